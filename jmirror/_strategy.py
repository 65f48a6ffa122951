"""`MirroredStrategy`: devices, placement and reading of values, and the current strategy."""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jmirror import _context
from jmirror._devices import DeviceSpec, resolve_devices
from jmirror._replicate import Replicated, replicate
from jmirror._values import (
    Aggregation,
    PerReplica,
    PyTree,
    ReduceOp,
    Synchronization,
    SyncOnRead,
    ValueContext,
    is_distributed,
)

_BACKENDS = ("pmap", "shard_map")
# Steps in flight by platform: XLA:CPU host devices deadlock in their collective rendezvous
# when many programs are queued back to back; accelerators queue deeper safely.
_DEFAULT_IN_FLIGHT = {"cpu": 2}
_DEFAULT_IN_FLIGHT_ACCELERATOR = 16
_RUN_CACHE_SIZE = 64

_READ_PER_REPLICA = (
    "{call} got a PerReplica{where}: its replicas may hold different values, so there is no "
    "single value to read. Use strategy.reduce(op, value) to combine them, "
    "strategy.gather(value) to concatenate them, or strategy.local_results(value) for each "
    "replica's component."
)


def _is_python_zero(x: Any) -> bool:
    return type(x) is int and x == 0


class MirroredStrategy:
    """Synchronous data parallelism over the devices of one machine.

    State pytrees are mirrored (one copy per device), replica functions run once per device
    (`jm.replicate`, `strategy.run`) and merge across replicas with collectives, and
    sync-on-read state stays per replica until it is read.

    Args:
      devices: devices (`jax.Device` objects or specs such as `"cpu:0"`, `"/device:GPU:1"`)
        in replica order; `None` for every local device.
      num_devices: use the first `num_devices` local devices instead of listing them.
      axis_name: the collective axis name of the replicas.
      backend: `"pmap"` (compile with `jax.pmap`) or `"shard_map"` (with
        `jax.jit(jax.shard_map(...))`); both give the same results.
      max_in_flight: how many replicated steps may be queued before the next call waits for
        the oldest; `None` picks a safe default for the platform (2 on CPU host devices).

    Raises:
      ValueError: for bad devices, both `devices` and `num_devices`, an unknown backend or
        `max_in_flight < 1`.
      TypeError: when `max_in_flight` is not an int.

    Example:
        >>> import jmirror as jm
        >>> strategy = jm.MirroredStrategy(num_devices=1, axis_name="batch")
        >>> strategy.num_replicas, strategy.axis_name
        (1, 'batch')
    """

    def __init__(
        self,
        devices: Sequence[DeviceSpec] | None = None,
        *,
        num_devices: int | None = None,
        axis_name: str = "replica",
        backend: str = "pmap",
        max_in_flight: int | None = None,
    ):
        resolved = resolve_devices(devices, num_devices)
        if backend not in _BACKENDS:
            raise ValueError(
                f"MirroredStrategy(backend={backend!r}) is not a backend; expected one of "
                f"{_BACKENDS}."
            )
        self._setup(resolved, axis_name, backend, max_in_flight)

    def _setup(
        self,
        devices: tuple[jax.Device, ...],
        axis_name: str,
        backend: str,
        max_in_flight: int | None,
    ) -> None:
        self._devices = devices
        if not isinstance(axis_name, str) or not axis_name:
            raise TypeError(
                f"MirroredStrategy(axis_name=...) expects a non-empty str, got {axis_name!r}."
            )
        if max_in_flight is not None:
            if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int):
                raise TypeError(
                    f"MirroredStrategy(max_in_flight=...) expects an int or None, got "
                    f"{max_in_flight!r} of type {type(max_in_flight).__name__}."
                )
            if max_in_flight < 1:
                raise ValueError(
                    f"MirroredStrategy(max_in_flight={max_in_flight}) must be at least 1 (or "
                    "None for the platform's safe default)."
                )
        else:
            max_in_flight = _DEFAULT_IN_FLIGHT.get(
                devices[0].platform, _DEFAULT_IN_FLIGHT_ACCELERATOR
            )
        self._axis_name = axis_name
        self._backend = backend
        self._max_in_flight = max_in_flight
        if len(set(devices)) == len(devices):
            self._mesh = Mesh(np.array(devices), (axis_name,))
            self._replicated = NamedSharding(self._mesh, P())
            self._stacked = NamedSharding(self._mesh, P(axis_name))
        else:  # every replica on one device (jmirror.testing.EmulatedStrategy)
            self._mesh = Mesh(np.array(devices[:1]), (axis_name,))
            self._replicated = self._stacked = jax.sharding.SingleDeviceSharding(devices[0])
        self._device_set = frozenset(devices)
        self._in_flight: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._run_cache: collections.OrderedDict = collections.OrderedDict()

    # --- properties ----------------------------------------------------------------------------

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        """The strategy's devices, in replica order."""
        return self._devices

    @property
    def num_replicas(self) -> int:
        """The number of replicas (one per device)."""
        return len(self._devices)

    @property
    def axis_name(self) -> str:
        """The collective axis name of the replicas."""
        return self._axis_name

    @property
    def mesh(self) -> Mesh:
        """A 1-D `jax.sharding.Mesh` over `devices` named `axis_name`."""
        return self._mesh

    @property
    def backend(self) -> str:
        """`"pmap"` or `"shard_map"`."""
        return self._backend

    @property
    def max_in_flight(self) -> int:
        """How many replicated steps may be queued before the next call waits."""
        return self._max_in_flight

    def __repr__(self) -> str:
        devices = ", ".join(f"{d.platform}:{d.id}" for d in self._devices)
        return (
            f"MirroredStrategy(num_replicas={self.num_replicas}, devices=[{devices}], "
            f"axis_name={self._axis_name!r}, backend={self._backend!r}, "
            f"max_in_flight={self._max_in_flight})"
        )

    # --- scope -----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def scope(self) -> Iterator[MirroredStrategy]:
        """Makes this the current strategy (`jm.get_strategy()`) inside a `with` block.

        Example:
            >>> import jmirror as jm
            >>> strategy = jm.MirroredStrategy(num_devices=1)
            >>> with strategy.scope():
            ...     jm.get_strategy() is strategy
            True
        """
        _context.push_strategy(self)
        try:
            yield self
        finally:
            _context.pop_strategy()

    # --- internal helpers used by replicate ------------------------------------------------------

    def _is_mirrored(self, x: jax.Array) -> bool:
        sharding = x.sharding
        if sharding == self._replicated:
            return True
        return sharding.is_fully_replicated and sharding.device_set == self._device_set

    def _wait_for_room(self) -> None:
        """Blocks until fewer than `max_in_flight` replicated steps are queued."""
        must_block = False  # set when a step's outputs were all donated to a later step
        while True:
            with self._lock:
                if not self._in_flight or (
                    len(self._in_flight) < self._max_in_flight and not must_block
                ):
                    return
                oldest = self._in_flight.popleft()
            alive = next(
                (x for x in jax.tree.leaves(oldest) if not x.is_deleted()), None
            )
            if alive is None:
                # Every output was donated to a later (already queued) step: waiting for that
                # step covers this one.
                must_block = True
                continue
            alive.block_until_ready()
            must_block = False

    def _track(self, outputs: Any) -> None:
        """Records a dispatched step by its outputs (all become ready when it is done)."""
        with self._lock:
            self._in_flight.append(outputs)

    def _merge(self, call: str) -> _context.ReplicaContext | None:
        """The replica context when called inside a merge_fn; raises inside a replica."""
        if _context.in_replica_context():
            raise RuntimeError(
                f"strategy.{call} is a cross-replica method, but it was called inside a replica "
                "function. Use the replica context there (jm.all_reduce, jm.sync, ...), or "
                "jm.merge_call(lambda strategy, ...: strategy."
                f"{call.split('(')[0]}(...)) to run it in cross-replica context."
            )
        return _context.merge_context()

    # --- running -------------------------------------------------------------------------------

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict | None = None):
        """Runs `fn(*args, **kwargs)` once per replica, at once (see `jm.replicate`).

        The compiled step is cached per `fn`, so calling `run` again with the same function
        and input shapes does not recompile.

        Example:
            >>> import jmirror as jm
            >>> strategy = jm.MirroredStrategy()
            >>> ids = strategy.run(jm.replica_id)
            >>> strategy.gather(ids).tolist() == list(range(strategy.num_replicas))
            True
        """
        if self._merge("run(fn)") is not None:
            raise RuntimeError(
                "strategy.run was called inside a merge_call's merge_fn; replicated functions "
                "do not nest. Compute in merge_fn directly, or return to the replica function."
            )
        replicated = self._run_cache.get(fn)
        if replicated is None:
            replicated = replicate(fn, strategy=self)
            self._run_cache[fn] = replicated
            if len(self._run_cache) > _RUN_CACHE_SIZE:
                self._run_cache.popitem(last=False)
        else:
            self._run_cache.move_to_end(fn)
        return replicated(*args, **(kwargs or {}))

    # --- creating values -----------------------------------------------------------------------

    def create_state(
        self,
        tree: PyTree,
        *,
        synchronization: Synchronization | str = "auto",
        aggregation: Aggregation | str = "none",
    ) -> PyTree:
        """Creates distributed state: mirrored (`AUTO`, `ON_WRITE`) or sync-on-read (`ON_READ`).

        Args:
          tree: the initial value, a pytree of array-likes.
          synchronization: `AUTO` / `ON_WRITE` mirror the tree; `ON_READ` makes it a
            `SyncOnRead` with `aggregation`.
          aggregation: how a sync-on-read value is read.

        Raises:
          ValueError: for `NONE` synchronization or an invalid enum value.

        Example:
            >>> import jmirror as jm
            >>> strategy = jm.MirroredStrategy()
            >>> total = strategy.create_state(0.0, synchronization="on_read", aggregation="sum")
            >>> total.aggregation
            <Aggregation.SUM: 'sum'>
        """
        synchronization = Synchronization(synchronization)
        aggregation = Aggregation(aggregation)
        if synchronization is Synchronization.NONE:
            raise ValueError(
                "`NONE` synchronization is not supported by MirroredStrategy: every replica "
                "keeps a copy of the state, so it must be kept in sync. Use "
                "synchronization='on_write' (mirrored) or 'on_read' (SyncOnRead) in "
                "strategy.create_state."
            )
        if synchronization is Synchronization.ON_READ:
            return self.sync_on_read(tree, aggregation)
        return self.mirror(tree)

    def mirror(self, tree: PyTree) -> PyTree:
        """Places every leaf of `tree` on every device: a mirrored value.

        Leaves that are already mirrored are returned without a copy. One copy lives on each
        device; there are never N stacked copies on one device.

        Example:
            >>> import numpy as np, jmirror as jm
            >>> strategy = jm.MirroredStrategy()
            >>> params = strategy.mirror({"w": np.ones(3)})
            >>> len(params["w"].sharding.device_set) == strategy.num_replicas
            True
        """
        if self._merge("mirror(tree)") is not None:
            return tree
        leaves, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_distributed)
        out: list[Any] = [None] * len(leaves)
        todo = []
        for i, (path, leaf) in enumerate(leaves):
            if is_distributed(leaf):
                raise TypeError(
                    f"strategy.mirror got a {type(leaf).__name__} at path "
                    f"{jax.tree_util.keystr(path)!r}; per-replica values cannot be mirrored "
                    "as they are. Reduce them first (strategy.reduce) or read them "
                    "(strategy.read for SyncOnRead)."
                )
            if isinstance(leaf, jax.Array) and self._is_mirrored(leaf):
                out[i] = leaf
            else:
                todo.append(i)
        if todo:
            placed = jax.device_put(
                [leaves[i][1] for i in todo], [self._replicated] * len(todo)
            )
            for i, x in zip(todo, placed):
                out[i] = x
        return treedef.unflatten(out)

    def sync_on_read(self, tree: PyTree, aggregation: Aggregation | str = "sum") -> SyncOnRead:
        """Returns a `SyncOnRead` whose every replica starts with `tree`.

        Example:
            >>> import jmirror as jm
            >>> strategy = jm.MirroredStrategy()
            >>> count = strategy.sync_on_read(1.0, "sum")
            >>> float(strategy.read(count)) == strategy.num_replicas
            True
        """
        aggregation = Aggregation(aggregation)
        if self._merge("sync_on_read(tree)") is not None:
            return SyncOnRead(tree, aggregation)
        return SyncOnRead(self._stack_copies(self.mirror(tree)), aggregation)

    def _stack_copies(self, mirrored: PyTree) -> PyTree:
        """N stacked copies of a mirrored tree, slice i on device i (no communication)."""
        n = self.num_replicas
        return _stack_fn(self._stacked, n)(mirrored)

    def distribute_values_from_function(self, value_fn: Callable[[ValueContext], PyTree]):
        """Returns a `PerReplica` whose component i is `value_fn(ValueContext(i, N))`.

        Component i is placed on device i.

        Example:
            >>> import numpy as np, jmirror as jm
            >>> strategy = jm.MirroredStrategy()
            >>> ids = strategy.distribute_values_from_function(
            ...     lambda ctx: np.float32(ctx.replica_id))
            >>> [float(v) for v in strategy.local_results(ids)] == list(
            ...     range(strategy.num_replicas))
            True
        """
        if self._merge("distribute_values_from_function(value_fn)") is not None:
            raise RuntimeError(
                "strategy.distribute_values_from_function cannot run inside a merge_fn; call "
                "it outside the replicated function and pass the result in."
            )
        n = self.num_replicas
        components = [value_fn(ValueContext(replica_id=i, num_replicas=n)) for i in range(n)]
        treedef = jax.tree.structure(components[0])
        for i, component in enumerate(components[1:], start=1):
            if jax.tree.structure(component) != treedef:
                raise ValueError(
                    "strategy.distribute_values_from_function: value_fn returned trees of "
                    f"different structure for replica 0 ({treedef}) and replica {i} "
                    f"({jax.tree.structure(component)}); every replica needs the same structure."
                )
        per_leaf = zip(*(jax.tree.leaves(c) for c in components))
        stacked = [self._place_components(list(parts), i) for i, parts in enumerate(per_leaf)]
        return PerReplica(treedef.unflatten(stacked))

    def _place_components(self, parts: list[Any], leaf_index: int) -> jax.Array:
        shapes = {np.shape(p) for p in parts}
        if len(shapes) != 1:
            raise ValueError(
                f"strategy.distribute_values_from_function: leaf {leaf_index} has different "
                f"shapes across replicas ({[np.shape(p) for p in parts]}); components of a "
                "PerReplica must share one shape."
            )
        if isinstance(self._stacked, jax.sharding.SingleDeviceSharding):
            return jax.device_put(jnp.stack([jnp.asarray(p) for p in parts]), self._stacked)
        arrays = [jax.device_put(jnp.asarray(p)[None], d) for p, d in zip(parts, self._devices)]
        shape = (self.num_replicas,) + tuple(arrays[0].shape[1:])
        return jax.make_array_from_single_device_arrays(shape, self._stacked, arrays)

    def split_key(self, key: jax.Array) -> PerReplica:
        """Splits a PRNG key into a `PerReplica` of N independent keys (per-replica noise).

        Example:
            >>> import jax, jmirror as jm
            >>> strategy = jm.MirroredStrategy()
            >>> keys = strategy.split_key(jax.random.key(0))
            >>> keys.values.shape == (strategy.num_replicas,)
            True
        """
        context = self._merge("split_key(key)")
        keys = jax.random.split(key, self.num_replicas)
        if context is not None:
            return PerReplica._from_local(keys[context.replica_id])
        return PerReplica(jax.device_put(keys, self._stacked))

    # --- input ---------------------------------------------------------------------------------

    def distribute_dataset(self, dataset: Any, *, remainder: str = "pad", prefetch: int = 2):
        """Splits each global batch of `dataset` into per-replica shards on the devices.

        See `jmirror._input.distribute_dataset` (SPEC section 7) for the full contract.

        Example:
            >>> import numpy as np, jmirror as jm
            >>> strategy = jm.MirroredStrategy()
            >>> n = strategy.num_replicas
            >>> batches = [np.ones((2 * n, 3), np.float32)] * 2
            >>> with strategy.distribute_dataset(batches, remainder="drop") as data:
            ...     shapes = [b.values.shape for b in data]
            >>> shapes == [(n, 2, 3)] * 2
            True
        """
        from jmirror._input import distribute_dataset

        return distribute_dataset(self, dataset, remainder=remainder, prefetch=prefetch)

    def distribute_datasets_from_function(self, dataset_fn: Callable[..., Any], *, prefetch: int = 2):
        """Deals the per-replica batches of `dataset_fn(jm.InputContext(...))` to replicas.

        See `jmirror._input.distribute_datasets_from_function` (SPEC section 7).

        Example:
            >>> import numpy as np, jmirror as jm
            >>> strategy = jm.MirroredStrategy()
            >>> n = strategy.num_replicas
            >>> def dataset_fn(ctx):
            ...     return [np.full((2,), i, np.float32) for i in range(2 * n)]
            >>> data = strategy.distribute_datasets_from_function(dataset_fn)
            >>> len(list(data))
            2
        """
        from jmirror._input import distribute_datasets_from_function

        return distribute_datasets_from_function(self, dataset_fn, prefetch=prefetch)

    # --- reading values ------------------------------------------------------------------------

    def _on_first_device(self, x: jax.Array) -> jax.Array:
        for shard in x.addressable_shards:
            if shard.device == self._devices[0]:
                return shard.data
        return jax.device_put(x, self._devices[0])

    def _gathered(self, stacked: Any) -> jax.Array:
        """The stacked components of a leaf, all on devices[0]."""
        return jax.device_put(stacked, self._devices[0])

    def read(self, tree: PyTree) -> PyTree:
        """Returns the value of mirrored and sync-on-read state, in cross-replica context.

        Mirrored leaves give their value as a `jax.Array` on `devices[0]` (one copy, no
        gather); `SyncOnRead` nodes are aggregated (`SUM`, `MEAN`, `ONLY_FIRST_REPLICA`); other
        non-distributed leaves are returned unchanged.

        Raises:
          TypeError: for a `PerReplica` (use `reduce`, `gather` or `local_results`).
          ValueError: for a `SyncOnRead` with aggregation `NONE`.

        Example:
            >>> import jmirror as jm
            >>> strategy = jm.MirroredStrategy()
            >>> state = {"w": strategy.mirror(2.0), "n": strategy.sync_on_read(1, "sum")}
            >>> out = strategy.read(state)
            >>> float(out["w"]), int(out["n"]) == strategy.num_replicas
            (2.0, True)
        """
        context = self._merge("read(tree)")
        return jax.tree.map(
            lambda x: self._read_node(x, context), tree, is_leaf=is_distributed
        )

    def _read_node(self, x: Any, context: _context.ReplicaContext | None) -> Any:
        if isinstance(x, PerReplica):
            where = " inside merge_fn" if context is not None else ""
            raise TypeError(_READ_PER_REPLICA.format(call="strategy.read", where=where))
        if isinstance(x, SyncOnRead):
            agg = x.aggregation
            if agg is Aggregation.NONE:
                raise ValueError(
                    "strategy.read got a SyncOnRead with aggregation NONE, which has no defined "
                    "value across replicas. Create it with aggregation 'sum', 'mean' or "
                    "'only_first_replica', or use strategy.local_results to see each component."
                )
            if agg is Aggregation.ONLY_FIRST_REPLICA:
                if context is not None:
                    return context.sync(x.value, agg)
                return jax.tree.map(lambda v: self._component(v, 0), x.value)
            op = ReduceOp.SUM if agg is Aggregation.SUM else ReduceOp.MEAN
            if context is not None:
                return _context.merge_reduce(context, op, x.value, None)
            return jax.tree.map(lambda v: _reduce_fn(op, None)(self._gathered(v)), x.value)
        if context is None and isinstance(x, jax.Array) and self._is_mirrored(x):
            return self._on_first_device(x)
        return x

    def _component(self, stacked: Any, i: int) -> Any:
        if isinstance(stacked, jax.Array):
            for shard in stacked.addressable_shards:
                if shard.device == self._devices[i] and shard.data.shape[:1] == (1,):
                    return _squeeze(shard.data)
            return _squeeze(jax.device_put(stacked[i : i + 1], self._devices[i]))
        return np.asarray(stacked)[i]

    def assign(self, sync_on_read: SyncOnRead, value: PyTree) -> SyncOnRead:
        """Returns a new `SyncOnRead` holding `value`: reading it gives `value`.

        For `SUM` each replica gets `value / N` cast to the dtype (integers truncate);
        otherwise each replica gets `value`.

        Example:
            >>> import jmirror as jm
            >>> strategy = jm.MirroredStrategy()
            >>> total = strategy.assign(strategy.sync_on_read(0.0, "sum"), 6.0)
            >>> float(strategy.read(total))
            6.0
        """
        if not isinstance(sync_on_read, SyncOnRead):
            raise TypeError(
                f"strategy.assign expects a SyncOnRead, got {type(sync_on_read).__name__}. "
                "Mirrored state is replaced by returning a new value from the replica function."
            )
        context = self._merge("assign(sync_on_read, value)")
        n = self.num_replicas
        if jax.tree.structure(value) != jax.tree.structure(sync_on_read.value):
            raise ValueError(
                f"strategy.assign: the value's structure {jax.tree.structure(value)} differs from "
                f"the SyncOnRead's {jax.tree.structure(sync_on_read.value)}; pass a value of the "
                "same structure."
            )

        def component(old: Any, new: Any) -> Any:
            dtype = jnp.result_type(old)
            new = jnp.asarray(new)
            if sync_on_read.aggregation is Aggregation.SUM:
                new = new / n
            return new.astype(dtype)

        if context is not None:
            return sync_on_read.replace(jax.tree.map(component, sync_on_read.value, value))
        old = jax.tree.map(lambda v: jax.ShapeDtypeStruct(np.shape(v)[1:], jnp.result_type(v)),
                           sync_on_read.value)
        new = jax.tree.map(component, old, value)
        return sync_on_read.replace(self._stack_copies(self.mirror(new)))

    def local_results(self, value: PyTree) -> tuple[PyTree, ...]:
        """Returns the per-replica components of `value`, in replica order.

        A `PerReplica` or `SyncOnRead` gives its N components; a mirrored array its N
        copies; a tree holding such nodes gives N trees; any other value gives `(value,)`.

        Example:
            >>> import jmirror as jm
            >>> strategy = jm.MirroredStrategy()
            >>> parts = strategy.local_results(strategy.run(jm.replica_id))
            >>> [int(p) for p in parts] == list(range(strategy.num_replicas))
            True
        """
        context = self._merge("local_results(value)")
        n = self.num_replicas
        nodes, treedef = jax.tree_util.tree_flatten(value, is_leaf=is_distributed)
        if context is not None:
            per_node = [self._merge_components(context, x) for x in nodes]
        else:
            per_node = [self._components(x) for x in nodes]
        if all(p is None for p in per_node):
            return (value,)
        trees = []
        for i in range(n):
            leaves = [x if p is None else p[i] for x, p in zip(nodes, per_node)]
            trees.append(treedef.unflatten(leaves))
        return tuple(trees)

    def _components(self, x: Any) -> list[Any] | None:
        n = self.num_replicas
        if isinstance(x, PerReplica):
            return [jax.tree.map(lambda v: self._component(v, i), x.values) for i in range(n)]
        if isinstance(x, SyncOnRead):
            return [x.replace(jax.tree.map(lambda v: self._component(v, i), x.value))
                    for i in range(n)]
        if isinstance(x, jax.Array) and n > 1 and self._is_mirrored(x):
            by_device = {s.device: s.data for s in x.addressable_shards}
            return [by_device[d] for d in self._devices]
        return None

    def _merge_components(self, context: _context.ReplicaContext, x: Any) -> list[Any] | None:
        if isinstance(x, PerReplica):
            stacked = x.values
        elif isinstance(x, SyncOnRead):
            stacked = context.all_gather(x.value)
        else:
            return None
        return [jax.tree.map(lambda v: v[i], stacked) for i in range(self.num_replicas)]

    def reduce(self, op: ReduceOp | str, value: PyTree, axis: int | None = None) -> PyTree:
        """Reduces a `PerReplica` across replicas into one value on `devices[0]`.

        Args:
          op: `SUM`, `MEAN`, `MAX` or `MIN`.
          value: a `PerReplica` (or a tree holding them).
          axis: `None` reduces element-wise across replicas; `axis=k` also reduces over axis k
            of each component, so `MEAN` gives the mean over the global batch.

        Returns:
          The reduced value. A non-distributed or mirrored value: `MEAN` returns it
          unchanged; `SUM` returns it when N == 1; the Python int 0 returns 0.

        Raises:
          ValueError: `SUM` of a non-distributed value with more than one replica.

        Example:
            >>> import numpy as np, jmirror as jm
            >>> strategy = jm.MirroredStrategy()
            >>> n = strategy.num_replicas
            >>> x = jm.PerReplica(np.arange(n * 2, dtype=np.float32).reshape(n, 2))
            >>> float(strategy.reduce("mean", x, axis=0)) == (n * 2 - 1) / 2
            True
        """
        op = ReduceOp(op)
        context = self._merge("reduce(op, value)")
        if _is_python_zero(value):
            return 0
        if not any(isinstance(x, PerReplica) for x in jax.tree.leaves(value, is_leaf=is_distributed)):
            return self._reduce_plain(op, value)

        def one(x: Any) -> Any:
            if isinstance(x, PerReplica):
                if context is not None:
                    return _context.merge_reduce(context, op, x._values, axis)
                return jax.tree.map(lambda v: _reduce_fn(op, axis)(self._gathered(v)), x.values)
            return self._reduce_plain(op, x)

        return jax.tree.map(one, value, is_leaf=is_distributed)

    def _reduce_plain(self, op: ReduceOp, value: Any) -> Any:
        if op is ReduceOp.SUM and self.num_replicas > 1:
            raise ValueError(
                f"strategy.reduce(SUM, value) got a value that is not a PerReplica "
                f"({type(value).__name__}) with {self.num_replicas} replicas: a value identical "
                "on every replica has no defined per-replica sum. Pass a PerReplica (for "
                "example a replica function's output), or use MEAN to get the value back."
            )
        return value

    def gather(self, value: PyTree, axis: int = 0) -> PyTree:
        """Concatenates the replicas' components along `axis`: the global batch back.

        Scalar components are stacked into a vector. The result is a `jax.Array` on
        `devices[0]`.

        Example:
            >>> import numpy as np, jmirror as jm
            >>> strategy = jm.MirroredStrategy()
            >>> n = strategy.num_replicas
            >>> x = jm.PerReplica(np.arange(n * 2).reshape(n, 2))
            >>> strategy.gather(x).tolist() == list(range(n * 2))
            True
        """
        context = self._merge("gather(value)")

        def one(x: Any) -> Any:
            if isinstance(x, PerReplica):
                if context is not None:
                    return jax.tree.map(
                        lambda v: context.all_gather(v, axis=axis, tiled=jnp.ndim(v) > 0),
                        x._values,
                    )
                return jax.tree.map(lambda v: _gather_fn(axis)(self._gathered(v)), x.values)
            if isinstance(x, SyncOnRead):
                raise TypeError(
                    "strategy.gather got a SyncOnRead; read it with strategy.read, or see its "
                    "components with strategy.local_results."
                )
            if context is None and isinstance(x, jax.Array) and self._is_mirrored(x):
                copy = self._on_first_device(x)
                return jnp.concatenate([copy] * self.num_replicas, axis=axis)
            return x

        return jax.tree.map(one, value, is_leaf=is_distributed)

    def update(self, tree: PyTree, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Applies `fn(tree, *args, **kwargs)` to every replica's copy of the mirrored `tree`.

        `PerReplica` arguments are split; the result is typed like a replicated function's.

        Example:
            >>> import jmirror as jm
            >>> strategy = jm.MirroredStrategy()
            >>> w = strategy.update(strategy.mirror(1.0), lambda w, d: w + d, 2.0)
            >>> float(strategy.read(w))
            3.0
        """
        if self._merge("update(tree, fn)") is not None:
            # Inside merge_fn every replica runs fn on its own components.
            tree, args, kwargs = jax.tree.map(
                lambda x: x._values if isinstance(x, PerReplica) else x,
                (tree, args, kwargs),
                is_leaf=lambda x: isinstance(x, PerReplica),
            )
            return fn(tree, *args, **kwargs)
        return self.run(_Updater(fn), args=(tree,) + args, kwargs=kwargs)


class _Updater:
    """`fn` as a replica function, hashed by `fn` so that `update` reuses compiled steps."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __hash__(self) -> int:
        return hash(self.fn)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Updater) and other.fn == self.fn


