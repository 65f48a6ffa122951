"""Per-call time of a small MLP's replicated train step, in one process: prints one figure.

    python benchmarks/per_call_bench.py [--hidden 32] [--calls 3000] [--rounds 5] [--nnx]

prints `per_call_us <median over rounds> min_us <fastest round> thread_cpu_us <median>` and
which jmirror it imported; `thread_cpu_us` is the CPU time of the calling thread per call (the
host's share, which the device threads' scheduling on a few cores does not move). The step is
small on purpose (a 2-layer MLP of `--hidden` units, 8 examples per replica), so that the figure
is mostly what a call costs on the host: jmirror's Python, the JIT's dispatch, the in-flight
bound. Self-contained (it imports only jmirror, JAX, optax,
flax), so that it can time another checkout of jmirror:
`PYTHONPATH=/path/to/other/checkout python benchmarks/per_call_bench.py`. RESULTS.md
alternates the two in fresh processes (A B A B ...) and takes the ratio of each pair.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jmirror as jm  # noqa: E402


class _MLP(nn.Module):
    hidden: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(10)(nn.relu(nn.Dense(self.hidden)(x)))


def _plain_step(strategy: jm.MirroredStrategy, hidden: int, x, y) -> Callable[[], Any]:
    """The linen step, state threaded through the loop: returns one call of it."""
    model, tx = _MLP(hidden), optax.sgd(1e-3)
    params = model.init(jax.random.key(0), jnp.zeros((1, 16)))

    @jm.replicate(strategy=strategy, donate_argnums=(0, 1))
    def step(params, opt_state, x, y):
        def loss_fn(p):
            logits = model.apply(p, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(jm.all_reduce("mean", grads), opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jm.all_reduce("mean", loss)

    held = {"state": strategy.mirror((params, tx.init(params)))}

    def call():
        held["state"] = step(*held["state"], x, y)[:2]
        return held["state"]

    return call


def _nnx_step(strategy: jm.MirroredStrategy, hidden: int, x, y) -> Callable[[], Any]:
    """The NNX in-place step (the model and optimizer written back): returns one call of it."""
    from flax import nnx

    class Mlp(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.hidden = nnx.Linear(16, hidden, rngs=rngs)
            self.out = nnx.Linear(hidden, 10, rngs=rngs)

        def __call__(self, x):
            return self.out(nnx.relu(self.hidden(x)))

    model = Mlp(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(1e-3), wrt=nnx.Param)

    @jm.replicate(strategy=strategy)
    def step(model, optimizer, x, y):
        def loss_fn(model):
            return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, jm.all_reduce("mean", grads))
        return jm.all_reduce("mean", loss)

    return lambda: step(model, optimizer, x, y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nnx", action="store_true", help="the NNX in-place step instead")
    args = parser.parse_args()

    strategy = jm.MirroredStrategy()
    n = strategy.num_replicas
    rng = np.random.default_rng(0)
    batch = (
        rng.normal(size=(n * 8, 16)).astype(np.float32),
        rng.integers(0, 10, size=(n * 8,)).astype(np.int32),
    )
    placed = next(iter(strategy.distribute_dataset([batch], remainder="drop")))  # placed once
    x, y = (jm.PerReplica(v) for v in placed.values)
    call = (_nnx_step if args.nnx else _plain_step)(strategy, args.hidden, x, y)
    for _ in range(50):  # compile and warm up
        out = call()
    jax.block_until_ready(out)
    per_call, thread_cpu = [], []
    for _ in range(args.rounds):
        start, start_cpu = time.perf_counter(), time.thread_time()
        for _ in range(args.calls):
            out = call()
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - start) / args.calls * 1e6)
        thread_cpu.append((time.thread_time() - start_cpu) / args.calls * 1e6)
    print(
        f"per_call_us {statistics.median(per_call):.2f} min_us {min(per_call):.2f} "
        f"thread_cpu_us {statistics.median(thread_cpu):.1f} "
        f"jmirror={os.path.dirname(jm.__file__)}"
    )


if __name__ == "__main__":
    main()
