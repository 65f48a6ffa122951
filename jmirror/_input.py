"""Input: global batches split into per-replica shards on the devices (SPEC section 7).

`MirroredStrategy.distribute_dataset` and `.distribute_datasets_from_function` delegate here.
Both return a `DistributedDataset`, whose every `iter()` opens one pass over the source.

Placement: each leaf `(G, ...)` is reshaped (a view) to `(N, G/N, ...)` and goes out in one
call with the stacked sharding `NamedSharding(mesh, P(axis_name))`: device i receives only
examples `[i * G/N, (i + 1) * G/N)`, with no per-device Python loop and never N slices stacked
on one device.

Choices the spec leaves open:

- `remainder="pad"` appends zeros (of each leaf's dtype) after the real examples, so the
  padding lands on the last replicas. With `remainder="drop"`, a first batch whose size is not
  a multiple of N makes every batch of that size incomplete: a `UserWarning` says so.
- `prefetch=k > 0`: a daemon thread keeps at most k batches transferred ahead of the consumer
  (see `jmirror._prefetch`, which iterates one pass). Warnings are emitted in the consuming
  thread.
- Iterators jmirror opened (by calling a callable source, or `iter()` of a re-iterable one)
  are closed with their pass; a one-shot iterator passed in is never closed, and concurrent
  passes over it take turns through a lock. `close()` on a dataset stops its running passes;
  the dataset stays re-iterable.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import TYPE_CHECKING, Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from jmirror._prefetch import DistributedIterator, _Warning
from jmirror._shim import put_rows
from jmirror._values import PerReplica, PyTree

if TYPE_CHECKING:
    from jmirror._strategy import MirroredStrategy

_REMAINDERS = ("pad", "drop", "error")
_DATASET_CALL = "strategy.distribute_dataset"
_FUNCTION_CALL = "strategy.distribute_datasets_from_function"


@dataclasses.dataclass(frozen=True)
class InputContext:
    """Where an input pipeline stands: passed to `distribute_datasets_from_function`'s function.

    On one machine there is one input pipeline (`num_input_pipelines=1`,
    `input_pipeline_id=0`) feeding all `num_replicas_in_sync` replicas.

    Args:
      num_input_pipelines: how many input pipelines feed the replicas.
      input_pipeline_id: this pipeline's index, in `[0, num_input_pipelines)`.
      num_replicas_in_sync: how many replicas train in sync.

    Raises:
      ValueError: for a count below 1 or a pipeline id out of range.

    Example:
        >>> import jmirror as jm
        >>> ctx = jm.InputContext(num_input_pipelines=1, input_pipeline_id=0,
        ...                       num_replicas_in_sync=4)
        >>> ctx.get_per_replica_batch_size(64)
        16
    """

    num_input_pipelines: int = 1
    input_pipeline_id: int = 0
    num_replicas_in_sync: int = 1

    def __post_init__(self) -> None:
        if self.num_input_pipelines < 1 or self.num_replicas_in_sync < 1:
            raise ValueError(
                f"jm.InputContext expects num_input_pipelines >= 1 and num_replicas_in_sync >= 1, "
                f"got {self.num_input_pipelines} and {self.num_replicas_in_sync}."
            )
        if not 0 <= self.input_pipeline_id < self.num_input_pipelines:
            raise ValueError(
                f"jm.InputContext expects 0 <= input_pipeline_id < num_input_pipelines "
                f"({self.num_input_pipelines}), got input_pipeline_id={self.input_pipeline_id}."
            )

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """Returns `global_batch_size // num_replicas_in_sync`.

        Raises:
          ValueError: when `global_batch_size` is not divisible by `num_replicas_in_sync`.

        Example:
            >>> import jmirror as jm
            >>> jm.InputContext(num_replicas_in_sync=8).get_per_replica_batch_size(96)
            12
        """
        n = self.num_replicas_in_sync
        if global_batch_size % n:
            raise ValueError(
                f"InputContext.get_per_replica_batch_size({global_batch_size}): the global batch "
                f"size must be divisible by num_replicas_in_sync={n}, but {global_batch_size} % "
                f"{n} = {global_batch_size % n}. Use a global batch size that is a multiple of {n}."
            )
        return global_batch_size // n


# --- the source ----------------------------------------------------------------------------------


class _Source:
    """Opens one pass over a dataset: calls a callable source, iterates an iterable one."""

    def __init__(self, call: str, open_fn: Callable[[], Any], given: Any):
        self._call = call
        self._open_fn = open_fn
        self._given = given  # the caller's object: never closed by jmirror
        self._lock = threading.Lock()

    def pull(self) -> Generator[Any, None, None]:
        """Yields the source's elements for one pass."""
        result = self._open_fn()
        try:
            it = iter(result)
        except TypeError:
            raise TypeError(
                f"{self._call}: the dataset function returned {type(result).__name__}, which is "
                "not iterable; return an iterable of batches (a list, a generator, a data "
                "loader)."
            ) from None
        if it is self._given:  # a one-shot iterator shared by every pass
            while True:
                with self._lock:
                    try:
                        element = next(it)
                    except StopIteration:
                        return
                yield element
        try:
            yield from it
        finally:
            close = getattr(it, "close", None)
            if callable(close):
                close()


