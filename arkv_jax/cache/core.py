"""The cache's core: the committed state, the pools, the lock, the one transaction in flight.

:class:`CacheCore` holds what every part of a :class:`~arkv_jax.cache.PagedKVCache` changes: the
sharded block-table state and the K/V pools (changed only by :mod:`~arkv_jax.cache.programs`, under
:attr:`CacheCore.lock`), the session table and the cross-attention store. :class:`Transaction` is
what the chunk step (:mod:`~arkv_jax.cache.chunk`) and the recache (:mod:`~arkv_jax.cache.recache`)
share: at most one is in flight (:meth:`CacheCore.start` refuses a second at once, naming the one in
flight), its with-block leaves the core idle, and its K/V go through one checked write
(:meth:`CacheCore.write`). ``docs/protocol.md``.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from arkv_jax import processes, sharding
from arkv_jax import state as state_lib
from arkv_jax.cache import programs
from arkv_jax.cache.batch import BatchRows
from arkv_jax.cache.cross_attention import CrossAttentionStore
from arkv_jax.cache.layout import CacheLayout
from arkv_jax.cache.sessions import SessionTable
from arkv_jax.config import ArgumentTypeError, CacheGeometry, CrossAttentionSpec, WindowPolicy
from arkv_jax.planner import DevicePlan, MemoryPlan
from arkv_jax.step import ChunkInputs

Array = jax.Array


def cross_label(session_id: str, branch: str) -> str:
    """How cross-attention messages name the row they were for."""
    return f"session {session_id!r} branch {branch!r}: cross-attention cache"


def check_kv(label: str, array, expected: tuple[int, ...]) -> None:
    """Checks one K/V argument of a write: an array of a floating dtype and shape ``expected``."""
    if not isinstance(array, (jax.Array, np.ndarray)):
        raise ArgumentTypeError(f"{label} must be a jax.Array, got {type(array).__name__}")
    if not jnp.issubdtype(array.dtype, jnp.floating):
        raise ArgumentTypeError(f"{label} must have a floating dtype (it is cast to the pool's), got "
                                f"{array.dtype}; int, bool and complex K/V are refused, not cast")
    if tuple(array.shape) != expected:
        raise ValueError(f"{label} must have shape {expected} (layers, rows, frames x tokens, "
                         f"kv_heads, head_dim), got {tuple(array.shape)}")


class CacheCore:
    """The mutable core of one cache (see the module docstring). Built by the facade.

    Args:
      geometry, window, plan: the cache's geometry, window policy and device plan.
      mesh: the mesh everything lives on (a ``(1, 1)`` mesh without one).
      cross_attention: the cross-attention specs.
      backend: kernel backend of the page writes.
    """

    def __init__(self, geometry: CacheGeometry, window: WindowPolicy, plan: MemoryPlan | DevicePlan, mesh: Mesh,
                 cross_attention: tuple[CrossAttentionSpec, ...], backend: str) -> None:
        if processes.spans_processes(mesh):
            processes.check_process_mesh(mesh)
        self.geometry, self.window, self.mesh, self.backend = geometry, window, mesh, backend
        branches = [b.name for b in plan.kv_branches]
        self.sessions = SessionTable(mesh.shape[sharding.DATA], plan.session_capacity, branches)
        state_layout = state_lib.StateLayout.from_config(geometry, window, plan.managed_num_blocks)
        self.layout = CacheLayout(self.sessions.num_shards, plan.session_capacity, len(branches),
                                  plan.managed_num_blocks, state_layout.table_width, geometry.pages_per_frame,
                                  geometry.page_bytes, window)
        self.state = sharding.init_sharded_state(state_layout, self.layout.rows_per_shard, mesh)
        self.k_pool, self.v_pool = sharding.make_pools(geometry, plan.managed_num_blocks, mesh)
        self.cross = CrossAttentionStore(
            cross_attention, geometry, self.layout.num_rows,
            NamedSharding(mesh, sharding.cross_attention_spec(5, row_axis=0, head_axis=3)))
        self.lock = threading.RLock()
        self.in_flight: Transaction | None = None
        self.local_shards = processes.local_shards(mesh)
        self.spans_processes = processes.spans_processes(mesh)

    # -- the one transaction in flight -------------------------------------------------------------
    def require_idle(self, what: str) -> None:
        """Refuses ``what`` while a transaction is in flight (``RuntimeError`` naming it)."""
        if self.in_flight is not None:
            raise RuntimeError(f"cannot {what} while a {self.in_flight.kind} is in flight; commit it or leave "
                               "its with-block first")

    def start(self, transaction: "Transaction") -> None:
        """Puts ``transaction`` in flight (call under :attr:`lock` after :meth:`require_idle`)."""
        self.require_idle(f"start a {transaction.kind}")
        self.in_flight = transaction

    def finish(self, transaction: "Transaction") -> None:
        """Leaves the core idle if ``transaction`` is the one in flight."""
        with self.lock:
            if self.in_flight is transaction:
                self.in_flight = None

    # -- the write both transactions share ---------------------------------------------------------
    def write(self, k_new: Array, v_new: Array, inputs: ChunkInputs, num_frames: int, batch_size: int, *,
              pending: state_lib.BlockTableState | None = None) -> None:
        """Checks and writes a forward's K/V into the pages of ``inputs`` (its rows are the first
        rows of the ``batch_size``-row batch; the K/V of later rows, padding, are dropped); with
        ``pending`` also commits the chunk (advance + evict) into the committed state, in one
        donated program. Call under :attr:`lock`.

        Raises:
          TypeError: not an array of a floating dtype. ValueError: not ``[layers, batch_size,
            num_frames * tokens_per_frame, kv_heads, head_dim]``.
        """
        g = self.geometry
        expected = (g.num_layers, batch_size, num_frames * g.tokens_per_frame, g.num_kv_heads, g.head_dim)
        check_kv("k_new", k_new, expected)
        check_kv("v_new", v_new, expected)
        rows = inputs.rows.shape[0]
        if rows < batch_size:  # a compact batch padded to its bucket: the padding rows are not written
            k_new, v_new = k_new[:, :rows], v_new[:, :rows]
        k_new, v_new = jnp.asarray(k_new, g.write_dtype), jnp.asarray(v_new, g.write_dtype)
        if pending is None:
            self.k_pool, self.v_pool = programs.write(
                self.k_pool, self.v_pool, k_new, v_new, inputs.write_pages, tokens_per_frame=g.tokens_per_frame,
                backend=self.backend, mesh=self.mesh)
        else:
            self.k_pool, self.v_pool, self.state, _ = programs.commit(
                self.k_pool, self.v_pool, pending, k_new, v_new, inputs, num_frames=num_frames,
                backend=self.backend, mesh=self.mesh)

    # -- sessions ------------------------------------------------------------------------------------
    def admit(self, session_id: str) -> None:
        """Gives a new session a slot and begins its rows."""
        slot = self.sessions.admit(session_id)
        self.state, _ = programs.begin(self.state, self.sessions.slot_local_rows(slot), mesh=self.mesh)

    def release(self, session_id: str, reason: str) -> tuple[str, str]:
        """Releases a session's slot, pages and cross-attention rows; returns the callback event
        ``(session_id, reason)`` (:mod:`~arkv_jax.cache.callbacks`: callbacks run after the bookkeeping)."""
        slot = self.sessions.remove(session_id)
        self.state, _ = programs.end(self.state, self.sessions.slot_local_rows(slot), mesh=self.mesh)
        self.cross.release(self.sessions.slot_rows(slot))
        return session_id, reason

    def restart(self, session_id: str, clear: set[str]) -> None:
        """Restarts a session at frame 0 (its pages released) and clears the caches ``clear``."""
        slot = self.sessions.slot(session_id)
        rows = self.sessions.slot_local_rows(slot)
        self.state, _ = programs.end(self.state, rows, mesh=self.mesh)
        self.state, _ = programs.begin(self.state, rows, mesh=self.mesh)
        self.cross.release(self.sessions.slot_rows(slot), clear)

    def num_free_pages(self) -> int:
        """Free pages, all shards (host sync; a collective on several processes)."""
        with self.lock:
            return int(jnp.sum(self.state.free_count))

    def local_free_pages(self) -> int:
        """Free pages of this process's data shards (all shards on one process; host sync, no
        collective)."""
        with self.lock:
            return int(sharding.local_rows(self.state.free_count)[1].sum())

    def is_local(self, slot: int) -> bool:
        """Whether ``slot``'s data shard lives on this process's devices."""
        return self.sessions.shard(slot) in self.local_shards

    def pages_held(self, session_ids: tuple[str, ...]) -> dict[str, np.ndarray]:
        """Pool pages each session holds (all its branches), sorted (host sync; a collective on
        several processes)."""
        with self.lock:
            rows = self.sessions.rows(session_ids)
            pages, counts = (sharding.to_host(a) for a in programs.resident_pages(
                self.state, self.sessions.every_local_row(), mesh=self.mesh))
            held = [SessionTable.pool_pages(s, pages[s, r, :counts[s, r]], self.layout.pages_per_shard)
                    for s, r in zip(*self.sessions.split_rows(rows))]
        per_session = len(rows) // len(session_ids)
        return {sid: np.sort(np.concatenate(held[i * per_session:(i + 1) * per_session]))
                for i, sid in enumerate(session_ids)}


class Transaction:
    """Work in flight on a :class:`CacheCore` over one batch (a chunk or a recache): a context
    manager whose with-block leaves the core idle (then runs :meth:`_abort` if it raised).

    Attributes:
      kind: what error messages call it (``"chunk"``, ``"recache"``).
      batch: where its sessions sit in the batch (:class:`~arkv_jax.cache.batch.BatchRows`).
      committed: whether its commit ran.
    """

    kind = "transaction"

    def __init__(self, core: CacheCore, batch: BatchRows) -> None:
        self._core, self.batch, self.committed = core, batch, False

    def __enter__(self) -> "Transaction":
        return self

    def __exit__(self, exc_type, exc, traceback) -> bool:
        with self._core.lock:
            self._core.finish(self)
            if exc is not None:
                self._abort(exc)
        return False

    def _abort(self, exc: BaseException) -> None:
        """What a raising with-block does beyond dropping the uncommitted work (nothing here); runs
        under the lock, the core already idle."""

    def _require_in_flight(self) -> None:
        if self._core.in_flight is not self or self.committed:
            raise RuntimeError(f"this {self.kind} is not in flight (already committed, or its with-block has exited)")

    # -- the batch (see arkv_jax.cache.batch) ---------------------------------------------------------
    @property
    def positions(self) -> tuple[int, ...]:
        """Each session's position in the batch, in the order the sessions were asked for."""
        return self.batch.positions

    @property
    def num_positions(self) -> int:
        """Session positions of the batch (its bucket, or every slot of the full batch)."""
        return self.batch.num_positions

    @property
    def batch_size(self) -> int:
        """Batch rows: positions x branches (what the forward's inputs and K/V have)."""
        return self.batch.batch_size

    @property
    def session_ids(self) -> tuple[str | None, ...]:
        """The session of each batch row (each session repeated per branch), ``None`` for padding."""
        return self.batch.owners

    def place(self, values, *, fill=0, axis: int = 0):
        """Per-session ``values`` (one per session asked for, in order) at their batch positions:
        :meth:`arkv_jax.cache.batch.BatchRows.place`."""
        return self.batch.place(values, fill=fill, axis=axis)

    def take_local(self, values) -> tuple[tuple[str, ...], np.ndarray]:
        """The sessions this process holds and their entries of per-position ``values``, on the host:
        :meth:`arkv_jax.cache.batch.BatchRows.take_local`."""
        return self.batch.take_local(values)

    def place_rows(self, values, *, fill=0, axis: int = 0):
        """Per-row ``values`` (the sessions' branches, session-major) at their batch rows:
        :meth:`arkv_jax.cache.batch.BatchRows.place_rows`."""
        return self.batch.place_rows(values, fill=fill, axis=axis)

    def take(self, values, *, axis: int = 0):
        """The sessions' entries of per-position ``values`` (e.g. latents): :meth:`BatchRows.take
        <arkv_jax.cache.batch.BatchRows.take>`."""
        return self.batch.take(values, axis=axis)
