"""The cache facade: what a model author holds.

:class:`PagedKVCache` composes a memory plan (:func:`arkv_jax.planner.resolve_plan`), the K/V pools
and the sharded block-table state, a :class:`~arkv_jax.cache.sessions.SessionTable` (slots, LRU
order, shard balance, row maps) and a :class:`~arkv_jax.cache.cross_attention.CrossAttentionStore`.
Per chunk it hands a model the inputs of one forward for many sessions at once
(:meth:`PagedKVCache.chunk`), and after the forward succeeded it writes the clean K/V into the
chunk's pages and commits (:meth:`ChunkStep.commit`).

Rows. Every (session, logical KV branch) is one row of the block-table state; the session in slot
``slot`` holds the global rows ``slot * num_branches + branch_index`` (every index space:
:mod:`arkv_jax.cache.sessions`). All branches of all sessions can run in one batched forward.

Failure safety. Preparing a chunk allocates its pages in a *pending* copy of the block-table state;
the committed state is replaced only when :meth:`ChunkStep.commit` runs. If the forward raises
inside ``with cache.chunk(...)``, the pending state is dropped: no page leaks and the sessions
continue from their last committed chunk. With ``fail_closed=True`` the sessions of the failed chunk
are closed instead, as vLLM-Omni's runner does. One chunk is in flight at a time. A prompt switch's
:meth:`PagedKVCache.recache` is the same kind of transaction: it writes into pages that stay free
until its commit swaps them in (:mod:`arkv_jax.cache.recache`).

Isolation. A row's visible window only ever names pages that row holds (the state guarantees it),
padding and unused entries point at the null page, and the attention kernels mask by length with
selection, so freed pages and other sessions' pages never reach an output, even NaN-filled ones.
Cross-attention rows are zeroed when a session releases them.

Devices. Without a mesh everything lives on one device, as a ``(1, 1)`` mesh. With ``mesh=`` (a
``("data", "model")`` mesh from :func:`arkv_jax.sharding.make_mesh`) the sessions are split over
``"data"``: each data shard has its own slice of the pools, its own block-table state and free list,
and holds ``plan.session_capacity`` sessions (slots ``shard * slots_per_shard ..``); K/V heads are
split over ``"model"``. A sharded cache hands out *full batches* (every slot, idle ones as padding
rows), so a chunk's inputs have the same shape and sharding whichever sessions run, and the
per-chunk bookkeeping and page write run on every shard at once without communication.

Scratch pages. The plan keeps vLLM-Omni's scratch reservation in its budget, but denoise steps never
write the pool, so the pools hold only the managed pages (as :class:`~arkv_jax.planner.DevicePlan`
counts them).

The facade stays one module: :class:`PagedKVCache` is one transaction (one lock, one in-flight
chunk) whose public methods validate their arguments before touching shared state; the session
table, the cross-attention store and the jitted programs are already their own modules.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from arkv_jax import sharding
from arkv_jax import state as core
from arkv_jax.cache import programs
from arkv_jax.cache.cross_attention import CrossAttentionStore
from arkv_jax.cache.recache import SINK_MODES, Recache, plan_recache
from arkv_jax.cache.sessions import SessionTable
from arkv_jax.config import (
    ArgumentTypeError,
    CacheGeometry,
    CrossAttentionSpec,
    KVBranch,
    WindowPolicy,
    require_bool,
    require_int,
    require_str_sequence,
    validate_branches,
)
from arkv_jax.planner import DevicePlan, MemoryPlan, resolve_plan
from arkv_jax.sharded_kernels import gather_rows
from arkv_jax.step import ChunkInputs, place_rows
from pallas_kernels.backend import BACKEND_NAMES

Array = jax.Array
_log = logging.getLogger(__name__)


class CallbackError(RuntimeError):
    """An ``on_release`` callback raised. The cache finished the operation first (every session it
    was closing is closed, the session it was opening is open); the callback's exception is the
    ``__cause__``."""


@functools.partial(jax.jit, static_argnames="mesh")
def _cross_attention_rows(k_table, v_table, rows, *, mesh: Mesh):
    """The batch's rows of a cross-attention cache (see :meth:`PagedKVCache.cross_attention_rows`),
    compiled once per shape and mesh."""
    return tuple(gather_rows(mesh, table, rows).swapaxes(0, 1) for table in (k_table, v_table))


@jax.jit
def _shard_state(state: core.BlockTableState, shard) -> core.BlockTableState:
    """Shard ``shard``'s state of a sharded state (no leading axis)."""
    return jax.tree_util.tree_map(lambda x: x[shard], state)


