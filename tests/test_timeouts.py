"""No wait without a bound across processes: `MultiWorkerMirroredStrategy(timeout_s=...)`.

Each launcher test here hung on the code before the timeouts (process 0 waited for process 1
forever, or 300 s in `initialize`): the subprocess timeout is what showed it. They start
processes, so they run once, in the 8-device pass. The argument checks run in both passes.
"""

import math
import re
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import jmirror as jm
from jmirror import _deadline

sys.path.insert(0, str(Path(__file__).parent / "multiprocess"))
import harness  # noqa: E402

TIMEOUT_S = 20
STARTUP_S = 60  # two JAX processes starting on two busy cores
SLACK_S = 30  # the watchdog's poll, naming the processes, the launcher stopping the others


def _launch(tmp_path, mode, timeout, *args):
    command = ["-m", "jmirror.launch", "--processes", "2", "--devices-per-process", "4"]
    command += ["timeout_worker.py", mode, str(timeout), *map(str, args)]
    return harness.Background(command, tmp_path, mode)


def _timed_out(tmp_path, mode, started, *args):
    """The output of a 2 x 4 run of `mode` with `timeout_s=TIMEOUT_S`, checked to have ended
    with jmirror's timeout status within the timeout (plus slack) of the line `started`."""
    run = _launch(tmp_path, mode, TIMEOUT_S, *args)
    try:
        run.wait_for(started, STARTUP_S)
        start = time.monotonic()
        code, _ = run.wait(TIMEOUT_S + SLACK_S + 30)
    finally:
        run.kill()
    elapsed = time.monotonic() - start
    out = run.output()
    assert code == _deadline.EXIT_CODE, out
    assert elapsed < TIMEOUT_S + SLACK_S, (elapsed, out)
    return out


# --- the argument -------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["300", True, [1]])
def test_a_timeout_that_is_not_a_number_is_a_type_error(bad):
    with pytest.raises(TypeError, match=r"MultiWorkerMirroredStrategy\(timeout_s=\.\.\.\).*number"):
        jm.MultiWorkerMirroredStrategy(timeout_s=bad)


@pytest.mark.parametrize("bad", [0, -1, 0.0, math.inf, math.nan])
def test_a_timeout_that_is_not_positive_and_finite_is_a_value_error(bad):
    with pytest.raises(ValueError, match=r"timeout_s=.*positive, finite.*None"):
        jm.MultiWorkerMirroredStrategy(timeout_s=bad)
    with pytest.raises(ValueError, match=r"jm\.distributed\.initialize\(timeout_s="):
        jm.distributed.initialize(timeout_s=bad)


def test_the_timeout_defaults_to_300_s_and_none_disables_it():
    assert jm.MultiWorkerMirroredStrategy().timeout_s == 300.0
    assert jm.MultiWorkerMirroredStrategy(timeout_s=2).timeout_s == 2.0
    assert jm.MultiWorkerMirroredStrategy(timeout_s=None).timeout_s is None


def test_one_process_has_nothing_to_bound_and_starts_no_thread():
    one = jm.MultiWorkerMirroredStrategy(timeout_s=1)
    assert one.dispatch.timeout_s is None  # no other process to wait for
    step = jm.replicate(lambda x: jm.all_reduce("sum", x), strategy=one)
    ones = jm.PerReplica(np.ones((one.num_replicas, 3), np.float32))
    for _ in range(4):
        out = step(ones)
    time.sleep(1.5)  # longer than timeout_s: nothing ends the process
    np.testing.assert_array_equal(one.read(out), np.full(3, one.num_replicas))
    assert float(one.reduce("sum", ones)[0]) == one.num_replicas
    assert _deadline.threads() == ()


class _Token:
    """A watched call's output whose completion the test decides."""

    def __init__(self, ready: bool):
        self.ready = ready

    def is_ready(self) -> bool:
        return self.ready


