"""The backend registry: one name per platform path, the platform it needs, one table per kernel.

* Every kernel's ``IMPLEMENTATIONS`` table has exactly the registry's names, each table one
  signature, its entries private; the backend table of ``docs/kernels.md`` documents every name for
  every kernel.
* Every backend records the platform it needs; the interpreters and the plain-XLA paths need none,
  every compiled kernel one, and a stand-in runs the same path anywhere.
* Every name the registry says runs here runs every kernel (the compiled ones where their device
  is); the dispatchers run the table's entry, and ``check_backend`` (the commands' up-front refusal)
  follows the registry: change an entry's platform and the refusal changes with it.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pathlib
import re
from types import MappingProxyType

import jax.numpy as jnp
import numpy as np
import pytest

from arkv_jax.apps import platforms
from pallas_kernels import backend as backend_module
from pallas_kernels.backend import BACKEND_NAMES, BACKENDS, Backend, resolve_backend
from pallas_kernels.layout import pool_shape
from tests.kernels.device_backends import compiled

ATTENTION = importlib.import_module("pallas_kernels.window_attention")
WRITE = importlib.import_module("pallas_kernels.paged_write")
CONTEXT = importlib.import_module("pallas_kernels.context_attention")
CONV = importlib.import_module("pallas_kernels.causal_conv")
UPSAMPLE = importlib.import_module("pallas_kernels.upsample_conv")
KERNELS = {"window_attention": ATTENTION, "paged_write": WRITE, "context_attention": CONTEXT, "causal_conv": CONV,
           "upsample_conv": UPSAMPLE}
#: The DiT block's kernels: a Mosaic kernel on the TPU names, XLA on every other (not in the docs'
#: backend table, which lists the kernels with a path per platform).
BLOCK_KERNELS = {name: importlib.import_module(f"pallas_kernels.{name}")
                 for name in ("qkv_projection", "cross_query", "adaln_mlp")}
PLATFORMS = ("cpu", "gpu", "tpu")


@pytest.mark.parametrize("kernel", list(KERNELS) + list(BLOCK_KERNELS))
def test_each_kernel_has_one_implementation_per_registry_name(kernel):
    table = {**KERNELS, **BLOCK_KERNELS}[kernel].IMPLEMENTATIONS
    assert list(table) == list(BACKENDS) == list(BACKEND_NAMES[1:])
    assert "auto" not in table
    signatures = {inspect.signature(impl) for impl in table.values()}
    assert len(signatures) == 1, f"{kernel}: the implementations take different arguments"
    assert all(impl.__name__.startswith("_") for impl in table.values())
    with pytest.raises(TypeError):
        table["xla"] = table["xla"]  # read only


def test_the_docs_table_documents_every_name_for_every_kernel():
    """One row per name, in the registry's order, with every kernel's column and the platform."""
    docs = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "kernels.md").read_text()
    rows = re.findall(r'^\| `"(\w+)"` \|(.*)\|$', docs, flags=re.M)
    assert [name for name, _ in rows] == list(BACKEND_NAMES)
    for name, cells in rows:
        assert len([c for c in cells.split("|") if c.strip()]) == len(KERNELS) + 1, name
    assert "docs/kernels.md" in backend_module.__doc__


@pytest.mark.parametrize("name", list(BACKENDS))
def test_each_backend_records_its_platform(name):
    entry = BACKENDS[name]
    assert entry.name == name and resolve_backend(name) is entry
    assert entry.platform in (None, "tpu", "gpu")
    assert (entry.platform is None) == (entry.device == "")
    stand_ins = {other.stand_in[0] for other in BACKENDS.values() if other.stand_in is not None}
    if entry.mode != "compiled" or entry.kind == "xla" or name in stand_ins:
        assert entry.platform is None, "an interpreter, plain XLA or a stand-in runs anywhere"
    else:
        assert entry.platform is not None, "a compiled kernel needs its device"
    if entry.stand_in is not None:
        stand_in = BACKENDS[entry.stand_in[0]]
        assert entry.platform is not None and stand_in.platform is None
        assert stand_in.kind == entry.kind  # the same path


def test_runs_on_follows_the_platform():
    assert all(BACKENDS["xla"].runs_on(p) for p in (*PLATFORMS, "cuda"))
    assert BACKENDS["pallas_gpu"].runs_on("gpu") and BACKENDS["pallas_gpu"].runs_on("cuda")
    assert not BACKENDS["pallas_gpu"].runs_on("cpu") and not BACKENDS["pallas_gpu"].runs_on("tpu")
    assert BACKENDS["pallas_tpu"].runs_on("tpu") and not BACKENDS["pallas_tpu"].runs_on("gpu")


def test_an_entry_is_checked():
    with pytest.raises(ValueError, match="mode must be one of"):
        Backend("x", "xla", mode="fast")
    with pytest.raises(ValueError, match="device words go with a platform"):
        Backend("x", "xla", platform="tpu")


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("name", BACKEND_NAMES)
def test_check_backend_refuses_what_the_registry_says_does_not_run_here(name, platform):
    resolved = resolve_backend(name, platform)
    if resolved.runs_on(platform):
        platforms.check_backend(name, platform)
        return
    assert name != "auto"  # "auto" resolves to a backend of the platform
    with pytest.raises(ValueError) as error:
        platforms.check_backend(name, platform)
    message = str(error.value)
    assert message.startswith(f"--backend {name}: the compiled kernel needs {resolved.device}, and "
                              f"this run's devices are {platform}; use --backend xla")
    if resolved.stand_in is not None:
        assert message.endswith(f" or --backend {resolved.stand_in[0]} ({resolved.stand_in[1]})")


def test_check_backend_asks_the_registry(monkeypatch):
    platforms.check_backend("xla", "cpu")
    platforms.check_backend("pallas_gpu", "gpu")
    changed = dict(BACKENDS)
    changed["xla"] = dataclasses.replace(BACKENDS["xla"], platform="tpu", device="a made-up chip")
    changed["pallas_gpu"] = dataclasses.replace(BACKENDS["pallas_gpu"], platform=None, device="",
                                                stand_in=None)
    monkeypatch.setattr(backend_module, "BACKENDS", MappingProxyType(changed))
    with pytest.raises(ValueError, match="^--backend xla: the compiled kernel needs a made-up chip, "
                                         "and this run's devices are cpu"):
        platforms.check_backend("xla", "cpu")
    platforms.check_backend("pallas_gpu", "cpu")


def test_window_attention_runs_the_table_entry(monkeypatch):
    calls = []

    def fake(*args, geom, scale, block_q, block_k, backend, rope, qk_norm):
        calls.append((len(args), geom.head_dim, scale, block_q, block_k, backend, rope, qk_norm))
        return args[0]

    monkeypatch.setattr(ATTENTION, "IMPLEMENTATIONS",
                        MappingProxyType({**ATTENTION.IMPLEMENTATIONS, "cudnn_gather_xla": fake}))
    q = jnp.ones((1, 2, 1, 8), jnp.float32)
    pool = jnp.zeros(pool_shape(1, 2, 4, 1, 8), jnp.float32)
    out = ATTENTION.window_attention(q, q, q, pool, pool, jnp.zeros((1, 1), jnp.int32),
                                     jnp.zeros((1,), jnp.int32), backend="cudnn_gather_xla",
                                     block_k=4)
    assert out is q
    assert calls == [(10, 8, 8 ** -0.5, None, 4, BACKENDS["cudnn_gather_xla"], None, None)]


def _registry_params():
    return [compiled(name) if resolve_backend(name).platform else name for name in BACKEND_NAMES]


def _tiny_inputs():
    """bf16, head dim 64, one frame per 64-token page (a case every backend takes): two rows, one
    with a frame of history, one with none."""
    rng = np.random.default_rng(0)

    def normal(*shape):
        return jnp.asarray(rng.normal(size=shape), jnp.bfloat16)

    shape = pool_shape(1, 6, 64, 1, 64)
    pool_k, pool_v = normal(*shape), normal(*shape)
    return dict(q=normal(2, 64, 2, 64), k_cur=normal(2, 64, 1, 64), v_cur=normal(2, 64, 1, 64),
                k_pool=pool_k, v_pool=pool_v, pages=jnp.asarray([[3, 0], [0, 0]], jnp.int32),
                lengths=jnp.asarray([64, 0], jnp.int32))


@pytest.mark.slow
@pytest.mark.parametrize("name", _registry_params())
def test_every_registry_name_runs_every_kernel(name):
    """What the registry says runs here does: each name's attentions and causal convolution match
    their references, its write the reference bit for bit."""
    inputs = _tiny_inputs()
    out = ATTENTION.window_attention(**inputs, backend=name)
    want = ATTENTION.window_attention_reference(**inputs)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                               atol=3e-2, rtol=3e-2)
    k_new = jnp.ones((1, 2, 64, 1, 64), jnp.bfloat16)
    ids = jnp.asarray([[2], [0]], jnp.int32)
    args = (inputs["k_pool"], inputs["v_pool"], k_new, -k_new, ids)
    for got, expected in zip(WRITE.write_chunk(*args, backend=name),
                             WRITE.write_chunk_reference(*args), strict=True):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(expected, np.float32))
    q, k = inputs["q"], inputs["k_cur"]
    np.testing.assert_allclose(np.asarray(CONTEXT.context_attention(q, k, -k, backend=name), np.float32),
                               np.asarray(CONTEXT.xla.attention(q, k, -k), np.float32), atol=3e-2, rtol=3e-2)
    rng = np.random.default_rng(1)
    frames, kernel, bias = (jnp.asarray(rng.normal(size=shape) * scale, jnp.bfloat16) for shape, scale in
                            (((3, 5, 8, 16), 1.0), ((3, 3, 3, 16, 8), 0.05), ((8,), 1.0)))
    conv = CONV.causal_conv3d(frames[2:], frames[:2], kernel, bias, backend=name)
    want = CONV.xla.causal_conv3d(frames[2:], frames[:2], kernel, bias)
    for got, expected in zip(conv, want, strict=True):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected, np.float32), atol=5e-2, rtol=3e-2)
