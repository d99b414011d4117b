"""Window attention as a Pallas TPU (Mosaic) kernel (``"pallas_tpu"``, ``_interpret``,
``_simulate``) on the head-major pool layout (:mod:`pallas_kernels.layout`).

Semantics and shapes are those of :func:`pallas_kernels.window_attention.window_attention`, whose
dispatcher calls ``_attention`` here (``block_k`` is ``keys_per_block``); :func:`window_attention`
here takes every tiling knob and the TPU generation (compile tests, benchmarks). The grid is
``(rows, kv_heads, query blocks)`` with GQA folded into the matmul's M; history pages are DMA'd by
hand into double-buffered VMEM and an online softmax with lane-dense statistics runs over chunks of
keys, unmasked where every slot is valid. Quantized pools (:class:`~pallas_kernels.layout.QuantizedPool`)
are DMA'd at their stored 8-bit width and each compute chunk is dequantized in VMEM as it is loaded,
with its page's scale from SMEM (:func:`dequantize_tile`); the matmuls run in the compute dtype.
Block sizes come from :data:`TUNED_BLOCKS`, the VMEM limit from :func:`vmem_estimate_bytes`. The
kernel's design: ``docs/kernels.md`` (Paged window attention).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.backend import resolve_backend
from pallas_kernels.checks import require_int
from pallas_kernels.common import MASK_VALUE, target_device, token_major_blocks
from pallas_kernels.layout import QuantizedPool, check_tpu_block_size, page_index
from pallas_kernels.quantization import dequantize, is_quantized
from pallas_kernels.rope import prepare_qk, rotate_rows
from pallas_kernels.window_attention.geometry import WindowGeometry, visible_page_count
from pallas_kernels.window_attention.validation import check_arrays, check_scale

LANES = 128
LOG2_E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Block sizes of one call.

    Attributes:
      block_q: queries per query block and query head (M is ``group * block_q``).
      block_q_compute: rows of M per softmax update (divides ``group * block_q``).
      block_kv_compute: keys per compute chunk (a multiple of 128).
      keys_per_block: target history keys per DMA block (``pages_per_block * block_size``).
      mxu_row_sums: whether the probabilities' row sums come from the MXU (V is widened by 128
        lanes of ones, so ``P @ [V | 1]`` also gives every lane the row sum) instead of 128-lane
        partial sums on the VPU; taken only where ``head_dim`` is a multiple of 128. It pays where
        the MXU is wider than ``head_dim`` (v6e's 256) and the VPU binds the softmax.
      fixed_row_max: whether a grid step takes every exponential against each row's maximum over
        its first key chunk (the chunk's own first keys), held fixed: no running maximum and no
        rescale. A step whose sums or outputs are not finite (a later key's logit beyond that
        maximum by about 128 in base 2) is computed again with the online softmax. Taken only where
        the tail has a whole compute chunk.
    """

    block_q: int
    block_q_compute: int
    block_kv_compute: int
    keys_per_block: int
    mxu_row_sums: bool = False
    fixed_row_max: bool = False


TUNED_BLOCKS = {
    # Chosen by benchmarks/tpu_compile.py's bundle estimate at wan-1.3b (9 history frames + the
    # 3-frame chunk), ms per row and layer: one softmax sub-block per query block (224-row ones:
    # v6e 2.22); 3-page DMA blocks (keys_per_block 4680, was 2048), so the 24-slot remainders of
    # 1,560-slot pages cut into 512- or 1536-key pieces are pooled into one chunk per block (v5e
    # 3.07 -> 2.89); on v6e the row sums on the MXU (1.66 -> 1.58), then pooled remainders (1.44)
    # and 2352-row query blocks (1.42; block_kv_compute 512 or 768: 1.56, 1.66); then the
    # remainders and the tail's pooled into one chunk per grid step (v5e 2.91 -> 2.89, v6e 1.42
    # -> 1.38; a single 4688-row query block with 768-key chunks: v6e 1.52); then fixed row
    # maxima (v6e 1.32 -> 1.25; v5e 2.82 -> 2.76, its matmuls at peak).
    "v5e": Blocks(block_q=1568, block_q_compute=1568, block_kv_compute=512, keys_per_block=4680,
                  fixed_row_max=True),
    "v6e": Blocks(block_q=2352, block_q_compute=2352, block_kv_compute=1536, keys_per_block=4680,
                  mxu_row_sums=True, fixed_row_max=True),
}
"""Default block sizes per generation (chosen from compiler bundle counts, ``benchmarks/tpu_compile.py``)."""
MAX_UNROLLED_TAIL_CHUNKS = 16
"""The tail's whole compute chunks are unrolled into one region up to this many (the scheduler
overlaps each chunk's last products with the next chunk's first); a longer tail (a recache's)
loops."""

VMEM_BUDGET = {"v5e": 100 << 20, "v6e": 100 << 20}
"""Most scoped VMEM a call may ask for, bytes (of 128 MiB physical)."""


