"""Quantized pools (:class:`pallas_kernels.layout.QuantizedPool`, int8 and fp8 pages with float32
scales per (layer, KV head, page)) through every backend (here the XLA path, the TPU and Triton
kernels interpreted and the cuDNN gather path through XLA's attention and the scatter write;
compiled on their device; the Mosaic GPU kernel, which needs kernel-sized tiles, in
``tests/kernels/test_window_attention_gpu.py``): the paged write against its reference, attention
against the reference on the dequantized values, isolation of pages a row must not read, no
retracing, and ``"auto"`` keeping the platform's kernel."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.backend import BACKENDS, cudnn_supports, resolve_backend
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
from tests.kernels.device_backends import compiled
from tests.kernels.test_window_attention import (
    HEAD_DIM,
    KV_HEADS,
    LAYERS,
    NUM_PAGES,
    TOLERANCE,
    Window,
    make_case,
    poisoned,
)
from tests.tiers import slow_except

BLOCK = 16
TPF = 24  # two pages per frame, the second one half padding


SMALL_CASE_BACKENDS = tuple(name for name in BACKENDS if name != "pallas_mgpu")
"""The backends that take this module's small cases (16-token pages, small heads): all but the
Mosaic GPU kernel, whose tiles need pages and heads that are multiples of 64."""


def quantized_backends(kernel: str) -> list:
    """The backends that run ``kernel`` (``"write_chunk"``: every one; ``"window_attention"``:
    :data:`SMALL_CASE_BACKENDS`) on this module's cases, as test parameters: the compiled ones
    skipped off their device (:func:`tests.kernels.device_backends.compiled`)."""
    names = BACKENDS if kernel == "write_chunk" else SMALL_CASE_BACKENDS
    return [compiled(name) if BACKENDS[name].platform else name for name in names]


def attention_dtype(backend: str, dtype=jnp.float32):
    """``dtype``, or bf16 where the compiled cuDNN path does not take it."""
    return dtype if backend != "cudnn_gather" or cudnn_supports(dtype, HEAD_DIM) else jnp.bfloat16


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


@pytest.mark.parametrize("backend", quantized_backends("write_chunk"))
@pytest.mark.parametrize("kv_dtype", QUANTIZED_DTYPES)
def test_write_quantizes_each_page_from_the_chunk(kv_dtype, backend):
    pools = [empty_pool(LAYERS, NUM_PAGES, BLOCK, KV_HEADS, HEAD_DIM, kv_dtype) for _ in range(2)]
    k_new, v_new = chunk()
    ids = jnp.asarray([[3, 4, 9, 10], [0, 0, 17, 5]], jnp.int32)  # row 1's first frame skipped
    out = write_chunk(*pools, k_new, v_new, ids, tokens_per_frame=TPF, backend=backend)
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


@pytest.mark.parametrize("backend", quantized_backends("write_chunk"))
def test_write_leaves_other_pages_bit_identical(backend):
    k_pool, v_pool = (quantize_pages(jnp.asarray(np.random.default_rng(s).standard_normal(
        (LAYERS, KV_HEADS, NUM_PAGES, BLOCK, HEAD_DIM)), jnp.float32), "int8") for s in (1, 2))
    k_new, v_new = chunk(jnp.float32)
    ids = jnp.asarray([[2, 3, 4, 5], [6, 7, 8, 9]], jnp.int32)
    out = write_chunk(k_pool, v_pool, k_new, v_new, ids, tokens_per_frame=TPF, backend=backend)
    keep = np.ones(NUM_PAGES, bool)
    keep[2:10] = False
    for got, before in zip(out, (k_pool, v_pool)):
        np.testing.assert_array_equal(np.asarray(got.values)[:, :, keep], np.asarray(before.values)[:, :, keep])
        np.testing.assert_array_equal(np.asarray(got.scales)[:, :, keep], np.asarray(before.scales)[:, :, keep])
        assert not np.array_equal(np.asarray(got.scales)[:, :, 2:10], np.asarray(before.scales)[:, :, 2:10])


@pytest.mark.parametrize("backend", quantized_backends("write_chunk"))
def test_write_is_in_place_when_donated(backend):
    """Values and scales of both donated pools aliased. The temporaries stay under a quarter of the
    pools for the XLA loop and the compiled kernels; Pallas' interpreter and the scatter on XLA:CPU
    carry a pool-sized copy that the compiled GPU code does not (``tests/kernels/test_paged_write.py``)."""
    pools = [empty_pool(LAYERS, NUM_PAGES, BLOCK, KV_HEADS, HEAD_DIM, "int8") for _ in range(2)]
    k_new, v_new = chunk()
    ids = jnp.asarray([[3, 4, 9, 10], [0, 0, 17, 5]], jnp.int32)
    step = jax.jit(lambda kp, vp, kn, vn, i: write_chunk(kp, vp, kn, vn, i, tokens_per_frame=TPF, backend=backend),
                   donate_argnums=(0, 1))
    memory = step.lower(*pools, k_new, v_new, ids).compile().memory_analysis()
    pool_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(pools))
    if memory is None:
        pytest.skip("no memory analysis on this backend")
    assert memory.alias_size_in_bytes == pool_bytes  # values and scales of both pools aliased
    if backend == "xla" or BACKENDS[backend].platform is not None:
        assert memory.temp_size_in_bytes < pool_bytes // 4


# ------------------------------------------------------------------------------------------------
# Attention
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", quantized_backends("window_attention"))
@pytest.mark.parametrize("kv_dtype", QUANTIZED_DTYPES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_attention_matches_the_reference_on_dequantized_values(kv_dtype, dtype, backend):
    if attention_dtype(backend, dtype) != dtype:
        pytest.skip(f"{backend} does not take {jnp.dtype(dtype).name}")
    case, _ = quantized_case(kv_dtype, dtype=dtype, extra=3, window=Window(tokens_per_frame=TPF))
    out = window_attention(**case, backend=backend)
    want = window_attention_reference(**dequantized(case))
    assert out.dtype == dtype and out.shape == case["q"].shape
    tol = 1e-5 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), atol=tol, rtol=tol)
    # The reference reads quantized pools itself, dequantizing the same way.
    np.testing.assert_allclose(np.asarray(window_attention_reference(**case), np.float32), np.asarray(want),
                               atol=tol / 3, rtol=tol / 3)


def poisoned_quantized(case: dict, owned, kv_dtype, poison=poisoned) -> dict:
    """``case`` (float pools) quantized, with every page a row must not read poisoned
    (:func:`quantize_poisoned` of ``poison(case, owned)``, which puts NaN wherever a row must not
    read: its test module's ``poisoned``)."""
    return quantize_poisoned(case, poison(case, owned), kv_dtype)


def quantize_poisoned(clean: dict, nan_case: dict, kv_dtype) -> dict:
    """``nan_case`` (``clean`` with NaN in every pool slot a row must not read, and its stale page
    lists) with the pools quantized from ``clean``'s: every page no row reads is poisoned in its
    scale (NaN) and every unreadable slot of a readable page holds the dtype's NaN (fp8 e4m3fn) or
    its largest value (int8 and e5m2: an int has no NaN), which would change the output if it were
    read."""
    hidden = jnp.isnan(nan_case["k_pool"])  # [L, H, P, S, D]
    page_hidden = jnp.all(hidden, axis=(3, 4))  # [L, H, P]: whole pages no row reads
    quantized = {}
    for name in ("k_pool", "v_pool"):
        pool = quantize_pages(clean[name], kv_dtype)
        garbage = jnp.asarray(jnp.nan if kv_dtype == "float8_e4m3fn" else MAX_VALUES[kv_dtype], kv_dtype)
        values = jnp.where(hidden, garbage, pool.values)
        scales = jnp.where(page_hidden, jnp.nan, pool.scales)
        quantized[name] = QuantizedPool(values, scales)
    return dict(nan_case, **quantized)


@pytest.mark.parametrize("backend,kv_dtype", slow_except(
    [compiled(name, kv_dtype) if BACKENDS[name].platform else (name, kv_dtype)
     for name in SMALL_CASE_BACKENDS for kv_dtype in QUANTIZED_DTYPES],
    fast=[("xla", kv_dtype) for kv_dtype in QUANTIZED_DTYPES]
    + [("pallas_tpu_interpret", "float8_e4m3fn"), ("pallas_gpu_interpret", "int8")]))
def test_pages_a_row_must_not_read_never_reach_the_output(backend, kv_dtype):
    """Sink and window frames, frames of 1.5 pages (a half-padding page each), ragged rows (no
    history, sink only, after eviction), GQA and extras, poison wherever a row must not read."""
    dtype = attention_dtype(backend)
    case, owned = make_case(committed=(0, 2, 6, 3), extra=2, window=Window(sink=1, recent=2, tokens_per_frame=TPF),
                            dtype=dtype)
    bad = poisoned_quantized(case, owned, kv_dtype)
    # Poison is there: NaN scales on free, foreign and evicted pages; garbage in padding and past lengths.
    assert bool(jnp.any(jnp.isnan(bad["k_pool"].scales)))
    clean = dict(case, k_pool=quantize_pages(case["k_pool"], kv_dtype),
                 v_pool=quantize_pages(case["v_pool"], kv_dtype))
    out = window_attention(**bad, backend=backend)
    assert bool(jnp.all(jnp.isfinite(out))), "poison reached the output"
    tol = TOLERANCE[jnp.dtype(dtype).type]
    np.testing.assert_allclose(np.asarray(out, np.float32),
                               np.asarray(window_attention_reference(**dict(clean, pages=bad["pages"])), np.float32),
                               atol=tol, rtol=tol)
    np.testing.assert_allclose(window_attention_reference(**bad), window_attention_reference(**clean),
                               atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", slow_except(
    [compiled(name) if BACKENDS[name].platform else name for name in SMALL_CASE_BACKENDS],
    fast=("xla", "pallas_tpu_interpret", "pallas_gpu_interpret")))
