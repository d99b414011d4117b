"""Issue #21 item 2: code written for vLLM-Omni reads a request's tokens back through compat's public
views with vLLM-Omni's own formulas, for every ``chunk_size`` / ``block_size``.

vLLM-Omni lays a request's tokens out contiguously: token ``p`` sits at flat slot
``block_table[p // block_size] * block_size + p % block_size`` of ``key_cache`` / ``value_cache``
(``paged.compute_slot_mapping``; ``chunk_write_slots`` is that over the in-flight chunk), a block may
hold the end of one chunk and the start of the next, and a commit nulls the wholly skipped blocks after
the sink (seed-semantics §4.4 [S2]). :class:`SeedModel` is that block management, written here from
the seed and seed-semantics §4.2-§5.3 (it shares no code with arkv_jax); the tests write distinct K/V
per token and layer through ``write_chunk_kv`` and read them back through ``block_table`` +
``key_cache`` / ``value_cache``, ``compute_slot_mapping`` and ``window_block_ids``.
"""

from __future__ import annotations

import collections

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from arkv_jax import state as core
from arkv_jax.compat.vllm_omni import (
    ARDiffusionKVBranchSpec,
    ARDiffusionKVCache,
    ARDiffusionKVConfig,
    chunk_slot_mapping,
    compute_slot_mapping,
)
from tests.tiers import slow_except

