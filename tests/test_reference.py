"""The exactness reference's pieces: the frame-level window mask and the masked history."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from arkv_jax.cache import PagedKVCache
from arkv_jax.config import CacheGeometry, KVBranch, WindowPolicy
from arkv_jax.nnx import masked_attention
from arkv_jax.reference import MaskedHistory, window_frame_mask


@pytest.mark.slow
@pytest.mark.parametrize("window,chunk", [
    (WindowPolicy(window_frames=6, sink_frames=2), 2),
    (WindowPolicy(window_frames=4, sink_frames=1), 3),
    (WindowPolicy(window_frames=3, sink_frames=0), 1),
    (WindowPolicy(window_frames=4, sink_frames=2, reset_at_boundary=True), 2),
])
def test_window_frame_mask_is_the_caches_visible_window(window, chunk):
    """The reference's mask, stated on frame indices, equals what the cache shows each chunk."""
    geometry = CacheGeometry(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", tokens_per_frame=3,
                             block_size=2, frames_per_forward=chunk)
    cache = PagedKVCache(geometry, window, (KVBranch("main"),), available_bytes=1 << 20, memory_fraction=1.0)
    cache.open("s")
    chunks = 9
    mask = window_frame_mask(chunks * chunk, chunk, window)
    for c in range(chunks):
        with cache.chunk(["s"], chunk) as step:
            frames = np.asarray(step.inputs.history_frames[0])
            assert sorted(frames[frames >= 0]) == np.flatnonzero(mask[c * chunk, :c * chunk]).tolist(), c
            np.testing.assert_array_equal(mask[c * chunk:(c + 1) * chunk, c * chunk:(c + 1) * chunk], True)
            assert not mask[c * chunk, (c + 1) * chunk:].any()
            kv = jnp.zeros((1, 1, chunk * 3, 1, 8))
            step.commit(kv, kv)


def test_masked_history_expands_the_frame_mask_to_tokens():
    rng = np.random.default_rng(2)
    tpf, frames = 3, 4
    q = jnp.asarray(rng.standard_normal((2, frames * tpf, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, frames * tpf, 2, 8)), jnp.float32) for _ in range(2))
    frame_mask = np.tril(np.ones((frames, frames), bool))[None].repeat(2, axis=0)
    frame_mask[1, 3, 0] = False
    token_mask = np.repeat(np.repeat(frame_mask, tpf, axis=1), tpf, axis=2)
    out = MaskedHistory(jnp.asarray(frame_mask), tpf).attend(q, k, v, jnp.int32(0))
    np.testing.assert_array_equal(out, masked_attention(q, k, v, jnp.asarray(token_mask)))
