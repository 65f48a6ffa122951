"""`jm.replicate`: a replica function compiled for every device of a strategy.

A call runs in three parts:

1. **prepare**: an adapter may take the call (`jmirror._adapter`: NNX objects run through a
   variant of the function); the arguments are split into a `Plan` (structure and static
   values, the compilation key) and traced leaves (`jmirror._arguments`); leaves not yet on
   the strategy's devices are placed there (`jmirror._placement`); the donation is decided
   and checked (`jmirror._dispatch.Donation`).
2. **step**: the call waits for room in the bound on steps in flight and runs one
   `jax.jit` of the step's body (`jmirror._step.Body`), whose C++ dispatch makes repeated
   calls cheap; the step's token is tracked.
3. **finish**: the adapter writes state back; after a call that compiled (JAX reported a
   compilation inside it: `jmirror._compilations`), the warnings about its arguments
   (`jmirror._call_warnings`).

What a call does in Python does not grow with the tree beyond C-level passes over its
leaves: one flatten, a set of types, a set of sharding ids.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.core
import numpy as np

from jmirror import (  # noqa: F401 (_flax registers what it knows)
    _adapter,
    _backends,
    _compilations,
    _context,
    _dispatch,
    _equinox,
    _flax,
    _nnx,
    _step_stats,
)
from jmirror._adapter import Adapted
from jmirror._arguments import Arguments, Prepared
from jmirror._call_warnings import CallWarnings
from jmirror._context import Runner
from jmirror._interrupts import HELD
from jmirror._placement import Placement, has_tracers
from jmirror._process_ops import globalize
from jmirror._step import Body
from jmirror._topology import Topology
from jmirror._tracing import restore_statics
from jmirror._values import PyTree

_adapter.register(_nnx.ADAPTER)
_adapter.register(_equinox.ADAPTER)


@dataclasses.dataclass
class _Step:
    """One replica function compiled: the user's own, or an adapter's variant of it. Two
    `jax.jit`s of each (with the requested donation, and without it where the donation
    policy skips it): `jitted` returns the result and an in-flight token, `lowerable` (for
    `.lower()`) the result only. `settled`: a call of it ran without compiling (an adapter's
    fresh state needs no settling any more). `make(with_token, options)` makes the `jax.jit`s
    again with XLA compiler options, which `with_options` gives and keeps.
    """

    jitted: dict[bool, Any]
    lowerable: dict[bool, Any]
    make: Callable[[bool, tuple], dict[bool, Any]]
    settled: bool = False
    _with: dict[tuple, tuple[dict[bool, Any], dict[bool, Any]]] = dataclasses.field(
        default_factory=dict
    )

    def with_options(self, options: tuple) -> tuple[dict[bool, Any], dict[bool, Any]]:
        """Returns `(jitted, lowerable)` compiled with `options` (`()`: XLA's defaults)."""
        if not options:
            return self.jitted, self.lowerable
        if options not in self._with:
            self._with[options] = (self.make(True, options), self.make(False, options))
        return self._with[options]


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
        static_argnames: tuple[str, ...] = (),
        per_replica: PyTree = None,
    ):
        self._fn = fn
        self._strategy = strategy
        self._per_replica = per_replica
        self._name = repr(self)
        self._arguments = Arguments(
            repr(self),
            static_argnums,
            static_argnames,
            donate_argnums,
            _adapter.leaf_policy,
            _adapter.deep,
        )
        self._warnings = CallWarnings(repr(self))
        # The last strategy called on and its `Donation` of `donate_argnums`.
        self._donation: tuple[Any, _dispatch.Donation] | None = None
        # The placement on the last topology called on (what it learned is kept there).
        self._placement: Placement | None = None
        self._compilations = 0  # the XLA compilations its calls caused (`_compilations`)
        _compilations.register()
        self._own = self._compile(fn, None)
        # The variants of `fn` that adapters ask for (`jmirror._adapter`), by key.
        self._variants: dict[Hashable, _Step] = {}
        self._calls = 0  # the calls so far: a call's number in a profiler trace is one less
        functools.update_wrapper(self, fn)
        name = getattr(fn, "__name__", None)  # the name of its row and its profiler steps
        self._step_name = name if isinstance(name, str) else repr(self)

    def _compile(self, fn: Callable[..., Any], check: Callable[..., Any] | None) -> _Step:
        """Returns the `_Step` of replica function `fn` (`check`: an adapter's)."""
        body = Body(fn, repr(self), check, self._per_replica, self._warnings.mirrored_state)
        donate = (1,)

        def jitted(with_token: bool, options: tuple = ()) -> dict[bool, Any]:
            entry = functools.partial(body, with_token)
            if not with_token:
                entry = _result_only(entry)
            xla = dict(options) if options else None
            return {
                True: jax.jit(
                    entry, static_argnums=(0,), donate_argnums=donate, compiler_options=xla
                ),
                False: jax.jit(entry, static_argnums=(0,), compiler_options=xla),
            }

        return _Step(jitted(True), jitted(False), jitted)

    def __repr__(self) -> str:
        return f"<jm.replicate({_function_name(self._fn)})>"

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return self
        return functools.partial(self, instance)

    # --- calling -------------------------------------------------------------------------------

    def __call__(self, *args: PyTree, **kwargs: PyTree) -> PyTree:
        # Where the time goes (jmirror._step_stats): this call's time in jmirror counts in
        # strategy.step_stats(), and inside a jax.profiler trace the call is a step event.
        began = _step_stats.clock()
        self._calls += 1
        try:
            if not _step_stats.tracing():
                return self._call(args, kwargs)
            with _step_stats.annotation(self._step_name, self._calls - 1):
                return self._call(args, kwargs)
        finally:
            _step_stats.ended(began)

    def _call(self, args: tuple, kwargs: dict) -> PyTree:
        # A keyboard interrupt waits for the call: a step that returned has donated nothing
        # in vain, and an NNX object is never left half written back.
        with HELD:
            strategy = self._check_call(args)
            step, adapted, (prepared, donate, traced) = self._adapt_and_prepare(
                strategy, args, kwargs, settle=True
            )
            result = self._run(strategy, step, prepared, donate, traced)
            return result if adapted is None else adapted.finish(result)

    def _adapt_and_prepare(
        self, strategy: Runner, args: tuple, kwargs: dict, settle: bool
    ) -> tuple[_Step, Adapted | None, tuple[Prepared, bool, bool]]:
        """Returns the step that runs this call, the adapter's `Adapted` when one took it,
        and the call prepared (`_prepare`). An adapter's kind found deeper in the arguments
        than its quick look reaches (an NNX object two containers deep) is adapted then."""
        deep = False
        while True:
            step, adapted = self._adapt(args, kwargs, deep)
            flat = None
            if adapted is not None:
                flat = adapted.flat
                if settle and not step.settled:
                    adapted.settle(functools.partial(_first_component, strategy.topology))
                    flat = None  # settling may have changed the state's leaves
            shared = adapted is not None and adapted.shared
            prepared = self._prepare(strategy, args, kwargs, flat, shared, adapted is None)
            if prepared is not None:
                return step, adapted, prepared
            deep = True

    def _adapt(self, args: tuple, kwargs: dict, deep: bool = False) -> tuple[_Step, Adapted | None]:
        """Returns the step that runs this call, and the adapter's `Adapted` when one took it
        (`deep`: an adapter's kind is in the arguments, beyond its quick look)."""
        adapted = _adapter.adapt(args, kwargs, self._arguments.static_argnums, deep)
        if adapted is None:
            return self._own, None
        step = self._variants.get(adapted.variant)
        if step is None:
            fn = adapted.make(self._fn, repr(self))
            step = self._variants[adapted.variant] = self._compile(fn, adapted.check)
        return step, adapted

    def _prepare(
        self,
        strategy: Runner,
        args: tuple,
        kwargs: dict,
        flat: dict | None = None,
        shared: bool = False,
        plain: bool = False,
    ) -> tuple[Prepared, bool, bool] | None:
        """Splits, places and checks a call's arguments (`flat`: already flattened by an
        adapter; `shared`: they reach a leaf twice through one holder, `Adapted.shared`);
        returns them, whether the call donates and whether it is inside the caller's own
        transformation (holds tracers). Returns None for a call no adapter took (`plain`)
        whose arguments hold an adapter's kind after all (`Layout.deep`)."""
        topology = strategy.topology
        several = topology.process_count > 1
        if several:
            args, kwargs = self._globalize(topology, args, kwargs)
            flat = None  # globalizing replaced this process's components
        prepared, leaves, types = self._arguments.prepare(strategy, args, kwargs, flat)
        if plain and prepared.plan.layout.deep:
            return None
        placement = self._placement
        if placement is None or placement.topology is not topology:
            placement = self._placement = Placement(topology)
        layout = prepared.plan.layout
        where = prepared.plan.positions.where
        statics = prepared.plan.statics
        placed = placement.place(self._name, layout, leaves, types, prepared.tree, where, statics)
        if placed is not None:
            if placed[1]:
                # What needed placing may be a pmap leftover or a host batch: say so.
                self._warnings.of_arguments(*self._warning_args(strategy, prepared))
            prepared = prepared.with_leaves(placed[0])
        donate = self._donation_on(strategy).check_prepared(self, prepared, shared)
        traced = has_tracers(types)
        if (several or topology.num_devices > 1) and not traced:
            # jaxlib raises on a deleted buffer when one device runs the step (`_dispatch`
            # names it then), and ends the process when several do.
            _dispatch.refuse_deleted(self, prepared, donated_checked=donate)
        return prepared, donate, traced

    def _run(
        self, strategy: Runner, step: _Step, prepared: Prepared, donate: bool, traced: bool
    ) -> PyTree:
        """Runs the step within the bound on steps in flight; warns after it compiled."""
        dispatch = strategy.dispatch
        dispatch.wait_for_room()
        before = _compilations.on_this_thread()
        if dispatch.timeout_s is None and strategy.topology.devices_per_replica == 1:
            # The common call: no deadline across processes, no mesh to set.
            result, token = self._dispatch(strategy, step.jitted[donate], prepared)
        else:
            scope, inside = strategy.topology.call_scope(traced)
            # Inside the caller's own jit, the options are its to give (JAX takes them only
            # at the top level).
            options = _backends.compiler_options(strategy.topology)
            if inside and options:
                self._warnings.options_outside(options, prepared)
                options = ()
            jitted = step.with_options(options)[0][donate]
            with dispatch.bounded(self), scope:
                # With replicas spanning devices the mesh is in context while the step is
                # traced and lowered: `axis_index` inside a scan, cond or while body lowers
                # through it.
                result, token = self._dispatch(strategy, jitted, prepared)
        result = restore_statics(result)
        compiled = 0 if traced else _compilations.on_this_thread() - before
        # Called inside the caller's own transformation (jit, grad, vmap, scan, ...), what an
        # eager grad or vmap compiled is the transformation's program, not a step's.
        self._compilations += compiled
        if isinstance(token, jax.core.Tracer):
            # Traced by that transformation: JAX dispatches it, nothing to bound.
            return result
        dispatch.track(token, self)
        if compiled:
            plan = prepared.plan
            warning_args = self._warning_args(strategy, prepared)
            self._warnings.after_compile(
                *warning_args, statics=plan.statics, named=plan.static_arguments()
            )
        else:
            step.settled = True
        return result

    def _dispatch(self, strategy: Runner, jitted: Any, prepared: Prepared) -> tuple:
        """Calls the step's `jax.jit` on the prepared arguments."""
        try:
            return jitted(prepared.plan, prepared.donated, prepared.others)
        except Exception as e:
            # JAX's own error about a deleted argument names neither its path nor the fix.
            try:
                _dispatch.refuse_deleted(self, prepared)
            except ValueError as deleted:
                raise deleted from e
            if isinstance(e, jax.errors.ConcretizationTypeError):
                _name_flat_argument(e, self, prepared)
            abstract = _abstract_argument(prepared)
            if abstract is not None:  # JAX names it by an internal path
                raise TypeError(
                    f"{self!r} got a jax.ShapeDtypeStruct at {abstract}: a call runs on values. "
                    "Pass an array there (jnp.zeros(shape, dtype), or restored state), or lower "
                    "the step for these shapes without running it: step.lower(...)."
                ) from e
            # Name pmap leftovers and host batches before JAX's own error about them.
            self._warnings.of_arguments(*self._warning_args(strategy, prepared))
            raise

    def _warning_args(self, strategy: Runner, prepared: Prepared) -> tuple:
        positions = prepared.plan.positions
        return strategy.num_replicas, strategy.topology, prepared.given, positions.where

    def _donation_on(self, strategy: Runner) -> _dispatch.Donation:
        """Returns the donation of `donate_argnums` under `strategy`'s policy (kept)."""
        last = self._donation
        if last is not None and last[0] is strategy:
            return last[1]
        donation = _dispatch.Donation(strategy.dispatch, self._arguments.donate_argnums)
        self._donation = (strategy, donation)
        return donation

    def _globalize(self, topology: Topology, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Makes per-replica arguments of this process's components global (several
        processes)."""
        static = self._arguments.static_argnums
        args = tuple(a if i in static else globalize(topology, a) for i, a in enumerate(args))
        return args, globalize(topology, kwargs)

    def lower(self, *args: PyTree, **kwargs: PyTree) -> jax.stages.Lowered:
        """Returns the `jax.stages.Lowered` of the step for these arguments.

        Example:
            >>> import jax, jax.numpy as jnp, jmirror as jm
            >>> step = jm.replicate(lambda x: jm.all_reduce("sum", x))
            >>> isinstance(step.lower(jnp.ones(3)), jax.stages.Lowered)
            True
        """
        strategy = self._check_call(args)
        step, _, (prepared, _, _) = self._adapt_and_prepare(strategy, args, kwargs, settle=False)
        donates = self._donation_on(strategy).donates(args)
        lowerable = step.with_options(_backends.compiler_options(strategy.topology))[1]
        with strategy.topology.mesh_scope():
            lowered = lowerable[donates].lower(prepared.plan, prepared.donated, prepared.others)

        def prepare(args: tuple, kwargs: dict) -> tuple[Prepared, Adapted | None]:
            # An adapter's call (NNX objects) is finished as a call is: written back.
            _, adapted, (prepared, _, _) = self._adapt_and_prepare(
                strategy, args, kwargs, settle=False
            )
            return prepared, adapted

        return _Lowered.of(lowered, prepare)

    @property
    def num_compilations(self) -> int:
        """Returns how many input signatures calls have compiled so far (`.lower()` and calls
        traced by an outer transformation do not count)."""
        return self._compilations

    def _check_call(self, args: tuple) -> PyTree:
        if _context.in_replica_context() or _context.merge_context() is not None:
            raise RuntimeError(
                f"{self!r} was called inside another replicated function; replicated functions "
                "do not nest. Call the inner function directly: it already runs per replica."
            )
        if self._strategy is not None:
            return self._strategy
        return _context.current_strategy()


def _name_flat_argument(error: Exception, call: object, prepared: Prepared) -> None:
    """Adds to JAX's error about a traced value used as a Python one (`if x:`, `int(x)`) which
    argument its `flat[i]` is, and the fix."""
    found = re.search(r"flat\[(\d+)\]", str(error))
    leaves = [*prepared.donated, *prepared.others]
    if found is None or int(found.group(1)) >= len(leaves):
        return
    leaf = leaves[int(found.group(1))]
    where = _argument_path(prepared, lambda x: x is leaf)
    if where is not None:
        error.add_note(
            f"jmirror: {found.group(0)} is {where} of {call!r}. A value the function uses in "
            "Python (an if, int(), range()) must be static: jm.replicate(fn, static_argnums=...) "
            "or static_argnames=...; or keep it traced with jax.lax.cond / jnp.where."
        )


def _abstract_argument(prepared: Prepared) -> str | None:
    """Returns the path of the first `jax.ShapeDtypeStruct` among a call's arguments, or None."""
    leaves = [*prepared.donated, *prepared.others]
    if not any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
        return None
    return _argument_path(prepared, lambda x: isinstance(x, jax.ShapeDtypeStruct))


