"""`jm.sync_batch_norm`: flax's NNX MNIST model, converted as it is.

Oracle: the unconverted model trained by `nnx.jit` on one device on the global batches.
"""

import flax.linen as nn
import jax
import nnx_data
import numpy as np
import optax
import pytest
from flax import nnx

import jmirror as jm
import jmirror.testing as jmt


class CNN(nnx.Module):
    """flax's NNX MNIST example model (examples/mnist), on 8x8 images: no axis_name anywhere."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(32, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=0.025)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm2 = nnx.BatchNorm(64, rngs=rngs)
        self.linear1 = nnx.Linear(64 * 2 * 2, 256, rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=0.025)
        self.linear2 = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs | None = None):
        pool = lambda x: nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2))  # noqa: E731
        x = pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
        x = pool(nnx.relu(self.batch_norm2(self.conv2(x))))
        x = x.reshape(x.shape[0], -1)
        x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
        return self.linear2(x)


def _model():
    model = CNN(rngs=nnx.Rngs(0))
    # Dropout off for the comparison; BatchNorm stays in training mode (batch statistics).
    model.set_attributes(nnx.Dropout, deterministic=True)
    return model


_loss, _split = nnx_data.loss, nnx_data.split


def _data(n, steps, per_replica=2):
    return nnx_data.data(n, steps, per_replica, side=8, classes=10)


def test_converted_mnist_model_trains_like_one_device_on_the_global_batch(strategy):
    n = strategy.num_replicas
    xs, ys = _data(n, steps=3)
    model = _model()
    assert jm.sync_batch_norm(model, strategy) is model
    optimizer = nnx.Optimizer(model, optax.sgd(0.05, momentum=0.9), wrt=nnx.Param)
    ref_model = _model()
    ref_optimizer = nnx.Optimizer(ref_model, optax.sgd(0.05, momentum=0.9), wrt=nnx.Param)

    @jm.replicate(strategy=strategy)
    def train_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(_loss)(model, x, y)
        optimizer.update(model, jm.all_reduce("mean", grads))
        return jm.all_reduce("mean", loss)

    @nnx.jit
    def ref_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(_loss)(model, x, y)
        optimizer.update(model, grads)
        return loss

    for x, y in zip(xs, ys):
        loss = train_step(model, optimizer, _split(n, x), _split(n, y))
        ref_loss = ref_step(ref_model, ref_optimizer, x, y)
        np.testing.assert_allclose(strategy.read(loss), ref_loss, rtol=1e-5)
    jmt.assert_mirrored(nnx.state(model), strategy)  # running statistics included
    got = strategy.read(nnx.state(model))
    want = nnx.state(ref_model)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    for layer, ref in [
        (model.batch_norm1, ref_model.batch_norm1),
        (model.batch_norm2, ref_model.batch_norm2),
    ]:
        assert not np.allclose(ref.mean[...], 0.0)  # the statistics moved
        np.testing.assert_allclose(strategy.read(layer.mean[...]), ref.mean[...], rtol=1e-5)
        np.testing.assert_allclose(strategy.read(layer.var[...]), ref.var[...], rtol=1e-5)


def test_every_reachable_batch_norm_gets_the_strategy_axis_name():
    strategy = jm.MirroredStrategy(axis_name="batch")
    rngs = nnx.Rngs(0)
    shared = nnx.BatchNorm(3, rngs=rngs)
    model = nnx.Sequential(shared, nnx.Linear(3, 3, rngs=rngs), shared, nnx.BatchNorm(3, rngs=rngs))
    assert jm.sync_batch_norm(model, strategy=strategy) is model
    assert [m.axis_name for m in model.layers if isinstance(m, nnx.BatchNorm)] == ["batch"] * 3
    assert model.layers[1].in_features == 3  # other layers untouched
    inside = nnx.List([nnx.BatchNorm(2, rngs=rngs)])  # an NNX container of modules
    assert jm.sync_batch_norm(inside, strategy)[0].axis_name == "batch"


def test_the_current_strategy_is_used_by_default():
    model = CNN(rngs=nnx.Rngs(0))
    with jm.MirroredStrategy(axis_name="in_scope").scope():
        jm.sync_batch_norm(model)
    assert model.batch_norm1.axis_name == model.batch_norm2.axis_name == "in_scope"
    other = jm.sync_batch_norm(CNN(rngs=nnx.Rngs(0)))
    assert other.batch_norm1.axis_name == jm.get_strategy().axis_name
    assert jm.sync_batch_norm(model, jm.MirroredStrategy(axis_name="in_scope")) is model


def test_a_batch_norm_over_another_axis_is_refused():
    model = nnx.Sequential(nnx.BatchNorm(3, axis_name="data", rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"\.layers\[0\].*'data'.*'replica'"):
        jm.sync_batch_norm(model, jm.MirroredStrategy())
    assert model.layers[0].axis_name == "data"


def test_linen_modules_and_other_values_are_type_errors():
    with pytest.raises(TypeError, match=r"linen.*nn\.BatchNorm\(\.\.\., axis_name='replica'\)"):
        jm.sync_batch_norm(nn.BatchNorm(), jm.MirroredStrategy())
    for value in ({"w": np.zeros(3)}, np.zeros(3), None):
        with pytest.raises(TypeError, match="expects a flax NNX object"):
            jm.sync_batch_norm(value)
