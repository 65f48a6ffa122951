"""`python -m jmirror.launch`: run one program as several local processes, as on several machines.

    python -m jmirror.launch --processes P [--min-processes M] [--devices-per-process D]
        [--max-restarts K] [--grace-period S] [--compilation-cache DIR|off]
        (script.py | -m module) [args]

starts P processes of `script.py args` (or `python -m module args`) on this machine, each told
by environment variables (`jm.distributed.ENV_*`) to join one run: a coordinator on
127.0.0.1 and a free port, process indices 0 to P-1 and, on CPU, D XLA:CPU host devices each
(default 1). The program calls `jm.distributed.initialize()` first, which reads them. Unless
`JAX_PLATFORMS` is set, the processes use the CPU backend (`JAX_PLATFORMS=cpu`), so that P
processes on one machine never share an accelerator by accident. As with `python`, every word
after the script (or `-m module`) belongs to the program, options included; `-mmodule` is
`-m module`.

Every line a process prints (stdout and stderr) is printed with its index first (`[0] `,
`[1] `, ...). The launcher returns 0 when every process exits with 0. When one fails (a
non-zero exit code, an uncaught exception, a signal), it stops the others (SIGTERM, then
SIGKILL 3 s later: under `jax.distributed` a process catches SIGTERM, and one that exits waits
for its peers in JAX's exit hook, so only SIGKILL is sure) and returns the first failing
process's code, naming it on stderr. A process killed by a signal counts as 128 + the signal
number, as a shell reports it. Each process runs in its own process group, so its own children
are stopped with it.

Restarts (`--max-restarts K`, default 0): when a process fails, every process is stopped as
above and all of them are started again, with a new coordinator port, at most K times; the
K+1-th failure ends the launcher with that failure's code. Each start tells the program how
many restarts came before it in `JMIRROR_RESTART` (`"0"` the first time, `jm.distributed.
ENV_RESTART`); a program that resumes from `manager.latest_step()` needs nothing else.

Fewer processes (`--min-processes M`, default P; torchrun's elastic `--nnodes MIN:MAX`): a
restart starts one process fewer for each lost process (one that failed by itself, before the
launcher stopped the others; not those it stopped), never fewer than M, and tells them the
new count in `JMIRROR_NUM_PROCESSES` (process indices 0 to the count - 1), and every start the
counts the run may have in `JMIRROR_PROCESS_COUNTS` (`"M:P"`). Each restart's line on stderr
gives its process count. The program then resumes on fewer replicas: `jmirror.checkpoint`
restores onto any layout, and a global batch of the same size keeps the results of an
uninterrupted run; `strategy.distribute_dataset` refuses (`ValueError`, at its first batch,
before any step) a global batch that the replicas of this start do not divide, naming the
sizes that every count from M to P divides.

SIGTERM to the launcher (what SLURM and Kubernetes send before SIGKILL) is forwarded to every
process (its process group), which then have `--grace-period` seconds (default 30) to save and
exit (see `CheckpointManager.reached_preemption`); those still running then are SIGKILLed. The
launcher returns 0 if every process exited with 0, else 143 (128 + SIGTERM). Ctrl-C (SIGINT)
stops every process at once as a failure does and returns 130 (0 if every process exited 0).
A second SIGTERM or SIGINT SIGKILLs the processes without waiting. Neither is restarted.

If the launcher itself dies, even by SIGKILL, its processes end within about a second and leave
no orphans: on Linux each process has the kernel kill it when the launcher dies
(`PR_SET_PDEATHSIG`), and on every platform a small watcher forked beside each process (in its
process group) SIGKILLs the whole group, the program's own children included, once a pipe held
only by the launcher reaches end-of-file.

Compilation survives restarts (`--compilation-cache DIR|off`): the processes use JAX's
persistent compilation cache in DIR, by default `jmirror/compilation` under the user's cache
directory (`$XDG_CACHE_HOME`, else `~/.cache`), for every step however quickly it compiles
(`JAX_COMPILATION_CACHE_DIR`, `JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0`,
`JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=-1` in their environment), so that a restart, and
a start on fewer processes that ran before, finds the steps it has compiled. A
`JAX_COMPILATION_CACHE_DIR` already in the environment is kept unless the option is given;
`off` disables the cache (`JAX_ENABLE_COMPILATION_CACHE=false`).

Each process runs the program under a short bootstrap that reports a failing exit code to the
launcher through a pipe as soon as the program ends, before JAX's exit hook starts waiting for
the other processes; this is how the launcher sees `sys.exit(3)` at once.
"""

