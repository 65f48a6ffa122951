"""Preemption: `CheckpointManager.reached_preemption`.

In this process (both device passes): the SIGTERM handler of one process without
`jax.distributed` (installed in the main thread only, chaining the previous handler, put back
by `close()`), the step it agrees on, and the save at that step. Then, in the 8-device pass
only, 2 processes x 4 host devices under `python -m jmirror.launch` (the training of
`tests/multiprocess/preemption_worker.py`): SIGTERM to one worker, SIGTERM to the launcher,
SIGTERM then SIGKILL after the grace period, and `--max-restarts` after a SIGKILL; every
resumed run ends bitwise equal to the uninterrupted run.
"""

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent / "multiprocess"))
import harness  # noqa: E402

import jmirror as jm  # noqa: E402
from jmirror.checkpoint import _preemption  # noqa: E402

starts_processes = pytest.mark.skipif(
    os.environ.get("JMIRROR_TEST_DEVICES", "8") != "8",
    reason="starts processes: runs once, in the 8-device pass",
)
STARTUP_S = 90  # two JAX processes, compiling, on two busy CI cores
RUN_S = 180
WORKER = str(Path(__file__).parent / "multiprocess" / "preemption_worker.py")


@pytest.fixture
def no_notice(monkeypatch):
    """A process that has seen no preemption notice; its SIGTERM handler put back after."""
    for name, value in (
        ("received", False),
        ("step", None),
        ("primed", False),
        ("before_any_step", False),
    ):
        monkeypatch.setattr(_preemption._NOTICE, name, value, raising=False)
    monkeypatch.setattr(_preemption, "_OPEN", weakref.WeakSet())  # managers other tests left
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


def _sigterm_to_myself():
    # Never send it unless a manager's handler is there to catch it (else pytest would die).
    assert isinstance(signal.getsignal(signal.SIGTERM), _preemption._Handler)
    os.kill(os.getpid(), signal.SIGTERM)  # Python runs the handler before the next line


def test_sigterm_is_noticed_at_the_next_step_chained_and_the_handler_restored(no_notice, tmp_path):
    calls = []

    def mine(number, frame):
        calls.append(number)

    signal.signal(signal.SIGTERM, mine)
    manager = jm.checkpoint.CheckpointManager(tmp_path)
    assert [manager.reached_preemption(step) for step in (1, 2)] == [False, False]
    _sigterm_to_myself()
    assert calls == [signal.SIGTERM]  # the previous handler still ran
    assert [manager.reached_preemption(step) for step in (3, 4, 5)] == [True, True, True]
    manager.close()
    assert signal.getsignal(signal.SIGTERM) is mine


def test_the_preemption_step_saves_whatever_the_interval_says(no_notice, tmp_path):
    with jm.checkpoint.CheckpointManager(tmp_path, save_interval_steps=10) as manager:
        assert manager.save(10, {"step": 10})
        assert not manager.save(13, {"step": 13})  # skipped by the interval
        _sigterm_to_myself()
        assert manager.reached_preemption(13)
        assert manager.save(13, {"step": 13})  # the preemption step is saved anyway
        assert not manager.save(14, {"step": 14})  # only that step
        assert manager.all_steps() == [10, 13]
        assert manager.restore(13) == {"step": 13}


def test_a_preemption_step_already_saved_is_not_an_error(no_notice, tmp_path):
    # The loop saves every step, then checks: the documented save at that step finds it saved.
    with jm.checkpoint.CheckpointManager(tmp_path) as manager:
        assert manager.save(7, {"step": 7})
        _sigterm_to_myself()
        assert manager.reached_preemption(7)
        assert manager.save(7, {"step": 7})
        assert manager.all_steps() == [7]
        with pytest.raises(ValueError, match="step 6 exists"):  # other steps: as before
            manager.save(6, {"step": 6})
            manager.save(6, {"step": 6})


def test_save_and_exit_if_preempted_saves_closes_and_exits_0(no_notice, tmp_path):
    manager = jm.checkpoint.CheckpointManager(tmp_path, save_interval_steps=100)
    state = {"w": np.arange(3.0)}
    assert manager.save_and_exit_if_preempted(1, state, data={"batches": 1}) is False
    _sigterm_to_myself()
    with pytest.raises(SystemExit) as exit:
        manager.save_and_exit_if_preempted(2, state, data={"batches": 2})
    assert exit.value.code == 0
    with pytest.raises(RuntimeError, match="after close"):
        manager.save(3, state)
    with jm.checkpoint.CheckpointManager(tmp_path) as reopened:
        assert reopened.all_steps() == [2] and reopened.data() == {"batches": 2}
        np.testing.assert_array_equal(reopened.restore()["w"], state["w"])