def _check_kv(label: str, array, expected: tuple[int, ...]) -> None:
    """Checks one K/V argument of a commit: an array of a floating dtype and shape ``expected``."""
    if not isinstance(array, (jax.Array, np.ndarray)):
        raise ArgumentTypeError(f"{label} must be a jax.Array, got {type(array).__name__}")
    if not jnp.issubdtype(array.dtype, jnp.floating):
        raise ArgumentTypeError(f"{label} must have a floating dtype (it is cast to the pool's), got "
                                f"{array.dtype}; int, bool and complex K/V are refused, not cast")
    if tuple(array.shape) != expected:
        raise ValueError(f"{label} must have shape {expected} (layers, rows, frames x tokens, "
                         f"kv_heads, head_dim), got {tuple(array.shape)}")


@dataclasses.dataclass(eq=False)
class ChunkStep:
    """One chunk in flight for a batch of rows; see :meth:`PagedKVCache.chunk`.

    Attributes:
      inputs: the forward's :class:`~arkv_jax.step.ChunkInputs`.
      session_ids: the session of each batch row (each session repeated per branch), ``None`` for
        padding rows.
      num_frames: frames of the chunk.
      pending: the sharded state with the chunk's pages allocated.
      on_commit: the cache's commit of this step, ``on_commit(step, k_new, v_new)``.
      committed: whether :meth:`commit` ran.
    """

    inputs: ChunkInputs
    session_ids: tuple[str | None, ...]
    num_frames: int
    pending: core.BlockTableState
    on_commit: Callable[["ChunkStep", Array, Array], None] = dataclasses.field(repr=False)
    committed: bool = False

    def commit(self, k_new: Array, v_new: Array) -> None:
        """Writes the chunk's clean K/V and commits it (advance + evict). Call after the forward
        succeeded.

        Args:
          k_new, v_new: ``[layers, B, num_frames * tokens_per_frame, kv_heads, head_dim]`` in the
            pool dtype, one row per batch row (padding rows are not written).

        Raises:
          RuntimeError: the step is not in flight (committed already, or its ``with`` block has exited).
          ValueError: wrong shapes.
        """
        self.on_commit(self, k_new, v_new)


def _check_session_id(session_id) -> None:
    if not isinstance(session_id, str):
        raise ArgumentTypeError(f"session_id must be a non-empty string, got {session_id!r} "
                                f"({type(session_id).__name__})")
    if not session_id:
        raise ValueError(f"session_id must be a non-empty string, got {session_id!r}")


def _cross_label(session_id: str, branch: str) -> str:
    """How cross-attention messages name the row they were for."""
    return f"session {session_id!r} branch {branch!r}: cross-attention cache"


