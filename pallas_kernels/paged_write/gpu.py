"""The paged chunk write as a Pallas GPU kernel, Triton lowering (``"pallas_gpu"``, ``_interpret``).

One program per (page, layer x KV head, block of elements) copies part of a page of the head-major
pool (:func:`pallas_kernels.layout.head_pages`) from a head-major copy of the chunk with vector
loads and stores; loads past a frame's end are masked to zero. The pools are aliased, so the write
is in place when they are donated. A quantized pool's pages are quantized in XLA before the kernel
(one scale per page of each layer and head, from the chunk itself), and the kernel moves the 8-bit
pages and writes their scales in place. Semantics and shapes: :func:`pallas_kernels.paged_write.write_chunk`.
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

from pallas_kernels.layout import (
    QuantizedPool,
    from_token_major,
    head_pages,
    is_quantized_pool,
    pool_geometry,
    quantize_pages,
)
from pallas_kernels.paged_write.reference import frame_pages

MAX_BLOCK_ELEMENTS = 4096
"""Most elements one program copies (a power of two; 4096 bf16 = 8 KiB)."""


def _kernel(ids_ref, k_src, v_src, *refs, ppf: int, block: int, padded: bool, quantized: bool):
    """Program ``(i, l, c)`` copies elements ``[c * block, (c + 1) * block)`` of (layer, head) ``l``
    of page ``i`` into page ``ids_ref[i]`` of both pools (nothing when it is 0).

    Refs are whole arrays in global memory: the source ``[L * H, N, n * D]`` (for a plain pool the
    unpadded head-major chunk, ``N = R * F`` frames of ``n = T`` tokens, a frame's page ``i % ppf``
    starting at token ``(i % ppf) * S``; for a quantized pool its quantized pages, ``ppf = 1``),
    pools ``[L * H, P, S * D]``, the pool outputs aliasing the pool inputs. A quantized write also
    has the pages' scales ``[L * H, N]`` after the sources and the pools' scales ``[L * H, P]``
    (inputs, then the aliased outputs) after the pools; program ``c = 0`` stores the scale. When
    frames are ``padded``, loads past a frame's end are masked to zero.
    """
    from jax.experimental.pallas import triton as pltriton

    if quantized:
        k_scales, v_scales, _, _, _, _, k_pool, v_pool, k_pool_scales, v_pool_scales = refs
    else:  # The pool inputs are aliased to the outputs.
        _, _, k_pool, v_pool = refs
    i, layer, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    page = ids_ref[i]
    page_elements, frame_elements = k_pool.shape[2], k_src.shape[2]

    @pl.when(page != 0)
    def _():
        start = lax.rem(i, ppf) * page_elements + c * block
        src = pl.ds(start, block)
        if padded:
            mask = start + lax.broadcasted_iota(jnp.int32, (block,), 0) < frame_elements
        for frames, pool in ((k_src, k_pool), (v_src, v_pool)):
            chunk = frames.at[layer, lax.div(i, ppf), src]
            data = pltriton.load(chunk, mask=mask, other=0) if padded else chunk[...]
            pool[layer, page, pl.ds(c * block, block)] = data

    if quantized:
        @pl.when((page != 0) & (c == 0))
        def _():
            k_pool_scales[layer, page] = k_scales[layer, i]
            v_pool_scales[layer, page] = v_scales[layer, i]


def block_elements(page_elements: int) -> int:
    """Largest power of two dividing ``page_elements``, at most :data:`MAX_BLOCK_ELEMENTS`
    (Triton blocks must be powers of two)."""
    return math.gcd(page_elements, MAX_BLOCK_ELEMENTS)


def write_chunk(k_pool, v_pool, k_frames, v_frames, ids, ppf: int, interpret: Any):
    """``(k_pool, v_pool)`` with page ``i`` of the chunk written at page ``ids[i]`` (0 skips).

    ``k_frames``/``v_frames`` are the unpadded chunk as ``[L, R * F, T, H, D]``; ``ids`` flat int32
    ``[R * F * ppf]`` with skipped entries already 0; ``interpret`` as for ``pl.pallas_call``.
    Grid ``(N, L * H, S * D / block)``: pages on the grid axis with the largest CUDA limit. The
    outputs alias the pool operands. A :class:`~pallas_kernels.layout.QuantizedPool` gets the chunk
    quantized page by page in XLA first (:func:`~pallas_kernels.layout.quantize_pages` of the
    padded pages, head-major: one pass over the chunk, its temporaries chunk-sized), then the kernel
    moves the 8-bit pages and their scales.
    """
    from jax.experimental.pallas import triton as pltriton

    geom = pool_geometry(k_pool)
    page_elements = geom.block_size * geom.head_dim
    block = block_elements(page_elements)
    layer_heads = geom.num_layers * geom.kv_heads
    quantized = is_quantized_pool(k_pool)
    if quantized:
        k_new, v_new = (quantize_pages(from_token_major(frame_pages(f, geom.block_size)), k_pool.dtype)
                        for f in (k_frames, v_frames))
        sources = [head_pages(k_new.values), head_pages(v_new.values),
                   *(new.scales.reshape(layer_heads, -1) for new in (k_new, v_new))]
        pools = [head_pages(k_pool.values), head_pages(v_pool.values),
                 *(pool.scales.reshape(layer_heads, -1) for pool in (k_pool, v_pool))]
        ppf, padded = 1, False
    else:
        num_frames, tokens = k_frames.shape[1], k_frames.shape[2]

        def head_major(frames):  # [L, R * F, T, H, D] -> [L * H, R * F, T * D]
            return frames.transpose(0, 3, 1, 2, 4).reshape(layer_heads, num_frames,
                                                             tokens * geom.head_dim)

        sources = [head_major(k_frames), head_major(v_frames)]
        pools = [head_pages(k_pool), head_pages(v_pool)]
        padded = ppf * geom.block_size != tokens
    first_pool = 1 + len(sources)
    out = pl.pallas_call(
        # A fresh partial per call (jax issue 40847).
        functools.partial(_kernel, ppf=ppf, block=block, padded=padded, quantized=quantized),
        grid=(ids.shape[0], layer_heads, page_elements // block),
        out_shape=[jax.ShapeDtypeStruct(pool.shape, pool.dtype) for pool in pools],
        input_output_aliases={first_pool + j: j for j in range(len(pools))},
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="paged_write_gpu",
    )(ids, *sources, *pools)
    if not quantized:
        return out[0].reshape(k_pool.shape), out[1].reshape(v_pool.shape)
    k_values, v_values, k_scales, v_scales = out
    return (QuantizedPool(k_values.reshape(k_pool.shape), k_scales.reshape(k_pool.scales.shape)),
            QuantizedPool(v_values.reshape(v_pool.shape), v_scales.reshape(v_pool.scales.shape)))
