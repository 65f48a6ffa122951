"""Builds the body of a replicated step, the function each `jax.jit` of `jm.replicate` traces.

For one input signature the body

1. puts the arguments back together from the plan and the traced leaves
   (`jmirror._arguments.Plan.rebuild`);
2. traces the replica function on one replica's shapes and proves its outputs
   (`jmirror._tracing.trace_and_prove`); inside the trace the static leaves are the plan's
   own values, so a static output leaves as the same Python object;
3. runs the proven jaxpr on the strategy's backend (`jmirror._backends`) and rebuilds the
   result (`jmirror._tracing.build_result`);
4. checks, before anything has run, that mirrored state stays mirrored
   (`jmirror._mirrored_state`): an adapter's check of its variant, or the check of returned
   dataclass state and the warning of plain pytrees.

The body returns the result and, for calls, a scalar token that the in-flight bound waits
on (an output of the same program: ready when every output is, and it keeps no large output
alive).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.core

from jmirror import _adapter, _mirrored_state, _proof
from jmirror._arguments import Plan, is_array, is_traced, leaf_policies
from jmirror._backends import Output, executable
from jmirror._call_warnings import argument_path
from jmirror._mirrored_state import Diverged, Traced
from jmirror._placement import split_error
from jmirror._topology import Declared, declared_leaves
from jmirror._tracing import (
    FORCED,
    SHARDED,
    SPLIT,
    STATIC,
    ProvenStep,
    ReplicaCall,
    StaticOut,
    build_result,
    flatten_slots,
    trace_and_prove,
)
from jmirror._values import PerReplica, PyTree, Structure, held_values, is_distributed


@dataclasses.dataclass(frozen=True)
class Body:
    """What the body of one replica function's steps needs besides a call's plan.

    Attributes:
      fn: the replica function (the user's, or an adapter's variant of it).
      name: how errors name the replicated function.
      check: the adapter's trace-time check of its variant (None: the user's function).
      per_replica: the `per_replica=` argument.
      warn: gives the mirrored-state warning of plain pytrees (once).
    """

    fn: Callable[..., Any]
    name: str
    check: Callable[[Traced], list[Diverged]] | None
    per_replica: Any
    warn: Callable[[str], None]

    def __call__(self, with_token: bool, plan: Plan, donated: tuple, others: tuple) -> Any:
        """Returns the traced step's result and (`with_token`) its token."""
        args, kwargs = plan.rebuild(donated, others)
        strategy = plan.strategy
        static_argnums = plan.positions.static_argnums
        statics = tuple(args[i] for i in static_argnums)
        dynamic = tuple(a for i, a in enumerate(args) if i not in static_argnums)
        top, treedef = jax.tree_util.tree_flatten(
            _open_static_holders((dynamic, kwargs)), is_leaf=is_distributed
        )
        # Inside the trace every traced leaf is a tracer: what is not is a static value.
        static = [not (is_distributed(x) or isinstance(x, jax.core.Tracer)) for x in top]
        flat, slots = flatten_slots(top, inputs=True, static=static)
        split = [slot.kind in (SPLIT, SHARDED) for slot in slots for _ in range(slot.size)]
        avals = []
        for leaf, s in zip(flat, split):
            aval = jax.typeof(leaf)
            shape = aval.shape
            if s:
                if not shape or shape[0] != strategy.num_replicas:
                    raise split_error(
                        self.name, strategy.topology, _path_of(args, kwargs, leaf), leaf
                    )
                shape = shape[1:]
            avals.append(jax.ShapeDtypeStruct(shape, aval.dtype, weak_type=aval.weak_type))
        call = ReplicaCall(
            self.fn,
            self.name,
            strategy,
            treedef,
            tuple(slots),
            statics,
            static_argnums,
            len(args),
            tuple(split),
            _out_static,
        )
        step = trace_and_prove(call, avals)
        needs_token = with_token or all(
            aval.dtype == jax.dtypes.float0 for aval in step.closed.out_avals
        )
        topology = strategy.topology
        backend = executable(strategy.backend, topology)
        out_paths = _out_paths(step) if topology.devices_per_replica > 1 else None
        run = backend(topology, step.closed, split, step.out_split, needs_token, out_paths)
        outs = run(*flat)
        result, built = build_result(step, outs)
        forced = frozenset(id(b) for b, s in zip(built, step.out_slots) if s.kind == FORCED)
        # The check sees the result as the function returned it: static values as they are.
        seen = [b.value if isinstance(b, StaticOut) else b for b in built]
        returned = step.out_treedef.unflatten(seen)
        computed_from = _data_flow(step, flat, outs)
        self._check_state(
            (dynamic, kwargs), returned, forced, static_argnums, strategy.axis_name, computed_from
        )
        return result, (outs[-1] if needs_token else None)

    def _check_state(
        self,
        inputs: tuple,
        result: Any,
        forced: Any,
        static: tuple,
        axis_name: str,
        computed_from: Callable[[Any, Any], bool] | None = None,
    ) -> None:
        """Refuses (or warns of) mirrored state that would lose its mirroring."""
        traced = Traced(
            self.name,
            inputs,
            result,
            forced,
            self.per_replica,
            lambda path: argument_path(path, static),
            axis_name,
            computed_from,
        )
        if self.check is not None:
            diverged = self.check(traced)
        else:
            diverged = _mirrored_state.check_returned(traced)
        if diverged:
            self.warn(_mirrored_state.warning(self.name, diverged))


