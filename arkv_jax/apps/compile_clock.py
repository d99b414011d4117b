"""Compile time of JAX programs, read from JAX's own compile events (see ``docs/demo.md``).

A program runs slower the first time it is used with a new shape: JAX traces, lowers and compiles
it. :class:`CompileClock` records when that happens, so a report can name the steps that compiled
and keep them out of its steady state.
"""

from __future__ import annotations

import threading
import time

import jax

#: JAX's events for the three stages of building a program (trace, lower to MLIR, XLA compile).
COMPILE_EVENTS = frozenset({
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
})


class CompileClock:
    """Records the spans of wall time JAX spends building programs while the clock is active.

    Use as a context manager; :meth:`seconds` then gives the compile time inside any interval of
    ``time.perf_counter()``. Nested stages (a jit traced inside another's trace) are counted once:
    spans are merged before they are summed.
    """

    def __init__(self) -> None:
        self._spans: list[tuple[float, float]] = []
        self._lock = threading.Lock()

    def __enter__(self) -> "CompileClock":
        jax.monitoring.register_event_duration_secs_listener(self._record)
        return self

    def __exit__(self, *exc_info) -> None:
        jax.monitoring.unregister_event_duration_listener(self._record)

    def _record(self, event: str, duration: float, **_) -> None:
        if event in COMPILE_EVENTS:
            end = time.perf_counter()
            with self._lock:
                self._spans.append((end - float(duration), end))

    def seconds(self, start: float, end: float) -> float:
        """Seconds of ``[start, end]`` (``time.perf_counter()`` values) spent building programs."""
        with self._lock:
            spans = sorted((max(a, start), min(b, end)) for a, b in self._spans if b > start and a < end)
        total, reach = 0.0, start
        for a, b in spans:
            if b > reach:
                total += b - max(a, reach)
                reach = b
        return total


class Phase:
    """Times one phase of a step: ``with Phase(clock) as phase: ...``, then ``phase.seconds`` (wall
    time) and ``phase.compile_seconds`` (the part of it spent building programs)."""

    def __init__(self, clock: CompileClock) -> None:
        self._clock = clock
        self.seconds = self.compile_seconds = 0.0

    def __enter__(self) -> "Phase":
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc_info) -> None:
        end = time.perf_counter()
        self.seconds = end - self._start
        self.compile_seconds = self._clock.seconds(self._start, end)
