"""The cache facade and the rollout on a mesh of 8 CPU devices (``arkv-jax demo --devices``:
``tests/test_demo.py``).

Every sharded run is compared with the same run on one device: pool contents bit for bit,
attention and generated latents to 1e-5 (fp32), and bit for bit where each device runs the same
batch shape as the single device. ``tests/conftest.py`` sets 8 host devices before JAX starts.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from arkv_jax import sharding as sh
from arkv_jax.cache import PagedKVCache
from arkv_jax.config import CacheGeometry, CrossAttentionSpec, KVBranch, WindowPolicy, ceil_div
from arkv_jax.models import MODEL_CONFIGS, init_random
from arkv_jax.models.dit import tensor_parallel_specs
from arkv_jax.nnx import PagedHistory
from arkv_jax.planner import DevicePlan, plan_per_device, rollout_plan
from arkv_jax.presets import get_preset
from arkv_jax.rollout import Rollout, Sampler
from pallas_kernels.layout import LAYER_AXIS, layer_pages, page_mask, pool_geometry

NUM_DEVICES = 8
pytestmark = pytest.mark.skipif(
    jax.device_count() < NUM_DEVICES,
    reason=f"needs {NUM_DEVICES} devices (tests/conftest.py sets jax_num_cpu_devices)")

# 8 KV heads, 16 query heads: every (data, model) mesh of 8 devices divides them.
GEOMETRY = CacheGeometry(num_layers=2, num_kv_heads=8, head_dim=8, dtype="float32", tokens_per_frame=6,
                         block_size=4, frames_per_forward=2)
WINDOW = WindowPolicy(window_frames=3, sink_frames=1)
CFG = (KVBranch("positive", 0), KVBranch("negative", 1))
TEXT = (CrossAttentionSpec("text", 5),)
Q_HEADS = 16


def mesh_of(data, model):
    return sh.make_mesh(data, model, jax.devices()[:data * model])


def make_cache(mesh=None, sessions_per_shard=2):
    model = 1 if mesh is None else mesh.shape["model"]
    plan = rollout_plan(GEOMETRY, WINDOW, CFG, TEXT, sessions_per_shard, model=model)
    return PagedKVCache(GEOMETRY, WINDOW, CFG, TEXT, plan=plan, mesh=mesh, backend="xla")


def session_kv(sid: str, chunk: int):
    """Deterministic K/V ``[L, branches, F * tpf, Hkv, D]`` of one session's chunk."""
    shape = (GEOMETRY.num_layers, len(CFG), GEOMETRY.frames_per_forward * GEOMETRY.tokens_per_frame,
             GEOMETRY.num_kv_heads, GEOMETRY.head_dim)
    k = np.random.default_rng((ord(sid), chunk)).standard_normal(shape, np.float32)
    return k, -k


def batch_kv(step, chunks):
    """The batch's K/V: each session's :func:`session_kv` at its rows, zeros at padding rows."""
    shape = (GEOMETRY.num_layers, len(step.session_ids), GEOMETRY.frames_per_forward * GEOMETRY.tokens_per_frame,
             GEOMETRY.num_kv_heads, GEOMETRY.head_dim)
    k, v = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
    for sid in dict.fromkeys(s for s in step.session_ids if s is not None):
        rows = [i for i, s in enumerate(step.session_ids) if s == sid]
        k[:, rows], v[:, rows] = session_kv(sid, chunks[sid])
    return jnp.asarray(k), jnp.asarray(v)


