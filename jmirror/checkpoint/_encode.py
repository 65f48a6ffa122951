"""Saving side: a training state becomes host arrays plus a JSON tree that says how to rebuild it.

Mirrored leaves are fetched once (one replica's copy: one device's, or with replicas spanning
k devices the k shards of one replica, `Topology.local_copy`), `SyncOnRead` nodes are read
(aggregated) in one `strategy.read` call and their N components fetched beside (a restore on
the same replica count puts them back as they were, so a resumed run's metrics continue bitwise),
`PerReplica` leaves are fetched with their N components, numpy arrays and Python scalars are
copied. Every value is a fresh host copy when `encode` returns, so the caller may donate or
overwrite its arrays at once (on XLA:CPU a host view of a device buffer would otherwise change
under the writer).

With several processes every process encodes, since reading a `SyncOnRead` and gathering the
`PerReplica` and `SyncOnRead` components (this process addresses only its own) are
collectives: one jitted identity into the mirrored layout gathers every per-replica leaf at
once. Only the writer keeps the host arrays; a `PerReplica` built by the user from this
process's components (leading axis `num_local_replicas`) is first made global, as is a
`SyncOnRead` of them. The gather is bounded by the strategy's `timeout_s`
(`jmirror._deadline`), as the strategy's own reads are: a process that skips a save ends its
peers' wait in bounded time, named.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from jmirror import _deadline
from jmirror._components import local_copy
from jmirror._flax import is_flax_internal, is_variable
from jmirror._values import Aggregation, PerReplica, PyTree, Sharded, SyncOnRead
from jmirror.checkpoint import _format, _sharded

if TYPE_CHECKING:
    from jmirror._strategy import MirroredStrategy
    from jmirror._topology import Topology

_PYTHON_SCALARS = (bool, int, float, complex)
# The bounded wait of a save that gathers per-replica components (named if it times out,
# after the save's call).
GATHER_CALL = "{call}'s gathering of the per-replica components"

_NOT_MIRRORED = (
    "jm.checkpoint.save: the array at path {where!r} is not mirrored (its sharding is "
    "{sharding}); a state holds mirrored arrays, SyncOnRead and PerReplica nodes. Wrap "
    "per-replica values in jm.PerReplica, or mirror the array with strategy.mirror; an array "
    "laid out inside the replicas (devices_per_replica > 1) over several processes is saved "
    "with strategy= the strategy that laid it out."
)


def _laid_out_elsewhere(topology: Topology, x: jax.Array) -> bool:
    """Returns whether `x` is laid out by another strategy or mesh (a notebook re-run that
    changed `devices_per_replica`) and wholly in this process: saved as its whole value, as a
    replicated call would place it. An array on this strategy's own mesh that is not mirrored
    (its stacked per-replica layout) stays an error: it is a `PerReplica` left unwrapped."""
    sharding = x.sharding
    on_this_mesh = isinstance(sharding, jax.sharding.NamedSharding) and (
        sharding.mesh == topology.mesh
    )
    return x.is_fully_addressable and not on_this_mesh


@dataclasses.dataclass
class Encoded:
    """A state as written: the JSON tree, its arrays (host copies) and the replica count."""

    tree: dict
    arrays: dict[str, np.ndarray]
    num_replicas: int


def children(node: PyTree) -> list[tuple[Any, Any]] | None:
    """Returns the (key entry, child) pairs one level below `node`; `None` when `node` is a leaf.

    flax NNX objects flatten with a leafless internal child (`_pytree__state`), which is
    left out: it holds nothing to save, and a state restored without target has no
    flax-internal names.
    """
    pairs, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    if len(pairs) == 1 and pairs[0][0] == () and pairs[0][1] is node:
        return None
    return [(path[0], child) for path, child in pairs if not is_flax_internal(path[0], child)]


def container_kind(node: PyTree) -> str:
    if node is None:
        return "none"
    for kind in (dict, list, tuple):
        if type(node) is kind:
            return kind.__name__
    return "class"


class _Encoder:
    def __init__(self, strategy: MirroredStrategy, call: str = "jm.checkpoint.save"):
        self.strategy = strategy
        self.call = call
        self.topology = strategy.topology
        self.n = strategy.num_replicas
        self.several = self.topology.process_count > 1
        self.fetch: list[tuple[str, Any]] = []  # (array name, device or host value)
        self.reads: list[tuple[SyncOnRead | Sharded, list[str]]] = []  # nodes to read
        self.count = 0

    def _name(self) -> str:
        self.count += 1
        return str(self.count - 1)

    def read_later(self, node: Sharded) -> str:
        """Returns the array name of `node`'s whole value, read with the state's other reads."""
        names = [self._name()]
        self.reads.append((node, names))
        return names[0]

    def node(self, x: PyTree, path: tuple) -> dict:
        where = jax.tree_util.keystr(path)
        if isinstance(x, Sharded):  # saved whole, as read
            return _leaf(_sharded.KIND, self.read_later(x), x.shape, x.shards)
        if isinstance(x, SyncOnRead):
            if x.aggregation is Aggregation.NONE:
                child = self.stacked(x.value, path + (jax.tree_util.GetAttrKey("value"),))
            else:
                child = self.aggregated(x, path)
            return {"node": "sync_on_read", "aggregation": x.aggregation.value, "child": child}
        if isinstance(x, PerReplica):
            if x.is_component:  # inside merge_fn a PerReplica holds one component
                raise RuntimeError(
                    f"jm.checkpoint.save got a PerReplica at path {where!r} inside a merge_fn; "
                    "save from cross-replica context, outside the replicated function."
                )
            key = jax.tree_util.GetAttrKey("values")
            return {"node": "per_replica", "child": self.stacked(x.values, path + (key,))}
        pairs = children(x)
        if pairs is None:
            return self.leaf(x, where)
        kind = container_kind(x)
        out: dict[str, Any] = {"node": kind}
        if kind == "class":
            out["class"] = f"{type(x).__module__}.{type(x).__qualname__}"
            if is_variable(x) and len(pairs) == 1:
                out["variable"] = True  # restored without target as its value
        out["children"] = [
            [_format.entry_to_json(entry, where), self.node(child, path + (entry,))]
            for entry, child in pairs
        ]
        return out

    def leaf(self, x: PyTree, where: str) -> dict:
        check_leaf(x, where)
        name = self._name()
        if isinstance(x, jax.Array):
            # Mirrored: replicated everywhere, or laid out inside the replicas (k > 1) and
            # replicated over them; one replica's copy is the whole value, written once.
            if x.is_fully_replicated or self.topology.is_mirrored(x):
                self.fetch.append((name, local_copy(self.topology, x)))
            elif _laid_out_elsewhere(self.topology, x):
                self.fetch.append((name, x))  # the whole value: every shard is this process's
            else:
                raise TypeError(_NOT_MIRRORED.format(where=where, sharding=x.sharding))
            return _leaf("mirrored", name, x.shape, x)
        if isinstance(x, (np.ndarray, np.generic)):
            self.fetch.append((name, np.array(x, copy=True)))
            out = _leaf("numpy", name, np.shape(x), x)
            if isinstance(x, np.generic):
                out["scalar"] = True
            return out
        if isinstance(x, _PYTHON_SCALARS):
            value = np.asarray(x)
            self.fetch.append((name, value))
            return {**_leaf("python", name, (), value), "python": type(x).__name__}
        raise TypeError(
            f"jm.checkpoint.save: the leaf at path {where!r} is a {type(x).__name__}; a "
            "checkpoint stores arrays (mirrored jax.Array, numpy) and Python scalars. Make it a "
            "static field (flax.struct.field(pytree_node=False)) or drop it from the state."
        )

    def stacked(self, tree: PyTree, path: tuple) -> dict:
        """Returns a subtree whose leaves hold N stacked components (PerReplica, SyncOnRead
        NONE)."""

        def one(sub_path: tuple, x: PyTree) -> dict:
            where = jax.tree_util.keystr(path + sub_path)
            check_leaf(x, where, stacked=True)
            return _leaf("stacked", self.components(x, where), np.shape(x)[1:], x)

        return self.subtree(tree, path, one)

    def components(self, x: PyTree, where: str) -> str:
        """Returns the array name of a per-replica leaf's N stacked components, fetched with the
        rest."""
        if self.several and not _is_global(x):
            x = self.globalize(x, where)
        if np.ndim(x) < 1 or np.shape(x)[0] != self.n:
            raise ValueError(
                f"jm.checkpoint.save: the per-replica leaf at path {where!r} has shape "
                f"{np.shape(x)}; expected a leading axis of {self.n} (one component per "
                "replica of the strategy). Save with the strategy that made the value."
            )
        name = self._name()
        if isinstance(x, jax.Array):
            self.fetch.append((name, x))
        else:
            self.fetch.append((name, np.array(x, copy=True)))
        return name

    def globalize(self, x: PyTree, where: str) -> PyTree:
        """Returns a global stacked array of this process's components (leading axis: local
        ones)."""
        local = self.topology.num_local_replicas
        if np.ndim(x) < 1 or np.shape(x)[0] != local:
            raise ValueError(
                f"jm.checkpoint.save: the per-replica leaf at path {where!r} has shape "
                f"{np.shape(x)}; with several processes a PerReplica holds either all "
                f"{self.n} components (a value of a replicated function) or this process's "
                f"num_local_replicas={local}. Save with the strategy that made the value."
            )
        local_value = np.asarray(x)
        shape = (self.n,) + local_value.shape[1:]
        return jax.make_array_from_process_local_data(self.topology.stacked, local_value, shape)

    def aggregated(self, node: SyncOnRead, path: tuple) -> dict:
        """Returns each leaf stored as read, with its N components beside it (`"components"`)."""
        names: list[str] = []
        self.reads.append((node, names))

        def one(sub_path: tuple, x: PyTree) -> dict:
            where = jax.tree_util.keystr(path + sub_path)
            check_leaf(x, where, stacked=True)
            names.append(self._name())
            out = _leaf("aggregated", names[-1], np.shape(x)[1:], x)
            out["components"] = self.components(x, where)
            return out

        return self.subtree(node.value, path + (jax.tree_util.GetAttrKey("value"),), one)

    def subtree(self, tree: PyTree, path: tuple, one: PyTree, sub_path: tuple = ()) -> dict:
        pairs = children(tree)
        if pairs is None:
            return one(sub_path, tree)
        where = jax.tree_util.keystr(path + sub_path)
        kind = container_kind(tree)
        out: dict[str, Any] = {"node": kind}
        if kind == "class":
            out["class"] = f"{type(tree).__module__}.{type(tree).__qualname__}"
            if is_variable(tree) and len(pairs) == 1:
                out["variable"] = True
        out["children"] = [
            [_format.entry_to_json(e, where), self.subtree(c, path, one, sub_path + (e,))]
            for e, c in pairs
        ]
        return out

    def host_arrays(self, keep: bool) -> dict[str, np.ndarray]:
        """Aggregates the sync-on-read nodes and copies every value to the host.

        Every process calls this (it holds the collectives); with `keep` False the values
        are not copied and nothing is returned.
        """
        values = dict(self.fetch)
        if self.reads:
            read = self.strategy.read([node for node, _ in self.reads])
            for (_, names), tree in zip(self.reads, read):
                for name, leaf in zip(names, jax.tree.leaves(tree)):
                    values[name] = leaf
        for name, x in values.items():
            if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
                values[name] = jax.random.key_data(x)
        values.update(self.gather({k: x for k, x in values.items() if _is_global(x)}))
        if not keep:
            return {}
        for name, x in values.items():
            if isinstance(x, jax.Array) and x.size == 0:  # nothing to fetch (see `_copyable`
                values[name] = np.zeros(x.shape, x.dtype)  # of `jmirror._host_ops`)
        on_device = [name for name, x in values.items() if isinstance(x, jax.Array)]
        fetched = jax.device_get([values[name] for name in on_device])
        for name, host in zip(on_device, fetched):
            # A host view of an XLA:CPU buffer would change if the array were donated.
            values[name] = np.array(host, copy=True)
        return {str(i): values[str(i)] for i in range(self.count)}

    def gather(self, spread: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """Returns this process's full copies of arrays spread over processes (one collective call).

        Bounded by the strategy's `timeout_s`: a process that skips the save its peers make
        (or exits) never joins the all-gather, and gloo would wait for it without end.
        """
        if not spread:
            return {}
        with _deadline.bounded(GATHER_CALL.format(call=self.call), self.topology.timeout_s):
            full = _mirror_all(self.topology.mirrored)(list(spread.values()))
            full = jax.block_until_ready(full)
        return {name: x.addressable_shards[0].data for name, x in zip(spread, full)}


@functools.cache
def _mirror_all(mirrored: PyTree) -> PyTree:
    """Returns a jitted identity whose outputs are mirrored: an all-gather of each array."""
    return jax.jit(lambda xs: xs, out_shardings=mirrored)


def _is_global(x: object) -> bool:
    """Returns whether `x` is an array of which this process addresses only part."""
    return isinstance(x, jax.Array) and not x.is_fully_addressable


def check_leaf(x: PyTree, where: str, stacked: bool = False) -> None:
    """Raises for a leaf that cannot be stored, before anything is read or written.

    The one place leaves are checked: every leaf of the state passes here while the tree is
    encoded, before the first collective, host copy or file.
    """
    if isinstance(x, jax.Array) and x.is_deleted():
        raise ValueError(
            f"jm.checkpoint.save: the array at path {where!r} has been deleted (donated to a "
            "jitted or replicated function, or deleted explicitly); its values are gone. Save "
            "the state that call returned, or save before donating it."
        )
    if isinstance(x, bool) or not isinstance(
        x, _PYTHON_SCALARS + (jax.Array, np.ndarray, np.generic)
    ):
        return  # Python bools and the leaf kinds refused by `leaf` with their own message
    if isinstance(x, int) and not -(2**63) <= x < 2**63:
        raise TypeError(
            f"jm.checkpoint.save: the Python int at path {where!r} is {x}, beyond the int64 "
            "range a checkpoint stores (-2**63 to 2**63 - 1). Store it as a float, as a numpy "
            "array of smaller parts, or as a str in the manager's data."
        )
    if isinstance(x, (np.ndarray, np.generic, jax.Array)) and not _format.is_stored_dtype(x.dtype):
        what = "per-replica leaf" if stacked else "leaf"
        raise TypeError(
            f"jm.checkpoint.save: the {what} at path {where!r} is an array of dtype "
            f"{x.dtype}; a checkpoint stores arrays of numeric, bool and PRNG key dtypes (not "
            "str, bytes, object or datetime arrays). Convert it (e.g. to integer codes), or keep "
            "it out of the state (the manager's data takes JSON)."
        )


def _leaf(kind: str, name: str, shape: tuple, x: PyTree) -> dict:
    dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
    out = {
        "node": "leaf",
        "kind": kind,
        "array": name,
        "shape": list(shape),
        "dtype": _format.dtype_name(dtype),
    }
    if jnp.issubdtype(dtype, jax.dtypes.prng_key):
        out["key_impl"] = str(jax.random.key_impl(x))
    elif isinstance(x, jax.Array) and jax.typeof(x).weak_type:
        out["weak"] = True  # restored weakly typed: a resumed step compiles as before
    return out


def encode(
    state: PyTree, strategy: MirroredStrategy, keep: bool = True, call: str = "jm.checkpoint.save"
) -> Encoded:
    """Returns the JSON tree of `state` and host copies of its arrays (see `_format`).

    Every process of the strategy calls it; only where `keep` are the arrays copied (the
    others get an empty dict). `call` names the user's call in the message of a wait that
    times out.
    """
    encoder = _Encoder(strategy, call)
    tree = encoder.node(state, ())
    return Encoded(tree, encoder.host_arrays(keep), strategy.num_replicas)
