"""Wan 2.1 VAE decoder (arkv_jax.models.vae): parity with diffusers' AutoencoderKLWan, streaming.

A tiny random ``AutoencoderKLWan`` (Wan 2.1's layout at ``base_dim`` 8, 16 latent channels,
random per-channel latent statistics) is saved under a temporary directory, loaded with
:func:`load_wan_vae` (diffusers layout, and the official ``Wan2.1_VAE.pth`` layout made by renaming
its keys) and compared with diffusers' ``decode`` in float32: the whole video, and the same video
decoded chunk by chunk through the explicit cache, to 1e-4; streaming equals the whole-video decode
to float rounding. A bfloat16 stream cache (float32 or bfloat16 compute) streams within measured
bounds of diffusers' float32 decode, bounds a wrong cache breaks. Without torch/diffusers (Python
3.12 CI) the torch-free tests run.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arkv_jax.models import io, vae
from pallas_kernels import causal_conv, tpu_aot

TOL = 1e-4
H, W = 4, 6  # latent frame: 32 x 48 pixels
NUM_FRAMES = 7  # latent frames: 1 + 4 * 6 = 25 pixel frames
CHUNKS = (1, 3, 3)  # the stream's chunks: 1, 12 and 12 pixel frames

#: (dtype, cache_dtype) -> bounds on the (max abs, mean abs) pixel error of the CHUNKS stream vs
#: diffusers' float32 decode, about 3x what was measured on this model (jax 0.10.2, XLA:CPU; a
#: standalone run gave up to 10 % more): float32 everything 5.1e-6 / 5.7e-7 (TOL above); float32
#: compute + bfloat16 cache 1.33e-2 / 1.40e-3; bfloat16 compute and cache 7.9e-2 / 8.3e-3. The
#: bfloat16-cache decoder with its cache zeroed at each chunk start, its two frames swapped or its
#: older frame lost errs by about 1.5 / 0.25 (test_bfloat16_cache_bound_catches_a_wrong_cache).
LOW_PRECISION_BOUNDS = {("float32", "bfloat16"): (5e-2, 5e-3), ("bfloat16", "bfloat16"): (0.25, 2.5e-2)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(diffusers model, its directory, normalised latents, diffusers' pixels [T, H, W, 3])."""
    torch = pytest.importorskip("torch")
    diffusers = pytest.importorskip("diffusers")
    rng = np.random.default_rng(0)
    mean = rng.uniform(-1, 1, 16).round(4).tolist()
    std = rng.uniform(0.5, 3, 16).round(4).tolist()
    torch.manual_seed(0)
    model = diffusers.AutoencoderKLWan(base_dim=8, z_dim=16, latents_mean=mean, latents_std=std).eval()
    with torch.no_grad():  # non-trivial gains and biases (the defaults are 1 and 0)
        for name, p in model.named_parameters():
            if name.endswith("gamma"):
                p.mul_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    directory = tmp_path_factory.mktemp("vae") / "vae"
    model.save_pretrained(directory)
    latents = rng.standard_normal((NUM_FRAMES, H, W, 16)).astype(np.float32)
    z = latents * np.asarray(std, np.float32) + np.asarray(mean, np.float32)  # the pipelines' de-normalisation
    with torch.no_grad():
        pixels = model.decode(torch.from_numpy(z).permute(3, 0, 1, 2)[None]).sample[0].permute(1, 2, 3, 0).numpy()
    assert pixels.shape == (25, 32, 48, 3) and 0 < (np.abs(pixels) >= 1).mean() < 0.05  # little clamping
    return model, directory, latents, pixels


@pytest.fixture(scope="module")
def decoder(reference):
    return vae.load_wan_vae(reference[1])


@pytest.fixture(scope="module")
def whole(reference, decoder):
    """Our whole-video decode of the reference latents."""
    return np.asarray(vae.decode_video(decoder, reference[2]))


def _err(a, b):
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


def _stream(decoder, latents, tamper=lambda cache: cache) -> np.ndarray:
    """``latents`` decoded in CHUNKS through one cache, ``tamper(cache)`` before every chunk but
    the first."""
    cache = vae.decoder_init_cache(decoder, H, W)
    frames, start = [], 0
    for i, size in enumerate(CHUNKS):
        out, cache = vae.decode_chunk(decoder, cache if i == 0 else tamper(cache), latents[start:start + size])
        frames.append(np.asarray(out))
        start += size
    return np.concatenate(frames)


