"""Returned state is checked leaf by leaf.

A linen `TrainState` (any dataclass state) that entered mirrored is checked wherever it comes
back: whatever else it holds (a per-replica dropout key, a sync-on-read total, `jm.shard_update`
state), inside tuples and dicts at any depth, and in a dataclass whose structure changed on the
way (fields matched by path). Un-reduced gradients and a BatchNorm without `axis_name` are a
`jm.MirroredStateError` before anything runs; the correct step is not refused and trains equal
to one device on the global batch (the oracle: a plain `jax.jit` step, NumPy comparison).
"""

import warnings
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import struct
from flax.training import train_state

import jmirror as jm

PER_REPLICA = 4  # examples per replica


class _Net(nn.Module):
    axis_name: str | None = None  # None: the BatchNorm normalizes over one replica's batch

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(3)(x)
        return nn.BatchNorm(use_running_average=False, axis_name=self.axis_name)(x)


class _State(train_state.TrainState):
    batch_stats: Any
    extra: Any  # what else the state holds


def _global_batch(n):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n * PER_REPLICA, 5)).astype(np.float32)


def _tx(holds, sharded=True):
    # momentum: state leaves of the parameters' shapes, which jm.shard_update splits (adam
    # would amplify the float noise of the bias before the BatchNorm, whose gradient is zero)
    if holds != "sharded":
        return optax.sgd(0.1)
    inner = optax.sgd(0.1, momentum=0.9)
    return jm.shard_update(inner) if sharded else inner


def _init(tx):
    variables = _Net().init(jax.random.key(0), jnp.zeros((PER_REPLICA, 5)))
    return variables["params"], variables["batch_stats"], tx


def _state(strategy, holds):
    """A mirrored `_State` that also holds a distributed leaf of kind `holds`."""
    n = strategy.num_replicas
    tx = _tx(holds)
    params, stats, tx = _init(tx)
    with strategy.scope():
        params, stats = strategy.mirror((params, stats))
        state = _State.create(apply_fn=None, params=params, tx=tx, batch_stats=stats, extra=None)
    if holds == "per_replica_key":
        extra = jm.PerReplica(jax.random.split(jax.random.key(1), n))
    elif holds == "sync_on_read":
        extra = strategy.sync_on_read(jnp.zeros(()), "sum")
    else:
        extra = strategy.mirror(jnp.zeros(()))  # a mirrored leaf: the state holds Sharded ones
    return state.replace(extra=extra)


def _loss(params, stats, x, axis_name):
    out, updates = _Net(axis_name).apply(
        {"params": params, "batch_stats": stats}, x, mutable=["batch_stats"]
    )
    return jnp.mean((out - 1.0) ** 2), updates["batch_stats"]


def _step(holds, axis_name, reduce):
    def step(state, x):
        grad_fn = jax.value_and_grad(_loss, has_aux=True)
        (loss, stats), grads = grad_fn(state.params, state.batch_stats, x, axis_name)
        if reduce and holds != "sharded":  # jm.shard_update reduces the gradients itself
            grads = jm.all_reduce("mean", grads)
        extra = state.extra
        if holds == "per_replica_key":
            extra = jax.random.split(extra)[0]
        elif holds == "sync_on_read":
            extra = extra.replace(extra.value + loss)
        state = state.apply_gradients(grads=grads, batch_stats=stats)
        return state.replace(extra=extra)

    return step


HOLDS = ("per_replica_key", "sync_on_read", "sharded")


