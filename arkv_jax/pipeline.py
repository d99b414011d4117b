"""The whole streaming generator on one chip: its programs, the bytes they need and their time.

A :class:`Pipeline` names a generator's parts (DiT, VAE decoder, text encoder, sampler, cache
preset). :func:`chunk_program`, :func:`decode_program`, :func:`text_program` and
:func:`recache_program` give each program exactly as the rollout runs it, with abstract arguments,
so a compile-only TPU device compiles them at the real shape without a TPU or the weights;
:func:`measure` reads what the compiler decided (``memory_analysis``, and XLA:TPU's cycle estimate
via :mod:`pallas_kernels.tpu_cost`). :func:`plan_chip` is the planner's whole-chip mode: weights,
per-session state and each batch bucket's compiled temporaries first, K/V pages with the rest (the
seed's arithmetic, :func:`arkv_jax.planner.plan_memory`, for the pages). See ``docs/planning.md``
(The whole chip).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from arkv_jax.config import KVBranch, require_bool, require_positive
from arkv_jax.models import dit as dit_model
from arkv_jax.models import umt5
from arkv_jax.models import vae as vae_model
from arkv_jax.planner import MemoryPlan, format_bytes, plan_memory
from arkv_jax.presets import ModelPreset, get_preset
from arkv_jax.rollout import ChunkConfig, generate_chunk, recache_kv
from arkv_jax.samplers import Sampler
from arkv_jax.step import ChunkInputs
from pallas_kernels import adaln_mlp, causal_conv, cross_query, qkv_projection, upsample_conv
from pallas_kernels.causal_conv import ConvGeometry
from pallas_kernels.context_attention import ContextGeometry
from pallas_kernels.layout import empty_pool
from pallas_kernels.upsample_conv import UpsampleGeometry
from pallas_kernels.window_attention.geometry import WindowGeometry

Array = jax.Array

#: KV branches of a guided (CFG) session: the prompt's rows, then the negative prompt's.
CFG_BRANCHES = (KVBranch("positive", 0), KVBranch("negative", 1))


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """One streaming generator: what runs on the chip for every chunk and every prompt.

    Attributes:
      preset: the DiT's cache shape (a :data:`arkv_jax.presets.PRESETS` entry).
      dit: the DiT's shape (its ``dtype`` is the weights' and the K/V pages').
      vae: the VAE decoder's shape (its ``dtype`` is the weights' and, unless ``cache_dtype`` says
        otherwise, the stream cache's).
      text_encoder: the text encoder's shape.
      sampler: steps and guidance; with guidance every session has two KV branches.
      text_on_device: whether the text encoder's weights stay on the chip (else it runs on the
        host, once per prompt, and only its output moves).
      backend: the window-attention backend the programs use (:mod:`pallas_kernels.backend`).
      vae_backend: the backend of the VAE decoder's causal convolutions
        (:func:`arkv_jax.models.vae.decode_chunk`): the TPU kernel by default, for every 3x3x3
        convolution of at least 96 input channels, over the stream cache kept row-major (compiled
        at Wan 2.1's shape: the decode about twice as fast as XLA's, with smaller temporaries;
        ``docs/kernels.md``, Causal convolution).
      rows_in_turn: the chunk and recache programs run each forward's batch rows one after the
        other (:attr:`arkv_jax.rollout.ChunkConfig.rows_in_turn`, what ``Rollout`` does on one TPU
        device).
    """

    preset: ModelPreset
    dit: dit_model.DiTConfig
    vae: vae_model.WanVAEConfig
    text_encoder: umt5.UMT5EncoderConfig
    sampler: Sampler
    text_on_device: bool = False
    backend: str = "pallas_tpu"
    vae_backend: str = "pallas_tpu"
    rows_in_turn: bool = True

    def __post_init__(self):
        require_bool("text_on_device", self.text_on_device)
        require_bool("rows_in_turn", self.rows_in_turn)
        self.dit.check_cache(self.preset.geometry, self.preset.cross_attention[0])
        if self.vae.z_dim != self.dit.in_channels:
            raise ValueError(f"the VAE decodes {self.vae.z_dim}-channel latents; the DiT makes "
                             f"{self.dit.in_channels}")
        if self.text_encoder.dim != self.dit.text_dim:
            raise ValueError(f"the text encoder gives {self.text_encoder.dim}-wide tokens; the DiT reads "
                             f"{self.dit.text_dim}")

    @property
    def kv_branches(self) -> tuple[KVBranch, ...]:
        """The cache's KV branches: two with guidance, else the preset's."""
        return CFG_BRANCHES if self.sampler.num_branches == 2 else self.preset.kv_branches[:1]

    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        """``(F, H, W, C)`` of one chunk's latents."""
        return (self.preset.geometry.frames_per_forward, *self.dit.frame_shape)

    def with_(self, **changes) -> "Pipeline":
        """A copy with ``changes`` (``sampler=``, ``text_on_device=``, ...)."""
        return dataclasses.replace(self, **changes)

    def with_kv_dtype(self, kv_dtype: str | None) -> "Pipeline":
        """A copy whose K/V pages are stored as ``kv_dtype`` (:attr:`arkv_jax.config.CacheGeometry.kv_dtype`;
        ``None``: the compute dtype)."""
        geometry = dataclasses.replace(self.preset.geometry, kv_dtype=kv_dtype)
        return self.with_(preset=dataclasses.replace(self.preset, geometry=geometry))


