"""Gradient accumulation that reduces once per step (`recipes.accumulate_gradients`,
`recipes.make_accumulating_train_step`), for linen, NNX and equinox.

Oracles: the full-batch step on one device (`jax.jit`), k sequential micro-batch passes on
one device for what the loss changes in other state, and the collectives of the compiled
step (`jmirror.testing.collectives`, which counts a collective in a loop once per iteration).
"""

import functools
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


@pytest.mark.parametrize("dtype", [None, jnp.float32])
def test_a_bfloat16_loss_comes_back_in_its_own_dtype(strategy, n, dtype):
    # Summed and reduced in float32, given back as the loss function returns it.
    params = strategy.mirror({"w": jnp.ones((FEATURES, CLASSES), jnp.bfloat16)})

    def loss_fn(p, batch):
        return jnp.mean((batch["x"].astype(jnp.bfloat16) @ p["w"]) ** 2)

    @jm.replicate(strategy=strategy)
    def grads_step(params, batch):
        return recipes.accumulate_gradients(loss_fn, params, batch, 2, dtype=dtype)

    loss, grads = grads_step(params, split(n, batch_of(4 * n)))
    assert loss.dtype == jnp.bfloat16 and grads["w"].dtype == jnp.bfloat16
    expected = loss_fn(strategy.read(params), batch_of(4 * n))
    np.testing.assert_allclose(float(strategy.read(loss)), float(expected), rtol=2e-2)


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


@pytest.mark.parametrize(
    "k, error",
    [(0, ValueError), (-1, ValueError), (True, TypeError), (2.0, TypeError), ("2", TypeError)],
)
def test_a_count_of_micro_batches_that_is_no_positive_int_is_refused(strategy, n, k, error):
    x = np.ones((n, 4), np.float32)
    step = jm.replicate(
        lambda p, x: recipes.accumulate_gradients(lambda p, x: jnp.sum(x * p), p, x, k),
        strategy=strategy,
    )
    with pytest.raises(error, match=r"num_micro_batches=.*positive int"):
        step(strategy.mirror(jnp.ones(())), jm.PerReplica(x))


def test_a_batch_leaf_that_cannot_be_cut_names_it_and_args(strategy, n):
    # A scalar among the batch (a rate) cannot be cut into micro-batches: args= takes it.
    batch = {"x": jm.PerReplica(np.ones((n, 4), np.float32)), "rate": 0.5}
    step = jm.replicate(
        lambda p, b: recipes.accumulate_gradients(
            lambda p, b: jnp.sum(b["x"] * p * b["rate"]), p, b, 2
        ),
        strategy=strategy,
    )
    with pytest.raises(ValueError, match=r"\['rate'\].*shape \(\).*args="):
        step(strategy.mirror(jnp.ones(())), batch)


@pytest.mark.parametrize("k, error", [(0, ValueError), (True, TypeError), (1.5, TypeError)])
def test_a_step_with_a_bad_count_of_micro_batches_is_refused_when_made(strategy, k, error):
    with pytest.raises(error, match=r"make_accumulating_train_step\(num_micro_batches="):
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


