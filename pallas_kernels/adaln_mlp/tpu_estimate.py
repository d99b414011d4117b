"""The TPU adaLN-MLP kernel's time on the compiler's estimate, read from its final bundles (the
method and the dump of :mod:`pallas_kernels.window_attention.tpu_estimate`, whose
:func:`~pallas_kernels.window_attention.tpu_estimate.estimate` compiles an
:class:`~pallas_kernels.adaln_mlp.MLPGeometry` in its own process and calls
:func:`estimate_from_dump`).

The kernel is one grid loop with no loop inside, run once per row block: a step costs the larger
of its bundles and its MXU floor (the block's two products at the chip's peak, padded to the MXU
tile: a step of few bundles cannot beat the MXU,
:func:`pallas_kernels.causal_conv.tpu_estimate.mxu_floor_cycles`); :func:`matmul_grid_estimate`
prices any kernel of that form (the cross query's too).
"""

from __future__ import annotations

from pallas_kernels.adaln_mlp.geometry import MLPGeometry, kernel_name


def estimate_from_dump(geom: MLPGeometry, rows_per_block: int, generation: str, dump_dir: str):
    """Prices the kernel of ``geom`` (``rows_per_block`` rows a grid step) from the final bundles
    of a compile for ``generation`` in ``dump_dir``: an
    :class:`~pallas_kernels.window_attention.tpu_estimate.Estimate`.

    Raises:
      ValueError: the bundles are not one grid loop without loops inside.
    """
    products = [(rows_per_block, geom.dim, geom.hidden), (rows_per_block, geom.hidden, geom.dim)]
    products += [(rows_per_block, geom.dim, geom.dim)] * geom.residual_input
    return matmul_grid_estimate(kernel_name(geom), geom.rows // rows_per_block, products, generation, dump_dir)


def matmul_grid_estimate(name: str, steps: int, products, generation: str, dump_dir: str):
    """The estimate of a kernel ``name`` (in ``dump_dir``'s bundles) that is one grid loop of
    ``steps`` steps without loops inside, each step the larger of its bundles and the MXU floor of
    its ``products`` (``(rows, contraction, columns)`` each), plus the grid-step overhead.

    Raises:
      ValueError: the bundles are not one grid loop without loops inside.
    """
    from pallas_kernels import tpu_aot
    from pallas_kernels.causal_conv.tpu_estimate import mxu_floor_cycles
    from pallas_kernels.window_attention import tpu_estimate as est

    chip = tpu_aot.check_generation(generation)
    tree = est.loop_tree(est.parse_bundles(est.kernel_dump(dump_dir, name)))
    if len(tree) != 1 or tree[0]["children"]:
        raise ValueError(f"the bundles of {name} are not one grid loop without inner loops")
    floor = sum(mxu_floor_cycles(*product, generation) for product in products)
    step = max(tree[0]["own"], floor)
    note = f"{steps} grid steps of max({tree[0]['own']} bundles, MXU floor {floor:.0f} cycles)"
    return est.Estimate(steps * (step / chip.clock_hz + tpu_aot.GRID_STEP_SECONDS), 0.0, steps, note)
