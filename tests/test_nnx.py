"""flax NNX objects as arguments of replica functions: write-back, rngs, keys.

Oracles: one device's `nnx.jit` step on the global batch, NumPy, and `nnx.Dropout` run on
one device with the key each replica is documented to draw from.
"""

import flax.struct
import jax
import jax.numpy as jnp
import nnx_data
import numpy as np
import optax
import pytest
from flax import nnx

import jmirror as jm
import jmirror.testing as jmt


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, axis_name=None, rate=0.25):
        self.conv = nnx.Conv(1, 4, kernel_size=(3, 3), use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(4, axis_name=axis_name, rngs=rngs)
        self.drop = nnx.Dropout(rate, rngs=rngs)
        self.head = nnx.Linear(4 * 6 * 6, 3, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.bn(self.conv(x)))
        x = self.drop(x.reshape(x.shape[0], -1))
        return self.head(x)


def _np(x):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


_loss, _split = nnx_data.loss, nnx_data.split


def _data(n, steps, per_replica=4):
    return nnx_data.data(n, steps, per_replica, side=6, classes=3)


def _pair(axis_name, deterministic=True):
    model = Net(nnx.Rngs(params=0, dropout=1), axis_name=axis_name)
    model.drop.deterministic = deterministic
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def _replicated_step(strategy):
    @jm.replicate(strategy=strategy)
    def train_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(_loss)(model, x, y)
        optimizer.update(model, jm.all_reduce("mean", grads))
        return jm.all_reduce("mean", loss)

    return train_step


def test_in_place_step_equals_one_device_nnx_jit(strategy):
    n = strategy.num_replicas
    xs, ys = _data(n, steps=4)
    model, optimizer = _pair(strategy.axis_name)
    ref_model, ref_optimizer = _pair(None)
    kernel = model.conv.kernel
    train_step = _replicated_step(strategy)

    @nnx.jit
    def ref_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(_loss)(model, x, y)
        optimizer.update(model, grads)
        return loss

    for x, y in zip(xs, ys):
        loss = train_step(model, optimizer, _split(n, x), _split(n, y))
        ref_loss = ref_step(ref_model, ref_optimizer, x, y)
        np.testing.assert_allclose(strategy.read(loss), ref_loss, rtol=2e-4)
    assert int(strategy.read(optimizer.step[...])) == len(xs)
    assert model.conv.kernel is kernel  # the caller's objects, updated in place
    got = strategy.read(nnx.state(model))
    want = nnx.state(ref_model)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(_np(a), _np(b), rtol=2e-3, atol=1e-6, err_msg=str(path))
    jmt.assert_mirrored(nnx.state(model, nnx.Param), strategy)
    jmt.assert_mirrored(nnx.state(optimizer), strategy)
    assert train_step.num_compilations == 1  # compiled once, the NNX twin counted


def test_landed_failure_loss_changes_and_step_advances(strategy):
    # The issue: five calls gave the same loss, optimizer.step stayed 0.
    n = strategy.num_replicas
    xs, ys = _data(n, steps=1)
    model, optimizer = _pair(strategy.axis_name)
    train_step = _replicated_step(strategy)
    x, y = _split(n, xs[0]), _split(n, ys[0])
    losses = [float(strategy.read(train_step(model, optimizer, x, y))) for _ in range(3)]
    assert losses[0] > losses[1] > losses[2]
    assert int(strategy.read(optimizer.step[...])) == 3


def test_unproven_state_is_written_back_per_replica_and_read_names_it(strategy):
    n = strategy.num_replicas
    xs, _ = _data(n, steps=1)
    model = Net(nnx.Rngs(0), axis_name=None)  # batch statistics of the local batch only
    model.drop.deterministic = True

    @jm.replicate(strategy=strategy, per_replica=nnx.BatchStat)  # declared per replica
    def forward(model, x):
        return jm.all_reduce("mean", model(x).mean())

    forward(model, _split(n, xs[0]))
    mean = model.bn.mean.get_raw_value()
    assert isinstance(mean, jm.PerReplica)
    whole = model.bn.mean[...]  # NNX's accessor reads the whole value
    assert isinstance(whole, jm.PerReplica) and whole.values is mean.values
    assert isinstance(model.conv.kernel.get_raw_value(), jax.Array)  # untouched: mirrored
    components = strategy.local_results(mean)
    for i, component in enumerate(components):  # each replica's own statistics
        local = jnp.asarray(xs[0].reshape(n, -1, 6, 6, 1)[i])
        ref = Net(nnx.Rngs(0))
        ref(local)
        np.testing.assert_allclose(component, ref.bn.mean[...], rtol=1e-5, atol=1e-7)
    with pytest.raises(TypeError, match=r"bn.*mean"):
        strategy.read(model)
    forward(model, _split(n, xs[0]))  # a PerReplica Variable goes back in as components


def test_shared_references_identity_and_returned_objects(strategy):
    class Tied(nnx.Module):
        def __init__(self, rngs):
            self.shared = nnx.Linear(2, 2, rngs=rngs)
            self.again = self.shared
            self.count = nnx.Variable(jnp.zeros((), jnp.int32))

    model = Tied(nnx.Rngs(0))
    kernel = model.shared.kernel[...]
    seen = {}

    @jm.replicate(strategy=strategy)
    def step(model, also):
        seen["tied"] = model.shared.kernel is model.again.kernel
        seen["same module"] = model.shared is model.again and also is model
        model.again.kernel[...] = model.again.kernel[...] + 1.0
        model.count[...] += 1
        also.count[...] += 1  # the same object through another argument
        return model, model.shared, jnp.asarray(1.0)

    out_model, out_layer, one = step(model, model)
    assert seen["tied"] and seen["same module"]
    assert out_model is model and out_layer is model.shared
    assert model.again is model.shared
    np.testing.assert_allclose(strategy.read(model.shared.kernel[...]), kernel + 1.0)
    assert int(strategy.read(model.count[...])) == 2
    assert float(strategy.read(one)) == 1.0


def test_an_item_of_an_nnx_list_returned_is_the_callers_object(strategy):
    class Stack(nnx.Module):
        def __init__(self):
            self.blocks = nnx.List([nnx.Linear(2, 2, rngs=nnx.Rngs(0))])

    model = Stack()
    bias = np.asarray(model.blocks[0].bias[...])

    @jm.replicate(strategy=strategy)
    def step(model):
        model.blocks[0].bias[...] += 1.0
        return model.blocks[0]

    assert step(model) is model.blocks[0]
    np.testing.assert_allclose(strategy.read(model.blocks[0].bias[...]), bias + 1.0)


@jax.tree_util.register_pytree_with_keys_class
class _Labelled:
    """A pytree node whose key paths label its children (`a`, `b`) without naming them."""

    def __init__(self, a, b):
        self._a, self._b = a, b

    def tree_flatten_with_keys(self):
        keys = (jax.tree_util.GetAttrKey("a"), jax.tree_util.GetAttrKey("b"))
        return list(zip(keys, (self._a, self._b))), None

    def tree_flatten(self):
        return [self._a, self._b], None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)


