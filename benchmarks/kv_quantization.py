"""Attention-output error of quantized K/V pages (int8, fp8) by scale granularity, on real K/V.

The K/V are the model's own: the random ``small`` model of :mod:`benchmarks.rollout` (4 layers,
dim 256, 4 heads of 64, 60-token frames in 16-token pages, sink 3 + window 9, 3-frame chunks, CFG)
generates ``--chunks`` chunks with the dense rolling history of
:class:`benchmarks.rollout.ContiguousRollout` (float32), so its buffers hold each layer's clean,
post-RoPE history K/V exactly as the cache would store them. One more denoise forward (at t = 500)
records every layer's queries and current K/V (a ``jax.debug.callback`` in the history). Then, per
layer, the history is laid out as frame-aligned pages (each frame's last page zero-padded) and
stored each way:

``bf16``
    the history rounded to bfloat16 (the bf16 pool's own error: the reference point);
``<dtype>/page``
    quantized with one float32 scale per (layer, KV head, page) (:mod:`pallas_kernels.quantization`);
``<dtype>/token``
    one scale per (layer, KV head, page, slot): per token.

Attention of the recorded queries over ``[history, current chunk]`` (the chunk in float32, as the
kernels keep it in the compute dtype) is computed in float32 with the stored history and compared
with the float32 history: max and mean abs error over all layers, and the mean abs error relative
to the mean output magnitude. The table also gives each layout's bytes per history token per KV
head (values + scales) at this head dim and at Wan's (128).

Then whole paged rollouts: the ``tiny`` preset's two CFG sessions (float32 model, XLA backend) for
``--rollout-chunks`` chunks (default 16; 8 with ``--quick``) with the pages stored in float32,
bfloat16, int8 and each fp8, and each run's latents against the float32 pages' run:
``bf16_rollout_max_abs_diff``, ``int8_rollout_max_abs_diff``, ``fp8_rollout_max_abs_diff``
(float8_e4m3fn; e5m2 beside it).

``--quick`` (the CI form, under a minute on 2 cores) generates 5 chunks (the window is full after
4); the default 8. Run: ``python -m benchmarks.kv_quantization [--quick]``. The figures and the
choice they support are in ``docs/kernels.md`` (Quantized pages).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from arkv_jax.cache import PagedKVCache
from arkv_jax.config import CacheGeometry, CrossAttentionSpec, KVBranch, WindowPolicy
from arkv_jax.models import MODEL_CONFIGS
from arkv_jax.models.dit import init_random
from arkv_jax.models.loader import load_wan
from arkv_jax.nnx import masked_attention
from arkv_jax.planner import rollout_plan
from arkv_jax.presets import get_preset
from arkv_jax.reference import FullRecompute
from arkv_jax.rollout import Rollout
from arkv_jax.samplers import Sampler
from benchmarks import harness
from benchmarks.rollout import SHAPES, ContiguousHistory, ContiguousRollout
from pallas_kernels.common import pages_per_frame
from pallas_kernels.quantization import QUANTIZED_DTYPES, SCALE_ITEMSIZE, dequantize, quantize
from pallas_kernels.rope import prepare_qk

GRANULARITIES = {"page": (1, 3), "token": (3,)}
"""Axes of ``[frames * pages_per_frame, slot, kv_head, head_dim]`` history pages one scale covers."""


@struct.dataclass
class RecordingHistory(ContiguousHistory):
    """A :class:`~benchmarks.rollout.ContiguousHistory` that hands every layer's ``(layer, q, k,
    v)`` to ``record`` on the host."""

    record: object = struct.field(pytree_node=False, default=None)

    def attend(self, q, k, v, layer, rope=None, qk_norm=None):
        q, k = prepare_qk(q, k, rope, qk_norm)
        jax.debug.callback(self.record, layer, q, k, v)
        return super().attend(q, k, v, layer)


def capture(chunks: int) -> dict:
    """Generates ``chunks`` chunks of the ``small`` shape, then records one denoise forward.

    Returns ``{"history": (k, v) [L, rows, tokens, H, D], "current": {layer: (q, k, v)}, "shape"}``
    (float32 NumPy arrays; ``tokens`` the full window's history)."""
    shape = SHAPES["small"]
    cfg = shape.model
    sampler = Sampler(num_steps=3, guidance_scale=3.0)
    model = init_random(cfg, seed=0)
    prompts = ["a red fox running through snow"]
    reference = FullRecompute(model, shape.window, sampler, chunk_frames=shape.chunk_frames)
    text_kv = reference.text_kv(prompts)
    rollout = ContiguousRollout(model, shape, sampler, prompts, [0], text_kv)
    for _ in range(chunks):
        rollout.step()
    recorded = {}

    def record(layer, q, k, v):
        recorded[int(layer)] = tuple(np.asarray(x, np.float32) for x in (q, k, v))

    rows = rollout.k.shape[1]
    history = RecordingHistory(rollout.k, rollout.v, rollout.filled * cfg.tokens_per_frame, record)
    noise = jnp.repeat(jnp.asarray(rollout.noise()), sampler.num_branches, axis=0)
    first = jnp.full((rows,), rollout.first_frame, jnp.int32)
    t = jnp.full((rows, shape.chunk_frames), 500.0)
    jax.block_until_ready(model(noise, t, first, history, *text_kv))
    jax.effects_barrier()
    tokens = rollout.filled * cfg.tokens_per_frame
    return {"history": tuple(np.asarray(x[:, :, :tokens], np.float32) for x in (rollout.k, rollout.v)),
            "current": recorded, "shape": shape}


def to_pages(history: np.ndarray, tokens_per_frame: int, block_size: int) -> np.ndarray:
    """``[rows, frames * tpf, H, D]`` -> ``[rows, frames * ppf, block_size, H, D]``, each frame's
    last page zero-padded (the cache's frame-aligned pages)."""
    rows, tokens, heads, dim = history.shape
    ppf = pages_per_frame(tokens_per_frame, block_size)
    frames = history.reshape(rows, tokens // tokens_per_frame, tokens_per_frame, heads, dim)
    frames = np.pad(frames, ((0, 0), (0, 0), (0, ppf * block_size - tokens_per_frame), (0, 0), (0, 0)))
    return frames.reshape(rows, -1, block_size, heads, dim)


def from_pages(pages: np.ndarray, tokens_per_frame: int, block_size: int) -> np.ndarray:
    """The inverse of :func:`to_pages` (padding dropped)."""
    rows, _, _, heads, dim = pages.shape
    ppf = pages_per_frame(tokens_per_frame, block_size)
    frames = pages.reshape(rows, -1, ppf * block_size, heads, dim)[:, :, :tokens_per_frame]
    return frames.reshape(rows, -1, heads, dim)


def stored(history: np.ndarray, method: str, tokens_per_frame: int, block_size: int) -> np.ndarray:
    """``history`` as the pool of ``method`` gives it back (float32)."""
    if method == "bf16":
        return np.asarray(jnp.asarray(history).astype(jnp.bfloat16).astype(jnp.float32))
    dtype, granularity = method.split("/")
    # Batched over rows: page axes [rows, page, slot, H, D]; the group axes shift by one.
    axes = tuple(a + 1 for a in GRANULARITIES[granularity])
    pages = jnp.asarray(to_pages(history, tokens_per_frame, block_size))
    values, scale = quantize(pages, dtype, axes)
    return from_pages(np.asarray(dequantize(values, scale, axes)), tokens_per_frame, block_size)


def _attend(current, k_history, v_history) -> np.ndarray:
    """One layer's attention output (float64) of the current chunk ``(q, k, v)`` over a history."""
    q, k_cur, v_cur = current
    k = jnp.concatenate([jnp.asarray(k_history), k_cur], axis=1)
    v = jnp.concatenate([jnp.asarray(v_history), v_cur], axis=1)
    return np.asarray(masked_attention(jnp.asarray(q), k, v), np.float64)


def errors(captured: dict, methods) -> dict:
    """Per method: max and mean abs attention-output error over all layers against the float32
    history, the mean error relative to the mean output magnitude, and each layer's mean abs error
    (``per_layer_mean_abs``, layer order)."""
    shape = captured["shape"]
    tpf, block = shape.model.tokens_per_frame, shape.block_size
    k_hist, v_hist = captured["history"]
    out = {m: {"max": 0.0, "sum": 0.0, "count": 0, "scale_sum": 0.0, "layers": []} for m in methods}
    for layer, current in sorted(captured["current"].items()):
        exact = _attend(current, k_hist[layer], v_hist[layer])
        for method in methods:
            approx = _attend(current, stored(k_hist[layer], method, tpf, block),
                             stored(v_hist[layer], method, tpf, block))
            diff = np.abs(approx - exact)
            acc = out[method]
            acc["max"] = max(acc["max"], float(diff.max()))
            acc["sum"] += float(diff.sum())
            acc["count"] += diff.size
            acc["scale_sum"] += float(np.abs(exact).sum())
            acc["layers"].append(float(diff.mean()))
    return {m: {"max_abs": a["max"], "mean_abs": a["sum"] / a["count"], "mean_rel": a["sum"] / a["scale_sum"],
                "per_layer_mean_abs": a["layers"]} for m, a in out.items()}


def bytes_per_token(method: str, head_dim: int, block_size: int) -> float:
    """Stored bytes per history token per KV head (K or V), scales included."""
    if method == "bf16":
        return 2.0 * head_dim
    granularity = method.split("/")[1]
    per_scale_tokens = block_size if granularity == "page" else 1
    return head_dim + SCALE_ITEMSIZE / per_scale_tokens


def paged_rollout(model, setup: "RolloutSetup", kv_dtype: str | None, chunks: int, backend: str = "xla"
                  ) -> np.ndarray:
    """``[2, chunks * F, H, W, C]``: two CFG sessions of ``setup`` over ``chunks`` chunks on
    ``backend``, their pages stored as ``kv_dtype`` (``None``: the model's dtype)."""
    geometry = dataclasses.replace(setup.geometry, kv_dtype=kv_dtype)
    plan = rollout_plan(geometry, setup.window, CFG_BRANCHES, setup.cross_attention, 2)
    cache = PagedKVCache(geometry, setup.window, CFG_BRANCHES, setup.cross_attention, plan=plan, backend=backend)
    rollout = Rollout(model, cache, setup.sampler, max_traces=1)
    for sid, (prompt, seed) in ROLLOUT_PROMPTS.items():
        rollout.join(sid, prompt, seed=seed)
    for _ in range(chunks):
        rollout.step()
    return np.stack([rollout.leave(sid) for sid in ROLLOUT_PROMPTS])


@dataclasses.dataclass(frozen=True)
class RolloutSetup:
    """A cache shape and sampler for :func:`paged_rollout` (two CFG branches per session)."""

    geometry: CacheGeometry
    window: WindowPolicy
    cross_attention: tuple[CrossAttentionSpec, ...]
    sampler: Sampler


CFG_BRANCHES = (KVBranch("positive", 0), KVBranch("negative", 1))
ROLLOUT_PROMPTS = {"a": ("a red fox in the snow", 1), "b": ("a city at night", 2)}
"""Session id -> (prompt, seed) of the rollout comparisons."""

_TINY = get_preset("tiny")
TINY_SETUP = RolloutSetup(_TINY.geometry, _TINY.window, _TINY.cross_attention, Sampler(num_steps=3, guidance_scale=3.0))
"""The ``tiny`` preset's cache (float32 model): the random ``tiny`` model's rollouts."""

#: A small random diffusers ``WanTransformer3DModel`` (Wan 2.1's architecture: 2 layers, 4 heads of
#: 16, 4 latent channels) and the cache its converted model streams through (24-token frames in
#: 16-token pages, sink 2 + window 4, 2-frame chunks).
DIFFUSERS_CONFIG = dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=4,
                        out_channels=4, text_dim=32, freq_dim=64, ffn_dim=128, num_layers=2, cross_attn_norm=True,
                        qk_norm="rms_norm_across_heads", eps=1e-6)
DIFFUSERS_GRID, DIFFUSERS_TEXT_TOKENS = (4, 6), 7
DIFFUSERS_SETUP = RolloutSetup(
    CacheGeometry(num_layers=2, num_kv_heads=4, head_dim=16, dtype="float32", tokens_per_frame=24,
                  block_size=16, frames_per_forward=2),
    WindowPolicy(window_frames=4, sink_frames=2), (CrossAttentionSpec("text", DIFFUSERS_TEXT_TOKENS),),
    Sampler(num_steps=2, guidance_scale=3.0))


def converted_diffusers_model(folder):
    """A random diffusers ``WanTransformer3DModel`` (:data:`DIFFUSERS_CONFIG`, seeded, its norm
    weights and biases perturbed from their initial values) saved to ``folder`` and loaded back
    through :func:`arkv_jax.models.loader.load_wan` in float32; ``None`` without torch and
    diffusers."""
    try:
        import diffusers
        import torch
    except ImportError:
        return None
    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(**DIFFUSERS_CONFIG).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn_like(param))
    model.save_pretrained(folder)
    return load_wan(folder, dtype="float32", grid=DIFFUSERS_GRID, text_tokens=DIFFUSERS_TEXT_TOKENS)


