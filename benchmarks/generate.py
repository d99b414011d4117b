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

* **pages**: the DiT part again over K/V pages stored as ``--kv-dtype`` (default ``int8``;
  ``none`` skips it) against pages in the model's dtype: two rollouts with the same seeds stepped in
  turn (interleaved medians), their time ratio and the largest difference of their latents after
  the same chunks.

Shapes: ``tiny`` (the DiT ``tiny`` with 16 latent channels, the VAE ``tiny``, umT5 ``tiny``: what
``generate --random-tiny`` runs; 3 Euler steps + commit) and ``small`` (the rollout benchmark's
small DiT, a VAE of base width 16, umT5 ``tiny`` widened to 64; 3 Euler steps + commit) run
anywhere; ``wan-1.3b`` (Wan 2.1's 1.3B DiT, cache preset and VAE at 480x832 in bfloat16, random
weights, Self-Forcing's 4 steps + commit; no text part: umT5-XXL's 5.7B random weights are not
drawn) is for a GPU or TPU and runs only when named. ``--quick`` runs ``tiny`` only; the default (``all``)
is ``tiny`` and ``small``.
Times are medians of ``--reps`` chunks (default 5) after the window has filled (at least two
warm-up chunks: the first and a later chunk each compile).

Run: ``python -m benchmarks.generate [--quick] [--shape tiny|small|wan-1.3b|all] [--sessions N]
[--kv-dtype int8|float8_e4m3fn|float8_e5m2|none]``.
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
    text: umt5.UMT5EncoderConfig | None
    sampler: Sampler = dataclasses.field(default_factory=lambda: Sampler(num_steps=3))

    def cache(self, sessions: int, kv_dtype: str | None = None) -> PagedKVCache:
        """A one-branch cache with text cross-attention for ``sessions`` sessions, pages stored as
        ``kv_dtype`` (``None``: the model's dtype)."""
        geometry = dataclasses.replace(self.geometry(), kv_dtype=kv_dtype)
        branches = (KVBranch("main"),)
        cross = (CrossAttentionSpec("text", self.model.text_tokens),)
        frame_bytes = int(np.prod(self.model.frame_shape)) * jnp.dtype(self.model.dtype).itemsize
        plan = rollout_plan(geometry, self.window, branches, cross, sessions, latent_frame_bytes=frame_bytes)
        return PagedKVCache(geometry, self.window, branches, cross, plan=plan)


