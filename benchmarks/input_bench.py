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

Run: python benchmarks/input_bench.py [--hidden 512] [--rounds 25] [--source-ms 0]
                                     [--priority-study]

- `--hidden`: the width of both hidden layers; 512 is the configuration the targets are
  measured on, wider layers give a longer step.
- `--source-ms X`: (a) and (c) read from a generator that spends X ms of Python (holding the
  GIL) on each batch before yielding it, like a loader decoding or augmenting on the host; (b)
  stays the pre-placed ceiling.
- `--priority-study`: adds (d), run (a) with jmirror's prefetch thread left at the normal CPU
  priority instead of niceness 19 (see jmirror/_prefetch.py), and prints (a)/(d).
"""

import argparse
import statistics
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import flax.jax_utils  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax.training.common_utils import shard  # noqa: E402

import jmirror as jm  # noqa: E402
from jmirror import _prefetch as jm_prefetch  # noqa: E402

GLOBAL_BATCH = 256
STEPS = 100
ROUNDS = 25
FEATURES, CLASSES = 64, 10
LR = 0.01


def init_params(hidden: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    sizes = (FEATURES, hidden, hidden, CLASSES)
    rng = np.random.default_rng(seed)
    return [
        {
            "w": (rng.normal(size=(m, k)) * np.sqrt(2.0 / m)).astype(np.float32),
            "b": np.zeros((k,), np.float32),
        }
        for m, k in zip(sizes[:-1], sizes[1:])
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
            rng.normal(size=(GLOBAL_BATCH, FEATURES)).astype(np.float32),
            rng.integers(0, CLASSES, size=(GLOBAL_BATCH,)).astype(np.int32),
        )
        for _ in range(steps)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512, help="hidden layer width (512)")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"rounds ({ROUNDS})")
    parser.add_argument("--source-ms", type=float, default=0.0, help="Python ms per batch (0)")
    parser.add_argument("--priority-study", action="store_true", help="add (d): normal priority")
    args = parser.parse_args()
    strategy = jm.MirroredStrategy()
    n = strategy.num_replicas
    print(
        f"{n} devices ({jax.devices()[0].platform}), global batch {GLOBAL_BATCH}, "
        f"MLP {FEATURES}-{args.hidden}-{args.hidden}-{CLASSES}, "
        f"{args.rounds} rounds x {STEPS} steps, source work {args.source_ms} ms/batch, "
        f"jax {jax.__version__}"
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
    params0 = init_params(args.hidden)

    def source():
        for batch in host_batches:
            if args.source_ms:
                end = time.perf_counter() + args.source_ms / 1e3
                while time.perf_counter() < end:  # Python work, holding the GIL
                    pass
            yield batch

    dataset = strategy.distribute_dataset(source, remainder="drop", prefetch=2)
    device_batches = list(strategy.distribute_dataset(host_batches, remainder="drop", prefetch=0))
    jax.block_until_ready(device_batches)

    def run_jm(batches) -> float:
        params = strategy.mirror(params0)
        jax.block_until_ready(params)
        start = time.perf_counter()
        for batch in batches:
            params, loss = jm_step(params, batch)
        jax.block_until_ready((params, loss))
        return STEPS / (time.perf_counter() - start)

    def run_a() -> float:
        return run_jm(dataset)

    def run_b() -> float:
        return run_jm(device_batches)

    def run_c() -> float:
        params = flax.jax_utils.replicate(params0)
        jax.block_until_ready(params)
        start = time.perf_counter()
        batches = flax.jax_utils.prefetch_to_device(map(shard, source()), 2)
        for i, batch in enumerate(batches):
            params, loss = pmap_step(params, batch)
            if i % 2 == 1:  # never queue unbounded collective steps on CPU host devices
                loss.block_until_ready()
        jax.block_until_ready((params, loss))
        return STEPS / (time.perf_counter() - start)

    def run_d() -> float:
        lower_priority = jm_prefetch._lower_priority
        jm_prefetch._lower_priority = lambda: None
        try:
            return run_a()
        finally:
            jm_prefetch._lower_priority = lower_priority

    runs = {"a": run_a, "b": run_b, "c": run_c}
    if args.priority_study:
        runs["d"] = run_d
    for run in runs.values():  # compile and warm up
        run()
    results: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(args.rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            results[name].append(runs[name]())
        print(f"round {r}: " + "  ".join(f"({k}) {v[-1]:7.1f}" for k, v in results.items()))
    dataset.close()

    med = {name: statistics.median(v) for name, v in results.items()}
    print("median steps/s:")
    print(f"  (a) distribute_dataset (host numpy, prefetch=2) + jm.replicate: {med['a']:8.1f}")
    print(f"  (b) batches already on the devices + jm.replicate:            {med['b']:8.1f}")
    print(f"  (c) flax prefetch_to_device(map(shard, ...), 2) + jax.pmap:   {med['c']:8.1f}")
    if "d" in med:
        print(f"  (d) as (a), prefetch thread at normal priority:              {med['d']:8.1f}")
        paired = statistics.median(a / d for a, d in zip(results["a"], results["d"], strict=True))
        print(f"(a)/(d) = {paired:.3f} median of per-round ratios")
    for base, target in (("b", 0.95), ("c", 1.0)):
        paired = statistics.median(a / x for a, x in zip(results["a"], results[base], strict=True))
        met = "met" if paired >= target else "NOT met"
        print(
            f"(a)/({base}) = {paired:.3f} median of per-round ratios (target >= {target}: {met}); "
            f"ratio of medians {med['a'] / med[base]:.3f}"
        )


if __name__ == "__main__":
    main()
