"""jmirror.testing: host device count, assertions, the pytest plugin, the emulated strategy."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jmirror as jm
import jmirror.testing as jmt


def run_python(code: str, *args: str, cwd=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JMIRROR_TEST_DEVICES")}
    return subprocess.run(
        [sys.executable, *args] if not code else [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )


@pytest.mark.once
def test_set_host_device_count_before_and_after_jax_starts():
    result = run_python(
        """
        import jax, jmirror.testing as jmt
        jmt.set_host_device_count(3)
        assert jax.device_count() == 3, jax.device_count()
        jmt.set_host_device_count(3)  # same count: fine
        try:
            jmt.set_host_device_count(5)
        except RuntimeError as e:
            assert "too late" in str(e) and "EmulatedStrategy" in str(e), e
            print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_set_host_device_count_rejects_bad_counts():
    with pytest.raises(ValueError):
        jmt.set_host_device_count(0)
    with pytest.raises(TypeError):
        jmt.set_host_device_count(2.0)


@pytest.mark.once
def test_pytest_plugin_runs_a_suite_on_n_fake_devices(tmp_path):
    (tmp_path / "test_user.py").write_text(
        textwrap.dedent(
            """
            import jax

            def test_count(jmirror_strategy, jmirror_emulated):
                assert jax.device_count() == 3
                assert jmirror_strategy.num_replicas == 3
                assert jmirror_emulated.num_replicas == 3
            """
        )
    )
    result = run_python(
        "", "-m", "pytest", "-q", "--jmirror-devices", "3", "-p", "no:cacheprovider", cwd=tmp_path
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout


def test_assertions(strategy, n):
    w = strategy.mirror(np.ones(3))
    jmt.assert_mirrored({"w": w}, strategy)
    with pytest.raises(AssertionError, match=r"\['x'\]"):
        jmt.assert_mirrored({"x": np.ones(3)}, strategy)
    ids = strategy.run(jm.replica_id)
    jmt.assert_per_replica(ids)
    with pytest.raises(AssertionError, match="expected a jm.PerReplica"):
        jmt.assert_per_replica(w)
    jmt.assert_replicas_equal(jm.PerReplica(np.ones((n, 2))), strategy)
    if n > 1:
        with pytest.raises(AssertionError, match="replica 1"):
            jmt.assert_replicas_equal(ids, strategy)


def _train(x, w):
    grads = jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w)))(w)
    return w - 0.5 * jm.all_reduce("mean", grads), grads


def _merge_scan(x, w):
    def body(c, xi):
        return c + jm.merge_call(lambda s, v: s.reduce("mean", v), args=(xi,)), None

    return lax.scan(body, jnp.zeros(3), x)[0] * w.sum()


def _sync(x, w):
    return (
        jm.sync(x.sum() * (jm.replica_id() + 1), "only_first_replica"),
        jm.sync(x.sum(), "mean"),
        jm.all_gather(x[0]),
        jm.replica_id() * w[0],
    )


def _sync_on_read(x, w, metric):
    return metric.replace(metric.value + x.sum())


@pytest.mark.parametrize("fn", [_train, _merge_scan, _sync, _sync_on_read])
def test_emulated_strategy_matches_the_real_one(fn, n):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4, 3)).astype(np.float32)
    w = rng.normal(size=(3,)).astype(np.float32)
    outs = []
    for strategy in (jm.MirroredStrategy(), jmt.EmulatedStrategy(n)):
        args = (jm.PerReplica(x), strategy.mirror(w))
        if fn is _sync_on_read:
            args += (strategy.sync_on_read(np.float32(1.0), "sum"),)
        out = strategy.run(fn, args=args)
        kinds = jax.tree.map(
            lambda v: (
                type(v).__name__ if isinstance(v, (jm.PerReplica, jm.SyncOnRead)) else "mirrored"
            ),
            out,
            is_leaf=lambda v: isinstance(v, (jm.PerReplica, jm.SyncOnRead)),
        )
        values = [np.asarray(v) for v in jax.tree.leaves(strategy.local_results(out))]
        outs.append((kinds, values, strategy))
    (real_kinds, real, s1), (emu_kinds, emu, s2) = outs
    assert real_kinds == emu_kinds
    for a, b in zip(real, emu):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_emulated_strategy_basics():
    strategy = jmt.EmulatedStrategy(4)
    assert strategy.num_replicas == 4 and len(set(strategy.devices)) == 1
    assert "EmulatedStrategy(num_replicas=4" in repr(strategy)
    ids = strategy.distribute_values_from_function(lambda ctx: np.float32(ctx.replica_id))
    assert [float(v) for v in strategy.local_results(ids)] == [0.0, 1.0, 2.0, 3.0]
    assert float(strategy.reduce("sum", ids)) == 6.0
    with pytest.raises(ValueError):
        jmt.EmulatedStrategy(0)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="replicas of 2 devices need 8 host devices")
def test_assertions_compare_whole_values_at_two_devices_per_replica():
    # assert_replicas_equal compared one device's shard of each component, so replicas that
    # differed only in the other half passed.
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    strategy = jm.MirroredStrategy(devices_per_replica=2)
    n = strategy.num_replicas
    same = np.ones((n, 6, 8), np.float32)
    laid_out = NamedSharding(strategy.mesh, P("replica", None, "model"))
    jmt.assert_replicas_equal(jm.PerReplica(jax.device_put(same, laid_out)), strategy)
    differs = same.copy()
    differs[1, :, 7] = 2.0  # replica 1, the columns its second device holds
    with pytest.raises(AssertionError, match="replica 0 and replica 1"):
        jmt.assert_replicas_equal(jm.PerReplica(jax.device_put(differs, laid_out)), strategy)
    # A mirrored leaf, replicated inside each replica, whose copy on replica 2's second
    # device differs (oracle: the copies as placed, by device).
    mirrored = NamedSharding(strategy.mesh, P())
    copies = [np.full((3,), 1.0 if i != 5 else 9.0, np.float32) for i in range(2 * n)]
    parts = [jax.device_put(c, d) for c, d in zip(copies, strategy.devices)]
    odd = jax.make_array_from_single_device_arrays((3,), mirrored, parts)
    jmt.assert_mirrored(strategy.mirror(np.ones(3, np.float32)), strategy)
    with pytest.raises(AssertionError, match=r"replica 0 and replica 2 \(its device"):
        jmt.assert_mirrored({"w": odd}, strategy)
    counts = rf"strategy's {n} replica\(s\) \({2 * n} device\(s\)\); found ndarray"
    with pytest.raises(AssertionError, match=counts):
        jmt.assert_mirrored(np.ones(3), strategy)
