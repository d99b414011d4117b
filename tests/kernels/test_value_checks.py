"""The kernels' value checks (issue #21, item 1): what each call refuses, eager or traced.

One rule for both kernels (:mod:`pallas_kernels.common`): static arguments are checked on every
call; concrete page ids, lengths and array layers are checked on the host by default
(``validate=True``) and refused before anything runs; ``validate=False`` turns that off; traced
values are checked only with ``validate="checkify"`` under ``checkify.checkify``, and the default
jitted program is the one without checks. Tiny shapes, ``xla`` backend.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from pallas_kernels.common import is_concrete, value_check_mode
from pallas_kernels.layout import pool_shape
from pallas_kernels.paged_write import write_chunk, write_chunk_reference
from pallas_kernels.window_attention import window_attention, window_attention_reference

LAYERS, NUM_PAGES, BLOCK, KV_HEADS, HEAD_DIM = 2, 10, 4, 1, 8
MAX_PAGES, ROWS, CUR = 3, 2, 4  # Capacity 12 tokens per row.


def attention_case(seed=0):
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    pool = pool_shape(LAYERS, NUM_PAGES, BLOCK, KV_HEADS, HEAD_DIM)
    return dict(q=normal(ROWS, CUR, 2, HEAD_DIM), k_cur=normal(ROWS, CUR, KV_HEADS, HEAD_DIM),
                v_cur=normal(ROWS, CUR, KV_HEADS, HEAD_DIM), k_pool=normal(*pool),
                v_pool=normal(*pool), pages=jnp.asarray([[1, 2, 3], [4, 5, 0]], jnp.int32),
                lengths=jnp.asarray([12, 6], jnp.int32), layer=1)


def attend(case, **kwargs):
    return window_attention(**dict(case, backend="xla", **kwargs))


def write_case(seed=0):
    rng = np.random.default_rng(seed)
    pool = pool_shape(LAYERS, NUM_PAGES, BLOCK, KV_HEADS, HEAD_DIM)
    new = (LAYERS, ROWS, 2 * BLOCK, KV_HEADS, HEAD_DIM)  # Two one-page frames per row.
    k_pool, v_pool, k_new, v_new = (jnp.asarray(rng.standard_normal(s), jnp.float32)
                                    for s in (pool, pool, new, new))
    return k_pool, v_pool, k_new, v_new, jnp.asarray([[1, 2], [3, 4]], jnp.int32)


def write(k_pool, v_pool, k_new, v_new, page_ids, **kwargs):
    return write_chunk(k_pool, v_pool, k_new, v_new, page_ids, backend="xla", **kwargs)


# ------------------------------------------------------------------------------------------------
# window_attention, eager: concrete values are refused by default.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("change,message", [
    (dict(layer=LAYERS), r"^layer=2 is out of range; allowed \[0, 2\) \(k_pool.shape\[0\]\)$"),
    (dict(layer=-1), r"^layer=-1 is out of range; allowed \[0, 2\)"),
    (dict(layer=jnp.int32(LAYERS)), r"^layer=2 is out of range; allowed \[0, 2\)"),
    (dict(layer=np.int64(LAYERS)), r"^layer=2 is out of range; allowed \[0, 2\)"),
    (dict(pages=jnp.asarray([[1, 2, 3], [4, NUM_PAGES, 0]], jnp.int32)),
     r"^pages\[1, 1\]=10 is not a page id; allowed \[0, 10\) \(k_pool.shape\[2\]\)$"),
    (dict(pages=jnp.asarray([[1, 2, -1], [4, 5, 0]], jnp.int32)),
     r"^pages\[0, 2\]=-1 is not a page id; allowed \[0, 10\)"),
    (dict(lengths=jnp.asarray([12, 13], jnp.int32)),
     r"^lengths\[1\]=13 is out of range; allowed \[0, 12\] \(the capacity of 3 pages"),
    (dict(lengths=jnp.asarray([-1, 0], jnp.int32)), r"^lengths\[0\]=-1 is out of range"),
])
def test_eager_attention_refuses_bad_values(change, message):
    """A 2-layer pool's layer 2, page id 10 of a 10-page pool, -1, a length past the capacity:
    each used to run (reading another layer or page) and is now refused, naming the entry."""
    with pytest.raises(ValueError, match=message):
        attend(attention_case(), **change)


def test_attention_takes_lists_of_ints():
    case = attention_case()
    as_lists = dict(case, pages=np.asarray(case["pages"]).tolist(),
                    lengths=np.asarray(case["lengths"]).tolist())
    np.testing.assert_array_equal(attend(as_lists), attend(case))
    np.testing.assert_array_equal(attend(dict(case, pages=tuple(map(tuple, as_lists["pages"])))),
                                  attend(case))


@pytest.mark.parametrize("name,value,message", [
    ("pages", [[1.0, 2.0, 3.0], [4.0, 5.0, 0.0]], r"^pages must be a list of ints, got a list of float"),
    ("pages", [[1, 2, 3], [4]], r"^pages must be a rectangular list of ints"),
    ("pages", "1 2 3", r"^pages must be an integer array \(int32\) or a list of ints, got str"),
    ("lengths", [True, False], r"^lengths must be a list of ints, got a list of bool"),
    ("lengths", None, r"^lengths must be an integer array .* got NoneType"),
])
def test_attention_refuses_other_python_values_with_a_type_error(name, value, message):
    with pytest.raises(TypeError, match=message):
        attend(dict(attention_case(), **{name: value}))


def test_attention_validate_false_turns_the_value_check_off():
    """The one switch: an eager call with ``validate=False`` runs on out-of-range lengths (masked to
    the capacity, as under jit) and does not read the values on the host."""
    case = attention_case()
    too_long = dict(case, lengths=jnp.asarray([10_000, 6], jnp.int32))
    np.testing.assert_allclose(attend(too_long, validate=False), window_attention_reference(**case),
                               atol=1e-5)
    attend(dict(case, pages=case["pages"].at[0, 0].set(NUM_PAGES)), validate=False)  # no raise
    with pytest.raises(ValueError, match=r"^layer=2 is out of range"):  # static: always checked
        attend(case, layer=LAYERS, validate=False)


@pytest.mark.parametrize("validate", [None, "yes", 1, "Checkify"])
def test_validate_takes_three_values(validate):
    with pytest.raises(ValueError, match=r"^validate must be True, False or 'checkify', got "):
        attend(attention_case(), validate=validate)
    with pytest.raises(ValueError, match=r"^validate must be True, False or 'checkify', got "):
        write(*write_case(), validate=validate)


# ------------------------------------------------------------------------------------------------
# window_attention under jit: static arguments always, values with checkify.
# ------------------------------------------------------------------------------------------------


ARRAY_NAMES = ("q", "k_cur", "v_cur", "k_pool", "v_pool", "pages", "lengths")


def jitted_attention(case, **kwargs):
    """``jax.jit`` of the call with every array (and an array ``layer``) traced."""
    def step(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, layer):
        return window_attention(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, layer=layer,
                                backend="xla", **kwargs)

    return jax.jit(step)


def arrays(case):
    return [case[n] for n in ARRAY_NAMES]


@pytest.mark.parametrize("kwargs,message", [
    (dict(layer=LAYERS), r"^layer=2 is out of range; allowed \[0, 2\)"),
    (dict(tokens_per_frame=0), r"^tokens_per_frame must be an int >= 1"),
    (dict(tokens_per_frame=2.0), r"^tokens_per_frame must be an int >= 1"),
    (dict(scale=-0.5), r"^scale must be a positive finite number"),
    (dict(scale=float("nan")), r"^scale must be a positive finite number"),
    (dict(block_k=0), r"^block_k must be None or a positive int \(a static tile size\), got 0"),
    (dict(block_q=2.5), r"^block_q must be None or a positive int .*, got 2.5 \(float, expected an int\)"),
    (dict(block_q=True), r"^block_q must be None or a positive int .*, got True \(bool, expected an int\)"),
    (dict(backend="pallas_tpu_interpret", block_q=12), r"^block_q must be a positive multiple of 8 .*, got 12"),
    (dict(backend="pallas_tpu_interpret", block_k=20), r"^block_k must be a positive multiple of 8 .*, got 20"),
])
def test_static_arguments_are_refused_under_jit(kwargs, message):
    """Static arguments are checked on every call: eagerly and while tracing a jitted caller."""
    case = attention_case()
    kwargs = {"backend": "xla", "layer": 0, **kwargs}
    layer = kwargs.pop("layer")

    @jax.jit
    def step(q, k_cur, v_cur, k_pool, v_pool, pages, lengths):
        return window_attention(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, layer=layer,
                                **kwargs)

    with pytest.raises(ValueError, match=message):
        step(*arrays(case))
    with pytest.raises(ValueError, match=message):
        window_attention(**dict(case, layer=layer, **kwargs))


@pytest.mark.parametrize("name", ["tokens_per_frame", "scale", "block_q", "block_k"])
def test_traced_static_arguments_are_refused(name):
    case = attention_case()
    step = jax.jit(lambda value: attend(case, **{name: value}))
    with pytest.raises(ValueError, match=rf"^{name}"):
        step(jnp.int32(4) if name != "scale" else jnp.float32(0.5))


def test_traced_values_are_not_checked_by_default():
    """Under jit the values are tracers: nothing is checked, nothing raises."""
    case = attention_case()
    bad = dict(case, pages=case["pages"].at[0, 0].set(NUM_PAGES), lengths=case["lengths"] + 100)
    jax.block_until_ready(jitted_attention(case)(*arrays(bad), jnp.int32(LAYERS)))


def test_default_jitted_program_has_no_checks():
    """``validate=True`` (the default) and ``validate=False`` lower to the same program under jit:
    the checks add nothing to the compiled kernel; ``"checkify"`` (under checkify) adds them."""
    case = attention_case()
    args = (*arrays(case), jnp.int32(1))
    default = jitted_attention(case).lower(*args).as_text()
    assert default == jitted_attention(case, validate=False).lower(*args).as_text()
    checked = jax.jit(checkify.checkify(jitted_attention(case, validate="checkify")))
    assert checked.lower(*args).as_text() != default


@pytest.mark.slow
@pytest.mark.parametrize("change,layer,message", [
    (dict(), LAYERS, r"^layer=2 is out of range; allowed \[0, 2\)"),
    (dict(pages=jnp.asarray([[1, 2, 3], [4, NUM_PAGES, 0]], jnp.int32)), 1,
     r"^pages\[1, 1\]=10 is not a page id; allowed \[0, 10\)"),
    (dict(pages=jnp.asarray([[1, 2, 3], [-1, 5, 0]], jnp.int32)), 1,
     r"^pages\[1, 0\]=-1 is not a page id; allowed \[0, 10\)"),
    (dict(lengths=jnp.asarray([12, 13], jnp.int32)), 1,
     r"^lengths\[1\]=13 is out of range; allowed \[0, 12\]"),
])
def test_checkify_reports_bad_traced_values(change, layer, message):
    """The checked jit form: ``validate="checkify"`` under ``checkify.checkify(jax.jit(step))``."""
    case = attention_case()
    step = checkify.checkify(jitted_attention(case, validate="checkify"))
    err, _ = step(*arrays(dict(case, **change)), jnp.int32(layer))
    with pytest.raises(checkify.JaxRuntimeError, match=message):
        err.throw()
    err, out = step(*arrays(case), jnp.int32(1))
    err.throw()
    np.testing.assert_allclose(out, window_attention_reference(**case), atol=1e-5)


def test_checkify_form_refuses_to_stage_without_checkify():
    case = attention_case()
    with pytest.raises(ValueError, match="checkify"):
        jitted_attention(case, validate="checkify")(*arrays(case), jnp.int32(1))


def test_constants_closed_over_by_a_jitted_caller_are_checked_while_tracing():
    """Concrete values are checked wherever they appear, here at trace time (once, on the host)."""
    case = attention_case()
    bad_pages = case["pages"].at[1, 2].set(NUM_PAGES)
    step = jax.jit(lambda q: attend(dict(case, q=q, pages=bad_pages)))
    with pytest.raises(ValueError, match=r"^pages\[1, 2\]=10 is not a page id"):
        step(case["q"])


def test_the_rule():
    """``value_check_mode``: concrete -> host unless switched off; traced -> checkify only on
    request."""
    concrete = jnp.zeros(3, jnp.int32)
    assert is_concrete(concrete) and is_concrete(np.zeros(3))
    assert not is_concrete(jax.ShapeDtypeStruct((3,), jnp.int32))
    assert value_check_mode(True, concrete) == "host"
    assert value_check_mode("checkify", concrete) == "host"
    assert value_check_mode(False, concrete) is None

    @jax.jit
    def traced(x):
        assert not is_concrete(x)
        assert value_check_mode(True, x) is None and value_check_mode(False, x) is None
        assert value_check_mode("checkify", x) == "checkify"
        return x

    traced(concrete)


# ------------------------------------------------------------------------------------------------
# write_chunk
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ids,message", [
    ([[1, 1], [3, 4]], r"^page_ids\[0, 1\]=1 repeats page_ids\[0, 0\]; a page may be written at "
                       r"most once per call"),
    ([[1, 2], [3, 2]], r"^page_ids\[1, 1\]=2 repeats page_ids\[0, 1\]"),
    ([[1, 2], [3, NUM_PAGES]], r"^page_ids\[1, 1\]=10 is not a page id; allowed \[0, 10\)"),
    ([[1, 2], [-1, 4]], r"^page_ids\[1, 0\]=-1 is not a page id; allowed \[0, 10\)"),
])
@pytest.mark.parametrize("as_list", [False, True], ids=["array", "list"])
def test_eager_write_refuses_bad_ids_and_changes_nothing(ids, message, as_list):
    """Repeated ids (within a row or across rows), ids out of range and negative ids are refused
    before anything runs: the caller's pools stay valid and unchanged."""
    k_pool, v_pool, k_new, v_new, _ = write_case()
    page_ids = ids if as_list else jnp.asarray(ids, jnp.int32)
    k_before, v_before = np.asarray(k_pool), np.asarray(v_pool)
    with pytest.raises(ValueError, match=message):
        write(k_pool, v_pool, k_new, v_new, page_ids, tokens_per_frame=BLOCK)
    assert not k_pool.is_deleted() and not v_pool.is_deleted()
    np.testing.assert_array_equal(np.asarray(k_pool), k_before)
    np.testing.assert_array_equal(np.asarray(v_pool), v_before)


