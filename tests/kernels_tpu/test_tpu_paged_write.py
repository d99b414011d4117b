"""The head-major in-place paged write against its reference, in interpret mode and the simulator."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.backend import tpu_simulator_params
from pallas_kernels.tpu_layout import pool_shape
from pallas_kernels.tpu_paged_write import write_chunk, write_chunk_reference

LAYERS, PAGES, HEADS, DIM = 2, 24, 3, 128


def case(block_size, tokens_per_frame, rows=2, frames=2, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    shape = pool_shape(LAYERS, PAGES, block_size, HEADS, DIM)
    ppf = -(-tokens_per_frame // block_size)
    ids = rng.permutation(np.arange(1, PAGES))[: rows * frames * ppf].reshape(rows, -1)
    new = (LAYERS, rows, frames * tokens_per_frame, HEADS, DIM)
    return (jnp.asarray(rng.normal(size=shape), dtype), jnp.asarray(rng.normal(size=shape), dtype),
            jnp.asarray(rng.normal(size=new), dtype), jnp.asarray(rng.normal(size=new), dtype),
            jnp.asarray(ids, jnp.int32))


@pytest.mark.parametrize("interpret", [True, tpu_simulator_params()], ids=["interpret", "simulate"])
@pytest.mark.parametrize("block_size,tpf", [(16, 16), (16, 24), (8, 24)])
def test_matches_reference(interpret, block_size, tpf):
    """Full pages, a padded last page per frame, several pages per frame; skipped ids under jit."""
    k_pool, v_pool, k_new, v_new, ids = case(block_size, tpf)
    ids = ids.at[1, 0].set(0).at[0, -1].set(PAGES + 3)  # Skipped: the null page, out of range.
    got = jax.jit(lambda *a: write_chunk(*a, tokens_per_frame=tpf, interpret=interpret))(
        k_pool, v_pool, k_new, v_new, ids)
    want = write_chunk_reference(k_pool, v_pool, k_new, v_new, ids, tokens_per_frame=tpf)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_bf16_and_nan_pages_untouched():
    """NaN in pages nobody writes stays there, bit for bit; written pages lose their NaN."""
    k_pool, v_pool, k_new, v_new, ids = case(16, 16, dtype=jnp.bfloat16)
    k_pool, v_pool = k_pool.at[:, :, 1:].set(jnp.nan), v_pool.at[:, :, 1:].set(jnp.nan)
    got = write_chunk(k_pool, v_pool, k_new, v_new, ids, interpret=True)
    want = write_chunk_reference(k_pool, v_pool, k_new, v_new, ids)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    written = np.asarray(ids).reshape(-1)
    assert np.isfinite(np.asarray(got[0][:, :, written], np.float32)).all()


@pytest.mark.parametrize("change,message", [
    (lambda a: dict(ids=a["ids"].at[0, 0].set(0)), r"page_ids contains 0; allowed page ids are \[1, 24\)"),
    (lambda a: dict(ids=a["ids"].at[0, 1].set(a["ids"][0, 0])), r"page_ids repeats page"),
    (lambda a: dict(ids=a["ids"][:, :1]), r"page_ids must have shape \[rows, frames \* pages_per_frame\]"),
    (lambda a: dict(k_new=a["k_new"].astype(jnp.bfloat16)), r"the pool dtype float32"),
    (lambda a: dict(k_new=a["k_new"][..., :64], v_new=a["v_new"][..., :64]), r"k_new must be \[num_layers=2"),
    (lambda a: dict(k_pool=a["k_pool"][:, :, :, :12], v_pool=a["v_pool"][:, :, :, :12],
                    k_new=a["k_new"][:, :, :24], v_new=a["v_new"][:, :, :24], tpf=12),
     r"block_size=12 \(pool.shape\[3\]\) must be a multiple of 8"),
    (lambda a: dict(tpf=0), r"tokens_per_frame must be an int >= 1"),
])
def test_validation(change, message):
    k_pool, v_pool, k_new, v_new, ids = case(16, 16)
    args = dict(k_pool=k_pool, v_pool=v_pool, k_new=k_new, v_new=v_new, ids=ids, tpf=16)
    args.update(change(args))
    with pytest.raises(ValueError, match=message):
        write_chunk(args["k_pool"], args["v_pool"], args["k_new"], args["v_new"], args["ids"],
                    tokens_per_frame=args["tpf"], interpret=True)
