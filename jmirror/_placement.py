"""Placing values on the devices: mirrored and sync-on-read state, per-replica values, keys."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jmirror._devices import Device
from jmirror._values import (
    Aggregation,
    PerReplica,
    PyTree,
    Synchronization,
    SyncOnRead,
    ValueContext,
    is_distributed,
)

if TYPE_CHECKING:
    from jmirror import _context


class _Placement:
    """Methods of `MirroredStrategy` that place values on its devices.

    Mirrors trees (one copy per device), creates sync-on-read state and assigns to it, builds
    `PerReplica` values from a function or a PRNG key. A mixin: it relies on the attributes
    set by `MirroredStrategy._setup` (`_devices`, `_replicated`, `_stacked`) and on its
    `num_replicas`, `_merge` and `_is_mirrored`.
    """

    if TYPE_CHECKING:  # provided by MirroredStrategy
        _devices: tuple[Device, ...]
        _replicated: jax.sharding.Sharding
        _stacked: jax.sharding.Sharding

        @property
        def num_replicas(self) -> int: ...

        def _merge(self, call: str) -> _context.ReplicaContext | None: ...

        def _is_mirrored(self, x: jax.Array) -> bool: ...

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
        if self._merge("mirror(tree)") is not None:
            return tree
        leaves, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_distributed)
        out: list[Any] = [None] * len(leaves)
        todo = []
        for i, (path, leaf) in enumerate(leaves):
            if isinstance(leaf, PerReplica):
                raise TypeError(
                    f"strategy.mirror got a PerReplica at path {jax.tree_util.keystr(path)!r}; "
                    "per-replica values cannot be mirrored as they are. Reduce them first "
                    "(strategy.reduce) or pick one (strategy.local_results)."
                )
            # SyncOnRead state is already placed; exactly-mirrored arrays are kept (one
            # sharding for mirrored state, so a step's outputs match its inputs' signature).
            if isinstance(leaf, SyncOnRead) or (
                isinstance(leaf, jax.Array) and leaf.sharding == self._replicated
            ):
                out[i] = leaf
            else:
                todo.append(i)
        if todo:
            sources = [leaves[i][1] for i in todo]
            placed = jax.device_put(sources, [self._replicated] * len(todo))
            # The mirrored state must own its buffers: device_put may reuse the caller's
            # buffer for the copy on its device, and donating the state to a step would then
            # delete (or overwrite) the caller's array.
            shared = [j for j, (a, b) in enumerate(zip(sources, placed)) if _shares_memory(a, b)]
            if shared:
                copies = _copy_fn(self._replicated)([placed[j] for j in shared])
                for j, copy in zip(shared, copies):
                    placed[j] = copy
            for i, x in zip(todo, placed, strict=False):
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
        is_sum = sync_on_read.aggregation is Aggregation.SUM

        def spread(dtype: Any) -> bool:  # an integer SUM: components differ by the remainder
            return is_sum and jnp.issubdtype(dtype, jnp.integer)

        def component(dtype: Any, new: Any, replica: Any) -> Any:
            new = jnp.asarray(new)
            if spread(dtype):
                new = new.astype(dtype)
                extra = (replica < jnp.remainder(new, n)).astype(dtype)
                return jnp.floor_divide(new, n) + extra
            return (new / n if is_sum else new).astype(dtype)

        if context is not None:
            return sync_on_read.replace(
                jax.tree.map(
                    lambda old, new: component(jnp.result_type(old), new, context.replica_id),
                    sync_on_read.value,
                    value,
                )
            )
        dtypes = jax.tree.map(jnp.result_type, sync_on_read.value)
        if not any(spread(d) for d in jax.tree.leaves(dtypes)):
            same = jax.tree.map(lambda d, new: component(d, new, 0), dtypes, value)
            return sync_on_read.replace(self._stack_copies(self.mirror(same)))
        replicas = jnp.arange(n)
        stacked = jax.tree.map(
            lambda d, new: jax.vmap(lambda r: component(d, new, r))(replicas), dtypes, value
        )
        return sync_on_read.replace(jax.device_put(stacked, self._stacked))

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
        per_leaf = zip(*(jax.tree.leaves(c) for c in components), strict=False)
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
        pairs = zip(parts, self._devices, strict=False)
        arrays = [jax.device_put(jnp.asarray(p)[None], d) for p, d in pairs]
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


def _buffers(x: Any) -> set[int]:
    if isinstance(x, jax.Array):
        return {shard.data.unsafe_buffer_pointer() for shard in x.addressable_shards}
    if isinstance(x, np.ndarray):
        return {x.__array_interface__["data"][0]}
    return set()


def _shares_memory(source: Any, placed: jax.Array) -> bool:
    """Whether `placed` reuses a buffer of `source` (a jax.Array or numpy array)."""
    return bool(_buffers(source) & _buffers(placed))


@functools.cache
def _copy_fn(sharding: Any) -> Callable[[list[jax.Array]], list[jax.Array]]:
    """Fresh copies of arrays, placed with `sharding`."""
    return jax.jit(lambda xs: [jnp.copy(x) for x in xs], out_shardings=sharding)


@functools.cache
def _stack_fn(sharding: NamedSharding, n: int) -> Callable[[PyTree], PyTree]:
    """N stacked copies of a mirrored tree; each device writes its own slice."""

    def stack(tree: PyTree) -> PyTree:
        return jax.tree.map(lambda x: jnp.broadcast_to(x[None], (n,) + jnp.shape(x)), tree)

    return jax.jit(stack, out_shardings=sharding)
