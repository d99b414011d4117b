"""The paged chunk write into quantized pools as a Pallas TPU (Mosaic) kernel: the chunk quantized
inside the kernel, in place on the pools' values and scales.

Semantics and shapes are those of :func:`pallas_kernels.paged_write.write_chunk` for
:class:`~pallas_kernels.layout.QuantizedPool` s (values ``[L, H, P, S, D]`` in an 8-bit dtype,
float32 scales ``[L, H, P]``) and a chunk in a compute dtype; the rule is that of
:mod:`pallas_kernels.quantization` (``scale_of``, ``inverse_of``, ``to_stored``), bit for bit the
XLA path's. The kernel is grid-less, the page ids scalar-prefetched, and the four outputs alias the
donated values and scales. Its jobs are one layer's page of K or V (page by page, layer by layer,
K then V):

* the job's page is DMA'd from the chunk in HBM into VMEM (the next job's DMA in flight while one
  is quantized), taken in the layout XLA gives the chunk
  (:func:`pallas_kernels.paged_write.tpu.chunk_view`): ``"head"`` head-major ``[H, S, D]``,
  ``"token"`` the page's token rows ``[S * H, D]`` (a head's rows read with sublane-strided loads;
  a 16-bit pair of heads shares a 32-bit row and is split with shifts, bf16 to float32 exactly);
* each head's page is read twice in slabs of :data:`SLAB_ROWS` rows: its absmax, then its values
  times the inverse scale (one division per head), converted into an 8-bit VMEM page
  ``[H, S, D]`` that one DMA writes into the pool; rows past a frame's last token are read as
  zeros (they do not move the scale);
* the scales of a page (all layers and heads, the 128 pages around it: a DMA moves whole 512-byte
  words, :func:`scale_order` for their layout; all the scales for a page past the last whole
  128 pages) are read at the page's first job, updated in VMEM and written back after its last.

A skipped page (id 0) moves nothing. Design and compiled figures: ``docs/kernels.md`` (Quantized
pages).
"""

from __future__ import annotations

import functools
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.layout import KV_HEAD_AXIS, LAYER_AXIS, PAGE_AXIS, QuantizedPool, pool_geometry
from pallas_kernels.paged_write.tpu import (
    TOKEN_ROWS,
    chunk_view,
    hbm_order,
    head_major,
    interpreter_bitcasts_refs,
    paged_write_call,
)
from pallas_kernels.quantization import SCALE_DTYPE, inverse_of, scale_of, to_stored

SLAB_ROWS = 256
"""Rows of one head's page read at once (a multiple of 32, the 8-bit VMEM tile's rows)."""
SCALE_LANES = 128
"""Scales moved per (layer, head) around a page: one 512-byte DMA word of float32."""
VMEM_BUDGET = 100 << 20
"""Most VMEM the kernel's buffers may take (v5e and v6e have 128 MiB)."""


def scale_order(shape: tuple[int, int, int], device=None) -> tuple[int, int, int]:
    """The order of the axes of scales ``[L, H, P]`` in which the kernel takes them: XLA:TPU's
    default HBM layout's, major to minor (:func:`~pallas_kernels.paged_write.tpu.hbm_order`, so
    the transpose is free: at 12 heads XLA lays them out ``[H, L, P]``) where the page axis is
    minor or the scales have at most :data:`SCALE_LANES` pages (the kernel then moves them whole);
    otherwise, and off TPU, ``(0, 1, 2)``."""
    order = hbm_order(shape, SCALE_DTYPE, device)
    if order is None or (order[-1] != PAGE_AXIS and shape[PAGE_AXIS] > SCALE_LANES):
        return (LAYER_AXIS, KV_HEAD_AXIS, PAGE_AXIS)
    return order


