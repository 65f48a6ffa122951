"""Gradient accumulation that reduces once per step (`recipes.accumulate_gradients`,
`recipes.make_accumulating_train_step`), for linen, NNX and equinox.

Oracles: the full-batch step on one device (`jax.jit`), k sequential micro-batch passes on
one device for what the loss changes in other state, and the collectives of the compiled
step (`jmirror.testing.collectives`, which counts a collective in a loop once per iteration).
"""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training.train_state import TrainState

import jmirror as jm
import jmirror.testing as jmt
from jmirror import recipes

FEATURES, CLASSES = 6, 3
KS = (1, 2, 4)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(CLASSES)(nn.relu(nn.Dense(16)(x)))


def batch_of(size, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(size, FEATURES)).astype(np.float32),
        "y": rng.integers(0, CLASSES, size=size).astype(np.int32),
    }


def split(n, batch):
    return jm.PerReplica(jax.tree.map(lambda a: a.reshape((n, -1) + a.shape[1:]), batch))


def global_micro_batches(n, k, batch):
    """The k global micro-batches the replicas run together: micro-batch j is every
    replica's j-th consecutive slice of its own batch."""
    cut = jax.tree.map(lambda a: a.reshape((n, k, -1) + a.shape[1:]), batch)
    return [
        jax.tree.map(lambda a, j=j: a[:, j].reshape((-1,) + a.shape[3:]), cut) for j in range(k)
    ]


def xent(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def linen_setup(tx):
    model = MLP()
    params = model.init(jax.random.key(0), jnp.zeros((1, FEATURES)))["params"]

    def loss_fn(params, batch):
        return xent(model.apply({"params": params}, batch["x"]), batch["y"])

    return params, loss_fn, TrainState.create(apply_fn=model.apply, params=params, tx=tx)


def assert_close(actual, expected, rtol=1e-5, atol=1e-6):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol)


def collectives_in_loops(lowered):
    """The collective instructions inside loop bodies of the compiled step, read from its
    HLO text here (apart from `jmirror.testing`): each runs once per iteration."""
    text = lowered.compile().as_text()
    bodies = set(re.findall(r"\bbody=%?([\w.\-]+)", text))
    found, where = [], None
    for line in text.splitlines():
        header = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if header is not None:
            where = header.group(1)
        elif where in bodies and re.search(
            r"\b(all-reduce|reduce-scatter|all-gather)(-start)?\(", line
        ):
            found.append(line.strip())
    return found


def param_bytes(params):
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))


# --- one reduction per step ----------------------------------------------------------------------


def test_linen_step_has_one_gradient_all_reduce_whatever_k_and_equals_the_full_batch(strategy, n):
    params, loss_fn, state = linen_setup(optax.sgd(0.1, momentum=0.9))
    placed = strategy.mirror(state)
    batch = batch_of(8 * n, seed=1)

    @jax.jit
    def full_batch_step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads=grads), loss

    expected, expected_loss = full_batch_step(state, batch)
    for k in KS:
        step = recipes.make_accumulating_train_step(loss_fn, num_micro_batches=k, strategy=strategy)
        lowered = step.lower(placed, split(n, batch))
        assert collectives_in_loops(lowered) == []  # nothing communicates per micro-batch
        ops = jmt.collectives(lowered)
        if n > 1:  # the gradients and the loss, combined by XLA into one all-reduce
            assert [c.op for c in ops] == ["all-reduce"], (k, ops)
            assert ops[0].bytes == param_bytes(params) + 4
        new, loss = step(placed, split(n, batch))
        jmt.assert_mirrored((new, loss), strategy)
        np.testing.assert_allclose(strategy.read(loss), expected_loss, rtol=1e-5)
        assert_close(strategy.read(new.params), expected.params)


