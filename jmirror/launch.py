"""`python -m jmirror.launch`: run one program as several local processes, as on several machines.

    python -m jmirror.launch --processes P [--devices-per-process D] (script.py | -m module) [args]

starts P processes of `script.py args` (or `python -m module args`) on this machine, each told
by environment variables (`jm.distributed.ENV_*`) to join one run: a coordinator on
127.0.0.1 and a free port, process indices 0 to P-1 and, on CPU, D XLA:CPU host devices each
(default 1). The program calls `jm.distributed.initialize()` first, which reads them. Unless
`JAX_PLATFORMS` is set, the processes use the CPU backend (`JAX_PLATFORMS=cpu`), so that P
processes on one machine never share an accelerator by accident.

Every line a process prints (stdout and stderr) is printed with its index first (`[0] `,
`[1] `, ...). The launcher returns 0 when every process exits with 0. When one fails (a
non-zero exit code, an uncaught exception, a signal), it stops the others (SIGTERM, then
SIGKILL 3 s later: under `jax.distributed` a process catches SIGTERM, and one that exits waits
for its peers in JAX's exit hook, so only SIGKILL is sure) and returns the first failing
process's code, naming it on stderr. A process killed by a signal counts as 128 + the signal
number, as a shell reports it. Ctrl-C or SIGTERM to the launcher stops every process the same
way (each runs in its own process group, so its own children are stopped too).

Each process runs the program under a short bootstrap that reports a failing exit code to the
launcher through a pipe as soon as the program ends, before JAX's exit hook starts waiting for
the other processes; this is how the launcher sees `sys.exit(3)` at once.
"""

from __future__ import annotations

import argparse
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["main"]

USAGE = (
    "python -m jmirror.launch --processes P [--devices-per-process D] "
    "(script.py | -m module) [args]"
)
STOP_GRACE_S = 3.0  # SIGTERM, then SIGKILL this much later
_DRAIN_S = 1.0  # after the last process exits, how long its children may still hold the pipes
_STATUS_FD = "JMIRROR_LAUNCH_STATUS_FD"

# Runs in each process: the program as `python script.py` / `python -m module` would run it,
# then a failing exit code written to the launcher's pipe before the interpreter exits (and
# waits in JAX's exit hook for the other processes).
_BOOTSTRAP = """\
import os, runpy, sys
def _jmirror_launch_child():
    fd = int(os.environ.pop("JMIRROR_LAUNCH_STATUS_FD"))
    kind, target = sys.argv[1], sys.argv[2]
    sys.argv = [target] + sys.argv[3:]
    def report(code):
        sys.stdout.flush(); sys.stderr.flush()
        if code % 256:
            os.write(fd, b"%d\\n" % (code % 256))
    try:
        if kind == "-m":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exit:
        code = exit.code
        report(0 if code is None else code if isinstance(code, int) else 1)
        raise
    except BaseException as error:
        tb = error.__traceback__  # from the program's first frame, as python would show it
        while tb and tb.tb_frame.f_code.co_filename in ("<string>", "<frozen runpy>"):
            tb = tb.tb_next
        sys.excepthook(type(error), error, tb)
        report(1)
        raise SystemExit(1) from None
_jmirror_launch_child()
"""


@dataclass
class _Process:
    """One launched process: its Popen, its output pipes and what it reported."""

    index: int
    popen: subprocess.Popen[bytes]
    status_fd: int
    partial: dict[int, bytes] = field(default_factory=dict)
    reported: int | None = None  # a failing code the bootstrap reported
    code: int | None = None  # the exit code, 128 + signal for a signal


def main(argv: Sequence[str] | None = None) -> int:
    """Run a program as several local processes of one multi-process JAX run.

    Args:
      argv: the command line after `python -m jmirror.launch` (default `sys.argv[1:]`):
        `--processes P [--devices-per-process D] (script.py | -m module) [args]`.

    Returns:
      0 when every process exited with 0; else the first failing process's exit code (128 +
      the signal number for a signal); 2 for a usage error; 128 + the signal number when the
      launcher was stopped by SIGINT or SIGTERM.

    Example:
      >>> from jmirror.launch import main
      >>> main(["--processes", "1", "-m", "platform"])  # prints the platform, as process 0
      [0] ...
      0
    """
    parsed = _parse(list(sys.argv[1:] if argv is None else argv))
    if isinstance(parsed, int):
        return parsed
    processes, devices, kind, target, args = parsed
    return _Launch(processes, devices, [kind, target, *args]).run()


