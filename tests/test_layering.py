"""The import rules between layers (docs: architecture): checked on the source, without importing it.

- the kernels (``pallas_kernels``) import nothing from ``arkv_jax``;
- ``state`` and ``step`` never import ``sharding``, ``cache`` or ``nnx``;
- ``nnx`` and ``models`` never import ``cache``;
- ``compat`` never imports the cache facade (it uses the cross-attention store's validator);
- the planner imports no jax except inside the device-memory probe (``device_free_bytes``);
- the exactness reference (``reference``) never imports the rollout it checks, nor the cache: it
  shares only the samplers and the text conditioning with it;
- ``samplers`` and ``conditioning`` import neither the rollout nor the cache;
- the rollout does no row arithmetic: it imports no row helpers (padding rows, row placement,
  row gathers) and pads, scatters and indexes no batch rows itself; the cache's steps do;
- the cache's modules are one job each: the transactions own their work (no ``on_write``,
  ``on_stage``, ``on_commit`` callback fields), only ``core`` holds the lock and the transaction
  in flight, only ``callbacks`` runs ``on_release``, and only ``batch`` places batch rows;
- the applications (``arkv_jax.apps``: the command line, the demo, ``generate``) sit above the
  library: nothing else in ``arkv_jax`` imports them, and importing the library loads no plotting,
  video or progress-bar package (checked on the source and in a fresh interpreter);
- the core's tests do not import ``compat``: only the compat tests do.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

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
    "reference imports no rollout and no cache": (files("arkv_jax", "reference"),
                                                  ("arkv_jax.rollout", "arkv_jax.cache", "arkv_jax.step")),
    "samplers and conditioning import no rollout and no cache": (
        files("arkv_jax", "samplers") + files("arkv_jax", "conditioning"), ("arkv_jax.rollout", "arkv_jax.cache")),
}


APPLICATION_PACKAGES = ("arkv_jax.apps", "matplotlib", "imageio", "imageio_ffmpeg", "tqdm")
RULES["the library imports no applications"] = (
    [p for p in files("arkv_jax") if "apps" not in p.relative_to(ROOT).parts], APPLICATION_PACKAGES)
RULES["only the compat tests import compat"] = (
    [p for p in files("tests") if not p.name.startswith("test_compat")], ("arkv_jax.compat",))

ROW_HELPERS = ("arkv_jax.sharded_kernels", "arkv_jax.step.PADDING", "arkv_jax.step.place_rows",
               "arkv_jax.cache.batch.BatchRows", "arkv_jax.cache.batch._place_inputs")
RULES["rollout imports no row helpers"] = (files("arkv_jax", "rollout"), ROW_HELPERS)


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


def test_the_rollout_does_no_row_arithmetic():
    """No padding, scattering or batch-row indexing in the rollout's source: ``jnp.pad``, ``.at[``
    updates, ``PADDING`` and ``positions`` subscripts belong to the cache's steps."""
    source = (ROOT / "arkv_jax" / "rollout.py").read_text()
    for pattern in ("jnp.pad(", ".at[", "PADDING", "positions]", "[positions", "full_batch is None"):
        assert pattern not in source, pattern


def _source(module: str) -> str:
    return (ROOT / "arkv_jax" / "cache" / f"{module}.py").read_text()


def test_each_cache_module_has_one_job():
    cache = sorted(p.stem for p in (ROOT / "arkv_jax" / "cache").glob("*.py"))
    assert {"batch", "callbacks", "chunk", "core", "facade", "layout", "recache", "recache_plan"} <= set(cache)
    for module in cache:
        source = _source(module)
        for field in ("on_write", "on_stage", "on_commit"):  # the transactions own their work
            assert field not in source, (module, field)
        if module != "core":
            assert "threading" not in source and "in_flight =" not in source, module
        if module != "callbacks":
            assert "except Exception" not in source, module  # only callbacks swallows callback errors
        if module not in ("batch", "cross_attention"):  # the store updates its tables' global rows
            assert ".at[" not in source and "jnp.pad(" not in source and "PADDING" not in source.replace(
                "step.PADDING", ""), module


def test_the_transactions_live_in_their_own_modules():
    from arkv_jax.cache.chunk import ChunkStep
    from arkv_jax.cache.core import Transaction
    from arkv_jax.cache.recache import Recache

    for transaction, module in ((ChunkStep, "arkv_jax.cache.chunk"), (Recache, "arkv_jax.cache.recache")):
        assert issubclass(transaction, Transaction) and transaction.__module__ == module
        assert callable(transaction.commit) and transaction._abort is not None


def test_importing_the_library_loads_no_application_package():
    modules = ("arkv_jax", "arkv_jax.cache", "arkv_jax.rollout", "arkv_jax.reference", "arkv_jax.nnx",
               "arkv_jax.sharding", "arkv_jax.compat.vllm_omni", "arkv_jax.models.dit", "arkv_jax.models.umt5",
               "arkv_jax.models.vae", "arkv_jax.models.loader", "pallas_kernels")
    code = (f"import importlib, sys; [importlib.import_module(m) for m in {modules!r}]; "
            f"loaded = sorted(m for m in sys.modules if m.split('.')[0] in {APPLICATION_PACKAGES[1:]!r} "
            "or m.startswith('arkv_jax.apps')); print(loaded)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


def test_no_library_class_is_over_300_lines():
    long = []
    for path in files("arkv_jax") + files("pallas_kernels"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 300:
                long.append(f"{path.name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert long == []
