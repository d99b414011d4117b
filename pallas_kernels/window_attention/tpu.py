"""Window attention as a Pallas TPU (Mosaic) kernel (``"pallas_tpu"``, ``_interpret``,
``_simulate``).

Grid ``(rows, query blocks, max_pages + tail blocks)``; the page table (with the layer folded in),
the per-row visible page counts and the lengths are scalar-prefetched; each history step brings one
whole page ``[block_size, kv_heads, head_dim]`` of K and of V into VMEM through a ``BlockSpec``
whose ``index_map`` reads the page table (Pallas double-buffers it). Past a row's last visible page
the index map repeats that page, so no further DMA is issued, and the compute is skipped with
``pl.when``; a row without history reads its null page once. The tail steps read the current chunk
+ extras the same way. An online (flash) softmax keeps ``m``, ``l`` and the accumulator for all
query heads of the block in VMEM scratch.

Only whole pages are DMA'd: a per-KV-head block would put a squeezed dimension in the second-minor
position of the pool, which Mosaic's block rules forbid. Wrapper-side layout changes touch only
``q``, the output and the (small) tail, never the pool, apart from merging its two leading axes (a
free reshape). Each grid step handles one page, so a real TPU wants ``block_size >= 128``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.backend import resolve_backend
from pallas_kernels.common import MASK_VALUE, online_softmax_step, round_up
from pallas_kernels.window_attention.geometry import (
    WindowGeometry,
    layer_page_table,
    tail_kv,
    visible_page_count,
)

BLOCK_Q = 128
"""Default query tile (shrunk to the chunk, in multiples of 8)."""
BLOCK_T = 512
"""Default tail tile in tokens (shrunk to the tail, in multiples of 8)."""


def tiles(geom: WindowGeometry, block_q: int | None, block_k: int | None) -> tuple[int, int]:
    """``(block_q, block_t)``: the given tiles (already validated), or the defaults shrunk to the
    query and tail lengths."""
    def tile(value, default, extent):
        return min(default, round_up(extent, 8)) if value is None else int(value)

    return tile(block_q, BLOCK_Q, geom.q_len), tile(block_k, BLOCK_T, geom.tail_len)


def _kernel(table_ref, nvis_ref, len_ref, q_ref, kp_ref, vp_ref, kt_ref, vt_ref, o_ref,
            m_ref, l_ref, acc_ref, *, geom: WindowGeometry, scale: float, block_t: int):
    """Grid step ``(row, q block, key step)``; key steps ``[0, max_pages)`` are history pages, then
    tail blocks of ``block_t`` tokens.

    Refs: ``q_ref``/``o_ref`` ``[Hq, bq, D]``; ``kp_ref``/``vp_ref`` one page
    ``[block_size, Hkv, D]``; ``kt_ref``/``vt_ref`` ``[block_t, Hkv, D]``; scratch
    ``m_ref``/``l_ref`` ``[Hq, bq, 1]`` and ``acc_ref`` ``[Hq, bq, D]`` float32. ``table_ref`` is
    unused here (read by the index maps).
    """
    del table_ref
    row, step = pl.program_id(0), pl.program_id(2)

    @pl.when(step == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def attend(k_ref, v_ref, valid_row, valid_col):
        for kv_head in range(geom.kv_heads):
            k = k_ref[:, kv_head, :]
            v = v_ref[:, kv_head, :]
            for head in range(kv_head * geom.group, (kv_head + 1) * geom.group):
                m_ref[head], l_ref[head], acc_ref[head] = online_softmax_step(
                    m_ref[head], l_ref[head], acc_ref[head], q_ref[head], k, v, valid_row,
                    valid_col, scale)

    def iotas(n):
        return (lax.broadcasted_iota(jnp.int32, (1, n), 1),
                lax.broadcasted_iota(jnp.int32, (n, 1), 0))

    @pl.when(step < nvis_ref[row])
    def _history_page():
        # Pages are frame aligned: page `step` lies wholly in frame step // pages_per_frame.
        frame = lax.div(step, geom.pages_per_frame)
        first = lax.rem(step, geom.pages_per_frame) * geom.block_size
        masks = [(first + i < geom.tokens_per_frame)
                 & (frame * geom.tokens_per_frame + first + i < len_ref[row])
                 for i in iotas(geom.block_size)]
        attend(kp_ref, vp_ref, *masks)

    @pl.when(step >= geom.max_pages)
    def _tail_block():
        first = (step - geom.max_pages) * block_t
        masks = [first + i < geom.tail_len for i in iotas(block_t)]
        attend(kt_ref, vt_ref, *masks)

    @pl.when(step == pl.num_programs(2) - 1)
    def _finish():
        o_ref[...] = (acc_ref[...] / l_ref[...]).astype(o_ref.dtype)


def _page_index(row, qb, step, table_ref, nvis_ref, len_ref, *, max_pages: int):
    """Pool block for key step ``step``: its page, or the last visible page once past it (a repeated
    block index issues no DMA). Rows without history read their null page once."""
    del qb, len_ref
    entry = jnp.maximum(jnp.minimum(step, nvis_ref[row] - 1), 0)
    return table_ref[row * max_pages + entry], 0, 0, 0


def _tail_index(row, qb, step, table_ref, nvis_ref, len_ref, *, max_pages: int):
    del qb, table_ref, nvis_ref, len_ref
    return row, jnp.maximum(step - max_pages, 0), 0, 0


def _query_index(row, qb, step, table_ref, nvis_ref, len_ref):
    del step, table_ref, nvis_ref, len_ref
    return row, 0, qb, 0


@functools.partial(jax.jit, static_argnames=("geom", "scale", "block_q", "block_t", "backend"))
def window_attention(q, k_cur, v_cur, extra_k, extra_v, k_pool, v_pool, pages, lengths, layer,
                     *, geom: WindowGeometry, scale: float, block_q: int, block_t: int,
                     backend: str):
    """Wrapper of the kernel: pads ``q`` to ``block_q`` and transposes it head-major, builds the
    padded tail, folds ``layer`` into the page table and merges the pool's two leading axes.

    Arguments as :func:`pallas_kernels.window_attention.window_attention`; ``backend`` one of the
    ``pallas_tpu*`` names (it sets ``interpret``).
    """
    q_pad, tail_pad = round_up(geom.q_len, block_q), round_up(geom.tail_len, block_t)
    q_t = jnp.pad(q, ((0, 0), (0, q_pad - geom.q_len), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
    k_tail, v_tail = tail_kv(k_cur, v_cur, extra_k, extra_v, tail_pad)
    pool_shape = (geom.num_layers * geom.num_pages, geom.block_size, geom.kv_heads, geom.head_dim)
    table = layer_page_table(pages, lengths, layer, geom).reshape(-1)
    nvis = visible_page_count(lengths, geom)
    num_steps = geom.max_pages + tail_pad // block_t
    q_spec = pl.BlockSpec((None, geom.num_q_heads, block_q, geom.head_dim), _query_index)
    page_spec = pl.BlockSpec((None, geom.block_size, geom.kv_heads, geom.head_dim),
                             functools.partial(_page_index, max_pages=geom.max_pages))
    tail_spec = pl.BlockSpec((None, block_t, geom.kv_heads, geom.head_dim),
                             functools.partial(_tail_index, max_pages=geom.max_pages))
    stats_shape = pltpu.VMEM((geom.num_q_heads, block_q, 1), jnp.float32)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(geom.rows, q_pad // block_q, num_steps),
        in_specs=[q_spec, page_spec, page_spec, tail_spec, tail_spec],
        out_specs=q_spec,
        scratch_shapes=[stats_shape, stats_shape,
                        pltpu.VMEM((geom.num_q_heads, block_q, geom.head_dim), jnp.float32)],
    )
    kernel = functools.partial(_kernel, geom=geom, scale=scale, block_t=block_t)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(q_t.shape, q.dtype),
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=resolve_backend(backend).interpret,
        name="window_attention_tpu",
    )(table, nvis, lengths.astype(jnp.int32), q_t, k_pool.reshape(pool_shape),
      v_pool.reshape(pool_shape), k_tail, v_tail)
    return out.transpose(0, 2, 1, 3)[:, :geom.q_len]
