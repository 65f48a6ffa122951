"""Replicas spanning several devices: `devices_per_replica=k`.

The strategy's mesh is (N, k), named `(axis_name, model_axis_name)`; replica functions run on
the shard_map backend, manual over the replica axis only, and XLA partitions each replica over
its k devices. Results are checked against the k = 1 strategy on the same global batches.
"""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jmirror as jm
from jmirror import _backends
from jmirror._topology import Topology

pytestmark = pytest.mark.skipif(
    len(jax.devices()) < 8,
    reason="replicas spanning several devices need 8 host devices (JMIRROR_TEST_DEVICES=8)",
)

SPANS = (2, 4)
KERNEL = P(None, "model")


def _spanning(k: int, **kwargs) -> jm.MirroredStrategy:
    return jm.MirroredStrategy(devices_per_replica=k, **kwargs)


# --- (1) the constructor ---------------------------------------------------------------------


@pytest.mark.parametrize("k", SPANS)
def test_replicas_span_k_devices(k):
    strategy = _spanning(k)
    devices = tuple(jax.devices())
    n = len(devices) // k
    assert strategy.num_replicas == n
    assert strategy.devices == devices
    assert strategy.devices_per_replica == k
    assert strategy.model_axis_name == "model"
    assert strategy.backend == "shard_map"
    assert dict(strategy.mesh.shape) == {"replica": n, "model": k}
    assert strategy.mesh.axis_names == ("replica", "model")
    for i in range(n):
        assert strategy.replica_devices(i) == devices[i * k : (i + 1) * k]
        assert tuple(strategy.mesh.devices[i]) == strategy.replica_devices(i)
    assert f"devices_per_replica={k}" in repr(strategy)


@pytest.mark.parametrize("k", SPANS)
def test_read_and_local_results_keep_weak_types(k):
    # A replica's copy is assembled from its shards (strongly typed by JAX): typed again as
    # the value was, as with one device per replica.
    strategy = _spanning(k)
    mirrored = strategy.mirror({"slope": jnp.asarray(0.5), "count": 3, "w": jnp.ones((k, 2))})
    for got in (strategy.read(mirrored), strategy.local_results(mirrored)[-1]):
        assert got["slope"].aval.weak_type and got["count"].aval.weak_type
        assert not got["w"].aval.weak_type
        assert float(got["slope"]) == 0.5 and int(got["count"]) == 3
    assert set(strategy.read(mirrored)["slope"].devices()) == set(strategy.replica_devices(0))


def test_replicas_keep_the_callers_device_order():
    devices = list(reversed(jax.devices()))
    strategy = jm.MirroredStrategy(
        devices, devices_per_replica=2, axis_name="b", model_axis_name="m"
    )
    assert strategy.replica_devices(0) == tuple(devices[:2])
    assert strategy.mesh.axis_names == ("b", "m")


def test_one_device_per_replica_is_as_before():
    strategy = jm.MirroredStrategy(devices_per_replica=1)
    assert strategy.mesh.axis_names == ("replica",)
    assert strategy.backend == "pmap"
    assert strategy.num_replicas == len(jax.devices())
    assert strategy.replica_devices(3) == (jax.devices()[3],)
    assert "devices_per_replica" not in repr(strategy)


@pytest.mark.parametrize("k", [3, 0, -2, 16])
def test_a_span_that_does_not_divide_the_devices_is_refused(k):
    with pytest.raises(ValueError, match=rf"devices_per_replica={k}\).*\b8 device"):
        _spanning(k)


def test_a_span_of_another_type_is_refused():
    with pytest.raises(TypeError, match="devices_per_replica"):
        _spanning(2.0)


def test_pmap_cannot_span_devices():
    with pytest.raises(ValueError, match='backend="shard_map"'):
        _spanning(2, backend="pmap")
    assert _spanning(2, backend="shard_map").backend == "shard_map"


def test_the_model_axis_needs_its_own_name():
    with pytest.raises(ValueError, match="model_axis_name='replica'"):
        _spanning(2, model_axis_name="replica")


def test_scope_makes_the_mesh_current():
    strategy = _spanning(2)
    with strategy.scope():
        assert jax.sharding.get_abstract_mesh() == strategy.mesh.abstract_mesh
    assert jax.sharding.get_abstract_mesh().empty


# --- (2) running -----------------------------------------------------------------------------


def _train(strategy: jm.MirroredStrategy, steps: int = 3):
    """A linear model trained on the same global batches by every strategy."""
    n = strategy.num_replicas
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(4, 8)).astype(np.float32), "b": np.zeros(8, np.float32)}
    params = strategy.mirror(params)

    @jm.replicate(strategy=strategy)
    def step(params, x, y):
        def loss(p):
            return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

        grads = jm.all_reduce("mean", jax.grad(loss)(params))
        new = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
        return new, jm.all_reduce("mean", loss(params)), jm.replica_id()

    xs = rng.normal(size=(steps, 16, 4)).astype(np.float32)
    ys = rng.normal(size=(steps, 16, 8)).astype(np.float32)
    losses, ids = [], None
    for x, y in zip(xs, ys):
        batch = (jm.PerReplica(x.reshape(n, -1, 4)), jm.PerReplica(y.reshape(n, -1, 8)))
        params, loss, ids = step(params, *batch)
        losses.append(float(strategy.read(loss)))
    assert step.num_compilations == 1
    return params, losses, ids


@pytest.mark.parametrize("k", SPANS)
def test_a_step_with_collectives_equals_one_device_per_replica(k):
    expected, expected_losses, _ = _train(jm.MirroredStrategy())
    strategy = _spanning(k)
    params, losses, ids = _train(strategy)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    for name in ("w", "b"):
        np.testing.assert_allclose(
            np.asarray(strategy.read(params)[name]), np.asarray(expected[name]), rtol=1e-5
        )
    assert strategy.gather(ids).tolist() == list(range(strategy.num_replicas))
    assert not isinstance(params["w"], jm.PerReplica)


def test_replica_id_inside_a_nested_jit():
    strategy = _spanning(2)
    ids = strategy.run(jax.jit(lambda: jm.replica_id() * 2))
    assert strategy.gather(ids).tolist() == [0, 2, 4, 6]


