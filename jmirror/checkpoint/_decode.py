"""Restoring side: the JSON tree and its host arrays become a state placed on a strategy.

`check` validates the tree (and `target`, when given) before any array is read; `place` puts
the values back as they were saved: mirrored leaves mirrored (laid out inside the replicas by
the restoring strategy's rules, whatever k saved them), `jm.Sharded` leaves cut into the
restoring strategy's pieces, `SyncOnRead` leaves with their
saved components on the replica count that saved them (bitwise as they were), else as
`strategy.assign` places a value (so reading them gives what was saved, on any replica count;
also for checkpoints written without components), `PerReplica` leaves split over the replicas
(same replica count only).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from jmirror import _shim
from jmirror._cross_replica import shares_beyond
from jmirror._flax import is_variable
from jmirror._nnx_metrics import MetricComponents
from jmirror._values import Aggregation, PerReplica, PyTree, Sharded, SyncOnRead, is_distributed
from jmirror.checkpoint import _format, _sharded
from jmirror.checkpoint._encode import children, container_kind

if TYPE_CHECKING:
    from jmirror._strategy import MirroredStrategy

_GET_VALUE = jax.tree_util.GetAttrKey("value")
_GET_VALUES = jax.tree_util.GetAttrKey("values")


class Leaf:
    """One validated leaf of the saved tree."""

    def __init__(self, node: dict, path: tuple, where: str, specs: dict):
        self.path = path
        self.kind = _format.field(node, "kind", str, where)
        if self.kind not in _format.KINDS:
            raise _format.corrupt(where, f"leaf kind {self.kind!r} is unknown")
        self.array = _format.field(node, "array", str, where)
        if self.array not in specs:
            raise _format.corrupt(where, f"leaf array {self.array!r} is not in the array table")
        self.shape = _format.parse_shape(_format.field(node, "shape", list, where), where)
        self.dtype_name = _format.field(node, "dtype", str, where)
        self.key_impl = node.get("key_impl")
        self.dtype: np.dtype | None = None
        self.aggregation: Aggregation | None = None  # set for the leaves of a SyncOnRead
        self.metric = False  # restored into an NNX metric's `MetricComponents`
        if self.key_impl is None:
            self.dtype = _format.parse_dtype(self.dtype_name, where)
        elif self.key_impl not in _format.KEY_IMPLS:
            raise _format.corrupt(where, f"PRNG key implementation {self.key_impl!r} is unknown")
        self.python = node.get("python")
        if self.kind == "python" and self.python not in _format.PYTHON_TYPES:
            raise _format.corrupt(where, f"Python scalar type {self.python!r} is unknown")
        self.scalar = node.get("scalar") is True
        self.weak = node.get("weak", False)
        if not isinstance(self.weak, bool):
            raise _format.corrupt(where, f"a leaf's weak type is {self.weak!r}, not true or false")
        self.sharded = self.kind == _sharded.KIND  # restored as a Sharded node
        # The array of a sync-on-read leaf's N components (absent in older version 2 checkpoints).
        self.components: str | None = node.get("components")
        if self.components is not None and (
            self.kind != "aggregated" or not isinstance(self.components, str)
        ):
            raise _format.corrupt(where, f"a {self.kind} leaf has components {self.components!r}")
        if self.components is not None and self.components not in specs:
            raise _format.corrupt(
                where, f"leaf components {self.components!r} are not in the array table"
            )

    def describe(self) -> str:
        if self.kind == "python":
            return f"a Python {self.python}"
        return f"shape {self.shape} dtype {self.dtype_name}"


class Tree:
    """A validated saved tree: containers, `SyncOnRead` / `PerReplica` nodes and `Leaf`s."""

    def __init__(self, node: object, where: str, specs: dict, path: tuple = (), inside=False):
        self.path = path
        self.kind = _format.field(node, "node", str, where)
        if inside and self.kind in ("sync_on_read", "per_replica"):
            raise _format.corrupt(where, f"a {self.kind} node lies inside a distributed node")
        self.children: list[tuple[Any, Tree]] = []
        self.variable = isinstance(node, dict) and node.get("variable") is True
        self.leaf: Leaf | None = None
        self.aggregation: Aggregation | None = None
        if self.kind == "leaf":
            self.leaf = Leaf(node, path, where, specs)  # type: ignore[arg-type]
            if not inside and self.leaf.kind in ("aggregated", "stacked"):
                raise _format.corrupt(where, f"a {self.leaf.kind} leaf lies outside its node")
        elif self.kind == "sync_on_read":
            name = _format.field(node, "aggregation", str, where)
            if name not in {a.value for a in Aggregation}:
                raise _format.corrupt(where, f"aggregation {name!r} is unknown")
            self.aggregation = Aggregation(name)
            child = Tree(
                _format.field(node, "child", dict, where), where, specs, path + (_GET_VALUE,), True
            )
            self.children = [(_GET_VALUE, child)]
            stored = "stacked" if self.aggregation is Aggregation.NONE else "aggregated"
            for leaf in child.leaves():
                _expect_kind(leaf, stored, where)
                leaf.aggregation = self.aggregation
        elif self.kind == "per_replica":
            child = Tree(
                _format.field(node, "child", dict, where), where, specs, path + (_GET_VALUES,), True
            )
            self.children = [(_GET_VALUES, child)]
            for leaf in child.leaves():
                _expect_kind(leaf, "stacked", where)
        elif self.kind in _format.CONTAINERS:
            for pair in _format.field(node, "children", list, where):
                if not isinstance(pair, list) or len(pair) != 2:
                    raise _format.corrupt(where, f"tree child {pair!r} is not a [key, node] pair")
                entry = _format.entry_from_json(pair[0], where)
                child = Tree(pair[1], where, specs, path + (entry,), inside)
                self.children.append((entry, child))
        else:
            raise _format.corrupt(where, f"tree node kind {self.kind!r} is unknown")

    def leaves(self) -> list[Leaf]:
        if self.leaf is not None:
            return [self.leaf]
        return [leaf for _, child in self.children for leaf in child.leaves()]

    def describe(self) -> str:
        if self.leaf is not None:
            return f"a leaf ({self.leaf.describe()})"
        if self.kind == "sync_on_read":
            return f"a SyncOnRead with aggregation {self.aggregation.value!r}"  # type: ignore[union-attr]
        if self.kind == "per_replica":
            return "a PerReplica"
        if self.kind == "none":
            return "None (nothing written)"
        keys = ", ".join(_key_str(e) for e, _ in self.children) or "none"
        return f"a {self.kind} with keys {keys}"


def _expect_kind(leaf: Leaf, kind: str, where: str) -> None:
    if leaf.kind != kind:
        raise _format.corrupt(where, f"a {leaf.kind} leaf lies where a {kind} leaf belongs")


def check_arrays(tree: Tree, specs: dict, saved_n: int, where: str) -> None:
    """Checks that every leaf's array has the shape and dtype the leaf says."""
    for leaf in tree.leaves():
        spec = specs[leaf.array]
        expected = ((saved_n,) if leaf.kind == "stacked" else ()) + leaf.shape
        shape = tuple(spec.shape)
        if leaf.key_impl is not None:
            shape = shape[: len(expected)]
        dtype_ok = leaf.kind == "aggregated" or leaf.key_impl is not None
        if shape != expected or not (dtype_ok or spec.dtype == leaf.dtype):
            raise _format.corrupt(
                where,
                f"array {leaf.array!r} has shape {spec.shape} dtype {spec.dtype}; its leaf "
                f"{jax.tree_util.keystr(leaf.path)!r} says {leaf.describe()}",
            )
        if leaf.components is not None:
            spec = specs[leaf.components]
            shape = tuple(spec.shape)
            if leaf.key_impl is not None:
                shape = shape[: len(leaf.shape) + 1]
            if shape != (saved_n,) + leaf.shape or not (
                leaf.key_impl is not None or spec.dtype == leaf.dtype
            ):
                raise _format.corrupt(
                    where,
                    f"array {leaf.components!r} has shape {spec.shape} dtype {spec.dtype}; the "
                    f"{saved_n} components of the leaf {jax.tree_util.keystr(leaf.path)!r} are "
                    f"{leaf.describe()} each",
                )


