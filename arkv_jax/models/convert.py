"""Wan 2.1 T2V checkpoints to :class:`arkv_jax.models.dit.CausalDiT` parameters: the key map and the
host-side (NumPy) tensor conversion.

Three key namings reach the same ``15 + 27 x num_layers`` tensors (:func:`official_key_map`):
**official** (Wan's ``WanModel``, also inside Self-Forcing / CausVid / LongLive ``.pt`` files under a
``model.`` prefix), **diffusers** (``WanTransformer3DModel``) and this model's **NNX** paths, the
blocks' leaves stacked on a leading layer axis. :func:`canonicalize` brings every key to the official
naming (wrappers stripped, diffusers names renamed, PEFT ``base_layer`` folded, LoRA factors set aside
for :func:`merge_lora`); :func:`plan_conversion` checks, before any data is read, that every tensor is
consumed and every parameter filled with the right shape (:func:`arkv_jax.models.io.check_tensors`,
the check every loader runs); :func:`convert_leaf` builds one parameter on the host in its dtype
(:data:`TRANSFORMS`). Values may be NumPy arrays (memory-mapped views, read only when a parameter is
built), torch tensors (:func:`arkv_jax.models.io.to_numpy`, no copy, bfloat16 included) or anything
``np.asarray`` takes. See ``docs/models.md``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from arkv_jax.models.dit import CausalDiT, DiTConfig
from arkv_jax.models.io import CheckpointKeyError, abstract, check_tensors, listing, path_names, shape_of, to_numpy

#: Transforms from a checkpoint tensor to (one layer of) a parameter: ``linear``, a ``Linear.weight``
#: ``[out, in]`` to a ``kernel`` ``[in, out]``; ``copy``, biases and norm scales as they are; ``patch``, the
#: patch-embedding ``Conv3d`` weight ``[dim, C, 1, p, p]`` to ``W[:, :, 0].transpose(2, 3, 1, 0).reshape(p * p
#: * C, dim)`` (:func:`arkv_jax.models.dit.patchify` orders a patch's features row, column, channel);
#: ``modulation``, a table ``[1, n, dim]`` to ``[n, dim]``.
TRANSFORMS = ("linear", "copy", "patch", "modulation")

#: Head dim of every Wan 2.1 model (1.3B: 12 x 128, 14B: 40 x 128), used to count heads when a
#: checkpoint comes without a config.
WAN_HEAD_DIM = 128


@dataclasses.dataclass(frozen=True)
class KeyTarget:
    """Where one official checkpoint tensor goes.

    Attributes:
      path: the NNX parameter path, e.g. ``("blocks", "self_attn", "q", "kernel")``.
      layer: index on the stacked layer axis (``path[0] == "blocks"``), else ``None``.
      transform: one of :data:`TRANSFORMS`.
    """

    path: tuple[str, ...]
    layer: int | None
    transform: str


def _linear(official: str, diffusers: str, path: tuple[str, ...]) -> list[tuple[str, str, tuple[str, ...], str]]:
    return [(f"{official}.weight", f"{diffusers}.weight", (*path, "kernel"), "linear"),
            (f"{official}.bias", f"{diffusers}.bias", (*path, "bias"), "copy")]


def _top_entries() -> list[tuple[str, str, tuple[str, ...], str]]:
    """``(official key, diffusers key, NNX path, transform)`` outside the blocks: 15 tensors."""
    return [
        ("patch_embedding.weight", "patch_embedding.weight", ("patch_embedding", "kernel"), "patch"),
        ("patch_embedding.bias", "patch_embedding.bias", ("patch_embedding", "bias"), "copy"),
        *_linear("text_embedding.0", "condition_embedder.text_embedder.linear_1", ("text_in",)),
        *_linear("text_embedding.2", "condition_embedder.text_embedder.linear_2", ("text_out",)),
        *_linear("time_embedding.0", "condition_embedder.time_embedder.linear_1", ("time_in",)),
        *_linear("time_embedding.2", "condition_embedder.time_embedder.linear_2", ("time_out",)),
        *_linear("time_projection.1", "condition_embedder.time_proj", ("time_projection",)),
        *_linear("head.head", "proj_out", ("head",)),
        ("head.modulation", "scale_shift_table", ("head_modulation",), "modulation"),
    ]


def _block_entries() -> list[tuple[str, str, tuple[str, ...], str]]:
    """The same for one block, keys relative to ``blocks.{i}.``: 27 tensors."""
    out = []
    for official, diffusers in (("self_attn", "attn1"), ("cross_attn", "attn2")):
        for o, d in (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("o", "to_out.0")):
            out += _linear(f"{official}.{o}", f"{diffusers}.{d}", (official, o))
        for norm in ("norm_q", "norm_k"):
            out.append((f"{official}.{norm}.weight", f"{diffusers}.{norm}.weight", (official, norm, "scale"), "copy"))
    out += [("norm3.weight", "norm2.weight", ("norm3", "scale"), "copy"),
            ("norm3.bias", "norm2.bias", ("norm3", "bias"), "copy"),
            *_linear("ffn.0", "ffn.net.0.proj", ("ffn_in",)),
            *_linear("ffn.2", "ffn.net.2", ("ffn_out",)),
            ("modulation", "scale_shift_table", ("modulation",), "modulation")]
    return out


_TOP = _top_entries()
_BLOCK = _block_entries()
_TOP_DIFFUSERS_TO_OFFICIAL = {d: o for o, d, _, _ in _TOP}
_BLOCK_DIFFUSERS_TO_OFFICIAL = {d: o for o, d, _, _ in _BLOCK}
_BLOCK_KEY = re.compile(r"^blocks\.(\d+)\.(.+)$")


def official_key_map(num_layers: int) -> dict[str, KeyTarget]:
    """Every tensor of an official Wan 2.1 T2V checkpoint with ``num_layers`` blocks and where it
    goes: ``15 + 27 * num_layers`` entries (825 for Wan2.1-T2V-1.3B's 30 blocks)."""
    out = {o: KeyTarget(path, None, transform) for o, _, path, transform in _TOP}
    for i in range(num_layers):
        for o, _, path, transform in _BLOCK:
            out[f"blocks.{i}.{o}"] = KeyTarget(("blocks", *path), i, transform)
    return out


def diffusers_to_official(key: str) -> str:
    """The official name of a diffusers ``WanTransformer3DModel`` key (unknown keys unchanged)."""
    match = _BLOCK_KEY.match(key)
    if match:
        rest = _BLOCK_DIFFUSERS_TO_OFFICIAL.get(match.group(2))
        return f"blocks.{match.group(1)}.{rest}" if rest else key
    return _TOP_DIFFUSERS_TO_OFFICIAL.get(key, key)


def is_diffusers_naming(keys: Iterable[str]) -> bool:
    """Whether ``keys`` use diffusers' names (``condition_embedder.``, ``attn1``, ``proj_out``, ...)."""
    return any(k.startswith(("condition_embedder.", "proj_out.")) or k == "scale_shift_table"
               or ".attn1." in k or ".attn2." in k or k.endswith(".scale_shift_table") for k in keys)


# ------------------------------------------------------------------------------------------------
# Host tensors
# ------------------------------------------------------------------------------------------------


def _transform(kind: str, w: np.ndarray) -> np.ndarray:
    if kind == "linear":
        return w.T
    if kind == "patch":
        return w[:, :, 0].transpose(2, 3, 1, 0).reshape(-1, w.shape[0])
    if kind == "modulation":
        return w[0]
    return w


def _source_shape(kind: str, target: tuple[int, ...], config: DiTConfig) -> tuple[int, ...]:
    """The checkpoint tensor shape that ``kind`` turns into (one layer of) ``target``."""
    if kind == "linear":
        return target[::-1]
    if kind == "patch":
        p = config.patch_size
        return (target[1], config.in_channels, 1, p, p)
    if kind == "modulation":
        return (1, *target)
    return target


# ------------------------------------------------------------------------------------------------
# Key canonicalisation and LoRA
# ------------------------------------------------------------------------------------------------

#: Module-wrapper tokens dropped wherever they occur (FSDP, activation checkpointing, torch.compile).
WRAPPER_TOKENS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
#: Prefixes dropped while every key has them: Self-Forcing's ``WanDiffusionWrapper`` (``model.``),
#: DDP (``module.``), PEFT (``base_model.model.``), ComfyUI (``diffusion_model.``), diffusers' LoRA
#: files (``transformer.``).
WRAPPER_PREFIXES = ("model.", "module.", "base_model.model.", "diffusion_model.", "transformer.")

_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<part>A|B|down|up)(?:\.(?P<adapter>[^.]+))?\.weight$")
_LORA_ALPHA = re.compile(r"^(?P<module>.+)\.alpha$")


