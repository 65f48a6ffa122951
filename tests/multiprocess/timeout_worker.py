"""A program run as 2 processes x 4 host devices by tests/test_timeouts.py.

    timeout_worker.py MODE TIMEOUT [DIR]

TIMEOUT is `timeout_s` (a number, or `none`) for the strategy (and for `initialize` in mode
`no-init`). MODE:

- `stuck`: 5 steps, then process 1 sleeps "forever"; process 0 goes on stepping and printing
  the reduced loss (it waits in its read or its step for process 1).
- `stuck-input`: as `stuck`, the batches coming from `distribute_dataset` (process 0 waits in
  the input agreement or its step).
- `skip-save`: 3 steps, then process 0 calls `jm.checkpoint.save(DIR, ...)` and process 1
  does not (it goes on stepping).
- `skip-manager-save`: the same with `CheckpointManager(DIR).save(3, ...)` (async).
- `no-init`: process 1 never calls `jm.distributed.initialize` (it sleeps); process 0 does.
- `first`: process 1 sleeps "forever" before the first collective; process 0 steps.
- `slow`: 5 steps, process 1 sleeps 25 s, then both take 5 more steps and exit 0, printing the
  threads jmirror started.

The landed code (before timeouts) has no `timeout_s`: the worker then leaves it out, so the
tests show the old behaviour (a hang) instead of failing on a `TypeError`.
"""

import inspect
import os
import sys
import threading
import time

import jax.numpy as jnp
import numpy as np
from preamble import join

import jmirror as jm

mode, timeout_arg = sys.argv[1], sys.argv[2]
directory = sys.argv[3] if len(sys.argv) > 3 else None
timeout = None if timeout_arg == "none" else float(timeout_arg)
me = int(os.environ["JMIRROR_PROCESS_ID"])
FOREVER = 3600


def supports_timeout(fn) -> bool:
    return "timeout_s" in inspect.signature(fn).parameters


def say(text: str) -> None:
    print(f"worker: {text}", flush=True)


if mode == "no-init" and me == 1:
    say("process 1 never calls initialize")
    time.sleep(FOREVER)
init = {"timeout_s": timeout} if supports_timeout(jm.distributed.initialize) else {}
join(**init)
say(f"process {me} initialized")

kwargs = {"timeout_s": timeout} if supports_timeout(jm.MultiWorkerMirroredStrategy) else {}
strategy = jm.MultiWorkerMirroredStrategy(**kwargs)


def loss_step(w, x):
    loss = jnp.mean((x @ w) ** 2)
    grad = jm.all_reduce("mean", 2 * x.T @ (x @ w) / x.shape[0])
    return w - 0.01 * grad, loss


step = jm.replicate(loss_step, strategy=strategy)
w = strategy.mirror(np.ones((8, 1), np.float32))
rng = np.random.default_rng(me)


def one_step(k: int) -> float:
    global w
    x = jm.PerReplica(rng.normal(size=(strategy.num_local_replicas, 4, 8)).astype(np.float32))
    w, loss = step(w, x)
    total = float(strategy.reduce("sum", loss))
    say(f"process {me} step {k} loss {total:.4f}")
    return total


if mode == "stuck-input":
    n = strategy.num_replicas

    def batches():
        for k in range(10**6):
            if k == 5 and me == 1:
                say("process 1 is stuck")
                time.sleep(FOREVER)
            yield np.random.default_rng(k).normal(size=(n * 4, 8)).astype(np.float32)

    for k, batch in enumerate(strategy.distribute_dataset(batches, remainder="drop", prefetch=0)):
        w, loss = step(w, batch)
        say(f"process {me} step {k}")
if mode == "first" and me == 1:
    say("process 1 sleeps before the first collective")
    time.sleep(FOREVER)
for k in range(3 if mode.startswith("skip") else 5):
    one_step(k)
if mode == "stuck":
    if me == 1:
        say("process 1 is stuck")
        time.sleep(FOREVER)
    for k in range(5, 10**6):
        one_step(k)
if mode == "skip-save":
    if me == 0:
        say("process 0 saves")
        jm.checkpoint.save(directory, {"w": w}, strategy=strategy)
        say("process 0 saved")
    for k in range(3, 10**6):
        one_step(k)
if mode == "skip-manager-save":
    manager = jm.checkpoint.CheckpointManager(directory, strategy=strategy)
    if me == 0:
        say("process 0 saves")
        manager.save(3, {"w": w})
        say("process 0 saved")
    for k in range(3, 10**6):
        one_step(k)
if mode == "slow":
    if me == 1:
        say("process 1 sleeps 25 s")
        time.sleep(25)
    for k in range(5, 10):
        one_step(k)
    names = sorted(t.name for t in threading.enumerate() if t.name.startswith("jmirror-deadline"))
    say(f"process {me} deadline threads {names}")
    say(f"process {me} done")
if mode == "first":
    for k in range(5, 10**6):
        one_step(k)
