"""The cache's sizes as one frozen value: shards, slots, rows, pages and bytes (``cache.layout``).

:class:`CacheLayout` is fixed when a :class:`~arkv_jax.cache.PagedKVCache` is built (from its
memory plan, geometry, window and mesh) and never changes; the facade's size views
(``num_shards``, ``rows_per_shard``, ``pages_per_shard``, ``total_pages``, ``max_chunk_frames``, ...)
read it. The index spaces it counts: ``docs/protocol.md``, "Index spaces".
"""

from __future__ import annotations

import dataclasses

from arkv_jax.config import WindowPolicy


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Sizes of one cache.

    Attributes:
      num_shards: data shards (1 without a mesh).
      slots_per_shard: resident sessions one data shard holds.
      num_branches: KV branches: state rows per session.
      pages_per_shard: pool pages of one data shard, its null page included; pool page ``p`` is page
        ``p % pages_per_shard`` of shard ``p // pages_per_shard``.
      table_width: pages one state row's table holds.
      pages_per_frame: pages one frame takes.
      page_bytes: bytes of one page, all layers, K and V, all K/V heads.
      window: the window policy (its rule bounds a chunk: :meth:`max_chunk_frames`).
    """

    num_shards: int
    slots_per_shard: int
    num_branches: int
    pages_per_shard: int
    table_width: int
    pages_per_frame: int
    page_bytes: int
    window: WindowPolicy

    @property
    def session_capacity(self) -> int:
        """Resident sessions, all shards."""
        return self.num_shards * self.slots_per_shard

    @property
    def rows_per_shard(self) -> int:
        """State rows of one data shard: its slots x branches."""
        return self.slots_per_shard * self.num_branches

    @property
    def num_rows(self) -> int:
        """State rows of all shards; global row ``r`` is row ``r % rows_per_shard`` of shard
        ``r // rows_per_shard``."""
        return self.num_shards * self.rows_per_shard

    @property
    def total_pages(self) -> int:
        """Pages that can be allocated, all shards (the null pages excluded)."""
        return self.num_shards * (self.pages_per_shard - 1)

    @property
    def pool_bytes(self) -> int:
        """Bytes of the K and V pools, all shards (every page, null pages included)."""
        return self.num_shards * self.pages_per_shard * self.page_bytes

    def max_chunk_frames(self, rows_per_shard: int | None = None) -> int:
        """The largest ``num_frames`` a chunk of ``rows_per_shard`` rows on one data shard (default:
        every row of the shard) can always take: :meth:`arkv_jax.config.WindowPolicy.max_chunk_frames`
        of a row's table and a shard's pages."""
        rows = self.rows_per_shard if rows_per_shard is None else rows_per_shard
        return int(self.window.max_chunk_frames(
            table_width=self.table_width, pool_pages=self.pages_per_shard - 1, pages_per_frame=self.pages_per_frame,
            rows_per_shard=self.rows_per_shard, chunk_rows=rows))
