"""The exactness reference: the paged rollout's videos generated without any KV cache.

:class:`FullRecompute` runs the model with the rollout's sampler, noise and conditioning
(:mod:`arkv_jax.samplers`, :mod:`arkv_jax.conditioning`; never :mod:`arkv_jax.rollout`, the code it
checks), but every forward runs over *all* frames of each session's video so far, recomputing every
layer's history K/V each time; the window rule is a frame mask (:func:`window_frame_mask` through
:class:`MaskedHistory`). History frames are what the cache's commit forward saw
(:func:`arkv_jax.samplers.commit_input`). The paged rollout must match it to float rounding (tests,
``arkv-jax demo --check``; ``docs/rollout.md``). Shapes: ``S`` sessions, ``B = S * branches`` rows,
``F`` frames, ``H, W, C`` a latent frame, ``L`` layers, ``T`` text tokens.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from arkv_jax import samplers
from arkv_jax.conditioning import branch_contexts, context_kv
from arkv_jax.config import WindowPolicy
from arkv_jax.models.dit import CausalDiT
from arkv_jax.nnx import masked_attention
from arkv_jax.samplers import Sampler, combine_branches
from pallas_kernels.rope import prepare_qk

Array = jax.Array


@struct.dataclass
class MaskedHistory:
    """No stored history: the forward's own frames attend to each other under a frame mask (an
    :class:`arkv_jax.nnx.History`).

    Attributes:
      frame_mask: bool ``[B, F, F]``; ``frame_mask[b, i, j]``: frame ``i`` sees frame ``j``.
      tokens_per_frame: tokens per frame (static).
      pinned: ``None``, or ``(k, v)`` ``[L, B, P, Hkv, D]``: K/V that replace the first ``P`` tokens'
        own in every layer (a sink kept across a prompt switch: :meth:`FullRecompute.commit_kv`).
    """

    frame_mask: Array
    tokens_per_frame: int = struct.field(pytree_node=False)
    pinned: tuple[Array, Array] | None = None

    def attend(self, q: Array, k: Array, v: Array, layer: Array,
               rope: tuple[Array, Array] | None = None,
               qk_norm: tuple[Array, Array, Array, Array] | None = None) -> Array:
        """Attention of ``q`` ``[B, F * tpf, Hq, D]`` over the forward's own ``k``/``v``
        ``[B, F * tpf, Hkv, D]`` (prepared by ``qk_norm`` and ``rope`` first where given; the
        pinned tokens' replaced) under the frame mask."""
        tpf = self.tokens_per_frame
        q, k = prepare_qk(q, k, rope, qk_norm)
        if self.pinned is not None:
            k, v = (jax.lax.dynamic_update_slice_in_dim(x, pin[layer].astype(x.dtype), 0, axis=1)
                    for x, pin in zip((k, v), self.pinned))
        mask = jnp.repeat(jnp.repeat(self.frame_mask, tpf, axis=1), tpf, axis=2)
        return masked_attention(q, k, v, mask)

    def attend_context(self, q: Array, k: Array, v: Array) -> Array:
        """Plain XLA attention over the whole context."""
        return masked_attention(q, k, v)


def window_frame_mask(num_frames: int, chunk_frames: int, window: WindowPolicy) -> np.ndarray:
    """bool ``[num_frames, num_frames]``: whether a query in frame ``i`` sees key frame ``j`` when a
    video is generated ``chunk_frames`` frames at a time under ``window``.

    A chunk (frames ``[c0, c0 + chunk_frames)``) sees itself (bidirectionally), the sink frames
    (``j < sink_frames``) and the most recent earlier frames such that, with the chunk, at most
    ``sink_frames + window_frames`` frames are visible; in reset mode only the sink: the window
    rule of :meth:`arkv_jax.config.WindowPolicy.frame_visible`, independently of pages.
    """
    frames = np.arange(num_frames)
    chunk_first = frames // chunk_frames * chunk_frames
    return window.frame_visible(frames[None, :], chunk_first[:, None], chunk_frames)


class FullRecompute:
    """The same generation as :class:`arkv_jax.rollout.Rollout` without a KV cache: the exactness
    reference and the no-cache baseline (see the module docstring).

    Args:
      model: the video model.
      window: the window policy the paged cache uses.
      sampler: as for the rollout.
      chunk_frames: frames per chunk.

    Attributes:
      params: the model's parameters.
      chunk_fn: the jitted ``(params, clean, first_frame, noise, text_kv) -> latents`` behind
        :meth:`chunk`.
    """

    def __init__(self, model: CausalDiT, window: WindowPolicy, sampler: Sampler = Sampler(), *,
                 chunk_frames: int) -> None:
        self.model, self.window, self.sampler, self.chunk_frames = model, window, sampler, chunk_frames
        self._graphdef, self.params = nnx.split(model)
        self.chunk_fn = jax.jit(self._chunk_fn)
        self.commit_kv_fn = jax.jit(self._commit_kv_fn)

    def text_kv(self, prompts: Sequence[str] | None = None, *, contexts: Sequence | None = None,
                negative_contexts: Sequence | None = None) -> tuple[Array, Array]:
        """Text K/V of every row (session-major, branch-minor): ``[L, S * branches, T, Hkv, D]``, of
        the ``prompts`` (hash stand-in) or of the sessions' ``contexts`` (and, with guidance,
        ``negative_contexts``), each ``[tokens, text_dim]``, as :meth:`Rollout.join` takes them."""
        config, nb = self.model.config, self.sampler.num_branches
        if contexts is None:
            if prompts is None:
                raise ValueError("pass prompts or contexts=")
            per_session = [branch_contexts(config.text_tokens, config.text_dim, nb, p) for p in prompts]
        else:
            if prompts is not None:
                raise ValueError("pass prompts or contexts=, not both")
            negatives = [None] * len(contexts) if negative_contexts is None else list(negative_contexts)
            if len(negatives) != len(contexts):
                raise ValueError(f"{len(contexts)} contexts but {len(negatives)} negative_contexts")
            per_session = [branch_contexts(config.text_tokens, config.text_dim, nb, None, c, n)
                           for c, n in zip(contexts, negatives)]
        context = np.stack([c for branches in per_session for c in branches])
        return context_kv(self._graphdef, self.params, jnp.asarray(context))

    def chunk(self, history: Array, first_frame: int, noise: Array, text_kv: tuple[Array, Array], *,
              visible: np.ndarray | None = None, pinned: tuple[Array, Array] | None = None) -> Array:
        """The clean chunk ``[S, F, H, W, C]`` starting at frame ``first_frame`` (all sessions),
        given the earlier frames as the cache's commit forward saw them in ``history``
        ``[S, max_frames, H, W, C]`` (clean latents, or noised with ``context_noise``; later
        entries are ignored), the chunk's float32 noise draws ``noise`` ``[S, D, F, H, W, C]``
        (``D = sampler.noise_draws``; rank 5 for one draw) and :meth:`text_kv`. Runs
        :attr:`chunk_fn`, one compilation per ``max_frames``.

        Prompt switches (:meth:`arkv_jax.rollout.Rollout.switch_prompt`): ``visible`` (bool
        ``[max_frames]``, default all) masks out the frames a switch forgot, for every query;
        ``pinned`` (:meth:`commit_kv` of a kept sink) replaces the sink's K/V in every layer.
        """
        frames = history.shape[1]
        visible = np.ones(frames, bool) if visible is None else np.asarray(visible, bool)
        return self.chunk_fn(self.params, history, jnp.int32(first_frame), noise, text_kv,
                             jnp.array(visible, copy=True), pinned)  # a copy: the caller may reuse its array

    def commit_kv(self, history: Array, num_frames: int, text_kv: tuple[Array, Array]) -> tuple[Array, Array]:
        """Every layer's K/V ``[L, S * branches, num_frames * tpf, Hkv, D]`` of the first
        ``num_frames`` frames of ``history`` (as for :meth:`chunk`) as their commit forwards
        computed them under ``text_kv``: what the cache holds for a sink of ``num_frames`` frames."""
        return self.commit_kv_fn(self.params, history[:, :num_frames], text_kv)

    def _commit_kv_fn(self, params, history_latents: Array, text_kv: tuple[Array, Array]):
        model = nnx.merge(self._graphdef, params)
        nb = self.sampler.num_branches
        sessions, frames = history_latents.shape[:2]
        rows = sessions * nb
        mask = jnp.asarray(window_frame_mask(frames, self.chunk_frames, self.window))
        history = MaskedHistory(jnp.broadcast_to(mask, (rows, frames, frames)), self.model.config.tokens_per_frame)
        t = jnp.full((rows, frames), float(self.sampler.context_noise))
        return model.commit_kv(jnp.repeat(history_latents, nb, axis=0), t, jnp.zeros((rows,), jnp.int32), history,
                               *text_kv)

    def _chunk_fn(self, params, history_latents: Array, first_frame: Array, noise: Array,
                  text_kv: tuple[Array, Array], visible: Array, pinned: tuple[Array, Array] | None) -> Array:
        model = nnx.merge(self._graphdef, params)
        nb, chunk = self.sampler.num_branches, self.chunk_frames
        sessions, max_frames = history_latents.shape[:2]
        rows = sessions * nb
        frames = jnp.arange(max_frames)
        generated = frames < first_frame + chunk
        mask = jnp.asarray(window_frame_mask(max_frames, chunk, self.window)) & (generated & visible)[None, :]
        history = MaskedHistory(jnp.broadcast_to(mask, (rows, max_frames, max_frames)),
                                self.model.config.tokens_per_frame, pinned)
        current = (frames >= first_frame) & generated
        context_t = float(self.sampler.context_noise)

        def velocity(x, sigma):
            video = jax.lax.dynamic_update_slice_in_dim(history_latents, x, first_frame, axis=1)
            t = jnp.broadcast_to(jnp.where(current, sigma * 1000.0, context_t), (rows, max_frames))
            out = model(jnp.repeat(video, nb, axis=0), t, jnp.zeros((rows,), jnp.int32), history, *text_kv)
            current_out = jax.lax.dynamic_slice_in_dim(out, first_frame, chunk, axis=1)
            return combine_branches(current_out, nb, self.sampler.guidance_scale)

        return samplers.sample(velocity, samplers.as_draws(noise).astype(history_latents.dtype), self.sampler)

    def rollout(self, prompts: Sequence[str] | None, seeds: Sequence[int], num_chunks: int, *,
                contexts: Sequence | None = None, negative_contexts: Sequence | None = None) -> np.ndarray:
        """``[S, num_chunks * F, H, W, C]`` clean latents: every session generated together (padded
        to the full length, so one compilation serves all chunks), conditioned as :meth:`text_kv`
        says, with each session's noise draws (:func:`arkv_jax.samplers.session_noise`)."""
        config = self.model.config
        text_kv = self.text_kv(prompts, contexts=contexts, negative_contexts=negative_contexts)
        chunk, draws = self.chunk_frames, self.sampler.noise_draws
        shape = (chunk, *config.frame_shape)
        clean = jnp.zeros((len(seeds), num_chunks * chunk, *config.frame_shape), config.dtype)
        history = clean
        for c in range(num_chunks):
            noise = np.stack([samplers.session_noise(seed, c, shape, draws) for seed in seeds])
            x = self.chunk(history, c * chunk, noise, text_kv)
            clean = jax.lax.dynamic_update_slice_in_dim(clean, x, c * chunk, axis=1)
            seen, _ = samplers.commit_input(x, jnp.asarray(noise, x.dtype), self.sampler)
            history = jax.lax.dynamic_update_slice_in_dim(history, seen, c * chunk, axis=1)
        return np.asarray(clean)
