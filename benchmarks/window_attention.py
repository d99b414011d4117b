"""Paged window attention vs dense attention over the same tokens held contiguously.

CPU (default): the XLA paged path (``backend="xla"``: history gathered through the page table, dense
float32-softmax attention) vs
``jax.nn.dot_product_attention`` on the visible history + current chunk laid out contiguously, both
jitted, timed in the same run (alternating runs, medians). The figure of merit is
``xla_paged_vs_dense_ratio`` = paged time / dense time (goal <= 1.15). Beside them the same history
in int8 and float8_e4m3fn pages (one scale per page, dequantized after the gather):
``int8_vs_plain_xla_ratio`` / ``fp8_vs_plain_xla_ratio`` = their time over the plain pool's (the
shape's dtype, float32 on the CPU shapes: the CPU has no native bf16; goal <= 1.3).

``--gpu`` (NVIDIA GPU only; refuses otherwise, in one line on stderr) runs
:mod:`benchmarks.gpu_window_attention` at its defaults (with ``--quick`` and ``--reps`` passed on):
every GPU backend against cuDNN at the Wan-1.3B shape.

Shapes: frames of ``tokens_per_frame`` tokens on pages of ``--block-size`` slots (frame aligned, last
page padded); ``sink`` + ``recent`` history frames are visible; queries = the current chunk.
The closing line is JSON with the figures.

Usage: ``python -m benchmarks.window_attention [--quick] [--gpu] [--reps N] [--block-size S]``
(``--block-size``: the CPU run's).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import QUANTIZED_PAGES, emit, median_seconds, parse_args, print_table, require_gpu
from pallas_kernels.common import pages_per_frame
from pallas_kernels.layout import from_token_major, quantize_pages
from pallas_kernels.window_attention import window_attention


@dataclasses.dataclass(frozen=True)
class Shape:
    """One benchmark shape (token counts in tokens, frames in frames)."""

    name: str
    heads: int
    head_dim: int
    tokens_per_frame: int
    chunk_frames: int
    sink_frames: int
    recent_frames: int
    dtype: str
    rows: int = 1

    @property
    def history_frames(self) -> int:
        return self.sink_frames + self.recent_frames

    @property
    def q_len(self) -> int:
        return self.chunk_frames * self.tokens_per_frame

    @property
    def keys(self) -> int:
        return (self.history_frames + self.chunk_frames) * self.tokens_per_frame

    def flops(self) -> float:
        """QK^T and PV matmuls: 4 * rows * heads * q_len * keys * head_dim."""
        return 4.0 * self.rows * self.heads * self.q_len * self.keys * self.head_dim


QUICK = Shape("quick", heads=4, head_dim=64, tokens_per_frame=390, chunk_frames=3, sink_frames=1,
              recent_frames=2, dtype="float32")
SMALL = Shape("small", heads=8, head_dim=64, tokens_per_frame=390, chunk_frames=3, sink_frames=3,
              recent_frames=6, dtype="float32")


def make_inputs(shape: Shape, block_size: int, seed: int = 0) -> dict:
    """Paged and contiguous copies of the same tokens.

    The pool holds one layer; the rows' history pages are a random permutation of pool pages, the
    rest of the pool is free (zeros). Returns the paged arguments plus ``k_dense``/``v_dense``
    ``[rows, keys, heads, head_dim]`` (history then current chunk).
    """
    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(shape.dtype)
    rows, heads, dim, tpf = shape.rows, shape.heads, shape.head_dim, shape.tokens_per_frame
    ppf = pages_per_frame(tpf, block_size)
    max_pages = shape.history_frames * ppf
    num_pages = 1 + rows * max_pages + 8
    hist = shape.history_frames * tpf

    def normal(*dims):
        return rng.standard_normal(dims, np.float32)

    k_hist, v_hist = normal(rows, hist, heads, dim), normal(rows, hist, heads, dim)
    k_pool = np.zeros((1, num_pages, block_size, heads, dim), np.float32)  # token-major, laid out below
    v_pool = np.zeros_like(k_pool)
    pages = (1 + rng.permutation(num_pages - 1)[:rows * max_pages]).reshape(rows, max_pages)
    for row in range(rows):
        for frame in range(shape.history_frames):
            for p in range(ppf):
                page = pages[row, frame * ppf + p]
                lo = frame * tpf + p * block_size
                n = min(block_size, (frame + 1) * tpf - lo)
                k_pool[0, page, :n] = k_hist[row, lo:lo + n]
                v_pool[0, page, :n] = v_hist[row, lo:lo + n]
    k_cur, v_cur = normal(rows, shape.q_len, heads, dim), normal(rows, shape.q_len, heads, dim)

    def put(x):
        return jax.device_put(jnp.asarray(x, dtype))

    return dict(
        q=put(normal(rows, shape.q_len, heads, dim)), k_cur=put(k_cur), v_cur=put(v_cur),
        k_pool=put(from_token_major(k_pool)), v_pool=put(from_token_major(v_pool)), pages=jnp.asarray(pages, jnp.int32),
        lengths=jnp.full((rows,), hist, jnp.int32), tokens_per_frame=tpf,
        k_dense=put(np.concatenate([k_hist, k_cur], axis=1)),
        v_dense=put(np.concatenate([v_hist, v_cur], axis=1)),
    )


def quantized_inputs(inputs: dict, kv_dtype) -> dict:
    """``inputs`` with both pools quantized to ``kv_dtype``, one scale per page
    (:func:`pallas_kernels.layout.quantize_pages`)."""
    return dict(inputs, k_pool=quantize_pages(inputs["k_pool"], kv_dtype),
                v_pool=quantize_pages(inputs["v_pool"], kv_dtype))


def paged_call(inputs: dict, backend: str, **tiles) -> tuple[Callable, tuple]:
    """A jitted paged call (layer passed as a traced scalar, as in a scan over layers) and its
    arguments."""
    tpf = inputs["tokens_per_frame"]

    @jax.jit
    def run(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, layer):
        return window_attention(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, layer=layer,
                                tokens_per_frame=tpf, backend=backend, **tiles)

    return run, (*(inputs[k] for k in ("q", "k_cur", "v_cur", "k_pool", "v_pool", "pages", "lengths")),
                 jnp.int32(0))


def paged_fn(inputs: dict, backend: str, **tiles):
    """:func:`paged_call` as a no-argument call."""
    run, args = paged_call(inputs, backend, **tiles)
    return lambda: run(*args)


def dense_call(inputs: dict, implementation: str | None = None) -> tuple[Callable, tuple]:
    """``jax.nn.dot_product_attention`` (jitted, with ``implementation``) on the same tokens held
    contiguously, and its arguments."""
    run = jax.jit(functools.partial(jax.nn.dot_product_attention, implementation=implementation))
    return run, (inputs["q"], inputs["k_dense"], inputs["v_dense"])


def interleaved_medians(fns: dict, reps: int) -> dict:
    """Median seconds per function over ``reps`` timed runs each, taken in alternation (one run of
    each function in turn, after one warm-up run each), so drifting load on a shared machine hits
    every contender alike."""
    for fn in fns.values():
        median_seconds(fn, reps=1, warmup=1)
    samples = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            samples[name].append(median_seconds(fn, reps=1, warmup=0))
    return {name: statistics.median(s) for name, s in samples.items()}


def max_abs_diff(a, b) -> float:
    return float(jnp.max(jnp.abs(a().astype(jnp.float32) - b().astype(jnp.float32))))


def cpu_benchmark(args) -> dict:
    shape = QUICK if args.quick else SMALL
    reps = args.reps or 15
    inputs = make_inputs(shape, args.block_size)
    run_dense, dense_args = dense_call(inputs)
    fns = {"xla_paged": paged_fn(inputs, "xla"), "dense": functools.partial(run_dense, *dense_args)}
    for key, dtype in QUANTIZED_PAGES.items():
        fns[f"xla_paged_{key}"] = paged_fn(quantized_inputs(inputs, dtype), "xla")
    diffs = {name: max_abs_diff(fns[name], fns["dense"]) for name in fns if name != "dense"}
    times = interleaved_medians(fns, reps)
    ratio = times["xla_paged"] / times["dense"]
    print(f"shape {shape}, block_size {args.block_size}, {reps} alternating reps")
    print_table(["path", "median ms", "GFLOP/s", "max |x - dense|"],
                [[name, t * 1e3, shape.flops() / t / 1e9, diffs.get(name, 0.0)] for name, t in times.items()])
    quantized = {f"{key}_vs_plain_xla_ratio": times[f"xla_paged_{key}"] / times["xla_paged"] for key in QUANTIZED_PAGES}
    print(f"xla_paged_vs_dense_ratio {ratio:.3f} (goal <= 1.15); max |paged - dense| {diffs['xla_paged']:.2e}; "
          + ", ".join(f"{k} {v:.3f}" for k, v in quantized.items()) + " (goal <= 1.3)")
    return {"mode": "cpu", "shape": dataclasses.asdict(shape), "block_size": args.block_size,
            "reps": reps, "xla_paged_ms": times["xla_paged"] * 1e3,
            "dense_ms": times["dense"] * 1e3, "xla_paged_vs_dense_ratio": ratio,
            "max_abs_diff": diffs["xla_paged"], **quantized,
            **{f"{key}_max_abs_diff": diffs[f"xla_paged_{key}"] for key in QUANTIZED_PAGES}}


def _extra_flags(parser) -> None:
    parser.add_argument("--gpu", action="store_true",
                        help="run benchmarks.gpu_window_attention: every GPU backend vs cuDNN (NVIDIA GPU only)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per page (the CPU run)")


def main(argv=None) -> int:
    args = parse_args(__doc__.splitlines()[0], argv, extra=_extra_flags)
    if args.gpu:
        require_gpu("benchmarks.window_attention --gpu", "without --gpu it runs the CPU benchmark")
        from benchmarks import gpu_window_attention

        return gpu_window_attention.main(["--quick"] * args.quick + ["--reps", str(args.reps)] * bool(args.reps))
    emit(cpu_benchmark(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
