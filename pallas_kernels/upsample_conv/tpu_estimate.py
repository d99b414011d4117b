"""The TPU upsampling-convolution kernel's time on the compiler's estimate, read from its final
bundles (the method of :mod:`pallas_kernels.causal_conv.tpu_estimate`; compiled in its own process
by :func:`pallas_kernels.window_attention.tpu_estimate.estimate`).

The kernel's loops: the grid loop, and inside it the row loop (the only one with MXU ops), run once
per input row. A row costs the larger of its bundles and its MXU floor (the padded ``[W, 3 Cin] x
[3 Cin, 3 P]`` product at the chip's peak); the rest of the grid loop runs once per grid step.
"""

from __future__ import annotations

from pallas_kernels.causal_conv.tpu_estimate import grid_and_row_loops, mxu_floor_cycles, rows_and_steps
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
    grid, row = grid_and_row_loops(bundles, "upsampling-convolution", geom)
    steps = geom.frames * geom.height // block_h
    cycles, note = rows_and_steps(grid, row, row_floor_cycles(geom, generation), geom.frames * geom.height, steps)
    return est.Estimate(cycles / chip.clock_hz + steps * tpu_aot.GRID_STEP_SECONDS, 0.0, steps, note)
