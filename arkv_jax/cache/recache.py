"""A session's history K/V recomputed into fresh pages (a prompt switch's KV recache, as LongLive does).

When a session's conditioning changes (a new prompt), the K/V its next chunks will attend to were
computed under the old one. A *recache* recomputes them: the frames the session's next chunk sees
(:meth:`arkv_jax.config.WindowPolicy.max_history`: the sink, unless it is kept, and the recent
window), from latents the caller kept, at the frames' absolute positions. :func:`plan_recache`
splits those frames into *units* (runs of consecutive frames of one original chunk, chunks starting
at multiples of ``chunk_frames``); the caller runs one forward per unit, in order, on
``unit.inputs``, and writes its K/V. Each unit attends bidirectionally to itself and to the earlier
history frames its original chunk saw (the window rule of
:meth:`~arkv_jax.config.WindowPolicy.frame_visible`) that are still held: the already recomputed
frames' fresh pages, and, with ``sink="keep"``, the sink's own pages. Frames that left the window
are forgotten, as if never generated.

Everything is written into fresh pages (free now, untouched by anyone else while the recache is in
flight) and swapped in at the end (:func:`arkv_jax.state.swap_pages`): until then the session's
pages are as they were, so a failure at any point leaves the old history.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from arkv_jax import state as core
from arkv_jax.config import WindowPolicy
from arkv_jax.step import ChunkInputs

Array = jax.Array

SINK_MODES = ("keep", "recompute")


class RecacheUnit(NamedTuple):
    """One forward of a recache: frames ``first_frame .. first_frame + num_frames - 1``.

    Attributes:
      first_frame: absolute index of the unit's first frame.
      num_frames: frames of the unit (at most ``chunk_frames``).
      inputs: the forward's :class:`~arkv_jax.step.ChunkInputs` for the session's rows (one per
        branch; shard-local rows): the unit's history and the fresh pages it is written into.
    """

    first_frame: int
    num_frames: int
    inputs: ChunkInputs


@dataclasses.dataclass(frozen=True)
class RecachePlan:
    """What :func:`plan_recache` decided (host arrays).

    Attributes:
      frames: absolute frames recomputed, in time order.
      units: the forwards, in the order they must run.
      replace: bool ``[branches, table_width]``: table positions given fresh pages.
      fresh: int32 ``[branches, table_width]``: those fresh pages (0 elsewhere).
    """

    frames: tuple[int, ...]
    units: tuple[RecacheUnit, ...]
    replace: np.ndarray
    fresh: np.ndarray


@functools.partial(jax.jit, static_argnums=2)
def _row_views(state: core.BlockTableState, rows: Array, chunk_frames: int):
    """Everything :func:`plan_recache` reads of ``rows``, in one program."""
    return (core.computed_frames(state, rows), state.prefill_tokens[rows],
            core.visible_window(state, rows, chunk_frames), core.resident_pages(state, rows),
            core.num_free_pages(state))


_fresh_pages = jax.jit(core.fresh_pages)


def _frame_runs(frames: list[int], chunk_frames: int) -> list[tuple[int, int]]:
    """``(first, count)`` of the maximal runs of consecutive frames within one chunk."""
    runs: list[list[int]] = []
    for f in frames:
        if runs and f == runs[-1][0] + runs[-1][1] and f // chunk_frames == runs[-1][0] // chunk_frames:
            runs[-1][1] += 1
        else:
            runs.append([f, 1])
    return [(a, n) for a, n in runs]


def plan_recache(state: core.BlockTableState, rows: np.ndarray, window: WindowPolicy, chunk_frames: int,
                 sink: str) -> RecachePlan:
    """Plans the recache of one session's ``rows`` (its branches) in one shard's ``state``.

    Args:
      state: the shard's committed state (host or device leaves).
      rows: int ``[branches]`` the session's shard-local rows.
      window: the cache's window policy.
      chunk_frames: frames per chunk of the session's stream (its chunks start at multiples of it).
      sink: ``"keep"`` (the sink's K/V stay as they are) or ``"recompute"`` (recomputed too).

    Raises:
      ValueError: the session's rows are not at one frame, or it is not at a chunk boundary (a
        prefill, or chunks of another size).
      RuntimeError: the pool has fewer free pages than the fresh pages the recache needs.
    """
    layout = state.layout
    ppf, tpf = layout.pages_per_frame, layout.tokens_per_frame
    rows = jnp.asarray(rows, jnp.int32)
    computed, prefill, view, (tables, counts), free = jax.device_get(_row_views(state, rows, chunk_frames))
    lengths, ids, pages = view.lengths, view.frame_ids, view.pages
    if len(set(computed.tolist())) != 1 or len(set(lengths.tolist())) != 1:
        raise ValueError(f"the session's branches stand at different frames {computed.tolist()}; a recache "
                         "needs them in lockstep")
    if int(computed[0]) % chunk_frames or int(prefill.max()):
        raise ValueError(f"the session stands at frame {int(computed[0])}, not at a boundary of "
                         f"chunk_frames={chunk_frames}-frame chunks from frame 0 (no prefill)")
    visible = ids[0, :int(lengths[0]) // tpf].tolist()
    redo = [f for f in visible if sink == "recompute" or f >= window.sink_frames]
    position = [{int(p): i for i, p in enumerate(t[:c])} for t, c in zip(tables, counts)]
    frame_slot = {f: i for i, f in enumerate(visible)}
    replace = np.zeros(tables.shape, bool)
    for b in range(len(rows)):
        for f in redo:
            for p in pages[b, frame_slot[f] * ppf:(frame_slot[f] + 1) * ppf]:
                replace[b, position[b][int(p)]] = True
    need, free = int(replace.sum()), int(free)
    if need > free:
        raise RuntimeError(f"a recache of frames {redo} needs {need} free pages, the pool has {free} (plan the "
                           "pool for prompt switches: arkv_jax.planner.rollout_plan(..., latent_frame_bytes=))")
    fresh = np.asarray(_fresh_pages(state, rows, replace))

    def frame_pages(f: int) -> np.ndarray:  # [branches, ppf]: the pages frame f is read from
        old = pages[:, frame_slot[f] * ppf:(frame_slot[f] + 1) * ppf]
        if f not in redo:
            return old
        return np.stack([fresh[b, [position[b][int(p)] for p in old[b]]] for b in range(len(rows))])

    width = layout.visible_frames
    units = []
    for first, n in _frame_runs(redo, chunk_frames):
        chunk_first = first // chunk_frames * chunk_frames
        seen = [f for f in visible if f < first and window.frame_visible(f, chunk_first, chunk_frames)]
        history = np.zeros((len(rows), width * ppf), np.int32)
        frame_ids = np.full((len(rows), width), -1, np.int32)
        if seen:
            history[:, :len(seen) * ppf] = np.concatenate([frame_pages(f) for f in seen], axis=1)
            frame_ids[:, :len(seen)] = seen
        write = np.concatenate([frame_pages(f) for f in range(first, first + n)], axis=1)
        inputs = ChunkInputs(rows, jnp.asarray(history), jnp.full(len(rows), len(seen) * tpf, jnp.int32),
                             jnp.asarray(frame_ids), jnp.full(len(rows), first, jnp.int32),
                             jnp.asarray(write, jnp.int32))
        units.append(RecacheUnit(first, n, inputs))
    return RecachePlan(tuple(redo), tuple(units), replace, fresh)


@dataclasses.dataclass(eq=False)
class Recache:
    """One session's recache in flight; see :meth:`arkv_jax.cache.PagedKVCache.recache`.

    Attributes:
      session_id: the session.
      branches: its KV branches, in the order of the units' rows.
      sink: ``"keep"`` or ``"recompute"``.
      frames: absolute frames recomputed, in time order (empty: nothing to recompute).
      units: the forwards to run, in order (:class:`RecacheUnit`).
      positions: int ``[branches]``: the batch rows of the session's branches (in ``branches``
        order) in every unit's inputs, K/V and text.
      batch_size: batch rows of every unit (the session's rows, or the cache's full batch).
      written: units written so far.
      committed: whether :meth:`commit` ran.
      staged: the staged cross-attention K/V, ``(name, row) -> (k, v)``.
    """

    session_id: str
    branches: tuple[str, ...]
    sink: str
    frames: tuple[int, ...]
    units: tuple[RecacheUnit, ...]
    positions: np.ndarray
    batch_size: int
    on_write: Callable[["Recache", Array, Array], None] = dataclasses.field(repr=False)
    on_stage: Callable[["Recache", str, str, object], None] = dataclasses.field(repr=False)
    on_commit: Callable[["Recache"], None] = dataclasses.field(repr=False)
    written: int = 0
    committed: bool = False
    staged: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def next_unit(self) -> RecacheUnit | None:
        """The unit to compute next (``None`` once all are written)."""
        return self.units[self.written] if self.written < len(self.units) else None

    def write(self, k_new: Array, v_new: Array) -> None:
        """Writes the K/V of :attr:`next_unit` (its forward ran on ``next_unit.inputs``) into its
        fresh pages; later units read them.

        Args:
          k_new, v_new: ``[layers, batch_size, num_frames * tokens_per_frame, kv_heads, head_dim]``
            (the session's rows at :attr:`positions`).

        Raises:
          RuntimeError: not in flight, or every unit is written. ValueError: wrong shapes.
        """
        self.on_write(self, k_new, v_new)

    def populate_cross_attention(self, name: str, branch: str, layer_kv) -> None:
        """Stages the session's new cross-attention K/V of ``name`` and ``branch`` (as
        :meth:`arkv_jax.cache.PagedKVCache.populate_cross_attention` takes them, validated now),
        published by :meth:`commit` together with the pages."""
        self.on_stage(self, name, branch, layer_kv)

    def commit(self) -> None:
        """Swaps the fresh pages in (the replaced pages are freed) and publishes the staged
        cross-attention K/V, in one step.

        Raises:
          RuntimeError: not in flight, or a unit is not written yet.
        """
        self.on_commit(self)
