"""nnx.metrics updated inside replica functions are sync-on-read (SPEC 11).

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
