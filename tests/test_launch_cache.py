"""`python -m jmirror.launch --compilation-cache DIR|off`: compiled steps survive a restart.

The environment the launcher gives its processes is checked in both device passes; the test
that starts processes runs once, in the 8-device pass: a JAX process of 2 host devices times
the first call of a step that takes long to compile, fails, is restarted by the launcher and
times it again. (One process: on XLA:CPU, JAX writes the cache from process 0 only and keys
its entries by each process's own devices, so the others compile again; see the README.)
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


def _first_calls(tmp_path, cache: str) -> dict[str, float]:
    """The first call's CPU seconds by restart (`"0"`, `"1"`) of a run with `cache`: the
    process's own work, which other jobs on a loaded machine do not stretch as they stretch
    wall time (benchmarks/restart_cache_bench.py gives both)."""
    run = harness.launch(
        [
            *("--processes", "1", "--devices-per-process", "2", "--max-restarts", "1"),
            *("--compilation-cache", cache, str(WORKER)),
        ],
        tmp_path,
        f"cache-{os.path.basename(cache)}",
        cwd=tmp_path,
    )
    code, _ = run.wait(RUN_S)
    assert code == 0, run.output()
    pattern = r"first call restart (\d) process 0 [\d.]+ cpu ([\d.]+)"
    found = dict(re.findall(pattern, run.output()))
    assert sorted(found) == ["0", "1"], run.output()
    return {restart: float(seconds) for restart, seconds in found.items()}


@starts_processes
def test_a_restart_finds_its_steps_compiled(tmp_path):
    first = _first_calls(tmp_path, str(tmp_path / "cache"))
    assert any((tmp_path / "cache").iterdir())  # the steps, written by the cold start
    assert first["1"] <= 0.3 * first["0"], first


@starts_processes
def test_with_the_cache_off_a_restart_compiles_again(tmp_path):
    first = _first_calls(tmp_path, "off")
    assert first["1"] > 0.5 * first["0"], first
