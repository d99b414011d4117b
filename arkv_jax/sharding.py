"""Multi-device layout: sessions split over a ``"data"`` mesh axis, K/V heads over ``"model"``.

Mesh and what each axis splits:

==============  ======================================================================================
``"data"``      session rows and pool pages. Each data shard owns an independent slice of the pools
                (``pages_per_shard`` pages, its own null page 0), an independent block-table state
                (its own rows, its own free ring, page ids local to its slice) and its rows of every
                per-row input. No page, row or free list is shared between data shards, so the
                per-chunk step needs no communication at all.
``"model"``     K/V heads and query heads (tensor parallel attention). Block tables, lengths and the
                state are replicated over it; every model shard reads the same pages, for its heads.
==============  ======================================================================================

Layouts (``D`` = size of the data axis, ``M`` = size of the model axis):

======================  ==========================================  ===================================
pools                   ``[L, D * pages_per_shard, S, Hkv, hd]``    ``P(None, "data", None, "model", None)``
chunk K/V to write      ``[L, D * rows_per_shard, F * T, Hkv, hd]`` ``P(None, "data", None, "model", None)``
``q``, ``k_cur`` ...    ``[D * rows_per_shard, len, heads, hd]``    ``P("data", None, "model", None)``
page ids / tables       ``[D * rows_per_shard, n]``                 ``P("data", None)``
lengths                 ``[D * rows_per_shard]``                    ``P("data")``
sharded state leaves    ``[D, ...one shard's leaf...]``             ``P("data")`` (replicated on model)
cross-attention caches  ``[D * rows_per_shard, tokens, heads, hd]`` ``P("data", None, "model", None)``
======================  ==========================================  ===================================

A *sharded state* is a :class:`~arkv_jax.state.BlockTableState` whose every leaf has a new leading
axis of size ``D``: leaf ``[s]`` is shard ``s``'s ordinary state. :func:`per_shard` runs any state
function (``begin``, ``allocate``, ``commit``, ``visible_window`` ...) on every data shard at once
under ``shard_map``; inside, each shard sees one ordinary state. Row indices, page ids and lengths
are therefore *local*: row ``r`` of shard ``s`` is global row ``s * rows_per_shard + r`` of the
kernels' row axis, and page ``p`` of shard ``s`` is global page ``s * pages_per_shard + p`` of the
pools. Outputs of :func:`per_shard` keep the leading ``D`` axis; ``x.reshape(D * B, ...)`` turns a
``[D, B, ...]`` output into the kernels' row axis without moving data (both are split over ``"data"``).

The kernel wrappers (:func:`sharded_write_chunk`, :func:`sharded_window_attention`) run the
unsharded kernels unchanged on each device's block: no new math, so a sharded write is bit-identical
to the single-device write with global page ids, and attention matches to float rounding. GQA
survives head sharding because heads are split in contiguous blocks: model shard ``i`` holds query
heads ``[i * Hq / M, (i + 1) * Hq / M)`` and exactly the K/V heads they read.

Donation: the wrappers do not donate by themselves (like :func:`pallas_kernels.paged_write
.write_chunk`); call them inside a step jitted with ``donate_argnums`` on the pools and the outputs
alias the pools on every device (tested).

Meshes: :func:`make_mesh` builds a ``("data", "model")`` mesh with *Auto* axis types, so inputs that
are not yet placed are resharded by ``jit`` as needed. With a mesh of *Explicit* axes (the default of
``jax.make_mesh`` in newer JAX) ``shard_map`` requires every input to already carry the sharding of
its spec: place them with :func:`place` first. A mesh may have further axes; everything here is
replicated over them (untested).

Communication: none. A jitted chunk step built from :func:`per_shard` and the two wrappers compiles
without any collective (tested on a ``(2, 4)`` mesh: no all-gather, all-reduce, all-to-all,
collective-permute or reduce-scatter), as long as the inputs arrive with the specs above; what the
model does around attention (projections, the output all-reduce of tensor parallelism) is the
model's business.

Limits: K/V heads must be divisible by the model axis (no KV-head replication when
``kv_heads < model``, as tpu-inference does; refused with a clear error instead); rows and pool pages
must be divisible by the data axis. Tested only on CPU host devices (8 in one process).

"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from arkv_jax.config import CacheGeometry, CrossAttentionSpec, KVBranch, WindowPolicy
from arkv_jax.planner import MemoryPlan, format_bytes, plan_memory
from arkv_jax.state import BlockTableState, StateLayout, init_state
from pallas_kernels.paged_write import write_chunk
from pallas_kernels.window_attention import window_attention

DATA = "data"
MODEL = "model"
AXES = (DATA, MODEL)

__all__ = [
    "AXES", "DATA", "MODEL", "DevicePlan", "auto_axes", "check_mesh", "cross_attention_spec",
    "gather_rows", "head_spec", "init_sharded_state", "local_shapes", "make_mesh", "make_pools",
    "per_shard", "place", "plan_per_device", "pool_spec", "row_spec", "shard_map",
    "sharded_window_attention", "sharded_write_chunk", "stack_states", "state_spec",
    "unstack_state",
]


# ------------------------------------------------------------------------------------------------
# shard_map across JAX versions.


def _shard_map_impl():
    """``(shard_map function, name of its replication-check keyword)`` for this JAX."""
    fn = getattr(jax, "shard_map", None)
    if fn is None:  # JAX < 0.7
        from jax.experimental.shard_map import shard_map as fn  # type: ignore[no-redef]
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        params = {}
    check = "check_vma" if "check_vma" in params else "check_rep"
    return fn, check


def shard_map(f: Callable, mesh: Mesh, in_specs: Any, out_specs: Any, *, check: bool = True
              ) -> Callable:
    """``jax.shard_map`` (or ``jax.experimental.shard_map.shard_map`` on old JAX) with the
    replication check under whichever name this JAX uses (``check_vma``, formerly ``check_rep``).
    Pass ``check=False`` around Pallas calls."""
    fn, check_name = _shard_map_impl()
    return fn(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **{check_name: check})


# ------------------------------------------------------------------------------------------------
# Meshes and validation.


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_axis_sizes(data: int, model: int) -> None:
    for name, value in (("data", data), ("model", model)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"mesh axis {name!r} must be a positive int, got {value!r}")


def make_mesh(data: int, model: int, devices: Sequence[Any] | None = None) -> Mesh:
    """A ``("data", "model")`` mesh of ``data * model`` devices with Auto axis types.

    Uses ``jax.make_mesh`` (which orders devices by the physical topology on TPU) with
    ``axis_types=(Auto, Auto)`` where this JAX supports it, else ``jax.sharding.Mesh``.

    Args:
      data: size of the ``"data"`` axis (independent session groups).
      model: size of the ``"model"`` axis (head shards).
      devices: the devices to use, default ``jax.devices()`` (all devices of all processes).

    Raises:
      ValueError: a size is not a positive int, or ``data * model`` differs from the device count.
    """
    _check_axis_sizes(data, model)
    devices = list(jax.devices() if devices is None else devices)
    if data * model != len(devices):
        raise ValueError(
            f"mesh shape (data={data}, model={model}) needs data * model = {data * model} devices, "
            f"but {len(devices)} are given; allowed (data, model) for {len(devices)} devices: "
            f"{[(d, len(devices) // d) for d in _divisors(len(devices))]} (pass devices= to use a "
            "subset)")
    auto = getattr(jax.sharding, "AxisType", None)
    if auto is not None:
        try:
            return jax.make_mesh((data, model), AXES, axis_types=(auto.Auto, auto.Auto),
                                 devices=devices)
        except TypeError:  # pragma: no cover - a make_mesh without axis_types/devices
            pass
    return Mesh(np.array(devices, dtype=object).reshape(data, model), AXES)


def auto_axes(mesh: Mesh) -> Mesh:
    """``mesh`` itself if every axis is Auto (or this JAX has no axis types), else a mesh of the
    same devices in the same order and the same axis names with every axis Auto: what the cache
    facade runs on, so that its host-built inputs need no explicit placement."""
    axis_type = getattr(jax.sharding, "AxisType", None)
    types = getattr(mesh, "axis_types", None)
    if axis_type is None or types is None or all(t == axis_type.Auto for t in types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(axis_type.Auto,) * len(mesh.axis_names))


def check_mesh(mesh: Mesh) -> tuple[int, int]:
    """Checks that ``mesh`` has a ``"data"`` and a ``"model"`` axis; returns their sizes.

    Raises:
      ValueError: ``mesh`` is not a Mesh or lacks one of the axes.
    """
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh with axes {AXES}, got "
                         f"{type(mesh).__name__}")
    names = tuple(mesh.axis_names)
    missing = [a for a in AXES if a not in names]
    if missing:
        raise ValueError(f"mesh must have the axes {AXES} (build it with arkv_jax.sharding."
                         f"make_mesh); got axes {names}, missing {tuple(missing)}")
    return int(mesh.shape[DATA]), int(mesh.shape[MODEL])


def _check_divisible(what: str, value: int, axis: str, size: int) -> None:
    if value % size:
        raise ValueError(
            f"{what}={value} must be divisible by the mesh axis {axis!r} of size {size}; allowed "
            f"{axis!r} sizes for {what}={value}: {_divisors(value)}")


def _check_heads(mesh_model: int, *, kv_heads: int, q_heads: int | None = None) -> None:
    _check_divisible("kv_heads", kv_heads, MODEL, mesh_model)
    if q_heads is not None:
        _check_divisible("num_q_heads", q_heads, MODEL, mesh_model)


# ------------------------------------------------------------------------------------------------
# Partition specs and placement.


def pool_spec() -> P:
    """Spec of a ``[layers, pages, block_size, kv_heads, head_dim]`` pool (and of the
    ``[layers, rows, tokens, kv_heads, head_dim]`` chunk to write): pages (rows) on data, heads on
    model."""
    return P(None, DATA, None, MODEL, None)


def row_spec(ndim: int = 1) -> P:
    """Spec of a per-row array ``[rows, ...]`` without a head axis (page lists, lengths)."""
    return P(DATA, *([None] * (ndim - 1)))


def head_spec() -> P:
    """Spec of ``[rows, tokens, heads, head_dim]`` activations (``q``, ``k_cur``, ``extra_k``...)."""
    return P(DATA, None, MODEL, None)


def cross_attention_spec(ndim: int = 4, row_axis: int = 0, head_axis: int = -2) -> P:
    """Spec of a dense cross-attention cache: rows on data, heads on model.

    The default is ``[rows, tokens, heads, head_dim]``; for ``[layers, rows, tokens, heads,
    head_dim]`` pass ``ndim=5, row_axis=1``.
    """
    row_axis, head_axis = row_axis % ndim, head_axis % ndim
    if row_axis == head_axis:
        raise ValueError(f"row_axis and head_axis must differ, got {row_axis} and {head_axis}")
    spec = [None] * ndim
    spec[row_axis], spec[head_axis] = DATA, MODEL
    return P(*spec)


def state_spec(state: BlockTableState | None = None) -> Any:
    """Spec of a sharded state: every leaf's leading (shard) axis on data, replicated on model.

    Returns ``P("data")`` (a pytree prefix valid for any sharded state) when ``state`` is None,
    else a tree of full specs matching ``state``'s leaves.
    """
    if state is None:
        return P(DATA)
    return jax.tree_util.tree_map(lambda x: P(DATA, *([None] * (jnp.ndim(x) - 1))), state)


def place(mesh: Mesh, tree: Any, spec: Any) -> Any:
    """``jax.device_put`` of ``tree`` with ``NamedSharding(mesh, spec)`` (``spec`` a pytree prefix
    of ``tree``). Needed before the wrappers when ``mesh`` has Explicit axes; with the Auto meshes of
    :func:`make_mesh` it only saves a reshard inside the step. Single-process only: on several
    hosts build global arrays with ``jax.make_array_from_process_local_data``."""
    shardings = jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), spec,
                                       is_leaf=lambda x: isinstance(x, P))
    return jax.device_put(tree, shardings)


# ------------------------------------------------------------------------------------------------
# Pools.


def make_pools(geometry: CacheGeometry, pages_per_shard: int, mesh: Mesh
               ) -> tuple[jax.Array, jax.Array]:
    """Zero-filled K and V pools ``[L, data * pages_per_shard, S, Hkv, hd]``, born sharded with
    :func:`pool_spec` (each device allocates only its block; two distinct buffers, donatable).

    ``geometry.num_kv_heads`` is the global head count (before sharding). Page 0 of every data shard
    (global page ``s * pages_per_shard``) is that shard's null page.

    Raises:
      ValueError: a mesh without the axes, heads not divisible by ``model``, fewer than 2 pages.
    """
    data, model = check_mesh(mesh)
    _check_heads(model, kv_heads=geometry.num_kv_heads)
    if isinstance(pages_per_shard, bool) or not isinstance(pages_per_shard, (int, np.integer)) \
            or pages_per_shard < 2:
        raise ValueError(f"pages_per_shard must be an int >= 2 (the null page and one more), got "
                         f"{pages_per_shard!r}")
    shape = (geometry.num_layers, data * int(pages_per_shard), geometry.block_size,
             geometry.num_kv_heads, geometry.head_dim)
    sharding = NamedSharding(mesh, pool_spec())
    zeros = jax.jit(lambda: (jnp.zeros(shape, geometry.dtype), jnp.zeros(shape, geometry.dtype)),
                    out_shardings=(sharding, sharding))
    return zeros()


# ------------------------------------------------------------------------------------------------
# Sharded block-table state.


def init_sharded_state(layout: StateLayout, rows_per_shard: int, mesh: Mesh) -> BlockTableState:
    """``data`` fresh states (``init_state(layout, rows_per_shard)`` each) stacked on a leading
    axis, placed with :func:`state_spec` (shard ``s`` on data index ``s``, replicated on model).

    ``layout.num_blocks`` is the managed pages *per shard* (null page included): page ids are local
    to the shard's pool slice.
    """
    data, _ = check_mesh(mesh)
    template = init_state(layout, rows_per_shard)  # validates rows_per_shard
    sharding = NamedSharding(mesh, P(DATA))
    build = jax.jit(
        lambda: jax.tree_util.tree_map(
            lambda x: jnp.broadcast_to(x, (data,) + x.shape),
            init_state(layout, rows_per_shard)),
        out_shardings=jax.tree_util.tree_map(lambda _: sharding, template))
    return build()


def stack_states(states: Sequence[BlockTableState]) -> BlockTableState:
    """Stacks per-shard states (same layout and rows) into one sharded state (not placed; use
    :func:`place` with :func:`state_spec`)."""
    states = list(states)
    if not states:
        raise ValueError("stack_states needs at least one state")
    layouts = {s.layout for s in states}
    if len(layouts) != 1:
        raise ValueError(f"every shard's state must have the same layout, got {len(layouts)} layouts")
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *states)


def unstack_state(sharded: BlockTableState, shard: int) -> BlockTableState:
    """Shard ``shard``'s ordinary state out of a sharded state."""
    num = sharded.tables.shape[0]
    if not 0 <= shard < num:
        raise ValueError(f"shard={shard} is out of range; allowed [0, {num})")
    return jax.tree_util.tree_map(lambda x: x[shard], sharded)


