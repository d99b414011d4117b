"""The compiled Pallas kernels as pytest parameters.

They run where their device is and are reported as skipped elsewhere (the CPU CI), so a run on an
NVIDIA GPU or a TPU (``benchmarks/device_check.sh``) puts them through the same tests as the
interpreters.
"""

from __future__ import annotations

import jax
import pytest

_DEVICE_OF = {"pallas_gpu": ("gpu", "an NVIDIA GPU"), "pallas_tpu": ("tpu", "a TPU")}


def compiled(backend: str, *values) -> object:
    """``pytest.param(backend, *values)``, skipped unless JAX's default platform has the device."""
    platform, device = _DEVICE_OF[backend]
    skip = pytest.mark.skipif(jax.default_backend() != platform,
                              reason=f"the compiled {backend} kernel needs {device}")
    return pytest.param(backend, *values, marks=skip)


COMPILED_BACKENDS = (compiled("pallas_gpu"), compiled("pallas_tpu"))
