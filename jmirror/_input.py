"""Input: global batches split into per-replica shards on the devices.

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
  the dataset stays re-iterable. No clean-up waits for a source blocked in `next()`: see
  `jmirror._prefetch`.
- Leaves: a numpy array, a `jax.Array`, or a non-empty list of numbers (nested lists of the
  same length for more dimensions) is one leaf; any other list stays a pytree container, as
  JAX sees it. Leaves that are not numbers (strings, bytes, datetimes, objects, ragged lists)
  are a `TypeError` naming the leaf. Without x64, 64-bit integer leaves are checked with one
  min and max each and must fit 32 bits (`ValueError`); 64-bit floats become 32-bit silently,
  as everywhere in JAX.
- `remainder="pad"` yields `PaddedBatch(batch, mask)`, a namedtuple: it unpacks and is a
  pytree like a plain pair, and `element["image"]` or `element.keys()` on it is a `TypeError`
  that says to unpack it.
- Position: iterators of `distribute_dataset` count the source batches up to and including
  the last one they returned (`.position`, a JSON-able dict). `start=` skips that many source
  batches on the first pass: the first is looked at only for its leading size (it sets G, for
  this run's N), the others are not even converted. A source shorter than the position is a
  `ValueError`. Batches are counted, never examples, so a position stays valid on another
  replica count when the global batch size does not change.
  `distribute_datasets_from_function` has no position: its `.position` is an
  `AttributeError`.
- Several processes: each process iterates its own source (its rows of each global batch,
  or its own pipeline's elements). Uneven input never hangs: before each step the processes
  agree whether every one of them has a batch (see `jmirror._prefetch`), so when one
  process's source ends first every process's pass ends at that same step, with a
  `UserWarning` naming the processes that ran short and those whose batches go unused; when
  one process's source raises, that process gets its error and the others a `RuntimeError`
  naming it, at the same step. Positions are per process (each counts its own source's
  batches). One process agrees with nobody and pays nothing for it.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import reprlib
import threading
import weakref
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jmirror._prefetch import (
    POSITION_FORMAT,
    POSITION_VERSION,
    Agree,
    Control,
    DistributedIterator,
    _Positioned,
    _Warning,
    position_dict,
)
from jmirror._shim import put_rows
from jmirror._topology import Topology
from jmirror._values import PerReplica, PyTree

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
    """Opens one pass over a dataset: calls a callable source, iterates an iterable one.

    Every call into the source's own code runs with `control.in_source` set, so that clean-up
    knows not to wait for it, and no call is made once `control.stopped` is set.
    """

    def __init__(self, call: str, open_fn: Callable[[], Any], given: Any):
        self._call = call
        self._open_fn = open_fn
        self._given = given  # the caller's object: never closed by jmirror
        self._lock = threading.Lock()

    def describe(self) -> str:
        """The source as warnings name it: its qualified name, or its type and id."""
        name = getattr(self._given, "__qualname__", None)
        if not isinstance(name, str):
            name = f"{type(self._given).__qualname__} object at {id(self._given):#x}"
        return f"{self._call}'s source {name}"

    def pull(self, control: Control) -> Generator[Any, None, None]:
        """Yields the source's elements for one pass, until it ends or `control` stops it."""
        stopped = control.stopped
        if stopped.is_set():
            return
        control.in_source = True
        try:
            it = self._open()
        finally:
            control.in_source = False
        shared = it is self._given  # a one-shot iterator shared by every pass: never closed
        try:
            while not stopped.is_set():
                control.in_source = True
                try:
                    if shared:
                        with self._lock:
                            element = next(it)
                    else:
                        element = next(it)
                except StopIteration:
                    return
                finally:
                    control.in_source = False
                if stopped.is_set():
                    return
                yield element
        finally:
            close = None if shared else getattr(it, "close", None)
            if callable(close):
                control.in_source = True
                try:
                    close()
                finally:
                    control.in_source = False

    def _open(self) -> Iterator[Any]:
        result = self._open_fn()
        try:
            return iter(result)
        except TypeError:
            raise TypeError(
                f"{self._call}: the dataset function returned {type(result).__name__}, which is "
                "not iterable; return an iterable of batches (a list, a generator, a data "
                "loader)."
            ) from None


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

