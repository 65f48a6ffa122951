"""equinox modules in replicated functions: static leaves, the usual step, state, keys.

Oracles: `eqx.filter_jit` on one device over the same global batches, NumPy, and
`jax.random.fold_in` for the per-replica keys.
"""

import dataclasses
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmirror as jm
import jmirror.testing as jmt


def _data(n, steps, per_replica=4, features=4, out=2, seed=0):
    rng = np.random.RandomState(seed)
    xs = rng.randn(steps, n * per_replica, features).astype(np.float32)
    ys = rng.randn(steps, n * per_replica, out).astype(np.float32)
    return xs, ys


def _split(n, x):
    return jm.PerReplica(x.reshape(n, -1, *x.shape[1:]))


def _loss(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def _mlp(seed=0):
    return eqx.nn.MLP(4, 2, 16, 2, activation=jax.nn.tanh, key=jax.random.key(seed))


def _usual_step(tx):
    def step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(_loss)(model, x, y)
        grads = jm.all_reduce("mean", grads)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, jm.all_reduce("mean", loss)

    return step


def _one_device(model, opt_state, tx, xs, ys):
    @eqx.filter_jit
    def step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(_loss)(model, x, y)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    losses = []
    for x, y in zip(xs, ys):
        model, opt_state, loss = step(model, opt_state, x, y)
        losses.append(float(loss))
    return model, losses


def _arrays(model):
    return jax.tree.leaves(eqx.filter(model, eqx.is_array))


def test_usual_step_equals_one_device_with_one_compile(strategy, n):
    tx = optax.adam(1e-2)
    model = _mlp()
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    xs, ys = _data(n, steps=4)
    want_model, want_losses = _one_device(model, opt_state, tx, xs, ys)

    step = jm.replicate(_usual_step(tx), strategy=strategy)
    m, o = strategy.mirror(model), strategy.mirror(opt_state)
    losses = []
    for x, y in zip(xs, ys):
        m, o, loss = step(m, o, _split(n, x), _split(n, y))
        losses.append(float(strategy.read(loss)))
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for a, b in zip(_arrays(m), _arrays(want_model)):
        np.testing.assert_allclose(
            np.asarray(strategy.read(a)), np.asarray(b), rtol=1e-5, atol=1e-6
        )
    assert step.num_compilations == 1
    # Static leaves come back as the same Python objects.
    assert m.activation is model.activation and m.final_activation is model.final_activation
    jmt.assert_mirrored(eqx.filter(m, eqx.is_array), strategy)


def test_fresh_state_compiles_once(strategy, n):
    # Not mirrored yet (made on one device): the first call places it, and the second call,
    # with the state the first returned, reuses the compiled step, on one device too.
    tx = optax.sgd(0.1)
    model = _mlp()
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    step = jm.replicate(_usual_step(tx), strategy=strategy)
    for x, y in zip(*_data(n, steps=3)):
        model, opt_state, _ = step(model, opt_state, _split(n, x), _split(n, y))
    assert step.num_compilations == 1


class _Scaled(eqx.Module):
    weight: jax.Array
    scale: float  # a Python number inside a module: static
    name: str = "scaled"

    def __call__(self, x):
        return x * self.weight * self.scale


def test_numbers_inside_modules_are_static_and_outside_traced(strategy, n):
    traced_types = []

    def fn(module, lr, x):
        traced_types.append((type(module.scale), isinstance(lr, jax.core.Tracer)))
        return module(x) * lr

    step = jm.replicate(fn, strategy=strategy)
    module = _Scaled(jnp.ones(3), 2.0)
    x = jnp.arange(3.0)
    out = step(module, 0.5, x)
    np.testing.assert_allclose(strategy.read(out), np.arange(3.0) * 2.0 * 0.5)
    assert traced_types[-1] == (float, True)
    step(module, 0.25, x)  # a new learning rate: traced, no new compilation
    assert step.num_compilations == 1
    step(_Scaled(jnp.ones(3), 3.0), 0.25, x)  # a new static value: one more
    assert step.num_compilations == 2


def test_static_numbers_equal_across_types_are_different_steps(strategy):
    # As static arguments of jax.jit: 2 and 2.0 (and True and 1) may give different results.
    step = jm.replicate(lambda m, x: (m, x * m.scale), strategy=strategy)
    x = jnp.arange(3, dtype=jnp.int32)
    for scale, dtype in ((2, jnp.int32), (2.0, jnp.float32), (True, jnp.int32)):
        module, out = step(_Scaled(jnp.ones(3), scale), x)
        assert module.scale is scale and strategy.read(out).dtype == dtype
    assert step.num_compilations == 3


def test_non_array_leaves_outside_modules_are_static(strategy):
    def fn(x, activation, mode, tx):
        y = activation(x)
        return y * 2 if mode == "double" else y

    step = jm.replicate(fn, strategy=strategy)
    tx = optax.sgd(0.1)
    out = step(jnp.arange(3.0), jnp.tanh, "double", tx)
    np.testing.assert_allclose(strategy.read(out), np.tanh(np.arange(3.0)) * 2, rtol=1e-6)
    out = step(jnp.arange(3.0), jnp.tanh, "single", tx)
    np.testing.assert_allclose(strategy.read(out), np.tanh(np.arange(3.0)), rtol=1e-6)
    assert step.num_compilations == 2


def test_static_argnames(strategy):
    step = jm.replicate(lambda x, *, power: x**power, strategy=strategy, static_argnames="power")
    np.testing.assert_allclose(strategy.read(step(jnp.arange(3.0), power=2)), [0, 1, 4])
    np.testing.assert_allclose(strategy.read(step(jnp.arange(3.0), power=2)), [0, 1, 4])
    np.testing.assert_allclose(strategy.read(step(jnp.arange(3.0), power=3)), [0, 1, 8])
    assert step.num_compilations == 2


def test_retracing_warning_counts_changing_static_leaves_of_a_module(strategy):
    step = jm.replicate(lambda m: m(1.0), strategy=strategy)
    for i in range(8):
        step(_Scaled(jnp.ones(2), 0.5 + i))
    with pytest.warns(UserWarning, match=r"compiled 9 input signatures.*\.scale: static"):
        step(_Scaled(jnp.ones(2), 9.5))
    assert step.num_compilations == 9


class _Unhashable:
    __hash__ = None  # type: ignore[assignment]

    def __eq__(self, other):
        return self is other


def test_unhashable_static_leaf_is_a_type_error_naming_the_path(strategy):
    step = jm.replicate(lambda x, cfg: x, strategy=strategy)
    with pytest.raises(TypeError, match=r"args\[1\]\['cfg'\].*_Unhashable.*hashable"):
        step(jnp.ones(2), {"cfg": _Unhashable()})


class _WithStaticTable(eqx.Module):
    linear: eqx.nn.Linear
    table: np.ndarray = eqx.field(static=True)

    def __call__(self, x):
        return self.linear(x) + self.table.sum()


@pytest.mark.filterwarnings("ignore:A JAX array is being set as static")
def test_an_array_in_a_static_field_is_a_type_error_naming_the_field(strategy, n):
    step = jm.replicate(lambda m, x: jax.vmap(m)(x), strategy=strategy)
    linear = eqx.nn.Linear(4, 2, key=jax.random.key(0))
    x = jm.PerReplica(np.ones((n, 2, 4), np.float32))
    step(_WithStaticTable(linear, np.ones(3, np.float32)), x)
    with pytest.raises(TypeError, match=r"static field at args\[0\]\.table .*ndarray.*static=True"):
        step(_WithStaticTable(linear, np.full(3, 2.0, np.float32)), x)


def _stacked_modules(n):
    """Returns `jm.PerReplica` of n MLPs (replica r's of seed r) and the n modules."""
    models = [_mlp(seed) for seed in range(n)]
    stacked = jax.tree.map(lambda *a: np.stack([np.asarray(x) for x in a]), *_arrays_of(models))
    values = eqx.combine(stacked, eqx.filter(models[0], eqx.is_array, inverse=True))
    return jm.PerReplica(values), models


def _arrays_of(models):
    return [eqx.filter(m, eqx.is_array) for m in models]


def test_a_per_replica_module_keeps_its_functions_where_replicas_are_taken_apart(strategy, n):
    per_replica, models = _stacked_modules(n)
    x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
    out = jm.replicate(lambda m, x: jax.vmap(m)(x), strategy=strategy)(per_replica, x)
    for r, (got, model) in enumerate(zip(strategy.local_results(out), models)):
        np.testing.assert_allclose(got, jax.vmap(model)(x), rtol=1e-5, err_msg=f"replica {r}")
    parts = strategy.local_results(per_replica)
    assert all(p.activation is models[0].activation for p in parts)
    for part, model in zip(parts, models):
        for a, b in zip(_arrays(part), _arrays(model)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for op, combine in (("mean", np.mean), ("sum", np.sum)):
        reduced = strategy.reduce(op, per_replica)
        assert reduced.activation is models[0].activation
        for a, *bs in zip(_arrays(reduced), *map(_arrays, models)):
            expected = combine(np.stack([np.asarray(b) for b in bs]), axis=0)
            np.testing.assert_allclose(np.asarray(a), expected, rtol=1e-5, atol=1e-6)
    same = jm.PerReplica(
        eqx.combine(
            jax.tree.map(
                lambda a: np.stack([np.asarray(a)] * n), eqx.filter(models[0], eqx.is_array)
            ),
            eqx.filter(models[0], eqx.is_array, inverse=True),
        )
    )
    jmt.assert_replicas_equal(same)
    if n > 1:
        with pytest.raises(AssertionError, match=r"layers\[0\]\.weight"):
            jmt.assert_replicas_equal(per_replica)


def test_sum_of_a_module_returned_per_replica_keeps_its_functions(strategy, n):
    @jm.replicate(strategy=strategy, per_replica=lambda path, leaf: True)
    def scaled(model):
        arrays, rest = eqx.partition(model, eqx.is_array)
        return eqx.combine(jax.tree.map(lambda a: a * (jm.replica_id() + 1.0), arrays), rest)

    model = _mlp()
    total = strategy.reduce("sum", scaled(strategy.mirror(model)))
    assert total.activation is model.activation
    for a, b in zip(_arrays(total), _arrays(model)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b) * n * (n + 1) / 2, rtol=1e-5)


def _assert_arrays(got, want, err_msg=""):
    for a, b in zip(_arrays(got), want, strict=True):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6, err_msg=err_msg)


