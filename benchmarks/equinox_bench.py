"""The equinox step: `jm.replicate` against equinox's own data parallelism.

Two ways to train the same equinox model data-parallel on 8 host devices, one global batch
per step, adam through optax on `eqx.filter(model, eqx.is_array)`:

- `jm.replicate`: the usual equinox step (`eqx.filter_value_and_grad`, `tx.update`,
  `eqx.apply_updates`) with one `jm.all_reduce("mean", grads)`, model and optimizer state
  mirrored and donated, the batch a `PerReplica` already on the devices;
- `eqx.filter_jit + sharding`: equinox's own idiom (its `parallelism` example): model and
  optimizer state replicated with `NamedSharding(mesh, P())`, the batch sharded over the mesh,
  one `eqx.filter_jit(donate="all")` step on the global batch with `eqx.filter_shard`
  (GSPMD partitions it).

Models: `mlp`, `eqx.nn.MLP` 64→512→512→10 (relu); `cnn`, `Conv2d` 1→16 3×3, relu,
`MaxPool2d` 2, `Linear` to 10, on 28×28 images. Rounds are interleaved (each variant leads a
round in turn); the table gives each variant's median steps/s and the step-time ratio
jm / filter_jit (target ≤ 1.05).

    python -m benchmarks.equinox_bench [--models mlp,cnn] [--rounds 9] [--steps 30] [--batch 256]
"""

from __future__ import annotations

import argparse
import statistics
import time


def _model(name: str):
    """Returns `(model, make_batch)` for the model named `name`."""
    import equinox as eqx
    import jax
    import numpy as np

    key = jax.random.key(0)
    rs = np.random.RandomState(0)
    if name == "mlp":
        model = eqx.nn.MLP(64, 10, 512, 2, activation=jax.nn.relu, key=key)

        def make_batch(batch):
            return rs.randn(batch, 64).astype(np.float32), rs.randint(0, 10, batch)

        return model, make_batch
    if name == "cnn":
        k1, k2 = jax.random.split(key)
        model = eqx.nn.Sequential(
            [
                eqx.nn.Conv2d(1, 16, kernel_size=3, key=k1),
                eqx.nn.Lambda(jax.nn.relu),
                eqx.nn.MaxPool2d(kernel_size=2, stride=2),
                eqx.nn.Lambda(jax.numpy.ravel),
                eqx.nn.Linear(16 * 13 * 13, 10, key=k2),
            ]
        )

        def make_batch(batch):
            return rs.randn(batch, 1, 28, 28).astype(np.float32), rs.randint(0, 10, batch)

        return model, make_batch
    raise ValueError(f"unknown model {name!r}: expected 'mlp' or 'cnn'")


def _setup(name: str, batch: int):
    """Returns the two variants (each `run(steps) -> loss`) for model `name`."""
    import equinox as eqx
    import jax
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jmirror as jm

    strategy = jm.MirroredStrategy()
    n = strategy.num_replicas
    model, make_batch = _model(name)
    tx = optax.adam(1e-3)
    x, y = make_batch(batch)

    def loss_fn(model, x, y):
        logits = jax.vmap(model)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    # jm.replicate
    @jm.replicate(strategy=strategy, donate_argnums=(0, 1))
    def replicated(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        grads = jm.all_reduce("mean", grads)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, jm.all_reduce("mean", loss)

    def split(a):
        return jm.PerReplica(
            jax.device_put(a.reshape(n, -1, *a.shape[1:]), strategy.topology.stacked)
        )

    px, py = split(x), split(y)
    held = {"jm": strategy.mirror((model, tx.init(eqx.filter(model, eqx.is_array))))}

    def run_jm(steps):
        model, opt_state = held["jm"]
        for _ in range(steps):
            model, opt_state, loss = replicated(model, opt_state, px, py)
        held["jm"] = (model, opt_state)
        return loss

    # eqx.filter_jit + NamedSharding, as equinox's parallelism example writes it
    mesh = strategy.mesh
    data_sharding = NamedSharding(mesh, P(strategy.axis_name))
    model_sharding = NamedSharding(mesh, P())

    @eqx.filter_jit(donate="all")
    def sharded(model, opt_state, x, y):
        model, opt_state = eqx.filter_shard((model, opt_state), model_sharding)
        x, y = eqx.filter_shard((x, y), data_sharding)
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        model, opt_state = eqx.filter_shard((model, opt_state), model_sharding)
        return model, opt_state, loss

    gx, gy = jax.device_put(x, data_sharding), jax.device_put(y, data_sharding)
    state = (model, tx.init(eqx.filter(model, eqx.is_array)))
    held["sharded"] = eqx.filter_shard(state, model_sharding)

    def run_sharded(steps):
        model, opt_state = held["sharded"]
        for _ in range(steps):
            model, opt_state, loss = sharded(model, opt_state, gx, gy)
        held["sharded"] = (model, opt_state)
        return loss

    # Both train the same model on the same batch: their losses agree after the warm-up.
    first = (float(strategy.read(run_jm(1))), float(run_sharded(1)))
    np.testing.assert_allclose(first[0], first[1], rtol=1e-4)
    return {"jm.replicate": run_jm, "eqx.filter_jit + sharding": run_sharded}


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args(argv)
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    ratios = {}
    print(f"equinox step, 8 host devices, global batch {args.batch}, ", end="")
    print(f"median of {args.rounds} interleaved rounds x {args.steps} steps")
    print(
        "| model | jm.replicate steps/s | eqx.filter_jit + sharding steps/s | step time jm / eqx |"
    )
    print("|---|---|---|---|")
    for name in args.models.split(","):
        variants = _setup(name, args.batch)
        for run in variants.values():  # compile and warm up
            jax.block_until_ready(run(3))
        names = list(variants)
        rates: dict[str, list[float]] = {v: [] for v in names}
        per_round: list[float] = []
        for r in range(args.rounds):
            seconds = {}
            for v in names[r % 2 :] + names[: r % 2]:  # each variant leads a round in turn
                start = time.perf_counter()
                jax.block_until_ready(variants[v](args.steps))
                seconds[v] = time.perf_counter() - start
                rates[v].append(args.steps / seconds[v])
            per_round.append(seconds["jm.replicate"] / seconds["eqx.filter_jit + sharding"])
        medians = {v: statistics.median(r) for v, r in rates.items()}
        ratios[name] = statistics.median(per_round)
        print(
            f"| {name} | {medians['jm.replicate']:.1f} | "
            f"{medians['eqx.filter_jit + sharding']:.1f} | {ratios[name]:.3f} "
            f"(rounds {min(per_round):.2f}–{max(per_round):.2f}) |"
        )
    return ratios


if __name__ == "__main__":
    main()
