"""A launcher restart's first call of a step against the cold start's: prints the figures.

    python benchmarks/restart_cache_bench.py [--processes 1 2] [--devices 4] [--raw]

For each process count P, runs `python -m jmirror.launch --processes P --devices-per-process
D/P --max-restarts 1` on tests/multiprocess/compile_worker.py (a small CNN's train step, which
fails on its first start) twice: with `--compilation-cache` in a new directory, and with
`--compilation-cache off`. Prints each run's first call on each process, cold and after the
restart, and the ratio of the slowest of each (a step waits for every process), in wall
time and in each process's CPU time (which a loaded machine stretches less). With `--raw`,
the same step written as plain JAX (benchmarks/restart_raw_worker.py: `jax.jit(jax.shard_map(
...))`, one process) runs under the same launcher after each jmirror run: the ratio JAX itself
reaches.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

WORKER = Path(__file__).parents[1] / "tests" / "multiprocess" / "compile_worker.py"
RAW_WORKER = Path(__file__).parent / "restart_raw_worker.py"


def first_calls(
    processes: int, devices: int, cache: str, worker: Path = WORKER
) -> dict[str, list[float]]:
    """The first call's seconds on each process, by restart ("0": cold, "1": restarted)."""
    command = [sys.executable, "-m", "jmirror.launch", "--processes", str(processes)]
    command += ["--devices-per-process", str(max(1, devices // processes))]
    command += ["--max-restarts", "1", "--compilation-cache", cache, str(worker)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {run.returncode}:\n{run.stderr[-3000:]}")
    found: dict[str, list[float]] = {"0": [], "1": [], "cpu0": [], "cpu1": []}
    pattern = r"first call restart (\d) process \d+ ([\d.]+) cpu ([\d.]+)"
    for restart, seconds, cpu in re.findall(pattern, run.stdout):
        found[restart].append(float(seconds))
        found[f"cpu{restart}"].append(float(cpu))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--raw", action="store_true", help="also the plain-JAX step (1 process)")
    args = parser.parse_args()
    for processes in args.processes:
        workers = [("jmirror", WORKER)]
        if args.raw and processes == 1:
            workers.append(("plain jax", RAW_WORKER))
        for label, given in (("cache", None), ("off", "off")):
            for name, worker in workers:
                with tempfile.TemporaryDirectory() as cache:
                    found = first_calls(processes, args.devices, given or cache, worker)
                wall = max(found["1"]) / max(found["0"])
                cpu = max(found["cpu1"]) / max(found["cpu0"])
                print(
                    f"{name} processes {processes} {label}: cold {found['0']} restart "
                    f"{found['1']} ratio {wall:.2f}; cpu cold {found['cpu0']} restart "
                    f"{found['cpu1']} ratio {cpu:.2f}"
                )


if __name__ == "__main__":
    main()
