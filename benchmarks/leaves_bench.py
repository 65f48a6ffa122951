"""Trees of many leaves: `mirror` and a step's first call, against plain JAX, in one run.

Each measurement runs in its own process (8 host devices), so that its peak memory (VmHWM) is
its own and no compilation cache is shared:

- `device_put`: `jax.device_put(tree, NamedSharding(mesh, P()))`, the baseline for `mirror`;
- `mirror`: `strategy.mirror(tree)`;
- `pmap first call`: a hand-written `jax.pmap` step over the mirrored tree (every leaf plus the
  `pmean` of a per-replica value), first call, compile included;
- `jm first call`: the same step through `jm.replicate`, first call, compile included.

Goals (issue "Reliability"): `mirror` <= 2x `device_put`; the first call <= 1.2x raw
`jax.pmap`'s time and peak memory.

    python benchmarks/leaves_bench.py [--leaves 3000 10000] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

_MODES = ("device_put", "mirror", "pmap first call", "jm first call")


def _peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def measure(mode: str, leaves: int) -> dict[str, float]:
    """One measurement, in this process (run by `main` in a fresh process per mode)."""
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jmirror as jm

    strategy = jm.MirroredStrategy()
    n = strategy.num_replicas
    tree = {f"layer{i}": np.full((4,), i, np.float32) for i in range(leaves)}
    x = np.ones((n,), np.float32)
    if mode in ("device_put", "mirror"):
        start = time.perf_counter()
        if mode == "device_put":
            out = jax.device_put(tree, NamedSharding(strategy.mesh, P()))
        else:
            out = strategy.mirror(tree)
        jax.block_until_ready(out)
        return {"seconds": time.perf_counter() - start, "peak_mib": _peak_rss_mib()}
    mirrored = strategy.mirror(tree)
    if mode == "pmap first call":
        step = jax.pmap(
            lambda t, x: jax.tree.map(lambda v: v + jax.lax.pmean(x, "i"), t),
            axis_name="i",
            in_axes=(None, 0),
        )
        start = time.perf_counter()
        out = step(mirrored, x)
    else:
        step = jm.replicate(
            lambda t, x: jax.tree.map(lambda v: v + jm.all_reduce("mean", x), t),
            strategy=strategy,
        )
        start = time.perf_counter()
        out = step(mirrored, jm.PerReplica(x))
    jax.block_until_ready(out)
    return {"seconds": time.perf_counter() - start, "peak_mib": _peak_rss_mib()}


def _run_one(mode: str, leaves: int) -> dict[str, float]:
    code = (
        "import json, sys; sys.path.insert(0, 'benchmarks'); import leaves_bench as b; "
        f"print(json.dumps(b.measure({mode!r}, {leaves})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=1800
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leaves", type=int, nargs="+", default=[3000, 10000])
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)
    print("| leaves | measure | seconds | peak MiB | ratio (time / memory) | goal |")
    print("|---|---|---|---|---|---|")
    for leaves in args.leaves:
        results: dict[str, dict[str, float]] = {}
        for mode in _MODES:
            runs = [_run_one(mode, leaves) for _ in range(args.repeats)]
            results[mode] = {
                key: statistics.median(r[key] for r in runs) for key in ("seconds", "peak_mib")
            }
        rows = [
            ("device_put", None, ""),
            ("mirror", "device_put", "<= 2x time"),
            ("pmap first call", None, ""),
            ("jm first call", "pmap first call", "<= 1.2x time and memory"),
        ]
        for mode, base, goal in rows:
            r = results[mode]
            ratio = ""
            if base is not None:
                b = results[base]
                ratio = f"{r['seconds'] / b['seconds']:.2f} / {r['peak_mib'] / b['peak_mib']:.2f}"
            seconds, peak = f"{r['seconds']:.2f}", f"{r['peak_mib']:.0f}"
            print(f"| {leaves} | {mode} | {seconds} | {peak} | {ratio} | {goal} |")


if __name__ == "__main__":
    main()
