"""vLLM-Omni's AR-Diffusion KV cache API, on arkv-jax's functional core.

A migration path and a proof of equivalence: the classes and functions here have vLLM-Omni's names
(a *block* here is a page of the core, a *chunk* a frame), constructor keywords, attributes, return
values, exception types and messages, but every block operation runs through :mod:`arkv_jax.state`
(jitted, donated) and the arithmetic through :mod:`arkv_jax.planner`. Physical block ids and
free-list order match vLLM-Omni's.

Checks come first, here, in vLLM-Omni's order and with its exact messages (the core types raise
their own); the one check that needs the planner's arithmetic (one session must fit) is the
planner's :class:`~arkv_jax.planner.InsufficientMemoryError`, re-raised in vLLM-Omni's words.

What vLLM-Omni accepts, this accepts, with the same effect:

* ``device=``: ``None`` (bookkeeping only, as in vLLM-Omni), a JAX device, a platform string
  (``"cpu"``, ``"cuda"`` or ``"gpu"``, ``"tpu"``, optionally ``":index"``, e.g. ``"cuda:1"``) or a
  ``torch.device`` (read duck-typed from ``.type`` and ``.index``; torch is never imported). A
  string maps to ``jax.devices(platform)[index]``.
* ``commit_chunk`` on a request whose chunk was never allocated: advanced by one chunk, with the
  window rule applied to the blocks the request holds (vLLM clips the skipped range to its table);
  the next ``allocate_chunk`` allocates every block the computed tokens need, in vLLM's order
  (:func:`arkv_jax.state.advance`). The native ``PagedKVCache`` keeps refusing this.
  As in vLLM, an allocation whose capacity check passes but whose blocks do not fit (possible
  only after such commits: vLLM's check discounts blocks already out of the window) raises
  ``ValueError("Cannot get N free blocks from the pool")`` instead of the exhaustion error.

Refused with a clear error, where vLLM-Omni fails obscurely or silently: layer indices out of
range (``IndexError``; negative indices count from the end, like vLLM-Omni's Python lists), bool or
non-integer layer indices (``TypeError``; vLLM-Omni's lists take ``True`` as layer 1), chunk K/V
with the wrong token count or heads/head size (``ValueError``; torch's indexed write would
broadcast a single token over the whole chunk) or of a non-floating dtype (``TypeError``), and a
chunk write or slot mapping whose blocks were not allocated (``IndexError``, as torch's indexing
of the short table raises). A refused call changes nothing.

Differences, all deliberate:

* Block tables are compacted (vLLM-Omni S3), so ``max_model_len`` never clips a long session.
* K/V arrays are JAX arrays; floating K/V are cast to the pool dtype (torch's indexed write
  would refuse a dtype mismatch). An unbatched ``(chunk_size, heads, head_size)`` chunk is written
  as is (vLLM-Omni takes its index 0, one token, and broadcasts it over the chunk).

Layout: a request's tokens are laid out as vLLM-Omni lays them out, for every ``chunk_size`` and
``block_size``: contiguously, token ``p`` (prefill included) at flat slot
``table[p // block_size] * block_size + p % block_size``, so a block may hold the end of one
chunk and the start of the next. ``allocate_chunk`` takes ``cdiv(computed + chunk_size,
block_size) - len(table)`` blocks, ``chunk_write_slots`` is ``chunk_slot_mapping`` over the
block table, and a commit nulls the wholly skipped blocks after the sink: table indices
``[ceil(sink_tokens / block_size), floor((sink_tokens + skipped) / block_size))``, walked
backwards to the first null entry (vLLM-Omni S2; S1's ``[sink_chunks, sink_chunks + skipped //
block_size)`` when a chunk is a block), so a block shared with a sink or in-window token stays.
``block_table``, ``window_block_ids``, ``key_cache``/``value_cache`` and the slot mappings
therefore describe where the data is exactly as vLLM-Omni's formulas read them. The state
behind the cache (:attr:`ARDiffusionKVCache.state`) has one-page frames (``tokens_per_frame ==
block_size``); this module applies vLLM-Omni's token-granular window rule to it
(the native ``PagedKVCache`` keeps frame-aligned pages).

The module is one file because it mirrors one vLLM-Omni module (the manager and its helpers)
name for name.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import re
from typing import Collection, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from arkv_jax import state as core
from arkv_jax.cache.cross_attention import collect_cross_attention_layers
from arkv_jax.config import CacheGeometry, CrossAttentionSpec, KVBranch, WindowPolicy, ceil_div, lookup
from arkv_jax.planner import InsufficientMemoryError, compute_num_blocks, plan_memory, scratch_blocks_per_branch
from pallas_kernels.layout import layer_token_major, pool_geometry, pool_shape, write_tokens

__all__ = [
    "ARDiffusionKVConfig", "ARDiffusionKVBranchSpec", "ARDiffusionRequestAdapter", "ARDiffusionKVCache",
    "compute_num_blocks", "compute_slot_mapping", "chunk_slot_mapping", "resident_block_ids", "resolve_device",
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
    """``pool``'s layer ``layer`` gets token-major ``new`` ``[n, heads, dim]`` at the flat slots
    ``slots`` (``page * block_size + offset``), in the pool's own layout."""
    block_size = pool_geometry(pool).block_size
    return write_tokens(pool, layer, slots // block_size, slots % block_size, new)


_begin = jax.jit(core.begin, donate_argnums=0)
_allocate = jax.jit(core.allocate, donate_argnums=0)
_end = jax.jit(core.end, donate_argnums=0)

#: The core state's own window rule is disabled (its window never ends): this module evicts.
_CORE_NEVER_EVICTS = 1 << 30


@functools.partial(jax.jit, donate_argnums=0)
def _place_row(state, row, evicted_pages, computed_tokens):
    """Row ``row`` evicted up to ``evicted_pages`` pages after the sink (highest table index first,
    compacted, as :func:`arkv_jax.state.commit` frees) and positioned at ``computed_tokens`` tokens
    (``computed // block_size`` whole pages plus the rest, so the core's token arithmetic is
    vLLM's contiguous one)."""
    rows = row[None]
    target = evicted_pages[None]
    state, _ = core._evict(state, rows, jnp.ones((1,), bool), target, target)
    block_size = state.layout.block_size
    return state.replace(committed_frames=state.committed_frames.at[row].set(computed_tokens // block_size),
                         prefill_tokens=state.prefill_tokens.at[row].set(computed_tokens % block_size))


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
        self.device = resolve_device(device)
        self._branch_index = {b.name: b.local_index for b in self.kv_branches}
        # vLLM-Omni's contiguous token layout: one-page frames, so the core allocates token-granular
        # contiguous pages; the window rule (token-granular, chunk-snapped) is applied here.
        self._sink_tokens = config.sink_chunks * config.chunk_size
        width = ceil_div((config.sink_chunks + config.window_chunks + frames_per_block) * config.chunk_size,
                         block_size) + 2
        layout = core.StateLayout(tokens_per_frame=block_size, block_size=block_size,
                                  sink_frames=ceil_div(self._sink_tokens, block_size),
                                  window_frames=_CORE_NEVER_EVICTS, reset_at_boundary=False,
                                  table_width=width, num_blocks=self.managed_num_blocks)
        self._state = core.init_state(layout, num_rows=max(4, 2 * self.session_capacity * len(self.kv_branches)))
        self._adapters: dict[str, ARDiffusionRequestAdapter] = {}
        self._free_rows: list[int] = list(range(self._state.num_rows))
        self._k_pool = self._v_pool = None
        self._cross_sessions: dict[str, dict[str, dict[str, tuple[jax.Array, jax.Array]]]] = {}
        if self.device is not None:
            shape = pool_shape(num_layers, self.num_blocks_total, block_size, num_kv_heads, head_size)
            self._k_pool = jax.device_put(jnp.zeros(shape, self.dtype), self.device)
            self._v_pool = jax.device_put(jnp.zeros(shape, self.dtype), self.device)

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

        Allocates every block the computed tokens and the chunk need that the request does not
        hold (after commits of unallocated chunks, that is more than the chunk's own blocks).

        Raises:
          RuntimeError: the pool is exhausted (nothing is allocated).
          ValueError: ``Cannot get N free blocks from the pool``, where vLLM's capacity check
            passes but its block pool cannot serve (only after commits of unallocated chunks).
        """
        return self._allocate(adapter, self.config.chunk_size, "a chunk")

    def allocate_token_slots(self, adapter: ARDiffusionRequestAdapter, num_tokens: int) -> list[int]:
        """Allocates blocks for ``num_tokens`` in-flight tokens without committing them.

        Raises:
          ValueError: ``num_tokens <= 0``, or as :meth:`allocate_chunk`.
          RuntimeError: the pool is exhausted (nothing is allocated).
        """
        if num_tokens <= 0:
            raise ValueError(f"num_tokens must be positive, got {num_tokens}")
        return self._allocate(adapter, num_tokens, "paged attention slots")

    def commit_chunk(self, adapter: ARDiffusionRequestAdapter) -> None:
        """Advances the request by one chunk and frees blocks that left the window.

        As in vLLM-Omni, the chunk's blocks need not have been allocated: the request advances all
        the same and the window rule frees what it holds out of the window; the next
        :meth:`allocate_chunk` then allocates every block the computed tokens need.
        """
        row = self._row(adapter)
        adapter.on_chunk_committed()
        self._remove_skipped_blocks(row, adapter.num_computed_tokens)

    def block_table(self, adapter: ARDiffusionRequestAdapter) -> list[int]:
        """The request's table in vLLM-Omni's form: sink blocks, a null placeholder per evicted
        block, then the live and in-flight blocks."""
        return seed_block_table(self._state, self._row(adapter))

    def chunk_write_slots(self, adapter: ARDiffusionRequestAdapter) -> jax.Array:
        """Slot mapping of the in-flight chunk (the K/V write target), ``(chunk_size,)`` int32.

        vLLM-Omni's ``chunk_slot_mapping(block_table, num_computed_tokens, chunk_size,
        block_size)``: token ``p`` at ``table[p // block_size] * block_size + p % block_size``.

        Raises:
          IndexError: some of the chunk's tokens have no allocated block (as vLLM-Omni's table
            lookup raises); call :meth:`allocate_chunk` first.
        """
        return jnp.asarray(self._chunk_slots(adapter), jnp.int32)

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
        """Layer ``layer_idx``'s K pool, ``[num_blocks_total, block_size, heads, head_size]``.

        The seed's token-major view: the pools themselves are head-major
        (:func:`pallas_kernels.layout.pool_shape`), so this is a copy of the layer
        (:func:`pallas_kernels.layout.layer_token_major`), not a view that later writes update.

        Raises:
          RuntimeError: no pool device. TypeError: ``layer_idx`` is not an int (or is a bool).
          IndexError: ``layer_idx`` is out of range (negative indices count from the end).
        """
        k_pool = self._pools()[0]
        return layer_token_major(k_pool, self._layer(layer_idx, "layer_idx"))

    def value_cache(self, layer_idx: int) -> jax.Array:
        """Layer ``layer_idx``'s V pool, ``[num_blocks_total, block_size, heads, head_size]`` (a
        token-major copy, as :meth:`key_cache`).

        Raises: as :meth:`key_cache`.
        """
        v_pool = self._pools()[1]
        return layer_token_major(v_pool, self._layer(layer_idx, "layer_idx"))

    def write_chunk_kv(self, layer_index: int, new_k, new_v, adapter: ARDiffusionRequestAdapter) -> None:
        """Writes one layer's K/V of the in-flight chunk into its slots, in place.

        ``new_k`` and ``new_v`` have shape ``(B, chunk_size, heads, head_size)`` (batch 0 is
        written, as in vLLM-Omni) or ``(chunk_size, heads, head_size)``, and a floating dtype (cast
        to the pool's). Everything is checked before anything is written: a refused call changes
        nothing.

        Raises:
          RuntimeError: no pool device. KeyError: the request is not active.
          TypeError: ``layer_index`` is not an int (or is a bool), or K/V are not floating.
          IndexError: ``layer_index`` is out of range, or the chunk's blocks were not allocated.
          ValueError: K/V of the wrong shape (e.g. one token for a whole chunk).
        """
        k_pool, v_pool = self._pools()
        layer = self._layer(layer_index, "layer_index")
        slots = self.chunk_write_slots(adapter)
        new_k = self._chunk_kv("new_k", new_k)
        new_v = self._chunk_kv("new_v", new_v)
        self._k_pool = _write_slots(k_pool, layer, slots, new_k.astype(k_pool.dtype))
        self._v_pool = _write_slots(v_pool, layer, slots, new_v.astype(v_pool.dtype))

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
          KeyError: unknown cache or branch. RuntimeError: the cache was not populated.
          TypeError: ``layer_idx`` is not an int (or is a bool). IndexError: ``layer_idx`` is out of
          range (negative indices count from the end).
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
        layer = self._layer(layer_idx, "layer_idx")
        return {"is_init": True, "k": pool[0][layer][None], "v": pool[1][layer][None]}

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

    def _layer(self, index, name: str) -> int:
        """``index`` as a layer in ``[0, num_layers)``; negative indices count from the end, as the
        vLLM-Omni's per-layer lists do."""
        if isinstance(index, (bool, np.bool_)) or str(getattr(index, "dtype", "")) in ("bool", "torch.bool"):
            raise TypeError(f"{name} must be an int, got bool {index!r}")
        try:
            layer = operator.index(index)
        except TypeError:
            raise TypeError(f"{name} must be an int, got {type(index).__name__} {index!r}") from None
        if not -self.num_layers <= layer < self.num_layers:
            raise IndexError(f"{name} {layer} is out of range for {self.num_layers} layers: expected "
                             f"0 <= {name} < {self.num_layers} (or -{self.num_layers} <= {name} < 0 "
                             "from the end)")
        return layer % self.num_layers

    def _chunk_kv(self, name: str, x) -> jax.Array:
        """One chunk's K or V as ``(chunk_size, heads, head_size)``, checked."""
        if not isinstance(x, (jax.Array, np.ndarray)):
            x = np.asarray(x)
        chunk, heads, dim = self.config.chunk_size, self.num_kv_heads, self.head_size
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must have a floating dtype (the pool holds {jnp.dtype(self.dtype).name}), "
                            f"got {x.dtype}")
        shape = tuple(x.shape)
        if not (shape == (chunk, heads, dim) or (len(shape) == 4 and shape[0] >= 1
                                                    and shape[1:] == (chunk, heads, dim))):
            raise ValueError(f"{name} must have shape (1, {chunk}, {heads}, {dim}) (batch 0 is written) or "
                             f"({chunk}, {heads}, {dim}): one K/V per token of the chunk, got {shape}")
        return jnp.asarray(x[0] if len(shape) == 4 else x)

    def _chunk_slots(self, adapter: ARDiffusionRequestAdapter) -> np.ndarray:
        """Flat slots of the in-flight chunk's tokens: vLLM-Omni's contiguous formula (host-side)."""
        table = np.asarray(self.block_table(adapter), np.int64)
        start = adapter.num_computed_tokens
        tokens = np.arange(start, start + self.config.chunk_size, dtype=np.int64)
        index = tokens // self.block_size
        pages = table[np.minimum(index, len(table) - 1)] if len(table) else np.zeros_like(index)
        missing = (index >= len(table)) | (pages == self.null_block_id)
        if missing.any():
            first = int(tokens[np.argmax(missing)])
            raise IndexError(f"AR-Diffusion request {adapter.request_id!r} has no allocated block for tokens "
                             f"[{first}, {start + self.config.chunk_size}) of its in-flight chunk (table "
                             f"{table.tolist()}); call allocate_chunk before writing the chunk")
        return pages * self.block_size + tokens % self.block_size

    def _cross_length(self, cache_name: str) -> int:
        return lookup(self.cross_attention_lengths, cache_name, "AR-Diffusion cross-attention cache")

    def _row(self, adapter: ARDiffusionRequestAdapter) -> int:
        if self._adapters.get(adapter.request_id) is not adapter:
            raise KeyError(f"AR-Diffusion request {adapter.request_id!r} is not active")
        return adapter.row

    def _kv_branch_index(self, kv_branch: str) -> int:
        return lookup(self._branch_index, kv_branch, "AR-Diffusion KV branch")

    def _skipped_tokens(self, computed: int) -> int:
        """vLLM-Omni's skip rule (seed-semantics §4.2): tokens after the sink out of the window once
        ``computed`` tokens are committed, snapped down to a chunk boundary."""
        chunk = self.config.chunk_size
        if self.config.reset_at_boundary:
            return max(0, computed // chunk * chunk - self._sink_tokens)
        return max(0, computed - self.config.window_chunks * chunk - self._sink_tokens) // chunk * chunk

    def _remove_skipped_blocks(self, row: int, computed: int) -> None:
        """vLLM-Omni's ``remove_skipped_blocks`` at ``computed`` tokens: table indices
        ``[ceil(sink / block_size), floor((sink + skipped) / block_size))``, clipped to the table,
        walked backwards to the first null entry, are freed; then the row is positioned at
        ``computed`` tokens."""
        evicted = int(self._state.evicted_pages[row])
        target = evicted
        skipped = self._skipped_tokens(computed)
        if skipped > 0:
            held = int(self._state.num_pages[row]) + evicted
            last = min((self._sink_tokens + skipped) // self.block_size, held)
            target = max(evicted, last - self._state.layout.sink_pages)
        self._state = _place_row(self._state, jnp.asarray(row, jnp.int32), jnp.asarray(target, jnp.int32),
                                 jnp.asarray(computed, jnp.int32))

    def _allocate(self, adapter: ARDiffusionRequestAdapter, num_tokens: int, what: str) -> list[int]:
        row = self._row(adapter)
        computed = adapter.num_computed_tokens
        # vLLM's allocate_slots runs the window walk first (a no-op unless blocks out of the window
        # are still held: after commits of unallocated chunks or a long prefill)
        if self._skipped_tokens(computed) > 0:
            self._remove_skipped_blocks(row, computed)
        required = ceil_div(computed + num_tokens, self.block_size)
        needed = required - int(self._state.evicted_pages[row])
        width = self._state.layout.table_width
        if needed > width:  # vLLM-Omni's tables are unbounded: widen ours (host-side, rare)
            self._state = core.resize(self._state, table_width=max(needed, 2 * width))
        self._state, ok = _allocate(self._state, jnp.array([row]), num_tokens)
        if not bool(ok[0]):
            # vLLM checks max(required - max(skipped, held), 0) blocks against the free count but
            # then takes required - held: after commits of unallocated chunks the check can pass
            # and BlockPool.get_new_blocks raise (the out-of-window eviction already happened).
            held = len(self.block_table(adapter))
            skipped = self._skipped_tokens(computed) // self.block_size
            free = self.num_free_blocks()
            if max(required - max(skipped, held), 0) <= free < required - held:
                raise ValueError(f"Cannot get {required - held} free blocks from the pool")
            raise RuntimeError(f"AR-Diffusion KV pool exhausted while allocating {what}")
        return self.block_table(adapter)


#: Platform strings vLLM-Omni users pass (torch's device types) -> JAX platform names.
_PLATFORMS = {"cpu": "cpu", "cuda": "gpu", "gpu": "gpu", "tpu": "tpu"}


def _available_platforms() -> list[str]:
    found = []
    for platform in ("cpu", "gpu", "tpu"):
        try:
            if jax.devices(platform):
                found.append(platform)
        except (RuntimeError, ValueError):
            pass
    return found


def resolve_device(device) -> jax.Device | None:
    """The JAX device for a vLLM-Omni-style ``device=`` argument.

    ``None`` stays ``None`` (bookkeeping only). A :class:`jax.Device` is used as is. A platform
    string ``"cpu"``, ``"cuda"`` (or ``"gpu"``) or ``"tpu"``, optionally with ``":index"`` (e.g.
    ``"cuda:1"``), maps to ``jax.devices(platform)[index]`` (index 0 by default). A
    ``torch.device`` is read duck-typed from its ``.type`` and ``.index``.

    Raises:
      TypeError: any other type (an int, a bool, ...).
      ValueError: a string that is not such a platform, a platform JAX does not have here, or an
        index past its devices; the message names ``device``, the value and what is available.
    """
    if device is None or isinstance(device, jax.Device):
        return device
    if isinstance(device, str):
        spec = device
    elif isinstance(getattr(device, "type", None), str) and not isinstance(device, (bool, int)):
        index = getattr(device, "index", None)  # a torch.device, read without importing torch
        spec = device.type if index is None else f"{device.type}:{index}"
    else:
        raise TypeError("device must be None, a jax.Device, a platform string ('cpu', 'cuda', 'cuda:1', "
                        f"'gpu', 'tpu') or a torch.device, got {type(device).__name__} {device!r}")
    match = re.fullmatch(r"(cpu|cuda|gpu|tpu)(?::(\d+))?", spec)
    if match is None:
        raise ValueError(f"device={device!r} is not a platform string: expected 'cpu', 'cuda', 'gpu' or 'tpu', "
                         "optionally followed by ':index' (e.g. 'cuda:1')")
    platform, index = _PLATFORMS[match[1]], int(match[2] or 0)
    try:
        devices = jax.devices(platform)
    except (RuntimeError, ValueError):
        devices = []
    if not devices:
        raise ValueError(f"device={device!r} asks for the JAX platform {platform!r}, which JAX does not have here; "
                         f"available platforms: {', '.join(_available_platforms())}")
    if index >= len(devices):
        raise ValueError(f"device={device!r} asks for {platform} device {index}, but JAX has {len(devices)} "
                         f"{platform} device{'s' if len(devices) != 1 else ''} here (indices 0..{len(devices) - 1})")
    return devices[index]


def seed_block_table(state: core.BlockTableState, row: int) -> list[int]:
    """A state row's table in vLLM-Omni's S1 form: compacted-away blocks shown as null (0) entries
    after the sink."""
    stored = np.asarray(state.tables[row, : int(state.num_pages[row])]).tolist()
    evicted = int(state.evicted_pages[row])
    sink = min(state.layout.sink_pages, len(stored))
    return stored[:sink] + [0] * evicted + stored[sink:]

