"""The cache facade: per-chunk protocol, lifecycle, cross-attention, failure safety, isolation."""

import gc
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arkv_jax.cache import PagedKVCache
from arkv_jax.config import CacheGeometry, CrossAttentionSpec, KVBranch, WindowPolicy
from pallas_kernels import window_attention, window_attention_reference
from pallas_kernels.layout import LAYER_AXIS, layer_pages, page_mask, pool_geometry

GEOMETRY = CacheGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", tokens_per_frame=6,
                         block_size=4, frames_per_forward=2)
WINDOW = WindowPolicy(window_frames=3, sink_frames=1)
CFG = (KVBranch("positive", 0), KVBranch("negative", 1))
TEXT = (CrossAttentionSpec("text", 5),)


def make_cache(capacity=3, branches=CFG, **kwargs):
    return PagedKVCache(GEOMETRY, WINDOW, branches, TEXT, available_bytes=1 << 30, memory_fraction=1.0,
                        session_capacity=capacity, **kwargs)


def chunk_kv(step, seed):
    """Deterministic fake K/V for a chunk: [layers, B, frames * tpf, heads, dim]."""
    shape = (GEOMETRY.num_layers, len(step.session_ids), step.num_frames * GEOMETRY.tokens_per_frame,
             GEOMETRY.num_kv_heads, GEOMETRY.head_dim)
    k = jax.random.normal(jax.random.PRNGKey(seed), shape)
    return k, k + 100.0


class Recorder:
    """Host-side truth: every committed frame's K per (session, branch)."""

    def __init__(self):
        self.frames = {}

    def record(self, step, k_new):
        k = np.asarray(k_new)
        tpf = GEOMETRY.tokens_per_frame
        for b, (sid, branch) in enumerate(zip(step.session_ids, self.branches(step))):
            for f in range(step.num_frames):
                self.frames.setdefault((sid, branch), []).append(k[:, b, f * tpf:(f + 1) * tpf])

    @staticmethod
    def branches(step):
        per_session = len(step.session_ids) // len(dict.fromkeys(step.session_ids))
        return [i % per_session for i in range(len(step.session_ids))]


def token_major_pages(pool, pages):
    """``[layers, len(pages), block_size, H, D]``: pages of every layer, token-major."""
    return np.stack([np.asarray(layer_pages(jnp.asarray(pool), layer, jnp.asarray(pages)))
                     for layer in range(pool.shape[LAYER_AXIS])])


def visible_history(cache, inputs, b):
    """The K the pool holds for row ``b``'s visible pages, frame by frame: [frames, layers, tpf, H, D]."""
    ppf, tpf = GEOMETRY.pages_per_frame, GEOMETRY.tokens_per_frame
    k_pool = np.asarray(cache.pools[0])
    frames = int(inputs.lengths[b]) // tpf
    out = []
    for f in range(frames):
        pages = np.asarray(inputs.pages[b, f * ppf:(f + 1) * ppf])
        tokens = token_major_pages(k_pool, pages).reshape(GEOMETRY.num_layers, ppf * GEOMETRY.block_size, 2,
                                                          8)[:, :tpf]
        out.append(tokens)
    return out


def expected_visible(frames, current):
    """The recorded frames a chunk of ``current`` frames sees: the window rule on frame indices."""
    sink, recent = (int(x) for x in WINDOW.visible_history(len(frames), current))
    return frames[:sink] + frames[len(frames) - recent:]


@pytest.mark.slow
def test_chunks_write_pages_and_windows_show_exactly_the_right_history():
    cache = make_cache()
    recorder = Recorder()
    sessions = ["a", "b"]
    for sid in sessions:
        cache.open(sid)
    for chunk in range(7):
        with cache.chunk(sessions, num_frames=2) as step:
            inputs = step.inputs
            for b, (sid, branch) in enumerate(zip(step.session_ids, Recorder.branches(step))):
                got = visible_history(cache, inputs, b)
                want = expected_visible(recorder.frames.get((sid, branch), []), 2)
                assert len(got) == len(want)
                for g, w in zip(got, want):
                    np.testing.assert_array_equal(g, w)
                assert int(inputs.first_frame[b]) == 2 * chunk
            k, v = chunk_kv(step, chunk)
            step.commit(k, v)
            recorder.record(step, k)
    # Every session holds sink + window frames per branch; nothing else is used.
    held = cache.plan.managed_num_blocks - 1 - cache.num_free_pages()
    assert held == 2 * 2 * (1 + 3) * GEOMETRY.pages_per_frame


