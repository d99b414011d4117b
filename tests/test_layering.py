"""The import rules between layers (docs: architecture): checked on the source, without importing it.

- the kernels (``pallas_kernels``) import nothing from ``arkv_jax``;
- ``state`` and ``step`` never import ``sharding``, ``cache`` or ``nnx``;
- ``nnx`` and ``models`` never import ``cache``;
- ``compat`` never imports the cache facade (it uses the cross-attention store's validator);
- the planner imports no jax except inside the device-memory probe (``device_free_bytes``).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def imports(path: pathlib.Path, *, skip_function: str | None = None) -> set[str]:
    """Every module ``path`` imports (absolute names), optionally ignoring one function's body."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == skip_function:
            skipped |= {id(n) for n in ast.walk(node)}
    names = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def files(*parts: str) -> list[pathlib.Path]:
    base = ROOT.joinpath(*parts)
    return sorted(base.rglob("*.py")) if base.is_dir() else [base.with_suffix(".py")]


def violations(paths, forbidden: tuple[str, ...], **kw) -> list[str]:
    return [f"{p.relative_to(ROOT) if p.is_relative_to(ROOT) else p} imports {name}"
            for p in paths for name in sorted(imports(p, **kw))
            if any(name == f or name.startswith(f + ".") for f in forbidden)]


RULES = {
    "kernels import nothing of arkv_jax": (files("pallas_kernels"), ("arkv_jax",)),
    "state and step import no sharding, cache or nnx": (
        files("arkv_jax", "state") + files("arkv_jax", "step"),
        ("arkv_jax.sharding", "arkv_jax.sharded_kernels", "arkv_jax.cache", "arkv_jax.nnx")),
    "nnx and models import no cache": (files("arkv_jax", "nnx") + files("arkv_jax", "models"), ("arkv_jax.cache",)),
    "compat imports no cache facade": (files("arkv_jax", "compat"),
                                       ("arkv_jax.cache.facade", "arkv_jax.cache.programs",
                                        "arkv_jax.cache.PagedKVCache")),
}


@pytest.mark.parametrize("rule", sorted(RULES))
def test_import_rule(rule):
    paths, forbidden = RULES[rule]
    assert paths and all(p.exists() for p in paths)
    assert violations(paths, forbidden) == []


def test_planner_imports_jax_only_in_the_device_probe():
    planner = files("arkv_jax", "planner")
    assert violations(planner, ("jax",), skip_function="probe_free_memory") == []
    assert "jax" in imports(planner[0])  # the probe does import it: the rule is not vacuous


def test_the_rules_catch_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from arkv_jax.cache import PagedKVCache\nimport arkv_jax.nnx\n")
    assert len(violations([bad], ("arkv_jax.cache", "arkv_jax.nnx"))) == 3