def test_refused_write_inside_a_donating_caller_donates_nothing():
    """A jitted caller that donates the pools and closes over bad concrete ids fails while tracing,
    before any buffer is donated."""
    k_pool, v_pool, k_new, v_new, _ = write_case()
    bad = jnp.asarray([[1, 1], [3, 4]], jnp.int32)
    step = jax.jit(lambda kp, vp: write(kp, vp, k_new, v_new, bad), donate_argnums=(0, 1))
    with pytest.raises(ValueError, match=r"repeats"):
        step(k_pool, v_pool)
    assert not k_pool.is_deleted() and not v_pool.is_deleted()


def test_write_allows_repeated_null_pages():
    """0 is the skip id (padding rows, failed allocations): it may repeat."""
    k_pool, v_pool, k_new, v_new, _ = write_case()
    ids = jnp.asarray([[0, 0], [3, 0]], jnp.int32)
    k_out, v_out = write(k_pool, v_pool, k_new, v_new, ids)
    k_ref, v_ref = write_chunk_reference(k_pool, v_pool, k_new, v_new, ids)
    np.testing.assert_array_equal(k_out, k_ref)
    np.testing.assert_array_equal(v_out, v_ref)


@pytest.mark.parametrize("convert", [lambda a: a.tolist(), lambda a: tuple(map(tuple, a.tolist())),
                                     lambda a: a.astype(np.int64)], ids=["list", "tuple", "numpy"])