_squeeze = jax.jit(lambda x: x[0])


@functools.cache
def _reduce_fn(op: ReduceOp, axis: int | None) -> Callable[[jax.Array], jax.Array]:
    """Reduces stacked components (leading replica axis), and axis `axis` of each component."""
    axes = 0 if axis is None else (0, axis + 1 if axis >= 0 else axis)
    reducer = {
        ReduceOp.SUM: jnp.sum,
        ReduceOp.MEAN: jnp.mean,
        ReduceOp.MAX: jnp.max,
        ReduceOp.MIN: jnp.min,
    }[op]
    return jax.jit(lambda x: reducer(x, axis=axes))


@functools.cache
def _gather_fn(axis: int) -> Callable[[jax.Array], jax.Array]:
    """Concatenates stacked components along `axis` of each component."""

    def gather(x: jax.Array) -> jax.Array:
        if x.ndim == 1:  # scalar components: the global vector of them
            return x
        return jnp.concatenate(list(x), axis=axis)

    return jax.jit(gather)


@functools.cache
def _stack_fn(sharding: NamedSharding, n: int) -> Callable[[PyTree], PyTree]:
    """N stacked copies of a mirrored tree; each device writes its own slice."""

    def stack(tree: PyTree) -> PyTree:
        return jax.tree.map(lambda x: jnp.broadcast_to(x[None], (n,) + jnp.shape(x)), tree)

    return jax.jit(stack, out_shardings=sharding)


def get_strategy() -> MirroredStrategy:
    """Returns the innermost current strategy, else a default one over all local devices.

    The default `MirroredStrategy()` is created once, on first use.

    Example:
        >>> import jmirror as jm
        >>> jm.get_strategy() is jm.get_strategy()
        True
    """
    return _context.current_strategy(MirroredStrategy)