def test_one_trace_while_window_fills_and_pages_are_rewritten(backend, fresh_trace_counter):
    """Write, then attend, over a quantized pool, on every backend that runs a whole quantized
    cache: lengths, pages, page ids and the layer are values."""
    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, layer, k_new, v_new, ids):
        k_pool, v_pool = write_chunk(k_pool, v_pool, k_new, v_new, ids, tokens_per_frame=TPF, backend=backend)
        out = window_attention(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, layer=layer,
                               tokens_per_frame=TPF, backend=backend)
        return out, k_pool, v_pool

    window = Window(tokens_per_frame=TPF)
    dtype = attention_dtype(backend)
    k_pool = v_pool = None
    for frames in range(4):
        case, _ = quantized_case("int8", committed=(frames, max(frames - 2, 0)), window=window,
                                 layer=frames % LAYERS, seed=frames, dtype=dtype)
        k_pool = case["k_pool"] if k_pool is None else k_pool
        v_pool = case["v_pool"] if v_pool is None else v_pool
        k_new, v_new = chunk(dtype, rows=2, frames=1, seed=frames)
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
# "auto" and validation
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("platform", ["tpu", "gpu", "cpu"])
def test_auto_keeps_the_platform_kernel_for_quantized_pools(platform, monkeypatch):
    """Quantized pools do not change what "auto" resolves to: the platform's kernel (the TPU kernel;
    on a GPU the Triton kernel for this f32 case, and cuDNN gather for bf16; on the CPU "xla"),
    which takes them."""
    case, _ = quantized_case("float8_e4m3fn")
    monkeypatch.setattr(jax, "default_backend", lambda: platform)
    resolved = resolve_backend("auto", dtype=case["q"].dtype, head_dim=HEAD_DIM).name
    assert resolved == {"tpu": "pallas_tpu", "gpu": "pallas_gpu", "cpu": "xla"}[platform]
    assert static_validate_inputs(**case).num_pages == NUM_PAGES
    if platform == "gpu":
        bf16, _ = quantized_case("int8", dtype=jnp.bfloat16)
        assert resolve_backend("auto", dtype=jnp.bfloat16, head_dim=HEAD_DIM).name == "cudnn_gather"
        assert static_validate_inputs(**bf16).num_pages == NUM_PAGES


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


