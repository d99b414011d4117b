"""One dispatcher for every arkv-jax kernel: which implementation runs, and how.

Each kernel (paged chunk write, paged window attention) has a plain-XLA path, a Pallas TPU kernel
(Mosaic) and a Pallas GPU kernel. Callers pick one with a ``backend=`` string:

============================  ===========================================================
``"auto"``                    ``"pallas_tpu"`` on TPU, ``"pallas_gpu"`` on GPU, ``"xla"`` elsewhere
``"xla"``                     plain jnp/lax, runs everywhere (the CPU default)
``"pallas_tpu"``              the Mosaic TPU kernel, compiled (TPU only)
``"pallas_tpu_interpret"``    the TPU kernel lowered to XLA by Pallas' generic interpreter
``"pallas_tpu_simulate"``     the TPU kernel under the TPU simulator: DMAs and semaphores
                              emulated, races detected, out-of-bounds reads raise (slow; small
                              shapes only)
``"pallas_tpu_gather"``       window attention only: the visible pages gathered by XLA, then
                              jax's splash attention kernel, compiled (TPU only; the TPU
                              kernel's yardstick). The paged write runs the TPU kernel.
``"pallas_tpu_gather_interpret"``  the same with splash in interpret mode
``"pallas_gpu"``              the GPU kernel, compiled (NVIDIA GPU only)
``"pallas_gpu_interpret"``    the GPU kernel under Pallas' interpreter
============================  ===========================================================

Kernels take the resolved :class:`Backend` and pass ``backend.interpret`` straight to
``pl.pallas_call(..., interpret=...)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

BACKEND_NAMES = (
    "auto",
    "xla",
    "pallas_tpu",
    "pallas_tpu_interpret",
    "pallas_tpu_simulate",
    "pallas_tpu_gather",
    "pallas_tpu_gather_interpret",
    "pallas_gpu",
    "pallas_gpu_interpret",
)

_AUTO_BY_PLATFORM = {"tpu": "pallas_tpu", "gpu": "pallas_gpu", "cuda": "pallas_gpu"}


@dataclasses.dataclass(frozen=True)
class Backend:
    """A resolved backend choice.

    Attributes:
      name: the resolved name (never ``"auto"``), one of ``BACKEND_NAMES``.
      kind: ``"xla"``, ``"pallas_tpu"`` or ``"pallas_gpu"``: which implementation runs.
      interpret: the value for ``pl.pallas_call(interpret=...)``: ``False`` (compiled), ``True``
        (generic interpreter) or a ``pltpu.InterpretParams`` (TPU simulator).
    """

    name: str
    kind: str
    interpret: Any


def tpu_simulator_params() -> Any:
    """The TPU simulator settings used by ``"pallas_tpu_simulate"``: race detection on,
    out-of-bounds reads raise, uninitialised memory reads as NaN."""
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.InterpretParams(
        detect_races=True, out_of_bounds_reads="raise", uninitialized_memory="nan"
    )


def resolve_backend(name: str = "auto", platform: str | None = None) -> Backend:
    """Turns a ``backend=`` string into a :class:`Backend`.

    Args:
      name: one of ``BACKEND_NAMES``.
      platform: the JAX platform to resolve ``"auto"`` for (``"cpu"``, ``"gpu"``, ``"tpu"``);
        defaults to ``jax.default_backend()``.

    Raises:
      ValueError: ``name`` is not a known backend.
    """
    if name not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {name!r}")
    if name == "auto":
        name = _AUTO_BY_PLATFORM.get(platform or jax.default_backend(), "xla")
    if name == "xla":
        return Backend(name, "xla", False)
    kind = "pallas_tpu" if name.startswith("pallas_tpu") else "pallas_gpu"
    if name == "pallas_tpu_simulate":
        interpret: Any = tpu_simulator_params()
    else:
        interpret = name.endswith("_interpret")
    return Backend(name, kind, interpret)