@pytest.mark.parametrize("ready", [True, False])
def test_a_call_that_completed_before_the_waiter_saw_it_is_not_late(monkeypatch, ready):
    # On a loaded machine the waiter thread may run seconds after the call it waits for has
    # completed: the watchdog asks the call itself before it ends the process.
    watchdog = _deadline._Watchdog()
    expired = []
    monkeypatch.setattr(watchdog, "expire", lambda wait, cause=None: expired.append(wait.call))
    monkeypatch.setattr(watchdog, "_publish", lambda: None)
    call = _deadline._Wait("a call", 1.0, "a test", time.monotonic() - 10, 1, _Token(ready))
    watchdog._head = call  # what the waiter waits for, 10 s after its clock started
    thread = threading.Thread(target=watchdog._watch_loop, daemon=True)
    thread.start()
    time.sleep(4 * _deadline.POLL_S)
    watchdog._stop.set()
    thread.join(timeout=10)
    assert not thread.is_alive()
    if ready:
        assert expired == []  # before: "timed out: a call has not completed 10 s after ..."
    else:
        assert expired and set(expired) == {"a call"}  # a call really late still ends it


_BARRIER_ERROR = (
    "DEADLINE_EXCEEDED: Barrier timed out. Id: k::0. This usually happens because a task "
    "triggered the barrier too early or too slowly.\n# of tasks that reached the barrier: "
    "1/4.\nThe first task at the barrier: 0. Some timed out task names:\n{names}\n\n\nRPC: "
    "/xla.coordination.CoordinationService/Barrier"
)


@pytest.mark.parametrize(
    "names",
    ["1\n3", "/job:jax_worker/replica:0/task:1\n/job:jax_worker/replica:0/task:3"],
)
def test_the_processes_absent_from_a_barrier_are_read_from_its_timeout_error(names):
    from jmirror.checkpoint._processes import _timed_out_tasks

    assert _timed_out_tasks(_BARRIER_ERROR.format(names=names)) == (1, 3)
    assert _timed_out_tasks("DEADLINE_EXCEEDED: something else") is None


# --- the watchdog in one process (a subprocess, since it ends the process) ----------------------

_SLOW_STEP = """
import time, jax, jax.numpy as jnp, numpy as np
from jax import lax
from jmirror import _deadline

# Runs asynchronously on XLA:CPU (a callback would run in the dispatching thread).
slow = jax.jit(lambda x, n: lax.fori_loop(0, n, lambda i, a: jnp.tanh(a @ a), x))
x = jnp.eye(256)
slow(x, 1).block_until_ready()  # compiled


def calibrated(seconds):  # (n, d): slow(x, n) ran in d > `seconds` seconds
    n = 50
    while True:
        start = time.monotonic()
        slow(x, n).block_until_ready()
        d = time.monotonic() - start
        if d > seconds:
            return n, d
        n *= 2
"""


def _python(tmp_path, code, name):
    script = tmp_path / f"{name}.py"
    script.write_text(textwrap.dedent(_SLOW_STEP) + textwrap.dedent(code))
    return harness.Background([str(script)], tmp_path, name)


@pytest.mark.once
def test_a_blocking_wait_past_its_bound_ends_the_process_naming_the_call(tmp_path):
    run = _python(
        tmp_path,
        """
        with _deadline.bounded("a test's wait", 1.0):
            time.sleep(60)
        """,
        "blocking",
    )
    code, waited = run.wait(STARTUP_S)
    assert code == _deadline.EXIT_CODE != 0, run.output()
    assert "jmirror: timed out: a test's wait has not completed 1 s after it was waited on" in (
        run.err.read_text()
    )
    assert "coordination service is not running" in run.err.read_text()


@pytest.mark.once
def test_a_watched_call_past_its_bound_ends_the_process(tmp_path):
    run = _python(
        tmp_path,
        """
        out = slow(x, 10**7)  # minutes of work, dispatched
        _deadline.watch(out, "a slow call", 1.0)
        print("threads", sorted(t.name for t in _deadline.threads()), flush=True)
        out.block_until_ready()
        """,
        "watched",
    )
    code, _ = run.wait(STARTUP_S)
    assert code == _deadline.EXIT_CODE, run.output()
    assert "timed out: a slow call has not completed" in run.err.read_text()
    assert "threads ['jmirror-deadline-waiter', 'jmirror-deadline-watchdog']" in run.output()