def _errors(a, b) -> tuple[float, float]:
    """(max abs, mean abs) of ``a - b``."""
    diff = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
    return float(diff.max()), float(diff.mean())


@pytest.mark.slow
def test_loads_the_diffusers_config(reference, decoder):
    model = reference[0]
    assert decoder.config == vae.WanVAEConfig(base_dim=8, latents_mean=tuple(model.config.latents_mean),
                                              latents_std=tuple(model.config.latents_std))
    assert decoder.config.num_pixel_frames(NUM_FRAMES, True) == 25


@pytest.mark.slow
def test_whole_video_matches_diffusers(reference, whole):
    pixels = reference[3]
    assert whole.shape == pixels.shape and whole.dtype == np.float32
    print(f"VAE whole-video decode vs diffusers: max abs err {_err(whole, pixels):.3e}")
    assert _err(whole, pixels) < TOL


@pytest.mark.slow
def test_streaming_matches_diffusers_and_the_whole_video(reference, decoder, whole):
    _, _, latents, pixels = reference
    cache = vae.decoder_init_cache(decoder, H, W)
    assert not cache.started and all(not np.asarray(f).any() for f in cache.frames)
    frames, start = [], 0
    for size in CHUNKS:
        out, cache = vae.decode_chunk(decoder, cache, latents[start:start + size])
        assert out.shape[0] == decoder.config.num_pixel_frames(size, start == 0) and cache.started
        frames.append(np.asarray(out))
        start += size
    stream = np.concatenate(frames)
    print(f"VAE streaming decode {CHUNKS} vs diffusers: max abs err {_err(stream, pixels):.3e}, mean abs err "
          f"{_errors(stream, pixels)[1]:.3e}; vs whole-video decode {_err(stream, whole):.3e}")
    assert _err(stream, pixels) < TOL
    assert _err(stream, whole) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("dtype, cache_dtype", list(LOW_PRECISION_BOUNDS))
def test_bfloat16_cache_streams_close_to_diffusers(reference, dtype, cache_dtype):
    _, directory, latents, pixels = reference
    decoder = vae.load_wan_vae(directory, dtype=dtype, cache_dtype=cache_dtype)
    assert decoder.config.dtype == dtype and decoder.config.stored_cache_dtype == jnp.bfloat16
    assert all(f.dtype == jnp.bfloat16 for f in vae.decoder_init_cache(decoder, H, W).frames)
    stream = _stream(decoder, latents)
    assert stream.dtype == np.float32 and stream.shape == pixels.shape
    max_err, mean_err = _errors(stream, pixels)
    print(f"VAE streaming decode {CHUNKS}, {dtype} compute, {cache_dtype} cache, vs diffusers float32: "
          f"max abs err {max_err:.3e}, mean abs err {mean_err:.3e}")
    max_bound, mean_bound = LOW_PRECISION_BOUNDS[dtype, cache_dtype]
    assert max_err < max_bound and mean_err < mean_bound


@pytest.mark.slow
def test_bfloat16_cache_bound_catches_a_wrong_cache(reference):
    """The float32-compute, bfloat16-cache bound fails for a cache reset to zeros between chunks
    (a stream restarted mid-way) and for one whose two frames are swapped."""
    _, directory, latents, pixels = reference
    decoder = vae.load_wan_vae(directory, cache_dtype="bfloat16")
    max_bound, mean_bound = LOW_PRECISION_BOUNDS["float32", "bfloat16"]
    wrong = {"zeroed": lambda c: vae.DecoderCache(tuple(jnp.zeros_like(f) for f in c.frames), started=True),
             "swapped": lambda c: vae.DecoderCache(tuple(f[::-1] for f in c.frames), started=True)}
    for name, tamper in wrong.items():
        max_err, mean_err = _errors(_stream(decoder, latents, tamper), pixels)
        assert max_err > 10 * max_bound and mean_err > 10 * mean_bound, (name, max_err, mean_err)


