"""A steady replicated call stays on `jax.jit`'s C++ dispatch, whatever the step returns.

`jax.jit` dispatches a call of a compiled signature in C++ when every output leaf is an array;
otherwise every call runs JAX's Python dispatch (several times slower per call). The oracle is
the interpreter itself: while a steady call runs, no Python function of JAX's jit dispatch
(`jax/_src/pjit.py`) is entered.
"""

import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jmirror as jm

PJIT = ("jax", "_src", "pjit.py")


def _entered_jit_dispatch(call) -> list[str]:
    """Calls `call()` and returns the names of the functions of JAX's jit dispatch entered."""
    entered = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.endswith("/".join(PJIT)):
            entered.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        jax.block_until_ready(call())
    finally:
        sys.setprofile(None)
    return entered


def _steady(call, calls: int = 3):
    """Warms `call` up (compiles), then returns the jit dispatch functions a later call entered."""
    for _ in range(calls):
        jax.block_until_ready(call())
    return _entered_jit_dispatch(call)


def _nnx_step(strategy):
    """The usual NNX in-place step, replicated."""

    @jm.replicate(strategy=strategy)
    def step(model, optimizer, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        optimizer.update(model, jm.all_reduce("mean", grads))
        return jm.all_reduce("mean", loss)

    return step


def test_an_array_step(strategy, n):
    step = jm.replicate(lambda w, x: w + jm.all_reduce("mean", x), strategy=strategy)
    w = strategy.mirror(jnp.zeros(3))
    x = jm.PerReplica(np.ones((n, 3), np.float32))
    assert _steady(lambda: step(w, x)) == []


def test_a_step_returning_static_values(strategy, n):
    @jm.replicate(strategy=strategy)
    def step(w, x):
        return w + jm.all_reduce("mean", x), "a label", jnp.tanh

    w = strategy.mirror(jnp.zeros(3))
    x = jm.PerReplica(np.ones((n, 3), np.float32))
    out, label, fn = step(w, x)
    assert (label, fn) == ("a label", jnp.tanh)  # the same objects come back
    assert _steady(lambda: step(w, x)) == []


def test_an_equinox_step(strategy, n):
    model = eqx.nn.MLP(4, 2, 8, 1, activation=jax.nn.relu, key=jax.random.key(0))
    tx = optax.sgd(0.1)
    state = strategy.mirror((model, tx.init(eqx.filter(model, eqx.is_array))))

    @jm.replicate(strategy=strategy)
    def step(model, opt_state, x):
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
        updates, opt_state = tx.update(jm.all_reduce("mean", grads), opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, jm.all_reduce("mean", loss)

    x = jm.PerReplica(np.ones((n, 5, 4), np.float32))
    held = {"state": state}

    def call():
        model, opt_state, loss = step(*held["state"], x)
        held["state"] = (model, opt_state)
        return loss

    assert _steady(call) == []
    assert held["state"][0].activation is jax.nn.relu


def test_an_nnx_in_place_step(strategy, n):
    model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    step = _nnx_step(strategy)

    x = jm.PerReplica(np.ones((n, 5, 4), np.float32))
    before = int(optimizer.step[...])
    assert _steady(lambda: step(model, optimizer, x)) == []
    assert int(optimizer.step[...]) == before + 4  # every call wrote back


@pytest.mark.parametrize("static", ["a label", 3])
def test_values_come_back_after_compiling_ahead(strategy, n, static):
    @jm.replicate(strategy=strategy, static_argnums=(2,))
    def step(w, x, s):
        return w + jm.all_reduce("mean", x), s, "fixed"

    w = strategy.mirror(jnp.zeros(3))
    x = jm.PerReplica(np.ones((n, 3), np.float32))
    compiled = step.lower(w, x, static).compile()
    out, s, fixed = compiled(w, x, static)
    assert (s, fixed) == (static, "fixed")
    np.testing.assert_allclose(np.asarray(strategy.read(out)), np.ones(3))


def _nnx_flattens(call) -> int:
    """Calls `call()` and returns how many times an NNX object's own flatten ran in it."""
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        if event == "call" and frame.f_code.co_name == "_pytree__flatten":
            count += 1

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return count


def test_an_nnx_step_flattens_an_object_only_after_it_changed(strategy, n):
    # An NNX object's flatten runs in Python: finding its Variables (to write them back) and
    # passing its arrays to the step share one, an object unchanged since the last call is
    # not flattened again, and a changed one once more to check its new snapshot.
    model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.Linear(8, 2, rngs=nnx.Rngs(1)))
    optimizer = nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)

    step = _nnx_step(strategy)

    x = jm.PerReplica(np.ones((n, 5, 4), np.float32))
    for _ in range(3):
        jax.block_until_ready(step(model, optimizer, x))
    once = _nnx_flattens(lambda: jax.tree_util.tree_flatten((model, optimizer)))
    assert once >= 4  # the model, its two layers, the optimizer (and what it holds)
    assert _nnx_flattens(lambda: jax.block_until_ready(step(model, optimizer, x))) == 0
    # Another Variable object in the model (an equal structure: nothing compiles again):
    # the model is flattened for the call and for its new snapshot, the optimizer not.
    model.layers[0].bias = nnx.Param(model.layers[0].bias[...])
    model_once = _nnx_flattens(lambda: jax.tree_util.tree_flatten(model))
    assert _nnx_flattens(lambda: jax.block_until_ready(step(model, optimizer, x))) == 2 * model_once
    assert _nnx_flattens(lambda: jax.block_until_ready(step(model, optimizer, x))) == 0
    assert step.num_compilations == 1


def test_an_nnx_object_changed_before_every_call_is_flattened_once_a_call(strategy, n):
    # A snapshot that misses call after call (a Variable replaced before each step) is given
    # up: such an object costs one flatten a call, as without snapshots, not two.
    model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.Linear(8, 2, rngs=nnx.Rngs(1)))
    optimizer = nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)
    step = _nnx_step(strategy)
    x = jm.PerReplica(np.ones((n, 5, 4), np.float32))
    model_once = _nnx_flattens(lambda: jax.tree_util.tree_flatten(model))
    counts = []
    for _ in range(6):
        model.layers[0].bias = nnx.Param(model.layers[0].bias[...])
        counts.append(_nnx_flattens(lambda: jax.block_until_ready(step(model, optimizer, x))))
    assert counts[-2:] == [model_once, model_once]
    assert step.num_compilations == 1
