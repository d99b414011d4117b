"""Compile the TPU kernels for v5e and v6e on this CPU machine and report what the compiler decided.

Needs libtpu (``pip install -e ".[tpu]"``); runs no kernel. At the ``wan-1.3b`` preset (30 layers,
12 KV heads x 128, 1,560-token frames in 1,560-slot pages, a 3-frame chunk over 12 visible frames)
for each generation it compiles, each in its own process (so each has its own bundle dump):

* the paged window attention (:mod:`pallas_kernels.window_attention.tpu`), rows 1 and 4;
* the gather + splash baseline (:mod:`pallas_kernels.window_attention.tpu_gather`), rows 1 and 4,
  with its generation's tuned splash tiles (``--baseline-blocks BQ,BKV,BKVC`` compiles only the
  baseline, rows 1, with other tiles: how they were tuned);
* the donated paged write (:mod:`pallas_kernels.paged_write.tpu`), one row's 3-frame commit.

Reported: whether each compiled, the kernel's VMEM estimate and limit, temporaries and aliased
bytes as fractions of the pools, pool copies in the optimized HLO, and a compiler-derived time:
final VLIW bundles of each loop (``--xla_jf_dump_llo_text``) times its trip count at the chip
clock, plus 0.35 us per grid step. That estimate assumes one bundle per cycle and omits stalls
(MXU result latency beyond the schedule, VMEM bank conflicts), DMA waits, HBM contention and the
XLA fusions around the kernels except the baseline's gather (counted as its HBM bytes over the
bandwidth). ``--quick`` compiles rows 1 only. The last line is JSON (a figure of a kernel that did
not compile is ``null``); the exit status is 1 if any kernel did not compile. Without libtpu it says
so in one line on stderr and exits with status 1, compiling nothing.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESET = dict(layers=30, kv_heads=12, head_dim=128, tokens_per_frame=1560, block_size=1560,
              cur_frames=3, visible_frames=12)
BLOCKS_ENV = "TPU_COMPILE_SPLASH_BLOCKS"
"""Environment variable (JSON ``{"block_q": ..}``) overriding the baseline's tuned splash blocks."""


# ------------------------------------------------------------------------------------------------
# Final-bundle parsing
# ------------------------------------------------------------------------------------------------

_BUNDLE = re.compile(r"^\s*(0x[0-9a-f]+|\d+)\s+(?:(LB|LH|LE|PB|PF|CT):|:)\s*(>*)\s*\{(.*)$")


def parse_bundles(path: str) -> list[tuple[str, int, str]]:
    """``(marker, loop depth, text)`` of every bundle of a ``*final_bundles.txt`` dump."""
    out = []
    for line in open(path):
        m = _BUNDLE.match(line)
        if m:
            out.append((m.group(2) or "", len(m.group(3)), m.group(4)))
    return out


def loop_tree(bundles) -> list[dict]:
    """The loops of a kernel in program order: ``{"start", "depth", "own", "children"}``, where
    ``own`` counts the loop body's bundles outside nested loops. Empty bundles stay in their loop."""
    loops, stack = [], []
    for i, (mark, depth, text) in enumerate(bundles):
        if text.strip().startswith("}"):
            depth = stack[-1]["depth"] if stack else 0
        while stack and (depth < stack[-1]["depth"] or (depth == stack[-1]["depth"] and mark == "LB")):
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
    files = sorted(glob.glob(os.path.join(dump_dir, f"*{name}*final_bundles.txt")))
    files = [f for f in files if "schedule-analysis" not in f]
    if not files:
        raise FileNotFoundError(f"no final bundles of {name} in {dump_dir}")
    return files[-1]


def _with_mxu(node) -> bool:
    return node["mxu"] > 0 or any(_with_mxu(c) for c in node["children"])


def attention_cycles(tree, trips: dict, bundles=None) -> tuple[float, str]:
    """Cycles of one grid step of the paged kernel (pages cut into pieces, every page full).

    Tree: the grid loop; inside it the tail-chunk loop (its query sub-block loop inside), the
    tail remainder's sub-block loop, and the history-block loop whose children are, per piece of a
    page, the unmasked then the masked sub-block loop (only the unmasked ones run on full pages).
    """
    grid = tree[0]
    kids = [c for c in grid["children"] if _with_mxu(c)]
    if trips["sub_blocks"] == 1 and bundles is not None:
        return _attention_cycles_one_sub_block(bundles, grid, kids, trips)
    tail = [c for c in kids if c["children"]][:-1] if trips["full_tail"] else []
    history = [c for c in kids if c["children"]][-1]
    rest = [c for c in kids if not c["children"]]
    sub = trips["sub_blocks"]
    cycles = grid["own"]
    for t in tail:
        cycles += trips["full_tail"] * (t["own"] + sub * sum(c["own"] for c in t["children"]))
    cycles += sum(sub * c["own"] for c in rest)
    fast = history["children"][0::2]
    cycles += trips["blocks"] * (history["own"] + sub * sum(c["own"] for c in fast))
    note = (f"grid loop {grid['own']} bundles/step; tail chunk loop x{trips['full_tail']}; "
            f"{trips['blocks']} history blocks of {history['own']} + {sub} x "
            f"{[c['own'] for c in fast]} bundles (unmasked pieces)")
    return cycles, note


