"""Common harness for arkv-jax benchmarks.

Every benchmark is a script that prints a readable table and, as its very last line, one JSON object
with its figures (strict JSON: a figure that could not be measured is ``null``, never ``NaN``).
``--quick`` keeps a run short on 2 CPU cores. Times are medians over several repetitions, and
comparisons are ratios measured in the same run. A benchmark that cannot run on this machine (no
GPU, no libtpu) says why in one line on stderr and exits with :data:`UNAVAILABLE` (:func:`refuse`).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from typing import Any, Callable, NoReturn, Sequence

import jax

#: Exit status of a benchmark that cannot run on this machine (:func:`refuse`).
UNAVAILABLE = 1

#: The quantized page dtypes the CPU benchmarks compare with plain pages, by the prefix of their
#: JSON keys (``int8_...``, ``fp8_...``).
QUANTIZED_PAGES = {"int8": "int8", "fp8": "float8_e4m3fn"}


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
    print(json_line({**figures, "machine": machine()}))


def finite(value: Any) -> Any:
    """``value`` with every NaN or infinite float (in dicts, lists and tuples) replaced by ``None``."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def json_line(figures: dict[str, Any]) -> str:
    """``figures`` as one line of strict JSON (keys sorted, non-finite floats as ``null``)."""
    return json.dumps(finite(figures), sort_keys=True, allow_nan=False)


def refuse(message: str) -> NoReturn:
    """Ends a benchmark that cannot run here: ``message`` as one line on stderr, exit status
    :data:`UNAVAILABLE`, no traceback (also under ``arkv-jax bench``, which passes the status on)."""
    print(" ".join(message.split()), file=sys.stderr)
    raise SystemExit(UNAVAILABLE)


def require_gpu(what: str, hint: str = "", nvidia: bool = True) -> None:
    """Refuses (:func:`refuse`) unless JAX sees a GPU (an NVIDIA one unless ``nvidia=False``);
    ``what`` names the benchmark mode in the message, ``hint`` (if any) ends it."""
    try:
        devices = jax.devices()
    except Exception as error:  # e.g. JAX_PLATFORMS=cuda where jax has no CUDA plugin
        first = (str(error).strip().splitlines() or [""])[0] or type(error).__name__
        found = f"JAX could not start its backend ({first})"
    else:
        gpus = [d for d in devices if d.platform == "gpu" and (not nvidia or "nvidia" in d.device_kind.lower())]
        if gpus:
            return
        found = f"this machine has {sorted({f'{d.platform}:{d.device_kind}' for d in devices})} only"
    refuse(f"{what} needs an NVIDIA GPU visible to JAX (jax with CUDA); {found}" + (f"; {hint}" if hint else ""))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
