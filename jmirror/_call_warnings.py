"""Warns of calls of a replicated function that work but do not do what the user meant.

Each warning is given once per replicated function, pointing at the caller's line:

- a numpy array whose leading axis equals the replica count passed as a plain argument (a
  per-replica batch broadcast whole to every replica);
- a `jax.Array` laid out the `jax.pmap` way passed as a plain argument;
- a function that keeps compiling new input signatures (shapes, dtypes, structures, static
  values), naming the arguments that keep changing;
- mirrored state returned per replica in a plain pytree (`jm.MirroredStateWarning`).

They look at a call's arguments only when the call compiled (or failed), never on the fast
path.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from jmirror._mirrored_state import MirroredStateWarning
from jmirror._values import PyTree, is_distributed

if TYPE_CHECKING:
    from jmirror._topology import Topology

# More input signatures than this compiled by one replicated function earn a warning.
RETRACE_WARNING_AT = 8


class CallWarnings:
    """The warnings of one replicated function (each kind once)."""

    def __init__(self, name: str):
        self._name = name
        self._warned: set[str] = set()
        # The input signatures of calls that compiled: what the retracing warning counts.
        self._signatures: set[tuple] = set()

    def after_compile(
        self,
        num_replicas: int,
        topology: Topology,
        inputs: PyTree,
        where: Any,
        statics: Sequence[tuple[int, Any]] = (),
        named: Sequence[tuple[str, Any]] = (),
    ) -> None:
        """Warns of a compiled call's arguments and of a function that keeps retracing.

        Args:
          num_replicas: the strategy's replica count.
          topology: the strategy's `Topology`.
          inputs: `(donated args, other args, kwargs)` as the call got them.
          where: names a key path into `inputs` (`Positions.where`).
          statics: `(flat index, value)` of the static leaves of `inputs`.
          named: `(where, value)` of the static arguments (`static_argnums` / `argnames`).
        """
        leaves = jax.tree_util.tree_flatten_with_path(inputs)[0]
        self.of_arguments(num_replicas, topology, inputs, where)
        static_at = dict(statics)
        signature = tuple(
            (where(p), "static", _value(static_at[i]))
            if i in static_at
            else (where(p), _shape(x), _dtype(x))
            for i, (p, x) in enumerate(leaves)
        )
        signature += tuple((at, "static", _value(value)) for at, value in named)
        self._signatures.add((jax.tree_util.tree_structure(inputs), signature))
        if len(self._signatures) <= RETRACE_WARNING_AT:
            return
        seen: dict[str, set[tuple]] = {}
        for _, signature in self._signatures:
            for path, shape, dtype in signature:
                seen.setdefault(path, set()).add((shape, dtype))
        changing = [(p, sorted(s, key=repr)) for p, s in seen.items() if len(s) > 1]
        shown = "; ".join(
            f"{p}: " + ", ".join(f"{shape} {dtype}" for shape, dtype in s[:4])
            for p, s in changing[:5]
        )
        message = _RETRACING.format(
            fn=self._name, k=len(self._signatures), changing=shown or _STRUCTURE_CHANGES
        )
        self.once("retrace", message)

    def of_arguments(
        self, num_replicas: int, topology: Topology, inputs: PyTree, where: Any
    ) -> None:
        """Warns of host batches broadcast every call and of pmap-layout arrays passed as
        plain arguments."""
        nodes = jax.tree_util.tree_flatten_with_path(inputs, is_leaf=is_distributed)[0]
        n = num_replicas
        for path, node in nodes:
            if isinstance(node, np.ndarray) and node.ndim and node.shape[0] == n:
                message = _HOST_BATCH.format(fn=self._name, shape=node.shape, path=where(path), n=n)
                self.once("host batch", message)
            elif (
                isinstance(node, jax.Array)
                and not isinstance(node, jax.core.Tracer)
                and topology.is_pmap_layout(node)
            ):
                message = _PMAP_LAYOUT.format(
                    fn=self._name, shape=node.shape, path=where(path), n=n
                )
                self.once("pmap layout", message)

    def once(self, kind: str, message: str, category: type[Warning] = UserWarning) -> None:
        """Warns `message` unless a warning of `kind` was given before."""
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(message, category, stacklevel=caller_level())

    def options_outside(self, options: Sequence[tuple[str, str]], prepared: Any) -> None:
        """Warns, once, that a step needing XLA `options` is traced by the caller's own
        transformation with half-precision floats among its arguments: that transformation's
        program compiles without them, and XLA:CPU may end the process."""
        leaves = [*prepared.donated, *prepared.others]
        if not any(getattr(x, "dtype", None) in _HALF for x in leaves):
            return
        given = ", ".join(f"{k!r}: {v!r}" for k, v in options)
        self.once("options outside", _OPTIONS_OUTSIDE.format(fn=self._name, options=given))

    def mirrored_state(self, message: str) -> None:
        """Warns of mirrored state returned per replica in a plain pytree (once)."""
        self.once("mirrored state", message, MirroredStateWarning)


_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_OPTIONS_OUTSIDE = (
    "{fn} is traced by your own transformation (jax.grad, jax.vmap, lax.scan, jax.jit, ...) "
    "with bfloat16 or float16 arguments, and its replicas span several XLA:CPU devices. XLA "
    "compiles your transformation's program, and its pass that promotes half-precision "
    'all-reduces ends the process on the collectives of such steps ("Invalid binary '
    'instruction opcode copy"). Compile the transformation in a jax.jit of your own with '
    "the step's options, e.g. jax.jit(jax.grad(loss), compiler_options={{{options}}}); or "
    "reduce in float32 (jm.all_reduce(..., dtype=jnp.float32)) with float32 arguments."
)


def _shape(x: PyTree) -> tuple | str:
    """Returns a leaf's shape (an attribute read: `np.shape` of a jax.Array costs more),
    `()` for a number, "static" for a static leaf."""
    shape = getattr(x, "shape", None)
    if shape is not None:
        return tuple(shape)
    return () if isinstance(x, (int, float, complex)) else "static"


def _value(x: object) -> str:
    """Returns how the retracing warning shows a static value: its repr and type."""
    return f"{repr(x)[:40]} ({type(x).__name__})"


def _dtype(x: PyTree) -> str:
    if hasattr(x, "dtype"):
        return str(x.dtype)
    if isinstance(x, (bool, int, float, complex)):
        return type(x).__name__
    return repr(x)[:40]


_INTERNAL = (__file__, __file__.replace("_call_warnings", "_replicate"))


def caller_level() -> int:
    """Returns the `stacklevel` of the first frame outside jmirror's call path: the caller's."""
    frame, level = inspect.currentframe(), 0
    while frame is not None and frame.f_code.co_filename in _INTERNAL:
        frame, level = frame.f_back, level + 1
    return level


def argument_path(path: Sequence[Any], static: Sequence[int]) -> str:
    """Names a path into `((dynamic args), kwargs)`: `args[i]...` / `kwargs[...]`."""
    first, rest = path[0], path[1:]
    if first.idx == 1:
        return "kwargs" + jax.tree_util.keystr(tuple(rest))
    i = rest[0].idx
    dynamic = [j for j in range(i + len(static) + 1) if j not in static]
    return f"args[{dynamic[i]}]" + jax.tree_util.keystr(tuple(rest[1:]))


_HOST_BATCH = (
    "{fn} got a numpy array of shape {shape} at {path}, whose leading axis equals the {n} "
    "replicas, as a plain argument: it is transferred whole to every device on every call, and "
    "every replica sees all of it. If it is a per-replica batch (such as flax's "
    "common_utils.shard output), wrap it as jm.PerReplica(batch) or let "
    "strategy.distribute_dataset place the batches; if it is state, place it once with "
    "strategy.mirror(x) and pass the mirrored value."
)
_PMAP_LAYOUT = (
    "{fn} got a jax.Array of shape {shape} at {path} laid out the jax.pmap way (its leading "
    "axis of {n} split over the strategy's {n} devices, as flax.jax_utils.prefetch_to_device "
    "and jax_utils.replicate return it) as a plain argument: it is broadcast whole, so every "
    "replica sees all {n} slices (a replicated state keeps its extra leading axis). If it is a "
    "per-replica batch, wrap it as jm.PerReplica(x), and each replica sees its own slice "
    "(strategy.distribute_dataset places batches that way); if it is replicated state, mirror "
    "it once with strategy.mirror(jax_utils.unreplicate(x)) and pass the mirrored value."
)
_RETRACING = (
    "{fn} has compiled {k} input signatures: every new shape, dtype, tree structure or static "
    "value of its arguments compiles the step again. Arguments that keep changing: "
    "{changing}. Pad batches to fixed shapes (strategy.distribute_dataset(..., "
    "remainder='pad') keeps every batch's shape), and pass Python values that change as "
    "static_argnums only when few."
)
_STRUCTURE_CHANGES = (
    "(the tree structure changes: a static pytree field, such as a flax struct.field("
    "pytree_node=False) or an NNX model's train()/eval() mode, that differs between calls)"
)
