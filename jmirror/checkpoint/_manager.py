"""`CheckpointManager`: a series of checkpoints, saved in the background, resumed from the newest.

The directory holds one checkpoint per step, named by the step ("100", "200", ...), each
written by `_storage.write` (orbax, atomic). A save copies the state to the host in the
caller's thread and writes it in a background thread, one write at a time; the next call to
the manager raises an error of that write. Old steps beyond `max_to_keep` are deleted after
the new one is complete, each made invisible before it is removed.

With several processes (`jm.MultiWorkerMirroredStrategy`) every process calls the same methods
in the same order; each does the collectives of a save in its own calling thread, one process
writes (and deletes old steps), and every background write ends at a barrier of every
process, so that all of them list the same steps (see `_processes`).

orbax's own `CheckpointManager` is not used: it refuses to replace a step (`force` there only
overrides the interval), deletes a replaced step before writing the new one, and keeps its
own bookkeeping of steps; here the directory listing is the only truth, so a restarted
process sees exactly the complete checkpoints.
"""

from __future__ import annotations

import json
import os
from typing import Any

from jmirror._strategy import MirroredStrategy, get_strategy
from jmirror._values import PyTree
from jmirror.checkpoint import (
    _background,
    _checkpoint,
    _directory_lock,
    _integrity,
    _processes,
    _storage,
)
from jmirror.checkpoint._preemption import PreemptionMixin


def _positive_int(value: object, name: str, allow_none: bool) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"CheckpointManager({name}=...) expects an int{' or None' if allow_none else ''}, "
            f"got {value!r} of type {type(value).__name__}."
        )
    if value < 1:
        raise ValueError(f"CheckpointManager({name}={value}) must be at least 1.")
    return value


def _json_copy(data: PyTree) -> PyTree:
    try:
        return json.loads(json.dumps(data, allow_nan=False))
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"CheckpointManager.save(..., data=...) expects JSON-able data (dicts, lists, str, "
            f"int, finite float, bool, None) such as an iterator's .position; got {data!r} "
            f"({error})."
        ) from None


