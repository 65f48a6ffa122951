"""Integrity of a checkpoint on disk: array checksums, the list of files, and errors named.

One record makes damage visible: `_JMIRROR_FILES` at the top of the checkpoint, written by
the writer (in the background thread for an async save) after orbax's save and before the
checkpoint is renamed into place. It holds
- every array's checksums: the CRC-32C (Castagnoli, the hardware CRC of SSE 4.2 and ARMv8,
  computed by Google's `crc32c` library that the `google-crc32c` package ships) of each
  `PIECE`-byte piece of its bytes in C order, a list per array, computed while orbax writes
  and verified on the arrays as restored, the pieces over a few threads: a flipped bit
  anywhere in orbax's files that still decodes is caught there, and named by its leaf path;
- every file orbax wrote, with its size (and the CRC-32C of each small file: the metadata,
  manifests and small arrays): a truncated, empty or missing file, or damaged metadata, is
  named before anything is read.

Checkpoints of format version 2 hold one `zlib.crc32` per array and a `crc32` per small file
instead; they are verified with those (`CRC32`), so they still restore whole. CRC-32C is the
checksum of TensorFlow's bundles and of TensorStore; here it runs about 3x faster than
`zlib.crc32`, which made verification most of the cost a restore adds to orbax's.

orbax checksums only the index of each zarr shard (`crc32c` in its index codecs), not the
array data, and offers no option to add one, so the array checksums are jmirror's own.

Errors from the layers below (TensorStore's bare `Exception`, `UnicodeDecodeError`,
`JSONDecodeError`, orbax's `ValueError`s) while reading a checkpoint become a
`CorruptCheckpointError` that names the step, the file or leaf, and what to do.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import ctypes.util
import errno as errno_module
import glob
import json
import os
import pathlib
import re
import zlib
from collections.abc import Callable
from typing import Any

import google_crc32c
import jax
import numpy as np

from jmirror._values import PyTree
from jmirror.checkpoint._format import CorruptCheckpointError, corrupt

FILES = "_JMIRROR_FILES"
CRC32C = "crc32c"  # the checksums of format version 3 (what is written)
CRC32 = "crc32"  # those of format version 2 (still verified)
PIECE = 4 << 20  # CRC-32C: one checksum per piece of this many bytes (verified in parallel)
_SMALL_FILE = 1 << 20  # files up to this size are checksummed whole in the file list
_OS_ERROR = re.compile(r"os_error_code\D{0,4}(\d+)|\[OS error (\d+)|errno[ =:]+(\d+)", re.I)


def _load_crc32c() -> Callable[[Any], int]:
    """Returns the CRC-32C of a bytes-like object without copying it: `crc32c_value` of the C
    library that `google-crc32c` ships, called through `ctypes` (which lets go of the GIL, so pieces
    run in parallel); where that library is not found, `google_crc32c.value` of a copy."""
    package = os.path.dirname(google_crc32c.__file__)
    candidates = sorted(glob.glob(os.path.join(package, "..", "google_crc32c.libs", "libcrc32c*")))
    candidates += sorted(glob.glob(os.path.join(package, "libcrc32c*")))
    candidates += [ctypes.util.find_library("crc32c") or ""]
    for path in filter(None, candidates):
        try:
            value = ctypes.CDLL(path).crc32c_value
        except (OSError, AttributeError):
            continue
        value.restype = ctypes.c_uint32
        value.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

        def crc32c(data: PyTree, value: PyTree = value) -> int:
            view = np.frombuffer(data, np.uint8)
            return int(value(view.ctypes.data, view.nbytes))

        return crc32c
    return lambda data: int(google_crc32c.value(bytes(data)))


_CRC32C = _load_crc32c()


def crc32c(data: PyTree) -> int:
    """Returns the CRC-32C of a bytes-like object (a contiguous buffer)."""
    return _CRC32C(data)


def checksum(array: np.ndarray) -> int:
    """Returns the CRC-32 of an array's bytes in C order (any dtype, any size): format version 2."""
    return zlib.crc32(_bytes(array))


