"""Input at scale: bytes read per process, a grain pipeline's rate, resume time.

Three measurements, on XLA:CPU host devices:

  (1) bytes: a grain pipeline of ROWS rows (DIM float32 each) run once through
      `strategy.distribute_dataset` by 2 processes x 4 devices (started with
      `python -m jmirror.launch`), each process reading every global batch (a global source)
      and then only its share (`process_local=True`, the pipeline sliced by process as
      grain's ShardByJaxProcess does). The bytes each process's map function produced, and
      their ratio (target 1/P = 0.5).
  (2) rate: batches per second of one grain pipeline (global batch BATCH rows of DIM
      float32) delivered to 8 devices through `strategy.distribute_dataset(prefetch=2)`,
      against grain's own `grain.experimental.device_put(ds, sharding, device_buffer_size=2)`
      (its CPU buffer at grain's default, 4) of the same pipeline; each batch waited for on
      the devices. Also jmirror with its prefetch thread left at normal priority: on XLA:CPU
      host devices it runs at niceness 19 (see jmirror/_prefetch.py), and so do the threads
      grain starts from it, which a machine loaded by other programs starves; on
      accelerators it keeps its priority. The three rotate, ROUNDS rounds of STEPS batches;
      the median of the per-round ratios (target >= 0.9).
  (3) resume: seconds from `distribute_dataset(pipeline, start=position)` to the first batch on
      the devices, with a position at batch 10 and at batch 10^5 (alternating, ROUNDS each);
      the ratio of the medians (target <= 1.5). The position at batch 10 is taken by
      receiving 10 batches; the one at 10^5 is that position with grain's own state after
      10^5 batches (grain's iterator positioned by its `set_state`), since reading 10^5
      batches only to take it would take minutes. The same two positions without their
      source state (resumed by counting, as sources without a state are), at batches 10 and
      10^4, are timed once each.

Run: python benchmarks/input_scale_bench.py [--rounds 7] [--steps 200]
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402

WORKER = "--bytes-worker"
if WORKER not in sys.argv:  # a worker's devices come from the launcher
    jax.config.update("jax_num_cpu_devices", 8)

import grain  # noqa: E402
import numpy as np  # noqa: E402

import jmirror as jm  # noqa: E402
from jmirror import _prefetch as jm_prefetch  # noqa: E402

BATCH, DIM = 256, 1024
ROUNDS, STEPS = 7, 200


class Counted:
    """A grain map function that counts the bytes it produced."""

    def __init__(self):
        self.bytes = 0

    def __call__(self, i):
        row = np.full((DIM,), i, np.float32)
        self.bytes += row.nbytes
        return row


def pipeline(rows: int, batch: int, fn, *, shard: tuple[int, int] | None = None, threads=2):
    ds = grain.MapDataset.range(rows).map(fn)
    if shard is None:
        ds = ds.batch(batch, drop_remainder=True)
    else:
        index, count = shard
        ds = ds.batch(batch // count, drop_remainder=True)[index::count]
    return ds.to_iter_dataset(grain.ReadOptions(num_threads=threads, prefetch_buffer_size=4))


def bytes_worker(out: str) -> None:
    """(1), in each of the launcher's processes."""
    jm.distributed.initialize()
    strategy = jm.MultiWorkerMirroredStrategy()
    me, processes = strategy.process_index, strategy.num_processes
    rows = BATCH * 40
    result = {}
    for name, shard in (("global", None), ("process_local", (me, processes))):
        counted = Counted()
        data = strategy.distribute_dataset(
            pipeline(rows, BATCH, counted, shard=shard),
            remainder="drop",
            process_local=shard is not None,
        )
        start = time.perf_counter()
        steps = sum(1 for batch in data if jax.block_until_ready(batch) is not None)
        result[name] = {
            "bytes": counted.bytes,
            "steps": steps,
            "seconds": time.perf_counter() - start,
        }
    with open(f"{out}/process{me}.json", "w") as f:
        json.dump(result, f)


def measure_bytes() -> None:
    with tempfile.TemporaryDirectory() as out:
        subprocess.run(
            [sys.executable, "-m", "jmirror.launch", "--processes", "2"]
            + ["--devices-per-process", "4", __file__, WORKER, out],
            check=True,
            timeout=600,
        )
        seen = [json.loads(Path(f"{out}/process{i}.json").read_text()) for i in (0, 1)]
    for i, got in enumerate(seen):
        ratio = got["process_local"]["bytes"] / got["global"]["bytes"]
        print(
            f"(1) process {i}: global source {got['global']['bytes'] / 2**20:.1f} MiB read "
            f"({got['global']['steps']} steps, {got['global']['seconds']:.2f} s), "
            f"process_local {got['process_local']['bytes'] / 2**20:.1f} MiB "
            f"({got['process_local']['steps']} steps, {got['process_local']['seconds']:.2f} s): "
            f"ratio {ratio:.3f} (target 1/P = 0.5: {'met' if ratio <= 0.5 else 'NOT met'})"
        )


