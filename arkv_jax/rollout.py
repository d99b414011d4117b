"""The chunk loop: many sessions generate video chunk by chunk through one paged KV cache.

Per chunk, for every active session at once (:meth:`Rollout.step`):

1. ``cache.chunk(...)`` hands out the visible pages of every row (session x KV branch) and allocates
   the chunk's pages in a pending state. Sessions may be at different frame indices.
2. :func:`generate_chunk`, jitted once per batch bucket, runs the whole chunk on device: from each
   session's noise draws (drawn on the host from its seed, chunk counter and draw index,
   :func:`arkv_jax.samplers.session_noise`), ``num_steps`` sampler steps of the :class:`Sampler`
   (deterministic Euler on Wan's shifted schedule by default; the distilled checkpoints' x0 update
   with fresh noise and their warped timestep lists as presets, :data:`SAMPLERS`), every step a
   read-only forward over the pools (the current chunk's K/V go straight to the attention kernel),
   then one commit forward on the clean latents at timestep 0 (or, with ``context_noise``, on them
   noised to that timestep) that returns every layer's K/V.
3. ``step.commit(k, v)`` writes those K/V into the chunk's pages (the cache's jitted write donates
   the pools, so it is in place) and commits (advance + evict).

:func:`generate_chunk` is a pure function of ``(params, pools, inputs, text K/V, noise)`` and a
static, hashable :class:`ChunkConfig`; it knows nothing of sessions or of the cache facade, so a
model author can drive it from their own loop (``cache.chunk`` around it, as :meth:`Rollout.step`
does). It only reads the pools, so it does not donate them.

CFG. With a guidance scale, each session has two rows (the cache's first two KV branches: prompt,
then the empty prompt), laid out session-major, branch-minor exactly as ``cache.rows`` orders them,
so both branches of every session run in *one* batched forward; the velocity is
``v_neg + g (v_pos - v_neg)``. Both branches commit their own K/V of the same clean latents.

Join and leave. :meth:`Rollout.join` opens a session in the cache and publishes its text K/V (per
branch) in the cache's cross-attention store, from text-encoder outputs (``context=``,
``negative_context=``: ``[tokens, text_dim]``, zero-padded to the model's ``text_tokens``) or, for
the demo and tests without a text encoder, the hash stand-in of a prompt string; :meth:`Rollout.leave`
closes it, which frees its pages and its text rows.

Batches. On one device a chunk runs the live sessions only, padded with padding rows (no history,
zero text, nothing written) to the smallest of a few bucketed sizes (powers of two up to
``max_sessions``), so one live stream in a 16-slot cache pays for one row, not 16, and the chunk
function is traced once per bucket used; ``num_traces`` counts the traces, ``max_traces`` bounds
them per bucket. ``full_batch=True`` (always on a mesh) runs the cache's full batch instead: every
slot, one shape for the whole run.

Devices. With a sharded cache (``PagedKVCache(..., mesh=...)``) the same code runs on the mesh: the
noise and the batch are split over ``"data"`` like the cache's slots, attention runs per device
through :func:`arkv_jax.sharded_kernels.sharded_window_attention` (heads over ``"model"``), the blocks'
weights are split over ``"model"`` tensor-parallel style
(:func:`arkv_jax.models.dit.tensor_parallel_specs`; the rest is replicated), and XLA partitions the
model's computation to match, adding one all-reduce per row-parallel layer.

The exactness reference, :class:`arkv_jax.reference.FullRecompute`, generates the same videos
without any cache from the same :class:`Sampler`, noise draws and :mod:`arkv_jax.samplers` math.

One module for the rollout: the sampler, the pure chunk function and its config, and the
:class:`Rollout` loop that jits it are one contract; the sampler math is in :mod:`arkv_jax.samplers`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from arkv_jax import samplers
from arkv_jax.cache import PagedKVCache
from arkv_jax.config import ArgumentTypeError, require_positive, require_real
from arkv_jax.models.dit import CausalDiT, prompt_embedding, tensor_parallel_specs
from arkv_jax.nnx import PagedHistory
from arkv_jax.sharded_kernels import gather_rows, take_rows
from arkv_jax.sharding import DATA, MODEL
from arkv_jax.step import PADDING, ChunkInputs

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Sampler:
    """Few-step flow-matching sampler (the math: :mod:`arkv_jax.samplers`, with the table of which
    checkpoint uses which preset).

    Presets: :meth:`euler` (the default ``Sampler()``: deterministic Euler, random weights and the
    demo), :meth:`self_forcing`, :meth:`longlive`, :meth:`causvid`; by name in :data:`SAMPLERS`.

    Attributes:
      num_steps: denoise forwards per chunk (then one commit forward).
      shift: Wan's timestep shift warp ``sigma' = shift s / (1 + (shift - 1) s)``, applied to ``s``
        evenly spaced from 1 to 0, or to ``timesteps / 1000`` (1: the list is used as is).
      guidance_scale: classifier-free guidance scale, or ``None`` for no CFG (one KV branch).
      timesteps: explicit denoising timesteps in ``(0, 1000]``, strictly decreasing, one per step
        (``len == num_steps``), warped with ``shift``; ``None``: evenly spaced.
      update: ``"euler"`` (deterministic Euler steps) or ``"x0"`` (x0 prediction ``x - sigma v``,
        re-noised to the next level with fresh per-session, per-step noise).
      context_noise: timestep in ``[0, 1000)`` of the commit forward; above 0 it runs on the clean
        latents noised to ``context_noise / 1000`` with a fresh draw (Self-Forcing's
        ``context_noise``); 0: clean latents at ``t = 0``.
    """

    num_steps: int = 3
    shift: float = 5.0
    guidance_scale: float | None = None
    timesteps: tuple[float, ...] | None = None
    update: str = "euler"
    context_noise: float = 0.0

    def __post_init__(self):
        require_positive("num_steps", self.num_steps)
        require_real("shift", self.shift, low=0.0, low_open=True)
        if self.guidance_scale is not None:
            require_real("guidance_scale", self.guidance_scale)
        if self.timesteps is not None:
            ts = tuple(require_real("timesteps", t) for t in self.timesteps)
            if len(ts) != self.num_steps:
                raise ValueError(f"timesteps has {len(ts)} entries for num_steps={self.num_steps}: {ts}")
            if not all(0 < t <= 1000 for t in ts) or any(a <= b for a, b in zip(ts, ts[1:])):
                raise ValueError(f"timesteps must be strictly decreasing in (0, 1000], got {ts}")
            object.__setattr__(self, "timesteps", ts)
        if self.update not in samplers.UPDATES:
            raise ValueError(f"update must be one of {samplers.UPDATES}, got {self.update!r}")
        require_real("context_noise", self.context_noise, low=0.0)
        if not self.context_noise < 1000.0:
            raise ValueError(f"context_noise must be a timestep in [0, 1000), got {self.context_noise!r}")

    @property
    def num_branches(self) -> int:
        """KV branches per session: 2 with CFG, else 1."""
        return 1 if self.guidance_scale is None else 2

    @property
    def noise_draws(self) -> int:
        """Standard-normal draws of the chunk's shape each session needs per chunk: the starting
        noise, ``num_steps - 1`` fresh ones for ``"x0"``, one for ``context_noise``."""
        return 1 + (self.num_steps - 1 if self.update == "x0" else 0) + (self.context_noise > 0)

    def sigmas(self) -> np.ndarray:
        """float32 ``[num_steps + 1]`` noise levels, decreasing to 0 (model timestep = 1000 sigma)."""
        return samplers.schedule(self.num_steps, self.shift, self.timesteps)

    # -- presets (see the table in :mod:`arkv_jax.samplers`) ----------------------------------------
    @classmethod
    def euler(cls, num_steps: int = 3, shift: float = 5.0, guidance_scale: float | None = None) -> "Sampler":
        """Deterministic Euler on Wan's shifted even schedule: ``Sampler()`` (random weights, demo)."""
        return cls(num_steps, shift, guidance_scale)

    @classmethod
    def self_forcing(cls, guidance_scale: float | None = None, context_noise: float = 0.0) -> "Sampler":
        """Self-Forcing's DMD checkpoints: timesteps ``[1000, 750, 500, 250]`` warped with shift 5
        (1000, 937.5, 833.3, 625), x0 update with fresh noise, no CFG."""
        return cls(4, 5.0, guidance_scale, (1000.0, 750.0, 500.0, 250.0), "x0", context_noise)

    @classmethod
    def longlive(cls, guidance_scale: float | None = None, context_noise: float = 0.0) -> "Sampler":
        """LongLive (built on Self-Forcing): the same 4-step warped schedule and x0 update."""
        return cls.self_forcing(guidance_scale, context_noise)

    @classmethod
    def causvid(cls, guidance_scale: float | None = None, context_noise: float = 0.0) -> "Sampler":
        """CausVid's DMD Wan checkpoint: timesteps ``[1000, 757, 522]`` used as is (shift 1), x0
        update with fresh noise, no CFG."""
        return cls(3, 1.0, guidance_scale, (1000.0, 757.0, 522.0), "x0", context_noise)


