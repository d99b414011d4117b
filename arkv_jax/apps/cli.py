"""The ``arkv-jax`` command line: ``plan`` (memory planning), ``demo`` (sessions sharing a cache),
``generate`` (prompts to mp4) and ``bench`` (a checkout's benchmarks). Each subcommand has a parser
and a runner; a bad flag or a refused run exits with code 2, the reason on stderr. See ``docs/planning.md``,
``docs/demo.md`` and ``docs/models.md``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.metadata
import os
import pathlib
import re
import runpy
import sys
from typing import Sequence

from arkv_jax import planner, presets
from arkv_jax.config import KV_DTYPES, CrossAttentionSpec, KVBranch, ceil_div

#: ``--fraction``'s default: vLLM-Omni's ``ARDiffusionKVConfig.gpu_memory_fraction``.
DEFAULT_FRACTION = planner.DEFAULT_MEMORY_FRACTION


def _positive_fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def _memory(text: str) -> int:
    try:
        return planner.parse_memory(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class _MemoryAction(argparse.Action):
    """Stores ``--memory``'s bytes, and its text as ``memory_name`` (a chip name says which chip)."""

    def __call__(self, parser, namespace, values, option_string=None):
        namespace.memory = values
        namespace.memory_name = self._text

    def __init__(self, *args, type=None, **kwargs):  # noqa: A002 -- argparse's keyword
        def parse(text: str) -> int:
            self._text = text.strip().lower()
            return type(text)

        super().__init__(*args, type=parse, **kwargs)


def _bytes_or_zero(text: str) -> int:
    """A size as ``--memory`` takes it (``512MiB``, ``1e9``), or ``0``."""
    return 0 if text.strip() in ("0", "0B", "0b") else _memory(text)


#: Internal names in planner and config messages -> the ``arkv-jax plan`` flag that sets them.
_FLAG_OF_FIELD = {
    "session_capacity": "--sessions", "num_layers": "--layers", "num_kv_heads": "--kv-heads",
    "head_dim": "--head-dim", "tokens_per_frame": "--tokens-per-frame", "block_size": "--block-size",
    "frames_per_forward": "--frames-per-forward", "window_frames": "--window-frames",
    "sink_frames": "--sink-frames", "memory_fraction": "--fraction", "available_bytes": "--memory",
    "max_scratch_tokens_per_branch": "--scratch-tokens",
    "model_owned_state_bytes_per_session": "--model-owned-bytes", "dtype": "--dtype", "processes": "--processes",
}


def _in_flag_terms(message: str) -> str:
    """``message`` with the internal field names replaced by the flags a user typed."""
    return re.sub(r"\b(" + "|".join(_FLAG_OF_FIELD) + r")\b", lambda m: _FLAG_OF_FIELD[m.group(1)], message)


def _join_negative_values(argv: Sequence[str]) -> list[str]:
    """``["--memory", "-5GiB"]`` -> ``["--memory=-5GiB"]``: argparse reads a value that starts with
    ``-`` (and is not a plain number) as an unknown option, so the flag's own check never sees it."""
    out: list[str] = []
    for token in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and re.match(r"-\.?\d", token):
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def _branches(text: str) -> tuple[KVBranch, ...]:
    """``"positive:0,negative:1"`` -> branches; a bare name gets local index 0."""
    try:
        out = []
        for item in text.split(","):
            name, _, index = item.strip().partition(":")
            out.append(KVBranch(name, int(index) if index else 0))
        return tuple(out)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"must look like 'main' or 'positive:0,negative:1' ({exc}), got {text!r}") from None


def _cross(text: str) -> tuple[CrossAttentionSpec, ...]:
    """``"text:512,image:257"`` -> cross-attention specs; ``"none"`` -> no cache."""
    if text.strip().lower() == "none":
        return ()
    try:
        return tuple(CrossAttentionSpec(name.strip(), int(tokens))
                     for name, tokens in (item.split(":") for item in text.split(",")))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"must look like 'text:512' or 'none' ({exc}), got {text!r}") from None


