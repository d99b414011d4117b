"""``arkv-jax demo``: several video sessions share one paged KV cache, on the CPU in seconds.

A random-weight causal video DiT (:mod:`arkv_jax.models.dit`, the ``tiny`` shape by default)
generates ``--chunks`` chunks for each of ``--sessions`` sessions through one
:class:`arkv_jax.cache.PagedKVCache`. Session ``i`` joins at step ``i`` and leaves after its last
chunk, so sessions run at different frame indices in one batch and freed pages are reused. Each
step prints (to stderr, one carriage-returned line) its latency, latent frames per second and pool
occupancy; the end prints a per-step table, a summary and, as the very last line,
``checksum: <float>``: the sum of every generated latent, to 7 significant digits (float32's
precision). It is deterministic for a seed and the same with ``--devices N``: a sharded run gives
each device a smaller batch, and XLA may then add in another order and move the last bits of a
value (up to 3e-6 measured, the same as on one device with a smaller batch); 7 digits do not see
that.

Two pictures go to ``--out``: ``pages.png``, the physical page ids each session holds after every
step (x = step, y = page id, colour = session, white = free), and ``memory.png``, the pages a
session holds against the frames it has generated (flat once the window is full). They are drawn
with a small NumPy rasteriser and written by a minimal PNG encoder (zlib), so the demo needs no
plotting library. ``--check`` also runs the full-recompute reference
(:class:`arkv_jax.rollout.FullRecompute`) and prints ``max_abs_diff``.
"""

from __future__ import annotations

import dataclasses
import pathlib
import struct
import sys
import time
import zlib
from typing import Sequence, TextIO

import jax
import numpy as np
from jax.sharding import Mesh

from arkv_jax.cache import PagedKVCache
from arkv_jax.models.dit import MODEL_CONFIGS, init_random
from arkv_jax.presets import get_preset
from arkv_jax.planner import rollout_plan
from arkv_jax.reference import FullRecompute
from arkv_jax.rollout import ChunkResult, Rollout, Sampler
from arkv_jax.sharding import check_mesh, make_mesh

PROMPTS = (
    "a red fox running through fresh snow",
    "a city street at night in the rain",
    "waves breaking on a rocky shore",
    "a hot air balloon over green hills",
    "a cat watching birds from a window",
    "timelapse of clouds over mountains",
)

#: Session colours (RGB), cycled.
PALETTE = np.array([
    (31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40),
    (148, 103, 189), (140, 86, 75), (227, 119, 194), (23, 190, 207),
], np.uint8)


# ------------------------------------------------------------------------------------------------
# What a run records
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class StepRecord:
    """One rollout step.

    Attributes:
      sessions: the sessions of the step, in batch order.
      first_frames: each session's first frame index in the step.
      seconds: wall time of the step (host to host, latents on the host).
      frames: latent frames generated (sessions x frames per chunk).
      pages_in_use: managed pages held by any row after the commit.
      pages_held: physical page ids each active session holds after the commit.
    """

    sessions: tuple[str, ...]
    first_frames: tuple[int, ...]
    seconds: float
    frames: int
    pages_in_use: int
    pages_held: dict[str, np.ndarray]


@dataclasses.dataclass
class Timeline:
    """Step records of a rollout plus what the pictures need.

    Attributes:
      num_pages: pages of the pool (page 0 is the null page; with a mesh, page ``s *
        pages_per_shard`` is shard ``s``'s null page).
      usable_pages: pages sessions can hold (``num_pages`` less the null pages).
      chunk_frames: frames per chunk.
      steps: one :class:`StepRecord` per step.
    """

    num_pages: int
    usable_pages: int
    chunk_frames: int
    steps: list[StepRecord] = dataclasses.field(default_factory=list)

    def observe(self, rollout: Rollout, result: ChunkResult, seconds: float) -> StepRecord:
        """Records the step that produced ``result`` in ``seconds`` (call right after ``step()``)."""
        record = StepRecord(result.session_ids, tuple(int(f) for f in result.first_frames), seconds,
                            len(result.session_ids) * self.chunk_frames,
                            self.usable_pages - rollout.cache.num_free_pages(), rollout.pages_held())
        self.steps.append(record)
        return record

    def memory_series(self) -> dict[str, list[tuple[int, int]]]:
        """Per session: ``(frames generated, pages held)`` after each of its chunks, from ``(0, 0)``."""
        series: dict[str, list[tuple[int, int]]] = {}
        for step in self.steps:
            for sid, first in zip(step.sessions, step.first_frames):
                points = series.setdefault(sid, [(0, 0)])
                points.append((first + self.chunk_frames, len(step.pages_held[sid])))
        return series