#: Sampler presets by name (factories: ``SAMPLERS["self_forcing"]()``).
SAMPLERS: dict[str, Callable[..., Sampler]] = {
    "euler": Sampler.euler, "self_forcing": Sampler.self_forcing, "longlive": Sampler.longlive,
    "causvid": Sampler.causvid,
}


def chunk_noise(seed: int, chunk_index: int, shape: tuple[int, ...]) -> np.ndarray:
    """float32 ``shape`` standard normal starting noise of chunk ``chunk_index`` of the session
    seeded ``seed``: NumPy's PCG64 seeded with ``(seed, chunk_index)``, so it is the same on every
    machine and whichever sessions share a batch. Drawn on the host: a few hundred KB per session
    and chunk at Wan's shape, and no random-number program to compile (threefry costs seconds of
    XLA:CPU compile time)."""
    return np.random.default_rng((seed, chunk_index)).standard_normal(shape, np.float32)


def combine_branches(out: Array, num_branches: int, guidance: float | None) -> Array:
    """Per-session velocity from the rows' outputs ``[S * num_branches, ...]`` (session-major):
    the only branch, or ``neg + guidance (pos - neg)``."""
    out = out.reshape(-1, num_branches, *out.shape[1:])
    if num_branches == 1:
        return out[:, 0]
    return out[:, 1] + guidance * (out[:, 0] - out[:, 1])