@pytest.mark.slow
def test_a_failed_forward_commits_nothing_and_leaks_nothing():
    cache = make_cache()
    cache.open("a")
    with cache.chunk(["a"], 2) as step:
        step.commit(*chunk_kv(step, 0))
    free = cache.num_free_pages()
    state_before = jax.tree.map(np.asarray, cache.state)
    with pytest.raises(ZeroDivisionError):
        with cache.chunk(["a"], 2) as step:
            _ = 1 / 0
    assert cache.num_free_pages() == free
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, cache.state), state_before)
    with cache.chunk(["a"], 2) as step:  # the cache is usable and resumes at frame 2
        assert np.asarray(step.inputs.first_frame).tolist() == [2, 2]
        step.commit(*chunk_kv(step, 1))
    with pytest.raises(RuntimeError, match="not in flight"):
        step.commit(*chunk_kv(step, 1))


@pytest.mark.slow
def test_fail_closed_releases_the_sessions_of_the_failed_chunk():
    released = []
    cache = make_cache(fail_closed=True, on_release=lambda sid, why: released.append((sid, why)))
    total = cache.num_free_pages()
    for sid in ("a", "b"):
        cache.open(sid)
    with cache.chunk(["a", "b"], 1) as step:
        step.commit(*chunk_kv(step, 0))
    with pytest.raises(RuntimeError, match="model exploded"):
        with cache.chunk(["a"], 1) as step:
            raise RuntimeError("model exploded")
    assert released == [("a", "forward_exception")]
    assert cache.sessions == ("b",)
    cache.close("b")
    assert cache.num_free_pages() == total


def test_lru_eviction_at_the_planned_capacity():
    released = []
    cache = make_cache(capacity=2, on_release=lambda sid, why: released.append((sid, why)))
    cache.open("a")
    cache.open("b")
    cache.open("a")  # touch: b is now the oldest
    cache.open("c")
    assert released == [("b", "lru_eviction")]
    assert cache.sessions == ("a", "c")
    with pytest.raises(KeyError, match="Unknown session 'b'"):
        cache.rows(["b"])


def test_only_one_chunk_in_flight_and_bad_inputs_are_refused():
    cache = make_cache()
    cache.open("a")
    cache.open("b")
    with cache.chunk(["a"], 1) as step:
        with pytest.raises(RuntimeError, match="while a chunk is in flight"):
            with cache.chunk(["b"], 1):
                pass
        with pytest.raises(RuntimeError, match="while a chunk is in flight"):
            cache.close("b")
        with pytest.raises(ValueError, match=r"k_new must have shape \(2, 2, 6, 2, 8\)"):
            step.commit(jnp.zeros((2, 1, 6, 2, 8)), jnp.zeros((2, 1, 6, 2, 8)))
        step.commit(*chunk_kv(step, 0))
    with pytest.raises(ValueError, match=r"num_frames must be an int in \[1, 3\]"):
        with cache.chunk(["a"], 4):
            pass
    with pytest.raises(ValueError, match="session_ids must be distinct"):
        with cache.chunk(["a", "a"], 1):
            pass
    with pytest.raises(KeyError, match="Unknown KV branch 'x'"):
        cache.rows(["a"], ["x"])
    with pytest.raises(ValueError, match="session_id must be a non-empty string"):
        cache.open("")