@pytest.mark.parametrize("holds", HOLDS)
def test_a_train_state_holding_distributed_leaves_is_checked(strategy, holds):
    """Both mistakes are refused; the correct step is not, and trains as one device."""
    n = strategy.num_replicas
    batch = _global_batch(n)
    x = jm.PerReplica(batch.reshape(n, -1, 5))
    mistakes = ("batch_norm",) if holds == "sharded" else ("gradients", "batch_norm")
    for mistake in mistakes:  # jm.shard_update reduces the gradients itself
        state = _state(strategy, holds)
        kernel = np.asarray(strategy.read(state.params["Dense_0"]["kernel"]))
        axis_name = None if mistake == "batch_norm" else strategy.axis_name
        wrong = _step(holds, axis_name, reduce=mistake != "gradients")
        with pytest.raises(jm.MirroredStateError) as caught:
            jm.replicate(wrong, strategy=strategy, donate_argnums=0)(state, x)
        message = str(caught.value)
        if mistake == "gradients":
            assert "result.params['Dense_0']['kernel']" in message and "all_reduce" in message
        else:
            assert "result.batch_stats['BatchNorm_0']['mean']" in message
            assert "axis_name=strategy.axis_name" in message
            assert "result.params" not in message  # the gradients were reduced
        assert "result.extra" not in message  # the distributed leaf is not a divergence
        assert not state.params["Dense_0"]["kernel"].is_deleted()  # nothing ran or was donated
        np.testing.assert_array_equal(strategy.read(state.params["Dense_0"]["kernel"]), kernel)

    step = jm.replicate(_step(holds, strategy.axis_name, reduce=True), strategy=strategy)
    for _ in range(2):
        state = step(state, x)
    params, stats, _ = _init(None)
    ref = _State.create(
        apply_fn=None, params=params, tx=_tx(holds, sharded=False), batch_stats=stats, extra=None
    )

    @jax.jit
    def one_device(ref, x):
        grad_fn = jax.value_and_grad(_loss, has_aux=True)
        (_, stats), grads = grad_fn(ref.params, ref.batch_stats, x, None)
        return ref.apply_gradients(grads=grads, batch_stats=stats)

    for _ in range(2):
        ref = one_device(ref, batch)
    got = strategy.read({"params": state.params, "batch_stats": state.batch_stats})
    want = {"params": ref.params, "batch_stats": ref.batch_stats}
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    kinds = {"per_replica_key": jm.PerReplica, "sync_on_read": jm.SyncOnRead}
    if holds in kinds:
        assert isinstance(state.extra, kinds[holds])
    else:
        nodes = jax.tree.leaves(state.opt_state, is_leaf=lambda x: isinstance(x, jm.Sharded))
        assert any(isinstance(x, jm.Sharded) for x in nodes)


def _plain_state(strategy):
    params, stats, tx = _init(optax.sgd(0.1))
    with strategy.scope():
        params, stats = strategy.mirror((params, stats))
        return _State.create(apply_fn=None, params=params, tx=tx, batch_stats=stats, extra=None)


def _unreduced(state, x):
    (_, stats), grads = jax.value_and_grad(_loss, has_aux=True)(
        state.params, state.batch_stats, x, jm.replica_context().axis_name
    )
    return state.apply_gradients(grads=grads, batch_stats=stats)


def _carry(state, ema, x):
    return (_unreduced(state, x), ema), jm.all_reduce("mean", jnp.mean(x))


CARRIES = {
    # (state, ema), loss = step((state, ema), batch)
    "tuple": (
        lambda s, e: ((s, e),),
        lambda c, x: _carry(*c, x),
        "result[0][0].params['Dense_0']['kernel']",
    ),
    # two containers deep: ({"train": (state, ema)}, step), loss
    "two deep": (
        lambda s, e: (({"train": (s, e)}, jnp.zeros(())),),
        lambda c, x: (({"train": _carry(*c[0]["train"], x)[0]}, c[1] + 1), 0.0),
        "result[0][0]['train'][0].params['Dense_0']['kernel']",
    ),
}


@pytest.mark.parametrize("carry", CARRIES)
def test_state_in_a_carry_is_refused_at_any_depth(strategy, carry):
    make, fn, path = CARRIES[carry]
    state = _plain_state(strategy)
    ema = strategy.mirror({"w": jnp.ones((5, 3))})
    args = make(state, ema)
    x = jm.PerReplica(_global_batch(strategy.num_replicas).reshape(strategy.num_replicas, -1, 5))
    with pytest.raises(jm.MirroredStateError) as caught:
        jm.replicate(fn, strategy=strategy)(*args, x)
    assert path in str(caught.value) and "_State" in str(caught.value)
    assert "all_reduce" in str(caught.value)

    def correct(carry, x):  # a per-replica key beside the state: left alone, no warning
        state, key = carry
        (_, stats), grads = jax.value_and_grad(_loss, has_aux=True)(
            state.params, state.batch_stats, x, strategy.axis_name
        )
        state = state.apply_gradients(grads=jm.all_reduce("mean", grads), batch_stats=stats)
        return (state, jax.random.split(key)[0]), jm.all_reduce("mean", jnp.mean(x))

    keys = jm.PerReplica(jax.random.split(jax.random.key(0), strategy.num_replicas))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (state, keys), _ = jm.replicate(correct, strategy=strategy)((state, keys), x)
    assert isinstance(keys, jm.PerReplica)
    assert not isinstance(state.params["Dense_0"]["kernel"], jm.PerReplica)


