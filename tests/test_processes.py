"""Several processes: two real JAX processes on localhost (``tests/multiprocess_worker.py``), each
with 4 CPU devices and gloo collectives, drive one rollout in lockstep on a (4, 2) and an (8, 1)
global mesh; the latents equal the one-device run, the session tables agree after every step, a
join refused at capacity is refused on both, and a chunk failing on one process fails on both;
prompt switches of sessions on either process give the one-device latents too.
Plus the single-process parts: the event codec, the agreement and the launcher's cleanup.
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
import pytest

from arkv_jax import processes
from arkv_jax.lockstep import Join, Leave, Switch, decode_events, encode_events
from arkv_jax.processes import ProcessGroup, StepFailed

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: Bound on the two workers together (both compile the tiny model for two meshes on shared cores).
WORKER_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """Runs the two workers; returns ``(reports, latents)``: each process's report, and each
    mesh's latents by session, merged over the processes (each session read by exactly one)."""
    out = tmp_path_factory.mktemp("processes")
    port = str(processes.free_port())
    logs = [open(out / f"worker_{i}.log", "w") for i in range(2)]
    try:
        status = processes.launch(
            [processes.python_module("tests.multiprocess_worker", str(i), "2", port, str(out)) for i in range(2)],
            timeout=WORKER_TIMEOUT_S, stdout=logs, stderr=logs, env={"JAX_PLATFORMS": "cpu"})
    finally:
        for log in logs:
            log.close()
    tails = "\n".join((out / f"worker_{i}.log").read_text()[-3000:] for i in range(2))
    assert status == [0, 0], f"worker exit statuses {status}:\n{tails}"
    reports = [json.loads((out / f"report_{i}.json").read_text()) for i in range(2)]
    latents = {}
    for shape in ("4x2", "8x1", "switch"):
        parts = [dict(np.load(out / f"latents_{shape}_{i}.npz")) for i in range(2)]
        assert not parts[0].keys() & parts[1].keys(), "a session read by both processes"
        latents[shape] = {**parts[0], **parts[1]}
    return reports, latents


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["4x2", "8x1"])
def test_two_processes_generate_the_one_device_latents(two_processes, shape):
    from arkv_jax.models import MODEL_CONFIGS, init_random
    from tests.test_sharded_cache import churn, tiny_rollout

    reports, latents = two_processes
    expected = churn(tiny_rollout(init_random(MODEL_CONFIGS["tiny"], seed=0), None, 3))
    assert latents[shape].keys() == expected.keys()
    for sid, want in expected.items():
        np.testing.assert_allclose(latents[shape][sid], want, atol=1e-5, err_msg=sid)
    assert [r[shape]["traces"] for r in reports] == [1, 1]


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["4x2", "8x1"])
def test_the_session_tables_agree_after_every_step(two_processes, shape):
    reports, _ = two_processes
    tables = [r[shape]["tables"] for r in reports]
    assert len(tables[0]) == 6 and tables[0] == tables[1]
    assert [s for s, _ in tables[0][3][1]] == ["a", "c", "d"]  # b left, d joined


@pytest.mark.slow
def test_a_join_refused_at_capacity_is_refused_on_both(two_processes):
    reports, _ = two_processes
    first, second = (r["8x1"] for r in reports)
    assert first["refused"] == second["refused"]
    assert sorted(first["refused"]) == ["5", "6", "7"]  # 3 sessions + 5 joins fill the 8 slots
    assert all(m.startswith("RuntimeError: 8 sessions are active") for m in first["refused"].values())
    assert first["after_refusal"] == second["after_refusal"] and len(first["after_refusal"]) == 8


@pytest.mark.slow
def test_a_chunk_failing_on_one_process_fails_on_both(two_processes):
    reports, _ = two_processes
    first, second = (r["8x1"] for r in reports)
    for entry in (first, second):
        name, message, process = entry["failed"]
        assert name == "StepFailed" and process == 1
        assert "ZeroDivisionError: injected failure" in message and "nothing was committed" in message
    assert first["after_failure"] == second["after_failure"]  # same table, same free pages
    # The failed chunk was committed nowhere: the next step gave every session one chunk.
    assert first["after_recovery"] == second["after_recovery"]
    frames = dict(first["after_recovery"])
    assert frames["x0"] == 4 and frames["a"] == 16  # 2 chunks of 2 frames after joining; a: 6 + 2


