"""Rules every kernel shares: integer rounding, frame-aligned pages, supported dtypes, input-check
helpers, the masked-logit value, the online-softmax step of the Pallas attention kernels and the
base-2 softmax constant of the GPU kernels.

A frame of ``tokens_per_frame`` tokens takes ``pages_per_frame(tokens_per_frame, block_size)``
consecutive pages of ``block_size`` slots; its last page ends in padding slots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
"""Pool and activation dtypes every kernel and backend accepts."""

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
"""Finite logit for masked keys: exp(MASK_VALUE - m) is exactly 0 and no inf - inf NaN can arise."""


LOG2_E = 1.4426950408889634
"""``log2(e)``: ``exp(x * scale) == exp2(x * scale * LOG2_E)`` (the GPU kernels' base-2 softmax)."""


def cdiv(a, b):
    """``ceil(a / b)`` for an integer ``a`` and a positive integer ``b`` (Python ints or int
    arrays; for arrays ``a`` must stay ``b - 1`` below the dtype's maximum)."""
    return (a + b - 1) // b


def round_up(a: int, b: int) -> int:
    """The smallest multiple of ``b`` that is ``>= a``."""
    return cdiv(a, b) * b


def is_power_of_two(value) -> bool:
    """Whether ``value`` is an int (not a bool) that is a positive power of two."""
    return (isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value > 0
            and not value & (value - 1))


def pages_per_frame(tokens_per_frame: int, block_size: int) -> int:
    """Pages one frame occupies: ``ceil(tokens_per_frame / block_size)``."""
    return cdiv(tokens_per_frame, block_size)


# ------------------------------------------------------------------------------------------------
# Input checks shared by the kernels' validators (host side, static: shapes and dtypes only)
# ------------------------------------------------------------------------------------------------


def check_rank(name: str, x, rank: int, layout: str = "") -> None:
    """Raises ``ValueError`` unless ``x`` has a ``shape`` of ``rank`` dimensions."""
    if not hasattr(x, "shape") or len(x.shape) != rank:
        got = getattr(x, "shape", type(x).__name__)
        layout = f" {layout}" if layout else ""
        raise ValueError(f"{name} must have rank {rank}{layout}, got shape {got}")


def check_supported_dtype(what: str, dtype) -> None:
    """Raises ``ValueError`` unless ``dtype`` is one of :data:`SUPPORTED_DTYPES`."""
    if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
        raise ValueError(f"{what} must be one of {[d.name for d in SUPPORTED_DTYPES]}, "
                         f"got {jnp.dtype(dtype).name}")


# ------------------------------------------------------------------------------------------------
# Online softmax (the Pallas TPU and GPU attention kernels)
# ------------------------------------------------------------------------------------------------


def matmul_precision(dtype) -> lax.Precision:
    """Full float32 products for f32 inputs (no TF32/bf16 passes); native for half types."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def online_softmax_step(m_prev: jax.Array, l_prev: jax.Array, acc_prev: jax.Array, q: jax.Array,
                        k: jax.Array, v: jax.Array, valid_row: jax.Array, valid_col: jax.Array,
                        scale: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One flash-attention update over a key block.

    Args:
      m_prev, l_prev: ``[bq, 1]`` f32 running max and normaliser; acc_prev ``[bq, D]`` f32.
      q: ``[bq, D]``; k, v: ``[bk, D]``; valid_row ``[1, bk]`` and valid_col ``[bk, 1]``: the same
        key mask in both orientations (masked keys may hold NaN: they are selected away, not
        multiplied).
      scale: the softmax scale, applied to the float32 logits.

    Returns:
      the updated ``(m, l, acc)``; start from ``(MASK_VALUE, 0, 0)`` and finish with ``acc / l``.
    """
    precision = matmul_precision(q.dtype)
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                        preferred_element_type=jnp.float32) * scale
    s = jnp.where(valid_row, s, MASK_VALUE)
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    p = jnp.where(valid_row, jnp.exp(s - m_new), 0.0)
    alpha = jnp.exp(m_prev - m_new)
    v = jnp.where(valid_col, v, jnp.zeros_like(v))
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)
    return m_new, alpha * l_prev + jnp.sum(p, axis=1, keepdims=True), alpha * acc_prev + pv
