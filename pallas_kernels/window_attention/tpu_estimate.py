"""The TPU attention kernels' time on the compiler's estimate, read from their final VLIW bundles.

libtpu writes each Mosaic kernel's final bundles with ``--xla_jf_dump_llo_text``; counting the
bundles of each loop body times its trip count, at the chip clock, plus
:data:`~pallas_kernels.tpu_aot.GRID_STEP_SECONDS` per grid step, gives a time that assumes one
bundle per cycle (no MXU latency stalls, no VMEM bank conflicts), never less than the paged
kernel's matmuls take at the MXUs' peak (:func:`mxu_cycles`). The first history block's DMA of
each grid step is added where the current chunk's loops do not hide it; later blocks are prefetched
behind compute. :func:`estimate` compiles one call in its own process (the dump flag must be set
before libtpu starts) and prices it; the bundle parsing is shared with ``benchmarks/tpu_compile.py``.
See ``docs/kernels.md`` (Compiling for TPU without one).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

from pallas_kernels.adaln_mlp.geometry import MLPGeometry
from pallas_kernels.causal_conv.geometry import ConvGeometry
from pallas_kernels.context_attention import ContextGeometry
from pallas_kernels.cross_query.geometry import QueryGeometry
from pallas_kernels.qkv_projection.geometry import ProjectionGeometry
from pallas_kernels.upsample_conv.geometry import UpsampleGeometry
from pallas_kernels.window_attention.geometry import WindowGeometry

_BUNDLE = re.compile(r"^\s*(0x[0-9a-f]+|\d+)\s+(?:(LB|LH|LE|PB|PF|CT):|:)\s*(>*)\s*\{(.*)$")


def parse_bundles(path: str) -> list[tuple[str, int, str]]:
    """``(marker, loop depth, text)`` of every bundle of a ``*final_bundles.txt`` dump."""
    out = []
    with open(path) as lines:
        for line in lines:
            m = _BUNDLE.match(line)
            if m:
                out.append((m.group(2) or "", len(m.group(3)), m.group(4)))
    return out


LOOP_DIP = 4
"""Bundles a loop body may dip below its loop depth for (a software-pipelined loop's predicated
bundles carry one ``>`` fewer) before the loop counts as ended."""


def loop_tree(bundles) -> list[dict]:
    """The loops of a kernel in program order: ``{"start", "depth", "own", "children"}``, where
    ``own`` counts the loop body's bundles outside nested loops. Empty bundles stay in their loop;
    a bundle below the loop's depth ends it unless the loop's depth returns, without a new loop
    starting, within :data:`LOOP_DIP` bundles."""
    depths = [stack_depth for _, stack_depth, _ in bundles]

    def ends(i: int, depth: int) -> bool:
        for j in range(i + 1, min(i + 1 + LOOP_DIP, len(bundles))):
            if bundles[j][2].strip().startswith("}"):
                continue
            if bundles[j][0] == "LB":
                return True
            if depths[j] >= depth:
                return False
        return True

    loops, stack = [], []
    for i, (mark, depth, text) in enumerate(bundles):
        if text.strip().startswith("}"):
            depth = stack[-1]["depth"] if stack else 0
        while stack and ((depth < stack[-1]["depth"] and ends(i, stack[-1]["depth"]))
                         or (depth == stack[-1]["depth"] and mark == "LB")):
            stack.pop()
        if mark == "LB":
            node = dict(start=i, depth=depth, own=0, children=[], mxu=0)
            (stack[-1]["children"] if stack else loops).append(node)
            stack.append(node)
        if stack:
            stack[-1]["own"] += 1
            if "vmatmul" in text:
                stack[-1]["mxu"] += 1
    return loops


def kernel_dump(dump_dir: str, name: str) -> str:
    """The final-bundles file of the Mosaic kernel ``name`` in a libtpu dump directory.

    Raises:
      FileNotFoundError: the dump has none.
    """
    files = sorted(glob.glob(os.path.join(dump_dir, f"*{name}*final_bundles.txt")))
    files = [f for f in files if "schedule-analysis" not in f]
    if not files:
        raise FileNotFoundError(f"no final bundles of {name} in {dump_dir}")
    return files[-1]


def _with_mxu(node) -> bool:
    return node["mxu"] > 0 or any(_with_mxu(c) for c in node["children"])


def attention_cycles(tree, trips: dict, bundles) -> tuple[float, float, str]:
    """``(cycles, tail cycles, note)`` of one grid step of the paged kernel, every page full; the
    tail cycles are those of the tail's chunks, which run while the first history block's DMAs
    are in flight.

    Tree: the grid loop; inside it the DMA-issue loops (no MXU op; ``pages_per_block`` trips,
    absent where unrolled), the tail's first chunk, its other whole chunks (unrolled into the same
    region, or a loop of ``trips["full_tail"]`` trips), the tail remainder, the history-block loop
    and last the pooled chunk's pieces (which take the tail remainder's place where pages have
    remainders). A history block of full pages computes its chunks unmasked in one region of the
    block loop's own bundles; its other child loops are DMA loops and, last, the page loop of
    blocks with a partial page (not counted: every page is full here). The grid loop's updates (the
    tail's, the pooled pieces) are all taken. With one softmax sub-block (``trips["sub_blocks"] ==
    1``) an update is a predicated region of its loop's own bundles, cut at the region fallthroughs
    (``PF``, :func:`_fast_own`); with several it is a sub-block loop (``sub_blocks`` trips), a child
    without MXU loops of its own. Work a (row, head) does at its first query block only, the tail's
    rotation where the kernel rotates (the grid loop's segment without MXU ops and with lane
    rotations, :func:`_fast_own`), counts once per ``trips["q_blocks"]`` steps. Under fixed row
    maxima (``trips["retry"]``) the grid loop's last loop with MXU ops is the online pass of a step
    that overflowed, 0 trips otherwise, and is not counted; the overflow check before it is.
    """
    grid, sub, dma = tree[0], trips["sub_blocks"], trips["pages_per_block"]
    if trips["retry"]:  # The online pass of an overflowing step, the grid loop's last loop, runs 0 times.
        online = [c for c in grid["children"] if _with_mxu(c)][-1]
        grid = dict(grid, children=[c for c in grid["children"] if c is not online])

    def cost(node, loop_trips: int, kind: str) -> float:
        kids = node["children"]
        per = _fast_own(bundles, node, trips["q_blocks"] if kind == "grid" else 1)
        per += sum(cost(c, dma, "dma") for c in kids if not _with_mxu(c))
        updates = [c for c in kids if _with_mxu(c)]  # Sub-block loops.
        if kind == "history":  # The last is the page loop of blocks with a partial page.
            updates = updates[:-1]
        return loop_trips * (per + sum(cost(c, sub, "sub") for c in updates))

    loops = [c for c in grid["children"] if _with_mxu(c) and (_mxu_children(c) or sub == 1)]
    history, tails = loops[-1], loops[:-1]
    tail_loops = sum(cost(t, trips["full_tail"], "tail") for t in tails)
    rest = cost(dict(grid, children=[c for c in grid["children"] if c not in loops]), 1, "grid")
    # The tail's chunks are the grid loop's updates before the history-block loop.
    tail_cycles = tail_loops + sum(cost(c, sub, "sub") for c in grid["children"]
                                   if c not in loops and _with_mxu(c) and c["start"] < history["start"])
    tail_cycles += sum(len(seg) for seg in _segments(bundles, grid) if seg[0] < history["start"]
                       and _has(bundles, seg, "vmatmul"))
    hist = cost(history, trips["blocks"], "history")
    note = (f"grid loop {rest:.0f} bundles/step (the tail's unrolled chunks, DMA issue and the pooled chunk "
            f"included); tail chunk loop x{trips['full_tail']} of {[round(cost(t, 1, 'tail')) for t in tails]}; "
            f"{trips['blocks']} history blocks of {hist / max(trips['blocks'], 1):.0f} bundles "
            f"({trips['pages_per_block']} full pages each; {sub} sub-block(s)); the tail's chunks {tail_cycles:.0f}")
    return rest + tail_loops + hist, tail_cycles, note


def _segments(bundles, node) -> list[list[int]]:
    """The bundle indices of ``node``'s body outside its child loops, cut at ``PF`` markers."""
    start, end = node["start"], node["start"] + span(node)
    inside = set()
    for child in node["children"]:
        inside.update(range(child["start"], child["start"] + span(child)))
    segments, current = [], []
    for i in (i for i in range(start, end) if i not in inside):
        if bundles[i][0] == "PF" and current:
            segments.append(current)
            current = []
        current.append(i)
    segments.append(current)
    return segments


