"""Takes a replica's whole value out of a distributed array, from its own shards.

A mirrored leaf laid out inside the replicas (k > 1) is whole only over a replica's k
devices, and a per-replica stack's component i only over replica i's: `replica_copy`,
`local_copy` and `replica_component` put those shards together without a transfer, laid out
over the replica's devices, wherever jmirror takes a replica's value (`HostOps`, the reads
across processes, checkpoints).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, Sharding
from jax.sharding import PartitionSpec as P

from jmirror import _shim
from jmirror._topology import Topology, names_axis


def replica_copy(topology: Topology, x: jax.Array, replica: int) -> jax.Array | None:
    """Returns replica `replica`'s whole copy of the mirrored leaf `x`, made of its own shards
    (no transfer) and laid out as `read_sharding` says; None where this process does not hold
    them."""
    devices = topology.replica_devices(replica)
    by_device = {shard.device: shard for shard in x.addressable_shards}
    if not all(d in by_device for d in devices):
        return None
    if len(devices) == 1:
        data = by_device[devices[0]].data
        return data if data.shape == x.shape else None
    sharding = topology.read_sharding(x, replica)
    # `x` may have been laid out by another strategy over these devices in another order:
    # each device keeps its part, and the devices are ordered by the part each holds.
    held = {d: _normal(by_device[d].index, x.shape) for d in devices}
    if isinstance(sharding, NamedSharding):
        expected = sharding.devices_indices_map(x.shape)
        wanted = [_normal(expected[d], x.shape) for d in devices]
        if [held[d] for d in devices] != wanted:
            order = _order_by_part(devices, held, wanted)
            if order is None:
                return None
            sharding = NamedSharding(Mesh(np.array(order), sharding.mesh.axis_names), sharding.spec)
            devices = order
    parts = [by_device[d].data for d in devices]
    copy = jax.make_array_from_single_device_arrays(x.shape, sharding, parts)
    # Assembled from its shards, strongly typed: typed again as the value was.
    return _shim.weakly_typed(copy) if jax.typeof(x).weak_type else copy


def _order_by_part(devices: Sequence[Any], held: dict, wanted: list) -> list | None:
    """Returns `devices` ordered so that the i-th holds the part `wanted[i]` (by `held`), or
    None when they do not hold those parts."""
    pool, order = list(devices), []
    for part in wanted:
        match = next((d for d in pool if held[d] == part), None)
        if match is None:
            return None
        pool.remove(match)
        order.append(match)
    return order


def replica_component(topology: Topology, x: jax.Array, replica: int) -> jax.Array | None:
    """Returns replica `replica`'s whole component of the per-replica stack `x` (leading axis
    split over the replicas), made of its own shards (no transfer): on its device (k = 1),
    or laid out over its devices as `x` is inside a replica (k > 1). None where this
    process does not hold them, or `x` is not split one component per replica."""
    if topology.is_emulated:
        return None
    devices = topology.replica_devices(replica)
    by_device = {shard.device: shard for shard in x.addressable_shards}
    if not all(d in by_device for d in devices):
        return None
    shards = [by_device[d] for d in devices]
    if any(_rows(s.index, x.shape) != (replica, replica + 1) for s in shards):
        return None
    if len(devices) == 1:
        data = shards[0].data
        return _first_row(data) if data.shape[1:] == x.shape[1:] else None
    inner = _inner_spec(topology, x)
    if inner is None:
        return None
    mesh = Mesh(np.array(devices), (topology.model_axis_name,))
    one = NamedSharding(mesh, P(None, *inner))
    shape = (1, *x.shape[1:])
    expected = one.devices_indices_map(shape)
    for d, shard in zip(devices, shards):
        if _normal(expected[d], shape)[1:] != _normal(shard.index, x.shape)[1:]:
            return None
    stacked = jax.make_array_from_single_device_arrays(shape, one, [s.data for s in shards])
    return _first_row_as(NamedSharding(mesh, P(*inner)))(stacked)


def _inner_spec(topology: Topology, x: jax.Array) -> tuple | None:
    """Returns the spec of a component of the stack `x` inside a replica (the model axis only),
    or None when `x` is not laid out over this mesh's replica axis that way."""
    sharding = x.sharding
    if not isinstance(sharding, NamedSharding) or sharding.mesh.axis_names != (
        topology.axis_name,
        topology.model_axis_name,
    ):
        return None
    spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
    if spec[:1] != (topology.axis_name,) or names_axis(spec[1:], topology.axis_name):
        return None
    return spec[1:]


def local_copy(topology: Topology, x: jax.Array) -> jax.Array:
    """Returns this process's whole copy of the mirrored leaf `x`, without a transfer: the shard
    on its first device when `x` is replicated inside a replica, else its first replica's
    copy (`replica_copy`)."""
    copy = None
    if x.sharding.is_fully_replicated:
        # Whole on each of its devices: the first device's copy, or any (a value mirrored by
        # another strategy over other devices of this process).
        first = topology.first_local_device
        shards = x.addressable_shards
        copy = next(
            (s.data for s in shards if s.device == first), shards[0].data if shards else None
        )
    elif not topology.is_emulated:
        copy = replica_copy(topology, x, topology.local_replica_ids[0])
    if copy is None:
        raise ValueError(
            f"expected a mirrored value with a whole copy on process {topology.process_index}'s "
            f"devices; found one laid out by {x.sharding}, which this process does not hold "
            "whole. Mirror it first with strategy.mirror(value)."
        )
    return copy


def _normal(index: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """Returns a shard's index as (start, stop) per dimension."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _rows(index: tuple, shape: tuple[int, ...]) -> tuple[int, int] | None:
    """Returns the (start, stop) of a shard's rows of the leading axis, or None for a scalar."""
    return _normal(index, shape)[0] if shape else None


_first_row = jax.jit(lambda x: x[0])


@functools.cache
def _first_row_as(sharding: Sharding) -> Callable[[jax.Array], jax.Array]:
    """Returns a function giving `x[0]` of a one-row stack, laid out by `sharding` (no transfer:
    each device keeps its part)."""
    return jax.jit(lambda x: x[0], out_shardings=sharding)
