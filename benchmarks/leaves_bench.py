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

`--per-call` measures instead what jmirror's own Python costs on every call (issue 18), in one
process per tree size, against two baselines measured in the same run, interleaved:

- `direct`: the very `jax.jit` that `jm.replicate` dispatches to (same compiled program, same
  arguments), called directly, so that `jm - direct` is exactly what jmirror adds in Python:
  the donation policy, the donated-argument check, the bound on steps in flight, typing;
- `plain jit`: a plain `jax.jit` of the same step over `NamedSharding` inputs (the mirrored
  tree donated, the batch split over the devices), what a user without jmirror would call.

Each timed call starts with the devices idle (the previous step's outputs are waited for
before the clock starts) and ends when the call returns. On host devices a call returns only
after much of the step has run, so `jm - direct` carries the noise of two executions; the
`own` column is measured inside the same call instead: the time `jm.replicate`'s call takes
minus the time spent inside the `jax.jit` it dispatches to (timed around that one call), which
is jmirror's own Python exactly. Figures are medians over `--calls` calls in each of `--rounds`
interleaved rounds. The benchmark MLP row
(`benchmarks/models.py`, hidden 512, Adam-free SGD step, params and optimizer state donated)
compares `jm.replicate` with its `direct` jit the same way.

Goals (issue 18): `own / plain jit` <= 0.02 at 10,000 leaves, and `own` <= 50 us on the
benchmark MLP.

    python benchmarks/leaves_bench.py [--leaves 3000 10000] [--repeats 1]
    python benchmarks/leaves_bench.py --per-call [--leaves 1000 10000] [--calls 20] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
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


_SETTLE = float(os.environ.get("SETTLE", 0))


def _idle_call(fn, *args):
    """One call of `fn`, started with nothing in flight: (wall seconds, CPU seconds of this
    thread, output) until it returns."""
    import jax

    jax.block_until_ready(args)
    if _SETTLE:
        time.sleep(_SETTLE)
    start, cpu = time.perf_counter(), time.thread_time()
    out = fn(*args)
    return time.perf_counter() - start, time.thread_time() - cpu, out


def _time_inner(step) -> list[tuple[float, float]]:
    """Makes `step` (a `jm.replicate` function) record the time spent inside its own jit.

    Returns the list each call of that jit appends its (wall, thread CPU) seconds to.
    """
    spent: list[tuple[float, float]] = []

    def timed(fn):
        def call(*args, **kwargs):
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent.append((time.perf_counter() - start, time.thread_time() - cpu))

        return call

    step._jitted_by_donation = {k: timed(v) for k, v in step._jitted_by_donation.items()}
    return spent


def per_call(leaves: int, calls: int, rounds: int) -> dict[str, float]:
    """Median seconds per call of `jm`, `direct` and `plain jit` over a tree of `leaves`."""
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jmirror as jm

    strategy = jm.MirroredStrategy()
    n = strategy.num_replicas
    tree = {f"layer{i}": np.full((4,), i, np.float32) for i in range(leaves)}
    x = jax.device_put(np.ones((n,), np.float32), strategy.topology.stacked)
    step = jm.replicate(
        lambda t, x: (lambda m: jax.tree.map(lambda v: v + m, t))(jm.all_reduce("mean", x)),
        strategy=strategy,
        donate_argnums=0,
    )
    inner = step._jitted_by_donation[True]  # what jm.replicate dispatches to
    spent = _time_inner(step)
    plain = jax.jit(
        lambda t, x: (lambda m: jax.tree.map(lambda v: v + m, t))(jnp.mean(x)),
        donate_argnums=0,
        out_shardings=NamedSharding(strategy.mesh, P()),
    )
    px = jax.device_put(
        np.ones((n,), np.float32), NamedSharding(strategy.mesh, P(strategy.axis_name))
    )
    state = {
        "jm": step(strategy.mirror(tree), jm.PerReplica(x)),
        "direct": inner(strategy, strategy.mirror(tree), jm.PerReplica(x))[0],
        "plain jit": plain(strategy.mirror(tree), px),
    }
    calls_of = {
        "jm": lambda s: step(s, jm.PerReplica(x)),
        "direct": lambda s: inner(strategy, s, jm.PerReplica(x))[0],
        "plain jit": lambda s: plain(s, px),
    }
    out = _interleaved_calls(state, calls_of, calls, rounds, spent)
    out["own warm"] = _warm_own(step, strategy, (state["jm"], jm.PerReplica(x)), calls=20)
    return out


