"""Preemption: a SIGTERM seen by any process, and the one step at which every process saves.

Clusters (SLURM, Kubernetes, preemptible VMs) announce the end of a job with SIGTERM and kill
it with SIGKILL some seconds later (about 30). TensorFlow's `PreemptionCheckpointHandler` and
orbax's `CheckpointManager` then save one checkpoint, at the same step on every worker, and
exit. `CheckpointManager` does the same through `reached_preemption(step)`:

- One process (no `jax.distributed`): the manager installs a SIGTERM handler (in the main
  thread only; elsewhere `signal` cannot) that records the notice and calls the handler that
  was there before, if it was a Python function (a handler set outside Python, which Python
  can neither call nor put back, is left in place, and nothing is watched). The first
  `reached_preemption(step)` after the notice is True, and so is every later one. A second
  SIGTERM ends the process as it would have without the manager, when no handler of the
  program's was there. One handler serves every manager open in the process (a registry of
  open managers), so managers close in any order (one opened to restore pretrained weights,
  closed before the training manager, leaves the training manager watching); closing the
  last one puts the previous handler back (when no other handler was installed on top of it
  since).
- Several processes (`jax.distributed`, e.g. `jm.distributed.initialize` under
  `python -m jmirror.launch`): JAX's runtime already catches SIGTERM (its preemption notifier,
  installed by `jax.distributed.initialize`), tells every process through its coordination
  service, and agrees on a step: the largest step any process has reached, plus one
  (`jax.experimental.multihost_utils.reached_preemption_sync_point`). The manager installs
  nothing then, and `reached_preemption(step)` asks JAX; it is True at that step on every
  process, and from then on. So every process must call it at every step, from the same first
  step (a resumed run starts from the same `latest_step()` everywhere). JAX counts from 0, so
  a notice that came before the first call would be agreed at step 1, which a resumed run
  never reaches: the first manager of a process therefore asks JAX whether that happened
  (then the run's first step is the preemption step) and sets JAX's counter to
  `latest_step()`. A Python SIGTERM
  handler installed after `jm.distributed.initialize` replaces JAX's, and the notice then never
  reaches the other processes: the manager warns about it.

The notice and the agreed step belong to the process (a signal does), so several managers
agree. `manager.save(step, ...)` at the agreed step saves even when `save_interval_steps`
would skip it, and returns True without writing when the step is already saved (e.g. by the
interval just before), so the documented loop works whatever the interval:

    if manager.reached_preemption(step):
        manager.save(step, state, data=iterator.position)
        manager.close()
        sys.exit(0)

which is what `manager.save_and_exit_if_preempted(step, state, data=...)` does.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import warnings
import weakref
from types import FrameType
from typing import NoReturn

import jax
from jax.experimental import multihost_utils

from jmirror import distributed
from jmirror._values import PyTree
from jmirror.checkpoint import _storage

_MAX_STEP = 2**31 - 1  # JAX's sync point counts steps in a C int


class _Notice:
    """The process's preemption state: whether SIGTERM came, and the agreed step."""

    received = False  # a SIGTERM reached a handler of a manager (one process)
    step: int | None = None  # the step from which reached_preemption is True
    primed = False  # JAX's step counter was set when the first manager opened
    before_any_step = False  # JAX agreed on a preemption before this run's first step


_NOTICE = _Notice()


def _jax_runs_the_notice() -> bool:
    """Returns whether JAX's distributed runtime is up: then its preemption service has the notice.

    (With `jax_enable_preemption_service` turned off there is none, and `reached` says so:
    a flag of this process alone would let the processes disagree.)
    """
    return jax.distributed.is_initialized()


# The open managers' watches of this process (the main thread's); a manager dropped without
# close() leaves it when it is collected.
_OPEN: weakref.WeakSet[Watch] = weakref.WeakSet()


class _Handler:
    """The process's SIGTERM handler: records the notice while any manager watches, then
    calls the previous (Python) handler.

    One handler serves every open manager (a registry, `_OPEN`), so managers may close in
    any order: a manager closed while another is open changes nothing, and the last one
    to close puts the previous handler back when ours is still on top.
    """

    def __init__(self, previous: PyTree) -> None:
        self.previous = previous
        self.seen = 0

    def __call__(self, number: int, frame: FrameType | None) -> None:
        self.seen += 1
        if _OPEN:
            _NOTICE.received = True
        if callable(self.previous):
            self.previous(number, frame)
        elif self.previous == signal.SIG_DFL and (self.seen > 1 or not _OPEN):
            # A second SIGTERM (or one after every manager closed): end the process as
            # SIGTERM would have.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)


class Watch:
    """One manager's watch for SIGTERM: registered with the process's handler, released by
    `close`."""

    def __init__(self) -> None:
        self._open = False
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can be set in the main thread only
        current = signal.getsignal(signal.SIGTERM)
        if _jax_runs_the_notice():
            if current is not distributed.sigterm_handler_after_initialize():
                warnings.warn(
                    f"jm.checkpoint.CheckpointManager: a Python SIGTERM handler ({current!r}) "
                    "was installed after jax.distributed started, replacing JAX's preemption "
                    "notifier, so a SIGTERM will not reach reached_preemption() on any "
                    "process. Install it before jm.distributed.initialize(), or remove it.",
                    RuntimeWarning,
                    stacklevel=4,  # the caller of CheckpointManager(...)
                )
            return
        if current is None:  # a handler set outside Python: it cannot be chained or restored
            return
        if not isinstance(current, _Handler):  # ours is not on top: chain what is there
            signal.signal(signal.SIGTERM, _Handler(current))
        _OPEN.add(self)
        self._open = True

    def close(self) -> None:
        """Stops watching; the last open watch puts the previous handler back if ours is on
        top (otherwise another handler chains to ours: ours stays, passing signals on)."""
        if not self._open:
            return
        self._open = False
        _OPEN.discard(self)
        if _OPEN or threading.current_thread() is not threading.main_thread():
            return
        current = signal.getsignal(signal.SIGTERM)
        while isinstance(current, _Handler):
            signal.signal(signal.SIGTERM, current.previous)
            current = current.previous


