"""The seed's manager API on the functional core: seed-semantics §5.4 traces, §13.1-§13.3 cases, and what
vLLM-Omni accepts beyond them (issue 13: device strings, commits of unallocated chunks, layer-index and
chunk K/V refusals), and vLLM-Omni's contiguous token layout when a chunk is not a multiple of a block
(issue 21; tests/test_compat_readback.py reads every geometry back with vLLM-Omni's formulas)."""

import re

import numpy as np
import pytest

from arkv_jax import state as core
from arkv_jax.compat.vllm_omni import (
    ARDiffusionKVBranchSpec,
    ARDiffusionKVCache,
    ARDiffusionKVConfig,
    ARDiffusionRequestAdapter,
    chunk_slot_mapping,
    compute_num_blocks,
    compute_slot_mapping,
    resident_block_ids,
    resolve_device,
)
from pallas_kernels.layout import pool_shape
from tests.reference_model import RefCache
from tests.test_compat_readback import SeedModel, free_queue
from tests.tiers import slow_except

POS, NEG = "positive", "negative"
BRANCHES = (ARDiffusionKVBranchSpec(POS, 0), ARDiffusionKVBranchSpec(NEG, 1))


def make_cache(*, chunk=16, window=2, sink=0, reset=False, branches=BRANCHES, capacity=2, available=1 << 24,
               layers=2, dtype="float16", fpb=1, fraction=0.1, device=None, **kwargs):
    config = ARDiffusionKVConfig(enable=True, chunk_size=chunk, window_chunks=window, sink_chunks=sink,
                                 reset_at_boundary=reset, gpu_memory_fraction=fraction)
    return ARDiffusionKVCache(config, num_layers=layers, num_kv_heads=4, head_size=64, dtype=dtype,
                              block_size=chunk, max_model_len=4096, available_bytes=available,
                              kv_branches=branches, session_capacity=capacity, frames_per_block=fpb,
                              device=device, **kwargs)


def queue(cache):
    return np.asarray(free_queue(cache.state))[: cache.num_free_blocks()].tolist()


def test_helpers_match_the_seed():
    assert compute_slot_mapping([5, 2, 9], [0, 1, 4, 5, 8, 9], 4).tolist() == [20, 21, 8, 9, 36, 37]
    with pytest.raises(ValueError, match="^block_size must be positive, got 0$"):
        compute_slot_mapping([1], [0], 0)
    assert chunk_slot_mapping([7, 4, 3], 32, 4, 16).tolist() == [48, 49, 50, 51]
    assert resident_block_ids([0, 1, 0, 2, 3], 0) == [1, 2, 3]
    assert compute_num_blocks(1 << 20, 0.5, 16 << 10) == 32


def test_config_sliding_window_property():
    assert ARDiffusionKVConfig(chunk_size=16, window_chunks=3).sliding_window == 48
    assert ARDiffusionKVConfig(chunk_size=16).sliding_window is None


def test_adapter_advances_per_chunk_and_counts_prefill():
    adapter = ARDiffusionRequestAdapter("r", chunk_size=16)
    assert (adapter.num_computed_tokens, adapter.num_tokens) == (0, 16)
    adapter.on_chunk_committed()
    assert (adapter.num_computed_tokens, adapter.num_tokens, adapter.completed_chunks) == (16, 32, 1)
    prefilled = ARDiffusionRequestAdapter("p", chunk_size=16, prefill_prefix_tokens=4)
    assert (prefilled.num_computed_tokens, prefilled.num_prompt_tokens, prefilled.num_tokens) == (4, 4, 20)


def test_seed_trace_sliding_window_two_branches():
    """§5.4: chunk 16, window 2, 2 layers, 4 heads, 64, fp16, pos/neg, capacity 2, 16 MiB."""
    cache = make_cache()
    assert (cache.managed_num_blocks, cache.scratch_num_blocks, cache.num_free_blocks()) == (49, 2, 48)
    assert cache.scratch_block_ids(POS, 0, 1) == [49] and cache.scratch_block_ids(NEG, 0, 1) == [50]
    adapter = cache.begin_request("ar::s::positive")
    expected = [
        ([1], [1], 47, [2, 3, 4, 5], [45, 46, 47, 48]),
        ([1, 2], [1, 2], 46, [3, 4, 5, 6], [45, 46, 47, 48]),
        ([1, 2, 3], [0, 2, 3], 46, [4, 5, 6, 7], [46, 47, 48, 1]),
        ([0, 2, 3, 4], [0, 0, 3, 4], 46, [5, 6, 7, 8], [47, 48, 1, 2]),
        ([0, 0, 3, 4, 5], [0, 0, 0, 4, 5], 46, [6, 7, 8, 9], [48, 1, 2, 3]),
        ([0, 0, 0, 4, 5, 6], [0, 0, 0, 0, 5, 6], 46, [7, 8, 9, 10], [1, 2, 3, 4]),
    ]
    for k, (allocated, committed, free, head, tail) in enumerate(expected):
        assert cache.allocate_chunk(adapter) == allocated
        assert cache.chunk_write_slots(adapter).tolist() == list(range(16 * (k + 1), 16 * (k + 2)))
        cache.commit_chunk(adapter)
        assert cache.block_table(adapter) == committed
        assert cache.num_free_blocks() == free
        assert queue(cache)[:4] == head and queue(cache)[-4:] == tail
    cache.end_request(adapter)
    assert cache.num_free_blocks() == 48
    assert queue(cache)[:6] == [7, 8, 9, 10, 11, 12]
    assert queue(cache)[-8:] == [47, 48, 1, 2, 3, 4, 6, 5]


def test_seed_trace_sink_and_three_frame_blocks():
    """§5.4 LingBot-like rollout: chunk=block 16, window 5, sink 1, fpb 3, one branch, 1 layer."""
    cache = make_cache(window=5, sink=1, fpb=3, layers=1, branches=(ARDiffusionKVBranchSpec("main", 0),),
                       capacity=1, available=14 * 2 * 16 * 4 * 64 * 2, fraction=1.0)
    assert cache.managed_num_blocks == 11 and cache.scratch_block_ids("main", 0, 3) == [11, 12, 13]
    adapter = cache.begin_request("ar::s::main")
    expected_current = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 2, 3]]
    expected_after = [[1, 2, 3], [1, 2, 3, 4, 5, 6], [1, 0, 0, 0, 5, 6, 7, 8, 9],
                      [1, 0, 0, 0, 0, 0, 0, 8, 9, 10, 2, 3]]
    for block in range(4):
        start = adapter.num_computed_tokens // 16
        table = cache.allocate_token_slots(adapter, 48)
        assert table[start:start + 3] == expected_current[block]
        for _ in range(3):
            cache.commit_chunk(adapter)
        assert cache.block_table(adapter) == expected_after[block]


