"""``arkv-jax generate``: the tiny random path writes playable mp4s (read back with imageio: frame
count and size), several sessions and a prompt switch, and the refusals before the run (exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from arkv_jax.apps import cli, generate
from pallas_kernels.backend import resolve_backend

imageio = pytest.importorskip("imageio")
pytest.importorskip("imageio_ffmpeg")

# imageio's reader starts ffmpeg with subprocess (fork + exec), which JAX's fork hook warns about.
pytestmark = pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")


def read_video(path) -> np.ndarray:
    with imageio.get_reader(str(path), format="FFMPEG") as reader:
        return np.stack([frame for frame in reader.iter_data()])  # list(reader) trusts len(): inf


@pytest.mark.slow
def test_random_tiny_writes_a_playable_mp4(tmp_path):
    """As CI runs it: a subprocess, the console entry point's module."""
    out = tmp_path / "x.mp4"
    proc = subprocess.run([sys.executable, "-m", "arkv_jax.apps.cli", "generate", "--random-tiny", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    video = read_video(out)
    # 6 latent frames (3 chunks of 2) -> 1 + 4 * 5 video frames of 8 x (8, 12) latent pixels.
    assert video.shape == (21, 64, 96, 3) and video.dtype == np.uint8
    assert video.std() > 1.0  # not a blank video
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("arkv-jax generate: 1 session x 6 latent frames (3 chunks of 2) -> 21 video frames")
    assert "arkv-jax memory plan" in proc.stdout and "sessions granted / requested" in proc.stdout
    # 3 chunks: 0 and 1 build programs (the DiT's chunk, the VAE's first and later chunks), 2 is steady.
    assert any(line.startswith("compilation: ") and "in chunks 0, 1 (the first use of each program)" in line
               for line in lines)
    assert any(line.startswith("text: the hash stand-in (no encoder), the joins' text K/V") for line in lines)
    assert any(line.startswith("steady state (1 chunk that built no program and switched no prompt): ")
               and "% of DiT + VAE" in line for line in lines)
    assert lines[-1].startswith(f"wrote {out} (21 frames, 64x96, 16 fps")
    assert "os.fork" not in proc.stderr and "generate:" not in proc.stderr  # no warning, no bar off a terminal


@pytest.mark.slow
def test_sessions_and_prompt_switch_in_process(tmp_path, capsys):
    assert cli.main(["generate", "--random-tiny", "--sessions", "2", "--frames", "4", "--prompt", "a red fox",
                     "--prompt", "waves on a shore", "--prompt-at", "1:a city at night", "--out",
                     str(tmp_path / "v.mp4"), "--seed", "5"]) == 0
    out = capsys.readouterr().out
    assert "chunk 1: 'a city at night'" in out and "KV recache, sink keep" in out
    assert "prompt switches (KV recache and text K/V, compilation excluded): chunk 1 " in out
    assert "steady state: none in this run (every chunk built a program or switched a prompt" in out
    videos = [read_video(tmp_path / f"v_session{i}.mp4") for i in range(2)]
    assert all(v.shape == (13, 64, 96, 3) for v in videos)
    assert not np.array_equal(videos[0], videos[1])  # different prompts and seeds


@pytest.mark.slow
def test_prompt_switch_changes_only_later_chunks(tmp_path):
    common = dict(prompts=["a red fox"], random_tiny=True, frames=6, seed=1, stdout=open("/dev/null", "w"))
    plain = generate.run_generate(out=tmp_path / "a.mp4", **common)
    switched = generate.run_generate(out=tmp_path / "b.mp4", prompt_at={2: "a cat"}, **common)
    a, b = plain.latents["s0"], switched.latents["s0"]
    np.testing.assert_array_equal(a[:4], b[:4])  # chunks 0 and 1 as before the switch
    assert not np.allclose(a[4:], b[4:])


@pytest.mark.slow
def test_int8_pages_stay_close_to_the_models_dtype(tmp_path):
    """``--kv-dtype int8`` changes only the pages' storage: the latents move by the quantization
    error alone (the tiny model in float32; measured max 1.1e-3 here)."""
    common = dict(prompts=["a red fox"], random_tiny=True, frames=6, seed=1, stdout=open("/dev/null", "w"))
    plain = generate.run_generate(out=tmp_path / "a.mp4", **common).latents["s0"]
    int8 = generate.run_generate(out=tmp_path / "b.mp4", kv_dtype="int8", **common).latents["s0"]
    diff = np.abs(int8.astype(np.float64) - plain)
    assert 0 < diff.max() < 1e-2


def test_output_paths(tmp_path):
    assert generate.output_paths("v.mp4", 1) == [generate.pathlib.Path("v.mp4")]
    assert [p.name for p in generate.output_paths("d/v.mp4", 2)] == ["v_session0.mp4", "v_session1.mp4"]
    assert generate.output_paths(tmp_path, 2) == [tmp_path / "session0.mp4", tmp_path / "session1.mp4"]


@pytest.mark.parametrize("argv, message", [
    (["--random-tiny", "--frames", "5"], "--frames 5: must be a positive multiple of the 2 latent frames"),
    (["--random-tiny", "--prompt-at", "3:x"], "--prompt-at chunk 3: switches happen before chunks 1..2"),
    (["--random-tiny", "--prompt-at", "0:x"], "CHUNK the chunk to switch before (1, 2, ...; chunk 0's prompt"),
    (["--random-tiny", "--guidance", "inf"], "--guidance must be a positive finite number, got inf"),
    (["--random-tiny", "--guidance", "nan"], "--guidance must be a positive finite number, got nan"),
    (["--random-tiny", "--guidance", "0"], "--guidance must be a positive finite number, got 0.0"),
    (["--random-tiny", "--backend", "pallas_gpu"], "--backend pallas_gpu: the compiled kernel needs an NVIDIA GPU"),
    (["--random-tiny", "--backend", "pallas_tpu_gather"], "the compiled kernel needs a TPU"),
    (["--random-tiny", "--prompt-at", "one:x"], "must look like CHUNK:TEXT"),
    (["--random-tiny", "--kv-dtype", "int4"], "argument --kv-dtype: invalid choice: 'int4'"),
    (["--random-tiny", "--generator", "g.pt"], "--generator needs --checkpoint"),
    (["--random-tiny", "--checkpoint", "."], "not allowed with argument"),
    ([], "one of the arguments --checkpoint --random-tiny is required"),
])
def test_refusals(tmp_path, capsys, argv, message):
    if "--backend" in argv and resolve_backend(argv[argv.index("--backend") + 1]).runs_on(
            jax.devices()[0].platform):
        pytest.skip("the backend runs on this machine's devices (the registry's Backend.runs_on)")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", *argv, "--out", str(tmp_path / "x.mp4")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert err.startswith("usage: arkv-jax generate")  # the subcommand's usage, not the top level's
    assert not (tmp_path / "x.mp4").exists() and list(tmp_path.iterdir()) == []


def test_an_out_name_too_long_for_the_file_system_is_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "--random-tiny", "--out", str(tmp_path / ("x" * 300 + ".mp4"))])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--out: cannot" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(resolve_backend("pallas_gpu").runs_on(jax.devices()[0].platform),
                    reason="pallas_gpu runs on this machine's devices (the registry's Backend.runs_on)")
