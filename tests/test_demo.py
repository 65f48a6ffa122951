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


@pytest.mark.once
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


@pytest.mark.once
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


@pytest.mark.once
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
    epochs = [line for line in lines if line.startswith("epoch ")]
    assert [bool(EPOCH_LINE.fullmatch(line)) for line in epochs] == [True, True], lines
    assert LAST_LINE.fullmatch(lines[-1]), lines[-1]


@pytest.mark.once
def test_demo_rejects_batch_size_not_divisible_by_devices():
    result = subprocess.run(
        [sys.executable, "-m", "jmirror.demo", "--devices", "3", "--batch-size", "64"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "multiple of --devices" in result.stderr


# --- under the launcher: 2 processes x 4 host devices ----------------------------------------

LAUNCH = [sys.executable, "-m", "jmirror.launch", "--processes", "2", "--devices-per-process"]
LAUNCH += ["4", "-m", "jmirror.demo"]


def _launch_demo(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([*LAUNCH, *flags], capture_output=True, text=True, timeout=180)


def _process_lines(output: str, index: int) -> list[str]:
    """The lines process `index` printed, without the launcher's prefix and gloo's chatter.

    Gloo reports each connection ("[Gloo] Rank 0 is connected to 7 peer ranks. ...") in
    pieces from several threads, so a piece may stand on a line of its own.
    """
    prefix = f"[{index}] "
    return [
        line[len(prefix) :]
        for line in output.splitlines()
        if line.startswith(prefix)
        and "[Gloo]" not in line
        and "peer ranks" not in line
        and not _GLOO_PIECE.fullmatch(line[len(prefix) :])
    ]


# A piece of gloo's connection report on a line of its own, such as the peer count "7".
_GLOO_PIECE = re.compile(r"[\d\s:.]*")


@pytest.mark.once
def test_demo_under_the_launcher_matches_one_process_and_resumes(tmp_path):
    flags = ["--epochs", "2", "--checkpoint-dir", str(tmp_path)]
    first = _launch_demo(*flags)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    _assert_plain(first.stdout)
    lines = _process_lines(first.stdout, 0)
    assert "8 replicas (pmap) on 2 processes, global batch 128 (16 per replica)" in lines[0]
    epochs = [line for line in lines if line.startswith("epoch ")]
    assert [bool(EPOCH_LINE.fullmatch(line)) for line in epochs] == [True, True], lines
    assert "on process 0's cpu:0" in lines[-2] and "-> OK" in lines[-2], lines
    assert _process_lines(first.stdout, 1) == []  # only process 0 prints
    # The launched run saved after each epoch; a longer launched run resumes from epoch 2.
    second = _launch_demo("--epochs", "3", "--checkpoint-dir", str(tmp_path))
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    lines = _process_lines(second.stdout, 0)
    assert lines[1].startswith("resuming after epoch 2 from"), lines
    one_process = _run_demo("--epochs", "3")
    assert LAST_LINE.fullmatch(lines[-1]), lines
    assert lines[-1] == one_process[-1]  # same test accuracy, same one-device figure


@pytest.mark.once
def test_demo_under_the_launcher_refuses_devices():
    result = _launch_demo("--devices", "8")
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert "[0] python -m jmirror.demo: error: --devices 8 does not apply" in result.stderr
    assert "--devices-per-process" in result.stderr
