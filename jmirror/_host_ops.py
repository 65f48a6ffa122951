"""The cross-replica operations on the host: placing and reading concrete values.

Mirrored values are laid out with the topology's mirrored sharding (one full copy per device),
per-replica and sync-on-read values with its stacked sharding (slice i on device i). Reading a
mirrored leaf takes the copy on `devices[0]` (no gather); reducing or gathering per-replica
values moves their components to `devices[0]` and combines them there with one compiled
function.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from jmirror import _shard_jaxpr
from jmirror._adapter import map_traced, map_traced_leaves, static_leaves
from jmirror._components import replica_component, replica_copy
from jmirror._cross_replica import REDUCERS, REPLICA_REDUCERS, CrossReplica
from jmirror._mirrored_state import UPDATE
from jmirror._placement import split_error
from jmirror._topology import Topology, declared_leaves
from jmirror._values import (
    Aggregation,
    PerReplica,
    PyTree,
    ReduceOp,
    Sharded,
    SyncOnRead,
    ValueContext,
    is_distributed,
)

_REDUCED = {Aggregation.SUM: ReduceOp.SUM, Aggregation.MEAN: ReduceOp.MEAN}
_MIRROR_TRACED = (
    "strategy.mirror got a traced value at {path}: it was called inside jax.jit (or "
    "another JAX transformation), where values have no devices yet. strategy.mirror places "
    "concrete values on the strategy's devices and runs outside transformations: call it on "
    "the result, strategy.mirror(jax.jit(init)(...)); inside a replicated function, jm.sync "
    "makes a value mirrored."
)
_MIRROR_PMAP_LAYOUT = (
    "strategy.mirror got a jax.Array of shape {shape} at {path}{others} laid out the jax.pmap "
    "way (its leading axis of {n} split over the strategy's {n} devices, as "
    "flax.jax_utils.replicate and prefetch_to_device return it): mirroring keeps that axis, "
    "so every replica holds all {n} slices. If it is replicated state, mirror the one copy: "
    "strategy.mirror(jax_utils.unreplicate(x)); if it is a per-replica batch, pass it to the "
    "replicated function as jm.PerReplica(x) instead of mirroring it."
)


class HostOps(CrossReplica):
    """`CrossReplica` on the host, for the replicas of `topology`.

    `run` runs a replica function on the strategy (for `update`).
    """

    where = ""

    def __init__(self, topology: Topology, run: Callable[..., Any]):
        self.topology = topology
        self.num_replicas = topology.num_replicas
        self._run = run

    # --- placing -------------------------------------------------------------------------------

    def mirror(self, tree: PyTree) -> PyTree:
        treedef = jax.tree_util.tree_structure(tree, is_leaf=is_distributed)
        declared = declared_leaves(tree, is_leaf=is_distributed)
        leaves = [(path, leaf) for path, leaf, _ in declared]
        likes = [(path, like) for path, _, like in declared]
        out: list[Any] = [None] * len(leaves)
        todo = []
        static = static_leaves(tree, is_leaf=is_distributed)
        for i, (path, leaf) in enumerate(leaves):
            if static[i]:  # a function, a flag, an equinox module's number: kept as it is
                out[i] = leaf
                continue
            if isinstance(leaf, PerReplica):
                raise TypeError(
                    f"strategy.mirror got a PerReplica at path {jax.tree_util.keystr(path)!r}; "
                    "per-replica values cannot be mirrored as they are. Reduce them first "
                    "(strategy.reduce) or pick one (strategy.local_results)."
                )
            if isinstance(leaf, jax.core.Tracer):
                where = jax.tree_util.keystr(path)
                raise TypeError(
                    _MIRROR_TRACED.format(path=repr(where) if where else "the top level")
                )
            # SyncOnRead state is already placed; exactly-mirrored arrays are kept (one
            # sharding for mirrored state, so a step's outputs match its inputs' signature).
            if isinstance(leaf, (SyncOnRead, Sharded)) or (
                isinstance(leaf, jax.Array)
                and leaf.sharding == self.topology.leaf_sharding(*likes[i])
            ):
                out[i] = leaf
            else:
                todo.append(i)
        self._warn_pmap_layout([leaves[i] for i in todo])
        if todo:
            sources = [leaves[i][1] for i in todo]
            # Mirrored, laid out inside the replicas by `Topology.layout_spec` (k > 1).
            layouts = [self.topology.leaf_sharding(*likes[i]) for i in todo]
            for i, x in zip(todo, self._place_mirrored(sources, layouts)):
                out[i] = x
        return treedef.unflatten(out)

    def _warn_pmap_layout(self, leaves: list[tuple[Any, Any]]) -> None:
        """Warns (once per call) of leaves laid out the pmap way: mirroring keeps their axis."""
        found = [
            (path, x)
            for path, x in leaves
            if isinstance(x, jax.Array)
            and not isinstance(x, jax.core.Tracer)
            and self.topology.is_pmap_layout(x)
        ]
        if found:
            path, x = found[0]
            message = _MIRROR_PMAP_LAYOUT.format(
                path=jax.tree_util.keystr(path) or "the top level",
                shape=x.shape,
                n=self.num_replicas,
                others=f" (and {len(found) - 1} more leaves like it)" if len(found) > 1 else "",
            )
            warnings.warn(message, UserWarning, stacklevel=4)

    def _place_mirrored(self, sources: list[Any], layouts: list[Any]) -> list[jax.Array]:
        """Returns mirrored copies of `sources` that own their buffers, placed with `layouts`.

        `device_put` may reuse a source's buffer for the copy on its device (a `jax.Array`
        on one of the devices; on CPU, an aligned numpy array of the canonical dtype), and
        donating the mirrored state to a step would then delete or overwrite the caller's
        array. Host values are copied on the host first (cheap, and what is reused is then
        jmirror's own copy; Python scalars are never reused); device arrays are checked and
        copied on the devices if shared.
        """
        sources = [np.array(x) if isinstance(x, np.ndarray) else x for x in sources]
        placed = jax.device_put(sources, layouts)
        shared = [j for j, (a, b) in enumerate(zip(sources, placed)) if _shares_memory(a, b)]
        if shared:
            copies = _copy_fn(tuple(layouts[j] for j in shared))([placed[j] for j in shared])
            for j, copy in zip(shared, copies):
                placed[j] = copy
        return placed

    def sync_on_read(self, tree: PyTree, aggregation: Aggregation) -> SyncOnRead:
        return SyncOnRead(self._stack_copies(self.mirror(tree)), aggregation)

    def _stack_copies(self, mirrored: PyTree) -> PyTree:
        """Returns N stacked copies of a mirrored tree, slice i on device i (no communication);
        its static leaves (an equinox module's functions and flags) are kept."""
        return map_traced_leaves(_stack_fn(self.topology.stacked, self.num_replicas), mirrored)

    def sync_on_read_from(self, component: Callable[[jax.Array], PyTree], aggregation):
        stacked = jax.vmap(component)(jnp.arange(self.num_replicas))
        return SyncOnRead(jax.device_put(stacked, self.topology.stacked), aggregation)

    def distribute_values_from_function(self, value_fn: Callable[[ValueContext], PyTree]):
        n = self.num_replicas
        ids = self._value_replica_ids()
        components = [value_fn(ValueContext(replica_id=i, num_replicas=n)) for i in ids]
        treedef = jax.tree.structure(components[0])
        for i, component in zip(ids[1:], components[1:]):
            if jax.tree.structure(component) != treedef:
                raise ValueError(
                    "strategy.distribute_values_from_function: value_fn returned trees of "
                    f"different structure for replica {ids[0]} ({treedef}) and replica {i} "
                    f"({jax.tree.structure(component)}); every replica needs the same structure."
                )
        flat = jax.tree_util.tree_flatten_with_path(components[0])[0]
        static = static_leaves(components[0])
        per_leaf = zip(*(jax.tree.leaves(c) for c in components), strict=True)
        out = []
        for (path, _), parts, kept in zip(flat, per_leaf, static, strict=True):
            where = jax.tree_util.keystr(path) or "<root>"
            if kept:  # a static leaf (an equinox module's function or flag): one for all
                _check_same_static(parts, ids, where)
                out.append(parts[0])
                continue
            shapes = [np.shape(p) for p in parts]
            if len(set(shapes)) != 1:
                raise ValueError(
                    f"strategy.distribute_values_from_function: the leaf at {where} has "
                    f"different shapes across replicas ({shapes}); components of a PerReplica "
                    "must share one shape."
                )
            out.append(self._place_components(list(parts)))
        return PerReplica(treedef.unflatten(out))

    def _value_replica_ids(self) -> list[int]:
        """Returns the replicas whose components `distribute_values_from_function` asks for."""
        return list(range(self.num_replicas))

    def _place_components(self, parts: list[Any]) -> jax.Array:
        """Returns the stacked components of one leaf, component i on replica i's devices."""
        topology = self.topology
        if topology.is_emulated:
            return jax.device_put(jnp.stack([jnp.asarray(p) for p in parts]), topology.stacked)
        arrays = [
            jax.device_put(jnp.asarray(p)[None], d)
            for i, p in enumerate(parts)
            for d in topology.replica_devices(i)
        ]
        shape = (self.num_replicas,) + tuple(arrays[0].shape[1:])
        return jax.make_array_from_single_device_arrays(shape, topology.stacked, arrays)

    def split_key(self, key: jax.Array) -> PerReplica:
        keys = jax.random.split(key, self.num_replicas)
        return PerReplica(jax.device_put(keys, self.topology.stacked))

    # --- reading -------------------------------------------------------------------------------

    def read(self, tree: PyTree) -> PyTree:
        # Every SUM / MEAN component goes to devices[0] in one transfer and is reduced by one
        # compiled function, however many sync-on-read leaves the tree holds.
        nodes, treedef = self.check_readable(tree)
        out: list[Any] = []
        pending: list[tuple[int, Any, list[Any], list[bool]]] = []
        work: list[tuple[ReduceOp, Any]] = []
        for i, node in enumerate(nodes):
            if isinstance(node, SyncOnRead):  # one component per replica (one process)
                self._check_count(node.value, "read")
            if isinstance(node, SyncOnRead) and node.aggregation in _REDUCED:
                leaves, inner = jax.tree_util.tree_flatten(node.value)
                static = static_leaves(node.value)  # an equinox module's functions: kept
                pending.append((i, inner, leaves, static))
                op = _REDUCED[node.aggregation]
                work.extend((op, leaf) for leaf, s in zip(leaves, static) if not s)
                out.append(None)
            elif isinstance(node, Sharded):  # the whole leaf, on devices[0]
                first = jax.device_put(node.shards, self.topology.devices[0])
                out.append(unshard(node.shape, pieces_span(self.topology))(first))
            elif isinstance(node, SyncOnRead):  # ONLY_FIRST_REPLICA
                out.append(map_traced(lambda v: self._component(v, 0), node.value))
            elif isinstance(node, jax.Array) and self.topology.is_mirrored(node):
                out.append(self._on_first_device(node))
            else:
                out.append(node)
        if pending:
            leaves = [_copyable(leaf) for _, leaf in work]
            stacked = jax.device_put(leaves, self.topology.devices[0])
            reduced = iter(_reduce_many(tuple(op for op, _ in work))(stacked))
            for i, inner, leaves, static in pending:
                out[i] = inner.unflatten(
                    [x if s else next(reduced) for x, s in zip(leaves, static)]
                )
        return treedef.unflatten(out)

    def _on_first_device(self, x: jax.Array) -> jax.Array:
        return self._on_replica(x, 0)

    def _on_replica(self, x: jax.Array, i: int) -> jax.Array:
        """Returns replica `i`'s copy of the mirrored `x` (on its device, or laid out on its
        devices)."""
        copy = replica_copy(self.topology, x, i)  # its own shards: no transfer
        return copy if copy is not None else jax.device_put(x, self.topology.read_sharding(x, i))

    def _gathered(self, stacked: PyTree) -> jax.Array:
        """Returns the stacked components of a leaf, all on devices[0]."""
        return jax.device_put(_copyable(stacked), self.topology.devices[0])

    def stacked(self, x: PyTree) -> PyTree:
        return self._gathered(x)

    def _component(self, stacked: PyTree, i: int) -> PyTree:
        """Returns replica `i`'s whole component of a stacked leaf: from its own shards where they
        hold it (laid out over its devices when k > 1), else moved to its first device."""
        if isinstance(stacked, jax.Array):
            component = replica_component(self.topology, stacked, i)
            if component is not None:
                return component
            device = self.topology.replica_devices(i)[0]
            return _squeeze(jax.device_put(stacked[i : i + 1], device))
        return np.asarray(stacked)[i]

    def local_results(self, value: PyTree) -> tuple[PyTree, ...]:
        nodes, treedef = jax.tree_util.tree_flatten(value, is_leaf=is_distributed)
        per_node = [self._components(x) for x in nodes]
        if all(p is None for p in per_node):
            return (value,)
        return tuple(
            treedef.unflatten([x if p is None else p[i] for x, p in zip(nodes, per_node)])
            for i in range(self.topology.num_local_replicas)
        )

    def _components(self, x: PyTree) -> list[Any] | None:
        n = self.num_replicas
        if isinstance(x, (PerReplica, SyncOnRead)):
            stacked = x.values if isinstance(x, PerReplica) else x.value
            self._check_count(stacked, "local_results")
            return [map_traced(lambda v, i=i: self._component(v, i), stacked) for i in range(n)]
        if isinstance(x, jax.Array) and n > 1 and self.topology.is_mirrored(x):
            return [self._on_replica(x, i) for i in range(n)]
        return None

    def reduce_per_replica(self, op: ReduceOp, x: PerReplica, axis: int | None) -> PyTree:
        self._check_count(x.values, "reduce")
        return map_traced(lambda v: _reduce_fn(op, axis)(self._gathered(v)), x.values)

    def _check_count(self, stacked: PyTree, call: str) -> None:
        """Raises a `ValueError` naming both counts when a leaf of a per-replica value is not
        one component per replica (a `PerReplica` built for another replica count)."""
        n = self.num_replicas
        if self.topology.process_count > 1:
            return  # there a PerReplica holds this process's components: checked on entry
        if all(getattr(x, "shape", ())[:1] == (n,) for x in jax.tree.leaves(stacked)):
            return  # the common case: no paths worked out
        flat = jax.tree_util.tree_flatten_with_path(stacked)[0]
        for (path, leaf), static in zip(flat, static_leaves(stacked)):
            # A Python number has no replica axis either (tf.distribute's list of values).
            if static or np.shape(leaf)[:1] == (n,):
                continue
            where = jax.tree_util.keystr(path) or "<root>"
            raise split_error(f"strategy.{call}", self.topology, where, leaf)

    def gather(self, value: PyTree, axis: int) -> PyTree:
        def one(x: PyTree) -> PyTree:
            if isinstance(x, PerReplica):
                self._check_count(x.values, "gather")
                return map_traced(lambda v: self._gather_stacked(v, axis), x.values)
            if isinstance(x, SyncOnRead):
                raise TypeError(
                    "strategy.gather got a SyncOnRead; read it with strategy.read, or see its "
                    "components with strategy.local_results."
                )
            if isinstance(x, jax.Array) and self.topology.is_mirrored(x):
                copy = self._on_first_device(x)
                if copy.ndim == 0:  # scalar copies: the vector of them, as for a PerReplica
                    return jnp.stack([copy] * self.num_replicas)
                return jnp.concatenate([copy] * self.num_replicas, axis=axis)
            return x

        return jax.tree.map(one, value, is_leaf=is_distributed)

    def _gather_stacked(self, stacked: jax.Array, axis: int) -> jax.Array:
        """Returns one leaf's stacked components concatenated along `axis`, on the first device."""
        return _gather_fn(axis)(self._gathered(stacked))

    def update(self, tree: PyTree, fn: Callable[..., Any], args: tuple, kwargs: dict) -> PyTree:
        return self._run(_Updater(fn), args=(tree,) + args, kwargs=kwargs)


class _Updater:
    """`fn` as a replica function, hashed by `fn` so that `update` reuses compiled steps."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        # How messages name the replicated function (`jm.replicate` uses the qualname).
        self.__qualname__ = f"{UPDATE}({getattr(fn, '__qualname__', repr(fn))})"

    def __call__(self, *args: PyTree, **kwargs: PyTree) -> PyTree:
        return self.fn(*args, **kwargs)

    def __hash__(self) -> int:
        return hash(self.fn)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Updater) and other.fn == self.fn


def _check_same_static(parts: tuple[Any, ...], ids: list[int], where: str) -> None:
    """Raises a `ValueError` when the replicas' components differ in a static leaf."""
    for i, part in zip(ids[1:], parts[1:]):
        if not _same(part, parts[0]):
            raise ValueError(
                f"strategy.distribute_values_from_function: value_fn returned {parts[0]!r} "
                f"for replica {ids[0]} and {part!r} for replica {i} at {where}, a static leaf "
                "(inside an eqx.Module every leaf that is not an array is static: it is part "
                "of the compiled step, one value for every replica). Return the same value "
                "for every replica, or an array (jnp.asarray(...)) where replicas differ."
            )


def _same(a: object, b: object) -> bool:
    """Returns whether two static leaves are the same value (`is`, else `==`)."""
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except (TypeError, ValueError):  # an `==` with no truth value (arrays): not the same
        return False


def _shares_memory(source: object, placed: jax.Array) -> bool:
    """Returns whether `placed` reuses a buffer of the device array `source`."""
    if not isinstance(source, jax.Array):
        return False  # host values were copied on the host
    mine = {shard.data.unsafe_buffer_pointer() for shard in source.addressable_shards}
    return any(shard.data.unsafe_buffer_pointer() in mine for shard in placed.addressable_shards)


def _copyable(x: PyTree) -> PyTree:
    """Returns `x`, or for a zero-size array the host zeros of its shape and dtype.

    JAX lays out the outputs of a computation whose outputs are all zero-size with shards of
    the whole shape, which `device_put` cannot copy; such an array holds nothing to move.
    """
    if isinstance(x, jax.Array) and x.size == 0 and not _is_key(x.dtype):
        return np.zeros(x.shape, x.dtype)
    return x


def _is_key(dtype: jax.typing.DTypeLike) -> bool:
    return jnp.issubdtype(dtype, jax.dtypes.prng_key)


@functools.cache
def _copy_fn(layouts: tuple[Any, ...]) -> Callable[[list[jax.Array]], tuple[jax.Array, ...]]:
    """Returns a function giving fresh copies of arrays, placed with `layouts` (one each)."""
    return jax.jit(lambda xs: tuple(jnp.copy(x) for x in xs), out_shardings=layouts)


@functools.cache
def _stack_fn(sharding: jax.sharding.Sharding, n: int) -> Callable[[PyTree], PyTree]:
    """Returns a function giving N stacked copies of a mirrored tree; each device writes its own
    slice."""

    def stack(tree: PyTree) -> PyTree:
        return jax.tree.map(lambda x: jnp.broadcast_to(x[None], (n,) + jnp.shape(x)), tree)

    return jax.jit(stack, out_shardings=sharding)


_squeeze = jax.jit(lambda x: x[0])


@functools.cache
def unshard(shape: tuple[int, ...], k: int = 1) -> Callable[[jax.Array], jax.Array]:
    """Returns a function giving the whole leaf of shape `shape` from its stacked `Sharded` pieces
    (padding dropped), cut for replicas of `k` devices (`jmirror._shard_jaxpr.layout`)."""
    shape = tuple(shape)

    def whole(x: jax.Array) -> jax.Array:
        return _shard_jaxpr.unstack(x, _shard_jaxpr.layout(shape, x.shape[0], k), shape)

    return jax.jit(whole)


def pieces_span(topology: Topology) -> int:
    """Returns the k that `jm.shard_update` cuts a `Sharded` leaf's pieces for on `topology`."""
    return 1 if topology.is_emulated else topology.devices_per_replica


@functools.cache
def reducer(op: ReduceOp, axis: int | None) -> Callable[[jax.Array], jax.Array]:
    """Reduces stacked components (leading replica axis), and axis `axis` of each component."""
    axes = 0 if axis is None else (0, axis + 1 if axis >= 0 else axis)
    reduce = REPLICA_REDUCERS[op] if axis is None else REDUCERS[op]
    return lambda x: reduce(x, axis=axes)


@functools.cache
def _reduce_fn(op: ReduceOp, axis: int | None) -> Callable[[jax.Array], jax.Array]:
    return jax.jit(reducer(op, axis))


@functools.cache
def _reduce_many(ops: tuple[ReduceOp, ...]) -> Callable[[list[jax.Array]], list[jax.Array]]:
    """Reduces a list of stacked components over their replica axis, one op each."""
    reducers = [REPLICA_REDUCERS[op] for op in ops]
    return jax.jit(lambda xs: [r(x, axis=0) for r, x in zip(reducers, xs)])


@functools.cache
def concatenate(axis: int) -> Callable[[jax.Array], jax.Array]:
    """Concatenates stacked components along `axis` of each component."""

    def gather(x: jax.Array) -> jax.Array:
        if x.ndim == 1:  # scalar components: the global vector of them
            return x
        return jnp.concatenate(list(x), axis=axis)

    return gather


@functools.cache
def _gather_fn(axis: int) -> Callable[[jax.Array], jax.Array]:
    return jax.jit(concatenate(axis))