# the sink's traces stay fast in test_seed_trace_sink_and_three_frame_blocks and
# test_commit_without_allocation_follows_vllm_with_a_sink
@pytest.mark.slow
def test_seed_trace_sink_one_frame_per_commit():
    """§5.4 sink example: window 5, sink 1, one frame committed per forward."""
    cache = make_cache(window=5, sink=1, fpb=3, branches=(ARDiffusionKVBranchSpec("main", 0),), capacity=1)
    adapter = cache.begin_request("r")
    tables = []
    for _ in range(9):
        cache.allocate_chunk(adapter)
        cache.commit_chunk(adapter)
        tables.append(cache.block_table(adapter))
    assert tables[5] == [1, 2, 3, 4, 5, 6]
    assert tables[6] == [1, 0, 3, 4, 5, 6, 7]
    assert tables[7] == [1, 0, 0, 4, 5, 6, 7, 8]
    assert tables[8] == [1, 0, 0, 0, 5, 6, 7, 8, 9]
    assert cache.window_block_ids(adapter) == [1, 5, 6, 7, 8, 9]


@pytest.mark.slow  # test_seed_trace_sink_and_three_frame_blocks keeps multi-chunk commits
def test_multi_chunk_commit_window_three():
    cache = make_cache(window=3, branches=(ARDiffusionKVBranchSpec("main", 0),), capacity=1)
    adapter = cache.begin_request("r")
    assert cache.allocate_token_slots(adapter, 48) == [1, 2, 3]
    assert cache.chunk_write_slots(adapter).tolist()[0] == 16
    for _ in range(3):
        cache.commit_chunk(adapter)
    assert cache.block_table(adapter) == [1, 2, 3]
    assert cache.allocate_token_slots(adapter, 32) == [1, 2, 3, 4, 5]
    for _ in range(2):
        cache.commit_chunk(adapter)
    assert cache.block_table(adapter) == [0, 0, 3, 4, 5]


def test_reset_at_boundary_evicts_the_committed_chunk():
    """§4.3: chunk 16, window 3, sink 1, reset mode: tables [1], [1,0], [1,0,0], window [1]."""
    cache = make_cache(window=3, sink=1, reset=True, branches=(ARDiffusionKVBranchSpec("main", 0),), capacity=1)
    adapter = cache.begin_request("r")
    for expected in ([1], [1, 0], [1, 0, 0], [1, 0, 0, 0]):
        cache.allocate_chunk(adapter)
        cache.commit_chunk(adapter)
        assert cache.block_table(adapter) == expected
        assert cache.window_block_ids(adapter) == [1]


def test_allocation_is_idempotent_for_the_same_span():
    cache = make_cache()
    adapter = cache.begin_request("r")
    assert cache.allocate_token_slots(adapter, 16) == [1]
    assert cache.allocate_token_slots(adapter, 16) == [1]
    assert cache.allocate_token_slots(adapter, 20) == [1, 2]
    assert cache.num_free_blocks() == 46


def test_pool_exhaustion_raises_and_changes_nothing():
    """§8.5: 1 branch, window 2, fpb 1, budget for 6 managed blocks -> managed 5, 4 free."""
    page = 2 * 2 * 16 * 4 * 64 * 2
    cache = make_cache(branches=(ARDiffusionKVBranchSpec("main", 0),), capacity=1, available=7 * page, fraction=1.0)
    assert cache.managed_num_blocks == 6 and cache.num_free_blocks() == 5
    cache = make_cache(branches=(ARDiffusionKVBranchSpec("main", 0),), capacity=1, available=6 * page, fraction=1.0)
    assert cache.managed_num_blocks == 5 and cache.num_free_blocks() == 4
    a = cache.begin_request("A")
    cache.allocate_token_slots(a, 48)
    assert cache.num_free_blocks() == 1
    b = cache.begin_request("B")
    before = (queue(cache), cache.block_table(b))
    assert before == ([4], [])
    with pytest.raises(RuntimeError, match=r"^AR-Diffusion KV pool exhausted while allocating paged attention slots$"):
        cache.allocate_token_slots(b, 32)
    assert (queue(cache), cache.block_table(b)) == before
    assert cache.allocate_chunk(b) == [4]
    c = cache.begin_request("C")
    with pytest.raises(RuntimeError, match=r"^AR-Diffusion KV pool exhausted while allocating a chunk$"):
        cache.allocate_chunk(c)
    assert cache.num_free_blocks() == 0 and cache.block_table(c) == []


