"""Shared pytest setup: tests run on the CPU with float32 matmuls at full precision."""

import jax

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_num_cpu_devices", 8)  # multi-device tests (tests/test_sharding.py)