_NUMERIC_KINDS = "biufc"  # bool, int, uint, float, complex: what a jax.Array holds
_KIND_NAMES = {
    "U": "strings",
    "S": "bytes",
    "M": "datetimes",
    "m": "timedeltas",
    "V": "structured records",
}


def _is_array_item(x: Any) -> bool:
    return isinstance(x, numbers.Number | np.generic | str | bytes) or _is_array_list(x)


def _is_array_list(x: Any) -> bool:
    """A non-empty list of numbers (or of such lists) is one array-like leaf.

    Any other list (of arrays, of dicts, empty) stays a pytree container, as JAX sees it.
    """
    return isinstance(x, list) and bool(x) and all(_is_array_item(v) for v in x)


def _flatten(tree: PyTree) -> tuple[list[Any], Any]:
    return jax.tree_util.tree_flatten(tree, is_leaf=_is_array_list)


def _leaf_path(tree: PyTree, leaf_index: int, root: str = "batch") -> str:
    path = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_array_list)[0][leaf_index][0]
    return f"{root}{jax.tree_util.keystr(path)}"


def _as_array(call: str, where: str, tree: PyTree, leaf: Any, leaf_index: int, root: str) -> Any:
    """`leaf` as an array JAX can place: numeric, and 64-bit integers only where they fit."""
    if isinstance(leaf, jax.Array):
        return leaf
    try:
        array = np.asarray(leaf)
    except ValueError:
        if not isinstance(leaf, list):
            raise
        raise TypeError(
            f"{call}: leaf {_leaf_path(tree, leaf_index, root)} of {where} is a ragged list: "
            "its nested lists do not all have the same length, so it is no array. A list of "
            "numbers, or nested lists of the same length, is one array-like leaf; pad the "
            "rows to one length (with a mask), or pass a numpy array."
        ) from None
    kind = array.dtype.kind
    if kind in _NUMERIC_KINDS:
        if kind != "b" and array.dtype.itemsize == 8 and array.size:
            _check_fits(call, where, tree, array, leaf_index, root)
        return array
    path = _leaf_path(tree, leaf_index, root)
    if kind == "O":
        found = f"a {type(leaf).__name__}"
        if isinstance(leaf, np.ndarray):
            found = "a numpy array of dtype object"
        raise TypeError(
            f"{call}: leaf {path} of {where} is {found}, which does not convert to a numeric "
            "array. Every leaf of a batch must be an array-like of numbers: a numpy array, a "
            "jax.Array, or a list of numbers (nested lists of the same length for more "
            "dimensions). Convert it to numbers, or keep it out of the batch."
        )
    raise TypeError(
        f"{call}: leaf {path} of {where} has dtype {array.dtype} "
        f"({_KIND_NAMES.get(kind, 'not numbers')}), which a jax.Array cannot hold. Convert it "
        "to a numeric dtype before it reaches the dataset (strings to integer ids through a "
        "vocabulary, datetimes to numbers of seconds), or keep it out of the batch."
    )


_IINFO: dict[np.dtype, np.iinfo] = {}


def _check_fits(call: str, where: str, tree: PyTree, x: np.ndarray, leaf_index: int, root: str):
    """A 64-bit integer array must fit the 32-bit dtype JAX gives it without x64."""
    if x.dtype.kind not in "iu":
        return
    target = jax.dtypes.canonicalize_dtype(x.dtype)
    if target == x.dtype:  # 64-bit types are on
        return
    low, high = x.min(), x.max()
    info = _IINFO.get(target) or _IINFO.setdefault(target, np.iinfo(target))
    if low >= info.min and high <= info.max:
        return
    raise ValueError(
        f"{call}: leaf {_leaf_path(tree, leaf_index, root)} of {where} is {x.dtype} with values "
        f"in [{low}, {high}], outside the range [{info.min}, {info.max}] of {target}, which "
        f"JAX makes of {x.dtype} while 64-bit types are off (its default): the values would "
        'wrap silently. Turn them on with jax.config.update("jax_enable_x64", True) at '
        f"start-up, or give the leaf a 32-bit dtype that holds its values."
    )


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
                "np.full((batch_size,), value). A list of numbers is one array-like leaf; "
                "tuples and dicts are containers, so a tuple of numbers gives scalar leaves."
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