def test_full_request_lifecycle_plateaus_and_returns_every_block():
    cache = make_cache()
    initial = cache.num_free_blocks()
    adapter = cache.begin_request("r")
    free_after = []
    for _ in range(10):
        table = cache.allocate_chunk(adapter)
        slots = cache.chunk_write_slots(adapter).tolist()
        assert len(slots) == 16 and all(s // 16 in table and s // 16 != 0 for s in slots)
        assert len(cache.window_block_ids(adapter)) <= 3
        cache.commit_chunk(adapter)
        assert len(cache.window_block_ids(adapter)) <= 2
        free_after.append(cache.num_free_blocks())
    assert free_after[9] == free_after[1]
    cache.end_request(adapter)
    assert cache.num_free_blocks() == initial == 48


def test_num_computed_advances_per_chunk_and_two_branches_free_everything():
    cache = make_cache()
    pos, neg = cache.begin_request("bde__s"), cache.begin_request("bde__s__neg")
    assert pos.num_computed_tokens == 0
    for _ in range(3):
        for adapter in (pos, neg):
            cache.allocate_chunk(adapter)
            cache.commit_chunk(adapter)
    assert pos.num_computed_tokens == 48
    assert cache.num_free_blocks() < 48
    cache.end_request(pos)
    cache.end_request(neg)
    assert cache.num_free_blocks() == 48


# fast tier: §13.1's plan in tests/test_planner.py, two requests' windows in the traces above
@pytest.mark.slow
def test_capacity_two_retains_both_windows_and_allocates_next_block():
    """§13.1 tiny: chunk=block=1, window 3, sink 3, fpb 3, 1x1x1 fp32, text 2, requested 2, avail 192."""
    config = ARDiffusionKVConfig(enable=True, chunk_size=1, window_chunks=3, sink_chunks=3, gpu_memory_fraction=1.0)
    cache = ARDiffusionKVCache(config, num_layers=1, num_kv_heads=1, head_size=1, dtype="float32", block_size=1,
                               max_model_len=1 << 20, available_bytes=192,
                               kv_branches=(ARDiffusionKVBranchSpec("main", 0),), session_capacity=2,
                               cross_attention_lengths={"text": 2}, frames_per_block=3)
    assert (cache.session_capacity, cache.requested_session_capacity, cache.managed_num_blocks) == (2, 2, 17)
    adapters = [cache.begin_request(f"r{i}") for i in range(2)]
    for adapter in adapters:
        for _ in range(6):
            cache.allocate_token_slots(adapter, 1)
            cache.commit_chunk(adapter)
        assert len(cache.window_block_ids(adapter)) == 6
    cache.allocate_token_slots(adapters[0], 3)


def test_scratch_block_ids_and_errors():
    cache = make_cache(fpb=2, max_scratch_tokens_per_branch=16)
    assert cache.scratch_blocks_per_kv_branch == 3
    shared = make_cache(branches=(ARDiffusionKVBranchSpec(POS, 0), ARDiffusionKVBranchSpec(NEG, 0)))
    assert shared.scratch_block_ids(POS, 0, 1) == shared.scratch_block_ids(NEG, 0, 1)
    assert cache.scratch_block_ids(POS, 0, 2) != cache.scratch_block_ids(NEG, 0, 2)
    with pytest.raises(ValueError, match=re.escape("scratch start/count must be non-negative, got start=-1, count=1")):
        cache.scratch_block_ids(POS, -1, 1)
    with pytest.raises(RuntimeError, match=re.escape("scratch blocks exhausted: need [0, 4) of 3")):
        cache.scratch_block_ids(POS, 0, 4)
    with pytest.raises(KeyError,
                       match=re.escape("Unknown AR-Diffusion KV branch 'zz'; expected ('positive', 'negative')")):
        cache.scratch_block_ids("zz", 0, 1)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(config=ARDiffusionKVConfig(chunk_size=16, window_chunks=2)),
         "ARDiffusionKVCache built with a disabled ARDiffusionKVConfig"),
        (dict(config=ARDiffusionKVConfig(enable=True, chunk_size=16)),
         "Phase 1 requires a bounded window (window_chunks)"),
        (dict(config=ARDiffusionKVConfig(enable=True, window_chunks=2)),
         "ARDiffusionKVConfig.chunk_size must be set (> 0)"),
        (dict(kv_branches=()), "ARDiffusionKVCache requires at least one KV branch"),
        (dict(session_capacity=0), "session_capacity must be positive, got 0"),
        (dict(kv_branches=(ARDiffusionKVBranchSpec("m"), ARDiffusionKVBranchSpec("m"))),
         "ARDiffusionKVCache KV branch names must be unique, got ['m', 'm']"),
        (dict(kv_branches=(ARDiffusionKVBranchSpec("m", 1),)),
         "ARDiffusionKVCache KV branch local_index values must be contiguous from zero, got [1]"),
        (dict(frames_per_block=0), "frames_per_block must be positive, got 0"),
        (dict(max_scratch_tokens_per_branch=-3), "max_scratch_tokens_per_branch must be non-negative, got -3"),
        (dict(model_owned_state_bytes_per_session=-1),
         "model_owned_state_bytes_per_session must be non-negative, got -1"),
        (dict(cross_attention_lengths={"text": 0}), "cross_attention_lengths must be positive, got {'text': 0}"),
        (dict(config=ARDiffusionKVConfig(enable=True, chunk_size=16, window_chunks=2, gpu_memory_fraction=0.0)),
         "gpu_memory_fraction must be in (0, 1], got 0.0"),
        (dict(config=ARDiffusionKVConfig(enable=True, chunk_size=16, window_chunks=2, gpu_memory_fraction=1.5)),
         "gpu_memory_fraction must be in (0, 1], got 1.5"),
    ],
)
def test_constructor_errors_match_the_seed(overrides, message):
    kwargs = dict(config=ARDiffusionKVConfig(enable=True, chunk_size=16, window_chunks=2), num_layers=2,
                  num_kv_heads=4, head_size=64, dtype="float16", block_size=16, max_model_len=4096,
                  available_bytes=1 << 24, kv_branches=BRANCHES, session_capacity=2)
    kwargs.update(overrides)
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        ARDiffusionKVCache(kwargs.pop("config"), **kwargs)


def test_env_override_below_zero_is_refused(monkeypatch):
    monkeypatch.setenv("AR_DIFFUSION_KV_SCRATCH_BLOCKS_PER_BRANCH", "-1")
    with pytest.raises(ValueError, match="^AR_DIFFUSION_KV_SCRATCH_BLOCKS_PER_BRANCH must be non-negative$"):
        make_cache()


def test_cannot_fit_one_session_error():
    with pytest.raises(ValueError, match=r"cannot fit one session: available=1000 bytes, required=\d+ bytes"):
        make_cache(available=1000)


def test_allocate_num_tokens_must_be_positive_and_bad_adapters_are_refused():
    cache = make_cache()
    adapter = cache.begin_request("r")
    with pytest.raises(ValueError, match="^num_tokens must be positive, got 0$"):
        cache.allocate_token_slots(adapter, 0)
    cache.commit_chunk(adapter)  # as in vLLM-Omni: advances although nothing was allocated
    assert adapter.num_computed_tokens == 16 and cache.block_table(adapter) == []
    assert cache.num_free_blocks() == 48
    with pytest.raises(ValueError, match="already active"):
        cache.begin_request("r")
    cache.end_request(adapter)
    with pytest.raises(KeyError, match="is not active"):
        cache.allocate_chunk(adapter)


@pytest.mark.slow
def test_many_requests_grow_the_state_and_long_tables_widen():
    cache = make_cache(available=1 << 26)
    adapters = [cache.begin_request(f"r{i}") for i in range(20)]
    for adapter in adapters:
        cache.allocate_chunk(adapter)
    assert cache.state.num_rows >= 20
    wide = cache.allocate_token_slots(adapters[0], 16 * 30)
    assert len(wide) == 30 and len(set(wide)) == 30
    for adapter in adapters:
        cache.end_request(adapter)
    assert cache.num_free_blocks() == cache.managed_num_blocks - 1


def test_pools_are_allocated_on_the_device_zero_filled():
    import jax

    cache = make_cache(device=jax.devices()[0])
    assert cache._kv.k.shape == pool_shape(2, cache.num_blocks_total, 16, 4, 64)
    assert float(abs(cache._kv.k).max()) == 0.0


# -- cross-attention caches and pools (seed-semantics §8.5, §8.6, §13.4) ---------------------------------

def cross_cache(shared_local_index=False, layers=2, capacity=2):
    import jax

    branches = (ARDiffusionKVBranchSpec(POS, 0), ARDiffusionKVBranchSpec(NEG, 0 if shared_local_index else 1))
    return make_cache(window=4, branches=branches, layers=layers, dtype="float32", capacity=capacity,
                      cross_attention_lengths={"text": 8}, device=jax.devices()[0])


def layer_kv(k_value, v_value, layers=2, length=8):
    import jax.numpy as jnp

    return [(jnp.full((1, length, 4, 64), k_value + i), np.full((1, length, 4, 64), v_value + i, np.float32))
            for i in range(layers)]


