"""flax NNX objects as arguments of replica functions, with `nnx.jit`'s write-back semantics.

An `nnx.Module`, `nnx.Optimizer`, `nnx.Rngs`, `nnx.Variable` or metric passed to a replicated
function (directly, or inside a tuple, NamedTuple, list or dict argument) is a pytree whose
leaves are its `Variable`s' values. `ADAPTER` plugs them into `jm.replicate` through the
adapter interface (`jmirror._adapter`). Each call

1. finds the caller's `Variable` objects (`jax.tree_util` with the `Variable`s as leaves);
2. runs the step through a variant of the replica function (`_Entry`) that wraps the
   user's: it folds the replica id into every rng stream but `params`, starts metrics as
   sync-on-read components, calls the function, restores the streams' keys and returns the
   result with every `Variable`'s new value;
3. writes those values back into the caller's `Variable`s (their raw value, as flax's own
   `nnx.jit` applies its updates): a value proven identical on every replica comes back
   mirrored, a metric's state as sync-on-read `MetricComponents` (`jmirror._nnx_metrics`),
   any other value as a `PerReplica` (never replica 0's value).

Shared references (a `Variable` or a module reached through two paths) are found by identity
and made one object again inside the trace, so a change through one path is seen through the
other; the value is written back once. NNX objects that the function returns and that were
reached from its arguments come back as the caller's own objects.

Nothing here runs for calls without NNX objects: `ADAPTER.adapt` looks at the types of the
top-level arguments only (and of the items of tuple, list and dict arguments).
"""

from __future__ import annotations

import dataclasses
import operator
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax

from jmirror import _context, _mirrored_state, _nnx_metrics, _nnx_snapshot, _proof
from jmirror._adapter import Adapted, OutputLayout
from jmirror._arguments import flatten
from jmirror._backends import Output
from jmirror._call_warnings import argument_path
from jmirror._flax import BATCH_NORM
from jmirror._mirrored_state import Diverged, Traced
from jmirror._nnx_metrics import MetricComponents
from jmirror._topology import Declared
from jmirror._values import PyTree, Sharded, Structure, SyncOnRead, is_distributed

if TYPE_CHECKING:
    from flax.nnx import Variable

# Items of a container argument looked at by `_has_nodes` on every call; NNX objects deeper
# in the arguments, or past these, are found once per argument structure (`NnxAdapter.deep`).
_SCAN_ITEMS = 16
# The rng stream that draws identically on every replica.
PARAMS_STREAM = "params"


def _flax() -> Any:
    """Returns `flax.nnx` when it has been imported (no NNX object can exist before), else None."""
    return sys.modules.get("flax.nnx")


def _graph_types(nnx: types.ModuleType) -> tuple[type, ...]:
    return (nnx.Pytree, nnx.Variable)


def _has_nodes(args: tuple, kwargs: dict, static_argnums: tuple[int, ...]) -> bool:
    """Returns whether a call passes NNX objects (at the top level or one container deep).

    The fast path of every call: a set lookup per top-level argument whose type is known to
    hold no NNX object (arrays, `PerReplica`, numbers, ...).
    """
    if "flax.nnx" not in sys.modules:
        return False
    plain = _PLAIN_TYPES
    for i, a in enumerate(args):
        if type(a) not in plain and _holds(a) and i not in static_argnums:
            return True
    return bool(kwargs) and any(type(a) not in plain and _holds(a) for a in kwargs.values())


# Types that are neither NNX objects nor containers `_has_nodes` looks into.
_PLAIN_TYPES: set[type] = set()
_CONTAINERS = (tuple, list, dict)


# Per type: whether it is an NNX graph type (`nnx.Pytree` or `nnx.Variable`; `isinstance`
# against `nnx.Variable` runs a Python `__instancecheck__`, a dict lookup does not).
_IS_GRAPH_TYPE: dict[type, bool] = {}
_IS_VARIABLE_TYPE: dict[type, bool] = {}


