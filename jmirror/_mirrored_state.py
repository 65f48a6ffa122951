"""Mirrored state stays mirrored: the trace-time check of a step.

State that enters a replicated function mirrored (identical on every replica) must leave it
proven mirrored, or be declared per replica (`per_replica=`). The static proof
(`jmirror._proof`) already knows, once per input signature, which outputs may differ between
replicas; this module turns that into

- `MirroredStateError` (a `ValueError`): state lost its mirroring — an NNX `Variable` written
  back (found by `jmirror._nnx`), or a field of a dataclass state (a flax `TrainState`, any
  `flax.struct` or other dataclass pytree) that entered mirrored, wherever it comes back
  (`check_returned`): at any depth of the result (`(state, ema), loss` carries), matched to
  the argument of its type and by its path in it (a structure that changed on the way still
  checks the fields that were there), whatever else the state holds (`PerReplica`,
  `SyncOnRead` and `Sharded` leaves are left alone, never the rest). It is raised while the
  step is traced, so nothing has run and nothing was donated;
- `MirroredStateWarning` (a `UserWarning`): a plain pytree returned (at any depth of tuples,
  lists and dicts) with the structure, shapes and dtypes of a plain argument pytree (at any
  depth too), some of what entered it mirrored no longer proven mirrored (the functional
  `state = step(state, batch)` pattern, where jmirror cannot tell state from a per-replica
  result).

The messages name the paths, the owner and the fix the cause calls for (`Diverged.cause`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax

from jmirror._values import PerReplica, PyTree, held_values, is_distributed

# Causes of a divergence that the message has a fix for.
GRADIENTS = "gradients"  # parameters (or optimizer state) updated from unreduced gradients

# How many paths a message lists before "and k more".
_SHOWN = 5


class MirroredStateError(ValueError):
    """State that entered a replicated function mirrored would leave it per replica.

    Raised by the first call of an input signature, while the step is traced: nothing has
    run and nothing was donated. The message names the paths, the owning module and the fix.

    Example:
        >>> import jax.numpy as jnp, jmirror as jm
        >>> from flax import nnx
        >>> counter = nnx.Variable(jnp.zeros(()))
        >>> @jm.replicate
        ... def count(counter):  # a different amount on each replica
        ...     counter[...] += jm.replica_id()
        >>> try:
        ...     count(counter)
        ... except jm.MirroredStateError as error:
        ...     print("args[0] (nnx.Variable" in str(error))
        True
        >>> float(counter[...])  # untouched
        0.0
    """


class MirroredStateWarning(UserWarning):
    """A returned pytree shaped like a mirrored argument is no longer proven mirrored.

    Example:
        >>> import warnings, jax, jax.numpy as jnp, jmirror as jm
        >>> strategy = jm.MirroredStrategy()
        >>> params = strategy.mirror({"w": jnp.ones(2), "b": jnp.zeros(2)})
        >>> step = jm.replicate(lambda p, x: jax.tree.map(lambda v: v * x, p))
        >>> x = jm.PerReplica(jnp.arange(strategy.num_replicas, dtype=jnp.float32))
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     params = step(params, x)
        >>> [w.category.__name__ for w in caught]
        ['MirroredStateWarning']
    """


@dataclasses.dataclass(frozen=True)
class Diverged:
    """One state leaf that would lose its mirroring.

    Attributes:
      path: where the caller finds it (`args[0].bn1.mean`, `result[0].params['w']`).
      what: what it is, for the message (`nnx.BatchStat of BatchNorm`).
      cause: `GRADIENTS`, a fix of its own (a library's, with its names) or None (no fix
        recognised).
    """

    path: str
    what: str
    cause: str | None = None


_FIXES = {
    GRADIENTS: (
        "Parameters that come back different on each replica are most often updated from "
        "gradients that were not reduced across replicas, so that every replica trains its own "
        'copy: reduce them first, grads = jm.all_reduce("mean", grads), before '
        "optimizer.update(model, grads) or state.apply_gradients(grads=grads). Otherwise reduce "
        "whatever else they are computed from (jm.all_reduce, jm.sync)."
    ),
}
_OTHERWISE = (
    "Reduce such a value across replicas before it is stored (jm.all_reduce(op, x), or "
    'jm.sync(x, "mean") / jm.sync(x, "only_first_replica")).'
)
_DECLARE = (
    "State that is meant to differ per replica is declared: jm.replicate(fn, per_replica=...) "
    "or strategy.run(fn, ..., per_replica=...), with an NNX filter (such as nnx.BatchStat), "
    "a type whose nodes hold it (such as eqx.nn.State) or a (path, leaf) -> bool predicate; "
    "it then comes back as a PerReplica."
)

UPDATE = "strategy.update"  # how the replicated function of `strategy.update` is named
_DECLARE_UPDATE = (
    "strategy.update applies fn to every replica's copy alike and keeps the tree mirrored: "
    "reduce its PerReplica arguments first (strategy.reduce), or, for state meant to differ "
    "per replica, call strategy.run(fn, args=(tree, ...), per_replica=...)."
)


def refuse(name: str, diverged: Sequence[Diverged]) -> None:
    """Raises the `MirroredStateError` of `diverged` (nothing when it is empty)."""
    if diverged:
        raise MirroredStateError(_message(name, diverged, "would come back", refused=True))


def _message(name: str, diverged: Sequence[Diverged], verb: str, refused: bool) -> str:
    count = len(diverged)
    shown = ", ".join(f"{d.path} ({d.what})" for d in diverged[:_SHOWN])
    more = f", and {count - _SHOWN} more" if count > _SHOWN else ""
    causes = [c for c in _FIXES if any(d.cause == c for d in diverged)]
    # A cause that is not a known key is a fix of its own (a library's, with its names).
    causes += list(dict.fromkeys(d.cause for d in diverged if d.cause and d.cause not in _FIXES))
    fixes = " ".join(_FIXES.get(c, c) for c in causes)
    if not causes or any(d.cause is None for d in diverged):
        fixes = f"{fixes} {_OTHERWISE}".strip()
    leaves = "1 state leaf" if count == 1 else f"{count} state leaves"
    head = (
        f"{name}: {leaves} entered mirrored (identical on every replica) and {verb} "
        f"different on each replica, no longer proven mirrored: {shown}{more}."
    )
    tail = " Nothing ran: the arguments are untouched and nothing was donated." if refused else ""
    # strategy.update has no per_replica=: its per-replica arguments are what to reduce.
    declare = _DECLARE_UPDATE if f"({UPDATE}(" in name else _DECLARE
    return f"{head} {fixes}{tail} {declare}"


# --- the per_replica= argument ------------------------------------------------------------------

PathPredicate = Callable[[tuple, Any], bool]


def as_predicate(per_replica: PyTree) -> PathPredicate | None:
    """Returns `per_replica=` as a `(path, leaf) -> bool` for plain pytrees (None when not given).

    An NNX filter that is not a callable (a `Variable` type, `...`, a string tag) matches no
    plain leaf but `...`, which matches every one. A type matches the leaves of its type, and
    every leaf inside a node of its type (`_declared_nodes`: an `eqx.nn.State`).
    """
    if per_replica is None:
        return None
    if per_replica is Ellipsis or per_replica is True:
        return lambda path, leaf: True
    if isinstance(per_replica, type):
        return lambda path, leaf: isinstance(leaf, per_replica)
    if callable(per_replica):
        return cast(PathPredicate, per_replica)
    return lambda path, leaf: False


def _declared_nodes(tree: PyTree, per_replica: PyTree) -> list[tuple]:
    """Returns the paths, in `tree`, of the nodes that `per_replica=` names by their type (an
    `eqx.nn.State`, a dataclass of statistics): every leaf under them is declared per replica."""
    if not isinstance(per_replica, type):
        return []
    is_node = lambda x: isinstance(x, per_replica) or is_distributed(x)  # noqa: E731
    found = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_node)[0]
    return [path for path, x in found if isinstance(x, per_replica)]


# --- dataclass state and plain pytrees ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Traced:
    """What the trace-time check of one input signature sees.

    Attributes:
      name: how messages name the replicated function.
      inputs: `(dynamic args, kwargs)` as the step got them, distributed values as their
        pytree nodes (`PerReplica`, `SyncOnRead`, `Sharded`).
      result: the replica function's result, its per-replica leaves as `PerReplica`.
      forced: the ids of result nodes the function itself returned as `jm.PerReplica`
        (declared per replica: never a divergence).
      per_replica: the `per_replica=` argument (None when not given).
      argument_path: names a path into `inputs` (`args[0].w`, `kwargs['state']`).
      computed_from: whether a result leaf is computed from an input leaf (by the traced
        program's data flow; None when not known).
    """

    name: str
    inputs: tuple[tuple, dict]
    result: PyTree
    forced: frozenset[int]
    per_replica: PyTree
    argument_path: Callable[[tuple], str]
    axis_name: str | None = None
    computed_from: Callable[[Any, Any], bool] | None = None

    def diverged(self, x: object) -> bool:
        """Returns whether result node `x` is per replica by the proof (not declared so)."""
        return type(x) is PerReplica and id(x) not in self.forced


@dataclasses.dataclass(frozen=True)
class StateKind:
    """A library's kind of state that, returned not proven mirrored, is refused (as a
    dataclass state is), not only warned of; registered by the module owning the library.

    Attributes:
      is_state: whether a returned object (or an item of a returned container) is state.
      cause: the fix for a diverged leaf of such state: a key of the known causes
        (`GRADIENTS`, ...), a sentence of its own, or None; given the check's `Traced`, the
        state and the leaf's path inside it.
      describe: what a diverged leaf is, for the message (the layer it belongs to), or None
        for "a <type> field"; given the same as `cause`.
    """

    is_state: Callable[[Any], bool]
    cause: Callable[[Traced, Any, tuple], str | None]
    describe: Callable[[Traced, Any, tuple], str | None] | None = None


STATE_KINDS: list[StateKind] = []


def register_state_kind(kind: StateKind) -> None:
    """Makes returned state of `kind` refused by `check_returned`."""
    if kind not in STATE_KINDS:
        STATE_KINDS.append(kind)


def _state_kind(x: PyTree) -> StateKind | None:
    for kind in STATE_KINDS:
        if kind.is_state(x):
            return kind
    return None


def check_returned(traced: Traced) -> list[Diverged]:
    """Checks, at trace time, a call that no adapter took (see the module docstring).

    Raises `MirroredStateError` for a field of dataclass state that entered mirrored and
    comes back not proven mirrored; returns what the warning of plain pytrees names (empty:
    nothing).
    """
    per_replica = as_predicate(traced.per_replica)
    checked: set[int] = set()  # result leaves inside returned dataclass state
    refuse(traced.name, _check_dataclasses(traced, per_replica, checked))
    return _check_plain(traced, per_replica, checked)


def warning(name: str, diverged: Sequence[Diverged]) -> str:
    """Returns the `MirroredStateWarning` message for `diverged` leaves of returned plain
    pytrees."""
    return _message(name, diverged, "came back", refused=False) + (
        " (In a plain pytree jmirror cannot tell state from a per-replica result: when this "
        "result is meant to differ per replica, per_replica= silences this warning.)"
    )


# A state leaf that entered distributed, or not at all, in `_entered`.
_NOT_MIRRORED = object()


def _check_dataclasses(
    traced: Traced, per_replica: PathPredicate | None, checked: set[int]
) -> list[Diverged]:
    """Returns every field of a returned dataclass that entered mirrored in the argument it stands
    for and comes back not proven mirrored, at any depth of the result.

    A returned dataclass stands for an argument dataclass of its type, at any depth of the
    arguments (the one whose path ends most like the result's: `(state, ema)` in and out
    pairs item with item). Fields are matched by their path inside it, so a structure that
    changed (an `ema=None` filled) still checks the fields that were there; distributed
    leaves (`PerReplica`, `SyncOnRead`, `Sharded`) are left alone, the rest is checked.
    """
    states: dict[type, list[tuple[tuple, Any]]] = {}
    for path, node in _dataclass_nodes(traced.inputs):
        states.setdefault(type(node), []).append((path, node))
    if not states:
        return []
    diverged: list[Diverged] = []
    pending = [((), traced.result, True)]
    for prefix, tree, root in pending:  # grows while it is walked: outer results first
        for path, out in _outermost_dataclasses(tree, root):
            where = prefix + path
            candidates = states.get(type(out))
            if candidates is None:  # not state that was passed: look inside it
                pending.append((where, out, False))
                continue
            arg = _source(traced, out, where, candidates)
            entered = _entered(arg)
            kind = type(out).__name__
            state_kind = _state_kind(out)
            declared = _declared_nodes(out, traced.per_replica)
            for p, x in jax.tree_util.tree_flatten_with_path(out, is_leaf=is_distributed)[0]:
                checked.add(id(x))
                if not traced.diverged(x) or entered.get(p, _NOT_MIRRORED) is _NOT_MIRRORED:
                    continue
                if per_replica is not None and per_replica(p, x.values):
                    continue
                if any(p[: len(q)] == q for q in declared):
                    continue
                at = f"result{jax.tree_util.keystr(where)}{jax.tree_util.keystr(p)}"
                cause = what = None
                if state_kind is not None:
                    cause = state_kind.cause(traced, out, p)
                    if state_kind.describe is not None:
                        what = state_kind.describe(traced, out, p)
                diverged.append(Diverged(at, what or f"a {kind} field", cause or _cause(p)))
    return diverged


def _check_plain(
    traced: Traced, per_replica: PathPredicate | None, checked: set[int]
) -> list[Diverged]:
    """Returns the leaves of returned plain pytrees (at any depth of tuples, lists and dicts) that
    have the structure, shapes and dtypes of a plain argument pytree (at any depth too),
    entered it mirrored and come back not proven mirrored."""
    candidates: dict[Any, list[tuple[str, Any]]] = {}
    for path, value in _plain_subtrees(traced.inputs):
        if len(path) < 2:
            continue  # `(args, kwargs)` and `args` themselves: not one argument
        leaves, treedef = jax.tree_util.tree_flatten(value, is_leaf=is_distributed)
        if not jax.tree_util.treedef_is_leaf(treedef) and not all(map(is_distributed, leaves)):
            candidates.setdefault(treedef, []).append((traced.argument_path(path), value))
    if not candidates:
        return []
    warned: list[Diverged] = []
    for sub, out in _plain_subtrees(traced.result):
        leaves, out_def = jax.tree_util.tree_flatten_with_path(out, is_leaf=is_distributed)
        if any(id(x) in checked for _, x in leaves):
            continue  # the leaves of an item that matched already, or of dataclass state
        match = next((c for c in candidates.get(out_def, ()) if _same_leaves(c[1], out)), None)
        if match is None:
            continue
        arg_where, arg = match
        before = jax.tree_util.tree_leaves(arg, is_leaf=is_distributed)
        where = "result" + jax.tree_util.keystr(sub)
        declared = _declared_nodes(out, traced.per_replica)
        for (p, x), b in zip(leaves, before):
            checked.add(id(x))
            if not traced.diverged(x) or is_distributed(b):
                continue
            if per_replica is not None and per_replica(p, x.values):
                continue
            if any(p[: len(q)] == q for q in declared):
                continue
            at = f"{where}{jax.tree_util.keystr(p)}"
            warned.append(Diverged(at, f"like {arg_where}", _cause(p)))
    return warned


def _is_dataclass_node(x: object) -> bool:
    """Returns whether `x` is state: a dataclass instance or a registered state kind's."""
    if isinstance(x, type) or is_distributed(x):
        return False
    if not (dataclasses.is_dataclass(x) or _state_kind(x) is not None):
        return False
    # A dataclass that is no pytree node is a static leaf (a config object), not state.
    return not jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(x))