def prime(latest: int | None) -> None:
    """Sets JAX's step counter to `latest` (the step a resumed run starts after), once.

    JAX agrees on one past the largest step any process last gave its sync point; a notice
    that comes before the first call would make that step 1 (every counter is 0), which a run
    resumed at step 13 never reaches: the notice would be lost. So the first manager of the
    process first asks whether that already happened (then the run's first step is the
    preemption step, on every process alike), then gives JAX `latest`.
    """
    if _NOTICE.primed or not _jax_runs_the_notice():
        return
    _NOTICE.primed = True
    try:
        if multihost_utils.reached_preemption_sync_point(1):
            _NOTICE.before_any_step = True
        multihost_utils.reached_preemption_sync_point(min(latest or 0, _MAX_STEP))
    except RuntimeError:  # the preemption service is off: reached() says so when asked
        pass


def reached(step: int) -> bool:
    """Returns whether `step` is (or is after) the agreed preemption step; see the module
    docstring."""
    if _NOTICE.step is not None:
        return step >= _NOTICE.step
    if _NOTICE.before_any_step:
        agreed = True
    elif _jax_runs_the_notice():
        try:
            agreed = multihost_utils.reached_preemption_sync_point(step)
        except RuntimeError as error:
            raise RuntimeError(
                "CheckpointManager.reached_preemption needs JAX's preemption service across "
                f"processes, which is off ({error}). Leave jax_enable_preemption_service at "
                "its default (True) before jm.distributed.initialize()."
            ) from None
    else:
        agreed = _NOTICE.received
    if agreed:
        _NOTICE.step = step
    return bool(agreed)


class PreemptionMixin:
    """`CheckpointManager`'s preemption methods (the manager's own state stays in the manager)."""

    _preemption: Watch | None = None

    def _watch_preemption(self) -> None:
        self._preemption = Watch()
        if _jax_runs_the_notice() and not _NOTICE.primed:
            try:
                latest = self.latest_step()  # type: ignore[attr-defined]
            except Exception:  # a damaged directory: restore() will say so
                latest = None
            prime(latest)

    def _stop_watching_preemption(self) -> None:
        if self._preemption is not None:
            self._preemption.close()

    def _is_preemption_step(self, step: int) -> bool:
        """Returns whether `step` is the agreed preemption step (a save there ignores the
        interval)."""
        return _NOTICE.step is not None and step == _NOTICE.step

    def reached_preemption(self, step: int) -> bool:
        """Returns whether to save and exit at `step` because a preemption notice (SIGTERM) came.

        False until SIGTERM reached some process of the run, then True from one step on: the
        same step on every process (with several processes, one past the furthest step any of
        them had reached when the notice came; JAX's preemption sync point). Call it at every
        step, on every process, with the same steps. `save(step, ...)` at that step saves even
        when `save_interval_steps` would skip it (and returns True without writing when the
        step is already saved), so save, `close()` and exit there (or call
        `save_and_exit_if_preempted`). A platform sends SIGKILL some time after SIGTERM (about
        30 s on SLURM and Kubernetes; `--grace-period` under `python -m jmirror.launch`): the
        save must fit in it. See `jmirror/checkpoint/_preemption.py` for how SIGTERM is
        watched.

        Args:
          step: the current step, a non-negative int, increasing from call to call.

        Returns:
          True at and after the agreed preemption step, else False.

        Raises:
          TypeError, ValueError: `step` is not an int from 0 to 2**31 - 1.

        Example:
            >>> import sys, tempfile, jmirror as jm
            >>> with jm.checkpoint.CheckpointManager(tempfile.mkdtemp()) as manager:
            ...     for step in range(1, 4):
            ...         state = {"step": step}  # train one step here
            ...         if manager.reached_preemption(step):
            ...             manager.save(step, state)
            ...             manager.close()
            ...             sys.exit(0)
            ...     manager.reached_preemption(3)
            False
        """
        return reached(_storage.check_step(step, "CheckpointManager.reached_preemption", _MAX_STEP))

    def save_and_exit_if_preempted(self, step: int, state: PyTree, *, data: PyTree = None) -> bool:
        """Saves `state`, closes the manager and exits with status 0 at the preemption step.

        Exactly `if manager.reached_preemption(step): manager.save(step, state, data=data);
        manager.close(); sys.exit(0)`: call it at every step, after the step's update. The
        exit is `sys.exit(0)` (`SystemExit`), so `finally` blocks and context managers run.

        Args:
          step: the current step, as for `reached_preemption`.
          state: the state to save, as for `save`.
          data: JSON-able data saved with it, e.g. the input iterator's `.position`.

        Returns:
          False when `step` is not (yet) the preemption step; otherwise it does not return.

        Raises:
          SystemExit: with code 0, after saving, at the preemption step.

        Example:
            >>> import tempfile, jmirror as jm
            >>> with jm.checkpoint.CheckpointManager(tempfile.mkdtemp()) as manager:
            ...     manager.save_and_exit_if_preempted(1, {"w": 1.0}, data={"batches": 1})
            False
        """
        if not self.reached_preemption(step):
            return False
        self.save(step, state, data=data)  # type: ignore[attr-defined]
        self.close()  # type: ignore[attr-defined]
        _exit()


def _exit() -> NoReturn:
    sys.exit(0)
