"""Compile the TPU kernels for v5e and v6e on this CPU machine and report what the compiler decided.

Needs libtpu (``pip install -e ".[tpu]"``); runs no kernel. Shapes come from the model presets
(:func:`preset_shape`: :mod:`arkv_jax.presets` geometry, the history its ``WindowPolicy`` lets a
chunk see, ``max_history``, and its extra tokens). At ``wan-1.3b`` (30 layers, 12 KV heads x 128,
1,560-token frames in 1,560-slot pages, a 3-frame chunk over 9 history frames: 18,720 keys) for
each generation it compiles, each in its own process (so each has its own bundle dump):

* the paged window attention (:mod:`pallas_kernels.window_attention.tpu`), rows 1 and 4, and over
  quantized pages (int8, float8_e4m3fn, float8_e5m2: :data:`ATTENTION_KV_DTYPES`), rows 1, whose
  estimates over the bf16 pages' are the summary's ``int8_vs_bf16_attention_est``,
  ``fp8_vs_bf16_attention_est`` (e4m3fn) and ``fp8_e5m2_vs_bf16_attention_est``;
* the gather + splash baseline (:mod:`pallas_kernels.window_attention.tpu_gather`), rows 1 and 4,
  under the scoped VMEM limit the paged kernel sets at this shape (``LIBTPU_INIT_ARGS=
  --xla_tpu_scoped_vmem_limit_kib=N`` in its process: splash takes no VMEM option), with the
  splash tiles ``tpu_gather`` tunes for that limit (``--baseline-blocks BQ,BKV,BKVC`` compiles only
  the baseline, rows 1, with other tiles: how they were tuned);
* the donated paged write (:mod:`pallas_kernels.paged_write.tpu`), one row's chunk, at
  ``wan-1.3b`` (12 heads: the head view) and ``lingbot-v2`` (40 heads: the token view).
* the text cross-attention of one row's chunk (:mod:`pallas_kernels.context_attention`): the TPU
  kernel and its yardstick, the plain XLA path (the logits materialised), at ``wan-1.3b`` (4,680
  queries over 512 text tokens).

Reported: whether each compiled, the kernel's VMEM estimate and limit, temporaries and aliased
bytes (as fractions of the pools, and for the write of the chunk), pool copies in the optimized
HLO, and a compiler-derived time per call, formed the same way for the kernel and its yardstick:

* kernel: the Mosaic kernel's final VLIW bundles (``--xla_jf_dump_llo_text``) of each loop times
  its trip count at the chip clock, plus 0.35 us per grid step (one bundle per cycle; stalls such
  as MXU result latency beyond the schedule or VMEM bank conflicts, and DMA waits, are omitted);
* exposed DMA (paged kernel): per grid step, the first history block's K and V bytes over the HBM
  bandwidth, less the cycles of the tail's chunks, which run while it is in flight (at least 0);
  later blocks are prefetched behind the previous block's compute and not counted;
* XLA ops: ``estimated_cycles`` of XLA:TPU's cost model (each instruction's ``backend_config``)
  summed over every instruction outside the Mosaic custom call, at the chip clock (a copy the model
  prices with its placeholder counts its bytes' round trip through HBM,
  :func:`pallas_kernels.tpu_cost.program_cycles`). For the
  baseline that is the gather of the visible history (one DMA per token), its concatenation with
  the chunk and padding, the scaled queries and the output transpose; for the paged kernel the
  page table (it reads the queries and the chunk's K and V, row-major as the DiT's projections
  give them, :func:`as_projected`, through token-major blocks).

The write's time is the larger of its bytes (read and written) over the HBM bandwidth and its
bundles' issue time. ``--quick`` compiles rows 1 only. The last line is JSON (a figure of a kernel
that did not compile is ``null``); the exit status is 1 if any kernel did not compile. Without
libtpu it says so in one line on stderr and exits with status 1, compiling nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCKS_ENV = "TPU_COMPILE_SPLASH_BLOCKS"
"""Environment variable (JSON ``{"block_q": ..}``) overriding the baseline's tuned splash blocks."""
ATTENTION_PRESET = "wan-1.3b"
WRITE_PRESETS = ("wan-1.3b", "lingbot-v2")
"""Presets whose write is compiled: 12 KV heads (head view) and 40 (token view)."""
ATTENTION_KV_DTYPES = {"attention": None, "attention_int8": "int8", "attention_fp8": "float8_e4m3fn",
                       "attention_fp8_e5m2": "float8_e5m2"}
"""The paged kernel's jobs and the dtype their pools store pages in (``None``: bf16, unquantized)."""


