"""The q/k/v projection (``pallas_kernels.qkv_projection``): the TPU kernel (interpreted) against
XLA and a float64 reference, the refusals, and the kernel compiled for v5e and v6e with libtpu (no
TPU needed)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import tpu_aot
from pallas_kernels.qkv_projection import ProjectionGeometry, geometry_of_kernel, kernel_name, qkv_projection
from pallas_kernels.qkv_projection import tpu as qkv_tpu

needs_libtpu = pytest.mark.skipif(not tpu_aot.libtpu_available(),
                                  reason="libtpu is not installed (pip install -e '.[tpu]')")

#: Wan-1.3B's self-attention projections over one row's chunk: 3 frames of 1,560 tokens, 12 heads of 128.
WAN_QKV = ProjectionGeometry(4680, 1536, 1536)

EPS = 1e-6


def _inputs(batch, tokens, dim, kv_dim, dtype, layers=3, seed=0):
    rng = np.random.default_rng(seed)

    def draw(shape, scale, offset=0.0):
        return jnp.asarray(rng.standard_normal(shape) * scale + offset, dtype)

    weights = []
    for width, gain in ((dim, True), (kv_dim, True), (kv_dim, False)):
        weights += [draw((layers, dim, width), dim ** -0.5), draw((layers, width), 0.1)]
        weights += [draw((layers, width), 0.2, 1.0)] * gain
    return (draw((batch, tokens, dim), 1.0), *weights)


def _exact(x, w_q, b_q, q_gain, w_k, b_k, k_gain, w_v, b_v, layer):
    """float64: ``(rms_norm(x @ w_q + b_q), rms_norm(x @ w_k + b_k), x @ w_v + b_v)``."""
    x, w_q, b_q, q_gain, w_k, b_k, k_gain, w_v, b_v = (
        np.asarray(a, np.float64) for a in (x, w_q, b_q, q_gain, w_k, b_k, k_gain, w_v, b_v))

    def rms_norm(y, gain):
        return y / np.sqrt(np.mean(y * y, axis=-1, keepdims=True) + EPS) * gain

    return (rms_norm(x @ w_q[layer] + b_q[layer], q_gain[layer]), rms_norm(x @ w_k[layer] + b_k[layer], k_gain[layer]),
            x @ w_v[layer] + b_v[layer])


@pytest.mark.parametrize("shape", [(2, 48, 128, 128), (1, 96, 64, 32), (1, 40, 96, 48)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_the_kernel_matches_xla_interpreted(shape, dtype):
    """Layer 1 of three stacked layers, queries as wide as the tokens and keys/values as wide or
    narrower (grouped heads): float32 to rounding; bf16 within the roundings to bf16 that both
    paths make (the products before their norms, the outputs)."""
    args = _inputs(*shape, dtype)
    xla = qkv_projection(*args, 1, eps=EPS, backend="xla")
    tpu = qkv_projection(*args, jnp.int32(1), eps=EPS, backend="pallas_tpu_interpret")
    batch, tokens, dim, kv_dim = shape
    assert [a.shape for a in tpu] == [(batch, tokens, dim), (batch, tokens, kv_dim), (batch, tokens, kv_dim)]
    assert all(a.dtype == dtype for a in (*tpu, *xla))
    tolerance = 1e-4 if dtype == jnp.float32 else 3 * 2.0 ** -8
    for got, want in zip((*tpu, *xla), _exact(*args, 1) * 2):
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tolerance, atol=4 * tolerance)
    for got, want in zip(tpu, xla):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2 * tolerance,
                                   atol=8 * tolerance)


def test_the_layer_index_selects_the_weights():
    """A traced layer index under ``jit`` reads that layer's weights."""
    args = _inputs(1, 32, 64, 64, jnp.float32)
    run = jax.jit(lambda layer: qkv_projection(*args, layer, eps=EPS, backend="pallas_tpu_interpret"))
    outs = [run(jnp.int32(layer)) for layer in range(3)]
    for layer, out in enumerate(outs):
        for got, want in zip(out, _exact(*args, layer)):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert not np.allclose(outs[0][2], outs[1][2])


def test_blocks_divide_the_rows_and_fit_the_vmem_limit():
    assert qkv_tpu.block_rows(WAN_QKV, 2) == 936  # 4,680 = 5 x 936
    assert qkv_tpu.block_rows(ProjectionGeometry(9360, 1536, 1536), 2) == 936
    assert qkv_tpu.block_rows(ProjectionGeometry(21, 128, 128), 4) is None  # no multiple of 8 divides 21
    assert qkv_tpu.block_rows(ProjectionGeometry(4680, 5120, 5120), 4) is None  # the weights alone are over
    assert qkv_tpu.vmem_bytes(WAN_QKV, 936, 2) <= qkv_tpu.VMEM_LIMIT