def _place(topology: Topology, arrays: list[Any]) -> list[jax.Array]:
    """Slice i of each (N, ...) array lands on device i, and only there.

    Host arrays go through `jmirror._shim.put_rows`, one C++ call per leaf that copies each
    row to its device (the least host time per batch, which is what the input pipeline costs
    while the step keeps the cores busy); arrays already on devices go through one
    `jax.device_put`.
    """
    sharding = topology.stacked
    return [
        put_rows(x, sharding) if isinstance(x, np.ndarray) else jax.device_put(x, sharding)
        for x in arrays
    ]


class _PairError(TypeError, AttributeError):
    """A `(batch, mask)` pair used as a batch: a TypeError that `hasattr` still answers."""


_PAIR_FIX = (
    "with remainder='pad', every element of strategy.distribute_dataset is a (batch, mask) "
    "pair, not a batch. Unpack it, `for batch, mask in data:` (or `batch, mask = element`), "
    "and use `batch`; or pass remainder='drop' to get batches alone."
)


class PaddedBatch(NamedTuple):
    """An element of `distribute_dataset(..., remainder="pad")`: a `(batch, mask)` pair.

    A tuple (it unpacks, and JAX takes it as a pytree node, like any namedtuple); indexing it
    with a key or asking it for a batch's attribute raises a `TypeError` that says to unpack it.

    Example:
        >>> import numpy as np, jmirror as jm
        >>> strategy = jm.MirroredStrategy()
        >>> n = strategy.num_replicas
        >>> (element,) = strategy.distribute_dataset([{"image": np.zeros((n, 2))}])
        >>> batch, mask = element
        >>> batch.values["image"].shape == (n, 1, 2)
        True
        >>> try:
        ...     element["image"]
        ... except TypeError as e:
        ...     print(e)
        element['image']: with remainder='pad', every element of ... a (batch, mask) pair, ...
    """

    batch: Any
    mask: Any

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, str):
            raise _PairError(f"element[{index!r}]: {_PAIR_FIX}")
        return tuple.__getitem__(self, index)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # protocol probes (numpy, copy, IPython) get the usual answer
            raise AttributeError(f"'PaddedBatch' object has no attribute {name!r}")
        raise _PairError(f"element.{name}: {_PAIR_FIX}")


def _global_batches(
    topology: Topology, source: _Source, remainder: str, control: Control, skip: int
) -> Iterator[Any]:
    """Yields placed global batches (`PerReplica`, or `PaddedBatch` for "pad"), positioned."""
    pulled = source.pull(control)
    try:
        yield from _split_batches(topology, pulled, remainder, control, skip)
    finally:
        pulled.close()


