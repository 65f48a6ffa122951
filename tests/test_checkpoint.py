"""jm.checkpoint: save / restore and CheckpointManager against NumPy oracles."""

import builtins
import json
import os
import pathlib
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import jmirror as jm
from jmirror.checkpoint import _integrity


def is_mirrored(x, strategy):
    return (
        isinstance(x, jax.Array)
        and x.sharding.is_fully_replicated
        and x.sharding.device_set == set(strategy.devices)
    )


def stacked(strategy, components):
    """A stacked array holding `components` (leading axis N), slice i on device i."""
    return strategy.distribute_values_from_function(lambda ctx: components[ctx.replica_id]).values


def disk_bytes(path):
    return sum(f.stat().st_size for f in pathlib.Path(path).rglob("*") if f.is_file())


def components(strategy, node):
    return np.stack([np.asarray(c) for c in strategy.local_results(node)])


# --- save / restore ----------------------------------------------------------------------------


def test_mixed_state_round_trips_as_saved(strategy, n, tmp_path):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 4)).astype(np.float32)
    host = rng.integers(0, 9, (5,))
    state = {
        "params": {"w": strategy.mirror(w), "b": strategy.mirror(np.arange(4, dtype=np.int32))},
        "host": host,
        "scalar": np.float32(1.5),
        "py": (7, 2.5, True),
        "nested": [None, {"k": strategy.mirror(jax.random.key(3))}],
        "empty": {},
    }
    jm.checkpoint.save(tmp_path / "ckpt", state, strategy=strategy)
    host[:] = -1  # the caller's numpy array changes after save: the checkpoint does not
    out = jm.checkpoint.restore(tmp_path / "ckpt", strategy=strategy)
    np.testing.assert_array_equal(out["params"]["w"], w)
    np.testing.assert_array_equal(out["params"]["b"], np.arange(4))
    assert is_mirrored(out["params"]["w"], strategy) and out["params"]["b"].dtype == jnp.int32
    assert type(out["host"]) is np.ndarray and out["host"].tolist() != [-1] * 5
    assert type(out["scalar"]) is np.float32 and out["scalar"] == 1.5
    assert out["py"] == (7, 2.5, True) and [type(v) for v in out["py"]] == [int, float, bool]
    assert out["nested"][0] is None and out["empty"] == {}
    key = out["nested"][1]["k"]
    assert is_mirrored(key, strategy) and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(jax.random.key(3)))


def test_mirrored_state_is_written_once(strategy, tmp_path):
    w = np.random.default_rng(1).standard_normal((512, 512)).astype(np.float32)  # 1 MiB
    jm.checkpoint.save(tmp_path / "ckpt", {"w": strategy.mirror(w)}, strategy=strategy)
    assert disk_bytes(tmp_path / "ckpt") <= 1.1 * w.nbytes + 64 * 1024


@pytest.mark.parametrize(
    "aggregation, dtype",
    [
        ("sum", np.int32),
        ("sum", np.float32),
        ("mean", np.float32),
        ("mean", np.int32),
        ("only_first_replica", np.int32),
        ("only_first_replica", np.float32),
    ],
)
@pytest.mark.parametrize("restore_n", ["same", 1, 3])
def test_sync_on_read_is_saved_aggregated_and_restored_as_assign(
    strategy, n, tmp_path, aggregation, dtype, restore_n
):
    target_n = n if restore_n == "same" else restore_n
    if target_n > n:
        pytest.skip(f"needs {target_n} devices")
    rng = np.random.default_rng(2)
    parts = rng.integers(-50, 50, (n, 3)).astype(dtype)
    node = jm.SyncOnRead(stacked(strategy, parts), aggregation)
    oracle = {"sum": parts.sum(0), "mean": parts.mean(0), "only_first_replica": parts[0]}
    saved = oracle[aggregation]
    jm.checkpoint.save(tmp_path / "c", {"metric": node}, strategy=strategy)
    other = jm.MirroredStrategy(num_devices=target_n, backend=strategy.backend)
    out = jm.checkpoint.restore(tmp_path / "c", strategy=other)["metric"]
    assert isinstance(out, jm.SyncOnRead) and out.aggregation == jm.Aggregation(aggregation)
    comps = components(other, out)
    assert comps.shape == (target_n, 3) and comps.dtype == dtype
    read = np.asarray(other.read(out))
    if restore_n == "same":  # the components as they were (bitwise resume)
        np.testing.assert_array_equal(comps, parts)
        return
    if aggregation == "mean" and dtype == np.int32:
        np.testing.assert_array_equal(comps, np.broadcast_to(np.rint(saved), comps.shape))
    elif np.issubdtype(dtype, np.integer):
        np.testing.assert_array_equal(read, saved)  # exact on any replica count
    else:
        np.testing.assert_allclose(read, saved, rtol=1e-6)
    if not (aggregation == "mean" and dtype == np.int32):  # the rounding rule is the checkpoint's
        assigned = other.assign(other.sync_on_read(np.zeros(3, dtype), aggregation), saved)
        np.testing.assert_array_equal(comps, components(other, assigned))


