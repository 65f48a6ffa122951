"""Why are 8 XLA:CPU host devices on few cores slower than one? `python -m benchmarks.host_flags`

Measures, for the large MLP (hidden 2048, global batch 256), each XLA:CPU setting below in a
fresh process (XLA reads its flags once, at start-up):

- one device, the whole batch (`jax.jit`);
- one device, one replica's share of the batch (batch 256 / 8), i.e. the work of one replica;
- eight host devices, `jax.pmap` without the gradient all-reduce, and with it (`psum`).

Comparing the rows tells where the eight devices' time goes: if eight replicas' work took as
long as eight one-replica steps run back to back, the replicas do not run in parallel; the
difference between the last two columns is the all-reduce.
"""

from __future__ import annotations

import os
import subprocess
import sys

SETTINGS = [
    "",
    "--xla_cpu_multi_thread_eigen=false",
    "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
    "--xla_cpu_use_thunk_runtime=false",
    "--xla_cpu_enable_concurrency_optimized_scheduler=true",
    "--xla_cpu_use_xnnpack=true",
    "--xla_cpu_experimental_onednn_custom_call=true",
]

_CHILD = r"""
import os, statistics, sys, time
os.environ["XLA_FLAGS"] = sys.argv[1]
import jax
jax.config.update("jax_num_cpu_devices", 8)
from benchmarks.models import make_problem

params, tx, loss_fn, x, y = make_problem(2048)


def timed(f, *args):
    jax.block_until_ready(f(*args))
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(5):
            jax.block_until_ready(f(*args))
        runs.append((time.perf_counter() - start) / 5 * 1e3)
    return statistics.median(runs)


def sgd(p, g):
    return jax.tree.map(lambda a, b: a - 1e-3 * b, p, g)


one = jax.jit(lambda p, x, y: sgd(p, jax.grad(loss_fn)(p, x, y)))
px, py = x.reshape(8, -1, x.shape[-1]), y.reshape(8, -1)
local = jax.pmap(lambda p, x, y: sgd(p, jax.grad(loss_fn)(p, x, y)), "i", in_axes=(None, 0, 0))
reduced = jax.pmap(
    lambda p, x, y: sgd(p, jax.lax.psum(jax.grad(loss_fn)(p, x, y), "i")),
    "i", in_axes=(None, 0, 0), out_axes=None,
)
print(timed(one, params, x, y), timed(one, params, x[:32], y[:32]),
      timed(local, params, px, py), timed(reduced, params, px, py))
"""


def main() -> None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    print(
        "| XLA_FLAGS | 1 device, batch 256 | 1 device, batch 32 | 8 devices, no all-reduce "
        "| 8 devices, psum |"
    )
    print("|---|---|---|---|---|")
    for flags in SETTINGS:
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, flags], capture_output=True, text=True, cwd=root
        )
        if out.returncode != 0:
            print(f"| `{flags}` | failed: {out.stderr.strip().splitlines()[-1]} | | | |")
            continue
        cells = [f"{float(v):.1f} ms" for v in out.stdout.split()]
        print(f"| `{flags or '(none)'}` | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