def visible_history(cache, step, sid):
    """Per branch of ``sid``: its visible history K ``[L, tokens, Hkv, D]`` read from the pool
    through the chunk's page list (local page ids mapped to pool pages of the row's shard)."""
    k_pool = np.asarray(cache.pools[0])
    rows = [i for i, s in enumerate(step.session_ids) if s == sid]
    per_shard = len(step.session_ids) // cache.num_shards
    ppf, tpf = GEOMETRY.pages_per_frame, GEOMETRY.tokens_per_frame
    out = []
    for b in rows:
        pages = np.asarray(step.inputs.pages[b]) + (b // per_shard) * cache.pages_per_shard
        frames = int(step.inputs.lengths[b]) // tpf
        tokens = [token_major_pages(k_pool, pages[f * ppf:(f + 1) * ppf]).reshape(
            GEOMETRY.num_layers, -1, GEOMETRY.num_kv_heads, GEOMETRY.head_dim)[:, :tpf] for f in range(frames)]
        out.append(np.concatenate(tokens, axis=1) if tokens else np.zeros((0,)))
    return out


def token_major_pages(pool, pages):
    """``[layers, len(pages), block_size, H, D]``: pages of every layer, token-major."""
    return np.stack([np.asarray(layer_pages(jnp.asarray(pool), layer, jnp.asarray(pages)))
                     for layer in range(pool.shape[LAYER_AXIS])])


def attention(cache, step, chunks):
    """Window attention of every batch row over its history and its chunk, as a model runs it."""
    k, v = batch_kv(step, chunks)
    rows, tokens = k.shape[1], k.shape[2]
    q = jnp.tile(k[0], (1, 1, Q_HEADS // GEOMETRY.num_kv_heads, 1)) * 0.5
    history = PagedHistory.from_inputs(cache.pools, step.inputs, GEOMETRY.tokens_per_frame, "xla", mesh=cache.mesh)
    assert q.shape == (rows, tokens, Q_HEADS, GEOMETRY.head_dim)
    return np.asarray(jax.jit(lambda h, q, k, v: h.attend(q, k, v, 1))(history, q, k[1], v[1]))


# step -> (joining, leaving after the step)
SCRIPT = {0: (("a", "b", "c"), ()), 2: (("d",), ("b",)), 4: (("e",), ("a",)), 6: ((), ())}
STEPS = 8


def run_script(cache):
    """Runs :data:`SCRIPT`; returns, per step and session, the visible history of each branch, the
    first frame and the attention output of the session's rows."""
    chunks, records, active = {}, [], []
    for index in range(STEPS):
        joining, leaving = SCRIPT.get(index, ((), ()))
        for sid in joining:
            cache.open(sid)
            chunks[sid] = 0
            active.append(sid)
        with cache.chunk(active, GEOMETRY.frames_per_forward) as step:
            out = attention(cache, step, chunks)
            record = {}
            for sid in active:
                rows = [i for i, s in enumerate(step.session_ids) if s == sid]
                record[sid] = (visible_history(cache, step, sid), np.asarray(step.inputs.first_frame)[rows],
                               out[rows])
            step.commit(*batch_kv(step, chunks))
        records.append(record)
        for sid in active:
            chunks[sid] += 1
        for sid in leaving:
            cache.close(sid)
            active.remove(sid)
    return records


@pytest.fixture(scope="module")
def single_device_run():
    return run_script(make_cache(None, sessions_per_shard=4))


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(1, 8), (2, 4), (4, 2), (8, 1)], ids=lambda s: f"data{s[0]}_model{s[1]}")
def test_sharded_cache_matches_one_device(shape, single_device_run):
    mesh = mesh_of(*shape)
    cache = make_cache(mesh, sessions_per_shard=ceil_div(4, shape[0]))
    sharded_run = run_script(cache)
    for step, (expected, got) in enumerate(zip(single_device_run, sharded_run)):
        assert expected.keys() == got.keys()
        for sid in expected:
            (hist_1, first_1, out_1), (hist_n, first_n, out_n) = expected[sid], got[sid]
            np.testing.assert_array_equal(first_1, first_n)
            for a, b in zip(hist_1, hist_n):
                np.testing.assert_array_equal(a, b)  # same bytes in the pages each row reads
            np.testing.assert_allclose(out_n, out_1, atol=1e-5, err_msg=f"step {step} session {sid}")
    assert cache.num_free_pages() == cache.num_shards * (cache.pages_per_shard - 1) - sum(
        len(p) for p in cache.pages_held(cache.sessions).values())


@pytest.mark.slow
def test_sessions_spread_over_shards_and_stay_in_their_slice():
    mesh = mesh_of(4, 2)
    cache = make_cache(mesh, sessions_per_shard=2)
    for sid in "abcdef":
        cache.open(sid)
    shards = [cache.slot(sid) // cache.slots_per_shard for sid in "abcdef"]
    assert shards == [0, 1, 2, 3, 0, 1]  # the least loaded shard first
    with cache.chunk(list("abcdef"), 2) as step:
        assert len(step.session_ids) == cache.session_capacity * len(CFG)  # the full batch
        assert step.session_ids.count(None) == 2 * len(CFG)
        padding = np.asarray([s is None for s in step.session_ids])
        assert np.all(np.asarray(step.inputs.rows)[padding] == -1)
        assert np.all(np.asarray(step.inputs.write_pages)[padding] == 0)
        step.commit(*batch_kv(step, dict.fromkeys("abcdef", 0)))
    for sid, pages in cache.pages_held(list("abcdef")).items():
        shard = cache.slot(sid) // cache.slots_per_shard
        assert np.all(pages // cache.pages_per_shard == shard) and np.all(pages % cache.pages_per_shard > 0)
    k_pool = cache.pools[0]
    assert k_pool.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, sh.pool_spec()), k_pool.ndim)


@pytest.mark.slow
def test_sharded_lifecycle_lru_reset_and_cross_attention():
    released = []
    mesh = mesh_of(2, 4)
    plan = rollout_plan(GEOMETRY, WINDOW, CFG, TEXT, 2, model=4)
    cache = PagedKVCache(GEOMETRY, WINDOW, CFG, TEXT, plan=plan, mesh=mesh, backend="xla",
                         on_release=lambda sid, reason: released.append((sid, reason)))
    text = np.random.default_rng(0).standard_normal((GEOMETRY.num_layers, 5, 8, 8), np.float32)
    for sid in "abcd":
        cache.open(sid)
        cache.populate_cross_attention(sid, "text", "positive", [(jnp.asarray(t), jnp.asarray(-t)) for t in text])
    chunks = dict.fromkeys("abcd", 0)
    with cache.chunk(list("abcd"), 2) as step:
        step.commit(*batch_kv(step, chunks))
    slot_a = cache.slot("a")
    cache.open("e")  # at capacity: "a", the least recently used, is evicted and "e" takes its slot
    assert released == [("a", "lru_eviction")] and cache.slot("e") == slot_a
    assert "a" not in cache.sessions and len(cache.pages_held(["e"])["e"]) == 0
    k_text, _ = cache.cross_attention_kv("text")
    rows = cache.rows(["e"])
    assert not np.asarray(k_text)[rows].any()  # a's text rows were zeroed on release
    cache.reset("b", keep_cross_attention=("text",))
    assert released[-1] == ("b", "reset") and len(cache.pages_held(["b"])["b"]) == 0
    with cache.chunk(["b", "e"], 2) as step:
        b_rows = [i for i, s in enumerate(step.session_ids) if s == "b"]
        assert np.asarray(step.inputs.first_frame)[b_rows].tolist() == [0, 0]
        text_k, _ = cache.cross_attention_rows(cache.cross_attention_kv("text"), step.inputs)
        b_row = step.session_ids.index("b")  # positive branch first
        np.testing.assert_array_equal(np.asarray(text_k)[:, b_row], text)  # kept across the reset
        assert not np.asarray(text_k)[:, step.session_ids.index("e")].any()
        step.commit(*batch_kv(step, {"b": 0, "e": 0}))
    assert cache.num_free_pages() == cache.num_shards * (cache.pages_per_shard - 1) - sum(
        len(p) for p in cache.pages_held(cache.sessions).values())


def test_the_cache_steps_compile_without_collectives():
    """The facade's own jitted prepare and write + commit, on a (2, 4) mesh: no device talks to
    another (rows, pages and free lists are per data shard; heads are independent)."""
    from arkv_jax.cache import programs

    mesh = mesh_of(2, 4)
    cache = make_cache(mesh, sessions_per_shard=2)
    for sid in "abc":
        cache.open(sid)
    with cache.chunk(list("abc"), 2) as step:
        k, v = batch_kv(step, dict.fromkeys("abc", 0))
        local_rows = np.asarray(step.inputs.rows).reshape(cache.num_shards, -1)
        programs = {
            "prepare": programs.prepare.lower(cache.state, local_rows, num_frames=2, mesh=cache.mesh),
            "commit": programs.commit.lower(*cache.pools, step.pending, k, v, step.inputs, num_frames=2,
                                            backend="xla", mesh=cache.mesh),
        }
        for name, lowered in programs.items():
            hlo = lowered.compile().as_text()
            for op in ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter"):
                assert not re.search(rf"\b{op}\b", hlo), f"{op} in the cache's {name} step"
        step.commit(k, v)


@pytest.mark.slow
def test_free_and_foreign_pages_never_reach_a_sharded_output():
    """Every page no row of the batch holds is NaN; outputs stay finite and equal the clean run."""
    mesh = mesh_of(4, 2)
    cache = make_cache(mesh, sessions_per_shard=2)
    chunks = {}
    for sid in "abcd":
        cache.open(sid)
        chunks[sid] = 0
    for _ in range(4):
        with cache.chunk(list("abcd"), 2) as step:
            step.commit(*batch_kv(step, chunks))
        chunks = {s: c + 1 for s, c in chunks.items()}
    cache.close("b")
    with cache.chunk(["a", "c"], 2) as step:
        clean = attention(cache, step, chunks)
        held = np.concatenate(list(cache.pages_held(["a", "c"]).values()))
        poison = ~np.isin(np.arange(pool_geometry(cache.pools[0]).num_pages), held)
        k_pool, v_pool = (jnp.where(page_mask(poison), jnp.nan, p) for p in cache.pools)
        cache._core.k_pool, cache._core.v_pool = sh.place(mesh, (k_pool, v_pool), (sh.pool_spec(), sh.pool_spec()))
        poisoned = attention(cache, step, chunks)
        rows = [i for i, s in enumerate(step.session_ids) if s is not None]
        assert np.all(np.isfinite(poisoned))
        np.testing.assert_array_equal(poisoned[rows], clean[rows])
        step.commit(*batch_kv(step, chunks))


@pytest.mark.slow
def test_sharded_cache_refusals_change_nothing():
    mesh = mesh_of(2, 4)
    plan = rollout_plan(GEOMETRY, WINDOW, CFG, TEXT, 1, model=4)
    cache = PagedKVCache(GEOMETRY, WINDOW, CFG, TEXT, plan=plan, mesh=mesh, backend="xla")
    for sid in "ab":
        cache.open(sid)
    with pytest.raises(ValueError, match="full batches only"):
        with cache.chunk(["a"], 2, full_batch=False):
            pass
    chunks = {"a": 0, "b": 0}
    for _ in range(3):  # fill the window: 4 frames resident per row, room for 2 more in the plan
        with cache.chunk(["a", "b"], 2) as step:
            step.commit(*batch_kv(step, chunks))
        chunks = {s: c + 1 for s, c in chunks.items()}
    state = jax.tree.map(np.asarray, cache.state)
    with pytest.raises(ValueError, match=r"num_frames must be an int in \[1, 2\]"):  # 3 never fit the tight plan
        with cache.chunk(["a", "b"], 3):
            pass
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, cache.state), state)
    with pytest.raises(ValueError, match="mesh axis 'model' must be a positive int, got 0"):
        DevicePlan.from_plan(plan, 2, 0)
    with pytest.raises(ValueError, match="plan is for a \\(data=1, model=1\\) mesh"):
        PagedKVCache(GEOMETRY, WINDOW, CFG, TEXT, plan=DevicePlan.from_plan(plan, 1, 1), mesh=mesh)
    with pytest.raises(ValueError, match="plan one device"):
        PagedKVCache(GEOMETRY, WINDOW, CFG, TEXT, plan=rollout_plan(GEOMETRY, WINDOW, CFG, TEXT, 1), mesh=mesh)
    with pytest.raises(ValueError, match="not both"):
        PagedKVCache(GEOMETRY, WINDOW, CFG, TEXT, plan=plan, mesh=mesh, device=jax.devices()[0])
    heads3 = CacheGeometry(num_layers=1, num_kv_heads=3, head_dim=8, dtype="float32", tokens_per_frame=4,
                           block_size=4)
    with pytest.raises(ValueError, match="kv_heads=3 must be divisible by the mesh axis 'model' of size 4"):
        PagedKVCache(heads3, WINDOW, mesh=mesh, available_bytes=1 << 24)
    planned = PagedKVCache(GEOMETRY, WINDOW, CFG, TEXT, mesh=mesh, available_bytes=1 << 24, memory_fraction=1.0,
                           session_capacity=5, backend="xla")
    assert planned.session_capacity == 6 and planned.slots_per_shard == 3  # 5 sessions over 2 shards
    assert planned.plan.geometry.num_kv_heads == 2  # one device's heads


