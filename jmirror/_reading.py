"""Reading distributed values: read, local_results, reduce and gather."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from jmirror import _context
from jmirror._devices import Device
from jmirror._values import (
    Aggregation,
    PerReplica,
    PyTree,
    ReduceOp,
    SyncOnRead,
    is_distributed,
)

_READ_PER_REPLICA = (
    "{call} got a PerReplica{where}: its replicas may hold different values, so there is no "
    "single value to read. Use strategy.reduce(op, value) to combine them, "
    "strategy.gather(value) to concatenate them, or strategy.local_results(value) for each "
    "replica's component."
)


def _is_python_zero(x: Any) -> bool:
    return type(x) is int and x == 0


class _Reading:
    """Methods of `MirroredStrategy` that read distributed values in cross-replica context.

    Reads mirrored and sync-on-read state, and reduces, gathers or lists the components of
    `PerReplica` values, on `devices[0]` or, inside a merge_fn, with collectives. A mixin: it
    relies on the attribute `_devices` set by `MirroredStrategy._setup` and on its
    `num_replicas`, `_merge` and `_is_mirrored`.
    """

    if TYPE_CHECKING:  # provided by MirroredStrategy
        _devices: tuple[Device, ...]

        @property
        def num_replicas(self) -> int: ...

        def _merge(self, call: str) -> _context.ReplicaContext | None: ...

        def _is_mirrored(self, x: jax.Array) -> bool: ...

    def _on_first_device(self, x: jax.Array) -> jax.Array:
        for shard in x.addressable_shards:
            if shard.device == self._devices[0]:
                return shard.data
        return jax.device_put(x, self._devices[0])

    def _gathered(self, stacked: Any) -> jax.Array:
        """The stacked components of a leaf, all on devices[0]."""
        return jax.device_put(stacked, self._devices[0])

    def read(self, tree: PyTree) -> PyTree:
        """Returns the value of mirrored and sync-on-read state, in cross-replica context.

        Mirrored leaves give their value as a `jax.Array` on `devices[0]` (one copy, no
        gather); `SyncOnRead` nodes are aggregated (`SUM`, `MEAN`, `ONLY_FIRST_REPLICA`); other
        non-distributed leaves are returned unchanged.

        Raises:
          TypeError: for a `PerReplica` (use `reduce`, `gather` or `local_results`).
          ValueError: for a `SyncOnRead` with aggregation `NONE`.

        Example:
            >>> import jmirror as jm
            >>> strategy = jm.MirroredStrategy()
            >>> state = {"w": strategy.mirror(2.0), "n": strategy.sync_on_read(1, "sum")}
            >>> out = strategy.read(state)
            >>> float(out["w"]), int(out["n"]) == strategy.num_replicas
            (2.0, True)
        """
        context = self._merge("read(tree)")
        path_nodes, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_distributed)
        for path, node in path_nodes:
            if isinstance(node, PerReplica):
                where = " inside merge_fn" if context is not None else ""
                where += f" at path {jax.tree_util.keystr(path) or '<root>'!r}"
                raise TypeError(_READ_PER_REPLICA.format(call="strategy.read", where=where))
        if context is not None:
            return jax.tree.map(lambda x: self._read_node(x, context), tree, is_leaf=is_distributed)
        # Cross-replica: every SUM / MEAN component goes to devices[0] in one transfer and is
        # reduced by one compiled function, however many sync-on-read leaves the tree holds.
        nodes = [node for _, node in path_nodes]
        out: list[Any] = []
        pending: list[tuple[int, Any, int]] = []
        for i, node in enumerate(nodes):
            if isinstance(node, SyncOnRead) and node.aggregation in _REDUCED:
                op = _REDUCED[node.aggregation]
                leaves, inner = jax.tree_util.tree_flatten(node.value)
                pending.append((i, inner, len(leaves)))
                out.append([(op, leaf) for leaf in leaves])
            else:
                out.append(self._read_node(node, None))
        if pending:
            work = [item for i, _, _ in pending for item in out[i]]
            stacked = jax.device_put([leaf for _, leaf in work], self._devices[0])
            reduced = iter(_reduce_many(tuple(op for op, _ in work))(stacked))
            for i, inner, size in pending:
                out[i] = inner.unflatten([next(reduced) for _ in range(size)])
        return treedef.unflatten(out)

    def _read_node(self, x: Any, context: _context.ReplicaContext | None) -> Any:
        if isinstance(x, SyncOnRead):
            agg = x.aggregation
            if agg is Aggregation.NONE:
                raise ValueError(
                    "strategy.read got a SyncOnRead with aggregation NONE, which has no defined "
                    "value across replicas. Create it with aggregation 'sum', 'mean' or "
                    "'only_first_replica', or use strategy.local_results to see each component."
                )
            if agg is Aggregation.ONLY_FIRST_REPLICA:
                if context is not None:
                    return context.sync(x.value, agg)
                return jax.tree.map(lambda v: self._component(v, 0), x.value)
            op = ReduceOp.SUM if agg is Aggregation.SUM else ReduceOp.MEAN
            if context is not None:
                return _context.merge_reduce(context, op, x.value, None)
            return jax.tree.map(lambda v: _reduce_fn(op, None)(self._gathered(v)), x.value)
        if context is None and isinstance(x, jax.Array) and self._is_mirrored(x):
            return self._on_first_device(x)
        return x

    def _component(self, stacked: Any, i: int) -> Any:
        if isinstance(stacked, jax.Array):
            for shard in stacked.addressable_shards:
                if shard.device == self._devices[i] and shard.data.shape[:1] == (1,):
                    return _squeeze(shard.data)
            return _squeeze(jax.device_put(stacked[i : i + 1], self._devices[i]))
        return np.asarray(stacked)[i]

    def local_results(self, value: PyTree) -> tuple[PyTree, ...]:
        """Returns the per-replica components of `value`, in replica order.

        A `PerReplica` or `SyncOnRead` gives its N components; a mirrored array its N
        copies; a tree holding such nodes gives N trees; any other value gives `(value,)`.

        Example:
            >>> import jmirror as jm
            >>> strategy = jm.MirroredStrategy()
            >>> parts = strategy.local_results(strategy.run(jm.replica_id))
            >>> [int(p) for p in parts] == list(range(strategy.num_replicas))
            True
        """
        context = self._merge("local_results(value)")
        n = self.num_replicas
        nodes, treedef = jax.tree_util.tree_flatten(value, is_leaf=is_distributed)
        if context is not None:
            per_node = [self._merge_components(context, x) for x in nodes]
        else:
            per_node = [self._components(x) for x in nodes]
        if all(p is None for p in per_node):
            return (value,)
        trees = []
        for i in range(n):
            leaves = [x if p is None else p[i] for x, p in zip(nodes, per_node, strict=False)]
            trees.append(treedef.unflatten(leaves))
        return tuple(trees)

    def _components(self, x: Any) -> list[Any] | None:
        n = self.num_replicas
        if isinstance(x, PerReplica):
            return [jax.tree.map(lambda v, i=i: self._component(v, i), x.values) for i in range(n)]
        if isinstance(x, SyncOnRead):
            return [jax.tree.map(lambda v, i=i: self._component(v, i), x.value) for i in range(n)]
        if isinstance(x, jax.Array) and n > 1 and self._is_mirrored(x):
            by_device = {s.device: s.data for s in x.addressable_shards}
            return [by_device[d] for d in self._devices]
        return None

    def _merge_components(self, context: _context.ReplicaContext, x: Any) -> list[Any] | None:
        if isinstance(x, PerReplica):
            stacked = x.values
        elif isinstance(x, SyncOnRead):
            stacked = context.all_gather(x.value)
        else:
            return None
        return [jax.tree.map(lambda v, i=i: v[i], stacked) for i in range(self.num_replicas)]

    def reduce(self, op: ReduceOp | str, value: PyTree, axis: int | None = None) -> PyTree:
        """Reduces a `PerReplica` across replicas into one value on `devices[0]`.

        Args:
          op: `SUM`, `MEAN`, `MAX` or `MIN`.
          value: a `PerReplica` (or a tree holding them).
          axis: `None` reduces element-wise across replicas; `axis=k` also reduces over axis k
            of each component, so `MEAN` gives the mean over the global batch.

        Returns:
          The reduced value. A non-distributed or mirrored value: `MEAN` returns it
          unchanged; `SUM` returns it when N == 1; the Python int 0 returns 0.

        Raises:
          ValueError: `SUM` of a non-distributed value with more than one replica.

        Example:
            >>> import numpy as np, jmirror as jm
            >>> strategy = jm.MirroredStrategy()
            >>> n = strategy.num_replicas
            >>> x = jm.PerReplica(np.arange(n * 2, dtype=np.float32).reshape(n, 2))
            >>> float(strategy.reduce("mean", x, axis=0)) == (n * 2 - 1) / 2
            True
        """
        op = ReduceOp(op)
        context = self._merge("reduce(op, value)")
        if _is_python_zero(value):
            return 0
        leaves = jax.tree.leaves(value, is_leaf=is_distributed)
        if not any(isinstance(x, PerReplica) for x in leaves):
            return self._reduce_plain(op, value)

        def one(x: Any) -> Any:
            if isinstance(x, PerReplica):
                if context is not None:
                    return _context.merge_reduce(context, op, x._values, axis)
                return jax.tree.map(lambda v: _reduce_fn(op, axis)(self._gathered(v)), x.values)
            return self._reduce_plain(op, x)

        return jax.tree.map(one, value, is_leaf=is_distributed)

    def _reduce_plain(self, op: ReduceOp, value: Any) -> Any:
        if isinstance(value, jax.core.Tracer) and _context.merge_context() is not None:
            raise ValueError(
                f"strategy.reduce({op.name}, value) inside merge_fn got a traced value that is "
                "not a PerReplica: it was captured from the replica function's closure instead "
                "of passed through merge_call, so jmirror cannot tell whether it differs "
                "between replicas. Pass it in jm.merge_call(merge_fn, args=(value,)): merge_fn "
                "then receives a PerReplica when it may differ."
            )
        if op is ReduceOp.SUM and self.num_replicas > 1:
            raise ValueError(
                f"strategy.reduce(SUM, value) got a value that is not a PerReplica "
                f"({type(value).__name__}) with {self.num_replicas} replicas: a value identical "
                "on every replica has no defined per-replica sum. Pass a PerReplica (for "
                "example a replica function's output), or use MEAN to get the value back."
            )
        return value

    def gather(self, value: PyTree, axis: int = 0) -> PyTree:
        """Concatenates the replicas' components along `axis`: the global batch back.

        Scalar components are stacked into a vector. The result is a `jax.Array` on
        `devices[0]`.

        Example:
            >>> import numpy as np, jmirror as jm
            >>> strategy = jm.MirroredStrategy()
            >>> n = strategy.num_replicas
            >>> x = jm.PerReplica(np.arange(n * 2).reshape(n, 2))
            >>> strategy.gather(x).tolist() == list(range(n * 2))
            True
        """
        context = self._merge("gather(value)")

        def one(x: Any) -> Any:
            if isinstance(x, PerReplica):
                if context is not None:
                    gather = context.all_gather
                    return jax.tree.map(
                        lambda v: gather(v, axis=axis, tiled=jnp.ndim(v) > 0), x._values
                    )
                return jax.tree.map(lambda v: _gather_fn(axis)(self._gathered(v)), x.values)
            if isinstance(x, SyncOnRead):
                raise TypeError(
                    "strategy.gather got a SyncOnRead; read it with strategy.read, or see its "
                    "components with strategy.local_results."
                )
            if context is None and isinstance(x, jax.Array) and self._is_mirrored(x):
                copy = self._on_first_device(x)
                return jnp.concatenate([copy] * self.num_replicas, axis=axis)
            return x

        return jax.tree.map(one, value, is_leaf=is_distributed)


_squeeze = jax.jit(lambda x: x[0])
_REDUCERS = _context.REDUCERS


@functools.cache
def _reduce_fn(op: ReduceOp, axis: int | None) -> Callable[[jax.Array], jax.Array]:
    """Reduces stacked components (leading replica axis), and axis `axis` of each component."""
    axes = 0 if axis is None else (0, axis + 1 if axis >= 0 else axis)
    reducer = _REDUCERS[op]
    return jax.jit(lambda x: reducer(x, axis=axes))


_REDUCED = {Aggregation.SUM: ReduceOp.SUM, Aggregation.MEAN: ReduceOp.MEAN}


@functools.cache
def _reduce_many(ops: tuple[ReduceOp, ...]) -> Callable[[list[jax.Array]], list[jax.Array]]:
    """Reduces a list of stacked components over their replica axis, one op each."""
    reducers = [_REDUCERS[op] for op in ops]
    return jax.jit(lambda xs: [r(x, axis=0) for r, x in zip(reducers, xs)])


@functools.cache
def _gather_fn(axis: int) -> Callable[[jax.Array], jax.Array]:
    """Concatenates stacked components along `axis` of each component."""

    def gather(x: jax.Array) -> jax.Array:
        if x.ndim == 1:  # scalar components: the global vector of them
            return x
        return jnp.concatenate(list(x), axis=axis)

    return jax.jit(gather)