def test_variables_below_a_node_whose_keys_are_labels_are_written_back(strategy):
    class Holder(nnx.Module):
        def __init__(self):
            self.box = nnx.data(_Labelled(nnx.Param(jnp.zeros(2)), nnx.Param(jnp.ones(2))))

    def body(model, x):
        a, b = model.box._a, model.box._b
        a[...] += x
        b[...] *= 2.0

    model, ref = Holder(), Holder()
    step, one = jm.replicate(body, strategy=strategy), nnx.jit(body)
    for _ in range(2):
        step(model, jnp.ones(2))
        one(ref, jnp.ones(2))
    for got, want in ((model.box._a, ref.box._a), (model.box._b, ref.box._b)):
        np.testing.assert_allclose(strategy.read(got[...]), want[...])


def test_a_donated_model_with_a_shared_variable_runs_as_nnx_jit(strategy):
    class Tied(nnx.Module):
        def __init__(self):
            self.a = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
            self.b = nnx.Linear(2, 2, rngs=nnx.Rngs(1))
            self.b.bias = self.a.bias  # one Variable at two places

    def body(model):
        model.a.bias[...] += 1.0
        return model.b.bias[...]

    model, ref = Tied(), Tied()
    step, one = jm.replicate(body, strategy=strategy, donate_argnums=0), nnx.jit(body)
    for _ in range(3):
        out, want = step(model), one(ref)
        np.testing.assert_allclose(strategy.read(out), want)
    assert model.b.bias is model.a.bias
    np.testing.assert_allclose(strategy.read(model.a.bias[...]), ref.a.bias[...])


def test_an_nnx_object_that_is_no_pytree_is_a_type_error_naming_it(strategy):
    class Legacy(nnx.Module, pytree=False):  # a graph node only, as nnx.Object is
        def __init__(self):
            self.w = nnx.Param(jnp.zeros(2))

    model = Legacy()

    @jm.replicate(strategy=strategy)
    def step(x, model):
        model.w[...] += x

    with pytest.raises(TypeError, match=r"Legacy at args\[1\].*pytree=False"):
        step(jnp.ones(2), model)
    np.testing.assert_array_equal(model.w[...], np.zeros(2))


def test_variable_and_containers_as_arguments(strategy):
    counter = nnx.Variable(jnp.zeros(()))
    layer = nnx.Linear(2, 3, rngs=nnx.Rngs(0))

    @jm.replicate(strategy=strategy)
    def step(pair, state, scale):
        counter, layer = pair
        counter[...] += scale
        state["layer"].bias[...] += 1.0
        return counter[...]

    out = step((counter, layer), {"layer": layer}, 2.0)
    assert float(strategy.read(out)) == 2.0
    assert float(strategy.read(counter[...])) == 2.0
    np.testing.assert_allclose(strategy.read(layer.bias[...]), np.ones(3))


