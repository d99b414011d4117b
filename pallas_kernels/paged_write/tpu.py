"""The paged chunk write as a Pallas TPU (Mosaic) kernel (``"pallas_tpu"``, ``_interpret``,
``_simulate``, and the write of ``"pallas_tpu_gather*"``), in place on the head-major pool layout.

Semantics and shapes are those of :func:`pallas_kernels.paged_write.write_chunk`, which validates
and calls :func:`write_chunk` here with the chunk as frames and the skipped ids set to 0. The
kernel is grid-less, the page ids scalar-prefetched, and the outputs alias the donated pools. It
reads the chunk in the HBM layout XLA gives it (:func:`chunk_view`), so that no copy of the chunk
precedes the kernel:

* ``"head"`` (XLA lays the chunk out with the tokens second-minor, as it does for 12 KV heads):
  the chunk is passed head-major (a free transpose) and step ``i`` starts the HBM-to-HBM K and V
  DMAs of page ``i`` (all layers and heads at once) and waits for those of page
  ``i - DMAS_IN_FLIGHT``;
* ``"token"`` (the chunk row-major, as for 16 or 40 heads): the chunk is passed as token rows
  ``[L, R * F, T * H, D]`` (free when ``H % 8 == 0``); pieces of ``piece`` tokens of one layer's
  page are DMA'd into VMEM, reordered there to head-major (sublane-strided loads) and DMA'd into
  the page, double-buffered, the next piece in flight while one is reordered.

Quantized pools take :mod:`pallas_kernels.paged_write.tpu_quantized` (the chunk quantized in the
kernel), which shares :func:`chunk_view` and :func:`paged_write_call`.

A skipped page (id 0) moves nothing. The compiled kernel needs a block size that is a multiple of 8
(:func:`pallas_kernels.layout.check_tpu_block_size`). Design and temporaries: ``docs/kernels.md``
(Paged chunk write).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.common import target_device
from pallas_kernels.layout import pool_geometry

DMAS_IN_FLIGHT = 8
"""Pages whose DMAs (K and V each) are in flight at once on the ``"head"`` view."""
PIECE_BYTES = 4 << 20
"""Most bytes of one VMEM piece buffer of the ``"token"`` view (four are allocated)."""
TOKEN_ROWS = 8
"""Rows of XLA:TPU's HBM tile: the ``"token"`` view needs ``H`` and the block size multiples of it."""


# ------------------------------------------------------------------------------------------------
# Which view of the chunk the kernel takes
# ------------------------------------------------------------------------------------------------


def hbm_order(shape: tuple[int, ...], dtype, device=None) -> tuple[int, ...] | None:
    """The axes of an array of ``shape`` and ``dtype`` from major to minor in XLA:TPU's default HBM
    layout on ``device`` (default the device the program is built for); ``None`` off TPU, where
    every array is row-major."""
    device = target_device() if device is None else device
    if device.platform != "tpu":
        return None
    from jax.experimental.layout import Layout

    layout = Layout.from_pjrt_layout(
        device.client.get_default_layout(jnp.dtype(dtype), tuple(shape), device))
    return tuple(layout.major_to_minor)


def chunk_view(frames_shape: tuple[int, ...], dtype, block_size: int, device=None) -> str:
    """``"token"`` or ``"head"``: how the kernel takes a chunk of frames ``[L, R * F, T, H, D]``.

    ``"token"`` needs ``H`` and ``block_size`` multiples of :data:`TOKEN_ROWS` (a token's heads are
    then whole HBM tile rows, so ``[L, R * F, T * H, D]`` is the same bytes); it is chosen when
    XLA:TPU's default HBM layout of the chunk, asked of ``device`` (default the device the program
    is built for, :func:`hbm_order`), is row-major. Any other layout (XLA puts the tokens
    second-minor when ``H`` would pad its tile) takes ``"head"``, whose transpose is then free. Off
    TPU (interpreted) both views are exact; ``"token"`` is taken wherever it applies, as a TPU
    would take it for a row-major chunk.
    """
    heads = frames_shape[3]
    if heads % TOKEN_ROWS or block_size % TOKEN_ROWS:
        return "head"
    order = hbm_order(frames_shape, dtype, device)
    return "token" if order in (None, tuple(range(len(frames_shape)))) else "head"


def token_piece(block_size: int, heads: int, head_dim: int, itemsize: int) -> int:
    """Tokens per VMEM piece of the ``"token"`` view: the largest divisor of ``block_size`` that
    is a multiple of :data:`TOKEN_ROWS` and whose ``[piece, H, D]`` buffer fits
    :data:`PIECE_BYTES` (at least :data:`TOKEN_ROWS`)."""
    fits = [n for n in range(TOKEN_ROWS, block_size + 1, TOKEN_ROWS)
            if block_size % n == 0 and n * heads * head_dim * itemsize <= PIECE_BYTES]
    return max(fits, default=TOKEN_ROWS)


