"""Tracing a replica function for one input signature, and proving its outputs.

`trace_and_prove(call, avals)` traces the replica function into a jaxpr with
`jax.make_jaxpr(axis_env=[(axis_name, N)])`, which gives `jax.pmap` semantics whichever backend
runs it, inside one `jax.jit` (so that the backend binds the traced body as one call and does
not trace it again), and proves which outputs are identical on every replica (`jmirror._proof`).
`sync` and `merge_call` leave markers whose answers only the proof knows, so tracing repeats:
each round uses the previous round's answers (the oracle), until the answers stop changing. When
a round contradicts an answer it relied on, or after `MAX_ROUNDS`, it traces once more with no
answers at all (every marked value then varies, which is always safe). The result is a
`ProvenStep`.

Arguments and results cross the trace as flat leaves, grouped in *slots*: one slot per
top-level leaf of the argument (or result) tree, where a `PerReplica` or `SyncOnRead` node is
one slot holding its own leaves (its static leaves, an equinox module's functions and flags,
kept in the slot), and a static leaf (a function, a string, an equinox module's flag) a slot
holding its value and no leaf. `build_result` puts a step's flat outputs back
into the result's structure; a static output comes back as the same Python object, carried
out of `jax.jit` in the output structure itself (`StaticOut`, inside a `WithStatics` that
`restore_statics` opens after the call).
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.core
import jax.extend.core as jex
import jax.numpy as jnp

from jmirror import _context, _deadline
from jmirror._adapter import static_leaves
from jmirror._context import Runner
from jmirror._proof import prove
from jmirror._values import (
    PerReplica,
    PyTree,
    Sharded,
    Structure,
    SyncOnRead,
    held_values,
    is_distributed,
)

MAX_ROUNDS = 4
_UNBOUND_AXIS = re.compile(r"unbound axis name: (\S+?)\.?(\s|$)")


class SlotKind(enum.Enum):
    """What a top-level leaf of an input or output tree is."""

    SPLIT = "split"  # input: each replica gets its own slice (PerReplica, SyncOnRead)
    BROADCAST = "broadcast"  # input: every replica gets the whole value
    AUTO = "auto"  # output: mirrored where proven identical, else per replica
    FORCED = "per_replica"  # output: returned as `jm.PerReplica` by the function itself
    STORAGE = "sync_on_read"  # output: a `SyncOnRead`
    SHARDED = "sharded"  # input or output: a `Sharded` node (`jm.shard_update`)
    STATIC = "static"  # input or output: a static leaf, no flat leaf


SPLIT, BROADCAST = SlotKind.SPLIT, SlotKind.BROADCAST
AUTO, FORCED, STORAGE = SlotKind.AUTO, SlotKind.FORCED, SlotKind.STORAGE
SHARDED, STATIC = SlotKind.SHARDED, SlotKind.STATIC


@dataclasses.dataclass(frozen=True)
class Slot:
    """One top-level leaf of an input or output tree: a plain leaf, a distributed node or a
    static value.

    Attributes:
      kind: the `SlotKind`.
      treedef: for distributed nodes, the structure inside the node.
      aggregation: for `SyncOnRead` nodes, their aggregation.
      shape: for `Sharded` nodes, the whole leaf's shape.
      value: for static slots, the value.
      size: the number of flat leaves.
      statics: for distributed nodes, their static leaves (an equinox module's functions
        and flags), as `(position among the node's leaves, value)`: no flat leaf.
    """

    kind: SlotKind
    treedef: Structure = None
    aggregation: Any = None
    shape: tuple[int, ...] = ()
    value: Any = None
    size: int = 1
    statics: tuple[tuple[int, Any], ...] = ()

    def unflatten(
        self, leaves: Sequence[Any], static: Callable[[Any], Any] = lambda v: v
    ) -> PyTree:
        """Returns a distributed node's contents from its flat leaves, its static leaves put
        back (each as `static(value)`)."""
        leaves = list(leaves)
        for position, value in self.statics:
            leaves.insert(position, static(value))
        return self.treedef.unflatten(leaves)


class StaticOut:
    """Marks a static output of a step while it is traced (a leaf holding the value, which
    `WithStatics.of` takes out of the outputs)."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