def _argument_path(prepared: Prepared, match: Callable[[Any], bool]) -> str | None:
    """Returns the path (`args[1]['w']`, `kwargs['x']`) of the first traced argument leaf that
    `match` takes, or None."""
    args, kwargs = prepared.arguments()
    for prefix, tree in (("args", args), ("kwargs", kwargs)):
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if match(x):
                return f"{prefix}{jax.tree_util.keystr(path)}"
    return None


def _function_name(fn: object) -> str:
    """Returns how a replicated function is named: its qualified name; a callable object's
    class name (an equinox module's repr spans many lines); `partial(name)` for a partial."""
    if isinstance(fn, functools.partial):
        return f"partial({_function_name(fn.func)})"
    name = getattr(fn, "__qualname__", None)
    return name if isinstance(name, str) else type(fn).__qualname__


# Prepares a compiled step's call: the prepared arguments, and the adapter's call if any.
_PrepareCall = Callable[[tuple, dict], tuple[Prepared, Adapted | None]]


class _Lowered(jax.stages.Lowered):
    """A replicated step's `jax.stages.Lowered`, whose `compile()` gives a step called with
    the replicated function's own arguments."""

    __slots__ = ("_prepare_call",)

    @classmethod
    def of(cls, lowered: jax.stages.Lowered, prepare: _PrepareCall):
        """Returns `lowered` as a `_Lowered` that prepares calls with `prepare`."""
        new = cls.__new__(cls)
        for klass in type(lowered).__mro__:
            for name in getattr(klass, "__slots__", ()):
                if hasattr(lowered, name):
                    object.__setattr__(new, name, getattr(lowered, name))
        object.__setattr__(new, "_prepare_call", prepare)
        return new

    def compile(self, *args: Any, **kwargs: Any) -> Any:
        """Returns the compiled step, called like the replicated function."""
        return _Compiled(super().compile(*args, **kwargs), self._prepare_call)


