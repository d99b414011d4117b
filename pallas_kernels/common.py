"""Rules every kernel shares: integer rounding, frame-aligned pages, supported dtypes, the static
input checks, the value-check rule, the masked-logit value, the online-softmax step of the Pallas
attention kernels and the base-2 softmax constant of the GPU kernels.

A frame of ``tokens_per_frame`` tokens takes :func:`pages_per_frame` consecutive pages of
``block_size`` slots; its last page ends in padding slots. The value-check rule (page ids, lengths,
a layer given as an array, set by both kernels' ``validate=``: :data:`VALIDATE_MODES`,
:func:`value_check_mode`, :func:`check_entries`) is described in ``docs/kernels.md`` (Validation);
static arguments are checked on every call whatever ``validate`` says, by the rule of
:mod:`pallas_kernels.checks`.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import checkify

from pallas_kernels.checks import is_bool, is_int
from pallas_kernels.layout import POOL_LAYOUT, SCALE_LAYOUT, is_quantized_pool, scale_shape
from pallas_kernels.quantization import QUANTIZED_DTYPES, SCALE_DTYPE, is_quantized

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
"""Pool and activation dtypes every kernel and backend accepts."""

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
"""Finite logit for masked keys: exp(MASK_VALUE - m) is exactly 0 and no inf - inf NaN can arise."""


LOG2_E = 1.4426950408889634
"""``log2(e)``: ``exp(x * scale) == exp2(x * scale * LOG2_E)`` (the GPU kernels' base-2 softmax)."""


def cdiv(a, b):
    """``ceil(a / b)`` for an integer ``a`` and a positive integer ``b`` (Python ints or int
    arrays; for arrays ``a`` must stay ``b - 1`` below the dtype's maximum)."""
    return (a + b - 1) // b


def token_major_blocks(group: int, head_dim: int) -> bool:
    """Whether a TPU attention kernel reads each head as one block of ``head_dim`` lanes of the
    caller's token-major ``[rows, tokens, heads * head_dim]`` array: one query head per KV head
    (no GQA) and a head dim of whole 128-lane groups."""
    return group == 1 and head_dim % 128 == 0


def round_up(a: int, b: int) -> int:
    """The smallest multiple of ``b`` that is ``>= a``."""
    return cdiv(a, b) * b


def is_power_of_two(value) -> bool:
    """Whether ``value`` is an int (not a bool) that is a positive power of two."""
    return is_int(value) and value > 0 and not value & (value - 1)


def pages_per_frame(tokens_per_frame: int, block_size: int) -> int:
    """Pages one frame occupies: ``ceil(tokens_per_frame / block_size)``."""
    return cdiv(tokens_per_frame, block_size)


# ------------------------------------------------------------------------------------------------
# Input checks shared by the kernels' validators (host side, static: shapes and dtypes only)
# ------------------------------------------------------------------------------------------------


def kernel_name_fields(pattern: re.Pattern, name: str, what: str) -> tuple:
    """The groups of ``pattern`` in a kernel's ``name``: how a kernel whose name spells its
    geometry (the convolutions', the adaLN MLP's) is read back from the compiled HLO.

    Raises:
      ValueError: ``name`` does not match (``"{name!r} is not {what}"``).
    """
    found = pattern.match(name)
    if not found:
        raise ValueError(f"{name!r} is not {what}")
    return found.groups()


def check_rank(name: str, x, rank: int, layout: str = "") -> None:
    """Raises ``TypeError`` unless ``x`` is an array (anything with a ``shape`` and a ``dtype``:
    jax or NumPy arrays, tracers, ``ShapeDtypeStruct`` s) and ``ValueError`` unless it has ``rank``
    dimensions."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{name} must be an array (jax or NumPy), got {type(x).__name__}")
    if len(x.shape) != rank:
        layout = f" {layout}" if layout else ""
        raise ValueError(f"{name} must have rank {rank}{layout}, got shape {x.shape}")


def as_index_array(name: str, x):
    """``x`` itself if it is an array (jax or NumPy, a tracer, a ``ShapeDtypeStruct``); a Python
    list, tuple or int of integers as an int32 jax array.

    Raises:
      TypeError: ``x`` is neither an array nor a rectangular nesting of integers (floats, bools,
        strings, ``None``, ragged lists).
      ValueError: an entry of the list does not fit in int32.
    """
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return x
    if not (isinstance(x, (list, tuple)) or is_int(x)):
        raise TypeError(f"{name} must be an integer array (int32) or a list of ints, got "
                        f"{type(x).__name__}")
    try:
        values = np.asarray(x)
    except ValueError:  # Ragged nesting.
        raise TypeError(f"{name} must be a rectangular list of ints, got a ragged "
                        f"{type(x).__name__}") from None
    if values.size and not np.issubdtype(values.dtype, np.integer):
        raise TypeError(f"{name} must be a list of ints, got a {type(x).__name__} of "
                        f"{values.dtype} values")
    info = np.iinfo(np.int32)
    check_entries("host", name, values, lambda v: (v < info.min) | (v > info.max),
                  "does not fit in int32")
    return jnp.asarray(values, jnp.int32)


def check_supported_dtype(what: str, dtype) -> None:
    """Raises ``ValueError`` unless ``dtype`` is one of :data:`SUPPORTED_DTYPES`."""
    if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
        raise ValueError(f"{what} must be one of {[d.name for d in SUPPORTED_DTYPES]}, "
                         f"got {jnp.dtype(dtype).name}")


def check_same_dtype(reference: str, dtype, named) -> None:
    """Raises ``ValueError`` naming the first ``(name, array)`` of ``named`` whose dtype is not
    ``dtype``, the dtype of the argument ``reference``."""
    for name, array in named:
        if array.dtype != dtype:
            raise ValueError(f"{name}.dtype must equal {reference}.dtype={jnp.dtype(dtype).name}, got "
                             f"{jnp.dtype(array.dtype).name}")


def check_pool_pair(k_pool, v_pool) -> bool:
    """Checks the parts of a pair of pools that are not shapes the kernels compare themselves:
    both plain or both :class:`~pallas_kernels.layout.QuantizedPool` s, and for quantized ones
    (:func:`check_quantized_pool`) the same dtype. Returns whether they are quantized.

    Raises:
      ValueError: one quantized and one not; a malformed quantized pool; quantized dtypes that
        differ.
    """
    quantized = is_quantized_pool(k_pool)
    if quantized != is_quantized_pool(v_pool):
        raise ValueError("k_pool and v_pool must both be arrays or both be QuantizedPools, got "
                         f"{type(k_pool).__name__} and {type(v_pool).__name__}")
    if quantized:
        check_quantized_pool("k_pool", k_pool)
        check_quantized_pool("v_pool", v_pool)
        if k_pool.dtype != v_pool.dtype:
            raise ValueError(f"k_pool and v_pool must have the same dtype, got {jnp.dtype(k_pool.dtype).name} "
                             f"and {jnp.dtype(v_pool.dtype).name}")
    return quantized


def check_quantized_pool(name: str, pool) -> None:
    """Raises unless ``pool`` is a well-formed :class:`~pallas_kernels.layout.QuantizedPool`:
    ``values`` rank 5 in a quantized dtype, ``scales`` float32 of the values' three major axes.

    Raises:
      TypeError: a part that is not an array. ValueError: a bad rank, dtype or scale shape.
    """
    check_rank(f"{name}.values", pool.values, 5, POOL_LAYOUT)
    check_rank(f"{name}.scales", pool.scales, 3, SCALE_LAYOUT)
    if not is_quantized(pool.values.dtype):
        raise ValueError(f"{name}.values.dtype must be one of {list(QUANTIZED_DTYPES)} (a plain pool of "
                         f"{jnp.dtype(pool.values.dtype).name} is passed as an array), got "
                         f"{jnp.dtype(pool.values.dtype).name}")
    if jnp.dtype(pool.scales.dtype) != SCALE_DTYPE:
        raise ValueError(f"{name}.scales.dtype must be {SCALE_DTYPE.name}, got {jnp.dtype(pool.scales.dtype).name}")
    expected = scale_shape(pool.values.shape)
    if tuple(pool.scales.shape) != expected:
        raise ValueError(f"{name}.scales.shape must be {SCALE_LAYOUT} = {expected} (the values' major axes), "
                         f"got {tuple(pool.scales.shape)}")


# ------------------------------------------------------------------------------------------------
# Value checks (:data:`VALIDATE_MODES`): the rule both kernels follow
# ------------------------------------------------------------------------------------------------

VALIDATE_MODES = (True, False, "checkify")
"""The values of the kernels' ``validate=`` argument. ``True`` (the default): an array whose values
are on the host (:func:`is_concrete`) is checked there before anything runs, so a refused call
raises ``ValueError`` and changes nothing; a traced array is not checked and the compiled program
gets nothing added. ``False``: nothing is checked (eager hot loops, where the host check costs a
device-to-host copy and a sync per call). ``"checkify"``: as ``True``, and traced arrays are checked
with ``checkify.check`` (run the caller under ``checkify.checkify``, which refuses to stage such
checks otherwise)."""


def check_validate(validate) -> None:
    """Raises ``ValueError`` unless ``validate`` is one of :data:`VALIDATE_MODES`."""
    if not (is_bool(validate) or (isinstance(validate, str) and validate == "checkify")):
        raise ValueError(f"validate must be True, False or 'checkify', got {validate!r}")


def is_concrete(x) -> bool:
    """Whether the values of array ``x`` can be read on the host now: a NumPy array or scalar, or a
    jax array that is neither a tracer nor spread over other processes (``ShapeDtypeStruct`` s and
    tracers are not)."""
    if isinstance(x, jax.core.Tracer):
        return False
    if isinstance(x, (np.ndarray, np.generic)):
        return True
    return isinstance(x, jax.Array) and getattr(x, "is_fully_addressable", True)


def value_check_mode(validate, x) -> str | None:
    """How the values of array ``x`` are checked under ``validate``: ``"host"`` (concrete ``x``,
    ``validate`` not ``False``), ``"checkify"`` (traced ``x``, ``validate="checkify"``) or ``None``
    (not checked)."""
    if is_bool(validate) and not validate:
        return None
    if is_concrete(x):
        return "host"
    return "checkify" if isinstance(validate, str) and validate == "checkify" else None


def stacked_layer(layer, num_layers: int, source: str, validate) -> jax.Array:
    """The layer index of a kernel that reads ``[L, ...]`` weight stacks, as an int32 scalar:
    ``layer`` was checked statically (:func:`pallas_kernels.checks.require_index`); an array's
    value is checked against ``[0, num_layers)`` as ``validate`` says (:func:`value_check_mode`),
    ``source`` naming where ``num_layers`` comes from in the message (``"w_in.shape[0]"``)."""
    if not is_int(layer):  # A Python int was checked statically.
        check_entries(value_check_mode(validate, layer), "layer", layer, lambda v: (v < 0) | (v >= num_layers),
                      f"is out of range; allowed [0, {num_layers}) ({source})")
    return jnp.asarray(layer, jnp.int32)


def index_text(index) -> str:
    """``[1, 2]`` for the index ``(1, 2)``; ``""`` for a scalar's ``()``."""
    return f"[{', '.join(str(int(i)) for i in index)}]" if len(index) else ""


def check_entries(mode: str | None, name: str, x, bad: Callable, reason: str) -> None:
    """Refuses the first entry of array ``x`` that ``bad`` flags.

    Args:
      mode: from :func:`value_check_mode`: ``"host"`` reads ``x`` on the host and raises
        ``ValueError`` (``"{name}[i, j]={value} {reason}"``); ``"checkify"`` emits a
        ``checkify.check`` with the same message; ``None`` does nothing.
      name: the parameter's name.
      x: an integer array (for ``"host"`` concrete; a tracer raises
        ``jax.errors.TracerArrayConversionError``).
      bad: elementwise predicate built from operators only (``(v < 0) | (v >= n)``), so it runs
        on NumPy and jax arrays alike.
      reason: what is wrong and the allowed range, e.g. ``"is not a page id; allowed [0, 10)"``.
    """
    if mode is None:
        return
    if mode == "host":
        values = np.asarray(x)
        mask = np.asarray(bad(values))
        if mask.any():
            index = tuple(np.argwhere(mask)[0])
            raise ValueError(f"{name}{index_text(index)}={values[index]} {reason}")
        return
    values = jnp.asarray(x)
    if values.size == 0:
        return
    mask = bad(values)
    first = jnp.argmax(mask.reshape(-1))
    index = jnp.unravel_index(first, values.shape) if values.ndim else ()
    where = f"[{', '.join(['{}'] * values.ndim)}]" if values.ndim else ""
    reason = reason.replace("{", "{{").replace("}", "}}")
    checkify.check(~jnp.any(mask), f"{name}{where}={{}} {reason}", *index,
                   values.reshape(-1)[first])


# ------------------------------------------------------------------------------------------------
# Online softmax (the Pallas TPU and GPU attention kernels)
# ------------------------------------------------------------------------------------------------


def target_device() -> jax.Device:
    """The device a program is built for: JAX's default device where one is set
    (``jax.default_device``, ``jax_default_device``: a device or a platform name, as
    :func:`pallas_kernels.tpu_aot.compile_for_tpu` sets a compile-only chip), else the first
    device."""
    target = jax.config.jax_default_device
    if isinstance(target, str):  # a platform name
        target = jax.devices(target)[0]
    return jax.devices()[0] if target is None else target


def matmul_precision(dtype) -> lax.Precision:
    """Full float32 products for f32 inputs (no TF32/bf16 passes); native for half types."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def online_softmax_step(m_prev: jax.Array, l_prev: jax.Array, acc_prev: jax.Array, q: jax.Array,
                        k: jax.Array, v: jax.Array, valid_row: jax.Array, valid_col: jax.Array,
                        scale: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One flash-attention update over a key block.

    Args:
      m_prev, l_prev: ``[bq, 1]`` f32 running max and normaliser; acc_prev ``[bq, D]`` f32.
      q: ``[bq, D]``; k, v: ``[bk, D]``; valid_row ``[1, bk]`` and valid_col ``[bk, 1]``: the same
        key mask in both orientations (masked keys may hold NaN: they are selected away, not
        multiplied).
      scale: the softmax scale, applied to the float32 logits.

    Returns:
      the updated ``(m, l, acc)``; start from ``(MASK_VALUE, 0, 0)`` and finish with ``acc / l``.
    """
    precision = matmul_precision(q.dtype)
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                        preferred_element_type=jnp.float32) * scale
    s = jnp.where(valid_row, s, MASK_VALUE)
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    p = jnp.where(valid_row, jnp.exp(s - m_new), 0.0)
    alpha = jnp.exp(m_prev - m_new)
    v = jnp.where(valid_col, v, jnp.zeros_like(v))
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)
    return m_new, alpha * l_prev + jnp.sum(p, axis=1, keepdims=True), alpha * acc_prev + pv
