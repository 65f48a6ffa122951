"""Splits a replicated call's arguments into the leaves `jax.jit` traces and the static rest.

A call's arguments are flattened once, as `(donated args, other args, kwargs)` (the
positional arguments named by `static_argnums` and the keyword arguments named by
`static_argnames` set aside whole). Each leaf is then

- **traced** when it is an array (`jax.Array`, `np.ndarray`, a numpy scalar, a tracer) or,
  outside the nodes an adapter polices, a Python number or bool (as `jax.jit` traces them);
- **static** otherwise: a string, a callable, an enum, the functions of an optax
  `GradientTransformation`, and inside an adapter's nodes whatever its predicate refuses
  (an `eqx.Module`'s Python numbers: `eqx.is_array`).

Static leaves join the compilation key by equality and hash, as `static_argnums` do: a
`Plan` holds them (with the tree structures and the static arguments) and is interned, so
calls with equal statics share one `Plan` object, which `jax.jit` takes as a static argument
compared by identity. Per call this is one C++ flatten, one C-level pass over the leaves'
types and two dictionary lookups; the per-leaf work (predicates, hashing, paths) runs only
for structures that hold static leaves or policed nodes.

`Layout` is what a tree structure alone decides, once per structure: which flat leaves sit
inside a `PerReplica` / `SyncOnRead` / `Sharded` node (split over the replicas) and which
inside a policed node.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import jax
import jax.core
import numpy as np

from jmirror._values import PerReplica, Sharded, Structure, SyncOnRead

# Which leaves a node type's subtree traces: a predicate, or None for `jax.jit`'s own rule.
LeafPolicy = Callable[[type], "Callable[[Any], bool] | None"]
# Whether an adapter must take the calls of an arguments' structure (None: never).
DeepOf = Callable[[Any], bool] | None

_DISTRIBUTED_NODES = (PerReplica, SyncOnRead, Sharded)
# `jax.tree_util.tree_flatten` without its Python wrapper (one call per replicated call).
flatten = jax.tree_util.default_registry.flatten
_NUMBERS = (int, float, bool, complex)
# Leaf types `jax.jit` traces, and those it cannot (static here), learned as they are met.
_TRACED: set[type] = {*_NUMBERS, np.ndarray}
_STATIC: set[type] = set()


# What stands for an array: arrays, tracers, numpy scalars, and array shapes (an abstract
# target, `jax.eval_shape`'s).
_ARRAYS = (jax.Array, np.ndarray, np.generic, jax.core.Tracer, jax.ShapeDtypeStruct)


def is_array(x: Any) -> bool:
    """Returns whether `x` is an array leaf: a `jax.Array` (tracers included), an
    `np.ndarray`, a numpy scalar or a `jax.ShapeDtypeStruct`."""
    return isinstance(x, _ARRAYS)


def is_traced(x: Any) -> bool:
    """Returns whether `jax.jit` traces leaf `x`: an array, a Python number or a bool."""
    return _traced_type(type(x))


def _traced_type(t: type) -> bool:
    if t in _TRACED:
        return True
    if t in _STATIC:
        return False
    traced = issubclass(t, (*_ARRAYS, *_NUMBERS))
    (_TRACED if traced else _STATIC).add(t)
    return traced


def all_traced_types(types: set[type]) -> bool:
    """Returns whether every leaf type in `types` is traced (a C-level subset test once each
    type has been met)."""
    if types <= _TRACED:
        return True
    return all(map(_traced_type, types))


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
    """What one tree structure of a call's arguments decides about its flat leaves.

    Attributes:
      treedef: the structure of `(donated args, other args, kwargs)`.
      num_donated: how many of the flat leaves belong to the donated arguments (first).
      split: per flat leaf, whether it sits inside a distributed node (each replica gets
        its own slice).
      policies: per flat leaf, the predicate of the nearest policed node above it (None:
        `jax.jit`'s rule); None when no leaf sits inside a policed node.
      deep: whether a call of this structure that no adapter took holds an adapter's kind
        after all, beyond its quick look (`jmirror._adapter.deep`): it is adapted then.
      plans: the interned `Plan`s of this structure, by their static key.
    """

    treedef: Structure
    num_donated: int
    split: tuple[bool, ...]
    policies: tuple[Callable[[Any], bool] | None, ...] | None
    deep: bool = False
    plans: dict[Hashable, Plan] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, treedef: Structure, policy_of: LeafPolicy, deep_of: DeepOf = None) -> Layout:
        """Builds the layout of `treedef`, asking `policy_of(node_type)` for each node type
        and `deep_of(treedef)` whether an adapter must take its calls."""
        split: list[bool] = []
        policies: list[Callable[[Any], bool] | None] = []
        _walk(treedef, False, None, split, policies, policy_of)
        donated = treedef.children()[0].num_leaves
        policed = tuple(policies) if any(p is not None for p in policies) else None
        deep = deep_of is not None and deep_of(treedef)
        return cls(treedef, donated, tuple(split), policed, deep)

    def statics(self, leaves: list[Any], types: set[type]) -> tuple[tuple[int, Any], ...]:
        """Returns `(flat index, value)` for every static leaf of a call (empty: none)."""
        if self.policies is None:
            if all_traced_types(types):
                return ()
            return tuple((i, x) for i, x in enumerate(leaves) if not _traced_type(type(x)))
        return tuple(
            (i, x)
            for i, (x, policy) in enumerate(zip(leaves, self.policies))
            if not (policy(x) if policy is not None else _traced_type(type(x)))
        )


def _per_replica_at_leaves(treedef: Structure) -> Any:
    """Returns `treedef` with every `PerReplica` of a subtree pushed down to its leaves (the
    same leaves in the same order); `treedef` itself when it has none."""
    if not _has_per_replica_subtree(treedef):
        return treedef

    def push(node: Any) -> Any:
        if isinstance(node, PerReplica) and not node.is_component:
            return jax.tree.map(PerReplica, node.values)
        return node

    try:
        placeholders = treedef.unflatten(range(treedef.num_leaves))
        pushed = jax.tree.map(push, placeholders, is_leaf=lambda x: isinstance(x, PerReplica))
    except Exception:  # a node whose unflatten checks its children: keep it as it is
        return treedef
    return jax.tree.structure(pushed)


def _has_per_replica_subtree(treedef: Structure) -> bool:
    data = treedef.node_data()
    if data is None:
        return False
    children = treedef.children()
    if data[0] is PerReplica and data[1] is None and children[0].node_data() is not None:
        return True
    return any(_has_per_replica_subtree(child) for child in children)


def leaf_policies(treedef: Structure, policy_of: LeafPolicy) -> list[Callable[[Any], bool] | None]:
    """Returns, per leaf of `treedef`, the predicate of the nearest policed node above it."""
    split: list[bool] = []
    policies: list[Callable[[Any], bool] | None] = []
    _walk(treedef, False, None, split, policies, policy_of)
    return policies


def _walk(
    treedef: Structure,
    split: bool,
    policy: Callable[[Any], bool] | None,
    splits: list[bool],
    policies: list[Callable[[Any], bool] | None],
    policy_of: LeafPolicy,
) -> None:
    """Appends each leaf's split flag and policy under `treedef`, depth first."""
    data = treedef.node_data()
    if data is None:  # a leaf
        splits.append(split)
        policies.append(policy)
        return
    node_type = data[0]
    split = split or issubclass(node_type, _DISTRIBUTED_NODES)
    policy = policy_of(node_type) or policy
    for child in treedef.children():
        _walk(child, split, policy, splits, policies, policy_of)


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """One arrangement of a call's arguments: the structure and every static value.

    Interned per `Layout` (equal statics give the same object), so `jax.jit` compares it by
    identity. `rebuild` puts the traced leaves and the statics back into the arguments.

    Attributes:
      strategy: the strategy the call runs on.
      layout: the arguments' `Layout`.
      statics: `(flat index, value)` of the static leaves.
      static_args: the values of the `static_argnums` arguments, in order.
      static_kwargs: `(name, value)` of the `static_argnames` arguments given, sorted.
      positions: the `Positions` of the call.
    """

    strategy: Any
    layout: Layout
    statics: tuple[tuple[int, Any], ...]
    static_args: tuple[Any, ...]
    static_kwargs: tuple[tuple[str, Any], ...]
    positions: Positions

    def static_arguments(self) -> list[tuple[str, Any]]:
        """Returns `(where, value)` of the static arguments: `args[i]`, then `kwargs['name']`."""
        at = self.positions.static_argnums
        named = [(f"args[{i}]", value) for i, value in zip(at, self.static_args)]
        return named + [(f"kwargs[{k!r}]", value) for k, value in self.static_kwargs]

    def rebuild(
        self, donated: Sequence[Any], others: Sequence[Any], treedef: Structure = None
    ) -> tuple[tuple, dict]:
        """Returns the call's `(args, kwargs)` from its traced leaves (in `treedef`, the
        structure of a call's `(donated args, other args, kwargs)` with these leaves, when
        given: its own `PerReplica` nodes where the layout's have them at the leaves)."""
        leaves = [*donated, *others]
        for i, value in self.statics:
            leaves.insert(i, value)
        treedef = self.layout.treedef if treedef is None else treedef
        donated_args, other_args, kwargs = treedef.unflatten(leaves)
        if self.static_kwargs:
            kwargs = dict(kwargs, **dict(self.static_kwargs))
        groups = (iter(donated_args), iter(other_args), iter(self.static_args))
        return tuple(next(groups[g]) for g in self.positions.groups), kwargs


@dataclasses.dataclass(frozen=True)
class Positions:
    """Where each positional argument of a call goes: donated (0), other (1), static (2).

    Attributes:
      groups: per positional argument, its group.
    """

    groups: tuple[int, ...]

    @classmethod
    def of(cls, num_args: int, static_argnums: Sequence[int], donate_argnums: Sequence[int]):
        """Builds the positions of a call with `num_args` positional arguments."""
        return cls(
            tuple(
                2 if i in static_argnums else 0 if i in donate_argnums else 1
                for i in range(num_args)
            )
        )

    @property
    def static_argnums(self) -> tuple[int, ...]:
        """Returns the positions of the static arguments."""
        return tuple(i for i, g in enumerate(self.groups) if g == 2)

    def split(self, args: tuple) -> tuple[tuple, tuple, tuple]:
        """Returns `(donated args, other args, static args)`."""
        donated, others, static = self.take
        return donated(args), others(args), static(args)

    @functools.cached_property
    def take(self) -> tuple[Callable[[tuple], tuple], ...]:
        """Returns, per group, a function picking that group's arguments out of `args`."""
        return tuple(_picker(list(indices)) for indices in self.indices)

    @functools.cached_property
    def indices(self) -> tuple[tuple[int, ...], ...]:
        """Returns, per group, the positions of its arguments."""
        return tuple(tuple(i for i, g in enumerate(self.groups) if g == k) for k in range(3))

    @functools.cached_property
    def flat_order(self) -> tuple[int | str, ...]:
        """Returns the order of the arguments in the flat leaves: the donated positions, the
        other traced ones, then `"kwargs"`."""
        return (*self.indices[0], *self.indices[1], "kwargs")

    def where(self, path: Sequence[Any]) -> str:
        """Names a path into `(donated args, other args, kwargs)`: `args[i]...`, `kwargs[...]`."""
        group = path[0].idx
        if group == 2:
            return "kwargs" + jax.tree_util.keystr(tuple(path[1:]))
        index = [i for i, g in enumerate(self.groups) if g == group][path[1].idx]
        return f"args[{index}]" + jax.tree_util.keystr(tuple(path[2:]))


def _picker(indices: list[int]) -> Callable[[tuple], tuple]:
    """Returns a function giving the items at `indices` of a tuple, as a tuple."""
    if not indices:
        return lambda args: ()
    if indices == list(range(indices[-1] + 1)):  # a prefix (all of them, often)
        stop = indices[-1] + 1
        return lambda args: args[:stop]
    if len(indices) == 1:
        i = indices[0]
        return lambda args: (args[i],)
    return operator.itemgetter(*indices)


def check_hashable(
    name: str, tree: Any, statics: Sequence[tuple[int, Any]], positions: Positions
) -> None:
    """Raises a `TypeError` naming the first static leaf of `tree` (the flattened
    `(donated args, other args, kwargs)`) that cannot be hashed."""
    unhashable = set()
    for i, value in statics:
        try:
            hash(value)
        except TypeError:
            unhashable.add(i)
    if not unhashable:
        return
    for i, (path, leaf) in enumerate(jax.tree_util.tree_flatten_with_path(tree)[0]):
        if i in unhashable:
            raise TypeError(unhashable_message(name, positions.where(path), leaf))


def check_metadata(name: str, tree: Any, positions: Positions) -> None:
    """Raises a `TypeError` naming the first field of a dataclass node in `tree` that is not
    one of its pytree children (static metadata, as an `eqx.field(static=True)`) and holds an
    array or a value that cannot be hashed."""
    stack: list[tuple[tuple, Any]] = [((), tree)]
    while stack:
        path, node = stack.pop()
        below = functools.partial(operator.is_not, node)  # the node's children, one level
        children = jax.tree_util.tree_flatten_with_path(node, is_leaf=below)[0]
        if len(children) == 1 and children[0][1] is node:
            continue  # a leaf
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            named = {k[0].name for k, _ in children if k and hasattr(k[0], "name")}
            for field in dataclasses.fields(node):
                value = getattr(node, field.name, None)
                if field.name not in named and not _can_be_static(value):
                    where = positions.where((*path, jax.tree_util.GetAttrKey(field.name)))
                    raise TypeError(
                        f"{name}: the static field at {where} (not a pytree child: part of "
                        f"the structure, compared and hashed as a static argument of jax.jit "
                        f"is) holds a {type(value).__name__}, which cannot be compared or "
                        "hashed as static data. Make the field a regular one, so that its "
                        "array is traced (drop static=True), store a hashable value (a "
                        "tuple), or close over the value in the replicated function."
                    )
        stack.extend((path + k, child) for k, child in reversed(children))


def _can_be_static(value: Any) -> bool:
    if isinstance(value, (np.ndarray, jax.Array)):
        return False
    try:
        hash(value)
    except TypeError:
        return False
    return True


def unhashable_message(name: str, where: str, value: Any) -> str:
    """Returns the message of an unhashable static value at `where`."""
    return (
        f"{name}: the argument at {where} is a {type(value).__name__}, which is not an array, "
        "so it is static (part of the compilation key, as a static argument of jax.jit is), "
        "but it cannot be hashed. Make it hashable (define __hash__ and __eq__, or use a "
        "frozen dataclass or a tuple), or close over it in the replicated function instead "
        "of passing it."
    )


class Prepared(NamedTuple):
    """One call's arguments as its step takes them.

    Attributes:
      plan: the call's interned `Plan`.
      donated: the traced leaves of the donated arguments.
      others: the other traced leaves.
      tree: `(donated args, other args, kwargs)`, the arguments the leaves came from.
      given: `tree` as the caller passed it (before placement).
    """

    plan: Plan
    donated: tuple
    others: tuple
    tree: tuple
    given: tuple

    def arguments(self) -> tuple[tuple, dict]:
        """Returns the call's `(args, kwargs)` as the caller structured them (for messages:
        paths as the caller wrote them)."""
        given = jax.tree.structure(self.given)
        count = len(self.donated) + len(self.others) + len(self.plan.statics)
        # An adapter's arguments (NNX objects) flatten by its own rules: their layout's then.
        return self.plan.rebuild(
            self.donated, self.others, given if given.num_leaves == count else None
        )

    def with_leaves(self, leaves: list[Any]) -> Prepared:
        """Returns the same call with these flat leaves (statics included) instead."""
        layout = self.plan.layout
        traced, num_donated = _traced_leaves(layout, self.plan.statics, leaves)
        tree = layout.treedef.unflatten(leaves)
        donated, others = tuple(traced[:num_donated]), tuple(traced[num_donated:])
        return Prepared(self.plan, donated, others, tree, self.given)


class Arguments:
    """The argument handling of one replicated function: which positions and names are
    static or donated, and the layouts and plans of the structures met so far.

    Args:
      name: how errors name the replicated function.
      static_argnums: positional arguments that are static.
      static_argnames: keyword arguments that are static.
      donate_argnums: positional arguments whose buffers the step may reuse.
      policy_of: which leaves a node type's subtree traces (`jmirror._adapter.leaf_policy`).
      deep_of: whether an adapter must take calls of an arguments' structure
        (`jmirror._adapter.deep`).
    """

    def __init__(
        self,
        name: str,
        static_argnums: tuple[int, ...],
        static_argnames: tuple[str, ...],
        donate_argnums: tuple[int, ...],
        policy_of: LeafPolicy,
        deep_of: DeepOf = None,
    ):
        self.name = name
        self.static_argnums = static_argnums
        self.static_argnames = frozenset(static_argnames)
        self.donate_argnums = donate_argnums
        self._policy_of = policy_of
        self._deep_of = deep_of
        self._positions: dict[int, Positions] = {}
        self._layouts: dict[Any, Layout] = {}
        self._joined_layouts: dict[tuple[int, ...], tuple[tuple[Any, ...], Layout]] = {}

    def positions(self, num_args: int) -> Positions:
        """Returns the `Positions` of a call with `num_args` positional arguments."""
        positions = self._positions.get(num_args)
        if positions is None:
            positions = Positions.of(num_args, self.static_argnums, self.donate_argnums)
            self._positions[num_args] = positions
        return positions

    def prepare(
        self,
        strategy: Any,
        args: tuple,
        kwargs: dict,
        flat: dict[int | str, tuple[list[Any], Structure]] | None = None,
    ) -> tuple[Prepared, list, set]:
        """Splits a call's arguments into its plan and traced leaves (`flat`: the arguments
        already flattened, as an adapter gives them in `Adapted.flat`).

        Returns:
          The `Prepared` call, every flat leaf of its arguments (statics included) and the
          set of their types (what placement looks at).

        Raises:
          TypeError: a static leaf or argument cannot be hashed (naming its path).
        """
        positions = self.positions(len(args))
        donated, others, static_args = positions.split(args)
        static_kwargs: tuple = ()
        if self.static_argnames and not self.static_argnames.isdisjoint(kwargs):
            static_kwargs = tuple(
                sorted((k, v) for k, v in kwargs.items() if k in self.static_argnames)
            )
            kwargs = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        tree = (donated, others, kwargs)
        try:
            if flat is None or static_kwargs:
                leaves, treedef = flatten(tree)
                layout = self._layout(treedef)
            else:
                leaves, layout = self._joined(flat, positions)
        except (TypeError, ValueError):
            # Comparing or hashing structures compares their nodes' metadata (an equinox
            # module's static fields): an array there has no single truth value.
            check_metadata(self.name, tree, positions)
            raise
        types = set(map(type, leaves))
        statics = layout.statics(leaves, types)
        key = (id(strategy), statics, static_args, static_kwargs)
        if static_args or static_kwargs:
            # As `jax.jit` does, static arguments that compare equal across types (1, 1.0,
            # True) are different steps: the function may read the type.
            key += (tuple(map(type, static_args)), tuple(type(v) for _, v in static_kwargs))
        if statics:
            # So are static leaves (a module's numbers): 2 and 2.0 give different results.
            key += (tuple(type(x) for _, x in statics),)
        try:
            plan = layout.plans.get(key)
        except TypeError:
            self._unhashable(tree, statics, positions, static_args, static_kwargs)
            raise
        if plan is None:
            plan = Plan(strategy, layout, statics, static_args, static_kwargs, positions)
            layout.plans[key] = plan
        traced, num_donated = _traced_leaves(layout, statics, leaves)
        donated_leaves, other_leaves = tuple(traced[:num_donated]), tuple(traced[num_donated:])
        prepared = Prepared(plan, donated_leaves, other_leaves, tree, tree)
        return prepared, leaves, types

    def _layout(self, treedef: Structure) -> Layout:
        """Returns the `Layout` of an arguments' structure (made once per structure).

        A `PerReplica` of a tree and the tree of `PerReplica` leaves a step returns for it
        are one layout (the same leaves, each split): passing a step's per-replica output
        back does not compile the step again.
        """
        layout = self._layouts.get(treedef)
        if layout is None:
            canonical = _per_replica_at_leaves(treedef)
            layout = self._layouts.get(canonical)
            if layout is None:
                layout = self._layouts[canonical] = Layout.of(
                    canonical, self._policy_of, self._deep_of
                )
            self._layouts[treedef] = layout
        return layout

    def _joined(
        self, flat: dict[int | str, tuple[list[Any], Structure]], positions: Positions
    ) -> tuple[list[Any], Layout]:
        """Returns the flat leaves of `(donated args, other args, kwargs)` and its `Layout`,
        from each argument's own leaves and structure (`flat`, by position, and `"kwargs"`).

        The layout is looked up by the identity of the arguments' structures: an adapter
        hands the same structure object for equal structures, having compared them already.
        """
        leaves: list[Any] = []
        structures = []
        for where in positions.flat_order:
            below, structure = flat[where]
            leaves.extend(below)
            structures.append(structure)
        key = (id(positions), *map(id, structures))
        known = self._joined_layouts.get(key)
        if known is not None:
            return leaves, known[1]
        donated = len(positions.indices[0])
        groups = (structures[:donated], structures[donated:-1])
        treedef = _treedef_tuple([*map(_treedef_tuple, groups), structures[-1]])
        layout = self._layout(treedef)
        if len(self._joined_layouts) >= _JOINED_KEPT:
            self._joined_layouts.clear()
        # The entry keeps its structures alive: no other object can take their ids meanwhile.
        self._joined_layouts[key] = (tuple(structures), layout)
        return leaves, layout

    def _unhashable(
        self, tree: tuple, statics: Any, positions: Positions, static_args: tuple, kwargs: tuple
    ) -> None:
        """Raises the `TypeError` naming the static value that cannot be hashed."""
        check_hashable(self.name, tree, statics, positions)
        static_at = positions.static_argnums
        for i, value in zip(static_at, static_args):
            _check_hash(self.name, f"args[{i}] (static_argnums)", value)
        for k, value in kwargs:
            _check_hash(self.name, f"kwargs[{k!r}] (static_argnames)", value)


_treedef_tuple = jax.tree_util.treedef_tuple
# Layouts kept by the identity of the arguments' structures, per replicated function.
_JOINED_KEPT = 64


def _traced_leaves(layout: Layout, statics: Any, leaves: list[Any]) -> tuple[list[Any], int]:
    """Returns the traced leaves among `leaves` and how many of them are donated."""
    if not statics:
        return leaves, layout.num_donated
    static_at = {i for i, _ in statics}
    traced = [x for i, x in enumerate(leaves) if i not in static_at]
    return traced, layout.num_donated - sum(1 for i in static_at if i < layout.num_donated)


def _check_hash(name: str, where: str, value: Any) -> None:
    try:
        hash(value)
    except TypeError:
        raise TypeError(unhashable_message(name, where, value)) from None