def test_num_frames_beyond_what_the_pool_always_holds_is_refused_at_the_first_call():
    geometry = CacheGeometry(1, 1, 4, "float32", tokens_per_frame=4, frames_per_forward=1)
    window = WindowPolicy(window_frames=3)
    # A budget of exactly one session: 6 managed pages (5 free) and 1 scratch page of 128 bytes:
    # 3 frames of window + 2 in flight, so a 3-frame chunk would fail once the window is full.
    cache = PagedKVCache(geometry, window, available_bytes=7 * 128, memory_fraction=1.0)
    assert cache.num_free_pages() == 5 and cache.max_chunk_frames() == 2
    cache.open("a")
    state = jax.tree.map(np.asarray, cache.state)
    with pytest.raises(ValueError, match=r"num_frames must be an int in \[1, 2\], got 3"):
        with cache.chunk(["a"], 3):
            pass
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, cache.state), state)
    kv = jnp.zeros((1, 1, 8, 1, 4))
    for _ in range(6):  # the largest accepted value works for the whole life of the session
        with cache.chunk(["a"], 2) as step:
            step.commit(kv, kv)
    assert cache.num_free_pages() + len(cache.pages_held(["a"])["a"]) == cache.total_pages


@pytest.mark.slow
def test_num_frames_beyond_what_a_rows_table_holds_is_refused_at_the_first_call():
    geometry = CacheGeometry(2, 2, 8, "float32", tokens_per_frame=6, block_size=4, frames_per_forward=2)
    window = WindowPolicy(4, 1)
    cache = PagedKVCache(geometry, window, available_bytes=1 << 30, memory_fraction=1.0, session_capacity=1)
    # A row's table holds sink + window + frames_per_forward + 1 = 8 frames; 5 stay after a commit.
    assert cache.max_chunk_frames() == 3
    cache.open("s")
    with pytest.raises(ValueError, match=r"num_frames must be an int in \[1, 3\], got 4 .* page table of 16 pages"):
        with cache.chunk(["s"], 4):
            pass
    for frames in (3, 1, 3, 2, 3, 3):  # every accepted value works for the whole life of the session
        with cache.chunk(["s"], frames) as step:
            kv = jnp.ones((2, 1, frames * 6, 2, 8))
            step.commit(kv, kv)
    assert cache.num_free_pages() + len(cache.pages_held(["s"])["s"]) == cache.total_pages


@pytest.mark.slow
def test_a_bucketed_chunk_owns_its_padding_positions_and_padded_commit():
    """``buckets`` pads a compact batch: the step places per-session values at their positions,
    takes them back, and commits the padded K/V exactly as the unpadded chunk does."""
    padded, plain = make_cache(), make_cache()
    for cache in (padded, plain):
        for sid in ("a", "b"):
            cache.open(sid)
    for chunk in range(4):
        with padded.chunk(["b", "a"], 2, buckets=(1, 4)) as step, plain.chunk(["b", "a"], 2) as twin:
            assert (step.positions, step.num_positions, step.batch_size) == ((0, 1), 4, 8)
            assert step.session_ids == ("b", "b", "a", "a", None, None, None, None)
            inputs = jax.tree.map(np.asarray, step.inputs)
            assert inputs.rows[4:].tolist() == [-1] * 4 and not inputs.lengths[4:].any()
            for got, want in zip(inputs, jax.tree.map(np.asarray, twin.inputs)):
                np.testing.assert_array_equal(got[:4], want)
            per_session = np.asarray([[1.0, 2.0], [3.0, 4.0]], np.float32)
            placed = step.place(per_session)
            assert placed.tolist() == [[1, 2], [3, 4], [0, 0], [0, 0]]
            np.testing.assert_array_equal(step.take(placed), per_session)
            assert step.place_rows(np.arange(4)).tolist() == [0, 1, 2, 3, 0, 0, 0, 0]
            with pytest.raises(ValueError, match=r"k_new must have shape \(2, 8, 12, 2, 8\)"):
                step.commit(*chunk_kv(twin, chunk))  # the unpadded K/V of the live rows only
            k, v = chunk_kv(twin, chunk)
            pad = jnp.full((2, 4, 12, 2, 8), jnp.nan)  # padding rows are never written
            step.commit(jnp.concatenate([k, pad], axis=1), jnp.concatenate([v, pad], axis=1))
            twin.commit(k, v)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, padded.state),
                 jax.tree.map(np.asarray, plain.state))
    for a, b in zip(padded.pools, plain.pools):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="buckets"):
        with padded.chunk(["a", "b"], 2, buckets=(1,)):
            pass


