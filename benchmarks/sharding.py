"""Per-chunk step on 1 vs 8 devices: sessions over ``"data"``, K/V heads over ``"model"``.

One jitted, donated step per chunk, for every session at once: per data shard the block-table
bookkeeping (visible window, allocate, pages to write, commit), then the sharded window attention
(every layer) and the sharded paged write of the chunk's K/V (all layers), through
:mod:`arkv_jax.sharding`. Throughput is chunks per second (one chunk of every session per step,
so session-chunks/s = steps/s x sessions), medians over interleaved repetitions.

The device count is fixed when JAX starts, so each count runs in its own subprocess
(``--worker --devices N``; on CPU it sets ``jax_num_cpu_devices``):

- 1 device: the step with a ``(1, 1)`` mesh and the same step without ``shard_map`` at all (the
  plain functions and kernels), interleaved: the cost of the wrappers on one device.
- 8 devices: every ``(data, model)`` with ``data * model == 8``, plus the ``(1, 1)`` mesh on one
  of the 8 devices, interleaved in the same process: the same-run ratio.

A second table times the user-level path: one ``Rollout.step()`` of the demo's tiny causal DiT
(CFG, 3 denoise forwards + 1 commit forward, host to host) for 8 sessions through
``PagedKVCache`` without a mesh (1 device), and with ``mesh=`` on ``(8, 1)`` and ``(4, 2)`` meshes
and a ``(1, 1)`` mesh on one of the 8 devices (8 devices), interleaved within each process, with the
model's parameter bytes per device (the ``"model"`` axis splits the blocks' weights).

On this project's CPU machine the 8 "devices" are 8 XLA host devices sharing the same 2 cores: one
CPU device runs most of this step on one core, 8 devices keep both cores busy, so 8 devices can be
up to ~2x faster here, and that says nothing about a TPU slice or several GPUs, where each device
has its own compute and memory. Pool bytes per device are exact.

A third table runs that rollout (8 sessions, global ``(4, 2)`` mesh, 8 CPU devices) as a JAX job of
several processes (:func:`arkv_jax.processes.launch`, ``jax.distributed`` on localhost, gloo CPU
collectives), driven by :class:`arkv_jax.lockstep.Lockstep` with no events: 1 process x 8 devices vs
2 processes x 4 devices (each process 2 data shards), one job after the other on the same cores.
Per job: ms per step (median), the step's coordination alone (the events' broadcast and the
agreement, timed apart with the devices idle: 0 on one process) and the pool bytes per device and
per process, measured and checked against the planner's (:func:`arkv_jax.planner.process_share`).
JSON: ``processes`` (by ``PROCESSESxDEVICES``), ``one_process_ms_per_step``,
``two_process_ms_per_step``, ``two_vs_one_process`` (one-process ms / two-process ms: above 1, two
processes are faster) and ``coordination_ms_per_step`` (two processes). On shared CPU cores expect
about 1x: it shows that the job runs and what the coordination costs, not a scaling.

``--quick``: smaller shapes (16 sessions, 32-wide heads, 32-token frames), 2 steps per sample and 5
reps; on 8 devices the kernel-level step on the ``(8, 1)`` and ``(1, 8)`` meshes only and the
rollout on ``(4, 2)`` only (besides the ``(1, 1)`` mesh on one device); the process jobs as
without it (about 25 s of the run on 2 cores).

Run: ``python -m benchmarks.sharding [--quick]``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks import harness

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICE_COUNTS = (1, 8)
MESHES_8 = ((8, 1), (4, 2), (2, 4), (1, 8))
QUICK_MESHES_8 = ((8, 1), (1, 8))
"""The 8-device meshes of the kernel-level step with ``--quick`` (sessions only, heads only; the
rollout table's ``(4, 2)`` mixes both)."""


def _config(quick: bool) -> dict:
    if quick:
        return dict(sessions=16, layers=2, kv_heads=8, q_heads=8, head_dim=32, tokens_per_frame=32,
                    block_size=16, sink=1, window=4, steps=2, reps=5)
    return dict(sessions=32, layers=2, kv_heads=8, q_heads=16, head_dim=64, tokens_per_frame=64,
                block_size=16, sink=1, window=4, steps=3, reps=7)


# ------------------------------------------------------------------------------------------------
# Worker (one device count per process).


def _worker(devices: int, quick: bool, reps: int | None) -> dict:
    import jax

    if devices > 1:  # only the CPU backend reads it; must precede JAX's backend start
        jax.config.update("jax_num_cpu_devices", devices)
    import jax.numpy as jnp

    from arkv_jax import sharding as sh
    from arkv_jax import state as core
    from arkv_jax.config import CacheGeometry, WindowPolicy
    from arkv_jax.sharded_kernels import sharded_window_attention, sharded_write_chunk
    from arkv_jax.step import prepare_chunk
    from pallas_kernels.layout import pool_shape
    from pallas_kernels.paged_write import write_chunk
    from pallas_kernels.window_attention import window_attention

    if jax.device_count() < devices:
        raise SystemExit(f"asked for {devices} devices, JAX has {jax.device_count()}")
    cfg = _config(quick)
    reps = reps or cfg["reps"]
    geometry = CacheGeometry(cfg["layers"], cfg["kv_heads"], cfg["head_dim"], "float32",
                             tokens_per_frame=cfg["tokens_per_frame"], block_size=cfg["block_size"])
    window = WindowPolicy(window_frames=cfg["window"], sink_frames=cfg["sink"])
    ppf, tpf, L = geometry.pages_per_frame, geometry.tokens_per_frame, geometry.num_layers
    sessions = cfg["sessions"]

    def chunk_state(state, rows):
        state, chunk, ok = prepare_chunk(state, rows, 1)
        state, ok2 = core.commit(state, rows, 1)
        return state, (chunk.pages, chunk.lengths, chunk.write_pages, ok & ok2)

    def pages_for(rows_per_shard):
        # Every row holds sink + window frames and allocates one more before its commit evicts:
        # (resident + 1) frames per row in flight at once, the null page, one spare frame.
        return rows_per_shard * (window.resident_frames + 1) * ppf + 1 + ppf

    @functools.cache
    def inputs(key):  # the same arrays for every case (placed per mesh by each case)
        k1, k2, k3 = jax.random.split(jax.random.key(key), 3)
        q = jax.random.normal(k1, (sessions, tpf, cfg["q_heads"], cfg["head_dim"]))
        k_new = jax.random.normal(k2, (L, sessions, tpf, cfg["kv_heads"], cfg["head_dim"]))
        v_new = jax.random.normal(k3, (L, sessions, tpf, cfg["kv_heads"], cfg["head_dim"]))
        return q, k_new, v_new

    def sharded_case(mesh):
        data, model = sh.check_mesh(mesh)
        rps = sessions // data
        pps = pages_for(rps)
        layout = core.StateLayout.from_config(geometry, window, pps)
        rows = jnp.tile(jnp.arange(rps, dtype=jnp.int32), (data, 1))

        @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
        def step(state, k_pool, v_pool, q, k_new, v_new):
            state, (pages, lengths, write, ok) = sh.per_shard(chunk_state, mesh)(state, rows)
            pages, lengths = pages.reshape(sessions, -1), lengths.reshape(sessions)
            outs = [sharded_window_attention(mesh, q, k_new[l], v_new[l], k_pool, v_pool, pages,
                                                lengths, layer=l, tokens_per_frame=tpf,
                                                backend="xla") for l in range(L)]
            k_pool, v_pool = sharded_write_chunk(mesh, k_pool, v_pool, k_new, v_new,
                                                    write.reshape(sessions, -1),
                                                    tokens_per_frame=tpf, backend="xla")
            return state, k_pool, v_pool, outs, ok  # outputs stay sharded: no reduction

        state = sh.init_sharded_state(layout, rps, mesh)
        state, _ = jax.jit(sh.per_shard(core.begin, mesh))(state, rows)
        k_pool, v_pool = sh.make_pools(geometry, pps, mesh)
        data_in = sh.place(mesh, inputs(0), (sh.head_spec(), sh.pool_spec(), sh.pool_spec()))
        pool_bytes = 2 * k_pool.addressable_shards[0].data.nbytes
        return _runner(step, [state, k_pool, v_pool], data_in, cfg["steps"]), pool_bytes

    def plain_case():
        pps = pages_for(sessions)
        layout = core.StateLayout.from_config(geometry, window, pps)
        rows = jnp.arange(sessions, dtype=jnp.int32)

        @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
        def step(state, k_pool, v_pool, q, k_new, v_new):
            state, (pages, lengths, write, ok) = chunk_state(state, rows)
            outs = [window_attention(q, k_new[l], v_new[l], k_pool, v_pool, pages, lengths,
                                     layer=l, tokens_per_frame=tpf, backend="xla")
                    for l in range(L)]
            k_pool, v_pool = write_chunk(k_pool, v_pool, k_new, v_new, write,
                                         tokens_per_frame=tpf, backend="xla")
            return state, k_pool, v_pool, outs, ok

        state, _ = core.begin(core.init_state(layout, sessions), rows)
        shape = pool_shape(L, pps, geometry.block_size, cfg["kv_heads"], cfg["head_dim"])
        pools = [jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32)]
        return _runner(step, [state, *pools], inputs(0), cfg["steps"]), 2 * pools[0].nbytes

    cases, pool_bytes, meshes = {}, {}, {}
    one = sh.make_mesh(1, 1, devices=jax.devices()[:1])
    if devices == 1:
        cases["plain (no shard_map)"], pool_bytes["plain (no shard_map)"] = plain_case()
        meshes["plain (no shard_map)"] = (1, 1, 1)
    name = "mesh (1, 1)" if devices == 1 else "mesh (1, 1) on 1 of 8 devices"
    cases[name], pool_bytes[name] = sharded_case(one)
    meshes[name] = (1, 1, 1)
    if devices == 8:
        for data, model in QUICK_MESHES_8 if quick else MESHES_8:
            name = f"mesh ({data}, {model})"
            cases[name], pool_bytes[name] = sharded_case(sh.make_mesh(data, model))
            meshes[name] = (data, model, 8)
    for run in cases.values():  # check every case runs correctly before timing
        ok = run()[1]
        assert bool(np.asarray(ok).all()), "a session failed to allocate: the pool is too small"
    seconds = harness.interleaved_medians(cases, reps=reps, warmup=1)
    rollouts = _rollout_cases(devices, quick)
    rollout_seconds = harness.interleaved_medians({name: r.step for name, r in rollouts.items()},
                                                  reps=reps, warmup=1)
    return {
        "devices": devices,
        "rollout": {name: {"seconds_per_step": t, "param_bytes_per_device": _bytes_per_device(rollouts[name].params)}
                    for name, t in rollout_seconds.items()},
        "cases": {name: {"seconds_per_step": seconds[name] / cfg["steps"],
                         "pool_bytes_per_device": pool_bytes[name],
                         "mesh": meshes[name]} for name in cases},
        "config": cfg,
        "cpu_count": os.cpu_count(),
        "platform": jax.devices()[0].platform,
        "device_count": jax.device_count(),
    }


