"""The recipes' gradient accumulation: `accumulate_gradients`, `make_accumulating_train_step`.

Part of `jmirror.recipes` (see its docstring), where both are public. Each replica cuts its
batch into k consecutive micro-batches and a `lax.scan` runs them one after another, summing
the gradients locally; the step then reduces them once, so the compiled step holds one
gradient all-reduce whatever k is (with `jm.shard_update`, its one reduce-scatter and
all-gather per bucket). Other state the loss changes (NNX batch statistics, rng counts,
metrics) is threaded from one micro-batch to the next, as k sequential passes leave it.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax import lax

from jmirror import _nnx_recipes
from jmirror._context import all_reduce
from jmirror._replicate import Replicated, replicate
from jmirror._strategy import MirroredStrategy
from jmirror._values import PyTree, ReduceOp, Sharded

if TYPE_CHECKING:
    import optax
    from flax import nnx

LossFn = Callable[..., Any]
# `(params, carry, micro_batch) -> (loss, carry)`: one micro-batch's loss, with the other
# state the loss changes passed from one micro-batch to the next.
MicroLoss = Callable[[PyTree, PyTree, PyTree], tuple[jax.Array, PyTree]]


def accumulate_gradients(
    loss_fn: LossFn,
    params: PyTree,
    batch: PyTree,
    num_micro_batches: int,
    *,
    args: Sequence[Any] = (),
    reduce: bool = True,
    dtype: jax.typing.DTypeLike | None = None,
) -> tuple[jax.Array, PyTree]:
    """Returns the mean loss and gradients over the global batch, one micro-batch at a time.

    Call it in replica context. The replica's batch is cut into `num_micro_batches`
    consecutive micro-batches along axis 0 and a `lax.scan` runs them one after another
    (only one micro-batch's activations are alive at a time), summing their gradients on
    the replica; the sum is then reduced across replicas once, so the compiled step holds
    one gradient all-reduce whatever `num_micro_batches` is. The result equals the
    gradients of the full batch, identical on every replica.

    `params` may be:

    - a pytree of arrays (a linen `TrainState.params`): `loss_fn(params, micro_batch,
      *args)`;
    - an NNX model: `loss_fn(model, micro_batch, *args)`; the gradients are the
      `nnx.State` of its `nnx.Param`s, as `nnx.grad` gives them. Every other `Variable`
      the loss changes — `BatchStat`s, rng counts, a metric held by the model or an NNX
      metric passed in `args` — is carried from one micro-batch to the next and written
      back, as k sequential passes over the micro-batches leave it (a metric counts every
      micro-batch);
    - an equinox module: `loss_fn(model, micro_batch, *args)`, differentiated with respect
      to its floating arrays as `eqx.filter_value_and_grad` does; the gradients are a module
      with `None` elsewhere.

    Gradients of a dtype narrower than float32 are summed in float32 and given back in
    their own dtype.

    Args:
      loss_fn: returns the mean loss over the micro-batch.
      params: the parameters (mirrored), an NNX model or an equinox module.
      batch: the replica's batch, every leaf with a leading size divisible by
        `num_micro_batches`.
      num_micro_batches: how many micro-batches to cut the replica's batch into.
      args: passed to `loss_fn` after the micro-batch, the same for every micro-batch
        (NNX objects among them carry their changes from one micro-batch to the next).
      reduce: `False` gives this replica's own mean gradients, not reduced (for
        `jm.shard_update`, which reduce-scatters them itself); the loss is reduced either
        way.
      dtype: the dtype the gradients are reduced in (`jm.all_reduce(..., dtype=)`). The
        loss rides in the same all-reduce, so it is reduced in `dtype` too (one reduction
        per step); it comes back in its own dtype.

    Raises:
      ValueError: when `num_micro_batches` is not a positive int, or a batch leaf's leading
        size is not divisible by it.

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
    num_micro_batches = _check(batch, num_micro_batches)
    args = tuple(args)
    if _nnx_recipes.is_model(params):
        diff, carry, loss, finish = _nnx_recipes.micro_loss(loss_fn, params, args)
    elif _is_equinox_module(params):
        diff, carry, loss, finish = _equinox_micro_loss(loss_fn, params, args)
    else:
        diff, carry, loss, finish = params, (), _plain_micro_loss(loss_fn, args), _nothing
    micro = jax.tree.map(
        lambda x: jnp.reshape(x, (num_micro_batches, -1) + jnp.shape(x)[1:]), batch
    )
    loss_sum, grad_sum, carry = _sum_over_micro_batches(loss, diff, carry, micro)
    finish(carry)
    grads = jax.tree.map(lambda g: g / num_micro_batches, grad_sum)
    loss = loss_sum / num_micro_batches
    if reduce:
        loss, grads = all_reduce(ReduceOp.MEAN, (loss, grads), dtype=dtype)
    else:
        loss = all_reduce(ReduceOp.MEAN, loss)
    return loss, _own_dtypes(grads, diff)


