"""One dispatcher for every arkv-jax kernel: which implementation runs, and how.

Each kernel (paged chunk write, paged window attention) has a plain-XLA path, a Pallas TPU kernel
(Mosaic) and GPU paths. Callers pick one with a ``backend=`` string; the same string is valid for
both kernels:

============================  ==================================  ==============================
name                          window attention                    paged write
============================  ==================================  ==============================
``"auto"``                    see the table below                 ``"pallas_tpu"`` on TPU, the
                                                                  scatter write on GPU, ``"xla"``
                                                                  elsewhere
``"xla"``                     plain jnp/lax gather + dense        a loop of page updates (the
                              attention (the CPU default)         CPU default)
``"pallas_tpu"``              the Mosaic TPU kernel, compiled (TPU only)
``"pallas_tpu_interpret"``    the TPU kernel lowered to XLA by Pallas' generic interpreter
``"pallas_tpu_simulate"``     the TPU kernel under the TPU simulator: DMAs and semaphores emulated,
                              races detected, out-of-bounds reads raise (slow; small shapes only)
``"pallas_tpu_gather"``       the visible pages gathered by XLA,  the TPU kernel
                              then jax's splash attention,
                              compiled (TPU; the TPU kernel's
                              yardstick)
``"pallas_tpu_gather_interpret"``  the same, splash interpreted   the TPU kernel, interpreted
``"pallas_gpu"``              the Triton kernel, compiled         the Triton page copy, compiled
                              (NVIDIA GPU)                        (NVIDIA GPU)
``"pallas_gpu_interpret"``    the Triton kernels under Pallas' interpreter
``"cudnn_gather"``            gather the visible history, then    one XLA scatter of whole pages
                              cuDNN attention (NVIDIA GPU;        (any platform)
                              bf16/f16, ``head_dim % 8 == 0``,
                              ``head_dim <= 256``)
``"cudnn_gather_xla"``        the same gather and key layout      the same scatter
                              through jax's XLA attention (any
                              platform: CPU tests of that path)
``"pallas_mgpu"``             the Mosaic GPU kernel, compiled     the same scatter
                              (Hopper and later; bf16/f16,
                              ``head_dim`` a multiple of 64 up
                              to 256, pages a multiple of the key
                              tile)
============================  ==================================  ==============================

``"auto"`` for window attention on an NVIDIA GPU depends on the call's dtype and head dim (the
attention dispatcher passes them to :func:`resolve_backend`):

=====================================================  =====================
dtype and ``head_dim``                                 ``"auto"`` resolves to
=====================================================  =====================
bf16 or f16, ``head_dim % 8 == 0`` and ``<= 256``      ``"cudnn_gather"``
otherwise, ``head_dim`` a power of two ``>= 16``       ``"pallas_gpu"``
otherwise                                              ``"xla"``
=====================================================  =====================

On TPU ``"auto"`` is ``"pallas_tpu"``, elsewhere ``"xla"``.

Kernels take the resolved :class:`Backend`; the Pallas ones pass ``backend.interpret`` straight to
``pl.pallas_call(..., interpret=...)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

BACKEND_NAMES = (
    "auto",
    "xla",
    "pallas_tpu",
    "pallas_tpu_interpret",
    "pallas_tpu_simulate",
    "pallas_tpu_gather",
    "pallas_tpu_gather_interpret",
    "pallas_gpu",
    "pallas_gpu_interpret",
    "cudnn_gather",
    "cudnn_gather_xla",
    "pallas_mgpu",
)

GPU_PLATFORMS = ("gpu", "cuda")
"""Platform names of an NVIDIA GPU as ``jax.default_backend()`` and ``lowering_platforms`` spell
them."""

CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
"""Dtypes cuDNN attention takes."""

_KIND_OF = {"cudnn_gather_xla": "cudnn_gather", "pallas_tpu_interpret": "pallas_tpu",
            "pallas_tpu_simulate": "pallas_tpu", "pallas_tpu_gather": "pallas_tpu",
            "pallas_tpu_gather_interpret": "pallas_tpu", "pallas_gpu_interpret": "pallas_gpu"}


@dataclasses.dataclass(frozen=True)
class Backend:
    """A resolved backend choice.

    Attributes:
      name: the resolved name (never ``"auto"``), one of ``BACKEND_NAMES``.
      kind: which implementation runs: ``"xla"``, ``"pallas_tpu"``, ``"pallas_gpu"`` (Triton),
        ``"cudnn_gather"`` or ``"pallas_mgpu"`` (Mosaic GPU).
      interpret: the value for ``pl.pallas_call(interpret=...)``: ``False`` (compiled), ``True``
        (generic interpreter) or a ``pltpu.InterpretParams`` (TPU simulator); ``False`` for the
        non-Pallas kinds.
    """

    name: str
    kind: str
    interpret: Any


def tpu_simulator_params() -> Any:
    """The TPU simulator settings used by ``"pallas_tpu_simulate"``: race detection on,
    out-of-bounds reads raise, uninitialised memory reads as NaN."""
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.InterpretParams(
        detect_races=True, out_of_bounds_reads="raise", uninitialized_memory="nan"
    )


def cudnn_supports(dtype, head_dim: int) -> bool:
    """Whether cuDNN attention takes ``dtype`` and ``head_dim`` (bf16/f16, a multiple of 8 in
    ``[8, 256]``; jax itself rejects ``head_dim > 128`` before Hopper)."""
    return jnp.dtype(dtype) in CUDNN_DTYPES and head_dim % 8 == 0 and 8 <= head_dim <= 256


def auto_gpu_attention(dtype, head_dim: int) -> str:
    """The window-attention backend ``"auto"`` picks on an NVIDIA GPU (the module docstring's
    table)."""
    if cudnn_supports(dtype, head_dim):
        return "cudnn_gather"
    if head_dim >= 16 and not head_dim & (head_dim - 1):
        return "pallas_gpu"
    return "xla"


def resolve_backend(name: str = "auto", platform: str | None = None, *, dtype=None,
                    head_dim: int | None = None) -> Backend:
    """Turns a ``backend=`` string into a :class:`Backend`.

    Args:
      name: one of ``BACKEND_NAMES``.
      platform: the JAX platform to resolve ``"auto"`` for (``"cpu"``, ``"gpu"``, ``"tpu"``);
        defaults to ``jax.default_backend()``.
      dtype, head_dim: the window-attention call's dtype and head dim; with both given, ``"auto"``
        on a GPU follows the attention table of the module docstring. Without them it is
        ``"cudnn_gather"`` (the paged write runs its scatter under that name).

    Raises:
      ValueError: ``name`` is not a known backend.
    """
    if name not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {name!r}")
    if name == "auto":
        platform = platform or jax.default_backend()
        if platform == "tpu":
            name = "pallas_tpu"
        elif platform in GPU_PLATFORMS:
            name = ("cudnn_gather" if dtype is None or head_dim is None
                    else auto_gpu_attention(dtype, head_dim))
        else:
            name = "xla"
    kind = _KIND_OF.get(name, name)
    if name == "pallas_tpu_simulate":
        interpret: Any = tpu_simulator_params()
    else:
        interpret = name.endswith("_interpret")
    return Backend(name, kind, interpret)