def component_paths(tree: Tree) -> dict[str, str]:
    """Returns each components array's leaf path, for messages (as `_integrity.leaf_paths`)."""
    return {
        leaf.components: jax.tree_util.keystr(leaf.path) + " (its components)"
        for leaf in tree.leaves()
        if leaf.components is not None
    }


def _key_str(entry: object) -> str:
    return jax.tree_util.keystr((entry,))


def _mismatch(path: tuple, saved: str, expected: str) -> ValueError:
    where = jax.tree_util.keystr(path) or "the root"
    return ValueError(
        f"jm.checkpoint.restore: the checkpoint does not match target at path {where!r}: the "
        f"checkpoint holds {saved}, target expects {expected}. Pass a target with the "
        "structure, shapes and dtypes that were saved, or target=None to get the saved tree."
    )


def _describe_target(x: PyTree) -> str:
    if isinstance(x, Sharded):
        return f"a Sharded leaf of shape {x.shape} dtype {_format.dtype_name(x.dtype)}"
    if isinstance(x, SyncOnRead):
        return f"a SyncOnRead with aggregation {x.aggregation.value!r}"
    if isinstance(x, PerReplica):
        return "a PerReplica"
    if x is None:
        return "None"
    pairs = children(x)
    if pairs is None:
        return f"a leaf ({_describe_leaf(x)})"
    keys = ", ".join(_key_str(e) for e, _ in pairs) or "none"
    return f"a {container_kind(x)} with keys {keys}"


