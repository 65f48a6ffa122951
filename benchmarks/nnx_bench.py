"""The NNX in-place step: `jm.replicate` with write-back against the glue it replaces.

Three ways to train the same NNX CNN (Conv + BatchNorm + Dropout + Linear, `nnx.Optimizer`
with adam) data-parallel on 8 host devices, one global batch per step:

- `jm in-place`: `train_step(model, optimizer, x, y)` returning only the loss; jmirror writes
  the changed state back into the caller's objects (SPEC 11);
- `(a) split/merge by hand`: the same step written with `nnx.split` once, `nnx.merge` inside
  and `nnx.state` returned, the state threaded through the loop by the caller (the glue the
  in-place step replaces; its dropout draws the same mask on every replica);
- `(b) nnx.jit + sharding`: flax's own data-parallel idiom, state replicated with a
  `NamedSharding(mesh, P())`, the batch sharded over the mesh, one `nnx.jit` step on the
  global batch (GSPMD partitions it).

Rounds are interleaved (a round runs every variant for `--steps` steps, each variant leading a
round in turn); the table gives each
variant's median steps/s and its ratio to (a). Target: the in-place step >= 0.97x (a).

    python -m benchmarks.nnx_bench [--rounds 7] [--steps 30] [--batch 128]
"""

from __future__ import annotations

import argparse
import statistics
import time


def _setup(batch: int):
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jmirror as jm

    strategy = jm.MirroredStrategy()
    n = strategy.num_replicas

    class Cnn(nnx.Module):
        def __init__(self, rngs: nnx.Rngs, axis_name: str | None):
            self.conv = nnx.Conv(1, 16, kernel_size=(3, 3), use_bias=False, rngs=rngs)
            self.bn = nnx.BatchNorm(16, axis_name=axis_name, rngs=rngs)
            self.drop = nnx.Dropout(0.2, rngs=rngs)
            self.head = nnx.Linear(16 * 12 * 12, 10, rngs=rngs)

        def __call__(self, x):
            x = nnx.relu(self.bn(self.conv(x)))
            return self.head(self.drop(x.reshape(x.shape[0], -1)))

    def loss_fn(model, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    def pair(axis_name):
        model = Cnn(nnx.Rngs(params=0, dropout=1), axis_name)
        return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    rs = np.random.RandomState(0)
    x = rs.randn(batch, 12, 12, 1).astype(np.float32)
    y = rs.randint(0, 10, batch).astype(np.int32)

    def split(a):
        stacked = a.reshape(n, -1, *a.shape[1:])
        return jm.PerReplica(jax.device_put(stacked, strategy.topology.stacked))

    px, py = split(x), split(y)

    # jm in-place
    model, optimizer = pair(strategy.axis_name)

    @jm.replicate(strategy=strategy)
    def in_place(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        optimizer.update(model, jm.all_reduce("mean", grads))
        return jm.all_reduce("mean", loss)

    def run_in_place(steps):
        for _ in range(steps):
            loss = in_place(model, optimizer, px, py)
        return loss

    # (a) split / merge by hand
    graphdef, state = nnx.split(pair(strategy.axis_name))
    held = {"state": strategy.mirror(state)}

    @jm.replicate(strategy=strategy)
    def by_hand(state, x, y):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        optimizer.update(model, jm.all_reduce("mean", grads))
        return nnx.state((model, optimizer)), jm.all_reduce("mean", loss)

    def run_by_hand(steps):
        state = held["state"]
        for _ in range(steps):
            state, loss = by_hand(state, px, py)
        held["state"] = state
        return loss

    # (b) nnx.jit + NamedSharding
    ref_model, ref_optimizer = pair(None)
    replicated = NamedSharding(strategy.mesh, P())
    nnx.update(
        (ref_model, ref_optimizer),
        jax.device_put(nnx.state((ref_model, ref_optimizer)), replicated),
    )
    sharded = NamedSharding(strategy.mesh, P(strategy.axis_name))
    gx, gy = jax.device_put(x, sharded), jax.device_put(y, sharded)

    @nnx.jit
    def jit_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        optimizer.update(model, grads)
        return loss

    def run_jit(steps):
        for _ in range(steps):
            loss = jit_step(ref_model, ref_optimizer, gx, gy)
        return loss

    del jnp
    variants = {
        "jm in-place": run_in_place,
        "(a) split/merge by hand": run_by_hand,
        "(b) nnx.jit + sharding": run_jit,
    }
    return variants, _bookkeeping(in_place, model, optimizer, px, py, held)


def _bookkeeping(in_place, model, optimizer, px, py, held) -> dict[str, float]:
    """Host microseconds per call of what the in-place step adds to the hand-written one."""
    import timeit

    import jax
    from flax import nnx

    from jmirror import _nnx

    args = (model, optimizer, px, py)
    variables = _nnx._variables(in_place, args, {})
    values = [v.get_raw_value() for v in variables]

    def write_back():
        for v, x in zip(variables, values):
            _nnx._set_raw_value(v, x)

    def micro(fn) -> float:
        return min(timeit.repeat(fn, number=500, repeat=5)) / 500 * 1e6

    return {
        "find the Variables": micro(lambda: _nnx._variables(in_place, args, {})),
        "write them back": micro(write_back),
        "jit flattens the objects": micro(lambda: jax.tree_util.tree_flatten(args)),
        "jit flattens an nnx.State (a)": micro(
            lambda: jax.tree_util.tree_flatten((held["state"], px, py))
        ),
        "plain-path check (has_nodes)": micro(
            lambda: _nnx.has_nodes(in_place, (held["state"], px, py), {})
        ),
        "(variables)": float(len(variables)),
        "(nnx.split, for scale)": micro(lambda: nnx.split((model, optimizer))),
    }


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=128)
    args = parser.parse_args(argv)
    import jax

    variants, bookkeeping = _setup(args.batch)
    for run in variants.values():  # compile and warm up
        jax.block_until_ready(run(3))
    rates: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(args.rounds):
        for name in names[r % 3 :] + names[: r % 3]:  # each variant leads a round in turn
            run = variants[name]
            start = time.perf_counter()
            jax.block_until_ready(run(args.steps))
            rates[name].append(args.steps / (time.perf_counter() - start))
    medians = {name: statistics.median(r) for name, r in rates.items()}
    base = medians["(a) split/merge by hand"]
    print(f"NNX step, 8 host devices, global batch {args.batch}, ", end="")
    print(f"median of {args.rounds} interleaved rounds x {args.steps} steps")
    print("| variant | steps/s | x (a) |")
    print("|---|---|---|")
    for name, rate in medians.items():
        print(f"| {name} | {rate:.1f} | {rate / base:.3f} |")
    print("host bookkeeping per call (µs, best of 5 x 500):")
    for name, us in bookkeeping.items():
        print(f"  {name}: {us:.1f}")
    return medians


if __name__ == "__main__":
    main()