from __future__ import annotations

import argparse
import os
import re
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
    "python -m jmirror.launch --processes P [--min-processes M] [--devices-per-process D] "
    "[--max-restarts K] [--grace-period S] [--compilation-cache DIR|off] "
    "(script.py | -m module) [args]"
)
STOP_GRACE_S = 3.0  # after a failure or Ctrl-C: SIGTERM, then SIGKILL this much later
GRACE_PERIOD_S = 30.0  # after SIGTERM to the launcher (--grace-period)
_DRAIN_S = 1.0  # after the last process exits, how long its children may still hold the pipes
_STATUS_FD = "JMIRROR_LAUNCH_STATUS_FD"
_ALIVE_FD = "JMIRROR_LAUNCH_ALIVE_FD"
_PARENT = "JMIRROR_LAUNCH_PID"
_RESTART = "JMIRROR_RESTART"  # jm.distributed.ENV_RESTART
ENV_PROCESS_COUNTS = "JMIRROR_PROCESS_COUNTS"  # jm.distributed.ENV_PROCESS_COUNTS
_OPTIONS_WITH_VALUE = (
    "--processes",
    "--min-processes",
    "--devices-per-process",
    "--max-restarts",
    "--grace-period",
    "--compilation-cache",
)
CACHE_OFF = "off"  # --compilation-cache off
# What the processes read (JAX's own configuration variables): the cache, and every step in
# it however small or quick to compile (JAX's defaults keep only steps compiled in 1 s or more).
_CACHE_DIR = "JAX_COMPILATION_CACHE_DIR"
_CACHE_ENABLED = "JAX_ENABLE_COMPILATION_CACHE"
_CACHE_EVERY_STEP = {
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
}

