"""The static proof (`jmirror._proof`): host callbacks, and values passed through unchanged.

`jax.pure_callback` is a pure host function: its result is mirrored when its arguments are;
`io_callback` may answer each replica differently and stays per replica. A key that a
replica function passes through a call, a `cond` or a loop unchanged *is* the key it passed
in, so `restore_key` gives the original back; a key the function computed is kept. Oracles:
NumPy, a one-device `jax.jit` step, the values put in.
"""

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from jax.experimental import io_callback

import jmirror as jm
from jmirror import _proof


def _schedule(step):
    """A learning-rate schedule in NumPy on the host."""
    return np.float32(0.1 / (1.0 + np.asarray(step)))


def _lr(step):
    return jax.pure_callback(_schedule, jax.ShapeDtypeStruct((), jnp.float32), step)


def _io(w):
    return io_callback(_schedule, jax.ShapeDtypeStruct((), jnp.float32), w)


CALLBACKS = {
    # name: (body, mirrored, each replica's value from its x and the mirrored w = 3)
    "pure_callback of mirrored": (lambda x, w: _lr(w), True, lambda x: _schedule(3.0)),
    "pure_callback of per-replica": (lambda x, w: _lr(x), False, _schedule),
    "io_callback": (lambda x, w: _io(w), False, lambda x: _schedule(3.0)),
}


def test_pure_callback_follows_its_arguments_and_io_callback_varies(strategy, n):
    x = np.arange(n, dtype=np.float32)
    args = (jm.PerReplica(x), strategy.mirror(np.float32(3.0)))
    for name, (body, mirrored, want) in CALLBACKS.items():
        out = strategy.run(body, args=args)
        assert isinstance(out, jm.PerReplica) != mirrored, name
        got = strategy.read(out) if mirrored else np.ravel(strategy.local_results(out))
        np.testing.assert_allclose(got, want(None) if mirrored else [want(v) for v in x])


def test_a_numpy_schedule_of_the_step_trains_a_train_state(strategy, n):
    """The step's learning rate from a NumPy schedule: not refused, equal to one device."""
    params = {"w": jnp.ones((4, 3)), "b": jnp.zeros((3,))}
    batch = np.random.default_rng(0).normal(size=(n * 2, 4)).astype(np.float32)
    loss = lambda p, x: jnp.mean((x @ p["w"] + p["b"]) ** 2)  # noqa: E731

    def step(state, x, reduce):
        grads = jax.grad(loss)(state.params, x)
        grads = jm.all_reduce("mean", grads) if reduce else grads
        lr = _lr(state.step)
        new = jax.tree.map(lambda p, g: p - lr * g, state.params, grads)
        return state.replace(step=state.step + 1, params=new)

    state = strategy.mirror(
        train_state.TrainState.create(apply_fn=None, params=params, tx=optax.identity())
    )
    run = jm.replicate(lambda s, x: step(s, x, reduce=True), strategy=strategy)
    x = jm.PerReplica(batch.reshape(n, 2, 4))
    for _ in range(3):
        state = run(state, x)
    ref = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.identity())

    @jax.jit
    def one_device(s, x):
        lr = 0.1 / (1.0 + s.step.astype(jnp.float32))
        new = jax.tree.map(lambda p, g: p - lr * g, s.params, jax.grad(loss)(s.params, x))
        return s.replace(step=s.step + 1, params=new)

    for _ in range(3):
        ref = one_device(ref, batch)
    assert not isinstance(state.params["w"], jm.PerReplica)
    for a, b in zip(jax.tree.leaves(strategy.read(state.params)), jax.tree.leaves(ref.params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(jm.MirroredStateError, match=r"result\.params\['w'\]"):
        jm.replicate(lambda s, x: step(s, x, reduce=False), strategy=strategy)(state, x)


# --- keys passed through unchanged -----------------------------------------------------------


def _carry_scan(f):
    return jax.lax.scan(lambda c, _: (c, None), f, None, length=3)[0]


def _carry_while(f):
    return jax.lax.while_loop(lambda c: c[1] < 3, lambda c: (c[0], c[1] + 1), (f, 0))[0]


PASSED_THROUGH = {
    "itself": lambda f, i: f,
    "jit": lambda f, i: jax.jit(lambda k: k)(f),
    "jit in jit": lambda f, i: jax.jit(lambda k: jax.jit(lambda j: j)(k))(f),
    "remat": lambda f, i: jax.checkpoint(lambda k: k)(f),
    "cond": lambda f, i: jax.lax.cond(i > 0, lambda k: k, lambda k: k, f),
    "scan carry": lambda f, i: _carry_scan(f),
    "while carry": lambda f, i: _carry_while(f),
}
COMPUTED = {
    "split": lambda f, i: jax.random.split(f)[0],
    "cond, one branch computes": lambda f, i: jax.lax.cond(
        i > 0, lambda k: k, lambda k: jax.random.fold_in(k, 1), f
    ),
    "a new seed": lambda f, i: jax.random.key(5),
}


def _restored(how, original, replica):
    """What `restore_key` gives, and whether the proof says it may vary, for a key that a
    replica folded (`replica` varies) and then passed through `how`."""

    def fn(original, replica):
        folded = jax.random.fold_in(original, replica)
        return _proof.restore_key(how(folded, replica), original, folded)

    closed = jax.make_jaxpr(fn)(original, replica)
    varying, _ = _proof.prove(closed, [False, True], "replica")
    value = jax.jit(jex.jaxpr_as_fun(closed))(original, replica)[0]
    return value, varying[0]


@pytest.mark.parametrize("how", PASSED_THROUGH)
def test_a_key_passed_through_unchanged_is_restored(how):
    original = jax.random.key(0)
    for replica in range(3):
        value, varies = _restored(PASSED_THROUGH[how], original, jnp.int32(replica))
        assert not varies
        np.testing.assert_array_equal(jax.random.key_data(value), jax.random.key_data(original))


@pytest.mark.parametrize("how", COMPUTED)
def test_a_computed_key_is_kept_and_varies_with_what_it_comes_from(how):
    original = jax.random.key(0)
    for replica in range(3):
        replica = jnp.int32(replica)
        value, varies = _restored(COMPUTED[how], original, replica)
        assert varies == (how != "a new seed")
        want = COMPUTED[how](jax.random.fold_in(original, replica), replica)
        np.testing.assert_array_equal(jax.random.key_data(value), jax.random.key_data(want))


def test_an_undecided_restore_compares_values():
    """Outside the proof (no decision), the original comes back where the key is unchanged."""
    original, folded = jax.random.key(0), jax.random.fold_in(jax.random.key(0), 1)
    other = jax.random.key(7)
    both = jnp.stack([folded, other])
    got = jax.vmap(_proof.restore_key, in_axes=(0, None, None))(both, original, folded)
    np.testing.assert_array_equal(
        jax.random.key_data(got), jax.random.key_data(jnp.stack([original, other]))
    )
    raw = jnp.asarray([[5, 6], [5, 7]], jnp.uint32)  # raw key data: one word differs
    got = jax.vmap(_proof.restore_key, in_axes=(0, None, None))(raw, raw[0] * 0, raw[0])
    np.testing.assert_array_equal(got, [[0, 0], [5, 7]])
