"""Checkpoints of sync-on-read metrics: bitwise resume includes metrics.

Oracle: the same training loop run without interruption. Restored on the replica count that
saved it, a `SyncOnRead` (a `jm.metrics` counter, `nnx.metrics` state) gets its per-replica
components back, so the resumed run's metrics are bitwise those of the uninterrupted run; on
another count the read value is placed as `strategy.assign` places it (equal to float
tolerance); checkpoints written before components were saved restore as they did.
"""

import json
import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmirror as jm
from jmirror.checkpoint import _checkpoint, _integrity, _processes, _storage

STEPS, STOP = 6, 3  # the uninterrupted run's steps; the interrupted one saves after STOP
HERE = pathlib.Path(__file__).parent


def make_metrics():
    return nnx.MultiMetric(loss=nnx.metrics.Average("loss"), accuracy=nnx.metrics.Accuracy())


def batches(n):
    """Per-replica batches with a per-example scale of the loss the metrics count: one loss
    of the first batch is about 2**26 times the others, so float32 sums of the losses (ulp 8
    there) depend on the order in which they are added."""
    rs = np.random.RandomState(0)
    for i in range(STEPS):
        x = rs.randn(n, 4, 3).astype(np.float32)
        y = rs.randint(0, 2, (n, 4)).astype(np.int32)
        scale = (rs.rand(n, 4) * 10.0).astype(np.float32)
        if i == 0:
            scale[0, 0] = 2.0**26
        yield jm.PerReplica(x), jm.PerReplica(y), jm.PerReplica(scale)


def make_step(strategy):
    """A replicated SGD step of a linear classifier; it updates both kinds of metrics."""

    @jm.replicate(strategy=strategy)
    def step(w, mean, metrics, x, y, scale):
        def loss_fn(w):
            logits = x @ w
            per_example = jnp.sum((logits - jax.nn.one_hot(y, 2)) ** 2, axis=-1)
            return jnp.mean(per_example), (per_example * scale, logits)

        (_, (counted, logits)), grads = jax.value_and_grad(loss_fn, has_aux=True)(w)
        metrics.update(loss=counted, logits=logits, labels=y)
        w = w - 0.1 * jm.all_reduce("mean", grads)
        return w, mean.update(counted)

    return step


def fresh_state(strategy):
    w = strategy.mirror(np.linspace(-1.0, 1.0, 6, dtype=np.float32).reshape(3, 2))
    return {"w": w, "mean": jm.metrics.Mean.create(strategy), "metrics": make_metrics()}


def train(strategy, state, steps):
    step = make_step(strategy)  # a new replicated function, as in a new process
    for batch in steps:
        state["w"], state["mean"] = step(state["w"], state["mean"], state["metrics"], *batch)
    return state


def target(strategy):
    """The state's structure with new objects only (a new process's restore target)."""
    return {
        "w": jax.ShapeDtypeStruct((3, 2), jnp.float32),
        "mean": jm.metrics.Mean.create(strategy),
        "metrics": nnx.eval_shape(make_metrics),
    }


def results(strategy, state):
    """What the run reads: the metrics and parameters read, and every SyncOnRead's components."""
    read = strategy.read(state)
    nodes = jax.tree.leaves(
        (state["mean"], nnx.state(state["metrics"])), is_leaf=lambda x: isinstance(x, jm.SyncOnRead)
    )
    assert nodes and all(isinstance(node, jm.SyncOnRead) for node in nodes)
    return {
        "w": np.asarray(read["w"]),
        "mean": np.asarray(read["mean"].compute()),
        "metrics": {k: np.asarray(v) for k, v in read["metrics"].compute().items()},
        "components": [np.stack(strategy.local_results(node)) for node in nodes],
    }


def assert_bitwise(got, want):
    jax.tree.map(np.testing.assert_array_equal, got, want)


def save_and_restore(how, strategy, state, path, restore_strategy=None):
    restore_strategy = restore_strategy or strategy
    if how == "save":
        jm.checkpoint.save(path, state, strategy=strategy)
        return jm.checkpoint.restore(path, target(restore_strategy), strategy=restore_strategy)
    with jm.checkpoint.CheckpointManager(path, strategy=strategy) as manager:
        manager.save(STOP, state, data={"step": STOP})
    with jm.checkpoint.CheckpointManager(path, strategy=restore_strategy) as manager:
        assert manager.data() == {"step": STOP}
        return manager.restore(target=target(restore_strategy))