# Runs in each process: the program as `python script.py` / `python -m module` would run it,
# then a failing exit code written to the launcher's pipe before the interpreter exits (and
# waits in JAX's exit hook for the other processes). First, it makes sure that the process
# (and its own children) end when the launcher dies: the kernel's parent-death signal (Linux)
# and a watcher process forked into this process group that SIGKILLs the group once the
# launcher's pipe closes (no thread of this process: a thread would need the GIL to act).
_BOOTSTRAP = """\
import os, runpy, select, signal, sys
def _jmirror_die_with_launcher():
    alive = int(os.environ.pop("JMIRROR_LAUNCH_ALIVE_FD"))
    parent = int(os.environ.pop("JMIRROR_LAUNCH_PID"))
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        except Exception:
            pass
    if os.getppid() != parent:  # the launcher died before the line above
        os._exit(128 + int(signal.SIGKILL))
    read, write = os.pipe()  # closed (end-of-file) when this process ends
    if os.fork() == 0:
        try:
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            keep = sorted({alive, read})
            os.closerange(3, keep[0])
            for low, high in zip(keep, keep[1:] + [65536]):
                os.closerange(low + 1, high)
            for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(number, signal.SIG_IGN)  # it ends with the program or the group
            ready, _, _ = select.select([alive, read], [], [])
            if alive not in ready:  # the program ended; the parent-death signal may come
                ready, _, _ = select.select([alive], [], [], 2.0)  # before the launcher's EOF
            if alive in ready:  # the launcher's end of the pipe is gone: it died
                os.killpg(os.getpgid(0), signal.SIGKILL)
        finally:
            os._exit(0)
    os.close(read)
    os.close(alive)
    return write
def _jmirror_launch_child():
    fd = int(os.environ.pop("JMIRROR_LAUNCH_STATUS_FD"))
    _jmirror_launch_child.alive = _jmirror_die_with_launcher()
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


@dataclass(frozen=True)
class _Options:
    """The launcher's command line, parsed."""

    processes: int
    devices: int
    max_restarts: int
    grace_period: float
    program: list[str]  # ["-m", module, *args] or ["script", path, *args]
    min_processes: int  # --min-processes, P when not given
    compilation_cache: str | None = None  # --compilation-cache: a directory, "off", or None


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
        `--processes P [--min-processes M] [--devices-per-process D] [--max-restarts K]
        [--grace-period S] [--compilation-cache DIR|off] (script.py | -m module) [args]`.

    Returns:
      0 when every process exited with 0; else the first failing process's exit code (128 +
      the signal number for a signal), of the last start when restarts are allowed; 2 for a
      usage error; 128 + the signal number when the launcher was stopped by SIGINT or SIGTERM
      and some process did not exit with 0.

    Example:
      >>> from jmirror.launch import main
      >>> main(["--processes", "1", "-m", "platform"])  # prints the platform, as process 0
      [0] ...
      0
    """
    options = _parse(list(sys.argv[1:] if argv is None else argv))
    if isinstance(options, int):
        return options
    return _Launch(options).run()


def _usage_error(message: str) -> int:
    sys.stderr.write(f"usage: {USAGE}\njmirror.launch: error: {message}\n")
    return 2


def _parse(argv: list[str]) -> _Options | int:
    """Split options from the program; a usage error prints and returns 2."""
    split = _program_start(argv)
    parser = argparse.ArgumentParser(
        prog="python -m jmirror.launch",
        usage=USAGE,
        add_help=True,
        allow_abbrev=False,
        description=(
            "Runs script.py (or -m module) as P local processes joined into one run: each "
            "calls jm.distributed.initialize() first, which reads what the launcher sets in "
            "its environment. Every word after the program belongs to it."
        ),
        epilog=(
            "Each start tells the program how many restarts came before it in "
            "JMIRROR_RESTART ('0' the first time). SIGTERM is forwarded to every process, "
            "which has --grace-period seconds to save and exit. The module's docstring "
            "(python -c 'import jmirror.launch; help(jmirror.launch)') says the rest."
        ),
    )
    parser.add_argument(
        "--processes", type=int, metavar="P", help="how many processes to start (required)"
    )
    parser.add_argument(
        "--min-processes",
        type=int,
        metavar="M",
        help="restart on one process fewer for each lost one, never fewer than M (default: P)",
    )
    parser.add_argument(
        "--devices-per-process",
        type=int,
        default=1,
        metavar="D",
        help="XLA:CPU host devices of each process on the CPU backend (default: 1)",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="K",
        help="when a process fails, stop all and start them again, at most K times (default: 0)",
    )
    parser.add_argument(
        "--grace-period",
        type=float,
        default=GRACE_PERIOD_S,
        metavar="S",
        help=f"seconds processes have to exit after a forwarded SIGTERM (default: "
        f"{GRACE_PERIOD_S:g})",
    )
    parser.add_argument(
        "--compilation-cache",
        metavar="DIR|off",
        help="JAX's persistent compilation cache for the processes, every step included "
        "(default: a JAX_COMPILATION_CACHE_DIR already set, else jmirror/compilation under "
        "$XDG_CACHE_HOME or ~/.cache); 'off' disables it",
    )
    try:
        options = parser.parse_args(argv[:split])
    except SystemExit as exit:  # argparse printed the usage error or the help
        return exit.code if isinstance(exit.code, int) else 2
    program = argv[split:]
    if options.processes is None:
        late = [w for w in program[1:] if w.split("=")[0] in _OPTIONS_WITH_VALUE]
        if late:
            return _usage_error(
                f"the launcher's options must come before the program; {late[0]!r} after "
                f"{' '.join(program[:2] if program[0] == '-m' else program[:1])!r} belongs to "
                "the program, as with python. Write: python -m jmirror.launch --processes P "
                "... script.py [its args]."
            )
        return _usage_error("the following arguments are required: --processes")
    for name, value, minimum in (
        ("--processes", options.processes, 1),
        ("--devices-per-process", options.devices_per_process, 1),
        ("--max-restarts", options.max_restarts, 0),
    ):
        if value < minimum:
            letter = {"--processes": "P", "--devices-per-process": "D"}.get(name, "K")
            return _usage_error(f"{name} expects {letter} >= {minimum}; got {value}.")
    least = options.processes if options.min_processes is None else options.min_processes
    if not 1 <= least <= options.processes:
        return _usage_error(
            f"--min-processes expects M with 1 <= M <= P (--processes {options.processes}); "
            f"got {least}. M is the fewest processes a restart may continue on."
        )
    grace = options.grace_period
    if not grace >= 0 or grace == float("inf"):
        return _usage_error(
            f"--grace-period expects S, a finite number of seconds >= 0; got {grace}."
        )
    cache = options.compilation_cache
    if cache is not None and not cache.strip():
        return _usage_error(
            "--compilation-cache expects a directory or 'off'; got an empty string."
        )
    if not program:
        return _usage_error("expected a script.py or -m module to run; got neither.")
    if program[0] == "-m":
        if len(program) < 2 or not program[1] or program[1].startswith("-"):
            return _usage_error("-m expects a module name, e.g. -m mypackage.train.")
        kind, target, args = "-m", program[1], program[2:]
    elif not os.path.isfile(program[0]):
        return _usage_error(
            f"script {program[0]!r} not found (from {os.getcwd()!r}); give a script.py path "
            "or -m module."
        )
    else:
        kind, target, args = "script", program[0], program[1:]
    return _Options(
        options.processes,
        options.devices_per_process,
        options.max_restarts,
        grace,
        [kind, target, *args],
        least,
        cache,
    )


def _default_compilation_cache() -> str:
    """Returns the launcher's default cache directory: `jmirror/compilation` under the user's
    cache directory (`$XDG_CACHE_HOME`, else `~/.cache`)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jmirror", "compilation")


