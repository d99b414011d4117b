"""The chunk loop: many sessions generate video chunk by chunk through one paged KV cache.

:func:`generate_chunk` is the pure chunk function: ``num_steps`` read-only denoise forwards of the
:class:`~arkv_jax.samplers.Sampler` over the pools, then one commit forward that returns every
layer's K/V; it knows nothing of sessions or of the facade, only of a static :class:`ChunkConfig`.
:func:`recache_kv` is the commit forward of one recache unit (a prompt switch). :class:`Rollout`
jits them and runs the loop: ``with cache.chunk(...) as step`` hands out the batch (its rows, padding
and positions are the step's), the chunk runs, ``step.commit(k, v)`` writes the K/V in place. Join,
leave and prompt switches go through the cache's sessions, cross-attention store and recache.
The loop, batching, CFG, meshes and prompt switches: ``docs/rollout.md``; on several processes
(each step agreed by a :class:`~arkv_jax.processes.ProcessGroup`): ``docs/sharding.md``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from arkv_jax import processes, samplers
from arkv_jax.cache import PagedKVCache
from arkv_jax.cache.batch import bucket_size, cross_attention_rows, resolve_buckets
from arkv_jax.conditioning import branch_contexts, context_kv
from arkv_jax.config import ArgumentTypeError, WindowPolicy, require_bool, require_int
from arkv_jax.models.dit import CausalDiT, tensor_parallel_specs
from arkv_jax.nnx import PagedHistory
from arkv_jax.processes import StepFailed
from arkv_jax.samplers import Sampler, combine_branches
from arkv_jax.sharding import DATA, MODEL, from_host
from arkv_jax.step import ChunkInputs

Array = jax.Array

#: Names of this module, and ``Sampler`` (home: :mod:`arkv_jax.samplers`), the rollout's argument,
#: for ``from arkv_jax.rollout import Rollout, Sampler``.
__all__ = ["ChunkConfig", "ChunkResult", "Rollout", "Sampler", "generate_chunk", "recache_kv"]


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
      rows_in_turn: run each forward on one batch row after the other (a loop over the rows, each
        row's outputs written in place) instead of on the whole batch; the same outputs. On one
        TPU chip a forward of Wan's size is compute-bound, so a batch buys no speed there, and
        XLA:TPU lays a batch's activations out so that per-row head-major views become copies
        (``docs/rollout.md``, Batching); ``False`` with a mesh, whose devices hold the rows.
    """

    graphdef: nnx.GraphDef
    sampler: Sampler
    chunk_frames: int
    tokens_per_frame: int
    backend: str = "auto"
    mesh: Mesh | None = None
    rows_in_turn: bool = False


