"""Input faults: stalled sources, 64-bit integers, bad leaves, the pad pair."""

import os
import subprocess
import sys
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmirror as jm
from jmirror import _prefetch

# A stalled source waits this long at most (then the test would fail on its timing bound).
STALL_S = 20.0
# What "promptly" means on a busy shared 2-core machine: far below STALL_S.
PROMPT_S = 5.0


@pytest.fixture
def s() -> jm.MirroredStrategy:
    return jm.MirroredStrategy()


class Stall:
    """A source whose second `next()` blocks until `release` (or STALL_S), recording its calls."""

    def __init__(self, n: int, count: int = 5):
        self.n = n
        self.count = count
        self.release = threading.Event()
        self.blocked = threading.Event()
        self.asked = 0
        self.closed = threading.Event()

    def __call__(self):
        return self.stalled_source()

    def stalled_source(self):
        try:
            for i in range(self.count):
                self.asked += 1
                if i == 1:
                    self.blocked.set()
                    self.release.wait(STALL_S)
                yield np.full((self.n, 2), i, np.float32)
        finally:
            self.closed.set()


@pytest.fixture
def jmirror_threads():
    """Waits, at teardown, for every jmirror thread the test started (none may outlive it)."""
    before = set(threading.enumerate())
    yield
    started = [t for t in set(threading.enumerate()) - before if t.name.startswith("jmirror")]
    for thread in started:
        thread.join(STALL_S + 5)
        assert not thread.is_alive(), f"{thread.name} outlived the test"


def _producer_threads():
    return [t for t in threading.enumerate() if t.name == "jmirror-prefetch"]


# --- a stalled source never holds up clean-up ----------------------------------------------------


@pytest.mark.parametrize("how", ["close", "del", "dataset_close", "with_iterator", "with_dataset"])
def test_cleanup_returns_while_the_source_is_blocked(s, n, how, jmirror_threads):
    source = Stall(n)
    data = s.distribute_dataset(source, remainder="drop", prefetch=2)
    it = iter(data)
    first = next(it)
    assert source.blocked.wait(STALL_S)  # the prefetch thread now waits inside the source
    (producer,) = [t for t in _producer_threads() if t.is_alive()]
    began = time.monotonic()
    if how == "close":
        it.close()
    elif how == "del":
        del it  # the last reference: the iterator is finalised now, no collection needed
    elif how == "dataset_close":
        data.close()
    elif how == "with_iterator":
        with it:
            pass
    else:
        with data:
            pass
    elapsed = time.monotonic() - began
    assert elapsed < PROMPT_S, f"clean-up waited {elapsed:.1f} s on the source"
    assert producer.is_alive()  # still inside the source's next(): nothing waited for it
    np.testing.assert_array_equal(np.asarray(first.values), np.zeros((n, 1, 2)))
    source.release.set()
    producer.join(STALL_S)
    assert not producer.is_alive()  # it ends once the blocked call returns...
    assert source.asked == 2  # ...and asks the source for nothing more,
    assert source.closed.wait(STALL_S)  # closing the generator jmirror opened.


def test_a_closed_iterator_stays_closed_while_the_source_is_blocked(s, n, jmirror_threads):
    source = Stall(n)
    it = iter(s.distribute_dataset(source, remainder="drop", prefetch=2))
    next(it)
    assert source.blocked.wait(STALL_S)
    it.close()
    assert list(it) == []
    source.release.set()


def test_closing_from_another_thread_without_prefetch(s, n, jmirror_threads):
    # With prefetch=0 the consumer itself waits in the source; a close from another thread
    # returns at once, and the consumer's pass ends when the source's call returns.
    source = Stall(n)
    data = s.distribute_dataset(source, remainder="drop", prefetch=0)
    it = iter(data)
    next(it)
    got = []
    consumer = threading.Thread(target=lambda: got.extend(it), name="jmirror-test-consumer")
    consumer.start()
    assert source.blocked.wait(STALL_S)
    began = time.monotonic()
    data.close()
    assert time.monotonic() - began < PROMPT_S
    source.release.set()
    consumer.join(STALL_S)
    assert not consumer.is_alive() and got == []
    assert source.asked == 2 and source.closed.is_set()


