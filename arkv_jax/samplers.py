"""The few-step samplers of the Wan 2.1 family: schedules, updates, per-step noise, commit input.

:class:`arkv_jax.rollout.Sampler` holds a sampler's settings; this module is the math both the
paged rollout (:func:`arkv_jax.rollout.generate_chunk`) and the exactness reference
(:class:`arkv_jax.reference.FullRecompute`) run, so the two cannot drift apart.

Schedule. Noise levels ``sigma`` in ``[0, 1]`` (model timestep ``t = 1000 sigma``) under Wan's shift
warp :func:`warp` ``sigma' = shift s / (1 + (shift - 1) s)``, of either ``s`` evenly spaced from 1
to 0 (``num_steps + 1`` points) or an explicit timestep list ``s = t / 1000`` followed by 0.

Updates (``Sampler.update``), from the chunk's starting noise ``x = eps_0`` at ``sigma_0``:

* ``"euler"``: deterministic flow-matching Euler steps ``x <- x + (sigma' - sigma) v(x, sigma)``.
* ``"x0"``: what the distilled causal checkpoints were trained for (DMD): each step predicts the
  clean latents ``x0 = x - sigma v(x, sigma)`` and re-noises them to the next level with *fresh*
  noise, ``x <- (1 - sigma') x0 + sigma' eps_{i+1}``; the last step returns ``x0`` (its
  ``sigma' = 0``).

Commit input. The commit forward that writes the chunk's K/V normally runs on the clean latents at
``t = 0``; with ``context_noise = t_c > 0`` it runs at timestep ``t_c`` on
``(1 - t_c / 1000) x0 + (t_c / 1000) eps_c`` (Self-Forcing's ``context_noise``; no warp: the
reference looks the level up on its shifted grid by timestep, so ``sigma = t / 1000``).

Noise draws. A session's chunk needs ``Sampler.noise_draws`` standard-normal arrays of the chunk's
shape, drawn on the host by :func:`session_noise` from ``(seed, chunk_index, draw)`` alone, so they
are reproducible and independent of which sessions share a batch: draw 0 is the starting noise
(:func:`arkv_jax.rollout.chunk_noise`, unchanged from the Euler-only rollout), draws
``1 .. num_steps - 1`` the ``"x0"`` update's fresh noise before steps ``1 ..``, and the last the
commit noise when ``context_noise > 0``.

Which checkpoint uses which (the presets on :class:`arkv_jax.rollout.Sampler`, also in
:data:`arkv_jax.rollout.SAMPLERS`):

=================  ================================  =====  ======  =============  =====================
preset             timesteps (before the warp)       shift  update  context_noise  checkpoints
=================  ================================  =====  ======  =============  =====================
``euler``          ``num_steps`` evenly from 1000    5      euler   0              random weights, demo,
                                                                                   tests (the default)
``self_forcing``   1000, 750, 500, 250               5      x0      0              Self-Forcing (DMD)
                   (= 1000, 937.5, 833.3, 625)
``longlive``       1000, 750, 500, 250               5      x0      0              LongLive (Self-Forcing
                                                                                   based, + its LoRA)
``causvid``        1000, 757, 522 (used as is)       1      x0      0              CausVid (DMD, Wan)
=================  ================================  =====  ======  =============  =====================

The distilled checkpoints run without classifier-free guidance (DMD distils the guided teacher):
their presets have ``guidance_scale=None``; a scale can still be given.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

#: Values of ``Sampler.update``.
UPDATES = ("euler", "x0")


def warp(s, shift: float) -> np.ndarray:
    """Wan's timestep shift: float64 ``shift s / (1 + (shift - 1) s)`` of noise levels ``s`` in
    ``[0, 1]`` (identity for ``shift = 1``)."""
    s = np.asarray(s, np.float64)
    return shift * s / (1.0 + (shift - 1.0) * s)


def schedule(num_steps: int, shift: float, timesteps: Sequence[float] | None = None) -> np.ndarray:
    """float32 ``[num_steps + 1]`` noise levels, decreasing, ending at 0: the warp of
    ``linspace(1, 0, num_steps + 1)`` or of ``timesteps / 1000`` then 0."""
    if timesteps is None:
        s = np.linspace(1.0, 0.0, num_steps + 1)
    else:
        s = np.append(np.asarray(timesteps, np.float64) / 1000.0, 0.0)
    return warp(s, shift).astype(np.float32)


def euler(velocity: Callable[[Array, Array], Array], noise: Array, sigmas: np.ndarray) -> Array:
    """Euler steps of ``dx/dsigma = velocity(x, sigma)`` from ``noise`` at ``sigmas[0]`` to
    ``sigmas[-1]`` (one traced step in a ``fori_loop``); the result has ``noise``'s dtype."""
    sig = jnp.asarray(sigmas)

    def step(i, x):
        return (x + (sig[i + 1] - sig[i]) * velocity(x, sig[i])).astype(x.dtype)

    return jax.lax.fori_loop(0, len(sigmas) - 1, step, noise)