def _global_size(call: str, n: int, size: int, remainder: str) -> tuple[int, _Warning | None]:
    """G from the first batch's size, and the warning that "drop" gives when size < G."""
    if size == 0:
        raise ValueError(
            f"{call}: the first batch has 0 examples, so there is no global batch size "
            "to infer; the first batch sets G. Skip empty batches in the source."
        )
    g = -(-size // n) * n
    if remainder != "drop" or size == g:
        return g, None
    return g, _Warning(
        f"{call}(remainder='drop'): the first batch has {size} examples, not a "
        f"multiple of the {n} replicas, so the global batch size is G={g} and every "
        f"batch of {size} examples is incomplete and will be dropped. Use a global "
        f"batch size divisible by {n}, or remainder='pad'."
    )


def _split_batches(
    topology: Topology,
    pulled: Iterator[Any],
    remainder: str,
    control: Control,
    skip: int,
) -> Iterator[Any]:
    """Splits and places each batch; the first `skip` are only counted (the first sets G)."""
    call = _DATASET_CALL
    n = topology.num_replicas
    g = 0
    first = 0
    index = -1
    for index, batch in enumerate(pulled):
        if index < skip:  # received before: neither converted nor placed
            if index == 0:
                flat, _ = _flatten(batch)
                first = _leading_size(call, batch, index, flat)
                g, warning = _global_size(call, n, first, remainder)
                if warning is not None:
                    yield warning
            continue
        flat, treedef = _flatten(batch)
        where = f"batch {index}"
        leaves = [_as_array(call, where, batch, x, i, "batch") for i, x in enumerate(flat)]
        size = _leading_size(call, batch, index, leaves)
        if index == 0:
            first = size
            g, warning = _global_size(call, n, size, remainder)
            if warning is not None:
                yield warning
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
            placed = _place(topology, arrays)
            yield _Positioned(PerReplica(treedef.unflatten(placed)), index + 1)
        else:
            placed = _place(topology, arrays + [mask])
            pair = PaddedBatch(PerReplica(treedef.unflatten(placed[:-1])), PerReplica(placed[-1]))
            yield _Positioned(pair, index + 1)
    if index + 1 < skip and not control.stopped.is_set():
        raise ValueError(
            f"{call}(start=...): the position says {skip} batches were received, but the source "
            f"has only {index + 1}. Resume with a source that yields the same batches as the "
            "one the position was taken from."
        )


def _dealt_batches(topology: Topology, source: _Source, control: Control) -> Iterator[Any]:
    """Yields placed `PerReplica` batches, dealing N consecutive elements to replicas 0..N-1.

    With several processes each process's pipeline deals its own `num_local_replicas`
    elements per step to its own replicas.
    """
    n = topology.num_local_replicas
    group: list[Any] = []
    step = 0
    pulled = source.pull(control)
    try:
        for element in pulled:
            group.append(element)
            if len(group) == n:
                yield _stack_group(topology, group, step)
                group = []
                step += 1
    finally:
        pulled.close()
    if group and not control.stopped.is_set():
        yield _Warning(
            f"{_FUNCTION_CALL}: the dataset function's elements ran out after {len(group)} of "
            f"the {n} per-replica batches of the last step, so those {len(group)} per-replica "
            f"batch(es) were dropped. Make the number of elements a multiple of {n} (for "
            "example, repeat or pad the dataset) to use them."
        )


def _stack_group(topology: Topology, group: list[Any], step: int) -> PerReplica:
    call = _FUNCTION_CALL
    flats = []
    treedef = _flatten(group[0])[1]
    for replica, element in enumerate(group):
        flat, structure = _flatten(element)
        if structure != treedef:
            raise ValueError(
                f"{call}: at step {step} the element for replica {replica} has structure "
                f"{structure}, but replica 0's has {treedef}; every element must have the same "
                "pytree structure."
            )
        where = f"replica {replica}'s element at step {step}"
        flats.append(
            [
                np.asarray(_as_array(call, where, element, x, i, "element"))
                for i, x in enumerate(flat)
            ]
        )
    stacked = []
    for i, parts in enumerate(zip(*flats, strict=False)):
        for replica, part in enumerate(parts):
            if part.shape != parts[0].shape or part.dtype != parts[0].dtype:
                path = _leaf_path(group[0], i, "element")
                raise ValueError(
                    f"{call}: at step {step} leaf {path} of replica {replica}'s element has "
                    f"shape {part.shape} and dtype {part.dtype}, but replica 0's has "
                    f"{parts[0].shape} and {parts[0].dtype}; the N elements of one step must "
                    "share shapes and dtypes. Batch the dataset with drop_remainder, or pad it."
                )
        stacked.append(np.stack(parts))
    if topology.process_count > 1:
        shape = lambda x: (topology.num_replicas,) + x.shape[1:]  # noqa: E731
        placed = [
            jax.make_array_from_process_local_data(topology.stacked, x, shape(x)) for x in stacked
        ]
        return PerReplica(treedef.unflatten(placed))
    return PerReplica(treedef.unflatten(_place(topology, stacked)))


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
        open_elements: Callable[[Control, int], Iterator[Any]],
        prefetch: int,
        call: str,
        topology: Topology,
        *,
        start: int | None = None,
        source: str = "the source",
        agree: Agree | None = None,
    ):
        # open_elements(control, skip) opens one pass; `start` is None for streams without a
        # position, else the number of batches the first pass skips (later passes skip none).
        self._open_elements = open_elements
        self._prefetch = prefetch
        self._call = call
        self._start = start
        self._source = source
        # On host devices the step's compute shares the cores: see jmirror._prefetch.
        self._low_priority = topology.devices[0].platform == "cpu"
        self._agree = agree
        self._iterators: weakref.WeakSet[DistributedIterator] = weakref.WeakSet()

    def __iter__(self) -> DistributedIterator:
        control = Control()
        start = self._start
        if start is not None:
            self._start = 0  # `start` applies to the first pass only
        iterator = DistributedIterator(
            self._open_elements(control, start or 0),
            self._prefetch,
            self._low_priority,
            control,
            position=start,
            source=self._source,
            agree=self._agree,
        )
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