HEADS, DIM, LAYERS = 2, 2, 2
free_queue = jax.jit(core.free_queue)  # one compilation per state layout, not one per array operation


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SeedModel:
    """vLLM-Omni's block management for any chunk and block size, in pure Python.

    vLLM's ``BlockPool`` (null block 0, FIFO free queue, frees appended in the order given),
    per-request tables that keep null placeholders, ``allocate_slots`` (``cdiv(computed + n,
    block_size) - len(table)`` new blocks from the queue head, after the window walk) and the
    ChunkWindow rule: ``skipped`` tokens after the sink (§4.2), table indices
    ``[ceil(sink_tokens / block_size), floor((sink_tokens + skipped) / block_size))`` clipped to the
    table, walked backwards to the first null entry (§4.4 [S2]; S1's rule when a chunk is a block).
    """

    def __init__(self, *, num_blocks: int, chunk_size: int, block_size: int, sink_chunks: int,
                 window_chunks: int, reset_at_boundary: bool = False) -> None:
        self.free = collections.deque(range(1, num_blocks))
        self.chunk, self.bs = chunk_size, block_size
        self.sink_tokens = sink_chunks * chunk_size
        self.window, self.reset = window_chunks, reset_at_boundary
        self.tables: dict[object, list[int]] = {}
        self.computed: dict[object, int] = {}

    def skipped_tokens(self, n: int) -> int:
        if self.reset:
            return max(0, n // self.chunk * self.chunk - self.sink_tokens)
        return max(0, n - self.window * self.chunk - self.sink_tokens) // self.chunk * self.chunk

    def begin(self, rid, prefill: int = 0) -> None:
        self.tables[rid], self.computed[rid] = [], prefill

    def remove_skipped_blocks(self, rid) -> None:
        skipped = self.skipped_tokens(self.computed[rid])
        if skipped <= 0:
            return
        table = self.tables[rid]
        first = cdiv(self.sink_tokens, self.bs)
        last = min((self.sink_tokens + skipped) // self.bs, len(table))
        for index in range(last - 1, first - 1, -1):
            if table[index] == 0:
                break
            self.free.append(table[index])
            table[index] = 0

    def allocate(self, rid, num_tokens: int) -> bool:
        self.remove_skipped_blocks(rid)
        table = self.tables[rid]
        new = max(0, cdiv(self.computed[rid] + num_tokens, self.bs) - len(table))
        if new > len(self.free):
            return False
        table.extend(self.free.popleft() for _ in range(new))
        return True

    def commit(self, rid) -> None:
        self.computed[rid] += self.chunk
        self.remove_skipped_blocks(rid)

    def end(self, rid) -> None:
        table = self.tables.pop(rid)
        del self.computed[rid]
        self.free.extend(b for b in reversed(table) if b != 0)

    def slots(self, rid, num_tokens: int) -> list[int]:
        """The in-flight tokens' slots; -1 where the table has no block (or the null block)."""
        table, out = self.tables[rid], []
        for p in range(self.computed[rid], self.computed[rid] + num_tokens):
            block = table[p // self.bs] if p // self.bs < len(table) else 0
            out.append(block * self.bs + p % self.bs if block != 0 else -1)
        return out

    def resident_tokens(self, rid) -> list[int]:
        """Computed tokens whose block is still in the table (not null)."""
        table = self.tables[rid]
        return [p for p in range(self.computed[rid]) if p // self.bs < len(table) and table[p // self.bs] != 0]

    def window_tokens(self, rid) -> list[int]:
        """The tokens attention reads after a commit: the sink and the tokens after the skipped ones."""
        n = self.computed[rid]
        kept_from = self.sink_tokens + self.skipped_tokens(n)
        return [p for p in range(n) if p < self.sink_tokens or p >= kept_from]


def token_kv(positions, layer: int) -> np.ndarray:
    """K of the tokens at ``positions`` in ``layer``: distinct per token, layer, head and channel, never 0."""
    positions = np.asarray(positions, np.float32)[:, None, None]
    return 1 + 100 * positions + 10 * layer + np.arange(HEADS * DIM, dtype=np.float32).reshape(1, HEADS, DIM)


def make_cache(chunk, block, *, sink=0, window=2, reset=False, capacity=1):
    config = ARDiffusionKVConfig(enable=True, chunk_size=chunk, window_chunks=window, sink_chunks=sink,
                                 reset_at_boundary=reset, gpu_memory_fraction=1.0)
    page = 2 * block * HEADS * DIM * 4 * LAYERS
    return ARDiffusionKVCache(config, num_layers=LAYERS, num_kv_heads=HEADS, head_size=DIM, dtype="float32",
                              block_size=block, max_model_len=1 << 20, available_bytes=200 * page,
                              kv_branches=(ARDiffusionKVBranchSpec("main", 0),), session_capacity=capacity,
                              device=jax.devices("cpu")[0])


def read_back(cache, adapter, positions):
    """K and V of ``positions`` per layer, read as vLLM-Omni code reads them: through the block table and
    the contiguous slot formula, from ``key_cache`` / ``value_cache`` (block-shaped and flat)."""
    table = cache.block_table(adapter)
    positions = np.asarray(positions, np.int64)
    slots = np.asarray(compute_slot_mapping(table, positions, cache.block_size)) if len(positions) else positions
    blocks = np.asarray(table, np.int64)[positions // cache.block_size]
    np.testing.assert_array_equal(slots, blocks * cache.block_size + positions % cache.block_size)
    out = []
    for layer in range(LAYERS):
        keys, values = np.asarray(cache.key_cache(layer)), np.asarray(cache.value_cache(layer))
        assert keys.shape == values.shape == (cache.num_blocks_total, cache.block_size, HEADS, DIM)
        k = keys[blocks, positions % cache.block_size]
        np.testing.assert_array_equal(k, keys.reshape(-1, HEADS, DIM)[slots])
        out.append((k, values[blocks, positions % cache.block_size]))
    return out


def check_views(cache, adapter, model, rid, written):
    """Every public view agrees with the seed model, and every written token that is still resident
    reads back exactly what was written."""
    assert cache.block_table(adapter) == model.tables[rid]
    assert cache.window_block_ids(adapter) == [b for b in model.tables[rid] if b != 0]
    assert np.asarray(free_queue(cache.state))[: cache.num_free_blocks()].tolist() == list(model.free)
    resident = [p for p in model.resident_tokens(rid) if p in written]
    for layer, (k, v) in enumerate(read_back(cache, adapter, resident)):
        np.testing.assert_array_equal(k, token_kv(resident, layer))
        np.testing.assert_array_equal(v, -token_kv(resident, layer))


def run_rollout(chunk, block, *, sink, window, reset=False, prefill=0, spans=(1,) * 7):
    """Per span of ``m`` chunks: allocate (``allocate_chunk`` or ``allocate_token_slots(m * chunk)``), then
    per chunk: check the write slots, write every layer, read back, commit, read back."""
    cache = make_cache(chunk, block, sink=sink, window=window, reset=reset)
    model = SeedModel(num_blocks=cache.managed_num_blocks, chunk_size=chunk, block_size=block, sink_chunks=sink,
                      window_chunks=window, reset_at_boundary=reset)
    adapter = cache.begin_request("r", prefill_prefix_tokens=prefill)
    model.begin("r", prefill)
    written: set[int] = set()
    for m in spans:
        table = cache.allocate_chunk(adapter) if m == 1 else cache.allocate_token_slots(adapter, m * chunk)
        assert model.allocate("r", m * chunk)
        assert table == model.tables["r"]
        for _ in range(m):
            start = adapter.num_computed_tokens
            positions = list(range(start, start + chunk))
            slots = cache.chunk_write_slots(adapter).tolist()
            assert slots == model.slots("r", chunk)
            assert slots == chunk_slot_mapping(cache.block_table(adapter), start, chunk, block).tolist()
            for layer in range(LAYERS):
                kv = token_kv(positions, layer)[None]
                cache.write_chunk_kv(layer, kv, -kv, adapter)
            written.update(positions)
            check_views(cache, adapter, model, "r", written)
            cache.commit_chunk(adapter)
            model.commit("r")
            check_views(cache, adapter, model, "r", written)
            # what attention reads after the commit (sink + window) is resident, all of it written
            window_tokens = [p for p in model.window_tokens("r") if p >= prefill]
            assert set(window_tokens) <= set(model.resident_tokens("r"))
            for layer, (k, _) in enumerate(read_back(cache, adapter, window_tokens)):
                np.testing.assert_array_equal(k, token_kv(window_tokens, layer))
    cache.end_request(adapter)
    model.end("r")
    assert np.asarray(free_queue(cache.state))[: cache.num_free_blocks()].tolist() == list(model.free)


def test_issue_example_chunk_6_block_4_reads_back_every_token():
    """The issue's case: chunk 6, block 4. vLLM-Omni's tables grow [1, 2], [1, 2, 3], [1, 2, 3, 4, 5]
    (block 2 holds the end of chunk 0 and the start of chunk 1), and each chunk reads back whole."""
    cache = make_cache(6, 4, window=3)
    adapter = cache.begin_request("r")
    tables = []
    for k in range(3):
        tables.append(cache.allocate_chunk(adapter))
        assert cache.chunk_write_slots(adapter).tolist() == list(range(4 + 6 * k, 4 + 6 * (k + 1)))
        values = np.full((1, 6, HEADS, DIM), 11.0 + k, np.float32)
        cache.write_chunk_kv(0, values, values, adapter)
        (k_read, v_read), _ = read_back(cache, adapter, range(6 * k, 6 * (k + 1)))
        assert k_read[:, 0, 0].tolist() == [11.0 + k] * 6 and v_read[:, 0, 0].tolist() == [11.0 + k] * 6
        cache.commit_chunk(adapter)
    assert tables == [[1, 2], [1, 2, 3], [1, 2, 3, 4, 5]]


GEOMETRIES = [
    (6, 4), (5, 4), (3, 4), (7, 8), (10, 4), (24, 16), (8, 16), (1, 4),  # not multiples
    (4, 4), (8, 4), (12, 4), (16, 16), (32, 16),                         # multiples
]


@pytest.mark.parametrize("chunk, block", slow_except(GEOMETRIES, fast=[(6, 4)]))
def test_tokens_written_through_compat_read_back_with_vllm_formulas(chunk, block):
    """Sink 1, window 1: the sink's last block and the window's first are shared with evicted chunks."""
    run_rollout(chunk, block, sink=1, window=1)


# fast tier: the window above, and tests/test_compat_vllm_omni.py's traces for these windows
@pytest.mark.slow
@pytest.mark.parametrize("chunk, block", [(6, 4), (5, 4), (3, 4), (24, 16), (16, 16)])
@pytest.mark.parametrize("sink, window, reset", [(0, 2, False), (2, 3, False), (1, 2, True)])
def test_other_windows_read_back_with_vllm_formulas(chunk, block, sink, window, reset):
    run_rollout(chunk, block, sink=sink, window=window, reset=reset)


# fast tier: multi-chunk spans and prefills in tests/test_compat_vllm_omni.py's traces and random sequences
@pytest.mark.slow
@pytest.mark.parametrize("chunk, block", [(6, 4), (7, 8), (24, 16), (16, 16)])
def test_multi_chunk_spans_and_prefill_read_back(chunk, block):
    """``allocate_token_slots`` over several chunks (frames_per_block > 1), after a prefill that ends
    inside a block."""
    run_rollout(chunk, block, sink=1, window=2, prefill=3, spans=(2, 1, 3, 2))


@pytest.mark.slow  # fast tier: the fixed geometries above
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunk=st.integers(1, 12), block=st.sampled_from([1, 2, 3, 4, 8, 16]), sink=st.integers(0, 2),
       window=st.integers(1, 3), reset=st.booleans(), prefill=st.integers(0, 20),
       spans=st.lists(st.integers(1, 3), min_size=1, max_size=5))
def test_any_geometry_reads_back_with_vllm_formulas(chunk, block, sink, window, reset, prefill, spans):
    run_rollout(chunk, block, sink=sink, window=window, reset=reset, prefill=prefill, spans=tuple(spans))