@pytest.mark.slow
def test_a_full_batch_places_sessions_at_their_slots():
    cache = make_cache()
    for sid in ("a", "b", "c"):
        cache.open(sid)
    cache.close("a")
    with cache.chunk(["c", "b"], 1, full_batch=True) as step:
        assert step.positions == (cache.slot("c"), cache.slot("b")) and step.num_positions == 3
        assert step.session_ids == (None, None, "b", "b", "c", "c")
        assert step.take(step.place(np.asarray([7, 9]))).tolist() == [7, 9]
        assert step.place(np.asarray([7, 9]), fill=-1).tolist() == [-1, 9, 7]
        step.commit(*chunk_kv(step, 0))


def test_free_and_foreign_pages_never_reach_an_attention_output():
    cache = make_cache()
    for sid in ("a", "b"):
        cache.open(sid)
    for chunk in range(5):
        with cache.chunk(["a", "b"], 2) as step:
            step.commit(*chunk_kv(step, chunk))
    cache.close("b")  # b's pages are now free
    with cache.chunk(["a"], 2) as step:
        inputs = step.inputs
        k_pool, v_pool = cache.pools
        owned = np.zeros(pool_geometry(k_pool).num_pages, bool)
        owned[np.asarray(inputs.pages).ravel()] = True
        owned[0] = True  # the null page stays zero
        poison = page_mask(~owned)
        k_nan, v_nan = jnp.where(poison, jnp.nan, k_pool), jnp.where(poison, jnp.nan, v_pool)
        q = jax.random.normal(jax.random.PRNGKey(7), (2, 12, 4, 8))
        k_cur, v_cur = chunk_kv(step, 99)
        args = (q, k_cur[0], v_cur[0])
        for layer in range(2):
            clean = window_attention(*args, k_pool, v_pool, inputs.pages, inputs.lengths, layer=layer,
                                     tokens_per_frame=6)
            poisoned = window_attention(*args, k_nan, v_nan, inputs.pages, inputs.lengths, layer=layer,
                                        tokens_per_frame=6)
            reference = window_attention_reference(*args, k_pool, v_pool, inputs.pages, inputs.lengths,
                                                   layer=layer, tokens_per_frame=6)
            assert bool(jnp.all(jnp.isfinite(poisoned)))
            np.testing.assert_array_equal(np.asarray(poisoned), np.asarray(clean))
            np.testing.assert_allclose(np.asarray(clean), np.asarray(reference), rtol=1e-6, atol=1e-5)
        step.commit(k_cur, v_cur)


def text_layers(value, tokens=5):
    return [(jnp.full((1, tokens, 2, 8), value + layer), jnp.full((1, tokens, 2, 8), -value - layer))
            for layer in range(2)]


def test_cross_attention_is_per_session_and_branch_and_transactional():
    cache = make_cache()
    cache.open("s1")
    assert not cache.is_cross_attention_populated("s1", "text", "positive")
    cache.populate_cross_attention("s1", "text", "positive", text_layers(1.0))
    cache.populate_cross_attention("s1", "text", "negative", text_layers(3.0))
    k, v = cache.cross_attention_kv("text")
    rows = cache.rows(["s1"])
    assert float(k[rows[0], 1, 0, 0, 0]) == 2.0 and float(k[rows[1], 0, 0, 0, 0]) == 3.0
    assert float(v[rows[1], 1, 0, 0, 0]) == -4.0

    def failing():
        yield text_layers(9.0)[0]
        raise RuntimeError("projection failed")

    with pytest.raises(RuntimeError, match="projection failed"):
        cache.populate_cross_attention("s1", "text", "positive", failing())
    with pytest.raises(ValueError, match="expected 2 layers, got 1"):
        cache.populate_cross_attention("s1", "text", "positive", text_layers(9.0)[:1])
    with pytest.raises(ValueError, match="expected 2 layers, got more than 2"):
        cache.populate_cross_attention("s1", "text", "positive", text_layers(9.0) * 2)
    with pytest.raises(ValueError, match=r"expected k/v shape \(1, 5, 2, 8\)"):
        cache.populate_cross_attention("s1", "text", "positive", text_layers(9.0, tokens=7))
    with pytest.raises(KeyError, match="Unknown cross-attention cache 'img'"):
        cache.populate_cross_attention("s1", "img", "positive", text_layers(9.0))
    pair = text_layers(9.0)[0]
    for item, got in ((pair + pair[:1], "a tuple of 3 items"), (pair[0], "a ArrayImpl"), (None, "a NoneType")):
        with pytest.raises(ValueError, match=re.escape(
                f"session 's1' branch 'negative': cross-attention cache 'text' layer 1 must yield a (k, v) "
                f"pair, got {got}")):
            cache.populate_cross_attention("s1", "text", "negative", [pair, item])
    k, _ = cache.cross_attention_kv("text")
    assert float(k[rows[0], 0, 0, 0, 0]) == 1.0  # the published cache survived every failure
    assert float(k[rows[1], 0, 0, 0, 0]) == 3.0


