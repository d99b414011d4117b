"""The seed's manager API on the functional core: seed-semantics §5.4 traces and §13.1-§13.3 cases."""

import re

import numpy as np
import pytest

from arkv_jax.compat.vllm_omni import (
    ARDiffusionKVBranchSpec,
    ARDiffusionKVCache,
    ARDiffusionKVConfig,
    ARDiffusionRequestAdapter,
    chunk_slot_mapping,
    compute_num_blocks,
    compute_slot_mapping,
    resident_block_ids,
)
from arkv_jax.state import free_queue

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
    assert cache._k_pool.shape == (2, cache.num_blocks_total, 16, 4, 64)
    assert float(abs(cache._k_pool).max()) == 0.0


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
    assert not cache.is_cross_attention_populated("s1", "text", POS) and "s1" not in cache._cross_sessions
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
    assert "s1" not in cache._cross_sessions
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