_GEOMETRY_FLAGS = {
    "layers": "num_layers", "kv_heads": "num_kv_heads", "head_dim": "head_dim", "dtype": "dtype",
    "tokens_per_frame": "tokens_per_frame", "block_size": "block_size",
    "frames_per_forward": "frames_per_forward", "kv_dtype": "kv_dtype",
}
_WINDOW_FLAGS = {"window_frames": "window_frames", "sink_frames": "sink_frames"}


def _add_plan_parser(sub) -> None:
    from arkv_jax.pipeline import DEFAULT_BUCKETS, PIPELINES

    p = sub.add_parser("plan", help="how many sessions fit in a memory budget",
                       description="Plan the paged KV pool for a model on one device.")
    p.add_argument("--preset", default="wan-1.3b", choices=sorted(presets.PRESETS),
                   help="model shape to start from (default: wan-1.3b)")
    for flag in ("layers", "kv-heads", "head-dim", "tokens-per-frame", "block-size",
                 "frames-per-forward", "window-frames", "sink-frames"):
        p.add_argument(f"--{flag}", type=int, help="override the preset's value")
    p.add_argument("--dtype", help="compute dtype (and the pages' unless --kv-dtype): float32, bfloat16 or float16")
    p.add_argument("--kv-dtype", choices=KV_DTYPES,
                   help="storage dtype of the K/V pages (default: --dtype); int8 and fp8 store each page with a "
                        "float32 scale per layer and KV head (backends: docs/kernels.md, Quantized pages)")
    p.add_argument("--reset-at-boundary", action="store_true", default=None,
                   help="vLLM-Omni's reset mode (evict everything after the sink on each commit)")
    p.add_argument("--branches", type=_branches, help="KV branches, e.g. 'positive:0,negative:1'")
    p.add_argument("--cross", type=_cross, help="cross-attention caches, e.g. 'text:512', or 'none'")
    p.add_argument("--scratch-tokens", type=int, help="action/state tokens per forward kept in scratch")
    p.add_argument("--model-owned-bytes", type=_bytes_or_zero,
                   help="per-session model state outside the pool, a size like --memory takes (or 0)")
    p.add_argument("--memory", type=_memory, action=_MemoryAction,
                   help="available memory: a size (100GiB, 80GB) or a chip "
                        f"({', '.join(sorted(planner.CHIP_MEMORY_BYTES))}); default: this device's free memory "
                        "(on a CPU, the host's available RAM; the plan says which it probed)")
    p.add_argument("--fraction", type=_positive_fraction, default=None,
                   help="soft budget fraction of the available memory, in (0, 1] (default "
                        f"{DEFAULT_FRACTION}: vLLM-Omni's gpu_memory_fraction default, which leaves the rest "
                        "of the device to the model; raise it, e.g. 0.9, for a device that serves only this "
                        "cache and its model)")
    defaults = ", ".join(f"{name} {preset.session_capacity}" for name, preset in sorted(presets.PRESETS.items()))
    p.add_argument("--sessions", type=int,
                   help=f"resident sessions requested (default: the preset's: {defaults})")
    p.add_argument("--batched-in-flight", action="store_true",
                   help="reserve in-flight pages for every session (all sessions in one batched chunk, as "
                        "arkv_jax.cache.PagedKVCache runs them) instead of vLLM-Omni's one forward at a time")
    p.add_argument("--mesh", type=_mesh_shape, metavar="DATAxMODEL",
                   help="plan one device of a (data, model) mesh, e.g. 4x2: sessions split over data, K/V "
                        "heads over model; --memory is then per device and --sessions counts every data shard")
    p.add_argument("--processes", type=_positive_int, default=None,
                   help="with --mesh: the processes the mesh spans (a divisor of DATA; default 1); the plan also "
                        "gives one process's pool bytes (DATA / N data shards x MODEL devices)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    whole = p.add_argument_group(
        "whole chip", "--pipeline plans the whole generator on one TPU chip named by --memory (tpu-v5e, tpu-v6e): "
                      "weights, each session's VAE stream cache and latent ring, the chunk program's and the VAE "
                      "decode's temporaries as the TPU compiler gives them (libtpu's compile-only device: "
                      "pip install 'arkv-jax[tpu]'; it compiles each batch bucket, minutes), then K/V pages with "
                      "the rest")
    whole.add_argument("--pipeline", choices=sorted(PIPELINES), nargs="?", const="self-forcing", default=None,
                       help="the generator to plan (default when given alone: self-forcing)")
    whole.add_argument("--guidance", type=float, default=None, help="CFG scale (two KV branches per session)")
    whole.add_argument("--text-on-device", action="store_true",
                       help="keep the text encoder's weights on the chip (default: it runs on the host)")
    whole.add_argument("--buckets", type=_buckets, default=DEFAULT_BUCKETS,
                       help="sessions per chunk to try, e.g. 1,2,4,8 (default)")
    p.set_defaults(run=_run_plan, command_parser=p, memory_name=None)


