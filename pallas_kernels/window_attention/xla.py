"""Window attention in plain jnp/lax (the ``"xla"`` backend, the CPU default): gather the visible
history tokens through the page table, append the tail, dense attention with float32 softmax."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.layout import read_tokens
from pallas_kernels.window_attention.geometry import (
    WindowGeometry,
    history_token_slot,
    layer_page_table,
    tail_kv,
)


@functools.partial(jax.jit, static_argnames=("geom", "scale"))
def window_attention(q, k_cur, v_cur, extra_k, extra_v, k_pool, v_pool, pages, lengths, layer,
                     *, geom: WindowGeometry, scale: float):
    """Dense attention over the visible history of ``layer``, the current chunk and the extras.

    Arguments as :func:`pallas_kernels.window_attention.window_attention` (``layer`` an int32
    scalar, ``extra_k``/``extra_v`` possibly ``None``); ``geom`` from its static validation.

    History tokens ``t < capacity`` come from :func:`gather_history`: frame padding is never read
    or attended.

    The key mask rides in the matmul: keys get one extra feature (0 if valid, the dtype's most
    negative finite value, about ``-3.4e38``, if not) and queries a matching feature of 1, so masked
    logits leave the einsum at ``-3.4e38 * scale`` and no separate pass over the ``[q, k]`` logits
    is spent on masking. f16 is computed in f32 after the gather (its most negative value, -65504,
    is too small for this). Masked K and V slots are first replaced by zeros with ``jnp.where``, so
    NaN in them never reaches a product.
    """
    rows, dtype = geom.rows, (jnp.float32 if q.dtype == jnp.float16 else q.dtype)
    valid = history_valid(lengths, geom)

    def history(pool):
        return gather_history(pool, pages, lengths, layer, geom).astype(dtype)

    k_tail, v_tail = tail_kv(k_cur, v_cur, extra_k, extra_v, geom.tail_len)
    mask_feature = jnp.concatenate(
        [jnp.where(valid, 0, jnp.finfo(dtype).min).astype(dtype),
         jnp.zeros((rows, geom.tail_len), dtype)], axis=1)
    mask_feature = jnp.broadcast_to(mask_feature[:, :, None, None],
                                    (rows, geom.capacity + geom.tail_len, geom.kv_heads, 1))
    k = jnp.concatenate([history(k_pool), k_tail.astype(dtype)], axis=1)
    k = jnp.concatenate([k, mask_feature], axis=3)
    v = jnp.concatenate([history(v_pool), v_tail.astype(dtype)], axis=1)
    # GQA: fold each KV head's query heads into the query axis: [rows, group * q_len, kv_heads, D].
    grouped = (rows, geom.q_len, geom.kv_heads, geom.group, geom.head_dim)
    qg = q.astype(dtype).reshape(grouped).transpose(0, 3, 1, 2, 4).reshape(
        rows, geom.group * geom.q_len, geom.kv_heads, geom.head_dim)
    qg = jnp.concatenate([qg, jnp.ones((*qg.shape[:3], 1), dtype)], axis=3)
    logits = jnp.einsum("rqhd,rkhd->rhqk", qg, k, preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(logits * scale, axis=-1).astype(dtype)
    out = jnp.einsum("rhqk,rkhd->rqhd", probs, v, preferred_element_type=jnp.float32)
    out = out.reshape(rows, geom.group, geom.q_len, geom.kv_heads, geom.head_dim)
    return out.transpose(0, 2, 3, 1, 4).reshape(q.shape).astype(q.dtype)


def history_valid(lengths: jax.Array, geom: WindowGeometry) -> jax.Array:
    """bool ``[rows, capacity]``: whether history token ``t`` of each row is valid
    (``t < lengths[row]``)."""
    return jnp.arange(geom.capacity, dtype=jnp.int32)[None, :] < lengths.astype(jnp.int32)[:, None]


def gather_history(pool: jax.Array, pages: jax.Array, lengths: jax.Array, layer: jax.Array,
                   geom: WindowGeometry) -> jax.Array:
    """Each row's history tokens of ``layer`` as contiguous ``[rows, capacity, kv_heads, head_dim]``
    in the pool's dtype.

    Token ``t`` of row ``r`` is at ``[r, t]``, read straight from the layer (one gather through the
    page table, no layer copy) at page-list slot :func:`history_token_slot`, so frame padding is
    never read. Tokens at or past ``lengths[r]`` are zeros, by selection: NaN past a row's length,
    in frame padding or in pages the row does not use never appears. Page-list entries past a row's
    visible pages are replaced by the null page before the read. ``layer`` is an int32 scalar (may be
    traced).
    """
    table = layer_page_table(pages, lengths, 0, geom)
    slot = history_token_slot(jnp.arange(geom.capacity, dtype=jnp.int32), geom)
    page, offset = table[:, slot // geom.block_size], slot % geom.block_size
    return jnp.where(history_valid(lengths, geom)[:, :, None, None],
                     read_tokens(pool, layer, page, offset), jnp.zeros((), pool.dtype))
