"""The TPU window-attention kernel's own tiling knobs (``pallas_kernels.window_attention.tpu.
window_attention``: query sub-blocks, compute chunks, DMA blocks, pages cut into pieces, head dim
128) against the reference, in interpret mode and under the TPU simulator (races detected,
out-of-bounds reads raise, uninitialised memory is NaN). The dispatcher's tests
(``test_window_attention.py``) run the same kernel with its tuned tiles through ``backend=``.

NaN goes wherever a row must not look (``poisoned``): the other layer, free, evicted and foreign
pages, frame padding, slots past a row's length, stale page-list entries.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.backend import tpu_simulator_params
from pallas_kernels.layout import page_mask, pool_geometry, pool_shape, slot_mask
from pallas_kernels.quantization import QUANTIZED_DTYPES
from pallas_kernels.rope import apply_rope, prepare_qk
from pallas_kernels.window_attention import WindowGeometry, tpu, window_attention_reference
from pallas_kernels.window_attention.tpu import window_attention
from pallas_kernels.window_attention.validation import check_arrays
from tests.tiers import slow_except

TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2, jnp.float16: 4e-3}
LAYERS, NUM_PAGES, BLOCK, KV_HEADS, HEAD_DIM = 2, 40, 16, 2, 128
# Small tiles so that several query blocks, sub-blocks, DMA blocks and compute chunks are visited.
SMALL = dict(block_q=16, block_q_compute=16, block_kv_compute=128, keys_per_block=64)


@dataclasses.dataclass(frozen=True)
class Window:
    sink: int = 1
    recent: int = 2
    tokens_per_frame: int = BLOCK
    block: int = BLOCK

    @property
    def pages_per_frame(self) -> int:
        return -(-self.tokens_per_frame // self.block)

    @property
    def max_pages(self) -> int:
        return (self.sink + self.recent) * self.pages_per_frame

    def visible_frames(self, committed: int) -> list[int]:
        sink = list(range(min(committed, self.sink)))
        return sink + list(range(max(self.sink, committed - self.recent), committed))


def make_case(*, committed=(0, 2, 6), window=Window(), extra=0, cur_frames=1, num_q_heads=4,
              dtype=jnp.float32, layer=1, lengths=None, seed=0):
    """Inputs for ``len(committed)`` rows; rows own disjoint, scattered pages."""
    rng = np.random.default_rng(seed)
    rows, tpf, ppf = len(committed), window.tokens_per_frame, window.pages_per_frame
    free = list(rng.permutation(np.arange(1, NUM_PAGES)))
    tables = np.zeros((rows, window.max_pages), np.int32)
    owned = []
    for row, frames in enumerate(committed):
        frame_pages = [[free.pop() for _ in range(ppf)] for _ in range(frames)]
        visible = [p for f in window.visible_frames(frames) for p in frame_pages[f]]
        tables[row, :len(visible)] = visible
        owned.append([p for pages in frame_pages for p in pages])
    if lengths is None:
        lengths = [len(window.visible_frames(n)) * tpf for n in committed]

    def normal(*shape):
        return jnp.asarray(rng.normal(size=shape), dtype)

    shape = pool_shape(LAYERS, NUM_PAGES, window.block, KV_HEADS, HEAD_DIM)
    cur = cur_frames * tpf
    case = dict(q=normal(rows, cur + extra, num_q_heads, HEAD_DIM),
                k_cur=normal(rows, cur, KV_HEADS, HEAD_DIM),
                v_cur=normal(rows, cur, KV_HEADS, HEAD_DIM),
                k_pool=jnp.where(page_mask(jnp.arange(NUM_PAGES) == 0), 0, normal(*shape)),
                v_pool=jnp.where(page_mask(jnp.arange(NUM_PAGES) == 0), 0, normal(*shape)),
                pages=jnp.asarray(tables), lengths=jnp.asarray(lengths, jnp.int32), layer=layer,
                tokens_per_frame=tpf,
                extra_k=normal(rows, extra, KV_HEADS, HEAD_DIM) if extra else None,
                extra_v=normal(rows, extra, KV_HEADS, HEAD_DIM) if extra else None)
    return case, owned


def poisoned(case: dict, owned: list[list[int]]) -> dict:
    """NaN in every pool slot no row may read; stale page-list entries past the visible pages."""
    tables, lengths = np.asarray(case["pages"]), np.asarray(case["lengths"])
    rows, max_pages = tables.shape
    tpf, block = case["tokens_per_frame"], pool_geometry(case["k_pool"]).block_size
    ppf = -(-tpf // block)
    readable = np.zeros((LAYERS, NUM_PAGES, block), bool)
    readable[:, 0] = True
    stale = tables.copy()
    for row in range(rows):
        for t in range(lengths[row]):
            slot = (t // tpf) * ppf * block + t % tpf
            readable[case["layer"], tables[row, slot // block], slot % block] = True
        used = -(-((lengths[row] // tpf) * ppf * block + lengths[row] % tpf) // block)
        unread = [p for p in owned[row] if p not in tables[row, :used]] or [0]
        stale[row, used:] = np.resize(unread, max_pages - used)
    mask = slot_mask(readable)
    return dict(case, k_pool=jnp.where(mask, case["k_pool"], jnp.nan),
                v_pool=jnp.where(mask, case["v_pool"], jnp.nan), pages=jnp.asarray(stale))


def check(case, interpret=True, expected=None, **kwargs):
    out = window_attention(**case, interpret=interpret, **kwargs)
    want = window_attention_reference(**(expected or case))
    assert out.shape == case["q"].shape and out.dtype == case["q"].dtype
    assert bool(jnp.all(jnp.isfinite(out))), "NaN/inf reached the output"
    tol = TOLERANCE[jnp.dtype(case["q"].dtype).type]
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                               atol=tol, rtol=tol)


@pytest.mark.slow
def test_fill_levels(tiles=SMALL):
    """No history, sink only, partial, full, after eviction; rows at different fill levels; GQA."""
    for committed in [(0, 0, 0), (1, 0, 2), (6, 9, 4)]:
        case, owned = make_case(committed=committed)
        check(poisoned(case, owned), expected=case, **tiles)


# GQA reads and writes through head-major transposes; one query head per KV head, through the
# token-major arrays (tpu.Geometry.token_major).
HEAD_LAYOUTS = pytest.mark.parametrize("num_q_heads", [2 * KV_HEADS, KV_HEADS], ids=["gqa", "token_major"])


@HEAD_LAYOUTS
def test_ragged_lengths(num_q_heads, tiles=SMALL):
    case, owned = make_case(committed=(3, 3, 1), lengths=[5, 37, 16], num_q_heads=num_q_heads)
    check(poisoned(case, owned), expected=case, **tiles)


@pytest.mark.slow
@HEAD_LAYOUTS
def test_extras_frame_padding_and_poison(num_q_heads, tiles=SMALL):
    """3 extra tokens, 24-token frames on 16-slot pages (8 padding slots per frame)."""
    case, owned = make_case(committed=(0, 2, 5), window=Window(tokens_per_frame=24), extra=3,
                            num_q_heads=num_q_heads)
    check(poisoned(case, owned), expected=case, **tiles)


def rope_for(case: dict, seed=1) -> tuple[jax.Array, jax.Array]:
    """Random rotary tables ``(cos, sin)`` for the chunk of ``case``: one angle per feature pair."""
    rows, cur, _, d = case["k_cur"].shape
    angles = np.repeat(np.random.default_rng(seed).uniform(-np.pi, np.pi, (rows, cur, d // 2)), 2, axis=-1)
    return jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32)


@pytest.mark.parametrize("num_q_heads,extra,dtype", [
    (KV_HEADS, 0, jnp.float32), (KV_HEADS, 3, jnp.bfloat16), (2 * KV_HEADS, 3, jnp.float32)],
    ids=["token_major", "token_major_extras_bf16", "gqa_extras"])
def test_rope_rotates_the_chunk_before_it_attends(num_q_heads, extra, dtype):
    """With ``rope`` the queries and the chunk's keys come before RoPE; the kernel (which rotates
    them in VMEM where it reads them token-major, else after XLA's rotation) matches the
    reference on the rotated chunk; extras and history keys are read as they are. Two query
    blocks; the tables' block (40 rows) is longer than the tail (35)."""
    case, owned = make_case(committed=(0, 2, 6), extra=extra, num_q_heads=num_q_heads, dtype=dtype,
                            cur_frames=2)
    case = dict(case, q=case["q"][:, :case["k_cur"].shape[1]])
    rope = rope_for(case)
    rotated = dict(case, q=apply_rope(case["q"], rope), k_cur=apply_rope(case["k_cur"], rope))
    check(dict(poisoned(case, owned), rope=rope), expected=rotated, **SMALL)


