"""`save` and `restore`: one checkpoint of a training state, in one directory."""

from __future__ import annotations

import os
import pathlib
from typing import Any

import jax

from jmirror._adapter import policed_statics
from jmirror._strategy import MirroredStrategy, get_strategy
from jmirror._values import PyTree
from jmirror.checkpoint import _decode, _encode, _format, _integrity, _processes, _storage


def save(
    directory: str | os.PathLike,
    state: PyTree,
    *,
    strategy: MirroredStrategy | None = None,
    force: bool = False,
) -> None:
    """Writes `state` to the checkpoint `directory` and returns when it is complete.

    Mirrored leaves are written once (one copy, however many replicas; a leaf laid out
    inside the replicas, `devices_per_replica > 1`, as its whole value); a `SyncOnRead` is
    written aggregated, as `strategy.read` gives it, and with its N components (restored as
    they were on the same replica count, so that a resumed run's metrics continue bitwise); a
    `PerReplica` with its N components; numpy arrays and Python scalars as they are. The
    checkpoint appears only when complete.

    With several processes (`jm.MultiWorkerMirroredStrategy`) every process calls `save` with
    its part of the state; the first process writes the checkpoint once (mirrored leaves and
    numpy arrays as it holds them, every replica's `PerReplica` components) and every process
    returns once it is complete.

    Args:
      directory: the checkpoint's directory; its parent is created if needed.
      state: a pytree of mirrored arrays, `SyncOnRead` and `PerReplica` nodes, numpy arrays
        and Python scalars (flax `TrainState` and optax states included).
      strategy: the strategy the state lives on; `None` for `jm.get_strategy()`.
      force: replace an existing checkpoint (atomically: a process killed while replacing
        leaves the old or the new checkpoint, never a mix).

    Raises:
      ValueError: `directory` exists and `force` is False; a leaf is a deleted (donated)
        array.
      TypeError: a leaf cannot be stored: neither an array nor a Python scalar, an array of
        `str`/object dtype, a Python int beyond int64 (raised before anything is written).
      OSError: the directory is read-only or the disk is full (with the OS's errno); nothing
        partial is left.

    Example:
        >>> import tempfile, numpy as np, jmirror as jm
        >>> strategy = jm.MirroredStrategy()
        >>> state = {"w": strategy.mirror(np.ones(3)), "n": strategy.sync_on_read(1, "sum")}
        >>> path = tempfile.mkdtemp() + "/ckpt"
        >>> jm.checkpoint.save(path, state)
        >>> int(strategy.read(jm.checkpoint.restore(path)["n"])) == strategy.num_replicas
        True
    """
    path = _storage.as_path(directory)
    if path.exists() and not force:
        raise ValueError(
            f"jm.checkpoint.save: {path} exists. Pass force=True to replace it atomically, "
            "or save to a new directory."
        )
    strategy = strategy or get_strategy()
    group = _processes.Group.of(strategy, "jm.checkpoint.save")
    keys = group.keys(str(path))
    # Every process arrives before the save's first collective (reading the state), so that
    # one that skips this save never has a collective of its own paired with one of it.
    group.arrive(keys)
    doc, arrays = encode(state, strategy, group, [None])
    if group.size == 1:  # with several processes the writer reports it after the barrier
        _integrity.check_writable(path.parent, "jm.checkpoint.save")

    def work() -> None:
        _storage.write(path, arrays, doc, force=force)

    group.write(keys, work, arrived=True)
    if not group.is_writer and not path.is_dir():
        raise group.not_written("jm.checkpoint.save", path)