def _windows(scales_shape: tuple[int, ...], order: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The VMEM scale windows of scales ``[L, H, P]`` taken in ``order``: all their axes with the
    page axis cut to :data:`SCALE_LANES`; and, where more pages than that are not a multiple of it,
    the whole scales too (a DMA cannot move the last, narrower window: it moves 512-byte words, or
    whole rows)."""
    num_pages = scales_shape[PAGE_AXIS]
    window = tuple(min(SCALE_LANES, num_pages) if a == PAGE_AXIS else scales_shape[a] for a in order)
    whole = tuple(scales_shape[a] for a in order)
    return [window] + ([whole] if num_pages > SCALE_LANES and num_pages % SCALE_LANES else [])


def _tile_rows(rows: int) -> int:
    """``rows`` rounded up to the 8-bit VMEM tile's 32 rows (so that Mosaic tiles an 8-bit page
    densely: a row count it does not divide gets 8-row tiles, a quarter of each store used)."""
    return -(-rows // 32) * 32


def vmem_bytes(heads: int, block_size: int, head_dim: int, chunk_itemsize: int,
               windows: list[tuple[int, ...]]) -> int:
    """VMEM of the kernel's buffers: two chunk pages of one layer (K and V), two 8-bit pages and
    two of each float32 scale window (:func:`_windows`), rounded up to whole tiles."""
    rows = _tile_rows(block_size)
    return (2 * heads * rows * head_dim * (chunk_itemsize + 1)
            + sum(2 * lead * -(-sub // 8) * 8 * -(-lanes // 128) * 128 * 4 for lead, sub, lanes in windows))


def _kernel(ids_ref, k_src, v_src, *refs, view: str, ppf: int, tokens_per_frame: int,
            order: tuple[int, int, int], strided: bool):
    """Refs: ``ids_ref`` SMEM int32 ``[N]`` (0 = skip); in HBM the chunk per pool (``"head"``:
    ``[L, H, R * F, T, D]``, ``"token"``: ``[L, R * F, T * H, D]``), the four pool inputs (aliased,
    unused) and outputs (K values, K scales, V values, V scales; the scales' axes in ``order``);
    scratch ``inbuf`` (``[2, H, S, D]`` or ``[2, S * H, D]``, slot 0 K, 1 V), ``outbuf`` ``[2, H,
    S, D]`` 8-bit, ``sbuf`` ``[2, *window]`` float32 (:func:`_windows`), DMA semaphores
    ``in_sems``/``out_sems``/``scale_sems`` ``[2]``, SMEM ``pending`` ``[2]`` (an out DMA of that
    slot not yet waited for), and ``whole`` ``[2, *scales]`` float32 where :func:`_windows` has it
    (pages past the last whole window read and write all the scales).

    Job ``j`` is page ``j // (2 L)`` of the chunk at layer ``(j // 2) % L``, K (``j`` even) or V.
    A written job waits for its page, starts the next job's (a skipped job starts the next one's),
    reads the page's scale window at layer 0, waits for its slot's previous out DMA, quantizes and
    starts its out DMA, and writes the scale window back at the last layer.
    """
    k_vals, k_scales, v_vals, v_scales = refs[4:8]
    inbuf, outbuf, sbuf, in_sems, out_sems, scale_sems, pending, *whole = refs[8:]
    num_layers, heads, num_pages, block_size, dim = k_vals.shape
    dtype = k_vals.dtype
    srcs, pools, scales = (k_src, v_src), (k_vals, v_vals), (k_scales, v_scales)
    jobs = 2 * ids_ref.shape[0] * num_layers
    last_valid = tokens_per_frame - (ppf - 1) * block_size
    lanes = sbuf.shape[1 + order.index(PAGE_AXIS)]
    tail_start = num_pages - num_pages % lanes  # Pages past the last whole 128-page window.
    pending[0], pending[1] = 0, 0

    def where(j):
        u = lax.div(j, 2)
        i = lax.div(u, num_layers)
        return i, lax.rem(u, num_layers), lax.rem(j, 2), ids_ref[i]

    def for_kv(kv, fn):
        """``fn(c)`` for the static ``c`` equal to ``kv``."""
        for c in range(2):
            pl.when(kv == c)(functools.partial(fn, c))

    def kinds(i):
        """``(is this page's kind, valid tokens of its pages)`` for each kind a page may have."""
        if ppf == 1 or last_valid == block_size:  # Every page alike.
            return [(True, last_valid)]
        is_last = lax.rem(i, ppf) == ppf - 1
        return [(is_last, last_valid), (jnp.logical_not(is_last), block_size)]

    def in_copy(i, layer, kv: int, n: int):
        frame, start = lax.div(i, ppf), lax.rem(i, ppf) * block_size
        if view == "head":
            src = srcs[kv].at[layer, :, frame, pl.ds(start, n)]
            dst = inbuf.at[kv, :, pl.ds(0, n)]
        else:
            src = srcs[kv].at[layer, frame, pl.ds(start * heads, n * heads)]
            dst = inbuf.at[kv, pl.ds(0, n * heads)]
        return pltpu.make_async_copy(src, dst, in_sems.at[kv])

    def on_in(j, action: str):
        i, layer, kv, page = where(j)
        for is_kind, valid in kinds(i):
            @pl.when(is_kind & (page != 0))
            def _(valid=valid):
                for_kv(kv, lambda c: getattr(in_copy(i, layer, c, valid), action)())

    def start_in(j):
        """Starts job ``j``'s page DMA if ``j`` exists and its page is written."""
        pl.when(j < jobs)(lambda: on_in(jnp.minimum(j, jobs - 1), "start"))

    def out_copy(page, layer, kv: int):
        return pltpu.make_async_copy(outbuf.at[kv, :, pl.ds(0, block_size)], pools[kv].at[layer, :, page],
                                     out_sems.at[kv])

    def scale_window(page, kv: int, action: str):
        """Starts and waits for the DMA of ``page``'s scale window (``"in"`` or ``"out"``)."""
        def move(hbm, vmem):
            copy = pltpu.make_async_copy(*((hbm, vmem) if action == "in" else (vmem, hbm)),
                                         scale_sems.at[kv])
            copy.start()
            copy.wait()

        if lanes == num_pages:  # One window: all the scales.
            move(scales[kv], sbuf.at[kv])
            return
        cut = tuple(pl.ds(pl.multiple_of(lax.div(page, lanes) * lanes, lanes), lanes) if a == PAGE_AXIS
                    else slice(None) for a in order)
        if tail_start == num_pages:  # Every page in a whole window.
            move(scales[kv].at[cut], sbuf.at[kv])
            return
        pl.when(page < tail_start)(lambda: move(scales[kv].at[cut], sbuf.at[kv]))
        pl.when(page >= tail_start)(lambda: move(scales[kv], whole[0].at[kv]))

    def put_scale(kv, layer, head, page, scale):
        """Sets the scale of ``(layer, head)`` at ``page`` in its window to ``scale`` ``[1, 1]``: a
        select on the 2-D tile of the window's leading index."""
        def put(window, at):
            value = {LAYER_AXIS: layer, KV_HEAD_AXIS: head, PAGE_AXIS: at}
            lead, row, col = (value[a] for a in order)
            tile = window[kv, lead]
            rows = lax.broadcasted_iota(jnp.int32, tile.shape, 0)
            cols = lax.broadcasted_iota(jnp.int32, tile.shape, 1)
            window[kv, lead] = jnp.where((rows == row) & (cols == col), scale, tile)

        if tail_start == num_pages:
            put(sbuf, page - lax.div(page, lanes) * lanes)
            return
        pl.when(page < tail_start)(lambda: put(sbuf, page - lax.div(page, lanes) * lanes))
        pl.when(page >= tail_start)(lambda: put(whole[0], page))

    def quantize_page(i, layer, kv, page):
        valid = last_valid if len(kinds(i)) == 1 else jnp.where(kinds(i)[0][0], last_valid, block_size)
        load, per = _head_loader(inbuf, kv, view, heads, strided)

        def group(g):
            """Heads ``g * per`` to ``g * per + per - 1``: absmax, scale, stored page rows."""
            def rows(start, n: int):
                xs = load(g, start, n)
                if last_valid == block_size:
                    return xs
                keep = lax.broadcasted_iota(jnp.int32, (n, dim), 0) + start < valid
                return [jnp.where(keep, x, 0.0) for x in xs]

            group_scales = [scale_of(amax, dtype) for amax in _absmax(rows, block_size, per, dim)]
            inverses = [inverse_of(scale) for scale in group_scales]

            def store(start, n: int):
                for t, (x, inverse) in enumerate(zip(rows(start, n), inverses)):
                    outbuf[kv, g * per + t, pl.ds(start, n)] = to_stored(x, inverse, dtype)

            _for_slabs(block_size, store)
            for t, scale in enumerate(group_scales):
                put_scale(kv, layer, g * per + t, page, scale)

        if view == "token" and strided:  # A strided load's first row must be static.
            for g in range(heads // per):
                group(g)
        else:
            pl.loop(0, heads // per)(group)

    start_in(0)

    @pl.loop(0, jobs)
    def _(j):
        i, layer, kv, page = where(j)

        @pl.when(page != 0)
        def _():
            on_in(j, "wait")
            start_in(j + 1)
            pl.when(layer == 0)(lambda: for_kv(kv, lambda c: scale_window(page, c, "in")))
            pl.when(pending[kv] != 0)(lambda: for_kv(kv, lambda c: out_copy(page, layer, c).wait()))
            quantize_page(i, layer, kv, page)
            for_kv(kv, lambda c: out_copy(page, layer, c).start())
            pending[kv] = 1
            pl.when(layer == num_layers - 1)(
                lambda: for_kv(kv, lambda c: scale_window(page, c, "out")))

        pl.when(page == 0)(lambda: start_in(j + 1))

    for kv in range(2):
        pl.when(pending[kv] != 0)(lambda kv=kv: out_copy(0, 0, kv).wait())


def _head_loader(inbuf, kv, view: str, heads: int, strided: bool):
    """``(load, per)``: ``load(g, start, n)`` is the float32 rows ``[start, start + n)`` ``[n, D]``
    of each of the ``per`` heads ``g * per + t`` of job slot ``kv``'s page in ``inbuf``."""
    if view == "head":
        return (lambda g, start, n: [inbuf[kv, g, pl.ds(start, n)].astype(jnp.float32)]), 1
    if not strided:  # Interpreted without ref bitcasts: the token rows as a value.
        def load_rows(g, start, n):
            x = inbuf[kv, pl.ds(start * heads, n * heads)].reshape(n, heads, -1)
            return [lax.dynamic_index_in_dim(x, g, 1, keepdims=False).astype(jnp.float32)]
        return load_rows, 1
    if jnp.dtype(inbuf.dtype).itemsize == 4:
        return (lambda g, start, n: [inbuf.at[kv, pl.ds(start * heads, n * heads)][pl.ds(g, n, stride=heads)]]), 1
    words, half = inbuf.bitcast(jnp.uint32), heads // 2  # [2, S * H / 2, D]: heads 2k, 2k+1 a row

    def load_pair(g, start, n):  # The slab's words first (an aligned slice), then the pair's rows.
        w = words.at[kv, pl.ds(start * half, n * half)][pl.ds(g, n, stride=half)]
        return [lax.bitcast_convert_type(w << 16, jnp.float32),
                lax.bitcast_convert_type(w & jnp.uint32(0xFFFF0000), jnp.float32)]
    return load_pair, 2


def _for_slabs(rows: int, body) -> None:
    """``body(start, n)`` over ``[0, rows)`` in slabs of :data:`SLAB_ROWS` rows (a loop), then
    the remainder (static)."""
    full, tail = divmod(rows, SLAB_ROWS)
    if full:
        @pl.loop(0, full)
        def _(s):
            body(pl.multiple_of(s * SLAB_ROWS, SLAB_ROWS), SLAB_ROWS)
    if tail:
        body(full * SLAB_ROWS, tail)


def _absmax(rows, block_size: int, per: int, dim: int) -> list:
    """``max|x|`` ``[1, 1]`` of each of ``per`` heads' ``block_size`` rows (``rows(start, n)``): the
    slabs folded into one ``[8, D]`` running maximum per head (elementwise, one vreg), then the
    remainder and one cross-lane reduction."""
    full, tail = divmod(block_size, SLAB_ROWS)
    amax = [jnp.zeros((1, 1), jnp.float32) for _ in range(per)]
    if full:
        def body(s, acc):
            xs = rows(pl.multiple_of(s * SLAB_ROWS, SLAB_ROWS), SLAB_ROWS)
            return [jnp.maximum(a, jnp.max(jnp.abs(x).reshape(-1, 8, dim), axis=0)) for a, x in zip(acc, xs)]
        acc = lax.fori_loop(0, full, body, [jnp.zeros((8, dim), jnp.float32) for _ in range(per)])
        amax = [jnp.max(a, axis=(0, 1), keepdims=True) for a in acc]
    if tail:
        xs = rows(full * SLAB_ROWS, tail)
        amax = [jnp.maximum(m, jnp.max(jnp.abs(x), axis=(0, 1), keepdims=True)) for m, x in zip(amax, xs)]
    return amax


def write_chunk(k_pool: QuantizedPool, v_pool: QuantizedPool, k_frames, v_frames, ids, ppf: int,
                interpret: Any, view: str | None = None, order: tuple[int, int, int] | None = None):
    """``(k_pool, v_pool)`` with page ``i`` of the chunk quantized and written at page ``ids[i]``
    (0 skips), values and scales in place.

    ``k_frames``/``v_frames`` are the unpadded chunk ``[L, R * F, T, H, D]`` in a compute dtype;
    ``ids`` flat int32 ``[R * F * ppf]`` with skipped entries already 0; ``interpret`` as for
    ``pl.pallas_call``; ``view`` ``"head"`` or ``"token"`` (default :func:`chunk_view`; ``"token"``
    needs ``H`` and the block size multiples of :data:`TOKEN_ROWS`); ``order`` the order of the
    scales' axes the kernel takes (default :func:`scale_order`; the page axis last unless the pools
    have at most :data:`SCALE_LANES` pages). The outputs alias the pools' values and scales.

    Raises:
      ValueError: an unknown ``view``, ``"token"`` at a shape it does not take, an ``order`` that
        is not a permutation the kernel takes, or a page of one layer too large for VMEM
        (:data:`VMEM_BUDGET`).
    """
    geom = pool_geometry(k_pool)
    num_layers, frames, tokens, heads, dim = k_frames.shape
    view = chunk_view(k_frames.shape, k_frames.dtype, geom.block_size) if view is None else view
    if view not in ("head", "token"):
        raise ValueError(f"view must be 'head' or 'token', got {view!r}")
    if view == "token" and (heads % TOKEN_ROWS or geom.block_size % TOKEN_ROWS):
        raise ValueError(f"the token view needs kv_heads and block_size multiples of {TOKEN_ROWS}, "
                         f"got {heads} and {geom.block_size}")
    order = scale_order(k_pool.scales.shape) if order is None else tuple(order)
    if sorted(order) != [0, 1, 2] or (order[-1] != PAGE_AXIS and geom.num_pages > SCALE_LANES):
        raise ValueError(f"order must be a permutation of (0, 1, 2) with the page axis ({PAGE_AXIS}) "
                         f"last when there are more than {SCALE_LANES} pages, got {order} for "
                         f"{geom.num_pages} pages")
    windows = _windows(k_pool.scales.shape, order)
    vmem = vmem_bytes(heads, geom.block_size, dim, k_frames.dtype.itemsize, windows)
    if vmem > VMEM_BUDGET:
        raise ValueError(f"a quantized pool's page of one layer (kv_heads={heads}, block_size="
                         f"{geom.block_size}, head_dim={dim}) needs {vmem} bytes of VMEM, more than "
                         f"the {VMEM_BUDGET} the TPU write takes")
    if view == "head":
        chunks = [head_major(k_frames), head_major(v_frames)]
        page_in = (heads, geom.block_size, dim)
    else:
        chunks = [x.reshape(num_layers, frames, tokens * heads, dim) for x in (k_frames, v_frames)]
        page_in = (geom.block_size * heads, dim)
    strided = not interpret or (interpret is True and interpreter_bitcasts_refs())
    scratch = [pltpu.VMEM((2, *page_in), k_frames.dtype),
               pltpu.VMEM((2, heads, _tile_rows(geom.block_size), dim), k_pool.dtype),
               pltpu.VMEM((2, *windows[0]), SCALE_DTYPE),
               pltpu.SemaphoreType.DMA((2,)), pltpu.SemaphoreType.DMA((2,)),
               pltpu.SemaphoreType.DMA((2,)), pltpu.SMEM((2,), jnp.int32),
               *[pltpu.VMEM((2, *whole), SCALE_DTYPE) for whole in windows[1:]]]
    kernel = functools.partial(_kernel, view=view, ppf=ppf, tokens_per_frame=tokens, order=order,
                               strided=strided)
    operands = [*chunks, k_pool.values, k_pool.scales.transpose(order), v_pool.values,
                v_pool.scales.transpose(order)]
    k_vals, k_scales, v_vals, v_scales = paged_write_call(kernel, ids, operands, scratch, interpret,
                                                          vmem_limit=vmem + (16 << 20), outputs=4)
    back = tuple(order.index(a) for a in range(3))
    return (QuantizedPool(k_vals, k_scales.transpose(back)),
            QuantizedPool(v_vals, v_scales.transpose(back)))
