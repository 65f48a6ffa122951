"""The cross-replica operations inside a `merge_call`'s `merge_fn`: collectives.

Inside `merge_fn` every replica traces the same code on its own components, so an operation
that combines replicas is a collective over the replica axis (`reduce` an all-reduce,
`local_results` and `gather` an all-gather), and its result is a traced value that every replica
holds. Placing is trivial there: each replica already holds its component.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from jmirror._adapter import map_traced, map_traced_leaves
from jmirror._context import (
    ReplicaContext,
    all_reduce_leaf,
    is_mirrored_in_merge,
    keep_weak,
    merge_per_replica,
    note_mirrored_in_merge,
)
from jmirror._cross_replica import REDUCERS, CrossReplica
from jmirror._values import (
    Aggregation,
    PerReplica,
    PyTree,
    ReduceOp,
    SyncOnRead,
    ValueContext,
    held_values,
    is_distributed,
)

_CAPTURED = (
    "strategy.reduce({op}, value) inside merge_fn got a traced value{where} that is not a "
    "PerReplica and was not passed through merge_call: it was captured from the replica "
    "function's closure (or computed inside merge_fn from such a value) instead of passed "
    "through merge_call, so jmirror cannot tell whether it differs between replicas. Pass it "
    "in jm.merge_call(merge_fn, args=(value,)): merge_fn then receives a PerReplica when it "
    "may differ, and a mirrored value when it is proven identical on every replica."
)


class MergeOps(CrossReplica):
    """`CrossReplica` inside the `merge_fn` of the replica context `context`."""

    where = " inside merge_fn"

    def __init__(self, context: ReplicaContext):
        self.context = context
        self.num_replicas = context.num_replicas

    # --- placing -------------------------------------------------------------------------------

    def mirror(self, tree: PyTree) -> PyTree:
        return tree

    def sync_on_read(self, tree: PyTree, aggregation: Aggregation) -> SyncOnRead:
        return SyncOnRead(tree, aggregation)

    def sync_on_read_from(self, component: Callable[[jax.Array], PyTree], aggregation):
        return SyncOnRead(component(self.context.replica_id), aggregation)

    def distribute_values_from_function(self, value_fn: Callable[[ValueContext], PyTree]):
        raise RuntimeError(
            "strategy.distribute_values_from_function cannot run inside a merge_fn; call it "
            "outside the replicated function and pass the result in."
        )

    def split_key(self, key: jax.Array) -> PerReplica:
        keys = jax.random.split(key, self.num_replicas)
        return merge_per_replica(keys[self.context.replica_id], self.context.axis_name)

    # --- reading -------------------------------------------------------------------------------

    def stacked(self, x: PyTree) -> PyTree:
        return x

    def read(self, tree: PyTree) -> PyTree:
        self.check_readable(tree)

        def one(x: PyTree) -> PyTree:
            if not isinstance(x, SyncOnRead):
                return x
            if x.aggregation is Aggregation.ONLY_FIRST_REPLICA:
                first = map_traced_leaves(lambda v: self.context.sync(v, x.aggregation), x.value)
                return note_mirrored_in_merge(first)
            op = ReduceOp.SUM if x.aggregation is Aggregation.SUM else ReduceOp.MEAN
            return self._all_reduce(op, x.value, None)

        return jax.tree.map(one, tree, is_leaf=is_distributed)

    def _all_reduce(self, op: ReduceOp, tree: PyTree, axis: int | None) -> PyTree:
        def one(x: PyTree) -> PyTree:
            x = given = jnp.asarray(x)
            if axis is not None:
                x = REDUCERS[op](x, axis=axis)
            # In the dtype the host's reduce gives (a sum of int8 in int32, a mean of ints in
            # float32: numpy's rule), not wrapping in the components' own.
            x = x.astype(_host_dtype(op, x.dtype))
            return keep_weak(given, all_reduce_leaf(op, x, self.context.axis_name))

        return note_mirrored_in_merge(map_traced(one, tree))

    def local_results(self, value: PyTree) -> tuple[PyTree, ...]:
        nodes, treedef = jax.tree_util.tree_flatten(value, is_leaf=is_distributed)
        per_node = [self._components(x) for x in nodes]
        if all(p is None for p in per_node):
            return (value,)
        return tuple(
            treedef.unflatten([x if p is None else p[i] for x, p in zip(nodes, per_node)])
            for i in range(self.num_replicas)
        )

    def _components(self, x: PyTree) -> list[Any] | None:
        """Returns the N components of one node: all-gathered, or a mirrored value's N copies."""
        if isinstance(x, PerReplica):
            stacked = x.values
        elif isinstance(x, SyncOnRead):
            stacked = self.context.all_gather(x.value)
        elif is_mirrored_in_merge(x):
            return [x] * self.num_replicas
        else:
            return None
        return [
            note_mirrored_in_merge(jax.tree.map(lambda v, i=i: v[i], stacked))
            for i in range(self.num_replicas)
        ]

    def reduce(self, op: ReduceOp, value: PyTree, axis: int | None) -> PyTree:
        self._check_passed(op, value)
        return super().reduce(op, value, axis)

    def _check_passed(self, op: ReduceOp, value: PyTree) -> None:
        """Raises for a traced leaf that merge_fn cannot tell mirrored from per-replica."""
        leaves = jax.tree_util.tree_flatten_with_path(value, is_leaf=is_distributed)[0]
        for path, leaf in leaves:
            if isinstance(leaf, jax.core.Tracer) and not is_mirrored_in_merge(leaf):
                where = f" at path {jax.tree_util.keystr(path)!r}" if path else ""
                raise ValueError(_CAPTURED.format(op=op.name, where=where))

    def reduce_per_replica(self, op: ReduceOp, x: PerReplica, axis: int | None) -> PyTree:
        return self._all_reduce(op, held_values(x), axis)

    def gather(self, value: PyTree, axis: int) -> PyTree:
        gather = self.context.all_gather
        n = self.num_replicas

        def one(x: PyTree) -> PyTree:
            if isinstance(x, PerReplica):
                return note_mirrored_in_merge(
                    jax.tree.map(
                        lambda v: gather(v, axis=axis, tiled=jnp.ndim(v) > 0), held_values(x)
                    )
                )
            if is_mirrored_in_merge(x):  # its N copies, as the host gathers a mirrored array
                copies = [x] * n
                if jnp.ndim(x) == 0:
                    return note_mirrored_in_merge(jnp.stack(copies, axis=axis))
                return note_mirrored_in_merge(jnp.concatenate(copies, axis=axis))
            if isinstance(x, SyncOnRead):
                raise TypeError(
                    "strategy.gather got a SyncOnRead; read it with strategy.read, or see its "
                    "components with strategy.local_results."
                )
            return x

        return jax.tree.map(one, value, is_leaf=is_distributed)

    def update(self, tree: PyTree, fn: Callable[..., Any], args: tuple, kwargs: dict) -> PyTree:
        # Every replica runs fn on its own components.
        tree, args, kwargs = jax.tree.map(
            lambda x: held_values(x) if isinstance(x, PerReplica) else x,
            (tree, args, kwargs),
            is_leaf=lambda x: isinstance(x, PerReplica),
        )
        return fn(tree, *args, **kwargs)


@functools.cache
def _host_dtype(op: ReduceOp, dtype: np.dtype) -> np.dtype:
    """Returns the dtype `strategy.reduce(op, ...)` on the host gives for components of `dtype`."""
    stacked = jax.ShapeDtypeStruct((1,), dtype)
    return jax.eval_shape(lambda v: REDUCERS[op](v, axis=0), stacked).dtype
