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

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from arkv_jax.cache import PagedKVCache
from arkv_jax.models import MODEL_CONFIGS
from arkv_jax.models.dit import init_random
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

GRANULARITIES = {"page": (1, 3), "token": (3,)}
"""Axes of ``[frames * pages_per_frame, slot, kv_head, head_dim]`` history pages one scale covers."""


@struct.dataclass
class RecordingHistory(ContiguousHistory):
    """A :class:`~benchmarks.rollout.ContiguousHistory` that hands every layer's ``(layer, q, k,
    v)`` to ``record`` on the host."""

    record: object = struct.field(pytree_node=False, default=None)

    def attend(self, q, k, v, layer):
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
    history, and the mean error relative to the mean output magnitude."""
    shape = captured["shape"]
    tpf, block = shape.model.tokens_per_frame, shape.block_size
    k_hist, v_hist = captured["history"]
    out = {m: {"max": 0.0, "sum": 0.0, "count": 0, "scale_sum": 0.0} for m in methods}
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
    return {m: {"max_abs": a["max"], "mean_abs": a["sum"] / a["count"],
                "mean_rel": a["sum"] / a["scale_sum"]} for m, a in out.items()}


def bytes_per_token(method: str, head_dim: int, block_size: int) -> float:
    """Stored bytes per history token per KV head (K or V), scales included."""
    if method == "bf16":
        return 2.0 * head_dim
    granularity = method.split("/")[1]
    per_scale_tokens = block_size if granularity == "page" else 1
    return head_dim + SCALE_ITEMSIZE / per_scale_tokens


def tiny_rollout(model, kv_dtype: str | None, chunks: int) -> np.ndarray:
    """``[2, chunks * F, H, W, C]``: two sessions of the ``tiny`` preset (CFG, 3 steps, XLA backend)
    over ``chunks`` chunks, their pages stored as ``kv_dtype`` (``None``: the model's dtype)."""
    preset = get_preset("tiny")
    geometry = dataclasses.replace(preset.geometry, kv_dtype=kv_dtype)
    plan = rollout_plan(geometry, preset.window, preset.kv_branches, preset.cross_attention, 2)
    cache = PagedKVCache(geometry, preset.window, preset.kv_branches, preset.cross_attention, plan=plan,
                         backend="xla")
    rollout = Rollout(model, cache, Sampler(num_steps=3, guidance_scale=3.0), max_traces=1)
    rollout.join("a", "a red fox in the snow", seed=1)
    rollout.join("b", "a city at night", seed=2)
    for _ in range(chunks):
        rollout.step()
    return np.stack([rollout.leave("a"), rollout.leave("b")])


#: Page dtypes of the rollout comparison, by the prefix of their JSON keys.
ROLLOUT_PAGES = {"bf16": "bfloat16", **harness.QUANTIZED_PAGES, "fp8_e5m2": "float8_e5m2"}


def rollout_errors(chunks: int) -> dict:
    """Max and mean abs difference of each :data:`ROLLOUT_PAGES` rollout's latents from the float32
    pages' rollout (the tiny model in float32)."""
    model = init_random(MODEL_CONFIGS["tiny"], seed=0)
    exact = tiny_rollout(model, None, chunks).astype(np.float64)
    out = {}
    for key, dtype in ROLLOUT_PAGES.items():
        diff = np.abs(tiny_rollout(model, dtype, chunks).astype(np.float64) - exact)
        out[f"{key}_rollout_max_abs_diff"] = float(diff.max())
        out[f"{key}_rollout_mean_abs_diff"] = float(diff.mean())
    out["rollout_mean_abs_latent"] = float(np.abs(exact).mean())
    return out


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
                     bytes_per_token(method, 128, 1560 if method.endswith("page") else 1)])
    harness.print_table(["pool", "max abs", "mean abs", "mean rel", "x bf16 mean", f"B/token/head (D={m.head_dim})",
                         "B/token/head (wan)"], rows)
    rollout_chunks = args.rollout_chunks or (8 if args.quick else 16)
    rollout = rollout_errors(rollout_chunks)
    print(f"tiny paged rollouts, 2 sessions x {rollout_chunks} chunks, latents vs float32 pages "
          f"(mean |latent| {rollout['rollout_mean_abs_latent']:.3f})")
    harness.print_table(["pages", "max abs", "mean abs"],
                        [[dtype, rollout[f"{key}_rollout_max_abs_diff"], rollout[f"{key}_rollout_mean_abs_diff"]]
                         for key, dtype in ROLLOUT_PAGES.items()])
    figures = {"benchmark": "kv_quantization", "chunks": chunks, "errors": result,
               "mean_abs_vs_bf16": {k: v["mean_abs"] / bf16 for k, v in result.items()},
               "rollout_chunks": rollout_chunks, **rollout}
    harness.emit(figures)


def _extra_flags(parser) -> None:
    parser.add_argument("--chunks", type=int, default=None,
                        help="chunks generated before the attention measurement (default 8; 5 with --quick)")
    parser.add_argument("--rollout-chunks", type=int, default=None,
                        help="chunks of the rollout comparison (default 16; 8 with --quick)")


if __name__ == "__main__":
    main()
