"""The static shape of one cross-query call, and the kernel name that carries it.

As for the adaLN MLP (:mod:`pallas_kernels.adaln_mlp.geometry`), the TPU kernel's name in the
compiled HLO spells out its geometry, so a program's Mosaic calls can be priced from the HLO alone.
"""

from __future__ import annotations

import dataclasses
import re

from pallas_kernels.common import kernel_name_fields

KERNEL_PREFIX = "cross_query_tpu"
"""Every TPU cross-query kernel's name starts with this."""

_NAME = re.compile(rf"^{KERNEL_PREFIX}_m(\d+)_d(\d+)_f(\d+)$")


@dataclasses.dataclass(frozen=True)
class QueryGeometry:
    """One call: ``rows`` tokens (a batch's, flattened) of width ``dim``, gated per frame of
    ``tokens_per_frame`` tokens, through two ``dim x dim`` projections."""

    rows: int
    dim: int
    tokens_per_frame: int

    @property
    def flops(self) -> int:
        """Multiply-add FLOPs of the two products: ``4 * rows * dim ** 2``."""
        return 4 * self.rows * self.dim * self.dim


def kernel_name(geom: QueryGeometry) -> str:
    """The TPU kernel's name for ``geom`` (``cross_query_tpu_m4680_d1536_f1560``)."""
    return f"{KERNEL_PREFIX}_m{geom.rows}_d{geom.dim}_f{geom.tokens_per_frame}"


def geometry_of_kernel(name: str) -> QueryGeometry:
    """The :class:`QueryGeometry` a :func:`kernel_name` spells.

    Raises:
      ValueError: ``name`` is not one.
    """
    sizes = kernel_name_fields(_NAME, name, f"a cross-query kernel name ({KERNEL_PREFIX}_m.._d.._f..)")
    return QueryGeometry(*(int(g) for g in sizes))
