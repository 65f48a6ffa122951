"""A program run as 2 processes x 4 host devices by tests/test_multi_worker.py.

    python -m jmirror.launch --processes 2 --devices-per-process 4 strategy_worker.py OUT_DIR

Each process trains the equivalence MLP with `jm.MultiWorkerMirroredStrategy` on both
backends, exercises the cross-replica reads, and writes what it saw to OUT_DIR/process<i>.npz
for the test to compare with one process of 8 devices.
"""

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from preamble import join
from training import (
    batches,
    init_state,
    make_step,
    metric_reads,
    metric_values,
    nnx_training,
)

jm = join()


def module_values(strategy, backend: str) -> dict[str, np.ndarray]:
    """What a PerReplica and a SyncOnRead of an equinox module give on this process: its
    replicas' components, a reduce, a replicated call's outputs and the reads, with the
    module's function kept in each (or the error, so that only its test fails)."""
    import equinox as eqx

    model = eqx.nn.MLP(3, 2, 4, 1, activation=jax.nn.tanh, key=jax.random.key(0))

    def shifted(ctx):
        return jax.tree.map(lambda a: a + ctx.replica_id if eqx.is_array(a) else a, model)

    seen: dict[str, object] = {}
    try:
        values = strategy.distribute_values_from_function(shifted)
        parts = strategy.local_results(values)
        mean = strategy.reduce("mean", values)
        call = jm.replicate(lambda m, x: jax.vmap(m)(x), strategy=strategy)
        outputs = strategy.local_results(call(values, np.ones((2, 3), np.float32)))
        aggregations = ("sum", "mean", "only_first_replica")
        reads = [strategy.read(strategy.sync_on_read(model, a)) for a in aggregations]
        modules = [*parts, mean, *reads]
        seen["kept"] = all(m.activation is model.activation for m in modules)
        seen["local"] = np.stack([np.asarray(p.layers[0].weight) for p in parts])
        seen["mean"] = np.asarray(mean.layers[0].weight)
        seen["reads"] = np.stack([np.asarray(r.layers[0].weight) for r in reads])
        seen["outputs"] = np.stack([np.asarray(o) for o in outputs])
        seen["error"] = ""
    except Exception as error:  # recorded: the test names it
        seen["error"] = f"{type(error).__name__}: {error}"
    return {f"{backend}/module/{key}": np.asarray(value) for key, value in seen.items()}


out_dir = sys.argv[1]
results: dict[str, np.ndarray] = {}
for backend in ("pmap", "shard_map"):
    strategy = jm.MultiWorkerMirroredStrategy(backend=backend)
    n = strategy.num_replicas
    assert strategy.num_processes == 2 and strategy.num_local_replicas == 4, strategy
    step = jm.replicate(make_step(), strategy=strategy)
    params, opt_state = strategy.mirror(init_state())
    count = strategy.sync_on_read(np.int32(0), "sum")
    data = strategy.distribute_dataset(list(batches(n)), remainder="drop")
    for batch in data:
        params, opt_state, loss, count = step(params, opt_state, batch, count)
    flat = jax.tree.leaves(strategy.read(params))
    results[f"{backend}/params"] = np.concatenate([np.ravel(np.asarray(p)) for p in flat])
    results[f"{backend}/loss"] = np.asarray(strategy.read(loss))
    results[f"{backend}/count"] = np.asarray(strategy.read(count))
    ids = strategy.run(lambda: jnp.float32(jm.replica_id()))
    results[f"{backend}/gather"] = np.asarray(strategy.gather(ids))
    results[f"{backend}/reduce_sum"] = np.asarray(strategy.reduce("sum", ids))
    results[f"{backend}/reduce_mean"] = np.asarray(strategy.reduce("mean", ids))
    results[f"{backend}/local_results"] = np.asarray(
        [float(v) for v in strategy.local_results(ids)]
    )
    values = strategy.distribute_values_from_function(lambda ctx: np.float32(ctx.replica_id))
    results[f"{backend}/values_sum"] = np.asarray(strategy.reduce("sum", values))
    mine = jm.PerReplica(
        np.full((strategy.num_local_replicas, 2), strategy.process_index, np.float32)
    )
    total = jm.replicate(lambda v: jm.all_reduce("sum", v), strategy=strategy)(mine)
    results[f"{backend}/user_per_replica_sum"] = np.asarray(strategy.read(total))
    # Host reads of values the user built from this process's components: over every replica.
    ranks = np.arange(4, dtype=np.float32) + 4 * strategy.process_index  # global replica ids
    user = jm.PerReplica(ranks)
    results[f"{backend}/user/reduce_sum"] = np.asarray(strategy.reduce("sum", user))
    results[f"{backend}/user/reduce_max"] = np.asarray(strategy.reduce("max", user))
    results[f"{backend}/user/gather"] = np.asarray(strategy.gather(user))
    for aggregation in ("sum", "mean", "only_first_replica"):
        value = jm.SyncOnRead(ranks, aggregation)
        results[f"{backend}/user/read_{aggregation}"] = np.asarray(strategy.read(value))
    results.update(module_values(strategy, backend))
    # NNX metrics (sync-on-read): each process passes its own replicas' rows of the values.
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average(), stats=nnx.metrics.Welford())
    update = jm.replicate(lambda m, v: m.update(values=v), strategy=strategy)
    local = slice(4 * strategy.process_index, 4 * strategy.process_index + 4)
    for values in metric_values(n):
        update(metrics, jm.PerReplica(values[local]))
    computed = strategy.read(metrics).compute()
    for name, value in metric_reads(strategy).items():
        results[f"{backend}/metrics/{name}"] = value
    losses, state, steps, again = nnx_training(strategy, checkpoint_dir=f"{out_dir}/nnx_{backend}")
    results[f"{backend}/nnx_again"] = again
    results[f"{backend}/nnx_losses"], results[f"{backend}/nnx_state"] = losses, state
    results[f"{backend}/nnx_steps"] = np.asarray(steps)
    results[f"{backend}/metric_average"] = np.asarray(computed["loss"])
    for field in dataclasses.fields(computed["stats"]):
        value = getattr(computed["stats"], field.name)
        results[f"{backend}/metric_welford_{field.name}"] = np.asarray(value)