#: Euler steps (kept under its old name): :func:`arkv_jax.samplers.euler`.
denoise = samplers.euler


@functools.partial(jax.jit, static_argnums=0)
def context_kv(graphdef: nnx.GraphDef, params: nnx.State, context: Array) -> tuple[Array, Array]:
    """The model's per-layer text K/V ``(k, v)``, each ``[L, B, T, Hkv, D]``, of ``context``
    ``[B, T, text_dim]`` (from :func:`arkv_jax.models.dit.prompt_embedding`); ``graphdef`` and
    ``params`` from ``nnx.split(model)``."""
    return nnx.merge(graphdef, params).text_kv(context)


def text_branches(prompt: str, num_branches: int) -> tuple[str, ...]:
    """The prompts of a session's branches: the prompt, then the empty prompt (CFG negative)."""
    return (prompt, "")[:num_branches]


def pad_context(context, num_tokens: int, text_dim: int, name: str = "context") -> np.ndarray:
    """A text encoder's output for one prompt as the model's text context: float32
    ``[num_tokens, text_dim]``, zero-padded after its tokens as Wan pads umT5's real tokens to 512.

    Args:
      context: ``[tokens, text_dim]`` (any float dtype, host or device), ``tokens <= num_tokens``.
      name: what to call it in errors.

    Raises:
      ValueError: not 2-D, another ``text_dim``, or more than ``num_tokens`` tokens.
    """
    shape = tuple(np.shape(context))
    if len(shape) != 2 or shape[1] != text_dim:
        raise ValueError(f"{name} must be [tokens, text_dim] = [<= {num_tokens}, {text_dim}] (one prompt's "
                         f"text-encoder output), got shape {shape}")
    if shape[0] > num_tokens:
        raise ValueError(f"{name} has {shape[0]} tokens (shape {shape}); the model's text cache holds "
                         f"{num_tokens} (shape ({num_tokens}, {text_dim})): truncate the prompt's tokens")
    out = np.zeros((num_tokens, text_dim), np.float32)
    out[:shape[0]] = np.asarray(context, np.float32)
    return out


def branch_contexts(num_tokens: int, text_dim: int, num_branches: int, prompt: str | None = None,
                    context=None, negative_context=None) -> list[np.ndarray]:
    """The text context ``[num_tokens, text_dim]`` of each KV branch of a session (prompt, then CFG
    negative), from text-encoder outputs (:func:`pad_context`) or, without ``context``, from the
    hash stand-in :func:`arkv_jax.models.dit.prompt_embedding` of ``prompt`` and ``""`` (demo,
    tests).

    Raises:
      ValueError: both or neither of ``prompt`` and ``context``; ``negative_context`` missing with
        CFG (Wan's negative is an encoded negative prompt, not zeros), given without CFG or without
        ``context``; bad shapes (:func:`pad_context`).
    """
    if context is None:
        if negative_context is not None:
            raise ValueError("negative_context needs context= (the encoded prompt) too")
        if not isinstance(prompt, str):
            raise ValueError(f"pass a prompt (hashed stand-in encoder) or context= (text-encoder output), "
                             f"got prompt={prompt!r}")
        return [prompt_embedding(text, num_tokens, text_dim) for text in text_branches(prompt, num_branches)]
    if prompt is not None:
        raise ValueError("pass a prompt (hashed stand-in encoder) or context=, not both")
    if num_branches == 1 and negative_context is not None:
        raise ValueError("negative_context given but the sampler has no guidance (one KV branch)")
    if num_branches == 2 and negative_context is None:
        raise ValueError("guidance needs negative_context= (the encoded negative prompt, e.g. Wan's "
                         "sample_neg_prompt) beside context=")
    pairs = [("context", context), ("negative_context", negative_context)][:num_branches]
    return [pad_context(value, num_tokens, text_dim, name) for name, value in pairs]