def test_outside_the_main_thread_nothing_is_installed(no_notice, tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    made = []
    thread = threading.Thread(target=lambda: made.append(jm.checkpoint.CheckpointManager(tmp_path)))
    thread.start()
    thread.join(60)
    assert made and signal.getsignal(signal.SIGTERM) is before
    assert not made[0].reached_preemption(1)
    made[0].close()


def test_two_managers_chain_and_close_in_any_order(no_notice, tmp_path):
    calls = []
    signal.signal(signal.SIGTERM, lambda number, frame: calls.append(number))
    original = signal.getsignal(signal.SIGTERM)
    first = jm.checkpoint.CheckpointManager(tmp_path / "a")
    second = jm.checkpoint.CheckpointManager(tmp_path / "b")
    _sigterm_to_myself()
    assert calls == [signal.SIGTERM]  # through both handlers, once
    assert first.reached_preemption(4) and second.reached_preemption(4)  # one notice
    first.close()  # not on top: it stays, passing the signal on
    assert signal.getsignal(signal.SIGTERM) is not original
    _sigterm_to_myself()
    assert calls == [signal.SIGTERM] * 2
    second.close()
    signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)  # what is left passes it on
    assert calls == [signal.SIGTERM] * 3


@pytest.mark.parametrize(
    "step, error", [(True, TypeError), ("3", TypeError), (-1, ValueError), (2**31, ValueError)]
)
def test_bad_steps(no_notice, tmp_path, step, error):
    with jm.checkpoint.CheckpointManager(tmp_path) as manager:
        with pytest.raises(error, match="CheckpointManager.reached_preemption"):
            manager.reached_preemption(step)


@pytest.fixture(params=[5])
def under_jax_distributed(no_notice, monkeypatch, request):
    """As under `jax.distributed`: JAX's notifier holds SIGTERM, its sync point answers."""
    asked = []

    def sync_point(step):  # JAX's agreed step: request.param
        asked.append(step)
        return step == request.param

    monkeypatch.setattr(_preemption, "_jax_runs_the_notice", lambda: True)
    monkeypatch.setattr(_preemption.multihost_utils, "reached_preemption_sync_point", sync_point)
    return asked


