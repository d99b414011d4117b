"""The paged chunk write in plain lax (the ``"xla"`` backend, the CPU default).

A ``fori_loop`` over the page ids: each step writes one whole page of every layer and head per pool
with a ``dynamic_update_slice`` under ``lax.cond`` (id 0 skips), transposing the token-major page
inside the loop body and building a frame's padded last page there. 16-bit pools move as uint16
bits, bitcast inside the body. A quantized pool (:class:`pallas_kernels.layout.QuantizedPool`)
gets each page's scales (one per layer and head) from a reduction over that page in the body
(padding slots are zeros and do not move a scale), and the page is quantized with them there (the
values and scales of :func:`pallas_kernels.layout.quantize_pages`, bit for bit, the values computed
as uint8 bits by :func:`pallas_kernels.quantization.to_stored_bits`: XLA:CPU converts to 8-bit
types and updates float8 arrays in place far slower) and scales are written in place the same
way. Semantics and shapes:
:func:`pallas_kernels.paged_write.write_chunk`;
why a loop and not a scatter, why the scales are reduced per page, and the other choices measured
on CPU: ``docs/kernels.md`` (Paged chunk write; Quantized pages).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.layout import PAGE_AXIS, QuantizedPool, from_token_major, is_quantized_pool, pool_geometry
from pallas_kernels.quantization import inverse_of, largest_magnitude, scale_of, to_stored_bits


def write_chunk(k_pool, v_pool, k_frames, v_frames, ids, ppf: int):
    """``(k_pool, v_pool)`` with page ``i`` of the chunk written at page ``ids[i]`` (0 skips).

    ``k_frames``/``v_frames`` are the unpadded chunk as ``[L, R * F, T, H, D]``; ``ids`` flat int32
    ``[R * F * ppf]`` with skipped entries already 0; ``ppf`` pages per frame. The pools are arrays
    of the chunk's dtype or :class:`~pallas_kernels.layout.QuantizedPool` s (the chunk then in a
    compute dtype, each page quantized as it is written).
    """
    quantized = is_quantized_pool(k_pool)
    pool = pool_geometry(k_pool)
    num_layers, block_size = pool.num_layers, pool.block_size
    kv_heads, head_dim = pool.kv_heads, pool.head_dim
    last_tokens = k_frames.shape[2] - (ppf - 1) * block_size
    chunk = (k_frames, v_frames)
    # Page index i >= 0: lax.div/rem (truncating) equal // and %, without their sign fix-ups.

    def page_at(frames, i):
        """Page ``i`` of the chunk in the pool's layout (one page of every layer and head), raw
        bits, zero-padded if a frame's last; quantized with its own scales (a one-page
        ``QuantizedPool``) for a quantized pool."""
        token_page = token_page_at(frames, i)
        if not quantized:
            return from_token_major(token_page)
        scale = scale_of(largest_magnitude(token_page, axes=(1, 2, 4)), k_pool.dtype)[..., None]
        values = from_token_major(token_page).astype(jnp.float32)
        # Values as raw bits: XLA:CPU converts to and moves float8 very slowly.
        return QuantizedPool(to_stored_bits(values, inverse_of(scale)[..., None, None], k_pool.dtype),
                             scale)

    def token_page_at(frames, i):
        """Page ``i`` of the chunk, ``[L, 1, S, H, D]`` (raw bits unless quantized)."""
        frame, j = lax.div(i, ppf), lax.rem(i, ppf)
        if frames.dtype.itemsize == 2 and not quantized:
            frames = lax.bitcast_convert_type(frames, jnp.uint16)

        def tokens(start, size):
            return lax.dynamic_slice(frames, (0, frame, start, 0, 0),
                                     (num_layers, 1, size, kv_heads, head_dim))

        if last_tokens == block_size:
            return tokens(j * block_size, block_size)
        last = jnp.pad(tokens((ppf - 1) * block_size, last_tokens),
                       ((0, 0), (0, 0), (0, block_size - last_tokens), (0, 0), (0, 0)))
        if ppf == 1:
            return last
        return jnp.where(j == ppf - 1, last, tokens(j * block_size, block_size))

    def body(i, pools):
        def write(pools):
            return tuple(_put_page(pool, page_at(frames, i), ids[i]) for pool, frames in zip(pools, chunk))
        return lax.cond(ids[i] != 0, write, lambda pools: pools, pools)

    return lax.fori_loop(0, ids.shape[0], body, (k_pool, v_pool))


def _put_page(pool, page, page_id: jax.Array):
    """``pool`` with ``page`` (one page of every layer and head in the pool's layout, or its raw
    uint16 bits for a 16-bit pool; for a :class:`QuantizedPool` a one-page ``QuantizedPool``)
    written at ``page_id`` on the page axis (a quantized page's scales at the same index of the
    scales)."""
    if is_quantized_pool(pool):
        return QuantizedPool(_put_page(pool.values, page.values, page_id),
                             lax.dynamic_update_slice_in_dim(pool.scales, page.scales, page_id,
                                                             axis=PAGE_AXIS))
    if page.dtype == pool.dtype:
        return lax.dynamic_update_slice_in_dim(pool, page, page_id, axis=PAGE_AXIS)
    bits = lax.bitcast_convert_type(pool, page.dtype)
    out = lax.dynamic_update_slice_in_dim(bits, page, page_id, axis=PAGE_AXIS)
    return lax.bitcast_convert_type(out, pool.dtype)
