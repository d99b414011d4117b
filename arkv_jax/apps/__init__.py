"""The ``arkv-jax`` applications' shared parts: what the commands measure and refuse.

The library (:mod:`arkv_jax`) never imports this package. See ``docs/demo.md``.
"""
