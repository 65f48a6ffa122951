"""What counting where the time goes costs a replicated call, in one process: prints figures.

    python benchmarks/step_stats_bench.py [--repeat 9]

Times the hook of `strategy.step_stats()` and of the profiler's steps on its own, in pure
Python, so that the figure does not drown in the scatter of whole calls on a loaded machine:
a replicated function whose body is replaced by a stub that only does what a dispatched step
does for the counts (`Dispatch.track`'s `Recorder.dispatched`), called through its
`__call__` (A: the hook and the stub) and through a `__call__(self, *args, **kwargs)` that
calls the stub (B: a call as it was before the hook). Prints, in nanoseconds
per call, the best of `--repeat` runs of A - B (`hook_ns`) and of the stub's lookup
(`dispatched_ns`), their sum (`total_ns`, what counting adds to a call), the same in calls of
an empty Python function (`total_in_noop_calls`: a figure that a loaded machine scales less),
the median time of a real call of a tiny step on one device (`call_us`), and `total_ns`
against it (`ratio`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import timeit

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jmirror as jm  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=9)
    args = parser.parse_args()

    strategy = jm.MirroredStrategy(num_devices=1)
    step = jm.replicate(lambda w, x: w + x, strategy=strategy)
    w, x = strategy.mirror((jnp.zeros(()), jnp.ones(())))
    calls = []
    for _ in range(2000):
        began = time.perf_counter()
        w = step(w, x)
        calls.append(time.perf_counter() - began)
    jax.block_until_ready(w)
    call_us = statistics.median(calls[500:]) * 1e6

    recorder = strategy.dispatch.stats

    def stub(args: tuple, kwargs: dict) -> None:
        recorder.dispatched(step)  # what Dispatch.track does for the counts

    step._call = stub  # type: ignore[method-assign]
    number = 200_000

    def best(call) -> float:
        return min(timeit.repeat(call, number=number, repeat=args.repeat)) / number * 1e9

    class Before:  # a replicated function's call as it was without the hook
        def __call__(self, *args: object, **kwargs: object) -> None:
            stub(args, kwargs)

    before = Before()
    hook = best(lambda: step(w, x)) - best(lambda: before(w, x))
    dispatched = best(lambda: recorder.dispatched(step)) - best(lambda: None)
    total = hook + dispatched
    noop = best(lambda: None)  # the load on the machine: about 30-40 ns when idle
    print(
        f"hook_ns {hook:.0f} dispatched_ns {dispatched:.0f} total_ns {total:.0f} "
        f"noop_call_ns {noop:.0f} total_in_noop_calls {total / noop:.1f} "
        f"call_us {call_us:.2f} ratio {1 + total / (call_us * 1e3):.4f}"
    )


if __name__ == "__main__":
    main()
