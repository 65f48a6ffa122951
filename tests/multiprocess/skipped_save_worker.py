"""A program run as 2 processes x 2 host devices by tests/test_checkpoint_processes.py.

    skipped_save_worker.py TIMEOUT DIR

Trains over `strategy.distribute_dataset` with `timeout_s=TIMEOUT`, the state only mirrored
parameters and optimizer state (no per-replica leaf), and saves it with a
`CheckpointManager(DIR)` and the input position as `data` at steps 2 and 4; process 1 skips
the save of step 4 and goes on to its next batch. Each process prints what it does, and the
keys of the checkpoint saves left in the coordination service's store after step 2.
"""

import sys

import jax
import numpy as np
import optax
from preamble import join

import jmirror as jm
from jmirror import _shim

timeout, directory = float(sys.argv[1]), sys.argv[2]
join(timeout_s=timeout, watchdog_s=timeout + 120)
strategy = jm.MultiWorkerMirroredStrategy(timeout_s=timeout)
me = strategy.process_index
tx = optax.sgd(0.1)


def loss_fn(w, x, y):
    return ((x @ w - y) ** 2).mean()


def train_step(w, opt_state, batch):
    x, y = batch
    grads = jm.all_reduce("mean", jax.grad(loss_fn)(w, x, y))
    updates, opt_state = tx.update(grads, opt_state, w)
    return optax.apply_updates(w, updates), opt_state


step = jm.replicate(train_step, strategy=strategy)
rng = np.random.default_rng(0)
source = [
    (rng.normal(size=(8, 3)).astype(np.float32), rng.normal(size=(8, 1)).astype(np.float32))
    for _ in range(8)
]
w = strategy.mirror(np.zeros((3, 1), np.float32))
opt_state = strategy.mirror(tx.init(np.zeros((3, 1), np.float32)))
manager = jm.checkpoint.CheckpointManager(directory, strategy=strategy)
batches = iter(strategy.distribute_dataset(source, remainder="drop"))
for k, batch in enumerate(batches, 1):
    w, opt_state = step(w, opt_state, batch)
    if k == 4 and me == 1:
        print(f"process {me} skips the save of step {k}", flush=True)
    elif k in (2, 4):
        print(f"process {me} saves step {k}", flush=True)
        manager.save(k, {"w": w, "opt_state": opt_state}, data=batches.position)
        print(f"process {me} saved step {k}", flush=True)
        if k == 2:  # both processes are past the save: no key of it is left in the store
            manager.wait_until_finished()
            left = _shim.distributed_client().key_value_dir_get("jmirror/checkpoint")
            print(f"process {me} keys left after step {k}: {left}", flush=True)
print(f"process {me} finished its input", flush=True)
manager.close()
