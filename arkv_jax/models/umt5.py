"""The umT5 text encoder Wan 2.1 conditions on, in Flax NNX, with loaders for the released weights.

Wan 2.1 encodes a prompt with the encoder half of umT5-XXL (:data:`UMT5_CONFIGS`) and keeps, per
prompt, only the real tokens' embeddings, zero-padded to ``text_len = 512`` tokens: that
``[B, 512, 4096]`` array is the ``context`` the DiT's cross-attention reads
(``Rollout.join(..., context=...)``). :class:`UMT5Encoder` is the stack (T5 v1.1 with a relative
position bias in every layer); :func:`load_umt5` reads the ``transformers`` layout or Wan's
``models_t5_umt5-xxl-enc-bf16.pth`` (renamed by :func:`convert_wan_t5_state_dict`), checked with
:mod:`arkv_jax.models.io` as every loader is; :func:`encode_prompts` tokenises as Wan does
(:func:`tokenize`, :func:`clean_prompt`, the ``transformers`` tokenizer Wan ships) and encodes. See
``docs/models.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import html
import math
import os
import re
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from arkv_jax.config import require_int
from arkv_jax.models import io

Array = jax.Array

#: Logit added for a padded key: finite, so a row with no real key cannot produce NaN.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class UMT5EncoderConfig:
    """Shape of a :class:`UMT5Encoder`.

    Attributes:
      vocab_size: token embedding rows.
      dim: model width (``d_model``).
      num_heads, head_dim: attention heads and their width (``d_kv``); ``num_heads * head_dim`` need
        not equal ``dim``.
      ffn_dim: gated-GELU hidden width (``d_ff``).
      num_layers: encoder blocks.
      num_buckets: relative-position buckets (both signs together).
      max_distance: relative distance from which all positions share the last bucket.
      eps: RMSNorm epsilon.
      text_len: tokens per prompt of the context handed to the DiT (Wan: 512).
      dtype: parameter and compute dtype name.
    """

    vocab_size: int
    dim: int
    num_heads: int
    head_dim: int
    ffn_dim: int
    num_layers: int
    num_buckets: int = 32
    max_distance: int = 128
    eps: float = 1e-6
    text_len: int = 512
    dtype: str = "float32"

    def __post_init__(self):
        for name in ("vocab_size", "dim", "num_heads", "head_dim", "ffn_dim", "num_layers", "text_len"):
            require_int(name, getattr(self, name), minimum=1)
        if self.num_buckets < 4 or self.num_buckets % 4:
            raise ValueError(f"num_buckets must be a positive multiple of 4, got {self.num_buckets}")
        if self.max_distance <= self.num_buckets // 4:
            raise ValueError(f"max_distance={self.max_distance} must exceed num_buckets / 4 = "
                             f"{self.num_buckets // 4}")

    @property
    def inner_dim(self) -> int:
        return self.num_heads * self.head_dim


#: Encoder shapes by name: ``tiny`` for CPU tests, ``umt5-xxl`` the one Wan 2.1 uses (5.7 B
#: parameters, bfloat16 as Wan ships it).
UMT5_CONFIGS: dict[str, UMT5EncoderConfig] = {
    "tiny": UMT5EncoderConfig(vocab_size=64, dim=32, num_heads=4, head_dim=8, ffn_dim=48, num_layers=2,
                              num_buckets=8, max_distance=16, text_len=16),
    "umt5-xxl": UMT5EncoderConfig(vocab_size=256384, dim=4096, num_heads=64, head_dim=64, ffn_dim=10240,
                                  num_layers=24, dtype="bfloat16"),
}


# ------------------------------------------------------------------------------------------------
# Layers
# ------------------------------------------------------------------------------------------------


def relative_position_buckets(query_len: int, key_len: int, num_buckets: int = 32,
                              max_distance: int = 128) -> np.ndarray:
    """int32 ``[query_len, key_len]``: T5's bidirectional bucket of ``key - query`` per pair.

    Half the buckets hold positive distances (keys after the query), half the others; in each half
    distances below ``num_buckets / 4`` have a bucket each and larger ones share logarithmically
    wider buckets up to ``max_distance``, the last bucket holding everything beyond. Computed on the
    host in float32, the way ``transformers`` computes it (so bucket edges round the same).
    """
    rel = np.arange(key_len, dtype=np.int64)[None, :] - np.arange(query_len, dtype=np.int64)[:, None]
    half = num_buckets // 2
    buckets = (rel > 0).astype(np.int64) * half
    rel = np.abs(rel)
    max_exact = half // 2
    ratio = (np.log(np.maximum(rel, 1).astype(np.float32) / np.float32(max_exact))
             / np.float32(math.log(max_distance / max_exact)))
    large = max_exact + (ratio * np.float32(half - max_exact)).astype(np.int64)
    large = np.minimum(large, half - 1)
    return (buckets + np.where(rel < max_exact, rel, large)).astype(np.int32)


class RMSNorm(nnx.Module):
    """T5's norm over the last axis: ``scale * x / sqrt(mean(x^2) + eps)`` (no mean, no bias),
    computed in float32 and returned in ``dtype``."""

    def __init__(self, dim: int, *, eps: float, dtype: jnp.dtype):
        self.scale = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: Array) -> Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return (self.scale[...].astype(jnp.float32) * x32).astype(self.dtype)


class UMT5Block(nnx.Module):
    """One umT5 encoder layer: self-attention with this layer's relative position bias, then the
    gated-GELU FFN, each pre-normed and residual."""

    def __init__(self, config: UMT5EncoderConfig, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(config.dtype)
        kw = dict(use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.config = config
        self.attn_norm = RMSNorm(config.dim, eps=config.eps, dtype=dtype)
        self.q = nnx.Linear(config.dim, config.inner_dim, **kw)
        self.k = nnx.Linear(config.dim, config.inner_dim, **kw)
        self.v = nnx.Linear(config.dim, config.inner_dim, **kw)
        self.o = nnx.Linear(config.inner_dim, config.dim, **kw)
        self.relative_attention_bias = nnx.Param(
            (jax.random.normal(rngs.params(), (config.num_buckets, config.num_heads))
             / math.sqrt(config.dim)).astype(dtype))
        self.ffn_norm = RMSNorm(config.dim, eps=config.eps, dtype=dtype)
        self.wi_0 = nnx.Linear(config.dim, config.ffn_dim, **kw)
        self.wi_1 = nnx.Linear(config.dim, config.ffn_dim, **kw)
        self.wo = nnx.Linear(config.ffn_dim, config.dim, **kw)

    def __call__(self, x: Array, buckets: Array, key_bias: Array) -> Array:
        """The layer on ``x`` ``[B, T, dim]``.

        Args:
          buckets: int32 ``[T, T]`` relative-position bucket of each (query, key) pair.
          key_bias: float32 ``[B, T]``, 0 for a real key and :data:`MASK_VALUE` for padding.
        """
        config = self.config
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q = self.q(h).reshape(b, t, config.num_heads, config.head_dim)
        k = self.k(h).reshape(b, t, config.num_heads, config.head_dim)
        v = self.v(h).reshape(b, t, config.num_heads, config.head_dim)
        position_bias = jnp.take(self.relative_attention_bias[...], buckets, axis=0)  # [T, T, H]
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
        logits = (logits + position_bias.transpose(2, 0, 1).astype(jnp.float32)[None]
                  + key_bias[:, None, None, :])
        weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
        attn = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, config.inner_dim)
        x = x + self.o(attn)
        h = self.ffn_norm(x)
        return x + self.wo(jax.nn.gelu(self.wi_0(h), approximate=True) * self.wi_1(h))


class UMT5Encoder(nnx.Module):
    """The umT5 encoder stack: a token embedding, ``num_layers`` :class:`UMT5Block` and a final
    :class:`RMSNorm`.

    umT5 is T5 (v1.1) with one difference that matters here: **every layer has its own relative
    position bias** (T5 computes it in the first layer and shares it). A layer is
    ``x + o(attention(q(n), k(n), v(n)) + bias)`` then ``x + wo(gelu_tanh(wi_0(n)) * wi_1(n))``, each
    with ``n = rms_norm(x)``; the bias is looked up from the layer's ``[num_buckets, heads]`` table by
    the bucket of ``key - query`` (:func:`relative_position_buckets`), the logits are **unscaled** (no
    ``1 / sqrt(head_dim)``: T5 folds it into the initialisation) and padded keys are masked. No
    linear layer has a bias; norms and the softmax run in float32 whatever the parameter dtype (as
    ``transformers`` and Wan do). The blocks are stacked (``nnx.vmap`` at creation) and applied with
    ``jax.lax.scan``, as :class:`arkv_jax.models.dit.CausalDiT` does, so the stack compiles one block.

    Args:
      config: the encoder shape.
      rngs: parameter initialisation (the loaders replace every parameter).
    """

    def __init__(self, config: UMT5EncoderConfig, *, rngs: nnx.Rngs):
        self.config = config
        dtype = jnp.dtype(config.dtype)
        self.embed = nnx.Embed(config.vocab_size, config.dim, dtype=dtype, param_dtype=dtype, rngs=rngs)

        @nnx.split_rngs(splits=config.num_layers)
        @nnx.vmap(in_axes=0, out_axes=0)
        def make_blocks(rngs: nnx.Rngs) -> UMT5Block:
            return UMT5Block(config, rngs=rngs)

        self.blocks = make_blocks(rngs)
        self.final_norm = RMSNorm(config.dim, eps=config.eps, dtype=dtype)

    def __call__(self, input_ids: Array, attention_mask: Array | None = None) -> Array:
        """Hidden states ``[B, T, dim]`` of token ids ``[B, T]`` (what ``transformers``'
        ``UMT5EncoderModel(...).last_hidden_state`` returns, padded positions included).

        Args:
          input_ids: int ``[B, T]``.
          attention_mask: ``[B, T]``, nonzero for real tokens (``None``: all real). Padded keys are
            masked out of every query's attention.
        """
        config = self.config
        b, t = input_ids.shape
        if attention_mask is None:
            attention_mask = jnp.ones((b, t), jnp.int32)
        key_bias = jnp.where(attention_mask != 0, 0.0, MASK_VALUE).astype(jnp.float32)
        buckets = jnp.asarray(relative_position_buckets(t, t, config.num_buckets, config.max_distance))
        x = self.embed(input_ids.astype(jnp.int32))
        graphdef, stacked = nnx.split(self.blocks)

        def run_block(x, state):
            return nnx.merge(graphdef, state)(x, buckets, key_bias), None

        x, _ = jax.lax.scan(run_block, x, stacked)
        return self.final_norm(x)

    def context(self, input_ids: Array, attention_mask: Array, text_len: int | None = None) -> Array:
        """Wan's text context ``[B, text_len, dim]``: each prompt's first ``sum(attention_mask)``
        hidden states (its real tokens), zeros after them, cut or zero-padded to ``text_len``
        (default ``config.text_len``) whatever ``T`` the ids have."""
        text_len = self.config.text_len if text_len is None else text_len
        hidden = self(input_ids, attention_mask)
        lengths = jnp.sum(attention_mask != 0, axis=1)
        keep = jnp.arange(hidden.shape[1])[None, :] < lengths[:, None]
        hidden = jnp.where(keep[..., None], hidden, jnp.zeros((), hidden.dtype))
        t = hidden.shape[1]
        if t >= text_len:
            return hidden[:, :text_len]
        return jnp.pad(hidden, ((0, 0), (0, text_len - t), (0, 0)))


@functools.partial(jax.jit, static_argnums=(0, 4))
def _context(graphdef, params, input_ids: Array, attention_mask: Array, text_len: int) -> Array:
    return nnx.merge(graphdef, params).context(input_ids, attention_mask, text_len)


def encode_ids(encoder: UMT5Encoder, input_ids, attention_mask, text_len: int | None = None) -> Array:
    """Jitted :meth:`UMT5Encoder.context` on host or device arrays ``[B, T]``: the DiT's
    ``context`` ``[B, text_len, dim]`` in the encoder's dtype."""
    text_len = encoder.config.text_len if text_len is None else int(text_len)
    graphdef, params = nnx.split(encoder)
    return _context(graphdef, params, jnp.asarray(input_ids, jnp.int32), jnp.asarray(attention_mask, jnp.int32),
                    text_len)


