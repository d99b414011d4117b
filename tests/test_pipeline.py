"""The whole-chip plan (:mod:`arkv_jax.pipeline`): its byte counts against real arrays, its bucket
logic, and (with libtpu) its plan against the compiled programs at the planned pool size."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from arkv_jax import pipeline as pl
from arkv_jax.models import dit, vae
from arkv_jax.models.umt5 import UMT5_CONFIGS
from arkv_jax.planner import plan_memory
from arkv_jax.presets import get_preset
from arkv_jax.rollout import Rollout
from pallas_kernels import tpu_aot
from pallas_kernels.causal_conv import row_major_tpu_bytes

TINY = pl.PIPELINES["tiny"]


def _nbytes(tree) -> int:
    return sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(tree))


def test_weight_bytes_are_the_models_arrays():
    real_dit = nnx.split(dit.init_random(TINY.dit, seed=0))[1]
    real_vae = nnx.split(vae.init_random(TINY.vae, seed=0))[1]
    assert pl.weight_bytes(TINY) == {"dit": _nbytes(real_dit), "vae": _nbytes(real_vae)}
    on_device = pl.weight_bytes(TINY.with_(text_on_device=True))
    assert on_device["text_encoder"] > 0 and on_device["dit"] == _nbytes(real_dit)


def test_session_state_is_what_a_rollout_and_a_decoder_keep():
    """The VAE stream cache is a real decoder's cache as a TPU's HBM holds it (row-major, padded to
    the lanes); the latent ring is what a rollout's session holds once its ring is full (after
    enough chunks that old ones are dropped)."""
    state = pl.session_state_bytes(TINY)
    decoder = vae.init_random(TINY.vae, seed=0)
    _, h, w, _ = TINY.latent_shape
    frames = vae.decoder_init_cache(decoder, h, w).frames
    assert state["vae_stream_cache"] == sum(row_major_tpu_bytes(f.shape, f.dtype) for f in frames) > _nbytes(frames)
    from arkv_jax.cache import PagedKVCache
    from arkv_jax.planner import rollout_plan

    p = TINY.preset
    plan = rollout_plan(p.geometry, p.window, TINY.kv_branches, p.cross_attention, 1)
    cache = PagedKVCache(p.geometry, p.window, TINY.kv_branches, p.cross_attention, plan=plan, backend="xla")
    rollout = Rollout(dit.init_random(TINY.dit, seed=0), cache, TINY.sampler)
    rollout.join("a", "a fox")
    for _ in range(8):
        rollout.step()
    ring = rollout._session("a").ring
    assert state["latent_ring"] == sum(x.nbytes for x in ring.values())


def test_a_pipeline_refuses_parts_that_do_not_fit_together():
    with pytest.raises(ValueError, match="16-channel latents; the DiT makes 4"):
        TINY.with_(vae=vae.VAE_CONFIGS["tiny"])
    with pytest.raises(ValueError, match="text encoder"):
        TINY.with_(text_encoder=UMT5_CONFIGS["umt5-xxl"])
    with pytest.raises(ValueError, match="num_layers"):
        TINY.with_(preset=get_preset("wan-1.3b"))
    with pytest.raises(TypeError, match="text_on_device"):
        TINY.with_(text_on_device=1)
    with pytest.raises(TypeError, match="rows_in_turn"):
        TINY.with_(rows_in_turn=1)


def test_quantized_pages_reach_the_chunk_program_and_its_bytes():
    """With int8 pages the chunk program takes the cache's own quantized pools (values and scales,
    the shapes a real cache allocates) and reads them, giving the commit's K/V in the compute dtype;
    the commit moves the chunk's compute width in and the stored width out."""
    from arkv_jax.cache import PagedKVCache
    from arkv_jax.planner import rollout_plan
    from pallas_kernels.layout import QuantizedPool

    quantized = TINY.with_kv_dtype("int8")
    p = quantized.preset
    assert p.geometry.quantized and TINY.preset.geometry.page_dtype == TINY.dit.dtype
    plan = rollout_plan(p.geometry, p.window, quantized.kv_branches, p.cross_attention, 1)
    cache = PagedKVCache(p.geometry, p.window, quantized.kv_branches, p.cross_attention, plan=plan, backend="xla")
    fn, args = pl.chunk_program(quantized, 1, plan.managed_num_blocks)
    real = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), cache.pools[0])
    assert isinstance(args[1][0], QuantizedPool) and args[1][0] == real
    out = jax.eval_shape(fn, *args)
    assert out[1].dtype == out[2].dtype == np.dtype(TINY.dit.dtype)
    wide, narrow = (pl.commit_seconds(x, 1, "v5e") for x in (TINY.with_kv_dtype("float32"), quantized))
    assert narrow / wide == pytest.approx((4 + 1) / (4 + 4))
    assert quantized.with_kv_dtype(None) == TINY


