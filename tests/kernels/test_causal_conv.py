"""The causal 3x3x3 convolution (the Wan VAE decoder's): the TPU kernel against the XLA path (with
and without the input norm), its in-place cache write, its kernel name and the argument checks.

The TPU kernel runs interpreted and under the TPU simulator here (races detected, uninitialised
VMEM reads as NaN, out-of-bounds reads raise); both read the cache through the aliased output, so
a cache row written before its last read changes ``y``. The libtpu compiles (skipped without
libtpu) check a real Wan VAE shape for v5e and v6e: no copy of the frames or the cache, the cache
aliased, and a loop carrying the cache keeps one copy of it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import tpu_aot
from pallas_kernels.backend import BACKENDS
from pallas_kernels.causal_conv import (
    IMPLEMENTATIONS,
    ConvGeometry,
    causal_conv3d,
    geometry_of_kernel,
    kernel_name,
    row_major,
    row_major_tpu_bytes,
)
from pallas_kernels.causal_conv import tpu as conv_tpu
from pallas_kernels.causal_conv import xla as conv_xla
from pallas_kernels.checks import ArgumentTypeError
from tests.kernels.device_backends import compiled

needs_libtpu = pytest.mark.skipif(not tpu_aot.libtpu_available(),
                                  reason="libtpu is not installed (pip install -e '.[tpu]')")
TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}


def inputs(geom: ConvGeometry, dtype, seed=0):
    """``x, cache, kernel, bias`` of ``geom``: a nonzero cache, weights scaled to unit outputs."""
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=1.0):
        return jnp.asarray(scale * rng.standard_normal(shape), dtype)

    g = geom
    return (normal(g.frames, g.height, g.width, g.in_channels), normal(2, g.height, g.width, g.in_channels),
            normal(3, 3, 3, g.in_channels, g.out_channels, scale=(27 * g.in_channels) ** -0.5),
            normal(g.out_channels))


def norm_gamma(geom: ConvGeometry, dtype, seed=1):
    """A norm scale of ``geom``'s input channels, some negative (the SiLU sees both signs)."""
    return jnp.asarray(np.random.default_rng(seed).uniform(-1.5, 1.5, geom.in_channels), dtype)


def check_against_xla(geom: ConvGeometry, dtype, backend: str, block_h):
    x, cache, kernel, bias = inputs(geom, dtype)
    gamma = norm_gamma(geom, dtype) if geom.input_norm else None
    residual = (jnp.asarray(np.random.default_rng(2).standard_normal((*x.shape[:3], geom.out_channels)), dtype)
                if geom.residual else None)
    y, new_cache = causal_conv3d(x, cache, kernel, bias, norm_gamma=gamma, residual=residual, backend=backend,
                                 block_h=block_h)
    f32 = [None if a is None else a.astype(jnp.float32) for a in (x, cache, kernel, bias, gamma, residual)]
    want_y, want_cache = causal_conv3d(*f32[:4], norm_gamma=f32[4], residual=f32[5], backend="xla")
    assert y.shape == want_y.shape and y.dtype == x.dtype
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want_y), atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])
    np.testing.assert_array_equal(np.asarray(new_cache, np.float32), np.asarray(want_cache))


#: (geometry, block_h): one block, first/middle/last blocks, a partial last block (H not a multiple
#: of block_h), T = 1 (the new cache mixes cache and x) and T > 2, narrow outputs written transposed
#: (3 channels as conv_out, 6, 8) and wider ones (12, 20).
CASES = [
    (ConvGeometry(2, 10, 16, 8, 3), 4),
    (ConvGeometry(1, 9, 8, 4, 6), 3),
    (ConvGeometry(1, 7, 8, 16, 12), None),
    (ConvGeometry(4, 12, 8, 8, 8), 5),
    (ConvGeometry(3, 5, 16, 12, 20), 1),
]


@pytest.mark.parametrize("geom,block_h", CASES, ids=lambda c: str(c))
@pytest.mark.parametrize("backend", ["pallas_tpu_interpret", compiled("pallas_tpu")])
def test_tpu_kernel_matches_xla(geom, block_h, backend):
    check_against_xla(geom, jnp.float32, backend, block_h)