def _forward(forward: Callable, latents: Array, timesteps: Array, first_frame: Array, history: PagedHistory,
             text_k: Array, text_v: Array, *, rows_in_turn: bool, out_axis: int = 0):
    """``forward(...)`` (a :class:`CausalDiT` or its ``commit_kv``) on the whole batch, or with
    ``rows_in_turn`` on one row after the other (:attr:`ChunkConfig.rows_in_turn`): the same
    outputs, ``latents`` and ``timesteps`` with the rows on axis 0, ``text_k``/``text_v`` on axis 1
    and every output on ``out_axis``."""
    def call(latents, timesteps, first_frame, pages, lengths, text_k, text_v):
        rows_history = history.replace(pages=pages, lengths=lengths)
        return forward(latents, timesteps, first_frame, rows_history, text_k, text_v)

    args = (latents, timesteps, first_frame, history.pages, history.lengths, text_k, text_v)
    in_axes = (0, 0, 0, 0, 0, 1, 1)
    rows = latents.shape[0]
    if not rows_in_turn or rows == 1:
        return call(*args)

    def row_args(i):
        return [jax.lax.dynamic_slice_in_dim(a, i, 1, axis) for a, axis in zip(args, in_axes)]

    def widen(shape, axis):
        return jnp.zeros((*shape.shape[:axis], rows, *shape.shape[axis + 1:]), shape.dtype)

    outs = jax.tree_util.tree_map(lambda shape: widen(shape, out_axis), jax.eval_shape(lambda: call(*row_args(0))))

    def body(i, outs):
        return jax.tree_util.tree_map(lambda out, row: jax.lax.dynamic_update_slice_in_dim(out, row, i, out_axis),
                                      outs, call(*row_args(i)))

    return jax.lax.fori_loop(0, rows, body, outs)


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
    text_k, text_v = cross_attention_rows(text_kv, inputs.rows, config.mesh)

    def velocity(x, sigma):
        t = jnp.full((rows, frames), sigma * 1000.0)
        out = _forward(model, jnp.repeat(x, nb, axis=0), t, inputs.first_frame, history, text_k, text_v,
                       rows_in_turn=config.rows_in_turn)
        return combine_branches(out, nb, sampler.guidance_scale)

    x = samplers.sample(velocity, draws, sampler)
    context, t_c = samplers.commit_input(x, draws, sampler)
    k, v = _forward(model.commit_kv, jnp.repeat(context, nb, axis=0), jnp.full((rows, frames), t_c),
                    inputs.first_frame, history, text_k, text_v, rows_in_turn=config.rows_in_turn, out_axis=1)
    return x, k, v


