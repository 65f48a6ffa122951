# jaxtyping's shape strings ("batch 1 28 28") are not Python expressions.
# ruff: noqa: F722
"""equinox's own examples, ported to `jm.replicate` as a new user would.

Each example's model code (and loss) is copied unchanged from equinox's documentation
(`docs/examples/*.ipynb` of patrick-kidger/equinox); only the training step changes: it runs
through `jm.replicate` with one `jm.all_reduce("mean", grads)` (and `jm.replica_key` where the
example draws dropout keys from one key per batch). The oracle is the example's own step,
under `eqx.filter_jit` on one device over the same global batches (for the sharding example:
its own `NamedSharding` step). Data are synthetic and sizes tiny; nothing is downloaded.

The last test runs every code block of the README's equinox section, in order.
"""

# Annotations unevaluated, as the examples (`jax.random.PRNGKey | None`) need.
from __future__ import annotations

import functools
import math
import operator
import pathlib
import re
from collections.abc import Mapping

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
import jax.random as jrandom
import jax.sharding as jshard
import jax.tree_util as jtu
import numpy as np
import optax
import pytest
from jaxtyping import Array, Float, Int, PyTree

import jmirror as jm
import jmirror.testing as jmt


@pytest.fixture
def backend():
    """Runs each example on the default backend; two of them run on `shard_map` instead
    (`parametrize("backend", ...)`), so that both are covered and the file stays quick."""
    return "pmap"


# Parameters after a few optimizer steps: the gradients are means over the same examples, summed
# in another order (per replica, then across replicas), so they agree to float32 rounding.
RTOL, ATOL = 1e-5, 1e-6


def _split(n, x):
    """Returns the global batch `x` (a pytree) as a `PerReplica`, consecutive rows per replica."""
    return jm.PerReplica(jax.tree.map(lambda a: np.asarray(a).reshape(n, -1, *a.shape[1:]), x))


def _assert_arrays_close(strategy, got, want, rtol=RTOL, atol=ATOL):
    """Compares the array leaves of `got` (mirrored, read) with `want`, leaf by leaf."""
    got = jax.tree.leaves(eqx.filter(strategy.read(got), eqx.is_array))
    want = jax.tree.leaves(eqx.filter(want, eqx.is_array))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


# --- mnist.ipynb: a CNN with functions and a pooling layer among its layers --------------------


class CNN(eqx.Module):
    layers: list

    def __init__(self, key):
        key1, key2, key3, key4 = jax.random.split(key, 4)
        # Standard CNN setup: convolutional layer, followed by flattening,
        # with a small MLP on top.
        self.layers = [
            eqx.nn.Conv2d(1, 3, kernel_size=4, key=key1),
            eqx.nn.MaxPool2d(kernel_size=2),
            jax.nn.relu,
            jnp.ravel,
            eqx.nn.Linear(1728, 512, key=key2),
            jax.nn.sigmoid,
            eqx.nn.Linear(512, 64, key=key3),
            jax.nn.relu,
            eqx.nn.Linear(64, 10, key=key4),
            jax.nn.log_softmax,
        ]

    def __call__(self, x: Float[Array, "1 28 28"]) -> Float[Array, "10"]:  # noqa: UP037
        for layer in self.layers:
            x = layer(x)
        return x


def loss(model: CNN, x: Float[Array, "batch 1 28 28"], y: Int[Array, " batch"]) -> Float[Array, ""]:
    # Our input has the shape (BATCH_SIZE, 1, 28, 28), but our model operations on
    # a single input input image of shape (1, 28, 28).
    #
    # Therefore, we have to use jax.vmap, which in this case maps our model over the
    # leading (batch) axis.
    pred_y = jax.vmap(model)(x)
    return cross_entropy(y, pred_y)


def cross_entropy(y: Int[Array, " batch"], pred_y: Float[Array, "batch 10"]) -> Float[Array, ""]:
    # y are the true targets, and should be integers 0-9.
    # pred_y are the log-softmax'd predictions.
    pred_y = jnp.take_along_axis(pred_y, jnp.expand_dims(y, 1), axis=1)
    return -jnp.mean(pred_y)


loss = eqx.filter_jit(loss)  # JIT our loss function from earlier!


@eqx.filter_jit
def compute_accuracy(
    model: CNN, x: Float[Array, "batch 1 28 28"], y: Int[Array, " batch"]
) -> Float[Array, ""]:
    """This function takes as input the current model
    and computes the average accuracy on a batch.
    """
    pred_y = jax.vmap(model)(x)
    pred_y = jnp.argmax(pred_y, axis=1)
    return jnp.mean(y == pred_y)