@pytest.mark.parametrize("geom,block_h", [CASES[1], CASES[3]], ids=lambda c: str(c))
def test_tpu_kernel_under_the_simulator(geom, block_h):
    check_against_xla(geom, jnp.float32, "pallas_tpu_simulate", block_h)


#: The input norm's cases: T = 1 (the ring starts at every step), T = 4 with middle blocks (frames
#: normalized once and reused from the ring), one row per block, a partial last block.
NORM_CASES = [(dataclasses.replace(geom, input_norm=True), block_h) for geom, block_h in (CASES[1], CASES[3], CASES[4])]


@pytest.mark.parametrize("geom,block_h", NORM_CASES, ids=lambda c: str(c))
@pytest.mark.parametrize("backend", ["pallas_tpu_interpret", "pallas_tpu_simulate", compiled("pallas_tpu")])
def test_tpu_kernel_with_the_input_norm_matches_xla(geom, block_h, backend):
    check_against_xla(geom, jnp.float32, backend, block_h)


@pytest.mark.parametrize("generation", ["v5e", "v6e"])
def test_the_norms_silu_form_follows_the_chip(generation, monkeypatch):
    """Built for a v5e the kernel's norm takes the SiLU in tanh form (the generation read outside
    the kernel's jit and passed static), for a v6e ``jax.nn.silu``; both match the XLA path."""
    import pallas_kernels.causal_conv as conv_package

    monkeypatch.setattr(conv_package, "default_generation", lambda: generation)
    forms, real = [], conv_tpu.causal_conv3d
    monkeypatch.setattr(conv_tpu, "causal_conv3d", lambda *a, **k: forms.append(k["tanh_silu"]) or real(*a, **k))
    geom, block_h = NORM_CASES[0]
    check_against_xla(geom, jnp.float32, "pallas_tpu_interpret", block_h)
    assert forms == [generation == "v5e"]


#: A residual alone (3 output channels, two row blocks) and with the input norm (several frames).
RESIDUAL_CASES = [(dataclasses.replace(CASES[0][0], residual=True), 4),
                  (dataclasses.replace(CASES[3][0], input_norm=True, residual=True), 5)]


@pytest.mark.parametrize("geom,block_h", RESIDUAL_CASES, ids=lambda c: str(c))
@pytest.mark.parametrize("backend", ["pallas_tpu_interpret", "pallas_tpu_simulate", compiled("pallas_tpu")])
def test_tpu_kernel_adds_the_residual(geom, block_h, backend):
    check_against_xla(geom, jnp.float32, backend, block_h)


def test_the_residual_is_added_to_the_output():
    geom = ConvGeometry(2, 5, 8, 4, 6)
    x, cache, kernel, bias = inputs(geom, jnp.float32)
    residual = jnp.arange(2 * 5 * 8 * 6, dtype=jnp.float32).reshape(2, 5, 8, 6)
    y, new_cache = causal_conv3d(x, cache, kernel, bias, residual=residual, backend="xla")
    want_y, want_cache = causal_conv3d(x, cache, kernel, bias, backend="xla")
    np.testing.assert_allclose(y, want_y + residual, rtol=1e-6)
    np.testing.assert_array_equal(new_cache, want_cache)


@pytest.mark.parametrize("norm", [False, True])
def test_bfloat16(norm):
    check_against_xla(ConvGeometry(2, 6, 16, 16, 16, input_norm=norm), jnp.bfloat16, "pallas_tpu_interpret", 4)


