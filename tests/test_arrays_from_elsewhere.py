"""Arrays laid out elsewhere are placed as the same value: another mesh, one device, another
strategy's layout (a notebook re-run that changes `devices_per_replica`).

Oracle: NumPy (the values the arrays were made from).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jmirror as jm

RULES = [(r"w", P(None, "model"))]
W = np.arange(32.0, dtype=np.float32).reshape(4, 8)


def _strategy(k):
    return jm.MirroredStrategy(devices_per_replica=k, layout=RULES if k > 1 else None)


@pytest.mark.parametrize("old, new", [(2, 4), (4, 2), (1, 2), (2, 1), (4, 1), (1, 4)])
def test_state_of_a_strategy_with_another_devices_per_replica(n, old, new):
    if n < 4:
        pytest.skip("needs 4 devices or more")
    before = _strategy(old)
    params = before.mirror({"w": jnp.asarray(W), "b": jnp.ones(8)})
    after = _strategy(new)

    @jm.replicate(strategy=after)
    def step(p, x):
        scale = jm.all_reduce("mean", x.mean())
        return jax.tree.map(lambda v: v * scale, p)

    out = step(params, jm.PerReplica(np.ones((after.num_replicas, 2), np.float32)))
    np.testing.assert_array_equal(np.asarray(after.read(out["w"])), W)
    np.testing.assert_array_equal(np.asarray(after.read(out["b"])), np.ones(8))
    again = after.mirror(params)
    np.testing.assert_array_equal(np.asarray(after.read(again["w"])), W)
    assert step.num_compilations == 1
    step(out, jm.PerReplica(np.ones((after.num_replicas, 2), np.float32)))
    assert step.num_compilations == 1  # its own outputs are in place


@pytest.mark.parametrize("old, new", [(2, 1), (4, 2), (1, 2)])
def test_a_checkpoint_saves_state_of_another_devices_per_replica(n, old, new, tmp_path):
    if n < 4:
        pytest.skip("needs 4 devices or more")
    params = _strategy(old).mirror({"w": jnp.asarray(W), "b": jnp.ones(8)})
    after = _strategy(new)
    jm.checkpoint.save(tmp_path / "c", params, strategy=after)
    restored = jm.checkpoint.restore(tmp_path / "c", strategy=after)
    np.testing.assert_array_equal(np.asarray(after.read(restored["w"])), W)
    np.testing.assert_array_equal(np.asarray(after.read(restored["b"])), np.ones(8))
    # Its own stacked per-replica layout left unwrapped is still refused.
    stacked = jm.PerReplica(np.zeros((after.num_replicas, 3), np.float32))
    placed = after.run(lambda x: x, args=(stacked,))
    with pytest.raises(TypeError, match="is not mirrored"):
        jm.checkpoint.save(tmp_path / "d", {"x": placed.values}, strategy=after)


def test_arrays_on_a_users_mesh_one_device_and_another_order(strategy, n):
    devices = jax.devices()
    mesh = Mesh(np.array(devices[::-1]), ("data",))
    x = jax.device_put(jnp.arange(8.0 * n), NamedSharding(mesh, P("data")))
    one = jax.device_put(jnp.arange(3.0), devices[-1])
    stacked = jax.device_put(jnp.arange(2.0 * n).reshape(n, 2), NamedSharding(mesh, P("data")))

    @jm.replicate(strategy=strategy)
    def step(x, y, b):
        return x * 2, y + 1, b * 1

    a, b, c = step(x, one, jm.PerReplica(stacked))
    np.testing.assert_array_equal(np.asarray(strategy.read(a)), np.arange(8.0 * n) * 2)
    np.testing.assert_array_equal(np.asarray(strategy.read(b)), np.arange(3.0) + 1)
    got = np.stack([np.asarray(v) for v in strategy.local_results(c)])
    ids = list(strategy.topology.local_replica_ids)
    np.testing.assert_array_equal(got, np.arange(2.0 * n).reshape(n, 2)[ids])
    np.testing.assert_array_equal(np.asarray(strategy.read(strategy.mirror(x))), np.arange(8.0 * n))


def test_a_per_replica_for_another_replica_count_names_both(strategy, n):
    bad = jm.PerReplica(np.zeros((n + 1, 2), np.float32))
    with pytest.raises(ValueError, match=rf"\({n + 1}, 2\).*{n}"):
        jm.replicate(lambda b: b, strategy=strategy)(bad)
