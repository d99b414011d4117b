"""Per-chunk time and memory of the paged rollout against two cacheless / dense baselines.

All three generate the same videos with the same model, sampler (3 Euler steps + 1 commit forward,
CFG: both branches batched) and window, for S sessions in lock-step, and are timed per chunk
(host to host, latents on the host):

``paged``
    :class:`arkv_jax.rollout.Rollout` over :class:`arkv_jax.cache.PagedKVCache`: per chunk the
    cache's prepare (visible pages, allocation), one jitted denoise + commit-forward function
    reading the pools, and the donated page write + commit. Measured in steady state (window full).
``contiguous``
    A Self-Forcing-style dense cache in plain jnp: per layer one ``[rows, (sink + window - chunk)
    * tokens_per_frame, heads, dim]`` K and V buffer in time order; attention reads the filled
    prefix (a static slice, as Self-Forcing slices with host integers) plus the current chunk;
    after the commit forward the new chunk's K/V are concatenated and the buffer is sliced back to
    the window (sink kept, oldest frames dropped: a copy of the buffer, donated). Same model, same
    history semantics: its latents equal the paged ones (checked).
``recompute@n``
    :class:`arkv_jax.reference.FullRecompute` at a video of ``n`` chunks: every forward runs the
    model over all ``n + 1`` chunks' frames (history clean at t = 0) under the window mask. No
    cache at all; its cost grows with the video.

Timing: paged and contiguous are interleaved (``harness.interleaved_medians``, ``--reps``, default
10); the recompute cases (at each ``--lengths`` video length) are interleaved with paged again (2
reps: they are slow) and reported as their ratio to that run's paged time, times the first run's
paged time. Defaults: ``--quick`` runs the ``tiny`` shape with 2 sessions and recompute at 4 and 8
chunks; otherwise the ``small`` shape with 2 sessions and recompute at 4, 8 and 16 chunks (a few
minutes: recompute at 16 chunks is ~40 s a chunk). The 2026-11-30 figures in ``RESULTS.md`` came from
an older, much longer ``--quick`` (tiny, 4 sessions, 20 and 3 reps, recompute at 4, 8 and 16, idle
slots at tiny and small, the converted model): ``--quick --sessions 4 --reps 20 --lengths 4,8,16
--scaling-shapes tiny,small --converted`` is that run but for 2 recompute reps instead of 3.

Memory, per method: *persistent* bytes (the cache between chunks: pools + text K/V, buffers +
text K/V, or the clean latents + text K/V) and the *peak* of the per-chunk programs as XLA's
``compiled.memory_analysis()`` reports it for the chunk's main program: arguments + outputs -
aliased (donated) + temporaries (model weights included, the same in all three; for paged, the
denoise + commit-forward program, which reads the pools).

Idle slots (:func:`slot_scaling`, at every ``--scaling-shapes`` shape, default ``tiny,small``;
``tiny`` with ``--quick``): the
rollout runs live rows only, padded to a bucket; per-chunk time of one live session in a 16-slot
cache against one session in a 1-slot cache (goal: at most 1.2x; the full-batch run, every slot, is
shown too), and of 16 live sessions against 16 separate single-session runs (16 x the 1-slot time;
goal: well under 1x). The last JSON line reports the first shape's two ratios.

Converted model (:func:`converted_rollout_diff`): a tiny random diffusers ``WanTransformer3DModel``
loaded with ``load_wan``, paged rollout vs full recompute, max abs difference (skipped with a note
without torch / diffusers, and with ``--quick`` unless ``--converted`` is given:
``tests/models/test_parity.py`` checks the same equality).

The ``--quick`` run takes about a minute of CPU time on 2 cores (compilation is most of it).

Run: ``python -m benchmarks.rollout [--quick] [--converted]``.
"""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from arkv_jax.cache import PagedKVCache
from arkv_jax.config import CacheGeometry, CrossAttentionSpec, KVBranch, WindowPolicy
from arkv_jax.models.dit import MODEL_CONFIGS, DiTConfig, init_random
from arkv_jax.nnx import masked_attention
from arkv_jax.planner import rollout_plan
from arkv_jax.reference import FullRecompute
from arkv_jax.rollout import Rollout
from arkv_jax.samplers import Sampler, chunk_noise, combine_branches
from arkv_jax.samplers import euler as denoise
from arkv_jax.step import ChunkInputs
from benchmarks import harness
from pallas_kernels.rope import prepare_qk

