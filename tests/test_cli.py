"""The ``arkv-jax`` command line: ``plan`` answers, flags and refusals (``demo`` is in test_demo.py)."""

import json
import re

import pytest

from arkv_jax.apps import cli


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    return code, capsys.readouterr().out


def test_cli_plan_lingbot_json(capsys):
    code, out = run_cli(capsys, "plan", "--preset", "lingbot-v2", "--memory", "100GiB", "--fraction", "0.1", "--json")
    plan = json.loads(out)
    assert code == 0
    assert plan["memory_budget_bytes"] == 33_653_670_400 and plan["session_capacity"] == 1
    _, out = run_cli(capsys, "plan", "--preset", "lingbot-v2", "--memory", "100GiB", "--fraction", "0.6", "--json")
    plan = json.loads(out)
    assert plan["memory_budget_bytes"] == 64_424_509_440 and plan["session_capacity"] == 2
    for key in ("session_capacity", "requested_session_capacity", "memory_budget_bytes",
                "configured_memory_budget_bytes", "managed_num_blocks", "num_blocks_total",
                "scratch_blocks_per_kv_branch", "scratch_num_blocks", "cross_attention_bytes_per_session",
                "cross_attention_reserved_bytes", "model_owned_state_reserved_bytes", "scratch_reserved_bytes"):
        assert key in plan


def test_cli_plan_flags_override_the_preset(capsys):
    _, out = run_cli(capsys, "plan", "--preset", "tiny", "--layers", "4", "--block-size", "24",
                     "--branches", "main", "--cross", "none", "--memory", "1GiB", "--sessions", "3", "--json")
    plan = json.loads(out)
    assert plan["geometry"]["num_layers"] == 4 and plan["geometry"]["block_size"] == 24
    assert plan["kv_branches"] == [{"name": "main", "local_index": 0}]
    assert plan["cross_attention"] == [] and plan["session_capacity"] == 3


def test_cli_plan_kv_dtype_counts_quantized_pages(capsys):
    def plan(*flags):
        code, out = run_cli(capsys, "plan", "--preset", "wan-1.3b", "--memory", "tpu-v5e", "--fraction", "1",
                            "--cross", "none", *flags, "--json")
        assert code == 0
        return json.loads(out)

    bf16, int8 = plan(), plan("--kv-dtype", "int8")
    assert int8["geometry"]["kv_dtype"] == "int8" and bf16["geometry"]["kv_dtype"] is None
    assert int8["page_size_bytes"] == bf16["page_size_bytes"] // 2 + 2 * 30 * 12 * 4
    assert (bf16["budget_session_capacity"], int8["budget_session_capacity"]) == (4, 9)
    _, out = run_cli(capsys, "plan", "--preset", "wan-1.3b", "--memory", "tpu-v5e", "--kv-dtype", "float8_e4m3fn")
    assert "(bfloat16; pages float8_e4m3fn + float32 scales)" in out
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["plan", "--kv-dtype", "int4"])
    assert exit_info.value.code == 2
    assert "--kv-dtype: invalid choice: 'int4'" in capsys.readouterr().err


def test_cli_plan_summary_with_chip_name(capsys):
    code, out = run_cli(capsys, "plan", "--preset", "wan-1.3b", "--memory", "h100-80gb")
    assert code == 0 and "arkv-jax memory plan" in out and "sessions granted / requested" in out


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--memory", "12XB"], "memory must be a size"),
        (["--fraction", "0"], "must be in (0, 1], got 0.0"),
        (["--fraction", "x"], "must be a number in (0, 1]"),
        (["--layers", "0"], "--layers must be positive, got 0"),
        (["--preset", "nope"], "invalid choice"),
        (["--branches", "a:1"], "contiguous from zero, got [1]"),
        (["--cross", "text:zero"], "must look like 'text:512'"),
        (["--memory", "1KiB"], "cannot fit one session"),
        (["--dtype", "int4"], "dtype must be one of"),
    ],
)
def test_cli_plan_bad_flags_exit_2_with_a_clear_message(capsys, argv, needle):
    with pytest.raises(SystemExit) as info:
        cli.main(["plan", *argv])
    assert info.value.code == 2
    assert needle in capsys.readouterr().err


def test_cli_plan_reports_the_fraction_in_use_and_an_unmet_request(capsys):
    code, out = run_cli(capsys, "plan", "--preset", "tiny", "--memory", "1GiB", "--sessions", "1000")
    assert code == 0
    assert "memory fraction in use: 0.1 (default 0.1, vLLM-Omni's gpu_memory_fraction" in out
    assert re.search(r"sessions granted / requested +398 / 1000 \(request not met", out)
    assert re.search(r"most sessions the budget holds +398", out)
    assert "note: 1000 sessions requested, 398 granted; the budget holds at most 398" in out
    _, out = run_cli(capsys, "plan", "--preset", "tiny", "--memory", "1GiB", "--sessions", "4", "--fraction", "0.5")
    assert "memory fraction in use: 0.5 (--fraction 0.5)" in out and "note:" not in out