def test_a_backend_for_another_platform_is_refused_before_the_checkpoint_loads(tmp_path, capsys, monkeypatch):
    root = make_checkpoint(tmp_path / "ckpt")

    def no_loading(*args, **kwargs):
        raise AssertionError("the checkpoint was loaded before the backend was checked")

    monkeypatch.setattr(generate, "load_pipeline", no_loading)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "--checkpoint", str(root), "--prompt", "x", "--backend", "pallas_gpu",
                  "--out", str(tmp_path / "x.mp4")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "the compiled kernel needs an NVIDIA GPU" in err
    assert not (tmp_path / "x.mp4").exists()


def test_unwritable_out_is_refused_before_the_run(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "--random-tiny", "--out", str(tmp_path / "file" / "x.mp4")])
    assert exit_info.value.code == 2 and "--out: cannot write" in capsys.readouterr().err


def test_missing_checkpoint_files_are_named(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "--checkpoint", str(tmp_path / "nope"), "--prompt", "x"])
    assert exit_info.value.code == 2 and "no such directory" in capsys.readouterr().err
    (tmp_path / "Wan2.1_VAE.pth").write_bytes(b"")
    with pytest.raises(SystemExit):
        cli.main(["generate", "--checkpoint", str(tmp_path), "--prompt", "x", "--out", str(tmp_path / "x.mp4")])
    err = capsys.readouterr().err
    for expected in ("diffusion_pytorch_model.safetensors (the DiT's weights", "models_t5_umt5-xxl-enc-bf16.pth",
                     "google/umt5-xxl (the umT5 tokenizer folder"):
        assert expected in err
    assert "Wan2.1_VAE.pth (" not in err  # present, so not listed
    with pytest.raises(SystemExit):
        cli.main(["generate", "--checkpoint", str(tmp_path), "--generator", str(tmp_path / "g.pt"), "--prompt", "x"])
    assert "g.pt (--generator: a Self-Forcing / CausVid / LongLive generator .pt file)" in capsys.readouterr().err


