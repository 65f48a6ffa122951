"""The recipes' gradient accumulation: `accumulate_gradients`, `make_accumulating_train_step`.

Part of `jmirror.recipes` (see its docstring), where both are public: micro-batches run one
after another in a `lax.scan`, with a `jm.merge_call` averaging each micro-batch's loss and
gradients across replicas inside the loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax.training import train_state
from jax import lax

from jmirror import _nnx_recipes
from jmirror._context import merge_call
from jmirror._replicate import Replicated, replicate
from jmirror._strategy import MirroredStrategy
from jmirror._values import PyTree, ReduceOp

LossFn = Callable[..., Any]


def _mean_over_replicas(strategy: MirroredStrategy, tree: PyTree) -> PyTree:
    return strategy.reduce(ReduceOp.MEAN, tree)


def accumulate_gradients(
    loss_fn: LossFn, params: PyTree, batch: PyTree, num_micro_batches: int
) -> tuple[jax.Array, PyTree]:
    """Returns the mean loss and gradients over the global batch, one micro-batch at a time.

    Call it in replica context. The replica's batch is cut into `num_micro_batches` equal
    micro-batches along axis 0 and a `lax.scan` runs them one after another, so only one
    micro-batch's activations are alive at a time. After each micro-batch a `jm.merge_call`
    averages its loss and gradients across replicas (`strategy.reduce(MEAN, ...)` in
    cross-replica context, lowered to one all-reduce): the pattern TensorFlow's
    `merge_call` cannot run inside a loop. The result equals the full-batch gradients and is
    identical on every replica. (Reducing once after the scan sends less; this recipe shows
    `merge_call` in a loop.)

    Args:
      loss_fn: `loss_fn(params, micro_batch)` returning the mean loss over the micro-batch.
      params: the parameters (mirrored), or an NNX model: then `loss_fn(model, micro_batch)`
        and the gradients are the `nnx.State` of its `nnx.Param`s, as `nnx.grad` gives
        (changes `loss_fn` makes to other state, such as batch statistics, are not kept).
      batch: the replica's batch, every leaf with a leading size divisible by
        `num_micro_batches`.
      num_micro_batches: how many micro-batches to cut the replica's batch into.

    Raises:
      ValueError: when a leaf's leading size is not divisible by `num_micro_batches`.

    Example:
        >>> import jax, jax.numpy as jnp, numpy as np, jmirror as jm
        >>> from jmirror import recipes
        >>> strategy = jm.MirroredStrategy()
        >>> loss_fn = lambda w, x: jnp.mean((x * w - 1.0) ** 2)
        >>> n = strategy.num_replicas
        >>> x = np.linspace(0.0, 1.0, 4 * n, dtype=np.float32)
        >>> _, grads = strategy.run(lambda w, b: recipes.accumulate_gradients(loss_fn, w, b, 2),
        ...                         args=(jnp.ones(()), jm.PerReplica(x.reshape(n, 4))))
        >>> bool(jnp.allclose(strategy.read(grads), jax.grad(loss_fn)(jnp.ones(()), x)))
        True
    """
    if (
        isinstance(num_micro_batches, bool)
        or not isinstance(num_micro_batches, int)
        or (num_micro_batches < 1)
    ):
        raise ValueError(
            f"recipes.accumulate_gradients(num_micro_batches={num_micro_batches!r}) expects a "
            "positive int."
        )
    paths = jax.tree_util.tree_flatten_with_path(batch)[0]
    for path, leaf in paths:
        size = jnp.shape(leaf)[0] if jnp.ndim(leaf) else None
        if size is None or size % num_micro_batches:
            raise ValueError(
                f"recipes.accumulate_gradients: the batch leaf at {jax.tree_util.keystr(path)!r} "
                f"has shape {jnp.shape(leaf)}, whose leading size is not divisible by "
                f"num_micro_batches={num_micro_batches}. Use a per-replica batch size that is "
                "a multiple of num_micro_batches."
            )
    params, micro_loss = _nnx_recipes.param_loss(loss_fn, params)
    micro = jax.tree.map(
        lambda x: jnp.reshape(x, (num_micro_batches, -1) + jnp.shape(x)[1:]), batch
    )
    grad_fn = jax.value_and_grad(micro_loss)
    first = jax.tree.map(lambda x: x[0], micro)
    shapes = jax.eval_shape(grad_fn, params, first)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    def accumulate(total: PyTree, micro_batch: PyTree) -> tuple[PyTree, None]:
        loss_and_grads = grad_fn(params, micro_batch)
        loss_and_grads = merge_call(_mean_over_replicas, args=(loss_and_grads,))
        return jax.tree.map(jnp.add, total, loss_and_grads), None

    (loss, grads), _ = lax.scan(accumulate, zeros, micro)
    return jax.tree.map(lambda x: x / num_micro_batches, (loss, grads))


def make_accumulating_train_step(
    loss_fn: LossFn, num_micro_batches: int, *, strategy: MirroredStrategy | None = None
) -> Replicated:
    """Returns a replicated train step that accumulates gradients over micro-batches.

    The step is `step(state, batch) -> (state, loss)` for a mirrored flax `TrainState` or
    an NNX `(model, optimizer)` pair (updated in place; `loss_fn(model, micro_batch)`); it
    applies the gradients of `accumulate_gradients` once, like one step on the global batch.

    Args:
      loss_fn: `loss_fn(params, micro_batch)` returning the mean loss over the micro-batch.
      num_micro_batches: micro-batches per replica batch.
      strategy: passed to `jm.replicate`.

    Example:
        >>> import jax.numpy as jnp, numpy as np, optax, jmirror as jm
        >>> from flax.training.train_state import TrainState
        >>> from jmirror import recipes
        >>> strategy = jm.MirroredStrategy()
        >>> state = strategy.mirror(TrainState.create(
        ...     apply_fn=None, params={"w": jnp.zeros(())}, tx=optax.sgd(0.5)))
        >>> step = recipes.make_accumulating_train_step(
        ...     lambda p, x: jnp.mean((p["w"] - x) ** 2), 2, strategy=strategy)
        >>> n = strategy.num_replicas
        >>> state, loss = step(state, jm.PerReplica(np.ones((n, 4), np.float32)))
        >>> float(strategy.read(state.params["w"])), float(strategy.read(loss))
        (1.0, 1.0)
    """

    def train_step(state: train_state.TrainState, batch: PyTree):
        pair = _nnx_recipes.pair(state, "make_accumulating_train_step")
        params = state.params if pair is None else pair[0]
        loss, grads = accumulate_gradients(loss_fn, params, batch, num_micro_batches)
        return _nnx_recipes.apply(state, pair, grads), loss

    return replicate(train_step, strategy=strategy)
