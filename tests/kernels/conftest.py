"""Fixtures shared by the kernel tests (the JAX settings live in ``tests/conftest.py``)."""

from __future__ import annotations

import chex
import jax
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

# The GPU that Triton lowering targets when this machine has none (jax >= 0.11 reads the GPU's
# properties from the device, or from an abstract one).
_ABSTRACT_GPU = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")


@pytest.fixture
def lower_for_device():
    """``lower(fn, args, platform) -> str``: the StableHLO text of ``jax.jit(fn)`` lowered for
    ``"tpu"`` or ``"cuda"`` from ``ShapeDtypeStruct`` arguments, without a device (nothing is
    compiled or run). On a machine without a GPU, ``"cuda"`` lowers for an abstract H200."""
    def lower(fn, args, platform: str) -> str:
        if platform != "cuda" or jax.default_backend() == "gpu":
            return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
        with use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=_ABSTRACT_GPU)):
            return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()

    return lower


@pytest.fixture
def fresh_trace_counter():
    """Clears chex's trace counter, which is keyed by code and so shared across parameters."""
    chex.clear_trace_counter()
