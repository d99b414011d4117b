"""The jitted block-table state against the pure-Python reference model of vLLM-Omni."""

import functools
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from arkv_jax import state as core
from arkv_jax.config import CacheGeometry, WindowPolicy
from arkv_jax.step import prepare_chunk
from tests.reference_model import RefCache

NUM_ROWS = 3
MAX_FRAMES_IN_FLIGHT = 3
# (tokens_per_frame, block_size, sink, window, reset, spare pages): a fixed menu, so that jitted
# steps compile once per configuration instead of once per example. It covers sink 0-3, window 1-8,
# both modes, a frame per page and frames of 2 and 3 pages with padding, and tight and loose pools.
CONFIGS = [
    (4, 4, 0, 1, False, 0), (4, 4, 1, 2, False, 3), (4, 4, 3, 8, False, 0), (4, 4, 2, 3, True, 5),
    (5, 3, 1, 2, False, 0), (5, 3, 0, 4, True, 2), (8, 3, 2, 1, False, 4), (8, 3, 3, 5, False, 30),
]

def stored_table(state, row: int) -> list[int]:
    """A state row's page table as stored: its ``num_pages`` live entries, compacted."""
    return np.asarray(state.tables[row, : int(state.num_pages[row])]).tolist()


def assert_seed_table(state, row: int, seed_table: list[int]) -> None:
    """The state row holds the seed's table: the seed keeps a null (0) placeholder for each evicted
    page, all of them right after the sink, where the state compacts them away and counts them."""
    stored = stored_table(state, row)
    evicted = [index for index, page in enumerate(seed_table) if page == 0]
    assert [page for page in seed_table if page != 0] == stored
    assert len(evicted) == int(state.evicted_pages[row])
    sink = min(state.layout.sink_pages, len(stored))
    assert evicted == list(range(sink, sink + len(evicted)))


# One jitted function per operation; shapes stay fixed inside a machine run (rows padded to 3).
begin = jax.jit(core.begin)
allocate = jax.jit(core.allocate)
commit = jax.jit(core.commit)
end = jax.jit(core.end)
visible = jax.jit(core.visible_window)
resident = jax.jit(core.resident_pages)
free_queue = jax.jit(core.free_queue)
slots = jax.jit(core.slot_mapping, static_argnums=2)
write_pages = jax.jit(core.write_pages, static_argnums=2)


def config_layout(config):
    """``(geometry, layout)`` of one :data:`CONFIGS` entry: room for every row's sink + window and
    ``MAX_FRAMES_IN_FLIGHT`` frames in flight, plus the entry's spare pages."""
    tokens, block, sink, window, reset, spare_blocks = config
    geometry = CacheGeometry(1, 1, 1, "float32", tokens, block_size=block)
    ppf = geometry.pages_per_frame
    layout = core.StateLayout.from_config(
        geometry, WindowPolicy(window, sink, reset), 2 + ppf * (sink + window + MAX_FRAMES_IN_FLIGHT) + spare_blocks,
        table_width=(sink + window + MAX_FRAMES_IN_FLIGHT + 2) * ppf)
    return geometry, layout


def padded(rows):
    return jnp.asarray(list(rows) + [-1] * (NUM_ROWS - len(rows)), jnp.int32)


def per_row(values):
    return jnp.asarray(list(values) + [0] * (NUM_ROWS - len(values)), jnp.int32)