def test_a_variable_replaced_by_an_equal_one_between_calls_is_the_one_written(strategy):
    # Same structure, another Variable object: the second call updates the new one only.
    layer = nnx.Linear(2, 3, rngs=nnx.Rngs(0))

    @jm.replicate(strategy=strategy)
    def step(layer, scale):
        layer.bias[...] += scale
        return jm.all_reduce("sum", layer.bias[...].sum())

    step(layer, 1.0)
    old = layer.bias
    layer.bias = nnx.Param(jnp.full((3,), 10.0))
    out = step(layer, 2.0)
    np.testing.assert_allclose(strategy.read(layer.bias[...]), np.full(3, 12.0))
    np.testing.assert_allclose(strategy.read(old[...]), np.ones(3))
    assert float(strategy.read(out)) == 36.0 * strategy.num_replicas


@jax.tree_util.register_pytree_node_class
class _Unkeyed:
    """A pytree node without keys: its children are reached by flat index only."""

    def __init__(self, *children):
        self.children = children

    def tree_flatten(self):
        return self.children, None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)


class _Holder(nnx.Module):
    def __init__(self):
        self.counters = nnx.data(_Unkeyed(nnx.Variable(jnp.zeros(())), nnx.Variable(jnp.ones(()))))


def test_variables_below_a_node_without_keys_are_found_every_call(strategy):
    holder = _Holder()

    @jm.replicate(strategy=strategy)
    def step(holder):
        for counter in holder.counters.children:
            counter[...] += 1.0

    for _ in range(2):
        step(holder)
    first, second = holder.counters.children
    assert float(strategy.read(first[...])) == 2.0
    assert float(strategy.read(second[...])) == 3.0
    holder.counters.children = (nnx.Variable(jnp.full((), 5.0)), second)  # same structure
    step(holder)
    assert float(strategy.read(holder.counters.children[0][...])) == 6.0
    assert float(strategy.read(second[...])) == 4.0


def test_keyword_arguments_and_an_exception_leave_the_objects_unchanged(strategy):
    layer = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    bias = layer.bias[...]

    @jm.replicate(strategy=strategy)
    def failing(x, *, layer):
        layer.bias[...] += x
        raise KeyError("from the step")

    @jm.replicate(strategy=strategy)
    def step(x, *, layer):
        layer.bias[...] += x
        return layer.bias[...].sum()

    with pytest.raises(KeyError, match="from the step"):
        failing(1.0, layer=layer)
    assert layer.bias[...] is bias  # nothing written back
    total = step(1.0, layer=layer)
    assert float(strategy.read(total)) == 3.0
    np.testing.assert_allclose(strategy.read(layer.bias[...]), np.ones(3))


def _bump(counter):
    counter[...] = counter[...] + 1.0


@pytest.mark.parametrize(
    "where",
    ["two dicts deep", "list item 20", "tuple in a tuple", "struct field", "module in a dict"],
)
def test_nnx_objects_at_any_depth_are_written_back_as_nnx_jit_does(strategy, where):
    # Oracle: nnx.jit on the same structure. Before, a Variable two containers deep (or past
    # a container's first items) was traced as a plain pytree and its change silently lost.
    @flax.struct.dataclass
    class Holder:
        counter: nnx.Variable

    def make():
        counter = nnx.Variable(jnp.zeros(()))
        layer = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
        tree = {
            "two dicts deep": {"a": {"b": counter}},
            "list item 20": [jnp.ones(())] * 20 + [counter],
            "tuple in a tuple": ((counter,),),
            "struct field": Holder(counter),
            "module in a dict": {"a": {"b": layer}},
        }[where]
        return tree, counter, layer

    def step(tree):
        if where == "module in a dict":
            tree["a"]["b"].bias[...] = tree["a"]["b"].bias[...] + 1.0
        else:
            _bump(jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))[-1])
        return jnp.zeros(())

    replicated = jm.replicate(step, strategy=strategy)
    tree, counter, layer = make()
    for _ in range(2):
        replicated(tree)
    want_tree, want_counter, want_layer = make()
    for _ in range(2):
        nnx.jit(step)(want_tree)
    got = (counter[...], layer.bias[...])
    want = (want_counter[...], want_layer.bias[...])
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(strategy.read(g)), np.asarray(w))
    assert replicated.num_compilations == 1


def test_structure_change_inside_is_refused(strategy):
    layer = nnx.Linear(2, 3, rngs=nnx.Rngs(0))

    @jm.replicate(strategy=strategy)
    def step(layer):
        layer.extra = nnx.Variable(jnp.ones(()))
        return 0.0

    with pytest.raises(ValueError, match="changed the structure"):
        step(layer)
    assert not hasattr(layer, "extra")


def test_strategy_run_and_lower_with_nnx(strategy):
    counter = nnx.Variable(jnp.zeros(()))

    def bump(counter):
        counter[...] += 1.0

    strategy.run(bump, (counter,))
    strategy.run(bump, (counter,))
    assert float(strategy.read(counter[...])) == 2.0
    lowered = jm.replicate(bump, strategy=strategy).lower(counter)
    assert isinstance(lowered, jax.stages.Lowered)


