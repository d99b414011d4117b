"""Causal 3x3x3 convolution on TPU (``"pallas_tpu*"``): one Mosaic kernel per call that reads the
stream cache and the input from HBM, convolves, and writes the new cache over the old one in place.

Grid ``(row block i, output frame t)``, sequential. A step holds, in a double-buffered VMEM scratch,
the three frames ``[cache, x][t : t + 3]`` of the block's ``block_h`` rows and their halo rows (one
above, one below), copied by DMA from ``cache`` or ``x`` (time concatenation inside the kernel; the
next step's copies are started before this step's compute). Per output row the nine ``(dt, dh)`` row
slabs ``[W, Cin]`` are concatenated on lanes into ``[W, 9 Cin]`` and multiplied by the packed weights
``[9 Cin, 3 CoP]`` (:func:`pack_weights`: the three ``dw`` taps side by side in the output columns,
each padded to ``CoP``, a multiple of 128 lanes); the taps are summed after two sublane rolls (the W
shift) with the image edge masked (zero "same" padding, as are the rows above and below the image).
A narrow output (at most 8 channels, :func:`is_narrow`: the decoder's ``conv_out`` to RGB) takes each
row's product transposed, the packed weights ``[3 x 8, 9 Cin]`` times the slab's transpose, so the
taps' channels land on sublanes and ``W`` on the lanes (the taps aligned by lane rolls), and writes
each row as ``[Cout, W]``: the output ``[T, H, Cout, W]`` keeps ``W`` on the lanes (the wrapper
swaps it back to ``[T, H, W, Cout]``).

The new cache (``[cache, x][T : T + 2]``, frames ``dt = 1, 2`` of the last step) is written into the
cache buffer itself (``input_output_aliases``), so a decode loop carrying the cache keeps one copy
of it; a batch's cache ``[B, 2, H, W, Cin]`` is read and written at the stream a scalar-prefetched
index names, the other streams' entries untouched (no slice of it is copied out or back). The write
must not overwrite a row a later step still reads: block ``i`` writes, at its last frame, rows
``[i * block_h - 1, (i + 1) * block_h - 1)`` (its top halo row, which no later block reads, and all its
rows but the last, which block ``i + 1`` reads as its top halo); the last block writes through the
image's last row. Blocks run in order, so every row is written after its last read. The kernel reads
the cache through the aliased output, so the interpreters see any write that came too early. Design
and figures: ``docs/kernels.md`` (Causal convolution).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.causal_conv.geometry import ConvGeometry, kernel_name
from pallas_kernels.causal_conv.xla import NARROW_OUTPUT, norm_scale, scaled_norm_silu
from pallas_kernels.common import cdiv, matmul_precision, round_up

LANES = 128
"""Each ``dw`` tap's output columns are padded to a multiple of this (TPU lanes)."""
DEFAULT_BLOCK_H = 8
"""Output rows per grid step unless the call says otherwise."""
NORM_UNROLL = 2
"""Buffer rows normalized per iteration of the input norm's loop (two overlap one row's reduction
latency with the other's work)."""
MIN_VMEM_LIMIT = 32 << 20
"""Least scoped-VMEM limit a call asks for (v6e's default)."""
MAX_VMEM_LIMIT = 100 << 20
"""Most scoped-VMEM limit a call asks for: a call asks for twice its estimate (:func:`vmem_bytes`)
within ``[MIN_VMEM_LIMIT, MAX_VMEM_LIMIT]`` (both chips have about 128 MiB of VMEM)."""


def is_narrow(cout: int) -> bool:
    """Whether a convolution to ``cout`` channels writes its output transposed, ``[T, H, Cout, W]``
    (at most :data:`~pallas_kernels.causal_conv.xla.NARROW_OUTPUT` channels: row-major ``[.., W,
    Cout]`` would pad each pixel's few channels to 128 lanes in VMEM and in HBM)."""
    return cout <= NARROW_OUTPUT


NARROW_TAP_ROWS = 8
"""A narrow output's rows per ``dw`` tap in its transposed weights (one float32 sublane tile)."""


def packed_columns(cout: int) -> int:
    """Output columns of :func:`pack_weights`' matrix for ``cout`` output channels: ``3 CoP`` (each
    ``dw`` tap's ``Cout`` padded to ``CoP = round_up(Cout, 128)``), or for a narrow output
    (:func:`is_narrow`, whose matrix is transposed) its rows, each tap's ``Cout`` padded to
    :data:`NARROW_TAP_ROWS`."""
    return 3 * NARROW_TAP_ROWS if is_narrow(cout) else 3 * round_up(cout, LANES)


