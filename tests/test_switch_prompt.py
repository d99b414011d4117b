"""Prompt switching with KV recache (``Rollout.switch_prompt`` over ``PagedKVCache.recache``), CPU, tiny shape.

The paged rollout with two switches of one session (first keeping the sink's K/V, then recomputing
them) against the full-recompute reference driven with the switch semantics stated in
:mod:`arkv_jax.cache.recache` (the forgotten frames masked out, the kept sink's K/V pinned); the
other session is untouched; no page leaks; a failed or refused recache changes nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arkv_jax import samplers, sharding
from arkv_jax.cache import PagedKVCache
from arkv_jax.models import MODEL_CONFIGS, init_random
from arkv_jax.planner import rollout_plan
from arkv_jax.presets import get_preset
from arkv_jax.reference import FullRecompute
from arkv_jax.rollout import Rollout, Sampler

PRESET = get_preset("tiny")
CONFIG = MODEL_CONFIGS["tiny"]
F = PRESET.geometry.frames_per_forward
FRAME_BYTES = int(np.prod(CONFIG.frame_shape)) * 4
CHUNKS = 10
# chunk index -> (new prompt of session "a" before that chunk, sink mode)
SWITCHES = {5: ("a cat on a sofa", "keep"), 8: ("a dog in the rain", "recompute")}
PROMPTS, SEEDS = {"a": "a red fox in the snow", "b": "a city at night"}, {"a": 11, "b": 12}


@pytest.fixture(scope="module")
def model():
    return init_random(CONFIG, seed=0)


def make_rollout(model, guidance, sessions=2, latent_frame_bytes=FRAME_BYTES):
    sampler = Sampler(num_steps=2, guidance_scale=guidance)
    branches = PRESET.kv_branches[:sampler.num_branches]
    plan = rollout_plan(PRESET.geometry, PRESET.window, branches, PRESET.cross_attention, sessions,
                        latent_frame_bytes=latent_frame_bytes)
    cache = PagedKVCache(PRESET.geometry, PRESET.window, branches, PRESET.cross_attention, plan=plan,
                         backend="xla")
    return Rollout(model, cache, sampler)


def reference_with_switches(model, sampler, prompt, seed, switches):
    """One session's latents from the full recompute, with each switch applied as the recache
    defines it: frames the next chunk would not see are forgotten, the text changes, and a kept
    sink keeps the K/V its commit forwards computed under the prompt of that time."""
    reference = FullRecompute(model, PRESET.window, sampler, chunk_frames=F)
    shape, draws = (F, *CONFIG.frame_shape), sampler.noise_draws
    total = CHUNKS * F
    clean = jnp.zeros((1, total, *CONFIG.frame_shape), jnp.float32)
    history = clean  # what the commit forwards saw (noised with context_noise)
    visible, pinned = np.ones(total, bool), None
    text = reference.text_kv([prompt])
    for c in range(CHUNKS):
        if c in switches:
            new_prompt, sink = switches[c]
            start = c * F
            frames = np.arange(total)
            visible = visible & ((frames >= start) | PRESET.window.frame_visible(frames, start, F))
            if sink == "keep" and pinned is None:
                pinned = reference.commit_kv(history, PRESET.window.sink_frames, text)
            elif sink == "recompute":
                pinned = None
            text = reference.text_kv([new_prompt])
        noise = jnp.asarray(samplers.session_noise(seed, c, shape, draws)[None])
        x = reference.chunk(history, c * F, noise, text, visible=visible, pinned=pinned)
        clean = clean.at[:, c * F:(c + 1) * F].set(x)
        history = history.at[:, c * F:(c + 1) * F].set(samplers.commit_input(x, noise, sampler)[0])
    return np.asarray(clean[0])


@pytest.fixture(scope="module", params=[None, 3.0], ids=["no_cfg", "cfg"])
def switched(request, model):
    rollout = make_rollout(model, request.param)
    free = rollout.cache.num_free_pages()
    for sid in PROMPTS:
        rollout.join(sid, PROMPTS[sid], seed=SEEDS[sid])
    recomputed = {}
    for c in range(CHUNKS):
        if c in SWITCHES:
            prompt, sink = SWITCHES[c]
            recomputed[c] = rollout.switch_prompt("a", prompt, sink=sink)
            assert rollout.cache.num_free_pages() + sum(map(len, rollout.pages_held().values())) == free
        rollout.step()
    latents = {sid: rollout.leave(sid) for sid in PROMPTS}
    return rollout, latents, recomputed, free


@pytest.mark.slow
def test_switched_rollout_equals_full_recompute_with_the_switches(switched, model):
    rollout, latents, _, _ = switched
    expected = reference_with_switches(model, rollout.sampler, PROMPTS["a"], SEEDS["a"], SWITCHES)
    np.testing.assert_allclose(latents["a"], expected, atol=2e-5, rtol=0)
    unswitched = reference_with_switches(model, rollout.sampler, PROMPTS["a"], SEEDS["a"], {})
    np.testing.assert_allclose(latents["a"][:5 * F], unswitched[:5 * F], atol=2e-5, rtol=0)
    assert np.abs(latents["a"][5 * F:] - unswitched[5 * F:]).max() > 0.1  # the switches changed the video


@pytest.mark.slow
def test_only_the_switched_session_changes(switched, model):
    rollout, latents, _, _ = switched
    expected = reference_with_switches(model, rollout.sampler, PROMPTS["b"], SEEDS["b"], {})
    np.testing.assert_allclose(latents["b"], expected, atol=2e-5, rtol=0)


@pytest.mark.slow
def test_recomputed_frames_and_no_leak(switched):
    rollout, _, recomputed, free = switched
    window = PRESET.window
    # At frame 10, keeping the sink: the recent frames the next chunk sees; at 16, the sink too.
    assert recomputed[5] == tuple(range(10 - (window.max_history(F) - window.sink_frames), 10))
    assert recomputed[8] == (*range(window.sink_frames), *range(16 - 4, 16))
    assert rollout.cache.num_free_pages() == free and not rollout.sessions


@pytest.mark.slow
def test_switch_with_context_noise_recomputes_from_the_noised_commit_inputs(model):
    """With ``context_noise`` the commit forward sees the clean latents noised with the chunk's last
    draw; the recache rebuilds that input from the session's seed."""
    sampler = Sampler.self_forcing(context_noise=100.0)
    cache = PagedKVCache(PRESET.geometry, PRESET.window, PRESET.kv_branches[:1], PRESET.cross_attention,
                         plan=rollout_plan(PRESET.geometry, PRESET.window, PRESET.kv_branches[:1],
                                           PRESET.cross_attention, 1, latent_frame_bytes=FRAME_BYTES),
                         backend="xla")
    rollout = Rollout(model, cache, sampler)
    rollout.join("a", PROMPTS["a"], seed=SEEDS["a"])
    switches = {4: ("a cat on a sofa", "keep"), 7: ("a dog in the rain", "recompute")}
    for c in range(CHUNKS):
        if c in switches:
            rollout.switch_prompt("a", switches[c][0], sink=switches[c][1])
        rollout.step()
    expected = reference_with_switches(model, sampler, PROMPTS["a"], SEEDS["a"], switches)
    np.testing.assert_allclose(rollout.latents("a"), expected, atol=2e-5, rtol=0)