def test_official_checkpoint_layout(reference, decoder, tmp_path):
    """Wan2.1_VAE.pth names: made from the diffusers ones through the inverse of our map, which
    diffusers' own converter (convert_wan_vae_to_diffusers) must map back."""
    torch = pytest.importorskip("torch")
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    state = reference[0].state_dict()
    decoder_keys = {k for k in state if k.startswith(("decoder.", "post_quant_conv."))}
    names = vae.official_vae_names(decoder.config)
    assert set(names) == decoder_keys
    official = {names[k]: state[k].clone() for k in decoder_keys}
    back = convert_wan_vae_to_diffusers(dict(official))
    assert set(back) == decoder_keys and all(back[k] is official[names[k]] for k in decoder_keys)

    # Encoder weights in the file are ignored.
    official.update({"encoder.conv1.weight": torch.zeros(8, 3, 3, 3, 3), "conv1.weight": torch.zeros(32, 32, 1, 1, 1)})
    torch.save(official, tmp_path / "Wan2.1_VAE.pth")
    loaded = vae.load_wan_vae(tmp_path / "Wan2.1_VAE.pth", decoder.config)
    assert loaded.config == decoder.config
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(decoder)):  # so it decodes as `decoder` does
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # The Wan 2.1 repository's layout: the VAE's .pth beside the DiT's weights and config.json.
    (tmp_path / "diffusion_pytorch_model.safetensors").write_bytes(b"not read")
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "WanModel", "dim": 1536}))
    assert vae.load_wan_vae(tmp_path, decoder.config).config == decoder.config

    # Without a config the official file is taken for Wan 2.1's full-size VAE: a named shape error.
    with pytest.raises(ValueError, match=r"Wan2.1_VAE.pth: \d+ tensors do not have the shape .*"
                                         r"decoder.conv_in.weight: \[32, 16, 3, 3, 3\], expected \[384, 16, 3, 3, 3\]"):
        vae.load_wan_vae(tmp_path / "Wan2.1_VAE.pth")
    official["decoder.upsamples.99.residual.0.gamma"] = torch.ones(4)
    torch.save(official, tmp_path / "bad.pth")
    with pytest.raises(KeyError, match=r"bad.pth: 1 tensors are left over \(not parameters of a Wan 2.1 VAE decoder"
                                       r".*\): decoder.upsamples.99.residual.0.gamma$"):
        vae.load_wan_vae(tmp_path / "bad.pth", decoder.config)