def test_integer_sum_spreads_the_remainder_over_the_first_replicas(n, tmp_path):
    strategy = jm.MirroredStrategy()
    jm.checkpoint.save(tmp_path / "c", strategy.sync_on_read(np.int32(0), "sum"))
    total = np.array(8 * 5 + 3, np.int32)  # as if saved on 8 replicas: 43
    restored = []
    for k in sorted({1, min(n, 8)}):
        other = jm.MirroredStrategy(num_devices=k)
        node = other.assign(other.sync_on_read(np.int32(0), "sum"), total)
        jm.checkpoint.save(tmp_path / f"t{k}", node, strategy=other)
        out = jm.checkpoint.restore(tmp_path / f"t{k}", strategy=other)
        expected = [43 // k + (i < 43 % k) for i in range(k)]
        assert components(other, out).tolist() == expected
        restored.append(int(other.read(out)))
    assert restored == [43] * len(restored)


def test_integer_mean_restores_to_nearest_ties_to_even(tmp_path):
    from jmirror.testing import EmulatedStrategy

    emulated = EmulatedStrategy(8)  # 8 replicas on one device, in both device-count passes
    one = jm.MirroredStrategy(num_devices=1)
    for i, total in enumerate([4, 12, 20, -4, 19, 21]):  # means 0.5 1.5 2.5 -0.5 2.375 2.625
        parts = np.zeros(8, np.int32)
        parts[0] = total
        node = jm.SyncOnRead(jnp.asarray(parts), "mean")
        jm.checkpoint.save(tmp_path / f"c{i}", {"m": node}, strategy=emulated)
        expected = int(np.rint(total / 8))
        assert expected == [0, 2, 2, 0, 2, 3][i]
        for strategy in (emulated, one):
            out = jm.checkpoint.restore(tmp_path / f"c{i}", strategy=strategy)
            comps = components(strategy, out["m"])
            assert comps.dtype == np.int32
            if strategy is emulated:  # the saved replica count: the components as they were
                assert comps.tolist() == parts.tolist()
            else:
                assert comps.tolist() == [expected] * strategy.num_replicas


def test_integer_mean_is_stored_as_read(strategy, n, tmp_path):
    parts = np.arange(n, dtype=np.int32) + 1
    node = jm.SyncOnRead(stacked(strategy, parts), "mean")
    jm.checkpoint.save(tmp_path / "c", {"m": node}, strategy=strategy)
    one = jm.MirroredStrategy(num_devices=1, backend=strategy.backend)
    out = jm.checkpoint.restore(tmp_path / "c", strategy=one)  # placed from the read value
    assert components(one, out["m"]).tolist() == [int(np.rint(parts.mean()))]
    out = jm.checkpoint.restore(tmp_path / "c", strategy=strategy)  # as saved
    assert components(strategy, out["m"]).tolist() == parts.tolist()


@pytest.mark.parametrize("kind", ["per_replica", "sync_on_read_none"])
def test_per_replica_round_trips_on_the_same_replica_count(strategy, n, tmp_path, kind):
    parts = np.random.default_rng(3).standard_normal((n, 2, 3)).astype(np.float32)
    keys = strategy.split_key(jax.random.key(0))
    if kind == "per_replica":
        node = jm.PerReplica({"x": stacked(strategy, parts)})
    else:
        node = jm.SyncOnRead({"x": stacked(strategy, parts)}, "none")
    jm.checkpoint.save(tmp_path / "c", {"v": node, "keys": keys}, strategy=strategy)
    out = jm.checkpoint.restore(tmp_path / "c", strategy=strategy)
    assert type(out["v"]) is type(node)
    got = np.stack([np.asarray(c["x"]) for c in strategy.local_results(out["v"])])
    np.testing.assert_array_equal(got, parts)
    np.testing.assert_array_equal(
        jax.random.key_data(out["keys"].values), jax.random.key_data(keys.values)
    )
    assert out["keys"].values.sharding.spec == jax.sharding.PartitionSpec(strategy.axis_name)


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices")
@pytest.mark.parametrize("kind", ["per_replica", "sync_on_read_none"])
def test_per_replica_on_another_replica_count_names_path_counts_and_fix(n, tmp_path, kind):
    strategy = jm.MirroredStrategy()
    parts = np.zeros((n, 2), np.float32)
    node = jm.PerReplica(stacked(strategy, parts))
    if kind == "sync_on_read_none":
        node = jm.SyncOnRead(node.values, "none")
    jm.checkpoint.save(tmp_path / "c", {"dropout": node}, strategy=strategy)
    with pytest.raises(ValueError) as info:
        jm.checkpoint.restore(tmp_path / "c", strategy=jm.MirroredStrategy(num_devices=1))
    message = str(info.value)
    assert "['dropout']" in message and f"saved with {n} replicas" in message
    assert "has 1" in message and "split_key" in message


# --- target ------------------------------------------------------------------------------------


def _train_state(strategy):
    params = {"dense": {"kernel": jnp.ones((3, 2)), "bias": jnp.zeros(2)}}
    state = train_state.TrainState.create(
        apply_fn=lambda p, x: x, params=params, tx=optax.adam(1e-2)
    )
    grads = jax.tree.map(jnp.ones_like, params)
    return strategy.mirror(state.apply_gradients(grads=grads))


def test_flax_train_state_and_optax_state_round_trip_with_target(strategy, tmp_path):
    state = _train_state(strategy)
    jm.checkpoint.save(tmp_path / "c", state, strategy=strategy)
    fresh = _train_state(strategy).replace(step=0)
    out = jm.checkpoint.restore(tmp_path / "c", target=fresh, strategy=strategy)
    assert type(out) is train_state.TrainState and type(out.opt_state[0]) is optax.ScaleByAdamState
    assert out.apply_fn is fresh.apply_fn and out.tx is fresh.tx
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(state)):
        np.testing.assert_array_equal(got, want)
        assert is_mirrored(got, strategy)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    out = jm.checkpoint.restore(tmp_path / "c", target=abstract, strategy=strategy)
    assert type(out) is train_state.TrainState
    np.testing.assert_array_equal(
        out.opt_state[0].mu["dense"]["kernel"], state.opt_state[0].mu["dense"]["kernel"]
    )