def _has(bundles, segment: list[int], op: str) -> bool:
    """Whether a bundle of ``segment`` (indices into ``bundles``) issues ``op``."""
    return any(op in bundles[i][2] for i in segment)


def _mxu_children(node) -> bool:
    return any(_with_mxu(c) for c in node["children"])


def span(node) -> int:
    """Bundles of a :func:`loop_tree` node, its child loops included."""
    return node["own"] + sum(span(c) for c in node["children"])


def _fast_own(bundles, node, q_blocks: int = 1) -> float:
    """Bundles of ``node``'s body outside its child loops (see :func:`attention_cycles`), its
    segments cut at ``PF`` markers (:func:`_segments`): a segment with lane rotations and no MXU op
    (the tail's rotation at a (row, head)'s first query block) counts ``1 / q_blocks``, every other
    segment whole."""
    segments = _segments(bundles, node)
    return sum(len(seg) / (q_blocks if not _has(bundles, seg, "vmatmul") and _has(bundles, seg, "vrot") else 1)
               for seg in segments)


@dataclasses.dataclass(frozen=True)
class Estimate:
    """One paged-attention call on the compiler's estimate.

    Attributes:
      kernel_seconds: the kernel's bundles x trips at the chip clock, plus the grid-step overhead.
      dma_seconds: the first history block's DMA per grid step that the chunk's loops do not hide.
      grid_steps: rows x KV heads x query blocks.
      note: how the bundles were counted.
    """

    kernel_seconds: float
    dma_seconds: float
    grid_steps: int
    note: str

    @property
    def seconds(self) -> float:
        return self.kernel_seconds + self.dma_seconds


