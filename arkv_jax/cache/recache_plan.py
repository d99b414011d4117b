"""The plan of a recache: which frames a prompt switch recomputes, in which forwards, into which pages.

When a session's conditioning changes (a new prompt), the K/V its next chunks will attend to were
computed under the old one. :func:`plan_recache` names the frames the session's next chunk sees
(:meth:`arkv_jax.config.WindowPolicy.max_history`: the sink, unless it is kept, and the recent
window) and splits them into *units* (runs of consecutive frames of one original chunk). Each unit
attends bidirectionally to itself and to the earlier history frames its original chunk saw
(:meth:`~arkv_jax.config.WindowPolicy.frame_visible`) that are still held; every frame goes into
fresh pages (:func:`arkv_jax.state.fresh_pages`), free until the recache's commit swaps them in.
Host-side planning on one shard's state; the transaction is :mod:`arkv_jax.cache.recache`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from arkv_jax import state as core
from arkv_jax.config import WindowPolicy
from arkv_jax.step import ChunkInputs

Array = jax.Array


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
