"""The replica context: collectives, `sync` and `merge_call` inside a replicated function.

A replicated function is traced once per round of the static proof (see `_proof.py`). Calls
that need to know at trace time whether a value is identical on every replica (`sync`,
`merge_call`) tag their inputs with a *marker* (`jmirror._proof.mark`), an identity equation
that the proof finds in the traced jaxpr. The proof reports for each marker which inputs it
proved identical, and the next round of tracing uses that answer (the *oracle*). Until a marker
has an answer its inputs are taken to differ across replicas, which is always safe.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmirror import _shim
from jmirror._proof import mark
from jmirror._values import (
    Aggregation,
    PerReplica,
    PyTree,
    ReduceOp,
    SyncOnRead,
    held_values,
    per_replica_component,
)

if TYPE_CHECKING:
    from jmirror._dispatch import Dispatch
    from jmirror._topology import Topology


class Runner(Protocol):
    """What running replica functions needs of a strategy: the internal interface that
    `jm.replicate` and the replica context use (`MirroredStrategy` provides it)."""

    @property
    def topology(self) -> Topology: ...

    @property
    def dispatch(self) -> Dispatch: ...

    @property
    def backend(self) -> str: ...

    @property
    def axis_name(self) -> str: ...

    @property
    def num_replicas(self) -> int: ...


class Strategy(Runner, Protocol):
    """What the modules below `jmirror._strategy` use of the current strategy
    (`current_strategy`): running replica functions, and placing and reading values on the
    host (`MirroredStrategy` provides it)."""

    def mirror(self, tree: PyTree) -> PyTree: ...

    def read(self, tree: PyTree) -> PyTree: ...


_NOT_IN_REPLICA = (
    "{call} needs a replica context, but it was called in cross-replica context{where}. Call it "
    "inside a function run by jm.replicate(fn) or strategy.run(fn); there "
    "jm.replica_context() returns the context."
)


@dataclasses.dataclass
class MarkerRecord:
    """What one marker asked of the proof in the current round of tracing."""

    call: str
    paths: tuple[str, ...]
    assumed_varying: tuple[bool, ...]
    require_identical: bool = False


@dataclasses.dataclass
class TraceRound:
    """State shared by all replica contexts of one trace of a replicated function."""

    oracle: dict[int, tuple[bool, ...]]
    records: dict[int, MarkerRecord] = dataclasses.field(default_factory=dict)
    counter: int = 0
    # Facts known while tracing, before the proof runs: whether a traced value (by id) may
    # vary. Inputs of the replica function and results of collectives are known at once,
    # so `merge_call` and `sync` see them right in the first round. The values are kept
    # alive here so that their ids stay unique.
    facts: dict[int, tuple[Any, bool]] = dataclasses.field(default_factory=dict)

    def learn(self, leaves: Sequence[Any], varying: bool | Sequence[bool]) -> None:
        """Records whether each traced leaf may vary across replicas."""
        flags = [varying] * len(leaves) if isinstance(varying, bool) else varying
        for leaf, flag in zip(leaves, flags):
            if isinstance(leaf, jax.core.Tracer):
                self.facts[id(leaf)] = (leaf, flag)

    def _fact(self, leaf: object) -> bool | None:
        if not isinstance(leaf, jax.core.Tracer):
            return False  # a constant is identical on every replica
        fact = self.facts.get(id(leaf))
        return None if fact is None else fact[1]

    def mark(
        self, call: str, leaves: Sequence[Any], paths: Sequence[str], require_identical=False
    ) -> tuple[list[Any], tuple[bool, ...], bool]:
        """Tags `leaves` with a new marker.

        Returns the tagged leaves, whether each may vary across replicas, and whether that
        answer comes from the proof (False: not proven yet, every leaf is taken to vary).
        """
        marker_id = self.counter
        self.counter += 1
        proven = self.oracle.get(marker_id)
        if proven is not None and len(proven) == len(leaves):
            known, answered = proven, True
        else:
            facts = [self._fact(leaf) for leaf in leaves]
            answered = all(f is not None for f in facts)
            known = tuple(True if f is None else f for f in facts)
        self.records[marker_id] = MarkerRecord(call, tuple(paths), known, require_identical)
        if not leaves:
            return list(leaves), known, answered

        marked = mark(leaves, marker_id)
        self.learn(marked, known)
        return marked, known, answered


# tf.distribute.ReplicaContext's names with another name in jmirror.
_TF_REPLICA_CONTEXT_NAMES = {
    "replica_id_in_sync_group": "replica_context.replica_id (or jm.replica_id())",
    "num_replicas_in_sync": "replica_context.num_replicas (or jm.num_replicas())",
    "devices": "strategy.replica_devices(i), outside the replica function",
}


class ReplicaContext:
    """The context of one replica, inside a function run by `jm.replicate` / `strategy.run`.

    Get it with `jm.replica_context()`; the module functions `jm.all_reduce`, `jm.sync`, ...
    are shortcuts to the current context's methods.

    Example:
        >>> import jax.numpy as jnp, jmirror as jm
        >>> strategy = jm.MirroredStrategy()
        >>> def step():
        ...     ctx = jm.replica_context()
        ...     return ctx.all_reduce("sum", jnp.ones(()))
        >>> float(strategy.read(strategy.run(step))) == strategy.num_replicas
        True
    """

    def __getattr__(self, name: str) -> Any:
        # Only for names the class lacks: tf.distribute's names point to jmirror's.
        ours = _TF_REPLICA_CONTEXT_NAMES.get(name)
        hint = f"; tf.distribute's {name} is jmirror's {ours}" if ours else ""
        raise AttributeError(f"'ReplicaContext' object has no attribute {name!r}{hint}")

    def __init__(self, strategy: Runner, trace: TraceRound):
        self._strategy = strategy
        self._trace = trace

    @property
    def strategy(self) -> Any:  # the strategy object itself (a MirroredStrategy)
        """Returns the `MirroredStrategy` running this replica."""
        return self._strategy

    @property
    def axis_name(self) -> str:
        """Returns the collective axis name of the replicas (`strategy.axis_name`)."""
        return self._strategy.axis_name

    @property
    def num_replicas(self) -> int:
        """Returns the number of replicas in sync."""
        return self._strategy.num_replicas

    @property
    def replica_id(self) -> jax.Array:
        """Returns this replica's index as a traced int32 scalar, 0..N-1 in `strategy.devices`
        order."""
        return lax.axis_index(self.axis_name)

    def all_reduce(
        self, op: ReduceOp | str, tree: PyTree, *, dtype: jax.typing.DTypeLike | None = None
    ) -> PyTree:
        """Reduces every leaf of `tree` across replicas; the result is mirrored.

        Args:
          op: `SUM`, `MEAN`, `MAX` or `MIN`.
          tree: a pytree of arrays, one per replica.
          dtype: the floating dtype the reduction runs in. Each floating leaf of another
            dtype is cast to `dtype` before the collective and its result cast back to the
            leaf's own dtype (bfloat16 gradients reduced in float32, say); integer and boolean
            leaves are reduced as they are. `None` reduces every leaf in its own dtype.

        Returns:
          The reduced tree, identical on every replica, each leaf in its own dtype (the
          `MEAN` of an integer leaf as `jnp.mean` gives it: floating). Differentiable: the
          gradient of `all_reduce(SUM, x) * c` with respect to `x` is the all-reduce of `c`.

        Raises:
          TypeError: `dtype` is not a floating dtype.
        """
        op = ReduceOp(op)
        wire = reduction_dtype(dtype, "jm.all_reduce")
        return self._identical(
            jax.tree.map(lambda x: all_reduce_leaf(op, x, self.axis_name, wire), tree)
        )

    def _identical(self, tree: PyTree) -> PyTree:
        """Notes that every leaf of `tree` is identical on every replica; returns `tree`."""
        self._trace.learn(jax.tree.leaves(tree), False)
        return tree

    def all_gather(self, tree: PyTree, axis: int = 0, tiled: bool = False) -> PyTree:
        """Gives every replica all components of every leaf, stacked on a new `axis`.

        With `tiled=True` the components are concatenated along `axis` instead. The result
        is mirrored.
        """
        if isinstance(axis, bool) or not isinstance(axis, int | np.integer):
            raise TypeError(f"jm.all_gather(tree, axis=...) expects an int; got {axis!r}.")

        def gather(path: tuple, x: Any) -> Any:
            rank = jnp.ndim(x)
            within = rank if tiled else rank + 1  # a new axis may go after the last one
            if not -within <= axis < within:
                new = " (tiled=False stacks on a new axis, which may also come last)"
                raise ValueError(
                    f"jm.all_gather(tree, axis={axis}, tiled={tiled}): the leaf at "
                    f"{jax.tree_util.keystr(path) or '<root>'} has {rank} dimension(s), so "
                    f"axis must be {-within} to {within - 1}{'' if tiled else new}. Pass an "
                    "axis the leaf has."
                )
            return keep_weak(x, lax.all_gather(x, self.axis_name, axis=axis, tiled=tiled))

        return self._identical(jax.tree_util.tree_map_with_path(gather, tree))

    def sync(self, tree: PyTree, aggregation: Aggregation | str) -> PyTree:
        """Makes `tree` mirrored: the functional form of writing a mirrored variable.

        Args:
          tree: a pytree of per-replica values.
          aggregation: `MEAN` (mean of the replicas' values), `SUM` (their sum),
            `ONLY_FIRST_REPLICA` (replica 0's value) or `NONE` (the value itself, which must
            be provably identical on every replica already).

        Returns:
          The synchronized tree, identical on every replica. A value already proven
          identical costs no collective for `MEAN`, `ONLY_FIRST_REPLICA` and `NONE`.

        Raises:
          ValueError: for `NONE` when a leaf is not provably identical on every replica.
        """
        aggregation = Aggregation(aggregation)
        path_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
        paths = [jax.tree_util.keystr(p) for p, _ in path_leaves]
        leaves = [leaf for _, leaf in path_leaves]
        call = f"jm.sync(tree, {aggregation.name})"
        for path, leaf in zip(paths, leaves):
            if not _is_array_like(leaf):
                raise TypeError(
                    f"{call} got a {type(leaf).__name__} at path {path or '<root>'!r}; every leaf "
                    "to synchronize must be an array or a number. Keep other Python values out "
                    "of the tree (they are the same on every replica already)."
                )
        require = aggregation is Aggregation.NONE
        leaves, varying, answered = self._trace.mark(call, leaves, paths, require)
        if require and answered:
            check_identical(call, paths, varying)
        out = [self._sync_leaf(aggregation, x, v) for x, v in zip(leaves, varying)]
        return self._identical(jax.tree.unflatten(treedef, out))

    def _sync_leaf(self, aggregation: Aggregation, x: PyTree, varying: bool) -> PyTree:
        if aggregation is Aggregation.NONE:
            return x
        if _is_key(x):
            return self._sync_key(aggregation, x, varying)
        if aggregation is Aggregation.SUM:
            return (
                all_reduce_leaf(ReduceOp.SUM, x, self.axis_name)
                if varying
                else (x * jnp.asarray(self.num_replicas, jnp.result_type(x)))
            )
        if not varying:
            return x
        if aggregation is Aggregation.MEAN:
            return all_reduce_leaf(ReduceOp.MEAN, x, self.axis_name)
        # ONLY_FIRST_REPLICA: every other replica contributes an exact zero.
        x = jnp.asarray(x)
        wide = x.astype(jnp.int32) if x.dtype == jnp.bool_ else x
        first = jnp.where(self.replica_id == 0, wide, jnp.zeros_like(wide))
        return keep_weak(x, lax.psum(first, self.axis_name).astype(x.dtype))

    def _sync_key(self, aggregation: Aggregation, key: jax.Array, varying: bool) -> jax.Array:
        """Returns a typed PRNG key array synchronized through its key data
        (`ONLY_FIRST_REPLICA`)."""
        if aggregation is not Aggregation.ONLY_FIRST_REPLICA:
            raise TypeError(
                f"jm.sync(tree, {aggregation.name}) got a typed PRNG key array ({key.dtype}); "
                "keys cannot be summed or averaged. Use jm.sync(key, 'only_first_replica') to "
                "give every replica replica 0's key."
            )
        data = self._sync_leaf(aggregation, jax.random.key_data(key), varying)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(key))

    def merge_call(
        self, merge_fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict | None = None
    ) -> PyTree:
        """Runs `merge_fn(strategy, *args, **kwargs)` once, in cross-replica context.

        Inside `merge_fn`, every argument leaf that may differ across replicas is a
        `jm.PerReplica`; `strategy.reduce`, `gather`, `local_results`, `read` and `update`
        work on it (they lower to collectives). A leaf proven identical on every replica (an
        all-reduced gradient, a mirrored input) is a mirrored value there: `reduce(MEAN, v)`
        returns it, `local_results(v)` gives its N copies. Each replica receives the result
        with every `PerReplica` replaced by its own component. Works inside `lax.scan`,
        `fori_loop` and `cond` bodies.

        Args:
          merge_fn: called as `merge_fn(strategy, *args, **kwargs)`.
          args: positional arguments, pytrees of per-replica values.
          kwargs: keyword arguments, pytrees of per-replica values.

        Returns:
          `merge_fn`'s result, with this replica's component of each `PerReplica`.
        """
        kwargs = {} if kwargs is None else dict(kwargs)
        tree = (tuple(args), kwargs)
        path_leaves, treedef = jax.tree_util.tree_flatten_with_path(
            tree, is_leaf=lambda x: isinstance(x, SyncOnRead)
        )
        paths = [jax.tree_util.keystr(p) for p, _ in path_leaves]
        leaves = [leaf for _, leaf in path_leaves]
        # Arrays are tagged for the proof; other Python objects (a string, a flag) are the same
        # on every replica and reach merge_fn as they are.
        plain = [i for i, x in enumerate(leaves) if _is_array_like(x)]
        marked, varying, _ = self._trace.mark(
            "jm.merge_call", [leaves[i] for i in plain], [paths[i] for i in plain]
        )
        frame = _MergeFrame(self)
        for i, x, v in zip(plain, marked, varying):
            # A leaf proven identical reaches merge_fn as a mirrored value, and merge_fn's
            # cross-replica operations treat it as one (not as a value from the closure).
            leaves[i] = merge_per_replica(x, self.axis_name) if v else frame.note_mirrored(x)
        args, kwargs = cast(tuple[tuple, dict[str, Any]], jax.tree.unflatten(treedef, leaves))
        _STACK.frames.append(frame)
        try:
            result = merge_fn(self._strategy, *args, **kwargs)
        finally:
            _STACK.frames.pop()
        nodes, treedef = jax.tree_util.tree_flatten_with_path(
            result, is_leaf=lambda x: isinstance(x, PerReplica)
        )
        return treedef.unflatten([self._own_component(path, x) for path, x in nodes])

    def _own_component(self, path: tuple, x: PyTree) -> PyTree:
        if not isinstance(x, PerReplica):
            return x
        if x.is_component:
            return held_values(x)
        n = self.num_replicas

        def own(inner: tuple, v: PyTree) -> PyTree:
            v = jnp.asarray(v)
            if v.shape[:1] != (n,):
                where = jax.tree_util.keystr(path) + ".values" + jax.tree_util.keystr(inner)
                raise ValueError(
                    f"jm.merge_call: merge_fn returned a PerReplica whose leaf at "
                    f"{where or '<root>'} has shape {v.shape}, but a PerReplica needs a leading "
                    f"axis of {n} (one component per replica) for each replica to receive its "
                    "own. Return the PerReplica merge_fn received (or one built from it with "
                    "jax.tree.map), a value stacked over all replicas, or a value every replica "
                    "shares (a plain array)."
                )
            return v[self.replica_id]

        return jax.tree_util.tree_map_with_path(own, held_values(x))

    def __repr__(self) -> str:
        return f"ReplicaContext(num_replicas={self.num_replicas}, axis_name={self.axis_name!r})"


@dataclasses.dataclass(frozen=True)
class AllGather:
    """All-gathers a merge_fn `PerReplica`'s components over `axis_name` (see `merge_call`)."""

    axis_name: str

    def __call__(self, tree: PyTree) -> PyTree:
        if merge_context() is None:
            raise RuntimeError(
                "This PerReplica belongs to a merge_call's merge_fn and cannot be read after "
                "merge_fn returns; return it from merge_fn (each replica receives its "
                "component)."
            )
        return jax.tree.map(lambda x: lax.all_gather(x, self.axis_name), tree)


def merge_per_replica(component: PyTree, axis_name: str) -> PerReplica:
    """Returns a `PerReplica` seen inside `merge_fn`, holding this replica's own component."""
    return per_replica_component(component, AllGather(axis_name))


@dataclasses.dataclass(frozen=True)
class _MergeFrame:
    """A running `merge_fn`: its replica context, and the traced values known to be mirrored
    there (the arguments proven identical, the results of its cross-replica operations),
    by id; the values are kept alive so that their ids stay unique."""

    context: ReplicaContext
    mirrored: dict[int, Any] = dataclasses.field(default_factory=dict)

    def note_mirrored(self, x: PyTree) -> PyTree:
        if isinstance(x, jax.core.Tracer):
            self.mirrored[id(x)] = x
        return x


class _Stack(threading.local):
    def __init__(self):
        self.frames: list[ReplicaContext | _MergeFrame] = []
        self.strategies: list[Strategy] = []


_STACK = _Stack()
_DEFAULT: list[Strategy] = []
# Makes the default strategy: set by `jmirror._strategy`, which sits above this module.
_DEFAULT_FACTORY: list[Callable[[], Strategy]] = []


def _is_array_like(x: object) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex))