def loop_trips(geom, plan) -> dict:
    """The trip counts :func:`attention_cycles` needs for the kernel of ``geom``
    (:class:`~pallas_kernels.window_attention.tpu.Geometry`) tiled by ``plan``."""
    # A tail-chunk loop (a tail too long to unroll) computes the tail's whole chunks after the first.
    return dict(full_tail=max(geom.tail_len // plan.block_kv_compute - 1, 0), pages_per_block=plan.pages_per_block,
                retry=plan.fixed_row_max,
                q_blocks=plan.num_q_blocks,
                sub_blocks=geom.group * plan.block_q // plan.block_q_compute,
                blocks=-(-geom.max_pages // plan.pages_per_block))


def mxu_cycles(geom, plan, chip) -> float:
    """Cycles of one grid step's matmuls at the MXUs' peak rate (``chip.bf16_flops``), every page
    full: ``Q K^T`` and ``P V`` (V widened by its ones under ``mxu_row_sums``) over the step's
    padded query rows and every key slot. One bundle a cycle undercounts where matmul pushes
    queue behind a busy MXU, so this floors the bundle count."""
    from pallas_kernels.window_attention import tpu as twa

    keys = plan.tail_pad + geom.max_pages * geom.block_size
    flops = 2 * geom.group * plan.block_q * keys * (geom.head_dim + twa.plan_v_lanes(geom, plan))
    return flops / (chip.bf16_flops / chip.clock_hz)


def estimate_from_dump(geom: WindowGeometry, dtype: str, generation: str, dump_dir: str,
                       kv_dtype: str | None = None, rope: bool = False, qk_norm: bool = False) -> Estimate:
    """Prices the paged kernel of ``geom`` computing in ``dtype`` over pages stored as ``kv_dtype``
    (default ``dtype``; a quantized dtype for quantized pools) from the final bundles of a compile
    for ``generation`` in ``dump_dir`` (its tiling is the one
    :func:`~pallas_kernels.window_attention.tpu.plan_call` gives that chip). Quantized pages'
    dequantization loop, a child of the history-block loop without MXU ops, counts once per page
    of a block, like the DMA loops; their DMAs move the stored bytes. ``rope``, ``qk_norm``: the
    call had rotary tables and RMS norms (:attr:`~pallas_kernels.window_attention.tpu.Geometry.rotates`,
    ``normalizes``)."""
    from pallas_kernels import tpu_aot
    from pallas_kernels.window_attention import tpu as twa

    chip = tpu_aot.check_generation(generation)
    geom, plan, _ = twa.plan_rotating_call(twa.Geometry.of(geom, dtype, kv_dtype, rope, qk_norm), generation)
    bundles = parse_bundles(kernel_dump(dump_dir, "window_attention_tpu"))
    per_step, tail, note = attention_cycles(loop_tree(bundles), loop_trips(geom, plan), bundles)
    floor = mxu_cycles(geom, plan, chip)
    if floor > per_step:
        note += f"; MXU-bound: {floor:.0f} cycles/step of matmuls over {per_step:.0f} bundles"
        per_step = floor
    steps = geom.rows * geom.kv_heads * plan.num_q_blocks
    first = 2 * min(plan.pages_per_block, geom.max_pages) * geom.block_size * geom.head_dim * geom.kv_itemsize
    exposed = max(0.0, first / chip.hbm_bytes_per_s - tail / chip.clock_hz)
    return Estimate(steps * (per_step / chip.clock_hz + tpu_aot.GRID_STEP_SECONDS), steps * exposed, steps, note)


def context_estimate_from_dump(geom: ContextGeometry, dtype: str, generation: str, dump_dir: str) -> Estimate:
    """Prices the context-attention kernel (:mod:`pallas_kernels.context_attention.tpu`) of ``geom``
    from the final bundles of a compile for ``generation`` in ``dump_dir``: its grid loop, its only
    loop, times the grid steps (its query block is the default one)."""
    from pallas_kernels import tpu_aot
    from pallas_kernels.context_attention import tpu as ctx

    chip = tpu_aot.check_generation(generation)
    grid = loop_tree(parse_bundles(kernel_dump(dump_dir, "context_attention_tpu")))
    per_step = sum(span(loop) for loop in grid)
    block_q = ctx.default_block_q(geom.q_len, geom.group, geom.kv_len)
    steps = geom.rows * geom.kv_heads * -(-geom.q_len // block_q)
    note = f"{steps} grid steps of {per_step} bundles (query blocks of {block_q})"
    return Estimate(steps * (per_step / chip.clock_hz + tpu_aot.GRID_STEP_SECONDS), 0.0, steps, note)


def call_specs(geom: WindowGeometry | ContextGeometry, dtype: str, rope: bool = False,
               qk_norm: bool = False) -> list[tuple[tuple[int, ...], str]]:
    """``(shape, dtype)`` of the arguments of one call of ``geom``: for window attention ``q,
    k_cur, v_cur, k_pool, v_pool, pages, lengths, layer`` (then ``extra_k, extra_v`` with extra
    tokens, the rotary tables ``cos, sin`` with ``rope``, then ``q_inv_rms, k_inv_rms, q_gain,
    k_gain`` with ``qk_norm``, the gains in ``dtype``), for context attention ``q, k, v``."""
    from pallas_kernels.layout import pool_shape

    h, d = geom.kv_heads, geom.head_dim
    q = ((geom.rows, geom.q_len, geom.num_q_heads, d), dtype)
    if isinstance(geom, ContextGeometry):
        return [q] + [((geom.rows, geom.kv_len, h, d), dtype)] * 2
    pool = pool_shape(geom.num_layers, geom.num_pages, geom.block_size, h, d)
    kv = ((geom.rows, geom.cur_len, h, d), dtype)
    specs = [q, kv, kv, (pool, dtype), (pool, dtype),
             ((geom.rows, geom.max_pages), "int32"), ((geom.rows,), "int32"), ((), "int32")]
    specs += [((geom.rows, geom.num_extra, h, d), dtype)] * 2 * bool(geom.num_extra)
    specs += [((geom.rows, geom.q_len, d), "float32")] * 2 * rope
    norms = [((geom.rows, geom.q_len), "float32"), ((geom.rows, geom.cur_len), "float32"),
             ((geom.num_q_heads * d,), dtype), ((h * d,), dtype)]
    return specs + norms * qk_norm


def _compile_and_price_conv(geom: ConvGeometry, dtype: str, generation: str, dump_dir: str) -> Estimate:
    """In the worker process: compiles one causal convolution of ``geom`` (its default row block,
    the frames and the cache row-major, the cache donated, as the decoder's loop passes them; a
    ``norm_gamma`` where ``geom.input_norm``, a row-major ``residual`` where ``geom.residual``) and
    prices it (:func:`pallas_kernels.causal_conv.tpu_estimate.estimate_from_dump`)."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import tpu_aot
    from pallas_kernels.causal_conv import causal_conv3d, row_major
    from pallas_kernels.causal_conv import tpu as conv_tpu
    from pallas_kernels.causal_conv import tpu_estimate as conv_estimate

    device = tpu_aot.compile_only_device(generation)
    sharding = jax.sharding.SingleDeviceSharding(device)
    rows = row_major(4, sharding)
    g, dt = geom, jnp.dtype(dtype)
    args = [jax.ShapeDtypeStruct((g.frames, g.height, g.width, g.in_channels), dt, sharding=rows),
            jax.ShapeDtypeStruct((2, g.height, g.width, g.in_channels), dt, sharding=rows),
            jax.ShapeDtypeStruct((3, 3, 3, g.in_channels, g.out_channels), dt, sharding=sharding),
            jax.ShapeDtypeStruct((g.out_channels,), dt, sharding=sharding)]
    norm = jax.ShapeDtypeStruct((g.in_channels,), dt, sharding=sharding) if g.input_norm else None
    residual = (jax.ShapeDtypeStruct((g.frames, g.height, g.width, g.out_channels), dt, sharding=rows)
                if g.residual else None)

    def conv(x, cache, kernel, bias, norm_gamma, residual):
        return causal_conv3d(x, cache, kernel, bias, norm_gamma=norm_gamma, residual=residual, backend="pallas_tpu")

    args += [norm, residual]

    with jax.default_device(device):
        jax.jit(conv, donate_argnums=(1,), out_shardings=(rows, rows)).trace(*args).lower().compile()
    block_h = min(conv_tpu.DEFAULT_BLOCK_H, g.height)
    return conv_estimate.estimate_from_dump(geom, block_h, generation, dump_dir)


def _compile_and_price_upsample(geom: UpsampleGeometry, dtype: str, generation: str, dump_dir: str) -> Estimate:
    """In the worker process: compiles one upsampling convolution of ``geom`` (its default row
    block, the input and output row-major, as the decoder passes them) and prices it
    (:func:`pallas_kernels.upsample_conv.tpu_estimate.estimate_from_dump`)."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import tpu_aot
    from pallas_kernels.causal_conv import row_major
    from pallas_kernels.upsample_conv import tpu as upsample_tpu
    from pallas_kernels.upsample_conv import tpu_estimate as upsample_estimate
    from pallas_kernels.upsample_conv import upsample_conv2d

    device = tpu_aot.compile_only_device(generation)
    sharding = jax.sharding.SingleDeviceSharding(device)
    rows = row_major(4, sharding)
    g, dt = geom, jnp.dtype(dtype)
    args = [jax.ShapeDtypeStruct((g.frames, g.height, g.width, g.in_channels), dt, sharding=rows),
            jax.ShapeDtypeStruct((3, 3, g.in_channels, g.out_channels), dt, sharding=sharding),
            jax.ShapeDtypeStruct((g.out_channels,), dt, sharding=sharding)]
    with jax.default_device(device):
        jax.jit(lambda x, kernel, bias: upsample_conv2d(x, kernel, bias, backend="pallas_tpu"),
                out_shardings=rows).trace(*args).lower().compile()
    return upsample_estimate.estimate_from_dump(geom, upsample_tpu.default_block_h(g.height), generation, dump_dir)


def _compile_and_price_mlp(geom: MLPGeometry, dtype: str, generation: str, dump_dir: str) -> Estimate:
    """In the worker process: compiles one adaLN MLP of ``geom`` (one row of ``geom.rows`` tokens in
    frames of ``geom.tokens_per_frame``, a float32 residual stream donated and ``dtype`` weights
    stacked over two layers, as a DiT block passes them; a residual input added where
    ``geom.residual_input``, the next block's input written where ``geom.next_input``) and prices it
    (:func:`pallas_kernels.adaln_mlp.tpu_estimate.estimate_from_dump`)."""
    import jax.numpy as jnp

    from pallas_kernels import tpu_aot
    from pallas_kernels.adaln_mlp import adaln_mlp
    from pallas_kernels.adaln_mlp import tpu as mlp_tpu
    from pallas_kernels.adaln_mlp import tpu_estimate as mlp_estimate

    g, dt, f32 = geom, jnp.dtype(dtype), jnp.float32
    rows = mlp_tpu.block_rows(g, dt.itemsize, 4)
    if rows is None:
        raise ValueError(f"no adaLN-MLP kernel fits at {g}: the call runs XLA")
    frames = g.rows // g.tokens_per_frame
    per_frame = ((1, frames, g.dim), f32)
    specs = [((1, g.rows, g.dim), f32), *[per_frame] * 3, ((2, g.dim, g.hidden), dt), ((2, g.hidden), dt),
             ((2, g.hidden, g.dim), dt), ((2, g.dim), dt), ((), jnp.int32)]
    residual = [((1, g.rows, g.dim), dt), ((2, g.dim, g.dim), dt), ((2, g.dim), dt)] * g.residual_input
    specs += residual + [per_frame] * (2 * g.next_input)

    def call(*args):
        rest = args[9 + len(residual):]
        return adaln_mlp(*args[:9], residual_input=tuple(args[9:9 + len(residual)]) or None,
                         next_modulation=tuple(rest) or None, backend="pallas_tpu")

    tpu_aot.compile_for_tpu(call, specs, generation, donate_argnums=(0,))
    return mlp_estimate.estimate_from_dump(g, rows, generation, dump_dir)


def _compile_and_price_cross_query(geom: QueryGeometry, dtype: str, generation: str, dump_dir: str) -> Estimate:
    """In the worker process: compiles one cross query of ``geom`` (one row of ``geom.rows`` tokens
    in frames of ``geom.tokens_per_frame``, a float32 residual stream donated, its norm's affine
    parameters float32 and ``dtype`` weights stacked over two layers, as a DiT block passes them)
    and prices it (:func:`pallas_kernels.cross_query.tpu_estimate.estimate_from_dump`)."""
    import jax.numpy as jnp

    from pallas_kernels import tpu_aot
    from pallas_kernels.cross_query import cross_query
    from pallas_kernels.cross_query import tpu as query_tpu
    from pallas_kernels.cross_query import tpu_estimate as query_estimate

    g, dt, f32 = geom, jnp.dtype(dtype), jnp.float32
    rows = query_tpu.block_rows(g, dt.itemsize, 4)
    if rows is None:
        raise ValueError(f"no cross-query kernel fits at {g}: the call runs XLA")
    tokens, matrix, vector = ((1, g.rows, g.dim), dt), ((2, g.dim, g.dim), dt), ((2, g.dim), dt)
    specs = [((1, g.rows, g.dim), f32), tokens, ((1, g.rows // g.tokens_per_frame, g.dim), f32), matrix, vector,
             ((2, g.dim), f32), ((2, g.dim), f32), matrix, vector, vector, ((), jnp.int32)]
    tpu_aot.compile_for_tpu(lambda *args: cross_query(*args, backend="pallas_tpu"), specs, generation,
                            donate_argnums=(0,))
    return query_estimate.estimate_from_dump(g, rows, generation, dump_dir)


def _compile_and_price_qkv(geom: ProjectionGeometry, dtype: str, generation: str, dump_dir: str) -> Estimate:
    """In the worker process: compiles one q/k/v projection of ``geom`` (one row of ``geom.rows``
    tokens, ``dtype`` weights stacked over two layers, as a DiT block passes them) and prices it
    (:func:`pallas_kernels.qkv_projection.tpu_estimate.estimate_from_dump`)."""
    import jax.numpy as jnp

    from pallas_kernels import tpu_aot
    from pallas_kernels.qkv_projection import qkv_projection
    from pallas_kernels.qkv_projection import tpu as qkv_tpu
    from pallas_kernels.qkv_projection import tpu_estimate as qkv_estimate

    g, dt = geom, jnp.dtype(dtype)
    rows = qkv_tpu.block_rows(g, dt.itemsize)
    if rows is None:
        raise ValueError(f"no q/k/v projection kernel fits at {g}: the call runs XLA")
    specs = [((1, g.rows, g.dim), dt)]
    for n in (g.dim, g.kv_dim, g.kv_dim):
        specs += [((2, g.dim, n), dt), ((2, n), dt), ((2, n), dt)]
    del specs[-1]  # the values have no gain
    tpu_aot.compile_for_tpu(lambda *args: qkv_projection(*args, backend="pallas_tpu"), specs + [((), jnp.int32)],
                            generation)
    return qkv_estimate.estimate_from_dump(g, rows, generation, dump_dir)


def _compile_and_price(geom: WindowGeometry | ContextGeometry | ConvGeometry | UpsampleGeometry | MLPGeometry
                       | QueryGeometry | ProjectionGeometry, dtype: str,
                       generation: str, dump_dir: str, kv_dtype: str | None = None,
                       rope: bool = False, qk_norm: bool = False) -> Estimate:
    """In the worker process: compiles one call of ``geom`` for ``generation`` (window attention
    over pages stored as ``kv_dtype``, default ``dtype``, with rotary tables where ``rope`` and RMS
    norms where ``qk_norm``) and prices it."""
    import jax.numpy as jnp

    from pallas_kernels import tpu_aot
    from pallas_kernels.context_attention import context_attention
    from pallas_kernels.layout import QuantizedPool, scale_shape
    from pallas_kernels.quantization import SCALE_DTYPE, is_quantized
    from pallas_kernels.window_attention import tpu as twa

    if isinstance(geom, ConvGeometry):
        return _compile_and_price_conv(geom, dtype, generation, dump_dir)
    if isinstance(geom, UpsampleGeometry):
        return _compile_and_price_upsample(geom, dtype, generation, dump_dir)
    if isinstance(geom, MLPGeometry):
        return _compile_and_price_mlp(geom, dtype, generation, dump_dir)
    if isinstance(geom, QueryGeometry):
        return _compile_and_price_cross_query(geom, dtype, generation, dump_dir)
    if isinstance(geom, ProjectionGeometry):
        return _compile_and_price_qkv(geom, dtype, generation, dump_dir)
    specs = [(shape, jnp.dtype(d)) for shape, d in call_specs(geom, dtype, rope, qk_norm)]
    if isinstance(geom, ContextGeometry):
        tpu_aot.compile_for_tpu(lambda q, k, v: context_attention(q, k, v, backend="pallas_tpu"), specs, generation)
        return context_estimate_from_dump(geom, dtype, generation, dump_dir)

    def fn(q, kc, vc, kp, vp, pages, lengths, layer, *rest):
        ek, ev = rest[:2] if geom.num_extra else (None, None)
        rest = rest[2 * bool(geom.num_extra):]
        return twa.window_attention(q, kc, vc, kp, vp, pages, lengths, layer=layer, extra_k=ek, extra_v=ev,
                                    rope=rest[:2] if rope else None, qk_norm=rest[2 * rope:] if qk_norm else None,
                                    tokens_per_frame=geom.tokens_per_frame, generation=generation)

    if is_quantized(kv_dtype):  # each pool as its values and scales
        pool = specs[3][0]
        stored = [(pool, jnp.dtype(kv_dtype)), (scale_shape(pool), SCALE_DTYPE)]
        specs = specs[:3] + stored + stored + specs[5:]
        plain = fn

        def fn(q, kc, vc, kv, ks, vv, vs, *rest):
            return plain(q, kc, vc, QuantizedPool(kv, ks), QuantizedPool(vv, vs), *rest)

    tpu_aot.compile_for_tpu(fn, specs, generation)
    return estimate_from_dump(geom, dtype, generation, dump_dir, kv_dtype, rope, qk_norm)


_GEOMETRIES = {"window-attention": WindowGeometry, "context-attention": ContextGeometry,
               "causal-convolution": ConvGeometry, "upsampling-convolution": UpsampleGeometry,
               "adaln-mlp": MLPGeometry, "cross-query": QueryGeometry, "qkv-projection": ProjectionGeometry}


def estimate(geom: WindowGeometry | ContextGeometry | ConvGeometry | UpsampleGeometry | MLPGeometry | QueryGeometry
             | ProjectionGeometry, dtype: str, generation: str, kv_dtype: str | None = None, rope: bool = False,
             qk_norm: bool = False) -> Estimate:
    """Compiles one call of ``geom`` (the paged window-attention kernel for a
    :class:`~pallas_kernels.window_attention.WindowGeometry` over pages stored as ``kv_dtype``,
    default ``dtype``; the context-attention kernel for a
    :class:`~pallas_kernels.context_attention.ContextGeometry`, the causal-convolution kernel for a
    :class:`~pallas_kernels.causal_conv.ConvGeometry`, the upsampling-convolution kernel for an
    :class:`~pallas_kernels.upsample_conv.UpsampleGeometry`, the adaLN-MLP kernel for an
    :class:`~pallas_kernels.adaln_mlp.MLPGeometry`, the cross-query kernel for a
    :class:`~pallas_kernels.cross_query.QueryGeometry`, the q/k/v projection kernel for a
    :class:`~pallas_kernels.qkv_projection.ProjectionGeometry`) for ``generation`` (libtpu's
    compile-only device, in a child process with its own bundle dump) and prices it; ``rope``,
    ``qk_norm``: window attention with rotary tables and RMS norms (the chunk prepared in the
    kernel where it can).

    Raises:
      RuntimeError: the call does not compile (the compiler's last line is in the message).
    """
    kernel = next(name for name, kind in _GEOMETRIES.items() if isinstance(geom, kind))
    with tempfile.TemporaryDirectory() as dump:
        env = dict(os.environ, JAX_PLATFORMS="cpu",
                   LIBTPU_INIT_ARGS=f"--xla_jf_dump_to={dump} --xla_jf_dump_llo_text=true",
                   ALLOW_MULTIPLE_LIBTPU_LOAD="1")
        request = json.dumps(dict(kernel=kernel, geometry=dataclasses.asdict(geom), dtype=dtype,
                                  generation=generation, dump=dump, kv_dtype=kv_dtype, rope=rope,
                                  qk_norm=qk_norm))
        proc = subprocess.run([sys.executable, "-m", __name__, request], env=env, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode or not lines:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"the {kernel} kernel does not compile for {generation} at {geom}: {last}")
        return Estimate(**json.loads(lines[-1]))


if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    geometry = _GEOMETRIES[args["kernel"]](**args["geometry"])
    result = _compile_and_price(geometry, args["dtype"], args["generation"], args["dump"], args["kv_dtype"],
                                args["rope"], args["qk_norm"])
    print(json.dumps(dataclasses.asdict(result)))
