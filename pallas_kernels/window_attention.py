"""Paged window attention: the current chunk attends to its visible history pages, itself and extras.

One call computes, for every row (a request slot: one session x KV branch), plain bidirectional softmax
attention of the chunk's queries over

* the row's visible history tokens, read from the paged K/V pools through the row's page list,
* every token of the current chunk (``k_cur``/``v_cur``, passed directly, never written to the pool),
* every extra register token (``extra_k``/``extra_v``, e.g. action/state tokens), if given.

No causal mask (the seed's semantics: ``causal=False``); the only masking is which history slots hold
valid tokens. Denoise steps are read-only: the pools are never written.

Shapes and units (``rows`` rows, token counts in tokens, page counts in pages):

=====================  ==============================================================  ===========
``q``                  ``[rows, q_len, num_q_heads, head_dim]``                        f32/bf16/f16
``k_cur``, ``v_cur``   ``[rows, cur_len, kv_heads, head_dim]`` (``cur_len >= 1``)      as ``q``
``extra_k/_v``         ``[rows, num_extra, kv_heads, head_dim]``, all valid            as ``q``
``k_pool``, ``v_pool`` ``[num_layers, num_pages, block_size, kv_heads, head_dim]``     as ``q``
``pages``              int32 ``[rows, max_pages]``: page ids into the pools (0 = null)
``lengths``            int32 ``[rows]``: valid history tokens, in ``[0, capacity]``
``layer``              int32 scalar (may be traced): which layer of the stacked pools
output                 ``[rows, q_len, num_q_heads, head_dim]``, ``q``'s dtype
=====================  ==============================================================  ===========

``num_q_heads`` is a multiple of ``kv_heads`` (GQA: query head ``h`` reads KV head
``h // (num_q_heads // kv_heads)``). The softmax scale defaults to ``head_dim ** -0.5``; logits,
softmax statistics and the output accumulator are float32.

Frame-aligned pages: a frame of ``tokens_per_frame`` tokens (default ``block_size``) fills
``pages_per_frame = ceil(tokens_per_frame / block_size)`` consecutive page-list entries; the last page
of each frame ends in ``pages_per_frame * block_size - tokens_per_frame`` padding slots. The key at
page-list slot ``s`` (entry ``s // block_size``, offset ``s % block_size``) belongs to frame
``f = s // (pages_per_frame * block_size)`` at in-frame offset ``o = s % (pages_per_frame * block_size)``
and is valid iff ``o < tokens_per_frame`` and ``f * tokens_per_frame + o < lengths[row]``. A page list of
``max_pages`` entries holds at most ``history_capacity(max_pages, block_size, tokens_per_frame)`` tokens.

Masked keys and values are removed by selection (``jnp.where``), never by multiplying with a 0/1
mask, so NaN in free or foreign pages, in frame padding or past a row's length cannot reach the
output. Page-list entries past the last page holding a valid token are replaced by the layer's null
page before any read, and the Pallas kernels do not visit pages past it (the TPU kernel reads one null
page for a row without history).

Backends (``backend=``, see :mod:`pallas_kernels.backend`):

``xla``
    Gathers the row's history tokens by position straight from the layer (one gather through the
    page table, no layer copy, frame padding skipped), concatenates the current chunk and extras
    and runs dense attention with float32 logits and softmax. The length mask is folded into the
    QK matmul as one extra feature (see ``_xla_window_attention``). The CPU default.
``pallas_tpu`` (``_interpret``, ``_simulate``)
    Mosaic kernel. Grid ``(rows, query blocks, max_pages + tail blocks)``; the page table (with the
    layer folded in), the per-row visible page counts and the lengths are scalar-prefetched; each
    history step brings one whole page ``[block_size, kv_heads, head_dim]`` of K and of V into VMEM
    through a ``BlockSpec`` whose ``index_map`` reads the page table (Pallas double-buffers it). Past a
    row's last visible page the index map repeats that page, so no further DMA is issued, and the
    compute is skipped with ``pl.when``. The tail steps read the current chunk + extras the same way.
    An online (flash) softmax keeps ``m``, ``l`` and the accumulator for all query heads of the block in
    VMEM scratch. Only whole pages are DMA'd: a per-KV-head block would put a squeezed dimension in
    the second-minor position of the pool, which Mosaic's block rules forbid. Wrapper-side layout
    changes touch only ``q``, the output and the (small) tail, never the pool, apart from merging
    its two leading axes (a free reshape). Efficiency on a real TPU wants ``block_size >= 128``:
    each grid step handles one page.
``pallas_gpu`` (``_interpret``)
    Triton-backend ``pallas_call``: one program per (row, query head, query block); the key loop walks
    the row's visible pages ``block_k`` slots at a time, gathering K/V rows through the page table with
    pointer indexing (any ``block_size``), then the tail. Triton rather than Mosaic GPU because the
    Triton lowering is the GPU path whose semantics the CPU interpreter checks faithfully (block
    programs, gathers, masked loops) and it compiles for Ampere as well as Hopper; a Mosaic GPU
    kernel (``plgpu.kernel`` + warpgroup pipelines, TMA gathers) has Hopper-specific layout, swizzle
    and barrier constraints that interpret mode does not check, so without a GPU to test on it would
    ship unverified. Deprecation status: the Pallas Changelog "Released with JAX 0.11.0" says "The
    Triton backend is deprecated and will be removed in a future version of JAX" (Mosaic GPU is the
    maintained GPU path; ``jax.experimental.pallas.ops.gpu`` Triton ops are deprecated in favour of
    tokamax). It still ships in 0.11; a Mosaic GPU port is the follow-up when Triton is removed.
    Requires power-of-two ``head_dim`` >= 16.

:func:`window_attention_reference` is the pure-jnp reference the tests compare against: it
materialises every history token by its logical position, masks and takes a plain softmax.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.backend import resolve_backend

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
"""Finite logit for masked keys: exp(MASK_VALUE - m) is exactly 0 and no inf - inf NaN can arise."""

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

_DEFAULT_BLOCK_Q = 128
_DEFAULT_BLOCK_K_GPU = 64
_DEFAULT_BLOCK_K_TPU = 512


@dataclasses.dataclass(frozen=True)
class WindowGeometry:
    """Static sizes of one window-attention call (hashable: a ``jit`` static argument).

    Token counts in tokens, page counts in pages, ``block_size`` in tokens per page.
    """

    rows: int
    q_len: int
    num_q_heads: int
    kv_heads: int
    head_dim: int
    cur_len: int
    num_extra: int
    num_layers: int
    num_pages: int
    block_size: int
    max_pages: int
    tokens_per_frame: int

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.num_q_heads // self.kv_heads

    @property
    def pages_per_frame(self) -> int:
        return -(-self.tokens_per_frame // self.block_size)

    @property
    def frame_slots(self) -> int:
        """Page-list slots one frame occupies (tokens plus padding)."""
        return self.pages_per_frame * self.block_size

    @property
    def tail_len(self) -> int:
        """Current-chunk plus extra tokens: keys that are always valid."""
        return self.cur_len + self.num_extra

    @property
    def capacity(self) -> int:
        """Most history tokens the page list can hold."""
        return history_capacity(self.max_pages, self.block_size, self.tokens_per_frame)


def history_capacity(max_pages: int, block_size: int, tokens_per_frame: int) -> int:
    """Valid tokens that fit in ``max_pages`` frame-aligned pages of ``block_size`` slots."""
    pages_per_frame = -(-tokens_per_frame // block_size)
    full_frames, rest_pages = divmod(max_pages, pages_per_frame)
    return full_frames * tokens_per_frame + min(rest_pages * block_size, tokens_per_frame)


def visible_page_count(lengths: jax.Array, geom: WindowGeometry) -> jax.Array:
    """int32 ``[rows]``: page-list entries up to and including the last one holding a valid token."""
    lengths = lengths.astype(jnp.int32)
    frames, offset = lengths // geom.tokens_per_frame, lengths % geom.tokens_per_frame
    slots = frames * geom.frame_slots + offset
    return (slots + geom.block_size - 1) // geom.block_size


def history_slot_valid(slots: jax.Array, lengths: jax.Array, geom: WindowGeometry) -> jax.Array:
    """Whether page-list slot ``slots`` holds a valid token of a row with ``lengths`` history tokens.

    ``slots`` and ``lengths`` are non-negative int32 arrays that broadcast together.
    """
    frame, offset = lax.div(slots, geom.frame_slots), lax.rem(slots, geom.frame_slots)
    return (offset < geom.tokens_per_frame) & (frame * geom.tokens_per_frame + offset < lengths)


def layer_page_table(pages: jax.Array, lengths: jax.Array, layer: jax.Array,
                     geom: WindowGeometry) -> jax.Array:
    """int32 ``[rows, width]`` (``pages``' shape): page ids into the pool reshaped to
    ``[layers * pages, ...]``, i.e. ``layer * num_pages + page``.

    Entries past a row's visible pages point at the layer's null page, so no kernel reads a page the
    row does not use.
    """
    entry = jnp.arange(pages.shape[1], dtype=jnp.int32)[None, :]
    used = entry < visible_page_count(lengths, geom)[:, None]
    return jnp.where(used, pages.astype(jnp.int32), 0) + layer * geom.num_pages


# ------------------------------------------------------------------------------------------------
# Public API
# ------------------------------------------------------------------------------------------------


def window_attention(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, *, layer=0, extra_k=None,
                     extra_v=None, scale=None, tokens_per_frame=None, backend="auto",
                     block_q=None, block_k=None):
    """Attention of the current chunk over its visible history pages, itself and extra tokens.

    Args:
      q: ``[rows, q_len, num_q_heads, head_dim]`` queries (f32, bf16 or f16).
      k_cur, v_cur: ``[rows, cur_len, kv_heads, head_dim]`` the current chunk's keys/values.
      k_pool, v_pool: ``[num_layers, num_pages, block_size, kv_heads, head_dim]`` paged pools (read
        only; page 0 is the null page).
      pages: int ``[rows, max_pages]`` each row's page list (frame after frame, unused entries 0).
      lengths: int ``[rows]`` valid history tokens per row, in ``[0, capacity]``.
      layer: int scalar, possibly traced: the pool layer to read.
      extra_k, extra_v: optional ``[rows, num_extra, kv_heads, head_dim]`` register tokens (both or
        neither).
      scale: softmax scale; defaults to ``head_dim ** -0.5``.
      tokens_per_frame: tokens per frame; defaults to ``block_size``.
      backend: a name from :data:`pallas_kernels.backend.BACKEND_NAMES`.
      block_q: query tile (Pallas backends); default 128, shrunk for short chunks.
      block_k: key tile in tokens: GPU key block (power of two >= 16, default 64) or TPU tail block
        (default 512); history pages are always whole pages on TPU.

    Returns:
      ``[rows, q_len, num_q_heads, head_dim]`` in ``q``'s dtype.

    Raises:
      ValueError: a bad shape, dtype, head count, page id, length, layer, frame size or tile size;
        the message names the value and the allowed range. Value checks run when the inputs are
        concrete (not traced).
    """
    geom = check_inputs(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, layer=layer,
                        extra_k=extra_k, extra_v=extra_v, tokens_per_frame=tokens_per_frame)
    resolved = resolve_backend(backend)
    kind = resolved.kind
    scale = _check_scale(geom.head_dim ** -0.5 if scale is None else scale)
    layer = jnp.asarray(layer, jnp.int32)
    if kind == "xla":
        return _xla_window_attention(q, k_cur, v_cur, extra_k, extra_v, k_pool, v_pool, pages,
                                     lengths, layer, geom=geom, scale=scale)
    block_q = _check_tile("block_q", block_q, _DEFAULT_BLOCK_Q, geom.q_len, kind)
    if kind == "pallas_tpu":
        block_k = _check_tile("block_k", block_k, _DEFAULT_BLOCK_K_TPU, geom.tail_len, kind)
        return _tpu_window_attention(q, k_cur, v_cur, extra_k, extra_v, k_pool, v_pool, pages,
                                     lengths, layer, geom=geom, scale=scale, block_q=block_q,
                                     block_t=block_k, backend=resolved.name)
    _check_gpu_head_dim(geom.head_dim)
    block_k = _check_tile("block_k", block_k, _DEFAULT_BLOCK_K_GPU, geom.tail_len, kind)
    return _gpu_window_attention(q, k_cur, v_cur, extra_k, extra_v, k_pool, v_pool, pages,
                                 lengths, layer, geom=geom, scale=scale, block_q=block_q,
                                 block_k=block_k, backend=resolved.name)


def window_attention_reference(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, *, layer=0,
                               extra_k=None, extra_v=None, scale=None, tokens_per_frame=None):
    """Pure-jnp reference of :func:`window_attention` (same arguments, no backend): slow and simple.

    Every history token is fetched by its logical position ``t < lengths[row]`` (frame ``t // tpf``,
    in-frame offset ``t % tpf``, hence page-list slot ``frame * pages_per_frame * block_size +
    offset``), then all keys are concatenated, masked and passed through a float32 softmax.
    """
    geom = check_inputs(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, layer=layer,
                        extra_k=extra_k, extra_v=extra_v, tokens_per_frame=tokens_per_frame)
    scale = geom.head_dim ** -0.5 if scale is None else scale
    f32 = jnp.float32
    tokens = jnp.arange(geom.max_pages * geom.block_size, dtype=jnp.int32)
    valid = tokens[None, :] < lengths.astype(jnp.int32)[:, None]
    slot = jnp.where(valid, (tokens // geom.tokens_per_frame) * geom.frame_slots
                     + tokens % geom.tokens_per_frame, 0)
    page = jnp.take_along_axis(pages.astype(jnp.int32), slot // geom.block_size, axis=1)
    k_hist = k_pool[layer][page, slot % geom.block_size]
    v_hist = v_pool[layer][page, slot % geom.block_size]
    keys = [k_hist, k_cur] + ([] if extra_k is None else [extra_k])
    values = [v_hist, v_cur] + ([] if extra_v is None else [extra_v])
    k = jnp.repeat(jnp.concatenate(keys, axis=1).astype(f32), geom.group, axis=2)
    v = jnp.repeat(jnp.concatenate(values, axis=1).astype(f32), geom.group, axis=2)
    mask = jnp.concatenate([valid, jnp.ones((geom.rows, geom.tail_len), bool)], axis=1)
    logits = jnp.einsum("rqhd,rkhd->rhqk", q.astype(f32), k, precision=lax.Precision.HIGHEST)
    logits = jnp.where(mask[:, None, None, :], logits * scale, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    v = jnp.where(mask[:, :, None, None], v, 0.0)
    out = jnp.einsum("rhqk,rkhd->rqhd", probs, v, precision=lax.Precision.HIGHEST)
    return out.astype(q.dtype)


# ------------------------------------------------------------------------------------------------
# Validation (host side)
# ------------------------------------------------------------------------------------------------


def check_inputs(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, *, layer=0, extra_k=None,
                 extra_v=None, tokens_per_frame=None) -> WindowGeometry:
    """Validates shapes, dtypes and head counts always, values when concrete; returns the geometry.

    Raises:
      ValueError: naming the bad value and the allowed range.
    """
    geom = _check_shapes(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, extra_k, extra_v,
                         tokens_per_frame)
    _check_dtypes(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, extra_k, extra_v)
    _check_values(pages, lengths, layer, geom)
    return geom


def _check_shapes(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, extra_k, extra_v,
                  tokens_per_frame) -> WindowGeometry:
    _check_rank("q", q, 4, "[rows, q_len, num_q_heads, head_dim]")
    _check_rank("k_cur", k_cur, 4, "[rows, cur_len, kv_heads, head_dim]")
    _check_rank("k_pool", k_pool, 5, "[num_layers, num_pages, block_size, kv_heads, head_dim]")
    _check_rank("pages", pages, 2, "[rows, max_pages]")
    _check_rank("lengths", lengths, 1, "[rows]")
    rows, q_len, num_q_heads, head_dim = q.shape
    _, cur_len, kv_heads, _ = k_cur.shape
    num_layers, num_pages, block_size, _, _ = k_pool.shape
    _same_shape("v_cur", v_cur, "k_cur", k_cur)
    _same_shape("v_pool", v_pool, "k_pool", k_pool)
    if (extra_k is None) != (extra_v is None):
        raise ValueError("extra_k and extra_v must be given together (both or neither); got "
                         f"extra_k={'None' if extra_k is None else 'an array'}, "
                         f"extra_v={'None' if extra_v is None else 'an array'}")
    num_extra = 0
    if extra_k is not None:
        _check_rank("extra_k", extra_k, 4, "[rows, num_extra, kv_heads, head_dim]")
        _same_shape("extra_v", extra_v, "extra_k", extra_k)
        num_extra = extra_k.shape[1]
        _expect("extra_k", extra_k.shape, (rows, num_extra, kv_heads, head_dim))
    _expect("k_cur", k_cur.shape, (rows, cur_len, kv_heads, head_dim))
    _expect("k_pool", k_pool.shape, (num_layers, num_pages, block_size, kv_heads, head_dim))
    _expect("pages", pages.shape, (rows, pages.shape[1]))
    _expect("lengths", lengths.shape, (rows,))
    if min(rows, q_len, cur_len, head_dim, kv_heads, num_layers, num_pages, block_size) < 1:
        raise ValueError("rows, q_len, cur_len, heads, head_dim, num_layers, num_pages and "
                         f"block_size must all be >= 1; got q {q.shape}, k_cur {k_cur.shape}, "
                         f"k_pool {k_pool.shape}")
    if num_q_heads % kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} (q.shape[2]) must be a positive multiple of "
                         f"kv_heads={kv_heads} (k_cur.shape[2])")
    tokens_per_frame = block_size if tokens_per_frame is None else tokens_per_frame
    if not isinstance(tokens_per_frame, (int, np.integer)) or tokens_per_frame < 1:
        raise ValueError(f"tokens_per_frame must be an int >= 1 (frames fill "
                         f"ceil(tokens_per_frame / block_size={block_size}) pages); got "
                         f"{tokens_per_frame!r}")
    return WindowGeometry(rows, q_len, num_q_heads, kv_heads, head_dim, cur_len, num_extra,
                          num_layers, num_pages, block_size, pages.shape[1], int(tokens_per_frame))


def _check_dtypes(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, extra_k, extra_v) -> None:
    if jnp.dtype(q.dtype) not in SUPPORTED_DTYPES:
        raise ValueError(f"q.dtype must be one of {[d.name for d in SUPPORTED_DTYPES]}, "
                         f"got {jnp.dtype(q.dtype).name}")
    named = {"k_cur": k_cur, "v_cur": v_cur, "k_pool": k_pool, "v_pool": v_pool,
             "extra_k": extra_k, "extra_v": extra_v}
    for name, x in named.items():
        if x is not None and x.dtype != q.dtype:
            raise ValueError(f"{name}.dtype must equal q.dtype={jnp.dtype(q.dtype).name}, got "
                             f"{jnp.dtype(x.dtype).name}")
    for name, x in (("pages", pages), ("lengths", lengths)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array (int32), got dtype "
                             f"{jnp.dtype(x.dtype).name}")


def _check_values(pages, lengths, layer, geom: WindowGeometry) -> None:
    if jnp.ndim(layer) != 0:
        raise ValueError(f"layer must be an int scalar, got shape {jnp.shape(layer)}")
    if _is_concrete(layer):
        layer_value = int(np.asarray(layer))
        if not 0 <= layer_value < geom.num_layers:
            raise ValueError(f"layer={layer_value} is out of range; allowed [0, {geom.num_layers}) "
                             "(k_pool.shape[0])")
    if _is_concrete(pages):
        table = np.asarray(pages)
        bad = np.argwhere((table < 0) | (table >= geom.num_pages))
        if bad.size:
            r, s = bad[0]
            raise ValueError(f"pages[{r}, {s}]={table[r, s]} is not a page id; allowed "
                             f"[0, {geom.num_pages}) (k_pool.shape[1])")
    if _is_concrete(lengths):
        lens = np.asarray(lengths)
        bad = np.flatnonzero((lens < 0) | (lens > geom.capacity))
        if bad.size:
            r = bad[0]
            raise ValueError(
                f"lengths[{r}]={lens[r]} is out of range; allowed [0, {geom.capacity}] (the "
                f"capacity of {geom.max_pages} pages of {geom.block_size} slots at "
                f"tokens_per_frame={geom.tokens_per_frame})")


def _check_tile(name: str, value, default: int, extent: int, kind: str) -> int:
    """A tile size: the given one (validated) or the default shrunk to the extent it tiles."""
    if value is None:
        if kind == "pallas_gpu":
            return max(16, min(default, pl.next_power_of_2(extent)))
        return min(default, _round_up(extent, 8))
    if kind == "pallas_gpu" and (value < 16 or value & (value - 1)):
        raise ValueError(f"{name}={value} must be a power of two >= 16 for the GPU kernel")
    if kind == "pallas_tpu" and (value < 8 or value % 8):
        raise ValueError(f"{name}={value} must be a positive multiple of 8 for the TPU kernel")
    return int(value)


def _check_scale(scale) -> float:
    if not isinstance(scale, (int, float, np.floating)) or not 0 < scale < math.inf:
        raise ValueError(f"scale must be a positive finite number (a Python float), got {scale!r}")
    return float(scale)


def _check_gpu_head_dim(head_dim: int) -> None:
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim={head_dim} is not supported by the GPU kernel; allowed: powers "
                         "of two >= 16 (use backend='xla' otherwise)")


def _check_rank(name, x, rank, layout) -> None:
    if not hasattr(x, "shape") or len(x.shape) != rank:
        got = getattr(x, "shape", type(x).__name__)
        raise ValueError(f"{name} must have rank {rank} {layout}, got shape {got}")


def _same_shape(name, x, ref_name, ref) -> None:
    if not hasattr(x, "shape") or tuple(x.shape) != tuple(ref.shape):
        raise ValueError(f"{name}.shape must equal {ref_name}.shape={tuple(ref.shape)}, got "
                         f"{getattr(x, 'shape', type(x).__name__)}")


def _expect(name, shape, expected) -> None:
    if tuple(shape) != tuple(expected):
        raise ValueError(f"{name}.shape={tuple(shape)} does not match q, k_cur and k_pool: "
                         f"expected {tuple(expected)}")


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


# ------------------------------------------------------------------------------------------------
# Shared pieces
# ------------------------------------------------------------------------------------------------


def _tail_kv(k_cur, v_cur, extra_k, extra_v, padded_len: int):
    """Current chunk + extras as ``[rows, padded_len, kv_heads, head_dim]`` K and V, zero padded."""
    pad = padded_len - k_cur.shape[1] - (0 if extra_k is None else extra_k.shape[1])
    zeros = jnp.zeros((k_cur.shape[0], pad, *k_cur.shape[2:]), k_cur.dtype)
    k_parts = [k_cur] + ([] if extra_k is None else [extra_k]) + [zeros]
    v_parts = [v_cur] + ([] if extra_v is None else [extra_v]) + [zeros]
    return jnp.concatenate(k_parts, axis=1), jnp.concatenate(v_parts, axis=1)


def _matmul_precision(dtype):
    """Full float32 products for f32 inputs (no TF32/bf16 passes); native for half types."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def _online_softmax_step(m_prev, l_prev, acc_prev, q, k, v, valid_row, valid_col, scale):
    """One flash-attention update over a key block.

    Args:
      m_prev, l_prev: ``[bq, 1]`` f32 running max and normaliser; acc_prev ``[bq, D]`` f32.
      q: ``[bq, D]``; k, v: ``[bk, D]``; valid_row ``[1, bk]`` and valid_col ``[bk, 1]``: the same key
        mask in both orientations (masked keys may hold NaN: they are selected away, not multiplied).

    Returns:
      the updated ``(m, l, acc)``.
    """
    precision = _matmul_precision(q.dtype)
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                        preferred_element_type=jnp.float32) * scale
    s = jnp.where(valid_row, s, MASK_VALUE)
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    p = jnp.where(valid_row, jnp.exp(s - m_new), 0.0)
    alpha = jnp.exp(m_prev - m_new)
    v = jnp.where(valid_col, v, jnp.zeros_like(v))
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)
    return m_new, alpha * l_prev + jnp.sum(p, axis=1, keepdims=True), alpha * acc_prev + pv


