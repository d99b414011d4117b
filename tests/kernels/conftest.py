"""Fixtures shared by the kernel tests (the JAX settings live in ``tests/conftest.py``)."""

from __future__ import annotations

import chex
import jax
import pytest

from benchmarks.gpu_compile import abstract_gpu


@pytest.fixture
def lower_for_device():
    """``lower(fn, args, platform) -> str``: the StableHLO text of ``jax.jit(fn)`` lowered for
    ``"tpu"`` or ``"cuda"`` from ``ShapeDtypeStruct`` arguments, without a device (nothing is
    compiled or run). On a machine without a GPU, ``"cuda"`` lowers for an abstract H200."""
    def lower(fn, args, platform: str) -> str:
        if platform != "cuda" or jax.default_backend() == "gpu":
            return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
        with abstract_gpu():  # jax >= 0.11 reads the GPU's properties from a (possibly abstract) device.
            return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()

    return lower


@pytest.fixture
def fresh_trace_counter():
    """Clears chex's trace counter, which is keyed by code and so shared across parameters."""
    chex.clear_trace_counter()