def test_cli_plan_json_holds_the_budget_capacity(capsys):
    _, out = run_cli(capsys, "plan", "--preset", "tiny", "--memory", "1GiB", "--sessions", "4", "--json")
    plan = json.loads(out)
    assert plan["session_capacity"] == 4 and plan["budget_session_capacity"] == 398


@pytest.mark.parametrize("argv", [["--memory", "-5GiB"], ["--memory=-5GiB"]])
def test_cli_negative_sizes_give_the_size_error_however_written(capsys, argv):
    with pytest.raises(SystemExit) as info:
        cli.main(["plan", *argv])
    assert info.value.code == 2 and "memory must be positive, got '-5GiB'" in capsys.readouterr().err


def test_cli_model_owned_bytes_takes_sizes(capsys):
    _, small = run_cli(capsys, "plan", "--preset", "tiny", "--memory", "1GiB", "--json", "--model-owned-bytes", "0")
    _, big = run_cli(capsys, "plan", "--preset", "tiny", "--memory", "1GiB", "--json", "--model-owned-bytes", "1MiB")
    assert json.loads(small)["model_owned_state_bytes_per_session"] == 0
    assert json.loads(big)["model_owned_state_bytes_per_session"] == 1 << 20


def test_cli_errors_name_the_flag_not_the_field(capsys):
    with pytest.raises(SystemExit):
        cli.main(["plan", "--sessions", "0", "--memory", "1GiB"])
    err = capsys.readouterr().err
    assert "--sessions" in err and "session_capacity" not in err


def test_cli_version(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.startswith("arkv-jax ")


def test_cli_bench_runs_a_checkout_benchmark_and_refuses_elsewhere(capsys, monkeypatch, tmp_path):
    root = __import__("pathlib").Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", "nope"])
    assert info.value.code == 2 and "choose from" in capsys.readouterr().err
    assert cli.main(["bench", "orchestration", "--help"]) == 0
    assert "--quick" in capsys.readouterr().out
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", "orchestration"])
    assert info.value.code == 2 and "no benchmarks/ folder" in capsys.readouterr().err


@pytest.mark.parametrize("argv, usage, needle", [
    (["plan", "--sessions", "0", "--memory", "1GiB"], "usage: arkv-jax plan", "--sessions must be positive, got 0"),
    (["generate", "--random-tiny", "--frames", "5"], "usage: arkv-jax generate", "--frames 5"),
    (["generate", "--random-tiny", "--prompt-at", "0:foo"], "usage: arkv-jax generate", "(1, 2, ..."),
    (["bench"], "usage: arkv-jax bench", "name a benchmark: one of "),
    (["bench", "nope"], "usage: arkv-jax bench", "unknown benchmark 'nope'"),
])
def test_errors_found_after_parsing_print_the_subcommands_usage(capsys, monkeypatch, argv, usage, needle):
    monkeypatch.chdir(cli.pathlib.Path(__file__).resolve().parents[1])  # bench runs a checkout's benchmarks
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith(usage) and needle in err
    assert "the following arguments are required" not in err


def test_bench_help_lists_every_benchmark_of_the_checkout(capsys, monkeypatch):
    root = cli.pathlib.Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    out = capsys.readouterr().out
    names = sorted(p.stem for p in (root / "benchmarks").glob("*.py") if p.stem not in ("__init__", "harness"))
    assert len(names) >= 9
    for name in names:
        assert re.search(rf"^  {name} +\S", out, re.MULTILINE), name


def test_plan_help_states_the_sessions_default_of_each_preset(capsys):
    from arkv_jax.presets import PRESETS

    with pytest.raises(SystemExit):
        cli.main(["plan", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for name, preset in PRESETS.items():
        assert f"{name} {preset.session_capacity}" in out


def test_plan_without_memory_says_what_it_probed(capsys):
    code, out = run_cli(capsys, "plan", "--preset", "tiny")
    assert code == 0
    assert re.search(r"^available memory: .*GiB .*, probed from the host's available RAM \(cpu devices report no "
                     r"memory statistics\)", out, re.MULTILINE)
    _, out = run_cli(capsys, "plan", "--preset", "tiny", "--json")
    json.loads(out)  # still one JSON object


def test_an_environment_override_that_is_not_an_integer_is_named(capsys, monkeypatch):
    monkeypatch.setenv("AR_DIFFUSION_KV_SCRATCH_BLOCKS_PER_BRANCH", "abc")
    with pytest.raises(SystemExit) as info:
        cli.main(["plan", "--preset", "tiny", "--memory", "1GiB"])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert "AR_DIFFUSION_KV_SCRATCH_BLOCKS_PER_BRANCH='abc' is not an integer" in err


def test_bench_prints_the_message_of_a_benchmark_that_exits_with_one(capsys, monkeypatch, tmp_path):
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "__init__.py").write_text("")
    (tmp_path / "benchmarks" / "harness.py").write_text("")
    script = '"""Exits with a message."""\nimport sys\nsys.exit("no device here")\n'
    (tmp_path / "benchmarks" / "quits.py").write_text(script)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(__import__("sys").modules, "benchmarks", raising=False)
    assert cli.main(["bench", "quits"]) == 1
    assert capsys.readouterr().err.strip() == "no device here"


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--pipeline", "--memory", "h100-80gb"], "--pipeline needs --memory naming a TPU chip"),
        (["--pipeline", "--memory", "16GiB"], "--pipeline needs --memory naming a TPU chip"),
        (["--pipeline", "--preset", "lingbot-v2", "--memory", "tpu-v5e"], "is the wan-1.3b model"),
        (["--pipeline", "nope", "--memory", "tpu-v5e"], "invalid choice"),
        (["--pipeline", "--memory", "tpu-v5e", "--buckets", "1,0"], "must be positive integers"),
    ],
)
def test_plan_pipeline_refusals(capsys, argv, needle):
    with pytest.raises(SystemExit) as info:
        cli.main(["plan", *argv])
    assert info.value.code == 2
    assert needle in capsys.readouterr().err


