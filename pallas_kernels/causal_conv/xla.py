"""The causal 3x3x3 convolution in plain XLA: the ``"xla"`` path and the reference of the TPU
kernel (the math the Wan VAE decoder has always run). Semantics:
:func:`pallas_kernels.causal_conv.causal_conv3d`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

CACHE_FRAMES = 2
"""Frames of history a 3-frame causal kernel reads: the cache's leading dimension."""
NARROW_OUTPUT = 8
"""A convolution with at most this many output channels (the decoder's ``conv_out`` to RGB)
contracts the channels first (:func:`_channels_first`): XLA:TPU lays a convolution with so few
output channels out badly (docs/kernels.md, Causal convolution)."""


def causal_conv3d(x, cache, kernel, bias):
    """``(y, new_cache)`` of ``x`` ``[T, H, W, Cin]`` after ``cache`` ``[2, H, W, Cin]``:
    ``y = conv([cache, x]) + bias`` ``[T, H, W, Cout]`` (valid in time, zero "same" padding in
    space, ``x``'s dtype), ``new_cache`` the last two frames of ``[cache, x]``."""
    extended = jnp.concatenate([cache, x], axis=0)
    if kernel.shape[-1] <= NARROW_OUTPUT:
        return _channels_first(extended, kernel) + bias, extended[-CACHE_FRAMES:]
    y = jax.lax.conv_general_dilated(
        extended[None], kernel, window_strides=(1, 1, 1), padding=((0, 0), (1, 1), (1, 1)),
        dimension_numbers=("NDHWC", "DHWIO", "NDHWC"))[0]
    return y + bias, extended[-CACHE_FRAMES:]


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