def test_a_cache_built_from_a_device_plan_allocates_what_the_plan_says():
    """``DevicePlan.pages_per_shard`` pages per data shard and ``pool_bytes_per_device`` bytes of
    pool per device: the managed pages, without the scratch reservation."""
    data, model = 2, 4
    plan = plan_per_device(GEOMETRY, WINDOW, CFG, data=data, model=model, available_bytes_per_device=1 << 20,
                           memory_fraction=1.0, sessions_per_shard=3, cross_attention=TEXT)
    assert plan.plan.scratch_num_blocks > 0 and plan.pages_per_shard == plan.plan.managed_num_blocks
    cache = PagedKVCache(GEOMETRY, WINDOW, CFG, TEXT, plan=plan, mesh=mesh_of(data, model), backend="xla")
    k_pool, v_pool = cache.pools
    assert cache.pages_per_shard == plan.pages_per_shard
    assert pool_geometry(k_pool).num_pages == data * plan.pages_per_shard
    for device in cache.mesh.devices.flat:
        pool_bytes = sum(shard.data.nbytes for pool in (k_pool, v_pool) for shard in pool.addressable_shards
                         if shard.device == device)
        assert pool_bytes == plan.pool_bytes_per_device
    cross_bytes = sum(shard.data.nbytes for table in cache.cross_attention_kv("text")
                      for shard in table.addressable_shards if shard.device == cache.mesh.devices.flat[0])
    assert plan.bytes_per_device == plan.pool_bytes_per_device + cross_bytes
    assert cache.session_capacity == plan.total_sessions and cache.rows_per_shard == plan.rows_per_shard


