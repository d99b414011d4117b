"""Pure-jnp reference of the paged chunk write, and the two rules every backend shares: the chunk
seen as frames, and which page ids are skipped (semantics: ``docs/kernels.md``, Paged chunk
write)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common import pages_per_frame
from pallas_kernels.layout import (
    PAGE_AXIS,
    SCALE_RANK,
    QuantizedPool,
    from_token_major,
    is_quantized_pool,
    page_mask,
    pool_geometry,
    quantize_pages,
)


def write_chunk_reference(
    k_pool: jax.Array,
    v_pool: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    page_ids: jax.Array,
    *,
    tokens_per_frame: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Pure-jnp reference of :func:`pallas_kernels.paged_write.write_chunk` (same arguments and
    skip semantics, no checks).

    Every pool page picks the chunk page whose valid id names it (a one-hot match of page ids
    against the page axis) or keeps its old bits: no scatter, no loop, ``O(P * R * F * ppf)``.
    Quantized pools (:class:`~pallas_kernels.layout.QuantizedPool`) get the chunk's pages quantized
    (:func:`~pallas_kernels.layout.quantize_pages`) and pick values and scales alike.
    """
    pool = pool_geometry(k_pool)
    num_pages, block_size = pool.num_pages, pool.block_size
    ids = valid_page_ids(page_ids, num_pages)
    match = (ids[None, :] == jnp.arange(num_pages, dtype=jnp.int32)[:, None]) & (ids[None, :] != 0)
    written = page_mask(match.any(axis=1))
    source = jnp.argmax(match, axis=1)
    tpf = block_size if tokens_per_frame is None else tokens_per_frame

    def pick(pool: jax.Array, pages: jax.Array, mask: jax.Array) -> jax.Array:
        return jnp.where(mask, jnp.take(pages, source, axis=PAGE_AXIS), pool)

    def one(pool, new: jax.Array):
        pages = from_token_major(chunk_to_pages(new, block_size, tpf))
        if not is_quantized_pool(pool):
            return pick(pool, pages, written)
        pages = quantize_pages(pages, pool.dtype)
        return QuantizedPool(pick(pool.values, pages.values, written),
                             pick(pool.scales, pages.scales, page_mask(match.any(axis=1), SCALE_RANK)))

    return one(k_pool, k_new), one(v_pool, v_new)


def chunk_frames(new: jax.Array, tokens_per_frame: int) -> jax.Array:
    """``[L, R, F * T, H, D]`` -> ``[L, R * F, T, H, D]`` (a free reshape)."""
    num_layers, rows, tokens, kv_heads, head_dim = new.shape
    return new.reshape(num_layers, rows * tokens // tokens_per_frame, tokens_per_frame, kv_heads,
                       head_dim)


def chunk_to_pages(new: jax.Array, block_size: int, tokens_per_frame: int) -> jax.Array:
    """``[L, R, F * T, H, D]`` -> ``[L, R * F * ppf, S, H, D]``, each frame's last page zero-padded
    (the reference's layout; the kernels read the unpadded chunk directly)."""
    return frame_pages(chunk_frames(new, tokens_per_frame), block_size)


def frame_pages(frames: jax.Array, block_size: int) -> jax.Array:
    """Frames ``[L, N, T, H, D]`` -> token-major pages ``[L, N * ppf, S, H, D]`` (``ppf =
    ceil(T / S)``), each frame's last page zero-padded: one pad of the chunk, then a free reshape."""
    num_layers, _, tokens_per_frame, kv_heads, head_dim = frames.shape
    pad = pages_per_frame(tokens_per_frame, block_size) * block_size - tokens_per_frame
    if pad:
        frames = jnp.pad(frames, ((0, 0), (0, 0), (0, pad), (0, 0), (0, 0)))
    return frames.reshape(num_layers, -1, block_size, kv_heads, head_dim)


def valid_page_ids(page_ids: jax.Array, num_pages: int) -> jax.Array:
    """Flat int32 page ids with every skipped entry (0 or out of ``[1, P)``) set to 0."""
    ids = page_ids.reshape(-1).astype(jnp.int32)
    return jnp.where((ids >= 1) & (ids < num_pages), ids, 0)
