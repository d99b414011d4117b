"""Tests of the paged chunk write (pallas_kernels/paged_write/) on CPU.

Every backend runs here: ``xla`` compiled, the GPU scatter write compiled for the CPU
(``cudnn_gather_xla``), the Pallas kernels in interpret mode only (``pallas_tpu_interpret``,
``pallas_gpu_interpret``, and ``pallas_tpu_simulate``, the TPU simulator with race detection and
out-of-bounds checks, on small shapes). Pools are filled with random values
and NaN before a write, so "untouched" is checked bit for bit.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.layout import (
    QuantizedPool,
    from_token_major,
    pool_geometry,
    pool_shape,
    scale_shape,
    to_token_major,
)
from pallas_kernels.paged_write import (
    dynamic_validate_inputs,
    pages_per_frame,
    static_validate_inputs,
    write_chunk,
    write_chunk_reference,
)
from tests.kernels.device_backends import (
    COMPILED_BACKENDS,
    CUDNN_GATHER,
    IGNORE_TRITON_DEPRECATION,
    compiled,
)
from tests.tiers import slow_except

# The fast tier runs the XLA path and the TPU kernel in interpret mode; the others in the whole suite.
BACKENDS = slow_except(("xla", "cudnn_gather_xla", "pallas_tpu_interpret", "pallas_gpu_interpret",
                        "pallas_tpu_simulate", *COMPILED_BACKENDS, CUDNN_GATHER), fast=("xla", "pallas_tpu_interpret"))
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
BLOCK = 16
HEADS, HEAD_DIM = 2, 128


def make_case(seed, *, layers=2, num_pages=24, rows=2, frames=2, tokens_per_frame=24,
              dtype=jnp.float32, nan_pages=4):
    """Random pools (null page zero, ``nan_pages`` pages NaN), a random chunk and random distinct
    page ids drawn from a permutation of ``[1, num_pages)``. Pools are built token-major
    ``[L, P, S, H, D]`` and laid out with :func:`pallas_kernels.layout.from_token_major`."""
    rng = np.random.default_rng(seed)
    shape = (layers, num_pages, BLOCK, HEADS, HEAD_DIM)

    def pool():
        x = rng.standard_normal(shape).astype(np.float32)
        x[:, 0] = 0.0
        x[:, rng.choice(np.arange(1, num_pages), nan_pages, replace=False)] = np.nan
        return from_token_major(jnp.asarray(x, dtype))

    ppf = pages_per_frame(tokens_per_frame, BLOCK)
    new_shape = (layers, rows, frames * tokens_per_frame, HEADS, HEAD_DIM)
    k_new = jnp.asarray(rng.standard_normal(new_shape), dtype)
    v_new = jnp.asarray(rng.standard_normal(new_shape), dtype)
    ids = rng.permutation(np.arange(1, num_pages))[: rows * frames * ppf]
    page_ids = jnp.asarray(ids.reshape(rows, frames * ppf), jnp.int32)
    return pool(), pool(), k_new, v_new, page_ids


def bits(x):
    """The raw bits of ``x`` as unsigned ints (NaN-safe, exact comparison)."""
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def assert_bitwise_equal(actual, expected):
    np.testing.assert_array_equal(bits(actual), bits(expected))


def token_major(pool) -> np.ndarray:
    """A pool as a token-major ``[L, P, S, H, D]`` numpy array (pages on axis 1)."""
    return np.asarray(to_token_major(jnp.asarray(pool)))


def assert_only_named_pages_changed(before, after, page_ids, num_pages):
    """Pages outside ``page_ids`` (and always the null page) are bit-identical to ``before``."""
    before, after = token_major(before), token_major(after)
    ids = np.asarray(page_ids).reshape(-1)
    named = np.zeros(num_pages, bool)
    named[ids[(ids >= 1) & (ids < num_pages)]] = True
    untouched = ~named
    assert_bitwise_equal(np.asarray(after)[:, untouched], np.asarray(before)[:, untouched])
    assert not np.asarray(after, np.float32)[:, 0].any(), "the null page was written"


def numpy_write(pool, new, page_ids, tokens_per_frame):
    """An independent, loop-by-loop numpy statement of the write (for checking the reference), on
    the token-major view; returns the pool in its own layout."""
    pool = token_major(pool).copy()
    layers, rows, tokens, heads, dim = new.shape
    block = pool.shape[2]
    ppf = pages_per_frame(tokens_per_frame, block)
    ids = np.asarray(page_ids)
    for r in range(rows):
        for f in range(tokens // tokens_per_frame):
            for j in range(ppf):
                page = ids[r, f * ppf + j]
                if not 1 <= page < pool.shape[1]:
                    continue
                start = f * tokens_per_frame + j * block
                stop = min(start + block, (f + 1) * tokens_per_frame)
                pool[:, page] = 0
                pool[:, page, : stop - start] = np.asarray(new)[:, r, start:stop]
    return np.asarray(from_token_major(pool))


def test_pages_per_frame():
    assert pages_per_frame(16, 16) == 1
    assert pages_per_frame(24, 16) == 2
    assert pages_per_frame(1560, 16) == 98
    assert pages_per_frame(1, 16) == 1


@pytest.mark.slow
@pytest.mark.parametrize("tokens_per_frame", [16, 24, 40])
def test_reference_matches_numpy_loop(tokens_per_frame):
    k_pool, v_pool, k_new, v_new, page_ids = make_case(0, tokens_per_frame=tokens_per_frame)
    page_ids = page_ids.at[1, 0].set(0)  # A skipped entry.
    k_ref, v_ref = write_chunk_reference(k_pool, v_pool, k_new, v_new, page_ids,
                                         tokens_per_frame=tokens_per_frame)
    assert_bitwise_equal(k_ref, numpy_write(k_pool, k_new, page_ids, tokens_per_frame))
    assert_bitwise_equal(v_ref, numpy_write(v_pool, v_new, page_ids, tokens_per_frame))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_reference_padded_frames(backend, dtype):
    """3 layers, 3 rows, 2 frames of 24 tokens in 16-token pages (2 pages per frame, 8 padding)."""
    case = make_case(1, layers=3, rows=3, frames=2, tokens_per_frame=24, dtype=dtype)
    k_pool, v_pool, _, _, page_ids = case
    k_out, v_out = write_chunk(*case, tokens_per_frame=24, backend=backend)
    k_ref, v_ref = write_chunk_reference(*case, tokens_per_frame=24)
    assert k_out.dtype == k_pool.dtype and k_out.shape == k_pool.shape
    assert_bitwise_equal(k_out, k_ref)
    assert_bitwise_equal(v_out, v_ref)
    assert_only_named_pages_changed(k_pool, k_out, page_ids, pool_geometry(k_pool).num_pages)
    assert_only_named_pages_changed(v_pool, v_out, page_ids, pool_geometry(v_pool).num_pages)
    # The padding tokens of each frame's last page are zeros.
    last_pages = np.asarray(page_ids)[:, 1::2].reshape(-1)
    assert not token_major(k_out.astype(jnp.float32))[:, last_pages, 8:].any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", [2, 3])
def test_matches_reference_one_layer_unpadded(backend, seed):
    """1 layer, tokens_per_frame == block_size (default), 4 rows of 3 frames."""
    case = make_case(seed, layers=1, rows=4, frames=3, tokens_per_frame=BLOCK, dtype=jnp.bfloat16)
    k_out, v_out = write_chunk(*case, backend=backend)
    k_ref, v_ref = write_chunk_reference(*case)
    assert_bitwise_equal(k_out, k_ref)
    assert_bitwise_equal(v_out, v_ref)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tokens_per_frame", [8, 40])
def test_matches_reference_short_and_long_frames(backend, tokens_per_frame):
    """A frame shorter than a page (8 tokens: one page, half padding) and one of three pages
    (40 tokens: two full pages, then 8 tokens and 8 padding)."""
    case = make_case(10, rows=2, frames=2, tokens_per_frame=tokens_per_frame, dtype=jnp.float16)
    k_out, v_out = write_chunk(*case, tokens_per_frame=tokens_per_frame, backend=backend)
    k_ref, v_ref = write_chunk_reference(*case, tokens_per_frame=tokens_per_frame)
    assert_bitwise_equal(k_out, k_ref)
    assert_bitwise_equal(v_out, v_ref)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("jitted", [True, False], ids=["jit", "eager"])
def test_skipped_ids_corrupt_nothing(backend, jitted):
    """Unchecked (traced, or eager with ``validate=False``), 0 and out-of-range ids skip."""
    k_pool, v_pool, k_new, v_new, page_ids = make_case(4, rows=3, tokens_per_frame=24)
    num_pages = pool_geometry(k_pool).num_pages
    skipped = (page_ids.at[0, :].set(0)            # a padding row
               .at[1, 1].set(num_pages)            # just out of range
               .at[1, 2].set(-1)                   # negative
               .at[2, 3].set(10 * num_pages))      # far out of range
    step = functools.partial(write_chunk, tokens_per_frame=24, backend=backend, validate=False)
    k_out, v_out = (jax.jit(step) if jitted else step)(k_pool, v_pool, k_new, v_new, skipped)
    k_ref, v_ref = write_chunk_reference(k_pool, v_pool, k_new, v_new, skipped,
                                         tokens_per_frame=24)
    assert_bitwise_equal(k_out, k_ref)
    assert_bitwise_equal(v_out, v_ref)
    assert_only_named_pages_changed(k_pool, k_out, skipped, num_pages)
    assert_only_named_pages_changed(v_pool, v_out, skipped, num_pages)


def test_all_ids_skipped_is_identity():
    k_pool, v_pool, k_new, v_new, page_ids = make_case(5)
    step = jax.jit(functools.partial(write_chunk, tokens_per_frame=24,
                                     backend="pallas_tpu_simulate"))
    k_out, v_out = step(k_pool, v_pool, k_new, v_new, jnp.zeros_like(page_ids))
    assert_bitwise_equal(k_out, k_pool)
    assert_bitwise_equal(v_out, v_pool)


def test_simulator_reports_no_race():
    """The TPU simulator (``detect_races=True``) finds no race in a valid write. It models one core
    and runs each DMA when it is waited on, so it checks the kernel's semaphore discipline, not
    overlap between the in-flight DMAs themselves."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as mosaic_interpret

    case = make_case(6, layers=1)
    step = jax.jit(functools.partial(write_chunk, tokens_per_frame=24,
                                     backend="pallas_tpu_simulate"))
    jax.block_until_ready(step(*case))
    assert not mosaic_interpret.races.races_found