def _attention_cycles_one_sub_block(bundles, grid, kids, trips) -> tuple[float, str]:
    """:func:`attention_cycles` when ``block_q_compute`` covers the whole query block: the
    one-trip sub-block loops are gone, so the tail-chunk loop and the history-block loop have no
    children. Inside the history-block loop each piece of a page is an unmasked then a masked
    predicated region; the loop body is cut at its predicated-region fallthroughs (``PF``) and the
    even segments (preamble + unmasked piece, then each further unmasked piece) are counted."""
    history = kids[-1]
    tail = kids[:-1] if trips["full_tail"] else []
    cycles = grid["own"] + sum(trips["full_tail"] * t["own"] for t in tail)
    start, end = history["start"], history["start"] + history["own"]
    cuts = [start] + [i for i in range(start, end) if bundles[i][0] == "PF"] + [end]
    segments = [b - a for a, b in zip(cuts, cuts[1:])]
    fast = sum(segments[0::2])
    cycles += trips["blocks"] * fast
    note = (f"grid loop {grid['own']} bundles/step; tail chunk loop x{trips['full_tail']} of "
            f"{[t['own'] for t in tail]}; {trips['blocks']} history blocks of {fast} bundles "
            f"(unmasked path; segments {segments})")
    return cycles, note


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


# ------------------------------------------------------------------------------------------------
# Worker: one compile in this process (LIBTPU_INIT_ARGS set by the parent)
# ------------------------------------------------------------------------------------------------


