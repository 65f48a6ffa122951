"""A keyboard interrupt during a replicated call never loses state.

A helper thread interrupts the main thread (`_thread.interrupt_main()`, what Ctrl-C and
Jupyter's "interrupt kernel" do) at varied moments of a training loop; after every interrupt
the loop's state must be whole: not deleted by a donation whose result was lost, and (NNX)
not a mix of two steps.
"""

import _thread
import random
import signal
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmirror as jm

INTERRUPTS = 12
LEAVES = 256


@pytest.fixture(autouse=True)
def python_handles_sigint():
    """Python's own SIGINT handler, as in a terminal or Jupyter. A process that a
    non-interactive shell starts in the background (`cmd &`, as CI's scripts do) begins with
    SIGINT ignored, and there `interrupt_main()` would do nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _interrupt_loop(step_once, check, interrupts: int = INTERRUPTS) -> int:
    """Runs `step_once()` in a loop while a thread interrupts it `interrupts` times at random
    moments; calls `check()` after every interrupt. Returns the number of interrupts caught."""
    rng = random.Random(0)
    caught = 0
    done = threading.Event()
    ready = threading.Event()
    deadline = time.monotonic() + 300

    def interrupter():
        # Each interrupt waits for the loop to have caught the one before: two interrupts
        # within one call are one KeyboardInterrupt (as two of Python's own SIGINTs before
        # its next bytecode are), and a first call that compiles on a loaded machine can
        # take longer than any fixed wait.
        for _ in range(interrupts):
            if not ready.wait(max(0.0, deadline - time.monotonic())) or done.is_set():
                break
            ready.clear()
            time.sleep(rng.uniform(0.001, 0.02))
            _thread.interrupt_main()

    thread = threading.Thread(target=interrupter, daemon=True)
    thread.start()
    while caught < interrupts and time.monotonic() < deadline:
        try:
            ready.set()
            while time.monotonic() < deadline:  # bounded even if no interrupt arrives
                step_once()
        except KeyboardInterrupt:
            caught += 1
            check()
    done.set()  # an interrupter still waiting (the loop ran out of time) ends
    ready.set()
    thread.join(10)
    assert not thread.is_alive()
    return caught


@pytest.mark.parametrize("donate", [True, False])
def test_an_interrupted_loop_keeps_its_state(strategy, donate):
    # Many leaves: the call spends its time dispatching them, after the donation.
    step = jm.replicate(
        lambda w, x: jax.tree.map(lambda v: v + jm.all_reduce("mean", x), w),
        strategy=strategy,
        donate_argnums=(0,) if donate else (),
    )
    state = {"w": strategy.mirror({f"leaf{i}": jnp.zeros((8,)) for i in range(LEAVES)})}
    # Placed per replica already: the call converts no argument in Python (where an interrupt
    # is raised before anything is donated), so most of it is the dispatch that donates.
    one = jm.PerReplica(
        jax.device_put(jnp.ones((strategy.num_replicas,)), strategy.topology.stacked)
    )
    steps = [0]

    def step_once():  # one statement: the interrupt comes after it, not inside it
        state["w"], steps[0] = step(state["w"], one), steps[0] + 1

    def check():
        leaves = jax.tree.leaves(state["w"])
        assert not any(x.is_deleted() for x in leaves), "the interrupt lost the donated state"
        # Each step adds 1: the state is the one of the steps that returned, none lost.
        np.testing.assert_array_equal(np.stack(leaves), np.full((LEAVES, 8), steps[0]))

    assert _interrupt_loop(step_once, check) == INTERRUPTS


class _Many(nnx.Module):
    """Many Variables: writing them back takes long enough for interrupts to land in it."""

    def __init__(self, count: int = 64):
        self.count = count
        for i in range(count):
            setattr(self, f"v{i}", nnx.Param(jnp.zeros((32,))))

    def variables(self):
        return [getattr(self, f"v{i}") for i in range(self.count)]


def test_an_interrupted_nnx_step_is_written_back_whole(strategy):
    model = _Many()

    @jm.replicate(strategy=strategy)
    def step(model):
        for v in model.variables():
            v[...] += 1.0

    def check():
        values = np.stack([np.asarray(jax.device_get(v[...])) for v in model.variables()])
        np.testing.assert_array_equal(values, np.broadcast_to(values[0], values.shape))

    assert _interrupt_loop(lambda: step(model), check) == INTERRUPTS


def test_calls_from_another_thread_are_unchanged(strategy):
    """Outside the main thread (no signal arrives there) a call runs as before."""
    step = jm.replicate(lambda w: w + 1.0, strategy=strategy, donate_argnums=(0,))
    out = []
    thread = threading.Thread(target=lambda: out.append(step(strategy.mirror(jnp.zeros(3)))))
    thread.start()
    thread.join(60)
    np.testing.assert_array_equal(np.asarray(out[0]), np.ones(3, np.float32))


def test_an_interrupt_between_calls_is_raised_at_once(strategy):
    """Only calls hold interrupts back: between them Python's own handler raises."""
    step = jm.replicate(lambda w: w + 1.0, strategy=strategy)
    step(strategy.mirror(jnp.zeros(3)))
    with pytest.raises(KeyboardInterrupt):
        _thread.interrupt_main()
        time.sleep(1)


