"""Checkpoint layouts written out from the upstream architectures, independently of
``arkv_jax.models.convert`` (so the tests check the converter against something it did not produce).

* :func:`official_shapes`: every tensor of Wan's ``WanModel`` (T2V) state dict and its shape, read off
  the module tree of ``wan/modules/model.py``: ``patch_embedding`` (``Conv3d``), ``text_embedding`` and
  ``time_embedding`` (``Sequential(Linear, act, Linear)``: indices 0 and 2), ``time_projection``
  (``Sequential(SiLU, Linear)``: index 1), ``num_layers`` x ``WanAttentionBlock`` (``self_attn`` and
  ``cross_attn`` with ``q, k, v, o`` linears and ``norm_q, norm_k`` RMSNorm weights, the affine
  ``norm3``, ``ffn = Sequential(Linear, GELU, Linear)``, ``modulation [1, 6, dim]``; ``norm1``/``norm2``
  have no parameters) and ``head`` (``head.head`` linear, ``head.modulation [1, 2, dim]``; its norm has
  none). Per block 2 x (4 x 2 + 2) + 2 + 2 x 2 + 1 = 27 tensors, outside 2 + 4 + 4 + 2 + 2 + 1 = 15:
  ``15 + 27 x 30 = 825`` for Wan2.1-T2V-1.3B.
* :data:`OFFICIAL_TO_DIFFUSERS`: the same modules in diffusers' ``WanTransformer3DModel``.
* :func:`export_official`: a ``CausalDiT``'s parameters written back as an official state dict (the
  inverse of each tensor fact).
"""

from __future__ import annotations

import re

import jax
import numpy as np
from flax import nnx

from arkv_jax.models.dit import DiTConfig

#: A Wan-shaped tiny model (no GQA, unlike the ``tiny`` preset: Wan has as many K/V heads as queries).
WAN_TINY = DiTConfig(num_layers=2, dim=64, num_heads=4, num_kv_heads=4, ffn_dim=128, in_channels=4, patch_size=2,
                     grid=(4, 6), text_dim=32, text_tokens=7, freq_dim=64)
OFFICIAL_JSON = {"_class_name": "WanModel", "model_type": "t2v", "dim": 64, "ffn_dim": 128, "freq_dim": 64,
                 "in_dim": 4, "out_dim": 4, "num_heads": 4, "num_layers": 2, "text_len": 7, "text_dim": 32,
                 "eps": 1e-6}
DIFFUSERS_JSON = {"_class_name": "WanTransformer3DModel", "num_attention_heads": 4, "attention_head_dim": 16,
                  "in_channels": 4, "out_channels": 4, "text_dim": 32, "freq_dim": 64, "ffn_dim": 128,
                  "num_layers": 2, "patch_size": [1, 2, 2], "cross_attn_norm": True,
                  "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "image_dim": None, "added_kv_proj_dim": None,
                  "rope_max_seq_len": 1024}


def assert_same_params(a, b):
    """The two models have the same parameters, bit for bit, with the same dtypes."""
    pa, pb = nnx_params(a), nnx_params(b)
    assert pa.keys() == pb.keys()
    for key in pa:
        assert pa[key].dtype == pb[key].dtype, key
        np.testing.assert_array_equal(pa[key], pb[key], err_msg=str(key))


def official_shapes(num_layers: int, dim: int, ffn_dim: int, in_channels: int, patch: int, text_dim: int,
                    freq_dim: int) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}

    def linear(name, n_in, n_out):
        shapes[f"{name}.weight"] = (n_out, n_in)
        shapes[f"{name}.bias"] = (n_out,)

    shapes["patch_embedding.weight"] = (dim, in_channels, 1, patch, patch)
    shapes["patch_embedding.bias"] = (dim,)
    linear("text_embedding.0", text_dim, dim)
    linear("text_embedding.2", dim, dim)
    linear("time_embedding.0", freq_dim, dim)
    linear("time_embedding.2", dim, dim)
    linear("time_projection.1", dim, 6 * dim)
    for i in range(num_layers):
        for attn in ("self_attn", "cross_attn"):
            for proj in "qkvo":
                linear(f"blocks.{i}.{attn}.{proj}", dim, dim)
            shapes[f"blocks.{i}.{attn}.norm_q.weight"] = (dim,)
            shapes[f"blocks.{i}.{attn}.norm_k.weight"] = (dim,)
        shapes[f"blocks.{i}.norm3.weight"] = (dim,)
        shapes[f"blocks.{i}.norm3.bias"] = (dim,)
        linear(f"blocks.{i}.ffn.0", dim, ffn_dim)
        linear(f"blocks.{i}.ffn.2", ffn_dim, dim)
        shapes[f"blocks.{i}.modulation"] = (1, 6, dim)
    linear("head.head", dim, patch * patch * in_channels)
    shapes["head.modulation"] = (1, 2, dim)
    return shapes


def config_shapes(config) -> dict[str, tuple[int, ...]]:
    return official_shapes(config.num_layers, config.dim, config.ffn_dim, config.in_channels, config.patch_size,
                           config.text_dim, config.freq_dim)


