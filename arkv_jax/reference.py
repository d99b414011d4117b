"""The exactness reference: the paged rollout's videos generated without any KV cache.

:class:`FullRecompute` runs the same model with the same sampler and noise as
:class:`arkv_jax.rollout.Rollout`, but every forward runs over *all* frames of each session's video
so far (clean generated frames at timestep 0, the noisy chunk at its timestep, frames not generated
yet masked out), recomputing every layer's history K/V from the clean latents every time. Attention
sees exactly what the cache would show because the window rule is applied as a frame mask
(:func:`window_frame_mask`) through :class:`MaskedHistory`. Its cost grows with the video; the paged
rollout must match it to float rounding (tests and ``arkv-jax demo --check``).

Shapes: ``S`` sessions, ``B = S * branches`` rows, ``F`` frames (of a chunk or of the whole video),
``H, W, C`` a latent frame, ``L`` layers, ``T`` text tokens.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from arkv_jax.config import WindowPolicy
from arkv_jax.models.dit import CausalDiT, prompt_embedding
from arkv_jax.nnx import masked_attention
from arkv_jax.rollout import Sampler, chunk_noise, combine_branches, context_kv, denoise, text_branches

Array = jax.Array


@struct.dataclass
class MaskedHistory:
    """No stored history: the forward's own frames attend to each other under a frame mask (an
    :class:`arkv_jax.nnx.History`).

    Attributes:
      frame_mask: bool ``[B, F, F]``; ``frame_mask[b, i, j]``: frame ``i`` sees frame ``j``.
      tokens_per_frame: tokens per frame (static).
    """

    frame_mask: Array
    tokens_per_frame: int = struct.field(pytree_node=False)

    def attend(self, q: Array, k: Array, v: Array, layer: Array) -> Array:
        """Attention of ``q`` ``[B, F * tpf, Hq, D]`` over the forward's own ``k``/``v``
        ``[B, F * tpf, Hkv, D]`` under the frame mask (``layer`` is unused)."""
        del layer
        tpf = self.tokens_per_frame
        mask = jnp.repeat(jnp.repeat(self.frame_mask, tpf, axis=1), tpf, axis=2)
        return masked_attention(q, k, v, mask)


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

    def text_kv(self, prompts: Sequence[str]) -> tuple[Array, Array]:
        """Text K/V of every row (session-major, branch-minor): ``[L, S * branches, T, Hkv, D]``."""
        config = self.model.config
        texts = [t for p in prompts for t in text_branches(p, self.sampler.num_branches)]
        context = np.stack([prompt_embedding(t, config.text_tokens, config.text_dim) for t in texts])
        return context_kv(self._graphdef, self.params, jnp.asarray(context))

    def chunk(self, clean: Array, first_frame: int, noise: Array, text_kv: tuple[Array, Array]) -> Array:
        """The clean chunk ``[S, F, H, W, C]`` starting at frame ``first_frame`` (all sessions),
        given the earlier clean frames in ``clean`` ``[S, max_frames, H, W, C]`` (later entries are
        ignored), the chunk's float32 starting ``noise`` ``[S, F, H, W, C]`` and :meth:`text_kv`.
        Runs :attr:`chunk_fn`, one compilation per ``max_frames``."""
        return self.chunk_fn(self.params, clean, jnp.int32(first_frame), noise, text_kv)

    def _chunk_fn(self, params, clean: Array, first_frame: Array, noise: Array, text_kv: tuple[Array, Array]
                  ) -> Array:
        model = nnx.merge(self._graphdef, params)
        nb, chunk = self.sampler.num_branches, self.chunk_frames
        sessions, max_frames = clean.shape[:2]
        rows = sessions * nb
        frames = jnp.arange(max_frames)
        generated = frames < first_frame + chunk
        mask = jnp.asarray(window_frame_mask(max_frames, chunk, self.window)) & generated[None, :]
        history = MaskedHistory(jnp.broadcast_to(mask, (rows, max_frames, max_frames)),
                                self.model.config.tokens_per_frame)
        current = (frames >= first_frame) & generated

        def velocity(x, sigma):
            video = jax.lax.dynamic_update_slice_in_dim(clean, x, first_frame, axis=1)
            t = jnp.broadcast_to(jnp.where(current, sigma * 1000.0, 0.0), (rows, max_frames))
            out = model(jnp.repeat(video, nb, axis=0), t, jnp.zeros((rows,), jnp.int32), history, *text_kv)
            current_out = jax.lax.dynamic_slice_in_dim(out, first_frame, chunk, axis=1)
            return combine_branches(current_out, nb, self.sampler.guidance_scale)

        return denoise(velocity, noise.astype(clean.dtype), self.sampler.sigmas())

    def rollout(self, prompts: Sequence[str], seeds: Sequence[int], num_chunks: int) -> np.ndarray:
        """``[S, num_chunks * F, H, W, C]``: every session generated together (padded to the full
        length, so one compilation serves all chunks)."""
        config = self.model.config
        text_kv = self.text_kv(prompts)
        chunk = self.chunk_frames
        shape = (chunk, *config.frame_shape)
        clean = jnp.zeros((len(prompts), num_chunks * chunk, *config.frame_shape), config.dtype)
        for c in range(num_chunks):
            noise = np.stack([chunk_noise(seed, c, shape) for seed in seeds])
            x = self.chunk(clean, c * chunk, noise, text_kv)
            clean = jax.lax.dynamic_update_slice_in_dim(clean, x, c * chunk, axis=1)
        return np.asarray(clean)
