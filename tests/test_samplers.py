"""The checkpoints' samplers (:mod:`arkv_jax.samplers`, :class:`arkv_jax.samplers.Sampler` presets):
the warped timesteps, the x0 update against a NumPy loop, the per-session noise draws, and the
paged rollout against full recompute under the distilled samplers (with eviction, CFG and
``context_noise``). CPU, tiny shape."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from arkv_jax import samplers
from arkv_jax.cache import PagedKVCache
from arkv_jax.models import MODEL_CONFIGS, init_random, prompt_embedding
from arkv_jax.planner import rollout_plan
from arkv_jax.presets import get_preset
from arkv_jax.reference import FullRecompute
from arkv_jax.rollout import Rollout
from arkv_jax.samplers import SAMPLERS, Sampler, chunk_noise

PRESET = get_preset("tiny")
CONFIG = MODEL_CONFIGS["tiny"]


def test_self_forcing_timesteps_are_wans_warp_of_its_list():
    sf = Sampler.self_forcing()
    np.testing.assert_allclose(sf.sigmas() * 1000, [1000, 937.5, 833.3333, 625, 0], atol=1e-3)
    assert (sf.num_steps, sf.update, sf.guidance_scale, sf.noise_draws) == (4, "x0", None, 4)
    assert SAMPLERS["longlive"]() == sf
    np.testing.assert_allclose(samplers.warp([1.0, 0.75, 0.5, 0.25], 5.0), [1, 0.9375, 0.833333, 0.625], atol=1e-6)


def test_causvid_timesteps_are_its_list_and_euler_is_the_default():
    cv = SAMPLERS["causvid"]()
    np.testing.assert_allclose(cv.sigmas() * 1000, [1000, 757, 522, 0], atol=1e-3)
    assert (cv.num_steps, cv.update) == (3, "x0")
    assert Sampler() == Sampler.euler() == SAMPLERS["euler"]() and Sampler().update == "euler"
    assert Sampler().noise_draws == 1 and Sampler.causvid(context_noise=20).noise_draws == 4


def test_sampler_refuses_bad_settings():
    with pytest.raises(ValueError, match="3 entries for num_steps=4"):
        Sampler(num_steps=4, timesteps=(1000, 750, 500))
    with pytest.raises(ValueError, match="strictly decreasing"):
        Sampler(num_steps=2, timesteps=(500, 750))
    with pytest.raises(ValueError, match="update"):
        Sampler(update="ddim")
    with pytest.raises(ValueError, match="context_noise"):
        Sampler(context_noise=-1)


def test_x0_update_matches_a_numpy_loop():
    sampler = Sampler.self_forcing()
    draws = np.random.default_rng(0).standard_normal((2, sampler.noise_draws, 3), np.float32)

    def velocity(x, sigma):  # any smooth function of (x, sigma)
        return jnp.sin(x) * (1.0 + sigma)

    got = np.asarray(samplers.sample(velocity, jnp.asarray(draws), sampler))
    sig = sampler.sigmas().astype(np.float64)
    x = draws[:, 0].astype(np.float64)
    for i in range(sampler.num_steps):
        x0 = x - sig[i] * np.sin(x) * (1.0 + sig[i])
        x = x0 if i == sampler.num_steps - 1 else (1 - sig[i + 1]) * x0 + sig[i + 1] * draws[:, i + 1]
    np.testing.assert_allclose(got, x, atol=1e-5)
    clean, t = samplers.commit_input(jnp.asarray(got), jnp.asarray(draws), Sampler.causvid(context_noise=100))
    assert t == 100.0
    np.testing.assert_allclose(np.asarray(clean), 0.9 * got + 0.1 * draws[:, -1], atol=1e-6)


def test_noise_draws_are_per_session_and_step_and_start_with_chunk_noise():
    draws = samplers.session_noise(7, 3, (2, 4), 3)
    np.testing.assert_array_equal(draws[0], chunk_noise(7, 3, (2, 4)))
    np.testing.assert_array_equal(draws, samplers.session_noise(7, 3, (2, 4), 3))
    assert not np.array_equal(draws[1], draws[2])
    assert not np.array_equal(draws[1], samplers.session_noise(8, 3, (2, 4), 3)[1])
    assert not np.array_equal(draws[1], samplers.session_noise(7, 4, (2, 4), 3)[1])


@pytest.fixture(scope="module")
def model():
    return init_random(CONFIG, seed=0)


@pytest.mark.slow
@pytest.mark.parametrize("sampler", [Sampler.self_forcing(), Sampler.causvid(guidance_scale=3.0, context_noise=100)],
                         ids=["self_forcing", "causvid_cfg_context_noise"])
def test_paged_rollout_equals_full_recompute_with_the_checkpoint_samplers(model, sampler):
    """Sessions at different frame indices in one batch, every one past the window (eviction),
    text-encoder contexts (CFG: an encoded negative prompt), fresh noise per step and the noised
    commit forward: the paged rollout equals the cacheless reference."""
    chunks, joins = 7, {0: ("a", "b"), 2: ("c",)}
    branches = PRESET.kv_branches[:sampler.num_branches]
    plan = rollout_plan(PRESET.geometry, PRESET.window, branches, PRESET.cross_attention, 3)
    cache = PagedKVCache(PRESET.geometry, PRESET.window, branches, PRESET.cross_attention, plan=plan, backend="xla")
    rollout = Rollout(model, cache, sampler, max_traces=1)
    rng = np.random.default_rng(3)
    contexts = {s: rng.standard_normal((4, CONFIG.text_dim), np.float32) for s in "abc"}
    negative = rng.standard_normal((2, CONFIG.text_dim), np.float32) if sampler.num_branches == 2 else None
    seeds = {"a": 1, "b": 2, "c": 3}
    for index in range(chunks):
        for sid in joins.get(index, ()):
            rollout.join(sid, seed=seeds[sid], context=contexts[sid], negative_context=negative)
        rollout.step()
    got = {sid: rollout.leave(sid) for sid in "abc"}
    assert len(got["c"]) == (chunks - 2) * PRESET.geometry.frames_per_forward > PRESET.window.resident_frames
    reference = FullRecompute(model, PRESET.window, sampler, chunk_frames=PRESET.geometry.frames_per_forward)
    expected = reference.rollout(None, [seeds[s] for s in "abc"], chunks, contexts=[contexts[s] for s in "abc"],
                                 negative_contexts=None if negative is None else [negative] * 3)
    for i, sid in enumerate("abc"):
        np.testing.assert_allclose(got[sid], expected[i, :len(got[sid])], atol=1e-5, rtol=0, err_msg=sid)
    assert np.abs(expected).max() > 1.0
    # The distilled sampler is not the Euler one: different latents from the same noise.
    euler = FullRecompute(model, PRESET.window, Sampler(guidance_scale=sampler.guidance_scale),
                          chunk_frames=PRESET.geometry.frames_per_forward)
    other = euler.rollout(None, [1], 1, contexts=[contexts["a"]],
                          negative_contexts=None if negative is None else [negative])
    assert np.abs(other[0] - expected[0, :len(other[0])]).max() > 1e-2


def test_prompt_embedding_context_is_the_stand_in():
    """The hash stand-in is one context among others: padding a prompt's word vectors gives it."""
    full = prompt_embedding("a red fox", CONFIG.text_tokens, CONFIG.text_dim)
    from arkv_jax.conditioning import pad_context
    np.testing.assert_array_equal(pad_context(full[:3], CONFIG.text_tokens, CONFIG.text_dim), full)
