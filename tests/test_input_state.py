"""Resuming input from the source's own state (`get_state` / `set_state`), in one process.

The oracle of every resume is an uninterrupted pass over the same source; "nothing read
again" is checked by recording which elements the source's own code read.
"""

import json
import threading
import time

import jax
import numpy as np
import pytest

import jmirror as jm

grain = pytest.importorskip("grain")


@pytest.fixture
def s() -> jm.MirroredStrategy:
    return jm.MirroredStrategy()


def _host(element):
    """A `PerReplica` batch (or `(batch, mask)`) back on the host as its global rows."""
    gather = lambda x: np.asarray(x).reshape((-1,) + x.shape[2:])  # noqa: E731
    if isinstance(element, tuple):
        return tuple(jax.tree.map(gather, part.values) for part in element)
    return jax.tree.map(gather, element.values)


def _equal(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        jax.tree.map(np.testing.assert_array_equal, a, b)


class Reads:
    """The rows a grain pipeline's map function read (grain may call it from its threads)."""

    def __init__(self):
        self.rows: list[int] = []
        self._lock = threading.Lock()

    def row(self, i):
        with self._lock:
            self.rows.append(int(i))
        return {"x": np.full((3,), i, np.float32), "y": np.int32(i % 7)}


def _grain(reads: Reads, rows: int, batch: int, threads: int = 2):
    """A grain pipeline of `rows` rows in batches of `batch` (the last one short)."""
    ds = grain.MapDataset.range(rows).map(reads.row).batch(batch)
    return ds.to_iter_dataset(grain.ReadOptions(num_threads=threads, prefetch_buffer_size=4))


@pytest.mark.parametrize("prefetch", [0, 3])
@pytest.mark.parametrize("remainder", ["pad", "drop"])
def test_a_grain_pipeline_resumes_from_its_state_reading_nothing_again(s, n, prefetch, remainder):
    g, rows, k = 4 * n, 4 * n * 7 + n, 3
    want = [_host(e) for e in s.distribute_dataset(_grain(Reads(), rows, g), remainder=remainder)]
    first = Reads()
    it = iter(s.distribute_dataset(_grain(first, rows, g), remainder=remainder, prefetch=prefetch))
    got = [_host(next(it)) for _ in range(k)]
    position = json.loads(json.dumps(it.position))
    it.close()
    assert position["source_state"] == {"json": {"next_index": k}}
    assert position["batches"] == k and position["global_batch_size"] == g
    again = Reads()
    rest = s.distribute_dataset(_grain(again, rows, g), remainder=remainder, start=position)
    _equal(got + [_host(e) for e in rest], want)
    assert min(again.rows) == k * g  # nothing before the position was read again
    assert sorted(again.rows) == list(range(k * g, rows))


def test_resuming_a_grain_pipeline_at_batch_100000_reads_no_skipped_element(s, n):
    g, k = 2 * n, 100_000
    take = iter(s.distribute_dataset(_grain(Reads(), 10**8, g), remainder="drop"))
    next(take)
    position = json.loads(json.dumps(take.position))
    take.close()
    # The state grain's own iterator has after k batches, as this pipeline writes it.
    direct = iter(_grain(Reads(), 10**8, g))
    direct.set_state({"next_index": k})
    position.update(batches=k, source_state={"json": direct.get_state()})
    reads = Reads()
    data = s.distribute_dataset(_grain(reads, 10**8, g), remainder="drop", start=position)
    it = iter(data)
    batch = _host(next(it))
    it.close()
    np.testing.assert_array_equal(batch["x"][:, 0], np.arange(k * g, (k + 1) * g))
    assert min(reads.rows) == k * g  # not one of the k * g rows before it


def test_prefetched_batches_never_reach_the_position(s, n):
    g = 2 * n
    source = _grain(Reads(), 20 * g, g, threads=0)
    it = iter(s.distribute_dataset(source, remainder="drop", prefetch=4))
    next(it)
    time.sleep(0.3)  # the thread runs ahead, up to 4 batches more
    assert it.position["source_state"] == {"json": {"next_index": 1}}
    assert it.position["batches"] == 1
    next(it)
    assert it.position["source_state"] == {"json": {"next_index": 2}}
    it.close()


def _loader(rows: int, batch: int):
    sampler = grain.samplers.IndexSampler(
        rows, shard_options=grain.sharding.NoSharding(), shuffle=True, num_epochs=1, seed=3
    )
    return grain.DataLoader(
        data_source=np.arange(rows, dtype=np.float32),
        sampler=sampler,
        operations=[grain.transforms.Batch(batch, drop_remainder=True)],
        worker_count=0,
    )


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_data_loader_bytes_state_is_carried_as_text(s, n, prefetch):
    g, rows = 2 * n, 2 * n * 6
    want = [_host(e) for e in s.distribute_dataset(_loader(rows, g), remainder="drop")]
    it = iter(s.distribute_dataset(_loader(rows, g), remainder="drop", prefetch=prefetch))
    got = [_host(next(it)) for _ in range(2)]
    saved = json.dumps(it.position)  # bytes would not serialize
    it.close()
    assert set(json.loads(saved)["source_state"]) == {"bytes"}
    rest = s.distribute_dataset(_loader(rows, g), remainder="drop", start=json.loads(saved))
    _equal(got + [_host(e) for e in rest], want)


class Stateful:
    """Anyone's iterator with `get_state` / `set_state`: counts the rows it produced."""

    def __init__(self, batches, kind="dict"):
        self.batches, self.i, self.kind, self.made = batches, 0, kind, []

    def __iter__(self):
        return self

    def __next__(self):
        if self.i == len(self.batches):
            raise StopIteration
        self.made.append(self.i)
        self.i += 1
        return self.batches[self.i - 1]

    def get_state(self):
        if self.kind == "object":
            return {"at": self.i, "when": object()}
        if self.kind == "numpy":
            return {"at": np.int64(self.i)}
        if self.kind == "int key":
            return {"at": self.i, "shards": {0: self.i}}
        return {"at": self.i}

    def set_state(self, state):
        self.i = state["at"]


def _numpy_batches(n, count):
    rng = np.random.default_rng(0)
    return [rng.normal(size=(2 * n, 3)).astype(np.float32) for _ in range(count)]


@pytest.mark.parametrize("prefetch", [0, 2])
def test_any_iterator_with_get_state_and_set_state_is_positioned_by_set_state(s, n, prefetch):
    batches = _numpy_batches(n, 6)
    want = [_host(e) for e in s.distribute_dataset(batches, remainder="drop")]
    it = iter(s.distribute_dataset(Stateful(batches), remainder="drop", prefetch=prefetch))
    got = [_host(next(it)) for _ in range(4)]
    position = json.loads(json.dumps(it.position))
    it.close()
    assert position["source_state"] == {"json": {"at": 4}}
    again = Stateful(batches)
    rest = [_host(e) for e in s.distribute_dataset(again, remainder="drop", start=position)]
    _equal(got + rest, want)
    assert again.made == [4, 5]


@pytest.mark.parametrize(
    "kind, named",
    [
        ("object", r"builtins\.object at \['when'\]"),
        ("numpy", r"numpy\.int64 at \['at'\]"),
        # JSON would give set_state the key "0" for 0: a state that does not come back as it was.
        ("int key", r"dict key 0 of type int at \['shards'\]"),
    ],
)
def test_a_state_that_json_cannot_hold_is_a_type_error_naming_where_when_read(s, n, kind, named):
    it = iter(s.distribute_dataset(Stateful(_numpy_batches(n, 3), kind), remainder="drop"))
    assert len(list(it)) == 3  # iterating never fails for it
    with pytest.raises(TypeError, match=rf"get_state\(\) returned a state holding a {named}.*JSON"):
        it.position  # noqa: B018


def test_a_position_travels_through_a_checkpoint_manager(s, n, tmp_path):
    g, rows = 2 * n, 2 * n * 6
    want = [_host(e) for e in s.distribute_dataset(_loader(rows, g), remainder="drop")]
    it = iter(s.distribute_dataset(_loader(rows, g), remainder="drop"))
    got = [_host(next(it)) for _ in range(3)]
    with jm.checkpoint.CheckpointManager(tmp_path, strategy=s) as manager:
        manager.save(3, {"w": s.mirror(np.zeros(2))}, data=it.position)
    it.close()
    with jm.checkpoint.CheckpointManager(tmp_path, strategy=s) as manager:
        position = manager.data(3)
    assert set(position["source_state"]) == {"bytes"}
    rest = s.distribute_dataset(_loader(rows, g), remainder="drop", start=position)
    _equal(got + [_host(e) for e in rest], want)


@pytest.mark.parametrize("stateful", [False, True])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_datasets_from_function_positions_resume(s, n, prefetch, stateful):
    elements = [np.full((2,), i, np.float32) for i in range(5 * n)]
    made = []

    def dataset_fn(ctx):
        pipeline = Stateful(elements)
        made.append(pipeline)
        return pipeline if stateful else iter(list(elements))

    want = [_host(e) for e in s.distribute_datasets_from_function(dataset_fn)]
    it = iter(s.distribute_datasets_from_function(dataset_fn, prefetch=prefetch))
    got = [_host(next(it)) for _ in range(2)]
    position = json.loads(json.dumps(it.position))
    it.close()
    assert position["batches"] == 2
    assert ("source_state" in position) == stateful
    rest = s.distribute_datasets_from_function(dataset_fn, prefetch=prefetch, start=position)
    _equal(got + [_host(e) for e in rest], want)
    if stateful:
        assert made[-1].made == list(range(2 * n, 5 * n))  # the first 2 steps not read again


def _local_position(position, processes):
    """`position` as a process-local source on `processes` processes would have saved it."""
    return dict(position, processes=processes, process_local=True)


def test_a_state_from_another_process_count_that_cannot_move_is_refused(s, n):
    batches = _numpy_batches(n, 4)
    it = iter(s.distribute_dataset(Stateful(batches), remainder="drop"))
    next(it)
    position = _local_position(it.position, 2)
    it.close()
    again = Stateful(batches)
    data = s.distribute_dataset(again, remainder="drop", start=position, process_local=True)
    with pytest.raises(ValueError, match=r"P=2 processes.*P'=1.*ElasticIterator.*source_state"):
        next(iter(data))
    assert again.made == []  # refused before reading anything
    # By count, the same position restores: the source reads and skips the batch received.
    del position["source_state"]
    rest = [_host(e) for e in s.distribute_dataset(Stateful(batches), start=position)]
    _equal(rest, [(_host(e)) for e in s.distribute_dataset(batches[1:])])


def test_an_elastic_iterator_state_moves_to_another_process_count(s, n):
    g = 4 * n
    ds = grain.MapDataset.range(g * 10).map(lambda i: np.float32(i))
    options = grain.sharding.ShardOptions(shard_index=0, shard_count=2)
    # What process 0 of 2 saw: its elastic share, G/2 rows a batch, after 3 batches.
    it = iter(grain.experimental.ElasticIterator(ds, g, options))
    for _ in range(3):
        next(it)
    here = iter(s.distribute_dataset([np.zeros(g, np.float32)], remainder="drop"))
    next(here)
    position = _local_position(dict(here.position, batches=3), 2)
    position["source_state"] = {"json": it.get_state()}
    here.close()
    one = grain.sharding.ShardOptions(shard_index=0, shard_count=1)
    source = grain.experimental.ElasticIterator(ds, g, one)
    data = s.distribute_dataset(source, remainder="drop", start=position, process_local=True)
    got = [_host(e) for e in data]
    assert len(got) == 7
    np.testing.assert_array_equal(np.concatenate(got), np.arange(3 * g, 10 * g))


def test_a_position_records_the_global_batch_size_and_reads_no_batch_to_learn_it(s, n):
    batches = _numpy_batches(n, 4)
    it = iter(s.distribute_dataset(batches, remainder="drop"))
    next(it)
    position = it.position
    it.close()
    assert position["global_batch_size"] == 2 * n
    source = [np.float32(0)] + batches[1:]  # batch 0 has no batch axis: never looked at
    rest = [_host(e) for e in s.distribute_dataset(source, remainder="drop", start=position)]
    _equal(rest, [_host(e) for e in s.distribute_dataset(batches[1:], remainder="drop")])
    # A position of the first format, without it, still resumes (by count, reading batch 1).
    old = {"format": "jmirror.input", "version": 1, "batches": 1}
    rest = [_host(e) for e in s.distribute_dataset(batches, remainder="drop", start=old)]
    _equal(rest, [_host(e) for e in s.distribute_dataset(batches[1:], remainder="drop")])


V2 = {"format": "jmirror.input", "version": 2, "batches": 1, "global_batch_size": 8}


@pytest.mark.parametrize(
    "change, match",
    [
        ({"source_state": {"pickle": "x"}}, "'source_state' must be"),
        ({"source_state": {"bytes": "not base64!"}}, "'source_state' must be"),
        ({"processes": 0}, "'processes' must be an int >= 1"),
        ({"process_local": "yes"}, "'process_local' must be a bool"),
        ({"global_batch_size": -8}, "'global_batch_size' must be an int >= 0"),
    ],
)
def test_a_damaged_position_is_a_value_error_naming_the_entry(s, change, match):
    with pytest.raises(ValueError, match=match):
        s.distribute_dataset([], start=dict(V2, **change))


def test_process_local_must_be_a_bool(s):
    with pytest.raises(TypeError, match=r"process_local=\.\.\.\) expects True"):
        s.distribute_dataset([], process_local=1)