@pytest.mark.slow
def test_switch_without_the_fresh_pages_is_refused_and_changes_nothing(model):
    rollout = make_rollout(model, None, sessions=1, latent_frame_bytes=None)
    rollout.join("a", PROMPTS["a"], seed=1)
    for _ in range(5):
        rollout.step()
    held, free = rollout.pages_held(), rollout.cache.num_free_pages()
    text = [np.asarray(x) for x in rollout.cache.cross_attention_kv("text")]
    with pytest.raises(RuntimeError, match="free pages"):
        rollout.switch_prompt("a", "a cat", sink="recompute")
    assert rollout.cache.num_free_pages() == free
    np.testing.assert_array_equal(rollout.pages_held()["a"], held["a"])
    for before, after in zip(text, rollout.cache.cross_attention_kv("text")):
        np.testing.assert_array_equal(before, np.asarray(after))
    rollout.step()  # the session goes on


@pytest.mark.slow
def test_a_failing_recache_forward_leaves_the_old_history(model):
    rollout = make_rollout(model, None)
    twin = make_rollout(model, None)
    for r in (rollout, twin):
        r.join("a", PROMPTS["a"], seed=1)
        for _ in range(4):
            r.step()
    held, free = rollout.pages_held(), rollout.cache.num_free_pages()
    calls = []

    def failing(*args):
        calls.append(1)
        if len(calls) == 2:
            raise FloatingPointError("forward failed")
        return forward(*args)

    forward, rollout.recache_fn = rollout.recache_fn, failing
    with pytest.raises(FloatingPointError):
        rollout.switch_prompt("a", "a cat")
    rollout.recache_fn = forward
    assert len(calls) == 2 and rollout.cache.num_free_pages() == free
    np.testing.assert_array_equal(rollout.pages_held()["a"], held["a"])
    np.testing.assert_allclose(rollout.step().latents, twin.step().latents, atol=1e-6, rtol=0)