def _buckets(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be positive integers separated by commas, e.g. 1,2,4, got {text!r}")
    return values


def _mesh_shape(text: str) -> tuple[int, int]:
    """``"4x2"`` -> ``(4, 2)``."""
    data, sep, model = text.lower().partition("x")
    try:
        shape = (int(data), int(model))
    except ValueError:
        shape = (0, 0)
    if not sep or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"must look like DATAxMODEL with positive sizes, e.g. 4x2, got {text!r}")
    return shape


def _plan_from_args(args: argparse.Namespace):
    """The :class:`~arkv_jax.planner.MemoryPlan` the flags ask for, or with ``--mesh`` a
    :class:`~arkv_jax.planner.DevicePlan`."""
    preset = presets.get_preset(args.preset)
    geometry = dataclasses.replace(preset.geometry, **{
        field: getattr(args, flag) for flag, field in _GEOMETRY_FLAGS.items()
        if getattr(args, flag) is not None})
    if args.tokens_per_frame is not None and args.block_size is None:
        geometry = dataclasses.replace(geometry, block_size=min(geometry.block_size, args.tokens_per_frame))
    window = dataclasses.replace(preset.window, **{
        field: getattr(args, flag) for flag, field in _WINDOW_FLAGS.items()
        if getattr(args, flag) is not None})
    if args.reset_at_boundary:
        window = dataclasses.replace(window, reset_at_boundary=True)
    sessions = args.sessions if args.sessions is not None else preset.session_capacity
    common = dict(
        memory_fraction=DEFAULT_FRACTION if args.fraction is None else args.fraction,
        cross_attention=args.cross if args.cross is not None else preset.cross_attention,
        max_scratch_tokens_per_branch=(args.scratch_tokens if args.scratch_tokens is not None
                                       else preset.max_scratch_tokens_per_branch),
        model_owned_state_bytes_per_session=(args.model_owned_bytes if args.model_owned_bytes is not None
                                             else preset.model_owned_state_bytes_per_session),
        batched_in_flight=args.batched_in_flight,
    )
    available = args.memory if args.memory is not None else args.probed[0]
    branches = args.branches or preset.kv_branches
    if args.mesh is not None:
        data, model = args.mesh
        return planner.plan_per_device(geometry, window, branches, data=data, model=model,
                                        available_bytes_per_device=available,
                                        sessions_per_shard=ceil_div(sessions, data),
                                        processes=args.processes or 1, **common)
    return planner.plan_memory(geometry, window, branches, available_bytes=available,
                               session_capacity=sessions, **common)


#: ``--memory`` values ``--pipeline`` takes -> the TPU generation compiled for.
_PIPELINE_CHIPS = {"tpu-v5e": "v5e", "tpu-v6e": "v6e"}