def test_a_compiled_step_returns_and_writes_back_as_a_call_does(strategy):
    n = strategy.num_replicas
    xs, ys = _data(n, steps=2)
    axis = strategy.axis_name
    (model, optimizer), (ref_model, ref_optimizer) = _pair(axis), _pair(axis)
    step, ref_step = _replicated_step(strategy), _replicated_step(strategy)
    x, y = _split(n, xs[0]), _split(n, ys[0])
    compiled = step.lower(model, optimizer, x, y).compile()
    for x, y in zip(xs, ys):
        x, y = _split(n, x), _split(n, y)
        loss, ref_loss = compiled(model, optimizer, x, y), ref_step(ref_model, ref_optimizer, x, y)
        assert isinstance(loss, jax.Array)  # the replica function's result, nothing more
        np.testing.assert_allclose(strategy.read(loss), strategy.read(ref_loss), rtol=1e-6)
    assert int(strategy.read(optimizer.step[...])) == 2
    np.testing.assert_allclose(
        strategy.read(model.conv.kernel[...]), strategy.read(ref_model.conv.kernel[...]), rtol=1e-6
    )


def test_donated_nnx_arguments(strategy):
    model, optimizer = _pair(strategy.axis_name)
    n = strategy.num_replicas
    xs, ys = _data(n, steps=2)

    @jm.replicate(strategy=strategy, donate_argnums=(0, 1))
    def train_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(_loss)(model, x, y)
        optimizer.update(model, jm.all_reduce("mean", grads))
        return jm.all_reduce("mean", loss)

    for x, y in zip(xs, ys):
        train_step(model, optimizer, _split(n, x), _split(n, y))
    assert int(strategy.read(optimizer.step[...])) == 2
    assert not model.conv.kernel[...].is_deleted()


def test_mirrored_model_steps_reads_and_asserts(strategy):
    model = strategy.mirror(Net(nnx.Rngs(params=0, dropout=1), axis_name=strategy.axis_name))
    jmt.assert_mirrored(nnx.state(model), strategy)  # typed rng keys included
    n = strategy.num_replicas
    xs, _ = _data(n, steps=1)

    @jm.replicate(strategy=strategy)
    def forward(model, x):
        return jm.all_reduce("mean", model(x).mean())

    forward(model, _split(n, xs[0]))
    jmt.assert_mirrored(nnx.state(model), strategy)
    read = strategy.read(model)
    assert isinstance(read, Net) and read is not model
    assert read.conv.kernel[...].devices() == {strategy.devices[0]}
    assert int(read.drop.rngs.count[...]) == 1


# --- rngs ------------------------------------------------------------------------------------


# NNX transforms inside a replica function write the stream's key back as a new value.
TRANSFORMS = {"none": lambda f: f, "nnx.jit": nnx.jit, "nnx.remat": nnx.remat}


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_dropout_masks_differ_per_replica_and_rng_state_stays_mirrored(strategy, transform):
    n = strategy.num_replicas
    rngs = nnx.Rngs(params=0, dropout=7)
    drop = nnx.Dropout(0.5, rngs=rngs)
    key = drop.rngs.key[...]

    @jm.replicate(strategy=strategy)
    @TRANSFORMS[transform]
    def masks(drop):
        return drop(jnp.ones((64,)))

    for step in range(3):
        out = masks(drop)
        components = [np.asarray(c) for c in strategy.local_results(out)]
        for r, component in enumerate(components):  # the oracle: one device, the folded key
            drawn = jax.random.fold_in(jax.random.fold_in(key, r), step)
            keep = jax.random.bernoulli(drawn, 0.5, (64,))
            np.testing.assert_array_equal(component, np.where(keep, 2.0, 0.0))
        for i in range(n):
            for j in range(i):
                assert not np.array_equal(components[i], components[j])
        state = nnx.state(drop)
        jmt.assert_mirrored(state, strategy)  # what the proof says: key and count mirrored
        assert int(strategy.read(drop.rngs.count[...])) == step + 1
        np.testing.assert_array_equal(
            jax.random.key_data(strategy.read(drop.rngs.key[...])), jax.random.key_data(key)
        )


