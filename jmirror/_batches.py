"""Turning a source's elements into placed global batches, one pass at a time.

`jmirror._input` opens passes over a source (`Source.pull`) and hands the elements here:
`global_batches` checks each global batch's leaves (array-likes, one leading size, values
that fit their dtype), pads or drops an incomplete one, and places each leaf `(G, ...)`,
reshaped (a view) to `(N, G/N, ...)`, with the stacked sharding in one call per leaf: device i
receives only examples `[i * G/N, (i + 1) * G/N)`. `dealt_batches` stacks N per-replica
elements into one batch instead. See `jmirror._input` for the choices the contract leaves open.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Iterator
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np

from jmirror._cluster_config import process_counts
from jmirror._prefetch import Control, Layout, Position, _Positioned, _Warning
from jmirror._shim import put_rows
from jmirror._source import Resume, Source
from jmirror._source_state import SourceState
from jmirror._topology import Topology
from jmirror._values import PerReplica, PyTree, is_distributed

DATASET_CALL = "strategy.distribute_dataset"
FUNCTION_CALL = "strategy.distribute_datasets_from_function"

# --- placing batches -----------------------------------------------------------------------------

_NUMERIC_KINDS = "biufc"  # bool, int, uint, float, complex: what a jax.Array holds
_KIND_NAMES = {
    "U": "strings",
    "S": "bytes",
    "M": "datetimes",
    "m": "timedeltas",
    "V": "structured records",
}


def _is_array_item(x: object) -> bool:
    return isinstance(x, numbers.Number | np.generic | str | bytes) or _is_array_list(x)


def _is_array_list(x: object) -> bool:
    """Returns whether `x` is a non-empty list of numbers (or of such lists): one array-like leaf.

    Any other list (of arrays, of dicts, empty) stays a pytree container, as JAX sees it.
    """
    return isinstance(x, list) and bool(x) and all(_is_array_item(v) for v in x)


def _is_batch_leaf(x: object) -> bool:
    """Returns whether `x` is one leaf of a batch: an array-like list, or a distributed value
    (refused by `_as_array`: a batch is split by the dataset, not by its source)."""
    return _is_array_list(x) or is_distributed(x)


def _flatten(tree: PyTree) -> tuple[list[Any], Any]:
    return jax.tree_util.tree_flatten(tree, is_leaf=_is_batch_leaf)


def _leaf_path(tree: PyTree, leaf_index: int, root: str = "batch") -> str:
    path = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_batch_leaf)[0][leaf_index][0]
    return f"{root}{jax.tree_util.keystr(path)}"


def _as_array(call: str, where: str, tree: PyTree, leaf: PyTree, leaf_index: int, root: str) -> Any:
    """Returns `leaf` as an array JAX can place: numeric, and 64-bit integers only where they
    fit."""
    if isinstance(leaf, jax.Array):
        return leaf
    if is_distributed(leaf):
        raise TypeError(
            f"{call}: leaf {_leaf_path(tree, leaf_index, root)} of {where} is a jm."
            f"{type(leaf).__name__}; a source yields global batches, which the dataset splits "
            "over the replicas itself. Yield the global batch (the PerReplica's values "
            "reshaped to (num_replicas * rows, ...)), or use distribute_datasets_from_function "
            "for a pipeline per replica."
        )
    try:
        array = np.asarray(leaf)
    except ValueError:
        if not isinstance(leaf, list):
            raise
        raise TypeError(
            f"{call}: leaf {_leaf_path(tree, leaf_index, root)} of {where} is a ragged list: "
            "its nested lists do not all have the same length, so it is no array. A list of "
            "numbers, or nested lists of the same length, is one array-like leaf; pad the "
            "rows to one length (with a mask), or pass a numpy array."
        ) from None
    kind = array.dtype.kind
    if kind in _NUMERIC_KINDS:
        if kind != "b" and array.dtype.itemsize == 8 and array.size:
            _check_fits(call, where, tree, array, leaf_index, root)
        return array
    if kind == "V" and _is_jax_dtype(array.dtype):
        return array  # ml_dtypes' bfloat16, float8, int4, ...: numpy calls them records
    path = _leaf_path(tree, leaf_index, root)
    if kind == "O":
        found = f"a {type(leaf).__name__}"
        if isinstance(leaf, np.ndarray):
            found = "a numpy array of dtype object"
        raise TypeError(
            f"{call}: leaf {path} of {where} is {found}, which does not convert to a numeric "
            "array. Every leaf of a batch must be an array-like of numbers: a numpy array, a "
            "jax.Array, or a list of numbers (nested lists of the same length for more "
            "dimensions). Convert it to numbers, or keep it out of the batch."
        )
    raise TypeError(
        f"{call}: leaf {path} of {where} has dtype {array.dtype} "
        f"({_KIND_NAMES.get(kind, 'not numbers')}), which a jax.Array cannot hold. Convert it "
        "to a numeric dtype before it reaches the dataset (strings to integer ids through a "
        "vocabulary, datetimes to numbers of seconds), or keep it out of the batch."
    )


def _is_jax_dtype(dtype: np.dtype) -> bool:
    """Returns whether a dtype numpy holds as raw records is one of JAX's numeric dtypes
    (ml_dtypes' bfloat16, float8 and narrow integer types)."""
    try:
        return jnp.issubdtype(dtype, jnp.number)
    except TypeError:
        return False


_IINFO: dict[np.dtype, np.iinfo] = {}


def _check_fits(call: str, where: str, tree: PyTree, x: np.ndarray, leaf_index: int, root: str):
    """Checks that a 64-bit integer array fits the 32-bit dtype JAX gives it without x64."""
    if x.dtype.kind not in "iu":
        return
    target = jax.dtypes.canonicalize_dtype(x.dtype)
    if target == x.dtype:  # 64-bit types are on
        return
    low, high = x.min(), x.max()
    info = _IINFO.get(target) or _IINFO.setdefault(target, np.iinfo(target))
    if low >= info.min and high <= info.max:
        return
    raise ValueError(
        f"{call}: leaf {_leaf_path(tree, leaf_index, root)} of {where} is {x.dtype} with values "
        f"in [{low}, {high}], outside the range [{info.min}, {info.max}] of {target}, which "
        f"JAX makes of {x.dtype} while 64-bit types are off (its default): the values would "
        'wrap silently. Turn them on with jax.config.update("jax_enable_x64", True) at '
        f"start-up, or give the leaf a 32-bit dtype that holds its values."
    )


def _leading_size(call: str, batch: PyTree, index: int, leaves: list[Any]) -> int:
    if not leaves:
        raise ValueError(
            f"{call}: batch {index} has no array leaves ({batch!r}); each batch must be a pytree "
            "of arrays with a leading batch axis."
        )
    sizes: list[int | None] = [np.shape(x)[0] if np.ndim(x) else None for x in leaves]
    for i, size in enumerate(sizes):
        if size is None:
            raise ValueError(
                f"{call}: leaf {_leaf_path(batch, i)} of batch {index} is a scalar (shape ()), "
                "but every leaf needs a leading batch axis. Give it one example per row, e.g. "
                "np.full((batch_size,), value). A list of numbers is one array-like leaf; "
                "tuples and dicts are containers, so a tuple of numbers gives scalar leaves."
            )
        if size != sizes[0]:
            shapes = f"{np.shape(leaves[i])} vs {np.shape(leaves[0])} at {_leaf_path(batch, 0)}"
            raise ValueError(
                f"{call}: leaf {_leaf_path(batch, i)} of batch {index} has leading size {size}, "
                f"but the first leaf has {sizes[0]} ({shapes}). Every leaf of a batch must hold "
                "the same number of examples along axis 0."
            )
    return cast(int, sizes[0])  # not None: checked in the loop above


def _pad(x: PyTree, size: int) -> PyTree:
    extra = size - x.shape[0]
    if isinstance(x, jax.Array):
        return jnp.concatenate([x, jnp.zeros((extra,) + x.shape[1:], x.dtype)])
    out = np.zeros((size,) + x.shape[1:], x.dtype)
    out[: x.shape[0]] = x
    return out


def _place(topology: Topology, arrays: list[Any]) -> list[jax.Array]:
    """Places slice i of each (N, ...) array on device i, and only there.

    Host arrays go through `jmirror._shim.put_rows`, one C++ call per leaf that copies each
    row to its device (the least host time per batch, which is what the input pipeline costs
    while the step keeps the cores busy); arrays already on devices go through one
    `jax.device_put`.
    """
    sharding = topology.stacked
    return [
        put_rows(x, sharding) if isinstance(x, np.ndarray) else jax.device_put(x, sharding)
        for x in arrays
    ]


class _PairError(TypeError, AttributeError):
    """A `(batch, mask)` pair used as a batch: a TypeError that `hasattr` still answers."""


_PAIR_FIX = (
    "with remainder='pad', every element of strategy.distribute_dataset is a (batch, mask) "
    "pair, not a batch. Unpack it, `for batch, mask in data:` (or `batch, mask = element`), "
    "and use `batch`; or pass remainder='drop' to get batches alone."
)


class PaddedBatch(NamedTuple):
    """An element of `distribute_dataset(..., remainder="pad")`: a `(batch, mask)` pair.

    A tuple (it unpacks, and JAX takes it as a pytree node, like any namedtuple); indexing it
    with a key or asking it for a batch's attribute raises a `TypeError` that says to unpack it.

    Example:
        >>> import numpy as np, jmirror as jm
        >>> strategy = jm.MirroredStrategy()
        >>> n = strategy.num_replicas
        >>> (element,) = strategy.distribute_dataset([{"image": np.zeros((n, 2))}])
        >>> batch, mask = element
        >>> batch.values["image"].shape == (n, 1, 2)
        True
        >>> try:
        ...     element["image"]
        ... except TypeError as e:
        ...     print(e)
        element['image']: with remainder='pad', every element of ... a (batch, mask) pair, ...
    """

    batch: PyTree
    mask: jax.Array | PerReplica

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, str):
            raise _PairError(f"element[{index!r}]: {_PAIR_FIX}")
        return tuple.__getitem__(self, index)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # protocol probes (numpy, copy, IPython) get the usual answer
            raise AttributeError(f"'PaddedBatch' object has no attribute {name!r}")
        raise _PairError(f"element.{name}: {_PAIR_FIX}")


