"""Distributed value types: the enums, `PerReplica`, `SyncOnRead`, `Sharded`, `ValueContext`."""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax

PyTree = Any


class _LowercaseEnum(enum.StrEnum):
    """A str enum whose members are matched case-insensitively by value or name."""

    @classmethod
    def _missing_(cls, value: object) -> _LowercaseEnum:
        if isinstance(value, str):
            for member in cls:
                if member.value == value.lower():
                    return member
        valid = ", ".join(f"{cls.__name__}.{m.name} ({m.value!r})" for m in cls)
        raise ValueError(f"{value!r} is not a valid {cls.__name__}; expected one of {valid}.")


class ReduceOp(_LowercaseEnum):
    """How `reduce` and `all_reduce` combine the replicas' values.

    Example:
        >>> import jmirror as jm
        >>> jm.ReduceOp("SUM") is jm.ReduceOp.SUM
        True
    """

    SUM = "sum"
    MEAN = "mean"
    MAX = "max"
    MIN = "min"


class Aggregation(_LowercaseEnum):
    """How the replicas' components of a sync-on-read value combine when it is read.

    Example:
        >>> import jmirror as jm
        >>> jm.Aggregation("only_first_replica")
        <Aggregation.ONLY_FIRST_REPLICA: 'only_first_replica'>
    """

    NONE = "none"
    SUM = "sum"
    MEAN = "mean"
    ONLY_FIRST_REPLICA = "only_first_replica"


class Synchronization(_LowercaseEnum):
    """When state created by `MirroredStrategy.create_state` is kept in sync.

    Example:
        >>> import jmirror as jm
        >>> jm.Synchronization("on_read").value
        'on_read'
    """

    AUTO = "auto"
    ON_WRITE = "on_write"
    ON_READ = "on_read"
    NONE = "none"


@jax.tree_util.register_pytree_with_keys_class
class PerReplica:
    """A value that may differ between replicas: one component per replica.

    Outside the replicas, every leaf of `values` is a stacked array whose leading axis has
    one slice per replica (slice i lives on device i). Inside a `merge_call`'s `merge_fn`, a
    `PerReplica` stands for the components of the calling replicas: pytree operations such as
    `jax.tree.map` act on each replica's own component, and reading `.values` all-gathers them.

    Args:
      values: a pytree whose leaves have leading axis N (the number of replicas).

    Example:
        >>> import numpy as np, jmirror as jm
        >>> batch = jm.PerReplica({"x": np.zeros((2, 4))})
        >>> batch.values["x"].shape
        (2, 4)
    """

    __slots__ = ("_values", "_gather")

    def __init__(self, values: PyTree):
        self._values = values
        self._gather = None

    @classmethod
    def _of_component(cls, component: PyTree, gather: Callable[[PyTree], PyTree]) -> PerReplica:
        """A `PerReplica` seen inside `merge_fn`: the calling replica's own component, and
        how to all-gather every replica's (`gather`, supplied by the replica context)."""
        node = cls.__new__(cls)
        node._values = component
        node._gather = gather
        return node

    @property
    def values(self) -> PyTree:
        """The stacked components (leading axis N); all-gathered when read inside `merge_fn`."""
        if self._gather is not None:
            return self._gather(self._values)
        return self._values

    @property
    def is_component(self) -> bool:
        """Whether this node holds one replica's component (inside `merge_fn`)."""
        return self._gather is not None

    def tree_flatten_with_keys(self):
        return ((jax.tree_util.GetAttrKey("values"), self._values),), self._gather

    @classmethod
    def tree_unflatten(cls, gather: Any, children) -> PerReplica:
        node = cls.__new__(cls)
        node._values = children[0]
        node._gather = gather
        return node

    def __repr__(self) -> str:
        if self._gather is not None:
            return f"PerReplica(<inside merge_fn: {self._values!r}>)"
        shapes = jax.tree.map(lambda x: getattr(x, "shape", type(x).__name__), self._values)
        return f"PerReplica({shapes})"