# ------------------------------------------------------------------------------------------------
# The TPU kernel's write of quantized pools, against the XLA path
# ------------------------------------------------------------------------------------------------

TPU_WRITES = ("pallas_tpu_interpret", "pallas_tpu_simulate", "pallas_tpu_gather_interpret", compiled("pallas_tpu"))


def random_quantized_pool(kv_dtype, seed):
    """A quantized pool of random pages (page 0 zeros, scale 0), so untouched pages are checked."""
    pages = np.random.default_rng(seed).standard_normal((LAYERS, KV_HEADS, NUM_PAGES, BLOCK, HEAD_DIM))
    pages[:, :, 0] = 0.0
    return quantize_pages(jnp.asarray(pages, jnp.float32), kv_dtype)


def assert_same_pool(got: QuantizedPool, want: QuantizedPool):
    """Values and scales bit for bit (values compared as their uint8 bits)."""
    assert isinstance(got, QuantizedPool) and got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got.values).view(np.uint8), np.asarray(want.values).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(got.scales).view(np.uint32), np.asarray(want.scales).view(np.uint32))


@pytest.mark.parametrize("kv_dtype", QUANTIZED_DTYPES)
@pytest.mark.parametrize("backend", TPU_WRITES)
def test_tpu_write_matches_the_xla_path_bit_for_bit(backend, kv_dtype):
    """Two 24-token frames per row in 16-slot pages (each frame's second page half padding), a bf16
    chunk, skipped ids (row 1's first frame, and unchecked out-of-range ids under jit), random pages
    elsewhere: values and scales equal the XLA path's bit for bit."""
    pools = [random_quantized_pool(kv_dtype, seed) for seed in (3, 4)]
    k_new, v_new = chunk(seed=5)
    ids = jnp.asarray([[3, 4, 9, 10], [0, 0, 17, NUM_PAGES + 2]], jnp.int32)
    step = jax.jit(functools.partial(write_chunk, tokens_per_frame=TPF, validate=False), static_argnames="backend")
    out = step(*pools, k_new, v_new, ids, backend=backend)
    want = step(*pools, k_new, v_new, ids, backend="xla")
    for got, expected, before in zip(out, want, pools):
        assert_same_pool(got, expected)
        assert not np.array_equal(np.asarray(got.scales), np.asarray(before.scales))  # pages were written


