"""Context attention on TPU (``"pallas_tpu*"``): one Mosaic grid step per (row, KV head, query
block) holds the whole context's K/V in VMEM, so the softmax is one pass (no running maximum, no
rescaling) and no logits reach HBM. Semantics and shapes: :func:`pallas_kernels.context_attention.
context_attention`; design and figures: ``docs/kernels.md`` (Context attention).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.common import LOG2_E, MASK_VALUE, cdiv, matmul_precision, round_up, token_major_blocks

LANES = 128
"""The context is padded to a multiple of this many keys (TPU lanes); padding keys are masked."""
LOGIT_BYTES = 8 << 20
"""Most bytes of one grid step's float32 logits ``[group * block_q, kv_pad]``: the query block is
cut so that they fit (with the probabilities beside them) under the default scoped VMEM."""
MAX_BLOCK_Q = 2048
"""Most query rows per block (before GQA folding)."""


def default_block_q(q_len: int, group: int, kv_len: int) -> int:
    """The query block: the fewest blocks of at most :data:`MAX_BLOCK_Q` rows whose logits fit
    :data:`LOGIT_BYTES`, cut evenly and rounded up to a multiple of 8 (a 4,680-token chunk over 512
    text tokens: three blocks of 1,560)."""
    cap = max(8, min(MAX_BLOCK_Q, LOGIT_BYTES // (4 * group * round_up(kv_len, LANES))) // 8 * 8)
    return round_up(cdiv(q_len, cdiv(q_len, cap)), 8)


def _kernel(q_ref, k_ref, v_ref, o_ref, *, scale: float, kv_len: int):
    """Refs (VMEM): ``q_ref``/``o_ref`` ``[group, block_q, D]``, or ``[block_q, D]`` where the
    kernel reads the token-major arrays (:func:`~pallas_kernels.common.token_major_blocks`; rows
    of the last block past ``q_len`` are unspecified, their outputs dropped), ``k_ref``/``v_ref``
    ``[kv_pad, D]`` (keys at and past ``kv_len`` are zero padding, their logits masked by
    selection)."""
    dim = q_ref.shape[-1]
    precision = matmul_precision(q_ref.dtype)
    q = (q_ref[...].reshape(-1, dim).astype(jnp.float32) * (scale * LOG2_E)).astype(q_ref.dtype)
    s = lax.dot_general(q, k_ref[...], (((1,), (1,)), ((), ())), precision=precision,
                        preferred_element_type=jnp.float32)
    if kv_len < k_ref.shape[0]:  # padding keys (zeros, as are their values) get no weight
        s = jnp.where(lax.broadcasted_iota(jnp.int32, s.shape, 1) < kv_len, s, MASK_VALUE)
    p = jnp.exp2(s - jnp.max(s, axis=1, keepdims=True))
    total = jnp.sum(p, axis=1, keepdims=True)
    out = lax.dot_general(p.astype(v_ref.dtype), v_ref[...], (((1,), (0,)), ((), ())), precision=precision,
                          preferred_element_type=jnp.float32)
    o_ref[...] = (out / total).astype(o_ref.dtype).reshape(o_ref.shape)


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "interpret"))
def context_attention(q, k, v, *, scale: float, block_q: int, interpret: Any):
    """The kernel on validated inputs: ``q`` ``[B, N, Hq, D]``, ``k``/``v`` ``[B, T, Hkv, D]``.

    Without GQA and with a head dim of whole lane groups
    (:func:`~pallas_kernels.common.token_major_blocks`) the kernel reads ``q``, ``k`` and ``v``
    and writes its output in these token-major arrays, viewed ``[B, tokens, heads * D]`` with one
    head's lanes per block; otherwise the wrapper transposes
    ``q`` to ``[B, Hkv, group, N, D]`` and ``k``/``v`` to ``[B, Hkv, T, D]`` (XLA:TPU relays a
    head-major view out with copies). The context is padded to a multiple of :data:`LANES` keys
    when it is not one.
    """
    batch, q_len, q_heads, dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    kv_pad = round_up(kv_len, LANES)

    def padded(x):  # [B, T, ...] -> [B, kv_pad, ...]
        pad = [(0, 0)] * x.ndim
        pad[1] = (0, kv_pad - kv_len)
        return x if kv_pad == kv_len else jnp.pad(x, pad)

    if token_major_blocks(group, dim):
        qh, kh, vh = (x.reshape(batch, x.shape[1], -1) for x in (q, padded(k), padded(v)))
        q_spec = pl.BlockSpec((None, block_q, dim), lambda b, h, i: (b, i, h))
        kv_spec = pl.BlockSpec((None, kv_pad, dim), lambda b, h, i: (b, 0, h))
    else:
        qh = q.reshape(batch, q_len, kv_heads, group, dim).transpose(0, 2, 3, 1, 4)
        kh, vh = (padded(x).transpose(0, 2, 1, 3) for x in (k, v))
        q_spec = pl.BlockSpec((None, None, group, block_q, dim), lambda b, h, i: (b, h, 0, i, 0))
        kv_spec = pl.BlockSpec((None, None, kv_pad, dim), lambda b, h, i: (b, h, 0, 0))
    out = pl.pallas_call(
        functools.partial(_kernel, scale=scale, kv_len=kv_len),
        out_shape=jax.ShapeDtypeStruct(qh.shape, q.dtype),
        grid=(batch, kv_heads, cdiv(q_len, block_q)),
        in_specs=[q_spec, kv_spec, kv_spec],
        out_specs=q_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel")),
        interpret=interpret,
        name="context_attention_tpu",
    )(qh, kh, vh)
    if not token_major_blocks(group, dim):
        out = out.transpose(0, 3, 1, 2, 4)
    return out.reshape(q.shape)