class StateMachine(RuleBasedStateMachine):
    """Random interleavings of begin / allocate / commit / end over several rows, batched calls
    included, checked after every step against the reference model."""

    @initialize(config=st.sampled_from(CONFIGS))
    def setup(self, config):
        tokens, block, sink, window, reset, _ = config
        self.geometry, self.layout = config_layout(config)
        self.state = core.init_state(self.layout, NUM_ROWS)
        self.ref = RefCache(num_blocks=self.layout.num_blocks, tokens_per_frame=tokens, block_size=block,
                            sink_frames=sink, window_frames=window, reset_at_boundary=reset)

    @rule(rows=st.lists(st.integers(0, NUM_ROWS - 1), min_size=1, max_size=NUM_ROWS, unique=True),
          prefill_frames=st.integers(0, 2))
    def begin_rows(self, rows, prefill_frames):
        prefill = prefill_frames * self.geometry.tokens_per_frame
        self.state, ok = begin(self.state, padded(rows), prefill)
        for row, row_ok in zip(rows, np.asarray(ok)):
            assert row_ok == (row not in self.ref.rows)
            if row_ok:
                self.ref.begin(row, prefill)

    @rule(rows=st.lists(st.integers(0, NUM_ROWS - 1), min_size=1, max_size=NUM_ROWS, unique=True),
          data=st.data())
    def allocate_rows(self, rows, data):
        self.check_allocate(
            rows, [data.draw(st.integers(1, MAX_FRAMES_IN_FLIGHT * self.geometry.tokens_per_frame)) for _ in rows])

    def check_allocate(self, rows, tokens):
        self.state, ok = allocate(self.state, padded(rows), per_row(tokens))
        for row, n, row_ok in zip(rows, tokens, np.asarray(ok)):
            expected = row in self.ref.rows and self.ref.allocate(row, n)
            assert row_ok == expected, (row, n)
            if row_ok:
                got = np.asarray(slots(self.state, jnp.asarray([row]), n))[0].tolist()
                assert got == self.ref.slots(row, n)

    @rule(rows=st.lists(st.integers(0, NUM_ROWS - 1), min_size=1, max_size=NUM_ROWS, unique=True),
          data=st.data())
    def commit_rows(self, rows, data):
        self.check_commit(rows, [data.draw(st.integers(0, MAX_FRAMES_IN_FLIGHT)) for _ in rows])

    def check_commit(self, rows, frames):
        expected_pages = {}
        for row, m in zip(rows, frames):
            if row in self.ref.rows:
                pages = np.asarray(write_pages(self.state, jnp.asarray([row]), MAX_FRAMES_IN_FLIGHT))[0]
                expected_pages[row] = pages[: m * self.layout.pages_per_frame]
        self.state, ok = commit(self.state, padded(rows), per_row(frames))
        for row, m, row_ok in zip(rows, frames, np.asarray(ok)):
            if row not in self.ref.rows:
                assert not row_ok
                continue
            ref_row = self.ref.rows[row]
            allocated = len(ref_row.table) >= self.ref.pages_for(self.ref.computed(ref_row) + m * self.ref.tpf)
            assert row_ok == allocated
            if row_ok:
                # The pages a commit forward writes are the ones the reference holds for those frames.
                first = self.ref.pages_for(self.ref.computed(ref_row))
                assert expected_pages[row].tolist() == ref_row.table[first:first + len(expected_pages[row])]
                self.ref.commit(row, m)

    @rule(rows=st.lists(st.integers(0, NUM_ROWS - 1), min_size=1, max_size=NUM_ROWS, unique=True),
          frames=st.integers(1, MAX_FRAMES_IN_FLIGHT), repeat=st.integers(1, 6))
    def rollout_rows(self, rows, frames, repeat):
        """Whole chunks (allocate, then commit every frame), several times: long enough to evict."""
        tokens = frames * self.geometry.tokens_per_frame
        for _ in range(repeat):
            self.check_allocate(rows, [tokens] * len(rows))
            self.check_commit(rows, [frames] * len(rows))

    @rule(rows=st.lists(st.integers(0, NUM_ROWS - 1), min_size=1, max_size=NUM_ROWS, unique=True))
    def end_rows(self, rows):
        self.state, ok = end(self.state, padded(rows))
        for row, row_ok in zip(rows, np.asarray(ok)):
            assert row_ok == (row in self.ref.rows)
            if row_ok:
                self.ref.end(row)

    @precondition(lambda self: hasattr(self, "ref"))
    @invariant()
    def matches_reference(self):
        state, ref = self.state, self.ref
        assert int(state.free_count) == len(ref.free)
        assert np.asarray(free_queue(state))[: len(ref.free)].tolist() == list(ref.free)
        pages, counts = resident(state, jnp.arange(NUM_ROWS))
        for row in range(NUM_ROWS):
            assert bool(state.active[row]) == (row in ref.rows)
            if row not in ref.rows:
                continue
            assert_seed_table(state, row, ref.table(row))
            assert np.asarray(pages[row, : int(counts[row])]).tolist() == ref.resident(row)
            for current in (1, 2):
                window = visible(state, jnp.asarray([row]), current)
                ref_pages, ref_length = ref.visible(row, current)
                assert int(window.lengths[0]) == ref_length
                padding = [0] * (window.pages.shape[1] - len(ref_pages))
                assert np.asarray(window.pages[0]).tolist() == ref_pages + padding

    @precondition(lambda self: hasattr(self, "ref"))
    @invariant()
    def no_page_is_lost_or_shared(self):
        held = [b for row in self.ref.rows for b in self.ref.resident(row)]
        free = np.asarray(free_queue(self.state))[: int(self.state.free_count)].tolist()
        assert 0 not in held and 0 not in free
        assert len(set(held)) == len(held)
        assert sorted(held + free) == list(range(1, self.layout.num_blocks))


