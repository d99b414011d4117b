"""The TPU adaLN-MLP kernel's time on the compiler's estimate, read from its final bundles (the
method and the dump of :mod:`pallas_kernels.window_attention.tpu_estimate`, whose
:func:`~pallas_kernels.window_attention.tpu_estimate.estimate` compiles an
:class:`~pallas_kernels.adaln_mlp.MLPGeometry` in its own process and calls
:func:`estimate_from_dump`).

The kernel is one grid loop with no loop inside, run once per row block: a step costs the larger
of its bundles and its MXU floor (the block's two products at the chip's peak, padded to the MXU
tile: a step of few bundles cannot beat the MXU,
:func:`pallas_kernels.causal_conv.tpu_estimate.mxu_floor_cycles`).
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
    from pallas_kernels import tpu_aot
    from pallas_kernels.causal_conv.tpu_estimate import mxu_floor_cycles
    from pallas_kernels.window_attention import tpu_estimate as est

    chip = tpu_aot.check_generation(generation)
    bundles = est.parse_bundles(est.kernel_dump(dump_dir, kernel_name(geom)))
    tree = est.loop_tree(bundles)
    if len(tree) != 1 or tree[0]["children"]:
        raise ValueError(f"the adaLN-MLP kernel's bundles at {geom} are not one grid loop without inner loops")
    steps = geom.rows // rows_per_block
    floor = sum(mxu_floor_cycles(rows_per_block, k, n, generation)
                for k, n in ((geom.dim, geom.hidden), (geom.hidden, geom.dim)))
    step = max(tree[0]["own"], floor)
    note = f"{steps} grid steps of max({tree[0]['own']} bundles, MXU floor {floor:.0f} cycles)"
    return est.Estimate(steps * (step / chip.clock_hz + tpu_aot.GRID_STEP_SECONDS), 0.0, steps, note)