def qk_norm_for(case: dict, seed=2):
    """Random RMS norms for the chunk of ``case``: each token's inverse RMS and each feature's gain."""
    rng = np.random.default_rng(seed)
    rows, cur, kv_heads, d = case["k_cur"].shape

    def f32(*shape):
        return jnp.asarray(rng.uniform(0.5, 1.5, shape), jnp.float32)

    return f32(rows, cur), f32(rows, cur), f32(case["q"].shape[2] * d), f32(kv_heads * d)


@pytest.mark.parametrize("num_q_heads,extra,dtype", [
    (KV_HEADS, 0, jnp.float32), (KV_HEADS, 0, jnp.bfloat16), (KV_HEADS, 3, jnp.float32),
    (2 * KV_HEADS, 0, jnp.float32)], ids=["token_major", "token_major_bf16", "extras", "gqa"])
def test_qk_norm_normalizes_the_raw_chunk_before_rope(num_q_heads, extra, dtype):
    """With ``qk_norm`` and ``rope`` the queries and the chunk's keys are the raw projections:
    normalized and rotated in the kernel where it reads them token-major without extras, else by
    XLA first (normalized, or normalized and rotated); the same attention as the reference on the
    prepared chunk."""
    case, owned = make_case(committed=(0, 2, 6), extra=extra, num_q_heads=num_q_heads, dtype=dtype,
                            cur_frames=2)
    case = dict(case, q=case["q"][:, :case["k_cur"].shape[1]])
    rope, qk_norm = rope_for(case), qk_norm_for(case)
    q, k = prepare_qk(case["q"], case["k_cur"], rope, qk_norm)
    check(dict(poisoned(case, owned), rope=rope, qk_norm=qk_norm), expected=dict(case, q=q, k_cur=k),
          **SMALL)


