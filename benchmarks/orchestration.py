"""Cost of the per-chunk block-table bookkeeping (no model compute).

One jitted, donated step per chunk: visible window + allocate + slot mapping + commit, for S
sessions per call; and for one session at increasing video lengths (the state is compacted, so the
cost must not grow). Anchor (vLLM-Omni's host path, measured on a 2-core CPU like CI's): 52 us per
chunk at 100 chunks for one session, 459 us per chunk averaged over 4,000 chunks, 34 us per
session-chunk with 256 sessions.

The facade (:class:`arkv_jax.cache.PagedKVCache`) adds host work per chunk: session lookup, one
jitted prepare (window + allocation into a pending state), one small host check of the allocation,
and the donated write + commit. Its cost per session-chunk (model compute excluded, K/V writes
included) is measured for 1 and 64 sessions.

Run: ``python -m benchmarks.orchestration [--quick]``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from arkv_jax import state as core
from arkv_jax.cache import PagedKVCache
from arkv_jax.config import CacheGeometry, WindowPolicy
from arkv_jax.step import prepare_chunk
from benchmarks import harness

# vLLM-Omni's test geometry (seed-semantics.md §5.4): a frame is one 16-token page; sink 1, window 5.
# float32 pools: XLA:CPU upcasts every fp16/bf16 pool update to f32 across the whole pool, which
# would measure that CPU artefact instead of the cache (accelerators update 16-bit pools in place).
GEOMETRY = CacheGeometry(2, 4, 64, "float32", tokens_per_frame=16, frames_per_forward=1)
WINDOW = WindowPolicy(window_frames=5, sink_frames=1)


def chunk_step(state: core.BlockTableState, rows: jax.Array):
    """The bookkeeping of one chunk for every row: what a rollout calls once per chunk."""
    state, inputs, ok_alloc = prepare_chunk(state, rows, 1)
    state, ok_commit = core.commit(state, rows, 1)
    return state, (ok_alloc & ok_commit, inputs.lengths, inputs.write_pages[:, 0])


def fresh_state(sessions: int) -> tuple[core.BlockTableState, jax.Array]:
    """A state with ``sessions`` active rows and room for all their windows."""
    pages = sessions * (WINDOW.resident_frames + 2) + 2
    layout = core.StateLayout.from_config(GEOMETRY, WINDOW, pages)
    state = core.init_state(layout, sessions)
    rows = jnp.arange(sessions, dtype=jnp.int32)
    state, _ = core.begin(state, rows)
    return state, rows


def stepper(state, rows, steps_per_sample: int):
    """A callable running ``steps_per_sample`` donated chunk steps on its own copy of the state."""
    step = jax.jit(chunk_step, donate_argnums=0)
    holder = [state]

    def run():
        out = None
        for _ in range(steps_per_sample):
            holder[0], out = step(holder[0], rows)
        return out

    return run


@functools.partial(jax.jit, static_argnums=2, donate_argnums=0)
def advance(state, rows, chunks: int):
    """Runs ``chunks`` chunk steps on device (to reach a long video quickly)."""
    return jax.lax.fori_loop(0, chunks, lambda _, s: chunk_step(s, rows)[0], state)


def facade_chunk(sessions: int):
    """A callable running one facade chunk (prepare, commit with ready K/V) for ``sessions``."""
    cache = PagedKVCache(GEOMETRY, WINDOW, available_bytes=(sessions + 4) * 8 * GEOMETRY.page_bytes,
                         memory_fraction=1.0, session_capacity=sessions, backend="xla")
    ids = [f"s{i}" for i in range(sessions)]
    for sid in ids:
        cache.open(sid)
    shape = (GEOMETRY.num_layers, sessions, GEOMETRY.tokens_per_frame, GEOMETRY.num_kv_heads, GEOMETRY.head_dim)
    kv = jnp.ones(shape, GEOMETRY.dtype)

    def run():
        with cache.chunk(ids, 1) as step:
            step.commit(kv, kv)
        return cache.pools

    for _ in range(10):  # past the window fill
        run()
    return run


def main(argv=None) -> None:
    args = harness.parse_args(__doc__.splitlines()[0], argv)
    reps = args.reps or (5 if args.quick else 15)
    steps = 20 if args.quick else 50
    sessions_list = (1, 8, 64, 256, 1024)
    lengths = (100, 1_000, 100_000)

    cases = {}
    for sessions in sessions_list:
        state, rows = fresh_state(sessions)
        state = advance(state, rows, 10)  # past the window fill: steady state with eviction
        cases[("sessions", sessions)] = stepper(state, rows, steps)
    for length in lengths:
        state, rows = fresh_state(1)
        state = advance(state, rows, length)
        assert int(state.committed_frames[0]) == length
        cases[("length", length)] = stepper(state, rows, steps)
    for sessions in (1, 64):
        cases[("facade", sessions)] = facade_chunk(sessions)
    seconds = harness.interleaved_medians(cases, reps=reps, warmup=2)
    per_call = {key: value / (1 if key[0] == "facade" else steps) * 1e6 for key, value in seconds.items()}

    per_session = {str(n): per_call[("sessions", n)] / n for n in sessions_list}
    per_length = {str(n): per_call[("length", n)] for n in lengths}
    rows_out = [(f"{n} sessions / call", per_call[("sessions", n)], per_session[str(n)]) for n in sessions_list]
    rows_out += [(f"1 session at {n:,} chunks", per_length[str(n)], per_length[str(n)]) for n in lengths]
    per_facade = {str(n): per_call[("facade", n)] / n for n in (1, 64)}
    rows_out += [(f"facade, {n} sessions / chunk", per_call[("facade", n)], per_facade[str(n)]) for n in (1, 64)]

    print("block-table bookkeeping per chunk (visible window + allocate + slot mapping + commit), jitted, donated")
    harness.print_table(("case", "us per call", "us per session-chunk"), rows_out)
    harness.emit({
        "us_per_session_chunk": per_session,
        "us_per_chunk_by_video_length": per_length,
        "length_ratio_100k_vs_100": per_length["100000"] / per_length["100"],
        "facade_us_per_session_chunk": per_facade,
        "vllm_omni_anchor_us": {"1_session_100_chunks": 52, "1_session_avg_4000_chunks": 459,
                           "256_sessions_per_session_chunk": 34},
    })


if __name__ == "__main__":
    main()
