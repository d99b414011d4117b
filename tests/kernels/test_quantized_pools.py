"""Quantized pools (:class:`pallas_kernels.layout.QuantizedPool`, int8 and fp8 pages with float32
scales per (layer, KV head, page)) through both kernels' XLA path: the paged write against its
reference, attention against the reference on the dequantized values, isolation of pages a row must
not read, no retracing, and the other backends' refusal."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.backend import BACKENDS, QUANTIZED_POOL_KERNELS, resolve_backend
from pallas_kernels.layout import (
    QuantizedPool,
    dequantize_pool,
    empty_pool,
    page_mask,
    quantize_pages,
    slot_mask,
)
from pallas_kernels.paged_write import write_chunk, write_chunk_reference
from pallas_kernels.quantization import MAX_VALUES, QUANTIZED_DTYPES
from pallas_kernels.window_attention import (
    static_validate_inputs,
    window_attention,
    window_attention_reference,
)
from tests.kernels.test_window_attention import HEAD_DIM, KV_HEADS, LAYERS, NUM_PAGES, Window, make_case, poisoned
from tests.tiers import slow_except

BLOCK = 16
TPF = 24  # two pages per frame, the second one half padding


def quantized_case(kv_dtype, **kw):
    """``make_case`` with the pools quantized page by page (null page: zeros, scale 0)."""
    case, owned = make_case(**kw)
    return dict(case, k_pool=quantize_pages(case["k_pool"], kv_dtype),
                v_pool=quantize_pages(case["v_pool"], kv_dtype)), owned


def dequantized(case: dict) -> dict:
    """The same case in float32, the pools holding the dequantized values."""
    floats = {k: case[k].astype(jnp.float32) for k in ("q", "k_cur", "v_cur", "extra_k", "extra_v")
              if case[k] is not None}
    return dict(case, **floats, k_pool=dequantize_pool(case["k_pool"]), v_pool=dequantize_pool(case["v_pool"]))


# ------------------------------------------------------------------------------------------------
# The write
# ------------------------------------------------------------------------------------------------


def chunk(dtype=jnp.bfloat16, rows=2, frames=2, seed=0):
    rng = np.random.default_rng(seed)
    shape = (LAYERS, rows, frames * TPF, KV_HEADS, HEAD_DIM)
    return (jnp.asarray(rng.standard_normal(shape) * 3, dtype), jnp.asarray(rng.standard_normal(shape), dtype))


@pytest.mark.parametrize("kv_dtype", QUANTIZED_DTYPES)
def test_write_quantizes_each_page_from_the_chunk(kv_dtype):
    pools = [empty_pool(LAYERS, NUM_PAGES, BLOCK, KV_HEADS, HEAD_DIM, kv_dtype) for _ in range(2)]
    k_new, v_new = chunk()
    ids = jnp.asarray([[3, 4, 9, 10], [0, 0, 17, 5]], jnp.int32)  # row 1's first frame skipped
    out = write_chunk(*pools, k_new, v_new, ids, tokens_per_frame=TPF, backend="xla")
    ref = write_chunk_reference(*pools, k_new, v_new, ids, tokens_per_frame=TPF)
    for got, want in zip(out, ref):
        assert isinstance(got, QuantizedPool) and got.dtype == jnp.dtype(kv_dtype)
        np.testing.assert_array_equal(np.asarray(got.values, np.float32), np.asarray(want.values, np.float32))
        np.testing.assert_array_equal(got.scales, want.scales)
    k_pool = out[0]
    written = np.zeros(NUM_PAGES, bool)
    written[[3, 4, 9, 10, 17, 5]] = True
    # Unwritten pages (the null page included) keep scale 0 and zero values.
    assert np.all(np.asarray(k_pool.scales)[:, :, ~written] == 0)
    assert np.all(np.asarray(k_pool.values, np.float32)[:, :, ~written] == 0)
    # Each written page's scale is its own absmax over slots and features / the dtype's maximum.
    pages = np.asarray(k_new, np.float32).reshape(LAYERS, 2, 2, TPF, KV_HEADS, HEAD_DIM)
    first_page = pages[:, 0, 0, :BLOCK]  # row 0, frame 0, page 0 -> id 3: [L, S, H, D]
    np.testing.assert_allclose(k_pool.scales[:, :, 3], np.abs(first_page).max(axis=(1, 3)) / MAX_VALUES[kv_dtype],
                               rtol=1e-6)
    # The padding slots of a frame's last page stay zero; the dequantized page is close to the chunk.
    assert np.all(np.asarray(k_pool.values, np.float32)[:, :, 4, TPF - BLOCK:] == 0)
    back = np.asarray(dequantize_pool(k_pool))[:, :, 4, :TPF - BLOCK]  # [L, H, 8, D]
    want = pages[:, 0, 0, BLOCK:].transpose(0, 2, 1, 3)
    step = np.asarray(k_pool.scales)[:, :, 4, None, None]
    mantissa_bits = {"int8": None, "float8_e4m3fn": 3, "float8_e5m2": 2}[kv_dtype]
    tol = 0.5 * step if mantissa_bits is None else 2.0 ** -(mantissa_bits + 1) * np.abs(want) + step * 2.0 ** -9
    assert np.all(np.abs(back - want) <= tol * 1.001 + 1e-7)


def test_write_leaves_other_pages_bit_identical():
    k_pool, v_pool = (quantize_pages(jnp.asarray(np.random.default_rng(s).standard_normal(
        (LAYERS, KV_HEADS, NUM_PAGES, BLOCK, HEAD_DIM)), jnp.float32), "int8") for s in (1, 2))
    k_new, v_new = chunk(jnp.float32)
    ids = jnp.asarray([[2, 3, 4, 5], [6, 7, 8, 9]], jnp.int32)
    out_k, _ = write_chunk(k_pool, v_pool, k_new, v_new, ids, tokens_per_frame=TPF, backend="xla")
    keep = np.ones(NUM_PAGES, bool)
    keep[2:10] = False
    np.testing.assert_array_equal(np.asarray(out_k.values)[:, :, keep], np.asarray(k_pool.values)[:, :, keep])
    np.testing.assert_array_equal(np.asarray(out_k.scales)[:, :, keep], np.asarray(k_pool.scales)[:, :, keep])


def test_write_is_in_place_when_donated():
    pools = [empty_pool(LAYERS, NUM_PAGES, BLOCK, KV_HEADS, HEAD_DIM, "int8") for _ in range(2)]
    k_new, v_new = chunk()
    ids = jnp.asarray([[3, 4, 9, 10], [0, 0, 17, 5]], jnp.int32)
    step = jax.jit(lambda kp, vp, kn, vn, i: write_chunk(kp, vp, kn, vn, i, tokens_per_frame=TPF, backend="xla"),
                   donate_argnums=(0, 1))
    compiled = step.lower(*pools, k_new, v_new, ids).compile()
    pool_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(pools))
    memory = compiled.memory_analysis()
    if memory is None:
        pytest.skip("no memory analysis on this backend")
    assert memory.alias_size_in_bytes == pool_bytes  # values and scales of both pools aliased
    assert memory.temp_size_in_bytes < pool_bytes // 4


# ------------------------------------------------------------------------------------------------
# Attention
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", QUANTIZED_DTYPES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_attention_matches_the_reference_on_dequantized_values(kv_dtype, dtype):
    case, _ = quantized_case(kv_dtype, dtype=dtype, extra=3, window=Window(tokens_per_frame=TPF))
    out = window_attention(**case, backend="xla")
    want = window_attention_reference(**dequantized(case))
    assert out.dtype == dtype and out.shape == case["q"].shape
    tol = 1e-5 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), atol=tol, rtol=tol)
    # The reference reads quantized pools itself, dequantizing the same way.
    np.testing.assert_allclose(np.asarray(window_attention_reference(**case), np.float32), np.asarray(want),
                               atol=tol / 3, rtol=tol / 3)


def poisoned_quantized(case: dict, owned, kv_dtype, poison=poisoned) -> dict:
    """``case`` (float32 pools) quantized, with every page a row must not read poisoned in its scale
    (NaN) and every unreadable slot of a readable page holding the dtype's NaN (fp8 e4m3fn) or its
    largest value (int8 and e5m2: an int has no NaN), which would change the output if it were read.
    ``poison(case, owned)`` puts NaN wherever a row must not read (its test module's ``poisoned``)."""
    nan_case = poison(case, owned)  # NaN wherever a row must not read, at slot granularity
    hidden = jnp.isnan(nan_case["k_pool"])  # [L, H, P, S, D]
    page_hidden = jnp.all(hidden, axis=(3, 4))  # [L, H, P]: whole pages no row reads
    quantized = {}
    for name in ("k_pool", "v_pool"):
        pool = quantize_pages(case[name], kv_dtype)
        garbage = jnp.asarray(jnp.nan if kv_dtype == "float8_e4m3fn" else MAX_VALUES[kv_dtype], kv_dtype)
        values = jnp.where(hidden, garbage, pool.values)
        scales = jnp.where(page_hidden, jnp.nan, pool.scales)
        quantized[name] = QuantizedPool(values, scales)
    return dict(nan_case, **quantized)


CPU_QUANTIZED_BACKENDS = [name for name in QUANTIZED_POOL_KERNELS["window_attention"]
                          if BACKENDS[name].platform is None]
"""The backends that read quantized pools in attention and run on a CPU (the XLA path and the TPU
kernels' interpreters)."""


@pytest.mark.parametrize("backend,kv_dtype", slow_except(
    [(name, kv_dtype) for name in CPU_QUANTIZED_BACKENDS for kv_dtype in QUANTIZED_DTYPES],
    fast=[("xla", kv_dtype) for kv_dtype in QUANTIZED_DTYPES] + [("pallas_tpu_interpret", "float8_e4m3fn")]))
def test_pages_a_row_must_not_read_never_reach_the_output(backend, kv_dtype):
    """Sink and window frames, frames of 1.5 pages (a half-padding page each), ragged rows (no
    history, sink only, after eviction), GQA and extras, poison wherever a row must not read."""
    case, owned = make_case(committed=(0, 2, 6, 3), extra=2, window=Window(sink=1, recent=2, tokens_per_frame=TPF))
    bad = poisoned_quantized(case, owned, kv_dtype)
    # Poison is there: NaN scales on free, foreign and evicted pages; garbage in padding and past lengths.
    assert bool(jnp.any(jnp.isnan(bad["k_pool"].scales)))
    clean = dict(case, k_pool=quantize_pages(case["k_pool"], kv_dtype),
                 v_pool=quantize_pages(case["v_pool"], kv_dtype))
    out = window_attention(**bad, backend=backend)
    assert bool(jnp.all(jnp.isfinite(out))), "poison reached the output"
    np.testing.assert_allclose(out, window_attention_reference(**dict(clean, pages=bad["pages"])), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(window_attention_reference(**bad), window_attention_reference(**clean),
                               atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", slow_except([name for name in CPU_QUANTIZED_BACKENDS if name != "xla"],
                                                fast=("pallas_tpu_interpret",)))
def test_bf16_attention_over_quantized_pages_matches_the_xla_path(backend):
    """bf16 compute over int8 pages: every backend dequantizes to bf16 as the XLA path does (the
    current chunk and extras stay bf16)."""
    case, owned = quantized_case("int8", dtype=jnp.bfloat16, committed=(1, 5), extra=3,
                                 window=Window(tokens_per_frame=TPF))
    out = window_attention(**case, backend=backend)
    want = window_attention(**case, backend="xla")
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2)