def pack_weights(kernel, dtype):
    """``[3, 3, 3, Cin, Cout]`` -> ``[9 Cin, packed_columns(Cout)]`` in ``dtype``: rows ``(dt, dh,
    cin)``, columns ``(dw, cout)``, each ``dw`` tap's ``Cout`` columns padded with zeros to ``CoP =
    round_up(Cout, 128)``; for a narrow output the transpose, ``[packed_columns(Cout), 9 Cin]``,
    each tap's ``Cout`` rows padded to :data:`NARROW_TAP_ROWS`."""
    kt, kh, kw, cin, cout = kernel.shape
    packed = jnp.transpose(kernel.astype(dtype), (0, 1, 3, 2, 4))  # dt, dh, cin, dw, cout
    if is_narrow(cout):
        packed = jnp.pad(packed, ((0, 0),) * 4 + ((0, NARROW_TAP_ROWS - cout),))
        return packed.reshape(kt * kh * cin, packed_columns(cout)).T
    packed = jnp.pad(packed, ((0, 0),) * 4 + ((0, round_up(cout, LANES) - cout),))
    return packed.reshape(kt * kh * cin, packed_columns(cout))


@dataclasses.dataclass(frozen=True)
class _Blocks:
    """Row blocks ``lo..hi`` (inclusive) that copy the same rows: a block's reads start at image row
    ``i * block_h + offset`` (``offset`` -1, or 0 for the image's first block, which has no row
    above it) and land at buffer row ``offset + 1``; ``read_rows`` rows are read per frame and
    ``write_rows`` written back to the cache from the same place."""

    lo: int
    hi: int
    offset: int
    read_rows: int
    write_rows: int


def row_blocks(height: int, block_h: int) -> tuple[_Blocks, ...]:
    """The kinds of row block of an image of ``height`` rows in blocks of ``block_h`` (at most
    ``height``): the only block, or the first, the middle ones and the last (see the module
    docstring for the write rule)."""
    nb = cdiv(height, block_h)
    if nb == 1:
        return (_Blocks(0, 0, 0, height, height),)
    last_rows = height - (nb - 1) * block_h
    kinds = [_Blocks(0, 0, 0, block_h + 1, block_h - 1)]
    if nb > 2:
        kinds.append(_Blocks(1, nb - 2, -1, block_h + 2, block_h))
    kinds.append(_Blocks(nb - 1, nb - 1, -1, last_rows + 1, last_rows + 1))
    return tuple(kinds)


def vmem_bytes(geom: ConvGeometry, block_h: int, itemsize: int) -> int:
    """VMEM one call needs: the frame buffers (and the normalized ring), the double-buffered
    weights and output (and residual) blocks, and one row's operands and float32 products."""
    w, cin, cout = geom.width, geom.in_channels, geom.out_channels
    columns = packed_columns(cout)
    frames = (2 + geom.input_norm) * 3 * (block_h + 2) * w * cin * itemsize
    weights = 2 * 9 * cin * columns * itemsize
    out = (2 + 2 * geom.residual) * block_h * w * cout * itemsize
    row = w * 9 * cin * itemsize + 3 * w * columns * 4
    return frames + weights + out + row