def _run_pipeline_plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``plan --pipeline``: :func:`arkv_jax.pipeline.plan_chip` for the chip ``--memory`` names."""
    from arkv_jax import pipeline
    from pallas_kernels import tpu_aot

    generation = _PIPELINE_CHIPS.get(args.memory_name or "")
    if generation is None:
        parser.error(f"--pipeline needs --memory naming a TPU chip ({', '.join(_PIPELINE_CHIPS)}), "
                     f"got {args.memory_name!r}")
    chosen = pipeline.PIPELINES[args.pipeline]
    if args.preset != chosen.preset.name:
        parser.error(f"--pipeline {args.pipeline} is the {chosen.preset.name} model, not --preset {args.preset}")
    if not tpu_aot.libtpu_available():
        parser.error("--pipeline compiles for the TPU and needs libtpu: pip install 'arkv-jax[tpu]'")
    if args.guidance is not None:
        chosen = chosen.with_(sampler=dataclasses.replace(chosen.sampler, guidance_scale=args.guidance))
    chosen = chosen.with_(text_on_device=args.text_on_device).with_kv_dtype(args.kv_dtype)
    plan = pipeline.plan_chip(chosen, generation, memory_bytes=None,  # the HBM the compiler allows
                              memory_fraction=1.0 if args.fraction is None else args.fraction,
                              buckets=args.buckets, kernel_seconds=pipeline.attention_pricer(chosen, generation))
    print(plan.to_json() if args.json else plan.summary())
    return 0


def _run_plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.pipeline is not None:
        return _run_pipeline_plan(args, parser)
    if args.processes is not None and args.mesh is None:
        parser.error(f"--processes {args.processes} needs --mesh DATAxMODEL (the processes split its data axis)")
    args.probed = planner.probe_free_memory() if args.memory is None else None
    try:
        plan = _plan_from_args(args)
    except ValueError as exc:
        parser.error(_in_flag_terms(str(exc)))
    if args.json:
        print(plan.to_json())
        return 0
    if args.probed is not None:
        print(f"available memory: {planner.format_bytes(args.probed[0])}, probed from {args.probed[1]} "
              "(pass --memory to plan another device)")
    print(plan.summary())
    one = plan.plan if isinstance(plan, planner.DevicePlan) else plan
    source = (f"--fraction {args.fraction:g}" if args.fraction is not None
              else f"default {DEFAULT_FRACTION:g}, vLLM-Omni's gpu_memory_fraction; pass --fraction to change it")
    print(f"memory fraction in use: {one.memory_fraction:g} ({source})")
    if one.session_capacity < one.requested_session_capacity:
        print(f"note: {one.requested_session_capacity} sessions requested, {one.session_capacity} granted; "
              f"the budget holds at most {one.budget_session_capacity} (raise --fraction or --memory)")
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _add_demo_parser(sub) -> None:
    from pallas_kernels.backend import BACKEND_NAMES

    p = sub.add_parser(
        "demo", help="several video sessions generating through one paged KV cache",
        description="Run a random-weight causal video DiT for several concurrent sessions through one paged KV "
                    "cache; print latency, frames per second and pool occupancy (in usable pages); write "
                    "pages.png, memory.png and latency.png. The last line is 'checksum: <float>', the sum of "
                    "every generated latent to 7 significant digits. With --devices N the latents equal the "
                    "one-device run's to float rounding (within 1e-5 each for the float32 tiny model), so the "
                    "checksum's last digit can differ; --check prints both checksums and the largest difference.")
    p.add_argument("--sessions", type=_positive_int, default=4, help="concurrent sessions (default 4)")
    p.add_argument("--chunks", type=_positive_int, default=12, help="chunks per session (default 12)")
    p.add_argument("--preset", default="tiny", choices=("tiny", "wan-1.3b"),
                   help="model and cache shape (default tiny; wan-1.3b needs an accelerator)")
    p.add_argument("--backend", default="auto", choices=BACKEND_NAMES,
                   help="kernel backend (default auto); the compiled pallas_gpu and pallas_tpu need their device "
                        "(checked before the run)")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default=None,
                   help="storage dtype of the K/V pages (default: the model's); int8 and fp8 are quantized pages "
                        "(one scale per page)")
    p.add_argument("--out", default="arkv_demo_out",
                   help="folder for the figures, created if needed (default arkv_demo_out; checked before the run)")
    p.add_argument("--check", action="store_true",
                   help="also run the full-recompute reference and print max_abs_diff; with --devices, also run "
                        "the same sessions on one device and print its checksum and devices_max_abs_diff, the "
                        "largest latent difference (exit status 1 if above 1e-5 for a float32 model)")
    p.add_argument("--seed", type=int, default=0, help="weights and noise seed (default 0)")
    p.add_argument("--devices", type=_positive_int, default=None,
                   help="shard the cache and the model over this many devices (sessions over a 'data' axis "
                        "of devices / model-axis, heads over 'model'); on CPU creates that many host devices. "
                        "Default: one device, no mesh")
    p.add_argument("--model-axis", type=_positive_int, default=1,
                   help="size of the mesh's 'model' (heads) axis with --devices (default 1)")
    p.add_argument("--processes", type=_positive_int, default=None,
                   help="start this many local processes, one JAX job (jax.distributed on 127.0.0.1, gloo CPU "
                        "collectives), with --devices in all (default: one per process) split between them; "
                        "prints process 0's report, the same checksum as one process")
    group = p.add_argument_group("one process of a multi-process job (what --processes passes each process; on "
                                 "several hosts run it on every host, docs/sharding.md)")
    group.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                       help="process 0's coordinator address (jax.distributed.initialize)")
    group.add_argument("--num-processes", type=_positive_int, default=None, help="processes of the job")
    group.add_argument("--process-id", type=int, default=None, help="this process, 0 .. num-processes - 1")
    p.set_defaults(run=_run_demo, command_parser=p)


def _run_demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.seed < 0:
        parser.error(f"--seed must be non-negative, got {args.seed}")
    if args.processes is not None:
        return _launch_demo(args, parser)
    if args.coordinator is not None:
        from arkv_jax.processes import fail_fast

        with fail_fast():  # a failed process ends at once instead of holding the others at shutdown
            _join_job(args, parser)
            return _demo(args, parser)
    if args.num_processes is not None or args.process_id is not None:
        parser.error("--num-processes and --process-id need --coordinator")
    return _demo(args, parser)


def _demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """The demo in this process (one process, or one of a job's)."""
    from arkv_jax.apps import demo

    mesh = None
    if args.devices is not None:
        if args.coordinator is None:  # a job's processes asked for their own devices when joining it
            _request_host_devices(args.devices)
        try:
            mesh = demo.demo_mesh(args.devices, args.model_axis)
        except ValueError as error:
            parser.error(str(error))
    elif args.model_axis != 1:
        parser.error("--model-axis needs --devices")
    try:
        result = demo.run_demo(sessions=args.sessions, chunks=args.chunks, preset=args.preset,
                               backend=args.backend, out=args.out, check=args.check, seed=args.seed, mesh=mesh,
                               kv_dtype=args.kv_dtype)
    except ValueError as error:  # refused before the run: --out, --backend, heads vs --model-axis
        parser.error(str(error))
    return 1 if result.devices_within_tolerance is False else 0


def _prompt_at(text: str) -> tuple[int, str]:
    from arkv_jax.apps.generate import parse_prompt_at

    try:
        return parse_prompt_at(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _add_generate_parser(sub) -> None:
    from pallas_kernels.backend import BACKEND_NAMES

    p = sub.add_parser(
        "generate", help="prompts to mp4 videos, chunk by chunk, through one paged KV cache",
        description="Generate video from text prompts: umT5 text encoding, the causal DiT chunk by chunk through one "
                    "paged KV cache (several sessions at once), and the streaming Wan VAE decoding each chunk as it "
                    "commits, written to one mp4 per session (imageio-ffmpeg). Prints the memory plan first, then one "
                    "row per chunk (DiT denoise + commit, VAE decode, text and write times, video frames/s) and a "
                    "summary with the VAE's share. Checks the checkpoint's files and the outputs before loading "
                    "anything (exit status 2 on a problem).")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", metavar="DIR",
                        help="a Wan2.1-T2V-1.3B folder: DiT weights (diffusion_pytorch_model.safetensors + "
                             "config.json), Wan2.1_VAE.pth, models_t5_umt5-xxl-enc-bf16.pth and the google/umt5-xxl "
                             "tokenizer folder "
                             "(or the diffusers layout: transformer/, vae/, text_encoder/, tokenizer/)")
    source.add_argument("--random-tiny", action="store_true",
                        help="no checkpoint: tiny random weights (DiT tiny, VAE tiny, hash stand-in text) on the whole "
                             "path, in seconds on a CPU")
    p.add_argument("--generator", metavar="FILE",
                   help="a Self-Forcing / CausVid / LongLive generator .pt to use as the DiT, with --checkpoint "
                        "for the VAE, umT5 and tokenizer")
    p.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                   help="the prompt; repeat for several sessions (session i gets prompt i mod count)")
    p.add_argument("--prompt-at", action="append", type=_prompt_at, default=[], metavar="CHUNK:TEXT",
                   help="switch every session to TEXT before chunk CHUNK (1, 2, ...); repeatable. A switch recomputes "
                        "the K/V of the frames the next chunk sees under the new prompt (LongLive's KV recache)")
    p.add_argument("--switch-sink", choices=("keep", "recompute"), default="keep",
                   help="at a prompt switch, keep the attention sink's K/V (default, as LongLive) or recompute them")
    p.add_argument("--frames", type=_positive_int, default=None,
                   help="latent frames per session, a multiple of the chunk (default 6 with --random-tiny: 2-frame "
                        "chunks; 21 with a checkpoint: 3-frame chunks, 81 video frames); F latent frames give "
                        "1 + 4 (F - 1) video frames")
    p.add_argument("--seed", type=int, default=0, help="noise seed; session i uses seed + i (default 0)")
    p.add_argument("--sessions", type=_positive_int, default=1,
                   help="sessions generated at once through one cache, one mp4 each (default 1)")
    p.add_argument("--out", default="video.mp4",
                   help="the mp4 (default video.mp4); with several sessions NAME_session<i>.mp4 beside it, or "
                        "<DIR>/session<i>.mp4 for a folder (checked writable before the run)")
    p.add_argument("--steps", type=_positive_int, default=None,
                   help="denoise steps per chunk (default 4 with a checkpoint, 3 with --random-tiny)")
    p.add_argument("--guidance", type=float, default=None,
                   help="classifier-free guidance scale against the empty prompt (default: none, as the distilled "
                        "Self-Forcing / CausVid / LongLive generators run)")
    p.add_argument("--fps", type=_positive_int, default=16, help="frames per second of the mp4 (default 16)")
    p.add_argument("--backend", default="auto", choices=BACKEND_NAMES, help="kernel backend (default auto)")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default=None,
                   help="store the K/V pages as int8 or fp8 (one scale per page) or another "
                        "float dtype (default: the model's dtype)")
    p.add_argument("--allow-pickle", action="store_true",
                   help="let torch unpickle arbitrary objects from a --generator file (trusted files only)")
    p.set_defaults(run=_run_generate, command_parser=p)