def test_mnist_cnn(strategy, n):
    LEARNING_RATE = 3e-4
    key = jax.random.PRNGKey(5678)
    key, subkey = jax.random.split(key, 2)
    model = CNN(subkey)
    optim = optax.adamw(LEARNING_RATE)
    opt_state = optim.init(eqx.filter(model, eqx.is_array))

    # The example's step, as it wrote it.
    @eqx.filter_jit
    def make_step(
        model: CNN,
        opt_state: PyTree,
        x: Float[Array, "batch 1 28 28"],
        y: Int[Array, " batch"],
    ):
        loss_value, grads = eqx.filter_value_and_grad(loss)(model, x, y)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        return model, opt_state, loss_value

    # The same step on every replica: one all_reduce.
    @jm.replicate(strategy=strategy)
    def replicated_step(model, opt_state, x, y):
        loss_value, grads = eqx.filter_value_and_grad(loss)(model, x, y)
        grads = jm.all_reduce("mean", grads)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        return model, opt_state, jm.all_reduce("mean", loss_value)

    @jm.replicate(strategy=strategy)
    def replicated_accuracy(model, x, y):
        return jm.all_reduce("mean", compute_accuracy(model, x, y))

    rng = np.random.RandomState(0)
    batches = [
        (rng.randn(2 * n, 1, 28, 28).astype(np.float32), rng.randint(0, 10, 2 * n))
        for _ in range(3)
    ]
    want, want_state = model, opt_state
    got, got_state = strategy.mirror((model, opt_state))
    for x, y in batches:
        want, want_state, want_loss = make_step(want, want_state, x, y)
        got, got_state, got_loss = replicated_step(got, got_state, _split(n, x), _split(n, y))
        np.testing.assert_allclose(strategy.read(got_loss), want_loss, rtol=RTOL)
    _assert_arrays_close(strategy, got, want)
    assert replicated_step.num_compilations == 1
    # The functions among the layers come back as the same objects.
    assert [type(a) for a in got.layers] == [type(b) for b in model.layers]
    assert got.layers[2] is jax.nn.relu and got.layers[3] is jnp.ravel
    jmt.assert_mirrored(eqx.filter(got, eqx.is_array), strategy)
    x, y = batches[0]
    np.testing.assert_allclose(
        strategy.read(replicated_accuracy(got, _split(n, x), _split(n, y))),
        compute_accuracy(want, x, y),
        rtol=RTOL,
    )


# --- train_rnn.ipynb: a GRU cell under lax.scan, a Python int field ------------------------------


def dataloader(arrays, batch_size):
    dataset_size = arrays[0].shape[0]
    assert all(array.shape[0] == dataset_size for array in arrays)
    indices = np.arange(dataset_size)
    while True:
        perm = np.random.permutation(indices)
        start = 0
        end = batch_size
        while end <= dataset_size:
            batch_perm = perm[start:end]
            yield tuple(array[batch_perm] for array in arrays)
            start = end
            end = start + batch_size


def get_data(dataset_size, *, key):
    t = jnp.linspace(0, 2 * math.pi, 16)
    offset = jrandom.uniform(key, (dataset_size, 1), minval=0, maxval=2 * math.pi)
    x1 = jnp.sin(t + offset) / (1 + t)
    x2 = jnp.cos(t + offset) / (1 + t)
    y = jnp.ones((dataset_size, 1))

    half_dataset_size = dataset_size // 2
    x1 = x1.at[:half_dataset_size].multiply(-1)
    y = y.at[:half_dataset_size].set(0)
    x = jnp.stack([x1, x2], axis=-1)

    return x, y


class RNN(eqx.Module):
    hidden_size: int
    cell: eqx.Module
    linear: eqx.nn.Linear
    bias: jax.Array

    def __init__(self, in_size, out_size, hidden_size, *, key):
        ckey, lkey = jrandom.split(key)
        self.hidden_size = hidden_size
        self.cell = eqx.nn.GRUCell(in_size, hidden_size, key=ckey)
        self.linear = eqx.nn.Linear(hidden_size, out_size, use_bias=False, key=lkey)
        self.bias = jnp.zeros(out_size)

    def __call__(self, input):
        hidden = jnp.zeros((self.hidden_size,))

        def f(carry, inp):
            return self.cell(inp, carry), None

        out, _ = lax.scan(f, hidden, input)
        # sigmoid because we're performing binary classification
        return jax.nn.sigmoid(self.linear(out) + self.bias)


