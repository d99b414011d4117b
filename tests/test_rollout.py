"""The chunk loop through the paged cache against the full-recompute reference (CPU, tiny shape).

One scripted run per CFG setting (module fixture), asserted from several angles: sessions join at
different steps (so one batch holds sessions at different frame indices), one leaves mid-run and a
new one takes its place (reusing its pages), every session outlives the window (sink 2 + window 6
frames; 13 chunks of 2 frames), the chunk function is traced once per batch bucket used, the same
schedule on the cache's full batch gives the same latents, and the pure chunk function driven by
hand gives the full-batch run's bits. Conditioning by text-encoder contexts is checked against the
hash stand-in. The samplers' tests are in ``tests/test_samplers.py``, the demo's in
``tests/test_demo.py``.
"""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arkv_jax.cache import PagedKVCache
from arkv_jax.cache.batch import cross_attention_rows
from arkv_jax.conditioning import context_kv, text_branches
from arkv_jax.config import KVBranch
from arkv_jax.models import MODEL_CONFIGS, CausalDiT, init_random, prompt_embedding
from arkv_jax.nnx import PagedHistory
from arkv_jax.planner import rollout_plan
from arkv_jax.presets import get_preset
from arkv_jax.reference import FullRecompute
from arkv_jax.rollout import ChunkConfig, Rollout, generate_chunk, recache_kv
from arkv_jax.samplers import Sampler, chunk_noise
from arkv_jax.step import ChunkInputs
from pallas_kernels.layout import pool_shape

PRESET = get_preset("tiny")
CONFIG = MODEL_CONFIGS["tiny"]
CHUNKS = 13
PROMPTS = {"a": "a red fox in the snow", "b": "a city at night", "c": "waves on rocks", "d": "clouds"}
SEEDS = {"a": 11, "b": 12, "c": 13, "d": 14}
# step -> (sessions joining before the step, sessions leaving after it)
JOINS = {0: ("a", "b"), 3: ("c",), 9: ("d",)}
LEAVES = {8: ("b",)}


@pytest.fixture(scope="module")
def model():
    return init_random(CONFIG, seed=0)


def make_rollout(model, guidance, sessions=3, **kwargs):
    sampler = Sampler(num_steps=3, guidance_scale=guidance)
    branches = PRESET.kv_branches[:sampler.num_branches]
    plan = rollout_plan(PRESET.geometry, PRESET.window, branches, PRESET.cross_attention, sessions)
    cache = PagedKVCache(PRESET.geometry, PRESET.window, branches, PRESET.cross_attention, plan=plan,
                         backend="xla")
    return Rollout(model, cache, sampler, **kwargs)


@dataclasses.dataclass
class Run:
    rollout: Rollout
    latents: dict
    first_frames: list  # per step: {session: first frame}
    pages: list  # per step: {session: page ids held after the commit}
    free_after: int


def scripted_run(rollout):
    latents, first_frames, pages = {}, [], []
    for index in range(CHUNKS):
        for sid in JOINS.get(index, ()):
            rollout.join(sid, PROMPTS[sid], seed=SEEDS[sid])
        result = rollout.step()
        first_frames.append(dict(zip(result.session_ids, result.first_frames.tolist())))
        pages.append(rollout.pages_held())
        for sid in LEAVES.get(index, ()):
            latents[sid] = rollout.leave(sid)
    for sid in rollout.sessions:
        latents[sid] = rollout.leave(sid)
    return Run(rollout, latents, first_frames, pages, rollout.cache.num_free_pages())


@pytest.fixture(scope="module", params=[None, 3.0], ids=["no_cfg", "cfg"])
def run(request, model):
    """The schedule on live rows only (the default: batches bucketed to 1, 2, 3 sessions)."""
    return scripted_run(make_rollout(model, request.param, max_traces=1))


@pytest.fixture(scope="module")
def full_run(run, model):
    """The same schedule on the cache's full batch (every slot, every chunk)."""
    return scripted_run(make_rollout(model, run.rollout.sampler.guidance_scale, max_traces=1, full_batch=True))


@pytest.mark.slow
def test_paged_rollout_equals_full_recompute(run, model):
    reference = FullRecompute(model, PRESET.window, run.rollout.sampler,
                              chunk_frames=PRESET.geometry.frames_per_forward)
    ids = list(PROMPTS)
    expected = reference.rollout([PROMPTS[s] for s in ids], [SEEDS[s] for s in ids], CHUNKS)
    for i, sid in enumerate(ids):
        got = run.latents[sid]
        np.testing.assert_allclose(got, expected[i, :len(got)], atol=1e-5, rtol=0, err_msg=sid)
    assert np.abs(expected).max() > 1.0  # the comparison is not between near-zero tensors