def _is_static_scalar(x: Any) -> bool:
    return isinstance(x, (bool, int, float, np.integer, np.floating))


def per_shard(fn: Callable[..., Any], mesh: Mesh, *, check: bool = True) -> Callable[..., Any]:
    """Wraps a state function so that it runs on every data shard of a sharded state at once.

    ``per_shard(fn, mesh)(sharded_state, *args)`` calls ``fn(state_s, *args_s)`` on shard ``s``,
    where ``state_s`` is the shard's ordinary :class:`BlockTableState` and every array argument
    carries a leading ``[data]`` axis (its ``[s]`` slice goes to shard ``s``; e.g. rows ``[data, B]``
    of *local* row indices), except 0-d arrays, which go to every shard as they are. Python
    scalars (``int``/``float``/``bool``) also go to every shard unchanged; under ``jax.jit`` an
    argument the function needs static (``slot_mapping``'s ``num_tokens``, ``write_pages``'
    ``num_frames``) must be one of the jit's ``static_argnums``. Every output leaf gains the leading
    ``[data]`` axis, sharded over data, replicated over model. ``check`` is shard_map's replication
    check (``check_vma``/``check_rep``); the state functions pass it.

    Example::

        rows = jnp.tile(jnp.arange(4, dtype=jnp.int32), (data, 1))   # local rows 0..3 per shard
        state, ok = jax.jit(per_shard(allocate, mesh))(state, rows, 16)  # ok: [data, 4]

    Raises:
      ValueError: (when called) a mesh without the axes, or an array argument or state leaf whose
        leading axis is not the mesh's data size.
    """
    data, _ = check_mesh(mesh)

    @functools.wraps(fn)
    def run(state: BlockTableState, *args):
        static = [_is_static_scalar(a) for a in args]
        arrays = [a for a, st in zip(args, static) if not st]
        for name, leaf in [("state", l) for l in jax.tree_util.tree_leaves(state)] + [
                (f"argument {i + 1}", l) for i, a in enumerate(args) if not static[i]
                for l in jax.tree_util.tree_leaves(a)]:
            if jnp.ndim(leaf) >= 1 and jnp.shape(leaf)[0] != data or (
                    name == "state" and jnp.ndim(leaf) == 0):
                raise ValueError(
                    f"per_shard: every leaf of {name} needs a leading shard axis of the mesh's data "
                    f"size {data}, got shape {tuple(jnp.shape(leaf))} (scalars are passed to "
                    "every shard as they are)")
        specs = jax.tree_util.tree_map(lambda x: P(DATA) if jnp.ndim(x) else P(), tuple(arrays))

        def body(state_blk, *array_blks):
            def squeeze(tree):
                return jax.tree_util.tree_map(lambda x: x[0] if jnp.ndim(x) else x, tree)

            blocks = iter(array_blks)
            full = [a if st else squeeze(next(blocks)) for a, st in zip(args, static)]
            out = fn(squeeze(state_blk), *full)
            return jax.tree_util.tree_map(lambda x: jnp.expand_dims(x, 0), out)

        return shard_map(body, mesh, (P(DATA),) + specs, P(DATA), check=check)(state, *arrays)

    return run