#: Page dtypes of the rollout comparison, by the prefix of their JSON keys.
ROLLOUT_PAGES = {"bf16": "bfloat16", **harness.QUANTIZED_PAGES, "fp8_e5m2": "float8_e5m2"}


def rollout_errors(model, setup: RolloutSetup, chunks: int, recompute: bool = False) -> dict:
    """Max and mean abs difference of each :data:`ROLLOUT_PAGES` rollout's latents from the float32
    pages' rollout of the same (float32) ``model``; with ``recompute`` also every run's (the
    float32 pages' too) from full recompute (:class:`arkv_jax.reference.FullRecompute`), keys
    ``*_vs_recompute_*``."""
    runs = {"fp32": paged_rollout(model, setup, None, chunks).astype(np.float64)}
    runs.update({key: paged_rollout(model, setup, dtype, chunks).astype(np.float64)
                 for key, dtype in ROLLOUT_PAGES.items()})
    out = {"rollout_mean_abs_latent": float(np.abs(runs["fp32"]).mean())}
    references = {"": runs["fp32"]}
    if recompute:
        full = FullRecompute(model, setup.window, setup.sampler, chunk_frames=setup.geometry.frames_per_forward)
        prompts, seeds = zip(*ROLLOUT_PROMPTS.values())
        references["_vs_recompute"] = np.asarray(full.rollout(list(prompts), list(seeds), chunks), np.float64)
    for suffix, reference in references.items():
        for key, latents in runs.items():
            if key == "fp32" and not suffix:
                continue
            diff = np.abs(latents - reference)
            out[f"{key}_rollout{suffix}_max_abs_diff"] = float(diff.max())
            out[f"{key}_rollout{suffix}_mean_abs_diff"] = float(diff.mean())
    return out