def test_safetensors_file_and_missing_weights(reference, decoder, tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    model = reference[0]
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    (tmp_path / "config.json").write_text((reference[1] / "config.json").read_text())
    safetensors_torch.save_file(state, tmp_path / "vae.safetensors")
    assert vae.load_wan_vae(tmp_path / "vae.safetensors").config == decoder.config
    del state["decoder.up_blocks.1.resnets.0.conv_shortcut.bias"]
    safetensors_torch.save_file(state, tmp_path / "vae.safetensors")
    with pytest.raises(KeyError, match=r"vae.safetensors: 1 tensors the model needs are missing: "
                                       r"decoder.up_blocks.1.resnets.0.conv_shortcut.bias$"):
        vae.load_wan_vae(tmp_path / "vae.safetensors")


def test_default_statistics_are_diffusers_defaults():
    diffusers = pytest.importorskip("diffusers")
    import inspect

    defaults = inspect.signature(diffusers.AutoencoderKLWan.__init__).parameters
    assert vae.WAN21_LATENTS_MEAN == tuple(defaults["latents_mean"].default)
    assert vae.WAN21_LATENTS_STD == tuple(defaults["latents_std"].default)
    assert vae.config_from_diffusers({}) == vae.VAE_CONFIGS["wan2.1"]


# ------------------------------------------------------------------------------------------------
# Without torch
# ------------------------------------------------------------------------------------------------

SMALL = vae.WanVAEConfig(base_dim=4, z_dim=4, dim_mult=(1, 2), temporal_upsample=(True,), num_res_blocks=1,
                         latents_mean=(0.1, -0.2, 0.3, 0.0), latents_std=(1.5, 0.5, 2.0, 1.0))


@pytest.mark.slow
def test_random_decoder_stream_equals_whole_video():
    """Two levels, one temporal upsampler: 2 pixel frames per latent frame after the first."""
    decoder = vae.init_random(SMALL, seed=1)
    latents = np.random.default_rng(1).standard_normal((6, 3, 5, 4)).astype(np.float32)
    whole = np.asarray(vae.decode_video(decoder, latents))
    assert whole.shape == (SMALL.num_pixel_frames(6, True), 6, 10, 3) == (11, 6, 10, 3)
    assert np.isfinite(whole).all() and np.abs(whole).max() <= 1 and whole.std() > 1e-3
    cache = vae.decoder_init_cache(decoder, 3, 5)
    frames = []
    for chunk in (latents[:1], latents[1:1], latents[1:6]):  # the first frame alone, an empty chunk, the rest
        out, cache = vae.decode_chunk(decoder, cache, chunk)
        frames.append(np.asarray(out))
    assert [f.shape[0] for f in frames] == [1, 0, 10]
    np.testing.assert_allclose(np.concatenate(frames), whole, atol=1e-5, rtol=0)
    # Causal: the pixels of the first frames do not depend on later latents.
    changed = latents.copy()
    changed[3:] += 1.0
    changed_pixels = np.asarray(vae.decode_video(decoder, changed))
    np.testing.assert_allclose(changed_pixels[:5], whole[:5], atol=1e-6, rtol=0)
    assert np.abs(changed_pixels[5:] - whole[5:]).max() > 1e-2


@pytest.mark.slow
def test_batched_stream_compiles_once_per_phase():
    """Two streams side by side (vmap), chunk by chunk: each equals its own whole-video decode;
    the later chunks reuse one compilation."""
    decoder = vae.init_random(SMALL, seed=2)
    batch = np.random.default_rng(2).standard_normal((2, 6, 3, 5, 4)).astype(np.float32)
    cache = vae.decoder_init_cache(decoder, 3, 5, batch_size=2)
    assert cache.frames[0].shape == (2, 2, 3, 5, 4)
    decode = vae._decode_jit(True, vae.DecoderCache(vae.cache_formats(cache.frames), started=True))
    traces = decode._cache_size()
    frames = []
    for start in range(0, 6, 2):
        old = cache
        out, cache = vae.decode_chunk(decoder, cache, batch[:, start:start + 2], per_frame=False, donate_cache=True)
        assert old.frames[0].is_deleted()  # donated: the new cache took its buffers
        frames.append(np.asarray(out))
    assert decode._cache_size() - traces == 2  # the first chunk, then one for all later ones
    stream = np.concatenate(frames, axis=1)
    assert stream.shape == (2, 11, 6, 10, 3)
    whole = np.asarray(vae.decode_video(decoder, batch))
    np.testing.assert_allclose(stream, whole, atol=1e-5, rtol=0)
    np.testing.assert_allclose(whole[1], np.asarray(vae.decode_video(decoder, batch[1])), atol=1e-5, rtol=0)


def test_the_upsampler_convolution_is_the_kernels_with_the_modules_parameters():
    """``UpsampleConv2d`` convolves the nearest-2x upsampled input with its kernel and bias
    (:func:`pallas_kernels.upsample_conv.upsample_conv2d`; the kernel's own tests check that
    against the definition), on XLA below :data:`vae.KERNEL_MIN_CHANNELS`."""
    from flax import nnx

    from pallas_kernels.upsample_conv import upsample_conv2d

    conv = vae.UpsampleConv2d(6, 5, dtype=jnp.float32, rngs=nnx.Rngs(3))
    conv.bias[...] = jnp.arange(5, dtype=jnp.float32)
    x = jax.random.normal(jax.random.key(4), (2, 5, 7, 6))
    want = upsample_conv2d(x, conv.kernel[...], conv.bias[...], backend="xla")
    np.testing.assert_array_equal(conv(x, "pallas_tpu"), want)  # 6 and 5 channels: XLA


def test_cache_shape_and_input_errors():
    decoder = vae.init_random(SMALL)
    cache = vae.decoder_init_cache(decoder, 3, 5)
    # conv_in, 2 mid resnets x 2, 2 up blocks x 2 resnets x 2, the time_conv, conv_out
    assert len(cache.frames) == 1 + 4 + 8 + 1 + 1
    assert cache.frames[0].shape == (2, 3, 5, 4) and cache.frames[-1].shape == (2, 6, 10, 4)
    with pytest.raises(ValueError, match=r"latents must be \[F, h, w, 4\]"):
        vae.decode_chunk(decoder, cache, np.zeros((2, 3, 5, 16), np.float32))
    with pytest.raises(ValueError, match="cache entry 0 has shape"):
        vae.decode_chunk(decoder, cache, np.zeros((1, 4, 5, 4), np.float32))
    with pytest.raises(ValueError, match="single cache cannot decode"):
        vae.decode_chunk(decoder, cache, np.zeros((2, 1, 3, 5, 4), np.float32))
    with pytest.raises(ValueError, match="temporal_upsample needs one entry"):
        vae.WanVAEConfig(dim_mult=(1, 2), temporal_upsample=(True, True))
    with pytest.raises(ValueError, match=r"cache_dtype='float16' is not one of \('float32', 'bfloat16'\) "
                                         r"\(or None: the compute dtype\)"):
        vae.WanVAEConfig(cache_dtype="float16")
    with pytest.raises(ValueError, match=r"dtype='fp32' is not one of \('float32', 'bfloat16'\)$"):
        vae.WanVAEConfig(dtype="fp32")
    bf16_cache = vae.init_random(dataclasses.replace(SMALL, cache_dtype="bfloat16"))
    with pytest.raises(ValueError, match="cache entry 0 is float32; the decoder stores its cache in bfloat16"):
        vae.decode_chunk(bf16_cache, cache, np.zeros((1, 3, 5, 4), np.float32))
    with pytest.raises(ValueError, match="Wan 2.2-style"):
        vae.config_from_diffusers({"is_residual": True})


def test_stream_cache_bytes_is_the_init_cache():
    """stream_cache_bytes and decoder_param_bytes (shapes only) equal the bytes of a real cache and
    decoder; a bfloat16 cache is half a float32 one under either compute dtype."""
    sizes = {}
    for dtype, cache_dtype in (("float32", None), ("float32", "bfloat16"), ("bfloat16", None), ("bfloat16", "float32")):
        config = dataclasses.replace(SMALL, dtype=dtype, cache_dtype=cache_dtype)
        decoder = vae.init_random(config)
        cache = vae.decoder_init_cache(decoder, 3, 5)
        assert {f.dtype for f in cache.frames} == {config.stored_cache_dtype}
        sizes[dtype, cache_dtype] = vae.stream_cache_bytes(config, 3, 5)
        assert sizes[dtype, cache_dtype] == sum(f.nbytes for f in cache.frames) > 0
        batched = vae.decoder_init_cache(decoder, 3, 5, batch_size=3)
        assert sum(f.nbytes for f in batched.frames) == 3 * sizes[dtype, cache_dtype]
        assert vae.decoder_param_bytes(config) == sum(p.nbytes for p in jax.tree.leaves(decoder))
    f32 = sizes["float32", None]
    assert sizes["float32", "bfloat16"] == sizes["bfloat16", None] == f32 // 2 and sizes["bfloat16", "float32"] == f32
    assert vae.stream_cache_bytes(SMALL, 6, 10) == 4 * f32  # every entry is [2, a h, a w, C]
    # Wan 2.1 at 480x832 (latents 60x104): 32 entries, 3.52 GiB per stream in float32, 1.76 GiB in bfloat16.
    wan = vae.VAE_CONFIGS["wan2.1"]
    assert vae.stream_cache_bytes(wan, 60, 104) == 3_777_146_880
    assert vae.stream_cache_bytes(dataclasses.replace(wan, cache_dtype="bfloat16"), 60, 104) == 1_888_573_440
    # In a TPU's HBM, row-major: the 96- and 192-channel entries take 128 and 256 lanes, conv_in's 16 take 128.
    assert vae.stream_cache_bytes(dataclasses.replace(wan, cache_dtype="bfloat16"), 60, 104,
                                  tpu_hbm=True) == 2_408_939_520
    small = vae.init_random(SMALL)
    assert vae.stream_cache_bytes(SMALL, 3, 5, tpu_hbm=True) == sum(
        causal_conv.row_major_tpu_bytes(f.shape, f.dtype) for f in vae.decoder_init_cache(small, 3, 5).frames)
    with pytest.raises(ValueError, match="latent_width"):
        vae.stream_cache_bytes(SMALL, 3, 0)


def test_the_cache_is_kept_row_major_on_its_sharding():
    """The cache is made, and comes back from every chunk (donated or not, batched or not), on the
    sharding it was made on in the row-major format; abstract_cache gives the same entries."""
    decoder = vae.init_random(SMALL)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[-1])
    latents = np.zeros((1, 2, 3, 5, 4), np.float32)
    for batch_size in (None, 1):
        cache = vae.decoder_init_cache(decoder, 3, 5, batch_size, sharding=sharding)
        abstract = vae.abstract_cache(SMALL, 3, 5, batch_size, sharding=sharding)
        assert [(e.shape, e.dtype) for e in abstract.frames] == [(e.shape, e.dtype) for e in cache.frames]
        chunk = latents if batch_size else latents[0]
        for donate in (False, True):
            for entry, fmt in zip(cache.frames, vae.cache_formats(cache.frames, sharding), strict=True):
                assert entry.sharding == sharding and entry.format.layout.major_to_minor == fmt.layout.major_to_minor
                assert fmt.layout.major_to_minor == tuple(range(entry.ndim))
            _, cache = vae.decode_chunk(decoder, cache, chunk, donate_cache=donate)
            assert cache.started
    with pytest.raises(ValueError, match="batch_size must be"):
        vae.abstract_cache(SMALL, 3, 5, 0)


