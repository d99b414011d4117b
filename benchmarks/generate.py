"""Per-chunk time of ``arkv-jax generate``'s parts: DiT denoise + commit, VAE decode, text encoding.

Users ask whether quoted frame rates include decoding; this measures each part of a chunk
separately, at the same shapes, in one run, and reports the VAE's share of a chunk's time:

* **DiT**: ``Rollout.step()`` for ``sessions`` sessions in one batch (denoise steps + commit
  forward + cache commit, latents on the host), in steady state (the window full: the chunks timed
  come after ``sink + window`` frames);
* **VAE**: the streaming decode (:func:`arkv_jax.models.vae.decode_chunk`, per-frame ``lax.scan``)
  of every session's chunk after the stream's first chunk (4 video frames per latent frame), uint8
  pixels on the host, as ``generate`` runs it;
* **text**: one prompt through a random umT5 encoder of the DiT's text width (token ids given, so
  no tokenizer) and the DiT's text K/V of it (``context_kv``), once per join or prompt switch, not
  per chunk; reported per prompt (interleaved medians of ``4 reps`` calls);
* **switch**: one session's prompt switch with KV recache (``Rollout.switch_prompt``, sink kept: the
  text K/V of the new prompt through the hash stand-in, the window's frames recomputed and swapped
  in), in steady state; once per switch, not per chunk.

Shapes: ``tiny`` (the DiT ``tiny`` with 16 latent channels, the VAE ``tiny``, umT5 ``tiny``: what
``generate --random-tiny`` runs) and ``small`` (the rollout benchmark's small DiT, a VAE of base width
16, umT5 ``tiny`` widened to 64). ``--quick`` runs ``tiny`` only. Times are medians of ``--reps``
chunks (default 5) after two warm-up chunks (the first and a later
chunk each compile).

Run: ``python -m benchmarks.generate [--quick] [--shape tiny|small|all] [--sessions N]``.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from arkv_jax.apps.generate import to_uint8
from arkv_jax.cache import PagedKVCache
from arkv_jax.conditioning import context_kv
from arkv_jax.config import CrossAttentionSpec, KVBranch, WindowPolicy
from arkv_jax.models import umt5
from arkv_jax.models import vae as vae_lib
from arkv_jax.models.dit import MODEL_CONFIGS, DiTConfig, init_random
from arkv_jax.planner import rollout_plan
from arkv_jax.presets import get_preset
from arkv_jax.rollout import Rollout
from arkv_jax.samplers import Sampler
from benchmarks import harness
from benchmarks import rollout as rollout_benchmark


@dataclasses.dataclass(frozen=True)
class Shape(rollout_benchmark.Shape):
    """A DiT and its cache layout (:class:`benchmarks.rollout.Shape`), a VAE decoder and a umT5
    encoder of the DiT's text width."""

    vae: vae_lib.WanVAEConfig
    text: umt5.UMT5EncoderConfig


