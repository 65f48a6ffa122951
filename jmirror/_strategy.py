"""`MirroredStrategy`: devices, running, updating and input, and the current strategy.

Placing values (`mirror`, `create_state`, ...) lives in `jmirror._placement` and reading them
(`read`, `reduce`, `gather`, ...) in `jmirror._reading`, as mixins of `MirroredStrategy`.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jmirror import _context
from jmirror._devices import Device, DeviceSpec, resolve_devices
from jmirror._placement import _Placement
from jmirror._reading import _Reading
from jmirror._replicate import replicate
from jmirror._values import PerReplica, PyTree

_BACKENDS = ("pmap", "shard_map")
# Steps in flight by platform: XLA:CPU host devices deadlock in their collective rendezvous
# when many programs are queued back to back; accelerators queue deeper safely.
_DEFAULT_IN_FLIGHT = {"cpu": 2}
_DEFAULT_IN_FLIGHT_ACCELERATOR = 16
# On several XLA:CPU devices, arguments holding a leaf this large are not donated.
_LARGE_DONATION = 8 * 2**20
_RUN_CACHE_SIZE = 64


class MirroredStrategy(_Placement, _Reading):
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
        devices: tuple[Device, ...],
        axis_name: str,
        backend: str,
        max_in_flight: int | None,
    ) -> None:
        self._devices = devices
        first = devices[0]
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
            max_in_flight = _DEFAULT_IN_FLIGHT.get(first.platform, _DEFAULT_IN_FLIGHT_ACCELERATOR)
        # Donating a large buffer to a step on several XLA:CPU host devices made the step much
        # slower (MLP hidden 2048, 16 MiB weights: 110 ms with donation, 58 ms without), while
        # small buffers gain from it (hidden 512: 4.2 ms against 4.7 ms); see
        # benchmarks/RESULTS.md. There jmirror skips donating arguments that hold a leaf of
        # `_LARGE_DONATION` bytes or more, and spends host memory instead.
        self._large_donation = (
            _LARGE_DONATION if first.platform == "cpu" and len(devices) > 1 else None
        )
        self._axis_name = axis_name
        self._backend = backend
        self._max_in_flight = max_in_flight
        if len(set(devices)) == len(devices):
            self._mesh = Mesh(np.array(devices), (axis_name,))
            self._replicated = NamedSharding(self._mesh, P())
            self._stacked = NamedSharding(self._mesh, P(axis_name))
        else:  # every replica on one device (jmirror.testing.EmulatedStrategy)
            self._mesh = Mesh(np.array([first]), (axis_name,))
            self._replicated = self._stacked = jax.sharding.SingleDeviceSharding(first)
        self._device_set = frozenset(devices)
        self._in_flight: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._run_cache: collections.OrderedDict = collections.OrderedDict()

    # --- properties ----------------------------------------------------------------------------

    @property
    def devices(self) -> tuple[Device, ...]:
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
        must_block = False  # set when a step's output was donated to a later step
        while True:
            with self._lock:
                if not self._in_flight or (
                    len(self._in_flight) < self._max_in_flight and not must_block
                ):
                    return
                oldest = self._in_flight.popleft()
            if oldest.is_deleted():
                # Donated to a later (already queued) step: waiting for that step covers
                # this one.
                must_block = True
                continue
            oldest.block_until_ready()
            must_block = False

    def _donates(self, donated: list[Any]) -> bool:
        """Whether to donate these arguments to a step (False: some leaf is too large)."""
        if self._large_donation is None or not donated:
            return True
        limit = self._large_donation
        return all(getattr(x, "nbytes", 0) < limit for x in jax.tree.leaves(donated))

    def _track(self, output: jax.Array) -> None:
        """Records a dispatched step by one (small) output: all are ready when it is done."""
        with self._lock:
            self._in_flight.append(output)

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

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[..., Any], *, prefetch: int = 2
    ):
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

    # --- updating ------------------------------------------------------------------------------

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


def get_strategy() -> MirroredStrategy:
    """Returns the innermost current strategy, else a default one over all local devices.

    The default `MirroredStrategy()` is created once, on first use.

    Example:
        >>> import jmirror as jm
        >>> jm.get_strategy() is jm.get_strategy()
        True
    """
    return _context.current_strategy(MirroredStrategy)
