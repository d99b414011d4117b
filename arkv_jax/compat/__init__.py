"""Compatibility layers: other systems' cache APIs on arkv-jax's functional core."""
