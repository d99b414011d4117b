"""Pallas kernels for arkv-jax: paged chunk writes and paged window attention.

One package per kernel (:mod:`pallas_kernels.paged_write`, :mod:`pallas_kernels.window_attention`),
each with its public function, explicit ``static_validate_inputs`` / ``dynamic_validate_inputs``
and a value check (page ids, lengths) that runs by default on concrete values (``validate=``, one
rule for both kernels, :mod:`pallas_kernels.common`), one module per backend (``xla``, ``tpu``,
``gpu`` (Triton); for attention also ``cudnn_gather`` and ``mosaic_gpu``, for the write
``xla_gpu``) and a pure-jnp ``reference``; the backend is chosen with one ``backend=`` argument
(the registry of :mod:`pallas_kernels.backend`: one name per platform path and the platform it
needs, and each kernel's ``IMPLEMENTATIONS`` table over the same names). Rules they share live in
:mod:`pallas_kernels.common`. Kernels know pages and lengths, never sessions or meshes.
"""

from pallas_kernels.backend import BACKEND_NAMES, BACKENDS, Backend, resolve_backend
from pallas_kernels.paged_write import pages_per_frame, write_chunk, write_chunk_reference
from pallas_kernels.window_attention import window_attention, window_attention_reference

__all__ = [
    "BACKEND_NAMES", "BACKENDS", "Backend", "resolve_backend",
    "pages_per_frame", "write_chunk", "write_chunk_reference",
    "window_attention", "window_attention_reference",
]