#: The generators of the Wan-2.1-T2V-1.3B family at 480x832 in bfloat16: Self-Forcing's and
#: CausVid's samplers over the same DiT, VAE and umT5-XXL text encoder.
#: ``tiny`` is the demo's shape (a 4-channel VAE, the ``xla`` backend): it compiles in seconds.
PIPELINES: dict[str, Pipeline] = {
    **{name: Pipeline(get_preset("wan-1.3b"), dit_model.MODEL_CONFIGS["wan-1.3b"],
                      vae_model.WanVAEConfig(dtype="bfloat16"), umt5.UMT5_CONFIGS["umt5-xxl"], sampler)
       for name, sampler in (("self-forcing", Sampler.self_forcing()), ("causvid", Sampler.causvid()))},
    "tiny": Pipeline(get_preset("tiny"), dit_model.MODEL_CONFIGS["tiny"],
                     vae_model.WanVAEConfig(base_dim=8, z_dim=4, latents_mean=(0.0,) * 4, latents_std=(1.0,) * 4),
                     umt5.UMT5_CONFIGS["tiny"], Sampler(guidance_scale=3.0), backend="xla"),
}


# ------------------------------------------------------------------------------------------------
# Bytes that do not depend on the compiler
# ------------------------------------------------------------------------------------------------


def _abstract(module_type, config):
    return nnx.split(nnx.eval_shape(lambda: module_type(config, rngs=nnx.Rngs(0))))


def tree_bytes(tree) -> int:
    """Bytes of every array leaf of ``tree`` (arrays or ``ShapeDtypeStruct``)."""
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree))


def weight_bytes(pipeline: Pipeline) -> dict[str, int]:
    """Bytes of each model's weights on the chip: ``dit``, ``vae`` and (if on the device)
    ``text_encoder``."""
    out = {"dit": tree_bytes(_abstract(dit_model.CausalDiT, pipeline.dit)[1]),
           "vae": vae_model.decoder_param_bytes(pipeline.vae)}
    if pipeline.text_on_device:
        out["text_encoder"] = tree_bytes(_abstract(umt5.UMT5Encoder, pipeline.text_encoder)[1])
    return out


def session_state_bytes(pipeline: Pipeline) -> dict[str, int]:
    """Bytes one session keeps on the chip outside the K/V pool and its cross-attention cache:
    ``vae_stream_cache`` (the streaming decoder's cache as a TPU's HBM holds it, row-major with its
    channels padded to the lanes: :func:`arkv_jax.models.vae.stream_cache_bytes` with ``tpu_hbm``)
    and ``latent_ring`` (the latents a prompt switch recomputes the history from)."""
    _, h, w, c = pipeline.latent_shape
    window = pipeline.preset.window
    frame = h * w * c * jnp.dtype(pipeline.dit.dtype).itemsize
    return {"vae_stream_cache": vae_model.stream_cache_bytes(pipeline.vae, h, w, tpu_hbm=True),
            "latent_ring": window.latent_ring_frames(pipeline.latent_shape[0]) * frame}


# ------------------------------------------------------------------------------------------------
# The programs, with abstract arguments
# ------------------------------------------------------------------------------------------------


def _spec(sharding):
    return lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def _pool(pipeline: Pipeline, num_pages: int):
    """One abstract K (or V) pool of ``num_pages`` pages in the pages' storage dtype: an array, or
    a :class:`~pallas_kernels.layout.QuantizedPool` of values and scales."""
    g = pipeline.preset.geometry
    return jax.eval_shape(lambda: empty_pool(g.num_layers, num_pages, g.block_size, g.num_kv_heads,
                                             g.head_dim, g.page_dtype))


