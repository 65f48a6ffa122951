"""jm.checkpoint with replicas spanning several devices.

A checkpoint saved with `devices_per_replica=2` (a regex layout, an NNX model with
`nnx.with_partitioning`, `jm.shard_update` state split over the replica and model axes)
restores onto k = 1, 2 and 4 and onto another replica count: the values bitwise as saved
(oracle: `np.asarray` of the saved state), each leaf laid out by the restoring strategy's rules,
and training goes on there without another compile, equal to the k = 1 run.
"""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jmirror as jm

pytestmark = pytest.mark.skipif(
    len(jax.devices()) < 8,
    reason="replicas spanning several devices need 8 host devices (JMIRROR_TEST_DEVICES=8)",
)

KERNEL = P(None, "model")
LAYOUT = [("kernel", KERNEL)]
SPANS = (1, 2, 4)


def _spanning(k: int, devices=None, **kwargs) -> jm.MirroredStrategy:
    return jm.MirroredStrategy(devices, devices_per_replica=k, layout=LAYOUT, **kwargs)


def _params() -> dict:
    rng = np.random.default_rng(0)
    return {
        "dense": {
            "kernel": rng.standard_normal((4, 8)).astype(np.float32),
            "bias": rng.standard_normal(8).astype(np.float32),
        },
        "head": {"kernel": rng.standard_normal((8, 4)).astype(np.float32)},
    }


def _host(tree):
    return jax.tree.map(np.asarray, tree)


def _assert_bitwise(got, want):
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves)
    for a, b in zip(got_leaves, want_leaves):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert np.asarray(a).dtype == np.asarray(b).dtype