CFG = (KVBranch("positive", 0), KVBranch("negative", 1))


@dataclasses.dataclass(frozen=True)
class Shape:
    """A model plus its cache layout."""

    name: str
    model: DiTConfig
    block_size: int
    chunk_frames: int
    window: WindowPolicy

    def geometry(self) -> CacheGeometry:
        m = self.model
        return CacheGeometry(m.num_layers, m.num_kv_heads, m.head_dim, m.dtype, m.tokens_per_frame,
                             self.block_size, self.chunk_frames)


SHAPES = {
    # The tiny preset: 24-token frames in 16-token pages, 2-frame chunks, sink 2 + window 6.
    "tiny": Shape("tiny", MODEL_CONFIGS["tiny"], 16, 2, WindowPolicy(window_frames=6, sink_frames=2)),
    # A CPU-sized "small" model (landscape doc section 7.2 scaled down): 4 layers, dim 256, 4 heads
    # of 64, 60-token frames in 16-token pages, 3-frame chunks, sink 3 + window 9.
    "small": Shape("small", DiTConfig(num_layers=4, dim=256, num_heads=4, num_kv_heads=4, ffn_dim=1024,
                                      in_channels=16, patch_size=2, grid=(6, 10), text_dim=64, text_tokens=16,
                                      freq_dim=128), 16, 3, WindowPolicy(window_frames=9, sink_frames=3)),
}


# ------------------------------------------------------------------------------------------------
# The contiguous (Self-Forcing style) baseline
# ------------------------------------------------------------------------------------------------


@struct.dataclass
class ContiguousHistory:
    """Dense per-layer history buffers ``[L, rows, tokens, Hkv, D]`` of which the first ``valid``
    tokens (static) are in use."""

    k: jax.Array
    v: jax.Array
    valid: int = struct.field(pytree_node=False)

    def attend(self, q, k, v, layer, rope=None, qk_norm=None):
        q, k = prepare_qk(q, k, rope, qk_norm)
        keys = jnp.concatenate([self.k[layer][:, :self.valid], k], axis=1)
        values = jnp.concatenate([self.v[layer][:, :self.valid], v], axis=1)
        return masked_attention(q, keys, values)

    def attend_context(self, q, k, v):
        return masked_attention(q, k, v)


def roll_in(buffer: jax.Array, new: jax.Array, *, filled: int, chunk: int, sink: int, tpf: int) -> jax.Array:
    """The buffer after appending ``new`` ``[L, rows, chunk * tpf, ...]`` to its ``filled`` frames:
    written in place while it fits, else concatenated and sliced back (sink kept, oldest dropped)."""
    capacity = buffer.shape[2] // tpf
    if filled + chunk <= capacity:
        return buffer.at[:, :, filled * tpf:(filled + chunk) * tpf].set(new)
    drop = filled + chunk - capacity
    kept = buffer[:, :, (sink + drop) * tpf:filled * tpf]
    return jnp.concatenate([buffer[:, :, :sink * tpf], kept, new], axis=2)


