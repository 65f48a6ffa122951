"""jm.checkpoint with several processes: 2 processes x 4 host devices through the launcher
(tests/multiprocess/checkpoint_worker.py) against this process's 1 x 8, both ways.

These tests start processes, so they run once, in the 8-device pass of the suite.
"""

import ast
import os
import pathlib
import re
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmirror as jm

HERE = pathlib.Path(__file__).parent / "multiprocess"
sys.path.insert(0, str(HERE))
import harness  # noqa: E402
from training import batches, init_state, make_step  # noqa: E402

kill_leftover_launchers = harness.kill_leftover_launchers
pytestmark = pytest.mark.skipif(
    os.environ.get("JMIRROR_TEST_DEVICES", "8") != "8" or len(jax.devices()) != 8,
    reason="starts processes: runs once, in the 8-device pass",
)
BIG = (256, 1024)


def launch(*args, timeout=150):
    """Runs checkpoint_worker.py as 2 processes x 4 devices; its npz of each process."""
    out = pathlib.Path(args[-1])
    return harness.two_by_four(HERE / "checkpoint_worker.py", *args, out=out, timeout=timeout)


def flat(strategy, tree):
    leaves = jax.tree.leaves(strategy.read(tree))
    return np.concatenate([np.ravel(np.asarray(x)) for x in leaves])


def components(strategy, node, as_array=np.asarray):
    return np.stack([as_array(c) for c in strategy.local_results(node)])


def disk_bytes(path):
    return sum(f.stat().st_size for f in pathlib.Path(path).rglob("*") if f.is_file())


@pytest.fixture(scope="module")
def strategy():
    return jm.MirroredStrategy()


@pytest.fixture(scope="module")
def trained(strategy):
    """The training of the worker on 1 x 8: the state after each of the 6 steps."""
    step_fn = jm.replicate(make_step(), strategy=strategy)
    params, opt_state = strategy.mirror(init_state())
    count = strategy.sync_on_read(np.int32(0), "sum")
    fixed = {
        "big": strategy.mirror(np.random.default_rng(0).standard_normal(BIG).astype(np.float32)),
        "ids": strategy.run(lambda: jnp.float32(jm.replica_id())),
        "keys": strategy.split_key(jax.random.key(1)),
    }
    states = {}
    for step, batch in enumerate(
        strategy.distribute_dataset(list(batches(8)), remainder="drop"), 1
    ):
        params, opt_state, _, count = step_fn(params, opt_state, batch, count)
        states[step] = {"params": params, "opt_state": opt_state, "count": count, **fixed}
    return states


@pytest.fixture(scope="module")
def saved_by_two(tmp_path_factory):
    """The checkpoints written by 2 processes x 4 devices, and what each process saw."""
    out = tmp_path_factory.mktemp("saved_by_two")
    return out, launch("save", out)


# --- written by 2 x 4 --------------------------------------------------------------------------


def test_every_process_sees_the_same_steps_and_restores_what_it_saved(saved_by_two):
    _, seen = saved_by_two
    for i, process in enumerate(seen):
        assert process["async/all_steps"].tolist() == [5, 6]  # max_to_keep=2
        assert process["sync/all_steps"].tolist() == [3, 6]
        # Each process reads its own data back; step 6 was replaced (force=True).
        assert ast.literal_eval(str(process["async/data"])) == {"process": i, "forced": True}
        for prefix in ("async", "plain"):  # the newest state, restored on the same layout
            for key in ("params", "opt_state", "big", "count", "ids", "keys", "mine"):
                np.testing.assert_array_equal(process[f"{prefix}/{key}"], process[f"trained/{key}"])
    for key in ("params", "opt_state", "big", "count"):  # mirrored / aggregated: the same
        np.testing.assert_array_equal(seen[0][f"async/{key}"], seen[1][f"async/{key}"])
    np.testing.assert_array_equal(seen[0]["async/ids"], [0, 1, 2, 3])
    np.testing.assert_array_equal(seen[1]["async/ids"], [4, 5, 6, 7])