@pytest.mark.once
def test_tracing_and_compiling_a_new_program_is_not_counted(tmp_path):
    # As jm.replicate's first call of a signature: its trace and compilation (seconds, for
    # this unrolled program) run inside the bound on its dispatch, which is 0.5 s.
    run = _python(
        tmp_path,
        """
        import functools
        big = jax.jit(lambda x: functools.reduce(lambda a, i: jnp.sin(a) + i, range(2000), x))
        small = jnp.ones(3)  # runs in microseconds once compiled
        start = time.monotonic()
        with _deadline.bounded("a first call", 0.5):
            _deadline.compiling()  # what jmirror._tracing says when it traces a new signature
            big(small).block_until_ready()
        print("compiled and ran in", round(time.monotonic() - start, 1), "s", flush=True)
        """,
        "compiling",
    )
    code, _ = run.wait(STARTUP_S + 60)
    assert code == 0, run.output()
    assert "compiled and ran in" in run.output()


@pytest.mark.once
def test_calls_queued_behind_others_count_from_when_they_are_waited_on(tmp_path):
    # 30 calls of d seconds each, dispatched at once, each needing the one before: 30 d from
    # dispatch to the last result, but each is waited on for about d only, within 10 d. The
    # margin is wide because d is measured once and the suite's other sessions may take the
    # cores away afterwards (8 busy processes started after the measure made calls take
    # 5.5-7.3 d); counting from dispatch would still pass 10 d by the 11th call.
    run = _python(
        tmp_path,
        """
        n, d = calibrated(0.2)
        y = x
        for _ in range(30):  # each call needs the one before
            y = slow(y, n)
            _deadline.watch(y, "a queued call", 10 * d)
        y.block_until_ready()
        time.sleep(1)
        print("calls of", round(d, 2), "s, threads", len(_deadline.threads()), flush=True)
        """,
        "queued",
    )
    code, _ = run.wait(STARTUP_S + 120)
    assert code == 0, run.output()
    assert "s, threads 2" in run.output()


@pytest.mark.once
def test_at_exit_the_waiter_ends_after_the_call_it_waits_for(tmp_path):
    # A program that ends with its last step still running: the waiter was left inside
    # block_until_ready when the interpreter finalized, and taking the GIL back there aborted
    # the process ("FATAL: exception not rethrown", 1 in 13 runs of a 2-process test).
    run = _python(
        tmp_path,
        """
        import atexit
        # Registered before the watchdog starts, so it runs after the watchdog's stop.
        atexit.register(lambda: print("after stop: waiter alive", _deadline.threads()[0]
                                      .is_alive(), "step done", out.is_ready(), flush=True))
        n, _ = calibrated(1.0)
        out = slow(x, n)
        _deadline.watch(out, "the last step", 60.0)
        time.sleep(0.2)  # the waiter is in block_until_ready
        """,
        "exit",
    )
    code, _ = run.wait(STARTUP_S)
    assert code == 0, run.output()
    assert "after stop: waiter alive False step done True" in run.output()


# --- several processes ---------------------------------------------------------------------------


def _absent(text, call_pattern, process):
    # A traceback another thread prints at the same moment may leave its indentation before
    # the line (seen under load): the prefix allows white space.
    prefix = r"\[\d\]\s+jmirror: processes that did not arrive at "
    pattern = rf"{prefix}{call_pattern}[^\n]*: {process}\."
    return re.search(pattern, text)