def _outermost_dataclasses(tree: PyTree, root: bool = False) -> list[tuple[tuple, Any]]:
    """Returns the outermost dataclass nodes of `tree` (`root`: `tree` itself when it is one; else
    below it): `(path, node)`."""
    found = jax.tree_util.tree_flatten_with_path(
        tree,
        is_leaf=lambda x: (root or x is not tree) and (is_distributed(x) or _is_dataclass_node(x)),
    )[0]
    return [(p, x) for p, x in found if (root or x is not tree) and _is_dataclass_node(x)]


def _dataclass_nodes(tree: PyTree) -> list[tuple[tuple, Any]]:
    """Returns every dataclass node of `tree` below its root, at any depth: `(path, node)`."""
    found = []
    for path, node in _outermost_dataclasses(tree):
        found.append((path, node))
        found += [(path + p, x) for p, x in _dataclass_nodes(node)]
    return found


def _entered(state: PyTree) -> dict[tuple, Any]:
    """Returns the leaves of an argument's dataclass by their path in it, `_NOT_MIRRORED` for those
    that entered distributed."""
    flat = jax.tree_util.tree_flatten_with_path(state, is_leaf=is_distributed)[0]
    return {p: _NOT_MIRRORED if is_distributed(x) else x for p, x in flat}


