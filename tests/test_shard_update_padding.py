"""jm.shard_update: "padding never changes a result".

Every leaf of `test_shard_update.SHAPES` is padded on 8 and on 4 replicas. Element-wise work
on a zero-padded piece may make the padding NaN (`g / sqrt(nu)` is `0 / 0` there, while every
real entry is finite), so a reduction over the whole tree must not see it. The oracle is the
inner transformation on `jm.all_reduce("mean", grads)` with mirrored state.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_shard_update import assert_trees_close, train_both


def _leaves_max(tree):
    return jnp.max(jnp.stack([jnp.max(x) for x in jax.tree.leaves(tree)]))


def _leaves_min(tree):
    return jnp.min(jnp.stack([jnp.min(x) for x in jax.tree.leaves(tree)]))


def _leaves_prod(tree):
    return functools.reduce(jnp.multiply, [jnp.prod(x) for x in jax.tree.leaves(tree)])


def _all_finite(tree):
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))
    return jnp.where(finite, 1.0, 2.0)


def _any_nan(tree):
    nan = jnp.any(jnp.stack([jnp.any(jnp.isnan(x)) for x in jax.tree.leaves(tree)]))
    return jnp.where(nan, 2.0, 1.0)


# Whole-tree reductions of `u` (NaN in its padding) and of the gradients `g` (zero there).
REDUCTIONS = {
    "vdot(u, u)": lambda g, u: optax.tree.vdot(u, u),
    "vdot(g, u)": lambda g, u: optax.tree.vdot(g, u),
    "vdot(u, g)": lambda g, u: optax.tree.vdot(u, g),
    "sum(u)": lambda g, u: optax.tree.sum(u),
    "norm(u)": lambda g, u: optax.tree.norm(u),
    "max(u)": lambda g, u: _leaves_max(u),
    "min(u)": lambda g, u: _leaves_min(u),
    "prod(u)": lambda g, u: _leaves_prod(u),
    "all(isfinite(u))": lambda g, u: _all_finite(u),
    "any(isnan(u))": lambda g, u: _any_nan(u),
}


def _rsqrt_then(reduce):
    """An RMS-style update with eps 0 (NaN on the padding), scaled by a whole-tree reduction."""

    def update(grads, nu, params=None):
        nu = jax.tree.map(lambda v, g: v + g * g, nu, grads)
        u = jax.tree.map(lambda g, v: g / jnp.sqrt(v), grads, nu)  # padding: 0 / 0
        scale = reduce(grads, u)
        return jax.tree.map(lambda x: -1e-2 * x / (1.0 + jnp.abs(scale)), u), nu

    return optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p), update)


def _assert_finite(tree):
    for leaf in jax.tree.leaves(tree):
        assert np.isfinite(np.asarray(leaf)).all(), leaf


@pytest.mark.parametrize("reduction", sorted(REDUCTIONS))
def test_nan_padding_does_not_reach_a_whole_tree_reduction(strategy, reduction):
    make = functools.partial(_rsqrt_then, REDUCTIONS[reduction])
    (params, state), (oracle_params, oracle_state) = train_both(strategy, make, steps=3)
    _assert_finite(strategy.read(oracle_params))
    _assert_finite(strategy.read(params))
    assert_trees_close(strategy.read(params), strategy.read(oracle_params))
    assert_trees_close(strategy.read(state), strategy.read(oracle_state))


def _momo_adam_eps_0():
    # momo_adam's `vdot(exp_avg, exp_avg / sqrt(exp_avg_sq))` is NaN on the padding with eps 0;
    # its update needs the loss (`value=`), here a fixed one.
    tx = optax.contrib.momo_adam(1e-2, eps=0.0)
    return optax.GradientTransformation(tx.init, functools.partial(tx.update, value=0.5))


# optax transformations with a whole-tree `optax.tree.vdot` (prodigy, D-adaptation, mechanic).
VDOT_TRANSFORMS = {
    "momo_adam_eps_0": _momo_adam_eps_0,
    "prodigy": lambda: optax.contrib.prodigy(1.0),
    "dadapt_adamw": lambda: optax.contrib.dadapt_adamw(1.0),
    "mechanize_adam": lambda: optax.contrib.mechanize(optax.adam(1e-2)),
}


@pytest.mark.parametrize("name", sorted(VDOT_TRANSFORMS))
def test_optax_transforms_with_a_tree_vdot_equal_the_mirrored_update(strategy, name):
    (params, state), (oracle_params, oracle_state) = train_both(strategy, VDOT_TRANSFORMS[name], 4)
    _assert_finite(strategy.read(oracle_params))
    assert_trees_close(strategy.read(params), strategy.read(oracle_params))
    assert_trees_close(strategy.read(state), strategy.read(oracle_state))