def _importable_checkout() -> None:
    """Puts the checkout on ``sys.path`` (for ``python benchmarks/tpu_compile.py``, run as a file)."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)


def preset_shape(name: str, block_size: int | None = None) -> dict:
    """The compiled shape of model preset ``name`` (:func:`arkv_jax.presets.get_preset`): its
    layers, KV heads, head dim and frame size, its block size rounded up to the TPU's multiple of
    8 (:func:`pallas_kernels.layout.tpu_block_size`) unless ``block_size`` is given, its chunk
    (``frames_per_forward``), the history frames its ``WindowPolicy`` lets a chunk see
    (``max_history``) and its extra tokens per forward (``max_scratch_tokens_per_branch``)."""
    _importable_checkout()
    from arkv_jax.presets import get_preset
    from pallas_kernels.layout import tpu_block_size

    model = get_preset(name)
    g = model.geometry
    frames = g.frames_per_forward
    return dict(preset=name, layers=g.num_layers, kv_heads=g.num_kv_heads, head_dim=g.head_dim,
                tokens_per_frame=g.tokens_per_frame,
                block_size=tpu_block_size(g.block_size) if block_size is None else block_size,
                cur_frames=frames, visible_frames=int(model.window.max_history(frames)),
                extra_tokens=model.max_scratch_tokens_per_branch)


def attention_shapes(p: dict, rows: int, layers: int | None = None, kv_dtype: str | None = None):
    """``(WindowGeometry, pool shape, specs)`` of one layer's attention call at shape ``p``
    (:func:`preset_shape`) for ``rows`` rows, bf16, with ``layers`` pool layers (default the
    preset's) and pages stored as ``kv_dtype`` (default bf16; a quantized dtype gives
    :class:`~pallas_kernels.layout.QuantizedPool` s): specs are ``(shape, dtype)`` of ``q, k_cur,
    v_cur``, each pool's arrays (``k_pool, v_pool``, or for quantized pools ``k_values, k_scales,
    v_values, v_scales``: see :func:`with_pool_arrays`), ``pages, lengths, layer`` then, if the
    preset has extra tokens, ``extra_k, extra_v``; ``q`` holds the chunk and the extras."""
    import jax.numpy as jnp

    from pallas_kernels.layout import PAGE_AXIS, pool_shape, scale_shape
    from pallas_kernels.quantization import SCALE_DTYPE, is_quantized
    from pallas_kernels.window_attention import WindowGeometry

    h, d, tpf, block = p["kv_heads"], p["head_dim"], p["tokens_per_frame"], p["block_size"]
    layers = p["layers"] if layers is None else layers
    max_pages = p["visible_frames"] * -(-tpf // block)
    shape = pool_shape(layers, rows * max_pages + 1, block, h, d)
    cur, extra = p["cur_frames"] * tpf, p["extra_tokens"]
    kv = (rows, cur, h, d)
    bf = jnp.bfloat16
    pool = [(shape, bf)]
    if is_quantized(kv_dtype):
        pool = [(shape, jnp.dtype(kv_dtype)), (scale_shape(shape), SCALE_DTYPE)]
    specs = [((rows, cur + extra, h, d), bf), (kv, bf), (kv, bf), *pool, *pool,
             ((rows, max_pages), jnp.int32), ((rows,), jnp.int32), ((), jnp.int32)]
    specs += [((rows, extra, h, d), bf)] * 2 if extra else []
    geom = WindowGeometry(rows, cur + extra, h, h, d, cur, extra, layers, shape[PAGE_AXIS], block,
                          max_pages, tpf)
    return geom, shape, specs


def with_pool_arrays(fn, kv_dtype: str | None = None):
    """``fn(q, k_cur, v_cur, k_pool, v_pool, *rest)`` as a function of the flat arrays
    :func:`attention_shapes` specifies for ``kv_dtype``: ``fn`` itself for plain pools, else a
    function of ``(q, k_cur, v_cur, k_values, k_scales, v_values, v_scales, *rest)`` that passes
    :class:`~pallas_kernels.layout.QuantizedPool` s."""
    from pallas_kernels.layout import QuantizedPool
    from pallas_kernels.quantization import is_quantized

    if not is_quantized(kv_dtype):
        return fn

    def flat(q, kc, vc, k_values, k_scales, v_values, v_scales, *rest):
        return fn(q, kc, vc, QuantizedPool(k_values, k_scales), QuantizedPool(v_values, v_scales), *rest)

    return flat


def as_projected(fn, specs):
    """``(fn, specs)`` with each rank-4 activation ``[rows, tokens, heads, D]`` (queries, the chunk's
    K/V, extras, the context) and the result passed as the DiT's projections give and take them,
    ``[rows, tokens, heads * D]`` row-major, viewed rank-4 inside: compiled alone, a 12-head
    parameter gets a head-major layout from XLA:TPU, which the model's program never has."""
    four = [len(shape) == 4 for shape, _ in specs]

    def projected(*args):
        out = fn(*(a.reshape(shape) if f else a for a, (shape, _), f in zip(args, specs, four)))
        return out.reshape(*out.shape[:2], -1)

    return projected, [((*shape[:2], shape[2] * shape[3]) if f else shape, dtype)
                       for (shape, dtype), f in zip(specs, four)]


def attention_flops(p: dict, rows: int) -> int:
    """FLOPs of one layer's attention at shape ``p``: QK and PV over the valid keys only (the
    history frames' tokens and the tail)."""
    q_len = p["cur_frames"] * p["tokens_per_frame"] + p["extra_tokens"]
    keys = p["visible_frames"] * p["tokens_per_frame"] + q_len
    return 4 * rows * q_len * keys * p["kv_heads"] * p["head_dim"]


def paged_vmem_limit(gen: str, rows: int) -> int:
    """The scoped VMEM limit (bytes) the paged kernel sets at :data:`ATTENTION_PRESET` for
    ``rows`` rows on ``gen``: the one the baseline is compiled under."""
    from pallas_kernels.window_attention import tpu as twa

    geom = twa.Geometry.of(attention_shapes(preset_shape(ATTENTION_PRESET), rows)[0], "bfloat16")
    return twa.plan_call(geom, gen)[1]


# ------------------------------------------------------------------------------------------------
# Final-bundle parsing (the paged kernel's: pallas_kernels.window_attention.tpu_estimate)
# ------------------------------------------------------------------------------------------------