def test_an_interrupt_during_the_write_back_waits_for_all_of_it(strategy, monkeypatch):
    """Deterministic: the interrupt arrives while the first Variable is written back."""
    from jmirror import _nnx

    model = _Many(8)
    write = _nnx._set_raw_value
    arrived = []

    def interrupted_write(variable, value):
        if not arrived:
            arrived.append(True)
            _thread.interrupt_main()
            time.sleep(0.01)  # Python's handler is due at the next bytecode
        write(variable, value)

    monkeypatch.setattr(_nnx, "_set_raw_value", interrupted_write)
    step = jm.replicate(lambda m: [v.__setitem__(..., v[...] + 1.0) for v in m.variables()])
    with strategy.scope(), pytest.raises(KeyboardInterrupt):
        step(model)
        time.sleep(1)  # the interrupt is raised at the caller's next line: this one
    assert arrived
    for v in model.variables():  # every Variable written back before the interrupt
        np.testing.assert_array_equal(np.asarray(jax.device_get(v[...])), np.ones(32))


@pytest.mark.parametrize("wait", ["wait_until_finished", "close"])
def test_an_interrupted_wait_for_a_background_save_keeps_the_save(tmp_path, monkeypatch, wait):
    # A KeyboardInterrupt inside `Thread.join` can leave CPython taking a thread that still
    # runs for finished: the save then looked done to every later wait, and was lost.
    from jmirror.checkpoint import _storage

    written = _storage.write
    writing = threading.Event()

    def slow_write(*args, **kwargs):
        writing.set()
        time.sleep(1.0)
        return written(*args, **kwargs)

    monkeypatch.setattr(_storage, "write", slow_write)
    strategy = jm.MirroredStrategy()
    manager = jm.checkpoint.CheckpointManager(tmp_path / "run", strategy=strategy, async_save=True)
    assert manager.save(1, {"w": strategy.mirror(jnp.arange(4.0))})
    assert writing.wait(60)
    threading.Timer(0.2, _thread.interrupt_main).start()
    with pytest.raises(KeyboardInterrupt):
        getattr(manager, wait)()
    getattr(manager, wait)()  # waits for the save still running
    if wait == "wait_until_finished":
        assert manager.all_steps() == [1]
        manager.close()
    restored = jm.checkpoint.CheckpointManager(tmp_path / "run", strategy=strategy)
    assert restored.all_steps() == [1]
    np.testing.assert_array_equal(strategy.read(restored.restore(1)["w"]), np.arange(4.0))
    restored.close()