# ---------------------------------------------------------------------------------------------
# Host-side validation.


def _valid_args(**kwargs):
    return make_case(7, **kwargs)


@pytest.mark.parametrize("bad_id, message", [
    (0, r"page_ids\[1, 2\]=0 is not a writable page id; allowed \[1, 24\)"),
    (24, r"page_ids\[1, 2\]=24 is not a writable page id; allowed \[1, 24\)"),
    (-3, r"page_ids\[1, 2\]=-3 is not a writable page id; allowed \[1, 24\)"),
])
def test_rejects_bad_page_id_values(bad_id, message):
    k_pool, v_pool, k_new, v_new, page_ids = _valid_args()
    bad = page_ids.at[1, 2].set(bad_id)
    with pytest.raises(ValueError, match=message):
        dynamic_validate_inputs(k_pool, v_pool, k_new, v_new, bad, tokens_per_frame=24)
    static_validate_inputs(k_pool, v_pool, k_new, v_new, bad, tokens_per_frame=24)


def test_rejects_duplicate_page_ids():
    k_pool, v_pool, k_new, v_new, page_ids = _valid_args()
    dup = int(page_ids[0, 0])
    with pytest.raises(ValueError, match=rf"page_ids\[1, 3\]={dup} repeats page_ids\[0, 0\]; "):
        dynamic_validate_inputs(k_pool, v_pool, k_new, v_new, page_ids.at[1, 3].set(dup),
                                tokens_per_frame=24)


