"""The checkpoint's own metadata: a JSON document, written and validated without evaluating it.

A checkpoint holds two orbax items: `state`, a flat dict of host arrays named "0", "1", ...,
and `jmirror`, one JSON document (orbax's `JsonSave`) that says how those arrays make up the
saved state:

    {"format": "jmirror.checkpoint", "version": 3, "num_replicas": N,
     "arrays": {"0": {"shape": [...], "dtype": "float32"}, ...},
     "tree": <node>, "data": <the manager's data, any JSON>,
     "process_data": [<process 0's data>, <process 1's data>, ...]}

Version 3 comes with the checkpoint's file list and each array's CRC-32C checksums
(`_integrity`); version 2 checkpoints (the same list with one CRC-32 per array) still restore
and verify, version 1 checkpoints restore unverified. Zero-size arrays are in the
table but not in the `state` item (orbax refuses them); they are restored from their shape
and dtype.

`process_data` is there only when several processes saved (each saves its own `data`; `data`
is then process 0's, as a single-process reader sees it).

A `<node>` is one of
    {"node": "leaf", "kind": KIND, "array": "3", "shape": [...], "dtype": "float32", ...}
    {"node": "dict" | "list" | "tuple" | "none" | "class", "children": [[ENTRY, <node>], ...]}
      (a "class" node of a flax `nnx.Variable` adds `"variable": true`: without target it is
      restored as its value)
    {"node": "sync_on_read", "aggregation": "sum", "child": <node>}
    {"node": "per_replica", "child": <node>}
where ENTRY is `["attr", name]`, `["key", str_or_int]`, `["index", int]` or `["flat", int]` (a
`jax.tree_util` key) and KIND says how the leaf was held and is placed back:
    "mirrored"   a mirrored array, stored once;
    "numpy"      a numpy array (`"scalar": true` for a numpy scalar);
    "python"     a Python scalar (`"python": "int" | "float" | "bool" | "complex"`);
    "aggregated" a leaf of a `SyncOnRead`, stored as `strategy.read` gives it;
    "stacked"    a leaf of a `PerReplica` (or a `SyncOnRead` with aggregation NONE), N components.
`shape` and `dtype` describe the value as the user held it (one component for "aggregated" and
"stacked"); a PRNG key leaf adds `"key_impl"` and is stored as its `jax.random.key_data`; a
weakly typed array (made from a Python scalar) adds `"weak": true` and is restored weakly typed,
so that the resumed step compiles as the uninterrupted one did.
An "aggregated" leaf may add `"components": "4"`, the array of its N
components (`num_replicas` of them, stacked, of the leaf's dtype): a restore on the same replica
count places them back as they were (a resumed run continues bitwise), on another count it
places the read value as `strategy.assign` does. Without the field (older checkpoints of
version 2) every restore places the read value.

Restoring parses this document with `json.loads` and checks every field it uses against this
schema: nothing read from a checkpoint is unpickled or evaluated, and a dtype outside
`_DTYPES` (an object dtype, say) is refused.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FORMAT = "jmirror.checkpoint"
# 2: every array has a CRC-32 and the file list (`_integrity`); 3: CRC-32C checksums instead.
VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
STATE_ITEM = "state"
METADATA_ITEM = "jmirror"

_STEP_NAME = re.compile(r"0|[1-9][0-9]*")
KINDS = ("mirrored", "numpy", "python", "aggregated", "stacked", "sharded")
CONTAINERS = ("dict", "list", "tuple", "none", "class")
PYTHON_TYPES = {"bool": bool, "int": int, "float": float, "complex": complex}
KEY_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")
_DTYPES = frozenset(
    ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
    + ["float16", "bfloat16", "float32", "float64", "complex64", "complex128"]
    + ["float8_e4m3fn", "float8_e5m2", "float8_e4m3b11fnuz", "float8_e4m3fnuz", "float8_e5m2fnuz"]
    # What orbax stores too among JAX's narrower types (uint4 and float8_e4m3 it refuses).
    + ["int4", "int2", "float4_e2m1fn", "float8_e8m0fnu", "float8_e3m4"]
)


class CorruptCheckpointError(ValueError):
    """A checkpoint on disk is damaged: nothing was restored from it (a `ValueError`).

    Raised by `jm.checkpoint.restore` and `CheckpointManager.restore` / `.data` when a file
    of the checkpoint is missing, truncated, empty or changed after it was written (every
    array is saved with a checksum and verified), or its metadata does not parse. The message
    names the step, the damaged file or leaf path, and the fix: restore another step (the
    manager says which earlier step is complete).

    Example:
        >>> import pathlib, tempfile, numpy as np, jmirror as jm
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "ckpt"
        >>> jm.checkpoint.save(path, {"w": np.arange(4.0)})
        >>> (path / "jmirror" / "metadata").write_text("{not json")
        9
        >>> try:
        ...     jm.checkpoint.restore(path)
        ... except jm.checkpoint.CorruptCheckpointError as error:
        ...     print("damaged:", "jmirror/metadata" in str(error))
        damaged: True
    """


def describe(where: str) -> str:
    """Returns 'step 3 of /runs/a' for a manager's step, else 'the checkpoint at /path'."""
    head, _, name = where.rstrip("/").rpartition("/")
    if _STEP_NAME.fullmatch(name) and head:
        return f"step {name} of {head}"
    return f"the checkpoint at {where}"


