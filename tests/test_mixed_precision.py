"""The README's mixed-precision recipe: bfloat16 compute, float32 master weights and optimizer
state, gradients reduced in float32. Oracle: the same training in float32 on the demo model."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState

import jmirror as jm
from jmirror import demo

EPOCHS, BATCH = 6, 128


def to_bfloat16(tree):
    return jax.tree.map(lambda x: x.astype(jnp.bfloat16), tree)


def mixed_precision_step(state, batch):
    # As in the README: the step's forward and backward passes in bfloat16.
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["x"].astype(jnp.bfloat16))
        labels = batch["y"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    loss, grads = jax.value_and_grad(loss_fn)(to_bfloat16(state.params))  # bfloat16 gradients
    grads = jm.all_reduce("mean", grads, dtype=jnp.float32)  # summed in float32
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)  # for the float32 master weights
    return state.apply_gradients(grads=grads), jm.all_reduce("mean", loss, dtype=jnp.float32)


def float32_step(state, batch):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=jm.all_reduce("mean", grads)), jm.all_reduce("mean", loss)


def train(strategy, step_fn):
    train_data, _ = demo.load_data(0)
    model = demo.MLP()
    params = model.init(jax.random.key(0), train_data["x"][:1])["params"]
    tx = optax.sgd(0.1, momentum=0.9)
    state = strategy.mirror(TrainState.create(apply_fn=model.apply, params=params, tx=tx))
    step = jm.replicate(step_fn, strategy=strategy)
    n = strategy.num_replicas
    for epoch in range(EPOCHS):
        for batch in demo.train_batches(train_data, BATCH, epoch, seed=0):
            state, _ = step(
                state, jm.PerReplica(jax.tree.map(lambda a: a.reshape(n, -1, *a.shape[1:]), batch))
            )
    params = strategy.read(state.params)
    logits = model.apply({"params": params}, train_data["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, train_data["y"]).mean()
    return state, float(loss)


def test_mixed_precision_final_loss_is_within_one_percent_of_float32(strategy):
    mixed, mixed_loss = train(strategy, mixed_precision_step)
    _, float32_loss = train(strategy, float32_step)
    # Master weights and optimizer state stayed float32 and mirrored.
    for leaf in jax.tree.leaves((mixed.params, mixed.opt_state)):
        assert leaf.dtype in (jnp.float32, jnp.int32) and strategy.topology.is_mirrored(leaf)
    assert abs(mixed_loss - float32_loss) <= 0.01 * float32_loss, (mixed_loss, float32_loss)
    assert np.isfinite(mixed_loss) and float32_loss < 0.2  # both trained


def test_the_recipe_reduces_bfloat16_gradients_in_float32(strategy, n):
    import jmirror.testing as jmt

    train_data, _ = demo.load_data(0)
    model = demo.MLP(hidden=8)
    params = model.init(jax.random.key(0), train_data["x"][:1])["params"]
    state = strategy.mirror(
        TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))
    )
    batch = {k: v[: 4 * n].reshape(n, 4, *v.shape[1:]) for k, v in train_data.items()}
    lowered = jm.replicate(mixed_precision_step, strategy=strategy).lower(
        state, jm.PerReplica(batch)
    )
    if n > 1:
        ops = jmt.collectives(lowered)
        assert {c.op for c in ops} == {"all-reduce"}
        assert {str(d) for c in ops for d in c.dtypes} == {"float32"}, ops
