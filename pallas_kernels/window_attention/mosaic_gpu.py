"""Window attention as a Mosaic GPU kernel (``jax.experimental.pallas.mosaic_gpu``,
``"pallas_mgpu"``) for Hopper (sm_90a) and later, FlashAttention-3 style.

Semantics and shapes are those of :func:`pallas_kernels.window_attention.window_attention`, under two
requirements checked by :func:`~pallas_kernels.window_attention.validation.static_validate_inputs`:
``block_size`` a multiple of the key tile ``block_kv`` (default :func:`default_block_kv`; a tile is
then one TMA box of contiguous pool rows), and bf16 or f16 with ``head_dim`` a multiple of 64 up to
256 and a tiling whose shared memory (:func:`smem_bytes`) fits :data:`SMEM_BYTES`. One producer
warpgroup streams K/V tiles by TMA into a ring of shared-memory slots; two consumer warpgroups run
wgmma and a base-2 online softmax, masking only tiles with invalid keys. Quantized pools (8-bit pages
with per-page scales) land in 8-bit slots that the consumers convert to the compute dtype. Off a GPU
it can be lowered for ``cuda`` and run under jax's GPU interpret mode. Design: ``docs/kernels.md``
(Paged window attention).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.common import LOG2_E, MASK_VALUE, cdiv, round_up
from pallas_kernels.layout import (
    PoolGeometry,
    head_row_stride,
    is_quantized_pool,
    token_row,
    token_rows,
)
from pallas_kernels.window_attention.geometry import WindowGeometry, layer_page_table, tail_kv

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
"""Dtypes the kernel takes."""
SMEM_BYTES = 227 * 1024
"""Dynamic shared memory one Hopper CTA may use."""
BLOCK_Q = 64
"""Query rows per consumer warpgroup (one wgmma M tile); a CTA covers ``2 * BLOCK_Q``."""
STAGES = 2
"""K/V tiles in flight (``stages``), in ``[2, 4]``."""


def default_block_kv(block_size: int) -> int:
    """128 when it divides ``block_size``, else 64 (a page size that neither divides is rejected)."""
    return 128 if block_size % 128 == 0 else 64


def smem_bytes(head_dim: int, itemsize: int, block_q: int, block_kv: int, stages: int,
               stored_itemsize: int = 0) -> int:
    """Shared memory of one CTA: two query/output tiles and ``stages`` K and V tiles in the compute
    dtype (``itemsize`` bytes), and for quantized pools ``stages`` K and V tiles as stored
    (``stored_itemsize`` bytes, 0 for plain pools)."""
    tiles = 2 * stages * block_kv * head_dim
    return itemsize * head_dim * 2 * block_q + (itemsize + stored_itemsize) * tiles


def _pool_geometry(geom: WindowGeometry) -> PoolGeometry:
    return PoolGeometry(geom.num_layers, geom.kv_heads, geom.num_pages, geom.block_size,
                        geom.head_dim)


def _tile_pages(pages, lengths, geom: WindowGeometry, block_kv: int):
    """Per history key tile (``max_pages * block_size // block_kv`` of them, in page-list order):
    int32 ``[rows, tiles]``, the page (of layer 0's numbering; past the visible pages the null
    page) the tile lies in, and int32 ``[tiles]``, its first slot in that page."""
    table = layer_page_table(pages, lengths, 0, geom)
    per_page = geom.block_size // block_kv
    tile = jnp.arange(geom.max_pages * per_page, dtype=jnp.int32)
    return table[:, tile // per_page], (tile % per_page) * block_kv


def history_tiles(pages, lengths, layer, geom: WindowGeometry, block_kv: int):
    """Per row: the pool row where each history key tile starts, and how many tiles to visit.

    Returns ``(starts, counts)``: int32 ``[rows, max_pages * block_size // block_kv]`` rows of the
    pool viewed as token rows (:func:`pallas_kernels.layout.token_rows`) for KV head 0 (KV head
    ``h`` starts :func:`pallas_kernels.layout.head_row_stride` rows further; tiles in page-list
    order; entries past the visible pages start in the layer's null page), and int32 ``[rows]``:
    tiles up to and including
    the one holding the row's last valid history key (0 without history).
    """
    starts = token_row(_pool_geometry(geom), layer, 0, *_tile_pages(pages, lengths, geom, block_kv))
    lengths = lengths.astype(jnp.int32)
    last = jnp.maximum(lengths - 1, 0)
    last_slot = (last // geom.tokens_per_frame) * geom.frame_slots + last % geom.tokens_per_frame
    counts = jnp.where(lengths > 0, last_slot // block_kv + 1, 0)
    return starts, counts


def history_tile_scales(scales, pages, lengths, layer, geom: WindowGeometry, block_kv: int):
    """float32 ``[rows, kv_heads, max_pages * block_size // block_kv]``: the page scale of each
    history key tile of :func:`history_tiles` (``scales`` a quantized pool's ``[layers, kv_heads,
    pages]``; entries past the visible pages read the layer's null page)."""
    tile_pages, _ = _tile_pages(pages, lengths, geom, block_kv)
    return jnp.take(scales[layer], tile_pages, axis=1).transpose(1, 0, 2)


def _to_compute_dtype(tile, dtype):
    """An 8-bit tile (registers) in the compute ``dtype``, exactly: Hopper converts fp8 only to
    f16, which holds every e4m3fn and e5m2 value, so fp8 goes to bf16 through f16."""
    if jnp.issubdtype(tile.dtype, jnp.floating) and dtype != jnp.float16:
        tile = tile.astype(jnp.float16)
    return tile.astype(dtype)


def _valid_keys_in_tile(step, n_hist, length, geom: WindowGeometry, block_kv: int):
    """Scalar int32: how many leading keys of key step ``step`` are valid (a prefix, in
    ``[0, block_kv]``). Steps ``< n_hist`` are history tiles (slot ``step * block_kv`` onward),
    later ones tail tiles."""
    slot = step * block_kv
    frame, offset = lax.div(slot, geom.frame_slots), lax.rem(slot, geom.frame_slots)
    history = jnp.minimum(geom.tokens_per_frame - offset,
                          length - (frame * geom.tokens_per_frame + offset))
    tail = geom.tail_len - (step - n_hist) * block_kv
    return jnp.clip(jnp.where(step < n_hist, history, tail), 0, block_kv)


def _kernel(q_ref, kp_ref, vp_ref, kt_ref, vt_ref, starts_ref, counts_ref, len_ref, *refs,
            geom: WindowGeometry, scale: float, block_q: int, block_kv: int, stages: int,
            tail_tiles: int, quantized: bool):
    """Body of one CTA ``(query tile, kv head, row)``; see ``docs/kernels.md`` (Mosaic GPU).

    Refs (GMEM): ``q_ref``/``o_ref`` ``[rows, kv_heads, q_pad, D]``; ``kp_ref``/``vp_ref`` the
    pools as token rows ``[layers * kv_heads * pages * block_size, D]`` (8-bit for quantized
    pools); ``kt_ref``/``vt_ref`` ``[rows, tail_tiles * block_kv, kv_heads, D]``;
    ``starts_ref``/``counts_ref``/``len_ref`` from :func:`history_tiles` and ``lengths``. ``refs``:
    for ``quantized``, ``ks_ref``/``vs_ref`` from :func:`history_tile_scales`, then ``o_ref`` and
    ``scoped`` (SMEM tiles and barriers).

    A tile one consumer rewrites in shared memory (converted from 8 bits, or with invalid V rows
    zeroed) has one writer: K is consumer 0's, V consumer 1's, and the other consumer waits on the
    writer's ``prepared`` barrier before its wgmma reads the tile.
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    *scale_refs, o_ref, scoped = refs
    (q_smem2, k_smem, v_smem, *stored), ready, (k_free, v_free), prepared = scoped
    k_ready, v_ready, q_ready = ready
    k_prepared, v_prepared = prepared
    row, kv_head = lax.axis_index("row"), lax.axis_index("kv_head")
    wg = lax.axis_index("wg")
    n_hist = counts_ref[row]
    n_steps = n_hist + tail_tiles
    length = len_ref[row]
    dtype = q_ref.dtype
    c = scale * LOG2_E

    def prepare(slot_ref, source, prepared_at, writer, n_valid=None):
        """The ``writer`` consumer stores ``source()`` (rows at or past ``n_valid`` zeroed) into
        ``slot_ref`` and arrives at ``prepared_at``; the other consumer waits there."""

        @pl.when(wg == writer)
        def _write():
            tile = source()
            if n_valid is not None:
                rows = plgpu.broadcasted_iota(jnp.int32, tile.shape, 0, layout=plgpu.Layout.WGMMA)
                tile = jnp.where(rows < n_valid, tile, jnp.zeros((), dtype))
            slot_ref[...] = tile
            plgpu.commit_smem()
            plgpu.barrier_arrive(prepared_at)

        @pl.when(wg != writer)
        def _wait():
            plgpu.barrier_wait(prepared_at)

    @pl.when(wg < 2)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")
        q_smem = q_smem2.at[wg]
        q_base = lax.axis_index("q_tile") * (2 * block_q) + wg * block_q
        plgpu.copy_gmem_to_smem(q_ref.at[row, kv_head, pl.ds(q_base, block_q)], q_smem,
                                q_ready.at[wg])
        plgpu.barrier_wait(q_ready.at[wg])
        m = plgpu.layout_cast(jnp.full((block_q,), MASK_VALUE, jnp.float32),
                              plgpu.Layout.WGMMA.reduce(1))
        l = plgpu.layout_cast(jnp.full((block_q,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        acc = plgpu.layout_cast(jnp.full((block_q, geom.head_dim), 0.0, jnp.float32),
                                plgpu.Layout.WGMMA)

        def step(carry, *, j, n_valid, masked: bool, stored_tile: bool):
            """Key step ``j``, whose first ``n_valid`` keys are valid (all of them unless
            ``masked``); ``stored_tile``: its K/V sit 8-bit in ``stored`` (a quantized pool's
            history tile) and are converted before use."""
            acc, m, l = carry
            slot = lax.rem(j, stages)
            n_valid = n_valid if masked else None
            plgpu.barrier_wait(k_ready.at[slot])
            c_tile = c
            if stored_tile:
                ks_ref, vs_ref = scale_refs
                prepare(k_smem.at[slot], lambda: _to_compute_dtype(stored[0].at[slot][...], dtype),
                        k_prepared.at[slot], writer=0)
                c_tile = c * ks_ref[row, kv_head, j]

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((block_q, block_kv), jnp.float32)) * c_tile
            plgpu.barrier_arrive(k_free.at[slot])
            if masked:
                cols = plgpu.broadcasted_iota(jnp.int32, (block_q, block_kv), 1,
                                              layout=plgpu.Layout.WGMMA)
                s = jnp.where(cols < n_valid, s, MASK_VALUE)
            m_new = jnp.maximum(m, s.max(axis=1))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            l = l * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            plgpu.barrier_wait(v_ready.at[slot])
            if stored_tile:
                prepare(v_smem.at[slot], lambda: _to_compute_dtype(stored[1].at[slot][...], dtype),
                        v_prepared.at[slot], writer=1, n_valid=n_valid)
                p = p * vs_ref[row, kv_head, j]
            elif masked:
                prepare(v_smem.at[slot], lambda: v_smem.at[slot][...], v_prepared.at[slot],
                        writer=1, n_valid=n_valid)

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p.astype(dtype), v_smem.at[slot])

            acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l

        def body(j, carry):
            n_valid = _valid_keys_in_tile(j, n_hist, length, geom, block_kv)
            masked = n_valid < block_kv
            branches = [functools.partial(step, j=j, n_valid=n_valid, masked=bool(b & 1),
                                          stored_tile=b >= 2)
                        for b in range(4 if quantized else 2)]
            index = masked.astype(jnp.int32)
            if quantized:
                index = index + 2 * (j < n_hist).astype(jnp.int32)
            return lax.switch(index, branches, carry)

        acc, m, l = lax.fori_loop(0, n_steps, body, (acc, m, l))
        acc = acc / lax.broadcast_in_dim(l, acc.shape, [0])
        q_smem[...] = acc.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, o_ref.at[row, kv_head, pl.ds(q_base, block_q)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")
        k_history, v_history = stored if quantized else (k_smem, v_smem)

        def issue(j):
            slot = lax.rem(j, stages)

            @pl.when(j < n_hist)
            def _history():
                # Tile starts are multiples of block_kv (block_kv divides block_size); TMA into the
                # tiled shared-memory layout needs the compiler to know it.
                start = starts_ref[row, j] + kv_head * head_row_stride(_pool_geometry(geom))
                rows = pl.ds(pl.multiple_of(start, block_kv), block_kv)
                plgpu.copy_gmem_to_smem(kp_ref.at[rows], k_history.at[slot], k_ready.at[slot])
                plgpu.copy_gmem_to_smem(vp_ref.at[rows], v_history.at[slot], v_ready.at[slot])

            @pl.when(j >= n_hist)
            def _tail():
                rows = pl.ds((j - n_hist) * block_kv, block_kv)
                plgpu.copy_gmem_to_smem(kt_ref.at[row, rows, kv_head], k_smem.at[slot],
                                        k_ready.at[slot])
                plgpu.copy_gmem_to_smem(vt_ref.at[row, rows, kv_head], v_smem.at[slot],
                                        v_ready.at[slot])

        @pl.loop(0, jnp.minimum(n_steps, stages))
        def _prologue(j):
            issue(j)

        @pl.loop(stages, n_steps)
        def _steady(j):
            slot = lax.rem(j, stages)
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])
            issue(j)


def _swizzled(dtype, head_dim: int) -> tuple:
    """Tiling and swizzle of a ``[rows, head_dim]`` shared-memory tile of ``dtype``: 128-byte rows
    of the swizzle pattern (64-byte for 8-bit tiles of a 64-wide head)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    swizzle = min(128, head_dim * jnp.dtype(dtype).itemsize)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
            plgpu.SwizzleTransform(swizzle))


@functools.partial(jax.jit, static_argnames=("geom", "scale", "block_kv", "stages"))
def window_attention(q, k_cur, v_cur, extra_k, extra_v, k_pool, v_pool, pages, lengths, layer,
                     *, geom: WindowGeometry, scale: float, block_kv: int, stages: int = STAGES):
    """Folds GQA into ``q``, pads it to whole CTA tiles, builds the tail tiles and the history tile
    table (and, for quantized pools, each tile's page scales), views the pools as token rows,
    launches the kernel and unfolds the output.

    Arguments as :func:`pallas_kernels.window_attention.window_attention` (``layer`` an int32
    scalar, ``extra_k``/``extra_v`` possibly ``None``, pools plain or
    :class:`~pallas_kernels.layout.QuantizedPool`, the tiling validated): ``block_kv`` keys per tile
    (a multiple of 64 dividing ``block_size``), ``stages`` K/V tiles in flight (2-4).
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    rows, g, hkv, d = geom.rows, geom.group, geom.kv_heads, geom.head_dim
    folded = g * geom.q_len
    block_q = BLOCK_Q
    q_pad = round_up(folded, 2 * block_q)
    qf = q.reshape(rows, geom.q_len, hkv, g, d).transpose(0, 2, 3, 1, 4).reshape(
        rows, hkv, folded, d)
    qf = jnp.pad(qf, ((0, 0), (0, 0), (0, q_pad - folded), (0, 0)))
    tail_tiles = cdiv(geom.tail_len, block_kv)
    k_tail, v_tail = tail_kv(k_cur, v_cur, extra_k, extra_v, tail_tiles * block_kv)
    starts, counts = history_tiles(pages, lengths, layer, geom, block_kv)
    quantized = is_quantized_pool(k_pool)
    if quantized:
        pools = (token_rows(k_pool.values), token_rows(v_pool.values))
        scales = tuple(history_tile_scales(pool.scales, pages, lengths, layer, geom, block_kv)
                       for pool in (k_pool, v_pool))
    else:
        pools, scales = (token_rows(k_pool), token_rows(v_pool)), ()
    transforms = _swizzled(q.dtype, d)

    def entry(*refs):
        tiles = [plgpu.SMEM((2, block_q, d), q.dtype, transforms=transforms),
                 plgpu.SMEM((stages, block_kv, d), q.dtype, transforms=transforms),
                 plgpu.SMEM((stages, block_kv, d), q.dtype, transforms=transforms)]
        if quantized:
            stored = _swizzled(pools[0].dtype, d)
            tiles += [plgpu.SMEM((stages, block_kv, d), pools[0].dtype, transforms=stored)] * 2
        ready = (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
                 plgpu.Barrier(num_barriers=2))
        free = (plgpu.Barrier(num_arrivals=2, num_barriers=stages),) * 2
        prepared = (plgpu.Barrier(num_barriers=stages),) * 2
        pl.run_scoped(
            lambda *scoped: _kernel(*refs, scoped, geom=geom, scale=scale, block_q=block_q,
                                    block_kv=block_kv, stages=stages, tail_tiles=tail_tiles,
                                    quantized=quantized),
            tiles, ready, free, prepared, collective_axes="wg")

    out = plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct(qf.shape, q.dtype),
        grid=(q_pad // (2 * block_q), hkv, rows),
        grid_names=("q_tile", "kv_head", "row"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(qf, *pools, k_tail, v_tail, starts, counts, lengths.astype(jnp.int32), *scales)
    out = out[:, :, :folded].reshape(rows, hkv, g, geom.q_len, d)
    return out.transpose(0, 3, 1, 2, 4).reshape(q.shape)