@dataclasses.dataclass(frozen=True)
class ChunkConfig:
    """The static part of :func:`generate_chunk`: what is fixed for a whole rollout (hashable).

    Attributes:
      graphdef: the model's graph, ``nnx.split(model)[0]``.
      sampler: steps, shift and guidance; ``sampler.num_branches`` rows per session.
      chunk_frames: frames ``F`` per chunk.
      tokens_per_frame: the cache's tokens per frame.
      backend: window-attention backend (:mod:`pallas_kernels.backend`).
      mesh: the cache's mesh (``PagedKVCache.mesh``): attention then runs on every device's rows
        and heads; ``None`` for one device.
    """

    graphdef: nnx.GraphDef
    sampler: Sampler
    chunk_frames: int
    tokens_per_frame: int
    backend: str = "auto"
    mesh: Mesh | None = None


def batch_rows(table: Array, rows: Array, mesh: Mesh | None) -> Array:
    """``table[rows]`` ``[B, ...]`` of a per-row table ``[rows, ...]``, zero where ``rows`` is
    negative (padding); with a mesh, each data shard reads its own rows
    (:func:`arkv_jax.sharded_kernels.gather_rows`, no communication)."""
    return take_rows(table, rows) if mesh is None else gather_rows(mesh, table, rows)


def generate_chunk(params: nnx.State, pools: tuple[Array, Array], inputs: ChunkInputs,
                   text_kv: tuple[Array, Array], noise: Array, *, config: ChunkConfig
                   ) -> tuple[Array, Array, Array]:
    """One chunk of ``S`` sessions: the denoise steps from ``noise``, then the commit forward.

    Pure and traceable (jit it once: nothing here depends on which sessions run or where their
    windows stand, only on shapes). ``B = S * config.sampler.num_branches`` batch rows, session-major
    and branch-minor (a full batch from ``cache.chunk(..., full_batch=True)``: padding rows for idle
    slots).

    Args:
      params: the model's parameters, ``nnx.split(model)[1]`` (for ``config.graphdef``).
      pools: ``(k_pool, v_pool)``, each of :func:`pallas_kernels.layout.pool_shape`, from ``cache.pools``;
        only read.
      inputs: the batch's :class:`ChunkInputs` (``step.inputs``).
      text_kv: ``(k, v)``, each ``[rows, L, T, Hkv, D]``: the cache's text K/V of every block-table
        row (``cache.cross_attention_kv(name)``); the batch reads rows ``inputs.rows`` (local to
        each data shard with a mesh; padding rows read zeros).
      noise: float ``[S, D, F, H, W, C]``: each session's ``D = config.sampler.noise_draws`` noise
        draws (:func:`arkv_jax.samplers.session_noise`: starting noise first); a rank-5
        ``[S, F, H, W, C]`` starting noise is accepted when ``D == 1``.

    Returns:
      ``(latents, k, v)``: the clean latents ``[S, F, H, W, C]`` in the model dtype and every
      layer's K/V of the commit forward ``[L, B, F * tokens_per_frame, Hkv, D]`` (``k`` post-RoPE),
      for ``step.commit``: on the clean latents at ``t = 0``, or with ``sampler.context_noise`` on
      them noised with the last draw (:func:`arkv_jax.samplers.commit_input`).
    """
    model = nnx.merge(config.graphdef, params)
    sampler, frames = config.sampler, config.chunk_frames
    nb, rows = sampler.num_branches, inputs.rows.shape[0]
    draws = samplers.as_draws(noise).astype(model.config.dtype)
    if draws.shape[1] != sampler.noise_draws:
        raise ValueError(f"noise has {draws.shape[1]} draws per session; the sampler needs {sampler.noise_draws}")
    history = PagedHistory.from_inputs(pools, inputs, config.tokens_per_frame, config.backend, mesh=config.mesh)
    text_k, text_v = (batch_rows(table, inputs.rows, config.mesh).swapaxes(0, 1) for table in text_kv)

    def velocity(x, sigma):
        t = jnp.full((rows, frames), sigma * 1000.0)
        out = model(jnp.repeat(x, nb, axis=0), t, inputs.first_frame, history, text_k, text_v)
        return combine_branches(out, nb, sampler.guidance_scale)

    x = samplers.sample(velocity, draws, sampler)
    context, t_c = samplers.commit_input(x, draws, sampler)
    _, (k, v) = model(jnp.repeat(context, nb, axis=0), jnp.full((rows, frames), t_c), inputs.first_frame,
                      history, text_k, text_v, return_kv=True)
    return x, k, v