def chunk_program(pipeline: Pipeline, sessions: int, num_pages: int, sharding=None):
    """:func:`arkv_jax.rollout.generate_chunk` as ``Rollout.step()`` runs it for ``sessions``
    sessions over pools of ``num_pages`` pages: ``(fn, args)`` with ``args`` abstract
    (``ShapeDtypeStruct`` with ``sharding``), ``fn(*args) -> (latents, k, v)``."""
    require_positive("sessions", sessions)
    graphdef, params = _abstract(dit_model.CausalDiT, pipeline.dit)
    g, w = pipeline.preset.geometry, pipeline.preset.window
    rows = sessions * pipeline.sampler.num_branches
    frames, ppf = g.frames_per_forward, g.pages_per_frame
    spec = _spec(sharding)
    i32 = jax.ShapeDtypeStruct((rows,), jnp.int32)
    table = lambda width: jax.ShapeDtypeStruct((rows, width), jnp.int32)  # noqa: E731
    visible = w.sink_frames + w.window_frames
    inputs = ChunkInputs(rows=i32, pages=table(visible * ppf), lengths=i32, history_frames=table(visible),
                         first_frame=i32, write_pages=table(frames * ppf))
    pool = _pool(pipeline, num_pages)
    text = jax.ShapeDtypeStruct((rows, g.num_layers, pipeline.dit.text_tokens, g.num_kv_heads, g.head_dim),
                                jnp.dtype(pipeline.dit.dtype))
    noise = jax.ShapeDtypeStruct((sessions, pipeline.sampler.noise_draws, *pipeline.latent_shape), jnp.float32)
    config = ChunkConfig(graphdef, pipeline.sampler, frames, g.tokens_per_frame, pipeline.backend,
                         rows_in_turn=pipeline.rows_in_turn)
    args = jax.tree_util.tree_map(spec, (params, (pool, pool), inputs, (text, text), noise))
    return (lambda *a: generate_chunk(*a, config=config)), args


def decode_program(pipeline: Pipeline, sessions: int, sharding=None):
    """One chunk's streaming VAE decode for ``sessions`` streams past their first chunk
    (``F`` latent frames to ``4 F`` pixel frames each), as :func:`arkv_jax.models.vae.decode_chunk`
    runs it with the cache donated and the pipeline's ``vae_backend``: ``(fn, args, donate_argnums,
    out_shardings)``. With a ``sharding`` the cache comes in and goes out in the row-major format
    the decoder keeps it in (:func:`arkv_jax.models.vae.cache_formats`; ``out_shardings`` says so
    for the outputs, to be given to ``jax.jit``); without one, ``out_shardings`` is ``None``."""
    require_positive("sessions", sessions)
    graphdef, params = _abstract(vae_model.WanVAEDecoder, pipeline.vae)
    f, h, w, _ = pipeline.latent_shape
    cache = vae_model.abstract_cache(pipeline.vae, h, w, sessions, sharding=sharding, started=True)
    latents = jax.ShapeDtypeStruct((sessions, f, h, w, pipeline.vae.z_dim), jnp.dtype(pipeline.dit.dtype))
    params, latents = jax.tree_util.tree_map(_spec(sharding), (params, latents))
    out_shardings = None
    if sharding is not None:
        out_shardings = (sharding, vae_model.DecoderCache(tuple(e.format for e in cache.frames), started=True))

    def fn(params, cache, latents):
        return vae_model.decode_chunk(nnx.merge(graphdef, params), cache, latents, donate_cache=True,
                                      backend=pipeline.vae_backend)

    return fn, (params, cache, latents), (1,), out_shardings


def text_program(pipeline: Pipeline, sharding=None):
    """One prompt's conditioning: the text encoder over ``text_tokens`` ids, then the DiT's
    per-layer cross-attention K/V of it. ``(fn, args)``, ``fn(encoder params, dit params, ids,
    mask) -> (k, v)``."""
    enc_def, enc_params = _abstract(umt5.UMT5Encoder, pipeline.text_encoder)
    dit_def, dit_params = _abstract(dit_model.CausalDiT, pipeline.dit)
    tokens = pipeline.dit.text_tokens
    ids = jax.ShapeDtypeStruct((1, tokens), jnp.int32)

    def fn(enc_params, dit_params, ids, mask):
        context = nnx.merge(enc_def, enc_params).context(ids, mask, tokens)
        return nnx.merge(dit_def, dit_params).text_kv(context)

    return fn, jax.tree_util.tree_map(_spec(sharding), (enc_params, dit_params, ids, ids))


def recache_program(pipeline: Pipeline, num_pages: int, sharding=None):
    """A prompt switch's recache of one session (:func:`arkv_jax.rollout.recache_kv` of every
    history frame a chunk sees, :meth:`~arkv_jax.config.WindowPolicy.max_history`, for each of its
    branches) over pools of ``num_pages`` pages: ``(fn, args)``."""
    graphdef, params = _abstract(dit_model.CausalDiT, pipeline.dit)
    g, w = pipeline.preset.geometry, pipeline.preset.window
    rows, frames = pipeline.sampler.num_branches, w.max_history(g.frames_per_forward)
    i32 = jax.ShapeDtypeStruct((rows,), jnp.int32)
    table = lambda width: jax.ShapeDtypeStruct((rows, width), jnp.int32)  # noqa: E731
    visible = w.sink_frames + w.window_frames
    inputs = ChunkInputs(rows=i32, pages=table(visible * g.pages_per_frame), lengths=i32,
                         history_frames=table(visible), first_frame=i32,
                         write_pages=table(frames * g.pages_per_frame))
    pool = _pool(pipeline, num_pages)
    text = jax.ShapeDtypeStruct((g.num_layers, rows, pipeline.dit.text_tokens, g.num_kv_heads, g.head_dim),
                                jnp.dtype(pipeline.dit.dtype))
    latents = jax.ShapeDtypeStruct((1, frames, *pipeline.dit.frame_shape), jnp.dtype(pipeline.dit.dtype))
    config = ChunkConfig(graphdef, pipeline.sampler, g.frames_per_forward, g.tokens_per_frame, pipeline.backend,
                         rows_in_turn=pipeline.rows_in_turn)
    args = jax.tree_util.tree_map(_spec(sharding), (params, (pool, pool), inputs, (text, text), latents,
                                                    jax.ShapeDtypeStruct((), jnp.float32)))
    return (lambda *a: recache_kv(*a, config=config)), args


