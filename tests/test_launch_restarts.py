"""`python -m jmirror.launch`: restarts, SIGTERM forwarding and its grace period, no orphans
when the launcher dies, and the command line (`-mmod`, options after the script).

The tests that start processes run in the 8-device pass only (the suite runs twice); most use
plain Python programs (no JAX) so that they take a second or two.
"""

import os
import re
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "multiprocess"))
import harness  # noqa: E402

from jmirror import launch  # noqa: E402

starts_processes = pytest.mark.skipif(
    os.environ.get("JMIRROR_TEST_DEVICES", "8") != "8",
    reason="starts processes: runs once, in the 8-device pass",
)
STARTUP_S = 60  # generous: JAX processes on two busy CI cores
ORPHANS_S = 10  # documented: the launcher's processes end within 10 s of its death


def _script(tmp_path, name, code):
    path = tmp_path / name
    path.write_text(textwrap.dedent(code))
    return str(path)


kill_leftover_launchers = harness.kill_leftover_launchers  # every launcher, after each test


def _launch(tmp_path, *args, name="launch"):
    return harness.launch(args, tmp_path, name, cwd=tmp_path)


def _gone_within(pids, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(harness.is_running(pid) for pid in pids):
            return True
        time.sleep(0.1)
    return False


# --- the command line (no process started) ---------------------------------------------------


def test_attached_m_is_m_module():
    options = launch._parse(["--processes", "2", "-mpkg.train", "--lr", "3"])
    assert options.program == ["-m", "pkg.train", "--lr", "3"]


def test_options_after_the_script_belong_to_the_script(tmp_path):
    script = _script(tmp_path, "train.py", "")
    argv = ["--processes", "2", script, "--max-restarts", "3", "--processes", "9", "-m", "x"]
    options = launch._parse(argv)
    assert (options.processes, options.max_restarts) == (2, 0)
    assert options.program == [
        "script",
        script,
        "--max-restarts",
        "3",
        "--processes",
        "9",
        "-m",
        "x",
    ]


def test_double_dash_ends_the_launcher_options(tmp_path):
    script = _script(tmp_path, "train.py", "")
    options = launch._parse(["--processes", "1", "--grace-period", "5", "--", script, "-v"])
    assert options.grace_period == 5 and options.program == ["script", script, "-v"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["{script}", "--processes", "2"], "options must come before the program; '--processes'"),
        (["-m", "mod", "--processes=2"], "'--processes=2' after '-m mod' belongs to the program"),
        (["--processes", "2", "--max-restarts", "-1", "{script}"], "--max-restarts expects K >= 0"),
        (
            ["--processes", "2", "--grace-period", "-1", "{script}"],
            "--grace-period expects S, a finite number of seconds >= 0; got -1.0",
        ),
        (["--processes", "2", "--grace-period", "nan", "{script}"], "--grace-period expects"),
        (["--processes", "2", "--grace-period", "soon", "{script}"], "invalid float value"),
        (["--proc", "2", "{script}"], "unrecognized arguments: --proc"),  # no abbreviations
        (["--processes", "2", "-m", "--max-restarts"], "-m expects a module name"),
    ],
)
def test_bad_usage_is_a_clear_usage_error(tmp_path, capsys, argv, message):
    script = _script(tmp_path, "train.py", "")
    assert launch.main([word.format(script=script) for word in argv]) == 2
    err = capsys.readouterr().err
    assert "usage: python -m jmirror.launch --processes P" in err
    assert message in err, err


# --- restarts --------------------------------------------------------------------------------

FAILS_FIRST = """
    import os, sys, time
    restart, index = os.environ["JMIRROR_RESTART"], os.environ["JMIRROR_PROCESS_ID"]
    print("start", index, "restart", restart,
          "coordinator", os.environ["JMIRROR_COORDINATOR"], flush=True)
    if index == "0":
        open(f"started-{restart}", "w").close()
    if int(restart) < int(sys.argv[1]) and index == "1":
        # Fail once process 0 has started (else the launcher may stop it before it prints).
        deadline = time.monotonic() + 30
        while not os.path.exists(f"started-{restart}") and time.monotonic() < deadline:
            time.sleep(0.01)
        sys.exit(3)
    print("finished", os.environ["JMIRROR_PROCESS_ID"], flush=True)
"""


