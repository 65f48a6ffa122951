"""Tests of `jmirror.recipes`, each against a single-device `jax.jit` oracle."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState

import jmirror as jm
from jmirror import recipes

FEATURES, CLASSES = 6, 3


class MLP(nn.Module):
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(16, dtype=self.dtype)(x))
        return nn.Dense(CLASSES, dtype=self.dtype)(x)


class DropoutMLP(nn.Module):
    @nn.compact
    def __call__(self, x, key):
        x = nn.relu(nn.Dense(16)(x))
        x = nn.Dropout(0.5, deterministic=False)(x, rng=key)
        return nn.Dense(CLASSES)(x)


class BatchNormMLP(nn.Module):
    axis_name: str | None = None

    @nn.compact
    def __call__(self, x, train):
        x = nn.Dense(16)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.5, axis_name=self.axis_name)(x)
        return nn.Dense(CLASSES)(nn.relu(x))


def _batches(steps, size, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=(size, FEATURES)).astype(np.float32),
            "y": rng.integers(0, CLASSES, size=size).astype(np.int32),
        }
        for _ in range(steps)
    ]


def _xent(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _split(n, batch):
    return jm.PerReplica(jax.tree.map(lambda a: a.reshape((n, -1) + a.shape[1:]), batch))


def _shards(n, batch):
    return [jax.tree.map(lambda a, i=i: np.split(a, n)[i], batch) for i in range(n)]


def _assert_trees_close(actual, expected, rtol=1e-5, atol=1e-6):
    jax.tree.map(
        lambda a, e: np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol),
        actual,
        expected,
    )


def _init(model, *args):
    return model.init(jax.random.key(0), *args)


# --- (a) TrainState + optax ----------------------------------------------------------------------


def test_train_state_matches_single_device(strategy, n):
    model = MLP()
    params = _init(model, jnp.zeros((1, FEATURES)))["params"]
    tx = optax.adam(1e-2)

    def loss_fn(params, batch):
        return _xent(model.apply({"params": params}, batch["x"]), batch["y"])

    step = recipes.make_train_step(loss_fn, strategy=strategy)
    state = strategy.mirror(TrainState.create(apply_fn=model.apply, params=params, tx=tx))

    @jax.jit
    def oracle_step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
        return state.apply_gradients(grads=grads), loss

    oracle = TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    for batch in _batches(10, 4 * n):
        state, loss = step(state, _split(n, batch))
        oracle, oracle_loss = oracle_step(oracle, batch)
        np.testing.assert_allclose(strategy.read(loss), oracle_loss, rtol=1e-5)
    for leaf in jax.tree.leaves(state):  # the state stayed mirrored
        assert not isinstance(leaf, jm.PerReplica) and strategy.topology.is_mirrored(leaf)
    assert int(strategy.read(state.step)) == 10
    _assert_trees_close(strategy.read(state.params), oracle.params)


# --- (c) per-replica dropout keys ----------------------------------------------------------------


def test_dropout_keys_match_single_device(strategy, n):
    model = DropoutMLP()
    key = jax.random.key(42)
    params = _init(model, jnp.zeros((1, FEATURES)), key)["params"]
    tx = optax.sgd(0.1)

    def loss_fn(params, batch, key):
        return _xent(model.apply({"params": params}, batch["x"], key), batch["y"])

    step = recipes.make_train_step(loss_fn, strategy=strategy)
    state = strategy.mirror(TrainState.create(apply_fn=model.apply, params=params, tx=tx))

    @jax.jit
    def oracle_step(params, shards, step_index):
        # Replica i draws its noise from fold_in(fold_in(key, step), i) for its own shard.
        def shard_loss(params):
            keys = [jax.random.fold_in(jax.random.fold_in(key, step_index), i) for i in range(n)]
            return jnp.mean(
                jnp.stack([loss_fn(params, s, k) for s, k in zip(shards, keys, strict=True)])
            )

        grads = jax.grad(shard_loss)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    oracle = params
    for i, batch in enumerate(_batches(3, 4 * n, seed=1)):
        state, _ = step(state, _split(n, batch), key)
        oracle = oracle_step(oracle, _shards(n, batch), i)
    _assert_trees_close(strategy.read(state.params), oracle)


def test_replica_keys_differ(strategy, n):
    key = jax.random.key(0)

    @jm.replicate(strategy=strategy)
    def noise(key, split_key):
        return jax.random.normal(recipes.fold_in_replica(key, 3), (4,)), jax.random.normal(
            split_key, (4,)
        )

    folded, split = noise(key, strategy.split_key(key))
    for draws in (folded, split):
        assert isinstance(draws, jm.PerReplica)
        rows = np.stack([np.asarray(d) for d in strategy.local_results(draws)])
        assert len({tuple(r) for r in rows.tolist()}) == n
    expected = jax.random.normal(jax.random.fold_in(jax.random.fold_in(key, 3), n - 1), (4,))
    np.testing.assert_allclose(strategy.local_results(folded)[-1], expected)


# --- (b) batch norm ------------------------------------------------------------------------------


def _bn_loss(model):
    def loss_fn(params, batch_stats, batch):
        logits, updates = model.apply(
            {"params": params, "batch_stats": batch_stats},
            batch["x"],
            train=True,
            mutable=["batch_stats"],
        )
        return _xent(logits, batch["y"]), updates["batch_stats"]

    return loss_fn


def _bn_state(model, init_model=None):
    """A `BatchNormTrainState` (SGD 0.1) for `model`, initialized by `init_model` (or `model`)."""
    variables = _init(init_model or model, jnp.zeros((2, FEATURES)), False)
    state = recipes.BatchNormTrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=optax.sgd(0.1),
        batch_stats=variables["batch_stats"],
    )
    return state, variables


def test_synchronized_batch_norm_matches_full_batch(strategy, n):
    model = BatchNormMLP(axis_name=strategy.axis_name)
    oracle_model = BatchNormMLP(axis_name=None)
    state, _ = _bn_state(model, oracle_model)
    placed = recipes.distribute_batch_norm_state(strategy, state, per_replica_stats=False)
    step = recipes.make_batch_norm_train_step(_bn_loss(model), strategy=strategy)
    oracle_loss = _bn_loss(oracle_model)

    @jax.jit
    def oracle_step(state, batch):
        (_, stats), grads = jax.value_and_grad(oracle_loss, has_aux=True)(
            state.params, state.batch_stats, batch
        )
        return state.apply_gradients(grads=grads, batch_stats=stats)

    oracle = state
    for batch in _batches(3, 4 * n, seed=2):
        placed, _ = step(placed, _split(n, batch))
        oracle = oracle_step(oracle, batch)
    assert all(strategy.topology.is_mirrored(x) for x in jax.tree.leaves(placed.batch_stats))
    read = recipes.read_variables(strategy, placed)
    _assert_trees_close(
        read, {"params": oracle.params, "batch_stats": oracle.batch_stats}, rtol=1e-4, atol=1e-5
    )


def test_per_replica_batch_norm_stats_read_as_mean(strategy, n):
    model = BatchNormMLP(axis_name=None)
    state, variables = _bn_state(model)
    placed = recipes.distribute_batch_norm_state(strategy, state, per_replica_stats=True)
    loss_fn = _bn_loss(model)
    step = recipes.make_batch_norm_train_step(loss_fn, strategy=strategy)

    @jax.jit
    def oracle_step(params, stats, shards):
        # Every replica normalizes with, and updates, its own statistics.
        def mean_loss(params):
            outs = [loss_fn(params, s, b) for s, b in zip(stats, shards, strict=True)]
            return jnp.mean(jnp.stack([o[0] for o in outs])), [o[1] for o in outs]

        grads, new_stats = jax.grad(mean_loss, has_aux=True)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), new_stats

    params, stats = variables["params"], [variables["batch_stats"]] * n
    for batch in _batches(2, 4 * n, seed=3):
        placed, _ = step(placed, _split(n, batch))
        params, stats = oracle_step(params, stats, _shards(n, batch))
    assert isinstance(placed.batch_stats, jm.SyncOnRead)
    assert placed.batch_stats.aggregation is jm.Aggregation.MEAN
    for component, expected in zip(strategy.local_results(placed.batch_stats), stats, strict=True):
        _assert_trees_close(component, expected, rtol=1e-4, atol=1e-5)
    mean_stats = jax.tree.map(lambda *xs: np.mean(np.stack(xs), axis=0), *stats)
    read = recipes.read_variables(strategy, placed)
    _assert_trees_close(read, {"params": params, "batch_stats": mean_stats}, rtol=1e-4, atol=1e-5)
    logits = model.apply(read, np.ones((2, FEATURES), np.float32), train=False)
    assert np.shape(logits) == (2, CLASSES)


def test_unsynchronized_batch_norm_with_mirrored_stats_raises(strategy, n):
    model = BatchNormMLP(axis_name=None)  # forgets axis_name: the statistics would diverge
    state, _ = _bn_state(model)
    placed = recipes.distribute_batch_norm_state(strategy, state, per_replica_stats=False)
    step = recipes.make_batch_norm_train_step(_bn_loss(model), strategy=strategy)
    with pytest.raises(ValueError, match="batch_stats|identical"):
        step(placed, _split(n, _batches(1, 2 * n)[0]))


# --- (d) gradient accumulation -------------------------------------------------------------------


def _mlp_loss(model):
    def loss_fn(params, batch):
        return _xent(model.apply({"params": params}, batch["x"]), batch["y"])

    return loss_fn


@pytest.mark.parametrize("num_micro_batches", [1, 4])
def test_accumulated_gradients_equal_full_batch(strategy, n, num_micro_batches):
    model = MLP()
    params = strategy.mirror(_init(model, jnp.zeros((1, FEATURES)))["params"])
    loss_fn = _mlp_loss(model)
    batch = _batches(1, 8 * n, seed=4)[0]

    @jm.replicate(strategy=strategy)
    def grads_step(params, batch):
        return recipes.accumulate_gradients(loss_fn, params, batch, num_micro_batches)

    loss, grads = grads_step(params, _split(n, batch))
    assert all(strategy.topology.is_mirrored(x) for x in jax.tree.leaves((loss, grads)))
    expected_loss, expected = jax.jit(jax.value_and_grad(loss_fn))(strategy.read(params), batch)
    np.testing.assert_allclose(strategy.read(loss), expected_loss, rtol=1e-5)
    _assert_trees_close(strategy.read(grads), expected)


def test_accumulating_train_step_matches_single_device(strategy, n):
    model = MLP()
    params = _init(model, jnp.zeros((1, FEATURES)))["params"]
    tx = optax.sgd(0.1, momentum=0.9)
    loss_fn = _mlp_loss(model)
    step = recipes.make_accumulating_train_step(loss_fn, 2, strategy=strategy)
    state = strategy.mirror(TrainState.create(apply_fn=model.apply, params=params, tx=tx))

    @jax.jit
    def oracle_step(state, batch):
        return state.apply_gradients(grads=jax.grad(loss_fn)(state.params, batch))

    oracle = TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    for batch in _batches(3, 4 * n, seed=5):
        state, _ = step(state, _split(n, batch))
        oracle = oracle_step(oracle, batch)
    _assert_trees_close(strategy.read(state.params), oracle.params)


def test_accumulate_gradients_indivisible_batch_raises(strategy, n):
    step = jm.replicate(
        lambda w, b: recipes.accumulate_gradients(lambda w, x: jnp.mean(w * x), w, b, 3),
        strategy=strategy,
    )
    with pytest.raises(ValueError, match="num_micro_batches=3"):
        step(jnp.ones(()), jm.PerReplica(np.ones((n, 4), np.float32)))


# --- (e) float16 loss scaling --------------------------------------------------------------------


def _fp16_setup(initial_scale):
    model = MLP(dtype=jnp.float16)
    params = _init(model, jnp.zeros((1, FEATURES)))["params"]
    state = recipes.LossScaleTrainState.create(
        apply_fn=model.apply,
        params=params,
        tx=optax.sgd(0.1),
        loss_scale=recipes.DynamicLossScale.create(initial_scale, growth_interval=2),
    )
    return _mlp_loss(model), state


def _oracle_loss_scaled_step(loss_fn):
    @jax.jit
    def step(state, batch):
        scale = state.loss_scale.scale
        grads = jax.grad(lambda p: loss_fn(p, batch).astype(jnp.float32) * scale)(state.params)
        grads = jax.tree.map(lambda g: g / scale, grads)
        finite = jnp.all(jnp.asarray([jnp.isfinite(g).all() for g in jax.tree.leaves(grads)]))
        updated = state.apply_gradients(grads=grads)
        new = jax.tree.map(lambda a, b: jnp.where(finite, a, b), updated, state)
        return new.replace(loss_scale=state.loss_scale.adjust(finite))

    return step


@pytest.mark.parametrize("poison", [False, True], ids=["finite", "inf-in-replica-0"])
def test_loss_scaling_matches_single_device(strategy, n, poison):
    loss_fn, state = _fp16_setup(2.0**10)
    step = recipes.make_loss_scaled_train_step(loss_fn, strategy=strategy)
    oracle_step = _oracle_loss_scaled_step(loss_fn)
    placed, oracle = strategy.mirror(state), state
    for i, batch in enumerate(_batches(3, 4 * n, seed=6)):
        if poison and i == 1:
            batch["x"][0, 0] = np.inf  # only replica 0's shard overflows
        placed, _ = step(placed, _split(n, batch))
        oracle = oracle_step(oracle, batch)
    for leaf in jax.tree.leaves(placed):  # every replica took the same decision
        assert strategy.topology.is_mirrored(leaf)
    read = strategy.read(placed)
    # growth_interval=2: finite steps double the scale every second step; a skip halves it.
    expected_scale = 2.0**10 * (0.5 if poison else 2.0)
    assert float(read.loss_scale.scale) == float(oracle.loss_scale.scale) == expected_scale
    assert int(read.step) == int(oracle.step) == (2 if poison else 3)
    _assert_trees_close(read.params, oracle.params, rtol=1e-3, atol=1e-4)


def test_loss_scale_overflow_skips_update(strategy, n):
    loss_fn, state = _fp16_setup(2.0**24)  # scaled float16 cotangents overflow
    step = recipes.make_loss_scaled_train_step(loss_fn, strategy=strategy)
    placed = strategy.mirror(state)
    new, _ = step(placed, _split(n, _batches(1, 2 * n, seed=7)[0]))
    read = strategy.read(new)
    assert float(read.loss_scale.scale) == 2.0**23 and int(read.step) == 0
    _assert_trees_close(read.params, state.params, rtol=0, atol=0)


def test_unagreed_finite_flag_diverges(strategy, n):
    """Without all_reduce(MIN) of the flag, the proof sees that replicas may diverge."""
    if n == 1:
        pytest.skip("one replica cannot diverge")

    @jm.replicate(strategy=strategy)
    def step(w, x):
        grad = jax.grad(lambda w: jnp.mean(w * x))(w)
        finite_here = jnp.isfinite(grad)  # this replica's verdict only
        return jnp.where(finite_here, w - jm.all_reduce("mean", grad), w)

    assert isinstance(step(jnp.ones(()), jm.PerReplica(np.ones((n, 2), np.float32))), jm.PerReplica)


def test_dynamic_loss_scale_grows_and_floors():
    scale = recipes.DynamicLossScale.create(2.0, growth_interval=2)
    scale = scale.adjust(True)
    assert float(scale.scale) == 2.0 and int(scale.good_steps) == 1
    scale = scale.adjust(True)
    assert float(scale.scale) == 4.0 and int(scale.good_steps) == 0
    for _ in range(5):
        scale = scale.adjust(False)
    assert float(scale.scale) == 1.0
    with pytest.raises(ValueError, match="factor"):
        recipes.DynamicLossScale.create(factor=1.0)
