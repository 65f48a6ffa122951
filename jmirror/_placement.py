"""Places a replicated call's array leaves where its step runs them, before the call.

A leaf is *in place* when it is a `jax.Array` laid out over the strategy's own mesh (any
layout there: the step's program moves it inside the mesh) or, on one device, committed to
that device. Every other array leaf is placed before the call, as the same value:

- a numpy array, an array not committed to devices, an array committed to other devices or
  laid out on another mesh over the same devices (a user's `NamedSharding(Mesh(devices,
  ("data",)), P("data"))`, a mirrored leaf of a strategy with another `devices_per_replica`);
- a leaf inside a `PerReplica` / `SyncOnRead` / `Sharded` node goes to the stacked layout
  (slice i on replica i), after its leading axis is checked against the replica count;
- any other leaf goes to its mirrored layout (`Topology.leaf_sharding`: its own metadata or
  the layout rules inside a replica, replicated over the replicas).

Python numbers that are traced (not static) are placed mirrored too, keeping their weak type
(`jax.device_put` keeps it): the step then returns, for state such as `TrainState.create`'s
`step=0`, an array of the very type it was given, and the second call reuses the first's
compiled step instead of compiling again for a committed array. Each value's placed array is
kept for later calls (a few values: flags, constant rates); a donated leaf, and a value's
repeat within one call, get arrays of their own.

With several processes, JAX takes host values as the same value on every process. Only
`jax.device_put` makes weakly typed global arrays, and it checks each value equal across
processes first (a collective of milliseconds; wrongly for Python floats that float32 cannot
hold): jmirror uses it for weakly typed arrays not committed to a device (`jnp.asarray(0.5)`,
library state), leaves Python floats to JAX, and places Python integers and bools (a
`TrainState.create` step) as arrays of JAX's integer dtype, not weakly typed. Arrays
committed to this process's devices (which JAX refuses), numpy arrays and other arrays not
committed are laid out by each process from its own copy; a global array on the strategy's
devices laid out otherwise (another mesh, another order) is laid out again by JAX
(`jax.device_put`); one on other devices is left to JAX.

Deciding costs two C-level passes per call (each array's sharding, then a set of their
ids) and a set comparison: shardings met once are remembered by identity, and the arrays a
step returns share their shardings. Tracers (a call inside the caller's own `jit`, `grad`,
`vmap`) are left to JAX.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jmirror._arguments import Layout
from jmirror._topology import Topology, declared_leaves
from jmirror._values import PyTree

# Shardings remembered per placement before the memory starts again.
_REMEMBERED = 256


class Placement:
    """The placement of call arguments on one topology (see the module docstring)."""

    def __init__(self, topology: Topology):
        self.topology = topology
        self._topology = topology
        # Inside replicas spanning devices (or under layout rules) a mirrored leaf is in place
        # only in its own layout (`Topology.leaf_sharding`), committed to its devices.
        self._laid_out = topology.devices_per_replica > 1 or topology.layout is not None
        self._several = topology.process_count > 1
        # id(sharding) -> the sharding (kept alive so that its id is not reused).
        self._in_place: dict[int, Any] = {id(None): None}
        # Laid out: (id(sharding), id(expected)) -> both, for pairs found equal; the expected
        # layouts of each structure by id(layout) -> (layout, expected).
        self._pairs: dict[tuple[int, int], tuple[Any, Any]] = {}
        self._expected: dict[int, tuple[Layout, list[Any]]] = {}
        # (type, value, sign, id(sharding)) -> (the placed number, its sharding kept alive).
        self._scalars: dict[tuple, tuple[jax.Array, Any]] = {}

    def place(
        self,
        name: str,
        layout: Layout,
        leaves: list[Any],
        types: set[type],
        tree: PyTree,
        where: Callable[[Any], str],
        statics: tuple[tuple[int, Any], ...] = (),
    ) -> tuple[list[Any], bool] | None:
        """Returns `leaves` with every leaf that is not in place placed, and whether an array
        was (not only Python numbers: what the warnings of arguments look at); None when all
        are in place.

        Args:
          name: how errors name the replicated function.
          layout: the structure's `Layout` (which leaves are split over the replicas).
          leaves: the flat leaves of `tree`, statics included.
          types: the set of the leaves' types.
          tree: `(donated args, other args, kwargs)`, for the layout rules' paths.
          where: names a key path into `tree` for messages (`Positions.where`).
          statics: `(flat index, value)` of the static leaves (never placed).

        Raises:
          ValueError: a leaf of a distributed value whose leading axis is not the replica
            count (a `PerReplica` made for another strategy).
        """
        if not self._laid_out and types <= _PLACED_ARRAYS:
            # The common call: every leaf a placed jax.Array; one C-level pass over their
            # shardings' ids.
            if set(map(id, map(_SHARDING, leaves))) <= self._in_place.keys():
                return None
        elif has_tracers(types):
            return None
        else:
            _PLACED_ARRAYS.update(t for t in types if _is_placed_array_type(t))
        numbers = _INTEGERS if self._several else PYTHON_NUMBERS  # see the module docstring
        scalars = _traced_scalars(leaves, types, statics, numbers)
        expected = self._expected_of(name, layout, leaves, tree) if self._laid_out else None
        if np.ndarray not in types and not scalars:
            # Leaves without a sharding (Python numbers, statics) give None: in place.
            shardings = list(map(getattr, leaves, _REPEAT_SHARDING, _REPEAT_NONE))
            if expected is not None:
                if self._all_laid_out(leaves, shardings, expected):
                    return None
            elif set(map(id, shardings)) <= self._in_place.keys():
                return None
            elif all(map(self._learn, shardings)):
                return None
        return self._place_all(name, layout, leaves, tree, where, expected, scalars)

    def _learn(self, sharding: Any) -> bool:
        """Returns whether arrays laid out by `sharding` are in place (remembering it if so)."""
        if id(sharding) in self._in_place:
            return True
        if not self.in_place(sharding):
            return False
        if len(self._in_place) >= _REMEMBERED:
            self._in_place = {id(None): None}
        self._in_place[id(sharding)] = sharding
        return True

    def in_place(self, sharding: Any) -> bool:
        """Returns whether an array laid out by `sharding` is on the strategy's mesh."""
        topology = self._topology
        if sharding.device_set != topology.device_set:
            return False
        return isinstance(sharding, NamedSharding) and sharding.mesh == topology.mesh

    def _expected_of(self, name: str, layout: Layout, leaves: list[Any], tree: PyTree) -> list[Any]:
        """Returns each leaf's own mirrored layout (None: split leaves and non-arrays)."""
        known = self._expected.get(id(layout))
        if known is not None:
            return known[1]
        topology = self._topology
        expected = []
        for (path, x, like), split in zip(declared_leaves(tree), layout.split):
            if split:
                expected.append(self._pieces_layout(path, x))
            elif not isinstance(x, (jax.Array, np.ndarray)):
                expected.append(None)
            else:
                expected.append(topology.leaf_sharding(path[2:], like, name))
        self._expected[id(layout)] = (layout, expected)
        return expected

    def _pieces_layout(self, path: tuple, x: Any) -> Any:
        """Returns the layout of a `jm.Sharded` node's stacked pieces (`[N, length]`) as the
        step returns them, split over the model axis too (None for other split leaves: any
        layout over the mesh is in place). Pieces made elsewhere (an `nnx.Optimizer` built in
        the strategy's scope lays them out by its parameters' metadata) are placed so, and the
        step compiles once."""
        last = path[-1] if path else None
        if getattr(last, "name", None) != "shards" or np.ndim(x) != 2:
            return None
        return self._topology.pieces_sharding(np.shape(x)[1])

    def _all_laid_out(self, leaves: list[Any], shardings: list[Any], expected: list[Any]) -> bool:
        """Returns whether every array is committed in its expected layout."""
        if not all(map(getattr, leaves, _REPEAT_COMMITTED, _REPEAT_TRUE)):
            return False
        pairs = self._pairs
        if set(zip(map(id, shardings), map(id, expected))) <= pairs.keys():
            return True
        for actual, wanted in zip(shardings, expected):
            if (id(actual), id(wanted)) in pairs:
                continue
            if not (self._learn(actual) if wanted is None else actual == wanted):
                return False
            if len(pairs) >= _REMEMBERED:
                pairs.clear()
            pairs[(id(actual), id(wanted))] = (actual, wanted)
        return True

    def _place_all(
        self,
        name: str,
        layout: Layout,
        leaves: list[Any],
        tree: PyTree,
        where: Callable[[Any], str],
        expected: list[Any] | None,
        scalars: set[int],
    ) -> tuple[list[Any], bool]:
        topology = self._topology
        found = None
        placed = []
        arrays = False  # whether an array (not a Python number) was placed
        used: set[tuple] = set()  # the kept numbers this call took (each leaf its own array)
        for i, (x, split) in enumerate(zip(leaves, layout.split)):
            wanted = None if expected is None else expected[i]
            if i in scalars and not split and self._several:
                placed.append(_put_integer(x, wanted or topology.mirrored))
            elif i in scalars and not split:
                # A donated leaf's array is consumed by the call: never a kept one.
                donated = i < layout.num_donated
                placed.append(self._scalar(x, wanted or topology.mirrored, used, donated))
            elif not self._needs_place(x, wanted):
                placed.append(x)
            elif split:
                if found is None:
                    found = declared_leaves(tree)
                placed.append(self._place_split(name, x, where(found[i][0]), wanted))
                arrays = True
            else:
                placed.append(_put(x, wanted or topology.mirrored))
                arrays = True
        return placed, arrays

    def _scalar(self, x: complex, sharding: Any, used: set[tuple], donated: bool) -> jax.Array:
        """Returns the Python number `x` placed mirrored, weakly typed: the array kept for its
        value, unless the leaf is donated or the call already took that array (one array
        given twice in a call could not be donated, and is refused)."""
        sign = math.copysign(1.0, x) if isinstance(x, float) else 0.0  # 0.0 and -0.0
        key = (type(x), x, sign, id(sharding))
        if donated or key in used:
            return jax.device_put(x, sharding)
        used.add(key)
        known = self._scalars.get(key)
        if known is None or known[0].is_deleted():  # donated by an earlier call
            if len(self._scalars) >= _REMEMBERED:
                self._scalars.clear()
            known = self._scalars[key] = (jax.device_put(x, sharding), sharding)
        return known[0]

    def _needs_place(self, x: object, wanted: PyTree) -> bool:
        if isinstance(x, np.ndarray):
            return True
        if not isinstance(x, jax.Array) or x.is_deleted():
            return False  # a number, a static leaf; a deleted array is the donation check's
        if self._several and not self._placed_across(x):
            return False
        if wanted is not None:
            return not x.committed or x.sharding != wanted
        return not self._learn(x.sharding)

    def _placed_across(self, x: jax.Array) -> bool:
        """Returns whether jmirror places array `x` with several processes (the module
        docstring): else JAX takes it as it is."""
        if not x.is_fully_addressable:  # a global array: laid out again on the same devices
            return x.sharding.device_set == self._topology.device_set
        return True

    def _place_split(self, name: str, x: PyTree, path: str, wanted: Any = None) -> PyTree:
        topology = self._topology
        if np.shape(x)[:1] != (topology.num_replicas,):
            raise split_error(name, topology, path, x)
        return jax.device_put(x, wanted or topology.stacked)


