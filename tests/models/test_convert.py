"""The checkpoint converter and loader without torch: key map coverage on Wan2.1-T2V-1.3B's real
shapes (abstractly), round trips through every naming and file layout, LoRA merging, placement on a
mesh, and the errors for missing, left-over, misshapen and malformed checkpoints."""

from __future__ import annotations

import dataclasses
import json
import math
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from arkv_jax.models import MODEL_CONFIGS, init_random
from arkv_jax.models.convert import (
    CheckpointKeyError,
    canonicalize,
    config_from_json,
    config_from_shapes,
    convert_state_dict,
    lora_factors,
    num_parameters,
    official_key_map,
    plan_conversion,
)
from arkv_jax.models.dit import DiTConfig, tensor_parallel_specs
from arkv_jax.models.loader import from_state_dict, load_wan, read_safetensors
from arkv_jax.sharding import make_mesh
from tests.models.wan_reference import (
    DIFFUSERS_JSON,
    OFFICIAL_JSON,
    WAN_TINY,
    assert_same_params,
    config_shapes,
    export_official,
    to_diffusers_name,
    write_safetensors,
)

# The released Wan2.1-T2V-1.3B config.json files (official repository and its diffusers port).
WAN_1_3B_OFFICIAL_JSON = {"_class_name": "WanModel", "_diffusers_version": "0.30.0", "dim": 1536, "eps": 1e-06,
                          "ffn_dim": 8960, "freq_dim": 256, "in_dim": 16, "model_type": "t2v", "num_heads": 12,
                          "num_layers": 30, "out_dim": 16, "text_len": 512}
WAN_1_3B_DIFFUSERS_JSON = {"_class_name": "WanTransformer3DModel", "_diffusers_version": "0.33.0.dev0",
                           "added_kv_proj_dim": None, "attention_head_dim": 128, "cross_attn_norm": True,
                           "eps": 1e-06, "ffn_dim": 8960, "freq_dim": 256, "image_dim": None, "in_channels": 16,
                           "num_attention_heads": 12, "num_layers": 30, "out_channels": 16, "patch_size": [1, 2, 2],
                           "qk_norm": "rms_norm_across_heads", "rope_max_seq_len": 1024, "text_dim": 4096}


def random_model(config: DiTConfig, seed: int = 0):
    """Every parameter random (norm scales around 1, biases and tables non-zero), so a swapped or
    mistransposed tensor cannot go unnoticed."""
    graphdef, state = nnx.split(init_random(config, seed))
    rng = np.random.default_rng(seed + 1)

    def draw(path, leaf):
        name = str(path[-2].key) if len(path) > 1 and isinstance(path[-2], jax.tree_util.DictKey) else ""
        value = rng.standard_normal(leaf.shape).astype(np.float32)
        value = 1 + 0.1 * value if name == "scale" else value * (0.1 if name == "bias" else 1.0)
        return jnp.asarray(value if name in ("scale", "bias") else np.asarray(leaf, np.float32) + 0.05 * value,
                           leaf.dtype)

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(draw, state))


@pytest.fixture(scope="module")
def model():
    return random_model(WAN_TINY, seed=3)


@pytest.fixture(scope="module")
def official(model):
    return export_official(model)


# ------------------------------------------------------------------------------------------------
# The real 1.3B layout, abstractly
# ------------------------------------------------------------------------------------------------


def test_key_map_covers_all_825_tensors_of_wan_1_3b():
    config = MODEL_CONFIGS["wan-1.3b"]
    shapes = config_shapes(config)  # the official state dict, written out from WanModel's modules
    assert len(shapes) == 15 + 27 * 30 == 825
    assert len(official_key_map(30)) == 825
    plans = plan_conversion(shapes, config)  # against nnx.eval_shape of the model: no data
    consumed = [key for plan in plans for key in plan.sources]
    assert len(consumed) == len(set(consumed)) == 825 and set(consumed) == set(shapes)
    assert len(plans) == 42  # 15 top-level parameters + 27 stacked block parameters
    assert num_parameters(plans) == sum(math.prod(s) for s in shapes.values()) == 1_418_996_800
    # The same 825 under diffusers' names.
    base, lora = canonicalize({to_diffusers_name(k): np.empty(0) for k in shapes})
    assert set(base) == set(shapes) and not lora