@starts_processes
def test_a_failure_restarts_every_process_with_a_new_port(tmp_path):
    script = _script(tmp_path, "fails.py", FAILS_FIRST)
    run = _launch(tmp_path, "--processes", "2", "--max-restarts", "2", script, "1")
    code, _ = run.wait(STARTUP_S)
    out, err = run.out.read_text(), run.err.read_text()
    assert code == 0, run.output()
    assert "jmirror.launch: process 1 exited with code 3; stopped the others" in err
    assert (
        "jmirror.launch: restarting every process (restart 1 of 2, JMIRROR_RESTART=1), "
        "JMIRROR_NUM_PROCESSES=2\n"
    ) in err
    assert "restart 2 of 2" not in err
    for index in (0, 1):
        assert (
            f"[{index}] start {index} restart 0" in out
            and f"[{index}] start {index} restart 1" in out
        )
        assert f"[{index}] finished {index}" in out  # only in the restarted run (1 exits at first)
    ports = set(re.findall(r"restart (\d) coordinator 127\.0\.0\.1:(\d+)", out))
    assert len({port for _, port in ports}) == 2, ports  # one port per start, shared by both


@starts_processes
def test_restarts_are_bounded_and_the_last_failure_is_the_exit_code(tmp_path):
    script = _script(tmp_path, "fails.py", FAILS_FIRST)
    run = _launch(tmp_path, "--processes", "2", "--max-restarts", "2", script, "99")
    code, _ = run.wait(STARTUP_S)
    err = run.err.read_text()
    assert code == 3, run.output()
    assert err.count("process 1 exited with code 3") == 3  # started 1 + 2 times
    assert "restart 2 of 2" in err and "restart 3" not in err
    assert "[1] start 1 restart 2" in run.out.read_text()


@starts_processes
def test_without_max_restarts_a_failure_is_not_restarted(tmp_path):
    script = _script(tmp_path, "fails.py", FAILS_FIRST)
    run = _launch(tmp_path, "--processes", "2", script, "1")
    code, _ = run.wait(STARTUP_S)
    assert code == 3, run.output()
    assert "restarting" not in run.err.read_text()


# --- SIGTERM to the launcher -----------------------------------------------------------------

ON_SIGTERM = """
    import os, signal, sys, time
    def on_sigterm(number, frame):
        print("saving", flush=True)
        time.sleep(0.5)
        sys.exit(0)
    if sys.argv[1] == "exit":
        signal.signal(signal.SIGTERM, on_sigterm)
    else:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as a program that never checks
    print("pid", os.getpid(), flush=True)
    while True:
        time.sleep(0.05)
"""


def _running(tmp_path, grace, body):
    """A launcher running 2 processes of ON_SIGTERM, and their pids."""
    script = _script(tmp_path, "term.py", ON_SIGTERM)
    run = _launch(tmp_path, "--processes", "2", "--grace-period", grace, script, body)
    pids = [int(run.wait_for(rf"^\[{i}\] pid (\d+)", STARTUP_S).group(1)) for i in (0, 1)]
    return run, pids


@starts_processes
def test_sigterm_is_forwarded_and_processes_that_exit_0_make_it_0(tmp_path):
    run, pids = _running(tmp_path, "20", "exit")
    run.popen.send_signal(signal.SIGTERM)
    code, stop_s = run.wait(20)
    assert code == 0, run.output()
    assert stop_s < 10  # they exited by themselves: no waiting for the grace period
    assert run.out.read_text().count("saving") == 2
    err = run.err.read_text()
    assert "received SIGTERM; forwarded it to every process, which have 20 s" in err
    assert not any(harness.is_running(pid) for pid in pids)


@starts_processes
def test_after_the_grace_period_sigkill_and_143(tmp_path):
    run, pids = _running(tmp_path, "2", "ignore")
    run.popen.send_signal(signal.SIGTERM)
    code, stop_s = run.wait(20)
    print(f"launcher returned {stop_s:.1f} s after SIGTERM, with a grace period of 2 s")
    assert code == 128 + signal.SIGTERM, run.output()
    assert 2 <= stop_s < 10
    assert "processes 0, 1 still running 2 s after SIGTERM (--grace-period); sent SIGKILL" in (
        run.err.read_text()
    )
    assert not any(harness.is_running(pid) for pid in pids)


