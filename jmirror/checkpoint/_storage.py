"""Checkpoint directories on disk: written by orbax, replaced and deleted atomically.

One checkpoint is one directory written by orbax's `Checkpointer` with a
`CompositeCheckpointHandler` of two items, `state` (`StandardSave` of a flat dict of host
arrays) and `jmirror` (`JsonSave` of the metadata document, see `_format`). Orbax writes it
under a hidden name (`.<name>.jmirror-new-<uuid>`, itself through orbax's own temporary
directory), jmirror adds its file list (`_integrity`), and the directory is renamed to
`<path>` when everything is written, so a directory named `<path>` is always complete: a
process killed during a save leaves only a hidden directory, which is never listed or
restored (and `clean` removes it). A failed save removes what it wrote; an I/O error is an
`OSError` with the OS's errno (`_integrity.os_error`). orbax runs in a daemon thread
(`_background.run_in_daemon_thread`), so that the threads it leaves behind after a failure
never keep the process from exiting.

Orbax stops short of what jmirror promises in two places, which this module adds:
- replacing (`force=True`): orbax deletes the old directory before writing the new one, so a
  kill in between loses both. Here the new checkpoint is written beside the old one and the two
  are swapped with one `renameat2(RENAME_EXCHANGE)` (Linux); elsewhere with two renames, where a
  kill between them leaves the new checkpoint under a hidden name and `<path>` missing.
- deleting: a checkpoint is first renamed to a hidden name (atomically invisible), then removed.

orbax always runs here for this process alone (`_checkpointer`): with several processes one
process writes and each reads for itself, and `_processes` orders them; orbax's own
multi-process barriers would be device collectives, which must not run from a background save.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import math
import operator
import os
import pathlib
import re
import shutil
import sys
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jmirror.checkpoint import _background, _format, _integrity

_NEW = ".jmirror-new-"
_DELETING = ".jmirror-deleting-"
_ORBAX_TMP = ".orbax-checkpoint-tmp"
_STEP = re.compile(r"0|[1-9][0-9]*")
_RENAME_EXCHANGE = 2
_METADATA_FILE = "metadata"  # the file of orbax's JsonSave in its item's directory
_AT_FDCWD = -100


def check_step(step: Any, call: str, maximum: int | None = None) -> int:
    """Returns `step` as an int of 0 or more (at most `maximum`), else the error naming `call`."""
    if isinstance(step, bool):
        raise TypeError(f"{call} expects an int step, got {step!r}.")
    try:
        step = operator.index(step)
    except TypeError:
        raise TypeError(
            f"{call} expects an int step, got {step!r} of type {type(step).__name__}."
        ) from None
    if step < 0:
        raise ValueError(f"{call} got step {step}; steps are non-negative ints.")
    if maximum is not None and step > maximum:
        raise ValueError(
            f"{call} got step {step}; steps are ints from 0 to {maximum} (JAX's preemption "
            "sync point counts them in a C int)."
        )
    return step


def as_path(directory: str | os.PathLike) -> pathlib.Path:
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(
            f"jm.checkpoint expects a directory as a str or os.PathLike, got "
            f"{type(directory).__name__}: {directory!r}."
        )
    return pathlib.Path(directory).absolute()


def write(
    path: pathlib.Path,
    arrays: dict[str, np.ndarray],
    doc: dict,
    *,
    force: bool,
    call: str = "jm.checkpoint.save",
) -> None:
    """Writes a checkpoint at `path`; with `force`, atomically replaces one that exists.

    The checkpoint is written under a hidden name (orbax's save, then jmirror's file list,
    see `_integrity`) and renamed to `path` when complete. An I/O error (a full disk, a
    read-only directory) is an `OSError` with the OS's errno, naming the directory; what the
    failed save wrote is removed.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise (_integrity.os_error(error, path.parent, call) or error) from error
    if path.exists() and not force:
        raise ValueError(f"{path} exists")  # the callers check first, with their own message
    _check_depth(doc, call)
    new = path.parent / f".{path.name}{_NEW}{uuid.uuid4().hex}"
    try:
        # The checksums are computed while orbax writes (crc32c and TensorStore release the
        # GIL), in one thread: it has the whole write to finish, and more threads would only
        # compete with orbax's for the cores.
        checksums = _background.start_daemon(
            lambda: _integrity.array_checksums(arrays, parallel=False)
        )
        _orbax_save(new, arrays, doc)
        _integrity.write_file_list(new, checksums())
    except BaseException as error:
        shutil.rmtree(new, ignore_errors=True)
        for tmp in path.parent.glob(f"{new.name}{_ORBAX_TMP}*"):
            shutil.rmtree(tmp, ignore_errors=True)
        converted = _integrity.os_error(error, path.parent, call)
        if converted is not None:
            raise converted from error
        raise
    if not path.exists():
        os.rename(new, path)
        return
    if _exchange(new, path):
        remove(new)  # now holds the old checkpoint
        return
    aside = path.parent / f".{path.name}{_DELETING}{uuid.uuid4().hex}"
    if path.exists():
        os.rename(path, aside)
    os.rename(new, path)
    _delete(aside)


