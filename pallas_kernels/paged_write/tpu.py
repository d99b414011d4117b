"""The paged chunk write as a Pallas TPU (Mosaic) kernel (``"pallas_tpu"``, ``_interpret``,
``_simulate``, and the write of ``"pallas_tpu_gather*"``), in place on the head-major pool layout.

Semantics and shapes are those of :func:`pallas_kernels.paged_write.write_chunk`, which validates
and calls :func:`write_chunk` here with the chunk as frames and the skipped ids set to 0. The kernel
is grid-less: the page ids are scalar-prefetched, and step ``i`` starts the HBM-to-HBM K and V DMAs
of page ``i`` (all layers and heads at once) and waits for those of page ``i - DMAS_IN_FLIGHT``; a
skipped page issues none. The outputs alias the donated pools. The compiled kernel needs a block
size that is a multiple of 8 (:func:`pallas_kernels.layout.check_tpu_block_size`). Design and
temporaries: ``docs/kernels.md`` (Paged chunk write).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.layout import pool_geometry

DMAS_IN_FLIGHT = 8
"""Pages whose DMAs (K and V each) are in flight at once."""


def _kernel(ids_ref, k_src, v_src, *refs, ppf: int, padding: int):
    """Refs: ``ids_ref`` SMEM int32 ``[N]`` (0 = skip); in HBM the head-major chunk
    ``[L, H, R * F, T, D]`` per pool, the zero block ``[L, H, padding, D]`` when ``padding``, the
    pool inputs (aliased, unused), the pool outputs ``[L, H, P, S, D]``; two DMA semaphores."""
    zeros = refs[0] if padding else None
    k_pool, v_pool, sems = refs[-3:]
    num, block_size = ids_ref.shape[0], k_pool.shape[3]

    def copies(i, last: bool):
        page, frame, start = ids_ref[i], lax.div(i, ppf), lax.rem(i, ppf) * block_size
        tokens = block_size - padding if last else block_size
        out = []
        for sem, src, pool in ((sems.at[0], k_src, k_pool), (sems.at[1], v_src, v_pool)):
            out.append(pltpu.make_async_copy(src.at[:, :, frame, pl.ds(start, tokens)],
                                             pool.at[:, :, page, pl.ds(0, tokens)], sem))
            if last:
                out.append(pltpu.make_async_copy(zeros, pool.at[:, :, page, pl.ds(tokens, padding)],
                                                 sem))
        return out

    def on_page(i, action: str):
        def run(last: bool):
            for copy in copies(i, last):
                getattr(copy, action)()

        @pl.when(ids_ref[i] != 0)
        def _():
            if not padding or ppf == 1:  # Every page alike: all full, or all a frame's last.
                run(bool(padding))
                return
            is_last = lax.rem(i, ppf) == ppf - 1
            pl.when(is_last)(lambda: run(True))
            pl.when(jnp.logical_not(is_last))(lambda: run(False))

    @pl.loop(0, num + DMAS_IN_FLIGHT)
    def _(step):
        pl.when(step < num)(lambda: on_page(step, "start"))
        done = step - DMAS_IN_FLIGHT
        pl.when(done >= 0)(lambda: on_page(done, "wait"))


def write_chunk(k_pool, v_pool, k_frames, v_frames, ids, ppf: int, interpret: Any):
    """``(k_pool, v_pool)`` with page ``i`` of the chunk written at page ``ids[i]`` (0 skips).

    ``k_frames``/``v_frames`` are the unpadded chunk as ``[L, R * F, T, H, D]``; ``ids`` flat int32
    ``[R * F * ppf]`` with skipped entries already 0; ``interpret`` as for ``pl.pallas_call``.
    The outputs alias the pool operands.
    """
    geom = pool_geometry(k_pool)
    tokens_per_frame = k_frames.shape[2]
    padding = ppf * geom.block_size - tokens_per_frame

    def head_major(frames):  # [L, R * F, T, H, D] -> [L, H, R * F, T, D]
        return frames.transpose(0, 3, 1, 2, 4)

    zeros = ([jnp.zeros((geom.num_layers, geom.kv_heads, padding, geom.head_dim), k_pool.dtype)]
             if padding else [])
    operands = [head_major(k_frames), head_major(v_frames), *zeros, k_pool, v_pool]
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    first_pool = len(operands) - 1  # Operand indices count the prefetched ids (operand 0).
    return pl.pallas_call(
        functools.partial(_kernel, ppf=ppf, padding=padding),  # Fresh per call (jax #40847).
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(), in_specs=[any_spec] * len(operands),
            out_specs=[any_spec] * 2, scratch_shapes=[pltpu.SemaphoreType.DMA((2,))]),
        out_shape=[jax.ShapeDtypeStruct(k_pool.shape, k_pool.dtype)] * 2,
        input_output_aliases={first_pool: 0, first_pool + 1: 1},
        interpret=interpret,
        name="paged_write_tpu",
    )(ids, *operands)
