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

Scratch pages. The planner keeps the seed's scratch reservation in the budget for exact parity, but
arkv-jax's denoise steps never write the pool (the current chunk's K/V go straight to the attention
kernel), so the pools hold only the managed pages.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
from typing import Callable, Iterable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from arkv_jax import state as core
from arkv_jax.config import CacheGeometry, CrossAttentionSpec, KVBranch, WindowPolicy, lookup
from arkv_jax.planner import MemoryPlan, device_free_bytes, plan_memory
from pallas_kernels import paged_write

Array = jax.Array


class ChunkInputs(NamedTuple):
    """Everything a forward of one chunk needs from the cache (a pytree of device arrays).

    ``B`` = sessions x branches in the call, ``F`` = frames of the chunk.

    Attributes:
      rows: ``[B]`` int32 rows of the block-table state (session-major, branch-minor).
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


def _prepare(state: core.BlockTableState, rows: Array, num_frames: int):
    """Jitted: visible window, then allocation of the chunk's pages in a pending state."""
    pending, visible, pages, ok = core.prepare_chunk(state, rows, num_frames)
    inputs = ChunkInputs(rows, visible.pages, visible.lengths, visible.frame_ids,
                         core.computed_frames(state, rows), pages)
    return pending, inputs, ok


def _commit(k_pool, v_pool, pending, k_new, v_new, inputs: ChunkInputs, *, num_frames: int,
            tokens_per_frame: int, backend: str):
    """Jitted with the pools and the pending state donated: page-granular write, then commit."""
    k_pool, v_pool = paged_write.write_chunk(k_pool, v_pool, k_new, v_new, inputs.write_pages,
                                             tokens_per_frame=tokens_per_frame, backend=backend)
    state, ok = core.commit(pending, inputs.rows, num_frames)
    return k_pool, v_pool, state, ok


_prepare_jit = jax.jit(_prepare, static_argnums=2)
_begin_jit = jax.jit(core.begin, donate_argnums=0)
_end_jit = jax.jit(core.end, donate_argnums=0)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _set_cross_rows(k_cache, v_cache, rows, k_rows, v_rows):
    """``k_cache[rows] = k_rows`` (same for V), in place."""
    return k_cache.at[rows].set(k_rows), v_cache.at[rows].set(v_rows)


@dataclasses.dataclass
class ChunkStep:
    """One chunk in flight for a batch of rows; see :meth:`PagedKVCache.chunk`.

    Attributes:
      inputs: the forward's :class:`ChunkInputs`.
      session_ids: the sessions of the call, in row order (each repeated per branch).
      num_frames: frames of the chunk.
    """

    cache: "PagedKVCache"
    inputs: ChunkInputs
    session_ids: tuple[str, ...]
    num_frames: int
    pending: core.BlockTableState
    committed: bool = False

    def commit(self, k_new: Array, v_new: Array) -> None:
        """Writes the chunk's clean K/V and commits it (advance + evict). Call after the forward
        succeeded.

        Args:
          k_new, v_new: ``[layers, B, num_frames * tokens_per_frame, kv_heads, head_dim]`` in the
            pool dtype.
        """
        self.cache._commit_step(self, k_new, v_new)