def _is_graph(x: object) -> bool:
    t = type(x)
    known = _IS_GRAPH_TYPE.get(t)
    if known is None:
        known = _IS_GRAPH_TYPE[t] = isinstance(x, _graph_types(_flax()))
    return known


def _refuse_graph_only(
    nnx: types.ModuleType, name: str, flat: list[tuple[tuple, Any]], static: tuple
) -> None:
    """Raises a `TypeError` at an NNX object that is no JAX pytree (declared with
    `pytree=False`, as `nnx.Object` is): it reaches the trace as one static leaf, so nothing
    in it can be traced or written back. `flat`: the leaves of `([dynamic args], kwargs)`
    with their paths; `static`: the static positions."""
    for path, x in flat:
        if isinstance(x, nnx.Pytree) and not isinstance(x, nnx.Variable):
            raise TypeError(
                f"{name} got {type(x).__name__} at {argument_path(path, static)}, an "
                "NNX object that is not a JAX pytree (declared with pytree=False, as "
                "nnx.Object is): jm.replicate takes NNX objects through their pytree leaves to "
                "trace them and write their changes back. Declare the class without "
                "pytree=False (nnx.Module's default), or pass nnx.split(obj)'s state and "
                "nnx.merge it inside the function."
            )


def _is_variable(x: object) -> bool:
    t = type(x)
    known = _IS_VARIABLE_TYPE.get(t)
    if known is None:
        known = _IS_VARIABLE_TYPE[t] = isinstance(x, _flax().Variable)
    return known


def _holds(a: object) -> bool:
    if _is_graph(a):
        return True
    t = type(a)
    if not isinstance(a, _CONTAINERS):
        _PLAIN_TYPES.add(t)
        return False
    if isinstance(a, (tuple, list)):  # a NamedTuple too
        return any(_is_graph(x) for x in a[:_SCAN_ITEMS])
    return any(_is_graph(x) for _, x in zip(range(_SCAN_ITEMS), a.values()))


def _finds_graph(treedef: Structure, nnx: types.ModuleType) -> bool:
    """Returns whether `treedef` has an NNX object node (`nnx.Pytree`, or an `nnx.Variable`
    outside an `nnx.State`)."""
    data = treedef.node_data()
    if data is None or not isinstance(data[0], type):
        return False
    if issubclass(data[0], nnx.State):
        return False
    if issubclass(data[0], (nnx.Pytree, nnx.Variable)):
        return True
    return any(_finds_graph(child, nnx) for child in treedef.children())


# --- one call --------------------------------------------------------------------------------


class NnxAdapter:
    """The `jmirror._adapter.Adapter` of flax NNX objects: each call runs through an `_Entry`
    variant of the replica function (one per sharing pattern of the arguments' `Variable`s
    and objects), and its changes are written back into the caller's `Variable`s."""

    def adapt(
        self, args: tuple, kwargs: dict, static_argnums: tuple[int, ...], deep: bool = False
    ) -> Adapted | None:
        if not (deep or _has_nodes(args, kwargs, static_argnums)):
            return None
        dynamic = _dynamic(args, kwargs, static_argnums)
        variables, flat = _flat_arguments(args, kwargs, static_argnums)
        seen: dict[int, int] = {}
        aliases = []
        for k, v in enumerate(variables):
            first = seen.setdefault(id(v), k)
            if first != k:
                aliases.append((k, first))
        shared = _shared_nodes(dynamic) if aliases else ()
        variant = (tuple(aliases), shared)

        def make(fn: Callable[..., Any], name: str) -> _Entry:
            return _Entry(fn, static_argnums, *variant, name)

        def finish(out: tuple[Any, list[Any]]) -> PyTree:
            return _write_back(dynamic, variables, variant[0], out)

        def check(traced: Traced) -> list[Diverged]:
            return _check_mirrored(traced, variant[0])

        def settle(first_component: Callable[[Any], Any]) -> None:
            _settle_metrics(dynamic, variables, first_component)

        return Adapted(variant, make, finish, check, settle, flat, shared=bool(aliases))

    def deep(self, in_treedef: Structure) -> bool:
        """Returns whether arguments of this structure hold NNX objects `_has_nodes` does not
        look at (deeper than one container, or past its first items): `Variable`s outside an
        `nnx.State` (what `nnx.split` gives is threaded through a step functionally)."""
        nnx = _flax()
        return nnx is not None and _finds_graph(in_treedef, nnx)

    def leaf_policy(self, node_type: type) -> None:
        """Returns None: an NNX object's leaves follow `jax.jit`'s rule."""
        return None


