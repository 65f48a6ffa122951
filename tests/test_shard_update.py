"""jm.shard_update against the mirrored update of the mean gradient."""

import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmirror as jm
import jmirror.testing as jmt

HERE = Path(__file__).parent / "multiprocess"

# Sizes that are not multiples of 8 (nor of 4): every leaf is padded on 8 and on 4 replicas.
SHAPES = {"w1": (7, 3), "b1": (3,), "w2": (3, 5), "b2": (5,), "scale": (13,)}

TRANSFORMS = {
    "sgd_momentum": lambda: optax.sgd(0.05, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "clip_adam": lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2)),
    "lamb": lambda: optax.lamb(1e-2),
    "lars": lambda: optax.lars(1e-2),
}


def init_params(seed=0):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def loss_fn(params, x):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    out = h @ params["w2"] + params["b2"]
    return jnp.mean(out**2) + 0.01 * jnp.sum(params["scale"] ** 2) * jnp.mean(x)


def batch(strategy, seed=1):
    n = strategy.num_replicas
    x = np.random.default_rng(seed).standard_normal((n, 4, 7)).astype(np.float32)
    return jm.PerReplica(x)


def sharded_step(strategy, tx, **kwargs):
    @jm.replicate(strategy=strategy, **kwargs)
    def step(params, state, x):
        grads = jax.grad(loss_fn)(params, x)  # this replica's own gradients
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def mirrored_step(strategy, inner):
    @jm.replicate(strategy=strategy)
    def step(params, state, x):
        grads = jm.all_reduce("mean", jax.grad(loss_fn)(params, x))
        updates, state = inner.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        if np.issubdtype(x.dtype, np.inexact):
            np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)
        else:
            np.testing.assert_array_equal(x, y)


def train_both(strategy, make, steps=8):
    inner = make()
    tx = jm.shard_update(make(), strategy=strategy)
    params = strategy.mirror(init_params())
    state = tx.init(params)
    oracle_params, oracle_state = strategy.mirror((init_params(), inner.init(init_params())))
    step, oracle = sharded_step(strategy, tx), mirrored_step(strategy, inner)
    x = batch(strategy)
    for _ in range(steps):
        params, state = step(params, state, x)
        oracle_params, oracle_state = oracle(oracle_params, oracle_state, x)
    return (params, state), (oracle_params, oracle_state)


# Transformations with a `cond` on a whole (mirrored) value, and others beyond the brief's list.
MORE = {
    "multi_steps_adam": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=3),
    "apply_if_finite_adam": lambda: optax.apply_if_finite(optax.adam(1e-2), 2),
    "novograd": lambda: optax.novograd(1e-2),
    "adafactor": lambda: optax.adafactor(1e-2),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2),
}


@pytest.mark.parametrize("name", sorted(TRANSFORMS) + sorted(MORE))
def test_eight_steps_equal_the_mirrored_update(strategy, name):
    make = TRANSFORMS.get(name) or MORE[name]
    (params, state), (oracle_params, oracle_state) = train_both(strategy, make)
    jmt.assert_mirrored(params, strategy)
    assert_trees_close(strategy.read(params), strategy.read(oracle_params))
    assert_trees_close(strategy.read(state), strategy.read(oracle_state))


