"""sm_90 compile check of the GPU kernels on a machine without a GPU.

What runs, per kernel, at the Wan-1.3B shape (12 heads, head_dim 128, bf16, chunk 3 x 1,560 tokens,
sink 3 + window 9 frames of history, rows 1):

* **The Triton kernels** (``backend="pallas_gpu"``: :mod:`pallas_kernels.window_attention.gpu` at
  its default tiling and a few others, and :mod:`pallas_kernels.paged_write.gpu`): lowered by jax for
  ``cuda`` under an abstract H200 (jax 0.11+ asks for the GPU's properties while lowering), the
  Triton IR Pallas emits captured, and compiled by the ``triton`` wheel from PyPI for
  ``GPUTarget("cuda", 90, 32)`` down to cubin; ``cuobjdump -res-usage`` (shipped in the wheel) gives
  registers, shared memory, stack and spills; the TTGIR gives the pipelining (asynchronous copies
  and their waits) and the matmul instructions (``warp_group_dot`` = wgmma), the PTX the 128-bit
  global loads and stores. Each is compiled for bf16 pools and for each quantized pool dtype
  (int8, fp8 e4m3fn, fp8 e5m2: :data:`POOL_DTYPES`), keys suffixed with the dtype. The wheel's Triton is
  not the one XLA bundles, so the figures describe the same IR compiled by a neighbouring Triton
  release.
* **The scatter paged write** (:mod:`pallas_kernels.paged_write.xla_gpu`, the write under
  ``"auto"`` on GPU): lowered for ``cuda``; the StableHLO XLA:GPU receives is summarised (scatters,
  loops, conditionals, aliased pools).
* **The Mosaic GPU kernel** (:mod:`pallas_kernels.window_attention.mosaic_gpu`), on bf16 and
  quantized pools: lowered for ``cuda`` as far as jax goes without a device (see that module's
  docstring for what is and is not checked).

Nothing runs on a GPU; no figure here is a measured time. Without the ``triton`` wheel the sm_90
compile of the Triton kernels is skipped (said once; the JSON's ``triton_wheel`` is ``null`` and
``triton_skipped`` says why) and everything else still runs: the Triton kernels are still lowered
(their launch parameters are reported), and so are the scatter write and the Mosaic GPU kernel.
``--quick`` compiles the Triton attention on one page size, leaves out the tiling sweep and lowers
one Mosaic GPU tiling per pool storage. The last line of output is JSON.

Usage: ``python -m benchmarks.gpu_compile [--quick] [--out DIR]`` (DIR keeps the TTIR/TTGIR/PTX/cubin
files).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from benchmarks import harness
from pallas_kernels.layout import QuantizedPool, pool_shape, scale_shape
from pallas_kernels.quantization import QUANTIZED_DTYPES, SCALE_DTYPE

H200 = dict(device_kind="NVIDIA H200", num_cores=132)
SM90 = 90

# Wan-1.3B: 12 heads of 128, 1,560-token frames, 3-frame chunks, 3 sink + 9 window history frames.
WAN = dict(heads=12, head_dim=128, tokens_per_frame=1560, chunk_frames=3, history_frames=12)


@contextlib.contextmanager
def abstract_gpu(device_kind: str = H200["device_kind"], num_cores: int = H200["num_cores"]):
    """A context in which lowering for ``cuda`` sees an abstract GPU of ``device_kind``."""
    device = AbstractDevice(device_kind=device_kind, num_cores=num_cores, platform="gpu")
    with use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=device)):
        yield


def lower_for_cuda(fn, *specs):
    """``fn`` (a ``jax.jit`` function) traced on ``specs`` and lowered for ``cuda`` (no device)."""
    with abstract_gpu():
        return fn.trace(*specs).lower(lowering_platforms=("cuda",))


@contextlib.contextmanager
def captured_triton_modules():
    """Yields a list that receives the Triton IR (text) of every Pallas Triton kernel lowered inside
    the context, in lowering order."""
    from jax._src.pallas.triton import pallas_call_registration as registration

    modules: list[str] = []
    original = registration.lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = original(*args, **kwargs)
        modules.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    registration.lowering.lower_jaxpr_to_triton_module = capture
    try:
        yield modules
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = original


def triton_launch_params(hlo_text: str) -> list[dict]:
    """``name``, ``num_warps`` and ``num_stages`` of each Triton custom call in a lowered module
    (its ``mhlo.backend_config`` lists them after the serialized IR)."""
    starts = [m.start() for m in re.finditer(r"__gpu\$xla\.gpu\.triton\(", hlo_text)]
    calls = []
    for start, end in zip(starts, starts[1:] + [len(hlo_text)]):
        call = hlo_text[start:end]
        calls.append(dict(
            name=re.search(r'name = "([^"]+)", num_stages', call).group(1),
            num_warps=int(re.search(r"num_warps = (\d+) : i32", call).group(1)),
            num_stages=int(re.search(r"num_stages = (\d+) : i32", call).group(1))))
    return calls


def triton_wheel_bin() -> str | None:
    """The directory of the ``triton`` wheel's NVIDIA tools (ptxas, cuobjdump), or None."""
    try:
        import triton
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    return path if os.path.exists(os.path.join(path, "cuobjdump")) else None


