"""The few-step samplers of the Wan 2.1 family: :class:`Sampler`, its presets and its math.

:class:`Sampler` holds a sampler's settings (presets :meth:`Sampler.euler`, :meth:`Sampler.self_forcing`,
:meth:`Sampler.longlive`, :meth:`Sampler.causvid`; by name in :data:`SAMPLERS`). The functions here are
the math that both the paged rollout (:func:`arkv_jax.rollout.generate_chunk`) and the exactness
reference (:class:`arkv_jax.reference.FullRecompute`) run, so the two cannot drift apart: the shifted
schedule (:func:`schedule`), the Euler and x0 updates (:func:`sample`), the commit forward's input
(:func:`commit_input`), the per-session noise draws (:func:`session_noise`) and the CFG combination
of a session's branch outputs (:func:`combine_branches`). The formulas and the table of which
checkpoint uses which preset: ``docs/rollout.md``, "Samplers".
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from arkv_jax.config import require_positive, require_real

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
    """The x0-prediction update with fresh noise (``docs/rollout.md``, "Samplers").

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
    """The chunk's clean latents ``[S, ...]`` under ``sampler`` (a :class:`Sampler`)
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
    """float32 ``[draws, *shape]``: a session's noise draws for one chunk (``docs/rollout.md``, "Samplers").
    Draw 0 is NumPy's PCG64 seeded ``(seed, chunk_index)`` (:func:`chunk_noise`),
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


@dataclasses.dataclass(frozen=True)
class Sampler:
    """Few-step flow-matching sampler (the math: this module; which checkpoint uses which preset:
    ``docs/rollout.md``, "Samplers").

    Presets: :meth:`euler` (the default ``Sampler()``: deterministic Euler, random weights and the
    demo), :meth:`self_forcing`, :meth:`longlive`, :meth:`causvid`; by name in :data:`SAMPLERS`.

    Attributes:
      num_steps: denoise forwards per chunk (then one commit forward).
      shift: Wan's timestep shift warp ``sigma' = shift s / (1 + (shift - 1) s)``, applied to ``s``
        evenly spaced from 1 to 0, or to ``timesteps / 1000`` (1: the list is used as is).
      guidance_scale: classifier-free guidance scale, or ``None`` for no CFG (one KV branch).
      timesteps: explicit denoising timesteps in ``(0, 1000]``, strictly decreasing, one per step
        (``len == num_steps``), warped with ``shift``; ``None``: evenly spaced.
      update: ``"euler"`` (deterministic Euler steps) or ``"x0"`` (x0 prediction ``x - sigma v``,
        re-noised to the next level with fresh per-session, per-step noise).
      context_noise: timestep in ``[0, 1000)`` of the commit forward; above 0 it runs on the clean
        latents noised to ``context_noise / 1000`` with a fresh draw (Self-Forcing's
        ``context_noise``); 0: clean latents at ``t = 0``.
    """

    num_steps: int = 3
    shift: float = 5.0
    guidance_scale: float | None = None
    timesteps: tuple[float, ...] | None = None
    update: str = "euler"
    context_noise: float = 0.0

    def __post_init__(self):
        require_positive("num_steps", self.num_steps)
        require_real("shift", self.shift, low=0.0, low_open=True)
        if self.guidance_scale is not None:
            require_real("guidance_scale", self.guidance_scale)
        if self.timesteps is not None:
            ts = tuple(require_real("timesteps", t) for t in self.timesteps)
            if len(ts) != self.num_steps:
                raise ValueError(f"timesteps has {len(ts)} entries for num_steps={self.num_steps}: {ts}")
            if not all(0 < t <= 1000 for t in ts) or any(a <= b for a, b in zip(ts, ts[1:])):
                raise ValueError(f"timesteps must be strictly decreasing in (0, 1000], got {ts}")
            object.__setattr__(self, "timesteps", ts)
        if self.update not in UPDATES:
            raise ValueError(f"update must be one of {UPDATES}, got {self.update!r}")
        require_real("context_noise", self.context_noise, low=0.0)
        if not self.context_noise < 1000.0:
            raise ValueError(f"context_noise must be a timestep in [0, 1000), got {self.context_noise!r}")

    @property
    def num_branches(self) -> int:
        """KV branches per session: 2 with CFG, else 1."""
        return 1 if self.guidance_scale is None else 2

    @property
    def noise_draws(self) -> int:
        """Standard-normal draws of the chunk's shape each session needs per chunk: the starting
        noise, ``num_steps - 1`` fresh ones for ``"x0"``, one for ``context_noise``."""
        return 1 + (self.num_steps - 1 if self.update == "x0" else 0) + (self.context_noise > 0)

    def sigmas(self) -> np.ndarray:
        """float32 ``[num_steps + 1]`` noise levels, decreasing to 0 (model timestep = 1000 sigma)."""
        return schedule(self.num_steps, self.shift, self.timesteps)

    # -- presets (see the table in :mod:`arkv_jax.samplers`) ----------------------------------------
    @classmethod
    def euler(cls, num_steps: int = 3, shift: float = 5.0, guidance_scale: float | None = None) -> "Sampler":
        """Deterministic Euler on Wan's shifted even schedule: ``Sampler()`` (random weights, demo)."""
        return cls(num_steps, shift, guidance_scale)

    @classmethod
    def self_forcing(cls, guidance_scale: float | None = None, context_noise: float = 0.0) -> "Sampler":
        """Self-Forcing's DMD checkpoints: timesteps ``[1000, 750, 500, 250]`` warped with shift 5
        (1000, 937.5, 833.3, 625), x0 update with fresh noise, no CFG."""
        return cls(4, 5.0, guidance_scale, (1000.0, 750.0, 500.0, 250.0), "x0", context_noise)

    @classmethod
    def longlive(cls, guidance_scale: float | None = None, context_noise: float = 0.0) -> "Sampler":
        """LongLive (built on Self-Forcing): the same 4-step warped schedule and x0 update."""
        return cls.self_forcing(guidance_scale, context_noise)

    @classmethod
    def causvid(cls, guidance_scale: float | None = None, context_noise: float = 0.0) -> "Sampler":
        """CausVid's DMD Wan checkpoint: timesteps ``[1000, 757, 522]`` used as is (shift 1), x0
        update with fresh noise, no CFG."""
        return cls(3, 1.0, guidance_scale, (1000.0, 757.0, 522.0), "x0", context_noise)


