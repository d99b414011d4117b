"""Pure-jnp reference of paged window attention: slow and simple; every backend is tested
against it (semantics: ``docs/kernels.md``, Paged window attention)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.layout import read_tokens_as
from pallas_kernels.window_attention.validation import check_arrays


def window_attention_reference(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, *, layer=0,
                               extra_k=None, extra_v=None, scale=None, tokens_per_frame=None):
    """Pure-jnp reference of :func:`pallas_kernels.window_attention.window_attention` (same array
    arguments and shapes, no backend options).

    Every history token is fetched by its logical position ``t < lengths[row]`` (frame ``t // tpf``,
    in-frame offset ``t % tpf``, hence page-list slot ``frame * pages_per_frame * block_size +
    offset``), then all keys are concatenated, masked and passed through a float32 softmax.
    Quantized pools (:class:`~pallas_kernels.layout.QuantizedPool`) are dequantized as they are read
    (:func:`~pallas_kernels.layout.read_tokens_as`), then the same math runs.

    Raises:
      ValueError: what :func:`~pallas_kernels.window_attention.validation.check_arrays` rejects.
    """
    geom = check_arrays(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, layer=layer,
                        extra_k=extra_k, extra_v=extra_v, tokens_per_frame=tokens_per_frame)
    scale = geom.head_dim ** -0.5 if scale is None else scale
    f32 = jnp.float32
    tokens = jnp.arange(geom.max_pages * geom.block_size, dtype=jnp.int32)
    valid = tokens[None, :] < lengths.astype(jnp.int32)[:, None]
    slot = jnp.where(valid, (tokens // geom.tokens_per_frame) * geom.frame_slots
                     + tokens % geom.tokens_per_frame, 0)
    page = jnp.take_along_axis(pages.astype(jnp.int32), slot // geom.block_size, axis=1)
    k_hist = read_tokens_as(k_pool, layer, page, slot % geom.block_size, f32)
    v_hist = read_tokens_as(v_pool, layer, page, slot % geom.block_size, f32)
    keys = [k_hist, k_cur] + ([] if extra_k is None else [extra_k])
    values = [v_hist, v_cur] + ([] if extra_v is None else [extra_v])
    k = jnp.repeat(jnp.concatenate(keys, axis=1).astype(f32), geom.group, axis=2)
    v = jnp.repeat(jnp.concatenate(values, axis=1).astype(f32), geom.group, axis=2)
    mask = jnp.concatenate([valid, jnp.ones((geom.rows, geom.tail_len), bool)], axis=1)
    logits = jnp.einsum("rqhd,rkhd->rhqk", q.astype(f32), k, precision=lax.Precision.HIGHEST)
    logits = jnp.where(mask[:, None, None, :], logits * scale, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    v = jnp.where(mask[:, :, None, None], v, 0.0)
    out = jnp.einsum("rhqk,rkhd->rqhd", probs, v, precision=lax.Precision.HIGHEST)
    return out.astype(q.dtype)