def test_decode_chunk_takes_auto():
    """``backend="auto"`` (the default) is the XLA path off TPU: the same pixels as ``"xla"``."""
    decoder = vae.init_random(SMALL, seed=5)
    latents = np.random.default_rng(5).standard_normal((2, 3, 5, 4)).astype(np.float32)
    auto, _ = vae.decode_chunk(decoder, vae.decoder_init_cache(decoder, 3, 5), latents)
    xla, _ = vae.decode_chunk(decoder, vae.decoder_init_cache(decoder, 3, 5), latents, backend="xla")
    np.testing.assert_array_equal(auto, xla)


@pytest.mark.slow
def test_bfloat16_decoder_streams():
    """bfloat16 weights and activations (norms and softmax in float32): float32 pixels close to
    the float32 decoder's, decoded in two chunks through a bfloat16 cache."""
    latents = np.random.default_rng(3).standard_normal((3, 3, 5, 4)).astype(np.float32)
    reference = np.asarray(vae.decode_video(vae.init_random(SMALL, seed=3), latents, per_frame=False))
    decoder = vae.init_random(dataclasses.replace(SMALL, dtype="bfloat16"), seed=3)
    cache = vae.decoder_init_cache(decoder, 3, 5)
    assert all(f.dtype == jnp.bfloat16 for f in cache.frames)
    first, cache = vae.decode_chunk(decoder, cache, latents[:1], per_frame=False)
    rest, cache = vae.decode_chunk(decoder, cache, latents[1:], per_frame=False)
    out = np.concatenate([first, rest])
    assert out.dtype == np.float32 and out.shape == reference.shape
    assert np.abs(out - reference).max() < 0.1