# ------------------------------------------------------------------------------------------------
# Kernel wrappers.


def sharded_write_chunk(mesh: Mesh, k_pool: jax.Array, v_pool: jax.Array, k_new: jax.Array,
                        v_new: jax.Array, page_ids: jax.Array, *,
                        tokens_per_frame: int | None = None, backend: str = "auto"
                        ) -> tuple[jax.Array, jax.Array]:
    """:func:`pallas_kernels.paged_write.write_chunk` on every device's block of the pools.

    Args:
      mesh: a mesh with ``"data"`` and ``"model"`` axes.
      k_pool, v_pool: ``[L, data * pages_per_shard, S, Hkv, hd]`` (spec :func:`pool_spec`).
      k_new, v_new: ``[L, data * rows_per_shard, F * T, Hkv, hd]`` (spec :func:`pool_spec`).
      page_ids: int ``[data * rows_per_shard, F * ppf]``, *local* page ids of each row's shard
        (spec ``P("data", None)``); 0 or outside ``[1, pages_per_shard)`` skips (always: the
        kernel runs traced, so concrete ids are not value-checked here).
      tokens_per_frame, backend: as for ``write_chunk``.

    Returns:
      ``(k_pool, v_pool)``, sharded like the inputs. Jit the caller with ``donate_argnums`` on the
      pools to update them in place.

    Raises:
      ValueError: a mesh without the axes; heads, rows or pages not divisible by the axis sizes;
        shapes that ``write_chunk`` rejects (checked per shard).
    """
    data, model = check_mesh(mesh)
    for name, x, rank in (("k_pool", k_pool, 5), ("v_pool", v_pool, 5), ("k_new", k_new, 5),
                          ("v_new", v_new, 5), ("page_ids", page_ids, 2)):
        if jnp.ndim(x) != rank:
            raise ValueError(f"{name} must have rank {rank}, got shape {tuple(jnp.shape(x))}")
    _check_heads(model, kv_heads=k_pool.shape[3])
    _check_divisible("pool pages (k_pool.shape[1])", k_pool.shape[1], DATA, data)
    _check_divisible("rows (k_new.shape[1])", k_new.shape[1], DATA, data)
    _check_divisible("rows (page_ids.shape[0])", page_ids.shape[0], DATA, data)
    return _sharded_write_jit(k_pool, v_pool, k_new, v_new, page_ids, mesh=mesh,
                              tokens_per_frame=tokens_per_frame, backend=backend)


