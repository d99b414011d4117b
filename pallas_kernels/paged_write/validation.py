"""Input validation of :func:`pallas_kernels.paged_write.write_chunk`.

:func:`static_validate_inputs` checks what is known at trace time (backend name, ranks, shapes,
dtypes, frame size); ``write_chunk`` always calls it, and it accepts tracers and
``jax.ShapeDtypeStruct`` s. :func:`dynamic_validate_inputs` also checks the page ids' values; it
needs concrete ids, so eager callers call it themselves. Every error is a ``ValueError`` that names
the parameter, the bad value and the allowed range.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels.backend import resolve_backend
from pallas_kernels.common import check_rank, check_supported_dtype, pages_per_frame
from pallas_kernels.layout import check_tpu_block_size, pool_geometry


def static_validate_inputs(k_pool, v_pool, k_new, v_new, page_ids, *, tokens_per_frame=None,
                           backend="auto") -> int:
    """Checks everything about a ``write_chunk`` call that does not depend on array values.

    Takes ``write_chunk``'s arguments; any array may be a tracer or a ``ShapeDtypeStruct``.

    Returns:
      ``tokens_per_frame`` resolved (the block size when ``None``).

    Raises:
      ValueError: an unknown backend; bad ranks, shapes or dtypes; a ``tokens_per_frame`` that is
        not a positive int or does not divide the chunk; ``page_ids`` not ``[rows, num_frames *
        pages_per_frame]`` integers.
    """
    resolved = resolve_backend(backend)
    for name, x in (("k_pool", k_pool), ("v_pool", v_pool), ("k_new", k_new), ("v_new", v_new)):
        check_rank(name, x, 5)
    if k_pool.shape != v_pool.shape or k_pool.dtype != v_pool.dtype:
        raise ValueError(f"k_pool and v_pool must match, got {k_pool.dtype}{list(k_pool.shape)} "
                         f"and {v_pool.dtype}{list(v_pool.shape)}")
    check_supported_dtype("pool dtype", k_pool.dtype)
    if k_new.shape != v_new.shape:
        raise ValueError(f"k_new and v_new must have the same shape, got {list(k_new.shape)} "
                         f"and {list(v_new.shape)}")
    for name, x in (("k_new", k_new), ("v_new", v_new)):
        if x.dtype != k_pool.dtype:
            raise ValueError(f"{name} dtype must be the pool dtype {k_pool.dtype} (cast it "
                             f"first), got {x.dtype}")
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
    if (isinstance(tokens_per_frame, bool) or not isinstance(tokens_per_frame, (int, np.integer))
            or tokens_per_frame < 1):
        raise ValueError(f"tokens_per_frame must be a positive int, got {tokens_per_frame!r}")
    rows, tokens = k_new.shape[1], k_new.shape[2]
    if tokens == 0 or tokens % tokens_per_frame:
        raise ValueError(f"the chunk's {tokens} tokens per row must be a positive multiple of "
                         f"tokens_per_frame={tokens_per_frame}")
    ppf = pages_per_frame(int(tokens_per_frame), block_size)
    expected = (rows, tokens // tokens_per_frame * ppf)
    if jnp.ndim(page_ids) != 2 or tuple(jnp.shape(page_ids)) != expected:
        raise ValueError(f"page_ids must have shape [rows, num_frames * pages_per_frame] = "
                         f"{list(expected)} (tokens_per_frame={tokens_per_frame}, block_size="
                         f"{block_size}, pages_per_frame={ppf}), got {list(jnp.shape(page_ids))}")
    if not jnp.issubdtype(page_ids.dtype, jnp.integer):
        raise ValueError(f"page_ids must be integers (int32), got {page_ids.dtype}")
    return int(tokens_per_frame)


def dynamic_validate_inputs(k_pool, v_pool, k_new, v_new, page_ids, *, tokens_per_frame=None,
                            backend="auto") -> None:
    """:func:`static_validate_inputs`, then the page ids: each in ``[1, num_pages)`` (not the null
    page) and none repeated.

    ``page_ids`` must be concrete (not traced). ``write_chunk`` itself does not check them: it
    skips 0 and ids outside ``[1, num_pages)``, and a page named twice ends up holding one of its
    writes (or on TPU/GPU possibly a mix of them).

    Raises:
      ValueError: as :func:`static_validate_inputs`, or a page id out of range or repeated.
    """
    static_validate_inputs(k_pool, v_pool, k_new, v_new, page_ids,
                           tokens_per_frame=tokens_per_frame, backend=backend)
    num_pages = pool_geometry(k_pool).num_pages
    flat = np.asarray(page_ids).reshape(-1)
    bad = flat[(flat < 1) | (flat >= num_pages)]
    if bad.size:
        what = "the null page 0" if bad[0] == 0 else f"page id {int(bad[0])}"
        raise ValueError(f"page_ids contains {what}; allowed page ids are [1, {num_pages}) "
                         f"(0 is the null page; write_chunk skips ids outside this range)")
    values, counts = np.unique(flat, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"page_ids repeats page {int(values[counts > 1][0])}; each page may be "
                         f"written once per call (allowed page ids are [1, {num_pages}))")
