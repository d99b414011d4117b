"""``arkv-jax demo``: several video sessions share one paged KV cache, on the CPU.

A random-weight causal video DiT (:mod:`arkv_jax.models.dit`, the ``tiny`` shape by default)
generates ``chunks`` chunks for each of ``sessions`` sessions through one
:class:`arkv_jax.cache.PagedKVCache`; session ``i`` joins at step ``i`` and leaves after its last
chunk, so one batch holds sessions at different frame indices and freed pages are reused. Stdout
gets a header, one row per step (latency, latent frames per second, pages in use out of the usable
pages, i.e. without each data shard's null page), a summary and, as the very last line,
``checksum: <float>`` (the float64 sum of every latent, 7 significant digits); :func:`write_figures`
writes ``pages.png``, ``memory.png`` and ``latency.png`` into ``out``. ``check`` adds the
full-recompute reference's ``max_abs_diff`` and, with a ``mesh``, the one-device run's checksum and
``devices_max_abs_diff``, judged against :data:`DEVICE_TOLERANCE`. See ``docs/demo.md``.
"""

from __future__ import annotations

import dataclasses
import io
import pathlib
import sys
import tempfile
from typing import Callable, Sequence, TextIO

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from tqdm import tqdm

from arkv_jax.apps.compile_clock import CompileClock, Phase
from arkv_jax.apps.platforms import check_backend
from arkv_jax.cache import PagedKVCache
from arkv_jax.config import CacheGeometry, ceil_div
from arkv_jax.lockstep import Event, Join, Leave, Lockstep, StepOutcome
from arkv_jax.models.dit import MODEL_CONFIGS, CausalDiT, init_random
from arkv_jax.planner import device_free_bytes, format_bytes, rollout_plan
from arkv_jax.presets import get_preset
from arkv_jax.processes import ProcessGroup, spans_processes
from arkv_jax.reference import FullRecompute
from arkv_jax.rollout import Rollout, Sampler
from arkv_jax.sharding import check_mesh, make_mesh
from pallas_kernels.backend import resolve_backend
from pallas_kernels.window_attention.geometry import WindowGeometry
from pallas_kernels.window_attention.xla import key_block

PROMPTS = (
    "a red fox running through fresh snow",
    "a city street at night in the rain",
    "waves breaking on a rocky shore",
    "a hot air balloon over green hills",
    "a cat watching birds from a window",
    "timelapse of clouds over mountains",
)

#: Largest difference of any latent between a sharded and a one-device run that the demo accepts,
#: by model dtype (``check`` judges against it; other dtypes are reported without a bound).
DEVICE_TOLERANCE = {"float32": 1e-5}

