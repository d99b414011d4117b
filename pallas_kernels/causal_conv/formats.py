"""The memory layout the TPU kernel reads its arrays in, and the bytes that layout takes in a TPU's HBM.

The Mosaic kernel (:mod:`~pallas_kernels.causal_conv.tpu`) copies rows of ``[T, H, W, C]`` arrays
laid out row-major (``C`` on the lanes, ``W`` on the sublanes). XLA:TPU gives a program argument that
layout only when ``C`` fills the 128 lanes: for 96 or 192 channels it puts ``H`` on the lanes, and a
program that hands such an argument to the kernel relays it out at its entry (and back at its exit
for a donated one). An array kept across programs (the VAE decoder's stream cache) therefore carries
:func:`row_major` as its format: ``jax.device_put(x, fmt)``, ``jax.jit(..., out_shardings=fmt)``,
``jax.ShapeDtypeStruct(..., sharding=fmt)``. Row-major is the default layout of CPU and GPU arrays,
so there the format changes nothing (:func:`default_sharding` names the device of an array made
without one). :func:`row_major_tpu_bytes` is what such an array takes in a TPU's HBM, its two minor
dims padded to XLA:TPU's tile (:data:`HBM_TILE`).

``jax.experimental.layout.Format`` and ``Layout`` have these names and signatures in jax 0.10.2 and
0.12 alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.experimental.layout import Format, Layout

from pallas_kernels.checks import require_positive
from pallas_kernels.common import round_up, target_device

HBM_TILE = (8, 128)
"""XLA:TPU's HBM tile of a 16- or 32-bit array's second-minor and minor dims (``T(8,128)``; 16-bit
``T(8,128)(2,1)``): each dim is padded to a multiple of it. A second-minor dim under 8 takes the
next power of two instead (a ``(4, 128)`` tile for 3 rows)."""

TILED_ITEMSIZES = (2, 4)
"""Bytes per element of the dtypes :func:`row_major_tpu_bytes` knows the tile of."""


def row_major(ndim: int, sharding: jax.sharding.Sharding) -> Format:
    """The format of a rank-``ndim`` array on ``sharding`` laid out row-major (its last dim minor).

    Raises:
      TypeError: ``ndim`` is not an int. ValueError: ``ndim`` is not positive.
    """
    ndim = require_positive("ndim", ndim)
    return Format(Layout(major_to_minor=tuple(range(ndim))), sharding)


def default_sharding() -> jax.sharding.SingleDeviceSharding:
    """The sharding a new array takes when none is named: on
    :func:`pallas_kernels.common.target_device` (JAX's default device where one is set, else the
    first device)."""
    return jax.sharding.SingleDeviceSharding(target_device())


def row_major_tpu_bytes(shape: Sequence[int], dtype) -> int:
    """Bytes of a ``shape`` array of ``dtype`` laid out row-major in a TPU's HBM: the minor dim
    padded to a multiple of 128 lanes, the second-minor to a multiple of 8 sublanes (the next power
    of two below 8), as XLA:TPU tiles it (:data:`HBM_TILE`).

    Raises:
      ValueError: a rank below 2, a negative dim, or a dtype not 2 or 4 bytes wide.
    """
    shape = tuple(int(d) for d in shape)
    itemsize = jnp.dtype(dtype).itemsize
    if len(shape) < 2 or min(shape) < 0:
        raise ValueError(f"shape must have rank >= 2 and no negative dim, got {shape}")
    if itemsize not in TILED_ITEMSIZES:
        raise ValueError(f"dtype {jnp.dtype(dtype).name} is {itemsize} bytes wide; the HBM tile is known for "
                         f"{TILED_ITEMSIZES}-byte dtypes")
    if 0 in shape:
        return 0
    *major, rows, lanes = shape
    sublanes, lane_tile = HBM_TILE
    rows = round_up(rows, sublanes) if rows >= sublanes else 1 << max(rows - 1, 0).bit_length()
    return math.prod(major) * rows * round_up(lanes, lane_tile) * itemsize
