"""Tests of the paged window-attention kernel against its pure-jnp reference (CPU).

Every backend runs here on CPU: ``xla`` natively, the cuDNN gather path through jax's XLA attention
(``cudnn_gather_xla``), the Pallas kernels in interpret mode (``pallas_tpu_interpret``,
``pallas_gpu_interpret``) and, on the smallest shapes only, under the TPU
simulator (``pallas_tpu_simulate``: races detected, out-of-bounds reads raise, uninitialised memory
is NaN). Free, foreign and evicted pages, frame padding, slots past a row's length and the unused
pool layer hold NaN wherever a test says ``poison``.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.layout import KV_HEAD_AXIS, page_mask, pool_shape, slot_mask
from pallas_kernels.rope import apply_rope, prepare_qk
from pallas_kernels.window_attention import (
    WindowGeometry,
    dynamic_validate_inputs,
    history_capacity,
    history_slot_valid,
    static_validate_inputs,
    visible_page_count,
    window_attention,
    window_attention_reference,
)
from pallas_kernels.window_attention import xla as xla_backend
from tests.kernels.device_backends import COMPILED_BACKENDS, CUDNN_GATHER, IGNORE_TRITON_DEPRECATION
from tests.tiers import slow_except

# The fast tier runs the XLA path and the TPU kernel in interpret mode; the other interpreters in the
# whole suite.
FAST_BACKENDS = slow_except(("xla", "cudnn_gather_xla", "pallas_tpu_interpret", "pallas_gpu_interpret",
                             *COMPILED_BACKENDS), fast=("xla", "pallas_tpu_interpret"))
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 3e-2, jnp.float16: 4e-3}

LAYERS, NUM_PAGES, BLOCK, KV_HEADS, HEAD_DIM = 2, 40, 16, 2, 16


@dataclasses.dataclass(frozen=True)
class Window:
    """A window policy: ``sink`` frames kept forever plus the ``recent`` newest frames."""

    sink: int = 1
    recent: int = 2
    tokens_per_frame: int = BLOCK

    @property
    def pages_per_frame(self) -> int:
        return -(-self.tokens_per_frame // BLOCK)

    @property
    def max_pages(self) -> int:
        return (self.sink + self.recent) * self.pages_per_frame

    def visible_frames(self, committed: int) -> list[int]:
        sink = list(range(min(committed, self.sink)))
        return sink + list(range(max(self.sink, committed - self.recent), committed))


def page_tables(window: Window, committed: list[int], rng) -> tuple[np.ndarray, list[list[int]]]:
    """Each row's page list (visible frames, frame after frame, 0-padded) and every page it owns.

    Pages are drawn from a permutation of ``1..NUM_PAGES-1``, so rows own disjoint, scattered pages.
    """
    free = list(rng.permutation(np.arange(1, NUM_PAGES)))
    tables = np.zeros((len(committed), window.max_pages), np.int32)
    owned = []
    for row, frames in enumerate(committed):
        frame_pages = [[free.pop() for _ in range(window.pages_per_frame)] for _ in range(frames)]
        visible = [p for f in window.visible_frames(frames) for p in frame_pages[f]]
        tables[row, :len(visible)] = visible
        owned.append([p for pages in frame_pages for p in pages])
    return tables, owned


def make_case(*, committed=(0, 2, 6), window=Window(), extra=0, cur_frames=1, num_q_heads=8,
              dtype=jnp.float32, layer=1, lengths=None, seed=0):
    """Random inputs for ``len(committed)`` rows with ``committed[r]`` frames committed so far."""
    rng = np.random.default_rng(seed)
    rows, tpf = len(committed), window.tokens_per_frame
    tables, owned = page_tables(window, list(committed), rng)
    if lengths is None:
        lengths = [len(window.visible_frames(n)) * tpf for n in committed]
    cur_len = cur_frames * tpf

    def normal(*shape):
        return jnp.asarray(rng.normal(size=shape), dtype)

    shape = pool_shape(LAYERS, NUM_PAGES, BLOCK, KV_HEADS, HEAD_DIM)
    null = page_mask(jnp.arange(NUM_PAGES) == 0)
    case = dict(
        q=normal(rows, cur_len + extra, num_q_heads, HEAD_DIM),
        k_cur=normal(rows, cur_len, KV_HEADS, HEAD_DIM),
        v_cur=normal(rows, cur_len, KV_HEADS, HEAD_DIM),
        k_pool=jnp.where(null, 0, normal(*shape)),
        v_pool=jnp.where(null, 0, normal(*shape)),
        pages=jnp.asarray(tables),
        lengths=jnp.asarray(lengths, jnp.int32),
        layer=layer,
        tokens_per_frame=tpf,
        extra_k=normal(rows, extra, KV_HEADS, HEAD_DIM) if extra else None,
        extra_v=normal(rows, extra, KV_HEADS, HEAD_DIM) if extra else None,
    )
    return case, owned


def poisoned(case: dict, owned: list[list[int]]) -> dict:
    """The same case with NaN in every pool slot the rows must not read.

    NaN goes to: the other layer, pages no row shows (free, evicted, foreign), frame padding and
    slots past each row's length. Page-list entries past a row's last visible page point at pages it
    owns but must not read (stale entries). Valid slots and the null page keep their values.
    """
    tables, lengths = np.asarray(case["pages"]), jnp.asarray(case["lengths"])
    rows, max_pages = tables.shape
    geom = WindowGeometry(rows, 1, 1, 1, HEAD_DIM, 1, 0, LAYERS, NUM_PAGES, BLOCK, max_pages,
                          case["tokens_per_frame"])
    slots = jnp.arange(max_pages * BLOCK)
    valid = np.asarray(history_slot_valid(slots[None, :], lengths[:, None], geom))
    readable = np.zeros((LAYERS, NUM_PAGES, BLOCK), bool)
    readable[:, 0] = True
    for row in range(rows):
        ok = np.flatnonzero(valid[row])
        readable[case["layer"], tables[row, ok // BLOCK], ok % BLOCK] = True
    stale = tables.copy()
    for row, used in enumerate(np.asarray(visible_page_count(lengths, geom))):
        unread = [p for p in owned[row] if p not in tables[row, :used]] or [0]
        stale[row, used:] = np.resize(unread, max_pages - used)
    mask = slot_mask(readable)
    return dict(case, k_pool=jnp.where(mask, case["k_pool"], jnp.nan),
                v_pool=jnp.where(mask, case["v_pool"], jnp.nan), pages=jnp.asarray(stale))


def check(case: dict, backend: str, *, expected=None, **kwargs):
    """Runs ``backend`` on ``case``; compares with the reference (on ``expected``'s inputs)."""
    out = window_attention(**case, backend=backend, **kwargs)
    want = window_attention_reference(**(expected or case))
    dtype = case["q"].dtype
    assert out.dtype == dtype and out.shape == case["q"].shape
    assert bool(jnp.all(jnp.isfinite(out))), "NaN/inf reached the output"
    tol = TOLERANCE[jnp.dtype(dtype).type]
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                               atol=tol, rtol=tol)
    return out


