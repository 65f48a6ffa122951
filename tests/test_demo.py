"""Runs `python -m jmirror.demo` in a fresh process (it sets its own host device count).

Its output goes to a pipe, a file and a pseudo-terminal: only the terminal gets rich's progress
bar; a pipe or a file (a log, a notebook) gets plain lines, without carriage returns or escape
sequences.
"""

import os
import re
import subprocess
import sys

import pytest

LAST_LINE = re.compile(r"test accuracy (\d\.\d{4}) \(one device (\d\.\d{4})\)")
EPOCH_LINE = re.compile(
    r"epoch +(\d+)/(\d+) +(\d+) steps +loss \d\.\d{4} +accuracy \d\.\d{4} +[\d,]+ examples/s"
    r"(  \(includes compiling\))?"
)
CONTROL = ("\r", "\x1b")  # what a progress bar writes: carriage returns, ANSI escapes
DEMO = [sys.executable, "-W", "error", "-m", "jmirror.demo"]


def _assert_plain(output: str) -> None:
    for char in CONTROL:
        assert char not in output, f"{char!r} in the demo's output:\n{output!r}"


def _run_demo(*flags: str) -> list[str]:
    """The demo's stdout lines, read through a pipe."""
    result = subprocess.run([*DEMO, *flags], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    _assert_plain(result.stdout)
    return result.stdout.strip().splitlines()


def test_demo_default_config_reaches_95_percent():
    lines = _run_demo()
    assert "8 replicas (pmap)" in lines[0]
    epochs = [line for line in lines if line.startswith("epoch ")]
    assert len(epochs) == 15
    for line in epochs:
        assert EPOCH_LINE.fullmatch(line), line
    assert "-> OK" in lines[-2]
    match = LAST_LINE.fullmatch(lines[-1])
    assert match, lines[-1]
    accuracy, one_device = map(float, match.groups())
    assert accuracy >= 0.95
    assert abs(accuracy - one_device) < 0.005


@pytest.mark.parametrize("backend", ["shard_map"])
def test_demo_flags_and_output_to_a_file(backend, tmp_path):
    log = tmp_path / "demo.log"
    flags = ["--devices", "2", "--epochs", "1", "--backend", backend, "--batch-size", "64"]
    with open(log, "w") as stdout:
        result = subprocess.run([*DEMO, *flags], stdout=stdout, stderr=subprocess.PIPE, timeout=120)
    assert result.returncode == 0, result.stderr
    output = log.read_text()
    _assert_plain(output)
    lines = output.strip().splitlines()
    assert f"2 replicas ({backend}), global batch 64 (32 per replica), 1 epochs" in lines[0]
    match = EPOCH_LINE.fullmatch(lines[1])
    assert match and match.group(3) == "22" and match.group(4), lines[1]
    assert LAST_LINE.fullmatch(lines[-1]), lines[-1]


def _screen(raw: str) -> list[str]:
    """The lines a terminal shows after `raw`: handles \r, \n, cursor up and erase line."""
    lines, row, column = [""], 0, 0
    for token in re.split(r"(\x1b\[[0-9;?]*[A-Za-z]|\r|\n)", raw):
        if token == "\r":
            column = 0
        elif token == "\n":
            row, column = row + 1, 0
            lines += [""] * (row + 1 - len(lines))
        elif token.endswith("A") and token.startswith("\x1b["):
            row = max(0, row - int(token[2:-1] or 1))
        elif token == "\x1b[2K":
            lines[row] = ""
        elif token and not token.startswith("\x1b["):
            line = lines[row].ljust(column)
            lines[row] = line[:column] + token + line[column + len(token) :]
            column += len(token)
    return lines


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_demo_on_a_terminal_draws_a_bar_then_the_same_lines():
    import pty

    controller, terminal = pty.openpty()
    flags = ["--devices", "2", "--epochs", "2", "--batch-size", "64"]
    process = subprocess.Popen([*DEMO, *flags], stdin=terminal, stdout=terminal, stderr=terminal)
    os.close(terminal)
    chunks = []
    while True:
        try:
            chunk = os.read(controller, 1 << 16)
        except OSError:  # EIO: the demo closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(controller)
    assert process.wait(timeout=120) == 0, b"".join(chunks).decode(errors="replace")
    raw = b"".join(chunks).decode()
    assert "\x1b[" in raw and "/22" in raw, raw  # rich drew a bar of the epoch's 22 steps
    lines = [line for line in _screen(raw) if line.strip()]  # rich erased its bars
    assert [bool(EPOCH_LINE.fullmatch(line)) for line in lines[1:3]] == [True, True], lines
    assert LAST_LINE.fullmatch(lines[-1]), lines[-1]


def test_demo_rejects_batch_size_not_divisible_by_devices():
    result = subprocess.run(
        [sys.executable, "-m", "jmirror.demo", "--devices", "3", "--batch-size", "64"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "multiple of --devices" in result.stderr
