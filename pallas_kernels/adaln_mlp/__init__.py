"""The adaLN MLP of a DiT block: ``x + gate * ffn_out(gelu(ffn_in(layer_norm(x) * (1 + scale) +
shift)))``, with one ``shift``/``scale``/``gate`` row per frame of tokens and the weights taken
from the model's stacked ``[L, ...]`` arrays at a layer index, as one call.

:func:`adaln_mlp` is the entry point (its docstring tables the shapes); it checks the call and
runs the ``backend=`` name's implementation from :data:`IMPLEMENTATIONS`: plain XLA
(:mod:`~pallas_kernels.adaln_mlp.xla`, also the reference) or a Mosaic TPU kernel
(:mod:`~pallas_kernels.adaln_mlp.tpu`) that keeps the hidden activations in VMEM and writes its
output over ``x``. Design and figures: ``docs/kernels.md`` (adaLN MLP).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp

from pallas_kernels.adaln_mlp import tpu, xla
from pallas_kernels.adaln_mlp.geometry import KERNEL_PREFIX, MLPGeometry, geometry_of_kernel, kernel_name
from pallas_kernels.backend import Backend, resolve_backend, tpu_kernel_else_xla
from pallas_kernels.checks import require_index, require_real
from pallas_kernels.common import (
    check_rank,
    check_same_dtype,
    check_supported_dtype,
    check_validate,
    stacked_layer,
)

__all__ = ["IMPLEMENTATIONS", "KERNEL_PREFIX", "MLPGeometry", "adaln_mlp", "geometry_of_kernel", "kernel_name",
           "static_validate_inputs"]


def adaln_mlp(x, shift, scale, gate, w_in, b_in, w_out, b_out, layer, *, next_modulation=None, residual_input=None,
              eps=1e-6, backend="auto", validate=True):
    """One DiT block's MLP with its adaLN modulation and gated residual add.

    ===========================  ====================  ==========================
    ``x``                        ``[B, N, dim]``       f32, bf16, f16
    ``shift``, ``scale``,        ``[B, F, dim]``       ``x``'s dtype
    ``gate``
    ``w_in``                     ``[L, dim, hidden]``  f32, bf16, f16
    ``b_in``                     ``[L, hidden]``       ``w_in``'s dtype
    ``w_out``                    ``[L, hidden, dim]``  ``w_in``'s dtype
    ``b_out``                    ``[L, dim]``          ``w_in``'s dtype
    ``layer``                    scalar                integer, in ``[0, L)``
    ``next_modulation``          two ``[B, F, dim]``   ``x``'s dtype
    ``residual_input``           ``[B, N, dim]``,      ``w_in``'s dtype
                                 ``[L, dim, dim]``,
                                 ``[L, dim]``
    output                       ``[B, N, dim]``       ``x``'s dtype
    next input                   ``[B, N, dim]``       ``w_in``'s dtype
    ===========================  ====================  ==========================

    Token ``n`` belongs to frame ``n // (N // F)`` (``F`` divides ``N``) and reads that frame's
    rows. The layer norm has no scale or bias and keeps its statistics in at least float32
    (:func:`~pallas_kernels.adaln_mlp.xla.layer_norm`); its modulated output is cast to the
    weights' dtype, and each linear layer computes in that dtype (the product accumulated in
    float32 and rounded once, then the bias added), the GELU (tanh approximation) too; the gated
    output is added to ``x`` in ``x``'s dtype (float32 under a DiT's mixed precision).

    Args:
      x: the residual stream (a donated ``x`` is overwritten in place on a TPU).
      shift, scale, gate: the frame's modulation rows.
      w_in, b_in, w_out, b_out: the FFN-in and FFN-out weights and biases of every layer.
      layer: which layer's weights (a Python int or an integer array; may be traced).
      next_modulation: optional ``(shift, scale)`` of the next block's attention input: the call
        then also returns the output normalized and modulated by them, cast to the weights' dtype
        (:func:`~pallas_kernels.adaln_mlp.xla.modulated_input`), as the next block's
        self-attention reads it; the TPU kernel writes it from the block it has in VMEM.
      residual_input: optional ``(r, w, b)``: the MLP then runs on ``x + r @ w[layer] + b[layer]``
        (the product in the weights' dtype, added in ``x``'s), which is also the residual its
        gated output is added to: a block's cross-attention output ``r`` and its output projection.
      eps: the layer norm's epsilon (a positive real).
      backend: a name from :data:`pallas_kernels.backend.BACKEND_NAMES`. The TPU names run the
        Mosaic kernel where both weights and a block of a frame's tokens fit its VMEM
        (:func:`~pallas_kernels.adaln_mlp.tpu.block_rows`), else XLA; the others XLA.
      validate: the value check of an array ``layer`` (:data:`pallas_kernels.common.VALIDATE_MODES`);
        unchecked, a layer out of range reads some other part of the weights' buffers.

    Returns:
      the output, or with ``next_modulation`` the pair ``(output, next input)``.

    Raises:
      TypeError: an input that is not an array, a layer that is not an integer scalar, an ``eps``
        that is not a real number.
      ValueError: mismatched shapes or dtypes, a layer out of range, a non-positive ``eps``, an
        unknown backend.
    """
    resolved = resolve_backend(backend)
    check_validate(validate)
    eps = require_real("eps", eps, low=0.0, low_open=True)
    geom = static_validate_inputs(x, shift, scale, gate, w_in, b_in, w_out, b_out, layer, next_modulation,
                                  residual_input)
    layer = stacked_layer(layer, w_in.shape[0], "w_in.shape[0]", validate)
    return IMPLEMENTATIONS[resolved.name](x, shift, scale, gate, w_in, b_in, w_out, b_out, layer, next_modulation,
                                          residual_input, eps=eps, geom=geom, backend=resolved)


def static_validate_inputs(x, shift, scale, gate, w_in, b_in, w_out, b_out, layer, next_modulation=None,
                           residual_input=None) -> MLPGeometry:
    """The call's :class:`MLPGeometry`, or the error :func:`adaln_mlp` raises."""
    check_rank("x", x, 3, "[B, N, dim]")
    per_frame = [("shift", shift), ("scale", scale), ("gate", gate)]
    if next_modulation is not None:
        if not (isinstance(next_modulation, (tuple, list)) and len(next_modulation) == 2):
            raise ValueError(f"next_modulation must be a pair (shift, scale), got {type(next_modulation).__name__}")
        per_frame += [("next_modulation[0]", next_modulation[0]), ("next_modulation[1]", next_modulation[1])]
    for name, array in per_frame:
        check_rank(name, array, 3, "[B, F, dim]")
    check_rank("w_in", w_in, 3, "[L, dim, hidden]")
    check_rank("b_in", b_in, 2, "[L, hidden]")
    check_rank("w_out", w_out, 3, "[L, hidden, dim]")
    check_rank("b_out", b_out, 2, "[L, dim]")
    require_index("layer", layer, w_in.shape[0], "w_in.shape[0]")
    check_supported_dtype("x.dtype", x.dtype)
    check_supported_dtype("w_in.dtype", w_in.dtype)
    check_same_dtype("x", x.dtype, per_frame)
    check_same_dtype("w_in", w_in.dtype, (("b_in", b_in), ("w_out", w_out), ("b_out", b_out)))
    batch, tokens, dim = x.shape
    num_layers, _, hidden = w_in.shape
    if min(x.shape) < 1 or min(w_in.shape) < 1:
        raise ValueError(f"every dimension of x and w_in must be positive, got x {tuple(x.shape)}, "
                         f"w_in {tuple(w_in.shape)}")
    expected = {"w_in": (num_layers, dim, hidden), "b_in": (num_layers, hidden), "w_out": (num_layers, hidden, dim),
                "b_out": (num_layers, dim)}
    for name, array in (("w_in", w_in), ("b_in", b_in), ("w_out", w_out), ("b_out", b_out)):
        if tuple(array.shape) != expected[name]:
            raise ValueError(f"{name}.shape must be {expected[name]} (L and hidden of w_in, dim of x), got "
                             f"{tuple(array.shape)}")
    frames = shift.shape[1]
    for name, array in per_frame:
        if array.shape[0] != batch or array.shape[2] != dim or array.shape[1] != frames or frames < 1 \
                or tokens % frames:
            raise ValueError(f"{name}.shape must be ({batch}, F, {dim}), one F for every row table "
                             f"dividing N = {tokens}, got {tuple(array.shape)}")
    if residual_input is not None:
        _check_residual_input(residual_input, x.shape, w_in.dtype, num_layers)
    return MLPGeometry(batch * tokens, dim, hidden, tokens // frames, next_modulation is not None,
                       residual_input is not None)


