"""Where the time goes: the counts behind `strategy.step_stats()`, and the profiler's steps.

Each strategy owns one `Recorder` (through its `Dispatch`). Three hooks feed it, each at the
top of its call path:

- a replicated call (`Replicated.__call__`) reads the clock when it starts (`clock()`) and calls
  `ended(began)` when it returns. The call's time on the caller's thread is `dispatch_s` of its
  function's row, less the two parts below;
- the wait for room behind earlier steps (`Dispatch.wait_for_room`) reports the seconds it
  blocked (`waited_for_room`): those are `room_wait_s`, the devices being the bottleneck;
- the wait for a batch in a distributed dataset's iterator (`Counted.__next__` in
  `jmirror._input`) is `input_wait_s` of its dataset's row, the input being the bottleneck.

`Dispatch.track(token, call)`, which every dispatched step passes through, tells the recorder
which function's row the open call counts in (`Recorder.dispatched`); a call traced by the
caller's own transformation dispatches nothing and is not counted. Compiling is neither host
nor device time of the steady loop: the spans JAX reports for tracing, lowering and compiling
(`jax.monitoring`'s time spans, on the thread that compiles) inside a call are left out of
its `dispatch_s` and of `wall_s`, and summed in `StepStats.compile_s`.

What one call costs: two clock reads, a dict lookup by the function's id, a few attribute
reads and float additions (benchmarks/RESULTS.md). Rows are zeroed in place by a reset, so
that a function or dataset keeps its row object.

Inside an active `jax.profiler` trace each replicated call is also a
`jax.profiler.StepTraceAnnotation` named after the function, with its call number (from 0):
`tracing()` is a check of an atomic flag in JAX's profiler (tens of nanoseconds), so the
annotation costs nothing outside a trace.
"""

from __future__ import annotations

import dataclasses
import io
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import jax

FUNCTION = "function"
DATASET = "dataset"
INPUT_BOUND = "input-bound"
DEVICE_BOUND = "device-bound"
HOST_BOUND = "host-bound"
VERDICTS = (INPUT_BOUND, DEVICE_BOUND, HOST_BOUND)

clock = time.perf_counter

# Whether a jax.profiler trace is active: TraceMe's own check (an atomic read), which the
# public TraceAnnotation inherits. Without it every call is annotated (about 1 µs each).
tracing: Callable[[], bool] = getattr(jax.profiler.TraceAnnotation, "is_enabled", lambda: True)


def annotation(name: str, number: int) -> jax.profiler.StepTraceAnnotation:
    """Returns the profiler's step event of call `number` (from 0) of the function `name`."""
    return jax.profiler.StepTraceAnnotation(name, step_num=number)


_FIXES = {
    INPUT_BOUND: (
        "the loop waited for batches: raise `prefetch` in strategy.distribute_dataset (or "
        "distribute_datasets_from_function), or speed up the source (parallel reading and "
        "decoding, less work per element)."
    ),
    DEVICE_BOUND: (
        "the devices are the bottleneck, the host and the input keep up: give each step more "
        "to do per call (a bigger batch or model per step), or less device work per example "
        "(mixed precision, a cheaper model)."
    ),
    HOST_BOUND: (
        "Python between steps takes the time (neither wait is the larger part): fewer Python "
        "operations between steps (read metrics and log every k steps, not every step; no "
        "float() or .item() on results in the loop), or more work per call (a bigger batch)."
    ),
}
_NOTHING = "nothing recorded: no replicated call or batch since the last reset"


class _Open:
    """What the replicated call open now has seen so far.

    One per process, not per thread: a thread-local costs about ten times a plain attribute
    on this path. Replicated calls made at the same time from several threads may then count
    in one another's rows (the totals, and the verdict, stay right).
    """

    __slots__ = ("row", "room_s", "spans", "apart")

    def __init__(self) -> None:
        self.row: _Row | None = None  # the row it counts in, once it dispatched a step
        self.room_s = 0.0  # seconds it waited for room
        self.spans: list[tuple[float, float]] = []  # compilation spans (time.time())
        self.apart = False  # whether either of the two above has something


_OPEN = _Open()