@pytest.mark.slow
def test_schedule_exercises_window_eviction_and_ragged_batches(run):
    chunk = PRESET.geometry.frames_per_forward
    assert len(run.latents["a"]) == CHUNKS * chunk > 3 * PRESET.window.resident_frames
    assert [len(run.latents[s]) for s in "bcd"] == [9 * chunk, 10 * chunk, 4 * chunk]
    assert any(len(set(frames.values())) > 1 for frames in run.first_frames)


@pytest.mark.slow
def test_memory_is_bounded_and_pages_are_reused(run):
    branches = run.rollout.sampler.num_branches
    ppf = PRESET.geometry.pages_per_frame
    bound = PRESET.window.resident_frames * ppf * branches
    for frames, held in zip(run.first_frames, run.pages):
        for sid, first in frames.items():
            generated = first + PRESET.geometry.frames_per_forward
            assert len(held[sid]) == min(generated, PRESET.window.resident_frames) * ppf * branches
            assert len(held[sid]) <= bound
    owners = {}
    for held in run.pages:
        for sid, pages in held.items():
            for page in pages.tolist():
                owners.setdefault(page, set()).add(sid)
    assert max(len(s) for s in owners.values()) > 1  # the pool wrapped: evicted pages changed hands
    assert run.free_after == run.rollout.cache.plan.managed_num_blocks - 1  # everything returned


@pytest.mark.slow
def test_the_chunk_function_compiles_once_per_bucket_used(run, full_run):
    # Live sessions per step: 2 (a, b), 3 from step 3, 2 after b leaves at step 8, 3 from step 9.
    assert run.rollout.buckets == (1, 2, 3)
    assert run.rollout.traces_per_batch == {2: 1, 3: 1} and run.rollout.num_traces == 2
    assert full_run.rollout.traces_per_batch == {3: 1} and full_run.rollout.num_traces == 1


@pytest.mark.slow
def test_live_rows_only_equal_the_full_batch(run, full_run):
    assert run.latents.keys() == full_run.latents.keys()
    for sid, expected in full_run.latents.items():
        np.testing.assert_allclose(run.latents[sid], expected, atol=1e-6, rtol=0, err_msg=sid)
    assert run.first_frames == full_run.first_frames


def test_default_buckets_are_powers_of_two_up_to_max_sessions(model):
    from arkv_jax.cache.batch import default_buckets
    assert default_buckets(16) == (1, 2, 4, 8, 16) and default_buckets(6) == (1, 2, 4, 6)
    assert default_buckets(1) == (1,)
    rollout = make_rollout(model, None, sessions=3, buckets=(2, 3))
    assert rollout.bucket(1) == 2 and rollout.bucket(3) == 3
    with pytest.raises(ValueError, match="buckets"):
        make_rollout(model, None, sessions=3, buckets=(1, 2))


@pytest.mark.slow
def test_the_pure_chunk_function_driven_by_hand_gives_the_rollouts_latents(full_run, model):
    """:func:`generate_chunk` needs no :class:`Rollout`: the same schedule driven through the cache
    by hand, jitted once under ``chex.assert_max_traces``, gives the rollout's latents bit for bit."""
    run = full_run
    sampler, chunk = run.rollout.sampler, PRESET.geometry.frames_per_forward
    kv_branches = PRESET.kv_branches[:sampler.num_branches]
    branches = [b.name for b in kv_branches]
    plan = rollout_plan(PRESET.geometry, PRESET.window, kv_branches, PRESET.cross_attention, 3)
    cache = PagedKVCache(PRESET.geometry, PRESET.window, kv_branches, PRESET.cross_attention, plan=plan,
                         backend="xla")
    graphdef, params = nnx.split(model)
    config = ChunkConfig(graphdef, sampler, chunk, PRESET.geometry.tokens_per_frame, "xla")
    chex.clear_trace_counter()
    chunk_fn = jax.jit(chex.assert_max_traces(generate_chunk, n=1), static_argnames="config")
    shape = (chunk, *CONFIG.frame_shape)
    chunks, latents = {}, {}
    for index in range(CHUNKS):
        for sid in JOINS.get(index, ()):
            cache.open(sid)
            for branch, text in zip(branches, text_branches(PROMPTS[sid], len(branches))):
                context = prompt_embedding(text, CONFIG.text_tokens, CONFIG.text_dim)[None]
                k, v = context_kv(graphdef, params, jnp.asarray(context))
                cache.populate_cross_attention(sid, "text", branch, ((k[i, 0], v[i, 0]) for i in range(len(k))))
            chunks[sid] = []
        ids = cache.sessions
        noise = np.zeros((cache.session_capacity, *shape), np.float32)
        for sid in ids:
            noise[cache.slot(sid)] = chunk_noise(SEEDS[sid], len(chunks[sid]), shape)
        with cache.chunk(ids, chunk, branches, full_batch=True) as step:
            x, k_new, v_new = chunk_fn(params, cache.pools, step.inputs, cache.cross_attention_kv("text"), noise,
                                       config=config)
            step.commit(k_new, v_new)
        for sid in ids:
            chunks[sid].append(np.asarray(x)[cache.slot(sid)])
        for sid in LEAVES.get(index, ()):
            cache.close(sid)
            latents[sid] = np.concatenate(chunks.pop(sid))
    latents.update({sid: np.concatenate(c) for sid, c in chunks.items()})
    assert latents.keys() == run.latents.keys()
    for sid, expected in run.latents.items():
        np.testing.assert_array_equal(latents[sid], expected, err_msg=sid)