def _kernel(*refs, geom: ConvGeometry, block_h: int, tanh_silu: bool):
    """Refs: SMEM ``stream_ref`` ``[1]`` (the stream of the cache batch), ``x_hbm`` ``[T, H, W,
    Cin]`` and ``batch_cache`` ``[B, 2, H, W, Cin]`` (HBM; the aliased output, read and written in
    place at ``stream_ref[0]``, ``_cache_in`` its unused input view), ``w_ref`` ``[9 Cin,
    packed_columns(Cout)]`` (a narrow output's transposed), ``b_ref`` ``[1, Cout]`` float32 (a
    narrow output's ``[NARROW_TAP_ROWS, 1]``), with an input norm ``g_ref`` ``[1, Cin]`` (its
    :func:`~pallas_kernels.causal_conv.xla.norm_scale`) and ``ring`` ``[3, block_h + 2, W, Cin]``,
    with a residual ``r_ref`` ``[block_h, W, Cout]`` (``y_ref``'s block of it), ``y_ref``
    ``[block_h, W, Cout]``, or ``[block_h, Cout, W]`` for a narrow output (:func:`is_narrow`; the
    residual likewise; the last block's rows past the image are dropped), ``buf`` ``[2, 3,
    block_h + 2, W, Cin]``."""
    refs = list(refs)
    stream_ref, x_hbm, w_ref, b_ref = refs[:4]
    g_ref = refs.pop(4) if geom.input_norm else None
    r_ref = refs.pop(4) if geom.residual else None
    ring = refs.pop(8) if geom.input_norm else None
    _cache_in, y_ref, batch_cache, buf, read_sem, write_sem = refs[4:]
    cache = batch_cache.at[stream_ref[0]]
    frames, height, width = geom.frames, geom.height, geom.width
    cout = geom.out_channels
    cop = round_up(cout, LANES)
    kinds = row_blocks(height, block_h)
    num_blocks = cdiv(height, block_h)
    i, t = pl.program_id(0), pl.program_id(1)
    step = i * frames + t
    slot = step % 2

    def each_kind(block, run):
        """``run(kind)`` under the condition that ``block`` is of that kind."""
        for kind in kinds:
            pl.when(jnp.logical_and(block >= kind.lo, block <= kind.hi))(functools.partial(run, kind))

    def reads(block, frame, into, action):
        def run(kind):
            start = block * block_h + kind.offset
            dst_rows = pl.ds(kind.offset + 1, kind.read_rows)
            for dt in range(3):
                s = frame + dt  # frame of [cache, x]
                for from_cache in (True, False):
                    src = (cache.at[jnp.minimum(s, 1)] if from_cache
                           else x_hbm.at[jnp.maximum(s - 2, 0)])
                    copy = pltpu.make_async_copy(src.at[pl.ds(start, kind.read_rows)],
                                                 buf.at[into, dt, dst_rows], read_sem.at[into, dt])
                    pl.when((s < 2) == from_cache)(getattr(copy, action))
        each_kind(block, run)

    def writes(block, source, action):
        def run(kind):
            if kind.write_rows == 0:
                return
            start = block * block_h + kind.offset
            for j in range(2):
                copy = pltpu.make_async_copy(buf.at[source, 1 + j, pl.ds(kind.offset + 1, kind.write_rows)],
                                             cache.at[j, pl.ds(start, kind.write_rows)], write_sem.at[j])
                getattr(copy, action)()
        each_kind(block, run)

    pl.when(step == 0)(lambda: reads(i, t, slot, "start"))
    # The previous step wrote the cache from the other slot: finish before refilling it.
    pl.when(jnp.logical_and(step > 0, t == 0))(lambda: writes(i - 1, 1 - slot, "wait"))

    @pl.when(step + 1 < num_blocks * frames)
    def _():
        last = t + 1 == frames
        reads(jnp.where(last, i + 1, i), jnp.where(last, 0, t + 1), 1 - slot, "start")

    reads(i, t, slot, "wait")

    if geom.input_norm:
        def normalize(dt):  # frame t + dt of [cache, x], every buffer row (masked when read)
            src, dst = buf.at[slot, dt], ring.at[(t + dt) % 3]

            def body(r, carry):
                dst[r] = scaled_norm_silu(src[r], g_ref[...], tanh_form=tanh_silu)
                return carry

            lax.fori_loop(0, block_h + 2, body, 0, unroll=NORM_UNROLL)

        @pl.when(t == 0)
        def _():
            normalize(0)
            normalize(1)

        normalize(2)
        frames_in = [ring.at[(t + dt) % 3] for dt in range(3)]
    else:
        frames_in = [buf.at[slot, dt] for dt in range(3)]

    precision = matmul_precision(x_hbm.dtype)
    narrow = is_narrow(cout)
    bias = b_ref[...]
    columns = (lax.broadcasted_iota(jnp.int32, (NARROW_TAP_ROWS, width), 1) if narrow
               else lax.broadcasted_iota(jnp.int32, (width, cout), 0))
    first_row = i * block_h

    def taps_summed(products):
        """``[W, Cout]`` (a narrow output: ``[NARROW_TAP_ROWS, W]``, ``Cout`` valid rows) of the three
        ``dw`` taps' products, shifted by a roll each (the W shift) with the image edge masked."""
        if narrow:  # tap dw's channels are rows [dw, dw + 1) * NARROW_TAP_ROWS; W is on the lanes
            n = NARROW_TAP_ROWS
            left = pltpu.roll(products[0:n], 1, 1)
            center = products[n:2 * n]
            right = pltpu.roll(products[2 * n:3 * n], width - 1, 1)
        else:
            left = pltpu.roll(products[:, 0:cout], 1, 0)  # left[w] = tap dw=0 of column w - 1
            center = products[:, cop:cop + cout]
            right = pltpu.roll(products[:, 2 * cop:2 * cop + cout], width - 1, 0)  # tap dw=2 of w + 1
        return center + jnp.where(columns > 0, left, 0.0) + jnp.where(columns < width - 1, right, 0.0)

    def row(j, carry):
        h = first_row + j
        pieces = []
        for dt in range(3):
            for dh in range(3):
                piece = frames_in[dt][j + dh]  # image row h + dh - 1
                if dh != 1:
                    inside = h >= 1 if dh == 0 else h + 1 < height
                    piece = jnp.where(inside, piece, jnp.zeros_like(piece))
                pieces.append(piece)
        slab = jnp.concatenate(pieces, axis=-1)
        if narrow:  # [taps' rows, 9 Cin] x [W, 9 Cin]^T: the channels on sublanes, W on the lanes
            products = lax.dot_general(w_ref[...], slab, (((1,), (1,)), ((), ())), precision=precision,
                                       preferred_element_type=jnp.float32)
        else:
            products = jnp.dot(slab, w_ref[...], precision=precision, preferred_element_type=jnp.float32)
        y = taps_summed(products) + bias
        if narrow:
            y = y[0:cout]
        if r_ref is not None:
            y = y + r_ref[j].astype(jnp.float32)
        y_ref[j] = y.astype(y_ref.dtype)
        return carry

    lax.fori_loop(0, jnp.minimum(block_h, height - first_row), row, 0)

    pl.when(t == frames - 1)(lambda: writes(i, slot, "start"))
    pl.when(step == num_blocks * frames - 1)(lambda: writes(i, slot, "wait"))


