"""Benchmark of the paged chunk write (pallas_kernels/paged_write/).

CPU (default): the XLA path's write bandwidth against a plain contiguous copy of the same bytes into
the same pools (a donated ``dynamic_update_slice`` of one ``[L, N, S, H, D]`` slab), measured in one
run, plus the memory figures of the jitted, donated write from ``memory_analysis()``:

- ``xla_vs_copy_ratio``: XLA-path bytes/s over contiguous-copy bytes/s (goal >= 0.8), bf16, 30
  layers of Wan-1.3B-sized pages (16 tokens x 12 KV heads x 128), frames of exactly one page;
- ``xla_vs_runtime_offset_copy_ratio``: the same against the same copy at a start page known only
  at run time, as a paged write's pages are.

On several cores XLA:CPU may split one large copy over all of them, while the XLA path's page
updates run one after another inside a loop, so the ratios also measure that parallelism. Measured
on 2 cores (2026-11-30): fp32 30 layers 0.42-0.66, bf16 30 layers 0.89-1.17; pinned to one core
(``taskset -c 0``) every case is 0.87-0.96.
- ``temp_bytes_fraction``: compiled temp bytes / pool bytes (goal < 0.01);
- ``aliased_pool_fraction``: aliased bytes / pool bytes (goal 1.0);
- ``int8_vs_bf16_write`` / ``fp8_vs_bf16_write``: time of the write into int8 / float8_e4m3fn pages
  (quantized in the write, one scale per page) over the write into bf16 pages, the same bf16 chunk,
  timed in alternation (goal <= 1.3), with the quantized writes' own temp and alias fractions;
  ``*_padded``: the same with frames of 24 tokens (each frame's second page padded, as at real
  shapes: 1,560 tokens are 97.5 pages of 16).

``--gpu`` (NVIDIA GPU only; refuses otherwise): at the Wan-1.3B shape (30 layers, 12 KV heads, head
dim 128, bf16, 3 frames of 1,560 tokens per row, ``--block-size`` 16 by default, i.e. 98 pages per
frame with 8 padding tokens), the Pallas GPU kernel's bandwidth against a device-to-device copy of
the same bytes, an XLA scatter (``unique_indices``, ``mode="drop"``) and the library's XLA path; and
the same bf16 chunk written by the Pallas GPU kernel and the scatter (``"auto"``) into int8 and
float8_e4m3fn pages (quantized in the write), ``<case>_<int8|fp8>_vs_bf16`` their times over the
same write into bf16 pages.
Without a GPU it says so in one line on stderr and exits with status 1.

Bandwidth counts the K/V bytes written to the pools (padding included), once; a copy also reads
them, so memory traffic is twice that. The last line is the JSON of the figures.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from benchmarks.harness import QUANTIZED_PAGES, emit, median_seconds, parse_args, print_table, require_gpu
from pallas_kernels.layout import PAGE_AXIS, pool_geometry, pool_shape, set_pages, zero_pool
from pallas_kernels.paged_write import pages_per_frame, write_chunk


def _extra_flags(parser) -> None:
    parser.add_argument("--gpu", action="store_true",
                        help="Pallas GPU kernel at the Wan-1.3B shape (needs an NVIDIA GPU)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per page (--gpu)")
    parser.add_argument("--rows", type=int, default=1, help="rows (sessions) per write (--gpu)")


def make_inputs(layers, num_pages, block_size, kv_heads, head_dim, rows, frames,
                tokens_per_frame, dtype, seed=0):
    """Zeroed pools, a random chunk and distinct random page ids (a permutation of [1, P))."""
    rng = np.random.default_rng(seed)
    shape = pool_shape(layers, num_pages, block_size, kv_heads, head_dim)
    k_pool = jnp.zeros(shape, dtype)
    v_pool = jnp.zeros(shape, dtype)
    new_shape = (layers, rows, frames * tokens_per_frame, kv_heads, head_dim)
    k_new = jax.random.normal(jax.random.key(seed), new_shape, dtype)
    v_new = jax.random.normal(jax.random.key(seed + 1), new_shape, dtype)
    n_ids = rows * frames * pages_per_frame(tokens_per_frame, block_size)
    if n_ids >= num_pages:
        raise ValueError(f"{n_ids} pages per write need a pool of more than {num_pages} pages")
    ids = rng.permutation(np.arange(1, num_pages))[:n_ids].reshape(rows, -1)
    return k_pool, v_pool, k_new, v_new, jnp.asarray(ids, jnp.int32)


def written_bytes(k_pool, page_ids) -> int:
    """K and V bytes one write stores: whole pages, all layers."""
    g = pool_geometry(k_pool)
    return 2 * page_ids.size * g.num_layers * g.block_size * g.kv_heads * g.head_dim * \
        k_pool.dtype.itemsize


def contiguous_copy(k_pool, v_pool, k_slab, v_slab, start=1):
    """The baseline: the same bytes, as one slab of ``N`` pages per pool (:func:`slab_like`), written
    at page ``start`` (1: a compile-time constant) with ``dynamic_update_slice`` (bf16 moved as raw
    bits, as the XLA path does)."""
    def put(pool, slab):
        bits = {2: jnp.uint16, 4: jnp.uint32}[pool.dtype.itemsize]
        out = lax.dynamic_update_slice_in_dim(lax.bitcast_convert_type(pool, bits),
                                              lax.bitcast_convert_type(slab, bits), start, axis=PAGE_AXIS)
        return lax.bitcast_convert_type(out, pool.dtype)
    return put(k_pool, k_slab), put(v_pool, v_slab)


def slab_like(pool, num_pages):
    """Ones in the pool's layout and dtype, ``num_pages`` pages."""
    g = pool_geometry(pool)
    return jnp.ones(pool_shape(g.num_layers, num_pages, g.block_size, g.kv_heads, g.head_dim,
                               check=False), pool.dtype)