# --- several processes ---------------------------------------------------------------------------


def _agreement(topology: Topology) -> Agree | None:
    """With several processes, `agree(state)`: every process's state for the next step.

    Each process puts its state on its first device as its row of a `(P,)` array over one
    device per process; one compiled all-gather (gloo on CPU) gives every process every row.
    One device per process, not all N: on 2 processes x 4 host devices an all-gather over all
    8 took about 5.5 ms, over 2 about 0.5 ms (benchmarks/RESULTS.md). None for one process.
    """
    if topology.process_count == 1:
        return None
    firsts: dict[int, Any] = {}
    for device in topology.devices:
        firsts.setdefault(device.process_index, device)
    order = sorted(firsts)
    mesh = Mesh(np.array([firsts[p] for p in order]), ("process",))
    rows, gather = NamedSharding(mesh, P("process")), _all_gather(NamedSharding(mesh, P()))
    shape = (len(order),)

    def agree(state: int) -> list[int]:
        mine = jax.make_array_from_process_local_data(rows, np.array([state], np.int32), shape)
        (copy,) = gather(mine).addressable_shards
        return np.asarray(copy.data).tolist()  # process indices are 0 to P - 1, in order

    return agree


@functools.cache
def _all_gather(everywhere: NamedSharding) -> Callable[[jax.Array], jax.Array]:
    return jax.jit(lambda x: x, out_shardings=everywhere)


# --- entry points --------------------------------------------------------------------------------


def distribute_dataset(
    topology: Topology,
    dataset: Any,
    *,
    remainder: str = "pad",
    prefetch: int = 2,
    start: Mapping[str, Any] | None = None,
) -> DistributedDataset:
    """Splits each global batch of `dataset` into per-replica shards on the devices.

    Args:
      topology: the strategy's `Topology`: the devices that receive the batches.
      dataset: an iterable of global batches (pytrees of array-likes with one common leading
        batch size), or a zero-argument callable returning one, called again per pass. A
        leaf is a numpy array, a `jax.Array` or a list of numbers (nested lists of the same
        length for more dimensions); tuples and dicts are containers.
      remainder: what to do with an incomplete batch (fewer than G examples, where G is the
        first batch's size rounded up to a multiple of N): `"pad"` pads it with zeros and
        yields `(batch, mask)` for every batch; `"drop"` skips it; `"error"` raises.
      prefetch: how many batches a background thread keeps on the devices ahead of the
        consumer; 0 runs synchronously, without a thread.
      start: `None`, or the `.position` of an iterator of an earlier dataset over the same
        batches (JSON round trips keep it valid): the first pass then yields exactly the
        batches that iterator had not returned, skipping the others without converting or
        placing them. `dataset` may be a new object (in a new process) yielding the same
        batches: a callable or a re-iterable. Later passes start at their beginning.

    Returns:
      A `DistributedDataset` yielding `jm.PerReplica` batches (leaves of shape
      `(N, G/N, ...)`), or `(batch, mask)` pairs for `"pad"`, with `mask` a `PerReplica` of
      bools of shape `(N, G/N)`, True exactly on the real examples. Its iterators have
      `.position`. With several processes each process passes its own source of global
      batches and places its own rows; a pass ends on every process at the step where the
      first process's source ends (a `UserWarning` names it when others had more).

    Raises:
      RuntimeError: with several processes, while iterating, when another process's source
        raised (every process stops at that step).
      ValueError: for an invalid `remainder`, `prefetch < 0` or `start`; while iterating, for
        a batch larger than G, leaves of different leading sizes, an incomplete batch with
        `"error"`, a 64-bit integer leaf whose values do not fit 32 bits while 64-bit types
        are off, or a source shorter than `start`.
      TypeError: when `dataset` is neither iterable nor callable, `prefetch` is not an int,
        or `start` is not a position dict; while iterating, for a leaf that is not numbers
        (strings, datetimes, objects, ragged lists).

    Example:
        >>> import numpy as np, jmirror as jm
        >>> strategy = jm.MirroredStrategy()
        >>> n = strategy.num_replicas
        >>> batches = [np.arange(4 * n), np.arange(n)]  # the second one is incomplete
        >>> masks = [mask for _, mask in strategy.distribute_dataset(batches)]
        >>> [int(np.sum(strategy.gather(m))) for m in masks] == [4 * n, n]
        True

        Resuming where an iterator stood:

        >>> it = iter(strategy.distribute_dataset(batches))
        >>> _ = next(it)
        >>> rest = strategy.distribute_dataset(batches, start=it.position)
        >>> [int(np.sum(strategy.gather(m))) for _, m in rest] == [n]
        True
    """
    if remainder not in _REMAINDERS:
        raise ValueError(
            f"{_DATASET_CALL}(remainder={remainder!r}) is not a valid remainder; expected one "
            f"of {_REMAINDERS}: 'pad' (pad and yield a mask), 'drop' (skip incomplete batches) "
            "or 'error' (raise on an incomplete batch)."
        )
    prefetch = _check_prefetch(_DATASET_CALL, prefetch)
    skip = _check_start(start)
    source = _source(_DATASET_CALL, dataset)
    return DistributedDataset(
        lambda control, skip: _global_batches(topology, source, remainder, control, skip),
        prefetch,
        _DATASET_CALL,
        topology,
        start=skip,
        source=source.describe(),
        agree=_agreement(topology),
    )