class _Compiled:
    """A compiled replicated step called with the replicated function's own arguments
    (`jax.stages.Compiled`'s other attributes are the compiled program's)."""

    def __init__(self, compiled: Any, prepare: _PrepareCall):
        self._compiled = compiled
        self._prepare_call = prepare

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        prepared, adapted = self._prepare_call(args, kwargs)
        result = restore_statics(self._compiled(prepared.donated, prepared.others))
        return result if adapted is None else adapted.finish(result)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._compiled, name)


def _result_only(entry: Callable[..., Any]) -> Callable[..., Any]:
    """Returns `entry` without its token (what `.lower()` compiles)."""

    def result(*args: PyTree) -> PyTree:
        return entry(*args)[0]

    return result


def _first_component(topology: Topology, value: PyTree) -> jax.Array:
    """Returns per-replica components of `value`: `value` on replica 0, zero elsewhere."""
    import jax.numpy as jnp

    value = jnp.asarray(value)
    stacked = jnp.zeros((topology.num_replicas, *value.shape), value.dtype).at[0].set(value)
    return jax.device_put(stacked, topology.stacked)


def _argnums(name: str, value: int | Sequence[int], fn: Callable[..., Any]) -> tuple[int, ...]:
    """Returns the argument numbers `value` (negative ones counted from the end of `fn`'s
    positional parameters, as `jax.jit` counts them)."""
    values = (value,) if isinstance(value, int | np.integer) else tuple(value)
    for v in values:
        if isinstance(v, bool | np.bool_) or not isinstance(v, int | np.integer):
            raise TypeError(f"jm.replicate({name}=...) expects ints, got {value!r}.")
    values = tuple(int(v) for v in values)
    if all(v >= 0 for v in values):
        return values
    count = _positional_count(fn)
    if count is None:
        raise TypeError(
            f"jm.replicate({name}={value!r}): a negative argument number counts from the end "
            f"of the function's positional parameters, and {_function_name(fn)} has no fixed "
            "number of them (*args, or no signature). Give the numbers from 0."
        )
    if any(v < -count for v in values):
        raise ValueError(
            f"jm.replicate({_function_name(fn)}) got {name}={value!r}, but the function takes "
            f"{count} positional argument(s): {min(values)} names none of them. Give the "
            "indices of its arguments (from 0, or from -1 for the last)."
        )
    return tuple(sorted({v + count if v < 0 else v for v in values}))


