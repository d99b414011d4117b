"""Batch rows: where a transaction's sessions sit in the batch its forward runs, and the rules that decide it.

A batch is ``num_positions`` session positions x the transaction's branches: batch row ``position *
len(branches) + i`` is branch ``branches[i]`` of the session at ``position``, other rows are padding
(:data:`arkv_jax.step.PADDING`). A compact batch holds the sessions asked for at positions ``0 ..``,
padded up to a bucket (:func:`bucket_size`); a full batch (:func:`resolve_full_batch`: always on a
mesh) holds every slot at position ``slot``, so its shapes never change. :class:`BatchRows` places
per-session values at their positions and takes them back, so nothing above the cache does row
arithmetic. Index spaces: ``docs/protocol.md``, "Index spaces".
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from arkv_jax import sharding
from arkv_jax.config import is_int, require_bool
from arkv_jax.sharded_kernels import gather_rows, take_rows
from arkv_jax.step import PADDING, ChunkInputs

if TYPE_CHECKING:
    from arkv_jax.cache.sessions import SessionTable

Array = jax.Array


def resolve_full_batch(full_batch: bool | None, sharded: bool) -> bool:
    """A ``full_batch`` argument resolved: ``None`` means full batches on a mesh only.

    Raises:
      TypeError: not a bool or None. ValueError: ``False`` on a mesh (each data shard must see the
        same rows every chunk).
    """
    if full_batch is None:
        return sharded
    require_bool("full_batch", full_batch)
    if not full_batch and sharded:
        raise ValueError("a sharded cache hands out full batches only (full_batch=True): each data "
                         "shard must see the same rows every chunk")
    return bool(full_batch)


def default_buckets(max_sessions: int) -> tuple[int, ...]:
    """Batch buckets (sessions per chunk): the powers of two below ``max_sessions``, then
    ``max_sessions`` (16: 1, 2, 4, 8, 16; 6: 1, 2, 4, 6)."""
    sizes = [1 << i for i in range(max_sessions.bit_length()) if (1 << i) < max_sessions]
    return (*sizes, max_sessions)


def resolve_buckets(buckets: Sequence[int] | None, max_sessions: int, *, what: str = "max_sessions"
                    ) -> tuple[int, ...]:
    """``buckets`` checked (increasing positive ints, the largest at least ``max_sessions``), or
    :func:`default_buckets` of ``max_sessions`` for ``None``.

    Raises:
      ValueError: anything else (the message names ``what``).
    """
    if buckets is None:
        return default_buckets(max_sessions)
    sizes = tuple(buckets) if isinstance(buckets, (tuple, list)) else ()
    if (not sizes or any(not is_int(b) or b < 1 for b in sizes)
            or list(sizes) != sorted(set(sizes)) or sizes[-1] < max_sessions):
        raise ValueError(f"buckets must be increasing positive ints, the largest >= {what}={max_sessions}; "
                         f"got {buckets!r}")
    return tuple(int(b) for b in sizes)


def bucket_size(num_sessions: int, buckets: Sequence[int]) -> int:
    """The smallest bucket holding ``num_sessions`` sessions (``ValueError`` if none does)."""
    try:
        return next(b for b in buckets if b >= num_sessions)
    except StopIteration:
        raise ValueError(f"no bucket of {tuple(buckets)} holds {num_sessions} sessions") from None


def cross_attention_rows(cross_kv: tuple[Array, Array], rows: Array, mesh: Mesh | None) -> tuple[Array, Array]:
    """A batch's rows of a cross-attention cache (traceable): ``cross_kv`` ``(k, v)`` tables
    ``[rows, layers, tokens, heads, head_dim]``, ``rows`` the batch's ``ChunkInputs.rows``. Returns
    ``(k, v)``, each ``[layers, B, tokens, heads, head_dim]``, zero at padding rows; with a mesh each
    data shard reads its own rows (:func:`arkv_jax.sharded_kernels.gather_rows`)."""
    def read(table):
        return take_rows(table, rows) if mesh is None else gather_rows(mesh, table, rows)

    return tuple(read(table).swapaxes(0, 1) for table in cross_kv)


@functools.partial(jax.jit, static_argnums=2)
def _place_inputs(inputs: ChunkInputs, positions: Array, num_rows: int) -> ChunkInputs:
    """``inputs``' rows at batch rows ``positions`` of ``num_rows`` rows, padding rows elsewhere."""
    def place(values, fill):
        return jnp.full((num_rows, *values.shape[1:]), fill, values.dtype).at[positions].set(values)

    return ChunkInputs(*(place(values, fill) for values, fill in zip(inputs, PADDING)))


def _index(axis: int, positions) -> tuple:
    return (slice(None),) * axis + (positions,)


def _moves_nothing(positions, total: int) -> bool:
    """Whether placing at ``positions`` in an axis of ``total`` is the identity."""
    return len(positions) == total and list(positions) == list(range(total))


