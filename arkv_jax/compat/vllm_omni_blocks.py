"""vLLM-Omni's contiguous token layout and window walk, on :mod:`arkv_jax.state`.

vLLM-Omni lays a request's tokens out contiguously: token ``p`` (prefill included) at flat slot
``table[p // block_size] * block_size + p % block_size``, so a block may hold the end of one chunk
and the start of the next, and a commit nulls only the blocks wholly out of the window after the
sink. :class:`ContiguousBlocks` keeps those tables as rows of a jitted
:class:`~arkv_jax.state.BlockTableState` (one-page frames, compacted) with vLLM's block ids and
free-list order; the functions are vLLM-Omni's slot formulas and its table view.

Part of :mod:`arkv_jax.compat.vllm_omni`, which re-exports the functions; see
``docs/migrating-from-vllm-omni.md``.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from arkv_jax import state as core
from arkv_jax.config import WindowPolicy, ceil_div

__all__ = ["ContiguousBlocks", "compute_slot_mapping", "chunk_slot_mapping", "resident_block_ids",
           "seed_block_table"]


def compute_slot_mapping(block_ids: Sequence[int], positions: Sequence[int], block_size: int) -> jax.Array:
    """Flat slots ``block_ids[p // block_size] * block_size + p % block_size`` of ``positions``.

    Raises:
      ValueError: ``block_size <= 0``.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    blocks = np.asarray(block_ids, np.int64)
    positions = np.asarray(positions, np.int64)
    return jnp.asarray((blocks[positions // block_size] * block_size + positions % block_size).astype(np.int32))


def chunk_slot_mapping(block_ids: Sequence[int], num_computed_tokens: int, chunk_size: int,
                       block_size: int) -> jax.Array:
    """Slots of the in-flight chunk: positions ``[num_computed_tokens, + chunk_size)``."""
    return compute_slot_mapping(block_ids, np.arange(num_computed_tokens, num_computed_tokens + chunk_size),
                                block_size)


def resident_block_ids(block_ids: Sequence[int], null_block_id: int) -> list[int]:
    """``block_ids`` without the null block, order kept."""
    return [int(b) for b in block_ids if int(b) != null_block_id]


def seed_block_table(state: core.BlockTableState, row: int) -> list[int]:
    """A state row's table in vLLM-Omni's S1 form: compacted-away blocks shown as null (0) entries
    after the sink. Read on the host (no device computation)."""
    num_pages, evicted = int(np.asarray(state.num_pages)[row]), int(np.asarray(state.evicted_pages)[row])
    stored = np.asarray(state.tables)[row, :num_pages].tolist()
    sink = min(state.layout.sink_pages, len(stored))
    return stored[:sink] + [0] * evicted + stored[sink:]


_begin = jax.jit(core.begin, donate_argnums=0)
_allocate = jax.jit(core.allocate, donate_argnums=0)
_end = jax.jit(core.end, donate_argnums=0)

#: The core state's own window rule is disabled (its window never ends): this module evicts.
_CORE_NEVER_EVICTS = 1 << 30


@functools.partial(jax.jit, donate_argnums=0)
def _place_row(state, row, evicted, computed_tokens):
    """Row ``row`` with ``evicted`` one-page frames after the sink evicted (:func:`arkv_jax.state.evict`:
    highest table index first, compacted, clipped to the table, never undone) and positioned at
    ``computed_tokens`` tokens (``computed // block_size`` whole pages plus the rest, so the core's
    token arithmetic is vLLM's contiguous one)."""
    state, _ = core.evict(state, row[None], evicted[None])
    block_size = state.layout.block_size
    return state.replace(committed_frames=state.committed_frames.at[row].set(computed_tokens // block_size),
                         prefill_tokens=state.prefill_tokens.at[row].set(computed_tokens % block_size))


class ContiguousBlocks:
    """Block tables of requests in vLLM-Omni's contiguous layout: one state row per request.

    The state has one-page frames (``tokens_per_frame == block_size``), so the core allocates
    token-granular contiguous pages (``cdiv(computed + n, block_size) - len(table)`` new blocks);
    its own window rule is off, and the window walk here applies vLLM-Omni's token-granular,
    chunk-snapped rule: a commit at ``computed`` tokens frees table indices
    ``[ceil(sink_tokens / block_size), floor((sink_tokens + skipped) / block_size))``, clipped to the
    table, walked backwards to the first null entry (vLLM-Omni S2; S1 when a chunk is a block).
    """

    def __init__(self, window: WindowPolicy, *, chunk_size: int, block_size: int, frames_per_block: int,
                 num_blocks: int, num_rows: int) -> None:
        self.window, self.chunk_size, self.block_size = window, chunk_size, block_size
        self.sink_tokens = window.sink_frames * chunk_size
        width = ceil_div((window.resident_frames + frames_per_block) * chunk_size, block_size) + 2
        layout = core.StateLayout(tokens_per_frame=block_size, block_size=block_size,
                                  sink_frames=ceil_div(self.sink_tokens, block_size),
                                  window_frames=_CORE_NEVER_EVICTS, reset_at_boundary=False,
                                  table_width=width, num_blocks=num_blocks)
        self.state = core.init_state(layout, num_rows=num_rows)
        self._free_rows: list[int] = list(range(num_rows))

    def begin(self, prefill_tokens: int) -> int:
        """A fresh row with ``prefill_tokens`` computed (the state grows when every row is taken)."""
        if not self._free_rows:
            grown = 2 * self.state.num_rows
            self._free_rows = list(range(self.state.num_rows, grown))
            self.state = core.resize(self.state, num_rows=grown)
        row = self._free_rows.pop(0)
        self.state, ok = _begin(self.state, jnp.array([row]), prefill_tokens)
        assert bool(ok[0])
        return row

    def end(self, row: int) -> None:
        """Returns every block of the row to the pool (its table in reverse) and frees the row."""
        self.state, _ = _end(self.state, jnp.array([row]))
        self._free_rows.append(row)

    def table(self, row: int) -> list[int]:
        """The row's table in vLLM-Omni's form (:func:`seed_block_table`)."""
        return seed_block_table(self.state, row)

    def num_free(self) -> int:
        return int(self.state.free_count)

    def skipped_tokens(self, computed: int) -> int:
        """vLLM-Omni's skip rule (seed-semantics §4.2): tokens after the sink out of the window once
        ``computed`` tokens are computed, snapped down to a chunk boundary. That is the window rule
        (:meth:`~arkv_jax.config.WindowPolicy.skipped_frames`) on the ``computed // chunk_size``
        whole chunks, in tokens."""
        return self.window.skipped_frames(computed // self.chunk_size) * self.chunk_size

    def remove_skipped_blocks(self, row: int, computed: int) -> None:
        """vLLM-Omni's ``remove_skipped_blocks`` at ``computed`` tokens, then the row is positioned
        at ``computed`` tokens."""
        skipped = self.skipped_tokens(computed)
        # pages [ceil(sink / block_size), floor((sink + skipped) / block_size)) are out: the sink holds the
        # first ceil(sink / block_size), so floor(...) less those are evicted (clipped, never undone)
        evicted = (self.sink_tokens + skipped) // self.block_size - self.state.layout.sink_pages if skipped else 0
        self.state = _place_row(self.state, jnp.asarray(row, jnp.int32), jnp.asarray(evicted, jnp.int32),
                                jnp.asarray(computed, jnp.int32))

    def allocate(self, row: int, computed: int, num_tokens: int, what: str) -> list[int]:
        """Allocates ``num_tokens`` in-flight tokens after ``computed`` ones; returns the table.

        Raises:
          RuntimeError: the pool is exhausted (nothing is allocated).
          ValueError: ``Cannot get N free blocks from the pool``, where vLLM's capacity check
            passes but its block pool cannot serve.
        """
        # vLLM's allocate_slots runs the window walk first (a no-op unless blocks out of the window
        # are still held: after commits of unallocated chunks or a long prefill)
        if self.skipped_tokens(computed) > 0:
            self.remove_skipped_blocks(row, computed)
        required = ceil_div(computed + num_tokens, self.block_size)
        needed = required - int(np.asarray(self.state.evicted_pages)[row])
        width = self.state.layout.table_width
        if needed > width:  # vLLM-Omni's tables are unbounded: widen ours (host-side, rare)
            self.state = core.resize(self.state, table_width=max(needed, 2 * width))
        self.state, ok = _allocate(self.state, jnp.array([row]), num_tokens)
        if not bool(ok[0]):
            # vLLM checks max(required - max(skipped, held), 0) blocks against the free count but
            # then takes required - held: after commits of unallocated chunks the check can pass
            # and BlockPool.get_new_blocks raise (the out-of-window eviction already happened).
            held = len(self.table(row))
            skipped = self.skipped_tokens(computed) // self.block_size
            free = self.num_free()
            if max(required - max(skipped, held), 0) <= free < required - held:
                raise ValueError(f"Cannot get {required - held} free blocks from the pool")
            raise RuntimeError(f"AR-Diffusion KV pool exhausted while allocating {what}")
        return self.table(row)

    def chunk_slots(self, row: int, computed: int, request_id: str) -> np.ndarray:
        """Flat slots of the in-flight chunk's tokens (after ``computed``): vLLM-Omni's contiguous
        formula (host-side).

        Raises:
          IndexError: some of the chunk's tokens have no allocated block.
        """
        table = np.asarray(self.table(row), np.int64)
        tokens = np.arange(computed, computed + self.chunk_size, dtype=np.int64)
        index = tokens // self.block_size
        pages = table[np.minimum(index, len(table) - 1)] if len(table) else np.zeros_like(index)
        missing = (index >= len(table)) | (pages == 0)  # the null block
        if missing.any():
            first = int(tokens[np.argmax(missing)])
            raise IndexError(f"AR-Diffusion request {request_id!r} has no allocated block for tokens "
                             f"[{first}, {computed + self.chunk_size}) of its in-flight chunk (table "
                             f"{table.tolist()}); call allocate_chunk before writing the chunk")
        return pages * self.block_size + tokens % self.block_size
