"""The cache facade: what a model author holds.

:class:`PagedKVCache` owns the memory plan, the K/V pools, the block-table state, the per-session
cross-attention caches and the session registry. Per chunk it hands a model the jitted inputs of a
forward for many sessions at once (:meth:`PagedKVCache.chunk`), and after the forward succeeded it
writes the clean K/V into the chunk's pages and commits (:meth:`ChunkStep.commit`).

Rows. Every (session, logical KV branch) is one row of the block-table state; a session holds the
rows ``slot * num_branches + branch_index``. All branches of all sessions can run in one batched
forward.

Failure safety. Preparing a chunk allocates its pages in a *pending* copy of the block-table state;
the committed state is replaced only when :meth:`ChunkStep.commit` runs. If the forward raises
inside ``with cache.chunk(...)``, the pending state is dropped: no page leaks and the sessions
continue from their last committed chunk. With ``fail_closed=True`` the sessions of the failed chunk
are closed instead, as vLLM-Omni's runner does. One chunk is in flight at a time.

Isolation. A row's visible window only ever names pages that row holds (the state guarantees it),
padding and unused entries point at the null page, and the attention kernels mask by length with
selection, so freed pages and other sessions' pages never reach an output (tested with NaN-filled
pages). Cross-attention rows are zeroed when a session releases them.

Devices. Without a mesh everything lives on one device. With ``mesh=`` (a ``("data", "model")``
mesh from :func:`arkv_jax.sharding.make_mesh`) the sessions are split over ``"data"``: each data
shard has its own slice of the pools, its own block-table state and free list, and holds
``plan.session_capacity`` sessions (slots ``shard * per_shard ..``); K/V heads are split over
``"model"``. A sharded cache hands out *full batches* (every slot, idle ones as padding rows), so a
chunk's inputs have the same shape and sharding whichever sessions run, and the per-chunk
bookkeeping and page write run on every shard at once without communication.

Scratch pages. The planner keeps the seed's scratch reservation in the budget for exact parity, but
arkv-jax's denoise steps never write the pool (the current chunk's K/V go straight to the attention
kernel), so the pools hold only the managed pages.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from arkv_jax import sharding
from arkv_jax import state as core
from arkv_jax import step as step_lib
from arkv_jax.config import CacheGeometry, CrossAttentionSpec, KVBranch, WindowPolicy, ceil_div, lookup
from arkv_jax.planner import DevicePlan, MemoryPlan, device_free_bytes, local_shapes, plan_memory
from arkv_jax.sharded_kernels import gather_rows
from arkv_jax.step import ChunkInputs

Array = jax.Array


def _flatten_shards(tree):
    """``[data, B, ...]`` leaves to ``[data * B, ...]`` (data-major, no data movement)."""
    return jax.tree_util.tree_map(lambda x: x.reshape(-1, *x.shape[2:]), tree)


@functools.partial(jax.jit, static_argnames=("num_frames", "mesh"))
def _prepare(state, rows, *, num_frames: int, mesh: Mesh):
    """Every shard's :func:`arkv_jax.step.prepare_chunk`; ``rows`` ``[data, B]`` local rows."""
    prepare = sharding.per_shard(functools.partial(step_lib.prepare_chunk, num_frames=num_frames), mesh)
    pending, inputs, ok = prepare(state, rows)
    return pending, _flatten_shards(inputs), ok


@functools.partial(jax.jit, static_argnames=("num_frames", "backend", "mesh"), donate_argnums=(0, 1, 2))
def _commit(k_pool, v_pool, pending, k_new, v_new, inputs: ChunkInputs, *, num_frames: int, backend: str,
            mesh: Mesh):
    """Pools and pending state donated: :func:`arkv_jax.step.commit_chunk` on every device's block
    (the pools' pages and heads; each data shard's state, replicated over ``"model"``)."""
    def body(kp, vp, state, kn, vn, inp):
        state = jax.tree_util.tree_map(lambda x: x[0], state)
        kp, vp, state, ok = step_lib.commit_chunk(kp, vp, state, inp, kn, vn, num_frames=num_frames,
                                                  backend=backend)
        return kp, vp, jax.tree_util.tree_map(lambda x: x[None], state), ok[None]

    pools, rows = sharding.pool_spec(), jax.tree_util.tree_map(lambda x: sharding.row_spec(x.ndim), inputs)
    return sharding.shard_map(body, mesh, (pools, pools, sharding.state_spec(), pools, pools, rows),
                              (pools, pools, sharding.state_spec(), sharding.row_spec(2)), check=False)(
        k_pool, v_pool, pending, k_new, v_new, inputs)