ADAPTER = NnxAdapter()


def _settle_metrics(
    dynamic: tuple, variables: list[Any], first_component: Callable[[Any], Any]
) -> None:
    """Sets fresh metric state (not yet sync-on-read) as the components a step writes back: its
    value on replica 0 and zero elsewhere, which reads as the same value."""
    roles = _nnx_metrics.metric_roles(_flax(), dynamic)
    for k, aggregation in roles.items():
        variable = variables[k]
        value = variable.get_raw_value()
        if not isinstance(value, SyncOnRead):
            _set_raw_value(variable, MetricComponents(first_component(value), aggregation))


def _check_mirrored(traced: Traced, aliases: tuple) -> list[Diverged]:
    """Refuses a step whose written-back `Variable`s would lose their mirroring: each
    that entered mirrored and comes back per replica, unless
    `per_replica=` matches it, with the fix its type and owner call for. Then checks the
    rest of the result as any step's (dataclass state refused, plain pytrees returned for
    the warning): NNX objects among the arguments switch nothing off."""
    nnx = _flax()
    dynamic, kwargs = traced.inputs
    root = (list(dynamic), kwargs)
    flat = jax.tree_util.tree_flatten_with_path(root, is_leaf=_is_variable)[0]
    found = [(p, x) for p, x in flat if _is_variable(x)]
    duplicate = {k for k, _ in aliases}
    unique = [(p, x) for k, (p, x) in enumerate(found) if k not in duplicate]
    values = traced.result[1]
    per_replica = traced.per_replica
    matches = None if per_replica is None else nnx.filterlib.to_predicate(per_replica)
    diverged = []
    for (path, variable), value in zip(unique, values):
        before = jax.tree_util.tree_leaves(variable.get_raw_value(), is_leaf=is_distributed)
        if any(is_distributed(x) for x in before):
            continue  # entered per replica (or sync-on-read): nothing to keep
        after = jax.tree_util.tree_leaves(value, is_leaf=is_distributed)
        if not any(traced.diverged(x) for x in after):
            continue
        if matches is not None and matches(_nnx_path(path[2:]), variable):
            continue
        owners = _owners(root, path)
        owner = type(owners[-1]).__name__ if owners else "the arguments"
        what = f"nnx.{type(variable).__name__} of {owner}"
        diverged.append(Diverged(traced.argument_path(path), what, _cause(nnx, variable, owners)))
    _mirrored_state.refuse(traced.name, diverged)
    # The user's own result, NNX objects in it stood for by references (no leaves).
    return _mirrored_state.check_returned(dataclasses.replace(traced, result=traced.result[0]))


def _owners(root: PyTree, path: tuple) -> list[Any]:
    """Returns the NNX objects on the way to the leaf at `path`, outermost first."""
    node, owners = root, []
    for key in path[:-1]:
        node = _child(node, key)
        if _is_graph(node):
            owners.append(node)
    return owners


def _cause(nnx: types.ModuleType, variable: object, owners: list[Any]) -> str | None:
    """Returns why a `Variable` would diverge, where the message has a fix for it."""
    owner = owners[-1] if owners else None
    if isinstance(owner, nnx.BatchNorm) and getattr(owner, "axis_name", None) is None:
        return BATCH_NORM
    if isinstance(variable, nnx.Param) or any(isinstance(o, nnx.Optimizer) for o in owners):
        return _mirrored_state.GRADIENTS
    return None


