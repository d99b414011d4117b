"""The chunk's query/key prologue, the one rule the model and the attention kernels share: RMS
normalization (:func:`inverse_rms`, :func:`normalize`) and rotary embedding of adjacent feature
pairs (:func:`apply_rope`) in XLA, both at once (:func:`prepare_qk`), and :func:`rotate_rows` for a
``[tokens, head_dim]`` tile inside a kernel. The tables come from :func:`arkv_jax.nnx.rope_tables`;
``docs/kernels.md`` (Paged window attention) says where each is used.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import tpu as pltpu

Array = jax.Array


def apply_rope(x: Array, rope: tuple[Array, Array]) -> Array:
    """Rotates adjacent feature pairs ``(x[2i], x[2i+1])`` of ``x`` ``[B, N, H, D]`` by the angles of
    ``rope`` (``(cos, sin)``, each float32 ``[B, N, D]``); computed in float32, returned in ``x``'s
    dtype."""
    # Lane-wise: out = x cos + (x S) sin, where S swaps each pair's features and negates the first
    # (exact: one +-1 per column). A [..., D / 2, 2] view of the pairs would give XLA:TPU a minor
    # dimension of 2, a slow layout.
    cos, sin = (t[:, :, None, :] for t in rope)
    swapped = jnp.einsum("...d,de->...e", x, jnp.asarray(signed_pair_swap(x.shape[-1]), x.dtype),
                         precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return (x.astype(jnp.float32) * cos + swapped * sin).astype(x.dtype)


def inverse_rms(x: Array, eps: float) -> Array:
    """float32 ``[B, N]``: ``1 / sqrt(mean(x ** 2) + eps)`` over the features of ``x`` ``[B, N, F]``
    (computed in float32), as ``flax.nnx.RMSNorm`` normalizes."""
    x32 = x.astype(jnp.float32)
    return lax.rsqrt(jnp.mean(x32 * x32, axis=-1) + eps)


def normalize(x: Array, inv_rms: Array, gain: Array) -> Array:
    """RMS normalization of ``x`` ``[B, N, H, D]`` by its tokens' ``inv_rms`` ``[B, N]``
    (:func:`inverse_rms` over all ``H * D`` features) and the features' ``gain`` ``[H * D]``:
    ``x * (inv_rms * gain)`` in float32, in ``x``'s dtype (bit for bit ``flax.nnx.RMSNorm``)."""
    gain = gain.astype(jnp.float32).reshape(x.shape[-2:])
    return (x.astype(jnp.float32) * (inv_rms[:, :, None, None] * gain)).astype(x.dtype)


def prepare_qk(q: Array, k: Array, rope: tuple[Array, Array] | None = None,
               qk_norm: tuple[Array, Array, Array, Array] | None = None) -> tuple[Array, Array]:
    """``(q, k)`` normalized by ``qk_norm`` (``(q_inv_rms, k_inv_rms, q_gain, k_gain)``,
    :func:`normalize`), then rotated by ``rope`` (:func:`apply_rope`), each where given."""
    if qk_norm is not None:
        q_inv_rms, k_inv_rms, q_gain, k_gain = qk_norm
        q, k = normalize(q, q_inv_rms, q_gain), normalize(k, k_inv_rms, k_gain)
    if rope is not None:
        q, k = apply_rope(q, rope), apply_rope(k, rope)
    return q, k


def rotate_rows(x: Array, cos: Array, sin: Array, gain: Array | None = None) -> Array:
    """:func:`apply_rope` of one head's tile ``x`` ``[n, D]`` times ``gain`` ``[1, D]`` (where
    given) with its tables ``cos``/``sin`` ``[n, D]`` float32 (which may carry each token's inverse
    RMS), as a TPU kernel computes it: the pair swap is two lane rotations and a select (no MXU
    op); returned in ``x``'s dtype."""
    d = x.shape[-1]
    x32 = x.astype(jnp.float32)
    if gain is not None:
        x32 = x32 * gain
    even = lax.rem(lax.broadcasted_iota(jnp.int32, (1, d), 1), 2) == 0  # broadcast over rows
    following, preceding = pltpu.roll(x32, d - 1, 1), pltpu.roll(x32, 1, 1)  # x[c + 1], x[c - 1]
    swapped = jnp.where(even, -following, preceding)
    return (x32 * cos + swapped * sin).astype(x.dtype)


@functools.lru_cache(maxsize=None)
def signed_pair_swap(head_dim: int) -> np.ndarray:
    """``S`` ``[head_dim, head_dim]`` with ``(x S)[2i] = -x[2i+1]`` and ``(x S)[2i+1] = x[2i]``."""
    swap = np.zeros((head_dim, head_dim), np.float32)
    pairs = np.arange(0, head_dim, 2)
    swap[pairs + 1, pairs] = -1.0
    swap[pairs, pairs + 1] = 1.0
    return swap
