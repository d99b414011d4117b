"""The ``arkv_jax`` package: lazy exports, what importing the core loads, the one glossary."""

import pathlib
import re
import subprocess
import sys

import pytest

import arkv_jax

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_python(code: str) -> None:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_facade_and_the_rollout_are_exported_lazily():
    run_python("import sys, arkv_jax; assert {'PagedKVCache', 'Rollout', 'Sampler'} <= set(arkv_jax.__all__) "
               "<= set(dir(arkv_jax)); assert 'arkv_jax.cache' not in sys.modules and 'flax' not in sys.modules")
    from arkv_jax.cache import PagedKVCache
    from arkv_jax.rollout import Rollout, Sampler

    assert (arkv_jax.PagedKVCache, arkv_jax.Rollout, arkv_jax.Sampler) == (PagedKVCache, Rollout, Sampler)
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = arkv_jax.no_such_name


def test_compat_loads_the_cross_attention_store_not_the_facade():
    run_python("import sys, arkv_jax.compat.vllm_omni; "
               "bad = [m for m in ('arkv_jax.cache.facade', 'arkv_jax.sharding', 'flax') if m in sys.modules]; "
               "assert not bad, bad")


GLOSSARY_TERMS = ("frame", "chunk", "page", "pool", "row", "session", "branch", "shard", "window", "sink",
                  "recache", "transaction", "seed")


def test_the_glossary_defines_each_term_once_and_only_there():
    glossary = (ROOT / "docs" / "glossary.md").read_text()
    defined = re.findall(r"^- \*\*(\w+)\*\*: \S", glossary, flags=re.M)
    for term in GLOSSARY_TERMS:
        assert defined.count(term) == 1, (term, defined)
    assert "docs/glossary.md" in arkv_jax.__doc__
    entries = [t for t in GLOSSARY_TERMS if re.search(rf"^{t}\n  \S", arkv_jax.__doc__, flags=re.M)]
    assert entries == [] and "Glossary" not in arkv_jax.__doc__, entries
