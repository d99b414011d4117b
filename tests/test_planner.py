"""The memory planner against vLLM-Omni's worked numbers (seed-semantics.md §8.2-§8.4, §13.1)."""

import dataclasses
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arkv_jax.config import CacheGeometry, CrossAttentionSpec, KVBranch, WindowPolicy
from arkv_jax.planner import (
    CHIP_MEMORY_BYTES,
    SCRATCH_OVERRIDE_ENV,
    DevicePlan,
    InsufficientMemoryError,
    compute_num_blocks,
    device_free_bytes,
    managed_blocks_required,
    parse_memory,
    plan_memory,
    plan_per_device,
    process_share,
    rollout_plan,
    scratch_blocks_per_branch,
)
from arkv_jax.presets import PRESETS

MAIN = (KVBranch("main"),)
CFG_SHARED = (KVBranch("positive", 0), KVBranch("negative", 0))


@pytest.fixture(autouse=True)
def _no_scratch_override(monkeypatch):
    monkeypatch.delenv(SCRATCH_OVERRIDE_ENV, raising=False)


def tiny_plan(available, *, fraction=1.0, sessions=2, model_owned=0):
    """seed-semantics.md §8.4 'tiny': chunk=block=1, window 3, sink 3, fpb 3, 1x1x1 fp32, text 2, one branch."""
    return plan_memory(
        CacheGeometry(1, 1, 1, "float32", tokens_per_frame=1, frames_per_forward=3),
        WindowPolicy(window_frames=3, sink_frames=3), MAIN,
        available_bytes=available, memory_fraction=fraction, session_capacity=sessions,
        cross_attention=(CrossAttentionSpec("text", 2),), model_owned_state_bytes_per_session=model_owned)


@pytest.mark.parametrize(
    "available, fraction, model_owned, configured, budget, capacity, managed, total",
    [
        (128, 1.0, 0, 128, 128, 1, 11, 14),
        (191, 1.0, 0, 191, 191, 1, 18, 21),
        (192, 1.0, 0, 192, 192, 2, 17, 20),
        (200, 1.0, 16, 200, 200, 1, 18, 21),
        (1280, 0.05, 0, 64, 128, 1, 11, 14),
    ],
)
def test_tiny_worked_numbers(available, fraction, model_owned, configured, budget, capacity, managed, total):
    plan = tiny_plan(available, fraction=fraction, model_owned=model_owned)
    assert plan.page_size_bytes == 8
    assert plan.scratch_num_blocks == 3
    assert plan.cross_attention_bytes_per_session == 16
    assert plan.configured_memory_budget_bytes == configured
    assert plan.memory_budget_bytes == budget
    assert (plan.session_capacity, plan.requested_session_capacity) == (capacity, 2)
    assert (plan.managed_num_blocks, plan.num_blocks_total) == (managed, total)
    assert plan.model_owned_state_reserved_bytes == model_owned * capacity
    assert (plan.num_blocks_total * plan.page_size_bytes + plan.cross_attention_reserved_bytes
            + plan.model_owned_state_reserved_bytes) <= plan.memory_budget_bytes


def test_cannot_fit_one_session_names_both_sizes():
    with pytest.raises(InsufficientMemoryError, match=r"cannot fit one session: available 127 B, required 128 B"
                       ) as info:
        tiny_plan(127, sessions=1)
    assert (info.value.available, info.value.required) == (127, 128)


def test_requested_capacity_is_capped_and_cross_reservation_uses_effective_capacity():
    plan = tiny_plan(192, sessions=64)
    assert plan.session_capacity == 2 and plan.requested_session_capacity == 64
    assert plan.cross_attention_bytes_per_session == 16
    assert plan.cross_attention_reserved_bytes == 32
    assert plan.num_blocks_total * 8 + 32 == plan.memory_budget_bytes


