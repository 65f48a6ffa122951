"""A program run as several processes by tests/test_launch.py and tests/test_distributed.py.

    worker.py [--coordinator HOST:PORT --num-processes N --process-id I] MODE [ARG]

Without `--coordinator` it calls `jm.distributed.initialize()` (the launcher's environment);
with it, it sets 4 host devices and passes the three arguments. Then MODE:

- `sum`: print this process's index and a cross-process sum, and exit 0.
- `loop`: print its pid, then sum across processes forever, printing `step K` now and then.
- `exit CODE`: process 1 exits with CODE after one sum; the others go on summing forever.
- `raise`: process 1 raises an uncaught exception after one sum; the others go on summing.
- `quiet`: print `looping`, then sum across processes forever without printing (a program
  whose output never shows that its launcher is gone).
"""

import argparse
import os
import sys
import time

import jax

parser = argparse.ArgumentParser()
parser.add_argument("--coordinator")
parser.add_argument("--num-processes", type=int)
parser.add_argument("--process-id", type=int)
parser.add_argument("mode", choices=["sum", "loop", "exit", "raise", "quiet"])
parser.add_argument("code", nargs="?", type=int, default=0)
options = parser.parse_args()

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from preamble import join  # noqa: E402

if options.coordinator:
    join(options.coordinator, options.num_processes, options.process_id, devices=4)
else:
    join()

index, count = jax.process_index(), jax.process_count()
mesh = jax.make_mesh((jax.device_count(),), ("x",), devices=jax.devices())
total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))
# Process p holds rows of value p + 1: the sum over every process is known in advance.
local = np.full((jax.local_device_count(), 8), index + 1, np.float32)
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), local)
expected = sum(p + 1 for p in range(count)) * jax.local_device_count() * 8


def step() -> float:
    return float(total(x))


print(f"process {index} of {count}, {jax.local_device_count()} local devices, pid {os.getpid()}")
print(f"process {index}: coordinator {os.environ.get('JMIRROR_COORDINATOR', options.coordinator)}")
result = step()
print(f"process {index}: sum {result:g} expected {expected:g}")
print(f"process {index}: on stderr", file=sys.stderr)
if options.mode == "sum":
    sys.exit(0 if result == expected else 1)
if options.mode == "exit" and index == 1:
    print("process 1: exiting", file=sys.stderr)
    sys.exit(options.code)
if options.mode == "raise" and index == 1:
    raise RuntimeError("process 1 fails on purpose")
if options.mode == "quiet":
    print("looping", flush=True)
    while True:
        step()
        time.sleep(0.005)
k = 0
while True:
    step()
    time.sleep(0.005)  # leave the shared cores some room
    k += 1
    if k % 20 == 0:
        print(f"step {k}")
