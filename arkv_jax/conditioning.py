"""Text conditioning of a session: the text context of each KV branch and its per-layer K/V.

A session's branches (the prompt, then the CFG negative) are conditioned on text-encoder outputs
(:func:`pad_context`: zero-padded to the model's ``text_tokens``, as Wan pads umT5's tokens) or, for
the demo and tests without a text encoder, on the hash stand-in
:func:`arkv_jax.models.dit.prompt_embedding` (:func:`branch_contexts`). :func:`context_kv` is the
model's per-layer text K/V of those contexts, what the cache's cross-attention store holds. Used by
the rollout (:meth:`arkv_jax.rollout.Rollout.join`, ``switch_prompt``) and the exactness reference
(:class:`arkv_jax.reference.FullRecompute`); ``docs/rollout.md``.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx

from arkv_jax.models.dit import prompt_embedding

Array = jax.Array


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


__all__ = ["branch_contexts", "context_kv", "pad_context", "text_branches"]
