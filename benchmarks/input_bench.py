"""Input pipeline throughput: `strategy.distribute_dataset` against two baselines.

Trains an MLP 64 -> 512 -> 512 -> 10 (global batch 256, SGD, gradients all-reduced with MEAN)
on 8 XLA:CPU host devices, fed three ways:

  (a) host numpy batches through `strategy.distribute_dataset` (prefetch=2), step via
      `jm.replicate`;
  (b) the same batches already on the devices (placed before timing), same `jm.replicate` step:
      the ceiling for (a);
  (c) the flax idiom `flax.jax_utils.prefetch_to_device(map(shard, batches), 2)` with a raw
      `jax.pmap` step over the same model.

The three are interleaved and repeated (ROUNDS x STEPS), the order rotating each round so that
none always runs first. On this shared 2-core machine one run's steps/s drifts by 10-15% from
round to round, more than the effect measured, so each round's ratio compares runs made
seconds apart: the printed ratios (a)/(b) (target >= 0.95) and (a)/(c) (target >= 1.0) are the
medians of the per-round ratios; the ratio of the median steps/s is printed beside them. On
CPU host devices XLA deadlocks when many collective programs are queued, so the raw pmap loop
blocks on its output every 2 steps (jm.replicate bounds its steps in flight itself).

Run: python benchmarks/input_bench.py
"""

import statistics
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import flax.jax_utils  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax.training.common_utils import shard  # noqa: E402

import jmirror as jm  # noqa: E402

GLOBAL_BATCH = 256
STEPS = 100
ROUNDS = 15
SIZES = (64, 512, 512, 10)
LR = 0.01


def init_params(seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {
            "w": (rng.normal(size=(m, k)) * np.sqrt(2.0 / m)).astype(np.float32),
            "b": np.zeros((k,), np.float32),
        }
        for m, k in zip(SIZES[:-1], SIZES[1:])
    ]


def loss_fn(params, x, y):
    h = x
    for layer in params[:-1]:
        h = jax.nn.relu(h @ layer["w"] + layer["b"])
    logits = h @ params[-1]["w"] + params[-1]["b"]
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))


def sgd(params, grads):
    return jax.tree.map(lambda p, g: p - LR * g, params, grads)


def make_host_batches(steps: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    return [
        (
            rng.normal(size=(GLOBAL_BATCH, SIZES[0])).astype(np.float32),
            rng.integers(0, SIZES[-1], size=(GLOBAL_BATCH,)).astype(np.int32),
        )
        for _ in range(steps)
    ]


def main() -> None:
    strategy = jm.MirroredStrategy()
    n = strategy.num_replicas
    print(
        f"{n} devices ({jax.devices()[0].platform}), global batch {GLOBAL_BATCH}, "
        f"{ROUNDS} rounds x {STEPS} steps, jax {jax.__version__}"
    )

    @jm.replicate(strategy=strategy)
    def jm_step(params, batch):
        x, y = batch
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        return sgd(params, jm.all_reduce("mean", grads)), jm.all_reduce("mean", loss)

    def raw_step(params, batch):
        x, y = batch
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        return sgd(params, jax.lax.pmean(grads, "batch")), jax.lax.pmean(loss, "batch")

    pmap_step = jax.pmap(raw_step, axis_name="batch")

    host_batches = make_host_batches(STEPS)
    params0 = init_params()
    dataset = strategy.distribute_dataset(host_batches, remainder="drop", prefetch=2)
    device_batches = list(strategy.distribute_dataset(host_batches, remainder="drop", prefetch=0))
    jax.block_until_ready(device_batches)

    def run_a() -> float:
        params = strategy.mirror(params0)
        jax.block_until_ready(params)
        start = time.perf_counter()
        for batch in dataset:
            params, loss = jm_step(params, batch)
        jax.block_until_ready((params, loss))
        return STEPS / (time.perf_counter() - start)

    def run_b() -> float:
        params = strategy.mirror(params0)
        jax.block_until_ready(params)
        start = time.perf_counter()
        for batch in device_batches:
            params, loss = jm_step(params, batch)
        jax.block_until_ready((params, loss))
        return STEPS / (time.perf_counter() - start)

    def run_c() -> float:
        params = flax.jax_utils.replicate(params0)
        jax.block_until_ready(params)
        start = time.perf_counter()
        batches = flax.jax_utils.prefetch_to_device(map(shard, host_batches), 2)
        for i, batch in enumerate(batches):
            params, loss = pmap_step(params, batch)
            if i % 2 == 1:  # never queue unbounded collective steps on CPU host devices
                loss.block_until_ready()
        jax.block_until_ready((params, loss))
        return STEPS / (time.perf_counter() - start)

    runs = {"a": run_a, "b": run_b, "c": run_c}
    for run in runs.values():  # compile and warm up
        run()
    results: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(ROUNDS):
        for name in names[r % 3 :] + names[: r % 3]:
            results[name].append(runs[name]())
        print(f"round {r}: " + "  ".join(f"({k}) {v[-1]:7.1f}" for k, v in results.items()))
    dataset.close()

    med = {name: statistics.median(v) for name, v in results.items()}
    print("median steps/s:")
    print(f"  (a) distribute_dataset (host numpy, prefetch=2) + jm.replicate: {med['a']:8.1f}")
    print(f"  (b) batches already on the devices + jm.replicate:            {med['b']:8.1f}")
    print(f"  (c) flax prefetch_to_device(map(shard, ...), 2) + jax.pmap:   {med['c']:8.1f}")
    for base, target in (("b", 0.95), ("c", 1.0)):
        paired = statistics.median(a / x for a, x in zip(results["a"], results[base], strict=True))
        met = "met" if paired >= target else "NOT met"
        print(
            f"(a)/({base}) = {paired:.3f} median of per-round ratios (target >= {target}: {met}); "
            f"ratio of medians {med['a'] / med[base]:.3f}"
        )


if __name__ == "__main__":
    main()