def test_break_does_not_wait_for_the_source(s, n, jmirror_threads):
    release = threading.Event()

    def slow_source():  # 3 s per batch after the first
        for i in range(4):
            if i:
                release.wait(3.0)
            yield np.full((n, 2), i, np.float32)

    data = s.distribute_dataset(slow_source, remainder="drop", prefetch=2)
    for batch in data:  # noqa: B007 - the loop breaks at once, keeping the first batch
        began = time.monotonic()
        break
    elapsed = time.monotonic() - began
    release.set()
    assert float(np.asarray(batch.values).max()) == 0.0
    assert elapsed < 1.0, f"break waited {elapsed:.1f} s for the source's next batch"


def test_a_source_still_blocked_after_the_deadline_gets_a_resource_warning(
    s, n, monkeypatch, jmirror_threads
):
    monkeypatch.setattr(_prefetch, "STALLED_SOURCE_WARNING_S", 0.2)
    source = Stall(n)
    it = iter(s.distribute_dataset(source.stalled_source, remainder="drop", prefetch=2))
    next(it)
    assert source.blocked.wait(STALL_S)
    with pytest.warns(ResourceWarning, match=r"stalled_source.*0\.2 s") as record:
        it.close()
        deadline = time.monotonic() + STALL_S
        while not record.list and time.monotonic() < deadline:
            time.sleep(0.02)
    source.release.set()


def test_no_resource_warning_when_the_source_returns_in_time(s, n, monkeypatch, jmirror_threads):
    monkeypatch.setattr(_prefetch, "STALLED_SOURCE_WARNING_S", 0.5)
    source = Stall(n)
    it = iter(s.distribute_dataset(source, remainder="drop", prefetch=2))
    next(it)
    assert source.blocked.wait(STALL_S)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        it.close()
        source.release.set()
        watchers = [t for t in threading.enumerate() if t.name == "jmirror-prefetch-watch"]
        for thread in watchers:
            thread.join(STALL_S)  # the watcher ends as soon as the producer does
        time.sleep(0.6)
    assert not [w for w in record if issubclass(w.category, ResourceWarning)]


_EXIT_SCRIPT = """
import os, threading, time
import jax
jax.config.update("jax_num_cpu_devices", {n})
import numpy as np
import jmirror as jm

def stalled_source():
    yield np.zeros(({n}, 2), np.float32)
    threading.Event().wait(60)
    yield np.zeros(({n}, 2), np.float32)

data = jm.MirroredStrategy().distribute_dataset(stalled_source, prefetch={prefetch})
it = iter(data)
next(it)
time.sleep(0.5)  # the prefetch thread is now blocked inside the source
{end}
print("exiting at", time.time(), flush=True)
"""


@pytest.mark.once
@pytest.mark.parametrize("end", ["pass", "del it", "it.close()", "data.close()"])
def test_interpreter_exit_does_not_wait_for_a_blocked_source(n, end):
    script = _EXIT_SCRIPT.format(n=n, prefetch=2, end=end)
    env = dict(os.environ, PYTHONWARNINGS="default")
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=150, env=env
    )
    ended = time.time()
    assert done.returncode == 0, done.stderr
    assert "exiting at" in done.stdout
    # From the script's last line to the process's end (JAX's import, slow on a loaded
    # machine, not included): far less than the 60 s the source stalls.
    elapsed = ended - float(done.stdout.split("exiting at")[1])
    assert elapsed < 30, f"exit took {elapsed:.0f} s"


