"""AOT compiles of the TPU kernels for v5e and v6e with libtpu's compile-only devices (no TPU).

Each case compiles (Mosaic + XLA:TPU, VMEM against the kernel's limit), no pool appears in a
``copy``/``copy-start`` of the optimized HLO, the donated write aliases both pools with temporaries
under 1 % of them, and attention's temporaries stay within ``temp_bound_bytes``. The ``xla``
backend (the fallback) is compiled too, at wan-1.3b: its temporaries stay within a small multiple of
one layer's K/V. Pools use few layers: the properties do not depend on the layer count. Skipped
without libtpu.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import tpu_aot
from pallas_kernels.layout import PAGE_AXIS, pool_shape, tpu_block_size
from pallas_kernels.paged_write import write_chunk
from pallas_kernels.window_attention import WindowGeometry, tpu_gather, window_attention
from pallas_kernels.window_attention import tpu as twa
from pallas_kernels.window_attention import xla as xla_backend

# Each case compiles a kernel with the real TPU compiler (seconds to minutes): the whole suite only.
pytestmark = [pytest.mark.skipif(not tpu_aot.libtpu_available(),
                                 reason="libtpu is not installed (pip install -e '.[tpu]')"),
              pytest.mark.slow]

BF16 = jnp.bfloat16
# name: (kv_heads, tokens_per_frame, block_size, chunk frames, visible frames, extra tokens)
PRESETS = {
    "wan-1.3b": (12, 1560, 1560, 3, 12, 0),
    "lingbot-v2": (40, 1560, 1560, 3, 18, 0),
    "dreamzero-14b": (40, 220, tpu_block_size(220), 2, 36, 33),
    "wan-128-token-pages": (12, 1560, 128, 3, 12, 0),
    "wan-16-token-pages": (12, 1560, 16, 3, 12, 0),
}
GENERATIONS = ("v5e", "v6e")


@pytest.mark.parametrize("gen", GENERATIONS)
@pytest.mark.parametrize("preset", list(PRESETS))
def test_write_compiles_in_place(gen, preset):
    heads, tpf, block, frames, _, _ = PRESETS[preset]
    ppf = -(-tpf // block)
    layers, pages = 1, 101 * frames * ppf  # The chunk is under 1 % of the pool (fits v5e HBM).
    shape = pool_shape(layers, pages, block, heads, 128)
    new = (layers, 1, frames * tpf, heads, 128)
    compiled = tpu_aot.compile_for_tpu(
        lambda kp, vp, kn, vn, ids: write_chunk(kp, vp, kn, vn, ids, tokens_per_frame=tpf,
                                                backend="pallas_tpu"),
        [(shape, BF16)] * 2 + [(new, BF16)] * 2 + [((1, frames * ppf), jnp.int32)], gen,
        donate_argnums=(0, 1))
    rep = tpu_aot.report(compiled, [shape])
    pools = 2 * 2 * math.prod(shape)
    assert rep.pool_copies == 0
    assert rep.alias_bytes >= pools
    assert rep.temp_bytes < 0.01 * pools


ATTENTION_CASES = [(p, 1) for p in PRESETS] + [("wan-1.3b", 4)]


def attention_call(preset: str, rows: int):
    """One layer's attention call at ``preset`` for ``rows`` rows (bf16, head_dim 128, 2 pool
    layers): its :class:`WindowGeometry`, pool shape and ``(shape, dtype)`` specs of ``q, k_cur,
    v_cur, k_pool, v_pool, pages, lengths, layer`` (then ``extra_k, extra_v`` if the preset has
    extras)."""
    return attention_call_at(*PRESETS[preset], rows)


def attention_call_at(heads: int, tpf: int, block: int, frames: int, visible: int, extra: int, rows: int):
    """:func:`attention_call` at an explicit shape (a ``PRESETS`` entry's fields)."""
    max_pages = visible * -(-tpf // block)
    shape = pool_shape(2, rows * max_pages + 1, block, heads, 128)
    cur, q_len = frames * tpf, frames * tpf + extra
    kv = (rows, cur, heads, 128)
    specs = [((rows, q_len, heads, 128), BF16), (kv, BF16), (kv, BF16), (shape, BF16),
             (shape, BF16), ((rows, max_pages), jnp.int32), ((rows,), jnp.int32),
             ((), jnp.int32)]
    if extra:
        specs += [((rows, extra, heads, 128), BF16)] * 2
    geom = WindowGeometry(rows, q_len, heads, heads, 128, cur, extra, 2, shape[PAGE_AXIS], block,
                          max_pages, tpf)
    return geom, shape, specs


def attention_fn(attend, geom: WindowGeometry, **kwargs):
    """``fn(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, layer[, extra_k, extra_v])`` calling
    ``attend`` (the facade's or the TPU module's ``window_attention``) with ``geom``'s frame size
    and ``kwargs``."""
    def fn(q, kc, vc, kp, vp, pages, lengths, layer, ek=None, ev=None):
        return attend(q, kc, vc, kp, vp, pages, lengths, layer=layer, extra_k=ek, extra_v=ev,
                      tokens_per_frame=geom.tokens_per_frame, **kwargs)

    return fn


@pytest.mark.parametrize("gen", GENERATIONS)
@pytest.mark.parametrize("preset,rows", ATTENTION_CASES)
def test_attention_compiles_without_pool_copies(gen, preset, rows):
    geom, shape, specs = attention_call(preset, rows)
    fn = attention_fn(twa.window_attention, geom, generation=gen)
    rep = tpu_aot.report(tpu_aot.compile_for_tpu(fn, specs, gen), [shape])
    tpu_geom = twa.Geometry.of(geom, BF16)
    assert rep.pool_copies == 0
    assert rep.temp_bytes <= twa.temp_bound_bytes(tpu_geom,
                                                  twa.make_plan(tpu_geom, twa.TUNED_BLOCKS[gen]))


@pytest.mark.parametrize("gen", GENERATIONS)
def test_gather_baseline_compiles_with_tuned_blocks(gen):
    """The gather + splash baseline at wan-1.3b with its generation's tuned splash tiles: compiles
    (splash's tiles within the default scoped VMEM) and copies no pool. At default matmul precision
    (tests/conftest.py asks for "highest", which Mosaic refuses on bf16 splash matmuls)."""
    geom, shape, specs = attention_call("wan-1.3b", 1)
    fn = attention_fn(tpu_gather.gather_window_attention, geom, generation=gen)
    with jax.default_matmul_precision("default"):
        rep = tpu_aot.report(tpu_aot.compile_for_tpu(fn, specs, gen), [shape])
    assert rep.pool_copies == 0


XLA_TEMP_KV_MULTIPLE = 4
"""The ``xla`` backend's temporaries stay within this many times one layer's attended K/V."""


def test_xla_attention_temporaries_are_bounded():
    """The ``xla`` fallback at wan-1.3b, one row, compiled for v5e: the online softmax over key
    blocks keeps temporaries within ``XLA_TEMP_KV_MULTIPLE`` x one layer's attended K/V
    (:func:`~pallas_kernels.window_attention.xla.kv_bytes`: 144 MB) and far below the float32
    ``[heads, q_len, keys]`` logits (5.3 GB; the untiled path needed 5.3 GB of temporaries)."""
    geom, shape, specs = attention_call("wan-1.3b", 1)
    fn = attention_fn(window_attention, geom, backend="xla")
    rep = tpu_aot.report(tpu_aot.compile_for_tpu(fn, specs, "v5e"), [shape])
    full_logits = geom.num_q_heads * geom.q_len * (geom.tail_len + geom.capacity) * 4
    assert rep.pool_copies == 0
    assert rep.temp_bytes <= XLA_TEMP_KV_MULTIPLE * xla_backend.kv_bytes(geom, BF16)
    assert rep.temp_bytes < full_logits / 10


def test_a_program_compiled_for_a_chip_takes_that_chips_tiles():
    """On this host the first device is the CPU; a kernel call traced for a compile-only v6e (JAX's
    default device, as ``compile_for_tpu`` sets it) plans with v6e's tiles and VMEM budget, not the
    host's fallback (v5e's)."""
    geom = twa.Geometry.of(attention_call("wan-1.3b", 1)[0], BF16)
    plans = {gen: twa.plan_call(geom, gen) for gen in GENERATIONS}
    assert plans["v5e"] != plans["v6e"]  # the generations do tile this call differently
    assert twa.default_generation() == "v5e"
    for gen in GENERATIONS:
        with jax.default_device(tpu_aot.compile_only_device(gen)):
            assert twa.default_generation() == gen
            assert twa.plan_call(geom, None) == plans[gen]


MODEL_PRESETS = ("wan-1.3b", "lingbot-v2", "dreamzero-14b")


@pytest.mark.parametrize("gen", GENERATIONS)
@pytest.mark.parametrize("preset", MODEL_PRESETS)
def test_the_public_entry_compiles_at_the_history_each_preset_attends(gen, preset):
    """``window_attention(backend="pallas_tpu")``, the call the cache makes (no tiles or generation
    given), compiled for ``gen`` at the history the model preset's ``WindowPolicy`` lets a chunk see
    (wan-1.3b 9 frames, lingbot-v2 15, dreamzero-14b 34): it compiles, copies no pool, and ``gen``'s
    tiling (which the call now takes: the test above) fits ``gen``'s VMEM budget and bounds the
    temporaries."""
    from arkv_jax.presets import get_preset

    model = get_preset(preset)
    heads, tpf, block, frames, _, extra = PRESETS[preset]
    assert (heads, tpf, frames) == (model.geometry.num_kv_heads, model.geometry.tokens_per_frame,
                                    model.geometry.frames_per_forward)
    geom, shape, specs = attention_call_at(heads, tpf, block, frames, model.window.max_history(frames), extra, 1)
    rep = tpu_aot.report(tpu_aot.compile_for_tpu(attention_fn(window_attention, geom, backend="pallas_tpu"),
                                                 specs, gen), [shape])
    tpu_geom = twa.Geometry.of(geom, BF16)
    plan = twa.make_plan(tpu_geom, twa.TUNED_BLOCKS[gen])
    assert twa.vmem_estimate_bytes(tpu_geom, plan) <= twa.VMEM_BUDGET[gen]
    assert rep.pool_copies == 0
    assert rep.temp_bytes <= twa.temp_bound_bytes(tpu_geom, plan)
