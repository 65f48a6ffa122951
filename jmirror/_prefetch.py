"""Iterating placed batches: one pass, optionally prefetched by a background thread.

`DistributedIterator` runs one pass over the placed batches that `jmirror._input` produces.
With `prefetch=k > 0`, a daemon thread keeps at most k batches transferred
(`block_until_ready`) ahead of the consumer; those never taken are discarded on `close()`
(lost to the next pass of a one-shot iterator source). A `_Warning` in the stream is emitted
in the consuming thread when the consumer reaches it.

On XLA:CPU host devices the step's compute threads and the prefetch thread share the host's
cores, and at every collective all replicas wait for the slowest device thread: input work that
preempts one of them holds up the whole step. There the prefetch thread (and the source code
it runs) takes the lowest CPU priority, niceness 19 (Linux; elsewhere it is left as is), so it
runs in the gaps the step leaves (measured in benchmarks/RESULTS.md). Threads and processes the
source starts from that thread inherit the niceness, as Linux does. On accelerators the step
does not run on the host's cores, and the thread keeps its priority.

Clean-up never waits for a blocked source. A thread blocked inside the source's own `next()`
cannot be interrupted, so `close()`, garbage collection, a `break` and interpreter exit set
the pass's `Control.stopped` and wait for the thread while it runs jmirror's own code (placing
a batch, which is bounded); while it is inside the source (`Control.in_source`) they wait at
most `_SOURCE_GRACE_S` (0.2 s, for a fast source call to return, so that no thread outlives a
stop after it) and then return. The thread, a daemon, asks the source for nothing more,
closes the iterator jmirror opened, and ends when the blocked call returns. A watcher thread
warns (`ResourceWarning`, naming the source) if it has not ended `STALLED_SOURCE_WARNING_S`
seconds after the stop; the watcher ends as soon as the thread does, or after warning.

Several processes: each process's pass pulls its own source, and a replicated step waits for
every process, so a process whose source ended first must not leave the others waiting alone
in the step's collective. Before returning each batch (and before ending), the consumer asks
`agree` (given by `jmirror._input`) what every process has: `HAS_BATCH`, `ENDED` or `FAILED`.
The batch is returned only when every process has one; otherwise every process ends its pass
at that same step, raising its own error (`FAILED` here) or a `RuntimeError` naming the
process that failed (`FAILED` elsewhere), or stopping, with a `UserWarning` naming the
processes that ran short when others still had batches. The question is asked in the
consumer's thread, where the steps are dispatched, never in the prefetch thread: collectives
issued from two threads at once may pair differently on each process. One process has no
`agree` and asks nothing. With process-local shares (see `jmirror._input`) a process may
answer `SHORT` (a batch whose share is incomplete under `remainder="drop"`): when every
process has a batch and any is `SHORT`, every process drops that step; on a pass's first
step the processes also agree on their shares' size. With each answer goes the signature of
the batch's `Layout` (structure, dtypes, shapes beyond the rows): batches that differ between
processes would make each process a different global array (XLA then aborts, or reads one
dtype's bytes as another's), so a difference ends the pass on every process with a
`ValueError` naming this process's layout.

Positions: each batch travels with the `Position` the consumer stands at once it has
received it, the source's own state included (taken in the thread that pulled the batch),
so `.position` never counts or holds a batch only prefetched.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import sys
import threading
import time
import warnings
import weakref
import zlib
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import jax

from jmirror._source_state import SourceState
from jmirror._values import PyTree, Structure


@dataclasses.dataclass(frozen=True)
class _Warning:
    """A warning for the consumer, emitted when it reaches this point of the stream."""

    message: str


@dataclasses.dataclass(frozen=True)
class Position:
    """Where a pass stands: what `.position` gives, and what `start=` resumes from.

    `batches` counts the source's batches up to the last one received (for a pass of
    `distribute_datasets_from_function`, its steps: `steps` is then True); `global_batch_size`
    is G, None until known; `processes` and `process_local` say how the source's data was
    split (each of the `processes` reading its own share, or every one the global batches);
    `state` is the source iterator's own state after that batch, when it has one.
    """

    batches: int
    global_batch_size: int | None = None
    processes: int = 1
    process_local: bool = False
    state: SourceState | None = None
    steps: bool = False

    def public(self, call: str) -> dict[str, Any]:
        """Returns the JSON-able dict a user saves; `TypeError` for a state that cannot be saved."""
        out: dict[str, Any] = {
            "format": POSITION_FORMAT,
            "version": POSITION_VERSION,
            "batches": self.batches,
            "global_batch_size": self.global_batch_size,
            "processes": self.processes,
            "process_local": self.process_local,
        }
        if self.steps:  # a function's pipelines: what `start=` of `distribute_dataset` refuses
            out["counts"] = "steps"
        if self.state is not None:
            out["source_state"] = self.state.public(call)
        return out


@dataclasses.dataclass(frozen=True)
class Layout:
    """What one step's batch must share with every other process's: its pytree structure and
    each leaf's dtype and shape (beyond the rows, for a batch or share).

    `leaves` describes each leaf as `dtype[shape]`; `what` names the batch ("share", "batch",
    "element"); `signature` is a 32-bit hash of the structure and leaves, what the processes
    compare at each step.
    """

    treedef: Structure
    leaves: tuple[str, ...]
    what: str
    signature: int

    @classmethod
    def of(cls, treedef: Structure, leaves: Sequence[Any], what: str, rows: bool) -> Layout:
        """Returns the layout of flat `leaves` of structure `treedef` (`rows`: the first axis is
        the batch's rows, which may differ between processes, and is shown as `rows`)."""
        described = tuple(
            f"{x.dtype}[{', '.join(['rows'] * rows + [str(d) for d in x.shape[rows:]])}]"
            for x in leaves
        )
        signature = zlib.crc32(f"{treedef}|{described}".encode()) - (1 << 31)  # an int32
        return cls(treedef, described, what, signature)

    def describe(self) -> str:
        """Returns each leaf's path, dtype and shape, as `batch['x']: float32[rows, 3]`."""
        return ", ".join(f"{path}: {leaf}" for path, leaf in self.entries())

    def entries(self) -> list[list[str]]:
        """Returns `[path, leaf]` per leaf, as `["batch['x']", "float32[rows, 3]"]`."""
        numbered = self.treedef.unflatten(range(len(self.leaves)))
        paths = jax.tree_util.tree_flatten_with_path(numbered)[0]
        return [
            [f"{self.what}{jax.tree_util.keystr(path)}", leaf]
            for (path, _), leaf in zip(paths, self.leaves, strict=True)
        ]


@dataclasses.dataclass(frozen=True)
class _Positioned:
    """A batch and the input position the consumer stands at once it has received it.

    Across processes: `incomplete` marks a process-local share that `remainder="drop"` drops
    on every process if any process's is incomplete; `share` is the rows of this process's
    share of G (process-local input only), which the processes compare on the first step
    they use; `layout`, with several processes, what every process's batch of the step must
    share.
    """

    value: PyTree
    position: Position
    incomplete: bool = False
    share: int | None = None
    layout: Layout | None = None


class Control:
    """What one pass shares between its consumer, its prefetch thread and its source.

    `stopped` is set when the pass is closed: the source is asked for nothing more after it.
    `in_source` is True while some thread runs the source's own code (opening it, `next()`,
    closing it), which nothing may wait on.
    """

    def __init__(self) -> None:
        self.stopped = threading.Event()
        self.in_source = False


_BACKGROUND_NICENESS = 19
# Seconds after a stop before a prefetch thread still blocked in the source is reported.
STALLED_SOURCE_WARNING_S = 10.0
# How often a stop looks again whether the thread is still busy with jmirror's own work.
_JOIN_POLL_S = 0.005
# How long a stop lets a source call in progress return (most do at once) before leaving the
# thread to end on its own: stops then leave no thread behind after a fast source.
_SOURCE_GRACE_S = 0.2


def _lower_priority() -> None:
    """Gives the calling thread the lowest CPU priority (Linux, where niceness is per thread)."""
    if sys.platform != "linux":
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _BACKGROUND_NICENESS)
    except OSError:  # a sandbox may forbid it: only speed is at stake, never results
        pass