def _check_residual_input(residual_input, x_shape, dtype, num_layers) -> None:
    """Raises the ``ValueError`` :func:`adaln_mlp` raises for a bad ``residual_input``."""
    if not (isinstance(residual_input, (tuple, list)) and len(residual_input) == 3):
        raise ValueError(f"residual_input must be a triple (r, w, b), got {type(residual_input).__name__}")
    names = ("residual_input[0]", "residual_input[1]", "residual_input[2]")
    dim = x_shape[2]
    expected = (tuple(x_shape), (num_layers, dim, dim), (num_layers, dim))
    for name, array, shape in zip(names, residual_input, expected):
        check_rank(name, array, len(shape))
        if tuple(array.shape) != shape:
            raise ValueError(f"{name}.shape must be {shape} (x's, L of w_in), got {tuple(array.shape)}")
    check_same_dtype("w_in", dtype, tuple(zip(names, residual_input)))


# The implementations of the registry, one signature (:data:`IMPLEMENTATIONS`).

def _xla(x, shift, scale, gate, w_in, b_in, w_out, b_out, layer, next_modulation, residual_input, *, eps: float,
         geom: MLPGeometry, backend: Backend):
    return xla.adaln_mlp(x, shift, scale, gate, w_in, b_in, w_out, b_out, layer, eps=eps,
                         next_modulation=next_modulation, residual_input=residual_input)


def _pallas_tpu(x, shift, scale, gate, w_in, b_in, w_out, b_out, layer, next_modulation, residual_input, *,
                eps: float, geom: MLPGeometry, backend: Backend):
    rows = tpu.block_rows(geom, jnp.dtype(w_in.dtype).itemsize, jnp.dtype(x.dtype).itemsize)
    if rows is None:
        return _xla(x, shift, scale, gate, w_in, b_in, w_out, b_out, layer, next_modulation, residual_input, eps=eps,
                    geom=geom, backend=backend)
    return tpu.adaln_mlp(x, shift, scale, gate, w_in, b_in, w_out, b_out, layer, next_modulation, residual_input,
                         eps=eps, rows_per_block=rows, interpret=backend.interpret)


IMPLEMENTATIONS: Mapping[str, Callable[..., jax.Array]] = tpu_kernel_else_xla(_pallas_tpu, _xla)
"""This kernel's table of the backend registry (:data:`pallas_kernels.backend.BACKENDS`, the same
names): backend name to implementation, called as ``impl(x, shift, scale, gate, w_in, b_in, w_out,
b_out, layer, next_modulation, residual_input, *, eps, geom, backend)`` on validated inputs. The
TPU names run the Mosaic kernel where its blocks fit; every other name runs XLA."""
