"""Gather-then-splash window attention on TPU (``"pallas_tpu_gather"``, ``_interpret``): the
yardstick of the paged kernel (:mod:`~pallas_kernels.window_attention.tpu`), and a fallback.

Same arguments, shapes and semantics as :func:`pallas_kernels.window_attention.window_attention`.
For one layer it gathers each row's visible history tokens into contiguous head-major K/V (frame
padding skipped, slots past the length selected to 0; quantized pages gathered at their stored width,
then dequantized to the compute dtype), appends the current chunk and extras, and
runs jax's splash attention per KV head (MQA form) with padded and invalid keys removed by segment
ids. Never a pool is copied. Block sizes: :data:`TUNED_BLOCKS`; details: ``docs/kernels.md`` (Paged
window attention).
"""

from __future__ import annotations

import functools
import math
import os
import re
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.backend import resolve_backend
from pallas_kernels.checks import argument_error, require_int
from pallas_kernels.common import round_up
from pallas_kernels.layout import read_tokens_as
from pallas_kernels.window_attention.geometry import WindowGeometry
from pallas_kernels.window_attention.tpu import default_generation
from pallas_kernels.window_attention.validation import check_arrays, check_scale

TUNED_BLOCKS = {
    # Chosen by benchmarks/tpu_compile.py's bundle estimate at wan-1.3b with 12 visible frames
    # (--baseline-blocks sweep, benchmarks/RESULTS.md), among tiles within splash's default scoped
    # VMEM at the preset's 9 history frames, 1 and 4 rows (v6e's 2432/4096/1024, best at 12 frames,
    # needs 32.4 MiB there; 1664/4096/1024 was next, 3 % slower).
    "v5e": dict(block_q=2432, block_kv=2048, block_kv_compute=256),
    "v6e": dict(block_q=1664, block_kv=4096, block_kv_compute=1024),
}
"""Splash block sizes per generation under the chip's default scoped VMEM (picked like the paged
kernel's, by :func:`~pallas_kernels.window_attention.tpu.default_generation`; ``"v5e"`` off TPU)."""
RAISED_VMEM_BLOCKS = {
    # Chosen by benchmarks/tpu_compile.py's --baseline-blocks sweep at wan-1.3b (9 history frames +
    # the 3-frame chunk: 18,720 keys) under the scoped VMEM limit the paged kernel sets there (v5e
    # 32 MiB, v6e 77.9 MiB) at 1 and 4 rows; splash kernel ms per row and layer: v5e 2432/3840/256
    # 3.077 (2432/6400/256 3.046 but over the limit at 4 rows; 2432/4864/256 3.101,
    # 4736/2560/256 3.169, 4736/2048/256 3.178, 2432/4096/256 3.270, 2432/2048/512 3.600,
    # block_kv_compute 128 >= 5.59; 4736 with block_kv >= 3840 or block_kv_compute >= 512 over
    # the limit); v6e 4736/3840/1280 1.898 (2432/6400/1280 1.903,
    # 2432/6272/896 1.939, 2432/3840/1280 1.954, 4736/4096/1024 1.964, 1664/6400/1280 1.988,
    # 2432/4096/1024 2.029, 2432/6400/3200 2.043; 4736 with block_kv >= 6272 over the limit).
    "v5e": (32 << 20, dict(block_q=2432, block_kv=3840, block_kv_compute=256)),
    "v6e": (77 << 20, dict(block_q=4736, block_kv=3840, block_kv_compute=1280)),
}
"""``(scoped VMEM limit, splash blocks)`` per generation: the blocks taken instead of
:data:`TUNED_BLOCKS` when the process's scoped VMEM limit (:func:`scoped_vmem_limit`) is at least
that limit. Splash sets no VMEM limit of its own, so its tiles must fit the process's."""
SCOPED_VMEM_FLAG = "--xla_tpu_scoped_vmem_limit_kib"
"""The ``LIBTPU_INIT_ARGS`` flag that sets XLA:TPU's scoped VMEM limit (KiB) for a process."""


def scoped_vmem_limit(generation: str) -> int:
    """The scoped VMEM limit (bytes) splash's kernels compile under in this process: the
    :data:`SCOPED_VMEM_FLAG` value in ``LIBTPU_INIT_ARGS`` (which libtpu reads when it starts),
    else ``generation``'s default (:data:`pallas_kernels.tpu_aot.CHIPS`)."""
    from pallas_kernels.tpu_aot import check_generation

    default = check_generation(generation).scoped_vmem_default
    found = re.findall(rf"{SCOPED_VMEM_FLAG}=(\d+)", os.environ.get("LIBTPU_INIT_ARGS", ""))
    return int(found[-1]) * 1024 if found else default


