"""AOT compiles of the TPU kernels for v5e and v6e with libtpu's compile-only devices (no TPU).

Each case compiles (Mosaic + XLA:TPU, VMEM against the kernel's limit), no pool appears in a
``copy``/``copy-start`` of the optimized HLO, the donated write aliases both pools with temporaries
under 1 % of them, and attention's temporaries stay within ``temp_bound_bytes``. Pools use few
layers: the properties do not depend on the layer count. Skipped without libtpu.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from pallas_kernels import tpu_aot
from pallas_kernels.layout import PAGE_AXIS, pool_shape, tpu_block_size
from pallas_kernels.paged_write import write_chunk
from pallas_kernels.window_attention import tpu as twa

pytestmark = pytest.mark.skipif(not tpu_aot.libtpu_available(),
                                reason="libtpu is not installed (pip install -e '.[tpu]')")

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
    pools = 2 * 2 * tpu_aot._prod(shape)
    assert rep.pool_copies == 0
    assert rep.alias_bytes >= pools
    assert rep.temp_bytes < 0.01 * pools


ATTENTION_CASES = [(p, 1) for p in PRESETS] + [("wan-1.3b", 4)]


@pytest.mark.parametrize("gen", GENERATIONS)
@pytest.mark.parametrize("preset,rows", ATTENTION_CASES)
def test_attention_compiles_without_pool_copies(gen, preset, rows):
    heads, tpf, block, frames, visible, extra = PRESETS[preset]
    ppf = -(-tpf // block)
    max_pages = visible * ppf
    shape = pool_shape(2, rows * max_pages + 1, block, heads, 128)
    cur, q_len = frames * tpf, frames * tpf + extra
    kv = (rows, cur, heads, 128)
    specs = [((rows, q_len, heads, 128), BF16), (kv, BF16), (kv, BF16), (shape, BF16),
             (shape, BF16), ((rows, max_pages), jnp.int32), ((rows,), jnp.int32),
             ((), jnp.int32)]
    if extra:
        specs += [((rows, extra, heads, 128), BF16)] * 2

    def fn(q, kc, vc, kp, vp, pages, lengths, layer, ek=None, ev=None):
        return twa.window_attention(q, kc, vc, kp, vp, pages, lengths, layer=layer, extra_k=ek,
                                    extra_v=ev, tokens_per_frame=tpf, generation=gen)

    rep = tpu_aot.report(tpu_aot.compile_for_tpu(fn, specs, gen), [shape])
    geom = twa.Geometry(rows, q_len, heads, heads, 128, cur, extra, 2, shape[PAGE_AXIS], block,
                        max_pages, tpf, "bfloat16")
    assert rep.pool_copies == 0
    assert rep.temp_bytes <= twa.temp_bound_bytes(geom, twa.make_plan(geom, twa.TUNED_BLOCKS[gen]))
