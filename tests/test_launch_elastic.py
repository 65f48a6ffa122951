"""`python -m jmirror.launch --min-processes M`: a restart continues on fewer processes.

The command line is checked here in both device passes; the tests that start processes run
once, in the 8-device pass: plain Python programs for the counts of each restart, then 4 x 2
JAX processes training with a `CheckpointManager`, one SIGKILLed, the job finishing on 3,
against an uninterrupted 3-process run from the same checkpoint and an uninterrupted
one-process run from the start.
"""

import os
import re
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent / "multiprocess"))
import harness  # noqa: E402
from training import batches, init_state, make_step  # noqa: E402

import jmirror as jm  # noqa: E402
from jmirror import launch  # noqa: E402

starts_processes = pytest.mark.skipif(
    os.environ.get("JMIRROR_TEST_DEVICES", "8") != "8",
    reason="starts processes: runs once, in the 8-device pass",
)
WORKER = str(Path(__file__).parent / "multiprocess" / "elastic_worker.py")
STARTUP_S = 60
RUN_S = 150  # three JAX starts of 3-4 processes, compiling, on two busy CI cores

kill_leftover_launchers = harness.kill_leftover_launchers  # every launcher, after each test


def _script(tmp_path, name, code):
    path = tmp_path / name
    path.write_text(textwrap.dedent(code))
    return str(path)


# --- the command line (no process started) ---------------------------------------------------


def test_min_processes_defaults_to_processes():
    assert launch._parse(["--processes", "3", "-m", "mod"]).min_processes == 3
    assert launch._parse(["--processes", "3", "--min-processes", "1", "-m", "m"]).min_processes == 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--processes", "2", "--min-processes", "0"], "1 <= M <= P (--processes 2); got 0."),
        (["--processes", "2", "--min-processes", "-1"], "1 <= M <= P (--processes 2); got -1."),
        (["--processes", "2", "--min-processes", "3"], "1 <= M <= P (--processes 2); got 3."),
        (["--processes", "2", "--min-processes", "two"], "invalid int value: 'two'"),
        (["{script}", "--min-processes", "2"], "options must come before the program"),
    ],
)
def test_bad_min_processes_is_a_usage_error(tmp_path, capsys, argv, message):
    script = _script(tmp_path, "train.py", "")
    if "{script}" not in argv:
        argv = [*argv, "{script}"]
    assert launch.main([word.format(script=script) for word in argv]) == 2
    err = capsys.readouterr().err
    assert "usage: python -m jmirror.launch --processes P [--min-processes M]" in err
    assert message in err, err


def test_a_global_batch_that_n_does_not_divide_is_a_value_error_before_the_first_step():
    # What the worker relies on when it resumes on fewer replicas: remainder="error" refuses
    # the first batch (fresh, or resumed from a position taken with another N).
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 host devices: 5 replicas that do not divide 24, 8 that do")

    def source():
        return batches(1, steps=4, per_replica=24)

    eight = jm.MirroredStrategy()
    iterator = iter(eight.distribute_dataset(source, remainder="error"))
    next(iterator)
    position = iterator.position
    iterator.close()
    five = jm.MirroredStrategy(jax.devices()[:5])
    for start in (None, position):
        with five.distribute_dataset(source, remainder="error", start=start) as data:
            with pytest.raises(ValueError, match=r"has 24 examples, fewer than the global batch"):
                next(iter(data))


# --- restarts on fewer processes: plain Python ------------------------------------------------

LOSES_ONE = """
    import os, sys, time
    restart, index = os.environ["JMIRROR_RESTART"], os.environ["JMIRROR_PROCESS_ID"]
    count = os.environ["JMIRROR_NUM_PROCESSES"]
    counts = os.environ["JMIRROR_PROCESS_COUNTS"]
    print("start", index, "of", count, "restart", restart, "counts", counts, flush=True)
    open(f"started-{restart}-{index}", "w").close()
    if int(restart) < 3 and index == str(int(count) - 1):  # the last process is lost
        deadline = time.monotonic() + 30  # once every process has started (and printed)
        while time.monotonic() < deadline and not all(
            os.path.exists(f"started-{restart}-{i}") for i in range(int(count))
        ):
            time.sleep(0.01)
        sys.exit(3)
    if int(restart) < 3:
        time.sleep(30)  # until the launcher stops it (SIGTERM): stopped, not lost
    print("finished", index, "of", count, flush=True)
"""


