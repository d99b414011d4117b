"""vLLM-Omni's AR-Diffusion KV cache API, on arkv-jax's functional core.

A migration path and a proof of equivalence: the classes and functions here have vLLM-Omni's names
(a *block* here is a page of the core, a *chunk* a frame), constructor keywords, attributes, return
values, exception types and messages, but every block operation runs through :mod:`arkv_jax.state`
(jitted, donated) and the arithmetic through :mod:`arkv_jax.planner`. Physical block ids and
free-list order match vLLM-Omni's.

Checks come first, here, in vLLM-Omni's order and with its exact messages (the core types raise
their own); the one check that needs the planner's arithmetic (one session must fit) is the
planner's :class:`~arkv_jax.planner.InsufficientMemoryError`, re-raised in vLLM-Omni's words.

Differences, all deliberate: block tables are compacted (vLLM-Omni S3), so ``max_model_len`` never
clips a long session; K/V arrays are JAX arrays; ``device=None`` means bookkeeping only, as in
vLLM-Omni.

The module is one file of some 480 lines because it mirrors one vLLM-Omni module (the manager and
its helpers) name for name.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Collection, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from arkv_jax import state as core
from arkv_jax.cache.cross_attention import collect_cross_attention_layers
from arkv_jax.config import CacheGeometry, CrossAttentionSpec, KVBranch, WindowPolicy, ceil_div, lookup
from arkv_jax.planner import InsufficientMemoryError, compute_num_blocks, plan_memory, scratch_blocks_per_branch

__all__ = [
    "ARDiffusionKVConfig", "ARDiffusionKVBranchSpec", "ARDiffusionRequestAdapter", "ARDiffusionKVCache",
    "compute_num_blocks", "compute_slot_mapping", "chunk_slot_mapping", "resident_block_ids",
]


@dataclasses.dataclass(frozen=True)
class ARDiffusionKVBranchSpec(KVBranch):
    """vLLM-Omni's branch spec: a :class:`~arkv_jax.config.KVBranch` checked with vLLM-Omni's messages."""

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("AR-Diffusion KV branch names must be non-empty")
        if not isinstance(self.local_index, (int, np.integer)) or self.local_index < 0:
            raise ValueError(f"AR-Diffusion KV branch local_index must be non-negative, got {self.local_index}")
        super().__post_init__()


@dataclasses.dataclass
class ARDiffusionKVConfig:
    """vLLM-Omni's (mutable) KV configuration."""

    enable: bool = False
    chunk_size: int = 0
    window_chunks: int | None = None
    sink_chunks: int = 0
    reset_at_boundary: bool = False
    gpu_memory_fraction: float = 0.1
    warmup_cudagraph: bool = True
    warmup_capture_reset: bool = False

    @property
    def sliding_window(self) -> int | None:
        """Window in tokens (sink excluded), or ``None`` for an unbounded window."""
        return None if self.window_chunks is None else self.window_chunks * self.chunk_size