def test_validation_accepts_numpy_page_ids():
    k_pool, v_pool, k_new, v_new, page_ids = _valid_args()
    assert dynamic_validate_inputs(k_pool, v_pool, k_new, v_new, np.asarray(page_ids),
                                   tokens_per_frame=24) is None
    k_out, _ = write_chunk(k_pool, v_pool, k_new, v_new, np.asarray(page_ids),
                           tokens_per_frame=24)
    k_ref, _ = write_chunk_reference(k_pool, v_pool, k_new, v_new, page_ids, tokens_per_frame=24)
    assert_bitwise_equal(k_out, k_ref)


def test_dynamic_validation_needs_concrete_values():
    k_pool, v_pool, k_new, v_new, page_ids = _valid_args()
    with pytest.raises(jax.errors.TracerArrayConversionError):
        jax.jit(lambda ids: dynamic_validate_inputs(k_pool, v_pool, k_new, v_new, ids,
                                                    tokens_per_frame=24))(page_ids)


def _swap(args, index, value):
    args = list(args)
    args[index] = value
    return args


@pytest.mark.parametrize("mutate, tokens_per_frame, message", [
    (lambda a: _swap(a, 0, a[0][0]), 24, r"k_pool must have rank 5"),
    (lambda a: _swap(a, 1, a[1][:, :-1]), 24, r"k_pool and v_pool must match"),
    (lambda a: _swap(a, 1, a[1].astype(jnp.bfloat16)), 24, r"k_pool and v_pool must match"),
    (lambda a: _swap(_swap(a, 0, a[0].astype(jnp.int32)), 1, a[1].astype(jnp.int32)), 24,
     r"pool dtype must be one of \['float32', 'bfloat16', 'float16'\], got int32"),
    (lambda a: _swap(a, 2, a[2].astype(jnp.bfloat16)), 24,
     r"k_new dtype must be the pool dtype float32 \(cast it first\), got bfloat16"),
    (lambda a: _swap(a, 3, a[3][:, :, :-24]), 24, r"k_new and v_new must have the same shape"),
    (lambda a: _swap(_swap(a, 2, a[2][:1]), 3, a[3][:1]), 24, r"must be \[num_layers=2, rows"),
    (lambda a: _swap(_swap(a, 2, a[2][..., :64]), 3, a[3][..., :64]), 24, r"head_dim=128\]"),
    (lambda a: a, 0, r"tokens_per_frame must be a positive int, got 0"),
    (lambda a: a, 20, r"48 tokens per row must be a positive multiple of tokens_per_frame=20"),
    (lambda a: a, 48, r"page_ids must have shape .* = \[2, 3\] \(tokens_per_frame=48, "
                      r"block_size=16, pages_per_frame=3\), got \[2, 4\]"),
    (lambda a: _swap(a, 4, a[4][:, :-1]), 24, r"page_ids must have shape .* = \[2, 4\]"),
    (lambda a: _swap(a, 4, a[4].astype(jnp.float32)), 24, r"page_ids must be integers"),
])
@pytest.mark.parametrize("validate", [write_chunk, static_validate_inputs,
                                      dynamic_validate_inputs])
