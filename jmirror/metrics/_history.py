"""Per-step metric history: many small device values → one host tree, in one transfer.

The pmap-era loop appends each step's metrics to a list and calls flax's
`common_utils.get_metrics(history)` every few hundred steps: it takes replica 0's copy of
every leaf of every step (`x[0]`) and fetches each one separately. `stack_history` takes the
same list of a replicated step's mirrored outputs (or sync-on-read values, which it reads),
stacks every leaf over the steps with one compiled function on this process's first device
of the strategy, and brings the result to the host with one `jax.device_get`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmirror._strategy import MirroredStrategy, get_strategy
from jmirror._values import PerReplica, PyTree, is_distributed

_CALL = "jm.metrics.stack_history(history)"


def stack_history(history: Sequence[PyTree], *, strategy: MirroredStrategy | None = None) -> PyTree:
    """Returns a per-step metric history as one host tree of arrays stacked over the steps.

    The replacement for flax's `common_utils.get_metrics`: `history` is a list of the metric
    trees a replicated step returned, one per step (mirrored arrays, such as
    `jm.all_reduce("mean", loss)`; `SyncOnRead` nodes, which are read as `strategy.read`
    reads them; plain arrays and numbers). The result has the structure of one step's tree,
    with every leaf a numpy array whose leading axis is the step. Mirrored leaves are read
    from this process's first device of the strategy without a gather (with several
    processes every process gets the whole history); all leaves are stacked there by one
    compiled function (compiled once per history length and structure) and copied to the
    host by one `jax.device_get`, so nothing waits on the steps before this call.

    Args:
      history: a list (or tuple) of per-step metric trees, all of the same structure, with
        each leaf of the same shape at every step.
      strategy: the strategy whose steps produced `history`; `None` means
        `jm.get_strategy()`.

    Returns:
      One tree of the steps' structure; each leaf a numpy array of shape
      `(len(history), *leaf_shape)`, with the dtype `jnp.stack` gives.

    Raises:
      TypeError: when `history` is not a list or tuple, or holds a `jm.PerReplica` (reduce
        it first: `jm.all_reduce` in the step, or `strategy.reduce` outside it).
      ValueError: when `history` is empty, when a step's tree differs in structure from
        the first step's, or a leaf differs in shape (both name the step and the path), or
        for a `SyncOnRead` with aggregation `NONE`.

    Example:
        >>> import jax, jax.numpy as jnp, jmirror as jm
        >>> strategy = jm.MirroredStrategy()
        >>> n = strategy.num_replicas
        >>> @jm.replicate(strategy=strategy)
        ... def step(x):
        ...     return {"loss": jm.all_reduce("mean", x), "max": jm.all_reduce("max", x)}
        >>> history = [step(jm.PerReplica(jnp.arange(n) + 10.0 * s)) for s in range(3)]
        >>> stacked = jm.metrics.stack_history(history, strategy=strategy)
        >>> stacked["loss"].shape, (stacked["loss"] - (n - 1) / 2).tolist()
        ((3,), [0.0, 10.0, 20.0])
        >>> (stacked["max"] - (n - 1)).tolist()
        [0.0, 10.0, 20.0]
    """
    if not isinstance(history, list | tuple):
        raise TypeError(
            f"{_CALL} expects a list of per-step metric trees, got {type(history).__name__}. "
            "Append each step's metrics to a list and pass the list: "
            "history.append(metrics); ...; jm.metrics.stack_history(history)."
        )
    if not history:
        raise ValueError(
            f"{_CALL} got an empty history: there is no step to stack. Call it after at "
            "least one step has appended its metrics (e.g. only when len(history) > 0)."
        )
    strategy = get_strategy() if strategy is None else strategy
    for index, tree in enumerate(history):
        _check_no_per_replica(index, tree)
    steps = strategy.read(list(history))  # SyncOnRead → aggregated, mirrored → devices[0]
    columns, treedef = _columns(steps)
    # Where this process's reads live (`strategy.devices[0]` may be another process's).
    on_device = jax.device_put(columns, strategy.topology.first_local_device)
    return treedef.unflatten(jax.device_get(list(_stack_columns(on_device))))


def _check_no_per_replica(index: int, tree: PyTree) -> None:
    nodes, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_distributed)
    for path, node in nodes:
        if isinstance(node, PerReplica):
            raise TypeError(
                f"{_CALL}: history[{index}]{jax.tree_util.keystr(path)} is a jm.PerReplica "
                "(one value per replica), which has no single value to record. Reduce it "
                'first: in the step with jm.all_reduce("mean", value) (the pmap-era '
                'lax.pmean), or outside with strategy.reduce("mean", value).'
            )


def _columns(steps: list[PyTree]) -> tuple[tuple[tuple[Any, ...], ...], Any]:
    """Returns each leaf position's values over the steps, after checking every step's layout."""
    first, treedef = jax.tree_util.tree_flatten_with_path(steps[0])
    rows = [[leaf for _, leaf in first]]
    for index, tree in enumerate(steps[1:], start=1):
        paths_leaves, other = jax.tree_util.tree_flatten_with_path(tree)
        if other != treedef:
            raise ValueError(
                f"{_CALL}: history[{index}] has a different structure from history[0]: "
                f"{_first_difference(first, paths_leaves)}. Every step must record the same "
                "metrics (same keys, same nesting); keep metrics recorded only on some steps "
                "in a history of their own."
            )
        for (path, leaf), (_, leaf0) in zip(paths_leaves, first):
            if np.shape(leaf) != np.shape(leaf0):
                raise ValueError(
                    f"{_CALL}: history[{index}]{jax.tree_util.keystr(path)} has shape "
                    f"{np.shape(leaf)}, but history[0]{jax.tree_util.keystr(path)} has shape "
                    f"{np.shape(leaf0)}. Each metric is stacked over the steps, so its shape "
                    "must be the same at every step: reduce it in the step (e.g. to a mean)."
                )
        rows.append([leaf for _, leaf in paths_leaves])
    return tuple(zip(*rows)), treedef


def _first_difference(first: list[tuple[Any, Any]], other: list[tuple[Any, Any]]) -> str:
    paths = [jax.tree_util.keystr(path) for path, _ in first]
    others = [jax.tree_util.keystr(path) for path, _ in other]
    for path, path_other in zip(paths, others):
        if path != path_other:
            return f"it has a leaf at {path_other} where history[0] has {path}"
    if len(others) > len(paths):
        return f"it has an extra leaf at {others[len(paths)]}"
    if len(paths) > len(others):
        return f"it has no leaf at {paths[len(others)]}"
    return "its leaves have the same paths but different container types"


@jax.jit
def _stack_columns(columns: tuple[tuple[Any, ...], ...]) -> tuple[jax.Array, ...]:
    return tuple(jnp.stack(column) for column in columns)