@starts_processes
def test_a_second_sigterm_kills_at_once(tmp_path):
    run, pids = _running(tmp_path, "60", "ignore")
    run.popen.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    run.popen.send_signal(signal.SIGTERM)
    code, stop_s = run.wait(20)
    assert code == 128 + signal.SIGTERM, run.output()
    assert stop_s < 10
    assert "still running at a second signal; sent SIGKILL" in run.err.read_text()
    assert not any(harness.is_running(pid) for pid in pids)


# --- the launcher killed ---------------------------------------------------------------------

WITH_A_CHILD = """
    import os, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("pid", os.getpid(), "child", child.pid, flush=True)
    time.sleep(600)
"""


@starts_processes
def test_sigkill_of_the_launcher_ends_its_processes_and_their_children(tmp_path):
    script = _script(tmp_path, "tree.py", WITH_A_CHILD)
    run = _launch(tmp_path, "--processes", "2", script)
    pids = []
    for index in (0, 1):
        match = run.wait_for(rf"^\[{index}\] pid (\d+) child (\d+)", STARTUP_S)
        pids += [int(match.group(1)), int(match.group(2))]
    assert all(harness.is_running(pid) for pid in pids)
    run.popen.send_signal(signal.SIGKILL)
    run.popen.wait(10)
    gone = _gone_within(pids, ORPHANS_S)
    for pid in pids:  # never leave them behind, whatever the outcome
        if harness.is_running(pid):
            os.kill(pid, signal.SIGKILL)
    assert gone, f"still running {ORPHANS_S} s after the launcher's SIGKILL"


@starts_processes
def test_sigkill_of_the_launcher_ends_jax_processes(tmp_path):
    # The hunt's case: 2 x 4 JAX processes in a loop of cross-process sums that prints nothing
    # (so no write to a closed pipe ends them) ran on for ever.
    worker = str(harness.WORKER)
    run = _launch(tmp_path, "--processes", "2", "--devices-per-process", "4", worker, "quiet")
    pids = [int(run.wait_for(rf"^\[{i}\] .*pid (\d+)", STARTUP_S).group(1)) for i in (0, 1)]
    run.wait_for(r"^\[0\] looping", STARTUP_S)
    run.wait_for(r"^\[1\] looping", STARTUP_S)
    killed_at = time.monotonic()
    run.popen.send_signal(signal.SIGKILL)
    run.popen.wait(10)
    gone = _gone_within(pids, ORPHANS_S)
    print(f"the processes ended {time.monotonic() - killed_at:.1f} s after the launcher")
    for pid in pids:
        if harness.is_running(pid):
            os.kill(pid, signal.SIGKILL)
    assert gone, f"still running {ORPHANS_S} s after the launcher's SIGKILL"


@starts_processes
def test_attached_m_runs_the_module(tmp_path):
    (tmp_path / "hello_mod.py").write_text("import sys; print('hello', sys.argv[1:])\n")
    run = _launch(tmp_path, "--processes", "2", "-mhello_mod", "--processes", "7")
    code, _ = run.wait(STARTUP_S)
    assert code == 0, run.output()
    out = run.out.read_text()
    assert "[0] hello ['--processes', '7']" in out and "[1] hello ['--processes', '7']" in out


@starts_processes
def test_sigterm_is_forwarded_to_the_children_of_the_processes_too(tmp_path):
    script = _script(tmp_path, "tree.py", WITH_A_CHILD)
    run = _launch(tmp_path, "--processes", "2", "--grace-period", "30", script)
    pids = []
    for index in (0, 1):
        match = run.wait_for(rf"^\[{index}\] pid (\d+) child (\d+)", STARTUP_S)
        pids += [int(match.group(1)), int(match.group(2))]
    run.popen.send_signal(signal.SIGTERM)
    code, stop_s = run.wait(20)
    assert code == 128 + signal.SIGTERM, run.output()  # killed by it: not 0
    assert stop_s < 10  # SIGTERM ended them: no waiting for the grace period
    assert _gone_within(pids, 5)


def test_help_says_what_each_option_does(capsys):
    assert launch._parse(["--help"]) == 0
    out = capsys.readouterr().out
    for option, says in [
        ("--processes P", "how many processes"),
        ("--max-restarts K", "at most K times"),
        ("--grace-period S", "SIGTERM"),
        ("--compilation-cache DIR|off", "'off' disables it"),
        ("--devices-per-process D", "host devices"),
        ("--min-processes M", "never fewer than M"),
    ]:
        assert option in out and says in " ".join(out.split()), option
    assert "JMIRROR_RESTART" in out