def _count(num_micro_batches: int, call: str = "recipes.accumulate_gradients") -> int:
    """Returns `num_micro_batches` as an int (numpy integers too); refuses anything else than
    a positive one."""
    count = None
    if not isinstance(num_micro_batches, bool):
        try:
            count = operator.index(num_micro_batches)
        except TypeError:
            pass
    if count is None or count < 1:
        raise ValueError(f"{call}(num_micro_batches={num_micro_batches!r}) expects a positive int.")
    return count


def _check(batch: PyTree, num_micro_batches: int) -> int:
    """Returns `num_micro_batches` as an int (`_count`), checked against `batch`."""
    count = _count(num_micro_batches)
    for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        size = jnp.shape(leaf)[0] if jnp.ndim(leaf) else None
        if size is None or size % count:
            raise ValueError(
                f"recipes.accumulate_gradients: the batch leaf at {jax.tree_util.keystr(path)!r} "
                f"has shape {jnp.shape(leaf)}, whose leading size is not divisible by "
                f"num_micro_batches={count}. Use a per-replica batch size that is "
                "a multiple of num_micro_batches."
            )
    return count


def _sum_over_micro_batches(
    loss: MicroLoss, diff: PyTree, carry: PyTree, micro: PyTree
) -> tuple[jax.Array, PyTree, PyTree]:
    """Returns the sums of the micro-batches' losses and gradients (in at least float32), and the
    carry after the last micro-batch: one `lax.scan`, no collective."""
    grad_fn = jax.value_and_grad(loss, has_aux=True)
    first = jax.tree.map(lambda x: x[0], micro)
    (loss_shape, _), grad_shapes = jax.eval_shape(grad_fn, diff, carry, first)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, _wide(s.dtype)), (loss_shape, grad_shapes))

    def body(state: tuple, micro_batch: PyTree) -> tuple[tuple, None]:
        sums, carry = state
        (value, carry), grads = grad_fn(diff, carry, micro_batch)
        sums = jax.tree.map(lambda t, x: t + x.astype(t.dtype), sums, (value, grads))
        return (sums, carry), None

    ((loss_sum, grad_sum), carry), _ = lax.scan(body, (zeros, carry), micro)
    return loss_sum, grad_sum, carry


def _wide(dtype: jax.typing.DTypeLike) -> Any:
    """Returns the dtype a sum of `dtype` values is kept in: at least float32 for floating ones."""
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.promote_types(dtype, jnp.float32)
    return dtype


def _own_dtypes(grads: PyTree, like: PyTree) -> PyTree:
    """Returns `grads` in the dtypes of the differentiated leaves they belong to."""
    return jax.tree.map(lambda g, p: g.astype(jnp.result_type(p)), grads, like)


def _plain_micro_loss(loss_fn: LossFn, args: tuple) -> MicroLoss:
    def loss(params: PyTree, carry: PyTree, micro_batch: PyTree) -> tuple[jax.Array, PyTree]:
        return loss_fn(params, micro_batch, *args), carry

    return loss


def _nothing(carry: PyTree) -> None:
    """Writes nothing back: a plain pytree's loss changes no other state."""


# --- equinox, only once the caller imported it ---------------------------------------------


def _is_equinox_module(x: object) -> bool:
    eqx = sys.modules.get("equinox")
    return eqx is not None and isinstance(x, eqx.Module)


def _equinox_micro_loss(
    loss_fn: LossFn, model: nnx.Module, args: tuple
) -> tuple[PyTree, PyTree, MicroLoss, Callable[[PyTree], None]]:
    """Returns an equinox model's micro-batch loss: its floating arrays differentiated, as
    `eqx.filter_value_and_grad` does, the rest of the module closed over."""
    import equinox as eqx

    diff, static = eqx.partition(model, eqx.is_inexact_array)

    def loss(d: PyTree, carry: PyTree, micro_batch: PyTree) -> tuple[jax.Array, PyTree]:
        return loss_fn(eqx.combine(d, static), micro_batch, *args), carry

    return diff, (), loss, _nothing


# --- the train step ------------------------------------------------------------------------