def kernel_case(kv_dtype, num_pages: int, heads: int, chunk_dtype, seed: int):
    """Random quantized pools ``[2, heads, num_pages, 16, 128]`` (page 0 zeros), a chunk of two
    24-token frames (each frame's second page 8 tokens and 8 padding slots) and ids in
    ``[1, P)`` (one skipped, two sharing a 128-page scale window, one in the last window)."""
    rng = np.random.default_rng(seed)

    def pool():
        pages = rng.standard_normal((2, heads, num_pages, BLOCK, 128))
        pages[:, :, 0] = 0.0
        return quantize_pages(jnp.asarray(pages, jnp.float32), kv_dtype)

    frames = [jnp.asarray(rng.standard_normal((2, 2, TPF, heads, 128)) * 3, chunk_dtype) for _ in range(2)]
    ids = jnp.asarray([num_pages - 1, 0, 5, 7], jnp.int32)
    return pool(), pool(), *frames, ids


@pytest.mark.parametrize("kv_dtype", QUANTIZED_DTYPES)
@pytest.mark.parametrize("view, order, num_pages, heads, chunk_dtype", [
    ("head", (1, 0, 2), 300, 4, jnp.bfloat16),  # [H, L, P]: XLA:TPU's layout at 12 heads
    ("token", (0, 1, 2), 300, 8, jnp.bfloat16),  # 128-page windows, the last one 44 pages
    ("token", (1, 2, 0), 40, 8, jnp.float32),  # [H, P, L]: few pages, moved whole
    ("head", (2, 0, 1), 40, 2, jnp.float32),
], ids=lambda v: jnp.dtype(v).name if isinstance(v, type) else str(v))
def test_tpu_quantizing_kernel_matches_the_xla_path(view, order, num_pages, heads, chunk_dtype, kv_dtype):
    """The kernel's two views of the chunk and its scale windows in several HBM orders, under Pallas'
    interpreter: values and scales bit for bit the XLA path's (padding slots zeros that leave the
    scale alone, the skipped id untouched)."""
    from pallas_kernels.paged_write import tpu_quantized
    from pallas_kernels.paged_write import xla as xla_write

    k_pool, v_pool, k_frames, v_frames, ids = kernel_case(kv_dtype, num_pages, heads, chunk_dtype, seed=7)
    out = jax.jit(functools.partial(tpu_quantized.write_chunk, ppf=2, interpret=True, view=view, order=order))(
        k_pool, v_pool, k_frames, v_frames, ids)
    want = jax.jit(functools.partial(xla_write.write_chunk, ppf=2))(k_pool, v_pool, k_frames, v_frames, ids)
    for got, expected, before in zip(out, want, (k_pool, v_pool)):
        assert_same_pool(got, expected)
        assert not np.array_equal(np.asarray(got.scales[:, :, 5]), np.asarray(before.scales[:, :, 5]))
        np.testing.assert_array_equal(np.asarray(got.values[:, :, 1:5]).view(np.uint8),
                                      np.asarray(before.values[:, :, 1:5]).view(np.uint8))