def _assert_laid_out(x, strategy, split: bool):
    """`x` is mirrored on `strategy`, split over its model axis (by columns) when `split`."""
    k = strategy.devices_per_replica
    assert x.sharding.device_set == set(strategy.devices)
    if split and k > 1:
        assert x.sharding == NamedSharding(strategy.mesh, KERNEL)
        assert x.addressable_shards[0].data.shape == (x.shape[0], x.shape[1] // k)
    else:
        assert x.sharding.is_fully_replicated
        assert x.addressable_shards[0].data.shape == x.shape


def _disk_bytes(path) -> int:
    return sum(f.stat().st_size for f in pathlib.Path(path).rglob("*") if f.is_file())


def _step(strategy):
    @jm.replicate(strategy=strategy)
    def step(params, x):
        def loss(p):
            h = jnp.tanh(x @ p["dense"]["kernel"] + p["dense"]["bias"])
            return jnp.mean((h @ p["head"]["kernel"]) ** 2)

        grads = jm.all_reduce("mean", jax.grad(loss)(params))
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    return step


def _batch(strategy, seed=1):
    x = np.random.default_rng(seed).standard_normal((16, 4)).astype(np.float32)
    return jm.PerReplica(x.reshape(strategy.num_replicas, -1, 4))


def _trained_at_two():
    """The k = 2 state after two steps, and its value."""
    strategy = _spanning(2)
    step = _step(strategy)
    params = strategy.mirror(_params())
    for seed in (1, 2):
        params = step(params, _batch(strategy, seed))
    state = {"params": params, "step": np.int32(2), "lr": 0.1}
    return strategy, state, _host(state)


# --- mirrored leaves laid out over the model axis -----------------------------------------------


def test_a_laid_out_leaf_is_saved_once(tmp_path):
    strategy, state, _ = _trained_at_two()
    assert not state["params"]["dense"]["kernel"].is_fully_replicated
    jm.checkpoint.save(tmp_path / "c", state, strategy=strategy)
    one_copy = sum(x.nbytes for x in jax.tree.leaves(_params()))
    assert _disk_bytes(tmp_path / "c") <= one_copy + 64 * 1024


@pytest.mark.parametrize("k", SPANS)
@pytest.mark.parametrize("with_target", [False, True], ids=["no-target", "target"])
def test_a_checkpoint_saved_at_two_restores_at_k_laid_out_by_its_rules(tmp_path, k, with_target):
    strategy, state, saved = _trained_at_two()
    jm.checkpoint.save(tmp_path / "c", state, strategy=strategy)
    other = _spanning(k)
    target = state if with_target else None  # the k = 2 state itself serves as target
    restored = jm.checkpoint.restore(tmp_path / "c", target, strategy=other)
    _assert_bitwise(restored, saved)
    params = restored["params"]
    _assert_laid_out(params["dense"]["kernel"], other, split=True)
    _assert_laid_out(params["head"]["kernel"], other, split=True)
    _assert_laid_out(params["dense"]["bias"], other, split=False)
    assert restored["step"] == 2 and isinstance(restored["lr"], float)


def test_a_checkpoint_restores_onto_another_replica_count(tmp_path):
    strategy, state, saved = _trained_at_two()
    jm.checkpoint.save(tmp_path / "c", state, strategy=strategy)
    for devices, k in ((jax.devices()[:4], 2), (jax.devices()[:4], 4), (jax.devices()[:2], 1)):
        other = _spanning(k, devices)
        restored = jm.checkpoint.restore(tmp_path / "c", strategy=other)
        _assert_bitwise(restored, saved)
        _assert_laid_out(restored["params"]["dense"]["kernel"], other, split=True)


def test_a_checkpoint_saved_at_one_restores_laid_out(tmp_path):
    one = jm.MirroredStrategy()
    state = {"params": one.mirror(_params())}
    jm.checkpoint.save(tmp_path / "c", state, strategy=one)
    two = _spanning(2)
    restored = jm.checkpoint.restore(tmp_path / "c", strategy=two)
    _assert_bitwise(restored, _host(state))
    _assert_laid_out(restored["params"]["dense"]["kernel"], two, split=True)
    _assert_laid_out(restored["params"]["dense"]["bias"], two, split=False)


def test_a_callable_layout_sees_the_restored_path(tmp_path):
    seen = []

    def layout(path, leaf):
        seen.append((jax.tree_util.keystr(path), tuple(np.shape(leaf))))
        return KERNEL if jax.tree_util.keystr(path).endswith("['kernel']") else None

    strategy = jm.MirroredStrategy(devices_per_replica=2, layout=layout)
    state = {"params": strategy.mirror(_params())}
    path = tmp_path / "c"
    jm.checkpoint.save(path, state, strategy=strategy)
    seen.clear()
    restored = jm.checkpoint.restore(path, strategy=strategy)
    assert ("['params']['dense']['kernel']", (4, 8)) in seen
    _assert_laid_out(restored["params"]["dense"]["kernel"], strategy, split=True)


@pytest.mark.parametrize("k", SPANS)
def test_restored_state_trains_on_at_k_without_another_layout(tmp_path, k):
    strategy, state, _ = _trained_at_two()
    jm.checkpoint.save(tmp_path / "c", state, strategy=strategy)
    other = _spanning(k)
    params = jm.checkpoint.restore(tmp_path / "c", strategy=other)["params"]
    layouts = jax.tree.map(lambda x: x.sharding, params)
    step = _step(other)
    for seed in (3, 4):
        params = step(params, _batch(other, seed))
    assert step.num_compilations == 1
    assert jax.tree.map(lambda x: x.sharding, params) == layouts  # outputs keep the layout
    # Oracle: the same steps at k = 1 from the saved values.
    one = jm.MirroredStrategy()
    expected = one.mirror(jm.checkpoint.restore(tmp_path / "c", strategy=one)["params"])
    one_step = _step(one)
    for seed in (3, 4):
        expected = one_step(expected, _batch(one, seed))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_checkpoint_manager_saves_at_two_and_restores_at_four(tmp_path):
    strategy, state, saved = _trained_at_two()
    with jm.checkpoint.CheckpointManager(tmp_path, strategy=strategy) as manager:
        assert manager.save(2, state, data={"batches": 2})
        manager.wait_until_finished()
    four = _spanning(4)
    with jm.checkpoint.CheckpointManager(tmp_path, strategy=four) as manager:
        restored = manager.restore()
        assert manager.data() == {"batches": 2}
    _assert_bitwise(restored, saved)
    _assert_laid_out(restored["params"]["dense"]["kernel"], four, split=True)
    _assert_laid_out(restored["params"]["dense"]["bias"], four, split=False)


def test_per_replica_values_at_two_restore_on_the_same_count(tmp_path):
    strategy = _spanning(2)
    ids = strategy.run(lambda: jnp.float32(jm.replica_id()))
    total = strategy.assign(strategy.sync_on_read(np.float32(0), "sum"), 6.0)
    jm.checkpoint.save(tmp_path / "c", {"ids": ids, "total": total}, strategy=strategy)
    same_n = _spanning(1, jax.devices()[:4])  # N = 4 replicas of one device
    restored = jm.checkpoint.restore(tmp_path / "c", strategy=same_n)
    assert [float(v) for v in same_n.local_results(restored["ids"])] == [0.0, 1.0, 2.0, 3.0]
    assert float(same_n.read(restored["total"])) == 6.0
    restored = jm.checkpoint.restore(tmp_path / "c", strategy=strategy)
    assert [float(v) for v in strategy.local_results(restored["ids"])] == [0.0, 1.0, 2.0, 3.0]
    assert float(strategy.read(restored["total"])) == 6.0


def test_per_replica_values_laid_out_inside_replicas_save_whole_and_restore(tmp_path):
    # A SyncOnRead ONLY_FIRST_REPLICA laid out over the model axis was saved as one device's
    # half of replica 0's value: the save succeeded and its restore raised
    # CorruptCheckpointError.
    from test_spanning import AGGREGATIONS, _laid_out_grads

    strategy, g, totals, expected = _laid_out_grads(2)
    parts = 1.0 + expected
    oracle = {"sum": parts.sum(0), "mean": parts.mean(0), "only_first_replica": parts[0]}
    saved = np.stack([np.asarray(c["w"]) for c in strategy.local_results(g)])
    jm.checkpoint.save(tmp_path / "c", {"g": g, "totals": totals}, strategy=strategy)
    same_n = _spanning(1, jax.devices()[:4])  # N = 4 replicas of one device
    for where in (strategy, same_n):
        restored = jm.checkpoint.restore(tmp_path / "c", strategy=where)
        got = np.stack([np.asarray(c["w"]) for c in where.local_results(restored["g"])])
        np.testing.assert_array_equal(got, saved)  # bitwise as saved
        np.testing.assert_allclose(got, expected, rtol=1e-5)
        for a in AGGREGATIONS:
            read = np.asarray(where.read(restored["totals"][a]))
            np.testing.assert_allclose(read, oracle[a], rtol=1e-5)


# --- what is not mirrored is still refused -------------------------------------------------------


def test_a_stacked_array_is_still_refused(tmp_path):
    strategy = _spanning(2)
    stacked = strategy.run(lambda: jnp.float32(jm.replica_id())).values
    with pytest.raises(TypeError, match=r"\['ids'\].*is not mirrored.*jm\.PerReplica"):
        jm.checkpoint.save(tmp_path / "c", {"ids": stacked}, strategy=strategy)
    assert not (tmp_path / "c").exists()


def test_a_leaf_laid_out_by_another_strategy_is_saved_as_its_whole_value(tmp_path):
    two, four = _spanning(2), _spanning(4)
    params = two.mirror(_params())
    jm.checkpoint.save(tmp_path / "c", params, strategy=four)  # a notebook re-run's state
    restored = jm.checkpoint.restore(tmp_path / "c", strategy=four)
    for got, want in zip(jax.tree.leaves(four.read(restored)), jax.tree.leaves(_params())):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# --- NNX: partitioning metadata -------------------------------------------------------------------


def _nnx_model(strategy, abstract=False):
    """The model, its kernel partitioned over the model axis (at k = 1: no partitioning, as
    flax needs a mesh for it), made for `strategy` (flax's eager sharding on its mesh)."""
    from flax import nnx

    init = nnx.initializers.lecun_normal()
    if strategy.devices_per_replica > 1:
        init = nnx.with_partitioning(init, (None, "model"))
    make = lambda: nnx.Linear(4, 8, kernel_init=init, rngs=nnx.Rngs(0))  # noqa: E731
    with strategy.scope():
        return nnx.eval_shape(make) if abstract else make()


@pytest.mark.parametrize("k", SPANS)
def test_an_nnx_model_with_partitioning_restores_at_k(tmp_path, k):
    from flax import nnx

    two = jm.MirroredStrategy(devices_per_replica=2)  # no rules: the metadata lays it out
    model = two.mirror(_nnx_model(two))
    saved = _host(nnx.state(model))
    assert model.kernel[...].sharding.spec == KERNEL
    jm.checkpoint.save(tmp_path / "c", model, strategy=two)
    other = jm.MirroredStrategy(devices_per_replica=k)
    # A target made for the restoring strategy (flax's eager sharding on its mesh), one made
    # abstractly, and the k = 2 model itself: the Variable's metadata says the layout.
    for target in (_nnx_model(other), _nnx_model(other, abstract=True), model):
        restored = jm.checkpoint.restore(tmp_path / "c", target, strategy=other)
        _assert_bitwise(nnx.state(restored), saved)
        _assert_laid_out(restored.kernel[...], other, split=True)
        _assert_laid_out(restored.bias[...], other, split=False)


# --- jm.shard_update: split over the replica and model axes ---------------------------------------


def _sharded_run(strategy, tx, params, state, seeds):
    @jm.replicate(strategy=strategy)
    def step(params, state, x):
        def loss(p):
            return jnp.mean((x @ p["dense"]["kernel"] + p["dense"]["bias"]) ** 2)

        updates, state = tx.update(jax.grad(loss)(params), state, params)
        return optax.apply_updates(params, updates), state

    for seed in seeds:
        params, state = step(params, state, _batch(strategy, seed))
    assert step.num_compilations == 1
    return params, state


def _dense(strategy):
    return strategy.mirror({"dense": _params()["dense"]})


@pytest.mark.parametrize("k", SPANS)
def test_shard_update_state_saved_at_two_restores_at_k(tmp_path, k):
    two = _spanning(2)
    tx = jm.shard_update(optax.adam(0.1))
    params = _dense(two)
    params, state = _sharded_run(two, tx, params, tx.init(params), (1, 2))
    mu = state[0].mu["dense"]["kernel"].shards
    assert mu.addressable_shards[0].data.size == 32 // 8  # 1/(N*k) per device
    saved = _host(two.read({"params": params, "opt": state}))
    jm.checkpoint.save(tmp_path / "c", {"params": params, "opt": state}, strategy=two)

    other = _spanning(k)
    fresh = _dense(other)
    target = {"params": fresh, "opt": tx.init(fresh)}
    restored = jm.checkpoint.restore(tmp_path / "c", target, strategy=other)
    _assert_bitwise(other.read(restored), saved)
    for got, want in zip(
        jax.tree.leaves(restored["opt"]), jax.tree.leaves(target["opt"]), strict=True
    ):
        assert got.sharding == want.sharding  # as tx.init lays it out at k
    node = restored["opt"][0].mu["dense"]["kernel"]
    assert isinstance(node, jm.Sharded) and node.shards.shape == (8 // k, 32 * k // 8)
    assert node.shards.addressable_shards[0].data.size == 32 // 8
    plain = jm.checkpoint.restore(tmp_path / "c", strategy=other)  # no target: sharded too
    assert plain["opt"][0]["mu"]["dense"]["kernel"].shards.sharding == node.shards.sharding

    # Training goes on at k as it does at k = 1 from the same checkpoint.
    params, state = _sharded_run(other, tx, restored["params"], restored["opt"], (3,))
    one = jm.MirroredStrategy()
    fresh = _dense(one)
    at_one = jm.checkpoint.restore(
        tmp_path / "c", {"params": fresh, "opt": tx.init(fresh)}, strategy=one
    )
    want = _sharded_run(one, tx, at_one["params"], at_one["opt"], (3,))
    for a, b in zip(jax.tree.leaves(other.read((params, state))), jax.tree.leaves(one.read(want))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("order", ["reversed", "pairs swapped"])
def test_a_value_laid_out_in_another_device_order_reads_and_saves_whole(tmp_path, order):
    devices = jax.devices()
    if order == "reversed":
        devices = devices[::-1]
    else:
        devices = [d for pair in zip(devices[1::2], devices[::2]) for d in pair]
    layout = [(r"w", P(None, "model"))]
    w = np.arange(32, dtype=np.float32).reshape(4, 8)
    laid_out = jm.MirroredStrategy(devices_per_replica=2, layout=layout).mirror({"w": w})
    other = jm.MirroredStrategy(devices, devices_per_replica=2, layout=layout)
    np.testing.assert_array_equal(other.read(laid_out)["w"], w)
    for copy in other.local_results(laid_out):
        np.testing.assert_array_equal(copy["w"], w)
    jm.checkpoint.save(tmp_path / "c", laid_out, strategy=other)
    np.testing.assert_array_equal(jm.checkpoint.restore(tmp_path / "c", strategy=other)["w"], w)


def test_a_value_mirrored_over_other_devices_saves(tmp_path):
    w = np.arange(8, dtype=np.float32)
    elsewhere = jm.MirroredStrategy(jax.devices()[4:]).mirror({"w": w})
    for strategy in (jm.MirroredStrategy(), jm.MirroredStrategy(devices_per_replica=2)):
        jm.checkpoint.save(tmp_path / str(strategy.num_replicas), elsewhere, strategy=strategy)
        back = jm.checkpoint.restore(tmp_path / str(strategy.num_replicas), strategy=strategy)
        np.testing.assert_array_equal(strategy.read(back)["w"], w)
