"""Host-side memory planner: how many sessions fit, and how many pages the pool gets.

:func:`plan_memory` reproduces vLLM-Omni's budget arithmetic exactly (scratch sizing, page bytes,
cross-attention and model-owned reservations, the soft floor that admits one session, the capacity,
leftover budget to managed pages), generalised to frame-aligned pages: a frame takes
:func:`~arkv_jax.config.pages_per_frame` pages (identical to vLLM-Omni when a frame is one page). The
capacity is in closed form: ``required(c)`` is affine in ``c``, so the largest ``c <= requested``
with ``required(c) <= budget`` is one division, not a search. :class:`DevicePlan` and
:func:`plan_per_device` plan one device of a ``(data, model)`` mesh; :func:`resolve_plan` turns the
cache facade's plan arguments into one device's plan; :func:`rollout_plan` is the smallest plan a
batched rollout runs in. All arithmetic is on Python ints (bytes, pages); nothing here touches a
device except :func:`device_free_bytes`. See ``docs/planning.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import re
from typing import Any, Sequence

from arkv_jax.config import (
    ArgumentTypeError,
    CacheGeometry,
    CrossAttentionSpec,
    KVBranch,
    WindowPolicy,
    ceil_div,
    check_axis_sizes,
    check_divisible,
    divisors,
    is_real,
    num_local_branches,
    require_bool,
    require_int,
    require_non_negative,
    require_positive,
    validate_branches,
    validate_cross_attention,
)
from pallas_kernels.checks import argument_error

_log = logging.getLogger(__name__)

#: Environment variable that can raise (never lower) the scratch pages per local branch.
SCRATCH_OVERRIDE_ENV = "AR_DIFFUSION_KV_SCRATCH_BLOCKS_PER_BRANCH"

#: vLLM-Omni's ``ARDiffusionKVConfig.gpu_memory_fraction`` default: the share of the available memory
#: a budgeted plan may use, leaving the rest to the model.
DEFAULT_MEMORY_FRACTION = 0.1

_GiB = 1 << 30

#: Nominal memory per chip (as sold; usable memory is a little less: probe a real device with
#: :func:`device_free_bytes`). TPU figures are HBM per chip.
CHIP_MEMORY_BYTES = {
    "tpu-v4": 32 * _GiB,
    "tpu-v5e": 16 * _GiB,
    "tpu-v5p": 95 * _GiB,
    "tpu-v6e": 32 * _GiB,
    "tpu-v7x": 192 * _GiB,
    "a100-40gb": 40 * _GiB,
    "a100-80gb": 80 * _GiB,
    "h100-80gb": 80 * _GiB,
    "h200": 141 * _GiB,
    "b200": 180 * _GiB,
    "l4": 24 * _GiB,
    "rtx-4090": 24 * _GiB,
}

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}


def compute_num_blocks(available_bytes: int, gpu_memory_fraction: float, page_size_bytes: int) -> int:
    """Pages of ``page_size_bytes`` that fit in ``int(available_bytes * fraction)`` (vLLM-Omni's
    helper, with its parameter names and messages).

    Raises:
      ValueError: ``page_size_bytes <= 0`` or the fraction is outside (0, 1].
    """
    if page_size_bytes <= 0:
        raise ValueError(f"page_size_bytes must be positive, got {page_size_bytes}")
    if not 0.0 < gpu_memory_fraction <= 1.0:
        raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {gpu_memory_fraction}")
    return max(0, int(available_bytes * gpu_memory_fraction) // page_size_bytes)


def scratch_blocks_per_branch(geometry: CacheGeometry, max_scratch_tokens_per_branch: int,
                              override: int | None = None) -> int:
    """Scratch pages per local branch: in-flight frames plus declared extra tokens.

    Args:
      geometry: the cache geometry.
      max_scratch_tokens_per_branch: extra tokens (action/state registers) a forward keeps in scratch.
      override: a count that may raise the minimum, never lower it; ``None`` reads
        ``AR_DIFFUSION_KV_SCRATCH_BLOCKS_PER_BRANCH`` from the environment (unset means 0).

    Raises:
      ValueError: the override is negative, or the environment's is not an integer.
    """
    declared = ceil_div(max_scratch_tokens_per_branch, geometry.block_size)
    minimum = geometry.frames_per_forward * geometry.pages_per_frame + declared
    if override is None:
        override = _scratch_override_from_environment()
    if override < 0:
        raise ValueError(f"{SCRATCH_OVERRIDE_ENV} must be non-negative")
    return max(minimum, override)


def _scratch_override_from_environment() -> int:
    """``AR_DIFFUSION_KV_SCRATCH_BLOCKS_PER_BRANCH`` as an int (unset or empty means 0).

    Raises:
      ValueError: a value that is not a decimal integer, naming the variable and the value.
    """
    raw = os.environ.get(SCRATCH_OVERRIDE_ENV, "").strip()
    try:
        return int(raw) if raw else 0
    except ValueError:
        raise ValueError(f"{SCRATCH_OVERRIDE_ENV}={raw!r} is not an integer; set it to a non-negative "
                         "integer count of scratch pages per branch, or unset it") from None


def cross_attention_bytes_per_session(geometry: CacheGeometry, specs: Sequence[CrossAttentionSpec],
                                      num_logical_branches: int) -> int:
    """Bytes of all cross-attention caches of one session: K and V, every layer, every logical branch."""
    return sum(
        2 * num_logical_branches * spec.num_tokens * (spec.num_kv_heads or geometry.num_kv_heads)
        * geometry.head_dim * geometry.itemsize * geometry.num_layers
        for spec in specs
    )


def managed_blocks_required(geometry: CacheGeometry, window: WindowPolicy, num_local: int,
                            sessions: int, batched_in_flight: bool = False) -> int:
    """Managed pages needed for ``sessions`` resident sessions (vLLM-Omni's ``managed(c)``).

    Every session keeps sink + window frames per local branch; ``+2`` frames cover the null page and
    one spare. In flight: vLLM-Omni runs one forward at a time, so one chunk's frames per local
    branch; with ``batched_in_flight`` every session may have a chunk in flight at once (a batched
    chunk of all sessions, as :class:`arkv_jax.cache.PagedKVCache` runs them).
    """
    ppf = geometry.pages_per_frame
    in_flight = sessions if batched_in_flight else 1
    return (num_local * (sessions * window.resident_frames * ppf + in_flight * geometry.frames_per_forward * ppf)
            + 2 * ppf)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """The planner's answer. Attribute names match vLLM-Omni's ``ARDiffusionKVCache`` where it has
    one, so ``*_blocks`` count pages (a page spans all layers, K and V); ``*_bytes`` are bytes.
    """

    geometry: CacheGeometry
    window: WindowPolicy
    kv_branches: tuple[KVBranch, ...]
    cross_attention: tuple[CrossAttentionSpec, ...]
    available_bytes: int
    memory_fraction: float
    requested_session_capacity: int
    session_capacity: int
    configured_memory_budget_bytes: int
    memory_budget_bytes: int
    page_size_bytes: int
    num_local_kv_branches: int
    scratch_blocks_per_kv_branch: int
    scratch_num_blocks: int
    scratch_reserved_bytes: int
    cross_attention_bytes_per_session: int
    cross_attention_reserved_bytes: int
    model_owned_state_bytes_per_session: int
    model_owned_state_reserved_bytes: int
    required_managed_blocks: int
    managed_num_blocks: int
    num_blocks_total: int
    null_block_id: int = 0
    batched_in_flight: bool = False
    budget_session_capacity: int = 0
    """The most resident sessions the memory budget holds, whatever was requested (>= 1)."""

    @property
    def bytes_per_frame(self) -> int:
        """Pool bytes of one frame (padding included), all layers, K and V."""
        return self.geometry.frame_bytes

    @property
    def bytes_per_session_branch(self) -> int:
        """Pool bytes one session holds per logical branch between chunks (sink + window)."""
        return self.window.resident_frames * self.bytes_per_frame

    @property
    def bytes_per_session(self) -> int:
        """Everything one resident session reserves: paged K/V of every logical branch, cross-attention
        caches and model-owned state."""
        return (len(self.kv_branches) * self.bytes_per_session_branch
                + self.cross_attention_bytes_per_session + self.model_owned_state_bytes_per_session)

    @property
    def pool_bytes(self) -> int:
        """Bytes of the K/V pools (managed + scratch pages)."""
        return self.num_blocks_total * self.page_size_bytes

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: the attributes plus the inputs and derived sizes."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["geometry"] = dataclasses.asdict(self.geometry)
        fields["window"] = dataclasses.asdict(self.window)
        fields["kv_branches"] = [dataclasses.asdict(b) for b in self.kv_branches]
        fields["cross_attention"] = [dataclasses.asdict(c) for c in self.cross_attention]
        fields.update(
            pages_per_frame=self.geometry.pages_per_frame,
            bytes_per_frame=self.bytes_per_frame,
            bytes_per_session_branch=self.bytes_per_session_branch,
            bytes_per_session=self.bytes_per_session,
            pool_bytes=self.pool_bytes,
        )
        return fields

    def to_json(self) -> str:
        """:meth:`to_dict` as one JSON object."""
        return json.dumps(self.to_dict(), sort_keys=True)

    def summary(self) -> str:
        """A readable table of the plan."""
        g, w = self.geometry, self.window
        branches = ", ".join(f"{b.name}(slot {b.local_index})" for b in self.kv_branches)
        cross = ", ".join(f"{c.name}:{c.num_tokens}" for c in self.cross_attention) or "none"
        mode = "reset at boundary" if w.reset_at_boundary else "sliding"
        rows = [
            ("geometry", f"{g.num_layers} layers x {g.num_kv_heads} kv heads x {g.head_dim} ({g.dtype}"
                         + (f"; pages {g.page_dtype}" + (" + float32 scales" if g.quantized else "")
                            if g.kv_dtype is not None else "") + ")"),
            ("frames", f"{g.tokens_per_frame} tokens in {g.pages_per_frame} page(s) of {g.block_size}"
                       f" ({g.padding_tokens_per_frame} padding), {g.frames_per_forward} per forward"),
            ("window", f"sink {w.sink_frames} + window {w.window_frames} frames, {mode}"),
            ("branches", branches),
            ("cross-attention", cross),
            ("bytes per page (all layers, K+V)", format_bytes(self.page_size_bytes)),
            ("bytes per frame", format_bytes(self.bytes_per_frame)),
            ("bytes per session per branch", format_bytes(self.bytes_per_session_branch)),
            ("cross-attention per session", format_bytes(self.cross_attention_bytes_per_session)),
            ("model-owned state per session", format_bytes(self.model_owned_state_bytes_per_session)),
            ("bytes per session (all branches)", format_bytes(self.bytes_per_session)),
            ("available memory", format_bytes(self.available_bytes)),
            ("fraction -> configured budget",
             f"{self.memory_fraction:g} -> {format_bytes(self.configured_memory_budget_bytes)}"),
            ("memory budget", format_bytes(self.memory_budget_bytes)
             + (" (raised to admit one session)"
                if self.memory_budget_bytes > self.configured_memory_budget_bytes else "")),
            ("sessions granted / requested", f"{self.session_capacity} / {self.requested_session_capacity}"
             + ("" if self.session_capacity == self.requested_session_capacity
                else " (request not met: the budget is too small)")),
            ("most sessions the budget holds", f"{self.budget_session_capacity}"),
            ("scratch pages", f"{self.scratch_num_blocks} ({self.scratch_blocks_per_kv_branch} per local"
                              f" branch x {self.num_local_kv_branches})"),
            ("managed pages (incl. null page 0)",
             f"{self.managed_num_blocks} (>= {self.required_managed_blocks} required)"),
            ("total pages / pool bytes", f"{self.num_blocks_total} / {format_bytes(self.pool_bytes)}"),
        ]
        width = max(len(k) for k, _ in rows)
        lines = ["arkv-jax memory plan"] + [f"  {k.ljust(width)}  {v}" for k, v in rows]
        return "\n".join(lines)


class InsufficientMemoryError(ValueError):
    """One session does not fit in the available memory.

    Attributes:
      available: bytes available.
      required: bytes one session needs: its managed pages, the scratch pages, its cross-attention
        caches and its model-owned state.
    """

    def __init__(self, available: int, required: int) -> None:
        super().__init__(
            f"available device memory cannot fit one session: available {format_bytes(available)}, "
            f"required {format_bytes(required)} (managed self-attention + cross-attention + scratch + "
            "model-owned state).")
        self.available, self.required = available, required


def check_settings(geometry, window) -> None:
    """Checks the types of a geometry and a window policy.

    Raises:
      ArgumentTypeError: ``geometry`` is not a :class:`CacheGeometry` or ``window`` not a
        :class:`WindowPolicy`.
    """
    if not isinstance(geometry, CacheGeometry):
        raise ArgumentTypeError(f"geometry must be a CacheGeometry, got {geometry!r} ({type(geometry).__name__})")
    if not isinstance(window, WindowPolicy):
        raise ArgumentTypeError(f"window must be a WindowPolicy, got {window!r} ({type(window).__name__})")


def _check_plan_inputs(session_capacity: int, kv_branches: Sequence[KVBranch],
                       cross_attention: Sequence[CrossAttentionSpec], available_bytes: int,
                       memory_fraction: float, max_scratch_tokens_per_branch: int,
                       model_owned_state_bytes_per_session: int
                       ) -> tuple[tuple[KVBranch, ...], tuple[CrossAttentionSpec, ...]]:
    """Checks :func:`plan_memory`'s inputs; returns the branches and cross-attention specs as tuples.

    Raises:
      ArgumentTypeError (a ``TypeError``): a wrong type (a ``bool`` or ``float`` where an int is
        expected, a string where a number is). ValueError: a value out of range, NaN or infinite.
    """
    require_positive("session_capacity", session_capacity)
    kv_branches = validate_branches(kv_branches)
    cross_attention = validate_cross_attention(cross_attention)
    require_non_negative("available_bytes", available_bytes)
    if not is_real(memory_fraction):
        raise ArgumentTypeError(f"memory_fraction must be a real number in (0, 1], got {memory_fraction!r} "
                                f"({type(memory_fraction).__name__})")
    if not 0.0 < memory_fraction <= 1.0:  # NaN fails this too
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
    require_non_negative("max_scratch_tokens_per_branch", max_scratch_tokens_per_branch)
    require_non_negative("model_owned_state_bytes_per_session", model_owned_state_bytes_per_session)
    return kv_branches, cross_attention


def plan_memory(
    geometry: CacheGeometry,
    window: WindowPolicy,
    kv_branches: Sequence[KVBranch] = (KVBranch("main"),),
    *,
    available_bytes: int,
    memory_fraction: float = DEFAULT_MEMORY_FRACTION,
    session_capacity: int = 1,
    cross_attention: Sequence[CrossAttentionSpec] = (),
    max_scratch_tokens_per_branch: int = 0,
    model_owned_state_bytes_per_session: int = 0,
    scratch_blocks_override: int | None = None,
    batched_in_flight: bool = False,
) -> MemoryPlan:
    """Plans the paged pool for one model on one device (vLLM-Omni's arithmetic, exactly).

    Args:
      geometry: cache geometry (per device: heads after any sharding).
      window: sink/window policy.
      kv_branches: logical KV branches; local indices contiguous from zero.
      available_bytes: free device memory in bytes (see :func:`device_free_bytes`).
      memory_fraction: soft budget fraction in (0, 1]; raised to admit one session if it fits.
      session_capacity: resident sessions requested; the plan may admit fewer.
      cross_attention: named dense cross-attention caches per session and logical branch.
      max_scratch_tokens_per_branch: extra (action/state) tokens a forward keeps in scratch.
      model_owned_state_bytes_per_session: per-session model state outside the pool, in bytes.
      scratch_blocks_override: raises the scratch pages per branch; ``None`` reads the environment.
      batched_in_flight: reserve in-flight pages for every session (all sessions in one batched
        chunk) instead of vLLM-Omni's one forward at a time. Off reproduces vLLM-Omni exactly.

    Raises:
      ValueError: an input is out of range.
      InsufficientMemoryError: one session does not fit in ``available_bytes``.
    """
    check_settings(geometry, window)
    kv_branches, cross_attention = _check_plan_inputs(
        session_capacity, kv_branches, cross_attention, available_bytes, memory_fraction,
        max_scratch_tokens_per_branch, model_owned_state_bytes_per_session)
    if scratch_blocks_override is not None:
        require_non_negative("scratch_blocks_override", scratch_blocks_override)
    require_bool("batched_in_flight", batched_in_flight)
    available_bytes, memory_fraction = int(available_bytes), float(memory_fraction)
    session_capacity = int(session_capacity)

    num_local = num_local_branches(kv_branches)
    scratch_per_branch = scratch_blocks_per_branch(
        geometry, max_scratch_tokens_per_branch, scratch_blocks_override)
    scratch_blocks = num_local * scratch_per_branch
    page = geometry.page_bytes
    configured = int(available_bytes * memory_fraction)

    scratch_bytes = scratch_blocks * page
    cross = cross_attention_bytes_per_session(geometry, cross_attention, len(kv_branches))
    owned = model_owned_state_bytes_per_session
    # required(c) = fixed + c * per_session (affine in c).
    managed = functools.partial(managed_blocks_required, geometry, window, num_local,
                                batched_in_flight=batched_in_flight)
    fixed = scratch_bytes + managed(0) * page
    per_session = cross + owned + (managed(1) - managed(0)) * page
    one_session = fixed + per_session
    if one_session > available_bytes:
        raise InsufficientMemoryError(available_bytes, one_session)
    budget = max(configured, one_session)
    if budget > configured:
        _log.warning("raised the configured memory budget from %d to %d bytes to admit one session",
                     configured, budget)
    budget_capacity = (budget - fixed) // per_session
    capacity = min(session_capacity, budget_capacity)
    if capacity < session_capacity:
        _log.warning("resident session capacity reduced from %d to %d by the memory budget",
                     session_capacity, capacity)
    required_managed = managed(capacity)
    managed_blocks = (budget - scratch_bytes - cross * capacity - owned * capacity) // page
    if managed_blocks < required_managed:  # unreachable for validated inputs: a planner bug
        raise RuntimeError(f"internal planner error: {managed_blocks} managed pages < {required_managed} required")
    return MemoryPlan(
        geometry=geometry, window=window, kv_branches=kv_branches, cross_attention=cross_attention,
        available_bytes=int(available_bytes), memory_fraction=float(memory_fraction),
        requested_session_capacity=int(session_capacity), session_capacity=int(capacity),
        configured_memory_budget_bytes=configured, memory_budget_bytes=budget, page_size_bytes=page,
        num_local_kv_branches=num_local, scratch_blocks_per_kv_branch=scratch_per_branch,
        scratch_num_blocks=scratch_blocks, scratch_reserved_bytes=scratch_bytes,
        cross_attention_bytes_per_session=cross, cross_attention_reserved_bytes=cross * capacity,
        model_owned_state_bytes_per_session=owned, model_owned_state_reserved_bytes=owned * capacity,
        required_managed_blocks=required_managed, managed_num_blocks=managed_blocks,
        num_blocks_total=managed_blocks + scratch_blocks, batched_in_flight=batched_in_flight,
        budget_session_capacity=int(budget_capacity),
    )


# ----------------------------------------------------------------------------------------------
# Plans of one device of a mesh, and the rollout's smallest plan.


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    """The memory plan of one device of a ``(data, model)`` mesh, and what it adds up to.

    Attributes:
      plan: the :class:`~arkv_jax.planner.MemoryPlan` of one device: its geometry has
        ``num_kv_heads // model`` heads (cross-attention heads divided too); its pages are the
        pages of one data shard (every device of a data shard holds all of them, for its heads).
      data, model: mesh axis sizes.
      pool_bytes_per_device: K+V pool bytes one device of a :class:`~arkv_jax.cache.PagedKVCache`
        holds: its managed pages (``pages_per_shard * plan.page_size_bytes``). The plan's scratch
        pages stay in its budget (vLLM-Omni's arithmetic) but are never allocated: denoise steps
        never write the pool.
      bytes_per_device: everything allocated for one device: pools + cross-attention caches +
        model-owned state of its sessions.
      pages_per_shard: pool pages per data shard, null page included (``plan.managed_num_blocks``):
        :attr:`PagedKVCache.pages_per_shard <arkv_jax.cache.PagedKVCache.pages_per_shard>` and the
        ``pages_per_shard`` of :func:`arkv_jax.sharding.make_pools`.
      sessions_per_data_shard: resident sessions one data shard holds (``plan.session_capacity``).
      total_sessions: ``sessions_per_data_shard * data``.
      rows_per_shard: state rows per data shard (sessions x logical KV branches).
      processes: processes the mesh spans (its ``"data"`` axis split evenly between them,
        :func:`process_share`).
      data_shards_per_process, devices_per_process: what one process holds (``data / processes``
        data shards of ``model`` devices each).
      pool_bytes_per_process, bytes_per_process, sessions_per_process: the per-device figures
        summed over one process's devices (sessions: over its data shards).
    """

    plan: MemoryPlan
    data: int
    model: int
    pool_bytes_per_device: int
    bytes_per_device: int
    pages_per_shard: int
    sessions_per_data_shard: int
    total_sessions: int
    rows_per_shard: int
    processes: int
    data_shards_per_process: int
    devices_per_process: int
    pool_bytes_per_process: int
    bytes_per_process: int
    sessions_per_process: int

    @classmethod
    def from_plan(cls, plan: MemoryPlan, data: int, model: int, processes: int = 1) -> "DevicePlan":
        """The mesh-wide view of ``plan``, the plan of one device (heads already divided by
        ``model``), when every one of the ``data`` shards holds the same plan, on a mesh over
        ``processes`` processes.

        Raises:
          ValueError: ``data`` or ``model`` is not a positive int, or ``processes`` does not
            divide ``data`` (:func:`process_share`).
        """
        shards, devices = process_share(data, model, processes)
        pool_bytes = plan.managed_num_blocks * plan.page_size_bytes
        device_bytes = pool_bytes + plan.cross_attention_reserved_bytes + plan.model_owned_state_reserved_bytes
        return cls(
            plan=plan, data=int(data), model=int(model), pool_bytes_per_device=pool_bytes,
            bytes_per_device=device_bytes, pages_per_shard=plan.managed_num_blocks,
            sessions_per_data_shard=plan.session_capacity, total_sessions=plan.session_capacity * int(data),
            rows_per_shard=plan.session_capacity * len(plan.kv_branches), processes=int(data) // shards,
            data_shards_per_process=shards, devices_per_process=devices,
            pool_bytes_per_process=pool_bytes * devices, bytes_per_process=device_bytes * devices,
            sessions_per_process=plan.session_capacity * shards)

    @property
    def num_devices(self) -> int:
        return self.data * self.model

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: the mesh-wide figures, and the device's plan under ``"plan"``."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "plan"}
        out["plan"] = self.plan.to_dict()
        return out

    def to_json(self) -> str:
        """:meth:`to_dict` as one JSON object."""
        return json.dumps(self.to_dict(), sort_keys=True)

    def summary(self) -> str:
        """The mesh-wide figures, then one device's :meth:`MemoryPlan.summary`."""
        return "\n".join([
            f"mesh: data={self.data} x model={self.model} ({self.num_devices} devices); the plan below "
            f"is one device's (K/V heads / {self.model})",
            f"  per device: pools {format_bytes(self.pool_bytes_per_device)}, everything reserved "
            f"{format_bytes(self.bytes_per_device)}",
            f"  per process ({self.processes} processes, each {self.data_shards_per_process} data shards x "
            f"{self.model} = {self.devices_per_process} devices): pools {format_bytes(self.pool_bytes_per_process)}, "
            f"everything reserved {format_bytes(self.bytes_per_process)}, {self.sessions_per_process} sessions",
            f"  sessions: {self.sessions_per_data_shard} per data shard x {self.data} = {self.total_sessions}; "
            f"{self.pages_per_shard} pages per data shard",
            self.plan.summary()])


def process_share(data: int, model: int, processes: int) -> tuple[int, int]:
    """What one of ``processes`` processes holds of a ``(data, model)`` mesh whose ``"data"`` axis
    spans them and whose ``"model"`` axis stays inside each (``docs/sharding.md``, "Several
    processes"): ``(data // processes, data // processes * model)``, its data shards and devices.

    Raises:
      ValueError: ``data`` or ``model`` is not a positive int, or ``processes`` is not a positive
        int dividing ``data`` (the message names the allowed counts).
    """
    check_axis_sizes(data, model)
    data, model = int(data), int(model)
    must = (f"a positive int dividing the mesh axis 'data' of size {data}, one of {divisors(data)} (each process "
            "holds whole data shards)")
    processes = require_int("processes", processes, minimum=1, must=must)
    if data % processes:
        raise argument_error("processes", processes, must)
    return data // processes, data // processes * model


def local_shapes(geometry: CacheGeometry, cross_attention: Sequence[CrossAttentionSpec], model: int
                 ) -> tuple[CacheGeometry, tuple[CrossAttentionSpec, ...]]:
    """What one device of a model axis of size ``model`` holds: ``geometry`` and each
    cross-attention cache with their K/V heads divided by ``model``.

    Raises:
      ValueError: K/V or cross-attention heads not divisible by ``model``.
    """
    check_divisible("kv_heads", geometry.num_kv_heads, "model", model)
    local_cross = []
    for spec in cross_attention:
        if spec.num_kv_heads is not None:
            check_divisible(f"cross-attention {spec.name!r} num_kv_heads", spec.num_kv_heads,
                             "model", model)
            spec = dataclasses.replace(spec, num_kv_heads=spec.num_kv_heads // model)
        local_cross.append(spec)
    return dataclasses.replace(geometry, num_kv_heads=geometry.num_kv_heads // model), tuple(local_cross)


def plan_per_device(
    geometry: CacheGeometry,
    window: WindowPolicy,
    branches: Sequence[KVBranch] = (KVBranch("main"),),
    *,
    data: int,
    model: int,
    available_bytes_per_device: int,
    memory_fraction: float = DEFAULT_MEMORY_FRACTION,
    sessions_per_shard: int = 1,
    cross_attention: Sequence[CrossAttentionSpec] = (),
    max_scratch_tokens_per_branch: int = 0,
    model_owned_state_bytes_per_session: int = 0,
    scratch_blocks_override: int | None = None,
    batched_in_flight: bool = False,
    processes: int = 1,
) -> DevicePlan:
    """Plans one device of a ``(data, model)`` mesh with the single-device planner.

    The pools of one data shard are split over ``model`` devices by heads, so one device plans with
    ``geometry.num_kv_heads // model`` heads (and each cross-attention cache's heads ``// model``)
    and its own ``available_bytes_per_device``. Every data shard holds the same plan, so the mesh
    holds ``sessions_per_data_shard * data`` sessions.

    Args:
      geometry: the model's global geometry (all K/V heads).
      window, branches, memory_fraction, cross_attention, max_scratch_tokens_per_branch,
        scratch_blocks_override, batched_in_flight: as for :func:`arkv_jax.planner.plan_memory`.
      data, model: mesh axis sizes.
      available_bytes_per_device: free memory of one device (the smallest, if they differ).
      sessions_per_shard: resident sessions requested per data shard.
      model_owned_state_bytes_per_session: model state per session *on one device*.
      processes: processes the mesh spans (a divisor of ``data``): the plan also gives one
        process's figures (:func:`process_share`).

    Raises:
      ValueError: bad axis sizes, K/V or cross-attention heads not divisible by ``model``,
        ``processes`` not dividing ``data``, or an input ``plan_memory`` rejects.
    """
    process_share(data, model, processes)
    local, local_cross = local_shapes(geometry, cross_attention, model)
    plan = plan_memory(
        local, window, branches, available_bytes=available_bytes_per_device,
        memory_fraction=memory_fraction, session_capacity=sessions_per_shard,
        cross_attention=local_cross, max_scratch_tokens_per_branch=max_scratch_tokens_per_branch,
        model_owned_state_bytes_per_session=model_owned_state_bytes_per_session,
        scratch_blocks_override=scratch_blocks_override, batched_in_flight=batched_in_flight)
    return DevicePlan.from_plan(plan, data, model, processes)


def resolve_plan(geometry: CacheGeometry, window: WindowPolicy, kv_branches: Sequence[KVBranch],
                 cross_attention: Sequence[CrossAttentionSpec], *, data: int = 1, model: int = 1,
                 plan: MemoryPlan | DevicePlan | None = None, available_bytes: int | None = None,
                 memory_fraction: float | None = None, session_capacity: int = 1, device: Any = None
                 ) -> MemoryPlan:
    """The plan of one device of a cache on ``data`` x ``model`` devices (1 x 1 without a mesh).

    Args:
      geometry, window, kv_branches, cross_attention: the cache's settings (``geometry`` with all
        K/V heads).
      data, model: mesh axis sizes.
      plan: a :class:`MemoryPlan` of one device for these settings (heads divided by ``model``, e.g.
        ``plan_per_device(...).plan``), a :class:`DevicePlan` for this mesh, or ``None``: planned
        for ``session_capacity`` sessions in all (``ceil(session_capacity / data)`` per data shard),
        with in-flight pages for every session (``batched_in_flight=True``), since all sessions can
        run in one chunk. With neither ``available_bytes`` nor ``memory_fraction`` the pool holds
        exactly those sessions (:func:`rollout_plan`; logged at INFO); with either, vLLM-Omni's
        budget rule applies: ``memory_fraction`` (default 0.1) of ``available_bytes`` (per device;
        default: ``device``'s free memory, :func:`device_free_bytes`).

    Raises:
      ValueError: K/V or cross-attention heads not divisible by ``model``, a :class:`DevicePlan`
        for another mesh, a plan for other settings, or an input :func:`plan_memory` rejects.
    """
    check_settings(geometry, window)
    check_axis_sizes(data, model)
    local_geometry, local_cross = local_shapes(geometry, validate_cross_attention(cross_attention), model)
    if plan is None:
        require_positive("session_capacity", session_capacity)
        if available_bytes is None and memory_fraction is None:
            exact = rollout_plan(geometry, window, kv_branches, cross_attention, ceil_div(session_capacity, data),
                                 model=model)
            _log.info("no plan, available_bytes or memory_fraction given: the pool holds exactly %d session(s) "
                      "per data shard, %d pages (%s) per device", exact.session_capacity, exact.num_blocks_total,
                      format_bytes(exact.num_blocks_total * exact.page_size_bytes))
            return exact
        if available_bytes is not None:
            require_non_negative("available_bytes", available_bytes)
        return plan_memory(
            local_geometry, window, kv_branches, cross_attention=local_cross,
            available_bytes=device_free_bytes(device) if available_bytes is None else available_bytes,
            memory_fraction=DEFAULT_MEMORY_FRACTION if memory_fraction is None else memory_fraction,
            session_capacity=ceil_div(session_capacity, data), batched_in_flight=True)
    if not isinstance(plan, (MemoryPlan, DevicePlan)):
        raise ArgumentTypeError(f"plan must be a MemoryPlan, a DevicePlan or None, got {type(plan).__name__}")
    if isinstance(plan, DevicePlan):
        if (plan.data, plan.model) != (data, model):
            raise ValueError(f"plan is for a (data={plan.data}, model={plan.model}) mesh, the cache's "
                             f"is (data={data}, model={model})")
        plan = plan.plan
    if (plan.geometry, plan.window, plan.kv_branches, plan.cross_attention) != (
            local_geometry, window, tuple(kv_branches), local_cross):
        raise ValueError("plan was made for a different geometry, window, branches or cross-attention"
                         + ("" if model == 1 else " (with a mesh, plan one device: heads divided by the "
                                                  "'model' axis, e.g. planner.plan_per_device)"))
    return plan


def rollout_plan(geometry: CacheGeometry, window: WindowPolicy, kv_branches: Sequence[KVBranch],
                 cross_attention: Sequence[CrossAttentionSpec], sessions: int, *, model: int = 1,
                 latent_frame_bytes: int | None = None) -> MemoryPlan:
    """The smallest plan that holds ``sessions`` sessions and runs them all in one batched chunk
    (the planner's ``batched_in_flight`` reservation, with a budget of exactly what it requires):
    the pool is as small as the rollout allows, so page reuse shows in a short run.

    For a mesh, ``sessions`` is per data shard and ``model`` the size of the ``"model"`` axis: the
    plan is one device's (heads divided by ``model``), which ``PagedKVCache(..., mesh=)`` takes.

    Prompt switches (:meth:`arkv_jax.rollout.Rollout.switch_prompt`): with ``latent_frame_bytes``
    (bytes of one latent frame, e.g. ``H * W * C * itemsize``) the plan also holds each session's
    latent ring (:meth:`~arkv_jax.config.WindowPolicy.latent_ring_frames`, as model-owned state per
    session) and the fresh pages of one recache (:func:`recache_blocks`).

    Raises:
      TypeError: ``sessions`` or ``model`` is not an int. ValueError: either is below 1, or a
        negative ``latent_frame_bytes``.
    """
    require_positive("sessions", sessions)
    require_positive("model", model)
    geometry, cross_attention = local_shapes(geometry, cross_attention, model)
    owned, extra_blocks = 0, 0
    if latent_frame_bytes is not None:
        require_non_negative("latent_frame_bytes", latent_frame_bytes)
        owned = window.latent_ring_frames(geometry.frames_per_forward) * int(latent_frame_bytes)
        extra_blocks = recache_blocks(geometry, window, len(kv_branches))
    kw = dict(cross_attention=cross_attention, session_capacity=sessions, batched_in_flight=True,
              model_owned_state_bytes_per_session=owned)
    probe = plan_memory(geometry, window, kv_branches, available_bytes=1 << 60, memory_fraction=1.0, **kw)
    budget = (probe.scratch_reserved_bytes + (probe.cross_attention_bytes_per_session + owned) * sessions
              + (probe.required_managed_blocks + extra_blocks) * probe.page_size_bytes)
    return plan_memory(geometry, window, kv_branches, available_bytes=budget, memory_fraction=1.0, **kw)


def recache_blocks(geometry: CacheGeometry, window: WindowPolicy, num_branches: int) -> int:
    """Fresh pages one prompt switch's recache takes while it runs: every history frame a chunk can
    see (:meth:`~arkv_jax.config.WindowPolicy.max_history`) for each of a session's branches."""
    return num_branches * window.max_history(geometry.frames_per_forward) * geometry.pages_per_frame


# ----------------------------------------------------------------------------------------------
# Memory sizes.


def parse_memory(text: str) -> int:
    """Bytes from a size such as ``"100GiB"``, ``"80GB"``, ``"512MiB"``, ``"1.5e9"`` or a chip name
    from ``CHIP_MEMORY_BYTES`` (e.g. ``"tpu-v5e"``, ``"h100-80gb"``).

    Raises:
      ValueError: neither a size nor a known chip.
    """
    key = text.strip().lower()
    if key in CHIP_MEMORY_BYTES:
        return CHIP_MEMORY_BYTES[key]
    if key.startswith("-"):
        raise ValueError(f"memory must be positive, got {text!r}")
    match = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)", key)
    if match is None or match.group(2) not in _UNITS:
        raise ValueError(
            f"memory must be a size like 100GiB, 80GB, 512MiB or 1e9 (bytes), or a chip name in "
            f"{sorted(CHIP_MEMORY_BYTES)}, got {text!r}")
    value = float(match.group(1)) * _UNITS[match.group(2)]
    if value <= 0:
        raise ValueError(f"memory must be positive, got {text!r}")
    return int(value)


def device_free_bytes(device=None) -> int:
    """Free memory of a JAX device in bytes (:func:`probe_free_memory`'s count)."""
    return probe_free_memory(device)[0]


def probe_free_memory(device=None) -> tuple[int, str]:
    """Free memory of a JAX device (default: the first local one) in bytes, and what was read.

    On GPU and TPU this is ``bytes_limit - bytes_in_use`` from ``device.memory_stats()``. Devices
    without memory statistics (the CPU) fall back to the host's available physical memory
    (``os.sysconf``), which is what CPU arrays are allocated from.
    """
    import jax

    device = device or jax.local_devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - backends without the API raise various errors
        stats = None
    if stats and "bytes_limit" in stats:
        free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
        return free, f"{device.platform} device {device.id}'s memory statistics"
    free = int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    return free, f"the host's available RAM ({device.platform} devices report no memory statistics)"


def format_bytes(num_bytes: int) -> str:
    """``num_bytes`` with a binary unit, e.g. ``"3.21 GiB (3,446,734,848 B)"``."""
    value, unit = float(num_bytes), "B"
    for next_unit in ("KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024:
            break
        value, unit = value / 1024, next_unit
    if unit == "B":
        return f"{num_bytes:,} B"
    return f"{value:.2f} {unit} ({num_bytes:,} B)"
