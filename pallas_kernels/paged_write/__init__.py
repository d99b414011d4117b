"""Paged chunk write: copy the clean K/V of one chunk per row into the rows' pages, in place.

Shapes (``L`` layers, ``P`` pages, ``S`` tokens per page = block size, ``H`` KV heads, ``D`` head
dim, ``R`` rows, ``F`` frames per chunk, ``T`` tokens per frame):

================  =====================================  ===========================================
``k_pool``        ``[L, H, P, S, D]``                    :func:`pallas_kernels.layout.pool_shape`;
                                                         a page = ``S * D`` elements per layer, head
``v_pool``        ``[L, H, P, S, D]``                    same shape and dtype as ``k_pool``
``k_new``         ``[L, R, F * T, H, D]``                the chunk's K, token-major (the model's
                                                         layout), frame-major, pool dtype
``v_new``         ``[L, R, F * T, H, D]``                same shape and dtype as ``k_new``
``page_ids``      ``int32 [R, F * ceil(T / S)]``         physical page of each (row, frame, page)
================  =====================================  ===========================================

A frame takes ``pages_per_frame = ceil(T / S)`` consecutive entries of its row's page list; the last
page of a frame is padded with zeros (the padding tokens are written as zeros). Page 0 is the null
page: it is never written. Every write is a whole-page copy (all layers and heads of a page at
once); pages
not named in ``page_ids`` stay bit-identical.

Skip semantics: an entry equal to 0 (the null page) writes nothing; padding rows and failed
allocations use 0, and 0 may repeat. Every other entry names a page in ``[1, P)`` written once per
call.

Validation (the rule of :mod:`pallas_kernels.common`, one ``validate=`` argument):

* always, traced or not: :func:`static_validate_inputs` (shapes, dtypes, ``tokens_per_frame``);
* concrete ``page_ids`` (an eager call, a NumPy array, a list, a constant closed over by a jitted
  function), by default: :func:`check_page_ids` reads them on the host and refuses negative ids,
  ids ``>= P`` and an id other than 0 named twice, before anything runs: a refused call raises
  ``ValueError`` and leaves the pools as they were (valid, undonated, unchanged);
* traced ``page_ids`` (under ``jit``, ``vmap``, ``shard_map``): not checked, nothing is added to the
  compiled program. Every backend still skips ids outside ``[1, P)`` (never writes out of bounds);
  a page named twice ends up holding one of its writes, or on TPU/GPU possibly a mix of them. Pass
  ``validate="checkify"`` and run the jitted caller under ``jax.experimental.checkify``
  (``err, out = checkify.checkify(jax.jit(step))(...)``, then ``err.throw()``) to have them
  checked.

``validate=False`` turns the value check off (eager hot loops: the host check costs a
device-to-host copy and a sync per call); static checks still run. :func:`dynamic_validate_inputs`
is a stricter host check (the null page refused too).

In place: call it inside a jitted step that donates the pools,
``jax.jit(step, donate_argnums=(0, 1))``; the outputs then alias the pools and a write moves only
the chunk's bytes (``2 * L * R * F * ceil(T / S) * S * H * D * itemsize``, plus on the Pallas backends a head-major
copy of the chunk that XLA usually folds away). Without donation XLA
copies both pools first.

Backends (``backend=``, the registry of :mod:`pallas_kernels.backend`, which also gives the
platform each name needs): :data:`IMPLEMENTATIONS` maps every backend name to this kernel's
implementation, one module each: ``xla`` (:mod:`~pallas_kernels.paged_write.xla`, a loop of page
updates, the CPU default), ``pallas_tpu*`` and ``pallas_tpu_gather*``
(:mod:`~pallas_kernels.paged_write.tpu`, HBM-to-HBM DMAs), ``pallas_gpu*``
(:mod:`~pallas_kernels.paged_write.gpu`, Triton vector copies) and the other NVIDIA GPU paths,
``cudnn_gather*`` and ``pallas_mgpu`` (also ``"auto"`` on GPU),
:mod:`~pallas_kernels.paged_write.xla_gpu` (one XLA scatter of whole pages per pool). The loop and
the Pallas kernels read the chunk's frames (the Pallas ones head-major) and write a frame's padding
from zeros; the scatter pads its updates. :func:`write_chunk_reference`
(:mod:`~pallas_kernels.paged_write.reference`) is the pure-jnp reference they are tested against.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from types import MappingProxyType

import jax

from pallas_kernels.backend import Backend, resolve_backend
from pallas_kernels.common import as_index_array, check_validate, pages_per_frame
from pallas_kernels.layout import pool_geometry
from pallas_kernels.paged_write import gpu, tpu, xla, xla_gpu
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

    Args:
      k_pool, v_pool: ``[L, H, P, S, D]`` pools (:func:`pallas_kernels.layout.pool_shape`; fp32,
        bf16 or fp16), page 0 the null page.
      k_new, v_new: ``[L, R, F * T, H, D]``, the pools' dtype (no implicit cast: a mismatch raises).
      page_ids: integer ``[R, F * ceil(T / S)]`` (a nested list of ints is taken as int32); entry
        ``(r, f * ppf + j)`` is the physical page of row ``r``, frame ``f``, page ``j`` of the
        frame, in ``[1, P)``, or 0 to skip. Unchecked (traced, or ``validate=False``), an id
        outside ``[1, P)`` also skips and a page named twice ends up holding one of its writes, or
        on TPU/GPU possibly a mix of them; no other page is touched.
      tokens_per_frame: ``T``; defaults to the block size ``S``.
      backend: a name from :data:`pallas_kernels.backend.BACKEND_NAMES` (the implementation run
        is ``IMPLEMENTATIONS[resolved name]``).
      validate: the value check of ``page_ids`` (the module docstring): ``True`` checks concrete
        ids on the host, ``False`` checks none, ``"checkify"`` also checks traced ids with
        ``checkify.check`` (run under ``checkify.checkify``). Static arguments are checked
        whatever it says.

    Returns:
      ``(k_pool, v_pool)`` with the named pages replaced (aliasing the inputs when donated).

    Raises:
      ValueError: what :func:`static_validate_inputs` rejects; with ``validate`` not ``False``,
        concrete page ids that are negative, ``>= P`` or repeated (other than 0). Nothing is
        written or donated then.
      TypeError: an input that is not an array (``page_ids`` may be a list of ints).
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
    return tpu.write_chunk(k_pool, v_pool, k_frames, v_frames, ids, ppf, backend.interpret)


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