class PagedKVCache:
    """Paged K/V for many concurrent video sessions, on one device or a mesh.

    Args:
      geometry, window: cache shape and window policy (``geometry.num_kv_heads``: all heads).
      kv_branches: logical KV branches (e.g. CFG ``positive``/``negative``); each session has one row
        per branch.
      cross_attention: named dense cross-attention caches per session and branch.
      plan, available_bytes, memory_fraction, session_capacity: the memory plan of *one device*, or
        what to plan it from (:func:`arkv_jax.planner.resolve_plan`; ``session_capacity`` counts
        all shards). Without a plan, a budget (``available_bytes``) or a ``memory_fraction``, the
        pool holds exactly ``session_capacity`` sessions running in one batched chunk
        (:func:`arkv_jax.planner.rollout_plan`); with either, vLLM-Omni's rule applies:
        ``memory_fraction`` (default 0.1) of ``available_bytes`` (default: the first device's free
        memory).
      device: where everything lives without a mesh (default: the first local device).
      mesh: a ``("data", "model")`` mesh to shard over (see the module docstring); exclusive with
        ``device``. A mesh with Explicit axes is used through its Auto view
        (:func:`arkv_jax.sharding.auto_axes`, same devices), which :attr:`mesh` holds.
      backend: kernel backend for the commit write (see :mod:`pallas_kernels.backend`).
      fail_closed: close the sessions of a chunk whose forward raised, instead of keeping them at
        their last committed chunk.
      on_release: called as ``on_release(session_id, reason)`` when a session is closed, reset or
        evicted (reason ``"close"``, ``"reset"``, ``"lru_eviction"``, ``"forward_exception"``), so
        a model can drop per-session state of its own.

    Threads. The cache may be shared by several threads; one chunk or recache (:meth:`recache`) is
    in flight at a time, and a call that cannot run meanwhile (``chunk``, ``recache``, ``open`` of a
    new session, ``close``, ``reset``, ``populate_cross_attention``, ``clear_cross_attention``) is
    *refused at once* with a ``RuntimeError`` ("... while a chunk is in flight"), never queued: a caller that
    wants to wait retries (or serialises its chunks itself). Every mutating method and every
    commit runs under one reentrant lock, so the in-flight check and its setting are one step and
    no two threads ever build chunks from the same committed state.

    Callbacks. An ``on_release`` that raises never interrupts the cache's bookkeeping: the
    operation finishes (every session being closed is closed, a session being opened is open),
    then a :class:`CallbackError` is raised ``from`` the first callback error. When a forward's
    exception is already propagating (``fail_closed``), that exception propagates unchanged and
    the callback errors are logged (``logging``, this module's logger) and added as notes.

    Atomicity. A call refused with an exception changes nothing: no session, page, LRU position
    or cross-attention row.

    Raises:
      TypeError: a wrong type (``geometry``, ``window``, a non-callable ``on_release``, a
        non-bool ``fail_closed``, a non-string ``backend``, ...).
      ValueError: an unknown ``backend``, a plan for other settings or another mesh, ``device``
        and ``mesh`` together, K/V heads not divisible by the mesh's ``"model"`` size, or what the
        planner rejects.
    """

    def __init__(self, geometry: CacheGeometry, window: WindowPolicy,
                 kv_branches: Sequence[KVBranch] = (KVBranch("main"),),
                 cross_attention: Sequence[CrossAttentionSpec] = (), *,
                 plan: MemoryPlan | DevicePlan | None = None, available_bytes: int | None = None,
                 memory_fraction: float | None = None, session_capacity: int = 1, device=None,
                 mesh: Mesh | None = None,
                 backend: str = "auto", fail_closed: bool = False,
                 on_release: Callable[[str, str], None] | None = None) -> None:
        if device is not None and mesh is not None:
            raise ValueError("pass device (one device) or mesh (sharded), not both")
        if not isinstance(backend, str):
            raise ArgumentTypeError(f"backend must be one of {BACKEND_NAMES}, got {backend!r}")
        if backend not in BACKEND_NAMES:
            raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {backend!r}")
        require_bool("fail_closed", fail_closed)
        if on_release is not None and not callable(on_release):
            raise ArgumentTypeError(f"on_release must be callable as on_release(session_id, reason) or None, "
                                    f"got {on_release!r}")
        if mesh is not None and not isinstance(mesh, Mesh):
            raise ArgumentTypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
        kv_branches = validate_branches(kv_branches)
        data, model = (1, 1) if mesh is None else sharding.check_mesh(mesh)
        mesh = None if mesh is None else sharding.auto_axes(mesh)
        plan = resolve_plan(geometry, window, kv_branches, cross_attention, data=data, model=model, plan=plan,
                            available_bytes=available_bytes, memory_fraction=memory_fraction,
                            session_capacity=session_capacity,
                            device=mesh.devices.flat[0] if mesh is not None else device)
        self.plan, self.geometry, self.window, self.mesh = plan, geometry, window, mesh
        self.kv_branches = plan.kv_branches
        self.backend, self.fail_closed, self.on_release = backend, fail_closed, on_release
        self._mesh = mesh or sharding.make_mesh(1, 1, [device or jax.local_devices()[0]])
        self._sessions = SessionTable(data, plan.session_capacity, [b.name for b in self.kv_branches])
        layout = core.StateLayout.from_config(geometry, window, plan.managed_num_blocks)
        self._state = sharding.init_sharded_state(layout, self.rows_per_shard, self._mesh)
        self._k_pool, self._v_pool = sharding.make_pools(geometry, plan.managed_num_blocks, self._mesh)
        self._cross = CrossAttentionStore(
            cross_attention, geometry, self.num_rows,
            NamedSharding(self._mesh, sharding.cross_attention_spec(5, row_axis=0, head_axis=3)))
        self._in_flight: ChunkStep | Recache | None = None
        self._lock = threading.RLock()

    # -- sizes and views -------------------------------------------------------------------------------
    @property
    def cross_attention(self) -> dict[str, CrossAttentionSpec]:
        """The cross-attention specs by name."""
        return self._cross.specs

    @property
    def num_shards(self) -> int:
        """Data shards (1 without a mesh)."""
        return self._sessions.num_shards

    @property
    def slots_per_shard(self) -> int:
        """Resident sessions one data shard holds (the plan's capacity)."""
        return self._sessions.slots_per_shard

    @property
    def session_capacity(self) -> int:
        """Resident sessions the cache admits, all shards (LRU eviction beyond)."""
        return self._sessions.capacity

    @property
    def rows_per_shard(self) -> int:
        """Block-table rows of one data shard: its slots x logical branches."""
        return self._sessions.rows_per_shard

    @property
    def num_rows(self) -> int:
        """Rows of all shards: capacity x logical branches. Row ``r`` is row ``r % rows_per_shard``
        of shard ``r // rows_per_shard``."""
        return self._sessions.num_rows

    @property
    def pages_per_shard(self) -> int:
        """Pool pages of one data shard, its null page included; pool page ``p`` is page
        ``p % pages_per_shard`` of shard ``p // pages_per_shard``."""
        return self.plan.managed_num_blocks

    @property
    def state(self) -> core.BlockTableState:
        """The committed block-table state, always a *sharded* state, with or without a mesh: every
        leaf has a leading ``[num_shards]`` axis (1 without a mesh), and
        :func:`arkv_jax.sharding.unstack_state` gives one shard's ordinary state."""
        return self._state

    @property
    def pools(self) -> tuple[Array, Array]:
        """``(k_pool, v_pool)``, each :func:`pallas_kernels.layout.pool_shape` ``(layers, shards x
        pages_per_shard, block_size, kv_heads, head_dim)``, i.e. ``[layers, kv_heads, pages,
        block_size, head_dim]`` (sharded with :func:`arkv_jax.sharding.pool_spec` on a mesh)."""
        return self._k_pool, self._v_pool

    @property
    def sessions(self) -> tuple[str, ...]:
        """Resident sessions, least recently used first."""
        return self._sessions.sessions

    def num_free_pages(self) -> int:
        """Free managed pages, all shards (host sync)."""
        with self._lock:
            return int(jnp.sum(self._state.free_count))

    @property
    def total_pages(self) -> int:
        """Managed pages that can be allocated, all shards (the null pages excluded): always
        :meth:`num_free_pages` plus the pages the resident sessions hold."""
        return self.num_shards * (self.pages_per_shard - 1)

    def max_chunk_frames(self, rows_per_shard: int | None = None) -> int:
        """The largest ``num_frames`` a chunk of ``rows_per_shard`` rows on one data shard (default:
        every row of the shard, a chunk of every session and branch) can always take: with every
        row holding its most frames between chunks (sink + window; sink only in reset mode), the
        row's page table still has room for the chunk and the shard's pages still hold it. Never
        above ``window.window_frames``; a value at or below it is valid for the whole life of the
        sessions, one above is refused at the first call.
        """
        rows = self.rows_per_shard if rows_per_shard is None else rows_per_shard
        w, ppf = self.window, self.geometry.pages_per_frame
        held = w.sink_frames + (0 if w.reset_at_boundary else w.window_frames)
        table_room = self._state.layout.table_width // ppf - held
        spare = (self.pages_per_shard - 1) // ppf - self.rows_per_shard * held
        return max(0, min(w.window_frames, table_room, spare // max(1, rows)))

    def slot(self, session_id: str) -> int:
        """The slot of a resident session (``KeyError`` if unknown): its rows are ``slot *
        len(kv_branches) + branch``, its data shard ``slot // slots_per_shard``."""
        _check_session_id(session_id)
        return self._sessions.slot(session_id)

    def rows(self, session_ids: Sequence[str], branches: Sequence[str] | None = None) -> np.ndarray:
        """Global rows of ``session_ids`` x ``branches`` (all branches by default), session-major
        (``KeyError`` for an unknown session or branch)."""
        session_ids = require_str_sequence("session_ids", session_ids, allow_empty=True)
        if branches is not None:
            branches = require_str_sequence("branches", branches)
        return self._sessions.rows(session_ids, branches)

    def pages_held(self, session_ids: Sequence[str]) -> dict[str, np.ndarray]:
        """Pool pages each session holds (all its branches), sorted (host sync; ``KeyError`` for an
        unknown session)."""
        session_ids = require_str_sequence("session_ids", session_ids, allow_empty=True)
        if not session_ids:
            return {}
        with self._lock:
            return self._pages_held(session_ids)

    def _pages_held(self, session_ids: tuple[str, ...]) -> dict[str, np.ndarray]:
        rows = self.rows(session_ids)
        pages, counts = (np.asarray(a) for a in programs.resident_pages(
            self._state, self._sessions.every_local_row(), mesh=self._mesh))
        held = [SessionTable.pool_pages(s, pages[s, r, :counts[s, r]], self.pages_per_shard)
                for s, r in zip(*self._sessions.split_rows(rows))]
        per_session = len(rows) // len(session_ids)
        return {sid: np.sort(np.concatenate(held[i * per_session:(i + 1) * per_session]))
                for i, sid in enumerate(session_ids)}

    # -- session lifecycle ---------------------------------------------------------------------------
    def open(self, session_id: str) -> None:
        """Opens ``session_id`` or marks it most recently used. At capacity, the least recently used
        sessions are closed first (``on_release(..., "lru_eviction")``). A new session takes a free
        slot of the data shard holding the fewest sessions.

        Raises:
          TypeError: not a string. ValueError: empty. RuntimeError: a new session while a chunk is
            in flight. CallbackError: an eviction callback raised (the new session *is* open).
        """
        _check_session_id(session_id)
        with self._lock:
            if session_id in self._sessions:
                self._sessions.touch([session_id])
                return
            self._require_idle("open a session")
            events = []
            while self._sessions.is_full:
                events.append(self._release(self._sessions.least_recent, "lru_eviction"))
            slot = self._sessions.admit(session_id)
            self._state, _ = programs.begin(self._state, self._sessions.slot_local_rows(slot), mesh=self._mesh)
            self._notify(events)

    def close(self, session_id: str) -> None:
        """Closes a session (``KeyError`` if unknown): all its pages and cross-attention caches are
        released (a raising ``on_release`` is a :class:`CallbackError` after the close)."""
        with self._lock:
            self.slot(session_id)
            self._require_idle("close a session")
            self._notify([self._release(session_id, "close")])

    def reset(self, session_id: str, *, keep_cross_attention: Iterable[str] = ()) -> None:
        """Restarts a session from frame 0: its pages are released, the named cross-attention
        caches kept (e.g. the text K/V across a window reset), the others cleared.

        Raises:
          TypeError: ``keep_cross_attention`` is a string or holds a non-string.
          KeyError: unknown session, or unknown cache names in ``keep_cross_attention``.
          CallbackError: ``on_release`` raised (after the reset).
        """
        keep = set(require_str_sequence("keep_cross_attention", keep_cross_attention, allow_empty=True))
        unknown = sorted(keep - set(self.cross_attention))
        if unknown:
            raise KeyError(f"Unknown cross-attention caches to keep: {unknown}; expected names in "
                           f"{tuple(self.cross_attention)}")
        with self._lock:
            slot = self.slot(session_id)
            self._require_idle("reset a session")
            rows = self._sessions.slot_local_rows(slot)
            self._state, _ = programs.end(self._state, rows, mesh=self._mesh)
            self._state, _ = programs.begin(self._state, rows, mesh=self._mesh)
            self._cross.release(self._sessions.slot_rows(slot), set(self.cross_attention) - keep)
            self._notify([(session_id, "reset")])

    # -- cross-attention caches ----------------------------------------------------------------------
    def populate_cross_attention(self, session_id: str, name: str, branch: str,
                                 layer_kv: Iterable[tuple[Array, Array]]) -> None:
        """Publishes one session's cross-attention K/V for ``name`` and ``branch``, atomically.

        ``layer_kv`` yields one ``(k, v)`` per layer, each ``[tokens, heads, head_dim]`` (a leading
        batch axis of 1 is accepted). Nothing is published unless every layer arrived and
        validated; a failure leaves the previous cache visible.

        Raises:
          KeyError: unknown session, cache or branch. ValueError: wrong layer count or shape.
          TypeError: a non-string id, name or branch, or K/V of a non-floating dtype (refused, not
            cast). RuntimeError: a chunk is in flight (its forward may be reading the tables).
        """
        _check_session_id(session_id)
        for label, value in (("name", name), ("branch", branch)):
            if not isinstance(value, str):
                raise ArgumentTypeError(f"{label} must be a string, got {value!r} ({type(value).__name__})")
        with self._lock:
            row = int(self.rows([session_id], [branch])[0])
            self._cross.spec(name)
            self._require_idle("populate a cross-attention cache")
            self._cross.populate(name, row, layer_kv, label=_cross_label(session_id, branch))

    def is_cross_attention_populated(self, session_id: str, name: str, branch: str) -> bool:
        """Whether ``populate_cross_attention`` published this cache."""
        self._cross.spec(name)
        return self._cross.is_populated(name, int(self.rows([session_id], [branch])[0]))

    def cross_attention_kv(self, name: str) -> tuple[Array, Array]:
        """The stacked cache ``name``: ``(k, v)``, each ``[rows, layers, tokens, heads, head_dim]``
        in global row order (rows on ``"data"``, heads on ``"model"`` with a mesh); a batch's
        rows are :meth:`cross_attention_rows`. Rows never populated (or released) are zero."""
        return self._cross.kv(name)

    def cross_attention_rows(self, cross_kv: tuple[Array, Array], inputs: ChunkInputs
                             ) -> tuple[Array, Array]:
        """The batch's rows of a cross-attention cache (traceable, e.g. inside a jitted forward):
        ``cross_kv`` from :meth:`cross_attention_kv`, ``inputs`` from ``step.inputs``. Returns
        ``(k, v)``, each ``[layers, B, tokens, heads, head_dim]``; padding rows are zero. With a
        mesh each data shard reads its own rows (no communication). Compiled once per shape
        (eager calls do not re-trace)."""
        k_table, v_table = cross_kv
        return _cross_attention_rows(k_table, v_table, inputs.rows, mesh=self._mesh)

    def clear_cross_attention(self, session_id: str) -> None:
        """Clears every cross-attention cache of a session (a prompt switch); self-attention
        history is kept (``RuntimeError`` while a chunk is in flight)."""
        with self._lock:
            slot = self.slot(session_id)
            self._require_idle("clear cross-attention caches")
            self._cross.release(self._sessions.slot_rows(slot))

    # -- the per-chunk protocol ----------------------------------------------------------------------
    @contextlib.contextmanager
    def chunk(self, session_ids: Sequence[str], num_frames: int, branches: Sequence[str] | None = None,
              *, full_batch: bool | None = None):
        """Prepares one chunk of ``num_frames`` frames for ``session_ids`` x ``branches``.

        Yields a :class:`ChunkStep`: run the denoise steps and the commit forward on
        ``step.inputs``, then call ``step.commit(k_new, v_new)``. If the ``with`` block raises, nothing is
        committed (or, with ``fail_closed``, the sessions are closed) and the exception propagates.

        Batch layout: by default the batch holds the rows of ``session_ids`` x ``branches`` in that
        order (session-major); each new batch size compiles the bookkeeping once. With
        ``full_batch=True`` (always on with a mesh) it holds every slot: batch row
        ``slot * len(branches) + i`` is branch ``branches[i]`` of the session in that slot
        (:meth:`slot`), and slots not in ``session_ids`` are padding rows (see
        :class:`~arkv_jax.step.ChunkInputs`), so its shape never changes.

        Frames: ``num_frames`` is an int in ``[1, max_chunk_frames(rows)]``, where ``rows`` is the
        chunk's rows on its busiest data shard (:meth:`max_chunk_frames`): the most frames the pool
        holds for those rows even when every row of the shard holds its full window, so a value
        accepted once works for the whole life of the sessions.

        Raises:
          TypeError: ``session_ids`` or ``branches`` is a string or holds non-strings, ``num_frames``
            is not an int (a bool is not one), ``full_batch`` is not a bool or None.
          KeyError: unknown session or branch. ValueError: no session, ``num_frames`` out of range,
            repeated sessions or branches, or ``full_batch=False`` with a mesh.
          RuntimeError: another chunk is in flight, or the pool cannot hold the chunk (nothing
            changes: not the state, not the LRU order).
        """
        session_ids = require_str_sequence("session_ids", session_ids)
        if isinstance(num_frames, (bool, np.bool_)) or not isinstance(num_frames, (int, np.integer)):
            raise ArgumentTypeError(f"num_frames must be an int in [1, {self.window.window_frames}] "
                                    f"(window_frames), got {num_frames!r} ({type(num_frames).__name__})")
        num_frames = int(num_frames)
        names = self._sessions.branches if branches is None else require_str_sequence("branches", branches)
        full_batch = self._full_batch(full_batch)
        with self._lock:
            local, owners = self._sessions.batch(session_ids, names, full_batch=full_batch)
            busiest = int(np.max(np.sum(np.asarray(local) >= 0, axis=1)))
            limit = self.max_chunk_frames(busiest)
            if not 1 <= num_frames <= limit:
                raise ValueError(
                    f"num_frames must be an int in [1, {limit}], got {num_frames!r} (at most window_frames="
                    f"{self.window.window_frames}, at most what a row's page table of "
                    f"{self._state.layout.table_width} pages holds beside its window, and at most what "
                    f"{self.pages_per_shard - 1} pages per shard hold for a chunk of {busiest} rows while "
                    "every row holds its window)")
            self._require_idle("start a chunk")
            pending, inputs, ok = programs.prepare(self._state, jnp.asarray(local), num_frames=num_frames,
                                                   mesh=self._mesh)
            if not bool(jnp.all(ok)):
                raise RuntimeError(
                    f"KV pool exhausted while allocating a chunk of {num_frames} frames for "
                    f"{len(session_ids) * len(names)} rows ({self.num_free_pages()} pages free)")
            self._sessions.touch(session_ids)
            step = ChunkStep(inputs, owners, num_frames, pending, on_commit=self._commit)
            self._in_flight = step
        try:
            yield step
        except BaseException as exc:
            with self._lock:
                self._in_flight = None
                if self.fail_closed:
                    events = [self._release(sid, "forward_exception")
                              for sid in session_ids if sid in self._sessions]
                    for sid, reason, error in self._call_back(events):
                        _log.error("on_release(%r, %r) raised while closing a failed chunk", sid, reason,
                                   exc_info=error)
                        if hasattr(exc, "add_note"):
                            exc.add_note(f"on_release({sid!r}, {reason!r}) raised {type(error).__name__}: {error}")
            raise
        finally:
            with self._lock:
                if self._in_flight is step:
                    self._in_flight = None

    # -- recomputing a session's history -------------------------------------------------------------
    @contextlib.contextmanager
    def recache(self, session_id: str, chunk_frames: int | None = None, *, sink: str = "keep",
                branches: Sequence[str] | None = None, full_batch: bool | None = None):
        """Recomputes a session's history K/V into fresh pages (a prompt switch's KV recache); see
        :mod:`arkv_jax.cache.recache`.

        Yields a :class:`~arkv_jax.cache.recache.Recache`: for each ``unit`` of ``recache.units`` in
        order, run the forward on ``unit.inputs`` (``unit.num_frames`` frames from
        ``unit.first_frame``) and ``recache.write(k, v)``; stage
        new cross-attention K/V with ``recache.populate_cross_attention``; then ``recache.commit()``
        swaps the fresh pages in and publishes the staged K/V at once. If the ``with`` block exits
        without a commit (an exception, or no call), nothing changed: the session keeps its pages
        and cross-attention K/V. While it is in flight the cache refuses chunks and lifecycle calls,
        as for a chunk.

        Args:
          session_id: an open session.
          chunk_frames: frames per chunk of the session's stream (default
            ``geometry.frames_per_forward``); the session must stand at a multiple of it.
          sink: ``"keep"`` the sink's K/V (LongLive's default) or ``"recompute"`` them too.
          branches: the KV branches to recompute (default: all).
          full_batch: the units' batch layout, as for :meth:`chunk`: the session's rows only, in
            ``branches`` order (the default without a mesh), or the full batch (always with a
            mesh): batch row ``slot * len(branches) + i`` is the session's branch ``branches[i]``,
            every other row padding (:data:`arkv_jax.step.PADDING`), so a sharded forward sees the
            shapes and shardings of a chunk.

        Raises:
          KeyError: unknown session or branch. TypeError/ValueError: a bad ``sink``, ``chunk_frames``,
            ``branches`` (repeated) or ``full_batch`` (``False`` with a mesh), or a session not at a
            chunk boundary.
          RuntimeError: a chunk or recache is in flight, or the pool lacks the fresh pages
            (nothing changes).
        """
        if not isinstance(sink, str) or sink not in SINK_MODES:
            raise ValueError(f"sink must be one of {SINK_MODES}, got {sink!r}")
        chunk_frames = require_int("chunk_frames", self.geometry.frames_per_forward if chunk_frames is None
                                   else chunk_frames, minimum=1, maximum=self.window.window_frames)
        names = self._sessions.branches if branches is None else require_str_sequence("branches", branches)
        if len(set(names)) != len(names):
            raise ValueError(f"branches must not repeat, got {list(names)}")
        full_batch = self._full_batch(full_batch)
        with self._lock:
            slot = self.slot(session_id)
            shard, local = self._sessions.shard(slot), self.rows([session_id], names) % self.rows_per_shard
            self._require_idle("recompute a session's K/V")
            plan = plan_recache(_shard_state(self._state, shard), local, self.window, chunk_frames, sink)
            units, positions, batch = plan.units, np.arange(len(names)), len(names)
            if full_batch:
                positions, batch = slot * len(names) + positions, self.session_capacity * len(names)
                units = tuple(u._replace(inputs=place_rows(u.inputs, positions, batch)) for u in units)
            rows = np.full((self.num_shards, len(names)), -1, np.int32)
            replace = np.zeros((self.num_shards, *plan.replace.shape), bool)
            rows[shard], replace[shard] = local, plan.replace
            job = Recache(session_id, tuple(names), sink, plan.frames, units, positions, batch,
                          on_write=self._recache_write, on_stage=self._recache_stage,
                          on_commit=functools.partial(self._recache_commit, rows=rows, replace=replace))
            self._in_flight = job
        try:
            yield job
        finally:
            with self._lock:
                if self._in_flight is job:
                    self._in_flight = None

    def _recache_job(self, job: Recache) -> None:
        if self._in_flight is not job or job.committed:
            raise RuntimeError("this recache is not in flight (already committed, or its with-block has exited)")

    def _recache_write(self, job: Recache, k_new: Array, v_new: Array) -> None:
        g = self.geometry
        with self._lock:
            self._recache_job(job)
            unit = job.next_unit
            if unit is None:
                raise RuntimeError(f"all {len(job.units)} units of this recache are written; commit it")
            expected = (g.num_layers, unit.inputs.rows.shape[0], unit.num_frames * g.tokens_per_frame,
                        g.num_kv_heads, g.head_dim)
            _check_kv("k_new", k_new, expected)
            _check_kv("v_new", v_new, expected)
            self._k_pool, self._v_pool = programs.write(
                self._k_pool, self._v_pool, jnp.asarray(k_new, g.dtype), jnp.asarray(v_new, g.dtype),
                unit.inputs.write_pages, tokens_per_frame=g.tokens_per_frame, backend=self.backend, mesh=self._mesh)
            job.written += 1

    def _recache_stage(self, job: Recache, name: str, branch: str, layer_kv) -> None:
        with self._lock:
            self._recache_job(job)
            row = int(self.rows([job.session_id], [branch])[0])
            job.staged[name, row] = self._cross.collect(name, layer_kv, label=_cross_label(job.session_id, branch))

    def _recache_commit(self, job: Recache, *, rows: np.ndarray, replace: np.ndarray) -> None:
        with self._lock:
            self._recache_job(job)
            if job.next_unit is not None:
                raise RuntimeError(f"{job.written} of {len(job.units)} recache units are written; write them all "
                                   "before committing")
            state, ok = programs.swap_pages(self._state, jnp.asarray(rows), jnp.asarray(replace), mesh=self._mesh)
            self._state = state  # unchanged unless ok (all or nothing)
            if not bool(jnp.all(ok)):  # plan_recache checked every condition under this lock
                raise RuntimeError("the page swap of a recache was refused; nothing changed")
            for (name, row), (k, v) in job.staged.items():
                self._cross.publish(name, row, k, v)
            job.committed = True

    # -- helpers -------------------------------------------------------------------------------------
    def _commit(self, step: ChunkStep, k_new: Array, v_new: Array) -> None:
        """:meth:`ChunkStep.commit`: checks the step and the shapes, then writes and commits."""
        g = self.geometry
        expected = (g.num_layers, len(step.session_ids), step.num_frames * g.tokens_per_frame, g.num_kv_heads,
                    g.head_dim)
        with self._lock:
            if self._in_flight is not step or step.committed:
                raise RuntimeError("this chunk is not in flight (already committed, or its with-block has exited)")
            _check_kv("k_new", k_new, expected)
            _check_kv("v_new", v_new, expected)
            self._k_pool, self._v_pool, self._state, _ = programs.commit(
                self._k_pool, self._v_pool, step.pending, jnp.asarray(k_new, g.dtype), jnp.asarray(v_new, g.dtype),
                step.inputs, num_frames=step.num_frames, backend=self.backend, mesh=self._mesh)
            step.committed = True

    def _full_batch(self, full_batch: bool | None) -> bool:
        """A ``full_batch`` argument resolved: ``None`` means full batches on a mesh only."""
        if full_batch is None:
            return self.mesh is not None
        require_bool("full_batch", full_batch)
        if not full_batch and self.mesh is not None:
            raise ValueError("a sharded cache hands out full batches only (full_batch=True): each data "
                             "shard must see the same rows every chunk")
        return bool(full_batch)

    def _require_idle(self, what: str) -> None:
        if self._in_flight is not None:
            raise RuntimeError(f"cannot {what} while a chunk is in flight; commit it or leave its with-block first")

    def _release(self, session_id: str, reason: str) -> tuple[str, str]:
        """Releases a session's slot, pages and cross-attention rows; returns the callback event
        ``(session_id, reason)`` for :meth:`_notify` (callbacks run after the bookkeeping)."""
        slot = self._sessions.remove(session_id)
        self._state, _ = programs.end(self._state, self._sessions.slot_local_rows(slot), mesh=self._mesh)
        self._cross.release(self._sessions.slot_rows(slot))
        return session_id, reason

    def _call_back(self, events) -> list[tuple[str, str, Exception]]:
        """Calls ``on_release`` for every event, even after one raised; returns the errors."""
        errors = []
        if self.on_release is not None:
            for sid, reason in events:
                try:
                    self.on_release(sid, reason)
                except Exception as error:  # noqa: BLE001 - reported after the bookkeeping
                    errors.append((sid, reason, error))
        return errors

    def _notify(self, events) -> None:
        """Runs the callbacks of finished bookkeeping; raises :class:`CallbackError` from the first
        error, naming them all."""
        errors = self._call_back(events)
        if errors:
            sid, reason, error = errors[0]
            calls = ", ".join(f"on_release({s!r}, {r!r})" for s, r, _ in errors)
            raise CallbackError(f"{calls} raised ({type(error).__name__}: {error}); the cache finished "
                                "the operation first") from error