def test_distribute_values_from_function_of_modules_is_a_per_replica_module(strategy, n):
    by_hand, models = _stacked_modules(n)
    per_replica = strategy.distribute_values_from_function(lambda ctx: models[ctx.replica_id])
    assert isinstance(per_replica, jm.PerReplica)
    assert isinstance(per_replica.values, eqx.nn.MLP)
    assert per_replica.values.activation is models[0].activation
    _assert_arrays(per_replica.values, [np.asarray(a) for a in _arrays(by_hand.values)])
    stacks = [np.stack([np.asarray(a) for a in leaves]) for leaves in zip(*map(_arrays, models))]
    x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
    out = jm.replicate(lambda m, x: jax.vmap(m)(x), strategy=strategy)(per_replica, x)
    for r, (got, part, model) in enumerate(
        zip(strategy.local_results(out), strategy.local_results(per_replica), models)
    ):
        np.testing.assert_allclose(got, jax.vmap(model)(x), rtol=1e-5, err_msg=f"replica {r}")
        assert part.activation is model.activation
        _assert_arrays(part, [np.asarray(a) for a in _arrays(model)], f"replica {r}")
    mean = strategy.reduce("mean", per_replica)
    assert mean.activation is models[0].activation
    _assert_arrays(mean, [s.mean(axis=0) for s in stacks])
    gathered = strategy.gather(per_replica)
    assert gathered.activation is models[0].activation
    _assert_arrays(gathered, [np.concatenate(list(s)) for s in stacks])
    # Returned as a PerReplica from a replica function: the same module, its functions kept.
    back = jm.replicate(lambda m: jm.PerReplica(m), strategy=strategy)(per_replica)
    assert isinstance(back, jm.PerReplica) and back.values.activation is models[0].activation
    _assert_arrays(back.values, stacks)


