"""Runs `python -m jmirror.demo` in a fresh process (it sets its own host device count)."""

import re
import subprocess
import sys

import pytest

LAST_LINE = re.compile(r"test accuracy (\d\.\d{4}) \(one device (\d\.\d{4})\)")


def _run_demo(*flags: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-W", "error", "-m", "jmirror.demo", *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.strip().splitlines()


def test_demo_default_config_reaches_95_percent():
    lines = _run_demo()
    assert "8 replicas (pmap)" in lines[0]
    assert sum(line.startswith("epoch ") for line in lines) == 15
    assert "-> OK" in lines[-2]
    match = LAST_LINE.fullmatch(lines[-1])
    assert match, lines[-1]
    accuracy, one_device = map(float, match.groups())
    assert accuracy >= 0.95
    assert abs(accuracy - one_device) < 0.005


@pytest.mark.parametrize("backend", ["shard_map"])
def test_demo_flags(backend):
    lines = _run_demo("--devices", "2", "--epochs", "1", "--backend", backend, "--batch-size", "64")
    assert f"2 replicas ({backend}), global batch 64 (32 per replica), 1 epochs" in lines[0]
    assert re.search(
        r"epoch +1/1 \[#+\] +22/22 +loss \d\.\d{4} +accuracy \d\.\d{4} +[\d,]+ "
        r"examples/s",
        lines[1],
    ), lines[1]
    assert LAST_LINE.fullmatch(lines[-1]), lines[-1]


def test_demo_rejects_batch_size_not_divisible_by_devices():
    result = subprocess.run(
        [sys.executable, "-m", "jmirror.demo", "--devices", "3", "--batch-size", "64"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "multiple of --devices" in result.stderr