class ContiguousRollout:
    """Lock-step generation with dense rolling buffers (see the module docstring)."""

    def __init__(self, model, shape: Shape, sampler: Sampler, prompts, seeds, text_kv):
        self.shape, self.sampler, self.seeds = shape, sampler, list(seeds)
        self.graphdef, self.params = nnx.split(model)
        cfg = shape.model
        rows = len(prompts) * sampler.num_branches
        self.capacity = shape.window.resident_frames - shape.chunk_frames
        buffer = (cfg.num_layers, rows, self.capacity * cfg.tokens_per_frame, cfg.num_kv_heads, cfg.head_dim)
        self.k, self.v = jnp.zeros(buffer, cfg.dtype), jnp.zeros(buffer, cfg.dtype)
        self.text_kv, self.chunk_index = text_kv, 0
        self.chunk_fn = jax.jit(self._chunk_fn, static_argnames="filled", donate_argnums=(1, 2))

    @property
    def filled(self) -> int:
        """History frames in the buffers before the next chunk."""
        return min(self.chunk_index * self.shape.chunk_frames, self.capacity)

    @property
    def first_frame(self) -> np.int32:
        """Absolute index of the next chunk's first frame."""
        return np.int32(self.chunk_index * self.shape.chunk_frames)

    def noise(self) -> np.ndarray:
        shape = (self.shape.chunk_frames, *self.shape.model.frame_shape)
        return np.stack([chunk_noise(seed, self.chunk_index, shape) for seed in self.seeds])

    def _chunk_fn(self, params, k_buf, v_buf, text_kv, noise, first_frame, *, filled: int):
        cfg, chunk, nb = self.shape.model, self.shape.chunk_frames, self.sampler.num_branches
        model = nnx.merge(self.graphdef, params)
        history = ContiguousHistory(k_buf, v_buf, filled * cfg.tokens_per_frame)
        rows = k_buf.shape[1]
        first = jnp.full((rows,), first_frame, jnp.int32)

        def velocity(x, sigma):
            t = jnp.full((rows, chunk), sigma * 1000.0)
            out = model(jnp.repeat(x, nb, axis=0), t, first, history, *text_kv)
            return combine_branches(out, nb, self.sampler.guidance_scale)

        x = denoise(velocity, noise.astype(cfg.dtype), self.sampler.sigmas())
        k, v = model.commit_kv(jnp.repeat(x, nb, axis=0), jnp.zeros((rows, chunk)), first, history, *text_kv)
        kw = dict(filled=filled, chunk=chunk, sink=self.shape.window.sink_frames, tpf=cfg.tokens_per_frame)
        return x, roll_in(k_buf, k, **kw), roll_in(v_buf, v, **kw)

    def step(self) -> np.ndarray:
        """One chunk for every session; returns the latents ``[S, F, H, W, C]``."""
        x, self.k, self.v = self.chunk_fn(self.params, self.k, self.v, self.text_kv, self.noise(),
                                          self.first_frame, filled=self.filled)
        self.chunk_index += 1
        return np.asarray(x)

    def peak_bytes(self) -> int:
        return peak_bytes(self.chunk_fn.lower(self.params, self.k, self.v, self.text_kv, self.noise(),
                                              self.first_frame, filled=self.filled))


# ------------------------------------------------------------------------------------------------
# Measurement
# ------------------------------------------------------------------------------------------------


def peak_bytes(lowered) -> int:
    """Arguments + outputs - aliased + temporaries of a lowered program (XLA's memory analysis)."""
    m = lowered.compile().memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes)


def nbytes(*trees) -> int:
    return int(sum(x.size * x.dtype.itemsize for tree in trees for x in jax.tree.leaves(tree)))


def paged_peak_bytes(rollout: Rollout) -> int:
    """Peak of the paged chunk's denoise + commit-forward program (it reads the pools; the page
    write + commit that follows runs in place on the donated pools and needs less: measured 0.3x
    (tiny) and 0.5x (small) of this)."""
    cache, frames = rollout.cache, rollout.chunk_frames
    rows = cache.session_capacity * len(rollout.branches)
    visible = cache.window.resident_frames

    def i32(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.int32)

    ppf = cache.geometry.pages_per_frame
    inputs = ChunkInputs(i32(rows), i32(rows, visible * ppf), i32(rows), i32(rows, visible), i32(rows),
                         i32(rows, frames * ppf))
    noise = jax.ShapeDtypeStruct((cache.session_capacity, rollout.sampler.noise_draws, frames,
                                  *rollout.model.config.frame_shape), jnp.float32)
    return peak_bytes(rollout.chunk_fn.lower(rollout.params, cache.pools, inputs,
                                             cache.cross_attention_kv(rollout.text_cache), noise))


