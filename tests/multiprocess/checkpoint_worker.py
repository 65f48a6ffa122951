"""Checkpoints with several processes, run as 2 processes x 4 host devices by
tests/test_checkpoint_processes.py.

    python -m jmirror.launch --processes 2 --devices-per-process 4 checkpoint_worker.py \
        save OUT_DIR
    python -m jmirror.launch --processes 2 --devices-per-process 4 checkpoint_worker.py \
        restore CHECKPOINT_DIR OUT_DIR

`save` trains the equivalence MLP for 6 steps and saves every step with an async manager
(max_to_keep=2, step 6 replaced once with force=True; data: the process index), steps 3 and 6
with a sync manager (data: the input position) and one `jm.checkpoint.save` (replaced once);
then restores them on the same layout. `restore` reads a manager's
directory written by one process of 8 devices. Each process writes what it saw to
OUT_DIR/process<i>.npz.
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from preamble import join
from training import batches, init_state, make_step

# A watchdog for the test: were a process ever stuck, it prints every thread's stack and ends,
# so the test fails with where it stood instead of at the harness's timeout.
jm = join(watchdog_s=90)

BIG = (256, 1024)  # a 1 MiB mirrored leaf, so that bytes on disk measure copies


def flat(strategy, tree):
    leaves = jax.tree.leaves(strategy.read(tree))
    return np.concatenate([np.ravel(np.asarray(x)) for x in leaves])


def components(strategy, node, as_array=np.asarray):
    return np.stack([as_array(c) for c in strategy.local_results(node)])


def seen(strategy, state, prefix, results):
    """What this process reads of a (restored) state, into `results`."""
    results[f"{prefix}/params"] = flat(strategy, state["params"])
    results[f"{prefix}/opt_state"] = flat(strategy, state["opt_state"])
    results[f"{prefix}/big"] = np.asarray(strategy.read(state["big"]))
    results[f"{prefix}/count"] = np.asarray(strategy.read(state["count"]))
    results[f"{prefix}/count_components"] = components(strategy, state["count"])
    results[f"{prefix}/ids"] = components(strategy, state["ids"])
    results[f"{prefix}/keys"] = components(strategy, state["keys"], jax.random.key_data)
    if "mine" in state:
        results[f"{prefix}/mine"] = components(strategy, state["mine"])


def save(strategy, out_dir, results):
    me = strategy.process_index
    step_fn = jm.replicate(make_step(), strategy=strategy)
    params, opt_state = strategy.mirror(init_state())
    count = strategy.sync_on_read(np.int32(0), "sum")
    big = np.random.default_rng(me).standard_normal(BIG).astype(np.float32)  # mirror: process 0's
    fixed = {
        "big": strategy.mirror(big),
        "ids": strategy.run(lambda: jnp.float32(jm.replica_id())),  # PerReplica of all 8
        "keys": strategy.split_key(jax.random.key(1)),
        "mine": jm.PerReplica(np.full((strategy.num_local_replicas, 2), me, np.float32)),
    }
    blocked = []
    data = strategy.distribute_dataset(list(batches(strategy.num_replicas)), remainder="drop")
    iterator = iter(data)
    async_manager = jm.checkpoint.CheckpointManager(f"{out_dir}/async", max_to_keep=2)
    with (
        async_manager,
        jm.checkpoint.CheckpointManager(f"{out_dir}/sync", async_save=False) as sync_manager,
    ):
        for step, batch in enumerate(iterator, 1):
            params, opt_state, _, count = step_fn(params, opt_state, batch, count)
            state = {"params": params, "opt_state": opt_state, "count": count, **fixed}
            start = time.perf_counter()
            async_manager.save(step, state, data={"process": me, "step": step})
            blocked.append(time.perf_counter() - start)
            if step % 3 == 0:  # the same data on every process: a 1-process run can read it
                sync_manager.save(step, state, data=iterator.position)
        async_manager.save(6, state, data={"process": me, "forced": True}, force=True)
        results["async/all_steps"] = np.asarray(async_manager.all_steps())
        results["sync/all_steps"] = np.asarray(sync_manager.all_steps())
        results["async/data"] = np.asarray(str(async_manager.data()))
        results["sync/data3"] = np.asarray(str(sync_manager.data(3)))
        seen(strategy, async_manager.restore(), "async", results)
        seen(strategy, sync_manager.restore(3), "sync3", results)
    results["blocked_s"] = np.asarray(blocked)
    jm.checkpoint.save(f"{out_dir}/plain", state)
    jm.checkpoint.save(f"{out_dir}/plain", {**state, "count": count}, force=True)
    seen(strategy, jm.checkpoint.restore(f"{out_dir}/plain"), "plain", results)
    seen(strategy, state, "trained", results)
    blocker = f"{out_dir}/a_file"  # process 0 cannot make a checkpoint below a file
    open(blocker, "w").close()
    try:
        jm.checkpoint.save(f"{blocker}/ckpt", {"n": 1})
        results["failed_save"] = np.asarray("")
    except Exception as e:
        results["failed_save"] = np.asarray(f"{type(e).__name__}: {e}")


def restore(strategy, checkpoint_dir, results):
    with jm.checkpoint.CheckpointManager(checkpoint_dir) as manager:
        results["all_steps"] = np.asarray(manager.all_steps())
        results["data"] = np.asarray(str(manager.data()))
        seen(strategy, manager.restore(), "restored", results)


def main():
    strategy = jm.MultiWorkerMirroredStrategy()
    assert strategy.num_processes == 2 and strategy.num_local_replicas == 4, strategy
    results: dict[str, np.ndarray] = {}
    if sys.argv[1] == "save":
        out_dir = sys.argv[2]
        save(strategy, out_dir, results)
    else:
        out_dir = sys.argv[3]
        restore(strategy, sys.argv[2], results)
    np.savez(f"{out_dir}/process{strategy.process_index}.npz", **results)
    print("done", strategy.process_index)


main()
