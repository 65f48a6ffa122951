"""Training that continues on fewer processes, run by tests/test_launch_elastic.py:

    python -m jmirror.launch --processes 4 --min-processes 3 --max-restarts 1 \
        --devices-per-process 2 elastic_worker.py CHECKPOINTS OUT_DIR \
        [--kill-at K] [--copy-on-restart DIR]

Trains `training.py`'s MLP with Adam for 6 steps on global batches of 24 examples (the same
batches whatever the number of replicas N: 24 / N per replica; a count that does not divide
24 is `distribute_dataset(remainder="error")`'s `ValueError` at the first batch, before the
first step), saving every step in a `CheckpointManager` on CHECKPOINTS with the input
position as `data`, and resuming from `manager.latest_step()` when there is one.

`--kill-at K`: in the first start (`JMIRROR_RESTART=0`) every process waits at step K until
that step is saved, then the last process SIGKILLs itself. `--copy-on-restart DIR`: in a
restarted start, process 0 copies CHECKPOINTS to DIR before opening the manager (the writer's
first act), so that an oracle run can start from the very checkpoint this run resumed from.

Prints `start FIRST restart R processes P replicas N`, `step K`; writes the trained parameters
and optimizer state to OUT_DIR/final<process>.npy.
"""

import argparse
import os
import shutil
import signal

import numpy as np
from preamble import join
from training import batches, init_state, make_step, save_final

# A watchdog: were a process ever stuck, it prints every thread's stack and ends.
jm = join(watchdog_s=100)

STEPS = 6
GLOBAL_BATCH = 24  # divisible by 8 (4 x 2 devices) and 6 (3 x 2)

parser = argparse.ArgumentParser()
parser.add_argument("checkpoints")
parser.add_argument("out_dir")
parser.add_argument("--kill-at", type=int)
parser.add_argument("--copy-on-restart")
options = parser.parse_args()


def main():
    strategy = jm.MultiWorkerMirroredStrategy()
    me, restart = strategy.process_index, os.environ.get(jm.distributed.ENV_RESTART, "0")
    if options.copy_on_restart and restart != "0" and me == 0:
        shutil.copytree(options.checkpoints, options.copy_on_restart)
    step_fn = jm.replicate(make_step(), strategy=strategy)
    params, opt_state = strategy.mirror(init_state())
    count = strategy.sync_on_read(np.int32(0), "sum")  # not saved: only the step needs it
    manager = jm.checkpoint.CheckpointManager(options.checkpoints)
    first, position = 1, None
    if manager.latest_step() is not None:
        first = manager.latest_step() + 1
        params, opt_state = manager.restore(target=(params, opt_state))
        position = manager.data()
    print(
        f"start {first} restart {restart} processes {strategy.num_processes} "
        f"replicas {strategy.num_replicas}",
        flush=True,
    )

    def source():  # the same global batches on every process, whatever N
        return batches(1, steps=STEPS, per_replica=GLOBAL_BATCH, seed=5)

    data = strategy.distribute_dataset(source, remainder="error", start=position)
    iterator = iter(data)
    for step in range(first, STEPS + 1):
        params, opt_state, _, count = step_fn(params, opt_state, next(iterator), count)
        manager.save(step, (params, opt_state), data=iterator.position)
        print(f"step {step}", flush=True)
        if step == options.kill_at and restart == "0":
            manager.wait_until_finished()  # on every process: the step is complete
            if me == strategy.num_processes - 1:
                print(f"process {me} kills itself after step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
    manager.close()
    iterator.close()
    save_final(strategy, options.out_dir, params, opt_state)


main()