def measure_rate(strategy, rounds: int, steps: int) -> None:
    rows = BATCH * steps
    sharding = jax.sharding.NamedSharding(
        strategy.topology.mesh, jax.sharding.PartitionSpec(strategy.topology.axis_name)
    )

    def timed(batches) -> tuple[float, float]:
        """Batches/s over `batches`, each waited for on the devices, and the CPU ms the
        process (all its threads) spent per batch."""
        start, cpu = time.perf_counter(), time.process_time()
        count = 0
        for batch in batches:
            jax.block_until_ready(batch)
            count += 1
        return count / (time.perf_counter() - start), (time.process_time() - cpu) / count * 1e3

    def jmirror_rate() -> tuple[float, float]:
        return timed(
            strategy.distribute_dataset(
                pipeline(rows, BATCH, Counted()), remainder="drop", prefetch=2
            )
        )

    def jmirror_normal_priority_rate() -> tuple[float, float]:
        lower_priority = jm_prefetch._lower_priority
        jm_prefetch._lower_priority = lambda: None
        try:
            return jmirror_rate()
        finally:
            jm_prefetch._lower_priority = lower_priority

    def grain_rate() -> tuple[float, float]:
        return timed(
            grain.experimental.device_put(
                pipeline(rows, BATCH, Counted()), sharding, device_buffer_size=2
            )
        )

    runs = [jmirror_rate, jmirror_normal_priority_rate, grain_rate]
    for run in runs:  # warm up
        run()
    rates: dict[str, list[float]] = {run.__name__: [] for run in runs}
    cpu: dict[str, list[float]] = {run.__name__: [] for run in runs}
    for r in range(rounds):
        k = r % len(runs)
        for run in runs[k:] + runs[:k]:  # rotating, so that none always runs first
            rate, ms = run()
            rates[run.__name__].append(rate)
            cpu[run.__name__].append(ms)
        print(f"(2) round {r}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items()))
    med = {name: statistics.median(v) for name, v in rates.items()}
    ms = {name: statistics.median(v) for name, v in cpu.items()}
    print(
        f"(2) batches/s of {BATCH} x {DIM} float32 to {strategy.num_replicas} devices, median of "
        f"{rounds} x {steps}: distribute_dataset {med['jmirror_rate']:.1f} (prefetch thread at "
        f"niceness 19, as on host devices), {med['jmirror_normal_priority_rate']:.1f} (at "
        f"normal priority, as on accelerators); grain device_put {med['grain_rate']:.1f}"
    )
    print(
        f"(2) CPU ms per batch (all threads, median): distribute_dataset "
        f"{ms['jmirror_rate']:.2f}, at normal priority {ms['jmirror_normal_priority_rate']:.2f}, "
        f"grain device_put {ms['grain_rate']:.2f}"
    )
    for name in ("jmirror_rate", "jmirror_normal_priority_rate"):
        ratio = statistics.median(
            a / b for a, b in zip(rates[name], rates["grain_rate"], strict=True)
        )
        print(
            f"(2) {name} / grain_rate: {ratio:.3f} median of per-round ratios (target >= 0.9: "
            f"{'met' if ratio >= 0.9 else 'NOT met'})"
        )


def measure_resume(strategy, rounds: int) -> None:
    rows, batch = 10**9, 8

    def source():
        return pipeline(rows, batch, Counted(), threads=0)

    it = iter(strategy.distribute_dataset(source(), remainder="drop"))
    for _ in range(10):
        next(it)
    at_10 = json.loads(json.dumps(it.position))
    it.close()
    direct = iter(source())
    direct.set_state({"next_index": 10**5})
    at_1e5 = dict(at_10, batches=10**5, source_state={"json": direct.get_state()})

    def resume(position) -> float:
        start = time.perf_counter()
        it = iter(strategy.distribute_dataset(source(), remainder="drop", start=position))
        first = next(it)
        jax.block_until_ready(first)
        seconds = time.perf_counter() - start
        it.close()
        return seconds

    resume(at_10), resume(at_1e5)  # warm up
    times: dict[int, list[float]] = {10: [], 10**5: []}
    for r in range(rounds):
        order = ((10, at_10), (10**5, at_1e5))
        for k, position in order if r % 2 == 0 else order[::-1]:
            times[k].append(resume(position))
    small, large = statistics.median(times[10]), statistics.median(times[10**5])
    print(
        f"(3) resume of a grain pipeline from its state, to the first batch on the devices "
        f"(median of {rounds}): at batch 10 {small * 1e3:.1f} ms, at batch 10^5 "
        f"{large * 1e3:.1f} ms; ratio {large / small:.2f} (target <= 1.5: "
        f"{'met' if large / small <= 1.5 else 'NOT met'})"
    )
    counting = {}
    for k in (10, 10**4):
        by_count = {key: v for key, v in at_10.items() if key != "source_state"}
        counting[k] = resume(dict(by_count, batches=k))
    print(
        f"(3) resumes by counting (the position without its source state: every batch "
        f"before it read and dropped): at batch 10 {counting[10] * 1e3:.1f} ms, at batch "
        f"10^4 {counting[10**4] * 1e3:.1f} ms ({counting[10**4] / counting[10]:.0f}x)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"rounds ({ROUNDS})")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"batches a round ({STEPS})")
    parser.add_argument(
        "--skip-bytes", action="store_true", help="skip (1), which starts processes"
    )
    args = parser.parse_args()
    strategy = jm.MirroredStrategy()
    print(
        f"{strategy.num_replicas} devices ({jax.devices()[0].platform}), jax "
        f"{jax.__version__}, grain {grain.__version__}"
    )
    if not args.skip_bytes:
        measure_bytes()
    measure_rate(strategy, args.rounds, args.steps)
    measure_resume(strategy, args.rounds)


if __name__ == "__main__":
    if WORKER in sys.argv:
        bytes_worker(sys.argv[sys.argv.index(WORKER) + 1])
    else:
        main()
