"""``arkv-jax generate``: prompts to mp4 files, chunk by chunk, through one paged KV cache.

The whole path of a streaming video model, in JAX: the prompts (and the empty CFG negative) are
encoded once, up front, by the umT5 encoder (:mod:`arkv_jax.models.umt5`; with ``random_tiny`` the
DiT's hash stand-in); ``sessions`` sessions join one :class:`arkv_jax.rollout.Rollout` over one
:class:`arkv_jax.cache.PagedKVCache` sized by :func:`arkv_jax.planner.rollout_plan` and generate
``frames`` latent frames, one batched chunk per step; as each chunk commits, every session's latents
are decoded by the streaming Wan VAE (:func:`arkv_jax.models.vae.decode_chunk`) and appended to its
mp4. ``prompt_at`` switches prompts with LongLive's KV recache
(:meth:`arkv_jax.rollout.Rollout.switch_prompt`). Bad requests and missing checkpoint files are
refused before anything loads, and a file that does not load is named, both as
:class:`GenerateError`. See ``docs/models.md``, "Prompts to mp4".
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import TextIO

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from arkv_jax.apps.compile_clock import CompileClock, Phase
from arkv_jax.apps.platforms import check_backend
from arkv_jax.cache import PagedKVCache
from arkv_jax.cache.recache import SINK_MODES
from arkv_jax.config import CacheGeometry, CrossAttentionSpec, KVBranch, WindowPolicy, canonical_kv_dtype
from arkv_jax.models import vae as vae_lib
from arkv_jax.models.dit import MODEL_CONFIGS, CausalDiT
from arkv_jax.models.dit import init_random as init_random_dit
from arkv_jax.planner import format_bytes, rollout_plan
from arkv_jax.presets import get_preset
from arkv_jax.rollout import Rollout, Sampler

#: Frames per second of the written videos (Wan 2.1's 16 fps).
DEFAULT_FPS = 16

#: Default latent frames: the tiny path's (3 chunks of 2) and a checkpoint's (Self-Forcing's 21
#: latent frames, 81 video frames, 7 chunks of 3).
DEFAULT_FRAMES = {"tiny": 6, "checkpoint": 21}

#: Default denoise steps: the tiny path's and a few-step (Self-Forcing / CausVid) generator's.
DEFAULT_STEPS = {"tiny": 3, "checkpoint": 4}

#: Files of a Wan2.1-T2V-1.3B folder, official layout, then the diffusers layout's folders.
OFFICIAL_FILES = {
    "dit": "diffusion_pytorch_model.safetensors",
    "vae": "Wan2.1_VAE.pth",
    "text_encoder": "models_t5_umt5-xxl-enc-bf16.pth",
    "tokenizer": "google/umt5-xxl",
}
DIFFUSERS_FOLDERS = {"dit": "transformer", "vae": "vae", "text_encoder": "text_encoder", "tokenizer": "tokenizer"}

#: Files that make a folder a tokenizer (sentencepiece model or a fast tokenizer's JSON).
TOKENIZER_FILES = ("spiece.model", "tokenizer.json")


def plural(count: int, noun: str) -> str:
    """``"1 session"``, ``"2 sessions"``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


class GenerateError(ValueError):
    """A run refused before it starts, or a checkpoint that does not load (the message names the
    file and what was expected)."""


# ------------------------------------------------------------------------------------------------
# The checkpoint
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CheckpointFiles:
    """Where each part of a checkpoint is read from.

    Attributes:
      dit: the DiT's folder or file (:func:`arkv_jax.models.loader.load_wan`): the checkpoint folder,
        its ``transformer/`` folder, or a ``--generator`` file.
      vae: ``Wan2.1_VAE.pth`` or a diffusers ``vae/`` folder.
      text_encoder: ``models_t5_umt5-xxl-enc-bf16.pth`` or a ``transformers`` ``text_encoder/`` folder.
      tokenizer: the ``google/umt5-xxl`` (or diffusers ``tokenizer/``) folder.
    """

    dit: pathlib.Path
    vae: pathlib.Path
    text_encoder: pathlib.Path
    tokenizer: pathlib.Path