# ------------------------------------------------------------------------------------------------
# Pictures: a tiny rasteriser and PNG encoder
# ------------------------------------------------------------------------------------------------

# 3x5 pixel glyphs, rows top to bottom, "1" = ink.
_GLYPHS = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001010010010",
    "8": "111101111101111", "9": "111101111001111", "A": "010101111101101", "B": "110101110101110",
    "C": "011100100100011", "D": "110101101101110", "E": "111100110100111", "F": "111100110100100",
    "G": "011100101101011", "H": "101101111101101", "I": "111010010010111", "J": "001001001101010",
    "K": "101101110101101", "L": "100100100100111", "M": "101111111101101", "N": "110101101101101",
    "O": "010101101101010", "P": "110101110100100", "Q": "010101101110011", "R": "110101110101101",
    "S": "011100010001110", "T": "111010010010010", "U": "101101101101111", "V": "101101101101010",
    "W": "101101111111101", "X": "101101010101101", "Y": "101101010010010", "Z": "111001010100111",
    " ": "000000000000000", "-": "000000111000000", ".": "000000000000010", ":": "000010000010000",
    "/": "001001010100100", "+": "000010111010000", "(": "010100100100010", ")": "010001001001010",
    "%": "101001010100101", "=": "000111000111000", "_": "000000000000111",
}


class Canvas:
    """An RGB image ``[height, width, 3]`` uint8 with a few drawing primitives (pixels, y down)."""

    def __init__(self, height: int, width: int):
        self.pixels = np.full((height, width, 3), 255, np.uint8)

    def rect(self, x0: int, y0: int, x1: int, y1: int, color) -> None:
        """Fills ``[x0, x1) x [y0, y1)`` (clipped)."""
        self.pixels[max(y0, 0):max(y1, 0), max(x0, 0):max(x1, 0)] = color

    def line(self, x0: float, y0: float, x1: float, y1: float, color, width: int = 1, dash: int = 0) -> None:
        """A straight segment ``width`` pixels thick; ``dash`` > 0 draws dashes of that length."""
        steps = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        half = width // 2
        for i in range(steps):
            if dash and (i // dash) % 2:
                continue
            x = round(x0 + (x1 - x0) * i / max(steps - 1, 1))
            y = round(y0 + (y1 - y0) * i / max(steps - 1, 1))
            self.rect(x - half, y - half, x - half + width, y - half + width, color)

    def text(self, x: int, y: int, text: str, color=(0, 0, 0), scale: int = 2) -> int:
        """Writes ``text`` (upper-cased; unknown characters as blanks) with its top-left at ``(x, y)``;
        returns the x after it."""
        for char in text.upper():
            glyph = _GLYPHS.get(char, _GLYPHS[" "])
            for i, bit in enumerate(glyph):
                if bit == "1":
                    r, c = divmod(i, 3)
                    self.rect(x + c * scale, y + r * scale, x + (c + 1) * scale, y + (r + 1) * scale, color)
            x += 4 * scale
        return x

    def png(self) -> bytes:
        """The image as PNG bytes (8-bit RGB, no filtering, zlib level 9)."""
        height, width, _ = self.pixels.shape
        raw = b"".join(b"\x00" + row.tobytes() for row in self.pixels)

        def chunk(tag: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

        header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9))
                + chunk(b"IEND", b""))


def _ticks(top: int, count: int = 5) -> list[int]:
    """About ``count`` round tick values in ``[0, top]``."""
    raw = max(top / count, 1)
    step = min((m * 10 ** e for e in range(8) for m in (1, 2, 5) if m * 10 ** e >= raw))
    return list(range(0, top + 1, int(step)))


def _legend(canvas: Canvas, x: int, y: int, names: Sequence[str]) -> None:
    for i, name in enumerate(names):
        canvas.rect(x, y + 16 * i, x + 10, y + 16 * i + 10, PALETTE[i % len(PALETTE)])
        canvas.text(x + 16, y + 16 * i, name)