def _positional_count(fn: Callable[..., Any]) -> int | None:
    """Returns how many positional parameters `fn` has, or what a `*args` wrapper of it wraps
    has (None: *args there too, or no signature)."""
    kinds = inspect.Parameter
    for signature in reversed(_signatures(fn)):  # its own first
        parameters = signature.parameters.values()
        if not any(p.kind is kinds.VAR_POSITIONAL for p in parameters):
            positional = (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
            return sum(p.kind in positional for p in parameters)
    return None


def _signatures(fn: Callable[..., Any]) -> list[inspect.Signature]:
    """Returns what `fn` may be read as: the signature of what a `functools.wraps` wrapper
    taking `*args` or `**kwargs` wraps, then its own (none: no signature to read)."""
    try:
        own = inspect.signature(fn, follow_wrapped=False)
    except (TypeError, ValueError):  # some builtins
        return []
    kinds = inspect.Parameter
    if not any(
        p.kind in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD) for p in own.parameters.values()
    ):
        return [own]
    try:
        return [inspect.signature(fn), own]
    except (TypeError, ValueError):
        return [own]


def _argnames(value: str | Sequence[str]) -> tuple[str, ...]:
    values = (value,) if isinstance(value, str) else tuple(value)
    for v in values:
        if not isinstance(v, str) or not v.isidentifier():
            raise TypeError(
                f"jm.replicate(static_argnames=...) expects argument names, got {value!r}."
            )
    return values


