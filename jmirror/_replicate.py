"""`jm.replicate`: compiling a replica function for every device of a strategy.

This is the only module that calls `jax.pmap` / `jax.shard_map`. For each input signature it

1. traces the replica function once into a jaxpr with `jax.make_jaxpr(axis_env=...)`, which
   gives `jax.pmap` semantics (the gradient with respect to a mirrored input is the replica's
   own gradient) whichever backend runs it;
2. proves which outputs are identical on every replica (`_proof.py`), re-tracing when a
   `sync` / `merge_call` can use what the proof learned;
3. compiles that jaxpr with the strategy's backend: identical outputs come back mirrored
   (`out_axes=None` / `P()`), the others stacked as `PerReplica`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jmirror import _context
from jmirror._proof import prove
from jmirror._values import PerReplica, SyncOnRead, is_distributed

_MAX_ROUNDS = 4

# Kinds of a flat input or output leaf.
_SPLIT, _MIRRORED, _BROADCAST = "split", "mirrored", "broadcast"
# Kinds of a top-level output slot.
_AUTO, _FORCED, _STORAGE = "auto", "per_replica", "sync_on_read"


@dataclasses.dataclass(frozen=True)
class _Slot:
    """One top-level leaf of an input or output tree: a plain leaf or a distributed node."""

    kind: str  # inputs: _SPLIT / _MIRRORED / _BROADCAST; outputs: _AUTO / _FORCED / _STORAGE
    treedef: Any = None  # for distributed nodes: the structure inside the node
    aggregation: Any = None  # for SyncOnRead nodes
    size: int = 1  # number of flat leaves


@dataclasses.dataclass
class _Plan:
    """Everything needed to run one compiled signature."""

    executable: Callable[..., Any]
    out_treedef: Any
    out_slots: tuple[_Slot, ...]
    out_split: tuple[bool, ...]
    n_outputs: int
    needs_token: bool
    traces: int


def _leaf_signature(strategy: Any, x: Any, split: bool) -> tuple:
    if isinstance(x, jax.Array):
        kind = _SPLIT if split else (_MIRRORED if strategy._is_mirrored(x) else _BROADCAST)
        return kind, x.shape, x.dtype, getattr(x, "weak_type", False)
    if isinstance(x, (bool, int, float, complex)) and not split:
        return _BROADCAST, (), type(x), True
    x = np.asarray(x)
    if x.dtype == object:
        raise TypeError
    return (_SPLIT if split else _BROADCAST), x.shape, x.dtype, False


def _aval(signature: tuple) -> jax.ShapeDtypeStruct:
    kind, shape, dtype, weak = signature
    if isinstance(dtype, type) and issubclass(dtype, (bool, int, float, complex)):
        dtype = jnp.asarray(dtype(0)).dtype
    elif not jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        dtype = jax.dtypes.canonicalize_dtype(dtype)
    if kind == _SPLIT:
        shape = shape[1:]
    return jax.ShapeDtypeStruct(shape, dtype, weak_type=weak)


class Replicated:
    """A replica function compiled for every device of a strategy (see `jm.replicate`).

    Call it like the original function; `.lower(*args, **kwargs)` returns the
    `jax.stages.Lowered` step for HLO inspection.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        strategy: Any,
        donate_argnums: tuple[int, ...],
        static_argnums: tuple[int, ...],
    ):
        self._fn = fn
        self._strategy = strategy
        self._donate = donate_argnums
        self._static = static_argnums
        self._cache: dict[Any, _Plan] = {}
        functools.update_wrapper(self, fn)

    def __repr__(self) -> str:
        name = getattr(self._fn, "__qualname__", repr(self._fn))
        return f"<jm.replicate({name})>"

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return self
        return functools.partial(self, instance)

    # --- calling -------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        strategy, plan, flat = self._prepare(args, kwargs)
        if plan.needs_token:
            flat.append(strategy._replica_token())
        strategy._wait_for_room()
        outs = plan.executable(*flat)
        strategy._track(outs[0])
        return self._build(plan, outs)

    def lower(self, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        """Returns the `jax.stages.Lowered` of the step for these arguments.

        Example:
            >>> import jax.numpy as jnp, jmirror as jm
            >>> step = jm.replicate(lambda x: jm.all_reduce("sum", x))
            >>> "all-reduce" in step.lower(jnp.ones(3)).compile().as_text()
            True
        """
        strategy, plan, flat = self._prepare(args, kwargs)
        if plan.needs_token:
            flat.append(strategy._replica_token())
        return plan.executable.lower(*flat)

    @property
    def num_compilations(self) -> int:
        """How many input signatures have been compiled so far."""
        return len(self._cache)

    def _prepare(self, args: tuple, kwargs: dict) -> tuple[Any, _Plan, list[Any]]:
        strategy = self._strategy if self._strategy is not None else _context.current_strategy(
            _default_strategy
        )
        if _context.in_replica_context() or _context.merge_context() is not None:
            raise RuntimeError(
                f"{self!r} was called inside another replicated function; replicated functions "
                "do not nest. Call the inner function directly: it already runs per replica."
            )
        for i in self._static:
            if i >= len(args):
                raise ValueError(
                    f"{self!r} has static_argnums={self._static}, but was called with "
                    f"{len(args)} positional argument(s); pass argument {i} positionally."
                )
        statics = tuple(args[i] for i in self._static)
        try:
            hash(statics)
        except TypeError as e:
            raise TypeError(
                f"{self!r}: static arguments (static_argnums={self._static}) must be hashable, "
                f"got {statics!r}. Pass arrays as dynamic arguments instead."
            ) from e
        dynamic = tuple(a for i, a in enumerate(args) if i not in self._static)
        top, treedef = jax.tree_util.tree_flatten((dynamic, kwargs), is_leaf=is_distributed)
        flat: list[Any] = []
        slots: list[_Slot] = []
        signature: list[tuple] = []
        for node in top:
            if isinstance(node, (PerReplica, SyncOnRead)):
                inner = node._values if isinstance(node, PerReplica) else node.value
                leaves, inner_def = jax.tree_util.tree_flatten(inner)
                agg = node.aggregation if isinstance(node, SyncOnRead) else None
                slots.append(_Slot(_SPLIT, inner_def, agg, len(leaves)))
                split = True
            else:
                leaves = [node]
                slots.append(_Slot(_BROADCAST))
                split = False
            for leaf in leaves:
                try:
                    sig = _leaf_signature(strategy, leaf, split)
                except TypeError:
                    raise self._bad_leaf(args, kwargs, leaf) from None
                if split and (not sig[1] or sig[1][0] != strategy.num_replicas):
                    raise self._bad_split(strategy, args, kwargs, leaf)
                signature.append(sig)
                flat.append(leaf)
        key = (strategy, treedef, tuple(slots), tuple(signature), statics)
        plan = self._cache.get(key)
        if plan is None:
            plan = self._compile(strategy, treedef, slots, signature, statics, len(args))
            self._cache[key] = plan
        return strategy, plan, flat

    def _build(self, plan: _Plan, outs: Sequence[Any]) -> Any:
        top = []
        pos = 0
        for slot in plan.out_slots:
            leaves = outs[pos : pos + slot.size]
            if slot.kind == _STORAGE:
                top.append(SyncOnRead(slot.treedef.unflatten(leaves), slot.aggregation))
            elif slot.kind == _FORCED:
                top.append(PerReplica(slot.treedef.unflatten(leaves)))
            else:
                top.append(PerReplica(leaves[0]) if plan.out_split[pos] else leaves[0])
            pos += slot.size
        return plan.out_treedef.unflatten(top)

    # --- errors --------------------------------------------------------------------------------

    def _paths(self, args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
        tree = (args, kwargs)
        return [
            (jax.tree_util.keystr(p), leaf)
            for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
        ]

    def _path_of(self, args: tuple, kwargs: dict, leaf: Any) -> str:
        for path, candidate in self._paths(args, kwargs):
            if candidate is leaf:
                return "(args, kwargs)" + path
        return "<unknown>"

    def _bad_leaf(self, args: tuple, kwargs: dict, leaf: Any) -> TypeError:
        return TypeError(
            f"{self!r} got a leaf of type {type(leaf).__name__} at "
            f"{self._path_of(args, kwargs, leaf)}; expected arrays or scalars. Pass other "
            "values through static_argnums or close over them."
        )

    def _bad_split(self, strategy: Any, args: tuple, kwargs: dict, leaf: Any) -> ValueError:
        shape = tuple(np.shape(leaf))
        return ValueError(
            f"{self!r} got a per-replica leaf of shape {shape} at "
            f"{self._path_of(args, kwargs, leaf)}; a PerReplica / SyncOnRead leaf needs a "
            f"leading axis of size {strategy.num_replicas} (the number of replicas), one slice "
            "per replica. Reshape the global batch to (num_replicas, per_replica_batch, ...) "
            "or use strategy.distribute_dataset, which does this for you."
        )

    # --- compiling -----------------------------------------------------------------------------

    def _compile(self, strategy, treedef, slots, signature, statics, n_args) -> _Plan:
        split = [sig[0] == _SPLIT for sig in signature]
        avals = [_aval(sig) for sig in signature]
        box: dict[str, Any] = {}
        axis_env = [(strategy.axis_name, strategy.num_replicas)]

        def trace(oracle):
            round_ = _context.TraceRound(oracle)
            box["round"] = round_
            # A new function object each round: make_jaxpr caches traces by function.
            flat_fn = functools.partial(
                self._flat_fn, strategy, treedef, slots, statics, n_args, box
            )
            closed = jax.make_jaxpr(flat_fn, axis_env=axis_env)(*avals)
            out_split, proof = prove(closed, split, strategy.axis_name)
            return closed, out_split, proof, round_

        oracle: dict[int, tuple[bool, ...]] = {}
        traces = 0
        while True:
            closed, out_split, proof, round_ = trace(oracle)
            traces += 1
            found = {
                k: tuple(proof.markers.get(k, (True,) * len(r.assumed_varying)))
                for k, r in round_.records.items()
            }
            if all(found[k] == r.assumed_varying for k, r in round_.records.items()):
                break
            # Something was assumed identical that may vary: fall back to assuming nothing.
            unsound = any(
                a is False and f is True
                for k, r in round_.records.items()
                for a, f in zip(r.assumed_varying, found[k])
            )
            if traces >= _MAX_ROUNDS or (unsound and traces > 1):
                if not oracle:
                    break
                oracle = {}
                closed, out_split, proof, round_ = trace(oracle)
                traces += 1
                break
            oracle = found
        for k, record in round_.records.items():
            if record.require_identical:
                _context.check_identical(
                    record.call, record.paths, proof.markers.get(k, [True] * len(record.paths))
                )

        out_slots: tuple[_Slot, ...] = box["out_slots"]
        out_split = list(out_split)
        pos = 0
        for slot in out_slots:
            if slot.kind != _AUTO:
                out_split[pos : pos + slot.size] = [True] * slot.size
            pos += slot.size
        n_outputs = len(out_split)
        needs_token = strategy.backend == "pmap" and not any(split)
        donate = self._flat_donate(treedef, slots, n_args)
        executable = _EXECUTABLES[strategy.backend](
            strategy, closed, split, out_split, donate, needs_token
        )
        return _Plan(
            executable, box["out_treedef"], out_slots, tuple(out_split), n_outputs, needs_token,
            traces,
        )

    def _flat_donate(self, treedef, slots, n_args) -> tuple[int, ...]:
        if not self._donate:
            return ()
        dynamic_index = [i for i in range(n_args) if i not in self._static]
        donated = {dynamic_index.index(i) for i in self._donate if i in dynamic_index}
        # Leaves of the (dynamic args, kwargs) tree in order; find which top slots each arg owns.
        owners = jax.tree_util.tree_unflatten(treedef, list(range(len(slots))))
        result = []
        starts = np.cumsum([0] + [s.size for s in slots])
        for pos, arg in enumerate(owners[0]):
            if pos in donated:
                for slot_index in jax.tree_util.tree_leaves(arg):
                    result.extend(range(starts[slot_index], starts[slot_index + 1]))
        return tuple(result)

    def _flat_fn(self, strategy, treedef, slots, statics, n_args, box, *flat):
        top = []
        pos = 0
        for slot in slots:
            leaves = flat[pos : pos + slot.size]
            pos += slot.size
            if slot.kind == _SPLIT and slot.aggregation is not None:
                top.append(SyncOnRead(slot.treedef.unflatten(leaves), slot.aggregation))
            elif slot.kind == _SPLIT:
                top.append(slot.treedef.unflatten(leaves))
            else:
                top.append(leaves[0])
        box["round"].learn(flat, [slot.kind == _SPLIT for slot in slots for _ in range(slot.size)])
        dynamic, kwargs = jax.tree_util.tree_unflatten(treedef, top)
        dynamic = iter(dynamic)
        static = iter(statics)
        args = [next(static) if i in self._static else next(dynamic) for i in range(n_args)]
        context = _context.ReplicaContext(strategy, box["round"])
        _context.enter_replica(context)
        try:
            result = self._fn(*args, **kwargs)
        finally:
            _context.exit_replica()
        out_top, out_treedef = jax.tree_util.tree_flatten(result, is_leaf=is_distributed)
        out_slots = []
        out_flat = []
        for node in out_top:
            if isinstance(node, SyncOnRead):
                leaves, inner = jax.tree_util.tree_flatten(node.value)
                out_slots.append(_Slot(_STORAGE, inner, node.aggregation, len(leaves)))
            elif isinstance(node, PerReplica):
                leaves, inner = jax.tree_util.tree_flatten(node._values)
                out_slots.append(_Slot(_FORCED, inner, None, len(leaves)))
            else:
                leaves = [node]
                out_slots.append(_Slot(_AUTO))
            out_flat.extend(jnp.asarray(x) for x in leaves)
        box["out_slots"] = tuple(out_slots)
        box["out_treedef"] = out_treedef
        return out_flat


def _pmap_executable(strategy, closed, split, out_split, donate, needs_token):
    body = jex.jaxpr_as_fun(closed)
    in_axes = tuple(0 if s else None for s in split) + ((0,) if needs_token else ())
    out_axes = tuple(0 if s else None for s in out_split)
    if not out_axes:
        out_axes = (None,)

    def replica(*flat):
        if needs_token:
            flat = flat[:-1]
        outs = tuple(body(*flat))
        return outs if outs else (jnp.zeros((), jnp.int32),)

    return jax.pmap(
        replica,
        axis_name=strategy.axis_name,
        in_axes=in_axes,
        out_axes=out_axes,
        devices=strategy.devices,
        donate_argnums=donate,
    )


def _shard_map_executable(strategy, closed, split, out_split, donate, needs_token):
    del needs_token
    body = jex.jaxpr_as_fun(closed)
    axis = strategy.axis_name

    def replica(*flat):
        flat = [x[0] if s else x for x, s in zip(flat, split)]
        outs = [o[None] if s else o for o, s in zip(body(*flat), out_split)]
        return tuple(outs) if outs else (jnp.zeros((), jnp.int32),)

    in_specs = tuple(P(axis) if s else P() for s in split)
    out_specs = tuple(P(axis) if s else P() for s in out_split) or (P(),)
    mapped = jax.shard_map(
        replica, mesh=strategy.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
    )
    return jax.jit(mapped, donate_argnums=donate)


def _vmap_executable(strategy, closed, split, out_split, donate, needs_token):
    """Every replica on one device, as `jax.vmap` with the replica axis name."""
    del needs_token
    body = jex.jaxpr_as_fun(closed)
    in_axes = tuple(0 if s else None for s in split)
    replicas = jax.vmap(
        lambda *flat: tuple(body(*flat)),
        in_axes=in_axes or 0,
        axis_name=strategy.axis_name,
        axis_size=strategy.num_replicas,
    )

    def run(*flat):
        outs = replicas(*flat)
        outs = [o if s else o[0] for o, s in zip(outs, out_split)]
        return tuple(outs) if outs else (jnp.zeros((), jnp.int32),)

    return jax.jit(run, donate_argnums=donate)


_EXECUTABLES = {
    "pmap": _pmap_executable,
    "shard_map": _shard_map_executable,
    "vmap": _vmap_executable,
}


def _default_strategy() -> Any:
    from jmirror._strategy import MirroredStrategy

    return MirroredStrategy()


def _argnums(name: str, value: int | Sequence[int]) -> tuple[int, ...]:
    values = (value,) if isinstance(value, int) else tuple(value)
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise TypeError(
                f"jm.replicate({name}=...) expects non-negative ints, got {value!r}."
            )
    return values


def replicate(
    fn: Callable[..., Any] | None = None,
    *,
    strategy: Any = None,
    donate_argnums: int | Sequence[int] = (),
    static_argnums: int | Sequence[int] = (),
) -> Any:
    """Compiles a replica function to run on every device of a strategy.

    Usable as `jm.replicate(train_step)`, `@jm.replicate` and `@jm.replicate(strategy=s)`.
    Inside the function each replica sees its own component of every `PerReplica` /
    `SyncOnRead` argument; mirrored arrays are passed without a copy and any other array or
    scalar is broadcast. Gradients have `jax.pmap` semantics: the gradient with respect to a
    mirrored input is the replica's own (all-reduce it to train like one device). Outputs that
    jmirror proves identical on every replica come back mirrored, `SyncOnRead` outputs stay
    `SyncOnRead`, and every other leaf comes back as a `PerReplica`.

    Args:
      fn: the replica function.
      strategy: the `MirroredStrategy` to run on; `None` means `jm.get_strategy()` at call
        time.
      donate_argnums: positional arguments whose buffers the step may reuse.
      static_argnums: positional arguments that are static (hashed, not traced).

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
    """
    if fn is None:
        return functools.partial(
            replicate,
            strategy=strategy,
            donate_argnums=donate_argnums,
            static_argnums=static_argnums,
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
    return Replicated(fn, strategy, donate, static)