def test_plan_pipeline_plans_the_chip_the_memory_names(capsys, monkeypatch):
    """``plan --pipeline`` hands ``plan_chip`` the pipeline (with the flags' guidance and text
    placement), the chip ``--memory`` names, the buckets and a kernel pricer, and prints the plan."""
    from arkv_jax import pipeline
    from pallas_kernels import tpu_aot

    seen = {}

    class Plan:
        def summary(self):
            return "whole-chip summary"

        def to_json(self):
            return '{"streams_per_chip": 3}'

    def plan_chip(chosen, generation, **kwargs):
        seen.update(chosen=chosen, generation=generation, **kwargs)
        return Plan()

    monkeypatch.setattr(pipeline, "plan_chip", plan_chip)
    monkeypatch.setattr(tpu_aot, "libtpu_available", lambda: True)
    code, out = run_cli(capsys, "plan", "--pipeline", "causvid", "--memory", "tpu-v6e", "--buckets", "1,2",
                        "--guidance", "4", "--text-on-device")
    assert code == 0 and out.strip() == "whole-chip summary"
    assert seen["generation"] == "v6e" and seen["buckets"] == (1, 2)
    assert seen["memory_bytes"] is None  # the HBM the compiler lets a program use
    assert seen["chosen"].sampler.guidance_scale == 4.0 and seen["chosen"].text_on_device
    assert seen["chosen"].sampler.num_steps == pipeline.PIPELINES["causvid"].sampler.num_steps
    assert callable(seen["kernel_seconds"])
    code, out = run_cli(capsys, "plan", "--pipeline", "--memory", "tpu-v5e", "--json")
    assert json.loads(out) == {"streams_per_chip": 3} and seen["generation"] == "v5e"


def test_plan_pipeline_without_libtpu_says_how_to_get_it(capsys, monkeypatch):
    from pallas_kernels import tpu_aot

    monkeypatch.setattr(tpu_aot, "libtpu_available", lambda: False)
    with pytest.raises(SystemExit):
        cli.main(["plan", "--pipeline", "--memory", "tpu-v5e"])
    assert "pip install 'arkv-jax[tpu]'" in capsys.readouterr().err


def test_cli_plan_mesh_reports_pool_bytes_per_device_and_per_process(capsys):
    base = ["plan", "--preset", "wan-1.3b", "--memory", "tpu-v5e", "--fraction", "0.9", "--sessions", "8",
            "--mesh", "4x2"]
    _, out = run_cli(capsys, *base, "--processes", "2", "--json")
    plan = json.loads(out)
    assert (plan["processes"], plan["data_shards_per_process"], plan["devices_per_process"]) == (2, 2, 4)
    assert plan["pool_bytes_per_process"] == 4 * plan["pool_bytes_per_device"] > 0
    assert plan["sessions_per_process"] == 4
    _, out = run_cli(capsys, *base, "--json")  # one process by default: it holds the whole mesh
    assert json.loads(out)["pool_bytes_per_process"] == 8 * plan["pool_bytes_per_device"]
    code, out = run_cli(capsys, *base, "--processes", "2")
    assert code == 0
    assert re.search(r"per process \(2 processes, each 2 data shards x 2 = 4 devices\): pools [\d.]+ GiB "
                     r"\(" + f"{plan['pool_bytes_per_process']:,}" + r" B\)", out), out


@pytest.mark.parametrize("argv, needle", [
    (["--mesh", "4x2", "--processes", "3"],
     "--processes must be a positive int dividing the mesh axis 'data' of size 4, one of [1, 2, 4]"),
    (["--mesh", "4x2", "--processes", "0"], "argument --processes: must be a positive integer, got 0"),
    (["--processes", "2"], "--processes 2 needs --mesh DATAxMODEL"),
])
def test_cli_plan_refuses_a_process_count_that_does_not_split_the_mesh(capsys, argv, needle):
    with pytest.raises(SystemExit) as info:
        cli.main(["plan", "--preset", "wan-1.3b", "--memory", "tpu-v5e", *argv])
    assert info.value.code == 2
    assert needle in capsys.readouterr().err