def replicate(
    fn: Callable[..., Any] | None = None,
    *,
    strategy: Runner | None = None,
    donate_argnums: int | Sequence[int] = (),
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    per_replica: PyTree = None,
    **unknown: object,
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
      static_argnames: keyword arguments that are static. As in `jax.jit`, given one of the
        two alone, the other is completed from `fn`'s signature (a static parameter is
        static passed by position or by name), and static values are keyed by type too.
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
    if unknown:
        name = next(iter(unknown))
        hint = _PMAP_OPTIONS.get(name, "")
        raise TypeError(
            f"jm.replicate() got an unexpected keyword argument {name!r}"
            f"{f'; {hint}' if hint else ''}. It takes strategy, donate_argnums, static_argnums, "
            "static_argnames and per_replica."
        )
    if fn is None:
        return functools.partial(
            replicate,
            strategy=strategy,
            donate_argnums=donate_argnums,
            static_argnums=static_argnums,
            static_argnames=static_argnames,
            per_replica=per_replica,
        )
    if not callable(fn):
        raise TypeError(f"jm.replicate expects a callable, got {fn!r}.")
    donate = _argnums("donate_argnums", donate_argnums, fn)
    static = _argnums("static_argnums", static_argnums, fn)
    _check_against_signature(fn, donate, static, _argnames(static_argnames))
    static, names = _infer_static(fn, static, _argnames(static_argnames))
    if set(static) & set(donate):
        raise ValueError(
            f"jm.replicate got argument(s) {sorted(set(static) & set(donate))} both static "
            "(static_argnums or static_argnames) and in donate_argnums; a static argument has "
            "no buffer to donate."
        )
    return Replicated(fn, strategy, donate, static, names, per_replica)