def test_distribute_values_from_function_refuses_static_leaves_that_differ(strategy, n):
    if n == 1:
        pytest.skip("one replica: nothing differs")

    def value_fn(ctx):
        activation = jax.nn.tanh if ctx.replica_id == 0 else jax.nn.relu
        return eqx.nn.MLP(4, 2, 16, 2, activation=activation, key=jax.random.key(0))

    with pytest.raises(ValueError, match=r"replica 0 .* replica 1 at \.activation.*static"):
        strategy.distribute_values_from_function(value_fn)


@pytest.mark.parametrize("aggregation", ["sum", "mean", "only_first_replica"])
@pytest.mark.parametrize("made_by", ["sync_on_read", "create_state"])
def test_sync_on_read_module_reads_back_a_module(strategy, n, aggregation, made_by):
    model = _mlp()
    if made_by == "sync_on_read":
        state = strategy.sync_on_read(model, aggregation)
    else:
        state = strategy.create_state(model, synchronization="on_read", aggregation=aggregation)
    assert isinstance(state, jm.SyncOnRead) and state.value.activation is model.activation
    weights = [np.asarray(a) for a in _arrays(model)]
    start = strategy.read(state)
    assert isinstance(start, eqx.nn.MLP) and start.activation is model.activation
    scale = {"sum": n, "mean": 1, "only_first_replica": 1}[aggregation]
    _assert_arrays(start, [w * scale for w in weights])

    @jm.replicate(strategy=strategy)
    def count(state):  # each replica adds its own id + 1 to its component
        arrays, rest = eqx.partition(state.value, eqx.is_array)
        more = jax.tree.map(lambda a: a + jm.replica_id() + 1.0, arrays)
        return state.replace(eqx.combine(more, rest))

    for _ in range(2):
        state = count(state)
    assert count.num_compilations == 1
    assert isinstance(state, jm.SyncOnRead) and state.value.activation is model.activation
    own = [2.0 * (r + 1) for r in range(n)]  # replica r's total after two calls
    for r, part in zip(_local_ids(strategy), strategy.local_results(state)):
        assert part.activation is model.activation
        _assert_arrays(part, [w + own[r] for w in weights], f"replica {r}")
    read = strategy.read(state)
    assert isinstance(read, eqx.nn.MLP) and read.activation is model.activation
    combined = {
        "sum": [n * w + sum(own) for w in weights],
        "mean": [w + np.mean(own) for w in weights],
        "only_first_replica": [w + own[0] for w in weights],
    }[aggregation]
    _assert_arrays(read, combined)
    # Read inside merge_fn too: the same module, mirrored.
    merged = jm.replicate(
        lambda state: jm.merge_call(lambda strategy, s: strategy.read(s), args=(state,)),
        strategy=strategy,
    )(state)
    assert isinstance(merged, eqx.nn.MLP) and merged.activation is model.activation
    jmt.assert_mirrored(merged, strategy)
    _assert_arrays(strategy.read(merged), combined)