def piece_checksums(array: np.ndarray) -> list[int]:
    """Returns the CRC-32C of each `PIECE`-byte piece of an array's bytes in C order (one, of no
    bytes, for an empty array)."""
    view = _bytes(array)
    return [crc32c(view[i : i + PIECE]) for i in range(0, max(view.nbytes, 1), PIECE)]


def array_checksums(
    arrays: dict[str, np.ndarray], kind: str = CRC32C, parallel: bool = True
) -> dict[str, Any]:
    """Returns the checksums of each array, as a checkpoint of that `kind` stores them: a list of
    the pieces' CRC-32C (`CRC32C`), or one CRC-32 (`CRC32`); computed over a few threads
    (one per core, at most `_MAX_THREADS`) when the arrays are large and `parallel`."""
    if kind == CRC32:
        return parallel_checksums(arrays)
    if not parallel:
        return {name: piece_checksums(array) for name, array in arrays.items()}
    views = {name: _bytes(array) for name, array in arrays.items()}
    pieces = [
        (name, view[i : i + PIECE])
        for name, view in views.items()
        for i in range(0, max(view.nbytes, 1), PIECE)
    ]
    out: dict[str, Any] = {name: [] for name in views}
    for (name, _), crc in zip(pieces, _map(crc32c, [piece for _, piece in pieces], views)):
        out[name].append(crc)
    return out


def _map(fn: Callable[[Any], int], parts: list[Any], views: dict[str, Any]) -> list[int]:
    """Returns `fn` of each part, over a few threads when the arrays are large; the threads are
    joined before it returns."""
    threads = min(_MAX_THREADS, _cores(), len(parts))
    if threads < 2 or sum(v.nbytes for v in views.values()) < _PARALLEL_BYTES:
        return [fn(part) for part in parts]
    with concurrent.futures.ThreadPoolExecutor(threads, "jmirror-checkpoint-crc") as pool:
        return list(pool.map(fn, parts))


def saved_checksums(root: pathlib.Path, kind: str = CRC32C) -> dict[str, Any]:
    """Returns the checksums of each array, from the file list (checked by `check_files` first): a
    list of piece CRC-32Cs each (`CRC32C`), or one CRC-32 each (`CRC32`)."""
    table = _read_list(root).get("arrays")

    def valid(v: object) -> bool:
        return type(v) is int and 0 <= v < 2**32

    if kind == CRC32C:
        ok = isinstance(table, dict) and all(
            isinstance(v, list) and v and all(valid(c) for c in v) for v in table.values()
        )
    else:
        ok = isinstance(table, dict) and all(valid(v) for v in table.values())
    if not ok:
        raise corrupt(str(root), f"its file list {FILES} has no valid array checksums")
    return table  # type: ignore[return-value]


def _crc32_combine() -> Any:
    """Returns zlib's `crc32_combine` (the CRC of two pieces joined, from theirs), or None."""
    try:
        libz = ctypes.CDLL(ctypes.util.find_library("z") or "libz.so.1")
        combine = libz.crc32_combine
    except (OSError, AttributeError, TypeError):
        return None
    combine.restype = ctypes.c_ulong
    combine.argtypes = [ctypes.c_ulong, ctypes.c_ulong, ctypes.c_long]
    return combine


_COMBINE = _crc32_combine()
_CHUNK = 4 << 20  # CRC-32 verification splits arrays into pieces of this many bytes
_PARALLEL_BYTES = 8 << 20  # below this, one thread (starting threads would cost more)
_MAX_THREADS = 4


