"""The recipes' equinox support: an equinox model where the recipes take parameters.

`recipes.accumulate_gradients` takes an equinox model as its `params` (the floating arrays
differentiated, as `eqx.filter_value_and_grad` does), and `recipes.make_accumulating_train_step`
takes an equinox `(model, opt_state)` pair or `(model, opt_state, state)` triple with the
optax transformation `tx`. This module is imported only once the caller's objects are
equinox's (equinox is an optional extra); the recipes themselves stay in `_accumulation.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import equinox as eqx
import jax

from jmirror._values import PyTree

if TYPE_CHECKING:
    import optax

# `(params, carry, micro_batch) -> (loss, carry)`, as `_accumulation` sums it.
MicroLoss = Callable[[PyTree, PyTree, PyTree], tuple[jax.Array, PyTree]]


def micro_loss(
    loss_fn: Callable[..., jax.Array], model: eqx.Module, args: tuple
) -> tuple[PyTree, PyTree, MicroLoss, Callable[[PyTree], None]]:
    """Returns an equinox model's micro-batch loss: its floating arrays differentiated, as
    `eqx.filter_value_and_grad` does, the rest of the module closed over; with the
    differentiated part, the (empty) carry, and what writes the carry back (nothing)."""
    diff, static = eqx.partition(model, eqx.is_inexact_array)

    def loss(d: PyTree, carry: PyTree, micro_batch: PyTree) -> tuple[jax.Array, PyTree]:
        return loss_fn(eqx.combine(d, static), micro_batch, *args), carry

    return diff, (), loss, _nothing


def _nothing(carry: PyTree) -> None:
    """Writes nothing back: an equinox model's loss changes no other state."""


def step(
    state: tuple,
    tx: optax.GradientTransformation | None,
    accumulate: Callable[..., tuple],
    batch: PyTree,
    args: tuple,
) -> tuple[tuple, jax.Array]:
    """Takes one step of an equinox `(model, opt_state)` pair or `(model, opt_state, state)`
    triple with the optax `tx`."""
    kind = "(model, opt_state)" if len(state) == 2 else "(model, opt_state, state)"
    if tx is None:
        raise TypeError(
            f"recipes.make_accumulating_train_step got an equinox {kind} "
            f"{'pair' if len(state) == 2 else 'triple'} but no optax transformation to update "
            "it with: pass it as make_accumulating_train_step(loss_fn, k, tx=optimizer), the "
            "one whose tx.init(eqx.filter(model, eqx.is_array)) made opt_state."
        )
    model, opt_state = state[0], state[1]
    if len(state) == 2:
        loss, grads = accumulate(model, batch, args, opt_state)
    else:
        loss, grads, model_state = accumulate(model, batch, args, opt_state, state[2])
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    model = eqx.apply_updates(model, updates)
    if len(state) == 2:
        return (model, opt_state), loss
    return (model, opt_state, model_state), loss
