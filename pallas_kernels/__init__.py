"""Pallas kernels for arkv-jax: paged chunk writes, paged window attention and context (text
cross-) attention (``docs/kernels.md``).

One package per kernel (:mod:`pallas_kernels.paged_write`, :mod:`pallas_kernels.window_attention`,
:mod:`pallas_kernels.context_attention`), each with its public function, explicit
``static_validate_inputs`` (the paged ones also ``dynamic_validate_inputs`` and a value check of
page ids and lengths, ``validate=``, one rule for both: :mod:`pallas_kernels.common`), one module
per backend and a reference (the plain XLA path for context attention). The backend is chosen with one ``backend=``
argument, a name of the registry (:mod:`pallas_kernels.backend`). The pool layout lives in
:mod:`pallas_kernels.layout`, the argument-type rule in :mod:`pallas_kernels.checks`, the other
shared rules in :mod:`pallas_kernels.common`. Kernels know pages and lengths, never sessions or
meshes.
"""

from pallas_kernels.backend import BACKEND_NAMES, BACKENDS, Backend, resolve_backend
from pallas_kernels.context_attention import context_attention
from pallas_kernels.paged_write import pages_per_frame, write_chunk, write_chunk_reference
from pallas_kernels.window_attention import window_attention, window_attention_reference

__all__ = [
    "BACKEND_NAMES", "BACKENDS", "Backend", "context_attention", "resolve_backend",
    "pages_per_frame", "write_chunk", "write_chunk_reference",
    "window_attention", "window_attention_reference",
]
