"""A small but real causal video DiT (Wan-2.1 layout) that generates through the paged KV cache.

:class:`CausalDiT` is the Wan 2.1 T2V transformer: latent frames ``[B, F, H, W, C]`` are patchified,
run through ``num_layers`` blocks (adaLN-modulated self-attention over the history with 3-D RoPE at
absolute positions, cross-attention over the session's cached text K/V, a GELU MLP) and projected
back; timesteps are per frame (``[B, F]``), and the commit forward also returns every layer's K/V
for ``ChunkStep.commit``. Weights are random (:func:`init_random`, drawn on the host) or a real
checkpoint's (:func:`arkv_jax.models.loader.load_wan`; the key map is :mod:`arkv_jax.models.convert`);
:data:`MODEL_CONFIGS` has the ``tiny`` shape and Wan-2.1-T2V-1.3B's. :func:`prompt_embedding` is a
hash stand-in for the text encoder, :attr:`DiTConfig.precision` keeps a bfloat16 model's float32
islands, and :func:`tensor_parallel_specs` lays the weights out over a ``"model"`` mesh axis. See
``docs/models.md``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from arkv_jax import nnx as layers
from arkv_jax.config import CacheGeometry, CrossAttentionSpec, require_int
from arkv_jax.models import io
from pallas_kernels.adaln_mlp import adaln_mlp
from pallas_kernels.adaln_mlp.xla import modulated_input, per_token
from pallas_kernels.backend import resolve_backend
from pallas_kernels.cross_query import cross_query
from pallas_kernels.qkv_projection import qkv_projection

Array = jax.Array

#: Values of :attr:`DiTConfig.precision`.
PRECISIONS = ("mixed", "uniform")


@dataclasses.dataclass(frozen=True)
class DiTConfig:
    """Shape of a :class:`CausalDiT`.

    Attributes:
      num_layers: blocks (each keeps K/V in one pool layer).
      dim: model width; head dim is ``dim // num_heads``.
      num_heads, num_kv_heads: query and K/V heads of self- and cross-attention.
      ffn_dim: MLP hidden width.
      in_channels: latent channels (Wan's VAE: 16).
      patch_size: spatial patch side in latent pixels (one frame per temporal patch).
      grid: ``(rows, columns)`` tokens per frame; a latent frame is ``rows * patch_size`` by
        ``columns * patch_size``.
      text_dim: width of the text encoder's tokens (umT5-XXL: 4096).
      text_tokens: text tokens per prompt (the cache's cross-attention ``num_tokens``).
      freq_dim: sinusoidal timestep features.
      rope_theta: RoPE base.
      eps: norm epsilon.
      dtype: parameter and compute dtype name of the matmuls (linear layers, attention, FFN).
      precision: ``"mixed"`` (default): Wan's reference policy: the time embedding and
        projection, the modulation tables, the layer norms (with the cross-attention norm's affine
        parameters) and the residual stream stay in float32 whatever ``dtype`` is, as its
        ``autocast(float32)`` regions keep them (diffusers keeps the same modules in float32,
        ``_keep_in_fp32_modules``, but casts the residual stream back to ``dtype`` after each
        add); everything else runs in ``dtype``. ``"uniform"``:
        every parameter and activation in ``dtype`` (all-bf16: on the tiny model 0.68 % relative RMS
        from the float32 output, against 0.42 % under ``"mixed"``). With ``dtype="float32"`` both are
        the same model.
    """

    num_layers: int
    dim: int
    num_heads: int
    num_kv_heads: int
    ffn_dim: int
    in_channels: int
    patch_size: int
    grid: tuple[int, int]
    text_dim: int
    text_tokens: int
    freq_dim: int = 256
    rope_theta: float = 10000.0
    eps: float = 1e-6
    dtype: str = "float32"
    precision: str = "mixed"

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.dim % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"dim={self.dim} must be a multiple of num_heads={self.num_heads}, itself a "
                             f"multiple of num_kv_heads={self.num_kv_heads}")
        layers.rope_axis_pairs(self.head_dim)

    @property
    def island_dtype(self) -> jnp.dtype:
        """dtype of the float32 islands of :attr:`precision` (time embedding, modulation, norms,
        residual stream): float32 under ``"mixed"``, else :attr:`dtype`."""
        return jnp.dtype(jnp.float32 if self.precision == "mixed" else self.dtype)

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def tokens_per_frame(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def frame_shape(self) -> tuple[int, int, int]:
        """``(H, W, C)`` of one latent frame."""
        return self.grid[0] * self.patch_size, self.grid[1] * self.patch_size, self.in_channels

    def check_cache(self, geometry: CacheGeometry, text: CrossAttentionSpec) -> None:
        """Raises ``ValueError`` naming the first field where the cache does not fit this model."""
        expected = {"num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads,
                    "head_dim": self.head_dim, "tokens_per_frame": self.tokens_per_frame}
        for name, value in expected.items():
            if getattr(geometry, name) != value:
                raise ValueError(f"cache geometry {name}={getattr(geometry, name)} does not match the "
                                 f"model's {value}")
        text_heads = text.num_kv_heads or geometry.num_kv_heads
        if text.num_tokens != self.text_tokens or text_heads != self.num_kv_heads:
            raise ValueError(f"cross-attention cache {text.name!r} holds {text.num_tokens} tokens x "
                             f"{text_heads} heads; the model needs "
                             f"{self.text_tokens} x {self.num_kv_heads}")


#: Model shapes by preset name (the cache shapes are in :data:`arkv_jax.presets.PRESETS`): ``tiny`` for CPU
#: tests and the demo, ``wan-1.3b`` Wan-2.1-T2V-1.3B (1560 tokens per 480x832 frame, 1.4 B parameters).
MODEL_CONFIGS: dict[str, DiTConfig] = {
    "tiny": DiTConfig(num_layers=2, dim=64, num_heads=4, num_kv_heads=2, ffn_dim=128, in_channels=4,
                      patch_size=2, grid=(4, 6), text_dim=32, text_tokens=7, freq_dim=64),
    "wan-1.3b": DiTConfig(num_layers=30, dim=1536, num_heads=12, num_kv_heads=12, ffn_dim=8960,
                          in_channels=16, patch_size=2, grid=(30, 52), text_dim=4096, text_tokens=512,
                          dtype="bfloat16"),
}


def prompt_embedding(prompt: str, num_tokens: int, text_dim: int) -> np.ndarray:
    """Stand-in text encoder: float32 ``[num_tokens, text_dim]``, one unit-variance vector per word
    (seeded by the word's SHA-256), zeros past the last word (so ``""`` gives all zeros).
    Deterministic across processes and machines."""
    out = np.zeros((num_tokens, text_dim), np.float32)
    for i, word in enumerate(prompt.lower().split()[:num_tokens]):
        seed = int.from_bytes(hashlib.sha256(word.encode()).digest()[:8], "little")
        out[i] = np.random.default_rng(seed).standard_normal(text_dim)
    return out


def timestep_features(t: Array, dim: int) -> Array:
    """float32 ``[..., dim]`` sinusoidal features of timesteps ``t`` (``[...]``, in ``[0, 1000]``):
    ``[cos(t w_i), sin(t w_i)]`` with ``w_i = 10000 ** (-i / (dim / 2))``."""
    half = dim // 2
    freqs = jnp.asarray(10000.0 ** (-np.arange(half) / half), jnp.float32)
    angles = t.astype(jnp.float32)[..., None] * freqs
    return jnp.concatenate([jnp.cos(angles), jnp.sin(angles)], axis=-1)


def patchify(latents: Array, patch: int) -> Array:
    """``[B, F, H, W, C]`` -> ``[B, F * (H/p) * (W/p), p * p * C]``, frame after frame, row-major."""
    b, f, h, w, c = latents.shape
    x = latents.reshape(b, f, h // patch, patch, w // patch, patch, c)
    return x.transpose(0, 1, 2, 4, 3, 5, 6).reshape(b, f * (h // patch) * (w // patch), patch * patch * c)


def unpatchify(tokens: Array, num_frames: int, grid: tuple[int, int], patch: int) -> Array:
    """Inverse of :func:`patchify`: ``[B, F * rows * cols, p * p * C]`` -> ``[B, F, H, W, C]``."""
    b = tokens.shape[0]
    rows, cols = grid
    x = tokens.reshape(b, num_frames, rows, cols, patch, patch, -1)
    return x.transpose(0, 1, 2, 4, 3, 5, 6).reshape(b, num_frames, rows * patch, cols * patch, -1)


def kernel_backend(history: layers.History) -> str:
    """The backend of a block's fused steps (:func:`pallas_kernels.qkv_projection.qkv_projection`,
    :func:`pallas_kernels.cross_query.cross_query` and :func:`pallas_kernels.adaln_mlp.adaln_mlp`):
    the history's TPU backend without a mesh, where the Mosaic kernels keep a block of tokens in
    VMEM through their products and run near the MXU's peak while XLA:TPU's fusions do not
    (``docs/kernels.md``, the DiT block's kernels); ``"xla"`` everywhere else."""
    backend = getattr(history, "backend", "xla")
    if getattr(history, "mesh", None) is None and resolve_backend(backend).kind == "pallas_tpu":
        return backend
    return "xla"


class BlockStacks(NamedTuple):
    """What a block reads from every block's parameters, stacked over the layers
    (:meth:`CausalDiT.stacks`): a kernel given a stack reads the layer's slice where it lies, so no
    slice is copied out of it.

    Attributes:
      mlp: ``(w_in [L, dim, ffn_dim], b_in [L, ffn_dim], w_out [L, ffn_dim, dim], b_out [L, dim])``,
        the FFN weights as :func:`pallas_kernels.adaln_mlp.adaln_mlp` takes them.
      modulation: ``[L, 6, dim]`` every block's learned modulation offsets.
      cross_query: self-attention's output projection, the cross-attention norm's scale and bias,
        its query projection and RMS-norm gain (``w_o, b_o, norm_scale, norm_bias, w_q, b_q,
        q_gain``), as :func:`pallas_kernels.cross_query.cross_query` takes them.
      qkv: self-attention's projections and QK-norm gains (``w_q, b_q, q_gain, w_k, b_k, k_gain,
        w_v, b_v``), as :func:`pallas_kernels.qkv_projection.qkv_projection` takes them.
      cross_output: the cross-attention's output projection ``(w [L, dim, dim], b [L, dim])``, as
        :func:`pallas_kernels.adaln_mlp.adaln_mlp`'s ``residual_input`` takes it.
    """

    mlp: tuple[Array, Array, Array, Array]
    modulation: Array
    cross_query: tuple[Array, Array, Array, Array, Array, Array, Array]
    qkv: tuple[Array, Array, Array, Array, Array, Array, Array, Array]
    cross_output: tuple[Array, Array]

    def modulation_of(self, time_mod: Array, layer: Array) -> list[Array]:
        """``shift, scale, gate`` of block ``layer``'s self-attention, then of its MLP, each ``[B, F,
        dim]``: the timestep projection ``time_mod`` ``[B, F, 6, dim]`` plus the block's learned
        offsets; past the last block, the last block's."""
        offsets = self.modulation[jnp.minimum(layer, self.modulation.shape[0] - 1)]
        return jnp.unstack(time_mod + offsets, axis=2)


class DiTBlock(nnx.Module):
    """One Wan block: modulated self-attention, cross-attention on cached text K/V, modulated MLP.

    A block takes its self-attention input already normalized and modulated, and hands the next
    block its own (:meth:`__call__`), so that on a TPU the MLP's kernel writes it from the
    residual it has just computed (``docs/planning.md``, What is left on a v6e)."""

    def __init__(self, config: DiTConfig, *, rngs: nnx.Rngs):
        dtype, island = jnp.dtype(config.dtype), config.island_dtype
        kw = dict(dtype=dtype, param_dtype=dtype)
        dim = config.dim
        self.self_attn = layers.PagedSelfAttention(dim, config.num_heads, config.num_kv_heads, eps=config.eps,
                                                   rngs=rngs, **kw)
        self.norm3 = nnx.LayerNorm(dim, epsilon=config.eps, dtype=island, param_dtype=island, rngs=rngs)
        self.cross_attn = layers.CachedCrossAttention(dim, config.num_heads, config.num_kv_heads,
                                                      eps=config.eps, rngs=rngs, **kw)
        self.ffn_in = nnx.Linear(dim, config.ffn_dim, rngs=rngs, **kw)
        self.ffn_out = nnx.Linear(config.ffn_dim, dim, rngs=rngs, **kw)
        self.eps = config.eps
        self.modulation = nnx.Param(
            (jax.random.normal(rngs.params(), (6, dim)) / math.sqrt(dim)).astype(island))

    def __call__(self, x: Array, attention_input: Array, time_mod: Array, rope: tuple[Array, Array],
                 history: layers.History, text_k: Array, text_v: Array, layer: Array, stacks: BlockStacks
                 ) -> tuple[Array, Array, tuple[Array, Array]]:
        """One block on ``x`` ``[B, F * tpf, dim]``.

        Under the ``"mixed"`` precision ``x``, ``time_mod`` and the norms are float32 and each
        linear layer casts its input to the matmul dtype (its output comes back in that dtype and
        is added to the float32 residual after the gate).

        Args:
          attention_input: ``[B, F * tpf, dim]`` in the matmul dtype: ``x`` layer-normalized and
            modulated by this block's self-attention shift and scale
            (:meth:`CausalDiT.attention_input`, or the previous block's output).
          time_mod: ``[B, F, 6, dim]`` the timestep projection (shared by all blocks).
          rope: ``(cos, sin)`` of the tokens' positions.
          history: where self-attention's keys come from (and which kernels cross-attention runs on).
          text_k, text_v: ``[B, T, Hkv, D]`` this layer's text K/V.
          layer: int32 scalar, this block's pool layer and its index in the stacks.
          stacks: what the block's kernels read of every block (:class:`BlockStacks`; the q/k/v
            projection, the cross query and the MLP read layer ``layer``'s slices).

        Returns:
          ``(x, next_attention_input, (k, v))``: the new tokens, their self-attention input for
          block ``layer + 1`` (for the last block, under its own modulation; unused) and this
          layer's post-RoPE K/V ``[B, N, Hkv, D]``.
        """
        _, _, gate_sa, shift_ff, scale_ff, gate_ff = stacks.modulation_of(time_mod, layer)
        backend = kernel_backend(history)
        q, k, v = qkv_projection(attention_input, *stacks.qkv, layer, eps=self.eps, backend=backend, validate=False)
        attention, kv = self.self_attn.attend_normed(q, k, v, rope, history, layer)
        x, query = cross_query(x, attention, gate_sa, *stacks.cross_query, layer, eps=self.eps, backend=backend,
                               validate=False)
        context = self.cross_attn.attend_heads(query, text_k, text_v, history)
        x, next_input = adaln_mlp(x, shift_ff, scale_ff, gate_ff, *stacks.mlp, layer,
                                  next_modulation=stacks.modulation_of(time_mod, layer + 1)[:2],
                                  residual_input=(context, *stacks.cross_output), eps=self.eps, backend=backend,
                                  validate=False)
        return x, next_input, kv


class CausalDiT(nnx.Module):
    """Chunk-wise causal video DiT (Wan 2.1 T2V) whose self-attention reads the paged KV cache.

    Latent frames ``[B, F, H, W, C]`` are cut into ``patch_size x patch_size`` patches (one token per
    patch, ``grid = (H / p, W / p)`` tokens per frame) and embedded; ``num_layers`` :class:`DiTBlock`
    follow, each with adaLN modulation from the frame's timestep (``shift, scale, gate`` for
    self-attention and MLP: a shared projection of the timestep embedding plus a learned per-block
    offset), self-attention over the history (:class:`arkv_jax.nnx.PagedSelfAttention`, 3-D RoPE at
    absolute positions, QK RMSNorm), cross-attention over the session's cached text K/V
    (:class:`arkv_jax.nnx.CachedCrossAttention`) and a GELU MLP; a modulated head projects back to
    patches. The blocks are stacked (``nnx.vmap`` at creation) and applied with ``jax.lax.scan`` over
    their split state (``nnx.split``/``nnx.merge`` per step, which works at any trace depth, e.g.
    inside a sampler's ``fori_loop``), the layer index riding along as a traced value, so a model
    compiles one block whatever its depth. Timesteps are per frame (``[B, F]``, in ``[0, 1000]``),
    which lets the full-recompute reference run clean history frames at ``t = 0`` beside a noisy
    chunk.

    Args:
      config: the model shape.
      rngs: parameter initialisation.
    """

    def __init__(self, config: DiTConfig, *, rngs: nnx.Rngs):
        self.config = config
        dtype, island = jnp.dtype(config.dtype), config.island_dtype
        kw = dict(dtype=dtype, param_dtype=dtype)
        fp32 = dict(dtype=island, param_dtype=island)
        dim, p = config.dim, config.patch_size
        self.patch_embedding = nnx.Linear(p * p * config.in_channels, dim, rngs=rngs, **kw)
        self.text_in = nnx.Linear(config.text_dim, dim, rngs=rngs, **kw)
        self.text_out = nnx.Linear(dim, dim, rngs=rngs, **kw)
        self.time_in = nnx.Linear(config.freq_dim, dim, rngs=rngs, **fp32)
        self.time_out = nnx.Linear(dim, dim, rngs=rngs, **fp32)
        self.time_projection = nnx.Linear(dim, 6 * dim, rngs=rngs, **fp32)

        @nnx.split_rngs(splits=config.num_layers)
        @nnx.vmap(in_axes=0, out_axes=0)
        def make_blocks(rngs: nnx.Rngs) -> DiTBlock:
            return DiTBlock(config, rngs=rngs)

        self.blocks = make_blocks(rngs)
        self.head = nnx.Linear(dim, p * p * config.in_channels, rngs=rngs, **kw)
        self.head_modulation = nnx.Param(
            (jax.random.normal(rngs.params(), (2, dim)) / math.sqrt(dim)).astype(island))

    def text_kv(self, context: Array) -> tuple[Array, Array]:
        """Per-layer text K/V of ``context`` float ``[B, T, text_dim]`` (from
        :func:`prompt_embedding`): ``(k, v)``, each ``[L, B, T, Hkv, D]``."""
        x = self.text_in(context.astype(self.config.dtype))
        x = self.text_out(jax.nn.gelu(x, approximate=True))
        graphdef, stacked = nnx.split(self.blocks)
        return jax.vmap(lambda state: nnx.merge(graphdef, state).cross_attn.kv(x))(stacked)

    def __call__(self, latents: Array, timesteps: Array, first_frame: Array, history: layers.History,
                 text_k: Array, text_v: Array) -> Array:
        """The velocity ``[B, F, H, W, C]`` (model dtype) of ``latents`` ``[B, F, H, W, C]`` at per-frame
        ``timesteps`` ``[B, F]``.

        Args:
          first_frame: int32 ``[B]`` absolute index of each row's first frame (RoPE positions).
          history: where self-attention's keys come from (:class:`arkv_jax.nnx.PagedHistory`, ...).
          text_k, text_v: ``[L, B, T, Hkv, D]`` the rows' text K/V.
        """
        config = self.config
        x, t_emb, time_mod, rope = self._embed(latents, timesteps, first_frame)
        graphdef, stacked = nnx.split(self.blocks)
        stacks = self.stacks()

        def run_block(carry, layer_inputs):
            state, layer_k, layer_v, layer = layer_inputs
            x, attention_input, _ = nnx.merge(graphdef, state)(*carry, time_mod, rope, history, layer_k, layer_v,
                                                               layer, stacks)
            return (x, attention_input), None

        layer_ids = jnp.arange(config.num_layers, dtype=jnp.int32)
        carry = (x, self.attention_input(x, time_mod, stacks, 0))
        (x, _), _ = jax.lax.scan(run_block, carry, (stacked, text_k, text_v, layer_ids))
        shift, scale = jnp.unstack(self.head_modulation[...] + t_emb[:, :, None], axis=2)
        n = x.shape[1]  # The head's norm and modulation in float32, as the reference computes them.
        out = self.head(modulated_input(x.astype(jnp.float32), per_token(shift, n), per_token(scale, n), config.eps,
                                        config.dtype))
        return unpatchify(out, latents.shape[1], config.grid, config.patch_size)

    def commit_kv(self, latents: Array, timesteps: Array, first_frame: Array, history: layers.History,
                  text_k: Array, text_v: Array) -> tuple[Array, Array]:
        """Every layer's self-attention K/V of the forward :meth:`__call__` would run (the commit
        forward): ``(k, v)``, each ``[L, B, F * tpf, Hkv, D]`` (``k`` post-RoPE), ready for
        ``ChunkStep.commit``. The last block stops at its K/V: nothing reads its attention, MLP or
        the head, so they are not computed. Arguments as for :meth:`__call__`."""
        config = self.config
        x, _, time_mod, rope = self._embed(latents, timesteps, first_frame)
        graphdef, stacked = nnx.split(self.blocks)
        stacks = self.stacks()
        last = config.num_layers - 1

        def block(layer):
            return nnx.merge(graphdef, jax.tree_util.tree_map(lambda leaf: leaf[layer], stacked))

        attention_input = self.attention_input(x, time_mod, stacks, 0)
        k_spec, v_spec = jax.eval_shape(lambda a: block(last).self_attn.kv(a, rope), attention_input)

        def run_block(layer, carry):
            x, attention_input, k_all, v_all = carry
            x, attention_input, (k, v) = block(layer)(x, attention_input, time_mod, rope, history, text_k[layer],
                                                      text_v[layer], layer, stacks)
            return (x, attention_input, *(jax.lax.dynamic_update_index_in_dim(all_, new, layer, 0)
                                          for all_, new in ((k_all, k), (v_all, v))))

        # Every layer's entry is written below (the loop's, then the last), so the buffers need no
        # zero fill: XLA:TPU would write a whole [L, ...] array of zeros first.
        k_all, v_all = (jax.lax.empty((config.num_layers, *spec.shape), spec.dtype) for spec in (k_spec, v_spec))
        _, attention_input, k_all, v_all = jax.lax.fori_loop(0, last, run_block, (x, attention_input, k_all, v_all))
        k, v = block(last).self_attn.kv(attention_input, rope)
        return k_all.at[last].set(k), v_all.at[last].set(v)

    def stacks(self) -> BlockStacks:
        """What the blocks' fused steps read of every block, stacked (:class:`BlockStacks`)."""
        blocks = self.blocks
        self_attn, norm, cross_attn = blocks.self_attn, blocks.norm3, blocks.cross_attn
        cross = (self_attn.o.kernel, self_attn.o.bias, norm.scale, norm.bias, cross_attn.q.kernel, cross_attn.q.bias,
                 cross_attn.norm_q.scale)
        qkv = (self_attn.q.kernel, self_attn.q.bias, self_attn.norm_q.scale, self_attn.k.kernel, self_attn.k.bias,
               self_attn.norm_k.scale, self_attn.v.kernel, self_attn.v.bias)
        return BlockStacks((blocks.ffn_in.kernel[...], blocks.ffn_in.bias[...], blocks.ffn_out.kernel[...],
                            blocks.ffn_out.bias[...]), blocks.modulation[...], tuple(p[...] for p in cross),
                           tuple(p[...] for p in qkv), (cross_attn.o.kernel[...], cross_attn.o.bias[...]))

    def attention_input(self, x: Array, time_mod: Array, stacks: BlockStacks, layer: int) -> Array:
        """Block ``layer``'s self-attention input of the residual stream ``x`` ``[B, N, dim]``: layer
        norm, then its modulation, in the matmul dtype
        (:func:`pallas_kernels.adaln_mlp.xla.modulated_input`, as the blocks hand it on)."""
        n = x.shape[1]
        shift, scale = stacks.modulation_of(time_mod, layer)[:2]
        return modulated_input(x, per_token(shift, n), per_token(scale, n), self.config.eps, self.config.dtype)

    def _embed(self, latents: Array, timesteps: Array, first_frame: Array
               ) -> tuple[Array, Array, Array, tuple[Array, Array]]:
        """What every block reads: ``(x, t_emb, time_mod, rope)``, the residual stream
        ``[B, F * tpf, dim]`` (island dtype), the timestep embedding ``[B, F, dim]``, its projection
        ``[B, F, 6, dim]`` and the RoPE tables of the tokens (:func:`arkv_jax.nnx.rope_tables`)."""
        config = self.config
        x = self.patch_embedding(patchify(latents.astype(config.dtype), config.patch_size))
        x = x.astype(config.island_dtype)  # the residual stream
        t_emb = self.time_out(jax.nn.silu(self.time_in(timestep_features(timesteps, config.freq_dim)
                                                       .astype(config.island_dtype))))
        time_mod = self.time_projection(jax.nn.silu(t_emb)).reshape(*timesteps.shape, 6, config.dim)
        rope = layers.rope_tables(layers.token_positions(first_frame, latents.shape[1], config.grid),
                                  config.head_dim, config.rope_theta)
        return x, t_emb, time_mod, rope


#: Tensor-parallel roles of a block's linear layers (Megatron style): column layers split their output
#: features over the ``"model"`` mesh axis (q/k/v by whole heads, the MLP's hidden units), row layers
#: their input features, so each device computes its heads and hidden units and one all-reduce per
#: row layer sums the partial outputs.
_COLUMN_LAYERS = ("q", "k", "v", "ffn_in")
_ROW_LAYERS = ("o", "ffn_out")


def tensor_parallel_specs(params: nnx.State, model_axis_size: int, axis: str = "model") -> nnx.State:
    """``PartitionSpec`` per parameter of a :class:`CausalDiT`: its blocks' attention and MLP
    weights split over ``axis`` as :data:`_COLUMN_LAYERS` / :data:`_ROW_LAYERS` say (and the q/k
    RMSNorm scales with their features); everything else replicated, as is any weight whose split
    dimension ``model_axis_size`` does not divide.

    Args:
      params: ``nnx.split(model)[1]``: the blocks' leaves carry a leading layer axis.
      model_axis_size: size of ``axis`` in the mesh.

    Raises:
      ValueError: ``model_axis_size`` is not a positive int.
    """
    require_int("model_axis_size", model_axis_size, minimum=1)

    def spec(path, leaf) -> P:
        names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
        if names[0] != "blocks":
            return P()
        layer, kind = names[-2], names[-1]
        if layer in _COLUMN_LAYERS or (layer in ("norm_q", "norm_k") and kind == "scale"):
            split = leaf.ndim - 1  # output features (kernel [L, in, out], bias/scale [L, out])
        elif layer in _ROW_LAYERS and kind == "kernel":
            split = 1  # input features of [L, in, out]
        else:
            return P()
        if leaf.shape[split] % model_axis_size:
            return P()
        return P(*[axis if d == split else None for d in range(leaf.ndim)])

    return jax.tree_util.tree_map_with_path(spec, params)


def init_random(config: DiTConfig, seed: int = 0) -> CausalDiT:
    """A :class:`CausalDiT` with random weights drawn on the host with NumPy
    (:func:`arkv_jax.models.io.init_random`: seeded, identical on every machine): Linear kernels
    ``N(0, 1 / fan_in)``, biases 0, norm scales 1, modulation offsets ``N(0, 1 / dim)`` as Wan
    initialises them. The constructor's ``nnx.Rngs`` initialisers draw nearly the same (Flax's
    LeCun normal is a truncated normal of the same variance) but are slow on XLA:CPU.
    """
    def draw(names: tuple[str, ...], shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
        if names[-1] == "bias":
            return np.zeros(shape, np.float32)
        if names[-1] == "scale":
            return np.ones(shape, np.float32)
        fan_in = shape[-2] if names[-1] == "kernel" else shape[-1]
        return rng.standard_normal(shape, np.float32) / np.float32(math.sqrt(fan_in))

    return io.init_random(CausalDiT, config, draw, seed)