def plural(count: int, noun: str) -> str:
    """``"1 session"``, ``"2 sessions"``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def session_colors(count: int) -> list[tuple[float, ...]]:
    """RGBA colour of each of ``count`` sessions (matplotlib's ``tab10``, cycled)."""
    palette = colormaps["tab10"].colors
    return [(*palette[i % len(palette)], 1.0) for i in range(count)]


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
      compile_seconds: the part of ``seconds`` JAX spent tracing, lowering and compiling programs
        (:class:`~arkv_jax.apps.compile_clock.CompileClock`); 0 once every program the step uses is
        built.
      frames: latent frames generated (sessions x frames per chunk).
      pages_in_use: usable pages held by any row after the commit.
      pages_held: physical page ids each active session holds after the commit.
    """

    sessions: tuple[str, ...]
    first_frames: tuple[int, ...]
    seconds: float
    compile_seconds: float
    frames: int
    pages_in_use: int
    pages_held: dict[str, np.ndarray]

    @property
    def compiled(self) -> bool:
        """Whether the step built a program (its latency is not a steady-state one)."""
        return self.compile_seconds > 0


@dataclasses.dataclass
class Timeline:
    """Step records of a rollout plus what the figures need.

    Attributes:
      num_pages: pages of the pool, null pages included (page 0; with a mesh of ``D`` data shards,
        page ``s * num_pages // D`` is shard ``s``'s null page).
      usable_pages: pages sessions can hold: ``num_pages`` less one null page per data shard.
      chunk_frames: frames per chunk.
      steps: one :class:`StepRecord` per step.
    """

    num_pages: int
    usable_pages: int
    chunk_frames: int
    steps: list[StepRecord] = dataclasses.field(default_factory=list)

    @property
    def null_pages(self) -> np.ndarray:
        """The null page of each data shard."""
        shards = self.num_pages - self.usable_pages
        return np.arange(shards) * (self.num_pages // shards)

    def step(self, lockstep: Lockstep, events: Sequence[Event], clock: CompileClock) -> tuple[StepOutcome, StepRecord]:
        """Runs ``lockstep.step(events)``, timed (``clock`` active), and records it (every session of
        the step, on every process)."""
        rollout = lockstep.rollout
        with Phase(clock) as phase:
            outcome = lockstep.step(events)
        ids = rollout.sessions
        firsts = tuple(rollout.num_frames(s) - self.chunk_frames for s in ids)
        record = StepRecord(ids, firsts, phase.seconds, phase.compile_seconds, len(ids) * self.chunk_frames,
                            self.usable_pages - rollout.cache.num_free_pages(), rollout.pages_held())
        self.steps.append(record)
        return outcome, record

    def steady_steps(self) -> list[StepRecord]:
        """The steps that built no program: the steady state the report and the figure summarise."""
        return [s for s in self.steps if not s.compiled]

    def compile_step_indexes(self) -> list[int]:
        """Indexes of the steps that built a program: the first chunk of each batch bucket, the first
        session to leave (the cache's end-of-session program)."""
        return [i for i, s in enumerate(self.steps) if s.compiled]

    def session_names(self) -> list[str]:
        """Every session of the run, in order of first appearance."""
        return list(dict.fromkeys(s for step in self.steps for s in step.sessions))

    def memory_series(self) -> dict[str, list[tuple[int, int]]]:
        """Per session: ``(frames generated, pages held)`` after each of its chunks, from ``(0, 0)``."""
        series: dict[str, list[tuple[int, int]]] = {}
        for step in self.steps:
            for sid, first in zip(step.sessions, step.first_frames):
                points = series.setdefault(sid, [(0, 0)])
                points.append((first + self.chunk_frames, len(step.pages_held[sid])))
        return series

    def page_owners(self) -> np.ndarray:
        """int ``[num_pages, steps]``: after each step, ``i + 1`` where session ``i`` of
        :meth:`session_names` holds the page, 0 where it is free, -1 for the null pages."""
        names = {sid: i for i, sid in enumerate(self.session_names())}
        owners = np.zeros((self.num_pages, len(self.steps)), np.int32)
        owners[self.null_pages] = -1
        for x, step in enumerate(self.steps):
            for sid, held in step.pages_held.items():
                owners[held, x] = names[sid] + 1
        return owners


# ------------------------------------------------------------------------------------------------
# Figures
# ------------------------------------------------------------------------------------------------


def _figure(width: float, height: float) -> Figure:
    """A figure of ``width x height`` inches drawn by the Agg backend (no pyplot state)."""
    figure = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def page_map_figure(timeline: Timeline) -> Figure:
    """The page map: which session holds each physical page after every step (the image's data is
    :meth:`Timeline.page_owners`; dotted lines between data shards). Its size does not depend on the
    pool's."""
    names = timeline.session_names()
    colors = session_colors(len(names))
    figure = _figure(8, 5)
    ax = figure.add_subplot()
    steps = len(timeline.steps)
    ax.imshow(timeline.page_owners(), origin="lower", aspect="auto", interpolation="nearest",
              cmap=ListedColormap([(0.8, 0.8, 0.8, 1.0), (1.0, 1.0, 1.0, 1.0), *colors]),
              vmin=-1.5, vmax=len(names) + 0.5, extent=(-0.5, steps - 0.5, -0.5, timeline.num_pages - 0.5))
    for null in timeline.null_pages[1:]:
        ax.axhline(null - 0.5, color="black", linewidth=0.6, linestyle=":")
    ax.set(xlabel="step", ylabel="physical page id",
           title=f"Pages each session holds after every step ({timeline.usable_pages} usable pages)")
    handles = [Patch(color=c, label=n) for n, c in zip(names, colors)]
    handles += [Patch(facecolor="white", edgecolor="black", label="free"), Patch(color=(0.8, 0.8, 0.8), label="null")]
    if len(timeline.null_pages) > 1:
        handles.append(Line2D([], [], color="black", linewidth=0.6, linestyle=":", label="data shards"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    return figure


def memory_figure(timeline: Timeline, bound: int) -> Figure:
    """Memory over time: left, the pages each session holds against the frames it has generated,
    with the ``bound`` (sink + window frames x pages per frame x branches) dashed; right, the pool's
    pages in use after every step against its usable pages."""
    names = timeline.session_names()
    series = timeline.memory_series()
    figure = _figure(11, 4.5)
    per_session, pool = figure.subplots(1, 2)
    for i, (name, color) in enumerate(zip(names, session_colors(len(names)))):
        frames, pages = zip(*series[name])
        # Sessions follow the same curve: the first ones are drawn widest so every colour shows.
        per_session.plot(frames, pages, color=color, linewidth=1.5 + 1.5 * (len(names) - 1 - i),
                         marker="o", markersize=3, label=name)
    per_session.axhline(bound, color="black", linestyle="--", linewidth=1, label=f"sink + window ({bound})")
    per_session.set(xlabel="frames generated", ylabel="pages held", ylim=(0, bound * 1.15),
                    title="Pages held vs frames generated, per session")
    per_session.legend(fontsize="small")
    steps = np.arange(len(timeline.steps))
    pool.plot(steps, [s.pages_in_use for s in timeline.steps], color="black", marker="o", markersize=3,
              label="pages in use")
    pool.axhline(timeline.usable_pages, color="tab:red", linestyle="--", linewidth=1,
                 label=f"usable pages ({timeline.usable_pages})")
    pool.set(xlabel="step", ylabel="pages", ylim=(0, timeline.usable_pages * 1.1),
             title="Pool occupancy after every step")
    pool.legend(fontsize="small")
    return figure


def latency_figure(timeline: Timeline) -> Figure:
    """Per-step latency in ms (log scale), with the batch's session count on each bar; steps that
    built a program in orange, the steady-state median (:meth:`Timeline.steady_steps`) as a line."""
    figure = _figure(8, 4)
    ax = figure.add_subplot()
    ms = np.asarray([s.seconds * 1e3 for s in timeline.steps])
    colors = ["tab:orange" if s.compiled else "tab:blue" for s in timeline.steps]
    bars = ax.bar(np.arange(len(ms)), ms, color=colors)
    ax.bar_label(bars, labels=[str(len(s.sessions)) for s in timeline.steps], fontsize="x-small")
    handles = [Patch(color="tab:orange", label="built a program (a first use)"),
               Patch(color="tab:blue", label="steady state")]
    steady = timeline.steady_steps()
    if steady:
        median = float(np.median([s.seconds for s in steady])) * 1e3
        handles.append(ax.axhline(median, color="black", linestyle="--", linewidth=1,
                                  label=f"steady-state median: {median:.1f} ms"))
    ax.legend(handles=handles, fontsize="small")
    ax.set_yscale("log")
    ax.set(xlabel="step (bar label: sessions in the batch)", ylabel="latency (ms)",
           title="Latency of every step")
    return figure


def write_figures(timeline: Timeline, bound: int, out: pathlib.Path) -> tuple[pathlib.Path, ...]:
    """Writes ``pages.png``, ``memory.png`` and ``latency.png`` into the folder ``out``; returns
    their paths."""
    figures = {"pages.png": page_map_figure(timeline), "memory.png": memory_figure(timeline, bound),
               "latency.png": latency_figure(timeline)}
    for name, figure in figures.items():
        figure.savefig(out / name)
    return tuple(out / name for name in figures)


# ------------------------------------------------------------------------------------------------
# Checks made before the run
# ------------------------------------------------------------------------------------------------


def prepare_out(out: str | pathlib.Path) -> pathlib.Path:
    """Creates the folder ``out`` (and its parents) if needed and checks that a file can be written
    in it.

    Raises:
      ValueError: it cannot be created (e.g. a file of that name, or below one) or written.
    """
    path = pathlib.Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        raise ValueError(f"--out {str(out)!r}: cannot create or write the figures' folder "
                         f"({error.strerror or error})") from None
    return path


def demo_geometry(preset: str, kv_dtype: str | None = None) -> CacheGeometry:
    """The demo's cache geometry: the preset's, its K/V pages stored as ``kv_dtype`` (``None``: the
    compute dtype; see :class:`arkv_jax.config.CacheGeometry`)."""
    return dataclasses.replace(get_preset(preset).geometry, kv_dtype=kv_dtype)


def memory_estimate(preset: str, sessions: int, backend: str, platform: str,
                    kv_dtype: str | None = None) -> dict[str, int]:
    """Bytes the demo needs on one device, from the plan and the model's size: ``weights``, ``pools``
    (the demo's plan, all K/V pages, stored as ``kv_dtype``) and, where attention runs through the XLA path (``backend``
    resolving to ``xla``), ``attention_logits``: its float32 logits tile of one layer
    (``[rows, heads, chunk tokens, key block]``, :func:`pallas_kernels.window_attention.xla.key_block`),
    the largest temporary; ``total`` is their sum. Nothing is allocated."""
    config, cache_preset = MODEL_CONFIGS[preset], get_preset(preset)
    abstract = nnx.state(nnx.eval_shape(lambda: CausalDiT(config, rngs=nnx.Rngs(0))))
    weights = sum(leaf.size * np.dtype(leaf.dtype).itemsize for leaf in jax.tree_util.tree_leaves(abstract))
    geometry, window = demo_geometry(preset, kv_dtype), cache_preset.window
    plan = rollout_plan(geometry, window, cache_preset.kv_branches, cache_preset.cross_attention, sessions)
    logits = 0
    if resolve_backend(backend, platform).name == "xla":
        rows = sessions * len(cache_preset.kv_branches)
        queries = geometry.frames_per_forward * geometry.tokens_per_frame
        ppf = geometry.pages_per_frame
        geom = WindowGeometry(rows, queries, config.num_heads, geometry.num_kv_heads, geometry.head_dim, queries, 0,
                              geometry.num_layers, plan.managed_num_blocks, geometry.block_size,
                              window.resident_frames * ppf, geometry.tokens_per_frame)
        logits = rows * config.num_heads * queries * key_block(geom, geometry.dtype) * 4
    pools = plan.managed_num_blocks * plan.page_size_bytes
    return {"weights": weights, "pools": pools, "attention_logits": logits, "total": weights + pools + logits}


def check_fits(preset: str, sessions: int, backend: str, device, kv_dtype: str | None = None) -> None:
    """Refuses a demo the device (the host's memory, on a CPU) cannot hold.

    Raises:
      ValueError: :func:`memory_estimate`'s total exceeds the device's free memory, with the
        estimate in the message.
    """
    estimate = memory_estimate(preset, sessions, backend, device.platform, kv_dtype)
    free = device_free_bytes(device)
    if estimate["total"] > free:
        parts = ", ".join(f"{name.replace('_', ' ')} {format_bytes(value)}"
                          for name, value in estimate.items() if name != "total" and value)
        raise ValueError(f"--preset {preset} with {sessions} session{'s' if sessions != 1 else ''} needs about "
                         f"{format_bytes(estimate['total'])} ({parts}) but this {device.platform} device has "
                         f"{format_bytes(free)} free; run it on an accelerator, or use --preset tiny")


# ------------------------------------------------------------------------------------------------
# The demo
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class DemoResult:
    """What :func:`run_demo` measured and wrote.

    Attributes:
      timeline: the step records.
      latents: each session's latents ``[frames, H, W, C]`` (``None`` for those another process
        read, on several processes).
      checksum: the sum of every generated latent (float64, unrounded).
      max_abs_diff: largest difference to the full-recompute reference (``check`` only).
      one_device_checksum: the checksum of the same sessions on one device (``check`` with a mesh).
      devices_max_abs_diff: largest difference of any latent to the one-device run (``check`` with
        a mesh).
      devices_within_tolerance: whether that is within :data:`DEVICE_TOLERANCE`; ``None`` without
        the comparison or for a dtype without a stated bound.
      figures: paths of ``pages.png``, ``memory.png`` and ``latency.png`` (none but on process 0).
    """

    timeline: Timeline
    latents: dict[str, np.ndarray | None]
    checksum: float
    max_abs_diff: float | None
    one_device_checksum: float | None
    devices_max_abs_diff: float | None
    devices_within_tolerance: bool | None
    figures: tuple[pathlib.Path, ...]


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


def checksum_of(latents: dict[str, np.ndarray | None], group: ProcessGroup | None = None) -> float:
    """The float64 sum of every latent, sessions in the dict's order; with a ``group`` of several
    processes, sessions another process read (``None`` here) are summed there (a collective)."""
    sums = np.asarray([0.0 if x is None else np.sum(x, dtype=np.float64) for x in latents.values()])
    if group is not None:
        sums = group.gather(sums).sum(axis=0)  # each session's sum is nonzero on one process only
    return float(sum(sums))


@dataclasses.dataclass(frozen=True)
class _Schedule:
    """The demo's sessions: who joins when, with which prompt and noise seed, for how long."""

    ids: tuple[str, ...]
    prompts: dict[str, str]
    seeds: dict[str, int]
    chunks: int

    @classmethod
    def make(cls, sessions: int, chunks: int, seed: int) -> "_Schedule":
        ids = tuple(f"s{i}" for i in range(sessions))
        return cls(ids, {sid: PROMPTS[i % len(PROMPTS)] for i, sid in enumerate(ids)},
                   {sid: 1000 * seed + i for i, sid in enumerate(ids)}, chunks)

    def run(self, rollout: Rollout, timeline: Timeline, clock: CompileClock,
            on_step: Callable[[StepRecord], None] = lambda r: None) -> dict[str, np.ndarray | None]:
        """Session ``i`` joins before step ``i`` and leaves after its last chunk, through a
        :class:`~arkv_jax.lockstep.Lockstep` (process 0's events, on every process); records every
        step in ``timeline`` (``clock`` active); returns each session's latents in leaving order
        (``None`` for sessions another process read)."""
        lockstep, latents = Lockstep(rollout), {}
        frames = self.chunks * rollout.chunk_frames
        done: list[str] = []
        for index in range(self.chunks + len(self.ids) - 1):
            events = [Leave(sid) for sid in done]
            if index < len(self.ids):
                sid = self.ids[index]
                events.append(Join(sid, self.prompts[sid], seed=self.seeds[sid]))
            outcome, record = timeline.step(lockstep, events, clock)
            on_step(record)
            latents.update({sid: outcome.left.get(sid) for sid in done})
            done = [sid for sid in rollout.sessions if rollout.num_frames(sid) == frames]
        latents.update({sid: rollout.leave(sid) for sid in done})
        return latents


def _rollout(model: CausalDiT, preset: str, sessions: int, backend: str, mesh: Mesh | None,
             kv_dtype: str | None = None) -> Rollout:
    """The demo's cache (sized for ``sessions``, all in one batched chunk, pages stored as
    ``kv_dtype``) and rollout."""
    cache_preset = get_preset(preset)
    geometry = demo_geometry(preset, kv_dtype)
    sampler = Sampler(num_steps=3, guidance_scale=3.0 if len(cache_preset.kv_branches) > 1 else None)
    branches = cache_preset.kv_branches[:sampler.num_branches]
    data, model_axis = check_mesh(mesh) if mesh is not None else (1, 1)
    plan = rollout_plan(geometry, cache_preset.window, branches, cache_preset.cross_attention,
                        ceil_div(sessions, data), model=model_axis)
    cache = PagedKVCache(geometry, cache_preset.window, branches, cache_preset.cross_attention,
                         plan=plan, backend=backend, mesh=mesh)
    return Rollout(model, cache, sampler, max_traces=1)


def _timeline(rollout: Rollout) -> Timeline:
    cache = rollout.cache
    num_pages = cache.pages_per_shard * cache.num_shards
    return Timeline(num_pages, num_pages - cache.num_shards, rollout.chunk_frames)


def run_demo(*, sessions: int = 4, chunks: int = 12, preset: str = "tiny", backend: str = "auto",
             out: str | pathlib.Path = "arkv_demo_out", check: bool = False, seed: int = 0,
             mesh: Mesh | None = None, stdout: TextIO | None = None, stderr: TextIO | None = None,
             progress: bool | None = None, kv_dtype: str | None = None) -> DemoResult:
    """Runs the demo (the module docstring, ``docs/demo.md``) and prints its report to ``stdout`` (default
    ``sys.stdout``); returns what it measured. With a ``mesh`` (e.g. :func:`demo_mesh`) the cache and
    the rollout are sharded over it: the sessions are spread over its ``"data"`` axis, heads over
    ``"model"``. ``progress``: whether to show the progress bar on ``stderr`` (default
    ``sys.stderr``); ``None`` shows it when both streams are terminals. ``kv_dtype``: the K/V pages'
    storage dtype (``None``: the model's; ``"int8"``, ``"float8_e4m3fn"``, ``"float8_e5m2"`` are
    quantized pages, which every backend reads and writes).

    Raises:
      ValueError, before anything runs: unknown preset or ``kv_dtype``, ``sessions``/``chunks`` below 1,
        an ``out`` that cannot be created or written, a compiled backend for another platform, a run the
        device cannot hold (:func:`check_fits`), heads not divisible by the mesh's ``"model"``
        size, or ``check`` with a mesh that spans processes. On several processes (a ``mesh`` over
        every process's devices, ``docs/sharding.md``) every process runs the demo; process 0
        prints and writes the figures.
    """
    stdout, stderr = stdout or sys.stdout, stderr or sys.stderr
    if sessions < 1 or chunks < 1:
        raise ValueError(f"sessions and chunks must be >= 1, got {sessions} and {chunks}")
    if preset not in MODEL_CONFIGS:
        raise ValueError(f"the demo has models for {sorted(MODEL_CONFIGS)}, got {preset!r}")
    if check and spans_processes(mesh):
        raise ValueError("check runs the references in one process; it takes no mesh that spans processes")
    out = prepare_out(out)
    first_device = jax.local_devices()[0] if mesh is None else next(
        d for d in mesh.devices.flat if d.process_index == jax.process_index())
    check_backend(backend, first_device.platform)
    demo_geometry(preset, kv_dtype)  # checks kv_dtype
    check_fits(preset, ceil_div(sessions, 1 if mesh is None else check_mesh(mesh)[0]), backend, first_device,
               kv_dtype)
    model = init_random(MODEL_CONFIGS[preset], seed)
    rollout = _rollout(model, preset, sessions, backend, mesh, kv_dtype)
    schedule = _Schedule.make(sessions, chunks, seed)
    main = rollout.group is None or rollout.group.index == 0  # on several processes process 0 reports
    if not main:
        stdout, progress = io.StringIO(), False
    _print_header(stdout, rollout, preset, sessions, chunks, backend)

    timeline = _timeline(rollout)
    if progress is None:
        progress = all(getattr(stream, "isatty", lambda: False)() for stream in (stdout, stderr))
    with CompileClock() as clock, tqdm(total=chunks + sessions - 1, desc="demo", unit="step", file=stderr,
                                       disable=not progress) as bar:
        def on_step(record: StepRecord) -> None:
            bar.set_postfix_str(f"{record.seconds * 1e3:.1f} ms, {record.frames / record.seconds:.1f} frames/s, "
                                f"pool {record.pages_in_use}/{timeline.usable_pages} pages", refresh=False)
            bar.update()

        latents = schedule.run(rollout, timeline, clock, on_step)
    _print_report(stdout, timeline)

    window, geometry = rollout.cache.window, rollout.cache.geometry
    bound = window.resident_frames * geometry.pages_per_frame * len(rollout.branches)
    figures = ()
    if main:
        figures = write_figures(timeline, bound, out)
        print(f"figures: {figures[0]} (pages each session holds per step), {figures[1]} (pages held vs frames "
              f"generated; pool occupancy), {figures[2]} (latency per step)", file=stdout)

    max_abs_diff = one_checksum = devices_diff = within = None
    if check:
        reference = FullRecompute(model, window, rollout.sampler, chunk_frames=rollout.chunk_frames)
        expected = reference.rollout([schedule.prompts[s] for s in schedule.ids],
                                     [schedule.seeds[s] for s in schedule.ids], chunks)
        max_abs_diff = max(float(np.max(np.abs(latents[s].astype(np.float64) - expected[i])))
                           for i, s in enumerate(schedule.ids))
        print(f"max_abs_diff: {max_abs_diff:.3e} (paged cache vs full recompute, {plural(chunks, 'chunk')} "
              f"per session)", file=stdout)
        if mesh is not None:
            one_device = _rollout(model, preset, sessions, backend, None, kv_dtype)
            with CompileClock() as clock:
                one = schedule.run(one_device, _timeline(one_device), clock)
            one_checksum = checksum_of(one)
            devices_diff = max(float(np.max(np.abs(latents[s].astype(np.float64) - one[s]))) for s in schedule.ids)
            dtype = MODEL_CONFIGS[preset].dtype
            tolerance = DEVICE_TOLERANCE.get(dtype)
            within = None if tolerance is None else devices_diff <= tolerance
            verdict = (f"no bound stated for {dtype}" if tolerance is None
                       else f"bound {tolerance:.0e}: {'ok' if within else 'EXCEEDED'}")
            print(f"one-device checksum: {one_checksum:.7g}", file=stdout)
            print(f"devices_max_abs_diff: {devices_diff:.3e} ({plural(mesh.devices.size, 'device')} vs one "
                  f"device, largest latent difference; {verdict})", file=stdout)
    checksum = checksum_of(latents, rollout.group)
    print(f"checksum: {checksum:.7g}", file=stdout)
    return DemoResult(timeline, latents, checksum, max_abs_diff, one_checksum, devices_diff, within, figures)


def _print_header(stream: TextIO, rollout: Rollout, preset: str, sessions: int, chunks: int, backend: str) -> None:
    cache, sampler = rollout.cache, rollout.sampler
    geometry, window = cache.geometry, cache.window
    guidance = f"CFG {sampler.guidance_scale}" if sampler.guidance_scale else "no CFG"
    print(f"arkv-jax demo: {plural(sessions, 'session')} x {plural(chunks, 'chunk')} of "
          f"{plural(rollout.chunk_frames, 'frame')}, preset {preset}, {plural(sampler.num_steps, 'denoise step')} "
          f"+ 1 commit forward, {guidance}, window {window.sink_frames} sink + "
          f"{plural(window.window_frames, 'frame')}", file=stream)
    shards = cache.num_shards
    num_pages = cache.pages_per_shard * shards
    mib = num_pages * cache.plan.page_size_bytes * (1 if cache.mesh is None else cache.mesh.shape["model"]) / 2 ** 20
    nulls = "1 null page" if shards == 1 else f"{shards} null pages, one per data shard"
    print(f"pool: {plural(num_pages - shards, 'usable page')} (+{nulls}) of {geometry.block_size} tokens, "
          f"{plural(geometry.pages_per_frame, 'page')} per frame, {mib:.2f} MiB K+V, backend {backend}", file=stream)
    if cache.mesh is not None:
        data, model_axis = cache.mesh.shape["data"], cache.mesh.shape["model"]
        print(f"mesh: data={data} x model={model_axis} over {data * model_axis} {cache.mesh.devices.flat[0].platform} "
              f"devices; {plural(cache.slots_per_shard, 'session slot')} and "
              f"{plural(cache.pages_per_shard - 1, 'usable page')} per data shard", file=stream)


def _print_report(stream: TextIO, timeline: Timeline) -> None:
    """Per-step table and summary: the steps that built programs (:meth:`Timeline.compile_step_indexes`)
    are named, and the steady state is :meth:`Timeline.steady_steps`."""
    usable = timeline.usable_pages
    print(f"{'step':>4}  {'sessions':>8}  {'frames':>14}  {'latency ms':>10}  {'compile ms':>10}  {'frames/s':>9}  "
          f"{'pages in use':>12}", file=stream)
    for i, step in enumerate(timeline.steps):
        frames = f"{min(step.first_frames)}..{max(step.first_frames) + timeline.chunk_frames - 1}"
        print(f"{i:>4}  {len(step.sessions):>8}  {frames:>14}  {step.seconds * 1e3:>10.1f}  "
              f"{step.compile_seconds * 1e3:>10.1f}  {step.frames / step.seconds:>9.1f}  "
              f"{f'{step.pages_in_use}/{usable}':>12}", file=stream)
    steady = timeline.steady_steps()
    frames = sum(s.frames for s in timeline.steps)
    seconds = sum(s.seconds for s in timeline.steps)
    compiled = timeline.compile_step_indexes()
    compile_s = sum(s.compile_seconds for s in timeline.steps)
    where = (f"steps {', '.join(map(str, compiled))} built programs (a first use), "
             f"{compile_s:.2f} s of compilation" if compiled else "no step built a program")
    print(f"generated {plural(frames, 'latent frame')} in {seconds:.2f} s ({frames / seconds:.1f} frames/s "
          f"overall, compilation included; {where})", file=stream)
    peak = f"peak pool occupancy {max(s.pages_in_use for s in timeline.steps)}/{usable} usable pages"
    if steady:
        latency = float(np.median([s.seconds for s in steady]))
        rate = float(np.median([s.frames / s.seconds for s in steady]))
        print(f"steady state: {latency * 1e3:.1f} ms per step (median of {plural(len(steady), 'step')} that "
              f"built no program), {rate:.1f} latent frames/s; {peak}", file=stream)
    else:
        print(f"steady state: none (every step built a program; run more --chunks); {peak}", file=stream)