def _run_generate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from arkv_jax.apps import generate

    if args.seed < 0:
        parser.error(f"--seed must be non-negative, got {args.seed}")
    switches = dict(args.prompt_at)
    if len(switches) != len(args.prompt_at):
        parser.error("--prompt-at: two switches at the same chunk")
    prompts = args.prompt or (["a red fox running through fresh snow"] if args.random_tiny else [])
    if not prompts:
        parser.error("--prompt is required with --checkpoint")
    try:
        generate.run_generate(prompts=prompts, checkpoint=args.checkpoint, generator=args.generator,
                              random_tiny=args.random_tiny, prompt_at=switches, frames=args.frames, seed=args.seed,
                              sessions=args.sessions, out=args.out, steps=args.steps, guidance=args.guidance,
                              fps=args.fps, backend=args.backend, allow_pickle=args.allow_pickle,
                              switch_sink=args.switch_sink, kv_dtype=args.kv_dtype)
    except generate.GenerateError as error:  # refused before the run, or a checkpoint that does not load
        parser.error(str(error))
    return 0


def _launch_demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``demo --processes N``: the same demo as N local processes of one JAX job; process 0 prints."""
    from arkv_jax import processes

    devices = args.devices or args.processes
    if args.coordinator is not None or args.check or devices % args.processes:
        parser.error(f"--processes {args.processes} takes no --coordinator or --check, and --devices (default: one "
                     f"per process) a multiple of it; got --devices {devices}")
    flags = ["--sessions", args.sessions, "--chunks", args.chunks, "--preset", args.preset, "--backend",
             args.backend, "--out", args.out, "--seed", args.seed, "--devices", devices, "--model-axis",
             args.model_axis, "--coordinator", f"127.0.0.1:{processes.free_port()}", "--num-processes",
             args.processes, *(["--kv-dtype", args.kv_dtype] if args.kv_dtype else [])]
    commands = [processes.python_module("arkv_jax.apps.cli", "demo", *map(str, flags), "--process-id", str(i))
                for i in range(args.processes)]
    with open(os.devnull, "w") as quiet:
        status = processes.launch(commands, stdout=[None] + [quiet] * (args.processes - 1))
    return max(status, key=abs)


def _join_job(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Joins this process to the job ``--coordinator``, ``--num-processes``, ``--process-id`` name,
    with ``--devices / --num-processes`` CPU devices of its own."""
    from arkv_jax import processes

    if args.num_processes is None or args.process_id is None:
        parser.error("--coordinator needs --num-processes and --process-id")
    if args.devices is not None and args.devices % args.num_processes:
        parser.error(f"--devices {args.devices} must be a multiple of --num-processes {args.num_processes}")
    local = None if args.devices is None else args.devices // args.num_processes
    try:
        processes.initialize(args.process_id, args.num_processes, args.coordinator, local_devices=local)
    except ValueError as error:
        parser.error(str(error))


