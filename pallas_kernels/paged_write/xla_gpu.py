"""The paged chunk write for NVIDIA GPUs in plain XLA: one scatter of whole pages per pool (run
under ``"auto"`` on GPU, ``"cudnn_gather"``, ``"cudnn_gather_xla"`` and ``"pallas_mgpu"``; it runs
on any platform).

The chunk is padded to whole pages and each page replaces pool page ``ids[i]`` in every layer and
head (:func:`pallas_kernels.layout.set_pages`); skipped ids are sent out of range and dropped
(``mode="drop"``), and ``unique_indices=True`` lets XLA:GPU store without atomics. A quantized
pool (:class:`pallas_kernels.layout.QuantizedPool`) gets the padded pages quantized first, one
scale per page of each layer and head, and its values and scales scattered alike. Semantics and
shapes: :func:`pallas_kernels.paged_write.write_chunk`; why a scatter on GPU rather than the
``xla`` loop: ``docs/kernels.md`` (Paged chunk write).
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.layout import pool_geometry, set_pages
from pallas_kernels.paged_write.reference import frame_pages


def write_chunk(k_pool, v_pool, k_frames, v_frames, ids, ppf: int):
    """``(k_pool, v_pool)`` with page ``i`` of the chunk written at page ``ids[i]`` (0 skips).

    ``k_frames``/``v_frames`` are the unpadded chunk as ``[L, R * F, T, H, D]``; ``ids`` flat int32
    ``[R * F * ppf]`` with skipped entries already 0; ``ppf`` pages per frame. The pools are arrays
    of the chunk's dtype or :class:`~pallas_kernels.layout.QuantizedPool` s (the chunk then in a
    compute dtype).
    """
    g = pool_geometry(k_pool)
    ids = jnp.where(ids == 0, g.num_pages, ids)  # Out of range: dropped by the scatter.

    def one(pool, frames):
        return set_pages(pool, ids, frame_pages(frames, g.block_size), mode="drop",
                         unique_indices=True)

    return one(k_pool, k_frames), one(v_pool, v_frames)