@dataclasses.dataclass(frozen=True)
class Shares:
    """How a pass's batches are split across processes.

    A global source (`processes == 1`): every batch is the global batch, G rows over the N
    replicas. Process-local: each process's source yields its share, G/P rows in process
    order, which this process's `unit` replicas (a contiguous block of the N) receive.
    """

    processes: int = 1
    unit: int = 1  # the replicas that receive one source batch's rows

    @property
    def is_local(self) -> bool:
        return self.processes > 1


def shares_of(call: str, topology: Topology, process_local: bool) -> Shares:
    """Returns the split of `distribute_dataset(..., process_local=...)` on `topology`, checked."""
    n, processes = topology.num_replicas, topology.process_count
    if not process_local or processes == 1:
        return Shares(1, n)
    unit = topology.num_local_replicas
    first = topology.process_index * unit
    if unit * processes != n or topology.local_replica_ids != tuple(range(first, first + unit)):
        raise ValueError(
            f"{call}(process_local=True): process {topology.process_index}'s replicas are "
            f"{list(topology.local_replica_ids)} of N={n}, but process-local shares need each "
            f"of the {processes} processes to hold the same number of replicas, as one "
            "contiguous block in process order (process p's share is rows [p G/P, (p + 1) "
            "G/P) of the global batch). Build the strategy over every process's devices in "
            "process order (jm.MultiWorkerMirroredStrategy does), or pass global batches."
        )
    return Shares(processes, unit)