def _produce(
    elements: Iterator[Any],
    results: queue.SimpleQueue,
    slots: queue.SimpleQueue,
    control: Control,
    low_priority: bool,
) -> None:
    """Runs the prefetch thread: one slot per element, each element on the devices before queued."""
    stopped = control.stopped
    if low_priority:
        _lower_priority()
    try:
        while True:
            slots.get()
            if stopped.is_set():
                return
            try:
                value = next(elements)
                if stopped.is_set():
                    return
                if isinstance(value, _Positioned):
                    jax.block_until_ready(value.value)
                elif not isinstance(value, _Warning):
                    jax.block_until_ready(value)
            except StopIteration:
                results.put(("end", None))
                return
            except BaseException as e:  # noqa: BLE001 - every error goes to the consumer
                if not stopped.is_set():
                    results.put(("error", e))
                return
            results.put(("item", value))
    finally:
        close = getattr(elements, "close", None)
        if callable(close):
            close()


def _watch(thread: threading.Thread, source: str, timeout: float) -> None:
    """Warns if the stopped prefetch `thread` is still blocked in `source` after `timeout` s."""
    thread.join(timeout)
    if thread.is_alive():
        warnings.warn(
            f"jmirror: the prefetch thread of {source} is still blocked inside the source "
            f"{timeout:g} s after its pass was closed. The thread is a daemon that asks the "
            "source for nothing more and ends when that call returns; until then it holds the "
            "source's resources. Give the source's reads a timeout, or make its next() return "
            "when your program stops it.",
            ResourceWarning,
            stacklevel=1,
        )


