"""Deadlock-free dispatch: bounded steps in flight on CPU host devices."""

import jax
import numpy as np
import pytest

import jmirror as jm


@pytest.mark.parametrize("donate", [(), (0,)])
def test_ten_thousand_back_to_back_steps_complete(strategy, n, donate):
    # With donation every output of a step is consumed by the next one: the bound must
    # still hold (it then waits on the later step).
    step = jm.replicate(
        lambda w, x: w + jm.all_reduce("mean", x), strategy=strategy, donate_argnums=donate
    )
    w = strategy.mirror(np.zeros(4, np.float32))
    x = jm.PerReplica(np.ones((n, 4), np.float32) * 1e-4)
    for _ in range(10_000):
        w = step(w, x)
        assert len(strategy.dispatch.in_flight) <= strategy.max_in_flight
    np.testing.assert_allclose(strategy.read(w), np.full(4, 1.0), rtol=1e-3)


def test_max_in_flight_bounds_the_queue(n):
    strategy = jm.MirroredStrategy(max_in_flight=1)
    assert strategy.max_in_flight == 1
    step = jm.replicate(lambda x: jm.all_reduce("sum", x), strategy=strategy)
    x = jm.PerReplica(np.ones((n,), np.float32))
    for _ in range(20):
        out = step(x)
        assert len(strategy.dispatch.in_flight) <= 1
    assert float(strategy.read(out)) == n


def test_default_is_small_on_cpu():
    assert jm.MirroredStrategy().max_in_flight == 2


def test_the_bound_keeps_only_the_smallest_output_alive(strategy, n):
    import gc
    import weakref

    step = jm.replicate(
        lambda x: (jm.all_reduce("sum", x), jm.all_reduce("sum", x.sum())), strategy=strategy
    )
    big, small = step(jm.PerReplica(np.ones((n, 1024), np.float32)))
    token = strategy.dispatch.in_flight[-1]
    assert token.nbytes <= small.nbytes  # the step's scalar token, or its smallest output
    ref = weakref.ref(big)
    del big
    gc.collect()
    assert ref() is None, "the in-flight bound must not keep large outputs alive"


def test_a_step_without_outputs_is_still_bounded(strategy, n):
    step = jm.replicate(lambda x: None, strategy=strategy)
    x = jm.PerReplica(np.ones((n, 2), np.float32))
    for _ in range(5):
        assert step(x) is None
        assert len(strategy.dispatch.in_flight) <= strategy.max_in_flight


def test_donation_policy_on_host_devices(n):
    strategy = jm.MirroredStrategy()
    small = [np.zeros(16, np.float32)]
    large = [np.zeros(8 * 2**20 // 4, np.float32)]  # 8 MiB
    assert strategy.dispatch.donates(small)
    # Donating large buffers made steps on several XLA:CPU devices ~1.9x slower.
    assert strategy.dispatch.donates(large) is (n == 1)
    step = jm.replicate(lambda w: w + 1, strategy=strategy, donate_argnums=0)
    w = step(strategy.mirror(large[0]))
    w = step(w)
    assert not w.is_deleted() and float(strategy.read(w)[0]) == 2.0


def test_donation_policy_is_decided_once_per_input_signature(monkeypatch, n):
    # The "auto" policy depends only on shapes and dtypes: a loop of state = step(state)
    # must not look at every leaf's size on every call.
    from jmirror import _dispatch

    looked = []
    all_small = _dispatch._all_small
    monkeypatch.setattr(
        _dispatch, "_all_small", lambda leaves: looked.append(1) or all_small(leaves)
    )
    strategy = jm.MirroredStrategy()
    step = jm.replicate(
        lambda s: jax.tree.map(lambda v: v + 1, s), strategy=strategy, donate_argnums=0
    )
    state = strategy.mirror({f"w{i}": np.zeros(3, np.float32) for i in range(50)})
    for _ in range(10):
        state = step(state)
    assert len(looked) <= 2  # the mirrored inputs' signature, then the outputs' one
    np.testing.assert_array_equal(strategy.read(state)["w7"], np.full(3, 10.0))


def test_a_new_signature_is_decided_again(n):
    # Same tree structure, one leaf now 8 MiB: "auto" must not reuse the small-leaf decision.
    strategy = jm.MirroredStrategy()
    step = jm.replicate(
        lambda s: jax.tree.map(lambda v: v + 1, s), strategy=strategy, donate_argnums=0
    )
    small = strategy.mirror({"a": np.zeros(4, np.float32), "b": np.zeros(4, np.float32)})
    for _ in range(3):
        small = step(small)
    large = strategy.mirror({"a": np.zeros(4, np.float32), "b": np.zeros(2**21, np.float32)})
    out = step(large)
    assert large["b"].is_deleted() is (n == 1)  # not donated on several host devices
    assert float(strategy.read(out)["b"][0]) == 1.0


def test_one_deleted_leaf_among_fresh_ones_is_still_refused(n):
    # The check looks at every donated leaf, not a sample: a state rebuilt from a new step's
    # outputs and one old (donated) leaf would crash jaxlib on several devices.
    strategy = jm.MirroredStrategy(donation="always")
    step = jm.replicate(
        lambda s: jax.tree.map(lambda v: v + 1, s), strategy=strategy, donate_argnums=0
    )
    old = strategy.mirror({f"w{i}": np.zeros(3, np.float32) for i in range(20)})
    new = step(old)
    mixed = {**new, "w13": old["w13"]}
    with pytest.raises(ValueError, match=r"args\[0\]\['w13'\].*deleted"):
        step(mixed)
    np.testing.assert_array_equal(strategy.read(step(new))["w13"], np.full(3, 2.0))
