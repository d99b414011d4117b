"""Nearest 2x upsampling then a 3x3 convolution on TPU (``"pallas_tpu*"``): one Mosaic kernel that
reads the input at its own resolution and writes the upsampled output row-major, with no
interleaving pass in HBM.

Grid ``(frame t, row block i)``, both parallel. A step reads ``block_h`` input rows and the row
above and below them (three BlockSpecs; the image's edges are masked to zero). Per input row the
three row slabs ``[W, Cin]`` are concatenated on lanes into ``[W, 3 Cin]`` and multiplied by the
packed weights ``[3 Cin, 3 P]`` (:func:`pack_weights`: per ``dw`` tap the four output phases
``(a, b, Cout)``, padded to ``P``, a multiple of 128 lanes); the taps are summed after two sublane
rolls (the W shift) with the image edge masked, as in :mod:`pallas_kernels.causal_conv.tpu`. Phase
``(a, b)`` of input pixel ``(h, w)`` is output pixel ``(2h + a, 2w + b)``: each phase's ``[W,
Cout]`` goes to every second row of a float32 VMEM row ``[2W, Cout]`` (a strided store, 128
lanes at a time: Mosaic strides only 32-bit data at most one lane tile wide), which is then cast
and stored as output row ``2h + a``. Design and
figures: ``docs/kernels.md`` (Upsampling convolution).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.common import matmul_precision, round_up
from pallas_kernels.upsample_conv.geometry import UpsampleGeometry, kernel_name
from pallas_kernels.upsample_conv.xla import phase_kernel

LANES = 128
"""Each ``dw`` tap's four phases are padded to a multiple of this many columns (TPU lanes)."""
DEFAULT_BLOCK_H = 8
"""Most input rows per grid step unless the call says otherwise (:func:`default_block_h`)."""
VMEM_LIMIT = 64 << 20
"""Scoped-VMEM limit of a call: room for its double-buffered blocks and weights and one row's float32
products at Wan 2.1's shapes."""


def default_block_h(height: int) -> int:
    """The largest divisor of ``height`` not above :data:`DEFAULT_BLOCK_H`."""
    return max(d for d in range(1, min(DEFAULT_BLOCK_H, height) + 1) if height % d == 0)


def pack_weights(kernel, dtype):
    """``[3, 3, Cin, Cout]`` -> ``([3 Cin, 3 P], P)``: rows ``(dh, cin)``, columns ``(dw, a, b,
    cout)`` of :func:`~pallas_kernels.upsample_conv.xla.phase_kernel`, each ``dw`` tap's ``4 Cout``
    columns padded with zeros to ``P = round_up(4 Cout, 128)``."""
    cin, cout = kernel.shape[2:]
    cols = round_up(4 * cout, LANES)
    phased = phase_kernel(kernel).reshape(3, 3, cin, 4 * cout)  # dh, dw, cin, (a, b, c)
    phased = jnp.pad(phased, ((0, 0), (0, 0), (0, 0), (0, cols - 4 * cout)))
    return jnp.transpose(phased, (0, 2, 1, 3)).reshape(3 * cin, 3 * cols).astype(dtype), cols


def lane_pieces(channels: int) -> tuple[tuple[int, int], ...]:
    """``(start, size)`` of the 128-lane pieces of ``channels`` (the last one may be narrower):
    Mosaic's strided store takes rows at most one lane tile wide."""
    return tuple((start, min(LANES, channels - start)) for start in range(0, channels, LANES))


