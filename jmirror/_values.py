"""Distributed value types: the enums, `PerReplica`, `SyncOnRead`, `Sharded`, `ValueContext`."""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax

PyTree = Any
# A `jax.tree_util.PyTreeDef`: the structure of a pytree (no type a checker accepts).
Structure = Any


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


_NO_SINGLE_VALUE = (
    "{call} got a PerReplica: its replicas may hold different values, so there is no single "
    "value{what}. Use strategy.reduce(op, x) to combine them (op 'sum', 'mean', 'max' or "
    "'min'), strategy.gather(x) to concatenate them, or strategy.local_results(x) for each "
    "replica's component."
)


_VALUES_KEY = jax.tree_util.GetAttrKey("values")


@jax.tree_util.register_pytree_with_keys_class
class PerReplica:
    """A value that may differ between replicas: one component per replica.

    Outside the replicas, every leaf of `values` is a stacked array whose leading axis has
    one slice per replica (slice i lives on device i). Inside a `merge_call`'s `merge_fn`, a
    `PerReplica` stands for the components of the calling replicas: pytree operations such as
    `jax.tree.map` act on each replica's own component, and reading `.values` all-gathers them.

    A `PerReplica` that wraps a container reads like it: `batch["image"]`, `batch[0]` and
    `batch.image` (a field of a NamedTuple, dataclass or flax struct) give the `PerReplica` of
    that item, holding the same arrays (no copy). There is no single number in it: `float()`,
    `int()`, `bool()` and a format spec (`f"{x:.3f}"`) are a `TypeError`; reduce, gather or
    take the local results first.

    Args:
      values: a pytree whose leaves have leading axis N (the number of replicas).

    Example:
        >>> import numpy as np, jmirror as jm
        >>> batch = jm.PerReplica({"x": np.zeros((2, 4)), "y": np.ones((2,))})
        >>> batch.values["x"].shape
        (2, 4)
        >>> batch["y"]
        PerReplica((2,))
        >>> batch["y"].values is batch.values["y"]
        True
    """

    __slots__ = ("_values", "_gather")

    def __init__(self, values: PyTree):
        self._values = values
        self._gather = None

    @property
    def values(self) -> PyTree:
        """Returns the stacked components (leading axis N); all-gathered when read inside
        `merge_fn`."""
        if self._gather is not None:
            return self._gather(self._values)
        return self._values

    @property
    def is_component(self) -> bool:
        """Returns whether this node holds one replica's component (inside `merge_fn`)."""
        return self._gather is not None

    def tree_flatten_with_keys(self):
        return ((_VALUES_KEY, self._values),), self._gather

    def tree_flatten(self):
        # Without it JAX flattens through tree_flatten_with_keys and drops the keys: a
        # Python wrapper on every call's arguments.
        return (self._values,), self._gather

    @classmethod
    def tree_unflatten(cls, gather: Callable[..., Any] | None, children) -> PerReplica:
        node = cls.__new__(cls)
        node._values = children[0]
        node._gather = gather
        return node

    # --- reading like the contents -------------------------------------------------------------

    def _item(self, item: PyTree) -> PerReplica:
        """Returns the `PerReplica` of one item of the wrapped container (same arrays, same
        gather)."""
        return PerReplica.tree_unflatten(self._gather, (item,))

    def _wraps_leaf(self) -> bool:
        return jax.tree_util.treedef_is_leaf(jax.tree.structure(self._values))

    def __getitem__(self, key: Any) -> PerReplica:
        if key is Ellipsis:
            # The whole value, as `x[...]` of an array (what NNX's `variable[...]` reads).
            return self
        values = self._values
        if self._wraps_leaf():
            raise TypeError(
                f"PerReplica[{key!r}]: this PerReplica wraps one leaf ({type(values).__name__}), "
                "not a container, so an index would mix up replicas and positions. Use "
                "strategy.local_results(x)[i] for replica i's component, or "
                "jax.tree.map(lambda v: v[:, j], x) to index every component."
            )
        try:
            return self._item(values[key])
        except (KeyError, IndexError) as error:
            raise type(error)(
                f"PerReplica[{key!r}]: the wrapped {type(values).__name__} has no item "
                f"{key!r}; it has {_describe_items(values)}."
            ) from None

    def __iter__(self) -> Iterator[PerReplica]:
        values = self._values
        if isinstance(values, (list, tuple)):
            return iter([self._item(v) for v in values])
        raise TypeError(
            f"A PerReplica of a {type(values).__name__} is not iterable: only a PerReplica of a "
            "list or tuple unpacks into the PerReplica of each item. Index it (x[key]), or use "
            "strategy.local_results(x) to iterate over the replicas' components."
        )

    def __getattr__(self, name: str) -> PerReplica:
        # Only reached when normal lookup fails. Private and special names are never fields
        # (pickle, copy and JAX probe them); a class attribute that raised is re-raised as is.
        if name.startswith("_"):
            raise AttributeError(f"'PerReplica' object has no attribute {name!r}")
        if hasattr(type(self), name):
            return object.__getattribute__(self, name)
        fields = _fields(self._values)
        if name in fields:
            return self._item(getattr(self._values, name))
        if fields:
            found = f"its {type(self._values).__name__} has the fields {tuple(fields)}"
        else:
            found = f"it wraps a {type(self._values).__name__}, which has no fields"
            if self._wraps_leaf():
                found = f"it wraps one leaf ({type(self._values).__name__}), not a container"
        raise AttributeError(
            f"'PerReplica' object has no attribute {name!r}: {found}. Attribute access gives "
            "the PerReplica of a field of the wrapped NamedTuple, dataclass or flax struct; "
            "x.values is the wrapped value itself."
        )

    def _no_single_value(self, call: str, what: str = "") -> TypeError:
        return TypeError(_NO_SINGLE_VALUE.format(call=call, what=what))

    def __float__(self) -> float:
        raise self._no_single_value("float()")

    def __int__(self) -> int:
        raise self._no_single_value("int()")

    def __index__(self) -> int:
        raise self._no_single_value("operator.index()", " to index with")

    def __complex__(self) -> complex:
        raise self._no_single_value("complex()")

    def __bool__(self) -> bool:
        raise self._no_single_value("bool()", " to test")

    def __format__(self, spec: str) -> str:
        if not spec:
            return str(self)
        raise self._no_single_value(f"format(x, {spec!r})", " to format")

    def __repr__(self) -> str:
        if self._gather is not None:
            return f"PerReplica(<inside merge_fn: {self._values!r}>)"
        shapes = jax.tree.map(lambda x: getattr(x, "shape", type(x).__name__), self._values)
        return f"PerReplica({shapes})"