def corrupt(where: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"jm.checkpoint: {describe(where)} is damaged: {what}. Nothing was restored from it "
        "(restoring never unpickles or evaluates checkpoint contents)."
    )


def dtype_name(dtype: jax.typing.DTypeLike) -> str:
    """Returns the JSON name of an array dtype (PRNG key dtypes included, e.g. 'key<fry>')."""
    return str(dtype) if jnp.issubdtype(dtype, jax.dtypes.prng_key) else np.dtype(dtype).name


def is_stored_dtype(dtype: jax.typing.DTypeLike) -> bool:
    """Returns whether arrays of `dtype` can be written (plain numeric, bool, PRNG keys)."""
    try:
        return jnp.issubdtype(dtype, jax.dtypes.prng_key) or np.dtype(dtype).name in _DTYPES
    except TypeError:
        return False


def parse_dtype(name: object, where: str) -> np.dtype:
    """Returns the numpy dtype named `name`; only plain numeric and bool dtypes are accepted."""
    if not isinstance(name, str) or name not in _DTYPES:
        raise corrupt(where, f"dtype {name!r} is not one of the array dtypes jmirror writes")
    return np.dtype(jnp.dtype(name))


def parse_shape(shape: object, where: str) -> tuple[int, ...]:
    if not isinstance(shape, list) or not all(
        type(d) is int and d >= 0
        for d in shape  # noqa: E721 (bool is not a dimension)
    ):
        raise corrupt(where, f"shape {shape!r} is not a list of non-negative ints")
    return tuple(shape)


def field(obj: object, name: str, kind: type | tuple[type, ...], where: str) -> Any:
    """Returns `obj[name]`, which must be of type `kind` (bools are not ints)."""
    if not isinstance(obj, dict) or name not in obj:
        raise corrupt(where, f"a metadata entry lacks the field {name!r}")
    value = obj[name]
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
        raise corrupt(where, f"field {name!r} is {value!r}, not of type {kind}")
    return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


# --- tree keys ---------------------------------------------------------------------------------