@dataclasses.dataclass(frozen=True)
class LoraFactors:
    """One low-rank update ``(alpha / r) up @ down`` of a linear weight ``[out, in]``.

    Attributes:
      down: ``lora_A`` (``lora_down``) ``[r, in]``.
      up: ``lora_B`` (``lora_up``) ``[out, r]``.
      alpha: the checkpoint's own alpha (kohya's ``<module>.alpha``), or ``None``.
    """

    down: Any
    up: Any
    alpha: float | None = None

    @property
    def rank(self) -> int:
        return shape_of(self.down)[0]


def strip_wrappers(keys: Sequence[str]) -> dict[str, str]:
    """``{key: cleaned key}``: :data:`WRAPPER_TOKENS` removed, then :data:`WRAPPER_PREFIXES` while all
    keys share one, then PEFT's ``.base_layer`` folded into its module."""
    cleaned = {k: k for k in keys}
    for token in WRAPPER_TOKENS:
        cleaned = {k: v.replace(token, "") for k, v in cleaned.items()}
    stripped = True
    while stripped and cleaned:
        stripped = False
        for prefix in WRAPPER_PREFIXES:
            if all(v.startswith(prefix) for v in cleaned.values()):
                cleaned = {k: v[len(prefix):] for k, v in cleaned.items()}
                stripped = True
    return {k: v.replace(".base_layer.", ".") for k, v in cleaned.items()}


