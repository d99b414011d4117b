"""Window attention through cuDNN (``"cudnn_gather"``) or, for CPU tests of the same code path,
jax's XLA attention (``"cudnn_gather_xla"``): gather the visible history, then one
``jax.nn.dot_product_attention`` with per-row key lengths.

The history is gathered with zeros (selected) at and past each row's length, and the keys are laid
out ``[current chunk, extras, history]``, so every row's valid keys are a prefix that
``key_value_seq_lengths`` expresses; cuDNN does GQA itself. A quantized pool
(:class:`pallas_kernels.layout.QuantizedPool`) is gathered at its 8-bit width and dequantized to
the compute dtype right after the gather, as the ``"xla"`` path does. ``"cudnn_gather"`` needs an NVIDIA GPU
with cuDNN, bf16 or f16, ``head_dim % 8 == 0`` and ``head_dim <= 256``; ``"cudnn_gather_xla"`` runs
anywhere. Semantics and shapes: :func:`pallas_kernels.window_attention.window_attention`; why not
cuDNN's paged attention, and costs: ``docs/kernels.md`` (Paged window attention).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.window_attention.geometry import WindowGeometry, tail_kv
from pallas_kernels.window_attention.xla import gather_history

IMPLEMENTATION_OF = {"cudnn_gather": "cudnn", "cudnn_gather_xla": "xla"}
"""``jax.nn.dot_product_attention``'s ``implementation`` for each backend name."""


@functools.partial(jax.jit, static_argnames=("geom", "scale", "backend"))
def window_attention(q, k_cur, v_cur, extra_k, extra_v, k_pool, v_pool, pages, lengths, layer,
                     *, geom: WindowGeometry, scale: float, backend: str):
    """Keys ``[tail, history]`` per row with valid prefix ``tail_len + lengths``; see the module
    docstring.

    Arguments as :func:`pallas_kernels.window_attention.window_attention` (``layer`` an int32
    scalar, ``extra_k``/``extra_v`` possibly ``None``); ``geom`` from its static validation;
    ``backend`` ``"cudnn_gather"`` or ``"cudnn_gather_xla"``.
    """
    implementation = IMPLEMENTATION_OF[backend]
    k_tail, v_tail = tail_kv(k_cur, v_cur, extra_k, extra_v, geom.tail_len)
    k, v = (jnp.concatenate([tail, gather_history(pool, pages, lengths, layer, geom, tail.dtype)], axis=1)
            for tail, pool in ((k_tail, k_pool), (v_tail, v_pool)))
    kv_lengths = lengths.astype(jnp.int32) + geom.tail_len
    if implementation != "cudnn" and q.dtype == jnp.float16:
        # jax's XLA attention asks for F16_F16_F32 dots, which XLA:CPU rejects: compute in f32.
        q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    out = jax.nn.dot_product_attention(q, k, v, scale=scale, key_value_seq_lengths=kv_lengths,
                                       implementation=implementation)
    return out.astype(k_cur.dtype)
