"""Checkpoint faults: nothing lost at exit, damage detected, leaves
checked before writing, I/O errors as `OSError`, PRNG keys and flax NNX objects.

Each case damages real files on disk, fills a real (tmpfs) disk or ends a real interpreter.
The tests that start processes run in the suite's 8-device pass only.
"""

import errno
import gc
import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import zlib

import google_crc32c
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jmirror as jm
from jmirror.checkpoint import _integrity

CHILD_TIMEOUT_S = 120


def run_child(code, *args, timeout=CHILD_TIMEOUT_S, wrap=()):
    return subprocess.run(
        [*wrap, sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def is_mirrored(x, strategy):
    return isinstance(x, jax.Array) and x.sharding.device_set == set(strategy.devices)


# --- nothing lost at exit ----------------------------------------------------------------------

EXIT_CHILD = """
import sys
import numpy as np
import jmirror as jm

directory, how = sys.argv[1], sys.argv[2]
manager = jm.checkpoint.CheckpointManager(directory)
# 16 MiB: the background write is still going when the script ends.
state = {"w": [np.full((1024, 1024), i, np.float32) for i in range(4)], "step": 1}
manager.save(1, state, data={"step": 1})
print("saved", flush=True)
if how == "sys.exit":
    sys.exit(0)
if how == "exception":
    raise RuntimeError("the training loop failed")
if how == "dropped":
    del manager
"""


@pytest.mark.once
@pytest.mark.parametrize("how", ["end", "sys.exit", "exception", "dropped"])
def test_a_pending_async_save_completes_at_every_interpreter_exit(tmp_path, how):
    # One run per exit path here (it ran 3 times per path, 16 in the hunt, while built).
    directory = tmp_path / "state"
    child = run_child(EXIT_CHILD, directory, how)
    assert child.returncode == (1 if how == "exception" else 0), child.stderr
    assert "saved" in child.stdout
    if how == "exception":
        assert "the training loop failed" in child.stderr
    strategy = jm.MirroredStrategy(num_devices=1)
    with jm.checkpoint.CheckpointManager(directory, strategy=strategy) as manager:
        assert manager.all_steps() == [1], (how, child.stderr)
        out = manager.restore()
        assert manager.data() == {"step": 1} and out["step"] == 1
        for i, w in enumerate(out["w"]):
            np.testing.assert_array_equal(w, np.full((1024, 1024), i, np.float32))


FAILING_EXIT_CHILD = """
import errno, sys, time
import numpy as np
import jmirror as jm
from jmirror.checkpoint import _storage

def full(*args, **kwargs):  # the disk fills up while the step is written
    time.sleep(0.2)
    raise OSError(errno.ENOSPC, "No space left on device")

manager = jm.checkpoint.CheckpointManager(sys.argv[1])
manager.save(1, {"w": np.ones(3)})
manager.wait_until_finished()
_storage._orbax_save = full
manager.save(2, {"w": np.ones(3)})
print("saved", flush=True)
"""


@pytest.mark.once
def test_a_save_that_fails_at_exit_is_printed_and_the_exit_status_is_1(tmp_path):
    child = run_child(FAILING_EXIT_CHILD, tmp_path)
    assert child.returncode == 1, (child.stdout, child.stderr)
    assert "saved" in child.stdout
    assert "the background save of step 2 did not complete" in child.stderr
    assert "No space left on device" in child.stderr and "OSError" in child.stderr
    with jm.checkpoint.CheckpointManager(tmp_path) as manager:
        assert manager.all_steps() == [1]
        np.testing.assert_array_equal(manager.restore()["w"], np.ones(3))


# --- a real full and a real read-only disk: tmpfs mounts in a user namespace ------------------


def _namespace_mount(tmp_path, options):
    """A command prefix that runs a child with a tmpfs of `options` mounted at tmp_path/mnt.

    `unshare --user --map-root-user --mount` gives the child its own mount namespace, where
    an unprivileged user may mount a tmpfs; skipped where user namespaces are disabled.
    """
    mount_point = tmp_path / "mnt"
    mount_point.mkdir()
    unshare = shutil.which("unshare")
    mount = f"mount -t tmpfs -o {options} tmpfs {mount_point}"
    if unshare is None:
        pytest.skip("needs unshare (util-linux) to mount a small tmpfs")
    probe = subprocess.run(
        [unshare, "-r", "-m", "sh", "-c", mount], capture_output=True, text=True, timeout=30
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {probe.stderr.strip()}")
    return mount_point, [unshare, "-r", "-m", "sh", "-c", f'{mount} && exec "$0" "$@"']


DISK_CHILD = """
import errno, os, sys
import numpy as np
import jmirror as jm

directory, how = sys.argv[1], sys.argv[2]
big = {"w": np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)}  # 4 MiB
small = {"w": np.arange(8.0)}

def report(error):
    print("OSError", errno.errorcode[error.errno], error.filename, "|", error, flush=True)

if how == "sync":
    try:
        jm.checkpoint.save(directory + "/ckpt", big)
    except OSError as error:
        report(error)
elif how == "async":
    manager = jm.checkpoint.CheckpointManager(directory, async_save=True)
    manager.save(1, small)
    manager.save(2, big)  # returns; the write fails in the background
    try:
        manager.all_steps()
    except OSError as error:
        report(error)
    print("steps", manager.all_steps(), flush=True)
    np.testing.assert_array_equal(manager.restore(1)["w"], small["w"])
    manager.close()
elif how == "readonly":
    for call in (
        lambda: jm.checkpoint.save(directory + "/ckpt", small),
        lambda: jm.checkpoint.CheckpointManager(directory + "/series"),
    ):
        try:
            call()
        except OSError as error:
            report(error)
print("left", sorted(os.listdir(directory)), flush=True)
from absl import logging as absl_logging

absl_logging.error("the program's own error")  # still shown
"""


@pytest.mark.once
@pytest.mark.parametrize("how", ["sync", "async"])
def test_a_full_disk_is_an_oserror_naming_the_directory_and_leaves_no_partial_step(tmp_path, how):
    mount_point, wrap = _namespace_mount(tmp_path, "size=1m")
    child = run_child(DISK_CHILD, mount_point, how, wrap=wrap)
    assert child.returncode == 0, child.stderr
    lines = child.stdout.splitlines()
    error = next(line for line in lines if line.startswith("OSError"))
    assert error.startswith(f"OSError ENOSPC {mount_point} |"), error
    assert "No space left on device" in error and "RESOURCE_EXHAUSTED" not in error
    if how == "async":
        assert "steps [1]" in lines
    expected = "left ['1']" if how == "async" else "left []"
    assert expected in lines, lines  # nothing partial, not even a hidden directory
    # orbax's threads logged the error with a traceback each (4 blocks): the OSError says it.
    assert "ERROR:absl" not in child.stderr.replace("ERROR:absl:the program's own error", "")
    assert "Traceback" not in child.stderr and "RESOURCE_EXHAUSTED" not in child.stderr
    assert "the program's own error" in child.stderr, child.stderr


def test_only_orbax_errors_about_jmirror_s_own_writes_are_dropped_while_it_writes(caplog):
    from absl import logging as absl_logging

    from jmirror.checkpoint import _storage

    def orbax_error(message):  # a record as orbax's code logs it
        record = logging.LogRecord(
            "absl", logging.ERROR, "/x/orbax/checkpoint/f.py", 1, message, None, None
        )
        logging.getLogger("absl").handle(record)

    ours = "Failed writing: /d/.ckpt.jmirror-new-0123/state: No space left on device"
    with caplog.at_level(logging.INFO), _storage._quiet_orbax_errors():
        orbax_error(ours)
        orbax_error("Failed writing: /d/someone-elses/state: No space left on device")
        absl_logging.error("the program's own error about %s", ours)
    orbax_error(ours)  # after the write: shown
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "Failed writing: /d/someone-elses/state: No space left on device",
        f"the program's own error about {ours}",
        ours,
    ]
    assert not logging.getLogger("absl").filters


@pytest.mark.once
def test_a_read_only_directory_is_an_oserror_raised_by_the_call(tmp_path):
    mount_point, wrap = _namespace_mount(tmp_path, "ro,size=1m")
    child = run_child(DISK_CHILD, mount_point, "readonly", wrap=wrap)
    assert child.returncode == 0, child.stderr
    errors = [line for line in child.stdout.splitlines() if line.startswith("OSError")]
    assert len(errors) == 2, child.stdout
    for error in errors:
        assert error.startswith("OSError EROFS"), error
        assert "Read-only file system" in error and str(mount_point) in error


def test_a_read_only_directory_fails_an_async_save_in_the_call(tmp_path, monkeypatch):
    manager = jm.checkpoint.CheckpointManager(tmp_path)
    manager.save(1, {"w": np.ones(2)})
    manager.wait_until_finished()
    read_only = os.statvfs_result((0,) * 8 + (os.ST_RDONLY, 255))
    monkeypatch.setattr(os, "statvfs", lambda path: read_only)
    with pytest.raises(OSError) as info:
        manager.save(2, {"w": np.ones(2)})  # raised by the call, not by a later one
    assert info.value.errno == errno.EROFS and str(tmp_path) in str(info.value)
    monkeypatch.undo()
    assert manager.all_steps() == [1]
    manager.close()


FAILED_SAVE_CHILD = """
import sys
import numpy as np
import jmirror as jm

try:
    w = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)
    jm.checkpoint.save(sys.argv[1] + "/ckpt", {"w": w})
except OSError as error:
    print("caught", error.errno, flush=True)
"""


@pytest.mark.once
def test_a_caught_failed_save_never_keeps_the_process_from_exiting(tmp_path):
    # orbax's threads of the failed save may wait for signals that never come.
    mount_point, wrap = _namespace_mount(tmp_path, "size=512k")
    children = [
        subprocess.Popen(
            [*wrap, sys.executable, "-c", FAILED_SAVE_CHILD, str(mount_point)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    try:
        for child in children:
            try:
                out, err = child.communicate(timeout=90)
            except subprocess.TimeoutExpired:
                pytest.fail("a process whose save failed did not exit within 90 s")
            assert child.returncode == 0 and f"caught {errno.ENOSPC}" in out, (out, err)
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
            child.communicate()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax's loop
def test_orbax_threads_left_by_a_failed_save_are_daemons(tmp_path, monkeypatch):
    # A non-daemon thread waiting for a signal of a failed save is joined at exit, for as long
    # as orbax's timeout: every thread orbax starts for jmirror must be a daemon.
    from jmirror.checkpoint import _checkpoint, _encode

    monkeypatch.setattr(_encode, "check_leaf", lambda *args, **kwargs: None, raising=False)
    monkeypatch.setattr(_checkpoint, "_check_restorable", lambda doc: None)  # let orbax see it
    started = []
    start = threading.Thread.start

    def record(thread):
        started.append(thread)
        start(thread)

    jax.devices()  # JAX's backend starts a timer thread of its own
    monkeypatch.setattr(threading.Thread, "start", record)
    with pytest.raises(Exception, match="data type"):  # orbax refuses the leaf itself
        jm.checkpoint.save(tmp_path / "c", {"w": np.ones(3), "s": np.array(["adam"])})
    monkeypatch.setattr(threading.Thread, "start", start)
    for thread in started:  # let the failed save's leftovers end inside this test
        threading.Thread.join(thread, timeout=10)  # orbax's join would re-raise
    gc.collect()  # orbax's closed event loops are collected here, not in a later test
    # concurrent.futures' workers are joined at exit only once idle, not when stuck waiting.
    waiting = [
        t.name
        for t in started
        if not t.daemon and not t.name.startswith("asyncio_") and type(t) is not threading.Timer
    ]
    assert len(started) > 2 and waiting == [], [t.name for t in started]
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == []


# --- integrity: damage real files -------------------------------------------------------------


def _state(strategy):
    rng = np.random.default_rng(7)
    return {
        "params": {"w": strategy.mirror(rng.standard_normal((512, 512)).astype(np.float32))},
        "b": np.arange(5.0),
        "n": 3,
    }


def _series(tmp_path, strategy):
    """A manager directory with steps 1, 2 and 3 (values differ by step)."""
    with jm.checkpoint.CheckpointManager(tmp_path, strategy=strategy) as manager:
        for step in (1, 2, 3):
            state = _state(strategy)
            state["b"] = state["b"] + step
            manager.save(step, state, data={"step": step})
    return tmp_path


def _largest(path):
    return max((f for f in path.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)


def _flip_bit(file):
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x04
    file.write_bytes(bytes(data))


DAMAGE = {
    "flip a bit in the largest file": lambda p: _flip_bit(_largest(p)),
    "truncate the largest file": lambda p: os.truncate(
        _largest(p), _largest(p).stat().st_size // 2
    ),
    "empty the largest file": lambda p: os.truncate(_largest(p), 0),
    "delete the largest file": lambda p: _largest(p).unlink(),
    "garble state/_METADATA as json": lambda p: (p / "state" / "_METADATA").write_text('{"tree": '),
    "garble state/_METADATA as utf-8": lambda p: (p / "state" / "_METADATA").write_bytes(
        b"\xff\xfe"
    ),
    "delete state/_METADATA": lambda p: (p / "state" / "_METADATA").unlink(),
    "delete state/manifest.ocdbt": lambda p: (p / "state" / "manifest.ocdbt").unlink(),
    "flip a bit in state/manifest.ocdbt": lambda p: _flip_bit(p / "state" / "manifest.ocdbt"),
    "garble jmirror/metadata": lambda p: (p / "jmirror" / "metadata").write_text("{[}"),
    "delete jmirror/metadata": lambda p: (p / "jmirror" / "metadata").unlink(),
    "delete _CHECKPOINT_METADATA": lambda p: (p / "_CHECKPOINT_METADATA").unlink(),
    "garble the file list": lambda p: (p / _integrity.FILES).write_text("{"),
    "delete the file list": lambda p: (p / _integrity.FILES).unlink(),
}


def _damaged_name(path, damage):
    """The file the damage hits, as the message should name it."""
    if "largest" in damage:
        return _largest(path).relative_to(path).as_posix()
    if "file list" in damage:
        return _integrity.FILES
    return damage.split()[-1] if "as " not in damage else "state/_METADATA"


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_newest_step_is_refused_naming_step_file_and_complete_step(
    strategy, tmp_path, damage
):
    _series(tmp_path, strategy)
    step3 = tmp_path / "3"
    name = _damaged_name(step3, damage)
    DAMAGE[damage](step3)
    with jm.checkpoint.CheckpointManager(tmp_path, strategy=strategy) as manager:
        for call in (manager.restore, manager.data):
            with pytest.raises(jm.checkpoint.CorruptCheckpointError) as info:
                call()  # no step: the newest, never skipped silently
            message = str(info.value)
            assert f"step 3 of {tmp_path}" in message and name in message, message
            assert "step 2 is complete" in message and "[1, 2, 3]" in message, message
            assert "TensorStore details" not in message and len(message) < 1200, message
        out = manager.restore(2)  # the fix works
        np.testing.assert_array_equal(out["b"], np.arange(5.0) + 2)
        assert manager.data(2) == {"step": 2}
    with pytest.raises(ValueError, match="step 3"):  # a ValueError for those who catch that
        jm.checkpoint.restore(step3, strategy=strategy)


def _rewrite_file_list(path):
    """Makes the file list agree with damaged files: only the layer below can tell."""
    saved = json.loads((path / _integrity.FILES).read_text())["arrays"]
    (path / _integrity.FILES).unlink()
    _integrity.write_file_list(path, saved)


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_damage_the_file_list_cannot_see_is_named_by_leaf_path(strategy, tmp_path, damage):
    jm.checkpoint.save(tmp_path / "c", _state(strategy), strategy=strategy)
    file = _largest(tmp_path / "c" / "state")
    {
        "flip": _flip_bit,
        "truncate": lambda f: os.truncate(f, 100),
        "empty": lambda f: os.truncate(f, 0),
    }[damage](file)
    _rewrite_file_list(tmp_path / "c")
    with pytest.raises(jm.checkpoint.CorruptCheckpointError) as info:
        jm.checkpoint.restore(tmp_path / "c", strategy=strategy)
    message = str(info.value)
    assert "['params']['w']" in message and "Restore another checkpoint" in message, message
    assert "TensorStore details" not in message


def test_two_damaged_steps_name_the_newest_complete_one(strategy, tmp_path):
    _series(tmp_path, strategy)
    _flip_bit(_largest(tmp_path / "3" / "state"))
    (tmp_path / "2" / "jmirror" / "metadata").unlink()
    with jm.checkpoint.CheckpointManager(tmp_path, strategy=strategy) as manager:
        with pytest.raises(jm.checkpoint.CorruptCheckpointError, match="step 1 is complete"):
            manager.restore()
        (tmp_path / "1" / "state" / "_METADATA").unlink()
        with pytest.raises(jm.checkpoint.CorruptCheckpointError, match="No other saved step"):
            manager.restore()


def test_every_array_is_written_with_its_checksum(strategy, tmp_path):
    state = _state(strategy)
    jm.checkpoint.save(tmp_path / "c", state, strategy=strategy)
    doc = json.loads((tmp_path / "c" / "jmirror" / "metadata").read_text())
    listed = json.loads((tmp_path / "c" / _integrity.FILES).read_text())
    assert doc["version"] == 3 and sorted(listed["arrays"]) == sorted(doc["arrays"]) != []
    assert listed["checksum"] == "crc32c"
    values = [np.asarray(state["params"]["w"]), state["b"], np.asarray(3)]
    # Oracle: google-crc32c's own Python call of each 4 MiB piece's bytes.
    pieces = [np.ascontiguousarray(v).tobytes() for v in values]
    expected = sorted(
        [google_crc32c.value(b[i : i + (4 << 20)]) for i in range(0, max(len(b), 1), 4 << 20)]
        for b in pieces
    )
    assert sorted(listed["arrays"].values()) == expected
    small = next(e for e in listed["files"].values() if "crc32c" in e)
    assert "crc32" not in small
    files = {p.relative_to(tmp_path / "c").as_posix() for p in (tmp_path / "c").rglob("*")}
    assert set(listed["files"]) == {f for f in files if (tmp_path / "c" / f).is_file()} - {
        _integrity.FILES
    }


@pytest.mark.parametrize("which", ["the first piece", "a middle piece", "the last byte"])
def test_verification_over_threads_finds_a_flipped_bit_in_any_piece_of_a_large_array(
    strategy, tmp_path, monkeypatch, which
):
    # Restore verifies over a few threads, a large array cut into pieces (a serial
    # CRC pass was 9-13 ms of a 50 MiB restore). The bit is flipped in the values as
    # read (as a damaged file that still decodes gives them), so only the checksum sees it.
    big = np.random.default_rng(3).standard_normal((3 << 20) // 2).astype(np.float32)  # 6 MiB
    state = {"big": strategy.mirror(big), "small": np.arange(3.0), "empty": np.zeros((0, 2))}
    jm.checkpoint.save(tmp_path / "c", state, strategy=strategy)
    np.testing.assert_array_equal(strategy.read(jm.checkpoint.restore(tmp_path / "c")["big"]), big)
    from jmirror.checkpoint import _storage

    read = _storage.read_arrays
    at = {"the first piece": 5, "a middle piece": (5 << 20) + 3, "the last byte": big.nbytes - 1}

    def flipped(*args):
        arrays = read(*args)
        name = max(arrays, key=lambda k: arrays[k].nbytes)
        arrays[name] = arrays[name].copy()  # orbax's are read-only views
        arrays[name].reshape(-1).view(np.uint8)[at[which]] ^= 0x10
        return arrays

    monkeypatch.setattr(_storage, "read_arrays", flipped)
    with pytest.raises(
        jm.checkpoint.CorruptCheckpointError, match=r"the leaf \"\['big'\]\" \(array"
    ):
        jm.checkpoint.restore(tmp_path / "c", strategy=strategy)
    crc = [t for t in threading.enumerate() if t.name.startswith("jmirror-checkpoint-crc")]
    assert crc == []  # the verification's threads are joined


def test_crc32c_checksums_of_pieces_equal_one_pass_and_run_on_several_threads(monkeypatch):
    rng = np.random.default_rng(0)
    arrays = {
        "large": rng.standard_normal(5 << 20).astype(np.float32),  # 20 MiB: five pieces
        "odd": rng.integers(0, 9, (3, 1_000_001)).astype(np.int8),
        "bool": np.ones(7, bool),
        "empty": np.zeros((0, 4), np.float64),
        "strided": rng.standard_normal((64, 64))[:, ::2],
    }
    names = set()
    real = _integrity._CRC32C

    def crc32c(data):
        names.add(threading.current_thread().name)
        # Slow enough that one thread cannot take every piece before the others start.
        time.sleep(0.01)
        return real(data)

    monkeypatch.setattr(_integrity, "_CRC32C", crc32c)
    got = _integrity.array_checksums(arrays)
    monkeypatch.undo()
    piece = _integrity.PIECE
    for name, array in arrays.items():  # oracle: google-crc32c's Python call, piece by piece
        data = np.ascontiguousarray(array).tobytes()
        pieces = [data[i : i + piece] for i in range(0, max(len(data), 1), piece)]
        assert got[name] == [google_crc32c.value(p) for p in pieces], name
    assert len(got["large"]) == 5 and got["empty"] == [0]
    if len(os.sched_getaffinity(0)) > 1:
        assert len({n for n in names if n.startswith("jmirror-checkpoint-crc")}) > 1, names
    assert not [t for t in threading.enumerate() if t.name.startswith("jmirror-checkpoint-crc")]


def test_parallel_checksums_equal_one_pass_and_run_on_several_threads(monkeypatch):
    # The CRC-32 of format version 2 checkpoints, verified over threads.
    rng = np.random.default_rng(0)
    arrays = {
        "large": rng.standard_normal(5 << 20).astype(np.float32),  # 20 MiB: five pieces
        "odd": rng.integers(0, 9, (3, 1_000_001)).astype(np.int8),
        "bool": np.ones(7, bool),
        "empty": np.zeros((0, 4), np.float64),
        "strided": rng.standard_normal((64, 64))[:, ::2],
    }
    names = set()
    real = zlib.crc32

    def crc32(data, *start):
        names.add(threading.current_thread().name)
        return real(data, *start)

    monkeypatch.setattr(_integrity.zlib, "crc32", crc32)
    got = _integrity.parallel_checksums(arrays)
    monkeypatch.undo()
    assert got == {name: _integrity.checksum(a) for name, a in arrays.items()}
    if len(os.sched_getaffinity(0)) > 1:
        assert len({n for n in names if n.startswith("jmirror-checkpoint-crc")}) > 1, names
    assert not [t for t in threading.enumerate() if t.name.startswith("jmirror-checkpoint-crc")]


# --- leaves (C2) --------------------------------------------------------------------------------


def test_zero_size_leaves_save_and_restore_with_their_shapes(strategy, n, tmp_path):
    state = {
        "mirrored": strategy.mirror(np.zeros((0, 3), np.float32)),
        "numpy": np.zeros((2, 0), np.int32),
        "per_replica": jm.PerReplica(np.zeros((n, 0, 2), np.float32)),
        "sum": strategy.sync_on_read(np.zeros((0,), np.float32), "sum"),
        "w": strategy.mirror(np.arange(3.0)),
    }
    for async_save in (False, True):
        directory = tmp_path / str(async_save)
        with jm.checkpoint.CheckpointManager(
            directory, strategy=strategy, async_save=async_save
        ) as m:
            m.save(1, state)
            out = m.restore()
            again = m.restore(target=state)
        for got in (out, again):
            assert got["mirrored"].shape == (0, 3) and is_mirrored(got["mirrored"], strategy)
            assert got["numpy"].shape == (2, 0) and got["numpy"].dtype == np.int32
            assert got["per_replica"].values.shape == (n, 0, 2)
            assert got["sum"].value.shape == (n, 0) and got["sum"].aggregation.value == "sum"
            np.testing.assert_array_equal(got["w"], np.arange(3.0))


def test_zero_size_sync_on_read_nodes_round_trip_as_read(strategy, n, tmp_path):
    # Fully and partly zero-size nodes of every aggregation; oracle: the read before saving.
    readable = {
        "mean": strategy.sync_on_read(np.zeros((0,), np.int32), "mean"),
        "first": strategy.sync_on_read(np.zeros((0, 2), np.float32), "only_first_replica"),
        "mixed": strategy.sync_on_read({"a": np.zeros((0, 3)), "b": np.arange(3.0)}, "sum"),
    }
    state = {**readable, "none": strategy.sync_on_read(np.zeros((0,), np.float32), "none")}
    want = strategy.read(readable)
    jm.checkpoint.save(tmp_path / "c", state, strategy=strategy)
    for target in (None, state):
        out = jm.checkpoint.restore(tmp_path / "c", target, strategy=strategy)
        got = strategy.read({k: out[k] for k in readable})
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert g.shape == w.shape and g.dtype == w.dtype
            np.testing.assert_array_equal(g, w)
        assert out["none"].value.shape == (n, 0) and out["none"].aggregation.value == "none"
        assert out["mean"].value.dtype == np.int32


@pytest.mark.parametrize(
    "leaf, path",
    [
        (np.array(["adam", "sgd"]), "['opt']['name']"),
        (np.array([1, None], dtype=object), "['opt']['name']"),
        (2**70, "['opt']['name']"),
        (-(2**63) - 1, "['opt']['name']"),
        (np.array(["2026-01-01"], dtype="datetime64[D]"), "['opt']['name']"),
    ],
    ids=["str", "object", "2**70", "below-int64", "datetime"],
)
@pytest.mark.parametrize("where", ["save", "manager", "async manager"])
def test_a_leaf_that_cannot_be_stored_is_a_type_error_before_anything_is_written(
    tmp_path, capfd, leaf, path, where
):
    state = {"w": np.ones(3), "opt": {"name": leaf}}
    with pytest.raises(TypeError) as info:
        if where == "save":
            jm.checkpoint.save(tmp_path / "c", state)
        else:
            with jm.checkpoint.CheckpointManager(tmp_path / "m", async_save="async" in where) as m:
                m.save(1, state)
    assert path in str(info.value) and "jm.checkpoint.save" in str(info.value)
    assert not (tmp_path / "c").exists()
    if where != "save":
        assert list((tmp_path / "m").iterdir()) == []
    assert "ERROR:absl" not in capfd.readouterr().err


def test_a_per_replica_str_leaf_is_a_type_error_naming_its_path(n, tmp_path):
    with pytest.raises(TypeError, match=r"\['tokens'\]\.values"):
        jm.checkpoint.save(tmp_path / "c", {"tokens": jm.PerReplica(np.array(["a"] * n))})
    assert not (tmp_path / "c").exists()


def test_a_donated_array_is_a_value_error_naming_its_path(strategy, tmp_path):
    state = {"params": {"w": strategy.mirror(np.ones(4, np.float32))}}

    @jm.replicate(strategy=strategy, donate_argnums=0)
    def step(state):
        return jax.tree.map(lambda x: x + 1, state)

    new = step(state)
    if not state["params"]["w"].is_deleted():
        state["params"]["w"].delete()  # a backend that did not donate: delete it as donation does
    with pytest.raises(ValueError, match=r"\['params'\]\['w'\].*deleted") as info:
        jm.checkpoint.save(tmp_path / "c", state, strategy=strategy)
    assert "donat" in str(info.value)
    assert not (tmp_path / "c").exists()
    jm.checkpoint.save(tmp_path / "c", new, strategy=strategy)  # the returned state saves
    np.testing.assert_array_equal(jm.checkpoint.restore(tmp_path / "c")["params"]["w"], 2.0)


# --- typed PRNG keys and flax NNX ----------------------------------------------------------------


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_typed_prng_keys_round_trip_mirrored_and_per_replica(strategy, n, tmp_path, impl):
    key = jax.random.key(3, impl=impl)
    per_replica = jax.random.split(jax.random.key(4, impl=impl), n)
    state = {"key": strategy.mirror(key), "keys": jm.PerReplica(per_replica)}
    jm.checkpoint.save(tmp_path / "c", state, strategy=strategy)
    for target in (None, state):
        out = jm.checkpoint.restore(tmp_path / "c", target, strategy=strategy)
        assert jax.random.key_impl(out["key"]) == jax.random.key_impl(key)
        assert is_mirrored(out["key"], strategy)
        np.testing.assert_array_equal(jax.random.key_data(out["key"]), jax.random.key_data(key))
        got = np.stack([jax.random.key_data(c) for c in strategy.local_results(out["keys"])])
        np.testing.assert_array_equal(got, jax.random.key_data(per_replica))
        # The restored keys draw what the saved ones draw.
        np.testing.assert_array_equal(
            jax.random.normal(out["key"], (3,)), jax.random.normal(key, (3,))
        )


class Model(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(3, 4, rngs=rngs)
        self.norm = nnx.BatchNorm(4, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.dropout(self.norm(self.linear(x)))


def _nnx_state():
    model = Model(nnx.Rngs(0, dropout=1))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    x = jnp.linspace(-1.0, 1.0, 24).reshape(8, 3)

    def loss(model):
        return jnp.mean(model(x) ** 2)

    for _ in range(2):  # moves the batch statistics, the optimizer state and the rng counter
        grads = nnx.grad(loss)(model)
        optimizer.update(model, grads)
    return model, optimizer


def _abstract_nnx():
    model = nnx.eval_shape(lambda: Model(nnx.Rngs(5, dropout=6)))
    optimizer = nnx.eval_shape(
        lambda: nnx.Optimizer(Model(nnx.Rngs(5, dropout=6)), optax.adam(1e-2), wrt=nnx.Param)
    )
    return model, optimizer


def _values(tree):
    return [
        np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
        for x in jax.tree.leaves(tree)
    ]


def test_nnx_model_and_optimizer_round_trip_with_an_eval_shape_target(strategy, tmp_path):
    model, optimizer = _nnx_state()
    saved = strategy.mirror({"model": model, "optimizer": optimizer})
    jm.checkpoint.save(tmp_path / "c", saved, strategy=strategy)
    abstract_model, abstract_optimizer = _abstract_nnx()
    target = {"model": abstract_model, "optimizer": abstract_optimizer}
    out = jm.checkpoint.restore(tmp_path / "c", target, strategy=strategy)
    assert type(out["model"]) is Model and type(out["optimizer"]) is nnx.Optimizer
    assert type(out["model"].dropout.rngs) is type(model.dropout.rngs)
    for got, want in zip(_values(out), _values({"model": model, "optimizer": optimizer})):
        np.testing.assert_array_equal(got, want)
    for leaf in jax.tree.leaves(out):
        assert is_mirrored(leaf, strategy)  # placed as saved
    assert int(out["optimizer"].step[...]) == 2 and int(out["model"].dropout.rngs.count[...]) == 2
    # The restored model computes what the saved one computes (its dropout draws included).
    x = jnp.ones((2, 3))
    expected = model(x)
    np.testing.assert_array_equal(jax.device_get(out["model"](x)), expected)


def test_nnx_without_target_gives_plain_dicts_of_the_variables_values(strategy, tmp_path):
    model, optimizer = _nnx_state()
    jm.checkpoint.save(tmp_path / "c", {"model": model, "optimizer": optimizer})
    out = jm.checkpoint.restore(tmp_path / "c", strategy=strategy)

    def keys(tree, prefix=""):
        if isinstance(tree, dict):
            for k, v in tree.items():
                yield f"{prefix}/{k}"
                yield from keys(v, f"{prefix}/{k}")
        elif isinstance(tree, (list, tuple)):
            for i, v in enumerate(tree):
                yield from keys(v, f"{prefix}/{i}")

    names = list(keys(out))
    assert not [k for k in names if "_pytree__" in k or k.endswith("/value")], names
    assert set(out["model"]) == {"linear", "norm", "dropout"}
    np.testing.assert_array_equal(out["model"]["linear"]["kernel"], model.linear.kernel[...])
    np.testing.assert_array_equal(out["model"]["norm"]["mean"], model.norm.mean[...])
    key = out["model"]["dropout"]["rngs"]["key"]
    np.testing.assert_array_equal(
        jax.random.key_data(key), jax.random.key_data(model.dropout.rngs.key[...])
    )
    assert int(out["optimizer"]["step"]) == 2
    state = nnx.to_pure_dict(nnx.state(model))  # flax's own plain dict of the same model
    np.testing.assert_array_equal(out["model"]["norm"]["var"], state["norm"]["var"])


def test_an_nnx_checkpoint_that_differs_from_target_names_the_path(strategy, tmp_path):
    model, _ = _nnx_state()
    jm.checkpoint.save(tmp_path / "c", model, strategy=strategy)
    wider = nnx.eval_shape(lambda: nnx.Linear(3, 5, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="target"):
        jm.checkpoint.restore(tmp_path / "c", wider, strategy=strategy)
    assert pathlib.Path(tmp_path / "c").is_dir()


def test_an_old_format_checkpoint_without_checksums_still_restores(strategy, tmp_path):
    state = _state(strategy)
    jm.checkpoint.save(tmp_path / "c", state, strategy=strategy)
    (tmp_path / "c" / _integrity.FILES).unlink()  # what a version 1 save wrote: no list
    doc = tmp_path / "c" / "jmirror" / "metadata"
    doc.write_text(doc.read_text().replace('"version": 3', '"version": 1'))
    out = jm.checkpoint.restore(tmp_path / "c", strategy=strategy)
    np.testing.assert_array_equal(out["params"]["w"], state["params"]["w"])
    doc.write_text(doc.read_text().replace('"version": 1', '"version": 3'))
    with pytest.raises(jm.checkpoint.CorruptCheckpointError, match="file list"):
        jm.checkpoint.restore(tmp_path / "c", strategy=strategy)


V2 = pathlib.Path(__file__).parent / "data" / "checkpoint_v2"


def test_a_version_2_checkpoint_with_crc32_restores_and_verifies(strategy, tmp_path):
    # tests/data/checkpoint_v2 was written by the code that wrote format version 2 (one
    # zlib CRC-32 per array, a crc32 per small file), jm.checkpoint.save of this state on 8
    # replicas.
    path = tmp_path / "v2"
    shutil.copytree(V2, path)
    doc = json.loads((path / "jmirror" / "metadata").read_text())
    listed = json.loads((path / _integrity.FILES).read_text())
    assert doc["version"] == 2 and all(type(c) is int for c in listed["arrays"].values())
    w = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    out = jm.checkpoint.restore(path, strategy=strategy)
    np.testing.assert_array_equal(strategy.read(out["params"]["w"]), w)
    np.testing.assert_array_equal(out["b"], np.arange(5.0))
    assert out["n"] == 3 and out["empty"].shape == (0, 2)
    assert float(strategy.read(out["total"])) == 6.0
    # Verified: a changed value that still decodes is named by its leaf path.
    from jmirror.checkpoint import _storage

    read = _storage.read_arrays

    def changed(*args):
        arrays = read(*args)
        name = next(k for k, a in arrays.items() if a.shape == (3, 4))
        arrays[name] = arrays[name] + 1.0
        return arrays

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_storage, "read_arrays", changed)
        with pytest.raises(jm.checkpoint.CorruptCheckpointError, match=r"\['params'\]\['w'\]"):
            jm.checkpoint.restore(path, strategy=strategy)
    # A changed small file is caught by its crc32 in the file list.
    _flip_bit(path / "state" / "_METADATA")
    with pytest.raises(jm.checkpoint.CorruptCheckpointError, match="_METADATA was changed"):
        jm.checkpoint.restore(path, strategy=strategy)


def test_an_nnx_run_resumed_from_its_checkpoint_ends_bitwise_equal(strategy, tmp_path):
    x = jnp.linspace(-1.0, 1.0, 48).reshape(16, 3)

    @nnx.jit
    def train_step(model, optimizer):
        def loss(model):
            return jnp.mean(model(x) ** 2)  # dropout draws from the model's own rngs

        optimizer.update(model, nnx.grad(loss)(model))

    model, optimizer = _nnx_state()
    with jm.checkpoint.CheckpointManager(tmp_path, strategy=strategy) as manager:
        manager.save(2, strategy.mirror({"model": model, "optimizer": optimizer}))
        for _ in range(3):  # the uninterrupted run
            train_step(model, optimizer)
        abstract_model, abstract_optimizer = _abstract_nnx()
        restored = manager.restore(
            target={"model": abstract_model, "optimizer": abstract_optimizer}
        )
    resumed_model, resumed_optimizer = restored["model"], restored["optimizer"]
    resumed_model, resumed_optimizer = jax.device_put((resumed_model, resumed_optimizer))
    for _ in range(3):
        train_step(resumed_model, resumed_optimizer)
    for got, want in zip(_values((resumed_model, resumed_optimizer)), _values((model, optimizer))):
        np.testing.assert_array_equal(got, want)


@pytest.mark.once
def test_the_suite_ignores_only_tensorstore_s_closed_loop_unraisable(tmp_path):
    # After a restore of a damaged file fails, tensorstore may finish a pending read on orbax's
    # closed event loop; pyproject.toml ignores that unraisable exception, and only that one.
    (tmp_path / "test_unraisable.py").write_text(
        textwrap.dedent(
            """
            import gc

            class Raises:
                def __init__(self, text):
                    self.text = text

                def __del__(self):
                    raise RuntimeError(self.text)

            def test_closed_loop():
                Raises("Event loop is closed")
                gc.collect()

            def test_other():
                Raises("something else")
                gc.collect()
            """
        )
    )
    config = pathlib.Path(__file__).parents[1] / "pyproject.toml"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(config)]
        + ["--rootdir", str(tmp_path), "test_unraisable.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "1 failed, 1 passed" in run.stdout, run.stdout[-3000:]
    assert "FAILED test_unraisable.py::test_other" in run.stdout, run.stdout[-3000:]
