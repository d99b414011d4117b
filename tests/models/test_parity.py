"""Parity with the upstream torch implementation (CPU, float32): a tiny random diffusers
``WanTransformer3DModel`` saved with ``save_pretrained``, loaded with :func:`load_wan`, one forward
against diffusers' own (a timestep per sample and one per frame); the same weights under Wan's official
names and in a Self-Forcing-style ``.pt`` (with a LongLive-style LoRA); the paged rollout of the
converted model against full recompute; and bf16 against diffusers' bf16.

Needs torch and diffusers (the ``test`` extra's parity part); skipped without them.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from arkv_jax.cache import PagedKVCache
from arkv_jax.config import CacheGeometry, CrossAttentionSpec, KVBranch, WindowPolicy
from arkv_jax.models.loader import load_wan
from arkv_jax.planner import rollout_plan
from arkv_jax.reference import FullRecompute, MaskedHistory
from arkv_jax.rollout import Rollout, Sampler
from tests.models.wan_reference import (
    OFFICIAL_JSON,
    WAN_TINY,
    assert_same_params,
    config_shapes,
    nnx_params,
    to_diffusers_name,
)

TOL = 1e-4
B, F = 2, 3
H, W, C = WAN_TINY.frame_shape
TPF = WAN_TINY.tokens_per_frame
DIFFUSERS_CONFIG = dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=4,
                        out_channels=4, text_dim=32, freq_dim=64, ffn_dim=128, num_layers=2, cross_attn_norm=True,
                        qk_norm="rms_norm_across_heads", eps=1e-6)
#: Official key -> diffusers key, the inverse of which renames diffusers' state dict to Wan's names.
OFFICIAL_FROM_DIFFUSERS = {to_diffusers_name(k): k for k in config_shapes(WAN_TINY)}
#: What the measured errors were when these tests were written (printed with ``-s``).
MEASURED: dict[str, float] = {}


def report(name: str, value: float) -> float:
    MEASURED[name] = value
    print(f"{name}: {value:.3g}")
    return value


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    """A random diffusers model (norm weights and all biases perturbed too), saved to a folder."""
    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(**DIFFUSERS_CONFIG).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    folder = tmp_path_factory.mktemp("diffusers") / "transformer"
    model.save_pretrained(folder)  # safetensors + config.json
    assert (folder / "diffusion_pytorch_model.safetensors").is_file()
    return model, folder


@pytest.fixture(scope="module")
def inputs():
    g = torch.Generator().manual_seed(1)
    return dict(latents=torch.randn(B, C, F, H, W, generator=g), context=torch.randn(B, WAN_TINY.text_tokens, 32,
                                                                                        generator=g))


@pytest.fixture(scope="module")
def converted(upstream):
    return load_wan(upstream[1], dtype="float32", grid=WAN_TINY.grid, text_tokens=WAN_TINY.text_tokens)


def diffusers_forward(model, inputs, timestep):
    with torch.no_grad():
        out = model(inputs["latents"].to(model.dtype), timestep, inputs["context"].to(model.dtype),
                    return_dict=False)[0]
    return out.float().permute(0, 2, 3, 4, 1).numpy()  # [B, C, F, H, W] -> [B, F, H, W, C]


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, latents, timesteps, context):
    model = nnx.merge(graphdef, state)
    text_k, text_v = model.text_kv(context)
    history = MaskedHistory(jnp.ones((B, F, F), bool), TPF)  # full bidirectional attention, as diffusers
    return model(latents, timesteps, jnp.zeros(B, jnp.int32), history, text_k, text_v)


def jax_forward(model, inputs, timesteps):
    latents = jnp.asarray(inputs["latents"].permute(0, 2, 3, 4, 1).numpy())
    out = _forward(*nnx.split(model), latents, jnp.asarray(timesteps, jnp.float32),
                   jnp.asarray(inputs["context"].numpy()))
    return np.asarray(out).astype(np.float32)


@pytest.mark.slow
def test_config_and_forward_match_diffusers(upstream, converted, inputs):
    assert converted.config == WAN_TINY
    t = torch.tensor([999.0, 250.0])
    expected = diffusers_forward(upstream[0], inputs, t)
    got = jax_forward(converted, inputs, np.repeat(t.numpy()[:, None], F, axis=1))
    assert np.abs(expected).max() > 0.5
    assert report("diffusers parity, one timestep per sample", float(np.abs(got - expected).max())) < TOL


@pytest.mark.slow
def test_timestep_per_frame_matches_diffusers(upstream, converted, inputs):
    t = np.array([[999.0, 500.0, 0.0], [100.0, 750.0, 30.0]], np.float32)
    # diffusers takes a timestep per token (its Wan 2.2 path): each frame's repeated over its tokens.
    expected = diffusers_forward(upstream[0], inputs, torch.from_numpy(np.repeat(t, TPF, axis=1)))
    got = jax_forward(converted, inputs, t)
    assert report("diffusers parity, one timestep per frame", float(np.abs(got - expected).max())) < TOL


def upstream_state(upstream) -> dict:
    return {k: v.detach().clone() for k, v in upstream[0].state_dict().items()}


@pytest.mark.slow
def test_official_names_and_self_forcing_pt_load_the_same_parameters(upstream, converted, tmp_path):
    from safetensors.torch import save_file

    official = {OFFICIAL_FROM_DIFFUSERS[k]: v.contiguous() for k, v in upstream_state(upstream).items()}
    assert len(official) == len(OFFICIAL_FROM_DIFFUSERS) == 15 + 27 * 2
    folder = tmp_path / "Wan2.1-T2V-tiny"
    folder.mkdir()
    save_file(official, folder / "diffusion_pytorch_model.safetensors")
    (folder / "config.json").write_text(json.dumps(OFFICIAL_JSON))
    assert_same_params(load_wan(folder, dtype="float32", grid=WAN_TINY.grid), converted)

    # Self-Forcing / CausVid / LongLive: the generator's state dict (WanDiffusionWrapper: "model.").
    generator = {"model." + k: v for k, v in official.items()}
    ema = {k: v * 0.5 for k, v in generator.items()}
    torch.save({"generator": generator, "generator_ema": ema}, tmp_path / "self_forcing_dmd.pt")
    assert_same_params(load_wan(tmp_path / "self_forcing_dmd.pt", WAN_TINY, ema=False), converted)
    halved = load_wan(tmp_path / "self_forcing_dmd.pt", WAN_TINY)  # the EMA weights by default
    np.testing.assert_array_equal(np.asarray(halved.head.kernel[...]), 0.5 * np.asarray(converted.head.kernel[...]))
    torch.save({"generator": {k: v.bfloat16() for k, v in generator.items()}}, tmp_path / "causvid.pt")
    bf16 = load_wan(tmp_path / "causvid.pt", WAN_TINY, dtype="bfloat16")
    np.testing.assert_array_equal(np.asarray(bf16.head.kernel[...]),
                                  np.asarray(converted.head.kernel[...].astype(jnp.bfloat16)))
    with pytest.raises(KeyError, match="has no 'generator_ema'"):
        load_wan(tmp_path / "causvid.pt", WAN_TINY, ema=True)
    torch.save({"step": 3, "optimizer": {"lr": 1.0}}, tmp_path / "training_state.pt")
    with pytest.raises(ValueError, match="training_state.pt: expected a state dict"):
        load_wan(tmp_path / "training_state.pt", WAN_TINY)


@pytest.mark.slow
def test_longlive_lora_merges_like_the_unmerged_forward(upstream, inputs, tmp_path):
    """LongLive wraps every linear layer of the blocks in PEFT LoRA (rank 256, alpha 256) and saves
    ``get_peft_model_state_dict`` under ``generator_lora``; here rank 4, alpha 8 (scale 2). The merged
    JAX model matches diffusers run with the merged weights ``W + (alpha / r) B A``."""
    rank, alpha = 4, 8.0
    state = upstream_state(upstream)
    official = {OFFICIAL_FROM_DIFFUSERS[k]: v for k, v in state.items()}
    g = torch.Generator().manual_seed(5)
    lora, merged = {}, dict(state)
    for diffusers_key, official_key in OFFICIAL_FROM_DIFFUSERS.items():
        module = official_key[:-len(".weight")]
        is_block_matrix = official_key.startswith("blocks.") and official_key.endswith(".weight")
        if not is_block_matrix or state[diffusers_key].ndim != 2:
            continue
        w = state[diffusers_key]
        a = 0.1 * torch.randn(rank, w.shape[1], generator=g)
        b = 0.1 * torch.randn(w.shape[0], rank, generator=g)
        lora[f"base_model.model.{module}.lora_A.weight"] = a
        lora[f"base_model.model.{module}.lora_B.weight"] = b
        merged[diffusers_key] = w + (alpha / rank) * b @ a
    assert len(lora) == 2 * 2 * 10  # 10 linear layers per block (q, k, v, o twice; ffn twice), A and B
    torch.save({"generator": {"model." + k: v for k, v in official.items()}}, tmp_path / "longlive_base.pt")
    torch.save({"generator_lora": lora}, tmp_path / "lora.pt")
    model = load_wan(tmp_path / "longlive_base.pt", WAN_TINY, lora=tmp_path / "lora.pt", lora_alpha=alpha)
    reference = diffusers.WanTransformer3DModel(**DIFFUSERS_CONFIG).eval()
    reference.load_state_dict(merged)
    t = torch.tensor([700.0, 20.0])
    expected = diffusers_forward(reference, inputs, t)
    got = jax_forward(model, inputs, np.repeat(t.numpy()[:, None], F, axis=1))
    assert np.abs(expected - diffusers_forward(upstream[0], inputs, t)).max() > 0.1  # the LoRA matters
    assert report("LoRA-merged parity", float(np.abs(got - expected).max())) < TOL


@pytest.mark.slow
def test_paged_rollout_of_the_converted_model_equals_full_recompute(converted):
    geometry = CacheGeometry(num_layers=2, num_kv_heads=4, head_dim=16, dtype="float32", tokens_per_frame=TPF,
                             block_size=16, frames_per_forward=2)
    window = WindowPolicy(window_frames=4, sink_frames=2)
    branches = (KVBranch("positive", 0), KVBranch("negative", 1))
    text = (CrossAttentionSpec("text", WAN_TINY.text_tokens),)
    sampler = Sampler(num_steps=2, guidance_scale=3.0)
    cache = PagedKVCache(geometry, window, branches, text, plan=rollout_plan(geometry, window, branches, text, 2),
                         backend="xla")
    rollout = Rollout(converted, cache, sampler, max_traces=1)
    prompts, seeds, chunks = {"a": "a red fox in the snow", "b": "waves on rocks"}, {"a": 1, "b": 2}, 4
    for sid in prompts:
        rollout.join(sid, prompts[sid], seed=seeds[sid])
    for _ in range(chunks):
        rollout.step()
        held = rollout.pages_held()
        assert all(len(p) <= window.resident_frames * geometry.pages_per_frame * 2 for p in held.values())
    paged = np.stack([rollout.leave(s) for s in prompts])
    assert paged.shape[1] == chunks * 2 > window.resident_frames  # frames were evicted
    reference = FullRecompute(converted, window, sampler, chunk_frames=2)
    expected = reference.rollout(list(prompts.values()), list(seeds.values()), chunks)
    assert np.abs(expected).max() > 1.0
    assert report("converted rollout vs full recompute", float(np.abs(paged - expected).max())) < TOL
    assert rollout.num_traces == 1


@pytest.mark.slow
def test_bf16_error_is_diffusers_like(upstream, inputs):
    """Under the mixed precision policy a bfloat16 model is as far from the float32 one as diffusers'
    bfloat16 model is from its own float32 (``torch_dtype=bfloat16``: ``_keep_in_fp32_modules``)."""
    t = torch.tensor([999.0, 250.0])
    timesteps = np.repeat(t.numpy()[:, None], F, axis=1)
    reference = diffusers_forward(upstream[0], inputs, t)
    folder = upstream[1]
    ours = load_wan(folder, dtype="bfloat16", grid=WAN_TINY.grid, text_tokens=WAN_TINY.text_tokens)
    uniform = load_wan(folder, dataclasses.replace(WAN_TINY, dtype="bfloat16", precision="uniform"))
    theirs = diffusers.WanTransformer3DModel.from_pretrained(folder, torch_dtype=torch.bfloat16).eval()
    assert theirs.scale_shift_table.dtype == torch.float32
    assert theirs.blocks[0].attn1.to_q.weight.dtype == torch.bfloat16

    def rel(x):
        return float(np.sqrt(np.mean((x - reference) ** 2) / np.mean(reference ** 2)))

    mixed = report("bf16 (mixed) vs float32, relative RMS", rel(jax_forward(ours, inputs, timesteps)))
    all_bf16 = report("bf16 (uniform) vs float32, relative RMS", rel(jax_forward(uniform, inputs, timesteps)))
    upstream_bf16 = report("diffusers bf16 vs float32, relative RMS", rel(diffusers_forward(theirs, inputs, t)))
    assert mixed < 0.01 and mixed < all_bf16 and mixed < 1.5 * upstream_bf16
    assert ours.time_in.kernel[...].dtype == jnp.float32 and ours.blocks.ffn_in.kernel[...].dtype == jnp.bfloat16


def test_parameter_count_matches_diffusers(upstream, converted):
    assert sum(p.numel() for p in upstream[0].parameters()) == sum(v.size for v in nnx_params(converted).values())