def xla_scatter(k_pool, v_pool, k_new, v_new, page_ids, *, tokens_per_frame):
    """XLA scatter over the page axis (the common alternative); no padding support needed here."""
    g = pool_geometry(k_pool)
    layers, num_pages, block_size, kv_heads, head_dim = (g.num_layers, g.num_pages, g.block_size,
                                                         g.kv_heads, g.head_dim)
    if tokens_per_frame % block_size:
        k_new, v_new = (_pad_frames(x, block_size, tokens_per_frame) for x in (k_new, v_new))
    ids = page_ids.reshape(-1)
    ids = jnp.where((ids >= 1) & (ids < num_pages), ids,
                    num_pages + jnp.arange(ids.shape[0], dtype=ids.dtype))
    page_shape = (layers, ids.shape[0], block_size, kv_heads, head_dim)
    return tuple(set_pages(pool, ids, new.reshape(page_shape), unique_indices=True, mode="drop")
                 for pool, new in ((k_pool, k_new), (v_pool, v_new)))


def _pad_frames(x, block_size, tokens_per_frame):
    layers, rows, tokens, kv_heads, head_dim = x.shape
    pad = pages_per_frame(tokens_per_frame, block_size) * block_size - tokens_per_frame
    x = x.reshape(layers, rows * tokens // tokens_per_frame, tokens_per_frame, kv_heads, head_dim)
    return jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0), (0, 0)))


def donated_runner(fn: Callable, pools: tuple, rest: tuple, state: dict | None = None) -> Callable[[], Any]:
    """A no-argument call of ``fn(*pools, *rest)`` jitted with the pools donated, threading the
    returned pools into the next call (each call is in place, as in a real step). The runner
    works on a copy of ``pools``; runners given the same ``state`` dict share one copy (the
    first one's), so that pools of a real size fit on a GPU once per dtype."""
    step = jax.jit(fn, donate_argnums=(0, 1))
    state = {} if state is None else state
    if "pools" not in state:  # the first runner of a shared state copies; the others reuse it
        state["pools"] = jax.tree_util.tree_map(jnp.copy, tuple(pools))

    def call():
        state["pools"] = step(*state["pools"], *rest)
        return state["pools"]

    return call