def test_cross_attention_pool_deducted_from_self_attention_budget():
    plan = plan_memory(
        CacheGeometry(2, 4, 64, "float16", tokens_per_frame=16), WindowPolicy(window_frames=2), CFG_SHARED,
        available_bytes=1 << 30, memory_fraction=0.5, session_capacity=1,
        cross_attention=(CrossAttentionSpec("text", 512),))
    assert plan.geometry.page_bytes_per_layer == 16384
    assert plan.page_size_bytes == 32768
    assert plan.scratch_num_blocks == 1
    assert plan.cross_attention_bytes_per_session == 2 * 2 * 512 * 4 * 64 * 2 * 2 == 2_097_152
    assert plan.configured_memory_budget_bytes == 536_870_912
    assert plan.managed_num_blocks == (536_870_912 - 2_097_152 - 32768) // 32768 == 16319
    assert plan.num_blocks_total == 16320
    assert plan.cross_attention_reserved_bytes == 2_097_152
    assert plan.num_blocks_total * 32768 + 2_097_152 <= 536_870_912


@pytest.mark.parametrize(
    "preset, available, fraction, budget, capacity, managed, total",
    [
        ("lingbot-v2", 100 << 30, 0.1, 33_653_670_400, 1, 23, 26),
        ("lingbot-v2", 100 << 30, 0.6, 64_424_509_440, 2, 46, 49),
        ("dreamzero-14b", 80 << 30, 0.1, 16_609_968_128, 1, 78, 84),
        ("dreamzero-14b", 80 << 30, 0.5, 42_949_672_960, 2, 215, 221),
    ],
)
def test_shipped_model_worked_numbers(preset, available, fraction, budget, capacity, managed, total):
    p = PRESETS[preset]
    plan = plan_memory(
        p.geometry, p.window, p.kv_branches, available_bytes=available, memory_fraction=fraction,
        session_capacity=p.session_capacity, cross_attention=p.cross_attention,
        max_scratch_tokens_per_branch=p.max_scratch_tokens_per_branch,
        model_owned_state_bytes_per_session=p.model_owned_state_bytes_per_session)
    assert plan.memory_budget_bytes == budget
    assert plan.session_capacity == capacity
    assert (plan.managed_num_blocks, plan.num_blocks_total) == (managed, total)


def test_lingbot_page_and_cross_sizes():
    p = PRESETS["lingbot-v2"]
    assert p.geometry.page_bytes_per_layer == 31_948_800
    assert p.geometry.page_bytes == 1_277_952_000
    assert PRESETS["dreamzero-14b"].geometry.page_bytes_per_layer == 4_505_600


@pytest.mark.parametrize("local_branches, managed, scratch", [(1, 13, 2), (2, 24, 4)])
def test_pool_floor_is_branch_aware(local_branches, managed, scratch):
    geometry = CacheGeometry(1, 4, 64, "float32", tokens_per_frame=16, frames_per_forward=2)
    branches = tuple(KVBranch(f"b{i}", i) for i in range(local_branches))
    available = (managed + scratch) * geometry.page_bytes
    plan = plan_memory(geometry, WindowPolicy(window_frames=9), branches,
                       available_bytes=available, memory_fraction=1.0, session_capacity=1)
    assert plan.managed_num_blocks == managed
    assert plan.scratch_num_blocks == scratch == local_branches * plan.scratch_blocks_per_kv_branch
    assert plan.num_blocks_total == managed + scratch


def test_scratch_is_derived_from_declared_geometry_and_override_only_raises(monkeypatch):
    geometry = CacheGeometry(1, 4, 64, "float32", tokens_per_frame=16, frames_per_forward=6)
    assert scratch_blocks_per_branch(geometry, 17) == 8
    monkeypatch.setenv(SCRATCH_OVERRIDE_ENV, "1")
    assert scratch_blocks_per_branch(geometry, 17) == 8
    monkeypatch.setenv(SCRATCH_OVERRIDE_ENV, "12")
    assert scratch_blocks_per_branch(geometry, 17) == 12
    monkeypatch.setenv(SCRATCH_OVERRIDE_ENV, "-1")
    with pytest.raises(ValueError, match=f"^{SCRATCH_OVERRIDE_ENV} must be non-negative$"):
        scratch_blocks_per_branch(geometry, 17)