TestStateMachine = pytest.mark.slow(StateMachine.TestCase)
TestStateMachine.settings = settings(max_examples=80, stateful_step_count=25, deadline=None)


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(config=st.sampled_from(CONFIGS),
       chunks=st.lists(st.integers(1, MAX_FRAMES_IN_FLIGHT), min_size=2, max_size=10))
def test_visible_window_follows_the_window_policy_rule(config, chunks):
    """Chunk after chunk of any sizes, ``visible_window`` shows exactly the frames that
    ``WindowPolicy.visible_history`` names for the chunk's first frame: the sink, then the recent
    frames, in time order, with their pages and lengths; and each commit keeps exactly
    ``WindowPolicy.kept_frames`` (the state and the policy share one window rule)."""
    geometry, layout = config_layout(config)
    policy = WindowPolicy(layout.window_frames, layout.sink_frames, layout.reset_at_boundary)
    ppf, tpf = layout.pages_per_frame, geometry.tokens_per_frame
    state, _ = begin(core.init_state(layout, NUM_ROWS), padded([0]), 0)
    first = 0
    for frames in chunks:
        window = visible(state, jnp.asarray([0]), frames)
        sink, recent = (int(x) for x in policy.visible_history(first, frames))
        expected = list(range(sink)) + list(range(first - recent, first))
        ids = np.asarray(window.frame_ids[0]).tolist()
        assert ids == expected + [-1] * (len(ids) - len(expected)), (first, frames)
        assert int(window.lengths[0]) == len(expected) * tpf
        pages = np.asarray(window.pages[0])
        assert np.all(pages[:len(expected) * ppf] > 0) and not pages[len(expected) * ppf:].any()
        state, ok = allocate(state, padded([0]), per_row([frames * tpf]))
        assert bool(ok[0])
        state, ok = commit(state, padded([0]), per_row([frames]))
        assert bool(ok[0])
        first += frames
        # The commit evicted exactly the policy's skipped frames: the row holds its kept frames.
        assert int(state.num_pages[0]) == int(policy.kept_frames(first)) * ppf
        assert int(state.evicted_pages[0]) == int(policy.skipped_frames(first)) * ppf


def tiny_layout(sink=1, window=2, tokens=4, block=4, blocks=32, reset=False):
    geometry = CacheGeometry(1, 1, 1, "float32", tokens, block_size=block, frames_per_forward=2)
    return core.StateLayout.from_config(geometry, WindowPolicy(window, sink, reset), blocks)


