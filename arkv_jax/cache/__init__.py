"""The host-side cache: :class:`PagedKVCache` and its two transactions, :class:`ChunkStep` and :class:`Recache`.

Modules: :mod:`~arkv_jax.cache.facade` (the facade: validation and the public API),
:mod:`~arkv_jax.cache.core` (state, pools, lock, the transaction in flight, the shared K/V write),
:mod:`~arkv_jax.cache.chunk` and :mod:`~arkv_jax.cache.recache` (the transactions; the recache's plan in
:mod:`~arkv_jax.cache.recache_plan`), :mod:`~arkv_jax.cache.layout` (the sizes, :class:`CacheLayout`),
:mod:`~arkv_jax.cache.batch` (batch rows: positions, buckets, padding), :mod:`~arkv_jax.cache.sessions`
(slots, LRU order, row maps), :mod:`~arkv_jax.cache.cross_attention` (the text K/V store),
:mod:`~arkv_jax.cache.callbacks` and :mod:`~arkv_jax.cache.programs` (the jitted per-shard steps). The
names below load on first use, so importing one module (e.g. the store, as :mod:`arkv_jax.compat.vllm_omni`
does) does not load the facade. ``docs/protocol.md``.
"""

from __future__ import annotations

from arkv_jax._lazy import lazy_exports

_EXPORTS = {
    "PagedKVCache": "arkv_jax.cache.facade",
    "ChunkStep": "arkv_jax.cache.chunk",
    "Recache": "arkv_jax.cache.recache",
    "CacheLayout": "arkv_jax.cache.layout",
    "BatchRows": "arkv_jax.cache.batch",
    "CallbackError": "arkv_jax.cache.callbacks",
    "cross_attention_rows": "arkv_jax.cache.batch",
    "SessionTable": "arkv_jax.cache.sessions",
    "CrossAttentionStore": "arkv_jax.cache.cross_attention",
    "collect_cross_attention_layers": "arkv_jax.cache.cross_attention",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
