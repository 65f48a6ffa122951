"""Checkpoints of replicas spanning 2 devices with several processes, run as 2 processes x 4
host devices by tests/test_checkpoint_processes.py.

    python -m jmirror.launch --processes 2 --devices-per-process 4 \
        spanning_checkpoint_worker.py OUT_DIR

Each process trains the equivalence MLP for 3 steps on 4 replicas of 2 devices (kernels laid
out over the model axis by a regex layout), then one `jm.shard_update` step, and saves the
state with `jm.checkpoint.save` (OUT_DIR/plain) and an async manager (OUT_DIR/series, step 3);
then restores the plain one on the same layout. Then per-replica gradients of the laid-out
kernel and a sync-on-read ONLY_FIRST_REPLICA value of them: their components, gather, reduce
and read, and a checkpoint of them restored (OUT_DIR/grads). Each process writes what it
holds (each leaf assembled from its own shards) to OUT_DIR/process<i>.npz.
"""

import sys

import jax
import numpy as np
import optax
from jax.sharding import PartitionSpec as P
from preamble import join
from training import batches, init_state, loss_fn, make_step

jm = join(watchdog_s=120)

LAYOUT = [("kernel", P(None, "model"))]


def assembled(x):
    """The whole value of an array of which this process holds a whole copy."""
    out = np.zeros(x.shape, x.dtype)
    for shard in x.addressable_shards:
        out[shard.index] = np.asarray(shard.data)
    return out


def held(strategy, state, prefix, results):
    """What this process holds of a state, into `results`."""
    for key in ("params", "opt_state"):
        leaves = jax.tree.leaves(state[key])
        results[f"{prefix}/{key}"] = np.concatenate([np.ravel(assembled(x)) for x in leaves])
    sharded = jax.tree.leaves(strategy.read(state["sharded"]))
    results[f"{prefix}/sharded"] = np.concatenate([np.ravel(np.asarray(x)) for x in sharded])
    results[f"{prefix}/count"] = np.asarray(strategy.read(state["count"]))
    kernel = state["params"]["params"]["Dense_0"]["kernel"]
    results[f"{prefix}/kernel_spec"] = np.array(str(kernel.sharding.spec))
    results[f"{prefix}/kernel_shard"] = np.array(kernel.addressable_shards[0].data.shape)


def as_read(strategy, tree):
    """What `strategy.read` and `strategy.local_results` give of each mirrored leaf, whole:
    a read is laid out over this process's first replica's devices, a component per local
    replica over that replica's."""
    out = []
    for x in jax.tree.leaves(tree):
        read = strategy.read(x)
        copies = strategy.local_results(x)
        assert len(copies) == strategy.num_local_replicas, len(copies)
        assert read.sharding.device_set == set(strategy.replica_devices(first_local(strategy)))
        out.append(np.ravel(np.asarray(read)))
        for copy in copies:
            np.testing.assert_array_equal(np.asarray(copy), np.asarray(read))
    return np.concatenate(out)


def first_local(strategy):
    return strategy.topology.local_replica_ids[0]


strategy = jm.MultiWorkerMirroredStrategy(devices_per_replica=2, layout=LAYOUT)
assert (strategy.num_replicas, strategy.num_local_replicas) == (4, 2)
step_fn = jm.replicate(make_step(), strategy=strategy)
params, opt_state = strategy.mirror(init_state())  # laid out by the rules
count = strategy.sync_on_read(np.int32(0), "sum")
data = list(batches(strategy.num_replicas, steps=3))
for batch in strategy.distribute_dataset(data, remainder="drop"):
    params, opt_state, _, count = step_fn(params, opt_state, batch, count)

tx = jm.shard_update(optax.adam(1e-2), strategy=strategy)


def sharded_step(params, state, batch):
    updates, state = tx.update(jax.grad(loss_fn)(params, *batch), state, params)
    return state


sharded = jm.replicate(sharded_step, strategy=strategy)(params, tx.init(params), batch)
state = {"params": params, "opt_state": opt_state, "count": count, "sharded": sharded}

out_dir = sys.argv[1]
results: dict[str, np.ndarray] = {}
held(strategy, state, "trained", results)
results["trained/read"] = as_read(strategy, state["params"])
jm.checkpoint.save(f"{out_dir}/plain", state, strategy=strategy)
with jm.checkpoint.CheckpointManager(f"{out_dir}/series", strategy=strategy) as manager:
    manager.save(3, state)
target = {**state, "sharded": tx.init(params)}
again = jm.checkpoint.restore(f"{out_dir}/plain", target, strategy=strategy)
held(strategy, again, "again", results)


def grads_and_first(params, batch, first):
    """Per-replica gradients (the kernel's laid out over the model axis, as the parameters)
    and a sync-on-read ONLY_FIRST_REPLICA value of the kernel's."""
    grads = jax.grad(loss_fn)(params, *batch)
    return grads, first.replace(first.value + grads["params"]["Dense_0"]["kernel"])


def components(strategy, node):
    return np.stack([np.asarray(c) for c in strategy.local_results(node)])


per_replica = jm.replicate(grads_and_first, strategy=strategy, per_replica=lambda p, x: True)
first = strategy.sync_on_read(np.ones((16, 32), np.float32), "only_first_replica")
grads, first = per_replica(params, batch, first)
kernel = grads["params"]["Dense_0"]["kernel"]
results["grads/spec"] = np.array(str(kernel.values.sharding.spec))
results["grads/replicas"] = np.array(strategy.topology.local_replica_ids)
results["grads/local"] = components(strategy, kernel)
results["grads/gather"] = np.asarray(strategy.gather(kernel, axis=0))
results["grads/reduce"] = np.asarray(strategy.reduce("sum", kernel))
results["grads/first"] = np.asarray(strategy.read(first))
jm.checkpoint.save(f"{out_dir}/grads", {"grads": kernel, "first": first}, strategy=strategy)
back = jm.checkpoint.restore(f"{out_dir}/grads", strategy=strategy)
results["grads/restored"] = components(strategy, back["grads"])
results["grads/restored_first"] = np.asarray(strategy.read(back["first"]))
np.savez(f"{out_dir}/process{jax.process_index()}.npz", **results)
print("done", jax.process_index())