def _compilation_cache_env(env: dict[str, str], given: str | None) -> None:
    """Sets, in the processes' environment `env`, JAX's persistent compilation cache as
    `--compilation-cache` says (`given`: a directory, "off", or None for the default)."""
    if given == CACHE_OFF:
        env.pop(_CACHE_DIR, None)
        env[_CACHE_ENABLED] = "false"
        return
    if given is not None:
        env[_CACHE_DIR] = os.path.abspath(given)  # the processes may change directory
    elif not env.get(_CACHE_DIR):
        env[_CACHE_DIR] = _default_compilation_cache()
    for name, value in _CACHE_EVERY_STEP.items():
        env.setdefault(name, value)


def _program_start(argv: list[str]) -> int:
    """Index of the first word of the program (`-m`, made so from `-mmodule`), in place."""
    i = 0
    while i < len(argv):
        word = argv[i]
        if word.startswith("-m") and len(word) > 2 and not word.startswith("--"):
            argv[i : i + 1] = ["-m", word[2:]]  # python's attached form, -mmodule
            return i
        if word == "-m" or not word.startswith("-") or word == "-":
            return i
        if word == "--":  # the end of the launcher's options
            del argv[i]
            return i
        i += 2 if word in _OPTIONS_WITH_VALUE else 1
    return len(argv)


# gloo (JAX's CPU collectives) prints "[Gloo] Rank R is connected to N peer ranks. Expected
# number of connected peer ranks is : N" on stdout for every rank of every communicator it
# makes (8 lines and more per run), from several threads at once, so that pieces of two
# reports may share a line. A line made of such pieces only tells the user nothing and is
# left out, unless two counts it can read (a number right after "is connected to" or "is :")
# differ: a rank short of its peers is kept. Pieces of several reports interleaved so that no
# count can be read (digits of two reports run together) are left out too.
_GLOO_PIECE = re.compile(
    r"\[Gloo\] Rank | is connected to | peer ranks\. |Expected number of connected peer "
    r"ranks is : |\d+"
)
_GLOO_COUNTS = (" is connected to ", "Expected number of connected peer ranks is : ")


