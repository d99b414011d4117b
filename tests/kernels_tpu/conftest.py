"""TPU-kernel tests run on the host CPU even where libtpu is installed (its compile-only devices are
created explicitly by the compile tests): the host backend stays JAX's default."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])