def _request_host_devices(count: int) -> None:
    """Asks JAX for ``count`` CPU host devices (``jax_num_cpu_devices``). Only the CPU backend reads
    it, and only before JAX starts its backends; afterwards (e.g. called in-process from a test) the
    devices JAX already has are used."""
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", max(count, jax.config.jax_num_cpu_devices))
    except (RuntimeError, AttributeError):  # backends already started, or an older JAX
        pass


def _benchmarks(root: pathlib.Path) -> dict[str, str]:
    """The benchmarks of the checkout at ``root``: name -> its docstring's first paragraph."""
    found = {}
    for path in sorted((root / "benchmarks").glob("*.py")):
        if path.stem not in ("__init__", "harness"):
            try:
                doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
            except (OSError, SyntaxError, UnicodeDecodeError):
                doc = ""
            found[path.stem] = " ".join(doc.strip().split("\n\n")[0].split())
    return found


def _benchmark_list(root: pathlib.Path) -> str:
    found = _benchmarks(root)
    if not found:
        return f"(no benchmarks/ folder in {root}: run from the repository root)"
    return "\n".join(f"  {name:<22} {line}" for name, line in found.items())


def _add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="run one of the checkout's benchmarks (benchmarks/NAME.py)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Run benchmarks/NAME.py of the repository checkout in the current folder "
                                   "(the same as `python -m benchmarks.NAME ARGS` there); ARGS go to the script, "
                                   "e.g. --quick (every benchmark takes it).\n\nbenchmarks:\n"
                                   + _benchmark_list(pathlib.Path.cwd()))
    p.add_argument("name", nargs="?", help="the benchmark (listed above)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own flags, e.g. --quick")
    p.set_defaults(run=_run_bench, command_parser=p)