def test_cache_recache_protocol_and_refusals(model):
    rollout = make_rollout(model, None)
    cache = rollout.cache
    rollout.join("a", PROMPTS["a"], seed=1)
    for _ in range(3):
        rollout.step()
    for kwargs, error in [(dict(sink="bogus"), ValueError), (dict(chunk_frames=0), ValueError),
                          (dict(chunk_frames="2"), TypeError), (dict(chunk_frames=4), ValueError),
                          (dict(branches=["main", "main"]), ValueError), (dict(branches=["nope"]), KeyError)]:
        with pytest.raises(error):
            with cache.recache("a", **kwargs):
                pass
    with pytest.raises(KeyError):
        with cache.recache("nobody"):
            pass
    held = cache.pages_held(["a"])["a"]
    with cache.recache("a") as job:
        assert job.frames == (2, 3, 4, 5) and [u.first_frame for u in job.units] == [2, 4]
        with pytest.raises(RuntimeError, match="cannot start a chunk while a recache is in flight"):
            with cache.chunk(["a"], F):
                pass
        with pytest.raises(RuntimeError, match="cannot close a session while a recache is in flight"):
            cache.close("a")
        with pytest.raises(RuntimeError, match="units are written"):
            job.commit()
        with pytest.raises(ValueError, match="k_new must have shape"):
            job.write(np.zeros((1,)), np.zeros((1,)))
    # Left without a commit: nothing changed, and the job is dead.
    np.testing.assert_array_equal(cache.pages_held(["a"])["a"], held)
    with pytest.raises(RuntimeError, match="this recache is not in flight"):
        job.commit()
    rollout.step()


#: Sessions of the mesh test, and step -> (session, sink) of each prompt switch, made before that
#: step (``f"new {step}"``); the two-process test (tests/multiprocess_worker.py) runs them too.
MESH_SESSIONS = ("a", "b", "c")
MESH_SWITCHES = {4: ("c", "keep"), 6: ("a", "recompute")}
MESH_STEPS = 7


def mesh_rollout(model, mesh):
    """A CFG rollout with room for a recache: 4 sessions on one device, 2 per data shard on a mesh."""
    sampler = Sampler(num_steps=2, guidance_scale=3.0)
    model_axis = 1 if mesh is None else mesh.shape["model"]
    sessions = 4 if mesh is None else 2  # per data shard
    plan = rollout_plan(PRESET.geometry, PRESET.window, PRESET.kv_branches, PRESET.cross_attention, sessions,
                        model=model_axis, latent_frame_bytes=FRAME_BYTES)
    cache = PagedKVCache(PRESET.geometry, PRESET.window, PRESET.kv_branches, PRESET.cross_attention,
                         plan=plan, mesh=mesh, backend="xla")
    return Rollout(model, cache, sampler)


def run_mesh_switches(rollout):
    """:data:`MESH_SESSIONS` join, :data:`MESH_SWITCHES` switch, every session leaves after
    :data:`MESH_STEPS` chunks; returns their latents."""
    for sid in MESH_SESSIONS:
        rollout.join(sid, f"prompt {sid}", seed=ord(sid))
    for c in range(MESH_STEPS):
        if c in MESH_SWITCHES:
            sid, sink = MESH_SWITCHES[c]
            rollout.switch_prompt(sid, f"new {c}", sink=sink)
        rollout.step()
    return {sid: rollout.leave(sid) for sid in MESH_SESSIONS}


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (tests/conftest.py sets jax_num_cpu_devices)")
def test_switch_on_a_mesh_matches_one_device(model):
    """Sessions on two data shards, heads on two model shards: the switches run full batches and
    give the one-device latents."""
    single = run_mesh_switches(mesh_rollout(model, None))
    rollout = mesh_rollout(model, sharding.make_mesh(2, 2, jax.devices()[:4]))
    sharded, cache = run_mesh_switches(rollout), rollout.cache
    assert cache.num_shards == 2 and cache.num_free_pages() == cache.total_pages
    for sid, expected in single.items():
        np.testing.assert_allclose(sharded[sid], expected, atol=1e-5, rtol=0, err_msg=sid)