def _figures(transient: int) -> pl.ProgramFigures:
    return pl.ProgramFigures(argument_bytes=0, output_bytes=transient, temp_bytes=0, alias_bytes=0,
                             xla_seconds=0.1, kernel_calls={})


def test_streams_per_chip_and_the_best_bucket():
    p = TINY.preset
    plan = plan_memory(p.geometry, p.window, TINY.kv_branches, available_bytes=1 << 30, memory_fraction=1.0,
                       session_capacity=2, cross_attention=p.cross_attention)
    buckets = (pl.BucketPlan(1, _figures(1), _figures(1), 1, plan, 1.0),
               pl.BucketPlan(2, _figures(2), _figures(2), 2, plan, 1.5),
               pl.BucketPlan(4, _figures(4), _figures(4), 4, None, 1.8))
    chip = pl.ChipPlan(TINY, "v5e", 1 << 30, 1 << 30, {"dit": 1}, {"vae_stream_cache": 1}, buckets)
    assert chip.streams_per_chip == 2
    assert chip.best_bucket().batch == 2  # 2 sessions in 1.5 s beat 1 in 1 s; batch 4 does not fit
    assert chip.frames_per_chunk == TINY.vae.num_pixel_frames(TINY.latent_shape[0], first_chunk=False)
    text = chip.summary()
    assert "batch 4" in text and "does not fit" in text and "streams per chip: 2" in text


def test_the_pricer_knows_the_chunk_programs_kernels():
    """The chunk program's Mosaic calls: window attention at the steady-state window, the text
    cross-attention at the chunk's tokens over the prompt's; anything else is refused."""
    from pallas_kernels.context_attention import ContextGeometry

    wan = pl.PIPELINES["self-forcing"]
    assert pl.context_geometry(wan, 2) == ContextGeometry(2, 3 * 1560, 12, 12, 128, 512)
    assert pl.attention_geometry(wan, 2).max_pages == 9 * wan.preset.geometry.pages_per_frame
    with pytest.raises(ValueError, match="no estimate for the Mosaic kernel 'splash'"):
        pl.attention_pricer(wan, "v5e")("splash", 1)


