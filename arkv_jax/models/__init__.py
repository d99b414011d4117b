"""Models that generate through the paged KV cache: a small causal video DiT (Wan-2.1 layout)."""

from arkv_jax.models.dit import MODEL_CONFIGS, CausalDiT, DiTConfig, init_random, prompt_embedding

__all__ = ["MODEL_CONFIGS", "CausalDiT", "DiTConfig", "init_random", "prompt_embedding"]
