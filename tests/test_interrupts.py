"""A keyboard interrupt during a replicated call never loses state (SPEC 5, round 4 note).

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

    def interrupter():
        for _ in range(interrupts):
            ready.wait(10)
            ready.clear()
            time.sleep(rng.uniform(0.0, 0.004))
            _thread.interrupt_main()
        done.set()

    thread = threading.Thread(target=interrupter, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while caught < interrupts and time.monotonic() < deadline:
        try:
            ready.set()
            while time.monotonic() < deadline:  # bounded even if no interrupt arrives
                step_once()
        except KeyboardInterrupt:
            caught += 1
            check()
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
    one = jm.PerReplica(jnp.ones((strategy.num_replicas,)))
    steps = [0]

    def step_once():  # one statement: the interrupt comes after it, not inside it
        state["w"], steps[0] = step(state["w"], one), steps[0] + 1

    def check():
        leaves = jax.tree.leaves(state["w"])
        assert not any(x.is_deleted() for x in leaves), "the interrupt lost the donated state"
        # Each step adds 1: the state is the one of the steps that returned, none lost.
        np.testing.assert_array_equal(np.stack(leaves), np.full((LEAVES, 8), steps[0]))

    assert _interrupt_loop(step_once, check) == INTERRUPTS


class _Pair(nnx.Module):
    def __init__(self):
        self.a = nnx.Param(jnp.zeros((32,)))
        self.b = nnx.Param(jnp.zeros((32,)))
        self.c = nnx.Param(jnp.zeros((32,)))


def test_an_interrupted_nnx_step_is_written_back_whole(strategy):
    model = _Pair()

    @jm.replicate(strategy=strategy)
    def step(model):
        model.a[...] += 1.0
        model.b[...] += 1.0
        model.c[...] += 1.0

    def check():
        a, b, c = (np.asarray(jax.device_get(v[...])) for v in (model.a, model.b, model.c))
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)

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
