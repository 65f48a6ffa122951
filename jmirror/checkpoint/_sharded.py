"""Checkpoints of `Sharded` state leaves (`jm.shard_update`): saved whole, restored sharded.

A `Sharded` leaf is written once, as `strategy.read` gives it (the whole leaf, no padding),
as a leaf of kind `"sharded"`. On restore its layout follows `target`: a `Sharded` target (or
no target) gets it cut into the restoring strategy's N pieces, so a state saved on 8 replicas
restores on any other count; a plain target gets it mirrored. A leaf saved mirrored restores
sharded into a `Sharded` target, so training can switch between the two updates.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jmirror import _shard_jaxpr
from jmirror._values import PyTree, Sharded

KIND = "sharded"


def pieces(host: np.ndarray, n: int, k: int = 1) -> np.ndarray:
    """Returns the `[N, length]` pieces of a whole host array over N replicas of k devices, as
    `jm.shard_update` cuts them (flattened, zero-padded, cut in N; in k blocks first when
    k > 1: `jmirror._shard_jaxpr.layout`)."""
    return _shard_jaxpr.stack(host, _shard_jaxpr.layout(np.shape(host), n, k), xp=np)


def matches(leaf: Any, target: PyTree) -> bool | None:
    """Returns whether `target` fits the saved `leaf` as a `Sharded` node, setting how it restores.

    Returns `None` when neither side is sharded (the plain checks apply), `True` when they
    fit, `False` when they do not (the caller reports the mismatch).
    """
    if isinstance(target, Sharded):
        if leaf.kind not in (KIND, "mirrored"):
            return False
        leaf.sharded = True
        dtype_ok = leaf.dtype is not None and np.dtype(leaf.dtype) == np.dtype(target.dtype)
        return tuple(target.shape) == tuple(leaf.shape) and dtype_ok
    if leaf.kind == KIND:
        leaf.sharded = False  # a plain target: restore the whole leaf mirrored
    return None