def test_no_block_fits_runs_xla():
    """21 tokens (no block of a multiple of 8 rows divides them) run the XLA path on a TPU name:
    the same values, no Mosaic call."""
    args = _inputs(1, 21, 64, 64, jnp.float32)
    jaxpr = str(jax.make_jaxpr(lambda *a: qkv_projection(*a, 0, eps=EPS, backend="pallas_tpu_interpret"))(*args))
    assert "pallas_call" not in jaxpr
    for got, want in zip(qkv_projection(*args, 0, eps=EPS, backend="pallas_tpu_interpret"), _exact(*args, 0)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_the_kernel_name_spells_its_geometry():
    assert kernel_name(WAN_QKV) == "qkv_projection_tpu_m4680_d1536_k1536"
    assert geometry_of_kernel(kernel_name(WAN_QKV)) == WAN_QKV
    with pytest.raises(ValueError, match="is not a q/k/v projection kernel name"):
        geometry_of_kernel("cross_query_tpu_m4680_d1536_f1560")


def _replace(args, index, value):
    return (*args[:index], value, *args[index + 1:])


@pytest.mark.parametrize("change, message", [
    (lambda a: _replace(a, 0, a[0][0]), r"x must have rank 3 \[B, N, dim\]"),
    (lambda a: _replace(a, 0, a[0].astype(jnp.float32)), r"w_q.dtype"),
    (lambda a: _replace(a, 1, a[1][:, :-1]), r"w_q.shape must be \(3, 128, 128\)"),
    (lambda a: _replace(a, 2, a[2][:2]), r"b_q.shape must be \(3, 128\)"),
    (lambda a: _replace(a, 3, a[3][None]), r"q_gain must have rank 2 \[L, n\]"),
    (lambda a: _replace(a, 6, a[6][:, :-1]), r"k_gain.shape must be \(3, 64\)"),
    (lambda a: _replace(a, 7, a[7][:, :, :-8]), r"w_v.shape must be \(3, 128, 64\)"),
    (lambda a: _replace(a, 8, a[8].astype(jnp.float32)), r"b_v.dtype"),
])
def test_bad_calls_name_the_argument(change, message):
    args = change(_inputs(2, 16, 128, 64, jnp.bfloat16))
    with pytest.raises(ValueError, match=message):
        qkv_projection(*args, 0, backend="xla")


@pytest.mark.parametrize("layer", [3, -1, np.int32(5), jnp.int32(3)], ids=str)
def test_a_layer_out_of_range_is_refused(layer):
    with pytest.raises(ValueError, match=r"layer=-?\d+ is out of range; allowed \[0, 3\)"):
        qkv_projection(*_inputs(1, 8, 128, 128, jnp.float32), layer, backend="pallas_tpu_interpret")


def test_a_bad_layer_eps_or_backend_is_refused():
    args = _inputs(1, 8, 128, 128, jnp.float32)
    with pytest.raises(TypeError, match="layer must be an integer scalar"):
        qkv_projection(*args, 0.5, backend="xla")
    with pytest.raises(ValueError, match="eps"):
        qkv_projection(*args, 0, eps=-1.0, backend="xla")
    with pytest.raises(TypeError, match="eps"):
        qkv_projection(*args, 0, eps=None, backend="xla")
    with pytest.raises(ValueError, match="backend must be one of"):
        qkv_projection(*args, 0, backend="tpu")


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("gen", ["v5e", "v6e"])
def test_compiles_reading_the_stacks_in_place(gen):
    """At Wan-1.3B's shape, weights stacked over 30 layers at a traced index, as the DiT calls it:
    no weight slice or activation is copied, the kernel named by its geometry; on the bundle
    estimate it is at or above its MXU floor and, on a v6e, above 80 % of the chip's peak."""
    g, bf16 = WAN_QKV, jnp.bfloat16
    specs = [((1, g.rows, g.dim), bf16)]
    for gain in (True, True, False):
        specs += [((30, g.dim, g.dim), bf16), ((30, g.dim), bf16)] + [((30, g.dim), bf16)] * gain
    compiled = tpu_aot.compile_for_tpu(lambda *args: qkv_projection(*args, backend="pallas_tpu"),
                                       specs + [((), jnp.int32)], gen)
    report = tpu_aot.report(compiled, [(1, g.rows, g.dim), (g.rows, g.dim), (30, g.dim, g.dim), (g.dim, g.dim)])
    assert report.pool_copies == 0
    assert report.temp_bytes < 1 << 20  # the vectors' [L, 1, dim] views at most
    assert kernel_name(g) in report.hlo
    from pallas_kernels.window_attention import tpu_estimate

    estimate = tpu_estimate.estimate(g, "bfloat16", gen)
    fraction = g.flops / tpu_aot.CHIPS[gen].bf16_flops / estimate.seconds
    assert estimate.grid_steps == g.rows // 936
    assert 0.8 < fraction <= 1.0 if gen == "v6e" else fraction <= 1.0, (gen, fraction, estimate.note)
