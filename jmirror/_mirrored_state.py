"""Mirrored state stays mirrored (SPEC 11, round 4 notes): the trace-time check of a step.

State that enters a replicated function mirrored (identical on every replica) must leave it
proven mirrored, or be declared per replica (`per_replica=`). The static proof
(`jmirror._proof`) already knows, once per input signature, which outputs may differ between
replicas; this module turns that into

- `MirroredStateError` (a `ValueError`): state lost its mirroring — an NNX `Variable` written
  back (found by `jmirror._nnx`), or a field of a dataclass state (a flax `TrainState`, any
  `flax.struct` or other dataclass pytree) returned where one was passed (`check_returned`).
  It is raised while the step is traced, so nothing has run and nothing was donated;
- `MirroredStateWarning` (a `UserWarning`): a plain pytree returned with the structure,
  shapes and dtypes of a mirrored argument, some of it no longer proven mirrored (the
  functional `state = step(state, batch)` pattern, where jmirror cannot tell state from a
  per-replica result).

The messages name the paths, the owner and the fix the cause calls for (`Diverged.cause`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax

from jmirror._values import PerReplica, is_distributed

# Causes of a divergence that the message has a fix for.
GRADIENTS = "gradients"  # parameters (or optimizer state) updated from unreduced gradients
BATCH_NORM = "batch_norm"  # an nnx.BatchNorm's statistics without axis_name
LINEN_BATCH_NORM = "linen_batch_norm"  # a linen BatchNorm's statistics (batch_stats)

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
      cause: `GRADIENTS`, `BATCH_NORM`, `LINEN_BATCH_NORM` or None (no fix recognised).
    """

    path: str
    what: str
    cause: str | None = None


