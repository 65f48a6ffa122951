"""What counting where the time goes costs a replicated call, in one process: prints figures.

    python benchmarks/step_stats_bench.py [--rounds 40] [--calls 500]

A tiny replicated step on one device (`w + x`: the call is almost all host work), called
`--calls` times per round, alternately (A B, then B A) as users call it (A: `step(w, x)`,
through the hook of `strategy.step_stats()` and of the profiler's steps) and through a
`__call__(self, *args, **kwargs)` that runs the same call without the hook (B: a call as it
was before it). Every call is timed on its own; prints the medians of A and B in nanoseconds,
their difference (what counting adds to a call) and their ratio. Pairing A and B in one
process, call by call, keeps the difference meaningful on a loaded machine, where
whole-process timings scatter by more than it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jmirror as jm  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--calls", type=int, default=500)
    args = parser.parse_args()

    strategy = jm.MirroredStrategy(num_devices=1)
    step = jm.replicate(lambda w, x: w + x, strategy=strategy)
    w, x = strategy.mirror((jnp.zeros(()), jnp.ones(())))

    class Before:  # the call without the hook
        def __call__(self, *args: object, **kwargs: object) -> object:
            return step._call(args, kwargs)

    before, clock = Before(), time.perf_counter
    with_hook: list[float] = []
    without: list[float] = []
    for i in range(args.rounds):
        pairs = [(with_hook, step), (without, before)]
        for times, call in pairs if i % 2 == 0 else pairs[::-1]:
            for _ in range(args.calls):
                began = clock()
                w = call(w, x)
                times.append(clock() - began)
    jax.block_until_ready(w)
    a, b = statistics.median(with_hook) * 1e9, statistics.median(without) * 1e9
    print(f"with_hook_ns {a:.0f} without_ns {b:.0f} hook_ns {a - b:.0f} ratio {a / b:.4f}")


if __name__ == "__main__":
    main()