def restore(
    directory: str | os.PathLike,
    target: PyTree = None,
    *,
    strategy: MirroredStrategy | None = None,
) -> PyTree:
    """Reads the checkpoint in `directory` and places it on `strategy`.

    Values come back as they were saved: mirrored leaves mirrored on the strategy's devices
    (with replicas spanning several devices, laid out inside each replica by the strategy's
    rules at the leaf's path in the result, `target`'s own metadata first, whatever layout
    saved them), `SyncOnRead` nodes with the components they had on the replica count that
    saved them (bitwise), on another count as `strategy.assign` places a value (reading one
    gives what was saved: exactly for integer `SUM` and `ONLY_FIRST_REPLICA`, an integer `MEAN`
    rounded to the nearest integer), `PerReplica` nodes split over the replicas (same replica
    count only), numpy arrays and Python scalars as themselves. Nothing read from the
    checkpoint is unpickled or evaluated. With several processes every process calls
    `restore` and reads the files (a filesystem every process sees); the layout that wrote the
    checkpoint (how many processes, how many devices each) does not matter.

    Args:
      directory: a directory written by `jm.checkpoint.save` (or a manager's step).
      target: `None` to rebuild the saved tree from dicts, lists, tuples, `SyncOnRead` and
        `PerReplica` nodes (other pytree classes come back as dicts of their fields); or a
        pytree of the saved structure (leaves may be `jax.ShapeDtypeStruct`) whose
        structure the result takes. An `nnx.metrics` metric's state takes the saved kind:
        saved sync-on-read (updated by a replicated function), it comes back as components
        in a target made by `nnx.eval_shape` or a fresh metric, and the other way round.
      strategy: where to place the state; `None` for `jm.get_strategy()`.

    Returns:
      The restored state.

    Raises:
      FileNotFoundError: no checkpoint at `directory` (the message says what exists there).
      ValueError: `target` differs from the checkpoint (the first differing path, what was
        saved, what was expected); a `PerReplica` saved with another replica count.
      CorruptCheckpointError: a file is missing, truncated, empty or changed, an array does
        not match its checksum, or metadata is damaged (a `ValueError`).

    Example:
        >>> import tempfile, numpy as np, jmirror as jm
        >>> strategy = jm.MirroredStrategy()
        >>> path = tempfile.mkdtemp() + "/ckpt"
        >>> jm.checkpoint.save(path, {"w": strategy.mirror(np.arange(3.0))})
        >>> jm.checkpoint.restore(path)["w"].tolist()
        [0.0, 1.0, 2.0]
    """
    path = _storage.as_path(directory)
    return read(path, target, strategy or get_strategy(), "jm.checkpoint.restore")


# --- shared with the manager -------------------------------------------------------------------


def encode(
    state: PyTree, strategy: MirroredStrategy, group: _processes.Group, process_data: list[Any]
) -> tuple[dict, dict]:
    """Returns the metadata document and host arrays of `state` (fresh host copies).

    Every process of `group` calls it (it may hold collectives); only the writer gets the
    arrays, the others an empty dict.
    """
    # Static leaves (an equinox module's functions and flags) are not written.
    state = without_statics(state)
    encoded = _encode.encode(state, strategy, keep=group.is_writer, call=group.call)
    doc = _format.document(encoded.tree, encoded.arrays, encoded.num_replicas, process_data)
    if encoded.arrays:
        _check_restorable(doc)
    return doc, encoded.arrays


def _check_restorable(doc: dict) -> None:
    """Raises before anything is written unless `doc` passes the checks a restore makes of
    it (each array of the shape and dtype its leaf says): a save that succeeds restores."""
    where = "the state being saved"
    try:
        saved_n, specs, node = _format.parse_document(doc, where)
        _decode.check_arrays(_decode.Tree(node, where, specs), specs, saved_n, where)
    except _format.CorruptCheckpointError as error:
        what = str(error).partition(" is damaged: ")[2].partition(". Nothing was restored")[0]
        raise RuntimeError(
            f"jm.checkpoint.save: the encoded state would not restore: {what}. Nothing was "
            "written. This is a bug of jmirror's encoding; please report it with the state's "
            "structure."
        ) from error


def read(path: pathlib.Path, target: PyTree, strategy: MirroredStrategy, call: str) -> PyTree:
    """Returns the state in the checkpoint at `path`, checked against `target` and placed;
    `target`'s static leaves (not written) come back as they are in `target`."""
    full_target = target
    if target is not None:
        target = without_statics(target)
    restored = _read(path, target, strategy, call)
    if full_target is not None and target is not full_target:
        return with_statics(restored, full_target)
    return restored


def _read(path: pathlib.Path, target: PyTree, strategy: MirroredStrategy, call: str) -> PyTree:
    try:
        doc, saved_n, tree, specs = _read_tree(path, call)
        if target is not None:
            target = _decode.fit_metrics(tree, target, strategy.num_replicas)
            _decode.check_target(tree, target)
        _decode.check_replicas(tree, saved_n, strategy.num_replicas)
        arrays = _read_verified(path, doc, tree, specs)
    except _format.CorruptCheckpointError as error:
        raise with_fix(error, path, call) from error
    return _decode.place(tree, arrays, strategy, target, saved_n, call)


