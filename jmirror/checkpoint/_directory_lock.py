"""One `CheckpointManager` at a time per directory: refused at the second one's construction.

A manager owns its directory: opening one removes what killed saves left behind (hidden
directories, `_storage.clean`), and it lists the steps it finds as its own. A second manager
open on the same directory would remove the first one's write in progress (a step that
`save` had returned for is then lost) and the first would later fail with "check the
directory", never naming the rule. So the second one is a `ValueError` naming the directory
and the rule:

- in one process, a registry of the open managers' directories (resolved, so that a symlink
  or a relative path names the same one); a manager dropped without `close()` counts while
  it exists (its pending write keeps it alive);
- across processes, the writer of each manager (the one process that writes its checkpoints,
  see `_processes`) holds an exclusive `flock` on `<directory>/.jmirror-lock` while open,
  with its pid written in it for the message, and removes the file at `close()`. The kernel
  releases the lock when the process ends, however it ends, so a killed run never leaves
  the directory locked (only an unlocked file, taken over by the next manager). A directory
  where the file cannot be created (read-only: a manager that only restores) is not locked.
"""

from __future__ import annotations

import errno
import fcntl
import os
import pathlib
import threading
import weakref

LOCK_FILE = ".jmirror-lock"
_RULE = (
    "one CheckpointManager at a time per directory (a second one removes the first one's "
    "write in progress and lists steps it did not save)"
)
_OPEN: weakref.WeakValueDictionary[str, DirectoryLock] = weakref.WeakValueDictionary()
_LOCK = threading.Lock()
# Errors of creating the lock file in a directory a manager only reads from.
_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


class DirectoryLock:
    """A manager's claim on its directory; `release` (or garbage collection) gives it up."""

    def __init__(self, root: pathlib.Path, *, writer: bool) -> None:
        self._key = os.path.realpath(root)
        self._close_fd: weakref.finalize | None = None
        with _LOCK:
            if _OPEN.get(self._key) is not None:
                raise ValueError(
                    f"CheckpointManager({str(root)!r}): another CheckpointManager of this "
                    f"process is open on {self._key}; {_RULE}. Use the open manager, or call "
                    "its close() before opening a new one."
                )
            fd = _flock(root) if writer else None
            if fd is not None:
                self._close_fd = weakref.finalize(self, _unlock, root / LOCK_FILE, fd)
            _OPEN[self._key] = self

    def release(self) -> None:
        """Gives the directory up (idempotent)."""
        with _LOCK:
            if _OPEN.get(self._key) is self:
                del _OPEN[self._key]
        if self._close_fd is not None:
            self._close_fd()  # once: removes the file, closes it (which releases the flock)


def _flock(root: pathlib.Path) -> int | None:
    """Returns an open descriptor of the directory's lock file, locked; None where it is
    read-only."""
    path = root / LOCK_FILE
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as error:
            if error.errno in _NOT_WRITABLE:
                return None
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ValueError(
                f"CheckpointManager({str(root)!r}): another process (pid {holder}) has a "
                f"CheckpointManager open on {os.path.realpath(root)}; {_RULE}. Save this "
                "run's checkpoints to another directory, or end the other run first."
            ) from None
        if _is_file_at(fd, path):  # not a file its holder removed while this one opened it
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def _is_file_at(fd: int, path: pathlib.Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _unlock(path: pathlib.Path, fd: int) -> None:
    """Removes the lock file (while holding it, so no one else holds it) and closes it."""
    try:
        os.unlink(path)
    except OSError:  # the directory was removed or made read-only meanwhile
        pass
    os.close(fd)