# ------------------------------------------------------------------------------------------------
# What the compiler decided
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ProgramFigures:
    """One compiled program's memory (``memory_analysis``) and XLA:TPU's time estimate.

    Attributes:
      argument_bytes, output_bytes, temp_bytes, alias_bytes: as the compiler reports them.
      xla_seconds: XLA:TPU's estimated cycles of everything outside Mosaic kernels, loops unrolled,
        at the chip clock (:func:`pallas_kernels.tpu_cost.program_cycles`).
      kernel_calls: Mosaic kernel calls per run, by kernel name and the rows each call runs
        (:attr:`pallas_kernels.tpu_cost.ProgramCost.kernel_calls`).
      unpriced: instruction runs the cost model gave no estimate (counted 0 in ``xla_seconds``).
      placeholder_copy_bytes: bytes written by copies the cost model priced with its placeholder;
        ``xla_seconds`` counts their round trip through HBM instead
        (:func:`pallas_kernels.tpu_cost.program_cycles`).
    """

    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    xla_seconds: float
    kernel_calls: dict[tuple[str, int], int]
    unpriced: int = 0
    placeholder_copy_bytes: int = 0

    @property
    def transient_bytes(self) -> int:
        """Bytes the program adds while it runs beyond its arguments: temporaries and the outputs
        that do not reuse a donated argument."""
        return self.temp_bytes + self.output_bytes - self.alias_bytes

    @property
    def peak_bytes(self) -> int:
        """Arguments plus :attr:`transient_bytes`."""
        return self.argument_bytes + self.transient_bytes


def chip_sharding(generation: str) -> jax.sharding.SingleDeviceSharding:
    """The sharding of one compile-only chip of ``generation`` (:mod:`pallas_kernels.tpu_aot`;
    needs libtpu), on which :func:`compile_for` compiles."""
    from pallas_kernels import tpu_aot

    return jax.sharding.SingleDeviceSharding(tpu_aot.compile_only_device(generation))


def compile_for(fn: Callable, args, generation: str, donate_argnums: Sequence[int] = (), out_shardings=None):
    """AOT-compiles ``fn(*args)`` (abstract ``args``) for one compile-only chip of ``generation``
    (:func:`chip_sharding`). Arguments without a sharding are placed on the chip; those with one
    (built on :func:`chip_sharding`, with a format) keep it, and ``out_shardings`` goes to
    ``jax.jit`` as it is."""
    sharding = chip_sharding(generation)
    (device,) = sharding.device_set
    args = jax.tree_util.tree_map(lambda x: x if x.sharding is not None else _spec(sharding)(x), args)
    with jax.default_device(device):
        return jax.jit(fn, donate_argnums=tuple(donate_argnums), out_shardings=out_shardings
                       ).trace(*args).lower().compile()


def measure(compiled, generation: str) -> ProgramFigures:
    """:class:`ProgramFigures` of a program compiled for ``generation``."""
    from pallas_kernels import tpu_aot, tpu_cost

    chip = tpu_aot.CHIPS[generation]
    mem = compiled.memory_analysis()
    cost = tpu_cost.program_cycles(compiled.as_text(), chip.hbm_bytes_per_cycle)
    return ProgramFigures(int(mem.argument_size_in_bytes), int(mem.output_size_in_bytes),
                          int(mem.temp_size_in_bytes), int(mem.alias_size_in_bytes),
                          cost.cycles / chip.clock_hz, cost.kernel_calls, cost.unpriced,
                          cost.placeholder_copy_bytes)


# ------------------------------------------------------------------------------------------------
# The whole-chip plan
# ------------------------------------------------------------------------------------------------

#: Sessions per chunk the whole-chip plan tries (the rollout's power-of-two buckets).
DEFAULT_BUCKETS = (1, 2, 4, 8)