class CheckpointManager(PreemptionMixin):
    """Keeps a series of checkpoints of a training state, one per saved step.

    Saving copies the state off the devices and, with `async_save`, writes it in the
    background while training goes on. Each checkpoint appears only when complete; a run
    killed at any moment resumes from `latest_step()`, the newest complete one. Use it as a
    context manager, or call `close()`, to get the last write's error as an exception; a
    write still pending at interpreter exit is completed then (if it fails, its error is
    printed to stderr and the exit status is 1).

    With several processes (`jm.MultiWorkerMirroredStrategy`) every process opens the manager
    on the same directory and calls its methods in the same order: a save's collectives run
    in the calling thread, the first process writes and deletes, and every process sees the
    same steps. Each process saves its own `data`.

    Preemption: while it is open, the manager watches for SIGTERM (the cluster's notice before
    SIGKILL); `reached_preemption(step)` says when to save and exit, at the same step on every
    process, and `save_and_exit_if_preempted` does it (see `jmirror/checkpoint/_preemption.py`).

    Args:
      directory: the directory of the series (created if missing). One manager at a time
        per directory: opening one removes what killed saves left behind, so a second one
        open on it (in this process, or in another process's run) is a `ValueError`.
      strategy: the strategy the state lives on; `None` for `jm.get_strategy()` at each call.
      max_to_keep: keep only the newest `max_to_keep` steps; `None` keeps all.
      save_interval_steps: `save` writes only steps that are multiples of it (others return
        False), unless `force=True`.
      async_save: write in a background thread; `save` returns once the state is copied.

    Raises:
      TypeError, ValueError: for arguments of the wrong type or out of range.
      ValueError: another manager is open on `directory` (named, with the rule).

    Example:
        >>> import tempfile, numpy as np, jmirror as jm
        >>> strategy = jm.MirroredStrategy()
        >>> state = {"w": strategy.mirror(np.zeros(2))}
        >>> with jm.checkpoint.CheckpointManager(tempfile.mkdtemp(), max_to_keep=2) as manager:
        ...     for step in range(1, 4):
        ...         _ = manager.save(step, state, data={"batches": step})
        ...     manager.all_steps(), manager.data()
        ([2, 3], {'batches': 3})
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        strategy: MirroredStrategy | None = None,
        max_to_keep: int | None = None,
        save_interval_steps: int = 1,
        async_save: bool = True,
    ):
        self._max_to_keep = _positive_int(max_to_keep, "max_to_keep", allow_none=True)
        self._interval: int = _positive_int(save_interval_steps, "save_interval_steps", False) or 1
        if not isinstance(async_save, bool):
            raise TypeError(
                f"CheckpointManager(async_save=...) expects a bool, got {async_save!r}."
            )
        self._root = _storage.as_path(directory)
        self._root.mkdir(parents=True, exist_ok=True)
        self._strategy = strategy
        writer = self._group().is_writer
        self._lock = _directory_lock.DirectoryLock(self._root, writer=writer)
        try:
            if writer:  # others may already be waiting for its first write
                _storage.clean(self._root)
            self._async = async_save
            self._background = _background.Background(f"CheckpointManager({str(self._root)!r})")
            self._closed = False
            self._watch_preemption()  # SIGTERM: see reached_preemption
        except BaseException:  # e.g. the warning about a SIGTERM handler, as an error
            self._lock.release()
            raise

    @property
    def directory(self) -> str:
        """Returns the directory of the series, as an absolute path."""
        return str(self._root)

    def __repr__(self) -> str:
        return (
            f"CheckpointManager({str(self._root)!r}, max_to_keep={self._max_to_keep}, "
            f"save_interval_steps={self._interval}, async_save={self._async})"
        )

    def _current_strategy(self) -> MirroredStrategy:
        return self._strategy or get_strategy()

    def _group(self) -> _processes.Group:
        return _processes.Group.of(self._current_strategy())

    # --- background writes -------------------------------------------------------------------

    def _raise_error(self, wait: bool) -> None:
        """Raises the error of the last background write (waiting for it when `wait`)."""
        self._background.raise_error(wait)

    def _write(
        self,
        step: int,
        doc: dict,
        arrays: dict,
        force: bool,
        group: _processes.Group,
        keys: _processes.Keys,
    ) -> None:
        path = self._root / str(step)

        def write() -> None:
            _storage.write(path, arrays, doc, force=force, call="CheckpointManager.save")
            if self._max_to_keep is not None:
                for old in _storage.steps(self._root)[: -self._max_to_keep]:
                    _storage.remove(self._root / str(old))

        try:
            group.write(keys, write)
            if not group.is_writer and not self._is_written(step):
                raise group.not_written("CheckpointManager.save", path)
        except BaseException as error:
            if self._async:
                error.add_note(f"(raised by the background save of step {step} to {path})")
            raise

    def _is_written(self, step: int) -> bool:
        """Returns whether `step` is saved, or was and `max_to_keep` newer steps replaced it."""
        steps = _storage.steps(self._root)
        if step in steps:
            return True
        return self._max_to_keep is not None and sum(s > step for s in steps) >= self._max_to_keep

    def wait_until_finished(self) -> None:
        """Blocks until the background write (if any) is complete; raises its error.

        Example:
            >>> import tempfile, jmirror as jm
            >>> manager = jm.checkpoint.CheckpointManager(tempfile.mkdtemp())
            >>> manager.save(0, {"n": 1})
            True
            >>> manager.wait_until_finished()
            >>> manager.close()
        """
        self._raise_error(wait=True)

    def close(self) -> None:
        """Waits for the background write and releases the manager; raises a write's error.

        Example:
            >>> import tempfile, jmirror as jm
            >>> manager = jm.checkpoint.CheckpointManager(tempfile.mkdtemp())
            >>> manager.close()
        """
        try:
            self._raise_error(wait=True)
        finally:
            self._closed = True
            self._stop_watching_preemption()
            self._lock.release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- saving ------------------------------------------------------------------------------

    def save(self, step: int, state: PyTree, *, data: PyTree = None, force: bool = False) -> bool:
        """Saves `state` (and `data`, e.g. an input position) as checkpoint `step`.

        Args:
          step: a non-negative int.
          state: as for `jm.checkpoint.save`.
          data: JSON-able data saved with the step, e.g. `iterator.position`; with several
            processes each process saves its own.
          force: replace the step if it exists (atomically), and save even a step that
            `save_interval_steps` would skip. The preemption step (`reached_preemption`) is
            saved whatever the interval says, and is not an error when it is already saved.

        Returns:
          True when the step is saved (or being saved), False when the interval skips it.

        Raises:
          ValueError: the step exists and `force` is False; a leaf is a deleted (donated)
            array.
          TypeError: a leaf cannot be stored (raised before anything is written).
          OSError: the directory is read-only, or the disk is full (for an async save, raised
            by the next call), with the OS's errno.
          RuntimeError: the manager is closed.
          Exception: the error of an earlier background write, with its own type.

        Example:
            >>> import tempfile, jmirror as jm
            >>> with jm.checkpoint.CheckpointManager(
            ...     tempfile.mkdtemp(), save_interval_steps=10
            ... ) as manager:
            ...     manager.save(5, {"n": 1}), manager.save(10, {"n": 1})
            (False, True)
        """
        if self._closed:
            raise RuntimeError(
                "CheckpointManager.save was called after close(); open a new "
                f"CheckpointManager({str(self._root)!r})."
            )
        step = _storage.check_step(step, "CheckpointManager.save")
        self._raise_error(wait=False)
        if step % self._interval != 0 and not force and not self._is_preemption_step(step):
            return False
        data = _json_copy(data)
        self._raise_error(wait=True)  # one write at a time: the previous one first
        path = self._root / str(step)
        if path.exists() and not force:
            if self._is_preemption_step(step):  # already saved, e.g. by the interval
                return True
            raise ValueError(
                f"CheckpointManager.save: step {step} exists in {self._root}. Pass force=True "
                "to replace it (atomically), or save a new step."
            )
        strategy = self._current_strategy()
        group = _processes.Group.of(strategy, "CheckpointManager.save")
        keys = group.keys(f"{self._root}/{step}")
        # Every process's data first, through the coordination service: no process issues a
        # collective of this save before every process has arrived at it. Then the save's
        # collectives, in this thread: the reads and gathers.
        process_data = group.gather_json(data, keys)
        doc, arrays = _checkpoint.encode(state, strategy, group, process_data)
        if group.size == 1:  # an async save's OSError too comes from this call, if it can
            _integrity.check_writable(self._root, "CheckpointManager.save")
        if not self._async:
            self._write(step, doc, arrays, force, group, keys)
            return True
        self._background.start(step, lambda: self._write(step, doc, arrays, force, group, keys))
        return True

    # --- reading -----------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Returns the steps with a complete checkpoint, ascending (after the pending write).

        Example:
            >>> import tempfile, jmirror as jm
            >>> jm.checkpoint.CheckpointManager(tempfile.mkdtemp()).all_steps()
            []
        """
        self._raise_error(wait=True)
        return _storage.steps(self._root)

    def latest_step(self) -> int | None:
        """Returns the newest step with a complete checkpoint, or None.

        Example:
            >>> import tempfile, jmirror as jm
            >>> print(jm.checkpoint.CheckpointManager(tempfile.mkdtemp()).latest_step())
            None
        """
        steps = self.all_steps()
        return steps[-1] if steps else None

    def _path(self, step: int | None, call: str) -> Any:
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(
                    f"{call}: no checkpoint in {self._root} yet; "
                    f"{_storage.listing(self._root)}. Save a step first."
                )
            step = steps[-1]
        step = _storage.check_step(step, call)
        if step not in steps:
            raise FileNotFoundError(
                f"{call}: no checkpoint of step {step} in {self._root}; the saved steps are "
                f"{steps}."
            )
        return self._root / str(step)

    def restore(self, step: int | None = None, target: PyTree = None) -> PyTree:
        """Restores the checkpoint of `step` (the latest when None), see `jm.checkpoint.restore`.

        Raises:
          FileNotFoundError: no such step (the message lists the saved ones).
          CorruptCheckpointError: the step is damaged; a damaged newest step is never
            skipped silently (the message names the newest other step that is complete).

        Example:
            >>> import tempfile, jmirror as jm
            >>> with jm.checkpoint.CheckpointManager(tempfile.mkdtemp()) as manager:
            ...     _ = manager.save(7, {"lr": 0.5})
            ...     manager.restore()
            {'lr': 0.5}
        """
        path = self._path(step, "CheckpointManager.restore")
        strategy = self._current_strategy()
        return _checkpoint.read(path, target, strategy, "CheckpointManager.restore")

    def data(self, step: int | None = None) -> PyTree:
        """Returns the `data` saved with `step` (the latest when None), e.g. an input position.

        With several processes each process reads the data it saved. A step saved by another
        number of processes reads the same on every process when all saved the same data (an
        input position is the same on every process); otherwise it is a `ValueError`.

        Example:
            >>> import tempfile, jmirror as jm
            >>> with jm.checkpoint.CheckpointManager(tempfile.mkdtemp()) as manager:
            ...     _ = manager.save(1, {}, data={"epoch": 0, "batches": 12})
            ...     manager.data(1)
            {'epoch': 0, 'batches': 12}
        """
        path = self._path(step, "CheckpointManager.data")
        return _checkpoint.read_data(path, "CheckpointManager.data", self._group())
