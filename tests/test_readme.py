"""The README's first lines, and the Python examples of the README and of ``docs/``, run as written."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))


def python_blocks(path: pathlib.Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def run_blocks(path: pathlib.Path) -> dict:
    """Executes every Python block of ``path`` in order, in one namespace; returns it."""
    namespace: dict = {}
    for block in python_blocks(path):
        exec(compile(block, str(path), "exec"), namespace)
    return namespace


def test_readme_starts_with_the_two_commands():
    first_block = re.search(r"```bash\n(.*?)```", README.read_text(), flags=re.S).group(1)
    assert "pip install -e . && arkv-jax demo" in first_block
    assert 'pip install -e ".[test]" && python -m pytest' in first_block


def test_readme_is_short_and_links_every_doc():
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    for doc in DOCS:
        assert f"docs/{doc.name}" in text, doc.name


@pytest.mark.slow
def test_readme_example_runs():
    namespace = run_blocks(README)
    rollout = namespace["rollout"]
    assert namespace["video"].shape == (13 * 2, 8, 12, 16) and set(rollout.traces_per_batch.values()) == {1}
    pixels = namespace["pixels"]
    assert pixels.shape == (1 + 4 * 25, 64, 96, 3) and -1.0 <= float(pixels.min()) < float(pixels.max()) <= 1.0


# What each document's examples must leave behind, beyond running.
CHECKS = {
    "protocol.md": lambda ns: ns["cache"].sessions == ("alice",),
    "rollout.md": lambda ns: ns["video"].shape[0] == 13 * 2 and set(ns["rollout"].traces_per_batch.values()) == {1},
    "functional-core.md": lambda ns: int(ns["st"].free_count) == 255,
    "sharding.md": lambda ns: (ns["rollout"].cache.num_shards == len(ns["rollout"].sessions)
                               == ns["jax"].device_count()
                               and all(len(ns["rollout"].latents(s)) == 2 for s in ns["rollout"].sessions)),
}


@pytest.mark.slow
@pytest.mark.parametrize("doc", [d for d in DOCS if python_blocks(d)], ids=lambda d: d.name)
def test_doc_examples_run(doc):
    namespace = run_blocks(doc)
    check = CHECKS.get(doc.name)
    assert check is None or check(namespace)


def test_every_doc_with_examples_is_checked():
    assert {d.name for d in DOCS if python_blocks(d)} >= set(CHECKS)