def check_identical(call: str, paths: Sequence[str], varying: Sequence[bool]) -> None:
    """Raises the `ValueError` of `sync(..., NONE)` for the first leaf that may vary."""
    for path, v in zip(paths, varying):
        if v:
            raise ValueError(
                f"{call} needs every leaf to be identical on all replicas already, but the leaf "
                f"at path {path or '<root>'!r} may differ between replicas (it depends on "
                "per-replica data or replica_id without a cross-replica reduction). Use "
                "aggregation MEAN, SUM or ONLY_FIRST_REPLICA to combine the replicas' values."
            )


def reduction_dtype(
    dtype: jax.typing.DTypeLike | None, call: str, argument: str = "dtype"
) -> np.dtype | None:
    """Returns `dtype` as a floating numpy dtype (`None` stays `None`), checked for `call`'s
    `argument`."""
    if dtype is None:
        return None
    try:
        found = np.dtype(dtype)
    except TypeError:
        found = None
    if found is None or not jnp.issubdtype(found, jnp.floating):
        raise TypeError(
            f"{call}(..., {argument}={dtype!r}) expects a floating dtype to reduce in (such as "
            "jnp.float32 for bfloat16 gradients), or None to reduce every leaf in its own "
            "dtype."
        )
    return found


def all_reduce_leaf(
    op: ReduceOp, x: PyTree, axis_name: str, dtype: np.dtype | None = None
) -> PyTree:
    """Returns `psum` / `pmean` / `pmax` / `pmin` of one array over `axis_name`; a floating leaf of
    another dtype than `dtype` (when given) is reduced in `dtype` and cast back. A weakly typed
    leaf gives a weakly typed result of its dtype, as elementwise operations do (JAX's
    collectives alone drop the weak type: a weak parameter would come back strong from the first
    step and the step compile again). A `float0` leaf (the gradient of an integer) is returned
    as it is."""
    if jax.typeof(x).dtype == jax.dtypes.float0:
        return x  # the gradient of an integer: no values, the same on every replica
    return keep_weak(x, _reduce_leaf(op, x, axis_name, dtype))