@pytest.mark.parametrize("backend", ["shard_map"])
def test_train_rnn(strategy, n):
    dataset_size, batch_size, learning_rate, steps, hidden_size, seed = 64, 4 * n, 3e-3, 4, 16, 5678
    data_key, model_key = jrandom.split(jrandom.PRNGKey(seed), 2)
    xs, ys = get_data(dataset_size * n, key=data_key)
    np.random.seed(0)
    iter_data = dataloader((np.asarray(xs), np.asarray(ys)), batch_size)
    batches = [next(iter_data) for _ in range(steps)]

    model = RNN(in_size=2, out_size=1, hidden_size=hidden_size, key=model_key)

    @eqx.filter_value_and_grad
    def compute_loss(model, x, y):
        pred_y = jax.vmap(model)(x)
        # Trains with respect to binary cross-entropy
        return -jnp.mean(y * jnp.log(pred_y) + (1 - y) * jnp.log(1 - pred_y))

    @eqx.filter_jit
    def make_step(model, x, y, opt_state):
        loss, grads = compute_loss(model, x, y)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        return loss, model, opt_state

    @jm.replicate(strategy=strategy)
    def replicated_step(model, x, y, opt_state):
        loss, grads = compute_loss(model, x, y)
        grads = jm.all_reduce("mean", grads)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        return jm.all_reduce("mean", loss), model, opt_state

    optim = optax.adam(learning_rate)
    opt_state = optim.init(eqx.filter(model, eqx.is_array))
    want, want_state = model, opt_state
    got, got_state = model, opt_state  # not mirrored yet: the first call places them
    for x, y in batches:
        want_loss, want, want_state = make_step(want, x, y, want_state)
        got_loss, got, got_state = replicated_step(got, _split(n, x), _split(n, y), got_state)
        np.testing.assert_allclose(strategy.read(got_loss), want_loss, rtol=RTOL)
    _assert_arrays_close(strategy, got, want)
    assert got.hidden_size == hidden_size and isinstance(got.hidden_size, int)
    assert replicated_step.num_compilations == 1


# --- stateful.ipynb: BatchNorm and SpectralNorm state in an eqx.nn.State ------------------------


class Model(eqx.Module):
    norm1: eqx.nn.BatchNorm
    spectral_linear: eqx.nn.SpectralNorm[eqx.nn.Linear]
    norm2: eqx.nn.BatchNorm
    linear1: eqx.nn.Linear
    linear2: eqx.nn.Linear

    def __init__(self, key):
        key1, key2, key3, key4 = jr.split(key, 4)
        self.norm1 = eqx.nn.BatchNorm(input_size=3, axis_name="batch")
        self.spectral_linear = eqx.nn.SpectralNorm(
            layer=eqx.nn.Linear(in_features=3, out_features=32, key=key1),
            weight_name="weight",
            key=key2,
        )
        self.norm2 = eqx.nn.BatchNorm(input_size=32, axis_name="batch")
        self.linear1 = eqx.nn.Linear(in_features=32, out_features=32, key=key3)
        self.linear2 = eqx.nn.Linear(in_features=32, out_features=3, key=key4)

    def __call__(self, x, state):
        x, state = self.norm1(x, state)
        x, state = self.spectral_linear(x, state)
        x = jax.nn.relu(x)
        x, state = self.norm2(x, state)
        x = self.linear1(x)
        x = jax.nn.relu(x)
        x = self.linear2(x)
        return x, state


def compute_loss(model, state, xs, ys):
    batch_model = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    pred_ys, state = batch_model(xs, state)
    loss = jnp.mean((pred_ys - ys) ** 2)
    return loss, state