def _loops_of_replica_ids(x):
    def body(carry, _):
        return carry + jm.replica_id(), None

    scanned, _ = jax.lax.scan(body, 0, None, length=3)
    chosen = jax.lax.cond(jm.replica_id() > 1, lambda: x, lambda: -x)
    looped = jax.lax.fori_loop(0, 2, lambda i, c: c + jm.replica_id() * i, 0)
    return scanned, chosen, jm.all_reduce("sum", looped * x)


@pytest.mark.parametrize("k", SPANS)
def test_replica_id_inside_scan_cond_and_loops(k):
    """`jm.replica_id()` inside `lax.scan`, `lax.cond` and `lax.fori_loop` bodies (lowered
    with the strategy's mesh in context), and `.lower()` of such a step, equal k = 1's."""
    n = 8 // k
    one = jm.MirroredStrategy(devices=jax.devices()[:n], backend="shard_map")
    expected = one.run(_loops_of_replica_ids, args=(2.0,))
    strategy = _spanning(k)
    got = strategy.run(_loops_of_replica_ids, args=(2.0,))
    for g, w in zip(got, expected):
        np.testing.assert_array_equal(np.asarray(strategy.gather(g)), np.asarray(one.gather(w)))
    assert strategy.gather(got[0]).tolist() == [3 * i for i in range(n)]
    jm.replicate(_loops_of_replica_ids, strategy=strategy).lower(2.0).compile()


def _replica_ids_inside_bodies(w, x):
    """`jm.replica_id()` inside `lax.cond` branches, a `while_loop` of a traced trip count and a
    `jax.checkpoint` body, forward and under `jax.grad`."""
    rid = lambda: jm.replica_id().astype(x.dtype)  # noqa: E731

    def loss(w):
        chosen = jax.lax.cond(x.sum() > 0, lambda v: v * rid(), lambda v: v - rid(), x * w)
        remat = jax.checkpoint(lambda v: jnp.sin(v * (rid() + 1)))(x * w)
        return jnp.sum(chosen) + jnp.sum(remat)

    value, grad = jax.value_and_grad(loss)(w)
    step = lambda c: (c[0] + 1, c[1] + rid())  # noqa: E731
    looped = jax.lax.while_loop(lambda c: c[0] < x.size, step, (jnp.int32(0), w))[1]
    return jm.all_reduce("sum", value), jm.all_reduce("sum", grad), value + looped


@pytest.mark.parametrize("k", SPANS)
def test_replica_ids_inside_cond_while_and_checkpoint_bodies(k):
    n = 8 // k
    x = jm.PerReplica(np.random.default_rng(4).normal(size=(n, 3)).astype(np.float32))
    one = jm.MirroredStrategy(devices=jax.devices()[:n])
    expected = one.run(_replica_ids_inside_bodies, args=(np.float32(0.5), x))
    strategy = _spanning(k)
    step = jm.replicate(_replica_ids_inside_bodies, strategy=strategy)
    got = step(np.float32(0.5), x)
    for g, e in zip(got[:2], expected[:2]):
        np.testing.assert_allclose(np.asarray(strategy.read(g)), np.asarray(one.read(e)), rtol=1e-5)
    np.testing.assert_allclose(
        np.asarray(strategy.gather(got[2])), np.asarray(one.gather(expected[2])), rtol=1e-5
    )
    step(np.float32(0.5), x)
    assert step.num_compilations == 1


def _scan_cond_remat(w, x):
    """A replica function with `lax.scan`, `lax.cond` and `jax.checkpoint`, for outer transforms."""
    carried, _ = jax.lax.scan(lambda c, xi: (c + jnp.tanh(xi * w), None), 0.0, x)
    chosen = jax.lax.cond(carried > 0, lambda: carried * w, lambda: carried - w)
    return jm.all_reduce("mean", jax.checkpoint(lambda v: jnp.sin(v) * w)(chosen))


def test_outer_transforms_of_a_step_of_replicas_spanning_devices():
    strategy = _spanning(2)
    n = strategy.num_replicas
    xs = np.random.default_rng(5).normal(size=(n, 3)).astype(np.float32)
    x = jm.PerReplica(xs)
    step = jm.replicate(_scan_cond_remat, strategy=strategy)
    oracle = lambda w: jnp.mean(jax.vmap(lambda xi: _scan_cond_oracle(w, xi))(xs))  # noqa: E731
    w = np.float32(0.3)
    read = lambda v: np.asarray(strategy.read(v))  # noqa: E731
    np.testing.assert_allclose(read(step(w, x)), oracle(w), rtol=1e-5)
    # jax.jit closing over concrete arguments, and a fori_loop around the step.
    np.testing.assert_allclose(read(jax.jit(lambda: step(w, x))()), oracle(w), rtol=1e-5)
    looped = jax.jit(lambda: jax.lax.fori_loop(0, 2, lambda i, a: a + step(w, x), 0.0))()
    np.testing.assert_allclose(read(looped), 2 * oracle(w), rtol=1e-5)
    # Outer jax.grad and jax.vmap of the step.
    np.testing.assert_allclose(read(jax.grad(step)(w, x)), jax.grad(oracle)(w), rtol=1e-5)
    ws = np.array([0.3, -0.2], np.float32)
    np.testing.assert_allclose(
        read(jax.vmap(step, in_axes=(0, None))(ws, x)), jax.vmap(oracle)(ws), rtol=1e-5
    )


def _scan_cond_oracle(w, x):
    carried = jnp.sum(jnp.tanh(x * w))
    chosen = jnp.where(carried > 0, carried * w, carried - w)
    return jnp.sin(chosen) * w