class PagedKVCache:
    """Paged K/V for many concurrent video sessions, planned for one device.

    Args:
      geometry, window: cache shape and window policy.
      kv_branches: logical KV branches (e.g. CFG ``positive``/``negative``); each session has one row
        per branch.
      cross_attention: named dense cross-attention caches per session and branch.
      plan: a :class:`MemoryPlan` for these settings; planned here when ``None`` from
        ``available_bytes`` (default: the device's free memory), ``memory_fraction`` and
        ``session_capacity``, with in-flight pages reserved for every session
        (``batched_in_flight=True``) since all sessions can run in one chunk.
      device: where the pools live (default: the first local device).
      backend: kernel backend for the commit write (see :mod:`pallas_kernels.backend`).
      fail_closed: close the sessions of a chunk whose forward raised, instead of keeping them at
        their last committed chunk.
      on_release: called as ``on_release(session_id, reason)`` when a session is closed, reset or
        evicted (reason ``"close"``, ``"reset"``, ``"lru_eviction"``, ``"forward_exception"``), so
        a model can drop per-session state of its own.
    """

    def __init__(self, geometry: CacheGeometry, window: WindowPolicy,
                 kv_branches: Sequence[KVBranch] = (KVBranch("main"),),
                 cross_attention: Sequence[CrossAttentionSpec] = (), *, plan: MemoryPlan | None = None,
                 available_bytes: int | None = None, memory_fraction: float = 0.1, session_capacity: int = 1,
                 device=None, backend: str = "auto", fail_closed: bool = False,
                 on_release: Callable[[str, str], None] | None = None) -> None:
        if plan is None:
            plan = plan_memory(
                geometry, window, kv_branches, cross_attention=cross_attention,
                available_bytes=device_free_bytes(device) if available_bytes is None else available_bytes,
                memory_fraction=memory_fraction, session_capacity=session_capacity, batched_in_flight=True)
        elif (plan.geometry, plan.window, plan.kv_branches, plan.cross_attention) != (
                geometry, window, tuple(kv_branches), tuple(cross_attention)):
            raise ValueError("plan was made for a different geometry, window, branches or cross-attention")
        self.plan, self.geometry, self.window = plan, geometry, window
        self.kv_branches = plan.kv_branches
        self.cross_attention = {spec.name: spec for spec in plan.cross_attention}
        self.backend, self.fail_closed, self.on_release = backend, fail_closed, on_release
        self.device = device or jax.local_devices()[0]
        self._branch_index = {b.name: i for i, b in enumerate(self.kv_branches)}
        layout = core.StateLayout.from_config(geometry, window, plan.managed_num_blocks)
        self._state = jax.device_put(core.init_state(layout, self.num_rows), self.device)
        pool_shape = (geometry.num_layers, plan.managed_num_blocks, geometry.block_size,
                      geometry.num_kv_heads, geometry.head_dim)
        self._k_pool = jax.device_put(jnp.zeros(pool_shape, geometry.dtype), self.device)
        self._v_pool = jax.device_put(jnp.zeros(pool_shape, geometry.dtype), self.device)
        self._cross = {name: tuple(jax.device_put(jnp.zeros(self._cross_shape(spec), geometry.dtype), self.device)
                                   for _ in range(2))
                       for name, spec in self.cross_attention.items()}
        self._cross_populated: set[tuple[int, str]] = set()  # (row, cache name)
        self._sessions: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._free_slots = list(range(plan.session_capacity))
        self._in_flight: ChunkStep | None = None
        self._commit_jit = jax.jit(
            functools.partial(_commit, tokens_per_frame=geometry.tokens_per_frame, backend=backend),
            static_argnames="num_frames", donate_argnums=(0, 1, 2))

    # -- sizes and views -------------------------------------------------------------------------------
    @property
    def session_capacity(self) -> int:
        """Resident sessions the plan admits (LRU eviction beyond)."""
        return self.plan.session_capacity

    @property
    def num_rows(self) -> int:
        """Rows of the block-table state: capacity x logical branches."""
        return self.plan.session_capacity * len(self.kv_branches)

    @property
    def state(self) -> core.BlockTableState:
        """The committed block-table state."""
        return self._state

    @property
    def pools(self) -> tuple[Array, Array]:
        """``(k_pool, v_pool)``, each ``[layers, pages, block_size, kv_heads, head_dim]``."""
        return self._k_pool, self._v_pool

    @property
    def sessions(self) -> tuple[str, ...]:
        """Resident sessions, least recently used first."""
        return tuple(self._sessions)

    def num_free_pages(self) -> int:
        """Free managed pages (host sync)."""
        return int(self._state.free_count)

    def rows(self, session_ids: Sequence[str], branches: Sequence[str] | None = None) -> np.ndarray:
        """Rows of ``session_ids`` x ``branches`` (all branches by default), session-major.

        Raises:
          KeyError: an unknown session or branch.
        """
        names = tuple(self._branch_index) if branches is None else tuple(branches)
        return np.asarray([self._slot(sid) * len(self.kv_branches) + self._branch(name)
                           for sid in session_ids for name in names], np.int32)

    # -- session lifecycle ---------------------------------------------------------------------------
    def open(self, session_id: str) -> None:
        """Opens ``session_id`` or marks it most recently used. At capacity, the least recently used
        sessions are closed first (``on_release(..., "lru_eviction")``)."""
        if not isinstance(session_id, str) or not session_id:
            raise ValueError(f"session_id must be a non-empty string, got {session_id!r}")
        if session_id in self._sessions:
            self._sessions.move_to_end(session_id)
            return
        self._require_idle("open a session")
        while not self._free_slots:
            self._release(next(iter(self._sessions)), "lru_eviction")
        slot = self._free_slots.pop(0)
        self._sessions[session_id] = slot
        self._state, _ = _begin_jit(self._state, jnp.asarray(self._slot_rows(slot)))

    def close(self, session_id: str) -> None:
        """Closes a session: all its pages and cross-attention caches are released.

        Raises:
          KeyError: unknown session.
        """
        self._slot(session_id)
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
        slot = self._slot(session_id)
        self._require_idle("reset a session")
        rows = jnp.asarray(self._slot_rows(slot))
        self._state, _ = _end_jit(self._state, rows)
        self._state, _ = _begin_jit(self._state, rows)
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
        self._cross[name] = _set_cross_rows(*self._cross[name], jnp.asarray([row]), k[None].astype(self.geometry.dtype),
                                            v[None].astype(self.geometry.dtype))
        self._cross_populated.add((row, name))

    def is_cross_attention_populated(self, session_id: str, name: str, branch: str) -> bool:
        """Whether ``populate_cross_attention`` published this cache."""
        self._cross_spec(name)
        return (int(self.rows([session_id], [branch])[0]), name) in self._cross_populated

    def cross_attention_kv(self, name: str) -> tuple[Array, Array]:
        """The stacked cache ``name``: ``(k, v)``, each ``[rows, layers, tokens, heads, head_dim]``;
        index with :attr:`ChunkInputs.rows`. Rows never populated (or released) are zero."""
        self._cross_spec(name)
        return self._cross[name]

    def clear_cross_attention(self, session_id: str) -> None:
        """Clears every cross-attention cache of a session (a prompt switch); self-attention
        history is kept."""
        self._clear_cross(self._slot(session_id), set(self.cross_attention))

    # -- the per-chunk protocol ----------------------------------------------------------------------
    @contextlib.contextmanager
    def chunk(self, session_ids: Sequence[str], num_frames: int, branches: Sequence[str] | None = None):
        """Prepares one chunk of ``num_frames`` frames for ``session_ids`` x ``branches``.

        Yields a :class:`ChunkStep`: run the denoise steps and the commit forward on
        ``step.inputs``, then call ``step.commit(k_new, v_new)``. If the block raises, nothing is
        committed (or, with ``fail_closed``, the sessions are closed) and the exception propagates.

        Raises:
          KeyError: unknown session or branch. ValueError: bad ``num_frames`` or repeated sessions.
          RuntimeError: another chunk is in flight, or the pool cannot hold the chunk (nothing
            changes).
        """
        if not isinstance(num_frames, int) or not 1 <= num_frames <= self.window.window_frames:
            raise ValueError(f"num_frames must be an int in [1, {self.window.window_frames}] "
                             f"(window_frames), got {num_frames!r}")
        if len(set(session_ids)) != len(session_ids):
            raise ValueError(f"session_ids must be distinct, got {list(session_ids)}")
        rows = self.rows(session_ids, branches)
        self._require_idle("start a chunk")
        for sid in session_ids:
            self._sessions.move_to_end(sid)
        pending, inputs, ok = _prepare_jit(self._state, jnp.asarray(rows), num_frames)
        if not bool(jnp.all(ok)):
            raise RuntimeError(
                f"AR-Diffusion KV pool exhausted while allocating a chunk of {num_frames} frames for "
                f"{len(rows)} rows ({self.num_free_pages()} pages free)")
        names = tuple(self._branch_index) if branches is None else tuple(branches)
        step = ChunkStep(self, inputs, tuple(s for s in session_ids for _ in names), num_frames, pending)
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
        self._k_pool, self._v_pool, self._state, ok = self._commit_jit(
            self._k_pool, self._v_pool, step.pending, k_new.astype(self.geometry.dtype),
            v_new.astype(self.geometry.dtype), step.inputs, num_frames=step.num_frames)
        step.committed = True

    # -- helpers -------------------------------------------------------------------------------------
    def _slot(self, session_id: str) -> int:
        try:
            return self._sessions[session_id]
        except KeyError:
            raise KeyError(f"Unknown session {session_id!r}; open it first") from None

    def _branch(self, name: str) -> int:
        return lookup(self._branch_index, name, "KV branch")

    def _cross_spec(self, name: str) -> CrossAttentionSpec:
        return lookup(self.cross_attention, name, "cross-attention cache")

    def _cross_shape(self, spec: CrossAttentionSpec) -> tuple[int, ...]:
        return (self.num_rows, self.geometry.num_layers, spec.num_tokens,
                spec.num_kv_heads or self.geometry.num_kv_heads, self.geometry.head_dim)

    def _slot_rows(self, slot: int) -> list[int]:
        n = len(self.kv_branches)
        return list(range(slot * n, (slot + 1) * n))

    def _require_idle(self, what: str) -> None:
        if self._in_flight is not None:
            raise RuntimeError(f"cannot {what} while a chunk is in flight; commit it or leave its block first")

    def _clear_cross(self, slot: int, names: Iterable[str]) -> None:
        rows = self._slot_rows(slot)
        for name in names:
            if any((row, name) in self._cross_populated for row in rows):
                k, v = self._cross[name]
                zeros = jnp.zeros((len(rows),) + k.shape[1:], k.dtype)
                self._cross[name] = _set_cross_rows(k, v, jnp.asarray(rows), zeros, zeros)
                self._cross_populated -= {(row, name) for row in rows}

    def _release(self, session_id: str, reason: str) -> None:
        slot = self._sessions.pop(session_id)
        self._state, _ = _end_jit(self._state, jnp.asarray(self._slot_rows(slot)))
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
