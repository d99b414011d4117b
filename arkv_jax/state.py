"""The block-table state: an immutable pytree and pure, jittable steps on it.

A :class:`BlockTableState` holds the compacted page table of every state row (one session x KV
branch) and the pool's FIFO free ring. The steps (:func:`begin`, :func:`allocate`, :func:`commit`,
:func:`end`, :func:`swap_pages`, :func:`evict`; read-only :func:`slot_mapping`, :func:`write_pages`,
:func:`resident_pages`, :func:`visible_window`, :func:`fresh_pages`) take a batch of row indices
(negative = padding), run as one jitted computation and return a new state and ``ok``: a row that
fails is left exactly as it was (:func:`swap_pages` is all or nothing). Nothing syncs with the host
or takes its shape from a value, so a window filling, sessions coming and going and a video of any
length never recompile; page ids and the free order are vLLM's ``BlockPool``'s. The state is a
registered dataclass pytree (:class:`StateLayout` static) that passes through ``jit``, ``shard_map``
and donation; this module needs nothing but JAX and applies :class:`~arkv_jax.config.WindowPolicy`'s
window rule (:attr:`StateLayout.window`). A row's layout and the free ring: ``docs/functional-core.md``.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from arkv_jax.config import CacheGeometry, WindowPolicy, ceil_div, pages_per_frame

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """Static facts about a state (hashable; part of the pytree's structure).

    Attributes:
      tokens_per_frame: tokens of one frame.
      block_size: tokens per page.
      sink_frames: leading frames never evicted.
      window_frames: recent frames kept after a commit (sliding mode).
      reset_at_boundary: reset mode (evict everything after the sink on each commit).
      table_width: pages a row's compacted table can hold.
      num_blocks: managed pages, null page 0 included.
    """

    tokens_per_frame: int
    block_size: int
    sink_frames: int
    window_frames: int
    reset_at_boundary: bool
    table_width: int
    num_blocks: int

    @property
    def pages_per_frame(self) -> int:
        """Pages of one frame: :func:`~arkv_jax.config.pages_per_frame`."""
        return pages_per_frame(self.tokens_per_frame, self.block_size)

    @property
    def sink_pages(self) -> int:
        return self.sink_frames * self.pages_per_frame

    @property
    def visible_frames(self) -> int:
        """Frames a forward can attend to: sink plus window (the current frames included)."""
        return self.sink_frames + self.window_frames

    @property
    def window(self) -> WindowPolicy:
        """The window policy whose rule the steps apply (:class:`~arkv_jax.config.WindowPolicy`)."""
        return WindowPolicy(self.window_frames, self.sink_frames, self.reset_at_boundary)

    @classmethod
    def from_config(cls, geometry: CacheGeometry, window: WindowPolicy, num_blocks: int,
                    table_width: int | None = None) -> "StateLayout":
        """A layout for ``num_blocks`` managed pages. The default table width holds sink + window
        frames, one forward in flight and one spare frame."""
        ppf = geometry.pages_per_frame
        if table_width is None:
            table_width = (window.resident_frames + geometry.frames_per_forward + 1) * ppf
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (the null page and one more), got {num_blocks}")
        if table_width < 1:
            raise ValueError(f"table_width must be positive, got {table_width}")
        return cls(geometry.tokens_per_frame, geometry.block_size, window.sink_frames,
                   window.window_frames, window.reset_at_boundary, int(table_width), int(num_blocks))


@dataclasses.dataclass(frozen=True)
class BlockTableState:
    """Page tables of ``R`` state rows and the pool's free ring. All leaves are int32/bool arrays.

    Attributes:
      tables: ``[R, table_width]`` compacted page ids per row (0 past ``num_pages``).
      num_pages: ``[R]`` pages stored in each row's table.
      evicted_pages: ``[R]`` pages evicted (and compacted away) from just after the sink.
      committed_frames: ``[R]`` frames committed since :func:`begin`.
      prefill_tokens: ``[R]`` prefix tokens counted as computed at :func:`begin`.
      active: ``[R]`` whether the row is in use.
      free_ids: ``[num_blocks - 1]`` ring buffer of free page ids.
      free_head: ``[]`` ring index of the next page to hand out.
      free_count: ``[]`` free pages in the ring.
      layout: static :class:`StateLayout`.
    """

    tables: Array
    num_pages: Array
    evicted_pages: Array
    committed_frames: Array
    prefill_tokens: Array
    active: Array
    free_ids: Array
    free_head: Array
    free_count: Array
    layout: StateLayout

    @property
    def num_rows(self) -> int:
        return self.tables.shape[0]

    @property
    def ring_size(self) -> int:
        return self.free_ids.shape[0]

    def replace(self, **changes) -> "BlockTableState":
        """A copy with the given fields replaced."""
        return dataclasses.replace(self, **changes)


jax.tree_util.register_dataclass(
    BlockTableState,
    data_fields=[f.name for f in dataclasses.fields(BlockTableState) if f.name != "layout"],
    meta_fields=["layout"])


class VisibleWindow(NamedTuple):
    """What a forward of ``num_current_frames`` new frames attends to in the pool (``B`` batch rows).

    Attributes:
      pages: ``[B, visible_frames * pages_per_frame]`` int32 page ids: the sink frames' pages, then
        the most recent history frames' pages, in time order; 0 (the null page) past the end.
      lengths: ``[B]`` int32 valid history tokens (visible frames x tokens_per_frame).
      frame_ids: ``[B, visible_frames]`` int32 absolute frame index of each visible history frame
        (counting prefill frames), -1 past the end: the positions for rotary embeddings.
    """

    pages: Array
    lengths: Array
    frame_ids: Array


def init_state(layout: StateLayout, num_rows: int) -> BlockTableState:
    """A state with ``num_rows`` inactive rows and every page but the null page free, in id order."""
    if num_rows < 1:
        raise ValueError(f"num_rows must be positive, got {num_rows}")
    def zeros():  # distinct buffers, so the whole state can be donated
        return jnp.zeros((num_rows,), jnp.int32)

    return BlockTableState(
        tables=jnp.zeros((num_rows, layout.table_width), jnp.int32),
        num_pages=zeros(), evicted_pages=zeros(), committed_frames=zeros(), prefill_tokens=zeros(),
        active=jnp.zeros((num_rows,), bool),
        free_ids=jnp.arange(1, layout.num_blocks, dtype=jnp.int32),
        free_head=jnp.zeros((), jnp.int32), free_count=jnp.asarray(layout.num_blocks - 1, jnp.int32),
        layout=layout,
    )


# ----------------------------------------------------------------------------------------------
# Small pure helpers (row batches, token <-> page arithmetic, ring pushes).


def _batch(state: BlockTableState, rows: Array, *values):
    """Normalises a row batch: ``rows`` int32 ``[B]`` (negative = padding), per-row ``values``
    broadcast to ``[B]``. Returns ``(safe_rows, valid, values...)``."""
    rows = jnp.asarray(rows, jnp.int32).reshape(-1)
    valid = (rows >= 0) & (rows < state.num_rows)
    safe = jnp.where(valid, rows, 0)
    return (safe, valid) + tuple(jnp.broadcast_to(jnp.asarray(v, jnp.int32), rows.shape) for v in values)


def _scatter_rows(array: Array, rows: Array, keep: Array, values: Array) -> Array:
    """``array[rows] = values`` for rows where ``keep``; other rows untouched."""
    target = jnp.where(keep, rows, array.shape[0])
    return array.at[target].set(values.astype(array.dtype), mode="drop")


def _pages_for_tokens(layout: StateLayout, tokens: Array) -> Array:
    """Pages that hold the first ``tokens`` tokens of a row (frame-aligned)."""
    tpf = layout.tokens_per_frame
    return (tokens // tpf) * layout.pages_per_frame + ceil_div(tokens % tpf, layout.block_size)


def _committed_tokens_pages(state: BlockTableState, rows: Array, extra_tokens: Array = 0) -> Array:
    """Absolute pages needed for a row's committed tokens plus ``extra_tokens`` more.

    Computed as ``committed_frames * ppf + pages(prefill + extra)`` so that long videos never
    overflow int32 token counts.
    """
    layout = state.layout
    return (state.committed_frames[rows] * layout.pages_per_frame
            + _pages_for_tokens(layout, state.prefill_tokens[rows] + extra_tokens))


def _stored_index(state: BlockTableState, rows: Array, absolute_page: Array) -> Array:
    """Index into a row's compacted table of an absolute page index (past the sink, shifted by the
    evicted pages)."""
    evicted = state.evicted_pages[rows][..., None] if absolute_page.ndim > 1 else state.evicted_pages[rows]
    return jnp.where(absolute_page >= state.layout.sink_pages, absolute_page - evicted, absolute_page)


def _push_free(state: BlockTableState, counts: Array, order: Array, values: Array) -> BlockTableState:
    """Appends pages to the free ring's tail, rows in batch order.

    Args:
      counts: ``[B]`` pages each row frees.
      order: ``[B, K]`` position of each candidate within its row's pushes (valid where < counts).
      values: ``[B, K]`` page ids.
    """
    offsets = jnp.cumsum(counts) - counts
    tail = state.free_head + state.free_count
    valid = (order >= 0) & (order < counts[:, None])
    slot = (tail + offsets[:, None] + order) % state.ring_size
    slot = jnp.where(valid, slot, state.ring_size)
    free_ids = state.free_ids.at[slot].set(values, mode="drop", unique_indices=True)
    return state.replace(free_ids=free_ids, free_count=state.free_count + jnp.sum(counts))


def _serve_in_row_order(demand: Array, eligible: Array, free: Array, released: Array) -> Array:
    """Which rows get their ``demand`` pages, serving rows in order as vLLM serves successive
    requests: row ``b`` first releases ``released[b]`` pages, then takes its demand if it fits in
    what is left; a row that does not fit fails and later rows are still served if they fit. The
    common case (everything fits) is one vector comparison; the sequential pass runs only when the
    pool is short."""
    wanted = jnp.where(eligible, demand, 0)

    def sequential(_):
        def step(left, row):
            need, ok, back = row
            left = left + back
            ok = ok & (need <= left)
            return left - jnp.where(ok, need, 0), ok

        return jax.lax.scan(step, free, (demand, eligible, released))[1]

    fits = jnp.all(jnp.cumsum(wanted) <= free + jnp.cumsum(released))
    return jax.lax.cond(fits, lambda _: eligible, sequential, None)


def _empty_rows(state: BlockTableState, rows: Array, ok: Array, prefill: Array, active: bool
                ) -> BlockTableState:
    """Rows where ``ok`` get an empty table, zero counters, ``prefill`` tokens and ``active``."""
    zero = jnp.zeros_like(rows)
    return state.replace(
        tables=_scatter_rows(state.tables, rows, ok, jnp.zeros((rows.shape[0], state.layout.table_width))),
        num_pages=_scatter_rows(state.num_pages, rows, ok, zero),
        evicted_pages=_scatter_rows(state.evicted_pages, rows, ok, zero),
        committed_frames=_scatter_rows(state.committed_frames, rows, ok, zero),
        prefill_tokens=_scatter_rows(state.prefill_tokens, rows, ok, prefill),
        active=_scatter_rows(state.active, rows, ok, jnp.full_like(ok, active)),
    )


def computed_frames(state: BlockTableState, rows: Array) -> Array:
    """Whole frames computed per row (committed frames plus whole prefill frames): the absolute
    index of the row's next frame. ``rows`` must be valid row indices."""
    return state.committed_frames[rows] + state.prefill_tokens[rows] // state.layout.tokens_per_frame


