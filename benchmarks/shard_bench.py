"""`jm.shard_update` against the mirrored update, in one run: `python -m benchmarks.shard_bench`.

For Adam on 8 host devices, every figure a ratio to the mirrored update (`jm.all_reduce`
MEAN of the gradients, then `optax.adam` on mirrored state) measured in the same process:

- step time: the small and large benchmark MLPs (`benchmarks/models.py`) and a small flax
  transformer; interleaved rounds, median (target <= 1.05x);
- optimizer memory per device: the bytes of the state on device 0 (target <= 1/N + 1%);
- peak device memory of a step (the compiled step's `memory_analysis()`), and from it the
  largest model that trains in a fixed per-device budget (target >= 1.6x the mirrored one's);
- bytes moved by the step's collectives, from its compiled HLO (target: one all-reduce's).

Two sharded variants: `jm.shard_update(optax.adam(1e-3))` with no argument ("sharded": since
round 4 the gradients go in buckets of about 4 MiB, each reduced as soon as it is complete,
so XLA does not hold a packed copy of all the gradients beside them) and `bucket_bytes=None`
("one_buffer": round 3's default, one buffer per dtype: one reduce-scatter, one all-gather).

    python -m benchmarks.shard_bench [--rounds 5] [--steps 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import jmirror.testing as jmt

NUM_DEVICES = 8
SHARDED = ("sharded", "one_buffer")  # the two sharded variants, as in the module docstring


def _problem(kind: str, hidden: int = 512, depth: int = 2, batch: int = 256):
    """(params, loss_fn, x, y) of a benchmark model."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from benchmarks.models import FEATURES, make_problem

    rng = np.random.default_rng(0)
    if kind == "mlp":
        params, _, loss_fn, x, y = make_problem(hidden)
        return params, loss_fn, x, y
    if kind == "deep_mlp":  # for the memory search: width and depth free, small batch
        import flax.linen as nn

        class Deep(nn.Module):
            @nn.compact
            def __call__(self, x):
                for _ in range(depth):
                    x = nn.relu(nn.Dense(hidden)(x))
                return nn.Dense(10)(x)

        model = Deep()
        params = model.init(jax.random.key(0), jnp.zeros((1, FEATURES)))
        x = rng.normal(size=(batch, FEATURES)).astype(np.float32)
        y = rng.integers(0, 10, size=(batch,)).astype(np.int32)

        def deep_loss(params, x, y):
            logits = model.apply(params, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        return params, deep_loss, x, y
    model = transformer()
    tokens = rng.integers(0, 256, size=(64, 32)).astype(np.int32)
    params = model.init(jax.random.key(0), tokens[:1])

    def lm_loss(params, x, y):
        logits = model.apply(params, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return params, lm_loss, tokens, np.roll(tokens, -1, axis=1)


def transformer():
    """A small decoder: 256-token vocabulary, width 128, 2 blocks of 4 heads."""
    import flax.linen as nn
    import jax.numpy as jnp

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
            h = nn.SelfAttention(num_heads=4)(nn.LayerNorm()(x), mask=mask)
            x = x + h
            h = nn.Dense(512)(nn.LayerNorm()(x))
            return x + nn.Dense(x.shape[-1])(nn.gelu(h))

    class Decoder(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(256, 128)(tokens)
            x = x + self.param("pos", nn.initializers.normal(0.02), (32, 128))
            for _ in range(2):
                x = Block()(x)
            return nn.Dense(256)(nn.LayerNorm()(x))

    return Decoder()


def _steps(strategy, params, loss_fn, x, y):
    """The mirrored and the sharded Adam step on `strategy`, with their initial states."""
    import jax
    import optax

    import jmirror as jm

    inner = optax.adam(1e-3)
    sharded_tx = jm.shard_update(optax.adam(1e-3), strategy=strategy)  # the default buckets
    one_buffer_tx = jm.shard_update(optax.adam(1e-3), strategy=strategy, bucket_bytes=None)

    @jm.replicate(strategy=strategy, donate_argnums=(0, 1))
    def mirrored(params, state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, state = inner.update(jm.all_reduce("mean", grads), state, params)
        return optax.apply_updates(params, updates), state, jm.all_reduce("mean", loss)

    def sharded_step(tx):
        @jm.replicate(strategy=strategy, donate_argnums=(0, 1))
        def sharded(params, state, x, y):
            loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state, jm.all_reduce("mean", loss)

        return sharded

    n = strategy.num_replicas
    batch = (
        jm.PerReplica(x.reshape((n, -1) + x.shape[1:])),
        jm.PerReplica(y.reshape((n, -1) + y.shape[1:])),
    )
    # Each variant gets its own mirrored copy of the parameters (the steps donate them).
    states = {"mirrored": [strategy.mirror(params), strategy.mirror(inner.init(params))]}
    fns = {"mirrored": mirrored}
    for name, tx in (("sharded", sharded_tx), ("one_buffer", one_buffer_tx)):
        mine = strategy.mirror(params)
        states[name] = [mine, tx.init(mine)]
        fns[name] = sharded_step(tx)
    return fns, states, batch


def _time_steps(strategy, problem, rounds: int, steps: int) -> dict[str, float]:
    """Median seconds per step of each variant, interleaved."""
    import jax

    fns, states, batch = _steps(strategy, *problem)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for name, fn in fns.items():  # compile and warm up
        for _ in range(3):
            states[name][0], states[name][1], loss = fn(*states[name], *batch)
        jax.block_until_ready(loss)
    order = list(fns)
    for r in range(rounds):
        for name in order[r % len(order) :] + order[: r % len(order)]:
            fn, state = fns[name], states[name]
            start = time.perf_counter()
            for _ in range(steps):
                state[0], state[1], loss = fn(state[0], state[1], *batch)
            jax.block_until_ready(loss)
            times[name].append((time.perf_counter() - start) / steps)
    return {name: statistics.median(t) for name, t in times.items()}


def _bytes_on_first_device(strategy, tree) -> int:
    import jax

    first = strategy.devices[0]
    return sum(
        s.data.nbytes
        for leaf in jax.tree.leaves(tree)
        for s in leaf.addressable_shards
        if s.device == first
    )


def _memory(strategy, problem) -> dict[str, Any]:
    """Optimizer bytes on device 0, and each step's compiled per-device memory."""
    import jax

    import jmirror as jm

    fns, states, batch = _steps(strategy, *problem)
    out: dict[str, Any] = {}
    for name, fn in fns.items():
        compiled = fn.lower(*states[name], *batch).compile()
        out[name] = {
            "state_bytes": _bytes_on_first_device(strategy, states[name][1]),
            "peak_bytes": peak_bytes(compiled),
            "collectives": [(c.op, c.bytes) for c in jmt.collectives(compiled)],
        }
    sharded = jax.tree.leaves(states["sharded"][1], is_leaf=lambda x: isinstance(x, jm.Sharded))
    out["padding_bytes"] = sum(
        (x.shards.size - x.size) * x.dtype.itemsize for x in sharded if isinstance(x, jm.Sharded)
    )
    out["param_bytes"] = sum(a.nbytes for a in jax.tree.leaves(problem[0]))
    return out


def peak_bytes(compiled) -> int:
    """Per-device bytes a compiled step needs: arguments + outputs + temporaries - aliased."""
    m = compiled.memory_analysis()
    return int(
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )


def _largest_in_budget(strategy, depth: int, reference: int) -> dict[str, Any]:
    """The widest model of `depth` layers whose step fits in the mirrored step's memory at
    width `reference`, for each variant (bisection on the width, compiled memory only)."""

    def peak(name: str, hidden: int) -> tuple[int, int]:
        problem = _problem("deep_mlp", hidden=hidden, depth=depth, batch=64)
        fns, states, batch = _steps(strategy, *problem)
        compiled = fns[name].lower(*states[name], *batch).compile()
        import jax

        params = sum(a.size for a in jax.tree.leaves(problem[0]))
        return peak_bytes(compiled), params

    budget, ref_params = peak("mirrored", reference)
    out: dict[str, Any] = {"budget_bytes": budget, "reference_width": reference}
    for name in ("mirrored", *SHARDED):
        lo, hi = reference // 2, reference * 3
        best = (reference if name == "mirrored" else lo, ref_params)
        while hi - lo > 8:
            mid = (lo + hi) // 2 // 8 * 8
            need, params = peak(name, mid)
            if need <= budget:
                lo, best = mid, (mid, params)
            else:
                hi = mid
        out[name] = {"width": best[0], "params": best[1]}
    for name in SHARDED:
        out[name]["ratio"] = out[name]["params"] / out["mirrored"]["params"]
    return out


def _moved(collectives: list[tuple[str, int]], n: int) -> float:
    """Bytes each device sends in a ring: all-reduce 2(N-1)/N of its bytes, reduce-scatter
    (N-1) x its output, all-gather (N-1)/N of its output."""
    total = 0.0
    for op, size in collectives:
        if op == "all-reduce":
            total += 2 * (n - 1) / n * size
        elif op == "reduce-scatter":
            total += (n - 1) * size
        elif op == "all-gather":
            total += (n - 1) / n * size
    return total


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--reference-width", type=int, default=1024)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    jmt.set_host_device_count(NUM_DEVICES)
    import jmirror as jm

    strategy = jm.MirroredStrategy()
    n = strategy.num_replicas
    results: dict[str, Any] = {"num_replicas": n, "steps": {}, "memory": {}}
    results["load_average"] = [os.getloadavg()]  # step-time ratios are noisy under load
    print(f"load average at the start: {os.getloadavg()}", flush=True)
    models = {
        "small MLP (512)": ("mlp", 512),
        "large MLP (2048)": ("mlp", 2048),
        "flax transformer": ("transformer", 0),
    }
    for label, (kind, hidden) in models.items():
        problem = _problem(kind, hidden=hidden)
        times = _time_steps(strategy, problem, args.rounds, args.steps)
        memory = _memory(strategy, problem)
        results["steps"][label] = times
        results["memory"][label] = memory
        for name in SHARDED:
            ratio = times[name] / times["mirrored"]
            state_ratio = memory[name]["state_bytes"] / memory["mirrored"]["state_bytes"]
            peak_ratio = memory[name]["peak_bytes"] / memory["mirrored"]["peak_bytes"]
            moved = _moved(memory[name]["collectives"], n) / _moved(
                memory["mirrored"]["collectives"], n
            )
            kinds = [op for op, _ in memory[name]["collectives"]]
            reduced = [b for op, b in memory[name]["collectives"] if op == "all-reduce"]
            print(
                f"{label} [{name}]: step {ratio:.3f}x ({times[name] * 1e3:.2f} / "
                f"{times['mirrored'] * 1e3:.2f} ms), optimizer bytes/device {state_ratio:.4f} "
                f"(1/N = {1 / n:.4f}), step peak {peak_ratio:.3f}x, bytes moved {moved:.4f}x; "
                f"{kinds.count('reduce-scatter')} reduce-scatter, {kinds.count('all-gather')} "
                f"all-gather, all-reduces of {reduced} bytes"
                f" (mirrored: {memory['mirrored']['collectives']})",
                flush=True,
            )
    search = _largest_in_budget(strategy, args.depth, args.reference_width)
    results["budget"] = search
    for name in SHARDED:
        print(
            f"largest {args.depth}-layer MLP in {search['budget_bytes'] / 2**20:.1f} MiB per "
            f"device (the mirrored step's need at width {args.reference_width}): mirrored width "
            f"{search['mirrored']['width']} ({search['mirrored']['params']:,} params), {name} "
            f"width {search[name]['width']} ({search[name]['params']:,} params): "
            f"{search[name]['ratio']:.2f}x the parameters",
            flush=True,
        )
    results["load_average"].append(os.getloadavg())
    print(f"load average at the end: {os.getloadavg()}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