def _rollout_table(title: str, rollout: dict, chunks: int) -> None:
    recompute = "fp32_rollout_vs_recompute_max_abs_diff" in rollout
    against = " and vs full recompute" if recompute else ""
    print(f"{title}, 2 CFG sessions x {chunks} chunks, latents vs float32 pages{against} "
          f"(mean |latent| {rollout['rollout_mean_abs_latent']:.3f})")
    keys = ({"fp32": "float32"} if recompute else {}) | ROLLOUT_PAGES
    rows = []
    for key, dtype in keys.items():
        row = [dtype, rollout.get(f"{key}_rollout_max_abs_diff", 0.0), rollout.get(f"{key}_rollout_mean_abs_diff", 0.0)]
        if recompute:
            row += [rollout[f"{key}_rollout_vs_recompute_max_abs_diff"],
                    rollout[f"{key}_rollout_vs_recompute_mean_abs_diff"]]
        rows.append(row)
    harness.print_table(["pages", "max abs", "mean abs"] + (["max abs vs recompute", "mean abs vs recompute"]
                                                            if recompute else []), rows)


def main(argv=None) -> None:
    args = harness.parse_args(__doc__.splitlines()[0], argv, extra=_extra_flags)
    chunks = args.chunks or (5 if args.quick else 8)
    captured = capture(chunks)
    shape = captured["shape"]
    methods = ["bf16"] + [f"{d}/{g}" for d in QUANTIZED_DTYPES for g in GRANULARITIES]
    result = errors(captured, methods)
    m = shape.model
    print(f"shape {shape.name}: {m.num_layers} layers, {m.num_kv_heads} KV heads x {m.head_dim}, "
          f"{m.tokens_per_frame}-token frames in {shape.block_size}-token pages; history "
          f"{captured['history'][0].shape[2]} tokens after {chunks} chunks; attention error vs float32 history")
    rows = []
    bf16 = result["bf16"]["mean_abs"]
    for method in methods:
        r = result[method]
        rows.append([method, r["max_abs"], r["mean_abs"], r["mean_rel"], r["mean_abs"] / bf16,
                     bytes_per_token(method, m.head_dim, shape.block_size),
                     bytes_per_token(method, 128, 1560 if method.endswith("page") else 1),
                     " ".join(f"{x:.1e}" for x in r["per_layer_mean_abs"])])
    harness.print_table(["pool", "max abs", "mean abs", "mean rel", "x bf16 mean", f"B/token/head (D={m.head_dim})",
                         "B/token/head (wan)", "mean abs per layer"], rows)
    rollout_chunks = args.rollout_chunks or (8 if args.quick else 16)
    rollout = rollout_errors(init_random(MODEL_CONFIGS["tiny"], seed=0), TINY_SETUP, rollout_chunks)
    _rollout_table("tiny paged rollouts (random tiny model)", rollout, rollout_chunks)
    figures = {"benchmark": "kv_quantization", "chunks": chunks, "errors": result,
               "mean_abs_vs_bf16": {k: v["mean_abs"] / bf16 for k, v in result.items()},
               "rollout_chunks": rollout_chunks, **rollout}
    with tempfile.TemporaryDirectory() as folder:
        converted = converted_diffusers_model(os.path.join(folder, "transformer"))
        if converted is None:
            print("converted diffusers model: skipped (needs torch and diffusers)")
        else:
            diffusers_rollout = rollout_errors(converted, DIFFUSERS_SETUP, rollout_chunks, recompute=True)
            _rollout_table("converted diffusers WanTransformer3DModel (random, 2 layers)", diffusers_rollout,
                           rollout_chunks)
            figures["converted_diffusers"] = diffusers_rollout
    harness.emit(figures)


def _extra_flags(parser) -> None:
    parser.add_argument("--chunks", type=int, default=None,
                        help="chunks generated before the attention measurement (default 8; 5 with --quick)")
    parser.add_argument("--rollout-chunks", type=int, default=None,
                        help="chunks of the rollout comparison (default 16; 8 with --quick)")


if __name__ == "__main__":
    main()