def test_the_input_norm_is_the_norm_then_the_convolution():
    """With ``norm_gamma`` the call convolves ``norm_silu`` of the cache and the frames, and keeps
    the frames as given (before the norm) in the new cache; a zero frame stays zero."""
    geom = ConvGeometry(3, 6, 8, 8, 12, input_norm=True)
    x, cache, kernel, bias = inputs(geom, jnp.float32)
    x = x.at[1].set(0.0)
    gamma = norm_gamma(geom, jnp.float32)
    y, new_cache = causal_conv3d(x, cache, kernel, bias, norm_gamma=gamma, backend="xla")
    normed = conv_xla.norm_silu(jnp.concatenate([cache, x]), gamma)
    assert not bool(jnp.any(normed[3]))
    want_y, _ = causal_conv3d(normed[2:], normed[:2], kernel, bias, backend="xla")
    np.testing.assert_allclose(y, want_y, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(new_cache, x[-2:])
    rms = np.sqrt(np.mean(np.square(np.asarray(conv_xla.channel_rms_norm(x, jnp.ones(8))[0])), axis=-1))
    np.testing.assert_allclose(rms, 1.0, rtol=1e-5)


@pytest.mark.parametrize("cout", [3, 8, 9])
def test_the_xla_path_is_the_plain_convolution_at_every_width(cout):
    """At most 8 output channels the XLA path contracts the channels first; either way it is the
    time-concatenated convolution."""
    rng = np.random.default_rng(cout)
    x, cache = rng.standard_normal((3, 7, 10, 16)), rng.standard_normal((2, 7, 10, 16))
    kernel, bias = rng.standard_normal((3, 3, 3, 16, cout)), rng.standard_normal(cout)
    x, cache, kernel, bias = (jnp.asarray(a, jnp.float32) for a in (x, cache, kernel, bias))
    y, new_cache = causal_conv3d(x, cache, kernel, bias, backend="xla")
    extended = jnp.concatenate([cache, x])
    want = jax.lax.conv_general_dilated(extended[None], kernel, (1, 1, 1), ((0, 0), (1, 1), (1, 1)),
                                        dimension_numbers=("NDHWC", "DHWIO", "NDHWC"))[0] + bias
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(new_cache, extended[-2:])


@pytest.mark.parametrize("frames", [1, 2])
def test_a_cache_row_written_too_early_is_caught(frames, monkeypatch):
    """The rule that keeps the in-place write safe is what the tests check: writing each block's
    last row too (read later as the next block's halo) changes ``y``."""
    original = conv_tpu.row_blocks

    def too_eager(height, block_h):
        last = -(-height // block_h) - 1
        return tuple(dataclasses.replace(k, write_rows=k.write_rows + 1) if k.hi < last else k
                     for k in original(height, block_h))

    monkeypatch.setattr(conv_tpu, "row_blocks", too_eager)
    with pytest.raises(AssertionError):
        check_against_xla(ConvGeometry(frames, 9, 8, 4, 4), jnp.float32, "pallas_tpu_simulate", 3)


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("backend", ["xla", "pallas_tpu_interpret", "pallas_tpu_simulate"])
def test_a_batch_cache_is_read_and_written_at_its_stream_only(backend, norm):
    """With ``stream=`` the call is the unbatched call on that stream's entry, and every other
    stream's entry comes back bit for bit, NaN included: no stream reads or writes another's."""
    geom = ConvGeometry(2, 9, 8, 4, 6, input_norm=norm)
    x, cache, kernel, bias = inputs(geom, jnp.float32)
    gamma = norm_gamma(geom, jnp.float32) if norm else None
    want_y, want_cache = causal_conv3d(x, cache, kernel, bias, norm_gamma=gamma, backend="xla")
    poison = jnp.full((3, *cache.shape), jnp.nan, jnp.float32)
    for stream in (0, 2, jnp.int32(1)):
        batch = poison.at[stream].set(cache)
        y, new_batch = causal_conv3d(x, batch, kernel, bias, norm_gamma=gamma, stream=stream, backend=backend,
                                     block_h=4)
        np.testing.assert_allclose(y, want_y, rtol=2e-5, atol=2e-5)
        np.testing.assert_array_equal(new_batch[stream], want_cache)
        others = [i for i in range(3) if i != int(stream)]
        assert bool(jnp.isnan(new_batch[jnp.asarray(others)]).all())


def test_a_traced_stream_selects_inside_jit():
    geom = ConvGeometry(1, 5, 8, 4, 4)
    x, cache, kernel, bias = inputs(geom, jnp.float32)
    batch = jnp.stack([cache, 2 * cache])
    run = jax.jit(lambda b, i: causal_conv3d(x, b, kernel, bias, stream=i, backend="pallas_tpu_interpret"))
    for i in range(2):
        y, new_batch = run(batch, jnp.int32(i))
        want_y, want_cache = causal_conv3d(x, batch[i], kernel, bias, backend="xla")
        np.testing.assert_allclose(y, want_y, rtol=2e-5, atol=2e-5)
        np.testing.assert_array_equal(new_batch[i], want_cache)
        np.testing.assert_array_equal(new_batch[1 - i], batch[1 - i])


def test_row_blocks_write_every_row_once():
    for height, block_h in [(9, 3), (10, 4), (7, 7), (5, 1), (13, 5)]:
        written = []
        for kind in conv_tpu.row_blocks(height, block_h):
            for block in range(kind.lo, kind.hi + 1):
                start = block * block_h + kind.offset
                written += range(start, start + kind.write_rows)
                assert start >= 0 and start + kind.read_rows <= height
        assert sorted(written) == list(range(height)), (height, block_h)


def test_every_registry_name_has_an_implementation():
    assert list(IMPLEMENTATIONS) == list(BACKENDS)
    for name, entry in BACKENDS.items():
        assert (IMPLEMENTATIONS[name].__name__ == "_pallas_tpu") == (entry.kind == "pallas_tpu"), name


def test_kernel_name_spells_the_geometry():
    geom = ConvGeometry(4, 480, 832, 96, 96)
    assert kernel_name(geom) == "causal_conv3d_tpu_t4_h480_w832_i96_o96"
    assert geometry_of_kernel(kernel_name(geom)) == geom
    normed = dataclasses.replace(geom, input_norm=True)
    assert kernel_name(normed) == "causal_conv3d_tpu_t4_h480_w832_i96_o96_norm"
    assert geometry_of_kernel(kernel_name(normed)) == normed
    both = dataclasses.replace(normed, residual=True)
    assert kernel_name(both) == "causal_conv3d_tpu_t4_h480_w832_i96_o96_norm_res"
    assert geometry_of_kernel(kernel_name(both)) == both
    assert geometry_of_kernel(kernel_name(dataclasses.replace(geom, residual=True))).residual
    with pytest.raises(ValueError, match="is not a causal-convolution kernel name"):
        geometry_of_kernel("window_attention_tpu")


def test_arguments_are_checked():
    x, cache, kernel, bias = inputs(ConvGeometry(1, 4, 8, 4, 6), jnp.float32)
    with pytest.raises(TypeError, match="x must be an array"):
        causal_conv3d([1.0], cache, kernel, bias)
    with pytest.raises(ValueError, match=r"cache.shape must be \(2, 4, 8, 4\)"):
        causal_conv3d(x, cache[:1], kernel, bias)
    with pytest.raises(ValueError, match=r"kernel.shape must be \(3, 3, 3, 4, Cout\)"):
        causal_conv3d(x, cache, kernel[:2], bias)
    with pytest.raises(ValueError, match=r"bias.shape must be \(6,\)"):
        causal_conv3d(x, cache, kernel, bias[:3])
    with pytest.raises(ValueError, match="cache.dtype must equal x.dtype=float32, got bfloat16"):
        causal_conv3d(x, cache.astype(jnp.bfloat16), kernel, bias)
    with pytest.raises(ValueError, match=r"block_h must be an int in \[1, 4\] \(H\), got 5"):
        causal_conv3d(x, cache, kernel, bias, block_h=5)
    with pytest.raises(ArgumentTypeError, match="block_h must be"):
        causal_conv3d(x, cache, kernel, bias, block_h=2.0)
    with pytest.raises(ValueError, match="backend must be one of"):
        causal_conv3d(x, cache, kernel, bias, backend="fast")
    batch = jnp.stack([cache, cache])
    with pytest.raises(ValueError, match=r"cache must have rank 5 \[B, 2, H, W, Cin\]"):
        causal_conv3d(x, cache, kernel, bias, stream=0)
    with pytest.raises(ValueError, match=r"^stream=2 is out of range; allowed \[0, 2\) \(cache.shape\[0\]\)$"):
        causal_conv3d(x, batch, kernel, bias, stream=2)
    with pytest.raises(ArgumentTypeError, match="^stream must be an integer scalar"):
        causal_conv3d(x, batch, kernel, bias, stream=True)
    with pytest.raises(ArgumentTypeError, match="^stream must be an integer scalar"):
        causal_conv3d(x, batch, kernel, bias, stream=jnp.float32(0))
    with pytest.raises(ValueError, match=r"^stream must be an int scalar, got shape \(1,\)"):
        causal_conv3d(x, batch, kernel, bias, stream=jnp.zeros((1,), jnp.int32))
    with pytest.raises(ValueError, match=r"cache.shape must be \(2, 4, 8, 4\)"):
        causal_conv3d(x, batch[:, :1], kernel, bias, stream=0)
    with pytest.raises(ValueError, match=r"^norm_gamma.shape must be \(4,\) \(Cin\), got \(6,\)$"):
        causal_conv3d(x, cache, kernel, bias, norm_gamma=bias)
    with pytest.raises(ValueError, match="norm_gamma must have rank 1"):
        causal_conv3d(x, cache, kernel, bias, norm_gamma=x)
    with pytest.raises(ValueError, match="norm_gamma.dtype must equal x.dtype=float32, got bfloat16"):
        causal_conv3d(x, cache, kernel, bias, norm_gamma=jnp.ones(4, jnp.bfloat16))
    with pytest.raises(ValueError, match=r"^residual.shape must be \(1, 4, 8, 6\) \(y's\), got \(1, 4, 8, 4\)$"):
        causal_conv3d(x, cache, kernel, bias, residual=x)
    with pytest.raises(ValueError, match="residual must have rank 4"):
        causal_conv3d(x, cache, kernel, bias, residual=bias)
    with pytest.raises(ValueError, match="residual.dtype must equal x.dtype=float32, got bfloat16"):
        causal_conv3d(x, cache, kernel, bias, residual=jnp.zeros((1, 4, 8, 6), jnp.bfloat16))


def test_row_major_format_and_its_tpu_bytes():
    """The row-major format is the CPU's own layout (an array put in it reads back unchanged); the
    TPU bytes pad the minor dim to 128 lanes and the second-minor to 8 rows (a power of two below)."""
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    x = jnp.arange(2 * 3 * 5 * 7, dtype=jnp.float32).reshape(2, 3, 5, 7)
    kept = jax.device_put(x, row_major(4, sharding))
    assert kept.format.layout.major_to_minor == (0, 1, 2, 3)
    np.testing.assert_array_equal(kept, x)
    assert row_major_tpu_bytes((2, 480, 832, 96), jnp.bfloat16) == 2 * 480 * 832 * 128 * 2
    assert row_major_tpu_bytes((2, 60, 104, 384), jnp.float32) == 2 * 60 * 104 * 384 * 4
    assert row_major_tpu_bytes((2, 6, 100, 200), jnp.bfloat16) == 2 * 6 * 104 * 256 * 2
    assert [row_major_tpu_bytes((rows, 1), jnp.float32) // 512 for rows in (1, 2, 3, 5, 9)] == [1, 2, 4, 8, 16]
    assert row_major_tpu_bytes((0, 3, 4), jnp.float32) == 0
    with pytest.raises(ValueError, match="ndim must be positive, got 0"):
        row_major(0, sharding)
    with pytest.raises(TypeError, match="ndim must be positive, got True"):
        row_major(True, sharding)
    with pytest.raises(ValueError, match=r"shape must have rank >= 2 and no negative dim, got \(5,\)"):
        row_major_tpu_bytes((5,), jnp.float32)
    with pytest.raises(ValueError, match="dtype int8 is 1 bytes wide"):
        row_major_tpu_bytes((2, 5), jnp.int8)


# ------------------------------------------------------------------------------------------------
# libtpu compile-only: a real Wan VAE shape on v5e and v6e
# ------------------------------------------------------------------------------------------------

WAN_FULL_RES = ConvGeometry(4, 480, 832, 96, 96)
"""The decoder's last stage (480x832, 96 channels, 4 frames per latent frame): its largest calls."""
WAN_LOW_RES = ConvGeometry(1, 60, 104, 384, 384)
"""The decoder's first stage (one latent frame per step of its per-frame scan)."""


def _specs(geom: ConvGeometry):
    g, bf16 = geom, jnp.bfloat16
    return [((g.frames, g.height, g.width, g.in_channels), bf16), ((2, g.height, g.width, g.in_channels), bf16),
            ((3, 3, 3, g.in_channels, g.out_channels), bf16), ((g.out_channels,), bf16)]


def _conv(x, cache, kernel, bias, norm_gamma=None, residual=None):
    return causal_conv3d(x, cache, kernel, bias, norm_gamma=norm_gamma, residual=residual, backend="pallas_tpu")


def _compile_row_major(fn, specs, gen: str):
    """``fn`` compiled for ``gen`` with the cache (argument 1) donated and every array argument
    and output of rank 4 or more in the row-major HBM layout the kernel reads (XLA's default for
    96 channels puts H on the lanes: a caller that keeps the frames row-major, as the decoder's
    own activations are, passes them without a relayout)."""
    device = tpu_aot.compile_only_device(gen)
    sharding = jax.sharding.SingleDeviceSharding(device)

    def fmt(rank):
        return row_major(rank, sharding) if rank >= 4 else sharding

    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=fmt(len(shape))) for shape, dtype in specs]
    outs = jax.eval_shape(fn, *args)
    with jax.default_device(device):
        return jax.jit(fn, donate_argnums=(1,), out_shardings=jax.tree.map(lambda o: fmt(o.ndim), outs)
                       ).trace(*args).lower().compile()


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("gen", ["v5e", "v6e"])
def test_compiles_with_the_cache_in_place(gen, norm):
    """The donated cache is the new cache's buffer; neither the frames nor the cache is copied
    (with the input norm and the residual too: the norm runs in VMEM, nothing normalized is
    written to HBM, and the residual is read block by block)."""
    geom = dataclasses.replace(WAN_FULL_RES, input_norm=norm, residual=norm)
    specs = _specs(geom) + [((geom.in_channels,), jnp.bfloat16), (_specs(geom)[0][0], jnp.bfloat16)] * norm
    report = tpu_aot.report(_compile_row_major(_conv, specs, gen), [shape for shape, _ in specs[:2]])
    cache_bytes = row_major_tpu_bytes(specs[1][0], jnp.bfloat16)  # 96 channels take 128 lanes in HBM
    assert report.pool_copies == 0
    assert report.alias_bytes == cache_bytes
    assert report.temp_bytes < 0.05 * cache_bytes
    assert kernel_name(geom) in report.hlo


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("gen", ["v5e", "v6e"])
def test_a_narrow_output_compiles_transposed_with_the_cache_in_place(gen):
    """``conv_out``'s shape (96 -> 3 channels, with its norm): the kernel writes ``[T, H, 3, W]``
    (``W`` on the lanes) and XLA swaps it back; the cache is aliased, neither the frames nor the
    cache is copied, and the only temporary is the transposed output."""
    geom = dataclasses.replace(WAN_FULL_RES, out_channels=3, input_norm=True)
    specs = _specs(geom) + [((geom.in_channels,), jnp.bfloat16)]
    report = tpu_aot.report(_compile_row_major(_conv, specs, gen), [shape for shape, _ in specs[:2]])
    assert report.pool_copies == 0
    assert report.alias_bytes == row_major_tpu_bytes(specs[1][0], jnp.bfloat16)
    assert report.temp_bytes <= row_major_tpu_bytes((geom.frames, geom.height, 3, geom.width), jnp.bfloat16)
    assert kernel_name(geom) in report.hlo


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("gen", ["v5e", "v6e"])
def test_compiles_with_a_batch_cache_in_place(gen):
    """A batch's cache with a run-time stream index: the whole donated batch is the new batch's
    buffer, and no stream's entry is copied out or back."""
    geom = WAN_FULL_RES
    x_spec, cache_spec, *weights = _specs(geom)
    batch_spec = ((3, *cache_spec[0]), cache_spec[1])
    specs = [x_spec, batch_spec, *weights, ((), jnp.int32)]
    report = tpu_aot.report(_compile_row_major(
        lambda x, batch, kernel, bias, stream: causal_conv3d(x, batch, kernel, bias, stream=stream,
                                                             backend="pallas_tpu"), specs, gen),
        [x_spec[0], cache_spec[0], batch_spec[0]])
    batch_bytes = row_major_tpu_bytes(batch_spec[0], jnp.bfloat16)
    assert report.pool_copies == 0
    assert report.alias_bytes == batch_bytes
    assert report.temp_bytes < 0.02 * batch_bytes


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("gen", ["v5e", "v6e"])
def test_row_major_tpu_bytes_are_the_compilers(gen):
    """An argument in the row-major format takes, by the compiler's count, the bytes
    :func:`row_major_tpu_bytes` gives: lane and sublane padding, small row counts, both dtypes."""
    sharding = jax.sharding.SingleDeviceSharding(tpu_aot.compile_only_device(gen))
    for shape in [(2, 480, 832, 96), (2, 240, 416, 192), (2, 60, 104, 16), (2, 6, 100, 200), (2, 6, 3, 5),
                  (3, 2, 6, 10, 4)]:
        for dtype in (jnp.bfloat16, jnp.float32):
            fmt = row_major(len(shape), sharding)
            arg = jax.ShapeDtypeStruct(shape, dtype, sharding=fmt)
            compiled = jax.jit(lambda a: a, donate_argnums=0, out_shardings=fmt).trace(arg).lower().compile()
            assert compiled.memory_analysis().argument_size_in_bytes == row_major_tpu_bytes(shape, dtype), shape


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("gen", ["v5e", "v6e"])
def test_a_loop_carrying_the_cache_keeps_one_copy(gen):
    """A ``scan`` over frames whose carry is the cache (the decoder's per-frame loop): the kernel's
    new cache is the carry itself, not a second buffer copied into it."""
    geom = WAN_LOW_RES
    specs = _specs(geom)
    frames = (3, *specs[0][0])

    def loop(xs, cache, kernel, bias):
        def step(cache, x):
            y, cache = _conv(x, cache, kernel, bias)
            return cache, y
        return jax.lax.scan(step, cache, xs)

    report = tpu_aot.report(_compile_row_major(loop, [(frames, jnp.bfloat16), *specs[1:]], gen), [specs[1][0]])
    cache_bytes = row_major_tpu_bytes(specs[1][0], jnp.bfloat16)
    assert report.pool_copies == 0
    assert report.alias_bytes == cache_bytes
    assert report.temp_bytes < cache_bytes


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("gen", ["v5e", "v6e"])
def test_the_bundle_estimate_prices_the_rows(gen):
    """The estimate finds the grid loop around the row loop in the kernel's bundles and charges each
    output row at least the padded product at the MXU's peak, each grid step its overhead; with the
    input norm, its three loops on top (a block's first frame normalizes three frames, every later
    step one)."""
    from pallas_kernels.causal_conv import tpu_estimate as conv_estimate
    from pallas_kernels.window_attention.tpu_estimate import estimate

    geom = WAN_LOW_RES
    result = estimate(geom, "bfloat16", gen)
    chip = tpu_aot.CHIPS[gen]
    rows = geom.frames * geom.height
    floor = rows * conv_estimate.row_floor_cycles(geom, gen) / chip.clock_hz
    assert result.grid_steps == geom.frames * -(-geom.height // conv_tpu.DEFAULT_BLOCK_H)
    assert floor + result.grid_steps * tpu_aot.GRID_STEP_SECONDS < result.seconds < 3 * floor
    assert f"{rows} rows" in result.note and "input norm" not in result.note
    normed = estimate(dataclasses.replace(geom, input_norm=True), "bfloat16", gen)
    assert result.seconds < normed.seconds < 2 * result.seconds
    assert "input norm" in normed.note and normed.grid_steps == result.grid_steps
    narrow = dataclasses.replace(WAN_FULL_RES, out_channels=3)  # the transposed product, 24 rows
    narrow_floor = narrow.frames * narrow.height * conv_estimate.row_floor_cycles(narrow, gen) / chip.clock_hz
    assert narrow_floor < estimate(narrow, "bfloat16", gen).seconds < 3 * narrow_floor