def test_the_pricer_prices_each_convolution_at_its_own_shape(monkeypatch):
    """A causal- or upsampling-convolution kernel is priced at the geometry its name spells, in the
    VAE's dtype, and the DiT block's kernels (q/k/v projection, cross query, adaLN MLP) at their
    own in the DiT's; a program's time is XLA's estimate plus its kernel calls, each priced once
    per shape."""
    from pallas_kernels import adaln_mlp, causal_conv, cross_query, qkv_projection, upsample_conv

    asked = []
    monkeypatch.setattr(pl, "_kernel_seconds", lambda geom, dtype, gen: asked.append((geom, dtype, gen)) or 1e-3)
    wan = pl.PIPELINES["self-forcing"]
    price = pl.attention_pricer(wan, "v6e")
    small = causal_conv.ConvGeometry(1, 60, 104, 384, 384)
    large = causal_conv.ConvGeometry(2, 120, 208, 384, 384, input_norm=True)
    up = upsample_conv.UpsampleGeometry(4, 240, 416, 192, 96)
    decode = dataclasses.replace(_figures(0), kernel_calls={
        (causal_conv.kernel_name(small), 2): 30, (causal_conv.kernel_name(large), 2): 15,
        (upsample_conv.kernel_name(up), 4): 3})
    assert pl.program_seconds(decode, price) == pytest.approx(0.1 + 48e-3)
    assert asked == [(small, "bfloat16", "v6e"), (large, "bfloat16", "v6e"), (up, "bfloat16", "v6e")]
    block = [qkv_projection.ProjectionGeometry(4680, 1536, 1536), cross_query.QueryGeometry(4680, 1536, 1560),
             adaln_mlp.MLPGeometry(4680, 1536, 8960, 1560)]
    names = [module.kernel_name(geom) for module, geom in zip((qkv_projection, cross_query, adaln_mlp), block)]
    chunk = dataclasses.replace(_figures(0), kernel_calls={(name, 4680): 150 for name in names})
    assert pl.program_seconds(chunk, price) == pytest.approx(0.1 + 450e-3)
    assert asked[3:] == [(geom, "bfloat16", "v6e") for geom in block]


def test_the_pricer_prices_attention_over_the_pages_stored_dtype(monkeypatch):
    """Window attention is priced over the pages' storage dtype (int8 pages here), with the rotary
    tables the DiT hands it (its q and k come normalized from the q/k/v projection); the text
    cross-attention in the compute dtype."""
    asked = []
    monkeypatch.setattr(pl, "_kernel_seconds", lambda geom, dtype, gen, kv_dtype=None, **prologue:
                        asked.append((type(geom).__name__, dtype, kv_dtype, prologue)) or 1e-3)
    price = pl.attention_pricer(pl.PIPELINES["self-forcing"].with_kv_dtype("int8"), "v5e")
    price("window_attention_tpu", 1)
    price("context_attention_tpu", 1)
    assert asked == [("WindowGeometry", "bfloat16", "int8", dict(rope=True)),
                     ("ContextGeometry", "bfloat16", None, {})]


def test_the_flop_count_scales_with_rows_and_steps():
    one = pl.dit_flops(TINY, 1)
    assert pl.dit_flops(TINY, 3) == 3 * one
    fewer = TINY.with_(sampler=dataclasses.replace(TINY.sampler, num_steps=1))
    per_forward = (one - pl.dit_flops(fewer, 1)) // (TINY.sampler.num_steps - 1)
    # The commit forward's last layer is only its k and v projections.
    cfg, g = TINY.dit, TINY.preset.geometry
    last_layer = per_forward // cfg.num_layers
    kv_only = 4 * cfg.dim ** 2 * g.frames_per_forward * g.tokens_per_frame * TINY.sampler.num_branches
    assert one == per_forward * (TINY.sampler.num_steps + 1) - last_layer + kv_only


# ------------------------------------------------------------------------------------------------
# Against the TPU compiler (libtpu's compile-only v5e)
# ------------------------------------------------------------------------------------------------

needs_libtpu = pytest.mark.skipif(not tpu_aot.libtpu_available(),
                                  reason="libtpu is not installed (pip install -e '.[tpu]')")


def small_wan() -> pl.Pipeline:
    """Wan-1.3B's frames, heads and window (the real attention kernel and chunk shapes) with two
    layers and a two-level VAE, so a bucket compiles in about a minute."""
    wan = pl.PIPELINES["self-forcing"]
    preset = dataclasses.replace(wan.preset, geometry=dataclasses.replace(wan.preset.geometry, num_layers=2))
    return wan.with_(preset=preset, dit=dataclasses.replace(wan.dit, num_layers=2),
                     vae=vae.WanVAEConfig(base_dim=8, dim_mult=(1, 2), temporal_upsample=(True,), dtype="bfloat16"))