def test_shard_update_step_has_one_reduce_scatter_and_all_gather_whatever_k(strategy, n):
    params, loss_fn, _ = linen_setup(optax.adam(1e-2))
    tx = jm.shard_update(optax.adam(1e-2), strategy=strategy)
    placed = strategy.mirror(TrainState.create(apply_fn=None, params=params, tx=tx))
    batch = batch_of(8 * n, seed=2)
    oracle = TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-2))
    grads = jax.jit(jax.grad(loss_fn))(params, batch)
    expected = jax.jit(lambda s, g: s.apply_gradients(grads=g))(oracle, grads)
    for k in KS:
        step = recipes.make_accumulating_train_step(loss_fn, k, strategy=strategy)
        ops = jmt.collectives(step.lower(placed, split(n, batch)))
        if n > 1:
            kinds = [c.op for c in ops]
            assert kinds.count("reduce-scatter") == 1 and kinds.count("all-gather") == 1, ops
            # The loss and Adam's scalars only: no all-reduce of the gradients.
            assert all(c.bytes <= 64 for c in ops if c.op == "all-reduce"), ops
        new, _ = step(placed, split(n, batch))
        assert_close(strategy.read(new.params), expected.params)


def test_accumulate_gradients_reduces_once_in_the_given_dtype(strategy, n):
    params = strategy.mirror({"w": jnp.ones((FEATURES, CLASSES), jnp.bfloat16)})

    def loss_fn(p, batch):
        return jnp.mean((batch["x"].astype(jnp.bfloat16) @ p["w"]).astype(jnp.float32) ** 2)

    @jm.replicate(strategy=strategy)
    def grads_step(params, batch):
        return recipes.accumulate_gradients(loss_fn, params, batch, 4, dtype=jnp.float32)

    ops = jmt.collectives(grads_step.lower(params, split(n, batch_of(8 * n))))
    if n > 1:
        assert [c.op for c in ops] == ["all-reduce"] and ops[0].dtype == jnp.float32, ops
    loss, grads = grads_step(params, split(n, batch_of(8 * n)))
    assert grads["w"].dtype == jnp.bfloat16 and loss.dtype == jnp.float32
    expected = jax.grad(loss_fn)(strategy.read(params), batch_of(8 * n))
    np.testing.assert_allclose(
        np.asarray(strategy.read(grads)["w"], np.float32),
        np.asarray(expected["w"], np.float32),
        rtol=2e-2,
    )


def test_local_gradients_when_not_reduced(strategy, n):
    params = {"w": jnp.ones(()) * 0.5}
    loss_fn = lambda p, x: jnp.mean((x * p["w"] - 1.0) ** 2)  # noqa: E731
    x = np.linspace(0.0, 1.0, 4 * n, dtype=np.float32).reshape(n, 4)

    @jm.replicate(strategy=strategy)
    def grads_step(params, x):
        loss, grads = recipes.accumulate_gradients(loss_fn, params, x, 2, reduce=False)
        return loss, grads["w"]

    loss, grads = grads_step(strategy.mirror(params), jm.PerReplica(x))
    assert isinstance(grads, jm.PerReplica) or n == 1
    own = [float(g) for g in strategy.local_results(grads)]
    assert own == pytest.approx([float(jax.grad(loss_fn)(params, r)["w"]) for r in x], rel=1e-5)
    assert float(strategy.read(loss)) == pytest.approx(float(loss_fn(params, x)), rel=1e-5)


@pytest.mark.parametrize("k", [np.int64(2), np.int32(2)])
def test_a_numpy_integer_count_of_micro_batches_is_taken_as_an_int(strategy, n, k):
    params = {"w": jnp.ones(()) * 0.5}
    loss_fn = lambda p, x: jnp.mean((x * p["w"] - 1.0) ** 2)  # noqa: E731
    x = np.linspace(0.0, 1.0, 4 * n, dtype=np.float32).reshape(n, 4)
    step = jm.replicate(
        lambda p, x: recipes.accumulate_gradients(loss_fn, p, x, k), strategy=strategy
    )
    _, grads = step(strategy.mirror(params), jm.PerReplica(x))
    want = jax.grad(loss_fn)(params, x.reshape(-1))["w"]
    assert float(strategy.read(grads)["w"]) == pytest.approx(float(want), rel=1e-5)


@pytest.mark.parametrize("k", [0, -1, True, 2.0, "2"])
def test_a_count_of_micro_batches_that_is_no_positive_int_is_a_value_error(strategy, n, k):
    x = np.ones((n, 4), np.float32)
    step = jm.replicate(
        lambda p, x: recipes.accumulate_gradients(lambda p, x: jnp.sum(x * p), p, x, k),
        strategy=strategy,
    )
    with pytest.raises(ValueError, match=r"num_micro_batches=.*positive int"):
        step(strategy.mirror(jnp.ones(())), jm.PerReplica(x))