class _Row:
    """One function's or dataset's counts in one recorder."""

    __slots__ = (
        "name",
        "kind",
        "calls",
        "dispatch_s",
        "room_wait_s",
        "input_wait_s",
        "compile_s",
        "first",
        "last",
    )

    def __init__(self, name: str, kind: str):
        self.name, self.kind = name, kind
        self.zero()

    def zero(self) -> None:
        self.calls = 0
        self.dispatch_s = self.room_wait_s = self.input_wait_s = self.compile_s = 0.0
        self.first: float | None = None  # the start of its first call or wait counted
        self.last = 0.0  # the end of its last one

    def waited_for_batch(self, began: float, batches: int) -> None:
        """Counts a wait for a batch that began at `began` (`clock()`) and ends now."""
        now = clock()
        self.calls += batches
        self.input_wait_s += now - began
        if self.first is None:
            self.first = began
        self.last = now


class Recorder:
    """One strategy's counts since the last reset: a row per function and dataset."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rows: list[_Row] = []
        # id(owner) -> (a weak reference to the owner, its row): the owner's id is checked
        # against the reference, so an id reused after the owner is gone gets a new row.
        self._owners: dict[int, tuple[Callable[[], Any], _Row]] = {}

    def row(self, owner: object, name: str, kind: str) -> _Row:
        """Returns the row of `owner` (a replicated function or a dataset), made if new."""
        entry = self._owners.get(id(owner))
        if entry is not None and entry[0]() is owner:
            return entry[1]
        with self._lock:
            row = _Row(name, kind)
            self._rows.append(row)
            self._owners[id(owner)] = (_reference(owner), row)
            return row

    def dispatched(self, call: Any) -> None:
        """Notes that the call open now dispatched a step of `call`."""
        # The row in the recorder `call` last ran on is kept on it: one attribute read per
        # call, where the lookup by id and weak reference takes several.
        kept = getattr(call, "_step_stats_row", _NOT_KEPT)
        if kept[0] is self:
            _OPEN.row = kept[1]
            return
        name = getattr(call, "_step_name", None)  # a replicated function's
        row = self.row(call, name if isinstance(name, str) else repr(call), FUNCTION)
        try:
            call._step_stats_row = (self, row)
        except AttributeError:  # an object that takes no attributes: looked up each call
            pass
        _OPEN.row = row

    def stats(self, reset: bool, process_index: int | None) -> StepStats:
        """Returns the counts as a `StepStats` (and zeroes them with `reset`)."""
        with self._lock:
            counted = [row for row in self._rows if row.first is not None]
            rows = [_as_dict(row, process_index) for row in counted]
            compile_s = sum(row.compile_s for row in counted)
            firsts = [row.first for row in counted if row.first is not None]
            wall = (
                max(0.0, max(row.last for row in counted) - min(firsts) - compile_s)
                if firsts
                else 0.0
            )
            if reset:
                for row in self._rows:
                    row.zero()
        return StepStats(rows, wall, _verdict(rows, wall), compile_s)


def _reference(owner: object) -> Callable[[], Any]:
    """Returns a weak reference to `owner`, or a strong one where it cannot have a weak one."""
    try:
        return weakref.ref(owner)
    except TypeError:
        return lambda: owner


_NOT_KEPT = (None, None)


def _as_dict(row: _Row, process_index: int | None) -> dict[str, Any]:
    out: dict[str, Any] = {"name": row.name, "kind": row.kind}
    if process_index is not None:
        out["process"] = process_index
    out.update(
        calls=row.calls,
        dispatch_s=row.dispatch_s,
        room_wait_s=row.room_wait_s,
        input_wait_s=row.input_wait_s,
    )
    return out


def _verdict(rows: list[dict[str, Any]], wall_s: float) -> str:
    """Returns the largest part of the time: waiting for batches, waiting for room, or the rest."""
    input_s = sum(row["input_wait_s"] for row in rows)
    room_s = sum(row["room_wait_s"] for row in rows)
    host_s = wall_s - input_s - room_s
    if input_s > max(room_s, host_s):
        return INPUT_BOUND
    if room_s > max(input_s, host_s):
        return DEVICE_BOUND
    return HOST_BOUND


# --- the hooks -----------------------------------------------------------------------------


def waited_for_room(seconds: float) -> None:
    """Counts `seconds` waited for room by the call open now."""
    state = _OPEN
    state.room_s += seconds
    state.apart = True


def ended(began: float) -> None:
    """Ends the call open now, begun at `began` (`clock()`): counts it in the row of the
    function whose step it dispatched (none: traced by the caller, not counted)."""
    state = _OPEN
    row = state.row
    if row is None:
        if state.apart:
            state.room_s, state.apart = 0.0, False
        return
    state.row = None
    now = clock()
    spent = now - began
    if state.apart:  # it waited, or compiled: set those apart
        spent = _set_apart(state, row, spent)
    row.calls += 1
    row.dispatch_s += spent
    if row.first is None:
        row.first = began
    row.last = now


def _set_apart(state: _Open, row: _Row, spent: float) -> float:
    """Counts the open call's wait for room and compilation apart from its `spent` seconds;
    returns the rest."""
    room, state.room_s, state.apart = state.room_s, 0.0, False
    compiling = _compiling(state.spans, spent) if state.spans else 0.0
    row.room_wait_s += room
    row.compile_s += compiling
    return max(0.0, spent - room - compiling)


def _compiling(spans: list[tuple[float, float]], length: float) -> float:
    """Returns the seconds of the last `length` seconds covered by compilation spans (nested spans
    counted once); forgets the spans."""
    end = time.time()
    start = end - length
    covered, reach = 0.0, start
    for s, e in sorted(spans):
        s, e = max(s, reach), min(e, end)
        if e > s:
            covered += e - s
            reach = e
    spans.clear()
    return covered


def _on_span(event: str, start_time: float, end_time: float, **kwargs: object) -> None:
    if event.startswith("/jax/core/compile/"):
        state = _OPEN
        if len(state.spans) > 1000:  # compiled outside replicated calls, never read: forget
            state.spans.clear()
        state.spans.append((start_time, end_time))
        state.apart = True


jax.monitoring.register_event_time_span_listener(_on_span)


# --- the result ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StepStats:
    """Where a strategy's time went: each replicated function and dataset since the last reset.

    Returned by `strategy.step_stats()`. `str(stats)` is a table of the rows, then the verdict
    and its fix.

    Attributes:
      rows: one dict per replicated function and distributed dataset that ran (per process
        with several processes, each reporting its own with its index in `"process"`):
        `"name"`, `"kind"` (`"function"` or `"dataset"`), `"calls"` (calls, or batches
        received), `"dispatch_s"` (the caller's thread inside jmirror, waits and compiling
        left out), `"room_wait_s"` (waiting for room because earlier steps were still
        running: the devices are the bottleneck) and `"input_wait_s"` (the loop waiting for a
        batch: the input is).
      wall_s: the time covered, from the start of the first call or wait counted to the end
        of the last one, compiling left out.
      verdict: `"input-bound"` or `"device-bound"` when that wait is the largest part of
        `wall_s`, else `"host-bound"` (Python between steps takes the time; also when nothing
        was recorded).
      compile_s: the seconds replicated calls spent tracing and compiling, left out of the
        rest.

    Example:
        >>> import jax.numpy as jnp, numpy as np, jmirror as jm
        >>> strategy = jm.MirroredStrategy()
        >>> n = strategy.num_replicas
        >>> @jm.replicate(strategy=strategy)
        ... def step(w, x):
        ...     return w + jm.all_reduce("mean", jnp.mean(x))
        >>> w = strategy.mirror(jnp.zeros(()))
        >>> for x in strategy.distribute_dataset([np.ones((n, 2))] * 3, remainder="drop"):
        ...     w = step(w, x)
        >>> stats = strategy.step_stats()
        >>> [(row["name"], row["kind"], row["calls"]) for row in stats.rows]
        [('distribute_dataset(list)', 'dataset', 3), ('step', 'function', 3)]
        >>> stats.verdict in ("input-bound", "device-bound", "host-bound")
        True
    """

    rows: list[dict[str, Any]]
    wall_s: float
    verdict: str
    compile_s: float = 0.0

    @property
    def fix(self) -> str:
        """Returns what to change for the verdict."""
        return _FIXES[self.verdict]

    def __str__(self) -> str:
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text

        if not self.rows:
            return _NOTHING
        table = Table(title=f"where the time went: {self.wall_s:.3f} s", title_justify="left")
        several = "process" in self.rows[0]
        columns = ["name", "kind"] + (["process"] if several else [])
        for column in columns:
            table.add_column(column)
        for column in ("calls", "dispatch s", "room wait s", "input wait s"):
            table.add_column(column, justify="right")
        for row in self.rows:
            table.add_row(
                *(Text(str(row[c])) for c in columns),  # Text: names are never markup
                str(row["calls"]),
                f"{row['dispatch_s']:.3f}",
                f"{row['room_wait_s']:.3f}",
                f"{row['input_wait_s']:.3f}",
            )
        out = io.StringIO()
        Console(file=out, width=100, color_system=None, force_terminal=False).print(table)
        compiled = f" ({self.compile_s:.3f} s compiling, not counted)" if self.compile_s else ""
        table_text = "\n".join(line.rstrip() for line in out.getvalue().splitlines())
        return f"{table_text}\n{self.verdict}{compiled}: {self.fix}"
