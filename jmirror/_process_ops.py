"""The cross-replica operations on the host of one of several processes.

With several processes (`jm.MultiWorkerMirroredStrategy`) every distributed value is one
global `jax.Array` over the devices of every process, of which this process addresses its own
shards. Every process runs the same program and calls the same methods in the same order, so:

- `mirror` gives every process process 0's value (as TensorFlow broadcasts from worker 0);
- reading a mirrored value takes this process's own copy, with no communication;
- reading a `SyncOnRead`, `reduce` and `gather` compute one value with a compiled function over
  the global arrays (so every process gets the same value) and return this process's copy,
  on its first local device;
- `local_results`, `distribute_values_from_function` and a `PerReplica` built by the user are
  about this process's replicas (leading axis `num_local_replicas`); a user's `PerReplica` or
  `SyncOnRead` given to `reduce`, `gather` or `read` is made global first, as a replicated
  call makes it, so that those compute over every replica on every process.

With `timeout_s` (the topology's), each of these cross-process calls is bounded by
`jmirror._deadline`: `mirror`'s broadcast and a read's dispatch are waited for here (a cheap
program runs inline on XLA:CPU), a read's result is watched until it is ready.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from jmirror import _deadline
from jmirror._adapter import map_traced, static_leaves
from jmirror._components import local_copy, replica_component
from jmirror._host_ops import HostOps, concatenate, pieces_span, reducer, unshard
from jmirror._topology import Topology
from jmirror._values import (
    Aggregation,
    PerReplica,
    PyTree,
    ReduceOp,
    Sharded,
    SyncOnRead,
    is_distributed,
)


class ProcessHostOps(HostOps):
    """`HostOps` for one process of several: global arrays, this process's shards."""

    # --- placing -------------------------------------------------------------------------------

    def _place_mirrored(self, sources: list[Any], layouts: list[Any]) -> list[jax.Array]:
        # A random key has no host value: its key data travels, and is wrapped again.
        impls = [_key_impl(x) for x in sources]
        host = [
            np.asarray(x if impl is None else jax.random.key_data(x))
            for x, impl in zip(sources, impls)
        ]
        with _deadline.bounded("strategy.mirror", self.topology.timeout_s):
            host = multihost_utils.broadcast_one_to_all(host)  # process 0's value, everywhere
        # Each device takes its piece of the value (the whole of it, unless laid out, k > 1).
        placed = [
            jax.make_array_from_callback(x.shape, layout, lambda index, x=x: x[index])
            for x, layout in zip(host, layouts)
        ]
        return [
            x if impl is None else jax.random.wrap_key_data(x, impl=impl)
            for x, impl in zip(placed, impls)
        ]

    def sync_on_read_from(self, component: Callable[[jax.Array], PyTree], aggregation):
        n = self.num_replicas
        stacked = jax.jit(jax.vmap(component), out_shardings=self.topology.stacked)(jnp.arange(n))
        return SyncOnRead(stacked, aggregation)

    def _value_replica_ids(self) -> list[int]:
        return list(self.topology.local_replica_ids)

    def _place_components(self, parts: list[Any]) -> jax.Array:
        return self.place_local(np.stack([np.asarray(p) for p in parts]))

    def place_local(self, local: np.ndarray) -> jax.Array:
        """Returns a global stacked array from this process's components (leading axis: local
        ones)."""
        shape = (self.num_replicas,) + tuple(local.shape[1:])
        return jax.make_array_from_process_local_data(self.topology.stacked, local, shape)

    def split_key(self, key: jax.Array) -> PerReplica:
        n, stacked = self.num_replicas, self.topology.stacked
        return PerReplica(jax.jit(lambda k: jax.random.split(k, n), out_shardings=stacked)(key))

    # --- reading -------------------------------------------------------------------------------

    def read(self, tree: PyTree) -> PyTree:
        self.check_readable(tree)

        def one(x: PyTree) -> PyTree:
            if isinstance(x, Sharded):
                k = pieces_span(self.topology)
                return self._everywhere(unshard(x.shape, k), x.shards, _READ_SHARDED)
            if isinstance(x, SyncOnRead):
                if x.aggregation is Aggregation.ONLY_FIRST_REPLICA:
                    return map_traced(lambda v: self._everywhere(_first, v, _READ), x.value)
                op = ReduceOp.SUM if x.aggregation is Aggregation.SUM else ReduceOp.MEAN
                fn = reducer(op, None)
                return map_traced(lambda v: self._everywhere(fn, v, _READ), x.value)
            if isinstance(x, jax.Array) and self.topology.is_mirrored(x):
                return self._on_first_device(x)
            return x

        return jax.tree.map(one, tree, is_leaf=is_distributed)

    def _everywhere(
        self, fn: Callable[[jax.Array], jax.Array], x: jax.Array, call: str
    ) -> jax.Array:
        """Returns `fn(x)` computed over the global array, as this process's copy (watched as
        `call`).

        The program is waited for before this returns: reads left in flight side by side (a
        dozen independent ones, or the two of one `metric.compute(strategy)`) can leave gloo's
        collectives of 2 x 4 processes waiting on each other for ever.
        """
        if not (isinstance(x, jax.Array) and self.topology.is_placed(x)):
            # Built by the user: this process's components, made one global value first (as a
            # replicated call takes them), so every process computes over every replica.
            x = globalize(self.topology, PerReplica(x)).values
        timeout = self.topology.timeout_s
        with _deadline.bounded(call, timeout):  # a cheap program may run (and wait) inline
            out = _jit_mirrored(fn, self.topology.mirrored)(x)
            mine = jax.block_until_ready(local_copy(self.topology, out))
        return mine

    def stacked(self, x: PyTree) -> PyTree:
        """Returns every process's components, gathered onto this process's first device."""
        return self._everywhere(_whole, x, _READ)

    def _on_first_device(self, x: jax.Array) -> jax.Array:
        """Returns this process's first replica's copy (on its device, or laid out on its
        devices)."""
        return self._on_replica(x, self.topology.local_replica_ids[0])

    def _components(self, x: PyTree) -> list[Any] | None:
        if isinstance(x, (PerReplica, SyncOnRead)):
            stacked = x.values if isinstance(x, PerReplica) else x.value
            return [
                map_traced(lambda v, i=i: self._local_component(v, i), stacked)
                for i in range(self.topology.num_local_replicas)
            ]
        if isinstance(x, jax.Array) and self.topology.is_mirrored(x):
            return [self._on_replica(x, i) for i in self.topology.local_replica_ids]
        return None

    def _local_component(self, stacked: PyTree, i: int) -> PyTree:
        """Returns this process's `i`-th replica's whole component of a stacked leaf (laid out over
        that replica's devices when k > 1)."""
        if isinstance(stacked, jax.Array) and not stacked.is_fully_addressable:
            replica = self.topology.local_replica_ids[i]
            component = replica_component(self.topology, stacked, replica)
            if component is not None:
                return component
            # Laid out some other way: every process gathers the whole stack (every process
            # takes this path for the same leaf, as the layout is the same everywhere).
            return self.stacked(stacked)[replica]
        return np.asarray(stacked)[i]  # a PerReplica of this process's components

    def reduce_per_replica(self, op: ReduceOp, x: PerReplica, axis: int | None) -> PyTree:
        fn = reducer(op, axis)
        return map_traced(lambda v: self._everywhere(fn, v, "strategy.reduce"), x.values)

    def _gather_stacked(self, stacked: jax.Array, axis: int) -> jax.Array:
        return self._everywhere(concatenate(axis), stacked, "strategy.gather")


