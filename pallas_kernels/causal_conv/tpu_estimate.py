"""The TPU causal-convolution kernel's time on the compiler's estimate, read from its final bundles
(the method and the dump of :mod:`pallas_kernels.window_attention.tpu_estimate`, whose
:func:`~pallas_kernels.window_attention.tpu_estimate.estimate` compiles a
:class:`~pallas_kernels.causal_conv.ConvGeometry` in its own process and calls
:func:`estimate_from_dump`).

The kernel's loops: the grid loop, and inside it the row loop (the only one with MXU ops), run
once per output row. A row costs the larger of its bundles and its MXU floor (the padded
``[W, 9 Cin] x [9 Cin, 3 CoP]`` product at the chip's peak: a row of few bundles cannot beat the
MXU); the rest of the grid loop (DMA issue, waits, the cache write, and the DMA loops of wide channels)
runs once per grid step. With an input norm, three loops (those with a reciprocal square root)
come before the row loop, each normalizing a frame's ``block_h + 2`` buffer
rows, :data:`~pallas_kernels.causal_conv.tpu.NORM_UNROLL` per iteration: the first two at a row
block's first frame only, the third at every step.
"""

from __future__ import annotations

from pallas_kernels.causal_conv.geometry import ConvGeometry, kernel_name
from pallas_kernels.common import cdiv, round_up

MXU_TILE = {"v5e": 128, "v6e": 256}
"""The MXU's tile edge per generation: a product's contraction and output sizes are padded to it."""


def mxu_floor_cycles(rows: int, contraction: int, columns: int, generation: str) -> float:
    """Cycles of a ``[rows, contraction] x [contraction, columns]`` product at the chip's bf16 MXU
    peak, its contraction and columns padded to the MXU tile."""
    from pallas_kernels import tpu_aot

    chip = tpu_aot.check_generation(generation)
    tile = MXU_TILE[generation]
    macs = rows * round_up(contraction, tile) * round_up(columns, tile)
    return macs / (chip.bf16_flops / 2 / chip.clock_hz)


def row_floor_cycles(geom: ConvGeometry, generation: str) -> float:
    """:func:`mxu_floor_cycles` of one output row's product ``[W, 9 Cin] x [9 Cin, P]``, ``P`` the
    packed weights' columns (:func:`~pallas_kernels.causal_conv.tpu.packed_columns`)."""
    from pallas_kernels.causal_conv.tpu import packed_columns

    return mxu_floor_cycles(geom.width, 9 * geom.in_channels, packed_columns(geom.out_channels), generation)


def grid_and_row_loops(bundles, what: str, geom) -> tuple[dict, dict]:
    """``(grid, row)``: the one grid loop of a convolution kernel's ``bundles`` and, inside it, its
    one row loop with MXU ops (no loop of its own inside).

    Raises:
      ValueError: the bundles have other loops; ``what`` and ``geom`` name the kernel in the message.
    """
    from pallas_kernels.window_attention import tpu_estimate as est

    tree = est.loop_tree(bundles)
    rows = [c for grid in tree for c in grid["children"] if c["mxu"]]
    if len(tree) != 1 or len(rows) != 1 or rows[0]["children"]:
        raise ValueError(f"the {what} kernel's bundles at {geom} do not have one grid loop around one row loop "
                         f"with MXU ops")
    return tree[0], rows[0]


def rows_and_steps(grid: dict, row: dict, floor: float, rows: int, steps: int, besides=()) -> tuple[float, str]:
    """``(cycles, note)`` of ``rows`` runs of the row loop, each the larger of its bundles and the
    MXU ``floor``, plus ``steps`` runs of the rest of the grid loop (less the loops ``besides``,
    priced apart)."""
    from pallas_kernels.window_attention import tpu_estimate as est

    per_step = est.span(grid) - est.span(row) - sum(est.span(c) for c in besides)
    note = (f"{steps} grid steps of {per_step} bundles outside the row loop; {rows} rows of max({row['own']} "
            f"bundles, MXU floor {floor:.0f} cycles)")
    return steps * per_step + rows * max(row["own"], floor), note


def estimate_from_dump(geom: ConvGeometry, block_h: int, generation: str, dump_dir: str):
    """Prices the kernel of ``geom`` (``block_h`` rows per grid step) from the final bundles of a
    compile for ``generation`` in ``dump_dir``: an
    :class:`~pallas_kernels.window_attention.tpu_estimate.Estimate`.

    Raises:
      ValueError: the bundles do not have the loops described in the module docstring.
    """
    from pallas_kernels import tpu_aot
    from pallas_kernels.causal_conv.tpu import NORM_UNROLL
    from pallas_kernels.window_attention import tpu_estimate as est

    chip = tpu_aot.check_generation(generation)
    bundles = est.parse_bundles(est.kernel_dump(dump_dir, kernel_name(geom)))
    grid, row = grid_and_row_loops(bundles, "causal-convolution", geom)
    norms = [c for c in grid["children"]
             if any("vrsqrt" in text for _, _, text in bundles[c["start"]:c["start"] + est.span(c)])]
    if len(norms) != 3 * geom.input_norm:
        raise ValueError(f"the causal-convolution kernel's bundles at {geom} have {len(norms)} norm loops "
                         f"(with a reciprocal square root), not {3 * geom.input_norm}")
    blocks = cdiv(geom.height, block_h)
    steps = blocks * geom.frames
    cycles, note = rows_and_steps(grid, row, row_floor_cycles(geom, generation), geom.height * geom.frames, steps,
                                  besides=norms)
    trips = (block_h + 2) // NORM_UNROLL
    norm = trips * (blocks * sum(est.span(c) for c in norms[:2]) + steps * sum(est.span(c) for c in norms[2:]))
    cycles += norm
    if geom.input_norm:
        note += f"; input norm {norm} bundles ({trips} iterations of {[c['own'] for c in norms]})"
    return est.Estimate(cycles / chip.clock_hz + steps * tpu_aot.GRID_STEP_SECONDS, 0.0, steps, note)
