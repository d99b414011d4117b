"""The Wan 2.1 family through the paged KV cache: the causal video DiT, its checkpoint loaders, the
umT5 text encoder and the streaming VAE decoder.

``init_random`` builds a random-weight DiT (tests, the demo); ``umt5.init_random`` and
``vae.init_random`` do the same for the encoder and the decoder. Every loader reads and checks its
files with :mod:`arkv_jax.models.io`.
"""

from arkv_jax.models.convert import config_from_json, official_key_map
from arkv_jax.models.dit import MODEL_CONFIGS, PRECISIONS, CausalDiT, DiTConfig, init_random, prompt_embedding
from arkv_jax.models.io import CheckpointKeyError
from arkv_jax.models.loader import from_state_dict, load_wan, read_checkpoint
from arkv_jax.models.umt5 import UMT5_CONFIGS, UMT5Encoder, UMT5EncoderConfig, encode_ids, encode_prompts, load_umt5
from arkv_jax.models.vae import (
    VAE_CONFIGS,
    DecoderCache,
    WanVAEConfig,
    WanVAEDecoder,
    decode_chunk,
    decode_video,
    decoder_init_cache,
    decoder_param_bytes,
    load_wan_vae,
    stream_cache_bytes,
)

__all__ = [
    "MODEL_CONFIGS", "PRECISIONS", "UMT5_CONFIGS", "VAE_CONFIGS", "CausalDiT", "CheckpointKeyError",
    "DecoderCache", "DiTConfig", "UMT5Encoder", "UMT5EncoderConfig", "WanVAEConfig", "WanVAEDecoder",
    "config_from_json", "decode_chunk", "decode_video", "decoder_init_cache", "decoder_param_bytes", "encode_ids",
    "encode_prompts",
    "from_state_dict", "init_random", "load_umt5", "load_wan", "load_wan_vae", "official_key_map",
    "prompt_embedding", "read_checkpoint", "stream_cache_bytes",
]
