"""Window attention through cuDNN (``"cudnn_gather"``) or, for CPU tests of the same code path,
jax's XLA attention (``"cudnn_gather_xla"``): gather the visible history, then one
``jax.nn.dot_product_attention`` with per-row key lengths.

Per call (one layer):

1. **Gather.** :func:`~pallas_kernels.window_attention.xla.gather_history` reads each row's history
   tokens ``t < capacity`` through the page table into contiguous ``[rows, capacity, kv_heads,
   head_dim]`` K and V, with zeros (selected) at and past ``lengths[row]``: NaN in free or foreign
   pages, frame padding or past a row's length never reaches the attention, whether or not cuDNN's
   padding mask would keep it out of ``P @ V``.
2. **Order.** There is no causal mask, so the key order is free: keys are laid out as ``[current
   chunk, extras, history]``, and the valid keys of every row are the prefix of length
   ``cur_len + num_extra + lengths[row]``, which ``key_value_seq_lengths`` (cuDNN's padding mask)
   expresses; no ``[q, k]`` mask is materialised.
3. **Attend.** ``q`` as given (BTNH), K/V at ``kv_heads`` heads (cuDNN does GQA itself).

The gather reads and writes ``2 * rows * (capacity + tail) * kv_heads * head_dim`` elements once on
top of what the attention reads; the fused paged kernel (:mod:`.mosaic_gpu`) avoids that pass, and
this path is its yardstick.

cuDNN's own paged attention (``page_table_k``/``page_table_v``) does not fit: it needs every valid
token of a row in its pages as a prefix of the page list, while the current chunk and extras are
not in the pool and frames with ``tokens_per_frame % block_size != 0`` leave padding inside the
sequence.

Requirements of ``"cudnn_gather"``: an NVIDIA GPU with cuDNN (jax traces the cuDNN call only where
a GPU backend is present), bf16 or f16, ``head_dim % 8 == 0`` and ``head_dim <= 256`` (``<= 128``
before Hopper, checked by jax). ``"cudnn_gather_xla"`` runs on any platform and dtype (f16 is
computed in f32, which XLA:CPU needs).
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
    k = jnp.concatenate([k_tail, gather_history(k_pool, pages, lengths, layer, geom)], axis=1)
    v = jnp.concatenate([v_tail, gather_history(v_pool, pages, lengths, layer, geom)], axis=1)
    kv_lengths = lengths.astype(jnp.int32) + geom.tail_len
    if implementation != "cudnn" and q.dtype == jnp.float16:
        # jax's XLA attention asks for F16_F16_F32 dots, which XLA:CPU rejects: compute in f32.
        q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    out = jax.nn.dot_product_attention(q, k, v, scale=scale, key_value_seq_lengths=kv_lengths,
                                       implementation=implementation)
    return out.astype(k_cur.dtype)
