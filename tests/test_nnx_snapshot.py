"""An NNX argument unchanged since the last call is not flattened again; every change is seen.

Oracles: `jax.tree_util.tree_flatten` of the object after each change (the leaves and the
structure a call must trace with), and `nnx.jit` running the same calls and changes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jmirror as jm
from jmirror import _nnx, _nnx_snapshot


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(3, 4, rngs=rngs), nnx.Linear(4, 4, rngs=rngs)])
        self.out = nnx.Linear(4, 2, rngs=rngs)
        self.drop = nnx.Dropout(0.5, deterministic=True, rngs=rngs)
        self.count = nnx.Variable(jnp.zeros((), jnp.int32))
        self.scale = nnx.Param(jnp.ones(()))
        self.factor = 2.0
        self.extras = nnx.data({"a": nnx.Variable(jnp.ones(2))})
        self.stack = nnx.data([nnx.Variable(jnp.ones(3))])
        self.state = nnx.data(nnx.State({"x": nnx.Variable(jnp.ones(1))}))

    def __call__(self, x):
        for layer in self.layers:
            x = nnx.relu(layer(x))
        return self.drop(self.out(x)) * self.scale[...] * self.factor


def _step(model, x):
    model.count[...] += 1
    for variable in (*model.extras.values(), *model.stack, *model.state.values()):
        variable[...] = variable[...] + 1
    model.scale[...] = model.scale[...] * 1.5
    return model(x)


def _replace_layer(model):
    model.out = nnx.Linear(4, 2, rngs=nnx.Rngs(7))


def _equal_count(model):
    # Another Variable object of an equal value: the write-back must reach the new one.
    model.count = nnx.Variable(jnp.array(model.count[...]))


def _append_layer(model):
    model.layers.append(nnx.Linear(4, 4, rngs=nnx.Rngs(3)))


def _set_factor(model):
    model.factor = 3.0


def _set_metadata(model):
    model.scale.set_metadata("note", "changed")


def _add_variable(model):
    model.extra = nnx.Variable(jnp.full((2,), 5.0))


class _Wider(nnx.Linear):
    def __call__(self, x):
        return super().__call__(x) * 10.0


def _variable_class(model):
    model.scale.__class__ = nnx.BatchStat  # a Param made a batch statistic, in place


def _module_class(model):
    # Past flax's own __setattr__ (which would also change the attributes' bookkeeping).
    object.__setattr__(model.out, "__class__", _Wider)


def _same_factor(model):
    model.factor = float("2.0")  # equal, not identical: the same structure


def _dict_item_added(model):
    model.extras["b"] = nnx.Variable(jnp.zeros(2))


def _dict_item_replaced(model):
    model.extras["a"] = nnx.Variable(model.extras["a"][...] * 3)


def _list_item_appended(model):
    model.stack.append(nnx.Variable(jnp.zeros(3)))


def _state_item_added(model):
    model.state["y"] = nnx.Variable(jnp.zeros(1))


CHANGES = {
    "a submodule replaced": _replace_layer,
    "a Variable replaced by an equal one": _equal_count,
    "a layer appended to an nnx.List": _append_layer,
    "a static attribute changed": _set_factor,
    "a Variable's metadata changed": _set_metadata,
    "a Variable added": _add_variable,
    "a static attribute set to an equal value": _same_factor,
    "a dict item added": _dict_item_added,
    "a dict item replaced": _dict_item_replaced,
    "a list item appended": _list_item_appended,
    "an nnx.State item added": _state_item_added,
    "a Variable's class changed": _variable_class,
    "a submodule's class changed": _module_class,
}


@pytest.mark.parametrize("change", CHANGES)
def test_after_a_change_the_leaves_and_structure_are_a_fresh_flatten(change):
    model = Model(nnx.Rngs(0))
    for _ in range(2):  # the second call finds the snapshot the first took
        _nnx._flat_arguments((model,), {}, ())
    assert _nnx_snapshot.known(model) is not None
    CHANGES[change](model)
    leaves, structure = jax.tree_util.tree_flatten(model)
    known = _nnx_snapshot.known(model)
    if known is not None:  # only an equal structure may still be known
        assert known[1] == structure and len(known[0]) == len(leaves)
        assert all(a is b for a, b in zip(known[0], leaves))
    variables, flat = _nnx._flat_arguments((model,), {}, ())
    got_leaves, got_structure = flat[0]
    assert got_structure == structure
    assert len(got_leaves) == len(leaves) and all(a is b for a, b in zip(got_leaves, leaves))
    want = [x for x in jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, nnx.Variable))]
    assert len(variables) == len(want) and all(a is b for a, b in zip(variables, want))


@pytest.mark.parametrize("change", CHANGES)
def test_a_replicated_step_sees_each_change_as_nnx_jit_does(strategy, change):
    x = jnp.arange(6.0).reshape(2, 3) / 6
    replicated = jm.replicate(_step, strategy=strategy)
    model, want_model = Model(nnx.Rngs(0)), Model(nnx.Rngs(0))
    oracle = nnx.jit(_step)
    got, want = [], []
    for i in range(4):
        if i == 2:
            CHANGES[change](model)
            CHANGES[change](want_model)
        got.append(np.asarray(strategy.read(replicated(model, x))))
        want.append(np.asarray(oracle(want_model, x)))
    np.testing.assert_allclose(np.stack(got), np.stack(want), rtol=1e-6)
    got_state = nnx.state(model, nnx.Not(nnx.RngState))  # keys: folded per replica
    want_state = nnx.state(want_model, nnx.Not(nnx.RngState))
    assert jax.tree.structure(got_state) == jax.tree.structure(want_state)
    for g, w in zip(jax.tree.leaves(got_state), jax.tree.leaves(want_state)):
        np.testing.assert_allclose(np.asarray(strategy.read(g)), np.asarray(w), rtol=1e-6)


def test_switching_dropout_on_between_calls_is_seen(strategy):
    # model.train() flips a static attribute of a submodule: the step must trace again.
    x = jnp.ones((2, 3))
    model = Model(nnx.Rngs(0))
    step = jm.replicate(lambda model, x: model(x), strategy=strategy)
    kept = np.asarray(strategy.read(step(model, x)))
    np.testing.assert_array_equal(np.asarray(strategy.read(step(model, x))), kept)
    model.train()
    values = [np.asarray(v) for v in strategy.local_results(step(model, x))]
    assert all(np.any(v == 0.0) for v in values)  # entries dropped: not the eval output
    assert step.num_compilations == 2


def test_an_unchanged_optimizer_step_uses_the_snapshot_and_matches_one_device(strategy):
    # Oracle: the same training steps under nnx.jit on one device.
    def make():
        model = Model(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    def train(model, optimizer, x, y, reduce=lambda grads: jm.all_reduce("mean", grads)):
        def loss_fn(model):
            return jnp.mean((model(x) - y) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, reduce(grads))
        return loss

    x = jnp.linspace(-1, 1, 12).reshape(4, 3)
    y = jnp.ones((4, 2))
    model, optimizer = make()
    want_model, want_optimizer = make()
    step = jm.replicate(train, strategy=strategy)
    for _ in range(4):
        step(model, optimizer, x, y)
        nnx.jit(train, static_argnums=4)(want_model, want_optimizer, x, y, _same)
    assert _nnx_snapshot.known(model) is not None
    assert _nnx_snapshot.known(optimizer) is not None
    kept = nnx.Not(nnx.RngState)  # keys: folded per replica
    got, want = nnx.state(model, kept), nnx.state(want_model, kept)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(strategy.read(g)), np.asarray(w), rtol=1e-5)
    assert step.num_compilations == 1


def _same(grads):
    return grads


def test_a_collected_argument_leaves_no_snapshot():
    model = Model(nnx.Rngs(0))
    _nnx._flat_arguments((model,), {}, ())
    key = id(model)
    assert key in _nnx_snapshot._SNAPSHOTS
    del model
    assert key not in _nnx_snapshot._SNAPSHOTS


class _Configured(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.ones(()))
        self.config = {"scale": 1.0}  # static (no arrays), and changeable in place

    def __call__(self, x):
        return self.w[...] * x * self.config["scale"]


def test_a_static_value_changed_in_place_is_seen_as_eager_code_sees_it(strategy):
    # Oracle: the model called eagerly. Two models of one class share one structure while
    # their static values are equal; the second's dict then changes in place.
    step = jm.replicate(lambda model, x: model(x), strategy=strategy)
    first, second = _Configured(), _Configured()
    for model in (first, second, second):
        step(model, 1.0)
    second.config["scale"] = 2.0
    got = np.asarray(strategy.read(step(second, 1.0)))
    np.testing.assert_allclose(got, np.asarray(second(1.0)))
    np.testing.assert_allclose(np.asarray(strategy.read(step(first, 1.0))), 1.0)


def test_a_change_while_the_snapshot_is_taken_is_not_kept(strategy, monkeypatch):
    # Another thread's model.eval() between the call's flatten and the snapshot's walk: the
    # snapshot must not pair the new attributes with the structure flattened before them.
    x = jnp.ones((2, 3))
    model = Model(nnx.Rngs(0))
    model.train()
    take = _nnx_snapshot.take

    def take_after_a_change(*args, **kwargs):
        model.eval()
        return take(*args, **kwargs)

    monkeypatch.setattr(_nnx_snapshot, "take", take_after_a_change)
    step = jm.replicate(lambda model, x: model(x), strategy=strategy)
    step(model, x)
    monkeypatch.setattr(_nnx_snapshot, "take", take)
    known = _nnx_snapshot.known(model)
    assert known is None or known[1] == jax.tree_util.tree_structure(model)
    for _ in range(2):  # evaluation mode: no entry dropped, as eager code gives
        got = np.asarray(strategy.read(step(model, x)))
        np.testing.assert_allclose(got, np.asarray(model(x)), rtol=1e-6)