@functools.partial(jax.jit, static_argnames=("mesh", "tokens_per_frame", "backend"))
def _sharded_write_jit(k_pool, v_pool, k_new, v_new, page_ids, *, mesh, tokens_per_frame, backend):
    def body(kp, vp, kn, vn, ids):
        return write_chunk(kp, vp, kn, vn, ids, tokens_per_frame=tokens_per_frame, backend=backend)

    pools = pool_spec()
    return shard_map(body, mesh, (pools, pools, pools, pools, row_spec(2)), (pools, pools),
                     check=False)(k_pool, v_pool, k_new, v_new, page_ids)


def sharded_window_attention(mesh: Mesh, q: jax.Array, k_cur: jax.Array, v_cur: jax.Array,
                             k_pool: jax.Array, v_pool: jax.Array, pages: jax.Array,
                             lengths: jax.Array, *, layer: Any = 0, extra_k: jax.Array | None = None,
                             extra_v: jax.Array | None = None, scale: float | None = None,
                             tokens_per_frame: int | None = None, backend: str = "auto",
                             block_q: int | None = None, block_k: int | None = None) -> jax.Array:
    """:func:`pallas_kernels.window_attention.window_attention` on every device's block.

    Rows (``q``, ``k_cur``, ``v_cur``, extras, ``pages``, ``lengths``) and pool pages are split over
    data, query and K/V heads over model; ``pages`` holds *local* page ids of each row's shard and
    is replicated over model, as are ``lengths``. ``layer`` may be traced (replicated). The other
    keywords are ``window_attention``'s (``block_q``/``block_k``: Pallas tiles).

    Returns:
      ``[rows, q_len, num_q_heads, head_dim]`` sharded as ``q`` (``P("data", None, "model", None)``).

    Raises:
      ValueError: a mesh without the axes; query or K/V heads not divisible by ``model``; rows or
        pool pages not divisible by ``data``; shapes ``window_attention`` rejects (per shard).
    """
    data, model = check_mesh(mesh)
    for name, x, rank in (("q", q, 4), ("k_cur", k_cur, 4), ("v_cur", v_cur, 4),
                          ("k_pool", k_pool, 5), ("v_pool", v_pool, 5), ("pages", pages, 2),
                          ("lengths", lengths, 1)):
        if jnp.ndim(x) != rank:
            raise ValueError(f"{name} must have rank {rank}, got shape {tuple(jnp.shape(x))}")
    _check_heads(model, kv_heads=k_cur.shape[2], q_heads=q.shape[2])
    _check_divisible("kv_heads (k_pool.shape[3])", k_pool.shape[3], MODEL, model)
    _check_divisible("rows (q.shape[0])", q.shape[0], DATA, data)
    _check_divisible("pool pages (k_pool.shape[1])", k_pool.shape[1], DATA, data)
    if (extra_k is None) != (extra_v is None):
        raise ValueError("extra_k and extra_v must be given together (both or neither)")
    if scale is None:
        scale = float(q.shape[-1]) ** -0.5  # the kernel's default, fixed before sharding
    return _sharded_attention_jit(q, k_cur, v_cur, k_pool, v_pool, pages, lengths,
                                  jnp.asarray(layer, jnp.int32), extra_k, extra_v, mesh=mesh,
                                  scale=scale, tokens_per_frame=tokens_per_frame, backend=backend,
                                  block_q=block_q, block_k=block_k)


