"""umT5 encoder (arkv_jax.models.umt5): parity with transformers' UMT5EncoderModel, the loaders.

Parity tests build a tiny random ``UMT5EncoderModel`` from a ``UMT5Config``, save it under
``tmp_path`` in each checkpoint layout, load it with :func:`load_umt5` and compare hidden states on
padded token-id batches (float32, tolerance 1e-4). Nothing is fetched from a hub. Without torch and
transformers (Python 3.12 CI) only the torch-free tests run.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arkv_jax.models import umt5

TOL = 1e-4
LENGTHS = (24, 17, 5)  # real tokens per row of the batch; 24 = T, past the log-bucket edge


def _hf_tiny(seed=0, **overrides):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    kw = dict(vocab_size=99, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
              relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
              feed_forward_proj="gated-gelu")
    kw.update(overrides)
    torch.manual_seed(seed)
    model = transformers.UMT5EncoderModel(transformers.UMT5Config(**kw)).eval()
    with torch.no_grad():  # make the per-layer position biases matter
        for block in model.encoder.block:
            block.layer[0].SelfAttention.relative_attention_bias.weight.mul_(4.0)
    return model


def _batch(vocab=99, t=24, seed=0):
    ids = np.random.default_rng(seed).integers(0, vocab, (len(LENGTHS), t))
    mask = (np.arange(t)[None, :] < np.asarray(LENGTHS)[:, None]).astype(np.int64)
    return ids, mask


def _hf_hidden(model, ids, mask):
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).last_hidden_state.numpy()


def _wan_names(hf_state):
    """transformers names -> the official Wan ``T5Encoder`` names (wan/modules/t5.py), stated
    independently of the module's map."""
    block = {
        "layer.0.layer_norm.weight": "norm1.weight",
        "layer.0.SelfAttention.q.weight": "attn.q.weight",
        "layer.0.SelfAttention.k.weight": "attn.k.weight",
        "layer.0.SelfAttention.v.weight": "attn.v.weight",
        "layer.0.SelfAttention.o.weight": "attn.o.weight",
        "layer.0.SelfAttention.relative_attention_bias.weight": "pos_embedding.embedding.weight",
        "layer.1.layer_norm.weight": "norm2.weight",
        "layer.1.DenseReluDense.wi_0.weight": "ffn.gate.0.weight",
        "layer.1.DenseReluDense.wi_1.weight": "ffn.fc1.weight",
        "layer.1.DenseReluDense.wo.weight": "ffn.fc2.weight",
    }
    out = {}
    for key, value in hf_state.items():
        if key == "shared.weight":
            out["token_embedding.weight"] = value
        elif key == "encoder.final_layer_norm.weight":
            out["norm.weight"] = value
        elif key.startswith("encoder.block."):
            _, _, layer, rest = key.split(".", 3)
            out[f"blocks.{layer}.{block[rest]}"] = value
    return out


def _same_params(a, b):
    assert a.config == b.config
    la, lb = jax.tree.leaves(jax.tree.map(np.asarray, a)), jax.tree.leaves(jax.tree.map(np.asarray, b))
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(x, y)


# ------------------------------------------------------------------------------------------------
# Parity with transformers
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_buckets,max_distance,length", [(32, 128, 512), (8, 16, 40)])
def test_buckets_match_transformers(num_buckets, max_distance, length):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.umt5.modeling_umt5 import UMT5Attention

    config = transformers.UMT5Config(relative_attention_num_buckets=num_buckets,
                                     relative_attention_max_distance=max_distance)
    attn = UMT5Attention(config, has_relative_attention_bias=True)
    rel = torch.arange(length)[None, :] - torch.arange(length)[:, None]
    expected = attn._relative_position_bucket(rel).numpy()
    np.testing.assert_array_equal(umt5.relative_position_buckets(length, length, num_buckets, max_distance),
                                  expected)


