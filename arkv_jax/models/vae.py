"""The Wan 2.1 VAE decoder in Flax NNX, decoding a latent stream chunk by chunk as chunks commit.

Wan 2.1's VAE decodes with *causal* 3-D convolutions, so a stream can be decoded as it is generated:
:func:`decoder_init_cache` gives a :class:`DecoderCache` (per causal convolution, the last two frames
of its input; zeros before the stream starts) and :func:`decode_chunk` maps
``(decoder, cache, latents [F, h, w, z_dim]) -> (frames, cache)`` with ``frames`` ``[F', 8h, 8w, 3]``
in ``[-1, 1]`` (``F' = 1 + 4 (F - 1)`` for the stream's first chunk, ``4 F`` after it), equal to the
whole-video decode to float rounding. Latents come **normalised**, as the DiT produces them, and are
mapped back with Wan's ``latents_mean`` / ``latents_std`` first; a leading batch axis is decoded
one stream after another (a ``fori_loop`` updating the batch's cache in place: a batch takes one
stream's temporaries). The cache is stored in ``WanVAEConfig.cache_dtype`` (bfloat16 halves it),
kept row-major on its device (:func:`cache_formats`: the layout the TPU convolution kernel reads, so
no decode relays the entries it reads), and :func:`stream_cache_bytes` sizes it from the shapes
alone (``tpu_hbm=True``: as a TPU's HBM pads it). :func:`load_wan_vae` reads the diffusers layout or
the official ``Wan2.1_VAE.pth`` (:func:`official_vae_names` is the key map), the decoder only,
checked with :mod:`arkv_jax.models.io`. See ``docs/models.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.experimental.layout import Format

from arkv_jax.config import require_int
from arkv_jax.models import io
from pallas_kernels import causal_conv, upsample_conv
from pallas_kernels.backend import resolve_backend

Array = jax.Array

#: Wan 2.1's per-channel latent statistics (``WanVAE`` in ``wan/modules/vae.py``, diffusers'
#: ``AutoencoderKLWan`` defaults): the DiT's latents are ``(z - mean) / std``.
WAN21_LATENTS_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                      0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
WAN21_LATENTS_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                     3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160)

#: Frames a causal convolution keeps between calls (kernel 3 in time: the last two input frames).
CACHE_FRAMES = causal_conv.CACHE_FRAMES

#: A 3x3x3 causal convolution runs the TPU kernel (:mod:`pallas_kernels.causal_conv`) under a TPU
#: backend when its input channels are at least this many and its output channels too, or few
#: enough for the kernel's transposed narrow output (:func:`pallas_kernels.causal_conv.is_narrow`;
#: Wan 2.1: every one but ``conv_in``, 16 in; ``conv_out``, 3 out, is narrow), as does an
#: upsampler's convolution (:mod:`pallas_kernels.upsample_conv`; Wan 2.1: all three). The kernel
#: reads its cache entry row-major, the layout the stream cache is kept in (:func:`cache_formats`):
#: a 96- or 192-channel entry takes 128 or 256 lanes in a TPU's HBM (:func:`stream_cache_bytes`
#: with ``tpu_hbm=True``). Fewer input channels, or outputs between the two, would pad the kernel's
#: rows, cache or output to the 128 lanes many times over; they stay on XLA.
KERNEL_MIN_CHANNELS = 96

#: dtype names a :class:`WanVAEConfig` takes for its parameters and compute (``dtype``) and for its
#: stream cache (``cache_dtype``).
DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class WanVAEConfig:
    """Shape of a :class:`WanVAEDecoder` (the decoder half of Wan 2.1's ``AutoencoderKLWan``).

    Attributes:
      base_dim: the decoder's base width (diffusers ``decoder_base_dim or base_dim``; Wan 2.1: 96).
      z_dim: latent channels.
      dim_mult: width multipliers per level, encoder order (the decoder runs them reversed).
      num_res_blocks: residual blocks per encoder level (the decoder has one more per level).
      temporal_upsample: per up block but the last, whether its upsampler doubles the frames
        (diffusers ``temperal_downsample[::-1]``; Wan 2.1: ``(True, True, False)``).
      out_channels: pixel channels.
      latents_mean, latents_std: per-channel statistics of the latents (``z_dim`` each).
      dtype: parameter and compute dtype name (norms and attention softmax run in float32).
      cache_dtype: dtype name the :class:`DecoderCache` entries are stored in (each entry is cast
        to it when written and read back in ``dtype``); ``None``: ``dtype``. A bfloat16 cache halves
        a stream's cache bytes (:func:`stream_cache_bytes`) under either compute dtype.
    """

    base_dim: int = 96
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    temporal_upsample: tuple[bool, ...] = (True, True, False)
    out_channels: int = 3
    latents_mean: tuple[float, ...] = WAN21_LATENTS_MEAN
    latents_std: tuple[float, ...] = WAN21_LATENTS_STD
    dtype: str = "float32"
    cache_dtype: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "dim_mult", tuple(int(m) for m in self.dim_mult))
        object.__setattr__(self, "temporal_upsample", tuple(bool(t) for t in self.temporal_upsample))
        object.__setattr__(self, "latents_mean", tuple(float(m) for m in self.latents_mean))
        object.__setattr__(self, "latents_std", tuple(float(s) for s in self.latents_std))
        for name in ("base_dim", "z_dim", "num_res_blocks", "out_channels"):
            require_int(name, getattr(self, name), minimum=1)
        if len(self.dim_mult) < 2 or min(self.dim_mult) < 1:
            raise ValueError(f"dim_mult must have at least two positive entries, got {self.dim_mult}")
        if len(self.temporal_upsample) != len(self.dim_mult) - 1:
            raise ValueError(f"temporal_upsample needs one entry per upsampler ({len(self.dim_mult) - 1}), "
                             f"got {self.temporal_upsample}")
        if len(self.latents_mean) != self.z_dim or len(self.latents_std) != self.z_dim:
            raise ValueError(f"latents_mean and latents_std need z_dim={self.z_dim} entries, got "
                             f"{len(self.latents_mean)} and {len(self.latents_std)}")
        if min(self.latents_std) <= 0:
            raise ValueError("latents_std must be positive")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not one of {DTYPES}")
        if self.cache_dtype is not None and self.cache_dtype not in DTYPES:
            raise ValueError(f"cache_dtype={self.cache_dtype!r} is not one of {DTYPES} (or None: the compute dtype)")

    @property
    def stored_cache_dtype(self) -> jnp.dtype:
        """The dtype the stream cache's entries are stored in: ``cache_dtype``, else ``dtype``."""
        return jnp.dtype(self.cache_dtype or self.dtype)

    @property
    def dims(self) -> tuple[int, ...]:
        """Channels entering the decoder and leaving each up block: ``base_dim * m`` over
        ``[dim_mult[-1]] + dim_mult[::-1]``."""
        return tuple(self.base_dim * m for m in (self.dim_mult[-1],) + self.dim_mult[::-1])

    @property
    def spatial_factor(self) -> int:
        """Pixels per latent pixel along each side (Wan 2.1: 8)."""
        return 2 ** (len(self.dim_mult) - 1)

    @property
    def temporal_factor(self) -> int:
        """Pixel frames per latent frame after the first (Wan 2.1: 4)."""
        return 2 ** sum(self.temporal_upsample)

    def num_pixel_frames(self, num_latent_frames: int, first_chunk: bool) -> int:
        """Pixel frames decoded from ``num_latent_frames`` latent frames: ``1 + 4 (F - 1)`` for
        the stream's first chunk, ``4 F`` later (Wan 2.1)."""
        f = self.temporal_factor * num_latent_frames
        return f - self.temporal_factor + 1 if first_chunk and num_latent_frames else f


#: Decoder shapes by name: ``tiny`` (CPU tests, the demo: 16 latent channels as Wan has) and Wan 2.1's.
VAE_CONFIGS: dict[str, WanVAEConfig] = {
    "tiny": WanVAEConfig(base_dim=8),
    "wan2.1": WanVAEConfig(),
}


# ------------------------------------------------------------------------------------------------
# The cache
# ------------------------------------------------------------------------------------------------


@struct.dataclass
class DecoderCache:
    """What a streaming decode carries from one chunk to the next.

    Attributes:
      frames: per causal convolution, in call order, the last :data:`CACHE_FRAMES` frames of its
        input ``[2, H_l, W_l, C_l]`` (``[B, 2, ...]`` for a batched stream; a residual block's
        convolutions: of the input to their norm), in the decoder's
        :attr:`WanVAEConfig.stored_cache_dtype`; zeros before the stream starts.
      started: static: whether the stream's first latent frame has been decoded (the first frame
        passes the temporal upsamplers undoubled).
    """

    frames: tuple[Array, ...]
    started: bool = struct.field(pytree_node=False, default=False)


class _Stream:
    """Trace-time threading of the per-convolution caches through the decoder, in call order
    (the reference's ``feat_cache``/``feat_idx``, but functional: ``inputs`` are read, the new
    entries collected in ``outputs``). Entries are stored in ``dtype`` (the config's
    :attr:`~WanVAEConfig.stored_cache_dtype`) and read back in the dtype of the input they extend.
    With ``inputs=None`` every entry reads as zeros (used to find the cache's shapes). ``backend``
    (a resolved name of :mod:`pallas_kernels.backend`) is the one the causal convolutions run.
    With an ``index`` the inputs are a batch's entries ``[B, 2, H, W, C]``: an entry is read as
    stream ``index``'s slice where it is used, and each output is the batch's entry with that
    slice replaced (updated in place: the batch's cache is not copied whole); a 3x3x3 causal
    convolution takes the batch's entry whole with the index (:meth:`take_batch`), so the TPU
    kernel reads and writes the stream's slice in place, without copying it out and back."""

    def __init__(self, inputs: Sequence[Array] | None, dtype, backend: str = "xla", index: Array | None = None):
        self.inputs = inputs
        self.dtype = jnp.dtype(dtype)
        self.backend = backend
        self.index = index
        self.outputs: list[Array] = []

    def take(self, like: Array) -> Array:
        """The next entry (``[2, H, W, C]`` for an input ``like`` ``[T, H, W, C]``), in ``like.dtype``.

        Raises:
          ValueError: the cache has too few entries, or this one's shape or dtype is not the
            decoder's (a cache made for another latent size or another decoder).
        """
        if self.inputs is None:
            return jnp.zeros((CACHE_FRAMES, *like.shape[1:]), like.dtype)
        entry = self._checked(like)
        if self.index is not None:
            entry = jax.lax.dynamic_index_in_dim(entry, self.index, axis=0, keepdims=False)
        return entry.astype(like.dtype)

    def take_batch(self, like: Array) -> tuple[Array, Array | None]:
        """``(entry, index)`` for a convolution that updates a batch's entry itself: with an
        ``index`` and entries stored in ``like.dtype``, the batch's entry ``[B, 2, H, W, C]`` whole
        and the index; otherwise :meth:`take` and ``None``. Give the result to :meth:`put_batch`.
        Raises what :meth:`take` raises."""
        if self.index is None or self.inputs is None or self.dtype != like.dtype:
            return self.take(like), None
        return self._checked(like), self.index

    def put_batch(self, entry: Array, index: Array | None) -> None:
        """Record the next entry from :meth:`take_batch`'s ``(entry, index)`` once updated: the
        batch's whole where ``index`` is not ``None``, else as :meth:`put`."""
        if index is None:
            self.put(entry)
        else:
            self.outputs.append(entry)

    def _checked(self, like: Array) -> Array:
        """The next input entry as stored (the batch's with an ``index``), checked against ``like``."""
        i = len(self.outputs)
        if i >= len(self.inputs):
            raise ValueError(f"the cache has {len(self.inputs)} entries; the decoder needs more")
        entry = self.inputs[i]
        shape = entry.shape if self.index is None else entry.shape[1:]
        if shape != (CACHE_FRAMES, *like.shape[1:]):
            raise ValueError(f"cache entry {i} has shape {shape}; the decoder needs "
                             f"{(CACHE_FRAMES, *like.shape[1:])} (was it made for this latent size?)")
        if entry.dtype != self.dtype:
            raise ValueError(f"cache entry {i} is {entry.dtype}; the decoder stores its cache in {self.dtype} "
                             "(was it made by this decoder's decoder_init_cache?)")
        return entry

    def put(self, entry: Array) -> None:
        """Record the next entry, cast to the cache's storage dtype (with an ``index``: written into
        the batch's entry)."""
        entry = entry.astype(self.dtype)
        if self.index is not None:
            entry = jax.lax.dynamic_update_index_in_dim(self.inputs[len(self.outputs)], entry, self.index, axis=0)
        self.outputs.append(entry)


# ------------------------------------------------------------------------------------------------
# Layers (unbatched, channels-last: x [T, H, W, C])
# ------------------------------------------------------------------------------------------------


def _conv_params(shape: tuple[int, ...], fan_in: int, dtype, rngs: nnx.Rngs) -> tuple[nnx.Param, nnx.Param]:
    kernel = jax.random.normal(rngs.params(), shape) / np.sqrt(fan_in)
    return nnx.Param(kernel.astype(dtype)), nnx.Param(jnp.zeros((shape[-1],), dtype))


class CausalConv3d(nnx.Module):
    """A 3-D convolution causal in time: ``kernel_t - 1`` frames of history (the cache, zeros at
    the stream's start) before the input, zero ``"same"`` padding in space.

    Parameters: ``kernel`` ``[kt, kh, kw, in, out]`` (torch's ``[out, in, kt, kh, kw]``
    transposed), ``bias`` ``[out]``.
    """

    def __init__(self, in_dim: int, out_dim: int, kernel: tuple[int, int, int], *, dtype, rngs: nnx.Rngs):
        self.kernel_size = tuple(kernel)
        self.kernel, self.bias = _conv_params((*kernel, in_dim, out_dim), in_dim * int(np.prod(kernel)), dtype,
                                              rngs)

    @property
    def history(self) -> int:
        return self.kernel_size[0] - 1

    def __call__(self, x: Array, stream: _Stream | None = None, norm: ChannelRMSNorm | None = None,
                 residual: Array | None = None) -> Array:
        """``x`` ``[T, H, W, in]`` -> ``[T, H, W, out]``; a temporal kernel reads and updates its
        ``stream`` entry (the last frames of ``[cache, x]``). A 3x3x3 kernel runs
        :func:`pallas_kernels.causal_conv.causal_conv3d` under the stream's backend (the XLA path
        where its channels do not suit the kernel, :data:`KERNEL_MIN_CHANNELS`); with a
        ``norm`` (3x3x3 only) it convolves ``silu(norm([cache, x]))`` and the entry keeps ``x``'s
        frames as given, so the normalized input is never written out (the TPU kernel normalizes
        in VMEM); a ``residual`` (3x3x3 only, the output's shape) is added to the output as it is
        written."""
        kt, kh, kw = self.kernel_size
        if (kt, kh, kw) == (3, 3, 3):
            cin, cout = self.kernel.shape[-2:]
            on_kernel = cin >= KERNEL_MIN_CHANNELS and (cout >= KERNEL_MIN_CHANNELS or causal_conv.is_narrow(cout))
            backend = stream.backend if on_kernel else "xla"
            cache, index = stream.take_batch(x)
            gamma = None if norm is None else norm.gamma[...].astype(x.dtype)
            y, entry = causal_conv.causal_conv3d(x, cache, self.kernel[...].astype(x.dtype),
                                                 self.bias[...].astype(x.dtype), norm_gamma=gamma,
                                                 residual=residual, stream=index, backend=backend)
            stream.put_batch(entry, index)
            return y
        if norm is not None or residual is not None:
            raise ValueError(f"an input norm or a residual needs a 3x3x3 kernel, this one is {self.kernel_size}")
        if kt > 1:
            if kt - 1 != CACHE_FRAMES:
                raise ValueError(f"a causal kernel of {kt} frames needs {kt - 1} cached frames, not {CACHE_FRAMES}")
            x = jnp.concatenate([stream.take(x), x], axis=0)
            stream.put(x[-CACHE_FRAMES:])
        if (kh, kw) == (1, 1):  # a matmul per frame offset, summed in float32 (XLA:TPU's convolution
            frames = x.shape[0] - kt + 1  # of a (3, 1, 1) kernel relaid its pixels out)
            kernel = self.kernel[...][:, 0, 0]
            y = sum(jnp.einsum("thwc,co->thwo", x[dt:dt + frames], kernel[dt], preferred_element_type=jnp.float32)
                    for dt in range(kt))
            return (y + self.bias[...]).astype(x.dtype)
        y = jax.lax.conv_general_dilated(
            x[None], self.kernel[...], window_strides=(1, 1, 1),
            padding=((0, 0), (kh // 2, kh // 2), (kw // 2, kw // 2)),
            dimension_numbers=("NDHWC", "DHWIO", "NDHWC"))[0]
        return y + self.bias[...]


class UpsampleConv2d(nnx.Module):
    """An upsampler's 3x3 convolution, zero "same" padding, of its input upsampled 2x in space by
    nearest neighbour (``kernel`` ``[3, 3, in, out]``): :func:`pallas_kernels.upsample_conv.upsample_conv2d`,
    which computes at the input's resolution."""

    def __init__(self, in_dim: int, out_dim: int, *, dtype, rngs: nnx.Rngs):
        self.kernel, self.bias = _conv_params((3, 3, in_dim, out_dim), in_dim * 9, dtype, rngs)

    def __call__(self, x: Array, backend: str) -> Array:
        """``[T, H, W, in]`` -> ``[T, 2H, 2W, out]`` under ``backend`` (the XLA path where the input or
        output channels are fewer than :data:`KERNEL_MIN_CHANNELS`)."""
        if min(self.kernel.shape[-2:]) < KERNEL_MIN_CHANNELS:
            backend = "xla"
        return upsample_conv.upsample_conv2d(x, self.kernel[...].astype(x.dtype), self.bias[...].astype(x.dtype),
                                             backend=backend)


class ChannelRMSNorm(nnx.Module):
    """Wan's norm over channels: ``x / max(||x||_2, 1e-12) * sqrt(C) * gamma`` (float32 inside;
    :func:`pallas_kernels.causal_conv.xla.channel_rms_norm`)."""

    def __init__(self, dim: int, *, dtype):
        self.gamma = nnx.Param(jnp.ones((dim,), dtype))
        self.dim = dim

    def __call__(self, x: Array) -> Array:
        return causal_conv.xla.channel_rms_norm(x, self.gamma[...]).astype(x.dtype)


class ResidualBlock(nnx.Module):
    """``shortcut(x) + conv2(silu(norm2(conv1(silu(norm1(x))))))``, both convolutions 3x3x3 causal
    and each applying its norm and SiLU itself (their stream entries keep the frames before the
    norm), the second adding the shortcut to its output; the shortcut is a 1x1x1 convolution
    where the width changes."""

    def __init__(self, in_dim: int, out_dim: int, *, dtype, rngs: nnx.Rngs):
        self.norm1 = ChannelRMSNorm(in_dim, dtype=dtype)
        self.conv1 = CausalConv3d(in_dim, out_dim, (3, 3, 3), dtype=dtype, rngs=rngs)
        self.norm2 = ChannelRMSNorm(out_dim, dtype=dtype)
        self.conv2 = CausalConv3d(out_dim, out_dim, (3, 3, 3), dtype=dtype, rngs=rngs)
        self.conv_shortcut = (CausalConv3d(in_dim, out_dim, (1, 1, 1), dtype=dtype, rngs=rngs)
                              if in_dim != out_dim else None)

    def __call__(self, x: Array, stream: _Stream) -> Array:
        h = x if self.conv_shortcut is None else self.conv_shortcut(x)
        x = self.conv1(x, stream, self.norm1)
        return self.conv2(x, stream, self.norm2, residual=h)


class AttentionBlock(nnx.Module):
    """Single-head self-attention over each frame's pixels (``x + proj(attn(qkv(norm(x))))``);
    ``to_qkv`` and ``proj`` are 1x1 convolutions, kept as ``[C, 3C]`` / ``[C, C]`` matrices."""

    def __init__(self, dim: int, *, dtype, rngs: nnx.Rngs):
        self.norm = ChannelRMSNorm(dim, dtype=dtype)
        self.to_qkv_kernel, self.to_qkv_bias = _conv_params((dim, 3 * dim), dim, dtype, rngs)
        self.proj_kernel, self.proj_bias = _conv_params((dim, dim), dim, dtype, rngs)

    def __call__(self, x: Array) -> Array:
        t, h, w, c = x.shape
        qkv = self.norm(x).reshape(t, h * w, c) @ self.to_qkv_kernel[...] + self.to_qkv_bias[...]
        q, k, v = jnp.split(qkv, 3, axis=-1)
        logits = jnp.einsum("tqc,tkc->tqk", q, k, preferred_element_type=jnp.float32) / np.float32(np.sqrt(c))
        y = jnp.einsum("tqk,tkc->tqc", jax.nn.softmax(logits, axis=-1).astype(v.dtype), v)
        y = y @ self.proj_kernel[...] + self.proj_bias[...]
        return x + y.reshape(t, h, w, c)


class Upsampler(nnx.Module):
    """Nearest 2x in space then a 3x3 convolution to ``dim // 2`` channels; with ``temporal``,
    first a ``(3, 1, 1)`` causal ``time_conv`` to ``2 dim`` channels whose halves become two frames
    per input frame, except for the stream's first frame, which passes through (and is not part of
    the time convolution's history)."""

    def __init__(self, dim: int, temporal: bool, *, dtype, rngs: nnx.Rngs):
        self.temporal = temporal
        self.time_conv = CausalConv3d(dim, 2 * dim, (3, 1, 1), dtype=dtype, rngs=rngs) if temporal else None
        self.conv = UpsampleConv2d(dim, dim // 2, dtype=dtype, rngs=rngs)

    def __call__(self, x: Array, stream: _Stream, started: bool) -> Array:
        if self.temporal:
            first, rest = (x[:0], x) if started else (x[:1], x[1:])
            if rest.shape[0]:
                y = self.time_conv(rest, stream)  # [T, H, W, 2C]: channel halves are frames 2t, 2t+1
                t, h, w, c2 = y.shape
                y = y.reshape(t, h, w, 2, c2 // 2).transpose(0, 3, 1, 2, 4).reshape(2 * t, h, w, c2 // 2)
            else:  # the stream's first chunk is its first frame alone: the history stays zeros
                stream.put(stream.take(rest[:0]))
                y = rest
            x = jnp.concatenate([first, y], axis=0)
        return self.conv(x, stream.backend)


class UpBlock(nnx.Module):
    """``num_res_blocks + 1`` residual blocks, then an optional :class:`Upsampler`."""

    def __init__(self, in_dim: int, out_dim: int, num_blocks: int, upsample: str | None, *, dtype,
                 rngs: nnx.Rngs):
        self.resnets = nnx.List([ResidualBlock(in_dim if i == 0 else out_dim, out_dim, dtype=dtype, rngs=rngs)
                                 for i in range(num_blocks)])
        self.upsampler = (Upsampler(out_dim, upsample == "temporal", dtype=dtype, rngs=rngs)
                          if upsample else None)

    def __call__(self, x: Array, stream: _Stream, started: bool) -> Array:
        for resnet in self.resnets:
            x = resnet(x, stream)
        return x if self.upsampler is None else self.upsampler(x, stream, started)


class WanVAEDecoder(nnx.Module):
    """The Wan 2.1 VAE decoder (with the post-quant convolution), decoding a stream chunk by chunk.

    Wan 2.1's VAE compresses video 8x in space and 4x in time with *causal* 3-D convolutions: a pixel
    frame depends on its own and earlier latent frames only. The reference (``WanVAE_.decode`` in
    Wan's ``wan/modules/vae.py``, diffusers' ``AutoencoderKLWan._decode``) decodes one latent frame at
    a time and keeps, per causal convolution, the last two frames of that convolution's input (its
    *feature cache*); here that cache is an explicit value (:class:`DecoderCache`). The first latent
    frame decodes to 1 pixel frame, every later one to 4 (each temporal upsampling doubles the
    frames except the stream's very first, which it passes through).

    Layers (Wan 2.1: ``base_dim`` 96, ``dim_mult`` (1, 2, 4, 4), 2 residual blocks): a 1x1x1
    ``post_quant_conv``, ``conv_in`` to 384 channels, a middle block (residual, single-head spatial
    attention per frame, residual), four :class:`UpBlock` of three residual blocks each (the first
    three end in an :class:`Upsampler`, the first two of them also doubling the frames), then
    :class:`ChannelRMSNorm`, SiLU and ``conv_out`` to RGB, clamped to ``[-1, 1]``. Channels-last
    throughout: latents ``[frames, h, w, 16]``, pixels ``[frames, 8h, 8w, 3]``.

    Args:
      config: the decoder shape.
      rngs: parameter initialisation (the loaders replace every parameter).
    """

    def __init__(self, config: WanVAEConfig, *, rngs: nnx.Rngs):
        self.config = config
        dtype = jnp.dtype(config.dtype)
        kw = dict(dtype=dtype, rngs=rngs)
        dims = config.dims
        self.post_quant_conv = CausalConv3d(config.z_dim, config.z_dim, (1, 1, 1), **kw)
        self.conv_in = CausalConv3d(config.z_dim, dims[0], (3, 3, 3), **kw)
        self.mid_resnets = nnx.List([ResidualBlock(dims[0], dims[0], **kw), ResidualBlock(dims[0], dims[0], **kw)])
        self.mid_attention = AttentionBlock(dims[0], **kw)
        blocks = []
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            if i > 0:
                in_dim //= 2  # the previous upsampler halved the channels
            last = i == len(dims) - 2
            upsample = None if last else ("temporal" if config.temporal_upsample[i] else "spatial")
            blocks.append(UpBlock(in_dim, out_dim, config.num_res_blocks + 1, upsample, **kw))
        self.up_blocks = nnx.List(blocks)
        self.norm_out = ChannelRMSNorm(dims[-1], dtype=dtype)
        self.conv_out = CausalConv3d(dims[-1], config.out_channels, (3, 3, 3), **kw)

    def denormalize(self, latents: Array) -> Array:
        """``latents * std + mean`` per channel (the last axis): the VAE's own latent scale."""
        mean = jnp.asarray(self.config.latents_mean, jnp.float32)
        std = jnp.asarray(self.config.latents_std, jnp.float32)
        return latents.astype(jnp.float32) * std + mean

    def decode_frames(self, z: Array, stream: _Stream, started: bool) -> Array:
        """Pixels ``[T', 8h, 8w, 3]`` (unclamped) of de-normalised latents ``z`` ``[T, h, w, z_dim]``
        continuing the stream the caches in ``stream`` describe."""
        x = self.post_quant_conv(z.astype(self.config.dtype))
        x = self.conv_in(x, stream)
        x = self.mid_resnets[0](x, stream)
        x = self.mid_attention(x)
        x = self.mid_resnets[1](x, stream)
        for block in self.up_blocks:
            x = block(x, stream, started)
        return self.conv_out(x, stream, self.norm_out)

    def cache_shapes(self, latent_height: int, latent_width: int) -> tuple[jax.ShapeDtypeStruct, ...]:
        """Shape and dtype of each entry of the cache of a stream of ``latent_height x latent_width``
        latents, one per causal convolution in call order: ``[2, H_l, W_l, C_l]`` in
        :attr:`WanVAEConfig.stored_cache_dtype` (traced, nothing allocated)."""
        config = self.config

        def shapes():
            stream = _Stream(None, config.stored_cache_dtype)
            self.decode_frames(jnp.zeros((1, latent_height, latent_width, config.z_dim), jnp.float32), stream, True)
            return tuple(stream.outputs)

        return tuple(jax.eval_shape(shapes))

    def __call__(self, latents: Array, cache: DecoderCache, *, per_frame: bool = True, backend: str = "xla",
                 index: Array | None = None) -> tuple[Array, DecoderCache]:
        """Decode the next chunk of a stream (unbatched latents; :func:`decode_chunk` batches and jits).

        Args:
          latents: ``[F, h, w, z_dim]`` normalised latent frames (``F`` may be 0).
          cache: the stream's cache (from :func:`decoder_init_cache` or the previous chunk); with
            ``index``, a batch's cache (entries ``[B, 2, ...]``) of which stream ``index`` is decoded.
          per_frame: decode one latent frame at a time (``lax.scan``; the reference's order and
            activation memory) rather than the chunk's frames at once.
          backend: the causal convolutions' backend, a resolved name of
            :data:`pallas_kernels.backend.BACKENDS` (:func:`decode_chunk` resolves ``"auto"``).

          index: the stream of a batch's cache (an int scalar, traced or not), or ``None``.

        Returns:
          ``(frames, cache)``: float32 pixels ``[F', 8h, 8w, 3]`` in ``[-1, 1]``
          (:meth:`WanVAEConfig.num_pixel_frames` of them) and the cache after them (with ``index``:
          the batch's, that stream's entries updated).
        """
        z = self.denormalize(latents)
        started = cache.started
        entries = cache.frames
        outputs = []
        if z.shape[0] and not started:
            stream = _Stream(entries, self.config.stored_cache_dtype, backend, index)
            first = z[:1] if per_frame else z
            outputs.append(self.decode_frames(first, stream, False))
            entries, started = tuple(stream.outputs), True
            z = z[1:] if per_frame else z[:0]
        if z.shape[0] and not per_frame:
            stream = _Stream(entries, self.config.stored_cache_dtype, backend, index)
            outputs.append(self.decode_frames(z, stream, True))
            entries = tuple(stream.outputs)
        elif z.shape[0]:
            def step(carry, frame):
                stream = _Stream(carry, self.config.stored_cache_dtype, backend, index)
                out = self.decode_frames(frame[None], stream, True)
                return tuple(stream.outputs), out

            entries, out = jax.lax.scan(step, entries, z)
            outputs.append(out.reshape(-1, *out.shape[2:]))
        h, w = latents.shape[1] * self.config.spatial_factor, latents.shape[2] * self.config.spatial_factor
        frames = (jnp.concatenate(outputs, axis=0) if outputs
                  else jnp.zeros((0, h, w, self.config.out_channels), jnp.float32))
        return jnp.clip(frames.astype(jnp.float32), -1.0, 1.0), DecoderCache(entries, started=started)


# ------------------------------------------------------------------------------------------------
# Functional entry points
# ------------------------------------------------------------------------------------------------


def cache_formats(entries: Sequence, sharding: jax.sharding.Sharding | None = None) -> tuple[Format, ...]:
    """The format each stream-cache entry (array or ``ShapeDtypeStruct``) is kept in, on ``sharding``
    (``None``: each entry's own ``sharding``): row-major (:func:`pallas_kernels.causal_conv.row_major`),
    the layout the TPU kernel reads, so a decode program takes and returns the entries the kernel
    reads without relaying them out (XLA:TPU would put ``H`` on the lanes of a 96- or 192-channel
    entry). Row-major is the default layout of CPU and GPU arrays."""
    return tuple(causal_conv.row_major(len(entry.shape), entry.sharding if sharding is None else sharding)
                 for entry in entries)


def abstract_cache(config: WanVAEConfig, latent_height: int, latent_width: int, batch_size: int | None = None,
                   *, sharding: jax.sharding.Sharding | None = None, started: bool = False) -> DecoderCache:
    """The :class:`DecoderCache` of ``jax.ShapeDtypeStruct`` entries :func:`decoder_init_cache` makes
    for a decoder of ``config`` (``[B, 2, ...]`` with ``batch_size``), traced (no decoder built,
    nothing allocated), each on ``sharding`` in its :func:`cache_formats` format (``None``: no
    sharding, no format), ``started`` as given (a compiled decode's cache)."""
    for name, value in (("latent_height", latent_height), ("latent_width", latent_width)):
        require_int(name, value, minimum=1)
    if batch_size is not None:
        require_int("batch_size", batch_size, minimum=1)
    lead = () if batch_size is None else (batch_size,)
    graphdef, abstract = io.abstract(WanVAEDecoder, config)
    entries = jax.eval_shape(lambda state: nnx.merge(graphdef, state).cache_shapes(latent_height, latent_width),
                             abstract)
    shapes = [jax.ShapeDtypeStruct((*lead, *e.shape), e.dtype) for e in entries]
    formats = [None] * len(shapes) if sharding is None else cache_formats(shapes, sharding)
    return DecoderCache(tuple(jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=f) for s, f in zip(shapes, formats)),
                        started=started)


def decoder_init_cache(decoder: WanVAEDecoder, latent_height: int, latent_width: int,
                       batch_size: int | None = None, *, sharding: jax.sharding.Sharding | None = None
                       ) -> DecoderCache:
    """The zero :class:`DecoderCache` of a new stream (``batch_size`` streams side by side: a
    leading axis on every entry), on ``sharding`` (default: JAX's default device), each entry in
    its :func:`cache_formats` format, which :func:`decode_chunk` keeps."""
    sharding = causal_conv.default_sharding() if sharding is None else sharding
    cache = abstract_cache(decoder.config, latent_height, latent_width, batch_size, sharding=sharding)
    zeros = jax.jit(lambda: tuple(jnp.zeros(e.shape, e.dtype) for e in cache.frames),
                    out_shardings=tuple(e.format for e in cache.frames))
    return DecoderCache(zeros(), started=False)


def _nbytes(tree) -> int:
    """Bytes of the arrays (or ``jax.ShapeDtypeStruct``) leaves of ``tree``."""
    return sum(int(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree))


def stream_cache_bytes(config: WanVAEConfig, latent_height: int, latent_width: int, *, tpu_hbm: bool = False) -> int:
    """Bytes of one stream's :class:`DecoderCache` for ``latent_height x latent_width`` latents
    (``batch_size`` streams: that many times this).

    The shapes are those :func:`decoder_init_cache` gives a decoder of ``config``, traced: no decoder
    is built and nothing is allocated. The entries are in :attr:`WanVAEConfig.stored_cache_dtype`
    (Wan 2.1 at 480x832, latents 60x104: 32 entries, 3.52 GiB in float32, 1.76 GiB in bfloat16).
    ``tpu_hbm=True`` counts what they take in a TPU's HBM in their row-major format
    (:func:`pallas_kernels.causal_conv.row_major_tpu_bytes`: channels padded to 128 lanes; Wan 2.1
    in bfloat16: 2.24 GiB).
    """
    shapes = abstract_cache(config, latent_height, latent_width).frames
    if tpu_hbm:
        return sum(causal_conv.row_major_tpu_bytes(s.shape, s.dtype) for s in shapes)
    return _nbytes(shapes)


def decoder_param_bytes(config: WanVAEConfig) -> int:
    """Bytes of the parameters of a :class:`WanVAEDecoder` of ``config`` (in ``config.dtype``),
    from the abstract module (nothing allocated)."""
    return _nbytes(io.abstract(WanVAEDecoder, config)[1])


def _decode_chunk_impl(graphdef, params, cache: DecoderCache, latents: Array, per_frame: bool, backend: str):
    decoder = nnx.merge(graphdef, params)
    if latents.ndim == 5:
        return _decode_streams(decoder, cache, latents, per_frame, backend)
    return decoder(latents, cache, per_frame=per_frame, backend=backend)


def _decode_streams(decoder: WanVAEDecoder, cache: DecoderCache, latents: Array, per_frame: bool, backend: str):
    """A batch of streams ``[B, F, h, w, z_dim]``, one stream after the other in a ``fori_loop``
    whose carry is the batch's cache, each entry read and written in place where the decoder uses
    it (:class:`_Stream` with an ``index``): a batch's temporaries are one stream's activations
    (``lax.map`` would stack the new caches into a second buffer the size of the batch's; slicing
    a stream's whole cache out first would hold a copy of it)."""
    def stream(i, entries):
        return decoder(latents[i], DecoderCache(entries, started=cache.started), per_frame=per_frame,
                       backend=backend, index=i)

    one = jax.eval_shape(stream, 0, cache.frames)

    def body(i, carry):
        frames, entries = carry
        out, new = stream(i, entries)
        return jax.lax.dynamic_update_index_in_dim(frames, out, i, axis=0), new.frames

    frames = jnp.zeros((latents.shape[0], *one[0].shape), one[0].dtype)
    frames, entries = jax.lax.fori_loop(0, latents.shape[0], body, (frames, cache.frames))
    return frames, DecoderCache(entries, started=one[1].started)


@functools.lru_cache(maxsize=None)
def _decode_jit(donate: bool, formats: DecoderCache | None):
    """:func:`_decode_chunk_impl` jitted, the cache (argument 2) donated if ``donate``, the new cache
    returned in ``formats`` (a :class:`DecoderCache` of formats; ``None``: left to the compiler, as
    inside a caller's own jit, whose formats rule)."""
    return jax.jit(_decode_chunk_impl, static_argnums=(0, 4, 5), donate_argnums=(2,) if donate else (),
                   out_shardings=None if formats is None else (None, formats))


def decode_chunk(decoder: WanVAEDecoder, cache: DecoderCache, latents, *, per_frame: bool = True,
                 donate_cache: bool = False, backend: str = "auto") -> tuple[Array, DecoderCache]:
    """Jitted :meth:`WanVAEDecoder.__call__`: ``(frames, cache)`` of the next chunk of normalised
    latents ``[F, h, w, z_dim]`` (or ``[B, F, h, w, z_dim]`` with a cache from
    ``decoder_init_cache(..., batch_size=B)``). Compiles once per (started, chunk shape).

    The cache is large at full size (Wan 2.1 at 480x832: 32 entries, 3.52 GiB per stream in float32,
    1.76 GiB in bfloat16: :func:`stream_cache_bytes`, ``WanVAEConfig.cache_dtype``);
    ``donate_cache=True`` lets XLA write the new cache over the old one's buffers (the ``cache``
    passed in is then consumed and must not be used again). The new cache comes back on the old
    one's shardings in the row-major :func:`cache_formats` (a cache of tracers, inside a caller's
    jit: in what that jit asks). ``backend`` (a name of :data:`pallas_kernels.backend.BACKEND_NAMES`;
    ``"auto"``: ``"pallas_tpu"`` on TPU, ``"xla"`` elsewhere) runs the 3x3x3 causal convolutions
    (:class:`CausalConv3d`; on TPU the Mosaic kernel for those of at least
    :data:`KERNEL_MIN_CHANNELS` input and output channels, ``docs/kernels.md``, Causal convolution)."""
    latents = jnp.asarray(latents)
    if latents.ndim not in (4, 5) or latents.shape[-1] != decoder.config.z_dim:
        raise ValueError(f"latents must be [F, h, w, {decoder.config.z_dim}] or [B, F, h, w, "
                         f"{decoder.config.z_dim}], got {latents.shape}")
    batched = cache.frames[0].ndim == 5
    if batched != (latents.ndim == 5):
        raise ValueError(f"a {'batched' if batched else 'single'} cache cannot decode latents of shape "
                         f"{latents.shape}")
    backend = resolve_backend(backend).name
    formats = None
    if all(isinstance(e, jax.Array) and not isinstance(e, jax.core.Tracer) for e in cache.frames):
        started = cache.started or latents.shape[-4] > 0  # a chunk with frames starts the stream
        formats = DecoderCache(cache_formats(cache.frames), started)
    graphdef, params = nnx.split(decoder)
    return _decode_jit(donate_cache, formats)(graphdef, params, cache, latents, per_frame, backend)


def decode_video(decoder: WanVAEDecoder, latents, *, per_frame: bool = True) -> Array:
    """A whole video ``[F, h, w, z_dim]`` (or batched) in one call: pixels ``[1 + 4 (F - 1), 8h,
    8w, 3]``."""
    latents = jnp.asarray(latents)
    cache = decoder_init_cache(decoder, latents.shape[-3], latents.shape[-2],
                               latents.shape[0] if latents.ndim == 5 else None)
    return decode_chunk(decoder, cache, latents, per_frame=per_frame, donate_cache=True)[0]


def init_random(config: WanVAEConfig, seed: int = 0) -> WanVAEDecoder:
    """A :class:`WanVAEDecoder` with random weights drawn on the host with NumPy
    (:func:`arkv_jax.models.io.init_random`, seeded): kernels ``N(0, 1 / fan_in)``, biases
    ``N(0, 0.01)``, norm gains 1."""
    def draw(names: tuple[str, ...], shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
        if names[-1] == "gamma":
            return np.ones(shape, np.float32)
        if names[-1].endswith("bias"):
            return 0.1 * rng.standard_normal(shape, np.float32)
        return rng.standard_normal(shape, np.float32) / np.float32(np.sqrt(np.prod(shape[:-1])))

    return io.init_random(WanVAEDecoder, config, draw, seed)


# ------------------------------------------------------------------------------------------------
# Checkpoints
# ------------------------------------------------------------------------------------------------


def _diffusers_name(names: Sequence[str]) -> str:
    """Our parameter path -> the diffusers ``AutoencoderKLWan`` state-dict key (``.weight`` /
    ``.bias`` / ``.gamma``)."""
    leaf = names[-1]
    if names[0] == "post_quant_conv":
        return f"post_quant_conv.{'weight' if leaf == 'kernel' else 'bias'}"
    parts = list(names[:-1])
    if parts[0] == "mid_resnets":
        parts = ["mid_block", "resnets", *parts[1:]]
    elif parts[0] == "mid_attention":  # norm.gamma, to_qkv_{kernel,bias}, proj_{kernel,bias}
        layer, leaf = ("norm", leaf) if leaf == "gamma" else leaf.rsplit("_", 1)
        parts = ["mid_block", "attentions", "0", layer]
    elif parts[0] == "up_blocks" and len(parts) > 2 and parts[2] == "upsampler":
        parts = [*parts[:2], "upsamplers", "0", *(["resample", "1"] if parts[3] == "conv" else parts[3:])]
    leaf = {"kernel": "weight", "bias": "bias", "gamma": "gamma"}[leaf]
    return ".".join(["decoder", *parts, leaf])


def _torch_shape(key: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape in a diffusers (or official) checkpoint of the parameter ``key`` of our ``shape``:
    conv weights ``[out, in, k...]`` (the attention's 1x1 convolutions ``[out, in, 1, 1]``), gains
    ``[C, 1, 1, 1]`` (``[C, 1, 1]`` in the per-frame attention), biases ``[C]``."""
    if len(shape) == 1:
        if key.endswith(".gamma"):
            return (*shape, 1, 1) if ".attentions." in key else (*shape, 1, 1, 1)
        return shape
    if len(shape) == 2:  # a 1x1 conv2d kept as a matrix [in, out]
        return (shape[1], shape[0], 1, 1)
    return (shape[-1], shape[-2], *shape[:-2])


def _torch_layout(value: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor of :func:`_torch_shape` in our layout ``shape``."""
    if len(shape) == 1:
        return value.reshape(shape)
    if len(shape) == 2:
        return value.reshape(value.shape[0], -1).T
    return np.transpose(value, (*range(2, value.ndim), 1, 0))  # [out, in, *k] -> [*k, in, out]


#: Key prefixes of a whole VAE checkpoint that the decoder does not read: the encoder and its quant
#: convolution (diffusers' ``quant_conv``, the official ``conv1``); every other tensor must be one of
#: the decoder's.
_NOT_DECODER = ("encoder.", "quant_conv.", "conv1.")


def from_diffusers_state_dict(state: Mapping[str, np.ndarray], config: WanVAEConfig, *,
                              source: str = "state dict") -> WanVAEDecoder:
    """A :class:`WanVAEDecoder` of ``config`` holding the decoder weights of a diffusers-named
    ``AutoencoderKLWan`` state dict (the encoder's weights are not read).

    Raises:
      CheckpointKeyError: tensors missing or left over, e.g. decoder weights the config does not
        have (a Wan 2.2 VAE; :func:`arkv_jax.models.io.check_tensors`, naming ``source`` and the keys).
      ValueError: tensors of the wrong shape (each named, with the shape expected).
    """
    state = {k: v for k, v in state.items() if not k.startswith(_NOT_DECODER)}
    graphdef, abstract = io.abstract(WanVAEDecoder, config)
    expected = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(abstract):
        key = _diffusers_name(io.path_names(path))
        expected[key] = _torch_shape(key, tuple(leaf.shape))
    io.check_tensors({k: io.shape_of(v) for k, v in state.items()}, expected, source=source,
                     model=f"a Wan 2.1 VAE decoder of base_dim {config.base_dim}, dim_mult {config.dim_mult}")

    def fill(names: tuple[str, ...], leaf: jax.ShapeDtypeStruct) -> Array:
        return jnp.asarray(_torch_layout(io.to_numpy(state[_diffusers_name(names)]), tuple(leaf.shape)), leaf.dtype)

    return io.build(graphdef, abstract, fill)


def official_vae_names(config: WanVAEConfig) -> dict[str, str]:
    """diffusers ``AutoencoderKLWan`` key -> official ``WanVAE_`` key (Wan's ``wan/modules/vae.py``),
    for every weight of the decoder of ``config`` and the post-quant convolution.

    Official layout: ``conv2`` (post-quant), ``decoder.conv1``, ``decoder.middle.{0,2}`` residual
    blocks around ``decoder.middle.1`` attention, ``decoder.upsamples.{k}`` flat (each level's
    ``num_res_blocks + 1`` residual blocks, then its resampler), residual blocks as
    ``residual.{0: norm1, 2: conv1, 3: norm2, 6: conv2}`` and ``shortcut``, resamplers as
    ``resample.1`` (the 2-D convolution) and ``time_conv``, ``decoder.head.{0: norm, 2: conv}``.
    """
    _, abstract = io.abstract(WanVAEDecoder, config)
    keys = [_diffusers_name(io.path_names(path)) for path, _ in jax.tree_util.tree_leaves_with_path(abstract)]
    residual = {"norm1.gamma": "residual.0.gamma", "conv1.weight": "residual.2.weight",
                "conv1.bias": "residual.2.bias", "norm2.gamma": "residual.3.gamma",
                "conv2.weight": "residual.6.weight", "conv2.bias": "residual.6.bias",
                "conv_shortcut.weight": "shortcut.weight", "conv_shortcut.bias": "shortcut.bias"}
    per_level = config.num_res_blocks + 2  # residual blocks and the resampler of each level

    def official(key: str) -> str:
        if key.startswith("post_quant_conv."):
            return "conv2." + key.split(".")[-1]
        if m := re.fullmatch(r"decoder\.conv_in\.(\w+)", key):
            return f"decoder.conv1.{m.group(1)}"
        if m := re.fullmatch(r"decoder\.conv_out\.(\w+)", key):
            return f"decoder.head.2.{m.group(1)}"
        if key == "decoder.norm_out.gamma":
            return "decoder.head.0.gamma"
        if m := re.fullmatch(r"decoder\.mid_block\.resnets\.(\d)\.(.+)", key):
            return f"decoder.middle.{2 * int(m.group(1))}.{residual[m.group(2)]}"
        if m := re.fullmatch(r"decoder\.mid_block\.attentions\.0\.(.+)", key):
            return f"decoder.middle.1.{m.group(1)}"
        if m := re.fullmatch(r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", key):
            return f"decoder.upsamples.{int(m.group(1)) * per_level + int(m.group(2))}.{residual[m.group(3)]}"
        if m := re.fullmatch(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.(.+)", key):
            return f"decoder.upsamples.{int(m.group(1)) * per_level + per_level - 1}.{m.group(2)}"
        raise AssertionError(key)  # every key of the decoder is covered above

    return {key: official(key) for key in keys}


def convert_wan_vae_state_dict(state: Mapping[str, np.ndarray], config: WanVAEConfig) -> dict[str, np.ndarray]:
    """The decoder part of an official ``Wan2.1_VAE.pth`` state dict under diffusers' names
    (:func:`official_vae_names` inverted); encoder and quant-conv weights are dropped, keys the
    map does not know keep their names (so :func:`from_diffusers_state_dict` reports them as left
    over)."""
    inverse = {v: k for k, v in official_vae_names(config).items()}
    return {inverse.get(key, key): value for key, value in state.items() if not key.startswith(_NOT_DECODER)}


def config_from_diffusers(config: Mapping, *, dtype: str = "float32") -> WanVAEConfig:
    """A :class:`WanVAEConfig` from an ``AutoencoderKLWan`` ``config.json`` dict.

    Raises:
      ValueError: a Wan 2.2-style (residual, patchified) VAE, decoder attention, or a field out
        of range.
    """
    if config.get("is_residual") or config.get("patch_size"):
        raise ValueError("a Wan 2.2-style VAE (is_residual / patch_size) is not the Wan 2.1 decoder this module has")
    if config.get("attn_scales"):
        raise ValueError(f"attn_scales={config['attn_scales']}: the Wan 2.1 decoder has attention in its middle "
                         "block only")
    defaults = WanVAEConfig()
    temporal_down = config.get("temperal_downsample", (False, True, True))
    return WanVAEConfig(
        base_dim=int(config.get("decoder_base_dim") or config.get("base_dim", defaults.base_dim)),
        z_dim=int(config.get("z_dim", defaults.z_dim)),
        dim_mult=tuple(config.get("dim_mult", defaults.dim_mult)),
        num_res_blocks=int(config.get("num_res_blocks", defaults.num_res_blocks)),
        temporal_upsample=tuple(temporal_down)[::-1],
        out_channels=int(config.get("out_channels", 3)),
        latents_mean=tuple(config.get("latents_mean", defaults.latents_mean)),
        latents_std=tuple(config.get("latents_std", defaults.latents_std)),
        dtype=dtype)


#: Files a VAE checkpoint directory is read from, in order: the official file (the Wan 2.1
#: repository keeps it beside the DiT's weights), then diffusers' ``vae/`` files.
VAE_WEIGHT_PATTERNS = ("Wan2.1_VAE.pth", "diffusion_pytorch_model*.safetensors", "diffusion_pytorch_model*.bin")


def load_wan_vae(path: str | os.PathLike, config: WanVAEConfig | None = None, *, dtype: str | None = None,
                 cache_dtype: str | None = None) -> WanVAEDecoder:
    """A :class:`WanVAEDecoder` holding released Wan 2.1 VAE weights.

    Args:
      path: a diffusers ``AutoencoderKLWan`` directory (``config.json`` and
        ``diffusion_pytorch_model.safetensors``), one such weight file, or the official
        ``Wan2.1_VAE.pth`` (told apart by its key names).
      config: the decoder shape; default: the ``config.json`` in or beside ``path`` if there is
        one, else Wan 2.1's (:data:`VAE_CONFIGS` ``"wan2.1"``, the official file's).
      dtype: parameter dtype name (default ``config.dtype``, float32).
      cache_dtype: the stream cache's dtype name (default ``config.cache_dtype``: the compute dtype).

    Raises:
      FileNotFoundError, ValueError: see :func:`arkv_jax.models.io.read_state_dict`.
      CheckpointKeyError, ValueError: see :func:`from_diffusers_state_dict`; the messages name the file.
    """
    state, source = io.read_state_dict(path, patterns=VAE_WEIGHT_PATTERNS,
                                       keep=lambda k: not k.startswith(_NOT_DECODER))
    if config is None:
        diffusers_config = io.sibling_config(
            path, lambda c: c.get("_class_name") == "AutoencoderKLWan" or ("_class_name" not in c and "z_dim" in c))
        config = VAE_CONFIGS["wan2.1"] if diffusers_config is None else config_from_diffusers(diffusers_config)
    if dtype is not None:
        config = dataclasses.replace(config, dtype=dtype)
    if cache_dtype is not None:
        config = dataclasses.replace(config, cache_dtype=cache_dtype)
    if "decoder.conv1.weight" in state or any(re.match(r"decoder\.upsamples\.", k) for k in state):
        state = convert_wan_vae_state_dict(state, config)
    return from_diffusers_state_dict(state, config, source=source)


__all__ = [
    "CACHE_FRAMES", "DTYPES", "DecoderCache", "VAE_CONFIGS", "VAE_WEIGHT_PATTERNS", "WAN21_LATENTS_MEAN",
    "WAN21_LATENTS_STD", "WanVAEConfig", "WanVAEDecoder", "abstract_cache", "cache_formats", "config_from_diffusers",
    "convert_wan_vae_state_dict", "decode_chunk", "decode_video", "decoder_init_cache", "decoder_param_bytes",
    "from_diffusers_state_dict", "init_random", "load_wan_vae", "official_vae_names", "stream_cache_bytes",
]