@functools.partial(jax.jit, static_argnames=("mesh", "scale", "tokens_per_frame", "backend",
                                             "block_q", "block_k"))
def _sharded_attention_jit(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, layer, extra_k, extra_v,
                           *, mesh, scale, tokens_per_frame, backend, block_q, block_k):
    has_extra = extra_k is not None

    def body(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, layer, *extra):
        ek, ev = extra if has_extra else (None, None)
        return window_attention(q, k_cur, v_cur, k_pool, v_pool, pages, lengths, layer=layer,
                                extra_k=ek, extra_v=ev, scale=scale,
                                tokens_per_frame=tokens_per_frame, backend=backend,
                                block_q=block_q, block_k=block_k)

    heads, pools = head_spec(), pool_spec()
    in_specs = (heads, heads, heads, pools, pools, row_spec(2), row_spec(1), P())
    args = (q, k_cur, v_cur, k_pool, v_pool, pages, lengths, layer)
    if has_extra:
        in_specs += (heads, heads)
        args += (extra_k, extra_v)
    return shard_map(body, mesh, in_specs, heads, check=False)(*args)


def gather_rows(mesh: Mesh, table: jax.Array, rows: jax.Array, *, head_axis: int = 3) -> jax.Array:
    """``table[rows]`` within every data shard: the per-row caches (e.g. cross-attention K/V) of a
    batch, without moving rows between devices.

    Args:
      mesh: a mesh with ``"data"`` and ``"model"`` axes.
      table: ``[data * rows_per_shard, ...]``, rows split over data and axis ``head_axis`` over
        model (:func:`cross_attention_spec`).
      rows: int ``[data * B]`` *local* row indices of each shard's batch rows; negative = padding.

    Returns:
      ``[data * B, ...]`` sharded like ``table``; padding rows are zero.
    """
    spec = cross_attention_spec(jnp.ndim(table), 0, head_axis)

    def body(block, local_rows):
        taken = jnp.take(block, jnp.maximum(local_rows, 0), axis=0)
        valid = (local_rows >= 0).reshape((-1,) + (1,) * (block.ndim - 1))
        return jnp.where(valid, taken, jnp.zeros((), block.dtype))

    return shard_map(body, mesh, (spec, row_spec(1)), spec)(table, rows)


