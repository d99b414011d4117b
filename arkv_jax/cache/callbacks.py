"""The ``on_release`` callbacks: run after the cache's bookkeeping, never inside it.

Every operation that releases sessions (close, reset, LRU eviction, a failed chunk with
``fail_closed``) finishes its bookkeeping first and then calls ``on_release(session_id, reason)``
for each released session, even after one raised. :func:`notify` then raises
:class:`CallbackError` from the first error; :func:`note` instead logs them and adds them as notes
to a forward's exception that is already propagating. ``docs/protocol.md``, "Callbacks".
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable

_log = logging.getLogger("arkv_jax.cache.facade")

#: A released session: ``(session_id, reason)``.
Event = tuple[str, str]


class CallbackError(RuntimeError):
    """An ``on_release`` callback raised. The cache finished the operation first (every session it
    was closing is closed, the session it was opening is open); the callback's exception is the
    ``__cause__``."""


def call_back(on_release: Callable[[str, str], None] | None, events: Iterable[Event]
              ) -> list[tuple[str, str, Exception]]:
    """Calls ``on_release`` for every event, even after one raised; returns the errors."""
    errors = []
    if on_release is not None:
        for sid, reason in events:
            try:
                on_release(sid, reason)
            except Exception as error:  # noqa: BLE001 - reported after the bookkeeping
                errors.append((sid, reason, error))
    return errors


def notify(on_release: Callable[[str, str], None] | None, events: Iterable[Event]) -> None:
    """Runs the callbacks of finished bookkeeping; raises :class:`CallbackError` from the first
    error, naming them all."""
    errors = call_back(on_release, events)
    if errors:
        sid, reason, error = errors[0]
        calls = ", ".join(f"on_release({s!r}, {r!r})" for s, r, _ in errors)
        raise CallbackError(f"{calls} raised ({type(error).__name__}: {error}); the cache finished "
                            "the operation first") from error


def note(on_release: Callable[[str, str], None] | None, events: Iterable[Event], exc: BaseException) -> None:
    """Runs the callbacks while ``exc`` (a failed forward's) propagates: errors are logged and added
    to ``exc`` as notes, never raised."""
    for sid, reason, error in call_back(on_release, events):
        _log.error("on_release(%r, %r) raised while closing a failed chunk", sid, reason, exc_info=error)
        if hasattr(exc, "add_note"):
            exc.add_note(f"on_release({sid!r}, {reason!r}) raised {type(error).__name__}: {error}")
