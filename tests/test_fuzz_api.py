"""API fuzz: wrong types and out-of-range values at every public entry point give a standard exception
naming the parameter, and leave the cache unchanged (free pages, pages held per session, pool bytes)."""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arkv_jax.cache import PagedKVCache
from arkv_jax.config import CacheGeometry, CrossAttentionSpec, KVBranch, WindowPolicy
from arkv_jax.planner import plan_memory
from arkv_jax.rollout import Sampler

GEOMETRY = CacheGeometry(1, 1, 4, "float32", tokens_per_frame=4)
WINDOW = WindowPolicy(window_frames=2)
STANDARD = (TypeError, ValueError, KeyError)

NOT_AN_INT = st.one_of(st.booleans(), st.floats(allow_nan=True), st.text(max_size=3), st.none(),
                       st.lists(st.integers(), max_size=2), st.complex_numbers())
BAD_INT = st.one_of(NOT_AN_INT, st.integers(max_value=0))
NOT_A_REAL = st.one_of(st.booleans(), st.text(max_size=3), st.none(), st.just(float("nan")),
                       st.just(float("inf")), st.complex_numbers())
NOT_A_NAME_LIST = st.one_of(st.text(min_size=1, max_size=3), st.integers(), st.none(),
                            st.lists(st.one_of(st.integers(), st.none()), min_size=1, max_size=2))

_CACHE = {}


def cache():
    if "c" not in _CACHE:
        c = PagedKVCache(GEOMETRY, WINDOW, (KVBranch("pos"), KVBranch("neg", 1)), (CrossAttentionSpec("text", 3),),
                         available_bytes=1 << 22, memory_fraction=1.0, session_capacity=3)
        c.open("a")
        c.open("b")
        _CACHE["c"] = c
    return _CACHE["c"]


def snapshot(c):
    held = {k: v.tolist() for k, v in c.pages_held(list(c.sessions)).items()}
    return c.num_free_pages(), held, c.sessions, sum(p.nbytes for p in c.pools), c._core.in_flight


def check(call, *words):
    with pytest.raises(STANDARD) as info:
        call()
    assert not isinstance(info.value, (AssertionError, AttributeError, OverflowError))
    message = str(info.value)
    assert any(w in message for w in words), (words, message)


def enter(c, *args, **kwargs):
    with c.chunk(*args, **kwargs):
        pass


def _int_ok(value, lo, hi):
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


@settings(max_examples=40, deadline=None)
@given(method=st.sampled_from(["chunk_ids", "chunk_frames", "chunk_branches", "chunk_full", "open", "close",
                               "reset", "reset_keep", "populate_name", "populate_branch", "rows", "pages_held"]),
       value=st.one_of(NOT_AN_INT, NOT_A_NAME_LIST, st.integers(-3, 99)))
def test_cache_methods_refuse_bad_arguments_and_change_nothing(method, value):
    c = cache()
    before = snapshot(c)
    layers = [(jnp.zeros((3, 1, 4)),) * 2]
    calls = {
        "chunk_ids": (lambda: enter(c, value, 1), "session_ids"),
        "chunk_frames": (lambda: enter(c, ["a"], value), "num_frames"),
        "chunk_branches": (lambda: enter(c, ["a"], 1, value), "branch"),
        "chunk_full": (lambda: enter(c, ["a"], 1, full_batch=value), "full_batch"),
        "open": (lambda: c.open(value), "session_id"),
        "close": (lambda: c.close(value), "session"),
        "reset": (lambda: c.reset(value), "session"),
        "reset_keep": (lambda: c.reset("a", keep_cross_attention=value), "keep_cross_attention", "cross-attention"),
        "populate_name": (lambda: c.populate_cross_attention("a", value, "pos", layers), "name", "cross-attention"),
        "populate_branch": (lambda: c.populate_cross_attention("a", "text", value, layers), "branch"),
        "rows": (lambda: c.rows(value), "session"),
        "pages_held": (lambda: c.pages_held(value), "session"),
    }
    call, *words = calls[method]
    if method == "chunk_frames" and _int_ok(value, 1, c.max_chunk_frames(2)):
        return  # a valid value
    if method in ("open",) and isinstance(value, str) and value:
        return
    if method in ("chunk_branches", "chunk_full") and (value is None or isinstance(value, bool)):
        return  # valid values
    if method in ("reset_keep", "rows", "pages_held") and isinstance(value, list) and not value:
        return
    check(call, *words)
    assert snapshot(c) == before


@settings(max_examples=40, deadline=None)
@given(field=st.sampled_from(["num_layers", "num_kv_heads", "head_dim", "tokens_per_frame", "block_size",
                              "frames_per_forward", "dtype", "window_frames", "sink_frames", "reset_at_boundary",
                              "branch_name", "branch_index", "spec_tokens", "spec_heads"]),
       value=st.one_of(BAD_INT, st.text(max_size=3)))