@jax.tree_util.register_pytree_with_keys_class
class SyncOnRead:
    """Per-replica storage written without communication and aggregated when read.

    Outside the replicas, `value` holds stacked components (leading axis N, slice i on
    device i); inside a replica function it is that replica's own component. Read it with
    `MirroredStrategy.read`, which combines the components by `aggregation`.

    Args:
      value: the components, as a pytree.
      aggregation: an `Aggregation` (or its lowercase string) used when the value is read.

    Example:
        >>> import jmirror as jm
        >>> strategy = jm.MirroredStrategy()
        >>> loss = strategy.sync_on_read(2.0, "mean")
        >>> loss.aggregation, float(strategy.read(loss))
        (<Aggregation.MEAN: 'mean'>, 2.0)
    """

    __slots__ = ("value", "aggregation")
    value: PyTree
    aggregation: Aggregation

    def __init__(self, value: PyTree, aggregation: Aggregation | str = Aggregation.SUM):
        object.__setattr__(self, "value", value)
        object.__setattr__(self, "aggregation", Aggregation(aggregation))

    def __setattr__(self, name: str, value: object) -> None:
        raise dataclasses.FrozenInstanceError(
            f"SyncOnRead is immutable; use .replace(new_value) instead of setting {name!r}."
        )

    def replace(self, value: PyTree) -> SyncOnRead:
        """Returns a new `SyncOnRead` holding `value` with the same aggregation.

        Example:
            >>> import jmirror as jm
            >>> jm.SyncOnRead(1.0, "mean").replace(2.0)
            SyncOnRead(value=2.0, aggregation='mean')
        """
        return SyncOnRead(value, self.aggregation)

    def tree_flatten_with_keys(self):
        return ((jax.tree_util.GetAttrKey("value"), self.value),), self.aggregation

    @classmethod
    def tree_unflatten(cls, aggregation: Aggregation, children) -> SyncOnRead:
        node = cls.__new__(cls)
        object.__setattr__(node, "value", children[0])
        object.__setattr__(node, "aggregation", aggregation)
        return node

    def __repr__(self) -> str:
        value = self.value
        if isinstance(value, jax.Array):
            value = f"Array(shape={value.shape}, dtype={value.dtype})"
        else:
            value = repr(value)
        return f"SyncOnRead(value={value}, aggregation={self.aggregation.value!r})"


@dataclasses.dataclass(frozen=True)
class ValueContext:
    """Which replica `MirroredStrategy.distribute_values_from_function` asks a value for.

    Example:
        >>> import jmirror as jm
        >>> jm.ValueContext(replica_id=1, num_replicas=2).replica_id
        1
    """

    replica_id: int = 0
    num_replicas: int = 1


@jax.tree_util.register_pytree_with_keys_class
class Sharded:
    """One leaf of a sharded optimizer state (`jm.shard_update`): 1/N of it on each replica.

    The leaf is flattened (row-major), padded with zeros to a multiple of N and cut into N
    equal pieces. Outside the replicas `shards` is the stacked pieces (shape `[N, k]`, piece
    i on device i); inside a replica function it is that replica's own piece (shape `[k]`).
    `shape` is the whole leaf's shape (static). `strategy.read` gives the whole leaf back.

    Args:
      shards: the stacked pieces, `[N, k]` with `N * k >= prod(shape)`.
      shape: the shape of the whole leaf.

    Example:
        >>> import numpy as np, jmirror as jm
        >>> node = jm.Sharded(np.arange(4.0).reshape(2, 2), (3,))
        >>> node.shape, node.size, node.shards.shape
        ((3,), 3, (2, 2))
    """

    __slots__ = ("shards", "shape")
    shards: Any
    shape: tuple[int, ...]

    def __init__(self, shards: Any, shape: Sequence[int]):
        object.__setattr__(self, "shards", shards)
        object.__setattr__(self, "shape", tuple(int(d) for d in shape))

    def __setattr__(self, name: str, value: object) -> None:
        raise dataclasses.FrozenInstanceError(f"Sharded is immutable; cannot set {name!r}.")

    @property
    def size(self) -> int:
        """The number of elements of the whole leaf (padding excluded)."""
        return math.prod(self.shape)

    @property
    def dtype(self) -> Any:
        """The leaf's dtype."""
        return self.shards.dtype

    def tree_flatten_with_keys(self):
        return ((jax.tree_util.GetAttrKey("shards"), self.shards),), self.shape

    @classmethod
    def tree_unflatten(cls, shape: tuple[int, ...], children) -> Sharded:
        node = cls.__new__(cls)
        object.__setattr__(node, "shards", children[0])
        object.__setattr__(node, "shape", shape)
        return node

    def __repr__(self) -> str:
        shards = self.shards
        found = getattr(shards, "shape", type(shards).__name__)
        return f"Sharded(shape={self.shape}, shards={found})"


def is_distributed(x: object) -> bool:
    """True for the pytree nodes that hold one component per replica."""
    return isinstance(x, (PerReplica, SyncOnRead, Sharded))