# ------------------------------------------------------------------------------------------------
# The "head" view: HBM-to-HBM DMAs of whole pages
# ------------------------------------------------------------------------------------------------


def _head_kernel(ids_ref, k_src, v_src, *refs, ppf: int, padding: int):
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


def head_major(frames):
    """``[L, R * F, T, H, D]`` -> ``[L, H, R * F, T, D]`` (free where XLA lays the chunk out with
    the tokens second-minor)."""
    return frames.transpose(0, 3, 1, 2, 4)


def _write_head_view(k_pool, v_pool, k_frames, v_frames, ids, ppf: int, interpret: Any):
    geom = pool_geometry(k_pool)
    padding = ppf * geom.block_size - k_frames.shape[2]
    zeros = ([jnp.zeros((geom.num_layers, geom.kv_heads, padding, geom.head_dim), k_pool.dtype)]
             if padding else [])
    operands = [head_major(k_frames), head_major(v_frames), *zeros, k_pool, v_pool]
    return paged_write_call(functools.partial(_head_kernel, ppf=ppf, padding=padding), ids, operands,
                            [pltpu.SemaphoreType.DMA((2,))], interpret)


# ------------------------------------------------------------------------------------------------
# The "token" view: pieces of a page reordered to head-major in VMEM
# ------------------------------------------------------------------------------------------------


def _reorder(src, dst, valid: int, heads: int, strided: bool):
    """``dst[h, t] = src[t * heads + h]`` for the ``valid`` first tokens ``t``, zero after.

    ``src`` VMEM ``[piece * heads, D]`` (a piece's token rows), ``dst`` VMEM ``[heads, piece, D]``.
    ``strided`` (compiled, and Pallas' generic interpreter where it takes a bitcast ref,
    :func:`interpreter_bitcasts_refs`): sublane-strided loads pick one head of
    every token; a 16-bit pair of heads (rows ``2k`` and ``2k + 1``) shares a 32-bit row, as a
    pair of tokens does in ``dst``, so both are read and written as uint32 and the 16-bit halves
    of an even and an odd token are swapped with shifts and masks. Otherwise (the TPU simulator and
    jax 0.10's interpreter, which take no ref bitcast) the piece is loaded whole and transposed as
    a value.
    """
    piece, dim = dst.shape[1], dst.shape[2]
    if valid == 0:
        dst[...] = jnp.zeros(dst.shape, dst.dtype)
        return
    if not strided:
        x = src[...].reshape(piece, heads, dim).swapaxes(0, 1)
        keep = lax.broadcasted_iota(jnp.int32, x.shape, 1) < valid
        dst[...] = x if valid == piece else jnp.where(keep, x, jnp.zeros_like(x))
        return
    packing = 4 // jnp.dtype(src.dtype).itemsize
    if packing == 1:
        keep = lax.broadcasted_iota(jnp.int32, (piece, dim), 0) < valid
        for h in range(heads):
            rows = src[pl.ds(h, piece, stride=heads), :]
            dst[h] = rows if valid == piece else jnp.where(keep, rows, jnp.zeros_like(rows))
        return
    if packing != 2:
        raise ValueError(f"the token view takes 16- or 32-bit pools, got {src.dtype}")
    words, out = src.bitcast(jnp.uint32), dst.bitcast(jnp.uint32)  # [piece * H / 2, D], [H, piece / 2, D]
    pairs, half = piece // 2, heads // 2
    pair = lax.broadcasted_iota(jnp.int32, (pairs, dim), 0)
    low, high = jnp.uint32(0xFFFF), jnp.uint32(0xFFFF0000)
    keep = jnp.where(2 * pair + 1 < valid, jnp.uint32(0xFFFFFFFF),
                     jnp.where(2 * pair < valid, low, jnp.uint32(0)))
    for k in range(half):
        even = words[pl.ds(k, pairs, stride=heads), :]         # heads 2k, 2k+1 of tokens 2j
        odd = words[pl.ds(half + k, pairs, stride=heads), :]   # ... of tokens 2j + 1
        first = (even & low) | (odd << 16)                     # head 2k of tokens 2j, 2j + 1
        second = (even >> 16) | (odd & high)                   # head 2k + 1
        out[2 * k] = first if valid == piece else first & keep
        out[2 * k + 1] = second if valid == piece else second & keep


