"""arkv-jax: a paged KV cache for autoregressive video diffusion models in JAX.

Layers (top to bottom once per chunk): ``config`` (validated shapes and the small shared rules),
``planner`` (host-side memory arithmetic), ``state`` (the immutable block-table state and its
jitted steps), ``step`` (the chunk step of one shard), ``pallas_kernels`` (paged chunk write and
window attention), ``sharding`` and ``sharded_kernels`` (the same over a ``("data", "model")``
device mesh), ``cache`` (the host facade and its transactions), ``nnx``, ``samplers``,
``conditioning`` and ``rollout``; ``models`` (the Wan 2.1 family) and ``apps`` (the commands) use
them, and ``compat`` has vLLM-Omni's API on the same core.

:class:`PagedKVCache`, :class:`Rollout` and :class:`Sampler` are exported here and load on first
use, so ``import arkv_jax.state`` loads neither Flax nor the cache.

The words of the code and the docs, each for one thing (frame, chunk, page, row, ...): ``docs/glossary.md``.
"""

import logging

from arkv_jax._lazy import lazy_exports
from arkv_jax.config import CacheGeometry, CrossAttentionSpec, KVBranch, WindowPolicy
from arkv_jax.planner import MemoryPlan, compute_num_blocks, device_free_bytes, plan_memory
from arkv_jax.presets import PRESETS, ModelPreset, get_preset

logging.getLogger(__name__).addHandler(logging.NullHandler())

__version__ = "0.1.0"

#: Exports loaded on first use: they pull in JAX, Flax and the cache stack.
_LAZY = {
    "PagedKVCache": "arkv_jax.cache",
    "Rollout": "arkv_jax.rollout",
    "Sampler": "arkv_jax.samplers",
}

__all__ = [
    "CacheGeometry", "CrossAttentionSpec", "KVBranch", "WindowPolicy",
    "MemoryPlan", "compute_num_blocks", "device_free_bytes", "plan_memory",
    "PRESETS", "ModelPreset", "get_preset",
    *_LAZY,
]

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, __all__)