def parallel_checksums(arrays: dict[str, np.ndarray]) -> dict[str, int]:
    """Returns `checksum` (CRC-32, format version 2) of each array, over a few threads.

    Each array is cut into `_CHUNK`-byte pieces whose CRC-32s (`zlib.crc32` releases the
    GIL) are computed in parallel and joined with zlib's `crc32_combine`, so a single large
    array spreads over the threads too. The threads are joined before it returns.
    """
    threads = min(_MAX_THREADS, _cores())
    views = {name: _bytes(array) for name, array in arrays.items()}
    if threads < 2 or _COMBINE is None or sum(v.nbytes for v in views.values()) < _PARALLEL_BYTES:
        return {name: zlib.crc32(view) for name, view in views.items()}
    pieces = {
        name: [view[i : i + _CHUNK] for i in range(0, max(view.nbytes, 1), _CHUNK)]
        for name, view in views.items()
    }
    with concurrent.futures.ThreadPoolExecutor(threads, "jmirror-checkpoint-crc") as pool:
        crcs = {name: list(pool.map(zlib.crc32, parts)) for name, parts in pieces.items()}
    out = {}
    for name, parts in pieces.items():
        crc = crcs[name][0]
        for part, part_crc in zip(parts[1:], crcs[name][1:]):
            crc = _COMBINE(crc, part_crc, part.nbytes)
        out[name] = crc
    return out


def _cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _bytes(array: np.ndarray) -> memoryview:
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8).data


def verify_arrays(
    arrays: dict[str, np.ndarray],
    saved: dict[str, Any],
    leaf_paths: dict[str, str],
    where: str,
    kind: str = CRC32C,
) -> None:
    """Raises `CorruptCheckpointError` naming the first array whose checksums differ.

    The checksums are computed over a few threads (`array_checksums`): on a restore this
    pass runs after the read, so its wall time is what verification costs.
    """
    actual = array_checksums({name: arrays[name] for name in saved if name in arrays}, kind)
    for name, expected in saved.items():
        if name in actual and actual[name] != expected:
            raise corrupt(
                where,
                f"the values of the leaf {leaf_paths.get(name, name)!r} (array {name!r}) do "
                "not match the checksum written with them: a file holding them was changed "
                "after it was written",
            )


# --- the file list ----------------------------------------------------------------------------


def _files(root: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != FILES)


_FILE_CRCS = {CRC32C: crc32c, CRC32: zlib.crc32}


def _file_crc(path: pathlib.Path, kind: str = CRC32C) -> int:
    with open(path, "rb") as f:
        return _FILE_CRCS[kind](f.read())


