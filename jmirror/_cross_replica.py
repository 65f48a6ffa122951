"""The cross-replica operations: one interface, for the host and for `merge_fn`.

`MirroredStrategy`'s methods that place and read distributed values (`mirror`, `read`,
`reduce`, `gather`, `local_results`, `assign`, ...) run in cross-replica context, which has two
places: the host, on concrete arrays (`jmirror._host_ops.HostOps`), and the inside of a
`merge_call`'s `merge_fn`, on traced values through collectives (`jmirror._merge_ops.MergeOps`).
`CrossReplica` is their one interface: the strategy asks `cross_replica(call)` for the
implementation that fits where it is called and forwards to it; nothing else branches on the
context. What both places share (argument checks, the integer `SUM` split of `assign`, the
rule for reducing a value that is not per replica, the messages) is written once, here.
"""

from __future__ import annotations

import abc
import operator
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmirror._adapter import static_leaves
from jmirror._values import (
    Aggregation,
    PerReplica,
    PyTree,
    ReduceOp,
    SyncOnRead,
    ValueContext,
    is_distributed,
)

# The reduction of each op within one array (over an axis).
REDUCERS = {
    ReduceOp.SUM: jnp.sum,
    ReduceOp.MEAN: jnp.mean,
    ReduceOp.MAX: jnp.max,
    ReduceOp.MIN: jnp.min,
}


def mean_over_replicas(x: jax.Array, axis: int = 0) -> jax.Array:
    """Returns the mean of stacked components over their replica axis (0), exactly their value
    where the components are equal (a `SyncOnRead` MEAN that was assigned a value: a float
    sum of N equal values rounds)."""
    mean = jnp.mean(x, axis=axis)
    if axis != 0 or not jnp.issubdtype(x.dtype, jnp.inexact) or not x.shape or not x.shape[0]:
        return mean
    return jnp.where(jnp.all(x == x[0], axis=0), x[0], mean)


# The reduction of each op over the replica axis alone (axis 0 of stacked components).
REPLICA_REDUCERS = {**REDUCERS, ReduceOp.MEAN: mean_over_replicas}

_READ_PER_REPLICA = (
    "strategy.read got a PerReplica{where}: its replicas may hold different values, so there "
    "is no single value to read. Use strategy.reduce(op, value) to combine them, "
    "strategy.gather(value) to concatenate them, or strategy.local_results(value) for each "
    "replica's component."
)
_READ_NONE = (
    "strategy.read got a SyncOnRead with aggregation NONE, which has no defined value across "
    "replicas. Create it with aggregation 'sum', 'mean' or 'only_first_replica', or use "
    "strategy.local_results to see each component."
)


