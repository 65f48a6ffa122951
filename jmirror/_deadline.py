"""Bounded waits across processes: every wait for other processes ends within `timeout_s`.

`jm.MultiWorkerMirroredStrategy(timeout_s=300)` (TensorFlow's
`CommunicationOptions(timeout_seconds=...)`) bounds every wait of this process for the others: a
replicated step, a read, reduce or gather, a checkpoint barrier, the input agreement, and
`jm.distributed.initialize`'s wait for the processes that never call it. A wait that has not
completed `timeout_s` seconds after it was waited on ends the process: jmirror prints what timed
out and the processes that did not arrive to stderr, and exits with `EXIT_CODE` (`os._exit`, as
a blocked XLA wait cannot be interrupted from Python). This module is the one place that does it:

- `bounded(call, timeout_s)`: a context manager around a wait of the caller's thread (a
  barrier, a collective whose result is read on the host, `initialize`, and the dispatch of a
  cross-process call, which XLA:CPU runs inline, waiting, when the program is cheap). Time
  JAX spends tracing and compiling in it is not counted (a `jax.monitoring` listener starts
  the clock again after each compilation event of the thread).
- `watch(token, call, timeout_s)`: an asynchronous cross-process call (a replicated step, a
  read) recorded by one of its outputs. Its clock starts when it is waited on: when every
  call watched before it has completed (calls complete in order), or when it is dispatched if
  that is later; so steps queued behind others never count their time in the queue, and a
  first call's compilation (done before the call returns) never counts.
- `expire(call, timeout_s, ...)`: print the message and end the process.

Two daemon threads, started lazily by the first bounded or watched call with a timeout (never
with `timeout_s=None`): the *waiter* waits for the watched outputs one by one
(`block_until_ready`), the *watchdog* wakes every `POLL_S` seconds, ends the process when a wait
is past its bound, and publishes this process's progress to the coordination service's
key-value store every `PUBLISH_S` seconds (once a call was watched or waited for). A call costs
one append to a queue; no thread is started per call. At interpreter exit both threads stop
before JAX shuts its runtime down, the waiter once the call it waits for has completed.

Naming the processes that did not arrive: JAX's coordination service knows who reached a
barrier (its timeout error lists them) but not who reached an XLA collective. So each process
publishes how many watched calls it has dispatched and completed and which blocking waits it is
in; since every process makes the same calls in the same order, a process that dispatched fewer
calls than the one that timed out, or is not in the same blocking wait, did not arrive. gloo's
own error for a peer that never reaches the first collective (`GetKeyValue() timed out` after
30 s) is turned into the same message by `explain`.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import itertools
import json
import math
import numbers
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, NoReturn

import jax
import jax.core
import jax.monitoring

from jmirror import _shim
from jmirror._values import PyTree

# The exit status of a process ended by a timed-out wait.
EXIT_CODE = 1
# How often the watchdog checks the bounds, and how often a process publishes its progress.
POLL_S = 0.25
PUBLISH_S = 2.0
# A published progress older than this is reported as stale (that process is stuck holding
# the interpreter, or lost).
STALE_S = 10.0
# The longest the message waits for the coordination service while naming processes.
NAMING_S = 10.0
PROGRESS_KEY = "jmirror/deadline/"

_GLOO_RENDEZVOUS = re.compile(r"Gloo context initialization failed.*GetKeyValue\(\) timed out")
# The key gloo waited for: the global ids of the communicator's devices, then the rank whose
# address never came.
_GLOO_KEY = re.compile(r"key: \S*gloo/([\d,]+)/(\d+)")


def check_timeout(timeout_s: object, call: str) -> float | None:
    """Validates `timeout_s`: a positive number of seconds, or None (no bound)."""
    if timeout_s is None:
        return None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real):
        raise TypeError(
            f"{call}(timeout_s=...) expects a positive number of seconds or None (no bound); "
            f"got {timeout_s!r} of type {type(timeout_s).__name__}."
        )
    if not math.isfinite(timeout_s) or timeout_s <= 0:
        raise ValueError(
            f"{call}(timeout_s={timeout_s!r}) must be a positive, finite number of seconds: how "
            "long a wait for the other processes may last before this process ends with an "
            "error naming them. Pass None to wait without a bound."
        )
    return float(timeout_s)


@dataclasses.dataclass
class _Wait:
    """One wait of a caller's thread, or one watched call."""

    call: object  # what is waited for; str() names it (only formatted when it times out)
    timeout_s: float
    setting: str  # where the bound is set, named in the message
    started: float  # time.monotonic() when the clock started
    seq: int = 0  # for a watched call: its number among this process's watched calls
    token: PyTree = None  # for a watched call: the output waited for
    missing: Callable[[], str] | None = None  # names the absent processes itself
    paused: bool = False  # while its thread traces and compiles a new program
    absent: tuple[int, ...] | None = None  # the absent processes, when known already
    nth: int = 0  # for a blocking wait: how many waits of its name this process began, this one too