#: Prices one Mosaic kernel call: ``(kernel name, batch rows) -> seconds`` on the planned chip.
KernelPricer = Callable[[str, int], float]


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    """The chip at one batch size: ``batch`` sessions resident, all in every chunk.

    Attributes:
      batch: sessions per chunk (and resident).
      chunk, decode: the compiled chunk program (minimal pools) and the batch's VAE decode
        (``None`` when the compiler refused one).
      transient_bytes: the larger of the two programs' :attr:`ProgramFigures.transient_bytes`
        (they run one after the other; ``None`` when refused).
      plan: the K/V pool with every byte left (:func:`arkv_jax.planner.plan_memory`), or ``None``
        when ``batch`` sessions do not fit.
      chunk_seconds: estimated seconds per chunk (DiT program, its kernels, the commit, the
        decode), or ``None`` without a kernel pricer or when refused.
      refused: the compiler's words when it refused a program of the batch for want of HBM
        (:func:`pallas_kernels.tpu_aot.hbm_refusal`; the batch does not fit), else ``None``.
    """

    batch: int
    chunk: ProgramFigures | None
    decode: ProgramFigures | None
    transient_bytes: int | None
    plan: MemoryPlan | None
    chunk_seconds: float | None
    refused: str | None = None

    @property
    def fits(self) -> bool:
        return self.plan is not None

    def video_fps(self, frames_per_chunk: int) -> tuple[float, float] | None:
        """``(per stream, per chip)`` video frames per second, or ``None`` without a time."""
        if self.chunk_seconds is None:
            return None
        per_stream = frames_per_chunk / self.chunk_seconds
        return per_stream, per_stream * self.batch


@dataclasses.dataclass(frozen=True)
class ChipPlan:
    """:func:`plan_chip`'s answer: what every byte of one chip is for, per batch bucket.

    Attributes:
      pipeline, generation: what was planned, for which chip.
      memory_bytes: the chip's memory; ``budget_bytes`` the share planned (``memory_fraction``).
      weights: bytes of each model's weights (:func:`weight_bytes`).
      session_state: bytes one session keeps outside the pool (:func:`session_state_bytes`).
      buckets: one :class:`BucketPlan` per batch tried, increasing.
    """

    pipeline: Pipeline
    generation: str
    memory_bytes: int
    budget_bytes: int
    weights: dict[str, int]
    session_state: dict[str, int]
    buckets: tuple[BucketPlan, ...]

    @property
    def streams_per_chip(self) -> int:
        """The most sessions the chip holds while running them all in one chunk (0: none fits)."""
        return max((b.batch for b in self.buckets if b.fits), default=0)

    @property
    def frames_per_chunk(self) -> int:
        """Video frames one chunk of latent frames decodes to (past the stream's first chunk)."""
        return self.pipeline.vae.num_pixel_frames(self.pipeline.latent_shape[0], first_chunk=False)

    def best_bucket(self) -> BucketPlan | None:
        """The fitting bucket with the most video frames per second per chip (``None`` if none fits
        or there is no time estimate)."""
        timed = [b for b in self.buckets if b.fits and b.chunk_seconds is not None]
        return max(timed, key=lambda b: b.video_fps(self.frames_per_chunk)[1], default=None)

    def to_dict(self) -> dict:
        """A JSON-ready dict: the chip, weights, session state, and per bucket its transient bytes,
        whether it fits, its pool and its estimated time."""
        best = self.best_bucket()
        buckets = []
        for b in self.buckets:
            fps = b.video_fps(self.frames_per_chunk)
            buckets.append(dict(batch=b.batch, fits=b.fits, transient_bytes=b.transient_bytes, refused=b.refused,
                                chunk_program=b.chunk and dataclasses.asdict(b.chunk),
                                decode_program=b.decode and dataclasses.asdict(b.decode),
                                pool_pages=b.plan.num_blocks_total if b.fits else None,
                                pool_bytes=b.plan.pool_bytes if b.fits else None,
                                chunk_seconds=b.chunk_seconds, fps_per_stream=fps[0] if fps else None,
                                fps_per_chip=fps[1] if fps else None))
        return dict(preset=self.pipeline.preset.name, kv_dtype=self.pipeline.preset.geometry.page_dtype,
                    generation=self.generation, memory_bytes=self.memory_bytes,
                    budget_bytes=self.budget_bytes, weights=self.weights, session_state=self.session_state,
                    streams_per_chip=self.streams_per_chip, best_batch=best.batch if best else None,
                    buckets=buckets)

    def to_json(self) -> str:
        """:meth:`to_dict` as one JSON object."""
        return json.dumps(self.to_dict(), sort_keys=True)

    def summary(self) -> str:
        """A readable account of what every byte of the chip is for, per batch bucket."""
        fb = format_bytes
        lines = [f"arkv-jax whole-chip plan: {self.pipeline.preset.name} on {self.generation}, "
                 f"{fb(self.budget_bytes)} planned of {fb(self.memory_bytes)}, "
                 f"K/V pages in {self.pipeline.preset.geometry.page_dtype}"]
        lines += [f"  weights: {name}: {fb(n)}" for name, n in self.weights.items()]
        lines += [f"  per session: {name}: {fb(n)}" for name, n in self.session_state.items()]
        for b in self.buckets:
            if b.refused:
                lines.append(f"  batch {b.batch}: does not fit, the compiler refuses it: {b.refused}")
                continue
            head = f"  batch {b.batch}: the programs' transient bytes {fb(b.transient_bytes)}"
            if not b.fits:
                lines.append(head + ": does not fit")
                continue
            p = b.plan
            lines.append(head + f"; K/V pool {fb(p.pool_bytes)} ({p.num_blocks_total} pages); "
                                f"cross-attention {fb(p.cross_attention_reserved_bytes)}; "
                                f"session state {fb(p.model_owned_state_reserved_bytes)}")
            fps = b.video_fps(self.frames_per_chunk)
            if fps:
                lines.append(f"    {b.chunk_seconds:.3f} s per chunk: {fps[0]:.1f} frames/s per stream, "
                             f"{fps[1]:.1f} per chip (compiler estimate)")
        lines.append(f"  streams per chip: {self.streams_per_chip}")
        return "\n".join(lines)