def _run_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    root = pathlib.Path.cwd()
    if not (root / "benchmarks" / "harness.py").exists():
        parser.error(f"bench runs the benchmarks of a repository checkout; {root} has no benchmarks/ folder "
                     "(cd to the repository root)")
    names = list(_benchmarks(root))
    if args.name is None:
        parser.error(f"name a benchmark: one of {', '.join(names)} (arkv-jax bench --help describes each)")
    if args.name not in names:
        parser.error(f"unknown benchmark {args.name!r}; choose from {', '.join(names)}")
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.path.insert(0, str(root))
    sys.argv = [f"benchmarks/{args.name}.py", *args.args]
    try:
        runpy.run_module(f"benchmarks.{args.name}", run_name="__main__")
    except SystemExit as done:
        if isinstance(done.code, str):  # sys.exit("message"): print it, as the interpreter would
            print(done.code, file=sys.stderr)
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return 0


def _version() -> str:
    try:
        return importlib.metadata.version("arkv-jax")
    except importlib.metadata.PackageNotFoundError:  # running from a checkout that is not installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    """The ``arkv-jax`` argument parser with its subcommands."""
    parser = argparse.ArgumentParser(
        prog="arkv-jax", description="Paged KV cache for autoregressive video diffusion in JAX.")
    parser.add_argument("--version", action="version", version=f"arkv-jax {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_plan_parser(sub)
    _add_demo_parser(sub)
    _add_generate_parser(sub)
    _add_bench_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``arkv-jax`` console script; returns the exit code (2 for bad flags)."""
    parser = build_parser()
    args = parser.parse_args(_join_negative_values(sys.argv[1:] if argv is None else argv))
    return args.run(args, args.command_parser)  # errors found later print the subcommand's usage


if __name__ == "__main__":
    sys.exit(main())