def write_file_list(root: pathlib.Path, checksums: dict[str, Any]) -> None:
    """Records every file under `root` (as orbax left it, with the CRC-32C of each small
    one) and the arrays' `checksums` (`array_checksums`)."""
    table = {}
    for path in _files(root):
        size = path.stat().st_size
        entry: dict[str, int] = {"size": size}
        if size <= _SMALL_FILE:
            entry[CRC32C] = _file_crc(path)
        table[path.relative_to(root).as_posix()] = entry
    listed = {
        "format": "jmirror.checkpoint.files",
        "checksum": CRC32C,
        "files": table,
        "arrays": checksums,
    }
    data = json.dumps(listed).encode()
    with open(root / FILES, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _read_list(root: pathlib.Path) -> dict:
    try:
        listed = json.loads((root / FILES).read_bytes().decode())
    except (OSError, ValueError) as error:
        raise corrupt(str(root), f"its file list {FILES} cannot be read ({error!r})") from None
    if not isinstance(listed, dict):
        raise corrupt(str(root), f"its file list {FILES} is not a JSON object")
    return listed


def has_file_list(root: pathlib.Path) -> bool:
    return (root / FILES).exists()


def check_files(root: pathlib.Path) -> None:
    """Raises `CorruptCheckpointError` naming the first file that differs from the list."""
    where = str(root)
    table = _read_list(root).get("files")
    if not isinstance(table, dict):
        raise corrupt(where, f"its file list {FILES} lists no files")
    for name, entry in table.items():
        file = root / name
        if not isinstance(entry, dict) or type(entry.get("size")) is not int:
            raise corrupt(where, f"its file list {FILES} is damaged at {name!r}")
        if not file.is_file():
            raise corrupt(where, f"the file {name} is missing")
        size = file.stat().st_size
        if size != entry["size"]:
            state = "empty" if size == 0 else f"{size} bytes"
            raise corrupt(where, f"the file {name} is {state}; {entry['size']} bytes were written")
        for kind in (CRC32C, CRC32):  # whichever the writer's format version recorded
            if kind in entry and _file_crc(file, kind) != entry[kind]:
                raise corrupt(where, f"the file {name} was changed after it was written")


# --- errors from below ------------------------------------------------------------------------


def first_line(error: BaseException) -> str:
    """Returns the start of a library's error message (TensorStore appends kilobytes of spec)."""
    text = str(error).split("See full TensorStore details")[0].strip()
    text = text.splitlines()[0] if text else type(error).__name__
    return text[:300] + (" ..." if len(text) > 300 else "")


def read_failed(where: str, what: str, error: BaseException) -> CorruptCheckpointError:
    """Returns the error for a read that a library below refused (`error` chained by the caller)."""
    return corrupt(where, f"{what} could not be read ({type(error).__name__}: {first_line(error)})")


def os_error(error: BaseException, directory: pathlib.Path, call: str) -> OSError | None:
    """Returns an `OSError` (errno kept) for an I/O failure of a write, or None if `error` is not
    one.

    orbax and TensorStore report a full disk as a `ValueError` carrying the OS error code;
    here it becomes the `OSError` the OS gave, naming the directory.
    """
    code = error.errno if isinstance(error, OSError) else None
    if code is None:
        match = _OS_ERROR.search(str(error))
        if match is None:
            return None
        code = int(next(g for g in match.groups() if g))
    reason = os.strerror(code)
    hint = {
        errno_module.ENOSPC: "free space there (or save to another directory)",
        errno_module.EDQUOT: "free space within your quota (or save to another directory)",
        errno_module.EROFS: "save to a writable directory",
        errno_module.EACCES: "save to a directory you may write to",
    }.get(code, "check the directory")
    return OSError(
        code,
        f"{call}: writing the checkpoint in {directory} failed: {reason}. Nothing partial "
        f"was kept; earlier checkpoints are untouched. Fix: {hint}",
        str(directory),
    )


def check_writable(directory: pathlib.Path, call: str) -> None:
    """Raises `OSError` (EROFS or EACCES) when `directory` (or its nearest parent) is not writable.

    Checked in the caller's thread before a save starts, so even an async save raises it
    from the call.
    """
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        read_only = bool(os.statvfs(existing).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    code = None
    if read_only:
        code = errno_module.EROFS
    elif not os.access(existing, os.W_OK | os.X_OK):
        code = errno_module.EACCES
    if code is not None:
        error = OSError(code, os.strerror(code))
        raise os_error(error, directory, call) from None  # type: ignore[misc]


def steps_note(steps: list[int], complete: int | None) -> str:
    """Returns the fix of a corrupt step: which other step is complete, and every saved one."""
    if complete is not None:
        return (
            f" Restore another step: step {complete} is complete (verified); the saved steps "
            f"are {steps} (e.g. manager.restore({complete}))."
        )
    if len(steps) > 1:
        return f" No other saved step is complete either (the saved steps are {steps})."
    return " No other step is saved: start again from the beginning."


def rethrow(error: CorruptCheckpointError, note: str) -> CorruptCheckpointError:
    """Returns a `CorruptCheckpointError` of the same message plus `note`."""
    return CorruptCheckpointError(str(error).rstrip() + note)


def leaf_paths(tree: PyTree) -> dict[str, str]:
    """Returns each array name's leaf path (of a `_decode.Tree`), for messages."""
    return {leaf.array: jax.tree_util.keystr(leaf.path) for leaf in tree.leaves()}
