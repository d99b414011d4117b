"""The q/k/v projection as one Mosaic TPU kernel: a grid over row blocks of tokens, each block read
once and projected to the queries, keys and values, the queries and keys RMS-normalized before
they are written. The weights are the model's ``[L, ...]`` stacks, the layer's slice chosen by a
scalar-prefetched index and fetched once (single-buffered). Semantics and shapes:
:func:`pallas_kernels.qkv_projection.qkv_projection`; design and figures: ``docs/kernels.md``
(q/k/v projection).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.adaln_mlp.tpu import layer_spec
from pallas_kernels.common import matmul_precision
from pallas_kernels.cross_query.xla import rms_norm
from pallas_kernels.qkv_projection.geometry import ProjectionGeometry, kernel_name

VMEM_LIMIT = 64 << 20
"""Scoped VMEM the kernel asks for (of 128 MiB physical on v5e and v6e)."""

MAX_BLOCK_ROWS = 1024
"""Most rows per grid step."""


def vmem_bytes(geom: ProjectionGeometry, block_rows: int, itemsize: int) -> int:
    """VMEM of the kernel's buffers at ``block_rows`` rows a step: the three weights and their
    vectors (single buffers, ``itemsize`` bytes an element), two blocks each of the input and the
    three outputs, and a float32 product of each."""
    width = geom.dim + 2 * geom.kv_dim
    weights = geom.dim * width * itemsize + 5 * width * itemsize
    return weights + block_rows * (2 * (geom.dim + width) * itemsize + width * 4)


def block_rows(geom: ProjectionGeometry, itemsize: int) -> int | None:
    """The rows per grid step: the largest multiple of 8 that divides ``geom.rows``, at most
    :data:`MAX_BLOCK_ROWS`, whose buffers fit :data:`VMEM_LIMIT`; ``None`` where there is none (the
    XLA path then runs)."""
    for rows in range(min(MAX_BLOCK_ROWS, geom.rows) // 8 * 8, 0, -8):
        if geom.rows % rows == 0 and vmem_bytes(geom, rows, itemsize) <= VMEM_LIMIT:
            return rows
    return None


def _kernel(layer_ref, x_ref, w_q_ref, b_q_ref, q_gain_ref, w_k_ref, b_k_ref, k_gain_ref, w_v_ref, b_v_ref, q_ref,
            k_ref, v_ref, *, eps: float):
    """Refs: ``layer_ref`` int32 ``[1]`` (SMEM, used by the index maps only); VMEM ``x_ref``
    ``[rows, dim]``, the layer's weights ``[dim, n]`` and vectors ``[1, n]``; out ``q_ref``
    ``[rows, dim]``, ``k_ref``/``v_ref`` ``[rows, kv_dim]``."""
    del layer_ref
    x = x_ref[...]
    dtype = w_q_ref.dtype

    def linear(w_ref, b_ref):  # as cross_query.xla.linear, the product in float32 and rounded once
        product = jnp.dot(x, w_ref[...], precision=matmul_precision(dtype), preferred_element_type=jnp.float32)
        return product.astype(dtype) + b_ref[...]

    q_ref[...] = rms_norm(linear(w_q_ref, b_q_ref), q_gain_ref[...], eps)
    k_ref[...] = rms_norm(linear(w_k_ref, b_k_ref), k_gain_ref[...], eps)
    v_ref[...] = linear(w_v_ref, b_v_ref)


@functools.partial(jax.jit, static_argnames=("eps", "rows_per_block", "interpret"))
def qkv_projection(x, w_q, b_q, q_gain, w_k, b_k, k_gain, w_v, b_v, layer, *, eps: float, rows_per_block: int,
                   interpret: Any):
    """The kernel on validated inputs (``x`` ``[B, N, dim]`` in the weights' dtype, stacked
    weights, ``layer`` an int32 scalar, ``rows_per_block`` dividing ``B * N``)."""
    batch, tokens, dim = x.shape
    kv_dim = w_k.shape[2]
    geom = ProjectionGeometry(batch * tokens, dim, kv_dim)

    def rows(width):
        return pl.BlockSpec((rows_per_block, width), lambda i, layer_ref: (i, 0))

    q, k, v = pl.pallas_call(
        functools.partial(_kernel, eps=eps),
        out_shape=tuple(jax.ShapeDtypeStruct((geom.rows, n), w_q.dtype) for n in (dim, kv_dim, kv_dim)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(geom.rows // rows_per_block,),
            in_specs=[rows(dim), layer_spec(dim, dim), layer_spec(1, dim), layer_spec(1, dim), layer_spec(dim, kv_dim),
                      layer_spec(1, kv_dim), layer_spec(1, kv_dim), layer_spec(dim, kv_dim), layer_spec(1, kv_dim)],
            out_specs=(rows(dim), rows(kv_dim), rows(kv_dim))),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",), vmem_limit_bytes=VMEM_LIMIT),
        interpret=interpret,
        name=kernel_name(geom),
    )(jnp.reshape(layer, (1,)), x.reshape(geom.rows, dim), w_q, b_q[:, None], q_gain[:, None], w_k, b_k[:, None],
      k_gain[:, None], w_v, b_v[:, None])
    return q.reshape(batch, tokens, dim), k.reshape(batch, tokens, kv_dim), v.reshape(batch, tokens, kv_dim)
