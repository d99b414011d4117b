"""Which kernel backends run on which platform: the commands' up-front refusal (``docs/kernels.md``).

``arkv-jax demo`` and ``arkv-jax generate`` both call :func:`check_backend` before they build or
load anything, so a compiled backend for another platform is refused in one line, not after a
checkpoint has loaded.
"""

from __future__ import annotations

from pallas_kernels.backend import BACKEND_NAMES, resolve_backend

#: The compiled kernel backends: the platform each needs, in JAX's name and in words.
COMPILED_BACKENDS = {
    "pallas_gpu": ("gpu", "an NVIDIA GPU"), "pallas_mgpu": ("gpu", "an NVIDIA Hopper GPU"),
    "cudnn_gather": ("gpu", "an NVIDIA GPU with cuDNN"), "pallas_tpu": ("tpu", "a TPU"),
    "pallas_tpu_gather": ("tpu", "a TPU"),
}


def check_backend(backend: str, platform: str) -> None:
    """Refuses a compiled kernel backend on devices of another platform.

    Raises:
      ValueError: an unknown backend, or a compiled one (:data:`COMPILED_BACKENDS`, or ``auto``
        resolving to one) on a platform other than its own, naming the backends that do run there.
    """
    resolved = resolve_backend(backend, platform)
    needs, device = COMPILED_BACKENDS.get(resolved.name, (platform, ""))
    if platform != needs:
        stand_ins = [f"--backend {name} ({why})" for name, why in (
            (f"{resolved.name}_interpret", "the same kernel under Pallas' interpreter, slow"),
            (f"{resolved.name}_xla", "the same gather with XLA's attention")) if name in BACKEND_NAMES]
        raise ValueError(f"--backend {backend}: the compiled kernel needs {device}, and this run's devices are "
                         f"{platform}; use --backend xla (runs everywhere)"
                         + "".join(f" or {option}" for option in stand_ins))
