"""The configuration types: their checks and messages, and the small shared rules (ceiling division,
pages per frame, the frame-level window rule)."""

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arkv_jax.config import (
    CacheGeometry,
    CrossAttentionSpec,
    KVBranch,
    WindowPolicy,
    ceil_div,
    lookup,
    pages_per_frame,
    validate_branches,
    validate_cross_attention,
)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: KVBranch(""), "KV branch name must be a non-empty string, got ''"),
        (lambda: KVBranch("x", -1), "KV branch local_index must be non-negative, got -1"),
        (lambda: CrossAttentionSpec("", 3), "cross-attention name must be a non-empty string, got ''"),
        (lambda: CrossAttentionSpec("text", 0), "cross-attention num_tokens must be positive, got 0"),
        (lambda: CrossAttentionSpec("text", 4, num_kv_heads=0), "cross-attention num_kv_heads must be positive, got 0"),
        (lambda: CacheGeometry(0, 1, 1, "float32", 1), "num_layers must be positive, got 0"),
        (lambda: CacheGeometry(1, 0, 1, "float32", 1), "num_kv_heads must be positive, got 0"),
        (lambda: CacheGeometry(1, 1, -2, "float32", 1), "head_dim must be positive, got -2"),
        (lambda: CacheGeometry(1, 1, 1, "float32", 0), "tokens_per_frame must be positive, got 0"),
        (lambda: CacheGeometry(1, 1, 1, "float32", 4, block_size=0), "block_size must be positive, got 0"),
        (lambda: CacheGeometry(1, 1, 1, "float32", 4, frames_per_forward=0),
         "frames_per_forward must be positive, got 0"),
        (lambda: CacheGeometry(1, 1, 1, "int8", 4),
         "dtype must be one of ('float32', 'bfloat16', 'float16'), got 'int8'"),
        (lambda: CacheGeometry(1, 1, 1, "nonsense", 4),
         "dtype must be one of ('float32', 'bfloat16', 'float16'), got 'nonsense'"),
        (lambda: WindowPolicy(None), "window_frames must be positive, got None (NoneType, expected an int)"),
        (lambda: WindowPolicy(0), "window_frames must be positive, got 0"),
        (lambda: WindowPolicy(2, sink_frames=-1), "sink_frames must be non-negative, got -1"),
        (lambda: validate_branches(()), "kv_branches must hold at least one KV branch"),
        (lambda: validate_branches((KVBranch("a"), KVBranch("a", 1))),
         "KV branch names must be unique, got ['a', 'a']"),
        (lambda: validate_branches((KVBranch("a", 2),)),
         "KV branch local_index values must be contiguous from zero, got [2]"),
        (lambda: validate_cross_attention((CrossAttentionSpec("t", 1),) * 2),
         "cross-attention names must be unique, got ['t', 't']"),
    ],
)
def test_config_errors(build, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        build()


def test_no_core_message_names_vllm_omni():
    for build in (lambda: WindowPolicy(0), lambda: WindowPolicy(None), lambda: KVBranch(""),
                  lambda: CacheGeometry(1, 1, 1, "float32", 1, frames_per_forward=0)):
        with pytest.raises(ValueError) as info:
            build()
        assert not re.search(r"AR-Diffusion|ARDiffusion|Phase|chunks|frames_per_block", str(info.value))


def test_dtype_accepts_strings_numpy_and_jax_dtypes():
    import jax.numpy as jnp

    for dtype in ("bfloat16", jnp.bfloat16, jnp.dtype("bfloat16")):
        assert CacheGeometry(1, 1, 1, dtype, 1).dtype == "bfloat16"
    assert CacheGeometry(1, 1, 1, np.float16, 1).itemsize == 2


def test_lookup_names_what_it_looked_for():
    assert lookup({"a": 1}, "a", "KV branch") == 1
    with pytest.raises(KeyError, match=re.escape("Unknown KV branch 'b'; expected ('a',)")):
        lookup({"a": 1}, "b", "KV branch")


@given(a=st.integers(0, 10**12), b=st.integers(1, 10**6))
def test_ceil_div_and_pages_per_frame(a, b):
    assert ceil_div(a, b) == (a + b - 1) // b
    if a:
        assert pages_per_frame(a, b) == ceil_div(a, b)
        assert CacheGeometry(1, 1, 1, "float32", a, block_size=b).pages_per_frame == pages_per_frame(a, b)


# ------------------------------------------------------------------------------------------------
# The window rule.


def test_window_rule_by_hand():
    """Sink 1, window 3, chunks of 2 frames: frames 0-1 see nothing earlier; 2-3 see 0 and 1 (4
    frames fit); 4-5 see the sink and frame 3 (window 3 - chunk 2 = 1 recent frame)."""
    window = WindowPolicy(window_frames=3, sink_frames=1)
    sink, recent = window.visible_history([0, 2, 4, 6], 2)
    assert sink.tolist() == [0, 1, 1, 1] and recent.tolist() == [0, 1, 1, 1]
    frames = np.arange(8)
    mask = window.frame_visible(frames[None, :], (frames // 2 * 2)[:, None], 2)
    expected = np.array([
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],
        [1, 0, 0, 1, 1, 1, 0, 0],
        [1, 0, 0, 1, 1, 1, 0, 0],
        [1, 0, 0, 0, 0, 1, 1, 1],
        [1, 0, 0, 0, 0, 1, 1, 1],
    ], bool)
    np.testing.assert_array_equal(mask, expected)
    reset = WindowPolicy(window_frames=3, sink_frames=1, reset_at_boundary=True)
    assert [int(r) for r in reset.visible_history([0, 2, 4], 2)[1]] == [0, 0, 0]
    assert reset.frame_visible(frames, 4, 2).tolist() == [True, False, False, False, True, True, False, False]


@settings(max_examples=200, deadline=None)
@given(sink=st.integers(0, 4), window=st.integers(1, 6), reset=st.booleans(),
       chunks=st.lists(st.integers(1, 4), min_size=1, max_size=10))
def test_window_rule_matches_a_simulation_of_the_resident_frames(sink, window, reset, chunks):
    """Chunk after chunk, the frames the rule shows are the resident frames a chunk can see: every
    resident frame while the chunk fits in sink + window, else the sink and the newest
    ``window - chunk`` resident frames; after a commit a session keeps the sink and the newest
    ``window`` frames (only the sink in reset mode)."""
    policy = WindowPolicy(window, sink, reset)
    resident, first = [], 0
    for frames in chunks:
        if len(resident) + frames <= sink + window:
            seen = list(resident)
        else:
            kept = resident[:sink]
            seen = kept + resident[len(resident) - min(len(resident) - len(kept), max(0, window - frames)):]
        got = np.flatnonzero(policy.frame_visible(np.arange(first + frames), first, frames)).tolist()
        assert got == seen + list(range(first, first + frames))
        first += frames
        resident += range(first - frames, first)
        live = resident[sink:]
        resident = resident[:sink] + ([] if reset else live[len(live) - min(len(live), window):])


_RULE_CASES = dict(sink=st.integers(0, 4), window=st.integers(1, 6), reset=st.booleans(),
                   first=st.integers(0, 30), frames=st.integers(1, 6))


@pytest.mark.slow
@settings(max_examples=100, deadline=None)
@given(**_RULE_CASES)
def test_window_rule_gives_the_same_answer_on_ints_numpy_and_tracers(sink, window, reset, first, frames):
    """One definition for every caller: Python ints (facade, planner, rollout) stay ints, NumPy
    arrays (references) and traced values (the jitted state) give the same numbers."""
    import jax
    import jax.numpy as jnp

    policy = WindowPolicy(window, sink, reset)

    def rule(first, frames):
        return (*policy.visible_history(first, frames), policy.skipped_frames(first), policy.kept_frames(first),
                policy.max_history(frames), policy.frame_visible(first - 1, first, frames),
                policy.ring_keeps(first // 3, first, frames),
                policy.max_chunk_frames(table_width=4 * first + 8, pool_pages=9 * first + 20, pages_per_frame=2,
                                        rows_per_shard=3, chunk_rows=frames))

    ints = rule(first, frames)
    assert all(type(x) in (int, bool) for x in ints), ints
    host = rule(np.int32(first), np.int32(frames))
    traced = jax.jit(rule)(jnp.int32(first), jnp.int32(frames))
    assert [int(x) for x in host] == [int(x) for x in traced] == [int(x) for x in ints]


@settings(max_examples=100, deadline=None)
@given(sink=st.integers(0, 5), window=st.integers(1, 8), reset=st.booleans(), chunk=st.integers(1, 4),
       chunks=st.integers(1, 20))
def test_the_latent_ring_holds_what_a_recache_needs_within_latent_ring_frames(sink, window, reset, chunk, chunks):
    """Chunk after chunk, the ring ``ring_keeps`` leaves holds every frame the next chunk sees
    (``visible_history``) and never more than ``latent_ring_frames`` frames."""
    policy = WindowPolicy(window, sink, reset)
    ring: set[int] = set()
    for newest in range(chunks):
        ring = {c for c in ring | {newest} if policy.ring_keeps(c, newest, chunk)}
        first = (newest + 1) * chunk
        s, recent = policy.visible_history(first, chunk)
        needed = {f // chunk for f in [*range(s), *range(first - recent, first)]}
        assert needed <= ring, (newest, needed, ring)
        assert len(ring) * chunk <= policy.latent_ring_frames(chunk)
        assert policy.max_history(chunk) >= s + recent


@settings(max_examples=100, deadline=None)
@given(sink=st.integers(0, 3), window=st.integers(1, 6), reset=st.booleans(), extra=st.integers(0, 4),
       rows=st.integers(1, 4), spare=st.integers(0, 30), ppf=st.integers(1, 3))
def test_max_chunk_frames_fits_the_table_and_the_pool_when_every_row_is_full(sink, window, reset, extra, rows,
                                                                             spare, ppf):
    policy = WindowPolicy(window, sink, reset)
    held = policy.kept_frames_max
    table_width, pool_pages = (held + extra) * ppf, (rows * held + spare) * ppf
    for chunk_rows in range(1, rows + 1):
        n = policy.max_chunk_frames(table_width=table_width, pool_pages=pool_pages, pages_per_frame=ppf,
                                    rows_per_shard=rows, chunk_rows=chunk_rows)
        assert 0 <= n <= window and held + n <= table_width // ppf
        assert (rows * held + chunk_rows * n) * ppf <= pool_pages
        if n < window:  # one more frame would not fit the table or the pool
            assert held + n + 1 > table_width // ppf or (rows * held + chunk_rows * (n + 1)) * ppf > pool_pages