def _describe_leaf(x: PyTree) -> str:
    if isinstance(x, (bool, int, float, complex)):
        return f"a Python {type(x).__name__}"
    dtype = getattr(x, "dtype", None)
    name = _format.dtype_name(dtype) if dtype is not None else type(x).__name__
    return f"shape {tuple(np.shape(x))} dtype {name}"


def check_target(tree: Tree, target: PyTree, stacked: bool = False) -> None:
    """Raises `ValueError` at the first path where `target` differs from the saved tree.

    Where neither holds an array (an equinox module's static field, None in the checkpoint),
    their structures may differ: nothing is read there, the target's own value comes back.
    """
    try:
        _check_target(tree, target, stacked)
    except ValueError:
        if not tree.leaves() and not jax.tree.leaves(target):
            return
        raise


def _check_target(tree: Tree, target: PyTree, stacked: bool) -> None:
    if tree.leaf is not None:
        fits = _sharded.matches(tree.leaf, target)
        if fits is not None:
            if not fits:
                raise _mismatch(tree.path, tree.describe(), _describe_target(target))
            return
        if is_distributed(target) or children(target) is not None:
            raise _mismatch(tree.path, tree.describe(), _describe_target(target))
        _check_leaf(tree.leaf, target, stacked)
        return
    if tree.kind == "sync_on_read":
        if not isinstance(target, SyncOnRead) or target.aggregation != tree.aggregation:
            raise _mismatch(tree.path, tree.describe(), _describe_target(target))
        check_target(tree.children[0][1], target.value, stacked=True)
        return
    if tree.kind == "per_replica":
        if not isinstance(target, PerReplica):
            raise _mismatch(tree.path, tree.describe(), _describe_target(target))
        check_target(tree.children[0][1], target.values, stacked=True)
        return
    pairs = None if is_distributed(target) else children(target)
    if pairs is None:
        raise _mismatch(tree.path, tree.describe(), _describe_target(target))
    saved_keys = [_key_str(e) for e, _ in tree.children]
    target_keys = [_key_str(e) for e, _ in pairs]
    if saved_keys != target_keys:
        raise _key_mismatch(tree, pairs, saved_keys, target_keys)
    for (_, child), (_, sub) in zip(tree.children, pairs):
        check_target(child, sub, stacked)


