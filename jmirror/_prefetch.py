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
"""

from __future__ import annotations

import dataclasses
import os
import queue
import sys
import threading
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import jax


@dataclasses.dataclass(frozen=True)
class _Warning:
    """A warning for the consumer, emitted when it reaches this point of the stream."""

    message: str


_BACKGROUND_NICENESS = 19


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
    stop: threading.Event,
    low_priority: bool,
) -> None:
    """The prefetch thread: one slot per element, each element on the devices before queued."""
    if low_priority:
        _lower_priority()
    try:
        while True:
            slots.get()
            if stop.is_set():
                return
            try:
                value = next(elements)
                if not isinstance(value, _Warning):
                    jax.block_until_ready(value)
            except StopIteration:
                results.put(("end", None))
                return
            except BaseException as e:  # noqa: BLE001 - every error goes to the consumer
                results.put(("error", e))
                return
            results.put(("item", value))
    finally:
        close = getattr(elements, "close", None)
        if callable(close):
            close()


class _Prefetcher:
    """The prefetch thread and its queue; holds no reference to the iterator using it."""

    def __init__(self, elements: Iterator[Any], prefetch: int, low_priority: bool):
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        # Free slots as tokens in a SimpleQueue, implemented in C: a get and a put took 59 ns
        # against 774 ns for a threading.Semaphore's acquire and release (Python code).
        self._slots: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(prefetch):
            self._slots.put(None)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=_produce,
            args=(elements, self._results, self._slots, self._stop, low_priority),
            name="jmirror-prefetch",
            daemon=True,
        )
        self._thread.start()

    def get(self) -> tuple[str, Any]:
        kind, value = self._results.get()
        self._slots.put(None)
        return kind, value

    def stop(self) -> None:
        self._stop.set()
        self._slots.put(None)  # wakes the thread if it waits for a slot
        if threading.current_thread() is not self._thread:
            self._thread.join()
            while not self._results.empty():  # drop prefetched batches now
                self._results.get_nowait()
        self._results.put(("closed", None))  # wakes a consumer waiting in another thread


def _shutdown(elements: Iterator[Any], prefetcher: _Prefetcher | None) -> None:
    if prefetcher is not None:
        prefetcher.stop()  # the thread closes `elements` itself
    else:
        close = getattr(elements, "close", None)
        if callable(close):
            close()


class DistributedIterator:
    """One pass over a `DistributedDataset`, possibly prefetching in a background thread.

    Supports `next()`, `close()` and `with`. The prefetch thread stops on `close()`, on
    exhaustion, on an error, and when the iterator is garbage collected.

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

    def __init__(self, elements: Iterator[Any], prefetch: int, low_priority: bool):
        self._elements = elements
        self._prefetcher = _Prefetcher(elements, prefetch, low_priority) if prefetch > 0 else None
        self._done = False
        # The finalizer holds the thread's state, never `self`: dropping the iterator stops it.
        self._finalizer = weakref.finalize(self, _shutdown, elements, self._prefetcher)

    def __iter__(self) -> DistributedIterator:
        return self

    def __next__(self) -> Any:
        value = self._next_value()
        while isinstance(value, _Warning):
            warnings.warn(value.message, UserWarning, stacklevel=2)
            value = self._next_value()
        return value

    def _next_value(self) -> Any:
        if self._done:
            raise StopIteration
        if self._prefetcher is None:
            try:
                return next(self._elements)
            except BaseException:
                self.close()
                raise
        kind, value = self._prefetcher.get()
        if kind != "item":
            self.close()
            if kind == "error":
                raise value
            raise StopIteration
        return value

    def close(self) -> None:
        """Stops the pass: joins the prefetch thread and closes the source it opened.

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

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