def compute_slot_mapping(block_ids: Sequence[int], positions: Sequence[int], block_size: int) -> jax.Array:
    """Flat slots ``block_ids[p // block_size] * block_size + p % block_size`` of ``positions``.

    Raises:
      ValueError: ``block_size <= 0``.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    blocks = np.asarray(block_ids, np.int64)
    positions = np.asarray(positions, np.int64)
    return jnp.asarray(blocks[positions // block_size] * block_size + positions % block_size, jnp.int32)


def chunk_slot_mapping(block_ids: Sequence[int], num_computed_tokens: int, chunk_size: int,
                       block_size: int) -> jax.Array:
    """Slots of the in-flight chunk: positions ``[num_computed_tokens, + chunk_size)``."""
    return compute_slot_mapping(block_ids, np.arange(num_computed_tokens, num_computed_tokens + chunk_size),
                                block_size)


def resident_block_ids(block_ids: Sequence[int], null_block_id: int) -> list[int]:
    """``block_ids`` without the null block, order kept."""
    return [int(b) for b in block_ids if int(b) != null_block_id]


class ARDiffusionRequestAdapter:
    """One state row, with vLLM-Omni's request-adapter view of it.

    ``num_computed_tokens = prefill + completed_chunks * chunk_size``; ``num_tokens`` adds the
    in-flight chunk. The cache advances it once per committed chunk, never per denoise step.
    """

    def __init__(self, request_id: str, *, chunk_size: int, prefill_prefix_tokens: int = 0,
                 row: int | None = None) -> None:
        self.request_id = request_id
        self.row = row
        self._chunk_size = chunk_size
        self._prefill = prefill_prefix_tokens
        self._completed_chunks = 0
        self.num_preemptions = 0
        self.num_in_flight_tokens = 0

    @property
    def num_computed_tokens(self) -> int:
        return self._prefill + self._completed_chunks * self._chunk_size

    @property
    def num_tokens(self) -> int:
        return self.num_computed_tokens + self._chunk_size

    @property
    def num_prompt_tokens(self) -> int:
        return self._prefill

    @property
    def completed_chunks(self) -> int:
        return self._completed_chunks

    def on_chunk_committed(self) -> None:
        """Advances by one chunk."""
        self._completed_chunks += 1


@functools.partial(jax.jit, static_argnums=1, donate_argnums=0)
def _write_slots(pool, layer: int, slots, new):
    """``pool[layer]`` viewed as ``[pages * block_size, heads, dim]`` gets ``new`` at ``slots``."""
    num_layers, pages, block_size, heads, dim = pool.shape
    flat = pool.reshape(num_layers, pages * block_size, heads, dim).at[layer, slots].set(new)
    return flat.reshape(pool.shape)


_begin = jax.jit(core.begin, donate_argnums=0)
_allocate = jax.jit(core.allocate, donate_argnums=0)
_commit = jax.jit(core.commit, donate_argnums=0)
_end = jax.jit(core.end, donate_argnums=0)


def _check_cache_arguments(config: ARDiffusionKVConfig, *, num_layers: int, num_kv_heads: int, head_size: int,
                           block_size: int, kv_branches: Sequence[KVBranch], session_capacity: int,
                           cross_attention_lengths: dict[str, int], frames_per_block: int,
                           max_scratch_tokens_per_branch: int, model_owned_state_bytes_per_session: int) -> None:
    """vLLM-Omni's constructor checks before any planning, in its order, with its messages.

    Raises:
      ValueError: the first argument out of range.
    """
    if not config.enable:
        raise ValueError("ARDiffusionKVCache built with a disabled ARDiffusionKVConfig")
    if config.window_chunks is None:
        raise ValueError("Phase 1 requires a bounded window (window_chunks)")
    if config.chunk_size <= 0:
        raise ValueError("ARDiffusionKVConfig.chunk_size must be set (> 0)")
    if not kv_branches:
        raise ValueError("ARDiffusionKVCache requires at least one KV branch")
    if session_capacity <= 0:
        raise ValueError(f"session_capacity must be positive, got {session_capacity}")
    names = [b.name for b in kv_branches]
    if len(names) != len(set(names)):
        raise ValueError(f"ARDiffusionKVCache KV branch names must be unique, got {names}")
    indices = sorted({b.local_index for b in kv_branches})
    if indices != list(range(len(indices))):
        raise ValueError(f"ARDiffusionKVCache KV branch local_index values must be contiguous from zero, got {indices}")
    if frames_per_block <= 0:
        raise ValueError(f"frames_per_block must be positive, got {frames_per_block}")
    if max_scratch_tokens_per_branch < 0:
        raise ValueError(f"max_scratch_tokens_per_branch must be non-negative, got {max_scratch_tokens_per_branch}")
    if model_owned_state_bytes_per_session < 0:
        raise ValueError("model_owned_state_bytes_per_session must be non-negative, "
                         f"got {model_owned_state_bytes_per_session}")
    invalid_cross = {name: n for name, n in cross_attention_lengths.items() if n <= 0}
    if invalid_cross:
        raise ValueError(f"cross_attention_lengths must be positive, got {invalid_cross}")
    for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_size", head_size),
                        ("block_size", block_size)):
        if value <= 0:
            raise ValueError(f"AR-Diffusion {name} must be positive, got {value}")
    if config.window_chunks <= 0:
        raise ValueError(f"ARDiffusionKVConfig.window_chunks must be positive, got {config.window_chunks}")
    if config.sink_chunks < 0:
        raise ValueError(f"ARDiffusionKVConfig.sink_chunks must be non-negative, got {config.sink_chunks}")


class ARDiffusionKVCache:
    """vLLM-Omni's ``ARDiffusionKVCache``: plan, pools and per-request block operations.

    Per request: ``begin_request`` -> per chunk (``allocate_chunk`` -> ``chunk_write_slots`` ->
    [model writes K/V] -> ``commit_chunk``) -> ``end_request``.
    """

    def __init__(self, config: ARDiffusionKVConfig, *, num_layers: int, num_kv_heads: int, head_size: int,
                 dtype, block_size: int, max_model_len: int, available_bytes: int,
                 kv_branches: Sequence[KVBranch], session_capacity: int,
                 cross_attention_lengths: dict[str, int] | None = None, device=None,
                 frames_per_block: int = 1, max_scratch_tokens_per_branch: int = 0,
                 model_owned_state_bytes_per_session: int = 0) -> None:
        self.cross_attention_lengths = dict(cross_attention_lengths or {})
        _check_cache_arguments(
            config, num_layers=num_layers, num_kv_heads=num_kv_heads, head_size=head_size, block_size=block_size,
            kv_branches=kv_branches, session_capacity=session_capacity,
            cross_attention_lengths=self.cross_attention_lengths, frames_per_block=frames_per_block,
            max_scratch_tokens_per_branch=max_scratch_tokens_per_branch,
            model_owned_state_bytes_per_session=model_owned_state_bytes_per_session)
        self.kv_branches, self.config = tuple(kv_branches), config
        self.geometry = CacheGeometry(num_layers, num_kv_heads, head_size, dtype, config.chunk_size,
                                      block_size=block_size, frames_per_forward=frames_per_block)
        self.window = WindowPolicy(config.window_chunks, config.sink_chunks, config.reset_at_boundary)
        scratch_blocks_per_branch(self.geometry, max_scratch_tokens_per_branch)  # checks the environment
        compute_num_blocks(available_bytes, config.gpu_memory_fraction, self.geometry.page_bytes)
        try:
            self.plan = plan_memory(
                self.geometry, self.window, self.kv_branches, available_bytes=available_bytes,
                memory_fraction=config.gpu_memory_fraction, session_capacity=session_capacity,
                cross_attention=tuple(CrossAttentionSpec(n, t) for n, t in self.cross_attention_lengths.items()),
                max_scratch_tokens_per_branch=max_scratch_tokens_per_branch,
                model_owned_state_bytes_per_session=model_owned_state_bytes_per_session)
        except InsufficientMemoryError as exc:
            raise ValueError(
                "AR-Diffusion available device memory cannot fit one session: "
                f"available={exc.available} bytes, required={exc.required} bytes "
                "(managed self-attention + cross-attention + scratch + model-owned state).") from None
        for name in ("session_capacity", "requested_session_capacity", "memory_budget_bytes",
                     "configured_memory_budget_bytes", "managed_num_blocks", "num_blocks_total",
                     "scratch_blocks_per_kv_branch", "scratch_num_blocks", "num_local_kv_branches",
                     "cross_attention_bytes_per_session", "cross_attention_reserved_bytes",
                     "model_owned_state_bytes_per_session", "model_owned_state_reserved_bytes",
                     "scratch_reserved_bytes", "null_block_id"):
            setattr(self, name, getattr(self.plan, name))
        self.num_blocks = self.managed_num_blocks
        self.available_memory_bytes = available_bytes
        self.frames_per_block = frames_per_block
        self.block_size, self.num_layers = block_size, num_layers
        self.num_kv_heads, self.head_size, self.dtype = num_kv_heads, head_size, self.geometry.dtype
        self.device = device
        self._branch_index = {b.name: b.local_index for b in self.kv_branches}
        layout = core.StateLayout.from_config(self.geometry, self.window, self.managed_num_blocks)
        self._state = core.init_state(layout, num_rows=max(4, 2 * self.session_capacity * len(self.kv_branches)))
        self._adapters: dict[str, ARDiffusionRequestAdapter] = {}
        self._free_rows: list[int] = list(range(self._state.num_rows))
        self._k_pool = self._v_pool = None
        self._cross_sessions: dict[str, dict[str, dict[str, tuple[jax.Array, jax.Array]]]] = {}
        if device is not None:
            shape = (num_layers, self.num_blocks_total, block_size, num_kv_heads, head_size)
            self._k_pool = jax.device_put(jnp.zeros(shape, self.dtype), device)
            self._v_pool = jax.device_put(jnp.zeros(shape, self.dtype), device)

    # -- request lifecycle ------------------------------------------------------------------------
    def begin_request(self, request_id: str, *, prefill_prefix_tokens: int = 0) -> ARDiffusionRequestAdapter:
        """Registers a request (one row of the state) and returns its adapter."""
        if request_id in self._adapters:
            raise ValueError(f"AR-Diffusion request {request_id!r} is already active")
        if prefill_prefix_tokens < 0:
            raise ValueError(f"prefill_prefix_tokens must be non-negative, got {prefill_prefix_tokens}")
        if not self._free_rows:
            grown = 2 * self._state.num_rows
            self._free_rows = list(range(self._state.num_rows, grown))
            self._state = core.resize(self._state, num_rows=grown)
        row = self._free_rows.pop(0)
        self._state, ok = _begin(self._state, jnp.array([row]), prefill_prefix_tokens)
        assert bool(ok[0])
        adapter = ARDiffusionRequestAdapter(request_id, chunk_size=self.config.chunk_size,
                                            prefill_prefix_tokens=prefill_prefix_tokens, row=row)
        self._adapters[request_id] = adapter
        return adapter

    def end_request(self, adapter: ARDiffusionRequestAdapter) -> None:
        """Returns every block of the request to the pool (its table in reverse)."""
        self._state, ok = _end(self._state, jnp.array([self._row(adapter)]))
        self._adapters.pop(adapter.request_id, None)
        self._free_rows.append(adapter.row)

    # -- per-chunk operations ---------------------------------------------------------------------
    def allocate_chunk(self, adapter: ARDiffusionRequestAdapter) -> list[int]:
        """Allocates the in-flight chunk's blocks; returns the full table (null placeholders kept).

        Raises:
          RuntimeError: the pool is exhausted (nothing changes).
        """
        return self._allocate(adapter, self.config.chunk_size, "a chunk")

    def allocate_token_slots(self, adapter: ARDiffusionRequestAdapter, num_tokens: int) -> list[int]:
        """Allocates blocks for ``num_tokens`` in-flight tokens without committing them.

        Raises:
          ValueError: ``num_tokens <= 0``.
          RuntimeError: the pool is exhausted (nothing changes).
        """
        if num_tokens <= 0:
            raise ValueError(f"num_tokens must be positive, got {num_tokens}")
        return self._allocate(adapter, num_tokens, "paged attention slots")

    def commit_chunk(self, adapter: ARDiffusionRequestAdapter) -> None:
        """Advances the request by one chunk and frees blocks that left the window.

        Raises:
          RuntimeError: the chunk's blocks were never allocated (nothing changes).
        """
        self._state, ok = _commit(self._state, jnp.array([self._row(adapter)]), 1)
        if not bool(ok[0]):
            raise RuntimeError(f"AR-Diffusion chunk of request {adapter.request_id!r} committed before its "
                               "blocks were allocated")
        adapter.on_chunk_committed()

    def block_table(self, adapter: ARDiffusionRequestAdapter) -> list[int]:
        """The request's table in vLLM-Omni's form: sink blocks, a null placeholder per evicted
        block, then the live and in-flight blocks."""
        return seed_block_table(self._state, self._row(adapter))

    def chunk_write_slots(self, adapter: ARDiffusionRequestAdapter) -> jax.Array:
        """Slot mapping of the in-flight chunk (the K/V write target)."""
        return chunk_slot_mapping(self.block_table(adapter), adapter.num_computed_tokens,
                                  self.config.chunk_size, self.block_size)

    def window_block_ids(self, adapter: ARDiffusionRequestAdapter) -> list[int]:
        """Resident (non-null) blocks of the request, table order."""
        return resident_block_ids(self.block_table(adapter), self.null_block_id)

    def scratch_block_ids(self, kv_branch: str, start: int, count: int) -> list[int]:
        """Branch-local scratch block ids (outside the managed pool).

        Raises:
          ValueError: negative ``start`` or ``count``.
          RuntimeError: the range exceeds the branch's scratch blocks.
          KeyError: unknown branch.
        """
        if count < 0 or start < 0:
            raise ValueError(f"scratch start/count must be non-negative, got start={start}, count={count}")
        if start + count > self.scratch_blocks_per_kv_branch:
            raise RuntimeError(
                "AR-Diffusion paged attention scratch blocks exhausted: "
                f"need [{start}, {start + count}) of {self.scratch_blocks_per_kv_branch}. "
                "Declare max_scratch_tokens_per_branch in the pipeline capability "
                "or increase AR_DIFFUSION_KV_SCRATCH_BLOCKS_PER_BRANCH.")
        base = (self.managed_num_blocks + self.scratch_blocks_per_kv_branch * self._kv_branch_index(kv_branch)
                + start)
        return list(range(base, base + count))

    def num_free_blocks(self) -> int:
        """Free managed blocks."""
        return int(self._state.free_count)

    @property
    def state(self) -> core.BlockTableState:
        """The functional block-table state behind this cache."""
        return self._state

    # -- pools ------------------------------------------------------------------------------------
    def key_cache(self, layer_idx: int) -> jax.Array:
        """Layer ``layer_idx``'s K pool, ``[num_blocks_total, block_size, heads, head_size]``."""
        return self._pools()[0][layer_idx]

    def value_cache(self, layer_idx: int) -> jax.Array:
        """Layer ``layer_idx``'s V pool, ``[num_blocks_total, block_size, heads, head_size]``."""
        return self._pools()[1][layer_idx]

    def write_chunk_kv(self, layer_index: int, new_k, new_v, adapter: ARDiffusionRequestAdapter) -> None:
        """Writes one layer's K/V of the in-flight chunk (``(1, chunk, H, D)`` or ``(chunk, H, D)``)
        into its slots, in place."""
        slots = self.chunk_write_slots(adapter)
        k_pool, v_pool = self._pools()
        self._k_pool = _write_slots(k_pool, layer_index, slots, _drop_batch(new_k).astype(k_pool.dtype))
        self._v_pool = _write_slots(v_pool, layer_index, slots, _drop_batch(new_v).astype(v_pool.dtype))

    # -- cross-attention caches (per session x cache name x logical branch) -------------------------
    def populate_cross_attention(self, session_id: str, cache_name: str, kv_branch: str,
                                 layer_kv: Iterable[tuple[jax.Array, jax.Array]]) -> None:
        """Atomically publishes one logical branch of a named cross-attention cache. ``layer_kv``
        yields one ``(k, v)`` pair of shape ``(1, length, heads, head_size)`` per layer (JAX or NumPy
        arrays); nothing is published unless every layer arrived and validated.

        Raises:
          KeyError: unknown cache or branch. RuntimeError: no pool device, or the session capacity
          is exhausted. ValueError: wrong layer count, type or shape.
        """
        length = self._cross_length(cache_name)
        self._kv_branch_index(kv_branch)
        session = self._cross_sessions.get(session_id)
        if session is None and len(self._cross_sessions) >= self.session_capacity:
            raise RuntimeError("AR-Diffusion cross-attention session capacity exhausted; "
                               "the runner must evict a session before allocating another")
        if self.device is None:
            raise RuntimeError("AR-Diffusion cross-attention tensors require a configured pool device")
        k, v = collect_cross_attention_layers(cache_name, layer_kv, self.num_layers,
                                              (length, self.num_kv_heads, self.head_size), allow_unbatched=False,
                                              label="AR-Diffusion cross-attention cache")
        published = tuple(jax.device_put(x.astype(self.dtype), self.device) for x in (k, v))
        self._cross_sessions.setdefault(session_id, {}).setdefault(cache_name, {})[kv_branch] = published

    def is_cross_attention_populated(self, session_id: str, cache_name: str, kv_branch: str) -> bool:
        """Whether a complete logical-branch cache has been published."""
        self._cross_length(cache_name)
        self._kv_branch_index(kv_branch)
        return kv_branch in self._cross_sessions.get(session_id, {}).get(cache_name, {})

    def read_cross_attention_kv(self, session_id: str, cache_name: str, layer_idx: int,
                                kv_branch: str) -> dict:
        """``{"is_init": True, "k": (1, L, H, D), "v": (1, L, H, D)}`` for one layer.

        Raises:
          RuntimeError: the cache was not populated.
        """
        self._cross_length(cache_name)
        self._kv_branch_index(kv_branch)
        session = self._cross_sessions.get(session_id)
        if session is None:
            raise RuntimeError(f"AR-Diffusion cross-attention cache {cache_name!r} for session {session_id!r} "
                               "was read before it was populated")
        pool = session.get(cache_name, {}).get(kv_branch)
        if pool is None:
            raise RuntimeError(f"AR-Diffusion cross-attention cache {cache_name!r} for session {session_id!r} "
                               f"and KV branch {kv_branch!r} was read before it was populated")
        return {"is_init": True, "k": pool[0][layer_idx][None], "v": pool[1][layer_idx][None]}

    def retain_cross_attention(self, session_id: str, cache_names: Collection[str]) -> None:
        """Releases the session's caches whose names are not in ``cache_names``."""
        session = self._cross_sessions.get(session_id)
        if session is None:
            return
        for name in [n for n in session if n not in set(cache_names)]:
            del session[name]
        if not session:
            del self._cross_sessions[session_id]

    def release_cross_attention(self, session_id: str) -> None:
        """Releases every cross-attention cache of the session."""
        self._cross_sessions.pop(session_id, None)

    # -- helpers ----------------------------------------------------------------------------------
    def _pools(self) -> tuple[jax.Array, jax.Array]:
        if self._k_pool is None:
            raise RuntimeError("AR-Diffusion K/V pools require a configured pool device")
        return self._k_pool, self._v_pool

    def _cross_length(self, cache_name: str) -> int:
        return lookup(self.cross_attention_lengths, cache_name, "AR-Diffusion cross-attention cache")

    def _row(self, adapter: ARDiffusionRequestAdapter) -> int:
        if self._adapters.get(adapter.request_id) is not adapter:
            raise KeyError(f"AR-Diffusion request {adapter.request_id!r} is not active")
        return adapter.row

    def _kv_branch_index(self, kv_branch: str) -> int:
        return lookup(self._branch_index, kv_branch, "AR-Diffusion KV branch")

    def _allocate(self, adapter: ARDiffusionRequestAdapter, num_tokens: int, what: str) -> list[int]:
        row = self._row(adapter)
        layout = self._state.layout
        needed = (ceil_div(adapter.num_computed_tokens + num_tokens, layout.tokens_per_frame) * layout.pages_per_frame
                  - int(self._state.evicted_pages[row]))
        if needed > layout.table_width:  # vLLM-Omni's tables are unbounded: widen ours (host-side, rare)
            self._state = core.resize(self._state, table_width=max(needed, 2 * layout.table_width))
        self._state, ok = _allocate(self._state, jnp.array([row]), num_tokens)
        if not bool(ok[0]):
            raise RuntimeError(f"AR-Diffusion KV pool exhausted while allocating {what}")
        return self.block_table(adapter)


def seed_block_table(state: core.BlockTableState, row: int) -> list[int]:
    """A state row's table in vLLM-Omni's S1 form: compacted-away blocks shown as null (0) entries
    after the sink."""
    stored = np.asarray(state.tables[row, : int(state.num_pages[row])]).tolist()
    evicted = int(state.evicted_pages[row])
    sink = min(state.layout.sink_pages, len(stored))
    return stored[:sink] + [0] * evicted + stored[sink:]


def _drop_batch(x) -> jax.Array:
    """``(1, L, H, D) -> (L, H, D)``; 3-D arrays pass through."""
    x = jnp.asarray(x)
    return x[0] if x.ndim == 4 else x