def test_configs_of_the_released_1_3b_checkpoints():
    expected = MODEL_CONFIGS["wan-1.3b"]
    assert config_from_json(WAN_1_3B_OFFICIAL_JSON) == expected
    assert config_from_json(WAN_1_3B_DIFFUSERS_JSON) == expected
    assert config_from_shapes(config_shapes(expected)) == expected
    assert config_from_json(OFFICIAL_JSON, grid=(4, 6), dtype="float32") == WAN_TINY
    assert config_from_json(DIFFUSERS_JSON, grid=(4, 6), text_tokens=7, dtype="float32") == WAN_TINY


# ------------------------------------------------------------------------------------------------
# Round trips
# ------------------------------------------------------------------------------------------------


def test_official_state_dict_round_trip(model, official):
    assert_same_params(from_state_dict(official, WAN_TINY), model)
    params = convert_state_dict(official, WAN_TINY)
    np.testing.assert_array_equal(params[("patch_embedding", "kernel")],
                                  np.asarray(model.patch_embedding.kernel[...]))


def test_prefixed_wrapped_and_diffusers_names_round_trip(model, official):
    wrapped = {"model." + k.replace("blocks.", "blocks._fsdp_wrapped_module.", 1): v for k, v in official.items()}
    assert_same_params(from_state_dict(wrapped, WAN_TINY), model)
    diffusers = {to_diffusers_name(k): v for k, v in official.items()}
    assert_same_params(from_state_dict(diffusers, WAN_TINY), model)


def test_config_read_off_the_shapes(official):
    # Heads are not in the shapes: Wan's head dim (128) gives them, which the 64-wide tiny model lacks.
    with pytest.raises(ValueError, match="not a multiple of Wan's head dim 128; pass config="):
        from_state_dict(official, None)
    shapes = {k: v.shape for k, v in official.items()}
    assert config_from_shapes(shapes, grid=(4, 6), text_tokens=7, dtype="float32", head_dim=16) == WAN_TINY


def test_load_official_and_diffusers_folders(tmp_path, model, official):
    folder = tmp_path / "official"
    folder.mkdir()
    write_safetensors(folder / "diffusion_pytorch_model.safetensors", official, {"format": "pt"})
    (folder / "config.json").write_text(json.dumps(OFFICIAL_JSON))
    assert_same_params(load_wan(folder, dtype="float32", grid=(4, 6)), model)

    # A diffusers pipeline folder: transformer/ with two shards and an index.
    diffusers = {to_diffusers_name(k): v for k, v in official.items()}
    folder = tmp_path / "pipeline" / "transformer"
    folder.mkdir(parents=True)
    names = sorted(diffusers)
    shards = {"diffusion_pytorch_model-00001-of-00002.safetensors": names[: len(names) // 2],
              "diffusion_pytorch_model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, keys in shards.items():
        write_safetensors(folder / file, {k: diffusers[k] for k in keys})
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 0}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}))
    (folder / "config.json").write_text(json.dumps(DIFFUSERS_JSON))
    loaded = load_wan(tmp_path / "pipeline", dtype="float32", grid=(4, 6), text_tokens=7)
    assert loaded.config == WAN_TINY
    assert_same_params(loaded, model)


def test_bf16_checkpoint_into_float32_and_bf16_models(tmp_path, official):
    bf16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in official.items()}
    write_safetensors(tmp_path / "w.safetensors", bf16)
    views = read_safetensors(tmp_path / "w.safetensors")
    assert isinstance(views["head.head.weight"], np.memmap) and views["head.head.weight"].dtype == ml_dtypes.bfloat16
    f32 = load_wan(tmp_path / "w.safetensors", WAN_TINY)
    np.testing.assert_array_equal(np.asarray(f32.head.kernel[...]), bf16["head.head.weight"].astype(np.float32).T)
    mixed = load_wan(tmp_path / "w.safetensors", WAN_TINY, dtype="bfloat16")
    assert mixed.head.kernel[...].dtype == jnp.bfloat16
    # The float32 islands of the precision policy stay float32.
    assert mixed.time_projection.kernel[...].dtype == jnp.float32
    assert mixed.blocks.modulation[...].dtype == jnp.float32 and mixed.blocks.norm3.scale[...].dtype == jnp.float32


