"""The paged chunk write for NVIDIA GPUs in plain XLA: one scatter of whole pages per pool (run
under ``"auto"`` on GPU, ``"cudnn_gather"``, ``"cudnn_gather_xla"`` and ``"pallas_mgpu"``; it runs
on any platform).

The chunk is padded to whole pages and each page replaces pool page ``ids[i]`` in every layer and
head (:func:`pallas_kernels.layout.set_pages`); skipped ids are sent out of range and dropped
(``mode="drop"``), and ``unique_indices=True`` lets XLA:GPU store without atomics. Semantics and
shapes: :func:`pallas_kernels.paged_write.write_chunk`; why a scatter on GPU rather than the
``xla`` loop: ``docs/kernels.md`` (Paged chunk write).
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.layout import pool_geometry, set_pages


def write_chunk(k_pool, v_pool, k_frames, v_frames, ids, ppf: int):
    """``(k_pool, v_pool)`` with page ``i`` of the chunk written at page ``ids[i]`` (0 skips).

    ``k_frames``/``v_frames`` are the unpadded chunk as ``[L, R * F, T, H, D]``; ``ids`` flat int32
    ``[R * F * ppf]`` with skipped entries already 0; ``ppf`` pages per frame.
    """
    g = pool_geometry(k_pool)
    num_layers, num_pages, block_size = g.num_layers, g.num_pages, g.block_size
    kv_heads, head_dim = g.kv_heads, g.head_dim
    ids = jnp.where(ids == 0, num_pages, ids)  # Out of range: dropped by the scatter.
    pad = ppf * block_size - k_frames.shape[2]

    def one(pool, frames):
        frames = jnp.pad(frames, ((0, 0), (0, 0), (0, pad), (0, 0), (0, 0))) if pad else frames
        pages = frames.reshape(num_layers, -1, block_size, kv_heads, head_dim)
        return set_pages(pool, ids, pages, mode="drop", unique_indices=True)

    return one(k_pool, k_frames), one(v_pool, v_frames)
