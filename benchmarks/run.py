"""Runs the benchmark suite: `python -m benchmarks` (see benchmarks/RESULTS.md).

Every figure is a median over interleaved, repeated measurements of the variants in one
process, and every claim is a ratio to a baseline measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

import jmirror.testing as jmt
from benchmarks._report import table

NUM_DEVICES = int(os.environ.get("JMIRROR_BENCH_DEVICES", "8"))


def _setup_devices() -> None:
    jmt.set_host_device_count(NUM_DEVICES)


SIZES = {"small": 512, "large": 2048}
BASELINE = "raw jax.pmap"


def measure_steps(variants, steps: int, rounds: int) -> dict[str, float]:
    """Median steps/s of each variant over `rounds` interleaved runs of `steps` steps."""
    rates: dict[str, list[float]] = {v.name: [] for v in variants}
    for r in range(rounds):
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        for variant in order:
            start = time.perf_counter()
            out = None
            for _ in range(steps):
                out = variant.step()
            variant.block(out)
            rates[variant.name].append(steps / (time.perf_counter() - start))
    return {name: statistics.median(values) for name, values in rates.items()}


def factories() -> dict:
    """The variants to compare: jmirror's, the JAX alternatives, and TensorFlow if installed."""
    from benchmarks import models_tf
    from benchmarks.models import VARIANTS

    found = dict(VARIANTS)
    if models_tf.available():
        found["TensorFlow MirroredStrategy"] = models_tf.tensorflow_variant
    return found


def build(names, hidden: int):
    """Builds each variant and times its first call (trace + compile + one step)."""
    import jax
    import jax.numpy as jnp

    from benchmarks.models import make_problem

    variant_factories = factories()
    # Start the backends, compile something and trace the model once first, so that no
    # variant pays the process's one-time costs (JAX's start-up, flax's first trace).
    params, _, loss_fn, x, y = make_problem(hidden)
    jax.make_jaxpr(jax.value_and_grad(loss_fn))(params, x, y)
    jax.jit(lambda x: x + 1)(jnp.ones(3)).block_until_ready()
    jax.pmap(lambda x: jax.lax.psum(x, "i"), "i")(jnp.ones(jax.device_count())).block_until_ready()
    variants, first_call = [], {}
    for name in names:
        start = time.perf_counter()
        variant = variant_factories[name](hidden)
        variant.block(variant.step())
        first_call[name] = time.perf_counter() - start
        for _ in range(3):
            variant.step()
        variant.block(variant.step())
        variants.append(variant)
    return variants, first_call


def peak_memory_mb(name: str, hidden: int) -> float:
    """Peak RSS (MB) of a fresh process that builds one variant and runs six steps.

    Read from VmHWM, which starts afresh at exec (ru_maxrss would inherit the parent's).
    """
    code = (
        "from benchmarks.run import _setup_devices, factories;"
        "_setup_devices(); from benchmarks import models_tf;"
        f"{name.startswith('TensorFlow')} and models_tf.configure(%d);"
        f"v = factories()[{name!r}]({hidden}); [v.step() for _ in range(5)]; v.block(v.step());"
        "print(next(int(line.split()[1]) for line in open('/proc/self/status')"
        " if line.startswith('VmHWM')) / 1024)"
    ) % NUM_DEVICES
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    if out.returncode != 0:
        return float("nan")
    return float(out.stdout.strip().splitlines()[-1])


def steps_section(size: str, steps: int, rounds: int, memory: bool) -> str:
    hidden = SIZES[size]
    names = list(factories())
    variants, first_call = build(names, hidden)
    rates = measure_steps(variants, steps, rounds)
    base_rate, base_first = rates[BASELINE], first_call[BASELINE]
    rows = []
    for name in names:
        row = [
            name,
            f"{rates[name]:.1f}",
            f"{rates[name] / base_rate:.3f}",
            f"{first_call[name]:.2f}",
            f"{first_call[name] / base_first:.2f}",
        ]
        if memory:
            row.append(f"{peak_memory_mb(name, hidden):.0f}")
        rows.append(row)
    header = ["variant", "steps/s", "× raw pmap", "first call s", "× raw pmap"]
    if memory:
        header.append("peak RSS MB")
    return table(
        f"Training step, MLP 64→{hidden}→{hidden}→10, global batch 256, {NUM_DEVICES} devices "
        f"(median of {rounds} × {steps} steps)",
        rows,
        header,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="small,large")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--memory", action="store_true", help="peak RSS of each variant")
    parser.add_argument("--skip", default="", help="comma list of: steps,hlo,micro,spanning")
    args = parser.parse_args(argv)
    _setup_devices()
    from benchmarks import models_tf

    if models_tf.available():
        models_tf.configure(NUM_DEVICES)
    import jax

    from benchmarks import hlo, micro

    print(f"# jmirror benchmarks\n\n`python -m benchmarks {' '.join(argv or sys.argv[1:])}`  ")
    print(
        f"jax {jax.__version__}, python {platform.python_version()}, {platform.machine()}, "
        f"{os.cpu_count()} cores, {jax.device_count()} {jax.devices()[0].platform} devices, "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}"
    )
    skip = set(filter(None, args.skip.split(",")))
    if "hlo" not in skip:
        print(hlo.report())
    if "steps" not in skip:
        for size in args.sizes.split(","):
            print(steps_section(size, args.steps, args.rounds, args.memory), flush=True)
    if "micro" not in skip:
        print(micro.report(args.rounds), flush=True)
    if "spanning" not in skip:  # replicas spanning k devices (SPEC 13): 8 devices only
        from benchmarks import spanning_bench

        if jax.device_count() == spanning_bench.NUM_DEVICES:
            print(spanning_bench.report(args.rounds), flush=True)
        else:
            print(f"\n(replicas spanning devices: skipped, needs {spanning_bench.NUM_DEVICES})")


if __name__ == "__main__":
    main()
