"""Real Wan 2.1 T2V weights in the causal DiT: :func:`load_wan`.

Formats (:func:`read_checkpoint`): an **official Wan 2.1** folder (``config.json`` and
``diffusion_pytorch_model.safetensors``, or shards listed in ``*.safetensors.index.json``); a
**diffusers** pipeline folder (its ``transformer/``) or the ``transformer/`` folder itself; a
**Self-Forcing / CausVid / LongLive** ``.pt`` / ``.pth`` torch pickle (:func:`generator_state_dict`;
only this format needs torch, ``pip install 'arkv-jax[torch]'``); and a **LoRA** to merge
(:func:`read_lora`: LongLive's ``lora.pt`` or any PEFT / kohya LoRA). Safetensors are read without
torch or a copy (read-only ``np.memmap`` views, bfloat16 through ``ml_dtypes``); each parameter is
then cast on the host under the model's precision policy and placed with ``jax.device_put``, on a
mesh straight into its :func:`arkv_jax.models.dit.tensor_parallel_specs` sharding (no unsharded copy
on any device), one parameter at a time (:func:`place`). Every tensor must be consumed and every
parameter filled with the right shape before any data is read, or a ``KeyError`` / ``ValueError``
names the file and the tensors. See ``docs/models.md``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from arkv_jax.models.convert import LeafPlan, LoraFactors, config_from_json, convert_leaf, lora_factors, prepare
from arkv_jax.models.dit import CausalDiT, DiTConfig, tensor_parallel_specs
from arkv_jax.models.io import (
    TORCH_SUFFIXES,
    abstract,
    build,
    path_names,
    read_json,
    read_safetensors,
    read_sharded_safetensors,
    tensor_dict,
    torch_load,
    torch_state_dict,
)

#: Wan's 480x832 video: latent 60x104, patch 2.
WAN_480P_GRID = (30, 52)


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A checkpoint's tensors as found (raw keys, lazy values) and its ``config.json``, if any.

    Attributes:
      tensors: ``{key: array}`` (memory-mapped NumPy views or torch tensors).
      config: the parsed ``config.json`` next to the weights, or ``None`` (none there, or not read).
      source: the file(s), for messages.
      config_source: the path of the ``config.json`` next to the weights, or ``None``.
    """

    tensors: Mapping[str, Any]
    config: dict | None
    source: str
    config_source: str | None = None


# ------------------------------------------------------------------------------------------------
# Files
# ------------------------------------------------------------------------------------------------


def generator_state_dict(obj: Any, *, ema: bool | None = None, source: str = "checkpoint"
                         ) -> tuple[dict[str, Any], str]:
    """The generator's state dict in a Self-Forcing / CausVid / LongLive checkpoint object.

    ``generator_ema`` or ``generator`` (``ema=None``: the EMA weights when the file has them,
    as Self-Forcing's released inference runs with ``--use_ema``; CausVid ships ``generator`` only;
    LongLive's inference configs set ``use_ema: false``, so pass ``ema=False`` there), else
    ``model``, else ``state_dict``, else the object itself if it is a flat state dict.

    Returns:
      ``(state dict, source)`` with the entry's name appended to ``source``.

    Raises:
      KeyError: ``ema`` asks for an entry the file does not have.
      ValueError: no state dict found (the top-level keys are listed), or a LoRA-only file.
    """
    if not isinstance(obj, Mapping):
        raise ValueError(f"{source}: expected a dict, found {type(obj).__name__}")
    if "generator" in obj or "generator_ema" in obj:
        if ema is None:
            key = "generator_ema" if "generator_ema" in obj else "generator"
        else:
            key = "generator_ema" if ema else "generator"
            if key not in obj:
                raise KeyError(f"{source}: has no {key!r} (ema={ema}); it has {sorted(map(str, obj))}")
    elif "generator_lora" in obj:
        raise ValueError(f"{source}: a LoRA file (generator_lora); pass it as lora=... beside the base checkpoint")
    else:
        return torch_state_dict(obj, source)
    return tensor_dict(obj[key], f"{source}[{key!r}]"), f"{source}[{key!r}]"


