"""The benchmarks keep running: every CPU benchmark's ``--quick`` form ends with one strict-JSON line,
and the device-only ones refuse cleanly where the device (or libtpu) is missing.

Each benchmark runs as its own process, ``python -m benchmarks.NAME --quick`` from the repository
root, as ``README.md`` says to run them. The ``--quick`` runs are in the slow tier (each takes tens of
seconds of compilation on 2 cores); the refusals are fast.
"""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import jax
import pytest

from arkv_jax.apps import cli
from benchmarks import harness
from benchmarks.gpu_compile import POOL_DTYPES
from pallas_kernels import tpu_aot

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: Benchmarks that run on the CPU: the keys their last JSON line must have.
CPU_QUICK = {
    "kv_quantization": ("benchmark", "chunks", "errors", "mean_abs_vs_bf16", "bf16_rollout_max_abs_diff",
                        "int8_rollout_max_abs_diff", "fp8_rollout_max_abs_diff", "machine"),
    "orchestration": ("us_per_session_chunk", "us_per_chunk_by_video_length", "length_ratio_100k_vs_100",
                      "facade_us_per_session_chunk", "machine"),
    "paged_write": ("benchmark", "mode", "xla_vs_copy_ratio", "temp_bytes_fraction", "aliased_pool_fraction",
                    "cases", "int8_vs_bf16_write", "fp8_vs_bf16_write", "int8_vs_bf16_write_padded",
                    "fp8_vs_bf16_write_padded", "int8_write_aliased_pool_fraction", "machine"),
    "window_attention": ("mode", "xla_paged_ms", "dense_ms", "xla_paged_vs_dense_ratio", "max_abs_diff",
                         "int8_vs_plain_xla_ratio", "fp8_vs_plain_xla_ratio", "int8_max_abs_diff", "machine"),
    "rollout": ("benchmark", "ms_per_chunk", "paged_over_contiguous", "recompute_over_paged", "persistent_bytes",
                "peak_bytes", "paged_contiguous_max_abs_diff", "one_live_in_16_slots_vs_one_slot",
                "sixteen_live_vs_sixteen_single", "idle_slots", "converted_rollout_max_abs_diff", "machine"),
    "sharding": ("cases", "sessions", "config", "devices_share_cores", "processes", "one_process_ms_per_step",
                 "two_process_ms_per_step", "two_vs_one_process", "coordination_ms_per_step", "machine"),
    "generate": ("benchmark", "reps", "shapes", "machine"),
    "gpu_compile": ("jax", "target", "measured_on_gpu", "quick", "triton_wheel", "triton_skipped",
                    "triton_attention_pages1560", "triton_paged_write", "scatter_paged_write"),
}

#: Device-only command lines (benchmark and flags) that must refuse on a machine without the device.
DEVICE_ONLY = {
    "gpu_window_attention": ([], ["--gpu", "--quick"]),  # --quick alone: test_bench_subcommand_passes_a_refusal_on
    "window_attention": (["--gpu", "--quick"],),
    "paged_write": (["--gpu", "--quick"],),
}


def run_benchmark(name: str, *flags: str, env: dict | None = None, timeout: float = 900):
    """``python -m benchmarks.NAME FLAGS`` from the repository root."""
    return subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *flags], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ, **(env or {})))


def reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def last_json_line(proc) -> dict:
    """The last stdout line of a benchmark, parsed as strict JSON (NaN and Infinity rejected)."""
    lines = proc.stdout.strip().splitlines()
    assert lines, f"no output; stderr:\n{proc.stderr[-3000:]}"
    figures = json.loads(lines[-1], parse_constant=reject_constant)
    assert isinstance(figures, dict), lines[-1]
    return figures


def assert_refused(proc, *words: str) -> str:
    """A clean refusal: non-zero exit, one line on stderr (naming ``words``), no traceback, no JSON."""
    assert proc.returncode == harness.UNAVAILABLE, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not proc.stdout.strip().startswith("{"), proc.stdout
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def test_every_benchmark_is_covered_here():
    """A new benchmark gets a test: each one is a CPU ``--quick`` run, device-only, or a libtpu compile."""
    names = {p.stem for p in (ROOT / "benchmarks").glob("*.py")} - {"__init__", "harness"}
    assert names == set(CPU_QUICK) | {"gpu_window_attention", "tpu_compile", "pipeline_compile"}, names
    assert set(DEVICE_ONLY) <= names


