"""The recipes' flax NNX support: an NNX `(model, optimizer)` pair where a `TrainState` goes.

Wherever a recipe of `jmirror.recipes` takes a `TrainState`, it also takes an NNX
`(model, optimizer)` pair (`nnx.Module`, `nnx.Optimizer`), updated in place and returned as
the same objects, with `loss_fn` taking the model where it took `params`. This module holds
what differs for the pair: recognizing it, its gradients, its optimizer step, the model's
`nnx.Param`s as the differentiated tree of a micro-batch loss, and the loss-scaled step of a
`(model, optimizer, loss_scale)` triple. The recipes themselves stay in `recipes.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jmirror._context import all_reduce
from jmirror._values import PyTree, ReduceOp

LossFn = Callable[..., Any]


def pair(state: Any, recipe: str) -> tuple[Any, Any] | None:
    """`(model, optimizer)` when `state` starts with an NNX model and optimizer, else None."""
    if not isinstance(state, (tuple, list)):
        return None
    if len(state) >= 2 and isinstance(state[0], nnx.Module):
        if isinstance(state[1], nnx.Optimizer):
            return state[0], state[1]
    if any(isinstance(x, (nnx.Module, nnx.Optimizer)) for x in state):
        raise TypeError(
            f"recipes.{recipe} expects a flax TrainState or an NNX (model, optimizer) pair; "
            f"found a {type(state).__name__} of {[type(x).__name__ for x in state]}. Pass "
            "(model, optimizer), with optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)."
        )
    return None


def value_and_grad(loss_fn: LossFn, has_aux: bool, model: Any, *args: Any) -> tuple[Any, Any]:
    """`loss_fn(model, *args)` and its gradients with respect to the model (`nnx.grad`'s)."""
    return nnx.value_and_grad(loss_fn, has_aux=has_aux)(model, *args)


def apply(state: Any, pair: tuple[Any, Any] | None, grads: PyTree) -> Any:
    """The state after one optimizer step: a new `TrainState`, or the pair updated in place."""
    if pair is None:
        return state.apply_gradients(grads=grads)
    model, optimizer = pair
    optimizer.update(model, grads)
    return state


def param_loss(loss_fn: LossFn, params: Any) -> tuple[PyTree, LossFn]:
    """The differentiated tree and `loss(tree, micro_batch)` of `accumulate_gradients`.

    For an NNX model, the tree is the `nnx.State` of its `nnx.Param`s and the loss merges them
    back into a copy of the model; for anything else, `params` and `loss_fn` unchanged.
    """
    if not isinstance(params, nnx.Module):
        return params, loss_fn
    graphdef, params, rest = nnx.split(params, nnx.Param, ...)

    def micro_loss(p: PyTree, micro_batch: PyTree) -> jax.Array:
        return loss_fn(nnx.merge(graphdef, p, rest, copy=True), micro_batch)

    return params, micro_loss


def loss_scaled_step(
    loss_fn: LossFn,
    state: tuple,
    batch: PyTree,
    unscaled_finite: Callable[[PyTree, Any], tuple[PyTree, jax.Array]],
) -> tuple[tuple, Any]:
    """The loss-scaled step for an NNX `(model, optimizer, loss_scale)` triple.

    `state` is checked by the caller (`loss_scale` a `recipes.DynamicLossScale`);
    `unscaled_finite(grads, loss_scale)` gives the gradients divided by the scale and the
    replicas' agreed verdict, as for a `LossScaleTrainState`.
    """
    model, optimizer, loss_scale = state

    def scaled_loss(model: Any) -> tuple[jax.Array, jax.Array]:
        loss = loss_fn(model, batch)
        return loss.astype(jnp.float32) * loss_scale.scale, loss

    (_, loss), grads = nnx.value_and_grad(scaled_loss, has_aux=True)(model)
    grads, finite = unscaled_finite(grads, loss_scale)
    grads, loss = all_reduce(ReduceOp.MEAN, (grads, loss.astype(jnp.float32)))
    before = jax.tree.map(lambda x: x, nnx.state((model, optimizer)))  # a snapshot
    optimizer.update(model, grads)
    after = nnx.state((model, optimizer))
    nnx.update(
        (model, optimizer),
        jax.tree.map(lambda new, old: jnp.where(finite, new, old), after, before),
    )
    return (model, optimizer, loss_scale.adjust(finite)), loss
