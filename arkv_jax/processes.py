"""Several processes: JAX's multi-controller runtime, the group the processes agree through, local launches.

Every process runs the same control program over one global ``("data", "model")`` mesh whose
``"data"`` axis spans the processes and whose ``"model"`` axis stays inside each process
(:func:`check_process_mesh`), so a chunk's programs never talk between processes. The processes
talk only through a :class:`ProcessGroup`: process 0's events broadcast (:meth:`ProcessGroup.broadcast`)
and one agreement before each commit (:meth:`ProcessGroup.agree`). :func:`initialize` joins a
process to the job; :func:`launch` starts ``N`` local processes. The model, the launch on TPU
slices and GPU hosts, and what was tested: ``docs/sharding.md``, "Several processes".
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import subprocess
import sys
import time
import traceback
from typing import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from arkv_jax.config import ArgumentTypeError, require_int

__all__ = ["ProcessGroup", "StepFailed", "check_process_mesh", "fail_fast", "free_port", "initialize", "launch",
           "local_shards", "python_module", "spans_processes"]


class StepFailed(RuntimeError):
    """A step failed or was refused on some process, so it fails on every process (nothing was
    committed anywhere). ``process`` is the first process that failed (-1: the session tables of
    the processes differ; the group is then closed)."""

    def __init__(self, message: str, process: int) -> None:
        super().__init__(message)
        self.process = process


def initialize(process_id: int, num_processes: int, coordinator_address: str, *,
               local_devices: int | None = None) -> None:
    """Joins this process to a multi-controller JAX job (``jax.distributed.initialize``). Call it
    before anything else uses JAX. On the CPU it also asks for ``local_devices`` host devices and
    selects the gloo CPU collectives the agreement needs.

    Args:
      process_id: this process, in ``[0, num_processes)``.
      num_processes: processes of the job (>= 1).
      coordinator_address: ``"host:port"`` of process 0's coordinator service.
      local_devices: CPU devices of this process (CPU only; ``None``: JAX's default).

    Raises:
      TypeError/ValueError: a bad argument (named, with its allowed range).
    """
    num_processes = require_int("num_processes", num_processes, minimum=1)
    process_id = require_int("process_id", process_id, minimum=0, maximum=num_processes - 1)
    if not isinstance(coordinator_address, str) or ":" not in coordinator_address:
        raise ArgumentTypeError(f"coordinator_address must be a 'host:port' string, got {coordinator_address!r}")
    if local_devices is not None:
        local_devices = require_int("local_devices", local_devices, minimum=1)
        jax.config.update("jax_num_cpu_devices", local_devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id)


def spans_processes(mesh: Mesh | None) -> bool:
    """Whether ``mesh`` holds devices of another process than this one."""
    return mesh is not None and any(d.process_index != jax.process_index() for d in mesh.devices.flat)


def check_process_mesh(mesh: Mesh) -> None:
    """Checks that every data shard of a ``("data", "model")`` mesh lies in one process (the
    ``"model"`` axis never crosses processes), so the cache's and the rollout's programs need no
    collective between processes.

    Raises:
      ValueError: a data shard whose devices belong to several processes.
    """
    for shard, devices in enumerate(mesh.devices.reshape(mesh.devices.shape[0], -1)):
        owners = sorted({d.process_index for d in devices})
        if len(owners) > 1:
            raise ValueError(f"data shard {shard} of the mesh spans processes {owners}; on several processes "
                             "keep the 'model' axis inside one process (build the mesh from jax.devices(), "
                             "which lists each process's devices together)")


def local_shards(mesh: Mesh | None) -> frozenset[int]:
    """The data shards (indices on the mesh's first axis) whose devices are this process's (all of
    them without a mesh: a one-shard cache is local)."""
    if mesh is None:
        return frozenset({0})
    me = jax.process_index()
    rows = mesh.devices.reshape(mesh.devices.shape[0], -1)
    return frozenset(s for s, devices in enumerate(rows) if devices[0].process_index == me)


def digest(value) -> np.ndarray:
    """Two int64 words of a SHA-256 of ``repr(value)``: what the agreement compares."""
    return np.frombuffer(hashlib.sha256(repr(value).encode()).digest()[:16], np.int64).copy()


class ProcessGroup:
    """The processes of this JAX job, and the only host calls that wait for another process.

    With one process both calls return at once. On several, every process must make the same
    calls in the same order (the same control program); each is one or two small collectives
    (:mod:`jax.experimental.multihost_utils`).

    Attributes:
      index: this process (``jax.process_index()``). count: processes (``jax.process_count()``).
      closed: whether an agreement found the processes' session tables different (every later
        call raises :class:`StepFailed`).
    """

    def __init__(self) -> None:
        self.index, self.count, self.closed = jax.process_index(), jax.process_count(), False

    def broadcast(self, payload: bytes) -> bytes:
        """Process 0's ``payload`` on every process (the others' ``payload`` is ignored)."""
        self._require_open()
        return self.broadcast_from(0, payload)

    def agree(self, error: BaseException | None, table) -> None:
        """Every process reports whether its part of a step succeeded (``error`` is ``None``) and
        its session ``table`` (any value with a deterministic ``repr``); returns when every process
        succeeded with the same table.

        Raises:
          StepFailed: on every process, if any process reported an error (chained from this
            process's own ``error``; the message names the first failing process and its error),
            or if the tables differ (the group is then closed).
        """
        self._require_open()
        mine = np.concatenate([[0 if error is None else 1], digest(table)]).astype(np.int64)
        if self.count == 1:
            reports = mine[None]
        else:
            reports = np.asarray(multihost_utils.process_allgather(mine))
        failed = np.flatnonzero(reports[:, 0])
        if failed.size:
            first = int(failed[0])
            message = self.broadcast_from(first, f"{type(error).__name__}: {error}".encode() if error else b"")
            raise StepFailed(f"the step failed on process {first} of {self.count} (nothing was committed on any "
                             f"process): {message.decode(errors='replace')}", first) from error
        if (reports[:, 1:] != reports[0, 1:]).any():
            self.closed = True
            raise StepFailed("the session tables of the processes differ (an event applied on some processes "
                             "only); the process group is closed", -1)

    def gather(self, values: np.ndarray) -> np.ndarray:
        """``[count, *values.shape]``: every process's ``values`` (same shape on each), by process."""
        self._require_open()
        values = np.asarray(values)
        return values[None] if self.count == 1 else np.asarray(multihost_utils.process_allgather(values))

    def broadcast_from(self, source: int, payload: bytes) -> bytes:
        """Process ``source``'s ``payload`` on every process."""
        if self.count == 1:
            return payload
        is_source = self.index == source
        length = int(multihost_utils.broadcast_one_to_all(np.int64(len(payload)), is_source=is_source))
        if not length:
            return b""
        buffer = np.frombuffer(payload, np.uint8) if is_source else np.zeros(length, np.uint8)
        return np.asarray(multihost_utils.broadcast_one_to_all(buffer, is_source=is_source)).astype(np.uint8).tobytes()

    def _require_open(self) -> None:
        if self.closed:
            raise StepFailed("the process group is closed: the processes' session tables differed", -1)


@contextlib.contextmanager
def fail_fast():
    """On an exception (``SystemExit`` included), prints it and ends the process at once with status
    1 (``SystemExit``: its own), so that JAX's shutdown barrier does not hold a failed process for
    minutes while the others wait: wrap a multi-process job's work in it."""
    try:
        yield
    except BaseException as error:  # noqa: BLE001 -- every failure ends the process now
        status = error.code if isinstance(error, SystemExit) and isinstance(error.code, int) else 1
        if not isinstance(error, SystemExit):
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def free_port() -> int:
    """A TCP port free on localhost now (for a local coordinator)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(commands: Sequence[Sequence[str]], *, timeout: float | None = None, stdout=None, stderr=None,
           env: dict[str, str] | None = None, poll_seconds: float = 0.2) -> list[int]:
    """Runs one local process per command, all at once, and waits for them.

    When a process exits with a non-zero status, or ``timeout`` seconds pass, the others are killed
    (their whole process group), so nothing is left behind. ``stdout``/``stderr``: a stream or file
    per process (``None``: inherited).

    Returns:
      the exit status of every process (``-9`` for one killed).
    """
    children = []
    try:
        for i, command in enumerate(commands):
            out, err = (None if streams is None else streams[i] for streams in (stdout, stderr))
            children.append(subprocess.Popen(list(command), stdout=out, stderr=err, env={**os.environ, **(env or {})},
                                             start_new_session=True))
        deadline = None if timeout is None else time.monotonic() + timeout
        while None in (statuses := [c.poll() for c in children]):  # every child polled each time
            failed = any(status not in (None, 0) for status in statuses)
            if failed or (deadline is not None and time.monotonic() > deadline):
                break
            time.sleep(poll_seconds)
    finally:
        for child in children:
            if child.poll() is None:
                os.killpg(child.pid, 9)
        for child in children:
            child.wait()
    return [c.returncode for c in children]


def python_module(module: str, *args: str) -> list[str]:
    """``[sys.executable, "-m", module, *args]``: a command for :func:`launch`."""
    return [sys.executable, "-m", module, *args]
