"""Reading the collectives of a compiled step from its HLO."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_INSTRUCTION = re.compile(r"=\s*(?P<shape>.+?)\s+(?P<op>" + "|".join(_OPS) + r")(?:-start)?\(")
_ARRAY = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled step: its opcode and the bytes it produces.

    Example:
        >>> from jmirror.testing import Collective
        >>> Collective("all-reduce", 16)
        Collective(op='all-reduce', bytes=16)
    """

    op: str
    bytes: int


def collectives(step: Any) -> list[Collective]:
    """Lists the cross-device collectives of a compiled step, in HLO order.

    Args:
      step: a `jax.stages.Lowered` (for example `jm.replicate(fn).lower(...)`), a
        `jax.stages.Compiled`, or HLO text.

    Returns:
      One `Collective(op, bytes)` per all-reduce, all-gather, reduce-scatter, all-to-all or
      collective-permute, after XLA's optimisations (combined all-reduces count once).

    Example:
        >>> import jax.numpy as jnp, jmirror as jm, jmirror.testing as jmt
        >>> step = jm.replicate(lambda x: jm.all_reduce("sum", x))
        >>> ops = jmt.collectives(step.lower(jnp.ones(4)))
        >>> [(c.op, c.bytes) for c in ops] if jm.get_strategy().num_replicas > 1 else [
        ...     ("all-reduce", 16)]
        [('all-reduce', 16)]
    """
    if hasattr(step, "compile"):
        step = step.compile()
    text = step if isinstance(step, str) else step.as_text()
    found = []
    for line in text.splitlines():
        match = _INSTRUCTION.search(line)
        if match is None or "-done" in line.split("=", 1)[-1].split("(", 1)[0]:
            continue
        size = 0
        for dtype, dims in _ARRAY.findall(match.group("shape")):
            count = 1
            for d in filter(None, dims.split(",")):
                count *= int(d)
            size += count * _DTYPE_BYTES[dtype]
        found.append(Collective(match.group("op"), size))
    return found