def test_a_chunk_xla_prepares_goes_in_head_major(monkeypatch):
    """A rotating call (one query head per KV head, head dim 128) whose tables do not fit the VMEM
    budget is planned without them: XLA normalizes and rotates the chunk and the kernel reads it
    head-major (the wrapper's one exception to token-major blocks); the same attention as the
    reference on the prepared chunk."""
    case, owned = make_case(committed=(0, 2, 6), num_q_heads=KV_HEADS, cur_frames=2)
    case = dict(case, q=case["q"][:, :case["k_cur"].shape[1]])
    rope, qk_norm = rope_for(case), qk_norm_for(case)
    geom = check_arrays(*(case[k] for k in ("q", "k_cur", "v_cur", "k_pool", "v_pool", "pages", "lengths")),
                        layer=case["layer"], tokens_per_frame=case["tokens_per_frame"], rope=rope,
                        qk_norm=qk_norm)
    rotating = tpu.Geometry.of(geom, jnp.float32, rope=True, qk_norm=True)
    plain = tpu.Geometry.of(geom, jnp.float32)
    assert rotating.rotates and rotating.token_major
    blocks = tpu.resolve_blocks("v5e", **SMALL)
    budget = tpu.vmem_estimate_bytes(plain, tpu.make_plan(plain, blocks))
    assert tpu.vmem_estimate_bytes(rotating, tpu.make_plan(rotating, blocks)) > budget
    monkeypatch.setitem(tpu.VMEM_BUDGET, "v5e", budget)
    assert not tpu.plan_rotating_call(rotating, "v5e", **SMALL)[0].rotates
    q, k = prepare_qk(case["q"], case["k_cur"], rope, qk_norm)
    check(dict(poisoned(case, owned), rope=rope, qk_norm=qk_norm), expected=dict(case, q=q, k_cur=k),
          generation="v5e", **SMALL)
    assert kernel_query_rank(dict(case, rope=rope, qk_norm=qk_norm), generation="v5e", **SMALL) == 5
    assert kernel_query_rank(case, generation="v5e", **SMALL) == 3  # Nothing prepared: token-major.


