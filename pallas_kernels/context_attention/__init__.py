"""Context attention: every query attends to all of a short, fully visible context (the text
cross-attention of a DiT over its session's cached text K/V).

:func:`context_attention` is the entry point (its docstring tables the shapes); it checks the call
and runs the ``backend=`` name's implementation from :data:`IMPLEMENTATIONS`: plain XLA
(:mod:`~pallas_kernels.context_attention.xla`, also the reference), a one-pass Mosaic TPU kernel
(:mod:`~pallas_kernels.context_attention.tpu`) and cuDNN's fused attention on NVIDIA GPUs. Design
and figures: ``docs/kernels.md`` (Context attention).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType

import jax

from pallas_kernels.backend import Backend, cudnn_supports, resolve_backend
from pallas_kernels.checks import require_int
from pallas_kernels.common import check_rank, check_same_dtype, check_supported_dtype
from pallas_kernels.context_attention import tpu, xla
from pallas_kernels.window_attention.validation import check_scale

__all__ = ["IMPLEMENTATIONS", "MAX_TPU_CONTEXT", "ContextGeometry", "context_attention", "static_validate_inputs"]

MAX_TPU_CONTEXT = 8192
"""Most context tokens the TPU kernel takes (it holds the whole context's K/V in VMEM)."""


@dataclasses.dataclass(frozen=True)
class ContextGeometry:
    """The static shape of one call: ``q`` ``[rows, q_len, num_q_heads, head_dim]`` over a context
    ``[rows, kv_len, kv_heads, head_dim]``."""

    rows: int
    q_len: int
    num_q_heads: int
    kv_heads: int
    head_dim: int
    kv_len: int

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.num_q_heads // self.kv_heads


def context_attention(q, k, v, *, scale=None, backend="auto", block_q=None):
    """Softmax attention of every query over every context token (no mask).

    =========  =================================================  ==============
    ``q``      ``[rows, q_len, num_q_heads, head_dim]``           f32, bf16, f16
    ``k, v``   ``[rows, kv_len, kv_heads, head_dim]``             ``q``'s dtype
    output     ``[rows, q_len, num_q_heads, head_dim]``           ``q``'s dtype
    =========  =================================================  ==============

    ``num_q_heads`` is a multiple of ``kv_heads`` (GQA: query head ``h`` reads KV head
    ``h // (num_q_heads // kv_heads)``). Logits, softmax and the accumulation are float32.

    Args:
      q, k, v: queries and the context's keys and values.
      scale: softmax scale, a positive float; defaults to ``head_dim ** -0.5``.
      backend: a name from :data:`pallas_kernels.backend.BACKEND_NAMES`. The TPU names run the
        Mosaic kernel (interpreted or simulated as the name says; ``kv_len`` at most
        :data:`MAX_TPU_CONTEXT`), the NVIDIA GPU names cuDNN's attention where it takes the dtype
        and head dim (else XLA), the others XLA.
      block_q: query rows per TPU grid step, a positive multiple of 8 (default
        :func:`~pallas_kernels.context_attention.tpu.default_block_q`); ignored elsewhere.

    Raises:
      TypeError: an input that is not an array, a static argument of the wrong type.
      ValueError: mismatched shapes or dtypes, an unknown backend, a bad ``scale`` or ``block_q``,
        a context too long for the TPU kernel.
    """
    resolved = resolve_backend(backend, dtype=getattr(q, "dtype", None), head_dim=None)
    geom = static_validate_inputs(q, k, v, scale=scale, backend=resolved, block_q=block_q)
    scale = geom.head_dim ** -0.5 if scale is None else float(scale)
    return IMPLEMENTATIONS[resolved.name](q, k, v, geom=geom, scale=scale, block_q=block_q, backend=resolved)


def static_validate_inputs(q, k, v, *, scale=None, backend: Backend, block_q=None) -> ContextGeometry:
    """The call's :class:`ContextGeometry`, or the error :func:`context_attention` raises."""
    check_rank("q", q, 4, "[rows, q_len, num_q_heads, head_dim]")
    check_rank("k", k, 4, "[rows, kv_len, kv_heads, head_dim]")
    check_rank("v", v, 4, "[rows, kv_len, kv_heads, head_dim]")
    check_supported_dtype("q.dtype", q.dtype)
    check_same_dtype("q", q.dtype, (("k", k), ("v", v)))
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v.shape must equal k.shape={tuple(k.shape)}, got {tuple(v.shape)}")
    rows, q_len, q_heads, dim = q.shape
    if k.shape[0] != rows or k.shape[3] != dim:
        raise ValueError(f"k.shape={tuple(k.shape)} must have q's rows ({rows}) and head_dim ({dim})")
    if min(q.shape) < 1 or min(k.shape) < 1:
        raise ValueError(f"every dimension of q and k must be positive, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if q_heads % k.shape[2]:
        raise ValueError(f"num_q_heads (q.shape[2] = {q_heads}) must be a multiple of kv_heads "
                         f"(k.shape[2] = {k.shape[2]})")
    if scale is not None:
        check_scale(scale)
    if block_q is not None:
        require_int("block_q", block_q, minimum=8, multiple_of=8, must="a positive multiple of 8")
    geom = ContextGeometry(rows, q_len, q_heads, k.shape[2], dim, k.shape[1])
    if backend.kind == "pallas_tpu" and geom.kv_len > MAX_TPU_CONTEXT:
        raise ValueError(f"kv_len (k.shape[1] = {geom.kv_len}) must be at most {MAX_TPU_CONTEXT} for the TPU "
                         "context-attention kernel (use backend='xla')")
    return geom


# The implementations of the registry, one signature (:data:`IMPLEMENTATIONS`).

def _xla(q, k, v, *, geom: ContextGeometry, scale: float, block_q, backend: Backend):
    return xla.attention(q, k, v, scale=scale)


def _pallas_tpu(q, k, v, *, geom: ContextGeometry, scale: float, block_q, backend: Backend):
    block_q = tpu.default_block_q(geom.q_len, geom.group, geom.kv_len) if block_q is None else block_q
    return tpu.context_attention(q, k, v, scale=scale, block_q=block_q, interpret=backend.interpret)


def _gpu(q, k, v, *, geom: ContextGeometry, scale: float, block_q, backend: Backend):
    if not cudnn_supports(q.dtype, geom.head_dim):
        return _xla(q, k, v, geom=geom, scale=scale, block_q=block_q, backend=backend)
    return jax.nn.dot_product_attention(q, k, v, scale=scale, implementation="cudnn")


IMPLEMENTATIONS: Mapping[str, Callable[..., jax.Array]] = MappingProxyType({
    "xla": _xla,
    "pallas_tpu": _pallas_tpu,
    "pallas_tpu_interpret": _pallas_tpu,
    "pallas_tpu_simulate": _pallas_tpu,
    "pallas_tpu_gather": _pallas_tpu,
    "pallas_tpu_gather_interpret": _pallas_tpu,
    "pallas_gpu": _gpu,
    "pallas_gpu_interpret": _xla,
    "cudnn_gather": _gpu,
    "cudnn_gather_xla": _xla,
    "pallas_mgpu": _gpu,
})
"""This kernel's table of the backend registry (:data:`pallas_kernels.backend.BACKENDS`, the same
names): backend name to implementation, called as ``impl(q, k, v, *, geom, scale, block_q,
backend)`` on validated inputs (``scale`` a float, ``backend`` the resolved
:class:`~pallas_kernels.backend.Backend`). The GPU names that run on a GPU take cuDNN; their
stand-ins on any platform take XLA."""