def _check_start(start: Any) -> int:
    """The number of batches a valid `start` position says were received (0 for None)."""
    call = _DATASET_CALL
    if start is None:
        return 0
    example = position_dict(0)
    if not isinstance(start, Mapping):
        raise TypeError(
            f"{call}(start=...) expects None or a position dict taken from an iterator's "
            f"`.position` (like {example}), got {type(start).__name__}: {reprlib.repr(start)}."
        )
    if start.get("format") != POSITION_FORMAT:
        raise ValueError(
            f"{call}(start={reprlib.repr(start)}) is not a jmirror input position: expected "
            f"the dict an iterator's `.position` gives, like {example}."
        )
    version = start.get("version")
    if version != POSITION_VERSION:
        raise ValueError(
            f"{call}(start=...) is a position of format version {version!r}, but this "
            f"jmirror reads version {POSITION_VERSION}; take the position with the jmirror "
            "version that resumes it."
        )
    batches = start.get("batches")
    if isinstance(batches, bool) or not isinstance(batches, int) or batches < 0:
        raise ValueError(
            f"{call}(start=...): the position's 'batches' must be an int >= 0 (the global "
            f"batches received), got {batches!r}. Pass `.position` unchanged."
        )
    return batches


def distribute_datasets_from_function(
    topology: Topology, dataset_fn: Callable[[InputContext], Any], *, prefetch: int = 2
) -> DistributedDataset:
    """Deals the per-replica batches of `dataset_fn(jm.InputContext(...))` to the replicas.

    `dataset_fn` is called with `InputContext(1, 0, N)` at the start of every pass. Its
    elements are per-replica batches: N consecutive elements form one step, element i going to
    replica i, stacked into one `jm.PerReplica`. A final group of fewer than N elements is
    dropped with a `UserWarning`. With several processes it is called on each process with
    `InputContext(num_processes, process_index, N)` and deals `num_local_replicas` elements
    per step to this process's replicas; a pass ends on every process at the step where the
    first process's pipeline ends (a `UserWarning` names it when others had more).

    Args:
      topology: the strategy's `Topology`: the devices that receive the batches.
      dataset_fn: a function of a `jm.InputContext` returning an iterable of per-replica
        batches (pytrees of array-likes; the N elements of a step share shapes).
      prefetch: how many steps a background thread keeps on the devices ahead of the
        consumer; 0 runs synchronously, without a thread.

    Returns:
      A `DistributedDataset` yielding one `jm.PerReplica` per step. Its iterators have no
      `.position` (an `AttributeError` says so): resume such input in `dataset_fn`.

    Raises:
      RuntimeError: with several processes, while iterating, when another process's
        `dataset_fn` or its elements raised (every process stops at that step).
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
        num_input_pipelines=topology.process_count,
        input_pipeline_id=topology.process_index,
        num_replicas_in_sync=topology.num_replicas,
    )
    source = _Source(_FUNCTION_CALL, lambda: dataset_fn(context), dataset_fn)
    return DistributedDataset(
        lambda control, skip: _dealt_batches(topology, source, control),
        prefetch,
        _FUNCTION_CALL,
        topology,
        source=source.describe(),
        agree=_agreement(topology),
    )