def kernel_query_rank(case: dict, **kwargs) -> int:
    """Rank of the queries the Mosaic call takes (3: token-major ``[rows, tokens, heads * D]``, 5:
    head-major ``[rows, kv_heads, group, tokens, D]``)."""

    def pallas_call(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                return eqn
            for param in eqn.params.values():
                inner = getattr(param, "jaxpr", param)
                if hasattr(inner, "eqns") and (found := pallas_call(inner)) is not None:
                    return found
        return None

    jaxpr = jax.make_jaxpr(lambda: window_attention(**case, interpret=True, **kwargs))()
    return len(pallas_call(jaxpr.jaxpr).invars[4].aval.shape)  # table, counts, lengths, layer, q


@pytest.mark.parametrize("tokens,gen,rotates", [(4680, "v5e", True), (4680, "v6e", True),
                                                (14040, "v5e", True), (14040, "v6e", False)])
def test_the_kernel_rotates_where_its_tables_fit(tokens, gen, rotates):
    """Wan-1.3B's 3-frame chunk is rotated in the kernel on both chips; a 9-frame recache's tables
    and rotated tail would take v6e's tuned tiling over its VMEM budget, so there XLA rotates first
    and the call is planned as one without tables."""
    geom = WindowGeometry(1, tokens, 12, 12, 128, tokens, 0, 30, 100, 1560, 12, 1560)
    call, plan, _ = tpu.plan_rotating_call(tpu.Geometry.of(geom, jnp.bfloat16, rope=True, qk_norm=True),
                                           gen)
    assert call.rotates == call.normalizes == rotates
    assert tpu.vmem_estimate_bytes(call, plan) <= tpu.VMEM_BUDGET[gen]
    assert not tpu.plan_rotating_call(tpu.Geometry.of(geom, jnp.bfloat16), gen)[0].rotates


@pytest.mark.slow
def test_rope_under_the_simulator():
    """The rotating kernel under the TPU simulator: the rotated tail written at a (row, head)'s
    first query block is read by the later ones without a race; no read out of bounds."""
    case, owned = make_case(committed=(0, 1, 4), window=Window(sink=1, recent=1, tokens_per_frame=24),
                            extra=3, num_q_heads=KV_HEADS)
    case = dict(case, q=case["q"][:, :case["k_cur"].shape[1]])
    rope = rope_for(case)
    rotated = dict(case, q=apply_rope(case["q"], rope), k_cur=apply_rope(case["k_cur"], rope))
    check(dict(poisoned(case, owned), rope=rope), interpret=tpu_simulator_params(), expected=rotated,
          block_q=8, block_q_compute=8, block_kv_compute=128, keys_per_block=32)


@pytest.mark.slow
def test_mha_layer0_two_frame_chunk():
    case, owned = make_case(committed=(4, 1), num_q_heads=KV_HEADS, layer=0, cur_frames=2)
    check(poisoned(case, owned), expected=case, **SMALL)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision(dtype):
    case, owned = make_case(committed=(0, 3, 6), extra=3, dtype=dtype)
    check(poisoned(case, owned), expected=case, **dict(SMALL, block_q=32))


@pytest.mark.slow
@pytest.mark.parametrize("block,tpf,dtype", [(272, 260, jnp.float32), (24, 40, jnp.bfloat16)])
def test_pages_cut_into_pieces(block, tpf, dtype):
    """Pages computed piece by piece: larger than the 128-key chunk (272 = 128 + 128 + 16 slots,
    12 of them frame padding), or not a whole number of bf16 tiles (24 slots)."""
    window = Window(sink=1, recent=1, tokens_per_frame=tpf, block=block)
    case, owned = make_case(committed=(0, 2, 5), window=window, extra=3, dtype=dtype,
                            lengths=[0, 2 * tpf - 7, tpf + 5])
    check(poisoned(case, owned), expected=case, block_q=32, block_q_compute=16,
          block_kv_compute=128, keys_per_block=block)


def test_pooled_chunk_in_several_pieces():
    """The tail's partial chunk and 9 page-list entries' 16-slot remainders (144-slot pages, 8 of
    them frame padding, cut into a 128-key piece) pooled: 160 rows computed last in two pieces of at
    most 128 keys; rows with no history, with part of it, and with a full window."""
    window = Window(sink=2, recent=6, tokens_per_frame=136, block=144)
    case, owned = make_case(committed=(0, 3, 11), window=window, extra=3, num_q_heads=KV_HEADS)
    geom = tpu.Geometry.of(WindowGeometry(3, 136, KV_HEADS, KV_HEADS, HEAD_DIM, 136, 3, LAYERS, NUM_PAGES,
                                          144, 8, 136), jnp.float32)
    plan = tpu.plan_call(geom, "v5e", block_q=32, block_q_compute=32, block_kv_compute=128,
                         keys_per_block=3 * 144)[0]
    assert tpu.plan_pooled(geom, plan) == (16, 16 + 9 * 16)
    assert [[entry for entry, _ in piece] for piece in tpu.pooled_pieces(geom, plan)] == [
        [-1, 0, 1, 2, 3, 4, 5, 6], [7, 8]]
    check(poisoned(case, owned), expected=case, block_q=32, block_q_compute=32, block_kv_compute=128,
          keys_per_block=3 * 144)


@pytest.mark.parametrize("block,tpf,tiles", [
    (144, 144, dict(block_q=32, block_q_compute=32, block_kv_compute=128, keys_per_block=3 * 144)),
    (32, 32, dict(block_q=16, block_q_compute=16, block_kv_compute=128, keys_per_block=128)),
], ids=["pages_in_pieces", "pages_per_chunk"])
def test_full_blocks_beside_partial_ones(block, tpf, tiles):
    """A DMA block whose pages are all full runs its chunks unmasked in one region, any other block
    chunk by chunk, masked where needed: rows whose first block is full and whose second is partial
    (a ragged last page, then an empty entry), rows with two full blocks and rows with none, in
    one call, poisoned."""
    window = Window(sink=2, recent=6, tokens_per_frame=tpf, block=block)
    case, owned = make_case(committed=(5, 8, 2, 12), window=window, extra=3, num_q_heads=KV_HEADS,
                            lengths=[4 * tpf + tpf // 2, 8 * tpf, 2 * tpf, 8 * tpf])
    geom = tpu.Geometry.of(WindowGeometry(4, tpf, KV_HEADS, KV_HEADS, HEAD_DIM, tpf, 3, LAYERS, NUM_PAGES,
                                          block, 8, tpf), jnp.float32)
    plan = tpu.plan_call(geom, "v5e", **tiles)[0]
    assert (plan.pages_per_block, plan.pages_per_chunk) == ((3, 0) if block == 144 else (4, 4))
    check(poisoned(case, owned), expected=case, **tiles)


def test_wan_pools_its_remainders_into_one_chunk():
    """At Wan-1.3B's shape (1,560-slot pages in 1,536-key pieces, a 4,680-key chunk) the tail's
    72-key remainder and the 9 pages' 24-slot ones form one 368-row chunk on both chips."""
    geom = tpu.Geometry.of(WindowGeometry(1, 4680, 12, 12, 128, 4680, 0, 30, 10, 1560, 9, 1560), jnp.bfloat16)
    for generation in ("v5e", "v6e"):
        plan = tpu.plan_call(geom, generation)[0]
        assert tpu.plan_pooled(geom, plan) == (80, 368)
        assert len(tpu.pooled_pieces(geom, plan)) == 1


FIXED_TILES = dict(block_q=32, block_q_compute=32, block_kv_compute=128, keys_per_block=2 * 144)


def fixed_case():
    """Three rows of 144-token frames: the tail (the chunk and 3 extras) a whole 128-key chunk and
    more, so the kernel takes fixed row maxima under :data:`FIXED_TILES`."""
    return make_case(committed=(3, 5, 0), window=Window(sink=1, recent=2, tokens_per_frame=144, block=144),
                     extra=3, num_q_heads=KV_HEADS)


def overflowing_case():
    """:func:`fixed_case` whose second row's sink page holds keys 60 times larger: that row's
    history logits exceed the maximum of its first key chunk by far more than 128 (base 2), which
    a fixed maximum cannot take."""
    case, owned = fixed_case()
    page = int(case["pages"][1, 0])
    case["k_pool"] = jnp.where(page_mask(jnp.arange(NUM_PAGES) == page), 60 * case["k_pool"], case["k_pool"])
    q = np.asarray(case["q"][1], np.float64) * HEAD_DIM ** -0.5 / np.log(2)  # Logits in base 2.
    first = np.einsum("thd,shd->hts", q, np.asarray(case["k_cur"][1, :128], np.float64)).max(-1)
    sink = np.einsum("thd,hsd->hts", q, np.asarray(case["k_pool"][case["layer"], :, page], np.float64)).max(-1)
    assert (sink - first).max() > 200
    return case, owned


def check_overflowing(out, case):
    """``out`` against the reference: the overflowing row's logits of about 400 carry float32
    rounding of about 400 * 2**-24 each, hence its looser tolerance."""
    want, out = np.asarray(window_attention_reference(**case)), np.asarray(out)
    np.testing.assert_allclose(out[1], want[1], atol=2e-4, rtol=2e-4)
    np.testing.assert_allclose(out[::2], want[::2], atol=TOLERANCE[jnp.float32], rtol=TOLERANCE[jnp.float32])


@pytest.mark.parametrize("generation", ["v5e", "v6e"])
def test_a_step_that_overflows_its_fixed_maxima_is_computed_again_online(generation):
    """With fixed row maxima (both chips' tuning; v6e's takes the row sums from the MXU) a step
    whose exponentials overflow is computed again with the online softmax: the overflowing row's
    output is the online softmax's, bit for bit, and every row matches the reference, with NaN
    wherever no row may look; the other rows' steps keep their fixed maxima."""
    case, owned = overflowing_case()
    geom = tpu.Geometry.of(check_arrays(**case), jnp.float32)
    plan = tpu.plan_call(geom, generation, **FIXED_TILES)[0]
    assert plan.fixed_row_max and plan.mxu_row_sums == (generation == "v6e")
    out, online = (np.asarray(window_attention(**poisoned(case, owned), interpret=True, generation=generation,
                                               fixed_row_max=fixed, **FIXED_TILES)) for fixed in (True, False))
    np.testing.assert_array_equal(out[1], online[1])
    check_overflowing(out, case)


def test_steps_that_do_not_overflow_keep_their_fixed_maxima():
    """No step of a call without overflows is computed again, the last query block's too, whose
    rows past ``q_len`` (147 queries in blocks of 32) hold unspecified queries (NaN in interpret
    mode): every query block's output differs in its last bits from the online softmax's, which
    rescales where a row's running maximum grows (a step computed again would equal it)."""
    case, owned = fixed_case()
    out, online = (np.asarray(window_attention(**poisoned(case, owned), interpret=True, fixed_row_max=fixed,
                                               **FIXED_TILES)) for fixed in (True, False))
    assert all((out[:, start:start + 32] != online[:, start:start + 32]).any() for start in range(0, 147, 32))
    tol = TOLERANCE[jnp.float32]
    np.testing.assert_allclose(out, np.asarray(window_attention_reference(**case)), atol=tol, rtol=tol)


def test_fixed_row_maxima_need_a_whole_first_chunk():
    """The fixed maxima are each row's over the tail's first compute chunk: a tail shorter than a
    chunk keeps the online softmax."""
    case, _ = make_case(window=Window(tokens_per_frame=120, block=120), num_q_heads=KV_HEADS)
    geom = tpu.Geometry.of(check_arrays(**case), jnp.float32)
    assert not tpu.plan_call(geom, "v5e", block_kv_compute=128)[0].fixed_row_max
    case, _ = make_case(window=Window(tokens_per_frame=128, block=128), num_q_heads=KV_HEADS)
    geom = tpu.Geometry.of(check_arrays(**case), jnp.float32)
    assert tpu.plan_call(geom, "v5e", block_kv_compute=128)[0].fixed_row_max


@pytest.mark.slow
def test_the_online_pass_again_under_the_simulator():
    """The overflowing step's second pass under the TPU simulator: its page DMAs are issued again
    into buffers the first pass used, without a race; no read out of bounds."""
    case, owned = overflowing_case()
    check_overflowing(window_attention(**poisoned(case, owned), interpret=tpu_simulator_params(), **FIXED_TILES),
                      case)


@pytest.mark.slow
def test_simulator_races_and_oob():
    """The TPU simulator: DMAs emulated, races detected, OOB reads raise, uninitialised VMEM NaN;
    GQA, extras, frame padding, poison, rows at different fills, two DMA blocks per row."""
    case, owned = make_case(committed=(0, 1, 4), window=Window(sink=1, recent=1, tokens_per_frame=24),
                            extra=3)
    check(poisoned(case, owned), interpret=tpu_simulator_params(), expected=case,
          block_q=32, block_q_compute=16, block_kv_compute=128, keys_per_block=32)


@pytest.mark.slow
def test_one_trace_while_window_fills():
    chex.clear_trace_counter()

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, layer):
        return window_attention(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, layer=layer,
                                tokens_per_frame=24, interpret=True, **SMALL)

    window = Window(tokens_per_frame=24)
    for frames in range(5):
        case, _ = make_case(committed=(frames, max(frames - 2, 0)), window=window,
                            layer=frames % LAYERS, seed=frames)
        args = [case[k] for k in ("q", "k_cur", "v_cur", "k_pool", "v_pool", "pages", "lengths")]
        out = step(*args, jnp.int32(case["layer"]))
        np.testing.assert_allclose(out, window_attention_reference(**case), atol=2e-5, rtol=2e-5)


def quantized_pair(case: dict, owned, kv_dtype) -> tuple[dict, dict]:
    """``(poisoned, clean)``: ``case`` with its pools quantized page by page, poisoned where no row
    may read (NaN scales on unread pages, NaN or the largest value in unread slots: see
    ``poisoned_quantized``), and the same pools unpoisoned with the poisoned case's page lists."""
    from pallas_kernels.layout import quantize_pages
    from tests.kernels.test_quantized_pools import poisoned_quantized

    bad = poisoned_quantized(case, owned, kv_dtype, poison=poisoned)
    clean = dict(case, k_pool=quantize_pages(case["k_pool"], kv_dtype),
                 v_pool=quantize_pages(case["v_pool"], kv_dtype), pages=bad["pages"])
    return bad, clean


@pytest.mark.parametrize("kv_dtype,mxu_row_sums", slow_except(
    [(kv_dtype, sums) for kv_dtype in QUANTIZED_DTYPES for sums in (False, True)],
    fast=[("float8_e4m3fn", True)]))
def test_quantized_pages_cut_into_pieces(kv_dtype, mxu_row_sums):
    """Quantized pages on the tuned tiles' path: 272-slot pages (12 of them frame padding) cut into
    128-key pieces, each dequantized as it is loaded, their 16-slot remainders pooled over a 3-page
    DMA block (dequantized as they are copied), V widened by ones under ``mxu_row_sums``; the
    chunk and extras stay float32; ragged rows, poison in unread pages' scales and unread slots."""
    window = Window(sink=1, recent=2, tokens_per_frame=260, block=272)
    case, owned = make_case(committed=(0, 2, 5), window=window, extra=3, lengths=[0, 2 * 260 - 7, 3 * 260])
    bad, clean = quantized_pair(case, owned, kv_dtype)
    check(bad, expected=clean, block_q=32, block_q_compute=32, block_kv_compute=128, keys_per_block=3 * 272,
          mxu_row_sums=mxu_row_sums)


@pytest.mark.parametrize("kv_dtype", QUANTIZED_DTYPES)
def test_quantized_whole_pages_per_chunk_in_bf16(kv_dtype):
    """Several 16-slot pages per compute chunk (each page dequantized with its own scale, then
    concatenated), bf16 compute, several query sub-blocks and DMA blocks, GQA, frame padding."""
    case, owned = make_case(committed=(1, 6, 3), window=Window(tokens_per_frame=24), extra=2,
                            dtype=jnp.bfloat16)
    floats = dict(case, k_pool=case["k_pool"].astype(jnp.float32), v_pool=case["v_pool"].astype(jnp.float32))
    bad, clean = quantized_pair(floats, owned, kv_dtype)
    check(bad, expected=clean, **dict(SMALL, block_q=32))


@pytest.mark.slow
def test_quantized_pages_under_the_simulator():
    """Quantized pages under the TPU simulator (DMAs of 8-bit pages emulated, races detected,
    out-of-bounds reads raise, uninitialised VMEM is NaN): pieces, pooled remainders over two DMA
    blocks, MXU row sums."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as mosaic_interpret

    window = Window(sink=1, recent=2, tokens_per_frame=272, block=272)
    case, owned = make_case(committed=(0, 1, 5), window=window, extra=3)
    bad, clean = quantized_pair(case, owned, "float8_e4m3fn")
    check(bad, interpret=tpu_simulator_params(), expected=clean, block_q=32, block_q_compute=16,
          block_kv_compute=128, keys_per_block=2 * 272, mxu_row_sums=True)
    assert not mosaic_interpret.races.races_found


@pytest.mark.parametrize("change,message", [
    (lambda c: dict(q=c["q"][0]), r"q must have rank 4"),
    (lambda c: dict(q=c["q"][:, :, :3]), r"num_q_heads=3 .* multiple of kv_heads=2"),
    (lambda c: dict(k_cur=c["k_cur"].astype(jnp.bfloat16)), r"k_cur.dtype must equal q.dtype"),
    (lambda c: dict(block_kv_compute=100), r"block_kv_compute must be a positive multiple of 128, got 100"),
    (lambda c: dict(block_q=12), r"block_q must be a positive multiple of 8, got 12"),
    (lambda c: dict(generation="v4"), r"generation must be one of \['v5e', 'v6e'\]"),
    (lambda c: dict(scale=-1.0), r"scale must be a positive finite number"),
    (lambda c: dict(block_kv_compute=1 << 20), r"needs about .* MiB of VMEM, over the 100 MiB budget"),
    (lambda c: dict(k_pool=c["k_pool"][:, :, :, :12], v_pool=c["v_pool"][:, :, :, :12],
                    lengths=c["lengths"] * 0, tokens_per_frame=12),
     r"block_size=12 \(pool.shape\[3\]\) must be a multiple of 8"),
])
def test_validation(change, message):
    """The kernel's own knobs; values (pages, lengths, layer) are ``dynamic_validate_inputs``' job
    (``test_window_attention.py``). The block-size rule is the compiled kernel's."""
    case, _ = make_case(committed=(3, 1))
    with pytest.raises(ValueError, match=message):
        window_attention(**dict(case, **change(case)), interpret=False)
