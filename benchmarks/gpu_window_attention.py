"""Every GPU window-attention backend against cuDNN on the same tokens held contiguously (NVIDIA GPU
only; refuses to run elsewhere).

At the Wan-1.3B shape (12 heads, head_dim 128, chunk 3 frames x 1,560 tokens, sink 3 + recent 9
history frames, bf16), for rows 1 and 4, in one run with alternating timed repetitions (medians):

* ``mosaic_<block_kv>x<stages>``: the Mosaic GPU kernel (``backend="pallas_mgpu"``,
  :mod:`pallas_kernels.window_attention.mosaic_gpu`) at each ``--mosaic-tilings`` entry,
* ``triton_<block_q>x<block_k>x<warps>x<stages>``: the Triton kernel (``backend="pallas_gpu"``,
  :mod:`pallas_kernels.window_attention.gpu`) at each ``--triton-tilings`` entry,
* ``cudnn_gather``: ``backend="cudnn_gather"`` (the GPU default,
  :mod:`pallas_kernels.window_attention.cudnn_gather`),
* ``cudnn_dense``: ``jax.nn.dot_product_attention(implementation="cudnn")`` on the visible history
  + chunk laid out contiguously (the yardstick),
* ``triton``, ``triton_<int8|fp8>``, ``cudnn_gather_<int8|fp8>``: the Triton kernel at its default
  tiling over bf16 pages and, like ``cudnn_gather``, over the same tokens in int8 and float8_e4m3fn
  pages (one scale per page; ``<path>_<key>_vs_bf16`` is the quantized call's time over the same
  path's on bf16 pages; their max |diff| includes the quantization error),

on a pool of ``--block-size``-token pages (default 1,664 = 13 x 128, one page per frame: what the
Mosaic GPU kernel requires). TFLOP/s count the QK^T and PV matmuls over the valid keys and are
compared with the card's bf16 peak measured in the same run (a chain of 8192^3 bf16 matmuls).
Each backend's output is compared with the dense result (max |diff|). The last line is JSON.

``--quick`` runs rows 1 only, 5 repetitions and the first tiling of each kernel. Without an NVIDIA
GPU it says so in one line on stderr and exits with status 1 (``--gpu`` is accepted and changes
nothing: this benchmark always needs the GPU).

Usage: ``python -m benchmarks.gpu_window_attention [--quick] [--reps N] [--rows 1 4]``
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp

from benchmarks import harness
from benchmarks.gpu_compile import attention_at_tiling
from benchmarks.window_attention import (
    Shape,
    dense_call,
    interleaved_medians,
    make_inputs,
    max_abs_diff,
    paged_call,
    quantized_inputs,
)

ARGS = ("q", "k_cur", "v_cur", "k_pool", "v_pool", "pages", "lengths")
MOSAIC_TILINGS = ("128x2", "128x3", "64x4")
TRITON_TILINGS = ("128x64x8x3", "64x64x4x3", "128x128x8x2")


def wan_shape(rows: int, recent_frames: int) -> Shape:
    return Shape("wan-1.3b", heads=12, head_dim=128, tokens_per_frame=1560, chunk_frames=3,
                 sink_frames=3, recent_frames=recent_frames, dtype="bfloat16", rows=rows)


def measured_bf16_peak_tflops(reps: int = 10) -> float:
    """TFLOP/s of a jitted chain of four 8192 x 8192 x 8192 bf16 matmuls (f32 accumulation)."""
    n = 8192
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)

    @jax.jit
    def chain(x):
        for _ in range(4):
            x = jnp.dot(x, a, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
        return x

    times = interleaved_medians({"mm": lambda: chain(a)}, reps)
    return 4 * 2 * n ** 3 / times["mm"] / 1e12


def at_tiling(inputs: dict, module, validate_as: str, **tiling) -> tuple[Callable, tuple]:
    """A backend module's kernel at ``tiling`` (the module's own keyword arguments) on ``inputs``
    (layer 0, Wan's 1,560-token frames), validated as ``validate_as``: the jitted call and its
    arguments."""
    return attention_at_tiling(module, validate_as, **tiling), tuple(inputs[k] for k in ARGS)


def calls(inputs: dict, mosaic_tilings, triton_tilings) -> dict[str, tuple[Callable, tuple]]:
    """Every timed path on ``inputs`` (:func:`benchmarks.window_attention.make_inputs`): name ->
    (jitted call, arguments)."""
    from pallas_kernels.window_attention import gpu, mosaic_gpu

    out = {"cudnn_dense": dense_call(inputs, implementation="cudnn"),
           "cudnn_gather": paged_call(inputs, "cudnn_gather")}
    for text in mosaic_tilings:
        out[f"mosaic_{text}"] = at_tiling(inputs, mosaic_gpu, "pallas_mgpu",
                                          **parse_tiling(text, ("block_kv", "stages")))
    for text in triton_tilings:
        out[f"triton_{text}"] = at_tiling(inputs, gpu, "pallas_gpu", backend="pallas_gpu",
                                          **parse_tiling(text, ("block_q", "block_k", "num_warps", "num_stages")))
    out["triton"] = paged_call(inputs, "pallas_gpu")
    for key, kv_dtype in harness.QUANTIZED_PAGES.items():
        pages = quantized_inputs(inputs, kv_dtype)
        out[f"triton_{key}"] = paged_call(pages, "pallas_gpu")
        out[f"cudnn_gather_{key}"] = paged_call(pages, "cudnn_gather")
    return out


def parse_tiling(text: str, keys: tuple[str, ...]) -> dict:
    values = [int(v) for v in text.split("x")]
    if len(values) != len(keys):
        raise ValueError(f"tiling {text!r} must give {len(keys)} values {'x'.join(keys)}")
    return dict(zip(keys, values))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true",
                        help="accepted for older command lines; the benchmark always needs an NVIDIA GPU")
    parser.add_argument("--quick", action="store_true",
                        help="rows 1, 5 reps, the first tiling of each kernel")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (default 20, 5 with --quick)")
    parser.add_argument("--rows", type=int, nargs="+", default=None, help="default: 1 4 (1 with --quick)")
    parser.add_argument("--recent-frames", type=int, default=9)
    parser.add_argument("--block-size", type=int, default=1664)
    parser.add_argument("--mosaic-tilings", nargs="*", default=None,
                        help=f"block_kv x stages (default {' '.join(MOSAIC_TILINGS)}; the first with --quick)")
    parser.add_argument("--triton-tilings", nargs="*", default=None,
                        help=f"block_q x block_k x num_warps x num_stages (default {' '.join(TRITON_TILINGS)}; "
                             "the first with --quick)")
    args = parser.parse_args(argv)
    harness.require_gpu("benchmarks.gpu_window_attention")
    defaults = slice(1) if args.quick else slice(None)
    args.reps = args.reps or (5 if args.quick else 20)
    args.rows = args.rows or ([1] if args.quick else [1, 4])
    if args.mosaic_tilings is None:
        args.mosaic_tilings = list(MOSAIC_TILINGS[defaults])
    if args.triton_tilings is None:
        args.triton_tilings = list(TRITON_TILINGS[defaults])
    peak = measured_bf16_peak_tflops()
    print(f"device {jax.devices()[0].device_kind}; measured bf16 matmul peak {peak:.1f} TFLOP/s")
    results = []
    for rows in args.rows:
        shape = wan_shape(rows, args.recent_frames)
        inputs = make_inputs(shape, args.block_size)
        fns = {name: functools.partial(run, *call_args)
               for name, (run, call_args) in calls(inputs, args.mosaic_tilings, args.triton_tilings).items()}
        errors, diffs = {}, {}
        for name in list(fns):
            try:
                diffs[name] = max_abs_diff(fns[name], fns["cudnn_dense"])
            except Exception as error:  # A backend that fails is reported, the others still run.
                errors[name] = f"{type(error).__name__}: {str(error)[:300]}"
                del fns[name]
        times = interleaved_medians(fns, args.reps)
        flops = shape.flops()
        print(f"\nrows {rows}: {shape}, block_size {args.block_size}, {args.reps} alternating reps")
        print(f"{'path':24s} {'median ms':>10s} {'TFLOP/s':>9s} {'of peak':>8s} {'vs dense':>9s} "
              f"{'max|diff|':>10s}")
        for name, t in times.items():
            tf = flops / t / 1e12
            print(f"{name:24s} {t * 1e3:10.3f} {tf:9.1f} {tf / peak:8.3f} "
                  f"{times['cudnn_dense'] / t:9.3f} {diffs[name]:10.2e}")
        for name, error in errors.items():
            print(f"{name:24s} FAILED {error}")
        results.append(dict(rows=rows, shape=dataclasses.asdict(shape),
                            ms={n: t * 1e3 for n, t in times.items()},
                            tflops={n: flops / t / 1e12 for n, t in times.items()},
                            speed_vs_cudnn_dense={n: times["cudnn_dense"] / t
                                                  for n, t in times.items()},
                            quantized_vs_bf16={f"{path}_{key}_vs_bf16": times[f"{path}_{key}"] / times[path]
                                               for path in ("triton", "cudnn_gather")
                                               for key in harness.QUANTIZED_PAGES
                                               if f"{path}_{key}" in times and path in times},
                            max_abs_diff=diffs, errors=errors))
    print(harness.json_line(dict(mode="gpu", device=jax.devices()[0].device_kind, jax=jax.__version__,
                                 block_size=args.block_size, reps=args.reps, quick=args.quick,
                                 measured_peak_tflops=peak, results=results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