def _is_gloo_report(line: str) -> bool:
    """Returns whether `line` holds nothing but gloo's reports of fully connected ranks."""
    if "[Gloo] Rank" not in line and " peer ranks" not in line:
        return False
    pieces = _GLOO_PIECE.findall(line)
    if "".join(pieces).strip() != line.strip():
        return False
    counts = {count for piece, count in zip(pieces, pieces[1:]) if piece in _GLOO_COUNTS}
    return len({count for count in counts if count.isdigit()}) <= 1


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _exit_code(returncode: int) -> int:
    """Returns a Popen return code as a shell reports it: 128 + the signal number for a signal."""
    return 128 - returncode if returncode < 0 else returncode


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _describe_failure(process: _Process, code: int) -> str:
    if process.reported is None and code > 128 and process.popen.returncode == 128 - code:
        name = _signal_name(code - 128)
        return f"process {process.index} was killed by {name} (exit code {code})"
    return f"process {process.index} exited with code {code}"


class _Launch:
    """Starts the processes, copies their output line by line and stops them all on failure."""

    def __init__(self, options: _Options) -> None:
        self.options = options
        self.count = options.processes
        self.selector = selectors.DefaultSelector()
        self.processes: list[_Process] = []
        self.first_failure: tuple[_Process, int] | None = None
        self.lost: list[int] = []  # processes that failed before the others were stopped
        self.stop_signal: int | None = None
        self.signals = 0  # how many SIGINT / SIGTERM arrived
        self.kill_at: float | None = None  # when stopping: the time of SIGKILL
        self.killed = False  # SIGKILL sent
        self.restarts = 0
        # The launcher holds the only write end of this pipe: each process's watcher sees
        # end-of-file when the launcher is gone, however it ended.
        self.alive_read, self.alive_write = os.pipe()

    def run(self) -> int:
        previous = self._install_signal_handlers()
        try:
            while True:
                self._start()
                self._supervise()
                self._reap()
                if not self._restart():
                    break
        finally:
            self._stop(signal.SIGKILL)  # only reached early by an error of the launcher
            self._reap()
            self.selector.close()
            os.close(self.alive_read)
            os.close(self.alive_write)
            for handled, handler in previous.items():
                signal.signal(handled, handler)
        return self._result()

    def _restart(self) -> bool:
        """After a failure with restarts left: announce it and reset for a new start."""
        if self.first_failure is None or self.stop_signal is not None:
            return False
        if self.restarts >= self.options.max_restarts:
            return False
        self.restarts += 1
        before, least = self.count, self.options.min_processes
        self.count = max(least, before - len(self.lost))
        counts = (
            f"(restart {self.restarts} of {self.options.max_restarts}, {_RESTART}="
            f"{self.restarts}), JMIRROR_NUM_PROCESSES={self.count}"
        )
        if least == self.options.processes:
            what = "every process"
        else:
            lost = ", ".join(map(str, self.lost))
            what = (
                f"on {self.count} of {before} processes (lost: process"
                f"{'es' if len(self.lost) > 1 else ''} {lost}; --min-processes {least})"
            )
        sys.stderr.write(f"jmirror.launch: restarting {what} {counts}\n")
        sys.stderr.flush()
        self.processes = []
        self.first_failure = None
        self.lost = []
        self.kill_at = None
        self.killed = False
        return True

    def _install_signal_handlers(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous = {}
        for handled in (signal.SIGINT, signal.SIGTERM):
            previous[handled] = signal.signal(handled, self._on_signal)
        return previous

    def _on_signal(self, number: int, frame: object) -> None:
        self.signals += 1
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
                JMIRROR_DEVICES_PER_PROCESS=str(self.options.devices),
                PYTHONUNBUFFERED="1",
            )
            env[_RESTART] = str(self.restarts)
            if self.options.min_processes < self.options.processes:
                env[ENV_PROCESS_COUNTS] = f"{self.options.min_processes}:{self.options.processes}"
            env[_STATUS_FD] = str(write_fd)
            env[_ALIVE_FD] = str(self.alive_read)
            env[_PARENT] = str(os.getpid())
            env.setdefault("JAX_PLATFORMS", "cpu")
            _compilation_cache_env(env, self.options.compilation_cache)
            try:
                popen = subprocess.Popen(
                    [sys.executable, "-c", _BOOTSTRAP, *self.options.program],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    env=env,
                    pass_fds=(write_fd, self.alive_read),
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
                self.kill_at = now + self._grace()
            elif not self.killed and self.kill_at is not None:
                if now >= self.kill_at or self.signals > 1:
                    if any(p.code is None for p in self.processes):
                        self._announce_kill(now >= self.kill_at)
                    self._stop(signal.SIGKILL)
                    self.killed = True
            if all(p.code is not None for p in self.processes):
                drain_until = drain_until or now + _DRAIN_S
                # Children of the processes may hold the pipes open: wait only so long.
                if not self.selector.get_map() or now >= drain_until:
                    break
        for key in list(self.selector.get_map().values()):
            self.selector.unregister(key.fd)
            self._flush(key.data, key.fd)

    def _grace(self) -> float:
        if self.first_failure is None and self.stop_signal == signal.SIGTERM:
            return self.options.grace_period
        return STOP_GRACE_S

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
        out = fd == process.popen.stdout.fileno()
        stream = sys.stdout if out else sys.stderr
        prefix = f"[{process.index}] "
        decoded = (line.decode(errors="replace") for line in lines)
        text = "".join(
            prefix + line + "\n" for line in decoded if not (out and _is_gloo_report(line))
        )
        stream.write(text)
        stream.flush()

    def _poll(self) -> None:
        for process in self.processes:
            if process.code is None and process.popen.poll() is not None:
                process.code = _exit_code(process.popen.returncode)
                if process.code != 0:
                    self._failed(process, process.reported or process.code)

    def _failed(self, process: _Process, code: int) -> None:
        if self.stop_signal is not None:
            return
        if self.kill_at is None and process.index not in self.lost:  # not one we stopped
            self.lost.append(process.index)
        if self.first_failure is None:
            self.first_failure = (process, code)

    def _announce(self) -> None:
        if self.first_failure is not None:
            process, code = self.first_failure
            others = "; stopped the others" if self.count > 1 else ""
            message = _describe_failure(process, code) + others
        else:
            assert self.stop_signal is not None
            name = _signal_name(self.stop_signal)
            if self.stop_signal == signal.SIGTERM:
                grace = self.options.grace_period
                message = (
                    f"received {name}; forwarded it to every process, which have {grace:g} s "
                    "(--grace-period) to save and exit before SIGKILL"
                )
            else:
                message = f"received {name}; stopped every process"
        sys.stderr.write(f"jmirror.launch: {message}\n")
        sys.stderr.flush()

    def _announce_kill(self, late: bool) -> None:
        running = [p.index for p in self.processes if p.code is None]
        if self.first_failure is None and self.stop_signal == signal.SIGTERM:
            why = (
                f"still running {self.options.grace_period:g} s after SIGTERM (--grace-period)"
                if late
                else "still running at a second signal"
            )
            names = ("process " if len(running) == 1 else "processes ") + ", ".join(
                map(str, running)
            )
            sys.stderr.write(f"jmirror.launch: {names} {why}; sent SIGKILL\n")
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
            if self.processes and all(p.code == 0 for p in self.processes):
                return 0
            return 128 + self.stop_signal
        return 0


if __name__ == "__main__":
    sys.exit(main())
