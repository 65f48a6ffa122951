"""The recipes' flax NNX support: an NNX `(model, optimizer)` pair where a `TrainState` goes.

Wherever a recipe of `jmirror.recipes` takes a `TrainState`, it also takes an NNX
`(model, optimizer)` pair (`nnx.Module`, `nnx.Optimizer`), updated in place and returned as
the same objects, with `loss_fn` taking the model where it took `params`. This module holds
what differs for the pair: recognizing it, its gradients, its optimizer step, a micro-batch
loss of the model's `nnx.Param`s that threads the model's other `Variable`s (and those of NNX
objects passed beside it) from one micro-batch to the next, and the loss-scaled step of a
`(model, optimizer, loss_scale)` triple. The recipes themselves stay in `recipes.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jmirror._context import all_reduce
from jmirror._values import PyTree, ReduceOp

LossFn = Callable[..., Any]


def pair(state: PyTree, recipe: str) -> tuple[Any, Any] | None:
    """Returns `(model, optimizer)` when `state` starts with an NNX model and optimizer, else
    None."""
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


def value_and_grad(
    loss_fn: LossFn, has_aux: bool, model: nnx.Module, *args: PyTree
) -> tuple[Any, Any]:
    """Returns `loss_fn(model, *args)` and its gradients with respect to the model
    (`nnx.grad`'s)."""
    return nnx.value_and_grad(loss_fn, has_aux=has_aux)(model, *args)


def optimizer_state(optimizer: nnx.Optimizer) -> PyTree:
    """Returns the state of an `nnx.Optimizer` (its step count and optax state) as a pytree."""
    return nnx.state(optimizer)


def apply(state: PyTree, pair: tuple[Any, Any] | None, grads: PyTree) -> PyTree:
    """Returns the state after one optimizer step: a new `TrainState`, or the pair updated in
    place."""
    if pair is None:
        return state.apply_gradients(grads=grads)
    model, optimizer = pair
    optimizer.update(model, grads)
    return state


def is_model(x: object) -> bool:
    """Returns whether `x` is an NNX module (the `params` an accumulating recipe differentiates)."""
    return isinstance(x, nnx.Module)


def micro_loss(
    loss_fn: LossFn, model: nnx.Module, args: Sequence[Any]
) -> tuple[PyTree, PyTree, Callable[..., tuple[jax.Array, PyTree]], Callable[[PyTree], None]]:
    """Returns an NNX model's micro-batch loss as a pure function, for `accumulate_gradients`.

    Returns `(params, rest, loss, finish)`: the `nnx.State` of the model's `nnx.Param`s (the
    differentiated tree, shaped as `nnx.grad` gives it); every other `Variable` of the model
    and of the NNX objects among `args` (batch statistics, rng counts, metrics held or passed
    in); `loss(params, rest, micro_batch) -> (loss, rest)`, which runs `loss_fn(model,
    micro_batch, *args)` on a copy and returns what it left in the other `Variable`s; and
    `finish(rest)`, which writes the last micro-batch's `rest` back into the caller's objects.
    Objects shared between the model and `args` stay shared.
    """
    nodes = [i for i, a in enumerate(args) if nnx.graph.is_graph_node(a)]
    objects = (model, *(args[i] for i in nodes))
    model_params = nnx.All(nnx.Param, lambda path, _: path[0] == 0)
    graphdef, params, rest = nnx.split(objects, model_params, ...)

    def loss(p: PyTree, rest: PyTree, micro_batch: PyTree) -> tuple[jax.Array, PyTree]:
        copies = nnx.merge(graphdef, nnx.State({0: p}), rest, copy=True)
        call_args = list(args)
        for i, copy in zip(nodes, copies[1:]):
            call_args[i] = copy
        value = loss_fn(copies[0], micro_batch, *call_args)
        return value, nnx.split(copies, model_params, ...)[2]

    def finish(rest: PyTree) -> None:
        nnx.update(objects, rest)

    return params[0], rest, loss, finish


def loss_scaled_step(
    loss_fn: LossFn,
    state: tuple,
    batch: PyTree,
    unscaled_finite: Callable[[PyTree, Any], tuple[PyTree, jax.Array]],
) -> tuple[tuple, Any]:
    """Returns the loss-scaled step for an NNX `(model, optimizer, loss_scale)` triple.

    `state` is checked by the caller (`loss_scale` a `recipes.DynamicLossScale`);
    `unscaled_finite(grads, loss_scale)` gives the gradients divided by the scale and the
    replicas' agreed verdict, as for a `LossScaleTrainState`.
    """
    model, optimizer, loss_scale = state

    def scaled_loss(model: nnx.Module) -> tuple[jax.Array, jax.Array]:
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