def _kernel(above_ref, x_ref, below_ref, w_ref, b_ref, y_ref, *spread, geom: UpsampleGeometry, block_h: int,
            cols: int):
    """Refs: ``above_ref``/``below_ref`` ``[1, W, Cin]`` (the input row above and below the block,
    clamped into the image), ``x_ref`` ``[block_h, W, Cin]``, ``w_ref`` ``[3 Cin, 3 P]``, ``b_ref``
    ``[1, 4 Cout]`` float32 (the bias per phase), ``y_ref`` ``[2 block_h, 2 W, Cout]``, ``spread``
    one float32 scratch ``[2 W, size]`` per :func:`lane_pieces` of ``Cout``."""
    height, width, cout = geom.height, geom.width, geom.out_channels
    first_row = pl.program_id(1) * block_h
    precision = matmul_precision(x_ref.dtype)
    bias = b_ref[...]
    columns = lax.broadcasted_iota(jnp.int32, (width, 4 * cout), 0)

    def row(j, carry):
        h = first_row + j
        up = jnp.where(j == 0, above_ref[0], x_ref[jnp.maximum(j - 1, 0)])
        down = jnp.where(j == block_h - 1, below_ref[0], x_ref[jnp.minimum(j + 1, block_h - 1)])
        up = jnp.where(h >= 1, up, jnp.zeros_like(up))
        down = jnp.where(h + 1 < height, down, jnp.zeros_like(down))
        products = jnp.dot(jnp.concatenate([up, x_ref[j], down], axis=-1), w_ref[...], precision=precision,
                           preferred_element_type=jnp.float32)
        left = pltpu.roll(products[:, 0:4 * cout], 1, 0)  # left[w] = tap dw=0 of column w - 1
        right = pltpu.roll(products[:, 2 * cols:2 * cols + 4 * cout], width - 1, 0)  # tap dw=2 of w + 1
        y = products[:, cols:cols + 4 * cout] + bias
        y = y + jnp.where(columns > 0, left, 0.0) + jnp.where(columns < width - 1, right, 0.0)
        for a in range(2):
            for piece, (start, size) in zip(spread, lane_pieces(cout)):
                for b in range(2):
                    phase = (2 * a + b) * cout + start
                    piece[pl.ds(b, width, stride=2), :] = y[:, phase:phase + size]
                y_ref[2 * j + a, :, pl.ds(start, size)] = piece[...].astype(y_ref.dtype)
        return carry

    lax.fori_loop(0, block_h, row, 0)


@functools.partial(jax.jit, static_argnames=("block_h", "interpret"))
def upsample_conv2d(x, kernel, bias, *, block_h: int, interpret: Any):
    """The kernel on validated inputs (:func:`pallas_kernels.upsample_conv.upsample_conv2d`): ``x``
    ``[T, H, W, Cin]``, ``kernel`` ``[3, 3, Cin, Cout]``, ``bias`` ``[Cout]``, ``block_h`` a divisor
    of ``H``. Returns ``y`` ``[T, 2H, 2W, Cout]``."""
    frames, height, width, cin = x.shape
    geom = UpsampleGeometry(frames, height, width, cin, kernel.shape[-1])
    cout = geom.out_channels
    weights, cols = pack_weights(kernel, x.dtype)
    bias = jnp.tile(bias.astype(jnp.float32), 4).reshape(1, 4 * cout)
    edge = functools.partial(pl.BlockSpec, (None, 1, width, cin))  # one row: block index = row index
    whole = functools.partial(pl.BlockSpec, index_map=lambda t, i: (0, 0))
    return pl.pallas_call(
        functools.partial(_kernel, geom=geom, block_h=block_h, cols=cols),
        out_shape=jax.ShapeDtypeStruct((frames, 2 * height, 2 * width, cout), x.dtype),
        grid=(frames, height // block_h),
        in_specs=[edge(lambda t, i: (t, jnp.maximum(i * block_h - 1, 0), 0, 0)),
                  pl.BlockSpec((None, block_h, width, cin), lambda t, i: (t, i, 0, 0)),
                  edge(lambda t, i: (t, jnp.minimum((i + 1) * block_h, height - 1), 0, 0)),
                  whole((3 * cin, 3 * cols)), whole((1, 4 * cout))],
        out_specs=pl.BlockSpec((None, 2 * block_h, 2 * width, cout), lambda t, i: (t, i, 0, 0)),
        scratch_shapes=[pltpu.VMEM((2 * width, size), jnp.float32) for _, size in lane_pieces(cout)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"),
                                             vmem_limit_bytes=VMEM_LIMIT),
        interpret=interpret,
        name=kernel_name(geom),
    )(x, x, x, weights, bias)
