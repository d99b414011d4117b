"""The cross query of a DiT block: self-attention's output projection added to the residual under
its per-frame gate, then the cross-attention's RMS-normalized queries of the layer-normalized
result, with the weights taken from the model's stacked ``[L, ...]`` arrays at a layer index, as
one call.

:func:`cross_query` is the entry point (its docstring tables the shapes); it checks the call and
runs the ``backend=`` name's implementation from :data:`IMPLEMENTATIONS`: plain XLA
(:mod:`~pallas_kernels.cross_query.xla`, also the reference) or a Mosaic TPU kernel
(:mod:`~pallas_kernels.cross_query.tpu`) that keeps each block of tokens in VMEM from the first
product to the queries and writes the residual over ``x``. Design and figures:
``docs/kernels.md`` (cross query).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp

from pallas_kernels.backend import Backend, resolve_backend, tpu_kernel_else_xla
from pallas_kernels.checks import require_index, require_real
from pallas_kernels.common import (
    check_rank,
    check_same_dtype,
    check_supported_dtype,
    check_validate,
    stacked_layer,
)
from pallas_kernels.cross_query import tpu, xla
from pallas_kernels.cross_query.geometry import KERNEL_PREFIX, QueryGeometry, geometry_of_kernel, kernel_name

__all__ = ["IMPLEMENTATIONS", "KERNEL_PREFIX", "QueryGeometry", "cross_query", "geometry_of_kernel", "kernel_name",
           "static_validate_inputs"]

_WEIGHTS = ("w_o", "b_o", "norm_scale", "norm_bias", "w_q", "b_q", "q_gain")


def cross_query(x, attention, gate, w_o, b_o, norm_scale, norm_bias, w_q, b_q, q_gain, layer, *, eps=1e-6,
                backend="auto", validate=True):
    """One DiT block's step from self- to cross-attention: ``x + gate * (attention @ w_o + b_o)``,
    and the cross-attention's queries ``rms_norm(layer_norm(that) @ w_q + b_q)``.

    ==========================  ===================  ==========================
    ``x``                       ``[B, N, dim]``      f32, bf16, f16
    ``attention``               ``[B, N, dim]``      ``w_o``'s dtype
    ``gate``                    ``[B, F, dim]``      ``x``'s dtype
    ``w_o``, ``w_q``            ``[L, dim, dim]``    f32, bf16, f16
    ``b_o``, ``b_q``,           ``[L, dim]``         ``w_o``'s dtype
    ``q_gain``
    ``norm_scale``,             ``[L, dim]``         ``x``'s dtype
    ``norm_bias``
    ``layer``                   scalar               integer, in ``[0, L)``
    output                      ``[B, N, dim]``      ``x``'s dtype
    queries                     ``[B, N, dim]``      ``w_o``'s dtype
    ==========================  ===================  ==========================

    Token ``n`` belongs to frame ``n // (N // F)`` (``F`` divides ``N``) and reads that frame's
    gate. Each linear layer computes in the weights' dtype (the product accumulated in float32
    and rounded once, then the bias added, :func:`~pallas_kernels.cross_query.xla.linear`); the
    gated product is added to ``x`` in ``x``'s dtype; the layer norm (with ``norm_scale`` and
    ``norm_bias``) keeps its statistics in at least float32 and its output, in ``x``'s dtype, is
    cast to the weights' dtype; the RMS norm (gain ``q_gain``) computes in float32
    (:func:`~pallas_kernels.cross_query.xla.rms_norm`). Both norms take ``eps``.

    Args:
      x: the residual stream (a donated ``x`` is overwritten in place on a TPU).
      attention: self-attention's output, its heads concatenated, before the output projection.
      gate: the frame's self-attention gate rows.
      w_o, b_o: self-attention's output projection of every layer.
      norm_scale, norm_bias: the cross-attention input norm's affine parameters of every layer.
      w_q, b_q, q_gain: the cross-attention's query projection and RMS-norm gain of every layer.
      layer: which layer's weights (a Python int or an integer array; may be traced).
      eps: the norms' epsilon (a positive real).
      backend: a name from :data:`pallas_kernels.backend.BACKEND_NAMES`. The TPU names run the
        Mosaic kernel where both weights and a block of a frame's tokens fit its VMEM
        (:func:`~pallas_kernels.cross_query.tpu.block_rows`), else XLA; the others XLA.
      validate: the value check of an array ``layer`` (:data:`pallas_kernels.common.VALIDATE_MODES`);
        unchecked, a layer out of range reads some other part of the weights' buffers.

    Returns:
      ``(output, queries)``.

    Raises:
      TypeError: an input that is not an array, a layer that is not an integer scalar, an ``eps``
        that is not a real number.
      ValueError: mismatched shapes or dtypes, a layer out of range, a non-positive ``eps``, an
        unknown backend.
    """
    resolved = resolve_backend(backend)
    check_validate(validate)
    eps = require_real("eps", eps, low=0.0, low_open=True)
    weights = (w_o, b_o, norm_scale, norm_bias, w_q, b_q, q_gain)
    geom = static_validate_inputs(x, attention, gate, *weights, layer)
    layer = stacked_layer(layer, w_o.shape[0], "w_o.shape[0]", validate)
    return IMPLEMENTATIONS[resolved.name](x, attention, gate, *weights, layer, eps=eps, geom=geom, backend=resolved)


def static_validate_inputs(x, attention, gate, w_o, b_o, norm_scale, norm_bias, w_q, b_q, q_gain, layer
                           ) -> QueryGeometry:
    """The call's :class:`QueryGeometry`, or the error :func:`cross_query` raises."""
    check_rank("x", x, 3, "[B, N, dim]")
    check_rank("attention", attention, 3, "[B, N, dim]")
    check_rank("gate", gate, 3, "[B, F, dim]")
    weights = (w_o, b_o, norm_scale, norm_bias, w_q, b_q, q_gain)
    for name, array in zip(_WEIGHTS, weights):
        matrix = name.startswith("w_")
        check_rank(name, array, 3 if matrix else 2, "[L, dim, dim]" if matrix else "[L, dim]")
    require_index("layer", layer, w_o.shape[0], "w_o.shape[0]")
    check_supported_dtype("x.dtype", x.dtype)
    check_supported_dtype("w_o.dtype", w_o.dtype)
    check_same_dtype("x", x.dtype, (("gate", gate), ("norm_scale", norm_scale), ("norm_bias", norm_bias)))
    check_same_dtype("w_o", w_o.dtype, (("attention", attention), ("b_o", b_o), ("w_q", w_q), ("b_q", b_q),
                                        ("q_gain", q_gain)))
    batch, tokens, dim = x.shape
    if min(x.shape) < 1 or w_o.shape[0] < 1:
        raise ValueError(f"every dimension of x and w_o must be positive, got x {tuple(x.shape)}, "
                         f"w_o {tuple(w_o.shape)}")
    num_layers = w_o.shape[0]
    if tuple(attention.shape) != tuple(x.shape):
        raise ValueError(f"attention.shape must be x's {tuple(x.shape)}, got {tuple(attention.shape)}")
    for name, array in zip(_WEIGHTS, weights):
        expected = (num_layers, dim, dim) if name.startswith("w_") else (num_layers, dim)
        if tuple(array.shape) != expected:
            raise ValueError(f"{name}.shape must be {expected} (L of w_o, dim of x), got {tuple(array.shape)}")
    frames = gate.shape[1]
    if gate.shape[0] != batch or gate.shape[2] != dim or frames < 1 or tokens % frames:
        raise ValueError(f"gate.shape must be ({batch}, F, {dim}) with F dividing N = {tokens}, got "
                         f"{tuple(gate.shape)}")
    return QueryGeometry(batch * tokens, dim, tokens // frames)


# The implementations of the registry, one signature (:data:`IMPLEMENTATIONS`).

def _xla(x, attention, gate, *weights_and_layer, eps: float, geom: QueryGeometry, backend: Backend):
    return xla.cross_query(x, attention, gate, *weights_and_layer, eps=eps)


def _pallas_tpu(x, attention, gate, *weights_and_layer, eps: float, geom: QueryGeometry, backend: Backend):
    rows = tpu.block_rows(geom, jnp.dtype(attention.dtype).itemsize, jnp.dtype(x.dtype).itemsize)
    if rows is None:
        return _xla(x, attention, gate, *weights_and_layer, eps=eps, geom=geom, backend=backend)
    return tpu.cross_query(x, attention, gate, *weights_and_layer, eps=eps, rows_per_block=rows,
                           interpret=backend.interpret)


IMPLEMENTATIONS: Mapping[str, Callable[..., tuple[jax.Array, jax.Array]]] = tpu_kernel_else_xla(_pallas_tpu, _xla)
"""This kernel's table of the backend registry (:data:`pallas_kernels.backend.BACKENDS`, the same
names): backend name to implementation, called as ``impl(x, attention, gate, w_o, b_o, norm_scale,
norm_bias, w_q, b_q, q_gain, layer, *, eps, geom, backend)`` on validated inputs. The TPU names run
the Mosaic kernel where its blocks fit; every other name runs XLA."""
