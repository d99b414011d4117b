"""The README's first lines and its Python examples run as written."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_starts_with_the_two_commands():
    first_block = re.search(r"```bash\n(.*?)```", README.read_text(), flags=re.S).group(1)
    assert "pip install -e . && arkv-jax demo" in first_block
    assert 'pip install -e ".[test]" && pytest' in first_block


def test_readme_examples_run():
    namespace = {}
    blocks = python_blocks()
    assert len(blocks) >= 4
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
        if 'cache.close("bob")' in block:
            assert namespace["cache"].sessions == ("alice",)
        if "rollout.leave" in block:
            assert namespace["video"].shape[0] == 13 * 2 and namespace["rollout"].num_traces == 1
        if "mesh=mesh" in block:
            rollout = namespace["rollout"]
            assert rollout.cache.num_shards == len(rollout.sessions) == namespace["jax"].device_count()
            assert all(len(rollout.latents(s)) == 2 for s in rollout.sessions)
    assert int(namespace["st"].free_count) == 255