def _ready(wait: _Wait) -> bool:
    """Returns whether a watched call has completed although the waiter has not seen it yet.

    On a loaded machine the waiter thread may run seconds after the call it waits for
    completed; that time is not the call's.
    """
    token = wait.token
    try:
        return token is not None and bool(token.is_ready())
    except Exception:  # noqa: BLE001 - e.g. a donated output: the waiter sees it at once
        return False


class _Watchdog:
    """The waiter and watchdog threads, and what they watch (one per process)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waits: dict[int, _Wait] = {}  # blocking waits in progress, by id
        self._begun: dict[str, int] = {}  # blocking waits begun so far, by name
        self._queue: collections.deque[_Wait] = collections.deque()  # watched, not yet waited
        self._head: _Wait | None = None  # the watched call the waiter waits for
        self._numbers = itertools.count(1)
        self._dispatched = 0  # watched calls so far
        self._idle = False  # whether the waiter waits for work
        self._done = 0  # watched calls completed
        self._wake = threading.Event()
        self._stop_waiting = threading.Event()  # the waiter's: set first at exit
        self._stop = threading.Event()  # the watchdog's
        self._expired = threading.Event()
        self._threads: tuple[threading.Thread, ...] = ()

    def start(self) -> None:
        with self._lock:
            if self._threads:
                return
            self._threads = (
                threading.Thread(
                    target=self._wait_loop, name="jmirror-deadline-waiter", daemon=True
                ),
                threading.Thread(
                    target=self._watch_loop, name="jmirror-deadline-watchdog", daemon=True
                ),
            )
        # Registered after jax.distributed's own exit handler, so it runs before it: the
        # threads stop before the runtime they publish to is shut down.
        atexit.register(self.stop)
        jax.monitoring.register_event_duration_secs_listener(_restart_after_compiling)
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Stops both threads (at exit): the waiter after the call it waits for, if any.

        The waiter must not be inside `block_until_ready` when the interpreter finalizes:
        a daemon thread that takes the GIL back then is ended with `pthread_exit` in jaxlib's
        C++ frames, which aborts the process ("FATAL: exception not rethrown", seen at the
        end of a 2-process run whose last step was still running). So the waiter is joined
        first, while the watchdog still bounds the call it waits for.
        """
        self._stop_waiting.set()
        self._wake.set()
        waiter, watchdog = self._threads
        while waiter.is_alive() and not self._expired.is_set():
            waiter.join(POLL_S)
        self._stop.set()
        watchdog.join(timeout=2 * POLL_S + NAMING_S)

    @property
    def threads(self) -> tuple[threading.Thread, ...]:
        return self._threads

    # --- registering -------------------------------------------------------------------------

    def add_wait(self, wait: _Wait) -> int:
        key = id(wait)
        with self._lock:
            # Every process makes the same calls in the same order: the n-th wait of one name
            # is the same wait on every process, so a report of an earlier one (a peer that
            # has not reported since) is not taken for this one.
            label = _label(wait.call)
            wait.nth = self._begun[label] = self._begun.get(label, 0) + 1
            self._waits[key] = wait
        return key

    def end_wait(self, key: int) -> None:
        with self._lock:
            self._waits.pop(key, None)

    def watch(self, token: PyTree, call: object, timeout_s: float, setting: str) -> None:
        seq = next(self._numbers)  # atomic under the GIL, as the deque's append
        self._dispatched = seq
        self._queue.append(_Wait(call, timeout_s, setting, time.monotonic(), seq, token))
        if self._idle:  # wake the waiter only when it waits for work
            self._wake.set()

    # --- the threads -------------------------------------------------------------------------

    def _wait_loop(self) -> None:
        while not self._stop_waiting.is_set():
            try:
                item = self._queue.popleft()
            except IndexError:
                self._idle = True
                if not self._queue:  # checked after saying so: `watch` then wakes it
                    self._wake.wait()
                self._idle = False
                self._wake.clear()
                continue
            item.started = max(item.started, time.monotonic())
            with self._lock:
                self._head = item
            try:
                item.token.block_until_ready()
            except Exception as e:  # noqa: BLE001 - the caller sees its own error
                if _GLOO_RENDEZVOUS.search(str(e)):
                    self.expire(item, cause=str(e))
            with self._lock:
                self._head = None
                self._done = item.seq
            item.token = None

    def _watch_loop(self) -> None:
        published = -math.inf
        while not self._stop.wait(POLL_S):
            now = time.monotonic()
            with self._lock:
                late = [
                    w
                    for w in self._waits.values()
                    if not w.paused and now - w.started > w.timeout_s
                ]
                head = self._head
            if head is not None and now - head.started > head.timeout_s and not _ready(head):
                late.append(head)
            if late:
                self.expire(late[0])
            if now - published >= PUBLISH_S:
                published = now
                self._publish()

    # --- progress and naming -----------------------------------------------------------------

    def progress(self) -> dict[str, Any]:
        with self._lock:
            head = self._head
            return {
                "dispatched": self._dispatched,
                "done": self._done,
                "head": None if head is None else _label(head.call),
                "waiting": sorted(_label(w.call) for w in self._waits.values()),
                "waiting_nth": sorted([_label(w.call), w.nth] for w in self._waits.values()),
                "begun": dict(self._begun),
                "time": time.time(),
            }

    def _client(self) -> Any:
        """Returns the coordination service's client, once connected (never during `initialize`,
        whose client exists before it is connected: calling it then aborts the process)."""
        with self._lock:
            if any(w.missing is not None for w in self._waits.values()):
                return None
        return _shim.distributed_client()

    def _publish(self) -> None:
        with self._lock:
            if not self._dispatched and not self._begun:
                return  # nothing to report yet
        client = self._client()
        if client is None:
            return
        try:
            value = json.dumps(self.progress())
            client.key_value_set(f"{PROGRESS_KEY}{jax.process_index()}", value, True)
        except Exception:  # noqa: BLE001 - progress is best effort, the bound is not
            pass

    def expire(self, wait: _Wait, cause: str | None = None) -> NoReturn:
        """Prints why `wait` timed out, naming the absent processes, and ends the process."""
        if self._expired.is_set():  # another thread is already ending the process
            time.sleep(NAMING_S + 5)
            os._exit(EXIT_CODE)
        self._expired.set()
        # Not while joining the runtime: asking JAX for the process index would start its
        # backends, which then use the client before it is connected (the process aborts).
        me = "" if wait.missing is not None else f" {jax.process_index()}"
        waited = time.monotonic() - wait.started
        call = _label(wait.call)
        if cause is not None and wait.absent is None:
            wait.absent = _gloo_absent(cause)
        if cause is not None:
            head = (
                f"jmirror: {call} failed on process{me}: a peer process never reached this "
                f"first collective within gloo's 30 s rendezvous ({cause.splitlines()[0]}); "
                f"ending process{me} with exit status {EXIT_CODE}."
            )
        else:
            head = (
                f"jmirror: timed out: {call} has not completed {waited:.0f} s after it was "
                f"waited on (timeout_s={wait.timeout_s:g} of {wait.setting}); ending process"
                f"{me} with exit status {EXIT_CODE}."
            )
        _say(head)
        if wait.missing is not None:
            _say(wait.missing())
        else:
            _say(_bounded_call(lambda: self._name_absent(wait), NAMING_S))
        fix = (
            "start every process's first collective within 30 s of the others' (gloo's bound, "
            "which cannot be raised)"
            if cause is not None
            else f"raise timeout_s of {wait.setting} (None waits without a bound)"
        )
        _say(
            "jmirror: fix: find why those processes did not arrive (stuck, busy in work of "
            "their own, or skipping a call the others make: every process must make the same "
            f"calls in the same order), or {fix}."
        )
        _flush_and_exit(EXIT_CODE)

    def _name_absent(self, wait: _Wait) -> str:
        client = self._client()
        if client is None:
            return "jmirror: JAX's coordination service is not running: no other process named."
        self._publish()
        rows = dict(client.key_value_dir_get(PROGRESS_KEY))
        me = jax.process_index()
        now = time.time()
        absent, lines = [], []
        for p in range(jax.process_count()):
            raw = rows.get(f"{PROGRESS_KEY}{p}")
            if p == me:
                continue
            if raw is None:
                if wait.absent is None or p in wait.absent:
                    absent.append(p)
                lines.append(f"process {p}: has made no cross-process call with a timeout yet")
                continue
            seen = json.loads(raw)
            doing = _describe(seen, now)
            if wait.absent is not None:
                arrived = p not in wait.absent
            elif wait.seq:
                arrived = seen["dispatched"] >= wait.seq
            else:
                arrived = [_label(wait.call), wait.nth] in seen.get("waiting_nth", [])
            if not arrived:
                absent.append(p)
            lines.append(f"process {p}: {doing}")
        where = f" (call #{wait.seq} of this process's cross-process calls)" if wait.seq else ""
        names = ", ".join(map(str, absent)) or "none found (each reports being there)"
        text = [f"jmirror: processes that did not arrive at {_label(wait.call)}{where}: {names}."]
        text += [f"jmirror:   {line}" for line in lines]
        return "\n".join(text)