@functools.partial(jax.jit, static_argnames=("block_h", "interpret", "tanh_silu"))
def causal_conv3d(x, cache, kernel, bias, norm_gamma=None, residual=None, stream=None, *, block_h: int,
                  interpret: Any, tanh_silu: bool = False):
    """The kernel on validated inputs (:func:`pallas_kernels.causal_conv.causal_conv3d`): ``x``
    ``[T, H, W, Cin]``, ``cache`` ``[2, H, W, Cin]`` in ``x``'s dtype, or with an int32 scalar
    ``stream`` a batch's caches ``[B, 2, H, W, Cin]`` of which entry ``stream`` is read and
    written (aliased to the new cache: inside a program that no longer needs it, XLA writes the
    new cache over it), ``kernel`` ``[3, 3, 3, Cin, Cout]``, ``bias`` ``[Cout]``, ``norm_gamma``
    ``[Cin]`` or ``None``, ``residual`` ``[T, H, W, Cout]`` or ``None``; ``block_h`` rows per grid
    step (at most ``H``); ``tanh_silu``: the input norm's SiLU as
    :func:`~pallas_kernels.causal_conv.xla.silu_tanh` (for a v5e). Returns ``(y [T, H, W, Cout],
    new_cache)``, ``new_cache`` of ``cache``'s shape."""
    frames, height, width, cin = x.shape
    geom = ConvGeometry(frames, height, width, cin, kernel.shape[-1], input_norm=norm_gamma is not None,
                        residual=residual is not None)
    cout = geom.out_channels
    narrow = is_narrow(cout)
    weights = pack_weights(kernel, x.dtype)
    bias = bias.astype(jnp.float32).reshape(1, cout)
    if narrow:  # one per row of the transposed output
        bias = jnp.pad(bias.reshape(cout, 1), ((0, NARROW_TAP_ROWS - cout), (0, 0)))
    batch = cache if stream is not None else cache[None]
    index = jnp.zeros((1,), jnp.int32) if stream is None else jnp.asarray(stream, jnp.int32).reshape(1)
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    limit = min(MAX_VMEM_LIMIT, max(MIN_VMEM_LIMIT, 2 * vmem_bytes(geom, block_h, x.dtype.itemsize)))
    whole = functools.partial(pl.BlockSpec, index_map=lambda i, t, *_: (0, 0))
    in_specs = [hbm, whole(weights.shape), whole(bias.shape)]
    operands = [index, x, weights, bias]
    scratch = [pltpu.VMEM((2, 3, block_h + 2, width, cin), x.dtype)]
    if geom.input_norm:
        in_specs.append(whole((1, cin)))
        operands.append(norm_scale(norm_gamma).reshape(1, cin))
        scratch.append(pltpu.VMEM((3, block_h + 2, width, cin), x.dtype))
    row_shape = (cout, width) if narrow else (width, cout)
    out_block = pl.BlockSpec((None, block_h, *row_shape), lambda i, t, *_: (t, i, 0, 0))
    if geom.residual:
        in_specs.append(out_block)
        operands.append(jnp.swapaxes(residual, 2, 3) if narrow else residual)
    y, batch = pl.pallas_call(
        functools.partial(_kernel, geom=geom, block_h=block_h, tanh_silu=tanh_silu),
        out_shape=(jax.ShapeDtypeStruct((frames, height, *row_shape), x.dtype),
                   jax.ShapeDtypeStruct(batch.shape, batch.dtype)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(cdiv(height, block_h), frames),
            in_specs=[*in_specs, hbm],
            out_specs=(out_block, hbm),
            scratch_shapes=[*scratch, pltpu.SemaphoreType.DMA((2, 3)), pltpu.SemaphoreType.DMA((2,))]),
        input_output_aliases={len(operands): 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary"),
                                             vmem_limit_bytes=limit),
        interpret=interpret,
        name=kernel_name(geom),
    )(*operands, batch)
    if narrow:
        y = jnp.swapaxes(y, 2, 3)
    return y, batch if stream is not None else batch[0]
