"""The chunk loop: many sessions generate video chunk by chunk through one paged KV cache.

Per chunk, for every active session at once (:meth:`Rollout.step`):

1. ``cache.chunk(...)`` hands out the visible pages of every row (session x KV branch) and allocates
   the chunk's pages in a pending state. Sessions may be at different frame indices.
2. :func:`generate_chunk`, jitted once per :class:`Rollout`, runs the whole chunk on device: from each
   session's starting noise (drawn on the host from its seed and chunk counter, :func:`chunk_noise`),
   ``num_steps`` flow-matching Euler steps ``x <- x + (sigma' - sigma) v(x, sigma)`` from
   ``sigma = 1`` (noise) to ``0`` on Wan's shifted schedule, every step a read-only forward over
   the pools (the current chunk's K/V go straight to the attention kernel), then one commit forward
   at timestep 0 on the clean latents that returns every layer's K/V.
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
branch) in the cache's cross-attention store; :meth:`Rollout.leave` closes it, which frees its
pages and its text rows. Every chunk runs the cache's *full batch* (every slot; idle slots are
padding rows with no history, zero text and nothing to write), so the chunk function is traced
*once* for the whole run however sessions come and go; ``num_traces`` counts it and
``max_traces`` turns a retrace into an error.

Devices. With a sharded cache (``PagedKVCache(..., mesh=...)``) the same code runs on the mesh: the
noise and the batch are split over ``"data"`` like the cache's slots, attention runs per device
through :func:`arkv_jax.sharded_kernels.sharded_window_attention` (heads over ``"model"``), the blocks'
weights are split over ``"model"`` tensor-parallel style
(:func:`arkv_jax.models.dit.tensor_parallel_specs`; the rest is replicated), and XLA partitions the
model's computation to match, adding one all-reduce per row-parallel layer.

The exactness reference, :class:`arkv_jax.reference.FullRecompute`, generates the same videos
without any cache from the same :class:`Sampler`, :func:`chunk_noise` and :func:`denoise`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from arkv_jax.cache import PagedKVCache
from arkv_jax.models.dit import CausalDiT, prompt_embedding, tensor_parallel_specs
from arkv_jax.nnx import PagedHistory
from arkv_jax.sharded_kernels import gather_rows
from arkv_jax.sharding import DATA, MODEL
from arkv_jax.step import ChunkInputs

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Sampler:
    """Few-step flow-matching sampler.

    Attributes:
      num_steps: denoise forwards per chunk (then one commit forward).
      shift: Wan's timestep shift: ``sigma = shift s / (1 + (shift - 1) s)`` for ``s`` evenly spaced
        from 1 to 0.
      guidance_scale: classifier-free guidance scale, or ``None`` for no CFG (one KV branch).
    """

    num_steps: int = 3
    shift: float = 5.0
    guidance_scale: float | None = None

    def __post_init__(self):
        if not isinstance(self.num_steps, int) or self.num_steps < 1:
            raise ValueError(f"num_steps must be a positive int, got {self.num_steps!r}")
        if not self.shift > 0:
            raise ValueError(f"shift must be positive, got {self.shift!r}")

    @property
    def num_branches(self) -> int:
        """KV branches per session: 2 with CFG, else 1."""
        return 1 if self.guidance_scale is None else 2

    def sigmas(self) -> np.ndarray:
        """float32 ``[num_steps + 1]`` noise levels from 1 to 0 (model timestep = 1000 sigma)."""
        s = np.linspace(1.0, 0.0, self.num_steps + 1)
        return (self.shift * s / (1.0 + (self.shift - 1.0) * s)).astype(np.float32)


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


def denoise(velocity: Callable[[Array, Array], Array], noise: Array, sigmas: np.ndarray) -> Array:
    """Euler steps of ``dx/dsigma = velocity(x, sigma)`` from ``noise`` at ``sigmas[0]`` to
    ``sigmas[-1]`` (one traced step in a ``fori_loop``)."""
    sig = jnp.asarray(sigmas)

    def step(i, x):
        return (x + (sig[i + 1] - sig[i]) * velocity(x, sig[i])).astype(x.dtype)

    return jax.lax.fori_loop(0, len(sigmas) - 1, step, noise)


@functools.partial(jax.jit, static_argnums=0)
def context_kv(graphdef: nnx.GraphDef, params: nnx.State, context: Array) -> tuple[Array, Array]:
    """The model's per-layer text K/V ``(k, v)``, each ``[L, B, T, Hkv, D]``, of ``context``
    ``[B, T, text_dim]`` (from :func:`arkv_jax.models.dit.prompt_embedding`); ``graphdef`` and
    ``params`` from ``nnx.split(model)``."""
    return nnx.merge(graphdef, params).text_kv(context)


def text_branches(prompt: str, num_branches: int) -> tuple[str, ...]:
    """The prompts of a session's branches: the prompt, then the empty prompt (CFG negative)."""
    return (prompt, "")[:num_branches]


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
    if mesh is not None:
        return gather_rows(mesh, table, rows)
    valid = (rows >= 0).reshape((-1,) + (1,) * (table.ndim - 1))
    return jnp.where(valid, jnp.take(table, jnp.maximum(rows, 0), axis=0), jnp.zeros((), table.dtype))


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
      noise: float ``[S, F, H, W, C]`` starting noise of each session's chunk.

    Returns:
      ``(latents, k, v)``: the clean latents ``[S, F, H, W, C]`` in the model dtype and every
      layer's K/V of them ``[L, B, F * tokens_per_frame, Hkv, D]`` (``k`` post-RoPE), for
      ``step.commit``.
    """
    model = nnx.merge(config.graphdef, params)
    sampler, frames = config.sampler, config.chunk_frames
    nb, rows = sampler.num_branches, inputs.rows.shape[0]
    history = PagedHistory.from_inputs(pools, inputs, config.tokens_per_frame, config.backend, mesh=config.mesh)
    text_k, text_v = (batch_rows(table, inputs.rows, config.mesh).swapaxes(0, 1) for table in text_kv)

    def velocity(x, sigma):
        t = jnp.full((rows, frames), sigma * 1000.0)
        out = model(jnp.repeat(x, nb, axis=0), t, inputs.first_frame, history, text_k, text_v)
        return combine_branches(out, nb, sampler.guidance_scale)

    x = denoise(velocity, noise.astype(model.config.dtype), sampler.sigmas())
    _, (k, v) = model(jnp.repeat(x, nb, axis=0), jnp.zeros((rows, frames)), inputs.first_frame, history,
                      text_k, text_v, return_kv=True)
    return x, k, v


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
    """A session's noise seed and the latents ``[F, H, W, C]`` of each chunk it generated."""

    seed: int
    chunks: list[np.ndarray] = dataclasses.field(default_factory=list)


