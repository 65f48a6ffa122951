"""MirroredStrategy: devices, scope, create_state and the cross-replica methods."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmirror as jm
import jmirror.testing as jmt

# --- devices --------------------------------------------------------------------------------


def test_default_devices_are_all_local_devices_in_order(n):
    s = jm.MirroredStrategy()
    assert s.devices == tuple(jax.local_devices())
    assert s.num_replicas == n
    assert s.axis_name == "replica"
    assert s.backend == "pmap"
    assert s.mesh.axis_names == ("replica",)
    assert list(s.mesh.devices) == list(s.devices)
    assert "MirroredStrategy(" in repr(s) and f"num_replicas={n}" in repr(s)


def test_num_devices_takes_the_first_k(n):
    s = jm.MirroredStrategy(num_devices=1)
    assert s.devices == (jax.local_devices()[0],)


@pytest.mark.parametrize(
    "spec_of",
    [
        lambda i: f"cpu:{i}",
        lambda i: f"/device:CPU:{i}",
        lambda i: f"/cpu:{i}",
        lambda i: f"CPU:{i}",
        lambda i: jax.local_devices()[i],
    ],
)
def test_device_specs_resolve_in_caller_order(spec_of, n):
    order = list(reversed(range(n)))
    s = jm.MirroredStrategy([spec_of(i) for i in order])
    assert s.devices == tuple(jax.local_devices()[i] for i in order)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(devices=[]), ["empty"]),
        (dict(devices=["cpu:0", "/cpu:0"]), ["more than once"]),
        (dict(devices=["cpu:99"]), ["'cpu:99'", "cpu:0"]),
        (dict(devices=["tpu:0"]), ["'tpu:0'"]),
        (dict(devices=["gpu-0"]), ["'gpu-0'", "form"]),
        (dict(devices=[3]), ["3", "jax.Device"]),
        (dict(num_devices=0), ["num_devices=0"]),
        (dict(num_devices=10_000), ["10000"]),
        (dict(devices=["cpu:0"], num_devices=1), ["both"]),
        (dict(backend="vmap"), ["'vmap'", "pmap", "shard_map"]),
        (dict(max_in_flight=0), ["max_in_flight=0"]),
    ],
)
def test_bad_strategy_arguments_raise_value_error(kwargs, words):
    with pytest.raises(ValueError) as info:
        jm.MirroredStrategy(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_tf_constructor_options_point_to_jmirrors():
    with pytest.raises(TypeError, match=r"'cross_device_ops'; jmirror reduces with XLA's"):
        jm.MirroredStrategy(cross_device_ops=None)
    with pytest.raises(TypeError, match=r"'devcies'\. It takes devices, num_devices"):
        jm.MirroredStrategy(devcies=None)


@pytest.mark.parametrize("bad", [True, 2.0, "2"])
def test_max_in_flight_must_be_an_int(bad):
    with pytest.raises(TypeError):
        jm.MirroredStrategy(max_in_flight=bad)


# --- scope ------------------------------------------------------------------------------------


def test_scope_is_reentrant_and_get_strategy_defaults_once():
    default = jm.get_strategy()
    assert jm.get_strategy() is default
    a, b = jm.MirroredStrategy(), jm.MirroredStrategy(num_devices=1)
    with a.scope():
        assert jm.get_strategy() is a
        with b.scope():
            assert jm.get_strategy() is b
            with b.scope():
                assert jm.get_strategy() is b
            assert jm.get_strategy() is b
        assert jm.get_strategy() is a
    assert jm.get_strategy() is default


# --- create_state / mirror / sync_on_read ----------------------------------------------------


def test_run_takes_args_as_a_tuple_or_list_and_kwargs_as_a_mapping(strategy, n):
    x = jm.PerReplica(np.arange(n, dtype=np.float32))
    double = lambda x, scale=2.0: x * scale  # noqa: E731
    for args in [(x,), [x]]:
        np.testing.assert_array_equal(strategy.gather(strategy.run(double, args)), 2 * np.arange(n))
    out = strategy.run(double, (x,), {"scale": 3.0})
    np.testing.assert_array_equal(strategy.gather(out), 3 * np.arange(n))
    with pytest.raises(
        TypeError, match=r"args=\.\.\.\) expects a tuple or list.*PerReplica.*args=\(x,\)"
    ):
        strategy.run(double, args=x)
    with pytest.raises(TypeError, match=r"kwargs=\.\.\.\) expects a dict.*of type list"):
        strategy.run(double, (x,), kwargs=[1])


def test_create_state(strategy, n):
    tree = {"w": np.arange(3.0), "b": 1.0}
    for sync in ["auto", "on_write", jm.Synchronization.ON_WRITE]:
        state = strategy.create_state(tree, synchronization=sync)
        assert strategy.topology.is_mirrored(state["w"])
        np.testing.assert_array_equal(strategy.read(state)["w"], tree["w"])
    sor = strategy.create_state(tree, synchronization="on_read", aggregation="mean")
    assert isinstance(sor, jm.SyncOnRead) and sor.aggregation is jm.Aggregation.MEAN
    assert sor.value["w"].shape == (n, 3)
    with pytest.raises(ValueError, match="`NONE` synchronization is not supported"):
        strategy.create_state(tree, synchronization="none")
    with pytest.raises(ValueError):
        strategy.create_state(tree, synchronization="sometimes")
    with pytest.raises(ValueError):
        strategy.create_state(tree, synchronization="on_read", aggregation="avg")


def test_mirror_places_one_copy_per_device_and_keeps_mirrored_leaves(strategy, n):
    params = strategy.mirror({"w": np.ones((4, 2), np.float32), "s": 3})
    w = params["w"]
    assert w.shape == (4, 2)
    assert w.sharding.device_set == set(strategy.devices)
    assert w.sharding.is_fully_replicated
    assert [s.data.shape for s in w.addressable_shards] == [(4, 2)] * n
    again = strategy.mirror(params)
    assert again["w"] is w and again["s"] is params["s"]
    with pytest.raises(TypeError, match="PerReplica"):
        strategy.mirror(jm.PerReplica(np.zeros((n, 2))))


def test_read_mirrored_returns_the_copy_on_the_first_device(strategy):
    w = strategy.mirror(np.arange(6.0).reshape(2, 3))
    value = strategy.read(w)
    assert value.devices() == {strategy.devices[0]}
    np.testing.assert_array_equal(value, np.arange(6.0).reshape(2, 3))
    assert strategy.read({"x": 3, "y": "text"}) == {"x": 3, "y": "text"}


def test_read_per_replica_is_a_type_error_pointing_to_the_fix(strategy, n):
    with pytest.raises(TypeError) as info:
        strategy.read({"a": jm.PerReplica(np.zeros((n,)))})
    for word in ["reduce", "gather", "local_results"]:
        assert word in str(info.value)


# --- sync-on-read (TensorFlow's tower-local variable tests) -----------------------------------


def test_sync_on_read_sum_reads_n_then_n_plus_sum_of_updates(strategy, n):
    v = strategy.sync_on_read(1.0, "sum")
    assert float(strategy.read(v)) == n
    step = jm.replicate(lambda v: v.replace(v.value + 2.0 + jm.replica_id()), strategy=strategy)
    v = step(v)
    assert isinstance(v, jm.SyncOnRead) and v.aggregation is jm.Aggregation.SUM
    assert float(strategy.read(v)) == n + sum(2 + i for i in range(n))
    # Components are what each replica wrote, on its own device.
    parts = strategy.local_results(v)
    assert [float(p) for p in parts] == [1.0 + 2 + i for i in range(n)]
    assert [next(iter(p.devices())) for p in parts] == list(strategy.devices)


@pytest.mark.parametrize(
    "agg, expected", [("sum", 6.0), ("mean", 6.0), ("only_first_replica", 6.0)]
)
def test_assign_reads_back_the_value(strategy, n, agg, expected):
    v = strategy.assign(strategy.sync_on_read(0.0, agg), 6.0)
    assert float(strategy.read(v)) == pytest.approx(expected)
    per = 6.0 / n if agg == "sum" else 6.0
    assert [float(p) for p in strategy.local_results(v)] == pytest.approx([per] * n)


@pytest.mark.parametrize("value", [7, 10, -10, 0, 2**20 + 3])
def test_assign_integer_sum_spreads_the_remainder(strategy, n, value):
    # value // N each, one more on the first value % N replicas.
    v = strategy.assign(strategy.sync_on_read(np.int32(0), "sum"), value)
    assert v.value.dtype == np.int32
    expected = [value // n + (i < value % n) for i in range(n)]
    assert [int(p) for p in strategy.local_results(v)] == expected
    assert int(strategy.read(v)) == value


def test_assign_of_a_bool_sum_reads_back_the_value(strategy, n):
    v = strategy.assign(strategy.sync_on_read(np.asarray(False), "sum"), np.asarray(True))
    assert int(strategy.read(v)) == 1
    assert [bool(c) for c in strategy.local_results(v)] == [True] + [False] * (n - 1)


def test_assign_of_an_integer_sum_beyond_the_dtype_divides_before_casting(strategy, n):
    # The sum may be beyond an int8; each replica's share of it has to fit.
    value = 100 * n
    v = strategy.assign(strategy.sync_on_read(np.int8(0), "sum"), value)
    assert v.value.dtype == np.int8 and int(strategy.read(v)) == value
    with pytest.raises(ValueError, match=r"shares from .* beyond what the SyncOnRead's dtype int8"):
        strategy.assign(strategy.sync_on_read(np.int8(0), "sum"), 128 * n + 1)


def test_read_sync_on_read_aggregations(strategy, n):
    components = np.arange(n, dtype=np.float32) + 1
    ids = strategy.distribute_values_from_function(lambda ctx: components[ctx.replica_id])
    for agg, expected in [
        ("sum", components.sum()),
        ("mean", components.mean()),
        ("only_first_replica", components[0]),
    ]:
        v = jm.SyncOnRead(ids.values, agg)
        assert float(strategy.read(v)) == pytest.approx(expected)
    with pytest.raises(ValueError, match="aggregation NONE"):
        strategy.read(jm.SyncOnRead(ids.values, "none"))


@pytest.mark.parametrize("agg", ["sum", "mean", "only_first_replica"])
@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_read_zero_size_sync_on_read(strategy, n, agg, dtype):
    # Oracle: numpy's reduction of the stacked zeros (jnp.mean's dtype for an integer mean).
    ops = {"sum": jnp.sum, "mean": jnp.mean, "only_first_replica": lambda x, axis: x[0]}

    def expected(x):
        return ops[agg](jnp.asarray(x), axis=0)

    empty = np.zeros((0,), dtype)
    mixed = {"a": np.zeros((0, 3), dtype), "b": np.arange(3, dtype=dtype), "c": np.zeros(0)}
    for value in (empty, mixed):
        node = strategy.sync_on_read(value, agg)
        got = strategy.read(node)
        stacked = jax.tree.map(lambda x: np.stack([x] * n), value)
        for g, x in zip(jax.tree.leaves(got), jax.tree.leaves(stacked)):
            want = expected(x)
            assert g.shape == want.shape and g.dtype == want.dtype
            np.testing.assert_allclose(np.asarray(g), np.asarray(want))
            assert g.devices() == {strategy.devices[0]}


def test_zero_size_outputs_of_a_step_read_reduce_and_gather(strategy, n):
    # A step whose outputs are all zero-size: JAX lays them out with whole-array shards.
    @jm.replicate(strategy=strategy)
    def step(x):
        return x * 2

    out = step(jm.PerReplica(np.zeros((n, 0, 2), np.float32)))
    assert strategy.reduce("sum", out).shape == (0, 2)
    assert strategy.gather(out).shape == (0, 2)
    assert strategy.read(jm.SyncOnRead(out.values, "mean")).shape == (0, 2)


# --- reduce / gather / local_results ----------------------------------------------------------


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
def test_reduce_per_replica_matches_numpy(strategy, n, op):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 3, 4)).astype(np.float32)
    value = jm.PerReplica({"x": x, "y": [x[:, 0]]})
    out = strategy.reduce(op, value)
    np_op = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min}[op]
    np.testing.assert_allclose(out["x"], np_op(x, axis=0), rtol=1e-6)
    np.testing.assert_allclose(out["y"][0], np_op(x[:, 0], axis=0), rtol=1e-6)
    assert out["x"].devices() == {strategy.devices[0]}
    with_axis = strategy.reduce(op, value, axis=0)
    np.testing.assert_allclose(with_axis["x"], np_op(x, axis=(0, 1)), rtol=1e-5)


def test_reduce_mean_with_axis_is_the_global_batch_mean(strategy, n):
    batch = np.arange(n * 5, dtype=np.float32).reshape(n, 5)
    assert float(strategy.reduce("mean", jm.PerReplica(batch), axis=0)) == pytest.approx(
        batch.mean()
    )


def test_reduce_mean_of_integers_follows_jnp_mean(strategy, n):
    x = np.arange(n, dtype=np.int32)
    out = strategy.reduce("mean", jm.PerReplica(x))
    assert out.dtype == jnp.mean(jnp.asarray(x)).dtype
    assert float(out) == pytest.approx(x.mean())


def test_reduce_of_plain_values(strategy, n):
    value = jnp.ones(3)
    assert strategy.reduce("mean", value) is value
    mirrored = strategy.mirror(2.0)
    assert strategy.reduce("mean", mirrored) is mirrored
    assert strategy.reduce("sum", 0) == 0
    if n == 1:
        assert strategy.reduce("sum", value) is value
    else:
        with pytest.raises(ValueError, match="not a PerReplica"):
            strategy.reduce("sum", value)


def test_gather_concatenates_components(strategy, n):
    x = np.arange(n * 2 * 3).reshape(n, 2, 3)
    np.testing.assert_array_equal(strategy.gather(jm.PerReplica(x)), x.reshape(n * 2, 3))
    np.testing.assert_array_equal(
        strategy.gather(jm.PerReplica(x), axis=1), np.concatenate(list(x), axis=1)
    )
    g = strategy.gather(jm.PerReplica(jax.device_put(x, strategy.topology.stacked)))
    assert g.devices() == {strategy.devices[0]}


def test_gather_along_an_axis_the_components_lack_names_it(strategy, n):
    x = jm.PerReplica({"x": np.zeros((n, 2, 3), np.float32)})
    np.testing.assert_array_equal(strategy.gather(x, axis=-1)["x"], np.zeros((2, 3 * n)))
    with pytest.raises(ValueError, match=r"gather\(value, axis=2\).*\['x'\].*\(2, 3\)"):
        strategy.gather(x, axis=2)
    with pytest.raises(TypeError, match=r"axis=1\.0\): axis must be an int"):
        strategy.gather(x, axis=1.0)
    # Scalar components are stacked: axis 0 (or -1) is theirs.
    scalars = jm.PerReplica(np.arange(n, dtype=np.float32))
    np.testing.assert_array_equal(strategy.gather(scalars, axis=-1), np.arange(n))
    with pytest.raises(ValueError, match="with no axis 1"):
        strategy.gather(scalars, axis=1)


def test_a_per_replica_list_of_numbers_is_refused_naming_the_fix(strategy, n):
    # tf.distribute's one value per replica: each leaf here is a scalar, with no replica axis.
    values = jm.PerReplica([float(i) for i in range(n)])
    for call, name in (
        (lambda: strategy.reduce("sum", values), "reduce"),
        (lambda: strategy.gather(values), "gather"),
        (lambda: strategy.local_results(values), "local_results"),
    ):
        with pytest.raises(
            ValueError,
            match=rf"strategy\.{name} got a per-replica leaf of shape \(\) at \[0\].*np\.stack",
        ):
            call()
    stacked = jm.PerReplica(np.stack([float(i) for i in range(n)]))
    assert float(strategy.reduce("sum", stacked)) == sum(range(n))


@pytest.mark.parametrize("value", [0.1, 1 / 3, 1e-7, -2.7])
def test_a_mean_assigned_or_made_reads_back_exactly(strategy, value):
    value = np.float32(value)
    made = strategy.sync_on_read(value, "mean")
    assigned = strategy.assign(strategy.sync_on_read(np.float32(0), "mean"), value)
    for node in (made, assigned):
        assert np.asarray(strategy.read(node)) == value
        assert np.asarray(strategy.reduce("mean", jm.PerReplica(node.value))) == value


def test_reduce_of_a_sync_on_read_reduces_its_components(strategy, n):
    # As tf.distribute reduces a sync-on-read variable: its per-replica components, by op.
    components = np.arange(n * 2, dtype=np.float32).reshape(n, 2)
    node = jm.SyncOnRead(components, "sum")
    for op, expected in (("sum", components.sum(0)), ("mean", components.mean(0))):
        np.testing.assert_allclose(np.asarray(strategy.reduce(op, node)), expected, rtol=1e-6)
        np.testing.assert_allclose(
            np.asarray(strategy.reduce(op, {"m": node})["m"]), expected, rtol=1e-6
        )


def test_read_refuses_a_sync_on_read_that_is_not_one_component_per_replica(strategy, n):
    held = jm.SyncOnRead({"p": jm.PerReplica(np.zeros((n, 2), np.float32))}, "sum")
    with pytest.raises(TypeError, match="whose value holds a PerReplica"):
        strategy.read(held)
    # Refused wherever the components are taken, never a PerReplica inside a PerReplica.
    for call in ("reduce", "local_results"):
        api = getattr(strategy, call)
        args = ("sum", {"d": held}) if call == "reduce" else ({"d": held},)
        with pytest.raises(
            TypeError, match=rf"strategy\.{call} got .*\['d'\].* holds a PerReplica"
        ):
            api(*args)
    with pytest.raises(ValueError, match=rf"leading axis of size {n}"):
        strategy.read(jm.SyncOnRead(np.ones((n + 2,), np.float32), "sum"))


def test_abstract_shapes_are_refused_where_values_are_needed(strategy):
    abstract = {"w": jax.ShapeDtypeStruct((3,), np.float32)}
    with pytest.raises(TypeError, match=r"strategy\.mirror got a jax\.ShapeDtypeStruct at \['w'\]"):
        strategy.mirror(abstract)
    step = jm.replicate(lambda p: p["w"] * 2, strategy=strategy)
    with pytest.raises(TypeError, match=r"ShapeDtypeStruct at args\[0\]\['w'\]: a call runs"):
        step(abstract)
    assert step.lower(abstract) is not None  # lowering for shapes stays open


def test_local_results(strategy, n):
    x = np.arange(n * 2.0).reshape(n, 2)
    parts = strategy.local_results({"a": jm.PerReplica(x), "b": 5})
    assert len(parts) == n
    for i, part in enumerate(parts):
        np.testing.assert_array_equal(part["a"], x[i])
        assert part["b"] == 5
    copies = strategy.local_results(strategy.mirror(np.ones(2)))
    assert len(copies) == n
    assert {next(iter(c.devices())) for c in copies} == set(strategy.devices)
    assert strategy.local_results(7) == (7,)


def test_distribute_values_from_function_places_component_i_on_device_i(strategy, n):
    value = strategy.distribute_values_from_function(
        lambda ctx: {"id": np.full((2,), ctx.replica_id, np.int32), "n": ctx.num_replicas}
    )
    parts = strategy.local_results(value)
    for i, (part, device) in enumerate(zip(parts, strategy.devices)):
        np.testing.assert_array_equal(part["id"], [i, i])
        assert int(part["n"]) == n
        assert part["id"].devices() == {device}


def test_split_key_gives_independent_keys(strategy, n):
    keys = strategy.split_key(jax.random.key(0))
    draws = strategy.run(lambda k: jax.random.normal(k, (4,)), args=(keys,))
    assert isinstance(draws, jm.PerReplica)
    values = np.asarray(strategy.gather(draws)).reshape(n, 4)
    assert len({tuple(row) for row in values.round(6)}) == n
    raw = strategy.split_key(jax.random.PRNGKey(0))  # the raw uint32 form
    oracle = jax.random.split(jax.random.PRNGKey(0), n)
    np.testing.assert_array_equal(np.asarray(strategy.gather(raw)).reshape(n, 2), oracle)


@pytest.mark.parametrize("key", [3, np.float32(1.0), np.zeros((2, 2), np.uint32)])
def test_split_key_of_what_is_not_a_key_is_a_type_error(strategy, key):
    with pytest.raises(TypeError, match=r"split_key\(key\) expects a PRNG key.*got.*random\.key"):
        strategy.split_key(key)


def test_update_applies_fn_to_each_copy(strategy, n):
    w = strategy.mirror(np.ones(3, np.float32))
    new = strategy.update(w, lambda w, d: w + d, 2.0)
    assert strategy.topology.is_mirrored(new)
    np.testing.assert_array_equal(strategy.read(new), np.full(3, 3.0))
    ids = jm.PerReplica(np.arange(n, dtype=np.float32))
    per = strategy.update(w, lambda w, d: w * d, ids)
    assert isinstance(per, jm.PerReplica)
    np.testing.assert_array_equal(strategy.gather(per).reshape(n, 3)[:, 0], np.arange(n))


def test_local_results_of_a_tree_with_sync_on_read_gives_plain_components(strategy, n):
    metric = jm.metrics.Sum.create(strategy)
    step = jm.replicate(lambda m, x: m.update(x), strategy=strategy)
    metric = step(metric, jm.PerReplica(np.arange(n * 2, dtype=np.float32).reshape(n, 2)))
    parts = strategy.local_results(metric)
    assert [float(p.compute()) for p in parts] == [4.0 * i + 1 for i in range(n)]
    assert float(metric.compute(strategy)) == sum(4.0 * i + 1 for i in range(n))


@pytest.mark.parametrize("make", [jnp.arange, lambda k: np.arange(k, dtype=np.float32)])
def test_donating_mirrored_state_keeps_the_callers_arrays(strategy, n, make):
    original = make(4.0) if make is jnp.arange else make(4)
    state = strategy.mirror(original)
    step = jm.replicate(lambda w: w * 10, strategy=strategy, donate_argnums=0)
    for _ in range(2):
        state = step(state)
    np.testing.assert_array_equal(np.asarray(original), np.arange(4.0))  # intact
    np.testing.assert_array_equal(strategy.read(state), np.arange(4.0) * 100)


# --- the topology owns layout; one device per replica -----------------------------------------


def test_topology_layouts_at_one_device_per_replica():
    from jax.sharding import PartitionSpec as P
    from jax.sharding import SingleDeviceSharding

    from jmirror._topology import Topology

    topology = Topology.create(jax.devices(), "replica")
    assert topology.devices_per_replica == 1 and topology.mesh.axis_names == ("replica",)
    assert topology.mirrored_sharding() is topology.mirrored
    assert topology.mirrored_sharding(P()) is topology.mirrored
    assert topology.stacked_sharding() is topology.stacked
    assert topology.leaf_sharding((), np.ones((4, 8))) is topology.mirrored
    assert topology.specs([True, False]) == (P("replica"), P())
    assert topology.manual_axes == {"replica"}
    assert [topology.replica_devices(i) for i in range(topology.num_replicas)] == [
        (d,) for d in jax.devices()
    ]
    x = jax.device_put(np.ones(3), topology.mirrored)
    assert topology.read_sharding(x) == SingleDeviceSharding(jax.devices()[0])
    stacked = jax.device_put(np.ones((topology.num_replicas, 2)), topology.stacked)
    assert not topology.is_stacked_elsewhere(stacked)


def test_strategy_spans_one_device_per_replica_by_default():
    strategy = jm.MirroredStrategy()
    assert strategy.devices_per_replica == 1 and strategy.model_axis_name == "model"
    assert strategy.backend == "pmap" and strategy.mesh.axis_names == ("replica",)
    assert strategy.replica_devices(0) == strategy.devices[:1]


def test_gather_of_a_mirrored_scalar_is_the_vector_of_its_copies(strategy, n):
    """As for a PerReplica of scalars (the issue: numpy's zero-dimensional concatenate)."""
    got = strategy.gather(strategy.mirror(np.float32(3.0)))
    np.testing.assert_array_equal(got, np.full(n, 3.0, np.float32))
    np.testing.assert_array_equal(got, strategy.gather(jm.PerReplica(np.full(n, 3.0, np.float32))))


def test_a_per_replica_value_for_another_replica_count_is_a_value_error_naming_both(strategy):
    n = strategy.num_replicas
    other = jm.PerReplica(np.zeros((n + 1, 3), np.float32))
    for call in (
        strategy.local_results,
        strategy.gather,
        lambda x: strategy.reduce("sum", x),
        lambda x: jmt.assert_replicas_equal(x, strategy),
    ):
        with pytest.raises(ValueError, match=rf"shape \({n + 1}, 3\).*leading axis of size {n} "):
            call(other)


@pytest.mark.parametrize("shape, axis", [((), 0), ((4, 3), 2), ((4, 3), -3)])
def test_reduce_over_an_axis_the_components_lack_is_a_value_error(strategy, n, shape, axis):
    x = jm.PerReplica({"loss": np.ones((n, *shape), np.float32)})
    with pytest.raises(
        ValueError, match=rf"\['loss'\] has components of shape {re.escape(str(shape))}"
    ):
        strategy.reduce("mean", x, axis=axis)
    with pytest.raises(ValueError, match="axis=None"):
        strategy.reduce("sum", x, axis=axis)


def test_assign_refuses_what_it_could_not_read_back(strategy):
    count = strategy.sync_on_read(np.int32(0), "sum")
    with pytest.raises(TypeError, match=r"dtype float64.*int32"):
        strategy.assign(count, 13.7)
    assert int(strategy.read(strategy.assign(count, np.int64(13)))) == 13
    pair = strategy.sync_on_read({"a": np.zeros(2, np.float32), "b": np.float32(0)}, "mean")
    with pytest.raises(ValueError, match=r"\['a'\] has shape \(3,\).*shape \(2,\)"):
        strategy.assign(pair, {"a": np.ones(3, np.float32), "b": 1.0})
    out = strategy.read(strategy.assign(pair, {"a": np.arange(2.0), "b": 5}))
    np.testing.assert_array_equal(out["a"], [0.0, 1.0])
    assert float(out["b"]) == 5.0


def test_update_from_per_replica_arguments_names_update_and_its_fix(strategy, n):
    if n == 1:
        pytest.skip("one replica: nothing diverges")
    w = strategy.mirror({"w": np.ones(3, np.float32)})

    def shift(tree, delta):
        return {"w": tree["w"] - delta.sum()}

    with pytest.warns(jm.MirroredStateWarning) as caught:
        strategy.update(w, shift, jm.PerReplica(np.arange(n * 2, dtype=np.float32).reshape(n, 2)))
    text = str(caught[0].message)
    assert "jm.replicate(strategy.update(" in text and "shift" in text, text
    assert "strategy.reduce" in text and "per_replica=" in text, text
    assert "_Updater" not in text, text


def test_tf_distribute_names_point_to_jmirrors(strategy):
    with pytest.raises(
        AttributeError, match="num_replicas_in_sync is jmirror's strategy.num_replicas"
    ):
        strategy.num_replicas_in_sync  # noqa: B018
    with pytest.raises(
        AttributeError, match="experimental_local_results is jmirror's strategy.local_results"
    ):
        strategy.experimental_local_results  # noqa: B018
    with pytest.raises(AttributeError, match="get_replica_context is jmirror's jm.replica_context"):
        jm.get_replica_context  # noqa: B018
    assert not hasattr(strategy, "no_such_name") and not hasattr(jm, "no_such_name")
    # distribute_values_from_function's context, as tf.distribute's ValueContext is read.
    with pytest.raises(AttributeError, match="replica_id_in_sync_group is jmirror's .replica_id"):
        strategy.distribute_values_from_function(lambda ctx: ctx.replica_id_in_sync_group)
    assert not hasattr(jm.ValueContext(), "no_such_name")


def test_reduce_takes_an_integer_like_axis(strategy, n):
    x = jm.PerReplica(np.arange(n * 2, dtype=np.float32).reshape(n, 2))
    assert float(strategy.reduce("sum", x, axis=np.int64(0))) == float(np.sum(np.arange(n * 2)))
    with pytest.raises(TypeError, match="axis must be None or an int"):
        strategy.reduce("sum", x, axis=0.5)
