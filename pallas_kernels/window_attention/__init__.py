"""Paged window attention: the current chunk attends to its visible history pages, itself, extras.

:func:`window_attention` is the entry point; its docstring tables the shapes. It computes plain
bidirectional softmax attention (no causal mask; the pools are read only), checks the call
(:func:`static_validate_inputs`, then the values under ``validate=``: :func:`check_values`;
:func:`dynamic_validate_inputs` reads every value on the host) and runs the ``backend=`` name's
implementation from :data:`IMPLEMENTATIONS`, one module per backend: ``xla``, ``tpu`` (Mosaic),
``tpu_gather`` (gather, then splash), ``gpu`` (Triton), ``cudnn_gather`` and ``mosaic_gpu``. The
frame-aligned page rules live in :mod:`~pallas_kernels.window_attention.geometry`;
:func:`window_attention_reference` is the pure-jnp reference. Semantics and each backend's design:
``docs/kernels.md`` (Paged window attention).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

import jax
import jax.numpy as jnp

from pallas_kernels.backend import Backend, resolve_backend
from pallas_kernels.common import as_index_array, check_validate
from pallas_kernels.rope import prepare_qk
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
                     block_q=None, block_k=None, validate=True, rope=None, qk_norm=None):
    """Attention of the current chunk over its visible history pages, itself and extra tokens.

    For every row (a request slot: one session x KV branch) the chunk's queries attend to the row's
    visible history tokens, read from the stacked pools through its page list, to every token of
    the current chunk (passed directly, never written to a pool) and to every extra register token
    (e.g. action or state tokens), if given. The only masking is which history slots hold valid
    tokens, and it selects (NaN in free or foreign pages, frame padding or past a row's length
    never reaches the output).

    Shapes (token counts in tokens, page counts in pages):

    =====================  =============================================================  ==============
    ``q``                  ``[rows, q_len, num_q_heads, head_dim]``                       f32, bf16, f16
    ``k_cur``, ``v_cur``   ``[rows, cur_len, kv_heads, head_dim]`` (``cur_len >= 1``)     ``q``'s dtype
    ``extra_k/_v``         ``[rows, num_extra, kv_heads, head_dim]``, all valid           ``q``'s dtype
    ``k_pool``, ``v_pool`` ``[num_layers, kv_heads, num_pages, block_size, head_dim]``    ``q``'s dtype
                           (:func:`pallas_kernels.layout.pool_shape`)
    ``pages``              ``[rows, max_pages]``: page ids, 0 the null page               integer
    ``lengths``            ``[rows]``: valid history tokens, in ``[0, capacity]``         integer
    ``layer``              scalar: the pool layer, in ``[0, num_layers)``                 integer
    output                 ``[rows, q_len, num_q_heads, head_dim]``                       ``q``'s dtype
    =====================  =============================================================  ==============

    ``num_q_heads`` is a multiple of ``kv_heads`` (GQA). ``capacity`` is
    ``history_capacity(max_pages, block_size, tokens_per_frame)``: a frame fills
    ``ceil(tokens_per_frame / block_size)`` consecutive page-list entries and ends in padding slots.
    The pools may instead be :class:`~pallas_kernels.layout.QuantizedPool` s (int8/fp8 values,
    float32 scales ``[num_layers, kv_heads, num_pages]``), dequantized to ``q``'s dtype as they are
    read (every backend).

    Args:
      q, k_cur, v_cur: the chunk's queries, keys and values.
      k_pool, v_pool: the stacked pools (read only).
      pages: each row's page list, frame after frame, unused entries 0; a nested list of ints is
        taken as int32.
      lengths: each row's valid history tokens; a list of ints is taken as int32.
      layer: possibly traced. A Python int is static (its range is checked on every call); an int
        array is a value (checked as ``pages`` is).
      extra_k, extra_v: optional register tokens (both or neither).
      scale: softmax scale; defaults to ``head_dim ** -0.5``. Logits, softmax statistics and the
        accumulator are float32.
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
      rope: optional ``(cos, sin)``, float32 ``[rows, q_len, head_dim]`` each
        (:func:`arkv_jax.nnx.rope_tables`): ``q`` and ``k_cur`` are then taken before their rotary
        embedding and rotated by it (:func:`pallas_kernels.rope.apply_rope`; ``q_len`` must equal
        ``cur_len``); extras and history keys are read as they are. The ``pallas_tpu*`` backends
        rotate inside the kernel where they read the chunk token-major
        (:func:`pallas_kernels.common.token_major_blocks`), the others before the call.
      qk_norm: optional ``(q_inv_rms, k_inv_rms, q_gain, k_gain)``: float32 ``[rows, q_len]`` and
        ``[rows, cur_len]``, floating ``[num_q_heads * head_dim]`` and ``[kv_heads * head_dim]``:
        ``q`` and ``k_cur`` are then the raw projections, RMS-normalized by their tokens'
        inverse RMS and the features' gains before RoPE (:func:`pallas_kernels.rope.normalize`).
        Inside the kernel where it rotates and there are no extras, else before the call.
      validate: the value checks of ``pages``, ``lengths`` and an array ``layer``
        (:data:`pallas_kernels.common.VALIDATE_MODES`): ``True`` checks concrete values on the host,
        ``False`` checks none, ``"checkify"`` also checks traced ones with ``checkify.check`` (run
        under ``checkify.checkify``). Static arguments are checked whatever it says. Unchecked, the
        kernel reads only the null page past a row's visible pages and masks every slot at or past a
        row's length (a length past the capacity counts as the capacity), but a page id or layer
        out of range reads some other page of the pools, possibly another session's K/V.

    Returns:
      the output of the table: ``q``'s shape and dtype.

    Raises:
      ValueError: what :func:`static_validate_inputs` rejects; with ``validate`` not ``False``, a
        concrete page id, length or array layer out of its range (nothing is computed).
      TypeError: an input that is not an array (``pages``/``lengths`` may be lists of ints), a
        non-integer ``layer``, a static argument of the wrong type (:mod:`pallas_kernels.checks`).
    """
    pages = as_index_array("pages", pages)
    lengths = as_index_array("lengths", lengths)
    check_validate(validate)
    geom = static_validate_inputs(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, layer=layer,
                                  extra_k=extra_k, extra_v=extra_v, scale=scale,
                                  tokens_per_frame=tokens_per_frame, backend=backend,
                                  block_q=block_q, block_k=block_k, rope=rope, qk_norm=qk_norm)
    check_values(geom, pages, lengths, layer, validate=validate)
    resolved = resolve_backend(backend, dtype=q.dtype, head_dim=geom.head_dim)
    scale = geom.head_dim ** -0.5 if scale is None else float(scale)
    layer = jnp.asarray(layer, jnp.int32)
    return IMPLEMENTATIONS[resolved.name](q, k_cur, v_cur, extra_k, extra_v, k_pool, v_pool, pages,
                                          lengths, layer, geom=geom, scale=scale, block_q=block_q,
                                          block_k=block_k, backend=resolved, rope=rope, qk_norm=qk_norm)


# The implementations of the registry, one signature (:data:`IMPLEMENTATIONS`). The TPU kernel
# prepares the chunk's queries and keys itself; the others take them prepared by XLA.

def _prepared(args: tuple, rope, qk_norm) -> tuple:
    """The implementations' positional arguments with ``q`` and ``k_cur`` (the first two)
    normalized and rotated (:func:`pallas_kernels.rope.prepare_qk`)."""
    return (*prepare_qk(args[0], args[1], rope, qk_norm), *args[2:])


def _xla(*args, geom: WindowGeometry, scale: float, block_q, block_k, backend: Backend, rope, qk_norm):
    return xla.window_attention(*_prepared(args, rope, qk_norm), geom=geom, scale=scale)


def _pallas_tpu(*args, geom: WindowGeometry, scale: float, block_q, block_k, backend: Backend, rope,
                qk_norm):
    return tpu._attention(*args, geom=geom, scale=scale, block_q=block_q, block_k=block_k,
                          backend=backend.name, rope=rope, qk_norm=qk_norm)


def _pallas_tpu_gather(*args, geom: WindowGeometry, scale: float, block_q, block_k,
                       backend: Backend, rope, qk_norm):
    return tpu_gather._attention(*_prepared(args, rope, qk_norm), geom=geom, scale=scale,
                                 backend=backend.name)


def _pallas_gpu(*args, geom: WindowGeometry, scale: float, block_q, block_k, backend: Backend, rope,
                qk_norm):
    block_q, block_k = gpu.tiles(geom, block_q, block_k)
    return gpu.window_attention(*_prepared(args, rope, qk_norm), geom=geom, scale=scale, block_q=block_q,
                                block_k=block_k, backend=backend.name)


def _cudnn_gather(*args, geom: WindowGeometry, scale: float, block_q, block_k, backend: Backend, rope,
                  qk_norm):
    return cudnn_gather.window_attention(*_prepared(args, rope, qk_norm), geom=geom, scale=scale,
                                         backend=backend.name)


def _pallas_mgpu(*args, geom: WindowGeometry, scale: float, block_q, block_k, backend: Backend, rope,
                 qk_norm):
    block_kv = mosaic_gpu.default_block_kv(geom.block_size) if block_k is None else block_k
    return mosaic_gpu.window_attention(*_prepared(args, rope, qk_norm), geom=geom, scale=scale,
                                       block_kv=int(block_kv))


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
k_pool, v_pool, pages, lengths, layer, *, geom, scale, block_q, block_k, backend, rope,
qk_norm)`` on inputs :func:`window_attention` has validated (``layer`` an int32 scalar, ``extra_k``/``extra_v``
possibly ``None``, ``geom`` the call's :class:`WindowGeometry`, ``scale`` a float, ``backend`` the
resolved :class:`~pallas_kernels.backend.Backend`, ``rope`` and ``qk_norm`` possibly ``None``),
returning the output."""