def test_write_takes_page_ids_as_python_lists(convert):
    k_pool, v_pool, k_new, v_new, page_ids = write_case()
    got = write(k_pool, v_pool, k_new, v_new, convert(np.asarray(page_ids)))
    want = write_chunk_reference(k_pool, v_pool, k_new, v_new, page_ids)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


@pytest.mark.parametrize("ids,message", [
    ([[1.0, 2.0], [3.0, 4.0]], r"^page_ids must be a list of ints, got a list of float64 values"),
    ([[1, 2], [3]], r"^page_ids must be a rectangular list of ints"),
    ({"a": 1}, r"^page_ids must be an integer array \(int32\) or a list of ints, got dict"),
])
def test_write_refuses_other_python_values_with_a_type_error(ids, message):
    with pytest.raises(TypeError, match=message):
        write(*write_case()[:4], ids)


def test_list_entries_must_fit_in_int32():
    """A list is range-checked before its int32 conversion (2**31 + 5 must not wrap to page 5)."""
    with pytest.raises(ValueError, match=r"^page_ids\[1, 1\]=2147483653 does not fit in int32"):
        write(*write_case()[:4], [[1, 2], [3, 2**31 + 5]], validate=False)


def test_write_validate_false_turns_the_value_check_off():
    """Unchecked, an out-of-range id skips and nothing raises (the jitted behaviour)."""
    k_pool, v_pool, k_new, v_new, _ = write_case()
    ids = jnp.asarray([[1, NUM_PAGES], [-1, 4]], jnp.int32)
    k_out, _ = write(k_pool, v_pool, k_new, v_new, ids, validate=False)
    np.testing.assert_array_equal(k_out, write_chunk_reference(k_pool, v_pool, k_new, v_new, ids)[0])


