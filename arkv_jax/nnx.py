"""Flax NNX attention layers over the paged KV cache, and the functional core under them.

The functional core is plain functions on arrays, usable from NNX, linen or bare JAX: Wan's 3-D
rotary positions (:func:`token_positions`, :func:`rope_tables`, :func:`apply_rope`: absolute frame,
patch-grid row and column; keys are rotated *before* they are stored, so history keys are read as
they are), a :class:`History` (``attend(q, k, v, layer, rope, qk_norm)``: the chunk's raw q and K
with their norms and tables; :class:`PagedHistory` reads the visible pages and the current chunk
through :func:`pallas_kernels.window_attention` and never writes the pool; the reference's is
:class:`arkv_jax.reference.MaskedHistory`) and dense GQA attention (:func:`masked_attention`).
The NNX modules wrap them: :class:`PagedSelfAttention` returns the output *and* the chunk's
post-RoPE K/V, which the commit forward hands to ``ChunkStep.commit``;
:class:`CachedCrossAttention` computes a session's text K/V once (``kv``) and reads them. Shapes:
``B`` rows (sessions x KV branches), ``N`` tokens of the forward (frames x tokens per frame), ``T``
text tokens, ``Hq``/``Hkv`` query/KV heads, ``D`` head dim, ``L`` layers. See ``docs/rollout.md``.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.experimental.layout import Layout, with_layout_constraint
from jax.sharding import Mesh

from arkv_jax.sharded_kernels import sharded_context_attention, sharded_window_attention
from arkv_jax.step import ChunkInputs
from pallas_kernels import window_attention
from pallas_kernels.common import target_device
from pallas_kernels.context_attention import context_attention
from pallas_kernels.context_attention.xla import attention as dense_attention
from pallas_kernels.layout import is_quantized_pool
from pallas_kernels.rope import apply_rope, inverse_rms, normalize

Array = jax.Array

# ------------------------------------------------------------------------------------------------
# Rotary positions
# ------------------------------------------------------------------------------------------------


def rope_axis_pairs(head_dim: int) -> tuple[int, int, int]:
    """Rotary pairs given to the (frame, row, column) axes: Wan's split of ``head_dim / 2`` pairs,
    ``head_dim // 6`` each to row and column and the rest to the frame (``head_dim`` 128: 22, 21, 21).

    Raises:
      ValueError: ``head_dim`` is odd or below 6 (each axis needs a pair).
    """
    if head_dim % 2 or head_dim < 6:
        raise ValueError(f"3-D RoPE needs an even head_dim >= 6, got {head_dim}")
    spatial = head_dim // 6
    return head_dim // 2 - 2 * spatial, spatial, spatial


def _rope_pair_table(head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """``(axis, inverse_frequency)`` of each rotary pair, each ``[head_dim // 2]``."""
    axes, freqs = [], []
    for axis, pairs in enumerate(rope_axis_pairs(head_dim)):
        axes.append(np.full(pairs, axis, np.int32))
        freqs.append(theta ** (-np.arange(pairs, dtype=np.float64) / pairs))
    return np.concatenate(axes), np.concatenate(freqs).astype(np.float32)


def token_positions(first_frame: Array, num_frames: int, grid: tuple[int, int]) -> Array:
    """int32 ``[B, num_frames * rows * columns, 3]``: (absolute frame, row, column) of every token
    of ``num_frames`` frames starting at ``first_frame`` (``[B]``), frame after frame, row-major."""
    rows, cols = grid
    f, r, c = np.meshgrid(np.arange(num_frames), np.arange(rows), np.arange(cols), indexing="ij")
    local = np.stack([f.ravel(), r.ravel(), c.ravel()], axis=-1).astype(np.int32)
    offset = jnp.stack([first_frame.astype(jnp.int32), jnp.zeros_like(first_frame, jnp.int32),
                        jnp.zeros_like(first_frame, jnp.int32)], axis=-1)
    return jnp.asarray(local)[None] + offset[:, None, :]


def rope_tables(positions: Array, head_dim: int, theta: float = 10000.0) -> tuple[Array, Array]:
    """``(cos, sin)``, each float32 ``[B, N, head_dim]``, for ``positions`` int ``[B, N, 3]``: the
    angle of each feature's rotary pair (both features of a pair carry it).

    Each axis has its own frequencies ``theta ** (-2 i / axis_dims)``; the angles are computed from
    the positions, so there is no table and no cap on the frame index. A forward computes them once
    for all its layers: per feature, so that no layer widens per-pair tables (XLA:TPU materialized
    that widening, a ``[N, D / 2, 2]`` array, in every layer).
    """
    axis, freq = (np.repeat(t, 2) for t in _rope_pair_table(head_dim, theta))
    angles = positions[..., axis].astype(jnp.float32) * freq
    return jnp.cos(angles), jnp.sin(angles)


# ------------------------------------------------------------------------------------------------
# Attention and histories
# ------------------------------------------------------------------------------------------------


def masked_attention(q: Array, k: Array, v: Array, mask: Array | None = None) -> Array:
    """Softmax attention of ``q`` ``[B, Nq, Hq, D]`` over ``k``/``v`` ``[B, Nk, Hkv, D]``.

    GQA: query head ``h`` reads KV head ``h // (Hq // Hkv)``. ``mask`` (bool ``[B, Nq, Nk]``, True =
    visible) removes keys by selection; a query with no visible key gets a uniform (finite) average.
    Logits and softmax in float32, scale ``D ** -0.5``; returns ``[B, Nq, Hq, D]`` in ``q``'s dtype
    (:func:`pallas_kernels.context_attention.xla.attention`).
    """
    return dense_attention(q, k, v, mask)


class History(Protocol):
    """Where a self-attention layer's keys come from besides the current tokens, and which kernels
    a forward's attention runs on."""

    def attend(self, q: Array, k: Array, v: Array, layer: Array,
               rope: tuple[Array, Array] | None = None,
               qk_norm: tuple[Array, Array, Array, Array] | None = None) -> Array:
        """Attention output ``[B, N, Hq, D]`` of the current tokens' ``q`` (``[B, N, Hq, D]``) over
        the history of pool layer ``layer`` (int scalar, may be traced) and the current ``k``/``v``
        (``[B, N, Hkv, D]``). ``q`` and ``k`` are as attended, or, with ``qk_norm``
        (``(q_inv_rms, k_inv_rms, q_gain, k_gain)``) and/or ``rope`` (``(cos, sin)`` of
        :func:`rope_tables`), before those: normalized, then rotated
        (:func:`pallas_kernels.rope.prepare_qk`; a kernel may do it as it reads them). History
        keys are stored prepared."""

    def attend_context(self, q: Array, k: Array, v: Array) -> Array:
        """Attention output ``[B, N, Hq, D]`` of ``q`` over every token of a cached context
        ``k``/``v`` ``[B, T, Hkv, D]`` (cross-attention), all three in one dtype, the output's."""


@struct.dataclass
class PagedHistory:
    """The visible pages of each row plus the current chunk, read through ``window_attention``.

    Attributes:
      k_pool, v_pool: the cache's pools (:func:`pallas_kernels.layout.pool_shape`, read only).
      pages: int32 ``[B, (sink + window) * pages_per_frame]`` visible history pages.
      lengths: int32 ``[B]`` valid history tokens.
      tokens_per_frame: tokens per frame (static).
      backend: kernel backend name (static), see :mod:`pallas_kernels.backend`.
      mesh: the cache's mesh (static), or ``None``: with a mesh, attention runs on every device's
        rows and heads through :func:`arkv_jax.sharded_kernels.sharded_window_attention`.
    """

    k_pool: Array
    v_pool: Array
    pages: Array
    lengths: Array
    tokens_per_frame: int = struct.field(pytree_node=False)
    backend: str = struct.field(pytree_node=False, default="auto")
    mesh: Mesh | None = struct.field(pytree_node=False, default=None)

    @classmethod
    def from_inputs(cls, pools: tuple[Array, Array], inputs: ChunkInputs, tokens_per_frame: int,
                    backend: str = "auto", mesh: Mesh | None = None) -> "PagedHistory":
        """The history of a chunk: ``pools`` from ``PagedKVCache.pools``, ``inputs`` from
        ``step.inputs``, ``mesh`` from ``PagedKVCache.mesh``."""
        return cls(pools[0], pools[1], inputs.pages, inputs.lengths, tokens_per_frame, backend, mesh)

    def attend(self, q: Array, k: Array, v: Array, layer: Array,
               rope: tuple[Array, Array] | None = None,
               qk_norm: tuple[Array, Array, Array, Array] | None = None) -> Array:
        """See :class:`History`; ``q``/``k``/``v`` are cast to the pool dtype for the kernel (kept in
        ``q``'s dtype over quantized pools, which the kernel dequantizes to it); ``rope`` and
        ``qk_norm`` go to the kernel (``window_attention``'s)."""
        dtype = q.dtype if is_quantized_pool(self.k_pool) else self.k_pool.dtype
        args = (q.astype(dtype), k.astype(dtype), v.astype(dtype), self.k_pool, self.v_pool, self.pages,
                self.lengths)
        kw = dict(layer=layer, tokens_per_frame=self.tokens_per_frame, backend=self.backend, rope=rope,
                  qk_norm=qk_norm)
        if self.mesh is None:
            out = window_attention(*args, **kw)
        else:
            out = sharded_window_attention(self.mesh, *args, **kw)
        return out.astype(q.dtype)

    def attend_context(self, q: Array, k: Array, v: Array) -> Array:
        """See :class:`History`: :func:`pallas_kernels.context_attention.context_attention` on
        :attr:`backend` (per device with a mesh)."""
        if self.mesh is None:
            return context_attention(q, k, v, backend=self.backend)
        return sharded_context_attention(self.mesh, q, k, v, backend=self.backend)


# ------------------------------------------------------------------------------------------------
# NNX modules
# ------------------------------------------------------------------------------------------------


class _HeadProjections(nnx.Module):
    """The q/k/v/o projections and optional QK RMSNorm both attention layers share: queries from
    ``dim``-wide tokens, keys and values from ``context_dim``-wide ones, ``num_kv_heads`` heads of
    ``dim // num_heads``.

    Raises:
      ValueError: ``dim`` not a multiple of ``num_heads``, or ``num_heads`` of ``num_kv_heads``.
    """

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, *, context_dim: int, qk_norm: bool,
                 eps: float, dtype, param_dtype, rngs: nnx.Rngs):
        if dim % num_heads or num_heads % num_kv_heads:
            raise ValueError(f"dim={dim} must be a multiple of num_heads={num_heads}, itself a multiple of "
                             f"num_kv_heads={num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, dim // num_heads
        kv_dim = num_kv_heads * self.head_dim
        linear = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q = nnx.Linear(dim, dim, **linear)
        self.k = nnx.Linear(context_dim, kv_dim, **linear)
        self.v = nnx.Linear(context_dim, kv_dim, **linear)
        self.o = nnx.Linear(dim, dim, **linear)
        norm = dict(epsilon=eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.norm_q = nnx.RMSNorm(dim, **norm) if qk_norm else None
        self.norm_k = nnx.RMSNorm(kv_dim, **norm) if qk_norm else None


class PagedSelfAttention(_HeadProjections):
    """Self-attention of a chunk over its history (paged pools in production) and itself.

    Wan's layout: q/k/v/o projections, RMSNorm over all heads of q and of k, 3-D RoPE on q and k.

    Args:
      dim: model width.
      num_heads, num_kv_heads: query and K/V heads (GQA when fewer K/V heads); ``dim`` is a multiple
        of ``num_heads`` and head dim is ``dim // num_heads``.
      qk_norm: RMSNorm on q and k before RoPE.
      eps: norm epsilon.
      dtype, param_dtype: compute and parameter dtypes.
    """

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, *, qk_norm: bool = True,
                 eps: float = 1e-6, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        super().__init__(dim, num_heads, num_kv_heads, context_dim=dim, qk_norm=qk_norm, eps=eps, dtype=dtype,
                         param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: Array, rope: tuple[Array, Array], history: History, layer: Array
                 ) -> tuple[Array, tuple[Array, Array]]:
        """Attends ``x`` ``[B, N, dim]`` over ``history`` and itself.

        Args:
          rope: ``(cos, sin)`` of the tokens' absolute positions (:func:`rope_tables`).
          history: e.g. a :class:`PagedHistory`.
          layer: int scalar (may be traced): the pool layer of this block.

        Returns:
          ``(out [B, N, dim], (k, v))`` with ``k``/``v`` ``[B, N, Hkv, D]``, ``k`` post-RoPE: what
          the commit forward writes to the pool.
        """
        attention, kv = self.attend(x, rope, history, layer)
        return self.o(attention), kv

    def attend(self, x: Array, rope: tuple[Array, Array], history: History, layer: Array
               ) -> tuple[Array, tuple[Array, Array]]:
        """:meth:`__call__` without the output projection: ``(attention [B, N, dim], (k, v))``, the
        heads' outputs concatenated (for a caller that projects them itself, as
        :func:`pallas_kernels.cross_query.cross_query` does)."""
        batch, n, _ = x.shape
        q = _row_major_on_tpu(self.q(x))
        k, v = self._projected_kv(x)
        k_inv_rms, qk_norm = self._k_inv_rms(k), None
        if self.norm_q is not None:
            qk_norm = (inverse_rms(q, self.norm_q.epsilon), k_inv_rms, self.norm_q.scale[...],
                       self.norm_k.scale[...])
        q = q.reshape(batch, n, self.num_heads, self.head_dim)
        out = history.attend(q, k, v, layer, rope, qk_norm)
        return out.reshape(batch, n, -1), (self._prepared_k(k, k_inv_rms, rope), v)

    def attend_normed(self, q: Array, k: Array, v: Array, rope: tuple[Array, Array], history: History,
                      layer: Array) -> tuple[Array, tuple[Array, Array]]:
        """:meth:`attend` from the projections on: ``q`` ``[B, N, dim]`` and ``k``/``v`` ``[B, N,
        Hkv * D]``, ``q`` and ``k`` already through the layer's QK norm where it has one (as
        :func:`pallas_kernels.qkv_projection.qkv_projection` gives them), rotated here."""
        batch, n, _ = q.shape
        split = (batch, n, self.num_kv_heads, self.head_dim)
        q = q.reshape(batch, n, self.num_heads, self.head_dim)
        k, v = k.reshape(split), v.reshape(split)
        out = history.attend(q, k, v, layer, rope)
        return out.reshape(batch, n, -1), (apply_rope(k, rope), v)

    def kv(self, x: Array, rope: tuple[Array, Array]) -> tuple[Array, Array]:
        """``(k, v)``, each ``[B, N, Hkv, D]`` (``k`` normed and post-RoPE), of ``x`` ``[B, N, dim]``:
        what :meth:`__call__` returns, without the attention."""
        k, v = self._projected_kv(x)
        return self._prepared_k(k, self._k_inv_rms(k), rope), v

    def _projected_kv(self, x: Array) -> tuple[Array, Array]:
        """The raw projections ``(k, v)`` ``[B, N, Hkv, D]`` of ``x``."""
        split = (*x.shape[:2], self.num_kv_heads, self.head_dim)
        return _row_major_on_tpu(self.k(x)).reshape(split), _row_major_on_tpu(self.v(x)).reshape(split)

    def _k_inv_rms(self, k: Array) -> Array | None:
        """The inverse RMS ``[B, N]`` of the raw keys ``k`` ``[B, N, Hkv, D]`` (over all heads), or
        ``None`` where the layer has no QK norm."""
        if self.norm_k is None:
            return None
        return inverse_rms(k.reshape(*k.shape[:2], -1), self.norm_k.epsilon)

    def _prepared_k(self, k: Array, k_inv_rms: Array | None, rope: tuple[Array, Array]) -> Array:
        """The raw keys ``k`` normed by ``k_inv_rms`` (:meth:`_k_inv_rms`, where the layer has the QK
        norm) and rotated: as stored."""
        if self.norm_k is not None:
            k = normalize(k, k_inv_rms, self.norm_k.scale[...])
        return apply_rope(k, rope)


def _row_major_on_tpu(x: Array) -> Array:
    """A q, k or v projection ``x`` pinned to its row-major layout when the program is built for a
    TPU, as the attention kernel reads it: a v5e's XLA otherwise lays V out head-major, and q and
    K token-minor around their norms, and relays each out twice a layer-forward
    (``docs/kernels.md``). Other platforms take ``x`` as it is."""
    if target_device().platform != "tpu":
        return x
    return with_layout_constraint(x, Layout(major_to_minor=tuple(range(x.ndim))))


class CachedCrossAttention(_HeadProjections):
    """Cross-attention over a session's cached context K/V (e.g. text).

    ``kv(context)`` computes the K/V once per session and branch (they go into the cache's
    cross-attention store); ``__call__`` projects the queries and reads them.

    Args:
      dim: model width (queries).
      num_heads, num_kv_heads: query and K/V heads.
      context_dim: width of the context tokens (defaults to ``dim``).
      qk_norm, eps, dtype, param_dtype: as :class:`PagedSelfAttention`.
    """

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, *, context_dim: int | None = None,
                 qk_norm: bool = True, eps: float = 1e-6, dtype=jnp.float32, param_dtype=jnp.float32,
                 rngs: nnx.Rngs):
        super().__init__(dim, num_heads, num_kv_heads, context_dim=context_dim or dim, qk_norm=qk_norm, eps=eps,
                         dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def kv(self, context: Array) -> tuple[Array, Array]:
        """``(k, v)``, each ``[B, T, Hkv, D]``, of ``context`` ``[B, T, context_dim]``."""
        batch, t, _ = context.shape
        k = self.k(context)
        if self.norm_k is not None:
            k = self.norm_k(k)
        shape = (batch, t, self.num_kv_heads, self.head_dim)
        return k.reshape(shape), self.v(context).reshape(shape)

    def __call__(self, x: Array, k: Array, v: Array, history: History | None = None) -> Array:
        """``[B, N, dim]``: ``x`` ``[B, N, dim]`` attending to all of ``k``/``v`` ``[B, T, Hkv, D]``,
        through ``history``'s :meth:`~History.attend_context` (default plain XLA)."""
        q = self.q(x)
        if self.norm_q is not None:
            q = self.norm_q(q)
        return self.attend(q, k, v, history)

    def attend(self, q: Array, k: Array, v: Array, history: History | None = None) -> Array:
        """:meth:`__call__` from the queries on: ``q`` ``[B, N, dim]`` projected and normed (as
        :func:`pallas_kernels.cross_query.cross_query` gives them) attending to ``k``/``v``, then
        the output projection; without it, :meth:`attend_heads`."""
        return self.o(self.attend_heads(q, k, v, history))

    def attend_heads(self, q: Array, k: Array, v: Array, history: History | None = None) -> Array:
        """:meth:`attend` before the output projection: the heads' outputs ``[B, N, dim]``
        concatenated (for a caller that projects them itself, as
        :func:`pallas_kernels.adaln_mlp.adaln_mlp`'s ``residual_input`` does)."""
        batch, n, dim = q.shape
        q = q.reshape(batch, n, dim // self.head_dim, self.head_dim)
        k, v = k.astype(q.dtype), v.astype(q.dtype)
        out = dense_attention(q, k, v) if history is None else history.attend_context(q, k, v)
        return out.reshape(batch, n, dim)
