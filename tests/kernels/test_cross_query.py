"""The cross query (``pallas_kernels.cross_query``): the TPU kernel (interpreted) against XLA and a
float64 reference, the refusals, and the kernel compiled for v5e and v6e with libtpu (no TPU
needed)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import tpu_aot
from pallas_kernels.cross_query import QueryGeometry, cross_query, geometry_of_kernel, kernel_name
from pallas_kernels.cross_query import tpu as query_tpu

needs_libtpu = pytest.mark.skipif(not tpu_aot.libtpu_available(),
                                  reason="libtpu is not installed (pip install -e '.[tpu]')")

#: Wan-1.3B's step from self- to cross-attention over one row's chunk: 3 frames of 1,560 tokens.
WAN_QUERY = QueryGeometry(4680, 1536, 1560)

EPS = 1e-6


def _inputs(batch, frames, tokens_per_frame, dim, dtype, layers=3, x_dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)

    def draw(shape, scale, offset=0.0, as_dtype=dtype):
        return jnp.asarray(rng.standard_normal(shape) * scale + offset, as_dtype)

    tokens = (batch, frames * tokens_per_frame, dim)
    return (draw(tokens, 2, 0.5, x_dtype), draw(tokens, 1), draw((batch, frames, dim), 0.5, as_dtype=x_dtype),
            draw((layers, dim, dim), dim ** -0.5), draw((layers, dim), 0.1),
            draw((layers, dim), 0.2, 1.0, x_dtype), draw((layers, dim), 0.1, as_dtype=x_dtype),
            draw((layers, dim, dim), dim ** -0.5), draw((layers, dim), 0.1), draw((layers, dim), 0.2, 1.0))


def _exact(x, attention, gate, w_o, b_o, norm_scale, norm_bias, w_q, b_q, q_gain, layer):
    """float64: the residual ``x + gate * (attention @ w_o + b_o)`` and ``rms_norm(layer_norm(it)
    @ w_q + b_q)``."""
    x, attention, gate, w_o, b_o, norm_scale, norm_bias, w_q, b_q, q_gain = (
        np.asarray(a, np.float64) for a in (x, attention, gate, w_o, b_o, norm_scale, norm_bias, w_q, b_q, q_gain))
    gate = np.repeat(gate, x.shape[1] // gate.shape[1], axis=1)
    out = x + gate * (attention @ w_o[layer] + b_o[layer])
    normed = (out - out.mean(-1, keepdims=True)) / np.sqrt(out.var(-1, keepdims=True) + EPS)
    q = (normed * norm_scale[layer] + norm_bias[layer]) @ w_q[layer] + b_q[layer]
    return out, q / np.sqrt(np.mean(q * q, axis=-1, keepdims=True) + EPS) * q_gain[layer]


@pytest.mark.parametrize("shape", [(2, 3, 16, 128), (1, 2, 24, 64), (1, 3, 40, 96)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_the_kernel_matches_xla_interpreted(shape, dtype):
    """Each block reads its own frame's gate and layer 1 of three stacked layers (two rows of three
    frames; frames of 16, 24 and 40 tokens, one block each): float32 to rounding; bf16 within the
    roundings to bf16 that both paths make (the products, the normalized input, the queries)."""
    args = _inputs(*shape, dtype)
    xla = cross_query(*args, 1, eps=EPS, backend="xla")
    tpu = cross_query(*args, jnp.int32(1), eps=EPS, backend="pallas_tpu_interpret")
    exact = _exact(*args, 1)
    for got, want, name in zip(tpu, xla, ("output", "queries")):
        assert got.shape == args[0].shape and got.dtype == want.dtype, name
    assert tpu[0].dtype == jnp.float32 and tpu[1].dtype == dtype
    tolerance = 1e-4 if dtype == jnp.float32 else 4 * 2.0 ** -8
    gate = np.repeat(np.abs(np.asarray(args[2])), shape[2], axis=1)
    for got in (tpu, xla):
        np.testing.assert_allclose(got[0], exact[0], rtol=tolerance, atol=tolerance * (1 + 3 * gate.max()))
        np.testing.assert_allclose(np.asarray(got[1], np.float64), exact[1], rtol=tolerance, atol=4 * tolerance)
    np.testing.assert_allclose(tpu[0], xla[0], rtol=tolerance, atol=tolerance * (1 + 3 * gate.max()))


def test_a_bf16_residual_stream_stays_bf16():
    """Under a uniform bf16 policy (``x``, the gate and the norm's parameters in bf16) the output
    is bf16 and the kernel agrees with XLA to bf16 rounding."""
    args = _inputs(1, 2, 16, 128, jnp.bfloat16, x_dtype=jnp.bfloat16)
    xla = cross_query(*args, 2, backend="xla")
    tpu = cross_query(*args, 2, backend="pallas_tpu_interpret")
    assert tpu[0].dtype == xla[0].dtype == jnp.bfloat16
    for got, want in zip(tpu, xla):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=3e-2, atol=6e-2)


def test_the_layer_index_selects_the_weights():
    """A traced layer index under ``jit`` reads that layer's weights."""
    args = _inputs(1, 2, 16, 64, jnp.float32)
    run = jax.jit(lambda layer: cross_query(*args, layer, eps=EPS, backend="pallas_tpu_interpret"))
    outs = [run(jnp.int32(layer)) for layer in range(3)]
    for layer, out in enumerate(outs):
        for got, want in zip(out, _exact(*args, layer)):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert not np.allclose(outs[0][1], outs[1][1])


def test_blocks_lie_in_one_frame_and_fit_the_vmem_limit():
    assert query_tpu.block_rows(WAN_QUERY, 2, 4) == 520  # 1,560 = 3 x 520
    assert query_tpu.block_rows(QueryGeometry(48, 128, 16), 4, 4) == 16
    assert query_tpu.block_rows(QueryGeometry(21, 128, 7), 4, 4) is None  # no multiple of 8 divides 7
    assert query_tpu.block_rows(QueryGeometry(4680, 5120, 1560), 4, 4) is None  # the weights alone are over
    assert query_tpu.vmem_bytes(WAN_QUERY, 520, 2, 4) <= query_tpu.VMEM_LIMIT


def test_no_block_fits_runs_xla():
    """Frames of 7 tokens (no block of a multiple of 8 rows lies in one) run the XLA path on a
    TPU name: the same values, no Mosaic call."""
    args = _inputs(1, 3, 7, 64, jnp.float32)
    jaxpr = str(jax.make_jaxpr(lambda *a: cross_query(*a, 0, eps=EPS, backend="pallas_tpu_interpret"))(*args))
    assert "pallas_call" not in jaxpr
    for got, want in zip(cross_query(*args, 0, eps=EPS, backend="pallas_tpu_interpret"), _exact(*args, 0)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_the_kernel_name_spells_its_geometry():
    assert kernel_name(WAN_QUERY) == "cross_query_tpu_m4680_d1536_f1560"
    assert geometry_of_kernel(kernel_name(WAN_QUERY)) == WAN_QUERY
    with pytest.raises(ValueError, match="is not a cross-query kernel name"):
        geometry_of_kernel("adaln_mlp_tpu_m4680_d1536_h8960_f1560")


def _replace(args, index, value):
    return (*args[:index], value, *args[index + 1:])


@pytest.mark.parametrize("change, message", [
    (lambda a: _replace(a, 0, a[0][0]), r"x must have rank 3 \[B, N, dim\]"),
    (lambda a: _replace(a, 1, a[1][:, :-8]), r"attention.shape must be x's \(2, 48, 128\), got \(2, 40, 128\)"),
    (lambda a: _replace(a, 2, jnp.concatenate([a[2], a[2][:, :2]], axis=1)),
     r"gate.shape must be \(2, F, 128\) with F dividing N = 48, got \(2, 5, 128\)"),
    (lambda a: _replace(a, 2, a[2].astype(jnp.bfloat16)), r"gate.dtype"),
    (lambda a: _replace(a, 1, a[1].astype(jnp.float32)), r"attention.dtype"),
    (lambda a: _replace(a, 3, a[3][:, :-1]), r"w_o.shape must be \(3, 128, 128\)"),
    (lambda a: _replace(a, 4, a[4][:2]), r"b_o.shape must be \(3, 128\)"),
    (lambda a: _replace(a, 5, a[5].astype(jnp.bfloat16)), r"norm_scale.dtype"),
    (lambda a: _replace(a, 7, a[7][:, :, :-1]), r"w_q.shape must be \(3, 128, 128\)"),
    (lambda a: _replace(a, 9, a[9][None]), r"q_gain must have rank 2 \[L, dim\]"),
])
def test_bad_calls_name_the_argument(change, message):
    args = change(_inputs(2, 3, 16, 128, jnp.bfloat16))
    with pytest.raises(ValueError, match=message):
        cross_query(*args, 0, backend="xla")


@pytest.mark.parametrize("layer", [3, -1, np.int32(5), jnp.int32(3)], ids=str)
def test_a_layer_out_of_range_is_refused(layer):
    with pytest.raises(ValueError, match=r"layer=-?\d+ is out of range; allowed \[0, 3\)"):
        cross_query(*_inputs(1, 1, 8, 128, jnp.float32), layer, backend="pallas_tpu_interpret")


def test_a_bad_layer_eps_or_backend_is_refused():
    args = _inputs(1, 1, 8, 128, jnp.float32)
    with pytest.raises(TypeError, match="layer must be an integer scalar"):
        cross_query(*args, jnp.float32(0), backend="xla")
    with pytest.raises(ValueError, match="eps"):
        cross_query(*args, 0, eps=0.0, backend="xla")
    with pytest.raises(TypeError, match="eps"):
        cross_query(*args, 0, eps="1e-6", backend="xla")
    with pytest.raises(ValueError, match="backend must be one of"):
        cross_query(*args, 0, backend="tpu")


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("gen", ["v5e", "v6e"])
def test_compiles_with_the_residual_in_place(gen):
    """At Wan-1.3B's shape, weights stacked over 30 layers at a traced index, as the DiT calls it:
    the donated residual is the output's buffer, no weight slice or activation is copied, the
    kernel named by its geometry; on the bundle estimate it is at or above its MXU floor and, on
    a v6e, above 70 % of the chip's peak."""
    g, bf16, f32 = WAN_QUERY, jnp.bfloat16, jnp.float32
    matrix, vector = ((30, g.dim, g.dim), bf16), ((30, g.dim), bf16)
    specs = [((1, g.rows, g.dim), f32), ((1, g.rows, g.dim), bf16), ((1, 3, g.dim), f32), matrix, vector,
             ((30, g.dim), f32), ((30, g.dim), f32), matrix, vector, vector, ((), jnp.int32)]
    compiled = tpu_aot.compile_for_tpu(lambda *args: cross_query(*args, backend="pallas_tpu"), specs, gen,
                                       donate_argnums=(0,))
    report = tpu_aot.report(compiled, [(1, g.rows, g.dim), (g.rows, g.dim), (30, g.dim, g.dim), (g.dim, g.dim)])
    assert report.pool_copies == 0
    assert report.alias_bytes == 4 * g.rows * g.dim
    assert report.temp_bytes < 1 << 20  # the vectors' [L, 1, dim] views at most
    assert kernel_name(g) in report.hlo
    from pallas_kernels.window_attention import tpu_estimate

    estimate = tpu_estimate.estimate(g, "bfloat16", gen)
    fraction = g.flops / tpu_aot.CHIPS[gen].bf16_flops / estimate.seconds
    assert estimate.grid_steps == g.rows // 520
    assert 0.7 < fraction <= 1.0 if gen == "v6e" else fraction <= 1.0, (gen, fraction, estimate.note)
