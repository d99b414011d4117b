"""Window attention as a Pallas GPU kernel, Triton lowering (``"pallas_gpu"``, ``_interpret``).

One program per (row, query head, query block); the key loop walks the row's visible pages
``block_k`` slots at a time, gathering the K/V rows of its KV head through the page table with
pointer indexing into the head-major pool viewed as token rows (any ``block_size``), then the
tail. Requires a power-of-two ``head_dim >= 16``.

Triton rather than Mosaic GPU: the Triton lowering is the GPU path whose semantics the CPU
interpreter checks faithfully (block programs, gathers, masked loops) and it compiles for Ampere as
well as Hopper; a Mosaic GPU kernel (``plgpu.kernel``, warpgroup pipelines, TMA gathers) has
Hopper-specific layout, swizzle and barrier constraints that interpret mode does not check. JAX
deprecates the Triton backend from 0.11 on (its lowering warns), so it is imported only when this
backend runs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.backend import resolve_backend
from pallas_kernels.common import MASK_VALUE, cdiv, online_softmax_step, round_up
from pallas_kernels.layout import PoolGeometry, token_row, token_rows
from pallas_kernels.window_attention.geometry import (
    WindowGeometry,
    history_slot_valid,
    layer_page_table,
    tail_kv,
    visible_page_count,
)

BLOCK_Q = 128
"""Default query tile (shrunk to the chunk, in powers of two >= 16)."""
BLOCK_K = 64
"""Default key tile in tokens (shrunk to the tail, in powers of two >= 16)."""


def tiles(geom: WindowGeometry, block_q: int | None, block_k: int | None) -> tuple[int, int]:
    """``(block_q, block_k)``: the given tiles (already validated), or the defaults shrunk to the
    query and tail lengths."""
    def tile(value, default, extent):
        return max(16, min(default, pl.next_power_of_2(extent))) if value is None else int(value)

    return tile(block_q, BLOCK_Q, geom.q_len), tile(block_k, BLOCK_K, geom.tail_len)


def _kernel(table_ref, nblk_ref, len_ref, layer_ref, q_ref, kp_ref, vp_ref, kt_ref, vt_ref, o_ref,
            *, geom: WindowGeometry, scale: float, block_k: int):
    """Program ``(row, q head, q block)``.

    Refs: ``q_ref``/``o_ref`` ``[bq, D]``; ``kp_ref``/``vp_ref`` the whole pool as token rows
    (:func:`pallas_kernels.layout.token_rows`, one KV head's slot per row); ``table_ref``
    ``[rows, table_len]`` (null past the visible pages); ``nblk_ref`` ``[rows]`` history key blocks
    to visit; ``len_ref`` ``[rows]``; ``layer_ref`` ``[1]``; ``kt_ref``/``vt_ref``
    ``[rows, tail_pad, Hkv, D]``.
    """
    row, head = pl.program_id(0), pl.program_id(1)
    kv_head = head // geom.group
    q = q_ref[...]
    length, layer = len_ref[row], layer_ref[0]
    lane = lax.iota(jnp.int32, block_k)
    pool = PoolGeometry(geom.num_layers, geom.kv_heads, geom.num_pages, geom.block_size,
                        geom.head_dim)

    def history_block(b, carry):
        slot = b * block_k + lane
        page = table_ref[row, lax.div(slot, geom.block_size)]
        pool_row = token_row(pool, layer, kv_head, page, lax.rem(slot, geom.block_size))
        valid = history_slot_valid(slot, length, geom)
        return online_softmax_step(*carry, q, kp_ref[pool_row, :], vp_ref[pool_row, :],
                                   valid[None, :], valid[:, None], scale)

    def tail_block(b, carry):
        valid = b * block_k + lane < geom.tail_len
        keys = pl.ds(pl.multiple_of(b * block_k, block_k), block_k)
        return online_softmax_step(*carry, q, kt_ref[row, keys, kv_head, :],
                                   vt_ref[row, keys, kv_head, :], valid[None, :], valid[:, None],
                                   scale)

    block_q = q.shape[0]
    carry = (jnp.full((block_q, 1), MASK_VALUE, jnp.float32), jnp.zeros((block_q, 1), jnp.float32),
             jnp.zeros((block_q, geom.head_dim), jnp.float32))
    carry = lax.fori_loop(0, nblk_ref[row], history_block, carry)
    _, denominator, acc = lax.fori_loop(0, kt_ref.shape[1] // block_k, tail_block, carry)
    o_ref[...] = (acc / denominator).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("geom", "scale", "block_q", "block_k", "backend"))
def window_attention(q, k_cur, v_cur, extra_k, extra_v, k_pool, v_pool, pages, lengths, layer,
                     *, geom: WindowGeometry, scale: float, block_q: int, block_k: int,
                     backend: str):
    """Wrapper of the kernel: pads ``q`` to ``block_q``, builds the padded tail and the page table
    (padded with null entries to whole key blocks) and views the pool as token rows of one KV head
    each (:func:`pallas_kernels.layout.token_rows`, a free reshape).

    Arguments as :func:`pallas_kernels.window_attention.window_attention`; ``backend`` one of the
    ``pallas_gpu*`` names (it sets ``interpret``).
    """
    from jax.experimental.pallas import triton as pltriton

    q_pad, tail_pad = round_up(geom.q_len, block_q), round_up(geom.tail_len, block_k)
    q_p = jnp.pad(q, ((0, 0), (0, q_pad - geom.q_len), (0, 0), (0, 0)))
    k_tail, v_tail = tail_kv(k_cur, v_cur, extra_k, extra_v, tail_pad)
    # Pad the table so every visited key block reads whole entries; padding is the null page.
    table_len = cdiv(round_up(geom.max_pages * geom.block_size, block_k), geom.block_size)
    table = layer_page_table(jnp.pad(pages, ((0, 0), (0, table_len - geom.max_pages))), lengths,
                             0, geom)
    slots = visible_page_count(lengths, geom) * geom.block_size
    nblk = cdiv(slots, block_k)
    io_spec = pl.BlockSpec((None, block_q, None, geom.head_dim),
                           lambda row, head, qb: (row, qb, head, 0))
    whole = pl.BlockSpec()
    kernel = functools.partial(_kernel, geom=geom, scale=scale, block_k=block_k)
    num_warps = 4 if block_q * geom.head_dim <= 64 * 128 else 8
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(q_p.shape, q.dtype),
        grid=(geom.rows, geom.num_q_heads, q_pad // block_q),
        in_specs=[whole, whole, whole, whole, io_spec, whole, whole, whole, whole],
        out_specs=io_spec,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=resolve_backend(backend).interpret,
        name="window_attention_gpu",
    )(table, nblk, lengths.astype(jnp.int32), layer.reshape(1), q_p, token_rows(k_pool),
      token_rows(v_pool), k_tail, v_tail)[:, :geom.q_len]