@pytest.mark.parametrize("k", [0, True, 1.5])
def test_a_step_with_a_bad_count_of_micro_batches_is_refused_when_made(strategy, k):
    with pytest.raises(ValueError, match=r"make_accumulating_train_step\(num_micro_batches="):
        recipes.make_accumulating_train_step(lambda p, x: jnp.sum(x), k, strategy=strategy)


# --- NNX: batch statistics and metrics as k sequential micro-batch passes ------------------------


class Net(nnx.Module):
    def __init__(self, rngs, axis_name=None):
        self.hidden = nnx.Linear(FEATURES, 16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, momentum=0.5, axis_name=axis_name, rngs=rngs)
        self.out = nnx.Linear(16, CLASSES, rngs=rngs)
        self.seen = nnx.metrics.Average()  # a metric held by the model

    def __call__(self, x):
        return self.out(nnx.relu(self.bn(self.hidden(x))))


def nnx_loss(model, batch, losses):
    per_example = optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"])
    model.seen.update(values=jnp.argmax(model(batch["x"]), -1) == batch["y"])
    losses.update(values=per_example)  # a metric passed in
    return per_example.mean()


def nnx_pair(axis_name):
    model = Net(nnx.Rngs(0), axis_name=axis_name)
    return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)


@pytest.mark.parametrize("k", KS)
def test_nnx_batch_stats_and_metrics_as_k_sequential_micro_batch_passes(strategy, n, k):
    model, optimizer = nnx_pair(strategy.axis_name)
    losses = nnx.metrics.Average()
    ref_model, ref_optimizer = nnx_pair(None)
    ref_losses = nnx.metrics.Average()

    @nnx.jit
    def one_device_step(model, optimizer, losses, micro_batches):
        total = None
        for micro_batch in micro_batches:  # k passes, one after another
            grads = nnx.grad(nnx_loss)(model, micro_batch, losses)
            total = grads if total is None else jax.tree.map(jnp.add, total, grads)
        optimizer.update(model, jax.tree.map(lambda g: g / len(micro_batches), total))

    step = recipes.make_accumulating_train_step(nnx_loss, k, strategy=strategy)
    for seed in range(2):
        batch = batch_of(8 * n, seed=seed)
        state, _ = step((model, optimizer), split(n, batch), losses)
        assert state[0] is model and state[1] is optimizer
        one_device_step(ref_model, ref_optimizer, ref_losses, global_micro_batches(n, k, batch))
    jmt.assert_mirrored(nnx.state(model, nnx.Param), strategy)
    assert_close(
        strategy.read(nnx.state(model, nnx.BatchStat)),
        nnx.state(ref_model, nnx.BatchStat),
        rtol=1e-4,
        atol=1e-6,
    )
    assert_close(
        strategy.read(nnx.state(model, nnx.Param)),
        nnx.state(ref_model, nnx.Param),
        rtol=1e-4,
        atol=1e-6,
    )
    # Every example of every micro-batch counted, in the metric held and the one passed in.
    for metric, ref in ((model.seen, ref_model.seen), (losses, ref_losses)):
        read = strategy.read(metric)
        assert int(read.count[...]) == int(ref.count[...]) == 2 * 8 * n
        np.testing.assert_allclose(read.compute(), ref.compute(), rtol=1e-4)
    assert int(strategy.read(optimizer.step[...])) == 2


def test_nnx_step_has_one_gradient_all_reduce_whatever_k(strategy, n):
    def fixed_statistics_pair():
        model, optimizer = nnx_pair(None)
        model.bn.use_running_average = True  # no batch statistics: equal to the full batch
        return model, optimizer

    def loss_fn(model, batch):
        return xent(model(batch["x"]), batch["y"])

    @nnx.jit
    def full_batch_step(model, optimizer, batch):
        optimizer.update(model, nnx.grad(loss_fn)(model, batch))

    batch = batch_of(8 * n, seed=3)
    ref_model, ref_optimizer = fixed_statistics_pair()
    full_batch_step(ref_model, ref_optimizer, batch)
    for k in KS:
        model, optimizer = fixed_statistics_pair()
        step = recipes.make_accumulating_train_step(loss_fn, k, strategy=strategy)
        lowered = step.lower((model, optimizer), split(n, batch))
        assert collectives_in_loops(lowered) == []
        if n > 1:
            ops = jmt.collectives(lowered)
            assert [c.op for c in ops] == ["all-reduce"], (k, ops)
            assert ops[0].bytes == param_bytes(nnx.state(model, nnx.Param)) + 4
        step((model, optimizer), split(n, batch))
        assert_close(strategy.read(nnx.state(model, nnx.Param)), nnx.state(ref_model, nnx.Param))


