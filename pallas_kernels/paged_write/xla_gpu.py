"""The paged chunk write for NVIDIA GPUs in plain XLA: one scatter of whole pages per pool (run
under ``"auto"`` on GPU, ``"cudnn_gather"``, ``"cudnn_gather_xla"`` and ``"pallas_mgpu"``; it runs
on any platform).

The unpadded chunk ``[L, R * F, T, H, D]`` is padded to whole pages (``jnp.pad`` to ``ppf * S``
tokens per frame, then a free reshape to ``[L, R * F * ppf, S, H, D]``) and page ``i`` replaces
pool page ``ids[i]`` in every layer and head at once (:func:`pallas_kernels.layout.set_pages`: the
updates are transposed to the head-major layout, chunk-sized). Why one scatter and not the ``xla`` backend's loop of
``dynamic_update_slice``:

- A ``while`` loop on XLA:GPU launches its body's kernels once per iteration and reads the loop
  predicate back to the host every iteration: a chunk of ``R * F * ppf`` pages (156 at Wan's
  1,560-token frames on 128-token pages for 4 rows) would be that many dependent launches. The
  scatter is one op over all pages.
- Skipped ids (0) are sent out of range (``P``) and dropped by ``mode="drop"``: no ``lax.cond`` with
  an identity branch (which copy insertion may answer with a copy of the pool).
- ``unique_indices=True`` lets XLA:GPU store without atomics. Valid ids are distinct in a correct
  call (:func:`~pallas_kernels.paged_write.write_chunk` refuses repeated concrete ids); a page named
  twice under ``jit`` ends up holding one of its writes or a mix, the contract of ``write_chunk``.
  Each update is ``L * H`` runs of ``S * D`` contiguous elements.
- The frame padding feeds the scatter's updates; XLA:GPU may fuse it into the scatter or
  materialise the padded chunk (one extra pass over the chunk's bytes, never the pool's).

The bf16 upcast that makes a scatter O(pool) on XLA:CPU (see :mod:`.xla`) does not apply on GPU;
on CPU this path is still exact, so the CPU tests check it bit for bit against the reference.
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
