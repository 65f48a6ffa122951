"""Structural checks read from the compiled training step's HLO."""

from __future__ import annotations

import jax
import numpy as np
import optax

import jmirror as jm
import jmirror.testing as jmt
from benchmarks.models import FEATURES, make_problem


def report(hidden: int = 512) -> str:
    params, tx, loss_fn, x, y = make_problem(hidden)
    strategy = jm.MirroredStrategy()
    n = strategy.num_replicas
    param_bytes = sum(p.size * p.dtype.itemsize for p in jax.tree.leaves(params))

    def train_step(params, opt_state, x, y, *metrics):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        grads = jm.all_reduce("mean", grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        out = (optax.apply_updates(params, updates), opt_state, loss)
        if metrics:
            total, count = metrics
            out += (total.replace(total.value + loss), count.replace(count.value + 1))
        return out

    state = strategy.mirror((params, tx.init(params)))
    bx = jm.PerReplica(x.reshape(n, -1, FEATURES))
    by = jm.PerReplica(y.reshape(n, -1))
    metrics = (
        strategy.sync_on_read(np.float32(0), "sum"),
        strategy.sync_on_read(np.int32(0), "sum"),
    )
    step = jm.replicate(train_step, strategy=strategy)
    plain = jmt.collectives(step.lower(*state, bx, by))
    with_metrics = jmt.collectives(step.lower(*state, bx, by, *metrics))
    synced = jmt.collectives(
        jm.replicate(lambda p: jm.sync(p, "mean"), strategy=strategy).lower(state[0])
    )
    rows = [
        f"- training step: {len(plain)} collective(s): "
        + ", ".join(f"{c.op} of {c.bytes} bytes" for c in plain)
        + f"; parameter bytes {param_bytes}",
        f"- with two SyncOnRead metrics: {len(with_metrics)} collective(s) "
        f"({'no collective added' if with_metrics == plain else 'CHANGED'})",
        f"- jm.sync(mirrored params, MEAN): {len(synced)} collective(s)",
    ]
    title = f"\n### Compiled step structure (MLP hidden {hidden}, {n} devices)\n\n"
    return title + "\n".join(rows)