class WithStatics:
    """A step's result that holds static values, as `jax.jit` returns it: its array leaves,
    and in the output structure (static), how to put the values back (`restore()`).

    `jax.jit` dispatches a compiled call in C++ only when every output, unflattened and
    flattened again, is an array: a static value unflattened in place (a function, a string)
    would send every call of the step through JAX's Python dispatch. The one type check of
    `restore_statics` tells the results that hold any.
    """

    __slots__ = ("leaves", "rebuild")

    def __init__(self, leaves: Sequence[Any], rebuild: _Rebuild):
        self.leaves = leaves
        self.rebuild = rebuild

    @classmethod
    def of(cls, result: Any) -> WithStatics:
        """Wraps a result (traced) in which static values are `StaticOut` leaves."""
        flat, treedef = jax.tree_util.tree_flatten(result, is_leaf=_is_static_out)
        statics = tuple((i, x.value) for i, x in enumerate(flat) if type(x) is StaticOut)
        leaves = [x for x in flat if type(x) is not StaticOut]
        return cls(leaves, _Rebuild(treedef, statics))

    def restore(self) -> Any:
        """Returns the result with the static values in place."""
        leaves = list(self.leaves)
        for i, value in self.rebuild.statics:
            leaves.insert(i, value)
        return self.rebuild.treedef.unflatten(leaves)


@dataclasses.dataclass(frozen=True, eq=False)
class _Rebuild:
    """Where a `WithStatics` puts its values back: the result's structure (static values
    as leaves) and `(flat index, value)` of each static value."""

    treedef: Structure
    statics: tuple[tuple[int, Any], ...]


def _is_static_out(x: Any) -> bool:
    return type(x) is StaticOut


jax.tree_util.register_pytree_node(
    WithStatics,
    lambda w: (w.leaves, w.rebuild),
    lambda rebuild, leaves: WithStatics(leaves, rebuild),
)


def restore_statics(result: Any) -> Any:
    """Returns a step's result as the replica function returned it (static values in place)."""
    return result.restore() if type(result) is WithStatics else result


def flatten_slots(
    top: Sequence[Any], inputs: bool, static: Sequence[bool] | None = None
) -> tuple[list[Any], list[Slot]]:
    """Returns the flat leaves and slots of top-level nodes, opening distributed nodes one
    level; `static[i]` marks top-level leaf i static (no flat leaf)."""
    flat: list[Any] = []
    slots: list[Slot] = []
    for i, node in enumerate(top):
        if static is not None and static[i]:
            slots.append(Slot(STATIC, value=node, size=0))
            continue
        if isinstance(node, Sharded):
            slots.append(Slot(SHARDED, shape=node.shape))
            flat.append(node.shards)
            continue
        if isinstance(node, SyncOnRead):
            leaves, inner, kept = _node_leaves(node.value, inputs)
            kind = SPLIT if inputs else STORAGE
            slots.append(Slot(kind, inner, node.aggregation, size=len(leaves), statics=kept))
        elif isinstance(node, PerReplica):
            leaves, inner, kept = _node_leaves(held_values(node), inputs)
            kind = SPLIT if inputs else FORCED
            slots.append(Slot(kind, inner, size=len(leaves), statics=kept))
        else:
            leaves = [node]
            slots.append(Slot(BROADCAST if inputs else AUTO))
        flat.extend(leaves)
    return flat, slots


def _node_leaves(value: PyTree, inputs: bool) -> tuple[list[Any], Any, tuple[tuple[int, Any], ...]]:
    """Returns the traced leaves of a distributed node's contents, their structure and its
    static leaves by position: an input's are those that are no tracer (the plan kept them
    static), a result's those `static_leaves` names (an equinox module's functions)."""
    leaves, inner = jax.tree_util.tree_flatten(value)
    if inputs:
        static = [not isinstance(x, jax.core.Tracer) for x in leaves]
    else:
        static = static_leaves(value)
    kept = tuple((i, x) for i, (x, s) in enumerate(zip(leaves, static)) if s)
    return [x for x, s in zip(leaves, static) if not s], inner, kept