@pytest.mark.slow
class ChexVariants(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_rollout_steps_agree_with_and_without_jit(self):
        layout = tiny_layout()
        step = self.variant(functools.partial(_chunk_step, frames=2))
        state = core.init_state(layout, 4)
        state, _ = core.begin(state, jnp.arange(4))
        for _ in range(6):
            state, ok = step(state, jnp.arange(4))
            assert bool(jnp.all(ok))
        # sink 1 + window 2 frames resident per row after every commit.
        assert np.asarray(state.num_pages).tolist() == [3, 3, 3, 3]
        assert int(state.free_count) == 31 - 12


def _chunk_step(state, rows, frames):
    """The per-chunk bookkeeping of a rollout: visible window, allocate, write pages, commit."""
    state, inputs, ok_alloc = prepare_chunk(state, rows, frames)
    state, ok_commit = core.commit(state, rows, frames)
    return state, ok_alloc & ok_commit & (inputs.lengths >= 0) & jnp.all(inputs.write_pages > 0, axis=1)


def test_one_compilation_across_a_thousand_chunks():
    layout = tiny_layout(sink=2, window=3, tokens=6, block=4)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(state, rows):
        return _chunk_step(state, rows, 2)

    state = core.init_state(layout, 2)
    state, _ = core.begin(state, jnp.arange(2))
    for _ in range(1000):
        state, ok = step(state, jnp.arange(2))
    assert bool(jnp.all(ok))
    assert np.asarray(state.committed_frames).tolist() == [2000, 2000]
    # Constant memory: the sink and the window, nothing more.
    assert np.asarray(state.num_pages).tolist() == [5 * 2, 5 * 2]


@pytest.mark.slow
def test_failed_allocation_leaves_the_row_untouched_and_serves_later_rows():
    layout = tiny_layout(sink=0, window=8, blocks=6)  # 5 free pages
    state = core.init_state(layout, 3)
    state, _ = core.begin(state, jnp.arange(3))
    state, ok = core.allocate(state, jnp.array([0, 1, 2]), jnp.array([8, 16, 8]))
    assert np.asarray(ok).tolist() == [True, False, True]
    assert np.asarray(state.num_pages).tolist() == [2, 0, 2]
    assert np.asarray(state.tables[:, :2]).tolist() == [[1, 2], [0, 0], [3, 4]]
    assert int(state.free_count) == 1


def test_refused_calls_change_nothing():
    layout = tiny_layout()
    state = core.init_state(layout, 2)
    state, _ = core.begin(state, jnp.array([0]))
    state, _ = core.allocate(state, jnp.array([0]), 8)
    before = jax.tree.map(np.asarray, state)
    for new_state, ok in (
        core.begin(state, jnp.array([0])),                   # already active
        core.allocate(state, jnp.array([1]), 4),             # inactive row
        core.allocate(state, jnp.array([0]), 0),             # no tokens
        core.allocate(state, jnp.array([0]), 4 * 100),       # wider than the table
        core.commit(state, jnp.array([0]), 3),               # frames without pages
        core.commit(state, jnp.array([0]), -1),
        core.end(state, jnp.array([1])),
        core.allocate(state, jnp.array([-1]), 4),            # padding
    ):
        assert not bool(ok[0])
        chex.assert_trees_all_equal(jax.tree.map(np.asarray, new_state), before)


@pytest.mark.slow
def test_swap_pages_gives_fresh_pages_frees_the_old_and_is_all_or_nothing():
    layout = tiny_layout(sink=1, window=3, tokens=4, block=4, blocks=16)
    state = core.init_state(layout, 3)
    state, _ = core.begin(state, jnp.array([0, 1]))
    for _ in range(3):
        state, _ = core.allocate(state, jnp.array([0, 1]), 4)
        state, _ = core.commit(state, jnp.array([0, 1]), 1)
    rows = jnp.array([1, -1, 0])
    tables = np.asarray(state.tables)
    marks = np.zeros((3, layout.table_width), bool)
    marks[0, [1, 2]] = marks[2, [0, 2]] = True
    fresh = np.asarray(core.fresh_pages(state, rows, marks))
    free = np.asarray(core.free_queue(state))[:4].tolist()
    assert fresh[0, [1, 2]].tolist() + fresh[2, [0, 2]].tolist() == free  # ring head, rows in batch order
    swapped, ok = core.swap_pages(state, rows, marks)
    assert bool(ok)
    new = np.asarray(swapped.tables)
    assert new[1, [1, 2]].tolist() == free[:2] and new[0, [0, 2]].tolist() == free[2:]
    assert new[1, 0] == tables[1, 0] and new[0, 1] == tables[0, 1]  # unmarked positions kept
    queue = np.asarray(core.free_queue(swapped))[:int(swapped.free_count)].tolist()
    assert queue[-4:] == [tables[1, 1], tables[1, 2], tables[0, 0], tables[0, 2]]
    assert int(swapped.free_count) == int(state.free_count)
    held = np.concatenate([new[r, :n] for r, n in enumerate(np.asarray(swapped.num_pages))])
    assert sorted(held.tolist() + queue) == list(range(1, 16))  # every page held or free, once
    inactive = np.zeros_like(marks)
    inactive[1, 0] = True  # row 2 is inactive
    short = state.replace(free_count=jnp.int32(3))  # a ring with 3 free pages, for 4 marks
    for case, bad_rows, bad_marks in ((state, jnp.array([0, 2, 1]), inactive),
                                      (state, rows, np.roll(marks, 3, axis=1)),  # past the stored pages
                                      (short, rows, marks)):
        before = jax.tree.map(np.asarray, case)
        new_state, ok = core.swap_pages(case, bad_rows, bad_marks)
        assert not bool(ok)
        chex.assert_trees_all_equal(jax.tree.map(np.asarray, new_state), before)


@pytest.mark.slow
def test_long_prefill_is_evicted_at_the_first_commit_in_one_catch_up():
    """A prefill longer than the window: vLLM-Omni frees every out-of-window frame at the first
    commit, highest index first."""
    layout = tiny_layout(sink=1, window=1, tokens=4, block=4, blocks=16)
    ref = RefCache(num_blocks=16, tokens_per_frame=4, block_size=4, sink_frames=1, window_frames=1)
    state = core.init_state(layout, 1)
    state, _ = core.begin(state, jnp.array([0]), 16)
    ref.begin(0, 16)
    for _ in range(3):
        state, ok = core.allocate(state, jnp.array([0]), 4)
        assert bool(ok[0]) and ref.allocate(0, 4)
        state, ok = core.commit(state, jnp.array([0]), 1)
        ref.commit(0, 1)
        assert_seed_table(state, 0, ref.table(0))
        assert np.asarray(free_queue(state))[: len(ref.free)].tolist() == list(ref.free)


@pytest.mark.slow
def test_visible_window_positions_and_lengths():
    layout = tiny_layout(sink=1, window=3, tokens=4, block=4)
    state = core.init_state(layout, 1)
    state, _ = core.begin(state, jnp.array([0]))
    for _ in range(5):
        state, _ = core.allocate(state, jnp.array([0]), 4)
        state, _ = core.commit(state, jnp.array([0]), 1)
    # Committed frames 0..4; resident: sink 0 + window 2, 3, 4. A 2-frame forward sees 0 and 4.
    window = core.visible_window(state, jnp.array([0]), 2)
    assert np.asarray(window.frame_ids[0]).tolist() == [0, 4, -1, -1]
    assert int(window.lengths[0]) == 8
    assert np.asarray(window.pages[0, :2]).tolist() == [1, 5]


def test_resize_keeps_rows_and_refuses_to_shrink():
    layout = tiny_layout()
    state = core.init_state(layout, 2)
    state, _ = core.begin(state, jnp.array([1]))
    state, _ = core.allocate(state, jnp.array([1]), 8)
    grown = core.resize(state, num_rows=4, table_width=layout.table_width + 3)
    assert grown.tables.shape == (4, layout.table_width + 3)
    assert stored_table(grown, 1) == stored_table(state, 1)
    assert int(grown.evicted_pages[1]) == int(state.evicted_pages[1])
    with pytest.raises(ValueError, match="cannot shrink"):
        core.resize(state, num_rows=1)


def test_the_state_is_a_registered_dataclass_pytree():
    layout = tiny_layout()
    state = core.init_state(layout, 2)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    assert len(leaves) == 9 and all(isinstance(leaf, jax.Array) for leaf in leaves)
    rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
    assert isinstance(rebuilt, core.BlockTableState) and rebuilt.layout == layout
    assert state.replace(free_head=state.free_head + 1).free_head == 1 and state.free_head == 0


def test_the_functional_core_loads_neither_flax_nor_the_cache():
    code = ("import sys, arkv_jax.state, arkv_jax.step, pallas_kernels; "
            "bad = [m for m in ('flax', 'arkv_jax.cache') if m in sys.modules]; assert not bad, bad")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def test_layout_validation():
    geometry = CacheGeometry(1, 1, 1, "float32", 4)
    with pytest.raises(ValueError, match="num_blocks must be at least 2"):
        core.StateLayout.from_config(geometry, WindowPolicy(1), 1)
    with pytest.raises(ValueError, match="num_rows must be positive, got 0"):
        core.init_state(core.StateLayout.from_config(geometry, WindowPolicy(1), 4), 0)


@pytest.mark.slow
def test_evict_frees_after_the_sink_highest_index_first_compacts_and_is_monotone():
    """state.evict: row 0 holds a sink frame and 3 more (2 pages each), row 1 a sink frame and 1 more;
    evicting 2 (row 0) and 9 (row 1, clipped to its 1 allocated frame) frees 6, 5, 4, 3 then 12, 11
    (highest table index first, rows in batch order) and compacts the tables; asking for no more than
    already evicted, padding and inactive rows change nothing."""
    layout = tiny_layout(sink=1, window=8, tokens=6, block=4)  # 2 pages per frame; the window never fills
    state, _ = begin(core.init_state(layout, NUM_ROWS), padded([0, 1]))
    state, ok = allocate(state, padded([0, 1]), per_row([6 * 4, 6 * 2]))
    assert ok.tolist()[:2] == [True, True] and stored_table(state, 0) == list(range(1, 9))
    assert stored_table(state, 1) == [9, 10, 11, 12]
    free = int(state.free_count)
    evict = jax.jit(core.evict)  # every call below has NUM_ROWS rows: one compilation
    state, ok = evict(state, jnp.array([0, -1, 1]), jnp.array([2, 5, 9]))
    assert ok.tolist() == [True, False, True]
    assert stored_table(state, 0) == [1, 2, 7, 8] and stored_table(state, 1) == [9, 10]
    assert np.asarray(state.evicted_pages[:2]).tolist() == [4, 2] and int(state.free_count) == free + 6
    assert np.asarray(free_queue(state))[: int(state.free_count)].tolist()[-6:] == [6, 5, 4, 3, 12, 11]
    assert np.asarray(state.committed_frames[:2]).tolist() == [0, 0]
    before = jax.tree.map(np.asarray, state)
    for rows, frames in (([0], [1]), ([0, 1], [2, 1]), ([1], [0]), ([2], [3]), ([-1], [3])):
        new_state, ok = evict(state, padded(rows), per_row(frames))
        assert ok.tolist()[: len(rows)] == [row in (0, 1) for row in rows]
        chex.assert_trees_all_equal(jax.tree.map(np.asarray, new_state), before)
    # one more frame of row 0: its next frame after the sink (pages 7, 8) goes, highest index first
    state, _ = evict(state, padded([0]), per_row([3]))
    assert stored_table(state, 0) == [1, 2] and int(state.evicted_pages[0]) == 6
    assert np.asarray(free_queue(state))[: int(state.free_count)].tolist()[-2:] == [8, 7]