def test_state_is_sharded_and_counts_mirrored(strategy, n):
    tx = jm.shard_update(optax.adam(1e-2))
    state = tx.init(strategy.mirror(init_params()))
    adam = state[0]
    for key, shape in SHAPES.items():
        node = adam.mu[key]
        assert isinstance(node, jm.Sharded) and node.shape == shape
        k = -(-int(np.prod(shape)) // n)
        assert node.shards.shape == (n, k)
        assert node.shards.sharding.is_equivalent_to(strategy.topology.stacked, 2)
    jmt.assert_mirrored(adam.count, strategy)
    assert_trees_close(strategy.read(state), optax.adam(1e-2).init(init_params()))


def bytes_on(tree, device):
    total = 0
    for leaf in jax.tree.leaves(tree):
        total += sum(s.data.nbytes for s in leaf.addressable_shards if s.device == device)
    return total


@pytest.mark.parametrize("name", ["adam", "lamb", "clip_adam"])
def test_optimizer_bytes_per_device_are_one_nth_plus_padding(strategy, n, name):
    (_, state), (_, oracle_state) = train_both(strategy, TRANSFORMS[name], steps=1)
    device = strategy.devices[0]
    mirrored = bytes_on(oracle_state, device)
    nodes = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, jm.Sharded))
    sharded = [x for x in nodes if isinstance(x, jm.Sharded)]
    scalars = sum(x.nbytes for x in nodes if not isinstance(x, jm.Sharded))
    array_bytes = sum(x.size * x.dtype.itemsize for x in sharded)
    padding = sum((n - 1) * x.dtype.itemsize for x in sharded)
    assert sharded and mirrored == array_bytes + scalars
    assert bytes_on(state, device) <= array_bytes / n + padding + scalars