def _warm_own(step, strategy, args: tuple, calls: int = 200, rounds: int = 5) -> float:
    """jmirror's own Python per call, warm: `step` called in a tight loop with its jit replaced
    by a stub that returns at once (no device work, nothing donated; a ready scalar as the
    in-flight token), minus the same loop over the stub alone. Median seconds per call over
    `rounds`."""
    import numpy as np

    jitted = step._jitted_by_donation
    fixed = (None, strategy.mirror(np.zeros((), np.int8)))

    def stub(*_args, **_kwargs):
        return fixed

    step._jitted_by_donation = {True: stub, False: stub}
    try:
        values = []
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(calls):
                step(*args)
            middle = time.perf_counter()
            for _ in range(calls):
                stub(strategy, *args)
            values.append((2 * middle - start - time.perf_counter()) / calls)
        return statistics.median(values)
    finally:
        step._jitted_by_donation = jitted


def _interleaved_calls(
    state: dict, calls_of: dict, calls: int, rounds: int, spent: list[tuple[float, float]]
) -> dict[str, float]:
    """Median seconds per call of each of `calls_of`, and jmirror's `own` share of `jm`'s
    (wall time, and `own cpu`: this thread's CPU time)."""
    times: dict[str, list[float]] = {k: [] for k in calls_of}
    times.update({f"{k} cpu": [] for k in calls_of})
    own, own_cpu = [], []
    for _ in range(rounds):
        for name, call in calls_of.items():
            for _ in range(calls):
                spent.clear()
                seconds, cpu, state[name] = _idle_call(call, state[name])
                times[name].append(seconds)
                times[f"{name} cpu"].append(cpu)
                if name == "jm":
                    own.append(seconds - sum(w for w, _ in spent))
                    own_cpu.append(cpu - sum(c for _, c in spent))
    out = {k: statistics.median(v) for k, v in times.items()}
    out["own"], out["own cpu"] = statistics.median(own), statistics.median(own_cpu)
    return out


def per_call_mlp(calls: int, rounds: int) -> dict[str, float]:
    """The benchmark MLP's step (hidden 512): `jm` against its `direct` jit."""
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import optax

    import jmirror as jm
    from benchmarks.models import FEATURES, make_problem

    params, tx, loss_fn, x, y = make_problem(512)
    strategy = jm.MirroredStrategy()
    n = strategy.num_replicas

    def train_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        grads = jm.all_reduce("mean", grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jm.all_reduce("mean", loss)

    step = jm.replicate(train_step, strategy=strategy, donate_argnums=(0, 1))
    inner = step._jitted_by_donation[True]
    spent = _time_inner(step)
    batch = jax.device_put(
        (x.reshape(n, -1, FEATURES), y.reshape(n, -1)), strategy.topology.stacked
    )
    bx, by = jm.PerReplica(batch[0]), jm.PerReplica(batch[1])
    state = {
        "jm": step(*strategy.mirror((params, tx.init(params))), bx, by)[:2],
        "direct": inner(strategy, *strategy.mirror((params, tx.init(params))), bx, by)[0][:2],
    }
    calls_of = {
        "jm": lambda s: step(*s, bx, by)[:2],
        "direct": lambda s: inner(strategy, *s, bx, by)[0][:2],
    }
    out = _interleaved_calls(state, calls_of, calls, rounds, spent)
    out["own warm"] = _warm_own(step, strategy, (*state["jm"], bx, by))
    return out


_FIRST_CALL_MODES = ("jit", "shard_map", "packed shard_map", "jm")


def first_call(mode: str, leaves: int) -> dict[str, float]:
    """Seconds of the first call (compile included) of the pass-through step over `leaves`:
    every leaf plus the mean of a per-replica value (one collective).

    `jit`: plain `jax.jit` over `NamedSharding` inputs (XLA's automatic partitioner);
    `shard_map`: a hand `jax.jit(jax.shard_map(...))` of the same step, one input per leaf;
    `packed shard_map`: the same with the leaves packed into one buffer per dtype outside the
    manual region (concatenated before, sliced inside, packed again, split after), which is
    what packing in `jm.replicate` would do; `jm`: `jm.replicate` (the pmap backend).
    """
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jmirror as jm

    strategy = jm.MirroredStrategy()
    n, axis, mesh = strategy.num_replicas, strategy.axis_name, strategy.mesh
    tree = {f"layer{i}": np.full((4,), i, np.float32) for i in range(leaves)}
    mirrored = strategy.mirror(tree)
    x = jax.device_put(np.ones((n,), np.float32), NamedSharding(mesh, P(axis)))
    jax.block_until_ready((mirrored, x))

    def body(t, x):
        m = jax.lax.pmean(x[0], axis)
        return jax.tree.map(lambda v: v + m, t)

    if mode == "jit":
        step = jax.jit(lambda t, x: (lambda m: jax.tree.map(lambda v: v + m, t))(jnp.mean(x)))
    elif mode == "shard_map":
        step = jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=(P(), P(axis)), out_specs=P(), check_vma=False)
        )
    elif mode == "packed shard_map":
        step = jax.jit(_packed(body, mesh, axis))
    else:
        replicated = jm.replicate(
            lambda t, x: (lambda m: jax.tree.map(lambda v: v + m, t))(jm.all_reduce("mean", x)),
            strategy=strategy,
        )
        x = jm.PerReplica(x)

        def step(t, x):
            return replicated(t, x)

    start = time.perf_counter()
    out = step(mirrored, x)
    jax.block_until_ready(out)
    seconds = time.perf_counter() - start
    got = np.asarray(jax.tree.leaves(out)[-1].addressable_data(0))
    if not np.allclose(got, np.asarray(jax.tree.leaves(tree)[-1]) + 1.0):
        raise AssertionError(f"{mode} computed {got}")
    return {"seconds": seconds, "peak_mib": _peak_rss_mib()}


