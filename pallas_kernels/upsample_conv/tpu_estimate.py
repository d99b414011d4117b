"""The TPU upsampling-convolution kernel's time on the compiler's estimate, read from its final
bundles (the method of :mod:`pallas_kernels.causal_conv.tpu_estimate`; compiled in its own process
by :func:`pallas_kernels.window_attention.tpu_estimate.estimate`).

The kernel's loops: the grid loop, and inside it the row loop (the only one with MXU ops), run once
per input row. A row costs the larger of its bundles and its MXU floor (the padded ``[W, 3 Cin] x
[3 Cin, 3 P]`` product at the chip's peak); the rest of the grid loop runs once per grid step.
"""

from __future__ import annotations

from pallas_kernels.causal_conv.tpu_estimate import mxu_floor_cycles
from pallas_kernels.common import round_up
from pallas_kernels.upsample_conv.geometry import UpsampleGeometry, kernel_name


def row_floor_cycles(geom: UpsampleGeometry, generation: str) -> float:
    """:func:`~pallas_kernels.causal_conv.tpu_estimate.mxu_floor_cycles` of one input row's product."""
    from pallas_kernels.upsample_conv.tpu import LANES

    return mxu_floor_cycles(geom.width, 3 * geom.in_channels, 3 * round_up(4 * geom.out_channels, LANES),
                            generation)


def estimate_from_dump(geom: UpsampleGeometry, block_h: int, generation: str, dump_dir: str):
    """Prices the kernel of ``geom`` (``block_h`` input rows per grid step) from the final bundles
    of a compile for ``generation`` in ``dump_dir``: an
    :class:`~pallas_kernels.window_attention.tpu_estimate.Estimate`.

    Raises:
      ValueError: the bundles do not have the loops described in the module docstring.
    """
    from pallas_kernels import tpu_aot
    from pallas_kernels.window_attention import tpu_estimate as est

    chip = tpu_aot.check_generation(generation)
    bundles = est.parse_bundles(est.kernel_dump(dump_dir, kernel_name(geom)))
    tree = est.loop_tree(bundles)
    rows = [c for grid in tree for c in grid["children"] if c["mxu"]]
    if len(tree) != 1 or len(rows) != 1 or rows[0]["children"]:
        raise ValueError(f"the upsampling-convolution kernel's bundles at {geom} do not have one grid loop "
                         f"around one row loop with MXU ops")
    grid, row = tree[0], rows[0]
    per_step = est.span(grid) - est.span(row)
    floor = row_floor_cycles(geom, generation)
    per_row = max(row["own"], floor)
    steps = geom.frames * geom.height // block_h
    cycles = steps * per_step + geom.frames * geom.height * per_row
    note = (f"{steps} grid steps of {per_step} bundles outside the row loop; {geom.frames * geom.height} rows "
            f"of max({row['own']} bundles, MXU floor {floor:.0f} cycles)")
    return est.Estimate(cycles / chip.clock_hz + steps * tpu_aot.GRID_STEP_SECONDS, 0.0, steps, note)
