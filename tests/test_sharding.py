"""Multi-device layer (arkv_jax/sharding.py) on 8 CPU devices.

The device count is set in ``tests/conftest.py`` (``jax_num_cpu_devices = 8``) before JAX starts.
Every sharded result is compared with the unsharded code on one device: the write bit for bit,
attention to 1e-5 (fp32), the state leaf for leaf.
"""

from __future__ import annotations

import functools
import json
import re
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from arkv_jax import planner
from arkv_jax import sharding as sh
from arkv_jax import state as core
from arkv_jax.config import CacheGeometry, CrossAttentionSpec, KVBranch, WindowPolicy, pages_per_frame
from arkv_jax.planner import plan_memory
from arkv_jax.sharded_kernels import sharded_window_attention, sharded_write_chunk
from arkv_jax.step import prepare_chunk
from pallas_kernels import layout as pool_layout
from pallas_kernels.paged_write import write_chunk
from pallas_kernels.window_attention import window_attention

NUM_DEVICES = 8
MESH_SHAPES = [(1, 8), (2, 4), (4, 2), (8, 1)]

# 8 KV heads and 16 query heads (GQA group 2): every (data, model) with data * model == 8 works.
LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM = 2, 8, 16, 16
BLOCK, TPF = 4, 6  # a frame takes 2 pages, its last page half padding
PPF = pages_per_frame(TPF, BLOCK)
PAGES_PER_SHARD = 12
ROWS_PER_SHARD = 2

pytestmark = pytest.mark.skipif(
    jax.device_count() < NUM_DEVICES,
    reason=f"needs {NUM_DEVICES} devices (tests/conftest.py sets jax_num_cpu_devices)")


def _mesh(shape):
    return sh.make_mesh(*shape, devices=jax.devices()[:NUM_DEVICES])


def _assert_sharded(x, mesh, spec):
    assert x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim), (x.sharding, spec)


