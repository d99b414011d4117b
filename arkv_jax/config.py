"""Frozen, validated configuration types: cache geometry, window policy, KV branches, cross-attention.

These are host-side values (hashable, usable as static jit arguments). Every check names the bad field
and the allowed range in these types' own terms; vLLM-Omni's names and messages live in
:mod:`arkv_jax.compat.vllm_omni_config`, which checks its inputs before building these.

The small shared rules live here once: :func:`ceil_div`, :func:`pages_per_frame`,
:data:`SUPPORTED_DTYPES`, the argument checks (``require_*``, re-exported from
:mod:`pallas_kernels.checks`, the one rule the kernels share) and the window rule on
:class:`WindowPolicy` (what a session keeps and sees: skipped and kept frames, the visible history,
the most history a chunk sees, the latent ring, the largest chunk), in arithmetic that runs on ints
and on tracers. Units: sizes in tokens, frames or pages as the field name says; bytes are ``int``.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Iterable, Mapping, Sequence

import numpy as np

from pallas_kernels.checks import (  # The one rule for int, real and bool arguments, re-exported.
    ArgumentTypeError,
    is_int,  # noqa: F401 (re-exported)
    is_real,  # noqa: F401 (re-exported)
    require_bool,
    require_int,
    require_non_negative,
    require_positive,
    require_real,  # noqa: F401 (re-exported)
)
from pallas_kernels.quantization import QUANTIZED_DTYPES, SCALE_ITEMSIZE, dtype_name

#: Compute and storage dtypes the pools and kernels support.
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")

#: K/V page storage dtypes (``CacheGeometry.kv_dtype``): the compute dtypes, or a quantized one
#: (:data:`pallas_kernels.quantization.QUANTIZED_DTYPES`: pages stored with float32 scales).
KV_DTYPES = SUPPORTED_DTYPES + QUANTIZED_DTYPES


def canonical_dtype(dtype) -> str:
    """Normalises a dtype given as a string, NumPy or JAX dtype to its name, e.g. ``"bfloat16"``.

    Raises:
      ValueError: the dtype is not one of ``SUPPORTED_DTYPES``.
    """
    try:
        import jax.numpy as jnp

        if isinstance(dtype, bool) or dtype is None:
            raise TypeError(dtype)
        name = jnp.dtype(dtype).name
    except (TypeError, ValueError) as exc:
        raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype!r}") from exc
    if name not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {name!r}")
    return name


def canonical_kv_dtype(kv_dtype) -> str:
    """Normalises a K/V storage dtype (a string, NumPy or JAX dtype) to its name, e.g. ``"int8"``.

    Raises:
      ValueError: not one of :data:`KV_DTYPES` (the message names ``kv_dtype``, the value and the
        allowed set).
    """
    name = dtype_name(kv_dtype)
    if name not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
    return name


def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of a supported (or K/V storage) dtype name."""
    import jax.numpy as jnp

    return int(np.dtype(jnp.dtype(dtype)).itemsize)


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative integers."""
    return -(-a // b)


def pages_per_frame(tokens_per_frame: int, block_size: int) -> int:
    """Pages one frame occupies when pages are frame-aligned: ``ceil(tokens_per_frame / block_size)``."""
    return ceil_div(tokens_per_frame, block_size)


def require_str_sequence(name: str, value, *, allow_empty: bool = False) -> tuple[str, ...]:
    """``value`` as a tuple of strings: a list or tuple (or other non-string iterable) of ``str``.

    Raises:
      ArgumentTypeError: a string or bytes (one string is not a list of names), a non-iterable, or a
        non-string item. ValueError: empty (unless ``allow_empty``) or repeated items.
    """
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ArgumentTypeError(f"{name} must be a list or tuple of strings, got {value!r} ({type(value).__name__})")
    items = tuple(value)
    bad = [x for x in items if not isinstance(x, str)]
    if bad:
        raise ArgumentTypeError(f"{name} must hold strings only, got {bad[0]!r} ({type(bad[0]).__name__})")
    if not items and not allow_empty:
        raise ValueError(f"{name} must not be empty")
    if len(set(items)) != len(items):
        raise ValueError(f"{name} must be distinct, got {list(items)}")
    return items


class _PythonInts:
    """The array operations of the window rule on Python ints (so ints stay ints)."""

    maximum, minimum = staticmethod(max), staticmethod(min)

    @staticmethod
    def where(condition, a, b):
        return a if condition else b

    @staticmethod
    def asarray(value):
        return value


def _ops(*values):
    """The array module of the window rule for ``values``: Python ints, NumPy, or ``jax.numpy``
    when any value is a JAX array or tracer (then JAX is imported already)."""
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return _PythonInts
    jax = sys.modules.get("jax")
    if jax is not None and any(isinstance(v, jax.Array) for v in values):
        return jax.numpy
    return np


@dataclasses.dataclass(frozen=True)
class CacheGeometry:
    """Shape of one model's self-attention K/V cache.

    Attributes:
      num_layers: attention layers that keep K/V.
      num_kv_heads: K/V heads per layer (on one device, before any head sharding).
      head_dim: features per head.
      dtype: compute dtype name, one of ``SUPPORTED_DTYPES`` (strings, NumPy and JAX dtypes accepted):
        the K/V a forward produces and attention computes in, and the storage of the cross-attention
        caches.
      tokens_per_frame: K/V tokens per latent frame (vLLM-Omni's ``chunk_size``).
      block_size: tokens per page; ``None`` means one page per frame (``tokens_per_frame``). Pages
        are frame-aligned: a frame takes ``pages_per_frame`` pages and its last page is padded.
      frames_per_forward: frames of one chunk, the frames a model forward commits at once
        (vLLM-Omni's ``frames_per_block``).
      kv_dtype: storage dtype of the K/V pages, one of :data:`KV_DTYPES`; ``None`` (the default)
        means ``dtype`` (no quantization), and a value equal to ``dtype`` is kept as ``None`` (so
        ``dataclasses.replace(geometry, dtype=...)`` changes the pages' dtype with the compute
        dtype unless a different one was chosen). :attr:`page_dtype` is the dtype the pages are
        stored in either way. A quantized one (``"int8"``, ``"float8_e4m3fn"``,
        ``"float8_e5m2"``) stores each page with one float32 scale per (layer, KV head, page)
        (``docs/kernels.md``, Quantized pages); every kernel backend reads and writes such pools.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    tokens_per_frame: int
    block_size: int | None = None
    frames_per_forward: int = 1
    kv_dtype: str | None = None

    def __post_init__(self):
        for name in ("num_layers", "num_kv_heads", "head_dim", "tokens_per_frame"):
            object.__setattr__(self, name, require_positive(name, getattr(self, name)))
        if self.block_size is None:
            object.__setattr__(self, "block_size", self.tokens_per_frame)
        object.__setattr__(self, "block_size", require_positive("block_size", self.block_size))
        object.__setattr__(self, "frames_per_forward", require_positive("frames_per_forward", self.frames_per_forward))
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        if self.kv_dtype is not None:
            kv_dtype = canonical_kv_dtype(self.kv_dtype)
            object.__setattr__(self, "kv_dtype", None if kv_dtype == self.dtype else kv_dtype)

    @property
    def page_dtype(self) -> str:
        """The dtype the K/V pages are stored in: ``kv_dtype``, or ``dtype`` when it is ``None``."""
        return self.dtype if self.kv_dtype is None else self.kv_dtype

    @property
    def quantized(self) -> bool:
        """Whether the K/V pages are stored quantized (:attr:`page_dtype` is not a compute dtype)."""
        return self.page_dtype in QUANTIZED_DTYPES

    @property
    def write_dtype(self) -> str:
        """The dtype of the K/V the page write takes: :attr:`page_dtype` for float pages, ``dtype``
        for quantized ones (quantized as they are written)."""
        return self.dtype if self.quantized else self.page_dtype

    @property
    def pages_per_frame(self) -> int:
        """Pages one frame occupies: :func:`pages_per_frame`."""
        return pages_per_frame(self.tokens_per_frame, self.block_size)

    @property
    def padding_tokens_per_frame(self) -> int:
        """Unused token slots in a frame's last page."""
        return self.pages_per_frame * self.block_size - self.tokens_per_frame

    @property
    def itemsize(self) -> int:
        """Bytes per element of ``dtype`` (the compute dtype; the cross-attention caches' storage)."""
        return dtype_itemsize(self.dtype)

    @property
    def kv_itemsize(self) -> int:
        """Bytes per stored K/V page element (of :attr:`page_dtype`)."""
        return dtype_itemsize(self.page_dtype)

    @property
    def page_bytes_per_layer(self) -> int:
        """Bytes of one page in one layer, K and V (vLLM's ``page_size_bytes``): the stored values
        and, for a quantized ``kv_dtype``, one float32 scale per KV head."""
        scales = self.num_kv_heads * SCALE_ITEMSIZE if self.quantized else 0
        return 2 * (self.block_size * self.num_kv_heads * self.head_dim * self.kv_itemsize + scales)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all layers, K and V (vLLM-Omni's "all-layer page")."""
        return self.page_bytes_per_layer * self.num_layers

    @property
    def frame_bytes(self) -> int:
        """Bytes one frame occupies in the pool, padding included, all layers, K and V."""
        return self.pages_per_frame * self.page_bytes


@dataclasses.dataclass(frozen=True)
class WindowPolicy:
    """Which frames attention sees and which the cache keeps.

    Attributes:
      window_frames: recent frames kept after a commit, the current chunk's frames counting inside
        the window when attending (vLLM-Omni's ``window_chunks``). Must be positive: an unbounded
        window is refused.
      sink_frames: leading frames never evicted (the attention sink, vLLM-Omni's ``sink_chunks``).
      reset_at_boundary: every commit evicts everything after the sink, including the frames just
        committed, so a chunk sees only the sink and itself.
    """

    window_frames: int
    sink_frames: int = 0
    reset_at_boundary: bool = False

    def __post_init__(self):
        object.__setattr__(self, "window_frames", require_positive("window_frames", self.window_frames))
        object.__setattr__(self, "sink_frames", require_non_negative("sink_frames", self.sink_frames))
        object.__setattr__(self, "reset_at_boundary", require_bool("reset_at_boundary", self.reset_at_boundary))

    @property
    def resident_frames(self) -> int:
        """Frames a session may hold: sink plus window (what the planner sizes a session for)."""
        return self.sink_frames + self.window_frames

    # -- the window rule: what a session keeps and sees. Each method takes Python ints (and returns
    # -- Python ints), NumPy integer arrays or JAX arrays and tracers (broadcast), so the jitted
    # -- state, the host-side facade, planner and rollout and the references share one definition.
    @property
    def kept_frames_max(self) -> int:
        """The most frames a session holds between chunks: sink plus window, the sink only in reset
        mode."""
        return self.sink_frames + (0 if self.reset_at_boundary else self.window_frames)

    def skipped_frames(self, committed):
        """Frames after the sink out of the window once ``committed`` frames are committed
        (vLLM-Omni's skip rule at frame granularity): they are evicted."""
        ops = _ops(committed)
        return ops.maximum(0, committed - self.kept_frames_max)

    def kept_frames(self, committed):
        """Frames a session holds after ``committed`` frames are committed (none skipped by a
        prefill): the sink, then the most recent ones."""
        return committed - self.skipped_frames(committed)

    def history_split(self, held, chunk_frames):
        """``(sink, recent)``: how many of ``held`` resident frames (the sink first, then recent
        frames in time order) a chunk of ``chunk_frames`` frames sees: the sink frames, and every
        recent frame while the chunk still fits in ``sink_frames + window_frames``, else the newest
        ``window_frames - chunk_frames`` of them (at least 0). The state's visible window."""
        ops = _ops(held, chunk_frames)
        sink = ops.minimum(held, self.sink_frames)
        live = held - sink
        fits = held + chunk_frames <= self.resident_frames
        return sink, ops.where(fits, live, ops.minimum(live, ops.maximum(0, self.window_frames - chunk_frames)))

    def visible_history(self, chunk_first_frame, chunk_frames):
        """The history a chunk sees, on frame indices: the window rule without pages.

        A chunk of ``chunk_frames`` frames whose first frame is ``chunk_first_frame`` (every earlier
        frame committed, none skipped) sees the sink frames ``[0, sink)`` and the recent frames
        ``[chunk_first_frame - recent, chunk_first_frame)``: :meth:`history_split` of the
        :meth:`kept_frames` (in reset mode ``recent`` is 0).

        Returns:
          ``(sink, recent)`` of the broadcast shape (ints for ints).
        """
        ops = _ops(chunk_first_frame, chunk_frames)
        first, frames = ops.asarray(chunk_first_frame), ops.asarray(chunk_frames)
        return self.history_split(self.kept_frames(first), frames)

    def frame_visible(self, frame, chunk_first_frame, chunk_frames):
        """Whether frame ``frame`` is visible to (every query of) the chunk of ``chunk_frames``
        frames starting at ``chunk_first_frame``: a sink or recent history frame of
        :meth:`visible_history`, or a frame of the chunk itself (attention inside a chunk is
        bidirectional). Returns a bool (array)."""
        ops = _ops(frame, chunk_first_frame, chunk_frames)
        frame, first = ops.asarray(frame), ops.asarray(chunk_first_frame)
        sink, recent = self.visible_history(first, chunk_frames)
        return (frame < sink) | ((frame >= first - recent) & (frame < first + ops.asarray(chunk_frames)))

    def max_history(self, chunk_frames):
        """The most history frames a chunk of ``chunk_frames`` frames ever sees: the sink plus at
        most ``window_frames - chunk_frames`` recent frames (none in reset mode). A prompt switch
        recomputes this many frames per branch (:meth:`arkv_jax.cache.PagedKVCache.recache`)."""
        recent = 0 if self.reset_at_boundary else _ops(chunk_frames).maximum(0, self.window_frames - chunk_frames)
        return self.sink_frames + recent

    def latent_ring_frames(self, chunk_frames: int) -> int:
        """Latent frames a session keeps so that a prompt switch can recompute its history: every
        whole chunk of ``chunk_frames`` frames holding a sink frame or one of the recent frames of
        :meth:`max_history` (chunks start at multiples of ``chunk_frames``); :meth:`ring_keeps` says
        which."""
        recent = self.max_history(chunk_frames) - self.sink_frames
        return chunk_frames * (ceil_div(self.sink_frames, chunk_frames) + ceil_div(recent, chunk_frames))

    def ring_keeps(self, chunk, newest_chunk, chunk_frames):
        """Whether a session's latent ring still needs chunk ``chunk`` (frames ``[chunk *
        chunk_frames, (chunk + 1) * chunk_frames)``) once chunk ``newest_chunk`` is generated: it
        holds a sink frame or one of the :meth:`max_history` recent frames the next chunk sees."""
        recent = self.max_history(chunk_frames) - self.sink_frames
        return ((chunk * chunk_frames < self.sink_frames)
                | ((chunk + 1) * chunk_frames > (newest_chunk + 1) * chunk_frames - recent))

    def max_chunk_frames(self, *, table_width, pool_pages, pages_per_frame, rows_per_shard, chunk_rows):
        """The largest ``num_frames`` a chunk of ``chunk_rows`` rows of one data shard can always
        take: with every one of the shard's ``rows_per_shard`` rows holding :attr:`kept_frames_max`,
        a row's page table of ``table_width`` pages still has room for the chunk, and the shard's
        ``pool_pages`` allocatable pages still hold it for every chunk row. Never above
        ``window_frames``, never below 0; a value at or below it is valid for the sessions' whole
        life."""
        ops, held = _ops(table_width, pool_pages, rows_per_shard, chunk_rows), self.kept_frames_max
        table_room = table_width // pages_per_frame - held
        spare = pool_pages // pages_per_frame - rows_per_shard * held
        return ops.maximum(0, ops.minimum(ops.minimum(self.window_frames, table_room),
                                          spare // ops.maximum(1, chunk_rows)))


@dataclasses.dataclass(frozen=True)
class KVBranch:
    """A logical KV branch (e.g. CFG ``"positive"``/``"negative"``, or ``"main"``).

    ``local_index`` is the worker-local storage slot used for scratch pages and in-flight sizing; two
    logical branches may share one when at most one of them runs on a device (CFG-parallel).
    """

    name: str
    local_index: int = 0

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise ArgumentTypeError(f"KV branch name must be a non-empty string, got {self.name!r}")
        if not self.name:
            raise ValueError(f"KV branch name must be a non-empty string, got {self.name!r}")
        object.__setattr__(self, "local_index", require_non_negative("KV branch local_index", self.local_index))


@dataclasses.dataclass(frozen=True)
class CrossAttentionSpec:
    """A named, dense cross-attention cache per session and logical branch (e.g. text K/V).

    Attributes:
      name: cache name, e.g. ``"text"``.
      num_tokens: K/V tokens the cache holds.
      num_kv_heads: heads of this cache; ``None`` means the self-attention head count.
    """

    name: str
    num_tokens: int
    num_kv_heads: int | None = None

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise ArgumentTypeError(f"cross-attention name must be a non-empty string, got {self.name!r}")
        if not self.name:
            raise ValueError(f"cross-attention name must be a non-empty string, got {self.name!r}")
        object.__setattr__(self, "num_tokens", require_positive("cross-attention num_tokens", self.num_tokens))
        if self.num_kv_heads is not None:
            object.__setattr__(self, "num_kv_heads",
                               require_positive("cross-attention num_kv_heads", self.num_kv_heads))


def validate_branches(branches: Iterable[KVBranch]) -> tuple[KVBranch, ...]:
    """Checks a branch list and returns it as a tuple.

    Raises:
      ArgumentTypeError: not a sequence of :class:`KVBranch`. ValueError: no branch, duplicate
        names, or local indices not contiguous from zero.
    """
    if isinstance(branches, (str, bytes, KVBranch)) or not isinstance(branches, Iterable):
        raise ArgumentTypeError(f"kv_branches must be a sequence of KVBranch, got {branches!r}")
    branches = tuple(branches)
    bad = [b for b in branches if not isinstance(b, KVBranch)]
    if bad:
        raise ArgumentTypeError(f"kv_branches must hold KVBranch values, got {bad[0]!r} ({type(bad[0]).__name__})")
    if not branches:
        raise ValueError("kv_branches must hold at least one KV branch")
    names = [b.name for b in branches]
    if len(names) != len(set(names)):
        raise ValueError(f"KV branch names must be unique, got {names}")
    indices = {b.local_index for b in branches}
    if indices != set(range(max(indices) + 1)):
        raise ValueError(f"KV branch local_index values must be contiguous from zero, got {sorted(indices)}")
    return branches


def num_local_branches(branches: Sequence[KVBranch]) -> int:
    """Worker-local branch slots: ``max(local_index) + 1``."""
    return max(b.local_index for b in branches) + 1


def validate_cross_attention(specs: Iterable[CrossAttentionSpec]) -> tuple[CrossAttentionSpec, ...]:
    """Checks that cross-attention cache names are unique; returns the specs as a tuple.

    Raises:
      ArgumentTypeError: not a sequence of :class:`CrossAttentionSpec`. ValueError: repeated names.
    """
    if isinstance(specs, (str, bytes, CrossAttentionSpec)) or not isinstance(specs, Iterable):
        raise ArgumentTypeError(f"cross_attention must be a sequence of CrossAttentionSpec, got {specs!r}")
    specs = tuple(specs)
    bad = [s for s in specs if not isinstance(s, CrossAttentionSpec)]
    if bad:
        raise ArgumentTypeError(f"cross_attention must hold CrossAttentionSpec values, got {bad[0]!r} "
                                f"({type(bad[0]).__name__})")
    names = [s.name for s in specs]
    if len(names) != len(set(names)):
        raise ValueError(f"cross-attention names must be unique, got {names}")
    return specs


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def check_axis_sizes(data: int, model: int) -> None:
    """Checks the sizes of a ``("data", "model")`` mesh.

    Raises:
      ValueError: a size that is not a positive int.
    """
    for name, value in (("data", data), ("model", model)):
        require_int(f"mesh axis {name!r}", value, minimum=1, must="a positive int")


def check_divisible(what: str, value: int, axis: str, size: int) -> None:
    """Checks that ``value`` (described as ``what``) splits evenly over a mesh axis.

    Raises:
      ValueError: ``value % size != 0``, naming the allowed axis sizes.
    """
    if value % size:
        raise ValueError(
            f"{what}={value} must be divisible by the mesh axis {axis!r} of size {size}; allowed "
            f"{axis!r} sizes for {what}={value}: {divisors(value)}")


def lookup(mapping: Mapping, key, what: str):
    """``mapping[key]``, or a ``KeyError``: ``Unknown {what} {key!r}; expected {tuple(mapping)}``."""
    try:
        return mapping[key]
    except KeyError:
        raise KeyError(f"Unknown {what} {key!r}; expected {tuple(mapping)}") from None