def keep_weak(given: Any, out: jax.Array) -> jax.Array:
    """Returns a collective's result `out` weakly typed when its operand `given` was and the
    dtype is the same (JAX's collectives drop the weak type, elementwise operations keep it).
    A Python number `out` (JAX's sum of a constant: the constant times the axis size) is
    returned as it is."""
    if not isinstance(out, jax.Array):
        return out
    if jax.typeof(given).weak_type and jnp.result_type(out) == jnp.result_type(given):
        return _shim.weakly_typed(out)
    return out


def _reduce_leaf(op: ReduceOp, x: PyTree, axis_name: str, dtype: np.dtype | None) -> PyTree:
    if dtype is not None:
        x = jnp.asarray(x)
        if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
            return _reduce_leaf(op, x.astype(dtype), axis_name, None).astype(x.dtype)
    if op is ReduceOp.SUM:
        return lax.psum(x, axis_name)
    if op is ReduceOp.MAX:
        return lax.pmax(x, axis_name)
    if op is ReduceOp.MIN:
        return lax.pmin(x, axis_name)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return lax.psum(x, axis_name) / lax.axis_size(axis_name)
    return lax.pmean(x, axis_name)


# --- context stack ------------------------------------------------------------------------


def enter_replica(context: ReplicaContext) -> None:
    _STACK.frames.append(context)


