"""XLA:TPU's own time estimate of a compiled program, read from its optimized HLO.

Each instruction XLA:TPU schedules carries its cost model's ``estimated_cycles`` in its
``backend_config``. :func:`program_cycles` sums them over the program, each loop body times its trip
count (read from the loop condition), so a 30-layer scan inside a 4-step sampler counts 120 layers.
``cost_analysis()`` cannot do this: its FLOPs count each loop body once and its ``optimal_seconds``
is negative for such programs. XLA's model does not see inside a Mosaic kernel (a
``tpu_custom_call``): those calls are counted, by name, rows (the leading dimension of the call's
result) and trips, for the caller to price with the kernel's own bundle estimate. Some copies
carry a placeholder instead of an estimate (100 cycles per window iteration, whatever their size);
given the chip's HBM bandwidth, those are priced as their bytes' round trip through HBM. See
``docs/planning.md`` (The whole chip).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

_HEADER = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s+\(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*.*?\s([\w\-]+)\((.*)$")
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
_CALLED = {"while": re.compile(r"condition=%([\w.\-]+), body=%([\w.\-]+)"),
           "call": re.compile(r"to_apply=%([\w.\-]+)"),
           "conditional": re.compile(r"(?:branch_computations=\{([^}]*)\}|true_computation=%([\w.\-]+), "
                                     r"false_computation=%([\w.\-]+))")}
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_LEADING_DIM = re.compile(r"=\s*\(?\w+\[(\d+)")
_CONSTANT = re.compile(r"%([\w.\-]+)\s*=\s*s32\[\]\S*\s+constant\((-?\d+)\)")
_ITERATIONS = re.compile(r'"iteration_bounds":\[([^\]]*)\]')
_RESULT = re.compile(r"=\s*(.*?)\s[\w\-]+\(")
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z\d]*)\[([\d,]*)\]")
_BOUND = re.compile(r"ROOT\s+%[\w.\-]+\s*=\s*pred\[\]\S*\s+compare\(%[\w.\-]+, %([\w.\-]+)\), direction=LT")

MOSAIC_TARGET = "tpu_custom_call"
UNKNOWN_CYCLES = 1 << 62
"""Estimates at or above this are the cost model's "unknown" sentinel (seen: ``2**64 - 1``)."""

PLACEHOLDER_CYCLES_PER_ITERATION = 100
"""What XLA:TPU's cost model writes for a copy it did not price: this many cycles per iteration of
the copy's window loop (``iteration_bounds``), whatever the bytes. Seen on layout copies of 14 MB
arrays at 1,900 cycles, where the same copy compiled alone is priced 73,720 and runs about 21,000
bundles (``docs/planning.md``)."""

ITEMSIZES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2,
             "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
"""Bytes per element of the HLO element types a result's size is read from."""


@dataclasses.dataclass(frozen=True)
class ProgramCost:
    """What :func:`program_cycles` found.

    Attributes:
      cycles: XLA:TPU's estimated cycles of everything outside Mosaic kernels, loops unrolled.
      kernel_calls: per Mosaic kernel name (``window_attention_tpu``, ...: the instruction's name
        up to its first dot, before the suffixes XLA adds) and
        leading dimension of its (first) result (the batch rows this project's attention kernels
        run; 0 for a scalar result), how many times it runs (loop trips included).
      loops: ``(body name, trip count)`` of every loop, outermost first.
      unpriced: instructions whose estimate is the cost model's "unknown" (``2**64 - 1`` and
        the like); they count 0 in ``cycles``.
      placeholder_copies: runs of copies whose estimate is the placeholder
        (:data:`PLACEHOLDER_CYCLES_PER_ITERATION`), loop trips included.
      placeholder_copy_bytes: the bytes those runs write (loop trips included); with
        ``hbm_bytes_per_cycle`` they count twice these bytes at that rate in ``cycles``.
    """

    cycles: int
    kernel_calls: dict[tuple[str, int], int]
    loops: tuple[tuple[str, int], ...]
    unpriced: int = 0
    placeholder_copies: int = 0
    placeholder_copy_bytes: int = 0


def computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
    """The instruction lines of every computation of an HLO module, and the entry's name."""
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(2)
            comps[current] = []
            if header.group(1):
                entry = current
        elif line.startswith("}"):
            current = None
        elif current is not None:
            comps[current].append(line)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