def _source(traced: Traced, out: Any, where: tuple, candidates: list[tuple[tuple, Any]]) -> Any:
    """Returns the argument dataclass that the returned one at `where` stands for: of several
    of its type, the one whose fields the returned fields are computed from (by the traced
    data flow: `state.apply_gradients(...)` is computed from `state`, whatever order the
    arguments and results come in); else the one whose path ends most like `where`'s."""
    if len(candidates) > 1 and traced.computed_from is not None:
        found = dict(jax.tree_util.tree_flatten_with_path(out, is_leaf=is_distributed)[0])
        scores = []
        for _, arg in candidates:
            score = 0
            for p, before in jax.tree_util.tree_flatten_with_path(arg, is_leaf=is_distributed)[0]:
                after = found.get(p)
                if after is not None and traced.computed_from(_held(after), _held(before)):
                    score += 1
            scores.append(score)
        best = max(scores)
        if best and scores.count(best) == 1:
            return candidates[scores.index(best)][1]
    return max(candidates, key=lambda c: _common_suffix(c[0][1:], where))[1]


def _held(x: object) -> object:
    """Returns the array a result or argument node holds (a `PerReplica`'s stacked values)."""
    return held_values(x) if type(x) is PerReplica else x


def _common_suffix(a: tuple, b: tuple) -> int:
    """Counts the keys that two paths end with in common."""
    n = 0
    while n < min(len(a), len(b)) and a[len(a) - 1 - n] == b[len(b) - 1 - n]:
        n += 1
    return n


