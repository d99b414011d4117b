"""``arkv-jax demo``: the report, the figures, the checks made before the run, and the multi-device
claim (a sharded run's latents equal the one-device run's within ``DEVICE_TOLERANCE``).

In-process runs use this process's CPU devices (``tests/conftest.py`` makes 8); the claim is checked
in subprocesses, as users run the command, where ``--devices`` creates the host devices itself.
"""

from __future__ import annotations

import io
import math
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from matplotlib.image import imread

from arkv_jax.apps import cli, demo
from arkv_jax.models import MODEL_CONFIGS
from pallas_kernels.backend import resolve_backend


@pytest.mark.slow
def test_demo_command_end_to_end(tmp_path, capsys):
    assert cli.main(["demo", "--sessions", "2", "--chunks", "5", "--out", str(tmp_path), "--check",
                     "--seed", "3"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    assert lines[0].startswith("arkv-jax demo: 2 sessions x 5 chunks of 2 frames, preset tiny, 3 denoise steps")
    assert lines[-1].startswith("checksum: ") and np.isfinite(float(lines[-1].split()[1]))
    diff = [line for line in lines if line.startswith("max_abs_diff:")]
    assert len(diff) == 1 and float(diff[0].split()[1]) < 1e-4
    assert not any(line.startswith(("one-device checksum", "devices_max_abs_diff")) for line in lines)
    # The pool is counted one way everywhere: usable pages.
    usable = int(re.match(r"pool: (\d+) usable pages \(\+1 null page\)", lines[1]).group(1))
    rows = [line for line in lines if re.match(r"\s+\d+\s+\d+\s+\d+\.\.\d+", line)]
    assert len(rows) == 5 + 2 - 1 and all(row.endswith(f"/{usable}") for row in rows)
    assert [line for line in lines if line.startswith("steady state:")][0].endswith(f"/{usable} usable pages")
    assert captured.err == ""  # no progress bar: the streams are not terminals
    for name in ("pages.png", "memory.png", "latency.png"):
        image = imread(tmp_path / name)
        assert image.ndim == 3 and min(image.shape[:2]) > 200, name


def test_demo_cli_offers_every_model_config():
    parser = cli.build_parser()
    for name in MODEL_CONFIGS:
        assert parser.parse_args(["demo", "--preset", name]).preset == name
    with pytest.raises(SystemExit):
        parser.parse_args(["demo", "--preset", "lingbot-v2"])  # a cache preset without a model


def test_plurals():
    assert [demo.plural(n, "session") for n in (0, 1, 2)] == ["0 sessions", "1 session", "2 sessions"]


def timeline_of(num_pages, shards, held_per_step, seconds=None, compile_seconds=None):
    timeline = demo.Timeline(num_pages=num_pages, usable_pages=num_pages - shards, chunk_frames=2)
    seconds = seconds or [0.01] * len(held_per_step)
    compile_seconds = compile_seconds or [0.0] * len(held_per_step)
    for step, held in enumerate(held_per_step):
        sessions = tuple(held)
        timeline.steps.append(demo.StepRecord(sessions, (2 * step,) * len(sessions), seconds[step],
                                              compile_seconds[step], 2 * len(sessions),
                                              sum(len(p) for p in held.values()), held))
    return timeline


def test_page_map_shows_which_session_holds_each_page():
    timeline = timeline_of(12, 2, [{"a": np.array([1, 2])},
                                   {"a": np.array([1, 2, 3]), "b": np.array([7, 8])},
                                   {"b": np.array([7, 9])}])
    owners = np.full((12, 3), 0)
    owners[[0, 6]] = -1  # the two shards' null pages
    owners[[1, 2], 0] = 1
    owners[[1, 2, 3], 1] = 1
    owners[[7, 8], 1] = 2
    owners[[7, 9], 2] = 2
    np.testing.assert_array_equal(timeline.page_owners(), owners)
    image = demo.page_map_figure(timeline).axes[0].images[0]
    np.testing.assert_array_equal(image.get_array(), owners)


def test_page_map_of_a_large_pool_stays_small():
    timeline = timeline_of(5001, 1, [{"s0": np.arange(1, 41) + 40 * step, "s1": np.arange(4900, 5000)}
                                     for step in range(3)])
    figure = demo.page_map_figure(timeline)
    width, height = figure.get_size_inches() * figure.dpi
    assert width <= 800 and height <= 600
    assert figure.axes[0].images[0].get_array().shape == (5001, 3)


def test_memory_and_latency_figures_plot_the_timeline():
    timeline = timeline_of(40, 1, [{"a": np.arange(1, 5)}, {"a": np.arange(1, 9), "b": np.arange(9, 13)}])
    per_session, pool = demo.memory_figure(timeline, bound=8).axes
    a = per_session.lines[0]
    assert a.get_label() == "a" and list(a.get_xdata()) == [0, 2, 4] and list(a.get_ydata()) == [0, 4, 8]
    assert list(pool.lines[0].get_ydata()) == [4, 12]
    bars = demo.latency_figure(timeline).axes[0].patches
    assert [bar.get_height() for bar in bars] == pytest.approx([10.0, 10.0])


def test_steps_that_compiled_are_named_and_kept_out_of_the_steady_state_in_text_and_figure():
    held = [{"a": np.arange(1, 3)}, {"a": np.arange(1, 3), "b": np.arange(3, 5)}] + [{"a": np.arange(1, 3)}] * 3
    timeline = timeline_of(40, 1, held, seconds=[2.0, 1.5, 0.010, 0.030, 0.020],
                           compile_seconds=[1.9, 1.4, 0.0, 0.0, 0.0])
    assert timeline.compile_step_indexes() == [0, 1]
    out = io.StringIO()
    demo._print_report(out, timeline)
    text = out.getvalue()
    assert "steps 0, 1 built programs (a first use), 3.30 s of compilation" in text
    assert "steady state: 20.0 ms per step (median of 3 steps that built no program)" in text
    ax = demo.latency_figure(timeline).axes[0]
    median = [line for line in ax.lines if line.get_label().startswith("steady-state median")]
    assert len(median) == 1 and median[0].get_ydata()[0] == pytest.approx(20.0)
    assert "20.0 ms" in median[0].get_label()
    colors = [bar.get_facecolor() for bar in ax.patches]
    assert colors[0] == colors[1] != colors[2] == colors[3] == colors[4]


def test_a_run_where_every_step_compiles_says_there_is_no_steady_state():
    timeline = timeline_of(40, 1, [{"a": np.arange(1, 3)}], seconds=[2.0], compile_seconds=[1.9])
    out = io.StringIO()
    demo._print_report(out, timeline)
    assert "steady state: none (every step built a program; run more --chunks)" in out.getvalue()
    labels = [line.get_label() for line in demo.latency_figure(timeline).axes[0].lines]
    assert not any(label.startswith("steady-state median") for label in labels)


@pytest.mark.slow
def test_the_compile_clock_sees_the_first_use_of_each_program_only(tmp_path):
    result = demo.run_demo(sessions=3, chunks=3, out=tmp_path, stdout=io.StringIO())
    steps = result.timeline.steps
    batch_sizes = [len(step.sessions) for step in steps]
    first_use = [i for i, size in enumerate(batch_sizes) if size not in batch_sizes[:i]]
    # A session leaves in the events of the step after its last chunk: it is gone from that step.
    leaves = [i for i in range(1, len(steps)) if set(steps[i - 1].sessions) - set(steps[i].sessions)]
    assert batch_sizes == [1, 2, 3, 2, 1] and first_use == [0, 1, 2] and leaves == [3, 4]
    assert result.timeline.compile_step_indexes() == first_use + leaves[:1]


class Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.slow
def test_the_progress_bar_shows_on_terminals_only(tmp_path):
    out, err = Terminal(), Terminal()
    demo.run_demo(sessions=1, chunks=1, out=tmp_path, stdout=out, stderr=err)
    assert "1/1" in err.getvalue() and "pool" in err.getvalue()
    assert out.getvalue().startswith("arkv-jax demo: 1 session x 1 chunk of 2 frames")


@pytest.mark.parametrize("flags,message", [
    (["--out", "{file}/figures"], "--out '{file}/figures': cannot create or write the figures' folder"),
    (["--out", "{file}"], "--out '{file}': cannot create or write the figures' folder"),
    (["--backend", "pallas_gpu"], "--backend pallas_gpu: the compiled kernel needs an NVIDIA GPU, and this "
                                  "run's devices are {platform}; use --backend xla (runs everywhere) or --backend "
                                  "pallas_gpu_interpret"),
    (["--backend", "pallas_tpu"], "--backend pallas_tpu: the compiled kernel needs a TPU"),
], ids=["out_below_a_file", "out_is_a_file", "pallas_gpu_on_cpu", "pallas_tpu_on_cpu"])
def test_demo_refuses_before_the_run(flags, message, tmp_path, capsys):
    if flags[0] == "--backend" and resolve_backend(flags[1]).runs_on(jax.devices()[0].platform):
        pytest.skip(f"{flags[1]} runs on this machine's devices (the registry's Backend.runs_on)")
    file = tmp_path / "a_file"
    file.write_text("")
    flags = [f.format(file=file) for f in flags]
    if "--out" not in flags:
        flags += ["--out", str(tmp_path / "figures")]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", *flags])
    captured = capsys.readouterr()
    assert exit_info.value.code == 2
    assert message.format(file=file, platform=jax.devices()[0].platform) in captured.err
    assert captured.out == ""  # nothing ran


@pytest.mark.slow
def test_check_exits_1_when_the_devices_disagree_beyond_the_bound(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(demo.DEVICE_TOLERANCE, "float32", -1.0)  # any difference, even 0, exceeds it
    assert cli.main(["demo", "--devices", "2", "--sessions", "1", "--chunks", "1", "--check",
                     "--out", str(tmp_path)]) == 1
    assert "2 devices vs one device, largest latent difference; bound -1e+00: EXCEEDED" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------
# The multi-device claim, as users run the command (subprocesses).


def run_demo_cli(*args, tmp_path):
    return subprocess.run([sys.executable, "-m", "arkv_jax.apps.cli", "demo", "--sessions", "2", "--out", str(tmp_path),
                           *args], capture_output=True, text=True, timeout=600)


def value(stdout: str, label: str) -> str:
    (line,) = [line for line in stdout.splitlines() if line.startswith(label)]
    return line[len(label):].split()[0]


@pytest.mark.slow
@pytest.mark.parametrize("chunks,mesh", [(1, ("--devices", "8")), (3, ("--devices", "8", "--model-axis", "2")),
                                         (6, ("--devices", "8"))], ids=["1_chunk", "3_chunks_tp", "6_chunks"])
def test_sharded_demo_equals_the_one_device_demo_within_the_stated_bound(chunks, mesh, tmp_path):
    """``--devices 8 --check`` prints the checksum ``arkv-jax demo`` prints on one device, and its own
    latents are within ``DEVICE_TOLERANCE`` of those (so its checksum is within that times the number
    of latents, plus the last printed digit)."""
    one = run_demo_cli("--chunks", str(chunks), tmp_path=tmp_path / "one")
    sharded = run_demo_cli("--chunks", str(chunks), "--check", *mesh, tmp_path=tmp_path / "sharded")
    for run in (one, sharded):
        assert run.returncode == 0, run.stderr[-2000:]
        assert run.stderr == ""  # no progress bar in a pipe
    data, model = (8, 1) if "--model-axis" not in mesh else (4, 2)
    assert f"mesh: data={data} x model={model} over 8 cpu devices" in sharded.stdout
    one_checksum = one.stdout.strip().splitlines()[-1]
    assert one_checksum.startswith("checksum: ")
    assert value(sharded.stdout, "one-device checksum:") == one_checksum.split()[1]
    difference = float(value(sharded.stdout, "devices_max_abs_diff:"))
    tolerance = demo.DEVICE_TOLERANCE["float32"]
    assert difference <= tolerance and "bound 1e-05: ok" in sharded.stdout
    checksum, expected = float(value(sharded.stdout, "checksum:")), float(one_checksum.split()[1])
    latents = 2 * chunks * 2 * math.prod(MODEL_CONFIGS["tiny"].frame_shape)
    assert abs(checksum - expected) <= latents * tolerance + 10 ** (math.floor(math.log10(abs(expected))) - 6)


@pytest.mark.slow
def test_demo_cli_refuses_a_mesh_the_model_cannot_use(tmp_path):
    result = run_demo_cli("--devices", "8", "--model-axis", "8", tmp_path=tmp_path)
    assert result.returncode == 2 and "kv_heads=2 must be divisible" in result.stderr
    result = run_demo_cli("--devices", "6", "--model-axis", "4", tmp_path=tmp_path)
    assert result.returncode == 2 and "multiple of model_axis=4" in result.stderr


def test_a_demo_the_device_cannot_hold_is_refused_up_front_with_the_estimate(monkeypatch, tmp_path):
    estimate = demo.memory_estimate("tiny", 2, "xla", "cpu")
    assert estimate["total"] == estimate["weights"] + estimate["pools"] + estimate["attention_logits"] > 0
    monkeypatch.setattr(demo, "device_free_bytes", lambda device=None: estimate["total"] - 1)
    with pytest.raises(ValueError, match=r"--preset tiny with 2 sessions needs about .* free; run it on an "):
        demo.run_demo(sessions=2, chunks=1, out=tmp_path / "out", backend="xla")
    assert not (tmp_path / "out" / "pages.png").exists()


def test_wan_demo_estimate_counts_its_weights_pools_and_logits():
    estimate = demo.memory_estimate("wan-1.3b", 4, "xla", "cpu")
    # The XLA path's logits tile, not the whole [rows, heads, q, k] logits (tens of GiB here).
    assert estimate["weights"] > 2 << 30 and 64 << 20 <= estimate["attention_logits"] < 4 << 30
    assert demo.memory_estimate("wan-1.3b", 4, "pallas_tpu", "tpu")["attention_logits"] == 0


def test_wan_demo_estimate_with_int8_pages_halves_the_pools():
    bf16, int8 = (demo.memory_estimate("wan-1.3b", 4, "xla", "cpu", kv_dtype) for kv_dtype in (None, "int8"))
    geometry = demo.demo_geometry("wan-1.3b", "int8")
    assert geometry.kv_dtype == "int8" and demo.demo_geometry("wan-1.3b").kv_dtype is None
    assert int8["weights"] == bf16["weights"] and int8["attention_logits"] == bf16["attention_logits"]
    assert bf16["pools"] / 2 < int8["pools"] < bf16["pools"] / 2 * 1.001  # half, plus the scales


@pytest.mark.slow
def test_demo_with_int8_pages_runs_and_stays_close_to_the_recompute(tmp_path, capsys):
    assert cli.main(["demo", "--sessions", "2", "--chunks", "4", "--out", str(tmp_path), "--check",
                     "--kv-dtype", "int8", "--backend", "xla"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    diff = float([line for line in lines if line.startswith("max_abs_diff:")][0].split()[1])
    assert 0 < diff < 1e-2  # quantized pages (the float32 pool gives < 1e-4), close to the float32 reference