def tuned_blocks(generation: str) -> dict:
    """The splash blocks of ``generation`` for this process's scoped VMEM limit: the
    :data:`RAISED_VMEM_BLOCKS` row when the limit reaches it, else the :data:`TUNED_BLOCKS` row."""
    limit, raised = RAISED_VMEM_BLOCKS[generation]
    return dict(raised if scoped_vmem_limit(generation) >= limit else TUNED_BLOCKS[generation])


def resolve_blocks(generation: str | None = None, **overrides) -> dict:
    """The tuned splash blocks of ``generation`` (default: the default device's;
    :func:`tuned_blocks`) with the non-None ``overrides`` applied, validated.

    Raises:
      ValueError: unknown generation; a block size that is not a positive multiple of 128, or a
        ``block_kv_compute`` that does not divide ``block_kv``.
    """
    generation = default_generation() if generation is None else generation
    if generation not in TUNED_BLOCKS:
        raise ValueError(f"generation must be one of {sorted(TUNED_BLOCKS)}, got {generation!r}")
    tuned = tuned_blocks(generation)
    blocks = {k: tuned[k] if overrides.get(k) is None else overrides[k]
              for k in ("block_q", "block_kv", "block_kv_compute")}
    blocks = {name: require_int(name, value, minimum=128, multiple_of=128, must="a positive multiple of 128")
              for name, value in blocks.items()}
    if blocks["block_kv"] % blocks["block_kv_compute"]:
        raise argument_error("block_kv_compute", blocks["block_kv_compute"],
                             f"a divisor of block_kv={blocks['block_kv']}")
    return blocks


def gather_window_attention(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, *, layer=0,
                            extra_k=None, extra_v=None, scale=None, tokens_per_frame=None,
                            block_q=None, block_kv=None, block_kv_compute=None,
                            generation=None, interpret: bool = False):
    """Window attention by gathering the visible pages and running splash attention.

    Args: those of :func:`pallas_kernels.window_attention.window_attention`, plus splash's
      ``block_q``, ``block_kv`` and ``block_kv_compute`` (multiples of 128, ``block_kv_compute``
      dividing ``block_kv``; defaults the :data:`TUNED_BLOCKS` row of ``generation``, ``"v5e"`` or
      ``"v6e"``, default the default device's) and ``interpret`` (a bool: splash's interpret mode).

    Returns:
      as :func:`pallas_kernels.window_attention.window_attention`: ``q``'s shape and dtype.

    Raises:
      ValueError: those of ``window_attention``; an unknown generation; a block size that is not a
        positive multiple of 128, or a ``block_kv_compute`` that does not divide ``block_kv``.
    """
    geom = check_arrays(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, layer=layer,
                        extra_k=extra_k, extra_v=extra_v, tokens_per_frame=tokens_per_frame)
    blocks = resolve_blocks(generation, block_q=block_q, block_kv=block_kv,
                            block_kv_compute=block_kv_compute)
    scale = check_scale(geom.head_dim ** -0.5 if scale is None else scale)
    return _gather_attention(q, k_cur, v_cur, extra_k, extra_v, k_pool, v_pool, pages, lengths,
                             jnp.asarray(layer, jnp.int32), geom=geom, scale=scale,
                             blocks=tuple(sorted(blocks.items())), interpret=interpret)


