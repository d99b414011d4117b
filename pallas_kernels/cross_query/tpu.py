"""The cross query as one Mosaic TPU kernel: a grid over row blocks of one frame's tokens, each
block's self-attention output projected, gated and added to the residual (written over the
residual's buffer), then layer-normalized, projected into the cross-attention's queries and
RMS-normalized, without leaving VMEM. The weights are the model's ``[L, ...]`` stacks, the layer's
slice chosen by a scalar-prefetched index and fetched once (single-buffered). Semantics and shapes:
:func:`pallas_kernels.cross_query.cross_query`; design and figures: ``docs/kernels.md`` (cross
query).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.adaln_mlp.tpu import layer_spec
from pallas_kernels.adaln_mlp.xla import layer_norm
from pallas_kernels.common import matmul_precision
from pallas_kernels.cross_query.geometry import QueryGeometry, kernel_name
from pallas_kernels.cross_query.xla import rms_norm

VMEM_LIMIT = 64 << 20
"""Scoped VMEM the kernel asks for (of 128 MiB physical on v5e and v6e)."""

MAX_BLOCK_ROWS = 1024
"""Most rows per grid step."""


def vmem_bytes(geom: QueryGeometry, block_rows: int, itemsize: int, residual_itemsize: int) -> int:
    """VMEM of the kernel's buffers at ``block_rows`` rows a step: the two weights (single
    buffers, ``itemsize`` bytes an element, with their vectors in float32 at most), two blocks
    each of the residual in and out (``residual_itemsize``), of the attention output and of the
    queries (``itemsize``), and four float32 temporaries of a block."""
    weights = 2 * geom.dim * geom.dim * itemsize + 5 * geom.dim * 4
    blocks = 4 * block_rows * geom.dim * (residual_itemsize + itemsize)
    return weights + blocks + 4 * block_rows * geom.dim * 4


def block_rows(geom: QueryGeometry, itemsize: int, residual_itemsize: int) -> int | None:
    """The rows per grid step: the largest multiple of 8 that divides a frame's tokens (so a block
    lies in one frame and reads one gate row), at most :data:`MAX_BLOCK_ROWS`, whose buffers fit
    :data:`VMEM_LIMIT`; ``None`` where there is none (the XLA path then runs)."""
    for rows in range(min(MAX_BLOCK_ROWS, geom.tokens_per_frame) // 8 * 8, 0, -8):
        if geom.tokens_per_frame % rows == 0 and vmem_bytes(geom, rows, itemsize, residual_itemsize) <= VMEM_LIMIT:
            return rows
    return None


def _kernel(layer_ref, x_ref, attention_ref, gate_ref, w_o_ref, b_o_ref, norm_scale_ref, norm_bias_ref, w_q_ref,
            b_q_ref, q_gain_ref, out_ref, query_ref, *, eps: float):
    """Refs: ``layer_ref`` int32 ``[1]`` (SMEM, used by the index maps only); VMEM ``x_ref`` and
    ``attention_ref`` ``[rows, dim]``, ``gate_ref`` ``[1, 1, dim]`` (the block's frame), the layer's
    ``w_o_ref``/``w_q_ref`` ``[dim, dim]`` and vectors ``[1, dim]``; out ``out_ref`` and
    ``query_ref`` ``[rows, dim]``."""
    del layer_ref
    dtype = w_o_ref.dtype

    def linear(a, w_ref, b_ref):  # as xla.linear, the product in float32 and rounded once
        product = jnp.dot(a, w_ref[...], precision=matmul_precision(dtype), preferred_element_type=jnp.float32)
        return product.astype(dtype) + b_ref[...]

    x = x_ref[...] + linear(attention_ref[...], w_o_ref, b_o_ref).astype(x_ref.dtype) * gate_ref[0]
    out_ref[...] = x
    normed = layer_norm(x, eps, norm_scale_ref[...], norm_bias_ref[...]).astype(dtype)
    query_ref[...] = rms_norm(linear(normed, w_q_ref, b_q_ref), q_gain_ref[...], eps)


@functools.partial(jax.jit, static_argnames=("eps", "rows_per_block", "interpret"))
def cross_query(x, attention, gate, w_o, b_o, norm_scale, norm_bias, w_q, b_q, q_gain, layer, *, eps: float,
                rows_per_block: int, interpret: Any):
    """The kernel on validated inputs (``x``/``attention`` ``[B, N, dim]``, ``gate`` ``[B, F, dim]``,
    stacked weights, ``layer`` an int32 scalar, ``rows_per_block`` dividing a frame's ``N // F``
    tokens)."""
    batch, tokens, dim = x.shape
    frames = gate.shape[1]
    geom = QueryGeometry(batch * tokens, dim, tokens // frames)
    blocks_per_row = tokens // rows_per_block
    blocks_per_frame = geom.tokens_per_frame // rows_per_block

    def frame_row(i, layer_ref):  # the gate row of block i: its row's frame
        return (i // blocks_per_row) * frames + (i % blocks_per_row) // blocks_per_frame, 0, 0

    rows = pl.BlockSpec((rows_per_block, dim), lambda i, layer_ref: (i, 0))
    vector = layer_spec(1, dim)
    out, query = pl.pallas_call(
        functools.partial(_kernel, eps=eps),
        out_shape=(jax.ShapeDtypeStruct((geom.rows, dim), x.dtype), jax.ShapeDtypeStruct((geom.rows, dim), w_q.dtype)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(geom.rows // rows_per_block,),
            in_specs=[rows, rows, pl.BlockSpec((1, 1, dim), frame_row), layer_spec(dim, dim), vector, vector, vector,
                      layer_spec(dim, dim), vector, vector],
            out_specs=(rows, rows)),
        input_output_aliases={1: 0},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",), vmem_limit_bytes=VMEM_LIMIT),
        interpret=interpret,
        name=kernel_name(geom),
    )(jnp.reshape(layer, (1,)), x.reshape(geom.rows, dim), attention.reshape(geom.rows, dim),
      gate.reshape(batch * frames, 1, dim), w_o, b_o[:, None], norm_scale[:, None], norm_bias[:, None], w_q,
      b_q[:, None], q_gain[:, None])
    return out.reshape(batch, tokens, dim), query.reshape(batch, tokens, dim)