# --- equinox -------------------------------------------------------------------------------------


def eqx_setup():
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.MLP(FEATURES, CLASSES, 16, depth=1, key=jax.random.key(0))

    def loss_fn(model, batch):
        return xent(jax.vmap(model)(batch["x"]), batch["y"])

    return eqx, model, loss_fn


def eqx_full_batch(eqx, model, loss_fn, tx, batch):
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, batch)
    updates, _ = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), loss


def test_equinox_gradients_inside_a_replica_function_equal_the_full_batch(strategy, n):
    # The module's static parts are closed over: only its arrays cross jm.replicate.
    eqx, model, loss_fn = eqx_setup()
    arrays, static = eqx.partition(model, eqx.is_array)
    batch = batch_of(8 * n, seed=4)
    expected_loss, expected = eqx.filter_value_and_grad(loss_fn)(model, batch)
    for k in KS:

        @jm.replicate(strategy=strategy)
        def grads_step(arrays, batch, k=k):
            model = eqx.combine(arrays, static)
            loss, grads = recipes.accumulate_gradients(loss_fn, model, batch, k)
            return loss, eqx.filter(grads, eqx.is_array)

        placed = strategy.mirror(arrays)
        ops = jmt.collectives(grads_step.lower(placed, split(n, batch)))
        if n > 1:
            assert [c.op for c in ops] == ["all-reduce"], (k, ops)
        loss, grads = grads_step(placed, split(n, batch))
        np.testing.assert_allclose(strategy.read(loss), expected_loss, rtol=1e-5)
        assert_close(strategy.read(grads), eqx.filter(expected, eqx.is_array))


def test_equinox_pair_step_equals_the_full_batch(strategy, n):
    eqx, model, loss_fn = eqx_setup()
    tx = optax.adam(1e-2)
    batch = batch_of(8 * n, seed=5)
    expected, expected_loss = eqx_full_batch(eqx, model, loss_fn, tx, batch)
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    for k in KS:
        step = recipes.make_accumulating_train_step(loss_fn, k, tx=tx, strategy=strategy)
        state = (strategy.mirror(model), strategy.mirror(opt_state))
        (new_model, _), loss = step(state, split(n, batch))
        np.testing.assert_allclose(strategy.read(loss), expected_loss, rtol=1e-5)
        assert_close(
            strategy.read(eqx.filter(new_model, eqx.is_array)), eqx.filter(expected, eqx.is_array)
        )


def test_equinox_pair_without_tx_is_a_type_error(strategy, n):
    eqx, model, loss_fn = eqx_setup()
    step = recipes.make_accumulating_train_step(loss_fn, 2, strategy=strategy)
    arrays, static = eqx.partition(model, eqx.is_array)
    with pytest.raises(TypeError, match="tx=optimizer"):
        step((model, optax.sgd(0.1).init(arrays)), split(n, batch_of(4 * n)))


def test_nnx_metrics_held_in_the_state_after_the_pair_count_every_micro_batch(strategy, n):
    model, optimizer = nnx_pair(strategy.axis_name)
    losses = nnx.metrics.Average()
    ref_losses = nnx.metrics.Average()
    step = recipes.make_accumulating_train_step(nnx_loss, 4, strategy=strategy)
    batch = batch_of(8 * n, seed=6)
    state, _ = step((model, optimizer, losses), split(n, batch))
    assert state[2] is losses
    ref_model, _ = nnx_pair(None)
    for micro_batch in global_micro_batches(n, 4, batch):
        nnx_loss(ref_model, micro_batch, ref_losses)  # the loss of the same parameters
    read = strategy.read(losses)
    assert int(read.count[...]) == 8 * n
    np.testing.assert_allclose(read.compute(), ref_losses.compute(), rtol=1e-5)