def _attention(q, k_cur, v_cur, extra_k, extra_v, k_pool, v_pool, pages, lengths, layer, *,
               geom: WindowGeometry, scale: float, backend: str):
    """The dispatcher's entry, private to the package (inputs already validated): the default
    device's :func:`tuned_blocks` shrunk to the call's query and key lengths (multiples of 128)."""
    tuned = tuned_blocks(default_generation())
    kv_len = geom.capacity + geom.tail_len
    block_q = min(tuned["block_q"], round_up(geom.q_len, 128))
    block_kv = min(tuned["block_kv"], round_up(kv_len, 128))
    block_kv_compute = 128 * math.gcd(block_kv // 128, tuned["block_kv_compute"] // 128)
    blocks = dict(block_q=block_q, block_kv=block_kv, block_kv_compute=block_kv_compute)
    return _gather_attention(q, k_cur, v_cur, extra_k, extra_v, k_pool, v_pool, pages, lengths,
                             layer, geom=geom, scale=scale, blocks=tuple(sorted(blocks.items())),
                             interpret=bool(resolve_backend(backend).interpret))


def gather_history(pool, pages, lengths, layer, geom, dtype):
    """Each row's history tokens of ``layer`` by position as ``dtype``: ``[rows, kv_heads,
    capacity, head_dim]`` (slots past ``lengths`` selected to 0) and their validity ``[rows,
    capacity]``. A :class:`~pallas_kernels.layout.QuantizedPool` is gathered at its stored width,
    then dequantized (:func:`~pallas_kernels.layout.read_tokens_as`)."""
    tpf = geom.tokens_per_frame
    token = jnp.arange(geom.capacity, dtype=jnp.int32)
    valid = token[None, :] < lengths.astype(jnp.int32)[:, None]
    slot = (token // tpf) * geom.pages_per_frame * geom.block_size + token % tpf
    page = jnp.where(valid, pages.astype(jnp.int32)[:, slot // geom.block_size], 0)
    offset = jnp.where(valid, slot % geom.block_size, 0)
    hist = read_tokens_as(pool, layer, page, offset, dtype)  # [rows, capacity, kv_heads, head_dim]
    hist = jnp.where(valid[:, :, None, None], hist, jnp.zeros((), dtype))
    return hist.transpose(0, 2, 1, 3), valid


@functools.partial(jax.jit, static_argnames=("geom", "scale", "blocks", "interpret"))
def _gather_attention(q, k_cur, v_cur, extra_k, extra_v, k_pool, v_pool, pages, lengths, layer, *,
                      geom, scale: float, blocks: tuple, interpret: Any):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    b = dict(blocks)
    rows, hkv, g, d = geom.rows, geom.kv_heads, geom.group, geom.head_dim
    q_pad = -(-geom.q_len // b["block_q"]) * b["block_q"]
    kv_len = geom.capacity + geom.tail_len
    kv_pad = -(-kv_len // b["block_kv"]) * b["block_kv"]

    def keys(pool, cur, extra):
        hist, valid = gather_history(pool, pages, lengths, layer, geom, q.dtype)
        tail = [cur] + ([] if extra is None else [extra])
        tail = jnp.concatenate(tail, axis=1).transpose(0, 2, 1, 3)
        pad = jnp.zeros((rows, hkv, kv_pad - kv_len, d), q.dtype)
        return jnp.concatenate([hist, tail, pad], axis=2), valid

    k, valid = keys(k_pool, k_cur, extra_k)
    v, _ = keys(v_pool, v_cur, extra_v)
    kv_segment = jnp.concatenate([jnp.where(valid, 0, 1), jnp.zeros((rows, geom.tail_len), jnp.int32),
                                  jnp.ones((rows, kv_pad - kv_len), jnp.int32)], axis=1)
    qs = (q.astype(jnp.float32) * scale).astype(q.dtype)
    qs = jnp.pad(qs, ((0, 0), (0, q_pad - geom.q_len), (0, 0), (0, 0)))
    qs = qs.reshape(rows, q_pad, hkv, g, d).transpose(0, 2, 3, 1, 4)  # [rows, Hkv, G, q, D]

    mask = masks.MultiHeadMask([masks.FullMask((q_pad, kv_pad)) for _ in range(g)])
    kernel = splash.make_splash_mqa_single_device(
        mask, block_sizes=splash.BlockSizes(block_q=b["block_q"], block_kv=b["block_kv"],
                                            block_kv_compute=b["block_kv_compute"]),
        interpret=interpret)

    def one(q_h, k_h, v_h, seg):  # one (row, KV head): q [G, q, D], k/v [kv, D]
        ids = splash.SegmentIds(q=jnp.zeros((q_pad,), jnp.int32), kv=seg)
        return kernel(q_h, k_h, v_h, segment_ids=ids)

    per_head = jax.vmap(one, in_axes=(0, 0, 0, None))
    out = jax.vmap(per_head)(qs, k, v, kv_segment)  # [rows, Hkv, G, q_pad, D]
    out = out.transpose(0, 3, 1, 2, 4).reshape(rows, q_pad, geom.num_q_heads, d)
    return out[:, :geom.q_len].astype(q.dtype)
