"""`jm.sync_batch_norm`: every `nnx.BatchNorm` of a model normalizes over the global batch.

torch's `SyncBatchNorm.convert_sync_batchnorm` for flax NNX: a model written as upstream wrote
it (`nnx.BatchNorm(features, rngs=rngs)`, no `axis_name`) computes its batch statistics per
replica inside a replicated function, so they drift apart between replicas. Setting each
BatchNorm's `axis_name` to the strategy's makes flax average the statistics over the replicas
(`lax.pmean` over that axis), which is what `nnx.jit` computes on the global batch.

flax is looked up in `sys.modules`, never imported here: no NNX object (nor linen module) can
exist before the caller imported flax, so jmirror itself imports without it.
"""

from __future__ import annotations

import sys
import types
from typing import Protocol, TypeVar

from jmirror import _equinox
from jmirror._context import current_strategy

Module = TypeVar("Module")


class HasAxisName(Protocol):
    """What `sync_batch_norm` uses of a strategy: its replicas' axis name."""

    @property
    def axis_name(self) -> str: ...


_LINEN = (
    "jm.sync_batch_norm got a flax linen module ({type}); linen modules are immutable "
    "definitions, so their BatchNorm takes axis_name where it is defined: write "
    "nn.BatchNorm(..., axis_name={axis_name!r}) in the module (the strategy's axis_name). "
    "jm.sync_batch_norm converts flax NNX modules (flax.nnx.Module)."
)
_NOT_NNX = (
    "jm.sync_batch_norm expects a flax NNX object (an nnx.Module, or an NNX object holding "
    "modules such as nnx.List) or an equinox model (an eqx.Module), got {type}. Pass the "
    "model whose BatchNorm layers should normalize over the replicas: "
    "model = jm.sync_batch_norm(model, strategy)."
)
_HOLDS_MODEL = (
    "jm.sync_batch_norm expects a flax NNX object (an nnx.Module, or an NNX object holding "
    "modules such as nnx.List) or an equinox model (an eqx.Module), got a {type} holding "
    "{model} at [{index}]. Pass the model alone: model = jm.sync_batch_norm(model, strategy). "
    "The conversion changes only each BatchNorm's axis_name, so what is passed beside the "
    "model (an eqx.nn.State from eqx.nn.make_with_state, an optimizer) is unchanged: keep "
    "using it as it is with the converted model."
)
_OTHER_AXIS = (
    "jm.sync_batch_norm: the nnx.BatchNorm at {path} already has axis_name={found!r}, which is "
    "not the strategy's axis_name {expected!r}; inside a replicated function only the "
    "strategy's axis exists. Build it with axis_name=None (jm.sync_batch_norm then sets it), "
    "or create the strategy with axis_name={found!r}."
)


def sync_batch_norm(module: Module, strategy: HasAxisName | None = None) -> Module:
    """Makes every `nnx.BatchNorm` in `module` compute its statistics over all replicas.

    Sets the `axis_name` of each `flax.nnx.BatchNorm` reachable from `module` (shared
    layers once) to the strategy's axis name, in place, and returns `module`. Inside a
    replicated function the batch mean and variance are then those of the global batch, and
    the running statistics stay mirrored: the result equals `nnx.jit` on one device on the
    global batch. The model definition stays as upstream wrote it (torch's
    `SyncBatchNorm.convert_sync_batchnorm`). Outside a replicated function, a converted
    BatchNorm in training mode has no replica axis to average over; evaluation with
    `model.eval()` (running statistics) works anywhere.

    Args:
      module: a flax NNX object: an `nnx.Module`, or an NNX object holding modules (an
        `nnx.List`, `nnx.Dict`); or an equinox model (an `eqx.Module`), without its state.
      strategy: the `MirroredStrategy` whose `axis_name` to use; `None`: the current
        strategy (`jm.get_strategy()`).

    An equinox model (`eqx.Module`) is immutable: a new model is returned, in which every
    `eqx.nn.BatchNorm` has the strategy's axis name added to its `axis_name` (its `vmap`
    axis stays first: `("batch", strategy.axis_name)`).

    Returns:
      `module` itself, converted (a new model for equinox).

    Raises:
      TypeError: for a flax linen module (linen takes `axis_name` in its definition:
        `nn.BatchNorm(axis_name=...)`), or anything else that is neither an NNX object nor an
        equinox model (a `(model, state)` tuple included: pass the model alone).
      ValueError: for a BatchNorm that already has another `axis_name`.

    Example:
        >>> from flax import nnx
        >>> import jmirror as jm
        >>> rngs = nnx.Rngs(0)
        >>> model = nnx.Sequential(nnx.Linear(2, 4, rngs=rngs), nnx.BatchNorm(4, rngs=rngs))
        >>> jm.sync_batch_norm(model) is model
        True
        >>> model.layers[1].axis_name == jm.get_strategy().axis_name
        True
    """
    if _equinox.is_module(module):  # immutable: a new model
        axis_name = (current_strategy() if strategy is None else strategy).axis_name
        return _equinox.sync_batch_norm(module, axis_name)
    nnx = sys.modules.get("flax.nnx")
    if nnx is None or not nnx.graph.is_graph_node(module):
        linen = sys.modules.get("flax.linen")
        if linen is not None and isinstance(module, linen.Module):
            axis_name = (current_strategy() if strategy is None else strategy).axis_name
            raise TypeError(_LINEN.format(type=type(module).__name__, axis_name=axis_name))
        raise _not_a_model(module, nnx)
    axis_name = (current_strategy() if strategy is None else strategy).axis_name
    layers = [(p, x) for p, x in nnx.iter_graph(module) if isinstance(x, nnx.BatchNorm)]
    for path, layer in layers:
        if layer.axis_name not in (None, axis_name):
            where = "".join(f"[{p!r}]" if isinstance(p, int) else f".{p}" for p in path)
            raise ValueError(
                _OTHER_AXIS.format(
                    path=where or "the top level", found=layer.axis_name, expected=axis_name
                )
            )
    for _, layer in layers:
        layer.axis_name = axis_name
    return module


def _not_a_model(value: object, nnx: types.ModuleType | None) -> TypeError:
    """Returns the error of a value that is no model; a tuple or list holding one (`(model,
    state)` from `eqx.nn.make_with_state`) is told to pass the model alone."""
    if isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            if _equinox.is_module(item) or (nnx is not None and nnx.graph.is_graph_node(item)):
                model = type(item).__name__
                return TypeError(
                    _HOLDS_MODEL.format(type=type(value).__name__, model=model, index=i)
                )
    return TypeError(_NOT_NNX.format(type=type(value).__name__))