class Rollout:
    """Chunk-wise generation of many sessions through one :class:`PagedKVCache`.

    Args:
      model: the video model.
      cache: its cache; geometry and text cache must fit the model, chunks have
        ``geometry.frames_per_forward`` frames.
      sampler: steps, shift, guidance. With guidance the cache's first two KV branches are the
        (prompt, empty prompt) rows; without, its first branch.
      text_cache: name of the cross-attention cache holding the text K/V.
      backend: window-attention backend (default: the cache's).
      max_sessions: most sessions active at once (default: the cache's capacity; the batch is
        always the cache's full batch).
      max_traces: if set, tracing the chunk function more often raises ``RuntimeError``.

    Attributes:
      params: the model's parameters (``nnx.split(model)[1]``; on a mesh, placed tensor-parallel).
      chunk_config: the static :class:`ChunkConfig` of this rollout.
      chunk_fn: :func:`generate_chunk` with ``chunk_config``, jitted: ``(params, pools, inputs,
        text_kv, noise) -> (latents, k, v)``, what :meth:`step` runs (e.g. ``.lower(...)`` it).
      num_traces: how often ``chunk_fn`` was traced.
    """

    def __init__(self, model: CausalDiT, cache: PagedKVCache, sampler: Sampler = Sampler(), *,
                 text_cache: str = "text", backend: str | None = None, max_sessions: int | None = None,
                 max_traces: int | None = None) -> None:
        config = model.config
        if text_cache not in cache.cross_attention:
            raise ValueError(f"the cache has no cross-attention cache {text_cache!r}; it has "
                             f"{sorted(cache.cross_attention)}")
        config.check_cache(cache.geometry, cache.cross_attention[text_cache])
        names = [b.name for b in cache.kv_branches]
        if len(names) < sampler.num_branches:
            raise ValueError(f"guidance needs two KV branches (prompt, empty prompt); the cache has {names}")
        if max_sessions is not None and max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.model, self.cache, self.sampler, self.text_cache = model, cache, sampler, text_cache
        self.branches = tuple(names[:sampler.num_branches])
        self.chunk_frames = cache.geometry.frames_per_forward
        self.max_sessions = max_sessions or cache.session_capacity
        self.max_traces, self.num_traces = max_traces, 0
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
        self._sessions: dict[str, _Session] = {}

    # -- sessions ------------------------------------------------------------------------------------
    @property
    def sessions(self) -> tuple[str, ...]:
        """Active sessions, in join order (the batch order)."""
        return tuple(self._sessions)

    def join(self, session_id: str, prompt: str, seed: int = 0) -> None:
        """Starts a new session at frame 0: opens it in the cache and publishes its text K/V.

        Raises:
          ValueError: the session is already active or already open in the cache, or a bad seed.
          RuntimeError: ``max_sessions`` are active, or the cache is full (no LRU eviction here).
        """
        if session_id in self._sessions or session_id in self.cache.sessions:
            raise ValueError(f"session {session_id!r} is already open")
        if not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        if len(self._sessions) >= self.max_sessions:
            raise RuntimeError(f"{self.max_sessions} sessions are active (max_sessions); leave one first")
        if len(self.cache.sessions) >= self.cache.session_capacity:
            raise RuntimeError(f"the cache holds {self.cache.session_capacity} sessions (its capacity); "
                               "close one first")
        self.cache.open(session_id)
        config = self.model.config
        for branch, text in zip(self.branches, text_branches(prompt, len(self.branches))):
            context = prompt_embedding(text, config.text_tokens, config.text_dim)[None]
            k, v = context_kv(self.chunk_config.graphdef, self.params, jnp.asarray(context))
            self.cache.populate_cross_attention(session_id, self.text_cache, branch,
                                                ((k[layer, 0], v[layer, 0]) for layer in range(config.num_layers)))
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

    def latents(self, session_id: str) -> np.ndarray:
        """All latents a session generated so far: ``[frames, H, W, C]``.

        Raises:
          KeyError: unknown session.
        """
        try:
            session = self._sessions[session_id]
        except KeyError:
            raise KeyError(f"unknown session {session_id!r}") from None
        if not session.chunks:
            return np.zeros((0, *self.model.config.frame_shape), jnp.dtype(self.model.config.dtype))
        return np.concatenate(session.chunks)

    # -- the chunk -----------------------------------------------------------------------------------
    def step(self) -> ChunkResult:
        """Generates one chunk for every active session (see the module docstring).

        Raises:
          RuntimeError: no active session, or the pool cannot hold the chunk (nothing changes).
        """
        ids = self.sessions
        if not ids:
            raise RuntimeError("no active session; join one first")
        shape = (self.chunk_frames, *self.model.config.frame_shape)
        counts = np.asarray([len(self._sessions[s].chunks) for s in ids], np.int32)
        slots = [self.cache.slot(s) for s in ids]
        noise = np.zeros((self.cache.session_capacity, *shape), np.float32)
        for sid, slot, count in zip(ids, slots, counts):
            noise[slot] = chunk_noise(self._sessions[sid].seed, int(count), shape)
        with self.cache.chunk(ids, self.chunk_frames, self.branches, full_batch=True) as step:
            x, k_new, v_new = self.chunk_fn(self.params, self.cache.pools, step.inputs,
                                            self.cache.cross_attention_kv(self.text_cache),
                                            jax.device_put(noise, self._noise_sharding))
            step.commit(k_new, v_new)
        latents = np.asarray(x)[slots]
        for i, sid in enumerate(ids):
            self._sessions[sid].chunks.append(latents[i])
        return ChunkResult(ids, counts * self.chunk_frames, latents)

    def _traced_chunk(self, params, pools, inputs: ChunkInputs, text_kv, noise):
        """:func:`generate_chunk` under the trace guard: runs once per trace of :attr:`chunk_fn`."""
        self.num_traces += 1
        if self.max_traces is not None and self.num_traces > self.max_traces:
            raise RuntimeError(f"the chunk function was traced {self.num_traces} times (max_traces="
                               f"{self.max_traces}): a shape, dtype or static value changed")
        return generate_chunk(params, pools, inputs, text_kv, noise, config=self.chunk_config)

    # -- views ---------------------------------------------------------------------------------------
    def pages_held(self) -> dict[str, np.ndarray]:
        """Pool page indices each active session holds (all its branches), sorted (host sync)."""
        return self.cache.pages_held(self.sessions)
