"""The static shape of one upsampling-convolution call, and the kernel name that carries it (as
:mod:`pallas_kernels.causal_conv.geometry` does for the causal convolution: a program's Mosaic calls
are priced one shape at a time from the HLO alone)."""

from __future__ import annotations

import dataclasses
import re

from pallas_kernels.common import kernel_name_fields

KERNEL_PREFIX = "upsample_conv2d_tpu"
"""Every TPU upsampling-convolution kernel's name starts with this."""

_NAME = re.compile(rf"^{KERNEL_PREFIX}_t(\d+)_h(\d+)_w(\d+)_i(\d+)_o(\d+)$")


@dataclasses.dataclass(frozen=True)
class UpsampleGeometry:
    """One call: ``x`` ``[frames, height, width, in_channels]`` upsampled 2x and convolved by a
    ``[3, 3, in_channels, out_channels]`` kernel into ``[frames, 2 height, 2 width,
    out_channels]``."""

    frames: int
    height: int
    width: int
    in_channels: int
    out_channels: int

    @property
    def flops(self) -> int:
        """Multiply-add FLOPs at the input's resolution: ``2 * 9 * in * 4 out`` per input pixel
        (the four output phases of :func:`pallas_kernels.upsample_conv.xla.phase_kernel`)."""
        return 2 * 9 * self.in_channels * 4 * self.out_channels * self.frames * self.height * self.width


def kernel_name(geom: UpsampleGeometry) -> str:
    """The TPU kernel's name for ``geom`` (``upsample_conv2d_tpu_t4_h240_w416_i192_o96``)."""
    return (f"{KERNEL_PREFIX}_t{geom.frames}_h{geom.height}_w{geom.width}_i{geom.in_channels}"
            f"_o{geom.out_channels}")


def geometry_of_kernel(name: str) -> UpsampleGeometry:
    """The :class:`UpsampleGeometry` a :func:`kernel_name` spells.

    Raises:
      ValueError: ``name`` is not one.
    """
    fields = kernel_name_fields(
        _NAME, name, f"an upsampling-convolution kernel name ({KERNEL_PREFIX}_t.._h.._w.._i.._o..)")
    return UpsampleGeometry(*(int(g) for g in fields))