def _pages_for(pipeline: Pipeline, sessions: int) -> int:
    """Pages of the smallest pool that runs ``sessions`` sessions in one chunk."""
    from arkv_jax.planner import rollout_plan

    preset = pipeline.preset
    return rollout_plan(preset.geometry, preset.window, pipeline.kv_branches, preset.cross_attention,
                        sessions).num_blocks_total


def attention_geometry(pipeline: Pipeline, rows: int) -> WindowGeometry:
    """One layer's window-attention call of a chunk of ``rows`` batch rows in steady state: the
    chunk over every history frame its window lets it see
    (:meth:`~arkv_jax.config.WindowPolicy.max_history`)."""
    g, w = pipeline.preset.geometry, pipeline.preset.window
    cur = g.frames_per_forward * g.tokens_per_frame
    max_pages = w.max_history(g.frames_per_forward) * g.pages_per_frame
    heads = pipeline.dit.num_heads
    return WindowGeometry(rows, cur, heads, g.num_kv_heads, g.head_dim, cur, 0, g.num_layers, rows * max_pages + 1,
                          g.block_size, max_pages, g.tokens_per_frame)


def context_geometry(pipeline: Pipeline, rows: int) -> ContextGeometry:
    """One layer's text cross-attention of a chunk of ``rows`` batch rows: the chunk's tokens over
    the prompt's ``text_tokens``."""
    g, cfg = pipeline.preset.geometry, pipeline.dit
    return ContextGeometry(rows, g.frames_per_forward * g.tokens_per_frame, cfg.num_heads, cfg.num_kv_heads,
                           cfg.head_dim, cfg.text_tokens)


def attention_pricer(pipeline: Pipeline, generation: str) -> KernelPricer:
    """Prices the chunk program's and the VAE decode's Mosaic calls for ``generation``: the paged
    window-attention kernel at :func:`attention_geometry` (with the rotary tables the DiT hands
    it), the context-attention kernel at :func:`context_geometry` and each causal or upsampling
    convolution and the DiT's q/k/v projection, cross query and adaLN MLP at the geometry its
    kernel name spells (:func:`pallas_kernels.causal_conv.geometry_of_kernel`,
    :func:`pallas_kernels.upsample_conv.geometry_of_kernel`,
    :func:`pallas_kernels.qkv_projection.geometry_of_kernel`,
    :func:`pallas_kernels.cross_query.geometry_of_kernel`,
    :func:`pallas_kernels.adaln_mlp.geometry_of_kernel`; ``rows`` is unused), each by its bundle
    estimate (:func:`pallas_kernels.window_attention.tpu_estimate.estimate`, one compile per kernel
    and shape; the XLA ops around each call are in the program's own cycles)."""

    def price(name: str, rows: int) -> float:
        for convolution in (causal_conv, upsample_conv):
            if name.startswith(convolution.KERNEL_PREFIX):
                return _kernel_seconds(convolution.geometry_of_kernel(name), pipeline.vae.dtype, generation)
        for block_step in (qkv_projection, cross_query, adaln_mlp):
            if name.startswith(block_step.KERNEL_PREFIX):
                return _kernel_seconds(block_step.geometry_of_kernel(name), pipeline.dit.dtype, generation)
        if name == "window_attention_tpu":  # The DiT hands it the normalized chunk and its tables.
            return _kernel_seconds(attention_geometry(pipeline, rows), pipeline.dit.dtype, generation,
                                   pipeline.preset.geometry.page_dtype, rope=True)
        if name == "context_attention_tpu":
            return _kernel_seconds(context_geometry(pipeline, rows), pipeline.dit.dtype, generation)
        raise ValueError(f"no estimate for the Mosaic kernel {name!r}")

    return price


@functools.lru_cache(maxsize=None)
def _kernel_seconds(geom: WindowGeometry | ContextGeometry | ConvGeometry | UpsampleGeometry | adaln_mlp.MLPGeometry
                    | cross_query.QueryGeometry | qkv_projection.ProjectionGeometry,
                    dtype: str, generation: str, kv_dtype: str | None = None, rope: bool = False,
                    qk_norm: bool = False) -> float:
    from pallas_kernels.window_attention import tpu_estimate

    return tpu_estimate.estimate(geom, dtype, generation, kv_dtype, rope, qk_norm).seconds