def test_flax_tutorial_steps_under_nnx_jit_equal_one_device(strategy):
    """flax's tutorial steps, `@nnx.jit` (with `nnx.remat` around the loss) wrapped with
    `jm.replicate`, on a model holding a dropout stream: a train step and an eval pass that
    draws nothing run, equal one device's `nnx.jit` steps on the global batches, and the
    stream stays mirrored and as it was."""
    n = strategy.num_replicas
    xs, ys = _data(n, steps=2)
    model, optimizer = _pair(strategy.axis_name)  # dropout off: one device draws no masks
    ref_model, ref_optimizer = _pair(None)
    key = model.drop.rngs.key[...]
    loss_fn = nnx.remat(_loss)

    def make_metrics():
        return nnx.MultiMetric(loss=nnx.metrics.Average("loss"), accuracy=nnx.metrics.Accuracy())

    def train_step(model, optimizer, x, y, reduce):
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        optimizer.update(model, reduce(grads))
        return loss

    def eval_step(model, metrics, x, y):
        logits = model(x)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        metrics.update(loss=loss, logits=logits, labels=y)

    def replica_step(model, optimizer, x, y):
        loss = train_step(model, optimizer, x, y, lambda g: jm.all_reduce("mean", g))
        return jm.all_reduce("mean", loss)

    step = jm.replicate(nnx.jit(replica_step), strategy=strategy)
    evaluate, metrics = jm.replicate(nnx.jit(eval_step), strategy=strategy), make_metrics()
    ref_step = nnx.jit(lambda m, o, x, y: train_step(m, o, x, y, lambda g: g))
    ref_eval, ref_metrics = nnx.jit(eval_step), make_metrics()
    for x, y in zip(xs, ys):
        loss = step(model, optimizer, _split(n, x), _split(n, y))
        ref_loss = ref_step(ref_model, ref_optimizer, x, y)
        np.testing.assert_allclose(strategy.read(loss), ref_loss, rtol=2e-4)
    model.eval()
    ref_model.eval()
    for x, y in zip(xs, ys):
        evaluate(model, metrics, _split(n, x), _split(n, y))
        ref_eval(ref_model, ref_metrics, x, y)
    got, want = strategy.read(metrics).compute(), ref_metrics.compute()
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=2e-4, err_msg=name)
    jmt.assert_mirrored(nnx.state(model), strategy)
    assert int(strategy.read(model.drop.rngs.count[...])) == 0  # nothing drawn
    np.testing.assert_array_equal(_np(strategy.read(model.drop.rngs.key[...])), _np(key))


def test_an_rngs_shared_by_a_module_and_an_argument_is_folded_once(strategy):
    class Noisy(nnx.Module):
        def __init__(self, rngs):
            self.rngs = rngs

        def __call__(self):
            return jax.random.uniform(self.rngs.noise())

    rngs = nnx.Rngs(params=0, noise=3)
    key = rngs.noise.key[...]
    module = Noisy(rngs)

    @jm.replicate(strategy=strategy)
    def draw(module, rngs):
        return module(), jax.random.uniform(rngs.noise())

    first, second = draw(module, rngs)
    assert module.rngs is rngs
    assert int(strategy.read(rngs.noise.count[...])) == 2  # one stream, advanced twice
    for r, (a, b) in enumerate(zip(strategy.local_results(first), strategy.local_results(second))):
        folded = jax.random.fold_in(key, r)
        np.testing.assert_array_equal(a, jax.random.uniform(jax.random.fold_in(folded, 0)))
        np.testing.assert_array_equal(b, jax.random.uniform(jax.random.fold_in(folded, 1)))
    jmt.assert_mirrored(nnx.state(rngs), strategy)


def test_a_raw_uint32_key_in_a_stream_is_folded_per_replica(strategy):
    # jax.random.PRNGKey gives raw key data (shape (2,), uint32): a stream holding it draws
    # from fold_in(key, replica id) on each replica, as a typed key does; it was refused.
    rngs = nnx.Rngs(noise=0)
    raw = jax.random.PRNGKey(5)
    rngs.noise.key.set_value(raw)

    @jm.replicate(strategy=strategy)
    def draw(rngs):
        return jax.random.uniform(rngs.noise())

    drawn = draw(rngs)
    for r, got in enumerate(strategy.local_results(drawn)):
        want = jax.random.uniform(jax.random.fold_in(jax.random.fold_in(raw, r), 0))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    key = np.asarray(strategy.read(rngs.noise.key[...]))
    np.testing.assert_array_equal(key, np.asarray(raw))  # the stream's key is kept
    assert int(strategy.read(rngs.noise.count[...])) == 1


def test_params_stream_draws_identically_and_sync_gives_identical_draws(strategy):
    rngs = nnx.Rngs(params=0, dropout=1)

    @jm.replicate(strategy=strategy)
    def build(rngs):
        layer = nnx.Linear(3, 2, rngs=rngs)
        same = jax.random.normal(jm.sync(rngs.dropout(), "only_first_replica"), (4,))
        differ = jax.random.normal(rngs.dropout(), (4,))
        return layer.kernel[...], same, differ

    kernel, same, differ = build(rngs)
    jmt.assert_mirrored(kernel, strategy)
    jmt.assert_mirrored(same, strategy)
    if strategy.num_replicas > 1:
        assert isinstance(differ, jm.PerReplica)
    np.testing.assert_allclose(
        strategy.read(kernel), nnx.Linear(3, 2, rngs=nnx.Rngs(params=0)).kernel[...], rtol=1e-6
    )
    jmt.assert_mirrored(nnx.state(rngs), strategy)
    assert int(strategy.read(rngs.dropout.count[...])) == 2


# --- typed keys ------------------------------------------------------------------------------