def _local_to_global(ids, data, pages_per_shard, *, null_to_zero):
    """Local page ids ``[data * rows, n]`` -> global ids of the stacked pool. Local 0 (the shard's
    null page) becomes global 0 (skip) for writes, or the shard's own null page for reads."""
    ids = np.asarray(ids)
    offset = np.repeat(np.arange(data) * pages_per_shard, ids.shape[0] // data)[:, None]
    glob = ids + offset
    return np.where(ids == 0, 0, glob) if null_to_zero else glob


def _distinct_local_ids(rng, data, rows_per_shard, n, pages_per_shard):
    """Per shard, distinct local ids in [1, pages_per_shard), with a few 0 (skip) entries."""
    out = []
    for _ in range(data):
        ids = rng.permutation(np.arange(1, pages_per_shard))[: rows_per_shard * n]
        ids = ids.reshape(rows_per_shard, n)
        ids[rng.random(ids.shape) < 0.2] = 0
        out.append(ids)
    return np.concatenate(out).astype(np.int32)


# ------------------------------------------------------------------------------------------------
# Kernels: sharded == single device.


@pytest.mark.slow
@pytest.mark.parametrize("shape", MESH_SHAPES, ids=lambda s: f"data{s[0]}_model{s[1]}")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sharded_write_is_bit_identical(shape, dtype):
    data, model = shape
    mesh = _mesh(shape)
    rng = np.random.default_rng(data)
    frames = 2
    pool_shape = pool_layout.pool_shape(LAYERS, data * PAGES_PER_SHARD, BLOCK, KV_HEADS, HEAD_DIM)
    new_shape = (LAYERS, data * ROWS_PER_SHARD, frames * TPF, KV_HEADS, HEAD_DIM)
    k_pool = jnp.asarray(rng.standard_normal(pool_shape), dtype)
    v_pool = jnp.asarray(rng.standard_normal(pool_shape), dtype)
    k_new = jnp.asarray(rng.standard_normal(new_shape), dtype)
    v_new = jnp.asarray(rng.standard_normal(new_shape), dtype)
    local = _distinct_local_ids(rng, data, ROWS_PER_SHARD, frames * PPF, PAGES_PER_SHARD)
    glob = _local_to_global(local, data, PAGES_PER_SHARD, null_to_zero=True)

    want = jax.jit(functools.partial(write_chunk, tokens_per_frame=TPF, backend="xla"))(
        k_pool, v_pool, k_new, v_new, jnp.asarray(glob))
    placed = sh.place(mesh, (k_pool, v_pool, k_new, v_new),
                      (sh.pool_spec(), sh.pool_spec(), sh.chunk_spec(), sh.chunk_spec()))
    got = sharded_write_chunk(mesh, *placed, sh.place(mesh, jnp.asarray(local), sh.row_spec(2)),
                                 tokens_per_frame=TPF, backend="xla")
    for g, w in zip(got, want):
        _assert_sharded(g, mesh, sh.pool_spec())
        np.testing.assert_array_equal(np.asarray(g).view(np.uint16 if dtype == "bfloat16"
                                                         else np.uint32),
                                      np.asarray(w).view(np.uint16 if dtype == "bfloat16"
                                                         else np.uint32))


def _attention_inputs(data, rng, *, extras=True, dtype="float32"):
    rows = data * ROWS_PER_SHARD
    q_len = cur = 2 * TPF
    max_pages = 3 * PPF  # 3 visible history frames
    pool_shape = pool_layout.pool_shape(LAYERS, data * PAGES_PER_SHARD, BLOCK, KV_HEADS, HEAD_DIM)
    arrays = dict(
        q=rng.standard_normal((rows, q_len, Q_HEADS, HEAD_DIM)),
        k_cur=rng.standard_normal((rows, cur, KV_HEADS, HEAD_DIM)),
        v_cur=rng.standard_normal((rows, cur, KV_HEADS, HEAD_DIM)),
        k_pool=rng.standard_normal(pool_shape), v_pool=rng.standard_normal(pool_shape))
    if extras:
        arrays["extra_k"] = rng.standard_normal((rows, 3, KV_HEADS, HEAD_DIM))
        arrays["extra_v"] = rng.standard_normal((rows, 3, KV_HEADS, HEAD_DIM))
    arrays = {k: jnp.asarray(v, dtype) for k, v in arrays.items()}
    # Any local page ids (repeats and the null page allowed): lengths decide what is visible.
    local = rng.integers(0, PAGES_PER_SHARD, size=(rows, max_pages)).astype(np.int32)
    lengths = rng.integers(0, 3 * TPF + 1, size=rows).astype(np.int32)
    lengths[0] = 0  # a row without history
    return arrays, local, lengths


@pytest.mark.slow
@pytest.mark.parametrize("shape", MESH_SHAPES, ids=lambda s: f"data{s[0]}_model{s[1]}")
def test_sharded_attention_matches_single_device(shape):
    data, model = shape
    mesh = _mesh(shape)
    rng = np.random.default_rng(10 + data)
    arrays, local, lengths = _attention_inputs(data, rng)
    glob = _local_to_global(local, data, PAGES_PER_SHARD, null_to_zero=False)
    layer = jnp.asarray(1, jnp.int32)

    want = window_attention(arrays["q"], arrays["k_cur"], arrays["v_cur"], arrays["k_pool"],
                            arrays["v_pool"], jnp.asarray(glob), jnp.asarray(lengths), layer=1,
                            extra_k=arrays["extra_k"], extra_v=arrays["extra_v"],
                            tokens_per_frame=TPF, backend="xla")
    got = sharded_window_attention(
        mesh, arrays["q"], arrays["k_cur"], arrays["v_cur"], arrays["k_pool"], arrays["v_pool"],
        jnp.asarray(local), jnp.asarray(lengths), layer=layer, extra_k=arrays["extra_k"],
        extra_v=arrays["extra_v"], tokens_per_frame=TPF, backend="xla")
    _assert_sharded(got, mesh, sh.head_spec())
    chex.assert_trees_all_close(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)


@pytest.mark.parametrize("layer", [LAYERS, -1, np.int32(LAYERS)])
def test_sharded_attention_refuses_a_static_layer_out_of_range(layer):
    mesh = _mesh((2, 4))
    arrays, local, lengths = _attention_inputs(2, np.random.default_rng(0), extras=False)
    with pytest.raises(ValueError, match=rf"layer \(k_pool.shape\[0\] = {LAYERS} layers\) must be an int in "
                                         rf"\[0, {LAYERS - 1}\], got {int(layer)}"):
        sharded_window_attention(mesh, arrays["q"], arrays["k_cur"], arrays["v_cur"], arrays["k_pool"],
                                 arrays["v_pool"], jnp.asarray(local), jnp.asarray(lengths), layer=layer,
                                 tokens_per_frame=TPF, backend="xla")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["pallas_tpu_interpret", "pallas_gpu_interpret"])
