"""The facade under threads: concurrent chunks are refused at once, no commit is lost, no page leaks."""

import threading

import jax.numpy as jnp
import numpy as np

from arkv_jax.cache import PagedKVCache
from arkv_jax.config import CacheGeometry, WindowPolicy

GEOMETRY = CacheGeometry(1, 1, 4, "float32", tokens_per_frame=4, frames_per_forward=1)
WINDOW = WindowPolicy(window_frames=3, sink_frames=1)


def test_threads_on_disjoint_sessions_lose_no_commit_and_leak_no_page():
    cache = PagedKVCache(GEOMETRY, WINDOW, available_bytes=1 << 24, memory_fraction=1.0, session_capacity=8)
    threads, per_thread, chunks = 4, 2, 6
    groups = [[f"t{t}s{i}" for i in range(per_thread)] for t in range(threads)]
    for group in groups:
        for sid in group:
            cache.open(sid)
    committed = {sid: 0 for group in groups for sid in group}
    refused, errors = [0], []
    barrier = threading.Barrier(threads)

    def work(group):
        barrier.wait()
        kv = jnp.ones((1, len(group), 4, 1, 4))
        done = 0
        while done < chunks:
            try:
                with cache.chunk(group, 1) as step:
                    first = np.asarray(step.inputs.first_frame).tolist()
                    assert first == [committed[sid] for sid in group], (first, group)
                    step.commit(kv, kv)
            except RuntimeError as exc:
                if "while a chunk is in flight" not in str(exc):
                    errors.append(exc)
                    return
                refused[0] += 1
                continue
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
                return
            for sid in group:  # commit() returned normally: the sessions advanced
                committed[sid] += 1
            done += 1

    workers = [threading.Thread(target=work, args=(g,)) for g in groups]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors, errors
    assert all(n == chunks for n in committed.values())
    with cache.chunk(list(committed), 1) as step:  # the state agrees: every frame was counted
        assert np.asarray(step.inputs.first_frame).tolist() == [chunks] * len(committed)
    held = sum(len(p) for p in cache.pages_held(list(committed)).values())
    assert cache.num_free_pages() + held == cache.total_pages
    for sid in committed:
        cache.close(sid)
    assert cache.num_free_pages() == cache.total_pages


def test_mutations_from_other_threads_are_refused_while_a_chunk_is_in_flight():
    cache = PagedKVCache(GEOMETRY, WINDOW, available_bytes=1 << 24, memory_fraction=1.0, session_capacity=3)
    cache.open("a")
    cache.open("b")
    outcomes = {}

    def other():
        for name, call in (("close", lambda: cache.close("b")), ("reset", lambda: cache.reset("b")),
                           ("open", lambda: cache.open("c")), ("clear", lambda: cache.clear_cross_attention("b"))):
            try:
                call()
                outcomes[name] = "ran"
            except RuntimeError as exc:
                outcomes[name] = str(exc)

    with cache.chunk(["a"], 1) as step:
        t = threading.Thread(target=other)
        t.start()
        t.join()
        step.commit(jnp.ones((1, 1, 4, 1, 4)), jnp.ones((1, 1, 4, 1, 4)))
    assert all("while a chunk is in flight" in v for v in outcomes.values()), outcomes
    assert cache.sessions == ("b", "a")