# ------------------------------------------------------------------------------------------------
# Correctness against the reference
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_window_fill_levels(backend):
    """No history, sink only, partial, full, sink + window after eviction; rows at different fills.

    One geometry (GQA 8 query heads on 2 KV heads, tokens_per_frame == block_size): every call
    after the first reuses the compilation.
    """
    for committed in [(0, 0, 0), (1, 0, 2), (3, 2, 1), (6, 9, 4)]:
        case, _ = make_case(committed=committed)
        check(case, backend)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_lengths_not_page_multiples(backend):
    case, owned = make_case(committed=(3, 3, 1), lengths=[5, 37, 16])
    check(poisoned(case, owned), backend, expected=case)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_extra_tokens_frame_padding_and_poison(backend):
    """3 extra tokens, 24-token frames on 16-slot pages (8 padding slots per frame), NaN wherever a
    row must not look (other layer, free/evicted/foreign pages, padding, stale page-list
    entries)."""
    case, owned = make_case(committed=(0, 2, 5), window=Window(tokens_per_frame=24), extra=3)
    check(poisoned(case, owned), backend, expected=case)


@pytest.mark.slow
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_multi_head_attention_layer0(backend):
    """MHA (query heads == KV heads), layer 0 of the stacked pool, two-frame current chunk."""
    case, owned = make_case(committed=(4, 1), num_q_heads=KV_HEADS, layer=0, cur_frames=2)
    check(poisoned(case, owned), backend, expected=case)


