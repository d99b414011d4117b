"""The backend registry of the kernels: each ``backend=`` name, the platform it needs, how it runs.

A backend name names a *platform path*, one choice for a whole run (``--backend`` of ``arkv-jax
demo``/``generate``, ``PagedKVCache(backend=...)``), the same string for both kernels; each kernel
runs its own implementation of that path from its ``IMPLEMENTATIONS`` table, which has exactly the
names of :data:`BACKENDS`. A :class:`Backend` records what the path as a whole needs (the stricter
of the two kernels' needs). The kernels do not check the platform: :meth:`Backend.runs_on` is the
question to ask before a run (``arkv_jax.apps.platforms.check_backend`` asks it). What every name
runs for each kernel, and what ``"auto"`` resolves to, is tabled in ``docs/kernels.md`` (Backends).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp

GPU_PLATFORMS = ("gpu", "cuda")
"""Platform names of an NVIDIA GPU as ``jax.default_backend()`` and ``lowering_platforms`` spell
them."""

CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
"""Dtypes cuDNN attention takes."""

MODES = ("compiled", "interpret", "simulate")
"""How a backend's Pallas kernels run (:attr:`Backend.mode`)."""


@dataclasses.dataclass(frozen=True)
class Backend:
    """One backend of the registry (:data:`BACKENDS`), or a resolved ``backend=`` choice.

    Attributes:
      name: the name (never ``"auto"``), a key of :data:`BACKENDS`.
      kind: the family whose argument rules the kernels' static validation applies: ``"xla"``,
        ``"pallas_tpu"`` (also the ``pallas_tpu_gather*`` names), ``"pallas_gpu"`` (Triton),
        ``"cudnn_gather"`` or ``"pallas_mgpu"`` (Mosaic GPU).
      platform: the JAX platform the backend needs (``"tpu"`` or ``"gpu"``), or ``None`` where it
        runs on any platform.
      device: what :attr:`platform` means in words (``"a TPU"``, ``"an NVIDIA GPU"``), for
        messages; ``""`` where ``platform`` is ``None``.
      mode: ``"compiled"`` (also the non-Pallas backends), ``"interpret"`` (Pallas' generic
        interpreter) or ``"simulate"`` (the TPU simulator), one of :data:`MODES`.
      stand_in: for a backend with a platform, the backend that runs the same path on any platform
        and what it changes, ``(name, words)``, for messages; ``None`` where there is none.
    """

    name: str
    kind: str
    platform: str | None = None
    device: str = ""
    mode: str = "compiled"
    stand_in: tuple[str, str] | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if (self.platform is None) != (self.device == ""):
            raise ValueError(f"backend {self.name!r}: device words go with a platform and only "
                             f"with one, got platform={self.platform!r}, device={self.device!r}")

    @property
    def interpret(self) -> Any:
        """The value for ``pl.pallas_call(interpret=...)``: ``False`` (compiled; also the
        non-Pallas backends), ``True`` (generic interpreter) or a ``pltpu.InterpretParams``
        (:func:`tpu_simulator_params`)."""
        if self.mode == "simulate":
            return tpu_simulator_params()
        return self.mode == "interpret"

    def runs_on(self, platform: str) -> bool:
        """Whether the backend runs on devices of JAX platform ``platform`` (``"cpu"``,
        ``"gpu"``/``"cuda"``, ``"tpu"``, as ``jax.Device.platform`` spells it)."""
        if self.platform is None:
            return True
        if self.platform == "gpu":
            return platform in GPU_PLATFORMS
        return platform == self.platform


_INTERPRETER = "the same kernel under Pallas' interpreter, slow"

