"""Pallas kernels for arkv-jax: paged chunk writes and paged window attention.

Every kernel has a plain-XLA path, a Pallas TPU kernel, a Pallas GPU kernel and a pure-jnp reference,
chosen with one ``backend=`` argument (see :mod:`pallas_kernels.backend`). Kernels know pages and
lengths, never sessions.
"""

from pallas_kernels.backend import BACKEND_NAMES, Backend, resolve_backend

__all__ = ["BACKEND_NAMES", "Backend", "resolve_backend"]
