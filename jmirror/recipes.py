"""Recipes: short, tested functions for the common data-parallel training patterns.

Each recipe is a few lines you could write yourself; copy and change them freely. Every train
step returned here is a `jm.replicate`d function `step(state, batch, ...) -> (state, loss)`
whose `state` stays mirrored (proven identical on every replica) and whose `loss` is the mean
over replicas. Each `loss_fn` returns the *mean* loss over its replica's batch; with equal
per-replica batches, all-reducing the gradients with `MEAN` trains exactly like one device on
the global batch.

- `make_train_step`: a flax `TrainState` + optax step, gradients all-reduced `MEAN`, with
  per-replica dropout keys (`fold_in_replica`) when a key is passed.
- `make_batch_norm_train_step`: batch norm with statistics synchronized every step through
  `strategy.axis_name` (`nn.BatchNorm(axis_name=strategy.axis_name)`), or kept per replica as
  a `SyncOnRead` `MEAN` and read at evaluation (`distribute_batch_norm_state`,
  `read_variables`).
- `accumulate_gradients`, `make_accumulating_train_step`: gradient accumulation over
  micro-batches in a `lax.scan`, reduced once per step (one gradient all-reduce, or
  `jm.shard_update`'s reduce-scatter and all-gather, whatever the number of micro-batches),
  for a linen `TrainState` (its `batch_stats` carried from one micro-batch to the next), an
  NNX `(model, optimizer)` pair, an equinox `(model, opt_state)` pair and an equinox
  `(model, opt_state, state)` triple (its `eqx.nn.State` carried likewise).
- `DynamicLossScale`, `make_loss_scaled_train_step`: float16 loss scaling whose
  finite-gradients verdict is agreed by every replica.

flax NNX: wherever a recipe takes a `TrainState`, it also takes an NNX `(model, optimizer)`
pair (`nnx.Module`, `nnx.Optimizer`), updated in place and returned as the same objects;
`loss_fn` then takes the model where it took `params` (`loss_fn(model, batch)`). The loss
scaling step takes `(model, optimizer, loss_scale)`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax.training import train_state

from jmirror import _nnx_recipes
from jmirror._accumulation import accumulate_gradients, make_accumulating_train_step
from jmirror._context import all_reduce, replica_id, sync
from jmirror._replicate import Replicated, replicate
from jmirror._strategy import MirroredStrategy
from jmirror._values import Aggregation, PyTree, ReduceOp, SyncOnRead

__all__ = [
    "BatchNormTrainState",
    "DynamicLossScale",
    "LossScaleTrainState",
    "accumulate_gradients",
    "distribute_batch_norm_state",
    "fold_in_replica",
    "make_accumulating_train_step",
    "make_batch_norm_train_step",
    "make_loss_scaled_train_step",
    "make_train_step",
    "read_variables",
]

LossFn = Callable[..., Any]


# --- (a) TrainState + optax, (c) per-replica dropout keys ----------------------------------------


def fold_in_replica(key: jax.Array, step: jax.typing.ArrayLike | None = None) -> jax.Array:
    """Returns a PRNG key unique to this replica (and to `step`), in replica context.

    Use it for dropout: every replica draws its own noise for its own examples, as one
    device would for the whole batch. The key of replica `i` at step `s` is
    `fold_in(fold_in(key, s), i)`. The alternative, `strategy.split_key(key)` passed into the
    step as a `PerReplica`, gives each replica one of `N` split keys instead.

    Args:
      key: a PRNG key identical on every replica (mirrored or broadcast).
      step: folded in first when given (for example `state.step`), so every step differs.

    Example:
        >>> import jax, jmirror as jm
        >>> from jmirror import recipes
        >>> strategy = jm.MirroredStrategy()
        >>> keys = strategy.run(recipes.fold_in_replica, args=(jax.random.key(0),))
        >>> last = strategy.local_results(keys)[-1]
        >>> expected = jax.random.fold_in(jax.random.key(0), strategy.num_replicas - 1)
        >>> bool((jax.random.key_data(last) == jax.random.key_data(expected)).all())
        True
    """
    if step is not None:
        key = jax.random.fold_in(key, step)
    return jax.random.fold_in(key, replica_id())


def make_train_step(
    loss_fn: LossFn, *, has_aux: bool = False, strategy: MirroredStrategy | None = None
) -> Replicated:
    """Returns a replicated train step for a flax `TrainState` with gradients all-reduced MEAN.

    The step is `step(state, batch, key=None) -> (state, loss)` (with `has_aux`,
    `(state, loss, aux)`, `aux` per replica). `state` is a mirrored `TrainState`
    (`strategy.mirror(TrainState.create(...))`) or an NNX `(model, optimizer)` pair,
    updated in place (its rng streams other than `params` draw per replica, and a
    `BatchNorm(axis_name=strategy.axis_name)` keeps its statistics mirrored); `loss_fn`
    then takes the model: `loss_fn(model, batch[, key])`. `batch` is a `PerReplica` of this step's
    global batch, and `loss` the mean over replicas of `loss_fn`'s value. When `key` is
    given, `loss_fn` is called as `loss_fn(params, batch, replica_key)` with
    `replica_key = fold_in_replica(key, state.step)`: per-replica, per-step dropout noise.

    Args:
      loss_fn: `loss_fn(params, batch[, key])` returning the mean loss over the replica's
        batch (or `(loss, aux)` with `has_aux`).
      has_aux: whether `loss_fn` returns `(loss, aux)`.
      strategy: passed to `jm.replicate` (`None`: the current strategy at call time).

    Example:
        >>> import jax.numpy as jnp, numpy as np, optax, jmirror as jm
        >>> from flax.training.train_state import TrainState
        >>> from jmirror import recipes
        >>> strategy = jm.MirroredStrategy()
        >>> def loss_fn(params, batch):
        ...     return jnp.mean((batch["x"] * params["w"] - batch["y"]) ** 2)
        >>> state = strategy.mirror(TrainState.create(
        ...     apply_fn=None, params={"w": jnp.zeros(())}, tx=optax.sgd(0.1)))
        >>> n = strategy.num_replicas
        >>> batch = jm.PerReplica({"x": np.ones((n, 4), np.float32),
        ...                        "y": np.full((n, 4), 2.0, np.float32)})
        >>> step = recipes.make_train_step(loss_fn, strategy=strategy)
        >>> for _ in range(50):
        ...     state, loss = step(state, batch)
        >>> round(float(strategy.read(state.params["w"])), 3)
        2.0
    """

    def train_step(state: train_state.TrainState, batch: PyTree, key: jax.Array | None = None):
        pair = _nnx_recipes.pair(state, "make_train_step")
        step = state.step if pair is None else pair[1].step[...]
        args = (batch,) if key is None else (batch, fold_in_replica(key, step))
        if pair is None:
            out, grads = jax.value_and_grad(loss_fn, has_aux=has_aux)(state.params, *args)
        else:
            out, grads = _nnx_recipes.value_and_grad(loss_fn, has_aux, pair[0], *args)
        loss, aux = out if has_aux else (out, None)
        grads, loss = all_reduce(ReduceOp.MEAN, (grads, loss))
        state = _nnx_recipes.apply(state, pair, grads)
        return (state, loss, aux) if has_aux else (state, loss)

    return replicate(train_step, strategy=strategy)


# --- (b) batch norm ------------------------------------------------------------------------------


class BatchNormTrainState(train_state.TrainState):
    """A flax `TrainState` with the model's `batch_stats` collection.

    `batch_stats` is mirrored when the model synchronizes its statistics across replicas
    (`nn.BatchNorm(axis_name=strategy.axis_name)`), or a `jm.SyncOnRead` with aggregation
    `MEAN` when each replica keeps its own (`nn.BatchNorm(axis_name=None)`); see
    `distribute_batch_norm_state`.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> from jmirror import recipes
        >>> state = recipes.BatchNormTrainState.create(
        ...     apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(0.1),
        ...     batch_stats={"mean": jnp.zeros(2)})
        >>> state.batch_stats["mean"].shape
        (2,)
    """

    batch_stats: PyTree


def distribute_batch_norm_state(
    strategy: MirroredStrategy, state: BatchNormTrainState, *, per_replica_stats: bool
) -> BatchNormTrainState:
    """Places a `BatchNormTrainState` on the strategy's devices.

    Everything is mirrored, except that with `per_replica_stats=True` the batch statistics
    become a `SyncOnRead` with aggregation `MEAN`: every replica updates its own copy from its
    own examples, without communication, and `strategy.read` gives their mean.

    Args:
      strategy: the `jm.MirroredStrategy`.
      state: a `BatchNormTrainState` on the host or one device.
      per_replica_stats: `True` for a model whose `BatchNorm` has `axis_name=None`; `False`
        for one that synchronizes with `axis_name=strategy.axis_name`.

    Example:
        >>> import jax.numpy as jnp, optax, jmirror as jm
        >>> from jmirror import recipes
        >>> strategy = jm.MirroredStrategy()
        >>> state = recipes.BatchNormTrainState.create(
        ...     apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(0.1),
        ...     batch_stats={"mean": jnp.zeros(2)})
        >>> state = recipes.distribute_batch_norm_state(strategy, state, per_replica_stats=True)
        >>> state.batch_stats.aggregation
        <Aggregation.MEAN: 'mean'>
    """
    if per_replica_stats:
        # mirror passes SyncOnRead state through: one call places the whole train state.
        state = state.replace(
            batch_stats=strategy.sync_on_read(state.batch_stats, Aggregation.MEAN)
        )
    return strategy.mirror(state)


def read_variables(strategy: MirroredStrategy, state: BatchNormTrainState) -> dict[str, PyTree]:
    """Returns `{"params", "batch_stats"}` for evaluation, read in cross-replica context.

    Per-replica statistics (a `SyncOnRead` `MEAN`) read as the mean of the replicas'
    statistics; mirrored ones as their value. The result lives on `strategy.devices[0]`:
    evaluate with `state.apply_fn(variables, x, train=False)` there, or mirror it.

    Example:
        >>> import jax.numpy as jnp, optax, jmirror as jm
        >>> from jmirror import recipes
        >>> strategy = jm.MirroredStrategy()
        >>> state = recipes.BatchNormTrainState.create(
        ...     apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(0.1),
        ...     batch_stats={"mean": jnp.ones(2)})
        >>> state = recipes.distribute_batch_norm_state(strategy, state, per_replica_stats=True)
        >>> recipes.read_variables(strategy, state)["batch_stats"]["mean"].tolist()
        [1.0, 1.0]
    """
    return {
        "params": strategy.read(state.params),
        "batch_stats": strategy.read(state.batch_stats),
    }


def make_batch_norm_train_step(
    loss_fn: LossFn, *, strategy: MirroredStrategy | None = None
) -> Replicated:
    """Returns a replicated train step for a model with batch norm.

    The step is `step(state, batch) -> (state, loss)` for a `BatchNormTrainState` placed by
    `distribute_batch_norm_state`. Gradients are all-reduced `MEAN`. Batch statistics:

    - synchronized every step: the model's `nn.BatchNorm(axis_name=strategy.axis_name)`
      normalizes with the global batch's statistics (one `pmean` per layer), so the new
      statistics are identical on every replica and stay mirrored; the step checks this with
      `jm.sync(stats, "none")`, a `ValueError` if the model does not synchronize them;
    - per replica: `nn.BatchNorm(axis_name=None)` normalizes with the replica's own examples
      and each replica updates its own `SyncOnRead` copy, read as their mean at evaluation
      (`read_variables`). No communication for statistics, at the price of noisier ones.

    Args:
      loss_fn: `loss_fn(params, batch_stats, batch) -> (loss, new_batch_stats)`, typically
        `model.apply({"params": params, "batch_stats": batch_stats}, x, train=True,
        mutable=["batch_stats"])` followed by the mean loss.
      strategy: passed to `jm.replicate`.

    Example:
        >>> import jax.numpy as jnp, numpy as np, optax, jmirror as jm
        >>> from jmirror import recipes
        >>> strategy = jm.MirroredStrategy()
        >>> def loss_fn(params, stats, x):  # a one-number "batch norm": a running mean of x
        ...     mean = jnp.mean(x)
        ...     return jnp.mean((x - mean) * params["w"]) ** 2, {"mean": 0.5 * stats["mean"]
        ...                                                       + 0.5 * mean}
        >>> state = recipes.BatchNormTrainState.create(
        ...     apply_fn=None, params={"w": jnp.ones(())}, tx=optax.sgd(0.1),
        ...     batch_stats={"mean": jnp.zeros(())})
        >>> state = recipes.distribute_batch_norm_state(strategy, state, per_replica_stats=True)
        >>> n = strategy.num_replicas
        >>> x = jm.PerReplica(np.arange(n, dtype=np.float32).repeat(2).reshape(n, 2))
        >>> state, _ = recipes.make_batch_norm_train_step(loss_fn, strategy=strategy)(state, x)
        >>> float(strategy.read(state.batch_stats)["mean"]) == 0.5 * (n - 1) / 2
        True
    """

    def train_step(state: BatchNormTrainState, batch: PyTree):
        stats = state.batch_stats
        per_replica = isinstance(stats, SyncOnRead)
        local_stats = stats.value if per_replica else stats
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (loss, new_stats), grads = grad_fn(state.params, local_stats, batch)
        grads, loss = all_reduce(ReduceOp.MEAN, (grads, loss))
        if per_replica:
            new_stats = stats.replace(new_stats)
        else:
            new_stats = sync(new_stats, Aggregation.NONE)
        return state.apply_gradients(grads=grads, batch_stats=new_stats), loss

    return replicate(train_step, strategy=strategy)


# --- (e) float16 loss scaling --------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """A dynamic loss scale for float16 training: halve on overflow, grow when stable.

    Attributes:
      scale: the current scale (float32 scalar); the loss is multiplied by it before
        differentiation and the gradients divided by it after.
      good_steps: finite steps since the scale last changed (int32 scalar).
      growth_interval: after this many finite steps in a row the scale is multiplied by
        `factor` (static).
      factor: growth and back-off factor (static).

    Example:
        >>> from jmirror import recipes
        >>> loss_scale = recipes.DynamicLossScale.create(initial_scale=1024.0)
        >>> float(loss_scale.adjust(False).scale), float(loss_scale.adjust(True).scale)
        (512.0, 1024.0)
    """

    scale: jax.Array
    good_steps: jax.Array
    growth_interval: int = dataclasses.field(default=2000, metadata={"static": True})
    factor: float = dataclasses.field(default=2.0, metadata={"static": True})

    @classmethod
    def create(
        cls, initial_scale: float = 2.0**15, growth_interval: int = 2000, factor: float = 2.0
    ) -> DynamicLossScale:
        """Returns a loss scale starting at `initial_scale`.

        Raises:
          ValueError: for a non-positive scale, `growth_interval < 1` or `factor <= 1`.

        Example:
            >>> from jmirror import recipes
            >>> float(recipes.DynamicLossScale.create(initial_scale=8.0).scale)
            8.0
        """
        if not initial_scale > 0 or growth_interval < 1 or not factor > 1:
            raise ValueError(
                "recipes.DynamicLossScale.create expects initial_scale > 0, growth_interval >= "
                f"1 and factor > 1, got initial_scale={initial_scale!r}, "
                f"growth_interval={growth_interval!r}, factor={factor!r}."
            )
        return cls(
            jnp.asarray(initial_scale, jnp.float32),
            jnp.zeros((), jnp.int32),
            growth_interval,
            float(factor),
        )

    def adjust(self, finite: jax.typing.ArrayLike) -> DynamicLossScale:
        """Returns the scale after a step whose gradients were `finite` (or not).

        Not finite: the scale is divided by `factor` (never below 1) and the count restarts.
        Finite: the count grows, and after `growth_interval` finite steps the scale is
        multiplied by `factor`.

        Example:
            >>> from jmirror import recipes
            >>> loss_scale = recipes.DynamicLossScale.create(2.0, growth_interval=1)
            >>> float(loss_scale.adjust(True).scale)
            4.0
        """
        finite = jnp.asarray(finite, jnp.bool_)
        grow = finite & (self.good_steps + 1 >= self.growth_interval)
        scale = jnp.where(
            finite,
            jnp.where(grow, self.scale * self.factor, self.scale),
            jnp.maximum(self.scale / self.factor, 1.0),
        )
        good_steps = jnp.where(finite & ~grow, self.good_steps + 1, 0)
        return dataclasses.replace(self, scale=scale, good_steps=good_steps.astype(jnp.int32))


class LossScaleTrainState(train_state.TrainState):
    """A flax `TrainState` with a `DynamicLossScale` (`loss_scale`).

    Example:
        >>> import jax.numpy as jnp, optax
        >>> from jmirror import recipes
        >>> state = recipes.LossScaleTrainState.create(
        ...     apply_fn=None, params={"w": jnp.zeros(2)}, tx=optax.sgd(0.1),
        ...     loss_scale=recipes.DynamicLossScale.create())
        >>> float(state.loss_scale.scale)
        32768.0
    """

    loss_scale: DynamicLossScale


def make_loss_scaled_train_step(
    loss_fn: LossFn, *, strategy: MirroredStrategy | None = None
) -> Replicated:
    """Returns a replicated float16 train step with dynamic loss scaling.

    The step is `step(state, batch) -> (state, loss)` for a mirrored `LossScaleTrainState`,
    or for an NNX `(model, optimizer, loss_scale)` triple (a `DynamicLossScale`; the model
    and optimizer are updated in place, or left as they were on a skipped step, and the
    triple comes back with the new loss scale; `loss_fn(model, batch)`).
    Each replica differentiates `loss * scale` (so small float16 gradients do not flush to
    zero), divides the gradients by the scale and checks them for infinities and NaNs. The
    replicas then agree on one verdict, `jm.all_reduce(MIN, finite)`: when any replica
    overflowed, every replica skips the update and halves the scale, so the state stays
    identical everywhere (it comes back mirrored; with each replica's own verdict it would
    come back as a `PerReplica`, the replicas having diverged).

    Args:
      loss_fn: `loss_fn(params, batch)` returning the mean loss over the replica's batch,
        computed in float16 (for example a flax model with `dtype=jnp.float16` and float32
        parameters).
      strategy: passed to `jm.replicate`.

    Example:
        >>> import jax.numpy as jnp, numpy as np, optax, jmirror as jm
        >>> from jmirror import recipes
        >>> strategy = jm.MirroredStrategy()
        >>> loss_fn = lambda p, x: jnp.mean((p["w"].astype(jnp.float16) * x - 1) ** 2)
        >>> state = strategy.mirror(recipes.LossScaleTrainState.create(
        ...     apply_fn=None, params={"w": jnp.zeros(())}, tx=optax.sgd(0.1),
        ...     loss_scale=recipes.DynamicLossScale.create(initial_scale=2.0**20)))
        >>> step = recipes.make_loss_scaled_train_step(loss_fn, strategy=strategy)
        >>> x = jm.PerReplica(np.ones((strategy.num_replicas, 2), np.float16))
        >>> state, _ = step(state, x)  # 2**20 overflows float16: skipped, scale halved
        >>> float(strategy.read(state.params["w"])), float(strategy.read(state.loss_scale.scale))
        (0.0, 524288.0)
    """

    def train_step(state: LossScaleTrainState, batch: PyTree):
        pair = _nnx_recipes.pair(state, "make_loss_scaled_train_step")
        if pair is not None:
            return _nnx_loss_scaled_step(loss_fn, tuple(state), batch)  # type: ignore[arg-type]
        loss_scale = state.loss_scale

        def scaled_loss(params: PyTree) -> tuple[jax.Array, jax.Array]:
            loss = loss_fn(params, batch)
            return loss.astype(jnp.float32) * loss_scale.scale, loss

        (_, loss), grads = jax.value_and_grad(scaled_loss, has_aux=True)(state.params)
        grads, finite = _unscaled_finite(grads, loss_scale)
        grads, loss = all_reduce(ReduceOp.MEAN, (grads, loss.astype(jnp.float32)))
        updated = state.apply_gradients(grads=grads)
        state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), updated, state)
        return state.replace(loss_scale=loss_scale.adjust(finite)), loss

    return replicate(train_step, strategy=strategy)


def _unscaled_finite(grads: PyTree, loss_scale: DynamicLossScale) -> tuple[PyTree, jax.Array]:
    """Returns gradients divided by the scale, and whether every replica's are finite."""
    grads = jax.tree.map(lambda g: g / loss_scale.scale.astype(g.dtype), grads)
    finite_here = jnp.all(jnp.asarray([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
    return grads, all_reduce(ReduceOp.MIN, finite_here.astype(jnp.int32)) == 1


def _nnx_loss_scaled_step(loss_fn: LossFn, state: tuple, batch: PyTree) -> tuple[tuple, Any]:
    """Returns the loss-scaled step for an NNX `(model, optimizer, loss_scale)` triple."""
    if len(state) != 3 or not isinstance(state[2], DynamicLossScale):
        raise TypeError(
            "recipes.make_loss_scaled_train_step expects an NNX (model, optimizer, loss_scale) "
            f"triple with a recipes.DynamicLossScale; found {[type(x).__name__ for x in state]}."
        )
    return _nnx_recipes.loss_scaled_step(loss_fn, state, batch, _unscaled_finite)
