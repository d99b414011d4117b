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
