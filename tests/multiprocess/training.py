"""The training of the data-parallel equivalence test, shared by the multi-process worker and
the test that checks it against one process."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmirror as jm

TX = optax.adam(1e-2)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(32)(x))
        return nn.Dense(10)(x)


def loss_fn(params, x, y):
    logits = MLP().apply(params, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def batches(n, steps=6, per_replica=4, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        x = rng.normal(size=(n * per_replica, 16)).astype(np.float32)
        y = rng.integers(0, 10, size=(n * per_replica,)).astype(np.int32)
        yield x, y


def init_state():
    params = MLP().init(jax.random.key(0), jnp.zeros((1, 16)))
    return params, TX.init(params)


def make_step():
    def step(params, opt_state, batch, count):
        x, y = batch
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        grads = jm.all_reduce("mean", grads)
        updates, opt_state = TX.update(grads, opt_state, params)
        count = count.replace(count.value + jnp.int32(x.shape[0]))
        return optax.apply_updates(params, updates), opt_state, jm.all_reduce("mean", loss), count

    return step


def train(strategy):
    """`make_step` over `batches` of all replicas from `init_state`: the flat parameters, the
    last loss and the example count, read (the one-process oracle of the several-process
    tests)."""
    step = jm.replicate(make_step(), strategy=strategy)
    params, opt_state = strategy.mirror(init_state())
    count = strategy.sync_on_read(np.int32(0), "sum")
    for batch in strategy.distribute_dataset(list(batches(8)), remainder="drop"):
        params, opt_state, loss, count = step(params, opt_state, batch, count)
    flat = jax.tree.leaves(strategy.read(params))
    flat = np.concatenate([np.ravel(np.asarray(p)) for p in flat])
    return flat, strategy.read(loss), count


def save_final(strategy, out_dir, params, opt_state):
    """Ends a worker's training: its final parameters and optimizer state, read and flattened,
    to OUT_DIR/final<process>.npy (what the tests compare with an uninterrupted run)."""
    read = jax.tree.leaves(strategy.read((params, opt_state)))
    final = np.concatenate([np.ravel(np.asarray(x)) for x in read])
    np.save(f"{out_dir}/final{strategy.process_index}.npy", final)
    print("done", flush=True)


def metric_values(n, steps=3, seed=2):
    """Values for NNX metrics, one row per replica: a different count of real values in each
    replica's row would need masking, so every row has 5, spread differently per replica."""
    rs = np.random.RandomState(seed)
    for _ in range(steps):
        yield (rs.randn(n, 5) * (1 + np.arange(n)[:, None]) + np.arange(n)[:, None]).astype(
            np.float32
        )