def test_write_static_arguments_are_refused_under_jit():
    k_pool, v_pool, k_new, v_new, page_ids = write_case()
    for tokens_per_frame in (0, 3, 2.0):
        step = jax.jit(functools.partial(write, tokens_per_frame=tokens_per_frame))
        with pytest.raises(ValueError, match=r"tokens_per_frame"):
            step(k_pool, v_pool, k_new, v_new, page_ids)


def test_write_default_jitted_program_has_no_checks():
    case = write_case()
    default = jax.jit(write).lower(*case).as_text()
    assert default == jax.jit(functools.partial(write, validate=False)).lower(*case).as_text()


@pytest.mark.slow
@pytest.mark.parametrize("ids,message", [
    ([[1, 2], [3, 2]], r"^page_ids\[1, 1\]=2 repeats page_ids\[0, 1\]; a page may be written"),
    ([[1, 2], [NUM_PAGES, 4]], r"^page_ids\[1, 0\]=10 is not a page id; allowed \[0, 10\)"),
    ([[1, -2], [3, 4]], r"^page_ids\[0, 1\]=-2 is not a page id; allowed \[0, 10\)"),
])
def test_write_checkify_reports_bad_traced_ids(ids, message):
    k_pool, v_pool, k_new, v_new, page_ids = write_case()
    step = checkify.checkify(jax.jit(functools.partial(write, validate="checkify")))
    err, _ = step(k_pool, v_pool, k_new, v_new, jnp.asarray(ids, jnp.int32))
    with pytest.raises(checkify.JaxRuntimeError, match=message):
        err.throw()
    for fine in (page_ids, jnp.asarray([[0, 0], [0, 5]], jnp.int32)):
        err, out = step(k_pool, v_pool, k_new, v_new, fine)
        err.throw()
        np.testing.assert_array_equal(out[0], write_chunk_reference(k_pool, v_pool, k_new, v_new,
                                                                    fine)[0])
