"""One process of the two-process tests (``tests/test_processes.py``): run as
``python -m tests.multiprocess_worker PROCESS_ID NUM_PROCESSES PORT OUT_DIR``.

Joins the job with 4 CPU devices, then on a (4, 2) and an (8, 1) global mesh drives the rollout
of ``tests/test_sharded_cache.py``'s churn through :class:`arkv_jax.lockstep.Lockstep` (only
process 0's events count), writing after every step its session table, and at the end the latents
of the sessions it read, the joins refused at capacity and what a chunk failing on process 1 did.
Then, on the (4, 2) mesh, ``tests/test_switch_prompt.py``'s prompt switches as :class:`Switch`
events (one session of each process switches; a switch of an unknown session is refused).
"""

from __future__ import annotations

import json
import pathlib
import sys

from arkv_jax import processes


def main(process_id: int, num_processes: int, port: int, out: pathlib.Path) -> None:
    processes.initialize(process_id, num_processes, f"127.0.0.1:{port}", local_devices=4)
    import jax
    import numpy as np

    jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py
    from arkv_jax.lockstep import Join, Leave, Lockstep
    from arkv_jax.models import MODEL_CONFIGS, init_random
    from arkv_jax.processes import StepFailed
    from arkv_jax.sharding import make_mesh
    from tests.test_sharded_cache import CHURN_JOINS, CHURN_LEAVES, tiny_rollout
    from tests.test_switch_prompt import mesh_rollout

    model = init_random(MODEL_CONFIGS["tiny"], seed=0)
    report = {}
    for data, model_axis in ((4, 2), (8, 1)):
        rollout = tiny_rollout(model, make_mesh(data, model_axis), 1)
        lockstep, tables, latents = Lockstep(rollout), [], {}
        for index in range(6):
            events = [Leave(s) for s in CHURN_LEAVES.get(index, ())]
            events += [Join(s, f"prompt {s}", seed=ord(s)) for s in CHURN_JOINS.get(index, ())]
            outcome = lockstep.step(events if process_id == 0 else ())
            latents.update(outcome.left)
            tables.append([list(rollout.cache.slots.items()), [[s, rollout.num_frames(s)] for s in rollout.sessions]])
        latents.update({s: rollout.latents(s) for s in rollout.sessions if rollout.cache.is_local(s)})
        np.savez(out / f"latents_{data}x{model_axis}_{process_id}.npz", **latents)
        entry = {"tables": tables, "traces": rollout.num_traces}
        if model_axis == 1:  # refusals and a failing process, on the (8, 1) mesh
            joins = [Join(f"x{i}", "more", seed=i) for i in range(rollout.cache.session_capacity)]
            outcome = lockstep.step(joins if process_id == 0 else ())
            entry["refused"] = {str(i): f"{type(e).__name__}: {e}" for i, e in outcome.refused.items()}
            entry["after_refusal"] = list(rollout.cache.slots.items())
            if process_id == 1:  # the next chunk fails here only, before its agreement
                def broken(*args):
                    raise ZeroDivisionError("injected failure")

                rollout.chunk_fn, working = broken, rollout.chunk_fn
            try:
                lockstep.step()
                entry["failed"] = None
            except StepFailed as error:
                entry["failed"] = [type(error).__name__, str(error), error.process]
            if process_id == 1:
                rollout.chunk_fn = working
            entry["after_failure"] = [list(rollout.cache.slots.items()), rollout.cache.num_free_pages()]
            lockstep.step()  # the group goes on after a failed step
            entry["after_recovery"] = [[s, rollout.num_frames(s)] for s in rollout.sessions]
        report[f"{data}x{model_axis}"] = entry
    report["switch"] = switch_prompts(process_id, mesh_rollout(model, make_mesh(4, 2)), out)
    (out / f"report_{process_id}.json").write_text(json.dumps(report))


def failing_switch(process_id: int, lockstep, switch) -> list:
    """One step whose only event is ``switch``, with the recache forward raising on process 1:
    ``[error class, message, failing process, pages free after]``."""
    from arkv_jax.processes import StepFailed

    rollout = lockstep.rollout
    working = rollout.recache_fn
    if process_id == 1:
        def broken(*args):
            raise ZeroDivisionError("injected recache failure")

        rollout.recache_fn = broken
    try:
        lockstep.step([switch] if process_id == 0 else ())
        failed = [None, None, None]
    except StepFailed as error:
        failed = [type(error).__name__, str(error), error.process]
    rollout.recache_fn = working
    return failed + [rollout.cache.num_free_pages()]


def switch_prompts(process_id: int, rollout, out: pathlib.Path) -> dict:
    """The mesh prompt-switch run through :class:`Lockstep`; saves the latents this process read and
    returns where each session sat, the frames each switch recomputed, the refusals and the tables."""
    import numpy as np

    from arkv_jax.lockstep import Join, Leave, Lockstep, Switch
    from tests.test_switch_prompt import MESH_SESSIONS, MESH_STEPS, MESH_SWITCHES

    lockstep, latents, entry = Lockstep(rollout), {}, {"recomputed": {}, "refused": {}, "tables": []}
    for c in range(MESH_STEPS + 1):  # the last step: every session leaves, no chunk
        events = [Join(s, f"prompt {s}", seed=ord(s)) for s in MESH_SESSIONS] if c == 0 else []
        if c in MESH_SWITCHES:
            sid, sink = MESH_SWITCHES[c]
            events += [Switch(sid, f"new {c}", sink=sink), Switch("nobody", "a cat")]
        if c == MESH_STEPS:
            events = [Leave(s) for s in MESH_SESSIONS]
        if c == 5:  # first a switch of "b" whose recache forward fails on process 1 only
            entry["failed_switch"] = failing_switch(process_id, lockstep, Switch("b", "never"))
        outcome = lockstep.step(events if process_id == 0 else ())
        latents.update(outcome.left)
        entry["recomputed"].update(outcome.recomputed)
        entry["refused"].update({f"{c}.{i}": f"{type(e).__name__}: {e}" for i, e in outcome.refused.items()})
        frames = [[s, rollout.num_frames(s)] for s in rollout.sessions]
        entry["tables"].append([list(rollout.cache.slots.items()), frames])
        if c == 0:
            entry["local"] = [s for s in MESH_SESSIONS if rollout.cache.is_local(s)]
    np.savez(out / f"latents_switch_{process_id}.npz", **latents)
    entry["free_pages"] = [rollout.cache.num_free_pages(), rollout.cache.total_pages]
    return entry


if __name__ == "__main__":
    with processes.fail_fast():
        main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), pathlib.Path(sys.argv[4]))