#: Sampler presets by name (factories: ``SAMPLERS["self_forcing"]()``).
SAMPLERS: dict[str, Callable[..., Sampler]] = {
    "euler": Sampler.euler, "self_forcing": Sampler.self_forcing, "longlive": Sampler.longlive,
    "causvid": Sampler.causvid,
}


def chunk_noise(seed: int, chunk_index: int, shape: tuple[int, ...]) -> np.ndarray:
    """float32 ``shape`` standard normal starting noise of chunk ``chunk_index`` of the session
    seeded ``seed``: NumPy's PCG64 seeded with ``(seed, chunk_index)``, so it is the same on every
    machine and whichever sessions share a batch. Drawn on the host: a few hundred KB per session
    and chunk at Wan's shape, and no random-number program to compile (threefry costs seconds of
    XLA:CPU compile time)."""
    return np.random.default_rng((seed, chunk_index)).standard_normal(shape, np.float32)


def combine_branches(out: Array, num_branches: int, guidance: float | None) -> Array:
    """Per-session velocity from the rows' outputs ``[S * num_branches, ...]`` (session-major):
    the only branch, or ``neg + guidance (pos - neg)``."""
    out = out.reshape(-1, num_branches, *out.shape[1:])
    if num_branches == 1:
        return out[:, 0]
    return out[:, 1] + guidance * (out[:, 0] - out[:, 1])


__all__ = ["SAMPLERS", "UPDATES", "Sampler", "as_draws", "chunk_noise", "combine_branches", "commit_input", "euler",
           "sample", "schedule", "session_noise", "warp", "x0_steps"]
