"""The q/k/v projection in plain XLA (every backend but the TPU ones, and the reference).
Semantics and shapes: :func:`pallas_kernels.qkv_projection.qkv_projection`."""

from __future__ import annotations

from pallas_kernels.cross_query.xla import linear, rms_norm


def projections(x, w_q, b_q, q_gain, w_k, b_k, k_gain, w_v, b_v, *, eps):
    """The call on one layer's weights (matrices ``[dim, n]``, vectors ``[n]`` or ``[1, n]``):
    ``(rms_norm(linear(x, w_q, b_q), q_gain), rms_norm(linear(x, w_k, b_k), k_gain), linear(x, w_v,
    b_v))``."""
    return (rms_norm(linear(x, w_q, b_q), q_gain, eps), rms_norm(linear(x, w_k, b_k), k_gain, eps),
            linear(x, w_v, b_v))


def qkv_projection(x, w_q, b_q, q_gain, w_k, b_k, k_gain, w_v, b_v, layer, *, eps):
    """The reference: :func:`projections` on layer ``layer`` of the stacks."""
    return projections(x, *(stack[layer] for stack in (w_q, b_q, q_gain, w_k, b_k, k_gain, w_v, b_v)), eps=eps)