def find_checkpoint(directory: str | pathlib.Path, generator: str | pathlib.Path | None = None) -> CheckpointFiles:
    """The files of a Wan2.1-T2V-1.3B folder (official: DiT safetensors + ``config.json``,
    ``Wan2.1_VAE.pth``, ``models_t5_umt5-xxl-enc-bf16.pth``, ``google/umt5-xxl/``; or the
    diffusers pipeline's ``transformer/``, ``vae/``, ``text_encoder/``, ``tokenizer/``), with the DiT
    taken from ``generator`` (a Self-Forcing / CausVid / LongLive ``.pt``) when given. Only checks
    that the files are there; nothing is read.

    Raises:
      GenerateError: the folder or a file is missing; every missing part is named, with what was
        expected there.
    """
    root = pathlib.Path(directory)
    if not root.is_dir():
        raise GenerateError(f"--checkpoint {str(directory)!r}: no such directory (expected a Wan2.1-T2V-1.3B "
                            f"folder holding {', '.join(OFFICIAL_FILES.values())})")
    missing: list[str] = []

    def pick(part: str, what: str, ok) -> pathlib.Path:
        official, diffusers = root / OFFICIAL_FILES[part], root / DIFFUSERS_FOLDERS[part]
        for candidate in (official, diffusers):
            if ok(candidate):
                return candidate
        missing.append(f"{official} ({what}; or a diffusers {diffusers.name}/ folder)")
        return official

    if generator is not None:
        dit = pathlib.Path(generator)
        if not dit.is_file():
            missing.append(f"{dit} (--generator: a Self-Forcing / CausVid / LongLive generator .pt file)")
    else:
        def has_dit(path: pathlib.Path) -> bool:
            folder = path if path.is_dir() else path.parent
            return (any(folder.glob("*.safetensors")) or any(folder.glob("*.safetensors.index.json"))) \
                and (folder / "config.json").is_file()

        dit = pick("dit", "the DiT's weights, diffusion_pytorch_model*.safetensors with its config.json", has_dit)
        dit = dit.parent if dit.name == OFFICIAL_FILES["dit"] else dit
    vae = pick("vae", "the Wan 2.1 VAE's weights", lambda p: p.is_file() or (p.is_dir() and any(p.iterdir())))
    text = pick("text_encoder", "the umT5-XXL encoder's weights",
                lambda p: p.is_file() or (p.is_dir() and any(p.iterdir())))
    tokenizer = pick("tokenizer", f"the umT5 tokenizer folder, with {' or '.join(TOKENIZER_FILES)}",
                     lambda p: p.is_dir() and any((p / f).is_file() for f in TOKENIZER_FILES))
    if missing:
        raise GenerateError(f"--checkpoint {str(directory)!r} is incomplete: missing " + "; ".join(missing))
    return CheckpointFiles(dit, vae, text, tokenizer)


@dataclasses.dataclass
class Pipeline:
    """A DiT, its cache shape, a VAE decoder and a text encoder.

    Attributes:
      name: ``"tiny"`` or ``"checkpoint"``.
      model: the DiT.
      geometry, window: the cache's shape and window.
      vae: the streaming VAE decoder (its ``z_dim`` equals the DiT's latent channels).
      encode: prompts -> contexts ``[B, text_tokens, text_dim]`` (host float32), or ``None`` for the
        DiT's hash stand-in (``Rollout.join`` hashes the prompt itself).
      description: one line for the header.
    """

    name: str
    model: CausalDiT
    geometry: CacheGeometry
    window: WindowPolicy
    vae: vae_lib.WanVAEDecoder
    encode: object | None
    description: str

    @property
    def chunk_frames(self) -> int:
        return self.geometry.frames_per_forward


def tiny_pipeline(seed: int = 0) -> Pipeline:
    """Random weights, small enough for the CPU: the DiT ``tiny`` shape with Wan's 16 latent
    channels (so the VAE ``tiny`` config, 16 channels, decodes it), the ``tiny`` cache preset, hash
    stand-in text."""
    config = dataclasses.replace(MODEL_CONFIGS["tiny"], in_channels=vae_lib.VAE_CONFIGS["tiny"].z_dim)
    preset = get_preset("tiny")
    return Pipeline("tiny", init_random_dit(config, seed), preset.geometry, preset.window,
                    vae_lib.init_random(vae_lib.VAE_CONFIGS["tiny"], seed), None,
                    "random tiny weights (DiT tiny, VAE tiny, hash stand-in text)")


def checkpoint_geometry(model: CausalDiT) -> tuple[CacheGeometry, WindowPolicy]:
    """The cache of a Wan DiT: one page per frame, the ``wan-1.3b`` preset's 3-frame chunks and its
    window (sink 3 + 9 frames)."""
    config, preset = model.config, get_preset("wan-1.3b")
    geometry = CacheGeometry(num_layers=config.num_layers, num_kv_heads=config.num_kv_heads,
                             head_dim=config.head_dim, dtype=config.dtype, tokens_per_frame=config.tokens_per_frame,
                             block_size=config.tokens_per_frame,
                             frames_per_forward=preset.geometry.frames_per_forward)
    return geometry, preset.window