@pytest.mark.parametrize(
    "saved, step", [("async/6", 6), ("sync/3", 3), ("sync/6", 6), ("plain", 6)]
)
def test_a_checkpoint_of_two_processes_restores_on_one_process(
    saved_by_two, trained, strategy, saved, step
):
    out, _ = saved_by_two
    state = jm.checkpoint.restore(out / saved, strategy=strategy)
    oracle = trained[step]
    for key in ("params", "opt_state"):
        np.testing.assert_allclose(
            flat(strategy, state[key]), flat(strategy, oracle[key]), rtol=2e-5, atol=2e-6
        )
    assert int(strategy.read(state["count"])) == step * 8 * 4  # every example counted once
    np.testing.assert_array_equal(strategy.read(state["big"]), strategy.read(oracle["big"]))
    np.testing.assert_array_equal(components(strategy, state["ids"]), np.arange(8))
    np.testing.assert_array_equal(
        components(strategy, state["keys"], jax.random.key_data),
        components(strategy, oracle["keys"], jax.random.key_data),
    )
    # A PerReplica each process built of its own 4 components holds all 8.
    np.testing.assert_array_equal(components(strategy, state["mine"])[:, 0], [0] * 4 + [1] * 4)


def test_two_processes_write_one_copy(saved_by_two, trained, strategy):
    out, _ = saved_by_two
    mirrored = {k: trained[6][k] for k in ("params", "opt_state", "big")}
    one_copy = sum(np.asarray(x).nbytes for x in jax.tree.leaves(strategy.read(mirrored)))
    for saved in ("async/6", "sync/6", "plain"):
        assert disk_bytes(out / saved) <= 1.1 * one_copy + 64 * 1024, saved
        written_by = {p.name for p in (out / saved).rglob("ocdbt.process_*")}
        assert written_by == {"ocdbt.process_0"}, saved  # one process wrote


def test_per_process_data_reads_on_one_process_only_when_equal(saved_by_two, strategy):
    out, _ = saved_by_two
    with jm.checkpoint.CheckpointManager(out / "sync", strategy=strategy) as manager:
        assert manager.data(3)["batches"] == 3  # the input position, the same on both
    with jm.checkpoint.CheckpointManager(out / "async", strategy=strategy) as manager:
        with pytest.raises(ValueError, match="saved by 2 processes, each with its own data"):
            manager.data(5)


def test_a_failed_write_raises_on_every_process(saved_by_two):
    _, seen = saved_by_two
    writer, other = (str(process["failed_save"]) for process in seen)
    assert writer.startswith(("NotADirectoryError", "FileExistsError")), writer
    assert other.startswith("RuntimeError") and "process 0" in other and "did not" in other


# --- written by 1 x 8, restored by 2 x 4 -------------------------------------------------------


def test_a_checkpoint_of_one_process_restores_on_two(tmp_path, trained, strategy):
    state = trained[6]
    with jm.checkpoint.CheckpointManager(tmp_path / "ckpt", strategy=strategy) as manager:
        manager.save(6, state, data={"batches": 6})
    seen = launch("restore", tmp_path / "ckpt", tmp_path)
    for i, process in enumerate(seen):
        assert process["all_steps"].tolist() == [6]
        assert ast.literal_eval(str(process["data"])) == {"batches": 6}
        for key in ("params", "opt_state"):
            np.testing.assert_array_equal(process[f"restored/{key}"], flat(strategy, state[key]))
        np.testing.assert_array_equal(process["restored/big"], strategy.read(state["big"]))
        assert int(process["restored/count"]) == 6 * 8 * 4
        np.testing.assert_array_equal(process["restored/count_components"], [24] * 4)
        mine = slice(4 * i, 4 * i + 4)
        np.testing.assert_array_equal(process["restored/ids"], np.arange(8)[mine])
        keys = components(strategy, state["keys"], jax.random.key_data)
        np.testing.assert_array_equal(process["restored/keys"], keys[mine])


# --- replicas spanning 2 devices on 2 x 4, restored on 1 x 8 at k = 1 ---------------------------