def test_reset_keeps_named_caches_and_clear_keeps_history():
    released = []
    cache = make_cache(on_release=lambda sid, why: released.append(why))
    cache.open("s1")
    total = cache.plan.managed_num_blocks - 1
    with cache.chunk(["s1"], 2) as step:
        step.commit(*chunk_kv(step, 0))
    cache.populate_cross_attention("s1", "text", "positive", text_layers(1.0))
    with pytest.raises(KeyError, match=r"Unknown cross-attention caches to keep: \['img'\]"):
        cache.reset("s1", keep_cross_attention=("img",))
    cache.reset("s1", keep_cross_attention=("text",))
    assert released == ["reset"]
    assert cache.num_free_pages() == total
    assert cache.is_cross_attention_populated("s1", "text", "positive")
    with cache.chunk(["s1"], 2) as step:
        assert np.asarray(step.inputs.first_frame).tolist() == [0, 0]
        step.commit(*chunk_kv(step, 1))
    held = total - cache.num_free_pages()
    cache.clear_cross_attention("s1")
    assert not cache.is_cross_attention_populated("s1", "text", "positive")
    assert float(jnp.abs(cache.cross_attention_kv("text")[0]).max()) == 0.0
    assert total - cache.num_free_pages() == held  # history kept
    cache.reset("s1")
    assert cache.num_free_pages() == total


@pytest.mark.slow
def test_soak_churn_leaves_every_page_free_and_memory_flat():
    rng = np.random.default_rng(0)
    geometry = CacheGeometry(1, 1, 4, "float32", tokens_per_frame=4, frames_per_forward=1)
    window = WindowPolicy(window_frames=2, sink_frames=1)
    cache = PagedKVCache(geometry, window, (KVBranch("main"),), (CrossAttentionSpec("text", 3),),
                         available_bytes=1 << 30, memory_fraction=1.0, session_capacity=64)
    total = cache.plan.managed_num_blocks - 1
    sessions = [f"s{i}" for i in range(64)]
    for sid in sessions:
        cache.open(sid)
    kv = jnp.ones((1, 64, 4, 1, 4))
    text = [(jnp.ones((3, 1, 4)), jnp.ones((3, 1, 4)))]
    gc.collect()
    live_before = len(jax.live_arrays())
    for chunk in range(10_000):
        with cache.chunk(sessions, 1) as step:
            step.commit(kv, kv)
        sid = sessions[rng.integers(64)]
        action = rng.integers(8)
        if action == 0:
            cache.close(sid)
            cache.open(sid)
        elif action == 1:
            cache.reset(sid, keep_cross_attention=("text",) if rng.integers(2) else ())
        elif action == 2:
            cache.populate_cross_attention(sid, "text", "main", text)
        elif action == 3:
            cache.clear_cross_attention(sid)
        if chunk % 1000 == 0:
            assert total - cache.num_free_pages() <= 64 * window.resident_frames
    del step
    gc.collect()
    assert len(jax.live_arrays()) <= live_before
    for sid in sessions:
        cache.close(sid)
    assert cache.num_free_pages() == total
    assert float(jnp.abs(cache.cross_attention_kv("text")[0]).max()) == 0.0