class _Prefetcher:
    """The prefetch thread and its queue; holds no reference to the iterator using it."""

    def __init__(
        self,
        elements: Iterator[Any],
        prefetch: int,
        low_priority: bool,
        control: Control,
        source: str,
    ):
        self._control = control
        self._source = source
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        # Free slots as tokens in a SimpleQueue, implemented in C: cheaper per batch than a
        # threading.Semaphore, written in Python (benchmarks/RESULTS.md).
        self._slots: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(prefetch):
            self._slots.put(None)
        self._thread = threading.Thread(
            target=_produce,
            args=(elements, self._results, self._slots, control, low_priority),
            name="jmirror-prefetch",
            daemon=True,
        )
        self._thread.start()

    def get(self) -> tuple[str, Any]:
        kind, value = self._results.get()
        self._slots.put(None)
        return kind, value

    def stop(self) -> None:
        """Stops the thread, waiting only while it runs jmirror's code, never the source's."""
        control, thread = self._control, self._thread
        control.stopped.set()
        self._slots.put(None)  # wakes the thread if it waits for a slot
        if threading.current_thread() is not thread:
            grace_ends = time.monotonic() + _SOURCE_GRACE_S
            while thread.is_alive():
                if control.in_source and time.monotonic() >= grace_ends:
                    break  # blocked in the source: the thread ends on its own
                thread.join(_JOIN_POLL_S)
            while not self._results.empty():  # drop prefetched batches now
                self._results.get_nowait()
            if thread.is_alive():
                self._watch()
        self._results.put(("closed", None))  # wakes a consumer waiting in another thread

    def _watch(self) -> None:
        watcher = threading.Thread(
            target=_watch,
            args=(self._thread, self._source, STALLED_SOURCE_WARNING_S),
            name="jmirror-prefetch-watch",
            daemon=True,
        )
        try:
            watcher.start()
        except RuntimeError:  # at interpreter exit no thread starts, and none needs to
            pass


