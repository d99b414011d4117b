"""The cross-attention store: dense per-row K/V caches (e.g. text K/V), one pair of tables per name.

Every named cache is a K and a V table ``[num_rows, layers, tokens, heads, head_dim]`` indexed by
*global row* (:mod:`arkv_jax.cache.sessions`): one row per (session, KV branch). A row is
published atomically (:meth:`CrossAttentionStore.populate`: every layer validated before anything
is written), read as whole tables (:meth:`CrossAttentionStore.kv`, rows never populated are zero)
and zeroed on release. Updates donate the tables and keep their sharding.

:func:`collect_cross_attention_layers` is the validator of one row's per-layer K/V, shared with
:mod:`arkv_jax.compat.vllm_omni`, which passes vLLM-Omni's wording as ``label``. This module
needs JAX, NumPy and :mod:`arkv_jax.config` only.
"""

from __future__ import annotations

import functools
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from arkv_jax.config import CacheGeometry, CrossAttentionSpec, lookup

Array = jax.Array


def collect_cross_attention_layers(name: str, layer_kv: Iterable[tuple[Array, Array]], num_layers: int,
                                   shape: tuple[int, ...], *, allow_unbatched: bool,
                                   label: str = "cross-attention cache", require_float: bool = False
                                   ) -> tuple[Array, Array]:
    """Consumes ``layer_kv`` once, in layer order, and stacks it: ``(k, v)`` each
    ``[num_layers, *shape]``. Each item is a ``(k, v)`` pair of JAX or NumPy arrays of shape
    ``(1, *shape)`` (or ``shape`` when ``allow_unbatched``). Messages start with
    ``f"{label} {name!r}"``; an exception raised by the iterable propagates unchanged.

    With ``require_float`` a K/V of a non-floating dtype (int, bool, complex) is refused with a
    ``TypeError`` instead of being cast to the tables' dtype.

    Raises:
      ValueError: too many or too few layers, an item that is not a ``(k, v)`` pair, a non-array
        k or v, or a wrong shape.
      TypeError: a non-floating dtype (with ``require_float``).
    """
    batched = (1, *shape)
    ks, vs = [], []
    for layer, item in enumerate(layer_kv):
        if layer >= num_layers:
            raise ValueError(f"{label} {name!r} expected {num_layers} layers, got more than {num_layers}")
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            got = f"a {type(item).__name__}" + (f" of {len(item)} items" if isinstance(item, (tuple, list)) else "")
            raise ValueError(f"{label} {name!r} layer {layer} must yield a (k, v) pair, got {got}")
        k, v = item
        if not all(isinstance(x, (jax.Array, np.ndarray)) for x in (k, v)):
            raise ValueError(f"{label} {name!r} layer {layer} must yield jax.Array k/v, got "
                             f"{type(k).__name__} and {type(v).__name__}")
        if require_float and not all(jnp.issubdtype(x.dtype, jnp.floating) for x in (k, v)):
            from arkv_jax.config import ArgumentTypeError

            raise ArgumentTypeError(f"{label} {name!r} layer {layer} k/v must have a floating dtype, got "
                                    f"{k.dtype} and {v.dtype}; int, bool and complex K/V are refused, not cast")
        shapes = (tuple(k.shape), tuple(v.shape))
        if not all(s == batched or (allow_unbatched and s == tuple(shape)) for s in shapes):
            raise ValueError(f"{label} {name!r} layer {layer} expected k/v shape {batched}, got "
                             f"{shapes[0]} and {shapes[1]}")
        ks.append(jnp.reshape(jnp.asarray(k), shape))
        vs.append(jnp.reshape(jnp.asarray(v), shape))
    if len(ks) != num_layers:
        raise ValueError(f"{label} {name!r} expected {num_layers} layers, got {len(ks)}")
    return jnp.stack(ks), jnp.stack(vs)


@functools.partial(jax.jit, static_argnames="target", donate_argnums=(0, 1))
def _set_rows(k_table, v_table, rows, k_rows, v_rows, *, target: jax.sharding.Sharding):
    """``k_table[rows] = k_rows`` (same for V), in place, keeping the tables' sharding."""
    def put(table, values):
        return jax.lax.with_sharding_constraint(table.at[rows].set(values), target)

    return put(k_table, k_rows), put(v_table, v_rows)