# --- 64-bit integers -----------------------------------------------------------------------------


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize(
    "dtype, value, target",
    [
        (np.int64, 2**40 + 7, "int32"),
        (np.int64, -(2**31) - 1, "int32"),
        (np.uint64, 2**32 + 5, "uint32"),
    ],
)
def test_64_bit_integers_that_do_not_fit_are_a_value_error(s, n, prefetch, dtype, value, target):
    labels = np.zeros((2 * n,), dtype)
    labels[-1] = value
    batches = [{"x": np.zeros((2 * n, 3), np.float32), "y": np.zeros(2 * n, dtype)}]
    batches.append({"x": np.zeros((2 * n, 3), np.float32), "y": labels})
    seen = []
    with pytest.raises(ValueError, match=r"batch\['y'\]") as info:
        for batch in s.distribute_dataset(batches, remainder="drop", prefetch=prefetch):
            seen.append(batch)
    message = str(info.value)
    assert len(seen) == 1
    assert "batch 1" in message and str(value) in message and target in message
    assert 'jax.config.update("jax_enable_x64", True)' in message


@pytest.mark.parametrize("prefetch", [0, 2])
def test_64_bit_integers_that_fit_convert_silently(s, n, prefetch):
    ints = np.array([-(2**31), 2**31 - 1, 0, 9] * n, np.int64)
    uints = np.array([0, 2**32 - 1, 5, 7] * n, np.uint64)
    (batch,) = s.distribute_dataset([(ints, uints)], remainder="drop", prefetch=prefetch)
    got_ints, got_uints = jax.tree.map(lambda x: np.asarray(x).reshape(-1), batch.values)
    assert got_ints.dtype == np.int32 and got_uints.dtype == np.uint32
    np.testing.assert_array_equal(got_ints, ints)
    np.testing.assert_array_equal(got_uints, uints)


def test_64_bit_integers_pass_whole_with_x64(s, n):
    big = np.full((n,), 2**40 + 7, np.int64)
    with jax.enable_x64(True):
        (batch,) = s.distribute_dataset([big], remainder="drop", prefetch=0)
        assert batch.values.dtype == np.int64
        assert int(np.asarray(batch.values).max()) == 2**40 + 7


def test_64_bit_integers_from_a_dataset_function(s, n):
    def dataset_fn(ctx):
        return [{"id": np.array([2**40], np.int64)}] * ctx.num_replicas_in_sync

    with pytest.raises(ValueError, match=r"\['id'\].*jax_enable_x64"):
        list(s.distribute_datasets_from_function(dataset_fn, prefetch=0))


# --- leaves that are not numbers -----------------------------------------------------------------


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize(
    "leaf, dtype",
    [
        (np.array(["a", "b"]), "<U1"),
        (np.array([b"a", b"b"]), "|S1"),
        (np.array(["2024-01-01", "2024-01-02"], "datetime64[D]"), "datetime64[D]"),
        (np.array([1, 2], "timedelta64[s]"), "timedelta64[s]"),
        (np.zeros(2, [("a", np.int32), ("b", np.float32)]), "structured"),
    ],
)
def test_non_numeric_leaf_is_a_type_error_naming_path_and_dtype(s, n, prefetch, leaf, dtype):
    leaf = np.resize(leaf, (2 * n,))
    batch = {"x": np.zeros((2 * n, 3), np.float32), "meta": {"when": leaf}}
    with pytest.raises(TypeError, match=r"batch\['meta'\]\['when'\]") as info:
        list(s.distribute_dataset([batch], prefetch=prefetch))
    message = str(info.value)
    assert dtype.split("[")[0] in message or dtype == "structured"
    assert "numeric" in message  # the fix: convert it to numbers, or keep it out of the batch


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_per_replica_inside_a_batch_is_a_type_error_naming_it(s, n, prefetch):
    # A source yields global batches: a PerReplica there would come back nested in one.
    batch = {"x": jm.PerReplica(np.zeros((n, 2, 3), np.float32))}
    with pytest.raises(TypeError, match=r"batch\['x'\] of batch 0 is a jm\.PerReplica"):
        list(s.distribute_dataset([batch], prefetch=prefetch))
    pipelines = s.distribute_datasets_from_function(
        lambda ctx: [jm.PerReplica(np.zeros((1, 2), np.float32))] * n, prefetch=prefetch
    )
    with pytest.raises(TypeError, match=r"element of .* is a jm\.PerReplica"):
        list(pipelines)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_list_of_numbers_is_one_array_like_leaf(s, n, prefetch):
    labels = list(range(2 * n))
    (batch,) = s.distribute_dataset(
        [{"x": np.zeros((2 * n, 3)), "y": labels}], remainder="drop", prefetch=prefetch
    )
    got = jax.tree.map(lambda x: np.asarray(x).reshape((2 * n,) + x.shape[2:]), batch.values)
    np.testing.assert_array_equal(got["y"], labels)
    nested = [[i, i + 1] for i in range(n)]
    (batch,) = s.distribute_dataset([nested], remainder="drop", prefetch=prefetch)
    np.testing.assert_array_equal(np.asarray(batch.values).reshape(n, 2), nested)


