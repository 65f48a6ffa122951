"""Flattens an NNX object argument without flax's Python flatten when nothing in it changed.

flax flattens each NNX object in Python (`Pytree._pytree__flatten`, a few microseconds per
object), so flattening a model of a few layers costs more than the rest of a replicated call.
What that flatten reads is, per object, its attribute names, its static attributes and its
child nodes (its `vars`), and per `Variable` its metadata and its value. A `Snapshot` of an
argument keeps those: a later call with the same object whose graph still matches it in
every one of them (the same keys; static attributes equal, as the structure compares them;
the same child objects) has the structure of the snapshot, and its leaves are its
`Variable`s' values.

A snapshot models only what it can check: NNX objects flattened by flax's own flatten,
`Variable`s holding one leaf, `nnx.State`s, dicts and lists (their keys or length and the same
items), tuples (immutable: the same tuple holds the same items) and nodes without leaves
(compared by their structure, as flattening them gives it). Anything else in the graph (a
class with a flatten of its own, a `Variable` holding a tree) and the argument is flattened on
every call, as before; the snapshot is also checked against a real flatten when it is taken.
The argument itself is held weakly: its snapshot goes when it does.
"""

from __future__ import annotations

import operator
import types
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from jmirror._arguments import flatten
from jmirror._values import PyTree, Structure

# Snapshots (or refusals) by the id of their argument; each entry holds a weak reference to it.
_SNAPSHOTS: dict[int, Snapshot | _Declined] = {}
_SNAPSHOTS_KEPT = 64
# Calls in a row whose snapshot missed (an argument changed before every call, a Variable
# replaced each step) after which the argument is flattened as before, without snapshots.
_MISSES_KEPT = 3


class Snapshot:
    """What one NNX object's flatten depends on, and the leaves and structure it gave."""

    __slots__ = (
        "root",
        "structure",
        "variables",
        "objects",
        "mappings",
        "lists",
        "metadata",
        "leafless",
        "leaf_types",
        "misses",
    )

    def __init__(self, root: weakref.ref, structure: Structure, variables: list[Any]):
        self.root, self.structure, self.variables = root, structure, variables
        # objects: (NNX object, or None for the root, held weakly; its type; its attribute
        # names; a getter of its static attributes and their values; a getter of its child
        # nodes and the children); mappings: (dict or nnx.State, keys, getter of the values,
        # values); lists: (list, items); metadata: (Variable, its type, its metadata);
        # leafless: (node, its structure).
        self.objects: list[tuple] = []
        self.mappings: list[tuple] = []
        self.lists: list[tuple[list, tuple]] = []
        self.metadata: list[tuple[Any, type, dict]] = []
        self.leafless: list[tuple[PyTree, Structure]] = []
        self.leaf_types: frozenset[type] = frozenset()
        self.misses = 0  # the calls in a row before this one whose snapshot missed

    def leaves(self, root: PyTree) -> list[Any] | None:
        """Returns the leaves of `root` when its graph still matches, else None."""
        try:
            for obj, kind, names, statics, static_values, nodes, children in self.objects:
                obj = root if obj is None else obj
                attributes = vars(obj)
                if (
                    type(obj) is not kind
                    or attributes.keys() != names
                    or statics(attributes) != static_values
                    or not all(map(operator.is_, nodes(attributes), children))
                ):
                    return None
            for holder, names, items, children in self.mappings:
                mapping = holder._mapping if type(holder) is not dict else holder
                if mapping.keys() != names or not all(map(operator.is_, items(mapping), children)):
                    return None
            for sequence, children in self.lists:
                if len(sequence) != len(children) or not all(map(operator.is_, sequence, children)):
                    return None
            for variable, kind, metadata in self.metadata:
                if type(variable) is not kind or variable._var_metadata != metadata:
                    return None
            for node, structure in self.leafless:
                leaves, found = flatten(node)
                if leaves or found != structure:
                    return None
            # Values change every call (a step's write-back): each must still be one leaf.
            values = [variable._raw_value for variable in self.variables]
        except Exception:  # a comparison that raises (an array as metadata): flattened each call
            _SNAPSHOTS[id(root)] = _Declined(self.root, self.structure)
            return None
        types = self.leaf_types
        if not all(type(x) in types for x in values):
            return None
        return values


class _Declined:
    """An argument the snapshot does not model, with the structure it had then."""

    __slots__ = ("root", "structure")

    def __init__(self, root: weakref.ref, structure: Structure):
        self.root, self.structure = root, structure


def known(value: PyTree) -> tuple[list[Any], Structure, list[Any]] | None:
    """Returns the leaves, structure and `Variable`s of `value` from its snapshot, or None
    (no snapshot of it, or its graph changed since)."""
    snapshot = _SNAPSHOTS.get(id(value))
    if type(snapshot) is not Snapshot or snapshot.root() is not value:
        return None
    leaves = snapshot.leaves(value)
    if leaves is None:
        return None
    if snapshot.misses:
        snapshot.misses = 0
    return leaves, snapshot.structure, snapshot.variables