# ------------------------------------------------------------------------------------------------
# XLA path
# ------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("geom", "scale"))
def _xla_window_attention(q, k_cur, v_cur, extra_k, extra_v, k_pool, v_pool, pages, lengths, layer,
                          *, geom: WindowGeometry, scale: float):
    """Gather the visible history tokens of ``layer``, append the tail, dense attention.

    History token ``t`` (frame ``t // tpf``, offset ``t % tpf``) is read from page-list slot
    ``frame * frame_slots + offset`` for ``t < capacity``: frame padding is never read or attended.

    The key mask rides in the matmul: keys get one extra feature (0 if valid, the dtype's most
    negative finite value, about ``-3.4e38``, if not) and queries a matching feature of 1, so masked
    logits leave the einsum at ``-3.4e38 * scale`` and no pass over the ``[q, k]`` logits is spent on
    masking (on CPU such a pass costs ~40 % of the attention). f16 is computed in f32 after the
    gather (its most negative value, -65504, is too small for this). Masked K and V slots are first
    replaced by zeros with ``jnp.where``, so NaN in them never reaches a product.
    """
    rows, dtype = geom.rows, (jnp.float32 if q.dtype == jnp.float16 else q.dtype)
    table = layer_page_table(pages, lengths, 0, geom)
    token = jnp.arange(geom.capacity, dtype=jnp.int32)
    slot = (token // geom.tokens_per_frame) * geom.frame_slots + token % geom.tokens_per_frame
    page, offset = table[:, slot // geom.block_size], slot % geom.block_size
    valid = token[None, :] < lengths.astype(jnp.int32)[:, None]

    def history(pool):
        return jnp.where(valid[:, :, None, None], pool[layer, page, offset], 0).astype(dtype)

    k_tail, v_tail = _tail_kv(k_cur, v_cur, extra_k, extra_v, geom.tail_len)
    mask_feature = jnp.concatenate(
        [jnp.where(valid, 0, jnp.finfo(dtype).min).astype(dtype),
         jnp.zeros((rows, geom.tail_len), dtype)], axis=1)
    mask_feature = jnp.broadcast_to(mask_feature[:, :, None, None],
                                    (rows, geom.capacity + geom.tail_len, geom.kv_heads, 1))
    k = jnp.concatenate([history(k_pool), k_tail.astype(dtype)], axis=1)
    k = jnp.concatenate([k, mask_feature], axis=3)
    v = jnp.concatenate([history(v_pool), v_tail.astype(dtype)], axis=1)
    # GQA: fold each KV head's query heads into the query axis: [rows, group * q_len, kv_heads, D].
    grouped = (rows, geom.q_len, geom.kv_heads, geom.group, geom.head_dim)
    qg = q.astype(dtype).reshape(grouped).transpose(0, 3, 1, 2, 4).reshape(
        rows, geom.group * geom.q_len, geom.kv_heads, geom.head_dim)
    qg = jnp.concatenate([qg, jnp.ones((*qg.shape[:3], 1), dtype)], axis=3)
    logits = jnp.einsum("rqhd,rkhd->rhqk", qg, k, preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(logits * scale, axis=-1).astype(dtype)
    out = jnp.einsum("rhqk,rkhd->rqhd", probs, v, preferred_element_type=jnp.float32)
    out = out.reshape(rows, geom.group, geom.q_len, geom.kv_heads, geom.head_dim)
    return out.transpose(0, 2, 3, 1, 4).reshape(q.shape).astype(q.dtype)


# ------------------------------------------------------------------------------------------------
# Pallas TPU (Mosaic) kernel
# ------------------------------------------------------------------------------------------------


def _tpu_kernel(table_ref, nvis_ref, len_ref, q_ref, kp_ref, vp_ref, kt_ref, vt_ref, o_ref,
                m_ref, l_ref, acc_ref, *, geom: WindowGeometry, scale: float, block_t: int):
    """Grid step ``(row, q block, key step)``; key steps ``[0, max_pages)`` are history pages, then
    tail blocks of ``block_t`` tokens.

    Refs: ``q_ref``/``o_ref`` ``[Hq, bq, D]``; ``kp_ref``/``vp_ref`` one page ``[block_size, Hkv, D]``;
    ``kt_ref``/``vt_ref`` ``[block_t, Hkv, D]``; scratch ``m_ref``/``l_ref`` ``[Hq, bq, 1]`` and
    ``acc_ref`` ``[Hq, bq, D]`` float32. ``table_ref`` is unused here (read by the index maps).
    """
    del table_ref
    row, step = pl.program_id(0), pl.program_id(2)

    @pl.when(step == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def attend(k_ref, v_ref, valid_row, valid_col):
        for kv_head in range(geom.kv_heads):
            k = k_ref[:, kv_head, :]
            v = v_ref[:, kv_head, :]
            for head in range(kv_head * geom.group, (kv_head + 1) * geom.group):
                m, l, acc = _online_softmax_step(m_ref[head], l_ref[head], acc_ref[head],
                                                 q_ref[head], k, v, valid_row, valid_col, scale)
                m_ref[head], l_ref[head], acc_ref[head] = m, l, acc

    def iotas(n):
        return (lax.broadcasted_iota(jnp.int32, (1, n), 1),
                lax.broadcasted_iota(jnp.int32, (n, 1), 0))

    @pl.when(step < nvis_ref[row])
    def _history_page():
        # Pages are frame aligned: page `step` lies wholly in frame step // pages_per_frame.
        frame = lax.div(step, geom.pages_per_frame)
        first = lax.rem(step, geom.pages_per_frame) * geom.block_size
        masks = [(first + i < geom.tokens_per_frame)
                 & (frame * geom.tokens_per_frame + first + i < len_ref[row])
                 for i in iotas(geom.block_size)]
        attend(kp_ref, vp_ref, *masks)

    @pl.when(step >= geom.max_pages)
    def _tail_block():
        first = (step - geom.max_pages) * block_t
        masks = [first + i < geom.tail_len for i in iotas(block_t)]
        attend(kt_ref, vt_ref, *masks)

    @pl.when(step == pl.num_programs(2) - 1)
    def _finish():
        o_ref[...] = (acc_ref[...] / l_ref[...]).astype(o_ref.dtype)


def _tpu_page_index(row, qb, step, table_ref, nvis_ref, len_ref, *, max_pages: int):
    """Pool block for key step ``step``: its page, or the last visible page once past it (a repeated
    block index issues no DMA). Rows without history read their null page once."""
    del qb, len_ref
    entry = jnp.maximum(jnp.minimum(step, nvis_ref[row] - 1), 0)
    return table_ref[row * max_pages + entry], 0, 0, 0


def _tpu_tail_index(row, qb, step, table_ref, nvis_ref, len_ref, *, max_pages: int):
    del qb, table_ref, nvis_ref, len_ref
    return row, jnp.maximum(step - max_pages, 0), 0, 0


def _tpu_query_index(row, qb, step, table_ref, nvis_ref, len_ref):
    del step, table_ref, nvis_ref, len_ref
    return row, 0, qb, 0


@functools.partial(jax.jit, static_argnames=("geom", "scale", "block_q", "block_t", "backend"))
def _tpu_window_attention(q, k_cur, v_cur, extra_k, extra_v, k_pool, v_pool, pages, lengths, layer,
                          *, geom: WindowGeometry, scale: float, block_q: int, block_t: int,
                          backend: str):
    """Wrapper of :func:`_tpu_kernel`: pads ``q`` to ``block_q`` and transposes it head-major, builds
    the padded tail, folds ``layer`` into the page table and merges the pool's two leading axes."""
    from jax.experimental.pallas import tpu as pltpu

    q_pad, tail_pad = _round_up(geom.q_len, block_q), _round_up(geom.tail_len, block_t)
    q_t = jnp.pad(q, ((0, 0), (0, q_pad - geom.q_len), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
    k_tail, v_tail = _tail_kv(k_cur, v_cur, extra_k, extra_v, tail_pad)
    pool_shape = (geom.num_layers * geom.num_pages, geom.block_size, geom.kv_heads, geom.head_dim)
    table = layer_page_table(pages, lengths, layer, geom).reshape(-1)
    nvis = visible_page_count(lengths, geom)
    num_steps = geom.max_pages + tail_pad // block_t
    q_spec = pl.BlockSpec((None, geom.num_q_heads, block_q, geom.head_dim), _tpu_query_index)
    page_spec = pl.BlockSpec((None, geom.block_size, geom.kv_heads, geom.head_dim),
                             functools.partial(_tpu_page_index, max_pages=geom.max_pages))
    tail_spec = pl.BlockSpec((None, block_t, geom.kv_heads, geom.head_dim),
                             functools.partial(_tpu_tail_index, max_pages=geom.max_pages))
    stats_shape = pltpu.VMEM((geom.num_q_heads, block_q, 1), jnp.float32)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(geom.rows, q_pad // block_q, num_steps),
        in_specs=[q_spec, page_spec, page_spec, tail_spec, tail_spec],
        out_specs=q_spec,
        scratch_shapes=[stats_shape, stats_shape,
                        pltpu.VMEM((geom.num_q_heads, block_q, geom.head_dim), jnp.float32)],
    )
    kernel = functools.partial(_tpu_kernel, geom=geom, scale=scale, block_t=block_t)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(q_t.shape, q.dtype),
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=resolve_backend(backend).interpret,
        name="window_attention_tpu",
    )(table, nvis, lengths.astype(jnp.int32), q_t, k_pool.reshape(pool_shape),
      v_pool.reshape(pool_shape), k_tail, v_tail)
    return out.transpose(0, 2, 1, 3)[:, :geom.q_len]


# ------------------------------------------------------------------------------------------------
# Pallas GPU (Triton) kernel
# ------------------------------------------------------------------------------------------------


def _gpu_kernel(table_ref, nblk_ref, len_ref, q_ref, kp_ref, vp_ref, kt_ref, vt_ref, o_ref, *,
                geom: WindowGeometry, scale: float, block_k: int):
    """Program ``(row, q head, q block)``.

    Refs: ``q_ref``/``o_ref`` ``[bq, D]``; ``kp_ref``/``vp_ref`` the whole pool as rows
    ``[layers * pages * block_size, Hkv, D]``; ``table_ref`` ``[rows, table_len]`` (layer folded in,
    null past the visible pages); ``nblk_ref`` ``[rows]`` history key blocks to visit; ``len_ref``
    ``[rows]``; ``kt_ref``/``vt_ref`` ``[rows, tail_pad, Hkv, D]``.
    """
    row, head = pl.program_id(0), pl.program_id(1)
    kv_head = head // geom.group
    q = q_ref[...]
    length = len_ref[row]
    lane = lax.iota(jnp.int32, block_k)

    def history_block(b, carry):
        slot = b * block_k + lane
        page = table_ref[row, lax.div(slot, geom.block_size)]
        pool_row = page * geom.block_size + lax.rem(slot, geom.block_size)
        valid = history_slot_valid(slot, length, geom)
        return _online_softmax_step(*carry, q, kp_ref[pool_row, kv_head, :],
                                    vp_ref[pool_row, kv_head, :], valid[None, :], valid[:, None],
                                    scale)

    def tail_block(b, carry):
        valid = b * block_k + lane < geom.tail_len
        keys = pl.ds(pl.multiple_of(b * block_k, block_k), block_k)
        return _online_softmax_step(*carry, q, kt_ref[row, keys, kv_head, :],
                                    vt_ref[row, keys, kv_head, :], valid[None, :], valid[:, None],
                                    scale)

    block_q = q.shape[0]
    carry = (jnp.full((block_q, 1), MASK_VALUE, jnp.float32), jnp.zeros((block_q, 1), jnp.float32),
             jnp.zeros((block_q, geom.head_dim), jnp.float32))
    carry = lax.fori_loop(0, nblk_ref[row], history_block, carry)
    _, l, acc = lax.fori_loop(0, kt_ref.shape[1] // block_k, tail_block, carry)
    o_ref[...] = (acc / l).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("geom", "scale", "block_q", "block_k", "backend"))
def _gpu_window_attention(q, k_cur, v_cur, extra_k, extra_v, k_pool, v_pool, pages, lengths, layer,
                          *, geom: WindowGeometry, scale: float, block_q: int, block_k: int,
                          backend: str):
    """Wrapper of :func:`_gpu_kernel`: pads ``q`` to ``block_q``, builds the padded tail, folds
    ``layer`` into the page table (padded with null entries to whole key blocks) and views the pool
    as token rows ``[layers * pages * block_size, kv_heads, head_dim]``."""
    from jax.experimental.pallas import triton as pltriton

    q_pad, tail_pad = _round_up(geom.q_len, block_q), _round_up(geom.tail_len, block_k)
    q_p = jnp.pad(q, ((0, 0), (0, q_pad - geom.q_len), (0, 0), (0, 0)))
    k_tail, v_tail = _tail_kv(k_cur, v_cur, extra_k, extra_v, tail_pad)
    num_rows = geom.num_layers * geom.num_pages * geom.block_size
    pool_shape = (num_rows, geom.kv_heads, geom.head_dim)
    # Pad the table so every visited key block reads whole entries; padding is the null page.
    table_len = -(-_round_up(geom.max_pages * geom.block_size, block_k) // geom.block_size)
    table = layer_page_table(jnp.pad(pages, ((0, 0), (0, table_len - geom.max_pages))), lengths,
                             layer, geom)
    slots = visible_page_count(lengths, geom) * geom.block_size
    nblk = (slots + block_k - 1) // block_k
    io_spec = pl.BlockSpec((None, block_q, None, geom.head_dim),
                           lambda row, head, qb: (row, qb, head, 0))
    whole = pl.BlockSpec()
    kernel = functools.partial(_gpu_kernel, geom=geom, scale=scale, block_k=block_k)
    num_warps = 4 if block_q * geom.head_dim <= 64 * 128 else 8
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(q_p.shape, q.dtype),
        grid=(geom.rows, geom.num_q_heads, q_pad // block_q),
        in_specs=[whole, whole, whole, io_spec, whole, whole, whole, whole],
        out_specs=io_spec,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=resolve_backend(backend).interpret,
        name="window_attention_gpu",
    )(table, nblk, lengths.astype(jnp.int32), q_p, k_pool.reshape(pool_shape),
      v_pool.reshape(pool_shape), k_tail, v_tail)[:, :geom.q_len]