@pytest.fixture(scope="module")
def spanning_by_two(tmp_path_factory):
    """The worker of replicas spanning 2 devices on 2 x 4: its directory, what each saw."""
    out = tmp_path_factory.mktemp("spanning_by_two")
    worker = HERE / "spanning_checkpoint_worker.py"
    return out, harness.two_by_four(worker, out, out=out, timeout=200)


def test_replicas_spanning_two_devices_save_on_two_processes_and_restore_on_one(
    spanning_by_two, strategy
):
    import optax

    tmp_path, seen = spanning_by_two
    keys = ("params", "opt_state", "sharded", "count")
    for process in seen:  # laid out over the model axis; restored on the same layout as held
        assert str(process["trained/kernel_spec"]) == "P(None, 'model')"
        assert process["trained/kernel_shard"].tolist() == [16, 16]
        # strategy.read and local_results give whole values (was half a kernel at k = 2)
        np.testing.assert_array_equal(process["trained/read"], process["trained/params"])
        for key in (*keys, "kernel_spec", "kernel_shard"):
            np.testing.assert_array_equal(process[f"again/{key}"], process[f"trained/{key}"])
    for key in keys:
        np.testing.assert_array_equal(seen[0][f"trained/{key}"], seen[1][f"trained/{key}"])
    held = seen[0]
    tx = jm.shard_update(optax.adam(1e-2), strategy=strategy)
    params, opt_state = strategy.mirror(init_state())
    target = {
        "params": params,
        "opt_state": opt_state,
        "count": strategy.sync_on_read(np.int32(0), "sum"),
        "sharded": tx.init(params),
    }
    with jm.checkpoint.CheckpointManager(tmp_path / "series", strategy=strategy) as manager:
        restored = [jm.checkpoint.restore(tmp_path / "plain", target), manager.restore(3, target)]
    for state in restored:  # bitwise what the processes held, on 8 replicas of one device
        for key in ("params", "opt_state", "sharded"):
            np.testing.assert_array_equal(flat(strategy, state[key]), held[f"trained/{key}"])
        assert int(strategy.read(state["count"])) == 3 * 16
        assert state["params"]["params"]["Dense_0"]["kernel"].sharding.is_fully_replicated
    # Oracle: the same global batches trained on 1 x 8 at k = 1.
    step_fn = jm.replicate(make_step(), strategy=strategy)
    count = strategy.sync_on_read(np.int32(0), "sum")
    for batch in strategy.distribute_dataset(list(batches(4, steps=3)), remainder="drop"):
        params, opt_state, _, count = step_fn(params, opt_state, batch, count)
    np.testing.assert_allclose(flat(strategy, params), held["trained/params"], rtol=2e-5, atol=2e-6)


def test_per_replica_values_laid_out_inside_replicas_are_whole_on_two_processes(
    spanning_by_two, strategy
):
    # local_results gave one device's half of each replica's (16, 32) kernel gradient.
    from training import loss_fn

    tmp_path, seen = spanning_by_two
    # Oracle: the gradients of the trained parameters on each replica's rows of the last batch
    # (4 replicas), on one device; the parameters as the 1 x 8 run trains them.
    step_fn = jm.replicate(make_step(), strategy=strategy)
    params, opt_state = strategy.mirror(init_state())
    count = strategy.sync_on_read(np.int32(0), "sum")
    data = list(batches(4, steps=3))
    for batch in strategy.distribute_dataset(data, remainder="drop"):
        params, opt_state, _, count = step_fn(params, opt_state, batch, count)
    host = jax.tree.map(np.asarray, strategy.read(params))
    x, y = data[-1]
    grad = jax.jit(lambda x, y: jax.grad(loss_fn)(host, x, y)["params"]["Dense_0"]["kernel"])
    expected = np.stack(
        [np.asarray(grad(x[4 * r : 4 * r + 4], y[4 * r : 4 * r + 4])) for r in range(4)]
    )
    close = {"rtol": 1e-4, "atol": 1e-6}
    for process in seen:
        assert str(process["grads/spec"]) == "P('replica', None, 'model')"
        mine = process["grads/replicas"].tolist()
        np.testing.assert_allclose(process["grads/local"], expected[mine], **close)
        np.testing.assert_array_equal(process["grads/restored"], process["grads/local"])
        np.testing.assert_allclose(process["grads/gather"], np.concatenate(expected), **close)
        np.testing.assert_allclose(process["grads/reduce"], expected.sum(0), **close)
        np.testing.assert_allclose(process["grads/first"], 1.0 + expected[0], **close)
        np.testing.assert_array_equal(process["grads/restored_first"], process["grads/first"])
    assert seen[0]["grads/replicas"].tolist() == [0, 1]
    assert seen[1]["grads/replicas"].tolist() == [2, 3]
    # The checkpoint the two processes wrote restores here, on 4 replicas of one device.
    four = jm.MirroredStrategy(jax.devices()[:4])
    back = jm.checkpoint.restore(tmp_path / "grads", strategy=four)
    got = np.stack([np.asarray(c) for c in four.local_results(back["grads"])])
    np.testing.assert_allclose(got, expected, **close)
    np.testing.assert_allclose(np.asarray(four.read(back["first"])), 1.0 + expected[0], **close)


