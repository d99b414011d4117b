"""The causal 3x3x3 convolution in plain XLA: the ``"xla"`` path and the reference of the TPU
kernel (the math the Wan VAE decoder has always run). Semantics:
:func:`pallas_kernels.causal_conv.causal_conv3d`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

CACHE_FRAMES = 2
"""Frames of history a 3-frame causal kernel reads: the cache's leading dimension."""


def causal_conv3d(x, cache, kernel, bias):
    """``(y, new_cache)`` of ``x`` ``[T, H, W, Cin]`` after ``cache`` ``[2, H, W, Cin]``:
    ``y = conv([cache, x]) + bias`` ``[T, H, W, Cout]`` (valid in time, zero "same" padding in
    space, ``x``'s dtype), ``new_cache`` the last two frames of ``[cache, x]``."""
    extended = jnp.concatenate([cache, x], axis=0)
    y = jax.lax.conv_general_dilated(
        extended[None], kernel, window_strides=(1, 1, 1), padding=((0, 0), (1, 1), (1, 1)),
        dimension_numbers=("NDHWC", "DHWIO", "NDHWC"))[0]
    return y + bias, extended[-CACHE_FRAMES:]