def _token_kernel(ids_ref, k_src, v_src, k_in, v_in, k_pool, v_pool, inbuf, outbuf, in_sems,
                  out_sems, pending, *, ppf: int, tokens_per_frame: int, piece: int,
                  strided: bool):
    """Refs: ``ids_ref`` SMEM int32 ``[N]`` (0 = skip); in HBM the chunk as token rows
    ``[L, R * F, T * H, D]`` per pool, the pool inputs (aliased, unused) and outputs
    ``[L, H, P, S, D]``; scratch ``inbuf`` ``[2, piece * H, D]`` and ``outbuf`` ``[2, H, piece, D]``
    (slot 0 K, slot 1 V), DMA semaphores ``in_sems``/``out_sems`` ``[2]`` and SMEM ``pending``
    ``[2]`` (an out DMA of that slot not yet waited for).

    Unit ``u`` is page ``u // L`` of the chunk at layer ``u % L``; its jobs are its pieces, K then
    V. A job waits for its piece, starts the next job's (the first of the next unit at the last
    job, whatever that unit is), waits for its slot's previous out DMA, reorders and starts its
    out DMA. Every page slot is written: a frame's last page gets zeros past the frame's tokens.
    """
    num_layers, heads, block_size = k_pool.shape[0], k_pool.shape[1], k_pool.shape[3]
    num = ids_ref.shape[0]
    units = num * num_layers
    last_valid = tokens_per_frame - (ppf - 1) * block_size
    jobs = [(p, kv) for p in range(block_size // piece) for kv in range(2)]
    pending[0], pending[1] = 0, 0

    def where(u):
        i = lax.div(u, num_layers)
        return i, lax.rem(u, num_layers), ids_ref[i]

    def kinds(i):
        """``(is this page's kind, valid tokens of its pages)`` for each kind a page may have."""
        if ppf == 1 or last_valid == block_size:  # Every page alike.
            return [(True, last_valid)]
        is_last = lax.rem(i, ppf) == ppf - 1
        return [(is_last, last_valid), (jnp.logical_not(is_last), block_size)]

    def piece_valid(valid: int, p: int) -> int:
        return min(max(valid - p * piece, 0), piece)

    def in_copy(i, layer, job, valid: int):
        p, kv = jobs[job]
        n = piece_valid(valid, p)
        frame, start = lax.div(i, ppf), lax.rem(i, ppf) * block_size + p * piece
        src = (k_src, v_src)[kv]
        return pltpu.make_async_copy(src.at[layer, frame, pl.ds(start * heads, n * heads)],
                                     inbuf.at[kv, pl.ds(0, n * heads)], in_sems.at[kv])

    def out_copy(page, layer, job):
        p, kv = jobs[job]
        pool = (k_pool, v_pool)[kv]
        return pltpu.make_async_copy(outbuf.at[kv], pool.at[layer, :, page, pl.ds(p * piece, piece)],
                                     out_sems.at[kv])

    def start_first_job(u):
        """Starts the first job's piece of unit ``u`` (if it exists and its page is written)."""
        @pl.when(u < units)
        def _():
            i, layer, page = where(jnp.minimum(u, units - 1))
            for is_kind, valid in kinds(i):
                pl.when(is_kind & (page != 0))(lambda valid=valid: in_copy(i, layer, 0, valid).start())

    def unit_body(u, i, layer, page, valid: int):
        for job, (p, kv) in enumerate(jobs):
            n = piece_valid(valid, p)
            if n:
                in_copy(i, layer, job, valid).wait()
            if job + 1 < len(jobs):
                if piece_valid(valid, jobs[job + 1][0]):
                    in_copy(i, layer, job + 1, valid).start()
            else:
                start_first_job(u + 1)

            # The slot's last out DMA has this one's size.
            pl.when(pending[kv] != 0)(lambda job=job: out_copy(page, layer, job).wait())

            _reorder(inbuf.at[kv], outbuf.at[kv], n, heads, strided)
            out_copy(page, layer, job).start()
            pending[kv] = 1

    start_first_job(0)

    @pl.loop(0, units)
    def _(u):
        i, layer, page = where(u)
        for is_kind, valid in kinds(i):
            pl.when(is_kind & (page != 0))(lambda valid=valid: unit_body(u, i, layer, page, valid))
        pl.when(page == 0)(lambda: start_first_job(u + 1))

    for kv in range(2):
        pl.when(pending[kv] != 0)(lambda kv=kv: out_copy(0, 0, kv).wait())


@functools.cache
def interpreter_bitcasts_refs() -> bool:
    """Whether Pallas' generic interpreter takes a bitcast ref (jax 0.12 does; 0.10.2 raises
    ``NotImplementedError`` discharging it): the ``"token"`` view's strided reorder needs one."""
    def kernel(x_ref, o_ref):
        o_ref.bitcast(jnp.uint32)[...] = x_ref.bitcast(jnp.uint32)[...]

    x = jax.ShapeDtypeStruct((16, 128), jnp.bfloat16)
    call = pl.pallas_call(kernel, out_shape=x, interpret=True)
    try:
        jax.jit(call).lower(x)
    except NotImplementedError:
        return False
    return True


def _write_token_view(k_pool, v_pool, k_frames, v_frames, ids, ppf: int, interpret: Any):
    geom = pool_geometry(k_pool)
    num_layers, frames, tokens, heads, dim = k_frames.shape
    piece = token_piece(geom.block_size, heads, dim, k_pool.dtype.itemsize)

    def rows(chunk):  # [L, R * F, T, H, D] -> [L, R * F, T * H, D]: the same bytes row-major.
        return chunk.reshape(num_layers, frames, tokens * heads, dim)

    scratch = [pltpu.VMEM((2, piece * heads, dim), k_pool.dtype),
               pltpu.VMEM((2, heads, piece, dim), k_pool.dtype),
               pltpu.SemaphoreType.DMA((2,)), pltpu.SemaphoreType.DMA((2,)),
               pltpu.SMEM((2,), jnp.int32)]
    vmem = 4 * piece * heads * dim * k_pool.dtype.itemsize
    strided = not interpret or (interpret is True and interpreter_bitcasts_refs())
    kernel = functools.partial(_token_kernel, ppf=ppf, tokens_per_frame=tokens, piece=piece, strided=strided)
    return paged_write_call(kernel, ids, [rows(k_frames), rows(v_frames), k_pool, v_pool], scratch,
                            interpret, vmem_limit=vmem + (8 << 20))


# ------------------------------------------------------------------------------------------------
# Entry
# ------------------------------------------------------------------------------------------------


def paged_write_call(kernel, ids, operands, scratch, interpret: Any, vmem_limit: int | None = None,
                     outputs: int = 2):
    """The grid-less ``pallas_call`` of ``kernel`` named ``paged_write_tpu``: ``ids``
    scalar-prefetched, every operand in HBM, the last ``outputs`` (the pools' arrays) aliased to
    the outputs, in order."""
    pools = operands[-outputs:]
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    first_pool = len(operands) - outputs + 1  # Operand indices count the prefetched ids (operand 0).
    params = {} if vmem_limit is None else dict(
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=vmem_limit))
    return pl.pallas_call(
        kernel,  # Fresh per call (jax #40847).
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(), in_specs=[any_spec] * len(operands),
            out_specs=[any_spec] * outputs, scratch_shapes=scratch),
        out_shape=[jax.ShapeDtypeStruct(pool.shape, pool.dtype) for pool in pools],
        input_output_aliases={first_pool + n: n for n in range(outputs)},
        interpret=interpret,
        name="paged_write_tpu",
        **params,
    )(ids, *operands)


