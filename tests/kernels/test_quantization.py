"""The quantization rule of K/V pages (:mod:`pallas_kernels.quantization`): round-trip error bounds,
zeros, int8's symmetric rounding and fp8's saturation."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from pallas_kernels.quantization import (
    MAX_VALUES,
    QUANTIZED_DTYPES,
    SCALE_DTYPE,
    dequantize,
    is_quantized,
    largest_magnitude,
    max_value,
    quantize,
    to_stored,
    to_stored_bits,
)

# Relative spacing of each dtype's values near its maximum (one unit in the last place there): fp8
# rounds to nearest, so the round-trip error of a value is at most half of it times its magnitude.
RELATIVE_STEP = {"float8_e4m3fn": 2.0 ** -3, "float8_e5m2": 2.0 ** -2}


def _values(seed=0, shape=(3, 2, 5, 16, 8)):
    rng = np.random.default_rng(seed)
    # Several magnitudes per group, so small values sit far below the group's maximum.
    return (rng.standard_normal(shape) * np.exp(rng.uniform(-3, 3, shape))).astype(np.float32)


@pytest.mark.parametrize("dtype", QUANTIZED_DTYPES)
def test_round_trip_error_is_bounded_by_the_step(dtype):
    x = _values()
    axes = (3, 4)
    stored, scale = quantize(x, dtype, axes)
    assert stored.dtype == jnp.dtype(dtype) and stored.shape == x.shape
    assert scale.dtype == SCALE_DTYPE and scale.shape == x.shape[:3]
    np.testing.assert_allclose(scale, np.abs(x).max(axis=axes) / MAX_VALUES[dtype], rtol=1e-6)
    back = np.asarray(dequantize(stored, scale, axes))
    err = np.abs(back - x)
    step = np.expand_dims(np.asarray(scale), axes)
    if dtype == "int8":  # uniform steps of one scale: at most half a step off
        assert np.all(err <= 0.5 * step * (1 + 1e-5))
    else:  # relative rounding of the nearest fp8 value, or below the smallest normal step
        bound = np.maximum(0.5 * RELATIVE_STEP[dtype] * np.abs(x), step * float(jnp.finfo(dtype).smallest_subnormal))
        assert np.all(err <= bound * (1 + 1e-5))
    assert err.max() > 0  # it does quantize
    # The maximum of each group is stored exactly at the range's end.
    assert np.all(np.abs(np.asarray(stored.astype(jnp.float32))).max(axis=axes) == MAX_VALUES[dtype])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_largest_magnitude_is_the_absolute_maximum_bit_for_bit(dtype):
    x = _values(2).astype(dtype)
    x[0, 0, 0] = -np.abs(x[0, 0, 0])  # a group of negatives only: its maximum is below zero
    x[0, 0, 1] = -0.0  # a group of negative zeros: +0.0, as |x| gives
    x[0, 0, 2] = 0.0
    x[1, 1, 3, 2, 5] = np.nan  # NaN anywhere in a group gives NaN
    got = np.asarray(largest_magnitude(jnp.asarray(x), axes=(3, 4)))
    want = np.abs(x.astype(np.float32)).max(axis=(3, 4))
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32)[~np.isnan(want)],
                                  want.view(np.uint32)[~np.isnan(want)])
    assert np.isnan(got[1, 1, 3]) and np.isnan(got).sum() == 1
    assert got[0, 0, 0] > 0


@pytest.mark.parametrize("dtype", QUANTIZED_DTYPES)
def test_zero_groups_get_scale_zero_and_no_nan(dtype):
    x = _values(1)
    x[1, 0] = 0.0  # every page of one (layer, head) all zeros
    x[0, 1, 2] = 0.0  # one page
    stored, scale = quantize(x, dtype, (3, 4))
    assert scale[1, 0].tolist() == [0.0] * 5 and float(scale[0, 1, 2]) == 0.0
    back = np.asarray(dequantize(stored, scale, (3, 4)))
    assert np.all(np.isfinite(back)) and np.all(back[1, 0] == 0) and np.all(back[0, 1, 2] == 0)
    assert np.all(np.asarray(stored.astype(jnp.float32))[1, 0] == 0)


def test_int8_is_symmetric_round_half_to_even():
    x = np.array([[127.0, -127.0, 0.5, 1.5, -2.5, 63.49, -0.4]], np.float32)
    stored, scale = quantize(x, "int8", (1,))
    assert float(scale[0]) == 1.0
    assert np.asarray(stored).tolist() == [[127, -127, 0, 2, -2, 63, 0]]
    # The most negative value maps to -127, never -128: the range is symmetric.
    stored, _ = quantize(np.array([[-5.0, 1.0, 5.0]], np.float32), "int8", (1,))
    assert np.asarray(stored).tolist() == [[-127, 25, 127]]


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_saturates_instead_of_overflowing(dtype):
    # A scale whose rounding pushes the maximum past the range would give NaN (e4m3fn) or inf (e5m2)
    # without the clip: the stored values stay finite and at most max_value.
    x = np.array([[1.0, -1.0, 0.3]], np.float32) * np.float32(3.0000002)
    stored, scale = quantize(x, dtype, (1,))
    stored = np.asarray(stored.astype(jnp.float32))
    assert np.all(np.isfinite(stored)) and np.abs(stored).max() == MAX_VALUES[dtype]
    # Plain conversion of an out-of-range value is not finite: the clip is what saturates.
    assert not np.isfinite(float(jnp.asarray(2 * MAX_VALUES[dtype], jnp.float32).astype(dtype).astype(jnp.float32)))


def test_dtype_names_and_errors():
    assert is_quantized("int8") and is_quantized(jnp.float8_e4m3fn) and is_quantized(np.dtype("int8"))
    assert not is_quantized("bfloat16") and not is_quantized(None) and not is_quantized("nope")
    assert max_value(jnp.int8) == 127.0 and max_value("float8_e4m3fn") == 448.0
    allowed = r"kv_dtype must be one of \['int8', 'float8_e4m3fn', 'float8_e5m2'\].*'bfloat16'"
    with pytest.raises(ValueError, match=allowed):
        max_value("bfloat16")


def test_dequantize_casts_to_the_compute_dtype():
    x = _values(2, (2, 4, 8))
    stored, scale = quantize(x, "int8", (-1,))
    assert scale.shape == (2, 4)
    out = dequantize(stored, scale, (-1,), jnp.bfloat16)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(dequantize(stored, scale, (-1,))),
                               rtol=2 ** -8)


def _every_rounding_boundary(dtype) -> np.ndarray:
    """Each value the dtype stores, each midpoint between neighbours and the float32 values either
    side of it (where half to even decides), with both signs, plus NaN, infinities and values far
    out of range."""
    if dtype == "int8":
        grid = np.arange(-127, 128, dtype=np.float32)
    else:
        grid = np.asarray(lax.bitcast_convert_type(jnp.arange(256, dtype=jnp.uint8), jnp.dtype(dtype))
                          .astype(jnp.float32))
    grid = np.unique(grid[np.isfinite(grid)])
    mid = ((grid[1:].astype(np.float64) + grid[:-1]) / 2).astype(np.float32)
    near = [np.nextafter(mid, np.float32(np.inf)), np.nextafter(mid, np.float32(-np.inf))]
    special = np.array([np.nan, np.inf, 1e30, 0.0], np.float32)
    values = np.concatenate([grid, mid, *near, special])
    return np.concatenate([values, -values])


@pytest.mark.parametrize("dtype", QUANTIZED_DTYPES)
def test_stored_bits_are_the_cast_bit_for_bit(dtype):
    rng = np.random.default_rng(1)
    scales = np.float32([1e-6, 1e-3, 1.0, 300.0, 6e4])
    x = np.concatenate([_every_rounding_boundary(dtype),
                        (rng.standard_normal((scales.size, 4096)) * scales[:, None]).ravel()])
    for inverse in (np.float32(1.0), np.float32(1 / 0.0123)):
        values = jnp.asarray(x / inverse if inverse != 1 else x)
        cast = lax.bitcast_convert_type(to_stored(values, inverse, dtype), jnp.uint8)
        bits = to_stored_bits(values, inverse, dtype)
        assert bits.dtype == jnp.uint8
        np.testing.assert_array_equal(np.asarray(bits), np.asarray(cast))
