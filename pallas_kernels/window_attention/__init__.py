"""Paged window attention: the current chunk attends to its visible history pages, itself, extras.

One call computes, for every row (a request slot: one session x KV branch), plain bidirectional
softmax attention of the chunk's queries over

* the row's visible history tokens, read from the paged K/V pools through the row's page list,
* every token of the current chunk (``k_cur``/``v_cur``, passed directly, never written to a pool),
* every extra register token (``extra_k``/``extra_v``, e.g. action/state tokens), if given.

No causal mask; the only masking is which history slots hold valid tokens. The pools are never
written.

Shapes and units (``rows`` rows, token counts in tokens, page counts in pages):

=====================  ==============================================================  ===========
``q``                  ``[rows, q_len, num_q_heads, head_dim]``                        f32/bf16/f16
``k_cur``, ``v_cur``   ``[rows, cur_len, kv_heads, head_dim]`` (``cur_len >= 1``)      as ``q``
``extra_k/_v``         ``[rows, num_extra, kv_heads, head_dim]``, all valid            as ``q``
``k_pool``, ``v_pool`` ``[num_layers, kv_heads, num_pages, block_size, head_dim]``     as ``q``
                       (:func:`pallas_kernels.layout.pool_shape`)
``pages``              int32 ``[rows, max_pages]``: page ids into the pools (0 = null)
``lengths``            int32 ``[rows]``: valid history tokens, in ``[0, capacity]``
``layer``              int32 scalar (may be traced): which layer of the stacked pools
output                 ``[rows, q_len, num_q_heads, head_dim]``, ``q``'s dtype
=====================  ==============================================================  ===========

``num_q_heads`` is a multiple of ``kv_heads`` (GQA: query head ``h`` reads KV head
``h // (num_q_heads // kv_heads)``). The softmax scale defaults to ``head_dim ** -0.5``; logits,
softmax statistics and the output accumulator are float32.

Frame-aligned pages (:mod:`~pallas_kernels.window_attention.geometry`): a frame of
``tokens_per_frame`` tokens (default ``block_size``) fills ``pages_per_frame`` consecutive
page-list entries and ends in padding slots; a page list of ``max_pages`` entries holds at most
``history_capacity(max_pages, block_size, tokens_per_frame)`` tokens.

Masked keys and values are removed by selection (``jnp.where``), never by multiplying with a 0/1
mask, so NaN in free or foreign pages, in frame padding or past a row's length cannot reach the
output. Page-list entries past the last page holding a valid token are replaced by the layer's null
page before any read, and the Pallas kernels do not visit pages past it.

Validation (the rule of :mod:`pallas_kernels.common`, one ``validate=`` argument):

* always, traced or not: :func:`static_validate_inputs` (shapes, dtypes, tiles, ``scale``,
  ``tokens_per_frame``, and a Python-int ``layer`` in ``[0, num_layers)``);
* concrete values (an eager call; NumPy arrays; constants closed over by a jitted function), by
  default: :func:`check_values` reads ``pages``, ``lengths`` and an array ``layer`` on the host and
  refuses ids outside ``[0, num_pages)``, lengths outside ``[0, capacity]`` and a layer outside
  ``[0, num_layers)`` (the same checks as :func:`dynamic_validate_inputs`);
* traced values (under ``jit``, ``vmap``, ``shard_map``, ``scan``): not checked, nothing is added to
  the compiled program. The kernel reads only the null page past a row's visible pages and masks
  every slot at or past a row's length (a length past the capacity counts as the capacity), but a
  page id or layer out of range reads some other page of the pools (which one depends on the
  backend; it may hold another session's K/V). Pass ``validate="checkify"`` and run the jitted
  caller under ``jax.experimental.checkify`` (``err, out = checkify.checkify(jax.jit(step))(...)``,
  then ``err.throw()``) to have them checked.

``validate=False`` turns the value checks off (eager hot loops: the host check costs a
device-to-host copy and a sync per call); static checks still run.

Backends (``backend=``, the registry of :mod:`pallas_kernels.backend`, which also gives what
``"auto"`` picks and the platform each name needs): :data:`IMPLEMENTATIONS` maps every backend name
to this kernel's implementation, one module each: ``xla``
(:mod:`~pallas_kernels.window_attention.xla`, the CPU default), ``pallas_tpu*``
(:mod:`~pallas_kernels.window_attention.tpu`, Mosaic TPU, head-major pages DMA'd by hand),
``pallas_tpu_gather*`` (:mod:`~pallas_kernels.window_attention.tpu_gather`: the visible pages
gathered by XLA, then jax's splash attention; the TPU kernel's yardstick), ``pallas_gpu*``
(:mod:`~pallas_kernels.window_attention.gpu`, Triton), ``cudnn_gather*``
(:mod:`~pallas_kernels.window_attention.cudnn_gather`, history gather + cuDNN attention, the
default on NVIDIA GPUs) and ``pallas_mgpu`` (:mod:`~pallas_kernels.window_attention.mosaic_gpu`,
Mosaic GPU, Hopper and later). :func:`window_attention_reference`
(:mod:`~pallas_kernels.window_attention.reference`) is the pure-jnp reference they are tested
against.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

import jax
import jax.numpy as jnp

from pallas_kernels.backend import Backend, resolve_backend
from pallas_kernels.common import as_index_array, check_validate
from pallas_kernels.window_attention import cudnn_gather, gpu, mosaic_gpu, tpu, tpu_gather, xla
from pallas_kernels.window_attention.geometry import (
    WindowGeometry,
    history_capacity,
    history_slot_valid,
    layer_page_table,
    visible_page_count,
)
from pallas_kernels.window_attention.reference import window_attention_reference
from pallas_kernels.window_attention.validation import (
    check_values,
    dynamic_validate_inputs,
    static_validate_inputs,
)

__all__ = [
    "IMPLEMENTATIONS", "WindowGeometry", "check_values", "dynamic_validate_inputs",
    "history_capacity", "history_slot_valid", "layer_page_table", "static_validate_inputs",
    "visible_page_count", "window_attention", "window_attention_reference",
]


def window_attention(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, *, layer=0, extra_k=None,
                     extra_v=None, scale=None, tokens_per_frame=None, backend="auto",
                     block_q=None, block_k=None, validate=True):
    """Attention of the current chunk over its visible history pages, itself and extra tokens.

    Args:
      q: ``[rows, q_len, num_q_heads, head_dim]`` queries (f32, bf16 or f16).
      k_cur, v_cur: ``[rows, cur_len, kv_heads, head_dim]`` the current chunk's keys/values.
      k_pool, v_pool: ``[num_layers, kv_heads, num_pages, block_size, head_dim]`` paged pools
        (:func:`pallas_kernels.layout.pool_shape`; read only; page 0 is the null page).
      pages: int ``[rows, max_pages]`` each row's page list (frame after frame, unused entries 0),
        ids in ``[0, num_pages)``; a nested list of ints is taken as int32.
      lengths: int ``[rows]`` valid history tokens per row, in ``[0, capacity]``; a list of ints is
        taken as int32.
      layer: int scalar, possibly traced: the pool layer to read, in ``[0, num_layers)``. A Python
        int is static (its range is checked on every call); an int array is a value (checked as
        ``pages`` is).
      extra_k, extra_v: optional ``[rows, num_extra, kv_heads, head_dim]`` register tokens (both or
        neither).
      scale: softmax scale; defaults to ``head_dim ** -0.5``.
      tokens_per_frame: tokens per frame; defaults to ``block_size``.
      backend: a name from :data:`pallas_kernels.backend.BACKEND_NAMES` (the implementation run
        is ``IMPLEMENTATIONS[resolved name]``).
      block_q: query tile (Pallas backends): Triton's over the GQA-folded query axis (default
        128, shrunk for short chunks), TPU's (default tuned per generation,
        :data:`~pallas_kernels.window_attention.tpu.TUNED_BLOCKS`), Mosaic GPU's (64 only).
      block_k: key tile in tokens: Triton key block (power of two in [16, 256], default 64), TPU
        history keys per DMA block (a multiple of 8, default tuned; history pages are always whole
        pages on TPU) or Mosaic GPU key tile (a multiple of 64 dividing ``block_size``, default 128
        where it divides). Unused by ``xla``, ``cudnn_gather*`` and ``pallas_tpu_gather*`` (there
        still ``None`` or a positive int).
      validate: the value checks of ``pages``, ``lengths`` and an array ``layer`` (the module
        docstring): ``True`` checks concrete values on the host, ``False`` checks none,
        ``"checkify"`` also checks traced ones with ``checkify.check`` (run under
        ``checkify.checkify``). Static arguments are checked whatever it says.

    Returns:
      ``[rows, q_len, num_q_heads, head_dim]`` in ``q``'s dtype.

    Raises:
      ValueError: what :func:`static_validate_inputs` rejects; with ``validate`` not ``False``, a
        concrete page id, length or array layer out of its range (nothing is computed).
      TypeError: an input that is not an array (``pages``/``lengths`` may be lists of ints), a
        non-integer ``layer``.
    """
    pages = as_index_array("pages", pages)
    lengths = as_index_array("lengths", lengths)
    check_validate(validate)
    geom = static_validate_inputs(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, layer=layer,
                                  extra_k=extra_k, extra_v=extra_v, scale=scale,
                                  tokens_per_frame=tokens_per_frame, backend=backend,
                                  block_q=block_q, block_k=block_k)
    check_values(geom, pages, lengths, layer, validate=validate)
    resolved = resolve_backend(backend, dtype=q.dtype, head_dim=geom.head_dim)
    scale = geom.head_dim ** -0.5 if scale is None else float(scale)
    layer = jnp.asarray(layer, jnp.int32)
    return IMPLEMENTATIONS[resolved.name](q, k_cur, v_cur, extra_k, extra_v, k_pool, v_pool, pages,
                                          lengths, layer, geom=geom, scale=scale, block_q=block_q,
                                          block_k=block_k, backend=resolved)


# The implementations of the registry, one signature (:data:`IMPLEMENTATIONS`).

def _xla(*args, geom: WindowGeometry, scale: float, block_q, block_k, backend: Backend):
    return xla.window_attention(*args, geom=geom, scale=scale)


def _pallas_tpu(*args, geom: WindowGeometry, scale: float, block_q, block_k, backend: Backend):
    return tpu._attention(*args, geom=geom, scale=scale, block_q=block_q, block_k=block_k,
                          backend=backend.name)


def _pallas_tpu_gather(*args, geom: WindowGeometry, scale: float, block_q, block_k,
                       backend: Backend):
    return tpu_gather._attention(*args, geom=geom, scale=scale, backend=backend.name)


def _pallas_gpu(*args, geom: WindowGeometry, scale: float, block_q, block_k, backend: Backend):
    block_q, block_k = gpu.tiles(geom, block_q, block_k)
    return gpu.window_attention(*args, geom=geom, scale=scale, block_q=block_q, block_k=block_k,
                                backend=backend.name)


def _cudnn_gather(*args, geom: WindowGeometry, scale: float, block_q, block_k, backend: Backend):
    return cudnn_gather.window_attention(*args, geom=geom, scale=scale, backend=backend.name)


def _pallas_mgpu(*args, geom: WindowGeometry, scale: float, block_q, block_k, backend: Backend):
    block_kv = mosaic_gpu.default_block_kv(geom.block_size) if block_k is None else block_k
    return mosaic_gpu.window_attention(*args, geom=geom, scale=scale, block_kv=int(block_kv))


IMPLEMENTATIONS: Mapping[str, Callable[..., jax.Array]] = MappingProxyType({
    "xla": _xla,
    "pallas_tpu": _pallas_tpu,
    "pallas_tpu_interpret": _pallas_tpu,
    "pallas_tpu_simulate": _pallas_tpu,
    "pallas_tpu_gather": _pallas_tpu_gather,
    "pallas_tpu_gather_interpret": _pallas_tpu_gather,
    "pallas_gpu": _pallas_gpu,
    "pallas_gpu_interpret": _pallas_gpu,
    "cudnn_gather": _cudnn_gather,
    "cudnn_gather_xla": _cudnn_gather,
    "pallas_mgpu": _pallas_mgpu,
})
"""This kernel's table of the backend registry (:data:`pallas_kernels.backend.BACKENDS`, the same
names): backend name to implementation, each called as ``impl(q, k_cur, v_cur, extra_k, extra_v,
k_pool, v_pool, pages, lengths, layer, *, geom, scale, block_q, block_k, backend)`` on inputs
:func:`window_attention` has validated (``layer`` an int32 scalar, ``extra_k``/``extra_v``
possibly ``None``, ``geom`` the call's :class:`WindowGeometry`, ``scale`` a float, ``backend`` the
resolved :class:`~pallas_kernels.backend.Backend`), returning the output."""