def _nnx_path(path: tuple) -> tuple:
    """Returns a `jax.tree_util` key path as NNX filters see paths: attribute names, indices,
    keys."""
    keys = []
    for key in path:
        if isinstance(key, jax.tree_util.GetAttrKey):
            keys.append(key.name)
        elif isinstance(key, jax.tree_util.SequenceKey):
            keys.append(key.idx)
        else:
            keys.append(getattr(key, "key", key))
    return tuple(keys)


def _write_back(dynamic: tuple, variables: list[Any], aliases: tuple, out: tuple) -> PyTree:
    """Writes a step's new values into the caller's `Variable`s; the step's own result, with
    the NNX objects it returned from the arguments resolved to the caller's."""
    result, values, _ = out
    unique = variables
    if aliases:
        duplicate = {k for k, _ in aliases}
        unique = [v for k, v in enumerate(variables) if k not in duplicate]
    for variable, value in zip(unique, values):
        if type(value) is SyncOnRead:
            value = MetricComponents(value.value, value.aggregation)
        _set_raw_value(variable, value)
    if any(type(r) is _Ref for r in jax.tree_util.tree_leaves(result, is_leaf=_is_ref)):
        tops = _tops(dynamic)
        result = jax.tree.map(
            lambda r: r.resolve(tops) if isinstance(r, _Ref) else r, result, is_leaf=_is_ref
        )
    return result


def _shared_nodes(root: PyTree) -> tuple[tuple[tuple, tuple], ...]:
    """Returns `(path, first path)` for every NNX object reached again after its first path (depth
    first, in flattening order); only called when some `Variable` is reached twice."""
    seen: dict[int, tuple] = {}
    found: list[tuple[tuple, tuple]] = []

    def walk(node: PyTree, path: tuple) -> None:
        children = jax.tree_util.tree_flatten_with_path(
            node, is_leaf=lambda x: x is not node and _is_graph(x)
        )[0]
        for p, child in children:
            if not _is_graph(child):
                continue
            where = path + tuple(p)
            first = seen.get(id(child))
            if first is not None:
                found.append((where, first))
            else:
                seen[id(child)] = where
                if not _is_variable(child):
                    walk(child, where)

    walk(root, ())
    return tuple(found)


def _set_raw_value(variable: Variable, value: PyTree) -> None:
    """Calls `variable.set_raw_value(value)` outside any trace, without its per-call trace check
    (as flax's own `nnx.jit` applies its updates); `set_raw_value` where that slot is gone."""
    if isinstance(getattr(type(variable), "_raw_value", None), types.MemberDescriptorType):
        object.__setattr__(variable, "_raw_value", value)
    else:
        variable.set_raw_value(value)


def _dynamic(args: tuple, kwargs: dict, static_argnums: tuple[int, ...]) -> tuple[list, dict]:
    return [a for i, a in enumerate(args) if i not in static_argnums], kwargs


def _flat_arguments(
    args: tuple, kwargs: dict, static_argnums: tuple[int, ...]
) -> tuple[list[Any], dict[int | str, tuple[list[Any], Structure]]]:
    """Flattens a call's dynamic arguments once: returns their `Variable`s (in flattening
    order: the positional arguments, then the keyword arguments) and, per positional argument
    and for the keyword arguments, the leaves and structure `jax.tree_util.tree_flatten`
    gives (`Adapted.flat`).

    Each argument is flattened whole (an NNX object's own flatten runs in Python, once); its
    `Variable`s are then taken by the `_Finder` of its structure, which follows the paths
    where the first argument of that structure had them. Equal structures are handed on as
    one object, which `Arguments.prepare` looks its layout up by. An NNX object argument
    whose graph did not change since the last call is not flattened again: its leaves and
    structure come from its snapshot (`jmirror._nnx_snapshot`).
    """
    variables: list[Any] = []
    flat: dict[int | str, tuple[list[Any], Structure]] = {}
    parts: list[tuple[int | str, Any]] = [
        (i, a) for i, a in enumerate(args) if i not in static_argnums
    ]
    parts.append(("kwargs", kwargs))
    for where, value in parts:
        unchanged = _nnx_snapshot.known(value)
        if unchanged is not None:
            leaves, structure, found = unchanged
        else:
            leaves, structure = flatten(value)
            known = _FINDERS.get(structure)
            if known is None:
                if len(_FINDERS) >= _FINDERS_KEPT:
                    _FINDERS.clear()
                known = _FINDERS[structure] = (structure, _Finder.of(value))
            structure, finder = known  # the first equal structure: one object for equal ones
            found = finder(value)
            if _is_graph(value):
                _nnx_snapshot.take(_flax(), value, leaves, structure, found)
        variables.extend(found)
        flat[where] = (leaves, structure)
    return variables, flat