def load_pipeline(files: CheckpointFiles, *, allow_pickle: bool = False) -> Pipeline:
    """Loads a checkpoint's DiT, VAE decoder and umT5 encoder (see :func:`find_checkpoint`).

    Raises:
      GenerateError: a part that does not load, naming its file and the loader's reason.
    """
    from arkv_jax.models import umt5
    from arkv_jax.models.loader import load_wan

    def load(what: str, path: pathlib.Path, loader):
        try:
            return loader()
        except (ValueError, KeyError, FileNotFoundError, ImportError, OSError) as error:
            reason = error.args[0] if isinstance(error, KeyError) and error.args else error
            raise GenerateError(f"{path}: cannot load {what}: {reason}") from None

    model = load("the DiT (a Wan 2.1 T2V transformer or a Self-Forcing / CausVid / LongLive generator)",
                 files.dit, lambda: load_wan(files.dit, allow_pickle=allow_pickle))
    if model.config.in_channels != 16:
        raise GenerateError(f"{files.dit}: the DiT has {model.config.in_channels} latent channels; the Wan 2.1 "
                            "VAE decodes 16")
    vae = load("the Wan 2.1 VAE decoder", files.vae, lambda: vae_lib.load_wan_vae(files.vae))
    encoder = load("the umT5 encoder", files.text_encoder,
                   lambda: umt5.load_umt5(files.text_encoder, text_len=model.config.text_tokens))
    if encoder.config.dim != model.config.text_dim:
        raise GenerateError(f"{files.text_encoder}: the text encoder is {encoder.config.dim} wide; the DiT's "
                            f"text_dim is {model.config.text_dim}")
    tokenizer = str(files.tokenizer)

    def encode(texts: Sequence[str]) -> np.ndarray:
        try:
            context = umt5.encode_prompts(list(texts), tokenizer, encoder, model.config.text_tokens)
        except (OSError, ValueError, ImportError) as error:
            raise GenerateError(f"{files.tokenizer}: cannot tokenise with this umT5 tokenizer folder: "
                                f"{error}") from None
        return np.asarray(context.astype(jnp.float32))

    geometry, window = checkpoint_geometry(model)
    c = model.config
    return Pipeline("checkpoint", model, geometry, window, vae, encode,
                    f"checkpoint {files.dit} ({c.num_layers} layers, dim {c.dim}, {c.dtype}), VAE {files.vae.name}, "
                    f"umT5 {files.text_encoder.name}")


# ------------------------------------------------------------------------------------------------
# Checks made before the run
# ------------------------------------------------------------------------------------------------


def output_paths(out: str | pathlib.Path, sessions: int) -> list[pathlib.Path]:
    """The mp4 of each session: ``out`` itself for one session and an ``.mp4`` name;
    ``<stem>_session<i>.mp4`` beside it for several; ``<out>/session<i>.mp4`` when ``out`` is a
    folder (an existing one, or a name without ``.mp4``).

    Raises:
      GenerateError: the file system refuses to look ``out`` up (e.g. a name too long for it).
    """
    path = pathlib.Path(out)
    try:
        is_dir = path.is_dir()
    except OSError as error:
        raise GenerateError(f"--out: cannot use {str(out)!r} ({error.strerror or error})") from None
    if path.suffix.lower() == ".mp4" and not is_dir:
        if sessions == 1:
            return [path]
        return [path.with_name(f"{path.stem}_session{i}.mp4") for i in range(sessions)]
    return [path / f"session{i}.mp4" for i in range(sessions)]


def prepare_outputs(paths: Sequence[pathlib.Path]) -> None:
    """Creates the folders of ``paths`` and checks each path can be written (a file is created and
    removed where none was).

    Raises:
      GenerateError: a folder cannot be created, or a file cannot be written (names it).
    """
    for path in paths:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.is_dir():
                raise IsADirectoryError(21, "a folder of that name exists")
            existed = path.exists()
            with open(path, "ab"):
                pass
            if not existed:
                path.unlink()
        except OSError as error:
            raise GenerateError(f"--out: cannot write {str(path)!r} ({error.strerror or error})") from None


def ffmpeg_exe() -> str:
    """imageio-ffmpeg's ffmpeg binary (pip-installed with the package).

    Raises:
      GenerateError: imageio or imageio-ffmpeg missing, or no binary.
    """
    try:
        import imageio  # noqa: F401
        import imageio_ffmpeg
    except ImportError as error:
        raise GenerateError(f"writing mp4 needs imageio and imageio-ffmpeg ({error}): "
                            "pip install imageio imageio-ffmpeg") from None
    try:
        return imageio_ffmpeg.get_ffmpeg_exe()
    except RuntimeError as error:
        raise GenerateError(f"imageio-ffmpeg has no ffmpeg binary here ({error})") from None