def _resolve(path: Path) -> tuple[str, Path]:
    """``(kind, file)``: kind is ``"safetensors"``, ``"index"`` or ``"torch"``."""
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if path.is_dir():
        indexes = sorted(path.glob("*.safetensors.index.json"))
        files = sorted(path.glob("*.safetensors"))
        if len(indexes) > 1:
            raise ValueError(f"{path}: several safetensors indexes ({[i.name for i in indexes]}); pass one of them")
        if indexes:
            return "index", indexes[0]
        if len(files) == 1:
            return "safetensors", files[0]
        if len(files) > 1:
            raise ValueError(f"{path}: several safetensors files and no *.safetensors.index.json: "
                             f"{[f.name for f in files][:8]}; pass one file or add the index")
        if (path / "transformer").is_dir():
            return _resolve(path / "transformer")
        torch_files = sorted(f.name for f in path.iterdir() if f.suffix in TORCH_SUFFIXES)
        hint = f"; torch files here: {torch_files[:8]}, pass the generator's file itself" if torch_files else ""
        raise FileNotFoundError(f"{path}: no *.safetensors, *.safetensors.index.json or transformer/ folder "
                                f"in this folder{hint}")
    if path.name.endswith(".safetensors.index.json"):
        return "index", path
    if path.suffix == ".safetensors":
        return "safetensors", path
    if path.suffix in TORCH_SUFFIXES:
        return "torch", path
    raise ValueError(f"{path}: unknown checkpoint format: expected a folder, *.safetensors, "
                     f"*.safetensors.index.json or a torch file ({', '.join(TORCH_SUFFIXES)})")


def read_checkpoint(path: str | os.PathLike, *, ema: bool | None = None, allow_pickle: bool = False,
                    read_config: bool = True) -> Checkpoint:
    """The tensors (lazily) and ``config.json`` of a checkpoint in any of the module's formats.

    Args:
      path: a folder, a ``.safetensors`` file, a ``*.safetensors.index.json`` or a torch file.
      ema: for a torch file, see :func:`generator_state_dict`.
      allow_pickle: for a torch file, see :func:`arkv_jax.models.io.torch_load`.
      read_config: parse the ``config.json`` beside safetensors weights (``False``: ignore it).
    """
    kind, file = _resolve(Path(path))
    if kind == "torch":
        tensors, source = generator_state_dict(torch_load(file, allow_pickle=allow_pickle), ema=ema, source=str(file))
        return Checkpoint(tensors, None, source)
    tensors = read_safetensors(file) if kind == "safetensors" else read_sharded_safetensors(file)
    config_path = file.parent / "config.json"
    if not config_path.is_file():
        return Checkpoint(tensors, None, str(file))
    return Checkpoint(tensors, read_json(config_path) if read_config else None, str(file), str(config_path))


def read_lora(lora: str | os.PathLike | Mapping[str, Any], *, allow_pickle: bool = False) -> dict[str, LoraFactors]:
    """LoRA factors by official module name from a file (``.safetensors`` or a torch file holding
    ``generator_lora`` or a flat PEFT state dict, as LongLive's ``lora.pt``) or a mapping."""
    if isinstance(lora, Mapping):
        if lora and all(isinstance(v, LoraFactors) for v in lora.values()):
            return dict(lora)
        return lora_factors(lora.get("generator_lora", lora), source="LoRA state dict")
    path = Path(lora)
    if path.suffix == ".safetensors":
        return lora_factors(read_safetensors(path), source=str(path))
    if path.suffix not in TORCH_SUFFIXES:
        raise ValueError(f"{path}: unknown LoRA format: expected .safetensors or a torch file "
                         f"({', '.join(TORCH_SUFFIXES)})")
    obj = torch_load(path, allow_pickle=allow_pickle)
    source = str(path)
    if isinstance(obj, Mapping) and "generator_lora" in obj:
        obj, source = obj["generator_lora"], f"{path}['generator_lora']"
    return lora_factors(tensor_dict(obj, source), source=source)


# ------------------------------------------------------------------------------------------------
# Placement
# ------------------------------------------------------------------------------------------------


def place(plans: list[LeafPlan], tensors: Mapping[str, Any], config: DiTConfig, *, mesh: Mesh | None = None,
          model_axis: str = "model") -> CausalDiT:
    """Builds the model parameter by parameter: each converted and cast on the host
    (:func:`arkv_jax.models.convert.convert_leaf`), then put on the device(s) with its sharding,
    waiting for each transfer so that at most one converted parameter is in host memory.

    Args:
      mesh: place with :func:`tensor_parallel_specs` over ``model_axis`` (replicated over the other
        axes); ``None``: the default device.
    """
    graphdef, state = abstract(CausalDiT, config)
    shardings: dict[tuple[str, ...], Any] = {}
    if mesh is not None:
        size = int(mesh.shape[model_axis]) if model_axis in mesh.axis_names else 1
        specs = tensor_parallel_specs(state, size, model_axis)
        shardings = {path_names(p): NamedSharding(mesh, spec) for p, spec in
                     jax.tree_util.tree_leaves_with_path(specs, is_leaf=lambda x: isinstance(x, P))}
    by_path = {plan.path: plan for plan in plans}

    def fill(names, leaf):
        host = convert_leaf(by_path[names], tensors)
        return jax.block_until_ready(jax.device_put(host, shardings.get(names)))

    return build(graphdef, state, fill)


