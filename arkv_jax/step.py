"""The chunk step of one shard: what a forward needs from the cache, and the commit after it.

A chunk of ``F`` frames for a batch of rows runs in two pure, jittable halves around the forward:
:func:`prepare_chunk` reads the rows' visible window and allocates the chunk's pages in a *pending*
state, returning the forward's :class:`ChunkInputs`; :func:`commit_chunk` copies the clean K/V into
the chunk's pages (donate the pools for an in-place write) and commits the frames (advance + evict).
A failed forward drops the pending state: the state before :func:`prepare_chunk` is still valid and
nothing leaked. Batch rows with a negative row index are *padding* (:data:`PADDING`: no history,
frame 0, nothing written; ok), so a batch of fixed shape carries any subset of rows. Row indices
and page ids are local to the state and pools passed in; several devices run these per shard
(:mod:`arkv_jax.sharding`). See ``docs/functional-core.md``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from arkv_jax import state as core
from pallas_kernels.paged_write import write_chunk

Array = jax.Array


class ChunkInputs(NamedTuple):
    """Everything a forward of one chunk needs from the cache (a pytree of device arrays).

    ``B`` = rows of the batch, ``F`` = frames of the chunk. A batch row is one (session, KV branch)
    or a padding row: no history (null pages, length 0), frame 0, nothing to write.

    Attributes:
      rows: ``[B]`` int32 rows of the block-table state; -1 for padding rows.
      pages: ``[B, (sink + window) * pages_per_frame]`` int32 visible history pages (0 = none).
      lengths: ``[B]`` int32 valid history tokens behind ``pages``.
      history_frames: ``[B, sink + window]`` int32 absolute frame index of each visible history
        frame, -1 past the end (rotary positions).
      first_frame: ``[B]`` int32 absolute index of the chunk's first frame (its frames are
        ``first_frame + 0 .. F - 1``).
      write_pages: ``[B, F * pages_per_frame]`` int32 pages the commit writes the chunk into.
    """

    rows: Array
    pages: Array
    lengths: Array
    history_frames: Array
    first_frame: Array
    write_pages: Array


#: The field values of a padding batch row (row -1, no history, frame 0, nothing to write); the
#: cache's batches place rows with it (:mod:`arkv_jax.cache.batch`).
PADDING = ChunkInputs(rows=-1, pages=0, lengths=0, history_frames=-1, first_frame=0, write_pages=0)


def prepare_chunk(state: core.BlockTableState, rows: Array, num_frames: int
                  ) -> tuple[core.BlockTableState, ChunkInputs, Array]:
    """The bookkeeping before a forward of ``num_frames`` frames for ``rows``.

    Args:
      state: the committed state.
      rows: int32 ``[B]`` row indices; negative entries are padding rows.
      num_frames: frames of the chunk (static).

    Returns:
      ``(pending, inputs, ok)``: the state with the chunk's pages allocated, the forward's
      :class:`ChunkInputs` (the visible window is taken before the allocation) and ``ok`` ``[B]``
      (False where the pool could not hold the row's chunk; padding rows are ok).
    """
    rows = jnp.asarray(rows, jnp.int32)
    window = core.visible_window(state, rows, num_frames)
    pending, ok = core.allocate(state, rows, num_frames * state.layout.tokens_per_frame)
    padding = rows < 0
    first = jnp.where(padding, 0, core.computed_frames(state, jnp.maximum(rows, 0)))
    inputs = ChunkInputs(rows, window.pages, window.lengths, window.frame_ids, first,
                         core.write_pages(pending, rows, num_frames))
    return pending, inputs, ok | padding


def commit_chunk(k_pool: Array, v_pool: Array, pending: core.BlockTableState, inputs: ChunkInputs,
                 k_new: Array, v_new: Array, *, num_frames: int, backend: str = "auto"
                 ) -> tuple[Array, Array, core.BlockTableState, Array]:
    """Writes a chunk's clean K/V into its pages, then commits its frames (advance + evict).

    Args:
      k_pool, v_pool: pools of :func:`pallas_kernels.layout.pool_shape` (donate them in the
        caller's jit for an in-place write).
      pending: the state :func:`prepare_chunk` returned.
      inputs: the :class:`ChunkInputs` :func:`prepare_chunk` returned.
      k_new, v_new: ``[layers, B, num_frames * tokens_per_frame, kv_heads, head_dim]`` in the pool
        dtype; padding rows are not written.
      num_frames: frames of the chunk (static), as given to :func:`prepare_chunk`.
      backend: kernel backend of the page write (:mod:`pallas_kernels.backend`).

    Returns:
      ``(k_pool, v_pool, state, ok)``: the updated pools and committed state, ``ok`` ``[B]``
      (padding rows are ok).
    """
    k_pool, v_pool = write_chunk(k_pool, v_pool, k_new, v_new, inputs.write_pages,
                                 tokens_per_frame=pending.layout.tokens_per_frame, backend=backend)
    state, ok = core.commit(pending, inputs.rows, num_frames)
    return k_pool, v_pool, state, ok | (inputs.rows < 0)