def parse_prompt_at(text: str) -> tuple[int, str]:
    """``"CHUNK:TEXT"`` -> ``(chunk, text)``: switch to ``TEXT`` before chunk ``CHUNK`` (1 or later;
    chunk 0's prompt is ``--prompt``).

    Raises:
      ValueError: no colon, or ``CHUNK`` not an integer >= 1.
    """
    chunk, sep, prompt = text.partition(":")
    try:
        index = int(chunk)
    except ValueError:
        index = 0
    if not sep or index < 1:
        raise ValueError(f"must look like CHUNK:TEXT with CHUNK the chunk to switch before (1, 2, ...; chunk 0's "
                         f"prompt is --prompt), got {text!r}")
    return index, prompt


# ------------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class ChunkTiming:
    """One chunk of every session. Each part's seconds exclude the compilation inside it, which is
    ``compile_s`` (:class:`~arkv_jax.apps.compile_clock.CompileClock`).

    Attributes:
      chunk: chunk index.
      text_s: the joins' text K/V (chunk 0; 0 otherwise).
      recache_s: prompt switches before the chunk: KV recache and the new text K/V (0 without one).
      dit_s: ``Rollout.step`` (denoise steps + commit forward + cache commit, latents on the host).
      vae_s: the VAE decode of every session's chunk (pixels on the host, uint8).
      write_s: appending the frames to the mp4s.
      compile_s: building programs (tracing, lowering, compiling) during the chunk, all parts.
      video_frames: video frames decoded, all sessions.
    """

    chunk: int
    text_s: float
    recache_s: float
    dit_s: float
    vae_s: float
    write_s: float
    compile_s: float
    video_frames: int

    @property
    def seconds(self) -> float:
        """Wall time of the chunk, compilation included."""
        return self.text_s + self.recache_s + self.dit_s + self.vae_s + self.write_s + self.compile_s

    @property
    def steady(self) -> bool:
        """Neither built a program nor switched a prompt: a steady-state chunk."""
        return self.compile_s == 0 and self.recache_s == 0


@dataclasses.dataclass
class GenerateResult:
    """What :func:`run_generate` wrote and measured.

    Attributes:
      paths: each session's mp4.
      video_frames: video frames per session (``1 + 4 (frames - 1)``).
      frame_size: ``(height, width)`` in pixels.
      timings: one :class:`ChunkTiming` per chunk.
      encode_s: encoding every prompt up front (umT5), compilation excluded; 0 for the hash stand-in.
      encode_compile_s: compilation during that encoding.
      latents: each session's latents ``[frames, h, w, 16]``.
    """

    paths: list[pathlib.Path]
    video_frames: int
    frame_size: tuple[int, int]
    timings: list[ChunkTiming]
    encode_s: float
    encode_compile_s: float
    latents: dict[str, np.ndarray]


def to_uint8(frames) -> np.ndarray:
    """Pixels in ``[-1, 1]`` -> uint8 ``[0, 255]`` (rounded)."""
    return np.clip(np.rint((np.asarray(frames, np.float32) + 1.0) * 127.5), 0, 255).astype(np.uint8)


def switch(rollout: Rollout, session_id: str, prompt: str, context: np.ndarray | None = None,
           negative_context: np.ndarray | None = None, sink: str = "keep") -> None:
    """``Rollout.switch_prompt`` with the encoder's ``context`` (and the CFG negative's) when there is
    one, else through the prompt (hash stand-in), as :func:`join` conditions."""
    if context is None:
        rollout.switch_prompt(session_id, prompt, sink=sink)
    else:
        rollout.switch_prompt(session_id, context=context, negative_context=negative_context, sink=sink)


def join(rollout: Rollout, session_id: str, prompt: str, seed: int, context: np.ndarray | None = None,
         negative_context: np.ndarray | None = None) -> None:
    """``Rollout.join`` with the encoder's ``context`` (and the CFG negative's) when there is one,
    else through the prompt (hash stand-in)."""
    if context is None:
        rollout.join(session_id, prompt, seed=seed)
    else:
        rollout.join(session_id, seed=seed, context=context, negative_context=negative_context)


def _param_bytes(module: nnx.Module) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(nnx.state(module)))


def _cache_bytes(cache: vae_lib.DecoderCache) -> int:
    return sum(f.size * f.dtype.itemsize for f in cache.frames)


