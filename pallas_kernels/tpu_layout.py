"""The TPU-native K/V pool layout: head-major pages, one helper every module uses.

A pool holds, for every layer, KV head and page, one ``[block_size, head_dim]`` tile column:

=================  ============================================================================
pool               ``[num_layers, kv_heads, num_pages, block_size, head_dim]`` (:func:`pool_shape`)
page ``p`` of      ``pool[layer, head, p]``: ``[block_size, head_dim]``, contiguous in HBM
(layer, head)
null page          ``p = 0`` in every (layer, head): never written, zero-filled
=================  ============================================================================

Why this layout (measured with libtpu's compile-only v5e/v6e devices, see
``tests/kernels_tpu/test_tpu_compile.py`` and ``benchmarks/tpu_compile.py``):

* The two minor dimensions are ``(block_size, head_dim)``: XLA:TPU tiles them exactly as Mosaic does
  (``(8|16, 128)`` tiles on the slot and lane axes), whatever the head count, so no pool is relaid
  out around a kernel. A row-major ``[L, P, S, H, D]`` pool puts the head axis second-minor; 12 or 40
  heads are not a multiple of the 16-row bf16 tile, XLA chooses a head-major physical layout for
  it, and every Mosaic call (which demands row-major) copies both whole pools.
* One DMA of ``pool.at[layer, head, p]`` brings a page of one KV head into VMEM as a dense
  ``[block_size, head_dim]`` matrix that the MXU consumes directly: no per-head sublane shuffles.
* XLA:TPU keeps this layout only while ``block_size`` is a multiple of 8: for a slot axis of, say,
  220 it moves the page axis second-minor (it minimises tile padding) and the kernels copy the pools
  again. :func:`tpu_block_size` rounds a frame up to such a page (220 -> 224 slots, 4 of them frame
  padding, which ``tokens_per_frame`` already expresses); the TPU kernels reject other sizes.
* Pages stay frame-aligned (a frame takes ``ceil(tokens_per_frame / block_size)`` page ids); the
  block-table state is unchanged: page ids do not depend on the layout.

Token-major tensors (``[..., tokens, kv_heads, head_dim]``: queries, the current chunk, extras,
the chunk to commit) keep their shapes at every API; kernels transpose them (O(chunk) bytes).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

LAYER_AXIS = 0
"""Axis of the layer in a pool."""
KV_HEAD_AXIS = 1
"""Axis of the KV head in a pool (the axis a head-sharded mesh splits)."""
PAGE_AXIS = 2
"""Axis of the page id in a pool."""
POOL_AXES = ("layer", "kv_head", "page", "slot", "head_dim")
"""Names of the pool's axes, major to minor."""
SLOT_MULTIPLE = 8
"""``block_size`` must be a multiple of this for XLA:TPU to keep the pool's layout (no copies)."""


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
               head_dim: int) -> tuple[int, int, int, int, int]:
    """The shape of one K (or V) pool: ``(num_layers, kv_heads, num_pages, block_size, head_dim)``.

    Arguments are in the cache's own order (pages before heads), so callers never spell the layout.

    Raises:
      ValueError: any size below 1, or ``num_pages < 2`` (the null page and one more).
    """
    sizes = dict(num_layers=num_layers, num_pages=num_pages, block_size=block_size,
                 kv_heads=kv_heads, head_dim=head_dim)
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if num_pages < 2:
        raise ValueError(f"num_pages={num_pages} is too small; allowed >= 2 (the null page 0 and "
                         "at least one more)")
    return (num_layers, kv_heads, num_pages, block_size, head_dim)


def tpu_block_size(tokens_per_frame: int) -> int:
    """The page size for frames of ``tokens_per_frame`` tokens on TPU: one page per frame, rounded up
    to a multiple of :data:`SLOT_MULTIPLE` (the extra slots are frame padding).

    Raises:
      ValueError: ``tokens_per_frame`` below 1.
    """
    if isinstance(tokens_per_frame, bool) or not isinstance(tokens_per_frame, int) or \
            tokens_per_frame < 1:
        raise ValueError(f"tokens_per_frame must be an int >= 1, got {tokens_per_frame!r}")
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
    """The :class:`PoolGeometry` of a pool array (or ``ShapeDtypeStruct``) in this layout.

    Raises:
      ValueError: ``pool`` is not rank 5.
    """
    shape = tuple(getattr(pool, "shape", ()))
    if len(shape) != 5:
        raise ValueError(f"a pool must have rank 5 {list(POOL_AXES)}, got shape {shape}")
    num_layers, kv_heads, num_pages, block_size, head_dim = shape
    return PoolGeometry(num_layers, kv_heads, num_pages, block_size, head_dim)


def empty_pool(num_layers: int, num_pages: int, block_size: int, kv_heads: int, head_dim: int,
               dtype=jnp.bfloat16) -> jax.Array:
    """A zero pool of :func:`pool_shape` (every page, the null page included, zero-filled)."""
    return jnp.zeros(pool_shape(num_layers, num_pages, block_size, kv_heads, head_dim), dtype)


def from_token_major(pool: jax.Array) -> jax.Array:
    """``[L, P, S, H, D]`` (the seed's and vLLM's page layout) -> this layout (a full copy)."""
    if pool.ndim != 5:
        raise ValueError(f"a token-major pool must have rank 5 [L, P, S, H, D], got {pool.shape}")
    return jnp.transpose(pool, (0, 3, 1, 2, 4))


def to_token_major(pool: jax.Array) -> jax.Array:
    """This layout -> ``[L, P, S, H, D]`` (a full copy; for views such as compat's key_cache)."""
    pool_geometry(pool)
    return jnp.transpose(pool, (0, 2, 3, 1, 4))
