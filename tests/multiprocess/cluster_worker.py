"""A program started by a cluster's launcher (or with a cluster's variables) in the tests.

    cluster_worker.py OUT_DIR MODE [TIMEOUT]

It never passes arguments to `jm.distributed.initialize()`: the cluster's variables are all it
has. Each process runs with 4 XLA:CPU host devices (`XLA_FLAGS`, set by the test). MODE:

- `train`: the equivalence training of train_worker.py, written to OUT_DIR/process<i>.npz
  with the process count and the GPUs JAX was told to use (`jax_cuda_visible_devices`).
- `join`: joins, writes the same count and GPUs (no training) and exits.
- `skip-0`: the process whose cluster index is 0 never calls `initialize` (it sleeps); the
  others call it with `timeout_s=TIMEOUT`.
"""

import json
import os
import runpy
import sys
import time
from pathlib import Path

import jax
from preamble import join

out_dir, mode = Path(sys.argv[1]), sys.argv[2]
timeout = float(sys.argv[3]) if len(sys.argv) > 3 else 300.0
index = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("SLURM_PROCID"))
if mode == "skip-0" and index == "0":
    print("process 0 does not join", flush=True)
    time.sleep(120)
    sys.exit(0)

join(timeout_s=timeout, watchdog_s=150)
seen = {
    "process_index": jax.process_index(),
    "process_count": jax.process_count(),
    "visible_gpus": jax.config.values["jax_cuda_visible_devices"],
}
print(json.dumps(seen), flush=True)
(out_dir / f"joined{jax.process_index()}.json").write_text(json.dumps(seen))
if mode == "train":
    sys.argv = [str(Path(__file__).parent / "train_worker.py"), str(out_dir)]
    runpy.run_path(sys.argv[0], run_name="__main__")
