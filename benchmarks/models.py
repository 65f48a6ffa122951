"""The model and the training-step variants the benchmarks compare."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.jax_utils
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jmirror as jm

FEATURES = 64
CLASSES = 10
GLOBAL_BATCH = 256
IN_FLIGHT = 2  # every loop, jmirror's or not, keeps at most this many steps queued


class MLP(nn.Module):
    hidden: int

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(self.hidden)(x))
        x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(CLASSES)(x)


def make_problem(hidden: int, seed: int = 0):
    model = MLP(hidden)
    params = model.init(jax.random.key(seed), jnp.zeros((1, FEATURES)))
    tx = optax.sgd(1e-3)
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(GLOBAL_BATCH, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=(GLOBAL_BATCH,)).astype(np.int32)

    def loss_fn(params, x, y):
        logits = model.apply(params, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return params, tx, loss_fn, x, y


@dataclasses.dataclass
class Variant:
    """A ready-to-run training loop: `step()` runs one step on prepared state."""

    name: str
    step: Callable[[], Any]
    block: Callable[[Any], None] = jax.block_until_ready


def _bounded(run_step: Callable[[], Any]) -> Callable[[], Any]:
    """Keeps at most IN_FLIGHT steps queued, like jmirror does (XLA:CPU deadlocks otherwise)."""
    queue: list[Any] = []

    def step():
        while len(queue) >= IN_FLIGHT:
            jax.block_until_ready(queue.pop(0))
        out = run_step()
        queue.append(out)
        return out

    return step


def _pmap_train_step(tx, loss_fn):
    """The hand-written pmap step of raw `jax.pmap` and the flax idiom."""

    def train_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        grads = jax.lax.pmean(grads, "batch")
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "batch")

    return train_step


def jmirror_variant(hidden: int, backend: str) -> Variant:
    params, tx, loss_fn, x, y = make_problem(hidden)
    strategy = jm.MirroredStrategy(backend=backend, max_in_flight=IN_FLIGHT)
    n = strategy.num_replicas

    @jm.replicate(strategy=strategy, donate_argnums=(0, 1))
    def train_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        grads = jm.all_reduce("mean", grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jm.all_reduce("mean", loss)

    state = list(strategy.mirror((params, tx.init(params))))
    batch = jax.device_put(
        (x.reshape(n, -1, FEATURES), y.reshape(n, -1)), strategy.topology.stacked
    )
    bx, by = jm.PerReplica(batch[0]), jm.PerReplica(batch[1])

    def step():
        state[0], state[1], loss = train_step(state[0], state[1], bx, by)
        return loss

    return Variant(f"jm.replicate[{backend}]", step)


def raw_pmap_variant(hidden: int) -> Variant:
    params, tx, loss_fn, x, y = make_problem(hidden)
    devices = jax.local_devices()
    n = len(devices)

    train_step = _pmap_train_step(tx, loss_fn)

    pstep = jax.pmap(
        train_step,
        axis_name="batch",
        in_axes=(None, None, 0, 0),
        out_axes=(None, None, None),
        devices=devices,
        donate_argnums=(0, 1),
    )
    mesh = jax.sharding.Mesh(np.array(devices), ("batch",))
    state = list(jax.device_put((params, tx.init(params)), NamedSharding(mesh, P())))
    batch = jax.device_put(
        (x.reshape(n, -1, FEATURES), y.reshape(n, -1)), NamedSharding(mesh, P("batch"))
    )

    def run():
        state[0], state[1], loss = pstep(state[0], state[1], *batch)
        return loss

    return Variant("raw jax.pmap", _bounded(run))


def jit_sharding_variant(hidden: int) -> Variant:
    params, tx, loss_fn, x, y = make_problem(hidden)
    devices = jax.local_devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("batch",))
    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("batch"))

    def train_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    train_step = jax.jit(
        train_step, donate_argnums=(0, 1), out_shardings=(replicated, replicated, replicated)
    )
    state = list(jax.device_put((params, tx.init(params)), replicated))
    batch = jax.device_put((x, y), sharded)

    def run():
        state[0], state[1], loss = train_step(state[0], state[1], *batch)
        return loss

    return Variant("jax.jit + NamedSharding", _bounded(run))


def flax_variant(hidden: int) -> Variant:
    params, tx, loss_fn, x, y = make_problem(hidden)

    train_step = _pmap_train_step(tx, loss_fn)

    pstep = jax.pmap(train_step, axis_name="batch", donate_argnums=(0, 1))
    state = list(flax.jax_utils.replicate((params, tx.init(params))))
    n = jax.local_device_count()
    batch = jax.tree.map(lambda a: a.reshape(n, -1, *a.shape[1:]), (x, y))
    batch = jax.device_put(
        batch,
        jax.sharding.NamedSharding(
            jax.sharding.Mesh(np.array(jax.local_devices()), ("b",)), P("b")
        ),
    )

    def run():
        state[0], state[1], loss = pstep(state[0], state[1], *batch)
        return loss

    return Variant("flax replicate/shard/pmap", _bounded(run))


def single_device_variant(hidden: int) -> Variant:
    params, tx, loss_fn, x, y = make_problem(hidden)

    def train_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    train_step = jax.jit(train_step, donate_argnums=(0, 1))
    device = jax.local_devices()[0]
    state = list(jax.device_put((params, tx.init(params)), device))
    batch = jax.device_put((x, y), device)

    def run():
        state[0], state[1], loss = train_step(state[0], state[1], *batch)
        return loss

    return Variant("one device jax.jit", _bounded(run))


VARIANTS: dict[str, Callable[[int], Variant]] = {
    "jm.replicate[pmap]": lambda h: jmirror_variant(h, "pmap"),
    "jm.replicate[shard_map]": lambda h: jmirror_variant(h, "shard_map"),
    "raw jax.pmap": raw_pmap_variant,
    "jax.jit + NamedSharding": jit_sharding_variant,
    "flax replicate/shard/pmap": flax_variant,
    "one device jax.jit": single_device_variant,
}