def res_usage(cubin: bytes, bin_dir: str) -> dict:
    """Registers, shared memory (bytes), stack and local (spill) bytes of the kernel in ``cubin``,
    from ``cuobjdump -res-usage``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-res-usage", f.name],
                              capture_output=True, text=True, check=True).stdout
    fields = dict(re.findall(r"(REG|STACK|SHARED|LOCAL|CONSTANT\[0\]|TEXTURE|SURFACE|SAMPLER):(\d+)",
                             text))
    return dict(registers=int(fields["REG"]), static_shared_bytes=int(fields["SHARED"]),
                stack_bytes=int(fields["STACK"]), local_bytes=int(fields["LOCAL"]))


def compile_triton(ttir: str, num_warps: int, num_stages: int, out_dir: str | None,
                   name: str) -> dict:
    """Compiles Triton IR for sm_90 with the ``triton`` wheel; returns resource use and pipeline
    facts. ``out_dir`` (if given) receives ``name.{ttir,ttgir,ptx,cubin}``."""
    import triton
    from triton.backends.compiler import GPUTarget

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{name}.ttir")
        with open(path, "w") as f:
            f.write(ttir)
        kernel = triton.compile(path, target=GPUTarget("cuda", SM90, 32),
                                options=dict(num_warps=num_warps, num_stages=num_stages))
    asm = kernel.asm
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        for ext in ("ttir", "ttgir", "ptx"):
            with open(os.path.join(out_dir, f"{name}.{ext}"), "w") as f:
                f.write(asm[ext] if ext != "ttir" else ttir)
        with open(os.path.join(out_dir, f"{name}.cubin"), "wb") as f:
            f.write(asm["cubin"])
    ttgir, ptx = asm["ttgir"], asm["ptx"]
    usage = res_usage(asm["cubin"], triton_wheel_bin())
    return dict(
        usage,
        shared_bytes=int(kernel.metadata.shared),
        spills=usage["local_bytes"] > 0,
        num_warps=num_warps,
        num_stages=num_stages,
        wgmma=ttgir.count("warp_group_dot "),
        mma_sync=ptx.count("mma.sync"),
        async_copies=ttgir.count("async_copy_global_to_local"),
        async_waits=re.findall(r"async_wait .*?\{num = (\d+) : i32\}", ttgir),
        exp2_approx=ptx.count("ex2.approx"),
        vector_loads=ptx.count("ld.global.v4."),
        vector_stores=ptx.count("st.global.v4."),
        ptx_lines=ptx.count("\n"),
        triton_wheel=triton.__version__,
    )


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def _pool_spec(shape, dtype, kv_dtype):
    """The spec of a pool of ``shape``: ``dtype`` values, or for a quantized ``kv_dtype`` a
    :class:`~pallas_kernels.layout.QuantizedPool` of ``kv_dtype`` values and float32 scales."""
    if kv_dtype is None:
        return _sds(shape, dtype)
    return QuantizedPool(_sds(shape, kv_dtype), _sds(scale_shape(shape), SCALE_DTYPE))


def wan_attention_specs(rows: int, block_size: int, dtype=jnp.bfloat16, layers: int = 1,
                        kv_dtype=None):
    """Argument specs of one window-attention call at the Wan-1.3B shape: ``(q, k_cur, v_cur,
    k_pool, v_pool, pages, lengths)`` with the pool holding ``rows`` rows' history pages, stored in
    ``dtype`` or, with a quantized ``kv_dtype``, as :class:`~pallas_kernels.layout.QuantizedPool` s."""
    heads, head_dim, tpf = WAN["heads"], WAN["head_dim"], WAN["tokens_per_frame"]
    ppf = -(-tpf // block_size)
    max_pages = WAN["history_frames"] * ppf
    q_len = WAN["chunk_frames"] * tpf
    pool = pool_shape(layers, 1 + rows * max_pages, block_size, heads, head_dim)
    kv = (rows, q_len, heads, head_dim)
    return (_sds((rows, q_len, heads, head_dim), dtype), _sds(kv, dtype), _sds(kv, dtype),
            _pool_spec(pool, dtype, kv_dtype), _pool_spec(pool, dtype, kv_dtype),
            _sds((rows, max_pages), jnp.int32), _sds((rows,), jnp.int32))


def attention_at_tiling(module, validate_as: str, **tiling):
    """A jitted ``fn(q, k_cur, v_cur, k_pool, v_pool, pages, lengths)`` that validates like
    ``window_attention(..., backend=validate_as)`` (layer 0, 1,560-token frames) and then calls
    ``module.window_attention`` with ``tiling`` (the backend module's own tiling arguments)."""
    from pallas_kernels.window_attention import static_validate_inputs

    def fn(q, k_cur, v_cur, k_pool, v_pool, pages, lengths):
        geom = static_validate_inputs(q, k_cur, v_cur, k_pool, v_pool, pages, lengths,
                                      tokens_per_frame=WAN["tokens_per_frame"], backend=validate_as)
        return module.window_attention(q, k_cur, v_cur, None, None, k_pool, v_pool, pages, lengths,
                                       jnp.int32(0), geom=geom, scale=geom.head_dim ** -0.5,
                                       **tiling)

    return jax.jit(fn)


TRITON_MISSING = "the triton wheel is not installed (pip install triton)"


POOL_DTYPES = (None, *QUANTIZED_DTYPES)
"""The pool storage the Triton kernels are compiled for: the compute dtype (``None``, bf16) and
each quantized dtype (:data:`pallas_kernels.quantization.QUANTIZED_DTYPES`)."""


def _pool_suffix(kv_dtype) -> str:
    return "" if kv_dtype is None else f"_{kv_dtype}"


def triton_attention_reports(out_dir: str | None, quick: bool = False) -> dict:
    """Compile reports of the Triton window attention at its default tiling, at the Wan shape on
    1,560-token (one page per frame) and, unless ``quick``, 128-token pages, for bf16 pools and
    each quantized pool dtype (:data:`POOL_DTYPES`)."""
    from pallas_kernels.window_attention import window_attention

    reports = {}
    for block_size in (1560,) if quick else (1560, 128):
        for kv_dtype in POOL_DTYPES:
            fn = jax.jit(lambda *a: window_attention(*a, tokens_per_frame=WAN["tokens_per_frame"],
                                                     backend="pallas_gpu"))
            key = f"triton_attention_pages{block_size}{_pool_suffix(kv_dtype)}"
            specs = wan_attention_specs(1, block_size, kv_dtype=kv_dtype)
            reports[key] = compile_lowered(fn, specs, out_dir, key)
    return reports


def wan_write_specs(rows: int, num_pages: int, block_size: int = 128, layers: int = 30,
                    dtype=jnp.bfloat16, kv_dtype=None):
    """Argument specs of one paged write at the Wan-1.3B shape: ``(k_pool, v_pool, k_new, v_new,
    page_ids)``, ``rows`` rows' 3-frame chunks in ``dtype`` into a pool of ``num_pages`` pages of
    ``block_size`` (stored in ``dtype`` or, with a quantized ``kv_dtype``, as
    :class:`~pallas_kernels.layout.QuantizedPool` s)."""
    heads, head_dim, tpf = WAN["heads"], WAN["head_dim"], WAN["tokens_per_frame"]
    frames, ppf = WAN["chunk_frames"], -(-tpf // block_size)
    pool = pool_shape(layers, num_pages, block_size, heads, head_dim)
    chunk = (layers, rows, frames * tpf, heads, head_dim)
    return (_pool_spec(pool, dtype, kv_dtype), _pool_spec(pool, dtype, kv_dtype), _sds(chunk, dtype),
            _sds(chunk, dtype), _sds((rows, frames * ppf), jnp.int32))


def triton_write_report(out_dir: str | None, quick: bool = False) -> dict:
    """Compile reports of the Triton paged write at Wan's shape (30 layers, 128-token pages, one
    row's 3-frame chunk), for bf16 pools and each quantized pool dtype (:data:`POOL_DTYPES`)."""
    from pallas_kernels.paged_write import write_chunk

    fn = jax.jit(lambda *a: write_chunk(*a, tokens_per_frame=WAN["tokens_per_frame"], backend="pallas_gpu"),
                 donate_argnums=(0, 1))
    reports = {}
    for kv_dtype in POOL_DTYPES:
        key = f"triton_paged_write{_pool_suffix(kv_dtype)}"
        specs = wan_write_specs(rows=1, num_pages=64, kv_dtype=kv_dtype)
        reports[key] = compile_lowered(fn, specs, out_dir, key)
    return reports


def compile_lowered(fn, specs, out_dir, name) -> dict:
    """Lowers ``fn`` (one Pallas Triton kernel) for ``cuda`` on ``specs`` and compiles its Triton IR
    for sm_90 (:func:`compile_triton`); without the ``triton`` wheel, the launch parameters and a
    ``skipped`` reason."""
    with captured_triton_modules() as modules:
        text = lower_for_cuda(fn, *specs).as_text()
    [launch] = triton_launch_params(text)
    [ttir] = modules
    if triton_wheel_bin() is None:
        return dict(launch, skipped=TRITON_MISSING)
    return dict(compile_triton(ttir, launch["num_warps"], launch["num_stages"], out_dir, name),
                kernel=launch["name"])


def scatter_write_report() -> dict:
    """What the lowered scatter write hands XLA:GPU, at Wan's shape (30 layers, 128-token pages, 4
    rows' 3-frame chunks, donated pools), for bf16 pools and each quantized pool dtype (values and
    scales scattered: twice the scatters and aliased outputs)."""
    from pallas_kernels.paged_write import write_chunk

    fn = jax.jit(lambda *a: write_chunk(*a, tokens_per_frame=WAN["tokens_per_frame"], backend="cudnn_gather"),
                 donate_argnums=(0, 1))
    reports = {}
    for kv_dtype in POOL_DTYPES:
        text = lower_for_cuda(fn, *wan_write_specs(rows=4, num_pages=256, kv_dtype=kv_dtype)).as_text()
        reports[f"scatter_paged_write{_pool_suffix(kv_dtype)}"] = dict(
            scatters=text.count("\"stablehlo.scatter\"("),
            unique_indices=text.count("unique_indices = true"),
            while_loops=text.count("stablehlo.while"),
            conditionals=text.count("stablehlo.case"),
            aliased_outputs=text.count("tf.aliasing_output"),
            pads=text.count("stablehlo.pad"),
        )
    return reports


MOSAIC_TILINGS = ((128, 2), (128, 3), (64, 4))
"""``(block_kv, stages)`` of the Mosaic GPU kernel lowered by :func:`mosaic_report`."""


def mosaic_report(out_dir: str | None, quick: bool = False) -> dict:
    """Lowering report of the Mosaic GPU kernel at the Wan shape on 1,664-token pages (13 x 128),
    rows 1, for each tiling and pool storage (:data:`POOL_DTYPES`; a quantized pool's 8-bit slots
    take more shared memory, and a tiling they do not fit is reported, not lowered): whether jax
    lowered it (Pallas' Mosaic GPU lowering, layout inference, MLIR verification of the module) and
    the shared memory the tiling takes. Past that point the Mosaic GPU pipeline to PTX runs inside
    XLA's CUDA plugin, absent here (jaxlib for the CPU registers none of the GPU-to-NVVM passes), so
    no PTX, registers or spills are reported. ``quick``: the first tiling only."""
    from pallas_kernels.window_attention import mosaic_gpu

    reports = {}
    for kv_dtype in POOL_DTYPES:
        stored = 0 if kv_dtype is None else 1
        for block_kv, stages in MOSAIC_TILINGS[:1] if quick else MOSAIC_TILINGS:
            key = f"mosaic_attention_pages1664_kv{block_kv}_stages{stages}{_pool_suffix(kv_dtype)}"
            smem = mosaic_gpu.smem_bytes(WAN["head_dim"], 2, mosaic_gpu.BLOCK_Q, block_kv, stages,
                                         stored)
            if smem > mosaic_gpu.SMEM_BYTES:
                reports[key] = dict(lowered_and_verified=None, smem_bytes=smem,
                                    ptx=f"not lowered: over {mosaic_gpu.SMEM_BYTES} bytes of shared memory")
                continue
            fn = attention_at_tiling(mosaic_gpu, "pallas_mgpu", block_kv=block_kv, stages=stages)
            text = lower_for_cuda(fn, *wan_attention_specs(1, 1664, kv_dtype=kv_dtype)).as_text()
            if out_dir:
                os.makedirs(out_dir, exist_ok=True)
                with open(os.path.join(out_dir, f"{key}.stablehlo.mlir"), "w") as f:
                    f.write(text)
            reports[key] = dict(lowered_and_verified="mosaic_gpu_v2" in text, smem_bytes=smem,
                                ptx="not produced (needs XLA's CUDA plugin)")
    return reports


def tiling_sweep_reports(out_dir: str | None, quick: bool = False) -> dict:
    """Compile reports of the Triton window attention at a few tilings (1,560-token pages), with
    the CTAs per SM they allow on paper (65,536 registers and 228 KiB shared memory per SM); none
    with ``quick``."""
    from pallas_kernels.window_attention import gpu

    reports = {}
    if quick:
        return reports
    for block_q, block_k, num_warps, num_stages in ((128, 64, 8, 3), (64, 64, 4, 3),
                                                     (128, 128, 8, 2), (64, 32, 4, 4)):
        key = f"triton_attention_q{block_q}_k{block_k}_w{num_warps}_s{num_stages}"
        fn = attention_at_tiling(gpu, "pallas_gpu", block_q=block_q, block_k=block_k,
                                 num_warps=num_warps, num_stages=num_stages, backend="pallas_gpu")
        entry = compile_lowered(fn, wan_attention_specs(1, 1560), out_dir, key)
        if "registers" in entry:
            threads = 32 * num_warps
            entry["ctas_per_sm"] = min(65536 // (max(entry["registers"], 1) * threads),
                                       (228 * 1024) // max(entry["shared_bytes"] + 1024, 1))
        reports[key] = entry
    return reports


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="one page size for the Triton attention, no tiling sweep, one Mosaic GPU tiling")
    parser.add_argument("--out", default=None, help="keep TTIR/TTGIR/PTX/cubin files here")
    args = parser.parse_args(argv)
    wheel = triton_wheel_bin() is not None
    if not wheel:
        print(f"{TRITON_MISSING}: the Triton kernels are lowered (launch parameters below) but not compiled "
              "for sm_90; the rest runs", file=sys.stderr)
    report: dict = dict(jax=jax.__version__, target=f"sm_{SM90} (abstract {H200['device_kind']})",
                        measured_on_gpu=False, quick=args.quick,
                        triton_wheel=_triton_version() if wheel else None,
                        triton_skipped=None if wheel else TRITON_MISSING)
    for part in (triton_attention_reports, tiling_sweep_reports, triton_write_report, mosaic_report):
        report.update(part(args.out, quick=args.quick))
    report.update(scatter_write_report())
    for name, entry in report.items():
        if isinstance(entry, dict):
            entry.pop("skipped", None)  # said once above and in ``triton_skipped``
            print(f"{name}: " + ", ".join(f"{k}={v}" for k, v in entry.items()))
    print(harness.json_line(report))
    return 0


def _triton_version() -> str:
    import triton

    return triton.__version__


if __name__ == "__main__":
    sys.exit(main())
