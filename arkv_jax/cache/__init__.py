"""The host-side cache: :class:`PagedKVCache` and the per-chunk :class:`ChunkStep`.

Modules: :mod:`~arkv_jax.cache.facade` (the facade and the chunk transaction),
:mod:`~arkv_jax.cache.sessions` (the session table: slots, LRU order, shard balance, row maps),
:mod:`~arkv_jax.cache.cross_attention` (the cross-attention store and its validator),
:mod:`~arkv_jax.cache.recache` (a session's history recomputed into fresh pages: prompt switches) and
:mod:`~arkv_jax.cache.programs` (the facade's jitted per-shard steps). The names below load on first
use, so importing one module of the package (e.g. the store, as :mod:`arkv_jax.compat.vllm_omni`
does) does not load the facade.
"""

from __future__ import annotations

from arkv_jax._lazy import lazy_exports

_EXPORTS = {
    "PagedKVCache": "arkv_jax.cache.facade",
    "ChunkStep": "arkv_jax.cache.facade",
    "Recache": "arkv_jax.cache.recache",
    "SessionTable": "arkv_jax.cache.sessions",
    "CrossAttentionStore": "arkv_jax.cache.cross_attention",
    "collect_cross_attention_layers": "arkv_jax.cache.cross_attention",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
