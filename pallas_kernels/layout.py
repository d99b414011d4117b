"""The K/V pool layout: head-major pages, the one place every module takes it from.

A pool is ``[num_layers, kv_heads, num_pages, block_size, head_dim]`` (:func:`pool_shape`); page
``p`` of a (layer, KV head) is ``pool[layer, head, p]``, a dense ``[block_size, head_dim]`` tile
(:func:`page_index`), and page 0 is the null page, never written and zero-filled. Modules build,
read and index pools only through this module (:func:`pool_shape`, the axis constants,
:func:`read_tokens` / :func:`write_tokens`, :func:`page_mask` / :func:`slot_mask`,
:func:`to_token_major` / :func:`from_token_major`), so a change of layout touches it alone. On TPU
``block_size`` must be a multiple of :data:`SLOT_MULTIPLE` (:func:`tpu_block_size`). Why this layout:
``docs/kernels.md`` (Pool layout).

A quantized pool (int8 or fp8 pages, :mod:`pallas_kernels.quantization`) is a
:class:`QuantizedPool`: the stored values in this layout plus float32 scales ``[num_layers,
kv_heads, num_pages]`` (:data:`SCALE_LAYOUT`, the pool's three major axes), one per page of one
(layer, KV head), covering the page's slots and features (:data:`PAGE_SCALE_AXES`). It is a pytree:
it goes where a pool array goes (jit, donation, ``shard_map`` with :func:`pool_spec_axes` applied to
both, :func:`pool_tree_spec`). Why one scale per page: ``docs/kernels.md`` (Quantized pages).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.checks import require_int
from pallas_kernels.quantization import SCALE_DTYPE, dequantize, is_quantized, quantize

LAYER_AXIS = 0
"""Axis of the layer in a pool."""
KV_HEAD_AXIS = 1
"""Axis of the KV head in a pool (the axis a head-sharded mesh splits)."""
PAGE_AXIS = 2
"""Axis of the page id in a pool."""
SLOT_AXIS = 3
"""Axis of the slot (token) within a page."""
HEAD_DIM_AXIS = 4
"""Axis of the head dimension (minor)."""
POOL_RANK = 5
POOL_LAYOUT = "[num_layers, kv_heads, num_pages, block_size, head_dim]"
"""The pool's axes as written in error messages and docs."""
POOL_AXES = ("layer", "kv_head", "page", "slot", "head_dim")
"""Names of the pool's axes, major to minor."""
SLOT_MULTIPLE = 8
"""``block_size`` must be a multiple of this for XLA:TPU to keep the pool's layout (no copies)."""
SCALE_RANK = 3
"""Rank of a quantized pool's scales: the pool's axes before :data:`SLOT_AXIS`."""
SCALE_LAYOUT = "[num_layers, kv_heads, num_pages]"
"""A quantized pool's scales' axes as written in error messages and docs."""
PAGE_SCALE_AXES = (SLOT_AXIS, HEAD_DIM_AXIS)
"""Axes of a pool (or of pages in its layout) that one scale covers: a page's slots and features."""


class QuantizedPool(NamedTuple):
    """A quantized K (or V) pool: a pytree of two arrays that goes where a pool array goes.

    Attributes:
      values: ``[num_layers, kv_heads, num_pages, block_size, head_dim]`` (:func:`pool_shape`) in a
        quantized dtype (:data:`pallas_kernels.quantization.QUANTIZED_DTYPES`).
      scales: float32 ``[num_layers, kv_heads, num_pages]`` (:func:`scale_shape`): page ``p`` of
        ``(layer, head)`` holds ``values[layer, head, p] * scales[layer, head, p]``. The null page
        and never-written pages have scale 0 (their values are zeros).

    ``shape`` and ``dtype`` are the values' (so shape checks read a quantized pool as a pool).
    """

    values: jax.Array
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def dtype(self):
        return self.values.dtype


def is_quantized_pool(pool) -> bool:
    """Whether ``pool`` is a :class:`QuantizedPool` (else a plain pool array)."""
    return isinstance(pool, QuantizedPool)


def scale_shape(pool_shape_: tuple[int, ...]) -> tuple[int, ...]:
    """The scales' shape of a quantized pool of shape ``pool_shape_``: its :data:`SCALE_RANK` major
    axes, ``(num_layers, kv_heads, num_pages)``."""
    return tuple(pool_shape_)[:SCALE_RANK]


