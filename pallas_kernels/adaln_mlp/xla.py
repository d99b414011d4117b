"""The adaLN MLP in plain XLA (every backend but the TPU ones, and the reference), and the pieces
the TPU kernel shares with it. Semantics and shapes: :func:`pallas_kernels.adaln_mlp.adaln_mlp`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.window_attention.tpu import default_generation


def per_token(values: jax.Array, num_tokens: int) -> jax.Array:
    """``values`` ``[B, F, dim]`` (one row per frame) as ``[B, num_tokens, dim]``, each of a frame's
    ``num_tokens // F`` tokens reading its frame's row, written as a chain of selects on the
    token's frame index.

    XLA fuses the selects into the consumer. Through a ``[B, F, tpf, dim]`` view, XLA:TPU
    materialized each broadcast as a whole ``f32[F, tpf, dim]`` array; frame by frame, with the
    pieces concatenated, it materialized the per-frame results and built the concatenation from
    full-size pads (``docs/planning.md``, The whole chip)."""
    num_frames = values.shape[1]
    frame = jax.lax.broadcasted_iota(jnp.int32, (1, num_tokens, 1), 1) // (num_tokens // num_frames)
    out = jnp.broadcast_to(values[:, :1], (values.shape[0], num_tokens, values.shape[2]))
    for f in range(1, num_frames):
        out = jnp.where(frame == f, values[:, f:f + 1], out)
    return out


def layer_norm(x: jax.Array, eps: float, scale: jax.Array | None = None, bias: jax.Array | None = None
               ) -> jax.Array:
    """Layer norm over the last axis, as ``flax.nnx.LayerNorm`` computes it: statistics in at
    least float32 (the variance as ``E[x^2] - E[x]^2``, clipped at 0), ``(x - mean) * (rsqrt(var +
    eps) * scale) + bias`` (each of ``scale``/``bias`` ``[..., dim]`` where given), the result in
    ``x``'s dtype."""
    x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.maximum(0.0, jnp.mean(jnp.square(x32), axis=-1, keepdims=True) - jnp.square(mean))
    mul = jax.lax.rsqrt(var + eps)
    if scale is not None:
        mul = mul * scale
    y = (x32 - mean) * mul
    if bias is not None:
        y = y + bias
    return y.astype(x.dtype)


def modulated_input(x: jax.Array, shift: jax.Array, scale: jax.Array, eps: float, dtype) -> jax.Array:
    """The MLP's input: ``layer_norm(x) * (1 + scale) + shift`` (``shift``/``scale`` broadcast
    against ``x``, in its dtype), cast to the matmul ``dtype``."""
    return (layer_norm(x, eps) * (1 + scale) + shift).astype(dtype)


def gelu(h: jax.Array) -> jax.Array:
    """The MLP's activation: GELU with the tanh approximation, in ``h``'s dtype."""
    return jax.nn.gelu(h, approximate=True)


def materializes_ffn_input() -> bool:
    """Whether the XLA path writes the MLP's normalized, modulated input to memory before the
    FFN-in matmul (an ``optimization_barrier``): on a v6e, the chip the program is built for
    (:func:`pallas_kernels.window_attention.tpu.default_generation`). There XLA:TPU otherwise fuses the norm and the
    modulation into the matmul and recomputes them for every output tile; on a v5e the slower MXU
    hides that and writing the input costs more (``docs/planning.md``, The whole chip)."""
    return default_generation() == "v6e"


def adaln_mlp(x, shift, scale, gate, w_in, b_in, w_out, b_out, layer, *, eps, next_modulation=None,
              residual_input=None):
    """``x + gate * mlp(modulated_input(x))`` with layer ``layer`` of the stacked weights, the
    per-frame rows broadcast to their tokens (:func:`per_token`), each linear layer in the
    weights' dtype (``jnp.dot`` then the bias, as ``flax.nnx.Linear`` computes it); with
    ``residual_input`` ``(r, w, b)`` on ``x + r @ w[layer] + b[layer]`` instead of ``x``; with
    ``next_modulation`` also the output's own :func:`modulated_input` under it."""
    n = x.shape[1]
    if residual_input is not None:
        r, w, b = residual_input
        x = x + (jnp.dot(r, w[layer]) + b[layer]).astype(x.dtype)
    w_in, b_in, w_out, b_out = (stack[layer] for stack in (w_in, b_in, w_out, b_out))
    hidden_input = modulated_input(x, per_token(shift, n), per_token(scale, n), eps, w_in.dtype)
    if materializes_ffn_input():
        hidden_input = jax.lax.optimization_barrier(hidden_input)
    hidden = gelu(jnp.dot(hidden_input, w_in) + b_in)
    # XLA:TPU otherwise fuses the FFN-out matmul with the GELU before it (and the gate and residual
    # after it) into fusions far below MXU peak (docs/planning.md, "The whole chip"): the barriers
    # keep the matmul alone.
    y = jax.lax.optimization_barrier(jnp.dot(jax.lax.optimization_barrier(hidden), w_out) + b_out)
    out = x + y * per_token(gate, n)
    if next_modulation is None:
        return out
    next_shift, next_scale = (per_token(m, n) for m in next_modulation)
    return out, modulated_input(out, next_shift, next_scale, eps, w_in.dtype)
