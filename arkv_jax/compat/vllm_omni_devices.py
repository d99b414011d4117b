"""vLLM-Omni's ``device=`` argument, as a JAX device.

vLLM-Omni takes a torch device or its string; :func:`resolve_device` maps ``None`` (bookkeeping
only), a :class:`jax.Device`, a platform string (``"cpu"``, ``"cuda"`` or ``"gpu"``, ``"tpu"``,
optionally ``":index"``, e.g. ``"cuda:1"``) or a ``torch.device`` (read duck-typed from ``.type``
and ``.index``; torch is never imported) to ``jax.devices(platform)[index]``, and refuses
anything else naming what this host has.

Part of :mod:`arkv_jax.compat.vllm_omni`, which re-exports :func:`resolve_device`; see
``docs/migrating-from-vllm-omni.md``.
"""

from __future__ import annotations

import re

import jax

__all__ = ["resolve_device"]

#: Platform strings vLLM-Omni users pass (torch's device types) -> JAX platform names.
_PLATFORMS = {"cpu": "cpu", "cuda": "gpu", "gpu": "gpu", "tpu": "tpu"}


def _available_platforms() -> list[str]:
    found = []
    for platform in ("cpu", "gpu", "tpu"):
        try:
            if jax.devices(platform):
                found.append(platform)
        except (RuntimeError, ValueError):
            pass
    return found


def resolve_device(device) -> jax.Device | None:
    """The JAX device for a vLLM-Omni-style ``device=`` argument.

    ``None`` stays ``None`` (bookkeeping only). A :class:`jax.Device` is used as is. A platform
    string ``"cpu"``, ``"cuda"`` (or ``"gpu"``) or ``"tpu"``, optionally with ``":index"`` (e.g.
    ``"cuda:1"``), maps to ``jax.devices(platform)[index]`` (index 0 by default). A
    ``torch.device`` is read duck-typed from its ``.type`` and ``.index``.

    Raises:
      TypeError: any other type (an int, a bool, ...).
      ValueError: a string that is not such a platform, a platform JAX does not have here, or an
        index past its devices; the message names ``device``, the value and what is available.
    """
    if device is None or isinstance(device, jax.Device):
        return device
    if isinstance(device, str):
        spec = device
    elif isinstance(getattr(device, "type", None), str) and not isinstance(device, (bool, int)):
        index = getattr(device, "index", None)  # a torch.device, read without importing torch
        spec = device.type if index is None else f"{device.type}:{index}"
    else:
        raise TypeError("device must be None, a jax.Device, a platform string ('cpu', 'cuda', 'cuda:1', "
                        f"'gpu', 'tpu') or a torch.device, got {type(device).__name__} {device!r}")
    match = re.fullmatch(r"(cpu|cuda|gpu|tpu)(?::(\d+))?", spec)
    if match is None:
        raise ValueError(f"device={device!r} is not a platform string: expected 'cpu', 'cuda', 'gpu' or 'tpu', "
                         "optionally followed by ':index' (e.g. 'cuda:1')")
    platform, index = _PLATFORMS[match[1]], int(match[2] or 0)
    try:
        devices = jax.devices(platform)
    except (RuntimeError, ValueError):
        devices = []
    if not devices:
        raise ValueError(f"device={device!r} asks for the JAX platform {platform!r}, which JAX does not have here; "
                         f"available platforms: {', '.join(_available_platforms())}")
    if index >= len(devices):
        raise ValueError(f"device={device!r} asks for {platform} device {index}, but JAX has {len(devices)} "
                         f"{platform} device{'s' if len(devices) != 1 else ''} here (indices 0..{len(devices) - 1})")
    return devices[index]