@dataclasses.dataclass(frozen=True)
class ReplicaCall:
    """One call of a replica function, as the trace needs it.

    Attributes:
      fn: the replica function; `name`: how errors name it.
      strategy: the strategy running it (the replica context's `strategy`).
      in_treedef: the structure of `((dynamic args), kwargs)`, distributed nodes as leaves.
      in_slots: a slot per leaf of `in_treedef`.
      out_static: which top-level leaves of a result are static (`jmirror._arguments`).
      statics: the values of the static arguments; `static_argnums`: their positions.
      num_args: the number of positional arguments.
      split: for each flat input leaf, whether each replica sees its own slice.
    """

    fn: Callable[..., Any]
    name: str
    strategy: Runner
    in_treedef: Structure
    in_slots: tuple[Slot, ...]
    statics: tuple[Any, ...]
    static_argnums: tuple[int, ...]
    num_args: int
    split: tuple[bool, ...]
    out_static: Callable[[Any, list[Any]], list[bool]]


@dataclasses.dataclass
class _Round:
    """One round of tracing: the replica contexts' shared state and what the trace returned."""

    trace: _context.TraceRound
    out_slots: tuple[Slot, ...] = ()
    out_treedef: Structure = None


@dataclasses.dataclass(frozen=True)
class ProvenStep:
    """A replica function traced for one input signature, with its outputs proven.

    Attributes:
      closed: the replica jaxpr (flat inputs without the replica axis, flat outputs).
      out_split: for each flat output, whether it may differ between replicas.
      out_slots: a slot per top-level leaf of the result; `out_treedef`: its structure.
    """

    closed: jex.ClosedJaxpr
    out_split: tuple[bool, ...]
    out_slots: tuple[Slot, ...]
    out_treedef: Structure


def trace_and_prove(call: ReplicaCall, avals: Sequence[jax.ShapeDtypeStruct]) -> ProvenStep:
    """Traces `call` on per-replica `avals` and proves which outputs are identical."""
    _deadline.compiling()  # tracing and compiling are not waiting for other processes
    strategy = call.strategy
    axis_env = [(strategy.axis_name, strategy.num_replicas)]

    def trace(oracle: dict[int, tuple[bool, ...]]):
        round_ = _Round(_context.TraceRound(oracle))

        # A new function object each round: make_jaxpr caches traces by function.
        def replica(*flat: Any) -> list[jax.Array]:
            return _run_replica(call, round_, *flat)

        # Named after the replica function, as its call is in the jaxpr and the HLO.
        name = getattr(call.fn, "__name__", None)
        replica.__name__ = replica.__qualname__ = name if isinstance(name, str) else "replica"
        # Traced as one `jax.jit`, the replica function is a single call equation that
        # carries its own jaxpr: the backend binds that equation and does not trace the
        # body a second time, and the proof reads the body through it.
        jitted = jax.jit(replica)
        try:
            closed = jax.make_jaxpr(jitted, axis_env=axis_env)(*avals)
        except NameError as e:
            raise _unbound_axis(call, e) from e
        try:
            out_split, proof = prove(closed, call.split, strategy.axis_name)
        except ValueError as e:  # a collective under a branch that differs: name the call
            raise ValueError(f"{call.name}: {e}") from None
        return closed, out_split, proof, round_

    oracle: dict[int, tuple[bool, ...]] = {}
    rounds = 0
    while True:
        closed, out_split, proof, round_ = trace(oracle)
        rounds += 1
        records = round_.trace.records
        found = {
            k: tuple(proof.markers.get(k, (True,) * len(r.assumed_varying)))
            for k, r in records.items()
        }
        if all(found[k] == r.assumed_varying for k, r in records.items()):
            break
        unsound = any(
            a is False and f is True
            for k, r in records.items()
            for a, f in zip(r.assumed_varying, found[k])
        )
        if rounds >= MAX_ROUNDS or (unsound and rounds > 1):
            # Stop refining: assume every marked value varies, which is always safe.
            closed, out_split, proof, round_ = trace({})
            break
        oracle = found
    for k, record in round_.trace.records.items():
        if record.require_identical:
            _context.check_identical(
                record.call, record.paths, proof.markers.get(k, [True] * len(record.paths))
            )
    out_split = list(out_split)
    pos = 0
    for slot in round_.out_slots:
        if slot.kind != AUTO:
            out_split[pos : pos + slot.size] = [True] * slot.size
        pos += slot.size
    return ProvenStep(closed, tuple(out_split), round_.out_slots, round_.out_treedef)