def make_accumulating_train_step(
    loss_fn: LossFn,
    num_micro_batches: int,
    *,
    tx: optax.GradientTransformation | None = None,
    dtype: jax.typing.DTypeLike | None = None,
    strategy: MirroredStrategy | None = None,
) -> Replicated:
    """Returns a replicated train step that accumulates gradients over micro-batches.

    The step is `step(state, batch, *args) -> (state, loss)`, one optimizer step on the
    global batch with the gradients of `accumulate_gradients` (reduced once per step), for

    - a mirrored flax `TrainState`: `loss_fn(params, micro_batch, *args)`;
    - an NNX `(model, optimizer)` pair, updated in place: `loss_fn(model, micro_batch,
      *args)`; batch statistics and metrics (held by the model, or NNX metrics in `args`)
      are left as k sequential micro-batch passes leave them. NNX objects after the pair in
      `state`, `(model, optimizer, metrics)`, are passed to `loss_fn` first, as
      `loss_fn(model, micro_batch, metrics, *args)`, and updated the same way;
    - an equinox `(model, opt_state)` pair with the optax transformation given as `tx`
      (`opt_state = tx.init(eqx.filter(model, eqx.is_array))`): `loss_fn(model,
      micro_batch, *args)`; the step returns the new `(model, opt_state)`.

    An optimizer made by `jm.shard_update` (its state holds `jm.Sharded` leaves) receives
    each replica's own gradients and reduces them itself: one reduce-scatter and one
    all-gather per bucket, and no gradient all-reduce.

    Args:
      loss_fn: returns the mean loss over the micro-batch.
      num_micro_batches: micro-batches per replica batch.
      tx: the optax transformation of an equinox `(model, opt_state)` pair (not used for a
        `TrainState` or an NNX pair, which hold theirs).
      dtype: the dtype the gradients (and, in the same all-reduce, the loss) are reduced
        in (`jm.all_reduce(..., dtype=)`).
      strategy: passed to `jm.replicate`.

    Raises:
      ValueError: when `num_micro_batches` is not a positive int (the batch's divisibility
        is checked when the step is traced).

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

    num_micro_batches = _count(num_micro_batches, "recipes.make_accumulating_train_step")

    def accumulate(params: PyTree, batch: PyTree, args: tuple, opt_state: PyTree) -> tuple:
        return accumulate_gradients(
            loss_fn,
            params,
            batch,
            num_micro_batches,
            args=args,
            reduce=not _is_sharded(opt_state),
            dtype=dtype,
        )

    def train_step(state: PyTree, batch: PyTree, *args: PyTree) -> tuple[Any, jax.Array]:
        if _is_equinox_pair(state):
            return _equinox_step(state, tx, accumulate, batch, args)
        pair = _nnx_recipes.pair(state, "make_accumulating_train_step")
        if pair is None:
            loss, grads = accumulate(state.params, batch, args, state.opt_state)
            return state.apply_gradients(grads=grads), loss
        model, optimizer = pair
        extra = tuple(state[2:])  # NNX objects after the pair: (model, optimizer, metrics)
        opt_state = _nnx_recipes.optimizer_state(optimizer)
        loss, grads = accumulate(model, batch, extra + args, opt_state)
        return _nnx_recipes.apply(state, pair, grads), loss

    return replicate(train_step, strategy=strategy)


def _is_sharded(opt_state: PyTree) -> bool:
    """Returns whether an optimizer state is `jm.shard_update`'s (it holds `jm.Sharded` leaves)."""
    leaves = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, Sharded))
    return any(isinstance(x, Sharded) for x in leaves)


def _is_equinox_pair(state: PyTree) -> bool:
    return isinstance(state, (tuple, list)) and len(state) == 2 and _is_equinox_module(state[0])


def _equinox_step(
    state: tuple,
    tx: optax.GradientTransformation | None,
    accumulate: Callable[..., tuple],
    batch: PyTree,
    args: tuple,
) -> tuple[tuple, jax.Array]:
    """Takes one step of an equinox `(model, opt_state)` pair with the optax `tx`."""
    import equinox as eqx

    if tx is None:
        raise TypeError(
            "recipes.make_accumulating_train_step got an equinox (model, opt_state) pair but "
            "no optax transformation to update it with: pass it as "
            "make_accumulating_train_step(loss_fn, k, tx=optimizer), the one whose "
            "tx.init(eqx.filter(model, eqx.is_array)) made opt_state."
        )
    model, opt_state = state
    loss, grads = accumulate(model, batch, args, opt_state)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return (eqx.apply_updates(model, updates), opt_state), loss
