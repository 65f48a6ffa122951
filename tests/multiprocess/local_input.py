"""Process-local input and resumable positions, run by tests/test_input_local.py.

    python -m jmirror.launch --processes 2 --devices-per-process 4 local_input.py OUT two
    python -m jmirror.launch --processes 1 --devices-per-process 8 local_input.py OUT one

"two": each process reads only its share of every global batch (`process_local=True`), from
numpy and from grain pipelines, counting the rows its source read; it takes positions (by
count, by grain's state, by grain's `ElasticIterator` state) and writes what it saw to
OUT/process<i>.json. "one": one process over the same 8 devices reads the global batches
(the oracle), and resumes from the positions process 0 of "two" saved, writing OUT/one.json.
"""

import json
import sys
import threading
import warnings

import grain
import numpy as np
from preamble import join

jm = join(watchdog_s=150)

out_dir, mode = sys.argv[1], sys.argv[2]
strategy = jm.MultiWorkerMirroredStrategy()
me, P, N = strategy.process_index, strategy.num_processes, strategy.num_replicas
assert N == 8 and P == (2 if mode == "two" else 1), strategy
G = 16  # the global batch: 2 rows per replica
FULL = 5  # full global batches, then one of LAST rows
LAST = 12  # a short last batch: on 2 processes, process 0's share is full, process 1's has 4
results: dict[str, object] = {}


def global_batch(b: int, rows: int = G) -> dict[str, np.ndarray]:
    """Global batch b: row r holds 100 b + r."""
    x = (100 * b + np.arange(rows, dtype=np.float32))[:, None] * np.ones(2, np.float32)
    return {"x": x, "y": (100 * b + np.arange(rows)).astype(np.int32)}


def sizes(last: int = LAST) -> list[int]:
    return [G] * FULL + [last]


class Shares:
    """This process's shares of the global batches (every row, with one process): a
    re-iterable source that counts the rows it handed out."""

    def __init__(self, batch_sizes: list[int]):
        self.batch_sizes, self.rows = batch_sizes, 0

    def __iter__(self):
        share = G // P
        for b, size in enumerate(self.batch_sizes):
            rows = global_batch(b, size)
            mine = {k: v[me * share : (me + 1) * share] for k, v in rows.items()}
            if len(mine["y"]) == 0:
                return  # nothing of this batch is this process's
            self.rows += len(mine["y"])
            yield mine


def host(element) -> dict[str, list]:
    """A placed element as the global batch (and mask) every process can read."""
    batch, mask = element if isinstance(element, tuple) else (element, None)
    gathered = strategy.gather(batch)
    if not isinstance(gathered, dict):
        gathered = {"x": gathered}
    out = {k: np.asarray(v).tolist() for k, v in gathered.items()}
    if mask is not None:
        out["mask"] = np.asarray(strategy.gather(mask)).tolist()
    return out


def run(data) -> dict[str, object]:
    got, error = [], None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for element in data:
                got.append(host(element))
        except (RuntimeError, ValueError) as e:
            if "jmirror" not in str(e) and "distribute_dataset" not in str(e):
                raise  # only jmirror's own errors are outcomes
            error = f"{type(e).__name__}: {e}"
    return {"batches": got, "warnings": [str(w.message) for w in caught], "error": error}


local = mode == "two"

# Numpy shares: equal to one process over the global batches; rows read = this share.
for remainder in ("pad", "drop"):
    for prefetch in (0, 2):
        source = Shares(sizes())
        data = strategy.distribute_dataset(
            source, remainder=remainder, prefetch=prefetch, process_local=local
        )
        results[f"numpy/{remainder}/{prefetch}"] = dict(run(data), rows=source.rows)

# Uneven ends: process 1's source ends after 3 shares, process 0's after 6.
uneven = Shares(sizes() if me == 0 else [G] * 3)
results["uneven"] = run(strategy.distribute_dataset(uneven, remainder="drop", process_local=local))


class Reads:
    """The rows a grain pipeline's map function read (grain may call it from its threads)."""

    def __init__(self):
        self.rows: list[int] = []
        self._lock = threading.Lock()

    def row(self, i):
        with self._lock:
            self.rows.append(int(i))
        return {"x": np.full((2,), i, np.float32), "y": np.int32(i)}


ROWS = G * 7


def pipeline(reads: Reads, shard: bool) -> grain.IterDataset:
    """Rows 0..ROWS-1 in global batches of G: this process's shares when `shard`
    (consecutive G/P-row batches dealt to the processes in turn, as ShardByJaxProcess)."""
    ds = grain.MapDataset.range(ROWS).map(reads.row)
    ds = ds.batch(G // P)[me::P] if shard else ds.batch(G)
    return ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=2))