def test_cross_attention_read_before_populate_raises():
    cache = cross_cache()
    for branch in (POS, NEG):
        with pytest.raises(RuntimeError, match="'text' for session 's1' was read before it was populated"):
            cache.read_cross_attention_kv("s1", "text", 0, branch)
    cache.populate_cross_attention("s1", "text", POS, layer_kv(1.0, 2.0))
    with pytest.raises(RuntimeError,
                       match="for session 's1' and KV branch 'negative' was read before it was populated"):
        cache.read_cross_attention_kv("s1", "text", 0, NEG)


def test_cross_attention_returns_per_layer_dicts_for_logical_branches_sharing_a_local_slot():
    cache = cross_cache(shared_local_index=True)
    assert cache.num_local_kv_branches == 1
    cache.populate_cross_attention("s1", "text", POS, layer_kv(1.0, 2.0))
    cache.populate_cross_attention("s1", "text", NEG, layer_kv(3.0, 4.0))
    for branch, (k_value, v_value) in ((POS, (1.0, 2.0)), (NEG, (3.0, 4.0))):
        for layer in range(2):
            out = cache.read_cross_attention_kv("s1", "text", layer, branch)
            assert out["is_init"] is True and out["k"].shape == (1, 8, 4, 64)
            assert float(out["k"][0, 0, 0, 0]) == k_value + layer and float(out["v"][0, 0, 0, 0]) == v_value + layer
    assert cache.is_cross_attention_populated("s1", "text", NEG)


def test_cross_attention_population_is_transactional():
    cache = cross_cache()

    def failing():
        yield layer_kv(1.0, 2.0)[0]
        raise RuntimeError("projection failed")

    with pytest.raises(RuntimeError, match="projection failed"):
        cache.populate_cross_attention("s1", "text", POS, failing())
    assert not cache.is_cross_attention_populated("s1", "text", POS) and "s1" not in cache._cross.sessions
    cache.populate_cross_attention("s1", "text", POS, layer_kv(1.0, 2.0))
    for bad, message in ((failing(), "projection failed"), (layer_kv(5.0, 5.0, layers=1), "expected 2 layers, got 1"),
                         (layer_kv(5.0, 5.0, layers=3), "expected 2 layers, got more than 2"),
                         (layer_kv(5.0, 5.0, length=7), r"expected k/v shape \(1, 8, 4, 64\)"),
                         ([(1.0, 2.0), (1.0, 2.0)], "must yield jax.Array k/v, got float and float")):
        with pytest.raises((RuntimeError, ValueError), match=message):
            cache.populate_cross_attention("s1", "text", POS, bad)
        assert float(cache.read_cross_attention_kv("s1", "text", 0, POS)["k"][0, 0, 0, 0]) == 1.0


def test_cross_attention_errors_retain_and_release():
    cache = cross_cache(capacity=1)
    with pytest.raises(KeyError, match=r"Unknown AR-Diffusion cross-attention cache 'img'; expected \('text',\)"):
        cache.populate_cross_attention("s1", "img", POS, layer_kv(1.0, 2.0))
    with pytest.raises(KeyError, match="Unknown AR-Diffusion KV branch 'zz'"):
        cache.is_cross_attention_populated("s1", "text", "zz")
    cache.populate_cross_attention("s1", "text", POS, layer_kv(1.0, 2.0))
    with pytest.raises(RuntimeError, match="cross-attention session capacity exhausted"):
        cache.populate_cross_attention("s2", "text", POS, layer_kv(1.0, 2.0))
    cache.retain_cross_attention("s1", ("text",))
    assert cache.is_cross_attention_populated("s1", "text", POS)
    cache.retain_cross_attention("s1", ())
    assert "s1" not in cache._cross.sessions
    cache.populate_cross_attention("s2", "text", POS, layer_kv(1.0, 2.0))
    cache.release_cross_attention("s2")
    assert not cache.is_cross_attention_populated("s2", "text", POS)
    bookkeeping = make_cache(cross_attention_lengths={"text": 8})
    with pytest.raises(RuntimeError, match="require a configured pool device"):
        bookkeeping.populate_cross_attention("s1", "text", POS, layer_kv(1.0, 2.0))


def test_paged_pool_layout_and_chunk_writes():
    """§13.1 pool layout: per-layer K and V caches (num_blocks_total, block, H, D); a chunk write
    lands at its slots."""
    cache = cross_cache()
    assert cache.key_cache(0).shape == (cache.num_blocks_total, 16, 4, 64)
    adapter = cache.begin_request("r")
    cache.allocate_chunk(adapter)
    new_k = np.arange(16 * 4 * 64, dtype=np.float32).reshape(1, 16, 4, 64)
    cache.write_chunk_kv(1, new_k, new_k + 0.5, adapter)
    block = cache.block_table(adapter)[0]
    np.testing.assert_array_equal(np.asarray(cache.key_cache(1)[block]), new_k[0])
    np.testing.assert_array_equal(np.asarray(cache.value_cache(1)[block]), new_k[0] + 0.5)
    assert float(abs(cache.key_cache(0)).max()) == 0.0 and float(abs(cache.key_cache(1)[0]).max()) == 0.0
    with pytest.raises(RuntimeError, match="require a configured pool device"):
        make_cache().key_cache(0)


# -- device= (issue 13): platform strings, JAX devices, torch.device duck-typed -----------------------------

def test_device_strings_map_to_jax_devices():
    import types

    import jax

    cpus = jax.devices("cpu")
    assert resolve_device(None) is None
    assert resolve_device(cpus[0]) is cpus[0]
    assert resolve_device("cpu") == cpus[0]
    assert resolve_device(f"cpu:{len(cpus) - 1}") == cpus[-1]
    # torch.device("cpu", 1) and torch.device("cuda"), read from .type/.index without importing torch
    assert resolve_device(types.SimpleNamespace(type="cpu", index=len(cpus) - 1)) == cpus[-1]
    assert resolve_device(types.SimpleNamespace(type="cpu", index=None)) == cpus[0]
    cache = make_cache(device=f"cpu:{len(cpus) - 1}", layers=1)
    assert cache.device == cpus[-1]
    assert cache._kv.k.devices() == {cpus[-1]} and cache.key_cache(0).devices() == {cpus[-1]}
    assert make_cache(device=None).device is None  # bookkeeping only, as in the seed


@pytest.mark.parametrize("platform, spec", [("gpu", "cuda"), ("gpu", "cuda:1"), ("gpu", "gpu"), ("tpu", "tpu:0")])
def test_device_platforms_jax_lacks_are_refused_naming_what_is_available(platform, spec):
    import jax

    try:
        devices = jax.devices(platform)
    except RuntimeError:
        devices = []
    index = int(spec.partition(":")[2] or 0)
    if index < len(devices):  # a machine that has the platform: the string maps to its device
        assert resolve_device(spec) == devices[index]
        return
    if devices:
        message = rf"device='{spec}' asks for {platform} device {index}, but JAX has {len(devices)} {platform}"
    else:
        message = (rf"device='{spec}' asks for the JAX platform '{platform}', which JAX does not have here; "
                   r"available platforms: cpu")
    with pytest.raises(ValueError, match=f"^{message}"):
        make_cache(device=spec)