@pytest.mark.filterwarnings("ignore:.*mode.*:UserWarning")  # equinox's BatchNorm mode notice
@pytest.mark.parametrize("fix", ["sync_batch_norm", "none"])
def test_stateful_batch_norm_and_spectral_norm(strategy, n, fix):
    dataset_size, learning_rate, steps, seed = 4 * n, 3e-4, 3, 5678
    key = jr.PRNGKey(seed)
    mkey, xkey, xkey2 = jr.split(key, 3)
    model, state = eqx.nn.make_with_state(Model)(mkey)
    xs = jr.normal(xkey, (dataset_size, 3))
    ys = jnp.sin(xs) + 1
    optim = optax.adam(learning_rate)
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def make_step(model, state, opt_state, xs, ys):
        grads, state = eqx.filter_grad(compute_loss, has_aux=True)(model, state, xs, ys)
        updates, opt_state = optim.update(grads, opt_state)
        model = eqx.apply_updates(model, updates)
        return model, state, opt_state

    @jm.replicate(strategy=strategy)
    def replicated_step(model, state, opt_state, xs, ys):
        grads, state = eqx.filter_grad(compute_loss, has_aux=True)(model, state, xs, ys)
        grads = jm.all_reduce("mean", grads)
        updates, opt_state = optim.update(grads, opt_state)
        model = eqx.apply_updates(model, updates)
        return model, state, opt_state

    if fix == "none":
        if n == 1:
            pytest.skip("one replica: the statistics cannot diverge")
        # The model as written normalizes over one replica's batch: refused, naming the fixes.
        with pytest.raises(jm.MirroredStateError, match=r"(?s)BatchNorm.*jm\.sync_batch_norm"):
            replicated_step(model, strategy.mirror(state), opt_state, _split(n, xs), _split(n, ys))
        return
    converted = jm.sync_batch_norm(model, strategy)
    want = (model, state, opt_state)
    got = strategy.mirror((converted, state, opt_state))
    for _ in range(steps):  # full-batch gradient descent, as the example trains
        want = make_step(*want, xs, ys)
        got = replicated_step(*got, _split(n, xs), _split(n, ys))

    # The bias just before norm2 has no gradient, analytically (the normalization removes any
    # shift): both runs compute rounding noise there, which adam scales up to its step size,
    # so that leaf agrees to steps * learning_rate only; every other leaf to RTOL.
    def bias(m):
        return m.spectral_linear.layer.bias

    np.testing.assert_allclose(
        bias(strategy.read(got[0])), bias(want[0]), atol=steps * learning_rate
    )
    got_model = eqx.tree_at(bias, got[0], bias(want[0]))
    _assert_arrays_close(strategy, got_model, want[0])
    _assert_arrays_close(strategy, got[1], want[1])  # running statistics, power iterations
    jmt.assert_mirrored(got[1], strategy)

    # Inference, as the example evaluates: the trained, converted model in inference mode,
    # against the example's evaluation of the same model read onto one device.
    @eqx.filter_jit
    def evaluate(model, xs):
        # discard state
        out, _ = jax.vmap(model)(xs)
        return out

    test_xs = jr.normal(xkey2, (2 * n, 3))
    trained, trained_state = strategy.read((got[0], got[1]))
    inference_model = eqx.nn.inference_mode(trained)
    inference_model = eqx.Partial(inference_model, state=trained_state)
    got_inference = eqx.Partial(eqx.nn.inference_mode(got[0]), state=got[1])
    out = jm.replicate(evaluate, strategy=strategy)(got_inference, _split(n, test_xs))
    out = np.concatenate([np.asarray(c) for c in strategy.local_results(out)])
    ids = list(strategy.topology.local_replica_ids)
    want_out = np.asarray(evaluate(inference_model, test_xs)).reshape(n, 2, 3)[ids]
    np.testing.assert_allclose(out, want_out.reshape(-1, 3), rtol=RTOL, atol=ATOL)


# --- frozen_layer.ipynb: a filter spec, partition and combine inside the step ------------------


@pytest.mark.parametrize("backend", ["shard_map"])
def test_frozen_layer(strategy, n):
    batch_size, learning_rate, steps, width_size, depth, seed = 8 * n, 3e-3, 4, 8, 1, 5678
    data_key, model_key = jrandom.split(jrandom.PRNGKey(seed), 2)
    x = np.asarray(jrandom.normal(data_key, (steps * batch_size, 1)))
    data = (x, 5 * x - 2)

    # Step 1
    model = eqx.nn.MLP(in_size=1, out_size=1, width_size=width_size, depth=depth, key=model_key)

    # Step 2
    filter_spec = jtu.tree_map(lambda _: False, model)
    filter_spec = eqx.tree_at(
        lambda tree: (tree.layers[-1].weight, tree.layers[-1].bias),
        filter_spec,
        replace=(True, True),
    )

    # Step 3
    @eqx.filter_jit
    def make_step(model, x, y, opt_state):
        @eqx.filter_grad
        def loss(diff_model, static_model, x, y):
            model = eqx.combine(diff_model, static_model)
            pred_y = jax.vmap(model)(x)
            return jnp.mean((y - pred_y) ** 2)

        diff_model, static_model = eqx.partition(model, filter_spec)
        grads = loss(diff_model, static_model, x, y)
        updates, opt_state = optim.update(grads, opt_state)
        model = eqx.apply_updates(model, updates)
        return model, opt_state

    @jm.replicate(strategy=strategy)
    def replicated_step(model, x, y, opt_state):
        @eqx.filter_grad
        def loss(diff_model, static_model, x, y):
            model = eqx.combine(diff_model, static_model)
            pred_y = jax.vmap(model)(x)
            return jnp.mean((y - pred_y) ** 2)

        diff_model, static_model = eqx.partition(model, filter_spec)
        grads = jm.all_reduce("mean", loss(diff_model, static_model, x, y))
        updates, opt_state = optim.update(grads, opt_state)
        model = eqx.apply_updates(model, updates)
        return model, opt_state

    optim = optax.sgd(learning_rate)
    opt_state = optim.init(model)
    want, got = (model, opt_state), strategy.mirror((model, opt_state))
    for i in range(steps):
        x, y = (a[i * batch_size : (i + 1) * batch_size] for a in data)
        want = make_step(want[0], x, y, want[1])
        got = replicated_step(got[0], _split(n, x), _split(n, y), got[1])
    _assert_arrays_close(strategy, got[0], want[0])
    # The frozen first layer is untouched, bit for bit.
    np.testing.assert_array_equal(
        np.asarray(strategy.read(got[0]).layers[0].weight), np.asarray(model.layers[0].weight)
    )