def exit_replica() -> None:
    _STACK.frames.pop()


def merge_context() -> ReplicaContext | None:
    """Returns the replica context whose `merge_call` is running, when inside a `merge_fn`."""
    if _STACK.frames and isinstance(_STACK.frames[-1], _MergeFrame):
        return _STACK.frames[-1].context
    return None


def note_mirrored_in_merge(tree: PyTree) -> PyTree:
    """Notes that the traced leaves of `tree` are mirrored inside the running `merge_fn`
    (results of its cross-replica operations); returns `tree`."""
    if _STACK.frames and isinstance(_STACK.frames[-1], _MergeFrame):
        for leaf in jax.tree.leaves(tree):
            _STACK.frames[-1].note_mirrored(leaf)
    return tree


def is_mirrored_in_merge(x: object) -> bool:
    """Returns whether the traced value `x` is known to be mirrored inside the running `merge_fn`:
    an argument proven identical on every replica, or a cross-replica operation's result."""
    if not (_STACK.frames and isinstance(_STACK.frames[-1], _MergeFrame)):
        return False
    return _STACK.frames[-1].mirrored.get(id(x)) is x


def in_replica_context() -> bool:
    """Returns whether the caller runs in a replica context.

    Example:
        >>> import jmirror as jm
        >>> jm.in_replica_context()
        False
    """
    return bool(_STACK.frames) and isinstance(_STACK.frames[-1], ReplicaContext)