@pytest.mark.slow
@pytest.mark.parametrize("backend", [*FAST_BACKENDS, CUDNN_GATHER])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision(backend, dtype):
    case, owned = make_case(committed=(0, 3, 6), extra=3, dtype=dtype)
    check(poisoned(case, owned), backend, expected=case)


@pytest.mark.slow
@pytest.mark.parametrize("backend,tiles", [("pallas_tpu_interpret", dict(block_q=8, block_k=8)),
                                           ("pallas_gpu_interpret", dict(block_q=16, block_k=16))])
def test_small_tiles(backend, tiles):
    """Several query blocks, history key blocks and tail blocks per row."""
    case, owned = make_case(committed=(2, 6), window=Window(tokens_per_frame=24), extra=3)
    check(poisoned(case, owned), backend, expected=case, **tiles)


XLA_BLOCK_CASES = {
    "no history, sink only, partial, full": dict(committed=(0, 1, 2, 6)),
    "ragged lengths": dict(committed=(3, 3, 1), lengths=[5, 37, 16]),
    "extras and frame padding": dict(committed=(0, 2, 5), window=Window(tokens_per_frame=24),
                                     extra=3),
    "bf16 extras": dict(committed=(0, 3, 6), extra=3, dtype=jnp.bfloat16),
}


def xla_in_key_blocks(case: dict, block_k: int, scale: float | None):
    """The ``xla`` backend on ``case`` with ``block_k`` keys per online-softmax block."""
    geom = static_validate_inputs(**case, backend="xla")
    scale = geom.head_dim ** -0.5 if scale is None else scale
    names = ("q", "k_cur", "v_cur", "extra_k", "extra_v", "k_pool", "v_pool", "pages", "lengths")
    return xla_backend.window_attention(*(case[n] for n in names), jnp.int32(case["layer"]),
                                        geom=geom, scale=scale, block_k=block_k)


@pytest.mark.slow
@pytest.mark.parametrize("block_k,scale", [(8, None), (24, 3.0)])
@pytest.mark.parametrize("name", list(XLA_BLOCK_CASES))
def test_xla_several_key_blocks(name, block_k, scale):
    """The ``xla`` online softmax over several key blocks (tail split over blocks, blocks of
    padding only, blocks of masked history) matches the reference, with NaN wherever a row must not
    look and a scale > 1 (masked logits overflow to -inf)."""
    case, owned = make_case(**XLA_BLOCK_CASES[name])
    geom = static_validate_inputs(**case, backend="xla")
    keys = geom.tail_len + geom.capacity
    assert xla_backend.key_block(geom, xla_backend.compute_dtype(case["q"].dtype)) == keys
    assert keys > 2 * block_k
    out = xla_in_key_blocks(poisoned(case, owned), block_k, scale)
    want = window_attention_reference(**case, scale=scale)
    assert bool(jnp.all(jnp.isfinite(out))), "NaN/inf reached the output"
    tol = TOLERANCE[jnp.dtype(case["q"].dtype).type]
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                               atol=tol, rtol=tol)