# What a process has for the next step of a pass over several processes (see `agree`):
# SHORT is a batch whose process-local share is incomplete, dropped everywhere under "drop".
ENDED, HAS_BATCH, FAILED, SHORT = 0, 1, 2, 3


class Agree(Protocol):
    """How the processes agree on each step of a pass (jmirror._input makes it)."""

    def __call__(self, values: tuple[int, int, int]) -> Sequence[Sequence[int]]:
        """Returns every process's values (index = process) for this process's `values`,
        each `(state, layout signature, share rows)`."""
        ...

    def exchange(self, entries: list[list[str]]) -> list[list[list[str]]] | None:
        """Returns every process's `entries` (its batch's `[path, leaf]` pairs), or None
        when they cannot be had in a few seconds; called by every process at once."""
        ...


POSITION_FORMAT = "jmirror.input"
POSITION_VERSION = 2
# Positions of the first version hold `batches` alone; they still resume (by counting).
POSITION_VERSIONS = (1, 2)


def _names(indices: list[int]) -> str:
    return ", ".join(str(i) for i in indices)


def _differences(everyone: list[list[list[str]]]) -> str:
    """Returns, for each leaf path whose leaf differs between the processes' batches (or that
    some lack), what each process has there: `batch['x']: float32[rows, 3] on process 0,
    int32[rows, 3] on process 1`."""
    leaves = [{path: leaf for path, leaf in entries} for entries in everyone]
    paths = list(dict.fromkeys(path for entries in everyone for path, _ in entries))
    found = []
    for path in paths:
        kinds: dict[str, list[int]] = {}
        for p, mine in enumerate(leaves):
            kinds.setdefault(mine.get(path, "nothing"), []).append(p)
        if len(kinds) > 1:
            found.append(
                f"{path}: "
                + ", ".join(f"{leaf} on process {_names(ps)}" for leaf, ps in kinds.items())
            )
    return "; ".join(found) or "the same leaves in another pytree structure"


def _shutdown(elements: Iterator[Any], prefetcher: _Prefetcher | None, control: Control) -> None:
    control.stopped.set()  # the source is asked for nothing more
    if prefetcher is not None:
        prefetcher.stop()  # the thread closes `elements` itself
    elif getattr(elements, "gi_running", False):
        pass  # another thread is inside it: `control.stopped` ends it after that source call
    else:
        close = getattr(elements, "close", None)
        if callable(close):
            close()