@pytest.mark.slow
def test_prompt_switches_on_either_process_give_the_one_device_latents(two_processes):
    from arkv_jax.models import MODEL_CONFIGS, init_random
    from tests.test_switch_prompt import MESH_SWITCHES, mesh_rollout, run_mesh_switches

    reports, latents = two_processes
    first, second = (r["switch"] for r in reports)
    switched = {sid for sid, _ in MESH_SWITCHES.values()}
    assert {sid for sid in first["local"] if sid in switched} and {sid for sid in second["local"] if sid in switched}
    expected = run_mesh_switches(mesh_rollout(init_random(MODEL_CONFIGS["tiny"], seed=0), None))
    assert latents["switch"].keys() == expected.keys()
    for sid, want in expected.items():
        np.testing.assert_allclose(latents["switch"][sid], want, atol=1e-5, rtol=0, err_msg=sid)
    assert first["recomputed"] == second["recomputed"] and sorted(first["recomputed"]) == sorted(switched)
    assert first["tables"] == second["tables"]
    assert first["free_pages"] == second["free_pages"] and first["free_pages"][0] == first["free_pages"][1]


@pytest.mark.slow
def test_a_switch_failing_on_one_process_fails_on_both_and_changes_nothing(two_processes):
    """Process 1's recache forward raises in a switch of process 0's session "b": both raise
    StepFailed, nothing is swapped in (the same free pages on both, and "b"'s latents equal the
    one-device run's without that switch: the test above)."""
    reports, _ = two_processes
    first, second = (r["switch"] for r in reports)
    assert "b" in first["local"]
    for entry in (first, second):
        name, message, process, _ = entry["failed_switch"]
        assert name == "StepFailed" and process == 1
        assert "ZeroDivisionError: injected recache failure" in message
    assert first["failed_switch"][3] == second["failed_switch"][3]


@pytest.mark.slow
def test_a_switch_of_an_unknown_session_is_refused_on_both(two_processes):
    reports, _ = two_processes
    first, second = (r["switch"] for r in reports)
    assert first["refused"] == second["refused"] and len(first["refused"]) == 2
    assert all(m == "KeyError: \"unknown session 'nobody'\"" for m in first["refused"].values())


def test_events_round_trip_and_refuse_other_types():
    events = (Join("a", "a red fox", seed=3), Leave("b"), Switch("a", "a cat", sink="recompute"))
    assert decode_events(encode_events(events)) == events
    assert decode_events(b"") == ()
    with pytest.raises(TypeError, match="events must be Join, Leave or Switch, got 'a'"):
        encode_events(["a"])


def test_one_process_group_agrees_at_once_and_fails_with_the_error():
    group = ProcessGroup()
    assert (group.index, group.count) == (0, 1)
    group.agree(None, ("table",))
    assert group.broadcast(b"events") == b"events"
    error = ValueError("bad")
    with pytest.raises(StepFailed, match="failed on process 0 of 1.*ValueError: bad") as caught:
        group.agree(error, ("table",))
    assert caught.value.__cause__ is error and caught.value.process == 0


def test_initialize_refuses_bad_arguments():
    with pytest.raises(ValueError, match=r"process_id must be an int in \[0, 1\], got 2"):
        processes.initialize(2, 2, "127.0.0.1:1")
    with pytest.raises(TypeError, match="coordinator_address must be a 'host:port' string"):
        processes.initialize(0, 2, "localhost")


def test_launch_kills_the_others_when_one_fails():
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    failing = [sys.executable, "-c", "raise SystemExit(3)"]
    # No timeout: the failure alone must end the sleeper (a launch that only noticed it at the
    # deadline, or after the sleeper, returns [0, 3]).
    assert processes.launch([sleeper, failing]) == [-9, 3]
    assert processes.launch([sleeper], timeout=0.5) == [-9]