@pytest.mark.parametrize("minimum", [1, None], ids=["every-conv-on-the-kernel", "wide-convs-only"])
def test_tpu_convolution_backend_streams_as_xla(minimum, monkeypatch):
    """Under a TPU backend the 3x3x3 causal convolutions run the Mosaic kernel (interpreted here;
    all of them when the channel minimum is 1, conv_in's and conv_out's included; none of this
    decoder's 4 and 8 channels under the default 96), chunk after chunk through a cache of two
    streams (the kernel reads and writes each stream's entries in the batch's, in place): the
    pixels and the cache equal the XLA path's."""
    if minimum is not None:
        monkeypatch.setattr(vae, "KERNEL_MIN_CHANNELS", minimum)
    calls = []
    real = vae.causal_conv.IMPLEMENTATIONS["pallas_tpu_interpret"]
    monkeypatch.setattr(vae.causal_conv, "IMPLEMENTATIONS", {
        **vae.causal_conv.IMPLEMENTATIONS,
        "pallas_tpu_interpret": lambda *a, **k: calls.append(k["geom"]) or real(*a, **k)})
    decoder = vae.init_random(SMALL, seed=4)
    latents = np.random.default_rng(4).standard_normal((2, 3, 3, 5, 4)).astype(np.float32)
    outputs = {}
    for backend in ("xla", "pallas_tpu_interpret"):
        cache = vae.decoder_init_cache(decoder, 3, 5, batch_size=2)
        frames = []
        for chunk in (latents[:, :1], latents[:, 1:]):
            out, cache = vae.decode_chunk(decoder, cache, chunk, backend=backend)
            frames.append(np.asarray(out))
        outputs[backend] = np.concatenate(frames, axis=1), [np.asarray(f) for f in cache.frames]
    want, got = outputs["xla"], outputs["pallas_tpu_interpret"]
    np.testing.assert_allclose(got[0], want[0], atol=1e-5, rtol=0)
    for new, old in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(new, old, atol=1e-5, rtol=0)
    in_kernel = {(g.in_channels, g.out_channels) for g in calls}
    assert in_kernel == (set() if minimum is None else {(4, 8), (8, 8), (4, 4), (4, 3)})