@pytest.mark.parametrize("k", SPANS)
def test_host_callbacks_inside_replicas_spanning_devices(k):
    from jax.experimental import io_callback

    n = 8 // k
    xs = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    seen = []

    def host(v):
        seen.append(np.asarray(v).copy())
        return np.asarray(v) * 2

    def replica(v):
        shape = jax.ShapeDtypeStruct(v.shape, v.dtype)
        return jax.pure_callback(host, shape, v) + io_callback(host, shape, v + 1)

    strategy = _spanning(k)
    out = jm.replicate(replica, strategy=strategy)(jm.PerReplica(xs))
    np.testing.assert_array_equal(np.asarray(strategy.gather(out)), (4 * xs + 2).reshape(-1))
    # Each of a replica's k devices calls the host function on the replica's whole values.
    assert len(seen) == 2 * n * k and all(v.shape == (3,) for v in seen)
    ordered = lambda v: io_callback(host, jax.ShapeDtypeStruct(v.shape, v.dtype), v, ordered=True)  # noqa: E731
    with pytest.raises(NotImplementedError, match="ordered=False"):
        jm.replicate(ordered, strategy=strategy)(jm.PerReplica(xs))


@jax.custom_vjp
def _doubled(v):
    return v * 2.0


_doubled.defvjp(lambda v: (_doubled(v), None), lambda _, g: (g * 2.0,))


def _custom_rules(w, x):
    """Functions with their own derivative rules: softplus, logaddexp (custom_jvp), optax's
    sigmoid cross-entropy, and a custom_vjp; forward and under `jax.grad`."""
    import optax

    def loss(w):
        z = x * w
        labels = (x > 0).astype(x.dtype)
        bce = optax.sigmoid_binary_cross_entropy(z, labels).mean()
        return bce + jnp.mean(jax.nn.softplus(z) + jnp.logaddexp(z, 1.0) + _doubled(z))

    value, grad = jax.value_and_grad(loss)(w)
    return jm.all_reduce("mean", value), jm.all_reduce("mean", grad)


@pytest.mark.parametrize("k", SPANS)
def test_custom_derivative_rules_inside_replicas_spanning_devices(k):
    n = 8 // k
    x = np.random.default_rng(0).normal(size=(n, 4, 3)).astype(np.float32)
    w = np.float32(0.7)
    one = jm.MirroredStrategy(devices=jax.devices()[:n])
    expected = one.run(_custom_rules, args=(w, jm.PerReplica(x)))
    strategy = _spanning(k)
    got = strategy.run(_custom_rules, args=(w, jm.PerReplica(x)))
    for g, e in zip(got, expected):
        np.testing.assert_allclose(np.asarray(strategy.read(g)), np.asarray(one.read(e)), rtol=1e-5)


@pytest.mark.parametrize("outer", ["jax.jit", "eqx.filter_jit"])
def test_a_step_of_replicas_spanning_devices_inside_an_outer_jit(outer):
    strategy = _spanning(2)
    n = strategy.num_replicas
    step = jm.replicate(
        lambda w, x: jm.all_reduce("sum", jnp.sum(x * w) + jm.replica_id()), strategy=strategy
    )
    x = jm.PerReplica(np.arange(n * 3, dtype=np.float32).reshape(n, 3))
    w = strategy.mirror(jnp.float32(2.0))
    if outer == "jax.jit":
        wrapped = jax.jit(step)
    else:
        eqx = pytest.importorskip("equinox")
        wrapped = eqx.filter_jit(step)
    expected = 2.0 * np.arange(n * 3).sum() + sum(range(n))
    np.testing.assert_allclose(np.asarray(strategy.read(wrapped(w, x))), expected)
    np.testing.assert_allclose(np.asarray(strategy.read(step(w, x))), expected)
    # Replica ids inside scan, cond and loop bodies, lowered within the outer jit.
    loops = jm.replicate(_loops_of_replica_ids, strategy=strategy)
    for got, want in zip(jax.jit(loops)(2.0), loops(2.0)):
        assert strategy.gather(got).tolist() == strategy.gather(want).tolist()


