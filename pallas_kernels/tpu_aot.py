"""Ahead-of-time compilation for TPU on a machine without one (libtpu's compile-only devices).

``pip install -e ".[tpu]"`` (``jax[tpu]``, which pins the libtpu matching jax) gives the real TPU
compiler. :func:`compile_for_tpu` compiles a function for a v5e or v6e chip: all of Mosaic and
XLA:TPU run (VMEM allocation against the scoped limit, layout assignment, register allocation, the
final VLIW schedule); nothing executes. The helpers read what the compiler decided: pool copies in
the optimized HLO, temporaries and aliased bytes, and (with :func:`bundle_dump_args`) the final
bundles of each Mosaic kernel.

The host backend must stay the default: set ``JAX_PLATFORMS=cpu`` before importing jax. See
``docs/kernels.md`` (Compiling for TPU without one).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from collections.abc import Callable, Sequence

GENERATIONS = ("v5e", "v6e")
"""TPU generations this project compiles for."""


@dataclasses.dataclass(frozen=True)
class ChipSpec:
    """Figures of one TPU generation used by the compiler-derived estimates.

    Attributes:
      topology: the ``get_topology_desc`` name of one chip.
      clock_hz: core clock.
      bf16_flops: dense bf16 MXU peak, FLOP/s.
      hbm_bytes_per_s: HBM bandwidth.
      scoped_vmem_default: Mosaic's default scoped VMEM limit, bytes.
      vmem_bytes: physical VMEM, bytes.
    """

    topology: str
    clock_hz: float
    bf16_flops: float
    hbm_bytes_per_s: float
    scoped_vmem_default: int
    vmem_bytes: int

    @property
    def hbm_bytes_per_cycle(self) -> float:
        """HBM bandwidth per core clock: what
        :func:`pallas_kernels.tpu_cost.program_cycles` prices placeholder copies at."""
        return self.hbm_bytes_per_s / self.clock_hz


CHIPS = {
    "v5e": ChipSpec("v5e:1x1", 1.5e9, 197e12, 819e9, 16 << 20, 128 << 20),
    "v6e": ChipSpec("v6e:1x1", 1.75e9, 918e12, 1640e9, 32 << 20, 128 << 20),
}
GRID_STEP_SECONDS = 0.35e-6
"""Per-grid-step overhead added to bundle-count estimates."""


def libtpu_available() -> bool:
    """Whether libtpu (the TPU compiler) is installed."""
    try:
        import libtpu  # noqa: F401
    except ImportError:
        return False
    return True


def check_generation(generation: str) -> ChipSpec:
    """The :class:`ChipSpec` of ``generation``.

    Raises:
      ValueError: ``generation`` is not one of :data:`GENERATIONS`.
    """
    if generation not in CHIPS:
        raise ValueError(f"generation must be one of {GENERATIONS}, got {generation!r}")
    return CHIPS[generation]


def compile_only_device(generation: str):
    """One compile-only TPU device of ``generation`` (no TPU needed; requires libtpu)."""
    chip = check_generation(generation)
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")  # Any valid type: no probe.
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    # A compile-only device touches no chip, so libtpu's one-process lock need not stop a compile
    # while another process (a benchmark's worker, a test run) has libtpu loaded.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    return topologies.get_topology_desc(chip.topology, "tpu",
                                        chips_per_host_bounds=(1, 1, 1)).devices[0]


_HBM_OOM = re.compile(r"exceeds available HBM \(([\d.]+)G\)")


def hbm_refusal(error: BaseException) -> str | None:
    """What the compiler said when it refused a program that does not fit in HBM
    (``CompileTimeHbmOom``: e.g. "Ran out of memory on HBM, the total memory required for HLO
    temporaries (45.72G) exceeds available HBM (15.75G)"), ``None`` for any other error."""
    text = str(error)
    if "CompileTimeHbmOom" not in text:
        return None
    return text.split("CompileTimeHbmOom:", 1)[1].split(". HLO module", 1)[0].strip()


@functools.lru_cache(maxsize=None)
def available_hbm_bytes(generation: str) -> int:
    """HBM one program may use on a chip of ``generation``, as the compiler counts it (v5e: 15.75
    GiB of 16; v6e: 31.24 of 32): read from the ``CompileTimeHbmOom`` refusal of a program that
    cannot fit (a one-line compile; requires libtpu).

    Raises:
      RuntimeError: the compiler did not refuse it in that form.
    """
    import jax.numpy as jnp

    too_big = (1 << 40) // 4  # 1 TiB of float32
    try:
        compile_for_tpu(lambda x: x + 1, [((too_big,), jnp.float32)], generation)
    except Exception as e:  # XlaRuntimeError's class differs across jax releases.
        found = _HBM_OOM.search(str(e))
        if found:
            return int(float(found.group(1)) * (1 << 30))
        raise RuntimeError(f"the TPU compiler refused an oversized program without an HBM figure: {e}") from e
    raise RuntimeError("the TPU compiler accepted a 1 TiB program: no HBM figure to read")


def compile_for_tpu(fn: Callable, shapes: Sequence[tuple[tuple[int, ...], object]],
                    generation: str, donate_argnums: Sequence[int] = (),
                    static_kwargs: dict | None = None):
    """AOT-compiles ``fn(*arrays, **static_kwargs)`` for one chip of ``generation``.

    Args:
      fn: the function; its positional arguments are arrays.
      shapes: ``(shape, dtype)`` of each positional argument.
      generation: ``"v5e"`` or ``"v6e"``.
      donate_argnums: arguments donated (their buffers may alias outputs).
      static_kwargs: keyword arguments closed over (not traced).

    Returns:
      the ``jax.stages.Compiled`` executable (it cannot run here).
    """
    import functools

    import jax

    device = compile_only_device(generation)
    sharding = jax.sharding.SingleDeviceSharding(device)
    specs = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in shapes]
    bound = functools.partial(fn, **(static_kwargs or {}))
    with jax.default_device(device):  # Lowering rules that ask for the chip see this one.
        return jax.jit(bound, donate_argnums=tuple(donate_argnums)).trace(*specs).lower().compile()