@dataclasses.dataclass(frozen=True)
class Geometry(WindowGeometry):
    """:class:`~pallas_kernels.window_attention.geometry.WindowGeometry` plus the names of the
    compute dtype and of the pools' page dtype (hashable): the static sizes of one TPU call.

    ``kv_dtype`` is ``dtype`` for plain pools, a quantized dtype
    (:data:`pallas_kernels.quantization.QUANTIZED_DTYPES`) for :class:`QuantizedPool` s.
    ``rotates``/``normalizes``: the kernel applies the call's RoPE / QK norms to the chunk
    (:meth:`of`, :func:`plan_rotating_call`)."""

    dtype: str
    kv_dtype: str
    rotates: bool = False
    normalizes: bool = False

    @classmethod
    def of(cls, geom: WindowGeometry, dtype, kv_dtype=None, rope: bool = False,
           qk_norm: bool = False) -> "Geometry":
        """``geom`` computed in ``dtype`` over pages of ``kv_dtype`` (default ``dtype``); with
        ``rope`` the call has rotary tables, which the kernel applies where it reads the chunk
        token-major (:attr:`rotates`); with ``qk_norm`` RMS norms too, which a rotating kernel
        applies where there are no extras (:attr:`normalizes`)."""
        name = jnp.dtype(dtype).name
        rotates = bool(rope) and token_major_blocks(geom.group, geom.head_dim)
        return cls(**dataclasses.asdict(geom), dtype=name,
                   kv_dtype=name if kv_dtype is None else jnp.dtype(kv_dtype).name, rotates=rotates,
                   normalizes=rotates and bool(qk_norm) and geom.num_extra == 0)

    @property
    def prologue_tables(self) -> int:
        """Float32 ``[tokens, head_dim]`` tables the kernel reads per row: cos and sin where it
        rotates, one pair for q and one for K (each scaled by its tokens' inverse RMS) where it
        also normalizes."""
        return 4 if self.normalizes else 2 if self.rotates else 0

    @property
    def itemsize(self) -> int:
        return jnp.dtype(self.dtype).itemsize

    @property
    def sublanes(self) -> int:
        """Rows of one VMEM tile of the compute dtype (8 for 32-bit, 16 for 16-bit types)."""
        return 8 * 4 // self.itemsize

    @property
    def quantized(self) -> bool:
        """Whether the pages are quantized (8-bit values and a float32 scale per page)."""
        return is_quantized(self.kv_dtype)

    @property
    def kv_itemsize(self) -> int:
        """Bytes of one stored page value (what the page DMAs move)."""
        return jnp.dtype(self.kv_dtype).itemsize

    @property
    def token_major(self) -> bool:
        """Whether the kernel reads the queries and the tail's K and V and writes its output in
        the caller's token-major arrays, one head's lanes per block
        (:func:`pallas_kernels.common.token_major_blocks`), except q and K that the wrapper
        rotates with XLA. Otherwise the wrapper transposes them head-major (``docs/kernels.md``,
        the Mosaic TPU kernel, on which layouts cost copies)."""
        return token_major_blocks(self.group, self.head_dim)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Derived, static tiling of one call."""

    block_q: int
    num_q_blocks: int
    block_q_compute: int
    block_kv_compute: int
    pages_per_block: int
    pages_per_chunk: int  # > 0: chunks of whole pages; 0: pieces of one page.
    tail_pad: int
    mxu_row_sums: bool = False
    fixed_row_max: bool = False

    @property
    def q_pad(self) -> int:
        return self.block_q * self.num_q_blocks

    @property
    def table_rows(self) -> int:
        """Rows of the rotary tables' one block per row (:attr:`Geometry.rotates`): the tail's
        and every query block's."""
        return max(self.tail_pad, self.q_pad)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def make_plan(geom: Geometry, blocks: Blocks) -> Plan:
    """The static tiling for ``geom`` from the (validated) target ``blocks``."""
    sub = geom.sublanes
    num_q_blocks = -(-geom.q_len // blocks.block_q)
    block_q = _round_up(-(-geom.q_len // num_q_blocks), sub)
    m = geom.group * block_q
    bqc = max(sub, min(blocks.block_q_compute, m) // sub * sub)
    while m % bqc:
        bqc -= sub
    bkc, size = blocks.block_kv_compute, geom.block_size
    if size % sub == 0 and size <= bkc:
        per_chunk = max(1, min(bkc // size, geom.max_pages))
        per_block = max(per_chunk, blocks.keys_per_block // size // per_chunk * per_chunk)
        per_block = min(per_block, _round_up(geom.max_pages, per_chunk))
    else:
        per_chunk = 0
        per_block = max(1, min(blocks.keys_per_block // size, geom.max_pages))
    full, rest = divmod(geom.tail_len, bkc)
    tail_pad = full * bkc + _round_up(rest, sub)
    mxu_row_sums = blocks.mxu_row_sums and geom.head_dim % LANES == 0
    return Plan(block_q, num_q_blocks, bqc, bkc, per_block, per_chunk, tail_pad, mxu_row_sums,
                blocks.fixed_row_max and full > 0)


def vmem_estimate_bytes(geom: Geometry, plan: Plan) -> int:
    """Scoped VMEM the kernel needs: double-buffered q, output and tail blocks, the double-buffered
    K and V page blocks (8-bit for quantized pages, plus one compute chunk dequantized), the scaled
    queries, the ``m``/``l``/accumulator scratch, the widened tail and pooled remainders where
    used, one compute chunk's float32 logits and probabilities (with their cast copy), and where
    the kernel rotates (:attr:`Geometry.rotates`) its tables and rotated tail K, in bytes."""
    isz, d = geom.itemsize, geom.head_dim
    m = geom.group * plan.block_q
    slots = _round_up(geom.block_size, geom.sublanes)
    v_lanes = plan_v_lanes(geom, plan)
    blocks = 2 * 2 * m * d * isz + 2 * 2 * plan.tail_pad * d * isz
    if geom.quantized:  # 8-bit pages, and one chunk dequantized (float32, then K and V cast).
        stored = _round_up(geom.block_size, 32 // geom.kv_itemsize)
        pages = 2 * plan.pages_per_block * stored * 2 * d * geom.kv_itemsize \
            + plan.block_kv_compute * (d * 4 + (d + v_lanes) * isz)
    else:
        pages = 2 * plan.pages_per_block * slots * (d + v_lanes) * isz
    wide_tail = plan.tail_pad * v_lanes * isz if plan.mxu_row_sums else 0
    pooled = plan_pooled(geom, plan)[1] * (d + v_lanes) * isz
    scratch = 2 * m * LANES * 4 + m * _round_up(d, LANES) * (4 + isz)
    chunk = plan.block_q_compute * plan.block_kv_compute * (4 + 4 + isz) \
        + plan.block_kv_compute * (d + v_lanes) * 4 + plan.block_q_compute * v_lanes * 4
    # Rotating: the double-buffered float32 tables, the rotated tail K, and a query block's (or a
    # tail chunk's) float32 rotation temporaries.
    rotation = (2 * geom.prologue_tables * plan.table_rows * d * 4 + plan.tail_pad * d * isz
                + 3 * max(m, plan.block_kv_compute) * d * 4) if geom.rotates else 0
    return blocks + pages + wide_tail + pooled + scratch + chunk + rotation


def plan_remainder(geom: Geometry, plan: Plan) -> tuple[int, int]:
    """``(rest, rest_rows)``: where pages are cut into pieces of ``block_kv_compute`` keys, each
    page's last ``rest = block_size % block_kv_compute`` slots are copied into ``rest_rows``
    (``rest`` rounded up to whole tiles) rows of the pooled chunk (:func:`plan_pooled`) instead of
    being one small chunk per page; ``(rest, 0)`` where nothing is pooled."""
    rest = 0 if plan.pages_per_chunk else geom.block_size % plan.block_kv_compute
    return rest, _round_up(rest, geom.sublanes) if rest else 0


def plan_pooled(geom: Geometry, plan: Plan) -> tuple[int, int]:
    """``(tail_rows, rows)`` of the pooled chunk, where pages have remainders
    (:func:`plan_remainder`): the tail's last, partial compute chunk (``tail_rows``, 0 where the
    tail is whole chunks) and then every page-list entry's remainder (``rest_rows`` each, for
    whole DMA blocks) are copied into one buffer of ``rows`` rows, which a grid step computes once,
    last, in pieces of at most ``block_kv_compute`` keys (:func:`pooled_pieces`); ``(0, 0)`` where
    nothing is pooled."""
    rest_rows = plan_remainder(geom, plan)[1]
    if not rest_rows:
        return 0, 0
    tail_rows = plan.tail_pad - geom.tail_len // plan.block_kv_compute * plan.block_kv_compute
    return tail_rows, tail_rows + _round_up(geom.max_pages, plan.pages_per_block) * rest_rows


def pooled_pieces(geom: Geometry, plan: Plan) -> list[list[tuple[int, int]]]:
    """The pooled chunk (:func:`plan_pooled`) cut into compute pieces: each a list of segments
    ``(page-list entry, rows)`` (entry -1: the tail's segment), whole segments, at most
    ``block_kv_compute`` rows a piece."""
    tail_rows, rows = plan_pooled(geom, plan)
    if not rows:
        return []
    rest_rows = plan_remainder(geom, plan)[1]
    segments = [(-1, tail_rows)] * bool(tail_rows)
    segments += [(entry, rest_rows) for entry in range((rows - tail_rows) // rest_rows)]
    pieces = []
    for segment in segments:
        if not pieces or sum(n for _, n in pieces[-1]) + segment[1] > plan.block_kv_compute:
            pieces.append([])
        pieces[-1].append(segment)
    return pieces


def plan_v_lanes(geom: Geometry, plan: Plan) -> int:
    """Lanes of a V row in VMEM: ``head_dim``, plus 128 lanes of ones under ``mxu_row_sums``."""
    return geom.head_dim + (LANES if plan.mxu_row_sums else 0)


def temp_bound_bytes(geom: Geometry, plan: Plan) -> int:
    """Upper bound of the compiled call's temporaries (outside the pools), bytes: the head-major
    queries and output, the head-major tail (copies where XLA lays them out token-major), the
    tables (with quantized pages the K and V scales of every row's visible pages), and 1 MiB for
    XLA's small buffers."""
    isz = geom.itemsize
    q = 2 * geom.rows * plan.q_pad * geom.num_q_heads * geom.head_dim * isz
    tail = 2 * geom.rows * geom.kv_heads * plan.tail_pad * geom.head_dim * isz
    scales = 2 * geom.rows * geom.kv_heads * geom.max_pages * 4 if geom.quantized else 0
    return q + tail + 4 * geom.rows * (geom.max_pages + 2) + scales + (1 << 20)


# ------------------------------------------------------------------------------------------------
# Public API
# ------------------------------------------------------------------------------------------------


def window_attention(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, *, layer=0, extra_k=None,
                     extra_v=None, scale=None, tokens_per_frame=None, rope=None, qk_norm=None,
                     generation=None,
                     block_q=None, block_q_compute=None, block_kv_compute=None,
                     keys_per_block=None, mxu_row_sums=None, fixed_row_max=None, interpret: Any = False):
    """The TPU kernel with every tiling knob (the dispatcher exposes ``block_q``/``block_k``).

    Args:
      q, k_cur, v_cur, k_pool, v_pool, pages, lengths, layer, extra_k, extra_v, scale,
        tokens_per_frame, rope, qk_norm: as :func:`pallas_kernels.window_attention.window_attention` (pools in
        :func:`pallas_kernels.layout.pool_shape`, plain or :class:`QuantizedPool` s).
      generation: ``"v5e"`` or ``"v6e"``: which :data:`TUNED_BLOCKS` row and VMEM budget; default
        the default device's generation, ``"v5e"`` off TPU.
      block_q, block_q_compute, block_kv_compute, keys_per_block, mxu_row_sums, fixed_row_max:
        override the tuned :class:`Blocks` fields.
      interpret: ``pl.pallas_call``'s ``interpret`` (False compiles for TPU; True or a
        ``pltpu.InterpretParams`` runs on the CPU).

    Returns:
      as :func:`pallas_kernels.window_attention.window_attention`: ``q``'s shape and dtype.

    Raises:
      ValueError: what :func:`~pallas_kernels.window_attention.validation.check_arrays` rejects;
        a bad scale, generation or tile; a block size that is not a multiple of 8 (compiled only);
        a tiling whose VMEM estimate exceeds the generation's budget; an int ``layer`` out of
        range. Page ids, lengths and array layers are checked by the public ``window_attention``.
    """
    geom = check_arrays(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, layer=layer,
                        extra_k=extra_k, extra_v=extra_v, tokens_per_frame=tokens_per_frame,
                        rope=rope, qk_norm=qk_norm)
    if interpret is False:
        check_tpu_block_size(geom.block_size)
    scale = check_scale(geom.head_dim ** -0.5 if scale is None else scale)
    geom = Geometry.of(geom, q.dtype, k_pool.dtype, rope=rope is not None, qk_norm=qk_norm is not None)
    geom, plan, vmem_limit = plan_rotating_call(geom, generation, block_q=block_q,
                                                block_q_compute=block_q_compute,
                                                block_kv_compute=block_kv_compute,
                                                keys_per_block=keys_per_block,
                                                mxu_row_sums=mxu_row_sums, fixed_row_max=fixed_row_max)
    return _window_attention(q, k_cur, v_cur, extra_k, extra_v, k_pool, v_pool, pages, lengths,
                             jnp.asarray(layer, jnp.int32), _tuple(rope), _tuple(qk_norm), geom=geom,
                             plan=plan, scale=scale, vmem_limit=vmem_limit, interpret=interpret)


def _attention(q, k_cur, v_cur, extra_k, extra_v, k_pool, v_pool, pages, lengths, layer, *,
               geom: WindowGeometry, scale: float, block_q: int | None, block_k: int | None,
               backend: str, rope=None, qk_norm=None):
    """The dispatcher's entry, private to the package (inputs already validated): ``block_k`` is
    ``keys_per_block``, the history keys of one DMA block; ``backend`` a ``pallas_tpu*`` name."""
    geom = Geometry.of(geom, q.dtype, k_pool.dtype, rope=rope is not None, qk_norm=qk_norm is not None)
    geom, plan, vmem_limit = plan_rotating_call(geom, None, block_q=block_q, keys_per_block=block_k)
    return _window_attention(q, k_cur, v_cur, extra_k, extra_v, k_pool, v_pool, pages, lengths,
                             layer, _tuple(rope), _tuple(qk_norm), geom=geom, plan=plan, scale=scale,
                             vmem_limit=vmem_limit, interpret=resolve_backend(backend).interpret)


def _tuple(arrays):
    """``arrays`` as a tuple (a pytree jit takes alike from a list or a tuple), or ``None``."""
    return None if arrays is None else tuple(arrays)


def plan_call(geom: Geometry, generation: str | None, **overrides) -> tuple[Plan, int]:
    """``(plan, vmem_limit_bytes)`` of one call from the tuned blocks of ``generation`` (default:
    the default device's) with the non-None ``overrides``.

    Raises:
      ValueError: unknown generation, a block size out of range, or a VMEM estimate over the
        generation's budget.
    """
    generation = default_generation() if generation is None else generation
    blocks = resolve_blocks(generation, **overrides)
    plan = make_plan(geom, blocks)
    vmem = vmem_estimate_bytes(geom, plan)
    if vmem > VMEM_BUDGET[generation]:
        raise ValueError(f"the tiling {blocks} needs about {vmem >> 20} MiB of VMEM, over the "
                         f"{VMEM_BUDGET[generation] >> 20} MiB budget of {generation}; use smaller "
                         "block_q / block_kv_compute / keys_per_block")
    return plan, _vmem_limit(vmem, generation)


def plan_rotating_call(geom: Geometry, generation: str | None, **overrides
                       ) -> tuple[Geometry, Plan, int]:
    """``(geom, plan, vmem_limit_bytes)``: :func:`plan_call`, where a kernel that would rotate
    (:attr:`Geometry.rotates`) but whose tables and rotated tail would take the tiling over the
    generation's VMEM budget (a long tail, e.g. a recache's) is planned without rotating; the
    wrapper then rotates with XLA first.

    Raises:
      ValueError: as :func:`plan_call`.
    """
    generation = default_generation() if generation is None else generation
    if geom.rotates:
        plan = make_plan(geom, resolve_blocks(generation, **overrides))
        if vmem_estimate_bytes(geom, plan) > VMEM_BUDGET[generation]:
            geom = dataclasses.replace(geom, rotates=False, normalizes=False)
    return (geom, *plan_call(geom, generation, **overrides))


def default_generation() -> str:
    """``"v6e"`` or ``"v5e"``: the generation of the chip a program is built for, from its kind;
    ``"v5e"`` off TPU. The chip is JAX's default device where one is set (``jax.default_device``,
    as :func:`pallas_kernels.tpu_aot.compile_for_tpu` sets a compile-only chip), else the first
    device."""
    device = target_device()
    kind = getattr(device, "device_kind", "").lower()
    return "v6e" if device.platform == "tpu" and ("v6" in kind) else "v5e"


def resolve_blocks(generation: str, **overrides) -> Blocks:
    """The tuned :class:`Blocks` of ``generation`` with the non-None ``overrides`` applied.

    Raises:
      ValueError: unknown generation, or a block size out of range.
    """
    if generation not in TUNED_BLOCKS:
        raise ValueError(f"generation must be one of {sorted(TUNED_BLOCKS)}, got {generation!r}")
    given = {k: v for k, v in overrides.items() if v is not None}
    blocks = dataclasses.replace(TUNED_BLOCKS[generation], **given)
    multiples = dict(block_q=8, block_q_compute=8, keys_per_block=8, block_kv_compute=LANES)
    return Blocks(**{name: require_int(name, getattr(blocks, name), minimum=m, multiple_of=m,
                                       must=f"a positive multiple of {m}") for name, m in multiples.items()},
                  mxu_row_sums=bool(blocks.mxu_row_sums), fixed_row_max=bool(blocks.fixed_row_max))


def _vmem_limit(estimate: int, generation: str) -> int:
    return int(min(VMEM_BUDGET[generation], max(32 << 20, estimate * 5 // 4 + (4 << 20))))


# ------------------------------------------------------------------------------------------------
# Kernel
# ------------------------------------------------------------------------------------------------


def _lanes(x, n: int):
    """A lane-dense ``[rows, 128]`` statistic widened (or cut) to ``n`` lanes."""
    reps, rest = divmod(n, LANES)
    parts = ([jnp.tile(x, (1, reps))] if reps else []) + ([x[:, :rest]] if rest else [])
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def _lane_partial_sums(p):
    """Row sums of ``p`` ``[rows, n]`` kept as 128 per-lane partial sums ``[rows, 128]`` (their
    total is the row sum): whole 128-lane slices are added elementwise, with no cross-lane
    reduction; a ragged rest (``n % 128``) is reduced and added into lane 0."""
    n = p.shape[1]
    full = n // LANES
    out = None
    for j in range(full):
        part = p[:, j * LANES:(j + 1) * LANES]
        out = part if out is None else out + part
    if n % LANES:
        rest = jnp.sum(p[:, full * LANES:], axis=1, keepdims=True)
        lane = lax.broadcasted_iota(jnp.int32, (p.shape[0], LANES), 1)
        rest = jnp.where(lane == 0, rest, 0.0)
        out = rest if out is None else out + rest
    return out


def _prefix_masks(sizes, limits):
    """Key masks of a chunk made of segments of ``sizes`` keys, segment ``i`` valid in its first
    ``limits[i]`` slots: ``([1, n], [n, 1])`` booleans, ``n = sum(sizes)``."""
    n = sum(sizes)
    masks = []
    for shape, axis in (((1, n), 1), ((n, 1), 0)):
        pos = lax.broadcasted_iota(jnp.int32, shape, axis)
        mask, start = None, 0
        for size, lim in zip(sizes, limits):
            part = (pos >= start) & (pos < start + lim)
            mask, start = part if mask is None else mask | part, start + size
        masks.append(mask)
    return masks


E4M3FN_AS_B11 = 16.0
"""float8_e4m3fn bytes read as float8_e4m3b11fnuz (the TPU's native fp8 unpack) are the e4m3fn
values divided by this (2**(11 - 7), the exponent biases' difference), except bytes 0x80 (e4m3fn
-0, b11fnuz NaN) and 0x7f/0xff (e4m3fn NaN, b11fnuz +-30)."""


def dequantize_tile(x, scale, dtype):
    """Stored values ``x`` times ``scale`` in float32, cast to ``dtype``
    (:func:`pallas_kernels.quantization.dequantize`). float8_e4m3fn is read as float8_e4m3b11fnuz
    (a bitcast; the TPU unpacks that natively) with the scale times :data:`E4M3FN_AS_B11`, and the
    b11fnuz NaN byte 0x80 (an e4m3fn -0) becomes 0; e4m3fn's NaN bytes, which
    :func:`~pallas_kernels.quantization.quantize` never stores (it clips to +-448), read as +-480
    times the scale."""
    if x.dtype != jnp.float8_e4m3fn:
        return dequantize(x, scale, (), dtype)
    y = dequantize(lax.bitcast_convert_type(x, jnp.float8_e4m3b11fnuz), scale * E4M3FN_AS_B11, (),
                   jnp.float32)
    return jnp.where(jnp.isnan(y), 0.0, y).astype(dtype)


def _kernel(table_ref, nvis_ref, len_ref, layer_ref, q_in, kt_ref, vt_ref, k_hbm, v_hbm, *refs,
            geom: Geometry, plan: Plan, q_scale: float):
    """Grid step ``(row, kv head, query block)``; see ``docs/kernels.md`` (the Mosaic TPU kernel).

    Refs: SMEM ``table_ref`` ``[rows * max_pages]`` (0 past the visible pages), ``nvis_ref``
    ``[rows]``, ``len_ref`` ``[rows]``, ``layer_ref`` ``[1]``; VMEM ``q_in``/``o_ref``
    ``[group, block_q, D]`` or ``[block_q, D]`` (token-major blocks; the last query block may
    hold rows past ``q_len``: their outputs are dropped),
    ``kt_ref``/``vt_ref`` ``[tail_pad, D]`` (rows past ``tail_len`` unspecified, masked);
    HBM pools ``[L, H, P, S, D]`` (the stored values of quantized pools); scratch ``kbuf``/``vbuf``
    ``[2, pages_per_block, S, D]``, DMA ``sems`` ``[2, 2]`` (K/V x buffer), ``q_ref`` ``[M, D]``
    (the queries times ``q_scale``), ``m_ref``/``l_ref`` ``[M, 128]`` and ``acc_ref`` ``[M, D]``
    float32. Under ``mxu_row_sums`` ``vbuf`` rows are ``D + 128`` lanes (V, then ones) and the
    first ``extra`` ref holds the tail's V so widened, ``[tail_pad, D + 128]``, both filled at a
    (row, head)'s first query block. Where pages are cut into pieces with a remainder
    (:func:`plan_remainder`) the last two ``extra`` refs are the pooled chunk's K and V
    (:func:`plan_pooled`), ``[rows, D]`` and ``[rows, V lanes]``: the tail's partial chunk, copied
    at the first query block, then each page's remainder, copied as its block is computed.

    Rotating (``geom.rotates``): ``q_in`` and ``kt_ref`` hold the queries and the chunk's keys
    before RoPE, two VMEM inputs ``cos``/``sin`` ``[table_rows, D]`` float32 (the tail's rows,
    every query block's rows among them; extras' rows 1 and 0) come after ``v_hbm`` and the
    scales, and the ``extra`` ref after the widened tail holds the tail's keys rotated,
    ``[tail_pad, D]``, filled at a (row, head)'s first query block; each query block is rotated
    as it is scaled (:func:`pallas_kernels.rope.rotate_rows`). Normalizing too
    (``geom.normalizes``): ``q_in`` and ``kt_ref`` are the raw projections, the inputs are q's
    ``cos``/``sin`` and K's, each times its tokens' inverse RMS, then q's and K's gains ``[1, D]``.

    Quantized pages (``geom.quantized``): an SMEM input ``scale_ref`` ``[2, max_pages]`` (the K and
    V scales of this (row, head)'s page-list entries) comes right after ``v_hbm``; ``kbuf`` and
    ``vbuf`` hold the pages' stored values (``D`` lanes, DMA'd at their stored width), and each
    compute chunk is dequantized as it is loaded (:func:`pallas_kernels.quantization.dequantize`
    with its page's scale, then widened under ``mxu_row_sums``), in the basic block of its
    matmuls, where the scheduler overlaps it with them.
    """
    scale_ref, refs = (refs[0], refs[1:]) if geom.quantized else (None, refs)
    prologue = geom.prologue_tables + 2 * geom.normalizes
    (q_tables, k_tables, gains), refs = _prologue_refs(refs[:prologue], geom), refs[prologue:]
    o_ref, kbuf, vbuf, sems, q_ref, m_ref, l_ref, acc_ref, *extra = refs
    v_tail = extra.pop(0) if plan.mxu_row_sums else vt_ref
    k_tail = extra.pop(0) if geom.rotates else kt_ref
    row, head = pl.program_id(0), pl.program_id(1)
    size, ppb, bkc, bqc = geom.block_size, plan.pages_per_block, plan.block_kv_compute, \
        plan.block_q_compute
    m_rows = q_ref.shape[0]
    precision = lax.Precision.HIGHEST if geom.dtype == "float32" else lax.Precision.DEFAULT
    nvis, length, layer = nvis_ref[row], len_ref[row], layer_ref[0]
    num_blocks = lax.div(nvis + ppb - 1, ppb)
    d = geom.head_dim
    rest, rest_rows = plan_remainder(geom, plan)
    body = size - rest if rest_rows else size  # A page's slots computed in pieces, not pooled.
    k_rest, v_rest = extra if rest_rows else (None, None)
    pooled_tail = plan_pooled(geom, plan)[0]
    full_tail = geom.tail_len // bkc
    tail_valid = geom.tail_len - full_tail * bkc  # Valid rows of the tail's partial chunk.
    tail_pieces = [(c * bkc, bkc) for c in range(full_tail)]
    if plan.tail_pad > full_tail * bkc:
        tail_pieces.append((full_tail * bkc, plan.tail_pad - full_tail * bkc))

    def first_query_block():
        """The (row, head)'s tail as every query block reads it: V widened by 128 lanes of ones
        under ``mxu_row_sums``, K rotated where the kernel rotates; its partial chunk copied to
        the pooled chunk's first rows where pooled."""
        if plan.mxu_row_sums:
            if not geom.quantized:  # Quantized pages are widened as they are dequantized.
                vbuf[:, :, :, pl.ds(d, LANES)] = jnp.ones(vbuf.shape[:-1] + (LANES,), vbuf.dtype)
            v_tail[:, pl.ds(0, d)] = vt_ref[...]
            v_tail[:, pl.ds(d, LANES)] = jnp.ones((plan.tail_pad, LANES), v_tail.dtype)
        if geom.rotates:
            gain = gains[1][...] if geom.normalizes else None
            for start, n in tail_pieces:
                keys = pl.ds(start, n)
                k_tail[keys] = rotate_rows(kt_ref[keys], k_tables[0][keys], k_tables[1][keys], gain)
        if pooled_tail:
            keys = pl.ds(full_tail * bkc, pooled_tail)
            k_rest[pl.ds(0, pooled_tail)] = k_tail[keys]
            v_rest[pl.ds(0, pooled_tail)] = v_tail[keys]

    if plan.mxu_row_sums or geom.rotates or pooled_tail:
        pl.when(pl.program_id(2) == 0)(first_query_block)

    def update(k, v, masks=None, first=False, fixed=False):
        """Softmax update of every query sub-block with one chunk of keys ``k``/``v``: online, or
        against the rows' maxima held ``fixed`` (:attr:`Blocks.fixed_row_max`); the ``first`` of
        a pass sets the statistics and the accumulator instead."""
        n = k.shape[0]
        if masks is not None:
            v = jnp.where(masks[1], v, jnp.zeros_like(v))

        def sub_block(i, carry):
            rows_ = pl.ds(pl.multiple_of(i * bqc, bqc), bqc)
            s = lax.dot_general(q_ref[rows_], k, (((1,), (1,)), ((), ())), precision=precision,
                                preferred_element_type=jnp.float32)
            if masks is not None:
                s = jnp.where(masks[0], s, MASK_VALUE)
            if first:
                m_next = jnp.broadcast_to(jnp.max(s, axis=1, keepdims=True), (bqc, LANES))
            elif fixed:
                m_next = m_ref[rows_]
            else:
                m_prev = m_ref[rows_]
                m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            p = jnp.exp2(s - _lanes(m_next, n))
            if first or not fixed:
                m_ref[rows_] = m_next
            pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                 precision=precision, preferred_element_type=jnp.float32)
            if plan.mxu_row_sums:  # Lanes d: of P @ [V | 1] hold the row sum on every lane.
                sums, pv = pv[:, d:], pv[:, :d]
            else:
                sums = _lane_partial_sums(p)
            if first:
                l_ref[rows_], acc_ref[rows_] = sums, pv
            elif fixed:
                l_ref[rows_] += sums
                acc_ref[rows_] += pv
            else:
                alpha = jnp.exp2(m_prev - m_next)
                l_ref[rows_] = alpha * l_ref[rows_] + sums
                acc_ref[rows_] = acc_ref[rows_] * _lanes(alpha, d) + pv
            return carry

        lax.fori_loop(0, m_rows // bqc, sub_block, 0)

    # History: blocks of `ppb` page-list entries, double-buffered by hand.
    def page_dmas(block, slot, i):
        entry = block * ppb + i
        page = table_ref[row * geom.max_pages + jnp.minimum(entry, geom.max_pages - 1)]
        dsts = (kbuf.at[slot, i], vbuf.at[slot, i, :, pl.ds(0, d)])
        return entry, [pltpu.make_async_copy(pool.at[page_index(layer, head, page)], dst,
                                             sems.at[kind, slot])
                       for kind, (pool, dst) in enumerate(zip((k_hbm, v_hbm), dsts))]

    def for_block(block, slot, action: str):
        def one(i, carry):
            entry, dmas = page_dmas(block, slot, i)

            @pl.when(entry < nvis)
            def _():
                for dma in dmas:
                    getattr(dma, action)()
            return carry

        lax.fori_loop(0, ppb, one, 0, unroll=ppb <= 8)

    def valid_slots(entry):
        """Valid slots (a prefix) of page-list entry ``entry``."""
        frame, first = lax.div(entry, geom.pages_per_frame), \
            lax.rem(entry, geom.pages_per_frame) * size
        n = jnp.minimum(geom.tokens_per_frame - first, length - frame * geom.tokens_per_frame - first)
        return jnp.clip(n, 0, size)

    def chunk(k, v, limits, sizes, known_full: bool, fixed: bool):
        """Computes one chunk of segments of ``sizes`` keys, ``limits`` of each valid: unmasked if
        every slot is valid, masked if some, skipped if none; where the caller knows every slot
        valid (``known_full``), unmasked in the caller's region, without the tests."""
        if known_full:
            update(k(), v(), fixed=fixed)
            return
        full = functools.reduce(jnp.logical_and, [lim == n for lim, n in zip(limits, sizes)])
        some = functools.reduce(jnp.logical_or, [lim > 0 for lim in limits])
        pl.when(full)(lambda: update(k(), v(), fixed=fixed))
        pl.when(some & jnp.logical_not(full))(
            lambda: update(k(), v(), _prefix_masks(sizes, limits), fixed=fixed))

    def history_block(block, carry, fixed: bool, unroll: bool):
        """One DMA block of the history; ``unroll``: a block of full pages computes its chunks in
        one region."""
        slot = lax.rem(block, 2)
        pl.when(block + 1 < num_blocks)(lambda: for_block(block + 1, 1 - slot, "start"))
        for_block(block, slot, "wait")
        first = block * ppb

        def load(buf, kind: int, i, keys):
            """Slots ``keys`` of the block's page ``i`` of K (``kind`` 0, ``kbuf``) or V (1,
            ``vbuf``) in the compute dtype: quantized pages dequantized with their scale, V widened
            by 128 lanes of ones under ``mxu_row_sums``."""
            x = buf[slot, i, keys]
            if not geom.quantized:
                return x
            x = dequantize_tile(x, scale_ref[kind, jnp.minimum(first + i, geom.max_pages - 1)],
                                 q_ref.dtype)
            if kind and plan.mxu_row_sums:
                x = jnp.concatenate([x, jnp.ones((x.shape[0], LANES), x.dtype)], axis=1)
            return x

        if plan.pages_per_chunk:
            g = plan.pages_per_chunk
            n = g * size

            def pages(buf, kind: int, c):
                """Pages ``c * g ..`` of the block, ``g`` of them, as one chunk ``[n, lanes]``."""
                if not geom.quantized:
                    return buf[slot, pl.ds(pl.multiple_of(c * g, g), g)].reshape(n, buf.shape[-1])
                return jnp.concatenate([load(buf, kind, c * g + i, pl.ds(0, size)) for i in range(g)])

            def page_chunk(c, full: bool):
                limits = [valid_slots(first + c * g + i) for i in range(g)]
                chunk(lambda: pages(kbuf, 0, c), lambda: pages(vbuf, 1, c), limits, [size] * g, full, fixed)

            units = ppb // g
        else:
            def page(i, full: bool):
                limit = valid_slots(first + i)
                for start in range(0, body, bkc):
                    n = min(bkc, body - start)
                    keys = pl.ds(start, n)
                    chunk(lambda keys=keys: load(kbuf, 0, i, keys), lambda keys=keys: load(vbuf, 1, i, keys),
                          [jnp.clip(limit - start, 0, n)], [n], full, fixed)
                if rest_rows:  # This page's remainder joins the pooled chunk.
                    at = pooled_tail + (first + i) * rest_rows
                    pooled = pl.ds(pl.multiple_of(at, geom.sublanes), rest)
                    k_rest[pooled] = load(kbuf, 0, i, pl.ds(body, rest))
                    v_rest[pooled] = load(vbuf, 1, i, pl.ds(body, rest))

            units, page_chunk = ppb, page

        # A block of full pages (the steady state of a window) runs its chunks unmasked, unrolled
        # into one region, where the scheduler overlaps each chunk's last products with the next
        # chunk's first; a block with a partial or missing page takes them one by one, masked where
        # needed.
        def one_by_one():
            lax.fori_loop(0, units, lambda unit, carry: (page_chunk(unit, False), carry)[1], 0)

        if not unroll:
            one_by_one()
            return carry
        full = functools.reduce(jnp.logical_and, [valid_slots(first + i) == size for i in range(ppb)])

        @pl.when(full)
        def _():
            for unit in range(units):
                page_chunk(unit, True)

        pl.when(jnp.logical_not(full))(one_by_one)
        return carry

    def pooled_chunks(fixed: bool):
        """The pooled chunk's pieces (:func:`pooled_pieces`), each masked: the tail's segment
        valid in its first ``tail_len % block_kv_compute`` rows, each entry's in its remainder's
        valid slots (none past the visible pages)."""
        start = 0
        for piece in pooled_pieces(geom, plan):
            limits = [tail_valid if entry < 0 else jnp.clip(valid_slots(entry) - body, 0, rest)
                      for entry, _ in piece]
            sizes = [n for _, n in piece]
            keys = pl.ds(start, sum(sizes))
            some = functools.reduce(jnp.logical_or, [jnp.asarray(lim) > 0 for lim in limits])
            pl.when(some)(lambda keys=keys, limits=limits, sizes=sizes: update(
                k_rest[keys], v_rest[keys], _prefix_masks(sizes, limits), fixed=fixed))
            start += sum(sizes)

    def start_history():
        pl.when(num_blocks > 0)(lambda: for_block(0, 0, "start"))

    def tail_chunk(c, carry, fixed: bool):
        keys = pl.ds(pl.multiple_of(c * bkc, bkc), bkc)
        update(k_tail[keys], v_tail[keys], fixed=fixed)
        return carry

    def attend(fixed: bool, unroll: bool):
        """One pass over every key: the tail's whole chunks first (they hide the first history
        block's DMAs, started by the caller), then the history, then the pooled chunk. A computed
        chunk has a valid key for every row, so every row's maximum is real from its first update
        on. ``unroll``: the tail's whole chunks and a block of full pages in one region each."""
        if full_tail:  # The first sets the statistics and the accumulator.
            update(k_tail[pl.ds(0, bkc)], v_tail[pl.ds(0, bkc)], first=True)
            lax.fori_loop(1, full_tail, functools.partial(tail_chunk, fixed=fixed), 0,
                          unroll=unroll and full_tail <= MAX_UNROLLED_TAIL_CHUNKS)
        else:
            m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
            l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
            acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        if plan.tail_pad > full_tail * bkc and not pooled_tail:
            n = plan.tail_pad - full_tail * bkc
            keys = pl.ds(full_tail * bkc, n)
            update(k_tail[keys], v_tail[keys], None if tail_valid == n else _prefix_masks([n], [tail_valid]),
                   fixed=fixed)
        lax.fori_loop(0, num_blocks, functools.partial(history_block, fixed=fixed, unroll=unroll), 0)
        if rest_rows:
            pooled_chunks(fixed)

    def normalize():
        """Writes the output; returns the float32 output and the row sums."""
        # Every lane holds the row sum (mxu_row_sums), or a partial sum.
        l_row = l_ref[...] if plan.mxu_row_sums else jnp.sum(l_ref[...], axis=1, keepdims=True)
        out = acc_ref[...] / _lanes(l_row, d)
        o_ref[...] = out.astype(o_ref.dtype).reshape(o_ref.shape)
        return out, l_row

    # The first history block's DMAs run while the queries are scaled and the tail is computed.
    start_history()
    q = q_in[...].reshape(q_ref.shape)
    if geom.rotates:
        own = pl.ds(pl.multiple_of(pl.program_id(2) * plan.block_q, plan.block_q), plan.block_q)
        q = rotate_rows(q, q_tables[0][own], q_tables[1][own], gains[0][...] if geom.normalizes else None)
    q_ref[...] = (q.astype(jnp.float32) * q_scale).astype(q_ref.dtype)
    real = geom.q_len - (plan.num_q_blocks - 1) * plan.block_q
    if plan.fixed_row_max and real < plan.block_q:
        # The last query block's rows past q_len hold unspecified queries (their outputs are
        # dropped); zeros keep their sums and outputs finite for the overflow check.
        @pl.when(pl.program_id(2) == plan.num_q_blocks - 1)
        def _():
            for g in range(geom.group):
                q_ref[pl.ds(g * plan.block_q + real, plan.block_q - real)] = jnp.zeros(
                    (plan.block_q - real, d), q_ref.dtype)

    attend(plan.fixed_row_max, unroll=True)
    out, l_row = normalize()
    if plan.fixed_row_max:
        # Against a fixed maximum a later logit beyond it by about 128 (base 2) overflows; the
        # sums or outputs then are not finite (x * 0 is 0 exactly for finite x), and the step is
        # computed again with the online softmax.
        overflow = jnp.sum(out * 0.0) + jnp.sum(l_row * 0.0) != 0.0

        def again(i, carry):
            start_history()
            attend(False, unroll=False)
            normalize()
            return carry

        lax.fori_loop(0, overflow.astype(jnp.int32), again, 0)


def _prologue_refs(refs, geom: Geometry):
    """``(q_tables, k_tables, gains)`` of the kernel's prologue inputs (:attr:`Geometry.rotates`,
    :attr:`Geometry.normalizes`): the (cos, sin) refs of q and of K (one pair for both where the
    kernel does not normalize), and the (q, K) gain refs or ``None``."""
    if geom.normalizes:
        return tuple(refs[:2]), tuple(refs[2:4]), tuple(refs[4:])
    return tuple(refs), tuple(refs), None


@functools.partial(jax.jit, static_argnames=("geom", "plan", "scale", "vmem_limit", "interpret"))
def _window_attention(q, k_cur, v_cur, extra_k, extra_v, k_pool, v_pool, pages, lengths, layer,
                      rope=None, qk_norm=None, *, geom: Geometry, plan: Plan, scale: float,
                      vmem_limit: int, interpret: Any):
    """Wrapper of :func:`_kernel`: hands it ``q``, the tail's (chunk, then extras) K and V and
    the output as they are, viewed ``[rows, tokens, heads * D]`` with one head's lanes per block
    (:attr:`Geometry.token_major`), else transposed head-major, ``q`` to ``[rows, kv_heads, group,
    q_len, D]`` and the tail to ``[rows, kv_heads, tail_len, D]`` (so too ``q`` and K where XLA
    rotates them here, whose rotation is computed head-major); no padding, no
    scaling (the kernel scales each query block, and the last query block and tail chunk may run
    past the arrays' ends); builds the page table and the visible counts. For
    quantized pools the kernel takes the stored values as they are and the visible pages' scales
    (:func:`visible_scales`), one ``[2, max_pages]`` SMEM block per (row, head). With ``rope``
    (``(cos, sin)``) the kernel rotates ``q`` and ``k_cur`` where :attr:`Geometry.rotates`, and
    they are rotated here (:func:`pallas_kernels.rope.apply_rope`) where not; the rotating kernel
    reads them token-major too, and the tables (extras' rows 1 and 0) one block per row. With
    ``qk_norm`` the kernel normalizes them too where :attr:`Geometry.normalizes` (the inverse RMS
    folded into per-row q and K tables here), and they are normalized here where not."""
    rows, hkv, g, d, bq = geom.rows, geom.kv_heads, geom.group, geom.head_dim, plan.block_q
    nqb, m = plan.num_q_blocks, geom.group * plan.block_q
    if not geom.rotates:
        q, k_cur = prepare_qk(q, k_cur, rope, qk_norm)
    elif not geom.normalizes:
        q, k_cur = prepare_qk(q, k_cur, None, qk_norm)
    k_tail = jnp.concatenate([k_cur] + ([] if extra_k is None else [extra_k]), axis=1)
    v_tail = jnp.concatenate([v_cur] + ([] if extra_v is None else [extra_v]), axis=1)
    # Token-major blocks, [rows, tokens, heads * D] viewed one head's lanes at a time.
    query_rows = pl.BlockSpec((None, bq, d), lambda r, h, b, *_: (r, b, h))
    tail_rows = pl.BlockSpec((None, plan.tail_pad, d), lambda r, h, b, *_: (r, 0, h))
    tables, table_specs = [], []
    # q and the tail's K token-major too, unless XLA rotated them above: its rotation's output
    # would be relaid out twice to reach token-major blocks (docs/kernels.md, on which layouts
    # cost copies).
    if geom.token_major and (geom.rotates or rope is None):
        qh, q_spec = q.reshape(rows, geom.q_len, hkv * d), query_rows
        k_tail, k_spec = k_tail.reshape(rows, geom.tail_len, hkv * d), tail_rows
    else:
        qh = q.reshape(rows, geom.q_len, hkv, g, d).transpose(0, 2, 3, 1, 4)
        q_spec = pl.BlockSpec((None, None, g, bq, d), lambda r, h, b, *_: (r, h, 0, b, 0))
        k_tail = k_tail.transpose(0, 2, 1, 3)
        k_spec = pl.BlockSpec((None, None, plan.tail_pad, d), lambda r, h, b, *_: (r, h, 0, 0))
    if geom.rotates:
        tables = list(rope)
        if geom.num_extra:  # Extras are read as they are: cos 1, sin 0.
            pad = (rows, geom.num_extra, d)
            tables = [jnp.concatenate([tables[0], jnp.ones(pad, jnp.float32)], axis=1),
                      jnp.concatenate([tables[1], jnp.zeros(pad, jnp.float32)], axis=1)]
        table_specs = [pl.BlockSpec((None, plan.table_rows, d), lambda r, h, b, *_: (r, 0, 0))]
        table_specs *= geom.prologue_tables
        if geom.normalizes:  # q's tables and K's, each times its tokens' inverse RMS; the gains.
            q_inv_rms, k_inv_rms, q_gain, k_gain = qk_norm
            tables = [t * inv[:, :, None] for inv in (q_inv_rms, k_inv_rms) for t in tables]
            tables += [g.astype(jnp.float32).reshape(1, hkv * d) for g in (q_gain, k_gain)]
            table_specs += [pl.BlockSpec((1, d), lambda r, h, b, *_: (0, h))] * 2
    if geom.token_major:
        v_tail, v_spec = v_tail.reshape(rows, v_tail.shape[1], hkv * d), tail_rows
        out_spec, out_shape = query_rows, (rows, geom.q_len, hkv * d)
    else:  # Head-major like q and K (a kernel that rotates reads token-major).
        v_tail, v_spec = v_tail.transpose(0, 2, 1, 3), k_spec
        out_spec, out_shape = q_spec, (rows, hkv, g, geom.q_len, d)

    lengths = lengths.astype(jnp.int32)
    nvis = visible_page_count(lengths, geom)
    entry = jnp.arange(geom.max_pages, dtype=jnp.int32)[None, :]
    table = jnp.where(entry < nvis[:, None], pages.astype(jnp.int32), 0).reshape(-1)

    hbm = pl.BlockSpec(memory_space=pl.ANY)
    pools, in_specs = [k_pool, v_pool], [q_spec, k_spec, v_spec, hbm, hbm]
    pages_shape = (2, plan.pages_per_block, geom.block_size)
    k_buf = pltpu.VMEM((*pages_shape, d), q.dtype)
    v_buf = pltpu.VMEM((*pages_shape, plan_v_lanes(geom, plan)), q.dtype)
    if geom.quantized:  # Pages stay 8-bit in VMEM; the scales of the visible pages go to SMEM.
        pools = [k_pool.values, v_pool.values, visible_scales(k_pool, v_pool, table, layer, geom)]
        in_specs.append(pl.BlockSpec((None, None, 2, geom.max_pages), lambda r, h, b, *_: (r, h, 0, 0),
                                     memory_space=pltpu.SMEM))
        k_buf = v_buf = pltpu.VMEM((*pages_shape, d), k_pool.dtype)
    in_specs += table_specs
    wide_tail = ([pltpu.VMEM((plan.tail_pad, plan_v_lanes(geom, plan)), q.dtype)]
                 if plan.mxu_row_sums else [])
    rotated_tail = [pltpu.VMEM((plan.tail_pad, d), q.dtype)] if geom.rotates else []
    pooled_rows = plan_pooled(geom, plan)[1]
    pooled_rest = ([pltpu.VMEM((pooled_rows, d), q.dtype),
                    pltpu.VMEM((pooled_rows, plan_v_lanes(geom, plan)), q.dtype)] if pooled_rows else [])
    out = pl.pallas_call(
        functools.partial(_kernel, geom=geom, plan=plan, q_scale=scale * LOG2_E),
        out_shape=jax.ShapeDtypeStruct(out_shape, q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(rows, hkv, nqb),
            in_specs=in_specs,
            out_specs=out_spec,
            scratch_shapes=[k_buf, v_buf, pltpu.SemaphoreType.DMA((2, 2)),
                            pltpu.VMEM((m, d), q.dtype),
                            pltpu.VMEM((m, LANES), jnp.float32),
                            pltpu.VMEM((m, LANES), jnp.float32),
                            pltpu.VMEM((m, d), jnp.float32), *wide_tail, *rotated_tail,
                            *pooled_rest]),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=vmem_limit),
        interpret=interpret,
        name="window_attention_tpu",
    )(table, nvis, lengths, layer.reshape(1), qh, k_tail, v_tail, *pools, *tables)
    if not geom.token_major:
        out = out.transpose(0, 3, 1, 2, 4)
    return out.reshape(rows, geom.q_len, geom.num_q_heads, d)


def visible_scales(k_pool: QuantizedPool, v_pool: QuantizedPool, table: jax.Array, layer: jax.Array,
                   geom: Geometry) -> jax.Array:
    """float32 ``[rows, kv_heads, 2, max_pages]``: the K (index 0) and V (1) scales of ``layer``'s
    pages at each row's page-list entries (``table``, flat ``[rows * max_pages]``, 0 past the
    visible pages, so those read the null page's scale)."""
    pages = table.reshape(geom.rows, geom.max_pages)
    # Advanced indices around a slice put their broadcast shape first: [rows, max_pages, kv_heads].
    scales = jnp.stack([k_pool.scales[layer, :, pages], v_pool.scales[layer, :, pages]], axis=-1)
    return scales.transpose(0, 2, 3, 1)