# What jax.pmap and jax.jit users pass, and where jmirror has it.
_PMAP_OPTIONS = {
    "axis_name": "the axis name is the strategy's: jm.MirroredStrategy(axis_name=...)",
    "in_axes": "arguments are split by kind, not by in_axes: a jm.PerReplica is split over "
    "the replicas (leading axis), every other argument is mirrored",
    "out_axes": "outputs come back by what they are, not by out_axes: mirrored when proven "
    "identical on every replica, else a jm.PerReplica",
    "static_broadcasted_argnums": "jmirror's is static_argnums",
    "devices": "the devices are the strategy's: jm.MirroredStrategy(devices=...)",
    "backend": "the backend is the strategy's: jm.MirroredStrategy(backend=...)",
    "axis_size": "the axis size is the strategy's num_replicas",
    "donate_argnames": "jmirror donates by position: donate_argnums",
}


def _check_against_signature(
    fn: Callable[..., Any], donate: tuple[int, ...], static: tuple[int, ...], names: tuple[str, ...]
) -> None:
    """Refuses argument numbers and names `fn` does not take, as `jax.jit` does (a function
    with `*args` takes any number, one with `**kwargs` any name). A wrapper made with
    `functools.wraps` is read both as what it wraps and as itself: either may take them."""
    signatures = _signatures(fn)
    for signature in signatures[:-1]:
        try:
            _check_parameters(fn, signature, donate, static, names)
            return
        except ValueError:
            pass
    if signatures:
        _check_parameters(fn, signatures[-1], donate, static, names)