_TINY = get_preset("tiny")
SHAPES = {
    "tiny": Shape("tiny", dataclasses.replace(MODEL_CONFIGS["tiny"], in_channels=16), _TINY.geometry.block_size,
                  _TINY.geometry.frames_per_forward, _TINY.window, vae_lib.VAE_CONFIGS["tiny"],
                  dataclasses.replace(umt5.UMT5_CONFIGS["tiny"], text_len=MODEL_CONFIGS["tiny"].text_tokens)),
    "small": Shape("small", DiTConfig(num_layers=4, dim=256, num_heads=4, num_kv_heads=4, ffn_dim=1024,
                                      in_channels=16, patch_size=2, grid=(6, 10), text_dim=64, text_tokens=16,
                                      freq_dim=128), 16, 3, WindowPolicy(window_frames=9, sink_frames=3),
                   vae_lib.WanVAEConfig(base_dim=16),
                   dataclasses.replace(umt5.UMT5_CONFIGS["tiny"], dim=64, text_len=16)),
}


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def run(shape: Shape, sessions: int, reps: int) -> dict:
    """Times the three parts at ``shape`` for ``sessions`` sessions (see the module docstring)."""
    model = init_random(shape.model, 0)
    decoder = vae_lib.init_random(shape.vae, 0)
    encoder = umt5.init_random(shape.text, 0)
    branches = (KVBranch("main"),)
    cross = (CrossAttentionSpec("text", shape.model.text_tokens),)
    geometry = shape.geometry()
    frame_bytes = int(np.prod(shape.model.frame_shape)) * jnp.dtype(shape.model.dtype).itemsize
    plan = rollout_plan(geometry, shape.window, branches, cross, sessions, latent_frame_bytes=frame_bytes)
    cache = PagedKVCache(geometry, shape.window, branches, cross, plan=plan)
    rollout = Rollout(model, cache, Sampler(num_steps=3), max_traces=1)
    rng = np.random.default_rng(0)

    # Text: a prompt of half the text length, token ids drawn at random (no tokenizer), then its K/V.
    text_len = shape.text.text_len
    ids = rng.integers(1, shape.text.vocab_size, (1, text_len)).astype(np.int32)
    mask = (np.arange(text_len) < text_len // 2).astype(np.int32)[None]
    graphdef = rollout.chunk_config.graphdef

    def encode():
        return umt5.encode_ids(encoder, ids, mask, text_len)

    def text_kv():
        return context_kv(graphdef, rollout.params, encode().astype(jnp.float32))

    text = harness.interleaved_medians({"encode": encode, "encode_kv": text_kv}, 4 * reps)
    encode_ms, text_ms = text["encode"] * 1e3, text["encode_kv"] * 1e3

    for i in range(sessions):
        rollout.join(f"s{i}", f"prompt {i}", seed=i)
    h, w, _ = shape.model.frame_shape
    caches = [vae_lib.decoder_init_cache(decoder, h, w) for _ in range(sessions)]

    def chunk() -> tuple[float, float, int]:
        start = time.perf_counter()
        result = rollout.step()
        dit = time.perf_counter() - start
        start = time.perf_counter()
        frames = 0
        for i in range(sessions):
            pixels, caches[i] = vae_lib.decode_chunk(decoder, caches[i], result.latents[i])
            frames += len(to_uint8(pixels))
        return dit, time.perf_counter() - start, frames

    fill = -(-shape.window.resident_frames // shape.chunk_frames)  # chunks until the window is full
    for _ in range(max(2, fill)):
        chunk()
    dits, vaes, frames = zip(*(chunk() for _ in range(reps)))
    dit_ms, vae_ms = _median_ms(list(dits)), _median_ms(list(vaes))

    def switch(k: int) -> float:
        start = time.perf_counter()
        rollout.switch_prompt("s0", f"switched prompt {k}")
        jax.block_until_ready(cache.pools)
        return time.perf_counter() - start

    switch(-1)  # compiles the recache forward
    switch_ms = _median_ms([switch(k) for k in range(reps)])
    return {"sessions": sessions, "chunk_frames": shape.chunk_frames, "video_frames_per_chunk": frames[0],
            "pixels": [h * decoder.config.spatial_factor, w * decoder.config.spatial_factor],
            "dit_ms": dit_ms, "vae_ms": vae_ms, "text_encode_ms_per_prompt": encode_ms,
            "text_encode_and_kv_ms_per_prompt": text_ms, "switch_recache_ms": switch_ms,
            "recached_frames": shape.window.max_history(shape.chunk_frames) - shape.window.sink_frames,
            "vae_share": vae_ms / (dit_ms + vae_ms),
            "video_frames_per_s": frames[0] / ((dit_ms + vae_ms) / 1e3),
            "video_frames_per_s_dit_only": frames[0] / (dit_ms / 1e3)}


def main(argv=None) -> None:
    args = harness.parse_args(__doc__.splitlines()[0], argv, extra=lambda p: (
        p.add_argument("--shape", choices=[*SHAPES, "all"], default=None,
                       help="shape(s) to run (default: tiny with --quick, all otherwise)"),
        p.add_argument("--sessions", type=int, default=2, help="sessions in the batch (default 2)")))
    names = [args.shape] if args.shape not in (None, "all") else (["tiny"] if args.quick and args.shape is None
                                                                   else list(SHAPES))
    reps = args.reps or 5
    figures = {name: run(SHAPES[name], args.sessions, reps) for name in names}
    print(f"per-chunk time, medians of {reps} chunks in steady state; {args.sessions} sessions per chunk, "
          "3 denoise steps + commit, no CFG; text once per prompt (join or switch), not per chunk")
    rows = [[name, f"{f['pixels'][0]}x{f['pixels'][1]}", f["video_frames_per_chunk"], f["dit_ms"], f["vae_ms"],
             f"{100 * f['vae_share']:.0f}%", f["text_encode_ms_per_prompt"], f["text_encode_and_kv_ms_per_prompt"],
             f["switch_recache_ms"], f["video_frames_per_s"], f["video_frames_per_s_dit_only"]]
            for name, f in figures.items()]
    harness.print_table(["shape", "pixels", "video frames", "DiT ms", "VAE ms", "VAE share", "umT5 ms",
                         "umT5+KV ms", "switch ms", "frames/s", "frames/s DiT only"], rows)
    harness.emit({"benchmark": "generate", "reps": reps, "shapes": figures})


if __name__ == "__main__":
    main()
