"""`Topology`: which devices, which mesh, which process, and how values are laid out.

A strategy holds one `Topology`, made once from its devices, and every part of jmirror that
places, reads or runs values asks it rather than the strategy: the replicas' devices in replica
order, the 1-D mesh over them, the two layouts of distributed values (mirrored: one full copy
per device; stacked: slice i of a leading replica axis on device i), and which of those devices
this process can address.

An emulated topology (`Topology.emulated`, for `jmirror.testing.EmulatedStrategy`) puts every
replica on one device: both layouts are then that device, and per-replica values are stacked
arrays on it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, Sharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from jmirror._devices import Device


@dataclasses.dataclass(frozen=True, eq=False)
class Topology:
    """The devices of a strategy's replicas and the layouts of values on them.

    Make one with `Topology.create(devices, axis_name)` (one replica per device, in the given
    order) or `Topology.emulated(device, num_replicas, axis_name)`.

    Attributes:
      devices: one device per replica, in replica order (every process's devices).
      axis_name: the collective axis name of the replicas.
      mesh: a 1-D mesh over `devices` named `axis_name`.
      mirrored: the layout of mirrored values (fully replicated over `devices`).
      stacked: the layout of per-replica values (leading axis split over `devices`).
      local_devices: the devices of `devices` this process can address, in replica order.
      process_index: this process's index; `process_count`: how many processes there are.
      is_emulated: whether every replica runs on one device.
      device_set: the devices as a set.
      timeout_s: the bound on a wait for other processes (`jmirror._deadline`), or None.
    """

    devices: tuple[Device, ...]
    axis_name: str
    mesh: Mesh
    mirrored: Sharding
    stacked: Sharding
    local_devices: tuple[Device, ...]
    process_index: int
    process_count: int
    is_emulated: bool
    device_set: frozenset[Device]  # the devices as a set, for layout checks on every read
    timeout_s: float | None = None

    @classmethod
    def create(
        cls, devices: Sequence[Device], axis_name: str, timeout_s: float | None = None
    ) -> Topology:
        """One replica per device of `devices` (distinct, one platform), in that order."""
        devices = tuple(devices)
        mesh = Mesh(np.array(devices), (axis_name,))
        me = jax.process_index()
        return cls(
            devices=devices,
            axis_name=axis_name,
            mesh=mesh,
            mirrored=NamedSharding(mesh, P()),
            stacked=NamedSharding(mesh, P(axis_name)),
            local_devices=tuple(d for d in devices if d.process_index == me),
            process_index=me,
            process_count=len({d.process_index for d in devices}),
            is_emulated=False,
            device_set=frozenset(devices),
            timeout_s=timeout_s,
        )

    @classmethod
    def emulated(cls, device: Device, num_replicas: int, axis_name: str) -> Topology:
        """`num_replicas` replicas, all on `device` (replicas run through `jax.vmap`)."""
        sharding = SingleDeviceSharding(device)
        return cls(
            devices=(device,) * num_replicas,
            axis_name=axis_name,
            mesh=Mesh(np.array([device]), (axis_name,)),
            mirrored=sharding,
            stacked=sharding,
            local_devices=(device,) * num_replicas,
            process_index=jax.process_index(),
            process_count=1,
            is_emulated=True,
            device_set=frozenset((device,)),
        )

    @property
    def num_replicas(self) -> int:
        """How many replicas (one per entry of `devices`)."""
        return len(self.devices)

    @property
    def num_local_replicas(self) -> int:
        """How many replicas run on this process's devices."""
        return len(self.local_devices)

    @property
    def first_local_device(self) -> Device:
        """The first of this process's devices: where a value read on this process lives."""
        return self.local_devices[0]

    @property
    def local_replica_ids(self) -> tuple[int, ...]:
        """The replica index of each of `local_devices`."""
        if self.is_emulated:
            return tuple(range(self.num_replicas))
        index = {d: i for i, d in enumerate(self.devices)}
        return tuple(index[d] for d in self.local_devices)

    @property
    def platform(self) -> str:
        """The platform of the devices (`"cpu"`, `"gpu"`, `"tpu"`)."""
        return self.devices[0].platform

    @property
    def num_devices(self) -> int:
        """How many distinct devices the replicas run on (1 when emulated)."""
        return 1 if self.is_emulated else len(self.devices)

    def is_mirrored(self, x: jax.Array) -> bool:
        """Whether `x` is laid out as a mirrored value of this topology."""
        sharding = x.sharding
        if sharding == self.mirrored:
            return True
        return sharding.is_fully_replicated and sharding.device_set == self.device_set

    def is_pmap_layout(self, x: jax.Array) -> bool:
        """Whether `x` is laid out the `jax.pmap` way over these devices: a leading axis of
        `num_replicas` whose slices lie one per device (what `flax.jax_utils.replicate` and
        `prefetch_to_device` return), rather than mirrored."""
        n = self.num_replicas
        if self.is_emulated or n == 1 or not x.ndim or x.shape[0] != n:
            return False
        sharding = x.sharding
        return (
            not sharding.is_fully_replicated
            and sharding.device_set == self.device_set
            and sharding.shard_shape(x.shape)[0] == 1
        )

    def is_placed(self, x: jax.Array) -> bool:
        """Whether `x` lives on exactly this topology's devices."""
        return x.sharding.device_set == self.device_set

    def __repr__(self) -> str:
        devices = ", ".join(f"{d.platform}:{d.id}" for d in self.devices)
        return f"Topology(devices=[{devices}], axis_name={self.axis_name!r})"
