"""Paged chunk write: copy the clean K/V of one chunk per row into the rows' pages, in place.

:func:`write_chunk` is the entry point; its docstring tables the shapes. It checks the call
(:func:`static_validate_inputs`, then the page ids' values under ``validate=``:
:func:`check_page_ids`; :func:`dynamic_validate_inputs` is a stricter host check) and runs the
``backend=`` name's implementation from :data:`IMPLEMENTATIONS`, one module per backend: ``xla``
(a loop of page updates), ``tpu`` (HBM-to-HBM DMAs), ``gpu`` (Triton page copies) and ``xla_gpu``
(one scatter of whole pages). :func:`write_chunk_reference` is the pure-jnp reference. Semantics,
costs and each backend's design: ``docs/kernels.md`` (Paged chunk write).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from types import MappingProxyType

import jax

from pallas_kernels.backend import Backend, resolve_backend
from pallas_kernels.common import as_index_array, check_validate, pages_per_frame
from pallas_kernels.layout import is_quantized_pool, pool_geometry
from pallas_kernels.paged_write import gpu, tpu, tpu_quantized, xla, xla_gpu
from pallas_kernels.paged_write.reference import (
    chunk_frames,
    valid_page_ids,
    write_chunk_reference,
)
from pallas_kernels.paged_write.validation import (
    check_page_ids,
    dynamic_validate_inputs,
    static_validate_inputs,
)

__all__ = [
    "IMPLEMENTATIONS", "check_page_ids", "dynamic_validate_inputs", "pages_per_frame",
    "static_validate_inputs", "write_chunk", "write_chunk_reference",
]


def write_chunk(
    k_pool: jax.Array,
    v_pool: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    page_ids: jax.Array,
    *,
    tokens_per_frame: int | None = None,
    backend: str = "auto",
    validate: bool | str = True,
) -> tuple[jax.Array, jax.Array]:
    """Writes one chunk's K/V per row into the pages ``page_ids`` names, for all layers at once.

    Shapes (``L`` layers, ``H`` KV heads, ``P`` pages, ``S`` tokens per page (the block size),
    ``D`` head dim, ``R`` rows, ``F`` frames per chunk, ``T`` tokens per frame, ``ppf = ceil(T / S)``
    pages per frame):

    ================  ==========================  ======================================================
    ``k_pool``        ``[L, H, P, S, D]``         :func:`pallas_kernels.layout.pool_shape`; fp32, bf16 or
                                                  fp16, or a :class:`~pallas_kernels.layout.QuantizedPool`
                                                  (int8/fp8 values, f32 scales ``[L, H, P]``; every
                                                  backend); page 0 is the null page
    ``v_pool``        ``[L, H, P, S, D]``         ``k_pool``'s shape and dtype (and kind)
    ``k_new``         ``[L, R, F * T, H, D]``     the chunk's K, token-major, frame after frame; the
                                                  pools' dtype (no implicit cast: a mismatch raises), or
                                                  any of fp32/bf16/fp16 for a quantized pool (each page
                                                  is quantized with its own scale as it is written)
    ``v_new``         ``[L, R, F * T, H, D]``     ``k_new``'s shape and dtype
    ``page_ids``      integer ``[R, F * ppf]``    entry ``(r, f * ppf + j)``: the page receiving page
                                                  ``j`` of frame ``f`` of row ``r``, in ``[1, P)``, or
                                                  0 to skip (a nested list of ints is taken as int32)
    output            ``(k_pool, v_pool)``        the named pages replaced, all else bit-identical
    ================  ==========================  ======================================================

    A frame's last page is zero-padded. Id 0 (the null page) writes nothing and may repeat
    (padding rows, failed allocations); every other id is written at most once per call.
    Unchecked (traced, or ``validate=False``), an id outside ``[1, P)`` also skips and a page named
    twice ends up holding one of its writes, or on TPU/GPU possibly a mix of them. Call it inside a
    step jitted with ``donate_argnums`` for the pools, so the outputs alias them and only the
    chunk's bytes move.

    Args:
      k_pool, v_pool, k_new, v_new, page_ids: as tabled above.
      tokens_per_frame: ``T``; defaults to the block size ``S``.
      backend: a name from :data:`pallas_kernels.backend.BACKEND_NAMES` (the implementation run
        is ``IMPLEMENTATIONS[resolved name]``).
      validate: the value check of ``page_ids`` (:data:`pallas_kernels.common.VALIDATE_MODES`):
        ``True`` checks concrete ids on the host, ``False`` checks none, ``"checkify"`` also checks
        traced ids with ``checkify.check`` (run under ``checkify.checkify``). Static arguments are
        checked whatever it says.

    Returns:
      ``(k_pool, v_pool)`` with the named pages replaced (aliasing the inputs when donated).

    Raises:
      ValueError: what :func:`static_validate_inputs` rejects; with ``validate`` not ``False``,
        concrete page ids that are negative, ``>= P`` or repeated (other than 0). Nothing is
        written or donated then.
      TypeError: an input that is not an array (``page_ids`` may be a list of ints), a
        ``tokens_per_frame`` that is not an int (:mod:`pallas_kernels.checks`).
    """
    page_ids = as_index_array("page_ids", page_ids)
    check_validate(validate)
    tokens_per_frame = static_validate_inputs(k_pool, v_pool, k_new, v_new, page_ids,
                                              tokens_per_frame=tokens_per_frame, backend=backend)
    check_page_ids(page_ids, pool_geometry(k_pool).num_pages, validate=validate)
    return _write_chunk_jit(k_pool, v_pool, k_new, v_new, page_ids,
                            tokens_per_frame=tokens_per_frame,
                            backend_name=resolve_backend(backend).name)


@functools.partial(jax.jit, static_argnames=("tokens_per_frame", "backend_name"))
def _write_chunk_jit(k_pool, v_pool, k_new, v_new, page_ids, *, tokens_per_frame: int,
                     backend_name: str):
    backend = resolve_backend(backend_name)
    pool = pool_geometry(k_pool)
    num_pages, block_size = pool.num_pages, pool.block_size
    ids = valid_page_ids(page_ids, num_pages)
    k_frames = chunk_frames(k_new, tokens_per_frame)
    v_frames = chunk_frames(v_new, tokens_per_frame)
    ppf = pages_per_frame(tokens_per_frame, block_size)
    return IMPLEMENTATIONS[backend.name](k_pool, v_pool, k_frames, v_frames, ids, ppf, backend)


# The implementations of the registry, one signature (:data:`IMPLEMENTATIONS`).

def _xla(k_pool, v_pool, k_frames, v_frames, ids, ppf: int, backend: Backend):
    return xla.write_chunk(k_pool, v_pool, k_frames, v_frames, ids, ppf)


def _pallas_tpu(k_pool, v_pool, k_frames, v_frames, ids, ppf: int, backend: Backend):
    write = tpu_quantized.write_chunk if is_quantized_pool(k_pool) else tpu.write_chunk
    return write(k_pool, v_pool, k_frames, v_frames, ids, ppf, backend.interpret)


def _pallas_gpu(k_pool, v_pool, k_frames, v_frames, ids, ppf: int, backend: Backend):
    return gpu.write_chunk(k_pool, v_pool, k_frames, v_frames, ids, ppf, backend.interpret)


def _scatter(k_pool, v_pool, k_frames, v_frames, ids, ppf: int, backend: Backend):
    return xla_gpu.write_chunk(k_pool, v_pool, k_frames, v_frames, ids, ppf)


IMPLEMENTATIONS: Mapping[str, Callable[..., tuple[jax.Array, jax.Array]]] = MappingProxyType({
    "xla": _xla,
    "pallas_tpu": _pallas_tpu,
    "pallas_tpu_interpret": _pallas_tpu,
    "pallas_tpu_simulate": _pallas_tpu,
    "pallas_tpu_gather": _pallas_tpu,
    "pallas_tpu_gather_interpret": _pallas_tpu,
    "pallas_gpu": _pallas_gpu,
    "pallas_gpu_interpret": _pallas_gpu,
    "cudnn_gather": _scatter,
    "cudnn_gather_xla": _scatter,
    "pallas_mgpu": _scatter,
})
"""This kernel's table of the backend registry (:data:`pallas_kernels.backend.BACKENDS`, the same
names): backend name to implementation, each called inside the jitted write as ``impl(k_pool,
v_pool, k_frames, v_frames, ids, ppf, backend)`` (``k_frames``/``v_frames`` the unpadded chunk
as ``[L, R * F, T, H, D]``; ``ids`` flat int32 ``[R * F * ppf]`` with every entry outside
``[1, P)`` set to 0; ``ppf`` pages per frame; ``backend`` the resolved :class:`~pallas_kernels.backend.Backend`),
returning ``(k_pool, v_pool)``."""