def _data_flow(step: Any, flat: Sequence[Any], outs: Sequence[Any]) -> Callable[[Any, Any], bool]:
    """Returns whether an output leaf of the traced step is computed from an input leaf (the
    leaves as the trace holds them), by the replica jaxpr's data flow, worked out on the first
    question only."""
    inputs = {id(x): i for i, x in enumerate(flat)}
    outputs = {id(x): j for j, x in enumerate(outs)}
    masks: list[int] = []

    def computed_from(out: object, leaf: object) -> bool:
        i, j = inputs.get(id(leaf)), outputs.get(id(out))
        if i is None or j is None:
            return False
        if not masks:
            masks.extend(_proof.dependencies(step.closed))
        return j < len(masks) and bool(masks[j] >> i & 1)

    return computed_from


def _out_static(treedef: Structure, top: list[Any]) -> list[bool]:
    """Returns which top-level leaves of a result are static: inside a node an adapter
    polices (an `eqx.Module`), whatever is not an array; elsewhere what `jax.jit` cannot
    trace (Python numbers become arrays)."""
    static = []
    for x, policy in zip(top, leaf_policies(treedef, _adapter.leaf_policy)):
        if is_distributed(x):
            static.append(False)
        elif policy is not None:
            static.append(not is_array(x))
        else:
            static.append(not is_traced(x))
    return static


def _out_paths(step: ProvenStep) -> list[Any]:
    """Returns what each flat output of `step` stands for as the layout rules see it
    (`jmirror._backends.Output`): its path in the result, with a linen box's metadata, or
    what an adapter's variant says it stands for (`jmirror._adapter.OutputLayout`)."""
    avals, pos = step.closed.out_avals, 0
    shapes = []
    for slot in step.out_slots:
        if slot.kind == STATIC:
            shapes.append(None)
        else:
            shapes.append(jax.ShapeDtypeStruct(avals[pos].shape, avals[pos].dtype))
        pos += slot.size
    top = step.out_treedef.unflatten(shapes)
    statics = [slot.value for slot in step.out_slots if slot.kind == STATIC]
    layout = next((v for v in statics if isinstance(v, _adapter.OutputLayout)), None)
    found = iter(declared_leaves(top))
    out_paths = []
    for slot in step.out_slots:
        if slot.kind == STATIC:
            continue
        path, _, like = next(found)
        entry = layout.output_path(path) if layout is not None else path
        if isinstance(like, Declared) and not isinstance(entry, Output):
            entry = Output(path, like)
        out_paths.extend([entry] * slot.size)
    return out_paths


def _path_of(args: tuple, kwargs: dict, leaf: Any) -> str:
    """Names where `leaf` is in the arguments (for messages)."""
    for p, candidate in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]:
        if candidate is leaf:
            return ("args" if p[0].idx == 0 else "kwargs") + jax.tree_util.keystr(tuple(p[1:]))
    return "<unknown>"


def _open_static_holders(tree: PyTree) -> PyTree:
    """Returns `tree` with each `PerReplica` that holds static leaves (an equinox module's
    functions and flags, which are no replica's slice) opened into its own structure: a
    `PerReplica` per traced leaf, the static leaves as they are. Each replica sees the same."""

    def open_one(x: object) -> object:
        if not isinstance(x, PerReplica):
            return x
        values = held_values(x)
        leaves = jax.tree_util.tree_leaves(values)
        if all(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
            return x
        return jax.tree.map(
            lambda v: PerReplica(v) if isinstance(v, jax.core.Tracer) else v, values
        )

    return jax.tree.map(open_one, tree, is_leaf=is_distributed)
