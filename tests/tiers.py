"""The fast tier (``python -m pytest -m "not slow"``): which cases of a parametrized test it keeps.

A test whose every case costs seconds on the 2-core CI machine is marked ``@pytest.mark.slow`` where
it is defined; a parametrized test keeps a few representative cases in the fast tier through
:func:`slow_except`. The whole suite (both tiers) runs in CI.
"""

from __future__ import annotations

import pytest


def slow_except(cases, fast):
    """``cases`` as parameters, all but those in ``fast`` marked slow. A case that is a tuple is
    unpacked into the parameter's values; a ``pytest.param`` (e.g. a compiled backend skipped off its
    device) is kept as it is."""
    def param(case):
        if isinstance(case, type(pytest.param(None))) or case in fast:
            return case
        return pytest.param(*(case if isinstance(case, tuple) else (case,)), marks=pytest.mark.slow)
    return [param(case) for case in cases]