# -- robustness: aliasing, callbacks, atomicity, types, no re-tracing ------------------------------------
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from arkv_jax.cache import CallbackError  # noqa: E402


def _page_totals_hold(cache):
    held = cache.pages_held(list(cache.sessions)) if cache.sessions else {}
    return cache.num_free_pages() + sum(len(p) for p in held.values()) == cache.total_pages


def test_duplicate_branches_and_sessions_are_refused_and_change_nothing():
    cache = make_cache()
    cache.open("a")
    free, order = cache.num_free_pages(), cache.sessions
    for kwargs, error, match in [
        (dict(branches=["positive", "positive"]), ValueError, "branches must be distinct"),
        (dict(branches="positive"), TypeError, "branches must be a list or tuple of strings"),
        (dict(branches=[]), ValueError, "branches must not be empty"),
    ]:
        with pytest.raises(error, match=match):
            with cache.chunk(["a"], 1, **kwargs):
                pass
    assert cache.num_free_pages() == free and cache.sessions == order
    cache.close("a")
    assert cache.num_free_pages() == cache.total_pages


SESSION_NAMES = st.sampled_from(["a", "b", "c", "d"])
BRANCH_NAMES = st.sampled_from(["positive", "negative", "zzz"])


@settings(max_examples=15, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["open", "close", "chunk", "fail"]),
                          st.lists(SESSION_NAMES, max_size=4),
                          st.one_of(st.none(), st.lists(BRANCH_NAMES, max_size=3)),
                          st.integers(0, 4)), max_size=8))
def test_random_argument_lists_never_leak_a_page(ops):
    cache = _SHARED.get("cache") or _SHARED.setdefault("cache", make_cache())
    for sid in cache.sessions:
        cache.close(sid)
    for op, sids, branches, frames in ops:
        try:
            if op == "open" and sids:
                cache.open(sids[0])
            elif op == "close" and sids:
                cache.close(sids[0])
            elif op in ("chunk", "fail"):
                with cache.chunk(sids, frames, branches) as step:
                    if op == "fail":
                        raise ZeroDivisionError
                    k = jnp.zeros((GEOMETRY.num_layers, len(step.session_ids), frames * GEOMETRY.tokens_per_frame,
                                   GEOMETRY.num_kv_heads, GEOMETRY.head_dim))
                    step.commit(k, k)
        except (KeyError, ValueError, TypeError, ZeroDivisionError):
            pass
        assert _page_totals_hold(cache), (op, sids, branches, frames)


_SHARED = {}


def test_raising_callbacks_finish_the_bookkeeping_then_raise_chained():
    def boom(sid, reason):
        raise OSError(f"callback failed for {sid}")

    cache = make_cache(capacity=2, on_release=boom, fail_closed=True)
    cache.open("a")
    cache.open("b")
    with pytest.raises(CallbackError, match="lru_eviction") as info:
        cache.open("c")  # evicts a, and c is open all the same
    assert isinstance(info.value.__cause__, OSError)
    assert cache.sessions == ("b", "c")
    with pytest.raises(RuntimeError, match="model exploded") as info:  # the model's error, unchanged
        with cache.chunk(["b", "c"], 1):
            raise RuntimeError("model exploded")
    assert cache.sessions == ()  # both closed although every callback raised
    assert any("on_release" in note for note in getattr(info.value, "__notes__", ["on_release"]))
    assert cache.num_free_pages() == cache.total_pages
    cache.open("d")
    with pytest.raises(CallbackError, match="'close'"):
        cache.close("d")
    assert cache.sessions == ()


def test_a_refused_chunk_keeps_the_lru_order():
    cache = make_cache(capacity=2)
    cache.open("a")
    cache.open("b")
    for bad in (dict(num_frames=9), dict(num_frames=True), dict(num_frames=1, branches=["nope"])):
        with pytest.raises((ValueError, TypeError, KeyError)):
            with cache.chunk(["a"], **bad):
                pass
    assert cache.sessions == ("a", "b")
    cache.open("c")  # evicts a, the least recently used, as before the refusals
    assert cache.sessions == ("b", "c")