def commit_seconds(pipeline: Pipeline, sessions: int, generation: str) -> float:
    """The paged write of one chunk's K/V, at HBM bandwidth: it reads the chunk in the compute dtype
    and writes its pages at their stored width (:mod:`pallas_kernels.paged_write`; its DMA issue
    hides under that, ``benchmarks/tpu_compile.py``)."""
    from pallas_kernels import tpu_aot

    g = pipeline.preset.geometry
    rows = sessions * pipeline.sampler.num_branches
    chunk = 2 * rows * g.num_layers * g.frames_per_forward * g.tokens_per_frame * g.num_kv_heads * g.head_dim
    width = jnp.dtype(g.dtype).itemsize + jnp.dtype(g.page_dtype).itemsize
    return chunk * width / tpu_aot.CHIPS[generation].hbm_bytes_per_s


def program_seconds(program: ProgramFigures, kernel_seconds: KernelPricer) -> float:
    """Estimated seconds of a compiled program: XLA's estimate outside its Mosaic kernels plus each
    kernel call priced by ``kernel_seconds`` at the rows it runs."""
    return program.xla_seconds + sum(calls * kernel_seconds(name, rows)
                                     for (name, rows), calls in program.kernel_calls.items())


def chunk_seconds(pipeline: Pipeline, sessions: int, generation: str, chunk: ProgramFigures,
                  decode: ProgramFigures, kernel_seconds: KernelPricer) -> float:
    """Estimated seconds of one chunk of ``sessions`` sessions: XLA's estimate of the chunk program
    outside its kernels, each kernel call priced by ``kernel_seconds``, the commit
    (:func:`commit_seconds`) and the VAE decode (both programs by :func:`program_seconds`)."""
    return (program_seconds(chunk, kernel_seconds) + commit_seconds(pipeline, sessions, generation)
            + program_seconds(decode, kernel_seconds))


@functools.lru_cache(maxsize=None)
def chunk_figures(pipeline: Pipeline, sessions: int, num_pages: int, generation: str) -> ProgramFigures:
    """:class:`ProgramFigures` of :func:`chunk_program` compiled for ``generation`` (once per
    pipeline, batch, pool size and chip)."""
    fn, args = chunk_program(pipeline, sessions, num_pages)
    return measure(compile_for(fn, args, generation), generation)


@functools.lru_cache(maxsize=None)
def decode_figures(pipeline: Pipeline, sessions: int, generation: str) -> ProgramFigures:
    """:class:`ProgramFigures` of :func:`decode_program` compiled for ``generation`` (once per
    decoder shape, batch and chip: the decode does not depend on the sampler)."""
    fn, args, donate, out_shardings = decode_program(pipeline, sessions, chip_sharding(generation))
    return measure(compile_for(fn, args, generation, donate, out_shardings), generation)


def dit_flops(pipeline: Pipeline, sessions: int) -> int:
    """Matmul FLOPs of one chunk's DiT forwards (``num_steps`` denoise + 1 commit) for
    ``sessions`` sessions, each row's chunk attending its whole window: per layer and token,
    ``2 (6 d^2 + 2 d f)`` for q/k/v/o, the cross-attention's q/o and the MLP, ``4 d K`` for
    self-attention over ``K`` keys (the history a chunk sees plus the chunk) and ``4 d T`` for
    cross-attention over ``T`` text tokens; the commit forward's last layer only its k and v
    projections, ``4 d^2`` (``CausalDiT.commit_kv``)."""
    g, w, cfg = pipeline.preset.geometry, pipeline.preset.window, pipeline.dit
    tokens = g.frames_per_forward * g.tokens_per_frame
    keys = w.max_history(g.frames_per_forward) * g.tokens_per_frame + tokens
    d = cfg.dim
    per_token = 2 * (6 * d * d + 2 * d * cfg.ffn_dim) + 4 * d * keys + 4 * d * cfg.text_tokens
    full_layers = cfg.num_layers * (pipeline.sampler.num_steps + 1) - 1
    rows = sessions * pipeline.sampler.num_branches
    return (per_token * full_layers + 4 * d * d) * tokens * rows