def _source(call: str, dataset: Any) -> _Source:
    if isinstance(dataset, Iterable):
        return _Source(call, lambda: dataset, dataset)
    if callable(dataset):
        return _Source(call, dataset, dataset)
    raise TypeError(
        f"{call} expects an iterable of batches or a zero-argument callable returning one, got "
        f"{type(dataset).__name__}. Pass a list, a generator, a data loader, or a function "
        "that returns one per epoch."
    )


def _check_prefetch(call: str, prefetch: Any) -> int:
    if isinstance(prefetch, bool) or not isinstance(prefetch, int):
        raise TypeError(
            f"{call}(prefetch=...) expects an int, got {prefetch!r} of type "
            f"{type(prefetch).__name__}."
        )
    if prefetch < 0:
        raise ValueError(
            f"{call}(prefetch={prefetch}) must be >= 0: the number of batches placed ahead of "
            "the consumer by a background thread (0 for no thread)."
        )
    return prefetch


# --- placing batches -----------------------------------------------------------------------------


def _as_array(call: str, batch: PyTree, index: int, leaf: Any, leaf_index: int) -> Any:
    if isinstance(leaf, jax.Array):
        return leaf
    array = np.asarray(leaf)
    if array.dtype == object:
        raise TypeError(
            f"{call}: leaf {_leaf_path(batch, leaf_index)} of batch {index} is a "
            f"{type(leaf).__name__} that does not convert to a numeric array; every leaf of a "
            "batch must be an array-like (numpy array, jax.Array, nested lists of numbers)."
        )
    return array


def _leaf_path(tree: PyTree, leaf_index: int) -> str:
    path = jax.tree_util.tree_flatten_with_path(tree)[0][leaf_index][0]
    return f"batch{jax.tree_util.keystr(path)}"


def _leading_size(call: str, batch: PyTree, index: int, leaves: list[Any]) -> int:
    if not leaves:
        raise ValueError(
            f"{call}: batch {index} has no array leaves ({batch!r}); each batch must be a pytree "
            "of arrays with a leading batch axis."
        )
    sizes: list[int | None] = [np.shape(x)[0] if np.ndim(x) else None for x in leaves]
    for i, size in enumerate(sizes):
        if size is None:
            raise ValueError(
                f"{call}: leaf {_leaf_path(batch, i)} of batch {index} is a scalar (shape ()), "
                "but every leaf needs a leading batch axis. Give it one example per row, e.g. "
                "np.full((batch_size,), value)."
            )
        if size != sizes[0]:
            shapes = f"{np.shape(leaves[i])} vs {np.shape(leaves[0])} at {_leaf_path(batch, 0)}"
            raise ValueError(
                f"{call}: leaf {_leaf_path(batch, i)} of batch {index} has leading size {size}, "
                f"but the first leaf has {sizes[0]} ({shapes}). Every leaf of a batch must hold "
                "the same number of examples along axis 0."
            )
    return cast(int, sizes[0])  # not None: checked in the loop above


