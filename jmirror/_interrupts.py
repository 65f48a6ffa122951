"""Keyboard interrupts held back while a replicated call runs, so that none loses state.

Python delivers SIGINT (Ctrl-C, Jupyter's "interrupt kernel", `_thread.interrupt_main()`) to
the main thread at the next bytecode, wherever it is: between a step donating its arguments
and returning its result, halfway through writing an NNX model's new values back, or just
after the call returned and before `state = step(state)` has stored the result. Each loses
the caller's state. So while a call is inside `HELD` in the main thread, jmirror's SIGINT
handler only notes the signal. When the call returns, the handler that was installed before
jmirror's runs (for Python's default one: `KeyboardInterrupt` is raised) at the caller's next
line: the statement that called jmirror has completed, its result is stored. (That is a line
event of the caller's frame, through `sys.settrace` for that one line; a tracer already
installed, a debugger's, is put back before the interrupt is raised.) A call that raises
delivers the interrupt at once.

The handler is installed by the first call in the main thread, over a Python handler only
(never over `SIG_DFL` or `SIG_IGN`), and chains the one it replaced; a handler the program
installs later replaces it, and calls then hold nothing back. In other threads, where Python
delivers no signal, `HELD` does nothing.
"""

from __future__ import annotations

import inspect
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

_MAIN_THREAD = threading.main_thread().ident
try:  # CPython's own: `signal.getsignal` without its enum conversion (2 µs of every call)
    from _signal import getsignal as _getsignal  # pyright: ignore[reportMissingImports]
except ImportError:  # another Python
    _getsignal = signal.getsignal
_SIGINT = int(signal.SIGINT)
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


class _Held:
    """A context manager: SIGINT held back while it is entered in the main thread."""

    def __init__(self):
        self.depth = 0
        self.pending: tuple[int, FrameType | None] | None = None
        self.chained: Callable[[int, FrameType | None], Any] | None = None
        self.handler = self._handle  # one bound method, to recognise it as installed

    def __enter__(self) -> None:
        if threading.get_ident() != _MAIN_THREAD:
            return
        if self.depth == 0 and _getsignal(_SIGINT) is not self.handler:
            self._install()
        self.depth += 1

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if threading.get_ident() != _MAIN_THREAD:
            return
        self.depth -= 1
        if self.depth == 0 and self.pending is not None:
            caller = _caller_frame()
            if kind is not None or caller is None:
                signum, frame = self.pending
                self.pending = None
                self._deliver(signum, frame)
            else:
                self._deliver_at_next_line(caller)

    def _deliver_at_next_line(self, caller: FrameType) -> None:
        """Delivers the pending interrupt at `caller`'s next line event (or its return)."""
        previous, previous_local = sys.gettrace(), caller.f_trace
        signum, frame = self.pending  # type: ignore[misc]

        def at_line(traced: FrameType, event: str, arg: object) -> Any:
            if event not in ("line", "return"):
                return at_line
            traced.f_trace = previous_local
            sys.settrace(previous)
            if self.pending is not None:
                self.pending = None
                self._deliver(signum, frame)
            return previous_local

        caller.f_trace = at_line
        sys.settrace(_no_new_frames)

    def _install(self) -> None:
        current = signal.getsignal(signal.SIGINT)
        if callable(current):
            self.chained = current
            signal.signal(signal.SIGINT, self.handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        """Handles SIGINT for jmirror: notes it while a call runs, else calls the chained
        handler."""
        if self.depth > 0:
            self.pending = (signum, frame)
            return
        self._deliver(signum, frame)

    def _deliver(self, signum: int, frame: FrameType | None) -> None:
        chained = self.chained if self.chained is not None else signal.default_int_handler
        chained(signum, frame)


HELD = _Held()


def _no_new_frames(frame: FrameType, event: str, arg: object) -> None:
    """Serves as the global tracer while an interrupt waits for the caller's next line: it traces no
    frame but the caller's."""
    return None


def _caller_frame() -> FrameType | None:
    """Returns the innermost frame outside jmirror: the code that called it."""
    frame = inspect.currentframe()
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
    return frame