@pytest.mark.slow
def test_parity_safetensors_directory(tmp_path):
    model = _hf_tiny()
    model.save_pretrained(tmp_path / "enc")
    encoder = umt5.load_umt5(tmp_path / "enc", text_len=32)
    assert encoder.config == umt5.UMT5EncoderConfig(vocab_size=99, dim=32, num_heads=4, head_dim=8, ffn_dim=37,
                                                    num_layers=2, num_buckets=8, max_distance=16, text_len=32)
    ids, mask = _batch()
    expected = _hf_hidden(model, ids, mask)
    hidden = np.asarray(encoder(jnp.asarray(ids), jnp.asarray(mask)))
    err = float(np.abs(hidden - expected).max())
    print(f"umT5 hidden states vs transformers: max abs err {err:.3e}")
    assert err < TOL
    # Wan's context: the real tokens' states, zeros after them, padded to text_len.
    context = np.asarray(umt5.encode_ids(encoder, ids, mask))
    assert context.shape == (3, 32, 32) and context.dtype == np.float32
    np.testing.assert_allclose(context[:, :24], expected * mask[..., None], atol=TOL, rtol=0)
    assert not context[:, 24:].any()
    for row, n in enumerate(LENGTHS):
        assert not context[row, n:].any() and np.abs(context[row, :n]).min(axis=-1).all()


def test_parity_unmasked_and_cut_to_text_len(tmp_path):
    """No mask (all tokens real), and ids longer than text_len (the context is cut)."""
    model = _hf_tiny(seed=1)
    model.save_pretrained(tmp_path / "enc")
    encoder = umt5.load_umt5(tmp_path / "enc", text_len=16)
    ids, _ = _batch(seed=1)
    mask = np.ones_like(ids)
    expected = _hf_hidden(model, ids, mask)
    np.testing.assert_allclose(np.asarray(encoder(jnp.asarray(ids))), expected, atol=TOL, rtol=0)
    np.testing.assert_allclose(np.asarray(umt5.encode_ids(encoder, ids, mask)), expected[:, :16], atol=TOL, rtol=0)


def test_torch_bin_and_wan_pth_load_the_same_weights(tmp_path):
    torch = pytest.importorskip("torch")
    model = _hf_tiny(seed=2)
    model.save_pretrained(tmp_path / "st")
    reference = umt5.load_umt5(tmp_path / "st")
    state = {k: v.clone() for k, v in model.state_dict().items()}

    config_json = (tmp_path / "st" / "config.json").read_text()  # max_distance 16, not umT5's 128
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text(config_json)
    torch.save(state, tmp_path / "bin" / "pytorch_model.bin")
    _same_params(umt5.load_umt5(tmp_path / "bin"), reference)

    wan = _wan_names(state)
    assert len(wan) == 2 + 10 * 2  # embedding, final norm, 10 tensors per layer
    (tmp_path / "wan").mkdir()
    torch.save(wan, tmp_path / "wan" / "models_t5_umt5-xxl-enc-bf16.pth")
    # Without a config.json beside it: umT5's max_distance (128), the right one for Wan's file.
    assert umt5.load_umt5(tmp_path / "wan" / "models_t5_umt5-xxl-enc-bf16.pth").config.max_distance == 128
    (tmp_path / "wan" / "config.json").write_text(config_json)
    from_wan = umt5.load_umt5(tmp_path / "wan" / "models_t5_umt5-xxl-enc-bf16.pth")
    _same_params(from_wan, reference)

    ids, mask = _batch(seed=2)
    np.testing.assert_allclose(np.asarray(from_wan(jnp.asarray(ids), jnp.asarray(mask))),
                               _hf_hidden(model, ids, mask), atol=TOL, rtol=0)


def test_official_wan_directory(tmp_path):
    """The Wan 2.1 repository's layout: the encoder's .pth beside the DiT's safetensors and the
    DiT's config.json (neither is read)."""
    torch = pytest.importorskip("torch")
    model = _hf_tiny(seed=5, relative_attention_max_distance=128)
    torch.save(_wan_names(model.state_dict()), tmp_path / "models_t5_umt5-xxl-enc-bf16.pth")
    (tmp_path / "diffusion_pytorch_model.safetensors").write_bytes(b"not read")
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "WanModel", "dim": 1536, "eps": 1e-3}))
    encoder = umt5.load_umt5(tmp_path)
    assert encoder.config.max_distance == 128 and encoder.config.eps == 1e-6
    ids, mask = _batch(seed=5)
    np.testing.assert_allclose(np.asarray(encoder(jnp.asarray(ids), jnp.asarray(mask))), _hf_hidden(model, ids, mask),
                               atol=TOL, rtol=0)