def test_tpu_quantizing_kernel_refuses_what_it_cannot_take():
    """An order that puts a page axis of more than 128 pages second-minor, an order that is no
    permutation, and the token view at 2 heads, each a ValueError naming the parameter."""
    from pallas_kernels.paged_write import tpu_quantized

    k_pool, v_pool, k_frames, v_frames, ids = kernel_case("int8", 300, 2, jnp.bfloat16, seed=0)
    write = functools.partial(tpu_quantized.write_chunk, k_pool, v_pool, k_frames, v_frames, ids, 2, True)
    with pytest.raises(ValueError, match="order must be"):
        write(order=(2, 0, 1))
    with pytest.raises(ValueError, match="order must be"):
        write(order=(0, 0, 2))
    with pytest.raises(ValueError, match="token view needs kv_heads"):
        write(view="token")


@pytest.mark.slow
def test_tpu_quantizing_kernel_under_the_simulator():
    """The token view with 128-page scale windows under the TPU simulator: DMAs and semaphores
    emulated, no race found, bit for bit the XLA path."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as mosaic_interpret

    from pallas_kernels.backend import resolve_backend
    from pallas_kernels.paged_write import tpu_quantized
    from pallas_kernels.paged_write import xla as xla_write

    k_pool, v_pool, k_frames, v_frames, ids = kernel_case("float8_e4m3fn", 300, 8, jnp.bfloat16, seed=1)
    interpret = resolve_backend("pallas_tpu_simulate").interpret
    out = jax.jit(functools.partial(tpu_quantized.write_chunk, ppf=2, interpret=interpret, view="token"))(
        k_pool, v_pool, k_frames, v_frames, ids)
    want = jax.jit(functools.partial(xla_write.write_chunk, ppf=2))(k_pool, v_pool, k_frames, v_frames, ids)
    for got, expected in zip(out, want):
        assert_same_pool(got, expected)
    assert not mosaic_interpret.races.races_found
