"""The session table: which session holds which slot, in which order, and every map from slots to rows.

Plain Python and NumPy (no JAX): the facade asks it where a session's rows are and hands the
answers to the jitted steps. With ``n`` KV branches, ``D`` data shards and ``S`` slots per shard,
slot ``s`` lives on data shard ``s // S``; its branch ``b`` is global row ``s * n + b`` (the row
axis of the cross-attention tables and of :meth:`SessionTable.rows`), which is shard-local row
``global % (S * n)`` of shard ``global // (S * n)``, what ``ChunkInputs.rows`` and the state steps
take (-1: padding). A full batch gives data shard ``d`` batch rows ``[d * B / D, (d + 1) * B / D)``,
exactly the slots it holds, so no row crosses a device. Every index space (slots, rows, batch rows,
pages) in one table: ``docs/protocol.md``, "Index spaces".
"""

from __future__ import annotations

import collections
from typing import Iterable, Sequence

import numpy as np

from arkv_jax.config import lookup


class SessionTable:
    """Slots of ``num_shards * slots_per_shard`` resident sessions, their LRU order and row maps.

    Args:
      num_shards: data shards (1 without a mesh).
      slots_per_shard: sessions one data shard holds.
      branches: names of the KV branches, in row order; every session has one row per branch.
    """

    def __init__(self, num_shards: int, slots_per_shard: int, branches: Sequence[str]) -> None:
        self.num_shards, self.slots_per_shard = int(num_shards), int(slots_per_shard)
        self.branches = tuple(branches)
        self._branch_index = {name: i for i, name in enumerate(self.branches)}
        self._slots: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._free = list(range(self.capacity))

    # -- sizes ---------------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Session slots of all shards."""
        return self.num_shards * self.slots_per_shard

    @property
    def rows_per_shard(self) -> int:
        """Block-table rows of one data shard: its slots x branches."""
        return self.slots_per_shard * len(self.branches)

    @property
    def num_rows(self) -> int:
        """Global rows: every slot x branch."""
        return self.rows_per_shard * self.num_shards

    # -- sessions ------------------------------------------------------------------------------------
    @property
    def sessions(self) -> tuple[str, ...]:
        """Resident sessions, least recently used first."""
        return tuple(self._slots)

    def placement(self) -> tuple[tuple[str, int], ...]:
        """``(session, slot)`` of every resident session, least recently used first."""
        return tuple(self._slots.items())

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._slots

    @property
    def is_full(self) -> bool:
        """Whether every slot holds a session."""
        return not self._free

    @property
    def least_recent(self) -> str:
        """The least recently used session.

        Raises:
          KeyError: no session is resident.
        """
        try:
            return next(iter(self._slots))
        except StopIteration:
            raise KeyError("no session is resident") from None

    def slot(self, session_id: str) -> int:
        """The slot of a resident session.

        Raises:
          KeyError: unknown session.
        """
        try:
            return self._slots[session_id]
        except KeyError:
            raise KeyError(f"Unknown session {session_id!r}; open it first") from None

    def touch(self, session_ids: Iterable[str]) -> None:
        """Marks resident sessions most recently used, in the order given."""
        for session_id in session_ids:
            self._slots.move_to_end(session_id)

    def admit(self, session_id: str) -> int:
        """Gives a new session the first free slot of the data shard holding the fewest sessions;
        returns the slot.

        Raises:
          ValueError: the session is already resident. RuntimeError: no slot is free.
        """
        if session_id in self._slots:
            raise ValueError(f"session {session_id!r} is already resident")
        if not self._free:
            raise RuntimeError("every session slot is taken; remove a session first")
        load = collections.Counter(self.shard(slot) for slot in self._slots.values())
        slot = min(self._free, key=lambda s: load[self.shard(s)])
        self._free.remove(slot)
        self._slots[session_id] = slot
        return slot

    def remove(self, session_id: str) -> int:
        """Frees a session's slot (it goes to the end of the free list); returns the slot.

        Raises:
          KeyError: unknown session.
        """
        slot = self.slot(session_id)
        del self._slots[session_id]
        self._free.append(slot)
        return slot

    # -- maps ----------------------------------------------------------------------------------------
    def branch(self, name: str) -> int:
        """The branch index of ``name``.

        Raises:
          KeyError: unknown branch.
        """
        return lookup(self._branch_index, name, "KV branch")

    def shard(self, slot: int) -> int:
        """The data shard holding ``slot``."""
        return slot // self.slots_per_shard

    def rows(self, session_ids: Sequence[str], branches: Sequence[str] | None = None) -> np.ndarray:
        """Global rows ``[len(session_ids) * len(branches)]`` (int32) of ``session_ids`` x
        ``branches`` (all branches by default), session-major.

        Raises:
          KeyError: an unknown session or branch.
        """
        names = self.branches if branches is None else tuple(branches)
        n = len(self.branches)
        return np.asarray([self.slot(sid) * n + self.branch(name) for sid in session_ids for name in names],
                          np.int32)

    def slot_rows(self, slot: int) -> list[int]:
        """Global rows of ``slot``'s branches, in branch order."""
        n = len(self.branches)
        return list(range(slot * n, (slot + 1) * n))

    def slot_local_rows(self, slot: int) -> np.ndarray:
        """``[num_shards, n]`` int32: shard-local rows of ``slot``'s branches in its shard, -1 in
        every other shard (the per-shard row batch of a lifecycle step)."""
        n = len(self.branches)
        local = np.full((self.num_shards, n), -1, np.int32)
        shard, index = divmod(slot, self.slots_per_shard)
        local[shard] = np.arange(index * n, (index + 1) * n)
        return local

    def every_local_row(self) -> np.ndarray:
        """``[num_shards, rows_per_shard]`` int32: every shard-local row of every shard."""
        return np.tile(np.arange(self.rows_per_shard, dtype=np.int32), (self.num_shards, 1))

    def split_rows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(shard, shard-local row)`` of global rows."""
        return np.divmod(np.asarray(rows), self.rows_per_shard)

    def batch(self, session_ids: Sequence[str], branches: Sequence[str], *, full_batch: bool
              ) -> tuple[np.ndarray, tuple[str | None, ...]]:
        """The rows of one chunk for ``session_ids`` x ``branches``.

        Returns:
          ``(local_rows, owners)``: ``[num_shards, B / num_shards]`` int32 shard-local rows (-1:
          padding) and the session of each of the ``B`` batch rows (``None`` for padding). A
          compact batch (``full_batch=False``) holds just the sessions' rows, session-major; a full
          batch holds every slot (see the module docstring): :class:`arkv_jax.cache.batch.BatchRows`.

        Raises:
          ValueError: a compact batch over several shards. KeyError: an unknown session or branch.
        """
        from arkv_jax.cache.batch import BatchRows  # the one row placement (it needs JAX; this module does not)

        batch = BatchRows.of(self, session_ids, branches, full_batch=full_batch)
        return batch.local_rows(self), batch.owners

    @staticmethod
    def pool_pages(shard: int, local_pages: np.ndarray, pages_per_shard: int) -> np.ndarray:
        """Pool pages of shard ``shard``'s shard-local pages."""
        return np.asarray(local_pages) + shard * pages_per_shard