class CrossReplica(abc.ABC):
    """The cross-replica operations of a strategy with `num_replicas` replicas."""

    num_replicas: int
    where: str  # "" on the host, " inside merge_fn" there: for messages

    # --- placing -----------------------------------------------------------------------------

    @abc.abstractmethod
    def mirror(self, tree: PyTree) -> PyTree:
        """Places every leaf identically on every replica."""

    @abc.abstractmethod
    def sync_on_read(self, tree: PyTree, aggregation: Aggregation) -> SyncOnRead:
        """Returns a `SyncOnRead` whose every replica starts with `tree`."""

    @abc.abstractmethod
    def sync_on_read_from(
        self, component: Callable[[jax.Array], PyTree], aggregation
    ) -> SyncOnRead:
        """Returns a `SyncOnRead` whose replica r holds `component(r)` (r a traced replica
        index)."""

    @abc.abstractmethod
    def distribute_values_from_function(self, value_fn: Callable[[ValueContext], PyTree]):
        """Returns a `PerReplica` whose component i is `value_fn(ValueContext(i, N))`."""

    @abc.abstractmethod
    def split_key(self, key: jax.Array) -> PerReplica:
        """Returns N independent PRNG keys, one per replica."""

    # --- reading -----------------------------------------------------------------------------

    @abc.abstractmethod
    def read(self, tree: PyTree) -> PyTree:
        """Returns mirrored leaves as their value, `SyncOnRead` nodes aggregated (no
        `PerReplica`)."""

    @abc.abstractmethod
    def stacked(self, x: PyTree) -> PyTree:
        """Returns every replica's component of the stacked leaf `x` (a sync-on-read value), as one
        array on which this process can combine them (the NNX metrics' own combines)."""

    @abc.abstractmethod
    def local_results(self, value: PyTree) -> tuple[PyTree, ...]:
        """Returns the N per-replica components of `value`, in replica order."""

    @abc.abstractmethod
    def reduce_per_replica(self, op: ReduceOp, x: PerReplica, axis: int | None) -> PyTree:
        """Returns one `PerReplica` reduced across replicas (and over `axis` of each component)."""

    @abc.abstractmethod
    def gather(self, value: PyTree, axis: int) -> PyTree:
        """Returns the replicas' components concatenated along `axis`."""

    @abc.abstractmethod
    def update(self, tree: PyTree, fn: Callable[..., Any], args: tuple, kwargs: dict) -> PyTree:
        """Applies `fn(tree, *args, **kwargs)` to every replica's copy of `tree`."""

    # --- shared --------------------------------------------------------------------------------

    def check_readable(self, tree: PyTree) -> tuple[list[Any], Any]:
        """Returns the top-level nodes of `tree` and its structure; raises at a `PerReplica`."""
        nodes, treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_distributed)
        for i, node in enumerate(nodes):
            if isinstance(node, PerReplica):
                path = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_distributed)[0][i][0]
                where = f"{self.where} at path {jax.tree_util.keystr(path) or '<root>'!r}"
                raise TypeError(_READ_PER_REPLICA.format(where=where))
            if isinstance(node, SyncOnRead) and node.aggregation is Aggregation.NONE:
                raise ValueError(_READ_NONE)
        self.refuse_nested("strategy.read", tree)
        return nodes, treedef

    def refuse_nested(self, call: str, tree: PyTree) -> None:
        """Raises a `TypeError` naming the path of a `SyncOnRead` whose value holds a
        `PerReplica`."""
        nodes = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_distributed)[0]
        for path, node in nodes:
            if isinstance(node, SyncOnRead) and any(
                isinstance(x, PerReplica)
                for x in jax.tree_util.tree_leaves(node.value, is_leaf=is_distributed)
            ):
                raise TypeError(
                    f"{call} got a SyncOnRead{self.where} at path "
                    f"{jax.tree_util.keystr(path) or '<root>'!r} whose value holds a PerReplica: a "
                    "SyncOnRead's value is its stacked components themselves. Build it as "
                    "jm.SyncOnRead(components, aggregation) with the PerReplica's values, or "
                    "with strategy.sync_on_read(value, aggregation)."
                )

    def reduce(self, op: ReduceOp, value: PyTree, axis: int | None) -> PyTree:
        """Returns `strategy.reduce`: `PerReplica` nodes reduced, other values by the plain rule."""
        if type(value) is int and value == 0:
            return 0
        # A SyncOnRead's components are per replica: reduced by `op` as a PerReplica's are
        # (as tf.distribute reduces a sync-on-read variable), whatever its own aggregation.
        self.refuse_nested("strategy.reduce", value)
        value = jax.tree.map(
            lambda x: PerReplica(x.value) if isinstance(x, SyncOnRead) else x,
            value,
            is_leaf=is_distributed,
        )
        nodes, treedef = jax.tree_util.tree_flatten(value, is_leaf=is_distributed)
        if not any(isinstance(x, PerReplica) for x in nodes):
            return self.reduce_plain(op, value)
        static = static_leaves(value, is_leaf=is_distributed)  # an equinox module's functions
        if axis is not None:
            _check_axis(op, value, axis)
        return treedef.unflatten(
            [
                x
                if s
                else self.reduce_per_replica(op, x, axis)
                if isinstance(x, PerReplica)
                else self.reduce_plain(op, x)
                for x, s in zip(nodes, static)
            ]
        )

    def reduce_plain(self, op: ReduceOp, value: PyTree) -> PyTree:
        """Returns a value that is not per replica: `MEAN` returns it, `SUM` only with one
        replica."""
        if op is ReduceOp.SUM and self.num_replicas > 1:
            raise ValueError(
                f"strategy.reduce(SUM, value) got a value that is not a PerReplica "
                f"({type(value).__name__}) with {self.num_replicas} replicas: a value identical "
                "on every replica has no defined per-replica sum. Pass a PerReplica (for "
                "example a replica function's output), or use MEAN to get the value back."
            )
        return value

    def assign(self, sync_on_read: SyncOnRead, value: PyTree) -> SyncOnRead:
        """Returns a `SyncOnRead` holding `value` such that reading it gives exactly `value`."""
        if not isinstance(sync_on_read, SyncOnRead):
            raise TypeError(
                f"strategy.assign expects a SyncOnRead, got {type(sync_on_read).__name__}. "
                "Mirrored state is replaced by returning a new value from the replica function."
            )
        if jax.tree.structure(value) != jax.tree.structure(sync_on_read.value):
            raise ValueError(
                f"strategy.assign: the value's structure {jax.tree.structure(value)} differs from "
                f"the SyncOnRead's {jax.tree.structure(sync_on_read.value)}; pass a value of the "
                "same structure."
            )
        n = self.num_replicas
        is_sum = sync_on_read.aggregation is Aggregation.SUM
        # A module's functions and flags (static leaves) are kept as `value` has them.
        held, treedef = jax.tree.flatten(sync_on_read.value)
        static = static_leaves(sync_on_read.value)
        dtypes = {i: jnp.result_type(x) for i, (x, st) in enumerate(zip(held, static)) if not st}
        news = treedef.flatten_up_to(value)
        paths = [jax.tree_util.keystr(q) for q, _ in jax.tree_util.tree_flatten_with_path(value)[0]]
        for i, dtype in dtypes.items():
            _check_assigned(paths[i], held[i], dtype, news[i], n if is_sum else None)

        def spread(
            dtype: jax.typing.DTypeLike,
        ) -> bool:  # an integer or bool SUM: components differ by the remainder
            return is_sum and bool(jnp.issubdtype(dtype, jnp.integer) or dtype == jnp.bool_)

        def component(
            dtype: jax.typing.DTypeLike, new: PyTree, replica: jax.Array | int
        ) -> jax.Array:
            new = jnp.asarray(new)
            if spread(dtype):
                # Divided before the cast: the sum may be beyond the dtype, its shares not.
                wide = jnp.promote_types(dtype, jnp.int32)
                new = new.astype(wide)
                extra = (replica < jnp.remainder(new, n)).astype(wide)
                return (jnp.floor_divide(new, n) + extra).astype(dtype)
            return (new / n if is_sum else new).astype(dtype)

        aggregation = sync_on_read.aggregation
        traced = list(dtypes)

        def with_leaves(leaves: dict[int, Any]) -> PyTree:
            return treedef.unflatten([leaves.get(i, new) for i, new in enumerate(news)])

        if not any(spread(dtypes[i]) for i in traced):
            same = {i: component(dtypes[i], news[i], 0) for i in traced}
            return self.sync_on_read(with_leaves(same), aggregation)
        parts = self.sync_on_read_from(
            lambda r: [component(dtypes[i], news[i], r) for i in traced], aggregation
        )
        return SyncOnRead(with_leaves(dict(zip(traced, parts.value))), aggregation)