def _gloo_absent(cause: str) -> tuple[int, ...] | None:
    """Returns the process of the device whose rank gloo's rendezvous waited for (if known)."""
    match = _GLOO_KEY.search(cause)
    if match is None:
        return None
    ids = [int(i) for i in match.group(1).split(",")]
    rank = int(match.group(2))
    if rank >= len(ids):
        return None
    process = {d.id: d.process_index for d in jax.devices()}.get(ids[rank])
    return None if process is None else (process,)


def _label(call: object) -> str:
    """Returns what a wait is for, in words: a string as given, a replicated function as a step."""
    if isinstance(call, str):
        return call
    return f"the replicated step {str(call).strip('<>')}"


def _describe(seen: dict[str, Any], now: float) -> str:
    age = now - seen["time"]
    parts = []
    if seen["head"] is not None:
        parts.append(f"waiting for {seen['head']}")
    for call in seen["waiting"]:
        parts.append(f"waiting in {call}")
    if not parts:
        parts.append("in none of jmirror's cross-process waits")
    parts.append(f"{seen['dispatched']} cross-process calls dispatched, {seen['done']} completed")
    begun = seen.get("begun") or {}
    if begun:  # bounded waits other than steps: the input agreement, checkpoint barriers, ...
        waits = ", ".join(f"{label} ({count})" for label, count in sorted(begun.items()))
        parts.append(f"other cross-process waits begun: {waits}")
    text = "; ".join(parts)
    if age > STALE_S:
        text += f" (as of {age:.0f} s ago: it has not reported since; stuck or lost)"
    return text


