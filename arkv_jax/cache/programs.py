"""The cache's jitted programs: each runs one step on every data shard of the sharded state at once.

Inputs are *shard-local* (:mod:`arkv_jax.cache.sessions`): ``rows`` is ``[data, B]`` with -1 for
padding, the state is a sharded state (leading ``[data]`` axis, :mod:`arkv_jax.sharding`), the pools
are ``[layers, data * pages_per_shard, ...]``. The state (and, in :func:`commit` and :func:`write`,
the pools) is donated. None of them communicates between devices.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import Mesh

from arkv_jax import sharding
from arkv_jax import state as core
from arkv_jax import step as step_lib
from arkv_jax.cache import batch
from arkv_jax.sharded_kernels import sharded_write_chunk
from arkv_jax.step import ChunkInputs
from pallas_kernels.layout import is_quantized_pool


def _flatten_shards(tree):
    """``[data, B, ...]`` leaves to ``[data * B, ...]`` (data-major, no data movement)."""
    return jax.tree_util.tree_map(lambda x: x.reshape(-1, *x.shape[2:]), tree)


@functools.partial(jax.jit, static_argnames=("num_frames", "mesh"))
def prepare(state, rows, *, num_frames: int, mesh: Mesh):
    """Every shard's :func:`arkv_jax.step.prepare_chunk`. Returns ``(pending, inputs, ok)``:
    ``inputs`` with ``[data * B, ...]`` leaves, ``ok`` ``[data, B]``."""
    prepare_chunk = sharding.per_shard(functools.partial(step_lib.prepare_chunk, num_frames=num_frames), mesh)
    pending, inputs, ok = prepare_chunk(state, rows)
    return pending, _flatten_shards(inputs), ok


@functools.partial(jax.jit, static_argnames=("num_frames", "backend", "mesh"), donate_argnums=(0, 1, 2))
def commit(k_pool, v_pool, pending, k_new, v_new, inputs: ChunkInputs, *, num_frames: int, backend: str,
           mesh: Mesh):
    """:func:`arkv_jax.step.commit_chunk` on every device's part (its pages and heads of the pools; each
    data shard's state, replicated over ``"model"``). Returns ``(k_pool, v_pool, state, ok)``."""
    def body(kp, vp, state, kn, vn, inp):
        state = jax.tree_util.tree_map(lambda x: x[0], state)
        kp, vp, state, ok = step_lib.commit_chunk(kp, vp, state, inp, kn, vn, num_frames=num_frames,
                                                  backend=backend)
        return kp, vp, jax.tree_util.tree_map(lambda x: x[None], state), ok[None]

    pools = sharding.pool_spec(is_quantized_pool(k_pool))
    rows = jax.tree_util.tree_map(lambda x: sharding.row_spec(x.ndim), inputs)
    chunk = sharding.chunk_spec()
    return sharding.shard_map(body, mesh, (pools, pools, sharding.state_spec(), chunk, chunk, rows),
                              (pools, pools, sharding.state_spec(), sharding.row_spec(2)), check=False)(
        k_pool, v_pool, pending, k_new, v_new, inputs)


@functools.partial(jax.jit, static_argnames="mesh", donate_argnums=0)
def begin(state, rows, *, mesh: Mesh):
    """Every shard's :func:`arkv_jax.state.begin`."""
    return sharding.per_shard(core.begin, mesh)(state, rows)


@functools.partial(jax.jit, static_argnames="mesh", donate_argnums=0)
def end(state, rows, *, mesh: Mesh):
    """Every shard's :func:`arkv_jax.state.end`."""
    return sharding.per_shard(core.end, mesh)(state, rows)


@functools.partial(jax.jit, static_argnames="mesh")
def resident_pages(state, rows, *, mesh: Mesh):
    """Every shard's :func:`arkv_jax.state.resident_pages`: ``([data, B, table_width], [data, B])``."""
    return sharding.per_shard(core.resident_pages, mesh)(state, rows)


@functools.partial(jax.jit, static_argnames=("tokens_per_frame", "backend", "mesh"), donate_argnums=(0, 1))
def write(k_pool, v_pool, k_new, v_new, write_pages, *, tokens_per_frame: int, backend: str, mesh: Mesh):
    """Writes K/V ``[L, data * B, F * T, Hkv, D]`` into the pages ``write_pages`` ``[data * B, F * ppf]``
    (shard-local ids) of every shard, in place (:func:`arkv_jax.sharded_kernels.sharded_write_chunk`);
    no state changes. Returns ``(k_pool, v_pool)``."""
    return sharded_write_chunk(mesh, k_pool, v_pool, k_new, v_new, write_pages, tokens_per_frame=tokens_per_frame,
                               backend=backend)


@functools.partial(jax.jit, static_argnames="mesh", donate_argnums=0)
def swap_pages(state, rows, replace, *, mesh: Mesh):
    """Every shard's :func:`arkv_jax.state.swap_pages` (``rows`` ``[data, B]``, ``replace``
    ``[data, B, table_width]``). Returns ``(state, ok [data])``."""
    return sharding.per_shard(core.swap_pages, mesh)(state, rows, replace)


@jax.jit
def shard_state(state, shard):
    """Shard ``shard``'s state of a sharded state (no leading axis)."""
    return jax.tree_util.tree_map(lambda x: x[shard], state)


#: :func:`arkv_jax.cache.batch.cross_attention_rows`, compiled once per shape and mesh.
cross_attention_rows = jax.jit(batch.cross_attention_rows, static_argnames="mesh")