# ------------------------------------------------------------------------------------------------
# Planner per device.


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    """The memory plan of one device of a ``(data, model)`` mesh, and what it adds up to.

    Attributes:
      plan: the :class:`~arkv_jax.planner.MemoryPlan` of one device: its geometry has
        ``num_kv_heads // model`` heads (cross-attention heads divided too); its pages are the
        pages of one data shard (every device of a data shard holds all of them, for its heads).
      data, model: mesh axis sizes.
      pool_bytes_per_device: K+V pool bytes one device holds (``plan.pool_bytes``).
      bytes_per_device: everything reserved on one device: pools + cross-attention caches +
        model-owned state of its sessions.
      pages_per_shard: pool pages per data shard, null page included (``plan.num_blocks_total``):
        the ``pages_per_shard`` of :func:`make_pools`.
      sessions_per_data_shard: resident sessions one data shard holds (``plan.session_capacity``).
      total_sessions: ``sessions_per_data_shard * data``.
      rows_per_shard: state rows per data shard (sessions x logical KV branches).
    """

    plan: MemoryPlan
    data: int
    model: int
    pool_bytes_per_device: int
    bytes_per_device: int
    pages_per_shard: int
    sessions_per_data_shard: int
    total_sessions: int
    rows_per_shard: int

    @classmethod
    def from_plan(cls, plan: MemoryPlan, data: int, model: int) -> "DevicePlan":
        """The mesh-wide view of ``plan``, the plan of one device (heads already divided by
        ``model``), when every one of the ``data`` shards holds the same plan.

        Raises:
          ValueError: ``data`` or ``model`` is not a positive int.
        """
        _check_axis_sizes(data, model)
        return cls(
            plan=plan, data=int(data), model=int(model), pool_bytes_per_device=plan.pool_bytes,
            bytes_per_device=(plan.pool_bytes + plan.cross_attention_reserved_bytes
                              + plan.model_owned_state_reserved_bytes),
            pages_per_shard=plan.num_blocks_total, sessions_per_data_shard=plan.session_capacity,
            total_sessions=plan.session_capacity * int(data),
            rows_per_shard=plan.session_capacity * len(plan.kv_branches))

    @property
    def num_devices(self) -> int:
        return self.data * self.model

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "plan"}
        out["plan"] = self.plan.to_dict()
        return out

    def to_json(self) -> str:
        """:meth:`to_dict` as one JSON object."""
        return json.dumps(self.to_dict(), sort_keys=True)

    def summary(self) -> str:
        """The mesh-wide figures, then one device's :meth:`MemoryPlan.summary`."""
        return "\n".join([
            f"mesh: data={self.data} x model={self.model} ({self.num_devices} devices); the plan below "
            f"is one device's (K/V heads / {self.model})",
            f"  per device: pools {format_bytes(self.pool_bytes_per_device)}, everything reserved "
            f"{format_bytes(self.bytes_per_device)}",
            f"  sessions: {self.sessions_per_data_shard} per data shard x {self.data} = {self.total_sessions}; "
            f"{self.pages_per_shard} pages per data shard",
            self.plan.summary()])