def _say(text: str) -> None:
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _flush_and_exit(code: int) -> NoReturn:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _bounded_call(fn: Callable[[], str], limit_s: float) -> str:
    """`fn()`, or a note that it did not answer within `limit_s` (run only when timing out)."""
    result: list[str] = []

    def run() -> None:
        try:
            result.append(fn())
        except Exception as e:  # noqa: BLE001
            result.append(f"jmirror: could not ask the coordination service who is absent: {e}")

    thread = threading.Thread(target=run, name="jmirror-deadline-naming", daemon=True)
    thread.start()
    thread.join(limit_s)
    if not result:
        return "jmirror: the coordination service did not answer: no other process named."
    return result[0]


_WATCHDOG = _Watchdog()


def _started() -> _Watchdog:
    if not _WATCHDOG.threads:
        _WATCHDOG.start()
    return _WATCHDOG


def threads() -> tuple[threading.Thread, ...]:
    """Returns the threads this module started (none until a bounded or watched call)."""
    return _WATCHDOG.threads


class _Bounded:
    """The context of one bounded wait (see `bounded`)."""

    __slots__ = ("_wait", "_key")

    def __init__(self, wait: _Wait):
        self._wait = wait
        self._key = 0

    def __enter__(self) -> None:
        watchdog = _started()
        self._wait.started = time.monotonic()
        self._key = watchdog.add_wait(self._wait)
        _current().append(self._wait)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        _current().pop()
        _WATCHDOG.end_wait(self._key)
        if error is not None and _GLOO_RENDEZVOUS.search(str(error)):
            wait = self._wait
            _WATCHDOG.expire(_Wait(wait.call, wait.timeout_s, wait.setting, 0.0), cause=str(error))


