"""Checkpoint I/O shared by every loader in :mod:`arkv_jax.models` (the DiT, umT5 and the VAE): the
safetensors and torch readers, the dtype map, torch-to-NumPy conversion, the key and shape check,
parameter path names and host-side random initialisation.

Every loader reports a malformed file, a missing, left-over or misshapen tensor the same way,
naming the file and the tensor; see ``docs/models.md`` ("Checkpoint files").
"""

from __future__ import annotations

import json
import math
import os
import pickle
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

M = TypeVar("M", bound=nnx.Module)

#: safetensors dtype names and their NumPy dtypes (bfloat16 and float8 through ``ml_dtypes``).
SAFETENSORS_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}

#: File suffixes read as torch pickles.
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")

_TORCH_HINT = ("reading a torch checkpoint (.pt, .pth, .bin: Self-Forcing, CausVid, LongLive, Wan's own "
               "encoder and VAE files) needs PyTorch, which arkv-jax does not install by default: "
               "pip install 'arkv-jax[torch]' (any CPU build of torch will do); safetensors checkpoints "
               "load without it")


class CheckpointKeyError(KeyError):
    """A checkpoint's tensors do not match the model: some are missing or left over. A ``KeyError``
    whose message reads as it is written."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


# ------------------------------------------------------------------------------------------------
# Files
# ------------------------------------------------------------------------------------------------


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """``{name: read-only np.memmap view}`` of a ``.safetensors`` file (nothing read but its header;
    the format: an 8-byte little-endian header length, a JSON header of name -> dtype, shape and
    byte offsets, then the raw little-endian data).

    Raises:
      FileNotFoundError: no such file.
      ValueError: not a well-formed safetensors file: too short, a header that is not JSON, an
        entry of an unknown dtype or whose bytes do not fit the file (truncated), naming the file
        and the entry.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"safetensors file {path} does not exist")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file: {size} bytes, shorter than the 8-byte header length")
        n = int.from_bytes(head, "little")
        if n < 2 or 8 + n > size:
            raise ValueError(f"{path}: not a safetensors file: header length {n} does not fit a {size}-byte file")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not a safetensors file: its header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: malformed safetensors header: a JSON {type(header).__name__}, expected an object")
    header.pop("__metadata__", None)
    data_size = size - 8 - n
    data = np.memmap(path, np.uint8, "r", offset=8 + n) if data_size else np.zeros(0, np.uint8)
    out = {}
    for name, info in header.items():
        try:
            dtype = SAFETENSORS_DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: malformed safetensors entry {name!r}: {info!r} "
                             f"({type(exc).__name__}: {exc}); expected dtype in {sorted(SAFETENSORS_DTYPES)}, "
                             "shape and data_offsets") from None
        if not 0 <= begin <= end <= data_size or end - begin != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"{path}: malformed safetensors entry {name!r}: bytes [{begin}, {end}) for "
                             f"{info['dtype']} {list(shape)} in a {data_size}-byte data section (truncated file?)")
        out[name] = data[begin:end].view(dtype).reshape(shape)
    return out