def _official_module(module: str, diffusers: bool) -> str:
    return diffusers_to_official(f"{module}.weight")[:-len(".weight")] if diffusers else module


def _collect_lora(lora_keys: Mapping[str, tuple[str, str, Any]], diffusers: bool, source: str
                  ) -> dict[str, LoraFactors]:
    """``{official module: LoraFactors}`` from ``{key: (module, part, tensor)}``."""
    parts: dict[str, dict[str, Any]] = {}
    for key, (module, part, value) in lora_keys.items():
        slot = {"A": "down", "down": "down", "B": "up", "up": "up", "alpha": "alpha"}[part]
        entry = parts.setdefault(_official_module(module, diffusers), {})
        if slot in entry:
            raise ValueError(f"{source}: two LoRA {slot} tensors for module {module!r} (one is {key!r}); "
                             "several adapters in one file are not supported")
        entry[slot] = value
    out = {}
    for module, entry in sorted(parts.items()):
        if "down" not in entry or "up" not in entry:
            have = sorted(entry)
            raise ValueError(f"{source}: LoRA module {module!r} has {have} but needs both lora_A (down) "
                             "and lora_B (up)")
        alpha = entry.get("alpha")
        out[module] = LoraFactors(entry["down"], entry["up"],
                                  None if alpha is None else float(np.asarray(to_numpy(alpha)).reshape(())))
    return out


def canonicalize(tensors: Mapping[str, Any], *, source: str = "state dict"
                 ) -> tuple[dict[str, Any], dict[str, LoraFactors]]:
    """Brings a checkpoint's keys to the official naming.

    Returns:
      ``(base, lora)``: the tensors by official key (values untouched), and any LoRA factors found
      among them (a PEFT-wrapped state dict) by official module name, e.g. ``blocks.0.self_attn.q``.

    Raises:
      ValueError: two keys clean to the same name, or a malformed LoRA entry (naming ``source``).
    """
    cleaned = strip_wrappers(list(tensors))
    base_keys: dict[str, str] = {}
    lora_keys: dict[str, tuple[str, str, Any]] = {}
    for key, name in cleaned.items():
        match = _LORA_KEY.match(name)
        alpha = _LORA_ALPHA.match(name)
        if match:
            lora_keys[key] = (match.group("module"), match.group("part"), tensors[key])
        elif alpha:
            lora_keys[key] = (alpha.group("module"), "alpha", tensors[key])
        else:
            base_keys[key] = name
    diffusers = is_diffusers_naming(base_keys.values()) or is_diffusers_naming(m for m, _, _ in lora_keys.values())
    base: dict[str, Any] = {}
    for key, name in base_keys.items():
        official = diffusers_to_official(name) if diffusers else name
        if official in base:
            raise ValueError(f"{source}: two tensors map to {official!r} (one is {key!r})")
        base[official] = tensors[key]
    return base, _collect_lora(lora_keys, diffusers, source)