def replica_context(call: str = "jm.replica_context()") -> ReplicaContext:
    """Returns the current `ReplicaContext`.

    Raises:
      RuntimeError: in cross-replica context (outside a replicated function, or inside a
        `merge_call`'s `merge_fn`).

    Example:
        >>> import jmirror as jm
        >>> strategy = jm.MirroredStrategy()
        >>> ids = strategy.run(lambda: jm.replica_context().replica_id)
        >>> [int(i) for i in strategy.local_results(ids)] == list(range(strategy.num_replicas))
        True
    """
    if in_replica_context():
        return _STACK.frames[-1]  # type: ignore[return-value]
    where = " (inside a merge_call's merge_fn)" if merge_context() is not None else ""
    raise RuntimeError(_NOT_IN_REPLICA.format(call=call, where=where))


def set_default_factory(factory: Callable[[], Strategy]) -> None:
    """Registers how `current_strategy` makes the default strategy (once, on first use)."""
    _DEFAULT_FACTORY[:] = [factory]


def push_strategy(strategy: Strategy) -> None:
    _STACK.strategies.append(strategy)


def pop_strategy() -> None:
    _STACK.strategies.pop()


def current_strategy() -> Strategy:
    """Returns the strategy running the replica function (or `merge_fn`) the caller is in, as
    in tf.distribute; else the innermost strategy in scope, else the default one (created
    once)."""
    if _STACK.frames:
        frame = _STACK.frames[-1]
        return (frame.context if isinstance(frame, _MergeFrame) else frame).strategy
    if _STACK.strategies:
        return _STACK.strategies[-1]
    if not _DEFAULT:
        _DEFAULT.append(_DEFAULT_FACTORY[0]())
    return _DEFAULT[0]