def _packed(body, mesh, axis):
    """`body(tree, x)` under `shard_map` with the tree's leaves packed per dtype."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    def pack(leaves):
        groups: dict = {}
        for i, leaf in enumerate(leaves):
            groups.setdefault(jnp.dtype(leaf.dtype), []).append(i)
        order = [i for members in groups.values() for i in members]
        buffers = [jnp.concatenate([leaves[i].ravel() for i in m]) for m in groups.values()]
        return buffers, (list(groups.values()), order)

    def unpack(buffers, layout, like):
        groups, _ = layout
        out = [None] * len(like)
        for buffer, members in zip(buffers, groups):
            start = 0
            for i in members:
                size = int(np.prod(like[i].shape))
                out[i] = buffer[start : start + size].reshape(like[i].shape)
                start += size
        return out

    def step(tree, x):
        leaves, treedef = jax.tree.flatten(tree)
        buffers, layout = pack(leaves)
        shapes = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in leaves]

        def inner(x, *buffers):
            t = treedef.unflatten(unpack(buffers, layout, shapes))
            outs = jax.tree.leaves(body(t, x))
            return tuple(pack(outs)[0])

        specs = (P(axis),) + (P(),) * len(buffers)
        packed = jax.shard_map(inner, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)(
            x, *buffers
        )
        return treedef.unflatten(unpack(packed, layout, shapes))

    return step


def main_first_call(leaves: list[int], repeats: int) -> None:
    print("| leaves | first call | seconds | peak MiB | × plain jit (time) |")
    print("|---|---|---|---|---|")
    for n in leaves:
        results = {}
        for mode in _FIRST_CALL_MODES:
            runs = [_run_code(f"first_call({mode!r}, {n})") for _ in range(repeats)]
            results[mode] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        base = results["jit"]["seconds"]
        for mode, r in results.items():
            ratio = r["seconds"] / base
            print(f"| {n} | {mode} | {r['seconds']:.2f} | {r['peak_mib']:.0f} | {ratio:.2f} |")


def _run_code(call: str) -> dict[str, float]:
    code = (
        "import json, sys; sys.path.insert(0, 'benchmarks'); import leaves_bench as b; "
        f"print(json.dumps(b.{call}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=3600
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main_per_call(leaves: list[int], calls: int, rounds: int) -> None:
    print("| step | jm µs | direct µs | plain jit µs | own µs | own ÷ plain jit | own ÷ direct |")
    print("|---|---|---|---|---|---|---|")
    runs = [("benchmark MLP", f"per_call_mlp({calls}, {rounds})")]
    runs += [(f"{n} leaves", f"per_call({n}, {calls}, {rounds})") for n in leaves]
    for label, call in runs:
        r = {k: v * 1e6 for k, v in _run_code(call).items()}
        for clock, suffix in (("wall", ""), ("CPU", " cpu")):
            plain = r.get("plain jit" + suffix)
            own = r["own" + suffix]
            cells = [
                f"{r['jm' + suffix]:.0f}",
                f"{r['direct' + suffix]:.0f}",
                "" if plain is None else f"{plain:.0f}",
                f"{own:.1f}",
                "" if plain is None else f"{own / plain:.4f}",
                f"{own / r['direct' + suffix]:.4f}",
                f"{r['own warm']:.1f}" if clock == "wall" else "",
            ]
            print(f"| {label} ({clock}) | " + " | ".join(cells) + " |")


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
    parser.add_argument("--per-call", action="store_true", help="per-call cost instead")
    parser.add_argument(
        "--first-call", action="store_true", help="first calls with and without packing"
    )
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if args.per_call:
        main_per_call(args.leaves, args.calls, args.rounds)
        return
    if args.first_call:
        main_first_call(args.leaves, args.repeats)
        return
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