def test_device_values_that_are_not_platforms_are_refused():
    import jax

    n = len(jax.devices("cpu"))
    with pytest.raises(ValueError, match=rf"^device='cpu:{n}' asks for cpu device {n}, but JAX has {n} cpu devices "
                                         rf"here \(indices 0..{n - 1}\)$"):
        resolve_device(f"cpu:{n}")
    for bad in ("npu", "mps", "cuda:", "cuda:-1", "cuda:x", "", "cpu:0:1", " cpu"):
        with pytest.raises(ValueError, match=f"^device={re.escape(repr(bad))} is not a platform string: expected "
                                             "'cpu', 'cuda', 'gpu' or 'tpu', optionally followed by ':index'"):
            make_cache(device=bad)
    for bad in (0, 1, True, 1.5, object(), ["cpu"]):
        with pytest.raises(TypeError, match="^device must be None, a jax.Device, a platform string "):
            make_cache(device=bad)


# -- commit_chunk of a chunk that was never allocated (issue 13): vLLM-Omni advances, it does not refuse ----
#
# vLLM's rules (seed-semantics §4.2, §4.4, §5.2, §5.3), chunk = block = 16, window W, sink S:
#   commit:   completed += 1, n = computed tokens; skipped = floor(max(0, n - 16W - 16S) / 16) * 16;
#             table indices [S, S + skipped/16), clipped to the table's length, walked backwards to the
#             first null entry: each block passed is freed (appended to the free queue) and nulled.
#   allocate: the same walk first, then cdiv(n + 16, 16) - len(table) blocks from the queue head are
#             appended (the capacity check counts max(cdiv(n + 16, 16) - max(skipped/16, len(table)), 0)).

def test_commit_without_allocation_follows_vllm_window_two():
    """§5.4 geometry (48 free, queue 1..48), one request, window 2, sink 0."""
    cache = make_cache()
    adapter = cache.begin_request("ar::s::positive")
    cache.commit_chunk(adapter)  # n=16, skipped 0, table empty: nothing to free
    assert (adapter.num_computed_tokens, cache.block_table(adapter), cache.num_free_blocks()) == (16, [], 48)
    # need cdiv(32, 16) = 2 blocks, holds 0: takes 1, 2; the chunk (positions 16..31) is index 1 -> block 2
    assert cache.allocate_chunk(adapter) == [1, 2]
    assert cache.chunk_write_slots(adapter).tolist() == list(range(32, 48))
    cache.commit_chunk(adapter)  # n=32, skipped 0
    assert cache.block_table(adapter) == [1, 2] and cache.num_free_blocks() == 46
    cache.commit_chunk(adapter)  # unallocated: n=48, skipped 16 -> index [0, 1): block 1 freed
    assert cache.block_table(adapter) == [0, 2] and queue(cache)[-2:] == [48, 1]
    cache.commit_chunk(adapter)  # unallocated: n=64, skipped 32 -> [0, 2): index 1 (block 2) freed, index 0 null
    assert cache.block_table(adapter) == [0, 0] and queue(cache)[-3:] == [48, 1, 2]
    cache.commit_chunk(adapter)  # unallocated: n=80, skipped 48 -> [0, 3) clipped to 2: index 1 null, stop
    assert cache.block_table(adapter) == [0, 0] and cache.num_free_blocks() == 48
    assert cache.window_block_ids(adapter) == []
    # need cdiv(96, 16) = 6, holds 2: takes 3, 4, 5, 6 (index 2 = block 3 is already out of the window;
    # vLLM allocates it anyway and frees it at the next commit); the chunk is index 5 -> block 6
    assert cache.allocate_chunk(adapter) == [0, 0, 3, 4, 5, 6]
    assert cache.window_block_ids(adapter) == [3, 4, 5, 6] and cache.num_free_blocks() == 44
    assert cache.chunk_write_slots(adapter).tolist() == list(range(96, 112))
    assert queue(cache)[:2] == [7, 8]
    cache.commit_chunk(adapter)  # n=96, skipped 64 -> [0, 4): index 3 (block 4), index 2 (block 3) freed
    assert cache.block_table(adapter) == [0, 0, 0, 0, 5, 6] and cache.num_free_blocks() == 46
    assert queue(cache)[-4:] == [1, 2, 4, 3]
    cache.end_request(adapter)  # the table in reverse: 6, 5
    assert cache.num_free_blocks() == 48 and queue(cache)[:1] == [7]
    assert queue(cache)[-6:] == [1, 2, 4, 3, 6, 5]


def test_commit_without_allocation_follows_vllm_with_a_sink():
    """Window 2, sink 1, one branch: the sink index is never freed, the walk stops at the first null."""
    cache = make_cache(sink=1, branches=(ARDiffusionKVBranchSpec("main", 0),), capacity=1)
    adapter = cache.begin_request("r")
    for _ in range(2):  # n=16, 32: skipped = max(0, n - 32 - 16) = 0
        cache.commit_chunk(adapter)
    assert cache.block_table(adapter) == []
    free = cache.num_free_blocks()
    # need cdiv(48, 16) = 3, holds 0: takes 1, 2, 3; the chunk (positions 32..47) is index 2 -> block 3
    assert cache.allocate_chunk(adapter) == [1, 2, 3]
    assert cache.chunk_write_slots(adapter).tolist() == list(range(48, 64))
    cache.commit_chunk(adapter)  # n=48, skipped 0
    cache.commit_chunk(adapter)  # unallocated: n=64, skipped 16 -> [1, 2): block 2 freed
    assert cache.block_table(adapter) == [1, 0, 3]
    cache.commit_chunk(adapter)  # unallocated: n=80, skipped 32 -> [1, 3): block 3 freed, index 1 null
    assert cache.block_table(adapter) == [1, 0, 0] and queue(cache)[-2:] == [2, 3]
    assert cache.num_free_blocks() == free - 1
    # need cdiv(96, 16) = 6, holds 3: takes 4, 5, 6; the chunk (80..95) is index 5 -> block 6
    assert cache.allocate_chunk(adapter) == [1, 0, 0, 4, 5, 6]
    assert cache.chunk_write_slots(adapter).tolist() == list(range(96, 112))
    assert cache.window_block_ids(adapter) == [1, 4, 5, 6]
    cache.commit_chunk(adapter)  # n=96, skipped 48 -> [1, 4): block 4 freed, index 2 null
    assert cache.block_table(adapter) == [1, 0, 0, 0, 5, 6] and queue(cache)[-3:] == [2, 3, 4]
    assert cache.num_free_blocks() == free - 3


