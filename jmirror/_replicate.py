"""`jm.replicate`: compiling a replica function for every device of a strategy.

For each input signature it

1. traces the replica function into a jaxpr under `jax.pmap` semantics and proves which
   outputs are identical on every replica (`jmirror._tracing`);
2. runs that jaxpr with the strategy's backend (`jmirror._backends`) inside one `jax.jit`
   (whose C++ dispatch makes repeated calls cheap): identical outputs come back mirrored,
   the others as `PerReplica`, `SyncOnRead` outputs as `SyncOnRead`.

Each call goes through the strategy's dispatch policy (`jmirror._dispatch`): donated arguments
are checked, the call waits for room in the bound on steps in flight, and the step is tracked
by a scalar token the compiled step returns beside its result. What a call does in Python does
not grow with the tree: the donation policy is decided once per input signature, the donated
check is C-level passes, and the warnings about arguments (host batches, pmap-layout arrays,
retracing) look at the arguments only when a call compiled.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from jmirror import _context, _dispatch, _mirrored_state, _nnx, _step_stats
from jmirror._adapter import Adapted, Adapter
from jmirror._backends import Output, executable
from jmirror._context import Runner
from jmirror._interrupts import HELD
from jmirror._mirrored_state import MirroredStateWarning, Traced
from jmirror._process_ops import globalize
from jmirror._shim import compiled_count
from jmirror._topology import Declared, declared_leaves
from jmirror._tracing import (
    FORCED,
    SHARDED,
    SPLIT,
    STORAGE,
    ReplicaCall,
    flatten_slots,
    trace_and_prove,
)
from jmirror._values import PerReplica, Sharded, SyncOnRead, is_distributed

# More input signatures than this compiled by one replicated function earn a warning.
_RETRACE_WARNING_AT = 8
# The kinds of argument that run through a variant of the replica function.
ADAPTERS: tuple[Adapter, ...] = (_nnx.ADAPTER,)


@dataclasses.dataclass(frozen=True)
class _Step:
    """One replica function compiled: the user's own, or an adapter's variant of it. Two
    `jax.jit`s of each (with the requested donation, and without it where the donation
    policy skips it): `jitted` returns the result and an in-flight token, `lowerable` (for
    `.lower()`) the result only."""

    jitted: dict[bool, Any]
    lowerable: dict[bool, Any]


class Replicated:
    """A replica function compiled for every device of a strategy (see `jm.replicate`).

    Call it like the original function; `.lower(*args, **kwargs)` returns the
    `jax.stages.Lowered` step for HLO inspection.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        strategy: Runner | None,
        donate_argnums: tuple[int, ...],
        static_argnums: tuple[int, ...],
        per_replica: Any = None,
    ):
        self._fn = fn
        self._strategy = strategy
        self._donate = donate_argnums
        self._static = static_argnums
        self._per_replica = per_replica
        self._min_args = max(static_argnums) + 1 if static_argnums else 0
        # The input signatures traced by calls, plain or under an outer transformation
        # (never by .lower()): what `num_compilations` counts.
        self._signatures: set[tuple] = set()
        # Those of plain calls only: what the retracing warning counts.
        self._plain_signatures: set[tuple] = set()
        # The last strategy called on and its `Donation` of `donate_argnums`.
        self._donation: tuple[Any, _dispatch.Donation] | None = None
        self._warned: set[str] = set()
        # While calls keep compiling (or keep passing arrays not placed yet), state not yet
        # mirrored (on one device, on the host) is placed mirrored before the call: the next
        # call, with the mirrored state the first wrote back or returned, finds the step
        # compiled.
        self._placing = True
        # One jax.jit around the whole step: its C++ dispatch flattens the arguments
        # (PerReplica and SyncOnRead are pytree nodes), checks the signature and runs the
        # cached program. The strategy is a static argument.
        self._own = self._compile(fn, None, None)
        # The variants of `fn` that adapters ask for (`jmirror._adapter`), by key.
        self._variants: dict[Hashable, _Step] = {}
        self._calls = 0  # the calls so far: a call's number in a profiler trace is one less
        functools.update_wrapper(self, fn)
        name = getattr(fn, "__name__", None)  # the name of its row and its profiler steps
        self._name = name if isinstance(name, str) else repr(self)

    def _compile(
        self, fn: Callable[..., Any], variant: Hashable, check: Callable[[Traced], None] | None
    ) -> _Step:
        """The step of replica function `fn`: the user's own when `variant` is None, else an
        adapter's variant, whose result `check` looks at (`Adapted.check`)."""
        static = (0,) + tuple(i + 1 for i in self._static)
        donate = tuple(i + 1 for i in self._donate)

        def entry(strategy: Runner, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
            self._signatures.add((variant, *self._signature(args, kwargs)))
            return self._step(fn, check, True, strategy, *args, **kwargs)

        def entry_result(strategy: Runner, *args: Any, **kwargs: Any) -> Any:
            return self._step(fn, check, False, strategy, *args, **kwargs)[0]

        def jitted(entry: Callable[..., Any]) -> dict[bool, Any]:
            return {
                True: jax.jit(entry, static_argnums=static, donate_argnums=donate),
                False: jax.jit(entry, static_argnums=static),
            }

        return _Step(jitted(entry), jitted(entry_result))

    def _adapt(self, args: tuple, kwargs: dict) -> tuple[_Step, Adapted | None]:
        """The step that runs this call, and the adapter's `Adapted` when one took it."""
        for adapter in ADAPTERS:
            adapted = adapter.adapt(args, kwargs, self._static)
            if adapted is not None:
                step = self._variants.get(adapted.variant)
                if step is None:
                    fn = adapted.make(self._fn, repr(self))
                    step = self._compile(fn, adapted.variant, adapted.check)
                    self._variants[adapted.variant] = step
                return step, adapted
        return self._own, None

    def _donation_on(self, strategy: Runner) -> _dispatch.Donation:
        """The donation of `donate_argnums` under `strategy`'s policy (kept for the next call)."""
        last = self._donation
        if last is not None and last[0] is strategy:
            return last[1]
        donation = _dispatch.Donation(strategy.dispatch, self._donate)
        self._donation = (strategy, donation)
        return donation

    def __repr__(self) -> str:
        name = getattr(self._fn, "__qualname__", repr(self._fn))
        return f"<jm.replicate({name})>"

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return self
        return functools.partial(self, instance)

    # --- calling -------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Where the time goes (jmirror._step_stats): this call's time in jmirror counts in
        # strategy.step_stats(), and inside a jax.profiler trace the call is a step event.
        began = _step_stats.clock()
        self._calls += 1
        try:
            if not _step_stats.tracing():
                return self._call(args, kwargs)
            with _step_stats.annotation(self._name, self._calls - 1):
                return self._call(args, kwargs)
        finally:
            _step_stats.ended(began)

    def _call(self, args: tuple, kwargs: dict) -> Any:
        # A keyboard interrupt waits for the call: a step that returned has donated nothing
        # in vain, and an NNX object is never left half written back.
        with HELD:
            step, adapted = self._adapt(args, kwargs)
            result = self._run(step, adapted, args, kwargs)
            return result if adapted is None else adapted.finish(result)

    def _run(self, step: _Step, adapted: Adapted | None, args: tuple, kwargs: dict) -> Any:
        strategy = self._check_call(args)
        if strategy.topology.process_count > 1:
            args, kwargs = self._globalize(strategy, args, kwargs)
        given = args, kwargs  # what the warnings about arguments look at
        if strategy.topology.process_count == 1 and self._placing:
            if adapted is not None:
                adapted.settle(functools.partial(_first_component, strategy.topology))
            args, kwargs = self._place_state(strategy, args, kwargs)
        donate = self._donation_on(strategy).check(self, args, kwargs)
        strategy.dispatch.wait_for_room()
        jitted = step.jitted[donate]
        compiled = self._compiled(jitted)
        with strategy.dispatch.bounded(self):  # a cheap step may run (and wait) inline
            try:
                result, token = self._dispatch(strategy, jitted, args, kwargs)
            except Exception:
                # Name pmap leftovers and host batches before JAX's own error about them.
                self._warn_of_arguments(strategy, *given)
                raise
        if isinstance(token, jax.core.Tracer):
            # Traced by the caller's own transformation (jit, grad, vmap, scan, ...): JAX
            # dispatches it, so there is nothing to bound and no compilation of ours to count.
            return result
        strategy.dispatch.track(token, self)
        compiled_now = self._compiled(jitted) != compiled
        # Placing goes on while calls compile, or keep passing values it places (a numpy
        # array every call): those then find the step compiled for mirrored arrays.
        self._placing = compiled_now or args is not given[0] or kwargs is not given[1]
        if compiled_now:
            self._check_new_signature(strategy, *given)
        return result

    def _dispatch(self, strategy: Runner, jitted: Any, args: tuple, kwargs: dict) -> Any:
        # With replicas spanning devices the strategy's mesh is in context while the step is
        # traced and lowered: `axis_index` inside a scan, cond or while body lowers through it.
        with strategy.topology.mesh_scope():
            try:
                return jitted(strategy, *args, **kwargs)
            except ValueError:
                # jax.jit refuses arrays committed to other devices; move them (rare), retry.
                placed = self._place(strategy, args, kwargs)
                if placed is None:
                    raise
                args, kwargs = placed
                return jitted(strategy, *args, **kwargs)

    def _compiled(self, jitted: Any) -> tuple[int | None, int]:
        """What changes when a call compiles: the jit's cache entries, the signatures traced."""
        return compiled_count(jitted), len(self._signatures)

    def _globalize(self, strategy: Runner, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """With several processes: per-replica arguments of this process's components, global."""
        topology = strategy.topology
        args = tuple(a if i in self._static else globalize(topology, a) for i, a in enumerate(args))
        return args, globalize(topology, kwargs)

    def _check_new_signature(self, strategy: Runner, args: tuple, kwargs: dict) -> None:
        """After a call that compiled: the warnings about its arguments, and of a step that
        keeps retracing."""
        self._warn_of_arguments(strategy, args, kwargs)
        self._plain_signatures.add(self._signature(args, kwargs))
        if len(self._plain_signatures) > _RETRACE_WARNING_AT:
            seen: dict[str, set[tuple]] = {}
            for signature in self._plain_signatures:
                for where, shape, dtype in signature[2]:
                    seen.setdefault(where, set()).add((shape, dtype))
            changing = [(p, sorted(s)) for p, s in seen.items() if len(s) > 1]
            shown = "; ".join(
                f"{p}: " + ", ".join(f"{shape} {dtype}" for shape, dtype in s[:4])
                for p, s in changing[:5]
            )
            message = _RETRACING.format(
                fn=self,
                k=len(self._plain_signatures),
                changing=shown or _STRUCTURE_CHANGES,
            )
            self._warn_once("retrace", message)

    def _warn_of_arguments(self, strategy: Runner, args: tuple, kwargs: dict) -> None:
        """Warns of host batches broadcast every call and of pmap-layout arrays passed as
        plain arguments (once each per function)."""
        dynamic = tuple(a for i, a in enumerate(args) if i not in self._static)
        nodes = jax.tree_util.tree_flatten_with_path((dynamic, kwargs), is_leaf=is_distributed)[0]
        n = strategy.num_replicas
        topology = strategy.topology
        for path, node in nodes:
            if isinstance(node, np.ndarray) and node.ndim and node.shape[0] == n:
                where = _argument_path(path, self._static)
                message = _HOST_BATCH.format(fn=self, shape=node.shape, path=where, n=n)
                self._warn_once("host batch", message)
            elif isinstance(node, jax.Array) and topology.is_pmap_layout(node):
                where = _argument_path(path, self._static)
                message = _PMAP_LAYOUT.format(fn=self, shape=node.shape, path=where, n=n)
                self._warn_once("pmap layout", message)

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(message, UserWarning, stacklevel=_caller_level())

    def _place_state(self, strategy: Runner, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The arguments with every array leaf outside `PerReplica` / `SyncOnRead` values that
        is not yet placed on the strategy's devices (a numpy array, an array not committed
        to devices or on others) placed mirrored; NNX objects included (their copies: the
        caller's objects are written back as before)."""
        topology = strategy.topology
        dynamic = [i for i in range(len(args)) if i not in self._static]
        tree = ([args[i] for i in dynamic], kwargs)
        treedef = jax.tree_util.tree_structure(tree, is_leaf=is_distributed)
        placed, moved = [], False
        devices = topology.device_set
        for path, x, like in declared_leaves(tree, is_leaf=is_distributed):
            if isinstance(x, jax.core.Tracer):
                return args, kwargs  # traced by the caller's own transformation: JAX places
            if type(x) is np.ndarray or (
                isinstance(x, jax.Array)
                and not x.is_deleted()
                and (not x.committed or x.sharding.device_set != devices)
            ):
                # Mirrored, laid out as the step lays it out (k > 1).
                sharding = topology.leaf_sharding(path[2:], like, repr(self))
                x, moved = jax.device_put(x, sharding), True
            placed.append(x)
        if not moved:
            return args, kwargs
        new_dynamic, new_kwargs = treedef.unflatten(placed)
        new_args = list(args)
        for i, a in zip(dynamic, new_dynamic):
            new_args[i] = a
        return tuple(new_args), new_kwargs

    def _place(self, strategy: Runner, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """Arguments with arrays on other devices moved onto the strategy's; None if none are."""
        moved = []
        topology = strategy.topology

        def place(x: Any, sharding: Any) -> Any:
            if isinstance(x, jax.Array) and not topology.is_placed(x):
                moved.append(x)
                return jax.device_put(x, sharding)
            return x

        def split(v: Any) -> Any:
            if jnp.shape(v)[:1] != (topology.num_replicas,):
                raise self._bad_split(strategy, args, kwargs, v)
            if isinstance(v, jax.Array) and not v.sharding.is_equivalent_to(
                topology.stacked, v.ndim
            ):
                # Stacked over these devices in another order (another strategy's batch):
                # slice i goes to this strategy's replica i.
                moved.append(v)
                return jax.device_put(v, topology.stacked)
            return place(v, topology.stacked)

        def node(x: Any) -> Any:
            if is_distributed(x):
                return jax.tree.map(split, x)
            return place(x, topology.mirrored)

        new_args = tuple(
            a if i in self._static else jax.tree.map(node, a, is_leaf=is_distributed)
            for i, a in enumerate(args)
        )
        new_kwargs = jax.tree.map(node, kwargs, is_leaf=is_distributed)
        return (new_args, new_kwargs) if moved else None

    def lower(self, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        """Returns the `jax.stages.Lowered` of the step for these arguments.

        Example:
            >>> import jax, jax.numpy as jnp, jmirror as jm
            >>> step = jm.replicate(lambda x: jm.all_reduce("sum", x))
            >>> isinstance(step.lower(jnp.ones(3)), jax.stages.Lowered)
            True
        """
        step, _ = self._adapt(args, kwargs)
        strategy = self._check_call(args)
        lowerable = step.lowerable[self._donation_on(strategy).donates(args)]
        with strategy.topology.mesh_scope():
            return lowerable.lower(strategy, *args, **kwargs)

    @property
    def num_compilations(self) -> int:
        """How many input signatures calls have compiled so far (`.lower()` and calls traced
        by an outer transformation do not count)."""
        return len(self._signatures)

    def _check_call(self, args: tuple) -> Any:
        if _context.in_replica_context() or _context.merge_context() is not None:
            raise RuntimeError(
                f"{self!r} was called inside another replicated function; replicated functions "
                "do not nest. Call the inner function directly: it already runs per replica."
            )
        if len(args) < self._min_args:
            raise ValueError(
                f"{self!r} has static_argnums={self._static}, but was called with "
                f"{len(args)} positional argument(s); pass the static arguments positionally."
            )
        if self._strategy is not None:
            return self._strategy
        return _context.current_strategy()

    # --- tracing: once per input signature, inside jax.jit -------------------------------------

    def _signature(self, args: tuple, kwargs: dict) -> tuple:
        """The static arguments, the tree structure (static pytree fields included), and each
        argument leaf's path, shape and dtype."""
        statics = tuple(args[i] for i in self._static)
        dynamic = tuple(a for i, a in enumerate(args) if i not in self._static)
        leaves, treedef = jax.tree_util.tree_flatten_with_path((dynamic, kwargs))
        return (
            statics,
            treedef,
            tuple(
                (_argument_path(p, self._static), jnp.shape(x), str(jnp.result_type(x)))
                for p, x in leaves
            ),
        )

    def _step(
        self,
        fn: Callable[..., Any],
        check: Callable[[Traced], None] | None,
        with_token: bool,
        strategy: Runner,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[Any, jax.Array | None]:
        """The traced step: the result, and (`with_token`) a scalar for the in-flight bound.

        The token is an output of the same program, ready when every output is: waiting on it
        waits for the step, and keeping it keeps no large output alive. A step with no array
        output (none at all, or only float0 gradients) gets one too, for `.lower()` as well.
        """
        statics = tuple(args[i] for i in self._static)
        dynamic = tuple(a for i, a in enumerate(args) if i not in self._static)
        top, treedef = jax.tree_util.tree_flatten((dynamic, kwargs), is_leaf=is_distributed)
        if check is None:  # what no adapter took: refuse what one would have had to
            for adapter in ADAPTERS:
                adapter.check_plain(repr(self), treedef)
        flat, slots = flatten_slots(top, inputs=True)
        split = [slot.kind in (SPLIT, SHARDED) for slot in slots for _ in range(slot.size)]
        avals = []
        for leaf, s in zip(flat, split):
            aval = jax.typeof(leaf)
            shape = aval.shape
            if s:
                if not shape or shape[0] != strategy.num_replicas:
                    raise self._bad_split(strategy, args, kwargs, leaf)
                shape = shape[1:]
            avals.append(jax.ShapeDtypeStruct(shape, aval.dtype, weak_type=aval.weak_type))
        call = ReplicaCall(
            fn,
            repr(self),
            strategy,
            treedef,
            tuple(slots),
            statics,
            self._static,
            len(args),
            tuple(split),
        )
        step = trace_and_prove(call, avals)
        out_split = step.out_split
        needs_token = with_token or all(
            aval.dtype == jax.dtypes.float0 for aval in step.closed.out_avals
        )
        backend = executable(strategy.backend, strategy.topology)
        out_paths = None
        if strategy.topology.devices_per_replica > 1:  # mirrored outputs laid out by the rules
            out_paths = self._out_paths(fn, step)
        run = backend(strategy.topology, step.closed, split, out_split, needs_token, out_paths)
        outs = run(*flat)
        built, pos = [], 0
        for slot in step.out_slots:
            leaves = outs[pos : pos + slot.size]
            if slot.kind == STORAGE:
                built.append(SyncOnRead(slot.treedef.unflatten(leaves), slot.aggregation))
            elif slot.kind == FORCED:
                built.append(PerReplica(slot.treedef.unflatten(leaves)))
            elif slot.kind == SHARDED:
                built.append(Sharded(leaves[0], slot.aggregation))
            else:
                built.append(PerReplica(leaves[0]) if out_split[pos] else leaves[0])
            pos += slot.size
        result = step.out_treedef.unflatten(built)
        forced = frozenset(id(b) for b, s in zip(built, step.out_slots) if s.kind == FORCED)
        self._check_state(check, (dynamic, kwargs), result, forced)
        return result, (outs[-1] if needs_token else None)

    @staticmethod
    def _out_paths(fn: Callable[..., Any], step: Any) -> list[Any]:
        """What each flat output of `step` stands for as the layout rules see it
        (`jmirror._backends.Output`): its path in the result, with a linen box's metadata
        or, through an adapter's variant (`output_path`), the state it is written back to."""
        avals, starts, pos = step.closed.out_avals, [], 0
        for slot in step.out_slots:
            starts.append(pos)
            pos += slot.size
        shapes = [jax.ShapeDtypeStruct(avals[i].shape, avals[i].dtype) for i in starts]
        top = step.out_treedef.unflatten(shapes)
        output_path = getattr(fn, "output_path", None)  # an adapter's variant (_adapter)
        out_paths = []
        for (path, _, like), slot in zip(declared_leaves(top), step.out_slots):
            entry = output_path(path) if output_path is not None else path
            if isinstance(like, Declared) and not isinstance(entry, Output):
                entry = Output(path, like)
            out_paths.extend([entry] * slot.size)
        return out_paths

    def _check_state(
        self, check: Callable[[Traced], None] | None, inputs: tuple, result: Any, forced: Any
    ) -> None:
        """Mirrored state stays mirrored (`jmirror._mirrored_state`): at trace time, before
        anything runs or is donated, the adapter's check of its variant, or for the user's
        own function the check of returned dataclass state and the warning of plain state."""
        traced = Traced(
            repr(self),
            inputs,
            result,
            forced,
            self._per_replica,
            lambda path: _argument_path(path, self._static),
        )
        if check is not None:
            check(traced)
            return
        diverged = _mirrored_state.check_returned(traced)
        if diverged and "mirrored state" not in self._warned:
            self._warned.add("mirrored state")
            message = _mirrored_state.warning(repr(self), diverged)
            warnings.warn(message, MirroredStateWarning, stacklevel=_caller_level())

    def _bad_split(self, strategy: Runner, args: tuple, kwargs: dict, leaf: Any) -> ValueError:
        path = "<unknown>"
        for p, candidate in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]:
            if candidate is leaf:
                path = ("args" if p[0].idx == 0 else "kwargs") + jax.tree_util.keystr(p[1:])
        found = f"{self!r} got a per-replica leaf of shape {tuple(jnp.shape(leaf))} at {path}"
        if path.endswith(".shards"):  # a jm.shard_update state made for another N
            return ValueError(
                f"{self!r} got a jm.Sharded state leaf at {path} whose pieces have shape "
                f"{tuple(jnp.shape(leaf))}, cut for another replica count; the strategy has "
                f"{strategy.num_replicas} replicas. Restore the state through jmirror.checkpoint "
                "(which re-shards it onto any replica count), or call tx.init on this strategy."
            )
        if strategy.topology.is_stacked_elsewhere(leaf):
            # Placed per replica by another strategy: a notebook cell re-run after the
            # strategy was created again, say.
            return ValueError(
                f"{found}, placed per replica over the {len(leaf.sharding.device_set)} "
                "device(s) of another strategy: it came from that strategy's "
                "distribute_dataset (or one of its steps), not from this strategy's "
                f"({strategy.num_replicas} replicas). A "
                "batch belongs to the strategy that placed it: after creating the strategy "
                "again (as re-running a notebook cell does), call the new strategy's "
                "distribute_dataset again."
            )
        return ValueError(
            f"{found}; a "
            f"PerReplica / SyncOnRead leaf needs a leading axis of size {strategy.num_replicas} "
            "(the number of replicas), one slice per replica. Reshape the global batch to "
            "(num_replicas, per_replica_batch, ...) or use strategy.distribute_dataset, which "
            "does this for you."
        )


_HOST_BATCH = (
    "{fn} got a numpy array of shape {shape} at {path}, whose leading axis equals the {n} "
    "replicas, as a plain argument: it is transferred whole to every device on every call, and "
    "every replica sees all of it. If it is a per-replica batch (such as flax's "
    "common_utils.shard output), wrap it as jm.PerReplica(batch) or let "
    "strategy.distribute_dataset place the batches; if it is state, place it once with "
    "strategy.mirror(x) and pass the mirrored value."
)
_PMAP_LAYOUT = (
    "{fn} got a jax.Array of shape {shape} at {path} laid out the jax.pmap way (its leading "
    "axis of {n} split over the strategy's {n} devices, as flax.jax_utils.prefetch_to_device "
    "and jax_utils.replicate return it) as a plain argument: it is broadcast whole, so every "
    "replica sees all {n} slices (a replicated state keeps its extra leading axis). If it is a "
    "per-replica batch, wrap it as jm.PerReplica(x), and each replica sees its own slice "
    "(strategy.distribute_dataset places batches that way); if it is replicated state, mirror "
    "it once with strategy.mirror(jax_utils.unreplicate(x)) and pass the mirrored value."
)
_RETRACING = (
    "{fn} has compiled {k} input signatures: every new shape, dtype or tree structure of its "
    "arguments compiles the step again. Arguments that keep changing: {changing}. Pad batches "
    "to fixed shapes (strategy.distribute_dataset(..., remainder='pad') keeps every batch's "
    "shape), and pass Python values that change as static_argnums only when few."
)


_STRUCTURE_CHANGES = (
    "(the tree structure changes: a static pytree field, such as a flax struct.field("
    "pytree_node=False) or an NNX model's train()/eval() mode, that differs between calls)"
)


def _first_component(topology: Any, value: Any) -> jax.Array:
    """Per-replica components of `value`: `value` on replica 0, zero on the others."""
    value = jnp.asarray(value)
    stacked = jnp.zeros((topology.num_replicas, *value.shape), value.dtype).at[0].set(value)
    return jax.device_put(stacked, topology.stacked)


def _caller_level() -> int:
    """The `stacklevel` of the first frame outside this module: the caller's."""
    frame, level = inspect.currentframe(), 0
    while frame is not None and frame.f_code.co_filename == __file__:
        frame, level = frame.f_back, level + 1
    return level


def _argument_path(path: tuple, static: Sequence[int]) -> str:
    """`args[i]...` / `kwargs[...]` for a path into `((dynamic args), kwargs)`."""
    first, rest = path[0], path[1:]
    if first.idx == 1:
        return "kwargs" + jax.tree_util.keystr(rest)
    i = rest[0].idx
    dynamic = [j for j in range(i + len(static) + 1) if j not in static]
    return f"args[{dynamic[i]}]" + jax.tree_util.keystr(rest[1:])


def _argnums(name: str, value: int | Sequence[int]) -> tuple[int, ...]:
    values = (value,) if isinstance(value, int) else tuple(value)
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise TypeError(f"jm.replicate({name}=...) expects non-negative ints, got {value!r}.")
    return values


def replicate(
    fn: Callable[..., Any] | None = None,
    *,
    strategy: Runner | None = None,
    donate_argnums: int | Sequence[int] = (),
    static_argnums: int | Sequence[int] = (),
    per_replica: Any = None,
) -> Any:
    """Compiles a replica function to run on every device of a strategy.

    Usable as `jm.replicate(train_step)`, `@jm.replicate` and `@jm.replicate(strategy=s)`.
    Inside the function each replica sees its own component of every `PerReplica` /
    `SyncOnRead` argument; mirrored arrays are passed without a copy and any other array or
    scalar is broadcast. Gradients have `jax.pmap` semantics: the gradient with respect to a
    mirrored input is the replica's own (all-reduce it to train like one device). Outputs that
    jmirror proves identical on every replica come back mirrored, `SyncOnRead` outputs stay
    `SyncOnRead`, and every other leaf comes back as a `PerReplica`.

    flax NNX objects (`nnx.Module`, `nnx.Optimizer`, `nnx.Rngs`, `nnx.Variable`, metrics; also
    as items of a tuple, list or dict argument) are taken with `nnx.jit`'s semantics: what the
    function changes in them is written back into the caller's objects after the call,
    mirrored where proven identical, else as a `PerReplica` inside the `Variable`; metrics
    come back sync-on-read (`strategy.read(metrics).compute()`). Inside, every `nnx.Rngs`
    stream but `params` draws per replica (the replica id folded into its key) while its
    state stays mirrored; `jm.sync(rngs.noise(), "only_first_replica")` gives every replica
    the same key.

    Args:
      fn: the replica function.
      strategy: the `MirroredStrategy` to run on; `None` means `jm.get_strategy()` at call
        time.
      donate_argnums: positional arguments whose buffers the step may reuse. With the
        strategy's `donation="auto"` (the default), on several XLA:CPU host devices an
        argument holding a leaf of 8 MiB or more is not donated, since donating it is slower
        there (the step then holds its inputs and outputs at once); `donation="always"`
        donates exactly these arguments. A donated argument is deleted by the call: passing
        it again is a `ValueError`.
      static_argnums: positional arguments that are static (hashed, not traced).
      per_replica: state kept per replica on purpose. State that enters mirrored and would
        leave not proven mirrored (an NNX `Variable` written back, a field of a returned
        `TrainState` or other dataclass) is a `jm.MirroredStateError` raised by the first
        call, before anything runs; a returned plain pytree shaped like a mirrored argument
        earns a `jm.MirroredStateWarning`. `per_replica` declares what may differ: an NNX
        filter (a `Variable` type such as `nnx.BatchStat`, `...` for all, a path predicate)
        or, for pytrees, a callable `(path, leaf) -> bool` (`path` inside the state). What
        it matches comes back as a `PerReplica`.

    Returns:
      A callable with the signature of `fn`, compiled once per input signature.

    Example:
        >>> import jax, jax.numpy as jnp, jmirror as jm
        >>> strategy = jm.MirroredStrategy()
        >>> @jm.replicate(strategy=strategy)
        ... def step(w, x):
        ...     grad = jax.grad(lambda w: jnp.mean((x * w - 1.0) ** 2))(w)
        ...     return w - 0.1 * jm.all_reduce("mean", grad)
        >>> w = strategy.mirror(jnp.zeros(()))
        >>> x = jm.PerReplica(jnp.ones((strategy.num_replicas, 4)))
        >>> new_w = step(w, x)  # mirrored: proven identical on every replica
        >>> round(float(strategy.read(new_w)), 4)
        0.2
        >>> isinstance(new_w, jm.PerReplica)
        False

        An NNX object changed in place is written back, as `nnx.jit` does:

        >>> from flax import nnx
        >>> counter = nnx.Variable(jnp.zeros(()))
        >>> @jm.replicate(strategy=strategy)
        ... def bump(counter):
        ...     counter[...] += 1.0
        >>> bump(counter); bump(counter)
        >>> float(strategy.read(counter[...]))
        2.0
    """
    if fn is None:
        return functools.partial(
            replicate,
            strategy=strategy,
            donate_argnums=donate_argnums,
            static_argnums=static_argnums,
            per_replica=per_replica,
        )
    if not callable(fn):
        raise TypeError(f"jm.replicate expects a callable, got {fn!r}.")
    static = _argnums("static_argnums", static_argnums)
    donate = _argnums("donate_argnums", donate_argnums)
    if set(static) & set(donate):
        raise ValueError(
            f"jm.replicate got argument(s) {sorted(set(static) & set(donate))} in both "
            "static_argnums and donate_argnums; a static argument has no buffer to donate."
        )
    return Replicated(fn, strategy, donate, static, per_replica)