BACKENDS: Mapping[str, Backend] = MappingProxyType({backend.name: backend for backend in (
    Backend("xla", "xla"),
    Backend("pallas_tpu", "pallas_tpu", "tpu", "a TPU",
            stand_in=("pallas_tpu_interpret", _INTERPRETER)),
    Backend("pallas_tpu_interpret", "pallas_tpu", mode="interpret"),
    Backend("pallas_tpu_simulate", "pallas_tpu", mode="simulate"),
    Backend("pallas_tpu_gather", "pallas_tpu", "tpu", "a TPU",
            stand_in=("pallas_tpu_gather_interpret", _INTERPRETER)),
    Backend("pallas_tpu_gather_interpret", "pallas_tpu", mode="interpret"),
    Backend("pallas_gpu", "pallas_gpu", "gpu", "an NVIDIA GPU",
            stand_in=("pallas_gpu_interpret", _INTERPRETER)),
    Backend("pallas_gpu_interpret", "pallas_gpu", mode="interpret"),
    Backend("cudnn_gather", "cudnn_gather", "gpu", "an NVIDIA GPU with cuDNN",
            stand_in=("cudnn_gather_xla", "the same gather with XLA's attention")),
    Backend("cudnn_gather_xla", "cudnn_gather"),
    Backend("pallas_mgpu", "pallas_mgpu", "gpu", "an NVIDIA Hopper GPU"),
)})
"""The registry (read only): every backend name (``"auto"`` aside) and its :class:`Backend`, in
the order of :data:`BACKEND_NAMES`. Each kernel's ``IMPLEMENTATIONS`` table has exactly these
keys."""

BACKEND_NAMES = ("auto", *BACKENDS)
"""Every value ``backend=`` takes: ``"auto"`` and the names of :data:`BACKENDS`."""


def tpu_kernel_else_xla(tpu_impl: Callable, xla_impl: Callable) -> Mapping[str, Callable]:
    """A kernel's ``IMPLEMENTATIONS`` table (read only, every name of :data:`BACKENDS`) for a kernel
    whose every TPU name (kind ``"pallas_tpu"``) runs its Mosaic kernel, ``tpu_impl``, and every
    other name plain XLA, ``xla_impl`` (on a GPU, XLA calls cuDNN's convolutions itself)."""
    return MappingProxyType({name: tpu_impl if backend.kind == "pallas_tpu" else xla_impl
                             for name, backend in BACKENDS.items()})


def tpu_simulator_params() -> Any:
    """The TPU simulator settings used by ``"pallas_tpu_simulate"``: race detection on,
    out-of-bounds reads raise, uninitialised memory reads as NaN."""
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.InterpretParams(
        detect_races=True, out_of_bounds_reads="raise", uninitialized_memory="nan"
    )


def cudnn_supports(dtype, head_dim: int) -> bool:
    """Whether cuDNN attention takes ``dtype`` and ``head_dim`` (bf16/f16, a multiple of 8 in
    ``[8, 256]``; jax itself rejects ``head_dim > 128`` before Hopper)."""
    return jnp.dtype(dtype) in CUDNN_DTYPES and head_dim % 8 == 0 and 8 <= head_dim <= 256


def _auto_gpu_attention(dtype, head_dim: int) -> str:
    """The window-attention backend ``"auto"`` picks on an NVIDIA GPU (the ``"auto"`` table of
    ``docs/kernels.md``)."""
    if cudnn_supports(dtype, head_dim):
        return "cudnn_gather"
    if head_dim >= 16 and not head_dim & (head_dim - 1):
        return "pallas_gpu"
    return "xla"


def resolve_backend(name: str = "auto", platform: str | None = None, *, dtype=None,
                    head_dim: int | None = None) -> Backend:
    """Turns a ``backend=`` string into its :class:`Backend` of :data:`BACKENDS`.

    Args:
      name: one of ``BACKEND_NAMES``.
      platform: the JAX platform to resolve ``"auto"`` for (``"cpu"``, ``"gpu"``, ``"tpu"``);
        defaults to ``jax.default_backend()``.
      dtype, head_dim: the window-attention call's dtype and head dim; with both given, ``"auto"``
        on a GPU follows the ``"auto"`` table of ``docs/kernels.md``. Without them it is
        ``"cudnn_gather"`` (the paged write runs its scatter under that name).

    Raises:
      ValueError: ``name`` is not a known backend.
    """
    if name not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {name!r}")
    if name == "auto":
        platform = platform or jax.default_backend()
        if platform == "tpu":
            name = "pallas_tpu"
        elif platform in GPU_PLATFORMS:
            name = ("cudnn_gather" if dtype is None or head_dim is None
                    else _auto_gpu_attention(dtype, head_dim))
        else:
            name = "xla"
    return BACKENDS[name]