class DistributedIterator:
    """One pass over a `DistributedDataset`, possibly prefetching in a background thread.

    Supports `next()`, `close()` and `with`. The prefetch thread stops on `close()`, on
    exhaustion, on an error, and when the iterator is garbage collected; none of these waits
    for a source blocked in its `next()` (see `jmirror._prefetch`). Every iterator has
    `position`.

    Example:
        >>> import numpy as np, jmirror as jm
        >>> strategy = jm.MirroredStrategy()
        >>> n = strategy.num_replicas
        >>> data = strategy.distribute_dataset([np.zeros((n, 2))], remainder="drop")
        >>> with iter(data) as it:
        ...     batch = next(it)
        >>> batch.values.shape == (n, 1, 2)
        True
    """

    def __init__(
        self,
        elements: Iterator[Any],
        prefetch: int,
        low_priority: bool,
        control: Control,
        *,
        position: Position,
        call: str = "strategy.distribute_dataset",
        source: str = "the source",
        agree: Agree | None = None,
    ):
        self._elements = elements
        self._agree = agree
        self._steps = 0  # batches returned by this pass
        self._call = call
        self._source = source
        self._prefetcher = (
            _Prefetcher(elements, prefetch, low_priority, control, source) if prefetch > 0 else None
        )
        self._done = False
        self._agreed = False  # whether the processes' shares were found equal
        self._position = position
        # The finalizer holds the thread's state, never `self`: dropping the iterator stops it.
        self._finalizer = weakref.finalize(self, _shutdown, elements, self._prefetcher, control)

    def __iter__(self) -> DistributedIterator:
        return self

    def __next__(self) -> PyTree:
        value = self._next_value()
        while isinstance(value, _Warning):
            warnings.warn(value.message, UserWarning, stacklevel=2)
            value = self._next_value()
        if isinstance(value, _Positioned):
            self._position = value.position
            return value.value
        return value

    @property
    def position(self) -> dict[str, Any]:
        """Returns where the consumer stands: pass it as `start=position` to resume there.

        A small JSON-able dict whose content is jmirror's own (treat it as opaque). It counts
        the global batches this iterator has returned (steps, for
        `distribute_datasets_from_function`), the batches that `remainder="drop"` skipped
        before them included, never those only prefetched; it records the global batch size
        and, when the source's iterator has `get_state()` and `set_state()`, the state that
        iterator had once the last batch returned was pulled (a `bytes` state as base64
        text), from which `start=` resumes without reading earlier elements again.

        Raises:
          TypeError: when the source's `get_state()` returned a value that is neither
            JSON-serializable nor `bytes` (the message names its type).

        Example:
            >>> import json, numpy as np, jmirror as jm
            >>> strategy = jm.MirroredStrategy()
            >>> n = strategy.num_replicas
            >>> batches = [np.full((n,), i) for i in range(4)]
            >>> it = iter(strategy.distribute_dataset(batches, remainder="drop"))
            >>> first = next(it)
            >>> saved = json.dumps(it.position)  # e.g. into a checkpoint
            >>> it.close()
            >>> rest = strategy.distribute_dataset(batches, remainder="drop",
            ...                                    start=json.loads(saved))
            >>> [int(batch.values[0, 0]) for batch in rest]
            [1, 2, 3]
        """
        return self._position.public(f"{self._call}'s iterator.position")

    def _next_value(self) -> PyTree:
        while True:
            if self._done:
                raise StopIteration
            kind, value = self._next_local()
            if isinstance(value, _Warning):
                return value
            if self._agree is not None and not self._check_others(kind, value):
                self._position = value.position  # dropped on every process: received
                continue
            if kind == "item":
                self._steps += 1
                return value
            self.close()
            if kind == "error":
                raise value
            raise StopIteration

    def _next_local(self) -> tuple[str, Any]:
        """Returns this process's next element: `("item", value)`, `("end" | "closed", None)` or
        `("error", exception)`."""
        if self._prefetcher is None:
            try:
                return "item", next(self._elements)
            except StopIteration:
                return "end", None
            except BaseException as e:  # noqa: BLE001 - raised after the processes agree
                return "error", e
        return self._prefetcher.get()

    def _check_others(self, kind: str, value: object) -> bool:
        """Ends this pass, with several processes, where any process has no batch for this step.

        Returns whether the step's batch is used: False when every process has one but some
        process's share is incomplete under `remainder="drop"` (every process drops it)."""
        assert self._agree is not None
        mine = HAS_BATCH if kind == "item" else FAILED if kind == "error" else ENDED
        positioned = value if isinstance(value, _Positioned) else None
        layout = positioned.layout if positioned is not None else None
        share = positioned.share if positioned is not None else None
        if mine == HAS_BATCH and positioned is not None and positioned.incomplete:
            mine = SHORT
        signature = layout.signature if layout is not None else 0
        agreed = [tuple(v) for v in self._agree((mine, signature, share or 0))]
        states = [v[0] for v in agreed]
        if all(state in (HAS_BATCH, SHORT) for state in states):
            if layout is not None:
                self._check_layouts(layout, [v[1] for v in agreed])
            if SHORT in states:
                return False
            if share is not None and not self._agreed:
                self._check_shares([v[2] for v in agreed])  # once, on the first step used
                self._agreed = True
            return True
        self.close()
        if isinstance(value, BaseException):  # this process's own error (FAILED)
            raise value
        failed = [i for i, state in enumerate(states) if state == FAILED]
        step = self._steps
        if failed:
            raise RuntimeError(
                f"jmirror: the input of process {_names(failed)} raised an error at step {step} "
                f"of this pass over {self._source} (its own output shows it), so every process "
                "ends the pass there instead of waiting for it in the step's collective."
            )
        short = [i for i, state in enumerate(states) if state == ENDED]
        more = [i for i, state in enumerate(states) if state in (HAS_BATCH, SHORT)]
        if more:
            warnings.warn(
                f"jmirror: the input of process {_names(short)} ended after {step} batches, "
                f"while process {_names(more)} still had more: every process ends this pass "
                f"over {self._source} at step {step}, and the batches left on process "
                f"{_names(more)} are not used. Give every process the same number of batches "
                "per pass to use them all.",
                UserWarning,
                stacklevel=4,
            )
        raise StopIteration

    def _check_layouts(self, layout: Layout, signatures: list[int]) -> None:
        """Checks that every process's batch of this step has this process's `layout`."""
        if all(signature == layout.signature for signature in signatures):
            return
        self.close()
        assert self._agree is not None
        # Every process is here at this step (all saw the same signatures): each learns the
        # others' leaves, to name the ones that differ.
        everyone = self._agree.exchange(layout.entries())
        what = layout.what
        whats = "batches" if what == "batch" else f"{what}s"
        beyond = "" if what == "element" else " beyond their rows"
        if everyone is not None:
            found = _differences(everyone)
        else:
            same = [i for i, signature in enumerate(signatures) if signature == layout.signature]
            other = [i for i, signature in enumerate(signatures) if signature != layout.signature]
            found = (
                f"process {_names(same)}'s {'is' if len(same) == 1 else 'are'} "
                f"{layout.describe()}; process {_names(other)}'s "
                f"differ{'s' if len(other) == 1 else ''} (its own error names it)"
            )
        raise ValueError(
            f"{self._call}: at step {self._steps} the processes' {whats} differ in structure, "
            f"dtype or shape{beyond}, over {self._source}: {found}. One global batch is made "
            f"of every process's {what}: each process's source must yield {whats} of the same "
            f"pytree structure, with the same dtypes and the same shapes"
            f"{'' if what == 'element' else ' but for the number of rows'}."
        )

    def _check_shares(self, shares: list[int]) -> None:
        """Checks, for process-local input, that every process's share of G holds the same rows."""
        if len(set(shares)) == 1:
            return
        self.close()
        sizes = ", ".join(f"process {i}: {rows}" for i, rows in enumerate(shares))
        raise ValueError(
            f"{self._call}(process_local=True): the processes' first shares set different "
            f"global batch sizes ({sizes} rows each, after rounding up to a multiple of the "
            f"local replicas), over {self._source}. Every process's source must yield shares "
            "of the same size (G / P rows, P the process count): give each process the same "
            "per-process batch size."
        )

    def close(self) -> None:
        """Stops the pass: stops the prefetch thread and closes the source iterator it opened.

        It returns promptly (within 0.2 s) even when the source is blocked in its `next()`:
        the thread then closes that iterator and ends when the call returns (see
        `jmirror._prefetch`).

        Example:
            >>> import numpy as np, jmirror as jm
            >>> strategy = jm.MirroredStrategy()
            >>> n = strategy.num_replicas
            >>> it = iter(strategy.distribute_dataset([np.zeros((n, 2))] * 3))
            >>> it.close()
            >>> list(it)
            []
        """
        self._done = True
        self._finalizer()

    def __enter__(self) -> DistributedIterator:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
