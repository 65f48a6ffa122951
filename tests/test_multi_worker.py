"""Several processes: 2 processes x 4 host devices through the launcher, against 1 x 8.

These tests start processes, so they run once, in the 8-device pass of the suite (where the
one-process oracle has 8 devices too).
"""

import dataclasses
import os
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import jmirror as jm

HERE = Path(__file__).parent / "multiprocess"
sys.path.insert(0, str(HERE))
import harness  # noqa: E402
from training import metric_batches, metric_reads, metric_values, nnx_training, train  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("JMIRROR_TEST_DEVICES", "8") != "8" or len(jax.devices()) != 8,
    reason="starts processes: runs once, in the 8-device pass",
)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """What each of 2 processes x 4 devices saw (tests/multiprocess/strategy_worker.py)."""
    out = tmp_path_factory.mktemp("multi_worker")
    return harness.two_by_four(HERE / "strategy_worker.py", out, out=out)


def _one_process(backend):
    """The same program on one process of 8 devices: the oracle."""
    return train(jm.MirroredStrategy(backend=backend))


@pytest.mark.parametrize("backend", ["pmap", "shard_map"])
def test_two_processes_train_like_one_process(two_processes, backend):
    params, loss, count = _one_process(backend)
    for seen in two_processes:
        np.testing.assert_allclose(seen[f"{backend}/params"], params, rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(seen[f"{backend}/loss"], loss, rtol=2e-5)
        assert int(seen[f"{backend}/count"]) == 6 * 8 * 4  # every example counted once


@pytest.mark.parametrize("backend", ["pmap", "shard_map"])
def test_reads_agree_on_every_process(two_processes, backend):
    first, second = two_processes
    for key in ("params", "loss", "count", "gather", "reduce_sum", "reduce_mean", "values_sum"):
        np.testing.assert_array_equal(first[f"{backend}/{key}"], second[f"{backend}/{key}"])
    np.testing.assert_array_equal(first[f"{backend}/gather"], np.arange(8))
    assert float(first[f"{backend}/reduce_sum"]) == 28.0
    assert float(first[f"{backend}/reduce_mean"]) == 3.5
    assert float(first[f"{backend}/values_sum"]) == 28.0  # value_fn saw the global replica ids


@pytest.mark.parametrize("backend", ["pmap", "shard_map"])
def test_local_results_and_user_per_replica_are_this_process(two_processes, backend):
    first, second = two_processes
    np.testing.assert_array_equal(first[f"{backend}/local_results"], [0, 1, 2, 3])
    np.testing.assert_array_equal(second[f"{backend}/local_results"], [4, 5, 6, 7])
    # Each process built a PerReplica of its 4 components, all equal to its index.
    for seen in two_processes:
        np.testing.assert_array_equal(seen[f"{backend}/user_per_replica_sum"], [4.0, 4.0])


@pytest.mark.parametrize("backend", ["pmap", "shard_map"])
def test_reads_of_user_built_values_cover_every_process(two_processes, backend):
    # Each process built its replicas' components (their global replica ids, 0-3 and 4-7).
    expected = {
        "reduce_sum": 28.0,
        "reduce_max": 7.0,
        "gather": np.arange(8),
        "read_sum": 28.0,
        "read_mean": 3.5,
        "read_only_first_replica": 0.0,
    }
    for seen in two_processes:
        for key, want in expected.items():
            np.testing.assert_array_equal(seen[f"{backend}/user/{key}"], want, err_msg=key)


@pytest.mark.parametrize("backend", ["pmap", "shard_map"])
def test_per_replica_and_sync_on_read_modules_across_processes(two_processes, backend):
    # Component i of the module is the model shifted by i (NumPy's oracle by hand): each
    # process sees its own replicas' components, and the reads agree everywhere.
    import equinox as eqx

    model = eqx.nn.MLP(3, 2, 4, 1, activation=jax.nn.tanh, key=jax.random.key(0))
    w = np.asarray(model.layers[0].weight)

    def shifted(i):
        return jax.tree.map(lambda a: a + i if eqx.is_array(a) else a, model)

    x = np.ones((2, 3), np.float32)
    for p, seen in enumerate(two_processes):
        key = f"{backend}/module/"
        assert str(seen[key + "error"]) == "", str(seen[key + "error"])
        assert bool(seen[key + "kept"])
        ids = range(4 * p, 4 * p + 4)
        np.testing.assert_allclose(seen[key + "local"], [w + i for i in ids], rtol=1e-6)
        np.testing.assert_allclose(seen[key + "mean"], w + 3.5, rtol=1e-6)
        np.testing.assert_allclose(seen[key + "reads"], [8 * w, w, w], rtol=1e-6)
        want = [jax.vmap(shifted(i))(x) for i in ids]
        np.testing.assert_allclose(seen[key + "outputs"], want, rtol=1e-5, atol=1e-6)


def test_a_per_replica_of_all_replicas_built_on_one_process_is_refused(two_processes):
    for seen in two_processes:
        message = str(seen["wrong_size_error"])
        assert "num_local_replicas=4" in message and "(8, 2)" in message


@pytest.mark.parametrize("backend", ["pmap", "shard_map"])
def test_nnx_metrics_read_across_processes_equal_one_device(two_processes, backend):
    # Average and Welford (Chan's combine of every replica's count, mean and m2) over the
    # replicas of both processes, against the same metrics updated on one device.
    from flax import nnx

    metrics = nnx.MultiMetric(loss=nnx.metrics.Average(), stats=nnx.metrics.Welford())
    for values in metric_values(8):
        metrics.update(values=jax.numpy.asarray(values.reshape(-1)))
    want = metrics.compute()
    for seen in two_processes:
        np.testing.assert_allclose(seen[f"{backend}/metric_average"], want["loss"], rtol=1e-5)
        for field in dataclasses.fields(want["stats"]):
            got = seen[f"{backend}/metric_welford_{field.name}"]
            want_field = getattr(want["stats"], field.name)
            np.testing.assert_allclose(got, want_field, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["pmap", "shard_map"])
def test_every_metric_read_across_processes_equals_one_process(two_processes, backend):
    # jm.metrics (Sum, Mean, Accuracy, with masks over NaN; compute, read, merge, reset,
    # stack_history) and NNX's Average, Welford and Accuracy as sync-on-read state, updated
    # in replicated steps: 2 x 4 against 1 x 8 on the same global batches.
    want = metric_reads(jm.MirroredStrategy(backend=backend))
    values, logits, labels, mask = (np.stack(x) for x in zip(*metric_batches(8)))
    np.testing.assert_allclose(want["Sum/compute"], np.sum(values[mask]), rtol=1e-5)  # sane
    np.testing.assert_allclose(want["nnx/welford_mean"], np.mean(np.where(mask, values, 0)))
    hits = (np.argmax(logits, -1) == labels)[mask]
    np.testing.assert_allclose(want["Accuracy/compute"], np.mean(hits), rtol=1e-6)
    prefix = f"{backend}/metrics/"
    for seen in two_processes:
        got = {k[len(prefix) :]: v for k, v in seen.items() if k.startswith(prefix)}
        assert sorted(got) == sorted(want)
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("backend", ["pmap", "shard_map"])
def test_nnx_in_place_training_across_processes_equals_one_process(two_processes, backend):
    # BatchNorm's statistics over all 8 replicas, Dropout's per-replica rngs folded with the
    # global replica id, the optimizer written back into the caller's objects on each process.
    losses, state, steps = nnx_training(jm.MirroredStrategy(backend=backend))
    for seen in two_processes:
        np.testing.assert_allclose(seen[f"{backend}/nnx_losses"], losses, rtol=2e-5)
        np.testing.assert_allclose(seen[f"{backend}/nnx_state"], state, rtol=2e-4, atol=1e-6)
        assert int(seen[f"{backend}/nnx_steps"]) == steps == 4
        # Saved on both processes, restored into nnx.eval_shape targets: the restored pair's
        # next step gives the trained pair's next loss, bitwise.
        restored, trained = seen[f"{backend}/nnx_again"]
        assert restored == trained


def test_with_one_process_it_is_a_mirrored_strategy(backend):
    strategy = jm.MultiWorkerMirroredStrategy(backend=backend)
    assert (strategy.num_processes, strategy.process_index) == (1, 0)
    assert strategy.devices == tuple(jax.local_devices()) == strategy.local_devices
    assert strategy.num_local_replicas == strategy.num_replicas == 8
    params, loss, count = _one_process(backend)
    flat, _, c = train(strategy)
    np.testing.assert_array_equal(flat, params)
    assert int(strategy.read(c)) == int(jm.MirroredStrategy().read(count))


def test_state_nobody_placed_compiles_once_and_arrays_of_this_process_are_placed(two_processes):
    # As with one process: a TrainState.create state (step=0, arrays on one device) is placed
    # mirrored before the first call, so the second call finds the step compiled; an array
    # committed to one of this process's devices, or laid out on a mesh of them, is the same
    # value on every replica (8 replicas sum it 8 times).
    for seen in two_processes:
        assert int(seen["unplaced/compiles"]) == 1
        assert int(seen["unplaced/step"]) == 3
        np.testing.assert_allclose(seen["unplaced/w"], np.full(3, 1 - 3 * 0.1), rtol=1e-6)
        # A Python float (0.1: not exact in float32) and a weakly typed scalar stay JAX's:
        # weakly typed, so bfloat16 stays bfloat16, as with one process.
        assert str(seen["unplaced/weak_dtype"]) == "bfloat16"
        np.testing.assert_allclose(seen["unplaced/weak_value"], [0.05, 0.05], rtol=1e-2)
        assert seen["unplaced/weak_state"].tolist() == [1, True]
        key_data = seen["unplaced/mirrored_key"]
        np.testing.assert_array_equal(key_data, jax.random.key_data(jax.random.key(0)))
        for name, length in (("committed", 4), ("local_mesh", 4), ("reversed_mesh", 8)):
            value = seen[f"unplaced/{name}"]
            assert value.dtype.kind != "U", str(value)  # not an error message
            np.testing.assert_allclose(value, 8 * np.arange(float(length)))