def test_the_state_is_sharded_with_and_without_a_mesh():
    for mesh, shards in ((mesh_of(4, 2), 4), (None, 1)):
        cache = make_cache(mesh)
        leaves = jax.tree.leaves(cache.state)
        assert {leaf.shape[0] for leaf in leaves} == {shards}
        assert sh.unstack_state(cache.state, 0).num_rows == cache.rows_per_shard


# ------------------------------------------------------------------------------------------------
# Rollout and demo.

TINY = get_preset("tiny")


def tiny_rollout(model, mesh, sessions_per_shard):
    sampler = Sampler(num_steps=2, guidance_scale=3.0)
    model_axis = 1 if mesh is None else mesh.shape["model"]
    plan = rollout_plan(TINY.geometry, TINY.window, TINY.kv_branches, TINY.cross_attention, sessions_per_shard,
                        model=model_axis)
    cache = PagedKVCache(TINY.geometry, TINY.window, TINY.kv_branches, TINY.cross_attention, plan=plan,
                         mesh=mesh, backend="xla")
    return Rollout(model, cache, sampler, max_traces=1)


#: The churn's sessions joining before each step, and leaving before it (``d`` after ``b`` left).
CHURN_JOINS = {0: ("a", "b"), 1: ("c",), 3: ("d",)}
CHURN_LEAVES = {3: ("b",)}