@pytest.mark.parametrize("rows", [1, 4])
def test_xla_key_block_bounds_the_logits_tile(rows):
    """At the Wan-1.3B chunk (3 x 1,560 queries, 12 heads, 12 visible frames) the key axis splits
    into even blocks of a multiple of 128 keys whose float32 logits fit the budget; small shapes
    keep one block."""
    geom = WindowGeometry(rows, 4680, 12, 12, 128, 4680, 0, 1, 1 + 12 * rows, 1560, 12, 1560)
    block = xla_backend.key_block(geom, jnp.bfloat16)
    budget = max(xla_backend.kv_bytes(geom, jnp.bfloat16), xla_backend.LOGITS_FLOOR_BYTES)
    keys = geom.tail_len + geom.capacity
    blocks = -(-keys // block)
    assert block % xla_backend.KEY_ALIGN == 0 and blocks > 1
    assert rows * 12 * 4680 * block * 4 <= budget
    assert blocks * block - keys < blocks * xla_backend.KEY_ALIGN  # Even blocks: little padding.
    small = dataclasses.replace(geom, q_len=48, cur_len=48, tokens_per_frame=16, block_size=16)
    assert xla_backend.key_block(small, jnp.float32) == small.tail_len + small.capacity


@pytest.mark.slow
def test_tpu_simulator():
    """The TPU kernel under the simulator: DMAs emulated, OOB reads raise, races detected,
    uninitialised VMEM is NaN; GQA, extra tokens, frame padding, poison, rows at different fills."""
    window = Window(sink=1, recent=1, tokens_per_frame=24)
    case, owned = make_case(committed=(0, 1, 4), window=window, extra=3)
    check(poisoned(case, owned), "pallas_tpu_simulate", expected=case)


@pytest.mark.slow
@pytest.mark.parametrize("committed,extra", [((0, 2, 5), 3), ((6, 1), 0)])
def test_tpu_gather_baseline(committed, extra):
    """``pallas_tpu_gather``: XLA gathers the visible pages, splash attention (interpret mode) does
    the rest; GQA, extras, frame padding, NaN poison, ragged fills."""
    case, owned = make_case(committed=committed, window=Window(tokens_per_frame=24), extra=extra)
    check(poisoned(case, owned), "pallas_tpu_gather_interpret", expected=case)


def test_tpu_gather_blocks():
    """The baseline's splash tiles: a tuned row per generation (``"v5e"`` off TPU), keyword
    overrides win, bad tiles and generations are refused."""
    from pallas_kernels.window_attention import tpu_gather

    assert tpu_gather.resolve_blocks() == tpu_gather.TUNED_BLOCKS["v5e"]
    for gen, tuned in tpu_gather.TUNED_BLOCKS.items():
        assert tpu_gather.resolve_blocks(gen) == tuned
        assert tpu_gather.resolve_blocks(gen, block_q=256)["block_q"] == 256
        assert tpu_gather.resolve_blocks(gen, block_kv_compute=None) == tuned
    with pytest.raises(ValueError, match="generation"):
        tpu_gather.resolve_blocks("v4")
    with pytest.raises(ValueError, match="multiple of 128"):
        tpu_gather.resolve_blocks("v6e", block_q=100)
    with pytest.raises(ValueError, match=r"block_kv_compute must be a divisor of block_kv=1024, got 768"):
        tpu_gather.resolve_blocks("v5e", block_kv=1024, block_kv_compute=768)


def test_auto_is_xla_on_cpu():
    case, _ = make_case(committed=(2,))
    np.testing.assert_array_equal(window_attention(**case, backend="auto"),
                                  window_attention(**case, backend="xla"))


def test_scale_argument():
    case, _ = make_case(committed=(3, 1))
    out = window_attention(**case, scale=0.3, backend="xla")
    np.testing.assert_allclose(out, window_attention_reference(**case, scale=0.3), atol=1e-5)


# ------------------------------------------------------------------------------------------------
# Static shapes: one compilation while the window fills
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_one_trace_while_window_fills(backend, fresh_trace_counter):
    """Lengths, pages and the layer change values only: a jitted step traces once."""
    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, layer):
        return window_attention(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, layer=layer,
                                tokens_per_frame=24, backend=backend)

    window = Window(tokens_per_frame=24)
    for frames in range(6):
        case, _ = make_case(committed=(frames, max(frames - 2, 0)), window=window,
                            layer=frames % LAYERS, seed=frames)
        args = [case[k] for k in ("q", "k_cur", "v_cur", "k_pool", "v_pool", "pages", "lengths")]
        out = step(*args, jnp.int32(case["layer"]))
        np.testing.assert_allclose(out, window_attention_reference(**case), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# Lowering for the real targets (no device needed; nothing is compiled or run)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("platform,backend,call", [
    ("tpu", "pallas_tpu", "tpu_custom_call"),
    pytest.param("cuda", "pallas_gpu", "triton", marks=IGNORE_TRITON_DEPRECATION),
])
def test_lowers_for_device(platform, backend, call, lower_for_device):
    """The kernels lower to a Mosaic TPU / Triton custom call (Pallas' own lowering rules: block
    shapes, supported primitives); the device compiler itself is not run here."""
    sds = jax.ShapeDtypeStruct
    rows, q_len, cur_len, max_pages, head_dim = 2, 48, 48, 6, 128
    kv = (rows, cur_len, KV_HEADS, head_dim)
    pool = pool_shape(LAYERS, NUM_PAGES, BLOCK, KV_HEADS, head_dim)
    args = (sds((rows, q_len, 8, head_dim), jnp.bfloat16), sds(kv, jnp.bfloat16),
            sds(kv, jnp.bfloat16), sds(pool, jnp.bfloat16), sds(pool, jnp.bfloat16),
            sds((rows, max_pages), jnp.int32), sds((rows,), jnp.int32), sds((), jnp.int32))

    def fn(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, layer):
        return window_attention(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, layer=layer,
                                tokens_per_frame=24, backend=backend)

    assert call in lower_for_device(fn, args, platform)