def test_json_line_is_strict_json():
    line = harness.json_line({"b": float("nan"), "a": [float("inf"), 1.5, (2, -float("inf"))], "c": {"d": None}})
    assert line == '{"a": [null, 1.5, [2, null]], "b": null, "c": {"d": null}}'
    json.loads(line, parse_constant=reject_constant)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CPU_QUICK))
def test_quick_form_runs_and_ends_with_json(name):
    proc = run_benchmark(name, "--quick")
    assert proc.returncode == 0, f"exit {proc.returncode}; stderr:\n{proc.stderr[-4000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    figures = last_json_line(proc)
    missing = [key for key in CPU_QUICK[name] if key not in figures]
    assert not missing, (missing, sorted(figures))
    if name == "rollout":  # every method was timed and measured, recompute included
        assert set(figures["ms_per_chunk"]) == {"paged", "contiguous", "recompute@4", "recompute@8"}
        assert set(figures["peak_bytes"]) == set(figures["ms_per_chunk"])
        assert all(v > 0 for v in figures["peak_bytes"].values())
        assert figures["paged_contiguous_max_abs_diff"] < 1e-4
    if name == "kv_quantization":  # every pool layout measured, int8 per page within 10x bf16's error
        assert set(figures["errors"]) == {"bf16"} | {f"{d}/{g}" for d in ("int8", "float8_e4m3fn", "float8_e5m2")
                                                     for g in ("page", "token")}
        assert 0 < figures["mean_abs_vs_bf16"]["int8/page"] < 10
        assert 0 < figures["int8_rollout_max_abs_diff"] < 1e-2 and 0 < figures["bf16_rollout_max_abs_diff"] < 1e-2
        converted = figures.get("converted_diffusers")  # with torch and diffusers (the parity stack)
        if converted is not None:  # float32 pages equal full recompute; int8 within 2x the bf16 pages' error
            assert converted["fp32_rollout_vs_recompute_max_abs_diff"] < 1e-4
            assert 0 < converted["int8_rollout_max_abs_diff"] < 2 * converted["bf16_rollout_max_abs_diff"]
    if name == "sharding":  # both process jobs ran; each process of two holds half the pools, devices alike
        jobs = figures["processes"]
        assert set(jobs) == {"1x8", "2x4"}, jobs
        assert jobs["1x8"]["pool_bytes_per_process"] == 2 * jobs["2x4"]["pool_bytes_per_process"] > 0
        assert jobs["1x8"]["pool_bytes_per_device"] == jobs["2x4"]["pool_bytes_per_device"]
        assert figures["two_process_ms_per_step"] == jobs["2x4"]["ms_per_step"] > 0
    if name == "gpu_compile":
        mosaic = [entry for key, entry in figures.items() if key.startswith("mosaic_attention")]
        assert len(mosaic) == len(POOL_DTYPES) and all(e["lowered_and_verified"] for e in mosaic), figures
        assert figures["scatter_paged_write"]["scatters"] == 2
        if figures["triton_wheel"] is None:  # said once, on stderr; every Triton kernel still lowered
            assert proc.stderr.count("triton wheel is not installed") == 1, proc.stderr
            assert figures["triton_paged_write"]["num_warps"] > 0
        else:
            assert figures["triton_paged_write"]["local_bytes"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("name,flags", [(name, flags) for name, cases in DEVICE_ONLY.items() for flags in cases],
                         ids=lambda value: value if isinstance(value, str) else " ".join(value) or "no-flags")
def test_gpu_modes_refuse_cleanly_without_a_gpu(name, flags):
    line = assert_refused(run_benchmark(name, *flags, env={"JAX_PLATFORMS": "cpu"}, timeout=300), "NVIDIA GPU")
    assert f"benchmarks.{name}" in line


def test_gpu_benchmark_refuses_cleanly_where_jax_cannot_start_cuda():
    if any(importlib.util.find_spec(plugin) for plugin in ("jax_cuda12_plugin", "jax_cuda13_plugin")):
        pytest.skip("jax here has a CUDA plugin: it may start a CUDA backend")
    assert_refused(run_benchmark("gpu_window_attention", "--quick", env={"JAX_PLATFORMS": "cuda"}, timeout=300),
                   "NVIDIA GPU", "could not start")


def test_bench_subcommand_passes_a_refusal_on(monkeypatch, capsys):
    """``arkv-jax bench gpu_window_attention --quick`` without a GPU: the benchmark's one line and its
    exit status, through the command line."""
    if any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX sees a GPU here: the benchmark would run")
    monkeypatch.chdir(ROOT)
    assert cli.main(["bench", "gpu_window_attention", "--quick"]) == harness.UNAVAILABLE
    err = capsys.readouterr().err
    assert "needs an NVIDIA GPU" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.skipif(tpu_aot.libtpu_available(), reason="libtpu is installed: the quick compile runs instead")
def test_tpu_compile_refuses_without_libtpu():
    proc = run_benchmark("tpu_compile", "--quick", timeout=300)
    assert_refused(proc, "libtpu is not installed", "pip install 'arkv-jax[tpu]'")
    assert "DOES NOT COMPILE" not in proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(not tpu_aot.libtpu_available(), reason="libtpu is not installed (pip install -e '.[tpu]')")
def test_tpu_compile_quick_compiles_every_kernel():
    proc = run_benchmark("tpu_compile", "--quick", env={"JAX_PLATFORMS": "cpu"}, timeout=1800)
    assert proc.returncode == 0, f"exit {proc.returncode}; stdout:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    figures = last_json_line(proc)
    assert set(figures) == {"shape", "v5e", "v6e"}, figures
    from benchmarks.tpu_compile import ATTENTION_PRESET, QUANTIZED_RATIO_KEYS, preset_shape
    from pallas_kernels.window_attention import tpu_gather
    assert figures["shape"] == preset_shape(ATTENTION_PRESET)  # the preset's, not a hand-made shape
    for gen in ("v5e", "v6e"):
        summary = figures[gen]
        assert summary["attention_compiles"], (gen, summary)
        for key in ("attention_est_ms", "attention_xla_ms", "baseline_est_ms", "baseline_xla_ms",
                    "attention_vs_baseline", "write_pool_copies", "write_alias_fraction", "context_est_ms",
                    "context_xla_path_ms", "context_vs_xla"):
            assert summary[key] is not None, (gen, key, summary)
        # The baseline compiles under the paged kernel's scoped VMEM limit (the fair yardstick),
        # takes its raised-VMEM tiles there and copies no pool.
        assert summary["baseline_scoped_vmem_mib"] == pytest.approx(summary["attention_vmem_limit_mib"], abs=1 / 1024)
        assert summary["baseline_blocks"] == tpu_gather.RAISED_VMEM_BLOCKS[gen][1], (gen, summary)
        assert summary["baseline_pool_copies"] == 0, (gen, summary)
        assert all(f is not None and f < 0.01 for f in summary["write_temp_chunk_fraction"].values()), summary
        # Quantized pages: 8-bit DMAs, no pool copied, within 5 % of the bf16 pages' estimate.
        for kind, key in QUANTIZED_RATIO_KEYS.items():
            assert summary[f"{kind}_pool_copies"] == 0, (gen, kind, summary)
            assert 0 < summary[key] <= 1.05, (gen, key, summary)


@pytest.mark.skipif(tpu_aot.libtpu_available(), reason="libtpu is installed: the quick compile runs instead")
def test_pipeline_compile_refuses_without_libtpu():
    proc = run_benchmark("pipeline_compile", "--quick", timeout=300)
    assert_refused(proc, "libtpu is not installed", "pip install 'arkv-jax[tpu]'")


@pytest.mark.slow
@pytest.mark.skipif(not tpu_aot.libtpu_available(), reason="libtpu is not installed (pip install -e '.[tpu]')")
def test_pipeline_compile_quick_plans_both_chips():
    """The whole generator compiled for v5e and v6e at batch 1: every figure of the issue's JSON is
    there, a stream fits, the plan is within 5 % of the compiled programs and the time adds up."""
    proc = run_benchmark("pipeline_compile", "--quick", env={"JAX_PLATFORMS": "cpu"}, timeout=3000)
    assert proc.returncode == 0, f"exit {proc.returncode}; stdout:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    figures = last_json_line(proc)
    assert set(figures) == {"v5e", "v6e"}, figures
    for gen, chip in figures.items():
        assert chip["streams_per_chip"] >= 1, (gen, chip)
        assert chip["best_batch"] == 1 and chip["fps_per_chip_best_batch"] == chip["fps_single_stream"] > 0
        assert 0 < chip["dit_fraction_of_peak"] < 1 and 0 < chip["vae_share_of_chunk"] < 1, (gen, chip)
        assert chip["plan_vs_compiled_bytes"] == pytest.approx(1.0, abs=0.05), (gen, chip)
        assert chip["text_seconds"] > 0 and chip["recache_seconds"] > 0, (gen, chip)


def test_generate_wan_shape_is_the_pipeline_shape():
    """``benchmarks.generate --shape wan-1.3b`` (run on a GPU by ``device_check.sh``) times the
    generator ``arkv_jax.pipeline`` compiles: the same DiT, cache geometry, window, VAE and sampler."""
    from arkv_jax.pipeline import PIPELINES
    from benchmarks import generate

    shape, pipeline = generate.SHAPES["wan-1.3b"], PIPELINES["self-forcing"]
    assert shape.model == pipeline.dit
    assert shape.geometry() == pipeline.preset.geometry
    assert shape.window == pipeline.preset.window
    assert shape.vae == pipeline.vae
    assert shape.sampler == pipeline.sampler
    assert "wan-1.3b" not in generate.CPU_SHAPES


def test_gpu_window_attention_builds_and_traces_every_pallas_path():
    """The GPU benchmark's paths are built (and the Pallas ones traced, abstractly) on a machine
    without a GPU, so a wrong argument shows here, not in a lent GPU's minutes. The cuDNN paths need
    cuDNN to trace."""
    from benchmarks import gpu_window_attention as bench
    from benchmarks.window_attention import make_inputs

    shape = bench.wan_shape(rows=1, recent_frames=1)
    calls = bench.calls(make_inputs(shape, 1664), bench.MOSAIC_TILINGS, bench.TRITON_TILINGS)
    assert {"cudnn_dense", "cudnn_gather", "triton", "triton_int8", "cudnn_gather_fp8"} <= set(calls)
    for name, (run, args) in calls.items():
        if not name.startswith("cudnn"):
            out = jax.eval_shape(run, *args)
            assert (out.shape, out.dtype) == (args[0].shape, args[0].dtype), name


@pytest.mark.parametrize("block_size", [128, 1664])
def test_paged_write_gpu_run_fits_and_traces(block_size):
    """``paged_write --gpu`` at its device_check shape (4 rows) holds far less than an H100's 80 GB
    (its first run kept a pool copy per timed path and ran out): ``make_inputs``' bf16 pools and
    the one copy every path writes into, one pair per 8-bit dtype, the chunk and the copy's slab.
    Every write traces (abstractly, on CPU) into bf16 and int8 pools of the run's page size."""
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import paged_write as bench

    g = bench.gpu_geometry(block_size, rows=4)
    page = g["layers"] * block_size * g["kv_heads"] * g["head_dim"]  # elements of a page, all layers
    chunk = g["layers"] * g["rows"] * g["frames"] * g["tokens_per_frame"] * g["kv_heads"] * g["head_dim"]
    written_pages = g["rows"] * g["frames"] * -(-g["tokens_per_frame"] // block_size)
    held = (2 * 2 * 2 * g["num_pages"] * page + len(bench.QUANTIZED_PAGES) * 2 * g["num_pages"] * page
            + 2 * 2 * chunk + 2 * written_pages * page)
    assert held < 40e9, held
    k, v, *rest = bench.make_inputs(**dict(g, layers=1, kv_heads=1), dtype=jnp.bfloat16)
    for name, fn in bench.gpu_cases(g["tokens_per_frame"]).items():
        for pools in ((k, v), (bench.zero_pool(k.shape, jnp.int8),) * 2):
            if name == "xla_scatter" and pools[0] is not k:
                continue  # XLA's own scatter stores bf16 pages only.
            out = jax.eval_shape(fn, *pools, *rest)
            assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(tuple(pools)), name
            assert [np.shape(x) for x in jax.tree_util.tree_leaves(out)] == \
                [np.shape(x) for x in jax.tree_util.tree_leaves(pools)], name
