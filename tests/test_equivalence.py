"""Data-parallel training through jm.replicate equals one-device training."""

import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmirror as jm


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(32)(x))
        x = nn.relu(nn.Dense(32)(x))
        return nn.Dense(10)(x)


def loss_fn(params, x, y):
    logits = MLP().apply(params, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def batches(n, steps=10, per_replica=4, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        x = rng.normal(size=(n * per_replica, 16)).astype(np.float32)
        y = rng.integers(0, 10, size=(n * per_replica,)).astype(np.int32)
        yield x, y


@pytest.mark.parametrize("forget_all_reduce", [False, True])
def test_ten_steps_match_single_device_training(strategy, n, forget_all_reduce):
    tx = optax.adam(1e-2)
    params0 = MLP().init(jax.random.key(0), jnp.zeros((1, 16)))

    @jax.jit
    def single_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    @jm.replicate(strategy=strategy)
    def replica_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        if not forget_all_reduce:
            grads = jm.all_reduce("mean", grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jm.all_reduce("mean", loss)

    params, opt_state = params0, tx.init(params0)
    for x, y in batches(n):
        params, opt_state, _ = single_step(params, opt_state, x, y)

    m_params, m_opt = strategy.mirror((params0, tx.init(params0)))
    for i, (x, y) in enumerate(batches(n)):
        # Forgotten, the all-reduce earns one warning, naming the fix.
        warns = pytest.warns(jm.MirroredStateWarning, match=r"\['params'\].*all_reduce")
        with warns if forget_all_reduce and i == 0 else contextlib.nullcontext():
            m_params, m_opt, loss = replica_step(
                m_params,
                m_opt,
                jm.PerReplica(x.reshape(n, -1, 16)),
                jm.PerReplica(y.reshape(n, -1)),
            )
        assert strategy.topology.is_mirrored(loss)

    leaves = jax.tree.leaves(m_params, is_leaf=lambda v: isinstance(v, jm.PerReplica))
    if forget_all_reduce:
        # Without the all-reduce the params may differ between replicas: the proof is static,
        # so they come back per-replica (never replica 0's value), whatever N is.
        assert all(isinstance(leaf, jm.PerReplica) for leaf in leaves)
        if n == 1:
            (only,) = strategy.local_results(m_params)
            for got, want in zip(jax.tree.leaves(only), jax.tree.leaves(params)):
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        return
    assert all(strategy.topology.is_mirrored(leaf) for leaf in leaves), (
        "params must come back mirrored"
    )
    assert replica_step.num_compilations == 1
    for got, want in zip(jax.tree.leaves(strategy.read(m_params)), jax.tree.leaves(params)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