@pytest.mark.slow
def test_bfloat16_checkpoint_keeps_its_dtype(tmp_path):
    torch = pytest.importorskip("torch")
    model = _hf_tiny(seed=3)
    state = {k: v.to(torch.bfloat16) for k, v in _wan_names(model.state_dict()).items()}
    model.save_pretrained(tmp_path)  # config.json
    torch.save(state, tmp_path / "enc.pth")
    encoder = umt5.load_umt5(tmp_path / "enc.pth")
    assert encoder.config.dtype == "bfloat16" and encoder.embed.embedding[...].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(encoder.embed.embedding[...].astype(jnp.float32)),
                                  state["token_embedding.weight"].float().numpy())
    ids, mask = _batch(seed=3)
    out = umt5.encode_ids(encoder, ids, mask)
    assert out.dtype == jnp.bfloat16 and bool(jnp.isfinite(out.astype(jnp.float32)).all())
    # The same weights as bfloat16 safetensors (memory-mapped, no safetensors package needed to read).
    safetensors_torch = pytest.importorskip("safetensors.torch")
    safetensors_torch.save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "enc.safetensors")
    _same_params(umt5.load_umt5(tmp_path / "enc.safetensors"), encoder)
    # bfloat16 weights, float32 compute: close to the float32 reference of the same (rounded) weights.
    encoder32 = umt5.load_umt5(tmp_path / "enc.pth", dtype="float32")
    ref = np.asarray(umt5.encode_ids(encoder32, ids, mask))
    assert np.abs(np.asarray(out.astype(jnp.float32)) - ref).max() < 0.1 * np.abs(ref).max()


def test_encode_prompts_with_a_local_tokenizer(tmp_path):
    """A tiny SentencePiece model trained here stands in for umT5's (no hub): encode_prompts is
    tokenize-as-Wan-does then the encoder, and matches transformers on the same ids."""
    spm = pytest.importorskip("sentencepiece")
    transformers = pytest.importorskip("transformers")
    import io

    sentences = ["a cat sits on a red mat", "the quick brown fox jumps over the lazy dog",
                 "streaming video of a river at dawn", "ein Hund läuft im Park"] * 10
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences), model_writer=buf, vocab_size=40,
                                   model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1, minloglevel=2)
    (tmp_path / "spiece.model").write_bytes(buf.getvalue())
    transformers.T5Tokenizer(vocab_file=str(tmp_path / "spiece.model"), extra_ids=0).save_pretrained(tmp_path / "tok")

    model = _hf_tiny(seed=4)
    model.save_pretrained(tmp_path / "enc")
    encoder = umt5.load_umt5(tmp_path / "enc", text_len=20)
    prompts = ["a  cat sits on a red mat &amp; the dog ", "river at dawn"]
    ids, mask = umt5.tokenize(prompts, tmp_path / "tok", 20)
    assert ids.shape == mask.shape == (2, 20) and ids.dtype == np.int32
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    expected_ids = tok(["a cat sits on a red mat & the dog", "river at dawn"], padding="max_length", max_length=20,
                       truncation=True)["input_ids"]
    np.testing.assert_array_equal(ids, expected_ids)
    assert all(row[n - 1] == tok.eos_token_id for row, n in zip(ids, mask.sum(1)))

    context = np.asarray(umt5.encode_prompts(prompts, tmp_path / "tok", encoder))
    assert context.shape == (2, 20, 32)
    np.testing.assert_allclose(context, _hf_hidden(model, ids, mask) * mask[..., None], atol=TOL, rtol=0)


# ------------------------------------------------------------------------------------------------
# Without torch
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_random_tiny_encoder_context():
    config = umt5.UMT5_CONFIGS["tiny"]
    encoder = umt5.init_random(config, seed=0)
    ids = np.arange(2 * 10).reshape(2, 10) % config.vocab_size
    mask = (np.arange(10)[None] < np.array([[10], [3]])).astype(np.int32)
    context = umt5.encode_ids(encoder, ids, mask)
    assert context.shape == (2, config.text_len, config.dim) and context.dtype == jnp.float32
    context = np.asarray(context)
    assert np.isfinite(context).all() and not context[1, 3:].any() and not context[:, 10:].any()
    # A padded token's id does not change the real tokens (its key is masked).
    ids2 = ids.copy()
    ids2[1, 5] = (ids2[1, 5] + 1) % config.vocab_size
    np.testing.assert_array_equal(np.asarray(umt5.encode_ids(encoder, ids2, mask)), context)
    # Relative positions only: shifting the padding does not matter either, but the order of tokens does.
    hidden = np.asarray(encoder(jnp.asarray(ids), jnp.asarray(mask)))
    assert np.abs(hidden[0, :3] - np.asarray(encoder(jnp.asarray(ids[:, ::-1].copy())))[0, -3:][::-1]).max() > 1e-3


