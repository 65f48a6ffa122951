"""Helpers for the tests that start processes: run in the background, wait for a line, clean up."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).parent
WORKER = HERE / "worker.py"


class Background:
    """A process whose stdout and stderr go to files, read while it runs."""

    def __init__(self, args, out_dir: Path, name: str, env=None, cwd=HERE, prefix=()):
        """`python ARGS`, after the words of `prefix` (e.g. `ip netns exec NAME`)."""
        self.out = out_dir / f"{name}.out"
        self.err = out_dir / f"{name}.err"
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.popen = subprocess.Popen(
                [*prefix, sys.executable, *args],
                stdout=out,
                stderr=err,
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def output(self) -> str:
        return self.out.read_text(errors="replace") + self.err.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        """The first match of `pattern` in the output, waiting up to `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = re.search(pattern, self.output(), re.MULTILINE)
            if match:
                return match
            if self.popen.poll() is not None:
                break
            time.sleep(0.05)
        match = re.search(pattern, self.output(), re.MULTILINE)
        if match:
            return match
        raise AssertionError(f"no {pattern!r} within {timeout} s; output:\n{self.output()}")

    def wait(self, timeout: float) -> tuple[int, float]:
        """The exit code and the seconds waited; kills the process group on timeout."""
        start = time.monotonic()
        try:
            code = self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"still running after {timeout} s:\n{self.output()}") from None
        return code, time.monotonic() - start

    def kill(self) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.popen.wait(timeout=10)


_LAUNCHED: list[Background] = []  # killed, with their process groups, when the test ends


def launch(args, out_dir: Path, name: str = "launch", **kwargs) -> Background:
    """`python -m jmirror.launch ARGS` in the background, killed after the test by the
    `kill_leftover_launchers` fixture (a test module takes it in with
    `kill_leftover_launchers = harness.kill_leftover_launchers`)."""
    run = Background(["-m", "jmirror.launch", *args], out_dir, name, **kwargs)
    _LAUNCHED.append(run)
    return run


@pytest.fixture(autouse=True)
def kill_leftover_launchers():
    yield
    while _LAUNCHED:
        _LAUNCHED.pop().kill()


def two_by_four(worker: Path, *args, out: Path, timeout: float = 300) -> list[dict]:
    """Runs `worker ARGS` as 2 processes x 4 host devices through the launcher, checks that
    it exited 0, and returns what each process saved in OUT/process<i>.npz."""
    command = ["-m", "jmirror.launch", "--processes", "2", "--devices-per-process", "4"]
    run = subprocess.run(
        [sys.executable, *command, str(worker), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return [dict(np.load(out / f"process{i}.npz")) for i in range(2)]


def is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie not yet reaped by its parent counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def listening_addresses(port: int) -> list[str]:
    """The local addresses of the TCP sockets listening on `port` (from /proc/net/tcp*)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, _, state = line.split()[1:4]
            address, hex_port = local.split(":")
            if int(hex_port, 16) == port and state == "0A":  # 0A: LISTEN
                found.append(address)
    return found
