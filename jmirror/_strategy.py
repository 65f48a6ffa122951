"""`MirroredStrategy`: the facade over a topology, a dispatch policy and the cross-replica ops.

A strategy is a `Topology` (its devices, mesh and value layouts: `jmirror._topology`), a
backend and a `Dispatch` policy (the bound on steps in flight and buffer donation:
`jmirror._dispatch`). Its methods forward: placing and reading values to the cross-replica
operations (`jmirror._cross_replica`: on the host, or with collectives inside a `merge_fn`),
running to `jm.replicate`, input to `jmirror._input`. It also keeps the current strategy
(`scope`, `jm.get_strategy`).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jmirror import _context, _nnx, _nnx_metrics
from jmirror._adapter import map_traced_leaves
from jmirror._backends import BACKENDS, choose
from jmirror._cross_replica import CrossReplica, check_gather_axis
from jmirror._devices import Device, DeviceSpec, resolve_devices
from jmirror._dispatch import Dispatch, explain_deleted
from jmirror._host_ops import HostOps
from jmirror._input import DistributedDataset, distribute_dataset, distribute_datasets_from_function
from jmirror._merge_ops import MergeOps
from jmirror._placement import PYTHON_NUMBERS
from jmirror._process_ops import ProcessHostOps
from jmirror._replicate import replicate
from jmirror._step_stats import StepStats
from jmirror._topology import LayoutRules, Topology
from jmirror._values import (
    Aggregation,
    PerReplica,
    PyTree,
    ReduceOp,
    Synchronization,
    SyncOnRead,
    ValueContext,
)

_PUBLIC_BACKENDS = ("pmap", "shard_map")
_RUN_CACHE_SIZE = 64
_CROSS_REPLICA_IN_REPLICA = (
    "strategy.{call} is a cross-replica method, but it was called inside a replica function. "
    "Use the replica context there (jm.all_reduce, jm.sync, ...), or "
    "jm.merge_call(lambda strategy, ...: strategy.{name}(...)) to run it in cross-replica "
    "context."
)


# tf.distribute.Strategy's names with another name (or none) in jmirror.
TF_STRATEGY_NAMES = {
    "num_replicas_in_sync": "num_replicas",
    "experimental_local_results": "local_results",
    "experimental_distribute_dataset": "distribute_dataset",
    "experimental_distribute_values_from_function": "distribute_values_from_function",
    "experimental_run_v2": "run",
    "extended": "update(tree, fn, ...) and strategy.mirror / strategy.read (no `extended`)",
}


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
        `jax.jit(jax.shard_map(...))`); both give the same results. `None`: `"pmap"`, or
        `"shard_map"` when `devices_per_replica > 1` (`"pmap"` is then a `ValueError`).
      max_in_flight: how many replicated steps may be queued before the next call waits for
        the oldest; `None` picks a safe default for the platform (2 on CPU host devices, at
        most 16 there: XLA:CPU aborts when too many collective steps are queued). Strategies
        on the same platform share one queue.
      donation: `"auto"` donates what `donate_argnums` names except where donating is
        measured to be slower (arguments holding leaves of 8 MiB or more, on several CPU
        host devices, where the step then holds its inputs and outputs at once);
        `"always"` donates exactly what `donate_argnums` names.
      devices_per_replica: k, how many devices each replica spans (an int >= 1 dividing the
        device count): replica i runs on `devices[i*k:(i+1)*k]`, partitioned by XLA.
      model_axis_name: the mesh axis inside a replica (k > 1).
      layout: how mirrored leaves are laid out inside a replica (k > 1): a callable
        `(path, leaf) -> PartitionSpec | None` or a sequence of `(regex, PartitionSpec)`
        pairs (`re.search` on `jax.tree_util.keystr(path)`, first match wins); a leaf's own
        sharding metadata naming only `model_axis_name` comes first; else replicated.

    Raises:
      ValueError: for bad devices, both `devices` and `num_devices`, an unknown backend or
        donation policy, a `devices_per_replica` that does not divide the devices (or
        `backend="pmap"` with it above 1), `max_in_flight < 1`, or above 16 on several CPU
        host devices.
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
        backend: str | None = None,
        max_in_flight: int | None = None,
        donation: str = "auto",
        devices_per_replica: int = 1,
        model_axis_name: str = "model",
        layout: LayoutRules = None,
        **unknown: object,
    ):
        if unknown:
            _refuse_options(type(self).__name__, unknown)
        resolved = resolve_devices(devices, num_devices)
        if backend is not None and backend not in _PUBLIC_BACKENDS:
            raise ValueError(
                f"MirroredStrategy(backend={backend!r}) is not a backend; expected one of "
                f"{_PUBLIC_BACKENDS}."
            )
        _check_axis_name(axis_name)
        _check_axis_name(model_axis_name, "model_axis_name", axis_name)
        topology = Topology.create(
            resolved,
            axis_name,
            devices_per_replica=devices_per_replica,
            model_axis_name=model_axis_name,
            layout=layout,
        )
        self._init(topology, choose(backend, topology), max_in_flight, donation)

    def _init(
        self, topology: Topology, backend: str, max_in_flight: int | None, donation: str
    ) -> None:
        """Initializes any strategy class, the one constructor path (subclasses resolve their own
        topology and backend, then call it)."""
        if backend not in BACKENDS:
            raise ValueError(f"{type(self).__name__}: unknown backend {backend!r}.")
        self._topology = topology
        self._backend = backend
        self._dispatch = Dispatch.create(topology, max_in_flight, donation, type(self).__name__)
        host_ops = ProcessHostOps if topology.process_count > 1 else HostOps
        self._host = host_ops(topology, self.run)
        self._run_cache: collections.OrderedDict = collections.OrderedDict()

    # --- properties ----------------------------------------------------------------------------

    @property
    def devices(self) -> tuple[Device, ...]:
        """The strategy's devices, in replica order."""
        return self._topology.devices

    @property
    def num_replicas(self) -> int:
        """The number of replicas (one per `devices_per_replica` devices)."""
        return self._topology.num_replicas

    @property
    def devices_per_replica(self) -> int:
        """How many devices each replica spans."""
        return self._topology.devices_per_replica

    @property
    def model_axis_name(self) -> str:
        """The mesh axis inside a replica (used when `devices_per_replica > 1`)."""
        return self._topology.model_axis_name

    def replica_devices(self, i: int) -> tuple[Device, ...]:
        """Returns the devices replica `i` runs on.

        Example:
            >>> import jmirror as jm
            >>> strategy = jm.MirroredStrategy()
            >>> strategy.replica_devices(0) == strategy.devices[:1]
            True
        """
        return self._topology.replica_devices(i)

    @property
    def axis_name(self) -> str:
        """The collective axis name of the replicas."""
        return self._topology.axis_name

    @property
    def mesh(self) -> Mesh:
        """The `jax.sharding.Mesh` over `devices`: 1-D named `axis_name`, or with
        `devices_per_replica > 1` 2-D `(axis_name, model_axis_name)` of shape (N, k)."""
        return self._topology.mesh

    @property
    def backend(self) -> str:
        """`"pmap"` or `"shard_map"`."""
        return self._backend

    @property
    def max_in_flight(self) -> int:
        """How many replicated steps may be queued before the next call waits."""
        return self._dispatch.max_in_flight

    @property
    def donation(self) -> str:
        """The donation policy: `"auto"` or `"always"`."""
        return self._dispatch.donation

    @property
    def topology(self) -> Topology:
        """The devices, mesh and value layouts of the replicas (`jmirror._topology`)."""
        return self._topology

    @property
    def dispatch(self) -> Dispatch:
        """The bound on steps in flight and the donation policy (`jmirror._dispatch`)."""
        return self._dispatch

    def __repr__(self) -> str:
        devices = ", ".join(f"{d.platform}:{d.id}" for d in self.devices)
        return (
            f"{type(self).__name__}(num_replicas={self.num_replicas}, devices=[{devices}], "
            f"axis_name={self.axis_name!r}, backend={self._backend!r}, "
            f"max_in_flight={self.max_in_flight}{self._topology.describe_spanning()})"
        )

    def __getattr__(self, name: str) -> Any:
        # Only for names the class lacks: tf.distribute's names point to jmirror's.
        ours = TF_STRATEGY_NAMES.get(name)
        hint = f"; tf.distribute's {name} is jmirror's strategy.{ours}" if ours else ""
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}{hint}")

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
            with self._topology.mesh_scope():  # k > 1: the current mesh too
                yield self
        finally:
            _context.pop_strategy()

    # --- cross-replica operations --------------------------------------------------------------

    def _cross_replica(self, call: str) -> CrossReplica:
        """Returns the cross-replica operations where `call` runs: the host, or inside merge_fn."""
        if _context.in_replica_context():
            name = call.split("(")[0]
            raise RuntimeError(_CROSS_REPLICA_IN_REPLICA.format(call=call, name=name))
        context = _context.merge_context()
        return self._host if context is None else MergeOps(context)

    def create_state(
        self,
        tree: PyTree,
        *,
        synchronization: Synchronization | str = "auto",
        aggregation: Aggregation | str = "none",
    ) -> PyTree:
        """Creates distributed state: mirrored (`AUTO`, `ON_WRITE`) or sync-on-read (`ON_READ`).

        Args:
          tree: the initial value, a pytree of array-likes; an `eqx.Module` in it has its
            array leaves made distributed and its other leaves (functions, flags) kept.
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

        Leaves that are already mirrored are returned without a copy, and `SyncOnRead` nodes
        are passed through (so a train state holding sync-on-read statistics mirrors in one
        call). One copy lives on each device; there are never N stacked copies on one device.

        Example:
            >>> import numpy as np, jmirror as jm
            >>> strategy = jm.MirroredStrategy()
            >>> params = strategy.mirror({"w": np.ones(3)})
            >>> len(params["w"].sharding.device_set) == strategy.num_replicas
            True
        """
        explain_deleted("strategy.mirror", {"tree": tree})
        _refuse_abstract("strategy.mirror", tree)
        return self._cross_replica("mirror(tree)").mirror(tree)

    def sync_on_read(self, tree: PyTree, aggregation: Aggregation | str = "sum") -> SyncOnRead:
        """Returns a `SyncOnRead` whose every replica starts with `tree`.

        The array leaves of an `eqx.Module` in `tree` become the components; its other
        leaves (functions, flags) are kept as they are, and `read` gives a module back.

        Example:
            >>> import jmirror as jm
            >>> strategy = jm.MirroredStrategy()
            >>> count = strategy.sync_on_read(1.0, "sum")
            >>> float(strategy.read(count)) == strategy.num_replicas
            True
        """
        aggregation = Aggregation(aggregation)
        # Python numbers get their dtype for good (as a TensorFlow variable does): a weakly
        # typed start would come back from the first step strongly typed, and the second
        # call would compile again.
        tree = map_traced_leaves(lambda leaves: list(map(_strongly_typed, leaves)), tree)
        return self._cross_replica("sync_on_read(tree)").sync_on_read(tree, aggregation)

    def assign(self, sync_on_read: SyncOnRead, value: PyTree) -> SyncOnRead:
        """Returns a new `SyncOnRead` holding `value`: reading it gives `value`.

        For `SUM` each replica gets `value / N` cast to the dtype; for integers each gets
        `value // N` and the first `value % N` replicas one more, so the sum is exact.
        Otherwise each replica gets `value`.

        Example:
            >>> import jmirror as jm
            >>> strategy = jm.MirroredStrategy()
            >>> total = strategy.assign(strategy.sync_on_read(0.0, "sum"), 6.0)
            >>> float(strategy.read(total))
            6.0
            >>> count = strategy.assign(strategy.sync_on_read(0, "sum"), 10)
            >>> int(strategy.read(count))
            10
        """
        return self._cross_replica("assign(sync_on_read, value)").assign(sync_on_read, value)

    def distribute_values_from_function(self, value_fn: Callable[[ValueContext], PyTree]):
        """Returns a `PerReplica` whose component i is `value_fn(ValueContext(i, N))`.

        Component i is placed on device i. Each replica's value has the same structure; for
        an `eqx.Module` the array leaves are stacked and every other leaf (a function, a
        flag), static, is the same on every replica and kept as it is.

        Raises:
          ValueError: for components of different structure or leaf shapes, or static
            leaves that differ between replicas.

        Example:
            >>> import numpy as np, jmirror as jm
            >>> strategy = jm.MirroredStrategy()
            >>> ids = strategy.distribute_values_from_function(
            ...     lambda ctx: np.float32(ctx.replica_id))
            >>> [float(v) for v in strategy.local_results(ids)] == list(
            ...     range(strategy.num_replicas))
            True
        """
        ops = self._cross_replica("distribute_values_from_function(value_fn)")
        return ops.distribute_values_from_function(value_fn)

    def split_key(self, key: jax.Array) -> PerReplica:
        """Splits a PRNG key into a `PerReplica` of N independent keys (per-replica noise).

        Example:
            >>> import jax, jmirror as jm
            >>> strategy = jm.MirroredStrategy()
            >>> keys = strategy.split_key(jax.random.key(0))
            >>> keys.values.shape == (strategy.num_replicas,)
            True
        """
        cross_replica = self._cross_replica("split_key(key)")
        _check_key(key)
        return cross_replica.split_key(key)

    def read(self, tree: PyTree) -> PyTree:
        """Returns the value of mirrored and sync-on-read state, in cross-replica context.

        Mirrored leaves give their value as a `jax.Array` on `devices[0]` (one copy, no
        gather; with `devices_per_replica > 1`, on `replica_devices(0)`, laid out as the leaf
        is inside a replica); `SyncOnRead` nodes are aggregated (`SUM`, `MEAN`,
        `ONLY_FIRST_REPLICA`); other non-distributed leaves are returned unchanged.

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
        ops = self._cross_replica("read(tree)")
        explain_deleted("strategy.read", {"tree": tree})
        if _nnx.holds_metrics(tree):
            tree = _nnx_metrics.read_metrics(ops.stacked, tree)
        return ops.read(tree)

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
        ops = self._cross_replica("local_results(value)")
        explain_deleted("strategy.local_results", {"value": value})
        ops.refuse_nested("strategy.local_results", value)
        return ops.local_results(value)

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
        ops = self._cross_replica("reduce(op, value)")
        explain_deleted("strategy.reduce", {"value": value})
        return ops.reduce(op, value, axis)

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
        ops = self._cross_replica("gather(value)")
        explain_deleted("strategy.gather", {"value": value})
        return ops.gather(value, check_gather_axis(value, axis))

    def update(
        self, tree: PyTree, fn: Callable[..., Any], *args: PyTree, **kwargs: PyTree
    ) -> PyTree:
        """Applies `fn(tree, *args, **kwargs)` to every replica's copy of the mirrored `tree`.

        `PerReplica` arguments are split; the result is typed like a replicated function's.

        Example:
            >>> import jmirror as jm
            >>> strategy = jm.MirroredStrategy()
            >>> w = strategy.update(strategy.mirror(1.0), lambda w, d: w + d, 2.0)
            >>> float(strategy.read(w))
            3.0
        """
        return self._cross_replica("update(tree, fn)").update(tree, fn, args, kwargs)

    # --- running -------------------------------------------------------------------------------

    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict | None = None,
        *,
        per_replica: PyTree = None,
    ):
        """Runs `fn(*args, **kwargs)` once per replica, at once (see `jm.replicate`).

        The compiled step is cached per `fn` (and `per_replica`), so calling `run` again with
        the same function and input shapes does not recompile. `per_replica` declares state
        kept per replica on purpose, as for `jm.replicate`.

        Example:
            >>> import jmirror as jm
            >>> strategy = jm.MirroredStrategy()
            >>> ids = strategy.run(jm.replica_id)
            >>> strategy.gather(ids).tolist() == list(range(strategy.num_replicas))
            True
        """
        if _context.merge_context() is not None:
            raise RuntimeError(
                "strategy.run was called inside a merge_call's merge_fn; replicated functions "
                "do not nest. Compute in merge_fn directly, or return to the replica function."
            )
        _check_run_arguments(args, kwargs)
        key = fn if per_replica is None else (fn, per_replica)
        replicated = self._run_cache.get(key)
        if replicated is None:
            replicated = replicate(fn, strategy=self, per_replica=per_replica)
            self._run_cache[key] = replicated
            if len(self._run_cache) > _RUN_CACHE_SIZE:
                self._run_cache.popitem(last=False)
        else:
            self._run_cache.move_to_end(key)
        return replicated(*args, **(kwargs or {}))

    def step_stats(self, reset: bool = False) -> StepStats:
        """Returns where the time went since the last reset: a `jm.StepStats`.

        Each replicated function run on this strategy and each dataset it distributed has a
        row: its calls (or batches), the caller's time inside jmirror, the waits for room
        behind earlier steps (the devices are the bottleneck) and the waits for a batch (the
        input is). The verdict names the largest part; `print(stats)` shows a table and the
        fix. Compiling is left out. With several processes each process reports its own.

        Args:
          reset: also start counting again from zero.

        Example:
            >>> import jax.numpy as jnp, jmirror as jm
            >>> strategy = jm.MirroredStrategy()
            >>> step = jm.replicate(lambda w: w + 1.0, strategy=strategy)
            >>> w = strategy.mirror(jnp.zeros(()))
            >>> for _ in range(3):
            ...     w = step(w)
            >>> strategy.step_stats(reset=True).rows[0]["calls"]
            3
            >>> strategy.step_stats().rows
            []
        """
        if not isinstance(reset, bool | np.bool_):
            raise TypeError(f"strategy.step_stats(reset=...) expects True or False; got {reset!r}.")
        several = self._topology.process_count > 1
        return self._dispatch.stats.stats(
            bool(reset), self._topology.process_index if several else None
        )

    # --- input ---------------------------------------------------------------------------------

    def distribute_dataset(
        self,
        dataset: object,
        *,
        remainder: str = "pad",
        prefetch: int = 2,
        start: Mapping[str, Any] | None = None,
        process_local: bool = False,
    ) -> DistributedDataset:
        """Splits each global batch of `dataset` into per-replica shards on the devices.

        A background thread keeps `prefetch` batches on the devices ahead of the consumer.
        With `remainder="pad"` every element is a `(batch, mask)` pair and incomplete batches
        are padded (shapes never change); `"drop"` skips them; `"error"` raises.
        `start=iterator.position` resumes where an iterator stood: a source iterator with
        `get_state()`/`set_state()` (grain's) is given its saved state, any other one skips
        the batches received without placing them. With several processes and
        `process_local=True` each process's source yields only its share of each global batch
        (G/P rows, in process order). See `jmirror._input.distribute_dataset`.

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
        return distribute_dataset(
            self._topology,
            dataset,
            remainder=remainder,
            prefetch=prefetch,
            start=start,
            process_local=process_local,
            stats=self._dispatch.stats,
        )

    def distribute_datasets_from_function(
        self,
        dataset_fn: Callable[..., Any],
        *,
        prefetch: int = 2,
        start: Mapping[str, Any] | None = None,
    ) -> DistributedDataset:
        """Deals the per-replica batches of `dataset_fn(jm.InputContext(...))` to replicas.

        N consecutive elements form one step, element i going to replica i; a final group of
        fewer than N is dropped with a warning. Iterators have `.position` (steps, and the
        pipeline's own state when it has one); `start=iterator.position` resumes there. See
        `jmirror._input.distribute_datasets_from_function`.

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
        return distribute_datasets_from_function(
            self._topology,
            dataset_fn,
            prefetch=prefetch,
            start=start,
            stats=self._dispatch.stats,
        )


def _refuse_abstract(call: str, tree: PyTree) -> None:
    """Raises a `TypeError` naming the first `jax.ShapeDtypeStruct` in `tree` (no value to
    place)."""
    if not any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree)):
        return  # the common case: no paths worked out
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(leaf, jax.ShapeDtypeStruct):
            raise TypeError(
                f"{call} got a jax.ShapeDtypeStruct at {jax.tree_util.keystr(path) or '<root>'}: "
                "there is no value to place. Pass arrays (jnp.zeros(shape, dtype), or state "
                "restored with jmirror.checkpoint, which takes abstract targets)."
            )


def _check_axis_name(axis_name: object, argument: str = "axis_name", other: object = None) -> None:
    if not isinstance(axis_name, str) or not axis_name:
        raise TypeError(
            f"MirroredStrategy({argument}=...) expects a non-empty str, got {axis_name!r}."
        )
    if axis_name == other:
        raise ValueError(
            f"MirroredStrategy({argument}={axis_name!r}) names the replica axis too; the "
            "mesh axis inside a replica needs a name of its own."
        )


def get_strategy() -> MirroredStrategy:
    """Returns the current strategy, else a default one over all local devices.

    Inside a replica function (or a `merge_fn`) the current strategy is the one running it,
    as in tf.distribute; elsewhere it is the innermost `strategy.scope()`. The default
    `MirroredStrategy()` is created once, on first use.

    Example:
        >>> import jmirror as jm
        >>> jm.get_strategy() is jm.get_strategy()
        True
    """
    # What runs a replica function, `scope` and the default factory give: strategies.
    return cast(MirroredStrategy, _context.current_strategy())


_context.set_default_factory(MirroredStrategy)


def _strongly_typed(x: Any) -> Any:
    """Returns a Python number as a NumPy array of the dtype JAX gives it; `x` otherwise."""
    if type(x) in PYTHON_NUMBERS:
        return np.asarray(x, dtype=jax.dtypes.canonicalize_dtype(jnp.result_type(x)))
    return x


def _check_key(key: object) -> None:
    """Refuses what is not a PRNG key: a typed key, or a raw uint32 one."""
    typed = isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    raw = isinstance(key, jax.Array | np.ndarray) and key.dtype == np.uint32 and key.ndim == 1
    if typed or raw:
        return
    found = f"{type(key).__name__} {key!r}"[:80]
    if isinstance(key, jax.Array | np.ndarray):
        found = f"an array of shape {key.shape} and dtype {key.dtype}"
    raise TypeError(
        f"strategy.split_key(key) expects a PRNG key (jax.random.key(seed), or the raw uint32 "
        f"key of jax.random.PRNGKey(seed)); got {found}. Make one from a seed: "
        "strategy.split_key(jax.random.key(seed))."
    )


def _check_run_arguments(args: object, kwargs: object) -> None:
    """Refuses `strategy.run` arguments that are not a tuple or list, keywords not a mapping."""
    if not isinstance(args, tuple | list):
        raise TypeError(
            f"strategy.run(fn, args=...) expects a tuple or list of fn's arguments; got an "
            f"object of type {type(args).__name__}. For one argument pass args=(x,)."
        )
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(
            f"strategy.run(fn, kwargs=...) expects a dict of fn's keyword arguments; got an "
            f"object of type {type(kwargs).__name__}. Pass kwargs={{'name': value}}, or "
            "positional arguments as args=(...)."
        )


# tf.distribute.MirroredStrategy's arguments that jmirror has no counterpart of.
_TF_OPTIONS = {
    "cross_device_ops": "jmirror reduces with XLA's collectives (jm.all_reduce), so there is "
    "no cross-device ops object to choose; drop the argument",
}


def _refuse_options(name: str, unknown: dict[str, object]) -> None:
    option = next(iter(unknown))
    hint = _TF_OPTIONS.get(option)
    raise TypeError(
        f"{name}() got an unexpected keyword argument {option!r}{f'; {hint}' if hint else ''}."
        " It takes devices, num_devices, axis_name, backend, max_in_flight, donation, "
        "devices_per_replica, model_axis_name and layout."
    )