def take(
    nnx: types.ModuleType,
    value: PyTree,
    leaves: list[Any],
    structure: Structure,
    variables: list[Any],
) -> None:
    """Takes a snapshot of `value` (an NNX object other than a `Variable`), just flattened to
    `leaves` and `structure`, whose `Variable`s are `variables` in flattening order; keeps a
    refusal when the snapshot cannot model it, or when its snapshots missed `_MISSES_KEPT`
    calls in a row (tried again when its structure changes)."""
    if not isinstance(value, nnx.Pytree) or isinstance(value, nnx.Variable):
        return
    before = _SNAPSHOTS.get(id(value))
    if type(before) is _Declined and before.root() is value and before.structure is structure:
        return
    try:
        root = weakref.ref(value)
    except TypeError:
        return
    # Called after the check of `before` missed, when it is this argument's snapshot.
    misses = before.misses + 1 if type(before) is Snapshot and before.root() is value else 0
    snapshot = None
    if misses < _MISSES_KEPT:
        snapshot = _snapshot(nnx, root, value, leaves, structure, variables)
    if snapshot is not None:
        snapshot.misses = misses
    if len(_SNAPSHOTS) >= _SNAPSHOTS_KEPT:
        _SNAPSHOTS.clear()
    if before is None or before.root() is not value:
        # A snapshot holds the graph's objects: it goes when its argument does (and nothing
        # runs for it at exit).
        weakref.finalize(value, _forget, id(value)).atexit = False
    _SNAPSHOTS[id(value)] = snapshot if snapshot is not None else _Declined(root, structure)


def _forget(key: int) -> None:
    """Drops the entry of a collected argument (unless the id now belongs to another)."""
    entry = _SNAPSHOTS.get(key)
    if entry is not None and entry.root() is None:
        del _SNAPSHOTS[key]


def _snapshot(
    nnx: types.ModuleType,
    root: weakref.ref,
    value: PyTree,
    leaves: list[Any],
    structure: Structure,
    variables: list[Any],
) -> Snapshot | None:
    """Returns the snapshot of `value`, or None where its graph holds what it cannot check."""
    snapshot = Snapshot(root, structure, variables)
    stock_flatten = nnx.Pytree._pytree__flatten

    def walk(node: PyTree) -> tuple | None:
        """Records `node`; returns its children to walk, or None where it cannot be checked."""
        if isinstance(node, nnx.Variable):
            metadata = dict(node._var_metadata)
            if not _immutable(metadata.values()):
                return None
            snapshot.metadata.append((node, type(node), metadata))
            return ()
        if isinstance(node, nnx.Pytree):
            if type(node)._pytree__flatten is not stock_flatten:
                return None
            attributes = vars(node)
            is_node = node._pytree__nodes
            node_names = tuple(k for k in attributes if is_node.get(k, False))
            static_names = tuple(k for k in attributes if k not in node_names)
            statics, nodes = _getter(static_names), _getter(node_names)
            static_values = statics(attributes)
            if not _immutable(static_values):
                return None
            children = nodes(attributes)
            snapshot.objects.append(
                (
                    None if node is value else node,
                    type(node),
                    frozenset(attributes),
                    statics,
                    static_values,
                    nodes,
                    children,
                )
            )
            return children
        if isinstance(node, nnx.State) or type(node) is dict:
            mapping = getattr(node, "_mapping", node)  # a State's items: its dict
            if type(mapping) is not dict:
                return None
            items = _getter(tuple(mapping))
            children = items(mapping)
            snapshot.mappings.append((node, frozenset(mapping), items, children))
            return children
        if type(node) is list:
            snapshot.lists.append((node, tuple(node)))
            return tuple(node)
        if type(node) is tuple or (isinstance(node, tuple) and hasattr(type(node), "_fields")):
            return node  # immutable: the same tuple holds the same items
        below, found = flatten(node)
        if below:
            return None
        snapshot.leafless.append((node, found))
        return ()

    # A loop, not a recursive closure: a closure that calls itself is a reference cycle,
    # which would keep the argument alive until the garbage collector runs.
    seen: set[int] = set()
    pending = [value]
    try:
        while pending:
            node = pending.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            children = walk(node)
            if children is None:
                return None
            pending.extend(children)
        values = [variable._raw_value for variable in variables]
    except Exception:  # flax's internals not as modelled here
        return None
    # The snapshot's leaves must be the flatten's, one value per Variable in its order; and
    # what it recorded must have the structure given (another thread may have changed the
    # object between that flatten and the walk).
    if len(values) != len(leaves) or any(map(operator.is_not, values, leaves)):
        return None
    if flatten(value)[1] != structure:
        return None
    snapshot.leaf_types = frozenset(map(type, leaves))
    return snapshot


def _immutable(values: Iterable[object]) -> bool:
    """Returns whether every value can be hashed: a list, dict or set changed in place would
    compare equal to itself, where the structure holds another object's equal value."""
    try:
        for x in values:
            hash(x)
    except TypeError:
        return False
    return True


def _getter(names: tuple[str, ...]) -> Callable[[dict], tuple]:
    """Returns a function giving the values of `names` in a dict, as a tuple."""
    if not names:
        return lambda attributes: ()
    if len(names) == 1:
        (name,) = names
        return lambda attributes: (attributes[name],)
    return operator.itemgetter(*names)