def unplaced_arguments(strategy) -> dict[str, np.ndarray]:
    """What calls given state nobody placed do on this process: a `TrainState.create` state (a
    Python number step, arrays on one device) trained 3 steps, with its compile count; sums
    over the replicas of an array committed to one of this process's devices and of one laid
    out on a mesh of this process's devices (or the errors, so that only their test fails)."""
    import optax
    from flax.training.train_state import TrainState
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    seen: dict[str, object] = {}
    state = TrainState.create(apply_fn=None, params={"w": jnp.ones(3)}, tx=optax.sgd(0.1))

    def train(state, x):
        grads = jax.grad(lambda p: jnp.sum(p["w"] * x))(state.params)
        return state.apply_gradients(grads=jm.all_reduce("mean", grads))

    step = jm.replicate(train, strategy=strategy)
    for _ in range(3):
        state = step(state, np.ones(3, np.float32))
    seen["compiles"] = step.num_compilations
    seen["step"] = strategy.read(state.step)
    seen["w"] = strategy.read(state.params["w"])
    # A Python rate float32 cannot hold exactly, and a weakly typed scalar with bfloat16.
    scale = jm.replicate(lambda a, x, rate: a * x * rate, strategy=strategy)
    half = scale(jnp.asarray(0.5), jnp.ones(2, jnp.bfloat16), 0.1)
    seen["weak_dtype"] = str(half.dtype)
    seen["weak_value"] = strategy.read(half).astype(np.float32)
    # Weakly typed state not yet on a device (as libraries make it): compiled once, still weak.
    count = jm.replicate(lambda s: {"t": s["t"] + 1, "w": s["w"] * 2.0}, strategy=strategy)
    counted = {"t": jnp.asarray(0), "w": jnp.ones(2)}
    for _ in range(3):
        counted = count(counted)
    seen["weak_state"] = [count.num_compilations, counted["t"].weak_type]
    # A random key mirrored: process 0's, on every process (as an NNX model's Rngs).
    mirrored = strategy.mirror({"key": jax.random.key(strategy.process_index)})
    seen["mirrored_key"] = jax.random.key_data(strategy.read(mirrored["key"]))
    total = jm.replicate(lambda v: jm.all_reduce("sum", v), strategy=strategy)
    devices = jax.local_devices()
    local_mesh = NamedSharding(Mesh(np.array(devices), ("data",)), PartitionSpec("data"))
    reversed_mesh = NamedSharding(
        Mesh(np.array(jax.devices()[::-1]), ("data",)), PartitionSpec("data")
    )
    host = np.arange(8.0, dtype=np.float32)
    given = {
        "committed": jax.device_put(jnp.arange(4.0), devices[1]),
        "local_mesh": jax.device_put(jnp.arange(4.0), local_mesh),
        "reversed_mesh": jax.make_array_from_callback((8,), reversed_mesh, lambda i: host[i]),
    }
    for name, value in given.items():
        try:
            seen[name] = strategy.read(total(value))
        except Exception as error:  # recorded: the test names it
            seen[name] = f"{type(error).__name__}: {error}"
    return {f"unplaced/{key}": np.asarray(value) for key, value in seen.items()}


results.update(unplaced_arguments(strategy))
try:
    jm.replicate(lambda v: v, strategy=strategy)(jm.PerReplica(np.zeros((8, 2), np.float32)))
    results["wrong_size_error"] = np.asarray("")
except ValueError as e:
    results["wrong_size_error"] = np.asarray(str(e))
np.savez(f"{out_dir}/process{jax.process_index()}.npz", **results)
print("done", jax.process_index())
