"""Input position and resume: `.position` and `start=`."""

import json
import threading
import time
import warnings

import jax
import numpy as np
import pytest

import jmirror as jm
from jmirror import _batches as batching


@pytest.fixture
def s() -> jm.MirroredStrategy:
    return jm.MirroredStrategy()


def _sizes(remainder: str, n: int) -> list[int]:
    """Source batch sizes with G = 4N: incomplete batches where each remainder shows them."""
    return {
        "pad": [4 * n, 4 * n, n, 4 * n, 4 * n, 2 * n, 4 * n, 3],
        "drop": [4 * n, n, 4 * n, 4 * n, 2 * n, 4 * n, 4 * n, 1],
        "error": [4 * n] * 6 + [n],
    }[remainder]


def _batches(sizes: list[int], seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {"x": rng.normal(size=(b, 3)).astype(np.float32), "y": rng.integers(0, 9, size=(b,))}
        for b in sizes
    ]


def _oracle(batches, remainder: str, n: int) -> tuple[list, list[int]]:
    """NumPy: the elements an uninterrupted pass yields, and the source index of each."""
    g = -(-len(batches[0]["y"]) // n) * n
    out, indices = [], []
    for index, batch in enumerate(batches):
        size = len(batch["y"])
        if size < g and remainder == "drop":
            continue
        if size < g and remainder == "error":
            break
        padded = {
            k: np.concatenate([v, np.zeros((g - size,) + v.shape[1:], v.dtype)])
            for k, v in batch.items()
        }
        padded["y"] = padded["y"].astype(np.int32)
        out.append((padded, np.arange(g) < size) if remainder == "pad" else padded)
        indices.append(index)
    return out, indices


def _host(strategy, element):
    """An element back on the host, as the global batch (and mask) it came from."""

    def gather(per_replica):
        return jax.tree.map(
            lambda x: np.asarray(x).reshape((-1,) + x.shape[2:]), per_replica.values
        )

    if isinstance(element, tuple):
        return gather(element[0]), gather(element[1])
    return gather(element)


def _assert_equal(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        jax.tree.map(np.testing.assert_array_equal, a, b)


def _drain(strategy, data, remainder):
    out = []
    if remainder == "error":
        with pytest.raises(ValueError, match="remainder='error'"):
            for element in data:
                out.append(_host(strategy, element))
        return out
    return [_host(strategy, element) for element in data]


class Counted:
    """A callable source that records how many batches it handed out."""

    def __init__(self, batches):
        self.batches = batches
        self.pulled = 0

    def __call__(self):
        for batch in self.batches:
            self.pulled += 1
            yield batch


@pytest.mark.parametrize("resume_source", ["callable", "list"])
@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("remainder", ["pad", "drop", "error"])
@pytest.mark.parametrize("k", [0, 1, 3, "all"])
def test_resume_yields_exactly_the_batches_not_received(
    s, n, remainder, prefetch, k, resume_source
):
    batches = _batches(_sizes(remainder, n))
    want, indices = _oracle(batches, remainder, n)
    k = len(want) if k == "all" else k
    source = Counted(batches)
    it = iter(s.distribute_dataset(source, remainder=remainder, prefetch=prefetch))
    got = [_host(s, next(it)) for _ in range(k)]
    received_through = indices[k - 1] + 1 if k else 0
    if prefetch:  # let the thread run ahead: prefetched batches must not count as received
        ahead = min(received_through + prefetch, len(batches))
        deadline = time.monotonic() + 10
        while source.pulled < ahead and time.monotonic() < deadline:
            time.sleep(0.01)
        assert source.pulled >= ahead
    position = json.loads(json.dumps(it.position))
    it.close()

    fresh = [dict(b) for b in batches]  # a new object yielding the same batches
    new_source = (lambda: iter(fresh)) if resume_source == "callable" else fresh
    resumed = s.distribute_dataset(
        new_source, remainder=remainder, prefetch=prefetch, start=position
    )
    rest = _drain(s, resumed, remainder)
    _assert_equal(got + rest, want)
    if resume_source == "list":  # start applies to the first iteration only
        _assert_equal(_drain(s, resumed, remainder), want)


def test_position_counts_dropped_batches_before_received_ones_only(s, n):
    sizes = [4 * n, n, n, 4 * n, n]  # G = 4N; batches 1, 2 and 4 are dropped
    data = s.distribute_dataset(_batches(sizes), remainder="drop", prefetch=0)
    it = iter(data)
    start = it.position
    next(it)
    after_first = it.position
    next(it)
    after_second = it.position
    with pytest.raises(StopIteration):
        next(it)
    for position in (start, after_first, after_second):
        assert json.loads(json.dumps(position)) == position
    # Resuming after the second received batch skips the two dropped ones before it.
    (only,) = s.distribute_dataset(_batches(sizes), remainder="drop", start=after_first)
    _assert_equal([_host(s, only)], [_oracle(_batches(sizes), "drop", n)[0][1]])
    assert list(s.distribute_dataset(_batches(sizes), remainder="drop", start=after_second)) == []
    assert it.position == after_second  # the dropped batch at the end was never received


def test_position_never_counts_prefetched_batches(s, n):
    batches = _batches([4 * n] * 6)
    source = Counted(batches)
    it = iter(s.distribute_dataset(source, remainder="drop", prefetch=3))
    next(it)
    deadline = time.monotonic() + 10
    while source.pulled < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert source.pulled == 4
    one = iter(s.distribute_dataset(batches, remainder="drop", prefetch=0))
    next(one)
    assert it.position == one.position
    it.close()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_skipped_batches_are_never_placed_nor_converted(s, n, monkeypatch, prefetch):
    batches = _batches([4 * n] * 6)
    for i in (1, 2, 3):  # a skipped batch would fail conversion, let alone placement
        batches[i] = {"x": np.array(["not numbers"] * 4 * n), "y": batches[i]["y"]}
    placed = []
    place = batching._place
    monkeypatch.setattr(batching, "_place", lambda *a: placed.append(1) or place(*a))
    head = iter(s.distribute_dataset(_batches([4 * n] * 6), remainder="drop", prefetch=0))
    for _ in range(4):
        next(head)
    position = head.position
    data = s.distribute_dataset(batches, remainder="drop", prefetch=prefetch, start=position)
    got = [_host(s, element) for element in data]
    _assert_equal(got, batches[4:])
    assert len(placed) == 4 + 2  # the four batches of `head`, then only the two yielded


def test_a_fresh_iterator_stands_at_its_start(s, n):
    batches = _batches([4 * n] * 3)
    it = iter(s.distribute_dataset(batches, remainder="drop"))
    zero = it.position
    next(it)
    one = it.position
    it.close()
    assert zero != one
    data = s.distribute_dataset(batches, remainder="drop", start=one)
    resumed = iter(data)
    assert resumed.position == one  # saving before the first batch keeps the place
    assert len(list(resumed)) == 2
    assert iter(data).position == zero  # later passes start at their beginning


def test_resume_on_another_replica_count_with_the_same_global_batch(s, n):
    if n == 1:
        pytest.skip("needs two replica counts")
    batches = _batches([4 * n] * 4 + [n])
    it = iter(s.distribute_dataset(batches, remainder="pad"))
    got = [_host(s, next(it)) for _ in range(2)]
    position = it.position
    it.close()
    one = jm.MirroredStrategy(num_devices=1)
    rest = [_host(one, e) for e in one.distribute_dataset(batches, remainder="pad", start=position)]
    _assert_equal(got + rest, _oracle(batches, "pad", n)[0])


@pytest.mark.parametrize(
    "start, error, match",
    [
        (3, TypeError, "a position dict"),
        ([0], TypeError, "a position dict"),
        ({}, ValueError, "not a jmirror input position"),
        ({"format": "other", "version": 1, "batches": 0}, ValueError, "not a jmirror input"),
        ({"format": "jmirror.input", "version": 99, "batches": 0}, ValueError, "version 99"),
        ({"format": "jmirror.input", "version": 1, "batches": -1}, ValueError, "batches"),
        ({"format": "jmirror.input", "version": 1, "batches": 1.5}, ValueError, "batches"),
        ({"format": "jmirror.input", "version": 1, "batches": True}, ValueError, "batches"),
    ],
)
def test_invalid_start(s, start, error, match):
    with pytest.raises(error, match=match):
        s.distribute_dataset([], start=start)


def test_a_start_beyond_the_source_is_a_value_error(s, n):
    batches = _batches([4 * n] * 3)
    it = iter(s.distribute_dataset(batches, remainder="drop"))
    for _ in range(3):
        next(it)
    short = s.distribute_dataset(batches[:2], remainder="drop", start=it.position)
    with pytest.raises(ValueError, match=r"start.*3 batches.*only 2"):
        list(short)


def test_position_reads_are_safe_from_another_thread(s, n):
    batches = _batches([4 * n] * 20)
    it = iter(s.distribute_dataset(batches, remainder="drop", prefetch=2))
    seen = []
    reader = threading.Thread(target=lambda: [seen.append(it.position) for _ in range(200)])
    reader.start()
    for _ in it:
        pass
    reader.join()
    assert all(json.loads(json.dumps(p)) == p for p in seen)


@pytest.mark.parametrize("remainder", ["pad", "drop"])
def test_a_source_still_batched_for_the_saved_process_count_is_named(s, n, remainder):
    # What two processes' iterators give after 3 steps of process-local shares of 2N rows.
    position = {
        "format": "jmirror.input",
        "version": 2,
        "batches": 3,
        "global_batch_size": 4 * n,
        "processes": 2,
        "process_local": True,
    }
    shares = _batches([2 * n] * 6)  # this one process's source: still G/2 rows per batch
    named = rf"taken by 2 processes.*G={4 * n} \({2 * n} rows\).*yield {4 * n} rows"
    with pytest.warns(UserWarning, match=named):
        got = list(s.distribute_dataset(shares, remainder=remainder, start=position))
    assert len(got) == (3 if remainder == "pad" else 0)  # as the position's G makes them
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # batches of G rows resume without a word
        whole = _batches([4 * n] * 6)
        assert len(list(s.distribute_dataset(whole, remainder=remainder, start=position))) == 3


def test_a_position_resumes_only_its_own_kind_of_input(s, n):
    it = iter(s.distribute_dataset(_batches([4 * n] * 3), remainder="drop"))
    next(it)
    batches = it.position
    it.close()
    fn = s.distribute_datasets_from_function(lambda ctx: [np.zeros(2)] * (3 * s.num_replicas))
    steps = iter(fn)
    next(steps)
    counted = steps.position
    steps.close()
    with pytest.raises(ValueError, match="taken from a strategy.distribute_dataset iterator"):
        s.distribute_datasets_from_function(lambda ctx: [], start=batches)
    with pytest.raises(ValueError, match="taken from a strategy.distribute_datasets_from_f"):
        s.distribute_dataset([], start=counted)
    resumed = s.distribute_datasets_from_function(
        lambda ctx: [np.zeros(2)] * (3 * s.num_replicas), start=json.loads(json.dumps(counted))
    )
    assert len(list(resumed)) == 2