@pytest.mark.parametrize("raw", ["abc", "1.5", "0x10"])
def test_a_scratch_override_that_is_not_an_integer_names_the_variable_and_value(monkeypatch, raw):
    geometry = CacheGeometry(1, 4, 64, "float32", tokens_per_frame=16, frames_per_forward=6)
    monkeypatch.setenv(SCRATCH_OVERRIDE_ENV, raw)
    with pytest.raises(ValueError, match=f"^{SCRATCH_OVERRIDE_ENV}={raw!r} is not an integer"):
        scratch_blocks_per_branch(geometry, 17)


def test_frame_aligned_paging_matches_vllm_omnis_s2_example():
    """LingBot at 832x480 with 16-token pages: 98 pages/frame, 294 scratch pages, managed(c)=1764c+490."""
    geometry = CacheGeometry(40, 40, 128, "bfloat16", tokens_per_frame=1560, block_size=16, frames_per_forward=3)
    window = WindowPolicy(window_frames=9, sink_frames=9)
    assert geometry.pages_per_frame == 98 and geometry.padding_tokens_per_frame == 8
    assert scratch_blocks_per_branch(geometry, 0) == 294
    for c in (1, 2, 7):
        assert managed_blocks_required(geometry, window, 1, c) == 1764 * c + 294 + 196


def test_batched_in_flight_reserves_a_forward_per_session():
    geometry = CacheGeometry(2, 4, 64, "float16", tokens_per_frame=16, frames_per_forward=3)
    window = WindowPolicy(window_frames=5, sink_frames=1)
    assert managed_blocks_required(geometry, window, 2, 4, batched_in_flight=True) == 2 * 4 * (6 + 3) + 2
    kwargs = dict(available_bytes=1 << 26, memory_fraction=1.0, session_capacity=1000)
    one_forward, batched = (plan_memory(geometry, window, MAIN, batched_in_flight=b, **kwargs) for b in (False, True))
    assert batched.batched_in_flight and batched.session_capacity < one_forward.session_capacity
    assert batched.managed_num_blocks >= batched.session_capacity * (6 + 3) + 2


def test_frame_equal_to_page_is_vllm_omnis_formula():
    geometry = CacheGeometry(2, 4, 64, "float16", tokens_per_frame=16, frames_per_forward=3)
    window = WindowPolicy(window_frames=5, sink_frames=1)
    for local in (1, 2):
        for c in (1, 4):
            assert managed_blocks_required(geometry, window, local, c) == local * (c * 6 + 3) + 2


def test_compute_num_blocks():
    assert compute_num_blocks(1 << 20, 0.5, 16 << 10) == 32
    with pytest.raises(ValueError, match=r"^page_size_bytes must be positive, got 0$"):
        compute_num_blocks(1 << 20, 0.5, 0)
    for fraction in (0.0, 1.5):
        with pytest.raises(ValueError, match=re.escape(f"gpu_memory_fraction must be in (0, 1], got {fraction}")):
            compute_num_blocks(1 << 20, fraction, 16)


def test_plan_rejects_a_bad_fraction():
    for fraction in (0.0, 1.5):
        with pytest.raises(ValueError, match=re.escape(f"memory_fraction must be in (0, 1], got {fraction}")):
            tiny_plan(1000, fraction=fraction)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(session_capacity=0), "session_capacity must be positive, got 0"),
        (dict(max_scratch_tokens_per_branch=-1), "max_scratch_tokens_per_branch must be non-negative, got -1"),
        (dict(model_owned_state_bytes_per_session=-5),
         "model_owned_state_bytes_per_session must be non-negative, got -5"),
        (dict(kv_branches=()), "kv_branches must hold at least one KV branch"),
        (dict(kv_branches=(KVBranch("m"), KVBranch("m"))), "KV branch names must be unique, got ['m', 'm']"),
        (dict(kv_branches=(KVBranch("m", 1),)),
         "KV branch local_index values must be contiguous from zero, got [1]"),
        (dict(cross_attention=(CrossAttentionSpec("t", 1), CrossAttentionSpec("t", 2))),
         "cross-attention names must be unique, got ['t', 't']"),
        (dict(available_bytes=-1), "available_bytes must be non-negative, got -1"),
    ],
)
def test_plan_input_errors(kwargs, message):
    args = dict(kv_branches=MAIN, available_bytes=1 << 20, session_capacity=1)
    args.update(kwargs)
    branches = args.pop("kv_branches")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        plan_memory(CacheGeometry(1, 1, 1, "float32", tokens_per_frame=1), WindowPolicy(1), branches, **args)


