"""A program run as 2 processes x 4 host devices by tests/test_shard_update.py.

    python -m jmirror.launch --processes 2 --devices-per-process 4 shard_worker.py OUT_DIR

Each process trains the equivalence MLP with `jm.shard_update(optax.lamb)` on both backends
(donating the state), reads the parameters and the whole optimizer state, saves a checkpoint
(OUT_DIR/<backend>) and writes what it read to OUT_DIR/process<i>.npz.
"""

import sys

import jax
import numpy as np
import optax
from preamble import join
from training import batches, init_state, loss_fn

jm = join()

out_dir = sys.argv[1]
results: dict[str, np.ndarray] = {}
for backend in ("pmap", "shard_map"):
    strategy = jm.MultiWorkerMirroredStrategy(backend=backend)
    tx = jm.shard_update(optax.lamb(1e-2), strategy=strategy)

    def train_step(params, opt_state, batch, tx=tx):
        grads = jax.grad(loss_fn)(params, *batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    step = jm.replicate(train_step, strategy=strategy, donate_argnums=(0, 1))

    params = strategy.mirror(init_state()[0])
    opt_state = tx.init(params)
    for batch in strategy.distribute_dataset(list(batches(8)), remainder="drop"):
        params, opt_state = step(params, opt_state, batch)
    read = strategy.read((params, opt_state))
    for i, leaf in enumerate(jax.tree.leaves(read)):
        results[f"{backend}/{i}"] = np.asarray(leaf)
    jm.checkpoint.save(
        f"{out_dir}/{backend}", {"params": params, "opt": opt_state}, strategy=strategy
    )
np.savez(f"{out_dir}/process{jax.process_index()}.npz", **results)
print("done", jax.process_index())