@pytest.mark.parametrize("name", ["adam", "clip_adam", "lamb"])
def test_step_has_one_reduce_scatter_and_one_all_gather_and_no_gradient_all_reduce(
    strategy, n, name
):
    tx = jm.shard_update(TRANSFORMS[name]())  # the default buckets: this tree fills one
    params = strategy.mirror(init_params())
    state = tx.init(params)
    ops = jmt.collectives(sharded_step(strategy, tx).lower(params, state, batch(strategy)))
    if n == 1:
        return  # XLA removes the collectives of one replica
    param_bytes = sum(int(np.prod(s)) * 4 for s in SHAPES.values())
    padded = sum(-(-int(np.prod(s)) // n) * n * 4 for s in SHAPES.values())
    kinds = [c.op for c in ops]
    assert kinds.count("reduce-scatter") == 1 and kinds.count("all-gather") == 1
    (scatter,) = [c for c in ops if c.op == "reduce-scatter"]
    (gather,) = [c for c in ops if c.op == "all-gather"]
    assert scatter.bytes == padded // n and gather.bytes == padded
    # Norms and trust ratios need scalar all-reduces only: nothing of the gradients' size.
    assert all(c.bytes <= 64 for c in ops if c.op == "all-reduce")
    assert padded < param_bytes + 8 * len(SHAPES) * n


@pytest.mark.parametrize("bucket_bytes", ["default", None])
def test_one_buffer_per_dtype(strategy, n, bucket_bytes):
    # Both 4 MiB buckets (the default: a tree this small fills one per dtype) and None.
    kwargs = {} if bucket_bytes == "default" else {"bucket_bytes": bucket_bytes}
    tx = jm.shard_update(optax.sgd(0.1, momentum=0.9), **kwargs)
    params = strategy.mirror({"a": np.ones(9, np.float32), "b": np.ones((3, 3), jnp.bfloat16)})
    state = tx.init(params)

    @jm.replicate(strategy=strategy)
    def step(params, state):
        grads = jax.tree.map(lambda p: p * (jm.replica_id() + 1).astype(p.dtype), params)
        updates, state = tx.update(grads, state, params)
        return updates, state

    ops = [c.op for c in jmt.collectives(step.lower(params, state))]
    if n > 1:
        assert ops.count("reduce-scatter") == 2 and ops.count("all-gather") == 2
    updates, _ = step(params, state)
    mean = (n + 1) / 2
    np.testing.assert_allclose(np.asarray(strategy.read(updates)["a"]), -0.1 * mean, rtol=1e-6)
    b = np.asarray(strategy.read(updates)["b"], np.float32)
    np.testing.assert_allclose(b, -0.1 * mean, rtol=2e-2)


def test_buckets_lower_the_step_s_temporaries(strategy, n):
    # A 4-layer MLP of four 256 x 256 kernels (P bytes of parameters). One buffer per dtype
    # is a concatenation of every gradient, which XLA holds beside them; buckets of one
    # kernel each are reduced as their gradients are produced (README: what it costs).
    if n == 1:
        pytest.skip("one replica packs nothing")
    rng = np.random.default_rng(0)
    shapes = {f"w{i}": (256, 256) for i in range(4)} | {f"b{i}": (256,) for i in range(4)}
    params = strategy.mirror(
        {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    )
    param_bytes = sum(int(np.prod(s)) * 4 for s in shapes.values())
    x = jm.PerReplica(rng.standard_normal((n, 8, 256)).astype(np.float32))

    def deep_loss(params, x):
        for i in range(4):
            x = jnp.tanh(x @ params[f"w{i}"] + params[f"b{i}"])
        return jnp.mean(x**2)

    def temporaries(bucket_bytes):
        tx = jm.shard_update(optax.adam(1e-3), strategy=strategy, bucket_bytes=bucket_bytes)

        @jm.replicate(strategy=strategy, donate_argnums=(0, 1))
        def step(params, state, x):
            updates, state = tx.update(jax.grad(deep_loss)(params, x), state, params)
            return optax.apply_updates(params, updates), state

        compiled = step.lower(params, tx.init(params), x).compile()
        return compiled.memory_analysis().temp_size_in_bytes / param_bytes

    one_buffer, buckets = temporaries(None), temporaries(256 * 256 * 4)
    assert buckets < 1.6 and buckets < one_buffer - 0.3, (buckets, one_buffer)


MIB = 2**20


@pytest.mark.parametrize(
    "kwargs,expected",
    [({}, 3), ({"bucket_bytes": 4 * MIB}, 3), ({"bucket_bytes": None}, 1)],
    ids=["default", "4MiB", "None"],
)
def test_default_packs_the_gradients_into_buckets_of_4_mib(strategy, n, kwargs, expected):
    # Five float32 gradients of 1.5 MiB and one of 12 bytes: in tree order [a, b], [c, d],
    # [e, f] by default (a third 1.5 MiB would pass 4 MiB); None keeps one buffer.
    rng = np.random.default_rng(0)
    shapes = {k: (384, 1024) for k in "abcde"} | {"f": (3,)}
    host = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    inner = optax.sgd(0.1, momentum=0.9)
    tx = jm.shard_update(optax.sgd(0.1, momentum=0.9), **kwargs)
    params = strategy.mirror(host)
    state, oracle_state = tx.init(params), strategy.mirror(inner.init(host))

    def grads_of(params):
        return jax.tree.map(lambda p: p * (jm.replica_id() + 1).astype(p.dtype), params)

    @jm.replicate(strategy=strategy)
    def step(params, state):
        return tx.update(grads_of(params), state, params)

    @jm.replicate(strategy=strategy)
    def oracle(params, oracle_state):
        return inner.update(jm.all_reduce("mean", grads_of(params)), oracle_state)

    if n > 1:
        ops = jmt.collectives(step.lower(params, state))
        scatters = [c.bytes for c in ops if c.op == "reduce-scatter"]
        gathers = [c.bytes for c in ops if c.op == "all-gather"]
        total = sum(-(-x.size // n) * n * 4 for x in host.values())
        assert len(scatters) == len(gathers) == expected, ops
        assert sum(scatters) == total // n and sum(gathers) == total
        assert not [c for c in ops if c.op == "all-reduce"], ops
    for _ in range(2):
        updates, state = step(params, state)
        oracle_updates, oracle_state = oracle(params, oracle_state)
        assert_trees_close(strategy.read(updates), strategy.read(oracle_updates))
        assert_trees_close(strategy.read(state), strategy.read(oracle_state))


def test_buckets_give_the_same_update_with_one_collective_pair_per_bucket(strategy, n):
    # In tree order b1, b2, scale, w1, w2 have 12, 20, 52, 84 and 60 bytes; buckets of at
    # most 100 bytes hold [b1, b2, scale], [w1], [w2]: three reduce-scatters, three gathers.
    make = TRANSFORMS["clip_adam"]
    tx = jm.shard_update(make(), strategy=strategy, bucket_bytes=100)
    params = strategy.mirror(init_params())
    state = tx.init(params)
    step = sharded_step(strategy, tx)
    if n > 1:
        kinds = [c.op for c in jmt.collectives(step.lower(params, state, batch(strategy)))]
        assert kinds.count("reduce-scatter") == 3 and kinds.count("all-gather") == 3
    inner = make()
    oracle_params, oracle_state = strategy.mirror((init_params(), inner.init(init_params())))
    oracle = mirrored_step(strategy, inner)
    for _ in range(3):
        params, state = step(params, state, batch(strategy))
        oracle_params, oracle_state = oracle(oracle_params, oracle_state, batch(strategy))
    assert_trees_close(strategy.read(params), strategy.read(oracle_params))
    assert_trees_close(strategy.read(state), strategy.read(oracle_state))


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1MB"])
def test_bucket_bytes_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match=r"bucket_bytes=.*positive int"):
        jm.shard_update(optax.adam(1e-2), bucket_bytes=bad)


def test_something_else_than_a_transformation_is_a_type_error():
    with pytest.raises(TypeError, match=r"optax.GradientTransformation.*jm.shard_update\(optax"):
        jm.shard_update(optax.adam)


def test_donated_state_and_params(strategy):
    make = TRANSFORMS["adam"]
    tx, inner = jm.shard_update(make()), make()
    params = strategy.mirror(init_params())
    state = tx.init(params)
    step = sharded_step(strategy, tx, donate_argnums=(0, 1))
    oracle = mirrored_step(strategy, inner)
    oracle_params, oracle_state = strategy.mirror((init_params(), inner.init(init_params())))
    x = batch(strategy)
    for _ in range(3):
        old = jax.tree.leaves(state)[1]
        params, state = step(params, state, x)
        oracle_params, oracle_state = oracle(oracle_params, oracle_state, x)
        assert old.is_deleted()
    assert_trees_close(strategy.read(params), strategy.read(oracle_params))
    assert_trees_close(strategy.read(state), strategy.read(oracle_state))


def test_init_inside_a_replica_function_gives_the_same_state(strategy):
    tx = jm.shard_update(optax.adam(1e-2))
    params = strategy.mirror(init_params())
    inside = jm.replicate(tx.init, strategy=strategy)(params)
    outside = tx.init(params)
    assert jax.tree.structure(inside) == jax.tree.structure(outside)
    assert_trees_close(strategy.read(inside), strategy.read(outside))


def test_init_shards_over_the_devices_the_params_are_mirrored_on(n):
    if n < 4:
        pytest.skip("needs 4 devices")
    four = jm.MirroredStrategy(num_devices=4)
    state = jm.shard_update(optax.adam(1e-2)).init(four.mirror(init_params()))  # no strategy=
    node = state[0].mu["w1"]
    assert node.shards.shape == (4, 6) and node.shards.sharding == four.topology.stacked
    (params, state), (oracle_params, _) = train_both(four, TRANSFORMS["adam"], steps=2)
    assert_trees_close(four.read(params), four.read(oracle_params))


def test_mirror_keeps_sharded_state(strategy):
    tx = jm.shard_update(optax.adam(1e-2))
    params = init_params()
    state = tx.init(params)  # host params are mirrored first
    params2, state2 = strategy.mirror((params, state))
    assert state2[0].mu["w1"].shards is state[0].mu["w1"].shards
    jmt.assert_mirrored(params2, strategy)


def test_checkpoint_saved_on_all_replicas_restores_on_four(strategy, n, tmp_path):
    if n < 4:
        pytest.skip("restores onto 4 replicas")
    (params, state), _ = train_both(strategy, TRANSFORMS["lamb"], steps=2)
    saved = strategy.read((params, state))
    jm.checkpoint.save(tmp_path / "c", {"params": params, "opt": state}, strategy=strategy)
    four = jm.MirroredStrategy(num_devices=4, backend=strategy.backend)
    target = {"params": params, "opt": state}  # the 8-replica state serves as target
    restored = jm.checkpoint.restore(tmp_path / "c", target=target, strategy=four)
    plain = jm.checkpoint.restore(tmp_path / "c", strategy=four)  # no target: plain dicts
    assert isinstance(plain["opt"][0]["mu"]["w1"], jm.Sharded)
    node = restored["opt"][0].mu["w1"]
    assert isinstance(node, jm.Sharded) and node.shards.shape == (4, 6)
    assert_trees_close(four.read((restored["params"], restored["opt"])), saved, rtol=0, atol=0)
    # Training goes on on four replicas as the mirrored update does there.
    inner, tx = TRANSFORMS["lamb"](), jm.shard_update(TRANSFORMS["lamb"]())
    x = batch(four)
    p, s = sharded_step(four, tx)(restored["params"], restored["opt"], x)
    oracle_p, oracle_s = mirrored_step(four, inner)(*four.mirror(saved), x)
    assert_trees_close(four.read(p), four.read(oracle_p))
    assert_trees_close(four.read(s), four.read(oracle_s))


def test_checkpoint_target_chooses_sharded_or_mirrored(strategy, tmp_path):
    inner, tx = optax.adam(1e-2), jm.shard_update(optax.adam(1e-2))
    mirrored_state = strategy.mirror(inner.init(init_params()))
    sharded_state = tx.init(init_params())
    jm.checkpoint.save(tmp_path / "m", mirrored_state, strategy=strategy)
    jm.checkpoint.save(tmp_path / "s", sharded_state, strategy=strategy)
    as_sharded = jm.checkpoint.restore(tmp_path / "m", target=sharded_state, strategy=strategy)
    as_mirrored = jm.checkpoint.restore(tmp_path / "s", target=mirrored_state, strategy=strategy)
    assert isinstance(as_sharded[0].mu["w1"], jm.Sharded)
    jmt.assert_mirrored(as_mirrored, strategy)
    assert_trees_close(strategy.read(as_sharded), strategy.read(mirrored_state), 0, 0)
    assert_trees_close(strategy.read(as_mirrored), strategy.read(mirrored_state), 0, 0)


def test_a_step_with_a_non_finite_gradient_is_skipped_as_unsharded(strategy, n):
    make = MORE["apply_if_finite_adam"]
    inner, tx = make(), jm.shard_update(make(), strategy=strategy)
    params = strategy.mirror(init_params())
    state, oracle_state = tx.init(params), strategy.mirror(inner.init(init_params()))

    @jm.replicate(strategy=strategy)
    def both(params, state, oracle_state, bad):
        grads = jax.tree.map(lambda p: p * jnp.where(bad, jnp.inf, 1.0), params)
        grads = jax.tree.map(lambda g: g * (jm.replica_id() + 1), grads)
        updates, state = tx.update(grads, state, params)
        mean = jm.all_reduce("mean", grads)
        oracle_updates, oracle_state = inner.update(mean, oracle_state, params)
        return updates, state, oracle_updates, oracle_state

    # The last replica's gradient is infinite in the second step only.
    for bad in (False, True, False):
        flags = jm.PerReplica(np.array([bad and i == n - 1 for i in range(n)]))
        updates, state, oracle_updates, oracle_state = both(params, state, oracle_state, flags)
        assert_trees_close(strategy.read(updates), strategy.read(oracle_updates))
        assert_trees_close(strategy.read(state), strategy.read(oracle_state))
    assert int(strategy.read(state).notfinite_count) == 0
    assert int(strategy.read(state).total_notfinite) == 1


def test_checkpoint_manager_saves_asynchronously_and_restores_sharded(strategy, tmp_path):
    (params, state), _ = train_both(strategy, TRANSFORMS["adamw"], steps=2)
    saved = strategy.read(state)
    with jm.checkpoint.CheckpointManager(tmp_path, strategy=strategy) as manager:
        manager.save(2, {"opt": state})
        manager.wait_until_finished()
        restored = manager.restore(2, target={"opt": state})["opt"]
    assert isinstance(
        jax.tree.leaves(restored, is_leaf=lambda x: isinstance(x, jm.Sharded))[1], jm.Sharded
    )
    assert_trees_close(strategy.read(restored), saved, 0, 0)


@jax.custom_vjp
def _twice(x):
    return 2.0 * x


_twice.defvjp(lambda x: (2.0 * x, None), lambda _, g: (2.0 * g,))


def _calls_and_reductions():
    """An update through jit, custom_jvp (relu), custom_vjp, remat and closed_call, with a
    global norm, a max, a min, a vdot and a reshape of sharded values."""

    @jax.jit
    def scaled(g):
        return jax.nn.relu(g) - 0.5 * jax.nn.relu(-g)

    def update(updates, state, params=None):
        updates = jax.tree.map(lambda g: jax.checkpoint(_twice)(scaled(g)), updates)
        norm = optax.tree.norm(updates)
        peak = jnp.max(jnp.stack([jnp.max(jnp.abs(g)) for g in jax.tree.leaves(updates)]))
        low = jnp.min(jnp.stack([jnp.min(g.reshape(-1)) for g in jax.tree.leaves(updates)]))
        dot = sum(jnp.vdot(g, p) for g, p in zip(jax.tree.leaves(updates), jax.tree.leaves(params)))
        factor = jax.jit(lambda a, b, c, d: a / (b + 1.0) + 0.01 * c + 0.001 * d)(
            1.0, norm, low, dot / (peak + 1.0)
        )
        return jax.tree.map(lambda g: -0.01 * factor * g, updates), state

    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


def test_calls_and_whole_leaf_reductions_are_followed_exactly(strategy):
    (params, _), (oracle_params, _) = train_both(strategy, _calls_and_reductions, steps=3)
    assert_trees_close(strategy.read(params), strategy.read(oracle_params))


class _Refused:
    """Transformations whose update mixes elements across positions of a leaf."""

    @staticmethod
    def sort():
        return optax.GradientTransformation(
            lambda p: optax.EmptyState(), lambda u, s, p=None: (jax.tree.map(jnp.sort, u), s)
        )

    @staticmethod
    def partial_sum():
        def update(u, s, p=None):
            return jax.tree.map(lambda g: g / jnp.sum(g, axis=0, keepdims=True), u), s

        return optax.GradientTransformation(lambda p: optax.EmptyState(), update)

    @staticmethod
    def cumsum():
        return optax.GradientTransformation(
            lambda p: optax.EmptyState(),
            lambda u, s, p=None: (jax.tree.map(lambda g: jnp.cumsum(g.ravel()), u), s),
        )


@pytest.mark.parametrize(
    "make,primitive",
    [(_Refused.sort, "sort"), (_Refused.partial_sum, "reduce_sum"), (_Refused.cumsum, "cum")],
)
def test_refused_transform_names_the_primitive_and_the_transform(strategy, make, primitive):
    tx = jm.shard_update(optax.chain(optax.scale(0.5), make()))
    params = strategy.mirror({"w": np.ones((6, 3), np.float32)})
    state = tx.init(params)

    @jm.replicate(strategy=strategy)
    def step(params, state):
        return tx.update(params, state, params)

    with pytest.raises(ValueError, match=rf"jm\.shard_update\(chain.*`{primitive}"):
        step(params, state)


def test_update_outside_a_replica_function_is_a_runtime_error(strategy):
    tx = jm.shard_update(optax.adam(1e-2))
    params = strategy.mirror(init_params())
    state = tx.init(params)
    with pytest.raises(RuntimeError, match="inside the function given to jm.replicate"):
        tx.update(params, state, params)


def test_state_of_another_replica_count_is_a_value_error(strategy, n):
    if n == 1:
        pytest.skip("needs another replica count")
    tx = jm.shard_update(optax.adam(1e-2))
    params = strategy.mirror(init_params())
    one = jm.MirroredStrategy(num_devices=1, backend=strategy.backend)
    state = jm.shard_update(optax.adam(1e-2), strategy=one).init(init_params())
    stacked = jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape[1:]), state)
    with pytest.raises(ValueError, match=r"another replica count.*checkpoint"):
        sharded_step(strategy, tx)(strategy.mirror(params), stacked, batch(strategy))


def test_state_cut_for_another_replica_count_names_the_leaf_and_the_fix(strategy, n):
    if n == 1:
        pytest.skip("needs another replica count")
    one = jm.MirroredStrategy(num_devices=1, backend=strategy.backend)
    state = jm.shard_update(optax.adam(1e-2), strategy=one).init(init_params())
    tx = jm.shard_update(optax.adam(1e-2), strategy=strategy)
    params = strategy.mirror(init_params())
    with pytest.raises(ValueError, match=r"jm.Sharded state leaf at args\[1\].*checkpoint"):
        sharded_step(strategy, tx)(params, state, batch(strategy))


def test_emulated_strategy_gives_the_same_result():
    strategy = jmt.EmulatedStrategy(4)
    (params, state), (oracle_params, oracle_state) = train_both(strategy, TRANSFORMS["lamb"], 3)
    assert_trees_close(strategy.read(params), strategy.read(oracle_params))
    assert_trees_close(strategy.read(state), strategy.read(oracle_state))


@pytest.mark.skipif(
    os.environ.get("JMIRROR_TEST_DEVICES", "8") != "8" or len(jax.devices()) != 8,
    reason="starts processes: runs once, in the 8-device pass",
)
def test_two_processes_of_four_devices_train_like_the_mirrored_update(tmp_path):
    sys.path.insert(0, str(HERE))
    import harness
    from training import batches, init_state
    from training import loss_fn as mlp_loss

    seen = harness.two_by_four(HERE / "shard_worker.py", tmp_path, out=tmp_path)
    strategy = jm.MirroredStrategy()
    inner = optax.lamb(1e-2)

    @jm.replicate(strategy=strategy)
    def oracle_step(params, opt_state, batch):
        grads = jm.all_reduce("mean", jax.grad(mlp_loss)(params, *batch))
        updates, opt_state = inner.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params = init_state()[0]
    params, opt_state = strategy.mirror((params, inner.init(params)))
    for b in strategy.distribute_dataset(list(batches(8)), remainder="drop"):
        params, opt_state = oracle_step(params, opt_state, b)
    oracle = [np.asarray(x) for x in jax.tree.leaves(strategy.read((params, opt_state)))]
    tx = jm.shard_update(optax.lamb(1e-2), strategy=strategy)
    target = {"params": params, "opt": tx.init(params)}
    for backend in ("pmap", "shard_map"):
        for process in seen:
            got = [process[f"{backend}/{i}"] for i in range(len(oracle))]
            for a, b in zip(got, oracle):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        # The checkpoint of 2 x 4 restores sharded on 1 x 8, equal to what was read there.
        restored = jm.checkpoint.restore(tmp_path / backend, target=target, strategy=strategy)
        again = jax.tree.leaves(strategy.read((restored["params"], restored["opt"])))
        for a, b in zip(again, [seen[0][f"{backend}/{i}"] for i in range(len(oracle))]):
            np.testing.assert_array_equal(np.asarray(a), b)


# --- the layout of the pieces: row-major at k = 1, in device blocks at k > 1 -----------------

LAYOUT_SHAPES = [(7, 3), (13,), (12, 5), (5, 12), (6, 4), (3, 4, 6), (2, 3, 5)]


@pytest.mark.parametrize("shape", LAYOUT_SHAPES)
@pytest.mark.parametrize("n, k", [(8, 1), (4, 1), (4, 2), (2, 4), (3, 2), (1, 4)])
def test_pieces_in_device_blocks_round_trip_and_mask_exactly_the_padding(shape, n, k):
    from jmirror import _host_ops, _shard_jaxpr
    from jmirror._shard_update import stack
    from jmirror.checkpoint import _sharded

    x = np.arange(1, 1 + int(np.prod(shape)), dtype=np.float32).reshape(shape)
    lay = _shard_jaxpr.layout(shape, n, k)
    pieces = np.asarray(stack(jnp.asarray(x), n, k))
    assert pieces.shape == (n, lay.length)
    np.testing.assert_array_equal(_sharded.pieces(x, n, k), pieces)  # restore cuts the same
    np.testing.assert_array_equal(np.asarray(_host_ops.unshard(shape, k)(pieces)), x)
    assert sorted(pieces[pieces != 0].tolist()) == sorted(x.ravel().tolist())  # each once
    if lay.blocks == 1:  # k = 1, or no dimension k divides: the row-major cut
        want = np.pad(x.ravel(), (0, n * lay.sub - x.size)).reshape(n, lay.sub)
        np.testing.assert_array_equal(pieces, want)
    for i in range(n):
        cut = _shard_jaxpr.Pieces("r", n, jnp.int32(i), "test", k=k)
        np.testing.assert_array_equal(np.asarray(cut.take(jnp.asarray(x))), pieces[i])
        np.testing.assert_array_equal(np.asarray(cut.valid(lay)), pieces[i] != 0)


def test_pieces_in_device_blocks_follow_the_layout_of_a_split_dimension():
    from jmirror import _shard_jaxpr
    from jmirror._shard_update import stack

    x = np.arange(24, dtype=np.float32).reshape(4, 6)  # k = 2 cuts the columns: 6 % 2 == 0
    pieces = np.asarray(stack(jnp.asarray(x), 2, 2))
    lay = _shard_jaxpr.layout(x.shape, 2, 2)
    assert (lay.blocks, lay.dim, lay.sub) == (2, 1, 6)
    # Model device j holds columns 3j..3j+2; replica i's piece is the i-th half of each block.
    left, right = x[:, :3].ravel(), x[:, 3:].ravel()
    np.testing.assert_array_equal(pieces[0], np.concatenate([left[:6], right[:6]]))
    np.testing.assert_array_equal(pieces[1], np.concatenate([left[6:], right[6:]]))


def test_gradients_not_shaped_as_the_parameters_are_named(strategy):
    tx = jm.shard_update(optax.adam(1e-2))
    params = strategy.mirror({"w": np.ones((9,), np.float32), "b": np.zeros((2,), np.float32)})
    state = tx.init(params)

    def update(grads):
        return jm.replicate(lambda p, s: tx.update(grads, s, p)[0], strategy=strategy)

    wrong_shape = {"w": jnp.ones((4,)), "b": jnp.ones((2,))}
    with pytest.raises(ValueError, match=r"gradient of shape \(4,\) at \['w'\].*shape \(9,\)"):
        update(wrong_shape)(params, state)
    with pytest.raises(ValueError, match="gradients of structure"):
        update({"w": jnp.ones((9,))})(params, state)


def test_a_none_gradient_of_a_frozen_parameter_gives_the_inner_update(strategy, n):
    # optax's stateless transformations take None for a gradient (their update is None
    # there): the same as the inner transformation on the reduced gradients.
    params = {"a": np.ones((16,), np.float32), "b": np.full((5, 3), 2.0, np.float32)}
    grads = jm.PerReplica(np.linspace(0, 1, n * 16, dtype=np.float32).reshape(n, 16))
    inner = optax.chain(optax.clip(1.0), optax.sgd(0.1))
    results = []
    for tx in (inner, jm.shard_update(inner)):
        placed = strategy.mirror(params)
        state = strategy.run(tx.init, args=(placed,))

        def update(p, s, g, tx=tx):
            g = {"a": g, "b": None}
            if tx is inner:
                g = jm.all_reduce("mean", g)
            return tx.update(g, s, p)[0]

        results.append(jm.replicate(update, strategy=strategy)(placed, state, grads))
    want, got = results
    assert got["b"] is None and want["b"] is None
    np.testing.assert_allclose(strategy.read(got["a"]), strategy.read(want["a"]), rtol=1e-6)
