"""The adaLN MLP as one Mosaic TPU kernel: a grid over row blocks of one frame's tokens, each block
normalized and modulated into the matmul dtype, through the FFN-in, the GELU and the FFN-out with
its hidden activations kept in VMEM, then gated and added to the residual, written over the
residual's buffer (and, where asked, normalized and modulated again for the next block). The
weights are the model's ``[L, ...]`` stacks, the layer's slice chosen by a
scalar-prefetched index and fetched once (single-buffered). Semantics and shapes:
:func:`pallas_kernels.adaln_mlp.adaln_mlp`; design and figures: ``docs/kernels.md`` (adaLN MLP).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.adaln_mlp import xla
from pallas_kernels.adaln_mlp.geometry import MLPGeometry, kernel_name
from pallas_kernels.common import matmul_precision

VMEM_LIMIT = 120 << 20
"""Scoped VMEM the kernel asks for (of 128 MiB physical on v5e and v6e): both weights, the
hidden activations of a block and the double-buffered residual and output blocks."""

MAX_BLOCK_ROWS = 1024
"""Most rows per grid step."""


def vmem_bytes(geom: MLPGeometry, block_rows: int, itemsize: int, residual_itemsize: int) -> int:
    """VMEM of the kernel's buffers at ``block_rows`` rows a step: the weights (single buffers,
    ``itemsize`` bytes an element), the block's hidden activations (the float32 product, it and
    its GELU in the matmul dtype), two residual and two output blocks (``residual_itemsize``), two
    blocks of the next block's input and of the residual input where there is one
    (``itemsize``)."""
    weights = 2 * geom.dim * geom.hidden * itemsize + 2 * (geom.dim + geom.hidden) * itemsize
    hidden = block_rows * geom.hidden * (4 + 2 * itemsize)
    rows = 4 * block_rows * geom.dim * residual_itemsize + block_rows * geom.dim * (4 + 3 * itemsize)
    if geom.residual_input:
        weights += (geom.dim + 1) * geom.dim * itemsize
        rows += 2 * block_rows * geom.dim * itemsize
    return weights + hidden + rows


def block_rows(geom: MLPGeometry, itemsize: int, residual_itemsize: int) -> int | None:
    """The rows per grid step: the largest multiple of 8 that divides a frame's tokens (so a block
    lies in one frame and reads one modulation row), at most :data:`MAX_BLOCK_ROWS`, whose
    buffers fit :data:`VMEM_LIMIT`; ``None`` where there is none (the XLA path then runs)."""
    for rows in range(min(MAX_BLOCK_ROWS, geom.tokens_per_frame) // 8 * 8, 0, -8):
        if geom.tokens_per_frame % rows == 0 and vmem_bytes(geom, rows, itemsize, residual_itemsize) <= VMEM_LIMIT:
            return rows
    return None


def layer_spec(*block: int) -> pl.BlockSpec:
    """The BlockSpec of one layer's slice ``block`` of an ``[L, *block]`` weight stack, the layer
    read from the grid's scalar-prefetched ``layer_ref``; fetched once, single-buffered."""
    return pl.BlockSpec((None, *block), lambda i, layer_ref: (layer_ref[0], 0, 0), pipeline_mode=pl.Buffered(1))


