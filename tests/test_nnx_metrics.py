"""nnx.metrics updated inside replica functions are sync-on-read.

Oracle: the same metrics updated on one device with the global batches.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmirror as jm


def _metrics():
    return nnx.MultiMetric(
        accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average(), stats=nnx.metrics.Welford()
    )


def _batches(n, steps=3, per_replica=5):
    rs = np.random.RandomState(0)
    for _ in range(steps):
        logits = rs.randn(n * per_replica, 4).astype(np.float32)
        labels = rs.randint(0, 4, n * per_replica).astype(np.int32)
        loss = (rs.rand(n * per_replica) * 3).astype(np.float32)
        yield logits, labels, loss


def _split(n, x):
    return jm.PerReplica(x.reshape(n, -1, *x.shape[1:]))


def _assert_same(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_multimetric_read_compute_equals_one_device(strategy):
    n = strategy.num_replicas
    metrics, ref = _metrics(), _metrics()

    @jm.replicate(strategy=strategy)
    def eval_step(metrics, logits, labels, loss):
        metrics.update(logits=logits, labels=labels, values=loss)

    for logits, labels, loss in _batches(n):
        eval_step(metrics, _split(n, logits), _split(n, labels), _split(n, loss))
        ref.update(logits=jnp.asarray(logits), labels=jnp.asarray(labels), values=loss)
        _assert_same(strategy.read(metrics).compute(), ref.compute())
    assert isinstance(metrics.loss.total.get_raw_value(), jm.SyncOnRead)
    with pytest.raises(TypeError, match=r"strategy.read\(metric\).compute\(\)"):
        metrics.compute()  # the components, not a value: the message says what to do
    # Reading leaves the caller's metrics as they were; reset works outside as usual.
    _assert_same(strategy.read(metrics).compute(), ref.compute())
    metrics.reset()
    ref.reset()
    for logits, labels, loss in _batches(n, steps=1):
        eval_step(metrics, _split(n, logits), _split(n, labels), _split(n, loss))
        ref.update(logits=jnp.asarray(logits), labels=jnp.asarray(labels), values=loss)
    _assert_same(strategy.read(metrics).compute(), ref.compute())


def test_metric_with_state_before_the_call_counts_it_once(strategy):
    n = strategy.num_replicas
    metrics, ref = _metrics(), _metrics()
    first = next(_batches(n, steps=1))
    for m in (metrics, ref):  # updated on the host before any replicated call
        m.update(logits=jnp.asarray(first[0]), labels=jnp.asarray(first[1]), values=first[2])

    @jm.replicate(strategy=strategy)
    def eval_step(metrics, logits, labels, loss):
        metrics.update(logits=logits, labels=labels, values=loss)

    for logits, labels, loss in _batches(n, steps=2):
        eval_step(metrics, _split(n, logits), _split(n, labels), _split(n, loss))
        ref.update(logits=jnp.asarray(logits), labels=jnp.asarray(labels), values=loss)
    _assert_same(strategy.read(metrics).compute(), ref.compute())


class Total(nnx.metrics.Metric):
    """A user metric whose state are sums."""

    def __init__(self):
        self.total = nnx.metrics.MetricState(jnp.zeros((2,), jnp.float32))

    def reset(self):
        self.total[...] = jnp.zeros((2,), jnp.float32)

    def update(self, *, values, **_):
        self.total[...] += values.sum(axis=0)

    def compute(self):
        return self.total[...]


class Largest(nnx.metrics.Metric):
    """A metric keeping a maximum in a plain Variable: not a sum."""

    def __init__(self):
        self.largest = nnx.Variable(jnp.asarray(-jnp.inf))

    def update(self, *, values, **_):
        self.largest[...] = jnp.maximum(self.largest[...], values.max())

    def compute(self):
        return self.largest[...]


def test_user_metric_of_sums(strategy):
    n = strategy.num_replicas
    metric, values = Total(), np.arange(n * 6, dtype=np.float32).reshape(n * 3, 2)

    @jm.replicate(strategy=strategy)
    def step(metric, values):
        metric.update(values=values)

    step(metric, _split(n, values))
    step(metric, _split(n, values))
    np.testing.assert_allclose(strategy.read(metric).compute(), 2 * values.sum(axis=0))


def test_metric_that_cannot_be_aggregated_is_a_type_error(strategy):
    n = strategy.num_replicas

    @jm.replicate(strategy=strategy)
    def step(metric, values):
        metric.update(values=values)

    with pytest.raises(TypeError, match="Largest"):
        step(Largest(), _split(n, np.ones((n, 2), np.float32)))


def test_welford_chan_combine_with_uneven_counts(strategy):
    n = strategy.num_replicas
    metric, ref = nnx.metrics.Welford(), nnx.metrics.Welford()
    rs = np.random.RandomState(1)
    values = (rs.randn(n, 6) * 3 + 1).astype(np.float32)
    mask = np.arange(6)[None, :] < (np.arange(n)[:, None] % 6 + 1)  # 1..6 values per replica

    @jm.replicate(strategy=strategy)
    def step(metric, values, mask):
        # Welford has no mask: update with each replica's real values only, one at a time.
        for i in range(6):
            count = metric.count[...]
            mean, m2 = metric.mean[...], metric.m2[...]
            metric.update(values=values[i : i + 1])
            keep = mask[i]
            metric.count[...] = jnp.where(keep, metric.count[...], count)
            metric.mean[...] = jnp.where(keep, metric.mean[...], mean)
            metric.m2[...] = jnp.where(keep, metric.m2[...], m2)

    step(metric, jm.PerReplica(values), jm.PerReplica(mask))
    ref.update(values=jnp.asarray(values[mask]))
    _assert_same(strategy.read(metric).compute(), ref.compute())


# --- checkpoints -------------------------------------------------------------------------------


def _assert_equal(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)


def _update(metrics, batch):
    logits, labels, loss = batch
    metrics.update(logits=jnp.asarray(logits), labels=jnp.asarray(labels), values=loss)


def test_sync_on_read_metrics_checkpoint_and_resume(strategy, tmp_path):
    # Oracle: the same metrics updated on one device with the global batches.
    n = strategy.num_replicas
    metrics = _metrics()
    batches = list(_batches(n, steps=4))

    @jm.replicate(strategy=strategy)
    def eval_step(metrics, logits, labels, loss):
        metrics.update(logits=logits, labels=labels, values=loss)

    def reference(batches):
        ref = _metrics()
        for batch in batches:
            _update(ref, batch)
        return ref.compute()

    for batch in batches[:2]:
        eval_step(metrics, *(_split(n, x) for x in batch))
    before = strategy.read(metrics).compute()
    _assert_same(before, reference(batches[:2]))
    jm.checkpoint.save(tmp_path / "c", {"metrics": metrics}, strategy=strategy)
    targets = {
        "eval_shape": nnx.eval_shape(_metrics),
        "fresh": _metrics(),  # never updated: plain values where components were saved
        "live": metrics,
    }
    for name, target in targets.items():
        out = jm.checkpoint.restore(tmp_path / "c", {"metrics": target}, strategy=strategy)
        restored = out["metrics"]
        assert type(restored) is nnx.MultiMetric and restored is not metrics, name
        assert isinstance(restored.loss.total.get_raw_value(), jm.SyncOnRead), name
        _assert_equal(strategy.read(restored).compute(), before)  # exactly, floats included
        # Steps go on from the restored state; reset works on it.
        eval_step(restored, *(_split(n, x) for x in batches[2]))
        _assert_same(strategy.read(restored).compute(), reference(batches[:3]))
        restored.reset()
        eval_step(restored, *(_split(n, x) for x in batches[3]))
        _assert_same(strategy.read(restored).compute(), reference(batches[3:]))
    # Restoring into the live metrics' structure left them as they were.
    _assert_equal(strategy.read(metrics).compute(), before)


def test_metrics_saved_before_any_step_restore_into_updated_metrics(strategy, tmp_path):
    n = strategy.num_replicas
    fresh, live = _metrics(), _metrics()
    batch = next(_batches(n, steps=1))
    _update(fresh, batch)  # updated on the host: plain values

    @jm.replicate(strategy=strategy)
    def eval_step(metrics, logits, labels, loss):
        metrics.update(logits=logits, labels=labels, values=loss)

    eval_step(live, *(_split(n, x) for x in batch))  # now sync-on-read components
    jm.checkpoint.save(tmp_path / "c", fresh, strategy=strategy)
    out = jm.checkpoint.restore(tmp_path / "c", live, strategy=strategy)
    _assert_same(strategy.read(out).compute(), fresh.compute())
    eval_step(out, *(_split(n, x) for x in batch))
    _update(fresh, batch)
    _assert_same(strategy.read(out).compute(), fresh.compute())


def test_metrics_restore_onto_another_replica_count(strategy, tmp_path):
    n = strategy.num_replicas
    if n < 3:
        pytest.skip("needs 3 replicas or more: restores onto 3 (a SUM / 3 would round)")
    other = jm.MirroredStrategy(num_devices=3, backend=strategy.backend)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average())

    @jm.replicate(strategy=strategy)
    def eval_step(metrics, logits, labels, loss):
        metrics.update(logits=logits, labels=labels, values=loss)

    eval_step(metrics, *(_split(n, x) for x in next(_batches(n, steps=1))))
    jm.checkpoint.save(tmp_path / "c", metrics, strategy=strategy)
    target = nnx.eval_shape(
        lambda: nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average())
    )
    out = jm.checkpoint.restore(tmp_path / "c", target, strategy=other)
    assert out.loss.total.get_raw_value().value.shape == (3,)
    _assert_equal(other.read(out).compute(), strategy.read(metrics).compute())
    # A float total that value / 3 would round (0.1 / 3 summed thrice is not 0.1): exact.
    total, values = Total(), np.zeros((n, 1, 2), np.float32)
    values[0] = 0.1
    eval_step(total, None, None, jm.PerReplica(values))
    jm.checkpoint.save(tmp_path / "t", total, strategy=strategy)
    out = jm.checkpoint.restore(tmp_path / "t", nnx.eval_shape(Total), strategy=other)
    np.testing.assert_array_equal(other.read(out).compute(), np.full(2, 0.1, np.float32))
    # A Welford's components cannot be spread over another N: the message names it.
    welford = nnx.metrics.Welford()
    eval_step(welford, None, None, _split(n, np.arange(2.0 * n, dtype=np.float32)))
    jm.checkpoint.save(tmp_path / "w", welford, strategy=strategy)
    with pytest.raises(ValueError, match=r"SyncOnRead \(aggregation NONE\).*'\.count"):
        jm.checkpoint.restore(tmp_path / "w", nnx.eval_shape(nnx.metrics.Welford), strategy=other)
