"""The functional core of the NNX layers: 3-D RoPE and dense attention."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arkv_jax.nnx import apply_rope, masked_attention, rope_axis_pairs, rope_tables, token_positions


def test_rope_splits_pairs_like_wan():
    assert rope_axis_pairs(128) == (22, 21, 21)  # Wan-1.3B: 44 frame + 42 row + 42 column dims
    assert rope_axis_pairs(16) == (4, 2, 2)
    with pytest.raises(ValueError, match="even head_dim"):
        rope_axis_pairs(15)


def test_token_positions_are_absolute_frame_row_column():
    pos = np.asarray(token_positions(jnp.asarray([0, 7]), 2, (2, 3)))
    assert pos.shape == (2, 12, 3)
    np.testing.assert_array_equal(pos[1, :6], [[7, 0, 0], [7, 0, 1], [7, 0, 2], [7, 1, 0], [7, 1, 1], [7, 1, 2]])
    np.testing.assert_array_equal(pos[1, 6:, 0], 8)
    np.testing.assert_array_equal(pos[0, :, 1:], pos[1, :, 1:])


def test_rope_tables_give_each_feature_its_pairs_angle():
    cos, sin = rope_tables(jnp.asarray([[[3, 1, 2], [0, 4, 5]]], jnp.int32), 16)
    assert cos.shape == sin.shape == (1, 2, 16)
    np.testing.assert_array_equal(cos[..., 0::2], cos[..., 1::2])
    np.testing.assert_allclose(cos ** 2 + sin ** 2, 1.0, rtol=1e-6)
    np.testing.assert_allclose(cos[0, 1, :8], 1.0)  # frame 0: the frame pairs' angle is 0


def rotate(x, position, head_dim=16):
    """``x`` ``[D]`` rotated at one (frame, row, column) position."""
    rope = rope_tables(jnp.asarray(position, jnp.int32)[None, None], head_dim)
    return apply_rope(jnp.asarray(x)[None, None, None], rope)[0, 0, 0]


def test_rope_scores_depend_only_on_relative_position():
    """Why keys can be stored rotated at absolute positions: q.k sees only the offset."""
    q, k = np.random.default_rng(0).standard_normal((2, 16)).astype(np.float32)
    base = float(rotate(q, (9, 1, 2)) @ rotate(k, (4, 0, 3)))
    for shift in [(1000, 0, 0), (3, 2, 1), (0, -1, 5)]:
        moved = float(rotate(q, np.add((9, 1, 2), shift)) @ rotate(k, np.add((4, 0, 3), shift)))
        assert moved == pytest.approx(base, abs=2e-4)
    assert float(rotate(q, (10, 1, 2)) @ rotate(k, (4, 0, 3))) != pytest.approx(base, abs=1e-2)
    np.testing.assert_allclose(np.linalg.norm(rotate(q, (123, 4, 5))), np.linalg.norm(q), rtol=1e-6)


@pytest.mark.slow
def test_masked_attention_is_gqa_softmax_over_visible_keys():
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((2, 5, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, 7, 2, 8)), jnp.float32) for _ in range(2))
    mask = jnp.asarray(rng.random((2, 5, 7)) < 0.6).at[:, :, 0].set(True)
    out = masked_attention(q, k, v, mask)
    k_full, v_full = jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k_full) / np.sqrt(8)
    probs = jax.nn.softmax(jnp.where(mask[:, None], logits, -jnp.inf), axis=-1)
    np.testing.assert_allclose(out, jnp.einsum("bhqk,bkhd->bqhd", probs, v_full), atol=1e-5)
    hidden = k.at[:, 3].add(100.0)
    np.testing.assert_allclose(masked_attention(q, hidden, v, mask.at[:, :, 3].set(False)),
                               masked_attention(q, k, v, mask.at[:, :, 3].set(False)), atol=1e-6)