# --- parallelism.ipynb: the example's own data parallelism (NamedSharding) as the oracle --------


def test_parallelism_example_equals_its_named_sharding_step(strategy, n):
    dataset_size, channel_size, hidden_size, depth = 64, 4, 32, 1
    learning_rate, num_steps, batch_size = 3e-4, 4, 2 * n
    rng = np.random.RandomState(0)
    xs = rng.normal(size=(dataset_size, channel_size)).astype(np.float32)
    ys = np.sin(xs)

    model = eqx.nn.MLP(channel_size, channel_size, hidden_size, depth, key=jr.PRNGKey(6789))
    optim = optax.adam(learning_rate)
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))

    def compute_loss(model, x, y):
        pred_y = jax.vmap(model)(x)
        return jnp.mean((y - pred_y) ** 2)

    num_devices = len(jax.devices())
    mesh = jax.make_mesh((num_devices,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))
    data_sharding = jshard.NamedSharding(mesh, jshard.PartitionSpec("batch"))
    model_sharding = jshard.NamedSharding(mesh, jshard.PartitionSpec())

    @eqx.filter_jit(donate="all")
    def train_step(model, opt_state, x, y):
        model, opt_state = eqx.filter_shard((model, opt_state), model_sharding)
        x, y = eqx.filter_shard((x, y), data_sharding)
        grads = eqx.filter_grad(compute_loss)(model, x, y)
        updates, opt_state = optim.update(grads, opt_state)
        model = eqx.apply_updates(model, updates)
        return eqx.filter_shard((model, opt_state), model_sharding)

    @jm.replicate(strategy=strategy, donate_argnums=(0, 1))
    def replicated_step(model, opt_state, x, y):
        grads = jm.all_reduce("mean", eqx.filter_grad(compute_loss)(model, x, y))
        updates, opt_state = optim.update(grads, opt_state)
        model = eqx.apply_updates(model, updates)
        return model, opt_state

    batches = [
        (xs[i * batch_size : (i + 1) * batch_size], ys[i * batch_size : (i + 1) * batch_size])
        for i in range(num_steps)
    ]
    got = strategy.mirror((model, opt_state))
    want = eqx.filter_shard((model, opt_state), model_sharding)
    for x, y in batches:
        got = replicated_step(*got, _split(n, x), _split(n, y))
        x, y = eqx.filter_shard((x, y), data_sharding)
        want = train_step(*want, x, y)
    _assert_arrays_close(strategy, got, want)
    # The example's arrays (on its own mesh) are taken as they are: the same value.
    again = replicated_step(
        *strategy.mirror(want), _split(n, batches[0][0]), _split(n, ys[: 2 * n])
    )
    reference = train_step(*want, *eqx.filter_shard((batches[0][0], ys[: 2 * n]), data_sharding))
    _assert_arrays_close(strategy, again, reference)


# --- bert.ipynb: attention, dropout, one key per batch (the example's own pmap step) ------------


class EmbedderBlock(eqx.Module):
    """BERT embedder."""

    token_embedder: eqx.nn.Embedding
    segment_embedder: eqx.nn.Embedding
    position_embedder: eqx.nn.Embedding
    layernorm: eqx.nn.LayerNorm
    dropout: eqx.nn.Dropout

    def __init__(
        self,
        vocab_size: int,
        max_length: int,
        type_vocab_size: int,
        embedding_size: int,
        hidden_size: int,
        dropout_rate: float,
        key: jax.random.PRNGKey,
    ):
        token_key, segment_key, position_key = jax.random.split(key, 3)

        self.token_embedder = eqx.nn.Embedding(
            num_embeddings=vocab_size, embedding_size=embedding_size, key=token_key
        )
        self.segment_embedder = eqx.nn.Embedding(
            num_embeddings=type_vocab_size,
            embedding_size=embedding_size,
            key=segment_key,
        )
        self.position_embedder = eqx.nn.Embedding(
            num_embeddings=max_length, embedding_size=embedding_size, key=position_key
        )
        self.layernorm = eqx.nn.LayerNorm(shape=hidden_size)
        self.dropout = eqx.nn.Dropout(dropout_rate)

    def __call__(
        self,
        token_ids: Int[Array, " seq_len"],
        position_ids: Int[Array, " seq_len"],
        segment_ids: Int[Array, " seq_len"],
        enable_dropout: bool = False,
        key: jax.random.PRNGKey | None = None,
    ) -> Float[Array, "seq_len hidden_size"]:
        tokens = jax.vmap(self.token_embedder)(token_ids)
        segments = jax.vmap(self.segment_embedder)(segment_ids)
        positions = jax.vmap(self.position_embedder)(position_ids)
        embedded_inputs = tokens + segments + positions
        embedded_inputs = jax.vmap(self.layernorm)(embedded_inputs)
        embedded_inputs = self.dropout(embedded_inputs, inference=not enable_dropout, key=key)
        return embedded_inputs


