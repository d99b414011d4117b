"""The paged chunk write as a Pallas GPU kernel, Triton lowering (``"pallas_gpu"``, ``_interpret``).

One program per (page, layer x KV head, block of elements) copies part of a page of the head-major
pool (:func:`pallas_kernels.layout.head_pages`) from a head-major copy of the chunk with vector
loads and stores; loads past a frame's end are masked to zero. The pools are aliased, so the write
is in place when they are donated. Semantics and shapes: :func:`pallas_kernels.paged_write.write_chunk`.
JAX deprecates the Triton backend, so it is imported only when this backend runs. Why Triton rather
than Mosaic GPU: ``docs/kernels.md`` (Paged chunk write).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.layout import head_pages, pool_geometry

MAX_BLOCK_ELEMENTS = 4096
"""Most elements one program copies (a power of two; 4096 bf16 = 8 KiB)."""


def _kernel(ids_ref, k_frames, v_frames, k_pool_in, v_pool_in, k_pool, v_pool, *, ppf: int,
            block: int, padded: bool):
    """Program ``(i, l, c)`` copies elements ``[c * block, (c + 1) * block)`` of (layer, head) ``l``
    of page ``i`` into page ``ids_ref[i]`` of both pools (nothing when it is 0).

    Refs are whole arrays in global memory: the unpadded head-major chunk ``[L * H, R * F, T * D]``,
    pools ``[L * H, P, S * D]``, the pool outputs aliasing the pool inputs. When frames are ``padded``,
    loads past a frame's end are masked to zero.
    """
    from jax.experimental.pallas import triton as pltriton

    del k_pool_in, v_pool_in  # Aliased to k_pool / v_pool.
    i, layer, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    page = ids_ref[i]
    page_elements, frame_elements = k_pool.shape[2], k_frames.shape[2]

    @pl.when(page != 0)
    def _():
        start = lax.rem(i, ppf) * page_elements + c * block
        src = pl.ds(start, block)
        if padded:
            mask = start + lax.broadcasted_iota(jnp.int32, (block,), 0) < frame_elements
        for frames, pool in ((k_frames, k_pool), (v_frames, v_pool)):
            chunk = frames.at[layer, lax.div(i, ppf), src]
            data = pltriton.load(chunk, mask=mask, other=0) if padded else chunk[...]
            pool[layer, page, pl.ds(c * block, block)] = data


def block_elements(page_elements: int) -> int:
    """Largest power of two dividing ``page_elements``, at most :data:`MAX_BLOCK_ELEMENTS`
    (Triton blocks must be powers of two)."""
    return math.gcd(page_elements, MAX_BLOCK_ELEMENTS)


def write_chunk(k_pool, v_pool, k_frames, v_frames, ids, ppf: int, interpret: Any):
    """``(k_pool, v_pool)`` with page ``i`` of the chunk written at page ``ids[i]`` (0 skips).

    ``k_frames``/``v_frames`` are the unpadded chunk as ``[L, R * F, T, H, D]``; ``ids`` flat int32
    ``[R * F * ppf]`` with skipped entries already 0; ``interpret`` as for ``pl.pallas_call``.
    Grid ``(N, L * H, S * D / block)``: pages on the grid axis with the largest CUDA limit. The
    outputs alias the pool operands.
    """
    from jax.experimental.pallas import triton as pltriton

    geom = pool_geometry(k_pool)
    page_elements = geom.block_size * geom.head_dim
    block = block_elements(page_elements)
    flat_pool = head_pages(k_pool).shape
    layer_heads, num_frames, tokens = flat_pool[0], k_frames.shape[1], k_frames.shape[2]

    def head_major(frames):  # [L, R * F, T, H, D] -> [L * H, R * F, T * D]
        return frames.transpose(0, 3, 1, 2, 4).reshape(layer_heads, num_frames,
                                                         tokens * geom.head_dim)

    padded = ppf * geom.block_size != tokens
    k_out, v_out = pl.pallas_call(
        # A fresh partial per call (jax issue 40847).
        functools.partial(_kernel, ppf=ppf, block=block, padded=padded),
        grid=(ids.shape[0], layer_heads, page_elements // block),
        out_shape=[jax.ShapeDtypeStruct(flat_pool, k_pool.dtype)] * 2,
        input_output_aliases={3: 0, 4: 1},
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="paged_write_gpu",
    )(ids, head_major(k_frames), head_major(v_frames), head_pages(k_pool), head_pages(v_pool))
    return k_out.reshape(k_pool.shape), v_out.reshape(v_pool.shape)
