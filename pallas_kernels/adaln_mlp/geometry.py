"""The static shape of one adaLN MLP call, and the kernel name that carries it.

As for the convolutions (:mod:`pallas_kernels.causal_conv.geometry`), the TPU kernel's name in the
compiled HLO spells out its geometry, so a program's Mosaic calls can be priced from the HLO alone.
"""

from __future__ import annotations

import dataclasses
import re

from pallas_kernels.common import kernel_name_fields

KERNEL_PREFIX = "adaln_mlp_tpu"
"""Every TPU adaLN-MLP kernel's name starts with this."""

_NAME = re.compile(rf"^{KERNEL_PREFIX}_m(\d+)_d(\d+)_h(\d+)_f(\d+)(_res)?(_next)?$")


@dataclasses.dataclass(frozen=True)
class MLPGeometry:
    """One call: ``rows`` tokens (a batch's, flattened) of width ``dim`` through a ``dim -> hidden
    -> dim`` MLP, modulated and gated per frame of ``tokens_per_frame`` tokens; ``residual_input``:
    the call first adds a ``dim x dim`` projection to the residual; ``next_input``: the call also
    writes the next block's normalized, modulated input."""

    rows: int
    dim: int
    hidden: int
    tokens_per_frame: int
    next_input: bool = False
    residual_input: bool = False

    @property
    def flops(self) -> int:
        """Multiply-add FLOPs of the products: ``4 * rows * dim * hidden``, plus ``2 * rows * dim **
        2`` with the residual input."""
        return 4 * self.rows * self.dim * self.hidden + 2 * self.rows * self.dim ** 2 * self.residual_input


def kernel_name(geom: MLPGeometry) -> str:
    """The TPU kernel's name for ``geom`` (``adaln_mlp_tpu_m4680_d1536_h8960_f1560``, then
    ``_res`` where it adds a residual input and ``_next`` where it writes the next block's
    input)."""
    return (f"{KERNEL_PREFIX}_m{geom.rows}_d{geom.dim}_h{geom.hidden}_f{geom.tokens_per_frame}"
            f"{'_res' * geom.residual_input}{'_next' * geom.next_input}")


def geometry_of_kernel(name: str) -> MLPGeometry:
    """The :class:`MLPGeometry` a :func:`kernel_name` spells.

    Raises:
      ValueError: ``name`` is not one.
    """
    *sizes, residual_input, next_input = kernel_name_fields(
        _NAME, name, f"an adaLN-MLP kernel name ({KERNEL_PREFIX}_m.._d.._h.._f..[_res][_next])")
    return MLPGeometry(*(int(g) for g in sizes), next_input=next_input is not None,
                       residual_input=residual_input is not None)
