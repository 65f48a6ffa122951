"""The set-up the several-process benchmarks share (`timeout_bench`, `processes_bench`).

Both run alone (8 XLA:CPU host devices) or under `python -m jmirror.launch`, and train the
benchmark MLP of `benchmarks/models.py` with `jm.MultiWorkerMirroredStrategy`: `start` comes
first (before JAX starts its backends), then `options` parses the options they share and
`train_mlp` builds the training on a strategy.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import jax
import optax

import jmirror as jm
from benchmarks.models import make_problem


def start() -> None:
    """Joins the launcher's other processes (nothing alone), else makes 8 host devices."""
    jm.distributed.initialize()
    if not jax.distributed.is_initialized():
        jax.config.update("jax_num_cpu_devices", 8)


def options(doc: str, rounds: int) -> argparse.ArgumentParser:
    """The parser of the shared options: `--hidden`, `--steps` (per timed round), `--rounds`."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--steps", type=int, default=40, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=rounds, help="timed rounds per loop")
    return parser


@dataclasses.dataclass
class Training:
    """The MLP trained on `strategy`: its mirrored state, the global batch on the host
    (`batch`) and placed once (`placed`)."""

    strategy: jm.MultiWorkerMirroredStrategy
    step: Any  # the replicated step: (params, opt_state, batch) -> (params, opt_state, loss)
    params: Any
    opt_state: Any
    batch: tuple[Any, Any]
    placed: Any

    def train(self, batch: Any) -> Any:
        """Runs one step on `batch` (a placed batch), keeps its state, returns its loss."""
        self.params, self.opt_state, loss = self.step(self.params, self.opt_state, batch)
        return loss

    @property
    def layout(self) -> str:
        """`"<processes> x <replicas per process>"`, as the reports print it."""
        return f"{self.strategy.num_processes} x {self.strategy.num_local_replicas}"


def train_mlp(strategy: jm.MultiWorkerMirroredStrategy, hidden: int, mean_loss: bool) -> Training:
    """The MLP's SGD step on `strategy` (params and optimizer state donated, gradients
    all-reduced MEAN); its loss all-reduced MEAN when `mean_loss`, else per replica."""
    params, tx, loss_fn, x, y = make_problem(hidden)

    @jm.replicate(strategy=strategy, donate_argnums=(0, 1))
    def train_step(params, opt_state, batch):
        bx, by = batch
        loss, grads = jax.value_and_grad(loss_fn)(params, bx, by)
        grads = jm.all_reduce("mean", grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        if mean_loss:
            loss = jm.all_reduce("mean", loss)
        return optax.apply_updates(params, updates), opt_state, loss

    params, opt_state = strategy.mirror((params, tx.init(params)))
    (placed,) = strategy.distribute_dataset([(x, y)], remainder="error", prefetch=0)
    return Training(strategy, train_step, params, opt_state, (x, y), placed)