def fit_metrics(tree: Tree, target: PyTree, n: int) -> PyTree:
    """Returns `target` with each NNX metric `Variable` holding the kind of state saved there.

    A metric updated by a replicated function holds sync-on-read `MetricComponents`; a target
    made by `nnx.eval_shape` (or a metric not yet updated) holds a plain value there, and a
    live metric holds components where a fresh one was saved. Such a `Variable` of the target
    takes the saved kind: components of `n` replicas (the saved ones on the replica count
    that saved them; else placed as `MetricComponents` takes a value: replica 0's component
    is the saved total, the others zero, so reading is exact) or a plain leaf of one
    component's shape. Every other part of `target` is kept.
    """
    nnx = sys.modules.get("flax.nnx")
    if nnx is None or target is None:
        return target
    state = nnx.metrics.MetricState
    is_state = lambda x: isinstance(x, state)  # noqa: E731
    if not any(is_state(x) for x in jax.tree.leaves(target, is_leaf=is_state)):
        return target
    saved = {jax.tree_util.keystr(node.path): node for node in _nodes(tree)}

    def one(path: tuple, x: PyTree) -> PyTree:
        pairs = children(x) if is_state(x) else None
        if not pairs or len(pairs) != 1:
            return x
        entry, value = pairs[0]
        node = saved.get(jax.tree_util.keystr(path + (entry,)))
        components = isinstance(value, SyncOnRead)
        if node is None or children(value if not components else value.value) is not None:
            return x  # not a metric's one array: left to check_target
        if node.kind == "sync_on_read":
            for leaf in node.leaves():
                leaf.metric = True
        if node.kind == "sync_on_read" and not components:
            stacked = jax.ShapeDtypeStruct((n,) + np.shape(value), _dtype(value))
            value = MetricComponents(stacked, node.aggregation)  # type: ignore[arg-type]
        elif node.leaf is not None and components:
            value = jax.ShapeDtypeStruct(np.shape(value.value)[1:], _dtype(value.value))
        else:
            return x
        variable = jax.tree.structure(x, is_leaf=lambda y: y is not x)
        return jax.tree.unflatten(variable, [value])

    return jax.tree_util.tree_map_with_path(one, target, is_leaf=is_state)


def _nodes(tree: Tree) -> list[Tree]:
    return [tree] + [node for _, child in tree.children for node in _nodes(child)]


def _dtype(x: PyTree) -> Any:
    dtype = getattr(x, "dtype", None)
    return dtype if dtype is not None else np.asarray(x).dtype


def _key_mismatch(tree: Tree, pairs: list, saved_keys: list, target_keys: list) -> ValueError:
    """Returns the error at the first key where the checkpoint's and target's containers differ."""
    i = next(i for i, (a, b) in enumerate(zip(saved_keys + [None], target_keys + [None])) if a != b)
    if i < len(saved_keys) and saved_keys[i] not in target_keys:
        entry, child = tree.children[i]
        there = f"no entry (target's keys there: {', '.join(target_keys) or 'none'})"
        return _mismatch(tree.path + (entry,), child.describe(), there)
    entry, sub = pairs[i]
    there = f"no entry (the checkpoint's keys there: {', '.join(saved_keys) or 'none'})"
    return _mismatch(tree.path + (entry,), there, _describe_target(sub))


def _check_leaf(leaf: Leaf, x: PyTree, stacked: bool) -> None:
    if isinstance(x, (bool, int, float, complex)) or leaf.kind == "python":
        if np.shape(x) != leaf.shape:
            raise _mismatch(leaf.path, f"a leaf ({leaf.describe()})", _describe_target(x))
        return
    shape = tuple(np.shape(x))
    if stacked:
        shape = shape[1:]  # target holds N components of its own strategy
    dtype = getattr(x, "dtype", None)
    name = _format.dtype_name(dtype) if dtype is not None else None
    if shape != leaf.shape or name != leaf.dtype_name:
        found = f"shape {shape} dtype {name}" + (" per replica" if stacked else "")
        raise _mismatch(leaf.path, f"a leaf ({leaf.describe()})", f"a leaf ({found})")


def check_replicas(tree: Tree, saved_n: int, n: int) -> None:
    """Raises `ValueError` when the tree holds per-replica leaves saved on another N."""
    if saved_n == n:
        return
    for leaf in tree.leaves():
        if leaf.kind == "stacked":
            where = jax.tree_util.keystr(leaf.path)
            what = "PerReplica" if leaf.aggregation is None else "SyncOnRead (aggregation NONE)"
            raise ValueError(
                f"jm.checkpoint.restore: the {what} value at path {where!r} was saved with "
                f"{saved_n} replicas and the strategy has {n}; per-replica components cannot "
                "be restored onto another replica count. Keep a mirrored value instead (for "
                "random keys: save one mirrored key and derive per-replica keys with "
                "strategy.split_key inside the run), or restore with the saved replica count."
            )


# --- placing -----------------------------------------------------------------------------------