# ------------------------------------------------------------------------------------------------
# Host-side validation
# ------------------------------------------------------------------------------------------------


STATIC_ERRORS = [
    (lambda c: dict(q=c["q"][0]), r"q must have rank 4"),
    (lambda c: dict(q=c["q"][..., :8]), r"k_cur.shape=.* does not match"),
    (lambda c: dict(q=c["q"][:, :, :3]), r"num_q_heads=3 .* multiple of kv_heads=2"),
    (lambda c: dict(v_cur=c["v_cur"][:, :3]), r"v_cur.shape must equal k_cur.shape"),
    (lambda c: dict(k_pool=jnp.take(c["k_pool"], jnp.arange(1), axis=KV_HEAD_AXIS),
                    v_pool=jnp.take(c["v_pool"], jnp.arange(1), axis=KV_HEAD_AXIS)),
     r"k_pool.shape=.* does not match"),
    (lambda c: dict(v_pool=c["v_pool"][:1]), r"v_pool.shape must equal k_pool.shape"),
    (lambda c: dict(pages=c["pages"][:1]), r"pages.shape=.* does not match"),
    (lambda c: dict(lengths=c["lengths"][:, None]), r"lengths must have rank 1"),
    (lambda c: dict(k_cur=c["k_cur"].astype(jnp.bfloat16)), r"k_cur.dtype must equal q.dtype"),
    (lambda c: dict(q=c["q"].astype(jnp.int32)), r"q.dtype must be one of"),
    (lambda c: dict(pages=c["pages"].astype(jnp.float32)), r"pages must be an integer array"),
    (lambda c: dict(layer=jnp.zeros((1,), jnp.int32)), r"layer must be an int scalar"),
    (lambda c: dict(layer=LAYERS), r"layer=2 is out of range; allowed \[0, 2\)"),
    (lambda c: dict(layer=-1), r"layer=-1 is out of range; allowed \[0, 2\)"),
    (lambda c: dict(tokens_per_frame=0), r"tokens_per_frame must be an int >= 1"),
    (lambda c: dict(extra_k=c["k_cur"][:, :3]), r"extra_k and extra_v must be given together"),
    (lambda c: dict(extra_k=c["k_cur"][:, :3], extra_v=c["v_cur"][:, :2]),
     r"extra_v.shape must equal extra_k.shape"),
    (lambda c: dict(k_cur=c["k_cur"][:, :0], v_cur=c["v_cur"][:, :0]), r"must all be >= 1"),
]