def test_a_resumed_step_compiles_no_more_than_an_uninterrupted_one(strategy, n, tmp_path):
    # A TrainState's step (a Python 0, then `step + 1`) and a counter made from a Python int
    # are weakly typed; restored strongly typed, the resumed step would compile once more (and,
    # in a restarted process, miss the persistent compilation cache's entry for it).
    tx = optax.sgd(0.1)

    def fresh():
        params = {"w": jnp.ones((4, 2))}
        return train_state.TrainState.create(apply_fn=None, params=params, tx=tx), 0

    def step(state, seen, x):
        grads = jax.grad(lambda p: jnp.mean((x @ p["w"]) ** 2))(state.params)
        return state.apply_gradients(grads=jm.all_reduce("mean", grads)), seen + 1

    step = jm.replicate(step, strategy=strategy)
    x = jm.PerReplica(np.linspace(-1, 1, n * 12, dtype=np.float32).reshape(n, 3, 4))
    state = fresh()
    for _ in range(2):
        state = step(*state, x)

    def weak(state, step, seen):
        return [jax.typeof(x).weak_type for x in (step, state["params"]["w"], seen)]

    assert weak(state[0].__dict__, state[0].step, state[1]) == [True, False, True]
    jm.checkpoint.save(tmp_path / "c", state, strategy=strategy)
    out = jm.checkpoint.restore(tmp_path / "c", strategy=strategy)  # dicts of the fields
    assert weak(out[0], out[0]["step"], out[1]) == [True, False, True]
    for target in (fresh(), jax.eval_shape(fresh)):
        out = jm.checkpoint.restore(tmp_path / "c", target=target, strategy=strategy)
        assert weak(out[0].__dict__, out[0].step, out[1]) == [True, False, True]
        out = step(*out, x)
        assert int(out[0].step) == 3 and int(out[1]) == 3
    assert step.num_compilations == 1


def test_without_target_other_classes_come_back_as_dicts_of_fields(strategy, tmp_path):
    state = _train_state(strategy)
    jm.checkpoint.save(tmp_path / "c", state, strategy=strategy)
    out = jm.checkpoint.restore(tmp_path / "c", strategy=strategy)
    assert set(out) == {"step", "params", "opt_state"}
    adam, empty = out["opt_state"]
    assert set(adam) == {"count", "mu", "nu"} and empty == {}
    np.testing.assert_array_equal(
        adam["nu"]["dense"]["bias"], state.opt_state[0].nu["dense"]["bias"]
    )


