"""The session table (plain Python): slots, LRU order, shard balance and every slot-to-row map."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arkv_jax.cache.sessions import SessionTable

BRANCHES = ("positive", "negative")


def test_sizes_and_row_maps():
    table = SessionTable(num_shards=4, slots_per_shard=2, branches=BRANCHES)
    assert (table.capacity, table.rows_per_shard, table.num_rows) == (8, 4, 16)
    assert table.slot_rows(5) == [10, 11]
    local = table.slot_local_rows(5)  # slot 5 is the second slot of shard 2
    assert local.shape == (4, 2) and local[2].tolist() == [2, 3]
    assert (np.delete(local, 2, axis=0) == -1).all()
    shard, row = table.split_rows(np.array([10, 11, 3]))
    assert shard.tolist() == [2, 2, 0] and row.tolist() == [2, 3, 3]
    assert table.every_local_row().tolist() == [[0, 1, 2, 3]] * 4
    assert SessionTable.pool_pages(2, np.array([0, 5]), 10).tolist() == [20, 25]


def test_new_sessions_go_to_the_least_loaded_shard_and_lru_order_is_kept():
    table = SessionTable(num_shards=4, slots_per_shard=2, branches=BRANCHES)
    for sid in "abcdefgh":
        table.admit(sid)
    assert [table.shard(table.slot(sid)) for sid in "abcdefgh"] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert table.sessions == tuple("abcdefgh") and table.least_recent == "a" and table.is_full
    table.touch(["a", "c"])
    assert table.sessions == tuple("bdefghac") and table.least_recent == "b"
    slot_b = table.remove("b")
    assert "b" not in table and not table.is_full
    table.admit("i")  # the only free slot
    assert table.slot("i") == slot_b and table.is_full
    with pytest.raises(RuntimeError, match="every session slot is taken"):
        table.admit("j")
    with pytest.raises(ValueError, match="already resident"):
        table.admit("a")
    with pytest.raises(KeyError, match="Unknown session 'b'; open it first"):
        table.slot("b")
    with pytest.raises(KeyError, match="Unknown KV branch 'x'"):
        table.rows(["a"], ["x"])
    with pytest.raises(KeyError, match="no session is resident"):
        _ = SessionTable(1, 1, BRANCHES).least_recent


def test_batches():
    table = SessionTable(num_shards=1, slots_per_shard=3, branches=BRANCHES)
    for sid in "abc":
        table.admit(sid)
    local, owners = table.batch(["c", "a"], ["negative"], full_batch=False)
    assert local.tolist() == [[5, 1]] and owners == ("c", "a")
    local, owners = table.batch(["c"], BRANCHES, full_batch=True)
    assert local.tolist() == [[-1, -1, -1, -1, 4, 5]] and owners == (None, None, None, None, "c", "c")
    sharded = SessionTable(num_shards=2, slots_per_shard=1, branches=BRANCHES)
    sharded.admit("a")
    sharded.admit("b")
    local, owners = sharded.batch(["b"], ["negative", "positive"], full_batch=True)
    assert local.tolist() == [[-1, -1], [1, 0]] and owners == (None, None, "b", "b")
    with pytest.raises(ValueError, match="a compact batch needs one shard"):
        sharded.batch(["a"], BRANCHES, full_batch=False)


@settings(max_examples=100, deadline=None)
@given(shards=st.integers(1, 4), slots=st.integers(1, 3), branches=st.integers(1, 3),
       ops=st.lists(st.tuples(st.sampled_from(["admit", "remove", "touch"]), st.integers(0, 9)), max_size=40))
def test_every_map_agrees_with_every_other(shards, slots, branches, ops):
    """After any admits, removals and touches: slots are distinct and balanced over shards, and a
    session's global rows, shard-local rows, lifecycle rows and full-batch rows name the same rows."""
    names = [f"b{i}" for i in range(branches)]
    table = SessionTable(shards, slots, names)
    for op, i in ops:
        sid = f"s{i}"
        if op == "admit" and sid not in table and not table.is_full:
            loads = np.bincount([table.shard(table.slot(s)) for s in table.sessions], minlength=shards)
            slot = table.admit(sid)
            assert loads[table.shard(slot)] == loads.min()
        elif op == "remove" and sid in table:
            table.remove(sid)
        elif op == "touch" and sid in table:
            table.touch([sid])
            assert table.sessions[-1] == sid
    resident = list(table.sessions)
    assert len({table.slot(s) for s in resident}) == len(resident)
    local, owners = table.batch(resident, names, full_batch=True)
    assert local.shape == (shards, slots * branches)
    flat = local.reshape(-1)
    for sid in resident:
        slot = table.slot(sid)
        rows = table.rows([sid])
        assert rows.tolist() == table.slot_rows(slot)
        shard, row = table.split_rows(rows)
        assert (shard == table.shard(slot)).all()
        assert table.slot_local_rows(slot)[table.shard(slot)].tolist() == row.tolist()
        batch_rows = range(slot * branches, (slot + 1) * branches)
        assert flat[list(batch_rows)].tolist() == row.tolist()
        assert {owners[b] for b in batch_rows} == {sid}
    assert sum(o is not None for o in owners) == len(resident) * branches
