"""The causal DiT's commit forward (``CausalDiT.commit_kv``) against its blocks run one by one."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, struct

from arkv_jax.models import dit
from arkv_jax.reference import MaskedHistory
from pallas_kernels.adaln_mlp import xla as adaln_xla

CONFIG = dataclasses.replace(dit.MODEL_CONFIGS["tiny"], num_layers=3)


def _inputs(frames: int = 2, rows: int = 2):
    rng = np.random.default_rng(0)
    c = CONFIG
    latents = jnp.asarray(rng.standard_normal((rows, frames, c.grid[0] * c.patch_size, c.grid[1] * c.patch_size,
                                               c.in_channels)), jnp.float32)
    timesteps = jnp.asarray(rng.uniform(0, 1000, (rows, frames)), jnp.float32)
    first_frame = jnp.asarray([0, 5][:rows], jnp.int32)
    mask = jnp.tril(jnp.ones((frames, frames), bool))
    history = MaskedHistory(jnp.broadcast_to(mask, (rows, frames, frames)), c.tokens_per_frame)
    text = jnp.asarray(rng.standard_normal((c.num_layers, rows, c.text_tokens, c.num_kv_heads, c.head_dim)),
                       jnp.float32)
    return latents, timesteps, first_frame, history, text, 0.5 * text


def _block_by_block_kv(model: dit.CausalDiT, latents, timesteps, first_frame, history, text_k, text_v):
    x, _, time_mod, rope = model._embed(latents, timesteps, first_frame)
    graphdef, stacked = nnx.split(model.blocks)
    stacks = model.stacks()
    ks, vs = [], []
    for layer in range(CONFIG.num_layers):
        block = nnx.merge(graphdef, jax.tree_util.tree_map(lambda leaf, i=layer: leaf[i], stacked))
        attention_input = model.attention_input(x, time_mod, stacks, layer)
        x, _, (k, v) = block(x, attention_input, time_mod, rope, history, text_k[layer], text_v[layer],
                             jnp.int32(layer), stacks)
        ks.append(k)
        vs.append(v)
    return jnp.stack(ks), jnp.stack(vs)


def test_commit_kv_is_every_blocks_kv_of_the_full_forward():
    """The last block stops at its K/V; the earlier blocks' outputs feed the next as in a forward."""
    model = dit.init_random(CONFIG, seed=3)
    args = _inputs()
    k, v = jax.jit(model.commit_kv)(*args)
    want_k, want_v = _block_by_block_kv(model, *args)
    assert k.shape == v.shape == (CONFIG.num_layers, 2, 2 * CONFIG.tokens_per_frame, CONFIG.num_kv_heads,
                                  CONFIG.head_dim)
    np.testing.assert_allclose(k, want_k, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(v, want_v, rtol=1e-5, atol=1e-5)
    # Every layer differs from the next: the residual stream did advance through the blocks.
    assert all(float(jnp.max(jnp.abs(k[i + 1] - k[i]))) > 1e-3 for i in range(CONFIG.num_layers - 1))


def test_commit_kv_skips_the_last_blocks_attention_mlp_and_head():
    """Traced, the commit forward attends in its loop over the first blocks only."""
    model = dit.init_random(CONFIG, seed=3)
    calls = []

    class Counting(MaskedHistory):
        def attend(self, q, k, v, layer, rope=None, qk_norm=None):
            calls.append("self")
            return super().attend(q, k, v, layer, rope, qk_norm)

    latents, timesteps, first_frame, history, text_k, text_v = _inputs()
    counting = Counting(history.frame_mask, history.tokens_per_frame)
    jax.eval_shape(lambda *a: model.commit_kv(*a[:3], counting, *a[3:]), latents, timesteps, first_frame,
                   text_k, text_v)
    assert calls == ["self"]  # the loop body over the first L - 1 blocks, traced once; none for the last


@pytest.mark.parametrize("generation", ["v5e", "v6e"])
def test_the_mlp_input_is_written_out_on_a_v6e_only(generation, monkeypatch):
    """On the XLA path, built for a v6e a block writes the MLP's input before the FFN-in matmul
    (one barrier more than the two around FFN-out); the values are the same."""
    monkeypatch.setattr(adaln_xla, "default_generation", lambda: generation)
    model = dit.init_random(CONFIG, seed=3)
    args = _inputs()
    assert str(jax.make_jaxpr(model)(*args)).count("optimization_barrier") == 2 + (generation == "v6e")
    monkeypatch.setattr(adaln_xla, "default_generation", lambda: "v5e")
    want = model(*args)
    monkeypatch.setattr(adaln_xla, "default_generation", lambda: generation)
    np.testing.assert_array_equal(model(*args), want)


@struct.dataclass
class _TPUHistory(MaskedHistory):
    """A :class:`MaskedHistory` whose forwards name a TPU backend (the MLP's kernel, interpreted)."""

    backend: str = struct.field(pytree_node=False, default="pallas_tpu_interpret")


def test_the_fused_steps_run_as_kernels_on_a_tpu_backend():
    """With a TPU backend every block's q/k/v projections, its step from self- to cross-attention
    and its MLP are the q/k/v, cross-query and adaLN-MLP kernels reading the stacked weights at
    its layer (in both forwards), the MLP's writing the next block's attention input; with XLA's,
    XLA. The values match the XLA path's."""
    model = dit.init_random(CONFIG, seed=3)
    latents, timesteps, first_frame, history, text_k, text_v = _inputs()
    tpu_history = _TPUHistory(history.frame_mask, history.tokens_per_frame)
    args = (latents, timesteps, first_frame, tpu_history, text_k, text_v)
    assert dit.kernel_backend(tpu_history) == "pallas_tpu_interpret"
    assert dit.kernel_backend(history) == "xla"
    for forward in (model, model.commit_kv):
        jaxpr = str(jax.make_jaxpr(forward)(*args))
        kernels = ("qkv_projection_tpu_m96_d64_k32", "cross_query_tpu_m96_d64_f24",
                   "adaln_mlp_tpu_m96_d64_h128_f24_res_next")
        assert all(name in jaxpr for name in kernels)
        xla_jaxpr = str(jax.make_jaxpr(forward)(latents, timesteps, first_frame, history, text_k, text_v))
        assert not any(name.split("_tpu")[0] + "_tpu" in xla_jaxpr for name in kernels)
        want = forward(latents, timesteps, first_frame, history, text_k, text_v)
        jax.tree.map(lambda got, want: np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5),
                     forward(*args), want)