class CrossAttentionStore:
    """Zero-filled K/V tables for each cross-attention spec, placed with ``sharding``.

    Args:
      specs: the named caches (a spec's ``num_kv_heads`` of ``None`` means the geometry's).
      geometry: layers, heads, head dim and dtype of the tables (all K/V heads).
      num_rows: global rows (sessions x KV branches).
      sharding: the tables' sharding (rows on ``"data"``, heads on ``"model"`` on a mesh).
    """

    def __init__(self, specs: Sequence[CrossAttentionSpec], geometry: CacheGeometry, num_rows: int,
                 sharding: jax.sharding.Sharding) -> None:
        self.specs = {spec.name: spec for spec in specs}
        self.geometry, self.num_rows, self.sharding = geometry, num_rows, sharding
        zeros = jax.jit(lambda shape: jnp.zeros(shape, geometry.dtype), static_argnums=0,
                        out_shardings=sharding)
        self._tables = {name: (zeros(self._table_shape(spec)), zeros(self._table_shape(spec)))
                        for name, spec in self.specs.items()}
        self._populated: set[tuple[int, str]] = set()  # (global row, cache name)

    def spec(self, name: str) -> CrossAttentionSpec:
        """The spec of cache ``name``.

        Raises:
          KeyError: unknown cache.
        """
        return lookup(self.specs, name, "cross-attention cache")

    def row_shape(self, name: str) -> tuple[int, int, int]:
        """``(tokens, heads, head_dim)`` of one layer of one row of cache ``name``."""
        return self._table_shape(self.spec(name))[2:]

    def populate(self, name: str, row: int, layer_kv: Iterable[tuple[Array, Array]], *,
                 label: str = "cross-attention cache") -> None:
        """Publishes ``row``'s K/V of cache ``name`` atomically: ``layer_kv`` yields one ``(k, v)``
        per layer, each ``[tokens, heads, head_dim]`` (a leading axis of 1 is accepted); nothing is
        written unless every layer arrived and validated. Messages start with ``label`` (e.g. the
        session and branch the row belongs to).

        Raises:
          KeyError: unknown cache. ValueError: wrong layer count, an item that is not a ``(k, v)``
            pair, a wrong type or shape.
        """
        self.publish(name, row, *self.collect(name, layer_kv, label=label))

    def collect(self, name: str, layer_kv: Iterable[tuple[Array, Array]], *,
                label: str = "cross-attention cache") -> tuple[Array, Array]:
        """Validates and stacks one row's ``layer_kv`` of cache ``name`` (as :meth:`populate` takes
        it) without publishing it: ``(k, v)``, each ``[layers, tokens, heads, head_dim]``.

        Raises:
          KeyError: unknown cache. ValueError: wrong layer count, an item that is not a ``(k, v)``
            pair, a wrong type or shape.
        """
        return collect_cross_attention_layers(name, layer_kv, self.geometry.num_layers, self.row_shape(name),
                                              allow_unbatched=True, require_float=True, label=label)

    def publish(self, name: str, row: int, k: Array, v: Array) -> None:
        """Publishes ``row``'s K/V of cache ``name`` from :meth:`collect`'s output."""
        self._set(name, [row], k[None], v[None])
        self._populated.add((row, name))

    def is_populated(self, name: str, row: int) -> bool:
        """Whether :meth:`populate` published ``row`` of cache ``name`` (since its last release).

        Raises:
          KeyError: unknown cache.
        """
        self.spec(name)
        return (row, name) in self._populated

    def kv(self, name: str) -> tuple[Array, Array]:
        """``(k, v)`` tables of cache ``name``, each ``[num_rows, layers, tokens, heads, head_dim]``.

        Raises:
          KeyError: unknown cache.
        """
        self.spec(name)
        return self._tables[name]

    def release(self, rows: Sequence[int], names: Iterable[str] | None = None) -> None:
        """Zeroes ``rows`` of the caches ``names`` (default: every cache) where any was populated."""
        for name in self.specs if names is None else names:
            if any((row, name) in self._populated for row in rows):
                k = self._tables[name][0]
                zeros = jnp.zeros((len(rows),) + k.shape[1:], k.dtype)
                self._set(name, rows, zeros, zeros)
                self._populated -= {(row, name) for row in rows}

    def _table_shape(self, spec: CrossAttentionSpec) -> tuple[int, ...]:
        g = self.geometry
        return (self.num_rows, g.num_layers, spec.num_tokens, spec.num_kv_heads or g.num_kv_heads, g.head_dim)

    def _set(self, name: str, rows: Sequence[int], k_rows: Array, v_rows: Array) -> None:
        dtype = self.geometry.dtype
        self._tables[name] = _set_rows(*self._tables[name], jnp.asarray(rows, jnp.int32), k_rows.astype(dtype),
                                       v_rows.astype(dtype), target=self.sharding)