def entry_to_json(entry: Any, path: str) -> list[Any]:
    """Returns a `jax.tree_util` key entry as JSON, e.g. `DictKey('w')` -> `["key", "w"]`."""
    if isinstance(entry, jax.tree_util.GetAttrKey):
        return ["attr", entry.name]
    if isinstance(entry, jax.tree_util.SequenceKey):
        return ["index", entry.idx]
    if isinstance(entry, jax.tree_util.FlattenedIndexKey):
        return ["flat", entry.key]
    if isinstance(entry, jax.tree_util.DictKey):
        key = entry.key
        if isinstance(key, str) or (isinstance(key, int) and not isinstance(key, bool)):
            return ["key", key]
        raise TypeError(
            f"jm.checkpoint.save: the dict key {key!r} at path {path!r} is a "
            f"{type(key).__name__}; checkpoints store dict keys that are str or int. Use str "
            "keys in the state."
        )
    raise TypeError(
        f"jm.checkpoint.save: the pytree key {entry!r} at path {path!r} is of an unknown kind "
        f"({type(entry).__name__}); expected GetAttrKey, DictKey, SequenceKey or "
        "FlattenedIndexKey. Register the class with jax.tree_util.register_dataclass."
    )


def entry_from_json(entry: object, where: str) -> Any:
    """Returns the `jax.tree_util` key entry written by `entry_to_json`."""
    if isinstance(entry, list) and len(entry) == 2:
        kind, key = entry
        if kind == "attr" and isinstance(key, str):
            return jax.tree_util.GetAttrKey(key)
        if kind == "key" and (isinstance(key, str) or type(key) is int):
            return jax.tree_util.DictKey(key)
        if kind == "index" and type(key) is int:
            return jax.tree_util.SequenceKey(key)
        if kind == "flat" and type(key) is int:
            return jax.tree_util.FlattenedIndexKey(key)
    raise corrupt(where, f"tree key {entry!r} is not a jmirror tree key")


def entry_name(entry: object) -> str | int:
    """Returns the key a rebuilt dict uses for a child: a field name, dict key or index."""
    for attr in ("name", "key", "idx"):
        if hasattr(entry, attr):
            return getattr(entry, attr)
    raise TypeError(f"unknown key entry {entry!r}")


# --- the document ------------------------------------------------------------------------------


def document(
    tree: dict, arrays: dict[str, np.ndarray], num_replicas: int, process_data: list[Any]
) -> dict:
    """Returns the metadata document of a checkpoint; `process_data` holds each process's data."""
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "num_replicas": num_replicas,
        "arrays": {
            name: {"shape": list(a.shape), "dtype": dtype_name(a.dtype)}
            for name, a in arrays.items()
        },
        "tree": tree,
        "data": process_data[0],
    }
    if len(process_data) > 1:
        doc["process_data"] = process_data
    return doc


def process_data(doc: dict, where: str) -> list[Any]:
    """Returns each saving process's `data` (one entry when one process saved)."""
    if "process_data" not in doc:
        return [doc.get("data")]
    per_process = field(doc, "process_data", list, where)
    if not per_process or per_process[0] != doc.get("data"):
        raise corrupt(where, "its per-process data does not start with its data")
    return per_process


def parse_document(doc: object, where: str) -> tuple[int, dict[str, jax.ShapeDtypeStruct], dict]:
    """Validates the document's header: (num_replicas, array specs, tree node)."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise corrupt(where, f"its metadata does not name the format {FORMAT!r}")
    version = field(doc, "version", int, where)
    if version not in READABLE_VERSIONS:
        raise ValueError(
            f"jm.checkpoint: the checkpoint at {where} has format version {version}; this "
            f"jmirror reads versions {list(READABLE_VERSIONS)}. Restore it with the jmirror "
            "that wrote it."
        )
    num_replicas = field(doc, "num_replicas", int, where)
    if num_replicas < 1:
        raise corrupt(where, f"num_replicas is {num_replicas}")
    specs = {}
    for name, spec in field(doc, "arrays", dict, where).items():
        shape = parse_shape(field(spec, "shape", list, where), where)
        dtype = parse_dtype(field(spec, "dtype", str, where), where)
        specs[name] = jax.ShapeDtypeStruct(shape, dtype)
    return num_replicas, specs, field(doc, "tree", dict, where)
