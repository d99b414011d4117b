"""Nearest 2x upsampling then a 3x3 convolution (the Wan VAE decoder's upsamplers): the XLA path
against the convolution of the upsampled input, the TPU kernel against the XLA path, its kernel name
and the argument checks.

The TPU kernel runs interpreted and under the TPU simulator here (out-of-bounds reads raise,
uninitialised VMEM reads as NaN). The libtpu compiles (skipped without libtpu) check Wan 2.1's
widest upsampler for v5e and v6e: the output written row-major with no copy of the input or the
output, and the bundle estimate pricing its rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import tpu_aot
from pallas_kernels.backend import BACKENDS
from pallas_kernels.checks import ArgumentTypeError
from pallas_kernels.upsample_conv import (
    IMPLEMENTATIONS,
    UpsampleGeometry,
    geometry_of_kernel,
    kernel_name,
    upsample_conv2d,
)
from pallas_kernels.upsample_conv import tpu as upsample_tpu
from tests.kernels.device_backends import compiled

needs_libtpu = pytest.mark.skipif(not tpu_aot.libtpu_available(),
                                  reason="libtpu is not installed (pip install -e '.[tpu]')")
TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}


def inputs(geom: UpsampleGeometry, dtype, seed=0):
    """``x, kernel, bias`` of ``geom``, weights scaled to unit outputs."""
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=1.0):
        return jnp.asarray(scale * rng.standard_normal(shape), dtype)

    g = geom
    return (normal(g.frames, g.height, g.width, g.in_channels),
            normal(3, 3, g.in_channels, g.out_channels, scale=(9 * g.in_channels) ** -0.5), normal(g.out_channels))


def upsampled_then_convolved(x, kernel, bias):
    """The definition: the input repeated 2x along H and W, then a "same" 3x3 convolution (float32)."""
    up = jnp.repeat(jnp.repeat(x.astype(jnp.float32), 2, axis=1), 2, axis=2)
    y = jax.lax.conv_general_dilated(up, kernel.astype(jnp.float32), (1, 1), ((1, 1), (1, 1)),
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"), precision=jax.lax.Precision.HIGHEST)
    return y + bias.astype(jnp.float32)


def check_against_xla(geom: UpsampleGeometry, dtype, backend: str, block_h):
    x, kernel, bias = inputs(geom, dtype)
    y = upsample_conv2d(x, kernel, bias, backend=backend, block_h=block_h)
    want = upsample_conv2d(x.astype(jnp.float32), kernel.astype(jnp.float32), bias.astype(jnp.float32), backend="xla")
    assert y.shape == (geom.frames, 2 * geom.height, 2 * geom.width, geom.out_channels) and y.dtype == x.dtype
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want), atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])


#: (geometry, block_h): two frames of several row blocks (first, middle, last), one block of the
#: whole image, one row per block, a one-row image (both edges in one block), 3 output channels,
#: output channels over one lane tile (two pieces of the strided store, the second narrower).
CASES = [
    (UpsampleGeometry(2, 6, 8, 8, 6), 2),
    (UpsampleGeometry(1, 5, 16, 16, 8), None),
    (UpsampleGeometry(1, 4, 8, 4, 5), 1),
    (UpsampleGeometry(2, 1, 8, 8, 4), None),
    (UpsampleGeometry(1, 6, 16, 8, 3), 3),
    (UpsampleGeometry(1, 4, 8, 8, 160), 2),
]


@pytest.mark.parametrize("geom", [g for g, _ in CASES], ids=str)
def test_the_xla_path_convolves_the_upsampled_input(geom):
    x, kernel, bias = inputs(geom, jnp.float32)
    np.testing.assert_allclose(upsample_conv2d(x, kernel, bias, backend="xla"),
                               upsampled_then_convolved(x, kernel, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("geom,block_h", CASES, ids=str)
@pytest.mark.parametrize("backend", ["pallas_tpu_interpret", compiled("pallas_tpu")])
def test_tpu_kernel_matches_xla(geom, block_h, backend):
    check_against_xla(geom, jnp.float32, backend, block_h)


@pytest.mark.parametrize("geom,block_h", [CASES[0], CASES[3], CASES[5]], ids=str)
def test_tpu_kernel_under_the_simulator(geom, block_h):
    check_against_xla(geom, jnp.float32, "pallas_tpu_simulate", block_h)


def test_bfloat16():
    check_against_xla(UpsampleGeometry(2, 4, 16, 16, 16), jnp.bfloat16, "pallas_tpu_interpret", 2)


def test_the_default_row_block_divides_the_height():
    assert [upsample_tpu.default_block_h(h) for h in (1, 7, 8, 60, 120, 240, 13)] == [1, 7, 8, 6, 8, 8, 1]


def test_every_registry_name_has_an_implementation():
    assert list(IMPLEMENTATIONS) == list(BACKENDS)
    for name, entry in BACKENDS.items():
        assert (IMPLEMENTATIONS[name].__name__ == "_pallas_tpu") == (entry.kind == "pallas_tpu"), name


def test_kernel_name_spells_the_geometry():
    geom = UpsampleGeometry(4, 240, 416, 192, 96)
    assert kernel_name(geom) == "upsample_conv2d_tpu_t4_h240_w416_i192_o96"
    assert geometry_of_kernel(kernel_name(geom)) == geom
    assert geom.flops == 2 * 9 * 192 * 4 * 96 * 4 * 240 * 416
    with pytest.raises(ValueError, match="is not an upsampling-convolution kernel name"):
        geometry_of_kernel("causal_conv3d_tpu_t4_h480_w832_i96_o96")


def test_arguments_are_checked():
    x, kernel, bias = inputs(UpsampleGeometry(1, 4, 8, 4, 6), jnp.float32)
    with pytest.raises(TypeError, match="x must be an array"):
        upsample_conv2d([1.0], kernel, bias)
    with pytest.raises(ValueError, match=r"x must have rank 4 \[T, H, W, Cin\], got shape \(4, 8, 4\)"):
        upsample_conv2d(x[0], kernel, bias)
    with pytest.raises(ValueError, match=r"kernel.shape must be \(3, 3, 4, Cout\)"):
        upsample_conv2d(x, kernel[:2], bias)
    with pytest.raises(ValueError, match=r"bias.shape must be \(6,\)"):
        upsample_conv2d(x, kernel, bias[:3])
    with pytest.raises(ValueError, match="kernel.dtype must equal x.dtype=float32, got bfloat16"):
        upsample_conv2d(x, kernel.astype(jnp.bfloat16), bias)
    with pytest.raises(ValueError, match=r"block_h must be a divisor of H=4, got 3"):
        upsample_conv2d(x, kernel, bias, block_h=3)
    with pytest.raises(ValueError, match=r"block_h must be a divisor of H=4, got 5"):
        upsample_conv2d(x, kernel, bias, block_h=5)
    with pytest.raises(ArgumentTypeError, match="block_h"):
        upsample_conv2d(x, kernel, bias, block_h=2.0)
    with pytest.raises(ValueError, match="backend"):
        upsample_conv2d(x, kernel, bias, backend="nope")


# ------------------------------------------------------------------------------------------------
# libtpu compile-only: Wan 2.1's widest upsampler, for v5e and v6e
# ------------------------------------------------------------------------------------------------

WAN_WIDEST = UpsampleGeometry(4, 240, 416, 192, 96)


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("gen", ["v5e", "v6e"])
def test_compiles_writing_the_output_row_major(gen):
    """The input and the upsampled output stay row-major (the causal convolutions' format): no copy
    of either, no temporaries."""
    from pallas_kernels.causal_conv import row_major

    g = WAN_WIDEST
    device = tpu_aot.compile_only_device(gen)
    sharding = jax.sharding.SingleDeviceSharding(device)
    rows = row_major(4, sharding)
    x_shape, y_shape = (g.frames, g.height, g.width, g.in_channels), (g.frames, 2 * g.height, 2 * g.width,
                                                                        g.out_channels)
    args = [jax.ShapeDtypeStruct(x_shape, jnp.bfloat16, sharding=rows),
            jax.ShapeDtypeStruct((3, 3, g.in_channels, g.out_channels), jnp.bfloat16, sharding=sharding),
            jax.ShapeDtypeStruct((g.out_channels,), jnp.bfloat16, sharding=sharding)]
    with jax.default_device(device):
        compiled_call = jax.jit(lambda x, k, b: upsample_conv2d(x, k, b, backend="pallas_tpu"),
                                out_shardings=rows).trace(*args).lower().compile()
    report = tpu_aot.report(compiled_call, [x_shape, y_shape])
    assert report.pool_copies == 0
    assert report.temp_bytes < 2 ** 20  # the packed weights only
    assert kernel_name(g) in report.hlo


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("gen", ["v5e", "v6e"])
def test_the_bundle_estimate_prices_the_rows(gen):
    """The estimate finds the grid loop around the row loop and charges each input row at least
    the padded product at the MXU's peak, each grid step its overhead."""
    from pallas_kernels.upsample_conv import tpu_estimate as upsample_estimate
    from pallas_kernels.window_attention.tpu_estimate import estimate

    g = WAN_WIDEST
    result = estimate(g, "bfloat16", gen)
    chip = tpu_aot.CHIPS[gen]
    rows = g.frames * g.height
    floor = rows * upsample_estimate.row_floor_cycles(g, gen) / chip.clock_hz
    assert result.grid_steps == rows // upsample_tpu.default_block_h(g.height)
    assert floor + result.grid_steps * tpu_aot.GRID_STEP_SECONDS <= result.seconds < 3 * floor
    assert f"{rows} rows" in result.note
    assert g.flops / chip.bf16_flops < result.seconds
