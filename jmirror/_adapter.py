"""How a kind of argument plugs into `jm.replicate`: the adapter interface.

Most arguments of a replicated function are pytrees of arrays: the compiled step takes their
leaves and gives results back. Some kinds need more: flax NNX objects hold state that the
step changes in place (`jmirror._nnx`), and their changes must be written back into the
caller's objects after the step. An *adapter* owns one such kind. For each call it is asked

- `Adapter.adapt(args, kwargs, static_argnums)`: `None` when the call holds nothing of its
  kind (the fast path of every call: it looks at types only); else an `Adapted`, which says

  - `variant`: a hashable key. Calls with the same key run the same replica function, the
    variant of the user's that `make(fn, name)` builds once (it takes the user's arguments
    and returns what `finish` takes);
  - `finish(result)`: what the caller gets from the variant's result (state written back
    into the caller's objects first);
  - `check(traced)`: the trace-time check of the variant's proven result
    (`jmirror._mirrored_state.Traced`), once per input signature, before anything runs:
    raises `jm.MirroredStateError` for state that would lose its mirroring;
  - `settle(first_component)`: on calls that compile, puts state that is not yet in the form
    the step gives back into that form (an NNX metric's fresh state as sync-on-read
    components, made by `first_component(value)`: the value on replica 0, zero elsewhere),
    so that the next call, with the state this one writes back, compiles nothing new;
  - `flat` (optional): the arguments as the adapter already flattened them, per argument,
    so that the call does not flatten them again (NNX objects flatten in Python).

- `Adapter.deep(in_treedef)`, once per argument structure of a call no adapter took:
  whether arguments of that structure hold its kind where `adapt`'s quick look (which runs
  on every call) does not reach (an NNX object two containers deep); the call is then
  adapted with `adapt(..., deep=True)`, which takes it without the quick look.

A variant's replica function may also return, as the last item of a tuple result, an
`OutputLayout`: a static value (it leaves the trace as a Python object, with no array) whose
`output_path(path)` says, given the key path of a flat output in the variant's result, what
that output stands for as the layout rules see it
(`jmirror._backends.Output`: the path and what declares its layout). With replicas spanning
several devices (`Topology.layout_spec`) this is how state written back by an adapter comes
back laid out by its own metadata and the rules matched against its argument path.

An adapter may also police the leaves of its own node types: `leaf_policy(node_type)`
returns, for a pytree node type of its kind (an `eqx.Module` subclass), the predicate of the
leaves inside it that are traced (`eqx.is_array`: the rest stay static, as
`eqx.filter_jit` partitions them), or None for the types it does not own. Leaves under no
policed node follow `jax.jit`'s rule (`jmirror._arguments`).

Adapters are registered (`register`) by the modules that own them, in the order they are
asked; `jm.replicate` (`jmirror._replicate.Replicated`) knows them only through this
interface: it compiles one step per variant and counts their compilations as its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol

import jax

from jmirror._arguments import is_array, is_traced, leaf_policies
from jmirror._mirrored_state import Diverged, Traced
from jmirror._values import PyTree, Structure


@dataclasses.dataclass(frozen=True)
class Adapted:
    """How one call runs through an adapter (see the module docstring).

    Attributes:
      variant: names the replica function that runs the call: the same key, the same one.
      make: `make(fn, name)` builds that replica function from the user's `fn` (called once
        per variant; `name` is how errors name the replicated function).
      finish: turns the variant's result into what the caller gets.
      check: the trace-time check of the variant's result (it may depend on the variant,
        never on one call's objects): it raises what it refuses and returns what the warning
        of plain pytrees names (`jmirror._mirrored_state.check_returned` of the rest).
      settle: puts the call's state into its steady form (see the module docstring).
      flat: the call's arguments already flattened by the adapter, when it flattened them
        anyway (None: not given): per dynamic positional argument (by position) and for the
        keyword arguments (`"kwargs"`), its leaves and structure as
        `jax.tree_util.tree_flatten` gives them, so that the call flattens nothing twice.
      shared: the arguments reach one object holding leaves twice (a shared NNX `Variable`),
        so a leaf may be passed twice: such a call does not donate.
    """

    variant: Hashable
    make: Callable[[Callable[..., Any], str], Callable[..., Any]]
    finish: Callable[[Any], Any]
    check: Callable[[Traced], list[Diverged]]
    settle: Callable[[Callable[[Any], Any]], None]
    flat: dict[int | str, tuple[list[Any], Structure]] | None = None
    shared: bool = False


class OutputLayout:
    """What the flat outputs of a variant's result stand for, as the layout rules see them
    (returned by the variant as the last item of its tuple result; see the module docstring).

    Subclasses implement `output_path`.
    """

    def output_path(self, path: tuple) -> Any:
        """Returns the path (or `jmirror._backends.Output`) the output at `path` stands for."""
        return path


class Adapter(Protocol):
    """One kind of argument that a replicated call runs through a variant of its function,
    or whose nodes it polices."""

    def adapt(
        self, args: tuple, kwargs: dict, static_argnums: tuple[int, ...], deep: bool = False
    ) -> Adapted | None:
        """Returns the call's `Adapted`, or None when it holds nothing of this kind (`deep`:
        `deep(...)` found its kind in the arguments: take the call without looking)."""
        ...

    def deep(self, in_treedef: Structure) -> bool:
        """Returns whether arguments of this structure hold this kind beyond `adapt`'s quick
        look."""
        ...

    def leaf_policy(self, node_type: type) -> Callable[[Any], bool] | None:
        """Returns the predicate of traced leaves inside nodes of `node_type`, or None."""
        ...


ADAPTERS: list[Adapter] = []
_POLICIES: dict[type, Callable[[Any], bool] | None] = {}


def register(adapter: Adapter) -> None:
    """Adds `adapter` to those every replicated call asks (once)."""
    if adapter not in ADAPTERS:
        ADAPTERS.append(adapter)
        _POLICIES.clear()


def adapt(
    args: tuple, kwargs: dict, static_argnums: tuple[int, ...], deep: bool = False
) -> Adapted | None:
    """Returns the `Adapted` of the first adapter that takes the call, or None (`deep`: the
    adapters whose `deep` finds their kind in the arguments take it without their quick look)."""
    for adapter in ADAPTERS:
        adapted = adapter.adapt(args, kwargs, static_argnums, deep)
        if adapted is not None:
            return adapted
    return None


def deep(in_treedef: Structure) -> bool:
    """Returns whether a call of this argument structure, which no adapter took, holds what
    one must take (beyond its quick look)."""
    return any(adapter.deep(in_treedef) for adapter in ADAPTERS)


def leaf_policy(node_type: type) -> Callable[[Any], bool] | None:
    """Returns the predicate of traced leaves inside nodes of `node_type` (an adapter's), or
    None: `jax.jit`'s rule."""
    try:
        return _POLICIES[node_type]
    except KeyError:
        pass
    found = None
    for adapter in ADAPTERS:
        found = adapter.leaf_policy(node_type)
        if found is not None:
            break
    _POLICIES[node_type] = found
    return found


def static_leaves(tree: PyTree, is_leaf: Callable[[Any], bool] | None = None) -> list[bool]:
    """Returns, per leaf of `tree` (flattened with `is_leaf`), whether it is static: not an
    array inside a policed node (an `eqx.Module`), not traceable by `jax.jit` elsewhere.
    Leaves that `is_leaf` stops at count as traced."""
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_leaf)
    policies = leaf_policies(treedef, leaf_policy)
    return [
        False
        if is_leaf is not None and is_leaf(x)
        else (not is_array(x) if policy is not None else not is_traced(x))
        for x, policy in zip(leaves, policies)
    ]