@functools.partial(jax.jit, static_argnames="mesh", donate_argnums=0)
def _begin(state, rows, *, mesh: Mesh):
    return sharding.per_shard(core.begin, mesh)(state, rows)


@functools.partial(jax.jit, static_argnames="mesh", donate_argnums=0)
def _end(state, rows, *, mesh: Mesh):
    return sharding.per_shard(core.end, mesh)(state, rows)


@functools.partial(jax.jit, static_argnames="mesh")
def _resident_blocks(state, rows, *, mesh: Mesh):
    return sharding.per_shard(core.resident_blocks, mesh)(state, rows)


@functools.partial(jax.jit, static_argnames="target", donate_argnums=(0, 1))
def _set_cross_rows(k_cache, v_cache, rows, k_rows, v_rows, *, target: NamedSharding):
    """``k_cache[rows] = k_rows`` (same for V), in place, keeping the caches' sharding."""
    def put(cache, values):
        return jax.lax.with_sharding_constraint(cache.at[rows].set(values), target)

    return put(k_cache, k_rows), put(v_cache, v_rows)


@dataclasses.dataclass
class ChunkStep:
    """One chunk in flight for a batch of rows; see :meth:`PagedKVCache.chunk`.

    Attributes:
      inputs: the forward's :class:`ChunkInputs`.
      session_ids: the session of each batch row (each session repeated per branch), ``None`` for
        padding rows.
      num_frames: frames of the chunk.
    """

    cache: "PagedKVCache"
    inputs: ChunkInputs
    session_ids: tuple[str | None, ...]
    num_frames: int
    pending: core.BlockTableState
    committed: bool = False

    def commit(self, k_new: Array, v_new: Array) -> None:
        """Writes the chunk's clean K/V and commits it (advance + evict). Call after the forward
        succeeded.

        Args:
          k_new, v_new: ``[layers, B, num_frames * tokens_per_frame, kv_heads, head_dim]`` in the
            pool dtype, one row per batch row (padding rows are not written).
        """
        self.cache._commit_step(self, k_new, v_new)