def test_bad_types_and_values_at_the_boundary():
    cache = make_cache()
    cache.open("a")
    kv = jnp.zeros((2, 2, 6, 2, 8))
    cases = [
        (lambda: cache.chunk("ab", 1).__enter__(), TypeError, "session_ids"),
        (lambda: cache.chunk([], 1).__enter__(), ValueError, "session_ids must not be empty"),
        (lambda: cache.chunk(["a"], 1.0).__enter__(), TypeError, "num_frames"),
        (lambda: cache.chunk(["a"], 1, full_batch="yes").__enter__(), TypeError, "full_batch"),
        (lambda: cache.reset("a", keep_cross_attention="text"), TypeError, "keep_cross_attention"),
        (lambda: cache.open(3), TypeError, "session_id"),
        (lambda: cache.close(None), TypeError, "session_id"),
        (lambda: cache.populate_cross_attention("a", "text", "positive",
                                                [(jnp.zeros((5, 2, 8), jnp.int32),) * 2] * 2), TypeError, "dtype"),
        (lambda: make_cache(backend="cuda-ish"), ValueError, "backend"),
        (lambda: make_cache(on_release="print"), TypeError, "on_release"),
        (lambda: make_cache(fail_closed="False"), TypeError, "fail_closed"),
        (lambda: make_cache(capacity=2.5), TypeError, "session_capacity"),
        (lambda: make_cache(capacity=True), TypeError, "session_capacity"),
    ]
    for call, error, word in cases:
        with pytest.raises(error, match=word):
            call()
    assert cache.sessions == ("a",) and cache._core.in_flight is None
    with cache.chunk(["a"], 1) as step:
        for dtype in (jnp.int32, jnp.bool_, jnp.complex64):
            with pytest.raises(TypeError, match="k_new must have a floating dtype"):
                step.commit(kv[:, :, :6].astype(dtype), kv)
        step.commit(kv.astype(jnp.bfloat16), kv)  # floats of another width are cast


def test_eager_cross_attention_rows_does_not_retrace():
    from arkv_jax.cache import programs

    cache = make_cache()
    cache.open("a")
    with cache.chunk(["a"], 1) as step:
        kv = cache.cross_attention_kv("text")
        cache.cross_attention_rows(kv, step.inputs)
        before = programs.cross_attention_rows._cache_size()
        for _ in range(3):
            k, v = cache.cross_attention_rows(kv, step.inputs)
        assert programs.cross_attention_rows._cache_size() == before
        assert k.shape == (GEOMETRY.num_layers, 2, 5, GEOMETRY.num_kv_heads, GEOMETRY.head_dim)


@pytest.mark.slow
def test_without_a_plan_or_budget_the_pool_holds_exactly_the_sessions_asked_for(caplog):
    from arkv_jax.planner import rollout_plan

    for capacity in (1, 3):
        with caplog.at_level("INFO", logger="arkv_jax.planner"):
            cache = PagedKVCache(GEOMETRY, WINDOW, CFG, TEXT, session_capacity=capacity)
        assert cache.plan == rollout_plan(GEOMETRY, WINDOW, CFG, TEXT, capacity)
        assert cache.plan.session_capacity == capacity
        assert [r.getMessage() for r in caplog.records if "holds exactly" in r.getMessage()][-1].startswith(
            f"no plan, available_bytes or memory_fraction given: the pool holds exactly {capacity} session(s)")
    for sid in ("a", "b", "c"):
        cache.open(sid)
    for chunk in range(4):  # a full window for every session, then more chunks: nothing runs out
        with cache.chunk(["a", "b", "c"], GEOMETRY.frames_per_forward) as step:
            step.commit(*chunk_kv(step, chunk))
    # A budget (or a fraction) still plans by vLLM-Omni's rule.
    budgeted = PagedKVCache(GEOMETRY, WINDOW, CFG, TEXT, available_bytes=1 << 24)
    assert budgeted.plan.memory_fraction == 0.1 and budgeted.plan.num_blocks_total > cache.plan.num_blocks_total