@dataclasses.dataclass(frozen=True)
class PoolGeometry:
    """Static sizes of a pool (hashable).

    Attributes:
      num_layers, kv_heads, num_pages, block_size (tokens per page), head_dim.
    """

    num_layers: int
    kv_heads: int
    num_pages: int
    block_size: int
    head_dim: int

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return pool_shape(self.num_layers, self.num_pages, self.block_size, self.kv_heads,
                          self.head_dim)


def pool_shape(num_layers: int, num_pages: int, block_size: int, kv_heads: int,
               head_dim: int, *, check: bool = True) -> tuple[int, int, int, int, int]:
    """The shape of one K (or V) pool: ``(num_layers, kv_heads, num_pages, block_size, head_dim)``.

    Arguments are in the cache's own order (pages before heads), so callers never spell the layout.
    ``check=False`` skips the range checks (validators that report sizes their own way).

    Raises:
      ArgumentTypeError: a size that is not an int (:mod:`pallas_kernels.checks`).
      ValueError: any size below 1, or ``num_pages < 2`` (the null page and one more).
    """
    if not check:
        return (num_layers, kv_heads, num_pages, block_size, head_dim)
    sizes = dict(num_layers=num_layers, num_pages=num_pages, block_size=block_size,
                 kv_heads=kv_heads, head_dim=head_dim)
    sizes = {name: require_int(name, value, minimum=1, must="an int >= 1") for name, value in sizes.items()}
    num_layers, num_pages, block_size, kv_heads, head_dim = sizes.values()
    if num_pages < 2:
        raise ValueError(f"num_pages={num_pages} is too small; allowed >= 2 (the null page 0 and "
                         "at least one more)")
    return (num_layers, kv_heads, num_pages, block_size, head_dim)