def test_rejects_bad_shapes_and_dtypes(mutate, tokens_per_frame, message, validate):
    """Raised by the kernel, by its static validation and by its dynamic validation (which runs
    the static one first)."""
    args = mutate(_valid_args())
    with pytest.raises(ValueError, match=message):
        validate(*args, tokens_per_frame=tokens_per_frame)


@pytest.mark.parametrize("validate", [write_chunk, static_validate_inputs])
def test_rejects_unknown_backend(validate):
    with pytest.raises(ValueError, match="backend must be one of"):
        validate(*_valid_args(), tokens_per_frame=24, backend="cuda")


def test_static_validation_accepts_abstract_inputs():
    args = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in _valid_args()]
    assert static_validate_inputs(*args, tokens_per_frame=24) == 24
    assert static_validate_inputs(*args[:4], jax.ShapeDtypeStruct((2, 3), jnp.int32)) == BLOCK

    def traced(*arrays):
        assert static_validate_inputs(*arrays, tokens_per_frame=24) == 24
        return arrays[0]

    jax.eval_shape(traced, *args)


def test_shape_checks_run_under_jit_value_checks_do_not():
    k_pool, v_pool, k_new, v_new, page_ids = _valid_args()
    step = jax.jit(functools.partial(write_chunk, tokens_per_frame=24))
    with pytest.raises(ValueError, match=r"page_ids must have shape"):
        step(k_pool, v_pool, k_new, v_new, page_ids[:, :-1])
    # The null page and out-of-range ids are skipped, not rejected, under jit.
    step(k_pool, v_pool, k_new, v_new, page_ids.at[0, 0].set(0).at[1, 1].set(99))