class FeedForwardBlock(eqx.Module):
    """A single transformer feed forward block."""

    mlp: eqx.nn.Linear
    output: eqx.nn.Linear
    layernorm: eqx.nn.LayerNorm
    dropout: eqx.nn.Dropout

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        dropout_rate: float,
        key: jax.random.PRNGKey,
    ):
        mlp_key, output_key = jax.random.split(key)
        self.mlp = eqx.nn.Linear(
            in_features=hidden_size, out_features=intermediate_size, key=mlp_key
        )
        self.output = eqx.nn.Linear(
            in_features=intermediate_size, out_features=hidden_size, key=output_key
        )

        self.layernorm = eqx.nn.LayerNorm(shape=hidden_size)
        self.dropout = eqx.nn.Dropout(dropout_rate)

    def __call__(
        self,
        inputs: Float[Array, " hidden_size"],
        enable_dropout: bool = True,
        key: jax.random.PRNGKey | None = None,
    ) -> Float[Array, " hidden_size"]:
        # Feed-forward.
        hidden = self.mlp(inputs)
        hidden = jax.nn.gelu(hidden)

        # Project back to input size.
        output = self.output(hidden)
        output = self.dropout(output, inference=not enable_dropout, key=key)

        # Residual and layer norm.
        output += inputs
        output = self.layernorm(output)

        return output


class AttentionBlock(eqx.Module):
    """A single transformer attention block."""

    attention: eqx.nn.MultiheadAttention
    layernorm: eqx.nn.LayerNorm
    dropout: eqx.nn.Dropout
    num_heads: int = eqx.field(static=True)

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        dropout_rate: float,
        attention_dropout_rate: float,
        key: jax.random.PRNGKey,
    ):
        self.num_heads = num_heads
        self.attention = eqx.nn.MultiheadAttention(
            num_heads=num_heads,
            query_size=hidden_size,
            use_query_bias=True,
            use_key_bias=True,
            use_value_bias=True,
            use_output_bias=True,
            dropout_p=attention_dropout_rate,
            key=key,
        )
        self.layernorm = eqx.nn.LayerNorm(shape=hidden_size)
        self.dropout = eqx.nn.Dropout(dropout_rate)

    def __call__(
        self,
        inputs: Float[Array, "seq_len hidden_size"],
        mask: Int[Array, " seq_len"] | None,
        enable_dropout: bool = False,
        key: "jax.random.PRNGKey" = None,  # noqa: UP037
    ) -> Float[Array, "seq_len hidden_size"]:
        if mask is not None:
            mask = self.make_self_attention_mask(mask)
        attention_key, dropout_key = (None, None) if key is None else jax.random.split(key)

        attention_output = self.attention(
            query=inputs,
            key_=inputs,
            value=inputs,
            mask=mask,
            inference=not enable_dropout,
            key=attention_key,
        )

        result = attention_output
        result = self.dropout(result, inference=not enable_dropout, key=dropout_key)
        result = result + inputs
        result = jax.vmap(self.layernorm)(result)
        return result

    def make_self_attention_mask(
        self, mask: Int[Array, " seq_len"]
    ) -> Float[Array, "num_heads seq_len seq_len"]:
        """Create self-attention mask from sequence-level mask."""
        mask = jnp.multiply(jnp.expand_dims(mask, axis=-1), jnp.expand_dims(mask, axis=-2))
        mask = jnp.expand_dims(mask, axis=-3)
        mask = jnp.repeat(mask, repeats=self.num_heads, axis=-3)
        return mask.astype(jnp.float32)


class TransformerLayer(eqx.Module):
    """A single transformer layer."""

    attention_block: AttentionBlock
    ff_block: FeedForwardBlock

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_heads: int,
        dropout_rate: float,
        attention_dropout_rate: float,
        key: jax.random.PRNGKey,
    ):
        attention_key, ff_key = jax.random.split(key)

        self.attention_block = AttentionBlock(
            hidden_size=hidden_size,
            num_heads=num_heads,
            dropout_rate=dropout_rate,
            attention_dropout_rate=attention_dropout_rate,
            key=attention_key,
        )
        self.ff_block = FeedForwardBlock(
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            dropout_rate=dropout_rate,
            key=ff_key,
        )

    def __call__(
        self,
        inputs: Float[Array, "seq_len hidden_size"],
        mask: Int[Array, " seq_len"] | None = None,
        *,
        enable_dropout: bool = False,
        key: jax.random.PRNGKey | None = None,
    ) -> Float[Array, "seq_len hidden_size"]:
        attn_key, ff_key = (None, None) if key is None else jax.random.split(key)
        attention_output = self.attention_block(
            inputs, mask, enable_dropout=enable_dropout, key=attn_key
        )
        seq_len = inputs.shape[0]
        ff_keys = None if ff_key is None else jax.random.split(ff_key, num=seq_len)
        output = jax.vmap(self.ff_block, in_axes=(0, None, 0))(
            attention_output, enable_dropout, ff_keys
        )
        return output