def recache_kv(params: nnx.State, pools: tuple[Array, Array], inputs: ChunkInputs, text_kv: tuple[Array, Array],
               latents: Array, timestep: Array, *, config: ChunkConfig) -> tuple[Array, Array]:
    """The K/V of one recache unit (:class:`arkv_jax.cache.recache.RecacheUnit`): the commit forward
    of a session's kept frames under new conditioning, pure and traceable like :func:`generate_chunk`.

    Args:
      params, pools: as for :func:`generate_chunk` (the pools are only read).
      inputs: the unit's :class:`ChunkInputs` (``B`` = the session's branch rows).
      text_kv: ``(k, v)``, each ``[L, B, T, Hkv, D]``: the new text K/V of the rows.
      latents: ``[n, H, W, C]`` the unit's commit-forward input (:func:`arkv_jax.samplers.commit_input`
        of its chunk's clean latents, the unit's frames).
      timestep: float scalar, the commit forward's timestep.

    Returns:
      ``(k, v)``: every layer's K/V ``[L, B, n * tokens_per_frame, Hkv, D]`` (``k`` post-RoPE).
    """
    model = nnx.merge(config.graphdef, params)
    rows, frames = inputs.rows.shape[0], latents.shape[0]
    history = PagedHistory.from_inputs(pools, inputs, config.tokens_per_frame, config.backend, mesh=config.mesh)
    x = jnp.broadcast_to(latents.astype(model.config.dtype), (rows, *latents.shape))
    _, kv = model(x, jnp.full((rows, frames), timestep, jnp.float32), inputs.first_frame, history, *text_kv,
                  return_kv=True)
    return kv


class ChunkResult(NamedTuple):
    """One chunk of every active session.

    Attributes:
      session_ids: the sessions, in batch order.
      first_frames: int ``[S]`` absolute index of each session's first frame in this chunk.
      latents: ``[S, F, H, W, C]`` the generated clean latents (host array).
    """

    session_ids: tuple[str, ...]
    first_frames: np.ndarray
    latents: np.ndarray


@dataclasses.dataclass
class _Session:
    """A session's noise seed, the latents ``[F, H, W, C]`` of each chunk it generated (host), and
    its latent ring: chunk index -> device latents of the chunks a prompt switch recomputes from
    (:meth:`arkv_jax.config.WindowPolicy.latent_ring_frames`)."""

    seed: int
    chunks: list[np.ndarray] = dataclasses.field(default_factory=list)
    ring: dict[int, Array] = dataclasses.field(default_factory=dict)


def default_buckets(max_sessions: int) -> tuple[int, ...]:
    """Batch buckets (sessions per chunk) of a :class:`Rollout`: the powers of two below
    ``max_sessions``, then ``max_sessions`` (16: 1, 2, 4, 8, 16; 6: 1, 2, 4, 6)."""
    sizes = [1 << i for i in range(max_sessions.bit_length()) if (1 << i) < max_sessions]
    return (*sizes, max_sessions)


@functools.partial(jax.jit, static_argnums=1)
def pad_inputs(inputs: ChunkInputs, rows: int) -> ChunkInputs:
    """A compact batch's :class:`ChunkInputs` padded to ``rows`` batch rows with padding rows (row
    -1, no history, frame 0, nothing to write; see :mod:`arkv_jax.step`)."""
    return ChunkInputs(*(jnp.pad(a, [(0, rows - a.shape[0])] + [(0, 0)] * (a.ndim - 1), constant_values=fill)
                         for a, fill in zip(inputs, PADDING)))


