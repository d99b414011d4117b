"""vLLM-Omni's paged K/V pools: every layer's managed and scratch blocks, on one device.

:class:`PagedKVPools` holds the head-major K and V pools
(:func:`pallas_kernels.layout.pool_shape`), writes a chunk's K/V at flat slots
(``block * block_size + offset``) in place and reads a layer back token-major, as vLLM-Omni's
``key_cache``/``value_cache`` are shaped. :func:`check_layer` is vLLM-Omni's per-layer list
indexing made strict (negative indices from the end; bools and non-integers refused).

Part of :mod:`arkv_jax.compat.vllm_omni`; see ``docs/migrating-from-vllm-omni.md``.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.layout import layer_token_major, pool_geometry, pool_shape, write_tokens

__all__ = ["PagedKVPools", "check_layer"]


def check_layer(index, name: str, num_layers: int) -> int:
    """``index`` as a layer in ``[0, num_layers)``; negative indices count from the end, as the
    vLLM-Omni's per-layer lists do.

    Raises:
      TypeError: ``index`` is not an int (or is a bool). IndexError: ``index`` is out of range.
    """
    if isinstance(index, (bool, np.bool_)) or str(getattr(index, "dtype", "")) in ("bool", "torch.bool"):
        raise TypeError(f"{name} must be an int, got bool {index!r}")
    try:
        layer = operator.index(index)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(index).__name__} {index!r}") from None
    if not -num_layers <= layer < num_layers:
        raise IndexError(f"{name} {layer} is out of range for {num_layers} layers: expected "
                         f"0 <= {name} < {num_layers} (or -{num_layers} <= {name} < 0 "
                         "from the end)")
    return layer % num_layers


@functools.partial(jax.jit, donate_argnums=0)
def _write_slots(pool, layer, slots, new):
    """``pool``'s layer ``layer`` (traced: one compilation serves every layer) gets token-major
    ``new`` ``[n, heads, dim]``, cast to the pool's dtype, at the flat slots ``slots``
    (``page * block_size + offset``), in the pool's own layout."""
    block_size = pool_geometry(pool).block_size
    return write_tokens(pool, layer, slots // block_size, slots % block_size, new.astype(pool.dtype))


#: A layer of a pool, token-major; the layer is traced, so one compilation serves every layer.
_token_major = jax.jit(layer_token_major)


class PagedKVPools:
    """The K and V pools, ``None`` without a device (vLLM-Omni's bookkeeping-only mode)."""

    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                 chunk_size: int, dtype, device: jax.Device | None) -> None:
        self.num_layers, self.chunk_size, self.dtype = num_layers, chunk_size, dtype
        self.num_kv_heads, self.head_size = num_kv_heads, head_size
        self.k = self.v = None
        if device is not None:
            shape = pool_shape(num_layers, num_blocks, block_size, num_kv_heads, head_size)
            self.k = jax.device_put(jnp.zeros(shape, dtype), device)
            self.v = jax.device_put(jnp.zeros(shape, dtype), device)

    def require(self) -> tuple[jax.Array, jax.Array]:
        """``(k, v)``. Raises: RuntimeError: no pool device."""
        if self.k is None:
            raise RuntimeError("AR-Diffusion K/V pools require a configured pool device")
        return self.k, self.v

    def key_cache(self, layer_idx) -> jax.Array:
        """A token-major copy of layer ``layer_idx`` of the K pool.

        Raises: as :meth:`require` and :func:`check_layer`.
        """
        return _token_major(self.require()[0], np.int32(check_layer(layer_idx, "layer_idx", self.num_layers)))

    def value_cache(self, layer_idx) -> jax.Array:
        """A token-major copy of layer ``layer_idx`` of the V pool (raises as :meth:`key_cache`)."""
        return _token_major(self.require()[1], np.int32(check_layer(layer_idx, "layer_idx", self.num_layers)))

    def write(self, layer: int, slots: jax.Array, new_k, new_v) -> None:
        """Writes one chunk's K/V of layer ``layer`` (checked) at ``slots``, in place; both are
        checked before either is written.

        Raises:
          RuntimeError: no pool device. TypeError: K/V are not floating. ValueError: K/V of the
            wrong shape.
        """
        k_pool, v_pool = self.require()
        new_k = self._chunk_kv("new_k", new_k)
        new_v = self._chunk_kv("new_v", new_v)
        layer = np.int32(layer)
        self.k = _write_slots(k_pool, layer, slots, new_k)
        self.v = _write_slots(v_pool, layer, slots, new_v)

    def _chunk_kv(self, name: str, x) -> jax.Array:
        """One chunk's K or V as ``(chunk_size, heads, head_size)``, checked."""
        if not isinstance(x, (jax.Array, np.ndarray)):
            x = np.asarray(x)
        chunk, heads, dim = self.chunk_size, self.num_kv_heads, self.head_size
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must have a floating dtype (the pool holds {jnp.dtype(self.dtype).name}), "
                            f"got {x.dtype}")
        shape = tuple(x.shape)
        if not (shape == (chunk, heads, dim) or (len(shape) == 4 and shape[0] >= 1
                                                    and shape[1:] == (chunk, heads, dim))):
            raise ValueError(f"{name} must have shape (1, {chunk}, {heads}, {dim}) (batch 0 is written) or "
                             f"({chunk}, {heads}, {dim}): one K/V per token of the chunk, got {shape}")
        return jnp.asarray(x[0] if len(shape) == 4 else x)