def page_map_png(timeline: Timeline) -> bytes:
    """PNG: which session holds each physical page after every step (x = step, y = page id with
    page 1 at the bottom, colour = session, white = free). Pools of more than 480 pages are drawn
    ``ceil(pages / 480)`` pages per pixel row (a row takes the colour of a session holding any of
    its pages)."""
    names = list(dict.fromkeys(s for step in timeline.steps for s in step.sessions))
    pages = timeline.num_pages - 1
    per_row = -(-pages // 480)
    cell_w = max(3, min(24, 640 // max(len(timeline.steps), 1)))
    cell_h = max(1, min(8, 480 // -(-pages // per_row)))
    left, top, plot_w, plot_h = 60, 34, cell_w * len(timeline.steps), cell_h * -(-pages // per_row)
    canvas = Canvas(top + plot_h + 46, left + plot_w + 130)
    canvas.text(left, 8, "PHYSICAL PAGES HELD PER SESSION")
    for x, step in enumerate(timeline.steps):
        for sid, held in step.pages_held.items():
            for page in held:
                y = top + plot_h - ((int(page) - 1) // per_row + 1) * cell_h
                canvas.rect(left + x * cell_w, y, left + (x + 1) * cell_w, y + cell_h,
                            PALETTE[names.index(sid) % len(PALETTE)])
    canvas.rect(left - 2, top, left, top + plot_h, (0, 0, 0))
    canvas.rect(left - 2, top + plot_h, left + plot_w, top + plot_h + 2, (0, 0, 0))
    for tick in _ticks(pages):
        y = top + plot_h - tick * cell_h // per_row
        canvas.rect(left - 6, y, left - 2, y + 1, (0, 0, 0))
        canvas.text(left - 10 - 8 * len(str(tick)), y - 4, str(tick))
    for tick in _ticks(len(timeline.steps) - 1):
        x = left + tick * cell_w + cell_w // 2
        canvas.rect(x, top + plot_h + 2, x + 1, top + plot_h + 6, (0, 0, 0))
        canvas.text(x - 4 * len(str(tick)), top + plot_h + 10, str(tick))
    canvas.text(left + plot_w // 2 - 20, top + plot_h + 28, "STEP")
    canvas.text(4, top - 16, "PAGE")
    _legend(canvas, left + plot_w + 14, top, names)
    return canvas.png()


def memory_png(timeline: Timeline, bound: int) -> bytes:
    """PNG: pages each session holds against the frames it has generated, with the ``bound``
    (sink + window frames x pages per frame x branches) dashed."""
    series = timeline.memory_series()
    names = list(series)
    max_x = max(x for points in series.values() for x, _ in points)
    max_y = max(bound, max(y for points in series.values() for _, y in points))
    left, top, plot_w, plot_h = 60, 34, 480, 300
    canvas = Canvas(top + plot_h + 46, left + plot_w + 130)
    canvas.text(left, 8, "PAGES HELD VS FRAMES GENERATED")

    def at(x, y):
        return left + x * plot_w / max(max_x, 1), top + plot_h - y * plot_h / (max_y * 1.1)

    for tick in _ticks(int(max_y * 1.1)):
        _, y = at(0, tick)
        canvas.line(left, y, left + plot_w, y, (225, 225, 225))
        canvas.text(left - 10 - 8 * len(str(tick)), round(y) - 4, str(tick))
    for tick in _ticks(max_x):
        x, _ = at(tick, 0)
        canvas.rect(round(x), top + plot_h + 2, round(x) + 1, top + plot_h + 6, (0, 0, 0))
        canvas.text(round(x) - 4 * len(str(tick)), top + plot_h + 10, str(tick))
    canvas.line(*at(0, bound), *at(max_x, bound), (0, 0, 0), width=1, dash=6)
    canvas.text(left + 6, round(at(0, bound)[1]) - 14, "SINK + WINDOW")
    # Every session follows the same curve: draw the first ones thickest so each colour shows.
    for i, name in enumerate(names):
        width = 2 + 2 * (len(names) - 1 - i)
        for (x0, y0), (x1, y1) in zip(series[name], series[name][1:]):
            canvas.line(*at(x0, y0), *at(x1, y1), PALETTE[i % len(PALETTE)], width=width)
    canvas.rect(left - 2, top, left, top + plot_h + 2, (0, 0, 0))
    canvas.rect(left - 2, top + plot_h, left + plot_w, top + plot_h + 2, (0, 0, 0))
    canvas.text(left + plot_w // 2 - 60, top + plot_h + 28, "FRAMES GENERATED")
    canvas.text(4, top - 16, "PAGES")
    _legend(canvas, left + plot_w + 14, top, names)
    return canvas.png()


# ------------------------------------------------------------------------------------------------
# The demo
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class DemoResult:
    """What :func:`run_demo` measured and wrote.

    Attributes:
      timeline: the step records.
      latents: each session's latents ``[frames, H, W, C]``.
      checksum: the sum of every generated latent (float64, unrounded).
      max_abs_diff: largest difference to the full-recompute reference (``check`` only).
      pictures: paths of ``pages.png`` and ``memory.png``.
    """

    timeline: Timeline
    latents: dict[str, np.ndarray]
    checksum: float
    max_abs_diff: float | None
    pictures: tuple[pathlib.Path, pathlib.Path]


def _progress(stream: TextIO, done: int, total: int, record: StepRecord, usable_pages: int) -> None:
    filled = round(20 * done / total)
    stream.write(f"\r[{'#' * filled}{'.' * (20 - filled)}] step {done}/{total}  "
                 f"{record.seconds * 1e3:7.1f} ms  {record.frames / record.seconds:8.1f} frames/s  "
                 f"pool {record.pages_in_use}/{usable_pages} pages")
    stream.flush()


def demo_mesh(devices: int, model_axis: int = 1) -> Mesh:
    """The demo's ``(devices // model_axis, model_axis)`` mesh over the first ``devices`` devices.

    Raises:
      ValueError: ``devices`` not a multiple of ``model_axis``, or more devices than there are.
    """
    if devices < 1 or model_axis < 1 or devices % model_axis:
        raise ValueError(f"devices={devices} must be a positive multiple of model_axis={model_axis}")
    available = jax.devices()
    if devices > len(available):
        raise ValueError(f"devices={devices} but this process sees {len(available)} "
                         f"{available[0].platform} device(s); allowed 1..{len(available)} (on CPU, "
                         "'arkv-jax demo --devices N' creates N host devices itself)")
    return make_mesh(devices // model_axis, model_axis, available[:devices])


def run_demo(*, sessions: int = 4, chunks: int = 12, preset: str = "tiny", backend: str = "auto",
             out: str | pathlib.Path = "arkv_demo_out", check: bool = False, seed: int = 0,
             mesh: Mesh | None = None, stdout: TextIO | None = None, stderr: TextIO | None = None
             ) -> DemoResult:
    """Runs the demo (see the module docstring) and prints its report to ``stdout`` (the progress
    line to ``stderr``; default: ``sys.stdout``/``sys.stderr``); returns what it measured. With a
    ``mesh`` (e.g. :func:`demo_mesh`) the cache and the rollout are sharded over it: the sessions
    are spread over its ``"data"`` axis, heads over ``"model"``.

    Raises:
      ValueError: unknown preset, ``sessions``/``chunks`` below 1, or heads not divisible by the
        mesh's ``"model"`` size.
    """
    stdout, stderr = stdout or sys.stdout, stderr or sys.stderr
    if sessions < 1 or chunks < 1:
        raise ValueError(f"sessions and chunks must be >= 1, got {sessions} and {chunks}")
    if preset not in MODEL_CONFIGS:
        raise ValueError(f"the demo has models for {sorted(MODEL_CONFIGS)}, got {preset!r}")
    cache_preset = get_preset(preset)
    sampler = Sampler(num_steps=3, guidance_scale=3.0 if len(cache_preset.kv_branches) > 1 else None)
    branches = cache_preset.kv_branches[:sampler.num_branches]
    geometry, window = cache_preset.geometry, cache_preset.window
    data, model_axis = check_mesh(mesh) if mesh is not None else (1, 1)
    plan = rollout_plan(geometry, window, branches, cache_preset.cross_attention, -(-sessions // data),
                        model=model_axis)
    cache = PagedKVCache(geometry, window, branches, cache_preset.cross_attention, plan=plan, backend=backend,
                         mesh=mesh)
    rollout = Rollout(init_random(MODEL_CONFIGS[preset], seed), cache, sampler, max_traces=1)
    ids = [f"s{i}" for i in range(sessions)]
    prompts = {sid: PROMPTS[i % len(PROMPTS)] for i, sid in enumerate(ids)}
    seeds = {sid: 1000 * seed + i for i, sid in enumerate(ids)}
    print(f"arkv-jax demo: {sessions} sessions x {chunks} chunks of {geometry.frames_per_forward} frames, "
          f"preset {preset}, {sampler.num_steps} denoise steps + 1 commit forward, "
          f"{'CFG ' + str(sampler.guidance_scale) if sampler.guidance_scale else 'no CFG'}, "
          f"window {window.sink_frames} sink + {window.window_frames} frames", file=stdout)
    num_pages = cache.pages_per_shard * cache.num_shards
    print(f"pool: {num_pages} pages of {geometry.block_size} tokens "
          f"({num_pages * plan.page_size_bytes * model_axis / 2 ** 20:.2f} MiB K+V), "
          f"{geometry.pages_per_frame} pages per frame, backend {backend}", file=stdout)
    if mesh is not None:
        print(f"mesh: data={data} x model={model_axis} over {data * model_axis} {mesh.devices.flat[0].platform} "
              f"devices; {cache.slots_per_shard} session slot(s) and {cache.pages_per_shard} pages per data shard",
              file=stdout)

    timeline = Timeline(num_pages, num_pages - cache.num_shards, geometry.frames_per_forward)
    latents: dict[str, np.ndarray] = {}
    total = chunks + sessions - 1
    for index in range(total):
        if index < sessions:
            rollout.join(ids[index], prompts[ids[index]], seed=seeds[ids[index]])
        start = time.perf_counter()
        result = rollout.step()
        record = timeline.observe(rollout, result, time.perf_counter() - start)
        _progress(stderr, index + 1, total, record, timeline.usable_pages)
        for sid in result.session_ids:
            if len(rollout.latents(sid)) == chunks * geometry.frames_per_forward:
                latents[sid] = rollout.leave(sid)
    stderr.write("\n")
    _print_report(stdout, timeline)

    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    pictures = (out / "pages.png", out / "memory.png")
    pictures[0].write_bytes(page_map_png(timeline))
    bound = window.resident_frames * geometry.pages_per_frame * len(branches)
    pictures[1].write_bytes(memory_png(timeline, bound))
    print(f"pictures: {pictures[0]} (pages per session per step), {pictures[1]} (pages held vs frames)",
          file=stdout)

    max_abs_diff = None
    if check:
        reference = FullRecompute(rollout.model, window, sampler, chunk_frames=geometry.frames_per_forward)
        expected = reference.rollout([prompts[s] for s in ids], [seeds[s] for s in ids], chunks)
        max_abs_diff = max(float(np.max(np.abs(latents[s].astype(np.float64) - expected[i])))
                           for i, s in enumerate(ids))
        print(f"max_abs_diff: {max_abs_diff:.3e} (paged cache vs full recompute, {chunks} chunks per session)",
              file=stdout)
    checksum = float(sum(np.sum(x, dtype=np.float64) for x in latents.values()))
    print(f"checksum: {checksum:.7g}", file=stdout)
    return DemoResult(timeline, latents, checksum, max_abs_diff, pictures)


def _print_report(stream: TextIO, timeline: Timeline) -> None:
    """Per-step table and steady-state summary. Steady state: steps after the first, with as many
    sessions as the step before (a new batch size compiles the cache's bookkeeping once)."""
    print(f"{'step':>4}  {'sessions':>8}  {'frames':>14}  {'latency ms':>10}  {'frames/s':>9}  {'pool pages':>10}",
          file=stream)
    for i, step in enumerate(timeline.steps):
        frames = f"{min(step.first_frames)}..{max(step.first_frames) + timeline.chunk_frames - 1}"
        print(f"{i:>4}  {len(step.sessions):>8}  {frames:>14}  {step.seconds * 1e3:>10.1f}  "
              f"{step.frames / step.seconds:>9.1f}  {step.pages_in_use:>4}/{timeline.usable_pages:<5}", file=stream)
    steady = [s for i, s in enumerate(timeline.steps)
              if i > 0 and len(s.sessions) == len(timeline.steps[i - 1].sessions)]
    frames = sum(s.frames for s in timeline.steps)
    seconds = sum(s.seconds for s in timeline.steps)
    print(f"generated {frames} latent frames in {seconds:.2f} s ({frames / seconds:.1f} frames/s overall; "
          f"first step {timeline.steps[0].seconds:.2f} s includes compilation)", file=stream)
    if steady:
        latency = float(np.median([s.seconds for s in steady]))
        rate = float(np.median([s.frames / s.seconds for s in steady]))
        print(f"steady state: {latency * 1e3:.1f} ms per step (median), {rate:.1f} latent frames/s; "
              f"peak pool occupancy {max(s.pages_in_use for s in timeline.steps)}/{timeline.usable_pages} pages",
              file=stream)