# --- module shortcuts ----------------------------------------------------------------------


def replica_id() -> jax.Array:
    """Returns the current replica's id (a traced int32 scalar).

    Example:
        >>> import jmirror as jm
        >>> strategy = jm.MirroredStrategy()
        >>> ids = strategy.run(jm.replica_id)
        >>> int(strategy.reduce("max", ids)) == strategy.num_replicas - 1
        True
    """
    return replica_context("jm.replica_id()").replica_id


def replica_key(key: jax.Array) -> jax.Array:
    """Returns `key` folded with the current replica's id: a PRNG key of this replica's own.

    `jax.random.fold_in(key, jm.replica_id())`, for raw (`jax.random.PRNGKey`) and typed
    (`jax.random.key`) keys alike: a key passed mirrored draws the same numbers on every
    replica, `jm.replica_key(key)` different ones on each (dropout masks per replica, as
    flax's `shard_prng_key` gives `jax.pmap` users).

    Raises:
      RuntimeError: outside a replicated function.

    Example:
        >>> import jax, jmirror as jm
        >>> strategy = jm.MirroredStrategy()
        >>> key = strategy.mirror(jax.random.key(0))
        >>> draws = strategy.run(lambda k: jax.random.uniform(jm.replica_key(k)), args=(key,))
        >>> first = strategy.local_results(draws)[0]
        >>> bool(first == jax.random.uniform(jax.random.fold_in(jax.random.key(0), 0)))
        True
    """
    return jax.random.fold_in(key, replica_context("jm.replica_key").replica_id)