def _kernel(layer_ref, x_ref, shift_ref, scale_ref, gate_ref, w_in_ref, b_in_ref, w_out_ref, b_out_ref, *refs,
            eps: float, residual_input: bool):
    """Refs: ``layer_ref`` int32 ``[1]`` (SMEM, used by the index maps only); VMEM ``x_ref``
    ``[rows, dim]``, ``shift_ref``/``scale_ref``/``gate_ref`` ``[1, 1, dim]`` (the block's frame),
    ``w_in_ref`` ``[dim, hidden]``, ``b_in_ref`` ``[1, hidden]``, ``w_out_ref`` ``[hidden, dim]``,
    ``b_out_ref`` ``[1, dim]`` (the layer's); with ``residual_input`` its ``r_ref`` ``[rows, dim]``,
    ``w_r_ref`` ``[dim, dim]`` and ``b_r_ref`` ``[1, dim]``; then ``out_ref`` ``[rows, dim]``, or
    the next block's ``next_shift_ref``/``next_scale_ref`` ``[1, 1, dim]``, ``out_ref`` and its
    input ``next_ref`` ``[rows, dim]`` (the weights' dtype)."""
    del layer_ref
    dtype = w_in_ref.dtype

    def linear(a, w_ref, b_ref):  # the product in float32, rounded once, then the bias
        product = jnp.dot(a, w_ref[...], precision=matmul_precision(dtype), preferred_element_type=jnp.float32)
        return product.astype(dtype) + b_ref[...]

    x = x_ref[...]
    if residual_input:
        r_ref, w_r_ref, b_r_ref, *refs = refs
        x = x + linear(r_ref[...], w_r_ref, b_r_ref).astype(x.dtype)
    hidden = xla.gelu(linear(xla.modulated_input(x, shift_ref[0], scale_ref[0], eps, dtype), w_in_ref, b_in_ref))
    out = x + linear(hidden, w_out_ref, b_out_ref).astype(x.dtype) * gate_ref[0]
    if len(refs) == 1:
        refs[0][...] = out
        return
    next_shift_ref, next_scale_ref, out_ref, next_ref = refs
    out_ref[...] = out
    next_ref[...] = xla.modulated_input(out, next_shift_ref[0], next_scale_ref[0], eps, dtype)


@functools.partial(jax.jit, static_argnames=("eps", "rows_per_block", "interpret"))
def adaln_mlp(x, shift, scale, gate, w_in, b_in, w_out, b_out, layer, next_modulation=None, residual_input=None, *,
              eps: float, rows_per_block: int, interpret: Any):
    """The kernel on validated inputs (``x`` ``[B, N, dim]``, ``shift``/``scale``/``gate`` and
    ``next_modulation``'s pair ``[B, F, dim]``, stacked weights, ``residual_input``'s ``(r [B, N,
    dim], w [L, dim, dim], b [L, dim])``, ``layer`` an int32 scalar, ``rows_per_block`` dividing a
    frame's ``N // F`` tokens)."""
    batch, tokens, dim = x.shape
    frames, hidden = shift.shape[1], w_in.shape[2]
    geom = MLPGeometry(batch * tokens, dim, hidden, tokens // frames, next_modulation is not None,
                       residual_input is not None)
    blocks_per_row = tokens // rows_per_block
    blocks_per_frame = geom.tokens_per_frame // rows_per_block

    def frame_row(i, layer_ref):  # the modulation row of block i: its row's frame
        return (i // blocks_per_row) * frames + (i % blocks_per_row) // blocks_per_frame, 0, 0

    rows = pl.BlockSpec((rows_per_block, dim), lambda i, layer_ref: (i, 0))
    per_frame = pl.BlockSpec((1, 1, dim), frame_row)
    modulation = (shift, scale, gate) + (() if next_modulation is None else tuple(next_modulation))
    out_shape = jax.ShapeDtypeStruct((geom.rows, dim), x.dtype)
    if next_modulation is not None:
        out_shape = (out_shape, jax.ShapeDtypeStruct((geom.rows, dim), w_in.dtype))
    residual_specs, residual_args = [], []
    if residual_input is not None:
        r, w_r, b_r = residual_input
        residual_specs = [rows, layer_spec(dim, dim), layer_spec(1, dim)]
        residual_args = [r.reshape(geom.rows, dim), w_r, b_r[:, None]]
    outs = pl.pallas_call(
        functools.partial(_kernel, eps=eps, residual_input=residual_input is not None),
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(geom.rows // rows_per_block,),
            in_specs=[rows, per_frame, per_frame, per_frame, layer_spec(dim, hidden), layer_spec(1, hidden),
                      layer_spec(hidden, dim), layer_spec(1, dim), *residual_specs,
                      *[per_frame] * (len(modulation) - 3)],
            out_specs=rows if next_modulation is None else (rows, rows)),
        input_output_aliases={1: 0},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",), vmem_limit_bytes=VMEM_LIMIT),
        interpret=interpret,
        name=kernel_name(geom),
    )(jnp.reshape(layer, (1,)), x.reshape(geom.rows, dim), *(m.reshape(batch * frames, 1, dim) for m in modulation[:3]),
      w_in, b_in[:, None], w_out, b_out[:, None], *residual_args,
      *(m.reshape(batch * frames, 1, dim) for m in modulation[3:]))
    if next_modulation is None:
        return outs.reshape(batch, tokens, dim)
    return tuple(o.reshape(batch, tokens, dim) for o in outs)