def test_sharded_placement(official):
    mesh = make_mesh(2, 4)
    loaded = from_state_dict(official, WAN_TINY, mesh=mesh)
    _, state = nnx.split(loaded)
    specs = tensor_parallel_specs(state, 4)
    got = [leaf.sharding.spec for leaf in jax.tree_util.tree_leaves(state)]
    want = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    assert [tuple(g) for g in got] == [tuple(w) for w in want]
    q = loaded.blocks.self_attn.q.kernel[...]
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, None, "model")
    assert {s.data.shape for s in q.addressable_shards} == {(2, 64, 16)}  # each device holds its heads only
    reference = from_state_dict(official, WAN_TINY)
    np.testing.assert_array_equal(np.asarray(q), np.asarray(reference.blocks.self_attn.q.kernel[...]))


# ------------------------------------------------------------------------------------------------
# LoRA
# ------------------------------------------------------------------------------------------------


def test_lora_merge_peft_names(official):
    rng = np.random.default_rng(0)
    rank, alpha = 3, 6.0
    lora, expected = {}, {}
    for module in ("blocks.0.self_attn.q", "blocks.1.cross_attn.o", "blocks.1.ffn.0"):
        w = official[f"{module}.weight"]
        a = rng.standard_normal((rank, w.shape[1])).astype(np.float32)
        b = rng.standard_normal((w.shape[0], rank)).astype(np.float32)
        lora[f"base_model.model.{module}.lora_A.weight"] = a  # LongLive's PEFT naming
        lora[f"base_model.model.{module}.lora_B.weight"] = b
        expected[module] = w + (alpha / rank) * b @ a
    merged = from_state_dict(official, WAN_TINY, lora={"generator_lora": lora}, lora_alpha=alpha)
    np.testing.assert_allclose(np.asarray(merged.blocks.self_attn.q.kernel[...][0]),
                               expected["blocks.0.self_attn.q"].T, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(merged.blocks.cross_attn.o.kernel[...][1]),
                               expected["blocks.1.cross_attn.o"].T, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(merged.blocks.ffn_in.kernel[...][1]), expected["blocks.1.ffn.0"].T,
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(merged.blocks.self_attn.q.kernel[...][1]),
                                  official["blocks.1.self_attn.q.weight"].T)  # untouched
    # alpha defaults to the rank (scale 1); a PEFT-wrapped full state dict carries its factors inline.
    inline = {**{k.replace("self_attn.q.", "self_attn.q.base_layer."): v for k, v in official.items()},
              **{k.replace("base_model.model.", ""): v for k, v in lora.items()}}
    unit = from_state_dict(inline, WAN_TINY)
    np.testing.assert_allclose(np.asarray(unit.blocks.ffn_in.kernel[...][1]),
                               (official["blocks.1.ffn.0.weight"] + (expected["blocks.1.ffn.0"]
                                - official["blocks.1.ffn.0.weight"]) / 2).T, rtol=1e-5, atol=1e-6)


def test_lora_errors(official):
    with pytest.raises(ValueError, match="lora_A"):
        lora_factors({"blocks.0.self_attn.q.lora_B.weight": np.zeros((64, 2), np.float32)})
    with pytest.raises(ValueError, match="not a LoRA state dict"):
        lora_factors({"blocks.0.self_attn.q.weight": np.zeros((64, 64), np.float32)})
    bad = {"blocks.0.self_attn.q.lora_A.weight": np.zeros((2, 64), np.float32),
           "blocks.0.self_attn.q.lora_B.weight": np.zeros((32, 2), np.float32)}
    with pytest.raises(ValueError, match="does not fit"):
        from_state_dict(official, WAN_TINY, lora=bad)
    absent = {"blocks.7.self_attn.q.lora_A.weight": np.zeros((2, 64), np.float32),
              "blocks.7.self_attn.q.lora_B.weight": np.zeros((64, 2), np.float32)}
    with pytest.raises(KeyError, match="blocks.7.self_attn.q"):
        from_state_dict(official, WAN_TINY, lora=absent)


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------