@dataclasses.dataclass(frozen=True)
class Request:
    """A validated ``generate`` run (:func:`validate_request`): what to build and what to write.

    Attributes:
      kind: ``"tiny"`` or ``"checkpoint"``.
      files: the checkpoint's files (``None`` for ``"tiny"``).
      prompts: each session's prompt, by session id.
      switches: chunk -> the prompt every session switches to before it.
      frames, chunk_frames, chunks: latent frames per session, per chunk, and the chunk count.
      paths: each session's mp4, writable.
      sampler: the denoise schedule (CFG with ``guidance``).
      guidance: the CFG scale, or ``None``.
      seed, fps, backend, switch_sink, allow_pickle: as :func:`run_generate` takes them.
    """

    kind: str
    files: CheckpointFiles | None
    prompts: dict[str, str]
    switches: dict[int, str]
    frames: int
    chunk_frames: int
    chunks: int
    paths: list[pathlib.Path]
    sampler: Sampler
    guidance: float | None
    seed: int
    fps: int
    backend: str
    switch_sink: str
    allow_pickle: bool
    kv_dtype: str | None = None

    @property
    def session_ids(self) -> list[str]:
        return list(self.prompts)


def validate_request(*, prompts: Sequence[str], checkpoint, generator, random_tiny: bool,
                     prompt_at: Mapping[int, str] | None, frames: int | None, seed: int, sessions: int, out,
                     steps: int | None, guidance: float | None, fps: int, backend: str, allow_pickle: bool,
                     switch_sink: str, kv_dtype: str | None = None) -> Request:
    """Every check :func:`run_generate` makes before it loads or builds anything.

    Raises:
      GenerateError: bad counts, a guidance scale that is not positive and finite, frames not a
        multiple of the chunk, a switch outside the run, a compiled backend for another platform,
        an unknown ``kv_dtype``,
        an incomplete checkpoint, an output that cannot be written, no ffmpeg.
    """
    if random_tiny == (checkpoint is not None):
        raise GenerateError("pass exactly one of --checkpoint DIR and --random-tiny")
    if generator is not None and checkpoint is None:
        raise GenerateError("--generator needs --checkpoint (the folder with the VAE, umT5 and tokenizer)")
    if not prompts:
        raise GenerateError("give at least one --prompt")
    if sessions < 1 or seed < 0 or fps < 1:
        raise GenerateError(f"sessions and fps must be >= 1 and seed >= 0, got {sessions}, {fps}, {seed}")
    if guidance is not None and not 0 < guidance < math.inf:
        raise GenerateError(f"--guidance must be a positive finite number, got {guidance}")
    platform = jax.devices()[0].platform
    try:
        check_backend(backend, platform)
        if kv_dtype is not None:
            canonical_kv_dtype(kv_dtype)
    except ValueError as error:
        raise GenerateError(str(error)) from None
    kind = "tiny" if random_tiny else "checkpoint"
    files = None if random_tiny else find_checkpoint(checkpoint, generator)
    chunk_frames = get_preset("tiny" if random_tiny else "wan-1.3b").geometry.frames_per_forward
    frames = DEFAULT_FRAMES[kind] if frames is None else frames
    if frames < 1 or frames % chunk_frames:
        raise GenerateError(f"--frames {frames}: must be a positive multiple of the {chunk_frames} latent frames "
                            f"of a chunk (e.g. {chunk_frames * max(1, -(-frames // chunk_frames))})")
    chunks = frames // chunk_frames
    if switch_sink not in SINK_MODES:
        raise GenerateError(f"--switch-sink must be one of {SINK_MODES}, got {switch_sink!r}")
    switches = dict(prompt_at or {})
    bad = sorted(c for c in switches if not 1 <= c < chunks)
    if bad:
        raise GenerateError(f"--prompt-at chunk {bad[0]}: switches happen before chunks 1..{chunks - 1} of this "
                            f"{chunks}-chunk run (chunk 0's prompt is --prompt)")
    paths = output_paths(out, sessions)
    prepare_outputs(paths)
    ffmpeg_exe()
    session_prompts = {f"s{i}": prompts[i % len(prompts)] for i in range(sessions)}
    return Request(kind, files, session_prompts, switches, frames, chunk_frames, chunks, paths,
                   Sampler(num_steps=steps or DEFAULT_STEPS[kind], guidance_scale=guidance), guidance, seed, fps,
                   backend, switch_sink, allow_pickle, kv_dtype)