def local_shapes(geometry: CacheGeometry, cross_attention: Sequence[CrossAttentionSpec], model: int
                 ) -> tuple[CacheGeometry, tuple[CrossAttentionSpec, ...]]:
    """What one device of a model axis of size ``model`` holds: ``geometry`` and each
    cross-attention cache with their K/V heads divided by ``model``.

    Raises:
      ValueError: K/V or cross-attention heads not divisible by ``model``.
    """
    _check_heads(model, kv_heads=geometry.num_kv_heads)
    local_cross = []
    for spec in cross_attention:
        if spec.num_kv_heads is not None:
            _check_divisible(f"cross-attention {spec.name!r} num_kv_heads", spec.num_kv_heads,
                             MODEL, model)
            spec = dataclasses.replace(spec, num_kv_heads=spec.num_kv_heads // model)
        local_cross.append(spec)
    return dataclasses.replace(geometry, num_kv_heads=geometry.num_kv_heads // model), tuple(local_cross)


def plan_per_device(
    geometry: CacheGeometry,
    window: WindowPolicy,
    branches: Sequence[KVBranch] = (KVBranch("main"),),
    *,
    data: int,
    model: int,
    available_bytes_per_device: int,
    memory_fraction: float = 0.1,
    sessions_per_shard: int = 1,
    cross_attention: Sequence[CrossAttentionSpec] = (),
    max_scratch_tokens_per_branch: int = 0,
    model_owned_state_bytes_per_session: int = 0,
    scratch_blocks_override: int | None = None,
    batched_in_flight: bool = False,
) -> DevicePlan:
    """Plans one device of a ``(data, model)`` mesh with the single-device planner.

    The pools of one data shard are split over ``model`` devices by heads, so one device plans with
    ``geometry.num_kv_heads // model`` heads (and each cross-attention cache's heads ``// model``)
    and its own ``available_bytes_per_device``. Every data shard holds the same plan, so the mesh
    holds ``sessions_per_data_shard * data`` sessions.

    Args:
      geometry: the model's global geometry (all K/V heads).
      window, branches, memory_fraction, cross_attention, max_scratch_tokens_per_branch,
        scratch_blocks_override, batched_in_flight: as for :func:`arkv_jax.planner.plan_memory`.
      data, model: mesh axis sizes.
      available_bytes_per_device: free memory of one device (the smallest, if they differ).
      sessions_per_shard: resident sessions requested per data shard.
      model_owned_state_bytes_per_session: model state per session *on one device*.

    Raises:
      ValueError: bad axis sizes, K/V or cross-attention heads not divisible by ``model``, or an
        input ``plan_memory`` rejects.
    """
    _check_axis_sizes(data, model)
    local, local_cross = local_shapes(geometry, cross_attention, model)
    plan = plan_memory(
        local, window, branches, available_bytes=available_bytes_per_device,
        memory_fraction=memory_fraction, session_capacity=sessions_per_shard,
        cross_attention=local_cross, max_scratch_tokens_per_branch=max_scratch_tokens_per_branch,
        model_owned_state_bytes_per_session=model_owned_state_bytes_per_session,
        scratch_blocks_override=scratch_blocks_override, batched_in_flight=batched_in_flight)
    return DevicePlan.from_plan(plan, data, model)
