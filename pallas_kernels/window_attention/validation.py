"""Input validation of :func:`pallas_kernels.window_attention.window_attention`.

:func:`static_validate_inputs` checks what is known at trace time (ranks, shapes, dtypes, head
counts, frame size, a Python-int ``layer``'s range, scale, backend name and tiles);
``window_attention`` always calls it, and it accepts tracers and ``jax.ShapeDtypeStruct`` s.
:func:`check_values` checks the values (page ids, lengths, a layer given as an array) under the
value-check rule of :mod:`pallas_kernels.common` (``validate=``); ``window_attention`` calls it
after the static checks. :func:`dynamic_validate_inputs` is both, with every value read on the
host. Every error is a ``ValueError`` (``TypeError`` for a non-array argument or a wrong type by the
rule of :mod:`pallas_kernels.checks`) that names the parameter, the bad value and the allowed range
(``docs/kernels.md``, Validation).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from pallas_kernels.backend import (
    CUDNN_DTYPES,
    cudnn_supports,
    resolve_backend,
)
from pallas_kernels.checks import argument_error, is_int, require_index, require_int, require_real
from pallas_kernels.common import (
    check_entries,
    check_pool_pair,
    check_rank,
    check_supported_dtype,
    check_validate,
    is_power_of_two,
    value_check_mode,
)
from pallas_kernels.layout import (
    PAGE_AXIS,
    POOL_LAYOUT,
    check_tpu_block_size,
    is_quantized_pool,
    pool_geometry,
    pool_shape,
)
from pallas_kernels.window_attention import mosaic_gpu
from pallas_kernels.window_attention.geometry import WindowGeometry


def static_validate_inputs(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, *, layer=0,
                           extra_k=None, extra_v=None, scale=None, tokens_per_frame=None,
                           backend="auto", block_q=None, block_k=None, rope=None,
                           qk_norm=None) -> WindowGeometry:
    """Checks everything about a ``window_attention`` call that does not depend on array values.

    Takes ``window_attention``'s arguments; any array may be a tracer or a ``ShapeDtypeStruct``.
    ``backend`` is resolved for the call's dtype and head dim (``"auto"``, see
    :mod:`pallas_kernels.backend`), then checked against that backend's rules:

    * ``pallas_gpu*`` (Triton): ``head_dim`` a power of two >= 16; ``block_q``/``block_k`` powers
      of two in ``[16, 256]``.
    * ``pallas_tpu*``: ``block_q``/``block_k`` positive multiples of 8; the compiled
      ``pallas_tpu`` kernel also a ``block_size`` that is a multiple of 8
      (:func:`pallas_kernels.layout.check_tpu_block_size`; the interpreters take any).
    * ``cudnn_gather``: bf16 or f16, ``head_dim`` a multiple of 8 in ``[8, 256]`` (tiles unused;
      ``cudnn_gather_xla`` takes any supported dtype and head dim).
    * ``pallas_mgpu``: bf16 or f16, ``head_dim`` a multiple of 64 in ``[64, 256]``, ``block_q``
      ``None`` or 64, ``block_k`` (the key tile) a multiple of 64 dividing ``block_size``, and the
      tiling's shared memory within one CTA's.

    On every backend ``block_q`` and ``block_k`` are ``None`` or positive ints (static tile sizes,
    never traced), also where the backend does not use them.

    Returns:
      the call's :class:`WindowGeometry`.

    Quantized pools (:class:`pallas_kernels.layout.QuantizedPool`) are read by every backend.

    Raises:
      ValueError: a bad rank, shape, dtype, head count, frame size, layer rank, a Python-int
        ``layer`` out of ``[0, num_layers)``, scale, backend name, tile size, ``rope`` table or
        ``qk_norm`` array.
      TypeError: a non-array input, a ``layer`` that is not an integer, a ``rope`` that is not a
        pair or a ``qk_norm`` that is not a 4-tuple.
    """
    geom = check_arrays(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, layer=layer,
                        extra_k=extra_k, extra_v=extra_v, tokens_per_frame=tokens_per_frame,
                        rope=rope, qk_norm=qk_norm)
    resolved = resolve_backend(backend, dtype=q.dtype, head_dim=geom.head_dim)
    if scale is not None:
        check_scale(scale)
    for name, tile in (("block_q", block_q), ("block_k", block_k)):
        if tile is not None:
            require_int(name, tile, minimum=1, must="None or a positive int (a static tile size)")
    if resolved.kind == "pallas_gpu":
        _check_gpu_tile("block_q", block_q)
        _check_gpu_head_dim(geom.head_dim)
        _check_gpu_tile("block_k", block_k)
    elif resolved.kind == "pallas_tpu":
        _check_tpu_tile("block_q", block_q)
        _check_tpu_tile("block_k", block_k)
        if resolved.name == "pallas_tpu":  # The interpreters take any block size.
            check_tpu_block_size(geom.block_size)
    elif resolved.name == "cudnn_gather":
        _check_cudnn(q.dtype, geom.head_dim)
    elif resolved.kind == "pallas_mgpu":
        stored = jnp.dtype(k_pool.dtype).itemsize if is_quantized_pool(k_pool) else 0
        check_mosaic_tiling(geom, q.dtype, block_q, block_k, mosaic_gpu.STAGES, stored)
    return geom


def check_mosaic_tiling(geom: WindowGeometry, dtype, block_q, block_kv, stages: int,
                        stored_itemsize: int = 0) -> None:
    """Raises ``ValueError`` unless the Mosaic GPU kernel takes ``dtype``, the head dim and the
    tiling (``block_q`` ``None`` or 64; ``block_kv`` ``None`` for
    :func:`~pallas_kernels.window_attention.mosaic_gpu.default_block_kv`, else a multiple of 64
    dividing ``block_size``; ``stages`` in ``[2, 4]``; shared memory within
    :data:`~pallas_kernels.window_attention.mosaic_gpu.SMEM_BYTES`, counting the 8-bit slots of
    quantized pools: ``stored_itemsize`` 1, else 0)."""
    dtype = jnp.dtype(dtype)
    if dtype not in mosaic_gpu.DTYPES:
        raise ValueError(f"q.dtype={dtype.name} is not supported by the Mosaic GPU kernel; allowed: "
                         f"{[d.name for d in mosaic_gpu.DTYPES]} (use backend='cudnn_gather')")
    if geom.head_dim % 64 or not 64 <= geom.head_dim <= 256:
        raise ValueError(f"head_dim={geom.head_dim} is not supported by the Mosaic GPU kernel; "
                         "allowed: multiples of 64 in [64, 256]")
    if block_q is not None:
        must = f"{mosaic_gpu.BLOCK_Q} for the Mosaic GPU kernel (one wgmma M tile per consumer warpgroup)"
        if require_int("block_q", block_q, must=must) != mosaic_gpu.BLOCK_Q:
            raise argument_error("block_q", block_q, must)
    block_kv = mosaic_gpu.default_block_kv(geom.block_size) if block_kv is None else block_kv
    must = (f"a positive multiple of 64 dividing block_size={geom.block_size} for the Mosaic GPU kernel "
            "(no key tile may straddle two pages; pick a page size that is a multiple of the key tile, "
            "e.g. 1664 = 13 x 128 for 1560-token frames)")
    if geom.block_size % require_int("block_k", block_kv, minimum=64, multiple_of=64, must=must):
        raise argument_error("block_k", block_kv, must)
    stages = require_int("stages", stages, minimum=2, maximum=4)
    need = mosaic_gpu.smem_bytes(geom.head_dim, dtype.itemsize, mosaic_gpu.BLOCK_Q, int(block_kv),
                                 stages, stored_itemsize)
    if need > mosaic_gpu.SMEM_BYTES:
        pools = " with quantized pools" if stored_itemsize else ""
        raise ValueError(f"block_k={block_kv}, stages={stages} need {need} bytes of shared memory "
                         f"at head_dim={geom.head_dim}{pools}; allowed at most {mosaic_gpu.SMEM_BYTES}")


def dynamic_validate_inputs(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, *, layer=0,
                            extra_k=None, extra_v=None, scale=None, tokens_per_frame=None,
                            backend="auto", block_q=None, block_k=None, rope=None,
                            qk_norm=None) -> None:
    """:func:`static_validate_inputs`, then the values read on the host: ``layer`` in
    ``[0, num_layers)``, every ``pages`` entry in ``[0, num_pages)``, every length in
    ``[0, capacity]``.

    ``layer``, ``pages`` and ``lengths`` must be concrete (a tracer raises
    ``jax.errors.TracerArrayConversionError``). It is the check ``window_attention`` runs by default
    on concrete values (``validate=True``); for traced ones see :func:`check_values`.

    Raises:
      ValueError: as :func:`static_validate_inputs`, or a value out of its range.
    """
    geom = static_validate_inputs(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, layer=layer,
                                  extra_k=extra_k, extra_v=extra_v, scale=scale,
                                  tokens_per_frame=tokens_per_frame, backend=backend,
                                  block_q=block_q, block_k=block_k, rope=rope, qk_norm=qk_norm)
    _check_values(geom, pages, lengths, layer, lambda _: "host")


def check_values(geom: WindowGeometry, pages, lengths, layer, *, validate=True) -> None:
    """The value checks of a call with geometry ``geom`` (from :func:`static_validate_inputs`),
    under the rule of :mod:`pallas_kernels.common`: ``layer`` (an array; a Python int was checked
    statically) in ``[0, num_layers)``, ``pages`` entries in ``[0, num_pages)``, ``lengths`` in
    ``[0, capacity]``. Each array is checked on the host if concrete (unless ``validate=False``),
    with ``checkify.check`` if traced and ``validate="checkify"``, else not at all.

    Raises:
      ValueError: ``validate`` is not ``True``, ``False`` or ``"checkify"``; a concrete value out of
        its range.
    """
    check_validate(validate)
    _check_values(geom, pages, lengths, layer, functools.partial(value_check_mode, validate))


def _check_values(geom: WindowGeometry, pages, lengths, layer, mode_of) -> None:
    if not is_int(layer):  # A Python int: checked by check_arrays.
        check_entries(mode_of(layer), "layer", layer, lambda v: (v < 0) | (v >= geom.num_layers),
                      f"is out of range; allowed [0, {geom.num_layers}) (k_pool.shape[0])")
    check_entries(mode_of(pages), "pages", pages, lambda v: (v < 0) | (v >= geom.num_pages),
                  f"is not a page id; allowed [0, {geom.num_pages}) (k_pool.shape[{PAGE_AXIS}])")
    check_entries(mode_of(lengths), "lengths", lengths, lambda v: (v < 0) | (v > geom.capacity),
                  f"is out of range; allowed [0, {geom.capacity}] (the capacity of "
                  f"{geom.max_pages} pages of {geom.block_size} slots at "
                  f"tokens_per_frame={geom.tokens_per_frame})")


def check_arrays(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, *, layer=0, extra_k=None,
                 extra_v=None, tokens_per_frame=None, rope=None, qk_norm=None) -> WindowGeometry:
    """The array part of :func:`static_validate_inputs` (no backend options); returns the geometry.
    Pools may be plain arrays or :class:`~pallas_kernels.layout.QuantizedPool` s (both alike).

    Raises:
      ValueError: a bad rank, shape, dtype, head count, frame size or layer rank; a Python-int
        ``layer`` out of ``[0, num_layers)``; a malformed pair of quantized pools; a bad ``rope``
        or ``qk_norm`` (:func:`check_rope`, :func:`check_qk_norm`).
      TypeError: a non-array input; a ``layer`` that is not an integer (``1.9``, ``True``); a
        ``rope`` that is not a pair or a ``qk_norm`` that is not a 4-tuple.
    """
    check_pool_pair(k_pool, v_pool)
    geom = _check_shapes(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, extra_k, extra_v,
                         tokens_per_frame)
    _check_dtypes(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, extra_k, extra_v)
    require_index("layer", layer, geom.num_layers, "k_pool.shape[0]")
    check_rope(rope, geom)
    check_qk_norm(qk_norm, geom)
    return geom


def check_qk_norm(qk_norm, geom: WindowGeometry) -> None:
    """``qk_norm`` is ``None`` or ``(q_inv_rms, k_inv_rms, q_gain, k_gain)``: float32
    ``[rows, q_len]`` and ``[rows, cur_len]``, and floating ``[num_q_heads * head_dim]`` and
    ``[kv_heads * head_dim]`` (taken in float32; :func:`pallas_kernels.rope.normalize`).

    Raises:
      TypeError: ``qk_norm`` not a 4-tuple, or an entry not an array.
      ValueError: an entry's shape or dtype.
    """
    if qk_norm is None:
        return
    if not isinstance(qk_norm, (tuple, list)) or len(qk_norm) != 4:
        raise TypeError("qk_norm must be None or a (q_inv_rms, k_inv_rms, q_gain, k_gain) tuple of "
                        f"arrays, got {type(qk_norm).__name__}")
    expected = {"q_inv_rms": (geom.rows, geom.q_len), "k_inv_rms": (geom.rows, geom.cur_len),
                "q_gain": (geom.num_q_heads * geom.head_dim,), "k_gain": (geom.kv_heads * geom.head_dim,)}
    for (name, shape), x in zip(expected.items(), qk_norm):
        name = f"qk_norm {name}"
        check_rank(name, x, len(shape), str(list(shape)))
        _expect(name, x.shape, shape)
        if "inv_rms" in name and x.dtype != jnp.float32:
            raise ValueError(f"{name}.dtype must be float32, got {jnp.dtype(x.dtype).name}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name}.dtype must be floating, got {jnp.dtype(x.dtype).name}")


def check_rope(rope, geom: WindowGeometry) -> None:
    """``rope`` is ``None`` or ``(cos, sin)``, float32 arrays ``[rows, q_len, head_dim]``, and the
    queries are the chunk's own tokens (``q_len == cur_len``), as the tables rotate both.

    Raises:
      TypeError: ``rope`` not a pair, or ``cos``/``sin`` not arrays.
      ValueError: a table's shape or dtype, or ``q_len != cur_len``.
    """
    if rope is None:
        return
    if not isinstance(rope, (tuple, list)) or len(rope) != 2:
        raise TypeError(f"rope must be None or a (cos, sin) pair of arrays, got {type(rope).__name__}")
    if geom.q_len != geom.cur_len:
        raise ValueError(f"rope rotates the queries and the chunk's keys at the same positions: "
                         f"q_len={geom.q_len} must equal cur_len={geom.cur_len}")
    for name, table in zip(("rope[0] (cos)", "rope[1] (sin)"), rope):
        check_rank(name, table, 3, "[rows, q_len, head_dim]")
        _expect(name, table.shape, (geom.rows, geom.q_len, geom.head_dim))
        if table.dtype != jnp.float32:
            raise ValueError(f"{name}.dtype must be float32, got {jnp.dtype(table.dtype).name}")


def _check_shapes(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, extra_k, extra_v,
                  tokens_per_frame) -> WindowGeometry:
    check_rank("q", q, 4, "[rows, q_len, num_q_heads, head_dim]")
    check_rank("k_cur", k_cur, 4, "[rows, cur_len, kv_heads, head_dim]")
    check_rank("k_pool", k_pool, 5, POOL_LAYOUT)
    check_rank("pages", pages, 2, "[rows, max_pages]")
    check_rank("lengths", lengths, 1, "[rows]")
    rows, q_len, num_q_heads, head_dim = q.shape
    _, cur_len, kv_heads, _ = k_cur.shape
    pool = pool_geometry(k_pool)
    num_layers, num_pages, block_size = pool.num_layers, pool.num_pages, pool.block_size
    _same_shape("v_cur", v_cur, "k_cur", k_cur)
    _same_shape("v_pool", v_pool, "k_pool", k_pool)
    if (extra_k is None) != (extra_v is None):
        raise ValueError("extra_k and extra_v must be given together (both or neither); got "
                         f"extra_k={'None' if extra_k is None else 'an array'}, "
                         f"extra_v={'None' if extra_v is None else 'an array'}")
    num_extra = 0
    if extra_k is not None:
        check_rank("extra_k", extra_k, 4, "[rows, num_extra, kv_heads, head_dim]")
        _same_shape("extra_v", extra_v, "extra_k", extra_k)
        num_extra = extra_k.shape[1]
        _expect("extra_k", extra_k.shape, (rows, num_extra, kv_heads, head_dim))
    _expect("k_cur", k_cur.shape, (rows, cur_len, kv_heads, head_dim))
    _expect("k_pool", k_pool.shape, pool_shape(num_layers, num_pages, block_size, kv_heads, head_dim,
                                            check=False))
    _expect("pages", pages.shape, (rows, pages.shape[1]))
    _expect("lengths", lengths.shape, (rows,))
    if min(rows, q_len, cur_len, head_dim, kv_heads, num_layers, num_pages, block_size) < 1:
        raise ValueError("rows, q_len, cur_len, heads, head_dim, num_layers, num_pages and "
                         f"block_size must all be >= 1; got q {q.shape}, k_cur {k_cur.shape}, "
                         f"k_pool {k_pool.shape}")
    if num_q_heads % kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} (q.shape[2]) must be a positive multiple of "
                         f"kv_heads={kv_heads} (k_cur.shape[2])")
    tokens_per_frame = require_int(
        "tokens_per_frame", block_size if tokens_per_frame is None else tokens_per_frame, minimum=1,
        must=f"an int >= 1 (frames fill ceil(tokens_per_frame / block_size={block_size}) pages)")
    return WindowGeometry(rows, q_len, num_q_heads, kv_heads, head_dim, cur_len, num_extra,
                          num_layers, num_pages, block_size, pages.shape[1], tokens_per_frame)


def _check_dtypes(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, extra_k, extra_v) -> None:
    check_supported_dtype("q.dtype", q.dtype)
    named = {"k_cur": k_cur, "v_cur": v_cur, "extra_k": extra_k, "extra_v": extra_v}
    if not is_quantized_pool(k_pool):  # A quantized pool's dtype was checked by check_pool_pair.
        named.update(k_pool=k_pool, v_pool=v_pool)
    for name, x in named.items():
        if x is not None and x.dtype != q.dtype:
            raise ValueError(f"{name}.dtype must equal q.dtype={jnp.dtype(q.dtype).name}, got "
                             f"{jnp.dtype(x.dtype).name}")
    for name, x in (("pages", pages), ("lengths", lengths)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array (int32), got dtype "
                             f"{jnp.dtype(x.dtype).name}")


def check_scale(scale) -> float:
    """``scale`` as a float; raises unless it is a positive finite real number (a bool is not
    one, nor a traced value: the scale is static)."""
    return require_real("scale", scale, low=0.0, low_open=True, must="a positive finite number (a Python float)")


def _check_gpu_tile(name: str, value) -> None:
    must = "a power of two in [16, 256] for the Triton kernel"
    if value is not None and not is_power_of_two(require_int(name, value, minimum=16, maximum=256, must=must)):
        raise argument_error(name, value, must)


def _check_cudnn(dtype, head_dim: int) -> None:
    if jnp.dtype(dtype) not in CUDNN_DTYPES:
        raise ValueError(f"q.dtype={jnp.dtype(dtype).name} is not supported by cuDNN attention; "
                         f"allowed: {[d.name for d in CUDNN_DTYPES]} (use backend='xla' or "
                         "'pallas_gpu')")
    if not cudnn_supports(dtype, head_dim):
        raise ValueError(f"head_dim={head_dim} is not supported by cuDNN attention; allowed: "
                         "multiples of 8 in [8, 256] (use backend='xla')")


def _check_tpu_tile(name: str, value) -> None:
    if value is not None:
        require_int(name, value, minimum=8, multiple_of=8, must="a positive multiple of 8 for the TPU kernel")


def _check_gpu_head_dim(head_dim: int) -> None:
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim={head_dim} is not supported by the Triton kernel; allowed: "
                         "powers of two >= 16 (use backend='xla' otherwise)")


def _same_shape(name, x, ref_name, ref) -> None:
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{name} must be an array (jax or NumPy), got {type(x).__name__}")
    if tuple(x.shape) != tuple(ref.shape):
        raise ValueError(f"{name}.shape must equal {ref_name}.shape={tuple(ref.shape)}, got "
                         f"{getattr(x, 'shape', type(x).__name__)}")


def _expect(name, shape, expected) -> None:
    if tuple(shape) != tuple(expected):
        raise ValueError(f"{name}.shape={tuple(shape)} does not match q, k_cur and k_pool: "
                         f"expected {tuple(expected)}")
