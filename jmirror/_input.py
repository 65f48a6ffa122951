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
- Position: iterators count the source batches up to and including the last one they
  returned (steps, for `distribute_datasets_from_function`) and record G and how the data
  was split over processes (`.position`, a JSON-able dict). When the source's iterator has
  `get_state()` and `set_state()` (see `jmirror._source_state`), the position also holds its
  state as of that batch, and `start=` gives it to the new iterator's `set_state`: nothing
  is read again. Otherwise `start=` pulls and skips that many source batches on the first
  pass, neither converting nor placing them (only a position without G, or with a G this
  run's N does not divide, has the first looked at for its leading size). A source shorter
  than the position is a `ValueError`. Batches are counted, never examples, so a position
  stays valid on another replica count when the global batch size does not change.
- Several processes: each process iterates its own source (its rows of each global batch,
  its share with `process_local=True`, or its own pipeline's elements). Uneven input never
  hangs: before each step the processes agree whether every one of them has a batch (see
  `jmirror._prefetch`), so when one process's source ends first every process's pass ends
  at that same step, with a `UserWarning` naming the processes that ran short and those
  whose batches go unused; when one process's source raises, that process gets its error
  and the others a `RuntimeError` naming it, at the same step. Positions are per process
  (each counts its own source's batches). One process agrees with nobody and pays nothing
  for it.
- Process-local shares: each process's source yields its G/P rows of each global batch;
  this process's replicas (a contiguous block of the N, in process order) receive them
  with `jax.make_array_from_process_local_data`, so no process reads or holds another's
  rows. A short share is padded at its end (under "pad": the mask is False there, at the
  end of that process's block); under "drop" it is placed like the others and marked, and
  the processes' agreement drops that step on every process alike (it still counts in the
  position). On the first step the processes also agree on their shares' size: different
  sizes would make different global batches, a `ValueError` naming each process's. At every
  step they compare their batches' layouts (structure, dtypes, shapes beyond the rows; a
  function's elements whole): a difference is a `ValueError` on every process at that step.
- A position counts global batches (`distribute_dataset`) or steps of per-replica elements
  (`distribute_datasets_from_function`, marked `"counts": "steps"`); each entry point refuses
  the other's. A process-local position resumed on another process count whose source still
  yields the saved run's shares gets a `UserWarning`: the position's G is kept, so each such
  batch would be padded or dropped.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import reprlib
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jmirror import _deadline, _shim, _step_stats
from jmirror._batches import (
    DATASET_CALL,
    FUNCTION_CALL,
    dealt_batches,
    global_batches,
    shares_of,
)
from jmirror._prefetch import (
    POSITION_FORMAT,
    POSITION_VERSIONS,
    Agree,
    Control,
    DistributedIterator,
    Position,
)
from jmirror._source import Source, open_source
from jmirror._source_state import read_public
from jmirror._topology import Topology
from jmirror._values import PyTree

_REMAINDERS = ("pad", "drop", "error")
_DATASET_CALL = DATASET_CALL
_FUNCTION_CALL = FUNCTION_CALL


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


def _check_prefetch(call: str, prefetch: object) -> int:
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
        open_elements: Callable[[Control, Position | None], Iterator[Any]],
        prefetch: int,
        call: str,
        topology: Topology,
        *,
        start: Position | None = None,
        process_local: bool = False,
        steps: bool = False,
        source: str = "the source",
        agree: Agree | None = None,
        stats: _step_stats.Recorder | None = None,
        name: str = "",
    ):
        # open_elements(control, start) opens one pass, resumed at `start` (the first pass
        # only; later passes start at their beginning).
        self._open_elements = open_elements
        self._prefetch = prefetch
        self._call = call
        self._start = start
        self._fresh = Position(0, None, topology.process_count, process_local, steps=steps)
        self._source = source
        # On host devices the step's compute shares the cores: see jmirror._prefetch.
        self._low_priority = topology.devices[0].platform == "cpu"
        self._agree = agree
        self._iterators: weakref.WeakSet[DistributedIterator] = weakref.WeakSet()
        # Where the time goes (jmirror._step_stats): this dataset's row, its waits for batches.
        self._row = None if stats is None else stats.row(self, name, _step_stats.DATASET)

    def __iter__(self) -> DistributedIterator:
        control = Control()
        start, self._start = self._start, None  # `start` applies to the first pass only
        row = self._row
        iterator = (DistributedIterator if row is None else functools.partial(_Counted, row))(
            self._open_elements(control, start),
            self._prefetch,
            self._low_priority,
            control,
            position=start or self._fresh,
            call=self._call,
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

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{self._call}(prefetch={self._prefetch})>"


class _Counted(DistributedIterator):
    """A pass whose waits for batches count in its dataset's row (`strategy.step_stats()`)."""

    def __init__(self, row: Any, *args: PyTree, **kwargs: PyTree):
        super().__init__(*args, **kwargs)
        self._row = row

    def __next__(self) -> PyTree:
        began = _step_stats.clock()  # where the time goes: the loop waits for a batch here
        try:
            batch = super().__next__()
        except StopIteration:
            self._row.waited_for_batch(began, 0)
            raise
        self._row.waited_for_batch(began, 1)
        return batch


# --- several processes ---------------------------------------------------------------------------


def _agreement(topology: Topology) -> Agree | None:
    """With several processes, `agree(values)`: every process's values for the next step
    (`jmirror._prefetch.Agree`).

    Each process puts its values on its first device as its row of a `(P, 3)` array over one
    device per process; one compiled all-gather (gloo on CPU) gives every process every row.
    One device per process, not all N: on 2 processes x 4 host devices an all-gather over all
    8 took about 5.5 ms, over 2 about 0.5 ms (benchmarks/RESULTS.md). None for one process.
    """
    if topology.process_count == 1:
        return None
    return _Agreement(topology)


class _Agreement:
    """`jmirror._prefetch.Agree` over several processes (see `_agreement`)."""

    def __init__(self, topology: Topology):
        firsts: dict[int, Any] = {}
        for device in topology.devices:
            firsts.setdefault(device.process_index, device)
        order = sorted(firsts)
        mesh = Mesh(np.array([firsts[p] for p in order]), ("process",))
        self._rows = NamedSharding(mesh, P("process"))
        self._gather = _all_gather(NamedSharding(mesh, P()))
        self._shape = (len(order),)
        self._timeout_s = topology.timeout_s

    def __call__(self, values: tuple[int, int, int]) -> list[list[int]]:
        local = np.array([values], np.int32)
        mine = jax.make_array_from_process_local_data(
            self._rows, local, self._shape + local.shape[1:]
        )
        # Bounded from the dispatch (this small program runs inline on XLA:CPU, waiting for
        # the others there); the first call's compilation is not counted.
        with _deadline.bounded(_AGREEMENT, self._timeout_s):
            (copy,) = self._gather(mine).addressable_shards
            return np.asarray(copy.data).tolist()  # process indices are 0 to P - 1, in order

    def exchange(self, entries: list[list[str]]) -> list[list[list[str]]] | None:
        """Returns every process's `entries` through JAX's coordination service (the detail
        of an error: None when the service or a process does not answer within a few s)."""
        client = _shim.distributed_client()
        if client is None:
            return None
        # Every process exchanges at the same point of the same program: the n-th exchange
        # is the same on every process.
        key = f"jmirror/input_leaves/{next(_EXCHANGES)}"
        count, me = jax.process_count(), jax.process_index()
        ends = time.monotonic() + _EXCHANGE_S
        try:
            client.key_value_set(f"{key}/{me}", json.dumps(entries), True)
            found = []
            for p in range(count):
                left_ms = max(1, int((ends - time.monotonic()) * 1000))
                found.append(json.loads(client.blocking_key_value_get(f"{key}/{p}", left_ms)))
        except Exception:  # noqa: BLE001 - only the error's detail is lost
            return None
        return found


# How long an error waits for the other processes' leaves to name the ones that differ.
_EXCHANGE_S = 10.0
_EXCHANGES = itertools.count()


_AGREEMENT = "the input agreement (does every process have a batch for the next step?)"


@functools.cache
def _all_gather(everywhere: NamedSharding) -> Callable[[jax.Array], jax.Array]:
    return jax.jit(lambda x: x, out_shardings=everywhere)


# --- entry points --------------------------------------------------------------------------------


def distribute_dataset(
    topology: Topology,
    dataset: object,
    *,
    remainder: str = "pad",
    prefetch: int = 2,
    start: Mapping[str, Any] | None = None,
    process_local: bool = False,
    stats: _step_stats.Recorder | None = None,
) -> DistributedDataset:
    """Splits each global batch of `dataset` into per-replica shards on the devices.

    Args:
      topology: the strategy's `Topology`: the devices that receive the batches.
      dataset: an iterable of global batches (pytrees of array-likes with one common leading
        batch size), or a zero-argument callable returning one, called again per pass. A
        leaf is a numpy array, a `jax.Array` or a list of numbers (nested lists of the same
        length for more dimensions); tuples and dicts are containers. With `process_local`,
        an iterable of this process's shares of the global batches instead.
      remainder: what to do with an incomplete batch (fewer than G examples, where G is the
        first batch's size rounded up to a multiple of N): `"pad"` pads it with zeros and
        yields `(batch, mask)` for every batch; `"drop"` skips it; `"error"` raises. With
        `process_local`, it applies to each share (G/P rows): a short share is padded at its
        end, or dropped on every process alike.
      prefetch: how many batches a background thread keeps on the devices ahead of the
        consumer; 0 runs synchronously, without a thread.
      start: `None`, or the `.position` of an iterator of an earlier dataset over the same
        batches (JSON round trips keep it valid): the first pass then yields exactly the
        batches that iterator had not returned. A source whose iterator has `get_state()`
        and `set_state()` (grain's, or any) is given the saved state and reads nothing
        again; any other one is read that far, the batches received skipped without being
        converted or placed. `dataset` may be a new object (in a new process) yielding the
        same batches: a callable or a re-iterable. Later passes start at their beginning.
      process_local: with several processes, whether each process's `dataset` yields only
        its own share of each global batch: G/P rows, in process order (what grain's
        `ShardByJaxProcess` with a per-process batch of G/P yields). One global batch is
        assembled from the shares without any process reading another's rows. With one
        process it is a global source.
        batches that iterator had not returned, skipping the others without converting or
        placing them. `dataset` may be a new object (in a new process) yielding the same
        batches: a callable or a re-iterable. Later passes start at their beginning.
      stats: the strategy's counts of where the time goes, where the waits for batches
        count (None: not counted).

    Returns:
      A `DistributedDataset` yielding `jm.PerReplica` batches (leaves of shape
      `(N, G/N, ...)`), or `(batch, mask)` pairs for `"pad"`, with `mask` a `PerReplica` of
      bools of shape `(N, G/N)`, True exactly on the real examples. Its iterators have
      `.position`. With several processes each process passes its own source (of global
      batches, or of its shares with `process_local`) and places its own rows; a pass ends
      on every process at the step where the first process's source ends (a `UserWarning`
      names it when others had more).

    Raises:
      RuntimeError: with several processes, while iterating, when another process's source
        raised (every process stops at that step).
      ValueError: for an invalid `remainder`, `prefetch < 0` or `start`; for
        `process_local` over replicas that are not one block per process; while iterating,
        for a batch (share) larger than G (G/P), leaves of different leading sizes, an
        incomplete batch with `"error"`, a 64-bit integer leaf whose values do not fit 32
        bits while 64-bit types are off, a source shorter than `start`, processes whose
        first shares differ, or, before the first batch, a saved source state of a
        process-local source on another process count that the source cannot move to.
      TypeError: when `dataset` is neither iterable nor callable, `prefetch` is not an int,
        `process_local` not a bool, or `start` is not a position dict; while iterating, for
        a leaf that is not numbers (strings, datetimes, objects, ragged lists).

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
    if not isinstance(process_local, bool):
        raise TypeError(
            f"{_DATASET_CALL}(process_local=...) expects True (each process's source yields "
            "its share of each global batch) or False (global batches), got "
            f"{process_local!r} of type {type(process_local).__name__}."
        )
    position = _check_start(_DATASET_CALL, start)
    shares = shares_of(_DATASET_CALL, topology, process_local)
    source = open_source(_DATASET_CALL, dataset)
    return DistributedDataset(
        lambda control, start: global_batches(topology, source, remainder, control, start, shares),
        prefetch,
        _DATASET_CALL,
        topology,
        start=position,
        process_local=shares.is_local,
        source=source.describe(),
        agree=_agreement(topology),
        stats=stats,
        name=f"distribute_dataset({_short_name(dataset)})",
    )


def _short_name(source: object) -> str:
    """Returns a source as a row of `strategy.step_stats()` names it: its name, else its type's."""
    name = getattr(source, "__name__", None)
    return name if isinstance(name, str) else type(source).__name__


_POSITION_EXAMPLE = (
    "{'format': 'jmirror.input', 'version': 2, 'batches': 3, 'global_batch_size': 64, ...}"
)


def _check_start(call: str, start: object) -> Position | None:
    """Returns the `Position` a valid `start` describes (None: None, or a position at its start)."""
    if start is None:
        return None
    if not isinstance(start, Mapping):
        raise TypeError(
            f"{call}(start=...) expects None or a position dict taken from an iterator's "
            f"`.position` (like {_POSITION_EXAMPLE}), got {type(start).__name__}: "
            f"{reprlib.repr(start)}."
        )
    if start.get("format") != POSITION_FORMAT:
        raise ValueError(
            f"{call}(start={reprlib.repr(start)}) is not a jmirror input position: expected "
            f"the dict an iterator's `.position` gives, like {_POSITION_EXAMPLE}."
        )
    version = start.get("version")
    if version not in POSITION_VERSIONS:
        raise ValueError(
            f"{call}(start=...) is a position of format version {version!r}, but this "
            f"jmirror reads versions {', '.join(map(str, POSITION_VERSIONS))}; take the "
            "position with the jmirror version that resumes it."
        )
    batches = _count(call, start, "batches", "the global batches received")
    g = start.get("global_batch_size")
    if g is not None:
        g = _count(call, start, "global_batch_size", "the global batch size")
    processes = _count(call, {"processes": 1, **start}, "processes", "the process count", 1)
    process_local = start.get("process_local", False)
    if not isinstance(process_local, bool):
        raise ValueError(
            f"{call}(start=...): the position's 'process_local' must be a bool, got "
            f"{process_local!r}. Pass `.position` unchanged."
        )
    steps = _check_counts(call, start, g)
    state = start.get("source_state")
    return Position(
        batches,
        g or None,
        processes,
        process_local,
        None if state is None else read_public(call, state),
        steps,
    )


def _check_counts(call: str, start: Mapping[str, Any], g: int | None) -> bool:
    """Returns whether a position for `call` counts steps (`distribute_datasets_from_function`),
    refusing a position of the other kind: one counts global batches of G, the other steps of
    per-replica elements, and each would skip the wrong number."""
    counts = start.get("counts", "batches")
    if counts not in ("batches", "steps"):
        raise ValueError(
            f"{call}(start=...): the position's 'counts' must be 'steps' or absent, got "
            f"{counts!r}. Pass `.position` unchanged."
        )
    steps = call == _FUNCTION_CALL
    if steps and g is not None:
        raise ValueError(
            f"{call}(start=...): this position was taken from a strategy.distribute_dataset "
            f"iterator (it counts global batches of G={g}); a dataset function's pipelines "
            "count steps of per-replica elements. Resume this pipeline from the position of "
            "its own iterator (distribute_datasets_from_function's `.position`)."
        )
    if not steps and counts == "steps":
        raise ValueError(
            f"{call}(start=...): this position was taken from a "
            "strategy.distribute_datasets_from_function iterator (it counts steps of "
            "per-replica elements); a global source counts its global batches. Resume this "
            "source from the position of its own iterator (distribute_dataset's `.position`)."
        )
    return steps


def _count(call: str, start: Mapping[str, Any], key: str, meaning: str, least: int = 0) -> int:
    value = start.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(
            f"{call}(start=...): the position's {key!r} must be an int >= {least} ({meaning}), got "
            f"{value!r}. Pass `.position` unchanged (a JSON round trip keeps it valid)."
        )
    return value


def distribute_datasets_from_function(
    topology: Topology,
    dataset_fn: Callable[[InputContext], Any],
    *,
    prefetch: int = 2,
    start: Mapping[str, Any] | None = None,
    stats: _step_stats.Recorder | None = None,
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
      start: `None`, or the `.position` of an iterator of an earlier dataset over the same
        pipeline (per process, with several): the first pass resumes after the steps that
        iterator had returned, giving the pipeline's iterator its saved state when it has
        `get_state()` and `set_state()`, else reading and skipping `num_local_replicas`
        elements per step received.
      stats: the strategy's counts of where the time goes, where the waits for batches
        count (None: not counted).

    Returns:
      A `DistributedDataset` yielding one `jm.PerReplica` per step. Its iterators have
      `.position`, which counts steps (and holds the pipeline's own state, when it has one).

    Raises:
      RuntimeError: with several processes, while iterating, when another process's
        `dataset_fn` or its elements raised (every process stops at that step).
      ValueError: for `prefetch < 0` or an invalid `start`; while iterating, when the
        elements of a step differ in structure, shape or dtype, when the pipeline is shorter
        than `start`, or, before the first step, for a saved pipeline state from another
        process count that the pipeline cannot move to.
      TypeError: when `dataset_fn` is not callable, `prefetch` is not an int or `start` not
        a position dict.

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
    position = _check_start(_FUNCTION_CALL, start)
    context = InputContext(
        num_input_pipelines=topology.process_count,
        input_pipeline_id=topology.process_index,
        num_replicas_in_sync=topology.num_replicas,
    )
    source = Source(_FUNCTION_CALL, lambda: dataset_fn(context), dataset_fn)
    return DistributedDataset(
        lambda control, start: dealt_batches(topology, source, control, start),
        prefetch,
        _FUNCTION_CALL,
        topology,
        start=position,
        process_local=topology.process_count > 1,
        steps=True,
        source=source.describe(),
        agree=_agreement(topology),
        stats=stats,
        name=f"distribute_datasets_from_function({_short_name(dataset_fn)})",
    )