def test_sharded_pallas_interpret(backend):
    """The Pallas kernels (interpret mode) under shard_map: same results as the XLA path."""
    data, model = 2, 4
    mesh = _mesh((data, model))
    rng = np.random.default_rng(3)
    arrays, local, lengths = _attention_inputs(data, rng, extras=False)
    args = (arrays["q"], arrays["k_cur"], arrays["v_cur"], arrays["k_pool"], arrays["v_pool"],
            jnp.asarray(local), jnp.asarray(lengths))
    kwargs = dict(layer=0, tokens_per_frame=TPF)
    want = sharded_window_attention(mesh, *args, **kwargs, backend="xla")
    got = sharded_window_attention(mesh, *args, **kwargs, backend=backend)
    chex.assert_trees_all_close(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)

    new_shape = (LAYERS, data * ROWS_PER_SHARD, TPF, KV_HEADS, HEAD_DIM)
    k_new = jnp.asarray(rng.standard_normal(new_shape), jnp.float32)
    ids = jnp.asarray(_distinct_local_ids(rng, data, ROWS_PER_SHARD, PPF, PAGES_PER_SHARD))
    pools = (arrays["k_pool"], arrays["v_pool"], k_new, -k_new, ids)
    want = sharded_write_chunk(mesh, *pools, tokens_per_frame=TPF, backend="xla")
    got = sharded_write_chunk(mesh, *pools, tokens_per_frame=TPF, backend=backend)
    chex.assert_trees_all_equal(jax.device_get(got), jax.device_get(want))


# ------------------------------------------------------------------------------------------------
# Donation, placement, no communication.


def test_jitted_sharded_write_aliases_donated_pools():
    mesh = _mesh((2, 4))
    geometry = CacheGeometry(LAYERS, KV_HEADS, HEAD_DIM, "float32", tokens_per_frame=TPF,
                             block_size=BLOCK)
    k_pool, v_pool = sh.make_pools(geometry, PAGES_PER_SHARD, mesh)
    new_shape = (LAYERS, 2 * ROWS_PER_SHARD, TPF, KV_HEADS, HEAD_DIM)
    k_new = sh.place(mesh, jnp.ones(new_shape, jnp.float32), sh.chunk_spec())
    ids = sh.place(mesh, jnp.asarray([[1, 2], [3, 4], [1, 2], [5, 6]], jnp.int32), sh.row_spec(2))
    step = jax.jit(functools.partial(sharded_write_chunk, mesh, tokens_per_frame=TPF,
                                     backend="xla"), donate_argnums=(0, 1))
    compiled = step.lower(k_pool, v_pool, k_new, k_new, ids).compile()
    per_device_pool = k_pool.addressable_shards[0].data.nbytes
    analysis = compiled.memory_analysis()
    if analysis is not None and hasattr(analysis, "alias_size_in_bytes"):
        assert analysis.alias_size_in_bytes == 2 * per_device_pool
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "donated buffers were not usable" would fail here
        k_out, v_out = step(k_pool, v_pool, k_new, k_new, ids)
    assert k_pool.is_deleted() and v_pool.is_deleted()
    _assert_sharded(k_out, mesh, sh.pool_spec())
    # Pages 1, 2 of data shard 0 hold row 0's frame: TPF ones per layer and head, then padding.
    assert float(np.take(np.asarray(k_out), [1, 2], axis=pool_layout.PAGE_AXIS).sum()) == \
        LAYERS * TPF * KV_HEADS * HEAD_DIM


