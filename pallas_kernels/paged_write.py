"""Paged chunk write: copy the clean K/V of one chunk per row into the rows' pages, in place.

Shapes (``L`` layers, ``P`` pages, ``S`` tokens per page = block size, ``H`` KV heads, ``D`` head
dim, ``R`` rows, ``F`` frames per chunk, ``T`` tokens per frame):

================  =====================================  ===========================================
``k_pool``        ``[L, P, S, H, D]``                    one page = ``S * H * D`` elements per layer
``v_pool``        ``[L, P, S, H, D]``                    same shape and dtype as ``k_pool``
``k_new``         ``[L, R, F * T, H, D]``                the chunk's K, frame-major, pool dtype
``v_new``         ``[L, R, F * T, H, D]``                same shape and dtype as ``k_new``
``page_ids``      ``int32 [R, F * ceil(T / S)]``         physical page of each (row, frame, page)
================  =====================================  ===========================================

A frame takes ``pages_per_frame = ceil(T / S)`` consecutive entries of its row's page list; the last
page of a frame is padded with zeros (the padding tokens are written as zeros). Page 0 is the null
page: it is never written. Every write is a whole-page copy (all layers of a page at once); pages
not named in ``page_ids`` stay bit-identical.

Skip semantics under ``jit``: an entry equal to 0 or outside ``[1, P)`` writes nothing (padding rows
and failed allocations use 0), in every backend. Called with concrete arguments, :func:`write_chunk`
instead rejects such entries, and duplicates, with a ``ValueError``.

In place: call it inside a jitted step that donates the pools,
``jax.jit(step, donate_argnums=(0, 1))``; the outputs then alias the pools and a write moves only
the chunk's bytes (``2 * L * R * F * ceil(T / S) * S * H * D * itemsize``). Without donation XLA
copies both pools first.

Backends (``backend=``, see :mod:`pallas_kernels.backend`):

- ``"xla"``: a ``fori_loop`` of one ``dynamic_update_slice`` per page, skipped pages under
  ``lax.cond`` (see :func:`_write_xla` for why not a scatter). The CPU default.
- ``"pallas_tpu*"``: a Mosaic TPU kernel that DMAs each page HBM to HBM, straight from the chunk
  into the aliased pool (``pl.ANY`` refs, page ids scalar-prefetched into SMEM, at most
  ``_TPU_DMAS_IN_FLIGHT`` pages in flight). Skipped pages issue no DMA.
- ``"pallas_gpu*"``: a Triton-backend ``pallas_call``, one program per (page, layer, block of
  elements); see :func:`_write_pallas_gpu` for why Triton and not Mosaic GPU.

No backend makes a padded copy of the chunk: each reads the ``[L, R, F * T, H, D]`` chunk as it is
and writes a frame's padding from zeros (a small zero block, a masked load, or an in-loop pad).

:func:`write_chunk_reference` is the pure-jnp reference the kernels are tested against.

Status (jax 0.10.2): every backend is tested on CPU against the reference, the Pallas kernels only
in interpret mode (``pallas_tpu_interpret``, ``pallas_tpu_simulate``, ``pallas_gpu_interpret``).
Both kernels also lower on CPU for their targets (Mosaic MLIR for ``tpu``, Triton IR for ``cuda``),
but neither has yet been compiled or run on a TPU or a GPU.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.backend import resolve_backend

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

# Pages whose DMAs the TPU kernel keeps in flight at once (K and V each).
_TPU_DMAS_IN_FLIGHT = 8
# Most elements one GPU program copies (a power of two; 4096 bf16 = 8 KiB).
_GPU_MAX_BLOCK_ELEMENTS = 4096


def pages_per_frame(tokens_per_frame: int, block_size: int) -> int:
    """Pages one frame occupies: ``ceil(tokens_per_frame / block_size)``."""
    return -(-tokens_per_frame // block_size)


def write_chunk(
    k_pool: jax.Array,
    v_pool: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    page_ids: jax.Array,
    *,
    tokens_per_frame: int | None = None,
    backend: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """Writes one chunk's K/V per row into the pages ``page_ids`` names, for all layers at once.

    Args:
      k_pool, v_pool: ``[L, P, S, H, D]`` pools (fp32, bf16 or fp16), page 0 the null page.
      k_new, v_new: ``[L, R, F * T, H, D]``, the pools' dtype (no implicit cast: a mismatch raises).
      page_ids: integer ``[R, F * ceil(T / S)]``; entry ``(r, f * ppf + j)`` is the physical page of
        row ``r``, frame ``f``, page ``j`` of the frame. Under ``jit``, 0 or out of ``[1, P)``
        skips; a page named twice (rejected when concrete) ends up holding one of its writes, or on
        TPU/GPU possibly a mix of them, and no other page is touched.
      tokens_per_frame: ``T``; defaults to the block size ``S``.
      backend: a name from :data:`pallas_kernels.backend.BACKEND_NAMES`.

    Returns:
      ``(k_pool, v_pool)`` with the named pages replaced (aliasing the inputs when donated).

    Raises:
      ValueError: bad ranks, shapes, dtypes or ``tokens_per_frame`` (always); with concrete
        ``page_ids``, an entry that is the null page, out of ``[1, P)``, or repeated.
    """
    resolved = resolve_backend(backend).name
    tokens_per_frame = _check_shapes(k_pool, v_pool, k_new, v_new, page_ids, tokens_per_frame)
    if not isinstance(page_ids, jax.core.Tracer):
        _check_page_id_values(np.asarray(page_ids), k_pool.shape[1])
    return _write_chunk_jit(k_pool, v_pool, k_new, v_new, page_ids,
                            tokens_per_frame=tokens_per_frame, backend_name=resolved)


def write_chunk_reference(
    k_pool: jax.Array,
    v_pool: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    page_ids: jax.Array,
    *,
    tokens_per_frame: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Pure-jnp reference of :func:`write_chunk` (same arguments and skip semantics, no checks).

    Every pool page picks the chunk page whose valid id names it (a one-hot match of page ids
    against the page axis) or keeps its old bits: no scatter, no loop, ``O(P * R * F * ppf)``.
    """
    num_pages, block_size = k_pool.shape[1], k_pool.shape[2]
    ids = _sanitize_page_ids(page_ids, num_pages)
    match = (ids[None, :] == jnp.arange(num_pages, dtype=jnp.int32)[:, None]) & (ids[None, :] != 0)
    written = match.any(axis=1)[None, :, None, None, None]
    source = jnp.argmax(match, axis=1)
    tpf = block_size if tokens_per_frame is None else tokens_per_frame

    def one(pool: jax.Array, new: jax.Array) -> jax.Array:
        pages = _chunk_to_pages(new, block_size, tpf)
        return jnp.where(written, pages[:, source], pool)

    return one(k_pool, k_new), one(v_pool, v_new)