@dataclasses.dataclass
class Run:
    """What :func:`build_run` made: the pipeline, the encoded text, the cache, its rollout and each
    session's VAE stream cache."""

    pipeline: Pipeline
    contexts: dict[str, np.ndarray]
    encoded: bool
    encode: Phase
    plan: object
    cache: PagedKVCache
    rollout: Rollout
    decoder_caches: dict[str, vae_lib.DecoderCache]


def build_run(request: Request, clock: CompileClock) -> Run:
    """Loads (or makes) the pipeline, encodes every prompt once, and builds the cache and rollout.

    Raises:
      GenerateError: a checkpoint part that does not load.
    """
    sampler = request.sampler
    pipeline = (tiny_pipeline(request.seed) if request.kind == "tiny"
                else load_pipeline(request.files, allow_pickle=request.allow_pickle))
    model = pipeline.model
    contexts: dict[str, np.ndarray] = {}
    encode = Phase(clock)
    encoded = pipeline.encode is not None
    if encoded:  # every distinct prompt once (umT5); the hash stand-in runs inside join instead
        texts = list(dict.fromkeys([*request.prompts.values(), *request.switches.values(),
                                    *([""] if sampler.num_branches > 1 else [])]))
        with encode:
            contexts = dict(zip(texts, pipeline.encode(texts)))
    pipeline.encode = None  # drops the encoder (umT5-XXL: 11 GB in bfloat16) before the DiT runs
    branches = ((KVBranch("positive", 0), KVBranch("negative", 1)) if request.guidance is not None
                else (KVBranch("main"),))
    cross = (CrossAttentionSpec("text", model.config.text_tokens),)
    ring_frame_bytes = int(np.prod(model.config.frame_shape)) * jnp.dtype(model.config.dtype).itemsize
    geometry = dataclasses.replace(pipeline.geometry, kv_dtype=request.kv_dtype)
    plan = rollout_plan(geometry, pipeline.window, branches, cross, len(request.prompts),
                        latent_frame_bytes=ring_frame_bytes if request.switches else None)
    cache = PagedKVCache(geometry, pipeline.window, branches, cross, plan=plan, backend=request.backend)
    h, w, _ = model.config.frame_shape
    decoder_caches = {sid: vae_lib.decoder_init_cache(pipeline.vae, h, w) for sid in request.session_ids}
    return Run(pipeline, contexts, encoded, encode, plan, cache, Rollout(model, cache, sampler, max_traces=1),
               decoder_caches)


def run_generate(*, prompts: Sequence[str], checkpoint: str | pathlib.Path | None = None,
                 generator: str | pathlib.Path | None = None, random_tiny: bool = False,
                 prompt_at: Mapping[int, str] | None = None, frames: int | None = None, seed: int = 0,
                 sessions: int = 1, out: str | pathlib.Path = "video.mp4", steps: int | None = None,
                 guidance: float | None = None, fps: int = DEFAULT_FPS, backend: str = "auto",
                 allow_pickle: bool = False, switch_sink: str = "keep", kv_dtype: str | None = None,
                 stdout: TextIO | None = None, stderr: TextIO | None = None,
                 progress: bool | None = None) -> GenerateResult:
    """Runs the command (the module docstring, ``docs/models.md``): :func:`validate_request`, :func:`build_run`,
    the chunk loop, the report. Session ``i`` gets ``prompts[i % len(prompts)]`` and noise seed
    ``seed + i``; ``prompt_at`` switches every session's prompt before the given chunks (1 and
    later), with KV recache (``switch_sink``: ``"keep"`` or ``"recompute"`` the sink). ``kv_dtype``
    stores the K/V pages as int8 or fp8 (``docs/kernels.md``, Quantized pages; ``None``: the model's
    dtype).

    Raises:
      GenerateError: what :func:`validate_request` refuses (before anything loads), or a checkpoint
        part that does not load.
    """
    stdout, stderr = stdout or sys.stdout, stderr or sys.stderr
    request = validate_request(prompts=prompts, checkpoint=checkpoint, generator=generator, random_tiny=random_tiny,
                               prompt_at=prompt_at, frames=frames, seed=seed, sessions=sessions, out=out,
                               steps=steps, guidance=guidance, fps=fps, backend=backend, allow_pickle=allow_pickle,
                               switch_sink=switch_sink, kv_dtype=kv_dtype)
    with CompileClock() as clock:
        run = build_run(request, clock)
        decoder = run.pipeline.vae
        h, w, _ = run.pipeline.model.config.frame_shape
        size = (h * decoder.config.spatial_factor, w * decoder.config.spatial_factor)
        video_frames = decoder.config.num_pixel_frames(request.frames, True)
        _print_header(stdout, request, run, size, video_frames)
        if progress is None:
            progress = all(getattr(stream, "isatty", lambda: False)() for stream in (stdout, stderr))
        timings, latents = _generate(request, run, clock, stdout, stderr, progress)
    _print_summary(stdout, timings, run, len(request.prompts))
    for sid, path in zip(request.session_ids, request.paths):
        print(f"wrote {path} ({video_frames} frames, {size[0]}x{size[1]}, {request.fps} fps; prompt "
              f"{request.prompts[sid]!r})", file=stdout)
    return GenerateResult(request.paths, video_frames, size, timings, run.encode.seconds - run.encode.compile_seconds,
                          run.encode.compile_seconds, latents)


