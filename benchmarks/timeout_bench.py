"""The cost of `timeout_s`: steps/s with `timeout_s=300` against `timeout_s=None`, one run.

The benchmark MLP of `benchmarks/models.py` (64 -> hidden -> hidden -> 10, SGD, global batch
256, gradients all-reduced MEAN), trained by two `jm.MultiWorkerMirroredStrategy`s over the
same devices, one with the default `timeout_s=300` (every step and read watched by
`jmirror._deadline`) and one with `timeout_s=None` (nothing watched, no thread). Two loops
each, timed over STEPS steps, ROUNDS times, interleaved (None, 300, None, 300, ...) so that
drift on a shared machine hits both alike; the median ratio is printed:

  (a) step: the replicated step alone;
  (b) step+read: the step and a `strategy.reduce` of its loss, read on the host every step.

    python benchmarks/timeout_bench.py [--hidden 512] [--steps 40] [--rounds 7]
    python -m jmirror.launch --processes 2 --devices-per-process 4 \\
        benchmarks/timeout_bench.py [--hidden 512] [--steps 40] [--rounds 7]

Alone (1 x 8 host devices) there is no other process to wait for, so nothing is watched
either way: the ratio shows the cost of the check that says so. Last, what a step with a
timeout adds on the caller's thread (one `jmirror._deadline.bounded` block around its
dispatch, one `watch` of its output) is timed directly; it starts the watchdog's threads in
that process. Only process 0 prints.
"""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import _setup  # noqa: E402

_setup.start()  # first: nothing alone, joins the others under the launcher

import jax  # noqa: E402

import jmirror as jm  # noqa: E402


def make_loop(timeout_s, hidden):
    strategy = jm.MultiWorkerMirroredStrategy(timeout_s=timeout_s)
    # The loss stays per replica: the step+read loop reduces it on the host.
    training = _setup.train_mlp(strategy, hidden, mean_loss=False)

    def run(steps: int, read: bool) -> float:
        """Steps/s over `steps` steps, waiting for the last one."""
        start = time.perf_counter()
        loss = None
        for _ in range(steps):
            loss = training.train(training.placed)
            if read:
                float(strategy.reduce("mean", loss))
        jax.block_until_ready((training.params, training.opt_state, loss))
        return steps / (time.perf_counter() - start)

    return training, run


def main() -> None:
    args = _setup.options(__doc__, rounds=7).parse_args()
    loops = {timeout: make_loop(timeout, args.hidden) for timeout in (None, 300)}
    for _, run in loops.values():  # compile, warm up
        run(3, False)
        run(3, True)
    rates = {(t, read): [] for t in loops for read in (False, True)}
    for _ in range(args.rounds):
        for read in (False, True):
            for timeout, (_, run) in loops.items():
                rates[timeout, read].append(run(args.steps, read))
    training = loops[300][0]
    watch_us, bounded_us = watch_cost()
    if training.strategy.process_index != 0:
        return
    layout = training.layout
    for read in (False, True):
        name = "step+read" if read else "step"
        off, on = rates[None, read], rates[300, read]
        ratios = [b / a for a, b in zip(off, on)]
        print(
            f"{layout} {name:>9}: timeout_s=None {statistics.median(off):6.1f} steps/s, "
            f"timeout_s=300 {statistics.median(on):6.1f} steps/s, ratio (300 / None) "
            f"{statistics.median(ratios):.3f} (median of {args.rounds} interleaved rounds of "
            f"{args.steps} steps; min {min(ratios):.3f}, max {max(ratios):.3f}), MLP hidden "
            f"{args.hidden}"
        )
    print(
        f"{layout} jmirror._deadline: watch {watch_us:.2f} us, bounded {bounded_us:.2f} us per "
        "call (what timeout_s adds to a step on the caller's thread: one of each; median of "
        "5 x 20000 calls, on a finished output)"
    )


def watch_cost() -> tuple[float, float]:
    """Microseconds per `_deadline.watch` call and per empty `_deadline.bounded` block: what
    `timeout_s` adds to a step (its dispatch is bounded, its output watched)."""
    from jmirror import _deadline

    token = jax.numpy.zeros(())
    token.block_until_ready()

    def per_call(fn) -> float:
        times = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(20000):
                fn()
            times.append((time.perf_counter() - start) / 20000 * 1e6)
            time.sleep(0.5)  # let the waiter drain the queue
        return statistics.median(times)

    def bounded() -> None:
        with _deadline.bounded("benchmark", 300.0):
            pass

    return per_call(lambda: _deadline.watch(token, "benchmark", 300.0)), per_call(bounded)


if __name__ == "__main__":
    main()