def _check_depth(doc: dict, call: str) -> None:
    """Refuses metadata nested deeper than Python's JSON encoder, which recurses, can write
    (before orbax's save starts: its threads would fail midway)."""
    limit = sys.getrecursionlimit() - 100
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            raise ValueError(
                f"{call}: the state is nested too deeply for the checkpoint's metadata (JSON, "
                "which Python writes and reads recursively); nothing was written. Keep its "
                "nesting under a few hundred levels (a list of layers, not layers inside "
                "layers)."
            )
        children = (
            node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        )
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))


def _orbax_save(path: pathlib.Path, arrays: dict[str, np.ndarray], doc: dict) -> None:
    """Saves the two items with orbax; zero-size arrays (orbax refuses them) live in `doc`."""
    items: dict[str, Any] = {_format.METADATA_ITEM: ocp.args.JsonSave(doc)}
    stored = {name: a for name, a in arrays.items() if a.size}
    if stored:
        items[_format.STATE_ITEM] = ocp.args.StandardSave(stored)

    def save() -> None:
        with _checkpointer() as checkpointer:
            checkpointer.save(path, args=ocp.args.Composite(**items))

    # orbax's threads then are daemons: a failed save's leftovers never hold up the exit.
    with _quiet_orbax_errors():
        _background.run_in_daemon_thread(save)


class _OwnWriteErrors(logging.Filter):
    """Drops orbax's ERROR records about jmirror's own hidden write directories.

    A failed write (a full disk) makes each of orbax's threads log its exception with a
    traceback (`ERROR:absl:... _SignalingThread.run() raised an exception`) before the caller
    gets it; jmirror raises it as an `OSError` with the orbax error as its cause, so the
    blocks only repeat it. Only records logged from orbax's code whose message names a
    directory of jmirror's writes (`.<name>.jmirror-new-<uuid>`) are dropped: the program's
    own absl logging, and orbax's for other directories, pass.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or f"{os.sep}orbax{os.sep}" not in record.pathname:
            return True
        return _NEW not in record.getMessage()


_QUIET = _OwnWriteErrors()
_QUIET_LOCK = threading.Lock()
_QUIET_USERS = [0]  # writes in progress (several managers may write at once)


@contextlib.contextmanager
def _quiet_orbax_errors() -> Iterator[None]:
    """Makes absl's logger drop orbax's errors about jmirror's write while that write runs."""
    absl = logging.getLogger("absl")
    with _QUIET_LOCK:
        _QUIET_USERS[0] += 1
        if _QUIET_USERS[0] == 1:
            absl.addFilter(_QUIET)
    try:
        yield
    finally:
        with _QUIET_LOCK:
            _QUIET_USERS[0] -= 1
            if _QUIET_USERS[0] == 0:
                absl.removeFilter(_QUIET)


def _checkpointer() -> ocp.Checkpointer:
    """Returns an orbax checkpointer of this process alone (no barriers with other processes)."""
    me = jax.process_index()
    alone = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
    handler = ocp.CompositeCheckpointHandler(
        composite_options=ocp.CompositeOptions(multiprocessing_options=alone)
    )
    return ocp.Checkpointer(handler, multiprocessing_options=alone)


def _exchange(a: pathlib.Path, b: pathlib.Path) -> bool:
    """Swaps two directories in one step (Linux `renameat2`); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p]
    renameat2.argtypes += [ctypes.c_uint]
    result = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    return result == 0


def remove(path: pathlib.Path) -> None:
    """Deletes a checkpoint: renamed out of sight first, so it never shows half-deleted."""
    hidden = path.parent / f".{path.name}{_DELETING}{uuid.uuid4().hex}"
    os.rename(path, hidden)
    _delete(hidden)


def _delete(path: pathlib.Path) -> None:
    """Deletes a directory tree, or a file (what `force=True` replaced may be one)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def clean(root: pathlib.Path) -> None:
    """Removes what killed saves and deletions left in a manager's directory."""
    for entry in root.iterdir():
        name = entry.name
        if _DELETING in name or _NEW in name or _ORBAX_TMP in name:
            _delete(entry)


def steps(root: pathlib.Path) -> list[int]:
    """Returns the steps with a complete checkpoint under `root`, ascending: directories
    named by a step that hold a checkpoint's metadata (a directory `3/` of the user's own is
    not one, and `max_to_keep` never deletes it)."""
    if not root.is_dir():
        return []
    found = [
        int(p.name)
        for p in root.iterdir()
        if _STEP.fullmatch(p.name) and (p / _format.METADATA_ITEM).is_dir()
    ]
    return sorted(found)