def splash_cycles(bundles, tree) -> tuple[float, float, str]:
    """(per-grid-step cycles, once-per-query-block cycles) of splash attention's grid loop. The
    once-per-query-block code is the two predicated regions skipped by a branch: the accumulator
    init (from the last ``sbr.rel`` before the first predicated-region fallthrough to it) and the
    finalisation (from the first ``sbr.rel`` at or after the second fallthrough to the next one);
    everything else in the loop body (the steady compute between the first two fallthroughs, the
    pipeline's DMA issue and waits, the loop bookkeeping) runs every grid step.

    Raises:
      ValueError: the loop is not one flat loop, or a branch does not skip to the fallthrough it
        should (the parse does not hold for this variant).
    """
    if len(tree) != 1 or tree[0]["children"]:
        raise ValueError(f"splash: {len(tree)} top-level loops, nested loops "
                         f"{[len(n['children']) for n in tree]}: the steady/once split does not hold")
    grid = tree[0]
    start, end = grid["start"], grid["start"] + grid["own"]
    pf = [i for i, (mark, _, _) in enumerate(bundles) if mark == "PF" and start < i < end]
    branches = [i for i, (_, _, text) in enumerate(bundles) if "sbr.rel" in text and start < i < end]

    def region(branch: int, fallthrough: int) -> int:
        m = re.search(r"target = \$region(\d+)", bundles[branch][2])
        if not m or f"empty region {m.group(1)} " not in bundles[fallthrough][2] + " ":
            raise ValueError(f"splash: branch at bundle {branch} does not skip to the fallthrough "
                             f"at {fallthrough}: the steady/once split does not hold")
        return fallthrough - branch - 1

    init_branch = max(i for i in branches if i < pf[0])
    fin_branch = min(i for i in branches if i >= pf[1])
    fin_end = min(i for i in pf if i > fin_branch)
    once = region(init_branch, pf[0]) + region(fin_branch, fin_end)
    steady = grid["own"] - once
    return steady, once, (f"splash grid loop {grid['own']} bundles: {steady} per step (compute "
                          f"{pf[1] - pf[0]}), init + finalisation {once} once per query block")


def write_cycles(tree, trips: tuple[int, ...]) -> int:
    """Issue cycles of the paged write: every bundle of its loops (both page kinds' predicated
    regions included: an upper bound), a loop nested ``d`` deep (0 the top level) run
    ``trips[d]`` times per run of its parent (1 past the tuple): pages + ``DMAS_IN_FLIGHT`` on the
    bf16 head view, pages x layers on the bf16 token view; the quantizing kernel's jobs (2 x pages
    x layers), then its head loop (``H`` on the head view, where it is a loop) and its slab loops
    (``S // SLAB_ROWS``)."""
    def total(node, depth: int) -> int:
        runs = trips[depth] if depth < len(trips) else 1
        return runs * (node["own"] + sum(total(c, depth + 1) for c in node["children"]))

    return sum(total(n, 0) for n in tree)


# ------------------------------------------------------------------------------------------------
# Worker: one compile in this process (LIBTPU_INIT_ARGS set by the parent)
# ------------------------------------------------------------------------------------------------


