"""The adaLN MLP (``pallas_kernels.adaln_mlp``): the TPU kernel (interpreted) against XLA and a
float64 reference, the refusals, and the kernel compiled for v5e and v6e with libtpu (no TPU
needed)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import tpu_aot
from pallas_kernels.adaln_mlp import MLPGeometry, adaln_mlp, geometry_of_kernel, kernel_name
from pallas_kernels.adaln_mlp import tpu as mlp_tpu
from pallas_kernels.adaln_mlp.xla import per_token

needs_libtpu = pytest.mark.skipif(not tpu_aot.libtpu_available(),
                                  reason="libtpu is not installed (pip install -e '.[tpu]')")

#: Wan-1.3B's MLP over one row's chunk: 3 frames of 1,560 tokens, 1,536 -> 8,960 -> 1,536.
WAN_MLP = MLPGeometry(4680, 1536, 8960, 1560)

EPS = 1e-6


def _inputs(batch, frames, tokens_per_frame, dim, hidden, dtype, layers=3, x_dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((batch, frames * tokens_per_frame, dim)) * 2 + 0.5, x_dtype)
    shift, scale, gate = (jnp.asarray(rng.standard_normal((batch, frames, dim)) * 0.5, x_dtype) for _ in range(3))
    w_in = jnp.asarray(rng.standard_normal((layers, dim, hidden)) / np.sqrt(dim), dtype)
    b_in = jnp.asarray(rng.standard_normal((layers, hidden)) * 0.1, dtype)
    w_out = jnp.asarray(rng.standard_normal((layers, hidden, dim)) / np.sqrt(hidden), dtype)
    b_out = jnp.asarray(rng.standard_normal((layers, dim)) * 0.1, dtype)
    return x, shift, scale, gate, w_in, b_in, w_out, b_out


def _exact(x, shift, scale, gate, w_in, b_in, w_out, b_out, layer):
    """float64, frame by frame: ``x + gate * (gelu_tanh(norm(x) * (1 + scale) + shift) @ ...)``."""
    x, shift, scale, gate, w_in, b_in, w_out, b_out = (np.asarray(a, np.float64) for a in
                                                       (x, shift, scale, gate, w_in, b_in, w_out, b_out))
    repeat = x.shape[1] // shift.shape[1]
    shift, scale, gate = (np.repeat(m, repeat, axis=1) for m in (shift, scale, gate))
    normed = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + EPS)
    h = (normed * (1 + scale) + shift) @ w_in[layer] + b_in[layer]
    h = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3)))
    return x + gate * (h @ w_out[layer] + b_out[layer])


@pytest.mark.parametrize("shape", [(2, 3, 16, 128, 256), (1, 2, 24, 64, 128), (1, 3, 40, 96, 160)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_the_kernel_matches_xla_interpreted(shape, dtype):
    """Each block reads its own frame's rows and layer 1 of three stacked layers (two rows of three
    frames; frames of 16, 24 and 40 tokens, one block each); float32 to rounding, bf16 within the
    roundings to bf16 that both paths make (the input, the hidden activations, the output: a few
    bf16 ulps of the MLP's output, times the gate)."""
    args = _inputs(*shape, dtype)
    xla = adaln_mlp(*args, 1, eps=EPS, backend="xla")
    tpu = adaln_mlp(*args, jnp.int32(1), eps=EPS, backend="pallas_tpu_interpret")
    assert tpu.dtype == xla.dtype == jnp.float32 and tpu.shape == args[0].shape
    exact = _exact(*args, 1)
    if dtype == jnp.float32:
        np.testing.assert_allclose(tpu, exact, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(tpu, xla, rtol=1e-5, atol=1e-5)
    else:
        x, shift, scale, gate = args[:4]
        y = np.abs(exact - np.asarray(x, np.float64)) / np.maximum(
            np.abs(np.repeat(np.asarray(gate, np.float64), shape[2], axis=1)), 1e-3)
        bound = (np.max(y) * 2.0 ** -5 + 2.0 ** -6) * np.repeat(np.abs(np.asarray(gate)), shape[2], axis=1)
        assert np.all(np.abs(np.asarray(tpu) - exact) <= bound + 1e-6)
        assert np.all(np.abs(np.asarray(tpu) - np.asarray(xla)) <= bound + 1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_the_next_blocks_input_matches_xla_interpreted(dtype):
    """With ``next_modulation`` both paths also return the output layer-normalized and modulated by
    the next rows, in the weights' dtype: float32 to rounding, bf16 within one bf16 rounding of
    it (the two outputs it is computed from differ by rounding)."""
    args = _inputs(2, 3, 16, 128, 256, dtype)
    rng = np.random.default_rng(5)
    next_modulation = tuple(jnp.asarray(rng.standard_normal((2, 3, 128)) * 0.5, jnp.float32) for _ in range(2))
    xla_out, xla_next = adaln_mlp(*args, 1, next_modulation=next_modulation, eps=EPS, backend="xla")
    tpu_out, tpu_next = adaln_mlp(*args, 1, next_modulation=next_modulation, eps=EPS,
                                  backend="pallas_tpu_interpret")
    assert tpu_next.dtype == xla_next.dtype == dtype and tpu_next.shape == args[0].shape
    np.testing.assert_array_equal(tpu_out, adaln_mlp(*args, 1, eps=EPS, backend="pallas_tpu_interpret"))
    out = np.asarray(tpu_out, np.float64)
    normed = (out - out.mean(-1, keepdims=True)) / np.sqrt(out.var(-1, keepdims=True) + EPS)
    shift, scale = (np.repeat(np.asarray(m, np.float64), 16, axis=1) for m in next_modulation)
    want = normed * (1 + scale) + shift
    tolerance = 1e-5 if dtype == jnp.float32 else 2.0 ** -7
    for got in (tpu_next, xla_next):
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tolerance, atol=tolerance)
    np.testing.assert_allclose(np.asarray(tpu_next, np.float32), np.asarray(xla_next, np.float32),
                               rtol=2 * tolerance, atol=2 * tolerance)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_a_residual_input_is_added_first(dtype):
    """With ``residual_input`` ``(r, w, b)`` both paths run the MLP on ``x + r @ w[layer] +
    b[layer]`` and add its gated output to that: against float64 to the bf16 roundings of the
    product (bf16) and to rounding (float32), and the kernel against XLA."""
    args = _inputs(2, 3, 16, 128, 256, dtype)
    rng = np.random.default_rng(7)
    r = jnp.asarray(rng.standard_normal(args[0].shape), dtype)
    w = jnp.asarray(rng.standard_normal((3, 128, 128)) / np.sqrt(128), dtype)
    b = jnp.asarray(rng.standard_normal((3, 128)) * 0.1, dtype)
    xla = adaln_mlp(*args, 1, residual_input=(r, w, b), eps=EPS, backend="xla")
    tpu = adaln_mlp(*args, jnp.int32(1), residual_input=(r, w, b), eps=EPS, backend="pallas_tpu_interpret")
    shifted = np.asarray(args[0], np.float64) + np.asarray(r, np.float64) @ np.asarray(w[1], np.float64) \
        + np.asarray(b[1], np.float64)
    exact = _exact(shifted, *args[1:], 1)
    tolerance = 1e-4 if dtype == jnp.float32 else 6e-2
    np.testing.assert_allclose(tpu, exact, rtol=tolerance, atol=tolerance)
    np.testing.assert_allclose(tpu, xla, rtol=tolerance, atol=tolerance)
    with pytest.raises(ValueError, match=r"residual_input\[1\].shape must be \(3, 128, 128\)"):
        adaln_mlp(*args, 1, residual_input=(r, w[:, :64], b), backend="xla")
    with pytest.raises(ValueError, match="residual_input must be a triple"):
        adaln_mlp(*args, 1, residual_input=(r, w), backend="xla")


def test_a_bf16_residual_stream_stays_bf16():
    """Under a uniform bf16 policy (``x`` and the modulation in bf16) the output is bf16 and the
    kernel agrees with XLA to bf16 rounding of the sum."""
    args = _inputs(1, 2, 16, 128, 256, jnp.bfloat16, x_dtype=jnp.bfloat16)
    xla = adaln_mlp(*args, 2, backend="xla")
    tpu = adaln_mlp(*args, 2, backend="pallas_tpu_interpret")
    assert tpu.dtype == xla.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(tpu, np.float32), np.asarray(xla, np.float32), rtol=3e-2, atol=3e-2)


def test_the_layer_index_selects_the_weights():
    """A traced layer index under ``jit`` reads that layer's weights (each layer gives a different
    output, equal to the reference's for that layer)."""
    args = _inputs(1, 2, 16, 64, 128, jnp.float32)
    run = jax.jit(lambda layer: adaln_mlp(*args, layer, eps=EPS, backend="pallas_tpu_interpret"))
    outs = [np.asarray(run(jnp.int32(layer))) for layer in range(3)]
    for layer, out in enumerate(outs):
        np.testing.assert_allclose(out, _exact(*args, layer), rtol=1e-4, atol=1e-4)
    assert not np.allclose(outs[0], outs[1])


def test_per_frame_values_reach_every_token_of_their_frame():
    values = jnp.asarray(np.random.default_rng(1).standard_normal((2, 3, 5)), jnp.float32)
    np.testing.assert_array_equal(per_token(values, 12), jnp.repeat(values, 4, axis=1))
    np.testing.assert_array_equal(per_token(values[:, :1], 4), jnp.repeat(values[:, :1], 4, axis=1))


def test_blocks_lie_in_one_frame_and_fit_the_vmem_limit():
    assert mlp_tpu.block_rows(WAN_MLP, 2, 4) == 520  # 1,560 = 3 x 520
    assert mlp_tpu.block_rows(MLPGeometry(48, 128, 256, 16), 4, 4) == 16
    assert mlp_tpu.block_rows(MLPGeometry(21, 128, 256, 7), 4, 4) is None  # no multiple of 8 divides 7
    assert mlp_tpu.block_rows(MLPGeometry(4680, 4096, 16384, 1560), 2, 4) is None  # the weights alone are over
    assert mlp_tpu.vmem_bytes(WAN_MLP, 520, 2, 4) <= mlp_tpu.VMEM_LIMIT < mlp_tpu.vmem_bytes(WAN_MLP, 780, 2, 4)


def test_no_block_fits_runs_xla():
    """Frames of 7 tokens (no block of a multiple of 8 rows lies in one) run the XLA path on a
    TPU name: the same values, no Mosaic call."""
    args = _inputs(1, 3, 7, 64, 128, jnp.float32)
    jaxpr = str(jax.make_jaxpr(lambda *a: adaln_mlp(*a, 0, eps=EPS, backend="pallas_tpu_interpret"))(*args))
    assert "pallas_call" not in jaxpr
    np.testing.assert_allclose(adaln_mlp(*args, 0, eps=EPS, backend="pallas_tpu_interpret"), _exact(*args, 0),
                               rtol=1e-4, atol=1e-4)


def test_the_kernel_name_spells_its_geometry():
    assert kernel_name(WAN_MLP) == "adaln_mlp_tpu_m4680_d1536_h8960_f1560"
    assert geometry_of_kernel(kernel_name(WAN_MLP)) == WAN_MLP
    handing_on = dataclasses.replace(WAN_MLP, next_input=True)
    assert kernel_name(handing_on) == "adaln_mlp_tpu_m4680_d1536_h8960_f1560_next"
    assert geometry_of_kernel(kernel_name(handing_on)) == handing_on
    in_block = dataclasses.replace(handing_on, residual_input=True)
    assert kernel_name(in_block) == "adaln_mlp_tpu_m4680_d1536_h8960_f1560_res_next"
    assert geometry_of_kernel(kernel_name(in_block)) == in_block
    assert in_block.flops == WAN_MLP.flops + 2 * 4680 * 1536 ** 2
    with pytest.raises(ValueError, match="is not an adaLN-MLP kernel name"):
        geometry_of_kernel("causal_conv3d_tpu_t4_h480_w832_i96_o96")


def _replace(args, index, value):
    return (*args[:index], value, *args[index + 1:])


@pytest.mark.parametrize("change, message", [
    (lambda a: _replace(a, 0, a[0][0]), r"x must have rank 3 \[B, N, dim\]"),
    (lambda a: _replace(a, 1, jnp.concatenate([a[1], a[1][:, :2]], axis=1)),
     r"shift.shape must be \(2, F, 128\), one F for every row table dividing N = 48, got \(2, 5, 128\)"),
    (lambda a: _replace(a, 2, a[2][:, :1]), r"scale.shape must be \(2, F, 128\), one F for every row table"),
    (lambda a: _replace(a, 3, a[3][:, :, :-1]), r"gate.shape must be \(2, F, 128\)"),
    (lambda a: _replace(a, 2, a[2].astype(jnp.bfloat16)), r"scale.dtype"),
    (lambda a: _replace(a, 4, a[4][:, :-1]), r"w_in.shape must be \(3, 128, 256\)|b_in.shape must be"),
    (lambda a: _replace(a, 5, a[5][:2]), r"b_in.shape must be \(3, 256\)"),
    (lambda a: _replace(a, 6, a[6][:, :, :-1]), r"w_out.shape must be \(3, 256, 128\)"),
    (lambda a: _replace(a, 7, a[7].astype(jnp.float32)), r"b_out.dtype"),
])
def test_bad_calls_name_the_argument(change, message):
    args = change(_inputs(2, 3, 16, 128, 256, jnp.bfloat16))
    with pytest.raises(ValueError, match=message):
        adaln_mlp(*args, 0, backend="xla")


def test_a_bad_next_modulation_is_refused():
    args = _inputs(2, 3, 16, 128, 256, jnp.bfloat16)
    shift = args[1]
    with pytest.raises(ValueError, match="next_modulation must be a pair"):
        adaln_mlp(*args, 0, next_modulation=shift, backend="xla")
    with pytest.raises(ValueError, match=r"next_modulation\[1\].shape must be \(2, F, 128\)"):
        adaln_mlp(*args, 0, next_modulation=(shift, shift[:, :, :64]), backend="xla")
    with pytest.raises(ValueError, match=r"next_modulation\[0\].dtype"):
        adaln_mlp(*args, 0, next_modulation=(shift.astype(jnp.bfloat16), shift), backend="xla")


@pytest.mark.parametrize("layer", [3, -1, np.int32(5), jnp.int32(3)], ids=str)
def test_a_layer_out_of_range_is_refused(layer):
    with pytest.raises(ValueError, match=r"layer=-?\d+ is out of range; allowed \[0, 3\)"):
        adaln_mlp(*_inputs(1, 1, 8, 128, 128, jnp.float32), layer, backend="pallas_tpu_interpret")


def test_a_non_integer_layer_is_refused():
    with pytest.raises(TypeError, match="layer must be an integer scalar"):
        adaln_mlp(*_inputs(1, 1, 8, 128, 128, jnp.float32), jnp.float32(0), backend="xla")
    with pytest.raises(TypeError, match="layer must be an integer scalar"):
        adaln_mlp(*_inputs(1, 1, 8, 128, 128, jnp.float32), True, backend="xla")
    with pytest.raises(ValueError, match=r"layer must be an int scalar, got shape \(2,\)"):
        adaln_mlp(*_inputs(1, 1, 8, 128, 128, jnp.float32), jnp.zeros(2, jnp.int32), backend="xla")


@pytest.mark.parametrize("eps, error", [(0.0, ValueError), (-1e-6, ValueError), (float("nan"), ValueError),
                                        ("1e-6", TypeError)], ids=str)
def test_a_bad_eps_is_refused(eps, error):
    with pytest.raises(error, match="eps"):
        adaln_mlp(*_inputs(1, 1, 8, 128, 128, jnp.float32), 0, eps=eps, backend="xla")


def test_an_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="backend must be one of"):
        adaln_mlp(*_inputs(1, 1, 8, 128, 128, jnp.float32), 0, backend="tpu")


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("in_block", [False, True], ids=["plain", "in-block"])
@pytest.mark.parametrize("gen", ["v5e", "v6e"])
def test_compiles_with_the_residual_in_place(gen, in_block):
    """At Wan-1.3B's MLP, weights stacked over 30 layers at a traced index (and, as the DiT calls
    it, the cross-attention's output projected in and the next block's input written): the
    donated residual is the output's buffer, no weight slice or activation is copied, no
    temporaries, the kernel named by its geometry, 520-row blocks; on the bundle estimate it is at
    or above its MXU floor and, on a v6e, above 90 % of the chip's peak."""
    g = dataclasses.replace(WAN_MLP, next_input=in_block, residual_input=in_block)
    bf16, f32 = jnp.bfloat16, jnp.float32
    per_frame = ((1, 3, g.dim), f32)
    specs = [((1, g.rows, g.dim), f32), *[per_frame] * 3, ((30, g.dim, g.hidden), bf16),
             ((30, g.hidden), bf16), ((30, g.hidden, g.dim), bf16), ((30, g.dim), bf16), ((), jnp.int32),
             *[((1, g.rows, g.dim), bf16), ((30, g.dim, g.dim), bf16), ((30, g.dim), bf16)] * in_block,
             *[per_frame] * (2 * in_block)]

    def call(*args):
        residual = tuple(args[9:12]) if in_block else None
        return adaln_mlp(*args[:9], residual_input=residual, next_modulation=tuple(args[12:]) or None,
                         backend="pallas_tpu")

    compiled = tpu_aot.compile_for_tpu(call, specs, gen, donate_argnums=(0,))
    residual_bytes = 4 * g.rows * g.dim
    report = tpu_aot.report(compiled, [(1, g.rows, g.dim), (g.rows, g.dim), (30, g.dim, g.hidden),
                                       (30, g.hidden, g.dim), (g.dim, g.hidden), (g.hidden, g.dim)])
    assert report.pool_copies == 0
    assert report.alias_bytes == residual_bytes
    assert report.temp_bytes < 1 << 20  # the biases' [L, 1, n] views at most
    assert kernel_name(g) in report.hlo
    from pallas_kernels.window_attention import tpu_estimate

    estimate = tpu_estimate.estimate(g, "bfloat16", gen)
    chip = tpu_aot.CHIPS[gen]
    assert estimate.grid_steps == g.rows // 520
    fraction = g.flops / chip.bf16_flops / estimate.seconds
    assert 0.9 < fraction <= 1.0 if gen == "v6e" else fraction <= 1.0, (gen, fraction, estimate.note)
