"""The kernels on a ``("data", "model")`` mesh: each device runs the unsharded kernel on its part.

Rows and pool pages are split over ``"data"``, K/V and query heads over ``"model"``
(:mod:`arkv_jax.sharding` has the specs; ``docs/sharding.md``). The wrappers add no math: a sharded
write is bit-identical to the single-device write with global page ids, and attention matches it to
float rounding. They check only mesh concerns (axes, divisibility); shapes are the kernels' to check.

Donation: the wrappers do not donate by themselves; call them inside a step jitted with
``donate_argnums`` on the pools and the outputs alias the pools on every device.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from arkv_jax.config import check_divisible, require_int
from arkv_jax.sharding import (
    DATA,
    MODEL,
    check_heads,
    check_mesh,
    chunk_spec,
    cross_attention_spec,
    head_spec,
    pool_spec,
    row_spec,
    shard_map,
)
from pallas_kernels.context_attention import context_attention
from pallas_kernels.layout import KV_HEAD_AXIS, LAYER_AXIS, PAGE_AXIS, is_quantized_pool
from pallas_kernels.paged_write import write_chunk
from pallas_kernels.window_attention import window_attention

__all__ = ["gather_rows", "sharded_context_attention", "sharded_window_attention", "sharded_write_chunk",
           "take_rows"]


def _shape(x) -> tuple:
    """``x``'s shape: an array's, or a quantized pool's values' (a pytree, not an array)."""
    return tuple(x.shape) if is_quantized_pool(x) else tuple(jnp.shape(x))


def _rank(x) -> int:
    return len(_shape(x))


def sharded_write_chunk(mesh: Mesh, k_pool: jax.Array, v_pool: jax.Array, k_new: jax.Array,
                        v_new: jax.Array, page_ids: jax.Array, *,
                        tokens_per_frame: int | None = None, backend: str = "auto"
                        ) -> tuple[jax.Array, jax.Array]:
    """:func:`pallas_kernels.paged_write.write_chunk` on every device's part of the pools.

    Args:
      mesh: a mesh with ``"data"`` and ``"model"`` axes.
      k_pool, v_pool: :func:`pallas_kernels.layout.pool_shape` pools of ``data * pages_per_shard``
        pages (spec :func:`pool_spec`), arrays or :class:`~pallas_kernels.layout.QuantizedPool` s.
      k_new, v_new: ``[L, data * rows_per_shard, F * T, Hkv, hd]`` (spec :func:`chunk_spec`).
      page_ids: int ``[data * rows_per_shard, F * ppf]``, *local* page ids of each row's shard
        (spec ``P("data", None)``); 0 or outside ``[1, pages_per_shard)`` skips (always: the
        kernel runs traced, so concrete ids are not value-checked here).
      tokens_per_frame, backend: as for ``write_chunk``.

    Returns:
      ``(k_pool, v_pool)``, sharded like the inputs. Jit the caller with ``donate_argnums`` on the
      pools to update them in place.

    Raises:
      ValueError: a mesh without the axes; heads, rows or pages not divisible by the axis sizes;
        shapes that ``write_chunk`` rejects (checked per shard).
    """
    data, model = check_mesh(mesh)
    for name, x, rank in (("k_pool", k_pool, 5), ("v_pool", v_pool, 5), ("k_new", k_new, 5),
                          ("v_new", v_new, 5), ("page_ids", page_ids, 2)):
        if _rank(x) != rank:
            raise ValueError(f"{name} must have rank {rank}, got shape {_shape(x)}")
    check_heads(model, kv_heads=k_pool.shape[KV_HEAD_AXIS])
    check_divisible(f"pool pages (k_pool.shape[{PAGE_AXIS}])", k_pool.shape[PAGE_AXIS], DATA, data)
    check_divisible("rows (k_new.shape[1])", k_new.shape[1], DATA, data)
    check_divisible("rows (page_ids.shape[0])", page_ids.shape[0], DATA, data)
    return _sharded_write_jit(k_pool, v_pool, k_new, v_new, page_ids, mesh=mesh,
                              tokens_per_frame=tokens_per_frame, backend=backend)


@functools.partial(jax.jit, static_argnames=("mesh", "tokens_per_frame", "backend"))
def _sharded_write_jit(k_pool, v_pool, k_new, v_new, page_ids, *, mesh, tokens_per_frame, backend):
    def body(kp, vp, kn, vn, ids):
        return write_chunk(kp, vp, kn, vn, ids, tokens_per_frame=tokens_per_frame, backend=backend)

    pools, chunk = pool_spec(is_quantized_pool(k_pool)), chunk_spec()
    return shard_map(body, mesh, (pools, pools, chunk, chunk, row_spec(2)), (pools, pools),
                     check=False)(k_pool, v_pool, k_new, v_new, page_ids)


def sharded_window_attention(mesh: Mesh, q: jax.Array, k_cur: jax.Array, v_cur: jax.Array,
                             k_pool: jax.Array, v_pool: jax.Array, pages: jax.Array,
                             lengths: jax.Array, *, layer: Any = 0, extra_k: jax.Array | None = None,
                             extra_v: jax.Array | None = None, scale: float | None = None,
                             tokens_per_frame: int | None = None, backend: str = "auto",
                             block_q: int | None = None, block_k: int | None = None,
                             rope: tuple[jax.Array, jax.Array] | None = None,
                             qk_norm: tuple[jax.Array, ...] | None = None) -> jax.Array:
    """:func:`pallas_kernels.window_attention.window_attention` on every device's part.

    Rows (``q``, ``k_cur``, ``v_cur``, extras, ``pages``, ``lengths``, the ``rope`` tables and
    ``qk_norm``'s inverse RMS) and pool pages are split over data, query and K/V heads (and
    ``qk_norm``'s gains) over model; ``pages`` holds *local* page ids of each row's shard and
    is replicated over model, as are ``lengths``. ``layer`` may be traced (replicated); a Python int
is range-checked here, page ids and lengths are not (they are per-shard values). The other
    keywords are ``window_attention``'s (``block_q``/``block_k``: Pallas tiles).

    Returns:
      ``[rows, q_len, num_q_heads, head_dim]`` sharded as ``q`` (``P("data", None, "model", None)``).

    Raises:
      ValueError: a mesh without the axes; query or K/V heads not divisible by ``model``; rows or
        pool pages not divisible by ``data``; shapes ``window_attention`` rejects (per shard).
    """
    data, model = check_mesh(mesh)
    for name, x, rank in (("q", q, 4), ("k_cur", k_cur, 4), ("v_cur", v_cur, 4),
                          ("k_pool", k_pool, 5), ("v_pool", v_pool, 5), ("pages", pages, 2),
                          ("lengths", lengths, 1)):
        if _rank(x) != rank:
            raise ValueError(f"{name} must have rank {rank}, got shape {_shape(x)}")
    check_heads(model, kv_heads=k_cur.shape[2], q_heads=q.shape[2])
    check_divisible(f"kv_heads (k_pool.shape[{KV_HEAD_AXIS}])", k_pool.shape[KV_HEAD_AXIS], MODEL,
                    model)
    check_divisible("rows (q.shape[0])", q.shape[0], DATA, data)
    check_divisible(f"pool pages (k_pool.shape[{PAGE_AXIS}])", k_pool.shape[PAGE_AXIS], DATA, data)
    if (extra_k is None) != (extra_v is None):
        raise ValueError("extra_k and extra_v must be given together (both or neither)")
    num_layers = k_pool.shape[LAYER_AXIS]
    if isinstance(layer, (int, np.integer)):  # static: checked here, as the kernel checks it
        require_int(f"layer (k_pool.shape[{LAYER_AXIS}] = {num_layers} layers)", layer, minimum=0,
                    maximum=num_layers - 1)
    if scale is None:
        scale = float(q.shape[-1]) ** -0.5  # the kernel's default, fixed before sharding
    return _sharded_attention_jit(q, k_cur, v_cur, k_pool, v_pool, pages, lengths,
                                  jnp.asarray(layer, jnp.int32), extra_k, extra_v,
                                  None if rope is None else tuple(rope),
                                  None if qk_norm is None else tuple(qk_norm), mesh=mesh, scale=scale,
                                  tokens_per_frame=tokens_per_frame, backend=backend,
                                  block_q=block_q, block_k=block_k)


@functools.partial(jax.jit, static_argnames=("mesh", "scale", "tokens_per_frame", "backend",
                                             "block_q", "block_k"))
def _sharded_attention_jit(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, layer, extra_k, extra_v,
                           rope, qk_norm, *, mesh, scale, tokens_per_frame, backend, block_q,
                           block_k):
    has_extra, has_rope, has_norm = extra_k is not None, rope is not None, qk_norm is not None

    def body(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, layer, *rest):
        ek, ev = rest[:2] if has_extra else (None, None)
        rest = rest[2 * has_extra:]
        return window_attention(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, layer=layer,
                                extra_k=ek, extra_v=ev, scale=scale,
                                tokens_per_frame=tokens_per_frame, backend=backend,
                                block_q=block_q, block_k=block_k,
                                rope=rest[:2] if has_rope else None,
                                qk_norm=rest[2 * has_rope:] if has_norm else None)

    heads, pools = head_spec(), pool_spec(is_quantized_pool(k_pool))
    in_specs = (heads, heads, heads, pools, pools, row_spec(2), row_spec(1), P())
    args = (q, k_cur, v_cur, k_pool, v_pool, pages, lengths, layer)
    if has_extra:
        in_specs += (heads, heads)
        args += (extra_k, extra_v)
    if has_rope:
        in_specs += (row_spec(3), row_spec(3))
        args += rope
    if has_norm:
        in_specs += (row_spec(2), row_spec(2), P(MODEL), P(MODEL))
        args += qk_norm
    return shard_map(body, mesh, in_specs, heads, check=False)(*args)


def sharded_context_attention(mesh: Mesh, q: jax.Array, k: jax.Array, v: jax.Array, *,
                              scale: float | None = None, backend: str = "auto") -> jax.Array:
    """:func:`pallas_kernels.context_attention.context_attention` on every device's part: rows
    split over data, query and K/V heads over model (``q`` ``[rows, N, Hq, D]``, ``k``/``v``
    ``[rows, T, Hkv, D]``, all ``P("data", None, "model", None)``); the output is sharded as ``q``.

    Raises:
      ValueError: a mesh without the axes; heads or rows not divisible by the axis sizes; shapes
        ``context_attention`` rejects (per shard).
    """
    data, model = check_mesh(mesh)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if jnp.ndim(x) != 4:
            raise ValueError(f"{name} must have rank 4, got shape {tuple(jnp.shape(x))}")
    check_heads(model, kv_heads=k.shape[2], q_heads=q.shape[2])
    check_divisible("rows (q.shape[0])", q.shape[0], DATA, data)
    scale = float(q.shape[-1]) ** -0.5 if scale is None else scale  # fixed before sharding
    return _sharded_context_jit(q, k, v, mesh=mesh, scale=scale, backend=backend)


@functools.partial(jax.jit, static_argnames=("mesh", "scale", "backend"))
def _sharded_context_jit(q, k, v, *, mesh, scale, backend):
    def body(q, k, v):
        return context_attention(q, k, v, scale=scale, backend=backend)

    heads = head_spec()
    return shard_map(body, mesh, (heads, heads, heads), heads, check=False)(q, k, v)


def gather_rows(mesh: Mesh, table: jax.Array, rows: jax.Array, *, head_axis: int = 3) -> jax.Array:
    """``table[rows]`` within every data shard: the per-row caches (e.g. cross-attention K/V) of a
    batch, without moving rows between devices.

    Args:
      mesh: a mesh with ``"data"`` and ``"model"`` axes.
      table: ``[data * rows_per_shard, ...]``, rows split over data and axis ``head_axis`` over
        model (:func:`cross_attention_spec`).
      rows: int ``[data * B]`` *local* row indices of each shard's batch rows; negative = padding.

    Returns:
      ``[data * B, ...]`` sharded like ``table``; padding rows are zero.
    """
    spec = cross_attention_spec(jnp.ndim(table), 0, head_axis)
    return shard_map(take_rows, mesh, (spec, row_spec(1)), spec)(table, rows)


def take_rows(table: jax.Array, rows: jax.Array) -> jax.Array:
    """``table[rows]`` ``[B, ...]`` of a per-row table ``[rows, ...]`` on one device, zero where
    ``rows`` is negative (padding): what :func:`gather_rows` runs on each data shard."""
    taken = jnp.take(table, jnp.maximum(rows, 0), axis=0)
    valid = (rows >= 0).reshape((-1,) + (1,) * (table.ndim - 1))
    return jnp.where(valid, taken, jnp.zeros((), table.dtype))
