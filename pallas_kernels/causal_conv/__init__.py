"""Causal 3x3x3 convolution over a stream: the Wan VAE decoder's 3-D convolutions, which see two
cached frames of their input before the current ones and pad zeros "same" in space.

:func:`causal_conv3d` is the entry point (its docstring tables the shapes); it checks the call and
runs the ``backend=`` name's implementation from :data:`IMPLEMENTATIONS`: plain XLA
(:mod:`~pallas_kernels.causal_conv.xla`, also the reference) or a Mosaic TPU kernel
(:mod:`~pallas_kernels.causal_conv.tpu`) that writes the new cache over the old one, reading its
arrays row-major (:mod:`~pallas_kernels.causal_conv.formats`: the format a kept cache carries and its
bytes in a TPU's HBM). Design and figures: ``docs/kernels.md`` (Causal convolution).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp

from pallas_kernels.backend import Backend, resolve_backend, tpu_kernel_else_xla
from pallas_kernels.causal_conv import tpu, xla
from pallas_kernels.causal_conv.formats import HBM_TILE, default_sharding, row_major, row_major_tpu_bytes
from pallas_kernels.causal_conv.geometry import KERNEL_PREFIX, ConvGeometry, geometry_of_kernel, kernel_name
from pallas_kernels.causal_conv.tpu import is_narrow
from pallas_kernels.causal_conv.xla import CACHE_FRAMES
from pallas_kernels.checks import require_index, require_int
from pallas_kernels.common import check_rank, check_same_dtype, check_supported_dtype
from pallas_kernels.window_attention.tpu import default_generation

__all__ = ["CACHE_FRAMES", "HBM_TILE", "IMPLEMENTATIONS", "KERNEL_PREFIX", "ConvGeometry", "causal_conv3d",
           "default_sharding", "geometry_of_kernel", "is_narrow", "kernel_name", "row_major",
           "row_major_tpu_bytes", "static_validate_inputs"]


def causal_conv3d(x, cache, kernel, bias, *, norm_gamma=None, residual=None, stream=None, backend="auto",
                  block_h=None):
    """One causal 3x3x3 convolution of a stream's next frames.

    ==============  ==============================  ==============
    ``x``           ``[T, H, W, Cin]``              f32, bf16, f16
    ``cache``       ``[2, H, W, Cin]``              ``x``'s dtype
    ``kernel``      ``[3, 3, 3, Cin, Cout]``        ``x``'s dtype
    ``bias``        ``[Cout]``                      ``x``'s dtype
    ``norm_gamma``  ``[Cin]`` or ``None``           ``x``'s dtype
    ``residual``    ``[T, H, W, Cout]`` or ``None`` ``x``'s dtype
    ``y``           ``[T, H, W, Cout]``             ``x``'s dtype
    new cache       ``[2, H, W, Cin]``              ``x``'s dtype
    ==============  ==============================  ==============

    ``y[t, h, w] = bias + sum over (dt, dh, dw) of e[t + dt, h + dh - 1, w + dw - 1] @ kernel[dt, dh,
    dw]`` with ``e = [cache, x]`` (``T + 2`` frames) and zeros outside the image; the new cache is
    ``[cache, x][T:]``, the last two frames. Products accumulate in float32. With ``norm_gamma``,
    ``e = norm_silu([cache, x], norm_gamma)`` (:func:`~pallas_kernels.causal_conv.xla.norm_silu`:
    Wan's channel norm and SiLU, per pixel, in float32, then ``x``'s dtype): the convolution takes
    its input before the norm, and the cache keeps those frames, so the norm's output is never
    written to memory (the TPU kernel normalizes in VMEM). With ``residual``, ``y`` is that plus
    ``residual`` (a residual block's skip connection, added before ``y`` is written).

    With ``stream``, ``cache`` is a batch of streams' caches ``[B, 2, H, W, Cin]``: the call reads
    entry ``stream`` and returns the batch with that entry replaced (the TPU kernel writes it in
    place, the other entries untouched; XLA slices it out and updates it back).

    Args:
      x, cache: the new frames and the two frames before them (zeros at a stream's start).
      stream: ``None``, or the index of ``x``'s stream in a batched ``cache``: an int in ``[0, B)``
        or an integer scalar array (concrete or traced; an array's value out of range is clamped,
        as JAX clamps dynamic slices).
      kernel, bias: the convolution's parameters (torch's ``[out, in, kt, kh, kw]`` transposed).
      norm_gamma: ``None``, or the scale of the channel norm applied to the input first.
      residual: ``None``, or what is added to the output.
      backend: a name from :data:`pallas_kernels.backend.BACKEND_NAMES`. The TPU names run the
        Mosaic kernel (interpreted or simulated as the name says), every other name XLA. Inside a
        program that does not use ``cache`` afterwards, the TPU kernel writes the new cache over it.
      block_h: output rows per TPU grid step, in ``[1, H]`` (default ``min(8, H)``); ignored elsewhere.

    Raises:
      TypeError: an input that is not an array, a ``block_h`` that is not an int.
      ValueError: mismatched shapes or dtypes, an unknown backend, ``block_h`` out of range.
    """
    resolved = resolve_backend(backend)
    geom = static_validate_inputs(x, cache, kernel, bias, norm_gamma=norm_gamma, residual=residual, stream=stream,
                                  block_h=block_h)
    block_h = min(tpu.DEFAULT_BLOCK_H, geom.height) if block_h is None else int(block_h)
    if stream is not None:
        stream = jnp.clip(jnp.asarray(stream, jnp.int32), 0, cache.shape[0] - 1)
    return IMPLEMENTATIONS[resolved.name](x, cache, kernel, bias, norm_gamma, residual, stream, geom=geom,
                                          block_h=block_h, backend=resolved)


def static_validate_inputs(x, cache, kernel, bias, *, norm_gamma=None, residual=None, stream=None,
                           block_h=None) -> ConvGeometry:
    """The call's :class:`ConvGeometry`, or the error :func:`causal_conv3d` raises."""
    check_rank("x", x, 4, "[T, H, W, Cin]")
    if stream is None:
        check_rank("cache", cache, 4, "[2, H, W, Cin]")
    else:
        check_rank("cache", cache, 5, "[B, 2, H, W, Cin] (a batch's caches, with stream=)")
        require_index("stream", stream, cache.shape[0], "cache.shape[0]")
        cache = jax.ShapeDtypeStruct(cache.shape[1:], cache.dtype)
    check_rank("kernel", kernel, 5, "[3, 3, 3, Cin, Cout]")
    check_rank("bias", bias, 1, "[Cout]")
    check_supported_dtype("x.dtype", x.dtype)
    named = [("cache", cache), ("kernel", kernel), ("bias", bias)]
    if norm_gamma is not None:
        check_rank("norm_gamma", norm_gamma, 1, "[Cin]")
        named.append(("norm_gamma", norm_gamma))
    if residual is not None:
        check_rank("residual", residual, 4, "[T, H, W, Cout]")
        named.append(("residual", residual))
    check_same_dtype("x", x.dtype, named)
    frames, height, width, cin = x.shape
    if min(x.shape) < 1:
        raise ValueError(f"every dimension of x must be positive, got shape {tuple(x.shape)}")
    if tuple(cache.shape) != (CACHE_FRAMES, height, width, cin):
        raise ValueError(f"cache.shape must be {(CACHE_FRAMES, height, width, cin)} (two frames of x's "
                         f"H, W and Cin), got {tuple(cache.shape)}")
    if tuple(kernel.shape[:4]) != (3, 3, 3, cin) or kernel.shape[4] < 1:
        raise ValueError(f"kernel.shape must be (3, 3, 3, {cin}, Cout) with Cout >= 1, got {tuple(kernel.shape)}")
    if tuple(bias.shape) != (kernel.shape[4],):
        raise ValueError(f"bias.shape must be ({kernel.shape[4]},) (Cout), got {tuple(bias.shape)}")
    if norm_gamma is not None and tuple(norm_gamma.shape) != (cin,):
        raise ValueError(f"norm_gamma.shape must be ({cin},) (Cin), got {tuple(norm_gamma.shape)}")
    if residual is not None and tuple(residual.shape) != (frames, height, width, kernel.shape[4]):
        raise ValueError(f"residual.shape must be {(frames, height, width, kernel.shape[4])} (y's), got "
                         f"{tuple(residual.shape)}")
    if block_h is not None:
        require_int("block_h", block_h, minimum=1, maximum=height, must=f"an int in [1, {height}] (H)")
    return ConvGeometry(frames, height, width, cin, kernel.shape[4], input_norm=norm_gamma is not None,
                        residual=residual is not None)


# The implementations of the registry, one signature (:data:`IMPLEMENTATIONS`).

def _xla(x, cache, kernel, bias, norm_gamma, residual, stream, *, geom: ConvGeometry, block_h: int,
         backend: Backend):
    if stream is None:
        return xla.causal_conv3d(x, cache, kernel, bias, norm_gamma, residual)
    y, entry = xla.causal_conv3d(x, jax.lax.dynamic_index_in_dim(cache, stream, keepdims=False), kernel, bias,
                                 norm_gamma, residual)
    return y, jax.lax.dynamic_update_index_in_dim(cache, entry, stream, axis=0)


def _pallas_tpu(x, cache, kernel, bias, norm_gamma, residual, stream, *, geom: ConvGeometry, block_h: int,
                backend: Backend):
    # The chip the program is built for, read here and passed static: a trace cached for one
    # generation is never reused for another.
    tanh_silu = default_generation() == "v5e"  # v5e refines exp and reciprocal in software
    return tpu.causal_conv3d(x, cache, kernel, bias, norm_gamma, residual, stream, block_h=block_h,
                             interpret=backend.interpret, tanh_silu=tanh_silu)


IMPLEMENTATIONS: Mapping[str, Callable[..., tuple[jax.Array, jax.Array]]] = tpu_kernel_else_xla(_pallas_tpu, _xla)
"""This kernel's table of the backend registry (:data:`pallas_kernels.backend.BACKENDS`, the same
names): backend name to implementation, called as ``impl(x, cache, kernel, bias, norm_gamma, residual,
stream, *, geom, block_h, backend)`` on validated inputs (``norm_gamma`` ``None`` or ``[Cin]``,
``residual`` ``None`` or ``y``'s shape, ``stream`` ``None`` or a clamped int32 scalar). The TPU
names run the Mosaic kernel; every GPU name runs XLA (cuDNN's convolutions, which XLA already calls
on a GPU)."""
