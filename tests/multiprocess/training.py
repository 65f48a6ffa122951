"""The training of the data-parallel equivalence test, shared by the multi-process worker and
the test that checks it against one process."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmirror as jm

TX = optax.adam(1e-2)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(32)(x))
        return nn.Dense(10)(x)


def loss_fn(params, x, y):
    logits = MLP().apply(params, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def batches(n, steps=6, per_replica=4, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        x = rng.normal(size=(n * per_replica, 16)).astype(np.float32)
        y = rng.integers(0, 10, size=(n * per_replica,)).astype(np.int32)
        yield x, y


def init_state():
    params = MLP().init(jax.random.key(0), jnp.zeros((1, 16)))
    return params, TX.init(params)


def make_step():
    def step(params, opt_state, batch, count):
        x, y = batch
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        grads = jm.all_reduce("mean", grads)
        updates, opt_state = TX.update(grads, opt_state, params)
        count = count.replace(count.value + jnp.int32(x.shape[0]))
        return optax.apply_updates(params, updates), opt_state, jm.all_reduce("mean", loss), count

    return step


def metric_values(n, steps=3, seed=2):
    """Values for NNX metrics, one row per replica: a different count of real values in each
    replica's row would need masking, so every row has 5, spread differently per replica."""
    rs = np.random.RandomState(seed)
    for _ in range(steps):
        yield (rs.randn(n, 5) * (1 + np.arange(n)[:, None]) + np.arange(n)[:, None]).astype(
            np.float32
        )
