"""Replicas spanning k devices (SPEC 13), in one run: `python -m benchmarks.spanning_bench`.

On 8 host devices, every figure a ratio between variants measured in the same process:

1. **Step time** at k = 2 and k = 4 (`jm.MirroredStrategy(devices_per_replica=k,
   layout=LAYOUT)`, a `jm.replicate` Adam step with `jm.all_reduce` of the gradients) against
   the same model written by hand as `jax.jit` with `NamedSharding`s over the same (N, k)
   mesh (`("replica", "model")`): the same layout (kernels alternately `P(None, "model")` and
   `P("model", None)`, biases replicated, the batch `P("replica")`), the same global batch,
   both donating their state. Both are first checked to compute the same losses (rtol 1e-5)
   over a few steps from the same parameters. Interleaved rounds, medians; target
   jmirror / hand <= 1.05.
2. **Largest model in a per-device budget**: the widest MLP whose compiled Adam step needs
   at most the k = 1 mirrored step's memory at `--reference-width` (`memory_analysis()`:
   arguments + outputs + temporaries - aliased, per device), found by bisection on the width
   (compiling only, on abstract arguments: nothing is allocated or run), at k = 1, 2, 4;
   mirrored Adam (target: k's parameters >= 0.9 k x k = 1's), `jm.shard_update(adam)` with its
   default buckets on top (target >= 1.6 x 0.9 k x the k = 1 mirrored step's), and for
   reference the hand-written GSPMD step.
3. **`jm.shard_update(tx)` against the mirrored update at k = 1**: the largest model is the
   k = 1 rows of 2 (target >= 1.6x); the step time reuses `benchmarks.shard_bench`'s
   interleaved timing on this benchmark's MLP (target <= 1.05x).

    python -m benchmarks.spanning_bench [--rounds 9] [--steps 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from typing import Any

import jmirror.testing as jmt

NUM_DEVICES = 8
SPANS = (2, 4)  # k of the step-time comparison
MEMORY_SPANS = (1, 2, 4)  # k of the memory search
FEATURES = 128
CLASSES = 16  # divisible by every k: the head's kernel is laid out too
# Kernels alternate column- and row-parallel (Megatron's MLP); biases stay replicated.
LAYOUT_RULES = (
    (r"_col'\]\['kernel'\]", ("None", "model")),
    (r"_row'\]\['kernel'\]", ("model", "None")),
)
WIDTH_STEP = 32  # the bisection's resolution (a multiple of every k)


def _spec(entries: tuple[str, ...]):
    from jax.sharding import PartitionSpec as P

    return P(*(None if e == "None" else e for e in entries))


def layout() -> list[tuple[str, Any]]:
    """The `(regex, PartitionSpec)` pairs given to `MirroredStrategy(layout=...)`."""
    return [(regex, _spec(entries)) for regex, entries in LAYOUT_RULES]


def spec_of(path: Any):
    """The spec the layout rules give a leaf at `path` (first match, else replicated): what the
    hand-written step uses, so both lay out the same leaves the same way."""
    import jax
    from jax.sharding import PartitionSpec as P

    key = jax.tree_util.keystr(path)
    for regex, spec in layout():
        if re.search(regex, key):
            return spec
    return P()


def _names(depth: int) -> list[str]:
    return [f"layer{i}_{'col' if i % 2 == 0 else 'row'}" for i in range(depth + 1)]


def _dims(width: int, depth: int) -> list[int]:
    return [FEATURES] + [width] * depth + [CLASSES]


def init_params(width: int, depth: int, seed: int = 0) -> dict:
    """An MLP of `depth` hidden layers of `width` (numpy float32, He-scaled normal)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    dims = _dims(width, depth)
    return {
        name: {
            "kernel": (rng.standard_normal((a, b)) * np.sqrt(2.0 / a)).astype(np.float32),
            "bias": np.zeros((b,), np.float32),
        }
        for name, a, b in zip(_names(depth), dims[:-1], dims[1:])
    }


def abstract_params(width: int, depth: int) -> dict:
    """`init_params`'s shapes as `jax.ShapeDtypeStruct`s (nothing allocated)."""
    import jax
    import jax.numpy as jnp

    dims = _dims(width, depth)
    return {
        name: {
            "kernel": jax.ShapeDtypeStruct((a, b), jnp.float32),
            "bias": jax.ShapeDtypeStruct((b,), jnp.float32),
        }
        for name, a, b in zip(_names(depth), dims[:-1], dims[1:])
    }