def from_state_dict(tensors: Mapping[str, Any], config: DiTConfig | None = None, *, dtype: str | None = None,
                    mesh: Mesh | None = None, model_axis: str = "model",
                    lora: Mapping[str, Any] | None = None, lora_alpha: float | None = None,
                    source: str = "state dict", grid: tuple[int, int] = WAN_480P_GRID,
                    text_tokens: int | None = None) -> CausalDiT:
    """A :class:`CausalDiT` from an in-memory state dict in any naming (official, diffusers,
    prefixed, PEFT-wrapped); see :func:`load_wan` for the arguments.

    ``config=None`` reads the shape off the tensors (:func:`arkv_jax.models.convert.config_from_shapes`).
    """
    if config is not None and dtype is not None:
        config = dataclasses.replace(config, dtype=dtype)
    factors = read_lora(lora) if lora is not None else None
    config_kw = dict(grid=grid, text_tokens=text_tokens or 512, dtype=dtype or "bfloat16")
    config, plans, base = prepare(tensors, config, source=source, lora=factors, lora_alpha=lora_alpha,
                                  config_kw=config_kw)
    return place(plans, base, config, mesh=mesh, model_axis=model_axis)


#: The fields of a :class:`DiTConfig` that a checkpoint's ``config.json`` fixes.
ARCHITECTURE_FIELDS = ("num_layers", "dim", "num_heads", "ffn_dim", "in_channels", "patch_size", "text_dim",
                       "freq_dim")


def _check_against_config_json(config: DiTConfig, path: Path) -> None:
    """An explicit ``config`` must describe the model of the ``config.json`` beside the weights
    where that file is a readable Wan config (the head count, for one, is not in the shapes)."""
    try:
        derived = config_from_json(read_json(path), source=str(path))
    except ValueError:
        return  # not a Wan transformer config: the explicit config is all there is
    diff = [f"{f}={getattr(derived, f)} (config: {getattr(config, f)})" for f in ARCHITECTURE_FIELDS
            if getattr(derived, f) != getattr(config, f)]
    if diff:
        raise ValueError(f"{path} describes a different model than config=: {', '.join(diff)}")


def load_wan(path: str | os.PathLike, config: DiTConfig | None = None, *, dtype: str | None = None,
             mesh: Mesh | None = None, model_axis: str = "model",
             lora: str | os.PathLike | Mapping[str, Any] | None = None, lora_alpha: float | None = None,
             ema: bool | None = None, grid: tuple[int, int] = WAN_480P_GRID, text_tokens: int | None = None,
             allow_pickle: bool = False) -> CausalDiT:
    """Loads a Wan 2.1 T2V checkpoint (official, diffusers, or a Self-Forcing / CausVid / LongLive
    ``.pt``) into a :class:`CausalDiT`.

    Args:
      path: see :func:`read_checkpoint`.
      config: the model shape; ``None``: from the checkpoint's ``config.json``
        (:func:`arkv_jax.models.convert.config_from_json`), or read off the tensor shapes for a
        ``.pt`` (:func:`arkv_jax.models.convert.config_from_shapes`). Given, it must agree with a
        readable Wan ``config.json`` beside the weights on :data:`ARCHITECTURE_FIELDS`.
      dtype: parameter / compute dtype (overrides ``config.dtype``); default ``config.dtype``, or
        ``"bfloat16"`` for a derived config. Float32 islands follow ``config.precision``.
      mesh, model_axis: place the parameters tensor-parallel on ``mesh`` (see :func:`place`).
      lora, lora_alpha: a LoRA to merge (LongLive's ``lora.pt``: rank 256, ``lora_alpha=256`` as its
        config sets, which is also the default ``alpha = r``); see :func:`read_lora` and
        :func:`arkv_jax.models.convert.merge_lora`.
      ema: which generator of a ``.pt`` (see :func:`generator_state_dict`).
      grid, text_tokens: tokens per frame and per prompt of a derived config (Wan 480x832: ``(30,
        52)``; 512 text tokens).
      allow_pickle: let ``torch.load`` unpickle arbitrary objects (trusted files only).

    Raises:
      FileNotFoundError: no checkpoint there.
      ImportError: a ``.pt`` without torch installed.
      KeyError: tensors missing or left over (listed, with the file).
      ValueError: a malformed file or config, shapes that do not fit ``config``, or a ``config``
        that contradicts the checkpoint's ``config.json``.
    """
    ckpt = read_checkpoint(path, ema=ema, allow_pickle=allow_pickle, read_config=config is None)
    if config is None and ckpt.config is not None:
        config = config_from_json(ckpt.config, grid=grid, text_tokens=text_tokens, dtype=dtype or "bfloat16",
                                  source=ckpt.config_source)
    elif config is not None and ckpt.config_source is not None:
        _check_against_config_json(config, Path(ckpt.config_source))
    factors = read_lora(lora, allow_pickle=allow_pickle) if lora is not None else None
    return from_state_dict(ckpt.tensors, config, dtype=dtype, mesh=mesh, model_axis=model_axis, lora=factors,
                           lora_alpha=lora_alpha, source=ckpt.source, grid=grid, text_tokens=text_tokens)