def test_half_precision_inside_an_outer_transformation_names_the_options():
    # XLA:CPU ends the process compiling such a program without the step's options (a
    # transformation of the caller's compiles it): the call warns first, naming them, and
    # the program compiled with them gives the gradient a one-device oracle gives.
    strategy = _spanning(2)
    n = strategy.num_replicas
    step = jm.replicate(lambda w, x: jm.all_reduce("sum", jnp.sum(w * x)), strategy=strategy)
    xs = np.linspace(-1, 1, n * 4, dtype=np.float32).reshape(n, 4)
    x = jm.PerReplica(jnp.asarray(xs, jnp.bfloat16))
    w = jnp.ones(4, jnp.bfloat16)
    options = {"xla_disable_hlo_passes": "all-reduce-promotion"}
    grad = jax.jit(jax.grad(lambda w: step(w, x).astype(jnp.float32)), compiler_options=options)
    with pytest.warns(UserWarning, match="all-reduce-promotion"):
        got = grad(w)
    expected = jnp.asarray(xs, jnp.bfloat16).astype(np.float32).sum(0)
    np.testing.assert_allclose(np.asarray(got, np.float32), expected, rtol=2e-2, atol=2e-2)
    # float32 arguments compile without those options: no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f32 = jax.jit(jax.grad(lambda w: step(w, jm.PerReplica(xs))))(jnp.ones(4))
    np.testing.assert_allclose(np.asarray(f32), xs.sum(0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k", SPANS)
def test_metrics_nnx_metrics_and_assertions_span_devices(k, tmp_path):
    """jm.metrics, nnx.metrics (Welford included, and their checkpoint and resume) and
    jmirror.testing's assertions on replicas spanning k devices, against NumPy and one device
    as in their own tests."""
    import test_metrics
    import test_nnx_metrics
    import test_testing

    strategy = _spanning(k)
    n = strategy.num_replicas
    test_metrics.test_distributed_metrics_match_numpy(strategy, n)
    test_nnx_metrics.test_multimetric_read_compute_equals_one_device(strategy)
    test_nnx_metrics.test_welford_chan_combine_with_uneven_counts(strategy)
    test_nnx_metrics.test_sync_on_read_metrics_checkpoint_and_resume(strategy, tmp_path)
    test_testing.test_assertions(strategy, n)


def test_placement_of_mirrored_values_batches_and_reads():
    strategy = _spanning(2)
    w = strategy.mirror(np.arange(6.0, dtype=np.float32))
    assert w.sharding == NamedSharding(strategy.mesh, P())
    batches = [np.arange(24, dtype=np.float32).reshape(8, 3)]
    with strategy.distribute_dataset(batches, remainder="drop") as data:
        (batch,) = list(data)
    x = batch.values
    assert x.shape == (4, 2, 3)
    assert x.sharding.is_equivalent_to(NamedSharding(strategy.mesh, P("replica")), x.ndim)
    for shard in x.addressable_shards:  # replica i's rows on each of its 2 devices
        i = strategy.devices.index(shard.device) // 2
        np.testing.assert_array_equal(np.asarray(shard.data)[0], batches[0][2 * i : 2 * i + 2])
    read = strategy.read(w)
    assert read.sharding.device_set == set(strategy.replica_devices(0))
    np.testing.assert_array_equal(np.asarray(read), np.arange(6.0))


# --- (3) layout ------------------------------------------------------------------------------


def _rules_callable(path, leaf):
    return KERNEL if jax.tree_util.keystr(path).endswith("['w']") else None


@pytest.mark.parametrize(
    "layout", [[(r"\['w'\]$", KERNEL)], _rules_callable], ids=["pairs", "callable"]
)
def test_layout_rules_lay_out_mirrored_leaves(layout):
    strategy = _spanning(2, layout=layout)
    params = strategy.mirror({"w": np.ones((4, 8), np.float32), "b": np.ones(8, np.float32)})
    assert params["w"].sharding == NamedSharding(strategy.mesh, KERNEL)
    assert params["w"].addressable_shards[0].data.shape == (4, 4)  # 1/k per device
    assert params["b"].sharding == NamedSharding(strategy.mesh, P())
    np.testing.assert_array_equal(np.asarray(params["w"]), np.ones((4, 8)))
    assert strategy.mirror(params)["w"] is params["w"]  # already laid out: no copy


def test_the_first_matching_rule_wins():
    strategy = _spanning(2, layout=[("w", P("model")), ("w", KERNEL)])
    assert strategy.mirror({"w": np.ones((4, 8))})["w"].sharding.spec == P("model")


def test_a_leafs_own_layout_comes_first():
    strategy = _spanning(2, layout=[("w", P("model"))])
    own = jax.device_put(np.ones((4, 8), np.float32), NamedSharding(strategy.mesh, KERNEL))
    assert strategy.mirror({"w": own})["w"].sharding.spec == KERNEL


@pytest.mark.parametrize(
    "spec, shape, why",
    [
        (P("replica"), (4, 8), "names the replica axis"),
        (P("model"), (3, 8), "splits a dimension of 3"),
        (P(None, None, "model"), (4, 8), "more entries"),
        (P("other"), (4, 8), "other than 'model'"),
    ],
)
def test_a_bad_layout_is_refused_naming_path_shape_and_spec(spec, shape, why):
    strategy = _spanning(2, layout=[("w", spec)])
    with pytest.raises(ValueError) as info:
        strategy.mirror({"w": np.ones(shape)})
    message = str(info.value)
    assert "['w']" in message and str(shape) in message and str(spec) in message
    assert why in message


def test_layout_rules_are_checked_when_given():
    with pytest.raises(TypeError, match="regex, PartitionSpec"):
        _spanning(2, layout=[("w", (None, "model"))])
    with pytest.raises(re.error):
        _spanning(2, layout=[("(", KERNEL)])


@pytest.mark.parametrize("k", SPANS)
def test_laid_out_state_trains_like_one_device_per_replica(k):
    expected, expected_losses, _ = _train(jm.MirroredStrategy())
    strategy = _spanning(k, layout=[(r"\['w'\]", KERNEL)])
    params, losses, _ = _train(strategy)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    read = strategy.read(strategy.mirror(params))["w"]
    assert read.sharding.device_set == set(strategy.replica_devices(0))
    assert read.sharding.spec == KERNEL  # laid out over replica 0's devices, not gathered
    np.testing.assert_allclose(np.asarray(read), np.asarray(expected["w"]), rtol=1e-5)


def test_the_backend_lays_out_mirrored_outputs_by_the_rules():
    topology = Topology.create(
        jax.devices(), "replica", devices_per_replica=2, layout=[("out", KERNEL)]
    )
    closed = jax.make_jaxpr(lambda w: (w * 2.0, w + 1.0))(jax.ShapeDtypeStruct((4, 8), jnp.float32))
    paths = [(jax.tree_util.DictKey("out"),), (jax.tree_util.DictKey("other"),)]
    run = _backends.executable("shard_map", topology)(
        topology, closed, [False], [False, False], False, paths
    )
    out, other = jax.jit(run)(jnp.ones((4, 8)))
    assert out.sharding.is_equivalent_to(NamedSharding(topology.mesh, KERNEL), 2)
    assert other.sharding.is_fully_replicated
    np.testing.assert_array_equal(np.asarray(out), np.full((4, 8), 2.0))


# --- the cross-replica operations at k > 1 -----------------------------------------------------


@pytest.mark.parametrize("k", SPANS)
def test_cross_replica_operations_span_devices(k):
    strategy = _spanning(k, layout=[("w", P("model"))])
    n = strategy.num_replicas
    ids = strategy.distribute_values_from_function(lambda ctx: np.float32(ctx.replica_id))
    assert [float(v) for v in strategy.local_results(ids)] == list(range(n))
    assert strategy.gather(ids).tolist() == list(range(n))
    assert float(strategy.reduce("sum", ids)) == sum(range(n))
    total = strategy.assign(strategy.sync_on_read(0.0, "sum"), 6.0)
    assert float(strategy.read(total)) == 6.0
    w = strategy.mirror({"w": np.arange(8.0, dtype=np.float32)})
    copies = strategy.local_results(w)
    assert len(copies) == n
    for i, copy in enumerate(copies):
        assert copy["w"].sharding.device_set == set(strategy.replica_devices(i))
        np.testing.assert_array_equal(np.asarray(copy["w"]), np.arange(8.0))
    w = strategy.update(w, lambda w, d: jax.tree.map(lambda x: x + d, w), 1.0)
    np.testing.assert_array_equal(np.asarray(strategy.read(w)["w"]), np.arange(8.0) + 1)
    keys = strategy.split_key(jax.random.key(0))
    assert keys.values.shape == (n,)


def test_an_output_keeps_the_layout_of_the_input_it_replaces():
    topology = Topology.create(jax.devices(), "replica", devices_per_replica=2)
    like = jax.device_put(np.ones((4, 8), np.float32), NamedSharding(topology.mesh, KERNEL))
    closed = jax.make_jaxpr(lambda w: (w * 2.0,))(jax.ShapeDtypeStruct((4, 8), jnp.float32))
    outputs = [_backends.Output((jax.tree_util.DictKey("w"),), like)]
    run = _backends.executable("shard_map", topology)(
        topology, closed, [False], [False], False, outputs
    )
    (out,) = jax.jit(run)(like)
    assert out.sharding.is_equivalent_to(like.sharding, 2)


def test_several_processes_strategy_spans_devices():
    strategy = jm.MultiWorkerMirroredStrategy(devices_per_replica=2)
    assert (strategy.num_replicas, strategy.backend) == (4, "shard_map")
    assert strategy.num_local_replicas == 4
    ids = strategy.run(jm.replica_id)
    assert [int(i) for i in strategy.local_results(ids)] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"MultiWorkerMirroredStrategy\(devices_per_replica=3\)"):
        jm.MultiWorkerMirroredStrategy(devices_per_replica=3)


def test_a_replica_cannot_span_processes():
    from types import SimpleNamespace

    from jmirror._topology import _check_processes

    devices = [SimpleNamespace(process_index=p) for p in (0, 0, 0, 1, 1, 1)]
    _check_processes(devices, 3, "MultiWorkerMirroredStrategy")
    with pytest.raises(ValueError, match="process 0 has 3 device"):
        _check_processes(devices, 2, "MultiWorkerMirroredStrategy")


def _shard_update_run(strategy: jm.MirroredStrategy):
    import optax

    tx = jm.shard_update(optax.adam(0.1))
    params = strategy.mirror({"w": jnp.ones((4, 8)), "b": jnp.ones(5)})
    state = tx.init(params)
    mu = state[0].mu["w"].shards
    assert mu.addressable_shards[0].data.size == 32 // 8  # 1/(N*k) of the leaf per device

    @jm.replicate(strategy=strategy)
    def step(params, state, x):
        def loss(p):
            return jnp.mean((x @ p["w"]) ** 2) + jnp.sum(p["b"] ** 2)

        updates, state = tx.update(jax.grad(loss)(params), state, params)
        return optax.apply_updates(params, updates), state

    x = jm.PerReplica(jnp.arange(64.0).reshape(strategy.num_replicas, -1, 4) / 64)
    for _ in range(3):
        params, state = step(params, state, x)
    return strategy.read((params, state))


@pytest.mark.parametrize("k", SPANS)
def test_shard_update_splits_state_over_replicas_and_model_axis(k):
    want = _shard_update_run(jm.MirroredStrategy())
    got = _shard_update_run(_spanning(k, layout=[("w", KERNEL)]))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_sharding_constraints_inside_a_replica_function():
    strategy = _spanning(2)
    x = jm.PerReplica(jnp.ones((4, 2, 4)))

    def double(spec):
        def fn(x):
            return jm.all_reduce("sum", jax.lax.with_sharding_constraint(x * 2, spec))

        return fn

    named = strategy.run(double(NamedSharding(strategy.mesh, KERNEL)), (x,))
    np.testing.assert_array_equal(np.asarray(strategy.read(named)), np.full((2, 4), 8.0))
    with strategy.scope():  # a bare PartitionSpec needs the mesh in context
        bare = strategy.run(double(KERNEL), (x,))
        _, losses, _ = _train(strategy)  # any step traced inside the scope
    np.testing.assert_array_equal(np.asarray(strategy.read(bare)), np.full((2, 4), 8.0))
    assert losses == _train(strategy)[1]


def test_datasets_from_function_and_donation_span_devices():
    strategy = _spanning(2)
    n = strategy.num_replicas

    def dataset_fn(ctx):
        return [np.full((2,), i, np.float32) for i in range(2 * n)]

    with strategy.distribute_datasets_from_function(dataset_fn) as data:
        steps = [strategy.gather(batch) for batch in data]
    assert [s.tolist()[::2] for s in steps] == [list(range(n)), list(range(n, 2 * n))]
    step = jm.replicate(lambda w: w + 1.0, strategy=strategy, donate_argnums=0)
    w = strategy.mirror(np.zeros(4, np.float32))
    new = step(w)
    assert w.is_deleted()
    np.testing.assert_array_equal(np.asarray(strategy.read(new)), np.ones(4))


@pytest.mark.parametrize("k", SPANS)
def test_mirrored_outputs_keep_the_layout_from_step_to_step(k):
    """The step's state comes back laid out by the rules (never as XLA left it), equal to
    k = 1, and the next step then finds it as compiled."""
    expected, _, _ = _train(jm.MirroredStrategy())
    strategy = _spanning(k, layout=[(r"\['w'\]", KERNEL)])
    params, _, _ = _train(strategy)
    assert params["w"].sharding == NamedSharding(strategy.mesh, KERNEL)
    assert params["b"].sharding.is_fully_replicated
    assert params["w"].addressable_shards[0].data.shape == (4, 8 // k)
    for got, want in zip(jax.tree.leaves(strategy.read(params)), jax.tree.leaves(expected)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _nnx_state_layouts(strategy: jm.MirroredStrategy, partitioned: bool):
    """Three Adam steps on an NNX model: the losses, the kernel's and its Adam moments'
    shardings after them, and the step's compilations."""
    import optax
    from flax import nnx

    init = nnx.initializers.lecun_normal()
    if partitioned:
        init = nnx.with_partitioning(init, (None, "model"))
    with strategy.scope():
        model = nnx.Linear(4, 8, kernel_init=init, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)

    @jm.replicate(strategy=strategy)
    def step(model, optimizer, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        optimizer.update(model, jm.all_reduce("mean", grads))
        return jm.all_reduce("mean", loss)

    x = np.arange(64.0, dtype=np.float32).reshape(strategy.num_replicas, -1, 4) / 64
    losses = [float(strategy.read(step(model, optimizer, jm.PerReplica(x)))) for _ in range(3)]
    adam = optimizer.opt_state[0]
    laid_out = [model.kernel, adam.mu["kernel"], adam.nu["kernel"]]
    return losses, [v.get_raw_value() for v in laid_out], model.bias.get_raw_value(), step


@pytest.mark.parametrize("partitioned", [True, False], ids=["with_partitioning", "rules"])
def test_nnx_state_written_back_keeps_its_layout(partitioned):
    """Written-back Variables come back laid out by their own metadata (flax's eager
    sharding, which the Adam moments copy) or by the rules matched against their argument
    paths: the same layout every step, one compilation, losses equal to k = 1."""
    expected, _, _, _ = _nnx_state_layouts(jm.MirroredStrategy(), False)
    layout = None if partitioned else [(r"kernel", KERNEL)]
    strategy = _spanning(2, layout=layout)
    losses, kernels, bias, step = _nnx_state_layouts(strategy, partitioned)
    for x in kernels:
        assert x.sharding == NamedSharding(strategy.mesh, KERNEL)
        assert x.addressable_shards[0].data.shape == (4, 4)
    assert bias.sharding.is_fully_replicated
    assert step.num_compilations == 1
    np.testing.assert_allclose(losses, expected, rtol=1e-5)


def _linen_params(strategy: jm.MirroredStrategy):
    """A linen Dense whose kernel is boxed in `nn.Partitioned((None, "model"))`, mirrored,
    after two SGD steps; and the step."""
    import flax.linen as nn

    kernel_init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
    model = nn.Dense(8, kernel_init=kernel_init)
    params = strategy.mirror(model.init(jax.random.key(0), jnp.ones((1, 4))))

    @jm.replicate(strategy=strategy)
    def step(params, x):
        grads = jax.grad(lambda p: jnp.mean(model.apply(p, x) ** 2))(params)
        grads = jm.all_reduce("mean", grads)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    x = np.arange(64.0, dtype=np.float32).reshape(strategy.num_replicas, -1, 4) / 64
    mirrored = params
    for _ in range(2):
        params = step(params, jm.PerReplica(x))
    return mirrored, params, step


def test_linen_partitioned_boxes_lay_out_their_leaves():
    """A linen `nn.Partitioned` box's names are the leaf's own metadata: the mirrored kernel
    and the stepped one are laid out by them, the bias replicated, equal to k = 1."""
    _, expected, _ = _linen_params(jm.MirroredStrategy())
    strategy = _spanning(2)
    mirrored, params, step = _linen_params(strategy)
    for tree in (mirrored, params):
        kernel = tree["params"]["kernel"].value
        assert kernel.sharding == NamedSharding(strategy.mesh, KERNEL)
        assert kernel.addressable_shards[0].data.shape == (4, 4)
        assert tree["params"]["bias"].sharding.is_fully_replicated
    assert step.num_compilations == 1
    got = jax.tree.leaves(strategy.read(params))
    for g, w in zip(got, jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_nnx_metadata_without_eager_sharding_lays_out_mirrored_leaves():
    """A Variable built outside the strategy's mesh keeps only flax's `out_sharding`
    metadata: `strategy.mirror` and a step's first call lay it out by that metadata."""
    from flax import nnx

    strategy = _spanning(2)
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
    with nnx.use_eager_sharding(False):
        model = nnx.Linear(4, 8, kernel_init=init, rngs=nnx.Rngs(0))
        fresh = nnx.Linear(4, 8, kernel_init=init, rngs=nnx.Rngs(0))
    value = np.asarray(model.kernel.get_raw_value())
    mirrored = strategy.mirror(model)

    @jm.replicate(strategy=strategy)
    def touch(model):
        model.kernel.set_raw_value(model.kernel.get_raw_value() * 1.0)

    touch(fresh)
    for m in (mirrored, fresh):
        kernel = m.kernel.get_raw_value()
        assert kernel.sharding == NamedSharding(strategy.mesh, KERNEL)
        np.testing.assert_array_equal(np.asarray(kernel), value)
        assert m.bias.get_raw_value().sharding.is_fully_replicated


# --- jm.shard_update packs each device's own blocks (k > 1) ----------------------------------

# Leaves laid out over the model axis both ways, replicated ones, and ones no dimension of
# which k divides; most of them padded inside their blocks (L / k not a multiple of N).
PADDED = {
    "rows": ((12, 5), P("model", None)),  # cut along its rows: the layout's own dimension
    "cols": ((5, 12), P(None, "model")),
    "across": ((6, 4), P("model", None)),  # cut along its columns at k = 2: not its layout's
    "bias": ((12,), P()),  # replicated, cut in blocks all the same
    "odd": ((3, 7), P()),  # no dimension k divides: row-major
}


def _padded_name(path):
    keys = [getattr(entry, "key", None) for entry in path]
    return next((key for key in reversed(keys) if key in PADDED), None)


def _padded_layout(path, leaf):
    name = _padded_name(path)
    return None if name is None else PADDED[name][1]


def _padded_params(strategy):
    rng = np.random.default_rng(3)
    host = {
        name: rng.standard_normal(shape).astype(np.float32) for name, (shape, _) in PADDED.items()
    }
    return strategy.mirror(host)


def _padded_loss(p, x):
    h = jnp.tanh(x @ p["rows"] + jnp.sum(p["odd"]))  # x: [b, 12]
    h = jnp.tanh(h @ p["cols"] + p["bias"])
    return jnp.mean(h**2) + jnp.sum(p["across"] ** 2) * jnp.mean(x)


def _padded_strategy(k):
    if k == 1:
        return jm.MirroredStrategy()
    layout = (
        _padded_layout
        if k == 2
        else lambda path, leaf: (
            None if _padded_name(path) == "across" else _padded_layout(path, leaf)
        )
    )
    return _spanning(k, layout=layout)


def _padded_run(strategy, tx, steps=3, sharded=True):
    import optax

    params = _padded_params(strategy)
    state = tx.init(params)

    @jm.replicate(strategy=strategy)
    def step(params, state, x):
        grads = jax.grad(_padded_loss)(params, x)
        if not sharded:
            grads = jm.all_reduce("mean", grads)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    x = jm.PerReplica(
        np.random.default_rng(4)
        .standard_normal((64, 12))
        .astype(np.float32)
        .reshape(strategy.num_replicas, -1, 12)
    )
    for _ in range(steps):
        params, state = step(params, state, x)
    return params, state


def _clipped_adamw():
    import optax

    return optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(0.05, weight_decay=0.1))


@pytest.mark.parametrize("k", SPANS)
def test_shard_update_in_device_blocks_equals_k1_with_padding_and_both_layouts(k):
    """Each leaf's pieces follow the device blocks at k > 1 (padding inside every block, a
    kernel cut along its layout's dimension or across it, replicated and row-major leaves):
    the step, `strategy.read` of the state and a whole-tree reduction equal k = 1's."""
    tx = jm.shard_update(_clipped_adamw())
    want = jax.tree.map(
        np.asarray, jm.MirroredStrategy().read(_padded_run(jm.MirroredStrategy(), tx))
    )
    strategy = _padded_strategy(k)
    params, state = _padded_run(strategy, tx)
    got = jax.tree.map(np.asarray, strategy.read((params, state)))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    mirrored = _padded_run(strategy, _clipped_adamw(), sharded=False)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(strategy.read(mirrored)), strict=True):
        np.testing.assert_allclose(a, np.asarray(b), rtol=1e-5, atol=1e-6)
    n = strategy.num_replicas
    for name in ("rows", "cols", "across", "bias"):
        node = state[1][0].mu[name]
        size = int(np.prod(node.shape))
        per_device = node.shards.addressable_shards[0].data.size
        assert per_device == -(-(size // k) // n)  # 1/N of one of the k blocks
        assert node.shards.shape == (n, k * per_device)


@pytest.mark.parametrize("k", SPANS)
def test_shard_update_padding_in_blocks_never_reaches_a_reduction(k):
    """An update that is NaN on the padding (`g / sqrt(nu)` with eps 0) scaled by a whole-tree
    vdot: the padding inside every block is masked, as at k = 1."""
    import optax

    def make():
        def update(grads, nu, params=None):
            nu = jax.tree.map(lambda v, g: v + g * g, nu, grads)
            u = jax.tree.map(lambda g, v: g / jnp.sqrt(v), grads, nu)
            scale = optax.tree.vdot(u, u) + optax.tree.sum(u)
            return jax.tree.map(lambda x: -1e-2 * x / (1.0 + jnp.abs(scale)), u), nu

        return optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p), update)

    strategy = _padded_strategy(k)
    got = strategy.read(_padded_run(strategy, jm.shard_update(make())))
    want = strategy.read(_padded_run(strategy, make(), sharded=False))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert np.isfinite(np.asarray(a)).all()
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_shard_update_state_in_device_blocks_restores_across_k(tmp_path):
    """A checkpoint of block-cut state saved at k = 2 restores at k = 1 and k = 4 with the same
    whole values, cut for the restoring k, and training goes on equal to k = 1."""
    tx = jm.shard_update(_clipped_adamw())
    two = _padded_strategy(2)
    params, state = _padded_run(two, tx, steps=2)
    saved = jax.tree.map(np.asarray, two.read({"params": params, "opt": state}))
    jm.checkpoint.save(tmp_path / "c", {"params": params, "opt": state}, strategy=two)
    for k in (1, 4, 2):
        other = _padded_strategy(k)
        fresh = _padded_params(other)
        restored = jm.checkpoint.restore(
            tmp_path / "c", {"params": fresh, "opt": tx.init(fresh)}, strategy=other
        )
        for a, b in zip(jax.tree.leaves(other.read(restored)), jax.tree.leaves(saved), strict=True):
            np.testing.assert_array_equal(np.asarray(a), b)
        node = restored["opt"][1][0].mu["cols"]
        assert node.shards.shape == tx.init(fresh)[1][0].mu["cols"].shards.shape


def _compiled_temp_bytes(k: int, sharded: bool) -> int:
    import optax

    width = 256
    layout = [("col", P(None, "model")), ("row", P("model", None))]
    strategy = _spanning(k, layout=layout, donation="always")
    params = strategy.mirror(
        {name: jnp.zeros((width, width)) for name in ("l0_col", "l1_row", "l2_col", "l3_row")}
    )
    # One bucket per kernel, as the default 4 MiB buckets give kernels of 1024 x 1024.
    tx = jm.shard_update(optax.adam(1e-3), bucket_bytes=2**16) if sharded else optax.adam(1e-3)
    state = tx.init(params) if sharded else strategy.mirror(tx.init(params))

    @jm.replicate(strategy=strategy, donate_argnums=(0, 1))  # the state counted once
    def step(params, state, x):
        def loss(p):
            h = x
            for name in sorted(p):
                h = jnp.tanh(h @ p[name])
            return jnp.mean(h**2)

        grads = jax.grad(loss)(params)
        if not sharded:
            grads = jm.all_reduce("mean", grads)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    n = strategy.num_replicas
    x = jm.PerReplica(jnp.zeros((n, 8, width)))
    compiled = step.lower(params, state, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("k", SPANS)
def test_shard_update_temporaries_shrink_with_the_model_axis(k):
    """With replicas spanning k devices the sharded update's per-device temporaries stay about
    half the mirrored update's, as at k = 1 (0.45, 0.48, 0.51 at k = 1, 2, 4): no gradient is
    rebuilt whole inside a replica. Packing a leaf laid out over the model axis in row-major
    order did (an all-gather over the model axis per kernel: 0.91 and 1.69 at k = 2, 4)."""
    sharded, mirrored = _compiled_temp_bytes(k, True), _compiled_temp_bytes(k, False)
    assert sharded < 0.7 * mirrored, (sharded, mirrored)


@pytest.mark.parametrize("k", SPANS)
def test_shard_update_init_inside_a_replica_cuts_the_same_blocks(k):
    import optax

    strategy = _padded_strategy(k)
    keep = optax.GradientTransformation(  # a state that holds the parameters: not all zeros
        lambda p: jax.tree.map(lambda x: 2.0 * x, p), lambda u, state, p=None: (u, state)
    )
    tx = jm.shard_update(keep)
    params = _padded_params(strategy)
    inside = jm.replicate(lambda p: tx.init(jax.tree.map(lambda x: x + 1.0, p)), strategy=strategy)
    outside = tx.init(jax.tree.map(lambda x: x + 1.0, params))
    got = inside(params)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(outside), strict=True):
        assert a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("k", SPANS)
def test_shard_update_state_made_either_way_has_the_layout_the_step_returns(k):
    """The state of `tx.init` in cross-replica context and of `strategy.run(tx.init, ...)`
    is laid out as the step gives it back (leaves cut in blocks, row-major ones whose pieces
    k divides, ones it does not), so one compiled step takes both, from the first call on."""
    import optax

    strategy = _padded_strategy(k)
    tx = jm.shard_update(_clipped_adamw())
    params = _padded_params(strategy)

    @jm.replicate(strategy=strategy)
    def step(params, state, x):
        updates, state = tx.update(jax.grad(_padded_loss)(params, x), state, params)
        return optax.apply_updates(params, updates), state

    x = jm.PerReplica(np.ones((strategy.num_replicas, 2, 12), np.float32))
    made = {"outside": tx.init(params), "run": strategy.run(tx.init, args=(params,))}
    for how, state in made.items():
        stepped = state
        for _ in range(2):
            _, stepped = step(params, stepped, x)
        flat = jax.tree_util.tree_flatten_with_path(state)[0]
        for (path, a), b in zip(flat, jax.tree.leaves(stepped), strict=True):
            assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (how, path)
    assert step.num_compilations == 1


# --- whole values wherever jmirror takes a replica's component ---------------------------------

AGGREGATIONS = ("sum", "mean", "only_first_replica")


def _laid_out_grads(k: int):
    """Per-replica gradients of a (6, 8) kernel laid out over the model axis (k > 1), and
    sync-on-read sums of them, on 4 replicas of k devices; the strategy, the values and the
    per-replica gradients by NumPy (the oracle)."""
    strategy = jm.MirroredStrategy(
        jax.devices()[: 4 * k], devices_per_replica=k, layout=[(r"\['w'\]", KERNEL)]
    )
    rng = np.random.default_rng(3)
    w = rng.normal(size=(6, 8)).astype(np.float32)
    x = rng.normal(size=(4, 2, 6)).astype(np.float32)
    totals = {a: strategy.sync_on_read(np.ones((6, 8), np.float32), a) for a in AGGREGATIONS}

    def grads(params, x, totals):
        g = jax.grad(lambda p: jnp.sum((x @ p["w"]) ** 2))(params)
        return g, {a: t.replace(t.value + g["w"]) for a, t in totals.items()}

    step = jm.replicate(grads, strategy=strategy, per_replica=lambda path, leaf: True)
    g, totals = step(strategy.mirror({"w": w}), jm.PerReplica(x), totals)
    expected = np.stack([2 * xi.T @ (xi @ w) for xi in x])  # d/dw sum((x w)^2)
    return strategy, g, totals, expected


def test_per_replica_values_laid_out_inside_replicas_are_taken_whole():
    # local_results gave one device's (6, 4) shard of each replica's (6, 8) gradient.
    strategy, g, _, expected = _laid_out_grads(2)
    assert g["w"].values.sharding.spec == P("replica", None, "model")
    components = strategy.local_results(g)
    assert len(components) == 4
    for i, component in enumerate(components):
        assert component["w"].shape == (6, 8)
        assert component["w"].sharding.device_set == set(strategy.replica_devices(i))
        np.testing.assert_allclose(np.asarray(component["w"]), expected[i], rtol=1e-5)
    gathered = strategy.gather(g, axis=0)["w"]
    np.testing.assert_allclose(np.asarray(gathered), np.concatenate(expected), rtol=1e-5)
    np.testing.assert_allclose(
        np.asarray(strategy.reduce("sum", g)["w"]), expected.sum(0), rtol=1e-5
    )


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_reading_a_sync_on_read_laid_out_inside_replicas_gives_the_whole_value(aggregation):
    # ONLY_FIRST_REPLICA read one device's half of replica 0's component.
    strategy, _, totals, expected = _laid_out_grads(2)
    parts = 1.0 + expected
    oracle = {"sum": parts.sum(0), "mean": parts.mean(0), "only_first_replica": parts[0]}
    node = totals[aggregation]
    read = strategy.read(node)
    assert read.shape == (6, 8)
    np.testing.assert_allclose(np.asarray(read), oracle[aggregation], rtol=1e-5)
    components = strategy.local_results(node)
    np.testing.assert_allclose(np.stack([np.asarray(c) for c in components]), parts, rtol=1e-5)


def test_whole_components_equal_one_device_per_replica():
    one, g1, totals1, _ = _laid_out_grads(1)
    two, g2, totals2, _ = _laid_out_grads(2)
    for a, b in zip(one.local_results((g1, totals1)), two.local_results((g2, totals2))):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        np.asarray(two.read(totals2["only_first_replica"])),
        np.asarray(one.read(totals1["only_first_replica"])),
        rtol=1e-5,
    )


def test_an_nnx_optimizer_of_shard_update_built_in_scope_compiles_once():
    # Built in the strategy's scope, the optimizer's pieces take their parameters' metadata
    # layout (P(None, 'model')); the step returns them split over replicas too.
    import optax
    from flax import nnx

    strategy = _spanning(2)
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
    with strategy.scope():
        model = nnx.Linear(6, 8, kernel_init=init, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, jm.shard_update(optax.adam(1e-2)), wrt=nnx.Param)
    x = jm.PerReplica(np.random.default_rng(0).normal(size=(4, 2, 6)).astype(np.float32))

    @jm.replicate(strategy=strategy)
    def step(model, optimizer, x):
        loss, grads = nnx.value_and_grad(lambda m: (m(x) ** 2).mean())(model)
        optimizer.update(model, grads)
        return jm.all_reduce("mean", loss)

    losses = [float(strategy.read(step(model, optimizer, x))) for _ in range(3)]
    assert step.num_compilations == 1
    assert losses[0] > losses[1] > losses[2]
    pieces = optimizer.opt_state[0].mu["kernel"].get_value().shards
    assert pieces.sharding.spec == P(strategy.axis_name, "model")
