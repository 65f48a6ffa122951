"""Counts the XLA compilations each replicated function's calls cause.

JAX reports every backend compilation through `jax.monitoring` (the event
`/jax/core/compile/backend_compile_duration`, on the thread that compiles, inside the call
that needed it). A replicated call marks itself as the thread's current call while it runs
its `jax.jit`; the one listener, registered the first time a counter is made, adds each
compilation to the current call's counter. Nothing is recorded at trace time, a call traced
by the caller's own transformation compiles nothing of its own, and `.lower()` compiles
nothing: neither counts.
"""

from __future__ import annotations

import threading

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

_current = threading.local()
_registered = False
_lock = threading.Lock()


class Counter:
    """The number of compilations of one replicated function's calls; as a context manager,
    counts the compilations inside the block as its own (`with counter: ...`)."""

    __slots__ = ("count", "_outer")

    def __init__(self):
        self.count = 0
        self._outer: list[Counter | None] = []
        _register()

    def __enter__(self) -> Counter:
        self._outer.append(getattr(_current, "counter", None))
        _current.counter = self
        return self

    def __exit__(self, *exc: object) -> None:
        _current.counter = self._outer.pop()


def _listen(event: str, duration_secs: float, **kwargs: object) -> None:
    if event == BACKEND_COMPILE_EVENT:
        counter = getattr(_current, "counter", None)
        if counter is not None:
            counter.count += 1


def _register() -> None:
    global _registered
    with _lock:
        if not _registered:
            jax.monitoring.register_event_duration_secs_listener(_listen)
            _registered = True