@pytest.mark.slow
@needs_libtpu
@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_the_plan_matches_the_compiled_programs(kv_dtype):
    """``plan_chip`` on a chip sized so that one bucket fits and the next does not; at the fitting
    bucket the planner's bytes are within 5 % of the compiled programs' (pools of the planned size,
    in bf16 or int8 pages: the TPU kernels read and write them in place), and the compiled total
    stays within the chip."""
    pipeline = small_wan().with_kv_dtype(kv_dtype)
    first = pl.plan_bucket(pipeline, 1, "v5e", budget=1 << 40)
    in_flight = first.plan.page_size_bytes * pipeline.preset.geometry.frames_per_forward
    per_session = first.plan.bytes_per_session + in_flight
    memory = sum(pl.weight_bytes(pipeline).values()) + first.transient_bytes + 3 * per_session // 2 + (64 << 20)
    chip = pl.plan_chip(pipeline, "v5e", memory_bytes=memory, buckets=(1, 2))
    assert [b.fits for b in chip.buckets] == [True, False]
    assert chip.streams_per_chip == 1
    fit = chip.buckets[0]
    compiled = pl.compiled_total(pipeline, fit, "v5e")
    assert pl.predicted_total(pipeline, fit) / compiled == pytest.approx(1.0, abs=0.05)
    assert compiled <= memory
    # The decode takes its stream cache in the kept format and writes the new one over it: every
    # byte the planner counts for the cache is aliased.
    assert fit.decode.alias_bytes == pl.session_state_bytes(pipeline)["vae_stream_cache"]


@pytest.mark.slow
@needs_libtpu
@pytest.mark.parametrize("generation", ["v5e", "v6e"])
def test_the_chunk_program_does_not_relay_out_attentions_activations(generation):
    """Compiled at Wan's shapes with two layers, the chunk program's copies that XLA:TPU prices
    with its placeholder write at most 18 chunk activations (``[4680, 1536]`` bf16; 14.5 on a v5e
    and 13.8 on a v6e measured, none of them in the denoise forwards' self-attention). Before the
    attention kernel took q and K as projected (XLA relaid them out around its RoPE) and the DiT
    pinned the q, k and v projections row-major on a TPU (a v5e relaid them out around the QK
    norms and for the kernel), it was 61 on a v5e and 46 on a v6e."""
    figures = pl.plan_bucket(small_wan(), 1, generation, budget=1 << 40).chunk
    assert figures.placeholder_copy_bytes <= 18 * 4680 * 1536 * 2


@needs_libtpu
def test_a_bucket_the_compiler_refuses_for_hbm_does_not_fit(monkeypatch):
    """The compiler's own refusal (a 1 TiB program) stands in for a chunk program too big for the
    chip: the bucket is recorded as not fitting, with the compiler's words, and planning goes on."""
    try:
        tpu_aot.compile_for_tpu(lambda x: x + 1, [(((1 << 40) // 4,), np.float32)], "v5e")
    except Exception as error:  # noqa: BLE001 (the compiler's class differs across jax releases)
        refusal = error
    words = tpu_aot.hbm_refusal(refusal)
    assert words.startswith("Ran out of memory on HBM") and "exceeds available HBM (15.75G)" in words
    assert tpu_aot.hbm_refusal(ValueError("another error")) is None

    def compiling_raises(error):
        def compile_for(*args, **kwargs):
            raise error
        return compile_for

    monkeypatch.setattr(pl, "compile_for", compiling_raises(refusal))
    chip = pl.plan_chip(TINY, "v5e", buckets=(1, 2))
    assert [(b.batch, b.fits, b.refused) for b in chip.buckets] == [(1, False, words)]
    assert chip.streams_per_chip == 0 and chip.best_bucket() is None
    assert f"batch 1: does not fit, the compiler refuses it: {words}" in chip.summary()
    assert '"refused": "Ran out of memory on HBM' in chip.to_json()
    monkeypatch.setattr(pl, "compile_for", compiling_raises(ValueError("a bug")))
    with pytest.raises(ValueError, match="a bug"):  # any other compile error propagates
        pl.plan_chip(TINY, "v5e", buckets=(1,))
