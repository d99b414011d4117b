"""vLLM-Omni's AR-Diffusion KV cache API, on arkv-jax's functional core.

The names here are vLLM-Omni's (a *block* is a page of the core, a *chunk* a frame), and so are
the constructor keywords, attributes, return values, exception types, messages, physical block ids
and free-list order; block operations run through :mod:`arkv_jax.state` (jitted, donated), the
arithmetic through :mod:`arkv_jax.planner`. This module is the manager, :class:`ARDiffusionKVCache`;
its parts sit beside it, one job each: ``vllm_omni_config`` (configuration, constructor checks,
plan), ``vllm_omni_blocks`` (contiguous block tables and window walk), ``vllm_omni_pools`` (K/V
pools), ``vllm_omni_cross_attention`` and ``vllm_omni_devices`` (``device=``). What it accepts,
refuses and does differently from vLLM-Omni: ``docs/migrating-from-vllm-omni.md``.
"""

from __future__ import annotations

from typing import Collection, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from arkv_jax import state as core
from arkv_jax.compat.vllm_omni_blocks import (
    ContiguousBlocks,
    chunk_slot_mapping,
    compute_slot_mapping,
    resident_block_ids,
    seed_block_table,
)
from arkv_jax.compat.vllm_omni_config import ARDiffusionKVBranchSpec, ARDiffusionKVConfig, plan_cache
from arkv_jax.compat.vllm_omni_cross_attention import CrossAttentionSessions
from arkv_jax.compat.vllm_omni_devices import resolve_device
from arkv_jax.compat.vllm_omni_pools import PagedKVPools, check_layer
from arkv_jax.config import KVBranch, lookup
from arkv_jax.planner import compute_num_blocks

__all__ = [
    "ARDiffusionKVConfig", "ARDiffusionKVBranchSpec", "ARDiffusionRequestAdapter", "ARDiffusionKVCache",
    "compute_num_blocks", "compute_slot_mapping", "chunk_slot_mapping", "resident_block_ids", "resolve_device",
    "seed_block_table",
]


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


