"""The first call of a replicated step against a hand-written `jax.jit(jax.shard_map(...))`.

The first call is everything between having the placed state and the first step's results:
tracing, jmirror's proof, compiling, and one step. Two models (8 XLA:CPU host devices), each
an Adam step with the loss and the gradients averaged over the replicas:

- `small MLP`: the benchmark MLP of `benchmarks/models.py` (hidden 512);
- `flax transformer LM`: the small decoder of `benchmarks/shard_bench.py` (vocabulary 256,
  width 128, 2 blocks of 4 heads, sequence 32, batch 64).

`jm` is `jm.replicate` of the step (its default backend, or `--backend`); `hand` is the same step as
`jax.jit(jax.shard_map(..., check_vma=False))` with `jax.lax.pmean`, the state replicated
and the batch split over the devices. Each measurement runs in a fresh process (compilation
caches are per process; the persistent compilation cache is off), `jm` and `hand` alternated,
and the report gives the median of `--repeats` pairs and the ratio of the medians, in
wall-clock seconds and in the process's CPU seconds (every thread: on a loaded machine the
wall clock mostly measures the other processes, the CPU seconds the work itself).

    PYTHONPATH=<checkout> python benchmarks/first_call_bench.py [--repeats 3] [--models mlp lm]
    PYTHONPATH=<checkout> python benchmarks/first_call_bench.py --profile jm lm   # cProfile
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MODELS = {"mlp": "small MLP", "lm": "flax transformer LM"}
MODES = ("jm", "hand")


def _problem(model: str):
    """Returns (params, loss_fn, x, y) of `model` ("mlp" or "lm")."""
    import jax
    import numpy as np
    import optax

    if model == "mlp":
        from benchmarks.models import make_problem

        params, _, loss_fn, x, y = make_problem(512)
        return params, loss_fn, x, y
    from benchmarks.shard_bench import transformer

    decoder = transformer()
    tokens = np.random.default_rng(0).integers(0, 256, size=(64, 32)).astype(np.int32)
    params = decoder.init(jax.random.key(0), tokens[:1])

    def lm_loss(params, x, y):
        logits = decoder.apply(params, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return params, lm_loss, tokens, np.roll(tokens, -1, axis=1)


def measure(mode: str, model: str, profile: str | None = None) -> dict[str, float]:
    """Returns the first call of `mode`'s step on `model`, in this process: its wall-clock
    seconds (`wall`) and the process's CPU seconds in it (`cpu`, every thread); with
    `profile` (a pstats sort key) prints the call's cProfile."""
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_enable_compilation_cache", False)
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jmirror as jm

    params, loss_fn, x, y = _problem(model)
    tx = optax.adam(1e-3)
    strategy = jm.MirroredStrategy(backend=os.environ.get("FIRST_CALL_BACKEND") or None)
    n, axis, mesh = strategy.num_replicas, strategy.axis_name, strategy.mesh
    if mode == "jm":

        @jm.replicate(strategy=strategy, donate_argnums=(0, 1))
        def step(params, opt_state, x, y):
            loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
            updates, opt_state = tx.update(jm.all_reduce("mean", grads), opt_state, params)
            return optax.apply_updates(params, updates), opt_state, jm.all_reduce("mean", loss)

        state = (strategy.mirror(params), strategy.mirror(tx.init(params)))
        stacked = NamedSharding(mesh, P(axis))  # each replica's slice on its own device
        batch = (
            jm.PerReplica(jax.device_put(x.reshape((n, -1) + x.shape[1:]), stacked)),
            jm.PerReplica(jax.device_put(y.reshape((n, -1) + y.shape[1:]), stacked)),
        )
    else:

        def body(params, opt_state, x, y):
            loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
            grads = jax.lax.pmean(grads, axis)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, axis)

        step = jax.jit(
            jax.shard_map(
                body,
                mesh=mesh,
                in_specs=(P(), P(), P(axis), P(axis)),
                out_specs=(P(), P(), P()),
                check_vma=False,
            ),
            donate_argnums=(0, 1),
        )
        mirrored = NamedSharding(mesh, P())
        state = jax.device_put((params, tx.init(params)), mirrored)
        batch = jax.device_put((x, y), NamedSharding(mesh, P(axis)))
    jax.block_until_ready((state, batch))
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    start, cpu = time.perf_counter(), time.process_time()
    out = step(*state, *batch)
    jax.block_until_ready(out)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    if profiler is not None:
        import pstats

        profiler.disable()
        if os.environ.get("FIRST_CALL_PROFILE_TO"):  # a file for pstats, to compare two runs
            profiler.dump_stats(os.environ["FIRST_CALL_PROFILE_TO"])
        pstats.Stats(profiler).sort_stats(profile).print_stats(60)
    return {"wall": seconds, "cpu": cpu}


def _fresh(mode: str, model: str) -> dict[str, float]:
    """Returns `measure(mode, model)` run in a fresh Python process."""
    code = (
        "import json; from benchmarks.first_call_bench import measure; "
        f"print(json.dumps(measure({mode!r}, {model!r})))"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900
    )
    if done.returncode != 0:
        raise RuntimeError(f"{mode} on {model} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Prints the first calls of `jm` and `hand` per model and their ratios (medians of
    wall-clock and of CPU seconds); returns them."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="fresh-process pairs per model")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument(
        "--profile", nargs=2, metavar=("MODE", "MODEL"), help="cProfile one first call here"
    )
    parser.add_argument(
        "--backend", choices=("pmap", "shard_map"), help="jm's backend (default: its default)"
    )
    parser.add_argument("--sort", default="cumulative", help="the profile's pstats sort key")
    args = parser.parse_args(argv)
    if args.backend:  # read by `measure`, in this process and in the fresh ones
        os.environ["FIRST_CALL_BACKEND"] = args.backend
    if args.profile:
        mode, model = args.profile
        took = measure(mode, model, profile=args.sort)
        print(f"{mode} first call on {model}: {took['wall']:.3f} s ({took['cpu']:.3f} s CPU)")
        return {}
    results: dict[str, dict[str, float]] = {}
    print(
        "| model | jm first call s | hand jit(shard_map) first call s | ratio "
        "| jm CPU s | hand CPU s | CPU ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    for model in args.models:
        runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
        for i in range(args.repeats):
            # Alternate which mode goes first, so that a drift in load favours neither.
            for mode in MODES if i % 2 == 0 else MODES[::-1]:
                runs[mode].append(_fresh(mode, model))
        row = {
            f"{mode} {kind}": statistics.median(r[kind] for r in runs[mode])
            for mode in MODES
            for kind in ("wall", "cpu")
        }
        row["ratio"] = row["jm wall"] / row["hand wall"]
        row["cpu ratio"] = row["jm cpu"] / row["hand cpu"]
        results[model] = row
        print(
            f"| {MODELS[model]} | {row['jm wall']:.2f} | {row['hand wall']:.2f} "
            f"| {row['ratio']:.2f} | {row['jm cpu']:.2f} | {row['hand cpu']:.2f} "
            f"| {row['cpu ratio']:.2f} |",
            flush=True,
        )
    return results


if __name__ == "__main__":
    main()
