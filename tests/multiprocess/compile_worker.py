"""Times the first call of a small CNN's train step, then fails on the first start.

Run by `python -m jmirror.launch --max-restarts 1 ...` (tests/test_launch_cache.py,
benchmarks/restart_cache_bench.py): XLA:CPU takes seconds to compile the step's convolutions
against a fraction of a second to trace it, so its first call after a restart shows whether
the compiled step was found in the persistent compilation cache. Prints
`first call restart R process I SECONDS cpu CPU_SECONDS compiled C found F` (wall and this
process's CPU time; the programs XLA compiled during the call and those the persistent cache
gave back, counted from JAX's own monitoring events); exits 3 on the first start
(JMIRROR_RESTART=0), so that the launcher restarts it, and 0 after.

With a directory argument the run resumes as a training run does: the first start saves its
`TrainState` there after the call, the restart restores it (`target=` a fresh one) and makes
its first call on the restored state, whose types must be those of the cold start's.
"""

import collections
import os
import sys
import time

import jmirror as jm

jm.distributed.initialize()  # before JAX starts its backends

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        for features in (16, 32, 32):
            x = nn.avg_pool(nn.relu(nn.Conv(features, (3, 3))(x)), (2, 2), (2, 2))
        return nn.Dense(10)(nn.relu(nn.Dense(64)(x.reshape(x.shape[0], -1))))


strategy = jm.MultiWorkerMirroredStrategy()
model, tx = CNN(), optax.sgd(1e-3)
checkpoint = sys.argv[1] if len(sys.argv) > 1 else None
restart = os.environ["JMIRROR_RESTART"]


@jm.replicate(strategy=strategy)
def step(state, x, y):
    def loss_fn(p):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y).mean()

    return state.apply_gradients(grads=jm.all_reduce("mean", jax.grad(loss_fn)(state.params)))


params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 16, 16, 1)))
state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)  # step: a Python 0
if checkpoint is None:
    state = strategy.mirror(state)
elif restart != "0":
    state = jm.checkpoint.restore(checkpoint, target=state, strategy=strategy)
# else: the state as `TrainState.create` made it, placed by the call (a Python 0 as its step)
x, y = strategy.mirror((np.ones((4, 16, 16, 1), np.float32), np.zeros((4,), np.int32)))
jax.block_until_ready((state, x, y))
events = collections.Counter()
# Every program JAX hands XLA passes through its backend-compile event, whether the persistent
# cache then gives it back (a cache hit) or XLA compiles it.
jax.monitoring.register_event_duration_secs_listener(lambda name, *_, **__: events.update([name]))
jax.monitoring.register_event_listener(lambda name, **_: events.update([name]))
began, began_cpu = time.perf_counter(), time.process_time()
state = jax.block_until_ready(step(state, x, y))
first_call, first_call_cpu = time.perf_counter() - began, time.process_time() - began_cpu
found = events["/jax/compilation_cache/cache_hits"]
compiled = events["/jax/core/compile/backend_compile_duration"] - found
if checkpoint is not None and restart == "0":
    jm.checkpoint.save(checkpoint, state, strategy=strategy, force=True)
print(
    f"first call restart {restart} process {jax.process_index()} {first_call:.4f} "
    f"cpu {first_call_cpu:.4f} compiled {compiled} found {found}"
)
sys.exit(3 if restart == "0" else 0)