def _check_axis(op: ReduceOp, value: PyTree, axis: int) -> None:
    """Raises a `ValueError` when a per-replica component of `value` has no axis `axis`."""
    try:
        axis = operator.index(axis)  # an int, or an integer like np.int64
    except TypeError:
        raise TypeError(
            f"strategy.reduce({op.value!r}, value, axis={axis!r}): axis must be None or an "
            "int (an axis of each replica's component)."
        ) from None
    _check_components_axis(
        value,
        axis,
        f"strategy.reduce({op.value!r}, value, axis={axis})",
        "axis names an axis of each replica's component, reduced as well as across replicas; "
        "pass axis=None to reduce across replicas only, or an axis the components have.",
    )


def check_gather_axis(value: PyTree, axis: object) -> int:
    """Returns `strategy.gather`'s `axis` as an int; raises when it is no int or a per-replica
    component of `value` has no such axis (scalar components are stacked: axis 0 or -1)."""
    try:
        axis = operator.index(axis)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"strategy.gather(value, axis={axis!r}): axis must be an int (the axis of each "
            "replica's component to concatenate along)."
        ) from None
    _check_components_axis(
        value,
        axis,
        f"strategy.gather(value, axis={axis})",
        "axis names the axis of each replica's component to concatenate along (0: the "
        "global batch back); pass an axis the components have.",
        scalars=True,
    )
    return axis


