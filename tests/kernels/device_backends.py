"""The compiled kernels as pytest parameters.

They run where their device is and are reported as skipped elsewhere (the CPU CI), so a run on an
NVIDIA GPU or a TPU (``benchmarks/device_check.sh``) puts them through the same tests as the
interpreters. Where a backend runs is the registry's answer
(:meth:`pallas_kernels.backend.Backend.runs_on`), not a list kept here.
"""

from __future__ import annotations

import jax
import pytest

from pallas_kernels.backend import resolve_backend

# jax >= 0.11 warns on every lowering of a Pallas Triton kernel (the pallas_gpu backend uses that
# lowering until it is ported to Mosaic GPU). The filter names the warning's own message, so every
# other DeprecationWarning still surfaces.
IGNORE_TRITON_DEPRECATION = pytest.mark.filterwarnings(
    "ignore:The Pallas Triton backend is deprecated:DeprecationWarning")


def skip_unless_here(backend: str) -> pytest.MarkDecorator:
    """A ``skipif`` mark: skipped unless ``backend`` runs on JAX's default platform (the
    registry's :meth:`~pallas_kernels.backend.Backend.runs_on`)."""
    resolved = resolve_backend(backend)
    return pytest.mark.skipif(not resolved.runs_on(jax.default_backend()),
                              reason=f"the compiled {backend} kernel needs {resolved.device}")


def compiled(backend: str, *values) -> object:
    """``pytest.param(backend, *values)``, skipped unless ``backend`` runs on JAX's default
    platform (:func:`skip_unless_here`)."""
    marks = [skip_unless_here(backend)]
    if backend == "pallas_gpu":
        marks.append(IGNORE_TRITON_DEPRECATION)
    return pytest.param(backend, *values, marks=marks)


COMPILED_BACKENDS = (compiled("pallas_gpu"), compiled("pallas_tpu"))
"""The compiled backends that take every case of the generic tests (any supported dtype, small
pages and head dims)."""

CUDNN_GATHER = compiled("cudnn_gather")
"""The cuDNN gather path, compiled: bf16/f16 cases with ``head_dim % 8 == 0`` only (and the
paged write's scatter under the same name, any case)."""

MOSAIC_GPU = compiled("pallas_mgpu")
"""The Mosaic GPU kernel, compiled: bf16/f16 cases with pages a multiple of 64 tokens and
``head_dim`` a multiple of 64 only."""
