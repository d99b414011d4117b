"""Cache shapes of real autoregressive video diffusion models, for planning and benchmarks.

Figures come from the models' public configurations (see the README's sources): Wan-2.1-T2V-1.3B as
used by Self-Forcing / CausVid / LongLive, LingBot World v2 at 832x480, DreamZero-14B (Wan-14B
backbone) at 180x320, plus a ``tiny`` shape for CPU tests and the demo.
"""

from __future__ import annotations

import dataclasses

from arkv_jax.config import CacheGeometry, CrossAttentionSpec, KVBranch, WindowPolicy


@dataclasses.dataclass(frozen=True)
class ModelPreset:
    """Everything the planner needs about one model.

    Attributes:
      name: preset name (``arkv-jax plan --preset NAME``).
      description: one line: the model and the source of its shape.
      geometry, window, kv_branches, cross_attention: the cache configuration.
      session_capacity: resident sessions the model's deployment asks for.
      max_scratch_tokens_per_branch: action/state tokens kept in scratch per forward.
      model_owned_state_bytes_per_session: per-session model state outside the pool, bytes.
    """

    name: str
    description: str
    geometry: CacheGeometry
    window: WindowPolicy
    kv_branches: tuple[KVBranch, ...] = (KVBranch("main"),)
    cross_attention: tuple[CrossAttentionSpec, ...] = ()
    session_capacity: int = 1
    max_scratch_tokens_per_branch: int = 0
    model_owned_state_bytes_per_session: int = 0


_CFG = (KVBranch("positive", 0), KVBranch("negative", 1))

PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset(
            name="tiny",
            description="tiny CPU shape: 2 layers, GQA 4/2 heads, 24-token frames in 16-token pages, CFG",
            geometry=CacheGeometry(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32",
                                   tokens_per_frame=24, block_size=16, frames_per_forward=2),
            window=WindowPolicy(window_frames=6, sink_frames=2),
            kv_branches=_CFG,
            cross_attention=(CrossAttentionSpec("text", 7),),
            session_capacity=4,
        ),
        ModelPreset(
            name="wan-1.3b",
            description="Wan-2.1-T2V-1.3B at 480x832 (Self-Forcing/CausVid/LongLive): 30 layers, "
                        "12 heads x 128, 1560 tokens/frame, 3-frame chunks, sink 3 + window 9",
            geometry=CacheGeometry(num_layers=30, num_kv_heads=12, head_dim=128, dtype="bfloat16",
                                   tokens_per_frame=1560, block_size=1560, frames_per_forward=3),
            window=WindowPolicy(window_frames=9, sink_frames=3),
            cross_attention=(CrossAttentionSpec("text", 512),),
            session_capacity=16,
        ),
        ModelPreset(
            name="lingbot-v2",
            description="LingBot World v2 at 832x480 as shipped in vLLM-Omni: 40 layers, 40 heads x 128, "
                        "1560 tokens/frame, 3-frame chunks, sink 9 + window 9",
            geometry=CacheGeometry(num_layers=40, num_kv_heads=40, head_dim=128, dtype="bfloat16",
                                   tokens_per_frame=1560, block_size=1560, frames_per_forward=3),
            window=WindowPolicy(window_frames=9, sink_frames=9),
            cross_attention=(CrossAttentionSpec("text", 512),),
            session_capacity=2,
            model_owned_state_bytes_per_session=7_488_000,
        ),
        ModelPreset(
            name="dreamzero-14b",
            description="DreamZero t2v (Wan-14B backbone) at 180x320 as in vLLM-Omni: 40 layers, "
                        "40 heads x 128, 220 tokens/frame, 2-frame chunks, window 36, CFG",
            geometry=CacheGeometry(num_layers=40, num_kv_heads=40, head_dim=128, dtype="bfloat16",
                                   tokens_per_frame=220, block_size=220, frames_per_forward=2),
            window=WindowPolicy(window_frames=36, sink_frames=0),
            kv_branches=_CFG,
            cross_attention=(CrossAttentionSpec("text", 512),),
            session_capacity=64,
            max_scratch_tokens_per_branch=33,
            model_owned_state_bytes_per_session=603 << 20,
        ),
    )
}


def get_preset(name: str) -> ModelPreset:
    """The preset called ``name``.

    Raises:
      ValueError: unknown name (the message lists the known ones).
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}") from None