def listing(directory: pathlib.Path) -> str:
    """Returns what exists at `directory`, for a `FileNotFoundError` message."""
    if directory.is_dir():
        names = sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))
        shown = ", ".join(names[:10]) + (", ..." if len(names) > 10 else "")
        return f"{directory} holds [{shown}]"
    if directory.exists():
        return f"{directory} is a file"
    parent = directory.parent
    while not parent.exists():
        parent = parent.parent
    return f"{directory} does not exist (the nearest existing directory is {parent})"


def read_document(path: pathlib.Path, call: str) -> Any:
    """Returns the metadata document of the checkpoint at `path`, parsed as JSON only."""
    if not (path / _format.METADATA_ITEM).is_dir():
        if path.is_dir() and steps(path):
            raise FileNotFoundError(
                f"{call}: {path} is not a checkpoint but holds the checkpoints of steps "
                f"{steps(path)}; restore one of them ({path / str(steps(path)[-1])}) or use "
                f"jm.checkpoint.CheckpointManager({str(path)!r}).restore()."
            )
        what = listing(path.parent) if not path.exists() else listing(path)
        raise FileNotFoundError(
            f"{call}: no jmirror checkpoint at {path}; {what}. Pass the directory given to "
            "jm.checkpoint.save."
        )
    if _integrity.has_file_list(path):
        _integrity.check_files(path)
    # orbax's JsonSave writes the document as one JSON file: read it as such (orbax's own
    # restore of it costs 1.5 ms of a restore); through orbax where the file is not there.
    document = path / _format.METADATA_ITEM / _METADATA_FILE
    try:
        if document.is_file():
            doc = json.loads(document.read_bytes().decode())
        else:
            with _checkpointer() as checkpointer:
                restored = checkpointer.restore(
                    path,
                    args=ocp.args.Composite(**{_format.METADATA_ITEM: ocp.args.JsonRestore()}),
                )
            doc = restored[_format.METADATA_ITEM]
    except Exception as error:  # JSON, Unicode and orbax errors of damaged metadata
        what = f"its metadata {_format.METADATA_ITEM}/{_METADATA_FILE}"
        raise _integrity.read_failed(str(path), what, error) from error
    if isinstance(doc, dict) and doc.get("version", 1) != 1 and not _integrity.has_file_list(path):
        raise _format.corrupt(str(path), f"its file list {_integrity.FILES} is missing")
    return doc


def read_arrays(path: pathlib.Path, specs: dict[str, jax.ShapeDtypeStruct], paths: dict) -> dict:
    """Returns the checkpoint's arrays as host numpy arrays of the given shapes and dtypes.

    orbax reads them as `jax.Array`s on the host CPU device (its faster path than reading
    numpy arrays); dtypes JAX cannot hold as they are (64-bit ones without
    `jax_enable_x64`) are read as numpy arrays. Zero-size arrays are not in orbax's files.
    A read that fails is a `CorruptCheckpointError` naming the leaf (`paths`: each array's
    leaf path) whose read failed.
    """
    stored = {name: spec for name, spec in specs.items() if math.prod(spec.shape)}
    out = {name: np.empty(spec.shape, spec.dtype) for name, spec in specs.items()}
    if not stored:
        return out
    try:
        out.update(_orbax_read(path, stored))
    except Exception as error:  # TensorStore's bare Exception, JSON errors of _METADATA, ...
        failing = [paths.get(name, name) for name in _failing_arrays(path, stored)]
        shown = ", ".join(failing[:5]) + (", ..." if len(failing) > 5 else "")
        what = f"the leaves {shown}" if failing else "its arrays"
        raise _integrity.read_failed(str(path), what, error) from error
    return out


def _failing_arrays(path: pathlib.Path, specs: dict[str, jax.ShapeDtypeStruct]) -> list[str]:
    """Returns the arrays that cannot be read alone, for the message (one file may hold several)."""
    failing = []
    for name, spec in specs.items():
        try:
            _orbax_read(path, {name: spec})
        except Exception:  # noqa: PERF203 (only after a failed read)
            failing.append(name)
    return failing


def _orbax_read(path: pathlib.Path, specs: dict[str, jax.ShapeDtypeStruct]) -> dict:
    try:
        host = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
    except RuntimeError:  # no CPU backend (JAX_PLATFORMS excludes it)
        host = None

    def abstract(spec: jax.ShapeDtypeStruct) -> Any:
        if host is None or jax.dtypes.canonicalize_dtype(spec.dtype) != spec.dtype:
            return np.empty(spec.shape, spec.dtype)
        return jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=host)

    targets = {name: abstract(spec) for name, spec in specs.items()}
    with _checkpointer() as checkpointer:
        restored = checkpointer.restore(
            path,
            args=ocp.args.Composite(**{_format.STATE_ITEM: ocp.args.StandardRestore(targets)}),
        )
    return {name: np.asarray(x) for name, x in restored[_format.STATE_ITEM].items()}
