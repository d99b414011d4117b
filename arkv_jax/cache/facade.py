"""The cache facade: what a model author holds (:class:`PagedKVCache`).

The facade validates every argument and delegates: the sizes are one frozen
:class:`~arkv_jax.cache.layout.CacheLayout` (:attr:`PagedKVCache.layout`); the state, pools, lock and
the one transaction in flight are the :class:`~arkv_jax.cache.core.CacheCore`; a chunk is a
:class:`~arkv_jax.cache.chunk.ChunkStep` and a prompt switch's recomputation a
:class:`~arkv_jax.cache.recache.Recache`, each owning its write, commit and abort; sessions are the
:class:`~arkv_jax.cache.sessions.SessionTable`, text K/V the
:class:`~arkv_jax.cache.cross_attention.CrossAttentionStore`, batch rows
:mod:`~arkv_jax.cache.batch`. The protocol, threads, failure and isolation: ``docs/protocol.md``.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from arkv_jax import sharding
from arkv_jax import state as state_lib
from arkv_jax.cache import callbacks, programs
from arkv_jax.cache.batch import resolve_buckets, resolve_full_batch
from arkv_jax.cache.callbacks import CallbackError
from arkv_jax.cache.chunk import ChunkStep
from arkv_jax.cache.core import CacheCore, cross_label
from arkv_jax.cache.layout import CacheLayout
from arkv_jax.cache.recache import Recache
from arkv_jax.config import (
    ArgumentTypeError,
    CacheGeometry,
    CrossAttentionSpec,
    KVBranch,
    WindowPolicy,
    require_bool,
    require_str_sequence,
    validate_branches,
)
from arkv_jax.planner import DevicePlan, MemoryPlan, resolve_plan
from arkv_jax.step import ChunkInputs
from pallas_kernels.backend import BACKEND_NAMES

Array = jax.Array

__all__ = ["CallbackError", "ChunkStep", "PagedKVCache", "Recache"]


def _check_session_id(session_id) -> None:
    if not isinstance(session_id, str):
        raise ArgumentTypeError(f"session_id must be a non-empty string, got {session_id!r} "
                                f"({type(session_id).__name__})")
    if not session_id:
        raise ValueError(f"session_id must be a non-empty string, got {session_id!r}")


def _check_options(device, mesh, backend, fail_closed, on_release) -> None:
    """The constructor's checks of its options (see :class:`PagedKVCache`)."""
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


