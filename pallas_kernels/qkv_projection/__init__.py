"""The q/k/v projection of a DiT block's self-attention: the queries, keys and values of one input,
the queries and keys RMS-normalized over all their heads, with the weights taken from the model's
stacked ``[L, ...]`` arrays at a layer index, as one call.

:func:`qkv_projection` is the entry point (its docstring tables the shapes); it checks the call and
runs the ``backend=`` name's implementation from :data:`IMPLEMENTATIONS`: plain XLA
(:mod:`~pallas_kernels.qkv_projection.xla`, also the reference) or a Mosaic TPU kernel
(:mod:`~pallas_kernels.qkv_projection.tpu`) that reads each block of tokens once for all three
products. Design and figures: ``docs/kernels.md`` (q/k/v projection).
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
from pallas_kernels.qkv_projection import tpu, xla
from pallas_kernels.qkv_projection.geometry import (
    KERNEL_PREFIX,
    ProjectionGeometry,
    geometry_of_kernel,
    kernel_name,
)

__all__ = ["IMPLEMENTATIONS", "KERNEL_PREFIX", "ProjectionGeometry", "geometry_of_kernel", "kernel_name",
           "qkv_projection", "static_validate_inputs"]

_WEIGHTS = ("w_q", "b_q", "q_gain", "w_k", "b_k", "k_gain", "w_v", "b_v")


def qkv_projection(x, w_q, b_q, q_gain, w_k, b_k, k_gain, w_v, b_v, layer, *, eps=1e-6, backend="auto",
                   validate=True):
    """Self-attention's projections of ``x``: ``(rms_norm(x @ w_q + b_q), rms_norm(x @ w_k + b_k),
    x @ w_v + b_v)``.

    ======================  ======================  ==========================
    ``x``                   ``[B, N, dim]``         f32, bf16, f16
    ``w_q``                 ``[L, dim, dim]``       ``x``'s dtype
    ``b_q``, ``q_gain``     ``[L, dim]``            ``x``'s dtype
    ``w_k``, ``w_v``        ``[L, dim, kv_dim]``    ``x``'s dtype
    ``b_k``, ``k_gain``,    ``[L, kv_dim]``         ``x``'s dtype
    ``b_v``
    ``layer``               scalar                  integer, in ``[0, L)``
    queries                 ``[B, N, dim]``         ``x``'s dtype
    keys, values            ``[B, N, kv_dim]``      ``x``'s dtype
    ======================  ======================  ==========================

    Each linear layer computes in ``x``'s dtype (the product accumulated in float32 and rounded
    once, then the bias added, :func:`~pallas_kernels.cross_query.xla.linear`); the RMS norms
    (gains ``q_gain``, ``k_gain``) compute in float32 over all of a token's heads
    (:func:`~pallas_kernels.cross_query.xla.rms_norm`), as ``flax.nnx.RMSNorm`` does.

    Args:
      x: the normalized, modulated tokens (a DiT block's attention input).
      w_q, b_q, q_gain, w_k, b_k, k_gain, w_v, b_v: every layer's projections and norm gains.
      layer: which layer's weights (a Python int or an integer array; may be traced).
      eps: the norms' epsilon (a positive real).
      backend: a name from :data:`pallas_kernels.backend.BACKEND_NAMES`. The TPU names run the
        Mosaic kernel where the weights and a block of tokens fit its VMEM
        (:func:`~pallas_kernels.qkv_projection.tpu.block_rows`), else XLA; the others XLA.
      validate: the value check of an array ``layer`` (:data:`pallas_kernels.common.VALIDATE_MODES`);
        unchecked, a layer out of range reads some other part of the weights' buffers.

    Returns:
      ``(q, k, v)``.

    Raises:
      TypeError: an input that is not an array, a layer that is not an integer scalar, an ``eps``
        that is not a real number.
      ValueError: mismatched shapes or dtypes, a layer out of range, a non-positive ``eps``, an
        unknown backend.
    """
    resolved = resolve_backend(backend)
    check_validate(validate)
    eps = require_real("eps", eps, low=0.0, low_open=True)
    weights = (w_q, b_q, q_gain, w_k, b_k, k_gain, w_v, b_v)
    geom = static_validate_inputs(x, *weights, layer)
    layer = stacked_layer(layer, w_q.shape[0], "w_q.shape[0]", validate)
    return IMPLEMENTATIONS[resolved.name](x, *weights, layer, eps=eps, geom=geom, backend=resolved)


def static_validate_inputs(x, w_q, b_q, q_gain, w_k, b_k, k_gain, w_v, b_v, layer) -> ProjectionGeometry:
    """The call's :class:`ProjectionGeometry`, or the error :func:`qkv_projection` raises."""
    check_rank("x", x, 3, "[B, N, dim]")
    weights = (w_q, b_q, q_gain, w_k, b_k, k_gain, w_v, b_v)
    for name, array in zip(_WEIGHTS, weights):
        matrix = name.startswith("w_")
        check_rank(name, array, 3 if matrix else 2, "[L, dim, n]" if matrix else "[L, n]")
    require_index("layer", layer, w_q.shape[0], "w_q.shape[0]")
    check_supported_dtype("x.dtype", x.dtype)
    check_same_dtype("x", x.dtype, tuple(zip(_WEIGHTS, weights)))
    if min(x.shape) < 1 or min(w_q.shape) < 1 or w_k.shape[2] < 1:
        raise ValueError(f"every dimension of x, w_q and w_k must be positive, got x {tuple(x.shape)}, "
                         f"w_q {tuple(w_q.shape)}, w_k {tuple(w_k.shape)}")
    num_layers, dim, kv_dim = w_q.shape[0], x.shape[2], w_k.shape[2]
    for name, array in zip(_WEIGHTS, weights):
        width = dim if name in ("w_q", "b_q", "q_gain") else kv_dim
        expected = (num_layers, dim, width) if name.startswith("w_") else (num_layers, width)
        if tuple(array.shape) != expected:
            raise ValueError(f"{name}.shape must be {expected} (L of w_q, dim of x, kv_dim of w_k), got "
                             f"{tuple(array.shape)}")
    return ProjectionGeometry(x.shape[0] * x.shape[1], dim, kv_dim)


# The implementations of the registry, one signature (:data:`IMPLEMENTATIONS`).

def _xla(x, *weights_and_layer, eps: float, geom: ProjectionGeometry, backend: Backend):
    return xla.qkv_projection(x, *weights_and_layer, eps=eps)


def _pallas_tpu(x, *weights_and_layer, eps: float, geom: ProjectionGeometry, backend: Backend):
    rows = tpu.block_rows(geom, jnp.dtype(x.dtype).itemsize)
    if rows is None:
        return _xla(x, *weights_and_layer, eps=eps, geom=geom, backend=backend)
    return tpu.qkv_projection(x, *weights_and_layer, eps=eps, rows_per_block=rows, interpret=backend.interpret)


IMPLEMENTATIONS: Mapping[str, Callable[..., tuple[jax.Array, jax.Array, jax.Array]]] = tpu_kernel_else_xla(
    _pallas_tpu, _xla)
"""This kernel's table of the backend registry (:data:`pallas_kernels.backend.BACKENDS`, the same
names): backend name to implementation, called as ``impl(x, w_q, b_q, q_gain, w_k, b_k, k_gain,
w_v, b_v, layer, *, eps, geom, backend)`` on validated inputs. The TPU names run the Mosaic kernel
where its blocks fit; every other name runs XLA."""