# --- a save that one process skips -------------------------------------------------------------

SKIP_TIMEOUT_S = 10
_SKIPPED_SAVE = """
import os, sys
import jax.numpy as jnp, numpy as np
import jmirror as jm

mode, directory = sys.argv[1], sys.argv[2]
jm.distributed.initialize(timeout_s={timeout})
me = int(os.environ["JMIRROR_PROCESS_ID"])
strategy = jm.MultiWorkerMirroredStrategy(timeout_s={timeout})
state = {{
    "w": strategy.mirror(np.ones((8, 1), np.float32)),
    "ids": strategy.run(lambda: jnp.float32(jm.replica_id())),  # a PerReplica of all 8
}}
for k in range(2):  # both save: gloo's communicators are connected, as in a real run
    jm.checkpoint.save(f"{{directory}}/both{{k}}", state, strategy=strategy)
print(f"process {{me}} saved twice", flush=True)
if me == 0:
    print("process 0 saves alone", flush=True)
    if mode == "save":
        jm.checkpoint.save(f"{{directory}}/alone", state, strategy=strategy)
    else:
        manager = jm.checkpoint.CheckpointManager(f"{{directory}}/series", strategy=strategy)
        manager.save(1, state)
        manager.wait_until_finished()
    print("process 0 saved alone", flush=True)
print(f"process {{me}} exits", flush=True)
"""


@pytest.mark.parametrize("mode", ["save", "manager"])
def test_a_save_that_the_other_process_skips_to_exit_ends_the_run_naming_the_save(tmp_path, mode):
    # Process 1 exits (into JAX's exit, which waits for process 0) while process 0 saves a
    # state with per-replica components: before the gather was bounded, process 0 waited in
    # gloo's all-gather without end (still running 120 s later, with no message).
    script = tmp_path / "skipped_save.py"
    script.write_text(textwrap.dedent(_SKIPPED_SAVE.format(timeout=SKIP_TIMEOUT_S)))
    command = ["--processes", "2", "--devices-per-process", "4", str(script), mode, tmp_path]
    run = harness.launch([str(c) for c in command], tmp_path, f"skipped-{mode}")
    run.wait_for(r"process 0 saves alone", 120)
    start = time.monotonic()
    code, _ = run.wait(SKIP_TIMEOUT_S + 60)
    elapsed = time.monotonic() - start
    out = run.output()
    assert code != 0 and "process 0 saved alone" not in out, out
    assert elapsed < SKIP_TIMEOUT_S + 40, (elapsed, out)
    # The save meets the other process before its first collective (reading the state).
    call = (
        rf"jm\.checkpoint\.save's barrier before writing {re.escape(str(tmp_path))}/alone"
        if mode == "save"
        else r"CheckpointManager\.save's gathering of every process's data"
    )
    assert re.search(
        rf"\[0\] jmirror: timed out: {call} has not completed {SKIP_TIMEOUT_S} s", out
    ), out
    assert re.search(rf"\[0\] jmirror: processes that did not arrive at {call}: 1\.", out), out
    assert "jmirror.launch: process 0 exited with code 1" in out