def test_bucket_layout():
    b = umt5.relative_position_buckets(300, 300, 32, 128)
    assert b.dtype == np.int32 and b.min() == 0 and b.max() == 31
    assert b[0, 0] == 0 and b[0, 1] == 17 and b[1, 0] == 1  # keys after the query use the upper half
    assert b[0, 299] == 31 and b[299, 0] == 15  # far distances share the last bucket of each half
    # Exact distances below num_buckets / 4 = 8: keys 7 after the query, keys 7 before it.
    np.testing.assert_array_equal(np.diag(b, 7), 16 + 7)
    np.testing.assert_array_equal(np.diag(b, -7), 7)
    assert b[0, 8] == 16 + 8 and b[0, 90] == 30 and b[0, 91] == 31  # log-spaced, saturating before 128


def test_checkpoint_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        umt5.load_umt5(tmp_path / "missing.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no weight files"):
        umt5.load_umt5(tmp_path / "empty")
    (tmp_path / "weights.npz").write_bytes(b"")
    with pytest.raises(ValueError, match="unknown checkpoint kind"):
        umt5.load_umt5(tmp_path / "weights.npz")
    # Wan's names are renamed; a key Wan's encoder does not have keeps its name, for the check to refuse.
    assert list(umt5.convert_wan_t5_state_dict({"blocks.0.attn.x.weight": np.zeros(1),
                                                "blocks.1.attn.q.weight": np.zeros(1)})) == [
        "blocks.0.attn.x.weight", "encoder.block.1.layer.0.SelfAttention.q.weight"]
    with pytest.raises(ValueError, match="no token embedding"):
        umt5.config_from_state_dict({})
    with pytest.raises(ValueError, match="num_buckets"):
        umt5.UMT5EncoderConfig(vocab_size=8, dim=8, num_heads=2, head_dim=4, ffn_dim=8, num_layers=1, num_buckets=6)


def tiny_hf_state(config, seed=0):
    """A random ``transformers``-named umT5 encoder state dict of ``config`` (NumPy, torch layout)."""
    rng = np.random.default_rng(seed)
    state = {"shared.weight": rng.standard_normal((config.vocab_size, config.dim), np.float32),
             "encoder.final_layer_norm.weight": np.ones(config.dim, np.float32)}
    shapes = {"layer.0.layer_norm.weight": (config.dim,), "layer.1.layer_norm.weight": (config.dim,),
              "layer.0.SelfAttention.relative_attention_bias.weight": (config.num_buckets, config.num_heads)}
    for name in "qkv":
        shapes[f"layer.0.SelfAttention.{name}.weight"] = (config.inner_dim, config.dim)
    shapes["layer.0.SelfAttention.o.weight"] = (config.dim, config.inner_dim)
    shapes["layer.1.DenseReluDense.wi_0.weight"] = shapes["layer.1.DenseReluDense.wi_1.weight"] = (config.ffn_dim,
                                                                                                   config.dim)
    shapes["layer.1.DenseReluDense.wo.weight"] = (config.dim, config.ffn_dim)
    for i in range(config.num_layers):
        for suffix, shape in shapes.items():
            state[f"encoder.block.{i}.{suffix}"] = rng.standard_normal(shape, np.float32)
    return state


def test_from_state_dict_names_a_bad_shape():
    config = umt5.UMT5_CONFIGS["tiny"]
    state = tiny_hf_state(config)
    assert umt5.config_from_state_dict(state, {"relative_attention_max_distance": 16}) == dataclasses_replace(
        config, text_len=512)
    umt5.from_state_dict(state, config)
    wan = umt5.convert_wan_t5_state_dict({**state, "blocks.0.attn.x.weight": np.zeros(1, np.float32)})
    with pytest.raises(KeyError, match=r"^state dict: 1 tensors are left over .*: blocks.0.attn.x.weight$"):
        umt5.from_state_dict(wan, config)
    state["encoder.block.1.layer.1.DenseReluDense.wo.weight"] = np.zeros((config.dim, 3), np.float32)
    with pytest.raises(ValueError, match=r"^state dict: 1 tensors do not have the shape .*: "
                                         r"encoder.block.1.layer.1.DenseReluDense.wo.weight: \[32, 3\], "
                                         r"expected \[32, 48\]$"):
        umt5.from_state_dict(state, config)


def dataclasses_replace(config, **kw):
    import dataclasses

    return dataclasses.replace(config, **kw)
