"""Input validation of :func:`pallas_kernels.paged_write.write_chunk`.

:func:`static_validate_inputs` checks what is known at trace time (backend name, ranks, shapes,
dtypes, frame size); ``write_chunk`` always calls it, and it accepts tracers and
``jax.ShapeDtypeStruct`` s. :func:`check_page_ids` checks the page ids' values under the
value-check rule of :mod:`pallas_kernels.common` (``validate=``); ``write_chunk`` calls it after
the static checks. :func:`dynamic_validate_inputs` is the static checks plus a stricter value check
on the host (no null page either). Every error is a ``ValueError`` (``TypeError`` for a non-array
argument or a ``tokens_per_frame`` that is not an int, :mod:`pallas_kernels.checks`) that names the
parameter, the bad value and the allowed range (``docs/kernels.md``, Validation).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from pallas_kernels.backend import resolve_backend
from pallas_kernels.checks import require_int
from pallas_kernels.common import (
    check_entries,
    check_pool_pair,
    check_rank,
    check_supported_dtype,
    check_validate,
    index_text,
    pages_per_frame,
    value_check_mode,
)
from pallas_kernels.layout import PAGE_AXIS, check_tpu_block_size, pool_geometry


def static_validate_inputs(k_pool, v_pool, k_new, v_new, page_ids, *, tokens_per_frame=None,
                           backend="auto") -> int:
    """Checks everything about a ``write_chunk`` call that does not depend on array values.

    Takes ``write_chunk``'s arguments; any array may be a tracer or a ``ShapeDtypeStruct``.

    Returns:
      ``tokens_per_frame`` resolved (the block size when ``None``).

    Raises:
      ValueError: an unknown backend; bad ranks, shapes or dtypes; a ``tokens_per_frame`` that is
        not a positive int or does not divide the chunk; ``page_ids`` not ``[rows, num_frames *
        pages_per_frame]`` integers; quantized pools that are malformed or mixed with a plain one.
      TypeError: an input that is not an array (``write_chunk`` itself takes ``page_ids`` as a list
        of ints).
    """
    resolved = resolve_backend(backend)
    quantized = check_pool_pair(k_pool, v_pool)
    for name, x in (("k_pool", k_pool), ("v_pool", v_pool), ("k_new", k_new), ("v_new", v_new)):
        check_rank(name, x, 5)
    if k_pool.shape != v_pool.shape or k_pool.dtype != v_pool.dtype:
        raise ValueError(f"k_pool and v_pool must match, got {k_pool.dtype}{list(k_pool.shape)} "
                         f"and {v_pool.dtype}{list(v_pool.shape)}")
    if not quantized:
        check_supported_dtype("pool dtype", k_pool.dtype)
    if k_new.shape != v_new.shape:
        raise ValueError(f"k_new and v_new must have the same shape, got {list(k_new.shape)} "
                         f"and {list(v_new.shape)}")
    for name, x in (("k_new", k_new), ("v_new", v_new)):
        if quantized:  # Quantized on the way in: the chunk comes in a compute dtype.
            check_supported_dtype(f"{name} dtype (the compute dtype a quantized pool is written from)",
                                  x.dtype)
        elif x.dtype != k_pool.dtype:
            raise ValueError(f"{name} dtype must be the pool dtype {k_pool.dtype} (cast it "
                             f"first), got {x.dtype}")
    if quantized and k_new.dtype != v_new.dtype:
        raise ValueError(f"k_new and v_new must have the same dtype, got {k_new.dtype} and {v_new.dtype}")
    pool = pool_geometry(k_pool)
    num_layers, num_pages, block_size = pool.num_layers, pool.num_pages, pool.block_size
    kv_heads, head_dim = pool.kv_heads, pool.head_dim
    if resolved.name == "pallas_tpu":  # The interpreters take any block size.
        check_tpu_block_size(block_size)
    if num_pages < 2:
        raise ValueError(f"the pools need the null page and at least one more, got "
                         f"num_pages={num_pages}")
    if k_new.shape[0] != num_layers or k_new.shape[3:] != (kv_heads, head_dim):
        raise ValueError(f"k_new/v_new must be [num_layers={num_layers}, rows, tokens, "
                         f"kv_heads={kv_heads}, head_dim={head_dim}], got {list(k_new.shape)}")
    if tokens_per_frame is None:
        tokens_per_frame = block_size
    tokens_per_frame = require_int("tokens_per_frame", tokens_per_frame, minimum=1, must="a positive int")
    rows, tokens = k_new.shape[1], k_new.shape[2]
    if tokens == 0 or tokens % tokens_per_frame:
        raise ValueError(f"the chunk's {tokens} tokens per row must be a positive multiple of "
                         f"tokens_per_frame={tokens_per_frame}")
    ppf = pages_per_frame(tokens_per_frame, block_size)
    expected = (rows, tokens // tokens_per_frame * ppf)
    if not (hasattr(page_ids, "shape") and hasattr(page_ids, "dtype")):
        raise TypeError(f"page_ids must be an integer array (int32), got {type(page_ids).__name__}")
    if jnp.ndim(page_ids) != 2 or tuple(jnp.shape(page_ids)) != expected:
        raise ValueError(f"page_ids must have shape [rows, num_frames * pages_per_frame] = "
                         f"{list(expected)} (tokens_per_frame={tokens_per_frame}, block_size="
                         f"{block_size}, pages_per_frame={ppf}), got {list(jnp.shape(page_ids))}")
    if not jnp.issubdtype(page_ids.dtype, jnp.integer):
        raise ValueError(f"page_ids must be integers (int32), got {page_ids.dtype}")
    return tokens_per_frame


def dynamic_validate_inputs(k_pool, v_pool, k_new, v_new, page_ids, *, tokens_per_frame=None,
                            backend="auto") -> None:
    """:func:`static_validate_inputs`, then the page ids read on the host: each in
    ``[1, num_pages)`` (not even the null page) and none repeated.

    ``page_ids`` must be concrete (a tracer raises ``jax.errors.TracerArrayConversionError``).
    Stricter than the check ``write_chunk`` runs by default (:func:`check_page_ids`), which lets 0
    stand for "skip" (padding rows, failed allocations).

    Raises:
      ValueError: as :func:`static_validate_inputs`, or a page id out of range or repeated.
    """
    static_validate_inputs(k_pool, v_pool, k_new, v_new, page_ids,
                           tokens_per_frame=tokens_per_frame, backend=backend)
    _check_ids(page_ids, pool_geometry(k_pool).num_pages, "host", allow_null=False)


def check_page_ids(page_ids, num_pages: int, *, validate=True) -> None:
    """The value check of ``write_chunk``'s ``page_ids`` for a pool of ``num_pages`` pages, under
    the rule of :mod:`pallas_kernels.common`: every id in ``[0, num_pages)`` and no id but the null
    page 0 (skip) named twice in the call. Checked on the host if ``page_ids`` is concrete (unless
    ``validate=False``), with ``checkify.check`` if it is traced and ``validate="checkify"``, else
    not at all.

    Raises:
      ValueError: ``validate`` is not ``True``, ``False`` or ``"checkify"``; a concrete id out of
        range or repeated.
    """
    check_validate(validate)
    _check_ids(page_ids, num_pages, value_check_mode(validate, page_ids), allow_null=True)


def _check_ids(page_ids, num_pages: int, mode: str | None, *, allow_null: bool) -> None:
    if mode is None:
        return
    low = 0 if allow_null else 1
    null = " (0, the null page, skips)" if allow_null else " (0 is the null page)"
    check_entries(mode, "page_ids", page_ids, lambda v: (v < low) | (v >= num_pages),
                  f"is not a {'' if allow_null else 'writable '}page id; allowed [{low}, {num_pages}){null}; "
                  f"k_pool.shape[{PAGE_AXIS}]={num_pages}")
    reason = ("a page may be written at most once per call"
              + (" (only the null page 0 may repeat)" if allow_null else ""))
    host = mode == "host"
    flat = (np.asarray(page_ids) if host else jnp.asarray(page_ids)).reshape(-1)
    if flat.shape[0] < 2:
        return
    shape = tuple(page_ids.shape)
    # Sorted stably, a repeated id sits next to its earlier occurrence.
    order = np.argsort(flat, kind="stable") if host else jnp.argsort(flat, stable=True)
    ranked = flat[order]
    repeat = (ranked[1:] == ranked[:-1]) & (ranked[1:] != 0)
    if host:
        if repeat.any():
            i = int(np.argmax(repeat))
            first, again = np.unravel_index(order[i], shape), np.unravel_index(order[i + 1], shape)
            raise ValueError(f"page_ids{index_text(again)}={flat[order[i + 1]]} repeats "
                             f"page_ids{index_text(first)}; {reason}")
        return
    i = jnp.argmax(repeat)
    first, again = jnp.unravel_index(order[i], shape), jnp.unravel_index(order[i + 1], shape)
    checkify.check(~jnp.any(repeat), "page_ids[{}, {}]={} repeats page_ids[{}, {}]; " + reason,
                   *again, flat[order[i + 1]], *first)