@pytest.mark.parametrize("backend", ["pmap"])
def test_a_weakly_typed_equinox_parameter_stays_weak_and_the_step_compiles_once(strategy, n):
    # eqx.nn.PReLU(0.2)'s slope is weakly typed; eqx.filter_jit keeps it so step after step
    # (its gradient is weak too); cast back to its dtype strongly, it would compile again.
    import equinox as eqx

    class Model(eqx.Module):
        linear: eqx.nn.Linear
        act: eqx.nn.PReLU

        def __call__(self, x):
            return self.act(self.linear(x))

    model = Model(eqx.nn.Linear(FEATURES, 2, key=jax.random.key(1)), eqx.nn.PReLU(0.2))
    tx = optax.sgd(0.1)

    def loss_fn(m, batch):
        return jnp.mean((jax.vmap(m)(batch["x"]) - 1.0) ** 2)

    @eqx.filter_jit
    def one_device(m, o, batch):
        grads = eqx.filter_grad(loss_fn)(m, batch)
        updates, o = tx.update(grads, o, eqx.filter(m, eqx.is_array))
        return eqx.apply_updates(m, updates), o

    batches = [batch_of(4 * n, seed=seed) for seed in range(3)]
    want = (model, tx.init(eqx.filter(model, eqx.is_array)))
    for batch in batches:
        want = one_device(*want, batch)
    assert want[0].act.negative_slope.aval.weak_type
    for k in (1, 2):
        step = recipes.make_accumulating_train_step(loss_fn, k, tx=tx, strategy=strategy)
        state = (strategy.mirror(model), strategy.mirror(want[1]))
        for batch in batches:
            state, _ = step(state, split(n, batch))
        assert step.num_compilations == 1, k
        assert state[0].act.negative_slope.aval.weak_type, k
        assert_close(
            strategy.read(eqx.filter(state[0], eqx.is_array)), eqx.filter(want[0], eqx.is_array)
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


# --- functional state: an equinox eqx.nn.State, a linen batch_stats collection -------------------


# Rows per replica where a BatchNorm normalizes: micro-batches of 4 rows or more keep its
# statistics well conditioned on one device too (k = 4).
ROWS = 16


def batch_norm_bytes(strategy, loss_fn, params, state, k):
    """The bytes one micro-batch's own collectives move (of a replica batch of ROWS cut in k):
    those of its loss and gradients, not reduced, in a step of their own (the BatchNorm's
    statistics and their gradients)."""
    n = strategy.num_replicas
    batch = split(n, batch_of(ROWS // k * n))
    one_pass = jm.replicate(
        lambda p, s, b: jax.value_and_grad(loss_fn, has_aux=True)(p, b, s),
        per_replica=lambda path, leaf: True,
        strategy=strategy,
    )
    lowered = one_pass.lower(strategy.mirror(params), strategy.mirror(state), batch)
    return sum(c.bytes for c in jmt.collectives(lowered))


def assert_gradients_reduced_once(lowered, k, grad_bytes, norm_bytes, n):
    """The step's collectives move the gradients and the loss once, and the BatchNorm's own
    statistics once per micro-batch (counted once per loop iteration): nothing else."""
    if n == 1:
        return
    ops = jmt.collectives(lowered)
    assert all(c.op == "all-reduce" for c in ops), ops
    assert norm_bytes > 0 and sum(c.bytes for c in ops) == grad_bytes + 4 + k * norm_bytes, ops


def eqx_batch_norm_setup(mode, axis_name):
    eqx = pytest.importorskip("equinox")

    class Net(eqx.Module):
        hidden: eqx.nn.Linear
        norm: eqx.nn.BatchNorm
        out: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.hidden = eqx.nn.Linear(FEATURES, 16, key=k1)
            self.norm = eqx.nn.BatchNorm(16, axis_name=axis_name, momentum=0.5, mode=mode)
            self.out = eqx.nn.Linear(16, CLASSES, key=k2)

        def __call__(self, x, state):
            h, state = self.norm(jax.nn.relu(self.hidden(x)), state)
            return self.out(h), state

    def loss_fn(model, batch, state):  # as eqx.filter_value_and_grad(has_aux=True) takes it
        batched = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
        logits, state = batched(batch["x"], state)
        return xent(logits, batch["y"]), state

    model, state = eqx.nn.make_with_state(Net)(jax.random.key(0))
    return eqx, model, state, loss_fn


def eqx_sequential_step(eqx, model, opt_state, state, loss_fn, tx, micro_batches):
    """One device: k passes one after another, the state carried, the gradients averaged."""
    total, losses = None, []
    for micro_batch in micro_batches:
        grad_fn = eqx.filter_value_and_grad(loss_fn, has_aux=True)
        (loss, state), grads = grad_fn(model, micro_batch, state)
        losses.append(loss)
        total = grads if total is None else jax.tree.map(jnp.add, total, grads)
    grads = jax.tree.map(lambda g: g / len(micro_batches), total)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, state, grads, jnp.mean(jnp.stack(losses))


# The carry of state through the micro-batches does not depend on the backend (the tests
# above run on both): these run on one, to keep the suite's time.
ONE_BACKEND = pytest.mark.parametrize("backend", ["pmap"])


@ONE_BACKEND
@pytest.mark.parametrize("mode", ["ema", "batch"])
def test_equinox_batch_norm_state_as_k_sequential_micro_batch_passes(strategy, n, mode):
    eqx, model, state, loss_fn = eqx_batch_norm_setup(mode, ("batch", strategy.axis_name))
    _, ref_model, ref_state, ref_loss_fn = eqx_batch_norm_setup(mode, "batch")
    arrays = lambda m: eqx.filter(m, eqx.is_array)  # noqa: E731
    tx = optax.sgd(0.1, momentum=0.9)
    diff, static = eqx.partition(model, eqx.is_inexact_array)
    norm_bytes = functools.partial(
        batch_norm_bytes,
        strategy,
        lambda d, b, s: loss_fn(eqx.combine(d, static), b, s),
        diff,
        state,
    )
    for k in KS:
        step = recipes.make_accumulating_train_step(loss_fn, k, tx=tx, strategy=strategy)
        placed = strategy.mirror((model, tx.init(arrays(model)), state))
        ref = (ref_model, tx.init(arrays(ref_model)), ref_state)
        for seed in range(2):  # the second step starts from the state the first left
            batch = batch_of(ROWS * n, seed=seed)
            if seed == 0:
                lowered = step.lower(placed, split(n, batch))
                assert_gradients_reduced_once(lowered, k, param_bytes(diff), norm_bytes(k), n)
            placed, loss = step(placed, split(n, batch))
            *ref, _, ref_loss = eqx_sequential_step(
                eqx, *ref, ref_loss_fn, tx, global_micro_batches(n, k, batch)
            )
            np.testing.assert_allclose(strategy.read(loss), ref_loss, rtol=1e-5)
        jmt.assert_mirrored(placed, strategy)
        new_model, _, new_state = placed
        assert_close(strategy.read(arrays(new_model)), arrays(ref[0]), rtol=1e-5)
        assert_close(strategy.read(new_state), ref[2], rtol=1e-5)


@ONE_BACKEND
@pytest.mark.parametrize("mode", ["ema", "batch"])
def test_equinox_gradients_and_state_inside_a_replica_function(strategy, n, mode):
    eqx, model, state, loss_fn = eqx_batch_norm_setup(mode, ("batch", strategy.axis_name))
    _, ref_model, ref_state, ref_loss_fn = eqx_batch_norm_setup(mode, "batch")
    arrays, static = eqx.partition(model, eqx.is_array)
    tx = optax.sgd(0.1)
    batch = batch_of(ROWS * n, seed=7)
    diff, rest = eqx.partition(model, eqx.is_inexact_array)
    norm_bytes = functools.partial(
        batch_norm_bytes, strategy, lambda d, b, s: loss_fn(eqx.combine(d, rest), b, s), diff, state
    )
    for k in KS:

        @jm.replicate(strategy=strategy)
        def grads_step(arrays, state, batch, k=k):
            model = eqx.combine(arrays, static)
            loss, grads, state = recipes.accumulate_gradients(loss_fn, model, batch, k, state=state)
            return loss, eqx.filter(grads, eqx.is_array), state

        placed = (strategy.mirror(arrays), strategy.mirror(state))
        lowered = grads_step.lower(*placed, split(n, batch))
        assert_gradients_reduced_once(lowered, k, param_bytes(diff), norm_bytes(k), n)
        loss, grads, new_state = grads_step(*placed, split(n, batch))
        ref = (ref_model, tx.init(eqx.filter(ref_model, eqx.is_array)), ref_state)
        _, _, expected_state, expected, expected_loss = eqx_sequential_step(
            eqx, *ref, ref_loss_fn, tx, global_micro_batches(n, k, batch)
        )
        np.testing.assert_allclose(strategy.read(loss), expected_loss, rtol=1e-5)
        assert_close(strategy.read(grads), eqx.filter(expected, eqx.is_array), rtol=1e-5)
        assert_close(strategy.read(new_state), expected_state, rtol=1e-5)


class BatchNormMLP(nn.Module):
    axis_name: str | None = None

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(16)(x))
        h = nn.BatchNorm(use_running_average=False, momentum=0.5, axis_name=self.axis_name)(h)
        return nn.Dense(CLASSES)(h)


def linen_batch_norm_loss(model):
    def loss_fn(params, batch, batch_stats):  # flax's BatchNorm pattern, one micro-batch
        logits, updates = model.apply(
            {"params": params, "batch_stats": batch_stats}, batch["x"], mutable=["batch_stats"]
        )
        return xent(logits, batch["y"]), updates["batch_stats"]

    return loss_fn


def linen_batch_norm_setup(tx):
    variables = BatchNormMLP().init(jax.random.key(0), jnp.zeros((2, FEATURES)))
    params, stats = variables["params"], variables["batch_stats"]
    state = recipes.BatchNormTrainState.create(
        apply_fn=None, params=params, tx=tx, batch_stats=stats
    )
    return params, stats, state


def linen_sequential(loss_fn, params, stats, micro_batches):
    """One device: k passes one after another, the statistics carried, gradients averaged."""
    total, losses = None, []
    for micro_batch in micro_batches:
        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, micro_batch, stats)
        losses.append(loss)
        total = grads if total is None else jax.tree.map(jnp.add, total, grads)
    return jax.tree.map(lambda g: g / len(micro_batches), total), stats, jnp.mean(jnp.stack(losses))


@ONE_BACKEND
def test_linen_batch_stats_as_k_sequential_micro_batch_passes(strategy, n):
    params, stats, state = linen_batch_norm_setup(optax.sgd(0.1, momentum=0.9))
    loss_fn = linen_batch_norm_loss(BatchNormMLP(axis_name=strategy.axis_name))
    ref_loss_fn = jax.jit(linen_batch_norm_loss(BatchNormMLP()))
    norm_bytes = functools.partial(batch_norm_bytes, strategy, loss_fn, params, stats)
    for k in KS:
        step = recipes.make_accumulating_train_step(loss_fn, k, strategy=strategy)
        placed, ref = strategy.mirror(state), state
        for seed in range(2):  # the second step starts from the statistics the first left
            batch = batch_of(ROWS * n, seed=seed)
            if seed == 0:
                lowered = step.lower(placed, split(n, batch))
                assert_gradients_reduced_once(lowered, k, param_bytes(params), norm_bytes(k), n)
            placed, loss = step(placed, split(n, batch))
            grads, ref_stats, ref_loss = linen_sequential(
                ref_loss_fn, ref.params, ref.batch_stats, global_micro_batches(n, k, batch)
            )
            ref = ref.apply_gradients(grads=grads, batch_stats=ref_stats)
            np.testing.assert_allclose(strategy.read(loss), ref_loss, rtol=1e-5)
        jmt.assert_mirrored(placed, strategy)
        assert isinstance(placed, recipes.BatchNormTrainState)
        assert_close(strategy.read(placed.params), ref.params, rtol=1e-5)
        assert_close(strategy.read(placed.batch_stats), ref.batch_stats, rtol=1e-5)


@ONE_BACKEND
def test_linen_gradients_and_batch_stats_inside_a_replica_function(strategy, n):
    params, stats, _ = linen_batch_norm_setup(optax.sgd(0.1))
    loss_fn = linen_batch_norm_loss(BatchNormMLP(axis_name=strategy.axis_name))
    batch = batch_of(ROWS * n, seed=8)
    for k in KS:
        grads_step = jm.replicate(
            lambda p, s, b, k=k: recipes.accumulate_gradients(loss_fn, p, b, k, state=s),
            strategy=strategy,
        )
        placed = (strategy.mirror(params), strategy.mirror(stats))
        lowered = grads_step.lower(*placed, split(n, batch))
        norm_bytes = functools.partial(batch_norm_bytes, strategy, loss_fn, params, stats)
        assert_gradients_reduced_once(lowered, k, param_bytes(params), norm_bytes(k), n)
        loss, grads, new_stats = grads_step(*placed, split(n, batch))
        expected, expected_stats, expected_loss = linen_sequential(
            linen_batch_norm_loss(BatchNormMLP()), params, stats, global_micro_batches(n, k, batch)
        )
        np.testing.assert_allclose(strategy.read(loss), expected_loss, rtol=1e-5)
        assert_close(strategy.read(grads), expected, rtol=1e-5)
        assert_close(strategy.read(new_stats), expected_stats, rtol=1e-5)


@ONE_BACKEND
def test_linen_per_replica_batch_stats_are_carried_on_each_replica(strategy, n):
    params, stats, state = linen_batch_norm_setup(optax.sgd(0.1))
    loss_fn = linen_batch_norm_loss(BatchNormMLP())  # each replica's own statistics
    state = recipes.distribute_batch_norm_state(strategy, state, per_replica_stats=True)
    step = recipes.make_accumulating_train_step(loss_fn, 2, strategy=strategy)
    batch = batch_of(ROWS * n, seed=9)
    new, _ = step(state, split(n, batch))

    # Oracle: every replica's two micro-batches in turn (vmap over the replicas).
    def replica(batch):
        return linen_sequential(loss_fn, params, stats, global_micro_batches(1, 2, batch))[:2]

    grads, own_stats = jax.vmap(replica)(
        jax.tree.map(lambda a: a.reshape((n, -1) + a.shape[1:]), batch)
    )
    expected = jax.tree.map(lambda p, g: p - 0.1 * g.mean(0), params, grads)
    assert isinstance(new.batch_stats, jm.SyncOnRead)
    assert_close(strategy.local_results(new.batch_stats.value), own_stats, rtol=1e-5)
    assert_close(strategy.read(new.params), expected, rtol=1e-5)


# --- the loss's form and the state's kind, named before JAX's own errors -------------------------


def test_a_loss_returning_state_without_state_given_is_a_type_error_naming_the_fix(strategy, n):
    params, stats, _ = linen_batch_norm_setup(optax.sgd(0.1))
    loss_fn = linen_batch_norm_loss(BatchNormMLP(axis_name=strategy.axis_name))
    step = jm.replicate(
        lambda p, b: recipes.accumulate_gradients(loss_fn, p, b, 2, args=(stats,)),
        strategy=strategy,
    )
    with pytest.raises(TypeError, match=r"returned a tuple of 2 .*state=state\)"):
        step(strategy.mirror(params), split(n, batch_of(4 * n)))


@pytest.mark.parametrize(
    "returned, match",
    [
        (lambda loss, stats: loss, r"returned a float32\[\] array where \(loss, new_state\)"),
        (lambda loss, stats: (loss, {"batch_stats": stats}), r"updates\['batch_stats'\]"),
        (
            lambda loss, stats: (loss, jax.tree.map(lambda s: s[:2], stats)),
            r"leaf at .*'mean'.* shape \(16,\).* shape \(2,\)",
        ),
    ],
)
def test_a_loss_of_the_wrong_form_with_state_is_a_type_error(strategy, n, returned, match):
    params, stats, _ = linen_batch_norm_setup(optax.sgd(0.1))
    inner = linen_batch_norm_loss(BatchNormMLP(axis_name=strategy.axis_name))

    def loss_fn(p, b, s):
        return returned(*inner(p, b, s))

    step = jm.replicate(
        lambda p, s, b: recipes.accumulate_gradients(loss_fn, p, b, 2, state=s),
        strategy=strategy,
    )
    with pytest.raises(TypeError, match=match):
        step(strategy.mirror(params), strategy.mirror(stats), split(n, batch_of(4 * n)))


@pytest.mark.parametrize(
    "make_state",
    [
        lambda params: {"params": params},
        lambda params: (params, optax.sgd(0.1).init(params)),
    ],
    ids=["dict", "tuple-of-arrays"],
)
def test_a_state_of_no_supported_kind_is_a_type_error_naming_the_kinds(strategy, n, make_state):
    params, loss_fn, _ = linen_setup(optax.sgd(0.1))
    step = recipes.make_accumulating_train_step(loss_fn, 2, strategy=strategy)
    with pytest.raises(TypeError, match=r"state that is a (dict|tuple of 2).*flax TrainState"):
        step(strategy.mirror(make_state(params)), split(n, batch_of(4 * n)))


def test_equinox_triple_without_tx_is_a_type_error(strategy, n):
    eqx, model, state, loss_fn = eqx_batch_norm_setup("batch", ("batch", strategy.axis_name))
    opt_state = optax.sgd(0.1).init(eqx.filter(model, eqx.is_array))
    step = recipes.make_accumulating_train_step(loss_fn, 2, strategy=strategy)
    with pytest.raises(TypeError, match=r"\(model, opt_state, state\) triple.*tx=optimizer"):
        step(strategy.mirror((model, opt_state, state)), split(n, batch_of(4 * n)))
