"""Multi-device layout: sessions split over a ``"data"`` mesh axis, K/V heads over ``"model"``.

Each data shard owns an independent slice of the pools (``pages_per_shard`` pages, its own null page
0), its own block-table state and free ring, and its rows of every per-row input; ``"model"`` splits
K/V and query heads, the state replicated over it. A *sharded state* is a
:class:`~arkv_jax.state.BlockTableState` with a leading ``[D]`` axis on every leaf, and
:func:`per_shard` runs any state function on every data shard at once under ``shard_map`` (rows and
page ids shard-local). The partition specs (:func:`pool_spec`, :func:`chunk_spec`, :func:`head_spec`,
:func:`row_spec`, :func:`state_spec`, :func:`cross_attention_spec`) are the contract: a chunk step built
from :func:`per_shard` and :mod:`arkv_jax.sharded_kernels` on inputs with these specs compiles without
any collective. The layout table, index maps and limits: ``docs/sharding.md``.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from arkv_jax.config import CacheGeometry, check_axis_sizes, check_divisible, divisors, require_int
from arkv_jax.state import BlockTableState, StateLayout, init_state
from pallas_kernels.layout import pool_shape, pool_spec_axes, pool_tree_spec, zero_pool

DATA = "data"
MODEL = "model"
AXES = (DATA, MODEL)

__all__ = [
    "AXES", "DATA", "MODEL", "auto_axes", "check_heads", "check_mesh", "chunk_spec", "cross_attention_spec",
    "from_host",
    "head_spec", "init_sharded_state", "make_mesh", "make_pools", "per_shard", "place", "pool_spec",
    "local_rows", "row_spec", "shard_map", "stack_states", "state_spec", "to_host", "unstack_state",
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
    check_axis_sizes(data, model)
    devices = list(jax.devices() if devices is None else devices)
    if data * model != len(devices):
        raise ValueError(
            f"mesh shape (data={data}, model={model}) needs data * model = {data * model} devices, "
            f"but {len(devices)} are given; allowed (data, model) for {len(devices)} devices: "
            f"{[(d, len(devices) // d) for d in divisors(len(devices))]} (pass devices= to use a "
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


def check_heads(mesh_model: int, *, kv_heads: int, q_heads: int | None = None) -> None:
    """Checks that K/V (and query) heads split evenly over a ``"model"`` axis of ``mesh_model``.

    Raises:
      ValueError: heads not divisible by ``mesh_model``.
    """
    check_divisible("kv_heads", kv_heads, MODEL, mesh_model)
    if q_heads is not None:
        check_divisible("num_q_heads", q_heads, MODEL, mesh_model)


# ------------------------------------------------------------------------------------------------
# Partition specs and placement.


def pool_spec(quantized: bool = False) -> Any:
    """Spec of a pool (:func:`pallas_kernels.layout.pool_shape`, ``[layers, kv_heads, pages,
    block_size, head_dim]``): pages on data, heads on model, i.e. ``P(None, "model", "data", None,
    None)``; for a quantized pool (``quantized``) a
    :class:`~pallas_kernels.layout.QuantizedPool` of that spec and its scales' ``P(None, "model",
    "data")`` (:func:`pallas_kernels.layout.pool_tree_spec`: a page's scale lives with the page)."""
    return pool_tree_spec(P(*pool_spec_axes(kv_head=MODEL, page=DATA)), quantized)


def chunk_spec() -> P:
    """Spec of the token-major ``[layers, rows, tokens, kv_heads, head_dim]`` chunk K/V to write:
    rows on data, heads on model."""
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


def local_rows(x: jax.Array) -> tuple[np.ndarray, np.ndarray]:
    """The rows (axis 0) of ``x`` that this process's devices hold, each once: ``(rows, values)``,
    ``rows`` the ascending global row indices, ``values`` their host copy ``[len(rows), ...]``.
    Nothing moves between processes; on one process every row."""
    blocks: dict[int, np.ndarray] = {}
    for shard in x.addressable_shards:
        start = shard.index[0].start or 0
        if start not in blocks:
            blocks[start] = np.asarray(shard.data)
    starts = sorted(blocks)
    rows = np.concatenate([np.arange(s, s + len(blocks[s])) for s in starts])
    return rows, np.concatenate([blocks[s] for s in starts])


def from_host(value: np.ndarray, target: NamedSharding | None) -> jax.Array:
    """``value``, a global host array, placed with ``target`` (``None``: the default device). Each
    process puts only the parts its devices hold (no check across processes, unlike
    ``jax.device_put``), so on several processes only those parts of ``value`` need to be right."""
    if target is None:
        return jax.device_put(value)
    return jax.make_array_from_callback(value.shape, target, lambda index: value[index])


def to_host(x: jax.Array) -> np.ndarray:
    """All of ``x`` on the host. On several processes, unless it is replicated, this gathers it
    from every process (a collective: every process must call it)."""
    if x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


# ------------------------------------------------------------------------------------------------
# Pools.


def make_pools(geometry: CacheGeometry, pages_per_shard: int, mesh: Mesh) -> tuple[Any, Any]:
    """Zero-filled K and V pools of :func:`pallas_kernels.layout.pool_shape` (``data *
    pages_per_shard`` pages) stored as ``geometry.page_dtype``, born sharded with
    :func:`pool_spec` (each device allocates only its part; distinct buffers, donatable). A
    quantized ``page_dtype`` gives :class:`~pallas_kernels.layout.QuantizedPool` s with zero scales.

    ``geometry.num_kv_heads`` is the global head count (before sharding). Page 0 of every data shard
    (global page ``s * pages_per_shard``) is that shard's null page.

    Raises:
      ValueError: a mesh without the axes, heads not divisible by ``model``, fewer than 2 pages.
    """
    data, model = check_mesh(mesh)
    check_heads(model, kv_heads=geometry.num_kv_heads)
    require_int("pages_per_shard (the null page and one more)", pages_per_shard, minimum=2)
    shape = pool_shape(geometry.num_layers, data * int(pages_per_shard), geometry.block_size,
                       geometry.num_kv_heads, geometry.head_dim)
    spec = pool_spec(geometry.quantized)
    sharding = jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), spec, is_leaf=lambda x: isinstance(x, P))
    zeros = jax.jit(lambda: (zero_pool(shape, geometry.page_dtype), zero_pool(shape, geometry.page_dtype)),
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