def _check_components_axis(
    value: PyTree, axis: int, call: str, fix: str, scalars: bool = False
) -> None:
    """Raises a `ValueError` naming `call`, the path and the shape when a per-replica component
    of `value` has no axis `axis` (`scalars`: scalar components count as vectors)."""
    nodes = jax.tree_util.tree_flatten_with_path(value, is_leaf=is_distributed)[0]
    for node_path, node in nodes:
        if not isinstance(node, PerReplica):
            continue
        for path, leaf in jax.tree_util.tree_flatten_with_path(node.values)[0]:
            shape = getattr(leaf, "shape", None)
            if shape is None or not shape:
                continue  # a static leaf; an unstacked leaf is the count check's
            component = tuple(shape[1:])
            rank = max(len(component), 1) if scalars else len(component)
            if -rank <= axis < rank:
                continue
            where = jax.tree_util.keystr(node_path) + jax.tree_util.keystr(path)
            raise ValueError(
                f"{call}: the per-replica value at {where or '<root>'} has components of shape "
                f"{component} ({len(component)} axes), with no axis {axis}. {fix}"
            )


def _check_assigned(where: str, held: PyTree, dtype: Any, new: PyTree, n: int | None) -> None:
    """Raises when `new` cannot be a `SyncOnRead` leaf's value exactly: another shape than a
    replica's component, a dtype that casting to the leaf's would change (a float into an
    integer leaf), or an integer SUM over `n` replicas whose shares the dtype cannot hold."""
    where = where or "<root>"
    component = tuple(np.shape(held)[1:])
    if tuple(np.shape(new)) != component:
        raise ValueError(
            f"strategy.assign: the value at {where} has shape {tuple(np.shape(new))}; the "
            f"SyncOnRead's components there have shape {component}. Pass a value of that shape "
            "(reading the SyncOnRead gives back exactly the value assigned)."
        )
    given = getattr(new, "dtype", None) or np.result_type(new)
    if not np.can_cast(given, dtype, casting="same_kind"):
        raise TypeError(
            f"strategy.assign: the value at {where} has dtype {np.dtype(given).name}; the "
            f"SyncOnRead's leaf there is {np.dtype(dtype).name}, and casting would change the "
            "value. Pass a value whose dtype casts to it unchanged (round it first, for "
            "example), or make the SyncOnRead with the dtype you mean to assign."
        )
    beyond = shares_beyond(new, n, dtype) if n is not None else None
    if beyond is not None:
        (low, high), (least, most) = beyond
        raise ValueError(
            f"strategy.assign: the value at {where} sums over {n} replicas to shares from "
            f"{low} to {high}, beyond what the SyncOnRead's dtype {np.dtype(dtype).name} holds "
            f"({least} to {most}). Make the SyncOnRead with a wider dtype."
        )


def shares_beyond(
    value: PyTree, n: int, dtype: Any
) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """Returns the smallest and largest share of an integer or bool SUM of `value` over `n`
    replicas (`value // n`, one more on `value % n` replicas) and what `dtype` holds, when
    the shares are beyond it; None when they fit, or for other dtypes (`assign` and a
    restore onto another replica count spread a SUM so)."""
    if dtype == np.bool_:
        least, most = 0, 1
    elif jnp.issubdtype(dtype, jnp.integer):
        least, most = int(np.iinfo(dtype).min), int(np.iinfo(dtype).max)
    else:
        return None
    value = np.asarray(value, np.int64)
    if not value.size:
        return None
    low, high = int(np.floor_divide(value, n).min()), int((-np.floor_divide(-value, n)).max())
    return ((low, high), (least, most)) if low < least or high > most else None