ROLLOUT_SESSIONS = 8


def _bytes_per_device(tree) -> int:
    """Bytes of ``tree``'s arrays held by the first device (sharded leaves count their block)."""
    import jax

    return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree_util.tree_leaves(tree))


def _rollout(model, mesh):
    """A :class:`Rollout` of the tiny demo model over ``mesh`` (``None``: one device, no mesh), its
    cache planned for :data:`ROLLOUT_SESSIONS` sessions, with them joined."""
    from arkv_jax import sharding as sh
    from arkv_jax.cache import PagedKVCache
    from arkv_jax.planner import rollout_plan
    from arkv_jax.presets import get_preset
    from arkv_jax.rollout import Rollout, Sampler

    preset = get_preset("tiny")
    data, model_axis = sh.check_mesh(mesh) if mesh is not None else (1, 1)
    plan = rollout_plan(preset.geometry, preset.window, preset.kv_branches, preset.cross_attention,
                        ROLLOUT_SESSIONS // data, model=model_axis)
    cache = PagedKVCache(preset.geometry, preset.window, preset.kv_branches, preset.cross_attention,
                         plan=plan, mesh=mesh, backend="xla")
    rollout = Rollout(model, cache, Sampler(num_steps=3, guidance_scale=3.0), max_traces=1)
    for i in range(ROLLOUT_SESSIONS):
        rollout.join(f"s{i}", f"prompt {i}", seed=i)
    return rollout


def _rollout_cases(devices: int, quick: bool = False) -> dict:
    """:func:`_rollout` s: no mesh on 1 device; ``(1, 1)`` on one device, ``(8, 1)`` (not with
    ``quick``) and ``(4, 2)`` on 8 devices."""
    import jax

    from arkv_jax import sharding as sh
    from arkv_jax.models import MODEL_CONFIGS, init_random

    model = init_random(MODEL_CONFIGS["tiny"], seed=0)
    if devices == 1:
        return {"rollout, no mesh": _rollout(model, None)}
    cases = {"rollout, mesh (1, 1) on 1 of 8 devices": _rollout(model, sh.make_mesh(1, 1, devices=jax.devices()[:1]))}
    if not quick:
        cases["rollout, mesh (8, 1)"] = _rollout(model, sh.make_mesh(8, 1))
    cases["rollout, mesh (4, 2)"] = _rollout(model, sh.make_mesh(4, 2))
    return cases


def _runner(step, carry, data_in, steps):
    """A callable that runs ``steps`` donated steps on its own carry; returns the last outputs."""
    holder = list(carry)

    def run():
        out = None
        for _ in range(steps):
            holder[0], holder[1], holder[2], *out = step(*holder, *data_in)
        return out

    return run


# ------------------------------------------------------------------------------------------------
# Several processes: one JAX job per process count, started by arkv_jax.processes.launch.

PROCESS_MESH = (4, 2)
"""The global mesh of the process cases: on 2 processes each holds 2 data shards x 2 devices."""
PROCESS_COUNTS = (1, 2)
PROCESS_DEVICES = 8
"""CPU devices of a process job in all (``PROCESS_DEVICES // processes`` per process)."""
PROCESS_TIMEOUT_S = 600
"""Bound on one job (its processes compile the tiny model on the shared cores)."""
COORDINATION_REPS = 50
"""Timed calls of one step's coordination (a few milliseconds each)."""


def _process_worker(process_id: int, num_processes: int, port: int, quick: bool, reps: int | None) -> dict:
    """One process of a job: :func:`_rollout` over the global :data:`PROCESS_MESH`, driven by
    :class:`~arkv_jax.lockstep.Lockstep` with no events (the steady state), timed per step; then the
    step's coordination alone, with the devices idle: the events' broadcast and the agreement on the
    rollout's session table, as a step makes them (inside a step the agreement's collective also
    waits for the chunk's programs, which run asynchronously, so it is timed apart)."""
    from arkv_jax import processes

    processes.initialize(process_id, num_processes, f"127.0.0.1:{port}",
                         local_devices=PROCESS_DEVICES // num_processes)
    from arkv_jax import sharding as sh
    from arkv_jax.lockstep import Lockstep, encode_events
    from arkv_jax.models import MODEL_CONFIGS, init_random
    from arkv_jax.planner import DevicePlan

    rollout = _rollout(init_random(MODEL_CONFIGS["tiny"], seed=0), sh.make_mesh(*PROCESS_MESH))
    lockstep, no_events = Lockstep(rollout), encode_events(())
    seconds = harness.median_seconds(lambda: lockstep.step().chunk, reps=reps or _config(quick)["reps"], warmup=1)
    coordination = harness.median_seconds(lambda: (lockstep.group.broadcast(no_events), rollout.agree(None)),
                                          reps=COORDINATION_REPS, warmup=1)
    shards = [shard for pool in rollout.cache.pools for shard in pool.addressable_shards]
    per_device = sum(s.data.nbytes for s in shards if s.device == shards[0].device)
    per_process = sum(s.data.nbytes for s in shards)
    planned = DevicePlan.from_plan(rollout.cache.plan, *PROCESS_MESH, num_processes)
    if (per_device, per_process) != (planned.pool_bytes_per_device, planned.pool_bytes_per_process):
        raise AssertionError(f"pool bytes per device / process {per_device} / {per_process}, the planner's "
                             f"{planned.pool_bytes_per_device} / {planned.pool_bytes_per_process}")
    return {"processes": num_processes, "devices_per_process": len({s.device for s in shards}),
            "ms_per_step": seconds * 1e3, "coordination_ms_per_step": coordination * 1e3,
            "pool_bytes_per_device": per_device, "pool_bytes_per_process": per_process}


def _run_processes(count: int, args) -> dict:
    """Runs a :func:`_process_worker` job of ``count`` local processes on CPU; returns process 0's figures."""
    from arkv_jax import processes

    flags = ["--process-worker", "--num-processes", str(count), "--port", str(processes.free_port())]
    flags += ["--quick"] * args.quick + (["--reps", str(args.reps)] if args.reps else [])
    with tempfile.TemporaryDirectory() as folder:
        outs = [open(os.path.join(folder, f"out_{i}"), "w+") for i in range(count)]
        errs = [open(os.path.join(folder, f"err_{i}"), "w+") for i in range(count)]
        status = processes.launch(
            [processes.python_module("benchmarks.sharding", *flags, "--process-id", str(i)) for i in range(count)],
            timeout=PROCESS_TIMEOUT_S, stdout=outs, stderr=errs, env={**_worker_env(), "JAX_PLATFORMS": "cpu"})
        texts = []
        for stream in outs + errs:
            stream.seek(0)
            texts.append(stream.read())
            stream.close()
    if status != [0] * count:
        sys.stderr.write("\n".join(text[-3000:] for text in texts))
        print(f"benchmarks.sharding: the {count}-process job failed with exit statuses {status}", file=sys.stderr)
        raise SystemExit(1)
    return json.loads(texts[0].strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------
# Driver.


def _worker_env() -> dict[str, str]:
    """This environment with the repository root on ``PYTHONPATH`` (for ``-m benchmarks.sharding``)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run_worker(devices: int, args) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.sharding", "--worker", "--devices", str(devices)]
    if args.quick:
        cmd.append("--quick")
    if args.reps:
        cmd += ["--reps", str(args.reps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=_worker_env())
    if proc.returncode:
        sys.stderr.write(proc.stdout + proc.stderr)
        print(f"benchmarks.sharding: the worker for {devices} device(s) failed with exit code {proc.returncode}",
              file=sys.stderr)
        raise SystemExit(1)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _extra(parser) -> None:
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--process-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--num-processes", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)


def main(argv=None) -> None:
    args = harness.parse_args(__doc__.splitlines()[0], argv, extra=_extra)
    if args.worker:
        print(json.dumps(_worker(args.devices, args.quick, args.reps)))
        return
    if args.process_worker:
        from arkv_jax.processes import fail_fast

        with fail_fast():  # a failed process ends at once instead of holding the other at shutdown
            figures = _process_worker(args.process_id, args.num_processes, args.port, args.quick, args.reps)
            print(json.dumps(figures))
        return
    start = time.perf_counter()
    results = {n: _run_worker(n, args) for n in DEVICE_COUNTS}
    cfg = results[1]["config"]
    sessions = cfg["sessions"]
    base = results[1]["cases"]["mesh (1, 1)"]["seconds_per_step"]
    rows, figures = [], {}
    for n in DEVICE_COUNTS:
        same_run_base = results[n]["cases"].get("mesh (1, 1) on 1 of 8 devices", {}).get(
            "seconds_per_step")
        for name, case in results[n]["cases"].items():
            s = case["seconds_per_step"]
            key = f"{n}dev/{name}"
            figures[key] = {
                "chunks_per_s": 1.0 / s,
                "session_chunks_per_s": sessions / s,
                "ms_per_step": s * 1e3,
                "pool_bytes_per_device": case["pool_bytes_per_device"],
                "vs_1dev_mesh11": base / s,
                "vs_same_run_1_device": (same_run_base / s) if same_run_base else None,
            }
            rows.append((n, name, s * 1e3, 1.0 / s, sessions / s,
                         case["pool_bytes_per_device"] / 2**20, base / s,
                         "-" if not same_run_base else f"{same_run_base / s:.3f}"))
    cores = results[8]["cpu_count"]
    print(f"per-chunk step: {sessions} sessions, {cfg['layers']} layers, {cfg['kv_heads']} KV / "
          f"{cfg['q_heads']} query heads x {cfg['head_dim']}, {cfg['tokens_per_frame']} tokens per "
          f"frame in pages of {cfg['block_size']}, sink {cfg['sink']} + window {cfg['window']}, "
          "fp32, XLA backend; state bookkeeping + attention (every layer) + paged write, jitted, "
          "donated")
    harness.print_table(("devices", "case", "ms/step", "chunks/s", "session-chunks/s",
                         "pool MiB/device", "x vs 1-dev (1,1)", "x vs (1,1) same run"), rows)
    rollout_base = results[1]["rollout"]["rollout, no mesh"]["seconds_per_step"]
    rollout_rows = []
    for n in DEVICE_COUNTS:
        same_run = results[n]["rollout"].get("rollout, mesh (1, 1) on 1 of 8 devices", {}).get("seconds_per_step")
        for name, case in results[n]["rollout"].items():
            s = case["seconds_per_step"]
            figures[f"{n}dev/{name}"] = {
                "ms_per_step": s * 1e3, "session_chunks_per_s": ROLLOUT_SESSIONS / s,
                "param_bytes_per_device": case["param_bytes_per_device"],
                "vs_1dev_no_mesh": rollout_base / s,
                "vs_same_run_1_device": (same_run / s) if same_run else None}
            rollout_rows.append((n, name, s * 1e3, ROLLOUT_SESSIONS / s, case["param_bytes_per_device"] / 2**10,
                                 rollout_base / s, "-" if not same_run else f"{same_run / s:.3f}"))
    print(f"\nRollout.step of the tiny demo model: {ROLLOUT_SESSIONS} sessions, CFG, 3 denoise + 1 commit "
          "forward, host to host")
    harness.print_table(("devices", "case", "ms/step", "session-chunks/s", "param KiB/device",
                         "x vs 1-dev no mesh", "x vs (1,1) same run"), rollout_rows)
    jobs = {n: _run_processes(n, args) for n in PROCESS_COUNTS}
    one_ms, two_ms = jobs[1]["ms_per_step"], jobs[2]["ms_per_step"]
    print(f"\nthe same Rollout.step through Lockstep.step (no events) on a global {PROCESS_MESH} mesh of "
          f"{PROCESS_DEVICES} CPU devices: 1 process x {PROCESS_DEVICES} devices vs 2 processes x "
          f"{PROCESS_DEVICES // 2} (jax.distributed, gloo; one job each, on the same {cores} cores); coordination: "
          "the step's broadcast + agreement alone")
    harness.print_table(("processes", "devices/process", "ms/step", "coordination ms/step", "pool KiB/device",
                         "pool KiB/process", "x vs 1 process"),
                        [(job["processes"], job["devices_per_process"], job["ms_per_step"],
                          job["coordination_ms_per_step"], job["pool_bytes_per_device"] / 2**10,
                          job["pool_bytes_per_process"] / 2**10, one_ms / job["ms_per_step"])
                         for job in jobs.values()])
    platform = results[8]["platform"]
    if platform == "cpu":
        print(f"NOTE: the 8 devices are XLA CPU host devices sharing this machine's {cores} cores, "
              "not 8 chips. One CPU device runs most of this step on one core at a time; 8 devices "
              f"run 8 shards concurrently on the same {cores} cores, so any gain here comes from "
              f"keeping all {cores} cores busy (at most ~{cores}x) and says nothing about scaling on "
              "a TPU slice or several GPUs, where each device brings its own compute and memory. "
              "Pool bytes per device are exact (K+V, all layers): they fall with the 'model' axis "
              "(heads) and with the 'data' axis (fewer sessions' pages per shard; each shard "
              "also keeps its own null page and spare frame).")
    harness.emit({
        "cases": figures,
        "sessions": sessions,
        "config": cfg,
        "cpu_cores": cores,
        "devices_share_cores": platform == "cpu",
        "processes": {f"{job['processes']}x{job['devices_per_process']}": job for job in jobs.values()},
        "one_process_ms_per_step": one_ms,
        "two_process_ms_per_step": two_ms,
        "two_vs_one_process": one_ms / two_ms,
        "coordination_ms_per_step": jobs[2]["coordination_ms_per_step"],
        "wall_seconds": time.perf_counter() - start,
    })


if __name__ == "__main__":
    main()
