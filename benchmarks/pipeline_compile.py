"""Compile the whole streaming generator at Wan-1.3B's real shape for v5e and v6e; plan each chip.

Needs libtpu (``pip install -e ".[tpu]"``); runs nothing. For each generation, on a compile-only
device (:mod:`arkv_jax.pipeline`): the chunk program exactly as ``Rollout.step()`` runs it (the
sampler's denoise forwards and the commit forward over the paged pools, ``pallas_tpu`` attention)
for Self-Forcing (4 steps) and CausVid (3 steps), without and with CFG, and Self-Forcing over int8
K/V pages (``streams_per_chip_int8_vs_bf16``), at each batch bucket up to
the first that does not fit; the streaming VAE decode of one chunk per batch; one prompt's text
encoding (umT5-XXL, 512 tokens) and its cross-attention K/V; one prompt switch's recache.

Time, a compiler estimate: XLA:TPU's ``estimated_cycles`` of every instruction outside the Mosaic
kernels, loops times their trip counts (:mod:`pallas_kernels.tpu_cost`; the copies its cost model
prices with a placeholder count their bytes' round trip through HBM, ``placeholder_copy_gb`` the
bytes they write), plus each Mosaic call (attention, ``attention_s``; the DiT block's q/k/v
projection, cross query and MLP, ``block_kernels_s``) priced by the kernel's own bundle estimate
at the same rows
(:mod:`pallas_kernels.window_attention.tpu_estimate`, as ``benchmarks/tpu_compile.py`` prices it), plus
the commit at HBM bandwidth. It cannot see DMA stalls, host overhead or real clocks. Memory: the
whole-chip plan (:func:`arkv_jax.pipeline.plan_chip`), checked against the compiled programs at the
planned pool size (``plan_vs_compiled_bytes``). ``--quick``: batch 1, Self-Forcing without CFG.
The last line is JSON, per chip. Host memory: compiling the largest full-form programs takes 14-22
GiB, so on a 24 GiB machine run one chip and variant per process (``--generations``,
``--variants``); ``streams_per_chip_int8_vs_bf16`` needs both of its variants in one run.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _importable_checkout() -> None:
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)


#: Samplers, guidance and K/V pages compiled: label -> (pipeline name, CFG scale or None, page
#: dtype or None for the compute dtype's).
VARIANTS = {"self-forcing": ("self-forcing", None, None), "self-forcing+cfg": ("self-forcing", 3.0, None),
            "causvid": ("causvid", None, None), "causvid+cfg": ("causvid", 3.0, None),
            "self-forcing+int8": ("self-forcing", None, "int8")}


def variants(names):
    """``(label, pipeline)`` of each variant in ``names`` (keys of :data:`VARIANTS`)."""
    import dataclasses

    from arkv_jax.pipeline import PIPELINES

    out = []
    for name in names:
        base, guidance, kv_dtype = VARIANTS[name]
        pipeline = PIPELINES[base].with_kv_dtype(kv_dtype)
        out.append((name, pipeline.with_(sampler=dataclasses.replace(pipeline.sampler, guidance_scale=guidance))))
    return out


def event_seconds(pipeline, generation: str, price) -> dict:
    """Seconds of the per-prompt programs: the text encoding with its K/V, and a recache."""
    from arkv_jax import pipeline as pl

    fn, args = pl.text_program(pipeline)
    text = pl.measure(pl.compile_for(fn, args, generation), generation)
    encoder_bytes = pl.tree_bytes(args[0])
    fn, args = pl.recache_program(pipeline, pl._pages_for(pipeline, 1))
    recache = pl.measure(pl.compile_for(fn, args, generation), generation)
    return dict(text_seconds=text.xla_seconds, text_temp_bytes=text.temp_bytes,
                text_encoder_bytes=encoder_bytes,
                recache_seconds=pl.program_seconds(recache, price))


def chip_report(generation: str, names, buckets) -> dict:
    from arkv_jax import pipeline as pl
    from pallas_kernels import adaln_mlp, cross_query, qkv_projection, tpu_aot

    chip = tpu_aot.CHIPS[generation]
    rows, plans = [], {}
    for label, pipeline in variants(names):
        price = pl.attention_pricer(pipeline, generation)
        plans[label] = plan = pl.plan_chip(pipeline, generation, buckets=buckets, kernel_seconds=price)
        for b in plan.buckets:
            row = dict(variant=label, batch=b.batch, fits=b.fits)
            if b.refused:
                row.update(refused=b.refused)
            else:
                decode = pl.program_seconds(b.decode, price)
                row.update(transient_gib=b.transient_bytes / 2**30, chunk_xla_s=b.chunk.xla_seconds,
                           decode_s=decode, unpriced=b.chunk.unpriced + b.decode.unpriced,
                           placeholder_copy_gb=(b.chunk.placeholder_copy_bytes + b.decode.placeholder_copy_bytes) / 1e9)
            if b.chunk_seconds is not None:
                kernels = b.chunk_seconds - b.chunk.xla_seconds - decode \
                    - pl.commit_seconds(pipeline, b.batch, generation)
                block_prefixes = tuple(k.KERNEL_PREFIX for k in (qkv_projection, cross_query, adaln_mlp))
                block = sum(price(name, rows) * calls for (name, rows), calls in b.chunk.kernel_calls.items()
                            if name.startswith(block_prefixes))
                dit = b.chunk.xla_seconds + kernels
                per_stream, per_chip = b.video_fps(plan.frames_per_chunk)
                row.update(chunk_s=b.chunk_seconds, attention_s=kernels - block, block_kernels_s=block,
                           dit_s=dit, fps_per_stream=per_stream, fps_per_chip=per_chip,
                           dit_fraction_of_peak=pl.dit_flops(pipeline, b.batch) / dit / chip.bf16_flops)
            rows.append(row)
            print(f"{generation} {label:17s} batch {b.batch}: " + ", ".join(
                f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
                if k not in ("variant", "batch")), flush=True)
    main = plans[names[0]]
    print(main.summary(), flush=True)
    single = next(r for r in rows if r["variant"] == names[0] and r["batch"] == 1)
    best = main.best_bucket()
    fitting = [b for b in main.buckets if b.fits]
    ratio = None
    if fitting:
        top = fitting[-1]
        ratio = pl.predicted_total(main.pipeline, top) / pl.compiled_total(main.pipeline, top, generation)
    events = event_seconds(main.pipeline, generation, pl.attention_pricer(main.pipeline, generation))
    print(f"{generation} per prompt: text encoding {events['text_seconds']:.3f} s, recache "
          f"{events['recache_seconds']:.3f} s", flush=True)
    int8 = {"self-forcing", "self-forcing+int8"} <= plans.keys() and plans["self-forcing"].streams_per_chip
    return dict(
        streams_per_chip=main.streams_per_chip,
        streams_per_chip_int8_vs_bf16=(plans["self-forcing+int8"].streams_per_chip
                                       / plans["self-forcing"].streams_per_chip) if int8 else None,
        fps_single_stream=single.get("fps_per_stream"),
        fps_per_chip_best_batch=best.video_fps(main.frames_per_chunk)[1] if best else None,
        best_batch=best.batch if best else None,
        dit_fraction_of_peak=single.get("dit_fraction_of_peak"),
        vae_share_of_chunk=single["decode_s"] / single["chunk_s"] if "chunk_s" in single else None,
        plan_vs_compiled_bytes=ratio,
        attention_share_of_chunk=single["attention_s"] / single["chunk_s"] if "chunk_s" in single else None,
        **events,
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="batch 1, Self-Forcing without CFG")
    parser.add_argument("--generations", default="v5e,v6e")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"samplers compiled, from {', '.join(VARIANTS)} (the first is planned); "
                             "--quick: self-forcing")
    args = parser.parse_args(argv)
    _importable_checkout()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from benchmarks import harness
    from benchmarks.tpu_compile import LIBTPU_MISSING
    from pallas_kernels import tpu_aot

    if not tpu_aot.libtpu_available():
        harness.refuse(LIBTPU_MISSING)
    generations = args.generations.split(",")
    for gen in generations:
        if gen not in tpu_aot.CHIPS:
            parser.error(f"--generations: {gen!r} is not one of {', '.join(tpu_aot.GENERATIONS)}")
    names = ["self-forcing"] if args.quick else args.variants.split(",")
    for name in names:
        if name not in VARIANTS:
            parser.error(f"--variants: {name!r} is not one of {', '.join(VARIANTS)}")
    buckets = (1,) if args.quick else (1, 2, 4, 8, 16)
    print("compiler estimates (XLA:TPU cycles outside kernels + the kernels' bundle estimate + the commit "
          "at HBM bandwidth); they omit DMA stalls, host overhead and real clocks", flush=True)
    summary = {gen: chip_report(gen, names, buckets) for gen in generations}
    print(harness.json_line(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