_FIXES = {
    GRADIENTS: (
        "The parameters are updated from gradients that were not reduced across replicas, so "
        "every replica trains its own copy: reduce them first, grads = "
        'jm.all_reduce("mean", grads), before optimizer.update(model, grads) or '
        "state.apply_gradients(grads=grads)."
    ),
    BATCH_NORM: (
        "An nnx.BatchNorm without axis_name computes its statistics over one replica's batch, "
        "and they drift apart per replica: call jm.sync_batch_norm(model) once before "
        "training (the model definition stays as it is), or build it as "
        "nnx.BatchNorm(..., axis_name=strategy.axis_name); the statistics are then over the "
        "global batch."
    ),
    LINEN_BATCH_NORM: (
        "A linen nn.BatchNorm without axis_name computes its batch_stats over one replica's "
        "batch: give it axis_name=strategy.axis_name in the module definition (linen takes it "
        "there), so that the statistics are over the global batch."
    ),
}
_OTHERWISE = (
    "Reduce such a value across replicas before it is stored (jm.all_reduce(op, x), or "
    'jm.sync(x, "mean") / jm.sync(x, "only_first_replica")).'
)
_DECLARE = (
    "State that is meant to differ per replica is declared: jm.replicate(fn, per_replica=...) "
    "or strategy.run(fn, ..., per_replica=...), with an NNX filter (such as nnx.BatchStat) or "
    "a (path, leaf) -> bool predicate; it then comes back as a PerReplica."
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
    return f"{head} {fixes}{tail} {_DECLARE}"


# --- the per_replica= argument ------------------------------------------------------------------

PathPredicate = Callable[[tuple, Any], bool]


def as_predicate(per_replica: Any) -> PathPredicate | None:
    """`per_replica=` as a `(path, leaf) -> bool` for plain pytrees (None when not given).

    An NNX filter that is not a callable (a `Variable` type, `...`, a string tag) matches no
    plain leaf but `...`, which matches every one.
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
    """

    name: str
    inputs: tuple[tuple, dict]
    result: Any
    forced: frozenset[int]
    per_replica: Any
    argument_path: Callable[[tuple], str]
    axis_name: str | None = None

    def diverged(self, x: Any) -> bool:
        """Whether result node `x` is per replica by the proof (not declared so)."""
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
    """

    is_state: Callable[[Any], bool]
    cause: Callable[[Traced, Any, tuple], str | None]


STATE_KINDS: list[StateKind] = []


def register_state_kind(kind: StateKind) -> None:
    """Makes returned state of `kind` refused by `check_returned`."""
    if kind not in STATE_KINDS:
        STATE_KINDS.append(kind)


def _state_kind(x: Any) -> StateKind | None:
    for kind in STATE_KINDS:
        if kind.is_state(x):
            return kind
    return None


def check_returned(traced: Traced) -> list[Diverged]:
    """The trace-time check of a call that no adapter took (see the module docstring).

    Raises `MirroredStateError` for a dataclass state returned where one was passed; returns
    what the warning of a plain pytree names (empty: nothing).
    """
    inputs, result, argument_path = traced.inputs, traced.result, traced.argument_path
    per_replica = as_predicate(traced.per_replica)
    candidates = _mirrored_arguments(inputs, argument_path)
    if not candidates:
        return []
    warned: list[Diverged] = []
    refused: list[Diverged] = []
    for where, out in _returned(result):
        out_def = jax.tree_util.tree_structure(out, is_leaf=is_distributed)
        for arg_where, arg, arg_def in candidates:
            if arg_def != out_def or not _same_leaves(arg, out):
                continue
            leaves = jax.tree_util.tree_flatten_with_path(out, is_leaf=is_distributed)[0]
            split = [
                p
                for p, x in leaves
                if traced.diverged(x) and not (per_replica and per_replica(p, x.values))
            ]
            if not split:
                break
            state_kind = _state_kind(out)
            if state_kind is not None or dataclasses.is_dataclass(out):
                kind = type(out).__name__
                refused += [
                    Diverged(
                        f"{where}{jax.tree_util.keystr(p)}",
                        f"a {kind} field",
                        (state_kind.cause(traced, out, p) if state_kind else None) or _cause(p),
                    )
                    for p in split
                ]
            else:
                warned += [
                    Diverged(f"{where}{jax.tree_util.keystr(p)}", f"like {arg_where}", _cause(p))
                    for p in split
                ]
            break
    refuse(traced.name, refused)
    return warned


def warning(name: str, diverged: Sequence[Diverged]) -> str:
    """The `MirroredStateWarning` message for `diverged` leaves of returned plain pytrees."""
    return _message(name, diverged, "came back", refused=False) + (
        " (In a plain pytree jmirror cannot tell state from a per-replica result: when this "
        "result is meant to differ per replica, per_replica= silences this warning.)"
    )


def _mirrored_arguments(inputs: tuple[tuple, dict], argument_path: Callable[[tuple], str]):
    """The arguments (and items of container arguments) that are pytrees of leaves none of
    which is distributed (state, mirrored): `(where, value, treedef)`."""
    found = []
    dynamic, kwargs = inputs
    tops = [((0, i), a) for i, a in enumerate(dynamic)] + [((1, k), a) for k, a in kwargs.items()]
    for (kind, key), a in tops:
        for sub, value in _one_deep(a):
            leaves, treedef = jax.tree_util.tree_flatten(value, is_leaf=is_distributed)
            if jax.tree_util.treedef_is_leaf(treedef):
                continue  # a bare array: as often a per-replica result's shape as state
            if leaves and not any(is_distributed(x) for x in leaves):
                first = jax.tree_util.SequenceKey(kind)
                top = (
                    jax.tree_util.SequenceKey(key) if kind == 0 else jax.tree_util.DictKey(key)  # type: ignore[arg-type]
                )
                found.append((argument_path((first, top, *sub)), value, treedef))
    return found


def _returned(result: Any) -> list[tuple[str, Any]]:
    """The result and the items of a container result: `(where, value)`."""
    return [
        ("result" + jax.tree_util.keystr(sub), value)
        for sub, value in _one_deep(result)
        if jax.tree_util.tree_leaves(value, is_leaf=is_distributed)
    ]


def _one_deep(x: Any) -> list[tuple[tuple, Any]]:
    """`x` itself, and the items of a tuple, list or dict `x`: `(path, value)`."""
    if isinstance(x, (tuple, list)) and not hasattr(x, "_fields"):
        return [((), x)] + [((jax.tree_util.SequenceKey(i),), v) for i, v in enumerate(x)]
    if isinstance(x, dict):
        return [((), x)] + [((jax.tree_util.DictKey(k),), v) for k, v in x.items()]
    return [((), x)]


def _same_leaves(a: Any, b: Any) -> bool:
    """Whether two trees of one structure have leaves of equal shapes and dtypes."""
    la = jax.tree_util.tree_leaves(a, is_leaf=is_distributed)
    lb = jax.tree_util.tree_leaves(b, is_leaf=is_distributed)
    return all(_aval(x) == _aval(y) for x, y in zip(la, lb))


def _aval(x: Any) -> tuple:
    """A leaf's shape and dtype as one replica sees it (a traced `PerReplica` output is
    stacked: its leading axis is the replicas'); a static leaf is its type."""
    if type(x) is PerReplica:
        return jax.numpy.shape(x.values)[1:], jax.numpy.result_type(x.values)
    if not (hasattr(x, "dtype") or isinstance(x, (int, float, complex))):
        return ("static", type(x))
    return jax.numpy.shape(x), jax.numpy.result_type(x)


def _cause(path: tuple) -> str | None:
    """The recognised cause of a diverged field of returned state, from its path."""
    keys = jax.tree_util.keystr(path)
    if "batch_stats" in keys:
        return LINEN_BATCH_NORM
    if "params" in keys or "opt_state" in keys:
        return GRADIENTS
    return None