def trip_count(condition: list[str]) -> int:
    """Trips of a loop whose condition is ``i < N`` for a constant ``N`` (what ``scan`` and
    ``fori_loop`` lower to; the induction variable starts at 0).

    Raises:
      ValueError: the condition has another form.
    """
    constants = dict(m.groups() for line in condition for m in [_CONSTANT.search(line)] if m)
    for line in condition:
        bound = _BOUND.search(line)
        if bound and bound.group(1) in constants:
            return int(constants[bound.group(1)])
    raise ValueError("a loop condition is not `i < constant`: its trip count is unknown")


def result_bytes(instruction: str) -> int:
    """Bytes of an HLO instruction line's result (the elements of each array in it, padding of
    tiled layouts left out).

    Raises:
      ValueError: an element type not in :data:`ITEMSIZES`.
    """
    total = 0
    for dtype, dims in _ARRAY.findall(_RESULT.search(instruction).group(1)):
        if dtype not in ITEMSIZES:
            raise ValueError(f"element type {dtype!r} of {instruction.strip()[:80]!r} has no size")
        total += ITEMSIZES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def is_placeholder(instruction: str) -> bool:
    """Whether an HLO instruction line is a copy whose estimate is the cost model's placeholder
    (:data:`PLACEHOLDER_CYCLES_PER_ITERATION` x its window iterations) rather than a price."""
    ins, cycles, iterations = _INSTRUCTION.match(instruction), _CYCLES.search(instruction), \
        _ITERATIONS.search(instruction)
    if not (ins and cycles and iterations) or ins.group(3) != "copy":
        return False
    bounds = [int(b.strip('"')) for b in iterations.group(1).split(",") if b.strip('"')]
    return int(cycles.group(1)) == PLACEHOLDER_CYCLES_PER_ITERATION * math.prod(bounds)


def program_cycles(hlo_text: str, hbm_bytes_per_cycle: float | None = None) -> ProgramCost:
    """Sums XLA:TPU's ``estimated_cycles`` over an optimized HLO module (see the module docstring).

    Fusions count as one instruction (their ``estimated_cycles`` covers the fused computation);
    a ``conditional`` counts its dearest branch. With ``hbm_bytes_per_cycle`` (the chip's HBM
    bandwidth over its clock), a copy priced by the placeholder (:func:`is_placeholder`) counts
    the round trip of its bytes instead: its result read and written once at that rate.
    """
    comps, entry = computations(hlo_text)
    kernels: collections.Counter = collections.Counter()
    loops: list[tuple[str, int]] = []
    unpriced = [0]
    placeholders = collections.Counter()

    def walk(name: str, times: int) -> int:
        total = 0
        for line in comps[name]:
            ins = _INSTRUCTION.match(line)
            if not ins:
                continue
            op = ins.group(3)
            cycles = int(_CYCLES.search(line).group(1)) if _CYCLES.search(line) else 0
            if is_placeholder(line):
                size = result_bytes(line)
                placeholders["runs"] += times
                placeholders["bytes"] += times * size
                if hbm_bytes_per_cycle:
                    cycles = round(2 * size / hbm_bytes_per_cycle)
            if cycles >= UNKNOWN_CYCLES:
                unpriced[0] += times
            else:
                total += cycles
            if op == "custom-call" and (_TARGET.search(line) or [None, None])[1] == MOSAIC_TARGET:
                rows = _LEADING_DIM.search(line)
                kernels[ins.group(2).split(".")[0], int(rows.group(1)) if rows else 0] += times
            elif op == "while":
                cond, body = _CALLED["while"].search(line).groups()
                trips = trip_count(comps[cond])
                loops.append((body, trips))
                total += trips * (walk(body, times * trips) + walk(cond, times * trips))
            elif op == "call":
                total += walk(_CALLED["call"].search(line).group(1), times)
            elif op == "conditional":
                m = _CALLED["conditional"].search(line)
                names = ([n.strip().lstrip("%") for n in m.group(1).split(",")] if m.group(1)
                         else [m.group(2), m.group(3)])
                total += max(walk(n, times) for n in names)
        return total

    cycles = walk(entry, 1)
    return ProgramCost(cycles, dict(kernels), tuple(loops), unpriced[0], placeholders["runs"],
                       placeholders["bytes"])
