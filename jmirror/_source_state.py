"""A source iterator's own state: taken with each batch, carried in positions, given back.

An iterator with `get_state()` and `set_state(state)` (grain's `DatasetIterator`, the iterator
of a `grain.DataLoader`, or any iterator with the two methods) is resumed by its own state
instead of by pulling and dropping the batches already received: `set_state` is one call
whatever the position, and no earlier element is read again.

The state is taken in the thread that pulls the source (the prefetch thread), right after the
element it belongs to, so a position never holds the state of a batch only prefetched. It is
frozen at once as text: JSON for a JSON-serializable state, base64 for `bytes` (a
`grain.DataLoader` iterator's state), so that later changes to a state object the iterator
keeps and reuses cannot reach it, and a position stays JSON-serializable. A state that is
neither, or that JSON would give back changed (a dict key that is not a string: `set_state`
would get `"0"` for `0`), is kept as it is and refused (`TypeError`, naming the path and type
of what JSON cannot hold) only when a position is read: iterating never fails for it. Tuples
come back as lists, as JSON has them.

Another process count: a process-local source's state says where this process's share
stands, which another number of processes cannot continue from, unless the source is made
for it. grain's `ElasticIterator` is: every shard's state is the same global index, from which
any number of shards can go on. grain is never imported here: an iterator is grain's only if
the caller's program imported grain and made it.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import sys
from typing import Any

# grain's elastic iterator: its state (the next global index) moves to any shard count.
_GRAIN_ELASTIC = ("grain._src.python.dataset.elastic_iterator", "_ElasticMapDatasetIterator")


def has_state(iterator: object) -> bool:
    """Returns whether `iterator` can be positioned by its own state (`get_state` and
    `set_state`)."""
    return callable(getattr(iterator, "get_state", None)) and callable(
        getattr(iterator, "set_state", None)
    )


def is_movable(iterator: object) -> bool:
    """Returns whether `iterator`'s state restores on another number of processes (grain's
    `ElasticIterator`, recognized only when grain is already imported)."""
    module = sys.modules.get(_GRAIN_ELASTIC[0])
    elastic = getattr(module, _GRAIN_ELASTIC[1], None) if module is not None else None
    return isinstance(elastic, type) and isinstance(iterator, elastic)


@dataclasses.dataclass(frozen=True)
class SourceState:
    """A source iterator's state, frozen as text.

    `text` is the state's JSON, or the base64 of a `bytes` state (`is_bytes`); None when the
    state is neither (`problem` says what JSON cannot hold, and where, for the error).
    """

    text: str | None
    is_bytes: bool = False
    problem: str = ""

    def public(self, call: str) -> dict[str, Any]:
        """Returns the state as a position holds it: `{"json": value}` or `{"bytes": base64
        text}`."""
        if self.text is None:
            raise TypeError(
                f"{call}: the source iterator's get_state() returned a state holding "
                f"{self.problem}, so the "
                "state is neither JSON that set_state gets back unchanged nor bytes, and this "
                "position cannot be saved (a checkpoint's data is JSON). Make get_state() "
                "return JSON-able values (dicts with string keys, lists, str, int, float, "
                "bool, None: e.g. int(x) for a numpy integer) or bytes, e.g. "
                "json.dumps(state).encode()."
            )
        return {"bytes": self.text} if self.is_bytes else {"json": json.loads(self.text)}

    def value(self) -> Any:
        """Returns the state to give `set_state`: the JSON value, or the bytes."""
        if self.text is None:
            raise TypeError(f"a source state holding {self.problem} has no saved form")
        return base64.b64decode(self.text) if self.is_bytes else json.loads(self.text)


def take(iterator: Any) -> SourceState:
    """Returns `iterator.get_state()`, frozen: later changes to the object it returned do not
    count."""
    state = iterator.get_state()
    if isinstance(state, bytes | bytearray | memoryview):
        return SourceState(base64.b64encode(bytes(state)).decode("ascii"), is_bytes=True)
    problem = _not_json(state, "")
    if problem is None:
        try:
            return SourceState(json.dumps(state))
        except (TypeError, ValueError) as e:  # a cycle: what JSON says about it
            problem = f"a {type(state).__qualname__} JSON cannot encode ({e})"
    return SourceState(None, problem=problem)


def _not_json(value: object, path: str) -> str | None:
    """Returns what in `value` JSON cannot hold as it is, with its path (`['key'][0]`), or None."""
    if value is None or isinstance(value, str | int | float):  # bool is an int
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return (
                    f"a dict key {key!r} of type {type(key).__qualname__} at {path or 'the top'} "
                    "(JSON keys are strings: set_state would get it back as a string)"
                )
            found = _not_json(item, f"{path}[{key!r}]")
            if found is not None:
                return found
        return None
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            found = _not_json(item, f"{path}[{i}]")
            if found is not None:
                return found
        return None
    where = f" at {path}" if path else ""
    return f"a {type(value).__module__}.{type(value).__qualname__}{where}"


def read_public(call: str, entry: object) -> SourceState:
    """Returns a position's `source_state` entry back as a `SourceState`; `ValueError` if
    damaged."""
    if isinstance(entry, dict) and set(entry) == {"json"}:
        return SourceState(json.dumps(entry["json"]))
    if isinstance(entry, dict) and set(entry) == {"bytes"} and isinstance(entry["bytes"], str):
        try:
            base64.b64decode(entry["bytes"], validate=True)
        except (binascii.Error, ValueError):
            pass
        else:
            return SourceState(entry["bytes"], is_bytes=True)
    raise ValueError(
        f"{call}(start=...): the position's 'source_state' must be {{'json': value}} or "
        f"{{'bytes': base64 text}}, as an iterator's `.position` gives it, got "
        f"{str(entry)[:80]}. Pass `.position` unchanged (a JSON round trip keeps it valid)."
    )
