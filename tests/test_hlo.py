"""Structural checks on the compiled training step (the claims of benchmarks/RESULTS.md)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmirror as jm
import jmirror.testing as jmt


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(10)(x)


def loss_fn(params, x, y):
    logits = MLP().apply(params, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def setup(strategy, n):
    params = MLP().init(jax.random.key(0), jnp.zeros((1, 32)))
    tx = optax.sgd(0.1)
    state = strategy.mirror((params, tx.init(params)))
    x = jm.PerReplica(np.ones((n, 4, 32), np.float32))
    y = jm.PerReplica(np.zeros((n, 4), np.int32))
    param_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(params))
    return tx, state, x, y, param_bytes


def train_step_factory(tx, with_metrics):
    def train_step(params, opt_state, x, y, *metrics):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        grads = jm.all_reduce("mean", grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        out = (optax.apply_updates(params, updates), opt_state, loss)
        if with_metrics:
            total, count = metrics
            out += (total.replace(total.value + loss), count.replace(count.value + 1))
        return out

    return train_step


def test_train_step_has_one_all_reduce_of_the_parameter_bytes(strategy, n):
    tx, (params, opt_state), x, y, param_bytes = setup(strategy, n)
    step = jm.replicate(train_step_factory(tx, False), strategy=strategy)
    ops = jmt.collectives(step.lower(params, opt_state, x, y))
    if n == 1:
        assert [c.op for c in ops] in ([], ["all-reduce"])
        return
    assert [c.op for c in ops] == ["all-reduce"]
    assert ops[0].bytes == param_bytes


def test_sync_on_read_metrics_add_no_collective(strategy, n):
    tx, (params, opt_state), x, y, _ = setup(strategy, n)
    plain = jm.replicate(train_step_factory(tx, False), strategy=strategy)
    with_metrics = jm.replicate(train_step_factory(tx, True), strategy=strategy)
    metrics = (
        strategy.sync_on_read(np.float32(0), "sum"),
        strategy.sync_on_read(np.int32(0), "sum"),
    )
    before = jmt.collectives(plain.lower(params, opt_state, x, y))
    after = jmt.collectives(with_metrics.lower(params, opt_state, x, y, *metrics))
    assert after == before
    outs = with_metrics(params, opt_state, x, y, *metrics)
    assert isinstance(outs[3], jm.SyncOnRead)
    assert int(strategy.read(outs[4])) == n


@pytest.mark.parametrize("aggregation", ["mean", "only_first_replica", "none"])
def test_sync_of_a_proven_mirrored_value_adds_no_collective(strategy, n, aggregation):
    tx, (params, opt_state), x, y, _ = setup(strategy, n)

    def step(params, x):
        return jm.sync(jax.tree.map(lambda p: p * 2, params), aggregation)

    replicated = jm.replicate(step, strategy=strategy)
    assert jmt.collectives(replicated.lower(params, x)) == []
    doubled = replicated(params, x)
    jmt.assert_mirrored(doubled, strategy)


@pytest.mark.parametrize("length", [2, 5])
def test_a_collective_in_a_loop_is_listed_once_per_iteration(strategy, n, length):
    from jax import lax

    def step(x):
        def body(carry, _):
            return carry + jm.all_reduce("sum", carry), None

        return lax.scan(body, x, None, length=length)[0]

    replicated = jm.replicate(step, strategy=strategy)
    x = jm.PerReplica(np.ones((n, 4), np.float32))
    ops = jmt.collectives(replicated.lower(x))
    if n > 1:
        assert [(c.op, c.bytes) for c in ops] == [("all-reduce", 16)] * length
    # The oracle of the values: the same loop under jax.vmap with an axis name.
    expected = jax.vmap(
        lambda v: lax.scan(lambda c, _: (c + lax.psum(c, "i"), None), v, None, length=length)[0],
        axis_name="i",
    )(np.ones((n, 4), np.float32))
    np.testing.assert_allclose(strategy.local_results(replicated(x))[0], expected[0])
