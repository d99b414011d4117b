"""The static sizes of a window-attention call and the page-list rules every backend applies.

A row's page list holds frame after frame; a frame of ``tokens_per_frame`` tokens fills
``pages_per_frame`` consecutive entries and ends in ``pages_per_frame * block_size -
tokens_per_frame`` padding slots. Page-list slot ``s`` (entry ``s // block_size``, offset
``s % block_size``) belongs to frame ``s // frame_slots`` at in-frame offset ``s % frame_slots``
and holds a valid token iff that offset is ``< tokens_per_frame`` and the token's logical position
``frame * tokens_per_frame + offset`` is ``< lengths[row]`` (``docs/kernels.md``, Paged window
attention).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.common import cdiv, pages_per_frame


@dataclasses.dataclass(frozen=True)
class WindowGeometry:
    """Static sizes of one window-attention call (hashable: a ``jit`` static argument).

    Token counts in tokens, page counts in pages, ``block_size`` in tokens per page.
    """

    rows: int
    q_len: int
    num_q_heads: int
    kv_heads: int
    head_dim: int
    cur_len: int
    num_extra: int
    num_layers: int
    num_pages: int
    block_size: int
    max_pages: int
    tokens_per_frame: int

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.num_q_heads // self.kv_heads

    @property
    def pages_per_frame(self) -> int:
        return pages_per_frame(self.tokens_per_frame, self.block_size)

    @property
    def frame_slots(self) -> int:
        """Page-list slots one frame occupies (tokens plus padding)."""
        return self.pages_per_frame * self.block_size

    @property
    def tail_len(self) -> int:
        """Current-chunk plus extra tokens: keys that are always valid."""
        return self.cur_len + self.num_extra

    @property
    def capacity(self) -> int:
        """Most history tokens the page list can hold."""
        return history_capacity(self.max_pages, self.block_size, self.tokens_per_frame)


def history_capacity(max_pages: int, block_size: int, tokens_per_frame: int) -> int:
    """Valid tokens that fit in ``max_pages`` frame-aligned pages of ``block_size`` slots."""
    full_frames, rest_pages = divmod(max_pages, pages_per_frame(tokens_per_frame, block_size))
    return full_frames * tokens_per_frame + min(rest_pages * block_size, tokens_per_frame)


def visible_page_count(lengths: jax.Array, geom: WindowGeometry) -> jax.Array:
    """int32 ``[rows]``: page-list entries up to and including the last one holding a valid
    token."""
    lengths = lengths.astype(jnp.int32)
    frames, offset = lengths // geom.tokens_per_frame, lengths % geom.tokens_per_frame
    return cdiv(frames * geom.frame_slots + offset, geom.block_size)


def history_token_slot(tokens: jax.Array, geom: WindowGeometry) -> jax.Array:
    """Page-list slot of history token ``tokens`` (non-negative int32, any shape): frame
    ``t // tokens_per_frame`` at in-frame offset ``t % tokens_per_frame``.

    Walking tokens rather than slots skips frame padding; a row's valid history tokens are then the
    prefix ``[0, lengths[row])``.
    """
    return (lax.div(tokens, geom.tokens_per_frame) * geom.frame_slots
            + lax.rem(tokens, geom.tokens_per_frame))


def history_slot_valid(slots: jax.Array, lengths: jax.Array, geom: WindowGeometry) -> jax.Array:
    """Whether page-list slot ``slots`` holds a valid token of a row of ``lengths`` history tokens.

    ``slots`` and ``lengths`` are non-negative int32 arrays that broadcast together.
    """
    frame, offset = lax.div(slots, geom.frame_slots), lax.rem(slots, geom.frame_slots)
    return (offset < geom.tokens_per_frame) & (frame * geom.tokens_per_frame + offset < lengths)


def layer_page_table(pages: jax.Array, lengths: jax.Array, layer: jax.Array,
                     geom: WindowGeometry) -> jax.Array:
    """int32 ``[rows, width]`` (``pages``' shape): page ids into the pool reshaped to
    ``[layers * pages, ...]``, i.e. ``layer * num_pages + page``.

    Entries past a row's visible pages point at the layer's null page, so no kernel reads a page the
    row does not use.
    """
    entry = jnp.arange(pages.shape[1], dtype=jnp.int32)[None, :]
    used = entry < visible_page_count(lengths, geom)[:, None]
    return jnp.where(used, pages.astype(jnp.int32), 0) + layer * geom.num_pages


def tail_kv(k_cur: jax.Array, v_cur: jax.Array, extra_k: jax.Array | None,
            extra_v: jax.Array | None, padded_len: int) -> tuple[jax.Array, jax.Array]:
    """Current chunk + extras as ``[rows, padded_len, kv_heads, head_dim]`` K and V, zero padded."""
    pad = padded_len - k_cur.shape[1] - (0 if extra_k is None else extra_k.shape[1])
    zeros = jnp.zeros((k_cur.shape[0], pad, *k_cur.shape[2:]), k_cur.dtype)
    k_parts = [k_cur] + ([] if extra_k is None else [extra_k]) + [zeros]
    v_parts = [v_cur] + ([] if extra_v is None else [extra_v]) + [zeros]
    return jnp.concatenate(k_parts, axis=1), jnp.concatenate(v_parts, axis=1)