def write_chunk(k_pool, v_pool, k_frames, v_frames, ids, ppf: int, interpret: Any,
                view: str | None = None):
    """``(k_pool, v_pool)`` with page ``i`` of the chunk written at page ``ids[i]`` (0 skips).

    ``k_frames``/``v_frames`` are the unpadded chunk as ``[L, R * F, T, H, D]``; ``ids`` flat int32
    ``[R * F * ppf]`` with skipped entries already 0; ``interpret`` as for ``pl.pallas_call``;
    ``view`` ``"head"`` or ``"token"`` (default :func:`chunk_view`; ``"token"`` needs ``H`` and
    the block size multiples of :data:`TOKEN_ROWS`). The outputs alias the pool operands.

    Raises:
      ValueError: an unknown ``view``, or ``"token"`` at a shape it does not take.
    """
    block_size = pool_geometry(k_pool).block_size
    view = chunk_view(k_frames.shape, k_frames.dtype, block_size) if view is None else view
    if view == "token":
        if k_frames.shape[3] % TOKEN_ROWS or block_size % TOKEN_ROWS:
            raise ValueError(f"the token view needs kv_heads and block_size multiples of "
                             f"{TOKEN_ROWS}, got {k_frames.shape[3]} and {block_size}")
        return _write_token_view(k_pool, v_pool, k_frames, v_frames, ids, ppf, interpret)
    if view != "head":
        raise ValueError(f"view must be 'head' or 'token', got {view!r}")
    return _write_head_view(k_pool, v_pool, k_frames, v_frames, ids, ppf, interpret)