def _plain_subtrees(tree: PyTree, path: tuple = ()) -> list[tuple[tuple, Any]]:
    """Returns `tree` and, at any depth, the items of the tuples, lists and dicts in it (not
    NamedTuples, dataclasses or other pytree nodes, which stand for one value): `(path,
    value)`, outer first."""
    found = [(path, tree)]
    if isinstance(tree, (tuple, list)) and not hasattr(tree, "_fields"):
        items = [(jax.tree_util.SequenceKey(i), v) for i, v in enumerate(tree)]
    elif isinstance(tree, dict):
        items = [(jax.tree_util.DictKey(k), v) for k, v in tree.items()]
    else:
        return found
    for key, value in items:
        found += _plain_subtrees(value, path + (key,))
    return found


def _same_leaves(a: object, b: PyTree) -> bool:
    """Returns whether two trees of one structure have leaves of equal shapes and dtypes."""
    la = jax.tree_util.tree_leaves(a, is_leaf=is_distributed)
    lb = jax.tree_util.tree_leaves(b, is_leaf=is_distributed)
    return all(_aval(x) == _aval(y) for x, y in zip(la, lb))


def _aval(x: PyTree) -> tuple:
    """Returns a leaf's shape and dtype as one replica sees it (a traced `PerReplica` output is
    stacked: its leading axis is the replicas'); a distributed input leaf by its kind; a
    static leaf by its type."""
    if type(x) is PerReplica:
        return jax.numpy.shape(x.values)[1:], jax.numpy.result_type(x.values)
    if is_distributed(x):
        return (type(x).__name__,)
    if not (hasattr(x, "dtype") or isinstance(x, (int, float, complex))):
        return ("static", type(x))
    return jax.numpy.shape(x), jax.numpy.result_type(x)


# Libraries' recognised causes of a diverged leaf of returned state, from its path inside
# the state: functions giving a cause (a known key or a fix of its own) or None. Registered
# by the module owning the library (`jmirror._flax`: linen's `batch_stats`, `params`).
PATH_CAUSES: list[Callable[[tuple], str | None]] = []


def register_path_cause(cause: Callable[[tuple], str | None]) -> None:
    """Makes `cause` name the fix of diverged state leaves it recognises by path."""
    if cause not in PATH_CAUSES:
        PATH_CAUSES.append(cause)


def _cause(path: tuple) -> str | None:
    """Returns the recognised cause of a diverged leaf of returned state, from its path."""
    for cause in PATH_CAUSES:
        found = cause(path)
        if found is not None:
            return found
    return None
