"""The quantization rule of K/V pages: which storage dtypes are quantized, how values become stored
values and scales, and back. The one source every module takes it from (the paged write, window
attention's XLA path and reference, the cache, the planner through ``arkv_jax.config``).

Symmetric absmax quantization with float32 scales: over a group of values (the axes a caller
reduces, e.g. one page of one layer and KV head), ``scale = max|x| * (1 / max_value(dtype))`` (the
reciprocal a float32 constant, :func:`scale_of`) and the stored value is ``x * (1 / scale)``
(:func:`inverse_of`, :func:`to_stored`) rounded to the storage dtype (int8: round half to even,
then clipped to ``[-127, 127]``, so the range is symmetric and -128 is never stored; fp8: clipped
to ``[-max_value, max_value]`` before the cast, so an out-of-range value saturates instead of
becoming NaN or inf). Multiplies, and one division per group: a kernel computes the group's
reciprocal once and multiplies by it, exactly the rule on every backend (per value, ``x / scale``
rounds exactly on XLA:CPU but as ``x`` times a refined reciprocal on a TPU, and XLA:TPU folds a
division by a constant into a multiply that Mosaic does not). A group of zeros gets scale 0 and
stored zeros (no division by zero, no NaN), which is what the null page and padding slots hold.
Dequantizing is ``stored * scale`` in float32, then a cast to the compute dtype. Why these
dtypes and this granularity: ``docs/kernels.md`` (Quantized pages).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

MAX_VALUES: Mapping[str, float] = MappingProxyType({
    "int8": 127.0,
    "float8_e4m3fn": float(jnp.finfo(jnp.float8_e4m3fn).max),  # 448
    "float8_e5m2": float(jnp.finfo(jnp.float8_e5m2).max),  # 57344
})
"""The quantized storage dtypes (names) and the largest magnitude each stores (int8's range is made
symmetric: 127, not 128)."""

QUANTIZED_DTYPES = tuple(MAX_VALUES)
"""Names of the quantized K/V storage dtypes, in the order messages list them."""

SCALE_DTYPE = jnp.dtype(jnp.float32)
"""dtype of the scales stored beside quantized pages."""

SCALE_ITEMSIZE = int(np.dtype(SCALE_DTYPE).itemsize)
"""Bytes of one stored scale (the planner counts them)."""


def dtype_name(dtype) -> str | None:
    """The canonical name of ``dtype`` (a string, NumPy or JAX dtype), or ``None`` where it is not a
    dtype at all."""
    if dtype is None:  # jnp.dtype(None) is float64
        return None
    try:
        return jnp.dtype(dtype).name
    except (TypeError, ValueError):
        return None


def is_quantized(dtype) -> bool:
    """Whether ``dtype`` is one of :data:`QUANTIZED_DTYPES` (any spelling ``jnp.dtype`` takes)."""
    return dtype_name(dtype) in MAX_VALUES


def max_value(dtype) -> float:
    """The largest magnitude storage dtype ``dtype`` holds (:data:`MAX_VALUES`).

    Raises:
      ValueError: ``dtype`` is not a quantized dtype (the message lists them).
    """
    name = dtype_name(dtype)
    if name not in MAX_VALUES:
        raise ValueError(f"kv_dtype must be one of {list(QUANTIZED_DTYPES)} to have a quantization "
                         f"range, got {dtype!r}")
    return MAX_VALUES[name]


def quantize(values: jax.Array, dtype, axes: Sequence[int]) -> tuple[jax.Array, jax.Array]:
    """Quantizes ``values`` to storage dtype ``dtype`` with one scale per group over ``axes``.

    Args:
      values: a floating array of any shape (any float dtype; computed in float32).
      dtype: a quantized dtype (:data:`QUANTIZED_DTYPES`).
      axes: the axes each scale covers (reduced), non-negative or negative.

    Returns:
      ``(stored, scale)``: ``stored`` of ``values``' shape in ``dtype``; ``scale`` float32 of
      ``values``' shape without ``axes`` (:func:`scale_of`: ``max|x| / max_value(dtype)`` to a
      float32 rounding, per group; 0 for an all-zero group). ``dequantize(stored, scale, axes)``
      approximates ``values`` within half a step, ``scale / 2`` for int8, and within fp8's
      relative rounding for fp8; values are never NaN or inf where ``values`` is finite.

    Raises:
      ValueError: ``dtype`` is not a quantized dtype.
    """
    x = jnp.asarray(values).astype(jnp.float32)
    scale = scale_of(jnp.max(jnp.abs(x), axis=tuple(axes), keepdims=True), dtype)
    return to_stored(x, inverse_of(scale), dtype), jnp.squeeze(scale, axis=tuple(axes)).astype(SCALE_DTYPE)


def largest_magnitude(x: jax.Array, axes: Sequence[int]) -> jax.Array:
    """``max |x|`` over ``axes`` as float32, bit for bit, computed as ``max(max(x), -min(x))`` in
    ``x``'s dtype: XLA:CPU reduces a bf16 maximum or minimum as fast as a sum, but takes 2-3x as
    long once ``|x|`` or a conversion to float32 precedes the reduction (``docs/kernels.md``,
    Quantized pages). NaN in a group gives NaN where the backend's maximum keeps NaN; XLA:CPU's
    float32 reductions drop it at some shapes, so there a float32 group's NaN can be lost
    (``benchmarks/RESULTS.md``, twenty-eighth session)."""
    axes = tuple(axes)
    largest = jnp.max(x, axis=axes).astype(jnp.float32)
    smallest = jnp.min(x, axis=axes).astype(jnp.float32)
    return jnp.abs(jnp.maximum(largest, -smallest))  # abs: max(-0.0, 0.0) may be -0.0


def scale_of(amax: jax.Array, dtype) -> jax.Array:
    """The float32 scale of a group whose largest magnitude is ``amax`` (float32, any shape):
    ``amax * (1 / max_value(dtype))``, the reciprocal rounded to float32 once, 0 for an all-zero
    group. :func:`quantize`'s scale; kernels that reduce a group in pieces call it on their own
    ``amax``.

    Raises:
      ValueError: ``dtype`` is not a quantized dtype.
    """
    return amax * np.float32(1.0 / max_value(dtype))


def inverse_of(scale: jax.Array) -> jax.Array:
    """``1 / scale`` (float32), 1 where ``scale`` is 0 (an all-zero group, which then stores zeros):
    what :func:`to_stored` multiplies by. One division per group; a kernel computes it once per
    group, outside its loop over the group's values."""
    return 1.0 / jnp.where(scale == 0, 1.0, scale)