def place(
    tree: Tree,
    arrays: dict[str, np.ndarray],
    strategy: MirroredStrategy,
    target: PyTree,
    saved_n: int,
    call: str = "jm.checkpoint.restore",
) -> PyTree:
    """Returns the restored state: `target`'s structure when given, else the saved plain containers.

    `saved_n` is the replica count that saved it: on that count a `SyncOnRead` leaf saved with
    its components gets them back as they were. A mirrored leaf is laid out by the strategy's
    rules (`Topology.leaf_sharding`, whatever layout saved it): at the path it has in the
    result, with `target`'s leaf (or the NNX `Variable` holding it) as its own metadata.
    """
    leaves = tree.leaves()
    likes = _target_leaves(target) if target is not None else _rebuilt_leaves(tree)
    as_saved = saved_n == strategy.num_replicas
    values = _place_leaves(leaves, likes, arrays, strategy, as_saved, call)
    # Weakly typed as saved (a `TrainState`'s step, made from a Python 0): the resumed step
    # compiles, and finds its persistent cache entries, as the uninterrupted run's did.
    values = [
        _shim.weakly_typed(x)
        if leaf.weak and isinstance(x, jax.Array) and not jax.typeof(x).weak_type
        else x
        for x, leaf in zip(values, leaves)
    ]
    if target is not None:
        return jax.tree.unflatten(jax.tree.structure(target), values)
    return _rebuild(tree, iter(values))


def _place_leaves(
    leaves: list[Leaf],
    likes: list[tuple[tuple, Any]],
    arrays: dict[str, np.ndarray],
    strategy: MirroredStrategy,
    as_saved: bool,
    call: str,
) -> list:
    """Returns the leaves' values, placed; `likes` holds each leaf's (path, leaf or `Variable`) in
    the result, which lay a mirrored leaf out."""
    n = strategy.num_replicas
    topology = strategy.topology
    out: list[Any] = [None] * len(leaves)
    placed: list[tuple[int, Any]] = []  # (index, layout)
    for i, leaf in enumerate(leaves):
        host = arrays[leaf.array]
        if leaf.kind == "numpy":  # the caller's own, writable copy
            out[i] = host[()] if leaf.scalar else np.array(host)
        elif leaf.kind == "python":
            out[i] = _format.PYTHON_TYPES[leaf.python](host.item())  # type: ignore[index]
        elif leaf.kind in ("mirrored", _sharded.KIND) and leaf.sharded:
            span = 1 if topology.is_emulated else topology.devices_per_replica
            out[i] = _sharded.pieces(host, n, span)
            placed.append((i, topology.pieces_sharding(out[i].shape[1])))
        elif leaf.kind in ("mirrored", _sharded.KIND):
            path, like = likes[i]
            if like is None:
                like = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype or host.dtype)
            out[i] = host
            placed.append((i, topology.leaf_sharding(path, like, call)))
        else:
            placed.append((i, topology.stacked))
            if leaf.components is not None and as_saved:  # as they were: bitwise resume
                out[i] = arrays[leaf.components]
            elif leaf.kind == "aggregated":
                out[i] = _components(leaf, host, n, call)
            else:
                out[i] = host
    if placed:
        indices, layouts = zip(*placed)
        values = _put([out[i] for i in indices], list(layouts), topology.process_count)
        for i, x in zip(indices, values):
            out[i] = x
    for i, leaf in enumerate(leaves):
        if leaf.key_impl is not None:
            out[i] = jax.random.wrap_key_data(out[i], impl=leaf.key_impl)
    return out


def _put(hosts: list[np.ndarray], shardings: list[Any], num_processes: int) -> list[jax.Array]:
    """Returns the host arrays (the whole values) placed, each with its sharding."""
    if num_processes == 1:
        # The host arrays are private to this restore, so device_put may reuse them.
        return jax.device_put(hosts, shardings)
    # Several processes: each places the parts on its own devices (every process read all).
    return [
        jax.make_array_from_callback(host.shape, sharding, lambda index, h=host: h[index])
        for host, sharding in zip(hosts, shardings)
    ]


def _target_leaves(target: PyTree) -> list[tuple[tuple, Any]]:
    """Returns (path, leaf) of each leaf of `target` in flattening order; a leaf that is an NNX
    `Variable`'s value comes with that `Variable` (its partitioning metadata)."""
    out = []
    for path, node in jax.tree_util.tree_flatten_with_path(target, is_leaf=is_variable)[0]:
        inner = jax.tree_util.tree_flatten_with_path(node)[0] if is_variable(node) else None
        if inner is None:
            out.append((path, node))
        else:
            out.extend((path + sub, node if len(inner) == 1 else x) for sub, x in inner)
    return out


