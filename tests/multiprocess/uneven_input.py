"""A program run as 2 processes x 4 host devices by tests/test_input_processes.py.

    python -m jmirror.launch --processes 2 --devices-per-process 4 uneven_input.py OUT_DIR

Each process feeds `jm.MultiWorkerMirroredStrategy` from its own source, process 1's shorter
than process 0's (or failing), runs a replicated step with an all-reduce on every batch, and
writes what it saw to OUT_DIR/process<i>.json: the steps of each pass, the sums the steps
computed, the warnings and errors, and positions. A process left waiting alone in a
collective would hang here, which the test's timeout turns into a failure.
"""

import json
import sys
import time
import warnings

import jax.numpy as jnp
import numpy as np
from preamble import join

jm = join()

out_dir = sys.argv[1]
strategy = jm.MultiWorkerMirroredStrategy()
me, n = strategy.process_index, strategy.num_replicas
assert strategy.num_processes == 2 and strategy.num_local_replicas == 4, strategy
step = jm.replicate(lambda x: jm.all_reduce("sum", jnp.sum(x)), strategy=strategy)
results: dict[str, object] = {}


def global_batches(count: int) -> list[np.ndarray]:
    """`count` global batches of 2N rows: batch b holds 100 * b + row."""
    return [100 * b + np.arange(2 * n, dtype=np.float32) for b in range(count)]


def run_pass(data) -> dict[str, object]:
    """Steps a pass; the sums every step computed, the warnings, the error if any."""
    sums, error = [], None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for batch in data:
                if isinstance(batch, tuple):
                    batch = batch[0]
                sums.append(float(strategy.read(step(batch))))
        except (RuntimeError, ValueError) as e:
            error = f"{type(e).__name__}: {e}"
    return {
        "steps": len(sums),
        "sums": sums,
        "warnings": [str(w.message) for w in caught],
        "error": error,
    }


# distribute_dataset: process 0 has 5 global batches, process 1 has 3.
for prefetch in (0, 2):
    for remainder in ("drop", "pad"):
        data = strategy.distribute_dataset(
            global_batches(5 if me == 0 else 3), remainder=remainder, prefetch=prefetch
        )
        results[f"dataset/{remainder}/prefetch{prefetch}"] = run_pass(data)
        # A second pass (a re-iterable source restarts) ends at the same step again.
        results[f"dataset/{remainder}/prefetch{prefetch}/again"] = run_pass(data)


# distribute_datasets_from_function: process 0's pipeline has 3 steps of 4 elements, process
# 1's has 2 steps and 2 leftover elements (dropped with the usual warning).
def dataset_fn(ctx: jm.InputContext) -> list[np.ndarray]:
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id) == (2, me), ctx
    count = 12 if ctx.input_pipeline_id == 0 else 10
    return [np.full((2,), 10 * ctx.input_pipeline_id + i, np.float32) for i in range(count)]


for prefetch in (0, 2):
    data = strategy.distribute_datasets_from_function(dataset_fn, prefetch=prefetch)
    results[f"function/prefetch{prefetch}"] = run_pass(data)


# A source that raises on process 1 at its third batch: every process stops there.
def failing() -> list[np.ndarray] | object:
    def gen():
        for b, batch in enumerate(global_batches(5)):
            if me == 1 and b == 2:
                raise ValueError("process 1's loader broke")
            yield batch

    return gen()


for prefetch in (0, 2):
    data = strategy.distribute_dataset(failing, remainder="drop", prefetch=prefetch)
    results[f"error/prefetch{prefetch}"] = run_pass(data)


# Batches that differ between the processes beyond their rows, from the step named: every
# process stops there with a ValueError naming its own layout (never XLA's abort, or one
# dtype's bytes read as another's).
def shares(step_differs: int, kind: str) -> list[dict[str, np.ndarray]]:
    out = []
    for b in range(4):
        x = np.full((n, 3), b, np.float32)
        if me == 1 and b >= step_differs:
            if kind == "trailing":
                x = np.full((n, 4), b, np.float32)
            elif kind == "dtype":
                x = x.astype(np.int32)
        batch = {"x": x, "y": np.full((n,), b, np.int32)}
        if me == 1 and b >= step_differs and kind == "structure":
            del batch["y"]
        out.append(batch)
    return out


LAYOUTS = (("trailing", 1, True), ("dtype", 0, False), ("structure", 2, True))
for kind, step_differs, local in LAYOUTS:
    for prefetch in (0, 2):
        data = strategy.distribute_dataset(
            shares(step_differs, kind), remainder="drop", prefetch=prefetch, process_local=local
        )
        results[f"layout/{kind}/prefetch{prefetch}"] = run_pass(batch["x"] for batch in data)


def elements(ctx: jm.InputContext) -> list[np.ndarray]:
    width = 3 if ctx.input_pipeline_id == 0 else 5
    return [np.full((2, width), i, np.float32) for i in range(8)]


data = strategy.distribute_datasets_from_function(elements, prefetch=2)
results["layout/function"] = run_pass(data)

# Positions, per process: two batches, then resume from the position on a new dataset.
for prefetch in (0, 2):
    batches = global_batches(5 if me == 0 else 4)
    it = iter(strategy.distribute_dataset(batches, remainder="drop", prefetch=prefetch))
    first = [float(strategy.read(step(next(it)))) for _ in range(2)]
    position = json.loads(json.dumps(it.position))
    it.close()
    rest = strategy.distribute_dataset(batches, remainder="drop", prefetch=prefetch, start=position)
    results[f"position/prefetch{prefetch}"] = {
        "first": first,
        "position": position,
        **run_pass(rest),
    }

# The cost of agreeing per batch: steps per second over the same batches, several passes.
many = global_batches(1)[0:1] * 200
data = strategy.distribute_dataset(many, remainder="drop", prefetch=2)
run_pass(data)  # compile
start = time.perf_counter()
for _ in range(3):
    for batch in data:
        step(batch)
results["steps_per_s"] = 600 / (time.perf_counter() - start)

with open(f"{out_dir}/process{me}.json", "w") as f:
    json.dump(results, f, indent=1)
print("done", me)