_SKIPPED_MIRRORED_SAVE = """
import os, sys
import numpy as np
import jmirror as jm

mode, directory = sys.argv[1], sys.argv[2]
jm.distributed.initialize(timeout_s={timeout})
me = int(os.environ["JMIRROR_PROCESS_ID"])
strategy = jm.MultiWorkerMirroredStrategy(timeout_s={timeout})
state = {{"w": strategy.mirror(np.ones((8, 1), np.float32)), "step": 3}}  # nothing per replica
if me == 0:  # without strategy=: the default strategy, bounded as initialize was asked
    print("process 0 saves alone", flush=True)
    if mode == "save":
        jm.checkpoint.save(f"{{directory}}/alone", state)
    else:
        manager = jm.checkpoint.CheckpointManager(f"{{directory}}/series")
        manager.save(1, state)
        manager.wait_until_finished()
    print("process 0 saved alone", flush=True)
print(f"process {{me}} exits", flush=True)
"""


@pytest.mark.parametrize("mode", ["save", "manager"])
def test_a_skipped_save_of_mirrored_state_without_strategy_ends_the_run_naming_it(tmp_path, mode):
    # A save given no strategy= took the default strategy, whose timeout_s was 300 whatever
    # initialize was given: process 0 still waited 120 s later at the checkpoint's first
    # barrier (a mirrored-only state gathers nothing before it), with no message.
    script = tmp_path / "skipped_mirrored_save.py"
    script.write_text(textwrap.dedent(_SKIPPED_MIRRORED_SAVE.format(timeout=SKIP_TIMEOUT_S)))
    command = ["--processes", "2", "--devices-per-process", "4", str(script), mode, tmp_path]
    run = harness.launch([str(c) for c in command], tmp_path, f"skipped-mirrored-{mode}")
    run.wait_for(r"process 0 saves alone", 120)
    start = time.monotonic()
    code, _ = run.wait(SKIP_TIMEOUT_S + 60)
    elapsed = time.monotonic() - start
    out = run.output()
    assert code != 0 and "process 0 saved alone" not in out, out
    assert elapsed < SKIP_TIMEOUT_S + 40, (elapsed, out)
    call = (
        rf"jm\.checkpoint\.save's barrier before writing {re.escape(str(tmp_path))}/alone"
        if mode == "save"
        else r"CheckpointManager\.save's gathering of every process's data"
    )
    assert re.search(
        rf"\[0\] jmirror: timed out: {call} has not completed {SKIP_TIMEOUT_S} s", out
    ), out
    assert re.search(rf"\[0\] jmirror: processes that did not arrive at {call}: 1\.", out), out
    assert "jmirror.launch: process 0 exited with code 1" in out


