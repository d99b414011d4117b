"""The causal 3x3x3 convolution in plain XLA: the ``"xla"`` path and the reference of the TPU
kernel (the math the Wan VAE decoder has always run), and the channel norm the convolution can apply
to its input first (:func:`channel_rms_norm`, :func:`norm_silu`: one rule for the kernel, this path
and the decoder's own norms). Semantics: :func:`pallas_kernels.causal_conv.causal_conv3d`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

CACHE_FRAMES = 2
"""Frames of history a 3-frame causal kernel reads: the cache's leading dimension."""
NARROW_OUTPUT = 8
"""A convolution with at most this many output channels (the decoder's ``conv_out`` to RGB)
contracts the channels first (:func:`_channels_first`): XLA:TPU lays a convolution with so few
output channels out badly (docs/kernels.md, Causal convolution)."""
NORM_EPS = 1e-12
"""The least channel norm :func:`channel_rms_norm` divides by."""


def norm_scale(gamma):
    """The per-channel factor of :func:`channel_rms_norm`, ``sqrt(C) * gamma`` in float32 (``gamma``
    ``[C]``)."""
    return gamma.astype(jnp.float32) * np.float32(np.sqrt(gamma.shape[-1]))


def scaled_rms_norm(x, scale):
    """``x / max(||x||_2, NORM_EPS) * scale`` over the channels (the last axis) in float32, as one
    reciprocal square root per pixel; ``scale`` is :func:`norm_scale` ``[C]`` (or ``[1, C]``). A zero
    pixel stays zero."""
    x32 = x.astype(jnp.float32)
    squares = jnp.sum(x32 * x32, axis=-1, keepdims=True)
    return x32 * jax.lax.rsqrt(jnp.maximum(squares, np.float32(NORM_EPS * NORM_EPS))) * scale


def channel_rms_norm(x, gamma):
    """Wan's norm over the channels, in float32: ``x / max(||x||_2, NORM_EPS) * sqrt(C) * gamma`` for
    ``x`` ``[..., C]`` and ``gamma`` ``[C]``."""
    return scaled_rms_norm(x, norm_scale(gamma))


def silu_tanh(x):
    """``silu(x)`` as ``x (1 + tanh(x / 2)) / 2`` (the same function; one EUP op where the sigmoid
    takes an exponential and a reciprocal)."""
    return x * (0.5 + 0.5 * jnp.tanh(0.5 * x))


def scaled_norm_silu(x, scale, tanh_form: bool = False):
    """``silu(scaled_rms_norm(x, scale))`` in ``x``'s dtype (float32 inside); ``tanh_form``: the
    SiLU as :func:`silu_tanh`."""
    y = scaled_rms_norm(x, scale)
    return (silu_tanh(y) if tanh_form else jax.nn.silu(y)).astype(x.dtype)


def norm_silu(x, gamma):
    """``silu(channel_rms_norm(x, gamma))`` in ``x``'s dtype (float32 inside): what a Wan residual
    block applies before each of its convolutions."""
    return scaled_norm_silu(x, norm_scale(gamma))


def causal_conv3d(x, cache, kernel, bias, norm_gamma=None, residual=None):
    """``(y, new_cache)`` of ``x`` ``[T, H, W, Cin]`` after ``cache`` ``[2, H, W, Cin]``:
    ``y = conv(e) + bias`` ``[T, H, W, Cout]`` (valid in time, zero "same" padding in space, ``x``'s
    dtype) with ``e = [cache, x]``, or ``e = norm_silu([cache, x], norm_gamma)`` given a
    ``norm_gamma`` ``[Cin]``, plus ``residual`` ``[T, H, W, Cout]`` if given; ``new_cache`` is the
    last two frames of ``[cache, x]`` (before any norm)."""
    extended = jnp.concatenate([cache, x], axis=0)
    new_cache = extended[-CACHE_FRAMES:]
    if norm_gamma is not None:
        extended = norm_silu(extended, norm_gamma)
    if kernel.shape[-1] <= NARROW_OUTPUT:
        y = _channels_first(extended, kernel) + bias
    else:
        y = jax.lax.conv_general_dilated(
            extended[None], kernel, window_strides=(1, 1, 1), padding=((0, 0), (1, 1), (1, 1)),
            dimension_numbers=("NDHWC", "DHWIO", "NDHWC"))[0] + bias
    return (y if residual is None else y + residual), new_cache


def _channels_first(extended, kernel):
    """The valid-in-time, "same"-in-space convolution of ``extended`` ``[T + 2, H, W, Cin]`` by
    ``kernel`` ``[3, 3, 3, Cin, Cout]``, ``[T, H, W, Cout]``: per frame offset ``dt``, one matmul to
    its nine taps' outputs (float32, ``W`` on the minor dim), each tap shifted by its offset and
    summed."""
    frames, height, width, cin = extended.shape
    cout = kernel.shape[-1]
    out_frames = frames - CACHE_FRAMES
    x32, kernel32 = extended.astype(jnp.float32), kernel.astype(jnp.float32)  # XLA:CPU has no bf16 x bf16 -> f32
    y = 0
    for dt in range(3):
        taps = jnp.einsum("thwc,ck->tkhw", x32[dt:dt + out_frames],
                          kernel32[dt].transpose(2, 0, 1, 3).reshape(cin, 9 * cout)
                          ).reshape(out_frames, 3, 3, cout, height, width)
        taps = jnp.pad(taps, ((0, 0),) * 4 + ((1, 1), (1, 1)))
        y = y + sum(taps[:, dh, dw, :, dh:dh + height, dw:dw + width] for dh in range(3) for dw in range(3))
    return y.astype(extended.dtype).transpose(0, 2, 3, 1)