# ------------------------------------------------------------------------------------------------
# libtpu compile-only: the jitted decode decode_chunk runs, for v5e and v6e
# ------------------------------------------------------------------------------------------------

needs_libtpu = pytest.mark.skipif(not tpu_aot.libtpu_available(),
                                  reason="libtpu is not installed (pip install -e '.[tpu]')")


def _entry_copies_of(hlo: str, names: list[str]) -> list[str]:
    """The ``copy`` instructions of the optimized HLO's entry computation whose operand is one of
    the parameters ``names`` (a relayout of that argument)."""
    entry = hlo[hlo.index("\nENTRY "):]
    entry = entry[:entry.index("\n}")]
    return [line.strip() for line in entry.splitlines()
            if " copy(" in line and any(f"copy(%{name}" in line for name in names)]


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("gen", ["v5e", "v6e"])
def test_the_tpu_decode_keeps_the_cache_in_place(gen):
    """Wan 2.1's decoder (bfloat16, a 64x128-pixel stream) as decode_chunk jits it on a TPU, with
    the cache decoder_init_cache makes there (row-major): the convolutions of 96+ channels run the
    kernel, the new cache comes back row-major over the donated one (every byte aliased, the bytes
    stream_cache_bytes(tpu_hbm=True) counts), and the entry relays out no cache entry the kernel
    reads (conv_in's 16-channel one, read by XLA, is its only copy)."""
    config = dataclasses.replace(vae.VAE_CONFIGS["wan2.1"], dtype="bfloat16")
    sharding = jax.sharding.SingleDeviceSharding(tpu_aot.compile_only_device(gen))
    graphdef, params = io.abstract(vae.WanVAEDecoder, config)
    params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=sharding), params)
    cache = vae.abstract_cache(config, 8, 16, 1, sharding=sharding, started=True)
    latents = jax.ShapeDtypeStruct((1, 1, 8, 16, config.z_dim), jnp.bfloat16, sharding=sharding)
    decode = vae._decode_jit(True, vae.DecoderCache(vae.cache_formats(cache.frames), started=True))
    with jax.default_device(next(iter(sharding.device_set))):
        compiled = decode.trace(graphdef, params, cache, latents, True, "pallas_tpu").lower().compile()
    hlo = compiled.as_text()
    assert causal_conv.KERNEL_PREFIX in hlo
    row_major = {tuple(range(5))}
    assert {f.layout.major_to_minor for f in compiled.input_formats[0][1].frames} == row_major
    assert {f.layout.major_to_minor for f in compiled.output_formats[1].frames} == row_major
    assert compiled.memory_analysis().alias_size_in_bytes == vae.stream_cache_bytes(config, 8, 16, tpu_hbm=True)
    names = [f"cache_frames_{i}_" for i in range(len(cache.frames))]
    copied = _entry_copies_of(hlo, names)
    assert len(copied) <= 1 and all("cache_frames_0_" in line for line in copied), copied
