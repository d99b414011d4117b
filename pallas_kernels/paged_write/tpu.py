"""The paged chunk write as a Pallas TPU (Mosaic) kernel (``"pallas_tpu"``, ``_interpret``,
``_simulate``).

Each page is DMA'd HBM to HBM, all layers at once, straight from the chunk into the aliased pool
(``pl.ANY`` refs, page ids scalar-prefetched into SMEM, at most :data:`DMAS_IN_FLIGHT` pages in
flight). Skipped pages issue no DMA. A frame's padded last page takes two DMAs: its tokens, then a
small zero block.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

DMAS_IN_FLIGHT = 8
"""Pages whose DMAs the kernel keeps in flight at once (K and V each)."""


def _kernel(ids_ref, k_frames, v_frames, *refs, ppf: int, padding: int):
    """Grid-less body: page ``i`` DMAs HBM->HBM, all layers at once, into page ``ids_ref[i]``.

    Refs: ``ids_ref`` SMEM int32 ``[N]`` (0 = skip); in HBM (``pl.ANY``) the unpadded chunk
    ``[L, R * F, T, H, D]`` per pool, then (only when ``padding`` > 0) a zero block
    ``[L, 1, padding, H, D]``, the pools (inputs, then the aliased outputs) and two DMA semaphores
    (K, V). Step ``t`` starts page ``t`` and waits for page ``t - DMAS_IN_FLIGHT``.
    """
    zeros_ref, refs = (refs[0], refs[1:]) if padding else (None, refs)
    _, _, k_pool, v_pool, sems = refs  # The pool inputs alias k_pool / v_pool.
    num, block_size = ids_ref.shape[0], k_pool.shape[2]

    def copies(i, last: bool):
        page, frame, start = ids_ref[i], lax.div(i, ppf), lax.rem(i, ppf) * block_size
        tokens = block_size - padding if last else block_size
        out = []
        for sem, frames, pool in ((sems.at[0], k_frames, k_pool), (sems.at[1], v_frames, v_pool)):
            dst = pool.at[:, pl.ds(page, 1)]
            out.append(pltpu.make_async_copy(frames.at[:, pl.ds(frame, 1), pl.ds(start, tokens)],
                                             dst.at[:, :, pl.ds(0, tokens)], sem))
            if last:
                out.append(pltpu.make_async_copy(zeros_ref, dst.at[:, :, pl.ds(tokens, padding)],
                                                 sem))
        return out

    def on_page(i, action: str):
        @pl.when(ids_ref[i] != 0)
        def _():
            if not padding or ppf == 1:  # Pages all alike: all full, or all a frame's last.
                _run(copies(i, last=bool(padding)), action)
                return
            is_last = lax.rem(i, ppf) == ppf - 1
            pl.when(is_last)(lambda: _run(copies(i, last=True), action))
            pl.when(jnp.logical_not(is_last))(lambda: _run(copies(i, last=False), action))

    @pl.loop(0, num + DMAS_IN_FLIGHT)
    def _(step):
        pl.when(step < num)(lambda: on_page(step, "start"))
        done = step - DMAS_IN_FLIGHT
        pl.when(done >= 0)(lambda: on_page(done, "wait"))


def _run(copies, action: str) -> None:
    for copy in copies:
        getattr(copy, action)()


def write_chunk(k_pool, v_pool, k_frames, v_frames, ids, ppf: int, interpret: Any):
    """``(k_pool, v_pool)`` with page ``i`` of the chunk written at page ``ids[i]`` (0 skips).

    ``k_frames``/``v_frames`` are the unpadded chunk as ``[L, R * F, T, H, D]``; ``ids`` flat int32
    ``[R * F * ppf]`` with skipped entries already 0; ``interpret`` as for ``pl.pallas_call``.
    The outputs alias the pool operands.
    """
    num_layers, _, block_size, kv_heads, head_dim = k_pool.shape
    padding = ppf * block_size - k_frames.shape[2]
    zeros = ([jnp.zeros((num_layers, 1, padding, kv_heads, head_dim), k_pool.dtype)]
             if padding else [])
    operands = [k_frames, v_frames, *zeros, k_pool, v_pool]
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(),
        in_specs=[any_spec] * len(operands),
        out_specs=[any_spec] * 2,
        scratch_shapes=[pltpu.SemaphoreType.DMA((2,))],
    )
    # Operand indices count the scalar-prefetched ids (operand 0); the pools come last.
    first_pool = 1 + len(operands) - 2
    return pl.pallas_call(
        functools.partial(_kernel, ppf=ppf, padding=padding),  # Fresh per call (jax #40847).
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct(k_pool.shape, k_pool.dtype)] * 2,
        input_output_aliases={first_pool: 0, first_pool + 1: 1},
        interpret=interpret,
        name="paged_write_tpu",
    )(ids, *operands)
