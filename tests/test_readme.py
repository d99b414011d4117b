"""The README's Python examples run as written."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_examples_run():
    namespace = {}
    blocks = python_blocks()
    assert len(blocks) >= 3
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
    assert namespace["cache"].sessions == ("alice",)
    assert int(namespace["st"].free_count) == 255
