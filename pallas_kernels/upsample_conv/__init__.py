"""Nearest 2x upsampling in space then a 3x3 "same" convolution: the Wan VAE decoder's upsamplers,
computed at the input's resolution (the output's four pixel phases are four 3x3 convolutions of the
input) without the upsampled input ever being formed.

:func:`upsample_conv2d` is the entry point; it checks the call and runs the ``backend=`` name's
implementation from :data:`IMPLEMENTATIONS`: plain XLA (:mod:`~pallas_kernels.upsample_conv.xla`,
also the reference) or a Mosaic TPU kernel (:mod:`~pallas_kernels.upsample_conv.tpu`) that writes
the phases into the output rows directly. Design and figures: ``docs/kernels.md`` (Upsampling
convolution).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax

from pallas_kernels.backend import Backend, resolve_backend, tpu_kernel_else_xla
from pallas_kernels.checks import require_int
from pallas_kernels.common import check_rank, check_same_dtype, check_supported_dtype
from pallas_kernels.upsample_conv import tpu, xla
from pallas_kernels.upsample_conv.geometry import KERNEL_PREFIX, UpsampleGeometry, geometry_of_kernel, kernel_name

__all__ = ["IMPLEMENTATIONS", "KERNEL_PREFIX", "UpsampleGeometry", "geometry_of_kernel", "kernel_name",
           "static_validate_inputs", "upsample_conv2d"]


def upsample_conv2d(x, kernel, bias, *, backend="auto", block_h=None):
    """``conv3x3(x upsampled 2x by nearest neighbour) + bias``, frame by frame.

    ==========  ========================  ==============
    ``x``       ``[T, H, W, Cin]``        f32, bf16, f16
    ``kernel``  ``[3, 3, Cin, Cout]``     ``x``'s dtype
    ``bias``    ``[Cout]``                ``x``'s dtype
    ``y``       ``[T, 2H, 2W, Cout]``     ``x``'s dtype
    ==========  ========================  ==============

    ``y[t, r, c] = bias + sum over (dh, dw) of u[t, r + dh - 1, c + dw - 1] @ kernel[dh, dw]`` with
    ``u[t, r, c] = x[t, r // 2, c // 2]`` and zeros outside the image. Products accumulate in
    float32; every path computes at ``x``'s resolution (:func:`~pallas_kernels.upsample_conv.xla.phase_kernel`).

    Args:
      x, kernel, bias: the input frames and the convolution's parameters (torch's ``[out, in, kh,
        kw]`` transposed).
      backend: a name from :data:`pallas_kernels.backend.BACKEND_NAMES`. The TPU names run the
        Mosaic kernel (interpreted or simulated as the name says), every other name XLA.
      block_h: input rows per TPU grid step, a divisor of ``H`` (default the largest divisor not
        above 8); ignored elsewhere.

    Raises:
      TypeError: an input that is not an array, a ``block_h`` that is not an int.
      ValueError: mismatched shapes or dtypes, an unknown backend, a ``block_h`` that does not
        divide ``H``.
    """
    resolved = resolve_backend(backend)
    geom = static_validate_inputs(x, kernel, bias, block_h=block_h)
    block_h = tpu.default_block_h(geom.height) if block_h is None else int(block_h)
    return IMPLEMENTATIONS[resolved.name](x, kernel, bias, geom=geom, block_h=block_h, backend=resolved)


def static_validate_inputs(x, kernel, bias, *, block_h=None) -> UpsampleGeometry:
    """The call's :class:`UpsampleGeometry`, or the error :func:`upsample_conv2d` raises."""
    check_rank("x", x, 4, "[T, H, W, Cin]")
    check_rank("kernel", kernel, 4, "[3, 3, Cin, Cout]")
    check_rank("bias", bias, 1, "[Cout]")
    check_supported_dtype("x.dtype", x.dtype)
    check_same_dtype("x", x.dtype, (("kernel", kernel), ("bias", bias)))
    frames, height, width, cin = x.shape
    if min(x.shape) < 1:
        raise ValueError(f"every dimension of x must be positive, got shape {tuple(x.shape)}")
    if tuple(kernel.shape[:3]) != (3, 3, cin) or kernel.shape[3] < 1:
        raise ValueError(f"kernel.shape must be (3, 3, {cin}, Cout) with Cout >= 1, got {tuple(kernel.shape)}")
    if tuple(bias.shape) != (kernel.shape[3],):
        raise ValueError(f"bias.shape must be ({kernel.shape[3]},) (Cout), got {tuple(bias.shape)}")
    if block_h is not None:
        require_int("block_h", block_h, minimum=1, maximum=height, must=f"a divisor of H={height}")
        if height % block_h:
            raise ValueError(f"block_h must be a divisor of H={height}, got {block_h}")
    return UpsampleGeometry(frames, height, width, cin, kernel.shape[3])


# The implementations of the registry, one signature (:data:`IMPLEMENTATIONS`).

def _xla(x, kernel, bias, *, geom: UpsampleGeometry, block_h: int, backend: Backend):
    return xla.upsample_conv2d(x, kernel, bias)


def _pallas_tpu(x, kernel, bias, *, geom: UpsampleGeometry, block_h: int, backend: Backend):
    return tpu.upsample_conv2d(x, kernel, bias, block_h=block_h, interpret=backend.interpret)


IMPLEMENTATIONS: Mapping[str, Callable[..., jax.Array]] = tpu_kernel_else_xla(_pallas_tpu, _xla)
"""This kernel's table of the backend registry (:data:`pallas_kernels.backend.BACKENDS`, the same
names): backend name to implementation, called as ``impl(x, kernel, bias, *, geom, block_h,
backend)`` on validated inputs. The TPU names run the Mosaic kernel; every GPU name runs XLA."""