def test_one_trace_while_window_fills_and_pages_are_rewritten(fresh_trace_counter):
    """Write, then attend, over a quantized pool: lengths, pages, page ids and the layer are values."""
    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, layer, k_new, v_new, ids):
        k_pool, v_pool = write_chunk(k_pool, v_pool, k_new, v_new, ids, tokens_per_frame=TPF, backend="xla")
        out = window_attention(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, layer=layer,
                               tokens_per_frame=TPF, backend="xla")
        return out, k_pool, v_pool

    window = Window(tokens_per_frame=TPF)
    k_pool = v_pool = None
    for frames in range(4):
        case, _ = quantized_case("int8", committed=(frames, max(frames - 2, 0)), window=window,
                                 layer=frames % LAYERS, seed=frames)
        k_pool = case["k_pool"] if k_pool is None else k_pool
        v_pool = case["v_pool"] if v_pool is None else v_pool
        k_new, v_new = chunk(jnp.float32, rows=2, frames=1, seed=frames)
        ids = jnp.asarray([[NUM_PAGES - 2 - 2 * frames, NUM_PAGES - 1 - 2 * frames], [0, 0]], jnp.int32)
        args = [case[k] for k in ("q", "k_cur", "v_cur")]
        out, k_pool, v_pool = step(*args, k_pool, v_pool, case["pages"], case["lengths"], jnp.int32(case["layer"]),
                                   k_new, v_new, ids)
        assert bool(jnp.all(jnp.isfinite(out)))


