"""The recache: a session's history K/V recomputed into fresh pages (``with cache.recache(...) as job``).

A prompt switch (LongLive's KV recache) recomputes the frames a session's next chunk sees under the
new conditioning, from latents the caller kept, at their absolute positions.
:meth:`Recache.start` plans it (:func:`~arkv_jax.cache.recache_plan.plan_recache`: the frames, the
forwards, the fresh pages) and lays out its batch like a chunk's; the caller runs one forward per
unit, in order, and :meth:`Recache.write`\\ s its K/V into fresh pages (free now, untouched by anyone
else while the recache is in flight), stages the new cross-attention K/V, and :meth:`Recache.commit`
swaps the pages in (:func:`arkv_jax.state.swap_pages`) and publishes the K/V at once. Until then the
session's pages are as they were, so a failure at any point leaves the old history.
``docs/protocol.md``, ``docs/rollout.md``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from arkv_jax import sharding
from arkv_jax.cache import programs
from arkv_jax.cache.batch import BatchRows
from arkv_jax.cache.core import CacheCore, Transaction, cross_label
from arkv_jax.cache.recache_plan import RecacheUnit, plan_recache
from arkv_jax.config import require_int

Array = jax.Array

#: Values of ``sink``: keep the sink's K/V as they are, or recompute them too.
SINK_MODES = ("keep", "recompute")


class Recache(Transaction):
    """One session's recache in flight; see :meth:`arkv_jax.cache.PagedKVCache.recache`.

    Attributes:
      session_id: the session.
      branches: its KV branches, in the order of each unit's rows.
      sink: ``"keep"`` or ``"recompute"``.
      frames: absolute frames recomputed, in time order (empty: nothing to recompute).
      units: the forwards to run, in order (:class:`~arkv_jax.cache.recache_plan.RecacheUnit`), each
        with ``batch_size``-row inputs (the session's rows at its position, padding elsewhere).
      positions, num_positions, batch_size: where the session sits in the batch; :meth:`place_rows`
        puts its per-branch values (e.g. the new text K/V) at its batch rows.
      written: units written so far.
      committed: whether :meth:`commit` ran.
    """

    kind = "recache"

    def __init__(self, core: CacheCore, batch: BatchRows, sink: str, frames: tuple[int, ...],
                 units: tuple[RecacheUnit, ...], rows: np.ndarray, replace: np.ndarray) -> None:
        super().__init__(core, batch)
        self.session_id, self.branches, self.sink = batch.session_ids[0], batch.branches, sink
        self.frames, self.units, self.written = frames, units, 0
        self._rows, self._replace, self._staged = rows, replace, {}

    @classmethod
    def start(cls, core: CacheCore, session_id: str, branches: tuple[str, ...], chunk_frames: int | None,
              sink: str, *, full_batch: bool) -> "Recache":
        """Checks ``sink`` and ``chunk_frames`` (default ``geometry.frames_per_forward``), plans the
        recache of a session at a chunk boundary, lays out its batch and puts it in flight (see
        :meth:`arkv_jax.cache.PagedKVCache.recache` for the errors); a refusal changes nothing."""
        if not isinstance(sink, str) or sink not in SINK_MODES:
            raise ValueError(f"sink must be one of {SINK_MODES}, got {sink!r}")
        chunk_frames = require_int("chunk_frames", core.geometry.frames_per_forward if chunk_frames is None
                                   else chunk_frames, minimum=1, maximum=core.window.window_frames)
        with core.lock:
            slot = core.sessions.slot(session_id)
            shard = core.sessions.shard(slot)
            local = core.sessions.rows([session_id], branches) % core.layout.rows_per_shard
            core.require_idle("recompute a session's K/V")
            plan = plan_recache(programs.shard_state(_readable(core), shard), local, core.window, chunk_frames, sink)
            batch = BatchRows.of(core.sessions, (session_id,), branches, full_batch=full_batch)
            units = tuple(u._replace(inputs=batch.place_inputs(u.inputs)) for u in plan.units)
            rows = np.full((core.layout.num_shards, len(branches)), -1, np.int32)
            replace = np.zeros((core.layout.num_shards, *plan.replace.shape), bool)
            rows[shard], replace[shard] = local, plan.replace
            job = cls(core, batch, sink, plan.frames, units, rows, replace)
            core.start(job)
        return job

    @property
    def next_unit(self) -> RecacheUnit | None:
        """The unit to compute next (``None`` once all are written)."""
        return self.units[self.written] if self.written < len(self.units) else None

    def write(self, k_new: Array, v_new: Array) -> None:
        """Writes the K/V of :attr:`next_unit` (its forward ran on ``next_unit.inputs``) into its
        fresh pages; later units read them.

        Args:
          k_new, v_new: ``[layers, batch_size, num_frames * tokens_per_frame, kv_heads, head_dim]``
            (padding rows are not written).

        Raises:
          RuntimeError: not in flight, or every unit is written. TypeError/ValueError: as for a
            chunk's commit.
        """
        with self._core.lock:
            self._require_in_flight()
            unit = self.next_unit
            if unit is None:
                raise RuntimeError(f"all {len(self.units)} units of this recache are written; commit it")
            self._core.write(k_new, v_new, unit.inputs, unit.num_frames, self.batch_size)
            self.written += 1

    def populate_cross_attention(self, name: str, branch: str, layer_kv) -> None:
        """Stages the session's new cross-attention K/V of ``name`` and ``branch`` (as
        :meth:`arkv_jax.cache.PagedKVCache.populate_cross_attention` takes them, validated now),
        published by :meth:`commit` together with the pages."""
        with self._core.lock:
            self._require_in_flight()
            row = int(self._core.sessions.rows([self.session_id], [branch])[0])
            self._staged[name, row] = self._core.cross.collect(name, layer_kv,
                                                               label=cross_label(self.session_id, branch))

    def commit(self) -> None:
        """Swaps the fresh pages in (the replaced pages are freed) and publishes the staged
        cross-attention K/V, in one step.

        Raises:
          RuntimeError: not in flight, or a unit is not written yet.
        """
        core = self._core
        with core.lock:
            self._require_in_flight()
            if self.next_unit is not None:
                raise RuntimeError(f"{self.written} of {len(self.units)} recache units are written; write them all "
                                   "before committing")
            state, ok = programs.swap_pages(core.state, jnp.asarray(self._rows), jnp.asarray(self._replace),
                                            mesh=core.mesh)
            core.state = state  # unchanged unless ok (all or nothing)
            if not bool(jnp.all(ok)):  # plan_recache checked every condition under the lock
                raise RuntimeError("the page swap of a recache was refused; nothing changed")
            for (name, row), (k, v) in self._staged.items():
                core.cross.publish(name, row, k, v)
            self.committed = True


def _readable(core: CacheCore):
    """The sharded state, every shard readable here: as it is on one process; on several, every
    process gathers it to the host (a collective every process runs, as each applies the same
    switch), so every process plans the same recache."""
    if not core.spans_processes:
        return core.state
    return jax.tree_util.tree_map(sharding.to_host, core.state)


__all__ = ["SINK_MODES", "Recache", "RecacheUnit", "plan_recache"]
