"""Quantized K/V pages (``CacheGeometry.kv_dtype``) in the cache and the rollout: the geometry's
rule, the pools the cache builds, a sharded cache's isolation of pages it does not read, the
refusal of backends that cannot read them, and a ``tiny`` rollout with int8 pages against float32."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arkv_jax import sharding as sh
from arkv_jax.cache import PagedKVCache
from arkv_jax.config import KV_DTYPES
from arkv_jax.models import MODEL_CONFIGS, init_random
from arkv_jax.planner import rollout_plan
from arkv_jax.presets import get_preset
from benchmarks.kv_quantization import TINY_SETUP, paged_rollout
from pallas_kernels.layout import QuantizedPool, page_mask, pool_geometry
from tests.test_sharded_cache import CFG, GEOMETRY, TEXT, WINDOW, attention, batch_kv, mesh_of

PRESET = get_preset("tiny")


def test_kv_dtype_defaults_to_the_compute_dtype_and_is_checked():
    g = PRESET.geometry
    assert g.kv_dtype is None and g.page_dtype == "float32" and g.write_dtype == "float32"
    q = dataclasses.replace(g, kv_dtype=jnp.int8)
    assert (q.kv_dtype, q.page_dtype, q.write_dtype, q.quantized, q.kv_itemsize) == ("int8", "int8", "float32",
                                                                                     True, 1)
    wide = dataclasses.replace(g, dtype="bfloat16", kv_dtype="float32")  # stored wider than computed
    assert (wide.page_dtype, wide.write_dtype, wide.quantized) == ("float32", "float32", False)
    # A changed compute dtype carries the pages along unless another dtype was chosen for them.
    assert dataclasses.replace(g, dtype="bfloat16").page_dtype == "bfloat16"
    for bad in ("int4", "float64", 3, True):
        with pytest.raises(ValueError, match=r"kv_dtype must be one of \('float32', 'bfloat16', 'float16', 'int8', "
                                             r"'float8_e4m3fn', 'float8_e5m2'\), got"):
            dataclasses.replace(g, kv_dtype=bad)
    assert KV_DTYPES[-3:] == ("int8", "float8_e4m3fn", "float8_e5m2")


@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn"])
def test_the_cache_builds_zero_quantized_pools(kv_dtype):
    g = dataclasses.replace(PRESET.geometry, kv_dtype=kv_dtype)
    plan = rollout_plan(g, PRESET.window, PRESET.kv_branches, PRESET.cross_attention, 2)
    cache = PagedKVCache(g, PRESET.window, PRESET.kv_branches, PRESET.cross_attention, plan=plan, backend="auto")
    for pool in cache.pools:
        assert isinstance(pool, QuantizedPool) and pool.dtype == jnp.dtype(kv_dtype)
        geom = pool_geometry(pool)
        assert geom.num_pages == plan.managed_num_blocks and pool.scales.shape == (g.num_layers, g.num_kv_heads,
                                                                                    geom.num_pages)
        assert pool.scales.dtype == jnp.float32
        assert not np.any(np.asarray(pool.values, np.float32)) and not np.any(np.asarray(pool.scales))
    # The two pools are distinct buffers (each donated on its own).
    k, v = cache.pools
    assert k.values.unsafe_buffer_pointer() != v.values.unsafe_buffer_pointer()


def run_poisoned(mesh, kv_dtype="int8"):
    """Four sessions commit four chunks; one leaves; then attention of two of them, clean and with the
    scale of every page no row holds set to NaN. Returns ``{session: clean output rows}``."""
    geometry = dataclasses.replace(GEOMETRY, kv_dtype=kv_dtype)
    model = 1 if mesh is None else mesh.shape["model"]
    plan = rollout_plan(geometry, WINDOW, CFG, TEXT, 2 if mesh is not None else 8, model=model)
    cache = PagedKVCache(geometry, WINDOW, CFG, TEXT, plan=plan, mesh=mesh, backend="xla")
    chunks = {}
    for sid in "abcd":
        cache.open(sid)
        chunks[sid] = 0
    for _ in range(4):
        with cache.chunk(list("abcd"), 2, full_batch=True) as step:
            step.commit(*batch_kv(step, chunks))
        chunks = {s: c + 1 for s, c in chunks.items()}
    cache.close("b")
    with cache.chunk(["a", "c"], 2, full_batch=True) as step:
        clean = attention(cache, step, chunks)
        held = np.concatenate(list(cache.pages_held(["a", "c"]).values()))
        poison = ~np.isin(np.arange(pool_geometry(cache.pools[0]).num_pages), held)
        bad = tuple(QuantizedPool(p.values, jnp.where(page_mask(poison, 3), jnp.nan, p.scales)) for p in cache.pools)
        assert np.isnan(np.asarray(bad[0].scales)).any()
        spec = sh.pool_spec(True)
        cache._core.k_pool, cache._core.v_pool = (bad if mesh is None else sh.place(mesh, bad, (spec, spec)))
        poisoned = attention(cache, step, chunks)
        rows = {sid: [i for i, s in enumerate(step.session_ids) if s == sid] for sid in ("a", "c")}
        assert np.all(np.isfinite(poisoned))
        for r in rows.values():
            np.testing.assert_array_equal(poisoned[r], clean[r])
        step.commit(*batch_kv(step, chunks))
    return {sid: clean[r] for sid, r in rows.items()}


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (tests/conftest.py sets jax_num_cpu_devices)")
def test_free_and_foreign_pages_never_reach_the_output_sharded_or_not():
    """A NaN scale poisons a whole page of a quantized pool: none reaches an output, on one device or
    on a 4 x 2 mesh (scales sharded with their pages), and both give the same attention."""
    one = run_poisoned(None)
    sharded = run_poisoned(mesh_of(4, 2))
    for sid in one:
        np.testing.assert_allclose(sharded[sid], one[sid], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# The rollout


@pytest.mark.slow
def test_an_int8_rollout_stays_close_to_the_float32_one():
    """8 chunks (the window of 2 sink + 6 frames fills and slides), both sessions: measured max abs
    difference 2.9e-3 (mean 3.7e-4) against the float32 pool's latents (mean |latent| 1.6), below the
    bf16 pool's own 4.3e-3 on the same run; fp8 e4m3fn 1.5e-2, e5m2 2.6e-2."""
    model = init_random(MODEL_CONFIGS["tiny"], seed=0)
    exact, int8 = (paged_rollout(model, TINY_SETUP, dtype, 8) for dtype in (None, "int8"))
    diff = np.abs(int8.astype(np.float64) - exact)
    assert np.all(np.isfinite(int8)) and int8.shape == exact.shape
    assert 0 < diff.max() < 1e-2 and diff.mean() < 1e-3  # quantized (not equal), and close


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn"])
def test_a_quantized_rollout_on_the_tpu_kernels_matches_the_xla_path(kv_dtype):
    """The whole cache on the TPU kernels (interpreted: the write quantizing in VMEM, attention
    dequantizing per compute chunk) gives the XLA path's latents up to float rounding, which a
    stored value rounded to the neighbouring level amplifies in later chunks. Measured max abs
    difference: 3e-6 under jax 0.12; under jax 0.10.2 on an AMD EPYC 1.1e-4 for int8 (3 % of the
    int8 pages' own error against float32 pages, 3.2e-3), 3.7e-5 for e4m3fn."""
    model = init_random(MODEL_CONFIGS["tiny"], seed=0)
    xla, tpu = (paged_rollout(model, TINY_SETUP, kv_dtype, 3, backend=b) for b in ("xla", "pallas_tpu_interpret"))
    assert np.all(np.isfinite(tpu))
    np.testing.assert_allclose(tpu, xla, atol=3e-4, rtol=1e-4)

