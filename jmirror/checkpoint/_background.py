"""Background writes of a `CheckpointManager`, and their completion at interpreter exit.

A manager writes one step at a time in a thread of its own; the error of a write is kept
until the manager's next call raises it. At interpreter exit every pending write is waited
for, and an error that no call has raised is printed to stderr and makes the exit status 1,
whether or not the manager was closed (a normal end, `sys.exit`, an uncaught exception).

Where that wait runs matters. At exit CPython first runs `threading._shutdown`, which calls
the callbacks of `threading._register_atexit` in reverse order of registration, then joins
the non-daemon threads, and only then runs the `atexit` callbacks. `concurrent.futures`
registers such a callback when it is imported, and after it has run no executor accepts
work ("cannot schedule new futures after interpreter shutdown"); orbax writes through
executors. So the wait is a `threading._register_atexit` callback registered after
`concurrent.futures` is imported (below), which runs before concurrent.futures' own. The
exit status is set by an `atexit` callback: it shuts `jax.distributed` down when it is
running (as its own exit callback would), flushes `logging` and the standard streams, and
ends the process with status 1 only when a pending write failed. Both are installed when the
first background write starts, not when jmirror is imported.

Writer threads are daemon threads, and so are the threads orbax starts from them (a thread
is a daemon when the thread that starts it is one): a write that failed half-way may leave
an orbax thread waiting for a signal that never comes, which must not keep the process
from exiting (`_storage` runs a synchronous save in such a thread too).

Every wait for one of these threads waits on an event the thread sets as its last act, in
short polls, never on `Thread.join` / `is_alive`: a KeyboardInterrupt that lands inside
`Thread.join` can leave CPython (3.11) taking the thread for finished while it still runs,
and the write it was doing would then be taken as done and lost.
"""

from __future__ import annotations

import atexit
import concurrent.futures.process  # noqa: F401 (registers its exit callback before ours)
import concurrent.futures.thread  # noqa: F401 (registers its exit callback before ours)
import logging
import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import TypeVar

import jax

T = TypeVar("T")

# Writes that have a thread or an error nobody raised yet (strong references: a manager that
# was dropped without close() still has its write completed, or its error reported).
_PENDING: set[Background] = set()
_LOCK = threading.Lock()
_FAILED_AT_EXIT: list[str] = []
_POLL_S = 0.1  # joins poll, so that Ctrl-C interrupts a wait


class Background:
    """One manager's background write: at most one thread, and the error it left.

    Attributes:
      what: names the owner in messages, e.g. "CheckpointManager('/tmp/run')".
    """

    def __init__(self, what: str):
        self.what = what
        self._worker: _Worker | None = None
        self._error: BaseException | None = None
        self._step: int | None = None

    def start(self, step: int, work: Callable[[], None]) -> None:
        """Runs `work` in a daemon thread; its error is kept for `raise_error`."""
        _install_exit_hooks()
        self._step = step
        with _LOCK:
            _PENDING.add(self)
        self._worker = _Worker(work, f"jmirror-checkpoint-{step}")

    def raise_error(self, wait: bool) -> None:
        """Raises the error of the last write (waiting for the write first when `wait`)."""
        worker = self._worker
        if worker is not None and (wait or worker.done.is_set()):
            worker.wait()
            self._worker = None
            self._error = worker.error
        error, self._error = self._error, None
        if self._worker is None:
            with _LOCK:
                _PENDING.discard(self)
        if error is not None:
            raise error

    def finish_at_exit(self) -> None:
        """Waits for the write; prints an error nobody raised (and marks the exit failed)."""
        try:
            self.raise_error(wait=True)
        except BaseException as error:
            text = "".join(traceback.format_exception(error, chain=False)).rstrip()
            message = (
                f"jm.checkpoint: {self.what}: the background save of step {self._step} did "
                "not complete before the interpreter exited; that step is not saved (earlier "
                f"steps are untouched). Its error:\n{text}\n"
                "Call manager.close() (or use the manager as a context manager) before exiting "
                "to get this error as an exception."
            )
            _FAILED_AT_EXIT.append(message)
            print(message, file=sys.stderr, flush=True)


class _Worker:
    """`work` running in a daemon thread, with the event it sets when it has finished and
    what it returned or raised."""

    def __init__(self, work: Callable[[], object], name: str):
        self.done = threading.Event()
        self.result: object = None
        self.error: BaseException | None = None
        self._work = work
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.result = self._work()
        except BaseException as error:  # kept for whoever waits
            self.error = error
        finally:
            self.done.set()

    def wait(self) -> None:
        """Waits until the work has finished, in short polls (a KeyboardInterrupt still
        interrupts the wait, and the work is then still waited for by the next wait)."""
        while not self.done.wait(_POLL_S):
            pass

    def outcome(self) -> object:
        """Waits, then returns the work's result or raises its error."""
        self.wait()
        if self.error is not None:
            raise self.error
        return self.result


def run_in_daemon_thread(work: Callable[[], object]) -> object:
    """Runs `work` in a daemon thread and returns its result (or raises its error).

    Called from a daemon thread already, it runs `work` there.
    """
    if threading.current_thread().daemon:
        return work()
    return _Worker(work, "jmirror-checkpoint-io").outcome()


def start_daemon(work: Callable[[], T]) -> Callable[[], T]:
    """Starts `work` in a daemon thread; the returned function waits for its result."""
    worker = _Worker(work, "jmirror-checkpoint-crc")
    return lambda: worker.outcome()  # type: ignore[return-value]


def _finish_pending() -> None:
    """Completes every pending write (the `threading` exit callback)."""
    while True:
        with _LOCK:
            pending = list(_PENDING)
        if not pending:
            return
        for background in pending:
            background.finish_at_exit()
            with _LOCK:
                _PENDING.discard(background)


def _distributed_running() -> bool:
    is_initialized = getattr(jax.distributed, "is_initialized", None)
    return bool(is_initialized()) if is_initialized is not None else False


def _exit_status() -> None:
    """Ends the process with status 1 when a write failed at exit (the `atexit` callback)."""
    if not _FAILED_AT_EXIT:
        return
    # Installed when the first write started, this may run before jax.distributed's own exit
    # callback: shut the runtime down first, as a normal exit would, so that no other process
    # waits for this one.
    shutdown = getattr(jax.distributed, "shutdown", None)
    if shutdown is not None and _distributed_running():
        try:
            shutdown()
        except Exception:  # the exit status is what matters now
            pass
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(1)


_INSTALLED: list[bool] = []


def _install_exit_hooks() -> None:
    """Installs the waits at exit, once, when the first background write starts."""
    with _LOCK:
        if _INSTALLED:
            return
        _INSTALLED.append(True)
    atexit.register(_exit_status)
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(_finish_pending)
    else:  # not CPython: the best that remains, before the exit status is set
        atexit.register(_finish_pending)
