"""One checkpoint behaviour for every loader (arkv_jax.models.io): the DiT (:func:`load_wan`), umT5
(:func:`load_umt5`) and the VAE decoder (:func:`load_wan_vae`) refuse a truncated file, a header that
is not JSON, an entry of an unknown dtype, a missing, a left-over and a misshapen tensor with the
same message, naming the file and the tensor (and for shapes the shape found and the one expected).

Tiny random checkpoints are written under ``tmp_path``: safetensors by hand (no torch needed), torch
files with ``torch.save`` where torch is installed.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable

import jax
import numpy as np
import pytest
from flax import nnx

from arkv_jax.models import init_random, load_umt5, load_wan, load_wan_vae, umt5, vae
from tests.models.test_umt5 import tiny_hf_state
from tests.models.test_vae import SMALL
from tests.models.wan_reference import WAN_TINY, export_official, write_safetensors


def _vae_state(config) -> dict[str, np.ndarray]:
    """A random decoder in diffusers' ``AutoencoderKLWan`` names and layouts (conv weights
    ``[out, in, k...]``, the attention's 1x1 convolutions ``[out, in, 1, 1]``, gains ``[C, 1, 1, 1]``
    or ``[C, 1, 1]`` in the attention)."""
    _, state = nnx.split(vae.init_random(config, seed=1))
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        names = [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]
        value = np.asarray(leaf, np.float32)
        key = vae._diffusers_name(names)
        if names[-1] == "gamma":
            value = value.reshape(-1, 1, 1) if names[0] == "mid_attention" else value.reshape(-1, 1, 1, 1)
        elif value.ndim == 2:
            value = value.T[:, :, None, None]
        elif value.ndim > 2:
            value = np.transpose(value, (value.ndim - 1, value.ndim - 2, *range(value.ndim - 2)))
        out[key] = np.ascontiguousarray(value)
    return out


@dataclasses.dataclass(frozen=True)
class Loader:
    """A loader and a valid tiny checkpoint for it."""

    name: str
    tensors: Callable[[], dict[str, np.ndarray]]
    load: Callable
    key: str  # a tensor to drop or misshape
    extra: str  # a tensor the model does not have


LOADERS = [
    Loader("dit", lambda: export_official(init_random(WAN_TINY, seed=0)), lambda p: load_wan(p, WAN_TINY),
           "blocks.1.norm3.bias", "head.extra.weight"),
    # The extra tensor of issue #21.3: a bias umT5 does not have, which the loader used to skip.
    Loader("umt5", lambda: tiny_hf_state(umt5.UMT5_CONFIGS["tiny"]), load_umt5,
           "encoder.block.1.layer.1.DenseReluDense.wo.weight", "encoder.block.0.layer.0.SelfAttention.q.bias"),
    Loader("vae", lambda: _vae_state(SMALL), lambda p: load_wan_vae(p, SMALL),
           "decoder.conv_out.weight", "decoder.mid_block.attentions.1.norm.gamma"),
]


@pytest.fixture(params=LOADERS, ids=lambda loader: loader.name)
def loader(request) -> Loader:
    return request.param


def _write(path, tensors: dict[str, np.ndarray]) -> None:
    if path.suffix == ".safetensors":
        write_safetensors(path, tensors)
    else:
        torch = pytest.importorskip("torch")
        torch.save({k: torch.from_numpy(np.array(v)) for k, v in tensors.items()}, path)


def _file(tmp_path, kind: str):
    if kind == "pt":
        pytest.importorskip("torch")
    return tmp_path / ("ckpt.safetensors" if kind == "safetensors" else "ckpt.pth")


def _names(path) -> str:
    """A pattern for ``path`` at the start of a message."""
    return "^" + re.escape(str(path)) + ": "


@pytest.mark.parametrize("kind", ["safetensors", "pt"])
def test_valid_checkpoint_loads(loader, kind, tmp_path):
    path = _file(tmp_path, kind)
    _write(path, loader.tensors())
    loader.load(path)


def test_vae_state_round_trips():
    """The VAE helper's layouts are the loader's: the loaded decoder is the one exported."""
    state = _vae_state(SMALL)
    loaded = vae.from_diffusers_state_dict(state, SMALL)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(vae.init_random(SMALL, seed=1))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_truncated_safetensors_names_the_file_and_the_tensor(loader, tmp_path):
    path = tmp_path / "ckpt.safetensors"
    tensors = loader.tensors()
    write_safetensors(path, tensors)
    raw = path.read_bytes()
    path.write_bytes(raw[:-4])  # the last tensor (in name order) loses its last bytes
    last = sorted(tensors)[-1]
    with pytest.raises(ValueError, match=_names(path) + f"malformed safetensors entry {re.escape(repr(last))}: "
                                         r"bytes .* \(truncated file\?\)$"):
        loader.load(path)


def test_header_that_is_not_json_names_the_file(loader, tmp_path):
    path = tmp_path / "ckpt.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(ValueError, match=_names(path) + "not a safetensors file: its header is not JSON"):
        loader.load(path)


def test_unknown_dtype_names_the_file_and_the_tensor(loader, tmp_path):
    path = tmp_path / "ckpt.safetensors"
    write_safetensors(path, loader.tensors())
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header[loader.key]["dtype"] = "C64"  # complex64: no model weight, and not in the reader's dtype map
    edited = json.dumps(header).encode()
    assert len(edited) <= n
    path.write_bytes(raw[:8] + edited.ljust(n) + raw[8 + n:])
    with pytest.raises(ValueError, match=_names(path) + f"malformed safetensors entry {re.escape(repr(loader.key))}"):
        loader.load(path)


@pytest.mark.parametrize("kind", ["safetensors", "pt"])
@pytest.mark.parametrize("case", ["missing", "left over"])
def test_missing_and_left_over_tensors_are_named(loader, kind, case, tmp_path):
    path = _file(tmp_path, kind)
    tensors = loader.tensors()
    if case == "missing":
        del tensors[loader.key]
        message = f"1 tensors the model needs are missing: {re.escape(loader.key)}$"
    else:
        tensors[loader.extra] = np.zeros(4, np.float32)
        message = rf"1 tensors are left over \(not parameters of .*\): {re.escape(loader.extra)}$"
    _write(path, tensors)
    with pytest.raises(KeyError, match=_names(path) + message):
        loader.load(path)


@pytest.mark.parametrize("kind", ["safetensors", "pt"])
def test_wrong_shape_is_named_with_the_expected_one(loader, kind, tmp_path):
    path = _file(tmp_path, kind)
    tensors = loader.tensors()
    expected = list(tensors[loader.key].shape)
    got = [*expected[:-1], expected[-1] + 1]
    tensors[loader.key] = np.zeros(got, np.float32)
    _write(path, tensors)
    with pytest.raises(ValueError, match=_names(path) + "1 tensors do not have the shape the model config needs .*: "
                                         f"{re.escape(loader.key)}: {re.escape(str(got))}, "
                                         f"expected {re.escape(str(expected))}$"):
        loader.load(path)


def test_truncated_torch_file_names_the_file(loader, tmp_path):
    path = _file(tmp_path, "pt")
    _write(path, loader.tensors())
    path.write_bytes(path.read_bytes()[:-64])
    with pytest.raises(ValueError, match=_names(path) + "not a readable torch checkpoint"):
        loader.load(path)