def plan_bucket(pipeline: Pipeline, batch: int, generation: str, budget: int,
                kernel_seconds: KernelPricer | None = None) -> BucketPlan:
    """One :class:`BucketPlan`: compiles the batch's chunk program and VAE decode for
    ``generation``, then gives the K/V pool what ``budget`` leaves after the weights, the
    programs' transient bytes and ``batch`` sessions' state. A program the compiler refuses for
    want of HBM makes a bucket that does not fit (:attr:`BucketPlan.refused`); other compile
    errors propagate."""
    from pallas_kernels import tpu_aot

    try:
        chunk = chunk_figures(pipeline, batch, _pages_for(pipeline, batch), generation)
        decode = decode_figures(pipeline.with_(sampler=Sampler()), batch, generation)
    except Exception as error:  # the compiler's error class differs across jax releases
        refusal = tpu_aot.hbm_refusal(error)
        if refusal is None:
            raise
        return BucketPlan(batch, None, None, None, None, None, refused=refusal)
    transient = max(chunk.transient_bytes, decode.transient_bytes)
    preset = pipeline.preset
    available = budget - sum(weight_bytes(pipeline).values()) - transient
    plan = None
    if available > 0:
        try:
            plan = plan_memory(preset.geometry, preset.window, pipeline.kv_branches, available_bytes=available,
                               memory_fraction=1.0, session_capacity=batch,
                               cross_attention=preset.cross_attention,
                               model_owned_state_bytes_per_session=sum(session_state_bytes(pipeline).values()),
                               batched_in_flight=True)
        except ValueError:  # InsufficientMemoryError: not even one session
            plan = None
        if plan is not None and plan.budget_session_capacity < batch:
            plan = None
    seconds = (None if kernel_seconds is None else
               chunk_seconds(pipeline, batch, generation, chunk, decode, kernel_seconds))
    return BucketPlan(batch, chunk, decode, transient, plan, seconds)


def plan_chip(pipeline: Pipeline, generation: str, *, memory_bytes: int | None = None,
              memory_fraction: float = 1.0, buckets: Sequence[int] = DEFAULT_BUCKETS,
              kernel_seconds: KernelPricer | None = None) -> ChipPlan:
    """The whole-chip plan of ``pipeline`` on one ``generation`` TPU (compile-only: needs libtpu).

    For each batch in ``buckets`` (increasing; stops after the first that does not fit) it
    compiles the chunk program and the VAE decode (:func:`plan_bucket`), so temporaries come from
    the compiler, as a profiling run would give them on a device; between the last batch that fits
    and the first that does not, it bisects for the largest that fits.

    Args:
      memory_bytes: the chip's memory (default: the HBM the compiler lets one program use,
        :func:`pallas_kernels.tpu_aot.available_hbm_bytes`).
      memory_fraction: the share of it to plan, in (0, 1].
      kernel_seconds: prices Mosaic kernel calls for the time estimate (``None``: no estimate).
    """
    from pallas_kernels import tpu_aot

    tpu_aot.check_generation(generation)
    memory_bytes = tpu_aot.available_hbm_bytes(generation) if memory_bytes is None else memory_bytes
    require_positive("memory_bytes", memory_bytes)
    if not 0.0 < memory_fraction <= 1.0:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
    budget = int(memory_bytes * memory_fraction)
    planned: dict[int, BucketPlan] = {}
    for batch in sorted(set(buckets)):
        planned[batch] = plan_bucket(pipeline, batch, generation, budget, kernel_seconds)
        if not planned[batch].fits:
            break
    fits = [b for b, p in planned.items() if p.fits]
    fails = [b for b, p in planned.items() if not p.fits]
    low, high = (max(fits), min(fails)) if fits and fails else (0, 0)
    while high - low > 1:  # whatever fits between the last bucket that fits and the first that does not
        mid = (low + high) // 2
        planned[mid] = plan_bucket(pipeline, mid, generation, budget, kernel_seconds)
        low, high = (mid, high) if planned[mid].fits else (low, mid)
    return ChipPlan(pipeline, generation, int(memory_bytes), budget, weight_bytes(pipeline),
                    session_state_bytes(pipeline), tuple(planned[b] for b in sorted(planned)))


def compiled_total(pipeline: Pipeline, bucket: BucketPlan, generation: str) -> int:
    """Bytes on the chip at the peak of a planned bucket, from the compiler: the chunk program
    compiled over pools of the planned size and the VAE decode, each with its arguments and
    transient bytes, plus what stays resident outside it (the other model's weights and state).
    The planner's total over this is ``plan_vs_compiled_bytes``."""
    plan = bucket.plan
    chunk = chunk_figures(pipeline, bucket.batch, plan.num_blocks_total, generation)
    _, args = chunk_program(pipeline, bucket.batch, plan.num_blocks_total)
    weights, state = weight_bytes(pipeline), session_state_bytes(pipeline)
    text_encoder = weights.get("text_encoder", 0)
    outside_chunk = weights["vae"] + text_encoder + bucket.batch * sum(state.values())
    dit_resident = chunk.argument_bytes - tree_bytes(args[2]) - tree_bytes(args[4])  # weights, pools, text K/V
    outside_decode = dit_resident + text_encoder + bucket.batch * state["latent_ring"]
    return max(chunk.peak_bytes + outside_chunk, bucket.decode.peak_bytes + outside_decode)


def predicted_total(pipeline: Pipeline, bucket: BucketPlan) -> int:
    """The planner's bytes for a fitting bucket: weights, the pool, the sessions' cross-attention
    caches and state, and the programs' transient bytes."""
    plan = bucket.plan
    return (sum(weight_bytes(pipeline).values()) + plan.pool_bytes + plan.cross_attention_reserved_bytes
            + plan.model_owned_state_reserved_bytes + bucket.transient_bytes)