def _chunk_args(model, sessions, guidance):
    """A cache with ``sessions`` sessions, two chunks in, and the next chunk's :func:`generate_chunk`
    arguments (the full batch) and ``ChunkConfig``."""
    rollout = make_rollout(model, guidance, sessions=sessions, full_batch=True)
    for i, sid in enumerate(list(PROMPTS)[:sessions]):
        rollout.join(sid, PROMPTS[sid], seed=SEEDS[sid])
        if i == 0:
            rollout.step()  # the sessions stand at different frames
    rollout.step()
    cache = rollout.cache
    branches = list(rollout.branches)
    noise = np.random.default_rng(0).standard_normal(
        (cache.session_capacity, rollout.sampler.noise_draws, PRESET.geometry.frames_per_forward,
         *CONFIG.frame_shape)).astype(np.float32)
    with cache.chunk(cache.sessions, PRESET.geometry.frames_per_forward, branches, full_batch=True) as step:
        args = (rollout.params, cache.pools, step.inputs, cache.cross_attention_kv("text"), noise)
    return rollout.chunk_config, args


@pytest.mark.parametrize("guidance", [None, 3.0], ids=["no_cfg", "cfg"])
def test_rows_in_turn_gives_the_batched_chunk(model, guidance):
    """``ChunkConfig.rows_in_turn``: each forward run row by row gives the batched forward's
    latents and commit K/V (2 sessions; with CFG 4 rows)."""
    config, args = _chunk_args(model, 2, guidance)
    assert not config.rows_in_turn
    batched = jax.jit(generate_chunk, static_argnames="config")(*args, config=config)
    in_turn_config = dataclasses.replace(config, rows_in_turn=True)
    chex.clear_trace_counter()
    in_turn = jax.jit(chex.assert_max_traces(generate_chunk, n=1), static_argnames="config")
    got = in_turn(*args, config=in_turn_config)
    for name, a, b in zip(("latents", "k", "v"), got, batched):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0, err_msg=name)
    assert np.abs(np.asarray(batched[1])).max() > 0.1  # not near-zero tensors
    in_turn(*args, config=in_turn_config)  # no retrace
    # The recache forward (a prompt switch's) too.
    params, pools, inputs, text_table, _ = args
    text_kv = cross_attention_rows(text_table, inputs.rows, None)
    latents = jnp.asarray(batched[0], jnp.float32)
    kv, kv_in_turn = (recache_kv(params, pools, inputs, text_kv, latents, jnp.float32(0.0), config=c)
                      for c in (config, in_turn_config))
    for a, b in zip(kv_in_turn, kv):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)


def test_rows_in_turn_is_refused_with_a_mesh_and_resolved_by_default(model):
    from arkv_jax.sharding import make_mesh
    sampler = Sampler(num_steps=3)
    branches = PRESET.kv_branches[:1]
    plan = rollout_plan(PRESET.geometry, PRESET.window, branches, PRESET.cross_attention, 2)
    mesh = make_mesh(1, 1, jax.devices()[:1])
    cache = PagedKVCache(PRESET.geometry, PRESET.window, branches, PRESET.cross_attention, plan=plan,
                         backend="xla", mesh=mesh)
    with pytest.raises(ValueError, match="rows_in_turn=True needs one device"):
        Rollout(model, cache, sampler, rows_in_turn=True)
    assert not Rollout(model, cache, sampler).chunk_config.rows_in_turn
    with pytest.raises(TypeError, match="rows_in_turn"):
        make_rollout(model, None, rows_in_turn="yes")
    # Without a mesh the default follows the default backend (this suite runs on CPU).
    assert make_rollout(model, None).chunk_config.rows_in_turn == (jax.default_backend() == "tpu")
    assert make_rollout(model, None, rows_in_turn=True).chunk_config.rows_in_turn