class _Finder:
    """Takes the `Variable`s out of any value of one structure, in flattening order.

    Equal structures have the same node types, attribute names, keys and lengths, so the
    paths to the `Variable`s of one value lead to those of every value of its structure.
    The paths are followed as a tree: each node on the way is reached once, through the
    instance `__dict__` of an NNX object (what its flatten reads), and items of sequences
    and mappings or fields of NamedTuples and dataclasses elsewhere. A structure whose paths
    cannot be followed that way (a node keyed by flat index, or another node, whose keys may
    only label its children) is searched by flattening it each call.
    """

    __slots__ = ("steps", "outputs")

    def __init__(self, steps: tuple, outputs: tuple[int, ...]):
        # steps: (index of the node the step starts from, how it reaches the child); node 0
        # is the value. outputs: the nodes that are the `Variable`s.
        self.steps, self.outputs = steps, outputs

    def __call__(self, value: PyTree) -> list[Any]:
        nodes = [value]
        for parent, child in self.steps:
            nodes.append(child(nodes[parent]))
        return [nodes[i] for i in self.outputs]

    @classmethod
    def of(cls, value: PyTree) -> Callable[[PyTree], list[Any]]:
        """Returns the finder of `value`'s structure, checked against a search of `value`."""
        found = jax.tree_util.tree_flatten_with_path(value, is_leaf=_is_variable)[0]
        found = [(path, x) for path, x in found if _is_variable(x)]
        if not found:
            return _no_variables
        steps: list[tuple[int, Callable[[Any], Any]]] = []
        reached: dict[tuple, tuple[int, Any]] = {(): (0, value)}
        outputs = []
        for path, _ in found:
            for depth in range(1, len(path) + 1):
                if path[:depth] in reached:
                    continue
                parent, node = reached[path[: depth - 1]]
                child = _child_getter(node, path[depth - 1])
                if child is None:
                    return _search
                try:
                    reached[path[:depth]] = (len(steps) + 1, child(node))
                except (AttributeError, LookupError, TypeError):
                    return _search  # a key that only labels the child
                steps.append((parent, child))
            outputs.append(reached[path][0])
        finder = cls(tuple(steps), tuple(outputs))
        taken = finder(value)
        if len(taken) != len(found) or any(a is not b for a, (_, b) in zip(taken, found)):
            return _search
        return finder


def _child_getter(node: PyTree, key: Any) -> Callable[[Any], Any] | None:
    """Returns how to reach the child of `node` at a `jax.tree_util` key, or None."""
    if _is_graph(node):
        name = getattr(key, "name", None)
        if name is None:
            name = getattr(key, "idx", None)
        if name is None or str(name) not in vars(node):
            return None
        name = str(name)
        return lambda n: vars(n)[name]
    # Elsewhere only the containers whose keys are known to name their children: another
    # node's keys may be labels of its own (a custom node keyed `a` that stores `_a`).
    if isinstance(key, jax.tree_util.GetAttrKey) and key.name in _field_names(node):
        return operator.attrgetter(key.name)
    if isinstance(key, jax.tree_util.SequenceKey) and isinstance(node, Sequence):
        return operator.itemgetter(key.idx)
    if isinstance(key, jax.tree_util.DictKey) and isinstance(node, Mapping):  # nnx.State too
        return operator.itemgetter(key.key)
    return None  # a flat index or a label: nothing known names the child