def test_allocation_after_unallocated_commits_fails_as_vllm_does():
    """§8.5 pool (5 managed blocks, 4 free: 1..4), one branch, window 2, sink 0."""
    page = 2 * 2 * 16 * 4 * 64 * 2
    cache = make_cache(branches=(ARDiffusionKVBranchSpec("main", 0),), capacity=1, available=6 * page, fraction=1.0)
    b = cache.begin_request("B")
    assert cache.allocate_chunk(b) == [1] and cache.num_free_blocks() == 3
    a = cache.begin_request("A")
    for _ in range(3):  # n=48: skipped 16, but A holds nothing to free
        cache.commit_chunk(a)
    # vLLM: check max(cdiv(64, 16) - max(16 // 16, 0), 0) = 3 <= 3 free passes, then
    # BlockPool.get_new_blocks(4 - 0) raises; nothing was taken
    with pytest.raises(ValueError, match=r"^Cannot get 4 free blocks from the pool$"):
        cache.allocate_chunk(a)
    assert (cache.block_table(a), cache.num_free_blocks(), queue(cache)) == ([], 3, [2, 3, 4])
    d = cache.begin_request("D")  # nothing skipped: check 4 > 3 -> the seed's exhaustion error
    with pytest.raises(RuntimeError, match=r"^AR-Diffusion KV pool exhausted while allocating paged attention slots$"):
        cache.allocate_token_slots(d, 64)
    cache.end_request(b)  # 4 free: 2, 3, 4, 1; A needs cdiv(64, 16) = 4
    assert cache.allocate_chunk(a) == [2, 3, 4, 1]
    cache.commit_chunk(a)  # n=64, skipped 32 -> [0, 2): block 3, then block 2
    assert cache.block_table(a) == [0, 0, 4, 1] and queue(cache) == [3, 2]


def test_the_skip_rule_is_the_window_policy_on_whole_chunks():
    """compat's skip rule is WindowPolicy.skipped_frames on the computed whole chunks, in tokens: the seed's
    token formula (SeedModel.skipped_tokens) for every prefill offset, window, sink and mode."""
    from arkv_jax.compat.vllm_omni_blocks import ContiguousBlocks
    from arkv_jax.config import WindowPolicy

    for chunk, block in ((16, 16), (6, 4), (5, 8), (1, 4)):
        for sink, window, reset in ((0, 1, False), (0, 2, False), (1, 1, False), (2, 3, False), (1, 2, True),
                                    (0, 3, True), (3, 1, True)):
            blocks = ContiguousBlocks(WindowPolicy(window, sink, reset), chunk_size=chunk, block_size=block,
                                      frames_per_block=1, num_blocks=4, num_rows=1)
            seed = SeedModel(num_blocks=4, chunk_size=chunk, block_size=block, sink_chunks=sink,
                             window_chunks=window, reset_at_boundary=reset)
            assert blocks.sink_tokens == seed.sink_tokens
            for computed in range(0, 12 * chunk + 3):
                assert blocks.skipped_tokens(computed) == seed.skipped_tokens(computed), (chunk, sink, computed)


def test_native_commit_still_refuses_unallocated_chunks():
    import jax

    cache = make_cache()
    cache.begin_request("r")
    state, ok = jax.jit(core.commit)(cache.state, np.array([0]), 1)
    assert not bool(ok[0]) and int(state.committed_frames[0]) == 0