@starts_processes
def test_each_restart_has_one_process_fewer_per_lost_one_down_to_the_minimum(tmp_path):
    script = _script(tmp_path, "loses.py", LOSES_ONE)
    args = ("--processes", "4", "--min-processes", "2", "--max-restarts", "3", script)
    run = harness.launch(args, tmp_path, cwd=tmp_path)
    code, _ = run.wait(STARTUP_S)
    out, err = run.out.read_text(), run.err.read_text()
    assert code == 0, run.output()
    restarts = re.findall(r"jmirror\.launch: restarting (.*)", err)
    assert restarts == [
        "on 3 of 4 processes (lost: process 3; --min-processes 2) "
        "(restart 1 of 3, JMIRROR_RESTART=1), JMIRROR_NUM_PROCESSES=3",
        "on 2 of 3 processes (lost: process 2; --min-processes 2) "
        "(restart 2 of 3, JMIRROR_RESTART=2), JMIRROR_NUM_PROCESSES=2",
        "on 2 of 2 processes (lost: process 1; --min-processes 2) "
        "(restart 3 of 3, JMIRROR_RESTART=3), JMIRROR_NUM_PROCESSES=2",
    ], err
    for restart, count in enumerate((4, 3, 2, 2)):
        line = rf"^\[(\d)\] start \1 of {count} restart {restart} counts 2:4$"
        started = set(re.findall(line, out, re.M))
        assert started == {str(i) for i in range(count)}, out
    finished = re.findall(r"^\[(\d)\] finished \1 of (\d)$", out, re.M)
    assert sorted(finished) == [("0", "2"), ("1", "2")], out  # the last start only


# --- restarts on fewer processes: training ----------------------------------------------------


def _finals(out_dir, count):
    return [np.load(out_dir / f"final{i}.npy") for i in range(count)]


def _one_process_from_scratch():
    """The worker's 6 steps on this process's 8 devices, uninterrupted: the global batch of
    24 examples makes N's choice immaterial, so this checks the input position too."""
    strategy = jm.MirroredStrategy()
    step_fn = jm.replicate(make_step(), strategy=strategy)
    params, opt_state = strategy.mirror(init_state())
    count = strategy.sync_on_read(np.int32(0), "sum")
    source = batches(1, steps=6, per_replica=24, seed=5)  # elastic_worker.py's
    for batch in strategy.distribute_dataset(list(source), remainder="error"):
        params, opt_state, _, count = step_fn(params, opt_state, batch, count)
    leaves = jax.tree.leaves(strategy.read((params, opt_state)))
    return np.concatenate([np.ravel(np.asarray(x)) for x in leaves])


@starts_processes
def test_training_continues_on_three_processes_as_an_uninterrupted_run_would(tmp_path):
    checkpoints, copy = tmp_path / "checkpoints", tmp_path / "resumed_from"
    elastic, oracle = tmp_path / "elastic", tmp_path / "oracle"
    elastic.mkdir(), oracle.mkdir()
    args = ["--processes", "4", "--min-processes", "3", "--max-restarts", "1"]
    args += ["--devices-per-process", "2", WORKER, str(checkpoints), str(elastic)]
    args += ["--kill-at", "3", "--copy-on-restart", str(copy)]
    run = harness.launch(args, tmp_path, "elastic")
    code, elastic_s = run.wait(RUN_S)
    out, err = run.out.read_text(), run.err.read_text()
    assert code == 0, run.output()
    assert "jmirror.launch: process 3 was killed by SIGKILL (exit code 137)" in err, err
    assert (
        "jmirror.launch: restarting on 3 of 4 processes (lost: process 3; --min-processes 3) "
        "(restart 1 of 1, JMIRROR_RESTART=1), JMIRROR_NUM_PROCESSES=3"
    ) in err, err
    assert "[3] process 3 kills itself after step 3" in out
    for i in range(3):  # resumed after the step the killed process saw saved
        assert f"[{i}] start 4 restart 1 processes 3 replicas 6" in out, out
        assert f"[{i}] done" in out
    assert "[3] done" not in out

    # The oracle: 3 processes from the same checkpoint, never interrupted.
    args = ["--processes", "3", "--devices-per-process", "2", WORKER, str(copy), str(oracle)]
    run = harness.launch(args, tmp_path, "oracle")
    code, oracle_s = run.wait(RUN_S)
    assert code == 0, run.output()
    assert "[0] start 4 restart 0 processes 3 replicas 6" in run.out.read_text(), run.output()
    print(f"elastic run {elastic_s:.1f} s, oracle run {oracle_s:.1f} s")
    want = _finals(oracle, 3)[0]
    for got in _finals(elastic, 3):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    # And the whole run, from scratch on one process: the data position carried over.
    np.testing.assert_allclose(want, _one_process_from_scratch(), rtol=1e-5, atol=1e-6)