def _field_names(node: object) -> tuple[str, ...]:
    """Returns the fields of a NamedTuple or dataclass (optax's states, flax structs), whose
    keys are their attribute names; none for other nodes."""
    if isinstance(node, tuple):
        return getattr(type(node), "_fields", ())
    fields = getattr(type(node), "__dataclass_fields__", None)
    return tuple(fields) if fields is not None else ()


def _no_variables(value: PyTree) -> list[Any]:
    return []


def _search(value: PyTree) -> list[Any]:
    """Returns `value`'s `Variable`s by flattening it with them as leaves."""
    return [x for x in jax.tree_util.tree_leaves(value, is_leaf=_is_variable) if _is_variable(x)]


# Each argument structure met (the first object of it) and its `Variable` finder.
_FINDERS: dict[Structure, tuple[Structure, Callable[[PyTree], list[Any]]]] = {}
_FINDERS_KEPT = 256


def _tops(dynamic: tuple) -> list[Any]:
    """Returns the outermost NNX objects of the arguments, in flattening order."""
    leaves = jax.tree_util.tree_leaves(dynamic, is_leaf=_is_graph)
    return [x for x in leaves if _is_graph(x)]


@jax.tree_util.register_pytree_node_class
class _Ref:
    """A returned NNX object that was reached from the arguments: no leaves, a path."""

    def __init__(self, top: int, path: tuple):
        self.top, self.path = top, path

    def tree_flatten(self):
        return (), (self.top, self.path)

    @classmethod
    def tree_unflatten(cls, aux: tuple, children: tuple) -> _Ref:
        return cls(*aux)

    def resolve(self, tops: list[Any]) -> PyTree:
        node = tops[self.top]
        for key in self.path:
            # An index is an item (of a list, or of an `nnx.List`, which keys items so too).
            if isinstance(node, (list, tuple, dict)) or not isinstance(key, str):
                node = node[key]
            else:
                node = getattr(node, key)
        return node


def _is_ref(x: object) -> bool:
    return isinstance(x, _Ref)


# --- inside the trace ----------------------------------------------------------------------


class _Entry:
    """The replica function of the NNX variant: the user's, with NNX state in and out."""

    # Slots: `functools.update_wrapper` in `Replicated` would copy a `__dict__` over its own.
    __slots__ = (
        "user_fn",
        "static",
        "aliases",
        "shared",
        "name",
        "__name__",
        "__qualname__",
    )

    def __init__(
        self, fn: Callable[..., Any], static: tuple, aliases: tuple, shared: tuple, name: str
    ):
        self.user_fn, self.static, self.name = fn, static, name
        # `aliases`: (k, i) when argument Variable k is Variable i; `shared`: (path, first
        # path) of the NNX objects reached twice, made one object again inside the trace.
        self.aliases, self.shared = aliases, shared
        self.__name__ = getattr(fn, "__name__", "replica_fn")
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)

    def __call__(self, *args: PyTree, **kwargs: PyTree) -> tuple[Any, list[Any], OutputLayout]:
        nnx = _flax()
        arguments = list(args)
        dynamic = [i for i in range(len(arguments)) if i not in self.static]
        root = ([arguments[i] for i in dynamic], kwargs)
        is_variable = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
        flat = jax.tree_util.tree_flatten_with_path(root, is_leaf=is_variable)[0]
        found = [(p, x) for p, x in flat if isinstance(x, nnx.Variable)]
        _refuse_graph_only(nnx, self.name, flat, self.static)
        for path, first in self.shared:
            _set_at(root, path, _get_at(root, first))
        for j, i in self.aliases:
            _set_at(root, found[j][0], found[i][1])
        for i, x in zip(dynamic, root[0]):
            arguments[i] = x
        variables = [x for _, x in found]
        before = jax.tree_util.tree_structure(root, is_leaf=is_variable)
        replica_id = _context.replica_context().replica_id
        roles = _nnx_metrics.metric_roles(nnx, root)
        for k in roles:
            _nnx_metrics.start_metric(variables[k], replica_id)
        folded = _fold_streams(nnx, root, replica_id)
        refs = _refs_of(nnx, root)
        sharded = [(v, v.get_raw_value()) for v in variables]
        sharded = [(v, x) for v, x in sharded if isinstance(x, Sharded)]
        result = self.user_fn(*arguments, **kwargs)
        for variable, before in sharded:
            _keep_sharded(variable, before, self.name)
        for variable, original, key in folded:
            variable.set_raw_value(_restore_key(variable.get_raw_value(), original, key))
        after_flat, after = jax.tree_util.tree_flatten(root, is_leaf=is_variable)
        if after != before:
            raise ValueError(
                f"{self.name} changed the structure of its NNX arguments (a Variable or "
                "submodule added, removed or replaced by another kind, or a static attribute "
                "changed); jm.replicate writes back the values of the Variables that existed "
                "before the call. Create every Variable and set static attributes (such as "
                "model.train() / model.eval()) before calling the replicated function."
            )
        after_vars = [x for x in after_flat if isinstance(x, nnx.Variable)]
        duplicate = {j for j, _ in self.aliases}
        values, written = [], []
        for k, variable in enumerate(after_vars):
            if k in duplicate:
                continue
            value = variable.get_raw_value()
            if k in roles:
                value = SyncOnRead(value, roles[k])
            values.append(value)
            declared = Declared.of(variable, getattr(value, "shape", ()))
            written.append((_leaf_path(found[k][0], variable), declared))
        if refs:
            result = jax.tree.map(
                lambda x: refs.get(id(x), x),
                result,
                is_leaf=lambda x: isinstance(x, _graph_types(nnx)),
            )
        return result, values, _Written(written)


