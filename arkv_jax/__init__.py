"""arkv-jax: a paged KV cache for autoregressive video diffusion models in JAX.

Layers (top to bottom once per chunk): ``config`` (validated shapes and the small shared rules),
``planner`` (host-side memory arithmetic), ``state`` (the immutable block-table state and its
jitted steps), ``step`` (the chunk step of one shard), ``pallas_kernels`` (paged chunk write and
window attention), ``sharding`` and ``sharded_kernels`` (the same over a ``("data", "model")``
device mesh), ``cache`` (the host facade and its transactions), ``nnx``, ``samplers``,
``conditioning`` and ``rollout``; ``compat`` has vLLM-Omni's API on the same core.

:class:`PagedKVCache`, :class:`Rollout` and :class:`Sampler` are exported here and load on first
use, so ``import arkv_jax.state`` loads neither Flax nor the cache.

Glossary (also ``docs/glossary.md``):

frame
  One latent frame of a video: ``tokens_per_frame`` K/V tokens per layer. The unit of commits,
  eviction, windows and positions; frame indices are absolute (0 is a session's first frame,
  prefill frames included). vLLM-Omni calls it a *chunk* (``chunk_size`` = tokens per frame).
chunk
  The frames one forward generates together (``num_frames``; ``frames_per_forward`` in a
  geometry): denoised over a few steps that all read the same history, then committed once.
  vLLM-Omni calls it a *block* (``frames_per_block``).
page
  ``block_size`` token slots of the pool, in every layer, for K and V: the unit of allocation.
  Pages are frame-aligned: a frame takes ``ceil(tokens_per_frame / block_size)`` pages, its last
  page padded. Page 0 (of each shard) is the null page: never allocated, where unused table
  entries point. vLLM-Omni calls it a *block*; arkv-jax says "block" only where
  ``arkv_jax.compat`` mirrors vLLM-Omni's names and in names kept from it: the *block table*
  (``BlockTableState``: each state row's page ids), ``block_size``, ``StateLayout.num_blocks``
  and the planner's ``*_blocks`` attributes.
pool
  The K and V arrays ``[layers, kv_heads, pages, block_size, head_dim]`` (head-major,
  ``pallas_kernels.layout.pool_shape``) holding every page; on a mesh each data shard owns a
  slice of ``pages_per_shard`` pages (*pool page* =
  ``shard * pages_per_shard + shard-local page``).
row
  Always qualified. A *state row* (a row of the block table) is one (session, KV branch) of a
  ``BlockTableState``: its page table and counters; a *global row* numbers them across shards, a
  *shard-local row* within one shard's state. A *batch row* is one row of a chunk's inputs
  (``ChunkInputs``, ``q``, ``k_new``): a state row, or padding (row -1). A *patch-grid row* is a
  row of a frame's latent patch grid (a spatial axis of the rotary positions).
session
  One video stream (a user, a prompt): a slot of the cache, one state row per KV branch, its
  cross-attention caches.
branch
  A logical KV branch (``KVBranch``), e.g. CFG ``positive``/``negative`` or ``main``: its own
  history and cross-attention caches. ``local_index`` is the worker-local slot that sizes scratch
  and in-flight pages.
shard
  A data shard: one index of a mesh's ``"data"`` axis, with its own sessions, block-table state,
  free ring and pool slice; nothing is shared between data shards. The ``"model"`` axis splits
  K/V heads: every model shard holds some heads of every page of its data shard.
window
  The ``window_frames`` most recent frames a session keeps after a commit; when attending, the
  current chunk's frames count inside it.
sink
  The first ``sink_frames`` frames of a session: never evicted, always visible.
recache
  Recomputing the history K/V a session's next chunk sees (the recent window, and the sink unless
  it is kept) under new conditioning, from the session's latent ring, into fresh pages swapped in
  at once: LongLive's prompt switch (``Rollout.switch_prompt``, ``PagedKVCache.recache``).
transaction
  Work in flight on the cache that changes it all at once or not at all: a chunk step
  (``cache.chunk``) or a recache (``cache.recache``), each owning its write, commit and abort; one
  is in flight at a time.
seed
  Only ever an RNG seed.
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