def interleaved_seconds(runners: dict[str, Callable], reps: int, rounds: int) -> dict[str, float]:
    """Median seconds per runner, measured in ``rounds`` alternating rounds of ``reps`` calls each
    (so a noisy neighbour on a shared machine hits every runner alike); the medians of the rounds'
    medians."""
    samples: dict[str, list[float]] = {name: [] for name in runners}
    for round_index in range(rounds):
        for name, run in runners.items():
            warmup = 5 if round_index == 0 else 1
            samples[name].append(median_seconds(run, reps=reps, warmup=warmup))
    return {name: float(np.median(times)) for name, times in samples.items()}


def memory_figures(fn: Callable, args: tuple) -> dict[str, float]:
    """Aliased and temp bytes of ``fn`` jitted with the pools donated, as fractions of the pools
    (a quantized pool's values and scales)."""
    analysis = jax.jit(fn, donate_argnums=(0, 1)).lower(*args).compile().memory_analysis()
    pool_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(args[:2]))
    return {"aliased_pool_fraction": analysis.alias_size_in_bytes / pool_bytes,
            "temp_bytes_fraction": analysis.temp_size_in_bytes / pool_bytes}


# CPU cases: (name, layers, dtype, tokens_per_frame). Pages are Wan-1.3B-sized per layer (16
# tokens x 12 KV heads x 128 head dim); the 4-layer case shows the XLA loop's per-page overhead.
_CPU_CASES = (
    ("bf16 30L T=16", 30, jnp.bfloat16, 16),
    ("fp32 30L T=16", 30, jnp.float32, 16),
    ("bf16 30L T=24 padded", 30, jnp.bfloat16, 24),
    ("bf16 4L T=16", 4, jnp.bfloat16, 16),
)


def bench_cpu(quick: bool, reps: int, rounds: int) -> dict[str, Any]:
    num_pages, rows = (48, 2) if quick else (192, 4)
    table, figures = [], {}
    for name, layers, dtype, tokens_per_frame in _CPU_CASES:
        geometry = dict(layers=layers, num_pages=num_pages, block_size=16, kv_heads=12,
                        head_dim=128, rows=rows, frames=3)
        k_pool, v_pool, k_new, v_new, page_ids = make_inputs(
            **geometry, tokens_per_frame=tokens_per_frame, dtype=dtype)
        write = functools.partial(write_chunk, tokens_per_frame=tokens_per_frame, backend="xla")
        nbytes = written_bytes(k_pool, page_ids)
        slab = slab_like(k_pool, page_ids.size)
        seconds = interleaved_seconds({
            "write": donated_runner(write, (k_pool, v_pool), (k_new, v_new, page_ids)),
            "copy": donated_runner(contiguous_copy, (k_pool, v_pool), (slab, slab)),
            "runtime-offset copy": donated_runner(contiguous_copy, (k_pool, v_pool),
                                                  (slab, slab, jnp.int32(1))),
        }, reps, rounds)
        t_write, t_copy, t_dynamic = seconds["write"], seconds["copy"], seconds["runtime-offset copy"]
        memory = memory_figures(write, (k_pool, v_pool, k_new, v_new, page_ids))
        table.append([name, page_ids.size, nbytes / 2**20, 2 * k_pool.nbytes / 2**20,
                      t_write * 1e3, t_copy * 1e3, nbytes / t_write / 1e9, nbytes / t_copy / 1e9,
                      t_copy / t_write, t_dynamic / t_write, memory["temp_bytes_fraction"],
                      memory["aliased_pool_fraction"]])
        key = name.replace(" ", "_").replace("=", "")
        figures[key] = {"xla_vs_copy_ratio": t_copy / t_write,
                        "xla_vs_runtime_offset_copy_ratio": t_dynamic / t_write,
                        "xla_gbps": nbytes / t_write / 1e9, "copy_gbps": nbytes / t_copy / 1e9,
                        **memory}
    print_table(["case", "pages", "written MiB", "pools MiB", "xla ms", "copy ms", "xla GB/s",
                 "copy GB/s", "xla/copy", "xla/runtime-offset copy", "temp frac", "alias frac"], table)
    print("xla/runtime-offset copy: the same contiguous copy with its start page a runtime value, as "
          "a paged write's pages are. On several cores XLA:CPU may split one large copy over all of "
          "them while the write's page updates run one after another in a loop; pin the process to "
          "one core (taskset -c 0) to compare like with like.")
    main = figures["bf16_30L_T16"]
    quantized = bench_quantized(num_pages, rows, reps, rounds)
    return {**quantized, "xla_vs_copy_ratio": main["xla_vs_copy_ratio"],
            "temp_bytes_fraction": main["temp_bytes_fraction"],
            "aliased_pool_fraction": main["aliased_pool_fraction"],
            "cases": figures,
            "shape": {"num_pages": num_pages, "rows": rows, "frames": 3, "block_size": 16,
                      "kv_heads": 12, "head_dim": 128}}


