"""`merge_call` keeps what the proof knows: a value proven identical on every replica and
passed in `args` is a mirrored value inside `merge_fn`.

Oracles: NumPy, and the same training run on one device (`jax.jit` on the global batch).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmirror as jm

CAPTURED = "captured from the replica function's closure"
SUM_OF_MIRRORED = "a value identical on every replica has no defined per-replica sum"


def _x(n):
    return np.arange(1.0, 3 * n + 1.0, dtype=np.float32).reshape(n, 3)


def _mirrored_source(kind):
    """A replica function body that makes a value proven identical, from x and w."""
    return {
        "all_reduce": lambda x, w: jm.all_reduce("mean", x),
        "sync": lambda x, w: jm.sync(x, "sum"),
        "mirrored input": lambda x, w: w,
        "constant": lambda x, w: np.full((3,), 2.0, np.float32),
        "derived": lambda x, w: jm.all_reduce("mean", x) * 2 + w,  # proven by the proof only
    }[kind]


def _expected(kind, x, w):
    return {
        "all_reduce": x.mean(0),
        "sync": x.sum(0),
        "mirrored input": w,
        "constant": np.full((3,), 2.0, np.float32),
        "derived": x.mean(0) * 2 + w,
    }[kind]


SOURCES = ["all_reduce", "sync", "mirrored input", "constant", "derived"]


@pytest.mark.parametrize("kind", SOURCES)
def test_a_mirrored_argument_is_mirrored_inside_merge_fn(strategy, n, kind):
    seen = {}
    make = _mirrored_source(kind)

    def merge_fn(s, g):
        seen["per_replica"] = isinstance(g, jm.PerReplica)
        mean = s.reduce("mean", g)
        seen["same"] = mean is g
        copies = s.local_results(g)
        seen["copies"] = len(copies)
        return (
            mean,
            s.reduce("max", g),
            jnp.stack(copies),
            s.gather(g),
            # A value only the proof knows is identical is a PerReplica in the first round of
            # tracing (always safe), where strategy.read refuses it; the last round reads it.
            s.reduce("mean", g) if isinstance(g, jm.PerReplica) else s.read(g),
            s.update(g, lambda v, d: v + d, 1.0),
        )

    def step(x, w):
        return jm.merge_call(merge_fn, args=(make(x, w),))

    x, w = _x(n), np.array([5.0, 6.0, 7.0], np.float32)
    outs = strategy.run(step, args=(jm.PerReplica(x), strategy.mirror(w)))
    want = _expected(kind, x, w)
    assert seen == {"per_replica": False, "same": True, "copies": n}
    mean, top, copies, gathered, read, updated = (strategy.read(o) for o in outs)
    np.testing.assert_allclose(mean, want, rtol=1e-6)
    np.testing.assert_allclose(top, want, rtol=1e-6)
    np.testing.assert_allclose(copies, np.stack([want] * n), rtol=1e-6)
    np.testing.assert_allclose(gathered, np.concatenate([want] * n), rtol=1e-6)
    np.testing.assert_allclose(read, want, rtol=1e-6)
    np.testing.assert_allclose(updated, want + 1.0, rtol=1e-6)


@pytest.mark.parametrize("kind", SOURCES)
def test_sum_of_a_mirrored_argument_is_the_mirrored_value_error(strategy, n, kind):
    make = _mirrored_source(kind)

    def step(x, w):
        return jm.merge_call(lambda s, g: s.reduce("sum", g), args=(make(x, w),))

    x, w = _x(n), np.array([5.0, 6.0, 7.0], np.float32)
    if n == 1:  # SUM of a mirrored value with one replica returns it
        out = strategy.run(step, args=(jm.PerReplica(x), strategy.mirror(w)))
        np.testing.assert_allclose(strategy.read(out), _expected(kind, x, w), rtol=1e-6)
        return
    with pytest.raises(ValueError, match=SUM_OF_MIRRORED) as info:
        strategy.run(step, args=(jm.PerReplica(x), strategy.mirror(w)))
    assert CAPTURED not in str(info.value)


def test_a_tree_of_mirrored_gradients_reduces_to_itself(strategy, n):
    def merge_fn(s, grads):
        mean = s.reduce("mean", grads)
        assert all(a is b for a, b in zip(jax.tree.leaves(mean), jax.tree.leaves(grads)))
        return mean

    def step(x):
        grads = {"a": x, "b": [x * 2, jnp.sum(x)]}
        return jm.merge_call(merge_fn, args=(jm.all_reduce("mean", grads),))

    x = _x(n)
    out = strategy.read(strategy.run(step, args=(jm.PerReplica(x),)))
    np.testing.assert_allclose(out["a"], x.mean(0), rtol=1e-6)
    np.testing.assert_allclose(out["b"][1], x.sum(1).mean(), rtol=1e-6)


def test_results_of_cross_replica_operations_stay_mirrored_inside_merge_fn(strategy, n):
    def merge_fn(s, x):
        total = s.reduce("sum", x)
        return (
            s.reduce("mean", total),
            jnp.stack(s.local_results(total)),
            s.reduce("mean", s.gather(x)),
        )

    x = _x(n)
    total, copies, gathered = strategy.run(
        lambda x: jm.merge_call(merge_fn, args=(x,)), args=(jm.PerReplica(x),)
    )
    np.testing.assert_allclose(strategy.read(total), x.sum(0), rtol=1e-6)
    np.testing.assert_allclose(strategy.read(copies), np.stack([x.sum(0)] * n), rtol=1e-6)
    np.testing.assert_allclose(strategy.read(gathered), x.reshape(-1), rtol=1e-6)


@pytest.mark.parametrize("op", ["mean", "sum"])
@pytest.mark.parametrize("kind", ["per-replica", "mirrored"])
def test_a_value_captured_from_the_closure_keeps_the_closure_message(strategy, op, kind):
    def step(x):
        y = x * 2 if kind == "per-replica" else jm.all_reduce("mean", x)
        return jm.merge_call(lambda s: s.reduce(op, {"y": y}))

    with pytest.raises(ValueError, match=CAPTURED) as info:
        strategy.run(step, args=(jm.PerReplica(_x(strategy.num_replicas)),))
    assert "['y']" in str(info.value)  # names the leaf


# --- the TF optimizer pattern -------------------------------------------------------------------


def _loss(w, x, y):
    if not isinstance(w, dict):  # one array: a single mirrored leaf reaches merge_fn
        w = {"kernel": w, "bias": 0.0}
    return jnp.mean((x @ w["kernel"] + w["bias"] - y) ** 2)


def _problem(n, steps, params, per_replica=4):
    rs = np.random.RandomState(0)
    xs = rs.randn(steps, n * per_replica, 5).astype(np.float32)
    ys = rs.randn(steps, n * per_replica, 2).astype(np.float32)
    w = {"kernel": rs.randn(5, 2).astype(np.float32), "bias": np.zeros(2, np.float32)}
    return xs, ys, (w if params == "dict" else w["kernel"])


def _apply(s, w, grads, lr=0.1):
    """The optimizer's cross-replica half: average the gradients, update every copy."""
    grads = s.reduce("mean", grads)
    return s.update(w, lambda w, g: jax.tree.map(lambda p, d: p - lr * d, w, g), grads)