# The package's access to what a `PerReplica` holds. Module functions, not attributes: every
# public attribute name of `PerReplica` hides a field of the wrapped container (`__getattr__`).


def per_replica_component(component: PyTree, gather: Callable[[PyTree], PyTree]) -> PerReplica:
    """Returns a `PerReplica` seen inside `merge_fn`: the calling replica's own component, and how
    to all-gather every replica's (`gather`, supplied by the replica context)."""
    return PerReplica.tree_unflatten(gather, (component,))


def held_values(x: PerReplica) -> PyTree:
    """Returns what `x` holds, never all-gathered: its stacked components (leading axis N), or
    inside `merge_fn` the calling replica's own component (`x.values` would all-gather it)."""
    return x._values


def _fields(values: PyTree) -> list[str]:
    """Returns the attribute names of the pytree children of `values` (NamedTuple, dataclass
    fields)."""
    children = jax.tree_util.tree_flatten_with_path(values, is_leaf=lambda x: x is not values)[0]
    keys = [path[0] for path, _ in children if path]
    return [k.name for k in keys if isinstance(k, jax.tree_util.GetAttrKey)]


def _describe_items(values: PyTree) -> str:
    if isinstance(values, Mapping):
        return f"the keys {list(values)}"
    try:
        return f"{len(values)} items"
    except TypeError:
        return "no items that can be listed"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False, repr=False)
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

    value: PyTree
    aggregation: Aggregation = dataclasses.field(default=Aggregation.SUM, metadata={"static": True})

    def __post_init__(self) -> None:
        # Only the static aggregation is converted: unflattening (with tracers as the value)
        # runs this too, and never looks at the value.
        if type(self.aggregation) is not Aggregation:
            object.__setattr__(self, "aggregation", Aggregation(self.aggregation))

    def replace(self, value: PyTree) -> SyncOnRead:
        """Returns a new `SyncOnRead` holding `value` with the same aggregation.

        Example:
            >>> import jmirror as jm
            >>> jm.SyncOnRead(1.0, "mean").replace(2.0)
            SyncOnRead(value=2.0, aggregation='mean')
        """
        return SyncOnRead(value, self.aggregation)

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

    def __getattr__(self, name: str) -> Any:
        # Only for names the class lacks: tf.distribute's ValueContext names point to ours.
        ours = _TF_VALUE_CONTEXT.get(name)
        hint = f"; tf.distribute's ValueContext.{name} is jmirror's .{ours}" if ours else ""
        raise AttributeError(f"'ValueContext' object has no attribute {name!r}{hint}")


_TF_VALUE_CONTEXT = {
    "replica_id_in_sync_group": "replica_id",
    "num_replicas_in_sync": "num_replicas",
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Sharded:
    """One leaf of a sharded optimizer state (`jm.shard_update`): 1/N of it on each replica.

    The leaf is flattened (row-major), padded with zeros to a multiple of N and cut into N
    equal pieces; with replicas spanning k > 1 devices it is first cut into k blocks along its
    last dimension that k divides, and piece i holds sub-piece i of every block, so that each
    device holds 1/(N*k) of it (`jmirror._shard_jaxpr`). Outside the replicas `shards` is the
    stacked pieces (shape `[N, k]`, piece i on device i); inside a replica function it is that
    replica's own piece (shape `[k]`).
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

    shards: jax.Array
    shape: tuple[int, ...] = dataclasses.field(metadata={"static": True})

    def __post_init__(self) -> None:
        if type(self.shape) is not tuple or not all(type(d) is int for d in self.shape):
            object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))

    @property
    def size(self) -> int:
        """Returns the number of elements of the whole leaf (padding excluded)."""
        return math.prod(self.shape)

    @property
    def dtype(self) -> Any:
        """Returns the leaf's dtype."""
        return self.shards.dtype

    def __repr__(self) -> str:
        shards = self.shards
        found = getattr(shards, "shape", type(shards).__name__)
        return f"Sharded(shape={self.shape}, shards={found})"


def is_distributed(x: object) -> bool:
    """Returns True for the pytree nodes that hold one component per replica."""
    return isinstance(x, (PerReplica, SyncOnRead, Sharded))