def init_random(config: UMT5EncoderConfig, seed: int = 0) -> UMT5Encoder:
    """A :class:`UMT5Encoder` with random weights drawn on the host with NumPy
    (:func:`arkv_jax.models.io.init_random`, seeded): T5's initialisation scales (embeddings
    ``N(0, 1)``, ``q`` ``N(0, 1 / (dim * head_dim))``, the other kernels ``N(0, 1 / fan_in)``, bias
    tables ``N(0, 1 / dim)``, norm scales 1)."""
    def draw(names: tuple[str, ...], shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
        if names[-1] == "scale":
            return np.ones(shape, np.float32)
        if names[-1] == "embedding":
            return rng.standard_normal(shape, np.float32)
        std = 1.0 / math.sqrt(config.dim)
        if names[-2:] == ("q", "kernel"):
            std = 1.0 / math.sqrt(config.dim * config.head_dim)
        elif names[-1] == "kernel":
            std = 1.0 / math.sqrt(shape[-2])
        return rng.standard_normal(shape, np.float32) * np.float32(std)

    return io.init_random(UMT5Encoder, config, draw, seed)


# ------------------------------------------------------------------------------------------------
# Checkpoints
# ------------------------------------------------------------------------------------------------

_WAN_BLOCK_KEYS = {
    "norm1.weight": "layer.0.layer_norm.weight",
    "attn.q.weight": "layer.0.SelfAttention.q.weight",
    "attn.k.weight": "layer.0.SelfAttention.k.weight",
    "attn.v.weight": "layer.0.SelfAttention.v.weight",
    "attn.o.weight": "layer.0.SelfAttention.o.weight",
    "pos_embedding.embedding.weight": "layer.0.SelfAttention.relative_attention_bias.weight",
    "norm2.weight": "layer.1.layer_norm.weight",
    "ffn.gate.0.weight": "layer.1.DenseReluDense.wi_0.weight",
    "ffn.fc1.weight": "layer.1.DenseReluDense.wi_1.weight",
    "ffn.fc2.weight": "layer.1.DenseReluDense.wo.weight",
}

#: ``transformers`` names of a layer's tensors (after ``encoder.block.{i}.``) by parameter path
#: inside :class:`UMT5Block`.
_HF_BLOCK_KEYS = {
    "attn_norm.scale": "layer.0.layer_norm.weight",
    "q.kernel": "layer.0.SelfAttention.q.weight",
    "k.kernel": "layer.0.SelfAttention.k.weight",
    "v.kernel": "layer.0.SelfAttention.v.weight",
    "o.kernel": "layer.0.SelfAttention.o.weight",
    "relative_attention_bias": "layer.0.SelfAttention.relative_attention_bias.weight",
    "ffn_norm.scale": "layer.1.layer_norm.weight",
    "wi_0.kernel": "layer.1.DenseReluDense.wi_0.weight",
    "wi_1.kernel": "layer.1.DenseReluDense.wi_1.weight",
    "wo.kernel": "layer.1.DenseReluDense.wo.weight",
}

#: The token embedding's ``transformers`` names: ``shared`` and its tied copy ``encoder.embed_tokens``
#: (``UMT5EncoderModel.state_dict()`` holds both, ``save_pretrained`` the first).
_EMBEDDING_KEYS = ("shared.weight", "encoder.embed_tokens.weight")

#: Key prefixes of a whole encoder-decoder checkpoint that the encoder does not read (its decoder
#: and LM head); every other tensor must be one of the encoder's.
_NOT_ENCODER = ("decoder.", "lm_head.")


def convert_wan_t5_state_dict(state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The official Wan encoder checkpoint (``models_t5_umt5-xxl-enc-bf16.pth``, Wan's
    ``T5Encoder`` names) renamed to ``transformers``' ``UMT5EncoderModel`` names; keys Wan's encoder
    does not have keep their names (so :func:`from_state_dict` reports them as left over). Wan's
    ``ffn.gate.0`` is the GELU branch ``wi_0``, ``ffn.fc1`` the linear branch ``wi_1``, ``ffn.fc2``
    is ``wo``."""
    out = {}
    for key, value in state.items():
        m = re.fullmatch(r"blocks\.(\d+)\.(.+)", key)
        if key == "token_embedding.weight":
            key = "shared.weight"
        elif key == "norm.weight":
            key = "encoder.final_layer_norm.weight"
        elif m is not None and m.group(2) in _WAN_BLOCK_KEYS:
            key = _hf_block_key(int(m.group(1)), _WAN_BLOCK_KEYS[m.group(2)])
        out[key] = value
    return out


def _hf_block_key(layer: int, suffix: str) -> str:
    return f"encoder.block.{layer}.{suffix}"


def config_from_state_dict(state: Mapping[str, np.ndarray], hf_config: Mapping | None = None, *,
                           dtype: str | None = None, text_len: int = 512) -> UMT5EncoderConfig:
    """The :class:`UMT5EncoderConfig` of a ``transformers``-named state dict: shapes from the
    weights, ``eps``/``max_distance`` from ``hf_config`` (a ``config.json`` dict) when given,
    ``dtype`` from the embedding's unless named.

    Raises:
      ValueError: a weight the shapes are read from is missing.
    """
    hf_config = dict(hf_config or {})
    embedding = next((k for k in _EMBEDDING_KEYS if k in state), None)
    if embedding is None:
        raise ValueError(f"the state dict has no token embedding ({' or '.join(_EMBEDDING_KEYS)})")
    embed = state[embedding]
    layers = sorted({int(m.group(1)) for k in state if (m := re.match(r"encoder\.block\.(\d+)\.", k))})
    if not layers or layers != list(range(len(layers))):
        raise ValueError(f"expected encoder.block.0 ... encoder.block.N-1 in the state dict, found layers {layers}")
    bias = _require(state, _hf_block_key(0, "layer.0.SelfAttention.relative_attention_bias.weight"))
    q = _require(state, _hf_block_key(0, "layer.0.SelfAttention.q.weight"))
    wi = _require(state, _hf_block_key(0, "layer.1.DenseReluDense.wi_0.weight"))
    num_buckets, num_heads = bias.shape
    if dtype is None:
        dtype = "bfloat16" if embed.dtype == jnp.bfloat16 else "float32"
    return UMT5EncoderConfig(
        vocab_size=int(embed.shape[0]), dim=int(embed.shape[1]), num_heads=int(num_heads),
        head_dim=int(q.shape[0]) // int(num_heads), ffn_dim=int(wi.shape[0]), num_layers=len(layers),
        num_buckets=int(num_buckets), max_distance=int(hf_config.get("relative_attention_max_distance", 128)),
        eps=float(hf_config.get("layer_norm_epsilon", 1e-6)), text_len=text_len, dtype=dtype)


def _require(state: Mapping[str, np.ndarray], key: str) -> np.ndarray:
    if key not in state:
        raise ValueError(f"the state dict has no {key!r}")
    return state[key]


def _sources(names: tuple[str, ...], config: UMT5EncoderConfig, embedding: str) -> list[str]:
    """The ``transformers`` keys of parameter ``names``: one per layer for the stacked blocks."""
    if names[0] == "embed":
        return [embedding]
    if names[0] == "final_norm":
        return ["encoder.final_layer_norm.weight"]
    return [_hf_block_key(i, _HF_BLOCK_KEYS[".".join(names[1:])]) for i in range(config.num_layers)]


def from_state_dict(state: Mapping[str, np.ndarray], config: UMT5EncoderConfig, *,
                    source: str = "state dict") -> UMT5Encoder:
    """A :class:`UMT5Encoder` of ``config`` holding the ``transformers``-named weights ``state``
    (torch ``Linear`` weights ``[out, in]`` are transposed; per-layer weights stacked). A whole
    encoder-decoder state dict is fine: its ``decoder.`` and ``lm_head.`` tensors are not read.

    Raises:
      CheckpointKeyError: tensors missing or left over (:func:`arkv_jax.models.io.check_tensors`,
        naming ``source`` and the keys).
      ValueError: tensors of the wrong shape (each named, with the shape expected).
    """
    state = {k: v for k, v in state.items() if not k.startswith(_NOT_ENCODER)}
    graphdef, abstract = io.abstract(UMT5Encoder, config)
    embedding = next((k for k in _EMBEDDING_KEYS if k in state), _EMBEDDING_KEYS[0])
    expected = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(abstract):
        names = io.path_names(path)
        shape = tuple(leaf.shape[1:] if names[0] == "blocks" else leaf.shape)
        expected.update(dict.fromkeys(_sources(names, config, embedding), shape[::-1] if names[-1] == "kernel"
                                      else shape))
    for tied in _EMBEDDING_KEYS:
        if tied in state:
            expected[tied] = expected[embedding]
    io.check_tensors({k: io.shape_of(v) for k, v in state.items()}, expected, source=source,
                     model=f"a {config.num_layers}-layer umT5 encoder")

    def fill(names: tuple[str, ...], leaf: jax.ShapeDtypeStruct) -> Array:
        values = [io.to_numpy(state[key]) for key in _sources(names, config, embedding)]
        values = [v.T for v in values] if names[-1] == "kernel" else values
        return jnp.asarray(np.stack(values) if names[0] == "blocks" else values[0], leaf.dtype)

    return io.build(graphdef, abstract, fill)


#: Files a umT5 checkpoint directory is read from, in order: Wan's own encoder file (the official
#: Wan 2.1 repository keeps it beside the DiT's and the VAE's weights), then ``transformers``' files.
UMT5_WEIGHT_PATTERNS = ("models_t5_umt5-xxl-enc-*.pth", "model*.safetensors", "pytorch_model*.bin")


def load_umt5(path: str | os.PathLike, *, dtype: str | None = None, text_len: int = 512) -> UMT5Encoder:
    """A :class:`UMT5Encoder` holding released umT5 encoder weights.

    Args:
      path: a ``transformers`` checkpoint directory (``config.json`` beside safetensors or
        ``pytorch_model*.bin``; a whole encoder-decoder checkpoint is fine, only the encoder is
        read), one weight file in either layout (``.safetensors``, ``.bin``, or Wan's
        ``models_t5_umt5-xxl-enc-bf16.pth``); the layout is told from the key names.
      dtype: parameter dtype name (default: the checkpoint's, float32 or bfloat16).
      text_len: ``config.text_len`` (tokens of the DiT's context).

    The shape is read from the weights; ``config.json``, where there is one, adds the norm epsilon
    and ``relative_attention_max_distance`` (defaults: umT5's ``1e-6`` and ``128``). A directory
    holding Wan's ``.pth`` is read from it first (the official Wan 2.1 repository keeps it beside the
    DiT's and the VAE's weights). ``.bin``/``.pth`` files need ``torch``; safetensors are
    memory-mapped, no package needed.

    Raises:
      FileNotFoundError, ValueError: see :func:`arkv_jax.models.io.read_state_dict`; a file that
        is no umT5 encoder.
      CheckpointKeyError, ValueError: see :func:`from_state_dict`; the messages name the file.
    """
    state, source = io.read_state_dict(path, patterns=UMT5_WEIGHT_PATTERNS,
                                       keep=lambda k: not k.startswith(_NOT_ENCODER))
    if "token_embedding.weight" in state or any(k.startswith("blocks.") for k in state):
        state = convert_wan_t5_state_dict(state)
    hf_config = io.sibling_config(path, lambda c: c.get("model_type") in ("umt5", "t5", "mt5") or "d_model" in c)
    try:
        config = config_from_state_dict(state, hf_config, dtype=dtype, text_len=text_len)
    except ValueError as e:
        raise ValueError(f"{source}: not a umT5 encoder checkpoint: {e}") from None
    return from_state_dict(state, config, source=source)


# ------------------------------------------------------------------------------------------------
# Prompts
# ------------------------------------------------------------------------------------------------


def clean_prompt(text: str) -> str:
    """Wan's prompt cleaning: ``ftfy.fix_text`` (when ``ftfy`` is installed), HTML entities
    unescaped twice, runs of whitespace collapsed to one space, ends stripped."""
    try:
        import ftfy

        text = ftfy.fix_text(text)
    except ImportError:
        pass
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


@functools.lru_cache(maxsize=4)
def _tokenizer(directory: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def tokenize(texts: Sequence[str], tokenizer_dir, text_len: int = 512) -> tuple[np.ndarray, np.ndarray]:
    """``(input_ids, attention_mask)``, int32 ``[B, text_len]`` each, as Wan tokenises: cleaned
    prompts, special tokens added (the closing ``</s>``), cut to and padded to ``text_len``.

    Args:
      tokenizer_dir: a local tokenizer directory (read with ``transformers.AutoTokenizer``, never
        from a hub) or a tokenizer object.
    """
    if isinstance(texts, str):
        texts = [texts]
    tokenizer = _tokenizer(os.fspath(tokenizer_dir)) if isinstance(tokenizer_dir, (str, os.PathLike)) \
        else tokenizer_dir
    out = tokenizer([clean_prompt(t) for t in texts], padding="max_length", max_length=text_len,
                    truncation=True, add_special_tokens=True, return_attention_mask=True, return_tensors="np")
    return np.asarray(out["input_ids"], np.int32), np.asarray(out["attention_mask"], np.int32)


def encode_prompts(texts: Sequence[str] | str, tokenizer_dir, encoder: UMT5Encoder,
                   text_len: int | None = None) -> Array:
    """The DiT's text ``context`` ``[B, text_len, dim]`` of prompts: :func:`tokenize` then
    :func:`encode_ids` (Wan's pipeline: real tokens' embeddings, zeros after them).

    Args:
      texts: one prompt or a list.
      tokenizer_dir: see :func:`tokenize`.
      encoder: e.g. from :func:`load_umt5`.
      text_len: tokens per prompt (default ``encoder.config.text_len``, Wan's 512).
    """
    text_len = encoder.config.text_len if text_len is None else int(text_len)
    ids, mask = tokenize(texts, tokenizer_dir, text_len)
    return encode_ids(encoder, ids, mask, text_len)


__all__ = [
    "UMT5_CONFIGS", "UMT5Block", "UMT5Encoder", "UMT5EncoderConfig", "clean_prompt", "config_from_state_dict",
    "convert_wan_t5_state_dict", "encode_ids", "encode_prompts", "from_state_dict", "init_random", "load_umt5",
    "relative_position_buckets", "tokenize",
]