def num_replicas() -> int:
    """Returns the number of replicas in sync (a Python int).

    Example:
        >>> import jax.numpy as jnp, jmirror as jm
        >>> strategy = jm.MirroredStrategy()
        >>> n = strategy.run(lambda: jnp.asarray(jm.num_replicas()))
        >>> int(strategy.read(n)) == strategy.num_replicas
        True
    """
    return replica_context("jm.num_replicas()").num_replicas


def all_reduce(
    op: ReduceOp | str, tree: PyTree, *, dtype: jax.typing.DTypeLike | None = None
) -> PyTree:
    """Shortcut for `jm.replica_context().all_reduce(op, tree, dtype=dtype)`.

    Example:
        >>> import jax.numpy as jnp, jmirror as jm
        >>> strategy = jm.MirroredStrategy()
        >>> total = strategy.run(lambda: jm.all_reduce("sum", jm.replica_id()))
        >>> n = strategy.num_replicas
        >>> int(strategy.read(total)) == n * (n - 1) // 2
        True
        >>> grads = jnp.full(3, 1 / 3, jnp.bfloat16)  # summed in float32, given back in bfloat16
        >>> total = strategy.run(lambda g: jm.all_reduce("sum", g, dtype=jnp.float32), (grads,))
        >>> strategy.read(total).dtype
        dtype(bfloat16)
    """
    return replica_context("jm.all_reduce").all_reduce(op, tree, dtype=dtype)


def all_gather(tree: PyTree, axis: int = 0, tiled: bool = False) -> PyTree:
    """Shortcut for `jm.replica_context().all_gather(tree, axis, tiled)`.

    Example:
        >>> import jmirror as jm
        >>> strategy = jm.MirroredStrategy()
        >>> ids = strategy.run(lambda: jm.all_gather(jm.replica_id()))
        >>> strategy.read(ids).tolist() == list(range(strategy.num_replicas))
        True
    """
    return replica_context("jm.all_gather").all_gather(tree, axis=axis, tiled=tiled)


def sync(tree: PyTree, aggregation: Aggregation | str) -> PyTree:
    """Shortcut for `jm.replica_context().sync(tree, aggregation)`.

    Example:
        >>> import jmirror as jm
        >>> strategy = jm.MirroredStrategy()
        >>> first = strategy.run(lambda: jm.sync(7 * (jm.replica_id() + 1), "only_first_replica"))
        >>> int(strategy.read(first))
        7
    """
    return replica_context("jm.sync").sync(tree, aggregation)


def merge_call(
    merge_fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict | None = None
) -> PyTree:
    """Shortcut for `jm.replica_context().merge_call(merge_fn, args, kwargs)`.

    Example:
        >>> import jax.numpy as jnp, jmirror as jm
        >>> strategy = jm.MirroredStrategy()
        >>> def step():
        ...     x = jnp.ones(()) * (jm.replica_id() + 1)
        ...     return jm.merge_call(lambda s, v: s.reduce("sum", v), args=(x,))
        >>> n = strategy.num_replicas
        >>> float(strategy.read(strategy.run(step))) == n * (n + 1) / 2
        True
    """
    return replica_context("jm.merge_call").merge_call(merge_fn, args, kwargs)


def _is_key(x: object) -> bool:
    """Returns whether `x` is a typed PRNG key array (`jax.random.key`)."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)