@pytest.mark.parametrize("how", ["save", "manager"])
def test_resume_mid_epoch_is_bitwise_metrics_included(strategy, tmp_path, how):
    n = strategy.num_replicas
    uninterrupted = results(strategy, train(strategy, fresh_state(strategy), batches(n)))
    steps = list(batches(n))
    state = train(strategy, fresh_state(strategy), steps[:STOP])
    restored = save_and_restore(how, strategy, state, tmp_path / "c")
    assert isinstance(restored["metrics"], nnx.MultiMetric)
    assert restored["metrics"] is not state["metrics"]
    assert_bitwise(results(strategy, restored), results(strategy, state))  # as they were
    resumed = results(strategy, train(strategy, restored, steps[STOP:]))
    assert_bitwise(resumed, uninterrupted)


@pytest.mark.parametrize("how", ["save", "manager"])
def test_resume_on_another_replica_count_reads_equal(tmp_path, how):
    n = len(jax.devices())
    if n < 2:
        pytest.skip("needs 2 devices")
    strategy, other = (
        jm.MirroredStrategy(jax.devices()),
        jm.MirroredStrategy(jax.devices()[: n // 2]),
    )
    state = train(strategy, fresh_state(strategy), list(batches(n))[:STOP])
    saved = results(strategy, state)
    restored = save_and_restore(how, strategy, state, tmp_path / "c", restore_strategy=other)
    got = results(other, restored)
    for key in ("w", "mean", "metrics"):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got[key], saved[key])
    # Placed as strategy.assign places the read value (a float jm counter: value / N each).
    assert all(c.shape[0] == n // 2 for c in got["components"])
    read_total = strategy.read(state["mean"]).total
    expected = other.assign(other.sync_on_read(np.float32(0), "sum"), read_total)
    np.testing.assert_array_equal(got["components"][0], np.stack(other.local_results(expected)))


def save_without_components(path, state, strategy):
    """Writes `state` as older version 2 checkpoints were written: aggregated leaves without
    their components, the arrays numbered "0", "1", ... in the order of the leaves (its tree
    and array table were checked equal to those that commit 1d1966a writes for this state)."""
    group = _processes.Group.of(strategy)
    doc, arrays = _checkpoint.encode(state, strategy, group, [None])
    names = {}

    def strip(node):
        if isinstance(node, dict):
            node.pop("components", None)
            if node.get("node") == "leaf":
                names[node["array"]] = node["array"] = str(len(names))
            for value in node.values():
                strip(value)
        elif isinstance(node, list):
            for value in node:
                strip(value)

    strip(doc["tree"])
    arrays = {new: arrays[old] for old, new in names.items()}
    doc["arrays"] = {new: doc["arrays"][old] for old, new in names.items()}
    _storage.write(path, arrays, doc, force=False)
    return doc


def test_checkpoint_without_components_restores_as_before(strategy, tmp_path):
    n = strategy.num_replicas
    state = train(strategy, fresh_state(strategy), list(batches(n))[:STOP])
    saved = results(strategy, state)
    doc = save_without_components(tmp_path / "c", state, strategy)
    assert len(doc["arrays"]) == len(saved["components"]) + 1  # one per leaf, w included
    restored = jm.checkpoint.restore(tmp_path / "c", target(strategy), strategy=strategy)
    got = results(strategy, restored)
    np.testing.assert_array_equal(got["w"], saved["w"])
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got["metrics"], saved["metrics"]
    )
    np.testing.assert_allclose(got["mean"], saved["mean"], rtol=1e-6)
    # The read value placed as before: an NNX metric's sums on replica 0, zero elsewhere.
    loss_total = [c for c in got["components"] if c.dtype == np.float32][-1]
    np.testing.assert_array_equal(loss_total[1:], np.zeros_like(loss_total[1:]))
    # Without target, too; and the strategy.assign rule for the jm counter.
    plain = jm.checkpoint.restore(tmp_path / "c", strategy=strategy)
    total = plain["mean"]["total"]
    assert isinstance(total, jm.SyncOnRead)
    each = np.stack(strategy.local_results(total))
    expected = strategy.assign(strategy.sync_on_read(np.float32(0), "sum"), strategy.read(total))
    np.testing.assert_array_equal(each, np.stack(strategy.local_results(expected)))


def test_components_are_checked_against_their_leaf(tmp_path):
    strategy = jm.MirroredStrategy()
    node = strategy.sync_on_read(np.float32(1.0), "sum")
    jm.checkpoint.save(tmp_path / "c", {"m": node}, strategy=strategy)
    document = tmp_path / "c" / "jmirror" / "metadata"
    doc = json.loads(document.read_text())
    leaf = doc["tree"]["children"][0][1]["child"]
    assert doc["arrays"][leaf["components"]]["shape"] == [strategy.num_replicas]
    leaf["components"] = leaf["array"]  # the read value's array where N components belong
    document.write_text(json.dumps(doc))
    _integrity.write_file_list(tmp_path / "c", _integrity.saved_checksums(tmp_path / "c"))
    with pytest.raises(jm.checkpoint.CorruptCheckpointError, match="components of the leaf"):
        jm.checkpoint.restore(tmp_path / "c", strategy=strategy)


# --- several processes -------------------------------------------------------------------------

WORKER = """
import sys

sys.path.insert(0, sys.argv[1])
import jmirror as jm

jm.distributed.initialize()
import test_checkpoint_metrics

test_checkpoint_metrics.resume_in_processes(jm.MultiWorkerMirroredStrategy(), sys.argv[2])
"""


def resume_in_processes(strategy, out):
    """The bitwise-resume test in each process of a run (the worker's body): each process
    feeds its own replicas' part of the batches and saves what it read to process<i>.npz."""
    me, local = strategy.process_index, strategy.num_local_replicas
    mine = slice(me * local, (me + 1) * local)
    steps = [
        tuple(jm.PerReplica(x.values[mine]) for x in b) for b in batches(strategy.num_replicas)
    ]
    uninterrupted = results(strategy, train(strategy, fresh_state(strategy), steps))
    state = train(strategy, fresh_state(strategy), steps[:STOP])
    restored = save_and_restore("save", strategy, state, pathlib.Path(out) / "c")
    seen = {"as_saved": results(strategy, state), "restored": results(strategy, restored)}
    seen["resumed"] = results(strategy, train(strategy, restored, steps[STOP:]))
    seen["uninterrupted"] = uninterrupted
    flat = jax.tree_util.tree_flatten_with_path(seen)[0]
    np.savez(f"{out}/process{me}.npz", **{jax.tree_util.keystr(p): x for p, x in flat})


def test_resume_with_several_processes_is_bitwise(tmp_path):
    if os.environ.get("JMIRROR_TEST_DEVICES", "8") != "8" or len(jax.devices()) != 8:
        pytest.skip("starts processes: runs once, in the 8-device pass")
    sys.path.insert(0, str(HERE / "multiprocess"))
    import harness

    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    seen = harness.two_by_four(worker, HERE, tmp_path, out=tmp_path, timeout=300)
    for process in seen:  # each process's own components, as they were, and bitwise resumed
        for key in process:
            if key.startswith("['restored']"):
                np.testing.assert_array_equal(
                    process[key], process[key.replace("restored", "as_saved")]
                )
            if key.startswith("['resumed']"):
                np.testing.assert_array_equal(
                    process[key], process[key.replace("resumed", "uninterrupted")]
                )
    # The checkpoint of 2 processes x 4 restores on 1 x 8 with every replica's components.
    strategy = jm.MirroredStrategy()
    restored = jm.checkpoint.restore(tmp_path / "c", target(strategy), strategy=strategy)
    got = results(strategy, restored)
    for i, components in enumerate(got["components"]):
        key = f"['as_saved']['components'][{i}]"
        np.testing.assert_array_equal(components, np.concatenate([p[key] for p in seen]))
    # The read sums the same components, but 2 x 4 adds them in another order than 1 x 8 does.
    np.testing.assert_allclose(got["mean"], seen[0]["['as_saved']['mean']"], rtol=1e-6)