def test_max_traces_guard_raises_and_leaves_the_cache_unchanged(model):
    rollout = make_rollout(model, None, sessions=2, max_traces=0)
    rollout.join("a", "x")
    free = rollout.cache.num_free_pages()
    with pytest.raises(RuntimeError, match="traced 1 times"):
        rollout.step()
    assert rollout.cache.num_free_pages() == free
    assert len(rollout.latents("a")) == 0


def test_join_and_step_refuse_bad_requests(model):
    rollout = make_rollout(model, 3.0, sessions=2)
    with pytest.raises(RuntimeError, match="no active session"):
        rollout.step()
    rollout.join("a", "x")
    with pytest.raises(ValueError, match="already open"):
        rollout.join("a", "y")
    with pytest.raises(ValueError, match="seed"):
        rollout.join("b", "y", seed=-1)
    rollout.join("b", "y")
    with pytest.raises(RuntimeError, match="max_sessions"):
        rollout.join("c", "z")
    with pytest.raises(KeyError, match="unknown session"):
        rollout.leave("c")
    single = PagedKVCache(PRESET.geometry, PRESET.window, (KVBranch("main"),), PRESET.cross_attention,
                          available_bytes=1 << 24, memory_fraction=1.0)
    with pytest.raises(ValueError, match="two KV branches"):
        Rollout(model, single, Sampler(guidance_scale=2.0))
    with pytest.raises(ValueError, match="tokens_per_frame=24 does not match the model's 25"):
        Rollout(init_random(dataclasses.replace(CONFIG, grid=(5, 5)), 0), single)


@pytest.mark.slow
def test_join_with_text_encoder_contexts_equals_join_with_the_prompt_of_that_embedding(model):
    """``context=`` / ``negative_context=`` are what the hash stand-in feeds: a prompt's word
    vectors (shorter than the text cache: zero-padded) and an encoded negative (here one zero
    token, the stand-in's empty prompt) give the stand-in's K/V and latents, bit for bit."""
    rollout = make_rollout(model, 3.0, sessions=2)
    prompt = "a red fox in the snow"
    words = len(prompt.split())
    embedding = prompt_embedding(prompt, CONFIG.text_tokens, CONFIG.text_dim)
    rollout.join("hashed", prompt, seed=5)
    rollout.join("encoded", seed=5, context=jnp.asarray(embedding[:words]),
                 negative_context=np.zeros((1, CONFIG.text_dim), np.float32))
    rows = rollout.cache.rows(["hashed", "encoded"])
    for table in rollout.cache.cross_attention_kv("text"):
        np.testing.assert_array_equal(np.asarray(table[rows[2:]]), np.asarray(table[rows[:2]]))
    for _ in range(2):
        rollout.step()
    assert len(rollout.latents("encoded")) == 4
    np.testing.assert_array_equal(rollout.latents("encoded"), rollout.latents("hashed"))
    # FullRecompute takes the same contexts.
    reference = FullRecompute(model, PRESET.window, rollout.sampler, chunk_frames=PRESET.geometry.frames_per_forward)
    for got, expected in zip(reference.text_kv(contexts=[embedding[:words]],
                                               negative_contexts=[np.zeros((1, CONFIG.text_dim))]),
                             reference.text_kv(["a red fox in the snow"])):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


