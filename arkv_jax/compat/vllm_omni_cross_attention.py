"""vLLM-Omni's cross-attention caches: K/V per session, cache name and logical KV branch.

:class:`CrossAttentionSessions` publishes a branch of a named cache atomically (every layer
arrives and validates, through :func:`arkv_jax.cache.cross_attention.collect_cross_attention_layers`,
or nothing is published), reads one layer back as vLLM-Omni's ``{"is_init", "k", "v"}`` dict, and
retains or releases a session's caches; at most ``capacity`` sessions hold caches at once. Its
messages are vLLM-Omni's.

Part of :mod:`arkv_jax.compat.vllm_omni` (``ARDiffusionKVCache``'s ``*_cross_attention*``
methods); see ``docs/migrating-from-vllm-omni.md``.
"""

from __future__ import annotations

from typing import Collection, Iterable

import jax

from arkv_jax.cache.cross_attention import collect_cross_attention_layers
from arkv_jax.compat.vllm_omni_pools import check_layer
from arkv_jax.config import lookup

__all__ = ["CrossAttentionSessions"]


class CrossAttentionSessions:
    """Published cross-attention K/V, ``[session][cache name][branch] = (k, v)``, each
    ``(layers, length, heads, head_size)`` on ``device``."""

    def __init__(self, lengths: dict[str, int], branch_index: dict[str, int], *, capacity: int, num_layers: int,
                 num_kv_heads: int, head_size: int, dtype, device: jax.Device | None) -> None:
        self.lengths, self.branch_index, self.capacity = lengths, branch_index, capacity
        self.num_layers, self.num_kv_heads, self.head_size = num_layers, num_kv_heads, head_size
        self.dtype, self.device = dtype, device
        self.sessions: dict[str, dict[str, dict[str, tuple[jax.Array, jax.Array]]]] = {}

    def populate(self, session_id: str, cache_name: str, kv_branch: str,
                 layer_kv: Iterable[tuple[jax.Array, jax.Array]]) -> None:
        """Publishes one branch of a cache, all layers or nothing.

        Raises:
          KeyError: unknown cache or branch. RuntimeError: no device, or the session capacity is
          exhausted. ValueError: wrong layer count, type or shape.
        """
        length = self._length(cache_name, kv_branch)
        if session_id not in self.sessions and len(self.sessions) >= self.capacity:
            raise RuntimeError("AR-Diffusion cross-attention session capacity exhausted; "
                               "the runner must evict a session before allocating another")
        if self.device is None:
            raise RuntimeError("AR-Diffusion cross-attention tensors require a configured pool device")
        k, v = collect_cross_attention_layers(cache_name, layer_kv, self.num_layers,
                                              (length, self.num_kv_heads, self.head_size), allow_unbatched=False,
                                              label="AR-Diffusion cross-attention cache")
        published = tuple(jax.device_put(x.astype(self.dtype), self.device) for x in (k, v))
        self.sessions.setdefault(session_id, {}).setdefault(cache_name, {})[kv_branch] = published

    def is_populated(self, session_id: str, cache_name: str, kv_branch: str) -> bool:
        """Whether the branch of the cache is published (raises KeyError as :meth:`populate`)."""
        self._length(cache_name, kv_branch)
        return kv_branch in self.sessions.get(session_id, {}).get(cache_name, {})

    def read(self, session_id: str, cache_name: str, layer_idx, kv_branch: str) -> dict:
        """``{"is_init": True, "k": (1, L, H, D), "v": (1, L, H, D)}`` for one layer.

        Raises:
          KeyError: unknown cache or branch. RuntimeError: not populated. TypeError, IndexError: as
          :func:`~arkv_jax.compat.vllm_omni_pools.check_layer`.
        """
        self._length(cache_name, kv_branch)
        session = self.sessions.get(session_id)
        if session is None:
            raise RuntimeError(f"AR-Diffusion cross-attention cache {cache_name!r} for session {session_id!r} "
                               "was read before it was populated")
        pool = session.get(cache_name, {}).get(kv_branch)
        if pool is None:
            raise RuntimeError(f"AR-Diffusion cross-attention cache {cache_name!r} for session {session_id!r} "
                               f"and KV branch {kv_branch!r} was read before it was populated")
        layer = check_layer(layer_idx, "layer_idx", self.num_layers)
        return {"is_init": True, "k": pool[0][layer][None], "v": pool[1][layer][None]}

    def retain(self, session_id: str, cache_names: Collection[str]) -> None:
        """Releases the session's caches whose names are not in ``cache_names``."""
        session = self.sessions.get(session_id)
        if session is None:
            return
        for name in [n for n in session if n not in set(cache_names)]:
            del session[name]
        if not session:
            del self.sessions[session_id]

    def release(self, session_id: str) -> None:
        """Releases every cache of the session."""
        self.sessions.pop(session_id, None)

    def _length(self, cache_name: str, kv_branch: str) -> int:
        """The cache's length, after checking the cache name and then the branch (KeyError)."""
        length = lookup(self.lengths, cache_name, "AR-Diffusion cross-attention cache")
        lookup(self.branch_index, kv_branch, "AR-Diffusion KV branch")
        return length
