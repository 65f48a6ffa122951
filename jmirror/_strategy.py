"""`MirroredStrategy`: devices, running, updating and input, and the current strategy.

Placing values (`mirror`, `create_state`, ...) lives in `jmirror._placement` and reading them
(`read`, `reduce`, `gather`, ...) in `jmirror._reading`, as mixins of `MirroredStrategy`.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jmirror import _context, _dispatch
from jmirror._devices import Device, DeviceSpec, resolve_devices
from jmirror._placement import _Placement
from jmirror._reading import _Reading
from jmirror._replicate import replicate
from jmirror._values import PerReplica, PyTree

_BACKENDS = ("pmap", "shard_map")
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
        the oldest; `None` picks a safe default for the platform (2 on CPU host devices, at
        most 16 there: XLA:CPU aborts when too many collective steps are queued). Strategies
        on the same platform share one queue.
      donation: `"auto"` donates what `donate_argnums` names except where donating is
        measured to be slower (arguments holding leaves of 8 MiB or more, on several CPU
        host devices, where the step then holds its inputs and outputs at once);
        `"always"` donates exactly what `donate_argnums` names.

    Raises:
      ValueError: for bad devices, both `devices` and `num_devices`, an unknown backend or
        donation policy, `max_in_flight < 1`, or above 16 on several CPU host devices.
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
        donation: str = "auto",
    ):
        resolved = resolve_devices(devices, num_devices)
        if backend not in _BACKENDS:
            raise ValueError(
                f"MirroredStrategy(backend={backend!r}) is not a backend; expected one of "
                f"{_BACKENDS}."
            )
        self._setup(resolved, axis_name, backend, max_in_flight, donation)

    def _setup(
        self,
        devices: tuple[Device, ...],
        axis_name: str,
        backend: str,
        max_in_flight: int | None,
        donation: str = "auto",
    ) -> None:
        self._devices = devices
        first = devices[0]
        if not isinstance(axis_name, str) or not axis_name:
            raise TypeError(
                f"MirroredStrategy(axis_name=...) expects a non-empty str, got {axis_name!r}."
            )
        self._max_in_flight = _dispatch.check_max_in_flight(
            max_in_flight, first.platform, len(set(devices)), "MirroredStrategy"
        )
        self._donation = _dispatch.check_donation(donation, "MirroredStrategy")
        self._axis_name = axis_name
        self._backend = backend
        if len(set(devices)) == len(devices):
            self._mesh = Mesh(np.array(devices), (axis_name,))
            self._replicated = NamedSharding(self._mesh, P())
            self._stacked = NamedSharding(self._mesh, P(axis_name))
        else:  # every replica on one device (jmirror.testing.EmulatedStrategy)
            self._mesh = Mesh(np.array([first]), (axis_name,))
            self._replicated = self._stacked = jax.sharding.SingleDeviceSharding(first)
        self._device_set = frozenset(devices)
        self._in_flight = _dispatch.in_flight_for(first.platform)
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

    @property
    def donation(self) -> str:
        """The donation policy: `"auto"` or `"always"`."""
        return self._donation

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

    def _donates(self, donated: list[Any]) -> bool:
        """Whether a step donates these arguments under the strategy's donation policy."""
        first = self._devices[0]
        return _dispatch.donates(self._donation, first.platform, len(self._device_set), donated)

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

    def distribute_dataset(
        self, dataset: Any, *, remainder: str = "pad", prefetch: int = 2, start: Any = None
    ):
        """Splits each global batch of `dataset` into per-replica shards on the devices.

        See `jmirror._input.distribute_dataset` (SPEC section 7) for the full contract;
        `start=iterator.position` resumes where an iterator stood.

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

        return distribute_dataset(
            self, dataset, remainder=remainder, prefetch=prefetch, start=start
        )

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