def recompute_peak_bytes(reference: FullRecompute, history, noise, first_frame: int, text_kv) -> int:
    """Peak of :meth:`FullRecompute.chunk`'s program on these arguments: its :attr:`chunk_fn`
    lowered on exactly what ``chunk`` passes it without a prompt switch (every frame visible, no
    pinned sink)."""
    visible = jnp.ones(history.shape[1], bool)
    return peak_bytes(reference.chunk_fn.lower(reference.params, history, jnp.int32(first_frame), noise, text_kv,
                                               visible, None))


def run(shape: Shape, sessions: int, lengths: tuple[int, ...], reps: int, recompute_reps: int) -> dict:
    """Builds the three methods, checks that paged and contiguous agree while the caches fill, then
    times paged vs contiguous (``reps``, interleaved) and paged vs recompute at each video length
    (``recompute_reps``, interleaved); returns medians (seconds) and bytes."""
    cfg, geometry, window = shape.model, shape.geometry(), shape.window
    sampler = Sampler(num_steps=3, guidance_scale=3.0)
    text = (CrossAttentionSpec("text", cfg.text_tokens),)
    model = init_random(cfg, seed=0)
    prompts = [f"prompt number {i}" for i in range(sessions)]
    seeds = list(range(sessions))

    plan = rollout_plan(geometry, window, CFG, text, sessions)
    cache = PagedKVCache(geometry, window, CFG, text, plan=plan, backend="xla")
    paged = Rollout(model, cache, sampler)
    for i, prompt in enumerate(prompts):
        paged.join(f"s{i}", prompt, seed=seeds[i])

    reference = FullRecompute(model, window, sampler, chunk_frames=shape.chunk_frames)
    text_kv = reference.text_kv(prompts)
    contiguous = ContiguousRollout(model, shape, sampler, prompts, seeds, text_kv)

    fill = -(-window.resident_frames // shape.chunk_frames) + 1  # chunks until both caches are full
    paged_latents = [paged.step().latents for _ in range(fill)]
    contiguous_latents = [contiguous.step() for _ in range(fill)]
    agreement = float(np.max(np.abs(np.stack(paged_latents) - np.stack(contiguous_latents))))

    frame = (shape.chunk_frames, *cfg.frame_shape)

    def recompute_at(n: int):
        clean = jnp.asarray(np.random.default_rng(n).standard_normal((sessions, (n + 1) * shape.chunk_frames,
                                                                      *cfg.frame_shape), np.float32))
        noise = np.stack([chunk_noise(seed, n, frame) for seed in seeds])
        return (lambda: reference.chunk(clean, n * shape.chunk_frames, noise, text_kv)), (clean, noise)

    def paged_step():
        return paged.step().latents

    medians = harness.interleaved_medians({"paged": paged_step, "contiguous": contiguous.step}, reps=reps)
    growth, recompute_args = {"paged": paged_step}, {}
    for n in lengths:
        growth[f"recompute@{n}"], recompute_args[n] = recompute_at(n)
    growth = harness.interleaved_medians(growth, reps=recompute_reps)
    medians.update({name: growth[name] * medians["paged"] / growth["paged"] for name in growth if name != "paged"})

    persistent = {
        "paged": nbytes(cache.pools, cache.cross_attention_kv("text")),
        "contiguous": nbytes(contiguous.k, contiguous.v, text_kv),
        **{f"recompute@{n}": nbytes(recompute_args[n][0], text_kv) for n in lengths},
    }
    peak = {
        "paged": paged_peak_bytes(paged),
        "contiguous": contiguous.peak_bytes(),
        **{f"recompute@{n}": recompute_peak_bytes(reference, *recompute_args[n], n * shape.chunk_frames, text_kv)
           for n in lengths},
    }
    return {"medians": medians, "persistent": persistent, "peak": peak, "agreement": agreement,
            "pool_pages": plan.managed_num_blocks, "fill_chunks": fill}


# ------------------------------------------------------------------------------------------------
# Idle slots: live rows only, bucketed
# ------------------------------------------------------------------------------------------------


def slot_scaling(shape: Shape, reps: int, slots: int = 16) -> dict:
    """Per-chunk time (steady state, window full) of: one live session in a ``slots``-slot cache
    (live rows only, bucket 1), the same on the cache's full batch (every slot: what a chunk cost
    before bucketing), one session in a 1-slot cache, and ``slots`` live sessions in the
    ``slots``-slot cache; all CFG, 3 Euler steps + commit. The first three are interleaved; the
    ``slots``-session run is interleaved with the 1-slot one again and scaled to the first run's
    1-slot time. ``slots`` separate single-session runs cost ``slots`` times the 1-slot time."""
    cfg, geometry, window = shape.model, shape.geometry(), shape.window
    sampler = Sampler(num_steps=3, guidance_scale=3.0)
    text = (CrossAttentionSpec("text", cfg.text_tokens),)
    model = init_random(cfg, seed=0)

    def make(capacity: int, sessions: int, **kwargs) -> Rollout:
        cache = PagedKVCache(geometry, window, CFG, text, plan=rollout_plan(geometry, window, CFG, text, capacity),
                             backend="xla")
        rollout = Rollout(model, cache, sampler, **kwargs)
        for i in range(sessions):
            rollout.join(f"s{i}", f"prompt number {i}", seed=i)
        return rollout

    rollouts = {"one_live_in_16": make(slots, 1), "one_live_in_16_full_batch": make(slots, 1, full_batch=True),
                "one_slot": make(1, 1), "sixteen_live": make(slots, slots)}
    fill = -(-window.resident_frames // shape.chunk_frames) + 1
    for rollout in rollouts.values():
        for _ in range(fill):
            rollout.step()
    steps = {name: (lambda r=r: r.step().latents) for name, r in rollouts.items()}
    first = harness.interleaved_medians({k: steps[k] for k in ("one_live_in_16", "one_live_in_16_full_batch",
                                                               "one_slot")}, reps=reps)
    second = harness.interleaved_medians({k: steps[k] for k in ("one_slot", "sixteen_live")},
                                         reps=max(3, reps // 2))
    medians = dict(first, sixteen_live=second["sixteen_live"] * first["one_slot"] / second["one_slot"])
    traces = {name: dict(r.traces_per_batch) for name, r in rollouts.items()}
    return {"medians": medians, "traces": traces, "slots": slots,
            "one_live_in_16_slots_vs_one_slot": medians["one_live_in_16"] / medians["one_slot"],
            "one_live_full_batch_vs_one_slot": medians["one_live_in_16_full_batch"] / medians["one_slot"],
            "sixteen_live_vs_sixteen_single": medians["sixteen_live"] / (slots * medians["one_slot"])}


# ------------------------------------------------------------------------------------------------
# A converted (diffusers) model: paged rollout vs full recompute
# ------------------------------------------------------------------------------------------------


def converted_rollout_diff() -> dict:
    """Max abs difference between the paged rollout and full recompute of a tiny random diffusers
    ``WanTransformer3DModel`` saved with ``save_pretrained`` and loaded with
    :func:`arkv_jax.models.load_wan` (as ``tests/models/test_parity.py`` builds it), float32, 2
    sessions x 4 chunks past a sink 2 + window 4 window, under the CFG Euler sampler (hash
    stand-in prompts) and the Self-Forcing sampler (text-encoder-shaped contexts). ``None`` with a
    note when torch or diffusers is missing."""
    import tempfile

    try:
        import diffusers
        import torch
    except ImportError as e:
        return {"max_abs_diff": None, "note": f"skipped: {e}"}
    from arkv_jax.models import load_wan

    torch.manual_seed(0)
    upstream = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4,
        text_dim=32, freq_dim=64, ffn_dim=128, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        eps=1e-6).eval()
    with torch.no_grad():
        for name, p in upstream.named_parameters():
            if "norm" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    with tempfile.TemporaryDirectory() as folder:
        upstream.save_pretrained(folder)
        model = load_wan(folder, dtype="float32", grid=(4, 6), text_tokens=7)
    cfg = model.config
    geometry = CacheGeometry(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, "float32", cfg.tokens_per_frame, 16, 2)
    window = WindowPolicy(window_frames=4, sink_frames=2)
    text = (CrossAttentionSpec("text", cfg.text_tokens),)
    rng = np.random.default_rng(0)
    contexts = [rng.standard_normal((5, cfg.text_dim), np.float32) for _ in range(2)]
    seeds, chunks, diffs = [1, 2], 4, {}
    for label, sampler in (("euler_cfg", Sampler(num_steps=2, guidance_scale=3.0)),
                           ("self_forcing", Sampler.self_forcing())):
        branches = CFG[:sampler.num_branches]
        cache = PagedKVCache(geometry, window, branches, text, plan=rollout_plan(geometry, window, branches, text, 2),
                             backend="xla")
        rollout = Rollout(model, cache, sampler, max_traces=1)
        for i, seed in enumerate(seeds):
            if sampler.num_branches == 2:
                rollout.join(f"s{i}", f"prompt number {i}", seed=seed)
            else:
                rollout.join(f"s{i}", seed=seed, context=contexts[i])
        for _ in range(chunks):
            rollout.step()
        paged = np.stack([rollout.leave(f"s{i}") for i in range(len(seeds))])
        reference = FullRecompute(model, window, sampler, chunk_frames=2)
        if sampler.num_branches == 2:
            expected = reference.rollout([f"prompt number {i}" for i in range(len(seeds))], seeds, chunks)
        else:
            expected = reference.rollout(None, seeds, chunks, contexts=contexts)
        diffs[label] = float(np.max(np.abs(paged - expected)))
    return {"max_abs_diff": max(diffs.values()), "by_sampler": diffs, "note": f"diffusers {diffusers.__version__}"}


def main(argv=None) -> None:
    args = harness.parse_args(__doc__.splitlines()[0], argv, extra=lambda p: (
        p.add_argument("--shape", choices=sorted(SHAPES), default=None,
                       help="model shape (default: tiny with --quick, small otherwise)"),
        p.add_argument("--sessions", type=int, default=None,
                       help="concurrent sessions (default 2)"),
        p.add_argument("--lengths", default=None,
                       help="video lengths (chunks) of the recompute cases, comma-separated (default: 4,8 with "
                            "--quick, 4,8,16 otherwise)"),
        p.add_argument("--scaling-shapes", default=None,
                       help="shapes of the idle-slot comparison (comma-separated; default: tiny with --quick, "
                            "tiny,small otherwise)"),
        p.add_argument("--converted", action="store_true",
                       help="also run the converted-model check with --quick (it always runs without --quick)")))
    shape = SHAPES[args.shape or ("tiny" if args.quick else "small")]
    sessions = args.sessions or 2
    lengths = tuple(int(n) for n in (args.lengths or ("4,8" if args.quick else "4,8,16")).split(","))
    reps = args.reps or 10
    recompute_reps = 2
    scaling_shapes = (args.scaling_shapes or ("tiny" if args.quick else "tiny,small")).split(",")
    unknown = [name for name in scaling_shapes if name not in SHAPES]
    if unknown:
        print(f"benchmarks.rollout: --scaling-shapes: unknown shape(s) {unknown}; choose from {sorted(SHAPES)}",
              file=sys.stderr)
        raise SystemExit(2)
    result = run(shape, sessions, lengths, reps, recompute_reps)
    medians, persistent, peak = result["medians"], result["persistent"], result["peak"]
    m = shape.model
    print(f"shape {shape.name}: {m.num_layers} layers, dim {m.dim}, {m.num_heads}/{m.num_kv_heads} heads, "
          f"{m.tokens_per_frame} tokens/frame in {shape.block_size}-token pages, {shape.chunk_frames}-frame "
          f"chunks, sink {shape.window.sink_frames} + window {shape.window.window_frames}; {sessions} "
          f"sessions x 2 CFG branches; 3 steps + commit; medians of {reps} reps (paged vs contiguous) "
          f"and {recompute_reps} reps (recompute, scaled to the first run's paged time)")
    rows = []
    for name, seconds in medians.items():
        rows.append([name, seconds * 1e3, seconds / medians["paged"], persistent[name] / 2 ** 20,
                     peak[name] / 2 ** 20])
    harness.print_table(["method", "ms/chunk", "x paged", "persistent MiB", "peak MiB"], rows)
    ratio = medians["paged"] / medians["contiguous"]
    speedups = {n: medians[f"recompute@{n}"] / medians["paged"] for n in lengths}
    print(f"paged / contiguous time: {ratio:.3f} (goal <= 1.1); full recompute / paged: "
          + ", ".join(f"{speedups[n]:.1f}x at {n} chunks" for n in lengths))
    print(f"paged and contiguous latents agree to {result['agreement']:.1e} over the first "
          f"{result['fill_chunks']} chunks")
    scaling = {}
    for name in scaling_shapes:
        scaling[name] = slot_scaling(SHAPES[name], reps=max(5, reps // 2))
        sc = scaling[name]
        print(f"\nidle slots, shape {name} (CFG, 3 steps + commit), ms/chunk: "
              + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in sc["medians"].items()))
        print(f"  1 live in 16 slots / 1 slot: {sc['one_live_in_16_slots_vs_one_slot']:.3f} (goal <= 1.2; "
              f"full batch {sc['one_live_full_batch_vs_one_slot']:.2f}); 16 live / 16 single runs: "
              f"{sc['sixteen_live_vs_sixteen_single']:.3f} (goal well under 1); traces by batch size: {sc['traces']}")
    if args.quick and not args.converted:
        converted = {"max_abs_diff": None, "note": "not run with --quick (--converted runs it; "
                                                   "tests/models/test_parity.py checks the same)"}
    else:
        converted = converted_rollout_diff()
    print(f"converted (diffusers) model, paged rollout vs full recompute: max abs diff {converted['max_abs_diff']} "
          f"({converted.get('by_sampler', '')}; {converted['note']})")
    first = scaling[next(iter(scaling))]
    harness.emit({
        "benchmark": "rollout", "shape": shape.name, "sessions": sessions, "reps": reps,
        "recompute_reps": recompute_reps,
        "ms_per_chunk": {k: v * 1e3 for k, v in medians.items()},
        "paged_over_contiguous": ratio,
        "recompute_over_paged": {str(n): s for n, s in speedups.items()},
        "persistent_bytes": persistent, "peak_bytes": peak,
        "paged_contiguous_max_abs_diff": result["agreement"],
        "one_live_in_16_slots_vs_one_slot": first["one_live_in_16_slots_vs_one_slot"],
        "sixteen_live_vs_sixteen_single": first["sixteen_live_vs_sixteen_single"],
        "idle_slots": {name: {k: v for k, v in sc.items() if k != "medians"}
                       | {"ms_per_chunk": {k: v * 1e3 for k, v in sc["medians"].items()}}
                       for name, sc in scaling.items()},
        "converted_rollout_max_abs_diff": converted["max_abs_diff"],
        "converted_rollout": converted,
    })


if __name__ == "__main__":
    main()
