"""The cross query in plain XLA (every backend but the TPU ones, and the reference), and the pieces
the TPU kernel shares with it. Semantics and shapes: :func:`pallas_kernels.cross_query.cross_query`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.adaln_mlp.xla import layer_norm, per_token


def linear(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
    """``x @ w + b`` in ``w``'s dtype, as ``flax.nnx.Linear`` computes it: ``x`` cast to it, the
    product in that dtype (accumulated in float32 and rounded once), then the bias added."""
    return jnp.dot(x.astype(w.dtype), w) + b


def rms_norm(x: jax.Array, gain: jax.Array, eps: float) -> jax.Array:
    """RMS norm over the last axis, as ``flax.nnx.RMSNorm`` computes it: ``x * (rsqrt(mean(x^2) +
    eps) * gain)`` in float32, the result in ``x``'s dtype."""
    x32 = x.astype(jnp.float32)
    inv_rms = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * (inv_rms * gain.astype(jnp.float32))).astype(x.dtype)


def residual_and_query(x, attention, gate, w_o, b_o, norm_scale, norm_bias, w_q, b_q, q_gain, *, eps):
    """The call on one layer's weights (``w_o``/``w_q`` ``[dim, dim]``, the vectors ``[dim]`` or
    ``[1, dim]``) with ``gate`` broadcast against ``x``: ``(x + gate * linear(attention, w_o, b_o),
    rms_norm(linear(layer_norm(that), w_q, b_q)))``."""
    x = x + linear(attention, w_o, b_o).astype(x.dtype) * gate
    query = linear(layer_norm(x, eps, norm_scale, norm_bias), w_q, b_q)
    return x, rms_norm(query, q_gain, eps)


def cross_query(x, attention, gate, w_o, b_o, norm_scale, norm_bias, w_q, b_q, q_gain, layer, *, eps):
    """The reference: :func:`residual_and_query` on layer ``layer`` of the stacks, the per-frame
    gate broadcast to its tokens (:func:`~pallas_kernels.adaln_mlp.xla.per_token`)."""
    weights = (stack[layer] for stack in (w_o, b_o, norm_scale, norm_bias, w_q, b_q, q_gain))
    return residual_and_query(x, attention, per_token(gate, x.shape[1]), *weights, eps=eps)