@pytest.mark.once
@pytest.mark.parametrize("mode", ["stuck", "stuck-input"])
def test_a_stuck_peer_ends_the_run_within_the_timeout_naming_the_call_and_it(tmp_path, mode):
    # "stuck-input": process 0 waits in the input agreement of distribute_dataset, whose small
    # all-gather XLA:CPU runs inline: the call itself waits, before it returns.
    out = _timed_out(tmp_path, mode, r"process 1 is stuck")
    call = (
        r"(the replicated step jm\.replicate\(loss_step\)|strategy\.reduce|the input agreement.*)"
    )
    assert re.search(
        rf"\[0\] jmirror: timed out: {call} has not completed {TIMEOUT_S} s after it was "
        rf"waited on \(timeout_s={TIMEOUT_S} of jm\.MultiWorkerMirroredStrategy\); ending "
        r"process 0 with exit status 1\.",
        out,
    ), out
    assert re.search(r"\[0\] jmirror: processes that did not arrive at .*: 1\.", out), out
    assert "[0] jmirror:   process 1: in none of jmirror's cross-process waits" in out
    if mode == "stuck-input":
        # It is stuck in its own source: its report names the agreements it made before.
        line = re.search(r"\[0\] jmirror:   process 1: .*", out).group(0)
        assert re.search(r"other cross-process waits begun: .*the input agreement", line), line
    assert "jmirror.launch: process 0 exited with code 1" in out


@pytest.mark.once
@pytest.mark.parametrize("mode", ["skip-save", "skip-manager-save"])
def test_a_save_that_one_process_skips_ends_the_run_naming_the_wait_and_it(tmp_path, mode):
    out = _timed_out(tmp_path, mode, r"process 0 saves", tmp_path / "checkpoint")
    assert "process 0 saved" not in out
    # Process 0 waits in the save (its barrier, or the manager's gathering of every process's
    # data) for process 1, which waits in its next step for process 0: whichever times out
    # first names the other.
    in_save = (
        r"(jm\.checkpoint\.save|CheckpointManager\.save)'s "
        r"(barrier before writing \S+|gathering of every process's data)"
    )
    on_0 = re.search(rf"\[0\] jmirror: processes that did not arrive at {in_save}: 1\.", out)
    on_1 = re.search(
        # process 1's own wait: its next step, or the reduce after it (seen under load in CI)
        rf"\[1\] jmirror: processes that did not arrive at [^\n]*: 0\.\n"
        rf"\[1\] jmirror:   process 0: waiting in {in_save}",
        out,
    )
    assert on_0 or on_1, out


@pytest.mark.once
def test_a_process_that_never_calls_initialize_ends_the_run_naming_it(tmp_path):
    out = _timed_out(tmp_path, "no-init", r"process 1 never calls initialize")
    assert (
        f"[0] jmirror: timed out: jm.distributed.initialize() has not completed {TIMEOUT_S} s"
        in out
    )
    assert "[0] jmirror: processes that did not arrive: process 1 did not call " in out


@pytest.mark.once
@pytest.mark.parametrize("timeout", [300, "none"])
def test_a_peer_that_never_reaches_the_first_collective_is_named(tmp_path, timeout):
    # gloo gives up after 30 s with DEADLINE_EXCEEDED naming a key (its device ids and the
    # rank it waited for); jmirror names process 1, with or without timeout_s (without it,
    # through the excepthook of jm.distributed.initialize).
    run = _launch(tmp_path, "first", timeout)
    try:
        code, _ = run.wait(STARTUP_S + 30 + SLACK_S)
    finally:
        run.kill()
    out = run.output()
    assert code == _deadline.EXIT_CODE, out
    assert "failed on process 0: a peer process never reached this first collective" in out
    # The call waited on when gloo gives up: the step, or the reduce of its loss that waits
    # for it (dispatch is asynchronous), as in the stuck-peer test.
    first = r"(the replicated step jm\.replicate\(loss_step\)|strategy\.reduce|the first "
    first += "collective)"
    assert _absent(out, first, 1), out
    assert "[0] jmirror:   process 1: " in out


@pytest.mark.once
def test_without_a_timeout_a_slow_peer_is_waited_for_and_no_thread_started(tmp_path):
    run = _launch(tmp_path, "slow", "none")
    try:
        code, _ = run.wait(STARTUP_S + 25 + SLACK_S)
    finally:
        run.kill()
    out = run.output()
    assert code == 0, out
    for p in (0, 1):
        assert f"[{p}] worker: process {p} step 9" in out
        assert f"[{p}] worker: process {p} deadline threads []" in out
    assert "timed out" not in out
