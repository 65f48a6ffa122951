"""`MultiWorkerMirroredStrategy`: the replicas of every device of every process.

Several processes (started by `python -m jmirror.launch`, a cluster, or by hand, each having
called `jm.distributed.initialize`) run the same program; the strategy's replicas are every
device of every process, grouped by process. Values are global `jax.Array`s of which each
process holds its own shards; see `jmirror._process_ops` for what each method does across
processes. With one process it behaves exactly as `MirroredStrategy()`.
"""

from __future__ import annotations

import jax

from jmirror import _context, _deadline, distributed
from jmirror._backends import choose
from jmirror._devices import Device
from jmirror._strategy import _PUBLIC_BACKENDS, MirroredStrategy, _check_axis_name
from jmirror._topology import LayoutRules, Topology


class MultiWorkerMirroredStrategy(MirroredStrategy):
    """Synchronous data parallelism over the devices of several processes.

    Every process runs the same program and calls the same strategy methods in the same order.
    `read` of a mirrored value communicates nothing; `read` of a `SyncOnRead`, `reduce` and
    `gather` give the same value on every process, on this process's first local device;
    `local_results`, a `PerReplica` built by the user (leading axis `num_local_replicas`) and
    `distribute_values_from_function` are about this process's replicas. `mirror` gives every
    process process 0's value. `distribute_dataset` places this process's rows of each global
    batch. Both backends keep `jax.pmap` semantics; across processes both compile with
    `jax.shard_map` (JAX cannot run a `jax.pmap` nested in `jax.jit` across processes).

    Args:
      axis_name: the collective axis name of the replicas.
      backend: `"pmap"` or `"shard_map"`; `None` as for `MirroredStrategy`.
      max_in_flight: as for `MirroredStrategy`.
      donation: as for `MirroredStrategy`.
      devices_per_replica, model_axis_name, layout: as for `MirroredStrategy`; a replica's
        devices belong to one process, so `devices_per_replica` must divide each process's
        device count.
      timeout_s: the bound, in seconds, on every wait of this process for the others
        (TensorFlow's `CommunicationOptions(timeout_seconds=...)`): a replicated step, a read,
        reduce or gather, a checkpoint barrier or the input agreement that has not completed
        `timeout_s` seconds after it was waited on (a first call's compilation excluded) ends
        the process with an error on stderr naming the call and the processes that did not
        arrive, and exit status 1. None waits without a bound (and starts no thread). Raise
        it above the longest step and the longest checkpoint write. One process has nothing
        to wait for.

    Raises:
      RuntimeError: when this process was started as one of several (`python -m
        jmirror.launch`) but `jm.distributed.initialize()` was not called.
      TypeError: when `timeout_s` is not a number or None.
      ValueError: when `timeout_s` is not positive and finite.

    Example:
        >>> import jmirror as jm
        >>> strategy = jm.MultiWorkerMirroredStrategy()  # one process: every local device
        >>> strategy.num_processes, strategy.num_local_replicas == strategy.num_replicas
        (1, True)
        >>> strategy.timeout_s, jm.MultiWorkerMirroredStrategy(timeout_s=None).timeout_s
        (300.0, None)
    """

    def __init__(
        self,
        *,
        axis_name: str = "replica",
        backend: str | None = None,
        max_in_flight: int | None = None,
        donation: str = "auto",
        timeout_s: float | None = 300,
        devices_per_replica: int = 1,
        model_axis_name: str = "model",
        layout: LayoutRules = None,
    ):
        distributed.check_initialized("jm.MultiWorkerMirroredStrategy()")
        timeout = _deadline.check_timeout(timeout_s, "MultiWorkerMirroredStrategy")
        if backend is not None and backend not in _PUBLIC_BACKENDS:
            raise ValueError(
                f"MultiWorkerMirroredStrategy(backend={backend!r}) is not a backend; expected "
                f"one of {_PUBLIC_BACKENDS}."
            )
        _check_axis_name(axis_name)
        _check_axis_name(model_axis_name, "model_axis_name", axis_name)
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        topology = Topology.create(
            devices,
            axis_name,
            timeout,
            devices_per_replica=devices_per_replica,
            model_axis_name=model_axis_name,
            layout=layout,
            call="MultiWorkerMirroredStrategy",
        )
        self._init(
            topology,
            choose(backend, topology, "MultiWorkerMirroredStrategy"),
            max_in_flight,
            donation,
        )

    @property
    def num_processes(self) -> int:
        """Returns how many processes run the replicas."""
        return self.topology.process_count

    @property
    def process_index(self) -> int:
        """Returns this process's index, in `[0, num_processes)`."""
        return self.topology.process_index

    @property
    def local_devices(self) -> tuple[Device, ...]:
        """Returns this process's devices, in replica order."""
        return self.topology.local_devices

    @property
    def timeout_s(self) -> float | None:
        """Returns the bound on a wait for the other processes, in seconds (None: no bound)."""
        return self.topology.timeout_s

    @property
    def num_local_replicas(self) -> int:
        """Returns how many replicas run on this process's devices."""
        return self.topology.num_local_replicas


def _default_strategy() -> MirroredStrategy:
    """Returns `jm.get_strategy()`'s default: every device of every process."""
    if jax.process_count() > 1:  # bounded as `initialize` was asked to bound the run
        return MultiWorkerMirroredStrategy(timeout_s=distributed.timeout_s_of_initialize())
    return MirroredStrategy()


_context.set_default_factory(_default_strategy)