@pytest.mark.parametrize("tokens, block, sink, window, reset", slow_except([
    (16, 16, 0, 2, False), (16, 16, 1, 3, False), (16, 16, 2, 1, True), (24, 16, 1, 2, False), (8, 16, 0, 1, False),
    (6, 4, 1, 1, False),
], fast=[(16, 16, 1, 3, False)]))
def test_random_sequences_with_unallocated_commits_match_the_reference_model(tokens, block, sink, window, reset):
    """Random interleavings of allocate_chunk / allocate_token_slots / commit_chunk (allocated or not) /
    begin (with or without a prefill) / end on two requests, checked after every step against pure-Python
    models of vLLM's rules: tables, free queue, slots. tests/test_compat_readback.SeedModel (vLLM-Omni's
    contiguous token layout) for every geometry, and tests/reference_model.py where a chunk is a block."""
    rng = np.random.default_rng(tokens * 100 + block + sink * 7 + window)
    ppf, page = -(-tokens // block), 2 * block * 4  # K+V of one fp32 token-slot per block
    # a tight pool: one scratch frame, two full windows, the in-flight frame, the planner's two spare
    # frames and 3 more blocks, so that allocations after unallocated commits run out
    available = page * (ppf + 2 * (sink + window) * ppf + 3 * ppf + 3)
    config = ARDiffusionKVConfig(enable=True, chunk_size=tokens, window_chunks=window, sink_chunks=sink,
                                 reset_at_boundary=reset, gpu_memory_fraction=1.0)
    cache = ARDiffusionKVCache(config, num_layers=1, num_kv_heads=1, head_size=1, dtype="float32", block_size=block,
                               max_model_len=1 << 20, available_bytes=available,
                               kv_branches=(ARDiffusionKVBranchSpec("main", 0),), session_capacity=2)
    seed = SeedModel(num_blocks=cache.managed_num_blocks, chunk_size=tokens, block_size=block, sink_chunks=sink,
                     window_chunks=window, reset_at_boundary=reset)
    refs = [RefCache(num_blocks=cache.managed_num_blocks, tokens_per_frame=tokens, block_size=block,
                     sink_frames=sink, window_frames=window, reset_at_boundary=reset)] if tokens == block else []
    adapters = {}
    for step in range(80):
        rid = int(rng.integers(2))
        op = rng.choice(["alloc", "alloc", "slots", "commit", "commit", "commit", "end"])
        if rid not in adapters:
            # prefills longer than the window too (evicted at the first allocation), and partial chunks
            prefill = int(rng.choice([0, 0, tokens, 3 * tokens, tokens // 2]))
            adapters[rid] = cache.begin_request(f"r{rid}", prefill_prefix_tokens=prefill)
            seed.begin(rid, prefill)
            for ref in refs:
                ref.begin(rid, prefill)
        adapter = adapters[rid]
        if op in ("alloc", "slots"):
            num = tokens if op == "alloc" else int(rng.integers(1, 3)) * tokens
            expected_ok = seed.allocate(rid, num)
            assert all(ref.allocate(rid, num) == expected_ok for ref in refs), step
            try:
                cache.allocate_token_slots(adapter, num) if op == "slots" else cache.allocate_chunk(adapter)
                assert expected_ok, step
            except (RuntimeError, ValueError):
                assert not expected_ok, step
        elif op == "commit":
            cache.commit_chunk(adapter)
            seed.commit(rid)
            for ref in refs:
                ref.commit(rid, 1)
        else:
            cache.end_request(adapter)
            seed.end(rid)
            for ref in refs:
                ref.end(rid)
            del adapters[rid]
            continue
        assert cache.block_table(adapter) == seed.tables[rid], step
        assert queue(cache) == list(seed.free), step
        expected_slots = seed.slots(rid, tokens)
        for ref in refs:
            assert (ref.table(rid), list(ref.free), ref.slots(rid, tokens)) == (
                seed.tables[rid], list(seed.free), expected_slots), step
        if -1 in expected_slots:
            with pytest.raises(IndexError, match="has no allocated block for tokens"):
                cache.chunk_write_slots(adapter)
        else:
            assert cache.chunk_write_slots(adapter).tolist() == expected_slots, step


# -- chunk_size not a multiple of block_size: vLLM-Omni's contiguous layout (issue 21) -------------------

def frame_cache(layers=2):
    """chunk 24, block 16, window 1, sink 1, one branch, fp32, a large pool (ids handed out 1, 2, 3, ...).
    Token p sits at table[p // 16] * 16 + p % 16: block 2 holds chunk 0's tokens 16..23 and chunk 1's
    24..31, a chunk spans two or three blocks. The pool has as many blocks (512 pages) for any layer count, so
    the state's steps compile once for every test here."""
    import jax

    config = ARDiffusionKVConfig(enable=True, chunk_size=24, window_chunks=1, sink_chunks=1, gpu_memory_fraction=1.0)
    return ARDiffusionKVCache(config, num_layers=layers, num_kv_heads=2, head_size=4, dtype="float32",
                              block_size=16, max_model_len=4096, available_bytes=(1 << 19) * layers,
                              kv_branches=(ARDiffusionKVBranchSpec("main", 0),), session_capacity=1,
                              device=jax.devices()[0])


def chunk_values(k, layer, dtype=np.float32):
    """Distinct K/V per chunk, layer, token, head and channel (none of them zero)."""
    return (1 + 1000 * k + 100 * layer + np.arange(24 * 2 * 4, dtype=dtype)).reshape(1, 24, 2, 4)


def contiguous(keys, table, start, count=24):
    """Tokens [start, start + count) as vLLM-Omni reads them: keys[table[p // 16], p % 16]."""
    return np.stack([keys[table[p // 16], p % 16] for p in range(start, start + count)])


@pytest.mark.slow
def test_contiguous_slots_share_blocks_between_chunks_as_vllm_omni_does():
    """vLLM-Omni's chunk 24 / block 16 trace: cdiv(computed + 24, 16) - len(table) new blocks per chunk;
    a commit at n tokens nulls indices [ceil(24 / 16), floor((24 + skipped) / 16)) = [2, ...), skipped
    = floor((n - 48) / 24) * 24, so block 2 (the sink's tokens 16..23 and chunk 1's 24..31) stays."""
    cache = frame_cache()
    adapter = cache.begin_request("r")
    expected = [
        ([1, 2], [1, 2]),
        ([1, 2, 3], [1, 2, 3]),
        ([1, 2, 3, 4, 5], [1, 2, 0, 4, 5]),                            # n=72, skipped 24: [2, 3) frees 3
        ([1, 2, 0, 4, 5, 6], [1, 2, 0, 0, 5, 6]),                      # n=96, skipped 48: [2, 4) frees 4
        ([1, 2, 0, 0, 5, 6, 7, 8], [1, 2, 0, 0, 0, 0, 7, 8]),          # n=120: [2, 6) frees 6, 5
        ([1, 2, 0, 0, 0, 0, 7, 8, 9], [1, 2, 0, 0, 0, 0, 0, 8, 9]),    # n=144: [2, 7) frees 7; 8 is shared
    ]
    first_slots = [16, 40, 64, 88, 112, 136]
    for k, (allocated, committed) in enumerate(expected):
        assert cache.allocate_chunk(adapter) == allocated
        slots = cache.chunk_write_slots(adapter).tolist()
        assert slots == chunk_slot_mapping(allocated, 24 * k, 24, 16).tolist()
        assert slots[0] == first_slots[k] and len(set(s // 16 for s in slots)) == 2
        assert slots == np.asarray(core.slot_mapping(cache.state, np.array([0]), 24))[0].tolist()
        for layer in range(2):
            cache.write_chunk_kv(layer, chunk_values(k, layer), -chunk_values(k, layer), adapter)
        for layer in range(2):  # the chunk reads back whole through the table, its neighbours intact
            keys, values = np.asarray(cache.key_cache(layer)), np.asarray(cache.value_cache(layer))
            data = chunk_values(k, layer)[0]
            np.testing.assert_array_equal(contiguous(keys, allocated, 24 * k), data)
            np.testing.assert_array_equal(contiguous(values, allocated, 24 * k), -data)
            if k:  # the previous chunk's tail shares the chunk's first block
                np.testing.assert_array_equal(contiguous(keys, allocated, 24 * k - 8, 8),
                                              chunk_values(k - 1, layer)[0, 16:])
            # the null page stays exactly zero (no data, no NaN) in every layer
            assert np.all(keys[0] == 0) and np.all(values[0] == 0)
        cache.commit_chunk(adapter)
        assert cache.block_table(adapter) == committed
    # the sink (chunk 0) and the window (chunk 5) still read back; block 8 holds chunk 4's tail too
    keys, table = np.asarray(cache.key_cache(1)), cache.block_table(adapter)
    for chunk in (0, 5):
        np.testing.assert_array_equal(contiguous(keys, table, 24 * chunk), chunk_values(chunk, 1)[0])
    assert cache.window_block_ids(adapter) == [1, 2, 8, 9]


def test_contiguous_writes_never_touch_the_null_page_after_unallocated_commits():
    cache = frame_cache(layers=1)
    adapter = cache.begin_request("r")
    for _ in range(3):  # chunks 0..2 never allocated: nothing to evict
        cache.commit_chunk(adapter)
    # cdiv(96, 16) = 6 blocks: takes 1..6; chunk 3 (tokens 72..95) is block 5's offsets 8..15 and block 6
    assert cache.allocate_chunk(adapter) == [1, 2, 3, 4, 5, 6]
    assert cache.chunk_write_slots(adapter).tolist() == list(range(88, 96)) + list(range(96, 112))
    cache.write_chunk_kv(0, chunk_values(3, 0), chunk_values(3, 0), adapter)
    keys = np.asarray(cache.key_cache(0))
    np.testing.assert_array_equal(contiguous(keys, [1, 2, 3, 4, 5, 6], 72), chunk_values(3, 0)[0])
    assert np.all(keys[0] == 0) and not np.isnan(keys).any() and not keys[5, :8].any()
    assert np.count_nonzero(np.abs(keys).sum(axis=(1, 2, 3))) == 2  # exactly blocks 5 and 6
    cache.commit_chunk(adapter)  # n=96: skipped 48 -> [2, 4): blocks 4, 3 freed, highest index first
    assert cache.block_table(adapter) == [1, 2, 0, 0, 5, 6] and queue(cache)[-2:] == [4, 3]


# -- layer indices and chunk K/V (issue 13): refused with a clear error; a refused call changes nothing -----

def snapshot(cache, adapters):
    return (np.asarray(cache._kv.k).copy(), np.asarray(cache._kv.v).copy(), cache.num_free_blocks(),
            queue(cache), [cache.block_table(a) for a in adapters])


def assert_unchanged(cache, adapters, before):
    after = snapshot(cache, adapters)
    np.testing.assert_array_equal(after[0], before[0])
    np.testing.assert_array_equal(after[1], before[1])
    assert after[2:] == before[2:]


def test_layer_indices_out_of_range_or_not_ints_are_refused():
    cache = cross_cache()  # 2 layers, fp32, 4 heads, 64 dims, chunk 16
    adapter = cache.begin_request("r")
    cache.allocate_chunk(adapter)
    cache.populate_cross_attention("s1", "text", POS, layer_kv(1.0, 2.0))
    chunk = np.ones((1, 16, 4, 64), np.float32)
    before = snapshot(cache, [adapter])
    for index in (2, 3, -3, 1 << 40):
        message = (rf"^layer_index {index} is out of range for 2 layers: expected 0 <= layer_index < 2 "
                   r"\(or -2 <= layer_index < 0 from the end\)$")
        with pytest.raises(IndexError, match=message):
            cache.write_chunk_kv(index, chunk, chunk, adapter)
        for read in (cache.key_cache, cache.value_cache):
            with pytest.raises(IndexError, match=rf"^layer_idx {index} is out of range for 2 layers"):
                read(index)
        with pytest.raises(IndexError, match=rf"^layer_idx {index} is out of range for 2 layers"):
            cache.read_cross_attention_kv("s1", "text", index, POS)
    for index, kind in ((True, "bool"), (np.bool_(False), "bool"), (1.0, "float"), ("0", "str"), (None, "NoneType")):
        with pytest.raises(TypeError, match=f"^layer_index must be an int, got {kind}"):
            cache.write_chunk_kv(index, chunk, chunk, adapter)
        with pytest.raises(TypeError, match=f"^layer_idx must be an int, got {kind}"):
            cache.key_cache(index)
        with pytest.raises(TypeError, match=f"^layer_idx must be an int, got {kind}"):
            cache.read_cross_attention_kv("s1", "text", index, POS)
    assert_unchanged(cache, [adapter], before)
    # what the seed's per-layer lists accept: numpy ints, and negative indices from the end
    np.testing.assert_array_equal(np.asarray(cache.key_cache(-1)), np.asarray(cache.key_cache(np.int64(1))))
    assert float(cache.read_cross_attention_kv("s1", "text", -1, POS)["k"][0, 0, 0, 0]) == 2.0
    assert float(cache.read_cross_attention_kv("s1", "text", np.int32(0), POS)["k"][0, 0, 0, 0]) == 1.0
    cache.write_chunk_kv(-1, chunk, 2 * chunk, adapter)  # layer 1
    block = cache.block_table(adapter)[0]
    assert float(cache.key_cache(1)[block].min()) == 1.0 and float(abs(cache.key_cache(0)).max()) == 0.0


def test_chunk_kv_of_the_wrong_shape_or_dtype_is_refused():
    cache = cross_cache()
    adapter = cache.begin_request("r")
    cache.allocate_chunk(adapter)
    good = np.ones((1, 16, 4, 64), np.float32)
    before = snapshot(cache, [adapter])
    for shape in ((1, 1, 4, 64), (1, 15, 4, 64), (1, 17, 4, 64), (0, 16, 4, 64), (1, 16, 2, 64), (1, 16, 4, 32),
                  (16, 4), (4, 64), (1, 1, 16, 4, 64)):
        message = (r"^new_k must have shape \(1, 16, 4, 64\) \(batch 0 is written\) or \(16, 4, 64\): one K/V per "
                   rf"token of the chunk, got {re.escape(str(shape))}$")
        with pytest.raises(ValueError, match=message):
            cache.write_chunk_kv(0, np.ones(shape, np.float32), good, adapter)
        with pytest.raises(ValueError, match="^new_v must have shape"):
            cache.write_chunk_kv(0, good, np.ones(shape, np.float32), adapter)
    for dtype in (np.int32, np.int8, np.uint8, bool, np.complex64):
        with pytest.raises(TypeError, match=rf"^new_k must have a floating dtype \(the pool holds float32\), got "
                                            rf"{np.dtype(dtype).name}$"):
            cache.write_chunk_kv(0, np.ones((1, 16, 4, 64), dtype), good, adapter)
        with pytest.raises(TypeError, match="^new_v must have a floating dtype"):
            cache.write_chunk_kv(1, good, np.ones((1, 16, 4, 64), dtype), adapter)  # new_k valid: not written
    with pytest.raises(TypeError, match="^new_k must have a floating dtype"):
        cache.write_chunk_kv(0, [[1, 2]], good, adapter)
    assert_unchanged(cache, [adapter], before)
    # what the seed writes: batch 0 of a batched chunk, an unbatched chunk, other float dtypes cast
    block = cache.block_table(adapter)[0]
    batched = np.stack([good[0] * 3, good[0] * 4])
    cache.write_chunk_kv(0, batched, np.ones((16, 4, 64), np.float16), adapter)
    assert float(cache.key_cache(0)[block].max()) == 3.0 and float(cache.value_cache(0)[block].min()) == 1.0


def test_writes_of_an_unallocated_chunk_are_refused_and_change_nothing():
    cache = cross_cache()
    adapter = cache.begin_request("r")
    good = np.ones((1, 16, 4, 64), np.float32)
    before = snapshot(cache, [adapter])
    # the seed's table lookup raises IndexError too (torch indexing an empty / short table)
    with pytest.raises(IndexError, match=r"^AR-Diffusion request 'r' has no allocated block for tokens \[0, 16\) "
                                         r"of its in-flight chunk \(table \[\]\); call allocate_chunk"):
        cache.write_chunk_kv(0, good, good, adapter)
    with pytest.raises(IndexError, match="has no allocated block"):
        cache.chunk_write_slots(adapter)
    assert_unchanged(cache, [adapter], before)
    cache.allocate_chunk(adapter)
    cache.commit_chunk(adapter)  # the next chunk is not allocated yet
    before = snapshot(cache, [adapter])
    with pytest.raises(IndexError, match=r"for tokens \[16, 32\) of its in-flight chunk \(table \[1\]\)"):
        cache.write_chunk_kv(0, good, good, adapter)
    assert_unchanged(cache, [adapter], before)
    partial = frame_cache(layers=1)  # chunk 24, block 16: 8 tokens take one page, tokens 16..23 have none
    adapter = partial.begin_request("p")
    assert partial.allocate_token_slots(adapter, 8) == [1]
    before = snapshot(partial, [adapter])
    with pytest.raises(IndexError, match=r"for tokens \[16, 24\) of its in-flight chunk \(table \[1\]\)"):
        partial.write_chunk_kv(0, chunk_values(0, 0), chunk_values(0, 0), adapter)
    assert_unchanged(partial, [adapter], before)
