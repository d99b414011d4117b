"""Common harness for arkv-jax benchmarks.

Every benchmark is a script that prints a readable table and, as its very last line, one JSON object
with its figures. ``--quick`` keeps a run under a minute on 2 CPU cores. Times are medians over
several repetitions, and comparisons are ratios measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Any, Callable, Sequence

import jax


def parse_args(description: str, argv: Sequence[str] | None = None,
               extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """Parses the common flags (``--quick``, ``--reps``) plus any ``extra`` ones."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="small sizes, under a minute on 2 cores")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per case (median)")
    if extra is not None:
        extra(parser)
    return parser.parse_args(argv)


def block(tree: Any) -> Any:
    """Waits for every array in ``tree``; returns it."""
    return jax.block_until_ready(tree)


def median_seconds(fn: Callable[[], Any], reps: int, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in seconds over ``reps`` runs after ``warmup`` untimed runs.

    ``fn`` must return its JAX outputs so they can be waited on.
    """
    for _ in range(warmup):
        block(fn())
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        block(fn())
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def interleaved_medians(fns: dict[str, Callable[[], Any]], reps: int, warmup: int = 1) -> dict[str, float]:
    """Median seconds of each ``fns[name]()``, timing the cases in turn (round-robin) so that load
    changes on a shared machine hit every case alike. Use it for ratios."""
    for fn in fns.values():
        for _ in range(warmup):
            block(fn())
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            block(fn())
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    device = jax.devices()[0]
    return {
        "platform": device.platform,
        "device_kind": device.device_kind,
        "device_count": jax.device_count(),
        "cpu": platform.processor() or platform.machine(),
        "jax": jax.__version__,
        "python": platform.python_version(),
    }


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Prints ``rows`` as an aligned text table."""
    cells = [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
              for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))


def emit(figures: dict[str, Any]) -> None:
    """Prints the closing JSON line (figures plus the machine)."""
    print(json.dumps({**figures, "machine": machine()}, sort_keys=True))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