def worker(gen: str, kind: str, rows: int, dump: str) -> dict:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    _importable_checkout()
    import functools

    import jax.numpy as jnp

    from pallas_kernels import tpu_aot
    from pallas_kernels.layout import pool_shape
    from pallas_kernels.paged_write import write_chunk as dispatch_write
    from pallas_kernels.window_attention import tpu as twa
    from pallas_kernels.window_attention.tpu_gather import gather_window_attention, resolve_blocks

    write_chunk = functools.partial(dispatch_write, backend="pallas_tpu")

    chip = tpu_aot.CHIPS[gen]
    p = PRESET
    bf = jnp.bfloat16
    h, d, t, s = p["kv_heads"], p["head_dim"], p["tokens_per_frame"], p["block_size"]
    q_len = p["cur_frames"] * t
    max_pages = p["visible_frames"]
    out: dict = dict(gen=gen, kind=kind, rows=rows)
    splash_blocks = resolve_blocks(gen, **json.loads(os.environ.get(BLOCKS_ENV, "{}")))
    if kind == "write":
        pages = 16
        shape = pool_shape(p["layers"], pages, s, h, d)
        new = (p["layers"], rows, q_len, h, d)
        specs = [(shape, bf)] * 2 + [(new, bf)] * 2 + [((rows, p["cur_frames"]), jnp.int32)]
        fn = write_chunk
        donate = (0, 1)
    else:
        pages = rows * max_pages + 1
        shape = pool_shape(p["layers"], pages, s, h, d)
        kv = (rows, q_len, h, d)
        specs = [((rows, q_len, h, d), bf), (kv, bf), (kv, bf), (shape, bf), (shape, bf),
                 ((rows, max_pages), jnp.int32), ((rows,), jnp.int32), ((), jnp.int32)]
        donate = ()
        if kind == "attention":
            def fn(q, kc, vc, kp, vp, pg, ln, layer):
                return twa.window_attention(q, kc, vc, kp, vp, pg, ln, layer=layer,
                                            generation=gen)
        else:
            def fn(q, kc, vc, kp, vp, pg, ln, layer):
                return gather_window_attention(q, kc, vc, kp, vp, pg, ln, layer=layer,
                                               **splash_blocks)
    pool_bytes = 2 * 2 * math.prod(int(d) for d in shape)
    try:
        compiled = tpu_aot.compile_for_tpu(fn, specs, gen, donate_argnums=donate)
    except Exception as e:  # Report a failed compile as data.
        out.update(compiles=False, error=str(e).splitlines()[0][:300])
        return out
    rep = tpu_aot.report(compiled, [shape])
    out.update(compiles=True, pool_copies=rep.pool_copies, pool_bytes=pool_bytes,
               temp_bytes=rep.temp_bytes, temp_fraction=rep.temp_bytes / pool_bytes,
               alias_fraction=rep.alias_bytes / pool_bytes)
    flops = 4 * rows * q_len * (max_pages * t + q_len) * h * d  # QK and PV, useful keys only.
    out["flops"] = flops
    if kind == "write":
        moved = 2 * p["layers"] * h * rows * p["cur_frames"] * s * d * 2  # K and V pages.
        tree = loop_tree(parse_bundles(kernel_dump(dump, "paged_write_tpu")))
        issue = sum(n["own"] for n in tree) * (rows * p["cur_frames"] + 8) / chip.clock_hz
        hbm = 2 * moved / chip.hbm_bytes_per_s  # Read the chunk, write the pages.
        out.update(bytes_moved=moved, hbm_ms=hbm * 1e3, issue_ms=issue * 1e3,
                   est_ms=max(hbm, issue) * 1e3, fraction_of_hbm=hbm / max(hbm, issue))
        return out
    if kind == "attention":
        geom = twa.Geometry(rows, q_len, h, h, d, q_len, 0, p["layers"], pages, s, max_pages, t,
                            "bfloat16")
        plan = twa.make_plan(geom, twa.TUNED_BLOCKS[gen])
        bundles = parse_bundles(kernel_dump(dump, "window_attention_tpu"))
        m = geom.group * plan.block_q
        trips = dict(full_tail=geom.tail_len // plan.block_kv_compute,
                     sub_blocks=m // plan.block_q_compute, blocks=-(-max_pages // plan.pages_per_block))
        per_step, note = attention_cycles(loop_tree(bundles), trips, bundles)
        steps = rows * h * plan.num_q_blocks
        seconds = steps * per_step / chip.clock_hz + steps * tpu_aot.GRID_STEP_SECONDS
        out.update(vmem_estimate=twa.vmem_estimate_bytes(geom, plan),
                   vmem_limit=twa._vmem_limit(twa.vmem_estimate_bytes(geom, plan), gen),
                   temp_bound=twa.temp_bound_bytes(geom, plan), grid_steps=steps,
                   est_ms=seconds * 1e3, note=note)
    else:
        bundles = parse_bundles(kernel_dump(dump, "splash_mqa_fwd"))
        steady, once, note = splash_cycles(bundles, loop_tree(bundles))
        b = splash_blocks
        out["blocks"] = b
        q_blocks = -(-q_len // b["block_q"])
        kv_blocks = -(-(max_pages * t + q_len) // b["block_kv"])
        steps = rows * h * q_blocks * kv_blocks
        kernel_s = (steps * steady + rows * h * q_blocks * once) / chip.clock_hz \
            + steps * tpu_aot.GRID_STEP_SECONDS
        gathered = 2 * rows * h * kv_blocks * b["block_kv"] * d * 2  # K and V, written.
        history = 2 * rows * h * max_pages * t * d * 2  # K and V pages, read.
        gather_s = (gathered + history) / chip.hbm_bytes_per_s
        out.update(grid_steps=steps, kernel_ms=kernel_s * 1e3, gather_ms=gather_s * 1e3,
                   est_ms=(kernel_s + gather_s) * 1e3, note=note)
    out["fraction_of_peak"] = flops / (out["est_ms"] * 1e-3) / chip.bf16_flops
    return out


# ------------------------------------------------------------------------------------------------
# Driver
# ------------------------------------------------------------------------------------------------


def run_job(gen: str, kind: str, rows: int) -> dict:
    with tempfile.TemporaryDirectory() as dump:
        env = dict(os.environ, JAX_PLATFORMS="cpu",
                   LIBTPU_INIT_ARGS=f"--xla_jf_dump_to={dump} --xla_jf_dump_llo_text=true")
        # Compile-only devices touch no chip, so libtpu's one-process lock (/tmp/libtpu_lockfile)
        # need not stop a compile while another process (a test run, say) has libtpu loaded.
        env.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        proc = subprocess.run([sys.executable, "-m", "benchmarks.tpu_compile", "--worker", gen, kind,
                               str(rows), dump], env=env, cwd=ROOT, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode or not lines:
            return dict(gen=gen, kind=kind, rows=rows, compiles=False,
                        error=(proc.stderr.strip().splitlines() or ["no output"])[-1][:300])
        return json.loads(lines[-1])


LIBTPU_MISSING = ("libtpu is not installed: pip install 'arkv-jax[tpu]' (in a checkout: pip install -e '.[tpu]'); "
                  "benchmarks.tpu_compile compiles the TPU kernels with it and compiled nothing")


def _importable_checkout() -> None:
    """Puts the checkout on ``sys.path`` (for ``python benchmarks/tpu_compile.py``, run as a file)."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)


def _figure(result: dict, key: str, kind=float):
    """``result[key]`` as ``kind``, or ``None`` when the kernel did not compile (or lacks it)."""
    value = result.get(key) if result.get("compiles") else None
    return None if value is None else kind(value)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="rows 1 only")
    parser.add_argument("--generations", default="v5e,v6e")
    parser.add_argument("--baseline-blocks", metavar="BQ,BKV,BKVC",
                        help="compile only the baseline, rows 1, with these splash blocks (a sweep)")
    parser.add_argument("--worker", nargs=4, metavar=("GEN", "KIND", "ROWS", "DUMP"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        gen, kind, rows, dump = args.worker
        print(json.dumps(worker(gen, kind, int(rows), dump)))
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
    if args.baseline_blocks:
        bq, bkv, bkvc = (int(x) for x in args.baseline_blocks.split(","))
        os.environ[BLOCKS_ENV] = json.dumps(dict(block_q=bq, block_kv=bkv, block_kv_compute=bkvc))
        results = [run_job(gen, "baseline", 1) for gen in generations]
        for r in results:
            print(harness.json_line(r))
        return 0 if all(r.get("compiles") for r in results) else 1
    rows_list = (1,) if args.quick else (1, 4)
    summary, failed = {}, []
    print("compiler-derived estimates: final bundles x trip counts at the chip clock + 0.35 us per "
          "grid step; they omit stalls, DMA waits and HBM contention (see the module docstring)")
    for gen in generations:
        results = {}
        for kind in ("attention", "baseline"):
            for rows in rows_list:
                results[(kind, rows)] = r = run_job(gen, kind, rows)
                if r.get("compiles"):
                    extra = (f" vmem est {r['vmem_estimate'] / 2**20:.1f} MiB (limit "
                             f"{r['vmem_limit'] / 2**20:.0f} MiB)" if kind == "attention" else
                             f" (kernel {r['kernel_ms']:.3f} ms + gather {r['gather_ms']:.3f} ms,"
                             f" splash tiles {r['blocks']})")
                    print(f"{gen} {kind:9s} rows={rows}: compiles, pool copies {r['pool_copies']}, "
                          f"temp {r['temp_fraction']:.2%} of pools ({r['temp_bytes'] / 2**20:.1f} "
                          f"MiB), est {r['est_ms']:.3f} ms = {r['est_ms'] / rows:.3f} ms per row "
                          f"and layer, {r['fraction_of_peak']:.1%} of bf16 peak;{extra}; "
                          f"{r['note']}")
                else:
                    failed.append(f"{gen} {kind} rows={rows}")
                    print(f"{gen} {kind:9s} rows={rows}: DOES NOT COMPILE: {r.get('error')}")
        w = run_job(gen, "write", 1)
        if w.get("compiles"):
            print(f"{gen} write rows=1: compiles, pool copies {w['pool_copies']}, temp "
                  f"{w['temp_fraction']:.4%} and aliased {w['alias_fraction']:.3f} of both pools; "
                  f"{w['bytes_moved'] / 2**20:.1f} MiB of pages per commit, HBM time "
                  f"{w['hbm_ms']:.3f} ms, DMA issue {w['issue_ms']:.4f} ms -> "
                  f"{w['fraction_of_hbm']:.1%} of HBM bandwidth")
        else:
            failed.append(f"{gen} write rows=1")
            print(f"{gen} write: DOES NOT COMPILE: {w.get('error')}")
        att, base = results[("attention", 1)], results[("baseline", 1)]
        ok = att.get("compiles") and base.get("compiles")
        summary[gen] = dict(
            attention_compiles=bool(att.get("compiles")),
            attention_pool_copies=_figure(att, "pool_copies", int),
            attention_est_ms=_figure(att, "est_ms"),
            baseline_est_ms=_figure(base, "est_ms"),
            attention_vs_baseline=float(base["est_ms"] / att["est_ms"]) if ok else None,
            attention_fraction_of_peak=_figure(att, "fraction_of_peak"),
            baseline_fraction_of_peak=_figure(base, "fraction_of_peak"),
            write_pool_copies=_figure(w, "pool_copies", int),
            write_temp_fraction=_figure(w, "temp_fraction"),
            write_alias_fraction=_figure(w, "alias_fraction"),
            write_fraction_of_hbm=_figure(w, "fraction_of_hbm"),
        )
        if not args.quick:
            for kind in ("attention", "baseline"):
                summary[gen][f"{kind}_rows4_est_ms"] = _figure(results[(kind, 4)], "est_ms")
    if failed:
        print(f"{len(failed)} compile(s) failed: {', '.join(failed)}", file=sys.stderr)
    print(harness.json_line(summary))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