def to_stored(x: jax.Array, inverse: jax.Array, dtype) -> jax.Array:
    """``x`` (float32) times its group's ``inverse`` scale (:func:`inverse_of`, float32,
    broadcastable to ``x``) rounded to storage dtype ``dtype``: int8 rounds half to even, then clips
    to ``[-127, 127]``; fp8 clips to ``[-max, max]``, then casts. :func:`quantize`'s stored values;
    kernels call it on pieces of a group once its scale is known.

    Raises:
      ValueError: ``dtype`` is not a quantized dtype.
    """
    limit = max_value(dtype)
    scaled = x * inverse
    if jnp.issubdtype(jnp.dtype(dtype), jnp.integer):
        scaled = jnp.round(scaled)
    return jnp.clip(scaled, -limit, limit).astype(dtype)


_ROUNDING_MAGIC = np.float32(1.5 * 2 ** 23)
"""Adding it to a float32 of magnitude below ``2 ** 22`` rounds to an integer, half to even, which
lands in the low bits of the sum's representation."""

_FLOAT8_FORMATS: Mapping[str, tuple[int, int]] = MappingProxyType({
    "float8_e4m3fn": (3, 7),
    "float8_e5m2": (2, 15),
})
"""The float8 storage dtypes' (mantissa bits, exponent bias)."""


def to_stored_bits(x: jax.Array, inverse: jax.Array, dtype) -> jax.Array:
    """:func:`to_stored`'s values as their uint8 bits, bit for bit, from float32 and integer
    arithmetic only (XLA:CPU converts float32 to int8 and float8 element by element, several times
    slower; ``docs/kernels.md``, Quantized pages).

    int8: the clipped product plus :data:`_ROUNDING_MAGIC`, whose low byte is the rounded value.
    float8: the clipped product's magnitude rounded half to even at the format's mantissa width in
    the float32 bits and its exponent rebiased; below the smallest normal, the magnitude in units of
    the smallest subnormal, rounded with :data:`_ROUNDING_MAGIC`; then the sign bit. NaN gives the
    format's NaN with its sign, as the cast does.

    Raises:
      ValueError: ``dtype`` is not a quantized dtype.
    """
    limit = max_value(dtype)
    scaled = jnp.clip(x * inverse, -limit, limit)
    name = dtype_name(dtype)
    if name == "int8":
        return lax.bitcast_convert_type(scaled + _ROUNDING_MAGIC, jnp.uint32).astype(jnp.uint8)
    mantissa_bits, bias = _FLOAT8_FORMATS[name]
    shift = 23 - mantissa_bits
    bits = lax.bitcast_convert_type(scaled, jnp.uint32)
    magnitude = bits & 0x7FFFFFFF
    rounded = magnitude + ((1 << (shift - 1)) - 1) + ((magnitude >> shift) & 1)
    normal = (rounded >> shift) - ((127 - bias) << mantissa_bits)
    min_normal_bits = (128 - bias) << 23
    units = lax.bitcast_convert_type(magnitude, jnp.float32) * np.float32(2.0 ** (bias - 1 + mantissa_bits))
    subnormal = lax.bitcast_convert_type(units + _ROUNDING_MAGIC, jnp.uint32) & 0xFF
    nan_bits = np.uint32(0x7F if name == "float8_e4m3fn" else 0x7E)
    code = jnp.where(magnitude < min_normal_bits, subnormal,
                     jnp.where(magnitude > 0x7F800000, nan_bits, normal))
    return (code | ((bits >> 24) & 0x80)).astype(jnp.uint8)


def dequantize(stored: jax.Array, scale: jax.Array, axes: Sequence[int], dtype=jnp.float32
               ) -> jax.Array:
    """``stored * scale`` in float32, cast to ``dtype``: the inverse of :func:`quantize`.

    Args:
      stored: the stored values (any shape, a quantized dtype).
      scale: float32, ``stored``'s shape without ``axes``.
      axes: the axes each scale covers, as given to :func:`quantize` (positions in ``stored``).
      dtype: the dtype of the result (the compute dtype).
    """
    ndim = jnp.ndim(stored)
    expanded = jnp.expand_dims(scale, tuple(sorted(a % ndim for a in axes)))
    return (stored.astype(jnp.float32) * expanded).astype(dtype)