def test_typed_keys_mirror_read_assert_local_results(strategy):
    n = strategy.num_replicas
    key = jax.random.key(3)
    mirrored = strategy.mirror({"key": key, "rngs": nnx.Rngs(0)})
    jmt.assert_mirrored(mirrored, strategy)
    read = strategy.read(mirrored["key"])
    np.testing.assert_array_equal(jax.random.key_data(read), jax.random.key_data(key))
    keys = strategy.split_key(key)
    parts = strategy.local_results(keys)
    want = jax.random.key_data(jax.random.split(key, n))
    for i, part in enumerate(parts):
        np.testing.assert_array_equal(jax.random.key_data(part), want[i])
    jmt.assert_replicas_equal(strategy.local_results(mirrored["key"])[0], strategy)
    per_replica = jm.PerReplica(jax.random.split(key, n))
    drawn = strategy.run(lambda k: jax.random.uniform(k), (per_replica,))
    ref = jax.vmap(jax.random.uniform)(jax.random.split(key, n))
    np.testing.assert_array_equal(strategy.gather(drawn), ref)
    if n > 1:
        with pytest.raises(AssertionError, match="differs"):
            jmt.assert_replicas_equal(keys, strategy)


def test_sync_of_a_key_by_sum_is_a_type_error(strategy):
    with pytest.raises(TypeError, match="only_first_replica"):
        strategy.run(
            lambda k: jm.sync(jax.random.fold_in(k, jm.replica_id()), "sum"), (jax.random.key(0),)
        )


# --- recipes with an NNX (model, optimizer) pair ---------------------------------------------


class _Mlp(nnx.Module):
    def __init__(self, rngs, axis_name=None, dtype=jnp.float32):
        self.hidden = nnx.Linear(6, 16, dtype=dtype, rngs=rngs)
        self.bn = nnx.BatchNorm(16, axis_name=axis_name, dtype=dtype, rngs=rngs)
        self.out = nnx.Linear(16, 3, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.bn(self.hidden(x))))


def _recipe_batches(n, steps=3):
    rs = np.random.RandomState(2)
    xs = rs.randn(steps, 4 * n, 6).astype(np.float32)
    ys = rs.randint(0, 3, (steps, 4 * n)).astype(np.int32)
    return [{"x": x, "y": y} for x, y in zip(xs, ys)]


def _recipe_loss(model, batch):
    logits = model(batch["x"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def _recipe_pair(axis_name, dtype=jnp.float32):
    model = _Mlp(nnx.Rngs(0), axis_name=axis_name, dtype=dtype)
    return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)


@nnx.jit
def _one_device_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(_recipe_loss)(model, batch)
    optimizer.update(model, grads)
    return loss


def _split_tree(n, batch):
    return jm.PerReplica(jax.tree.map(lambda a: a.reshape(n, -1, *a.shape[1:]), batch))


def _assert_params_close(strategy, model, ref):
    got = strategy.read(nnx.state(model, nnx.Param))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(nnx.state(ref, nnx.Param))):
        np.testing.assert_allclose(a, b, rtol=2e-3, atol=1e-6)


def test_recipes_make_train_step_with_nnx_pair(strategy):
    from jmirror import recipes

    n = strategy.num_replicas
    model, optimizer = _recipe_pair(strategy.axis_name)
    ref_model, ref_optimizer = _recipe_pair(None)
    step = recipes.make_train_step(_recipe_loss, strategy=strategy)
    for batch in _recipe_batches(n):
        state, loss = step((model, optimizer), _split_tree(n, batch))
        assert state[0] is model and state[1] is optimizer
        ref_loss = _one_device_step(ref_model, ref_optimizer, batch)
        np.testing.assert_allclose(strategy.read(loss), ref_loss, rtol=2e-4)
    _assert_params_close(strategy, model, ref_model)
    jmt.assert_mirrored(nnx.state(model), strategy)  # BatchNorm over the replica axis
    with pytest.raises(TypeError, match=r"\(model, optimizer\)"):
        step((optimizer, model), _split_tree(n, _recipe_batches(n)[0]))


def test_recipes_accumulating_step_with_nnx_pair(strategy):
    from jmirror import recipes

    n = strategy.num_replicas
    model, optimizer = _recipe_pair(None)
    model.bn.use_running_average = True  # micro-batches: normalize with fixed statistics
    ref_model, ref_optimizer = _recipe_pair(None)
    ref_model.bn.use_running_average = True
    step = recipes.make_accumulating_train_step(_recipe_loss, 2, strategy=strategy)
    for batch in _recipe_batches(n):
        _, loss = step((model, optimizer), _split_tree(n, batch))
        ref_loss = _one_device_step(ref_model, ref_optimizer, batch)
        np.testing.assert_allclose(strategy.read(loss), ref_loss, rtol=2e-4)
    _assert_params_close(strategy, model, ref_model)
    assert int(strategy.read(optimizer.step[...])) == 3