def test_config_types_refuse_bad_fields(field, value):
    geometry = dict(num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32", tokens_per_frame=4)
    builders = {
        "dtype": (lambda: CacheGeometry(**{**geometry, "dtype": value}), "dtype"),
        "window_frames": (lambda: WindowPolicy(value), "window_frames"),
        "sink_frames": (lambda: WindowPolicy(2, sink_frames=value), "sink_frames"),
        "reset_at_boundary": (lambda: WindowPolicy(2, reset_at_boundary=value), "reset_at_boundary"),
        "branch_name": (lambda: KVBranch(value), "KV branch name"),
        "branch_index": (lambda: KVBranch("x", value), "local_index"),
        "spec_tokens": (lambda: CrossAttentionSpec("t", value), "num_tokens"),
        "spec_heads": (lambda: CrossAttentionSpec("t", 2, value), "num_kv_heads"),
    }
    call, word = builders.get(field, (lambda: CacheGeometry(**{**geometry, field: value}), field))
    if field == "sink_frames" and _int_ok(value, 0, 10**40):
        return
    if field == "branch_index" and _int_ok(value, 0, 10**40):
        return
    if field == "branch_name" and isinstance(value, str) and value:
        return
    if field == "reset_at_boundary" and isinstance(value, bool):
        return
    if field in ("block_size", "spec_heads") and value is None:
        return
    valid_dtypes = ("float32", "bfloat16", "float16", "f", "e", "f4", "f2")
    if field == "dtype" and isinstance(value, str) and value in valid_dtypes:
        return
    check(call, word)


@settings(max_examples=40, deadline=None)
@given(param=st.sampled_from(["available_bytes", "memory_fraction", "session_capacity",
                              "max_scratch_tokens_per_branch", "model_owned_state_bytes_per_session",
                              "batched_in_flight", "scratch_blocks_override"]),
       value=st.one_of(NOT_AN_INT, NOT_A_REAL, st.integers(max_value=-1), st.floats(min_value=1.01)))
def test_plan_memory_refuses_bad_inputs(param, value):
    kwargs = dict(available_bytes=1 << 20, memory_fraction=0.5)
    kwargs[param] = value
    if param == "memory_fraction" and isinstance(value, float) and 0 < value <= 1:
        return
    if param == "scratch_blocks_override" and value is None:
        return
    if param == "batched_in_flight" and isinstance(value, bool):
        return
    check(lambda: plan_memory(GEOMETRY, WINDOW, **kwargs), param)


@settings(max_examples=30, deadline=None)
@given(param=st.sampled_from(["num_steps", "shift", "guidance_scale"]),
       value=st.one_of(NOT_A_REAL, st.just(0), st.just(-1.5), st.just(1.5)))
def test_sampler_refuses_bad_values(param, value):
    if param == "guidance_scale" and (value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)
                                                        and math.isfinite(value))):
        return
    if param == "shift" and isinstance(value, float) and value > 0 and math.isfinite(value):
        return
    check(lambda: Sampler(**{param: value}), param)


def test_plan_memory_examples_from_the_issue():
    check(lambda: plan_memory(GEOMETRY, WINDOW, available_bytes=float("nan")), "available_bytes")
    check(lambda: plan_memory(GEOMETRY, WINDOW, available_bytes=1 << 20, session_capacity=2.5), "session_capacity")
    check(lambda: plan_memory(GEOMETRY, WINDOW, available_bytes=1 << 20, memory_fraction="0.5"), "memory_fraction")
    check(lambda: plan_memory("geometry", WINDOW, available_bytes=1 << 20), "geometry")
    check(lambda: plan_memory(GEOMETRY, WINDOW, ("main",), available_bytes=1 << 20), "kv_branches")
    assert np.isfinite(plan_memory(GEOMETRY, WINDOW, available_bytes=1 << 20).memory_fraction)


# ------------------------------------------------------------------------------------------------
# The kernels' public functions and Rollout.join.

def _attention_args():
    from pallas_kernels.layout import pool_shape

    pool = jnp.zeros(pool_shape(2, 6, 4, 1, 8), jnp.float32)
    q = jnp.zeros((1, 4, 2, 8), jnp.float32)
    cur = jnp.zeros((1, 4, 1, 8), jnp.float32)
    return dict(q=q, k_cur=cur, v_cur=cur, k_pool=pool, v_pool=pool, pages=jnp.zeros((1, 2), jnp.int32),
                lengths=jnp.zeros((1,), jnp.int32))


@settings(max_examples=40, deadline=None)
@given(field=st.sampled_from(["layer", "tokens_per_frame", "backend", "scale"]),
       value=st.one_of(st.booleans(), st.text(max_size=3), st.none(), st.floats(allow_nan=True),
                       st.integers(max_value=0)))
def test_window_attention_static_validation_names_the_parameter(field, value):
    from pallas_kernels.window_attention import static_validate_inputs

    if field == "layer" and (value is None or isinstance(value, int) and not isinstance(value, bool)):
        return  # ints are valid layers for static validation (range is the dynamic check)
    if field == "tokens_per_frame" and value is None:
        return  # None means block_size
    if field == "scale" and (value is None or isinstance(value, float) and math.isfinite(value) and value > 0):
        return
    check(lambda: static_validate_inputs(**_attention_args(), **{field: value}), field)


@settings(max_examples=30, deadline=None)
@given(field=st.sampled_from(["tokens_per_frame", "backend"]),
       value=st.one_of(st.booleans(), st.text(max_size=3), st.floats(allow_nan=True), st.integers(max_value=0)))
def test_paged_write_static_validation_names_the_parameter(field, value):
    from pallas_kernels.paged_write import static_validate_inputs

    args = _attention_args()
    new = jnp.zeros((2, 1, 4, 1, 8), jnp.float32)
    check(lambda: static_validate_inputs(args["k_pool"], args["v_pool"], new, new, jnp.ones((1, 1), jnp.int32),
                                         **{field: value}), field)
