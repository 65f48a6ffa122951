"""Data-parallel training of a small MLP on scikit-learn's 8x8 digits: `python -m jmirror.demo`.

Runs on `--devices` simulated XLA:CPU host devices (default 8), trains with a replicated
step (gradients all-reduced `MEAN`, metrics kept per replica as `SyncOnRead` and read once
per epoch) on batches placed by `strategy.distribute_dataset`, evaluates on padded test
batches with masks, then trains the same model on one device with `jax.jit` on the same
global batches and checks that both agree. The last line reads
`test accuracy 0.9667 (one device 0.9667)`.

Several processes: `python -m jmirror.launch --processes 2 --devices-per-process 4 -m
jmirror.demo` runs it as 2 processes of 4 host devices each, with
`jm.MultiWorkerMirroredStrategy` over all 8; the launcher sets the device count (`--devices`
is refused there). Every process trains (and saves and resumes with `--checkpoint-dir`);
only process 0 prints, and only process 0 trains the one-device model, on its first device,
to check against.

`main` first calls `jm.distributed.initialize()` (nothing alone), then sets the host device
count, before anything asks JAX for devices: nothing in this module (or in `jmirror`)
touches the backends at import time.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import jmirror as jm
from jmirror import metrics, testing
from jmirror._values import PyTree

if TYPE_CHECKING:
    from jmirror._devices import Device

_BAR_WIDTH = 24
_DEFAULT_DEVICES = 8
# Largest parameter difference accepted between the N-device and the one-device run.
_PARAMS_ATOL = 1e-4


class MLP(nn.Module):
    """A two-layer perceptron for 8x8 digit images (64 features, 10 classes).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jmirror import demo
        >>> model = demo.MLP(hidden=8)
        >>> model.apply(model.init(jax.random.key(0), jnp.zeros((1, 64))), jnp.zeros((3, 64))).shape
        (3, 10)
    """

    hidden: int = 256

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(10)(x)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parses the demo's command line.

    Example:
        >>> from jmirror import demo
        >>> args = demo.parse_args(["--devices", "2", "--epochs", "1"])
        >>> args.devices, args.epochs, args.backend, args.batch_size
        (2, 1, 'pmap', 128)
    """
    parser = argparse.ArgumentParser(
        prog="python -m jmirror.demo",
        description="Data-parallel MLP training on scikit-learn's 8x8 digits.",
    )
    parser.add_argument(
        "--devices",
        type=int,
        default=None,
        help=f"simulated host devices (default {_DEFAULT_DEVICES}); not under jmirror.launch, "
        "which sets them with --devices-per-process",
    )
    parser.add_argument("--epochs", type=int, default=15, help="passes over the training set")
    parser.add_argument("--backend", choices=("pmap", "shard_map"), default="pmap")
    parser.add_argument("--batch-size", type=int, default=128, help="global batch size")
    parser.add_argument(
        "--learning-rate", type=float, default=0.1, help="SGD step size (momentum 0.9)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--checkpoint-dir",
        default=None,
        help="save a checkpoint after every epoch here; resume from the newest one if any",
    )
    args = parser.parse_args(argv)
    if (args.devices is not None and args.devices < 1) or args.epochs < 1:
        parser.error("--devices and --epochs must be at least 1")
    devices = _DEFAULT_DEVICES if args.devices is None else args.devices
    if args.batch_size < 1 or args.batch_size % devices:
        parser.error(
            f"--batch-size {args.batch_size} must be a positive multiple of --devices "
            f"{devices}: every replica gets batch_size / devices examples."
        )
    return args


def set_host_device_count(n: int) -> None:
    """Asks XLA for `n` CPU host devices; must run before JAX initializes its backends.

    Raises:
      RuntimeError: when the backends already started with fewer than `n` CPU devices.

    Example:
        >>> import jax
        >>> from jmirror import demo
        >>> n = len(jax.devices("cpu"))  # JAX has started: asking for what exists is fine
        >>> demo.set_host_device_count(n)
    """
    try:
        testing.set_host_device_count(n)  # the one place jmirror sets the host device count
    except RuntimeError:
        if len(jax.devices("cpu")) < n:
            raise RuntimeError(
                f"jmirror.demo needs {n} CPU devices, but JAX already started with "
                f"{len(jax.devices('cpu'))}. Run it in a fresh process "
                "(python -m jmirror.demo) or call main() before any JAX operation."
            ) from None


