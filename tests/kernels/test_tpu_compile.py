"""AOT compiles of the TPU kernels for v5e and v6e with libtpu's compile-only devices (no TPU).

The shapes are the model presets' (:func:`benchmarks.tpu_compile.preset_shape`: geometry, the
history their ``WindowPolicy`` lets a chunk see, extra tokens), plus wan-1.3b at other page sizes.
Each case compiles (Mosaic + XLA:TPU, VMEM against the kernel's limit), no pool appears in a
``copy``/``copy-start`` of the optimized HLO, the donated write aliases both pools with
temporaries under 1 % of the pools and of the chunk (no copy of the chunk at 12, 16 or 40 KV
heads), and attention's temporaries stay within ``temp_bound_bytes``. The ``xla`` backend (the
fallback) is compiled too, at wan-1.3b: its temporaries stay within a small multiple of one layer's
K/V. Attention over quantized pages (int8, fp8) compiles with the 8-bit pools as the Mosaic call's
operands, and the gather + splash path over int8 pages, neither copying a pool. The gather + splash
baseline compiles with its default tiles in this process (with its raised-VMEM tiles under the
limit the paged kernel sets: ``tests/test_benchmarks.py``, the quick ``tpu_compile`` run).
Pools use few layers where the properties do not depend on the layer count. The compiles are
skipped without libtpu; the token view of the write is also checked interpreted, bit for bit.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import tpu_compile
from benchmarks.tpu_compile import attention_shapes, preset_shape
from pallas_kernels import tpu_aot
from pallas_kernels.backend import resolve_backend
from pallas_kernels.common import pages_per_frame
from pallas_kernels.layout import from_token_major, pool_shape
from pallas_kernels.paged_write import tpu as write_tpu
from pallas_kernels.paged_write import write_chunk, write_chunk_reference
from pallas_kernels.paged_write.reference import chunk_frames, valid_page_ids
from pallas_kernels.quantization import QUANTIZED_DTYPES
from pallas_kernels.window_attention import tpu as twa
from pallas_kernels.window_attention import tpu_gather, window_attention
from pallas_kernels.window_attention import xla as xla_backend

needs_libtpu = pytest.mark.skipif(not tpu_aot.libtpu_available(),
                                  reason="libtpu is not installed (pip install -e '.[tpu]')")
"""Each compile runs the real TPU compiler (seconds to minutes): with ``slow``, the whole suite only."""

BF16 = jnp.bfloat16
MODEL_PRESETS = ("wan-1.3b", "lingbot-v2", "dreamzero-14b")
PRESETS = {
    **{name: preset_shape(name) for name in MODEL_PRESETS},
    "wan-128-token-pages": preset_shape("wan-1.3b", block_size=128),
    "wan-16-token-pages": preset_shape("wan-1.3b", block_size=16),
}
GENERATIONS = ("v5e", "v6e")


def write_call(p: dict, layers: int, heads: int | None = None):
    """``(fn, specs, pool shape, chunk shapes)`` of the donated write of one row's chunk at shape
    ``p`` with ``layers`` layers (and ``heads`` KV heads, default the preset's); the pools hold the
    chunk's pages and the null page; the chunk shapes are the chunk's and its frames'."""
    heads = p["kv_heads"] if heads is None else heads
    tpf, block, frames = p["tokens_per_frame"], p["block_size"], p["cur_frames"]
    ppf = pages_per_frame(tpf, block)
    shape = pool_shape(layers, frames * ppf + 1, block, heads, p["head_dim"])
    new = (layers, 1, frames * tpf, heads, p["head_dim"])

    def fn(kp, vp, kn, vn, ids):
        return write_chunk(kp, vp, kn, vn, ids, tokens_per_frame=tpf, backend="pallas_tpu")

    as_frames = (layers, frames, tpf, heads, p["head_dim"])
    specs = [(shape, BF16)] * 2 + [(new, BF16)] * 2 + [((1, frames * ppf), jnp.int32)]
    return fn, specs, shape, [new, as_frames]


def assert_in_place(gen: str, fn, specs, shape, chunk_shapes):
    """The compiled write copies neither pool nor chunk, aliases both pools and has temporaries
    under 1 % of the chunk."""
    rep = tpu_aot.report(tpu_aot.compile_for_tpu(fn, specs, gen, donate_argnums=(0, 1)), [shape])
    chunk = 2 * 2 * math.prod(chunk_shapes[0])
    assert rep.pool_copies == 0
    assert tpu_aot.copies_of(rep.hlo, chunk_shapes) == 0
    assert rep.alias_bytes >= 2 * 2 * math.prod(shape)
    assert rep.temp_bytes < 0.01 * chunk, (rep.temp_bytes, chunk)


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("gen", GENERATIONS)
@pytest.mark.parametrize("preset", list(PRESETS) + ["lingbot-128-token-pages"])
def test_write_compiles_in_place(gen, preset):
    """Every preset (and 40 heads in 128-token pages: the token view with a frame's padded last
    page among full pages), two layers."""
    p = PRESETS.get(preset) or preset_shape("lingbot-v2", block_size=128)
    assert_in_place(gen, *write_call(p, layers=2))


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("gen", GENERATIONS)
@pytest.mark.parametrize("heads", [12, 16, 40])
def test_write_takes_the_chunk_in_xlas_layout(gen, heads):
    """At wan-1.3b's frames and 30 layers (a chunk far larger than VMEM, so a copy would be an HBM
    temporary) and 12, 16 or 40 KV heads: XLA lays the chunk out head-major at 12 heads and
    row-major at 16 and 40, and the write takes it as laid out, with no transposing copy."""
    assert_in_place(gen, *write_call(PRESETS["wan-1.3b"], layers=30, heads=heads))


QUANTIZED_SESSIONS = 4
"""Sessions whose pool (:func:`arkv_jax.planner.rollout_plan`) the quantized writes are compiled
with: wan-1.3b 65 pages, lingbot-v2 89, dreamzero-14b 310 (128-page scale windows, the last one
narrower)."""


def rollout_pages(preset: str) -> int:
    """Pages of the pool :func:`arkv_jax.planner.rollout_plan` lays out for
    :data:`QUANTIZED_SESSIONS` sessions of ``preset``."""
    from arkv_jax.planner import rollout_plan
    from arkv_jax.presets import get_preset

    m = get_preset(preset)
    return rollout_plan(m.geometry, m.window, m.kv_branches, m.cross_attention, QUANTIZED_SESSIONS).num_blocks_total


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("gen", GENERATIONS)
@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("preset, layers, heads, view", [
    ("wan-1.3b", 30, 12, "head"), ("wan-1.3b", 30, 16, "token"), ("lingbot-v2", 4, 40, "token"),
    ("dreamzero-14b", 8, 40, "token")])
def test_quantized_write_compiles_in_place(gen, kv_dtype, preset, layers, heads, view):
    """Quantized pools of a rollout's size (:func:`rollout_pages`; lingbot-v2 and dreamzero-14b with
    fewer layers, to fit the chip's HBM), a bf16 chunk quantized inside the kernel: the view XLA's
    layout of the chunk asks for, no copy of the pools' values or scales nor of the chunk, values
    and scales aliased, temporaries under 1 % of the pools."""
    p = dict(PRESETS[preset], layers=layers, kv_heads=heads)
    fn, specs, donate, shape = tpu_compile._write_call(p, 1, kv_dtype, num_pages=rollout_pages(preset))
    frames = (layers, p["cur_frames"], p["tokens_per_frame"], heads, p["head_dim"])
    assert write_tpu.chunk_view(frames, BF16, p["block_size"], tpu_aot.compile_only_device(gen)) == view
    leaves = [spec for spec, _ in specs[:2]]
    rep = tpu_aot.report(tpu_aot.compile_for_tpu(fn, specs, gen, donate_argnums=donate), leaves)
    pools = 2 * (math.prod(leaves[0]) + 4 * math.prod(leaves[1]))
    assert rep.pool_copies == 0
    assert tpu_aot.copies_of(rep.hlo, [specs[-2][0], frames]) == 0
    assert rep.alias_bytes >= pools
    assert rep.temp_bytes < 0.01 * pools, (rep.temp_bytes, pools)


def token_view_case(seed: int, dtype, *, block=32, tpf=40, heads=8, layers=2, rows=2, frames=2,
                    num_pages=24):
    """Random pools (NaN pages), a random chunk and distinct page ids, one skipped."""
    rng = np.random.default_rng(seed)
    shape = (layers, num_pages, block, heads, 128)

    def pool():
        x = rng.standard_normal(shape).astype(np.float32)
        x[:, 0] = 0.0
        x[:, 5] = np.nan
        return from_token_major(jnp.asarray(x, dtype))

    ppf = pages_per_frame(tpf, block)
    new = (layers, rows, frames * tpf, heads, 128)
    ids = rng.permutation(np.arange(1, num_pages))[: rows * frames * ppf].reshape(rows, frames * ppf)
    ids[0, 1] = 0
    return (pool(), pool(), jnp.asarray(rng.standard_normal(new), dtype),
            jnp.asarray(rng.standard_normal(new), dtype), jnp.asarray(ids, jnp.int32), tpf, ppf)


def run_token_view(case, backend: str):
    k_pool, v_pool, k_new, v_new, page_ids, tpf, ppf = case
    ids = valid_page_ids(page_ids, k_pool.shape[2])
    fn = jax.jit(functools.partial(write_tpu.write_chunk, ppf=ppf,
                                   interpret=resolve_backend(backend).interpret, view="token"))
    out = fn(k_pool, v_pool, chunk_frames(k_new, tpf), chunk_frames(v_new, tpf), ids)
    ref = write_chunk_reference(k_pool, v_pool, k_new, v_new, page_ids, tokens_per_frame=tpf)
    for actual, expected in zip(out, ref):
        bits = {2: np.uint16, 4: np.uint32}[actual.dtype.itemsize]
        np.testing.assert_array_equal(np.asarray(actual).view(bits), np.asarray(expected).view(bits))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_token_view_matches_reference_interpreted(dtype, monkeypatch):
    """The write's token view under Pallas' interpreter, bit for bit against the reference: pieces
    of 8 tokens (4 to a 32-slot page), frames of 40 tokens (a full page, then a page of 8 tokens
    and 24 zeros, one piece of it all padding), a skipped page, NaN in other pages."""
    monkeypatch.setattr(write_tpu, "PIECE_BYTES", 8 * 8 * 128 * 4)
    assert write_tpu.token_piece(32, 8, 128, 4) == 8
    run_token_view(token_view_case(0, dtype), "pallas_tpu_interpret")


@pytest.mark.slow
def test_token_view_under_the_simulator(monkeypatch):
    """The same under the TPU simulator: DMAs and semaphores emulated, no race found."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as mosaic_interpret

    monkeypatch.setattr(write_tpu, "PIECE_BYTES", 8 * 8 * 128 * 2)
    run_token_view(token_view_case(1, BF16), "pallas_tpu_simulate")
    assert not mosaic_interpret.races.races_found


@pytest.mark.parametrize("mxu_row_sums", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_tuned_attention_paths_match_the_reference_interpreted(mxu_row_sums, dtype):
    """The paths the tuned tiles take, under Pallas' interpreter against the reference: pages cut
    into pieces (272 slots: 128 + 128, then 16 slots of frame padding and tokens) with their
    remainders pooled over a 3-page DMA block, with the row sums on the VPU or the MXU; rows at
    different fills, poison in unreadable slots, 3 extra tokens."""
    from tests.kernels.test_window_attention_tpu import Window, check, make_case, poisoned

    window = Window(sink=1, recent=2, tokens_per_frame=260, block=272)
    case, owned = make_case(committed=(0, 2, 5), window=window, extra=3, dtype=dtype,
                            lengths=[0, 2 * 260 - 7, 3 * 260])
    check(poisoned(case, owned), expected=case, block_q=32, block_q_compute=32, block_kv_compute=128,
          keys_per_block=3 * 272, mxu_row_sums=mxu_row_sums)


@pytest.mark.slow
def test_tuned_attention_paths_under_the_simulator():
    """The same paths (MXU row sums, pooled remainders over two DMA blocks) under the TPU
    simulator: DMAs emulated, races detected, out-of-bounds reads raise."""
    from pallas_kernels.backend import tpu_simulator_params
    from tests.kernels.test_window_attention_tpu import Window, check, make_case, poisoned

    window = Window(sink=1, recent=2, tokens_per_frame=272, block=272)
    case, owned = make_case(committed=(0, 1, 5), window=window, extra=3)
    check(poisoned(case, owned), interpret=tpu_simulator_params(), expected=case, block_q=32,
          block_q_compute=16, block_kv_compute=128, keys_per_block=2 * 272, mxu_row_sums=True)


ATTENTION_CASES = [(p, 1) for p in PRESETS] + [("wan-1.3b", 4)]


def attention_call(preset: str, rows: int):
    """One layer's attention call at ``preset`` for ``rows`` rows (bf16, 2 pool layers): its
    :class:`WindowGeometry`, pool shape and ``(shape, dtype)`` specs of ``q, k_cur, v_cur, k_pool,
    v_pool, pages, lengths, layer`` (then ``extra_k, extra_v`` if the preset has extras)."""
    return attention_shapes(PRESETS[preset], rows, layers=2)


def attention_fn(attend, geom, **kwargs):
    """``fn(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, layer[, extra_k, extra_v])`` calling
    ``attend`` (the facade's or the TPU module's ``window_attention``) with ``geom``'s frame size
    and ``kwargs``."""
    def fn(q, kc, vc, kp, vp, pages, lengths, layer, ek=None, ev=None):
        return attend(q, kc, vc, kp, vp, pages, lengths, layer=layer, extra_k=ek, extra_v=ev,
                      tokens_per_frame=geom.tokens_per_frame, **kwargs)

    return fn


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("gen", GENERATIONS)
@pytest.mark.parametrize("preset,rows", ATTENTION_CASES)
def test_attention_compiles_without_pool_copies(gen, preset, rows):
    """``window_attention(backend="pallas_tpu")``, the call the cache makes (no tiles or generation
    given), compiled for ``gen`` at the preset's shape (the history its ``WindowPolicy`` lets a
    chunk see): it compiles, copies no pool, and ``gen``'s tiling (which the call takes:
    :func:`test_a_program_compiled_for_a_chip_takes_that_chips_tiles`) fits ``gen``'s VMEM budget
    and bounds the temporaries."""
    geom, shape, specs = attention_call(preset, rows)
    rep = tpu_aot.report(tpu_aot.compile_for_tpu(attention_fn(window_attention, geom, backend="pallas_tpu"),
                                                 specs, gen), [shape])
    tpu_geom = twa.Geometry.of(geom, BF16)
    plan = twa.make_plan(tpu_geom, twa.TUNED_BLOCKS[gen])
    assert twa.vmem_estimate_bytes(tpu_geom, plan) <= twa.VMEM_BUDGET[gen]
    assert rep.pool_copies == 0
    assert rep.temp_bytes <= twa.temp_bound_bytes(tpu_geom, plan)


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("gen", GENERATIONS)
def test_the_rotating_kernel_takes_the_chunk_as_projected(gen):
    """Given RMS norms and rotary tables at wan-1.3b (one query head per KV head, head dim 128),
    the kernel normalizes and rotates the raw queries and chunk keys itself and reads them, V and
    its output as the DiT's projections lay them out: compiled, no pool is copied and the
    temporaries stay under one chunk activation."""
    geom, shape, specs = attention_call("wan-1.3b", 1)
    d = geom.head_dim
    prologue = [((geom.rows, geom.q_len, d), "float32")] * 2 + [((geom.rows, geom.q_len), "float32")] * 2 \
        + [((geom.num_q_heads * d,), BF16), ((geom.kv_heads * d,), BF16)]

    def attend(q, kc, vc, kp, vp, pages, lengths, layer, cos, sin, *qk_norm):
        return twa.window_attention(q, kc, vc, kp, vp, pages, lengths, layer=layer, rope=(cos, sin),
                                    qk_norm=qk_norm, tokens_per_frame=geom.tokens_per_frame, generation=gen)

    fn, projected = tpu_compile.as_projected(attend, specs + prologue)
    rep = tpu_aot.report(tpu_aot.compile_for_tpu(fn, projected, gen), [shape])
    call = twa.Geometry.of(geom, BF16, rope=True, qk_norm=True)
    assert call.rotates and call.normalizes
    assert rep.pool_copies == 0
    assert rep.temp_bytes < geom.rows * geom.q_len * geom.num_q_heads * d * 2


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("gen", GENERATIONS)
def test_the_plain_kernel_reads_the_chunk_as_projected(gen):
    """Without tables, at wan-1.3b (one query head per KV head, head dim 128), the kernel reads the
    queries and the chunk's K and V token-major as the DiT's projections lay them out: neither a
    pool nor a chunk activation is copied (head-major q and K had cost two copies each)."""
    geom, shape, specs = attention_call("wan-1.3b", 1)
    fn, projected = tpu_compile.as_projected(attention_fn(twa.window_attention, geom, generation=gen), specs)
    rep = tpu_aot.report(tpu_aot.compile_for_tpu(fn, projected, gen), [shape])
    assert rep.pool_copies == 0
    assert tpu_aot.copies_of(rep.hlo, [(geom.rows, geom.q_len, geom.num_q_heads * geom.head_dim)]) == 0


HLO_TYPES = {"int8": "s8", "float8_e4m3fn": "f8e4m3fn", "float8_e5m2": "f8e5m2"}
"""The quantized page dtypes as the optimized HLO spells them."""


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("gen", GENERATIONS)
@pytest.mark.parametrize("kv_dtype", QUANTIZED_DTYPES)
def test_attention_over_quantized_pages_compiles_without_pool_copies(gen, kv_dtype):
    """``window_attention(backend="pallas_tpu")`` over quantized pools at wan-1.3b with all 30
    layers (a pool-sized conversion of the 8-bit pages would be a temporary far over the bound):
    it compiles, the Mosaic kernel takes both pools' stored values as they are (8-bit operands of
    the custom call: its DMAs move 8-bit pages), no pool is copied and the temporaries stay within
    ``temp_bound_bytes`` (the scales of the visible pages included)."""
    geom, shape, specs = attention_shapes(PRESETS["wan-1.3b"], 1, kv_dtype=kv_dtype)
    fn = tpu_compile.with_pool_arrays(attention_fn(window_attention, geom, backend="pallas_tpu"), kv_dtype)
    rep = tpu_aot.report(tpu_aot.compile_for_tpu(fn, specs, gen), [shape])
    tpu_geom = twa.Geometry.of(geom, BF16, kv_dtype)
    plan = twa.make_plan(tpu_geom, twa.TUNED_BLOCKS[gen])
    assert twa.vmem_estimate_bytes(tpu_geom, plan) <= twa.VMEM_BUDGET[gen]
    call = next(line for line in rep.hlo.splitlines() if "custom-call(" in line and "window_attention_tpu" in line)
    assert call.count(f"{HLO_TYPES[kv_dtype]}[{','.join(map(str, shape))}]") == 2
    assert rep.pool_copies == 0
    assert rep.temp_bytes <= twa.temp_bound_bytes(tpu_geom, plan)


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("gen", GENERATIONS)
def test_gather_baseline_over_int8_pages_compiles_without_pool_copies(gen):
    """The gather + splash path over int8 pages at wan-1.3b (30 layers): it compiles, copies no
    pool, and its temporaries (the gathered, dequantized history) stay under one int8 pool's bytes,
    so no pool is converted whole either."""
    geom, shape, specs = attention_shapes(PRESETS["wan-1.3b"], 1, kv_dtype="int8")
    fn = tpu_compile.with_pool_arrays(attention_fn(tpu_gather.gather_window_attention, geom, generation=gen),
                                      "int8")
    with jax.default_matmul_precision("default"):
        rep = tpu_aot.report(tpu_aot.compile_for_tpu(fn, specs, gen), [shape])
    assert rep.pool_copies == 0
    assert rep.temp_bytes < math.prod(shape)


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("gen", GENERATIONS)
def test_gather_baseline_compiles_with_tuned_blocks(gen):
    """The gather + splash baseline at wan-1.3b with its generation's default-VMEM splash tiles
    (this process sets no scoped VMEM limit): compiles and copies no pool. At default matmul
    precision (tests/conftest.py asks for "highest", which Mosaic refuses on bf16 splash matmuls)."""
    assert tpu_gather.resolve_blocks(gen) == tpu_gather.TUNED_BLOCKS[gen]
    geom, shape, specs = attention_call("wan-1.3b", 1)
    fn = attention_fn(tpu_gather.gather_window_attention, geom, generation=gen)
    with jax.default_matmul_precision("default"):
        rep = tpu_aot.report(tpu_aot.compile_for_tpu(fn, specs, gen), [shape])
    assert rep.pool_copies == 0


def test_baseline_tiles_follow_the_scoped_vmem_limit(monkeypatch):
    """``tpu_gather`` reads the process's scoped VMEM limit from ``LIBTPU_INIT_ARGS`` (the chip's
    default without the flag) and takes the raised-VMEM tiles from their limit up."""
    monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
    for gen in GENERATIONS:
        limit, raised = tpu_gather.RAISED_VMEM_BLOCKS[gen]
        assert tpu_gather.scoped_vmem_limit(gen) == tpu_aot.CHIPS[gen].scoped_vmem_default
        assert tpu_gather.resolve_blocks(gen) == tpu_gather.TUNED_BLOCKS[gen]
        monkeypatch.setenv("LIBTPU_INIT_ARGS", f"--xla_jf_dump_llo_text=true "
                                               f"{tpu_gather.SCOPED_VMEM_FLAG}={limit // 1024}")
        assert tpu_gather.scoped_vmem_limit(gen) == limit
        assert tpu_gather.resolve_blocks(gen) == raised
        monkeypatch.setenv("LIBTPU_INIT_ARGS", f"{tpu_gather.SCOPED_VMEM_FLAG}={limit // 1024 - 1}")
        assert tpu_gather.resolve_blocks(gen) == tpu_gather.TUNED_BLOCKS[gen]
        monkeypatch.delenv("LIBTPU_INIT_ARGS")


XLA_TEMP_KV_MULTIPLE = 4
"""The ``xla`` backend's temporaries stay within this many times one layer's attended K/V."""


@needs_libtpu
@pytest.mark.slow
def test_xla_attention_temporaries_are_bounded():
    """The ``xla`` fallback at wan-1.3b, one row, compiled for v5e: the online softmax over key
    blocks keeps temporaries within ``XLA_TEMP_KV_MULTIPLE`` x one layer's attended K/V
    (:func:`~pallas_kernels.window_attention.xla.kv_bytes`) and far below the float32
    ``[heads, q_len, keys]`` logits."""
    geom, shape, specs = attention_call("wan-1.3b", 1)
    fn = attention_fn(window_attention, geom, backend="xla")
    rep = tpu_aot.report(tpu_aot.compile_for_tpu(fn, specs, "v5e"), [shape])
    full_logits = geom.num_q_heads * geom.q_len * (geom.tail_len + geom.capacity) * 4
    assert rep.pool_copies == 0
    assert rep.temp_bytes <= XLA_TEMP_KV_MULTIPLE * xla_backend.kv_bytes(geom, BF16)
    assert rep.temp_bytes < full_logits / 10


@needs_libtpu
@pytest.mark.slow
def test_a_program_compiled_for_a_chip_takes_that_chips_tiles():
    """On this host the first device is the CPU; a kernel call traced for a compile-only v6e (JAX's
    default device, as ``compile_for_tpu`` sets it) plans with v6e's tiles and VMEM budget, not the
    host's fallback (v5e's)."""
    geom = twa.Geometry.of(attention_call("wan-1.3b", 1)[0], BF16)
    plans = {gen: twa.plan_call(geom, gen) for gen in GENERATIONS}
    assert plans["v5e"] != plans["v6e"]  # the generations do tile this call differently
    assert twa.default_generation() == "v5e"
    for gen in GENERATIONS:
        with jax.default_device(tpu_aot.compile_only_device(gen)):
            assert twa.default_generation() == gen
            assert twa.plan_call(geom, None) == plans[gen]


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("gen", GENERATIONS)
@pytest.mark.parametrize("rows", [1, 2])
def test_context_attention_compiles_without_copies_or_temporaries(gen, rows):
    """The DiT's text cross-attention at Wan-1.3B's shape (a 3-frame chunk of 4,680 tokens, 12
    heads of 128, 512 text tokens), bf16: the kernel compiles within the default scoped VMEM, and
    the queries, the context and the output are read and written in the token-major arrays the
    DiT's projections give, ``[rows, tokens, 12 * 128]`` (no copy, no temporaries)."""
    from pallas_kernels.context_attention import context_attention

    q, kv = (rows, 4680, 12 * 128), (rows, 512, 12 * 128)

    def attend(q, k, v):
        heads = lambda x: x.reshape(*x.shape[:2], 12, 128)  # noqa: E731
        return context_attention(heads(q), heads(k), heads(v), backend="pallas_tpu").reshape(q.shape)

    compiled = tpu_aot.compile_for_tpu(attend, [(q, BF16), (kv, BF16), (kv, BF16)], gen)
    rep = tpu_aot.report(compiled, [q, kv])
    assert tpu_aot.copies_of(rep.hlo, [q, kv]) == 0  # by element count: the 4-D views too
    assert rep.temp_bytes == 0
    assert "context_attention_tpu" in rep.hlo