def test_make_pools_and_state_placement():
    mesh = _mesh((4, 2))
    geometry = CacheGeometry(LAYERS, KV_HEADS, HEAD_DIM, "bfloat16", tokens_per_frame=TPF,
                             block_size=BLOCK)
    k_pool, v_pool = sh.make_pools(geometry, PAGES_PER_SHARD, mesh)
    assert k_pool.shape == pool_layout.pool_shape(LAYERS, 4 * PAGES_PER_SHARD, BLOCK, KV_HEADS, HEAD_DIM)
    assert sh.pool_spec() == P(None, sh.MODEL, sh.DATA, None, None)
    assert k_pool.dtype == jnp.bfloat16 and k_pool.sharding.spec == sh.pool_spec()
    assert {s.data.shape for s in k_pool.addressable_shards} == {
        pool_layout.pool_shape(LAYERS, PAGES_PER_SHARD, BLOCK, KV_HEADS // 2, HEAD_DIM)}
    assert not np.asarray(k_pool, np.float32).any()
    assert (k_pool.addressable_shards[0].data.unsafe_buffer_pointer()
            != v_pool.addressable_shards[0].data.unsafe_buffer_pointer())

    layout = core.StateLayout.from_config(geometry, WindowPolicy(3, 1), PAGES_PER_SHARD)
    state = sh.init_sharded_state(layout, ROWS_PER_SHARD, mesh)
    single = core.init_state(layout, ROWS_PER_SHARD)
    for s in range(4):
        chex.assert_trees_all_equal(sh.unstack_state(state, s), single)
    for leaf in jax.tree_util.tree_leaves(state):
        assert leaf.shape[0] == 4 and leaf.sharding.spec == P(sh.DATA)
        assert leaf.addressable_shards[0].data.shape == (1,) + leaf.shape[1:]
    specs = sh.state_spec(state)
    assert specs.tables == P(sh.DATA, None, None) and specs.free_head == P(sh.DATA)
    assert sh.cross_attention_spec() == P(sh.DATA, None, sh.MODEL, None)
    assert sh.cross_attention_spec(5, row_axis=1) == P(None, sh.DATA, None, sh.MODEL, None)


def test_explicit_axis_mesh_needs_placed_inputs():
    """A mesh with Explicit axes (``jax.make_mesh``'s default in newer JAX) works once the inputs
    carry their specs (``place``); JAX 0.10 refuses unplaced inputs there ("in_specs ... does not
    match the specs of the input")."""
    axis_type = getattr(jax.sharding, "AxisType", None)
    if axis_type is None:
        pytest.skip("this JAX has no axis types")
    mesh = jax.make_mesh((2, 4), sh.AXES, axis_types=(axis_type.Explicit,) * 2,
                         devices=jax.devices()[:NUM_DEVICES])
    geometry = CacheGeometry(LAYERS, KV_HEADS, HEAD_DIM, "float32", tokens_per_frame=BLOCK)
    k_pool, v_pool = sh.make_pools(geometry, 8, mesh)
    new = jnp.ones((LAYERS, 4, BLOCK, KV_HEADS, HEAD_DIM))
    ids = sh.place(mesh, jnp.asarray([[1], [2], [1], [2]], jnp.int32), sh.row_spec(2))
    k_out, _ = sharded_write_chunk(mesh, k_pool, v_pool, *sh.place(mesh, (new, new), sh.chunk_spec()),
                                      ids, backend="xla")
    # Local page 1 of each data shard (global pages 1 and 9) holds row 0 / row 2: all ones.
    pool = np.asarray(k_out)  # (indexing an Explicit-axes array needs out_sharding)
    page = functools.partial(np.take, pool, axis=pool_layout.PAGE_AXIS)
    assert page(1).sum() == page(9).sum() == float(new[:, 0].sum()) == pool.sum() / 4


def _chunk_step(state, rows):
    """Per-shard bookkeeping of one chunk: window, allocate, pages to write, commit."""
    state, inputs, ok = prepare_chunk(state, rows, 1)
    state, ok2 = core.commit(state, rows, 1)
    return state, (inputs.pages, inputs.lengths, inputs.write_pages, ok & ok2)


@pytest.mark.slow
def test_chunk_step_matches_per_shard_runs_and_has_no_collectives():
    """A whole jitted, donated chunk step (state + attention + write) on a (2, 4) mesh equals
    running every data shard alone on one device, compiles once, and communicates nothing."""
    data, model = 2, 4
    mesh = _mesh((data, model))
    geometry = CacheGeometry(LAYERS, KV_HEADS, HEAD_DIM, "float32", tokens_per_frame=TPF,
                             block_size=BLOCK)
    window = WindowPolicy(window_frames=2, sink_frames=1)
    pages_per_shard = 20  # 2 rows x (sink 1 + window 2 + 1 in flight) frames x 2 pages + null
    layout = core.StateLayout.from_config(geometry, window, pages_per_shard)
    rows_local = jnp.tile(jnp.arange(ROWS_PER_SHARD, dtype=jnp.int32), (data, 1))
    R = data * ROWS_PER_SHARD

    @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
    @chex.assert_max_traces(n=1)
    def step(state, k_pool, v_pool, q, k_new, v_new):
        state, (pages, lengths, write, ok) = sh.per_shard(_chunk_step, mesh)(state, rows_local)
        out = sharded_window_attention(mesh, q, k_new[0], v_new[0], k_pool, v_pool,
                                          pages.reshape(R, -1), lengths.reshape(R),
                                          tokens_per_frame=TPF, backend="xla")
        k_pool, v_pool = sharded_write_chunk(mesh, k_pool, v_pool, k_new, v_new,
                                                write.reshape(R, -1), tokens_per_frame=TPF,
                                                backend="xla")
        return state, k_pool, v_pool, out, ok

    state = sh.init_sharded_state(layout, ROWS_PER_SHARD, mesh)
    state, _ = jax.jit(sh.per_shard(core.begin, mesh))(state, rows_local)
    k_pool, v_pool = sh.make_pools(geometry, pages_per_shard, mesh)

    # The same chunks, one data shard at a time, on one device with the plain functions.
    ref_states = [core.begin(core.init_state(layout, ROWS_PER_SHARD), rows_local[0])[0]
                  for _ in range(data)]
    ref_pools = [(jnp.zeros(pool_layout.pool_shape(LAYERS, pages_per_shard, BLOCK, KV_HEADS, HEAD_DIM)),) * 2
                 for _ in range(data)]
    ref_step = jax.jit(_chunk_step)
    ref_attention = jax.jit(functools.partial(window_attention, tokens_per_frame=TPF, backend="xla"))
    rng = np.random.default_rng(0)
    for chunk in range(5):
        q = jnp.asarray(rng.standard_normal((R, TPF, Q_HEADS, HEAD_DIM)), jnp.float32)
        k_new = jnp.asarray(rng.standard_normal((LAYERS, R, TPF, KV_HEADS, HEAD_DIM)), jnp.float32)
        v_new = jnp.asarray(rng.standard_normal((LAYERS, R, TPF, KV_HEADS, HEAD_DIM)), jnp.float32)
        if chunk == 0:
            hlo = step.lower(state, k_pool, v_pool, q, k_new, v_new).compile().as_text()
            for op in ("all-gather", "all-reduce", "all-to-all", "collective-permute",
                       "reduce-scatter"):
                assert not re.search(rf"\b{op}\b", hlo), f"unexpected {op} in the chunk step"
        state, k_pool, v_pool, out, ok = step(state, k_pool, v_pool, q, k_new, v_new)
        assert bool(ok.all())
        for s in range(data):
            sl = slice(s * ROWS_PER_SHARD, (s + 1) * ROWS_PER_SHARD)
            st, (pages, lengths, write, _) = ref_step(ref_states[s], rows_local[0])
            kp, vp = ref_pools[s]
            want = ref_attention(q[sl], k_new[0, sl], v_new[0, sl], kp, vp, pages, lengths)
            kp, vp = write_chunk(kp, vp, k_new[:, sl], v_new[:, sl], write, tokens_per_frame=TPF,
                                 backend="xla")
            ref_states[s], ref_pools[s] = st, (kp, vp)
            chex.assert_trees_all_close(np.asarray(out[sl]), np.asarray(want), atol=1e-5, rtol=0)
            chex.assert_trees_all_equal(jax.device_get(sh.unstack_state(state, s)),
                                        jax.device_get(st))
            pps = slice(s * pages_per_shard, (s + 1) * pages_per_shard)
            pages_of = functools.partial(np.take, indices=np.arange(pps.start, pps.stop),
                                         axis=pool_layout.PAGE_AXIS)
            np.testing.assert_array_equal(pages_of(np.asarray(k_pool)), np.asarray(kp))
            np.testing.assert_array_equal(pages_of(np.asarray(v_pool)), np.asarray(vp))


# ------------------------------------------------------------------------------------------------
# Sharded state == each shard run separately.


@pytest.mark.slow
def test_per_shard_state_steps_equal_separate_runs():
    data = 4
    mesh = _mesh((data, 2))
    geometry = CacheGeometry(LAYERS, KV_HEADS, HEAD_DIM, "float32", tokens_per_frame=TPF,
                             block_size=BLOCK)
    layout = core.StateLayout.from_config(geometry, WindowPolicy(2, 1), num_blocks=16)
    rows_per_shard = 3
    sharded = sh.init_sharded_state(layout, rows_per_shard, mesh)
    separate = [core.init_state(layout, rows_per_shard) for _ in range(data)]
    begin = jax.jit(sh.per_shard(core.begin, mesh))
    allocate = jax.jit(sh.per_shard(core.allocate, mesh))
    commit = jax.jit(sh.per_shard(core.commit, mesh))
    end = jax.jit(sh.per_shard(core.end, mesh))
    window = jax.jit(sh.per_shard(core.visible_window, mesh))
    slots = jax.jit(sh.per_shard(core.slot_mapping, mesh), static_argnums=2)

    plain_jit = {name: jax.jit(getattr(core, name)) for name in ("begin", "allocate", "commit", "end")}
    plain_window = jax.jit(core.visible_window)
    plain_slots = jax.jit(core.slot_mapping, static_argnums=2)
    rng = np.random.default_rng(7)
    ops = [("begin", None)] + [("allocate", None), ("commit", None)] * 4 + [("end", None),
                                                                           ("begin", None)]
    ops += [("allocate", None), ("commit", None)]
    for name, _ in ops:
        # Different rows (some padding, -1) and counts per shard, so shards diverge.
        rows = np.stack([rng.permutation(np.array([0, 1, 2, -1]))[:3] for _ in range(data)]
                        ).astype(np.int32)
        counts = rng.integers(1, 2 * TPF, size=(data, 3)).astype(np.int32)
        fn = {"begin": begin, "allocate": allocate, "commit": commit, "end": end}[name]
        arg = {"begin": (counts * 0 + TPF * rng.integers(0, 2),), "allocate": (counts,),
               "commit": (np.ones_like(counts),), "end": ()}[name]
        sharded, ok = fn(sharded, jnp.asarray(rows), *map(jnp.asarray, arg))
        plain = plain_jit[name]
        for s in range(data):
            separate[s], ok_s = plain(separate[s], rows[s], *(a[s] for a in arg))
            np.testing.assert_array_equal(np.asarray(ok[s]), np.asarray(ok_s))
            chex.assert_trees_all_equal(jax.device_get(sh.unstack_state(sharded, s)),
                                        jax.device_get(separate[s]))
        win = window(sharded, jnp.asarray(rows), 1)
        slot = slots(sharded, jnp.asarray(rows), 5)
        for s in range(data):
            w = plain_window(separate[s], rows[s], 1)
            chex.assert_trees_all_equal(jax.device_get(jax.tree_util.tree_map(lambda x, s=s: x[s], win)),
                                        jax.device_get(w))
            np.testing.assert_array_equal(np.asarray(slot[s]),
                                          np.asarray(plain_slots(separate[s], rows[s], 5)))
    _assert_sharded(sharded.tables, mesh, P(sh.DATA))
    # A scalar argument goes to every shard.
    _, ok = allocate(sharded, jnp.zeros((data, 1), jnp.int32), jnp.int32(1))
    assert ok.shape == (data, 1)

    # stack_states round-trips.
    restacked = sh.stack_states([sh.unstack_state(sharded, s) for s in range(data)])
    chex.assert_trees_all_equal(jax.device_get(restacked), jax.device_get(sharded))


# ------------------------------------------------------------------------------------------------
# Refusals.


def test_invalid_meshes_and_shapes_are_refused():
    with pytest.raises(ValueError, match=r"data \* model = 9 devices, but 8 are given.*\(2, 4\)"):
        sh.make_mesh(3, 3)
    with pytest.raises(ValueError, match="mesh axis 'model' must be a positive int, got 0"):
        sh.make_mesh(8, 0)
    other = Mesh(np.array(jax.devices()[:NUM_DEVICES]).reshape(2, 4), ("x", "model"))
    with pytest.raises(ValueError, match=r"axes \('data', 'model'\).*missing \('data',\)"):
        sh.check_mesh(other)
    geometry = CacheGeometry(LAYERS, 6, HEAD_DIM, "float32", tokens_per_frame=TPF, block_size=BLOCK)
    with pytest.raises(ValueError, match=r"missing"):
        sh.make_pools(geometry, PAGES_PER_SHARD, other)

    mesh = _mesh((2, 4))
    with pytest.raises(ValueError, match=r"kv_heads=6 must be divisible by the mesh axis 'model' "
                                         r"of size 4; allowed 'model' sizes .*\[1, 2, 3, 6\]"):
        sh.make_pools(geometry, PAGES_PER_SHARD, mesh)

    rng = np.random.default_rng(0)
    arrays, local, lengths = _attention_inputs(2, rng, extras=False)
    args = [arrays["q"], arrays["k_cur"], arrays["v_cur"], arrays["k_pool"], arrays["v_pool"],
            jnp.asarray(local), jnp.asarray(lengths)]
    bad_q = list(args)
    bad_q[0] = arrays["q"][:, :, :6]  # 6 query heads
    with pytest.raises(ValueError, match=r"num_q_heads=6 must be divisible by the mesh axis 'model'"):
        sharded_window_attention(mesh, *bad_q, tokens_per_frame=TPF)
    bad_kv = list(args)
    bad_kv[0], bad_kv[1], bad_kv[2] = (arrays["q"][:, :, :12], arrays["k_cur"][:, :, :6],
                                       arrays["v_cur"][:, :, :6])
    with pytest.raises(ValueError, match=r"kv_heads=6 must be divisible"):
        sharded_window_attention(mesh, *bad_kv, tokens_per_frame=TPF)
    odd_rows = [a[:3] if i in (0, 1, 2, 5, 6) else a for i, a in enumerate(args)]
    with pytest.raises(ValueError, match=r"rows \(q.shape\[0\]\)=3 must be divisible by the mesh "
                                         r"axis 'data' of size 2"):
        sharded_window_attention(mesh, *odd_rows, tokens_per_frame=TPF)
    with pytest.raises(ValueError, match=r"rows \(k_new.shape\[1\]\)=3 must be divisible"):
        new = jnp.zeros((LAYERS, 3, TPF, KV_HEADS, HEAD_DIM))
        sharded_write_chunk(mesh, args[3], args[4], new, new, jnp.ones((3, PPF), jnp.int32),
                               tokens_per_frame=TPF)
    odd_pool = jnp.zeros(pool_layout.pool_shape(LAYERS, 25, BLOCK, KV_HEADS, HEAD_DIM))
    odd = rf"pool pages \(k_pool.shape\[{pool_layout.PAGE_AXIS}\]\)=25 must be divisible"
    with pytest.raises(ValueError, match=odd):
        new = jnp.zeros((LAYERS, 4, TPF, KV_HEADS, HEAD_DIM))
        sharded_write_chunk(mesh, odd_pool, odd_pool, new, new, jnp.ones((4, PPF), jnp.int32),
                               tokens_per_frame=TPF)

    layout = core.StateLayout.from_config(
        CacheGeometry(LAYERS, KV_HEADS, HEAD_DIM, "float32", tokens_per_frame=TPF,
                      block_size=BLOCK), WindowPolicy(2), 8)
    state = sh.init_sharded_state(layout, 2, _mesh((4, 2)))
    with pytest.raises(ValueError, match=r"leading shard axis of the mesh's data size 2, got shape "
                                         r"\(4, 2, \d+\)"):
        sh.per_shard(core.begin, mesh)(state, jnp.zeros((2, 1), jnp.int32))
    with pytest.raises(ValueError, match=r"argument 1 needs a leading shard axis"):
        sh.per_shard(core.begin, _mesh((4, 2)))(state, jnp.zeros((2, 1), jnp.int32))


# ------------------------------------------------------------------------------------------------
# Planner per device.


def test_plan_per_device_divides_heads_and_scales_sessions():
    geometry = CacheGeometry(4, 8, 64, "bfloat16", tokens_per_frame=32, block_size=16)
    window = WindowPolicy(window_frames=4, sink_frames=1)
    branches = (KVBranch("positive", 0), KVBranch("negative", 1))
    cross = (CrossAttentionSpec("text", 64), CrossAttentionSpec("image", 16, num_kv_heads=8))
    available = 1 << 30
    single = plan_memory(geometry, window, branches, available_bytes=available,
                         memory_fraction=0.5, session_capacity=1000, cross_attention=cross)
    for data, model in MESH_SHAPES + [(1, 1), (3, 2)]:
        plan = planner.plan_per_device(geometry, window, branches, data=data, model=model,
                                  available_bytes_per_device=available // model,
                                  memory_fraction=0.5, sessions_per_shard=1000,
                                  cross_attention=cross)
        p = plan.plan
        assert p.geometry.num_kv_heads == 8 // model
        assert [c.num_kv_heads for c in p.cross_attention] == [None, 8 // model]
        # One device holds 1/model of a single device's bytes for the same pages and sessions; the
        # pools hold the managed pages (the scratch reservation is never allocated).
        assert p.page_size_bytes * model == single.page_size_bytes
        assert plan.pages_per_shard == single.managed_num_blocks == p.managed_num_blocks
        assert plan.pool_bytes_per_device == p.managed_num_blocks * p.page_size_bytes
        assert plan.pool_bytes_per_device * model == single.managed_num_blocks * single.page_size_bytes
        assert plan.sessions_per_data_shard == single.session_capacity
        assert plan.total_sessions == single.session_capacity * data
        assert plan.rows_per_shard == single.session_capacity * 2
        assert plan.bytes_per_device == (plan.pool_bytes_per_device + p.cross_attention_reserved_bytes)
        assert plan.bytes_per_device * model == (single.managed_num_blocks * single.page_size_bytes
                                                 + single.cross_attention_reserved_bytes)
        assert plan.num_devices == data * model and plan.to_dict()["total_sessions"] > 0

    with pytest.raises(ValueError, match=r"kv_heads=8 must be divisible by the mesh axis 'model' "
                                         r"of size 3"):
        planner.plan_per_device(geometry, window, data=1, model=3, available_bytes_per_device=available)
    with pytest.raises(ValueError, match=r"cross-attention 'image' num_kv_heads=4 must be divisible"
                                         r" by the mesh axis 'model' of size 8"):
        planner.plan_per_device(geometry, window, data=1, model=8, available_bytes_per_device=available,
                           cross_attention=(CrossAttentionSpec("image", 16, num_kv_heads=4),))
    with pytest.raises(ValueError, match=r"mesh axis 'data' must be a positive int, got 0"):
        planner.plan_per_device(geometry, window, data=0, model=1, available_bytes_per_device=available)


def test_cli_plans_one_device_of_a_mesh(capsys):
    from arkv_jax import get_preset
    from arkv_jax.apps import cli

    def run(*argv):
        code = cli.main(["plan", "--preset", "wan-1.3b", "--memory", "tpu-v5e", "--fraction", "0.9", *argv])
        return code, capsys.readouterr().out

    code, out = run("--mesh", "4x2", "--sessions", "8", "--json")
    wan = get_preset("wan-1.3b")
    expected = planner.plan_per_device(wan.geometry, wan.window, wan.kv_branches, data=4, model=2,
                                  available_bytes_per_device=16 * 2**30, memory_fraction=0.9,
                                  sessions_per_shard=2, cross_attention=wan.cross_attention)
    assert code == 0 and json.loads(out) == json.loads(expected.to_json())
    code, out = run("--mesh", "4x2")
    assert code == 0 and out.startswith("mesh: data=4 x model=2 (8 devices)")
    assert "30 layers x 6 kv heads x 128" in out  # one device's heads
    with pytest.raises(SystemExit):
        run("--mesh", "2x5")  # 12 K/V heads
    assert "kv_heads=12 must be divisible by the mesh axis 'model' of size 5" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run("--mesh", "4")
    assert "DATAxMODEL" in capsys.readouterr().err
