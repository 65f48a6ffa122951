"""Exact resume: a run killed after its checkpoint resumes to the same result.

A child process trains a small flax MLP with optax Adam on 8 host devices (`jm.replicate`,
`jm.all_reduce("mean", grads)`, a `SyncOnRead` SUM of the example losses), reading a
deterministic numpy source through `distribute_dataset`, saves a checkpoint with the input
position as `data` at step K, and is SIGKILLed once it has reached step K + 3. This process
then restarts from the newest checkpoint and trains to the end; the oracle is the same
training run uninterrupted. Both backends; then the 8-replica checkpoint resumes on 4 and
on 1 replica(s).

These tests start processes: they run in the suite's 8-device pass only.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from flax.training import train_state

import jmirror as jm

pytestmark = pytest.mark.skipif(
    os.environ.get("JMIRROR_TEST_DEVICES", "8") != "8",
    reason="starts processes: runs in the suite's 8-device pass only",
)

GLOBAL_BATCH, FEATURES, CLASSES = 16, 8, 4
STEPS, K = 10, 4  # train 10 steps; checkpoint after step 4; killed after step 7


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(CLASSES)(nn.relu(nn.Dense(32)(x)))


def batches():
    """The deterministic source: one epoch of STEPS global batches (re-created per call)."""
    rng = np.random.default_rng(0)
    for _ in range(STEPS):
        x = rng.standard_normal((GLOBAL_BATCH, FEATURES)).astype(np.float32)
        yield {"x": x, "y": x[:, :CLASSES].argmax(1).astype(np.int32)}


def init(strategy):
    model = MLP()
    params = model.init(jax.random.key(0), np.zeros((1, FEATURES), np.float32))
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(0.05))
    return strategy.mirror(state), strategy.sync_on_read(np.float32(0.0), "sum")


def make_step(strategy):
    @jm.replicate(strategy=strategy)
    def step(state, total, batch):
        def loss_fn(params):
            logits = state.apply_fn(params, batch["x"])
            losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
            return losses.mean(), losses.sum()

        (_, loss_sum), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        state = state.apply_gradients(grads=jm.all_reduce("mean", grads))
        return state, total.replace(total.value + loss_sum)

    return step


def train(strategy, manager=None, *, resume=False, report=False, stop_after=None):
    """Trains to STEPS (or `stop_after`), saving at step K; resumes from `manager` first."""
    state, total = init(strategy)
    first, position = 1, None
    if resume:
        first = manager.latest_step() + 1
        state, total = manager.restore(target=(state, total))
        position = manager.data()
    step_fn = make_step(strategy)
    data = strategy.distribute_dataset(batches, remainder="drop", start=position)
    iterator = iter(data)
    for step in range(first, STEPS + 1):
        state, total = step_fn(state, total, next(iterator))
        if manager is not None and step == K and not resume:
            manager.save(step, (state, total), data=iterator.position)
        if report:
            print("reached", step, flush=True)
        if step == stop_after:
            time.sleep(600)  # waits here to be killed
    iterator.close()
    return state, total


CHILD = textwrap.dedent(
    """
    import sys
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    sys.path.insert(0, sys.argv[1])
    import jmirror as jm
    import test_resume

    strategy = jm.MirroredStrategy(backend=sys.argv[2])
    manager = jm.checkpoint.CheckpointManager(sys.argv[3])
    test_resume.train(strategy, manager, report=True, stop_after=test_resume.K + 3)
    """
)


def run_and_kill(directory, backend):
    """A child trains, checkpoints at K and is SIGKILLed after reaching K + 3."""
    script = directory.parent / "child.py"
    script.write_text(CHILD)
    tests = os.path.dirname(os.path.abspath(__file__))
    child = subprocess.Popen(
        [sys.executable, str(script), tests, backend, str(directory)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        for line in child.stdout:  # type: ignore[union-attr]
            if line.strip() == f"reached {K + 3}":
                break
        deadline = time.monotonic() + 60
        while not (directory / str(K)).exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # the background write of step K may still be finishing
    finally:
        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL
    return directory


@pytest.fixture(scope="module", params=["pmap", "shard_map"])
def backend(request):
    return request.param


@pytest.fixture(scope="module")
def killed(backend, tmp_path_factory):
    """The checkpoint directory a killed 8-replica run left behind."""
    return run_and_kill(tmp_path_factory.mktemp(backend) / "checkpoints", backend)


@pytest.fixture(scope="module")
def uninterrupted(backend):
    """The oracle: the same training on 8 replicas, never killed."""
    strategy = jm.MirroredStrategy(backend=backend)
    state, total = train(strategy)
    return leaves(state), float(strategy.read(total))


def leaves(state):
    return [np.asarray(x) for x in jax.tree.leaves((state.params, state.opt_state))]


def test_killed_run_resumes_bitwise_on_the_same_replica_count(backend, killed, uninterrupted):
    strategy = jm.MirroredStrategy(backend=backend)
    with jm.checkpoint.CheckpointManager(killed, strategy=strategy) as manager:
        assert manager.all_steps() == [K]
        resumed, total = train(strategy, manager, resume=True)
    full_leaves, full_total = uninterrupted
    assert int(resumed.step) == STEPS
    for got, want in zip(leaves(resumed), full_leaves, strict=True):
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
    np.testing.assert_allclose(float(strategy.read(total)), full_total, rtol=1e-6)


@pytest.mark.parametrize("n", [4, 1])
def test_the_8_replica_checkpoint_resumes_on_fewer_replicas(backend, killed, uninterrupted, n):
    strategy = jm.MirroredStrategy(num_devices=n, backend=backend)
    with jm.checkpoint.CheckpointManager(killed, strategy=strategy) as manager:
        resumed, total = train(strategy, manager, resume=True)
    full_leaves, full_total = uninterrupted
    assert int(resumed.step) == STEPS
    for got, want in zip(leaves(resumed), full_leaves, strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(float(strategy.read(total)), full_total, rtol=1e-5)


def test_demo_resumes_from_its_checkpoint_dir(tmp_path, capsys):
    from jmirror import demo

    n = len(jax.devices("cpu"))
    flags = ["--devices", str(n), "--batch-size", str(64 * n), "--checkpoint-dir", str(tmp_path)]
    demo.main([*flags, "--epochs", "1"])
    assert "resuming" not in capsys.readouterr().out
    result = demo.main([*flags, "--epochs", "2"])  # exits 1 unless it matches one device
    out = capsys.readouterr().out
    assert f"resuming after epoch 1 from {tmp_path}" in out and "epoch   2/2" in out
    assert "epoch   1/2" not in out and result["max_param_diff"] <= 1e-4
    with jm.checkpoint.CheckpointManager(tmp_path) as manager:  # closed: its SIGTERM handler goes
        assert manager.all_steps() == [1, 2]