class _Written(OutputLayout):
    """The layout of a variant's outputs: per written-back value, the argument path of its
    Variable's leaf and what the Variable declares."""

    def __init__(self, written: list[tuple[tuple, Declared]]):
        self.written = written

    def output_path(self, path: tuple) -> Any:
        """Returns what the flat output at `path` of `(result, values, layout)` stands for,
        as the layout rules see it: a written-back value is its Variable's leaf, at its
        argument path and with the Variable's own sharding metadata (so that the state comes
        back laid out as it went in); the result's leaves are the user's result's."""
        if path[:1] == (jax.tree_util.SequenceKey(1),) and len(path) >= 2:
            where, declared = self.written[path[1].idx]
            return Output(where + tuple(path[2:]), declared if len(path) == 2 else None)
        return tuple(path[1:])


def _leaf_path(variable_path: tuple, variable: Variable) -> tuple:
    """Returns the path of a Variable's array leaf as the arguments' flattening gives it (the
    Variable's own key, `.value`, appended), without the `(arguments, kwargs)` prefix."""
    own = jax.tree_util.tree_flatten_with_path(variable)[0]
    return tuple(variable_path[2:]) + (tuple(own[0][0]) if len(own) == 1 else ())


def _keep_sharded(variable: Variable, before: Sharded, name: str) -> None:
    """Makes a `Variable` that held a `jm.Sharded` (`jm.shard_update`'s state, as in an
    `nnx.Optimizer`'s `opt_state`) hold one again when flax wrote the new pieces back as a
    mapping (`nnx.Optimizer.update` rebuilds its state with `nnx.state`, which takes the
    `Sharded` node apart into `{"shards": pieces}`)."""
    after = variable.get_raw_value()
    if isinstance(after, Sharded):
        return
    leaves = jax.tree_util.tree_leaves(after)
    shape = getattr(before.shards, "shape", None)
    if len(leaves) == 1 and getattr(leaves[0], "shape", None) == shape:
        variable.set_raw_value(Sharded(leaves[0], before.shape))
        return
    raise TypeError(
        f"{name}: an NNX Variable held a jm.Sharded piece of shape {shape} (jm.shard_update's "
        f"state) and the function replaced it by {type(after).__name__} with leaf shapes "
        f"{[getattr(x, 'shape', None) for x in leaves]}; the state of jm.shard_update must "
        "keep its pieces. Update it with tx.update inside the replicated function and keep "
        "the state it returns."
    )