def recache_kv(params: nnx.State, pools: tuple[Array, Array], inputs: ChunkInputs, text_kv: tuple[Array, Array],
               latents: Array, timestep: Array, *, config: ChunkConfig) -> tuple[Array, Array]:
    """The K/V of one recache unit (:class:`arkv_jax.cache.recache.RecacheUnit`): the commit forward
    of a session's kept frames under new conditioning, pure and traceable like :func:`generate_chunk`.

    Args:
      params, pools: as for :func:`generate_chunk` (the pools are only read).
      inputs: the unit's :class:`ChunkInputs`: ``B = S * branches`` batch rows, session-major.
      text_kv: ``(k, v)``, each ``[L, B, T, Hkv, D]``: the new text K/V of the rows.
      latents: ``[S, n, H, W, C]`` each session position's commit-forward input (the session's:
        :func:`arkv_jax.samplers.commit_input` of its chunk's clean latents, the unit's frames;
        anything at padding positions).
      timestep: float scalar, the commit forward's timestep.

    Returns:
      ``(k, v)``: every layer's K/V ``[L, B, n * tokens_per_frame, Hkv, D]`` (``k`` post-RoPE).
    """
    model = nnx.merge(config.graphdef, params)
    rows, frames = inputs.rows.shape[0], latents.shape[1]
    history = PagedHistory.from_inputs(pools, inputs, config.tokens_per_frame, config.backend, mesh=config.mesh)
    x = jnp.repeat(latents.astype(model.config.dtype), rows // latents.shape[0], axis=0)
    return _forward(model.commit_kv, x, jnp.full((rows, frames), timestep, jnp.float32), inputs.first_frame,
                    history, *text_kv, rows_in_turn=config.rows_in_turn, out_axis=1)


def _batch_noise(cache: PagedKVCache, seeds: list[int], ids: tuple[str, ...], counts: np.ndarray, draws: int,
                 shape: tuple[int, ...]) -> np.ndarray:
    """``[S, draws, *shape]``: each session's noise draws for its chunk ``counts[i]``, zeros for the
    sessions another process generates (only this process's rows are placed)."""
    return np.stack([samplers.session_noise(seed, int(count), shape, draws) if cache.is_local(sid)
                     else np.zeros((draws, *shape), np.float32) for sid, seed, count in zip(ids, seeds, counts)])


def _ring_input(session: _Session, first_frame: int, num_frames: int, sampler: Sampler, chunk_frames: int,
                frame_shape: tuple[int, ...], dtype) -> tuple[np.ndarray, float]:
    """The commit-forward input ``[1, num_frames, H, W, C]`` of a session's recomputed frames
    ``first_frame, ...`` (from its latent ring) and its timestep. A session another process holds
    has no ring here: zeros, which only that process's devices would read."""
    chunk, offset = divmod(first_frame, chunk_frames)
    shape = (chunk_frames, *frame_shape)
    clean = session.ring.get(chunk, np.zeros(shape, dtype))
    draws = (samplers.session_noise(session.seed, chunk, shape, sampler.noise_draws)[None]
             if sampler.context_noise else None)  # only a noised commit input reads them
    x, t_c = samplers.commit_input(jnp.asarray(clean, dtype)[None], draws, sampler)
    return np.asarray(x[:, offset:offset + num_frames]), t_c


def _per_layer(k: Array, v: Array):
    """Each layer's ``(k, v)`` ``[T, Hkv, D]`` of one context's text K/V ``[L, 1, T, Hkv, D]``, by
    indexing (an array spread over several processes cannot be iterated)."""
    return ((k[layer, 0], v[layer, 0]) for layer in range(k.shape[0]))


class ChunkResult(NamedTuple):
    """One chunk of every active session this process reads: all of them on one process, on
    several those of its data shards (:meth:`PagedKVCache.is_local`).

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
    """A session's noise seed, the chunks it generated, the latents ``[F, H, W, C]`` of each (host;
    only where this process reads them), and its latent ring: chunk index -> latents of the chunks a
    prompt switch recomputes from (:meth:`arkv_jax.config.WindowPolicy.latent_ring_frames`; device
    arrays on one process, the host latents of this process's sessions on several)."""

    seed: int
    num_chunks: int = 0
    chunks: list[np.ndarray] = dataclasses.field(default_factory=list)
    ring: dict[int, Array] = dataclasses.field(default_factory=dict)

    def keep(self, chunk_index: int, latents, window: WindowPolicy, chunk_frames: int) -> None:
        """Adds a chunk's latents to the ring and drops the chunks no prompt switch can need any
        more (neither a sink chunk nor one of the recent history's)."""
        self.ring[chunk_index] = latents
        for c in [c for c in self.ring if not window.ring_keeps(c, chunk_index, chunk_frames)]:
            del self.ring[c]


def _resolve_rows_in_turn(rows_in_turn: bool | None, mesh: Mesh | None) -> bool:
    """:attr:`ChunkConfig.rows_in_turn` for ``Rollout(rows_in_turn=...)``: ``None`` means on one
    TPU device (the default backend's), never with a mesh."""
    if rows_in_turn is None:
        return mesh is None and jax.default_backend() == "tpu"
    require_bool("rows_in_turn", rows_in_turn)
    if rows_in_turn and mesh is not None:
        raise ValueError("rows_in_turn=True needs one device: with a mesh the data axis holds the rows "
                         "(pass None or False)")
    return rows_in_turn


class Rollout:
    """Chunk-wise generation of many sessions through one :class:`PagedKVCache`.

    Batching. By default (one device) a chunk runs the *live* sessions only: the cache's compact
    batch of their rows (session-major in join order), padded by the cache to the smallest of a few
    bucketed sizes (``cache.chunk(..., buckets=)``; default
    :func:`arkv_jax.cache.batch.default_buckets`, powers of two up to ``max_sessions``), so a chunk
    costs what its live sessions cost, rounded up to a bucket, and :attr:`chunk_fn` compiles once
    per bucket used. With ``full_batch=True``, and always on a mesh, every chunk runs the cache's
    full batch (every slot, idle ones as padding rows): one shape for the whole run. The step says
    where each session sits (``step.place``/``step.take``); the cache's own bookkeeping programs
    (prepare, page write) run on the unpadded compact batch and compile once per live-row count.

    Args:
      model: the video model.
      cache: its cache; geometry and text cache must fit the model, chunks have
        ``geometry.frames_per_forward`` frames.
      sampler: schedule, update, guidance (:class:`Sampler`; presets in :data:`arkv_jax.samplers.SAMPLERS`). With
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
        ``max_sessions`` (default :func:`arkv_jax.cache.batch.default_buckets`); ignored with the
        full batch.
      rows_in_turn: run each forward's batch rows one after the other
        (:attr:`ChunkConfig.rows_in_turn`); ``None`` (default): on one TPU device. ``True`` with a
        mesh raises ``ValueError``.

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
      group: when the cache's mesh spans processes, the :class:`~arkv_jax.processes.ProcessGroup`
        that agrees on every chunk before its commit (a chunk failing or refused on any process raises
        :class:`~arkv_jax.processes.StepFailed` on all, committed nowhere; ``docs/sharding.md``).
    """

    def __init__(self, model: CausalDiT, cache: PagedKVCache, sampler: Sampler = Sampler(), *,
                 text_cache: str = "text", backend: str | None = None, max_sessions: int | None = None,
                 max_traces: int | None = None, full_batch: bool | None = None,
                 buckets: tuple[int, ...] | None = None, rows_in_turn: bool | None = None) -> None:
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
        full_batch = cache.uses_full_batch(full_batch)
        self.model, self.cache, self.sampler, self.text_cache = model, cache, sampler, text_cache
        self.branches = tuple(names[:sampler.num_branches])
        self.chunk_frames = cache.geometry.frames_per_forward
        self.max_sessions = max_sessions or cache.session_capacity
        self.full_batch = full_batch
        self.buckets = (cache.session_capacity,) if full_batch else resolve_buckets(buckets, self.max_sessions)
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
                                        backend or cache.backend, cache.mesh,
                                        _resolve_rows_in_turn(rows_in_turn, cache.mesh))
        self.chunk_fn = jax.jit(self._traced_chunk)
        self.recache_fn = jax.jit(functools.partial(recache_kv, config=self.chunk_config))
        self._sessions: dict[str, _Session] = {}
        self.group = processes.ProcessGroup() if processes.spans_processes(cache.mesh) else None

    def bucket(self, num_sessions: int) -> int:
        """The batch size (sessions) a chunk of ``num_sessions`` live sessions runs at."""
        return bucket_size(num_sessions, self.buckets)

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
        here to the model's ``text_tokens`` (:func:`arkv_jax.conditioning.pad_context`); with guidance
        ``negative_context`` is the encoded negative prompt (required: Wan's negative is an encoded
        prompt, not zeros).
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
        seed = require_int("seed", seed, minimum=0, must="a non-negative int")
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
                self.cache.populate_cross_attention(session_id, self.text_cache, branch, _per_layer(k, v))
        except BaseException:
            if session_id in self.cache.sessions:
                self.cache.close(session_id)
            raise
        self._sessions[session_id] = _Session(int(seed))

    def leave(self, session_id: str) -> np.ndarray | None:
        """Ends a session: closes it in the cache (its pages and text rows are freed) and returns
        its latents ``[frames, H, W, C]`` (``None`` where another process reads them).

        Raises:
          KeyError: unknown session.
        """
        self._session(session_id)
        latents = self.latents(session_id) if self.cache.is_local(session_id) else None
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
        with self.cache.recache(session_id, f, sink=sink, branches=self.branches, full_batch=self.full_batch) as job:
            try:  # refused before this, alike everywhere; from here a failure anywhere fails it everywhere
                # The new text K/V at the session's batch rows, zeros at padding rows: [L, batch, T, Hkv, D].
                text_kv = tuple(job.place_rows(jnp.concatenate([kv[i] for kv in text], axis=1), axis=1)
                                for i in range(len(text[0])))
                for unit in job.units:
                    x, t_c = _ring_input(session, unit.first_frame, unit.num_frames, self.sampler, f,
                                         config.frame_shape, config.dtype)
                    k, v = self.recache_fn(self.params, self.cache.pools, unit.inputs, text_kv,
                                           from_host(job.place(x), self._noise_sharding), jnp.float32(t_c))
                    job.write(k, v)
                for branch, (k, v) in zip(self.branches, text):
                    job.populate_cross_attention(self.text_cache, branch, _per_layer(k, v))
                self.agree(None)
            except BaseException as error:
                if not isinstance(error, StepFailed):
                    self.agree(error)  # on several processes: raises StepFailed on every one
                raise
            job.commit()
        return job.frames

    def _session(self, session_id: str) -> _Session:
        try:
            return self._sessions[session_id]
        except KeyError:
            raise KeyError(f"unknown session {session_id!r}") from None

    def num_frames(self, session_id: str) -> int:
        """Frames a session generated so far, on every process (``KeyError`` if unknown)."""
        return self._session(session_id).num_chunks * self.chunk_frames

    def latents(self, session_id: str) -> np.ndarray:
        """All latents a session generated so far: ``[frames, H, W, C]``.

        Raises:
          KeyError: unknown session, or one whose data shard another process holds.
        """
        session = self._session(session_id)
        if not self.cache.is_local(session_id):
            raise KeyError(f"session {session_id!r} is generated on another process's devices; its latents "
                           "are there")
        if not session.chunks:
            return np.zeros((0, *self.model.config.frame_shape), jnp.dtype(self.model.config.dtype))
        return np.concatenate(session.chunks)

    # -- the chunk -----------------------------------------------------------------------------------
    def step(self) -> ChunkResult:
        """Generates one chunk for every active session (see the module docstring and the class's
        batching note). On several processes every process runs its data shards' rows, then the
        processes agree (:attr:`group`) before the chunk is committed.

        Raises:
          RuntimeError: no active session, or the pool cannot hold the chunk (nothing changes).
          StepFailed: (several processes) the chunk failed or was refused on some process; it
            failed on every process and nothing was committed.
        """
        ids = self.sessions
        if not ids:
            raise RuntimeError("no active session; join one first")
        counts = np.asarray([self._sessions[s].num_chunks for s in ids], np.int32)
        agreed = False
        try:
            noise = _batch_noise(self.cache, [self._sessions[s].seed for s in ids], ids, counts,
                                 self.sampler.noise_draws, (self.chunk_frames, *self.model.config.frame_shape))
            with self.cache.chunk(ids, self.chunk_frames, self.branches, full_batch=self.full_batch,
                                  buckets=self.buckets) as step:
                x, k_new, v_new = self.chunk_fn(self.params, self.cache.pools, step.inputs,
                                                self.cache.cross_attention_kv(self.text_cache),
                                                from_host(step.place(noise), self._noise_sharding))
                agreed = self.agree(None)
                step.commit(k_new, v_new)
        except BaseException as error:
            if not agreed and not isinstance(error, StepFailed):
                self.agree(error)  # on several processes: raises StepFailed on every one
            raise
        local, latents = step.take_local(x)  # this process's sessions, in ``ids`` order, on the host
        # The rings: every session's device latents on one process, this process's host latents on several.
        rings = dict(zip(ids, step.take(x))) if self.group is None else dict(zip(local, latents))
        for i, sid in enumerate(ids):
            self._sessions[sid].num_chunks += 1
            if sid in rings:
                self._sessions[sid].keep(int(counts[i]), rings[sid], self.cache.window, self.chunk_frames)
        for sid, latent in zip(local, latents):
            self._sessions[sid].chunks.append(latent)
        return ChunkResult(local, np.asarray([self.num_frames(s) - self.chunk_frames for s in local], np.int32),
                           latents)

    def agree(self, error: BaseException | None) -> bool:
        """On several processes, :meth:`arkv_jax.processes.ProcessGroup.agree` with this process's
        ``error`` and session table (the cache's slots and every session's chunk count); returns
        ``True``. On one process returns at once.

        Raises:
          StepFailed: on every process, when any process reported an error or the tables differ.
        """
        if self.group is not None:
            table = (tuple(self.cache.slots.items()), tuple((s, v.num_chunks) for s, v in self._sessions.items()))
            self.group.agree(error, table)
        return True


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
