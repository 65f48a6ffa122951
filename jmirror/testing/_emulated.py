"""`EmulatedStrategy`: N replicas on one device, for tests and notebooks that cannot restart JAX."""

from __future__ import annotations

from jmirror._devices import DeviceSpec, as_int, resolve_devices
from jmirror._strategy import MirroredStrategy, _check_axis_name
from jmirror._topology import Topology


class EmulatedStrategy(MirroredStrategy):
    """A `MirroredStrategy` whose N replicas all run on one device through `jax.vmap`.

    The idea of chex's `fake_pmap`: the replica function runs as `jax.vmap` with the replica
    axis name, so collectives, `sync`, `merge_call`, the static proof and every cross-replica
    method behave as on N real devices and give the same results. Mirrored values are plain
    arrays on the device; per-replica values are stacked arrays on it. Use it where the host
    device count cannot be set any more (a notebook whose JAX already started).

    Args:
      num_replicas: how many replicas to emulate.
      device: the device to run on (a `jax.Device` or a spec such as `"cpu:1"`); `None` for
        `jax.local_devices()[0]`.
      axis_name: the collective axis name of the replicas.
      max_in_flight: as for `MirroredStrategy`.

    Example:
        >>> import jmirror as jm, jmirror.testing as jmt
        >>> strategy = jmt.EmulatedStrategy(4)
        >>> total = strategy.run(lambda: jm.all_reduce("sum", jm.replica_id()))
        >>> int(strategy.read(total)), strategy.num_replicas
        (6, 4)
    """

    def __init__(
        self,
        num_replicas: int,
        *,
        device: DeviceSpec | None = None,
        axis_name: str = "replica",
        max_in_flight: int | None = None,
    ):
        num_replicas = as_int(num_replicas, "EmulatedStrategy(num_replicas)")
        if num_replicas < 1:
            raise ValueError(f"EmulatedStrategy({num_replicas}) needs at least one replica.")
        (resolved,) = resolve_devices(
            None if device is None else [device], 1 if device is None else None
        )
        _check_axis_name(axis_name)
        topology = Topology.emulated(resolved, num_replicas, axis_name)
        self._init(topology, "vmap", max_in_flight, "auto")

    def __repr__(self) -> str:
        device = self.devices[0]
        return (
            f"EmulatedStrategy(num_replicas={self.num_replicas}, device={device.platform}:"
            f"{device.id}, axis_name={self.axis_name!r})"
        )
