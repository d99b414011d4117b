"""Frozen, validated configuration types: cache geometry, window policy, KV branches, cross-attention.

These are host-side values (hashable, usable as static jit arguments). Every check names the bad value
and the allowed range; where vLLM-Omni (the seed) has the same check, the condition and message are the
seed's.

Units: sizes in tokens, frames or pages as the field name says; bytes are plain ``int``.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping, Sequence

import numpy as np

#: Storage dtypes the pools and kernels support.
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")


def canonical_dtype(dtype) -> str:
    """Normalises a dtype given as a string, NumPy or JAX dtype to its name, e.g. ``"bfloat16"``.

    Raises:
      ValueError: the dtype is not one of ``SUPPORTED_DTYPES``.
    """
    try:
        import jax.numpy as jnp

        name = jnp.dtype(dtype).name
    except TypeError as exc:
        raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype!r}") from exc
    if name not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {name!r}")
    return name


def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of a supported dtype name."""
    import jax.numpy as jnp

    return int(np.dtype(jnp.dtype(dtype)).itemsize)


def _require_positive(name: str, value: int) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"AR-Diffusion {name} must be positive, got {value!r}")


def _require_non_negative(name: str, value: int) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
        raise ValueError(f"AR-Diffusion {name} must be non-negative, got {value!r}")


@dataclasses.dataclass(frozen=True)
class CacheGeometry:
    """Shape of one model's self-attention K/V cache.

    Attributes:
      num_layers: attention layers that keep K/V.
      num_kv_heads: K/V heads per layer (on one device, before any head sharding).
      head_dim: features per head.
      dtype: storage dtype name, one of ``SUPPORTED_DTYPES`` (strings, NumPy and JAX dtypes accepted).
      tokens_per_frame: K/V tokens per latent frame (one AR "chunk" of the seed).
      block_size: tokens per page; ``None`` means one page per frame (``tokens_per_frame``). Pages
        are frame-aligned: a frame takes ``pages_per_frame`` pages and its last page is padded.
      frames_per_forward: frames a model forward commits at once (the seed's ``frames_per_block``).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    tokens_per_frame: int
    block_size: int | None = None
    frames_per_forward: int = 1

    def __post_init__(self):
        for name in ("num_layers", "num_kv_heads", "head_dim", "tokens_per_frame"):
            _require_positive(name, getattr(self, name))
        if self.block_size is None:
            object.__setattr__(self, "block_size", int(self.tokens_per_frame))
        _require_positive("block_size", self.block_size)
        if not isinstance(self.frames_per_forward, (int, np.integer)) or self.frames_per_forward <= 0:
            raise ValueError(f"frames_per_block must be positive, got {self.frames_per_forward!r}")
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))

    @property
    def pages_per_frame(self) -> int:
        """Pages one frame occupies: ``ceil(tokens_per_frame / block_size)``."""
        return -(-self.tokens_per_frame // self.block_size)

    @property
    def padding_tokens_per_frame(self) -> int:
        """Unused token slots in a frame's last page."""
        return self.pages_per_frame * self.block_size - self.tokens_per_frame

    @property
    def itemsize(self) -> int:
        """Bytes per stored element."""
        return dtype_itemsize(self.dtype)

    @property
    def page_bytes_per_layer(self) -> int:
        """Bytes of one page in one layer, K and V (vLLM's ``page_size_bytes``)."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all layers, K and V (the seed's "all-layer page")."""
        return self.page_bytes_per_layer * self.num_layers

    @property
    def frame_bytes(self) -> int:
        """Bytes one frame occupies in the pool, padding included, all layers, K and V."""
        return self.pages_per_frame * self.page_bytes


