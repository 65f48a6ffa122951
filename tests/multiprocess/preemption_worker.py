"""Preemptible training of the equivalence MLP, run as 2 processes x 4 host devices by
tests/test_preemption.py under `python -m jmirror.launch`:

    preemption_worker.py OUT_DIR [--steps N] [--sleep S] [--ignore-preemption] [--helper]

Trains N steps (default 24) of `training.py`'s MLP with Adam on a deterministic source read
through `distribute_dataset`, with a `CheckpointManager` (async, `save_interval_steps=4`,
the input position as `data`), resuming from `manager.latest_step()` when there is one (as
after a restart or a preemption). At each step it follows the README's preemption loop:
`if manager.reached_preemption(step): save, close, exit 0` (or, with `--helper`,
`manager.save_and_exit_if_preempted`). `--ignore-preemption` never checks, so only SIGKILL
ends it. `--sigterm-before-manager`: process 1 sends itself SIGTERM before the manager opens
(and waits until every process has given JAX's preemption sync its step counter, which fixes
the step they agree on), as a notice that comes during start-up. It prints `pid P`, `start S
restart R`, `step K` and `preempted at step K`, sleeps S seconds (default 0.15) per step so
that a test can signal it mid-run, and at the end writes the trained parameters and optimizer
state to OUT_DIR/final<process>.npy.
"""

import argparse
import os
import signal
import sys
import time

import numpy as np
from preamble import join
from training import batches, init_state, make_step, save_final

from jmirror import _shim

# A watchdog: were a process ever stuck, it prints every thread's stack and ends.
jm = join(watchdog_s=150)

parser = argparse.ArgumentParser()
parser.add_argument("out_dir")
parser.add_argument("--steps", type=int, default=24)
parser.add_argument("--sleep", type=float, default=0.15)
parser.add_argument("--ignore-preemption", action="store_true")
parser.add_argument("--helper", action="store_true")
parser.add_argument("--sigterm-before-manager", action="store_true")
options = parser.parse_args()


def _wait_until_the_step_is_fixed(count, bound_s=120):
    """Waits until every process has given JAX's preemption sync its step counter.

    The processes agree on one past the largest counter; each holds its counter from the
    moment it gives it until they agree. So from then on the step is fixed, whenever the
    agreement itself completes. (A fixed sleep here was too short on a loaded machine: the
    other process then reached its first step first, and they agreed on the next one.)
    """
    client = _shim.distributed_client()
    deadline = time.monotonic() + bound_s
    while len(client.key_value_dir_get("PREEMPTION_CURRENT_COUNTER/")) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"JAX's preemption sync did not start within {bound_s} s")
        time.sleep(0.05)


def main():
    strategy = jm.MultiWorkerMirroredStrategy()
    me = strategy.process_index
    print(f"pid {os.getpid()}", flush=True)
    step_fn = jm.replicate(make_step(), strategy=strategy)
    params, opt_state = strategy.mirror(init_state())
    count = strategy.sync_on_read(np.int32(0), "sum")
    if options.sigterm_before_manager and me == 1:
        os.kill(os.getpid(), signal.SIGTERM)  # JAX's runtime catches it
        _wait_until_the_step_is_fixed(strategy.num_processes)
    manager = jm.checkpoint.CheckpointManager(
        f"{options.out_dir}/checkpoints", save_interval_steps=4, max_to_keep=3
    )
    first, position = 1, None
    latest = manager.latest_step()
    if latest is not None:
        params, opt_state = manager.restore(target=(params, opt_state))
        position = manager.data()
        first = latest + 1
    restart = os.environ.get(jm.distributed.ENV_RESTART)
    print(f"start {first} restart {restart}", flush=True)

    def source():
        return batches(strategy.num_replicas, steps=options.steps)

    iterator = iter(strategy.distribute_dataset(source, remainder="drop", start=position))
    for step in range(first, options.steps + 1):
        params, opt_state, _, count = step_fn(params, opt_state, next(iterator), count)
        state = (params, opt_state)
        manager.save(step, state, data=iterator.position)  # every 4th step
        print(f"step {step}", flush=True)
        if not options.ignore_preemption:
            if options.helper:
                if manager.reached_preemption(step):
                    print(f"preempted at step {step}", flush=True)
                manager.save_and_exit_if_preempted(step, state, data=iterator.position)
            elif manager.reached_preemption(step):
                print(f"preempted at step {step}", flush=True)
                manager.save(step, state, data=iterator.position)
                manager.close()
                sys.exit(0)
        time.sleep(options.sleep)
    manager.close()
    iterator.close()
    save_final(strategy, options.out_dir, params, opt_state)


main()
