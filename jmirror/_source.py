"""A source of batches, one pass at a time: opened, pulled, resumed.

`Source.pull` opens one pass over what the user gave (calling a callable, iterating an
iterable) and yields its elements, each with the source iterator's own state when it has one
(`jmirror._source_state`). A resumed pass starts after the batches already received: an
iterator with `get_state`/`set_state` is given the saved state, any other one is pulled that
far (its elements dropped unseen). Every call into the source's own code is marked in the
pass's `Control` (`in_source`), so that clean-up never waits on it.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any, cast

from jmirror._prefetch import Control
from jmirror._source_state import SourceState, has_state, is_movable, take
from jmirror._values import PyTree


@dataclasses.dataclass(frozen=True)
class Resume:
    """Where a pass resumes: after `skip` source elements (`every` per batch or step).

    `state` is the source iterator's saved state, used when the new iterator has one;
    `saved` and `current` are the process counts over which the source's data was split
    then and is now (1 for a global source), which a saved state must not cross unless the
    iterator is made for it.
    """

    skip: int
    state: SourceState | None = None
    every: int = 1
    peek_first: bool = False
    saved: int = 1
    current: int = 1
    unit: str = "batches"

    def check_movable(self, call: str, iterator: object) -> None:
        """Refuses a saved state from another process count that `iterator` cannot take."""
        if self.saved == self.current or is_movable(iterator):
            return
        batches = self.skip // self.every
        raise ValueError(
            f"{call}(start=...): the position holds the state of a source whose data was "
            f"split over P={self.saved} process{'es' if self.saved > 1 else ''} (each reading "
            f"its own share), but this run splits it over P'={self.current}, and the source's "
            f"iterator ({type(iterator).__qualname__}) cannot move its state to another "
            "process count: its next batch would not be the one the position names. Resume "
            f"on {self.saved} process{'es' if self.saved > 1 else ''}; or use a source made "
            "for it (grain's ElasticIterator, whose state restores on any shard count); or "
            "resume by counting: pass the position without its 'source_state' entry, and "
            f"each new process's source reads and skips its shares of the {batches} "
            f"{self.unit} already received."
        )


class Source:
    """Opens one pass over a dataset: calls a callable source, iterates an iterable one.

    Every call into the source's own code runs with `control.in_source` set, so that clean-up
    knows not to wait for it, and no call is made once `control.stopped` is set.
    """

    def __init__(self, call: str, open_fn: Callable[[], Any], given: PyTree):
        self._call = call
        self._open_fn = open_fn
        self._given = given  # the caller's object: never closed by jmirror
        self._lock = threading.Lock()

    def describe(self) -> str:
        """Returns the source as warnings name it: its qualified name, or its type and id."""
        name = getattr(self._given, "__qualname__", None)
        if not isinstance(name, str):
            name = f"{type(self._given).__qualname__} object at {id(self._given):#x}"
        return f"{self._call}'s source {name}"

    def pull(
        self, control: Control, resume: Resume | None = None
    ) -> Generator[tuple[int, Any, SourceState | None], None, None]:
        """Yields `(index, element, state)` for one pass, until the source ends or `control`
        stops it: the element's index in the source, and the source iterator's own state once
        it was pulled (at the end of each group of `resume.every` elements; None for iterators
        without `get_state`/`set_state`).

        With `resume`, the pass starts after `resume.skip` elements: an iterator with its own
        state is given the saved state (`set_state`), any other one is pulled that far and
        only the first element is yielded, when `resume.peek_first` asks for it (to learn G).
        """
        stopped = control.stopped
        if stopped.is_set():
            return
        control.in_source = True
        try:
            it = self._open()
        finally:
            control.in_source = False
        shared = it is self._given  # a one-shot iterator shared by every pass: never closed
        stateful = has_state(it)
        every = resume.every if resume is not None else 1
        index, skip = 0, 0
        try:
            if resume is not None and resume.skip:
                if resume.state is not None and stateful:
                    resume.check_movable(self._call, it)
                    control.in_source = True
                    try:
                        cast(Any, it).set_state(resume.state.value())
                    finally:
                        control.in_source = False
                    index = resume.skip
                else:
                    skip = resume.skip
            while not stopped.is_set():
                control.in_source = True
                try:
                    if shared:
                        with self._lock:
                            element = next(it)
                            state = take(it) if stateful and (index + 1) % every == 0 else None
                    else:
                        element = next(it)
                        state = take(it) if stateful and (index + 1) % every == 0 else None
                except StopIteration:
                    break
                finally:
                    control.in_source = False
                if stopped.is_set():
                    return
                if index >= skip or (index == 0 and resume is not None and resume.peek_first):
                    yield index, element, state
                index += 1
            if index < skip and not stopped.is_set():
                assert resume is not None
                raise ValueError(
                    f"{self._call}(start=...): the position says {resume.skip // every} "
                    f"{resume.unit} were received, but the source has only {index // every}"
                    f"{'' if every == 1 else f' ({index} elements)'}. Resume with a source "
                    "that yields the same batches as the one the position was taken from."
                )
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


def open_source(call: str, dataset: object) -> Source:
    if isinstance(dataset, Iterable):
        return Source(call, lambda: dataset, dataset)
    if callable(dataset):
        return Source(call, dataset, dataset)
    raise TypeError(
        f"{call} expects an iterable of batches or a zero-argument callable returning one, got "
        f"{type(dataset).__name__}. Pass a list, a generator, a data loader, or a function "
        "that returns one per epoch."
    )
