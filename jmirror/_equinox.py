"""equinox modules as arguments of replicated functions, with `eqx.filter_jit`'s semantics.

An `eqx.Module` is a pytree whose leaves mix arrays with functions, flags and numbers
(`eqx.nn.MLP.activation`, `eqx.nn.Dropout.inference`). Inside a module, at any depth, only
arrays are traced: every other leaf, Python numbers and bools included, is static, exactly as
`eqx.filter_jit` partitions it with `eqx.is_array`. `ADAPTER` says so through the adapter
interface (`jmirror._adapter.Adapter.leaf_policy`); equinox modules are immutable, so no
call needs a variant of the replica function or a write-back.

Nothing here imports equinox: an equinox module can only exist once the caller imported it,
so `sys.modules` tells.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import jax

from jmirror import _mirrored_state
from jmirror._adapter import Adapted
from jmirror._arguments import is_array
from jmirror._mirrored_state import StateKind, Traced
from jmirror._values import Structure


def _equinox() -> Any:
    """Returns `equinox` when the caller has imported it, else None."""
    return sys.modules.get("equinox")


def is_module(x: Any) -> bool:
    """Returns whether `x` is an `eqx.Module`."""
    eqx = _equinox()
    return eqx is not None and isinstance(x, eqx.Module)


class EquinoxAdapter:
    """The `jmirror._adapter.Adapter` of equinox modules: their non-array leaves are static."""

    def adapt(
        self, args: tuple, kwargs: dict, static_argnums: tuple[int, ...], deep: bool = False
    ) -> Adapted | None:
        """Returns None: an equinox module runs through the user's own function."""
        return None

    def deep(self, in_treedef: Structure) -> bool:
        """Returns False: equinox modules need no variant."""
        return False

    def leaf_policy(self, node_type: type) -> Any:
        """Returns `is_array` for `eqx.Module` subclasses (their other leaves are static)."""
        eqx = _equinox()
        if eqx is not None and issubclass(node_type, eqx.Module):
            return is_array
        return None


ADAPTER = EquinoxAdapter()


# --- state under the mirrored-state rule ------------------------------------------------------


def _is_state(x: Any) -> bool:
    """Returns whether `x` is equinox state: an `eqx.Module` or an `eqx.nn.State`."""
    eqx = _equinox()
    return eqx is not None and isinstance(x, (eqx.Module, eqx.nn.State))


def _cause(traced: Traced, state: Any, path: tuple) -> str | None:
    """Returns the fix for a diverged leaf of returned equinox state: a BatchNorm without
    the strategy's axis (naming the layer and both fixes), else unreduced gradients."""
    eqx = _equinox()
    axis = traced.axis_name
    for where, norm in _batch_norms(traced.inputs):
        if not _has_axis(norm.axis_name, axis):
            own = norm.axis_name
            return (
                f"The eqx.nn.BatchNorm at {traced.argument_path(where)} has "
                f"axis_name={own!r}, without the strategy's axis {axis!r}, so its statistics "
                "are over one replica's batch and drift apart per replica: build it with "
                f"axis_name=({_first(own)!r}, {axis!r}) (its vmap axis and the replica "
                "axis), or convert the model once with model = jm.sync_batch_norm(model, "
                "strategy), which returns a new model with the strategy's axis added to every "
                "BatchNorm. The statistics are then over the global batch."
            )
    if eqx is not None and isinstance(state, eqx.Module):
        return _mirrored_state.GRADIENTS
    return None


def _batch_norms(tree: Any) -> list[tuple[tuple, Any]]:
    """Returns `(path, layer)` for every `eqx.nn.BatchNorm` in `tree`."""
    eqx = _equinox()
    if eqx is None:
        return []
    norm = eqx.nn.BatchNorm
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, norm))[0]
    return [(p, x) for p, x in flat if isinstance(x, norm)]


def _has_axis(axis_name: Any, axis: str | None) -> bool:
    names = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)
    return axis is None or axis in names


def _first(axis_name: Any) -> Any:
    if isinstance(axis_name, (tuple, list)) and len(axis_name) == 1:
        return axis_name[0]
    return axis_name


def _describe(traced: Traced, state: Any, path: tuple) -> str | None:
    """Names what a diverged leaf of a returned `eqx.nn.State` is: the state of the layer
    whose `StateIndex` keys it (an `eqx.nn.State` flattens to one child per index, keyed by
    position only)."""
    eqx = _equinox()
    if eqx is None or not isinstance(state, eqx.nn.State) or not path:
        return None
    position = getattr(path[0], "key", None)  # a FlattenedIndexKey
    markers = state.tree_flatten()[1]
    if not isinstance(position, int) or not 0 <= position < len(markers):
        return None
    marker = markers[position]
    index = eqx.nn.StateIndex
    flat = jax.tree_util.tree_flatten_with_path(
        traced.inputs, is_leaf=lambda x: isinstance(x, index)
    )[0]
    for where, x in flat:
        if isinstance(x, index) and x.marker == marker:
            item = jax.tree_util.keystr(path[1:])
            owner = traced.argument_path(where[:-1]) if where else "the arguments"
            return f"eqx.nn.State of {owner}" + (f", item {item}" if item else "")
    return None


_mirrored_state.register_state_kind(StateKind(_is_state, _cause, _describe))


# --- jm.sync_batch_norm --------------------------------------------------------------------------


class AxisNames(tuple):
    """Several collective axis names that `jax.tree_util` holds as one leaf.

    `eqx.nn.BatchNorm.axis_name` is a pytree leaf of the model, not a static field: a plain
    tuple there would add leaves and change the model's tree structure, so optimizer state,
    gradients or checkpoints made from the model before conversion would no longer match it.
    A tuple subclass is a leaf to JAX's pytrees, while `lax.pmean` reads any tuple as several
    axes; it equals and hashes as the plain tuple.
    """

    __slots__ = ()


def sync_batch_norm(model: Any, axis: str) -> Any:
    """Returns a new equinox model whose every `eqx.nn.BatchNorm` has `axis` added to its
    `axis_name` (its own axis, the `vmap` one, is kept first). One name becomes one leaf
    (`AxisNames`): the model's structure is kept. A tuple or list of names gains a name, and
    the structure a leaf: nothing can keep it (a nested tuple is not several axes to JAX)."""
    eqx = _equinox()
    norm = eqx.nn.BatchNorm

    def convert(x: Any) -> Any:
        if not isinstance(x, norm) or _has_axis(x.axis_name, axis):
            return x
        own = x.axis_name if isinstance(x.axis_name, (tuple, list)) else (x.axis_name,)
        converted = copy.copy(x)
        # equinox modules are frozen: set on the copy only, the caller's model is untouched.
        object.__setattr__(converted, "axis_name", AxisNames((*own, axis)))
        return converted

    return jax.tree.map(convert, model, is_leaf=lambda x: isinstance(x, norm))