def bench_quantized(num_pages: int, rows: int, reps: int, rounds: int) -> dict[str, Any]:
    """A bf16 chunk (30 layers, frames of 16 tokens, then of 24: a padded last page) written into
    bf16, int8 and fp8 pages, timed in alternation; the quantized writes' times over the bf16
    write's, and their memory."""
    out, table = {}, []
    for tokens_per_frame, suffix in ((16, ""), (24, "_padded")):
        frame_rows = rows if tokens_per_frame == 16 else max(1, rows // 2)  # the same pages' bytes
        geometry = dict(layers=30, num_pages=num_pages, block_size=16, kv_heads=12, head_dim=128,
                        rows=frame_rows, frames=3, tokens_per_frame=tokens_per_frame)
        k_pool, v_pool, k_new, v_new, page_ids = make_inputs(**geometry, dtype=jnp.bfloat16)
        write = functools.partial(write_chunk, tokens_per_frame=tokens_per_frame, backend="xla")
        pools = {"bf16": (k_pool, v_pool)}
        pools.update({key: (zero_pool(k_pool.shape, dtype), zero_pool(k_pool.shape, dtype))
                      for key, dtype in QUANTIZED_PAGES.items()})
        seconds = interleaved_seconds({key: donated_runner(write, pair, (k_new, v_new, page_ids))
                                       for key, pair in pools.items()}, reps, rounds)
        for key in QUANTIZED_PAGES:
            ratio = seconds[key] / seconds["bf16"]
            out[f"{key}_vs_bf16_write{suffix}"] = ratio
            if not suffix:
                memory = memory_figures(write, (*pools[key], k_new, v_new, page_ids))
                out[f"{key}_write_temp_bytes_fraction"] = memory["temp_bytes_fraction"]
                out[f"{key}_write_aliased_pool_fraction"] = memory["aliased_pool_fraction"]
            table.append([f"T={tokens_per_frame}", QUANTIZED_PAGES[key], seconds["bf16"] * 1e3,
                          seconds[key] * 1e3, ratio])
    print("bf16 chunk into quantized pages (30 layers; T=24: each frame's second page padded)")
    print_table(["frames", "pages", "bf16 pages ms", "write ms", "vs bf16 pages (goal <= 1.3)"], table)
    return out


# Wan-1.3B at 480x832: 30 layers, 12 KV heads of 128, 3 latent frames of 1,560 tokens per chunk.
WAN_1_3B = dict(layers=30, kv_heads=12, head_dim=128, frames=3, tokens_per_frame=1560)


def gpu_geometry(block_size: int, rows: int) -> dict[str, int]:
    """``make_inputs``' geometry for the GPU run: Wan-1.3B's shape, ``rows`` rows, pools with room
    for 2 chunks (3.6 GiB a pool at 4 rows, either page size)."""
    shape = dict(WAN_1_3B)
    tokens_per_frame = shape.pop("tokens_per_frame")
    num_pages = 2 * rows * shape["frames"] * pages_per_frame(tokens_per_frame, block_size) + 1
    return dict(**shape, num_pages=num_pages, block_size=block_size, rows=rows, tokens_per_frame=tokens_per_frame)


def gpu_cases(tokens_per_frame: int) -> dict[str, Callable]:
    """The GPU run's writes, each ``fn(k_pool, v_pool, k_new, v_new, page_ids) -> (k_pool, v_pool)``."""
    def write(backend):
        return functools.partial(write_chunk, tokens_per_frame=tokens_per_frame, backend=backend)

    return {"pallas_gpu": write("pallas_gpu"), "auto_gpu_scatter": write("auto"),
            "xla_scatter": functools.partial(xla_scatter, tokens_per_frame=tokens_per_frame),
            "xla_path": write("xla")}


def bench_gpu(block_size: int, rows: int, reps: int, rounds: int) -> dict[str, Any]:
    require_gpu("benchmarks.paged_write --gpu", "without --gpu it runs the CPU benchmark")
    geometry = gpu_geometry(block_size, rows)
    tokens_per_frame = geometry["tokens_per_frame"]
    ppf = pages_per_frame(tokens_per_frame, block_size)
    k_pool, v_pool, k_new, v_new, page_ids = make_inputs(**geometry, dtype=jnp.bfloat16)
    nbytes = written_bytes(k_pool, page_ids)
    slab = slab_like(k_pool, page_ids.size)
    rest = (k_new, v_new, page_ids)
    cases = gpu_cases(tokens_per_frame)
    memory = memory_figures(cases["pallas_gpu"], (k_pool, v_pool, *rest))
    bf16_pools = {}  # Every runner writes into one copy of the bf16 pools, and one of each 8-bit pair.
    runners = {name: donated_runner(fn, (k_pool, v_pool), rest, bf16_pools) for name, fn in cases.items()}
    runners["d2d_copy"] = donated_runner(contiguous_copy, (k_pool, v_pool), (slab, slab), bf16_pools)
    for key, kv_dtype in QUANTIZED_PAGES.items():  # The same bf16 chunk into 8-bit pages.
        pools, shared = (zero_pool(k_pool.shape, kv_dtype), zero_pool(k_pool.shape, kv_dtype)), {}
        for name in ("pallas_gpu", "auto_gpu_scatter"):
            runners[f"{name}_{key}"] = donated_runner(cases[name], pools, rest, shared)
    seconds = interleaved_seconds(runners, reps, rounds)
    into_8_bit = {f"{name}_{key}": name for name in ("pallas_gpu", "auto_gpu_scatter") for key in QUANTIZED_PAGES}
    quantized = {f"{run}_vs_bf16": seconds[run] / seconds[bf16] for run, bf16 in into_8_bit.items()}
    print_table(["case", "ms", "GB/s written", "vs d2d copy"],
                [[n, s * 1e3, nbytes / s / 1e9, seconds["d2d_copy"] / s]
                 for n, s in seconds.items() if n not in into_8_bit])
    print("into 8-bit pages, time over the same write into bf16 pages: "
          + ", ".join(f"{name} {ratio:.3f}" for name, ratio in quantized.items()))
    return {
        "pallas_gpu_gbps": nbytes / seconds["pallas_gpu"] / 1e9,
        "pallas_gpu_vs_d2d_copy": seconds["d2d_copy"] / seconds["pallas_gpu"],
        "pallas_gpu_vs_xla_scatter": seconds["xla_scatter"] / seconds["pallas_gpu"],
        "pallas_gpu_vs_xla_path": seconds["xla_path"] / seconds["pallas_gpu"],
        "auto_gpu_scatter_gbps": nbytes / seconds["auto_gpu_scatter"] / 1e9,
        "auto_gpu_scatter_vs_d2d_copy": seconds["d2d_copy"] / seconds["auto_gpu_scatter"],
        **quantized,
        "seconds": seconds,
        "written_bytes": nbytes,
        **memory,
        "shape": {**geometry, "pages_per_frame": ppf, "dtype": "bfloat16"},
    }


def main(argv=None) -> None:
    args = parse_args(__doc__.splitlines()[0], argv, extra=_extra_flags)
    reps = args.reps or (10 if args.quick else 20)
    rounds = 3 if args.quick else 5
    if args.gpu:
        figures = bench_gpu(args.block_size, args.rows, reps, rounds)
    else:
        figures = bench_cpu(args.quick, reps, rounds)
    emit({"benchmark": "paged_write", "mode": "gpu" if args.gpu else "cpu", "reps": reps,
          "rounds": rounds, **figures})


if __name__ == "__main__":
    main()