def lora_factors(tensors: Mapping[str, Any], *, source: str = "LoRA state dict") -> dict[str, LoraFactors]:
    """The LoRA factors of a LoRA-only state dict (PEFT ``lora_A``/``lora_B`` as LongLive saves
    them, ``base_model.model.blocks.0.self_attn.q.lora_A.weight``; or kohya ``lora_down``/
    ``lora_up``/``alpha``), by official module name.

    Raises:
      ValueError: a key that is not a LoRA factor, an unpaired factor, or no factor at all.
    """
    base, lora = canonicalize(tensors, source=source)
    if base:
        raise ValueError(f"{source}: not a LoRA state dict: {len(base)} keys are no lora_A/lora_B/"
                         f"lora_down/lora_up/alpha, e.g. {sorted(base)[:5]}")
    if not lora:
        raise ValueError(f"{source}: no LoRA factors found")
    return lora


class MergedWeight:
    """A linear weight with a LoRA update, merged when read: ``np.asarray(merged)`` is
    ``W + scale * up @ down`` in float32. Lazy, so a model's merged weights are never all in host
    memory at once (Wan-1.3B's block linears are 5.6 GB in float32)."""

    def __init__(self, weight: Any, factors: LoraFactors, scale: float):
        self.weight, self.factors, self.scale = weight, factors, float(scale)

    @property
    def shape(self) -> tuple[int, ...]:
        return shape_of(self.weight)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        f32 = np.float32
        out = to_numpy(self.weight).astype(f32) + f32(self.scale) * (
            to_numpy(self.factors.up).astype(f32) @ to_numpy(self.factors.down).astype(f32))
        return out if dtype is None else out.astype(dtype)


def merge_lora(base: Mapping[str, Any], lora: Mapping[str, LoraFactors], *, alpha: float | None = None,
               source: str = "state dict") -> dict[str, Any]:
    """``base`` (official keys) with every LoRA pair merged into its linear weight:
    ``W + (alpha / r) B A``, computed in float32 on the host when the weight is read
    (:class:`MergedWeight`).

    Args:
      alpha: the LoRA alpha (PEFT keeps it in its config, not in the weights; LongLive trains rank
        256 with alpha 256). ``None``: the factor's own alpha if the file has one, else ``r`` (scale 1,
        PEFT's ``lora_alpha = alpha or rank`` as LongLive configures it).

    Raises:
      CheckpointKeyError: a LoRA module whose ``<module>.weight`` is not in ``base``.
      ValueError: factor shapes that do not fit the weight.
    """
    out = dict(base)
    for module, factors in lora.items():
        key = f"{module}.weight"
        if key not in out:
            raise CheckpointKeyError(f"{source}: LoRA factors for {module!r} but the checkpoint has no {key!r}")
        w, down, up = shape_of(out[key]), shape_of(factors.down), shape_of(factors.up)
        r = down[0] if len(down) == 2 else -1
        if len(w) != 2 or len(up) != 2 or r < 1 or up != (w[0], r) or down[1] != w[1]:
            raise ValueError(f"{source}: LoRA {module!r}: lora_B {list(up)} @ lora_A {list(down)} does not fit "
                             f"the weight {list(w)} (expected [out, r] @ [r, in])")
        a = alpha if alpha is not None else (factors.alpha if factors.alpha is not None else r)
        out[key] = MergedWeight(out[key], factors, a / r)
    return out


# ------------------------------------------------------------------------------------------------
# Configs
# ------------------------------------------------------------------------------------------------