def _put(x: Any, sharding: Any) -> jax.Array:
    """Returns the array `x` laid out by `sharding`, as the same value on every process.

    With several processes each process lays out its own copy of a value of its own (a numpy
    array, an array on this process's devices): jaxlib cannot move an array committed to one
    process's devices to the others' on CPU, and `jax.device_put` of a host value checks it
    equal on every process first (a collective of milliseconds, each call).
    """
    if sharding.is_fully_addressable or (isinstance(x, jax.Array) and not x.is_fully_addressable):
        return jax.device_put(x, sharding)  # one process; or a global array, laid out again
    if isinstance(x, jax.Array) and not x.committed and getattr(x, "weak_type", False):
        # Only `jax.device_put` keeps a weak type (it checks the value equal on every process
        # first: milliseconds; such values are mostly state, placed once).
        return jax.device_put(x, sharding)
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        # A random key has no host value: its key data is laid out, and wrapped again.
        data = _put(jax.random.key_data(x), sharding)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def split_error(name: str, topology: Topology, path: str | None, leaf: PyTree) -> ValueError:
    """Returns the error of a per-replica leaf whose leading axis is not the replica count."""
    n = topology.num_replicas
    shape = tuple(np.shape(leaf))
    where = f" at {path}" if path else ""
    if path is not None and path.endswith(".shards"):  # a jm.shard_update state for another N
        return ValueError(
            f"{name} got a jm.Sharded state leaf{where} whose pieces have shape {shape}, cut "
            f"for another replica count; the strategy has {n} replicas. Restore the state "
            "through jmirror.checkpoint (which re-shards it onto any replica count), or call "
            "tx.init on this strategy."
        )
    found = f"{name} got a per-replica leaf of shape {shape}{where}"
    if isinstance(leaf, jax.Array) and topology.is_stacked_elsewhere(leaf):
        # Placed per replica by another strategy: a notebook cell re-run after the strategy
        # was created again, say.
        return ValueError(
            f"{found}, placed per replica over the {len(leaf.sharding.device_set)} device(s) "
            "of another strategy: it came from that strategy's distribute_dataset (or one of "
            f"its steps), not from this strategy's ({n} replicas). A batch belongs to the "
            "strategy that placed it: after creating the strategy again (as re-running a "
            "notebook cell does), call the new strategy's distribute_dataset again."
        )
    if not shape:  # tf.distribute's one value per replica, as a list of scalars
        return ValueError(
            f"{found}; a PerReplica / SyncOnRead leaf holds one slice per replica along a "
            f"leading axis of size {n}. For one value per replica, stack them: "
            "jm.PerReplica(np.stack(values)), or "
            "strategy.distribute_values_from_function(lambda ctx: values[ctx.replica_id])."
        )
    return ValueError(
        f"{found}; a PerReplica / SyncOnRead leaf needs a leading axis of size {n} (the number "
        "of replicas), one slice per replica. Reshape the global batch to (num_replicas, "
        "per_replica_batch, ...) or use strategy.distribute_dataset, which does this for you."
    )