_COPY = re.compile(r"=\s*(\w+)\[([\d,]*)\]\S*\s+copy(?:-start)?\(")


def copies_of(hlo_text: str, shapes: Sequence[tuple[int, ...]]) -> int:
    """How many ``copy``/``copy-start`` instructions of the optimized HLO produce an array of one of
    ``shapes`` (or of the same element count, which catches copies of reshaped pools)."""
    sizes = {math.prod(int(d) for d in s) for s in shapes}
    exact = {tuple(s) for s in shapes}
    count = 0
    for _, dims in _COPY.findall(hlo_text):
        shape = tuple(int(d) for d in dims.split(",") if d)
        if shape in exact or math.prod(shape) in sizes:
            count += 1
    return count


@dataclasses.dataclass(frozen=True)
class CompileReport:
    """What the compiler decided for one executable.

    Attributes:
      temp_bytes, alias_bytes, argument_bytes, output_bytes: from ``memory_analysis()``.
      pool_copies: copies of a pool-sized array in the optimized HLO.
      hlo: the optimized HLO text.
    """

    temp_bytes: int
    alias_bytes: int
    argument_bytes: int
    output_bytes: int
    pool_copies: int
    hlo: str


def report(compiled, pool_shapes: Sequence[tuple[int, ...]]) -> CompileReport:
    """Memory figures and pool copies of a compiled executable."""
    mem = compiled.memory_analysis()
    hlo = compiled.as_text()
    return CompileReport(int(mem.temp_size_in_bytes), int(mem.alias_size_in_bytes),
                         int(mem.argument_size_in_bytes), int(mem.output_size_in_bytes),
                         copies_of(hlo, pool_shapes), hlo)
