"""Micro-benchmarks: dispatch, reading and placing values, and the in-flight bound's cost."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import flax.jax_utils
import jax
import numpy as np

import jmirror as jm
from benchmarks._report import table
from benchmarks.models import make_problem

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rate(fn, calls: int, rounds: int, block=jax.block_until_ready) -> float:
    values = []
    for _ in range(rounds):
        start = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn()
        block(out)
        values.append(calls / (time.perf_counter() - start))
    return statistics.median(values)


def _interleaved(fns: dict, calls: int, rounds: int) -> dict[str, float]:
    rates: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            rates[name].append(_rate(fn, calls, 1))
    return {k: statistics.median(v) for k, v in rates.items()}


def _bounded(call):
    """At most 2 steps in flight, exactly as jm.replicate's default bound on CPU."""
    queue = []

    def step():
        while len(queue) >= 2:
            jax.block_until_ready(queue.pop(0))
        out = call()
        queue.append(out)
        return out

    return step


def dispatch(rounds: int, leaves: int = 1) -> list[list[str]]:
    """Calls/s of a trivial step (`x + 1` on every leaf of a tree of `leaves` arrays)."""
    n = jax.device_count()
    x = [np.ones((n, 16), np.float32) for _ in range(leaves)]

    def trivial(tree):
        return [a + 1 for a in tree]

    fns = {}
    for backend in ("pmap", "shard_map"):
        strategy = jm.MirroredStrategy(backend=backend)
        step = jm.replicate(trivial, strategy=strategy)
        px = jm.PerReplica(jax.device_put(x, strategy.topology.stacked))
        fns[f"jm.replicate[{backend}]"] = lambda step=step, px=px: step(px)
    raw = jax.pmap(trivial)
    rx = jax.device_put(x, jm.MirroredStrategy().topology.stacked)
    fns["raw jax.pmap"] = _bounded(lambda: raw(rx))
    for fn in fns.values():
        jax.block_until_ready(fn())
    rates = _interleaved(fns, max(20, 200 // leaves), rounds)
    base = rates["raw jax.pmap"]
    return [
        [f"dispatch, {leaves} leaf tree, {k}", f"{v:.0f} calls/s", f"{v / base:.2f}× raw jax.pmap"]
        for k, v in rates.items()
    ]


def reads(rounds: int) -> list[list[str]]:
    params = make_problem(512)[0]
    strategy = jm.MirroredStrategy()
    mirrored = strategy.mirror(params)
    stacked = flax.jax_utils.replicate(params)
    metrics = {k: strategy.sync_on_read(np.float32(1), "sum") for k in ("loss", "acc", "n")}
    rates = _interleaved(
        {
            "strategy.read(mirrored params)": lambda: strategy.read(mirrored),
            "flax.jax_utils.unreplicate(params)": lambda: flax.jax_utils.unreplicate(stacked),
            "strategy.read(3 SyncOnRead metrics)": lambda: strategy.read(metrics),
        },
        100,
        rounds,
    )
    ratio = rates["flax.jax_utils.unreplicate(params)"] / rates["strategy.read(mirrored params)"]
    rows = [[k, f"{1e6 / v:.0f} µs", ""] for k, v in rates.items()]
    rows[0][2] = f"time {ratio:.2f}× unreplicate's"
    return rows


_MEMORY = """
import os, sys, threading, time
from benchmarks.run import _setup_devices; _setup_devices()
import jax, jax.numpy as jnp, numpy as np
jnp.ones(1).block_until_ready()
import flax.jax_utils, jmirror as jm
tree = {"w%d" % i: np.ones((1024, 1024), np.float32) for i in range(8)}  # 32 MiB
strategy = jm.MirroredStrategy()


def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


peak, done = [rss()], []


def poll():  # the transient peak, sampled every half millisecond
    while not done:
        peak[0] = max(peak[0], rss())
        time.sleep(0.0005)


base = rss()
watcher = threading.Thread(target=poll)
watcher.start()
start = time.perf_counter()
out = strategy.mirror(tree) if sys.argv[1] == "mirror" else flax.jax_utils.replicate(tree)
jax.block_until_ready(out)
took = time.perf_counter() - start
done.append(True)
watcher.join()
peak = max(peak[0], rss())
print(took, (peak - base) / (32 * 2**20 * jax.device_count()))
"""


def placement() -> list[list[str]]:
    rows = []
    for how in ("mirror", "flax.jax_utils.replicate"):
        out = subprocess.run(
            [sys.executable, "-c", _MEMORY, how.split(".")[0]],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        if out.returncode != 0:
            rows.append([how, "failed", out.stderr.strip().splitlines()[-1]])
            continue
        took, peak = map(float, out.stdout.split())
        rows.append(
            [f"{how}(32 MiB tree)", f"{took * 1e3:.0f} ms", f"peak {peak:.2f} × N × tree bytes"]
        )
    return rows


def in_flight_cost(rounds: int) -> list[list[str]]:
    """jmirror's bounded loop against an unbounded raw loop short enough not to deadlock."""
    n = jax.device_count()
    strategy = jm.MirroredStrategy()
    step = jm.replicate(lambda w, x: w + jm.all_reduce("mean", x), strategy=strategy)
    w = strategy.mirror(np.zeros(1024, np.float32))
    x = jm.PerReplica(jax.device_put(np.ones((n, 1024), np.float32), strategy.topology.stacked))
    raw = jax.pmap(lambda w, x: w + jax.lax.pmean(x, "i"), "i", in_axes=(None, 0), out_axes=None)
    rx = x.values
    jax.block_until_ready((step(w, x), raw(w, rx)))
    short = 32  # well under the ~200 queued steps at which XLA:CPU deadlocks
    rates = _interleaved(
        {
            "jm.replicate (max_in_flight=2)": lambda: step(w, x),
            "raw jax.pmap, unbounded": lambda: raw(w, rx),
        },
        short,
        rounds,
    )
    a, b = rates.values()
    return [[k, f"{v:.0f} steps/s", ""] for k, v in rates.items()][:1] + [
        ["raw jax.pmap, unbounded (32 steps)", f"{b:.0f} steps/s", f"bounded/unbounded {a / b:.3f}"]
    ]


def donation_cost(rounds: int) -> list[list[str]]:
    """Raw jax.pmap on the large MLP, donating its state or not (why jmirror skips it on CPU)."""
    import optax

    params, tx, loss_fn, x, y = make_problem(2048)
    n = jax.device_count()
    strategy = jm.MirroredStrategy()
    batch = jax.device_put(
        (x.reshape(n, -1, x.shape[-1]), y.reshape(n, -1)), strategy.topology.stacked
    )

    def train_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(jax.lax.pmean(grads, "i"), opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "i")

    fns = {}
    for donate in ((0, 1), ()):
        step = jax.pmap(
            train_step, "i", in_axes=(None, None, 0, 0), out_axes=None, donate_argnums=donate
        )
        state = list(strategy.mirror((jax.tree.map(np.asarray, params), tx.init(params))))

        def run(step=step, state=state):
            state[0], state[1], loss = step(state[0], state[1], *batch)
            return loss

        fns[f"raw jax.pmap, hidden 2048, donate_argnums={donate}"] = _bounded(run)
    for fn in fns.values():
        jax.block_until_ready(fn())
    rates = _interleaved(fns, 5, rounds)
    (a, ra), (b, rb) = rates.items()
    return [[a, f"{ra:.1f} steps/s", ""], [b, f"{rb:.1f} steps/s", f"{rb / ra:.2f}× donating"]]


def report(rounds: int) -> str:
    rows = (
        dispatch(rounds)
        + dispatch(rounds, leaves=100)
        + reads(rounds)
        + placement()
        + in_flight_cost(rounds)
        + donation_cost(rounds)
    )
    return table("Micro-benchmarks", rows, ["what", "median", "ratio"])