def _rebuilt_leaves(tree: Tree, path: tuple = ()) -> list[tuple[tuple, Any]]:
    """Returns (path, None) of each leaf in the tree `_rebuild` makes of `tree`, in the saved order
    (a class node is a dict of its fields there, an NNX `Variable` its value)."""
    if tree.leaf is not None:
        return [(path, None)]
    if tree.kind in ("sync_on_read", "per_replica"):
        return _rebuilt_leaves(tree.children[0][1], path + (tree.children[0][0],))
    out = []
    for i, (entry, child) in enumerate(tree.children):
        if tree.variable and len(tree.children) == 1:
            key: tuple = ()
        elif tree.kind in ("list", "tuple"):
            key = (jax.tree_util.SequenceKey(i),)
        else:
            key = (jax.tree_util.DictKey(_format.entry_name(entry)),)
        out.extend(_rebuilt_leaves(child, path + key))
    return out


def _components(leaf: Leaf, value: np.ndarray, n: int, call: str) -> np.ndarray:
    """Returns N components whose aggregation is `value`, as `strategy.assign` places them.

    Raises:
      ValueError: an integer or bool SUM whose share per replica does not fit the dtype.
    """
    dtype = np.asarray(value).dtype if leaf.dtype is None else leaf.dtype
    aggregation = leaf.aggregation
    # jnp's, not np's: numpy does not count bfloat16 and the float8 types as floating.
    floating = bool(jnp.issubdtype(dtype, jnp.inexact))
    if aggregation is Aggregation.SUM and leaf.metric:
        # As `MetricComponents` takes a value: replica 0's component, zero elsewhere (the
        # sum is then exact for floats too).
        out = np.zeros((n,) + np.shape(value), dtype)
        out[0] = value
        return out
    if aggregation is Aggregation.SUM:
        if floating:
            each = (np.asarray(value, np.float64) / n).astype(dtype)
            return np.broadcast_to(each, (n,) + each.shape).copy()
        # Integers and bools: value // N each, the remainder spread one unit over the first
        # replicas (a bool SUM of v <= N: v replicas hold True).
        beyond = shares_beyond(value, n, dtype)
        if beyond is not None:
            (_, high), (least, most) = beyond
            where = jax.tree_util.keystr(leaf.path) or "<root>"
            read = np.asarray(value).max() if high > most else np.asarray(value).min()
            raise ValueError(
                f"{call}: the SyncOnRead (SUM) at {where} reads {read}, which {n} replicas "
                f"cannot hold in components of dtype {_format.dtype_name(dtype)} ({least} to "
                f"{most} each). Restore onto the replica count that saved it, or save the "
                "SyncOnRead with a wider dtype."
            )
        quotient, remainder = np.divmod(np.asarray(value, np.int64), n)
        ids = np.arange(n).reshape((n,) + (1,) * np.ndim(value))
        return (quotient[None] + (ids < remainder[None])).astype(dtype)
    if aggregation is Aggregation.MEAN and not floating:
        value = np.rint(value)  # an integer MEAN reads as a float: nearest, ties to even
    each = np.asarray(value).astype(dtype)
    return np.broadcast_to(each, (n,) + each.shape).copy()


def _rebuild(tree: Tree, values: PyTree) -> PyTree:
    if tree.leaf is not None:
        value = next(values)
        return Sharded(value, tree.leaf.shape) if tree.leaf.sharded else value
    if tree.kind == "sync_on_read":
        return SyncOnRead(_rebuild(tree.children[0][1], values), tree.aggregation)  # type: ignore[arg-type]
    if tree.kind == "per_replica":
        return PerReplica(_rebuild(tree.children[0][1], values))
    items = [(entry, _rebuild(child, values)) for entry, child in tree.children]
    if tree.variable and len(items) == 1:  # an NNX Variable: its value
        return items[0][1]
    if tree.kind == "none":
        return None
    if tree.kind in ("list", "tuple"):
        rebuilt = [value for _, value in items]
        return rebuilt if tree.kind == "list" else tuple(rebuilt)
    return {_format.entry_name(entry): value for entry, value in items}
