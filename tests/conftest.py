"""Shared pytest setup: tests run on the CPU with float32 matmuls at full precision.

The host backend stays JAX's default even where libtpu is installed (the TPU compile tests create
libtpu's compile-only devices explicitly). To run the compiled-device parameters on a GPU or TPU,
set ``JAX_PLATFORMS`` (e.g. ``cuda,cpu``), as ``benchmarks/device_check.sh`` does."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_num_cpu_devices", 8)  # multi-device tests (tests/test_sharding.py)

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _compile_caches_emptied_after_each_module():
    """Each test module's executables are dropped when it ends (``jax.clear_caches``). XLA:CPU
    maps about 18 memory regions per executable it keeps; the whole suite keeps thousands, and past
    the kernel's ``vm.max_map_count`` (65,530) a later compile crashes the process (SIGSEGV)."""
    yield
    jax.clear_caches()