def read_sharded_safetensors(index: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of the shards a ``*.safetensors.index.json`` lists (``weight_map``), lazily
    (:func:`read_safetensors` per shard).

    Raises:
      FileNotFoundError: the index or a shard is not there.
      ValueError: a malformed index or shard, a tensor missing from the shard the index names, or
        a tensor in two shards.
    """
    index = Path(index)
    if not index.is_file():
        raise FileNotFoundError(f"safetensors index {index} does not exist")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{index}: malformed safetensors index: expected JSON with a 'weight_map' of "
                         f"tensor name -> shard file ({type(exc).__name__}: {exc})") from None
    out: dict[str, np.ndarray] = {}
    for file in files:
        shard = index.parent / file
        if not shard.is_file():
            raise FileNotFoundError(f"{index}: lists shard {file}, which is not in {index.parent}")
        tensors = read_safetensors(shard)
        absent = [k for k, f in weight_map.items() if f == file and k not in tensors]
        if absent:
            raise ValueError(f"{index}: {len(absent)} tensors it places in {file} are not there: {sorted(absent)[:8]}")
        twice = sorted(set(tensors) & set(out))
        if twice:
            raise ValueError(f"{index}: tensors in more than one shard: {twice[:8]}")
        out.update(tensors)
    return out


def torch_load(path: str | os.PathLike, *, allow_pickle: bool = False) -> Any:
    """``torch.load`` on the CPU, memory-mapped where the file allows, ``weights_only`` unless
    ``allow_pickle`` (only for files you trust: a pickle runs code).

    Raises:
      ImportError: no torch (the message names the extra).
      FileNotFoundError: no such file.
      ValueError: the file is not a readable torch checkpoint (truncated, say), or needs
        ``allow_pickle=True``, naming the file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    try:
        import torch
    except ImportError as exc:
        raise ImportError(_TORCH_HINT) from exc
    kw = dict(map_location="cpu", weights_only=not allow_pickle)
    try:
        try:
            return torch.load(path, mmap=True, **kw)
        except RuntimeError as exc:
            if "mmap" not in str(exc) and "zip" not in str(exc).lower():
                raise
            return torch.load(path, **kw)  # the legacy (non-zip) format cannot be memory-mapped
    except pickle.UnpicklingError as exc:
        if allow_pickle:
            raise ValueError(f"{path}: not a torch checkpoint ({exc})") from None
        raise ValueError(f"{path}: torch.load(weights_only=True) refused it ({str(exc).splitlines()[0]}); "
                         "if you trust the file, pass allow_pickle=True") from None
    except (RuntimeError, EOFError, OSError) as exc:
        raise ValueError(f"{path}: not a readable torch checkpoint ({type(exc).__name__}: {exc})") from None


def is_tensor(value: Any) -> bool:
    """Whether ``value`` is a NumPy array or a torch tensor."""
    return isinstance(value, np.ndarray) or (type(value).__module__.startswith("torch") and hasattr(value, "shape"))


def tensor_dict(obj: Any, source: str) -> dict[str, Any]:
    """``obj`` as a state dict (name -> tensor).

    Raises:
      ValueError: ``obj`` is not a mapping, or some of its values are not tensors (listed, with the
        top-level keys, naming ``source``).
    """
    if not isinstance(obj, Mapping):
        raise ValueError(f"{source}: expected a dict of tensors, found {type(obj).__name__}")
    other = [k for k, v in obj.items() if not is_tensor(v)]
    if other:
        raise ValueError(f"{source}: expected a state dict (name -> tensor), but {len(other)} entries are not "
                         f"tensors: {sorted(map(str, other))[:8]}; top-level keys: {sorted(map(str, obj))[:8]}")
    return dict(obj)


def torch_state_dict(obj: Any, source: str) -> tuple[dict[str, Any], str]:
    """The state dict in a loaded torch checkpoint: ``obj["model"]``, else ``obj["state_dict"]``
    (where that is a dict), else ``obj`` itself.

    Returns:
      ``(state dict, source)`` with the entry's name appended to ``source``.

    Raises:
      ValueError: see :func:`tensor_dict`.
    """
    if not isinstance(obj, Mapping):
        raise ValueError(f"{source}: expected a dict, found {type(obj).__name__}")
    for key in ("model", "state_dict"):
        if isinstance(obj.get(key), Mapping):
            return tensor_dict(obj[key], f"{source}[{key!r}]"), f"{source}[{key!r}]"
    return tensor_dict(obj, source), source


def read_state_dict(path: str | os.PathLike, *, patterns: Sequence[str],
                    keep: Callable[[str], bool] | None = None) -> tuple[dict[str, np.ndarray], str]:
    """The tensors of one checkpoint file or directory as NumPy arrays by name, and the file(s) they
    come from (for messages).

    ``*.safetensors`` files go through :func:`read_safetensors` (memory-mapped views), torch files
    (:data:`TORCH_SUFFIXES`) through :func:`torch_load` and :func:`torch_state_dict`, then
    :func:`to_numpy`. A directory is read from all the files of the first of ``patterns`` that
    matches any (sharded checkpoints).

    Args:
      patterns: glob patterns tried in order for a directory.
      keep: the names to read (default: all), e.g. only a decoder's from a whole model's file.

    Returns:
      ``(tensors, source)``: ``source`` is the file, or ``directory/pattern`` for several.

    Raises:
      FileNotFoundError: nothing at ``path``, or a directory without weight files.
      ValueError: a file of an unknown kind, a malformed one, or a tensor in two files.
    """
    path = Path(path)
    if path.is_dir():
        for pattern in patterns:
            files = sorted(path.glob(pattern))
            if files:
                out: dict[str, np.ndarray] = {}
                for file in files:
                    tensors = _read_weight_file(file, keep)
                    twice = sorted(set(tensors) & set(out))
                    if twice:
                        raise ValueError(f"{file}: tensors also in another {pattern} file: {twice[:8]}")
                    out.update(tensors)
                return out, str(files[0]) if len(files) == 1 else str(path / pattern)
        raise FileNotFoundError(f"{path}: no weight files ({', '.join(patterns)}) in this directory")
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such checkpoint file")
    return _read_weight_file(path, keep), str(path)


def _read_weight_file(path: Path, keep: Callable[[str], bool] | None) -> dict[str, np.ndarray]:
    if path.suffix == ".safetensors":
        tensors = read_safetensors(path)
    elif path.suffix in TORCH_SUFFIXES:
        tensors, _ = torch_state_dict(torch_load(path), str(path))
    else:
        raise ValueError(f"{path}: unknown checkpoint kind (expected .safetensors or a torch file: "
                         f"{', '.join(TORCH_SUFFIXES)})")
    return {k: to_numpy(v) for k, v in tensors.items() if keep is None or keep(k)}


def read_json(path: str | os.PathLike) -> Any:
    """The parsed JSON file ``path``.

    Raises:
      ValueError: not valid JSON, naming the file.
    """
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None


def sibling_config(path: str | os.PathLike, accept: Callable[[dict], bool]) -> dict | None:
    """The ``config.json`` in directory ``path`` (or beside file ``path``) if there is one and
    ``accept`` takes it (a checkpoint directory can hold another model's config), else ``None``.

    Raises:
      ValueError: the ``config.json`` is not valid JSON (see :func:`read_json`).
    """
    path = Path(path)
    config_path = (path if path.is_dir() else path.parent) / "config.json"
    if not config_path.is_file():
        return None
    config = read_json(config_path)
    return config if isinstance(config, dict) and accept(config) else None


# ------------------------------------------------------------------------------------------------
# Tensors
# ------------------------------------------------------------------------------------------------


def shape_of(value: Any) -> tuple[int, ...]:
    """The shape of a NumPy array, torch tensor or array-like."""
    return tuple(int(d) for d in (value.shape if hasattr(value, "shape") else np.shape(value)))


def to_numpy(value: Any) -> np.ndarray:
    """A NumPy view (no copy where possible) of an array, torch tensor (bfloat16 kept as
    ``ml_dtypes.bfloat16``, not widened) or array-like."""
    if isinstance(value, np.ndarray):
        return value
    if type(value).__module__.startswith("torch"):
        import torch  # only reached with a torch tensor in hand

        value = value.detach().cpu()
        if value.dtype == torch.bfloat16:
            return value.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return value.numpy()
    return np.asarray(value)


def listing(names: Sequence[str], limit: int = 12) -> str:
    """The first ``limit`` of ``names`` sorted, comma-separated, with a count of the rest."""
    names = sorted(names)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def check_tensors(shapes: Mapping[str, Sequence[int]], expected: Mapping[str, Sequence[int]], *, source: str,
                  model: str, hint: Callable[[Sequence[str]], str] | None = None) -> None:
    """The one check of a checkpoint against a model: every expected tensor there, none left over,
    each of its expected shape (in the checkpoint's layout).

    Args:
      shapes: ``{key: shape}`` of the checkpoint's tensors (those the model should consume).
      expected: ``{key: shape}`` the model needs.
      source: the file(s), named first in every message.
      model: what the tensors should be parameters of (``"a 2-layer umT5 encoder"``).
      hint: a note on the left-over keys (``""`` for none), e.g. what kind of model they suggest.

    Raises:
      CheckpointKeyError: tensors missing or left over (both listed).
      ValueError: tensors of the wrong shape (all listed: ``key: [got], expected [shape]``).
    """
    missing = [k for k in expected if k not in shapes]
    unexpected = [k for k in shapes if k not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} tensors the model needs are missing: {listing(missing)}")
        if unexpected:
            note = hint(unexpected) if hint else ""
            parts.append(f"{len(unexpected)} tensors are left over (not parameters of {model}){note}: "
                         f"{listing(unexpected)}")
        raise CheckpointKeyError(f"{source}: " + "; ".join(parts))
    wrong = [f"{k}: {list(shapes[k])}, expected {list(shape)}" for k, shape in expected.items()
             if tuple(shapes[k]) != tuple(shape)]
    if wrong:
        raise ValueError(f"{source}: {len(wrong)} tensors do not have the shape the model config needs "
                         f"(a different model size? pass the matching config): {listing(wrong, 8)}")


# ------------------------------------------------------------------------------------------------
# Parameters
# ------------------------------------------------------------------------------------------------


def path_names(path) -> tuple[str, ...]:
    """The ``DictKey`` names of a pytree path into an ``nnx.State`` (``("blocks", "norm3", "scale")``)."""
    return tuple(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))