def without_statics(tree: PyTree) -> PyTree:
    """Returns `tree` with the static leaves of its modules (`jmirror._adapter.policed_statics`:
    an equinox module's functions and flags) as None, or `tree` itself when it has none.
    Leaves that cannot be saved elsewhere stay, for the encoder's error."""
    # Through `PerReplica` / `SyncOnRead` nodes too: a module inside one keeps its statics.
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    static = policed_statics(tree)
    if not any(static):
        return tree
    return treedef.unflatten([None if s else x for x, s in zip(leaves, static)])


def with_statics(restored: PyTree, target: PyTree) -> PyTree:
    """Returns `restored` (restored into `without_statics(target)`) with `target`'s statics."""
    leaves, treedef = jax.tree_util.tree_flatten(target, is_leaf=_is_none)
    static = policed_statics(target, is_leaf=_is_none)
    got = jax.tree_util.tree_leaves(restored, is_leaf=_is_none)
    return treedef.unflatten([t if s else r for t, r, s in zip(leaves, got, static)])


def _is_none(x: object) -> bool:
    return x is None


def with_fix(error: _format.CorruptCheckpointError, path: pathlib.Path, call: str) -> Exception:
    """Returns `error` with the fix: the newest other step of the series that reads whole.

    The other steps (the sibling directories of a manager's step) are verified newest
    first, until one is complete; a corrupt step is never skipped silently.
    """
    message = f"{call}: " + str(error).removeprefix("jm.checkpoint: ")
    if not _format.describe(str(path)).startswith("step "):
        return _format.CorruptCheckpointError(message + " Restore another checkpoint.")
    steps = _storage.steps(path.parent)
    others = [s for s in reversed(steps) if str(s) != path.name]
    complete = next((s for s in others if verify(path.parent / str(s), call)), None)
    return _integrity.rethrow(
        _format.CorruptCheckpointError(message), _integrity.steps_note(steps, complete)
    )


def _read_tree(path: pathlib.Path, call: str) -> tuple[dict, int, _decode.Tree, dict]:
    where = str(path)
    doc = _storage.read_document(path, call)
    saved_n, specs, node = _format.parse_document(doc, where)
    tree = _decode.Tree(node, where, specs)
    _decode.check_arrays(tree, specs, saved_n, where)
    return doc, saved_n, tree, specs


def _read_verified(path: pathlib.Path, doc: dict, tree: _decode.Tree, specs: dict) -> dict:
    """Returns the checkpoint's host arrays, each checked against its saved checksum."""
    where = str(path)
    paths = _integrity.leaf_paths(tree) | _decode.component_paths(tree)
    kind = _integrity.CRC32C if doc["version"] >= 3 else _integrity.CRC32
    saved = _integrity.saved_checksums(path, kind) if doc["version"] >= 2 else {}
    arrays = _storage.read_arrays(path, specs, paths)
    _integrity.verify_arrays(arrays, saved, paths, where, kind)
    return arrays


def verify(path: pathlib.Path, call: str) -> bool:
    """Returns whether the checkpoint at `path` reads whole (every file and checksum verified)."""
    try:
        doc, _, tree, specs = _read_tree(path, call)
        _read_verified(path, doc, tree, specs)
    except (ValueError, OSError):  # CorruptCheckpointError included
        return False
    return True


def read_data(path: pathlib.Path, call: str, group: _processes.Group) -> PyTree:
    """Returns this process's `data` saved with the checkpoint at `path`.

    When as many processes saved as read, each reads its own; otherwise the saved data must
    be the same on every saving process (as an input position of `distribute_dataset` is).
    """
    try:
        doc = _storage.read_document(path, call)
        _format.parse_document(doc, str(path))
        saved = _format.process_data(doc, str(path))
    except _format.CorruptCheckpointError as error:
        raise with_fix(error, path, call) from error
    if len(saved) == 1 or len(saved) == group.size:
        return saved[group.rank if len(saved) > 1 else 0]
    if all(d == saved[0] for d in saved):
        return saved[0]
    raise ValueError(
        f"{call}: step {path.name} was saved by {len(saved)} processes, each with its own "
        f"data, and they differ; this run has {group.size} process(es), so which one is this "
        f"process's is not defined. Read it with {len(saved)} processes, or save data that is "
        "the same on every process (an iterator's .position is)."
    )