def test_a_list_of_arrays_stays_a_container(s, n):
    (batch,) = s.distribute_dataset([[np.zeros((n, 3)), np.ones((n,))]], remainder="drop")
    assert isinstance(batch.values, list) and len(batch.values) == 2


def test_a_ragged_list_is_a_type_error_that_says_so(s, n):
    with pytest.raises(TypeError, match=r"batch\['y'\].*ragged") as info:
        list(s.distribute_dataset([{"y": [[1, 2], [3]] * n}]))
    assert "same length" in str(info.value)


def test_object_leaf_message_describes_what_is_accepted(s, n):
    with pytest.raises(TypeError, match=r"batch\['y'\].*list of numbers") as info:
        list(s.distribute_dataset([{"y": np.array([object()] * n)}]))
    assert "nested lists of numbers" not in str(info.value)


def test_scalar_leaf_message_points_to_lists_and_arrays(s, n):
    with pytest.raises(ValueError, match=r"batch\[1\].*scalar.*list of numbers"):
        list(s.distribute_dataset([(np.zeros((n,)), 3.0)]))


# --- the (batch, mask) pair of remainder="pad" ---------------------------------------------------


def _pad_element(s, n):
    (element,) = s.distribute_dataset([{"image": np.zeros((n, 2)), "label": np.arange(n)}])
    return element


@pytest.mark.parametrize(
    "misuse",
    [
        lambda e: e["image"],
        lambda e: e.keys(),
        lambda e: e.items(),
        lambda e: e.values,
        lambda e: e.shape,
    ],
)
def test_using_the_pad_pair_as_a_batch_is_a_type_error(s, n, misuse):
    element = _pad_element(s, n)
    with pytest.raises(TypeError, match=r"\(batch, mask\) pair") as info:
        misuse(element)
    message = str(info.value)
    assert "for batch, mask in" in message and "remainder='drop'" in message


def test_the_pad_pair_is_still_a_tuple(s, n):
    element = _pad_element(s, n)
    assert isinstance(element, tuple) and len(element) == 2
    batch, mask = element
    assert element[0] is batch and element[1] is mask and element[-1] is mask
    assert isinstance(batch, jm.PerReplica) and isinstance(mask, jm.PerReplica)
    assert not hasattr(element, "keys")  # hasattr probes still answer False
    assert len(jax.tree.leaves(element)) == 3
    doubled = jax.tree.map(lambda x: x, element)
    assert isinstance(doubled, tuple)


def test_the_pad_pair_passes_through_replicate_like_a_plain_tuple(s, n):
    element = _pad_element(s, n)
    plain = tuple(element)

    @jm.replicate(strategy=s)
    def count(pair):
        batch, mask = pair
        return jm.all_reduce("sum", jnp.sum(jnp.where(mask, batch["label"] + 1, 0)))

    @jm.replicate(strategy=s)
    def echo(pair):
        return pair

    want = n * (n + 1) // 2
    assert int(s.read(count(element))) == int(s.read(count(plain))) == want
    batch, mask = echo(element)
    np.testing.assert_array_equal(np.asarray(s.gather(mask)), np.ones(n, bool))
    np.testing.assert_array_equal(np.asarray(s.gather(batch["label"])), np.arange(n))