def test_a_manager_save_skipped_while_iterating_input_ends_the_run_naming_the_save(tmp_path):
    # Process 1 skips the save of step 4 (mirrored state, the input position as data) and goes
    # on to its input's next batch. The saver's gathering of the data used to be a device
    # collective, which gloo paired with the skipper's input agreement: process 0 aborted
    # ("Received data size doesn't match"), nothing named the save, and process 1 ended its
    # pass early with a warning about uneven input.
    command = ["--processes", "2", "--devices-per-process", "2"]
    command += [str(HERE / "skipped_save_worker.py"), str(SKIP_TIMEOUT_S), str(tmp_path / "ck")]
    run = harness.launch(command, tmp_path, "skipped-manager-save-input")
    run.wait_for(r"process 1 skips the save of step 4", 120)
    start = time.monotonic()
    code, _ = run.wait(SKIP_TIMEOUT_S + 60)
    elapsed = time.monotonic() - start
    out = run.output()
    # Both processes time out within moments of each other (process 0 in the save, process
    # 1 in the input agreement); whichever ends first, the launcher stops the other, and the
    # first to end names the save: its own wait, or where the other process waits.
    assert code == 1 and re.search(r"jmirror\.launch: process [01] exited with code 1", out), out
    assert elapsed < SKIP_TIMEOUT_S + 25, (elapsed, out)
    call = r"CheckpointManager\.save's gathering of every process's data"
    named_by_0 = re.search(
        rf"\[0\] jmirror: timed out: {call} has not completed {SKIP_TIMEOUT_S} s", out
    ) and re.search(rf"\[0\] jmirror: processes that did not arrive at {call}: 1\.", out)
    named_by_1 = re.search(rf"\[1\] jmirror:   process 0: waiting in {call}", out)
    assert named_by_0 or named_by_1, out
    if named_by_0:
        assert "[0] jmirror:   process 1: waiting in the input agreement" in out, out
    for wrong in ("EnforceNotMet", "doesn't match", "still had more", "finished its input"):
        assert wrong not in out, out
    assert "process 0 saved step 2" in out and "process 0 saved step 4" not in out, out
    assert "[0] process 0 keys left after step 2: []" in out, out


# --- a pending async save at exit, on every process ---------------------------------------------

_EXIT_PENDING = """
import os, sys, time
import jax.numpy as jnp, numpy as np
import jmirror as jm
from jmirror.checkpoint import _storage

jm.distributed.initialize()
directory = sys.argv[1]
write = _storage.write


def slow_write(*args, **kwargs):  # the writer's (process 0's) write: surely pending at exit
    time.sleep(1)
    return write(*args, **kwargs)


_storage.write = slow_write
strategy = jm.MultiWorkerMirroredStrategy()
me = strategy.process_index
state = {
    "big": strategy.mirror(np.arange(BIG[0] * BIG[1], dtype=np.float32).reshape(BIG)),
    "ids": strategy.run(lambda: jnp.float32(jm.replica_id())),  # a PerReplica of all 8
    "mine": jm.PerReplica(np.full((strategy.num_local_replicas, 2), me, np.float32)),
}
manager = jm.checkpoint.CheckpointManager(directory, async_save=True)
manager.save(1, {"n": np.int32(1)})
manager.save(2, state, data={"process": me})  # waits for step 1, then goes to the background
pending = manager._background._worker
print(f"process {me} exits; step 2 pending: {pending is not None and not pending.done.is_set()}")
if me == 1:
    sys.exit(0)  # process 0 ends by falling off the end
"""


def test_a_pending_async_save_is_completed_at_exit_on_every_process(tmp_path, strategy):
    # Neither process calls close(): process 0 falls off the end, process 1 calls sys.exit(0).
    script = tmp_path / "exit_pending.py"
    script.write_text(f"BIG = {(2 * BIG[0], BIG[1])}\n" + textwrap.dedent(_EXIT_PENDING))
    command = ["--processes", "2", "--devices-per-process", "4", str(script), tmp_path / "ckpt"]
    run = harness.launch([str(c) for c in command], tmp_path, "exit-pending")
    code, _ = run.wait(150)
    out = run.output()
    assert code == 0, out
    for i in (0, 1):  # process 1 waits for process 0's write: pending on both
        assert f"[{i}] process {i} exits; step 2 pending: True" in out, out
    with jm.checkpoint.CheckpointManager(tmp_path / "ckpt", strategy=strategy) as manager:
        assert manager.all_steps() == [1, 2]
        with pytest.raises(ValueError, match="saved by 2 processes, each with its own data"):
            manager.data(2)  # each process's data was written
        state = manager.restore(2)
    big = np.arange(2 * BIG[0] * BIG[1], dtype=np.float32).reshape(2 * BIG[0], BIG[1])
    np.testing.assert_array_equal(strategy.read(state["big"]), big)
    np.testing.assert_array_equal(components(strategy, state["ids"]), np.arange(8))
    np.testing.assert_array_equal(components(strategy, state["mine"])[:, 0], [0] * 4 + [1] * 4)