_READ = "strategy.read of a SyncOnRead"
_READ_SHARDED = "strategy.read of a jm.Sharded state"


def globalize(topology: Topology, tree: PyTree) -> PyTree:
    """Returns `tree` with each `PerReplica` / `SyncOnRead` of this process's components made
    global.

    Leaves that are already global arrays on the topology's devices are kept. Others must hold
    this process's components: a leading axis of `num_local_replicas`.
    """
    local = topology.num_local_replicas

    def node(path: tuple, x: PyTree) -> PyTree:
        if not is_distributed(x):
            return x

        def leaf(inner: tuple, v: PyTree) -> PyTree:
            if isinstance(v, jax.Array) and topology.is_placed(v):
                return v
            if not hasattr(v, "shape"):
                v = np.asarray(v)
            if v.shape[:1] != (local,):
                where = jax.tree_util.keystr(path) + jax.tree_util.keystr(inner)
                raise ValueError(
                    f"A PerReplica built on process {topology.process_index} has a leaf at "
                    f"{where or '<root>'} of shape {tuple(v.shape)}, but with several processes "
                    f"a PerReplica holds this process's components: a leading axis of "
                    f"num_local_replicas={local} (of {topology.num_replicas} replicas in all). "
                    "Build it from this process's share of the batch, or use "
                    "strategy.distribute_dataset, which splits global batches for you."
                )
            shape = (topology.num_replicas,) + tuple(v.shape[1:])
            return _from_local(np.asarray(v), topology.stacked, shape)

        flat, inner = jax.tree_util.tree_flatten_with_path(x)
        static = static_leaves(x)  # an equinox module's functions: no components
        return inner.unflatten([v if s else leaf(p, v) for (p, v), s in zip(flat, static)])

    return jax.tree_util.tree_map_with_path(node, tree, is_leaf=is_distributed)


def _key_impl(x: object) -> Any:
    """Returns the PRNG implementation of a random key array, else None."""
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.key_impl(x)
    return None


def _from_local(
    local: np.ndarray, sharding: jax.sharding.Sharding, shape: tuple[int, ...]
) -> jax.Array:
    return jax.make_array_from_process_local_data(sharding, local, shape)


@functools.cache
def _jit_mirrored(
    fn: Callable[[jax.Array], jax.Array], sharding: jax.sharding.Sharding
) -> Callable:
    return jax.jit(fn, out_shardings=sharding)


def _whole(x: jax.Array) -> jax.Array:
    return x


def _first(x: jax.Array) -> jax.Array:
    return x[0]