def test_recipes_loss_scaled_step_with_nnx_triple(strategy):
    from jmirror import recipes

    n = strategy.num_replicas
    model, optimizer = _recipe_pair(strategy.axis_name, dtype=jnp.float16)
    ref_model, ref_optimizer = _recipe_pair(None, dtype=jnp.float16)
    step = recipes.make_loss_scaled_train_step(_recipe_loss, strategy=strategy)
    batches = _recipe_batches(n)
    huge = recipes.DynamicLossScale.create(initial_scale=2.0**30)
    kernel = np.asarray(model.out.kernel[...])
    state, _ = step((model, optimizer, huge), _split_tree(n, batches[0]))  # overflows
    assert state[0] is model and float(strategy.read(state[2].scale)) == 2.0**29
    np.testing.assert_array_equal(strategy.read(model.out.kernel[...]), kernel)  # skipped
    assert int(strategy.read(optimizer.step[...])) == 0
    loss_scale = recipes.DynamicLossScale.create(initial_scale=2.0**4)
    for batch in batches:
        (model, optimizer, loss_scale), loss = step(
            (model, optimizer, loss_scale), _split_tree(n, batch)
        )
        ref_loss = _one_device_step(ref_model, ref_optimizer, batch)
        np.testing.assert_allclose(strategy.read(loss), ref_loss, rtol=2e-3)
    assert int(strategy.read(optimizer.step[...])) == len(batches)
    got = strategy.read(nnx.state(model, nnx.Param))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(nnx.state(ref_model, nnx.Param))):
        np.testing.assert_allclose(a, b, rtol=2e-2, atol=1e-3)


# --- together with the rest --------------------------------------------------------------------


def _noisy_step(strategy, donate):
    @jm.replicate(strategy=strategy, donate_argnums=donate)
    def step(model, optimizer, rngs, x, y):
        x = x + 0.01 * jax.random.normal(rngs.noise(), x.shape)
        loss, grads = nnx.value_and_grad(_loss)(model, x, y)
        optimizer.update(model, jm.all_reduce("mean", grads))
        return jm.all_reduce("mean", loss)

    return step


def test_donated_model_optimizer_and_rngs_equal_an_undonated_run(strategy):
    # Oracle: the same step without donation.
    n = strategy.num_replicas
    xs, ys = _data(n, steps=3)
    runs = []
    for donate in ((0, 1, 2), ()):
        model, optimizer = _pair(strategy.axis_name, deterministic=False)
        rngs = nnx.Rngs(noise=3)
        step = _noisy_step(strategy, donate)
        losses = [
            float(strategy.read(step(model, optimizer, rngs, _split(n, x), _split(n, y))))
            for x, y in zip(xs, ys)
        ]
        runs.append(
            (losses, [_np(v) for v in jax.tree.leaves(nnx.state((model, optimizer, rngs)))])
        )
        assert int(strategy.read(rngs.noise.count[...])) == 3
        assert not model.head.kernel[...].is_deleted()
    assert runs[0][0] == runs[1][0]
    for a, b in zip(runs[0][1], runs[1][1]):
        np.testing.assert_array_equal(a, b)


