"""Context attention (the DiT's text cross-attention): every backend against the float32 XLA
reference, the TPU kernel's query blocks and padded context, and the argument checks.

The TPU kernel runs interpreted and under the TPU simulator here (uninitialised VMEM reads as NaN,
out-of-bounds reads raise), compiled where a TPU is (``tests/kernels/device_backends.py``); its
compiles for v5e and v6e are in ``test_tpu_compile.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.backend import BACKENDS, resolve_backend
from pallas_kernels.context_attention import (
    IMPLEMENTATIONS,
    MAX_TPU_CONTEXT,
    ContextGeometry,
    context_attention,
)
from pallas_kernels.context_attention import tpu as ctx_tpu
from pallas_kernels.context_attention.xla import attention
from tests.kernels.device_backends import compiled

ANYWHERE = [name for name, entry in BACKENDS.items() if entry.platform is None]
"""The names that run on any platform (interpreters, simulators, XLA stand-ins)."""
TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2, jnp.float16: 5e-3}


def inputs(seed, rows, q_len, q_heads, kv_heads, kv_len, head_dim, dtype):
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), dtype)

    return normal(rows, q_len, q_heads, head_dim), normal(rows, kv_len, kv_heads, head_dim), \
        normal(rows, kv_len, kv_heads, head_dim)


def reference(q, k, v, scale=None):
    """The XLA path in float32 at full matmul precision."""
    with jax.default_matmul_precision("highest"):
        return attention(*(x.astype(jnp.float32) for x in (q, k, v)), scale=scale)


CASES = [
    # rows, q_len, q_heads, kv_heads, kv_len, head_dim, block_q
    (2, 100, 4, 2, 24, 16, 32),     # GQA, the last query block partial, a padded context
    (1, 64, 2, 2, 128, 64, None),   # a context of whole lanes, one query block
    (3, 7, 2, 1, 7, 64, None),      # tiny: one partial block, 7 context tokens
    (2, 100, 2, 2, 24, 128, 32),    # the token-major arrays read as they are, a padded context
    (1, 300, 12, 12, 512, 128, 96),  # Wan's heads and text length, several blocks
]


@pytest.mark.parametrize("backend", ANYWHERE + [compiled("pallas_tpu"), compiled("cudnn_gather")])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", CASES[:4])
def test_every_backend_matches_the_reference(backend, dtype, case):
    rows, q_len, q_heads, kv_heads, kv_len, head_dim, block_q = case
    q, k, v = inputs(0, rows, q_len, q_heads, kv_heads, kv_len, head_dim, dtype)
    out = context_attention(q, k, v, backend=backend, block_q=block_q)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not np.isnan(np.asarray(out, np.float32)).any()
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(reference(q, k, v)),
                               atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["pallas_tpu_interpret", compiled("pallas_tpu")])
def test_the_tpu_kernel_at_wans_heads_and_text_length(backend):
    """12 heads, 512 text tokens, several query blocks, bf16; and a given scale."""
    q, k, v = inputs(1, *CASES[4][:-1], jnp.bfloat16)
    out = context_attention(q, k, v, backend=backend, block_q=CASES[4][-1], scale=0.05)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(reference(q, k, v, scale=0.05)),
                               atol=3e-2, rtol=3e-2)


def test_the_xla_path_is_the_dense_attention_the_references_use():
    q, k, v = inputs(2, 2, 9, 4, 2, 5, 16, jnp.float32)
    np.testing.assert_array_equal(context_attention(q, k, v, backend="xla"), attention(q, k, v))


def test_a_backend_runs_its_table_entry():
    assert list(IMPLEMENTATIONS) == list(BACKENDS)
    assert IMPLEMENTATIONS["pallas_tpu"] is IMPLEMENTATIONS["pallas_tpu_gather"]
    assert IMPLEMENTATIONS["pallas_gpu_interpret"] is IMPLEMENTATIONS["xla"]
    assert IMPLEMENTATIONS["cudnn_gather_xla"] is IMPLEMENTATIONS["xla"]
    assert resolve_backend("auto", "tpu").name == "pallas_tpu"


@pytest.mark.parametrize("q_len, group, kv_len, want", [
    (4680, 1, 512, 1560),   # Wan 480x832: three even blocks
    (100, 2, 24, 104),      # one block, rounded up to 8
    (4680, 1, 8192, 248),   # a long context: the logits' budget cuts the block (19 even blocks)
    (5, 1, 7, 8),
])
def test_the_default_query_block(q_len, group, kv_len, want):
    block = ctx_tpu.default_block_q(q_len, group, kv_len)
    assert block == want and block % 8 == 0
    assert 4 * group * block * ((kv_len + 127) // 128 * 128) <= ctx_tpu.LOGIT_BYTES or block == 8


def test_the_geometry():
    q, k, v = inputs(3, 2, 9, 4, 2, 5, 16, jnp.float32)
    geom = ContextGeometry(2, 9, 4, 2, 16, 5)
    assert geom.group == 2
    from pallas_kernels.context_attention import static_validate_inputs
    assert static_validate_inputs(q, k, v, backend=BACKENDS["xla"]) == geom


@pytest.mark.parametrize("change, error, match", [
    (lambda q, k, v: (q[0], k, v), ValueError, "q must have rank 4"),
    (lambda q, k, v: (np.zeros(3), k, v), ValueError, "q must have rank 4"),
    (lambda q, k, v: ("q", k, v), TypeError, "q must be an array"),
    (lambda q, k, v: (q, k.astype(jnp.bfloat16), v), ValueError, "k.dtype must equal q.dtype"),
    (lambda q, k, v: (q, k, v[:, :3]), ValueError, "v.shape must equal k.shape"),
    (lambda q, k, v: (q, k[:1], v[:1]), ValueError, "must have q's rows"),
    (lambda q, k, v: (q[:, :, :3], k, v), ValueError, "multiple of kv_heads"),
    (lambda q, k, v: (q.astype(jnp.int32), k.astype(jnp.int32), v.astype(jnp.int32)), ValueError,
     "q.dtype must be one of"),
])
def test_bad_arrays_are_refused(change, error, match):
    q, k, v = inputs(4, 2, 9, 4, 2, 5, 16, jnp.float32)
    with pytest.raises(error, match=match):
        context_attention(*change(q, k, v))


@pytest.mark.parametrize("kwargs, match", [
    (dict(scale=0.0), "scale must be a positive finite number"),
    (dict(scale=float("nan")), "scale must be a positive finite number"),
    (dict(block_q=12), "block_q must be a positive multiple of 8"),
    (dict(block_q=0), "block_q must be a positive multiple of 8"),
    (dict(backend="tpu"), "backend must be one of"),
])
def test_bad_options_are_refused(kwargs, match):
    q, k, v = inputs(5, 1, 9, 2, 2, 5, 16, jnp.float32)
    with pytest.raises(ValueError, match=match):
        context_attention(q, k, v, **kwargs)


def test_a_context_too_long_for_the_tpu_kernel_is_refused():
    q = jax.ShapeDtypeStruct((1, 8, 1, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, MAX_TPU_CONTEXT + 1, 1, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match=rf"kv_len \(k.shape\[1\] = {MAX_TPU_CONTEXT + 1}\) must be at most"):
        jax.eval_shape(lambda q, k: context_attention(q, k, k, backend="pallas_tpu_interpret"), q, k)
