"""Times the first call of compile_worker.py's step as plain JAX, then fails on the first start.

The baseline of benchmarks/restart_cache_bench.py: the same CNN, `TrainState` and batch as
tests/multiprocess/compile_worker.py, its step a hand-written `jax.jit(jax.shard_map(...))` with
`lax.pmean` over a one-axis mesh of this process's devices (one process only), so that the
restarted first call shows what JAX itself costs with the persistent cache. The process joins
the run as the jmirror worker does (`jm.distributed.initialize()`, JAX's distributed runtime),
so that the two differ in the step only. Run by
`python -m jmirror.launch --processes 1 --max-restarts 1 ...`, which sets the cache in the
environment; prints `first call restart R process 0 SECONDS cpu CPU_SECONDS` and exits 3 on the
first start (JMIRROR_RESTART=0).
"""

import os
import sys
import time

import jmirror as jm

jm.distributed.initialize()  # as compile_worker.py: the same process, the step aside

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        for features in (16, 32, 32):
            x = nn.avg_pool(nn.relu(nn.Conv(features, (3, 3))(x)), (2, 2), (2, 2))
        return nn.Dense(10)(nn.relu(nn.Dense(64)(x.reshape(x.shape[0], -1))))


model, tx = CNN(), optax.sgd(1e-3)
mesh = Mesh(np.array(jax.devices()), ("batch",))


def replica_step(state, x, y):
    def loss_fn(p):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y).mean()

    return state.apply_gradients(grads=jax.lax.pmean(jax.grad(loss_fn)(state.params), "batch"))


step = jax.jit(
    jax.shard_map(replica_step, mesh=mesh, in_specs=(P(), P("batch"), P("batch")), out_specs=P())
)
params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 16, 16, 1)))
state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
state = jax.device_put(state, NamedSharding(mesh, P()))
n = len(jax.devices())
x, y = jax.device_put(
    (np.ones((4 * n, 16, 16, 1), np.float32), np.zeros((4 * n,), np.int32)),
    NamedSharding(mesh, P("batch")),
)
jax.block_until_ready((state, x, y))
began, began_cpu = time.perf_counter(), time.process_time()
state = jax.block_until_ready(step(state, x, y))
first_call, first_call_cpu = time.perf_counter() - began, time.process_time() - began_cpu
restart = os.environ["JMIRROR_RESTART"]
print(f"first call restart {restart} process 0 {first_call:.4f} cpu {first_call_cpu:.4f}")
sys.exit(3 if restart == "0" else 0)
