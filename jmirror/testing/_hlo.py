"""Reading the collectives of a compiled step from its HLO."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

# HLO element types: their numpy dtypes (bfloat16 is ml_dtypes', as JAX registers it).
_DTYPES = {
    "pred": np.dtype(np.bool_),
    "s8": np.dtype(np.int8),
    "u8": np.dtype(np.uint8),
    "s16": np.dtype(np.int16),
    "u16": np.dtype(np.uint16),
    "f16": np.dtype(np.float16),
    "bf16": np.dtype(jnp.bfloat16),
    "s32": np.dtype(np.int32),
    "u32": np.dtype(np.uint32),
    "f32": np.dtype(np.float32),
    "s64": np.dtype(np.int64),
    "u64": np.dtype(np.uint64),
    "f64": np.dtype(np.float64),
    "c64": np.dtype(np.complex64),
    "c128": np.dtype(np.complex128),
}
_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_INSTRUCTION = re.compile(r"=\s*(?P<shape>.+?)\s+(?P<op>" + "|".join(_OPS) + r")(?:-start)?\(")
_ARRAY = re.compile(r"\b(" + "|".join(_DTYPES) + r")\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s.*\{\s*$")
_CALLEE = re.compile(
    r"\b(?P<how>body|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')

# One operand of a collective instruction: its element type and dimensions.
_Operand = tuple[str, tuple[int, ...]]


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled step: its opcode, the bytes it produces and
    the dtype it communicates in.

    `dtype` is the dtype of its operands as the program given to XLA has them (`None` when
    XLA combined operands of several dtypes into this one instruction: `dtypes` has each).

    Example:
        >>> import numpy as np
        >>> from jmirror.testing import Collective
        >>> c = Collective("all-reduce", 16, np.dtype("float32"), (np.dtype("float32"),))
        >>> c.op, c.bytes, c.dtype == np.float32
        ('all-reduce', 16, True)
    """

    op: str
    bytes: int
    dtype: np.dtype | None = None
    dtypes: tuple[np.dtype, ...] = ()


def collectives(step: Callable[..., Any]) -> list[Collective]:
    """Lists the cross-device collectives one call of a compiled step runs, in HLO order.

    Args:
      step: a `jax.stages.Lowered` (for example `jm.replicate(fn).lower(...)`), a
        `jax.stages.Compiled`, or HLO text.

    Returns:
      One `Collective(op, bytes, dtype, dtypes)` per all-reduce, all-gather, reduce-scatter,
      all-to-all or collective-permute, after XLA's optimisations (combined all-reduces count
      once). A collective inside a loop (a `lax.scan`, a `fori_loop`) is listed once per
      iteration when XLA knows the trip count (else once). For a `Lowered` step each entry's
      dtype (and its bytes, counted in it) is the one in the program jmirror hands to XLA,
      before XLA's own passes: XLA:CPU computes a bfloat16 all-reduce in float32, yet the
      entry says bfloat16, as a GPU or TPU would reduce it. For a `Compiled` step or HLO
      text, the dtype is the compiled instruction's.

    Example:
        >>> import jax.numpy as jnp, jmirror as jm, jmirror.testing as jmt
        >>> step = jm.replicate(lambda x: jm.all_reduce("sum", x, dtype=jnp.float32))
        >>> ops = jmt.collectives(step.lower(jnp.ones(4, jnp.bfloat16)))
        >>> [(c.op, str(c.dtype)) for c in ops] if jm.get_strategy().num_replicas > 1 else [
        ...     ("all-reduce", "float32")]
        [('all-reduce', 'float32')]
    """
    given: list[tuple[str, list[_Operand]]] | None = None
    if hasattr(step, "compile"):
        given = [
            (op, operands)
            for op, operands, _ in _instructions(step.compiler_ir("hlo").as_hlo_text())
        ]
        step = step.compile()
    text = step if isinstance(step, str) else step.as_text()
    found = _instructions(text)
    named = [(op, operands) for op, operands, _ in found]
    if given is not None:
        named = _as_given(named, given)
    runs = _runs(text)
    return [
        _collective(op, operands)
        for (op, operands), (_, _, where) in zip(named, found)
        for _ in range(runs.get(where, 1))
    ]


def _instructions(text: str) -> list[tuple[str, list[_Operand], str]]:
    """Returns the collective instructions of HLO text: opcode, operands and the computation that
    holds each, in order."""
    found = []
    where = ""
    for line in text.splitlines():
        header = _COMPUTATION.match(line)
        if header is not None:
            where = header.group("name")
            continue
        match = _INSTRUCTION.search(line)
        if match is None or "-done" in line.split("=", 1)[-1].split("(", 1)[0]:
            continue
        operands = [
            (dtype, tuple(int(d) for d in filter(None, dims.split(","))))
            for dtype, dims in _ARRAY.findall(match.group("shape"))
        ]
        found.append((match.group("op"), operands, where))
    return found


def _runs(text: str) -> dict[str, int]:
    """Returns how many times one call of the module runs each computation: the entry once, a
    loop body once per iteration of a known trip count, any other callee once per call."""
    calls: dict[str, list[tuple[str, int]]] = {}
    entry = None
    where = ""
    for line in text.splitlines():
        header = _COMPUTATION.match(line)
        if header is not None:
            where = header.group("name")
            entry = where if header.group("entry") else entry
            continue
        trips = _TRIP_COUNT.search(line)
        for how, callee in _CALLEE.findall(line):
            times = int(trips.group(1)) if how == "body" and trips is not None else 1
            calls.setdefault(where, []).append((callee, times))
        for branches in _BRANCHES.findall(line):
            for callee in branches.split(","):
                calls.setdefault(where, []).append((callee.strip().lstrip("%"), 1))
    runs: dict[str, int] = {}

    def visit(name: str, times: int, depth: int) -> None:
        runs[name] = runs.get(name, 0) + times
        for callee, factor in calls.get(name, []) if depth < 64 else []:
            visit(callee, times * factor, depth + 1)

    if entry is not None:
        visit(entry, 1, 0)
    return runs


def _as_given(
    compiled: list[tuple[str, list[_Operand]]], given: list[tuple[str, list[_Operand]]]
) -> list[tuple[str, list[_Operand]]]:
    """Returns the compiled instructions with each operand's dtype as in the program given to XLA:
    matched, in order, to an operand of the same opcode and shape there (XLA combines
    collectives and may widen their dtype, but keeps each operand's shape)."""
    pool = [(op, dims, dtype) for op, operands in given for dtype, dims in operands]
    out = []
    for op, operands in compiled:
        named = []
        for dtype, dims in operands:
            match = next((p for p in pool if p[0] == op and p[1] == dims), None)
            if match is not None:
                pool.remove(match)
                dtype = match[2]
            named.append((dtype, dims))
        out.append((op, named))
    return out


def _collective(op: str, operands: list[_Operand]) -> Collective:
    dtypes = tuple(_DTYPES[dtype] for dtype, _ in operands)
    size = sum(
        int(np.prod(dims, dtype=np.int64)) * _DTYPES[dtype].itemsize for dtype, dims in operands
    )
    return Collective(op, size, dtypes[0] if len(set(dtypes)) == 1 else None, dtypes)