#: Official module -> diffusers module, outside the blocks and inside one (``blocks.{i}.`` dropped).
TOP_MODULES = {
    "patch_embedding": "patch_embedding",
    "text_embedding.0": "condition_embedder.text_embedder.linear_1",
    "text_embedding.2": "condition_embedder.text_embedder.linear_2",
    "time_embedding.0": "condition_embedder.time_embedder.linear_1",
    "time_embedding.2": "condition_embedder.time_embedder.linear_2",
    "time_projection.1": "condition_embedder.time_proj",
    "head.head": "proj_out",
}
BLOCK_MODULES = {
    **{f"self_attn.{p}": f"attn1.{d}" for p, d in (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("o", "to_out.0"))},
    **{f"cross_attn.{p}": f"attn2.{d}" for p, d in (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("o", "to_out.0"))},
    "self_attn.norm_q": "attn1.norm_q", "self_attn.norm_k": "attn1.norm_k",
    "cross_attn.norm_q": "attn2.norm_q", "cross_attn.norm_k": "attn2.norm_k",
    "norm3": "norm2",  # the affine cross-attention norm
    "ffn.0": "ffn.net.0.proj", "ffn.2": "ffn.net.2",
}


def to_diffusers_name(key: str) -> str:
    if key == "head.modulation":
        return "scale_shift_table"
    match = re.match(r"^(blocks\.\d+\.)(.+)$", key)
    if match:
        prefix, rest = match.groups()
        if rest == "modulation":
            return prefix + "scale_shift_table"
        module, param = rest.rsplit(".", 1)
        return f"{prefix}{BLOCK_MODULES[module]}.{param}"
    module, param = key.rsplit(".", 1)
    return f"{TOP_MODULES[module]}.{param}"


def nnx_params(model) -> dict[tuple[str, ...], np.ndarray]:
    _, state = nnx.split(model)
    return {tuple(str(k.key) for k in p if isinstance(k, jax.tree_util.DictKey)): np.asarray(leaf)
            for p, leaf in jax.tree_util.tree_leaves_with_path(state)}


def export_official(model) -> dict[str, np.ndarray]:
    """The official state dict (float32) whose conversion is ``model``'s parameters."""
    params = {k: v.astype(np.float32) for k, v in nnx_params(model).items()}
    config = model.config
    p, c, dim = config.patch_size, config.in_channels, config.dim
    out: dict[str, np.ndarray] = {}

    def linear(name, path):
        out[f"{name}.weight"] = np.ascontiguousarray(params[(*path, "kernel")].swapaxes(-1, -2))
        out[f"{name}.bias"] = params[(*path, "bias")]

    kernel = params[("patch_embedding", "kernel")]  # [p*p*C, dim], rows ordered (row, col, channel)
    out["patch_embedding.weight"] = np.ascontiguousarray(
        kernel.reshape(p, p, c, dim).transpose(3, 2, 0, 1)[:, :, None])
    out["patch_embedding.bias"] = params[("patch_embedding", "bias")]
    linear("text_embedding.0", ("text_in",))
    linear("text_embedding.2", ("text_out",))
    linear("time_embedding.0", ("time_in",))
    linear("time_embedding.2", ("time_out",))
    linear("time_projection.1", ("time_projection",))
    linear("head.head", ("head",))
    out["head.modulation"] = params[("head_modulation",)][None]
    blocks = {k[1:]: v for k, v in params.items() if k[0] == "blocks"}

    def block_linear(i, layer, name, path):
        out[f"blocks.{i}.{name}.weight"] = np.ascontiguousarray(layer[(*path, "kernel")].T)
        out[f"blocks.{i}.{name}.bias"] = layer[(*path, "bias")]

    for i in range(config.num_layers):
        layer = {k: v[i] for k, v in blocks.items()}

        for attn in ("self_attn", "cross_attn"):
            for proj in "qkvo":
                block_linear(i, layer, f"{attn}.{proj}", (attn, proj))
            for norm in ("norm_q", "norm_k"):
                out[f"blocks.{i}.{attn}.{norm}.weight"] = layer[(attn, norm, "scale")]
        out[f"blocks.{i}.norm3.weight"] = layer[("norm3", "scale")]
        out[f"blocks.{i}.norm3.bias"] = layer[("norm3", "bias")]
        block_linear(i, layer, "ffn.0", ("ffn_in",))
        block_linear(i, layer, "ffn.2", ("ffn_out",))
        out[f"blocks.{i}.modulation"] = layer[("modulation",)][None]
    return out


_ST_NAMES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.float64): "F64",
             np.dtype(np.int64): "I64", np.dtype(np.int32): "I32"}


def write_safetensors(path, tensors: dict, metadata: dict | None = None) -> None:
    """A ``.safetensors`` file written by hand from the format's definition (8-byte little-endian
    header length, JSON header of dtype / shape / data_offsets, raw little-endian bytes), so the
    torch-free tests need neither torch nor the safetensors package."""
    import json

    import ml_dtypes

    names = {**_ST_NAMES, np.dtype(ml_dtypes.bfloat16): "BF16"}
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        blob = arr.tobytes()
        header[name] = {"dtype": names[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for blob in blobs:
            f.write(blob)
