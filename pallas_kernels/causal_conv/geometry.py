"""The static shape of one causal-convolution call, and the kernel name that carries it.

The TPU kernel's name in the compiled HLO (:func:`kernel_name`) spells out its geometry, so a
program's Mosaic calls can be priced one shape at a time from the HLO alone
(:func:`geometry_of_kernel`, used by :func:`arkv_jax.pipeline.attention_pricer`).
"""

from __future__ import annotations

import dataclasses
import re

from pallas_kernels.common import kernel_name_fields

KERNEL_PREFIX = "causal_conv3d_tpu"
"""Every TPU causal-convolution kernel's name starts with this."""

_NAME = re.compile(rf"^{KERNEL_PREFIX}_t(\d+)_h(\d+)_w(\d+)_i(\d+)_o(\d+)(_norm)?(_res)?$")


@dataclasses.dataclass(frozen=True)
class ConvGeometry:
    """One call: ``x`` ``[frames, height, width, in_channels]`` over a cache ``[2, height, width,
    in_channels]``, a ``[3, 3, 3, in_channels, out_channels]`` kernel; ``input_norm``: the call
    applies the channel norm and SiLU to its input first (``norm_gamma=``); ``residual``: it adds
    a residual to its output (``residual=``)."""

    frames: int
    height: int
    width: int
    in_channels: int
    out_channels: int
    input_norm: bool = False
    residual: bool = False

    @property
    def flops(self) -> int:
        """Multiply-add FLOPs of the call: ``2 * 27 * in * out`` per output pixel."""
        return 2 * 27 * self.in_channels * self.out_channels * self.frames * self.height * self.width


def kernel_name(geom: ConvGeometry) -> str:
    """The TPU kernel's name for ``geom`` (``causal_conv3d_tpu_t4_h480_w832_i96_o96``, then
    ``_norm`` with an input norm and ``_res`` with a residual)."""
    return (f"{KERNEL_PREFIX}_t{geom.frames}_h{geom.height}_w{geom.width}_i{geom.in_channels}"
            f"_o{geom.out_channels}{'_norm' * geom.input_norm}{'_res' * geom.residual}")


def geometry_of_kernel(name: str) -> ConvGeometry:
    """The :class:`ConvGeometry` a :func:`kernel_name` spells.

    Raises:
      ValueError: ``name`` is not one.
    """
    *sizes, norm, residual = kernel_name_fields(
        _NAME, name, f"a causal-convolution kernel name ({KERNEL_PREFIX}_t.._h.._w.._i.._o..[_norm][_res])")
    return ConvGeometry(*(int(g) for g in sizes), input_norm=norm is not None, residual=residual is not None)
