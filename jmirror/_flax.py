"""What jmirror knows of flax outside the NNX adapter: metadata boxes and linen state.

- **Metadata boxes.** A linen `nn.Partitioned` (any `flax.core.meta.AxisMetadata` with
  `names`) and an NNX `Variable` with `out_sharding` declare the layout of the array they
  hold inside a replica; `jmirror._topology.declared_leaves` reads them through the names
  registered here.
- **Fixes the mirrored-state rule names.** A diverged leaf under `batch_stats` is a linen
  `nn.BatchNorm` without `axis_name`; under `params` or `opt_state` (a `TrainState`'s
  fields), parameters updated from unreduced gradients. `BATCH_NORM` is the fix for an
  `nnx.BatchNorm` (`jmirror._nnx` names it).

Nothing here imports flax: a flax object can only exist once the caller imported flax, so
`sys.modules` tells. Importing this module registers what it knows.
"""

from __future__ import annotations

import sys
from typing import Any

import jax
from jax.sharding import NamedSharding

from jmirror import _mirrored_state, _topology
from jmirror._values import PyTree

BATCH_NORM = (
    "An nnx.BatchNorm without axis_name computes its statistics over one replica's batch, and "
    "they drift apart per replica: call jm.sync_batch_norm(model, strategy) once before "
    "training, with the strategy that runs the step (the model definition stays as it is), "
    "or build it as nnx.BatchNorm(..., axis_name=strategy.axis_name); the statistics are then "
    "over the global batch."
)
LINEN_BATCH_NORM = (
    "A linen nn.BatchNorm without axis_name computes its batch_stats over one replica's batch: "
    "give it axis_name=strategy.axis_name in the module definition (linen takes it there), so "
    "that the statistics are over the global batch."
)


def is_variable(x: object) -> bool:
    """Returns whether `x` is a flax `nnx.Variable`."""
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(x, nnx.Variable)


def is_flax_internal(entry: object, child: object) -> bool:
    """Returns whether `child`, under `entry`, is a flax object's internal pytree node holding
    no arrays (an NNX object's `_pytree__...` bookkeeping), which checkpoints leave out."""
    name = getattr(entry, "name", None)
    return (
        isinstance(name, str)
        and name.startswith("_pytree__")
        and type(child).__module__.startswith("flax.")
        and not jax.tree.leaves(child)
    )


def _linen_names(x: PyTree) -> Any:
    """Returns the names of a linen metadata box (`nn.Partitioned`; `()` for a box without
    names), else None."""
    meta = sys.modules.get("flax.core.meta")
    if meta is None or not isinstance(x, getattr(meta, "AxisMetadata", ())):
        return None
    return getattr(x, "names", None) or ()


def _variable_names(x: PyTree) -> Any:
    """Returns the `out_sharding` names of an NNX `Variable` (flax 0.12's name; reading its
    deprecated `sharding_names` warns; `()` for a Variable without them), else None."""
    if not is_variable(x):
        return None
    names = x.get_metadata("out_sharding", None)
    names = tuple(names.spec) if isinstance(names, NamedSharding) else names
    return tuple(names) if names else ()


def _linen_cause(path: tuple) -> str | None:
    """Returns the fix for a diverged leaf of linen state by its path, or None."""
    keys = jax.tree_util.keystr(path)
    if "batch_stats" in keys:
        return LINEN_BATCH_NORM
    if "params" in keys or "opt_state" in keys:
        return _mirrored_state.GRADIENTS
    return None


_topology.register_box(_linen_names)
_topology.register_box(_variable_names)
_mirrored_state.register_path_cause(_linen_cause)