def test_join_refuses_bad_contexts_and_changes_nothing(model):
    rollout = make_rollout(model, 3.0, sessions=2)
    t, d = CONFIG.text_tokens, CONFIG.text_dim
    ok = np.zeros((2, d), np.float32)
    cases = [
        (dict(context=np.zeros((t + 1, d)), negative_context=ok),
         r"8 tokens \(shape \(8, 32\)\); the model's text cache holds 7 \(shape \(7, 32\)\)"),
        (dict(context=np.zeros((3, d + 1)), negative_context=ok), r"\[tokens, text_dim\] = \[<= 7, 32\].*\(3, 33\)"),
        (dict(context=np.zeros((1, 3, d)), negative_context=ok), r"got shape \(1, 3, 32\)"),
        (dict(context=ok), "negative_context"),
        (dict(prompt="x", context=ok, negative_context=ok), "not both"),
        (dict(negative_context=ok), "needs context"),
        (dict(), "pass a prompt"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            rollout.join("a", **kwargs)
        assert rollout.sessions == () and rollout.cache.sessions == ()
    single = make_rollout(model, None, sessions=1)
    with pytest.raises(ValueError, match="no guidance"):
        single.join("a", context=ok, negative_context=ok)


def test_noise_depends_only_on_session_seed_and_chunk():
    a = chunk_noise(7, 3, (2, 4))
    np.testing.assert_array_equal(a, chunk_noise(7, 3, (2, 4)))
    assert not np.array_equal(a, chunk_noise(7, 4, (2, 4)))
    assert not np.array_equal(a, chunk_noise(8, 3, (2, 4)))


def test_sampler_schedule_is_wans_shifted_flow_matching():
    sigmas = Sampler(num_steps=4, shift=5.0).sigmas()
    np.testing.assert_allclose(sigmas * 1000, [1000, 937.5, 833.333, 625, 0], atol=1e-3)


def test_wan_1_3b_shapes_trace(model):
    """The DiT at Wan-2.1-1.3B's shape (abstract: nothing is allocated): 1.4 B parameters, and a
    commit forward of one 3-frame chunk returns the 30 layers' K/V in the cache's layout."""
    wan = MODEL_CONFIGS["wan-1.3b"]
    preset = get_preset("wan-1.3b")
    abstract = nnx.eval_shape(lambda: CausalDiT(wan, rngs=nnx.Rngs(0)))
    assert 1.3e9 < sum(x.size for x in jax.tree.leaves(nnx.state(abstract))) < 1.5e9
    geo, frames = preset.geometry, preset.geometry.frames_per_forward
    wan.check_cache(geo, preset.cross_attention[0])
    visible = preset.window.resident_frames * geo.pages_per_frame
    spec = jax.ShapeDtypeStruct
    pool = spec(pool_shape(geo.num_layers, 64, geo.block_size, geo.num_kv_heads, geo.head_dim), jnp.bfloat16)
    inputs = ChunkInputs(spec((1,), jnp.int32), spec((1, visible), jnp.int32), spec((1,), jnp.int32),
                         spec((1, preset.window.resident_frames), jnp.int32), spec((1,), jnp.int32),
                         spec((1, frames * geo.pages_per_frame), jnp.int32))
    text = spec((geo.num_layers, 1, wan.text_tokens, geo.num_kv_heads, geo.head_dim), jnp.bfloat16)

    def forward(model, pools, inputs, text_k, text_v, commit):
        history = PagedHistory.from_inputs(pools, inputs, geo.tokens_per_frame, "xla")
        latents = jnp.zeros((1, frames, *wan.frame_shape), jnp.bfloat16)
        return (model.commit_kv if commit else model)(latents, jnp.zeros((1, frames)), inputs.first_frame, history,
                                                       text_k, text_v)

    velocity = jax.eval_shape(functools.partial(forward, commit=False), abstract, (pool, pool), inputs, text, text)
    assert velocity.shape == (1, frames, 60, 104, 16)
    k, v = jax.eval_shape(functools.partial(forward, commit=True), abstract, (pool, pool), inputs, text, text)
    kv_shape = (geo.num_layers, 1, frames * geo.tokens_per_frame, geo.num_kv_heads, geo.head_dim)
    assert k.shape == v.shape == kv_shape
    # The whole chunk (3 denoise steps + the commit forward) traces at this shape too.
    graphdef, params = nnx.split(abstract)
    config = ChunkConfig(graphdef, Sampler(num_steps=3), frames, geo.tokens_per_frame, "xla")
    noise = spec((1, frames, *wan.frame_shape), jnp.float32)
    table = spec((1, geo.num_layers, wan.text_tokens, geo.num_kv_heads, geo.head_dim), jnp.bfloat16)
    latents, k, v = jax.eval_shape(functools.partial(generate_chunk, config=config), params, (pool, pool),
                                   inputs, (table, table), noise)
    assert latents.shape == (1, frames, 60, 104, 16) and latents.dtype == jnp.bfloat16
    assert k.shape == v.shape == kv_shape


def test_a_join_that_fails_after_opening_leaves_nothing_open(model, monkeypatch):
    rollout = make_rollout(model, None)
    free = rollout.cache.num_free_pages()

    def refuse(*args, **kwargs):
        raise RuntimeError("text K/V refused")

    with monkeypatch.context() as patch:
        patch.setattr(rollout.cache, "populate_cross_attention", refuse)
        with pytest.raises(RuntimeError, match="text K/V refused"):
            rollout.join("fox", "a red fox", seed=0)
    assert rollout.sessions == () and rollout.cache.sessions == () and rollout.cache.num_free_pages() == free
    rollout.join("fox", "a red fox", seed=0)  # the id is joinable again
    assert rollout.sessions == ("fox",)