class PagedKVCache:
    """Paged K/V for many concurrent video sessions, on one device or a mesh.

    Args:
      geometry, window: cache shape and window policy (``geometry.num_kv_heads``: all heads).
      kv_branches: logical KV branches (e.g. CFG ``positive``/``negative``); each session has one row
        per branch (global row ``slot * len(kv_branches) + branch``).
      cross_attention: named dense cross-attention caches per session and branch.
      plan, available_bytes, memory_fraction, session_capacity: the memory plan of *one device*, or
        what to plan it from (:func:`arkv_jax.planner.resolve_plan`: without a plan, budget or
        fraction, exactly ``session_capacity`` sessions, counted over all shards).
      device: where everything lives without a mesh (default: the first local device).
      mesh: a ``("data", "model")`` mesh (:func:`arkv_jax.sharding.make_mesh`): sessions split over
        ``"data"`` (each data shard its own pools slice, state and free list, ``slots_per_shard``
        sessions), K/V heads over ``"model"``; chunks are full batches. Exclusive with ``device``;
        a mesh with Explicit axes is used through its Auto view (:attr:`mesh`).
      backend: kernel backend for the page writes (:mod:`pallas_kernels.backend`).
      fail_closed: close the sessions of a chunk whose forward raised, instead of keeping them at
        their last committed chunk.
      on_release: called as ``on_release(session_id, reason)`` when a session is closed, reset or
        evicted (reason ``"close"``, ``"reset"``, ``"lru_eviction"``, ``"forward_exception"``).

    Threads, callbacks, atomicity (``docs/protocol.md``). One chunk or recache is in flight at a
    time; a call that cannot run meanwhile is refused at once with a ``RuntimeError`` naming it
    ("... while a chunk is in flight", "... while a recache is in flight"), never queued; every
    mutation runs under one reentrant lock. A raising ``on_release`` never interrupts the
    bookkeeping (:mod:`~arkv_jax.cache.callbacks`). A refused call changes nothing.

    Raises:
      TypeError: a wrong type. ValueError: an unknown ``backend``, a plan for other settings or
        another mesh, ``device`` and ``mesh`` together, K/V heads not divisible by ``"model"``, or
        what the planner rejects.
    """

    def __init__(self, geometry: CacheGeometry, window: WindowPolicy,
                 kv_branches: Sequence[KVBranch] = (KVBranch("main"),),
                 cross_attention: Sequence[CrossAttentionSpec] = (), *,
                 plan: MemoryPlan | DevicePlan | None = None, available_bytes: int | None = None,
                 memory_fraction: float | None = None, session_capacity: int = 1, device=None,
                 mesh: Mesh | None = None, backend: str = "auto", fail_closed: bool = False,
                 on_release: Callable[[str, str], None] | None = None) -> None:
        _check_options(device, mesh, backend, fail_closed, on_release)
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
        device_mesh = mesh or sharding.make_mesh(1, 1, [device or jax.local_devices()[0]])
        self._core = CacheCore(geometry, window, plan, device_mesh, tuple(cross_attention), backend)

    # -- sizes and views -------------------------------------------------------------------------------
    @property
    def layout(self) -> CacheLayout:
        """The cache's sizes (shards, slots, rows, pages, bytes): one frozen value."""
        return self._core.layout

    num_shards = property(lambda self: self.layout.num_shards, doc="Data shards (1 without a mesh).")
    slots_per_shard = property(lambda self: self.layout.slots_per_shard,
                               doc="Resident sessions one data shard holds (the plan's capacity).")
    session_capacity = property(lambda self: self.layout.session_capacity,
                                doc="Resident sessions the cache admits, all shards (LRU eviction beyond).")
    rows_per_shard = property(lambda self: self.layout.rows_per_shard,
                              doc="State rows of one data shard: its slots x branches.")
    num_rows = property(lambda self: self.layout.num_rows, doc="State rows of all shards (:class:`CacheLayout`).")
    pages_per_shard = property(lambda self: self.layout.pages_per_shard,
                               doc="Pool pages of one data shard, its null page included.")
    total_pages = property(lambda self: self.layout.total_pages,
                           doc="Pages that can be allocated, all shards: always :meth:`num_free_pages` plus "
                               "the pages the resident sessions hold.")

    @property
    def cross_attention(self) -> dict[str, CrossAttentionSpec]:
        """The cross-attention specs by name."""
        return self._core.cross.specs

    @property
    def state(self) -> state_lib.BlockTableState:
        """The committed block-table state, always *sharded* (a leading ``[num_shards]`` axis on every
        leaf, 1 without a mesh; :func:`arkv_jax.sharding.unstack_state` gives one shard's)."""
        return self._core.state

    @property
    def pools(self) -> tuple[Array, Array]:
        """``(k_pool, v_pool)``, each :func:`pallas_kernels.layout.pool_shape` of ``geometry.page_dtype`` (a
        :class:`~pallas_kernels.layout.QuantizedPool` if quantized; :func:`arkv_jax.sharding.pool_spec` on a mesh)."""
        return self._core.k_pool, self._core.v_pool

    sessions = property(lambda self: self._core.sessions.sessions, doc="Resident sessions, least recently used first.")
    slots = property(lambda self: dict(self._core.sessions.placement()),
                     doc="Each resident session's slot, least recently used first (the same on every process).")

    def is_local(self, session_id: str) -> bool:
        """Whether a session's data shard is on this process's devices (``KeyError`` if unknown)."""
        return self._core.is_local(self.slot(session_id))

    def num_free_pages(self) -> int:
        """Free managed pages, all shards (host sync; on several processes a collective)."""
        return self._core.num_free_pages()

    def max_chunk_frames(self, rows_per_shard: int | None = None) -> int:
        """The largest ``num_frames`` a chunk of ``rows_per_shard`` rows on one data shard (default:
        all of them) can always take, for the sessions' whole life
        (:meth:`arkv_jax.config.WindowPolicy.max_chunk_frames`)."""
        return self.layout.max_chunk_frames(rows_per_shard)

    def uses_full_batch(self, full_batch: bool | None = None) -> bool:
        """Whether chunks and recaches asked with ``full_batch`` run the full batch: ``None`` means
        on a mesh only; ``False`` on a mesh is refused (``ValueError``)."""
        return resolve_full_batch(full_batch, self.mesh is not None)

    def slot(self, session_id: str) -> int:
        """The slot of a resident session (``KeyError`` if unknown): its rows are ``slot *
        len(kv_branches) + branch``, its data shard ``slot // slots_per_shard``."""
        _check_session_id(session_id)
        return self._core.sessions.slot(session_id)

    def rows(self, session_ids: Sequence[str], branches: Sequence[str] | None = None) -> np.ndarray:
        """Global rows of ``session_ids`` x ``branches`` (all branches by default), session-major
        (``KeyError`` for an unknown session or branch)."""
        session_ids = require_str_sequence("session_ids", session_ids, allow_empty=True)
        if branches is not None:
            branches = require_str_sequence("branches", branches)
        return self._core.sessions.rows(session_ids, branches)

    def pages_held(self, session_ids: Sequence[str]) -> dict[str, np.ndarray]:
        """Pool pages each session holds (all its branches), sorted (host sync, a collective on
        several processes; ``KeyError`` for an unknown session)."""
        session_ids = require_str_sequence("session_ids", session_ids, allow_empty=True)
        return self._core.pages_held(session_ids) if session_ids else {}

    # -- session lifecycle ---------------------------------------------------------------------------
    def open(self, session_id: str) -> None:
        """Opens ``session_id`` or marks it most recently used. At capacity, the least recently used
        sessions are closed first (``on_release(..., "lru_eviction")``). A new session takes a free
        slot of the data shard holding the fewest sessions.

        Raises:
          TypeError: not a string. ValueError: empty. RuntimeError: a new session while a chunk or
            recache is in flight. CallbackError: an eviction callback raised (the new session *is* open).
        """
        _check_session_id(session_id)
        core = self._core
        with core.lock:
            if session_id in core.sessions:
                core.sessions.touch([session_id])
                return
            core.require_idle("open a session")
            events = []
            while core.sessions.is_full:
                events.append(core.release(core.sessions.least_recent, "lru_eviction"))
            core.admit(session_id)
            callbacks.notify(self.on_release, events)

    def close(self, session_id: str) -> None:
        """Closes a session (``KeyError`` if unknown): all its pages and cross-attention caches are
        released (a raising ``on_release`` is a :class:`CallbackError` after the close)."""
        with self._core.lock:
            self.slot(session_id)
            self._core.require_idle("close a session")
            callbacks.notify(self.on_release, [self._core.release(session_id, "close")])

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
        with self._core.lock:
            self.slot(session_id)
            self._core.require_idle("reset a session")
            self._core.restart(session_id, set(self.cross_attention) - keep)
            callbacks.notify(self.on_release, [(session_id, "reset")])

    # -- cross-attention caches ----------------------------------------------------------------------
    def populate_cross_attention(self, session_id: str, name: str, branch: str,
                                 layer_kv: Iterable[tuple[Array, Array]]) -> None:
        """Publishes one session's cross-attention K/V for ``name`` and ``branch``, atomically.

        ``layer_kv`` yields one ``(k, v)`` per layer, each ``[tokens, heads, head_dim]`` (a leading
        axis of 1 is accepted); nothing is published unless every layer arrived and validated.

        Raises:
          KeyError: unknown session, cache or branch. ValueError: wrong layer count or shape.
          TypeError: a non-string id, name or branch, or K/V of a non-floating dtype (refused, not
            cast). RuntimeError: a chunk or recache is in flight (its forward may read the tables).
        """
        _check_session_id(session_id)
        for label, value in (("name", name), ("branch", branch)):
            if not isinstance(value, str):
                raise ArgumentTypeError(f"{label} must be a string, got {value!r} ({type(value).__name__})")
        with self._core.lock:
            row = int(self.rows([session_id], [branch])[0])
            self._core.cross.spec(name)
            self._core.require_idle("populate a cross-attention cache")
            self._core.cross.populate(name, row, layer_kv, label=cross_label(session_id, branch))

    def is_cross_attention_populated(self, session_id: str, name: str, branch: str) -> bool:
        """Whether ``populate_cross_attention`` published this cache."""
        self._core.cross.spec(name)
        return self._core.cross.is_populated(name, int(self.rows([session_id], [branch])[0]))

    def cross_attention_kv(self, name: str) -> tuple[Array, Array]:
        """The stacked cache ``name``: ``(k, v)``, each ``[rows, layers, tokens, heads, head_dim]``
        in global row order (rows on ``"data"``, heads on ``"model"`` with a mesh); rows never
        populated (or released) are zero. A batch's rows: :meth:`cross_attention_rows`."""
        return self._core.cross.kv(name)

    def cross_attention_rows(self, cross_kv: tuple[Array, Array], inputs: ChunkInputs) -> tuple[Array, Array]:
        """The batch's rows of :meth:`cross_attention_kv` for ``step.inputs`` (traceable; compiled
        once per shape): ``(k, v)``, each ``[layers, B, tokens, heads, head_dim]``, zero at padding
        rows; with a mesh each data shard reads its own rows (no communication)."""
        return programs.cross_attention_rows(cross_kv, inputs.rows, mesh=self._core.mesh)

    def clear_cross_attention(self, session_id: str) -> None:
        """Clears every cross-attention cache of a session (a prompt switch); self-attention
        history is kept (``RuntimeError`` while a chunk or recache is in flight)."""
        with self._core.lock:
            slot = self.slot(session_id)
            self._core.require_idle("clear cross-attention caches")
            self._core.cross.release(self._core.sessions.slot_rows(slot))

    # -- transactions ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def chunk(self, session_ids: Sequence[str], num_frames: int, branches: Sequence[str] | None = None,
              *, full_batch: bool | None = None, buckets: Sequence[int] | None = None):
        """Prepares one chunk of ``num_frames`` frames for ``session_ids`` x ``branches``.

        Yields a :class:`~arkv_jax.cache.chunk.ChunkStep`: run the forwards on ``step.inputs``, then
        ``step.commit(k_new, v_new)``. If the ``with`` block raises, nothing is committed (or, with
        ``fail_closed``, the sessions are closed) and the exception propagates.

        Batch (:mod:`arkv_jax.cache.batch`): the rows of ``session_ids`` x ``branches``, session-major,
        padded to the smallest of ``buckets`` (sessions) if given; with ``full_batch=True`` (always
        on a mesh) every slot, batch row ``slot * len(branches) + i``, idle slots padding.
        ``step.place``/``step.take`` move per-session values in and out. ``num_frames`` is an int in
        ``[1, max_chunk_frames(rows)]`` (``rows``: the chunk's rows on its busiest data shard).

        Raises:
          TypeError: ``session_ids`` or ``branches`` is a string or holds non-strings, ``num_frames``
            is not an int (a bool is not one), ``full_batch`` is not a bool or None.
          KeyError: unknown session or branch. ValueError: no session, ``num_frames`` out of range,
            repeated sessions or branches, bad ``buckets``, or ``full_batch=False`` with a mesh.
          RuntimeError: a chunk or recache is in flight, or the pool cannot hold the chunk (nothing
            changes: not the state, not the LRU order).
        """
        session_ids = require_str_sequence("session_ids", session_ids)
        names = self._core.sessions.branches if branches is None else require_str_sequence("branches", branches)
        full_batch = self.uses_full_batch(full_batch)
        if buckets is not None and not full_batch:
            buckets = resolve_buckets(buckets, len(session_ids), what="len(session_ids)")
        with ChunkStep.start(self._core, session_ids, names, num_frames, full_batch=full_batch, buckets=buckets,
                             fail_closed=self.fail_closed, on_release=self.on_release) as step:
            yield step

    @contextlib.contextmanager
    def recache(self, session_id: str, chunk_frames: int | None = None, *, sink: str = "keep",
                branches: Sequence[str] | None = None, full_batch: bool | None = None):
        """Recomputes a session's history K/V into fresh pages (a prompt switch's KV recache).

        Yields a :class:`~arkv_jax.cache.recache.Recache`: for each ``unit`` of ``job.units`` in
        order, run the forward on ``unit.inputs`` and ``job.write(k, v)``; stage new cross-attention
        K/V with ``job.populate_cross_attention``; ``job.commit()`` swaps the fresh pages in and
        publishes the staged K/V at once. Leaving the block without a commit changes nothing.

        Args:
          session_id: an open session.
          chunk_frames: frames per chunk of the session's stream (default
            ``geometry.frames_per_forward``); the session must stand at a multiple of it.
          sink: ``"keep"`` the sink's K/V (LongLive's default) or ``"recompute"`` them too.
          branches: the KV branches to recompute (default: all).
          full_batch: the units' batch layout, as for :meth:`chunk` (the session at its slot, every
            other row padding).

        Raises:
          KeyError: unknown session or branch. TypeError/ValueError: a bad ``sink``, ``chunk_frames``,
            ``branches`` (repeated) or ``full_batch`` (``False`` with a mesh), or a session not at a
            chunk boundary.
          RuntimeError: a chunk or recache is in flight, or the pool lacks the fresh pages (nothing
            changes). On a mesh that spans processes every process must call it alike (it gathers
            the block tables to plan the recache the same way everywhere).
        """
        names = self._core.sessions.branches if branches is None else require_str_sequence("branches", branches)
        full_batch = self.uses_full_batch(full_batch)
        _check_session_id(session_id)
        with Recache.start(self._core, session_id, tuple(names), chunk_frames, sink, full_batch=full_batch) as job:
            yield job
