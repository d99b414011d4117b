"""The one rule for int, real and bool arguments, for the kernels and for ``arkv_jax``.

An int is a Python ``int`` or a NumPy integer scalar, returned as a Python ``int``; ``bool`` and
``np.bool_`` are not ints. A real number is an int or a Python or NumPy float (not a bool), returned
as a ``float``. A bool is ``True``, ``False`` or an ``np.bool_``. A value of the wrong type raises
:class:`ArgumentTypeError`, one out of range a ``ValueError``; both messages read
``"{name} must be {must}, got {value}"``. This module imports only NumPy, so ``arkv_jax.config``
re-exports it (the kernels import nothing of ``arkv_jax``). See ``docs/kernels.md`` (Validation).
"""

from __future__ import annotations

import numpy as np


class ArgumentTypeError(TypeError, ValueError):
    """A public argument of the wrong type. A :class:`TypeError`; also a :class:`ValueError`, so
    callers written when wrong types were reported as bad values keep working."""


def is_int(value) -> bool:
    """Whether ``value`` is an int under the rule: ``int`` or ``np.integer``, not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_real(value) -> bool:
    """Whether ``value`` is a real number under the rule: an int or a Python/NumPy float."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def is_bool(value) -> bool:
    """Whether ``value`` is ``True``, ``False`` or an ``np.bool_``."""
    return isinstance(value, (bool, np.bool_))


def _shown(value):
    """``value`` as a message shows it: a NumPy scalar as its Python value."""
    return value.item() if isinstance(value, np.generic) else value


def argument_error(name: str, value, must: str) -> ValueError:
    """The ``ValueError`` of an argument of the right type that breaks a rule: ``"{name} must be
    {must}, got {value!r}"``, for checks beyond :func:`require_int`'s (raise it)."""
    return ValueError(f"{name} must be {must}, got {_shown(value)!r}")


def _type_error(name: str, value, must: str, expected: str) -> ArgumentTypeError:
    return ArgumentTypeError(f"{name} must be {must}, got {_shown(value)!r} ({type(value).__name__}, "
                             f"expected {expected})")


def require_int(name: str, value, *, minimum: int | None = None, maximum: int | None = None,
                multiple_of: int | None = None, must: str | None = None) -> int:
    """``value`` as an ``int`` in ``[minimum, maximum]`` (either bound may be open), a multiple of
    ``multiple_of`` if given.

    Args:
      name: the parameter as messages name it.
      must: what ``value`` must be, in words (``"a positive multiple of 8"``); by default ``"an int
        in [minimum, maximum]"`` (``-inf``/``inf`` for an open bound) and the multiple.

    Raises:
      ArgumentTypeError: not an int (a bool is not one); the message ends ``(type, expected an
        int)``. ValueError: out of range or not a multiple.
    """
    if must is None:
        must = f"an int in [{'-inf' if minimum is None else minimum}, {'inf' if maximum is None else maximum}]"
        if multiple_of is not None:
            must += f", a multiple of {multiple_of}"
    if not is_int(value):
        raise _type_error(name, value, must, "an int")
    value = int(value)
    if ((minimum is not None and value < minimum) or (maximum is not None and value > maximum)
            or (multiple_of is not None and value % multiple_of)):
        raise argument_error(name, value, must)
    return value


def require_index(name: str, value, size: int, source: str) -> None:
    """``value`` indexes one of ``size`` items: an int in ``[0, size)``, or an integer scalar array
    (concrete or traced; its value is the caller's to check or clamp). ``source`` names where
    ``size`` comes from in the message (``"k_pool.shape[0]"``).

    Raises:
      ArgumentTypeError: neither an int nor an integer array. ValueError: an array that is not a
        scalar; an int out of range.
    """
    dtype = getattr(value, "dtype", None)
    if not (is_int(value) or (dtype is not None and np.issubdtype(dtype, np.integer))):
        raise ArgumentTypeError(f"{name} must be an integer scalar (it may be traced), got {value!r} "
                                f"({type(value).__name__}, expected an int or an int array)")
    shape = tuple(getattr(value, "shape", ()))
    if shape:
        raise ValueError(f"{name} must be an int scalar, got shape {shape}")
    if is_int(value) and not 0 <= value < size:
        raise ValueError(f"{name}={int(value)} is out of range; allowed [0, {size}) ({source})")


def require_positive(name: str, value) -> int:
    """``value`` as a positive ``int`` (:func:`require_int`, the requirement worded ``positive``)."""
    return require_int(name, value, minimum=1, must="positive")


def require_non_negative(name: str, value) -> int:
    """``value`` as a non-negative ``int`` (:func:`require_int`, worded ``non-negative``)."""
    return require_int(name, value, minimum=0, must="non-negative")


def require_real(name: str, value, *, low: float | None = None, high: float | None = None,
                 low_open: bool = False, must: str | None = None) -> float:
    """``value`` as a finite ``float`` in ``[low, high]`` (``(low, high]`` with ``low_open``).

    ``must`` words the requirement as :func:`require_int`'s does (default ``"a finite real number in
    [low, high]"``).

    Raises:
      ArgumentTypeError: not a real number (a bool or a string is not one). ValueError: NaN,
        infinite or out of range.
    """
    if must is None:
        must = (f"a finite real number in {'(' if low_open else '['}{'-inf' if low is None else low}, "
                f"{'inf' if high is None else high}]")
    if not is_real(value):
        raise _type_error(name, value, must, "a real number")
    x = float(value)
    if not np.isfinite(x) or (low is not None and (x <= low if low_open else x < low)) or (
            high is not None and x > high):
        raise argument_error(name, value, must)
    return x


def require_bool(name: str, value) -> bool:
    """``value`` as a ``bool``; only ``True``/``False`` (or NumPy bools) are accepted.

    Raises:
      ArgumentTypeError: anything else (``"False"`` or ``0`` are refused, not coerced).
    """
    if not is_bool(value):
        raise _type_error(name, value, "a bool (True or False)", "a bool")
    return bool(value)