def _pad(x: Any, size: int) -> Any:
    extra = size - x.shape[0]
    if isinstance(x, jax.Array):
        return jnp.concatenate([x, jnp.zeros((extra,) + x.shape[1:], x.dtype)])
    out = np.zeros((size,) + x.shape[1:], x.dtype)
    out[: x.shape[0]] = x
    return out


def _place(strategy: MirroredStrategy, arrays: list[Any]) -> list[jax.Array]:
    """Slice i of each (N, ...) array lands on device i, and only there.

    Host arrays go through `jmirror._shim.put_rows`, one C++ call per leaf that copies each
    row to its device (the least host time per batch, which is what the input pipeline costs
    while the step keeps the cores busy); arrays already on devices go through one
    `jax.device_put`.
    """
    sharding = strategy._stacked
    return [
        put_rows(x, sharding) if isinstance(x, np.ndarray) else jax.device_put(x, sharding)
        for x in arrays
    ]


def _global_batches(strategy: MirroredStrategy, source: _Source, remainder: str) -> Iterator[Any]:
    """Yields placed global batches (`PerReplica`, or `(PerReplica, mask)` for "pad")."""
    pulled = source.pull()
    try:
        yield from _split_batches(strategy, pulled, remainder)
    finally:
        pulled.close()


def _split_batches(
    strategy: MirroredStrategy, pulled: Iterator[Any], remainder: str
) -> Iterator[Any]:
    call = _DATASET_CALL
    n = strategy.num_replicas
    g = 0
    first = 0
    for index, batch in enumerate(pulled):
        flat, treedef = jax.tree_util.tree_flatten(batch)
        leaves = [_as_array(call, batch, index, x, i) for i, x in enumerate(flat)]
        size = _leading_size(call, batch, index, leaves)
        if index == 0:
            if size == 0:
                raise ValueError(
                    f"{call}: the first batch has 0 examples, so there is no global batch size "
                    "to infer; the first batch sets G. Skip empty batches in the source."
                )
            first = size
            g = -(-size // n) * n
            if remainder == "drop" and size != g:
                yield _Warning(
                    f"{call}(remainder='drop'): the first batch has {size} examples, not a "
                    f"multiple of the {n} replicas, so the global batch size is G={g} and every "
                    f"batch of {size} examples is incomplete and will be dropped. Use a global "
                    f"batch size divisible by {n}, or remainder='pad'."
                )
        if size > g:
            raise ValueError(
                f"{call}: batch {index} has {size} examples, more than the global batch size "
                f"G={g} (the first batch's {first} examples rounded up to a multiple of N={n} "
                "replicas). Every batch may hold at most G examples (only smaller, incomplete "
                "batches are allowed); make the first batch the largest, or re-batch the source."
            )
        mask = None
        if size < g:
            if remainder == "drop":
                continue
            if remainder == "error":
                raise ValueError(
                    f"{call}(remainder='error'): batch {index} has {size} examples, fewer than "
                    f"the global batch size G={g} ({g // n} per replica on N={n} replicas). Use "
                    "remainder='pad' to pad it (with a mask), remainder='drop' to skip it, or "
                    f"make every batch hold exactly {g} examples."
                )
            leaves = [_pad(x, g) for x in leaves]
        if remainder == "pad":
            mask = (np.arange(g) < size).reshape(n, g // n)
        arrays = [x.reshape((n, g // n) + tuple(x.shape[1:])) for x in leaves]
        if mask is None:
            placed = _place(strategy, arrays)
            yield PerReplica(treedef.unflatten(placed))
        else:
            placed = _place(strategy, arrays + [mask])
            yield PerReplica(treedef.unflatten(placed[:-1])), PerReplica(placed[-1])


def _dealt_batches(strategy: MirroredStrategy, source: _Source) -> Iterator[Any]:
    """Yields placed `PerReplica` batches, dealing N consecutive elements to replicas 0..N-1."""
    n = strategy.num_replicas
    group: list[Any] = []
    step = 0
    pulled = source.pull()
    try:
        for element in pulled:
            group.append(element)
            if len(group) == n:
                yield _stack_group(strategy, group, step)
                group = []
                step += 1
    finally:
        pulled.close()
    if group:
        yield _Warning(
            f"{_FUNCTION_CALL}: the dataset function's elements ran out after {len(group)} of "
            f"the {n} per-replica batches of the last step, so those {len(group)} per-replica "
            f"batch(es) were dropped. Make the number of elements a multiple of {n} (for "
            "example, repeat or pad the dataset) to use them."
        )


def _stack_group(strategy: MirroredStrategy, group: list[Any], step: int) -> PerReplica:
    call = _FUNCTION_CALL
    flats = []
    treedef = jax.tree_util.tree_structure(group[0])
    for replica, element in enumerate(group):
        flat, structure = jax.tree_util.tree_flatten(element)
        if structure != treedef:
            raise ValueError(
                f"{call}: at step {step} the element for replica {replica} has structure "
                f"{structure}, but replica 0's has {treedef}; every element must have the same "
                "pytree structure."
            )
        flats.append([np.asarray(x) for x in flat])
    stacked = []
    for i, parts in enumerate(zip(*flats, strict=False)):
        for replica, part in enumerate(parts):
            if part.shape != parts[0].shape or part.dtype != parts[0].dtype:
                path = _leaf_path(group[0], i)
                raise ValueError(
                    f"{call}: at step {step} leaf {path} of replica {replica}'s element has "
                    f"shape {part.shape} and dtype {part.dtype}, but replica 0's has "
                    f"{parts[0].shape} and {parts[0].dtype}; the N elements of one step must "
                    "share shapes and dtypes. Batch the dataset with drop_remainder, or pad it."
                )
        stacked.append(np.stack(parts))
    return PerReplica(treedef.unflatten(_place(strategy, stacked)))


# --- the dataset ---------------------------------------------------------------------------------


class DistributedDataset:
    """An iterable of batches already on the strategy's devices, re-iterable per epoch.

    Each `iter()` opens a new pass: a callable source is called again and a re-iterable one
    restarts; an exhausted one-shot iterator yields nothing. `close()` (or leaving a `with`
    block) stops every running pass.

    Example:
        >>> import numpy as np, jmirror as jm
        >>> strategy = jm.MirroredStrategy()
        >>> n = strategy.num_replicas
        >>> with strategy.distribute_dataset(lambda: [np.ones((n, 3))] * 2) as data:
        ...     epochs = [len(list(data)) for _ in range(2)]
        >>> epochs
        [2, 2]
    """

    def __init__(
        self,
        open_elements: Callable[[], Iterator[Any]],
        prefetch: int,
        call: str,
        strategy: MirroredStrategy,
    ):
        self._open_elements = open_elements
        self._prefetch = prefetch
        self._call = call
        # On host devices the step's compute shares the cores: see jmirror._prefetch.
        self._low_priority = strategy.devices[0].platform == "cpu"
        self._iterators: weakref.WeakSet[DistributedIterator] = weakref.WeakSet()

    def __iter__(self) -> DistributedIterator:
        iterator = DistributedIterator(self._open_elements(), self._prefetch, self._low_priority)
        self._iterators.add(iterator)
        return iterator

    def close(self) -> None:
        """Stops every running pass over this dataset (their prefetch threads included).

        Example:
            >>> import numpy as np, jmirror as jm
            >>> strategy = jm.MirroredStrategy()
            >>> n = strategy.num_replicas
            >>> data = strategy.distribute_dataset([np.zeros((n, 2))] * 3)
            >>> it = iter(data)
            >>> data.close()
            >>> list(it)
            []
        """
        for iterator in list(self._iterators):
            iterator.close()

    def __enter__(self) -> DistributedDataset:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{self._call}(prefetch={self._prefetch})>"


# --- entry points --------------------------------------------------------------------------------


def distribute_dataset(
    strategy: MirroredStrategy, dataset: Any, *, remainder: str = "pad", prefetch: int = 2
) -> DistributedDataset:
    """Splits each global batch of `dataset` into per-replica shards on the devices.

    Args:
      strategy: the `MirroredStrategy` whose devices receive the batches.
      dataset: an iterable of global batches (pytrees of array-likes with one common leading
        batch size), or a zero-argument callable returning one, called again per pass.
      remainder: what to do with an incomplete batch (fewer than G examples, where G is the
        first batch's size rounded up to a multiple of N): `"pad"` pads it with zeros and
        yields `(batch, mask)` for every batch; `"drop"` skips it; `"error"` raises.
      prefetch: how many batches a background thread keeps on the devices ahead of the
        consumer; 0 runs synchronously, without a thread.

    Returns:
      A `DistributedDataset` yielding `jm.PerReplica` batches (leaves of shape
      `(N, G/N, ...)`), or `(batch, mask)` pairs for `"pad"`, with `mask` a `PerReplica` of
      bools of shape `(N, G/N)`, True exactly on the real examples.

    Raises:
      ValueError: for an invalid `remainder` or `prefetch < 0`; while iterating, for a batch
        larger than G, leaves of different leading sizes, or an incomplete batch with
        `"error"`.
      TypeError: when `dataset` is neither iterable nor callable, or `prefetch` is not an int.

    Example:
        >>> import numpy as np, jmirror as jm
        >>> strategy = jm.MirroredStrategy()
        >>> n = strategy.num_replicas
        >>> batches = [np.arange(4 * n), np.arange(n)]  # the second one is incomplete
        >>> masks = [mask for _, mask in strategy.distribute_dataset(batches)]
        >>> [int(np.sum(strategy.gather(m))) for m in masks] == [4 * n, n]
        True
    """
    if remainder not in _REMAINDERS:
        raise ValueError(
            f"{_DATASET_CALL}(remainder={remainder!r}) is not a valid remainder; expected one "
            f"of {_REMAINDERS}: 'pad' (pad and yield a mask), 'drop' (skip incomplete batches) "
            "or 'error' (raise on an incomplete batch)."
        )
    prefetch = _check_prefetch(_DATASET_CALL, prefetch)
    source = _source(_DATASET_CALL, dataset)
    return DistributedDataset(
        lambda: _global_batches(strategy, source, remainder), prefetch, _DATASET_CALL, strategy
    )


def distribute_datasets_from_function(
    strategy: MirroredStrategy, dataset_fn: Callable[[InputContext], Any], *, prefetch: int = 2
) -> DistributedDataset:
    """Deals the per-replica batches of `dataset_fn(jm.InputContext(...))` to the replicas.

    `dataset_fn` is called with `InputContext(1, 0, N)` at the start of every pass. Its
    elements are per-replica batches: N consecutive elements form one step, element i going to
    replica i, stacked into one `jm.PerReplica`. A final group of fewer than N elements is
    dropped with a `UserWarning`.

    Args:
      strategy: the `MirroredStrategy` whose devices receive the batches.
      dataset_fn: a function of a `jm.InputContext` returning an iterable of per-replica
        batches (pytrees of array-likes; the N elements of a step share shapes).
      prefetch: how many steps a background thread keeps on the devices ahead of the
        consumer; 0 runs synchronously, without a thread.

    Returns:
      A `DistributedDataset` yielding one `jm.PerReplica` per step.

    Raises:
      ValueError: for `prefetch < 0`; while iterating, when the elements of a step differ in
        structure, shape or dtype.
      TypeError: when `dataset_fn` is not callable or `prefetch` is not an int.

    Example:
        >>> import numpy as np, jmirror as jm
        >>> strategy = jm.MirroredStrategy()
        >>> n = strategy.num_replicas
        >>> def dataset_fn(ctx):
        ...     return [np.full((2,), i) for i in range(ctx.num_replicas_in_sync)]
        >>> (batch,) = strategy.distribute_datasets_from_function(dataset_fn)
        >>> [int(x[0]) for x in strategy.local_results(batch)] == list(range(n))
        True
    """
    if not callable(dataset_fn):
        raise TypeError(
            f"{_FUNCTION_CALL} expects a function of a jm.InputContext returning an iterable of "
            f"per-replica batches, got {type(dataset_fn).__name__}. For an iterable of global "
            "batches use strategy.distribute_dataset."
        )
    prefetch = _check_prefetch(_FUNCTION_CALL, prefetch)
    context = InputContext(
        num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=strategy.num_replicas
    )
    source = _Source(_FUNCTION_CALL, lambda: dataset_fn(context), dataset_fn)
    return DistributedDataset(
        lambda: _dealt_batches(strategy, source), prefetch, _FUNCTION_CALL, strategy
    )