def _usage_error(message: str) -> int:
    sys.stderr.write(f"usage: {USAGE}\njmirror.launch: error: {message}\n")
    return 2


def _parse(argv: list[str]) -> tuple[int, int, str, str, list[str]] | int:
    """Split options from the program; a usage error prints and returns 2."""
    split = _program_start(argv)
    parser = argparse.ArgumentParser(prog="python -m jmirror.launch", usage=USAGE, add_help=True)
    parser.add_argument("--processes", type=int, required=True, metavar="P")
    parser.add_argument("--devices-per-process", type=int, default=1, metavar="D")
    try:
        options = parser.parse_args(argv[:split])
    except SystemExit as exit:  # argparse printed the usage error or the help
        return exit.code if isinstance(exit.code, int) else 2
    if options.processes < 1:
        return _usage_error(f"--processes expects P >= 1; got {options.processes}.")
    if options.devices_per_process < 1:
        return _usage_error(
            f"--devices-per-process expects D >= 1; got {options.devices_per_process}."
        )
    program = argv[split:]
    if not program:
        return _usage_error("expected a script.py or -m module to run; got neither.")
    if program[0] == "-m":
        if len(program) < 2 or not program[1]:
            return _usage_error("-m expects a module name, e.g. -m mypackage.train.")
        return options.processes, options.devices_per_process, "-m", program[1], program[2:]
    if not os.path.isfile(program[0]):
        return _usage_error(
            f"script {program[0]!r} not found (from {os.getcwd()!r}); give a script.py path "
            "or -m module."
        )
    return options.processes, options.devices_per_process, "script", program[0], program[1:]


def _program_start(argv: list[str]) -> int:
    """Index of the first word of the program: `-m` or the first word that is not an option."""
    with_value = {"--processes", "--devices-per-process"}
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "-m" or not word.startswith("-"):
            return i
        i += 2 if word in with_value else 1
    return len(argv)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _exit_code(returncode: int) -> int:
    """A Popen return code as a shell reports it: 128 + the signal number for a signal."""
    return 128 - returncode if returncode < 0 else returncode


def _describe_failure(process: _Process, code: int) -> str:
    if process.reported is None and code > 128 and process.popen.returncode == 128 - code:
        number = code - 128
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        return f"process {process.index} was killed by {name} (exit code {code})"
    return f"process {process.index} exited with code {code}"


