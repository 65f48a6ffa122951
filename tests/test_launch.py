"""`python -m jmirror.launch`: processes, output, exit codes, stopping, usage errors.

These tests start JAX processes: they run in the 8-device pass only (the suite runs twice).
"""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "multiprocess"))
import harness  # noqa: E402

from jmirror import launch  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("JMIRROR_TEST_DEVICES", "8") != "8",
    reason="starts processes: runs once, in the 8-device pass",
)
STARTUP_S = 60  # generous: two JAX processes on two busy CI cores
STOP_S = 10  # documented: the others are stopped within 10 s


def _launch(tmp_path, *args, name="launch"):
    return harness.Background(["-m", "jmirror.launch", *args], tmp_path, name)


def _is_loopback(address: str) -> bool:
    # /proc/net/tcp* addresses: 127.0.0.1, or ::ffff:127.0.0.1 / ::1 in tcp6.
    return address.endswith("0100007F") or address == "00000000000000000000000001000000"


def test_runs_every_process_and_prefixes_every_line(tmp_path):
    run = _launch(tmp_path, "--processes", "2", "--devices-per-process", "4", "worker.py", "sum")
    code, _ = run.wait(STARTUP_S)
    out, err = run.out.read_text(), run.err.read_text()
    assert code == 0, out + err
    for index in (0, 1):
        assert f"[{index}] process {index} of 2, 4 local devices" in out
        # Process p holds 4 rows of 8 elements of value p + 1: (1 + 2) * 4 * 8 = 96.
        assert f"[{index}] process {index}: sum 96 expected 96" in out
        assert f"[{index}] process {index}: on stderr" in err
    for line in (out + err).splitlines():
        assert re.match(r"\[[01]\] ", line), f"unprefixed line {line!r}"
    assert "[Gloo]" not in out  # gloo's reports of connected ranks are left out


GLOO = "[Gloo] Rank 3 is connected to 7 peer ranks. Expected number of connected peer ranks is : 7"


@pytest.mark.parametrize(
    "line, left_out",
    [
        (GLOO, True),
        # two of a process's threads reporting at once: pieces of two reports on one line
        ("[Gloo] Rank [Gloo] Rank 1 is connected to 1 peer ranks. Expected number of "
         "connected peer ranks is : 1", True),
        ("1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1", True),
        # digits of two reports run together: no count can be read, nothing but gloo's words
        (
            "[Gloo] Rank 7 is connected to [Gloo] Rank 76 peer ranks.  is connected to Expected "
            "number of connected peer ranks is : 77 peer ranks. ",
            True,
        ),
        (GLOO.replace("connected to 7", "connected to 6"), False),  # a rank short: kept
        (GLOO + " and more", False),
        ("[Gloo] Rank 3 failed: Connection reset by peer", False),
        ("42", False),
        ("step 7: 3 peer ranks", False),
    ],
)  # fmt: skip
def test_only_gloos_reports_of_connected_ranks_are_left_out(line, left_out):
    assert launch._is_gloo_report(line) == left_out


def test_runs_a_module_with_one_device_per_process_by_default(tmp_path):
    run = _launch(tmp_path, "--processes", "2", "-m", "worker", "sum")  # cwd: tests/multiprocess
    code, _ = run.wait(STARTUP_S)
    out = run.out.read_text()
    assert code == 0, run.output()
    assert "[1] process 1 of 2, 1 local devices" in out
    assert "[0] process 0: sum 24 expected 24" in out  # (1 + 2) * 1 * 8


def test_a_failing_process_stops_the_others_with_its_code(tmp_path):
    # Process 1 calls sys.exit(3) while process 0 waits for it in a collective, and process 1
    # itself then waits in JAX's exit hook for process 0: only the launcher can end them.
    args = ("--processes", "2", "--devices-per-process", "4", "worker.py", "exit", "3")
    run = _launch(tmp_path, *args)
    run.wait_for(r"^\[1\] process 1: exiting", STARTUP_S)
    code, stop_s = run.wait(STOP_S + 5)
    print(f"launcher returned {stop_s:.1f} s after process 1 called sys.exit(3)")
    assert code == 3, run.output()
    assert stop_s < STOP_S
    assert "jmirror.launch: process 1 exited with code 3; stopped the others" in run.err.read_text()
    pids = [int(p) for p in re.findall(r"pid (\d+)", run.out.read_text())]
    assert len(pids) == 2 and not any(harness.is_running(pid) for pid in pids)


def _running_loop(tmp_path):
    """A launcher running `worker.py loop` on 2 processes × 4 devices, and their pids."""
    args = ("--processes", "2", "--devices-per-process", "4", "worker.py", "loop")
    run = _launch(tmp_path, *args)
    run.wait_for(r"^\[0\] step", STARTUP_S)
    run.wait_for(r"^\[1\] step", STARTUP_S)
    out = run.out.read_text()
    pids = [int(re.search(rf"^\[{i}\] .*pid (\d+)", out, re.M).group(1)) for i in (0, 1)]
    return run, pids


def test_a_killed_process_stops_the_others_with_128_plus_signal(tmp_path):
    run, pids = _running_loop(tmp_path)
    try:
        # The coordinator that process 0 runs listens on 127.0.0.1 only.
        port = int(re.search(r"coordinator 127\.0\.0\.1:(\d+)", run.out.read_text()).group(1))
        addresses = harness.listening_addresses(port)
        assert addresses and all(_is_loopback(a) for a in addresses), addresses
        os.kill(pids[1], signal.SIGKILL)
        code, stop_s = run.wait(STOP_S + 5)
    finally:
        run.kill()
    print(f"launcher returned {stop_s:.1f} s after process 1 was SIGKILLed")
    assert code == 128 + signal.SIGKILL, run.output()
    assert stop_s < STOP_S
    err = run.err.read_text()
    assert (
        "jmirror.launch: process 1 was killed by SIGKILL (exit code 137); stopped the others" in err
    )
    assert not any(harness.is_running(pid) for pid in pids)


def test_ctrl_c_stops_every_process(tmp_path):
    run, pids = _running_loop(tmp_path)
    try:
        run.popen.send_signal(signal.SIGINT)
        code, stop_s = run.wait(STOP_S + 5)
    finally:
        run.kill()
    print(f"launcher returned {stop_s:.1f} s after SIGINT")
    assert code == 128 + signal.SIGINT, run.output()
    assert stop_s < STOP_S
    assert "jmirror.launch: received SIGINT; stopped every process" in run.err.read_text()
    assert not any(harness.is_running(pid) for pid in pids)


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "--processes"),
        (["--processes", "0", "worker.py"], "expects P >= 1; got 0"),
        (["--processes", "two", "worker.py"], "invalid int value"),
        (["--processes", "2", "--devices-per-process", "0", "worker.py"], "expects D >= 1"),
        (["--processes", "2"], "expected a script.py or -m module"),
        (["--processes", "2", "-m"], "-m expects a module name"),
        (["--processes", "2", "missing.py"], "script 'missing.py' not found"),
    ],
)
def test_bad_arguments_are_a_usage_error(argv, message, capsys):
    assert launch.main(argv) == 2
    err = capsys.readouterr().err
    assert "usage: python -m jmirror.launch --processes P" in err
    assert message in err


def test_usage_error_from_the_command_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "jmirror.launch", "--processes", "2", "missing.py"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert "script 'missing.py' not found" in result.stderr