class Encoder(eqx.Module):
    """Full BERT encoder."""

    embedder_block: EmbedderBlock
    layers: list[TransformerLayer]
    pooler: eqx.nn.Linear

    def __init__(
        self,
        vocab_size: int,
        max_length: int,
        type_vocab_size: int,
        embedding_size: int,
        hidden_size: int,
        intermediate_size: int,
        num_layers: int,
        num_heads: int,
        dropout_rate: float,
        attention_dropout_rate: float,
        key: jax.random.PRNGKey,
    ):
        embedder_key, layer_key, pooler_key = jax.random.split(key, num=3)
        self.embedder_block = EmbedderBlock(
            vocab_size=vocab_size,
            max_length=max_length,
            type_vocab_size=type_vocab_size,
            embedding_size=embedding_size,
            hidden_size=hidden_size,
            dropout_rate=dropout_rate,
            key=embedder_key,
        )

        layer_keys = jax.random.split(layer_key, num=num_layers)
        self.layers = []
        for layer_key in layer_keys:
            self.layers.append(
                TransformerLayer(
                    hidden_size=hidden_size,
                    intermediate_size=intermediate_size,
                    num_heads=num_heads,
                    dropout_rate=dropout_rate,
                    attention_dropout_rate=attention_dropout_rate,
                    key=layer_key,
                )
            )

        self.pooler = eqx.nn.Linear(
            in_features=hidden_size, out_features=hidden_size, key=pooler_key
        )

    def __call__(
        self,
        token_ids: Int[Array, " seq_len"],
        position_ids: Int[Array, " seq_len"],
        segment_ids: Int[Array, " seq_len"],
        *,
        enable_dropout: bool = False,
        key: jax.random.PRNGKey | None = None,
    ) -> dict[str, Array]:
        emb_key, l_key = (None, None) if key is None else jax.random.split(key)

        embeddings = self.embedder_block(
            token_ids=token_ids,
            position_ids=position_ids,
            segment_ids=segment_ids,
            enable_dropout=enable_dropout,
            key=emb_key,
        )

        # We assume that all 0-values should be masked out.
        mask = jnp.asarray(token_ids != 0, dtype=jnp.int32)

        x = embeddings
        layer_outputs = []
        for layer in self.layers:
            cl_key, l_key = (None, None) if l_key is None else jax.random.split(l_key)
            x = layer(x, mask, enable_dropout=enable_dropout, key=cl_key)
            layer_outputs.append(x)

        # BERT pooling.
        # The first token in the last layer is the embedding of the "[CLS]" token.
        first_token_last_layer = x[..., 0, :]
        pooled = self.pooler(first_token_last_layer)
        pooled = jnp.tanh(pooled)

        return {"embeddings": embeddings, "layers": layer_outputs, "pooled": pooled}


