"""The TPU q/k/v projection kernel's time on the compiler's estimate, read from its final bundles as
the adaLN MLP's is (:func:`pallas_kernels.adaln_mlp.tpu_estimate.matmul_grid_estimate`: one grid
loop, each step the larger of its bundles and its three products' MXU floor);
:func:`pallas_kernels.window_attention.tpu_estimate.estimate` compiles a
:class:`~pallas_kernels.qkv_projection.ProjectionGeometry` in its own process and calls
:func:`estimate_from_dump`.
"""

from __future__ import annotations

from pallas_kernels.adaln_mlp.tpu_estimate import matmul_grid_estimate
from pallas_kernels.qkv_projection.geometry import ProjectionGeometry, kernel_name


def estimate_from_dump(geom: ProjectionGeometry, rows_per_block: int, generation: str, dump_dir: str):
    """Prices the kernel of ``geom`` (``rows_per_block`` rows a grid step) from the final bundles
    of a compile for ``generation`` in ``dump_dir``: an
    :class:`~pallas_kernels.window_attention.tpu_estimate.Estimate`.

    Raises:
      ValueError: the bundles are not one grid loop without loops inside.
    """
    products = [(rows_per_block, geom.dim, n) for n in (geom.dim, geom.kv_dim, geom.kv_dim)]
    return matmul_grid_estimate(kernel_name(geom), geom.rows // rows_per_block, products, generation, dump_dir)