# ---------------------------------------------------------------------------------------------
# Validation (host side).


def _check_shapes(k_pool, v_pool, k_new, v_new, page_ids, tokens_per_frame) -> int:
    """Checks ranks, shapes and dtypes (static, so also under jit); returns ``tokens_per_frame``."""
    for name, x in (("k_pool", k_pool), ("v_pool", v_pool), ("k_new", k_new), ("v_new", v_new)):
        if jnp.ndim(x) != 5:
            raise ValueError(f"{name} must have rank 5, got shape {jnp.shape(x)}")
    if k_pool.shape != v_pool.shape or k_pool.dtype != v_pool.dtype:
        raise ValueError(f"k_pool and v_pool must match, got {k_pool.dtype}{list(k_pool.shape)} "
                         f"and {v_pool.dtype}{list(v_pool.shape)}")
    if jnp.dtype(k_pool.dtype) not in SUPPORTED_DTYPES:
        raise ValueError(f"pool dtype must be one of {[d.name for d in SUPPORTED_DTYPES]}, "
                         f"got {k_pool.dtype}")
    if k_new.shape != v_new.shape:
        raise ValueError(f"k_new and v_new must have the same shape, got {list(k_new.shape)} "
                         f"and {list(v_new.shape)}")
    for name, x in (("k_new", k_new), ("v_new", v_new)):
        if x.dtype != k_pool.dtype:
            raise ValueError(f"{name} dtype must be the pool dtype {k_pool.dtype} (cast it "
                             f"first), got {x.dtype}")
    num_layers, num_pages, block_size, kv_heads, head_dim = k_pool.shape
    if num_pages < 2:
        raise ValueError(f"the pools need the null page and at least one more, got "
                         f"num_pages={num_pages}")
    if k_new.shape[0] != num_layers or k_new.shape[3:] != (kv_heads, head_dim):
        raise ValueError(f"k_new/v_new must be [num_layers={num_layers}, rows, tokens, "
                         f"kv_heads={kv_heads}, head_dim={head_dim}], got {list(k_new.shape)}")
    if tokens_per_frame is None:
        tokens_per_frame = block_size
    if (isinstance(tokens_per_frame, bool) or not isinstance(tokens_per_frame, (int, np.integer))
            or tokens_per_frame < 1):
        raise ValueError(f"tokens_per_frame must be a positive int, got {tokens_per_frame!r}")
    rows, tokens = k_new.shape[1], k_new.shape[2]
    if tokens == 0 or tokens % tokens_per_frame:
        raise ValueError(f"the chunk's {tokens} tokens per row must be a positive multiple of "
                         f"tokens_per_frame={tokens_per_frame}")
    ppf = pages_per_frame(int(tokens_per_frame), block_size)
    expected = (rows, tokens // tokens_per_frame * ppf)
    if jnp.ndim(page_ids) != 2 or tuple(jnp.shape(page_ids)) != expected:
        raise ValueError(f"page_ids must have shape [rows, num_frames * pages_per_frame] = "
                         f"{list(expected)} (tokens_per_frame={tokens_per_frame}, block_size="
                         f"{block_size}, pages_per_frame={ppf}), got {list(jnp.shape(page_ids))}")
    if not jnp.issubdtype(page_ids.dtype, jnp.integer):
        raise ValueError(f"page_ids must be integers (int32), got {page_ids.dtype}")
    return int(tokens_per_frame)


def _check_page_id_values(ids: np.ndarray, num_pages: int) -> None:
    """Rejects the null page, ids outside ``[1, num_pages)`` and repeated ids."""
    flat = ids.reshape(-1)
    bad = flat[(flat < 1) | (flat >= num_pages)]
    if bad.size:
        what = "the null page 0" if bad[0] == 0 else f"page id {int(bad[0])}"
        raise ValueError(f"page_ids contains {what}; allowed page ids are [1, {num_pages}) "
                         f"(0 is the null page, skipped only under jit)")
    values, counts = np.unique(flat, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"page_ids repeats page {int(values[counts > 1][0])}; each page may be "
                         f"written once per call (allowed page ids are [1, {num_pages}))")


# ---------------------------------------------------------------------------------------------
# Shared layout helpers (pure).


def _frames(new: jax.Array, tokens_per_frame: int) -> jax.Array:
    """``[L, R, F * T, H, D]`` -> ``[L, R * F, T, H, D]`` (a free reshape)."""
    num_layers, rows, tokens, kv_heads, head_dim = new.shape
    return new.reshape(num_layers, rows * tokens // tokens_per_frame, tokens_per_frame, kv_heads,
                       head_dim)


def _chunk_to_pages(new: jax.Array, block_size: int, tokens_per_frame: int) -> jax.Array:
    """``[L, R, F * T, H, D]`` -> ``[L, R * F * ppf, S, H, D]``, each frame's last page zero-padded
    (the reference's layout; the kernels read the unpadded chunk directly)."""
    frames = _frames(new, tokens_per_frame)
    ppf = pages_per_frame(tokens_per_frame, block_size)
    pad = ppf * block_size - tokens_per_frame
    frames = jnp.pad(frames, ((0, 0), (0, 0), (0, pad), (0, 0), (0, 0)))
    num_layers, _, _, kv_heads, head_dim = new.shape
    return frames.reshape(num_layers, -1, block_size, kv_heads, head_dim)


def _sanitize_page_ids(page_ids: jax.Array, num_pages: int) -> jax.Array:
    """Flat int32 page ids with every skipped entry (0 or out of ``[1, P)``) set to 0."""
    ids = page_ids.reshape(-1).astype(jnp.int32)
    return jnp.where((ids >= 1) & (ids < num_pages), ids, 0)


@functools.partial(jax.jit, static_argnames=("tokens_per_frame", "backend_name"))
def _write_chunk_jit(k_pool, v_pool, k_new, v_new, page_ids, *, tokens_per_frame: int,
                     backend_name: str):
    backend = resolve_backend(backend_name)
    num_pages, block_size = k_pool.shape[1], k_pool.shape[2]
    ids = _sanitize_page_ids(page_ids, num_pages)
    k_frames, v_frames = _frames(k_new, tokens_per_frame), _frames(v_new, tokens_per_frame)
    ppf = pages_per_frame(tokens_per_frame, block_size)
    if backend.kind == "xla":
        return _write_xla(k_pool, v_pool, k_frames, v_frames, ids, ppf)
    if backend.kind == "pallas_tpu":
        return _write_pallas_tpu(k_pool, v_pool, k_frames, v_frames, ids, ppf, backend.interpret)
    return _write_pallas_gpu(k_pool, v_pool, k_frames, v_frames, ids, ppf, backend.interpret)


# ---------------------------------------------------------------------------------------------
# XLA path.


def _write_xla(k_pool, v_pool, k_frames, v_frames, ids, ppf: int):
    """A ``fori_loop`` over the ``N = R * F * ppf`` page ids: one ``dynamic_update_slice`` of a
    whole ``[L, 1, S, H, D]`` page per pool, under ``lax.cond`` (id 0 skips).

    ``k_frames``/``v_frames`` are the unpadded chunk as ``[L, R * F, T, H, D]``; ``ids`` flat int32.
    Choices, all measured on CPU (jax 0.10.2, 2 cores):

    - Not a scatter (``pool.at[:, ids].set(pages, unique_indices=True, mode="drop")``): with 32 MiB
      pools and 16 pages of 4 layers the donated scatter took 0.93 ms and a 4 MiB temp in fp32, and
      35-66 ms and a 64-128 MiB temp in bf16 (XLA:CPU upcasts bf16/fp16 scatters and
      dynamic-update-slices to f32 across the whole pool); this loop took 0.47-0.52 ms in every
      dtype with a sub-KiB temp (a contiguous DUS of the same bytes: 0.25-0.4 ms).
    - 16-bit pools move as uint16 bits, bitcast inside the loop body: XLA:CPU upcasts bf16/fp16
      updates to f32 across the whole pool, and the bitcast variant is the cheapest of the
      measured options (bitcasts outside the loop become full-pool copies). It is still O(pool)
      on CPU: 50 ms for 64 pages into a 1M-page bf16 pool against 0.01 ms for fp32. 32-bit pools
      are written directly: bitcasting them too made the same fp32 write 50 ms instead of 0.01 ms.
    - A frame's padded last page is built page-sized inside the loop (slice, pad, select) rather
      than from a padded copy of the chunk: XLA:CPU maps a fresh temp per call, and page-faulting a
      chunk-sized temp made the write 5x slower (20.8 ms against 3.9 ms for 34 MiB). Nor is it a
      third ``lax.switch`` branch: two branches that both update the pools cost a full-pool copy.
    """
    num_layers, _, block_size, kv_heads, head_dim = k_pool.shape
    last_tokens = k_frames.shape[2] - (ppf - 1) * block_size
    # Page index i >= 0: lax.div/rem (truncating) equal // and %, without their sign fix-ups.

    def page_at(frames, i):
        """Page ``i`` of the chunk, ``[L, 1, S, H, D]`` raw bits, zero-padded if a frame's last."""
        frame, j = lax.div(i, ppf), lax.rem(i, ppf)
        if frames.dtype.itemsize == 2:
            frames = lax.bitcast_convert_type(frames, jnp.uint16)

        def tokens(start, size):
            return lax.dynamic_slice(frames, (0, frame, start, 0, 0),
                                     (num_layers, 1, size, kv_heads, head_dim))

        if last_tokens == block_size:
            return tokens(j * block_size, block_size)
        last = jnp.pad(tokens((ppf - 1) * block_size, last_tokens),
                       ((0, 0), (0, 0), (0, block_size - last_tokens), (0, 0), (0, 0)))
        if ppf == 1:
            return last
        return jnp.where(j == ppf - 1, last, tokens(j * block_size, block_size))

    def body(i, pools):
        def write(pools):
            return tuple(_put_page(pool, page_at(frames, i), ids[i])
                         for pool, frames in zip(pools, (k_frames, v_frames)))
        return lax.cond(ids[i] != 0, write, lambda pools: pools, pools)

    return lax.fori_loop(0, ids.shape[0], body, (k_pool, v_pool))


def _put_page(pool: jax.Array, page: jax.Array, page_id: jax.Array) -> jax.Array:
    """``pool`` with ``page`` (a ``[L, 1, S, H, D]`` page, or its raw uint16 bits for a 16-bit pool)
    written at ``page_id`` on axis 1."""
    if page.dtype == pool.dtype:
        return lax.dynamic_update_slice_in_dim(pool, page, page_id, axis=1)
    out = lax.dynamic_update_slice_in_dim(lax.bitcast_convert_type(pool, page.dtype), page, page_id, axis=1)
    return lax.bitcast_convert_type(out, pool.dtype)


# ---------------------------------------------------------------------------------------------
# Pallas TPU (Mosaic) kernel.


def _tpu_kernel(ids_ref, k_frames, v_frames, *refs, ppf: int, padding: int):
    """Grid-less body: page ``i`` DMAs HBM->HBM, all layers at once, into page ``ids_ref[i]``.

    Refs: ``ids_ref`` SMEM int32 ``[N]`` (0 = skip); in HBM (``pl.ANY``) the unpadded chunk
    ``[L, R * F, T, H, D]`` per pool, then (only when ``padding`` > 0) a zero block
    ``[L, 1, padding, H, D]``, the pools (inputs, then the aliased outputs) and two DMA semaphores
    (K, V). Step ``t`` starts page ``t`` and waits for page ``t - _TPU_DMAS_IN_FLIGHT``. A frame's
    last page takes two DMAs when padded: its tokens, then the zero block.
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

    @pl.loop(0, num + _TPU_DMAS_IN_FLIGHT)
    def _(step):
        pl.when(step < num)(lambda: on_page(step, "start"))
        done = step - _TPU_DMAS_IN_FLIGHT
        pl.when(done >= 0)(lambda: on_page(done, "wait"))


def _run(copies, action: str) -> None:
    for copy in copies:
        getattr(copy, action)()


def _write_pallas_tpu(k_pool, v_pool, k_frames, v_frames, ids, ppf: int, interpret: Any):
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
        functools.partial(_tpu_kernel, ppf=ppf, padding=padding),  # Fresh per call (jax #40847).
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct(k_pool.shape, k_pool.dtype)] * 2,
        input_output_aliases={first_pool: 0, first_pool + 1: 1},
        interpret=interpret,
        name="paged_write_tpu",
    )(ids, *operands)


# ---------------------------------------------------------------------------------------------
# Pallas GPU kernel (Triton backend).


def _gpu_kernel(ids_ref, k_frames, v_frames, k_pool_in, v_pool_in, k_pool, v_pool, *, ppf: int,
                block: int, padded: bool):
    """Program ``(i, l, c)`` copies elements ``[c * block, (c + 1) * block)`` of layer ``l`` of page
    ``i`` into page ``ids_ref[i]`` of both pools (nothing when it is 0).

    Refs are whole arrays in global memory: the unpadded chunk ``[L, R * F, T * H * D]``, pools
    ``[L, P, S * H * D]``, the pool outputs aliasing the pool inputs. When frames are ``padded``,
    loads past a frame's end are masked to zero.
    """
    from jax.experimental.pallas import triton as pltriton  # See _write_pallas_gpu.

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


def _gpu_block_elements(page_elements: int) -> int:
    """Largest power of two dividing ``page_elements``, at most ``_GPU_MAX_BLOCK_ELEMENTS``
    (Triton blocks must be powers of two)."""
    return math.gcd(page_elements, _GPU_MAX_BLOCK_ELEMENTS)


def _write_pallas_gpu(k_pool, v_pool, k_frames, v_frames, ids, ppf: int, interpret: Any):
    """Triton-backend ``pallas_call`` over the grid ``(N, L, S * H * D / block)`` (pages on the grid
    axis with the largest CUDA limit).

    Why Triton rather than Mosaic GPU (jax 0.10.2, measured on CPU): the write must alias the
    donated pools. Mosaic GPU's ``pallas_call`` (which has ``input_output_aliases``) is deprecated
    since jax 0.10.2 in favour of ``plgpu.kernel``, and ``plgpu.kernel`` aliases only Refs, which it
    rejects as operands (``JaxprInputEffect ... does not have a corresponding jaxpr input``); its
    TMA copies also have no discharge rule, so the kernel cannot run under ``interpret=True``.
    The Triton ``pallas_call`` aliases, runs under the generic interpreter on CPU, and a page copy
    needs no tensor cores or TMA: vectorised global loads/stores of ``block`` elements suffice.
    The Triton backend is deprecated in jax 0.11 ("will be removed in a future version"); port to
    ``plgpu.kernel`` once it aliases operands. Triton offsets switch to 64 bits for pools over
    4 GiB (Pallas' Triton lowering does that by buffer size). Triton is imported here, not at
    module level, so the other backends keep working once JAX drops it.
    """
    from jax.experimental.pallas import triton as pltriton

    num_layers, num_pages, block_size, kv_heads, head_dim = k_pool.shape
    page_elements = block_size * kv_heads * head_dim
    block = _gpu_block_elements(page_elements)
    flat_pool = (num_layers, num_pages, page_elements)
    flat_frames = (num_layers, k_frames.shape[1], k_frames.shape[2] * kv_heads * head_dim)
    padded = ppf * block_size != k_frames.shape[2]
    k_out, v_out = pl.pallas_call(
        # A fresh partial per call (jax issue 40847).
        functools.partial(_gpu_kernel, ppf=ppf, block=block, padded=padded),
        grid=(ids.shape[0], num_layers, page_elements // block),
        out_shape=[jax.ShapeDtypeStruct(flat_pool, k_pool.dtype)] * 2,
        input_output_aliases={3: 0, 4: 1},
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="paged_write_gpu",
    )(ids, k_frames.reshape(flat_frames), v_frames.reshape(flat_frames),
      k_pool.reshape(flat_pool), v_pool.reshape(flat_pool))
    return k_out.reshape(k_pool.shape), v_out.reshape(v_pool.shape)