def x0_steps(velocity: Callable[[Array, Array], Array], draws: Array, sigmas: np.ndarray) -> Array:
    """The x0-prediction update with fresh noise (see the module docstring).

    Args:
      velocity: ``(x [S, ...], sigma) -> v [S, ...]``.
      draws: ``[S, D, ...]`` noise draws, ``D >= len(sigmas) - 1``: ``draws[:, 0]`` the starting
        noise, ``draws[:, i]`` the fresh noise of step ``i`` (``1 <= i < len(sigmas) - 1``).
      sigmas: ``[num_steps + 1]`` levels ending at 0.

    Returns:
      The last step's ``x0`` ``[S, ...]`` in ``draws``' dtype (one traced step in a ``fori_loop``;
      the last step's re-noising multiplies by ``sigma' = 0``, so it returns ``x0`` exactly).
    """
    sig = jnp.asarray(sigmas)
    last = len(sigmas) - 2

    def step(i, x):
        x0 = x - sig[i] * velocity(x, sig[i])
        eps = jax.lax.dynamic_index_in_dim(draws, jnp.minimum(i + 1, max(last, 0)), axis=1, keepdims=False)
        return ((1.0 - sig[i + 1]) * x0 + sig[i + 1] * eps).astype(x.dtype)

    return jax.lax.fori_loop(0, len(sigmas) - 1, step, draws[:, 0])


def sample(velocity: Callable[[Array, Array], Array], draws: Array, sampler) -> Array:
    """The chunk's clean latents ``[S, ...]`` under ``sampler`` (a :class:`arkv_jax.rollout.Sampler`)
    from its noise ``draws`` ``[S, sampler.noise_draws, ...]`` (dtype of the result)."""
    sigmas = sampler.sigmas()
    if sampler.update == "euler":
        return euler(velocity, draws[:, 0], sigmas)
    return x0_steps(velocity, draws, sigmas)


def commit_input(latents: Array, draws: Array, sampler) -> tuple[Array, float]:
    """``(input, timestep)`` of the commit forward: the clean ``latents`` ``[S, ...]`` at 0, or with
    ``sampler.context_noise = t_c > 0`` the latents noised with the last draw to ``t_c / 1000``, at
    ``t_c``. ``draws`` as for :func:`sample`; the input has ``latents``' dtype."""
    t_c = float(sampler.context_noise)
    if t_c == 0.0:
        return latents, 0.0
    sigma = t_c / 1000.0
    return ((1.0 - sigma) * latents + sigma * draws[:, -1]).astype(latents.dtype), t_c


def session_noise(seed: int, chunk_index: int, shape: tuple[int, ...], draws: int) -> np.ndarray:
    """float32 ``[draws, *shape]``: a session's noise draws for one chunk (module docstring).
    Draw 0 is NumPy's PCG64 seeded ``(seed, chunk_index)`` (:func:`arkv_jax.rollout.chunk_noise`),
    draw ``j >= 1`` PCG64 seeded ``(seed, chunk_index, j)``: the same on every machine."""
    out = np.empty((draws, *shape), np.float32)
    for j in range(draws):
        key = (seed, chunk_index) if j == 0 else (seed, chunk_index, j)
        out[j] = np.random.default_rng(key).standard_normal(shape, np.float32)
    return out


def as_draws(noise: Array) -> Array:
    """``noise`` as ``[S, D, F, H, W, C]`` draws: a rank-5 ``[S, F, H, W, C]`` starting noise is one
    draw."""
    return noise if noise.ndim == 6 else noise[:, None]


__all__ = ["UPDATES", "as_draws", "commit_input", "euler", "sample", "schedule", "session_noise", "warp",
           "x0_steps"]