PYTHON_NUMBERS = frozenset({int, float, bool, complex})


_INTEGERS = frozenset({int, bool})


def _traced_scalars(
    leaves: list[Any], types: set[type], statics: tuple, numbers: frozenset[type] = PYTHON_NUMBERS
) -> set[int]:
    """Returns the flat indices of the Python numbers (of the types `numbers`) among `leaves`
    that are traced."""
    if types.isdisjoint(numbers):
        return set()
    static_at = {i for i, _ in statics}
    return {i for i, x in enumerate(leaves) if type(x) in numbers and i not in static_at}


def _put_integer(x: int, sharding: Any) -> jax.Array | int:
    """Returns the Python integer (or bool) `x` laid out by `sharding` with several processes,
    as an array of JAX's integer dtype (not weakly typed; `x` itself when that dtype cannot
    hold it: JAX then says so)."""
    dtype = jax.dtypes.canonicalize_dtype(np.asarray(x).dtype)
    if not isinstance(x, bool) and not np.iinfo(dtype).min <= x <= np.iinfo(dtype).max:
        return x
    return _put(np.asarray(x, dtype), sharding)


_SHARDING = operator.attrgetter("sharding")
# The classes of placed (concrete) jax.Arrays met so far.
_PLACED_ARRAYS: set[type] = set()


def _is_placed_array_type(t: type) -> bool:
    return issubclass(t, jax.Array) and not issubclass(t, jax.core.Tracer)


_REPEAT_SHARDING = itertools.repeat("sharding")
_REPEAT_NONE = itertools.repeat(None)
_REPEAT_COMMITTED = itertools.repeat("committed")
_REPEAT_TRUE = itertools.repeat(True)
_TRACER_TYPES: set[type] = set()
_NOT_TRACER_TYPES: set[type] = set()


def has_tracers(types: set[type]) -> bool:
    """Returns whether a leaf of one of `types` is a tracer (the caller's transformation)."""
    if types <= _NOT_TRACER_TYPES:
        return False
    for t in types:
        if t in _TRACER_TYPES:
            return True
        if issubclass(t, jax.core.Tracer):
            _TRACER_TYPES.add(t)
            return True
        _NOT_TRACER_TYPES.add(t)
    return False
