"""Dense softmax attention in plain XLA: the ``"xla"`` path of context attention and the math the
masked references share (:func:`arkv_jax.nnx.masked_attention`). Semantics: ``docs/kernels.md``
(Context attention)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common import MASK_VALUE


def attention(q, k, v, mask=None, scale: float | None = None):
    """Softmax attention of ``q`` ``[B, Nq, Hq, D]`` over ``k``/``v`` ``[B, Nk, Hkv, D]``.

    GQA: query head ``h`` reads KV head ``h // (Hq // Hkv)``. ``mask`` (bool ``[B, Nq, Nk]``, True =
    visible) removes keys by selection (:data:`~pallas_kernels.common.MASK_VALUE`: a query with no
    visible key averages uniformly). Logits and softmax in float32, ``scale`` (default
    ``D ** -0.5``); returns ``[B, Nq, Hq, D]`` in ``q``'s dtype.
    """
    batch, nq, hq, dim = q.shape
    hkv = k.shape[2]
    scale = dim ** -0.5 if scale is None else scale
    qg = q.reshape(batch, nq, hkv, hq // hkv, dim)
    logits = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32) * scale
    if mask is not None:
        logits = jnp.where(mask[:, None, None], logits, MASK_VALUE)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(q.shape).astype(q.dtype)
