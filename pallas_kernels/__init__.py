"""Pallas kernels for arkv-jax: paged chunk writes and paged window attention.

Every kernel has a plain-XLA path, a Pallas TPU kernel, a Pallas GPU kernel and a pure-jnp reference,
chosen with one ``backend=`` argument (see :mod:`pallas_kernels.backend`). Kernels know pages and
lengths, never sessions.
"""

from pallas_kernels.backend import BACKEND_NAMES, Backend, resolve_backend
from pallas_kernels.paged_write import pages_per_frame, write_chunk, write_chunk_reference
from pallas_kernels.window_attention import window_attention, window_attention_reference

__all__ = [
    "BACKEND_NAMES", "Backend", "resolve_backend",
    "pages_per_frame", "write_chunk", "write_chunk_reference",
    "window_attention", "window_attention_reference",
]