@pytest.mark.parametrize("params", ["dict", "array"])
@pytest.mark.parametrize("reduced", [True, False], ids=["all-reduced", "per-replica"])
def test_optimizer_pattern_equals_one_device(strategy, n, reduced, params):
    xs, ys, w0 = _problem(n, steps=3, params=params)

    @jm.replicate(strategy=strategy)
    def step(w, x, y):
        grads = jax.grad(_loss)(w, x, y)
        if reduced:  # gradients already all-reduced, handed to merge_call and averaged there
            grads = jm.all_reduce("mean", grads)
        return jm.merge_call(_apply, args=(w, grads))

    @jax.jit
    def ref_step(w, x, y):
        grads = jax.grad(_loss)(w, x, y)
        return jax.tree.map(lambda p, d: p - 0.1 * d, w, grads)

    w, ref = strategy.mirror(w0), w0
    for x, y in zip(xs, ys):
        split = lambda a: jm.PerReplica(a.reshape(n, -1, a.shape[-1]))  # noqa: E731
        w = step(w, split(x), split(y))
        ref = ref_step(ref, x, y)
    assert not any(isinstance(leaf, jm.PerReplica) for leaf in jax.tree.leaves(w))
    for got, want in zip(jax.tree.leaves(strategy.read(w)), jax.tree.leaves(ref)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op", ["sum", "mean", "max"])
def test_reduce_inside_merge_fn_gives_the_hosts_dtype_and_value(strategy, n, op):
    # int8 components that overflow int8 when summed: the host's reduce sums in int32 (numpy's
    # rule) and so does the same reduce inside merge_fn, instead of wrapping.
    x = jm.PerReplica(np.full((n, 2), 100, np.int8))
    host = strategy.reduce(op, x)
    step = jm.replicate(
        lambda a: jm.merge_call(lambda s, v: s.reduce(op, v), args=(a,)), strategy=strategy
    )
    inside = step(x)
    assert inside.dtype == host.dtype
    np.testing.assert_array_equal(np.asarray(strategy.read(inside)), np.asarray(host))