class _Launch:
    """Starts the processes, copies their output line by line and stops them all on failure."""

    def __init__(self, processes: int, devices: int, program: list[str]) -> None:
        self.count = processes
        self.devices = devices
        self.program = program
        self.selector = selectors.DefaultSelector()
        self.processes: list[_Process] = []
        self.first_failure: tuple[_Process, int] | None = None
        self.stop_signal: int | None = None
        self.kill_at: float | None = None  # when stopping: the time of SIGKILL

    def run(self) -> int:
        previous = self._install_signal_handlers()
        try:
            self._start()
            self._supervise()
        finally:
            self._stop(signal.SIGKILL)  # only reached early by an error of the launcher
            self._reap()
            self.selector.close()
            for handled, handler in previous.items():
                signal.signal(handled, handler)
        return self._result()

    def _install_signal_handlers(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous = {}
        for handled in (signal.SIGINT, signal.SIGTERM):
            previous[handled] = signal.signal(handled, self._on_signal)
        return previous

    def _on_signal(self, number: int, frame: object) -> None:
        if self.stop_signal is None:
            self.stop_signal = number

    def _start(self) -> None:
        coordinator = f"127.0.0.1:{_free_port()}"
        for index in range(self.count):
            read_fd, write_fd = os.pipe()
            env = dict(os.environ)
            env.update(
                JMIRROR_COORDINATOR=coordinator,
                JMIRROR_NUM_PROCESSES=str(self.count),
                JMIRROR_PROCESS_ID=str(index),
                JMIRROR_DEVICES_PER_PROCESS=str(self.devices),
                PYTHONUNBUFFERED="1",
            )
            env[_STATUS_FD] = str(write_fd)
            env.setdefault("JAX_PLATFORMS", "cpu")
            try:
                popen = subprocess.Popen(
                    [sys.executable, "-c", _BOOTSTRAP, *self.program],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    env=env,
                    pass_fds=(write_fd,),
                    start_new_session=True,
                )
            finally:
                os.close(write_fd)
            process = _Process(index, popen, read_fd)
            self.processes.append(process)
            assert popen.stdout is not None and popen.stderr is not None  # PIPE above
            for fd in (popen.stdout.fileno(), popen.stderr.fileno(), read_fd):
                os.set_blocking(fd, False)
                self.selector.register(fd, selectors.EVENT_READ, process)

    def _supervise(self) -> None:
        drain_until = None
        while True:
            for key, _ in self.selector.select(timeout=0.05):
                self._read(key.data, key.fd)
            self._poll()
            now = time.monotonic()
            if self.kill_at is None and (self.first_failure or self.stop_signal):
                self._announce()
                self._stop(signal.SIGTERM)
                self.kill_at = now + STOP_GRACE_S
            elif self.kill_at is not None and now >= self.kill_at:
                self._stop(signal.SIGKILL)
            if all(p.code is not None for p in self.processes):
                drain_until = drain_until or now + _DRAIN_S
                # Children of the processes may hold the pipes open: wait only so long.
                if not self.selector.get_map() or now >= drain_until:
                    break
        for key in list(self.selector.get_map().values()):
            self.selector.unregister(key.fd)
            self._flush(key.data, key.fd)

    def _read(self, process: _Process, fd: int) -> None:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return
        if fd == process.status_fd:
            if data and process.reported is None:
                process.reported = int(data.split()[0])
                self._failed(process, process.reported)
            elif not data:
                self.selector.unregister(fd)
                os.close(fd)
            return
        if not data:
            self.selector.unregister(fd)
            self._flush(process, fd)
            return
        lines = (process.partial.pop(fd, b"") + data).split(b"\n")
        process.partial[fd] = lines.pop()
        if lines:
            self._write(process, fd, lines)

    def _flush(self, process: _Process, fd: int) -> None:
        rest = process.partial.pop(fd, b"")
        if rest:
            self._write(process, fd, [rest])
        if fd == process.status_fd:
            os.close(fd)

    def _write(self, process: _Process, fd: int, lines: list[bytes]) -> None:
        assert process.popen.stdout is not None  # PIPE
        stream = sys.stdout if fd == process.popen.stdout.fileno() else sys.stderr
        prefix = f"[{process.index}] "
        text = "".join(prefix + line.decode(errors="replace") + "\n" for line in lines)
        stream.write(text)
        stream.flush()

    def _poll(self) -> None:
        for process in self.processes:
            if process.code is None and process.popen.poll() is not None:
                process.code = _exit_code(process.popen.returncode)
                if process.code != 0:
                    self._failed(process, process.reported or process.code)

    def _failed(self, process: _Process, code: int) -> None:
        if self.first_failure is None and self.stop_signal is None:
            self.first_failure = (process, code)

    def _announce(self) -> None:
        if self.first_failure is not None:
            process, code = self.first_failure
            others = "; stopped the others" if self.count > 1 else ""
            message = _describe_failure(process, code) + others
        else:
            assert self.stop_signal is not None
            name = signal.Signals(self.stop_signal).name
            message = f"received {name}; stopped every process"
        sys.stderr.write(f"jmirror.launch: {message}\n")
        sys.stderr.flush()

    def _stop(self, number: int) -> None:
        """Send `number` to the process group of every process that is still running."""
        for process in self.processes:
            if process.popen.poll() is None:
                try:
                    os.killpg(process.popen.pid, number)
                except ProcessLookupError:
                    pass

    def _reap(self) -> None:
        for process in self.processes:
            process.popen.wait()
            if process.code is None:
                process.code = _exit_code(process.popen.returncode)
            for stream in (process.popen.stdout, process.popen.stderr):
                if stream is not None:
                    stream.close()
            if self.first_failure or self.stop_signal:  # the processes' own children too
                try:
                    os.killpg(process.popen.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def _result(self) -> int:
        if self.first_failure is not None:
            return self.first_failure[1]
        if self.stop_signal is not None:
            return 128 + self.stop_signal
        return 0


if __name__ == "__main__":
    sys.exit(main())