def vllm_omni_downward_search(geometry, window, branches, available, fraction, requested, cross, owned, scratch_tokens):
    """vLLM-Omni's loop, literally: largest c in [requested .. 1] with required(c) <= budget."""
    local = max(b.local_index for b in branches) + 1
    ppf = -(-geometry.tokens_per_frame // geometry.block_size)
    scratch = local * (geometry.frames_per_forward * ppf + -(-scratch_tokens // geometry.block_size))
    page = geometry.page_bytes
    x = sum(2 * len(branches) * c.num_tokens * geometry.num_kv_heads * geometry.head_dim
            * geometry.itemsize * geometry.num_layers for c in cross)

    def managed(c):
        return local * (c * (window.sink_frames + window.window_frames) * ppf
                        + geometry.frames_per_forward * ppf) + 2 * ppf

    def required(c):
        return scratch * page + c * x + c * owned + managed(c) * page

    if required(1) > available:
        return None
    budget = max(int(available * fraction), required(1))
    for c in range(requested, 0, -1):
        if required(c) <= budget:
            return c, budget, (budget - scratch * page - x * c - owned * c) // page


@settings(max_examples=300, deadline=None)
@given(
    layers=st.integers(1, 48), heads=st.integers(1, 64), head_dim=st.sampled_from([1, 16, 64, 128]),
    dtype=st.sampled_from(["float32", "bfloat16", "float16"]), tokens=st.integers(1, 2000),
    block=st.integers(1, 2048), fpf=st.integers(1, 6), sink=st.integers(0, 10), window=st.integers(1, 40),
    local=st.integers(1, 3), extra_logical=st.integers(0, 2), cross_tokens=st.lists(st.integers(1, 600), max_size=2),
    owned=st.integers(0, 1 << 30), scratch_tokens=st.integers(0, 64), requested=st.integers(1, 200),
    available=st.integers(0, 1 << 42), fraction=st.floats(0.01, 1.0),
)
def test_closed_form_capacity_equals_vllm_omnis_downward_search(
        layers, heads, head_dim, dtype, tokens, block, fpf, sink, window, local, extra_logical, cross_tokens,
        owned, scratch_tokens, requested, available, fraction):
    geometry = CacheGeometry(layers, heads, head_dim, dtype, tokens, block_size=block, frames_per_forward=fpf)
    policy = WindowPolicy(window_frames=window, sink_frames=sink)
    branches = tuple(KVBranch(f"b{i}", i) for i in range(local)) + tuple(
        KVBranch(f"x{i}", 0) for i in range(extra_logical))
    cross = tuple(CrossAttentionSpec(f"c{i}", n) for i, n in enumerate(cross_tokens))
    expected = vllm_omni_downward_search(geometry, policy, branches, available, fraction, requested, cross, owned,
                                    scratch_tokens)
    kwargs = dict(available_bytes=available, memory_fraction=fraction, session_capacity=requested,
                  cross_attention=cross, model_owned_state_bytes_per_session=owned,
                  max_scratch_tokens_per_branch=scratch_tokens)
    if expected is None:
        with pytest.raises(ValueError, match="cannot fit one session"):
            plan_memory(geometry, policy, branches, **kwargs)
        return
    plan = plan_memory(geometry, policy, branches, **kwargs)
    assert (plan.session_capacity, plan.memory_budget_bytes, plan.managed_num_blocks) == expected
    assert plan.managed_num_blocks >= plan.required_managed_blocks


def test_parse_memory_sizes_and_chips():
    assert parse_memory("100GiB") == 100 << 30
    assert parse_memory("80GB") == 80 * 10**9
    assert parse_memory("512MiB") == 512 << 20
    assert parse_memory("1e9") == 10**9
    assert parse_memory("1.5KiB") == 1536
    assert parse_memory("TPU-v5e") == CHIP_MEMORY_BYTES["tpu-v5e"] == 16 << 30
    for bad in ("12XB", "abc", "0GiB", ""):
        with pytest.raises(ValueError, match="memory must be"):
            parse_memory(bad)


def test_chip_table_covers_tpu_generations_and_common_gpus():
    for chip in ("tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e", "tpu-v7x", "h100-80gb", "h200", "a100-80gb"):
        assert CHIP_MEMORY_BYTES[chip] > 8 << 30


def test_device_probe_reports_free_memory():
    assert device_free_bytes() > 0


def test_summary_is_readable():
    p = PRESETS["lingbot-v2"]
    plan = plan_memory(p.geometry, p.window, p.kv_branches, available_bytes=100 << 30,
                       session_capacity=2, cross_attention=p.cross_attention,
                       model_owned_state_bytes_per_session=p.model_owned_state_bytes_per_session)
    text = plan.summary()
    for needle in ("bytes per frame", "bytes per session per branch", "sessions granted / requested",
                   "1 / 2 (request not met", "raised to admit one session", "managed pages"):
        assert needle in text


@pytest.mark.parametrize("name, kwargs, error", [
    ("sessions", dict(sessions=0), ValueError), ("sessions", dict(sessions=1.5), TypeError),
    ("model", dict(sessions=1, model=0), ValueError),
])
def test_rollout_plan_names_the_parameter_the_caller_passed(name, kwargs, error):
    tiny = PRESETS["tiny"]
    with pytest.raises(error, match=f"^{name} must be positive"):
        rollout_plan(tiny.geometry, tiny.window, tiny.kv_branches, tiny.cross_attention, **kwargs)


def test_one_session_that_does_not_fit_is_reported_in_gib_and_bytes():
    wan = PRESETS["wan-1.3b"]
    with pytest.raises(InsufficientMemoryError, match=r"available 1\.00 GiB \(1,073,741,824 B\), required "
                                                      r"\d+\.\d\d GiB \([\d,]+ B\)"):
        plan_memory(wan.geometry, wan.window, wan.kv_branches, available_bytes=1 << 30, memory_fraction=1.0,
                    session_capacity=1)


# ----------------------------------------------------------------------------------------------
# Several processes: what one process of a mesh holds.


@pytest.mark.parametrize("data, model, processes, expected", [
    (4, 2, 1, (4, 8)), (4, 2, 2, (2, 4)), (4, 2, 4, (1, 2)), (8, 1, 2, (4, 4)), (6, 3, 3, (2, 6))])
def test_process_share_splits_the_data_axis(data, model, processes, expected):
    assert process_share(data, model, processes) == expected


@pytest.mark.parametrize("data, processes, error, needle", [
    (4, 3, ValueError, "processes must be a positive int dividing the mesh axis 'data' of size 4, one of "
                       "[1, 2, 4] (each process holds whole data shards), got 3"),
    (4, 8, ValueError, "got 8"),
    (4, 0, ValueError, "of size 4, one of [1, 2, 4] (each process holds whole data shards), got 0"),
    (4, 2.0, TypeError, "got 2.0 (float, expected an int)"),
    (4, True, TypeError, "(bool, expected an int)"),
    (0, 1, ValueError, "mesh axis 'data' must be a positive int, got 0"),
])
def test_process_share_refuses_counts_that_do_not_divide_the_data_axis(data, processes, error, needle):
    with pytest.raises(error) as info:
        process_share(data, 2, processes)
    assert needle in str(info.value)


def test_device_plan_sums_one_process_s_devices():
    """Per process = per device x (data / processes) x model devices; sessions x its data shards."""
    geometry = CacheGeometry(4, 8, 64, "bfloat16", tokens_per_frame=32, block_size=16)
    window = WindowPolicy(window_frames=4, sink_frames=1)
    kw = dict(data=4, model=2, available_bytes_per_device=1 << 30, sessions_per_shard=3,
              cross_attention=(CrossAttentionSpec("text", 64),), model_owned_state_bytes_per_session=1000)
    one = plan_per_device(geometry, window, **kw)
    two = plan_per_device(geometry, window, processes=2, **kw)
    assert (one.processes, one.data_shards_per_process, one.devices_per_process) == (1, 4, 8)
    assert one.pool_bytes_per_process == 8 * one.pool_bytes_per_device
    assert one.sessions_per_process == one.total_sessions == 12
    assert (two.processes, two.data_shards_per_process, two.devices_per_process) == (2, 2, 4)
    assert two.pool_bytes_per_device == one.pool_bytes_per_device > 0
    assert two.pool_bytes_per_process == 4 * two.pool_bytes_per_device
    assert two.bytes_per_process == 4 * two.bytes_per_device > two.pool_bytes_per_process
    assert two.sessions_per_process == 6
    assert two.to_dict()["pool_bytes_per_process"] == two.pool_bytes_per_process
    assert DevicePlan.from_plan(two.plan, 4, 2, 2) == two
    with pytest.raises(ValueError, match=r"processes must be a positive int dividing the mesh axis 'data' of "
                                         r"size 4, one of \[1, 2, 4\].*got 3"):
        plan_per_device(geometry, window, processes=3, **kw)


# ------------------------------------------------------------------------------------------------
# Quantized K/V pages (CacheGeometry.kv_dtype): the stored width plus one float32 scale per page of
# each layer and KV head, K and V.


@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn", "float8_e5m2"])
def test_a_quantized_page_is_half_a_bf16_page_plus_its_scales(kv_dtype):
    g = PRESETS["wan-1.3b"].geometry
    q = dataclasses.replace(g, kv_dtype=kv_dtype)
    assert (g.page_dtype, q.page_dtype, q.quantized, g.quantized) == ("bfloat16", kv_dtype, True, False)
    scales = 2 * g.num_layers * g.num_kv_heads * 4  # K and V, float32
    assert q.page_bytes == g.page_bytes // 2 + scales
    assert q.frame_bytes == q.pages_per_frame * q.page_bytes


@pytest.mark.parametrize("chip", sorted(CHIP_MEMORY_BYTES))
def test_wan_int8_streams_per_chip_are_twice_bf16_minus_the_scales(chip):
    """K/V only (no cross-attention cache), the whole chip: the most sessions the budget holds.

    Everything the planner counts per session and fixed (null page, spare, in-flight pages) halves,
    plus the scales (2 x 30 layers x 12 heads x 4 bytes per 1560-token page: 0.002 % of a page), so
    int8 holds 2x bf16's sessions, or one or two more (the fixed pages halve too), never fewer."""
    preset = PRESETS["wan-1.3b"]

    def streams(kv_dtype):
        geometry = dataclasses.replace(preset.geometry, kv_dtype=kv_dtype)
        plan = plan_memory(geometry, preset.window, preset.kv_branches, available_bytes=CHIP_MEMORY_BYTES[chip],
                           memory_fraction=1.0, session_capacity=1)
        assert plan.page_size_bytes == geometry.page_bytes  # the stored width plus the scales
        return plan.budget_session_capacity

    bf16, int8 = streams(None), streams("int8")
    assert bf16 >= 1
    assert 2 * bf16 <= int8 <= 2 * bf16 + 2
    assert streams("float8_e4m3fn") == streams("float8_e5m2") == int8  # one byte each, the same scales


def test_the_default_kv_dtype_leaves_the_seed_arithmetic_unchanged():
    for preset in PRESETS.values():
        g = preset.geometry
        assert g.kv_dtype is None and g.page_dtype == g.dtype and not g.quantized
        assert dataclasses.replace(g, kv_dtype=g.dtype) == g  # the compute dtype is the default, spelled out
        assert g.page_bytes == 2 * g.block_size * g.num_kv_heads * g.head_dim * g.itemsize * g.num_layers