@pytest.mark.parametrize("aggregation", ["sum", "mean"])
def test_assign_and_checkpoint_of_a_sync_on_read_module(strategy, n, aggregation, tmp_path):
    model = _mlp()
    state = strategy.sync_on_read(_mlp(seed=1), aggregation)
    weights = [np.asarray(a) for a in _arrays(model)]
    assigned = strategy.assign(state, model)
    assert isinstance(assigned, jm.SyncOnRead) and assigned.value.activation is model.activation
    _assert_arrays(strategy.read(assigned), weights)  # reading gives the value assigned
    jm.checkpoint.save(tmp_path / "c", {"m": assigned}, strategy=strategy)
    restored = jm.checkpoint.restore(tmp_path / "c", strategy=strategy, target={"m": state})
    assert isinstance(restored["m"], jm.SyncOnRead)
    read = strategy.read(restored["m"])
    assert isinstance(read, eqx.nn.MLP) and read.activation is model.activation
    _assert_arrays(read, weights)


def test_mirror_read_and_per_replica_of_a_module(strategy, n):
    model = _mlp()
    mirrored = strategy.mirror(model)
    assert isinstance(mirrored, eqx.nn.MLP) and mirrored.activation is model.activation
    jmt.assert_mirrored(mirrored, strategy)
    back = strategy.read(mirrored)
    for a, b in zip(_arrays(back), _arrays(model)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    @jm.replicate(strategy=strategy, per_replica=lambda path, leaf: True)
    def perturb(model):
        return jax.tree.map(lambda w: w + jm.replica_id() if eqx.is_array(w) else w, model)

    per = perturb(mirrored)
    components = strategy.local_results(per)
    assert len(components) == len(_local_ids(strategy))
    np.testing.assert_allclose(
        np.asarray(components[-1].layers[0].weight),
        np.asarray(model.layers[0].weight) + strategy.num_replicas - 1,
    )
    if n > 1:
        with pytest.raises(AssertionError):
            jmt.assert_replicas_equal(per, strategy)


def test_replica_key_is_fold_in_of_the_replica_id(strategy, n):
    key = jax.random.key(3)

    @jm.replicate(strategy=strategy)
    def draw(key):
        return jax.random.normal(jm.replica_key(key), (2,)), jax.random.normal(key, (2,))

    own, same = draw(strategy.mirror(key))
    own = np.stack([np.asarray(c) for c in strategy.local_results(own)])
    for i, row in zip(_local_ids(strategy), own):
        want = jax.random.normal(jax.random.fold_in(key, i), (2,))
        np.testing.assert_allclose(row, np.asarray(want), rtol=1e-6)
    np.testing.assert_allclose(strategy.read(same), jax.random.normal(key, (2,)), rtol=1e-6)


def test_replica_key_takes_raw_keys(strategy):
    key = jax.random.PRNGKey(5)
    out = jm.replicate(lambda k: jm.replica_key(k), strategy=strategy)(key)
    first = strategy.local_results(out)[0]
    want = jax.random.fold_in(key, _local_ids(strategy)[0])
    np.testing.assert_array_equal(np.asarray(first), np.asarray(want))


def test_replica_key_outside_a_replica_function_is_a_runtime_error():
    with pytest.raises(RuntimeError):
        jm.replica_key(jax.random.key(0))


def test_dropout_with_replica_key_draws_per_replica(strategy, n):
    dropout = eqx.nn.Dropout(0.5)

    @jm.replicate(strategy=strategy)
    def apply(dropout, x, key):
        return dropout(x, key=jm.replica_key(key))

    out = apply(dropout, jnp.ones(64), strategy.mirror(jax.random.key(0)))
    components = [np.asarray(c) for c in strategy.local_results(out)]
    for i, c in zip(_local_ids(strategy), components):
        want = dropout(jnp.ones(64), key=jax.random.fold_in(jax.random.key(0), i))
        np.testing.assert_array_equal(c, np.asarray(want))


def test_inference_mode_compiles_once_more(strategy):
    model = eqx.nn.Sequential([eqx.nn.Linear(3, 3, key=jax.random.key(0)), eqx.nn.Dropout(0.5)])
    step = jm.replicate(lambda m, x, key: m(x, key=key), strategy=strategy)
    key = strategy.mirror(jax.random.key(1))
    x = jnp.ones(3)
    step(model, x, key)
    step(model, x, key)
    inference = eqx.nn.inference_mode(model)
    out = step(inference, x, key)
    step(inference, x, key)
    np.testing.assert_allclose(strategy.read(out), inference(x, key=jax.random.key(1)), rtol=1e-6)
    assert step.num_compilations == 2


def _batch_norm_model(axis_name):
    class Net(eqx.Module):
        linear: eqx.nn.Linear
        norm: eqx.nn.BatchNorm

        def __init__(self, axis_name, key):
            self.linear = eqx.nn.Linear(4, 3, key=key)
            self.norm = eqx.nn.BatchNorm(3, axis_name=axis_name, mode="batch")

        def __call__(self, x, state):
            return self.norm(self.linear(x), state)

    model, state = eqx.nn.make_with_state(Net)(axis_name, jax.random.key(0))
    return model, state


def _bn_step(model, state, x):
    grads, state, value = _one_bn_step(model, state, x)
    return jm.all_reduce("mean", grads), state, jm.all_reduce("mean", value)


def test_batch_norm_state_without_the_replica_axis_is_refused_naming_both_fixes(strategy, n):
    if n == 1:
        pytest.skip("one replica: nothing diverges")
    model, state = _batch_norm_model("batch")
    x = jm.PerReplica(np.random.RandomState(0).randn(n, 4, 4).astype(np.float32))
    step = jm.replicate(_bn_step, strategy=strategy)
    with pytest.raises(jm.MirroredStateError) as info:
        step(model, strategy.mirror(state), x)
    message = str(info.value)
    assert "BatchNorm" in message
    assert "(eqx.nn.State of args[0].norm, item [0])" in message  # the leaves name their layer
    assert f'axis_name=("batch", {strategy.axis_name!r})' in message.replace("'batch'", '"batch"')
    assert "jm.sync_batch_norm" in message


@pytest.mark.parametrize("fix", ["axis_name", "sync_batch_norm"])
def test_batch_norm_fixes_equal_one_device(strategy, n, fix):
    if fix == "axis_name":
        model, state = _batch_norm_model(("batch", strategy.axis_name))
    else:
        model, state = _batch_norm_model("batch")
        converted = jm.sync_batch_norm(model, strategy)
        assert converted is not model  # equinox modules are immutable: a new model
        assert converted.norm.axis_name == ("batch", strategy.axis_name)
        model = converted
    one_model, one_state = _batch_norm_model("batch")
    rng = np.random.RandomState(0)
    xs = rng.randn(3, n * 4, 4).astype(np.float32)
    step = jm.replicate(_bn_step, strategy=strategy)
    state = strategy.mirror(state)
    for x in xs:
        grads, state, loss = step(model, state, _split(n, x))
        want_grads, one_state, want_loss = eqx.filter_jit(_one_bn_step)(one_model, one_state, x)
        np.testing.assert_allclose(strategy.read(loss), want_loss, rtol=1e-5)
    jmt.assert_mirrored(state, strategy)
    for a, b in zip(jax.tree.leaves(strategy.read(state)), jax.tree.leaves(one_state)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_sync_batch_norm_keeps_the_tree_structure(strategy, n):
    # An optimizer state made before converting still matches the converted model.
    model, state = _batch_norm_model("batch")
    # sgd: these gradients are near zero (the loss is of normalized outputs), and adam would
    # scale their rounding up to the step size.
    tx = optax.sgd(0.1)
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    converted = jm.sync_batch_norm(model, strategy)
    assert jax.tree.structure(converted) == jax.tree.structure(model)

    def step(model, state, opt_state, x):
        grads, state, loss = _bn_step(model, state, x)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state, opt_state, loss

    def one_step(model, state, opt_state, x):
        grads, state, loss = _one_bn_step(model, state, x)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state, opt_state, loss

    x = np.random.RandomState(1).randn(n * 4, 4).astype(np.float32)
    got = jm.replicate(step, strategy=strategy)(converted, state, opt_state, _split(n, x))
    want = eqx.filter_jit(one_step)(model, state, opt_state, x)
    np.testing.assert_allclose(strategy.read(got[3]), want[3], rtol=1e-5)
    for a, b in zip(_arrays(strategy.read(got[0])), _arrays(want[0])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_sync_batch_norm_of_a_model_and_its_state_says_to_pass_the_model_alone():
    strategy = jm.MirroredStrategy()
    model, state = _batch_norm_model("batch")
    kinds = r"flax NNX object.*or an equinox model \(an eqx\.Module\)"
    with pytest.raises(TypeError, match=kinds + r", got a tuple holding Net at \[0\]") as info:
        jm.sync_batch_norm((model, state), strategy)
    assert "Pass the model alone: model = jm.sync_batch_norm(model, strategy)" in str(info.value)
    assert "eqx.nn.State" in str(info.value) and "unchanged" in str(info.value)
    for value in ({"w": np.zeros(3)}, (np.zeros(3), state), None):
        with pytest.raises(TypeError, match=kinds + f", got {type(value).__name__}\\."):
            jm.sync_batch_norm(value, strategy)


def _one_bn_step(model, state, x):
    def loss(model, state):
        y, state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
            x, state
        )
        return jnp.mean(y**2), state

    (value, state), grads = eqx.filter_value_and_grad(loss, has_aux=True)(model, state)
    return grads, state, value


def test_returned_module_not_mirrored_is_refused(strategy, n):
    if n == 1:
        pytest.skip("one replica: nothing diverges")
    tx = optax.sgd(0.1)
    model = _mlp()
    opt_state = tx.init(eqx.filter(model, eqx.is_array))

    def forgot(model, opt_state, x, y):  # no all_reduce of the gradients
        grads = eqx.filter_grad(_loss)(model, x, y)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state

    xs, ys = _data(n, 1)
    with pytest.raises(jm.MirroredStateError, match=r"layers"):
        jm.replicate(forgot, strategy=strategy)(
            strategy.mirror(model), strategy.mirror(opt_state), _split(n, xs[0]), _split(n, ys[0])
        )


def test_checkpoint_of_a_module_restores_into_a_target(strategy, tmp_path):
    model = strategy.mirror(_mlp(1))
    jm.checkpoint.save(tmp_path / "ckpt", model)
    target = _mlp(2)
    restored = jm.checkpoint.restore(tmp_path / "ckpt", target=target)
    assert isinstance(restored, eqx.nn.MLP) and restored.activation is target.activation
    for a, b in zip(_arrays(restored), _arrays(_mlp(1))):
        np.testing.assert_array_equal(np.asarray(strategy.read(a)), np.asarray(b))


class _Tagged(eqx.Module):
    weight: jax.Array
    tag: object  # static: not written; a target's own value comes back, whatever its shape


@pytest.mark.parametrize(
    "saved, wanted",
    [("a", ("a",)), (("a",), "a"), (("a",), ("a", "b")), (None, "a"), (jnp.add, None)],
)
def test_a_target_whose_static_fields_differ_from_the_saved_ones(strategy, tmp_path, saved, wanted):
    jm.checkpoint.save(tmp_path / "ckpt", strategy.mirror(_Tagged(jnp.arange(3.0), saved)))
    restored = jm.checkpoint.restore(tmp_path / "ckpt", target=_Tagged(jnp.zeros(3), wanted))
    assert restored.tag == wanted
    np.testing.assert_array_equal(np.asarray(strategy.read(restored.weight)), [0.0, 1.0, 2.0])
    with pytest.raises(ValueError, match=r"\.weight"):  # arrays still have to match
        jm.checkpoint.restore(tmp_path / "ckpt", target=_Tagged(jnp.zeros(4), wanted))


@pytest.mark.parametrize("whole", [False, True], ids=["filtered", "whole module"])
def test_shard_update_on_a_module(strategy, n, whole):
    # adamw reads the parameters (weight decay). equinox's own examples pass the whole model
    # as `params`, functions and all, which optax takes as it is.
    tx = optax.adamw(1e-2, weight_decay=0.1)
    sharded = jm.shard_update(tx)
    model = _mlp()
    params = eqx.filter(model, eqx.is_array)
    want_model, want_losses = _one_device(model, tx.init(params), tx, *_data(n, 3))

    def step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(_loss)(model, x, y)
        params = model if whole else eqx.filter(model, eqx.is_array)
        updates, opt_state = sharded.update(grads, opt_state, params)
        return eqx.apply_updates(model, updates), opt_state, jm.all_reduce("mean", loss)

    step = jm.replicate(step, strategy=strategy)
    m = strategy.mirror(model)
    o = strategy.run(sharded.init, args=(eqx.filter(m, eqx.is_array),))
    losses = []
    for x, y in zip(*_data(n, 3)):
        m, o, loss = step(m, o, _split(n, x), _split(n, y))
        losses.append(float(strategy.read(loss)))
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for got, want in zip(_arrays(strategy.read(m)), _arrays(want_model)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


class _PReLUNet(eqx.Module):
    linear: eqx.nn.Linear
    act: eqx.nn.PReLU  # its slope, made from a Python float, is weakly typed

    def __init__(self, key):
        self.linear = eqx.nn.Linear(4, 2, key=key)
        self.act = eqx.nn.PReLU(0.2)

    def __call__(self, x):
        return self.act(self.linear(x))


@pytest.mark.parametrize("update", ["all_reduce", "shard_update"])
def test_a_weakly_typed_parameter_stays_weak_and_the_step_compiles_once(strategy, n, update):
    # eqx.filter_jit keeps the slope weakly typed step after step; JAX's collectives alone
    # return strong types, which would compile the step again and change how the slope
    # promotes against other dtypes.
    model = _PReLUNet(jax.random.key(3))
    assert model.act.negative_slope.aval.weak_type
    tx = optax.sgd(0.1, momentum=0.9)  # (adam's update is strongly typed on one device too)
    xs, ys = _data(n, 3)
    want_model, want_losses = _one_device(
        model, tx.init(eqx.filter(model, eqx.is_array)), tx, xs, ys
    )
    assert want_model.act.negative_slope.aval.weak_type
    if update == "all_reduce":
        step = jm.replicate(_usual_step(tx), strategy=strategy)
        opt_state = strategy.mirror(tx.init(eqx.filter(model, eqx.is_array)))
    else:
        sharded = jm.shard_update(tx)

        def sharded_step(model, opt_state, x, y):
            loss, grads = eqx.filter_value_and_grad(_loss)(model, x, y)
            updates, opt_state = sharded.update(grads, opt_state, eqx.filter(model, eqx.is_array))
            return eqx.apply_updates(model, updates), opt_state, jm.all_reduce("mean", loss)

        step = jm.replicate(sharded_step, strategy=strategy)
        params = eqx.filter(strategy.mirror(model), eqx.is_array)
        opt_state = strategy.run(sharded.init, args=(params,))
    got, losses = strategy.mirror(model), []
    for x, y in zip(xs, ys):
        got, opt_state, loss = step(got, opt_state, _split(n, x), _split(n, y))
        losses.append(float(strategy.read(loss)))
    assert step.num_compilations == 1
    assert got.act.negative_slope.aval.weak_type
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for a, b in zip(_arrays(strategy.read(got)), _arrays(want_model)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_arrays_from_another_mesh_are_placed_as_the_same_value(strategy, n):
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = jax.devices()
    mesh = Mesh(np.array(devices[::-1]), ("data",))
    x = jax.device_put(jnp.arange(8.0 * n), NamedSharding(mesh, P("data")))
    one = jax.device_put(jnp.arange(3.0), devices[-1])
    step = jm.replicate(lambda x, y: (x * 2, y + 1), strategy=strategy)
    a, b = step(x, one)
    np.testing.assert_array_equal(np.asarray(strategy.read(a)), np.arange(8.0 * n) * 2)
    np.testing.assert_array_equal(np.asarray(strategy.read(b)), np.arange(3.0) + 1)
    mirrored = strategy.mirror(x)
    np.testing.assert_array_equal(np.asarray(strategy.read(mirrored)), np.arange(8.0 * n))
    batch = jm.PerReplica(
        jax.device_put(jnp.arange(2.0 * n).reshape(n, 2), NamedSharding(mesh, P("data")))
    )
    out = jm.replicate(lambda b: b * 1, strategy=strategy)(batch)
    got = np.stack([np.asarray(c) for c in strategy.local_results(out)])
    np.testing.assert_array_equal(got, np.arange(2.0 * n).reshape(n, 2)[list(_local_ids(strategy))])


@dataclasses.dataclass(frozen=True)
class _Config:
    depth: int


def test_hashable_config_objects_are_static(strategy):
    calls = []

    def fn(x, cfg):
        calls.append(cfg)
        return x * cfg.depth

    step = jm.replicate(fn, strategy=strategy)
    np.testing.assert_allclose(strategy.read(step(jnp.ones(2), _Config(3))), [3, 3])
    step(jnp.ones(2), _Config(3))
    assert step.num_compilations == 1


def _local_ids(strategy):
    return list(strategy.topology.local_replica_ids)


def test_usual_step_at_two_devices_per_replica_with_layout_rules_equals_one_device(n):
    if n < 4:
        pytest.skip("needs 4 devices or more")
    from jax.sharding import PartitionSpec as P

    rules = [(r"layers\[0\]\.weight", P("model", None)), (r"layers\[1\]\.weight", P(None, "model"))]
    strategy = jm.MirroredStrategy(devices_per_replica=2, layout=rules)
    tx = optax.adam(1e-2)
    model = _mlp()
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    replicas = strategy.num_replicas
    xs, ys = _data(replicas, steps=3)
    want_model, want_losses = _one_device(model, opt_state, tx, xs, ys)
    step = jm.replicate(_usual_step(tx), strategy=strategy)
    m, o = strategy.mirror(model), strategy.mirror(opt_state)
    assert m.layers[0].weight.sharding.spec == P("model", None)
    losses = []
    for x, y in zip(xs, ys):
        m, o, loss = step(m, o, _split(replicas, x), _split(replicas, y))
        losses.append(float(strategy.read(loss)))
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert m.layers[0].weight.sharding.spec == P("model", None)
    assert m.layers[1].weight.sharding.spec == P(None, "model")
    for a, b in zip(_arrays(m), _arrays(want_model)):
        np.testing.assert_allclose(
            np.asarray(strategy.read(a)), np.asarray(b), rtol=1e-5, atol=1e-6
        )
    assert step.num_compilations == 1


def test_a_replicated_module_is_named_by_its_class(strategy):
    # A module's repr spans many lines: errors, step statistics and profiler steps name its
    # class instead (a partial by the function it holds).
    model = eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(0))
    step = jm.replicate(model, strategy=strategy)
    assert repr(step) == "<jm.replicate(MLP)>"
    strategy.step_stats(reset=True)
    step(jm.PerReplica(jnp.ones((strategy.num_replicas, 2))))
    (row,) = strategy.step_stats(reset=True).rows
    assert row["name"] == "<jm.replicate(MLP)>"

    def scale(x, factor):
        return x * factor

    assert repr(jm.replicate(functools.partial(scale, factor=2))) == (
        "<jm.replicate(partial(test_a_replicated_module_is_named_by_its_class.<locals>.scale))>"
    )


def test_per_replica_by_the_state_type_declares_every_leaf_of_the_state(strategy, n):
    # As an NNX user writes per_replica=nnx.BatchStat: each replica's own statistics come
    # back, equal to that replica's BatchNorm run alone.
    model, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(3, axis_name="batch", mode="batch")

    def forward(model, state, x):
        batched = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
        return batched(x, state)[1]

    xs = np.linspace(-2, 2, n * 4 * 3, dtype=np.float32).reshape(n, 4, 3) ** 2
    step = jm.replicate(forward, strategy=strategy, per_replica=eqx.nn.State)
    got = step(model, strategy.mirror(state), jm.PerReplica(xs))
    for r, mine in enumerate(strategy.local_results(got)):
        alone = eqx.filter_jit(forward)(model, state, xs[r])
        for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(alone), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
