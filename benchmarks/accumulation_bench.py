"""Gradient accumulation reduced once per step against the landed recipe, in one run:
`python -m benchmarks.accumulation_bench`.

The landed recipe averaged each micro-batch's loss and gradients across the replicas inside
the `lax.scan` (a `jm.merge_call` of `strategy.reduce("mean", ...)`: one all-reduce per
micro-batch); `recipes.make_accumulating_train_step` now sums them on each replica and
reduces once. Both train the benchmark MLP (`benchmarks/models.py`) with SGD on 8 host
devices, global batch 256 cut into k micro-batches per replica; measured in the same
process, interleaved rounds, median:

- step time, the new step over the landed one;
- bytes all-reduced per step, from the compiled step's HLO (`jmirror.testing.collectives`,
  a collective in the loop counted once per micro-batch).

    python -m benchmarks.accumulation_bench [--k 4] [--hidden 512 2048] [--rounds 7] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import jmirror.testing as jmt

NUM_DEVICES = 8


def landed_step(loss_fn: Any, k: int, strategy: Any) -> Any:
    """The landed recipe: one all-reduce per micro-batch, from a `merge_call` in the scan."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    import jmirror as jm

    def mean_over_replicas(strategy: Any, tree: Any) -> Any:
        return strategy.reduce("mean", tree)

    def train_step(state: Any, batch: Any) -> Any:
        micro = jax.tree.map(lambda x: x.reshape((k, -1) + x.shape[1:]), batch)
        grad_fn = jax.value_and_grad(lambda p, b: loss_fn(p, *b))
        zeros = jax.tree.map(jnp.zeros_like, (jnp.zeros(()), state.params))

        def accumulate(total: Any, micro_batch: Any) -> tuple[Any, None]:
            loss_and_grads = jm.merge_call(
                mean_over_replicas, args=(grad_fn(state.params, micro_batch),)
            )
            return jax.tree.map(jnp.add, total, loss_and_grads), None

        (loss, grads), _ = lax.scan(accumulate, zeros, micro)
        grads = jax.tree.map(lambda g: g / k, grads)
        return state.apply_gradients(grads=grads), loss / k

    return jm.replicate(train_step, strategy=strategy)


def _setup(hidden: int, k: int) -> dict[str, Any]:
    import jax
    import numpy as np
    from flax.training.train_state import TrainState

    import jmirror as jm
    from benchmarks.models import make_problem
    from jmirror import recipes

    strategy = jm.MirroredStrategy()
    n = strategy.num_replicas
    params, tx, loss_fn, x, y = make_problem(hidden)
    state = strategy.mirror(TrainState.create(apply_fn=None, params=params, tx=tx))
    batch = jm.PerReplica(jax.tree.map(lambda a: np.reshape(a, (n, -1) + a.shape[1:]), (x, y)))
    steps = {
        "landed": landed_step(loss_fn, k, strategy),
        "once": recipes.make_accumulating_train_step(
            lambda p, b: loss_fn(p, *b), k, strategy=strategy
        ),
    }
    return {"state": state, "batch": batch, "steps": steps}


def _all_reduced_bytes(step: Any, state: Any, batch: Any) -> int:
    return sum(c.bytes for c in jmt.collectives(step.lower(state, batch)) if c.op == "all-reduce")


def measure(hidden: int, k: int, rounds: int, steps: int) -> dict[str, Any]:
    import jax

    setup = _setup(hidden, k)
    state, batch = setup["state"], setup["batch"]
    out: dict[str, Any] = {"hidden": hidden, "k": k}
    states = {}
    for name, step in setup["steps"].items():
        out[f"{name}_all_reduced_bytes"] = _all_reduced_bytes(step, state, batch)
        states[name], loss = step(state, batch)  # compiles
        jax.block_until_ready(loss)
    times: dict[str, list[float]] = {name: [] for name in setup["steps"]}
    for _ in range(rounds):
        for name, step in setup["steps"].items():  # alternated: the machine's load hits both
            current = states[name]
            start = time.perf_counter()
            for _ in range(steps):
                current, loss = step(current, batch)
            jax.block_until_ready(loss)
            times[name].append((time.perf_counter() - start) / steps)
            states[name] = current
    for name, values in times.items():
        out[f"{name}_step_ms"] = 1e3 * statistics.median(values)
    out["step_time_ratio"] = out["once_step_ms"] / out["landed_step_ms"]
    out["bytes_ratio"] = out["once_all_reduced_bytes"] / out["landed_all_reduced_bytes"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, default=4, help="micro-batches per replica batch")
    parser.add_argument("--hidden", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20, help="steps per timed round")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    jmt.set_host_device_count(NUM_DEVICES)
    results = [measure(h, args.k, args.rounds, args.steps) for h in args.hidden]
    for r in results:
        print(
            f"MLP hidden {r['hidden']}, k = {r['k']}: step {r['once_step_ms']:.2f} ms against "
            f"{r['landed_step_ms']:.2f} ms ({r['step_time_ratio']:.2f}x); all-reduced bytes per "
            f"step {r['once_all_reduced_bytes']:,} against {r['landed_all_reduced_bytes']:,} "
            f"({r['bytes_ratio']:.2f}x)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