def _check_parameters(
    fn: Callable[..., Any],
    signature: inspect.Signature,
    donate: tuple[int, ...],
    static: tuple[int, ...],
    names: tuple[str, ...],
) -> None:
    parameters = list(signature.parameters.values())
    kinds = inspect.Parameter
    positional = [
        p.name for p in parameters if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
    ]
    if not any(p.kind is kinds.VAR_POSITIONAL for p in parameters):
        for option, argnums in (("donate_argnums", donate), ("static_argnums", static)):
            beyond = [i for i in argnums if i >= len(positional)]
            if beyond:
                raise ValueError(
                    f"jm.replicate({_function_name(fn)}) got {option}={argnums}, but the "
                    f"function takes {len(positional)} positional argument(s) "
                    f"{tuple(positional)}: index {beyond[0]} names none of them. Give the "
                    "indices of its arguments (from 0)."
                )
    if not any(p.kind is kinds.VAR_KEYWORD for p in parameters):
        keywords = {
            p.name
            for p in parameters
            if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)
        }
        unknown = [name for name in names if name not in keywords]
        only = [p.name for p in parameters if p.kind is kinds.POSITIONAL_ONLY]
        if unknown and unknown[0] in only:
            raise ValueError(
                f"jm.replicate({_function_name(fn)}) got static_argnames={names}, but "
                f"{unknown[0]!r} is positional-only: name it by number, static_argnums="
                f"{only.index(unknown[0])}."
            )
        if unknown:
            raise ValueError(
                f"jm.replicate({_function_name(fn)}) got static_argnames={names}, but the "
                f"function takes no keyword argument {unknown[0]!r} (it takes "
                f"{sorted(keywords)}). Give the names of its parameters."
            )


def _infer_static(
    fn: Callable[..., Any], argnums: tuple[int, ...], argnames: tuple[str, ...]
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Completes `static_argnums` / `static_argnames` from `fn`'s signature as `jax.jit` does:
    given one of them alone, the parameters that can be passed either way join the other."""
    if bool(argnums) == bool(argnames):
        return argnums, argnames  # both given (only those), or neither
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no signature to read (some builtins)
        return argnums, argnames
    either = inspect.Parameter.POSITIONAL_OR_KEYWORD
    if argnames:
        found = [i for i, p in enumerate(parameters) if p.kind is either and p.name in argnames]
        return tuple(sorted({*argnums, *found})), argnames
    named = [p.name for i, p in enumerate(parameters) if i in argnums and p.kind is either]
    return argnums, (*argnames, *named)