def make_checkpoint(root):
    """A Wan2.1 folder with every file in place, the DiT's weights malformed."""
    (root / "google" / "umt5-xxl").mkdir(parents=True)
    (root / "google" / "umt5-xxl" / "spiece.model").write_bytes(b"x")
    (root / "config.json").write_text(json.dumps({"_class_name": "WanModel", "dim": 1536}))
    (root / "diffusion_pytorch_model.safetensors").write_bytes(b"\x00" * 4)
    (root / "Wan2.1_VAE.pth").write_bytes(b"x")
    (root / "models_t5_umt5-xxl-enc-bf16.pth").write_bytes(b"x")
    return root


def test_malformed_checkpoint_names_the_file(tmp_path, capsys):
    root = make_checkpoint(tmp_path / "ckpt")
    assert generate.find_checkpoint(root).dit == root
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "--checkpoint", str(root), "--prompt", "x", "--out", str(tmp_path / "x.mp4")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "diffusion_pytorch_model.safetensors: not a safetensors file" in err and "cannot load the DiT" in err


@pytest.mark.slow
def test_encoder_context_path_equals_the_prompt_path(tmp_path, monkeypatch):
    """The checkpoint path (contexts encoded up front, ``join(..., context=)``, and
    switches from the encoded contexts), run with an 'encoder' that returns the hash stand-in: the
    same latents as the tiny path, which hashes inside ``Rollout.join``."""
    from arkv_jax.models.dit import prompt_embedding

    common = dict(prompts=["a red fox", "rain"], random_tiny=True, frames=4, sessions=2, prompt_at={1: "a cat"},
                  stdout=open("/dev/null", "w"))
    plain = generate.run_generate(out=tmp_path / "a", **common)
    tiny = generate.tiny_pipeline

    def encoded(seed=0):
        pipeline = tiny(seed)
        c = pipeline.model.config
        pipeline.encode = lambda texts: np.stack([prompt_embedding(t, c.text_tokens, c.text_dim) for t in texts])
        return pipeline

    monkeypatch.setattr(generate, "tiny_pipeline", encoded)
    via_context = generate.run_generate(out=tmp_path / "b", **common)
    for sid in ("s0", "s1"):
        np.testing.assert_allclose(via_context.latents[sid], plain.latents[sid], rtol=0, atol=1e-6)
    assert via_context.paths == [tmp_path / "b" / "session0.mp4", tmp_path / "b" / "session1.mp4"]
