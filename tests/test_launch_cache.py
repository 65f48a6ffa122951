"""`python -m jmirror.launch --compilation-cache DIR|off`: compiled steps survive a restart.

The environment the launcher gives its processes is checked in both device passes; the tests
that start processes run once, in the 8-device pass: each process makes the first call of a
step, fails, is restarted by the launcher and makes it again, counting with JAX's monitoring
events what XLA compiled during the call and what the persistent cache gave back (the time it
saves is a benchmark's: benchmarks/restart_cache_bench.py). With several processes on XLA:CPU
each process finds its own entries (JAX alone writes only process 0's, and the others' keys
differ).
"""

import os
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "multiprocess"))
import harness  # noqa: E402

from jmirror import launch  # noqa: E402

starts_processes = pytest.mark.skipif(
    os.environ.get("JMIRROR_TEST_DEVICES", "8") != "8",
    reason="starts processes: runs once, in the 8-device pass",
)
RUN_S = 240  # two starts of a JAX process, compiling, on two busy CI cores

kill_leftover_launchers = harness.kill_leftover_launchers  # every launcher, after each test

WORKER = Path(__file__).parent / "multiprocess" / "compile_worker.py"


def _env(argv, environ=None):
    """The environment the launcher gives its processes for the command line `argv`."""
    options = launch._parse([*argv, "-m", "mod"])
    env = dict(environ or {})
    launch._compilation_cache_env(env, options.compilation_cache)
    return env


def test_the_cache_is_on_by_default_under_the_users_cache_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    env = _env(["--processes", "2"])
    assert env["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / "jmirror" / "compilation")
    assert env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0"
    assert env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] == "-1"
    monkeypatch.delenv("XDG_CACHE_HOME")
    home = os.path.expanduser("~")
    expected = os.path.join(home, ".cache", "jmirror", "compilation")
    assert _env(["--processes", "2"])["JAX_COMPILATION_CACHE_DIR"] == expected


def test_a_directory_given_wins_and_off_disables_it(tmp_path):
    mine = {"JAX_COMPILATION_CACHE_DIR": "/elsewhere"}
    assert _env(["--processes", "1"], mine)["JAX_COMPILATION_CACHE_DIR"] == "/elsewhere"
    given = _env(["--processes", "1", "--compilation-cache", str(tmp_path)], mine)
    assert given["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path)
    off = _env(["--processes", "1", "--compilation-cache", "off"], mine)
    assert "JAX_COMPILATION_CACHE_DIR" not in off
    assert off["JAX_ENABLE_COMPILATION_CACHE"] == "false"


def _first_calls(
    tmp_path, cache: str, processes: int = 1, resume: bool = False
) -> dict[tuple[str, str], tuple[int, int]]:
    """The programs compiled and found in the cache during the first call, by (restart,
    process) (`("0", "1")`: the cold start's process 1), of a run with `cache` (`resume`: the
    restart's state restored from the cold start's checkpoint)."""
    checkpoint = [str(tmp_path / "checkpoint")] if resume else []
    run = harness.launch(
        [
            *("--processes", str(processes), "--devices-per-process", str(2 // processes)),
            *("--max-restarts", "1", "--compilation-cache", cache, str(WORKER), *checkpoint),
        ],
        tmp_path,
        f"cache-{os.path.basename(cache)}",
        cwd=tmp_path,
    )
    code, _ = run.wait(RUN_S)
    assert code == 0, run.output()
    pattern = r"first call restart (\d) process (\d) .* compiled (\d+) found (\d+)"
    found = {
        (restart, i): (int(compiled), int(hits))
        for restart, i, compiled, hits in re.findall(pattern, run.output())
    }
    expected = [(r, str(i)) for r in "01" for i in range(processes)]
    assert sorted(found) == expected, run.output()
    return found


@starts_processes
def test_a_restart_finds_its_steps_compiled(tmp_path):
    # Resumed from the cold start's checkpoint, as a training run resumes: the restored
    # TrainState must give the programs the cold start compiled.
    first = _first_calls(tmp_path, str(tmp_path / "cache"), resume=True)
    assert (tmp_path / "checkpoint").is_dir()
    assert any((tmp_path / "cache").iterdir())  # the steps, written by the cold start
    compiled, found = first["0", "0"]
    assert compiled >= 1 and found == 0, first
    assert first["1", "0"] == (0, compiled), first  # every program the cold start compiled


@starts_processes
def test_every_process_of_a_restart_finds_its_steps_compiled(tmp_path):
    first = _first_calls(tmp_path, str(tmp_path / "cache"), processes=2, resume=True)
    for process in "01":
        compiled, found = first["0", process]
        assert compiled >= 1 and found == 0, (process, first)
        assert first["1", process] == (0, compiled), (process, first)


@starts_processes
def test_with_the_cache_off_a_restart_compiles_again(tmp_path):
    first = _first_calls(tmp_path, "off")
    assert first["1", "0"] == first["0", "0"], first
    compiled, found = first["1", "0"]
    assert compiled >= 1 and found == 0, first
