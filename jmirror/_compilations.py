"""Counts the XLA compilations each replicated function's calls cause.

JAX reports every backend compilation through `jax.monitoring` (the event
`/jax/core/compile/backend_compile_duration`, on the thread that compiles, inside the call
that needed it). One listener, registered the first time a replicated function is made,
counts them per thread; a replicated call reads its thread's count before and after its
`jax.jit` and keeps the difference as its own. Nothing is recorded at trace time, and
`.lower()` compiles nothing.
"""

from __future__ import annotations

import threading

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

_thread = threading.local()
_registered: list[bool] = []
_lock = threading.Lock()


def on_this_thread() -> int:
    """Returns how many compilations this thread has made since the listener was registered."""
    return getattr(_thread, "count", 0)


def register() -> None:
    """Registers the listener that counts compilations per thread (once)."""
    with _lock:
        if not _registered:
            jax.monitoring.register_event_duration_secs_listener(_listen)
            _registered.append(True)


def _listen(event: str, duration_secs: float, **kwargs: object) -> None:
    if event == BACKEND_COMPILE_EVENT:
        _thread.count = getattr(_thread, "count", 0) + 1