def worker(gen: str, kind: str, rows: int, preset: str, dump: str) -> dict:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    _importable_checkout()
    from pallas_kernels import tpu_aot, tpu_cost

    p = preset_shape(preset)
    out: dict = dict(gen=gen, kind=kind, rows=rows, preset=preset)
    if kind in CONTEXT_KINDS:
        return {**out, **_context_figures(gen, kind, preset, rows, dump)}
    kv_dtype = WRITE_KINDS.get(kind)
    if kv_dtype:
        fn, specs, donate, shape = _write_call(p, rows, kv_dtype)
    else:
        fn, specs, donate, shape = _attention_call(gen, kind, p, rows, out)
        fn, specs = as_projected(fn, specs)
    leaves = specs[:len(donate) // 2] if kv_dtype else [(shape, "bfloat16")]  # One pool's arrays.
    pool_bytes = pools_bytes(shape, kv_dtype or ATTENTION_KV_DTYPES.get(kind))
    try:
        compiled = tpu_aot.compile_for_tpu(fn, specs, gen, donate_argnums=donate)
    except Exception as e:  # Report a failed compile as data.
        out.update(compiles=False, error=str(e).splitlines()[0][:300])
        return out
    rep = tpu_aot.report(compiled, [spec for spec, _ in leaves])
    out.update(compiles=True, pool_copies=rep.pool_copies, pool_bytes=pool_bytes,
               temp_bytes=rep.temp_bytes, temp_fraction=rep.temp_bytes / pool_bytes,
               alias_fraction=rep.alias_bytes / pool_bytes)
    chip = tpu_aot.CHIPS[gen]
    if kv_dtype:
        out.update(_write_figures(p, rows, kv_dtype, specs, rep, dump, chip))
        return out
    xla_cycles = tpu_cost.program_cycles(rep.hlo, chip.hbm_bytes_per_cycle).cycles  # Every op but the Mosaic kernel.
    out.update(flops=attention_flops(p, rows), xla_ms=xla_cycles / chip.clock_hz * 1e3)
    out.update(_paged_figures(gen, p, rows, dump, ATTENTION_KV_DTYPES[kind]) if kind in ATTENTION_KV_DTYPES
               else _baseline_figures(p, rows, out["blocks"], dump, chip))
    out["est_ms"] = out["kernel_ms"] + out.get("dma_ms", 0.0) + out["xla_ms"]
    out["fraction_of_peak"] = out["flops"] / (out["est_ms"] * 1e-3) / chip.bf16_flops
    return out


def pools_bytes(shape, kv_dtype: str | None) -> int:
    """Bytes of a K and a V pool of ``shape`` storing pages as ``kv_dtype`` (``None``: bf16): the
    values, and for quantized pages their scales."""
    import jax.numpy as jnp

    from pallas_kernels.layout import scale_shape
    from pallas_kernels.quantization import SCALE_ITEMSIZE, is_quantized

    if not is_quantized(kv_dtype):
        return 2 * math.prod(shape) * 2
    return 2 * (math.prod(shape) * jnp.dtype(kv_dtype).itemsize + math.prod(scale_shape(shape)) * SCALE_ITEMSIZE)


CONTEXT_KINDS = {"context": "pallas_tpu", "context_xla": "xla"}
"""Context-attention jobs: the TPU kernel and its yardstick, the plain XLA path."""


def context_geometry(preset: str, rows: int):
    """The text cross-attention of one chunk of ``preset`` for ``rows`` rows
    (:class:`~pallas_kernels.context_attention.ContextGeometry`): the chunk's tokens and the
    preset's KV heads (its DiT's query heads) over its text tokens."""
    from arkv_jax.presets import get_preset
    from pallas_kernels.context_attention import ContextGeometry

    model = get_preset(preset)
    g = model.geometry
    return ContextGeometry(rows, g.frames_per_forward * g.tokens_per_frame, g.num_kv_heads, g.num_kv_heads,
                           g.head_dim, model.cross_attention[0].num_tokens)


def _context_figures(gen: str, kind: str, preset: str, rows: int, dump: str) -> dict:
    """Compiles context attention on ``kind``'s backend; its time: the kernel's bundles (the TPU
    kernel) plus XLA:TPU's cycles of every other op (all of the XLA path)."""
    import jax.numpy as jnp

    from pallas_kernels import tpu_aot, tpu_cost
    from pallas_kernels.context_attention import context_attention
    from pallas_kernels.window_attention import tpu_estimate

    geom, chip = context_geometry(preset, rows), tpu_aot.CHIPS[gen]
    specs = [(shape, jnp.dtype(d)) for shape, d in tpu_estimate.call_specs(geom, "bfloat16")]
    backend = CONTEXT_KINDS[kind]
    fn, specs = as_projected(lambda q, k, v: context_attention(q, k, v, backend=backend), specs)
    try:
        compiled = tpu_aot.compile_for_tpu(fn, specs, gen)
    except Exception as e:  # Report a failed compile as data.
        return dict(compiles=False, error=str(e).splitlines()[0][:300])
    rep = tpu_aot.report(compiled, [shape for shape, _ in specs])
    xla_ms = tpu_cost.program_cycles(rep.hlo, chip.hbm_bytes_per_cycle).cycles / chip.clock_hz * 1e3
    kernel_ms = (tpu_estimate.context_estimate_from_dump(geom, "bfloat16", gen, dump).kernel_seconds * 1e3
                 if kind == "context" else 0.0)
    flops = 4 * rows * geom.q_len * geom.kv_len * geom.num_q_heads * geom.head_dim
    est_ms = kernel_ms + xla_ms
    return dict(compiles=True, copies=rep.pool_copies, temp_bytes=rep.temp_bytes, kernel_ms=kernel_ms,
                xla_ms=xla_ms, est_ms=est_ms, fraction_of_peak=flops / (est_ms * 1e-3) / chip.bf16_flops)


def _context_line(gen: str, kind: str, r: dict) -> str:
    if not r.get("compiles"):
        return f"{gen} {kind}: DOES NOT COMPILE: {r.get('error')}"
    return (f"{gen} {kind:11s} rows=1: compiles, copies of q/k/v {r['copies']}, temp {r['temp_bytes'] / 2**20:.1f} "
            f"MiB, est {r['est_ms']:.3f} ms per row and layer (kernel {r['kernel_ms']:.3f} + XLA ops "
            f"{r['xla_ms']:.3f}), {r['fraction_of_peak']:.1%} of bf16 peak")


WRITE_KINDS = {"write": "bfloat16", "write_int8": "int8", "write_float8_e4m3fn": "float8_e4m3fn",
               "write_float8_e5m2": "float8_e5m2"}
"""Write jobs and their pools' dtype: bf16 pools, or quantized pools written from a bf16 chunk."""


def jnp_itemsize(dtype) -> int:
    import jax.numpy as jnp

    return jnp.dtype(dtype).itemsize


def _write_call(p: dict, rows: int, kv_dtype: str = "bfloat16", num_pages: int | None = None):
    """``(fn, specs, donate, pool shape)`` of the donated write of one bf16 chunk per row at ``p``
    into pools of ``kv_dtype`` with ``num_pages`` pages (default just enough: the chunk's pages and
    the null page); a quantized pool is passed as its values and scales (specs and donated
    arguments: the pools' leaves, then the chunk and the ids)."""
    import functools

    import jax.numpy as jnp

    from pallas_kernels.layout import QuantizedPool, pool_shape, scale_shape
    from pallas_kernels.paged_write import write_chunk
    from pallas_kernels.quantization import SCALE_DTYPE, is_quantized

    ppf = -(-p["tokens_per_frame"] // p["block_size"])
    num_pages = rows * p["cur_frames"] * ppf + 1 if num_pages is None else num_pages
    shape = pool_shape(p["layers"], num_pages, p["block_size"], p["kv_heads"], p["head_dim"])
    new = (p["layers"], rows, p["cur_frames"] * p["tokens_per_frame"], p["kv_heads"], p["head_dim"])
    bf = jnp.bfloat16
    tail = [(new, bf)] * 2 + [((rows, p["cur_frames"] * ppf), jnp.int32)]
    write = functools.partial(write_chunk, tokens_per_frame=p["tokens_per_frame"], backend="pallas_tpu")
    if not is_quantized(kv_dtype):
        return write, [(shape, jnp.dtype(kv_dtype))] * 2 + tail, (0, 1), shape

    def fn(k_values, k_scales, v_values, v_scales, *rest):
        return write(QuantizedPool(k_values, k_scales), QuantizedPool(v_values, v_scales), *rest)

    leaves = [(shape, jnp.dtype(kv_dtype)), (scale_shape(shape), SCALE_DTYPE)] * 2
    return fn, leaves + tail, (0, 1, 2, 3), shape


def _write_figures(p: dict, rows: int, kv_dtype: str, specs, rep, dump: str, chip) -> dict:
    """The write's kernel time (the larger of its bytes, the chunk read and the pages written, over
    the HBM bandwidth and its bundles' issue time) plus XLA:TPU's cycles of every op outside the
    kernel."""
    from pallas_kernels import tpu_cost
    from pallas_kernels.paged_write import tpu as write_tpu
    from pallas_kernels.paged_write import tpu_quantized
    from pallas_kernels.quantization import is_quantized
    from pallas_kernels.window_attention.tpu_estimate import kernel_dump, loop_tree, parse_bundles

    frames_shape = (p["layers"], rows * p["cur_frames"], p["tokens_per_frame"], p["kv_heads"],
                    p["head_dim"])
    view = write_tpu.chunk_view(frames_shape, "bfloat16", p["block_size"], _chip_device(chip))
    ppf = -(-p["tokens_per_frame"] // p["block_size"])
    pages = rows * p["cur_frames"] * ppf
    values = 2 * p["layers"] * p["kv_heads"] * pages * p["block_size"] * p["head_dim"]  # K and V.
    moved = values * jnp_itemsize(kv_dtype)
    chunk_bytes = 2 * math.prod(specs[-2][0]) * 2
    if is_quantized(kv_dtype):
        slabs = p["block_size"] // tpu_quantized.SLAB_ROWS
        trips = (2 * pages * p["layers"], p["kv_heads"], slabs) if view == "head" else (2 * pages * p["layers"], slabs)
    else:
        trips = (pages + write_tpu.DMAS_IN_FLIGHT if view == "head" else pages * p["layers"],)
    issue = write_cycles(loop_tree(parse_bundles(kernel_dump(dump, "paged_write_tpu"))), trips) / chip.clock_hz
    hbm = (values * 2 + moved) / chip.hbm_bytes_per_s  # Read the bf16 chunk's pages, write them.
    xla = tpu_cost.program_cycles(rep.hlo, chip.hbm_bytes_per_cycle).cycles / chip.clock_hz
    kernel = max(hbm, issue)
    return dict(view=view, kv_heads=p["kv_heads"], kv_dtype=kv_dtype, bytes_moved=moved,
                temp_chunk_fraction=rep.temp_bytes / chunk_bytes, hbm_ms=hbm * 1e3,
                issue_ms=issue * 1e3, xla_ms=xla * 1e3, est_ms=(kernel + xla) * 1e3,
                fraction_of_hbm=hbm / kernel)


def _chip_device(chip):
    from pallas_kernels import tpu_aot

    return tpu_aot.compile_only_device(next(g for g, c in tpu_aot.CHIPS.items() if c is chip))


def _attention_call(gen: str, kind: str, p: dict, rows: int, out: dict):
    """``(fn, specs, donate, pool shape)`` of the paged kernel (over the pages of ``kind``'s
    :data:`ATTENTION_KV_DTYPES`) or the baseline at ``p``; records the baseline's splash tiles and
    scoped VMEM limit in ``out``."""
    if kind in ATTENTION_KV_DTYPES:
        from pallas_kernels.window_attention import tpu as twa

        kv_dtype = ATTENTION_KV_DTYPES[kind]
        geom, shape, specs = attention_shapes(p, rows, kv_dtype=kv_dtype)

        def fn(q, kc, vc, kp, vp, pg, ln, layer, ek=None, ev=None):
            return twa.window_attention(q, kc, vc, kp, vp, pg, ln, layer=layer, extra_k=ek, extra_v=ev,
                                        tokens_per_frame=geom.tokens_per_frame, generation=gen)
        return with_pool_arrays(fn, kv_dtype), specs, (), shape
    geom, shape, specs = attention_shapes(p, rows)
    from pallas_kernels.window_attention import tpu_gather

    blocks = tpu_gather.resolve_blocks(gen, **json.loads(os.environ.get(BLOCKS_ENV, "{}")))
    out.update(blocks=blocks, scoped_vmem=tpu_gather.scoped_vmem_limit(gen))

    def fn(q, kc, vc, kp, vp, pg, ln, layer, ek=None, ev=None):
        return tpu_gather.gather_window_attention(q, kc, vc, kp, vp, pg, ln, layer=layer, extra_k=ek,
                                                  extra_v=ev, tokens_per_frame=geom.tokens_per_frame,
                                                  **blocks)
    return fn, specs, (), shape


def _paged_figures(gen: str, p: dict, rows: int, dump: str, kv_dtype: str | None) -> dict:
    """The paged kernel's bundle estimate and exposed first-block DMA
    (:func:`pallas_kernels.window_attention.tpu_estimate.estimate_from_dump`), VMEM and tiling, over
    pages stored as ``kv_dtype`` (``None``: bf16)."""
    from pallas_kernels.window_attention import tpu as twa
    from pallas_kernels.window_attention import tpu_estimate

    window = attention_shapes(p, rows)[0]
    geom = twa.Geometry.of(window, "bfloat16", kv_dtype)
    plan, vmem_limit = twa.plan_call(geom, gen)
    est = tpu_estimate.estimate_from_dump(window, "bfloat16", gen, dump, kv_dtype)
    return dict(vmem_estimate=twa.vmem_estimate_bytes(geom, plan), vmem_limit=vmem_limit,
                temp_bound=twa.temp_bound_bytes(geom, plan), grid_steps=est.grid_steps,
                kernel_ms=est.kernel_seconds * 1e3, dma_ms=est.dma_seconds * 1e3, note=est.note)


def _baseline_figures(p: dict, rows: int, blocks: dict, dump: str, chip) -> dict:
    """Splash's bundle estimate (its grid: rows x KV heads x query blocks x key blocks)."""
    from pallas_kernels import tpu_aot
    from pallas_kernels.window_attention.tpu_estimate import kernel_dump, loop_tree, parse_bundles

    bundles = parse_bundles(kernel_dump(dump, "splash_mqa_fwd"))
    steady, once, note = splash_cycles(bundles, loop_tree(bundles))
    q_len = p["cur_frames"] * p["tokens_per_frame"] + p["extra_tokens"]
    keys = p["visible_frames"] * p["tokens_per_frame"] + q_len
    q_blocks, kv_blocks = -(-q_len // blocks["block_q"]), -(-keys // blocks["block_kv"])
    steps = rows * p["kv_heads"] * q_blocks * kv_blocks
    kernel_s = (steps * steady + rows * p["kv_heads"] * q_blocks * once) / chip.clock_hz \
        + steps * tpu_aot.GRID_STEP_SECONDS
    # Never less than its matmuls (Q K^T and P V over the padded blocks) at the MXUs' peak, as the
    # paged kernel's estimate (tpu_estimate.mxu_cycles).
    mxu_s = 4 * steps * blocks["block_q"] * blocks["block_kv"] * p["head_dim"] / chip.bf16_flops
    return dict(grid_steps=steps, kernel_ms=max(kernel_s, mxu_s) * 1e3, note=note)


# ------------------------------------------------------------------------------------------------
# Driver
# ------------------------------------------------------------------------------------------------


def run_job(gen: str, kind: str, rows: int, preset: str = ATTENTION_PRESET,
            scoped_vmem: int | None = None) -> dict:
    """One compile in its own process (its own bundle dump); ``scoped_vmem`` (bytes) sets
    XLA:TPU's scoped VMEM limit there."""
    with tempfile.TemporaryDirectory() as dump:
        flags = f"--xla_jf_dump_to={dump} --xla_jf_dump_llo_text=true"
        if scoped_vmem is not None:
            flags += f" --xla_tpu_scoped_vmem_limit_kib={scoped_vmem // 1024}"
        env = dict(os.environ, JAX_PLATFORMS="cpu", LIBTPU_INIT_ARGS=flags)
        # Compile-only devices touch no chip, so libtpu's one-process lock (/tmp/libtpu_lockfile)
        # need not stop a compile while another process (a test run, say) has libtpu loaded.
        env.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        proc = subprocess.run([sys.executable, "-m", "benchmarks.tpu_compile", "--worker", gen, kind,
                               str(rows), preset, dump], env=env, cwd=ROOT, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode or not lines:
            return dict(gen=gen, kind=kind, rows=rows, preset=preset, compiles=False,
                        error=(proc.stderr.strip().splitlines() or ["no output"])[-1][:300])
        return json.loads(lines[-1])


LIBTPU_MISSING = ("libtpu is not installed: pip install 'arkv-jax[tpu]' (in a checkout: pip install -e '.[tpu]'); "
                  "benchmarks.tpu_compile compiles the TPU kernels with it and compiled nothing")


def _figure(result: dict, key: str, kind=float):
    """``result[key]`` as ``kind``, or ``None`` when the kernel did not compile (or lacks it)."""
    value = result.get(key) if result.get("compiles") else None
    return None if value is None else kind(value)


def _attention_line(gen: str, kind: str, rows: int, r: dict) -> str:
    if not r.get("compiles"):
        return f"{gen} {kind:9s} rows={rows}: DOES NOT COMPILE: {r.get('error')}"
    if kind in ATTENTION_KV_DTYPES:
        extra = (f"kernel {r['kernel_ms']:.3f} + exposed DMA {r['dma_ms']:.3f} + XLA ops "
                 f"{r['xla_ms']:.3f} ms; vmem est {r['vmem_estimate'] / 2**20:.1f} MiB (limit "
                 f"{r['vmem_limit'] / 2**20:.0f} MiB)")
    else:
        extra = (f"kernel {r['kernel_ms']:.3f} + XLA ops (gather etc.) {r['xla_ms']:.3f} ms; splash "
                 f"tiles {r['blocks']} under {r['scoped_vmem'] / 2**20:.0f} MiB scoped VMEM")
    return (f"{gen} {kind:9s} rows={rows}: compiles, pool copies {r['pool_copies']}, temp "
            f"{r['temp_fraction']:.2%} of pools ({r['temp_bytes'] / 2**20:.1f} MiB), est "
            f"{r['est_ms']:.3f} ms = {r['est_ms'] / rows:.3f} ms per row and layer, "
            f"{r['fraction_of_peak']:.1%} of bf16 peak ({extra}); {r['note']}")


def _write_line(gen: str, w: dict) -> str:
    if not w.get("compiles"):
        return f"{gen} {w['kind']} {w['preset']}: DOES NOT COMPILE: {w.get('error')}"
    return (f"{gen} write {w['preset']} ({w['kv_dtype']} pools, {w['kv_heads']} heads, {w['view']} view) "
            f"rows=1: compiles, pool copies {w['pool_copies']}, temp {w['temp_chunk_fraction']:.4%} of the "
            f"chunk ({w['temp_fraction']:.2%} of the pools), aliased {w['alias_fraction']:.3f} of both "
            f"pools; {w['bytes_moved'] / 2**20:.1f} MiB of pages per commit, HBM time {w['hbm_ms']:.3f} "
            f"ms, issue {w['issue_ms']:.4f} ms -> {w['fraction_of_hbm']:.1%} of HBM bandwidth; XLA ops "
            f"{w['xla_ms']:.3f} ms; est {w['est_ms']:.3f} ms")


def _quantized_write_summary(bf16: dict, writes: dict) -> dict:
    """Per quantized dtype: the write's figures at :data:`ATTENTION_PRESET` and its estimated time
    over the bf16 write's."""
    return {WRITE_KINDS[kind]: dict(pool_copies=_figure(w, "pool_copies", int),
                                    alias_fraction=_figure(w, "alias_fraction"),
                                    temp_fraction=_figure(w, "temp_fraction"),
                                    est_ms=_figure(w, "est_ms"), xla_ms=_figure(w, "xla_ms"),
                                    vs_bf16=w["est_ms"] / bf16["est_ms"]
                                    if w.get("compiles") and bf16.get("compiles") else None)
            for kind, w in writes.items()}


def _summary(att: dict, base: dict, writes: dict) -> dict:
    ok = att.get("compiles") and base.get("compiles")
    summary = dict(
        attention_compiles=bool(att.get("compiles")),
        attention_pool_copies=_figure(att, "pool_copies", int),
        attention_est_ms=_figure(att, "est_ms"),
        attention_kernel_ms=_figure(att, "kernel_ms"),
        attention_dma_ms=_figure(att, "dma_ms"),
        attention_xla_ms=_figure(att, "xla_ms"),
        attention_vmem_limit_mib=_figure(att, "vmem_limit", lambda v: v / 2**20),
        baseline_est_ms=_figure(base, "est_ms"),
        baseline_kernel_ms=_figure(base, "kernel_ms"),
        baseline_xla_ms=_figure(base, "xla_ms"),
        baseline_scoped_vmem_mib=_figure(base, "scoped_vmem", lambda v: v / 2**20),
        baseline_blocks=base.get("blocks") if base.get("compiles") else None,
        baseline_pool_copies=_figure(base, "pool_copies", int),
        attention_vs_baseline=float(base["est_ms"] / att["est_ms"]) if ok else None,
        attention_fraction_of_peak=_figure(att, "fraction_of_peak"),
        baseline_fraction_of_peak=_figure(base, "fraction_of_peak"),
    )
    wan = writes[ATTENTION_PRESET]
    summary.update(write_pool_copies=_figure(wan, "pool_copies", int),
                   write_temp_fraction=_figure(wan, "temp_fraction"),
                   write_alias_fraction=_figure(wan, "alias_fraction"),
                   write_fraction_of_hbm=_figure(wan, "fraction_of_hbm"),
                   write_temp_chunk_fraction={f"{w['kv_heads']}_heads" if w.get("compiles") else name:
                                              _figure(w, "temp_chunk_fraction")
                                              for name, w in writes.items()})
    return summary


QUANTIZED_RATIO_KEYS = {"attention_int8": "int8_vs_bf16_attention_est", "attention_fp8": "fp8_vs_bf16_attention_est",
                        "attention_fp8_e5m2": "fp8_e5m2_vs_bf16_attention_est"}
"""The summary key of each quantized-page job's estimate over the bf16 pages' (rows 1)."""


def _quantized_summary(att: dict, quantized: dict) -> dict:
    """Per quantized-page job (:data:`QUANTIZED_RATIO_KEYS`): its estimate over bf16 pages' (both
    ``est_ms``: kernel bundles + exposed DMA + XLA ops), its estimate and its pool copies."""
    out = {}
    for kind, key in QUANTIZED_RATIO_KEYS.items():
        r = quantized[kind]
        ok = att.get("compiles") and r.get("compiles")
        out.update({key: float(r["est_ms"] / att["est_ms"]) if ok else None,
                    f"{kind}_est_ms": _figure(r, "est_ms"), f"{kind}_pool_copies": _figure(r, "pool_copies", int)})
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="rows 1 only")
    parser.add_argument("--generations", default="v5e,v6e")
    parser.add_argument("--baseline-blocks", metavar="BQ,BKV,BKVC",
                        help="compile only the baseline, rows 1, with these splash blocks (a sweep)")
    parser.add_argument("--writes", action="store_true",
                        help="compile only the writes (bf16 and quantized pools) at wan-1.3b")
    parser.add_argument("--worker", nargs=5, metavar=("GEN", "KIND", "ROWS", "PRESET", "DUMP"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        gen, kind, rows, preset, dump = args.worker
        print(json.dumps(worker(gen, kind, int(rows), preset, dump)))
        return 0
    _importable_checkout()
    from benchmarks import harness
    from pallas_kernels import tpu_aot

    if not tpu_aot.libtpu_available():
        harness.refuse(LIBTPU_MISSING)
    generations = args.generations.split(",")
    for gen in generations:
        if gen not in tpu_aot.CHIPS:
            parser.error(f"--generations: {gen!r} is not one of {', '.join(tpu_aot.GENERATIONS)}")
    shape = preset_shape(ATTENTION_PRESET)
    if args.baseline_blocks:
        bq, bkv, bkvc = (int(x) for x in args.baseline_blocks.split(","))
        os.environ[BLOCKS_ENV] = json.dumps(dict(block_q=bq, block_kv=bkv, block_kv_compute=bkvc))
        results = [run_job(gen, "baseline", 1, scoped_vmem=paged_vmem_limit(gen, 1)) for gen in generations]
        for r in results:
            print(harness.json_line(r))
        return 0 if all(r.get("compiles") for r in results) else 1
    if args.writes:
        return _writes_main(generations, shape)
    rows_list = (1,) if args.quick else (1, 4)
    summary, failed = dict(shape=shape), []
    print(f"{ATTENTION_PRESET}: {shape['visible_frames']} history frames + a {shape['cur_frames']}-frame "
          f"chunk ({(shape['visible_frames'] + shape['cur_frames']) * shape['tokens_per_frame']} keys); "
          "compiler-derived estimates (kernel bundles + exposed DMA + XLA:TPU's cost model of the XLA "
          "ops; see the module docstring)")
    for gen in generations:
        results = {}
        for rows in rows_list:
            results[("attention", rows)] = run_job(gen, "attention", rows)
            results[("baseline", rows)] = run_job(gen, "baseline", rows,
                                                  scoped_vmem=paged_vmem_limit(gen, rows))
            for kind in ("attention", "baseline"):
                r = results[(kind, rows)]
                print(_attention_line(gen, kind, rows, r))
                if not r.get("compiles"):
                    failed.append(f"{gen} {kind} rows={rows}")
        writes = {name: run_job(gen, "write", 1, name) for name in WRITE_PRESETS}
        for name, w in writes.items():
            print(_write_line(gen, w))
            if not w.get("compiles"):
                failed.append(f"{gen} write {name}")
        summary[gen] = _summary(results[("attention", 1)], results[("baseline", 1)], writes)
        quantized, failed_writes = _quantized_writes(gen, writes[ATTENTION_PRESET])
        summary[gen]["write_quantized"] = quantized
        failed += failed_writes
        quantized = {kind: run_job(gen, kind, 1) for kind in QUANTIZED_RATIO_KEYS}
        for kind, r in quantized.items():
            print(_attention_line(gen, kind, 1, r))
            if not r.get("compiles"):
                failed.append(f"{gen} {kind}")
        summary[gen].update(_quantized_summary(results[("attention", 1)], quantized))
        context = {kind: run_job(gen, kind, 1) for kind in CONTEXT_KINDS}
        for kind, r in context.items():
            print(_context_line(gen, kind, r))
            if not r.get("compiles"):
                failed.append(f"{gen} {kind}")
        ok = all(r.get("compiles") for r in context.values())
        summary[gen].update(context_est_ms=_figure(context["context"], "est_ms"),
                            context_xla_path_ms=_figure(context["context_xla"], "est_ms"),
                            context_vs_xla=context["context_xla"]["est_ms"] / context["context"]["est_ms"]
                            if ok else None)
        if not args.quick:
            for kind in ("attention", "baseline"):
                summary[gen][f"{kind}_rows4_est_ms"] = _figure(results[(kind, 4)], "est_ms")
    if failed:
        print(f"{len(failed)} compile(s) failed: {', '.join(failed)}", file=sys.stderr)
    print(harness.json_line(summary))
    return 1 if failed else 0


def _quantized_writes(gen: str, bf16: dict) -> tuple[dict, list[str]]:
    """Compiles and prints the quantized writes at :data:`ATTENTION_PRESET`: ``(summary, failed)``."""
    writes = {kind: run_job(gen, kind, 1) for kind in WRITE_KINDS if kind != "write"}
    for w in writes.values():
        print(_write_line(gen, w))
    return (_quantized_write_summary(bf16, writes),
            [f"{gen} {kind}" for kind, w in writes.items() if not w.get("compiles")])


def _writes_main(generations, shape: dict) -> int:
    """``--writes``: the bf16 and quantized writes at :data:`ATTENTION_PRESET` only."""
    from benchmarks import harness

    summary, failed = dict(shape=shape), []
    for gen in generations:
        bf16 = run_job(gen, "write", 1)
        print(_write_line(gen, bf16))
        quantized, failed_writes = _quantized_writes(gen, bf16)
        summary[gen] = dict(write_est_ms=_figure(bf16, "est_ms"), write_quantized=quantized)
        failed += failed_writes + ([] if bf16.get("compiles") else [f"{gen} write"])
    print(harness.json_line(summary))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
