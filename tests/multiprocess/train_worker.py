"""A program run as several processes by tests/test_two_hosts.py.

    train_worker.py OUT_DIR

Joins the run the `JMIRROR_*` variables describe (`jm.distributed.initialize()`), trains the
equivalence MLP of training.py for 6 steps with `jm.MultiWorkerMirroredStrategy`, and writes
the parameters and the last loss it read to OUT_DIR/process<i>.npz, for the test to compare
with one process of 8 devices.
"""

import socket
import sys

import jax
import numpy as np
from preamble import join
from training import batches, init_state, make_step

jm = join()

strategy = jm.MultiWorkerMirroredStrategy()
print(f"process {strategy.process_index} on host {socket.gethostname()}", flush=True)
step = jm.replicate(make_step(), strategy=strategy)
params, opt_state = strategy.mirror(init_state())
count = strategy.sync_on_read(np.int32(0), "sum")
for batch in strategy.distribute_dataset(list(batches(strategy.num_replicas)), remainder="drop"):
    params, opt_state, loss, count = step(params, opt_state, batch, count)
flat = jax.tree.leaves(strategy.read(params))
np.savez(
    f"{sys.argv[1]}/process{strategy.process_index}.npz",
    params=np.concatenate([np.ravel(np.asarray(p)) for p in flat]),
    loss=np.asarray(strategy.read(loss)),
    count=np.asarray(strategy.read(count)),
)
print("done", strategy.process_index)
