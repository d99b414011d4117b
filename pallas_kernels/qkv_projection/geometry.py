"""The static shape of one q/k/v projection call, and the kernel name that carries it.

As for the adaLN MLP (:mod:`pallas_kernels.adaln_mlp.geometry`), the TPU kernel's name in the
compiled HLO spells out its geometry, so a program's Mosaic calls can be priced from the HLO alone.
"""

from __future__ import annotations

import dataclasses
import re

from pallas_kernels.common import kernel_name_fields

KERNEL_PREFIX = "qkv_projection_tpu"
"""Every TPU q/k/v projection kernel's name starts with this."""

_NAME = re.compile(rf"^{KERNEL_PREFIX}_m(\d+)_d(\d+)_k(\d+)$")


@dataclasses.dataclass(frozen=True)
class ProjectionGeometry:
    """One call: ``rows`` tokens (a batch's, flattened) of width ``dim`` projected to ``dim``-wide
    queries and ``kv_dim``-wide keys and values."""

    rows: int
    dim: int
    kv_dim: int

    @property
    def flops(self) -> int:
        """Multiply-add FLOPs of the three products: ``2 * rows * dim * (dim + 2 * kv_dim)``."""
        return 2 * self.rows * self.dim * (self.dim + 2 * self.kv_dim)


def kernel_name(geom: ProjectionGeometry) -> str:
    """The TPU kernel's name for ``geom`` (``qkv_projection_tpu_m4680_d1536_k1536``)."""
    return f"{KERNEL_PREFIX}_m{geom.rows}_d{geom.dim}_k{geom.kv_dim}"


def geometry_of_kernel(name: str) -> ProjectionGeometry:
    """The :class:`ProjectionGeometry` a :func:`kernel_name` spells.

    Raises:
      ValueError: ``name`` is not one.
    """
    sizes = kernel_name_fields(_NAME, name, f"a q/k/v projection kernel name ({KERNEL_PREFIX}_m.._d.._k..)")
    return ProjectionGeometry(*(int(g) for g in sizes))