def map_traced(fn: Callable[[Any], Any], tree: PyTree) -> PyTree:
    """Returns `tree` with `fn` applied to every leaf that is not static (`static_leaves`):
    an equinox module's functions and flags inside a `PerReplica` stay as they are."""
    return map_traced_leaves(lambda leaves: [fn(x) for x in leaves], tree)


def map_traced_leaves(fn: Callable[[list[Any]], Sequence[Any]], tree: PyTree) -> PyTree:
    """Returns `tree` with its leaves that are not static (`static_leaves`) replaced by
    `fn(leaves)`, which takes and returns them all at once (one compiled call for a tree);
    the static leaves stay as they are."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    static = static_leaves(tree)
    done = iter(fn([x for x, s in zip(leaves, static) if not s]))
    return treedef.unflatten([x if s else next(done) for x, s in zip(leaves, static)])


def policed_statics(tree: PyTree, is_leaf: Callable[[Any], bool] | None = None) -> list[bool]:
    """Returns, per leaf of `tree` (flattened with `is_leaf`), whether it is a static leaf
    inside a policed node (an `eqx.Module`'s function, flag or number); leaves elsewhere are
    never static here."""
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_leaf)
    policies = leaf_policies(treedef, leaf_policy)
    return [
        policy is not None and not (is_leaf is not None and is_leaf(x)) and not is_array(x)
        for x, policy in zip(leaves, policies)
    ]
