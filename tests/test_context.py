"""The replica context: collectives, sync, merge_call and their errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jmirror as jm


def is_mirrored(strategy, x):
    return isinstance(x, jax.Array) and strategy.topology.is_mirrored(x)


def per_replica_tree(n):
    rng = np.random.default_rng(0)
    return {
        "a": rng.normal(size=(n, 3)).astype(np.float32),
        "b": [
            rng.normal(size=(n,)).astype(np.float32),
            rng.integers(0, 9, (n, 2)).astype(np.int32),
        ],
    }


def test_replica_context_properties(strategy, n):
    def fn():
        ctx = jm.replica_context()
        assert ctx.strategy is strategy
        assert ctx.num_replicas == n == jm.num_replicas()
        assert ctx.axis_name == "replica"
        assert jm.in_replica_context()
        return ctx.replica_id

    ids = strategy.run(fn)
    assert [int(i) for i in strategy.local_results(ids)] == list(range(n))


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
def test_all_reduce_nested_tree_matches_numpy(strategy, n, op):
    tree = per_replica_tree(n)
    out = strategy.run(lambda t: jm.all_reduce(op, t), args=(jm.PerReplica(tree),))
    np_op = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min}[op]
    for got, x in zip(jax.tree.leaves(out), jax.tree.leaves(tree)):
        assert is_mirrored(strategy, got)
        np.testing.assert_allclose(strategy.read(got), np_op(x, axis=0), rtol=1e-6)


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
def test_all_reduce_of_integer_gradients_gives_their_float0_back(strategy, n, op):
    # jax.grad(..., allow_int=True) gives float0 leaves for integer parameters: no values,
    # nothing to reduce (JAX's own division refuses them).
    params = {"w": np.ones(3, np.float32), "k": np.int32(2)}
    x = np.arange(n * 3, dtype=np.float32).reshape(n, 3)

    def grads(p, x):
        return jax.grad(lambda p: jnp.sum(p["w"] * x * p["k"]), allow_int=True)(p)

    out = strategy.run(lambda p, x: jm.all_reduce(op, grads(p, x)), args=(params, jm.PerReplica(x)))
    assert out["k"].dtype == jax.dtypes.float0 and out["k"].shape == ()
    np_op = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min}[op]
    np.testing.assert_allclose(strategy.read(out["w"]), np_op(2 * x, axis=0), rtol=1e-6)


def test_collectives_keep_weak_types(strategy):
    # JAX's collectives return strong types; elementwise operations (and one device) keep a
    # weak operand's type: a weak parameter updated through a collective would come back
    # strong and the step compile again.
    def collect(x):
        out = {op: jm.all_reduce(op, x) for op in ("sum", "mean", "max", "min")}
        out["gather"] = jm.all_gather(x)
        out["first"] = jm.sync(x * jm.replica_id(), "only_first_replica")
        out["merge"] = jm.merge_call(lambda s, v: s.reduce("mean", v), args=(x,))
        out["float32"] = jm.all_reduce("mean", x, dtype=jnp.bfloat16)  # cast back, weak
        return out

    step = jm.replicate(collect, strategy=strategy)
    for name, value in step(0.5).items():  # a Python float: weakly typed
        assert value.aval.weak_type and value.dtype == jnp.float32, name
    for name, value in step(jnp.float32(0.5)).items():
        assert not value.aval.weak_type, name


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
def test_all_reduce_of_python_numbers_equals_the_collective(strategy, n, op):
    # Counting with all_reduce("sum", 1): a Python number inside the replica function, which
    # JAX's own collective takes too (its sum of a constant is the constant times the axis size).
    def count():
        given = {"count": 1, "x": 2.5, "array": jnp.ones(2)}
        return jm.all_reduce(op, given), jax.tree.map(lambda v: oracle(v), given)

    def oracle(v):
        name = strategy.axis_name
        return {"sum": lax.psum, "max": lax.pmax, "min": lax.pmin}.get(op, lax.pmean)(v, name)

    out, expected = strategy.run(count)
    expected = jax.tree.map(np.asarray, strategy.read(expected))
    np.testing.assert_equal(jax.tree.map(np.asarray, strategy.read(out)), expected)
    assert float(strategy.read(out)["count"]) == (n if op == "sum" else 1)


@pytest.mark.parametrize("tiled", [False, True])
def test_all_gather(strategy, n, tiled):
    x = np.arange(n * 2 * 3, dtype=np.float32).reshape(n, 2, 3)
    out = strategy.run(lambda x: jm.all_gather(x, axis=1, tiled=tiled), args=(jm.PerReplica(x),))
    assert is_mirrored(strategy, out)
    expected = np.concatenate(list(x), axis=1) if tiled else np.stack(list(x), axis=1)
    np.testing.assert_array_equal(strategy.read(out), expected)


def test_all_gather_names_the_leaf_whose_axis_is_out_of_range(strategy, n):
    x = jm.PerReplica(np.zeros((n, 2, 3), np.float32))
    gathered = strategy.run(lambda x: jm.all_gather(x, axis=-1), args=(x,))  # a new last axis
    assert gathered.shape == (2, 3, n)
    with pytest.raises(
        ValueError, match=r"axis=5, tiled=False\): the leaf at \['w'\] has 2 .*-3 to 2"
    ):
        strategy.run(lambda x: jm.all_gather({"w": x}, axis=5), args=(x,))
    with pytest.raises(ValueError, match=r"axis=2, tiled=True\).*-2 to 1"):
        strategy.run(lambda x: jm.all_gather(x, axis=2, tiled=True), args=(x,))
    with pytest.raises(TypeError, match=r"axis=\.\.\.\) expects an int; got True"):
        strategy.run(lambda x: jm.all_gather(x, axis=True), args=(x,))


def test_sync_aggregations(strategy, n):
    def fn():
        x = 7.0 * (jm.replica_id() + 1)
        return {
            "first": jm.sync(x, "only_first_replica"),
            "mean": jm.sync(x, "mean"),
            "sum": jm.sync(x, jm.Aggregation.SUM),
            "flag": jm.sync(jm.replica_id() == 0, "only_first_replica"),
            "ident": jm.sync(jnp.float32(3.0), "none"),
        }

    out = strategy.run(fn)
    values = 7.0 * (np.arange(n) + 1)
    for leaf in jax.tree.leaves(out):
        assert is_mirrored(strategy, leaf)
    assert float(strategy.read(out["first"])) == 7.0
    assert float(strategy.read(out["mean"])) == pytest.approx(values.mean())
    assert float(strategy.read(out["sum"])) == pytest.approx(values.sum())
    assert bool(strategy.read(out["flag"])) is True
    assert float(strategy.read(out["ident"])) == 3.0


def test_sync_none_of_a_varying_value_names_the_leaf(strategy, n):
    def fn(x):
        return jm.sync({"ok": jnp.ones(2), "bad": x}, "none")

    with pytest.raises(ValueError) as info:
        strategy.run(fn, args=(jm.PerReplica(np.ones((n, 2))),))
    assert "['bad']" in str(info.value) and "MEAN" in str(info.value)


def _count_all_reduces(text):
    return sum(line.count("all-reduce(") for line in text.splitlines())


def test_sync_of_a_proven_identical_value_adds_no_collective(strategy, n):
    w = strategy.mirror(np.ones(4, np.float32))
    x = jm.PerReplica(np.ones((n, 4), np.float32))

    def step(w, x):
        mean = jm.all_reduce("mean", x)  # one collective
        identical = w * 2 + mean
        return (
            jm.sync(identical, "mean"),
            jm.sync(identical, "only_first_replica"),
            jm.sync(identical, "none"),
            jm.sync(identical, "sum"),
        )

    replicated = jm.replicate(step, strategy=strategy)
    outs = replicated(w, x)
    for out in outs:
        assert is_mirrored(strategy, out)
    np.testing.assert_allclose(strategy.read(outs[0]), np.full(4, 3.0))
    np.testing.assert_allclose(strategy.read(outs[3]), np.full(4, 3.0 * n))
    if n > 1:
        text = replicated.lower(w, x).compile().as_text()
        assert _count_all_reduces(text) == 1


def test_merge_call_sees_per_replica_values_and_returns_components(strategy, n):
    seen = {}

    def merge_fn(s, x, w, *, scale):
        seen["types"] = (type(x), type(w))
        seen["in_replica"] = jm.in_replica_context()
        with pytest.raises(RuntimeError, match="merge_fn"):
            jm.replica_context()
        total = s.reduce("sum", x)
        parts = s.local_results(x)
        gathered = s.gather(x)
        return total * scale, parts[n - 1], gathered, x

    def fn(x, w):
        return jm.merge_call(merge_fn, args=(x, w), kwargs={"scale": 2.0})

    x = np.arange(1.0, n + 1.0, dtype=np.float32)
    w = strategy.mirror(np.float32(1.0))
    total, last, gathered, own = strategy.run(fn, args=(jm.PerReplica(x), w))
    assert seen["types"] == (jm.PerReplica, jax.core.Tracer) or seen["types"][0] is jm.PerReplica
    assert not isinstance(seen["types"][1], jm.PerReplica)
    assert seen["in_replica"] is False
    assert is_mirrored(strategy, total) and float(strategy.read(total)) == 2 * x.sum()
    assert is_mirrored(strategy, last) and float(strategy.read(last)) == x[-1]
    np.testing.assert_array_equal(strategy.read(gathered), x)
    assert isinstance(own, jm.PerReplica)
    np.testing.assert_array_equal(own.values, x)


def test_merge_call_reads_and_updates(strategy, n):
    def fn(metric, w):
        metric = metric.replace(metric.value + jm.replica_id().astype(jnp.float32))

        def merge_fn(s, metric, w):
            total = s.read(metric)
            return s.update(w, lambda w, t: w + t, total)

        return jm.merge_call(merge_fn, args=(metric, w))

    metric = strategy.sync_on_read(np.float32(0.0), "sum")
    out = strategy.run(fn, args=(metric, strategy.mirror(np.float32(1.0))))
    assert is_mirrored(strategy, out)
    assert float(strategy.read(out)) == 1.0 + sum(range(n))


def test_merge_call_inside_scan_fori_and_cond(strategy, n):
    x = np.arange(n * 4, dtype=np.float32).reshape(n, 4)

    def mean_of(v):
        return jm.merge_call(lambda s, v: s.reduce("mean", v), args=(v,))

    def fn(x):
        def body(c, xi):
            return c + mean_of(xi), None

        scanned, _ = lax.scan(body, jnp.float32(0.0), x)
        fori = lax.fori_loop(0, 4, lambda i, c: c + mean_of(x[i]), jnp.float32(0.0))
        conditioned = lax.cond(
            jm.all_reduce("sum", x[0]) >= 0, lambda: mean_of(x[1]), lambda: jnp.float32(-1.0)
        )
        return scanned, fori, conditioned

    scanned, fori, conditioned = strategy.run(fn, args=(jm.PerReplica(x),))
    for out in (scanned, fori, conditioned):
        assert is_mirrored(strategy, out)
    assert float(strategy.read(scanned)) == pytest.approx(x.mean(axis=0).sum())
    assert float(strategy.read(fori)) == pytest.approx(x.mean(axis=0).sum())
    assert float(strategy.read(conditioned)) == pytest.approx(x[:, 1].mean())


def test_get_strategy_inside_a_replica_function_is_the_strategy_running_it(n):
    # As tf.distribute.get_strategy(): a loss scaled by get_strategy().num_replicas inside a
    # step of a strategy over some devices used the default strategy's count.
    strategy = jm.MirroredStrategy(num_devices=max(1, n // 2), axis_name="batch")
    seen = []

    def fn():
        seen.append(jm.get_strategy())
        jm.merge_call(lambda s: seen.append(jm.get_strategy()))
        return jnp.float32(jm.get_strategy().num_replicas)

    out = strategy.run(fn)
    assert seen == [strategy, strategy]
    assert float(strategy.read(out)) == strategy.num_replicas
    assert jm.get_strategy() is not strategy  # outside: the scope's, else the default
    with strategy.scope():
        assert jm.get_strategy() is strategy


def test_tf_replica_context_names_point_to_jmirrors(strategy):
    def fn():
        context = jm.replica_context()
        for name, ours in [
            ("replica_id_in_sync_group", "replica_id"),
            ("num_replicas_in_sync", "num_replicas"),
            ("devices", "replica_devices"),
        ]:
            with pytest.raises(AttributeError, match=rf"tf\.distribute's {name} is .*{ours}"):
                getattr(context, name)
        with pytest.raises(AttributeError, match=r"no attribute 'nothing'$"):
            context.nothing  # noqa: B018
        return jm.replica_id()

    strategy.run(fn)


def test_merge_call_exceptions_keep_their_type(strategy):
    def merge_fn(s):
        raise KeyError("from merge_fn")

    with pytest.raises(KeyError, match="from merge_fn"):
        strategy.run(lambda: jm.merge_call(merge_fn))
    assert not jm.in_replica_context()


def test_collective_under_a_varying_predicate_is_a_value_error(strategy, n):
    def in_cond(x):
        return lax.cond(x > 0, lambda: jm.all_reduce("sum", x), lambda: x)

    def in_while(x):
        return lax.while_loop(lambda c: c < x, lambda c: c + jm.all_reduce("max", c) + 1, 0.0)

    for fn in (in_cond, in_while):
        named = rf"jm.replicate\(.*{fn.__name__}\)>: A .* wait on each other forever"
        with pytest.raises(ValueError, match=named):
            strategy.run(fn, args=(jm.PerReplica(np.arange(n, dtype=np.float32)),))


@pytest.mark.parametrize(
    "call",
    [
        jm.replica_context,
        jm.replica_id,
        jm.num_replicas,
        lambda: jm.all_reduce("sum", 1.0),
        lambda: jm.all_gather(1.0),
        lambda: jm.sync(1.0, "mean"),
        lambda: jm.merge_call(lambda s: None),
    ],
)
def test_replica_only_calls_raise_outside(call):
    assert not jm.in_replica_context()
    with pytest.raises(RuntimeError, match="jm.replicate"):
        call()


def test_cross_replica_methods_refuse_the_replica_context(strategy, n):
    def fn(x):
        return strategy.reduce("sum", x)

    with pytest.raises(RuntimeError, match="merge_call"):
        strategy.run(fn, args=(jm.PerReplica(np.ones(n)),))