def _check(ok: bool, source: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{source}: {message}")


def config_from_json(cfg: Mapping[str, Any], *, grid: tuple[int, int] = (30, 52), text_tokens: int | None = None,
                     dtype: str = "bfloat16", source: str = "config.json") -> DiTConfig:
    """A :class:`DiTConfig` from a checkpoint's ``config.json``: diffusers' ``WanTransformer3DModel``
    or Wan's ``WanModel`` (T2V only).

    Args:
      grid: tokens per frame (rows, columns): not in a checkpoint, the resolution is the caller's
        (Wan's 480x832: latent 60x104, patch 2: ``(30, 52)``).
      text_tokens: text tokens per prompt; default Wan's ``text_len`` (512).
      dtype: parameter and compute dtype.

    Raises:
      ValueError: not a Wan transformer config, or a variant this model does not implement (I2V,
        temporal patches, no QK norm or no cross-attention norm), naming ``source``.
    """
    _check(isinstance(cfg, Mapping), source, f"expected a JSON object, found {type(cfg).__name__}")
    name = cfg.get("_class_name")
    if name == "WanTransformer3DModel" or (name is None and "num_attention_heads" in cfg):
        heads, head_dim = int(cfg.get("num_attention_heads", 40)), int(cfg.get("attention_head_dim", 128))
        patch = tuple(cfg.get("patch_size", (1, 2, 2)))
        in_channels = int(cfg.get("in_channels", 16))
        out_channels = cfg.get("out_channels") or in_channels
        for field in ("image_dim", "added_kv_proj_dim", "pos_embed_seq_len"):
            _check(cfg.get(field) is None, source, f"{field}={cfg.get(field)!r}: an image-to-video (I2V) "
                   "model; only text-to-video is supported")
        _check(cfg.get("cross_attn_norm", True) is True, source, "cross_attn_norm must be true (Wan 2.1)")
        _check(cfg.get("qk_norm", "rms_norm_across_heads") == "rms_norm_across_heads", source,
               f"qk_norm={cfg.get('qk_norm')!r}; only 'rms_norm_across_heads' is supported")
        fields = dict(num_layers=int(cfg.get("num_layers", 40)), dim=heads * head_dim, num_heads=heads,
                      ffn_dim=int(cfg.get("ffn_dim", 13824)), in_channels=in_channels,
                      text_dim=int(cfg.get("text_dim", 4096)), freq_dim=int(cfg.get("freq_dim", 256)),
                      eps=float(cfg.get("eps", 1e-6)), text_tokens=512)
    elif name == "WanModel" or (name is None and "dim" in cfg and "num_heads" in cfg):
        _check(cfg.get("model_type", "t2v") == "t2v", source,
               f"model_type={cfg.get('model_type')!r}; only text-to-video ('t2v') is supported")
        _check(bool(cfg.get("qk_norm", True)), source, "qk_norm must be true (Wan 2.1)")
        _check(bool(cfg.get("cross_attn_norm", True)), source, "cross_attn_norm must be true (Wan 2.1)")
        patch = tuple(cfg.get("patch_size", (1, 2, 2)))
        in_channels = int(cfg.get("in_dim", 16))
        out_channels = int(cfg.get("out_dim", in_channels))
        dim, heads = int(cfg.get("dim", 2048)), int(cfg.get("num_heads", 16))
        fields = dict(num_layers=int(cfg.get("num_layers", 32)), dim=dim, num_heads=heads,
                      ffn_dim=int(cfg.get("ffn_dim", 8192)), in_channels=in_channels,
                      text_dim=int(cfg.get("text_dim", 4096)), freq_dim=int(cfg.get("freq_dim", 256)),
                      eps=float(cfg.get("eps", 1e-6)), text_tokens=int(cfg.get("text_len", 512)))
    else:
        raise ValueError(f"{source}: not a Wan transformer config: expected diffusers' WanTransformer3DModel or "
                         f"Wan's WanModel, found _class_name={name!r} with keys {sorted(cfg)[:12]}")
    _check(len(patch) == 3 and patch[0] == 1 and patch[1] == patch[2], source,
           f"patch_size={list(patch)}; only (1, p, p) patches (one frame per token) are supported")
    _check(int(out_channels) == in_channels, source,
           f"out channels {out_channels} differ from in channels {in_channels}")
    if text_tokens is not None:
        fields["text_tokens"] = text_tokens
    return DiTConfig(num_kv_heads=fields["num_heads"], patch_size=int(patch[1]), grid=tuple(grid), dtype=dtype,
                     **fields)


def config_from_shapes(shapes: Mapping[str, tuple[int, ...]], *, grid: tuple[int, int] = (30, 52),
                       text_tokens: int = 512, dtype: str = "bfloat16", head_dim: int = WAN_HEAD_DIM,
                       source: str = "state dict") -> DiTConfig:
    """A :class:`DiTConfig` read off the tensor shapes of an official-named state dict (a ``.pt``
    file has no config): width, channels and patch from ``patch_embedding``, blocks from the
    ``blocks.{i}`` indices, FFN, text and timestep widths from their first linear layers; heads
    from ``head_dim`` (128 in every Wan 2.1 model). ``eps`` is Wan's 1e-6.

    Raises:
      CheckpointKeyError: a tensor the shapes are read from is missing.
      ValueError: shapes that no Wan 2.1 T2V model has.
    """
    def get(key: str) -> tuple[int, ...]:
        if key not in shapes:
            raise CheckpointKeyError(f"{source}: no {key!r}, so the model shape cannot be read off the "
                                     "checkpoint: is it a Wan 2.1 transformer? (pass config= otherwise)")
        return tuple(shapes[key])

    patch = get("patch_embedding.weight")
    _check(len(patch) == 5 and patch[2] == 1 and patch[3] == patch[4], source,
           f"patch_embedding.weight has shape {patch}; expected [dim, C, 1, p, p]")
    dim, in_channels, p = patch[0], patch[1], patch[3]
    layers = {int(m.group(1)) for k in shapes if (m := _BLOCK_KEY.match(k))}
    _check(bool(layers) and layers == set(range(max(layers) + 1)), source,
           f"block indices {sorted(layers)[:8]}... are not 0..L-1")
    _check(dim % head_dim == 0, source, f"width {dim} is not a multiple of Wan's head dim {head_dim}; pass config=")
    return DiTConfig(num_layers=max(layers) + 1, dim=dim, num_heads=dim // head_dim, num_kv_heads=dim // head_dim,
                     ffn_dim=get("blocks.0.ffn.0.weight")[0], in_channels=in_channels, patch_size=p,
                     grid=tuple(grid), text_dim=get("text_embedding.0.weight")[1], text_tokens=text_tokens,
                     freq_dim=get("time_embedding.0.weight")[1], dtype=dtype)


# ------------------------------------------------------------------------------------------------
# The plan and the conversion
# ------------------------------------------------------------------------------------------------


def parameter_shapes(config: DiTConfig) -> dict[tuple[str, ...], jax.ShapeDtypeStruct]:
    """Every parameter of a :class:`CausalDiT` by path, abstractly (``nnx.eval_shape``): shapes
    and dtypes (the precision policy's)."""
    _, state = abstract(CausalDiT, config)
    return {path_names(p): jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
            for p, leaf in jax.tree_util.tree_leaves_with_path(state)}


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """How one parameter is built.

    Attributes:
      path: the NNX parameter path.
      shape, dtype: the parameter's (the layer axis first for the blocks).
      sources: the official checkpoint keys, one per layer for a stacked parameter.
      transform: one of :data:`TRANSFORMS`.
    """

    path: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: np.dtype
    sources: tuple[str, ...]
    transform: str

    @property
    def stacked(self) -> bool:
        return self.path[0] == "blocks"


def _hint(unexpected: Sequence[str]) -> str:
    if any("img_emb" in k or "k_img" in k or "v_img" in k or "add_k_proj" in k for k in unexpected):
        return " (image-to-video weights: only Wan 2.1 T2V is supported)"
    if any(_BLOCK_KEY.match(k) for k in unexpected):
        return " (more blocks than config.num_layers?)"
    return ""


def plan_conversion(shapes: Mapping[str, tuple[int, ...]], config: DiTConfig, *, source: str = "state dict",
                    params: Mapping[tuple[str, ...], jax.ShapeDtypeStruct] | None = None) -> list[LeafPlan]:
    """Checks an official-named checkpoint against the model without reading any data.

    Args:
      shapes: ``{official key: shape}`` (from :func:`canonicalize`).
      params: the model's parameters by path (default :func:`parameter_shapes` of ``config``).

    Returns:
      One :class:`LeafPlan` per parameter, in ``params`` order.

    Raises:
      CheckpointKeyError: tensors missing or left over (both listed, naming ``source``), or a
        parameter no tensor fills.
      ValueError: a tensor of the wrong shape (all of them listed).
    """
    params = parameter_shapes(config) if params is None else params
    key_map = official_key_map(config.num_layers)
    by_path: dict[tuple[str, ...], list[tuple[int | None, str, str]]] = {}
    for key, target in key_map.items():
        by_path.setdefault(target.path, []).append((target.layer, key, target.transform))
    unfilled = [p for p in params if p not in by_path]
    unknown = [p for p in by_path if p not in params]
    if unfilled or unknown:
        raise CheckpointKeyError(f"{source}: the key map and the model disagree: parameters no tensor fills: "
                                 f"{listing(['/'.join(p) for p in unfilled])}; targets the model lacks: "
                                 f"{listing(['/'.join(p) for p in unknown])}")
    plans, expected = [], {}
    for path, leaf in params.items():
        entries = sorted(by_path[path], key=lambda e: -1 if e[0] is None else e[0])
        transform = entries[0][2]
        stacked = entries[0][0] is not None
        if stacked and len(entries) != leaf.shape[0]:
            raise ValueError(f"{source}: {'/'.join(path)}: {len(entries)} layers for a parameter of {leaf.shape[0]}")
        shape = _source_shape(transform, tuple(leaf.shape[1:] if stacked else leaf.shape), config)
        expected.update((key, shape) for _, key, _ in entries)
        plans.append(LeafPlan(path, tuple(leaf.shape), np.dtype(leaf.dtype), tuple(k for _, k, _ in entries),
                              transform))
    check_tensors(shapes, expected, source=source, model=f"a {config.num_layers}-block Wan 2.1 T2V transformer",
                  hint=_hint)
    return plans


def convert_leaf(plan: LeafPlan, tensors: Mapping[str, Any]) -> np.ndarray:
    """One parameter as a fresh host array of ``plan.dtype`` (stacked blocks filled layer by layer,
    so only one layer of the source is in memory besides the result)."""
    if plan.stacked:
        out = np.empty(plan.shape, plan.dtype)
        for i, key in enumerate(plan.sources):
            out[i] = _transform(plan.transform, to_numpy(tensors[key]))
        return out
    return np.array(_transform(plan.transform, to_numpy(tensors[plan.sources[0]])), dtype=plan.dtype)


def prepare(tensors: Mapping[str, Any], config: DiTConfig | None = None, *, source: str = "state dict",
            lora: Mapping[str, LoraFactors] | None = None, lora_alpha: float | None = None,
            config_kw: Mapping[str, Any] | None = None) -> tuple[DiTConfig, list[LeafPlan], dict[str, Any]]:
    """Canonicalises ``tensors``, merges LoRA (found inline or given), derives the config if
    ``None`` (:func:`config_from_shapes` with ``config_kw``) and plans the conversion.

    Returns:
      ``(config, plans, tensors by official key)``, ready for :func:`convert_leaf`.
    """
    base, inline = canonicalize(tensors, source=source)
    factors = {**inline, **(lora or {})}
    if factors:
        base = merge_lora(base, factors, alpha=lora_alpha, source=source)
    shapes = {k: shape_of(v) for k, v in base.items()}
    if config is None:
        config = config_from_shapes(shapes, source=source, **(config_kw or {}))
    return config, plan_conversion(shapes, config, source=source), base


def convert_state_dict(tensors: Mapping[str, Any], config: DiTConfig, *, source: str = "state dict",
                       lora: Mapping[str, LoraFactors] | None = None, lora_alpha: float | None = None
                       ) -> dict[tuple[str, ...], np.ndarray]:
    """Every parameter of ``config``'s model as a host array, by NNX path (see :func:`prepare`)."""
    config, plans, base = prepare(tensors, config, source=source, lora=lora, lora_alpha=lora_alpha)
    return {plan.path: convert_leaf(plan, base) for plan in plans}


def num_parameters(plans: Iterable[LeafPlan]) -> int:
    """Total parameter count of a plan."""
    return sum(math.prod(p.shape) for p in plans)
