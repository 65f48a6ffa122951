"""Several processes: steps/s of 2 processes x 4 host devices against 1 process x 8.

The benchmark MLP of `benchmarks/models.py` (64 -> hidden -> hidden -> 10, SGD, global batch
256, gradients all-reduced MEAN), trained by `jm.MultiWorkerMirroredStrategy` with
`jm.replicate` (with one process it is `MirroredStrategy()`). Two loops, measured after a
warm-up that compiles both, each timed over STEPS steps, ROUNDS times (the median printed):

  (a) step: the global batch placed once (its rows on each process's devices), reused;
  (b) input: the same batch, STEPS times, through `strategy.distribute_dataset` (prefetch=2)
      each round: placing each process's rows and, with several processes, the per-batch
      agreement that an uneven source never leaves a process waiting alone;
  (c) preempt: loop (a) with `manager.reached_preemption(step)` after every step, as the
      README's preemption loop does (JAX's preemption sync point with several processes).

Then the cost of `reached_preemption` alone: CALLS calls in a tight loop (increasing steps),
the median of ROUNDS, per call, and as a fraction of loop (a)'s median step.

Run it alone, then under the launcher:

    python benchmarks/processes_bench.py [--hidden 512] [--steps 40] [--rounds 5]
    python -m jmirror.launch --processes 2 --devices-per-process 4 \\
        benchmarks/processes_bench.py [--hidden 512] [--steps 40] [--rounds 5]

Alone, it runs on 8 XLA:CPU host devices. Only process 0 prints. The figures exclude start-up
(processes, the distributed runtime, gloo's connections) and compilation; time the whole
commands from outside (for example `/usr/bin/time -v`) for what a user waits. On one machine
the several processes talk through gloo over loopback and share its cores, so 2 x 4 is
expected to be slower there: this measures that cost, not a gain.
"""

import itertools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import _setup  # noqa: E402

_setup.start()  # first: nothing alone, joins the others under the launcher

import jax  # noqa: E402

import jmirror as jm  # noqa: E402
from benchmarks.models import FEATURES, GLOBAL_BATCH  # noqa: E402


def main() -> None:
    parser = _setup.options(__doc__, rounds=5)
    parser.add_argument("--calls", type=int, default=2000, help="reached_preemption calls")
    args = parser.parse_args()
    strategy = jm.MultiWorkerMirroredStrategy()
    training = _setup.train_mlp(strategy, args.hidden, mean_loss=True)
    x, y = training.batch
    assert x.shape == (GLOBAL_BATCH, FEATURES)
    placed = training.placed

    def run(batches) -> float:
        """Steps/s over `batches`, waiting for the last step."""
        start = time.perf_counter()
        loss = None
        steps = 0
        for batch in batches:
            loss = training.train(batch)
            steps += 1
        jax.block_until_ready(loss)
        return steps / (time.perf_counter() - start)

    def fed():
        return strategy.distribute_dataset([(x, y)] * args.steps, remainder="error")

    # Every process opens the manager on one directory (it never saves here).
    run_name = os.environ.get(jm.distributed.ENV_COORDINATOR, "alone").replace(":", "_")
    directory = f"{tempfile.gettempdir()}/jmirror_processes_bench_{run_name}"
    manager = jm.checkpoint.CheckpointManager(directory)
    counter = itertools.count(1)  # the steps given to reached_preemption: increasing

    def checked(batches):
        for batch in batches:
            yield batch
            if manager.reached_preemption(next(counter)):
                raise SystemExit("preempted during the benchmark")

    def calls() -> float:
        """Seconds per reached_preemption call, over args.calls calls."""
        start = time.perf_counter()
        for _ in range(args.calls):
            manager.reached_preemption(next(counter))
        return (time.perf_counter() - start) / args.calls

    run([placed] * 3)  # compile, warm up
    run(fed())
    run(checked([placed] * 3))
    rates: dict[str, list[float]] = {"step": [], "input": [], "preempt": []}
    per_call: list[float] = []
    for _ in range(args.rounds):  # interleaved, so that drift hits every loop alike
        rates["step"].append(run([placed] * args.steps))
        rates["input"].append(run(fed()))
        rates["preempt"].append(run(checked([placed] * args.steps)))
        per_call.append(calls())
    manager.close()
    if strategy.process_index == 0:
        layout = training.layout
        for name, values in rates.items():
            print(
                f"{layout} {name:>7}: {statistics.median(values):6.1f} steps/s "
                f"(median of {args.rounds} x {args.steps} steps; min {min(values):.1f}, "
                f"max {max(values):.1f}), MLP hidden {args.hidden}, global batch {GLOBAL_BATCH}"
            )
        step_s = 1 / statistics.median(rates["step"])
        call_s = statistics.median(per_call)
        loops = statistics.median(rates["step"]) / statistics.median(rates["preempt"])
        print(
            f"{layout} reached_preemption: {call_s * 1e6:.2f} us per call (median of "
            f"{args.rounds} x {args.calls} calls; min {min(per_call) * 1e6:.2f}, max "
            f"{max(per_call) * 1e6:.2f}) = {call_s / step_s:.4%} of a step of "
            f"{step_s * 1e3:.2f} ms; loop (c) / loop (a) step time: {loops:.3f}"
        )


if __name__ == "__main__":
    main()
