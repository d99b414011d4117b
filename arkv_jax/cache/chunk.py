"""The chunk step: one chunk in flight for a batch of sessions (``with cache.chunk(...) as step``).

:meth:`ChunkStep.start` checks ``num_frames`` against the window rule
(:meth:`~arkv_jax.cache.layout.CacheLayout.max_chunk_frames`), lays out the batch
(:class:`~arkv_jax.cache.batch.BatchRows`: compact, bucketed or full) and allocates the chunk's
pages in a *pending* copy of the state (:func:`~arkv_jax.cache.programs.prepare`). The forward runs
on ``step.inputs``; :meth:`ChunkStep.commit` writes its K/V (padding rows included) into the chunk's
pages and commits the pending state in one donated program. A with-block that raises drops the
pending state: no page leaks, and with ``fail_closed`` the chunk's sessions are closed.
``docs/protocol.md``.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from arkv_jax import sharding
from arkv_jax import state as state_lib
from arkv_jax.cache import callbacks, programs
from arkv_jax.cache.batch import BatchRows
from arkv_jax.cache.core import CacheCore, Transaction
from arkv_jax.config import require_int
from arkv_jax.step import ChunkInputs

Array = jax.Array


class ChunkStep(Transaction):
    """One chunk in flight; see :meth:`arkv_jax.cache.PagedKVCache.chunk`.

    Attributes:
      inputs: the forward's :class:`~arkv_jax.step.ChunkInputs`, ``batch_size`` rows (padding rows
        where no session's branch sits).
      session_ids: the session of each batch row (each session repeated per branch), ``None`` for
        padding rows.
      num_frames: frames of the chunk.
      pending: the sharded state with the chunk's pages allocated.
      positions, num_positions, batch_size: where the sessions sit in the batch; :meth:`place`,
        :meth:`place_rows` and :meth:`take` move per-session values in and out of it.
      committed: whether :meth:`commit` ran.
    """

    kind = "chunk"

    def __init__(self, core: CacheCore, batch: BatchRows, num_frames: int, pending: state_lib.BlockTableState,
                 program_inputs: ChunkInputs, *, fail_closed: bool,
                 on_release: Callable[[str, str], None] | None) -> None:
        super().__init__(core, batch)
        self.num_frames, self.pending, self._program_inputs = num_frames, pending, program_inputs
        self._fail_closed, self._on_release = fail_closed, on_release
        # The prepare ran on every batch row of a full batch, on the sessions' rows of a compact one.
        self.inputs = program_inputs if batch.full else batch.place_inputs(program_inputs)

    @classmethod
    def start(cls, core: CacheCore, session_ids: tuple[str, ...], branches: tuple[str, ...], num_frames, *,
              full_batch: bool, buckets: Sequence[int] | None, fail_closed: bool,
              on_release: Callable[[str, str], None] | None) -> "ChunkStep":
        """Checks ``num_frames``, lays out the batch, allocates the chunk's pages and puts the step
        in flight (see :meth:`arkv_jax.cache.PagedKVCache.chunk` for the errors). A refusal changes
        nothing, not even the LRU order."""
        window = core.window
        num_frames = require_int("num_frames", num_frames,
                                 must=f"an int in [1, {window.window_frames}] (window_frames)")
        with core.lock:
            batch = BatchRows.of(core.sessions, session_ids, branches, full_batch=full_batch, buckets=buckets)
            local = batch.local_rows(core.sessions)
            busiest = int(np.max(np.sum(local >= 0, axis=1)))
            limit = core.layout.max_chunk_frames(busiest)
            if not 1 <= num_frames <= limit:
                raise ValueError(
                    f"num_frames must be an int in [1, {limit}], got {num_frames!r} (at most window_frames="
                    f"{window.window_frames}, at most what a row's page table of {core.layout.table_width} pages "
                    f"holds beside its window, and at most what {core.layout.pages_per_shard - 1} pages per "
                    f"shard hold for a chunk of {busiest} rows while every row holds its window)")
            core.require_idle("start a chunk")
            pending, inputs, ok = programs.prepare(core.state, jnp.asarray(local), num_frames=num_frames,
                                                   mesh=core.mesh)
            if not sharding.local_rows(ok)[1].all():  # this process's shards (arkv_jax.processes: the rollout agrees)
                where = " on this process's data shards" if core.spans_processes else ""
                raise RuntimeError(
                    f"KV pool exhausted while allocating a chunk of {num_frames} frames for "
                    f"{len(session_ids) * len(branches)} rows ({core.local_free_pages()} pages free{where})")
            core.sessions.touch(session_ids)
            step = cls(core, batch, num_frames, pending, inputs, fail_closed=fail_closed, on_release=on_release)
            core.start(step)
        return step

    def commit(self, k_new: Array, v_new: Array) -> None:
        """Writes the chunk's clean K/V and commits it (advance + evict). Call after the forward
        succeeded.

        Args:
          k_new, v_new: ``[layers, batch_size, num_frames * tokens_per_frame, kv_heads, head_dim]``
            (cast to the pool dtype), one row per batch row of :attr:`inputs`; padding rows are not
            written.

        Raises:
          RuntimeError: the step is not in flight (committed already, or its ``with`` block has exited).
          TypeError: not a floating array. ValueError: wrong shapes.
        """
        with self._core.lock:
            self._require_in_flight()
            self._core.write(k_new, v_new, self._program_inputs, self.num_frames, self.batch_size,
                             pending=self.pending)
            self.committed = True

    def _abort(self, exc: BaseException) -> None:
        """With ``fail_closed``, closes the chunk's sessions (callback errors become notes of ``exc``)."""
        if self._fail_closed:
            events = [self._core.release(sid, "forward_exception")
                      for sid in self.batch.session_ids if sid in self._core.sessions]
            callbacks.note(self._on_release, events, exc)