def loss_fn(params: dict, x: Any, y: Any) -> Any:
    import jax
    import optax

    h = x
    names = sorted(params, key=lambda s: int(s[5:].split("_")[0]))
    for i, name in enumerate(names):
        h = h @ params[name]["kernel"] + params[name]["bias"]
        if i < len(names) - 1:
            h = jax.nn.relu(h)
    return optax.softmax_cross_entropy_with_integer_labels(h, y).mean()


def data(batch: int, seed: int = 1) -> tuple[Any, Any]:
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=(batch,)).astype(np.int32)
    return x, y


def _adam():
    import optax

    return optax.adam(1e-3)


# --- the two steps --------------------------------------------------------------------------


def strategy_of(k: int, donation: str = "auto"):
    import jmirror as jm

    return jm.MirroredStrategy(devices_per_replica=k, layout=layout(), donation=donation)


def jm_step(strategy, tx: Any, sharded: bool):
    """The replicated Adam step: `jm.all_reduce` MEAN of the gradients then `tx` (mirrored
    state), or a `jm.shard_update` `tx` given this replica's own gradients (`sharded`)."""
    import jax
    import optax

    import jmirror as jm

    @jm.replicate(strategy=strategy, donate_argnums=(0, 1))
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        if not sharded:
            grads = jm.all_reduce("mean", grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jm.all_reduce("mean", loss)

    return step


def hand_mesh(k: int):
    """The (N, k) mesh `("replica", "model")` over the devices in their order."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    devices = np.array(jax.devices()).reshape(-1, k)
    return Mesh(devices, ("replica", "model"))


def hand_shardings(mesh, params: Any, tx: Any):
    """(params', optimizer state's, batch's) `NamedSharding`s of the hand-written step."""
    import jax
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    param_sh = jax.tree_util.tree_map_with_path(
        lambda path, _: NamedSharding(mesh, spec_of(path)), params
    )
    replicated = NamedSharding(mesh, P())
    state = jax.eval_shape(tx.init, params)
    state_sh = optax.tree_map_params(
        tx,
        lambda _, sharding: sharding,
        state,
        param_sh,
        transform_non_params=lambda _: replicated,
    )
    return param_sh, state_sh, NamedSharding(mesh, P("replica")), replicated


def hand_step(mesh, params: Any, tx: Any):
    """The same Adam step as `jax.jit` over `mesh` (GSPMD): the same layout, donated state."""
    import jax
    import optax

    param_sh, state_sh, batch_sh, replicated = hand_shardings(mesh, params, tx)

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(
        step,
        in_shardings=(param_sh, state_sh, batch_sh, batch_sh),
        out_shardings=(param_sh, state_sh, replicated),
        donate_argnums=(0, 1),
    )


# --- 1. step time ---------------------------------------------------------------------------


class _Loop:
    """One variant's training loop on placed state: `run(steps)` runs that many steps with
    at most two in flight (as jmirror does: XLA:CPU host devices deadlock with many queued
    collective steps) and waits for the last."""

    def __init__(self, name: str, step: Any, state: list[Any], batch: tuple[Any, Any]):
        self.name, self.step, self.state, self.batch = name, step, state, batch

    def one(self) -> Any:
        self.state[0], self.state[1], loss = self.step(*self.state, *self.batch)
        return loss

    def run(self, steps: int) -> Any:
        import jax

        queue: list[Any] = []
        for _ in range(steps):
            while len(queue) >= 2:
                jax.block_until_ready(queue.pop(0))
            queue.append(self.one())
        return jax.block_until_ready(queue[-1])


def _loops(k: int, width: int, depth: int, batch: int) -> tuple[_Loop, _Loop]:
    import jax

    tx = _adam()
    params, (x, y) = init_params(width, depth), data(batch)
    strategy = strategy_of(k)
    step = jm_step(strategy, tx, sharded=False)
    mirrored = list(strategy.mirror((params, tx.init(params))))
    (placed,) = strategy.distribute_dataset([(x, y)], remainder="error", prefetch=0)
    mesh = hand_mesh(k)
    assert mesh.devices.tolist() == strategy.mesh.devices.tolist()
    param_sh, state_sh, batch_sh, _ = hand_shardings(mesh, params, tx)
    hand = [jax.device_put(params, param_sh), jax.device_put(tx.init(params), state_sh)]
    hand_batch = jax.device_put((x, y), batch_sh)
    return (
        _Loop(f"jm.replicate, k={k}", step, mirrored, tuple(placed)),
        _Loop(f"hand jax.jit, k={k}", hand_step(mesh, params, tx), hand, hand_batch),
    )


def check_losses(loops: tuple[_Loop, _Loop], steps: int = 3, rtol: float = 1e-5) -> list:
    """The losses of `steps` steps of both loops from the same state: equal within `rtol`."""
    import numpy as np

    out = []
    for _ in range(steps):
        jm_loss, hand_loss = (float(np.asarray(loop.one())) for loop in loops)
        out.append((jm_loss, hand_loss))
        if not np.isclose(jm_loss, hand_loss, rtol=rtol, atol=0):
            raise AssertionError(
                f"{loops[0].name} and {loops[1].name} differ: losses {out} (rtol {rtol}); "
                "the step-time comparison would not be of the same computation"
            )
    return out


def time_loops(loops: list[_Loop], rounds: int, steps: int) -> dict[str, float]:
    """Median seconds per step of each loop over `rounds` interleaved rounds (each loop
    leads a round in turn)."""
    times: dict[str, list[float]] = {loop.name: [] for loop in loops}
    for loop in loops:  # warm up
        loop.run(3)
    for r in range(rounds):
        for loop in loops[r % len(loops) :] + loops[: r % len(loops)]:
            start = time.perf_counter()
            loop.run(steps)
            times[loop.name].append((time.perf_counter() - start) / steps)
    return {name: statistics.median(t) for name, t in times.items()}


def step_times(width: int, depth: int, batch: int, rounds: int, steps: int) -> dict[str, Any]:
    loops, losses = [], {}
    for k in SPANS:
        pair = _loops(k, width, depth, batch)
        losses[k] = check_losses(pair)
        loops.extend(pair)
    times = time_loops(loops, rounds, steps)
    out: dict[str, Any] = {"losses": losses, "times": times, "ratio": {}}
    for k in SPANS:
        out["ratio"][k] = times[f"jm.replicate, k={k}"] / times[f"hand jax.jit, k={k}"]
    return out


# --- 2. the largest model in a budget -------------------------------------------------------


def peak_bytes(compiled: Any) -> int:
    """Per-device bytes a compiled step needs (`benchmarks.shard_bench.peak_bytes`)."""
    from benchmarks import shard_bench

    return shard_bench.peak_bytes(compiled)


def _abstract(tree: Any, sharding_of) -> Any:
    import jax

    return jax.tree_util.tree_map_with_path(
        lambda path, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_of(path, x)),
        tree,
    )


def _placed_state_node(node: Any, topology: Any) -> Any:
    """An abstract `jm.shard_update` state node laid out as its `init` places it: a
    `Sharded` leaf's `[N, piece]` stack by `pieces_sharding`, anything else mirrored."""
    import jax

    import jmirror as jm

    if isinstance(node, jm.Sharded):
        shards = node.shards
        sharding = topology.pieces_sharding(shards.shape[1])
        return jm.Sharded(
            jax.ShapeDtypeStruct(shards.shape, shards.dtype, sharding=sharding), node.shape
        )
    return jax.ShapeDtypeStruct(node.shape, node.dtype, sharding=topology.mirrored)


def check_abstract_layouts(k: int, width: int = 64, depth: int = 2) -> None:
    """The abstract arguments `compiled_need` lowers on are laid out as `strategy.mirror` and
    `jm.shard_update(...).init` place real ones (checked on a small model)."""
    import jax

    import jmirror as jm

    strategy = strategy_of(k, donation="always")
    topology = strategy.topology
    params = strategy.mirror(init_params(width, depth))
    sharded_tx = jm.shard_update(_adam(), strategy=strategy)
    real = (params, strategy.mirror(_adam().init(params)), sharded_tx.init(params))
    placed = _abstract(abstract_params(width, depth), topology.leaf_sharding)
    abstract = (
        placed,
        _abstract(jax.eval_shape(_adam().init, placed), topology.leaf_sharding),
        jax.tree.map(
            lambda node: _placed_state_node(node, topology),
            jax.eval_shape(sharded_tx.init, placed),
            is_leaf=lambda node: isinstance(node, jm.Sharded),
        ),
    )
    for a, b in zip(jax.tree.leaves(real), jax.tree.leaves(abstract), strict=True):
        if a.shape != b.shape or not a.sharding.is_equivalent_to(b.sharding, a.ndim):
            raise AssertionError(f"k={k}: placed {a.shape} {a.sharding}, abstract {b}")


def compiled_need(variant: str, k: int, width: int, depth: int, batch: int) -> int:
    """Per-device bytes of `variant`'s compiled step ("mirrored", "sharded", "hand") at k,
    lowered on abstract arguments laid out as the strategy (or the hand step) places them."""
    import jax
    from jax.sharding import NamedSharding

    import jmirror as jm

    params = abstract_params(width, depth)
    x = jax.ShapeDtypeStruct((batch, FEATURES), jax.numpy.float32)
    y = jax.ShapeDtypeStruct((batch,), jax.numpy.int32)
    if variant == "hand":
        mesh = hand_mesh(k)
        tx = _adam()
        param_sh, state_sh, batch_sh, _ = hand_shardings(mesh, params, tx)
        args = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            (params, jax.eval_shape(tx.init, params), x, y),
            (param_sh, state_sh, batch_sh, batch_sh),
        )
        return peak_bytes(hand_step(mesh, params, tx).lower(*args).compile())
    # donation="always": the budget counts the donated state once at every width (the
    # "auto" policy stops donating 8 MiB leaves on host devices).
    strategy = strategy_of(k, donation="always")
    topology = strategy.topology
    placed = _abstract(params, topology.leaf_sharding)
    if variant == "sharded":
        tx = jm.shard_update(_adam(), strategy=strategy)
        state = jax.tree.map(
            lambda node: _placed_state_node(node, topology),
            jax.eval_shape(tx.init, placed),  # the shapes only: eval_shape drops layouts
            is_leaf=lambda node: isinstance(node, jm.Sharded),
        )
    else:
        tx = _adam()
        state = _abstract(jax.eval_shape(tx.init, params), topology.leaf_sharding)
    n = strategy.num_replicas
    stacked = NamedSharding(strategy.mesh, topology.spec(True))
    bx = jm.PerReplica(jax.ShapeDtypeStruct((n, batch // n, FEATURES), x.dtype, sharding=stacked))
    by = jm.PerReplica(jax.ShapeDtypeStruct((n, batch // n), y.dtype, sharding=stacked))
    step = jm_step(strategy, tx, sharded=variant == "sharded")
    return peak_bytes(step.lower(placed, state, bx, by).compile())


def param_count(width: int, depth: int) -> int:
    dims = _dims(width, depth)
    return sum(a * b + b for a, b in zip(dims[:-1], dims[1:]))


def largest(variant: str, k: int, budget: int, depth: int, batch: int, guess: float):
    """The widest multiple of WIDTH_STEP whose step needs <= `budget` bytes (the need grows
    with the width): an exponential search from `guess` (steps of WIDTH_STEP, doubling) then
    a bisection; and the needs measured on the way."""
    needs: dict[int, int] = {}

    def fits(width: int) -> bool:
        needs[width] = compiled_need(variant, k, width, depth, batch)
        return needs[width] <= budget

    start = max(WIDTH_STEP, int(guess) // WIDTH_STEP * WIDTH_STEP)
    step = WIDTH_STEP
    if fits(start):
        lo = start
        while fits(hi := lo + step):
            lo, step = hi, step * 2
    else:
        hi = start
        while not fits(lo := max(WIDTH_STEP, hi - step)):
            if lo == WIDTH_STEP:
                raise RuntimeError(f"{variant} at k={k}: no width fits {budget} bytes")
            hi, step = lo, step * 2
    while hi - lo > WIDTH_STEP:
        mid = (lo + hi) // 2 // WIDTH_STEP * WIDTH_STEP
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, needs


def memory_search(reference: int, depth: int, batch: int) -> dict[str, Any]:
    """The largest width of each variant and k within the k = 1 mirrored step's need at
    `reference` (per device)."""
    for k in MEMORY_SPANS:
        check_abstract_layouts(k)
    budget = compiled_need("mirrored", 1, reference, depth, batch)
    out: dict[str, Any] = {"budget_bytes": budget, "reference_width": reference, "rows": {}}
    found: dict[tuple[str, int], int] = {}
    for variant in ("mirrored", "sharded", "hand"):
        for k in MEMORY_SPANS:
            # Where to start looking (only the number of compiles depends on it): the hand
            # step where jmirror's mirrored one was, else k = 1's width grown by sqrt(k).
            if variant == "hand":
                guess = found[("mirrored", k)]
            elif k == 1:
                guess = reference * (2.0 if variant == "sharded" else 1.0) ** 0.5
            else:
                guess = found[(variant, 1)] * k**0.5
            width, needs = largest(variant, k, budget, depth, batch, guess)
            found[(variant, k)] = width
            out["rows"][(variant, k)] = {
                "width": width,
                "params": param_count(width, depth),
                "need": needs[width],
            }
            _log(
                f"  {variant:8s} k={k}: widest {width} ({param_count(width, depth):,} params, "
                f"{needs[width] / 2**20:.1f} MiB of {budget / 2**20:.1f})"
            )
    base = out["rows"][("mirrored", 1)]["params"]
    for row in out["rows"].values():
        row["x_k1_mirrored"] = row["params"] / base
    return out


# --- 3. jm.shard_update against the mirrored update, k = 1 ----------------------------------


def shard_update_step_time(width: int, depth: int, batch: int, rounds: int, steps: int):
    """`benchmarks.shard_bench`'s interleaved timing (mirrored, sharded with its default
    buckets, one buffer) on this benchmark's MLP at k = 1."""
    from benchmarks import shard_bench

    problem = (init_params(width, depth), loss_fn, *data(batch))
    return shard_bench._time_steps(strategy_of(1), problem, rounds, steps)


# --- the report -----------------------------------------------------------------------------


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _mark(ok: bool) -> str:
    return "met" if ok else "**not met**"


def report(
    rounds: int = 9,
    steps: int = 10,
    width: int = 512,
    depth: int = 4,
    batch: int = 256,
    reference: int = 1024,
    memory_depth: int = 4,
    memory_batch: int = 64,
    results: dict | None = None,
) -> str:
    """Runs the three measurements and returns their markdown tables."""
    from benchmarks._report import table

    results = {} if results is None else results
    results["load_average"] = [os.getloadavg()]
    results["seconds"] = {}
    _log(f"load average at the start: {os.getloadavg()}")
    clock = time.perf_counter()
    times = results["steps"] = step_times(width, depth, batch, rounds, steps)
    results["seconds"]["steps"] = time.perf_counter() - clock
    _log(f"1. step times: {times['ratio']} ({results['seconds']['steps']:.0f} s)")
    clock = time.perf_counter()
    memory = results["memory"] = memory_search(reference, memory_depth, memory_batch)
    results["seconds"]["memory"] = time.perf_counter() - clock
    _log(f"2. memory search ({results['seconds']['memory']:.0f} s)")
    clock = time.perf_counter()
    shard = results["shard_update_k1"] = shard_update_step_time(width, depth, batch, rounds, steps)
    results["seconds"]["shard_update"] = time.perf_counter() - clock
    _log(f"3. shard_update at k = 1: {shard} ({results['seconds']['shard_update']:.0f} s)")
    results["load_average"].append(os.getloadavg())
    _log(f"load average at the end: {os.getloadavg()}")

    rows = []
    for k in SPANS:
        jm_t, hand_t = (
            times["times"][f"jm.replicate, k={k}"],
            times["times"][f"hand jax.jit, k={k}"],
        )
        ratio = times["ratio"][k]
        losses = times["losses"][k]
        rel = max(abs(a - b) / abs(b) for a, b in losses)
        rows.append(
            [
                f"{NUM_DEVICES // k} x {k}",
                f"{jm_t * 1e3:.2f}",
                f"{hand_t * 1e3:.2f}",
                f"{ratio:.3f}",
                f"{losses[-1][0]:.6f} / {losses[-1][1]:.6f} ({rel:.1e})",
                f"<= 1.05: {_mark(ratio <= 1.05)}",
            ]
        )
    out = [
        table(
            f"1. Step time, Adam MLP {FEATURES}→{width}×{depth}→{CLASSES}, global batch {batch} "
            f"(median of {rounds} interleaved rounds × {steps} steps)",
            rows,
            [
                "N x k",
                "jm.replicate ms",
                "hand jit ms",
                "jm / hand",
                "loss of step 3, jm / hand (max rel. diff. of steps 1-3)",
                "target",
            ],
        )
    ]
    rows = []
    rowsd = memory["rows"]
    for variant, label in (
        ("mirrored", "mirrored Adam"),
        ("sharded", "jm.shard_update(adam)"),
        ("hand", "hand jax.jit (reference)"),
    ):
        for k in MEMORY_SPANS:
            row = rowsd[(variant, k)]
            same_k1 = row["params"] / rowsd[(variant, 1)]["params"]
            if variant == "mirrored" and k > 1:
                target = f">= {0.9 * k:.1f}: {_mark(row['x_k1_mirrored'] >= 0.9 * k)}"
            elif variant == "sharded":
                goal = 1.6 * 0.9 * k if k > 1 else 1.6
                target = f">= {goal:.2f}: {_mark(row['x_k1_mirrored'] >= goal)}"
            else:
                target = ""
            rows.append(
                [
                    label,
                    str(k),
                    str(row["width"]),
                    f"{row['params']:,}",
                    f"{row['need'] / 2**20:.1f}",
                    f"{row['x_k1_mirrored']:.2f}",
                    f"{same_k1:.2f}",
                    target,
                ]
            )
    out.append(
        table(
            f"2. Largest {memory_depth}-layer Adam MLP in {memory['budget_bytes'] / 2**20:.1f} "
            f"MiB per device (the k = 1 mirrored step's need at width {reference}; global batch "
            f"{memory_batch}; compiled memory, bisection to {WIDTH_STEP})",
            rows,
            [
                "variant",
                "k",
                "widest",
                "parameters",
                "need MiB",
                "× k=1 mirrored",
                "× same variant k=1",
                "target (× k=1 mirrored)",
            ],
        )
    )
    sharded, mirrored = shard["sharded"], shard["mirrored"]
    big = rowsd[("sharded", 1)]["x_k1_mirrored"]
    out.append(
        table(
            "3. jm.shard_update(adam) against the mirrored update, k = 1 (step time: "
            f"shard_bench's interleaved timing on the MLP of 1, median of {rounds} × {steps})",
            [
                [
                    "step time × mirrored",
                    f"{sharded / mirrored:.3f} ({sharded * 1e3:.2f} / {mirrored * 1e3:.2f} ms; "
                    f"bucket_bytes=None {shard['one_buffer'] / mirrored:.3f})",
                    f"<= 1.05: {_mark(sharded / mirrored <= 1.05)}",
                ],
                [
                    "largest model × mirrored",
                    f"{big:.2f} (table 2, k = 1)",
                    f">= 1.6: {_mark(big >= 1.6)}",
                ],
            ],
            ["measure", "value", "target"],
        )
    )
    load = [", ".join(f"{x:.1f}" for x in avg) for avg in results["load_average"]]
    seconds = ", ".join(f"{name} {s:.0f} s" for name, s in results["seconds"].items())
    out.append(
        f"\nLoad average (1, 5, 15 min) at the start {load[0]}, at the end {load[1]}; "
        f"time: {seconds}."
    )
    return "\n".join(out)


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {(k if isinstance(k, str) else repr(k)): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=10, help="steps per timed round")
    parser.add_argument("--width", type=int, default=512, help="the timed MLP's width")
    parser.add_argument("--depth", type=int, default=4, help="the timed MLP's hidden layers")
    parser.add_argument("--batch", type=int, default=256, help="the timed global batch")
    parser.add_argument("--reference-width", type=int, default=1024)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    jmt.set_host_device_count(NUM_DEVICES)
    results: dict[str, Any] = {}
    start = time.perf_counter()
    text = report(
        args.rounds,
        args.steps,
        args.width,
        args.depth,
        args.batch,
        args.reference_width,
        results=results,
    )
    print(text)
    print(f"\n({time.perf_counter() - start:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_jsonable(results), f, indent=1)
    return results


if __name__ == "__main__":
    main()
