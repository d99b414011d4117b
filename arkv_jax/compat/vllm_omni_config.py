"""vLLM-Omni's AR-Diffusion KV configuration, its constructor checks and the memory plan.

:class:`ARDiffusionKVConfig` and :class:`ARDiffusionKVBranchSpec` are vLLM-Omni's types;
:func:`plan_cache` checks ``ARDiffusionKVCache``'s constructor arguments first, in vLLM-Omni's order
and with its exact messages (the core types raise their own), then builds the
:class:`~arkv_jax.config.CacheGeometry`, :class:`~arkv_jax.config.WindowPolicy` and
:class:`~arkv_jax.planner.MemoryPlan` (a chunk is a frame), re-raising the planner's
:class:`~arkv_jax.planner.InsufficientMemoryError` (one session must fit) in vLLM-Omni's words.

Part of :mod:`arkv_jax.compat.vllm_omni`, which re-exports the types; see
``docs/migrating-from-vllm-omni.md``.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from arkv_jax.config import CacheGeometry, CrossAttentionSpec, KVBranch, WindowPolicy
from arkv_jax.planner import (
    InsufficientMemoryError,
    MemoryPlan,
    compute_num_blocks,
    plan_memory,
    scratch_blocks_per_branch,
)

__all__ = ["ARDiffusionKVConfig", "ARDiffusionKVBranchSpec", "plan_cache"]


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


def plan_cache(config: ARDiffusionKVConfig, *, num_layers: int, num_kv_heads: int, head_size: int, dtype,
               block_size: int, available_bytes: int, kv_branches: Sequence[KVBranch], session_capacity: int,
               cross_attention_lengths: dict[str, int], frames_per_block: int, max_scratch_tokens_per_branch: int,
               model_owned_state_bytes_per_session: int) -> tuple[CacheGeometry, WindowPolicy, MemoryPlan]:
    """``(geometry, window, plan)`` of an ``ARDiffusionKVCache``: a chunk is a frame of
    ``chunk_size`` tokens, the window ``window_chunks`` chunks after ``sink_chunks``.

    Raises:
      ValueError: an argument out of range (vLLM-Omni's checks, in its order, then the core
        types'), a bad ``AR_DIFFUSION_KV_SCRATCH_BLOCKS_PER_BRANCH``, or memory that cannot fit
        one session (vLLM-Omni's message).
    """
    _check_cache_arguments(
        config, num_layers=num_layers, num_kv_heads=num_kv_heads, head_size=head_size, block_size=block_size,
        kv_branches=kv_branches, session_capacity=session_capacity, cross_attention_lengths=cross_attention_lengths,
        frames_per_block=frames_per_block, max_scratch_tokens_per_branch=max_scratch_tokens_per_branch,
        model_owned_state_bytes_per_session=model_owned_state_bytes_per_session)
    geometry = CacheGeometry(num_layers, num_kv_heads, head_size, dtype, config.chunk_size,
                             block_size=block_size, frames_per_forward=frames_per_block)
    window = WindowPolicy(config.window_chunks, config.sink_chunks, config.reset_at_boundary)
    scratch_blocks_per_branch(geometry, max_scratch_tokens_per_branch)  # checks the environment
    compute_num_blocks(available_bytes, config.gpu_memory_fraction, geometry.page_bytes)
    try:
        plan = plan_memory(
            geometry, window, tuple(kv_branches), available_bytes=available_bytes,
            memory_fraction=config.gpu_memory_fraction, session_capacity=session_capacity,
            cross_attention=tuple(CrossAttentionSpec(n, t) for n, t in cross_attention_lengths.items()),
            max_scratch_tokens_per_branch=max_scratch_tokens_per_branch,
            model_owned_state_bytes_per_session=model_owned_state_bytes_per_session)
    except InsufficientMemoryError as exc:
        raise ValueError(
            "AR-Diffusion available device memory cannot fit one session: "
            f"available={exc.available} bytes, required={exc.required} bytes "
            "(managed self-attention + cross-attention + scratch + model-owned state).") from None
    return geometry, window, plan