@pytest.mark.parametrize("kv_dtype", QUANTIZED_DTYPES)
def test_the_tpu_kernels_tile_dequantization_is_the_rule(kv_dtype):
    """Every stored byte through the TPU kernel's in-VMEM dequantization (float8_e4m3fn read as the
    TPU's native float8_e4m3b11fnuz) equals :func:`dequantize`, bit for bit after the cast to bf16
    and in float32, but for e4m3fn's NaN bytes (never stored: quantize clips), which read as
    +-480 x the scale, and -0, which reads as +0."""
    from pallas_kernels.quantization import dequantize
    from pallas_kernels.window_attention.tpu import dequantize_tile

    stored = jax.lax.bitcast_convert_type(jnp.arange(256, dtype=jnp.uint8), jnp.dtype(kv_dtype))
    scale = jnp.float32(0.0123)
    for dtype in (jnp.float32, jnp.bfloat16):
        got = np.asarray(dequantize_tile(stored, scale, dtype), np.float32)
        want = np.asarray(dequantize(stored, scale, (), dtype), np.float32)
        nan = np.isnan(want)
        assert nan.sum() == {"int8": 0, "float8_e4m3fn": 2, "float8_e5m2": 6}[kv_dtype]
        if kv_dtype == "float8_e4m3fn":
            np.testing.assert_array_equal(got[nan], (jnp.asarray([480.0, -480.0]) * scale).astype(dtype))
        else:
            assert np.all(np.isnan(got[nan]))
        np.testing.assert_array_equal(got[~nan], want[~nan])