def nnx_training(strategy, steps=4, per_replica=4, checkpoint_dir=None):
    """An NNX model (BatchNorm over the replicas, Dropout with per-replica rngs) and its
    `nnx.Optimizer`, trained in place by `jm.replicate` on `strategy`; each process passes its
    own replicas' rows. Returns (losses, the parameters and batch statistics flattened, step)."""
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            # No bias before BatchNorm: its gradient is zero up to rounding, which Adam would
            # turn into steps of the learning rate whose sign depends on summation order.
            self.hidden = nnx.Linear(16, 32, use_bias=False, rngs=rngs)
            self.bn = nnx.BatchNorm(32, axis_name=strategy.axis_name, rngs=rngs)
            self.drop = nnx.Dropout(0.25, rngs=rngs)
            self.out = nnx.Linear(32, 10, rngs=rngs)

        def __call__(self, x):
            return self.out(self.drop(nnx.relu(self.bn(self.hidden(x)))))

    def make():
        model = Net(nnx.Rngs(params=0, dropout=1))
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    model, optimizer = make()

    @jm.replicate(strategy=strategy)
    def train_step(model, optimizer, x, y):
        def loss_of(model):
            logits = model(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = nnx.value_and_grad(loss_of)(model)
        optimizer.update(model, jm.all_reduce("mean", grads))
        return jm.all_reduce("mean", loss)

    n = strategy.num_replicas
    local = getattr(strategy, "num_local_replicas", n)  # a MirroredStrategy: one process
    index = getattr(strategy, "process_index", 0)
    rows = slice(local * index, local * (index + 1))
    losses = []
    for x, y in batches(n, steps=steps, per_replica=per_replica, seed=3):
        x = x.reshape(n, per_replica, -1)[rows]
        y = y.reshape(n, per_replica)[rows]
        losses.append(
            float(strategy.read(train_step(model, optimizer, jm.PerReplica(x), jm.PerReplica(y))))
        )
    state = strategy.read(nnx.state(model, nnx.Param, nnx.BatchStat))
    flat = np.concatenate([np.ravel(np.asarray(v)) for v in jax.tree.leaves(state)])
    out = np.asarray(losses), flat, int(strategy.read(optimizer.step[...]))
    if checkpoint_dir is None:
        return out
    # Saved by every process, restored into `nnx.eval_shape` targets; one more step of the
    # restored pair and of the trained one.
    jm.checkpoint.save(checkpoint_dir, (model, optimizer), strategy=strategy)
    target = nnx.eval_shape(make)
    restored = jm.checkpoint.restore(checkpoint_dir, target, strategy=strategy)
    x, y = next(batches(n, steps=1, per_replica=per_replica, seed=4))
    x, y = jm.PerReplica(x.reshape(n, per_replica, -1)[rows]), jm.PerReplica(y.reshape(n, -1)[rows])
    again = [
        float(strategy.read(train_step(*pair, x, y))) for pair in (restored, (model, optimizer))
    ]
    return (*out, np.asarray(again))


def _local_rows(strategy):
    """This process's replicas' rows of an array of all N replicas' rows."""
    local = getattr(strategy, "num_local_replicas", strategy.num_replicas)
    index = getattr(strategy, "process_index", 0)
    return slice(local * index, local * (index + 1))


def metric_batches(n, steps=3, seed=7):
    """Per step, one row per replica: values (NaN where masked out), logits, labels, mask."""
    rs = np.random.RandomState(seed)
    for values in metric_values(n, steps=steps, seed=seed):
        mask = rs.rand(n, 5) < 0.7
        values = np.where(mask, values, np.nan).astype(np.float32)
        logits = rs.randn(n, 5, 3).astype(np.float32)
        labels = rs.randint(0, 3, size=(n, 5)).astype(np.int32)
        yield values, logits, labels, mask


def metric_reads(strategy):
    """Every jmirror metric (`Sum`, `Mean`, `Accuracy`: distributed, updated with masks in a
    replicated step, computed, read, merged, reset, and a `stack_history` of the steps) and
    NNX's `Average`, `Welford` and `Accuracy` (sync-on-read state updated in place) over the
    same global batches; each process passes its own replicas' rows. Returns name -> value,
    read on this process: the several-process run is compared with one process's."""
    from flax import nnx

    from jmirror import metrics

    def update(ours, nnx_metrics, values, logits, labels, mask):
        total, mean, accuracy = ours
        ours = (
            total.update(values, mask),
            mean.update(values, mask),
            accuracy.update(logits, labels, mask),
        )
        finite = jnp.where(mask, values, 0.0)
        nnx_metrics.update(values=finite, logits=logits, labels=labels)
        step_sum = total.reset().update(values, mask)  # this step's alone, sync-on-read
        record = {"mean": jm.all_reduce("mean", jnp.sum(finite)), "sum": step_sum}
        return ours, record

    step = jm.replicate(update, strategy=strategy)
    ours = tuple(m.create(strategy) for m in (metrics.Sum, metrics.Mean, metrics.Accuracy))
    nnx_metrics = nnx.MultiMetric(
        average=nnx.metrics.Average(),
        welford=nnx.metrics.Welford(),
        accuracy=nnx.metrics.Accuracy(),
    )
    rows = _local_rows(strategy)
    history = []
    for batch in metric_batches(strategy.num_replicas):
        ours, record = step(ours, nnx_metrics, *(jm.PerReplica(x[rows]) for x in batch))
        history.append(record)
    # Reads are left in flight side by side, as a user's are (they once deadlocked gloo).
    out = {}
    for metric in ours:
        name = type(metric).__name__
        out[f"{name}/compute"] = metric.compute(strategy)
        out[f"{name}/read"] = strategy.read(metric).compute()
        out[f"{name}/merged"] = metric.merge(metric).compute(strategy)
        out[f"{name}/reset"] = metric.reset().compute(strategy)
    stacked = metrics.stack_history(history, strategy=strategy)
    out["history/mean"], out["history/sum"] = stacked["mean"], stacked["sum"].total
    computed = strategy.read(nnx_metrics).compute()
    out["nnx/average"], out["nnx/accuracy"] = computed["average"], computed["accuracy"]
    for field in dataclasses.fields(computed["welford"]):
        out[f"nnx/welford_{field.name}"] = getattr(computed["welford"], field.name)
    return {name: np.asarray(value) for name, value in out.items()}
