"""Window attention in plain jnp/lax (the ``"xla"`` backend, the CPU default): gather the visible
history tokens through the page table, put the tail in front, then a flash-style online softmax
over key blocks (float32 statistics) whose block size :func:`key_block` bounds. Quantized pools are
gathered at their stored width and dequantized to the compute dtype right after the gather (the
current chunk's K/V stay in the compute dtype). Semantics and
shapes: :func:`pallas_kernels.window_attention.window_attention`; memory bound: ``docs/kernels.md``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.common import cdiv, round_up
from pallas_kernels.layout import read_tokens, read_tokens_as
from pallas_kernels.window_attention.geometry import (
    WindowGeometry,
    history_token_slot,
    layer_page_table,
    tail_kv,
)

LOGITS_FLOOR_BYTES = 64 << 20
"""Logits-tile budget (bytes) below which :func:`key_block` never splits the keys."""

KEY_ALIGN = 128
"""Key blocks of a split key axis are multiples of this many keys (one TPU lane tile)."""


@functools.partial(jax.jit, static_argnames=("geom", "scale", "block_k"))
def window_attention(q, k_cur, v_cur, extra_k, extra_v, k_pool, v_pool, pages, lengths, layer,
                     *, geom: WindowGeometry, scale: float, block_k: int | None = None):
    """Attention over the visible history of ``layer``, the current chunk and the extras, as an
    online softmax over blocks of ``block_k`` keys.

    Arguments as :func:`pallas_kernels.window_attention.window_attention` (``layer`` an int32
    scalar, ``extra_k``/``extra_v`` possibly ``None``); ``geom`` from its static validation;
    ``block_k`` keys per block, default :func:`key_block` (tests pass small ones).

    Keys are ``[tail, padding, history]`` per row: the ``tail_len`` current-chunk and extra tokens
    (always valid) first, then masked zero keys up to a multiple of ``block_k`` keys in all, then
    the ``capacity`` history tokens from :func:`gather_history` (frame padding is never read or
    attended). Attention is order-invariant over keys, and block 0 always holds a valid key, so the
    running max is finite from the first block on: fully masked later blocks add ``exp(masked -
    max) = 0`` and no ``-inf - -inf`` arises, whatever the scale.

    The key mask rides in the matmul: keys get one extra feature (0 if valid, the dtype's most
    negative finite value, about ``-3.4e38``, if not) and queries a matching feature of 1, so masked
    logits leave the einsum at ``-3.4e38 * scale`` and no separate pass over the logits is spent on
    masking. f16 is computed in f32 after the gather (its most negative value, -65504, is too small
    for this). Masked K and V slots are zeros, selected with ``jnp.where``, so NaN in them never
    reaches a product. GQA folds each KV head's query heads into the query axis.

    Temporaries (one call; ``B`` = the compute dtype's bytes, f32 for f16): the gathered keys with
    their mask feature and values, ``rows * keys * kv_heads * (2 * head_dim + 1) * B`` with ``keys
    = round_up(tail_len + capacity, block_k)``; per key block the float32 logits and probabilities,
    ``rows * num_q_heads * q_len * block_k * 4`` bytes each (for the default ``block_k`` within
    ``max(kv_bytes(geom, dtype), LOGITS_FLOOR_BYTES)`` unless ``KEY_ALIGN`` keys alone exceed it,
    see :func:`key_block`); and the float32 ``[rows, num_q_heads, q_len, head_dim]`` accumulator.
    No logits array over the whole key axis is formed unless it fits in one block.
    """
    rows, dtype = geom.rows, compute_dtype(q.dtype)
    block_k = key_block(geom, dtype) if block_k is None else block_k
    head_len = round_up(geom.tail_len + geom.capacity, block_k) - geom.capacity
    k_tail, v_tail = tail_kv(k_cur, v_cur, extra_k, extra_v, head_len)
    valid = jnp.concatenate(
        [jnp.broadcast_to(jnp.arange(head_len) < geom.tail_len, (rows, head_len)),
         history_valid(lengths, geom)], axis=1)
    mask_feature = jnp.where(valid, 0, jnp.finfo(dtype).min).astype(dtype)[:, :, None, None]

    def keys_of(tail, pool):
        return jnp.concatenate(
            [tail.astype(dtype), gather_history(pool, pages, lengths, layer, geom, dtype)], axis=1)

    k = keys_of(k_tail, k_pool)
    k = jnp.concatenate([k, jnp.broadcast_to(mask_feature, (*k.shape[:3], 1))], axis=3)
    v = keys_of(v_tail, v_pool)
    # GQA: fold each KV head's query heads into the query axis: [rows, group * q_len, kv_heads, D].
    grouped = (rows, geom.q_len, geom.kv_heads, geom.group, geom.head_dim)
    qg = q.astype(dtype).reshape(grouped).transpose(0, 3, 1, 2, 4).reshape(
        rows, geom.group * geom.q_len, geom.kv_heads, geom.head_dim)
    qg = jnp.concatenate([qg, jnp.ones((*qg.shape[:3], 1), dtype)], axis=3)

    def step(b, carry):
        k_block = lax.dynamic_slice_in_dim(k, b * block_k, block_k, axis=1)
        v_block = lax.dynamic_slice_in_dim(v, b * block_k, block_k, axis=1)
        return online_softmax_update(carry, qg, k_block, v_block, scale)

    stats = (rows, geom.kv_heads, geom.group * geom.q_len)
    init = (jnp.full(stats, -jnp.inf, jnp.float32), jnp.zeros(stats, jnp.float32),
            jnp.zeros((*stats, geom.head_dim), jnp.float32))
    _, norm, acc = lax.fori_loop(0, k.shape[1] // block_k, step, init)
    out = (acc / norm[..., None]).reshape(
        rows, geom.kv_heads, geom.group, geom.q_len, geom.head_dim)
    return out.transpose(0, 3, 1, 2, 4).reshape(q.shape).astype(q.dtype)


def online_softmax_update(carry, qg: jax.Array, k: jax.Array, v: jax.Array, scale: float):
    """One online-softmax update of the running ``(max, sum, acc)`` over a block of keys.

    Args:
      carry: float32 ``max`` and ``sum`` ``[rows, kv_heads, gq]`` and ``acc`` ``[rows, kv_heads,
        gq, head_dim]`` (start from ``(-inf, 0, 0)``; the result is ``acc / sum``).
      qg: ``[rows, gq, kv_heads, head_dim + 1]`` GQA-folded queries with a mask feature of 1.
      k: ``[rows, block, kv_heads, head_dim + 1]`` keys with their mask feature; v: ``[rows, block,
        kv_heads, head_dim]`` values, as ``qg``'s dtype.
      scale: the softmax scale, applied to the float32 logits.

    Returns:
      the updated carry. The first block must hold a valid key for every row so that ``max`` is
      finite from then on. Probabilities are cast to ``v``'s dtype for the ``P @ V`` matmul, which
      accumulates in float32. Unlike :func:`pallas_kernels.common.online_softmax_step` (one
      ``[bq, bk]`` tile, masks selected on the logits), this is batched over rows and heads and the
      mask comes from the keys' mask feature.
    """
    m_prev, l_prev, acc_prev = carry
    s = jnp.einsum("rqhd,rkhd->rhqk", qg, k, preferred_element_type=jnp.float32) * scale
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=-1))
    p = jnp.exp(s - m_new[..., None])
    alpha = jnp.exp(m_prev - m_new)
    pv = jnp.einsum("rhqk,rkhd->rhqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m_new, alpha * l_prev + jnp.sum(p, axis=-1), alpha[..., None] * acc_prev + pv


def compute_dtype(dtype) -> jnp.dtype:
    """The dtype the XLA path computes in for inputs of ``dtype``: f32 for f16 (its most negative
    value is too small for the mask feature), else ``dtype``."""
    return jnp.dtype(jnp.float32) if jnp.dtype(dtype) == jnp.float16 else jnp.dtype(dtype)


def kv_bytes(geom: WindowGeometry, dtype) -> int:
    """Bytes of the K and V one call attends over, all rows, one layer: ``2 * rows * (tail_len +
    capacity) * kv_heads * head_dim`` elements of ``dtype``."""
    elements = 2 * geom.rows * (geom.tail_len + geom.capacity) * geom.kv_heads * geom.head_dim
    return elements * jnp.dtype(dtype).itemsize


def key_block(geom: WindowGeometry, dtype) -> int:
    """Keys per online-softmax block of :func:`window_attention` for compute dtype ``dtype``.

    The float32 logits tile, ``rows * num_q_heads * q_len * block * 4`` bytes, stays within
    ``max(kv_bytes(geom, dtype), LOGITS_FLOOR_BYTES)``: the whole key axis ``tail_len + capacity``
    in one block when it fits, else the fewest blocks of a multiple of :data:`KEY_ALIGN` keys that
    fit, sized evenly (at least ``KEY_ALIGN`` keys, even where that exceeds the budget).
    """
    keys = geom.tail_len + geom.capacity
    budget = max(kv_bytes(geom, dtype), LOGITS_FLOOR_BYTES)
    fit = budget // (geom.rows * geom.num_q_heads * geom.q_len * 4)
    if fit >= keys:
        return keys
    blocks = cdiv(keys, max(KEY_ALIGN, fit // KEY_ALIGN * KEY_ALIGN))
    return round_up(cdiv(keys, blocks), KEY_ALIGN)


def history_valid(lengths: jax.Array, geom: WindowGeometry) -> jax.Array:
    """bool ``[rows, capacity]``: whether history token ``t`` of each row is valid
    (``t < lengths[row]``)."""
    return jnp.arange(geom.capacity, dtype=jnp.int32)[None, :] < lengths.astype(jnp.int32)[:, None]


def gather_history(pool, pages: jax.Array, lengths: jax.Array, layer: jax.Array,
                   geom: WindowGeometry, dtype=None) -> jax.Array:
    """Each row's history tokens of ``layer`` as contiguous ``[rows, capacity, kv_heads, head_dim]``
    in ``dtype`` (default: the pool's dtype; a quantized pool needs one).

    Token ``t`` of row ``r`` is at ``[r, t]``, read straight from the layer (one gather through the
    page table, no layer copy) at page-list slot :func:`history_token_slot`, so frame padding is
    never read. Tokens at or past ``lengths[r]`` are zeros, by selection: NaN past a row's length,
    in frame padding or in pages the row does not use never appears. Page-list entries past a row's
    visible pages are replaced by the null page before the read. ``layer`` is an int32 scalar (may be
    traced). A :class:`~pallas_kernels.layout.QuantizedPool` is read at its stored width and
    dequantized after the gather (:func:`~pallas_kernels.layout.read_tokens_as`); a NaN scale of a
    page the row does not use is selected away like a NaN value.
    """
    table = layer_page_table(pages, lengths, 0, geom)
    slot = history_token_slot(jnp.arange(geom.capacity, dtype=jnp.int32), geom)
    page, offset = table[:, slot // geom.block_size], slot % geom.block_size
    tokens = (read_tokens(pool, layer, page, offset) if dtype is None
              else read_tokens_as(pool, layer, page, offset, dtype))
    return jnp.where(history_valid(lengths, geom)[:, :, None, None], tokens, jnp.zeros((), tokens.dtype))