def tpu_block_size(tokens_per_frame: int) -> int:
    """The page size for frames of ``tokens_per_frame`` tokens on TPU: one page per frame, rounded up
    to a multiple of :data:`SLOT_MULTIPLE` (the extra slots are frame padding).

    Raises:
      ArgumentTypeError: not an int. ValueError: ``tokens_per_frame`` below 1.
    """
    tokens_per_frame = require_int("tokens_per_frame", tokens_per_frame, minimum=1, must="an int >= 1")
    return -(-tokens_per_frame // SLOT_MULTIPLE) * SLOT_MULTIPLE


def check_tpu_block_size(block_size: int) -> None:
    """Raises a ValueError unless ``block_size`` keeps the pool's layout on TPU (a multiple of
    :data:`SLOT_MULTIPLE`)."""
    if block_size % SLOT_MULTIPLE:
        raise ValueError(
            f"block_size={block_size} (pool.shape[3]) must be a multiple of {SLOT_MULTIPLE} for the "
            f"TPU kernels (XLA:TPU relays out other pools and every call copies them); use "
            f"tpu_block_size(tokens_per_frame)={tpu_block_size(block_size)} with frame padding")


def pool_geometry(pool) -> PoolGeometry:
    """The :class:`PoolGeometry` of a pool array (or ``ShapeDtypeStruct``, a :class:`QuantizedPool`,
    or a shape tuple) in this layout.

    Raises:
      ValueError: ``pool`` is not rank 5.
    """
    if isinstance(pool, (tuple, list)) and not is_quantized_pool(pool):
        shape = tuple(pool)
    else:
        shape = tuple(getattr(pool, "shape", ()))
    if len(shape) != POOL_RANK:
        raise ValueError(f"a pool must have rank 5 {list(POOL_AXES)}, got shape {shape}")
    return PoolGeometry(shape[LAYER_AXIS], shape[KV_HEAD_AXIS], shape[PAGE_AXIS],
                        shape[SLOT_AXIS], shape[HEAD_DIM_AXIS])


def pool_spec_axes(layer=None, kv_head=None, page=None, slot=None, head_dim=None) -> tuple:
    """A partition-spec tuple in pool axis order from per-axis entries (mesh axis names or None)."""
    entries = {LAYER_AXIS: layer, KV_HEAD_AXIS: kv_head, PAGE_AXIS: page, SLOT_AXIS: slot,
               HEAD_DIM_AXIS: head_dim}
    return tuple(entries[axis] for axis in range(POOL_RANK))


def pool_tree_spec(spec, quantized: bool):
    """The partition spec (a pytree prefix) of a pool whose values have partition spec ``spec`` (a
    ``PartitionSpec`` in pool axis order): ``spec`` itself for a plain pool, a
    :class:`QuantizedPool` of ``spec`` and its first :data:`SCALE_RANK` entries for a quantized one
    (a page's scale lives with the page)."""
    if not quantized:
        return spec
    return QuantizedPool(spec, type(spec)(*tuple(spec)[:SCALE_RANK]))


def page_index(layer, kv_head, page) -> tuple:
    """The index of one page ``[block_size, head_dim]`` of ``(layer, kv_head)`` in a pool (or a
    pool ``Ref``: ``pool.at[page_index(...)]``, the unit the TPU kernels DMA)."""
    entries = {LAYER_AXIS: layer, KV_HEAD_AXIS: kv_head, PAGE_AXIS: page}
    return tuple(entries[axis] for axis in sorted(entries))


def head_pages(pool) -> jax.Array:
    """The pool as ``[num_layers * kv_heads, num_pages, block_size * head_dim]``: every (layer, KV
    head)'s pages as flat contiguous rows (a free reshape; ``.reshape(pool.shape)`` undoes it)."""
    geom = pool_geometry(pool)
    return pool.reshape(geom.num_layers * geom.kv_heads, geom.num_pages,
                        geom.block_size * geom.head_dim)


def token_rows(pool) -> jax.Array:
    """The pool as token rows ``[num_layers * kv_heads * num_pages * block_size, head_dim]`` (a
    free reshape); row :func:`token_row` holds one slot of one KV head."""
    return pool.reshape(-1, pool.shape[HEAD_DIM_AXIS])


def token_row(geom: PoolGeometry, layer, kv_head, page, slot):
    """The row of :func:`token_rows` holding ``slot`` of ``page`` of ``(layer, kv_head)`` (ints or
    int arrays that broadcast together)."""
    return ((layer * geom.kv_heads + kv_head) * geom.num_pages + page) * geom.block_size + slot


def head_row_stride(geom: PoolGeometry) -> int:
    """Rows of :func:`token_rows` between the same slot of KV heads ``h`` and ``h + 1``."""
    return token_row(geom, 0, 1, 0, 0)


def read_tokens(pool, layer, page, offset):
    """Slots ``(page, offset)`` of ``layer``, token-major: ``[*page.shape, kv_heads, head_dim]``.

    ``layer`` an int scalar (may be traced); ``page`` and ``offset`` int arrays that broadcast
    together. One gather, no copy of the layer."""
    # Advanced indices separated by a slice put their broadcast shape first: token-major.
    return pool[layer, :, page, offset]


def write_tokens(pool, layer, page, offset, new):
    """``pool`` with token-major ``new`` ``[*page.shape, kv_heads, head_dim]`` written at slots
    ``(page, offset)`` of ``layer`` (a functional update)."""
    return pool.at[layer, :, page, offset].set(new)


def layer_token_major(pool, layer) -> jax.Array:
    """Every page of ``layer``, token-major ``[num_pages, block_size, kv_heads, head_dim]`` (the
    seed's and vLLM's ``key_cache[layer]``; a copy of one layer)."""
    return jnp.transpose(pool[layer], (1, 2, 0, 3))


def layer_pages(pool, layer, pages):
    """Pages ``pages`` (int ``[n]``) of ``layer``, token-major ``[n, block_size, kv_heads,
    head_dim]``: the seed's ``key_cache[layer][pages]`` view (a copy)."""
    return jnp.transpose(pool[layer][:, pages], (1, 2, 0, 3))


def set_pages(pool, ids, pages, **scatter_options):
    """``pool`` with token-major ``pages`` ``[num_layers, n, block_size, kv_heads, head_dim]``
    written at page ids ``ids`` (int ``[n]``) of every layer and head: one scatter
    (``scatter_options`` go to ``.at[...].set``, e.g. ``mode="drop", unique_indices=True``).

    For a :class:`QuantizedPool`, ``pages`` (a float dtype) are quantized first, one scale per page
    of each layer and head (:func:`quantize_pages`), and values and scales are scattered alike
    (two scatters)."""
    index = tuple(ids if axis == PAGE_AXIS else slice(None) for axis in range(PAGE_AXIS + 1))
    # Advanced indices after basic slices keep their axis: the update is in the pool's layout.
    if is_quantized_pool(pool):  # The scales' axes are the pool's first three: the same index.
        new = quantize_pages(from_token_major(pages), pool.dtype)
        return QuantizedPool(pool.values.at[index].set(new.values, **scatter_options),
                             pool.scales.at[index].set(new.scales, **scatter_options))
    return pool.at[index].set(from_token_major(pages), **scatter_options)


def page_mask(mask, rank: int = POOL_RANK):
    """A bool ``[num_pages]`` mask broadcastable against a pool (or, with ``rank=SCALE_RANK``,
    against a quantized pool's scales)."""
    return jnp.asarray(mask).reshape(
        tuple(-1 if axis == PAGE_AXIS else 1 for axis in range(rank)))


def slot_mask(mask):
    """A bool ``[num_layers, num_pages, block_size]`` mask broadcastable against a pool."""
    return jnp.expand_dims(jnp.asarray(mask), (KV_HEAD_AXIS, HEAD_DIM_AXIS))


def empty_pool(num_layers: int, num_pages: int, block_size: int, kv_heads: int, head_dim: int,
               dtype=jnp.bfloat16):
    """A zero pool of :func:`pool_shape` (every page, the null page included, zero-filled): an array
    of ``dtype``, or for a quantized ``dtype`` a :class:`QuantizedPool` with zero scales."""
    return zero_pool(pool_shape(num_layers, num_pages, block_size, kv_heads, head_dim), dtype)


def zero_pool(shape: tuple[int, ...], dtype):
    """A zero pool of ``shape`` (:func:`pool_shape`'s order) stored as ``dtype``: ``jnp.zeros``, or
    for a quantized ``dtype`` a :class:`QuantizedPool` of zero values and zero scales."""
    if is_quantized(dtype):
        return QuantizedPool(jnp.zeros(shape, dtype), jnp.zeros(scale_shape(shape), SCALE_DTYPE))
    return jnp.zeros(shape, dtype)


def quantize_pages(pages: jax.Array, dtype) -> QuantizedPool:
    """Pages in the pool's layout (``[..., n, block_size, head_dim]``, a float dtype) quantized to
    ``dtype`` with one scale per page of each (layer, head): a :class:`QuantizedPool` of ``n``
    pages (values ``pages``' shape, scales ``pages.shape[:-2]``)."""
    return QuantizedPool(*quantize(pages, dtype, PAGE_SCALE_AXES))


def dequantize_pool(pool: QuantizedPool, dtype=jnp.float32) -> jax.Array:
    """Every page of a :class:`QuantizedPool` as ``dtype`` values in the pool's layout (a full
    copy; references and tests)."""
    return dequantize(pool.values, pool.scales, PAGE_SCALE_AXES, dtype)


def read_tokens_as(pool, layer, page, offset, dtype):
    """:func:`read_tokens` of a plain or quantized pool, as ``dtype``: ``[*page.shape, kv_heads,
    head_dim]``. A quantized pool's values and their pages' scales are gathered (one gather each)
    and multiplied in float32; a plain pool's tokens are cast."""
    if not is_quantized_pool(pool):
        return read_tokens(pool, layer, page, offset).astype(dtype)
    values = read_tokens(pool.values, layer, page, offset)
    scales = pool.scales[layer, :, page]  # [*page.shape, kv_heads], as read_tokens orders it
    return (values.astype(jnp.float32) * scales[..., None]).astype(dtype)


def from_token_major(pool) -> jax.Array:
    """``[L, P, S, H, D]`` (the seed's and vLLM's page layout) -> this layout (a full copy)."""
    pool = jnp.asarray(pool)
    if pool.ndim != 5:
        raise ValueError(f"a token-major pool must have rank 5 [L, P, S, H, D], got {pool.shape}")
    return jnp.transpose(pool, (0, 3, 1, 2, 4))


def to_token_major(pool: jax.Array) -> jax.Array:
    """This layout -> ``[L, P, S, H, D]`` (a full copy; for views such as compat's key_cache)."""
    pool_geometry(pool)
    return jnp.transpose(pool, (0, 2, 3, 1, 4))