def churn(rollout, steps=6):
    """Sessions join and leave as :data:`CHURN_JOINS` and :data:`CHURN_LEAVES` say; returns every
    session's latents."""
    out = {}
    for index in range(steps):
        for sid in CHURN_LEAVES.get(index, ()):
            out[sid] = rollout.leave(sid)
        for sid in CHURN_JOINS.get(index, ()):
            rollout.join(sid, f"prompt {sid}", seed=ord(sid))
        rollout.step()
    out.update({sid: rollout.latents(sid) for sid in rollout.sessions})
    return out


@pytest.fixture(scope="module")
def tiny_model():
    return init_random(MODEL_CONFIGS["tiny"], seed=0)


@pytest.fixture(scope="module")
def single_device_latents(tiny_model):
    return churn(tiny_rollout(tiny_model, None, 3))


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(8, 1), (4, 2)], ids=lambda s: f"data{s[0]}_model{s[1]}")
def test_sharded_rollout_matches_one_device(shape, tiny_model, single_device_latents):
    rollout = tiny_rollout(tiny_model, mesh_of(*shape), 1)
    got = churn(rollout)
    assert rollout.num_traces == 1
    assert got.keys() == single_device_latents.keys()
    for sid, expected in single_device_latents.items():
        np.testing.assert_allclose(got[sid], expected, atol=1e-5, err_msg=sid)