@pytest.mark.parametrize(
    "change, path, saved, expected",
    [
        (lambda t: {**t, "extra": 1}, "['extra']", "no entry", "a leaf (a Python int)"),
        (
            lambda t: {**t, "b": {"y": 0}},
            "['b']['x']",
            "a leaf",
            "no entry (target's keys there: ['y'])",
        ),
        (lambda t: {**t, "a": np.zeros((2, 4), np.float32)}, "['a']", "(2, 3)", "(2, 4)"),
        (lambda t: {**t, "a": np.zeros((2, 3), np.int32)}, "['a']", "float32", "int32"),
        (
            lambda t: {**t, "b": {"x": jm.SyncOnRead(0, "sum")}},
            "['b']['x']",
            "a leaf",
            "SyncOnRead",
        ),
        (lambda t: {**t, "a": [1]}, "['a']", "a leaf", "a list with keys [0]"),
    ],
)
def test_target_mismatch_names_first_path_saved_and_expected(
    strategy, tmp_path, change, path, saved, expected
):
    state = {"a": strategy.mirror(np.zeros((2, 3), np.float32)), "b": {"x": 1}}
    jm.checkpoint.save(tmp_path / "c", state, strategy=strategy)
    with pytest.raises(ValueError) as info:
        jm.checkpoint.restore(tmp_path / "c", target=change(state), strategy=strategy)
    message = str(info.value)
    assert repr(path) in message or path in message
    assert saved in message and expected in message


def test_sync_on_read_target_from_another_replica_count(n, tmp_path):
    strategy = jm.MirroredStrategy()
    node = strategy.sync_on_read(np.float32(2.0), "sum")
    jm.checkpoint.save(tmp_path / "c", {"loss": node}, strategy=strategy)
    one = jm.MirroredStrategy(num_devices=1)
    target = {"loss": one.sync_on_read(np.float32(0.0), "sum")}
    out = jm.checkpoint.restore(tmp_path / "c", target=target, strategy=one)
    assert float(one.read(out["loss"])) == 2.0 * n


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn, np.float16])
@pytest.mark.parametrize("aggregation", ["sum", "mean"])
def test_a_low_precision_sync_on_read_restores_onto_another_replica_count(
    n, tmp_path, dtype, aggregation
):
    # numpy does not count bfloat16 and the float8 types as floating: they were divided as
    # integers (a SUM) or rounded to integers (a MEAN).
    strategy = jm.MirroredStrategy()
    value = np.array([2.5, -10.0, 60.0], dtype)
    saved = strategy.assign(strategy.sync_on_read(np.zeros(3, dtype), aggregation), value)
    jm.checkpoint.save(tmp_path / "c", {"s": saved}, strategy=strategy)
    three = jm.MirroredStrategy(num_devices=min(3, n))
    target = {"s": three.sync_on_read(np.zeros(3, dtype), aggregation)}
    out = jm.checkpoint.restore(tmp_path / "c", target=target, strategy=three)
    # Up to the dtype's rounding of value / N (its mantissa: 7 bits, 3 bits, 10 bits).
    rtol = {jnp.bfloat16: 2**-7, jnp.float8_e4m3fn: 2**-3, np.float16: 2**-10}[dtype]
    read = np.asarray(strategy.read(saved), np.float32)
    np.testing.assert_allclose(np.asarray(three.read(out["s"]), np.float32), read, rtol=rtol)
    assert np.all(np.sign(read) == np.sign(value.astype(np.float32)))


@pytest.mark.parametrize("component", [np.int8(100), np.bool_(True)])
def test_an_integer_sum_the_replica_count_cannot_hold_is_refused_at_restore(n, tmp_path, component):
    if n < 4:
        pytest.skip("restores a sum of 4 or more components onto 3 replicas")
    strategy = jm.MirroredStrategy()
    saved = strategy.sync_on_read(
        component, "sum"
    )  # every replica's component: the sum is n of them
    jm.checkpoint.save(tmp_path / "c", {"s": saved}, strategy=strategy)
    three = jm.MirroredStrategy(num_devices=3)
    target = {"s": three.sync_on_read(np.zeros((), component.dtype), "sum")}
    if component.dtype == np.int8 and n < 8:  # 100 n / 3 fits an int8: restored exactly
        out = jm.checkpoint.restore(tmp_path / "c", target=target, strategy=three)
        assert int(three.read(out["s"])) == 100 * n
        return
    with pytest.raises(ValueError, match=r"at \['s'\].* reads .*3 replicas cannot hold"):
        jm.checkpoint.restore(tmp_path / "c", target=target, strategy=three)


# --- files -------------------------------------------------------------------------------------