class Rollout:
    """Chunk-wise generation of many sessions through one :class:`PagedKVCache`.

    Batching. By default (one device) a chunk runs the *live* sessions only: the cache's compact
    batch of their rows (``cache.chunk(..., full_batch=False)``, session-major in join order),
    padded with padding rows to the smallest of a few bucketed sizes (``buckets``: sessions per
    chunk; default :func:`default_buckets`, powers of two up to ``max_sessions``), so a chunk costs
    what its live sessions cost, rounded up to a bucket, and :attr:`chunk_fn` compiles once per
    bucket used. With ``full_batch=True``, and always on a mesh, every chunk runs the cache's full
    batch (every slot, idle ones as padding rows): one shape for the whole run (a sharded cache
    hands out full batches only, so each data shard sees the same rows every chunk; there is no
    per-shard bucketing). The cache's own bookkeeping programs (prepare, page write) run on the
    unpadded compact batch and compile once per live-row count.

    Args:
      model: the video model.
      cache: its cache; geometry and text cache must fit the model, chunks have
        ``geometry.frames_per_forward`` frames.
      sampler: schedule, update, guidance (:class:`Sampler`; presets in :data:`SAMPLERS`). With
        guidance the cache's first two KV branches are the (prompt, negative prompt) rows; without,
        its first branch.
      text_cache: name of the cross-attention cache holding the text K/V.
      backend: window-attention backend (default: the cache's).
      max_sessions: most sessions active at once (default: the cache's capacity).
      max_traces: if set, tracing the chunk function more often than this *for one batch size*
        raises ``RuntimeError`` (a retrace means a shape, dtype or static value changed; each
        bucket's first trace is expected, so ``max_traces=1`` allows one compile per bucket).
      full_batch: run the cache's full batch every chunk (fixed shapes); ``None`` (default): only on
        a mesh. ``False`` with a mesh raises.
      buckets: sessions per chunk to pad compact batches to, increasing, the largest at least
        ``max_sessions`` (default :func:`default_buckets`); ignored with the full batch.

    Attributes:
      params: the model's parameters (``nnx.split(model)[1]``; on a mesh, placed tensor-parallel).
      chunk_config: the static :class:`ChunkConfig` of this rollout.
      chunk_fn: :func:`generate_chunk` with ``chunk_config``, jitted: ``(params, pools, inputs,
        text_kv, noise) -> (latents, k, v)``, what :meth:`step` runs (e.g. ``.lower(...)`` it);
        ``noise`` is ``[batch sessions, sampler.noise_draws, F, H, W, C]``.
      full_batch: whether every chunk runs the full batch.
      buckets: the batch sizes (sessions) chunks run at: the cache's capacity alone with the full
        batch.
      num_traces: how often ``chunk_fn`` was traced (all batch sizes).
      traces_per_batch: traces by batch size in sessions (the buckets used).
    """

    def __init__(self, model: CausalDiT, cache: PagedKVCache, sampler: Sampler = Sampler(), *,
                 text_cache: str = "text", backend: str | None = None, max_sessions: int | None = None,
                 max_traces: int | None = None, full_batch: bool | None = None,
                 buckets: tuple[int, ...] | None = None) -> None:
        config = model.config
        if text_cache not in cache.cross_attention:
            raise ValueError(f"the cache has no cross-attention cache {text_cache!r}; it has "
                             f"{sorted(cache.cross_attention)}")
        config.check_cache(cache.geometry, cache.cross_attention[text_cache])
        names = [b.name for b in cache.kv_branches]
        if len(names) < sampler.num_branches:
            raise ValueError(f"guidance needs two KV branches (prompt, negative prompt); the cache has {names}")
        if max_sessions is not None and max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        if full_batch is None:
            full_batch = cache.mesh is not None
        elif not full_batch and cache.mesh is not None:
            raise ValueError("on a mesh the rollout runs the cache's full batch (full_batch=True): a sharded "
                             "cache hands out full batches only")
        self.model, self.cache, self.sampler, self.text_cache = model, cache, sampler, text_cache
        self.branches = tuple(names[:sampler.num_branches])
        self.chunk_frames = cache.geometry.frames_per_forward
        self.max_sessions = max_sessions or cache.session_capacity
        self.full_batch = bool(full_batch)
        if self.full_batch:
            self.buckets = (cache.session_capacity,)
        else:
            self.buckets = default_buckets(self.max_sessions) if buckets is None else tuple(buckets)
            if (not self.buckets or any(not isinstance(b, (int, np.integer)) or b < 1 for b in self.buckets)
                    or list(self.buckets) != sorted(set(self.buckets)) or self.buckets[-1] < self.max_sessions):
                raise ValueError(f"buckets must be increasing positive ints, the largest >= max_sessions="
                                 f"{self.max_sessions}; got {buckets!r}")
        self.max_traces, self.num_traces = max_traces, 0
        self.traces_per_batch: dict[int, int] = {}
        graphdef, self.params = nnx.split(model)
        self._noise_sharding = None
        if cache.mesh is not None:
            specs = tensor_parallel_specs(self.params, cache.mesh.shape[MODEL])
            self.params = jax.device_put(self.params, jax.tree_util.tree_map(
                lambda spec: NamedSharding(cache.mesh, spec), specs, is_leaf=lambda x: isinstance(x, P)))
            self._noise_sharding = NamedSharding(cache.mesh, P(DATA))
        self.chunk_config = ChunkConfig(graphdef, sampler, self.chunk_frames, cache.geometry.tokens_per_frame,
                                        backend or cache.backend, cache.mesh)
        self.chunk_fn = jax.jit(self._traced_chunk)
        self.recache_fn = jax.jit(functools.partial(recache_kv, config=self.chunk_config))
        self._sessions: dict[str, _Session] = {}

    def bucket(self, num_sessions: int) -> int:
        """The batch size (sessions) a chunk of ``num_sessions`` live sessions runs at."""
        return next(b for b in self.buckets if b >= num_sessions)

    # -- sessions ------------------------------------------------------------------------------------
    @property
    def sessions(self) -> tuple[str, ...]:
        """Active sessions, in join order (the batch order)."""
        return tuple(self._sessions)

    def join(self, session_id: str, prompt: str | None = None, seed: int = 0, *, context=None,
             negative_context=None) -> None:
        """Starts a new session at frame 0: opens it in the cache and publishes its text K/V.

        Conditioning: ``context`` is the text encoder's output for the prompt, ``[tokens, text_dim]``
        (e.g. :func:`arkv_jax.models.encode_prompts`'s row, umT5's ``[512, 4096]`` for Wan), zero-padded
        here to the model's ``text_tokens`` (:func:`pad_context`); with guidance ``negative_context``
        is the encoded negative prompt (required: Wan's negative is an encoded prompt, not zeros).
        Without ``context``, ``prompt`` goes through the hash stand-in
        :func:`arkv_jax.models.dit.prompt_embedding` (prompt, then ``""`` as the negative), for the demo
        and tests that have no text encoder. See :func:`branch_contexts`.

        Raises:
          ValueError: the session is already active or already open in the cache, a bad seed, or bad
            conditioning (:func:`branch_contexts`; checked before anything changes).
          RuntimeError: ``max_sessions`` are active, or the cache is full (no LRU eviction here).
        """
        if session_id in self._sessions or session_id in self.cache.sessions:
            raise ValueError(f"session {session_id!r} is already open")
        if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        if prompt is not None and not isinstance(prompt, str):
            raise ArgumentTypeError(f"prompt must be a string or None, got {type(prompt).__name__}")
        if len(self._sessions) >= self.max_sessions:
            raise RuntimeError(f"{self.max_sessions} sessions are active (max_sessions); leave one first")
        if len(self.cache.sessions) >= self.cache.session_capacity:
            raise RuntimeError(f"the cache holds {self.cache.session_capacity} sessions (its capacity); "
                               "close one first")
        config = self.model.config
        contexts = branch_contexts(config.text_tokens, config.text_dim, len(self.branches), prompt, context,
                                   negative_context)
        self.cache.open(session_id)
        try:  # all or nothing: a failure leaves the session closed and the id joinable
            for branch, branch_context in zip(self.branches, contexts):
                k, v = context_kv(self.chunk_config.graphdef, self.params, jnp.asarray(branch_context[None]))
                self.cache.populate_cross_attention(session_id, self.text_cache, branch,
                                                    ((k[layer, 0], v[layer, 0]) for layer in range(config.num_layers)))
        except BaseException:
            if session_id in self.cache.sessions:
                self.cache.close(session_id)
            raise
        self._sessions[session_id] = _Session(int(seed))

    def leave(self, session_id: str) -> np.ndarray:
        """Ends a session: closes it in the cache (its pages and text rows are freed) and returns
        its latents ``[frames, H, W, C]``.

        Raises:
          KeyError: unknown session.
        """
        latents = self.latents(session_id)
        self.cache.close(session_id)
        del self._sessions[session_id]
        return latents

    def switch_prompt(self, session_id: str, prompt: str | None = None, *, context=None, negative_context=None,
                      sink: str = "keep") -> tuple[int, ...]:
        """Switches a session to new conditioning between chunks, with a KV recache (LongLive).

        The frames the session's next chunk attends to are recomputed under the new prompt from the
        session's latent ring, at their absolute positions, and swapped in together with the new
        text K/V (:meth:`PagedKVCache.recache`): the sink's K/V are kept (``sink="keep"``) or
        recomputed too (``"recompute"``). Each recomputed chunk sees what it saw when it was
        generated, less the frames that have left the window; the following chunks see the new
        prompt and the recomputed history. All or nothing: on any error the session keeps its old
        history and text K/V.

        Conditioning as for :meth:`join` (``prompt`` through the hash stand-in, or ``context`` and,
        with guidance, ``negative_context``).

        Returns:
          the absolute frames recomputed, in time order.

        Raises:
          KeyError: unknown session. ValueError: bad conditioning or a bad ``sink``.
          RuntimeError: the pool lacks the fresh pages (plan it with
            :func:`arkv_jax.planner.rollout_plan`'s ``latent_frame_bytes``).
        """
        session = self._session(session_id)
        if prompt is not None and not isinstance(prompt, str):
            raise ArgumentTypeError(f"prompt must be a string or None, got {type(prompt).__name__}")
        config, f = self.model.config, self.chunk_frames
        contexts = branch_contexts(config.text_tokens, config.text_dim, len(self.branches), prompt, context,
                                   negative_context)
        text = [context_kv(self.chunk_config.graphdef, self.params, jnp.asarray(c[None])) for c in contexts]
        shape = (f, *config.frame_shape)
        with self.cache.recache(session_id, f, sink=sink, branches=self.branches, full_batch=self.full_batch) as job:
            # The new text K/V at the session's batch rows, zeros at padding rows: [L, batch, T, Hkv, D].
            text_kv = tuple(jnp.zeros((x.shape[0], job.batch_size, *x.shape[2:]), x.dtype)
                            .at[:, job.positions].set(jnp.concatenate([kv[i] for kv in text], axis=1))
                            for i, x in enumerate(text[0]))
            for unit in job.units:
                chunk, offset = divmod(unit.first_frame, f)
                draws = (jnp.asarray(samplers.session_noise(session.seed, chunk, shape, self.sampler.noise_draws)[None])
                         if self.sampler.context_noise else None)  # only a noised commit input reads them
                x, t_c = samplers.commit_input(session.ring[chunk][None], draws, self.sampler)
                k, v = self.recache_fn(self.params, self.cache.pools, unit.inputs, text_kv,
                                       x[0, offset:offset + unit.num_frames], jnp.float32(t_c))
                job.write(k, v)
            for branch, (k, v) in zip(self.branches, text):
                job.populate_cross_attention(self.text_cache, branch, zip(k[:, 0], v[:, 0]))
            job.commit()
        return job.frames

    def _session(self, session_id: str) -> _Session:
        try:
            return self._sessions[session_id]
        except KeyError:
            raise KeyError(f"unknown session {session_id!r}") from None

    def latents(self, session_id: str) -> np.ndarray:
        """All latents a session generated so far: ``[frames, H, W, C]``.

        Raises:
          KeyError: unknown session.
        """
        session = self._session(session_id)
        if not session.chunks:
            return np.zeros((0, *self.model.config.frame_shape), jnp.dtype(self.model.config.dtype))
        return np.concatenate(session.chunks)

    # -- the chunk -----------------------------------------------------------------------------------
    def step(self) -> ChunkResult:
        """Generates one chunk for every active session (see the module docstring and the class's
        batching note).

        Raises:
          RuntimeError: no active session, or the pool cannot hold the chunk (nothing changes).
        """
        ids = self.sessions
        if not ids:
            raise RuntimeError("no active session; join one first")
        shape = (self.chunk_frames, *self.model.config.frame_shape)
        counts = np.asarray([len(self._sessions[s].chunks) for s in ids], np.int32)
        if self.full_batch:
            size, positions = self.cache.session_capacity, [self.cache.slot(s) for s in ids]
        else:
            size, positions = self.bucket(len(ids)), list(range(len(ids)))
        draws = self.sampler.noise_draws
        noise = np.zeros((size, draws, *shape), np.float32)
        for sid, position, count in zip(ids, positions, counts):
            noise[position] = samplers.session_noise(self._sessions[sid].seed, int(count), shape, draws)
        live_rows = len(ids) * len(self.branches)
        with self.cache.chunk(ids, self.chunk_frames, self.branches, full_batch=self.full_batch) as step:
            inputs = step.inputs if self.full_batch else pad_inputs(step.inputs, size * len(self.branches))
            x, k_new, v_new = self.chunk_fn(self.params, self.cache.pools, inputs,
                                            self.cache.cross_attention_kv(self.text_cache),
                                            jax.device_put(noise, self._noise_sharding))
            if not self.full_batch and live_rows < k_new.shape[1]:
                k_new, v_new = k_new[:, :live_rows], v_new[:, :live_rows]
            step.commit(k_new, v_new)
        latents = np.asarray(x)[positions]
        for i, sid in enumerate(ids):
            self._sessions[sid].chunks.append(latents[i])
            self._keep_in_ring(self._sessions[sid], int(counts[i]), x[positions[i]])
        return ChunkResult(ids, counts * self.chunk_frames, latents)

    def _keep_in_ring(self, session: _Session, chunk_index: int, latents: Array) -> None:
        """Adds a chunk's device latents to the session's ring and drops the chunks no prompt switch
        can need any more (neither a sink chunk nor one of the recent history's)."""
        session.ring[chunk_index] = latents
        window, f = self.cache.window, self.chunk_frames
        oldest_recent = (chunk_index + 1) * f - (window.max_history(f) - window.sink_frames)
        for c in [c for c in session.ring if c * f >= window.sink_frames and (c + 1) * f <= oldest_recent]:
            del session.ring[c]

    def _traced_chunk(self, params, pools, inputs: ChunkInputs, text_kv, noise):
        """:func:`generate_chunk` under the trace guard: runs once per trace of :attr:`chunk_fn`."""
        size = noise.shape[0]
        self.num_traces += 1
        self.traces_per_batch[size] = self.traces_per_batch.get(size, 0) + 1
        if self.max_traces is not None and self.traces_per_batch[size] > self.max_traces:
            raise RuntimeError(f"the chunk function was traced {self.traces_per_batch[size]} times for a batch "
                               f"of {size} sessions (max_traces={self.max_traces}): a shape, dtype or static "
                               "value changed")
        return generate_chunk(params, pools, inputs, text_kv, noise, config=self.chunk_config)

    # -- views ---------------------------------------------------------------------------------------
    def pages_held(self) -> dict[str, np.ndarray]:
        """Pool page indices each active session holds (all its branches), sorted (host sync)."""
        return self.cache.pages_held(self.sessions)