_TINY, _WAN = get_preset("tiny"), get_preset("wan-1.3b")
SHAPES = {
    "tiny": Shape("tiny", dataclasses.replace(MODEL_CONFIGS["tiny"], in_channels=16), _TINY.geometry.block_size,
                  _TINY.geometry.frames_per_forward, _TINY.window, vae_lib.VAE_CONFIGS["tiny"],
                  dataclasses.replace(umt5.UMT5_CONFIGS["tiny"], text_len=MODEL_CONFIGS["tiny"].text_tokens)),
    "small": Shape("small", DiTConfig(num_layers=4, dim=256, num_heads=4, num_kv_heads=4, ffn_dim=1024,
                                      in_channels=16, patch_size=2, grid=(6, 10), text_dim=64, text_tokens=16,
                                      freq_dim=128), 16, 3, WindowPolicy(window_frames=9, sink_frames=3),
                   vae_lib.WanVAEConfig(base_dim=16),
                   dataclasses.replace(umt5.UMT5_CONFIGS["tiny"], dim=64, text_len=16)),
    "wan-1.3b": Shape("wan-1.3b", MODEL_CONFIGS["wan-1.3b"], _WAN.geometry.block_size,
                      _WAN.geometry.frames_per_forward, _WAN.window, vae_lib.WanVAEConfig(dtype="bfloat16"), None,
                      Sampler.self_forcing()),
}
#: The shapes ``--shape all`` (the default without ``--quick``) runs: those that fit a CPU's time.
CPU_SHAPES = ("tiny", "small")


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def text_ms_per_prompt(config: umt5.UMT5EncoderConfig, rollout: Rollout, reps: int) -> tuple[float, float]:
    """Milliseconds of one prompt's encoding, and of its encoding plus the DiT's text K/V of it: a
    random encoder over a prompt of half the text length, token ids drawn at random (no tokenizer)."""
    encoder = umt5.init_random(config, 0)
    rng = np.random.default_rng(0)
    ids = rng.integers(1, config.vocab_size, (1, config.text_len)).astype(np.int32)
    mask = (np.arange(config.text_len) < config.text_len // 2).astype(np.int32)[None]

    def encode():
        return umt5.encode_ids(encoder, ids, mask, config.text_len)

    def text_kv():
        return context_kv(rollout.chunk_config.graphdef, rollout.params, encode().astype(jnp.float32))

    text = harness.interleaved_medians({"encode": encode, "encode_kv": text_kv}, 4 * reps)
    return text["encode"] * 1e3, text["encode_kv"] * 1e3


def joined(rollout: Rollout, sessions: int) -> Rollout:
    """``rollout`` with sessions ``s0 .. s{sessions-1}`` joined (prompt ``i``, seed ``i``)."""
    for i in range(sessions):
        rollout.join(f"s{i}", f"prompt {i}", seed=i)
    return rollout


def warmup_chunks(shape: Shape) -> int:
    """Chunks before the timed ones: until the window is full, and at least two (the first chunk
    and a later one each compile)."""
    return max(2, -(-shape.window.resident_frames // shape.chunk_frames))


def kv_pages(shape: Shape, model, sessions: int, reps: int, kv_dtype: str) -> dict:
    """The DiT part over pages stored as ``kv_dtype`` against pages in the model's dtype: two
    rollouts of ``model``, the same sessions and seeds, stepped in turn."""
    rollouts = {name: joined(Rollout(model, shape.cache(sessions, dtype), shape.sampler, max_traces=1), sessions)
                for name, dtype in (("model_dtype", None), ("stored", kv_dtype))}
    latents = {}

    def step(name):
        def fn():
            latents[name] = rollouts[name].step().latents
            return latents[name]
        return fn

    for _ in range(warmup_chunks(shape) - 1):  # interleaved_medians steps each once more before timing
        for name in rollouts:
            step(name)()
    seconds = harness.interleaved_medians({name: step(name) for name in rollouts}, reps)
    reference, stored = (np.asarray(latents[name], np.float32) for name in ("model_dtype", "stored"))
    return {"kv_dtype": kv_dtype, "model_dtype": shape.model.dtype, "dit_ms": seconds["model_dtype"] * 1e3,
            "dit_ms_stored": seconds["stored"] * 1e3,
            "stored_vs_model_dtype": seconds["stored"] / seconds["model_dtype"],
            "latents_max_abs_diff": float(np.max(np.abs(stored - reference))),
            "latents_max_abs": float(np.max(np.abs(reference)))}


def run(shape: Shape, model, sessions: int, reps: int) -> dict:
    """Times the parts at ``shape`` for ``sessions`` sessions of ``model`` (a DiT of
    ``shape.model``; see the module docstring)."""
    decoder = vae_lib.init_random(shape.vae, 0)
    cache = shape.cache(sessions)
    rollout = Rollout(model, cache, shape.sampler, max_traces=1)
    encode_ms = text_ms = None
    if shape.text is not None:
        encode_ms, text_ms = text_ms_per_prompt(shape.text, rollout, reps)
    joined(rollout, sessions)
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

    for _ in range(warmup_chunks(shape)):
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
            "steps": shape.sampler.num_steps, "vae_share": vae_ms / (dit_ms + vae_ms),
            "video_frames_per_s": frames[0] / ((dit_ms + vae_ms) / 1e3),
            "video_frames_per_s_dit_only": frames[0] / (dit_ms / 1e3)}


def main(argv=None) -> None:
    args = harness.parse_args(__doc__.splitlines()[0], argv, extra=lambda p: (
        p.add_argument("--shape", choices=[*SHAPES, "all"], default=None,
                       help="shape(s) to run (default: tiny with --quick, else all: tiny and small; "
                            "wan-1.3b only when named)"),
        p.add_argument("--sessions", type=int, default=2, help="sessions in the batch (default 2)"),
        p.add_argument("--kv-dtype", default="int8", choices=["int8", "float8_e4m3fn", "float8_e5m2", "none"],
                       help="page dtype timed against the model dtype's pages (default int8; none: skip)")))
    names = [args.shape] if args.shape not in (None, "all") else (["tiny"] if args.quick and args.shape is None
                                                                   else list(CPU_SHAPES))
    reps = args.reps or 5
    figures = {}
    for name in names:
        model = init_random(SHAPES[name].model, 0)
        figures[name] = run(SHAPES[name], model, args.sessions, reps)
        if args.kv_dtype != "none":
            figures[name]["pages"] = kv_pages(SHAPES[name], model, args.sessions, reps, args.kv_dtype)
    print(f"per-chunk time, medians of {reps} chunks in steady state; {args.sessions} sessions per chunk, "
          "no CFG; text once per prompt (join or switch), not per chunk")
    rows = [[name, f"{f['pixels'][0]}x{f['pixels'][1]}", f["steps"], f["video_frames_per_chunk"], f["dit_ms"],
             f["vae_ms"], f"{100 * f['vae_share']:.0f}%", f["text_encode_ms_per_prompt"] or "-",
             f["text_encode_and_kv_ms_per_prompt"] or "-", f["switch_recache_ms"], f["video_frames_per_s"],
             f["video_frames_per_s_dit_only"]]
            for name, f in figures.items()]
    harness.print_table(["shape", "pixels", "steps", "video frames", "DiT ms", "VAE ms", "VAE share", "umT5 ms",
                         "umT5+KV ms", "switch ms", "frames/s", "frames/s DiT only"], rows)
    if args.kv_dtype != "none":
        print(f"\nDiT part over {args.kv_dtype} pages against pages in the model's dtype (in turn, medians)")
        harness.print_table(["shape", "DiT ms", f"DiT ms {args.kv_dtype}", "ratio", "latents max |diff|",
                             "latents max |x|"],
                            [[name, p["dit_ms"], p["dit_ms_stored"], p["stored_vs_model_dtype"],
                              p["latents_max_abs_diff"], p["latents_max_abs"]]
                             for name, p in ((n, f["pages"]) for n, f in figures.items())])
    harness.emit({"benchmark": "generate", "reps": reps, "shapes": figures})


if __name__ == "__main__":
    main()