def test_missing_and_left_over_tensors_are_named(tmp_path, official):
    broken = {k: v for k, v in official.items() if k != "blocks.1.norm3.bias"}
    broken["img_emb.proj.0.weight"] = np.zeros(3, np.float32)
    write_safetensors(tmp_path / "broken.safetensors", broken)
    with pytest.raises(KeyError) as info:
        load_wan(tmp_path / "broken.safetensors", WAN_TINY)
    message = str(info.value)
    assert isinstance(info.value, CheckpointKeyError)
    assert "broken.safetensors" in message and "blocks.1.norm3.bias" in message and "missing" in message
    assert "img_emb.proj.0.weight" in message and "left over" in message and "image-to-video" in message
    deeper = dict(official, **{"blocks.2.ffn.0.bias": official["blocks.0.ffn.0.bias"]})
    with pytest.raises(KeyError, match="more blocks than config.num_layers"):
        from_state_dict(deeper, WAN_TINY)


def test_wrong_shapes_are_named(official):
    with pytest.raises(ValueError, match=r"blocks.0.ffn.0.weight: \[128, 64\], expected \[256, 64\]"):
        from_state_dict(official, dataclasses.replace(WAN_TINY, ffn_dim=256))


def test_malformed_files(tmp_path, official):
    write_safetensors(tmp_path / "w.safetensors", official)
    raw = (tmp_path / "w.safetensors").read_bytes()
    (tmp_path / "truncated.safetensors").write_bytes(raw[: len(raw) - 100])
    with pytest.raises(ValueError, match="truncated.safetensors.*truncated file"):
        read_safetensors(tmp_path / "truncated.safetensors")
    (tmp_path / "garbage.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(ValueError, match="garbage.safetensors: not a safetensors file: its header is not JSON"):
        read_safetensors(tmp_path / "garbage.safetensors")
    (tmp_path / "tiny.safetensors").write_bytes(b"abc")
    with pytest.raises(ValueError, match="tiny.safetensors: not a safetensors file"):
        read_safetensors(tmp_path / "tiny.safetensors")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_wan(tmp_path / "nowhere")
    (tmp_path / "weights.npz").write_bytes(b"")
    with pytest.raises(ValueError, match="unknown checkpoint format"):
        load_wan(tmp_path / "weights.npz")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_wan(empty)


def test_bad_configs(tmp_path, official):
    folder = tmp_path / "i2v"
    folder.mkdir()
    write_safetensors(folder / "model.safetensors", official)
    (folder / "config.json").write_text(json.dumps({**OFFICIAL_JSON, "model_type": "i2v"}))
    with pytest.raises(ValueError, match=r"i2v.config.json: model_type='i2v'"):
        load_wan(folder)
    (folder / "config.json").write_text(json.dumps({**DIFFUSERS_JSON, "image_dim": 1280}))
    with pytest.raises(ValueError, match="image_dim=1280: an image-to-video"):
        load_wan(folder)
    (folder / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKLWan", "z_dim": 16}))
    with pytest.raises(ValueError, match="not a Wan transformer config"):
        load_wan(folder)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        load_wan(folder)
    # An explicit config wins over a config.json that is no Wan config...
    assert load_wan(folder, WAN_TINY).config == WAN_TINY
    # ... but must agree with one that is (the head count is not in the shapes).
    (folder / "config.json").write_text(json.dumps(OFFICIAL_JSON))
    assert load_wan(folder, WAN_TINY).config == WAN_TINY
    with pytest.raises(ValueError, match=r"describes a different model than config=: num_heads=4 \(config: 2\)"):
        load_wan(folder, dataclasses.replace(WAN_TINY, num_heads=2, num_kv_heads=2))


def test_pt_files_without_torch_name_the_extra(tmp_path, monkeypatch):
    (tmp_path / "self_forcing_dmd.pt").write_bytes(b"PK\x03\x04 not really")
    monkeypatch.setitem(sys.modules, "torch", None)  # as if torch were not installed
    with pytest.raises(ImportError, match=r"pip install 'arkv-jax\[torch\]'"):
        load_wan(tmp_path / "self_forcing_dmd.pt", WAN_TINY)
