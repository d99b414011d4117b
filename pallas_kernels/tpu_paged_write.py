"""Paged chunk write on the TPU-native pool layout, in place: one HBM->HBM DMA per page and pool.

Shapes (``L`` layers, ``H`` KV heads, ``P`` pages, ``S`` block size, ``D`` head dim, ``R`` rows,
``F`` frames per chunk, ``T`` tokens per frame, ``ppf = ceil(T / S)`` pages per frame):

================  =====================================  ===========================================
``k_pool``        ``[L, H, P, S, D]``                    :func:`pallas_kernels.tpu_layout.pool_shape`
``v_pool``        same as ``k_pool``
``k_new``         ``[L, R, F * T, H, D]``                the chunk's K, token-major, pool dtype
``v_new``         same as ``k_new``
``page_ids``      int32 ``[R, F * ppf]``                 physical page of each (row, frame, page)
================  =====================================  ===========================================

Semantics (those of :mod:`pallas_kernels.paged_write`, on this layout): entry ``(r, f * ppf + j)``
names the page that receives tokens ``[j * S, min((j + 1) * S, T))`` of frame ``f`` of row ``r``,
for every layer and head at once; a frame's last page is zero-padded. An id of 0 (the null page) or
outside ``[1, P)`` writes nothing. Pages not named stay bit-identical. A page named twice holds one
of the writes or a mix of them (concrete ids are rejected by :func:`write_chunk` instead).

In place: inside ``jax.jit(step, donate_argnums=...)`` donating the pools, the outputs alias them
(``input_output_aliases``) and the call moves ``2 * L * H * R * F * ppf * S * D * itemsize`` bytes
per pool (the chunk read, the pages written), never a pool. Compiled temporaries: at most the
head-major copy of the chunk, ``2 * L * R * F * T * H * D * itemsize`` bytes (XLA usually folds the
transpose into the chunk's HBM layout, leaving none), plus a ``[L, H, ppf * S - T, D]`` zero
block when frames are padded.

Kernel: grid-less; the page ids are scalar-prefetched into SMEM; step ``i`` starts the K and V
DMAs of page ``i`` (``[L, H, S, D]`` strided slabs, all layers and heads) and waits for those of
page ``i - DMAS_IN_FLIGHT``; a skipped page issues no DMA.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.tpu_layout import check_tpu_block_size, pool_geometry

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
DMAS_IN_FLIGHT = 8
"""Pages whose DMAs (K and V each) are in flight at once."""


def write_chunk(k_pool, v_pool, k_new, v_new, page_ids, *, tokens_per_frame=None,
                interpret: Any = False):
    """Writes one chunk's K/V per row into the pages ``page_ids`` names, all layers at once.

    Args:
      k_pool, v_pool: ``[L, H, P, S, D]`` pools (f32, bf16 or f16); page 0 is the null page.
      k_new, v_new: ``[L, R, F * T, H, D]`` in the pools' dtype.
      page_ids: integer ``[R, F * ceil(T / S)]``; 0 or outside ``[1, P)`` skips under ``jit``.
      tokens_per_frame: ``T``; defaults to ``S``.
      interpret: ``pl.pallas_call``'s ``interpret`` (False: compiled Mosaic; True or a
        ``pltpu.InterpretParams``: on the CPU).

    Returns:
      ``(k_pool, v_pool)`` with the named pages replaced (aliasing the inputs when donated).

    Raises:
      ValueError: bad ranks, shapes, dtypes, ``tokens_per_frame`` or a block size that is not a
        multiple of 8 (see :func:`pallas_kernels.tpu_layout.tpu_block_size`); with concrete ``page_ids``,
        the null page, an id outside ``[1, P)``, or a repeated id.
    """
    tpf = _check_shapes(k_pool, v_pool, k_new, v_new, page_ids, tokens_per_frame)
    if not isinstance(page_ids, jax.core.Tracer):
        _check_page_id_values(np.asarray(page_ids), k_pool.shape[2])
    return _write_chunk_jit(k_pool, v_pool, k_new, v_new, page_ids, tokens_per_frame=tpf,
                            interpret=interpret)


def write_chunk_reference(k_pool, v_pool, k_new, v_new, page_ids, *, tokens_per_frame=None):
    """Pure-jnp reference of :func:`write_chunk` (same arguments and skip semantics, no checks)."""
    num_layers, kv_heads, num_pages, block_size, head_dim = k_pool.shape
    tpf = block_size if tokens_per_frame is None else tokens_per_frame
    ppf = -(-tpf // block_size)
    ids = page_ids.reshape(-1).astype(jnp.int32)
    ids = jnp.where((ids >= 1) & (ids < num_pages), ids, 0)
    match = (ids[None, :] == jnp.arange(num_pages)[:, None]) & (ids[None, :] != 0)
    written, source = match.any(axis=1), jnp.argmax(match, axis=1)

    def one(pool, new):
        frames = new.reshape(num_layers, -1, tpf, kv_heads, head_dim)
        frames = jnp.pad(frames, ((0, 0), (0, 0), (0, ppf * block_size - tpf), (0, 0), (0, 0)))
        pages = frames.reshape(num_layers, -1, block_size, kv_heads, head_dim)
        pages = pages.transpose(0, 3, 1, 2, 4)[:, :, source]
        return jnp.where(written[None, None, :, None, None], pages, pool)

    return one(k_pool, k_new), one(v_pool, v_new)


def _check_shapes(k_pool, v_pool, k_new, v_new, page_ids, tokens_per_frame) -> int:
    for name, x in (("k_pool", k_pool), ("v_pool", v_pool), ("k_new", k_new), ("v_new", v_new)):
        if jnp.ndim(x) != 5:
            raise ValueError(f"{name} must have rank 5, got shape {jnp.shape(x)}")
    geom = pool_geometry(k_pool)
    if k_pool.shape != v_pool.shape or k_pool.dtype != v_pool.dtype:
        raise ValueError(f"k_pool and v_pool must match, got {k_pool.dtype}{list(k_pool.shape)} "
                         f"and {v_pool.dtype}{list(v_pool.shape)}")
    if jnp.dtype(k_pool.dtype) not in SUPPORTED_DTYPES:
        raise ValueError(f"pool dtype must be one of {[d.name for d in SUPPORTED_DTYPES]}, "
                         f"got {k_pool.dtype}")
    check_tpu_block_size(geom.block_size)
    if geom.num_pages < 2:
        raise ValueError(f"the pools need the null page and one more; got num_pages="
                         f"{geom.num_pages} (k_pool.shape[2]), allowed >= 2")
    if k_new.shape != v_new.shape or k_new.dtype != k_pool.dtype or v_new.dtype != k_pool.dtype:
        raise ValueError(f"k_new and v_new must have one shape and the pool dtype {k_pool.dtype}; "
                         f"got {k_new.dtype}{list(k_new.shape)} and {v_new.dtype}"
                         f"{list(v_new.shape)}")
    if k_new.shape[0] != geom.num_layers or k_new.shape[3:] != (geom.kv_heads, geom.head_dim):
        raise ValueError(f"k_new must be [num_layers={geom.num_layers}, rows, tokens, kv_heads="
                         f"{geom.kv_heads}, head_dim={geom.head_dim}], got {list(k_new.shape)}")
    tpf = geom.block_size if tokens_per_frame is None else tokens_per_frame
    if isinstance(tpf, bool) or not isinstance(tpf, (int, np.integer)) or tpf < 1:
        raise ValueError(f"tokens_per_frame must be an int >= 1, got {tokens_per_frame!r}")
    rows, tokens = k_new.shape[1], k_new.shape[2]
    if tokens == 0 or tokens % tpf:
        raise ValueError(f"the chunk's tokens per row (k_new.shape[2]={tokens}) must be a positive "
                         f"multiple of tokens_per_frame={tpf}")
    ppf = -(-int(tpf) // geom.block_size)
    expected = (rows, tokens // tpf * ppf)
    if jnp.ndim(page_ids) != 2 or tuple(jnp.shape(page_ids)) != expected:
        raise ValueError(f"page_ids must have shape [rows, frames * pages_per_frame] = "
                         f"{list(expected)}, got {list(jnp.shape(page_ids))}")
    if not jnp.issubdtype(page_ids.dtype, jnp.integer):
        raise ValueError(f"page_ids must be an integer array (int32), got {page_ids.dtype}")
    return int(tpf)


def _check_page_id_values(ids: np.ndarray, num_pages: int) -> None:
    flat = ids.reshape(-1)
    bad = flat[(flat < 1) | (flat >= num_pages)]
    if bad.size:
        raise ValueError(f"page_ids contains {int(bad[0])}; allowed page ids are [1, {num_pages}) "
                         "(0 is the null page, skipped only under jit)")
    values, counts = np.unique(flat, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"page_ids repeats page {int(values[counts > 1][0])}; each page may be "
                         f"written once per call (allowed page ids are [1, {num_pages}))")


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


@functools.partial(jax.jit, static_argnames=("tokens_per_frame", "interpret"))
def _write_chunk_jit(k_pool, v_pool, k_new, v_new, page_ids, *, tokens_per_frame: int,
                     interpret: Any):
    num_layers, kv_heads, num_pages, block_size, head_dim = k_pool.shape
    ppf = -(-tokens_per_frame // block_size)
    padding = ppf * block_size - tokens_per_frame
    ids = page_ids.reshape(-1).astype(jnp.int32)
    ids = jnp.where((ids >= 1) & (ids < num_pages), ids, 0)

    def head_major(new):  # [L, R, F * T, H, D] -> [L, H, R * F, T, D]
        frames = new.reshape(num_layers, -1, tokens_per_frame, kv_heads, head_dim)
        return frames.transpose(0, 3, 1, 2, 4)

    zeros = ([jnp.zeros((num_layers, kv_heads, padding, head_dim), k_pool.dtype)]
             if padding else [])
    operands = [head_major(k_new), head_major(v_new), *zeros, k_pool, v_pool]
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    first_pool = len(operands) - 1  # Operand indices count the prefetched ids (operand 0).
    return pl.pallas_call(
        functools.partial(_kernel, ppf=ppf, padding=padding),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(), in_specs=[any_spec] * len(operands),
            out_specs=[any_spec] * 2, scratch_shapes=[pltpu.SemaphoreType.DMA((2,))]),
        out_shape=[jax.ShapeDtypeStruct(k_pool.shape, k_pool.dtype)] * 2,
        input_output_aliases={first_pool: 0, first_pool + 1: 1},
        interpret=interpret,
        name="tpu_paged_write",
    )(ids, *operands)
