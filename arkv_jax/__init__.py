"""arkv-jax: a paged KV cache for autoregressive video diffusion models in JAX.

Layers (top to bottom once per chunk): ``config`` (validated shapes), ``planner`` (host-side memory
arithmetic), ``state`` (the immutable block-table state and its jitted steps), ``pallas_kernels``
(paged chunk write and window attention), ``cache`` (the host facade), ``nnx`` and ``rollout``;
``sharding`` lays all of them out over a ``("data", "model")`` device mesh.
"""

import logging

from arkv_jax.config import CacheGeometry, CrossAttentionSpec, KVBranch, WindowPolicy
from arkv_jax.planner import MemoryPlan, compute_num_blocks, device_free_bytes, plan_memory
from arkv_jax.presets import PRESETS, ModelPreset, get_preset

logging.getLogger(__name__).addHandler(logging.NullHandler())

__version__ = "0.1.0"

__all__ = [
    "CacheGeometry", "CrossAttentionSpec", "KVBranch", "WindowPolicy",
    "MemoryPlan", "compute_num_blocks", "device_free_bytes", "plan_memory",
    "PRESETS", "ModelPreset", "get_preset",
]
