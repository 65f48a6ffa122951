"""Mirrored state stays mirrored.

The two commonest data-parallel mistakes (a BatchNorm without `axis_name`, gradients not
all-reduced) are a `jm.MirroredStateError` of the first call, before anything runs or is
donated; `per_replica=` allows them on purpose; a plain functional step earns a
`jm.MirroredStateWarning`; state that is not mirrored yet compiles once. Oracles: the
arguments as they were before the call, a one-device `nnx.jit` step on the global batch.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import jmirror as jm

# Every XLA compilation of this process, by name (JAX's public monitoring events).
_EVENTS: list[str] = []
jax.monitoring.register_event_duration_secs_listener(lambda name, *_, **__: _EVENTS.append(name))


def _compiles_during(fn) -> int:
    """How many XLA programs `fn()` compiles."""
    _EVENTS.clear()
    fn()
    return sum(name == "/jax/core/compile/backend_compile_duration" for name in _EVENTS)


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(4, 3, rngs=rngs)
        self.bn = nnx.BatchNorm(3, rngs=rngs)  # as upstream writes it: no axis_name

    def __call__(self, x):
        return self.bn(self.linear(x))


def _batch(n, per_replica=2):
    x = np.arange(n * per_replica * 4, dtype=np.float32).reshape(n, per_replica, 4) / 10
    return jm.PerReplica(jnp.asarray(x))


def _train_step(strategy, reduce=True, **kw):
    @jm.replicate(strategy=strategy, donate_argnums=(0, 1), **kw)
    def step(model, optimizer, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        if reduce:
            grads = jm.all_reduce("mean", grads)
        optimizer.update(model, grads)
        return jm.all_reduce("mean", loss)

    return step


def _setup(sync=False):
    model = Net(nnx.Rngs(0))
    if sync:
        jm.sync_batch_norm(model)
    # sgd: adam would amplify the float noise of the bias before the BatchNorm (zero gradient)
    return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)


def _values(*objects):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(objects))]


def _assert_untouched(before, *objects):
    leaves = jax.tree.leaves(nnx.state(objects))
    assert not any(isinstance(x, jax.Array) and x.is_deleted() for x in leaves)
    for a, b in zip(before, _values(*objects)):
        np.testing.assert_array_equal(a, b)


def test_batch_norm_without_axis_name_is_refused_at_the_first_call(strategy):
    with strategy.scope():
        model, optimizer = _setup()
        before = _values(model, optimizer)
        step = _train_step(strategy)
        with pytest.raises(jm.MirroredStateError) as caught:
            step(model, optimizer, _batch(strategy.num_replicas))
    message = str(caught.value)
    assert "args[0].bn.mean" in message and "args[0].bn.var" in message
    assert "BatchNorm" in message and "jm.sync_batch_norm(model, strategy)" in message
    assert "all_reduce" not in message  # the gradients were reduced: not their fix
    assert isinstance(caught.value, ValueError)
    _assert_untouched(before, model, optimizer)  # nothing ran, nothing was donated


def test_unreduced_gradients_are_refused_at_the_first_call(strategy):
    with strategy.scope():
        model, optimizer = _setup(sync=True)
        before = _values(model, optimizer)
        step = _train_step(strategy, reduce=False)
        with pytest.raises(jm.MirroredStateError) as caught:
            step(model, optimizer, _batch(strategy.num_replicas))
    message = str(caught.value)
    assert "args[0].linear.kernel" in message and "nnx.Param of Linear" in message
    assert 'jm.all_reduce("mean", grads)' in message
    assert "sync_batch_norm" not in message
    _assert_untouched(before, model, optimizer)


def test_the_fixed_step_equals_nnx_jit_on_the_global_batch(strategy):
    n = strategy.num_replicas
    batch = _batch(n)
    with strategy.scope():
        model, optimizer = _setup(sync=True)
        step = _train_step(strategy)
        losses = [float(strategy.read(step(model, optimizer, batch))) for _ in range(3)]
    ref_model, ref_optimizer = _setup()

    @nnx.jit
    def ref_step(model, optimizer, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    x = batch.values.reshape(-1, 4)
    ref_losses = [float(ref_step(ref_model, ref_optimizer, x)) for _ in range(3)]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    got = jax.tree.leaves(strategy.read(nnx.state(model)))
    for a, b in zip(got, jax.tree.leaves(nnx.state(ref_model))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_per_replica_declares_state_that_may_differ(strategy):
    with strategy.scope():
        model, optimizer = _setup()
        step = _train_step(strategy, per_replica=nnx.BatchStat)
        step(model, optimizer, _batch(strategy.num_replicas))
    assert isinstance(model.bn.mean.get_raw_value(), jm.PerReplica)
    assert not isinstance(model.linear.kernel.get_raw_value(), jm.PerReplica)
    with strategy.scope():  # a filter for the statistics only still refuses the parameters
        model, optimizer = _setup()
        step = _train_step(strategy, reduce=False, per_replica=nnx.BatchStat)
        with pytest.raises(jm.MirroredStateError, match="linear.kernel"):
            step(model, optimizer, _batch(strategy.num_replicas))
        step = _train_step(strategy, reduce=False, per_replica=...)
        step(model, optimizer, _batch(strategy.num_replicas))
    assert isinstance(model.linear.kernel.get_raw_value(), jm.PerReplica)


def test_strategy_run_takes_per_replica(strategy):
    counter = nnx.Variable(jnp.zeros(()))

    def bump(counter):
        counter[...] += jm.replica_id().astype(jnp.float32)

    with pytest.raises(jm.MirroredStateError, match=r"args\[0\]"):
        strategy.run(bump, (counter,))
    strategy.run(bump, (counter,), per_replica=...)
    got = strategy.local_results(counter.get_raw_value())
    np.testing.assert_array_equal(np.ravel(got), np.arange(strategy.num_replicas))


def _train_state(strategy):
    params = {"w": jnp.ones((4, 3)), "b": jnp.zeros((3,))}
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1))
    return strategy.mirror(state)


def _ts_step(reduce):
    def step(state, x):
        grads = jax.grad(lambda p: jnp.mean((x @ p["w"] + p["b"]) ** 2))(state.params)
        if reduce:
            grads = jm.all_reduce("mean", grads)
        return state.apply_gradients(grads=grads)

    return step


def test_a_train_state_with_unreduced_gradients_is_refused(strategy):
    state = _train_state(strategy)
    w = np.asarray(strategy.read(state.params["w"]))
    step = jm.replicate(_ts_step(reduce=False), strategy=strategy, donate_argnums=0)
    with pytest.raises(jm.MirroredStateError) as caught:
        step(state, _batch(strategy.num_replicas))
    message = str(caught.value)
    assert "result.params['w']" in message and "TrainState" in message
    assert "all_reduce" in message
    assert not state.params["w"].is_deleted()  # not donated
    np.testing.assert_array_equal(strategy.read(state.params["w"]), w)
    good = jm.replicate(_ts_step(reduce=True), strategy=strategy)(
        state, _batch(strategy.num_replicas)
    )
    assert not isinstance(good.params["w"], jm.PerReplica)
    declared = jm.replicate(
        _ts_step(reduce=False),
        strategy=strategy,
        per_replica=lambda path, leaf: "params" in jax.tree_util.keystr(path),
    )(state, _batch(strategy.num_replicas))
    assert isinstance(declared.params["w"], jm.PerReplica)


def test_a_functional_step_warns_once_and_per_replica_silences_it(strategy):
    params = strategy.mirror({"w": jnp.ones((4,)), "b": jnp.zeros(())})

    def sgd(params, x):  # the gradients are not reduced
        grads = jax.grad(lambda p: jnp.mean((x * p["w"] + p["b"]) ** 2))(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    x = jm.PerReplica(_batch(strategy.num_replicas, 1).values[:, 0])  # (4,) per replica
    step = jm.replicate(sgd, strategy=strategy)
    with pytest.warns(jm.MirroredStateWarning, match=r"result\['w'\].*all_reduce|result\['b'\]"):
        out = step(params, x)
    assert isinstance(out["w"], jm.PerReplica)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(params, x)  # once per function
        quiet = jm.replicate(sgd, strategy=strategy, per_replica=lambda path, leaf: True)
        quiet(params, x)
        # Mirrored all the way: no warning.
        jm.replicate(lambda p: jax.tree.map(lambda v: v + 1, p), strategy=strategy)(params)


def test_state_not_mirrored_yet_compiles_once(strategy):
    """Constructor-fresh model, optimizer, metrics and rngs: three calls, one compile."""

    class Dropped(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(4, 3, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.linear(x))

    model = Dropped(nnx.Rngs(params=0, dropout=1))
    optimizer = nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))

    @jm.replicate(strategy=strategy)
    def step(model, optimizer, metrics, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        optimizer.update(model, jm.all_reduce("mean", grads))
        metrics.update(loss=loss)

    batch = _batch(strategy.num_replicas)
    step(model, optimizer, metrics, batch)
    later = _compiles_during(lambda: [step(model, optimizer, metrics, batch) for _ in range(2)])
    assert later == 0  # the calls after the first compile nothing
    assert step.num_compilations == 1
    assert np.isfinite(float(strategy.read(metrics).compute()["loss"]))

    plain = jm.replicate(lambda p, x: jax.tree.map(lambda v: v + jm.all_reduce("sum", x), p))
    params = {"a": jnp.zeros(()), "b": np.zeros((2,), np.float32)}  # one device, host
    ones = jm.PerReplica(jnp.ones(strategy.num_replicas))
    with strategy.scope():
        params = plain(params, ones)
        for _ in range(2):
            assert _compiles_during(lambda: params.update(plain(params, ones))) == 0
    assert plain.num_compilations == 1
    np.testing.assert_array_equal(strategy.read(params["b"]), np.full(2, 3 * strategy.num_replicas))


def test_state_holding_python_numbers_compiles_once(strategy, n):
    """`TrainState.create`'s `step=0`, a Python counter, an `nnx.Variable(0)` and a
    `sync_on_read(0.0)` total: the first call's state comes back as arrays of the same type."""
    tx = optax.sgd(0.1)
    state = train_state.TrainState.create(apply_fn=None, params={"w": jnp.ones((3, 2))}, tx=tx)
    x = jm.PerReplica(np.ones((n, 4, 3), np.float32))

    @jm.replicate(strategy=strategy)
    def step(state, counter, total, x, lr):
        grads = jax.grad(lambda p: jnp.mean((x @ p["w"]) ** 2))(state.params)
        grads = jax.tree.map(lambda g: g * lr, jm.all_reduce("mean", grads))
        total = total.replace(total.value + jnp.sum(x))
        return state.apply_gradients(grads=grads), {"seen": counter["seen"] + 1}, total

    counter, total = {"seen": 0}, strategy.sync_on_read(0.0, "sum")
    for lr in (1.0, 0.5, 0.25):  # a changing Python float stays traced
        state, counter, total = step(state, counter, total, x, lr)
    assert step.num_compilations == 1
    assert int(strategy.read(state.step)) == 3 and int(strategy.read(counter["seen"])) == 3
    assert float(strategy.read(total)) == 3 * n * 12

    class Counted(nnx.Module):
        def __init__(self):
            self.calls = nnx.Variable(0)

    counted = Counted()

    @jm.replicate(strategy=strategy)
    def count(module):
        module.calls.set_value(module.calls.get_value() + 1)

    for _ in range(3):
        count(counted)
    assert count.num_compilations == 1 and int(strategy.read(counted.calls.get_value())) == 3


def test_equal_python_numbers_in_donated_state_are_each_their_own_array(n):
    strategy = jm.MirroredStrategy(donation="always")

    @jm.replicate(strategy=strategy, donate_argnums=0)
    def step(state, other):
        return {"a": state["a"] + 1, "b": state["b"] + 2, "c": state["c"] * 2.0}, other + 1

    state, other = {"a": 0, "b": 0, "c": 0.5}, 0  # two equal numbers donated, one more kept
    for _ in range(3):
        state, other = step(state, other)
    assert step.num_compilations == 1
    assert [int(strategy.read(state[k])) for k in "ab"] == [3, 6]
    assert float(strategy.read(state["c"])) == 4.0 and int(strategy.read(other)) == 3