class BertClassifier(eqx.Module):
    """BERT classifier."""

    encoder: Encoder
    classifier_head: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __init__(self, config: Mapping, num_classes: int, key: jax.random.PRNGKey):
        encoder_key, head_key = jax.random.split(key)

        self.encoder = Encoder(
            vocab_size=config["vocab_size"],
            max_length=config["max_position_embeddings"],
            type_vocab_size=config["type_vocab_size"],
            embedding_size=config["hidden_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=config["num_attention_heads"],
            dropout_rate=config["hidden_dropout_prob"],
            attention_dropout_rate=config["attention_probs_dropout_prob"],
            key=encoder_key,
        )
        self.classifier_head = eqx.nn.Linear(
            in_features=config["hidden_size"], out_features=num_classes, key=head_key
        )
        self.dropout = eqx.nn.Dropout(config["hidden_dropout_prob"])

    def __call__(
        self,
        inputs: dict[str, Int[Array, " seq_len"]],
        enable_dropout: bool = True,
        key: jax.random.PRNGKey = None,
    ) -> Float[Array, " num_classes"]:
        seq_len = inputs["token_ids"].shape[-1]
        position_ids = jnp.arange(seq_len)

        e_key, d_key = (None, None) if key is None else jax.random.split(key)

        pooled_output = self.encoder(
            token_ids=inputs["token_ids"],
            segment_ids=inputs["segment_ids"],
            position_ids=position_ids,
            enable_dropout=enable_dropout,
            key=e_key,
        )["pooled"]
        pooled_output = self.dropout(pooled_output, inference=not enable_dropout, key=d_key)

        return self.classifier_head(pooled_output)


@eqx.filter_value_and_grad
def compute_bert_loss(classifier, inputs, key):
    batch_size = inputs["token_ids"].shape[0]
    batched_keys = jax.random.split(key, num=batch_size)
    logits = jax.vmap(classifier, in_axes=(0, None, 0))(inputs, True, batched_keys)
    return jnp.mean(
        optax.softmax_cross_entropy_with_integer_labels(logits=logits, labels=inputs["label"])
    )


@pytest.mark.parametrize("backend", ["shard_map"])
@pytest.mark.skipif(
    len(jax.devices()) < 2, reason="one replica's step is its own one-device oracle"
)
def test_bert_classifier_with_dropout_keys(strategy, n):
    # The example's sizes, scaled down (its checkpoint and tokenizer are not used).
    bert_config = {
        "vocab_size": 50,
        "hidden_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "hidden_act": "gelu",
        "intermediate_size": 32,
        "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.1,
        "max_position_embeddings": 16,
        "type_vocab_size": 2,
        "initializer_range": 0.02,
    }
    key = jax.random.PRNGKey(5678)
    model_key, train_key = jax.random.split(key)
    classifier = BertClassifier(config=bert_config, num_classes=2, key=model_key)
    tx = optax.adam(learning_rate=1e-3)
    tx = optax.chain(optax.clip_by_global_norm(1.0), tx)
    # The example gives optax the whole model (`tx.init(classifier)`), which today's optax
    # refuses (its moments hold arrays where the gradients hold None): filtered, as the other
    # examples do, on one device as on eight.
    opt_state = tx.init(eqx.filter(classifier, eqx.is_array))

    # The example's pmap step, with `jm.all_reduce` for `lax.pmean` and each replica's own
    # dropout keys (the example gives every device the same key, so the same masks).
    def make_step(model, inputs, opt_state, key, tx):
        key, new_key = jax.random.split(key)
        loss, grads = compute_bert_loss(model, inputs, jm.replica_key(key))
        grads = jm.all_reduce("mean", grads)

        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        return jm.all_reduce("mean", loss), model, opt_state, new_key

    # One device over the global batch, drawing each replica's rows with that replica's key:
    # one replica's loss at a time (a vmap over the replicas compiles twice as long as the
    # whole step under test).
    replica_loss = eqx.filter_jit(compute_bert_loss)

    @eqx.filter_jit
    def apply(model, grads, opt_state):
        grads = jax.tree.map(lambda *g: sum(g) / n, *grads)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state

    def one_device_step(model, inputs, opt_state, key):
        key, new_key = jax.random.split(key)
        parts = jax.tree.map(lambda a: a.reshape(n, -1, *a.shape[1:]), inputs)
        rows = [jax.tree.map(operator.itemgetter(i), parts) for i in range(n)]
        losses, grads = zip(
            *(replica_loss(model, rows[i], jax.random.fold_in(key, i)) for i in range(n))
        )
        model, opt_state = apply(model, grads, opt_state)
        return jnp.mean(jnp.stack(losses)), model, opt_state, new_key

    step = jm.replicate(functools.partial(make_step, tx=tx), strategy=strategy)
    rng = np.random.RandomState(0)
    batch_size, seq_len = 2 * n, 8
    want = (classifier, opt_state, train_key)
    got = strategy.mirror((classifier, opt_state, train_key))
    for _ in range(2):
        inputs = {
            "token_ids": rng.randint(0, 50, (batch_size, seq_len)).astype(np.int32),
            "segment_ids": rng.randint(0, 2, (batch_size, seq_len)).astype(np.int32),
            "label": rng.randint(0, 2, batch_size).astype(np.int32),
        }
        want_loss, *want = one_device_step(want[0], inputs, want[1], want[2])
        got_loss, *got = step(got[0], _split(n, inputs), got[1], got[2])
        np.testing.assert_allclose(strategy.read(got_loss), want_loss, rtol=RTOL)
    # adam's first steps move each parameter by about its learning rate whatever its gradient's
    # size, so parameters whose gradients are rounding-level (some attention biases) agree to
    # a tenth of one step (1e-4), not to RTOL.
    _assert_arrays_close(strategy, got[0], want[0], atol=1e-4)
    np.testing.assert_array_equal(np.asarray(strategy.read(got[2])), np.asarray(want[2]))
    assert step.num_compilations == 1


# --- the README's equinox section ---------------------------------------------------------------

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _readme_equinox_blocks():
    text = README.read_text()
    section = re.search(r"^### equinox\n(.*?)(?=^### )", text, re.S | re.M)
    assert section, "README.md has no '### equinox' section"
    return re.findall(r"```python\n(.*?)```", section.group(1), re.S)


def test_readme_equinox_section_runs(tmp_path, monkeypatch):
    blocks = _readme_equinox_blocks()
    assert len(blocks) >= 4
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