DYNAMIC_ERRORS = [
    (lambda c: dict(pages=c["pages"].at[1, 2].set(NUM_PAGES)),
     rf"pages\[1, 2\]={NUM_PAGES} is not a page id; allowed \[0, {NUM_PAGES}\)"),
    (lambda c: dict(pages=c["pages"].at[0, 0].set(-1)), r"pages\[0, 0\]=-1 .* allowed \[0, 40\)"),
    (lambda c: dict(lengths=c["lengths"].at[1].set(49)), r"lengths\[1\]=49 .* allowed \[0, 48\]"),
    (lambda c: dict(lengths=c["lengths"].at[0].set(-2)), r"lengths\[0\]=-2 .* allowed \[0, 48\]"),
    (lambda c: dict(layer=jnp.int32(LAYERS)), r"layer=2 is out of range; allowed \[0, 2\)"),
]


def rope_case(extra=0, num_q_heads=8):
    """A case whose queries are the chunk's own tokens, its rotary tables (random angles, one per
    feature pair) and the same case rotated."""
    case, owned = make_case(extra=extra, num_q_heads=num_q_heads, cur_frames=2)
    rows, cur = case["k_cur"].shape[:2]
    case = dict(case, q=case["q"][:, :cur])
    angles = np.repeat(np.random.default_rng(5).uniform(-np.pi, np.pi, (rows, cur, HEAD_DIM // 2)), 2, -1)
    rope = (jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32))
    rotated = dict(case, q=apply_rope(case["q"], rope), k_cur=apply_rope(case["k_cur"], rope))
    return case, owned, rope, rotated


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_rope_is_applied_to_the_chunk_only(backend):
    """``rope``: the queries and the chunk's keys are rotated (before the call or in the kernel),
    the extras and the history keys are read as they are."""
    case, owned, rope, rotated = rope_case(extra=3)
    check(dict(poisoned(case, owned), rope=rope), backend, expected=rotated)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_qk_norm_then_rope_prepare_the_raw_chunk(backend):
    """``qk_norm`` with ``rope``: the raw queries and keys are RMS-normalized, then rotated."""
    case, owned, rope, _ = rope_case()
    rng = np.random.default_rng(7)
    rows, cur, kv_heads, d = case["k_cur"].shape
    qk_norm = tuple(jnp.asarray(rng.uniform(0.5, 1.5, shape), jnp.float32) for shape in
                    [(rows, cur), (rows, cur), (case["q"].shape[2] * d,), (kv_heads * d,)])
    q, k = prepare_qk(case["q"], case["k_cur"], rope, qk_norm)
    check(dict(poisoned(case, owned), rope=rope, qk_norm=qk_norm), backend, expected=dict(case, q=q, k_cur=k))


QK_NORM_ERRORS = [
    (lambda n: n[:3], TypeError, r"qk_norm must be None or a \(q_inv_rms, k_inv_rms, q_gain, k_gain\)"),
    (lambda n: (n[0][:, :4], *n[1:]), ValueError, r"qk_norm q_inv_rms.shape=.* does not match"),
    (lambda n: (*n[:3], n[3][:8]), ValueError, r"qk_norm k_gain.shape=.* does not match"),
    (lambda n: (n[0], n[1].astype(jnp.bfloat16), *n[2:]), ValueError,
     r"qk_norm k_inv_rms.dtype must be float32, got bfloat16"),
    (lambda n: (*n[:2], n[2].astype(jnp.int32), n[3]), ValueError, r"qk_norm q_gain.dtype must be floating"),
]


@pytest.mark.parametrize("change,error,message", QK_NORM_ERRORS)
def test_qk_norm_errors(change, error, message):
    case, _, _, _ = rope_case()
    rows, cur, kv_heads, d = case["k_cur"].shape
    good = (jnp.ones((rows, cur)), jnp.ones((rows, cur)), jnp.ones(case["q"].shape[2] * d),
            jnp.ones(kv_heads * d))
    static_validate_inputs(**case, qk_norm=good, backend="xla")
    with pytest.raises(error, match=message):
        window_attention(**case, qk_norm=change(good), backend="xla")


ROPE_ERRORS = [
    (lambda c, r: dict(rope=r[0]), TypeError, r"rope must be None or a \(cos, sin\) pair"),
    (lambda c, r: dict(rope=(r[0], "sin")), TypeError, r"rope\[1\] \(sin\) must be an array"),
    (lambda c, r: dict(rope=(r[0][:, :5], r[1])), ValueError, r"rope\[0\] \(cos\).shape=.* does not match"),
    (lambda c, r: dict(rope=(r[0], r[1].astype(jnp.bfloat16))), ValueError,
     r"rope\[1\] \(sin\).dtype must be float32, got bfloat16"),
    (lambda c, r: dict(rope=r, q=jnp.concatenate([c["q"], c["q"][:, :1]], axis=1)), ValueError,
     r"q_len=33 must equal cur_len=32"),
]


@pytest.mark.parametrize("validate", [window_attention, static_validate_inputs])
@pytest.mark.parametrize("change,error,message", ROPE_ERRORS)
def test_rope_errors(change, error, message, validate):
    case, _, rope, _ = rope_case()
    with pytest.raises(error, match=message):
        validate(**dict(case, **change(case, rope)), backend="xla")


@pytest.mark.parametrize("validate", [window_attention, static_validate_inputs,
                                      dynamic_validate_inputs])
@pytest.mark.parametrize("change,message", STATIC_ERRORS)
def test_validation_errors(change, message, validate):
    """Shape, dtype and argument errors: raised by the kernel, by its static validation and by its
    dynamic validation (which runs the static one first)."""
    case, _ = make_case(committed=(3, 1))
    with pytest.raises(ValueError, match=message):
        validate(**dict(case, **change(case)), backend="xla")


@pytest.mark.parametrize("validate", [window_attention, static_validate_inputs])
@pytest.mark.parametrize("layer", [1.9, True, jnp.float32(1)])
def test_a_layer_that_is_not_an_integer_is_refused(layer, validate):
    case, _ = make_case(committed=(3, 1))
    with pytest.raises(TypeError, match=r"layer must be an integer scalar"):
        validate(**dict(case, layer=layer), backend="xla")


@pytest.mark.parametrize("change,message", DYNAMIC_ERRORS)
def test_dynamic_validation_errors(change, message):
    """Page ids, lengths and an array layer out of range: refused by ``dynamic_validate_inputs``
    and by an eager kernel call (its default value check), accepted by the static validation and
    by the kernel with ``validate=False``."""
    case, _ = make_case(committed=(3, 1))
    bad = dict(case, **change(case))
    with pytest.raises(ValueError, match=message):
        dynamic_validate_inputs(**bad, backend="xla")
    with pytest.raises(ValueError, match=message):
        window_attention(**bad, backend="xla")
    static_validate_inputs(**bad, backend="xla")
    window_attention(**bad, backend="xla", validate=False)


def test_validation_of_valid_inputs():
    case, _ = make_case(committed=(3, 1), extra=3)
    geom = static_validate_inputs(**case, backend="xla")
    assert (geom.rows, geom.num_extra, geom.capacity) == (2, 3, 48)
    assert dynamic_validate_inputs(**case, backend="xla") is None


def test_static_validation_accepts_abstract_inputs():
    """Shapes and dtypes are all it needs: ``ShapeDtypeStruct`` s and tracers pass."""
    case, _ = make_case(committed=(3, 1))
    arrays = {k: v for k, v in case.items() if hasattr(v, "shape")}
    specs = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in arrays.items()}
    args = dict(case, **specs, layer=jax.ShapeDtypeStruct((), jnp.int32))
    assert static_validate_inputs(**args, backend="pallas_gpu", block_k=32).max_pages == 3
    with pytest.raises(ValueError, match=r"block_k must be a power of two in \[16, 256\] .*, got 24"):
        static_validate_inputs(**args, backend="pallas_gpu", block_k=24)

    def traced(**arrays):
        static_validate_inputs(**dict(case, **arrays), backend="xla")
        return arrays["q"]

    jax.eval_shape(traced, **arrays)


def test_dynamic_validation_needs_concrete_values():
    case, _ = make_case(committed=(3, 1))
    with pytest.raises(jax.errors.TracerArrayConversionError):
        jax.jit(lambda pages: dynamic_validate_inputs(**dict(case, pages=pages)))(case["pages"])


def test_unchecked_lengths_are_masked_to_the_capacity():
    """With the value check off (``validate=False``) an eager call behaves as a jitted one: a
    length past the capacity is masked to the capacity, nothing raises."""
    case, _ = make_case(committed=(6, 6))
    too_long = dict(case, lengths=case["lengths"].at[0].set(10_000))
    eager = window_attention(**too_long, backend="xla", validate=False)
    jitted = jax.jit(lambda lengths: window_attention(**dict(too_long, lengths=lengths),
                                                       backend="xla"))(too_long["lengths"])
    np.testing.assert_array_equal(eager, jitted)
    np.testing.assert_allclose(eager, window_attention_reference(**case), atol=1e-5)


@pytest.mark.parametrize("validate", [window_attention, static_validate_inputs])
def test_validation_of_backend_options(validate):
    case, _ = make_case(committed=(1,))
    with pytest.raises(ValueError, match=r"scale must be a positive finite number"):
        validate(**case, backend="xla", scale=-0.5)
    with pytest.raises(ValueError, match=r"backend must be one of"):
        validate(**case, backend="cuda")
    with pytest.raises(ValueError, match=r"block_k must be a power of two in \[16, 256\] .*, got 24"):
        validate(**case, backend="pallas_gpu_interpret", block_k=24)
    with pytest.raises(ValueError, match=r"block_q must be a power of two in \[16, 256\] .*, got 512"):
        validate(**case, backend="pallas_gpu_interpret", block_q=512)
    with pytest.raises(ValueError, match=r"block_q must be a positive multiple of 8 for the TPU kernel, got 12"):
        validate(**case, backend="pallas_tpu_interpret", block_q=12)
    odd = dict(case, q=case["q"][..., :12], k_cur=case["k_cur"][..., :12],
               v_cur=case["v_cur"][..., :12], k_pool=case["k_pool"][..., :12],
               v_pool=case["v_pool"][..., :12])
    with pytest.raises(ValueError, match=r"head_dim=12 is not supported by the Triton kernel"):
        validate(**odd, backend="pallas_gpu_interpret")
    with pytest.raises(ValueError, match=r"q.dtype=float32 is not supported by cuDNN attention"):
        validate(**case, backend="cudnn_gather")
    with pytest.raises(ValueError, match=r"head_dim=12 is not supported by cuDNN attention"):
        validate(**{k: (v.astype(jnp.bfloat16) if k in ("q", "k_cur", "v_cur", "k_pool", "v_pool")
                        else v) for k, v in odd.items()}, backend="cudnn_gather")


def test_values_not_checked_when_traced():
    """Inside jit only shapes/dtypes are checked; the kernel masks by the (traced) lengths."""
    case, _ = make_case(committed=(3, 1))
    jitted = jax.jit(lambda pages, lengths: window_attention(
        **dict(case, pages=pages, lengths=lengths), backend="xla"))
    out = jitted(case["pages"], case["lengths"])
    np.testing.assert_allclose(out, window_attention_reference(**case), atol=1e-5)


def test_history_capacity():
    assert history_capacity(6, 16, 16) == 96
    assert history_capacity(6, 16, 24) == 72
    assert history_capacity(5, 16, 24) == 48 + 16
    assert history_capacity(3, 16, 8) == 24
