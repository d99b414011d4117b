"""Window attention: what only the GPU backends have (CPU, compiled on an NVIDIA GPU where present).

* The ``"auto"`` table of :mod:`pallas_kernels.backend` on GPU.
* The cuDNN gather path's history gather (contiguous, frame padding skipped, zeros past a length),
  and kernel-sized cases (pages of 64+ tokens, head dim 64, NaN wherever a row must not look)
  through ``cudnn_gather_xla`` here and ``cudnn_gather`` / ``pallas_mgpu`` compiled on a GPU.
* The Mosaic GPU kernel run under jax's GPU interpret mode (jax >= 0.12; shared memory, barriers,
  TMA and warpgroups simulated, races detected) on bf16/f16 and quantized pools, lowered for
  ``cuda`` under an abstract H200 (Pallas' Mosaic GPU lowering and MLIR verification), and its
  tiling rules.
* Quantized pools (int8, fp8 e4m3fn and e5m2 pages with per-page scales) on kernel-sized cases
  with poison wherever a row must not look, through the GPU backends that read them.
* The scatter paged write lowered for ``cuda``: one aliased scatter per pool (per values and
  scales of a quantized pool), no loop; the Triton write's quantized pools aliased.
* The sm_90 compile check of the Triton kernels (registers, shared memory, spills) for bf16 and
  quantized pools, where the ``triton`` wheel is installed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.gpu_compile import (
    POOL_DTYPES,
    attention_at_tiling,
    compile_lowered,
    lower_for_cuda,
    triton_wheel_bin,
    wan_attention_specs,
    wan_write_specs,
)
from pallas_kernels.backend import resolve_backend
from pallas_kernels.layout import from_token_major, layer_token_major, quantize_pages
from pallas_kernels.paged_write import write_chunk
from pallas_kernels.quantization import QUANTIZED_DTYPES
from pallas_kernels.window_attention import (
    mosaic_gpu,
    static_validate_inputs,
    window_attention,
    window_attention_reference,
)
from pallas_kernels.window_attention.validation import check_mosaic_tiling
from pallas_kernels.window_attention.xla import gather_history
from tests.kernels import mgpu_interpret
from tests.kernels.device_backends import (
    COMPILED_BACKENDS,
    CUDNN_GATHER,
    IGNORE_TRITON_DEPRECATION,
    MOSAIC_GPU,
    compiled,
    skip_unless_here,
)
from tests.kernels.test_quantized_pools import quantize_poisoned
from tests.kernels.test_window_attention import (
    HEAD_DIM,
    KV_HEADS,
    TOLERANCE,
    Window,
    check,
    make_case,
    poisoned,
)

ARGS = ("q", "k_cur", "v_cur", "k_pool", "v_pool", "pages", "lengths")


# ------------------------------------------------------------------------------------------------
# "auto" on GPU
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,head_dim,expected", [
    (jnp.bfloat16, 128, "cudnn_gather"), (jnp.float16, 64, "cudnn_gather"),
    (jnp.bfloat16, 256, "cudnn_gather"), (jnp.bfloat16, 96, "cudnn_gather"),
    (jnp.bfloat16, 512, "pallas_gpu"), (jnp.float32, 128, "pallas_gpu"),
    (jnp.bfloat16, 12, "xla"), (jnp.float32, 96, "xla"), (jnp.float32, 8, "xla"),
])
def test_auto_table_on_gpu(dtype, head_dim, expected):
    for platform in ("gpu", "cuda"):
        resolved = resolve_backend("auto", platform, dtype=dtype, head_dim=head_dim)
        assert resolved.name == expected and resolved.interpret is False


def test_auto_elsewhere_and_for_the_write():
    assert resolve_backend("auto", "tpu", dtype=jnp.bfloat16, head_dim=128).name == "pallas_tpu"
    assert resolve_backend("auto", "cpu", dtype=jnp.bfloat16, head_dim=128).name == "xla"
    # Without a dtype (the paged write) "auto" on GPU names the scatter write's backend.
    assert resolve_backend("auto", "gpu").kind == "cudnn_gather"
    assert resolve_backend("cudnn_gather_xla").kind == "cudnn_gather"
    assert resolve_backend("pallas_mgpu").kind == "pallas_mgpu"


# ------------------------------------------------------------------------------------------------
# The cuDNN gather path
# ------------------------------------------------------------------------------------------------


def test_gathered_history_is_contiguous_and_zero_past_length():
    """Token t of each row at position t, frame padding skipped, zeros (not NaN) past the length."""
    case, owned = make_case(committed=(2, 5), window=Window(tokens_per_frame=24), lengths=[30, 71])
    bad = poisoned(case, owned)
    geom = static_validate_inputs(**bad, backend="cudnn_gather_xla")
    hist = gather_history(bad["k_pool"], bad["pages"], bad["lengths"], jnp.int32(case["layer"]),
                          geom)
    assert hist.shape == (2, geom.capacity, KV_HEADS, HEAD_DIM)
    pages = np.asarray(case["pages"])
    pool = np.asarray(layer_token_major(case["k_pool"], case["layer"]))  # [pages, slots, H, D]
    for row, length in enumerate([30, 71]):
        for t in (0, 23, 24, length - 1):
            frame, offset = divmod(t, 24)
            slot = frame * 32 + offset  # 24-token frames on 16-slot pages: 2 pages = 32 slots.
            np.testing.assert_array_equal(hist[row, t], pool[pages[row, slot // 16], slot % 16])
        assert not np.any(np.asarray(hist[row, length:]))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["xla", "cudnn_gather_xla", "pallas_gpu_interpret",
                                     *COMPILED_BACKENDS, CUDNN_GATHER])
def test_bf16_ragged_lengths_with_frame_padding(backend):
    """Lengths that end mid-frame and mid-page, 24-token frames on 16-slot pages, bf16, poison."""
    case, owned = make_case(committed=(2, 5), window=Window(tokens_per_frame=24), lengths=[30, 71],
                            dtype=jnp.bfloat16)
    check(poisoned(case, owned), backend, expected=case)


# ------------------------------------------------------------------------------------------------
# Kernel-sized cases (what the Mosaic GPU kernel's tiles need)
# ------------------------------------------------------------------------------------------------


def make_wide_case(*, committed=(0, 2, 5), tokens_per_frame=200, block_size=128, sink=1, recent=2,
                   num_q_heads=4, kv_heads=2, head_dim=64, extra=0, dtype=jnp.bfloat16, layer=1,
                   lengths=None, layers=2, seed=0):
    """A case on kernel-sized tiles (``block_size`` a multiple of 64, ``head_dim`` 64).

    Rows own disjoint, scattered pages; every pool slot no row may read is NaN (the other layer,
    free and foreign pages, frame padding, slots past each row's length), and page-list entries
    past a row's visible pages name NaN pages. Returns ``(inputs, expected_inputs)``.
    """
    rng = np.random.default_rng(seed)
    ppf = -(-tokens_per_frame // block_size)
    max_pages = (sink + recent) * ppf
    rows = len(committed)
    num_pages = 1 + sum(committed) * ppf + rows * max_pages
    free = list(rng.permutation(np.arange(1, num_pages)))
    tables = np.zeros((rows, max_pages), np.int32)
    stale = np.zeros((rows, max_pages), np.int32)
    for row, frames in enumerate(committed):
        frame_pages = [[free.pop() for _ in range(ppf)] for _ in range(frames)]
        visible = list(range(min(frames, sink))) + list(range(max(sink, frames - recent), frames))
        flat = [p for f in visible for p in frame_pages[f]]
        tables[row, :len(flat)] = flat
        stale[row] = tables[row]
        stale[row, len(flat):] = [free.pop() for _ in range(max_pages - len(flat))]
    if lengths is None:
        lengths = [(min(n, sink) + max(0, min(n - sink, recent))) * tokens_per_frame
                   for n in committed]

    def normal(*shape):
        return rng.normal(size=shape).astype(np.float32)

    pool_shape = (layers, num_pages, block_size, kv_heads, head_dim)  # token-major, laid out below
    k_pool, v_pool = normal(*pool_shape), normal(*pool_shape)
    k_pool[:, 0] = v_pool[:, 0] = 0
    readable = np.zeros((layers, num_pages, block_size), bool)
    readable[:, 0] = True
    for row in range(rows):
        for t in range(lengths[row]):
            slot = (t // tokens_per_frame) * ppf * block_size + t % tokens_per_frame
            readable[layer, tables[row, slot // block_size], slot % block_size] = True
    mask = readable[..., None, None]
    cur_len = tokens_per_frame
    case = dict(
        q=jnp.asarray(normal(rows, cur_len + extra, num_q_heads, head_dim), dtype),
        k_cur=jnp.asarray(normal(rows, cur_len, kv_heads, head_dim), dtype),
        v_cur=jnp.asarray(normal(rows, cur_len, kv_heads, head_dim), dtype),
        k_pool=from_token_major(jnp.asarray(k_pool, dtype)),
        v_pool=from_token_major(jnp.asarray(v_pool, dtype)),
        pages=jnp.asarray(tables), lengths=jnp.asarray(lengths, jnp.int32), layer=layer,
        tokens_per_frame=tokens_per_frame,
        extra_k=jnp.asarray(normal(rows, extra, kv_heads, head_dim), dtype) if extra else None,
        extra_v=jnp.asarray(normal(rows, extra, kv_heads, head_dim), dtype) if extra else None,
    )
    bad = dict(case, k_pool=from_token_major(jnp.asarray(np.where(mask, k_pool, np.nan), dtype)),
               v_pool=from_token_major(jnp.asarray(np.where(mask, v_pool, np.nan), dtype)),
               pages=jnp.asarray(stale))
    return bad, case


WIDE_SPECS = {
    "no_history": dict(committed=(0, 0)),
    "sink_only_and_partial": dict(committed=(1, 2)),
    "full_after_eviction_gqa_extras3": dict(committed=(5, 7), extra=3),
    "ragged_lengths": dict(committed=(3, 3), lengths=[70, 333]),
    "mha_f16_layer0": dict(committed=(4, 1), num_q_heads=2, dtype=jnp.float16, layer=0),
    "one_page_per_frame_1664": dict(committed=(2, 4), tokens_per_frame=1560, block_size=1664,
                                    num_q_heads=2, kv_heads=1),
}


def assert_matches_reference(out, expected) -> None:
    want = window_attention_reference(**expected)
    assert out.dtype == expected["q"].dtype and out.shape == expected["q"].shape
    assert bool(jnp.all(jnp.isfinite(out))), "NaN/inf reached the output"
    tol = TOLERANCE[jnp.dtype(expected["q"].dtype).type]
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                               atol=tol, rtol=tol)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["cudnn_gather_xla", CUDNN_GATHER, MOSAIC_GPU])
@pytest.mark.parametrize("name", WIDE_SPECS)
def test_wide_cases(name, backend):
    inputs, expected = make_wide_case(**WIDE_SPECS[name])
    assert_matches_reference(window_attention(**inputs, backend=backend), expected)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["cudnn_gather_xla", "pallas_gpu_interpret", CUDNN_GATHER,
                                     compiled("pallas_gpu"), MOSAIC_GPU])
@pytest.mark.parametrize("kv_dtype", QUANTIZED_DTYPES)
@pytest.mark.parametrize("name", ["ragged_lengths", "full_after_eviction_gqa_extras3"])
def test_quantized_wide_cases(name, kv_dtype, backend):
    """Quantized pools on kernel-sized tiles: NaN scales on every page no row reads, the dtype's NaN
    or largest value in every unreadable slot of a readable page (padding, past the length)."""
    bad, clean = make_wide_case(**WIDE_SPECS[name])
    inputs = quantize_poisoned(clean, bad, kv_dtype)
    assert bool(jnp.any(jnp.isnan(inputs["k_pool"].scales)))
    expected = dict(clean, k_pool=quantize_pages(clean["k_pool"], kv_dtype),
                    v_pool=quantize_pages(clean["v_pool"], kv_dtype))
    assert_matches_reference(window_attention(**inputs, backend=backend), expected)


def run_mosaic(inputs, block_kv, stages):
    """``mosaic_gpu.window_attention`` on a validated case at tiling ``(block_kv, stages)``."""
    geom = static_validate_inputs(**inputs, backend="pallas_mgpu", block_k=block_kv)
    return mosaic_gpu.window_attention(*(inputs[k] for k in ARGS[:3]), inputs["extra_k"],
                                       inputs["extra_v"], *(inputs[k] for k in ARGS[3:]),
                                       jnp.int32(inputs["layer"]), geom=geom,
                                       scale=geom.head_dim ** -0.5, block_kv=block_kv,
                                       stages=stages)


MOSAIC_TILINGS = [(64, 2), (64, 4), (128, 3)]
"""Key tiles and stages the Mosaic GPU kernel is run at (pages of 128 and 1,664 tokens)."""


@skip_unless_here("pallas_mgpu")
@pytest.mark.parametrize("block_kv,stages", MOSAIC_TILINGS)
@pytest.mark.parametrize("name", WIDE_SPECS)
def test_mosaic_tilings_on_gpu(name, block_kv, stages):
    inputs, expected = make_wide_case(**WIDE_SPECS[name])
    assert_matches_reference(run_mosaic(inputs, block_kv, stages), expected)


needs_mgpu_interpreter = pytest.mark.skipif(not mgpu_interpret.AVAILABLE,
                                            reason=mgpu_interpret.REASON)


def interpreted_cases(fast: list[tuple], every: list[tuple]) -> list:
    """``every`` case as test parameters, those not in ``fast`` in the slow tier (run them with
    ``-m slow`` on the Python 3.12 stack: the 1,664-token pages take a minute or more each)."""
    return [case if case in fast else pytest.param(*case, marks=pytest.mark.slow) for case in every]


@needs_mgpu_interpreter
@pytest.mark.parametrize("name,block_kv,stages", interpreted_cases(
    fast=[(name, 64, 2) for name in WIDE_SPECS if name != "one_page_per_frame_1664"]
    + [("one_page_per_frame_1664", 128, 3)],
    every=[(name, *tiling) for name in WIDE_SPECS for tiling in MOSAIC_TILINGS]))
def test_mosaic_interpreted(name, block_kv, stages):
    """The kernel's own program (barrier protocol, TMA boxes, tile table, masking) on CPU, with
    race detection: NaN wherever a row must not look."""
    inputs, expected = make_wide_case(**WIDE_SPECS[name])
    with mgpu_interpret.gpu_interpret_mode(detect_races=True):
        out = run_mosaic(inputs, block_kv, stages)
    assert_matches_reference(out, expected)


QUANTIZED_CASES = [("full_after_eviction_gqa_extras3", 64, 2), ("ragged_lengths", 64, 3),
                   ("mha_f16_layer0", 128, 2), ("one_page_per_frame_1664", 128, 2)]
"""Kernel-sized cases and tilings of the quantized Mosaic GPU runs."""


@needs_mgpu_interpreter
@pytest.mark.parametrize("name,block_kv,stages,kv_dtype", interpreted_cases(
    fast=[(*case, kv_dtype) for case, kv_dtype in zip(QUANTIZED_CASES, (*QUANTIZED_DTYPES, "int8"))],
    every=[(*case, kv_dtype) for case in QUANTIZED_CASES for kv_dtype in QUANTIZED_DTYPES]))
def test_mosaic_quantized_interpreted(name, block_kv, stages, kv_dtype):
    """Quantized pools: NaN scales on pages no row reads, the dtype's NaN or largest value in every
    unreadable slot of a readable page; 8-bit tiles converted by one consumer each (K, V), with
    race detection."""
    bad, clean = make_wide_case(**WIDE_SPECS[name])
    inputs = quantize_poisoned(clean, bad, kv_dtype)
    expected = dict(clean, k_pool=quantize_pages(clean["k_pool"], kv_dtype),
                    v_pool=quantize_pages(clean["v_pool"], kv_dtype))
    with mgpu_interpret.gpu_interpret_mode(detect_races=True):
        out = run_mosaic(inputs, block_kv, stages)
    assert_matches_reference(out, expected)


# ------------------------------------------------------------------------------------------------
# Mosaic GPU: lowering without a device, tiling rules
# ------------------------------------------------------------------------------------------------


def _specs(inputs):
    return [jax.ShapeDtypeStruct(inputs[k].shape, inputs[k].dtype) for k in ARGS] + [
        jax.ShapeDtypeStruct(inputs[k].shape, inputs[k].dtype)
        for k in ("extra_k", "extra_v") if inputs[k] is not None]


@pytest.mark.slow
@pytest.mark.parametrize("name", WIDE_SPECS)
def test_mosaic_lowers_for_cuda(name):
    inputs, _ = make_wide_case(**WIDE_SPECS[name])

    def fn(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, *extras):
        return window_attention(q, k_cur, v_cur, k_pool, v_pool, pages, lengths,
                                layer=inputs["layer"], extra_k=extras[0] if extras else None,
                                extra_v=extras[1] if extras else None,
                                tokens_per_frame=inputs["tokens_per_frame"], block_k=64,
                                backend="pallas_mgpu")

    assert "mosaic_gpu_v2" in lower_for_cuda(jax.jit(fn), *_specs(inputs)).as_text()


@pytest.mark.parametrize("kv_dtype,block_kv,stages", [
    (None, 128, 2), (None, 128, 3), (None, 64, 4),
    *[(kv_dtype, 128, 2) for kv_dtype in QUANTIZED_DTYPES], ("int8", 64, 3)])
def test_mosaic_lowers_for_cuda_at_wan_shape(kv_dtype, block_kv, stages):
    """Wan-1.3B, 1,664-token pages (13 x 128: one page per 1,560-token frame), rows 4, bf16 and
    quantized pools (fp8 converts through f16, the only fp8 conversion Hopper has)."""
    fn = attention_at_tiling(mosaic_gpu, "pallas_mgpu", block_kv=block_kv, stages=stages)
    specs = wan_attention_specs(4, 1664, kv_dtype=kv_dtype)
    assert "mosaic_gpu_v2" in lower_for_cuda(fn, *specs).as_text()


@pytest.mark.parametrize("change,message", [
    (dict(block_k=96), r"block_k must be a positive multiple of 64 dividing block_size=128 .*, got 96"),
    (dict(block_k=256), r"block_k must be a positive multiple of 64 dividing .*, got 256"),
    (dict(block_q=128), r"block_q must be 64 for the Mosaic GPU kernel .*, got 128"),
])
def test_mosaic_tiling_validation(change, message):
    inputs, _ = make_wide_case(committed=(1,))
    with pytest.raises(ValueError, match=message):
        window_attention(**inputs, backend="pallas_mgpu", **change)


def test_mosaic_dtype_head_dim_and_smem_validation():
    inputs, _ = make_wide_case(committed=(1,), dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"q.dtype=float32 is not supported by the Mosaic GPU"):
        window_attention(**inputs, backend="pallas_mgpu")
    inputs, _ = make_wide_case(committed=(1,), head_dim=96)
    with pytest.raises(ValueError, match=r"head_dim=96 is not supported by the Mosaic GPU kernel"):
        window_attention(**inputs, backend="pallas_mgpu")
    inputs, _ = make_wide_case(committed=(1,), head_dim=256, block_size=256)
    with pytest.raises(ValueError, match=r"block_k=128, stages=2 need 327680 bytes of shared "
                       r"memory at head_dim=256"):
        window_attention(**inputs, backend="pallas_mgpu")
    geom = static_validate_inputs(**inputs, backend="pallas_mgpu", block_k=64)
    with pytest.raises(ValueError, match=r"stages must be an int in \[2, 4\], got 5"):
        check_mosaic_tiling(geom, jnp.bfloat16, None, 64, 5)
    # The 8-bit slots of quantized pools count too: the tiling that fits bf16 pools does not.
    clean = make_wide_case(committed=(1,), head_dim=256, block_size=256)[1]
    quantized = dict(inputs, k_pool=quantize_pages(clean["k_pool"], "int8"),
                     v_pool=quantize_pages(clean["v_pool"], "int8"))
    with pytest.raises(ValueError, match=r"block_k=64, stages=2 need 262144 bytes of shared memory "
                       r"at head_dim=256 with quantized pools; allowed at most 232448"):
        window_attention(**quantized, backend="pallas_mgpu", block_k=64)


# ------------------------------------------------------------------------------------------------
# The scatter paged write for GPU, lowered; the Triton kernel compiled for sm_90
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
@pytest.mark.parametrize("backend", ["cudnn_gather", "pallas_mgpu"])
def test_gpu_write_lowers_to_one_aliased_scatter_per_pool(backend, kv_dtype):
    """For ``cuda``: one scatter with unique indices per pool (per values and scales of a quantized
    pool), no while loop or conditional, and every pool array aliased to its output when donated
    (the StableHLO that XLA:GPU receives)."""
    arrays = 2 if kv_dtype is None else 4
    fn = jax.jit(functools.partial(write_chunk, tokens_per_frame=1560, backend=backend),
                 donate_argnums=(0, 1))
    text = lower_for_cuda(fn, *wan_write_specs(rows=4, num_pages=64, kv_dtype=kv_dtype)).as_text()
    assert text.count('"stablehlo.scatter"(') == arrays
    assert text.count("unique_indices = true") == arrays
    assert "stablehlo.while" not in text and "stablehlo.case" not in text
    assert text.count("tf.aliasing_output") == arrays


@IGNORE_TRITON_DEPRECATION
@pytest.mark.parametrize("kv_dtype", QUANTIZED_DTYPES)
def test_triton_write_lowers_with_quantized_pools_aliased(kv_dtype):
    """For ``cuda``: one Triton call, the values and scales of both donated pools aliased to its
    outputs."""
    fn = jax.jit(functools.partial(write_chunk, tokens_per_frame=1560, backend="pallas_gpu"),
                 donate_argnums=(0, 1))
    text = lower_for_cuda(fn, *wan_write_specs(rows=1, num_pages=64, kv_dtype=kv_dtype)).as_text()
    assert text.count("__gpu$xla.gpu.triton(") == 1
    assert text.count("tf.aliasing_output") == 4


TRITON_WHEEL = pytest.mark.skipif(triton_wheel_bin() is None, reason="the sm_90 compile check needs the "
                                  "triton wheel from PyPI (pip install triton), which this environment lacks")


@IGNORE_TRITON_DEPRECATION
@TRITON_WHEEL
@pytest.mark.parametrize("kv_dtype", POOL_DTYPES)
def test_triton_attention_compiles_for_sm90_without_spills(kv_dtype):
    """Lowered under an abstract H200, compiled to cubin by the wheel: wgmma, no spills, one CTA's
    shared memory, at most 255 registers, for bf16 pools and for 8-bit pools converted in registers
    (the history tiles are loaded as 8-bit and converted before the wgmma)."""
    fn = jax.jit(lambda *a: window_attention(*a, tokens_per_frame=1560, backend="pallas_gpu"))
    report = compile_lowered(fn, wan_attention_specs(1, 1560, kv_dtype=kv_dtype), None, "triton_sm90")
    assert report["local_bytes"] == 0 and report["stack_bytes"] == 0, report
    assert report["wgmma"] > 0, report
    assert report["shared_bytes"] <= 227 * 1024, report
    assert report["registers"] <= 255, report


@IGNORE_TRITON_DEPRECATION
@TRITON_WHEEL
@pytest.mark.parametrize("kv_dtype", POOL_DTYPES)
def test_triton_write_compiles_for_sm90_to_vector_copies(kv_dtype):
    """The page copy compiles to 128-bit global loads and stores, no spills and no shared memory,
    for bf16 and for quantized pages (quantized in XLA before the kernel)."""
    fn = jax.jit(functools.partial(write_chunk, tokens_per_frame=1560, backend="pallas_gpu"),
                 donate_argnums=(0, 1))
    report = compile_lowered(fn, wan_write_specs(rows=1, num_pages=64, kv_dtype=kv_dtype), None, "write_sm90")
    assert report["local_bytes"] == 0 and report["shared_bytes"] == 0, report
    assert report["vector_loads"] > 0 and report["vector_stores"] > 0, report
