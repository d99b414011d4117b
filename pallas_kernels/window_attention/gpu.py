"""Window attention as a Pallas GPU kernel, Triton lowering (``"pallas_gpu"``, ``_interpret``), for
NVIDIA GPUs Mosaic GPU does not serve (Ampere and Ada); on Hopper and later the cuDNN gather path
(:mod:`.cudnn_gather`) is the default and the Mosaic GPU kernel (:mod:`.mosaic_gpu`) the fused one.

One program per ``(row, KV head, query block)``, GQA folded onto the query axis. The key loop walks
history tokens through a token-to-pool-row map computed outside the kernel
(:func:`history_pool_rows`), so a row's valid keys are a prefix: full blocks run unmasked and only
the boundary block and the tail's last block mask. Base-2 softmax, float32 statistics. Quantized
pools (:class:`pallas_kernels.layout.QuantizedPool`) are loaded at their 8-bit width and converted
to the compute dtype in registers; each key's page scale multiplies its logits and each value's
the probabilities before ``P @ V``. Requires
``head_dim`` a power of two >= 16 and tiles that are powers of two in ``[16, 256]``. JAX deprecates
the Triton backend, so it is imported only when this backend runs. Semantics and shapes:
:func:`pallas_kernels.window_attention.window_attention`; design: ``docs/kernels.md``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.backend import resolve_backend
from pallas_kernels.common import LOG2_E, MASK_VALUE, matmul_precision, round_up
from pallas_kernels.layout import (
    PoolGeometry,
    head_row_stride,
    is_quantized_pool,
    token_row,
    token_rows,
)
from pallas_kernels.window_attention.geometry import (
    WindowGeometry,
    history_token_slot,
    layer_page_table,
    tail_kv,
)

BLOCK_Q = 128
"""Default query tile over the folded (group x q_len) query axis, shrunk to it in powers of two
>= 16."""
BLOCK_K = 64
"""Default key tile in tokens, shrunk to the longest key run (history capacity or tail)."""
NUM_STAGES = 3
"""Default Triton pipeline stages."""


def tiles(geom: WindowGeometry, block_q: int | None, block_k: int | None) -> tuple[int, int]:
    """``(block_q, block_k)``: the given tiles (already validated), or the defaults shrunk to the
    folded query length and the longest key run."""
    def tile(value, default, extent):
        return max(16, min(default, pl.next_power_of_2(extent))) if value is None else int(value)

    return (tile(block_q, BLOCK_Q, geom.group * geom.q_len),
            tile(block_k, BLOCK_K, max(geom.capacity, geom.tail_len)))


def default_num_warps(block_q: int, head_dim: int) -> int:
    """4 warps for query tiles of up to 64 x 128 elements, 8 above."""
    return 4 if block_q * head_dim <= 64 * 128 else 8


def _attend(carry, q, k, v, valid, c, value_scale=None):
    """One online-softmax update in base 2 over a key block.

    ``carry`` is ``(m [bq, 1], l [bq, 1], acc [bq, D])`` float32 with ``m`` in base-2 units; ``q``
    ``[bq, D]``; ``k``/``v`` ``[bk, D]``; ``valid`` None (all keys valid) or bool ``[1, bk]``;
    ``c`` scales the f32 scores once: ``scale * log2(e)``, or for keys of a quantized pool that
    times each key's page scale, float32 ``[1, bk]`` (``q`` stays unscaled: scaling it in its own
    dtype would round it). ``value_scale``: None, or float32 ``[1, bk]``, each value's page scale,
    applied to the probabilities before ``P @ V`` (the sum ``l`` takes them unscaled). Masked keys
    must hold finite values and scales (their ``p`` is exactly 0).
    """
    m_prev, l_prev, acc_prev = carry
    precision = matmul_precision(q.dtype)
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                        preferred_element_type=jnp.float32) * c
    if valid is not None:
        s = jnp.where(valid, s, MASK_VALUE)
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    p = jnp.exp2(s - m_new)
    alpha = jnp.exp2(m_prev - m_new)
    weights = p if value_scale is None else p * value_scale
    pv = lax.dot_general(weights.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)
    return m_new, alpha * l_prev + jnp.sum(p, axis=1, keepdims=True), alpha * acc_prev + pv


def _kernel(rows_ref, len_ref, q_ref, kp_ref, vp_ref, kt_ref, vt_ref, *refs,
            geom: WindowGeometry, scale: float, block_k: int, quantized: bool):
    """Program ``(row, kv head, query block)``.

    Refs: ``q_ref``/``o_ref`` ``[bq, D]``; ``kp_ref``/``vp_ref`` the head-major pool as token rows
    (:func:`pallas_kernels.layout.token_rows`, one KV head's slot per row); ``rows_ref`` int32
    ``[rows, round_up(capacity, block_k)]``: the pool row of each history token of KV head 0
    (:func:`history_pool_rows`; KV head ``h`` is :func:`pallas_kernels.layout.head_row_stride`
    rows further); ``len_ref`` ``[rows]``; ``kt_ref``/``vt_ref`` ``[rows, tail_pad, kv_heads, D]``.
    ``refs``: ``(o_ref,)``, or for ``quantized`` pools (8-bit token rows) ``(ks_ref, vs_ref,
    o_ref)``, the pools' scales flat float32 ``[L * H * P]``: the scale of pool row ``r`` is entry
    ``r // block_size``. History K/V are converted to ``q``'s dtype after the load; K's scales
    multiply the logits, V's the probabilities; the tail stays in ``q``'s dtype.
    """
    *scale_refs, o_ref = refs
    row, kv_head = pl.program_id(0), pl.program_id(1)
    head_offset = kv_head * head_row_stride(_pool_geometry(geom))
    q = q_ref[...]
    length = len_ref[row]
    lane = lax.iota(jnp.int32, block_k)
    c = scale * LOG2_E

    def history_block(b, carry, masked: bool):
        pool_row = rows_ref[row, pl.ds(pl.multiple_of(b * block_k, block_k), block_k)] + head_offset
        valid = (b * block_k + lane < length)[None, :] if masked else None
        k, v = kp_ref[pool_row, :], vp_ref[pool_row, :]
        if not quantized:
            return _attend(carry, q, k, v, valid, c)
        ks_ref, vs_ref = scale_refs
        page = lax.div(pool_row, geom.block_size)
        return _attend(carry, q, k.astype(q.dtype), v.astype(q.dtype), valid,
                       (c * ks_ref[page])[None, :], vs_ref[page][None, :])

    def tail_block(b, carry, masked: bool):
        start = b * block_k if isinstance(b, int) else pl.multiple_of(b * block_k, block_k)
        keys = pl.ds(start, block_k)
        valid = (b * block_k + lane < geom.tail_len)[None, :] if masked else None
        return _attend(carry, q, kt_ref[row, keys, kv_head, :], vt_ref[row, keys, kv_head, :],
                       valid, c)

    block_q = q.shape[0]
    carry = (jnp.full((block_q, 1), MASK_VALUE, jnp.float32),
             jnp.zeros((block_q, 1), jnp.float32),
             jnp.zeros((block_q, geom.head_dim), jnp.float32))
    full = lax.div(length, block_k)
    carry = lax.fori_loop(0, full, functools.partial(history_block, masked=False), carry)
    carry = lax.fori_loop(full, lax.div(length + block_k - 1, block_k),
                          functools.partial(history_block, masked=True), carry)
    tail_full, tail_rest = divmod(geom.tail_len, block_k)
    carry = lax.fori_loop(0, tail_full, functools.partial(tail_block, masked=False), carry)
    if tail_rest:
        carry = tail_block(tail_full, carry, masked=True)
    _, denominator, acc = carry
    o_ref[...] = (acc / denominator).astype(o_ref.dtype)


def _pool_geometry(geom: WindowGeometry) -> PoolGeometry:
    return PoolGeometry(geom.num_layers, geom.kv_heads, geom.num_pages, geom.block_size,
                        geom.head_dim)


def history_pool_rows(pages, lengths, layer, geom: WindowGeometry, padded_len: int):
    """int32 ``[rows, padded_len]``: the row of the pool viewed as token rows
    (:func:`pallas_kernels.layout.token_rows`) that holds history token ``t`` of ``layer`` and KV
    head 0, for ``t < lengths[row]``; every other token
    (past the length or the capacity) names the row of token 0, so a key block that straddles the
    length reads finite, valid data in its masked lanes (or the null page's zeros at length 0).
    """
    table = layer_page_table(pages, lengths, 0, geom)
    tokens = jnp.arange(padded_len, dtype=jnp.int32)
    tokens = jnp.where(tokens[None, :] < lengths.astype(jnp.int32)[:, None], tokens[None, :], 0)
    slots = history_token_slot(tokens, geom)
    page = jnp.take_along_axis(table, slots // geom.block_size, axis=1)
    return token_row(_pool_geometry(geom), layer, 0, page, slots % geom.block_size)


@functools.partial(jax.jit, static_argnames=("geom", "scale", "block_q", "block_k", "num_warps",
                                             "num_stages", "backend"))
def window_attention(q, k_cur, v_cur, extra_k, extra_v, k_pool, v_pool, pages, lengths, layer,
                     *, geom: WindowGeometry, scale: float, block_q: int, block_k: int,
                     backend: str, num_warps: int | None = None, num_stages: int = NUM_STAGES):
    """Folds GQA into ``q`` (``[rows, kv_heads, group * q_len, D]``, padded to ``block_q``), builds
    the padded tail and each history token's pool row, views the pools as token rows, runs the
    kernel and unfolds the output.

    Arguments as :func:`pallas_kernels.window_attention.window_attention` (tiles validated);
    ``backend`` one of the ``pallas_gpu*`` names (it sets ``interpret``); ``num_warps`` (4 or 8,
    default :func:`default_num_warps`) and ``num_stages`` (in ``[1, 4]``) are Triton's.
    """
    from jax.experimental.pallas import triton as pltriton  # Only this backend needs Triton.

    rows, g, hkv, d = geom.rows, geom.group, geom.kv_heads, geom.head_dim
    num_warps = default_num_warps(block_q, d) if num_warps is None else num_warps
    folded = g * geom.q_len
    q_pad = round_up(folded, block_q)
    qf = q.reshape(rows, geom.q_len, hkv, g, d).transpose(0, 2, 3, 1, 4).reshape(
        rows, hkv, folded, d)
    qf = jnp.pad(qf, ((0, 0), (0, 0), (0, q_pad - folded), (0, 0)))
    k_tail, v_tail = tail_kv(k_cur, v_cur, extra_k, extra_v, round_up(geom.tail_len, block_k))
    pool_rows = history_pool_rows(pages, lengths, layer, geom, round_up(geom.capacity, block_k))
    quantized = is_quantized_pool(k_pool)
    pools = ([token_rows(k_pool.values), token_rows(v_pool.values), k_tail, v_tail,
              k_pool.scales.reshape(-1), v_pool.scales.reshape(-1)] if quantized
             else [token_rows(k_pool), token_rows(v_pool), k_tail, v_tail])
    io_spec = pl.BlockSpec((None, None, block_q, d), lambda row, head, qb: (row, head, qb, 0))
    whole = pl.BlockSpec()
    out = pl.pallas_call(
        functools.partial(_kernel, geom=geom, scale=scale, block_k=block_k, quantized=quantized),
        out_shape=jax.ShapeDtypeStruct(qf.shape, q.dtype),
        grid=(rows, hkv, q_pad // block_q),
        in_specs=[whole, whole, io_spec, *[whole] * len(pools)],
        out_specs=io_spec,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=resolve_backend(backend).interpret,
        name="window_attention_gpu",
    )(pool_rows, lengths.astype(jnp.int32), qf, *pools)
    out = out[:, :, :folded].reshape(rows, hkv, g, geom.q_len, d)
    return out.transpose(0, 3, 1, 2, 4).reshape(q.shape)