class PagedKVCache:
    """Paged K/V for many concurrent video sessions, on one device or a mesh.

    Args:
      geometry, window: cache shape and window policy (``geometry.num_kv_heads``: all heads).
      kv_branches: logical KV branches (e.g. CFG ``positive``/``negative``); each session has one row
        per branch.
      cross_attention: named dense cross-attention caches per session and branch.
      plan: a :class:`MemoryPlan` of *one device* for these settings (with a mesh: heads divided by
        its ``"model"`` size, e.g. ``plan_per_device(...).plan``), or a
        :class:`~arkv_jax.DevicePlan` for this mesh. Planned here when ``None``, from
        ``available_bytes`` (per device; default: the first device's free memory),
        ``memory_fraction`` and ``session_capacity`` (sessions in all, split evenly over the data
        shards), with in-flight pages reserved for every session (``batched_in_flight=True``) since
        all sessions can run in one chunk.
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

    Raises:
      ValueError: a plan for other settings or another mesh, ``device`` and ``mesh`` together, K/V
        heads not divisible by the mesh's ``"model"`` size, or what the planner rejects.
    """

    def __init__(self, geometry: CacheGeometry, window: WindowPolicy,
                 kv_branches: Sequence[KVBranch] = (KVBranch("main"),),
                 cross_attention: Sequence[CrossAttentionSpec] = (), *,
                 plan: MemoryPlan | DevicePlan | None = None, available_bytes: int | None = None,
                 memory_fraction: float = 0.1, session_capacity: int = 1, device=None, mesh: Mesh | None = None,
                 backend: str = "auto", fail_closed: bool = False,
                 on_release: Callable[[str, str], None] | None = None) -> None:
        if device is not None and mesh is not None:
            raise ValueError("pass device (one device) or mesh (sharded), not both")
        data, model = (1, 1) if mesh is None else sharding.check_mesh(mesh)
        mesh = None if mesh is None else sharding.auto_axes(mesh)
        local_geometry, local_cross = local_shapes(geometry, cross_attention, model)
        if plan is None:
            first_device = mesh.devices.flat[0] if mesh is not None else device
            plan = plan_memory(
                local_geometry, window, kv_branches, cross_attention=local_cross,
                available_bytes=device_free_bytes(first_device) if available_bytes is None else available_bytes,
                memory_fraction=memory_fraction, session_capacity=ceil_div(session_capacity, data),
                batched_in_flight=True)
        elif isinstance(plan, DevicePlan):
            if (plan.data, plan.model) != (data, model):
                raise ValueError(f"plan is for a (data={plan.data}, model={plan.model}) mesh, the cache's "
                                 f"is (data={data}, model={model})")
            plan = plan.plan
        if (plan.geometry, plan.window, plan.kv_branches, plan.cross_attention) != (
                local_geometry, window, tuple(kv_branches), local_cross):
            raise ValueError("plan was made for a different geometry, window, branches or cross-attention"
                             + ("" if model == 1 else " (with a mesh, plan one device: heads divided by the "
                                                      "'model' axis, e.g. planner.plan_per_device)"))
        self.plan, self.geometry, self.window, self.mesh = plan, geometry, window, mesh
        self.kv_branches = plan.kv_branches
        self.cross_attention = {spec.name: spec for spec in cross_attention}
        self.backend, self.fail_closed, self.on_release = backend, fail_closed, on_release
        self.num_shards = data
        self._mesh = mesh or sharding.make_mesh(1, 1, [device or jax.local_devices()[0]])
        self._branch_index = {b.name: i for i, b in enumerate(self.kv_branches)}
        layout = core.StateLayout.from_config(geometry, window, plan.managed_num_blocks)
        self._state = sharding.init_sharded_state(layout, self.rows_per_shard, self._mesh)
        self._k_pool, self._v_pool = sharding.make_pools(geometry, plan.managed_num_blocks, self._mesh)
        self._cross_sharding = NamedSharding(self._mesh, sharding.cross_attention_spec(5, row_axis=0, head_axis=3))
        zeros = jax.jit(lambda shape: jnp.zeros(shape, geometry.dtype), static_argnums=0,
                        out_shardings=self._cross_sharding)
        self._cross = {name: (zeros(self._cross_shape(spec)), zeros(self._cross_shape(spec)))
                       for name, spec in self.cross_attention.items()}
        self._cross_populated: set[tuple[int, str]] = set()  # (row, cache name)
        self._sessions: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._free_slots = list(range(self.session_capacity))
        self._in_flight: ChunkStep | None = None

    # -- sizes and views -------------------------------------------------------------------------------
    @property
    def slots_per_shard(self) -> int:
        """Resident sessions one data shard holds (the plan's capacity)."""
        return self.plan.session_capacity

    @property
    def session_capacity(self) -> int:
        """Resident sessions the cache admits, all shards (LRU eviction beyond)."""
        return self.plan.session_capacity * self.num_shards

    @property
    def rows_per_shard(self) -> int:
        """Block-table rows of one data shard: its slots x logical branches."""
        return self.plan.session_capacity * len(self.kv_branches)

    @property
    def num_rows(self) -> int:
        """Rows of all shards: capacity x logical branches. Row ``r`` is row ``r % rows_per_shard``
        of shard ``r // rows_per_shard``."""
        return self.rows_per_shard * self.num_shards

    @property
    def pages_per_shard(self) -> int:
        """Pool pages of one data shard, its null page included; pool page ``p`` is page
        ``p % pages_per_shard`` of shard ``p // pages_per_shard``."""
        return self.plan.managed_num_blocks

    @property
    def state(self) -> core.BlockTableState:
        """The committed block-table state: an ordinary state without a mesh, a sharded state
        (leading ``[data]`` axis, see :mod:`arkv_jax.sharding`) with one."""
        return self._state if self.mesh is not None else sharding.unstack_state(self._state, 0)

    @property
    def pools(self) -> tuple[Array, Array]:
        """``(k_pool, v_pool)``, each ``[layers, shards x pages_per_shard, block_size, kv_heads,
        head_dim]`` (sharded with :func:`arkv_jax.sharding.pool_spec` on a mesh)."""
        return self._k_pool, self._v_pool

    @property
    def sessions(self) -> tuple[str, ...]:
        """Resident sessions, least recently used first."""
        return tuple(self._sessions)

    def num_free_pages(self) -> int:
        """Free managed pages, all shards (host sync)."""
        return int(jnp.sum(self._state.free_count))

    def slot(self, session_id: str) -> int:
        """The slot of a resident session: its rows are ``slot * len(kv_branches) + branch``, its
        position in a full batch is ``slot``, its data shard ``slot // slots_per_shard``.

        Raises:
          KeyError: unknown session.
        """
        try:
            return self._sessions[session_id]
        except KeyError:
            raise KeyError(f"Unknown session {session_id!r}; open it first") from None

    def rows(self, session_ids: Sequence[str], branches: Sequence[str] | None = None) -> np.ndarray:
        """Global rows of ``session_ids`` x ``branches`` (all branches by default), session-major.

        Raises:
          KeyError: an unknown session or branch.
        """
        names = tuple(self._branch_index) if branches is None else tuple(branches)
        return np.asarray([self.slot(sid) * len(self.kv_branches) + self._branch(name)
                           for sid in session_ids for name in names], np.int32)

    def pages_held(self, session_ids: Sequence[str]) -> dict[str, np.ndarray]:
        """Pool page indices each session holds (all its branches), sorted (host sync).

        Raises:
          KeyError: an unknown session.
        """
        if not session_ids:
            return {}
        rows = self.rows(session_ids)
        every_row = np.tile(np.arange(self.rows_per_shard, dtype=np.int32), (self.num_shards, 1))
        pages, counts = (np.asarray(a) for a in _resident_blocks(self._state, every_row, mesh=self._mesh))
        shard, local = np.divmod(rows, self.rows_per_shard)
        held = [pages[s, r, :counts[s, r]] + s * self.pages_per_shard for s, r in zip(shard, local)]
        per_session = len(rows) // len(session_ids)
        return {sid: np.sort(np.concatenate(held[i * per_session:(i + 1) * per_session]))
                for i, sid in enumerate(session_ids)}

    # -- session lifecycle ---------------------------------------------------------------------------
    def open(self, session_id: str) -> None:
        """Opens ``session_id`` or marks it most recently used. At capacity, the least recently used
        sessions are closed first (``on_release(..., "lru_eviction")``). A new session takes a free
        slot of the data shard holding the fewest sessions."""
        if not isinstance(session_id, str) or not session_id:
            raise ValueError(f"session_id must be a non-empty string, got {session_id!r}")
        if session_id in self._sessions:
            self._sessions.move_to_end(session_id)
            return
        self._require_idle("open a session")
        while not self._free_slots:
            self._release(next(iter(self._sessions)), "lru_eviction")
        load = collections.Counter(slot // self.slots_per_shard for slot in self._sessions.values())
        slot = min(self._free_slots, key=lambda s: load[s // self.slots_per_shard])
        self._free_slots.remove(slot)
        self._sessions[session_id] = slot
        self._state, _ = _begin(self._state, self._slot_local_rows(slot), mesh=self._mesh)

    def close(self, session_id: str) -> None:
        """Closes a session: all its pages and cross-attention caches are released.

        Raises:
          KeyError: unknown session.
        """
        self.slot(session_id)
        self._require_idle("close a session")
        self._release(session_id, "close")

    def reset(self, session_id: str, *, keep_cross_attention: Iterable[str] = ()) -> None:
        """Restarts a session from frame 0: its pages are released, the named cross-attention
        caches kept (e.g. the text K/V across a window reset), the others cleared.

        Raises:
          KeyError: unknown session, or unknown cache names in ``keep_cross_attention``.
        """
        keep = set(keep_cross_attention)
        unknown = sorted(keep - set(self.cross_attention))
        if unknown:
            raise KeyError(f"Unknown AR-Diffusion cross-attention caches to keep: {unknown}")
        slot = self.slot(session_id)
        self._require_idle("reset a session")
        rows = self._slot_local_rows(slot)
        self._state, _ = _end(self._state, rows, mesh=self._mesh)
        self._state, _ = _begin(self._state, rows, mesh=self._mesh)
        self._clear_cross(slot, set(self.cross_attention) - keep)
        if self.on_release is not None:
            self.on_release(session_id, "reset")

    # -- cross-attention caches ----------------------------------------------------------------------
    def populate_cross_attention(self, session_id: str, name: str, branch: str,
                                 layer_kv: Iterable[tuple[Array, Array]]) -> None:
        """Publishes one session's cross-attention K/V for ``name`` and ``branch``, atomically.

        ``layer_kv`` yields one ``(k, v)`` per layer, each ``[tokens, heads, head_dim]`` (a leading
        batch axis of 1 is accepted). Nothing is published unless every layer arrived and
        validated; a failure leaves the previous cache visible.

        Raises:
          KeyError: unknown session, cache or branch. ValueError: wrong layer count or shape.
        """
        row = int(self.rows([session_id], [branch])[0])
        spec = self._cross_spec(name)
        k, v = collect_cross_attention_layers(name, layer_kv, self.geometry.num_layers,
                                              self._cross_shape(spec)[2:], allow_unbatched=True)
        self._cross[name] = self._set_cross(name, [row], k[None], v[None])
        self._cross_populated.add((row, name))

    def is_cross_attention_populated(self, session_id: str, name: str, branch: str) -> bool:
        """Whether ``populate_cross_attention`` published this cache."""
        self._cross_spec(name)
        return (int(self.rows([session_id], [branch])[0]), name) in self._cross_populated

    def cross_attention_kv(self, name: str) -> tuple[Array, Array]:
        """The stacked cache ``name``: ``(k, v)``, each ``[rows, layers, tokens, heads, head_dim]``
        in global row order (rows on ``"data"``, heads on ``"model"`` with a mesh); a batch's
        rows are :meth:`cross_attention_rows`. Rows never populated (or released) are zero."""
        self._cross_spec(name)
        return self._cross[name]

    def cross_attention_rows(self, cross_kv: tuple[Array, Array], inputs: ChunkInputs
                             ) -> tuple[Array, Array]:
        """The batch's rows of a cross-attention cache (traceable, e.g. inside a jitted forward):
        ``cross_kv`` from :meth:`cross_attention_kv`, ``inputs`` from ``step.inputs``. Returns
        ``(k, v)``, each ``[layers, B, tokens, heads, head_dim]``; padding rows are zero. With a
        mesh each data shard reads its own rows (no communication)."""
        return tuple(gather_rows(self._mesh, table, inputs.rows).swapaxes(0, 1)
                     for table in cross_kv)

    def clear_cross_attention(self, session_id: str) -> None:
        """Clears every cross-attention cache of a session (a prompt switch); self-attention
        history is kept."""
        self._clear_cross(self.slot(session_id), set(self.cross_attention))

    # -- the per-chunk protocol ----------------------------------------------------------------------
    @contextlib.contextmanager
    def chunk(self, session_ids: Sequence[str], num_frames: int, branches: Sequence[str] | None = None,
              *, full_batch: bool | None = None):
        """Prepares one chunk of ``num_frames`` frames for ``session_ids`` x ``branches``.

        Yields a :class:`ChunkStep`: run the denoise steps and the commit forward on
        ``step.inputs``, then call ``step.commit(k_new, v_new)``. If the block raises, nothing is
        committed (or, with ``fail_closed``, the sessions are closed) and the exception propagates.

        Batch layout: by default the batch holds the rows of ``session_ids`` x ``branches`` in that
        order (session-major); each new batch size compiles the bookkeeping once. With
        ``full_batch=True`` (always on with a mesh) it holds every slot: batch row
        ``slot * len(branches) + i`` is branch ``branches[i]`` of the session in that slot
        (:meth:`slot`), and slots not in ``session_ids`` are padding rows (see :class:`ChunkInputs`),
        so its shape never changes.

        Raises:
          KeyError: unknown session or branch. ValueError: bad ``num_frames``, repeated sessions or
            ``full_batch=False`` with a mesh.
          RuntimeError: another chunk is in flight, or the pool cannot hold the chunk (nothing
            changes).
        """
        if not isinstance(num_frames, int) or not 1 <= num_frames <= self.window.window_frames:
            raise ValueError(f"num_frames must be an int in [1, {self.window.window_frames}] "
                             f"(window_frames), got {num_frames!r}")
        if len(set(session_ids)) != len(session_ids):
            raise ValueError(f"session_ids must be distinct, got {list(session_ids)}")
        if full_batch is None:
            full_batch = self.mesh is not None
        elif not full_batch and self.mesh is not None:
            raise ValueError("a sharded cache hands out full batches only (full_batch=True): each data "
                             "shard must see the same rows every chunk")
        names = tuple(self._branch_index) if branches is None else tuple(branches)
        rows = self.rows(session_ids, names)
        self._require_idle("start a chunk")
        if full_batch:
            owners: list[str | None] = [None] * self.session_capacity
            for sid in session_ids:
                owners[self.slot(sid)] = sid
            batch_rows = np.full(self.session_capacity * len(names), -1, np.int32)
            batch_rows[[self.slot(sid) * len(names) + i for sid in session_ids for i in range(len(names))]] = rows
            local = np.where(batch_rows >= 0, batch_rows % self.rows_per_shard, -1).reshape(self.num_shards, -1)
        else:
            owners = list(session_ids)
            local = rows[None]
        for sid in session_ids:
            self._sessions.move_to_end(sid)
        pending, inputs, ok = _prepare(self._state, jnp.asarray(local), num_frames=num_frames, mesh=self._mesh)
        if not bool(jnp.all(ok)):
            raise RuntimeError(
                f"AR-Diffusion KV pool exhausted while allocating a chunk of {num_frames} frames for "
                f"{len(rows)} rows ({self.num_free_pages()} pages free)")
        step = ChunkStep(self, inputs, tuple(s for s in owners for _ in names), num_frames, pending)
        self._in_flight = step
        try:
            yield step
        except BaseException:
            if self.fail_closed:
                for sid in dict.fromkeys(session_ids):
                    if sid in self._sessions:
                        self._release(sid, "forward_exception")
            raise
        finally:
            self._in_flight = None

    def _commit_step(self, step: ChunkStep, k_new: Array, v_new: Array) -> None:
        if self._in_flight is not step or step.committed:
            raise RuntimeError("this chunk is not in flight (already committed, or its block has exited)")
        expected = (self.geometry.num_layers, len(step.session_ids), step.num_frames * self.geometry.tokens_per_frame,
                    self.geometry.num_kv_heads, self.geometry.head_dim)
        for label, array in (("k_new", k_new), ("v_new", v_new)):
            if tuple(array.shape) != expected:
                raise ValueError(f"{label} must have shape {expected} (layers, rows, frames x tokens, "
                                 f"kv_heads, head_dim), got {tuple(array.shape)}")
        self._k_pool, self._v_pool, self._state, _ = _commit(
            self._k_pool, self._v_pool, step.pending, k_new.astype(self.geometry.dtype),
            v_new.astype(self.geometry.dtype), step.inputs, num_frames=step.num_frames,
            backend=self.backend, mesh=self._mesh)
        step.committed = True

    # -- helpers -------------------------------------------------------------------------------------
    def _branch(self, name: str) -> int:
        return lookup(self._branch_index, name, "KV branch")

    def _cross_spec(self, name: str) -> CrossAttentionSpec:
        return lookup(self.cross_attention, name, "cross-attention cache")

    def _cross_shape(self, spec: CrossAttentionSpec) -> tuple[int, ...]:
        return (self.num_rows, self.geometry.num_layers, spec.num_tokens,
                spec.num_kv_heads or self.geometry.num_kv_heads, self.geometry.head_dim)

    def _slot_local_rows(self, slot: int) -> np.ndarray:
        """``[data, branches]`` local rows of ``slot``'s branches in its shard, -1 elsewhere."""
        n = len(self.kv_branches)
        local = np.full((self.num_shards, n), -1, np.int32)
        shard, index = divmod(slot, self.slots_per_shard)
        local[shard] = np.arange(index * n, (index + 1) * n)
        return local

    def _slot_rows(self, slot: int) -> list[int]:
        n = len(self.kv_branches)
        return list(range(slot * n, (slot + 1) * n))

    def _set_cross(self, name: str, rows: Sequence[int], k_rows: Array, v_rows: Array) -> tuple[Array, Array]:
        dtype = self.geometry.dtype
        return _set_cross_rows(*self._cross[name], jnp.asarray(rows, jnp.int32), k_rows.astype(dtype),
                               v_rows.astype(dtype), target=self._cross_sharding)

    def _require_idle(self, what: str) -> None:
        if self._in_flight is not None:
            raise RuntimeError(f"cannot {what} while a chunk is in flight; commit it or leave its block first")

    def _clear_cross(self, slot: int, names: Iterable[str]) -> None:
        rows = self._slot_rows(slot)
        for name in names:
            if any((row, name) in self._cross_populated for row in rows):
                k = self._cross[name][0]
                zeros = jnp.zeros((len(rows),) + k.shape[1:], k.dtype)
                self._cross[name] = self._set_cross(name, rows, zeros, zeros)
                self._cross_populated -= {(row, name) for row in rows}

    def _release(self, session_id: str, reason: str) -> None:
        slot = self._sessions.pop(session_id)
        self._state, _ = _end(self._state, self._slot_local_rows(slot), mesh=self._mesh)
        self._clear_cross(slot, set(self.cross_attention))
        self._free_slots.append(slot)
        if self.on_release is not None:
            self.on_release(session_id, reason)


def collect_cross_attention_layers(name: str, layer_kv: Iterable[tuple[Array, Array]], num_layers: int,
                                   shape: tuple[int, ...], *, allow_unbatched: bool) -> tuple[Array, Array]:
    """Consumes ``layer_kv`` once, in layer order, and stacks it: ``(k, v)`` each
    ``[num_layers, *shape]``. Each item is a ``(k, v)`` pair of arrays of shape ``(1, *shape)`` (or
    ``shape`` when ``allow_unbatched``). Validation and messages follow vLLM-Omni's
    ``populate_cross_attention``; an exception raised by the iterable propagates unchanged.

    Raises:
      ValueError: too many or too few layers, a non-array item, or a wrong shape.
    """
    batched = (1, *shape)
    ks, vs = [], []
    for layer, (k, v) in enumerate(layer_kv):
        if layer >= num_layers:
            raise ValueError(f"AR-Diffusion cross-attention cache {name!r} expected {num_layers} layers, "
                             f"got more than {num_layers}")
        if not all(isinstance(x, (jax.Array, np.ndarray)) for x in (k, v)):
            raise ValueError(f"AR-Diffusion cross-attention cache {name!r} layer {layer} must yield "
                             f"jax.Array k/v, got {type(k).__name__} and {type(v).__name__}")
        shapes = (tuple(k.shape), tuple(v.shape))
        if not all(s == batched or (allow_unbatched and s == tuple(shape)) for s in shapes):
            raise ValueError(f"AR-Diffusion cross-attention cache {name!r} layer {layer} expected k/v shape "
                             f"{batched}, got {shapes[0]} and {shapes[1]}")
        ks.append(jnp.reshape(jnp.asarray(k), shape))
        vs.append(jnp.reshape(jnp.asarray(v), shape))
    if len(ks) != num_layers:
        raise ValueError(f"AR-Diffusion cross-attention cache {name!r} expected {num_layers} layers, got {len(ks)}")
    return jnp.stack(ks), jnp.stack(vs)