def test_nnx_objects_among_the_arguments_leave_the_check_of_the_rest_on(strategy):
    from flax import nnx

    n = strategy.num_replicas
    state = _plain_state(strategy)
    x = jm.PerReplica(_global_batch(n).reshape(n, -1, 5))
    counter = nnx.Variable(jnp.zeros(()))  # taken by the NNX adapter, written back

    def step(state, x, counter):
        counter[...] += 1.0
        return _unreduced(state, x)

    with pytest.raises(jm.MirroredStateError, match=r"result\.params\['Dense_0'\]"):
        jm.replicate(step, strategy=strategy)(state, x, counter)
    assert float(strategy.read(counter[...])) == 0.0  # refused before anything ran


def test_of_two_states_of_one_type_each_result_is_checked_against_its_own_source(strategy):
    n = strategy.num_replicas
    state = _plain_state(strategy)
    # An ensemble of the same type, per replica on purpose.
    ensemble = jax.tree.map(lambda a: jm.PerReplica(jnp.stack([a] * n)), strategy.read(state))
    x = jm.PerReplica(_global_batch(n).reshape(n, -1, 5))

    def reduced(state, x):
        (_, stats), grads = jax.value_and_grad(_loss, has_aux=True)(
            state.params, state.batch_stats, x, strategy.axis_name
        )
        return state.apply_gradients(grads=jm.all_reduce("mean", grads), batch_stats=stats)

    # The mirrored state updated from unreduced gradients, returned alone: refused.
    with pytest.raises(jm.MirroredStateError, match=r"result\.params"):
        jm.replicate(lambda ens, s, x: _unreduced(s, x), strategy=strategy)(ensemble, state, x)
    # Both updated correctly, returned in the other order than they came: runs.
    swapped = jm.replicate(lambda ens, s, x: (reduced(s, x), _unreduced(ens, x)), strategy=strategy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new, new_ensemble = swapped(ensemble, state, x)
    assert not isinstance(new.params["Dense_0"]["kernel"], jm.PerReplica)
    assert isinstance(new_ensemble.params["Dense_0"]["kernel"], jm.PerReplica)


@struct.dataclass
class _WithEma:
    state: _State
    ema: Any = None  # filled on the first step
    step: Any = 0


def test_a_dataclass_whose_structure_changes_is_matched_by_path(strategy):
    n = strategy.num_replicas
    holder = _WithEma(_plain_state(strategy), None, strategy.mirror(jnp.zeros((), jnp.int32)))
    x = jm.PerReplica(_global_batch(n).reshape(n, -1, 5))

    def fill(holder, x, reduce):
        state = _unreduced(holder.state, x)
        if reduce:  # the parameters averaged after the fact: mirrored again
            state = state.replace(params=jm.all_reduce("mean", state.params))
        ema = jax.tree.map(lambda p: 0.5 * p, state.params)
        return holder.replace(state=state, ema=ema, step=holder.step + 1)

    with pytest.raises(jm.MirroredStateError) as caught:
        jm.replicate(lambda h, x: fill(h, x, False), strategy=strategy)(holder, x)
    message = str(caught.value)
    assert "result.state.params['Dense_0']['kernel']" in message and "_WithEma" in message
    assert "result.ema" not in message  # the new field did not enter mirrored
    filled = jm.replicate(lambda h, x: fill(h, x, True), strategy=strategy)(holder, x)
    assert not isinstance(filled.state.params["Dense_0"]["kernel"], jm.PerReplica)
    assert int(strategy.read(filled.step)) == 1


def test_a_plain_state_deep_in_the_result_warns_with_its_path(strategy):
    """A plain pytree has no type to match: the one shaped like a mirrored argument warns,
    wherever it comes back; reduced gradients do not."""
    n = strategy.num_replicas
    params = strategy.mirror({"w": jnp.ones((5, 3)), "b": jnp.zeros((3,))})
    x = jm.PerReplica(_global_batch(n).reshape(n, -1, 5))

    def sgd(params, x, reduce):
        grads = jax.grad(lambda p: jnp.mean((x @ p["w"] + p["b"]) ** 2))(params)
        grads = jm.all_reduce("mean", grads) if reduce else grads
        new = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
        return {"train": {"carry": (new, jnp.zeros(()))}}, jm.all_reduce("mean", jnp.mean(x))

    step = jm.replicate(lambda p, x: sgd(p, x, reduce=False), strategy=strategy)
    with pytest.warns(
        jm.MirroredStateWarning, match=r"result\[0\]\['train'\]\['carry'\]\[0\]\['w'\]"
    ):
        step(params, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, _ = jm.replicate(lambda p, x: sgd(p, x, reduce=True), strategy=strategy)(params, x)
    assert not isinstance(out["train"]["carry"][0]["w"], jm.PerReplica)