def _print_header(stream: TextIO, request: Request, run: Run, size: tuple[int, int], video_frames: int) -> None:
    model, decoder, sampler = run.pipeline.model, run.pipeline.vae, request.sampler
    guidance_text = f"CFG {request.guidance}" if request.guidance is not None else "no CFG"
    print(f"arkv-jax generate: {plural(len(request.prompts), 'session')} x {request.frames} latent frames "
          f"({plural(request.chunks, 'chunk')} of {request.chunk_frames}) -> {video_frames} video frames of "
          f"{size[0]}x{size[1]} at {request.fps} fps each; {sampler.num_steps} denoise steps + 1 commit forward, "
          f"{guidance_text}", file=stream)
    print(f"model: {run.pipeline.description}", file=stream)
    print("memory plan (paged KV cache):", file=stream)
    print(run.plan.summary(), file=stream)
    stream_cache = next(iter(run.decoder_caches.values()))
    print(f"weights: DiT {format_bytes(_param_bytes(model))}, VAE decoder {format_bytes(_param_bytes(decoder))}; "
          f"VAE stream cache {format_bytes(_cache_bytes(stream_cache))} per session", file=stream)
    if run.encoded:
        print(f"text: {len(run.contexts)} prompt(s) encoded by umT5 in {run.encode.seconds:.2f} s "
              f"({run.encode.compile_seconds:.2f} s of it compiling)", file=stream)
    else:
        print("text: the DiT's hash stand-in (no encoder); each join computes its text K/V (the text column)",
              file=stream)
    if request.switches:
        print(f"prompt switches (KV recache, sink {request.switch_sink}): "
              + ", ".join(f"chunk {c}: {p!r}" for c, p in sorted(request.switches.items())), file=stream)


def _generate(request: Request, run: Run, clock: CompileClock, stdout: TextIO, stderr: TextIO,
              progress: bool) -> tuple[list[ChunkTiming], dict[str, np.ndarray]]:
    """The chunk loop: joins (chunk 0) or switches, the DiT step, the VAE decode and the mp4 writes
    of every chunk, each part timed; returns the timings and each session's latents."""
    import imageio

    rollout, cache, decoder, ids = run.rollout, run.cache, run.pipeline.vae, request.session_ids
    decoder_caches = run.decoder_caches
    negative = run.contexts.get("") if request.sampler.num_branches > 1 else None
    timings: list[ChunkTiming] = []
    # imageio-ffmpeg starts ffmpeg with subprocess (fork + exec at once, nothing of JAX's runs in the
    # child), which JAX's fork hook warns about; the warning does not apply, so it is silenced here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
        writers = {sid: imageio.get_writer(str(path), format="FFMPEG", mode="I", fps=request.fps, codec="libx264",
                                           pixelformat="yuv420p", quality=8, macro_block_size=1,
                                           ffmpeg_log_level="error")
                   for sid, path in zip(ids, request.paths)}
        print(f"{'chunk':>5}  {'text ms':>8}  {'recache ms':>10}  {'DiT ms':>9}  {'VAE ms':>9}  {'write ms':>8}  "
              f"{'compile ms':>10}  {'video frames/s':>14}", file=stdout)
        try:
            with tqdm(total=request.chunks, desc="generate", unit="chunk", file=stderr, disable=not progress) as bar:
                for chunk in range(request.chunks):
                    text, recache, dit, vae, write = (Phase(clock) for _ in range(5))
                    if chunk == 0:
                        with text:
                            for i, sid in enumerate(ids):
                                join(rollout, sid, request.prompts[sid], request.seed + i,
                                     run.contexts.get(request.prompts[sid]), negative)
                            jax.block_until_ready(cache.cross_attention_kv(rollout.text_cache))
                    elif chunk in request.switches:
                        prompt = request.switches[chunk]
                        with recache:
                            for sid in ids:
                                switch(rollout, sid, prompt, run.contexts.get(prompt), negative,
                                       request.switch_sink)
                            jax.block_until_ready(cache.cross_attention_kv(rollout.text_cache))
                    with dit:
                        result = rollout.step()
                    pixels = {}
                    with vae:
                        for i, sid in enumerate(result.session_ids):
                            out_frames, decoder_caches[sid] = vae_lib.decode_chunk(
                                decoder, decoder_caches[sid], result.latents[i], donate_cache=True,
                                backend=request.backend)
                            pixels[sid] = to_uint8(out_frames)
                    with write:
                        for sid, video in pixels.items():
                            for frame in video:
                                writers[sid].append_data(frame)
                    parts = (text, recache, dit, vae, write)
                    record = ChunkTiming(chunk, *(p.seconds - p.compile_seconds for p in parts),
                                         sum(p.compile_seconds for p in parts), sum(len(v) for v in pixels.values()))
                    timings.append(record)
                    rate = record.video_frames / record.seconds
                    print(f"{chunk:>5}  {record.text_s * 1e3:>8.1f}  {record.recache_s * 1e3:>10.1f}  "
                          f"{record.dit_s * 1e3:>9.1f}  {record.vae_s * 1e3:>9.1f}  {record.write_s * 1e3:>8.1f}  "
                          f"{record.compile_s * 1e3:>10.1f}  {rate:>14.1f}", file=stdout)
                    bar.set_postfix_str(f"{record.seconds * 1e3:.0f} ms, {rate:.1f} frames/s", refresh=False)
                    bar.update()
            latents = {sid: rollout.leave(sid) for sid in ids}
        finally:
            for writer in writers.values():
                writer.close()
    return timings, latents