# ------------------------------------------------------------------------------------------------
# Refusals and validation
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", [name for name in BACKENDS
                                     if name not in QUANTIZED_POOL_KERNELS["window_attention"]])
def test_other_backends_refuse_quantized_pools_in_attention(backend):
    case, _ = quantized_case("int8")
    with pytest.raises(ValueError, match=f"window_attention: backend '{backend}' does not read or write quantized "
                                         "pools.*only 'xla'.* read/write quantized pools so far"):
        window_attention(**case, backend=backend)


@pytest.mark.parametrize("backend", [name for name in BACKENDS if name not in QUANTIZED_POOL_KERNELS["write_chunk"]])
def test_other_backends_refuse_quantized_pools_in_the_write(backend):
    pools = [empty_pool(LAYERS, NUM_PAGES, BLOCK, KV_HEADS, HEAD_DIM, "int8") for _ in range(2)]
    k_new, v_new = chunk()
    with pytest.raises(ValueError, match=f"write_chunk: backend '{backend}' does not read or write quantized pools"):
        write_chunk(*pools, k_new, v_new, jnp.ones((2, 4), jnp.int32), tokens_per_frame=TPF, backend=backend)


@pytest.mark.parametrize("platform", ["tpu", "gpu", "cpu"])
def test_auto_is_never_downgraded_for_quantized_pools(platform, monkeypatch):
    """"auto" takes quantized pools where the platform's backend reads them (the TPU kernel on a
    TPU, "xla" on the CPU) and is not silently downgraded to the XLA path where it does not: it
    refuses, naming what it resolved to."""
    case, _ = quantized_case("float8_e4m3fn")
    monkeypatch.setattr(jax, "default_backend", lambda: platform)
    resolved = resolve_backend("auto", dtype=case["q"].dtype, head_dim=HEAD_DIM).name
    assert (resolved == "pallas_tpu") == (platform == "tpu")
    if resolved in QUANTIZED_POOL_KERNELS["window_attention"]:
        assert static_validate_inputs(**case).num_pages == NUM_PAGES
    else:
        with pytest.raises(ValueError, match=rf"window_attention: backend '{resolved}' \(what backend='auto' "
                                             r"resolves to here\)"):
            static_validate_inputs(**case)


def test_malformed_quantized_pools_are_refused():
    case, _ = quantized_case("int8")
    kp, vp = case["k_pool"], case["v_pool"]
    with pytest.raises(ValueError, match="both be arrays or both be QuantizedPools"):
        window_attention(**dict(case, v_pool=dequantize_pool(vp)), backend="xla")
    with pytest.raises(ValueError, match=r"k_pool.scales.shape must be \[num_layers, kv_heads, num_pages\]"):
        window_attention(**dict(case, k_pool=QuantizedPool(kp.values, kp.scales[:, :, :-1])), backend="xla")
    with pytest.raises(ValueError, match="k_pool.scales.dtype must be float32, got bfloat16"):
        window_attention(**dict(case, k_pool=QuantizedPool(kp.values, kp.scales.astype(jnp.bfloat16))), backend="xla")
    with pytest.raises(ValueError, match=r"k_pool.values.dtype must be one of \['int8', 'float8_e4m3fn'"):
        window_attention(**dict(case, k_pool=QuantizedPool(kp.values.astype(jnp.float32), kp.scales)), backend="xla")
    with pytest.raises(ValueError, match="k_pool and v_pool must have the same dtype"):
        window_attention(**dict(case, v_pool=quantize_pages(dequantize_pool(vp), "float8_e5m2")), backend="xla")
    k_new, v_new = chunk(jnp.float32)
    written_from = r"k_new dtype \(the compute dtype a quantized pool is written from\) must be one of"
    with pytest.raises(ValueError, match=written_from):
        write_chunk(kp, vp, k_new.astype(jnp.int8), v_new, jnp.ones((2, 4), jnp.int32), tokens_per_frame=TPF,
                    backend="xla")


def test_quantized_pool_masks_are_the_layout_helpers():
    """The layout's page mask reaches the scales' rank (used by the reference write)."""
    mask = page_mask(jnp.arange(NUM_PAGES) == 3, 3)
    assert mask.shape == (1, 1, NUM_PAGES)
    assert slot_mask(jnp.zeros((LAYERS, NUM_PAGES, BLOCK), bool)).shape == (LAYERS, 1, NUM_PAGES, BLOCK, 1)