@dataclasses.dataclass(frozen=True)
class WindowPolicy:
    """Which frames attention sees and which the cache keeps.

    Attributes:
      window_frames: recent frames kept after a commit, the current frames counting inside the window
        when attending (the seed's ``window_chunks``). Must be positive: an unbounded window is refused.
      sink_frames: leading frames never evicted (the attention sink, the seed's ``sink_chunks``).
      reset_at_boundary: the seed's reset mode: every commit evicts everything after the sink,
        including the frame just committed.
    """

    window_frames: int
    sink_frames: int = 0
    reset_at_boundary: bool = False

    def __post_init__(self):
        if self.window_frames is None:
            raise ValueError("Phase 1 requires a bounded window (window_chunks)")
        if not isinstance(self.window_frames, (int, np.integer)) or self.window_frames <= 0:
            raise ValueError(
                f"ARDiffusionKVConfig.window_chunks must be positive, got {self.window_frames!r}"
            )
        if not isinstance(self.sink_frames, (int, np.integer)) or self.sink_frames < 0:
            raise ValueError(
                f"ARDiffusionKVConfig.sink_chunks must be non-negative, got {self.sink_frames!r}"
            )
        object.__setattr__(self, "reset_at_boundary", bool(self.reset_at_boundary))

    @property
    def resident_frames(self) -> int:
        """Frames a session holds between chunks: sink plus window."""
        return self.sink_frames + self.window_frames


@dataclasses.dataclass(frozen=True)
class KVBranch:
    """A logical KV branch (e.g. CFG ``"positive"``/``"negative"``, or ``"main"``).

    ``local_index`` is the worker-local storage slot used for scratch pages and in-flight sizing; two
    logical branches may share one when at most one of them runs on a device (CFG-parallel).
    """

    name: str
    local_index: int = 0

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("AR-Diffusion KV branch names must be non-empty")
        if not isinstance(self.local_index, (int, np.integer)) or self.local_index < 0:
            raise ValueError(
                f"AR-Diffusion KV branch local_index must be non-negative, got {self.local_index}"
            )


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
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("AR-Diffusion cross-attention names must be non-empty")
        if not isinstance(self.num_tokens, (int, np.integer)) or self.num_tokens <= 0:
            raise ValueError(
                f"AR-Diffusion cross-attention num_tokens must be positive, got {self.num_tokens!r}"
            )
        if self.num_kv_heads is not None:
            _require_positive("cross-attention num_kv_heads", self.num_kv_heads)


def validate_branches(branches: Iterable[KVBranch], owner: str = "ARDiffusionKVCache") -> tuple[KVBranch, ...]:
    """Checks a branch list as the seed does and returns it as a tuple.

    Raises:
      ValueError: no branch, duplicate names, or local indices not contiguous from zero.
    """
    branches = tuple(branches)
    if not branches:
        raise ValueError(f"{owner} requires at least one KV branch")
    names = [b.name for b in branches]
    if len(names) != len(set(names)):
        raise ValueError(f"{owner} KV branch names must be unique, got {names}")
    indices = {b.local_index for b in branches}
    if indices != set(range(max(indices) + 1)):
        raise ValueError(
            f"{owner} KV branch local_index values must be contiguous from zero, got {sorted(indices)}"
        )
    return branches


def num_local_branches(branches: Sequence[KVBranch]) -> int:
    """Worker-local branch slots: ``max(local_index) + 1``."""
    return max(b.local_index for b in branches) + 1


def validate_cross_attention(specs: Iterable[CrossAttentionSpec]) -> tuple[CrossAttentionSpec, ...]:
    """Checks that cross-attention cache names are unique; returns the specs as a tuple."""
    specs = tuple(specs)
    names = [s.name for s in specs]
    if len(names) != len(set(names)):
        raise ValueError(f"AR-Diffusion cross-attention names must be unique, got {names}")
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
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"mesh axis {name!r} must be a positive int, got {value!r}")


def check_divisible(what: str, value: int, axis: str, size: int) -> None:
    """Checks that ``value`` (described as ``what``) splits evenly over a mesh axis.

    Raises:
      ValueError: ``value % size != 0``, naming the allowed axis sizes.
    """
    if value % size:
        raise ValueError(
            f"{what}={value} must be divisible by the mesh axis {axis!r} of size {size}; allowed "
            f"{axis!r} sizes for {what}={value}: {divisors(value)}")


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative integers."""
    return -(-a // b)


def lookup(mapping: Mapping, key, what: str):
    """``mapping[key]``, or a ``KeyError`` in the seed's words: ``Unknown AR-Diffusion {what}
    {key!r}; expected {tuple(mapping)}``."""
    try:
        return mapping[key]
    except KeyError:
        raise KeyError(f"Unknown AR-Diffusion {what} {key!r}; expected {tuple(mapping)}") from None