def test_save_refuses_existing_directory_unless_force(tmp_path):
    jm.checkpoint.save(tmp_path / "c", {"v": 1})
    with pytest.raises(ValueError, match="force=True"):
        jm.checkpoint.save(tmp_path / "c", {"v": 2})
    assert jm.checkpoint.restore(tmp_path / "c") == {"v": 1}
    jm.checkpoint.save(tmp_path / "c", {"v": 3, "w": np.ones(2)}, force=True)
    assert jm.checkpoint.restore(tmp_path / "c")["v"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_missing_checkpoint_is_file_not_found_naming_what_exists(tmp_path):
    jm.checkpoint.save(tmp_path / "there", {"v": 1})
    with pytest.raises(FileNotFoundError, match="there"):
        jm.checkpoint.restore(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        jm.checkpoint.restore(tmp_path / "a" / "b")
    with jm.checkpoint.CheckpointManager(tmp_path / "series") as manager:
        manager.save(4, {"v": 1})
        manager.save(8, {"v": 2})
        with pytest.raises(FileNotFoundError, match=r"\[4, 8\]"):
            manager.restore(5)
        with pytest.raises(FileNotFoundError, match=r"\[4, 8\]"):
            manager.data(6)
    with pytest.raises(FileNotFoundError, match=r"steps \[4, 8\]"):
        jm.checkpoint.restore(tmp_path / "series")
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        jm.checkpoint.CheckpointManager(tmp_path / "fresh").restore()


def test_an_unfinished_save_is_never_restored(tmp_path):
    jm.checkpoint.save(tmp_path / "c", {"v": np.ones(3)})
    partial = tmp_path / "5.orbax-checkpoint-tmp"
    partial.mkdir()
    (partial / "jmirror").mkdir()
    with jm.checkpoint.CheckpointManager(tmp_path) as manager:
        assert manager.all_steps() == []
    (tmp_path / "7.orbax-checkpoint-tmp").mkdir()
    with pytest.raises((FileNotFoundError, ValueError)):
        jm.checkpoint.restore(tmp_path / "7.orbax-checkpoint-tmp")


def test_empty_and_scalar_only_states(tmp_path):
    for i, state in enumerate([{}, None, (), {"a": 1, "b": [2.0, None]}]):
        jm.checkpoint.save(tmp_path / str(i), state)
        assert jm.checkpoint.restore(tmp_path / str(i)) == state


def test_unsupported_leaves_are_type_errors_naming_the_path(tmp_path):
    with pytest.raises(TypeError, match=r"\['name'\]"):
        jm.checkpoint.save(tmp_path / "c", {"name": "adam"})
    with pytest.raises(TypeError, match=r"\(1, 2\)"):
        jm.checkpoint.save(tmp_path / "c", {(1, 2): 1.0})
    assert not (tmp_path / "c").exists()


# --- never unpickles ---------------------------------------------------------------------------


class _Payload:
    """Creates a marker file when unpickled."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_restore_never_unpickles_or_evaluates(strategy, tmp_path, monkeypatch):
    state = {"w": strategy.mirror(np.ones(3)), "m": strategy.sync_on_read(1, "sum"), "n": 2}
    jm.checkpoint.save(tmp_path / "c", state, strategy=strategy)

    def refuse(*args, **kwargs):
        raise AssertionError("restore unpickled or evaluated something")

    with monkeypatch.context() as patch:
        for module, name in [(pickle, "load"), (pickle, "loads"), (builtins, "eval")]:
            patch.setattr(module, name, refuse)
        patch.setattr(builtins, "exec", refuse)
        patch.setattr(pickle, "Unpickler", refuse)
        out = jm.checkpoint.restore(tmp_path / "c", strategy=strategy)
    assert out["n"] == 2 and int(strategy.read(out["m"])) == strategy.num_replicas


@pytest.mark.parametrize(
    "planted", ["jmirror/metadata", "state/_METADATA", "state/checkpoint", "payload.pkl"]
)
def test_a_planted_pickle_payload_is_never_executed(tmp_path, planted):
    jm.checkpoint.save(tmp_path / "c", {"w": np.ones(3), "v": 1})
    marker = tmp_path / "executed"
    (tmp_path / "c" / planted).write_bytes(pickle.dumps(_Payload(marker)))
    try:
        out = jm.checkpoint.restore(tmp_path / "c")
    except ValueError:
        pass  # damaged metadata is refused
    else:
        np.testing.assert_array_equal(out["w"], np.ones(3))
    assert not marker.exists()


@pytest.mark.parametrize("dtype", ["object", "|O", "V8", "<U4"])
def test_metadata_naming_an_object_dtype_is_refused(tmp_path, dtype):
    jm.checkpoint.save(tmp_path / "c", {"w": np.ones(3)})
    doc = tmp_path / "c" / "jmirror" / "metadata"
    doc.write_text(doc.read_text().replace('"float64"', f'"{dtype}"'))
    listed = tmp_path / "c" / _integrity.FILES  # it would name the changed file: rewrite it
    saved = json.loads(listed.read_text())["arrays"]
    listed.unlink()
    _integrity.write_file_list(tmp_path / "c", saved)
    with pytest.raises(ValueError, match="not one of the array dtypes"):
        jm.checkpoint.restore(tmp_path / "c")


# --- CheckpointManager -------------------------------------------------------------------------


@pytest.mark.parametrize("async_save", [True, False])
def test_manager_keeps_max_to_keep_and_interval(tmp_path, async_save):
    with jm.checkpoint.CheckpointManager(
        tmp_path, max_to_keep=2, save_interval_steps=2, async_save=async_save
    ) as manager:
        saved = [manager.save(step, {"s": np.full(2, step)}, data={"s": step}) for step in range(7)]
        assert saved == [True, False, True, False, True, False, True]
        assert manager.all_steps() == [4, 6] and manager.latest_step() == 6
        assert manager.save(3, {"s": np.full(2, 3)}, force=True)  # force saves a skipped step
        assert manager.all_steps() == [4, 6]  # ... which is the oldest: max_to_keep drops it
        assert manager.data() == {"s": 6} and manager.data(4) == {"s": 4}
        assert manager.restore(4)["s"].tolist() == [4, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["4", "6"]


def test_a_directory_named_by_a_step_that_holds_no_checkpoint_is_not_a_step(tmp_path):
    # The user's own `1/` (notes, a log) beside the checkpoints: latest_step names the newest
    # complete checkpoint, restore() finds it, and max_to_keep leaves the directory alone.
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "notes.txt").write_text("mine")
    (tmp_path / "9").mkdir()
    with jm.checkpoint.CheckpointManager(tmp_path, max_to_keep=1) as manager:
        assert manager.latest_step() is None and manager.all_steps() == []
        for step in (2, 3):
            manager.save(step, {"s": np.full(2, step)})
        assert manager.all_steps() == [3] and manager.restore()["s"].tolist() == [3, 3]
    assert (tmp_path / "1" / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "3", "9"]


@pytest.mark.parametrize("name", ["int4", "int2", "float4_e2m1fn", "float8_e8m0fnu", "float8_e3m4"])
def test_narrow_dtypes_round_trip_bitwise(strategy, n, tmp_path, name):
    dtype = jnp.dtype(getattr(jnp, name))
    if jnp.issubdtype(dtype, jnp.integer):
        x = (np.arange(6) % 2).astype(dtype)
    else:
        x = np.array([1, 2, 4, 0.5, 1, 2], np.float32).astype(dtype)
    state = {"m": strategy.mirror(jnp.asarray(x)), "n": x, "p": jm.PerReplica(np.stack([x] * n))}
    jm.checkpoint.save(tmp_path / "c", state, strategy=strategy)
    out = jm.checkpoint.restore(tmp_path / "c", strategy=strategy)
    for got in (strategy.read(out["m"]), out["n"], *strategy.local_results(out["p"])):
        assert np.asarray(got).dtype == dtype
        assert np.asarray(got).tobytes() == x.tobytes()


def test_a_state_nested_too_deeply_for_json_is_refused_before_writing(tmp_path):
    state = np.ones(2)
    for _ in range(400):  # JAX's pytrees take it; JSON's recursive encoder would fail
        state = {"a": state}
    with pytest.raises(ValueError, match=r"nested too deeply .* nothing was written"):
        jm.checkpoint.save(tmp_path / "c", state)
    assert list(tmp_path.iterdir()) == []


def test_save_with_force_replaces_a_file_at_the_path(tmp_path):
    (tmp_path / "c").write_text("not a checkpoint")
    with pytest.raises(ValueError, match="force=True"):
        jm.checkpoint.save(tmp_path / "c", {"v": np.ones(2)})
    jm.checkpoint.save(tmp_path / "c", {"v": np.ones(2)}, force=True)
    assert jm.checkpoint.restore(tmp_path / "c")["v"].tolist() == [1.0, 1.0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # nothing hidden left


def test_manager_refuses_an_existing_step_unless_force(tmp_path):
    with jm.checkpoint.CheckpointManager(tmp_path) as manager:
        manager.save(1, {"v": np.zeros(2)}, data={"pos": 1})
        with pytest.raises(ValueError, match="step 1 exists"):
            manager.save(1, {"v": np.ones(2)})
        manager.save(1, {"v": np.ones(2)}, data={"pos": 2}, force=True)
        assert manager.restore(1)["v"].tolist() == [1.0, 1.0] and manager.data(1) == {"pos": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1"]


def test_a_second_manager_on_an_open_directory_is_a_value_error_naming_it(tmp_path):
    # Before: the second manager removed the first one's write in progress (a step whose
    # save had returned was lost) and the first failed later with "check the directory".
    first = jm.checkpoint.CheckpointManager(tmp_path / "run")
    first.save(1, {"w": np.ones((256, 1024), np.float32)})  # async: still being written
    (tmp_path / "link").symlink_to(tmp_path / "run")
    for same in (tmp_path / "run", tmp_path / "link", os.path.relpath(tmp_path / "run")):
        with pytest.raises(ValueError) as info:
            jm.checkpoint.CheckpointManager(same)
        message = str(info.value)
        assert str(tmp_path / "run") in message, message
        assert "one CheckpointManager at a time per directory" in message
        assert "close()" in message
    first.close()
    with jm.checkpoint.CheckpointManager(tmp_path / "link") as second:
        assert second.all_steps() == [1]  # nothing lost
    dropped = jm.checkpoint.CheckpointManager(tmp_path / "run")
    del dropped  # never closed: collected, it holds the directory no more
    jm.checkpoint.CheckpointManager(tmp_path / "run").close()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["1"]  # no lock file left


@pytest.mark.once
def test_a_manager_open_in_another_process_is_a_value_error_naming_its_pid(tmp_path):
    code = """
        import sys, jmirror as jm
        manager = jm.checkpoint.CheckpointManager(sys.argv[1])
        print("open", flush=True)
        sys.stdin.readline()
        manager.close()
    """
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    try:
        assert child.stdout.readline() == "open\n"
        with pytest.raises(ValueError, match=rf"another process \(pid {child.pid}\)") as info:
            jm.checkpoint.CheckpointManager(tmp_path)
        assert str(tmp_path) in str(info.value)
        assert "one CheckpointManager at a time per directory" in str(info.value)
        child.communicate("\n", timeout=60)
    finally:
        child.kill()
        child.wait()
    with jm.checkpoint.CheckpointManager(tmp_path) as manager:  # released by close()
        assert manager.all_steps() == []


def test_manager_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="max_to_keep=0"):
        jm.checkpoint.CheckpointManager(tmp_path, max_to_keep=0)
    with pytest.raises(TypeError, match="save_interval_steps"):
        jm.checkpoint.CheckpointManager(tmp_path, save_interval_steps=1.5)
    with jm.checkpoint.CheckpointManager(tmp_path) as manager:
        with pytest.raises(TypeError, match="JSON"):
            manager.save(0, {}, data={"it": object()})
        with pytest.raises(ValueError, match="non-negative"):
            manager.save(-1, {})
    with pytest.raises(RuntimeError, match="close"):
        manager.save(2, {})


def _worker_threads():
    return [t for t in threading.enumerate() if t.name.startswith("jmirror-checkpoint")]


def test_async_save_writes_the_state_as_it_was_at_the_call(backend, tmp_path):
    strategy = jm.MirroredStrategy(backend=backend, donation="always")
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    host = np.arange(3.0)
    state = {"w": strategy.mirror(w), "m": strategy.sync_on_read(np.float32(1.0), "sum")}

    @jm.replicate(strategy=strategy, donate_argnums=0)
    def overwrite(state):
        return jax.tree.map(lambda x: x * 0 - 7, state)

    with jm.checkpoint.CheckpointManager(tmp_path, strategy=strategy) as manager:
        assert manager.save(1, {**state, "host": host})
        new = overwrite(state)  # donated right away: the buffers may be reused
        host[:] = -7
        jax.block_until_ready(new)
        assert state["w"].is_deleted()
        out = manager.restore(1)
    np.testing.assert_array_equal(out["w"], w)
    np.testing.assert_array_equal(out["host"], np.arange(3.0))
    assert float(strategy.read(out["m"])) == strategy.num_replicas
    assert _worker_threads() == []


def test_restored_state_owns_its_buffers_and_can_be_donated(backend, tmp_path):
    strategy = jm.MirroredStrategy(backend=backend, donation="always")
    # 1 MiB leaves: restoring may hand the devices zero-copy host buffers (XLA:CPU).
    w = np.arange(512 * 512, dtype=np.float32).reshape(512, 512)
    state = {"w": strategy.mirror(w), "n": strategy.sync_on_read(np.float32(1.0), "sum")}
    jm.checkpoint.save(tmp_path / "c", state, strategy=strategy)
    out = jm.checkpoint.restore(tmp_path / "c", strategy=strategy)

    @jm.replicate(strategy=strategy, donate_argnums=0)
    def step(state):
        w = state["w"] * 2 + jm.replica_id().astype(jnp.float32)  # differs per replica
        return {"w": jm.all_reduce("max", w), "n": state["n"].replace(state["n"].value * 2)}

    new = step(out)
    assert out["w"].is_deleted()
    for copy in strategy.local_results(new["w"]):
        np.testing.assert_array_equal(copy, w * 2 + strategy.num_replicas - 1)
    assert float(strategy.read(new["n"])) == 2.0 * strategy.num_replicas


def test_a_background_write_error_is_raised_by_the_next_call(tmp_path, monkeypatch):
    from jmirror.checkpoint import _storage

    def fail(*args, **kwargs):
        time.sleep(0.05)
        raise OSError("No space left on device")

    manager = jm.checkpoint.CheckpointManager(tmp_path)
    manager.save(1, {"v": np.zeros(2)})
    with monkeypatch.context() as patch:
        patch.setattr(_storage, "write", fail)
        assert manager.save(2, {"v": np.ones(2)})  # returns before the write fails
        with pytest.raises(OSError, match="No space left") as info:
            manager.latest_step()
        assert any("step 2" in note for note in info.value.__notes__)
        assert manager.all_steps() == [1]  # raised once, then the manager goes on
        manager.save(3, {"v": np.ones(2)})
        with pytest.raises(OSError):
            manager.save(4, {"v": np.ones(2)})
        manager.save(5, {"v": np.ones(2)})
        with pytest.raises(OSError):
            manager.close()
    assert _worker_threads() == []
    with pytest.raises(OSError):
        with jm.checkpoint.CheckpointManager(tmp_path) as again:
            monkeypatch.setattr(_storage, "write", fail)
            again.save(6, {"v": np.ones(2)})
    assert _worker_threads() == []


# --- killed saves ------------------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import sys
    import jax
    jax.config.update("jax_num_cpu_devices", 2)
    import numpy as np
    import jmirror as jm

    strategy = jm.MirroredStrategy()
    def state(value):  # 16 MiB mirrored, plus a sync-on-read total
        return {
            "w": [strategy.mirror(np.full((1024, 1024), value, np.float32)) for _ in range(4)],
            "total": strategy.assign(strategy.sync_on_read(np.float32(0), "sum"), value),
        }
    manager = jm.checkpoint.CheckpointManager(sys.argv[1], max_to_keep=2)
    step = 0
    while True:
        step += 1
        print("saving", step, flush=True)
        manager.save(step, state(step), data={"step": step})
        manager.wait_until_finished()
        print("complete", step, flush=True)
        if step % 2 == 0:
            print("forcing", step, flush=True)
            manager.save(step, state(step + 0.5), data={"step": step}, force=True)
            manager.wait_until_finished()
            print("complete", step, flush=True)
    """
)


@pytest.mark.once
@pytest.mark.parametrize(
    "trigger, delay",
    # A save there takes about 0.1 s: the kills land in the copy, the write, the rename and the
    # deletion of old steps, of a new step and of a forced replacement.
    [(t, d) for t in ("saving 3", "forcing 4") for d in (0.0, 0.04, 0.09)],
)
def test_a_save_killed_at_any_moment_leaves_every_earlier_checkpoint(tmp_path, trigger, delay):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    directory = tmp_path / "series"
    child = subprocess.Popen(
        [sys.executable, str(script), str(directory)], stdout=subprocess.PIPE, text=True
    )
    lines = []
    try:
        for line in child.stdout:  # type: ignore[union-attr]
            lines.append(line.strip())
            if lines[-1] == trigger:
                break
        time.sleep(delay)
    finally:
        child.send_signal(signal.SIGKILL)
        rest, _ = child.communicate(timeout=60)
    lines += rest.split("\n")
    assert trigger in lines, lines
    complete = max(int(line.split()[1]) for line in lines if line.startswith("complete"))
    strategy = jm.MirroredStrategy(num_devices=1)
    with jm.checkpoint.CheckpointManager(directory, strategy=strategy) as manager:
        steps = manager.all_steps()
        assert manager.latest_step() in (complete, complete + 1), (steps, lines)
        assert len(steps) <= 3
        for step in steps:  # every visible checkpoint is whole: one value, never a mix
            out = manager.restore(step)
            values = {float(np.unique(np.asarray(w)).item()) for w in out["w"]}
            assert values <= {step, step + 0.5} and len(values) == 1, (step, values)
            assert float(strategy.read(out["total"])) == values.pop()
            assert manager.data(step) == {"step": step}
        manager.save(complete + 10, {"v": 1})
        assert manager.latest_step() == complete + 10