# ---------------------------------------------------------------------------------------------
# In place, no retrace.


@pytest.mark.slow
@pytest.mark.parametrize("backend, tokens_per_frame", [
    ("xla", 16), ("xla", 24),
    ("pallas_tpu_interpret", 16),
    ("pallas_tpu_simulate", 16), ("pallas_tpu_simulate", 24),
    compiled("pallas_gpu", 16), compiled("pallas_gpu", 24),
    compiled("pallas_tpu", 16), compiled("pallas_tpu", 24),
    compiled("cudnn_gather", 16), compiled("cudnn_gather", 24),
])
def test_donated_write_is_in_place(backend, tokens_per_frame):
    """Donated: the outputs alias both whole pools and the temp stays under 1 % of the pools
    (it is at most chunk-sized; the chunk is 0.4 % of the pools here). Not donated: nothing is
    aliased. (``pallas_tpu_interpret`` with padded frames is left out: Pallas' generic interpreter
    turns the kernel's branch on the page kind into two pool-writing ``cond`` branches, and XLA
    copies the pools for them; the compiled kernel and the simulator do not. The scatter write is
    checked compiled on GPU only: XLA:CPU upcasts a bf16 scatter to f32 across the whole pool, see
    ``pallas_kernels/paged_write/xla.py``.)"""
    layers, num_pages = 2, 2048
    shape = pool_shape(layers, num_pages, BLOCK, 1, HEAD_DIM)
    k_pool = jnp.zeros(shape, jnp.bfloat16)
    v_pool = jnp.zeros(shape, jnp.bfloat16)
    k_new = jnp.zeros((layers, 2, 2 * tokens_per_frame, 1, HEAD_DIM), jnp.bfloat16)
    ppf = pages_per_frame(tokens_per_frame, BLOCK)
    page_ids = jnp.arange(1, 4 * ppf + 1, dtype=jnp.int32).reshape(2, 2 * ppf)
    args = (k_pool, v_pool, k_new, k_new, page_ids)
    write = functools.partial(write_chunk, tokens_per_frame=tokens_per_frame, backend=backend)
    pool_bytes = 2 * k_pool.nbytes

    donated = jax.jit(write, donate_argnums=(0, 1)).lower(*args).compile().memory_analysis()
    assert donated.alias_size_in_bytes == pool_bytes
    assert donated.temp_size_in_bytes < 0.01 * pool_bytes

    copied = jax.jit(write).lower(*args).compile().memory_analysis()
    assert copied.alias_size_in_bytes == 0


def test_pallas_gpu_interpret_aliases_pools():
    """The GPU kernel's outputs alias the donated pools. (Its temp is not checked: Pallas' generic
    interpreter carries an aliased input and its output side by side through the grid loop, a
    pool-sized copy that the compiled Triton kernel does not make.)"""
    shape = pool_shape(1, 64, BLOCK, 1, HEAD_DIM)
    pool = jnp.zeros(shape, jnp.float32)
    new = jnp.zeros((1, 1, BLOCK, 1, HEAD_DIM), jnp.float32)
    args = (pool, pool, new, new, jnp.ones((1, 1), jnp.int32))
    write = functools.partial(write_chunk, backend="pallas_gpu_interpret")
    analysis = jax.jit(write, donate_argnums=(0, 1)).lower(*args).compile().memory_analysis()
    assert analysis.alias_size_in_bytes == 2 * pool.nbytes