def test_strategy_run_with_an_nnx_pair_equals_replicate():
    # strategy.run on the shard_map backend; oracle: jm.replicate on pmap.
    n = len(jax.devices())
    xs, ys = _data(n, steps=2)
    results = []
    for backend, use_run in (("shard_map", True), ("pmap", False)):
        strategy = jm.MirroredStrategy(backend=backend)
        model, optimizer = _pair(strategy.axis_name)

        def step(model, optimizer, x, y):
            loss, grads = nnx.value_and_grad(_loss)(model, x, y)
            optimizer.update(model, jm.all_reduce("mean", grads))
            return jm.all_reduce("mean", loss)

        replicated = jm.replicate(step, strategy=strategy)
        for x, y in zip(xs, ys):
            args = (model, optimizer, _split(n, x), _split(n, y))
            loss = strategy.run(step, args) if use_run else replicated(*args)
        jmt.assert_mirrored(nnx.state(model), strategy)
        results.append(
            [float(strategy.read(loss))] + [_np(v) for v in jax.tree.leaves(nnx.state(model))]
        )
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def _functional_step(strategy, tx, reduce_grads):
    @jm.replicate(strategy=strategy)
    def step(model, opt_state, x, y):
        params = nnx.state(model, nnx.Param)
        grads = nnx.grad(_loss)(model, x, y)
        if reduce_grads:  # jm.shard_update takes each replica's own gradients
            grads = jm.all_reduce("mean", grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        nnx.update(model, optax.apply_updates(params, updates))
        return opt_state

    return step


def test_shard_update_as_the_optimizer_of_an_nnx_model(strategy):
    # Oracle: optax.adam on the all-reduced gradients (rtol 1e-5).
    n = strategy.num_replicas
    xs, ys = _data(n, steps=3)
    models = []
    for sharded in (True, False):
        model = strategy.mirror(Net(nnx.Rngs(params=0, dropout=1), axis_name=strategy.axis_name))
        model.drop.deterministic = True
        tx = jm.shard_update(optax.adam(1e-2)) if sharded else optax.adam(1e-2)
        opt_state = tx.init(nnx.state(model, nnx.Param))
        step = _functional_step(strategy, tx, reduce_grads=not sharded)
        for x, y in zip(xs, ys):
            opt_state = step(model, opt_state, _split(n, x), _split(n, y))
        jmt.assert_mirrored(nnx.state(model, nnx.Param), strategy)
        models.append(model)
    for a, b in zip(jax.tree.leaves(nnx.state(models[0])), jax.tree.leaves(nnx.state(models[1]))):
        np.testing.assert_allclose(_np(a), _np(b), rtol=1e-5, atol=1e-6)


def test_checkpoint_manager_resume_of_an_nnx_pair_is_bitwise(strategy, tmp_path):
    # Oracle: the uninterrupted run. Dropout on: the rng state must resume too.
    n = strategy.num_replicas
    xs, ys = _data(n, steps=4)
    step = _replicated_step(strategy)

    def run(model, optimizer, steps):
        for x, y in zip(xs[steps], ys[steps]):
            step(model, optimizer, _split(n, x), _split(n, y))

    whole = _pair(strategy.axis_name, deterministic=False)
    run(*whole, slice(0, 4))
    first = _pair(strategy.axis_name, deterministic=False)
    run(*first, slice(0, 2))
    with jm.checkpoint.CheckpointManager(tmp_path, strategy=strategy) as manager:
        manager.save(2, {"model": first[0], "optimizer": first[1]})
        manager.wait_until_finished()
        abstract = nnx.eval_shape(lambda: _pair(strategy.axis_name, deterministic=False))
        out = manager.restore(2, target={"model": abstract[0], "optimizer": abstract[1]})
    resumed = out["model"], out["optimizer"]
    run(*resumed, slice(2, 4))
    for a, b in zip(jax.tree.leaves(nnx.state(whole)), jax.tree.leaves(nnx.state(resumed))):
        np.testing.assert_array_equal(_np(a), _np(b))
    jmt.assert_mirrored(nnx.state(resumed), strategy)


def test_nnx_optimizer_with_shard_update_equals_adam_on_reduced_grads(strategy, tmp_path):
    # nnx.Optimizer.update rebuilds its state with nnx.state, which took jm.Sharded apart
    # after the first step. Oracle: nnx.Optimizer with optax.adam on the all-reduced grads.
    n = strategy.num_replicas
    xs, ys = _data(n, steps=3)
    pairs = []
    for sharded in (True, False):
        model = Net(nnx.Rngs(params=0, dropout=1), axis_name=strategy.axis_name)
        model.drop.deterministic = True
        tx = jm.shard_update(optax.adam(1e-2), strategy=strategy) if sharded else optax.adam(1e-2)
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        step = _optimizer_step(strategy, reduce_grads=not sharded)
        for x, y in zip(xs, ys):
            step(model, optimizer, _split(n, x), _split(n, y))
        pairs.append((model, optimizer))
    (model, optimizer), (ref_model, ref_optimizer) = pairs
    mu = optimizer.opt_state[0].mu["head"]["kernel"].get_raw_value()
    assert isinstance(mu, jm.Sharded) and mu.shape == ref_model.head.kernel.shape
    got = strategy.read(nnx.state((model, optimizer)))
    want = strategy.read(nnx.state((ref_model, ref_optimizer)))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(_np(a), _np(b), rtol=1e-5, atol=1e-6)
    # Saved whole, restored sharded into the live structure.
    jm.checkpoint.save(tmp_path / "c", optimizer, strategy=strategy)
    out = jm.checkpoint.restore(tmp_path / "c", optimizer, strategy=strategy)
    for a, b in zip(jax.tree.leaves(strategy.read(nnx.state(out))), jax.tree.leaves(got[1])):
        np.testing.assert_array_equal(_np(a), _np(b))


def _optimizer_step(strategy, reduce_grads):
    @jm.replicate(strategy=strategy)
    def step(model, optimizer, x, y):
        grads = nnx.grad(_loss)(model, x, y)
        if reduce_grads:
            grads = jm.all_reduce("mean", grads)
        optimizer.update(model, grads)

    return step


def test_nnx_optimizer_with_shard_update_restores_into_an_eval_shape_target(strategy, tmp_path):
    # nnx.eval_shape traces tx.init (no mirroring of tracers). Oracle: the uninterrupted run.
    n = strategy.num_replicas
    xs, ys = _data(n, steps=3)

    def pair():
        model = Net(nnx.Rngs(params=0, dropout=1), axis_name=strategy.axis_name)
        model.drop.deterministic = True
        tx = jm.shard_update(optax.adam(1e-2), strategy=strategy)
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    step = _optimizer_step(strategy, reduce_grads=False)
    whole, first = pair(), pair()
    for i in range(3):
        step(*whole, _split(n, xs[i]), _split(n, ys[i]))
    step(*first, _split(n, xs[0]), _split(n, ys[0]))
    jm.checkpoint.save(tmp_path / "c", first, strategy=strategy)
    resumed = jm.checkpoint.restore(tmp_path / "c", nnx.eval_shape(pair), strategy=strategy)
    mu = resumed[1].opt_state[0].mu["head"]["kernel"].get_raw_value()
    assert isinstance(mu, jm.Sharded) and mu.shards.shape[0] == n
    for i in (1, 2):
        step(*resumed, _split(n, xs[i]), _split(n, ys[i]))
    for a, b in zip(jax.tree.leaves(nnx.state(whole)), jax.tree.leaves(nnx.state(resumed))):
        np.testing.assert_array_equal(_np(a), _np(b))