_NO_BOUND = contextlib.nullcontext()
_THREAD = threading.local()  # each thread's bounded waits in progress, innermost last


def _current() -> list[_Wait]:
    try:
        return _THREAD.waits
    except AttributeError:
        _THREAD.waits = []
        return _THREAD.waits


def _restart_after_compiling(event: str, duration_secs: float, **kwargs: object) -> None:
    """Restarts the clock of this thread's innermost bounded wait when JAX traced, lowered or
    compiled something in this thread (a `jax.monitoring` listener: compilation and tracing
    are not waiting for other processes); a backend compilation ends its pause."""
    if event.startswith(_COMPILE_EVENTS):
        waits = getattr(_THREAD, "waits", None)
        if waits:
            waits[-1].started = time.monotonic()
            if event == _BACKEND_COMPILE_EVENT:
                waits[-1].paused = False


_COMPILE_EVENTS = "/jax/core/compile/"
_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def compiling() -> None:
    """Pauses this thread's innermost bounded wait: it starts tracing a new program, which
    JAX then compiles. The clock starts again when JAX's backend compilation in this thread
    ends (or when the wait ends). Called by `jmirror._tracing` for a new replica function
    signature, whose trace and compilation may take long, inside `jm.replicate`'s bound."""
    waits = getattr(_THREAD, "waits", None)
    if waits:
        waits[-1].paused = True


def bounded(
    call: object,
    timeout_s: float | None,
    *,
    setting: str = "jm.MultiWorkerMirroredStrategy",
    missing: Callable[[], str] | None = None,
) -> contextlib.AbstractContextManager[None]:
    """Bounds a wait of the caller's thread for other processes to `timeout_s` (None: none).

    Use it around a dispatch that may run (and wait) inline, and around a host read of a
    collective's result. Time JAX spends tracing or compiling inside it is not counted: the
    clock starts again after each of JAX's compilation events in this thread.

    Args:
      call: what is waited for, named in the message (its `str`, equal on every process).
      timeout_s: the bound in seconds, or None for no bound (then nothing is started).
      setting: where the bound is set, named in the message's fix.
      missing: a function that names the absent processes itself (when the coordination
        service cannot, e.g. before every process has joined it).
    """
    if timeout_s is None:
        return _NO_BOUND
    return _Bounded(_Wait(call, timeout_s, setting, 0.0, missing=missing))


def watch(token: PyTree, call: object, timeout_s: float | None, setting: str | None = None) -> None:
    """Bounds an asynchronous cross-process call recorded by its output `token`.

    Tracers and host values are not watched (nothing of jmirror's waits for them).
    """
    if timeout_s is None or not isinstance(token, jax.Array) or isinstance(token, jax.core.Tracer):
        return
    _started().watch(token, call, timeout_s, setting or "jm.MultiWorkerMirroredStrategy")


def expire(
    call: object,
    timeout_s: float,
    *,
    setting: str,
    absent: tuple[int, ...] | None = None,
) -> NoReturn:
    """Ends the process now, for a wait on `call` past its bound (e.g. a barrier's own
    timeout, whose error lists the `absent` processes)."""
    wait = _Wait(call, timeout_s, setting, time.monotonic() - timeout_s, absent=absent)
    _WATCHDOG.expire(wait)


def explain(error: BaseException) -> None:
    """Ends the process with jmirror's message if `error` is gloo's timeout for a peer that never
    reached the first collective (`GetKeyValue() timed out`, which names a key, not the peer);
    returns otherwise. For an uncaught error (see `jm.distributed.initialize`'s excepthook)."""
    if _GLOO_RENDEZVOUS.search(str(error)):
        first = _Wait("the first collective", 30.0, "gloo's rendezvous", time.monotonic(), seq=1)
        _WATCHDOG.expire(first, cause=str(error))