def _evict(state: BlockTableState, rows: Array, ok: Array, first_frames: Array, all_frames: Array
           ) -> tuple[BlockTableState, Array]:
    """Evicts frames just after the sink and compacts the tables.

    Frames ``[evicted, first_frames)`` (after the sink) are freed first, highest table index first,
    then frames ``[first_frames, all_frames)`` one frame at a time in time order, each frame's pages
    highest index first: the order vLLM frees them in when one eviction catches up several frames and
    each later frame's commit evicts one.

    Args:
      rows, ok: ``[B]`` the batch and which rows to touch.
      first_frames, all_frames: ``[B]`` frames after the sink evicted after the first and after the
        last step (``evicted <= first_frames <= all_frames``).

    Returns:
      ``(state, freed)``: ``freed[b]`` pages pushed to the free ring.
    """
    layout = state.layout
    ppf = layout.pages_per_frame
    before = state.evicted_pages[rows]
    first = first_frames * ppf - before
    freed = jnp.where(ok, all_frames * ppf - before, 0)
    d = jnp.arange(layout.table_width)[None, :]
    later = d - first[:, None]
    order = jnp.where(later < 0, first[:, None] - 1 - d,
                      first[:, None] + later // ppf * ppf + (ppf - 1 - later % ppf))
    tables = state.tables[rows]
    evicted = jnp.take_along_axis(tables, jnp.minimum(layout.sink_pages + d, layout.table_width - 1), axis=1)
    state = _push_free(state, freed, order, evicted)
    kept = jnp.take_along_axis(tables, jnp.minimum(d + freed[:, None], layout.table_width - 1), axis=1)
    kept = jnp.where(d + freed[:, None] < layout.table_width, kept, 0)
    compacted = jnp.where(d < layout.sink_pages, tables, kept)
    return state.replace(
        tables=_scatter_rows(state.tables, rows, ok, compacted),
        num_pages=_scatter_rows(state.num_pages, rows, ok, state.num_pages[rows] - freed),
        evicted_pages=_scatter_rows(state.evicted_pages, rows, ok, before + freed),
    ), freed


def _catch_up_eviction(state: BlockTableState, rows: Array, ok: Array) -> tuple[BlockTableState, Array]:
    """Evicts frames already out of the window but not yet evicted because their pages were not
    allocated at commit time (only after a prefill longer than the window), as vLLM does before
    every allocation. A no-op otherwise. Returns ``(state, freed pages per row)``."""
    return _evict_up_to(state, rows, ok, state.layout.window.skipped_frames(computed_frames(state, rows)))


def _evict_up_to(state: BlockTableState, rows: Array, ok: Array, frames: Array
                 ) -> tuple[BlockTableState, Array]:
    """Evicts rows ``ok`` up to ``frames`` frames after the sink, clipped to the frames whose pages
    are all in the table (as vLLM clips its skipped range) and never below what is already evicted.
    Returns ``(state, freed pages per row)``."""
    layout = state.layout
    ppf = layout.pages_per_frame
    before = state.evicted_pages[rows] // ppf
    allocated_after_sink = (state.num_pages[rows] + state.evicted_pages[rows]) // ppf - layout.sink_frames
    target = jnp.maximum(before, jnp.minimum(frames, allocated_after_sink))
    return _evict(state, rows, ok, target, target)


# ----------------------------------------------------------------------------------------------
# Lifecycle and per-chunk steps.


def begin(state: BlockTableState, rows: Array, prefill_tokens: Array = 0
          ) -> tuple[BlockTableState, Array]:
    """Starts rows with empty tables and ``prefill_tokens`` already computed (no pages allocated).

    Args:
      rows: ``[B]`` int32 row indices (negative = padding).
      prefill_tokens: ``[B]`` or scalar, >= 0.

    Returns:
      ``(state, ok)``: ``ok[b]`` is False for padding, an already active row, or a negative prefill.
    """
    rows, valid, prefill = _batch(state, rows, prefill_tokens)
    ok = valid & ~state.active[rows] & (prefill >= 0)
    return _empty_rows(state, rows, ok, prefill, active=True), ok


def allocate(state: BlockTableState, rows: Array, num_tokens: Array) -> tuple[BlockTableState, Array]:
    """Allocates pages for ``num_tokens`` in-flight tokens per row, token-granular like vLLM.

    New pages per row = ``pages(computed + num_tokens) - pages already allocated`` (never negative),
    so asking twice for the same span allocates nothing more. Pages come from the free ring's head,
    rows in batch order. Like vLLM, a row first evicts frames that are out of the window but still
    held (possible only after a prefill longer than the window); that happens even if the row's
    allocation then fails.

    Args:
      rows: ``[B]`` int32 row indices (negative = padding).
      num_tokens: ``[B]`` or scalar, > 0.

    Returns:
      ``(state, ok)``: ``ok[b]`` is False (and the row untouched) for padding, an inactive row,
      ``num_tokens <= 0``, a table that would overflow ``table_width``, or a pool without enough
      free pages for that row.
    """
    layout = state.layout
    rows, valid, num_tokens = _batch(state, rows, num_tokens)
    free_before = state.free_count
    state, released = _catch_up_eviction(state, rows, valid & state.active[rows] & (num_tokens > 0))
    stored = state.num_pages[rows]
    demand = jnp.maximum(0, _committed_tokens_pages(state, rows, num_tokens)
                         - stored - state.evicted_pages[rows])
    eligible = valid & state.active[rows] & (num_tokens > 0) & (stored + demand <= layout.table_width)
    ok = _serve_in_row_order(demand, eligible, free_before, released)
    taken = jnp.where(ok, demand, 0)
    offsets = jnp.cumsum(taken) - taken
    column = jnp.arange(layout.table_width)[None, :] - stored[:, None]
    fill = (column >= 0) & (column < taken[:, None])
    ring_slot = (state.free_head + offsets[:, None] + column) % state.ring_size
    table = jnp.where(fill, state.free_ids[ring_slot], state.tables[rows])
    total = jnp.sum(taken)
    return state.replace(
        tables=_scatter_rows(state.tables, rows, ok, table),
        num_pages=_scatter_rows(state.num_pages, rows, ok, stored + taken),
        free_head=(state.free_head + total) % state.ring_size,
        free_count=state.free_count - total,
    ), ok


def commit(state: BlockTableState, rows: Array, num_frames: Array) -> tuple[BlockTableState, Array]:
    """Commits ``num_frames`` frames per row, evicting after each one with vLLM-Omni's rule.

    Sliding mode keeps the sink and the last ``window_frames`` frames; reset mode keeps only the
    sink. Pages evicted after one frame are freed highest table index first, frame after frame,
    rows in batch order; the table is compacted.

    Args:
      rows: ``[B]`` int32 row indices (negative = padding).
      num_frames: ``[B]`` or scalar, >= 0.

    Returns:
      ``(state, ok)``: ``ok[b]`` is False (and the row untouched) for padding, an inactive row, a
      negative count, or frames whose pages were not allocated.
    """
    layout = state.layout
    rows, valid, num_frames = _batch(state, rows, num_frames)
    allocated = state.num_pages[rows] + state.evicted_pages[rows]
    ok = (valid & state.active[rows] & (num_frames >= 0)
          & (_committed_tokens_pages(state, rows, num_frames * layout.tokens_per_frame) <= allocated))
    frames = computed_frames(state, rows)
    before = state.evicted_pages[rows] // layout.pages_per_frame
    # Eviction is monotone: the first frame may catch up several frames (after a long prefill),
    # later frames evict at most one frame each.
    first = jnp.maximum(before, layout.window.skipped_frames(frames + 1))
    last = jnp.maximum(before, layout.window.skipped_frames(frames + num_frames))
    state, _ = _evict(state, rows, ok & (num_frames > 0), first, last)
    return state.replace(
        committed_frames=_scatter_rows(state.committed_frames, rows, ok,
                                       state.committed_frames[rows] + num_frames),
    ), ok


def end(state: BlockTableState, rows: Array) -> tuple[BlockTableState, Array]:
    """Finishes rows: every page they hold goes back to the free ring (each table in reverse, rows
    in batch order) and the rows become inactive.

    Returns:
      ``(state, ok)``: ``ok[b]`` is False for padding or an inactive row (nothing happens to it).
    """
    layout = state.layout
    rows, valid = _batch(state, rows)
    ok = valid & state.active[rows]
    counts = jnp.where(ok, state.num_pages[rows], 0)
    d = jnp.arange(layout.table_width)[None, :]
    state = _push_free(state, counts, counts[:, None] - 1 - d, state.tables[rows])
    return _empty_rows(state, rows, ok, jnp.zeros_like(rows), active=False), ok


def _fresh_ids(state: BlockTableState, rows: Array, replace: Array) -> tuple[Array, Array, Array, Array]:
    """The pages the next pops of the free ring give the marked table positions, rows in batch order
    and positions in table order. Returns ``(rows, marks, fresh, ok)``: the safe rows, the marks
    ``[B, table_width]`` (none on padding rows), the fresh ids there (0 elsewhere) and ``ok`` (scalar:
    every marked row is active with its marks on stored pages, and the ring holds every fresh page)."""
    rows, valid = _batch(state, rows)
    marks = jnp.asarray(replace, bool) & valid[:, None]
    stored = jnp.arange(state.layout.table_width)[None, :] < state.num_pages[rows][:, None]
    counts = jnp.sum(marks, axis=1, dtype=jnp.int32)
    fits = ~jnp.any(marks, axis=1) | (state.active[rows] & ~jnp.any(marks & ~stored, axis=1))
    ok = jnp.all(fits) & (jnp.sum(counts) <= state.free_count)
    rank = (jnp.cumsum(counts) - counts)[:, None] + jnp.cumsum(marks, axis=1) - 1
    fresh = jnp.where(marks, state.free_ids[(state.free_head + rank) % state.ring_size], 0)
    return rows, marks, fresh, ok


def fresh_pages(state: BlockTableState, rows: Array, replace: Array) -> Array:
    """int32 ``[B, table_width]``: the page :func:`swap_pages` would give each marked position (0
    elsewhere): pages that are free now, so K/V can be written into them before the swap."""
    return _fresh_ids(state, rows, replace)[2]


def swap_pages(state: BlockTableState, rows: Array, replace: Array) -> tuple[BlockTableState, Array]:
    """Gives the marked table positions of each row fresh pages and frees the pages they held: the
    page-level half of a K/V recompute (write the new K/V into :func:`fresh_pages` first, then swap).
    Frame counts, eviction and every unmarked position are unchanged.

    Fresh pages come from the free ring's head, rows in batch order and positions in table order;
    the replaced pages go to the ring's tail in the same order.

    Args:
      rows: ``[B]`` int32 row indices (negative = padding: never marked).
      replace: bool ``[B, table_width]``: the positions of each row's table to give fresh pages.

    Returns:
      ``(state, ok)``, all or nothing: ``ok`` (scalar) is False, and the state unchanged, if a
      marked row is inactive or has marks past its stored pages, or the ring holds fewer free pages
      than there are marks.
    """
    rows, marks, fresh, ok = _fresh_ids(state, rows, replace)
    marks = marks & ok
    counts = jnp.sum(marks, axis=1, dtype=jnp.int32)
    total = jnp.sum(counts)
    popped = state.replace(free_head=(state.free_head + total) % state.ring_size,
                           free_count=state.free_count - total)
    old = state.tables[rows]
    freed = _push_free(popped, counts, jnp.where(marks, jnp.cumsum(marks, axis=1) - 1, -1), old)
    tables = _scatter_rows(state.tables, rows, jnp.any(marks, axis=1), jnp.where(marks, fresh, old))
    return freed.replace(tables=tables), ok


# ----------------------------------------------------------------------------------------------
# Read-only views.


def num_free_pages(state: BlockTableState) -> Array:
    """Free pages in the pool (int32 scalar)."""
    return state.free_count


def free_queue(state: BlockTableState) -> Array:
    """The free ring in queue order, head first: ``[num_blocks - 1]`` int32, 0 past ``free_count``."""
    index = (state.free_head + jnp.arange(state.ring_size)) % state.ring_size
    return jnp.where(jnp.arange(state.ring_size) < state.free_count, state.free_ids[index], 0)


def resident_pages(state: BlockTableState, rows: Array) -> tuple[Array, Array]:
    """Pages each row holds, in table order, null page excluded.

    Returns:
      ``(pages, counts)``: ``[B, table_width]`` int32 (0 past ``counts``) and ``[B]`` int32.
    """
    rows, valid = _batch(state, rows)
    counts = jnp.where(valid, state.num_pages[rows], 0)
    pages = jnp.where(jnp.arange(state.layout.table_width)[None, :] < counts[:, None], state.tables[rows], 0)
    return pages, counts


def slot_mapping(state: BlockTableState, rows: Array, num_tokens: int) -> Array:
    """Flat pool slots (``page * block_size + offset``) of each row's next ``num_tokens`` tokens.

    Args:
      num_tokens: static count of in-flight tokens.

    Returns:
      ``[B, num_tokens]`` int32; -1 for padding rows and for tokens without an allocated page.
    """
    layout = state.layout
    rows, valid = _batch(state, rows)
    token = state.prefill_tokens[rows][:, None] + jnp.arange(num_tokens)[None, :]
    in_frame = token % layout.tokens_per_frame
    absolute = ((state.committed_frames[rows][:, None] + token // layout.tokens_per_frame)
                * layout.pages_per_frame + in_frame // layout.block_size)
    index = _stored_index(state, rows, absolute)
    present = valid[:, None] & (index < state.num_pages[rows][:, None])
    page = jnp.take_along_axis(state.tables[rows], jnp.clip(index, 0, layout.table_width - 1), axis=1)
    return jnp.where(present, page * layout.block_size + in_frame % layout.block_size, -1)


def write_pages(state: BlockTableState, rows: Array, num_frames: int) -> Array:
    """Pages of each row's next ``num_frames`` frames (the commit target), frame after frame.

    Rows must be frame-aligned (no partial prefill frame).

    Args:
      num_frames: static count of in-flight frames.

    Returns:
      ``[B, num_frames * pages_per_frame]`` int32; 0 (skip) for padding rows and unallocated pages.
    """
    layout = state.layout
    rows, valid = _batch(state, rows)
    first = _committed_tokens_pages(state, rows)
    absolute = first[:, None] + jnp.arange(num_frames * layout.pages_per_frame)[None, :]
    index = _stored_index(state, rows, absolute)
    present = valid[:, None] & (index < state.num_pages[rows][:, None])
    page = jnp.take_along_axis(state.tables[rows], jnp.clip(index, 0, layout.table_width - 1), axis=1)
    return jnp.where(present, page, 0)


def visible_window(state: BlockTableState, rows: Array, num_current_frames: Array) -> VisibleWindow:
    """The history a forward of ``num_current_frames`` new frames attends to (vLLM-Omni's
    ``video_block_table``, history part): the sink frames plus the most recent frames such that,
    with the current frames, at most ``sink + window`` frames are visible
    (:meth:`arkv_jax.config.WindowPolicy.history_split` of the frames the row holds). The current
    frames' K/V are not in the pool; the attention kernel takes them directly. For a row whose
    every earlier frame is resident this is :meth:`~arkv_jax.config.WindowPolicy.visible_history`
    on the row's next frame.

    Rows must be frame-aligned (no partial prefill frame).

    Args:
      rows: ``[B]`` int32 row indices (negative = padding).
      num_current_frames: ``[B]`` or scalar, frames of the forward.
    """
    layout = state.layout
    ppf = layout.pages_per_frame
    rows, valid, current = _batch(state, rows, num_current_frames)
    frames = computed_frames(state, rows)
    evicted_frames = state.evicted_pages[rows] // ppf
    allocated_frames = (state.num_pages[rows] + state.evicted_pages[rows]) // ppf
    history = jnp.where(valid, jnp.minimum(frames, allocated_frames) - evicted_frames, 0)
    sink, recent = layout.window.history_split(history, current)
    live = history - sink
    j = jnp.arange(layout.visible_frames * ppf)[None, :]
    sink_end = (sink * ppf)[:, None]
    source = jnp.where(j < sink_end, j, ((sink + live - recent) * ppf)[:, None] + j - sink_end)
    shown = j < ((sink + recent) * ppf)[:, None]
    pages = jnp.take_along_axis(state.tables[rows], jnp.clip(source, 0, layout.table_width - 1), axis=1)
    i = jnp.arange(layout.visible_frames)[None, :]
    frame_ids = jnp.where(i < sink[:, None], i, (history + evicted_frames - recent - sink)[:, None] + i)
    frame_ids = jnp.where(i < (sink + recent)[:, None], frame_ids, -1)
    return VisibleWindow(pages=jnp.where(shown, pages, 0),
                         lengths=(sink + recent) * layout.tokens_per_frame,
                         frame_ids=frame_ids.astype(jnp.int32))


def resize(state: BlockTableState, *, num_rows: int | None = None,
           table_width: int | None = None) -> BlockTableState:
    """A copy of ``state`` with more rows and/or wider tables (new rows inactive, new columns
    empty). Host-side: shapes change, so jitted steps compile once more for the new shapes.

    Raises:
      ValueError: a size would shrink.
    """
    num_rows = state.num_rows if num_rows is None else num_rows
    table_width = state.layout.table_width if table_width is None else table_width
    if num_rows < state.num_rows or table_width < state.layout.table_width:
        raise ValueError(f"resize cannot shrink: rows {state.num_rows} -> {num_rows}, "
                         f"table width {state.layout.table_width} -> {table_width}")
    extra_rows = num_rows - state.num_rows

    def grow(array):
        return jnp.pad(array, [(0, extra_rows)] + [(0, 0)] * (array.ndim - 1))

    return state.replace(
        tables=jnp.pad(state.tables, [(0, extra_rows), (0, table_width - state.layout.table_width)]),
        num_pages=grow(state.num_pages), evicted_pages=grow(state.evicted_pages),
        committed_frames=grow(state.committed_frames), prefill_tokens=grow(state.prefill_tokens),
        active=grow(state.active),
        layout=dataclasses.replace(state.layout, table_width=table_width),
    )


def evict(state: BlockTableState, rows: Array, evicted_frames: Array) -> tuple[BlockTableState, Array]:
    """Evicts frames just after the sink until ``evicted_frames[b]`` frames of row ``b`` are evicted.

    The eviction :func:`commit` applies, without its window rule, for a caller that applies its own
    (:mod:`arkv_jax.compat.vllm_omni` applies vLLM-Omni's token-granular one): row ``b``'s frames
    after the sink ``[already evicted, evicted_frames[b])`` are freed, highest table index first,
    rows in batch order, to the free ring's tail, and its table is compacted (``num_pages`` drops,
    ``evicted_pages`` grows by as many pages). The target is clipped to the frames after the sink
    whose pages are all in the table, as vLLM clips its skipped range to the table; a row asked
    for no more frames than it has already evicted is untouched (eviction is monotone). Committed
    frames and prefill tokens are left as they are. Jittable: nothing depends on a value for its
    shape.

    Args:
      rows: ``[B]`` int32 row indices (negative = padding).
      evicted_frames: ``[B]`` or scalar int32: frames after the sink evicted once the call returns.

    Returns:
      ``(state, ok)``: ``ok[b]`` is False (and the row untouched) for padding or an inactive row.
    """
    rows, valid, evicted_frames = _batch(state, rows, evicted_frames)
    ok = valid & state.active[rows]
    state, _ = _evict_up_to(state, rows, ok, evicted_frames)
    return state, ok