reads = Reads()
data = strategy.distribute_dataset(pipeline(reads, local), remainder="drop", process_local=local)
results["grain"] = dict(run(data), rows=sorted(reads.rows))


def take(data, k: int) -> tuple[list, dict]:
    """The first k elements of a pass, and the position after them (through JSON)."""
    it = iter(data)
    got = [host(next(it)) for _ in range(k)]
    position = json.loads(json.dumps(it.position))
    it.close()
    return got, position


K = 3
if mode == "two":
    # Process-local grain: resume from its state with a new pipeline on the same processes.
    first, position = take(
        strategy.distribute_dataset(pipeline(Reads(), True), remainder="drop", process_local=True),
        K,
    )
    again = Reads()
    rest = strategy.distribute_dataset(
        pipeline(again, True), remainder="drop", process_local=True, start=position
    )
    results["grain_resume"] = dict(run(rest), first=first, position=position, rows=again.rows)
    # Positions for one process to restore: by count, a grain global source's state, a
    # process-local ElasticIterator's state.
    _, results["count_position"] = take(
        strategy.distribute_dataset(Shares(sizes()), remainder="drop", process_local=True), K
    )
    _, results["global_grain_position"] = take(
        strategy.distribute_dataset(pipeline(Reads(), False), remainder="drop"), K
    )
    elastic = grain.experimental.ElasticIterator(
        grain.MapDataset.range(ROWS).map(Reads().row),
        G,
        grain.sharding.ShardOptions(shard_index=me, shard_count=P),
    )
    _, results["elastic_position"] = take(
        strategy.distribute_dataset(elastic, remainder="drop", process_local=True), K
    )

    # Shares of different sizes would make different global batches: refused everywhere.
    rows = 8 if me == 0 else 4
    mismatched = [{"x": np.zeros((rows, 2), np.float32), "y": np.zeros(rows, np.int32)}] * 2
    results["mismatch"] = run(strategy.distribute_dataset(mismatched, process_local=True))

    # distribute_datasets_from_function: per-process pipelines, resumed by count.
    def dataset_fn(ctx):
        return [np.full((2,), 10 * ctx.input_pipeline_id + i, np.float32) for i in range(16)]

    first, position = take(strategy.distribute_datasets_from_function(dataset_fn), 1)
    rest = strategy.distribute_datasets_from_function(dataset_fn, start=position)
    whole = strategy.distribute_datasets_from_function(dataset_fn)
    results["function"] = dict(run(rest), first=first, whole=run(whole)["batches"])

    # A position through a CheckpointManager, each process saving its own.
    with jm.checkpoint.CheckpointManager(f"{out_dir}/ckpt", strategy=strategy) as manager:
        manager.save(1, {"w": strategy.mirror(np.zeros(2, np.float32))}, data=position)
    with jm.checkpoint.CheckpointManager(f"{out_dir}/ckpt", strategy=strategy) as manager:
        results["manager_data"] = manager.data(1)
        results["manager_position"] = position
else:
    with open(f"{out_dir}/process0.json") as f:
        two = json.load(f)
    # By count: the new process's source reads and skips the K global batches received.
    results["count_resume"] = run(
        strategy.distribute_dataset(
            Shares(sizes()), remainder="drop", process_local=True, start=two["count_position"]
        )
    )
    # A global grain source's state, saved by 2 processes: it names the same next batch.
    again = Reads()
    data = strategy.distribute_dataset(
        pipeline(again, False), remainder="drop", start=two["global_grain_position"]
    )
    results["global_grain_resume"] = dict(run(data), rows=again.rows)
    # A process-local grain state cannot move from 2 processes to 1: refused.
    again = Reads()
    data = strategy.distribute_dataset(
        pipeline(again, False),
        remainder="drop",
        process_local=True,
        start=two["grain_resume"]["position"],
    )
    results["refused"] = dict(run(data), rows=again.rows)
    # An ElasticIterator's state can.
    elastic = grain.experimental.ElasticIterator(
        grain.MapDataset.range(ROWS).map(Reads().row),
        G,
        grain.sharding.ShardOptions(shard_index=0, shard_count=1),
    )
    data = strategy.distribute_dataset(
        elastic, remainder="drop", process_local=True, start=two["elastic_position"]
    )
    results["elastic_resume"] = run(data)

with open(f"{out_dir}/{'one' if mode == 'one' else f'process{me}'}.json", "w") as f:
    json.dump(results, f)
print("done", me)