def _set_at(root: PyTree, path: tuple, value: PyTree) -> None:
    """Sets the item or attribute at a `jax.tree_util` path of `root` (lists, dicts, NNX)."""
    node = root
    for key in path[:-1]:
        node = _child(node, key)
    key = path[-1]
    if isinstance(key, jax.tree_util.GetAttrKey):
        setattr(node, key.name, value)
    else:
        node[key.idx if isinstance(key, jax.tree_util.SequenceKey) else key.key] = value


def _get_at(root: PyTree, path: tuple) -> PyTree:
    node = root
    for key in path:
        node = _child(node, key)
    return node


def _child(node: PyTree, key: Any) -> PyTree:
    if isinstance(key, jax.tree_util.GetAttrKey):
        return getattr(node, key.name)
    if isinstance(key, jax.tree_util.SequenceKey):
        return node[key.idx]
    return node[key.key]


def _refs_of(nnx: types.ModuleType, root: PyTree) -> dict[int, _Ref]:
    """Returns, for every NNX object reachable from the arguments, the `_Ref` that names it."""
    kinds = _graph_types(nnx)
    leaves = jax.tree_util.tree_leaves(root, is_leaf=lambda x: isinstance(x, kinds))
    refs: dict[int, _Ref] = {}
    for t, top in enumerate(x for x in leaves if isinstance(x, kinds)):
        refs.setdefault(id(top), _Ref(t, ()))
        if isinstance(top, nnx.Variable):
            continue
        for path, node in nnx.iter_graph(top):
            if isinstance(node, kinds):
                refs.setdefault(id(node), _Ref(t, tuple(path)))
    return refs


# --- rng streams -----------------------------------------------------------------------------


def _fold_streams(
    nnx: types.ModuleType, root: PyTree, replica_id: jax.Array
) -> list[tuple[Any, Any, Any]]:
    """Folds the replica id into the key of every rng stream but `params` (once per key)."""
    leaves = jax.tree_util.tree_leaves(root, is_leaf=lambda x: isinstance(x, nnx.RngStream))
    folded, seen = [], set()
    for stream in leaves:
        if not isinstance(stream, nnx.RngStream) or stream.tag == PARAMS_STREAM:
            continue
        variable = stream.key
        if id(variable) in seen:
            continue
        seen.add(id(variable))
        original = variable.get_raw_value()
        key = _fold_in(original, replica_id)
        variable.set_raw_value(key)
        folded.append((variable, original, key))
    return folded


def _restore_key(written: jax.Array, original: jax.Array, folded: jax.Array) -> jax.Array:
    """Returns a stream's key after the user's function: the original where the function left the
    folded key as it was (also through `nnx.jit`, `nnx.remat` and other transforms, which
    write back a new value: the proof decides, `jmirror._proof.restore_key`), else the key
    the function set (a reseed)."""
    if written is folded:
        return original
    kind = (getattr(written, "shape", None), getattr(written, "dtype", None))
    if kind != (folded.shape, folded.dtype):
        return written  # not a key like the stream's: the function's own
    return _proof.restore_key(written, original, folded)


def _fold_in(key: jax.Array, data: jax.Array) -> jax.Array:
    """Returns `key` (typed keys of any shape, or raw `uint32` key data whose last axis is one
    key's words, as `jax.random.PRNGKey` gives) with `data` folded into each key."""
    typed = jax.numpy.issubdtype(key.dtype, jax.dtypes.prng_key)
    if key.ndim == (0 if typed else 1):
        return jax.random.fold_in(key, data)
    flat = key.reshape(-1) if typed else key.reshape(-1, key.shape[-1])
    return jax.vmap(jax.random.fold_in, in_axes=(0, None))(flat, data).reshape(key.shape)


# --- reading -------------------------------------------------------------------------------


def holds_metrics(tree: PyTree) -> bool:
    """Returns whether `tree` holds NNX objects (metrics among them) at its top or one container
    deep."""
    return _flax() is not None and _holds(tree)
