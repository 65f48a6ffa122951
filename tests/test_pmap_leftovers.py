"""pmap leftovers: arrays laid out the `jax.pmap` way by flax's `jax_utils` are recognised,
never silently broadcast whole.

`flax.jax_utils.prefetch_to_device` and `jax_utils.replicate` return a `jax.Array` whose
leading axis of N is split over the devices. Passed to a replicated function as a plain
argument it used to reach every replica whole (an all-reduced sum of N times the batch), and
`strategy.mirror` of it kept the leading axis, both without a word. Each test here failed on
the code before the fix.
"""

import warnings

import flax.jax_utils
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmirror as jm

pytestmark = pytest.mark.skipif(
    jax.device_count() == 1, reason="with one device every layout is the mirrored one"
)


def _prefetched(batch: np.ndarray) -> jax.Array:
    """`batch` (already shaped (N, ...)) through flax's prefetch_to_device, as flax users do."""
    return next(flax.jax_utils.prefetch_to_device(iter([batch]), 1))


def _global_batch(n: int) -> np.ndarray:
    return np.arange(n * 3 * 5, dtype=np.float32).reshape(n, 3, 5)


def test_prefetched_batch_as_plain_argument_warns_naming_path_and_fix(strategy, n):
    step = jm.replicate(lambda batch: jm.all_reduce("sum", batch["x"].sum()), strategy=strategy)
    batch = {"x": _prefetched(_global_batch(n))}
    with pytest.warns(UserWarning, match=r"args\[0\]\['x'\].*pmap way.*jm\.PerReplica\(x\)"):
        step(batch)
    # The fix the message gives: each replica then sees its own slice (the oracle: NumPy).
    fixed = strategy.read(step({"x": jm.PerReplica(batch["x"])}))
    np.testing.assert_allclose(fixed, _global_batch(n).sum(), rtol=1e-6)


def test_replicated_state_as_plain_argument_warns_with_the_unreplicate_fix(strategy, n):
    params = {"w": jnp.arange(4.0)}
    step = jm.replicate(lambda p, x: p["w"] * jm.all_reduce("mean", x), strategy=strategy)
    x = jm.PerReplica(jnp.ones((n,)))
    with pytest.warns(UserWarning, match=r"args\[0\]\['w'\].*unreplicate"):
        step(flax.jax_utils.replicate(params), x)
    mirrored = strategy.mirror(flax.jax_utils.unreplicate(flax.jax_utils.replicate(params)))
    np.testing.assert_array_equal(strategy.read(step(mirrored, x)), np.arange(4.0))


def test_the_warning_comes_once_per_function(strategy, n):
    step = jm.replicate(lambda b: b.sum(), strategy=strategy)
    with pytest.warns(UserWarning, match="pmap way"):
        step(_prefetched(_global_batch(n)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(_prefetched(_global_batch(n)))
        step(_prefetched(_global_batch(n)[:, :2]))  # a new signature: still warned already
    other = jm.replicate(lambda b: b.sum(), strategy=strategy)
    with pytest.warns(UserWarning, match="pmap way"):
        other(_prefetched(_global_batch(n)))


def test_a_layout_change_without_a_shape_change_is_noticed(strategy, n):
    # Same shape and dtype as a mirrored argument already compiled for: only the sharding
    # differs, which does not retrace the Python function.
    step = jm.replicate(lambda b: b.sum(), strategy=strategy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(strategy.mirror(_global_batch(n)))
    with pytest.warns(UserWarning, match=r"args\[0\].*pmap way"):
        step(_prefetched(_global_batch(n)))


def test_mirrored_state_and_per_replica_batches_do_not_warn(strategy, n):
    step = jm.replicate(lambda p, b: p + b.sum(), strategy=strategy)
    params = strategy.mirror(jnp.ones((n,)))  # leading axis n, but mirrored: fine
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(params, jm.PerReplica(_prefetched(_global_batch(n))))
        step(params, jm.PerReplica(_global_batch(n)))
        step(params, b=jm.PerReplica(_prefetched(_global_batch(n))))


def test_keyword_argument_path_is_named(strategy, n):
    step = jm.replicate(lambda w, batch=None: w + batch.sum(), strategy=strategy)
    w = strategy.mirror(jnp.zeros(()))
    with pytest.warns(UserWarning, match=r"kwargs\['batch'\].*pmap way"):
        step(w, batch=_prefetched(_global_batch(n)))


def test_mirror_of_replicated_state_warns_naming_path_and_fix(strategy, n):
    replicated = flax.jax_utils.replicate({"layer": {"w": jnp.arange(3.0)}})
    with pytest.warns(UserWarning, match=r"\['layer'\]\['w'\].*unreplicate"):
        mirrored = strategy.mirror(replicated)
    assert mirrored["layer"]["w"].shape == (n, 3)  # warned, not changed behind the user's back
    fixed = strategy.mirror(flax.jax_utils.unreplicate(replicated))
    np.testing.assert_array_equal(strategy.read(fixed)["layer"]["w"], np.arange(3.0))


def test_mirror_of_a_prefetched_batch_warns_with_the_per_replica_fix(strategy, n):
    with pytest.warns(UserWarning, match=r"strategy\.mirror.*pmap way.*jm\.PerReplica\(x\)"):
        strategy.mirror([_prefetched(_global_batch(n))])


def test_mirror_of_ordinary_arrays_does_not_warn(strategy, n):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        strategy.mirror({"a": jnp.ones((n, 3)), "b": np.ones((n, 2)), "c": 1.0})
        strategy.mirror(strategy.mirror(jnp.ones((n,))))


def test_raw_pmap_output_as_plain_argument_warns(strategy, n):
    # A half-migrated loop: a jax.pmap step's per-device output fed to a replicated one.
    per_device = jax.pmap(lambda x: x * 2)(jnp.ones((n, 3)))
    step = jm.replicate(lambda x: jm.all_reduce("sum", x.sum()), strategy=strategy)
    with pytest.warns(UserWarning, match=r"args\[0\].*pmap way"):
        step(per_device)
    got = strategy.read(step(jm.PerReplica(per_device)))
    np.testing.assert_allclose(got, 2.0 * 3 * n)  # each replica sums only its own slice
