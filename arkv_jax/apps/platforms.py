"""Which kernel backends run on which platform: the commands' up-front refusal (``docs/kernels.md``).

``arkv-jax demo`` and ``arkv-jax generate`` both call :func:`check_backend` before they build or
load anything, so a compiled backend for another platform is refused in one line, not after a
checkpoint has loaded. The platform each backend needs is the kernels' registry's
(:data:`pallas_kernels.backend.BACKENDS`, :meth:`~pallas_kernels.backend.Backend.runs_on`); this
module only words the refusal.
"""

from __future__ import annotations

from pallas_kernels.backend import resolve_backend


def check_backend(backend: str, platform: str) -> None:
    """Refuses a kernel backend that does not run on devices of ``platform``.

    Args:
      backend: a ``--backend`` value (``auto`` resolves for ``platform``, so it always runs).
      platform: the JAX platform of the run's devices (``jax.Device.platform``).

    Raises:
      ValueError: an unknown backend, or one whose registry entry needs another platform, naming
        the backends that do run here (``xla``, and the entry's any-platform stand-in if it has
        one).
    """
    resolved = resolve_backend(backend, platform)
    if resolved.runs_on(platform):
        return
    options = "" if resolved.stand_in is None else " or --backend {} ({})".format(*resolved.stand_in)
    raise ValueError(f"--backend {backend}: the compiled kernel needs {resolved.device}, and this run's devices are "
                     f"{platform}; use --backend xla (runs everywhere){options}")