def _print_summary(stream: TextIO, timings: Sequence[ChunkTiming], run: Run, sessions: int) -> None:
    """Totals; compilation, text and recache each on its own; the steady state: the median of the
    chunks that built no program and switched no prompt (:attr:`ChunkTiming.steady`)."""
    encode = run.encode.seconds
    total = sum(t.seconds for t in timings) + encode
    frames = sum(t.video_frames for t in timings)
    print(f"generated {frames} video frames ({plural(sessions, 'session')}) in {total:.2f} s "
          f"({frames / total:.1f} frames/s overall, compilation included)", file=stream)
    compiled = [t.chunk for t in timings if t.compile_s > 0]
    compile_s = sum(t.compile_s for t in timings) + run.encode.compile_seconds
    print(f"compilation: {compile_s:.2f} s" + (f", in chunks {', '.join(map(str, compiled))} (the first use of each "
                                               "program)" if compiled else "")
          + (f" and {run.encode.compile_seconds:.2f} s in the text encoder" if run.encode.compile_seconds else ""),
          file=stream)
    joins = sum(t.text_s for t in timings)
    encoded = (f"umT5 {encode - run.encode.compile_seconds:.2f} s up front (compilation excluded), "
               if run.encoded else "the hash stand-in (no encoder), ")
    print(f"text: {encoded}the joins' text K/V {joins * 1e3:.1f} ms", file=stream)
    switches = [t for t in timings if t.recache_s > 0]
    if switches:
        print("prompt switches (KV recache and text K/V, compilation excluded): "
              + ", ".join(f"chunk {t.chunk} {t.recache_s * 1e3:.1f} ms" for t in switches), file=stream)
    steady = [t for t in timings if t.steady]
    if not steady:
        print("steady state: none in this run (every chunk built a program or switched a prompt; run more "
              "--frames)", file=stream)
        return
    dit, vae = (float(np.median([getattr(t, f) for t in steady])) for f in ("dit_s", "vae_s"))
    seconds = float(np.median([t.seconds for t in steady]))
    rate = float(np.median([t.video_frames / t.seconds for t in steady]))
    print(f"steady state ({plural(len(steady), 'chunk')} that built no program and switched no prompt): "
          f"{seconds * 1e3:.1f} ms per chunk (median), DiT {dit * 1e3:.1f} ms, VAE {vae * 1e3:.1f} ms "
          f"({100 * vae / max(dit + vae, 1e-12):.0f}% of DiT + VAE), {rate:.1f} video frames/s", file=stream)


__all__ = [
    "CheckpointFiles", "ChunkTiming", "DEFAULT_FPS", "DEFAULT_FRAMES", "DEFAULT_STEPS", "GenerateError",
    "GenerateResult", "Pipeline", "Request", "Run", "build_run", "checkpoint_geometry", "ffmpeg_exe", "find_checkpoint",
    "join", "load_pipeline", "output_paths", "parse_prompt_at", "prepare_outputs", "run_generate", "switch",
    "tiny_pipeline", "to_uint8", "validate_request",
]