def load_data(seed: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Returns the digits as `(train, test)`, dicts of `x` (float32 in [0, 1]) and `y` (int32).

    Example:
        >>> from jmirror import demo
        >>> train, test = demo.load_data(0)
        >>> train["x"].shape, test["x"].shape
        ((1437, 64), (360, 64))
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    images, targets = load_digits(return_X_y=True)
    x = (np.asarray(images) / 16.0).astype(np.float32)
    y = np.asarray(targets).astype(np.int32)
    parts = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    x_train, x_test, y_train, y_test = (np.asarray(p) for p in parts)
    return {"x": x_train, "y": y_train}, {"x": x_test, "y": y_test}


def train_batches(
    train: dict[str, np.ndarray], batch_size: int, epoch: int, seed: int
) -> list[dict[str, np.ndarray]]:
    """Returns one epoch of shuffled global batches; the incomplete last one is dropped.

    Example:
        >>> import numpy as np
        >>> from jmirror import demo
        >>> data = {"x": np.zeros((10, 2)), "y": np.zeros(10)}
        >>> [b["x"].shape for b in demo.train_batches(data, 4, epoch=0, seed=0)]
        [(4, 2), (4, 2)]
    """
    order = np.random.default_rng((seed, epoch)).permutation(len(train["y"]))
    steps = len(order) // batch_size
    return [
        {k: v[order[i * batch_size : (i + 1) * batch_size]] for k, v in train.items()}
        for i in range(steps)
    ]


def padded_batches(
    data: dict[str, np.ndarray], batch_size: int
) -> Iterator[tuple[dict[str, np.ndarray], np.ndarray]]:
    """Yields `(batch, mask)` covering `data` in order; the last batch is padded at its end.

    Example:
        >>> import numpy as np
        >>> from jmirror import demo
        >>> [m.sum() for _, m in demo.padded_batches({"y": np.arange(5)}, 4)]
        [np.int64(4), np.int64(1)]
    """
    size = len(next(iter(data.values())))
    for start in range(0, size, batch_size):
        real = min(batch_size, size - start)
        batch = {
            k: np.concatenate([v[start : start + real], np.zeros_like(v[: batch_size - real])])
            for k, v in data.items()
        }
        yield batch, np.arange(batch_size) < real


def _loss_and_logits(state: TrainState, params: PyTree, batch: dict[str, Any]):
    logits = state.apply_fn({"params": params}, batch["x"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return losses.mean(), (losses, logits)


def _train_step(state: TrainState, batch: dict[str, Any], loss: PyTree, accuracy: metrics.Accuracy):
    """Runs one replica's step: local gradients, all-reduced MEAN; metrics updated locally."""
    grad_fn = jax.value_and_grad(lambda p: _loss_and_logits(state, p, batch), has_aux=True)
    (_, (losses, logits)), grads = grad_fn(state.params)
    grads = jm.all_reduce("mean", grads)
    return (
        state.apply_gradients(grads=grads),
        loss.update(losses),
        accuracy.update(logits, batch["y"]),
    )


def _eval_step(
    params: PyTree,
    apply_fn: Callable[..., Any],
    batch: dict[str, Any],
    mask: jax.Array,
    accuracy: metrics.Accuracy,
):
    return accuracy.update(apply_fn({"params": params}, batch["x"]), batch["y"], mask=mask)


@contextlib.contextmanager
def _bar(description: str, total: int, live: bool) -> Iterator[Callable[[], None]]:
    """Yields `advance()`, called once per step.

    With `live` (stdout is a terminal) a rich progress bar shows the epoch's steps and is
    erased when the epoch ends; otherwise (a notebook, a pipe, a log file) nothing is drawn,
    so the output holds no carriage returns or escape sequences, only the epoch lines.
    """
    if not live:
        yield lambda: None
        return
    columns = (TextColumn("{task.description}"), BarColumn(bar_width=_BAR_WIDTH))
    with Progress(*columns, MofNCompleteColumn(), TimeElapsedColumn(), transient=True) as progress:
        task = progress.add_task(description, total=total)
        yield lambda: progress.advance(task)


def train_one_device(
    model: nn.Module,
    params: PyTree,
    tx: optax.GradientTransformation,
    args: argparse.Namespace,
    train: dict[str, np.ndarray],
    test: dict[str, np.ndarray],
    device: Device,
) -> tuple[Any, float]:
    """Trains with `jax.jit` on `device` on the same global batches; returns params, accuracy.

    `device` is the `jax.Device` to train on (the strategy's first device).

    Example:
        >>> import jax, optax
        >>> from jmirror import demo
        >>> args = demo.parse_args(["--devices", "1", "--epochs", "1"])
        >>> train, test = demo.load_data(0)
        >>> model = demo.MLP()
        >>> params = model.init(jax.random.key(0), train["x"][:1])["params"]
        >>> tx = optax.sgd(0.1, momentum=0.9)
        >>> _, accuracy = demo.train_one_device(model, params, tx, args, train, test,
        ...                                     jax.devices("cpu")[0])
        >>> 0.5 < accuracy <= 1.0
        True
    """

    @jax.jit
    def step(state: TrainState, batch: dict[str, Any]) -> TrainState:
        grads = jax.grad(lambda p: _loss_and_logits(state, p, batch)[0])(state.params)
        return state.apply_gradients(grads=grads)

    @jax.jit
    def correct(params: PyTree, batch: dict[str, Any], mask: jax.Array) -> jax.Array:
        logits = cast(jax.Array, model.apply({"params": params}, batch["x"]))
        hits = jnp.argmax(logits, -1) == batch["y"]
        return jnp.sum(hits & mask)

    with jax.default_device(device):
        state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)
        for epoch in range(args.epochs):
            for batch in train_batches(train, args.batch_size, epoch, args.seed):
                state = step(state, batch)
        batches = padded_batches(test, args.batch_size)
        hits = sum(int(correct(state.params, b, m)) for b, m in batches)
    return state.params, hits / len(test["y"])


def _strategy(args: argparse.Namespace) -> jm.MirroredStrategy:
    """Joins the other processes if launched as several, sets the devices, makes the strategy.

    Raises:
      SystemExit: with status 2 for `--devices` under several processes, or a batch size
        that is not a multiple of their replicas.
    """
    jm.distributed.initialize()  # nothing alone; several processes: before any device use
    if not jax.distributed.is_initialized():
        set_host_device_count(args.devices or _DEFAULT_DEVICES)
        devices = jax.devices("cpu")[: args.devices or _DEFAULT_DEVICES]
        return jm.MirroredStrategy(devices, backend=args.backend)
    if args.devices is not None:
        _refuse(
            f"--devices {args.devices} does not apply under python -m jmirror.launch "
            f"({jax.process_count()} processes here): the launcher sets each process's devices "
            "(python -m jmirror.launch --devices-per-process D) and the replicas are every "
            "device of every process. Drop --devices."
        )
    strategy = jm.MultiWorkerMirroredStrategy(backend=args.backend)
    if args.batch_size % strategy.num_replicas:
        _refuse(
            f"--batch-size {args.batch_size} must be a multiple of the "
            f"{strategy.num_replicas} replicas of the {strategy.num_processes} processes: "
            "every replica gets batch_size / replicas examples."
        )
    return strategy


def _refuse(message: str) -> NoReturn:
    """Exits with status 2 and `message` on stderr (every process, so the cause is shown)."""
    print(f"python -m jmirror.demo: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _resume(
    args: argparse.Namespace, strategy: jm.MirroredStrategy
) -> tuple[jm.checkpoint.CheckpointManager | None, int]:
    """Returns the checkpoint manager of `--checkpoint-dir` and the epochs its newest step
    completed."""
    if args.checkpoint_dir is None:
        return None, 0
    manager = jm.checkpoint.CheckpointManager(args.checkpoint_dir, strategy=strategy, max_to_keep=2)
    latest = manager.latest_step() or 0
    if latest > args.epochs:
        raise SystemExit(
            f"--checkpoint-dir {args.checkpoint_dir} holds a run of {latest} epochs, more than "
            f"--epochs {args.epochs}; pass --epochs {latest} or more, or a new directory."
        )
    return manager, latest


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the demo; returns the final accuracies and the largest parameter difference.

    Raises:
      SystemExit: with status 1 when the N-device run and the one-device run disagree.

    Example:
        >>> import jax
        >>> from jmirror import demo
        >>> n = len(jax.devices("cpu"))
        >>> result = demo.main(["--devices", str(n), "--epochs", "1", "--batch-size", str(16 * n)])
        ... # doctest: +ELLIPSIS
        jmirror demo: ...
        >>> sorted(result)
        ['max_param_diff', 'one_device_accuracy', 'test_accuracy']
    """
    args = parse_args(argv)
    strategy = _strategy(args)  # first: before anything queries the devices
    several = jax.process_count() > 1
    leader = jax.process_index() == 0
    say = print if leader else _silent
    tty = sys.stdout.isatty() and leader
    train, test = load_data(args.seed)
    processes = f" on {jax.process_count()} processes" if several else ""
    say(
        f"jmirror demo: {len(train['y'])} train / {len(test['y'])} test digits, "
        f"{strategy.num_replicas} replicas ({args.backend}){processes}, global batch "
        f"{args.batch_size} ({args.batch_size // strategy.num_replicas} per replica), "
        f"{args.epochs} epochs"
    )

    model = MLP()
    init_params = model.init(jax.random.key(args.seed), train["x"][:1])["params"]
    tx = optax.sgd(args.learning_rate, momentum=0.9)
    state = strategy.mirror(TrainState.create(apply_fn=model.apply, params=init_params, tx=tx))
    train_step = jm.replicate(_train_step, strategy=strategy)
    eval_step = jm.replicate(_eval_step, strategy=strategy, static_argnums=1)
    manager, first_epoch = _resume(args, strategy)
    if manager is not None and first_epoch:
        state = manager.restore(first_epoch, target=state)
        say(f"resuming after epoch {first_epoch} from {manager.directory}")

    for epoch in range(first_epoch, args.epochs):
        batches = train_batches(train, args.batch_size, epoch, args.seed)
        loss, accuracy = metrics.Mean.create(strategy), metrics.Accuracy.create(strategy)
        start = time.perf_counter()
        label = f"epoch {epoch + 1:>3}/{args.epochs}"
        with (
            _bar(label, len(batches), live=tty) as advance,
            strategy.distribute_dataset(batches, remainder="error") as placed,
        ):
            for batch in placed:
                state, loss, accuracy = train_step(state, batch, loss, accuracy)
                advance()
            epoch_loss = float(loss.compute(strategy))  # waits for the epoch's steps
            epoch_accuracy = float(accuracy.compute(strategy))
        seconds = time.perf_counter() - start
        rate = len(batches) * args.batch_size / seconds
        say(
            f"{label}  {len(batches)} steps  loss {epoch_loss:.4f}  "
            f"accuracy {epoch_accuracy:.4f}  {rate:,.0f} examples/s"
            + ("  (includes compiling)" if epoch == first_epoch else "")
        )
        if manager is not None:
            manager.save(epoch + 1, state, data={"epochs_done": epoch + 1})
    if manager is not None:
        manager.close()  # waits for the last background write

    accuracy = metrics.Accuracy.create(strategy)
    size = len(test["y"])
    test_batches = [
        {k: v[i : i + args.batch_size] for k, v in test.items()}
        for i in range(0, size, args.batch_size)
    ]
    with strategy.distribute_dataset(test_batches, remainder="pad") as placed:
        for batch, mask in placed:
            accuracy = eval_step(state.params, model.apply, batch, mask, accuracy)
    test_accuracy = float(accuracy.compute(strategy))
    params = strategy.read(state.params)  # this process's copy: no communication
    if not leader:
        return {"test_accuracy": test_accuracy, "one_device_accuracy": None, "max_param_diff": None}

    device = strategy.topology.first_local_device
    one_params, one_accuracy = train_one_device(model, init_params, tx, args, train, test, device)
    diff = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(one_params), strict=True)
    )
    agree = diff <= _PARAMS_ATOL and abs(test_accuracy - one_accuracy) <= 1.5 / len(test["y"])
    where = f" on process 0's {device}" if several else ""
    say(
        f"check against one device (jax.jit{where}, same global batches): max |params "
        f"difference| {diff:.2e} -> {'OK' if agree else 'MISMATCH'}"
    )
    say(f"test accuracy {test_accuracy:.4f} (one device {one_accuracy:.4f})")
    if not agree:
        raise SystemExit(1)
    return {
        "test_accuracy": test_accuracy,
        "one_device_accuracy": one_accuracy,
        "max_param_diff": diff,
    }


def _silent(*args: PyTree, **kwargs: PyTree) -> None:
    """Stands in for `print` on the processes that do not print (all but process 0)."""


if __name__ == "__main__":
    main()
