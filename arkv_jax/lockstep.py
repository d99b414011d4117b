"""One rollout on every process of a multi-controller JAX job, driven in lockstep by process 0's events.

Each step process 0 broadcasts its session events (:class:`Join`, :class:`Leave`, :class:`Switch`) to every process
(:meth:`arkv_jax.processes.ProcessGroup.broadcast`); every process applies them in order to its own
:class:`~arkv_jax.rollout.Rollout` (placement is deterministic, so the session tables stay equal and
a refusal, decided by the table, happens on every process), then runs the chunk, which the
processes agree on before it is committed. On one process nothing is sent. The model and its
limits: ``docs/sharding.md``, "Several processes".
"""

from __future__ import annotations

import dataclasses
import json
from typing import NamedTuple, Sequence, Union

import numpy as np

from arkv_jax.processes import ProcessGroup, StepFailed
from arkv_jax.rollout import ChunkResult, Rollout

__all__ = ["Join", "Leave", "Lockstep", "StepOutcome", "Switch", "decode_events", "encode_events"]


@dataclasses.dataclass(frozen=True)
class Join:
    """A session joins (:meth:`Rollout.join` with a prompt and a noise seed)."""

    session_id: str
    prompt: str
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class Leave:
    """A session leaves (:meth:`Rollout.leave`)."""

    session_id: str


@dataclasses.dataclass(frozen=True)
class Switch:
    """A session switches prompts, with a KV recache (:meth:`Rollout.switch_prompt`; ``sink`` as there)."""

    session_id: str
    prompt: str
    sink: str = "keep"


Event = Union[Join, Leave, Switch]
_KINDS = {"join": Join, "leave": Leave, "switch": Switch}
#: What applying an event may refuse with; the session table decides, so every process refuses alike.
REFUSALS = (KeyError, RuntimeError, TypeError, ValueError)


def encode_events(events: Sequence[Event]) -> bytes:
    """``events`` as bytes (JSON).

    Raises:
      TypeError: an event that is not a :class:`Join`, :class:`Leave` or :class:`Switch`.
    """
    kinds = {cls: kind for kind, cls in _KINDS.items()}
    bad = [e for e in events if type(e) not in kinds]
    if bad:
        raise TypeError(f"events must be Join, Leave or Switch, got {bad[0]!r} ({type(bad[0]).__name__})")
    return json.dumps([[kinds[type(e)], dataclasses.asdict(e)] for e in events]).encode()


def decode_events(payload: bytes) -> tuple[Event, ...]:
    """The events :func:`encode_events` encoded (``b""``: none)."""
    return tuple(_KINDS[kind](**fields) for kind, fields in json.loads(payload or b"[]"))


class StepOutcome(NamedTuple):
    """One lockstep step, on this process.

    Attributes:
      events: process 0's events of the step, in the order applied (the same on every process).
      refused: index into ``events`` -> the exception that refused it (the same on every process).
      left: the latents ``[frames, H, W, C]`` of the sessions that left and that this process read.
      recomputed: the absolute frames each switched session recomputed, in time order.
      chunk: the chunk of the sessions this process reads, ``None`` when no session was active.
    """

    events: tuple[Event, ...]
    refused: dict[int, BaseException]
    left: dict[str, np.ndarray]
    recomputed: dict[str, tuple[int, ...]]
    chunk: ChunkResult | None


class Lockstep:
    """Drives ``rollout`` in lockstep with the same rollout on every other process.

    Every process must build the same rollout (same model weights, cache, sampler and mesh) and
    call :meth:`step` as often; only process 0's ``events`` count.

    Args:
      rollout: this process's rollout over the global mesh (or one device: one process).
    """

    def __init__(self, rollout: Rollout) -> None:
        self.rollout = rollout
        self.group = rollout.group or ProcessGroup()

    def step(self, events: Sequence[Event] = ()) -> StepOutcome:
        """Broadcasts process 0's ``events``, applies them in order, then runs one chunk of every
        active session (none: no chunk).

        Raises:
          TypeError: (process 0) an event of another type; nothing is sent, but the other
            processes then wait for process 0.
          StepFailed: on every process, when applying the events failed on some process in
            another way than a refusal, or the chunk failed or was refused on some process.
        """
        payload = encode_events(events) if self.group.index == 0 else b""
        applied = decode_events(self.group.broadcast(payload))
        refused: dict[int, BaseException] = {}
        left: dict[str, np.ndarray] = {}
        recomputed: dict[str, tuple[int, ...]] = {}
        try:
            for i, event in enumerate(applied):
                try:
                    if isinstance(event, Join):
                        self.rollout.join(event.session_id, event.prompt, seed=event.seed)
                    elif isinstance(event, Switch):
                        recomputed[event.session_id] = self.rollout.switch_prompt(event.session_id, event.prompt,
                                                                                  sink=event.sink)
                    else:
                        latents = self.rollout.leave(event.session_id)
                        if latents is not None:
                            left[event.session_id] = latents
                except StepFailed:  # a switch failed on some process: agreed already, a failure not a refusal
                    raise
                except REFUSALS as error:
                    refused[i] = error
        except BaseException as error:  # not decided by the table: the step fails everywhere
            if not isinstance(error, StepFailed):
                self.rollout.agree(error)
            raise
        if not self.rollout.sessions:
            self.rollout.agree(None)  # one agreement per step, with or without a chunk
            return StepOutcome(applied, refused, left, recomputed, None)
        return StepOutcome(applied, refused, left, recomputed, self.rollout.step())