def test_the_model_axis_splits_the_blocks_weights(tiny_model):
    rollout = tiny_rollout(tiny_model, mesh_of(4, 2), 1)
    attention = rollout.params["blocks"]["self_attn"]
    q, o = attention["q"]["kernel"][...], attention["o"]["kernel"][...]
    assert q.sharding.spec == P(None, None, "model") and o.sharding.spec == P(None, "model", None)
    assert q.addressable_shards[0].data.shape == (2, 64, 32)  # 2 of the 4 query heads per device
    ffn_out = rollout.params["blocks"]["ffn_out"]["kernel"][...]
    assert ffn_out.addressable_shards[0].data.shape == (2, 64, 64)
    assert rollout.params["patch_embedding"]["kernel"][...].sharding.is_fully_replicated
    # A model axis that divides none of the split dimensions leaves every weight whole.
    specs = jax.tree.leaves(tensor_parallel_specs(rollout.params, 3), is_leaf=lambda x: isinstance(x, P))
    assert specs and all(spec == P() for spec in specs)
    with pytest.raises(ValueError, match=r"model_axis_size must be an int in \[1, inf\], got 0"):
        tensor_parallel_specs(rollout.params, 0)


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(jax.sharding, "AxisType"), reason="this JAX has no mesh axis types")
def test_a_mesh_with_explicit_axes_runs_through_its_auto_view(tiny_model, single_device_latents):
    explicit = jax.sharding.AxisType.Explicit
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), sh.AXES, axis_types=(explicit,) * 2)
    rollout = tiny_rollout(tiny_model, mesh, 1)
    assert rollout.cache.mesh.devices.tolist() == mesh.devices.tolist()
    assert all(t == jax.sharding.AxisType.Auto for t in rollout.cache.mesh.axis_types)
    got = churn(rollout)
    for sid, expected in single_device_latents.items():
        np.testing.assert_allclose(got[sid], expected, atol=1e-5, err_msg=sid)


@pytest.mark.slow
def test_sharded_rollout_is_bit_identical_with_the_same_batch_per_device(tiny_model):
    """Two slots per device on a (4, 1) mesh run the same program shapes as one device with two
    slots, so the latents are the same bits."""
    one = tiny_rollout(tiny_model, None, 2)
    four = tiny_rollout(tiny_model, mesh_of(4, 1), 2)
    for rollout in (one, four):
        rollout.join("a", "prompt a", seed=1)
        rollout.join("b", "prompt b", seed=2)
        for _ in range(5):
            rollout.step()
    assert four.cache.slot("b") // four.cache.slots_per_shard == 1  # a and b on different devices
    for sid in "ab":
        np.testing.assert_array_equal(four.latents(sid), one.latents(sid))


def test_sharded_rollout_refuses_heads_the_model_axis_does_not_divide(tiny_model):
    with pytest.raises(ValueError, match="kv_heads=2 must be divisible by the mesh axis 'model' of size 4"):
        tiny_rollout(tiny_model, mesh_of(2, 4), 1)