def global_batches(
    topology: Topology,
    source: Source,
    remainder: str,
    control: Control,
    start: Position | None,
    shares: Shares,
) -> Iterator[Any]:
    """Yields placed global batches (`PerReplica`, or `PaddedBatch` for "pad"), positioned."""
    g = 0
    if (
        start is not None
        and start.global_batch_size
        and start.global_batch_size % topology.num_replicas == 0
    ):
        g = start.global_batch_size  # known: no batch is read to learn it
    resume = None
    if start is not None and start.batches:
        resume = Resume(
            start.batches,
            start.state,
            peek_first=not g,
            saved=start.processes if start.process_local else 1,
            current=shares.processes,
        )
    pulled = source.pull(control, resume)
    try:
        yield from _split_batches(topology, pulled, remainder, resume, shares, g)
    finally:
        pulled.close()


def _global_size(
    call: str, n: int, size: int, remainder: str, processes: int, shares: Shares
) -> tuple[int, _Warning | None]:
    """Returns G from the first batch's size (the first share's, for process-local input), and the
    warning that "drop" gives when that size is below G's.

    In a run that `jmirror.launch --min-processes` may continue on fewer processes, a first
    batch that N does not divide is a `ValueError`: padding or dropping would change the global
    batch from one start to the next."""
    what = "first share" if shares.is_local else "first batch"
    if size == 0:
        raise ValueError(
            f"{call}: the {what} has 0 examples, so there is no global batch size "
            f"to infer; the {what} sets G. Skip empty batches in the source."
        )
    unit = shares.unit
    rows = -(-size // unit) * unit
    g = rows * shares.processes
    counts = process_counts()
    if counts is not None and size != rows:
        raise ValueError(_elastic_batch(call, size * shares.processes, n, processes, counts))
    if remainder != "drop" or size == rows:
        return g, None
    if shares.is_local:
        return g, _Warning(
            f"{call}(remainder='drop', process_local=True): the first share has {size} rows, "
            f"not a multiple of this process's {unit} replicas, so each share of the global "
            f"batch size G={g} holds {rows} rows and every share of {size} rows is incomplete: "
            f"every such batch will be dropped. Use a per-process batch size divisible by "
            f"{unit}, or remainder='pad'."
        )
    return g, _Warning(
        f"{call}(remainder='drop'): the first batch has {size} examples, not a "
        f"multiple of the {n} replicas, so the global batch size is G={g} and every "
        f"batch of {size} examples is incomplete and will be dropped. Use a global "
        f"batch size divisible by {n}, or remainder='pad'."
    )


def _elastic_batch(call: str, size: int, n: int, processes: int, counts: tuple[int, int]) -> str:
    """Returns the error of a first batch of `size` examples that N does not divide, in an elastic
    run of `counts` = (M, P) processes: the replica counts it may run on and their multiple."""
    per_process = max(1, n // processes)
    least, most = counts
    sizes = [c * per_process for c in range(least, most + 1)]
    every = math.lcm(*sizes)
    return (
        f"{call}: the global batch has {size} examples, which the N={n} replicas of this "
        f"start ({processes} process{'es' if processes > 1 else ''}) do not divide. This run "
        f"may continue on {least} to {most} processes (jmirror.launch --min-processes "
        f"{least}), {'/'.join(map(str, sizes))} replicas, and keeps its global batch across "
        f"restarts (per-replica batch = global / N): use a global batch size that each of "
        f"them divides, a multiple of {every}."
    )


def _split_batches(
    topology: Topology,
    pulled: Iterator[tuple[int, Any, SourceState | None]],
    remainder: str,
    resume: Resume | None,
    shares: Shares,
    g: int,
) -> Iterator[Any]:
    """Splits and places each batch (each share, for process-local input), positioned.

    `g` is G when the position gave it (0: the first batch read sets it). An element before
    `resume.skip` is only looked at for its leading size (the first one, to set G)."""
    call = DATASET_CALL
    n = topology.num_replicas
    processes = topology.process_count
    local = shares.is_local
    unit = shares.unit  # replicas per source batch
    position = Position(0, g or None, processes, local)
    first: int | None = None  # the first batch's size, when it set G
    skip = resume.skip if resume is not None else 0
    drop_everywhere = local and remainder == "drop"
    what = "share" if local else "batch"
    # Resumed on another process count from process-local shares: a first batch of the saved
    # run's G/P rows (not this run's) is a source still batched for the saved count.
    saved = resume.saved if resume is not None and g else shares.processes
    compare = saved != shares.processes
    for index, batch, state in pulled:
        if index < skip:  # received before: looked at only to learn G
            flat, _ = _flatten(batch)
            first = _leading_size(call, batch, index, flat)
            g, warning = _global_size(call, n, first, remainder, processes, shares)
            if warning is not None:
                yield warning
            continue
        flat, treedef = _flatten(batch)
        where = f"{what} {index}"
        leaves = [_as_array(call, where, batch, x, i, "batch") for i, x in enumerate(flat)]
        size = _leading_size(call, batch, index, leaves)
        if not g:
            first = size
            g, warning = _global_size(call, n, size, remainder, processes, shares)
            if warning is not None:
                yield warning
        rows = g // shares.processes
        if compare:
            compare = False
            if size < rows and size == g // saved and remainder != "error":
                yield _Warning(_resumed_short(call, what, size, rows, g, saved, remainder, shares))
        position = dataclasses.replace(
            position, batches=index + 1, global_batch_size=g, state=state
        )
        if size > rows:
            raise ValueError(_too_large(call, what, index, size, rows, g, first, shares, n))
        incomplete = size < rows
        if incomplete:
            if remainder == "drop" and not drop_everywhere:
                continue
            if remainder == "error":
                raise ValueError(_incomplete(call, index, size, rows, g, n, shares))
            leaves = [_pad(x, rows) for x in leaves]
        mask = None
        if remainder == "pad":
            mask = (np.arange(rows) < size).reshape(unit, rows // unit)
        arrays = [x.reshape((unit, rows // unit) + tuple(x.shape[1:])) for x in leaves]
        if mask is not None:
            arrays.append(mask)
        placed = _place_local(topology, arrays) if local else _place(topology, arrays)
        if mask is None:
            value = PerReplica(treedef.unflatten(placed))
        else:
            value = PaddedBatch(PerReplica(treedef.unflatten(placed[:-1])), PerReplica(placed[-1]))
        # Several processes compare their batches' layouts before each step is used.
        layout = Layout.of(treedef, leaves, "batch", rows=True) if processes > 1 else None
        share = rows if local else None
        yield _Positioned(value, position, incomplete and drop_everywhere, share, layout)


def _resumed_short(
    call: str, what: str, size: int, rows: int, g: int, saved: int, remainder: str, shares: Shares
) -> str:
    """Returns the warning of a pass resumed on another process count from process-local
    shares whose first batch has the saved run's G/P rows: every one would be padded or
    dropped."""
    fate = "padded to that size (with a mask)" if remainder == "pad" else "dropped"
    now = f"{shares.processes} processes" if shares.is_local else "1 process"
    return (
        f"{call}: the position given as start= was taken by {saved} processes, each reading "
        f"its share of the global batch size G={g} ({size} rows), and this run has {now}, so "
        f"each {what} holds G/{shares.processes} = {rows} rows; the first {what} read has "
        f"{size}, the saved run's share: if every {what} is that size, each is incomplete and "
        f"will be {fate}. A run continued on another process count keeps G: make each "
        f"process's source yield {rows} rows (G / the process count), or pass start=None to "
        f"start a new pass with G from the first {what}."
    )


def _incomplete(call: str, index: int, size: int, rows: int, g: int, n: int, shares: Shares) -> str:
    fixes = (
        "Use remainder='pad' to pad it (with a mask), remainder='drop' to skip it, or make "
        f"every {'share' if shares.is_local else 'batch'} hold exactly {rows} examples."
    )
    if shares.is_local:
        return (
            f"{call}(remainder='error', process_local=True): share {index} has {size} "
            f"examples, fewer than its {rows} of the global batch size G={g} ({g // n} per "
            f"replica on N={n} replicas, {shares.processes} processes). {fixes}"
        )
    return (
        f"{call}(remainder='error'): batch {index} has {size} examples, fewer than the global "
        f"batch size G={g} ({g // n} per replica on N={n} replicas). {fixes}"
    )


def _too_large(
    call: str,
    what: str,
    index: int,
    size: int,
    rows: int,
    g: int,
    first: int | None,
    shares: Shares,
    n: int,
) -> str:
    if first is None:
        origin = "as the position given as start= recorded it"
    elif shares.is_local:
        origin = (
            f"the first share's {first} rows rounded up to a multiple of this process's "
            f"{shares.unit} replicas, times {shares.processes} processes"
        )
    else:
        origin = f"the first batch's {first} examples rounded up to a multiple of N={n} replicas"
    limit = f"{rows} rows per share of G={g}" if shares.is_local else f"G={g}"
    return (
        f"{call}: {what} {index} has {size} examples, more than the global batch size allows "
        f"({limit}: {origin}). Every {what} may hold at most that many examples (only smaller, "
        f"incomplete ones are allowed); make the first {what} the largest, or re-batch the "
        "source."
    )


def _place_local(topology: Topology, arrays: list[Any]) -> list[jax.Array]:
    """Returns this process's rows `(n_local, ...)` of each global `(N, ...)` array, placed on its
    own replicas; no other process's rows are read. Each host array is copied first: on CPU, JAX
    may place an aligned host buffer without copying it, and a loader may refill it."""
    n = topology.num_replicas
    return [
        jax.make_array_from_process_local_data(
            topology.stacked, np.array(x) if isinstance(x, np.ndarray) else x, (n,) + x.shape[1:]
        )
        for x in arrays
    ]


def dealt_batches(
    topology: Topology, source: Source, control: Control, start: Position | None
) -> Iterator[Any]:
    """Yields placed `PerReplica` batches, dealing N consecutive elements to replicas 0..N-1.

    With several processes each process's pipeline deals its own `num_local_replicas`
    elements per step to its own replicas. Positions count steps; a resumed pass skips
    `num_local_replicas` elements per step received (or gives the pipeline its state).
    """
    n = topology.num_local_replicas
    processes = topology.process_count
    resume = None
    if start is not None and start.batches:
        resume = Resume(
            start.batches * n,
            start.state,
            every=n,
            saved=start.processes,
            current=processes,
            unit="steps",
        )
    step = start.batches if start is not None else 0
    position = Position(step, None, processes, processes > 1, steps=True)
    group: list[Any] = []
    pulled = source.pull(control, resume)
    try:
        for _, element, state in pulled:
            group.append(element)
            if len(group) == n:
                stacked, layout = _stack_group(topology, group, step)
                step += 1
                position = dataclasses.replace(position, batches=step, state=state)
                yield _Positioned(stacked, position, layout=layout)
                group = []
    finally:
        pulled.close()
    if group and not control.stopped.is_set():
        yield _Warning(
            f"{FUNCTION_CALL}: the dataset function's elements ran out after {len(group)} of "
            f"the {n} per-replica batches of the last step, so those {len(group)} per-replica "
            f"batch(es) were dropped. Make the number of elements a multiple of {n} (for "
            "example, repeat or pad the dataset) to use them."
        )


def _stack_group(
    topology: Topology, group: list[Any], step: int
) -> tuple[PerReplica, Layout | None]:
    """Returns one step's elements stacked and placed, and (several processes) their layout,
    which the processes compare before the step is used."""
    call = FUNCTION_CALL
    flats = []
    treedef = _flatten(group[0])[1]
    for replica, element in enumerate(group):
        flat, structure = _flatten(element)
        if structure != treedef:
            raise ValueError(
                f"{call}: at step {step} the element for replica {replica} has structure "
                f"{structure}, but replica 0's has {treedef}; every element must have the same "
                "pytree structure."
            )
        where = f"replica {replica}'s element at step {step}"
        flats.append(
            [
                np.asarray(_as_array(call, where, element, x, i, "element"))
                for i, x in enumerate(flat)
            ]
        )
    stacked = []
    for i, parts in enumerate(zip(*flats, strict=False)):
        for replica, part in enumerate(parts):
            if part.shape != parts[0].shape or part.dtype != parts[0].dtype:
                path = _leaf_path(group[0], i, "element")
                raise ValueError(
                    f"{call}: at step {step} leaf {path} of replica {replica}'s element has "
                    f"shape {part.shape} and dtype {part.dtype}, but replica 0's has "
                    f"{parts[0].shape} and {parts[0].dtype}; the N elements of one step must "
                    "share shapes and dtypes. Batch the dataset with drop_remainder, or pad it."
                )
        stacked.append(np.stack(parts))
    if topology.process_count > 1:
        shape = lambda x: (topology.num_replicas,) + x.shape[1:]  # noqa: E731
        placed = [
            jax.make_array_from_process_local_data(topology.stacked, x, shape(x)) for x in stacked
        ]
        layout = Layout.of(treedef, flats[0], "element", rows=False)
        return PerReplica(treedef.unflatten(placed)), layout
    return PerReplica(treedef.unflatten(_place(topology, stacked))), None