@pytest.mark.parametrize("backend", ["xla", "cudnn_gather_xla", "pallas_tpu_interpret",
                                     *COMPILED_BACKENDS, CUDNN_GATHER])
def test_donated_step_runs_in_place(backend):
    k_pool, v_pool, k_new, v_new, page_ids = make_case(8, tokens_per_frame=24)
    k_ref, v_ref = write_chunk_reference(k_pool, v_pool, k_new, v_new, page_ids,
                                         tokens_per_frame=24)
    step = jax.jit(functools.partial(write_chunk, tokens_per_frame=24, backend=backend),
                   donate_argnums=(0, 1))
    k_out, v_out = step(k_pool, v_pool, k_new, v_new, page_ids)
    assert k_pool.is_deleted() and v_pool.is_deleted()
    assert_bitwise_equal(k_out, k_ref)
    assert_bitwise_equal(v_out, v_ref)


@pytest.mark.parametrize("backend", ["xla", "cudnn_gather_xla", "pallas_tpu_interpret",
                                     "pallas_gpu_interpret", *COMPILED_BACKENDS, CUDNN_GATHER])
def test_new_page_id_values_do_not_retrace(backend, fresh_trace_counter):
    k_pool, v_pool, k_new, v_new, page_ids = make_case(9, tokens_per_frame=24)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(k_pool, v_pool, k_new, v_new, page_ids):
        return write_chunk(k_pool, v_pool, k_new, v_new, page_ids, tokens_per_frame=24,
                           backend=backend)

    for seed in range(3):
        ids = np.random.default_rng(seed).permutation(np.arange(1, pool_geometry(k_pool).num_pages))
        new_ids = jnp.asarray(ids[: page_ids.size].reshape(page_ids.shape), jnp.int32)
        k_pool, v_pool = step(k_pool, v_pool, k_new, v_new, new_ids)
    step(k_pool, v_pool, k_new, v_new, jnp.zeros_like(page_ids))


@pytest.mark.slow
@pytest.mark.parametrize("platform,backend,call", [
    ("tpu", "pallas_tpu", "tpu_custom_call"),
    pytest.param("cuda", "pallas_gpu", "triton", marks=IGNORE_TRITON_DEPRECATION),
    ("cuda", "cudnn_gather", "stablehlo.scatter"),
])
@pytest.mark.parametrize("tokens_per_frame", [16, 24])
@pytest.mark.parametrize("kv_dtype", [None, "float8_e5m2"])
def test_lowers_for_device(platform, backend, call, tokens_per_frame, kv_dtype, lower_for_device):
    """The kernels lower to a Mosaic TPU / Triton custom call (Pallas' own lowering rules), for
    full and padded frames, into bf16 or quantized pools; the device compiler itself is not run
    here."""
    ppf = pages_per_frame(tokens_per_frame, BLOCK)
    shape = pool_shape(2, 64, BLOCK, HEADS, HEAD_DIM)
    pool = (jax.ShapeDtypeStruct(shape, jnp.bfloat16) if kv_dtype is None else
            QuantizedPool(jax.ShapeDtypeStruct(shape, kv_dtype), jax.ShapeDtypeStruct(scale_shape(shape), jnp.float32)))
    new = jax.ShapeDtypeStruct((2, 2, 2 * tokens_per_frame, HEADS, HEAD_DIM), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((2, 2 * ppf), jnp.int32)
    write = functools.partial(write_chunk, tokens_per_frame=tokens_per_frame, backend=backend)
    assert call in lower_for_device(write, (pool, pool, new, new, ids), platform)