@dataclasses.dataclass(frozen=True)
class BatchRows:
    """Where the sessions of one transaction sit in its batch (see the module docstring).

    Attributes:
      session_ids: the sessions asked for, in the order asked.
      branches: the KV branches of every session, in batch-row order.
      positions: each session's position (in ``session_ids`` order).
      num_positions: the batch's session positions (its bucket, or every slot).
      full: whether this is the full batch (every slot; the cache's programs run on every row) or a
        compact one (the programs run on the sessions' rows only, padding added after).
    """

    session_ids: tuple[str, ...]
    branches: tuple[str, ...]
    positions: tuple[int, ...]
    num_positions: int
    full: bool

    @classmethod
    def of(cls, table: "SessionTable", session_ids: Sequence[str], branches: Sequence[str], *, full_batch: bool,
           buckets: Sequence[int] | None = None) -> "BatchRows":
        """The batch of ``session_ids`` x ``branches`` in ``table``: the full batch, or a compact one
        padded to the smallest of ``buckets`` (none: not padded).

        Raises:
          KeyError: an unknown session. ValueError: a compact batch over several shards, or more
            sessions than the largest bucket.
        """
        ids, names = tuple(session_ids), tuple(branches)
        if full_batch:
            return cls(ids, names, tuple(table.slot(s) for s in ids), table.capacity, True)
        if table.num_shards > 1:
            raise ValueError(f"a compact batch needs one shard, this table has {table.num_shards}: use "
                             "full_batch=True")
        size = len(ids) if buckets is None else bucket_size(len(ids), buckets)
        return cls(ids, names, tuple(range(len(ids))), size, False)

    # -- sizes ---------------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        """Batch rows: positions x branches."""
        return self.num_positions * len(self.branches)

    @property
    def row_positions(self) -> np.ndarray:
        """int32 ``[len(session_ids) * len(branches)]``: the batch row of each session's branch,
        session-major (the order of :meth:`arkv_jax.cache.PagedKVCache.rows`)."""
        n = len(self.branches)
        return (np.asarray(self.positions, np.int32)[:, None] * n + np.arange(n, dtype=np.int32)).reshape(-1)

    @property
    def owners(self) -> tuple[str | None, ...]:
        """The session of each batch row (``None`` for padding rows)."""
        at: list[str | None] = [None] * self.num_positions
        for sid, position in zip(self.session_ids, self.positions):
            at[position] = sid
        return tuple(sid for sid in at for _ in self.branches)

    def local_rows(self, table: "SessionTable") -> np.ndarray:
        """int32 ``[num_shards, R]``: the shard-local rows the cache's programs run on: every batch
        row of a full batch (-1: padding), the sessions' rows only of a compact one."""
        rows = table.rows(self.session_ids, self.branches)
        if not self.full:
            return rows[None]
        placed = self.place_rows(rows, fill=-1)
        return np.where(placed >= 0, placed % table.rows_per_shard, -1).reshape(table.num_shards, -1)

    # -- placement -------------------------------------------------------------------------------------
    def place(self, values, *, fill=0, axis: int = 0):
        """Per-session ``values`` (axis ``axis`` of length ``len(session_ids)``) at their positions of
        an axis of ``num_positions``, ``fill`` elsewhere; NumPy in, NumPy out (else JAX)."""
        return self._scatter(values, self.positions, self.num_positions, fill, axis)

    def place_rows(self, values, *, fill=0, axis: int = 0):
        """Per-row ``values`` (axis ``axis``: the sessions' rows, session-major) at their batch rows of
        an axis of ``batch_size``, ``fill`` elsewhere."""
        return self._scatter(values, self.row_positions, self.batch_size, fill, axis)

    def take(self, values, *, axis: int = 0):
        """The sessions' entries ``[len(session_ids), ...]`` of per-position ``values`` (axis ``axis``
        of length ``num_positions``, e.g. a chunk's latents), in ``session_ids`` order."""
        if _moves_nothing(self.positions, values.shape[axis]):
            return values
        xp = np if isinstance(values, np.ndarray) else jnp
        return xp.take(values, np.asarray(self.positions, np.int32), axis=axis)

    def take_local(self, values: Array) -> tuple[tuple[str, ...], np.ndarray]:
        """The sessions whose entries of per-position ``values`` (axis 0 of length
        ``num_positions``, e.g. a chunk's latents) this process's devices hold, in ``session_ids``
        order, and those entries on the host ``[n, ...]``. Nothing moves between processes; on one
        process every session's, as :meth:`take` gives them."""
        rows, host = sharding.local_rows(values)
        at = {int(row): i for i, row in enumerate(rows)}
        held = [(sid, at[p]) for sid, p in zip(self.session_ids, self.positions) if p in at]
        return tuple(sid for sid, _ in held), host[[i for _, i in held]]

    def place_inputs(self, inputs: ChunkInputs) -> ChunkInputs:
        """The sessions' :class:`~arkv_jax.step.ChunkInputs` rows at their batch rows, padding rows
        elsewhere (jitted; unchanged when nothing moves)."""
        if _moves_nothing(self.row_positions, self.batch_size):
            return inputs
        return _place_inputs(inputs, jnp.asarray(self.row_positions), self.batch_size)

    def _scatter(self, values, positions, total: int, fill, axis: int):
        count = np.shape(values)[axis]
        if count != len(positions):
            raise ValueError(f"expected {len(positions)} entries on axis {axis}, got shape {np.shape(values)}")
        if _moves_nothing(positions, total):
            return values
        shape = (*np.shape(values)[:axis], total, *np.shape(values)[axis + 1:])
        if isinstance(values, np.ndarray):
            out = np.full(shape, fill, values.dtype)
            out[_index(axis, np.asarray(positions, np.int32))] = values
            return out
        values = jnp.asarray(values)
        return jnp.full(shape, fill, values.dtype).at[_index(axis, jnp.asarray(positions, jnp.int32))].set(values)
