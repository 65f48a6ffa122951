"""Tests of `jmirror.metrics` against NumPy on the same data, padding excluded."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmirror as jm
from jmirror import metrics

NUM_CLASSES = 5


def _data(rng, size, *, pad):
    """`size` examples of (values, logits, labels, mask), the last `pad` ones padding."""
    values = rng.normal(size=size).astype(np.float32)
    logits = rng.normal(size=(size, NUM_CLASSES)).astype(np.float32)
    labels = rng.integers(0, NUM_CLASSES, size=size).astype(np.int32)
    mask = np.arange(size) < size - pad
    values[~mask] = np.nan  # padding must never reach a counter
    return values, logits, labels, mask


def _expected(values, logits, labels, mask):
    return {
        "sum": values[mask].sum(),
        "mean": values[mask].mean(),
        "accuracy": (logits.argmax(-1) == labels)[mask].mean(),
    }


def _split(n, *arrays):
    return [jm.PerReplica(a.reshape((n, -1) + a.shape[1:])) for a in arrays]


@pytest.mark.parametrize("pad", [0, 3])
def test_local_metrics_match_numpy(pad):
    values, logits, labels, mask = _data(np.random.default_rng(0), 16, pad=pad)
    expected = _expected(values, logits, labels, mask)
    got = {
        "sum": metrics.Sum.empty().update(values, mask=mask).compute(),
        "mean": metrics.Mean.empty().update(values, mask=mask).compute(),
        "accuracy": metrics.Accuracy.empty().update(logits, labels, mask=mask).compute(),
    }
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-6, err_msg=name)


def test_local_metrics_under_jit_and_no_mask():
    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    update = jax.jit(lambda m, v: m.update(v))
    metric = update(update(metrics.Mean.empty(), values), values)
    assert int(metric.count) == 24
    np.testing.assert_allclose(metric.compute(), values.mean())


def test_mask_over_leading_axes_broadcasts():
    values = np.arange(6, dtype=np.float32).reshape(3, 2)
    metric = metrics.Mean.empty().update(values, mask=np.array([True, False, True]))
    assert int(metric.count) == 4
    np.testing.assert_allclose(metric.compute(), values[[0, 2]].mean())


def test_distributed_metrics_match_numpy(strategy, n):
    """Metrics created in cross-replica context, updated in a replicated step, read once."""

    @jm.replicate(strategy=strategy)
    def eval_step(states, values, logits, labels, mask):
        total, mean, accuracy = states
        return (
            total.update(values, mask=mask),
            mean.update(values, mask=mask),
            accuracy.update(logits, labels, mask=mask),
        )

    states = (
        metrics.Sum.create(strategy),
        metrics.Mean.create(strategy),
        metrics.Accuracy.create(strategy),
    )
    rng = np.random.default_rng(1)
    seen = []
    for pad in (0, 0, 2 * n - 1):  # the last batch is mostly padding
        batch = _data(rng, 4 * n, pad=pad)
        seen.append(batch)
        states = eval_step(states, *_split(n, *batch))
    assert eval_step.num_compilations == 1
    for metric in states:
        assert metric.is_distributed
        for counter in jax.tree.leaves(metric, is_leaf=lambda x: isinstance(x, jm.SyncOnRead)):
            assert isinstance(counter, jm.SyncOnRead) and counter.value.shape == (n,)
    expected = _expected(*(np.concatenate(parts) for parts in zip(*seen, strict=True)))
    for name, metric in zip(("sum", "mean", "accuracy"), states, strict=True):
        np.testing.assert_allclose(metric.compute(strategy), expected[name], rtol=1e-5)
        np.testing.assert_allclose(strategy.read(metric).compute(), expected[name], rtol=1e-5)


def test_compute_in_replica_context_is_local(strategy, n):
    values = np.arange(2 * n, dtype=np.float32)

    @jm.replicate(strategy=strategy)
    def step(metric, x):
        metric = metric.update(x)
        return metric, metric.compute()

    metric, local = step(metrics.Mean.create(strategy), *_split(n, values))
    expected = values.reshape(n, 2).mean(axis=1)
    np.testing.assert_allclose([float(v) for v in strategy.local_results(local)], expected)
    np.testing.assert_allclose(metric.compute(strategy), values.mean())


def test_merge_and_reset_distributed(strategy, n):
    step = jm.replicate(lambda m, x: m.update(x), strategy=strategy)
    a = step(metrics.Mean.create(strategy), *_split(n, np.ones(n, np.float32)))
    b = step(metrics.Mean.create(strategy), *_split(n, np.full(3 * n, 5.0, np.float32)))
    merged = a.merge(b)
    assert merged.is_distributed
    np.testing.assert_allclose(merged.compute(strategy), (n + 15 * n) / (4 * n))
    empty = merged.reset()
    assert empty.is_distributed and int(strategy.read(empty).count) == 0
    again = step(empty, *_split(n, np.full(n, 2.0, np.float32)))
    np.testing.assert_allclose(again.compute(strategy), 2.0)


def test_merge_inside_replica():
    strategy = jm.MirroredStrategy()
    n = strategy.num_replicas

    @jm.replicate(strategy=strategy)
    def step(metric, x, y):
        return metric.update(x).merge(metric.reset().update(y))

    metric = step(metrics.Sum.create(strategy), *_split(n, np.ones(n), np.full(n, 2.0)))
    np.testing.assert_allclose(metric.compute(strategy), 3.0 * n)


def test_empty_mean_and_accuracy_are_nan():
    assert np.isnan(metrics.Mean.empty().compute())
    assert np.isnan(metrics.Accuracy.empty().compute())
    all_padding = metrics.Mean.empty().update(jnp.ones(3), mask=jnp.zeros(3, bool))
    assert np.isnan(all_padding.compute())


def test_update_distributed_outside_replica_raises():
    strategy = jm.MirroredStrategy()
    with pytest.raises(TypeError, match="inside the replicated step"):
        metrics.Mean.create(strategy).update(jnp.ones(3))


def test_compute_distributed_without_strategy_raises():
    strategy = jm.MirroredStrategy()
    with pytest.raises(TypeError, match=r"metric.compute\(strategy\)"):
        metrics.Accuracy.create(strategy).compute()


@pytest.mark.parametrize(
    "call",
    [
        lambda: metrics.Mean.empty().update(jnp.ones((3, 2)), mask=jnp.ones(2, bool)),
        lambda: metrics.Sum.empty().update(jnp.ones(3), mask=jnp.ones((3, 1), bool)),
        lambda: metrics.Accuracy.empty().update(jnp.ones((3, 4)), jnp.ones((3, 4), int)),
    ],
    ids=["mask-too-short", "mask-too-deep", "one-hot-labels"],
)
def test_shape_errors(call):
    with pytest.raises(ValueError, match="shape"):
        call()


def test_merge_mismatch_raises():
    strategy = jm.MirroredStrategy()
    with pytest.raises(TypeError, match="same form"):
        metrics.Mean.empty().merge(metrics.Sum.empty())
    with pytest.raises(TypeError, match="same form"):
        metrics.Mean.empty().merge(metrics.Mean.create(strategy))


def test_update_in_replica_communicates_nothing(strategy, n):
    step = jm.replicate(lambda m, x, mask: m.update(x, mask=mask), strategy=strategy)
    values, _, _, mask = _data(np.random.default_rng(2), 2 * n, pad=1)
    hlo = step.lower(metrics.Mean.create(strategy), *_split(n, values, mask)).as_text()
    for collective in ("all-reduce", "all_reduce", "all-gather", "all_gather", "psum"):
        assert collective not in hlo


# stack_history: a per-step metric history → one host tree (flax's common_utils.get_metrics).


def _history_step(strategy):
    @jm.replicate(strategy=strategy)
    def step(x, seen):
        metrics_tree = {
            "loss": jm.all_reduce("mean", jnp.mean(x)),
            "per_class": jm.all_reduce("sum", x),
            "nested": {"max": jm.all_reduce("max", jnp.max(x))},
            "seen": seen.replace(seen.value + x.shape[0]),  # SyncOnRead (SUM), read by stack
        }
        return metrics_tree

    return step


def test_stack_history_matches_numpy(strategy, n):
    step = _history_step(strategy)
    rng = np.random.default_rng(3)
    batches = [rng.normal(size=(n, 4, 3)).astype(np.float32) for _ in range(5)]
    history = []
    for batch in batches:
        out = step(jm.PerReplica(batch), strategy.sync_on_read(np.int32(0), "sum"))
        history.append({**out, "learning_rate": 0.1})  # a plain number is stacked too
    got = metrics.stack_history(history, strategy=strategy)
    expected = {
        "loss": np.array([b.mean() for b in batches]),
        "per_class": np.stack([b.sum(axis=0) for b in batches]),
        "nested": {"max": np.array([b.max() for b in batches])},
        "seen": np.full(5, 4 * n),
        "learning_rate": np.full(5, 0.1),
    }
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    for path, leaf in jax.tree_util.tree_leaves_with_path(got):
        assert isinstance(leaf, np.ndarray), jax.tree_util.keystr(path)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), got, expected)
    assert got["seen"].dtype == np.int32 and got["per_class"].shape == (5, 4, 3)


def test_stack_history_one_compiled_stack_and_one_transfer(monkeypatch, strategy, n):
    """Every leaf of every step goes to the host in one device_get, after one compiled stack."""
    from jmirror.metrics import _history

    step = _history_step(strategy)
    history = [
        step(jm.PerReplica(np.full((n, 2, 3), float(s), np.float32)), strategy.sync_on_read(0))
        for s in range(4)
    ]
    calls = {"device_get": 0, "stack": 0}
    device_get, stack = jax.device_get, _history._stack_columns

    def counting_device_get(tree):
        calls["device_get"] += 1
        return device_get(tree)

    def counting_stack(columns):
        calls["stack"] += 1
        return stack(columns)

    monkeypatch.setattr(jax, "device_get", counting_device_get)
    monkeypatch.setattr(_history, "_stack_columns", counting_stack)
    got = metrics.stack_history(history, strategy=strategy)
    assert calls == {"device_get": 1, "stack": 1}
    np.testing.assert_allclose(got["loss"], [0.0, 1.0, 2.0, 3.0])


def test_stack_history_uses_the_current_strategy(n):
    strategy = jm.MirroredStrategy()
    step = jm.replicate(lambda x: jm.all_reduce("sum", x), strategy=strategy)
    history = [step(jm.PerReplica(np.ones(n, np.float32) * s)) for s in range(3)]
    with strategy.scope():
        np.testing.assert_allclose(metrics.stack_history(history), [0.0, n, 2.0 * n])
    np.testing.assert_allclose(metrics.stack_history(tuple(history)), [0.0, n, 2.0 * n])


def test_stack_history_errors(n):
    strategy = jm.MirroredStrategy()
    one = strategy.mirror(np.float32(1.0))
    with pytest.raises(ValueError, match="empty history"):
        metrics.stack_history([], strategy=strategy)
    with pytest.raises(TypeError, match="expects a list.*got dict"):
        metrics.stack_history({"loss": one}, strategy=strategy)
    with pytest.raises(ValueError, match=r"history\[2\] has a different structure.*\['acc'\]"):
        metrics.stack_history(
            [{"loss": one, "acc": one}, {"loss": one, "acc": one}, {"loss": one}],
            strategy=strategy,
        )
    with pytest.raises(ValueError, match=r"history\[1\]\['loss'\] has shape \(2,\).*\(\)"):
        metrics.stack_history([{"loss": one}, {"loss": strategy.mirror(np.ones(2))}])
    with pytest.raises(TypeError, match=r"history\[1\]\['loss'\] is a jm.PerReplica.*reduce"):
        metrics.stack_history(
            [{"loss": one}, {"loss": jm.PerReplica(np.zeros(n, np.float32))}],
            strategy=strategy,
        )