def test_under_jax_distributed_jax_agrees_and_nothing_is_installed(under_jax_distributed, tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    with jm.checkpoint.CheckpointManager(tmp_path, save_interval_steps=100) as manager:
        assert signal.getsignal(signal.SIGTERM) is before  # JAX's handler stays in charge
        answers = [manager.reached_preemption(step) for step in range(1, 9)]
        assert answers == [False] * 4 + [True] * 4  # from the agreed step on
        # Opening: "agreed before any step?" (1), JAX's counter primed with latest_step() (0);
        # then every step to the agreed one.
        assert under_jax_distributed == [1, 0, 1, 2, 3, 4, 5]
        assert manager.save(5, {"step": 5}) and not manager.save(6, {"step": 6})
        assert manager.all_steps() == [5]


@pytest.mark.parametrize("under_jax_distributed", [1], indirect=True)
def test_a_notice_before_the_first_step_of_a_resumed_run_is_not_lost(
    under_jax_distributed, tmp_path
):
    # JAX agreed on step 1 (every counter was 0), which a run resumed after step 12 would never
    # reach: its first step is the preemption step instead, on every process alike.
    with jm.checkpoint.CheckpointManager(tmp_path) as manager:
        manager.save(12, {"step": 12})
    with jm.checkpoint.CheckpointManager(tmp_path) as manager:
        assert manager.reached_preemption(13) and manager.reached_preemption(14)
        assert manager.save(13, {"step": 13}) and manager.all_steps() == [12, 13]


def test_jax_s_counter_is_primed_with_the_latest_step_once(under_jax_distributed, tmp_path):
    with jm.checkpoint.CheckpointManager(tmp_path) as manager:
        manager.save(12, {"step": 12})
    assert under_jax_distributed == [1, 0]
    jm.checkpoint.CheckpointManager(tmp_path).close()  # not the first manager: nothing asked
    assert under_jax_distributed == [1, 0]


def test_a_python_handler_that_replaced_jax_s_is_warned_about(under_jax_distributed, tmp_path):
    signal.signal(signal.SIGTERM, lambda number, frame: None)
    with pytest.warns(RuntimeWarning, match="replacing JAX's preemption notifier"):
        jm.checkpoint.CheckpointManager(tmp_path).close()


@starts_processes
def test_one_process_a_second_sigterm_ends_it_and_close_restores_the_default(tmp_path):
    code = textwrap.dedent(
        """
        import os, signal, sys, tempfile
        import jmirror as jm
        manager = jm.checkpoint.CheckpointManager(tempfile.mkdtemp())
        os.kill(os.getpid(), signal.SIGTERM)
        print("alive after one SIGTERM:", manager.reached_preemption(1), flush=True)
        if sys.argv[1] == "close":
            manager.close()
        os.kill(os.getpid(), signal.SIGTERM)
        print("still alive", flush=True)
        """
    )
    for how in ("twice", "close"):
        result = subprocess.run(
            [sys.executable, "-c", code, how], capture_output=True, text=True, timeout=120,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
        )  # fmt: skip
        assert result.returncode == -signal.SIGTERM, result.stdout + result.stderr
        assert result.stdout.splitlines() == ["alive after one SIGTERM: True"]


@starts_processes
@pytest.mark.parametrize("closed_first", ["first", "second"])
def test_two_managers_closed_in_either_order_leave_the_open_one_watching(tmp_path, closed_first):
    # One manager restores pretrained weights and is closed, the training one stays open:
    # before one handler served both, closing the first one first left its handler below
    # the second's, and the first SIGTERM ended the process (SIG_DFL) with nothing saved.
    code = textwrap.dedent(
        """
        import os, signal, sys
        import jmirror as jm
        pretrained = jm.checkpoint.CheckpointManager(sys.argv[1] + "/pretrained")
        training = jm.checkpoint.CheckpointManager(sys.argv[1] + "/training")
        closed, left = (pretrained, training) if sys.argv[2] == "first" else (training, pretrained)
        closed.close()
        os.kill(os.getpid(), signal.SIGTERM)
        print("alive, reached:", left.reached_preemption(1), flush=True)
        left.save(1, {"w": 1.0})
        left.close()
        print("saved", left.all_steps(), flush=True)
        os.kill(os.getpid(), signal.SIGTERM)  # every manager closed: the default again
        print("still alive", flush=True)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code, tmp_path, closed_first], capture_output=True, text=True,
        timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    assert result.returncode == -signal.SIGTERM, result.stdout + result.stderr
    assert result.stdout.splitlines() == ["alive, reached: True", "saved [1]"], result.stderr


# --- 2 processes x 4 host devices under the launcher -----------------------------------------


kill_leftover_launchers = harness.kill_leftover_launchers  # every launcher, after each test


def _launch(out_dir, *args, name="launch"):
    out_dir.mkdir(exist_ok=True)
    return harness.launch(["--processes", "2", "--devices-per-process", "4", *args], out_dir, name)


def _finals(out_dir):
    return [np.load(out_dir / f"final{index}.npy") for index in (0, 1)]


def _assert_bitwise_equal(resumed, uninterrupted):
    for got, expected in zip(_finals(resumed), uninterrupted):
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert got.tobytes() == expected.tobytes()  # bitwise, not just numerically


def _preempted_steps(run):
    steps = {
        int(i): int(s)
        for i, s in re.findall(r"^\[(\d)\] preempted at step (\d+)", run.out.read_text(), re.M)
    }
    assert sorted(steps) == [0, 1], run.output()
    return steps


def _pids(run):
    return [int(run.wait_for(rf"^\[{i}\] pid (\d+)", STARTUP_S).group(1)) for i in (0, 1)]


def _resume(out_dir, first_step=None):
    """Runs the training again in `out_dir`: it resumes (from `first_step`) and ends."""
    run = _launch(out_dir, WORKER, str(out_dir), "--sleep", "0", name="resumed")
    code, _ = run.wait(RUN_S)
    assert code == 0, run.output()
    out = run.out.read_text()
    starts = {int(s) for s in re.findall(r"^\[\d\] start (\d+) restart 0$", out, re.M)}
    assert len(starts) == 1 and starts != {1}, out  # the same step on both, not the first
    assert first_step is None or starts == {first_step}, out
    for index in (0, 1):
        assert f"[{index}] done" in out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The oracle: the same training run to the end, never interrupted (2 x 4 as well)."""
    out_dir = tmp_path_factory.mktemp("uninterrupted")
    run = _launch(out_dir, WORKER, str(out_dir), "--sleep", "0")
    code, _ = run.wait(RUN_S)
    assert code == 0, run.output()
    return _finals(out_dir)


def _steps_on_disk(out_dir):
    return sorted(int(p.name) for p in (out_dir / "checkpoints").iterdir() if p.name.isdigit())


@starts_processes
def test_sigterm_to_one_worker_every_process_saves_at_the_same_step(tmp_path, uninterrupted):
    run = _launch(tmp_path, WORKER, str(tmp_path))
    pids = _pids(run)
    run.wait_for(r"^\[1\] step 6$", STARTUP_S)
    os.kill(pids[1], signal.SIGTERM)  # one worker only, as a platform preempting one machine
    code, _ = run.wait(RUN_S)
    assert code == 0, run.output()
    steps = _preempted_steps(run)
    step = steps[0]
    assert steps[1] == step, steps
    assert step < 24 and step in _steps_on_disk(tmp_path)
    assert "jmirror.launch" not in run.err.read_text()  # no failure, nothing stopped
    # The resumed run is preempted too, by a notice that comes before its manager opens (JAX
    # would agree on step 1 then, which it never reaches): at its first step.
    early = _launch(tmp_path, WORKER, str(tmp_path), "--sigterm-before-manager", name="early")
    code, _ = early.wait(RUN_S)
    assert code == 0, early.output()
    assert _preempted_steps(early) == {0: step + 1, 1: step + 1}
    _resume(tmp_path, step + 2)
    _assert_bitwise_equal(tmp_path, uninterrupted)


@starts_processes
def test_sigterm_to_the_launcher_every_process_saves_and_it_exits_0(tmp_path, uninterrupted):
    run = _launch(tmp_path, WORKER, str(tmp_path), "--helper")
    pids = _pids(run)
    run.wait_for(r"^\[0\] step 5$", STARTUP_S)
    run.popen.send_signal(signal.SIGTERM)
    code, _ = run.wait(RUN_S)
    assert code == 0, run.output()
    assert "received SIGTERM; forwarded it to every process" in run.err.read_text()
    steps = _preempted_steps(run)
    assert steps[0] == steps[1] and steps[0] in _steps_on_disk(tmp_path), steps
    assert not any(harness.is_running(pid) for pid in pids)
    _resume(tmp_path, steps[0] + 1)
    _assert_bitwise_equal(tmp_path, uninterrupted)


@starts_processes
def test_sigterm_then_sigkill_after_the_grace_period(tmp_path):
    args = (WORKER, str(tmp_path), "--ignore-preemption", "--steps", "100000")
    run = _launch(tmp_path, "--grace-period", "3", *args)
    pids = _pids(run)
    run.wait_for(r"^\[1\] step 3$", STARTUP_S)
    run.popen.send_signal(signal.SIGTERM)
    code, stop_s = run.wait(30)
    print(f"launcher returned {stop_s:.1f} s after SIGTERM, with --grace-period 3")
    assert code == 128 + signal.SIGTERM, run.output()
    assert 3 <= stop_s < 13
    assert "still running 3 s after SIGTERM (--grace-period); sent SIGKILL" in run.err.read_text()
    assert not any(harness.is_running(pid) for pid in pids)


@starts_processes
def test_max_restarts_after_a_sigkill_resumes_bitwise(tmp_path, uninterrupted):
    run = _launch(tmp_path, "--max-restarts", "1", WORKER, str(tmp_path))
    pids = _pids(run)
    run.wait_for(r"^\[1\] step 10$", STARTUP_S)
    os.kill(pids[1], signal.SIGKILL)
    code, _ = run.wait(RUN_S)
    assert code == 0, run.output()
    err, out = run.err.read_text(), run.out.read_text()
    assert "process 1 was killed by SIGKILL (exit code 137); stopped the others" in err
    assert "restarting every process (restart 1 of 1, JMIRROR_RESTART=1)" in err
    starts = re.findall(r"^\[(\d)\] start (\d+) restart 1$", out, re.M)
    assert sorted(i for i, _ in starts) == ["0", "1"] and len({s for _, s in starts}) == 1, out
    assert int(starts[0][1]) > 1  # resumed from a checkpoint, not from the beginning
    _assert_bitwise_equal(tmp_path, uninterrupted)


@starts_processes
def test_sigkill_of_the_launcher_during_the_grace_period(tmp_path, uninterrupted):
    # The platform's SIGKILL comes before the processes are done (they never check here):
    # nothing is left running, and the complete checkpoints resume to the same end.
    args = (WORKER, str(tmp_path), "--ignore-preemption", "--steps", "24", "--sleep", "0.3")
    run = _launch(tmp_path, "--grace-period", "60", *args)
    pids = _pids(run)
    run.wait_for(r"^\[1\] step 9$", STARTUP_S)
    run.popen.send_signal(signal.SIGTERM)
    run.wait_for(r"received SIGTERM; forwarded it", 10)
    run.popen.send_signal(signal.SIGKILL)
    run.popen.wait(10)
    deadline = time.monotonic() + 10  # the processes end within 10 s, as documented
    while any(harness.is_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in pids if harness.is_running(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, "processes still running 10 s after the launcher's SIGKILL"
    assert not (tmp_path / "final0.npy").exists()
    _resume(tmp_path)
    _assert_bitwise_equal(tmp_path, uninterrupted)