def abstract(module_type: Callable[..., M], config: Any) -> tuple[nnx.GraphDef, nnx.State]:
    """``(graphdef, abstract state)`` of ``module_type(config, rngs=...)``: parameter shapes and
    dtypes as ``jax.ShapeDtypeStruct`` leaves, nothing allocated (``nnx.eval_shape``)."""
    return nnx.split(nnx.eval_shape(lambda: module_type(config, rngs=nnx.Rngs(0))))


def build(graphdef: nnx.GraphDef, state: nnx.State,
          fill: Callable[[tuple[str, ...], jax.ShapeDtypeStruct], Any]) -> nnx.Module:
    """The module of ``graphdef`` whose every parameter is ``fill(path names, abstract leaf)``,
    called leaf by leaf in the state's order."""
    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(lambda p, leaf: fill(path_names(p), leaf), state))


def init_random(module_type: Callable[..., M], config: Any,
                draw: Callable[[tuple[str, ...], tuple[int, ...], np.random.Generator], np.ndarray],
                seed: int = 0) -> M:
    """``module_type(config)`` with random weights drawn on the host with NumPy (seeded, identical
    on every machine): each parameter is ``draw(path names, shape, rng)``, cast to its dtype.

    The constructors' ``nnx.Rngs`` initialisers are slow on XLA:CPU (JAX's random-number code
    compiles once per parameter shape); only the structure comes from the constructor, traced
    abstractly (:func:`abstract`).
    """
    graphdef, state = abstract(module_type, config)
    rng = np.random.default_rng(seed)
    return build(graphdef, state, lambda names, leaf: jnp.asarray(draw(names, tuple(leaf.shape), rng), leaf.dtype))
