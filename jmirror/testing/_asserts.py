"""Assertions about distributed values (chex style: actual vs expected in every message)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmirror._adapter import static_leaves
from jmirror._strategy import MirroredStrategy, get_strategy
from jmirror._values import PerReplica, PyTree, is_distributed


def _strategy(strategy: MirroredStrategy | None) -> MirroredStrategy:
    return get_strategy() if strategy is None else strategy


def _host(x: PyTree) -> np.ndarray:
    """Returns `x` as a NumPy array; a typed PRNG key array as its key data
    (`jax.random.key_data`)."""
    if _is_key(x):
        x = jax.random.key_data(x)
    return np.asarray(x)


def _paths(tree: PyTree) -> list[tuple[str, Any]]:
    """Returns `(path, leaf)` for every leaf of `tree` that is not static (an equinox
    module's functions and flags are no replica's value)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_distributed)
    static = static_leaves(tree, is_leaf=is_distributed)
    return [(jax.tree_util.keystr(p) or "<root>", x) for (p, x), s in zip(flat, static) if not s]


def assert_mirrored(tree: PyTree, strategy: MirroredStrategy | None = None) -> None:
    """Asserts that every leaf is mirrored over the strategy's devices, with equal copies.

    Example:
        >>> import numpy as np, jmirror as jm, jmirror.testing as jmt
        >>> strategy = jm.MirroredStrategy()
        >>> jmt.assert_mirrored({"w": strategy.mirror(np.ones(3))}, strategy)
    """
    strategy = _strategy(strategy)
    for path, leaf in _paths(tree):
        if not isinstance(leaf, jax.Array) or not strategy.topology.is_mirrored(leaf):
            found = type(leaf).__name__
            if isinstance(leaf, jax.Array):
                found = f"jax.Array with sharding {leaf.sharding}"
            raise AssertionError(
                f"assert_mirrored: leaf {path} is not mirrored over the strategy's "
                f"{strategy.num_replicas} replica(s) ({strategy.topology.num_devices} "
                f"device(s)); found {found}. Place it with strategy.mirror(...)."
            )
        _check_every_device(path, leaf, strategy)


def _check_every_device(path: str, leaf: jax.Array, strategy: MirroredStrategy) -> None:
    """Raises unless every device's part of the mirrored `leaf` equals that part of the first
    replica's whole copy (each device of every replica: a copy within a replica too)."""
    topology = strategy.topology
    first = _host(strategy.local_results(leaf)[0])
    k = topology.devices_per_replica
    position = {d: i for i, d in enumerate(topology.devices)}
    for shard in sorted(leaf.addressable_shards, key=lambda s: position.get(s.device, 0)):
        part = _host(shard.data)
        if not np.array_equal(part, first[shard.index], equal_nan=True):
            index = position.get(shard.device, 0)
            where = f"replica {index // k}" + (f" (its device {shard.device})" if k > 1 else "")
            raise AssertionError(
                f"assert_mirrored: leaf {path} differs between replica 0 and {where}: "
                f"{first[shard.index]!r} vs {part!r}."
            )


def assert_per_replica(tree: PyTree) -> None:
    """Asserts that every leaf of `tree` is inside a `jm.PerReplica`.

    Example:
        >>> import numpy as np, jmirror as jm, jmirror.testing as jmt
        >>> jmt.assert_per_replica({"x": jm.PerReplica(np.zeros((2, 3)))})
    """
    for path, leaf in _paths(tree):
        if not isinstance(leaf, PerReplica):
            raise AssertionError(
                f"assert_per_replica: leaf {path} is a {type(leaf).__name__}, expected a "
                "jm.PerReplica."
            )


def assert_replicas_equal(
    value: PyTree, strategy: MirroredStrategy | None = None, *, rtol: float = 0.0, atol: float = 0.0
) -> None:
    """Asserts that every replica holds the same value (within `rtol` / `atol`).

    Works for `PerReplica`, `SyncOnRead` and mirrored values.

    Example:
        >>> import numpy as np, jmirror as jm, jmirror.testing as jmt
        >>> strategy = jm.MirroredStrategy()
        >>> same = jm.PerReplica(np.ones((strategy.num_replicas, 2)))
        >>> jmt.assert_replicas_equal(same, strategy)
    """
    strategy = _strategy(strategy)
    parts = strategy.local_results(value)
    first = jax.tree.leaves(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        for (path, a), (_, b) in zip(_paths(parts[0]), _paths(part)):
            a, b = _host(a), _host(b)
            if not np.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True):
                raise AssertionError(
                    f"assert_replicas_equal: leaf {path} differs between replica 0 and replica "
                    f"{i} (rtol={rtol}, atol={atol}): {a!r} vs {b!r}."
                )
    del first


def _is_key(x: object) -> bool:
    """Returns whether `x` is a typed PRNG key array (`jax.random.key`)."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)