def _run_replica(call: ReplicaCall, round_: _Round, *flat: Any) -> list[jax.Array]:
    """Runs the replica function on flat per-replica leaves in a replica context; returns flat
    results."""
    round_.trace.learn(flat, call.split)
    top = []
    pos = 0
    for slot in call.in_slots:
        leaves = flat[pos : pos + slot.size]
        pos += slot.size
        if slot.kind == STATIC:
            top.append(slot.value)
        elif slot.kind == SHARDED:
            top.append(Sharded(leaves[0], slot.shape))
        elif slot.kind == SPLIT and slot.aggregation is not None:
            top.append(SyncOnRead(slot.unflatten(leaves), slot.aggregation))
        elif slot.kind == SPLIT:
            top.append(slot.unflatten(leaves))
        else:
            top.append(leaves[0])
    dynamic, kwargs = jax.tree_util.tree_unflatten(call.in_treedef, top)
    dynamic = iter(dynamic)
    static = iter(call.statics)
    args = [
        next(static) if i in call.static_argnums else next(dynamic) for i in range(call.num_args)
    ]
    context = _context.ReplicaContext(call.strategy, round_.trace)
    _context.enter_replica(context)
    try:
        result = call.fn(*args, **kwargs)
    finally:
        _context.exit_replica()
    out_top, round_.out_treedef = jax.tree_util.tree_flatten(result, is_leaf=is_distributed)
    static = call.out_static(round_.out_treedef, out_top)
    out_flat, out_slots = flatten_slots(out_top, inputs=False, static=static)
    round_.out_slots = tuple(out_slots)
    return [jnp.asarray(x) for x in out_flat]


def build_result(step: ProvenStep, outs: Sequence[Any]) -> Any:
    """Returns the result of a step from its flat outputs (`outs`, the run's): per-replica
    leaves as `PerReplica`, sync-on-read ones as `SyncOnRead`, `Sharded` nodes rebuilt,
    static values as `StaticOut` (the whole result then inside a `WithStatics`)."""
    built, pos, statics = [], 0, False
    for slot in step.out_slots:
        leaves = outs[pos : pos + slot.size]
        if slot.kind == STATIC:
            statics = True
            built.append(StaticOut(slot.value))
        elif slot.kind == STORAGE:
            statics = statics or bool(slot.statics)
            built.append(SyncOnRead(slot.unflatten(leaves, StaticOut), slot.aggregation))
        elif slot.kind == FORCED:
            statics = statics or bool(slot.statics)
            built.append(PerReplica(slot.unflatten(leaves, StaticOut)))
        elif slot.kind == SHARDED:
            built.append(Sharded(leaves[0], slot.shape))
        else:
            built.append(PerReplica(leaves[0]) if step.out_split[pos] else leaves[0])
        pos += slot.size
    result = step.out_treedef.unflatten(built)
    return (WithStatics.of(result) if statics else result), built


def _unbound_axis(call: ReplicaCall, error: NameError) -> Exception:
    match = _UNBOUND_AXIS.search(str(error))
    if match is None:
        return error
    name, axis_name = match.group(1), call.strategy.axis_name
    return UnboundAxisError(
        f"{call.name} runs a collective over the axis name {name!r}, but the strategy's axis "
        f"name is {axis_name!r}, so {name!r} is not bound. Models written for jax.pmap often "
        f"hard-code it (flax's BatchNorm(axis_name={name!r})): create the strategy with "
        f"jm.MirroredStrategy(axis_name={name!r}), or use the strategy's axis name "
        "(jm.replica_context().axis_name) in the model. A BatchNorm converted by "
        "jm.sync_batch_norm(model) took the axis name of the current strategy then: pass the "
        "strategy that runs the step, jm.sync_batch_norm(model, strategy)."
    )


class UnboundAxisError(NameError, ValueError):
    """A collective over an axis name the strategy does not bind: a `NameError` as JAX raises
    it, and a `ValueError` as jmirror's errors about what the user passed are."""