class ARDiffusionKVCache:
    """vLLM-Omni's ``ARDiffusionKVCache``: plan, pools and per-request block operations.

    Per request: ``begin_request`` -> per chunk (``allocate_chunk`` -> ``chunk_write_slots`` ->
    [model writes K/V] -> ``commit_chunk``) -> ``end_request``. The plan's attributes are copied
    onto the cache under vLLM-Omni's names; the block tables are a
    :class:`~arkv_jax.compat.vllm_omni_blocks.ContiguousBlocks` (:attr:`state`), the pools a
    :class:`~arkv_jax.compat.vllm_omni_pools.PagedKVPools` (``None`` without ``device``), the
    cross-attention caches a
    :class:`~arkv_jax.compat.vllm_omni_cross_attention.CrossAttentionSessions`.
    """

    def __init__(self, config: ARDiffusionKVConfig, *, num_layers: int, num_kv_heads: int, head_size: int,
                 dtype, block_size: int, max_model_len: int, available_bytes: int,
                 kv_branches: Sequence[KVBranch], session_capacity: int,
                 cross_attention_lengths: dict[str, int] | None = None, device=None,
                 frames_per_block: int = 1, max_scratch_tokens_per_branch: int = 0,
                 model_owned_state_bytes_per_session: int = 0) -> None:
        self.cross_attention_lengths = dict(cross_attention_lengths or {})
        self.geometry, self.window, self.plan = plan_cache(
            config, num_layers=num_layers, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype,
            block_size=block_size, available_bytes=available_bytes, kv_branches=kv_branches,
            session_capacity=session_capacity, cross_attention_lengths=self.cross_attention_lengths,
            frames_per_block=frames_per_block, max_scratch_tokens_per_branch=max_scratch_tokens_per_branch,
            model_owned_state_bytes_per_session=model_owned_state_bytes_per_session)
        self.kv_branches, self.config = tuple(kv_branches), config
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
        self._blocks = ContiguousBlocks(self.window, chunk_size=config.chunk_size, block_size=block_size,
                                        frames_per_block=frames_per_block, num_blocks=self.managed_num_blocks,
                                        num_rows=max(4, 2 * self.session_capacity * len(self.kv_branches)))
        self._adapters: dict[str, ARDiffusionRequestAdapter] = {}
        self._kv = PagedKVPools(num_layers=num_layers, num_blocks=self.num_blocks_total, block_size=block_size,
                                num_kv_heads=num_kv_heads, head_size=head_size, chunk_size=config.chunk_size,
                                dtype=self.dtype, device=self.device)
        self._cross = CrossAttentionSessions(self.cross_attention_lengths, self._branch_index,
                                             capacity=self.session_capacity, num_layers=num_layers,
                                             num_kv_heads=num_kv_heads, head_size=head_size, dtype=self.dtype,
                                             device=self.device)

    # -- request lifecycle ------------------------------------------------------------------------
    def begin_request(self, request_id: str, *, prefill_prefix_tokens: int = 0) -> ARDiffusionRequestAdapter:
        """Registers a request (one row of the state) and returns its adapter."""
        if request_id in self._adapters:
            raise ValueError(f"AR-Diffusion request {request_id!r} is already active")
        if prefill_prefix_tokens < 0:
            raise ValueError(f"prefill_prefix_tokens must be non-negative, got {prefill_prefix_tokens}")
        row = self._blocks.begin(prefill_prefix_tokens)
        adapter = ARDiffusionRequestAdapter(request_id, chunk_size=self.config.chunk_size,
                                            prefill_prefix_tokens=prefill_prefix_tokens, row=row)
        self._adapters[request_id] = adapter
        return adapter

    def end_request(self, adapter: ARDiffusionRequestAdapter) -> None:
        """Returns every block of the request to the pool (its table in reverse)."""
        self._blocks.end(self._row(adapter))
        self._adapters.pop(adapter.request_id, None)

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
        return self._blocks.allocate(self._row(adapter), adapter.num_computed_tokens, self.config.chunk_size,
                                     "a chunk")

    def allocate_token_slots(self, adapter: ARDiffusionRequestAdapter, num_tokens: int) -> list[int]:
        """Allocates blocks for ``num_tokens`` in-flight tokens without committing them.

        Raises:
          ValueError: ``num_tokens <= 0``, or as :meth:`allocate_chunk`.
          RuntimeError: the pool is exhausted (nothing is allocated).
        """
        if num_tokens <= 0:
            raise ValueError(f"num_tokens must be positive, got {num_tokens}")
        return self._blocks.allocate(self._row(adapter), adapter.num_computed_tokens, num_tokens,
                                     "paged attention slots")

    def commit_chunk(self, adapter: ARDiffusionRequestAdapter) -> None:
        """Advances the request by one chunk and frees blocks that left the window.

        As in vLLM-Omni, the chunk's blocks need not have been allocated: the request advances all
        the same and the window rule frees what it holds out of the window; the next
        :meth:`allocate_chunk` then allocates every block the computed tokens need.
        """
        row = self._row(adapter)
        adapter.on_chunk_committed()
        self._blocks.remove_skipped_blocks(row, adapter.num_computed_tokens)

    def block_table(self, adapter: ARDiffusionRequestAdapter) -> list[int]:
        """The request's table in vLLM-Omni's form: sink blocks, a null placeholder per evicted
        block, then the live and in-flight blocks."""
        return self._blocks.table(self._row(adapter))

    def chunk_write_slots(self, adapter: ARDiffusionRequestAdapter) -> jax.Array:
        """Slot mapping of the in-flight chunk (the K/V write target), ``(chunk_size,)`` int32.

        vLLM-Omni's ``chunk_slot_mapping(block_table, num_computed_tokens, chunk_size,
        block_size)``: token ``p`` at ``table[p // block_size] * block_size + p % block_size``.

        Raises:
          IndexError: some of the chunk's tokens have no allocated block (as vLLM-Omni's table
            lookup raises); call :meth:`allocate_chunk` first.
        """
        slots = self._blocks.chunk_slots(self._row(adapter), adapter.num_computed_tokens, adapter.request_id)
        return jnp.asarray(slots.astype(np.int32))

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
        return self._blocks.num_free()

    @property
    def state(self) -> core.BlockTableState:
        """The functional block-table state behind this cache."""
        return self._blocks.state

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
        return self._kv.key_cache(layer_idx)

    def value_cache(self, layer_idx: int) -> jax.Array:
        """Layer ``layer_idx``'s V pool, ``[num_blocks_total, block_size, heads, head_size]`` (a
        token-major copy, as :meth:`key_cache`).

        Raises: as :meth:`key_cache`.
        """
        return self._kv.value_cache(layer_idx)

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
        self._kv.require()
        layer = check_layer(layer_index, "layer_index", self.num_layers)
        self._kv.write(layer, self.chunk_write_slots(adapter), new_k, new_v)

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
        self._cross.populate(session_id, cache_name, kv_branch, layer_kv)

    def is_cross_attention_populated(self, session_id: str, cache_name: str, kv_branch: str) -> bool:
        """Whether a complete logical-branch cache has been published."""
        return self._cross.is_populated(session_id, cache_name, kv_branch)

    def read_cross_attention_kv(self, session_id: str, cache_name: str, layer_idx: int,
                                kv_branch: str) -> dict:
        """``{"is_init": True, "k": (1, L, H, D), "v": (1, L, H, D)}`` for one layer.

        Raises:
          KeyError: unknown cache or branch. RuntimeError: the cache was not populated.
          TypeError: ``layer_idx`` is not an int (or is a bool). IndexError: ``layer_idx`` is out of
          range (negative indices count from the end).
        """
        return self._cross.read(session_id, cache_name, layer_idx, kv_branch)

    def retain_cross_attention(self, session_id: str, cache_names: Collection[str]) -> None:
        """Releases the session's caches whose names are not in ``cache_names``."""
        self._cross.retain(session_id, cache_names)

    def release_cross_attention(self, session_id: str) -> None:
        """Releases every cross-attention cache of the session."""
        self._cross.release(session_id)

    # -- helpers ----------------------------------------------------------------------------------
    def _row(self, adapter: ARDiffusionRequestAdapter) -> int:
        if self._adapters.get(adapter.request_id) is not adapter:
            raise KeyError(f"AR-Diffusion request {adapter.request_id!r} is not active")
        return adapter.row

    def _kv_branch_index(self, kv_branch: str) -> int:
        return lookup(self._branch_index, kv_branch, "AR-Diffusion KV branch")
