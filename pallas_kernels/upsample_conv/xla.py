"""Nearest 2x upsampling then a 3x3 convolution, in plain XLA at the input's resolution: the
``"xla"`` path and the reference of the TPU kernel. Semantics:
:func:`pallas_kernels.upsample_conv.upsample_conv2d`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _nearest_2x_taps() -> np.ndarray:
    """``[a, o, d]``: 1 where tap ``d`` of a 3-tap "same" convolution over an axis upsampled 2x by
    nearest neighbour reads, at output ``2i + a``, input ``i + o - 1`` (``(2i + a + d - 1) // 2``)."""
    taps = np.zeros((2, 3, 3), np.float32)
    for a in range(2):
        for d in range(3):
            taps[a, (a + d - 1) // 2 + 1, d] = 1
    return taps


NEAREST_2X_TAPS = _nearest_2x_taps()


def phase_kernel(kernel):
    """``[3, 3, Cin, Cout]`` -> ``[3, 3, Cin, 2, 2, Cout]`` in float32: the 3x3 convolution of the
    input at its own resolution whose output phase ``(a, b)`` is output pixel ``(2i + a, 2j + b)``
    of ``kernel`` over the input upsampled 2x (each tap the sum of the original taps that read the
    same input pixel)."""
    taps = jnp.asarray(NEAREST_2X_TAPS)
    return jnp.einsum("aoh,bpw,hwic->opiabc", taps, taps, kernel.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


def upsample_conv2d(x, kernel, bias):
    """``[T, H, W, Cin]`` -> ``[T, 2H, 2W, Cout]``: the four phases side by side in one convolution's
    output channels, then interleaved into rows and columns."""
    cin, cout = kernel.shape[2:]
    phased = phase_kernel(kernel).astype(kernel.dtype).reshape(3, 3, cin, 4 * cout)
    y = jax.lax.conv_general_dilated(x, phased, window_strides=(1, 1), padding=((1, 1), (1, 1)),
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
    t, h, w, _ = y.shape  # [.., w, (a, b, c)] -> [.., a, w, (b, c)]: (b, c) stays whole
    y = y.reshape(t, h, w, 2, 2 * cout).transpose(0, 1, 3, 2, 4).reshape(t, 2 * h, 2 * w, cout)
    return y + bias
