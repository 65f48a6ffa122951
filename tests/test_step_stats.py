"""Where the time goes: `strategy.step_stats()`, its verdict and table, and the profiler's steps.

The oracles are the test's own clock and sleeps (a source that sleeps, Python that sleeps
between steps), the calls and batches it made, and the trace JAX's profiler writes.
"""

import glob
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmirror as jm
from jmirror import _step_stats

KEYS = ["name", "kind", "calls", "dispatch_s", "room_wait_s", "input_wait_s"]
PAUSE_S = 0.03  # a sleep long against a cheap step, on a loaded machine too


def _cheap_step(strategy):
    @jm.replicate(strategy=strategy)
    def cheap_step(w, x):
        return w + jm.all_reduce("mean", jnp.mean(x))

    return cheap_step


def _heavy_step(strategy, layers=8):
    @jm.replicate(strategy=strategy)
    def heavy_step(w, x):
        y = x
        # Unrolled, not a loop: XLA:CPU runs a program of few instructions on the caller's
        # thread, which would make device time look like dispatch.
        for _ in range(layers):
            y = jnp.tanh(y @ w)
        return w + 1e-6 * jm.all_reduce("mean", jnp.mean(y))

    return heavy_step


def _batches(n, count, pause=0.0):
    def source():
        for i in range(count):
            time.sleep(pause)
            yield np.full((n, 2), i, np.float32)

    return source


def test_rows_count_every_call_and_batch(strategy, n):
    step = _cheap_step(strategy)
    w = strategy.mirror(jnp.zeros(()))
    for x in strategy.distribute_dataset(_batches(n, 5), remainder="drop"):
        w = step(w, x)
    per_replica = strategy.distribute_datasets_from_function(
        lambda ctx: [np.ones(2, np.float32)] * (2 * ctx.num_replicas_in_sync)
    )
    for x in per_replica:
        w = step(w, x)
    stats = strategy.step_stats()
    assert isinstance(stats, jm.StepStats)
    assert [list(row) for row in stats.rows] == [KEYS] * 3
    named = {row["name"]: row for row in stats.rows}
    assert named["distribute_dataset(source)"]["kind"] == "dataset"
    assert named["distribute_dataset(source)"]["calls"] == 5
    assert named["distribute_datasets_from_function(<lambda>)"]["calls"] == 2
    assert (named["cheap_step"]["kind"], named["cheap_step"]["calls"]) == ("function", 7)
    parts = sum(row[k] for row in stats.rows for k in KEYS[3:])
    assert 0 < parts <= stats.wall_s * 1.01
    assert float(strategy.read(w)) == pytest.approx(sum(range(5)) + 2.0)


def test_reset_reads_then_counts_from_zero(strategy, n):
    step = _cheap_step(strategy)
    w = strategy.mirror(jnp.zeros(()))
    x = jm.PerReplica(np.ones((n, 2), np.float32))
    for _ in range(3):
        w = step(w, x)
    assert strategy.step_stats(reset=True).rows[0]["calls"] == 3
    empty = strategy.step_stats()
    assert (empty.rows, empty.wall_s) == ([], 0.0)
    w = step(w, x)
    assert [row["calls"] for row in strategy.step_stats().rows] == [1]


@pytest.mark.parametrize("reset", ["no", 1, None])
def test_reset_must_be_a_bool(strategy, n, reset):
    step = _cheap_step(strategy)
    step(strategy.mirror(jnp.zeros(())), jm.PerReplica(np.ones((n, 2), np.float32)))
    with pytest.raises(TypeError, match=r"reset=\.\.\.\) expects True or False; got"):
        strategy.step_stats(reset=reset)
    assert [row["calls"] for row in strategy.step_stats().rows] == [1]  # nothing was reset


def test_a_source_slower_than_the_steps_is_input_bound(strategy, n):
    step = _cheap_step(strategy)
    w = strategy.mirror(jnp.zeros(()))
    step(w, jm.PerReplica(np.ones((n, 2), np.float32)))  # compiled before the loop
    strategy.step_stats(reset=True)
    data = strategy.distribute_dataset(_batches(n, 10, PAUSE_S), remainder="drop", prefetch=1)
    for x in data:
        w = step(w, x)
    stats = strategy.step_stats()
    (dataset,) = [row for row in stats.rows if row["kind"] == "dataset"]
    assert dataset["input_wait_s"] >= 9 * PAUSE_S  # the first batch may be prefetched
    assert stats.verdict == "input-bound"
    assert "raise `prefetch`" in str(stats)


def test_steps_slower_than_the_host_are_device_bound(n):
    strategy = jm.MirroredStrategy()
    # Deep enough that waiting for room outweighs dispatch even when other processes share
    # the cores (8 host devices on 2 cores slow the caller's thread in proportion to the work).
    step = _heavy_step(strategy, layers=24)
    size = 512 if n == 1 else 320
    w = strategy.mirror(jnp.eye(size, dtype=jnp.float32) * 0.5)
    # Placed once, as distribute_dataset places batches (a host array would be copied to the
    # devices by every call, on the caller's thread).
    batch = np.ones((n * size, size), np.float32)
    (x,) = strategy.distribute_dataset([batch], remainder="drop")
    x = jm.PerReplica(x.values.reshape(n, size, size))
    w = step(w, x)  # compiles
    jax.block_until_ready(w)
    assert strategy.step_stats(reset=True).compile_s > 0
    # Only the steady loop is counted: the first call's tracing, and the placing of the batch,
    # are host time that a loaded machine stretches to the size of the whole loop.
    for _ in range(24):
        w = step(w, x)
    jax.block_until_ready(w)
    stats = strategy.step_stats()
    (row,) = [row for row in stats.rows if row["kind"] == "function"]
    assert row["calls"] == 24 and row["room_wait_s"] > 0 and stats.compile_s == 0
    assert stats.verdict == "device-bound", stats
    assert "a bigger batch or model per step" in str(stats)


def test_python_between_steps_is_host_bound(strategy, n):
    step = _cheap_step(strategy)
    w = strategy.mirror(jnp.zeros(()))
    x = jm.PerReplica(np.ones((n, 2), np.float32))
    began = time.perf_counter()
    for _ in range(10):
        w = step(w, x)
        time.sleep(PAUSE_S)  # the host's own work between steps
    w = step(w, x)
    stats = strategy.step_stats()
    assert 9 * PAUSE_S <= stats.wall_s <= time.perf_counter() - began
    assert stats.verdict == "host-bound"
    assert "fewer Python operations between steps" in str(stats)


def test_compiling_is_left_out(strategy, n):
    @jm.replicate(strategy=strategy)
    def long_to_compile(w, x):
        for i in range(300):
            w = jnp.sin(w + i * x)
        return w + jm.all_reduce("sum", x)

    w = strategy.mirror(jnp.zeros(()))
    x = jm.PerReplica(np.ones((n,), np.float32))
    began = time.perf_counter()
    long_to_compile(w, x)
    first_call = time.perf_counter() - began
    stats = strategy.step_stats()
    assert stats.compile_s > first_call / 2
    assert stats.rows[0]["dispatch_s"] < first_call / 2
    assert stats.wall_s < first_call / 2


def test_calls_traced_by_the_callers_jit_are_not_counted(strategy, n):
    step = _cheap_step(strategy)
    w = strategy.mirror(jnp.zeros(()))
    x = jm.PerReplica(np.ones((n, 2), np.float32))
    out = jax.jit(lambda w: step(w, x))(w)
    assert float(strategy.read(out)) == 1.0
    assert strategy.step_stats().rows == []


def test_the_table_shows_every_row_and_the_verdict_with_its_fix(strategy, n):
    step = _cheap_step(strategy)
    w = strategy.mirror(jnp.zeros(()))
    for x in strategy.distribute_dataset(_batches(n, 2), remainder="drop"):
        w = step(w, x)
    stats = strategy.step_stats()
    text = str(stats)
    for header in ("name", "kind", "calls", "dispatch s", "room wait s", "input wait s"):
        assert header in text
    assert "cheap_step" in text and "distribute_dataset(source)" in text
    assert text.rstrip().endswith(stats.fix)
    assert f"{stats.verdict}" in text.splitlines()[-1]
    strategy.step_stats(reset=True)
    assert "nothing recorded" in str(strategy.step_stats())


def test_several_processes_name_the_process_in_each_row():
    # One process's recorder as a process of several reports it (the strategy passes its
    # process index when there are several).
    recorder = _step_stats.Recorder()
    row = recorder.row(test_several_processes_name_the_process_in_each_row, "f", "function")
    row.waited_for_batch(_step_stats.clock(), 1)
    stats = recorder.stats(False, 3)
    assert stats.rows[0]["process"] == 3 and list(stats.rows[0])[:3] == ["name", "kind", "process"]
    assert "process" in str(stats)


# --- the profiler ----------------------------------------------------------------------------


def _step_events(log_dir) -> list[tuple[str, dict]]:
    """The events named after `cheap_step` in the trace JAX wrote, with their stats."""
    (path,) = glob.glob(f"{log_dir}/**/*.xplane.pb", recursive=True)
    data = jax.profiler.ProfileData.from_file(path)
    return [
        (event.name, dict(event.stats))
        for plane in data.planes
        for line in plane.lines
        for event in line.events
        if event.name == "cheap_step"
    ]


def test_a_trace_shows_every_call_as_a_numbered_step(strategy, n, tmp_path):
    step = _cheap_step(strategy)
    w = strategy.mirror(jnp.zeros(()))
    x = jm.PerReplica(np.ones((n, 2), np.float32))
    for _ in range(2):  # numbered from the function's first call
        w = step(w, x)
    with jax.profiler.trace(str(tmp_path)):
        for _ in range(3):
            w = step(w, x)
    w = step(w, x)  # outside the trace: no event
    events = _step_events(tmp_path)
    assert [stats["step_num"] for _, stats in events] == [2, 3, 4]
    assert all(stats["_r"] == 1 for _, stats in events)  # step events, as StepTraceAnnotation


def test_only_calls_inside_a_trace_are_annotated(strategy, n, tmp_path, monkeypatch):
    made = []

    def annotation(name, number):
        made.append((name, number))
        return jax.profiler.StepTraceAnnotation(name, step_num=number)

    monkeypatch.setattr(_step_stats, "annotation", annotation)
    step = _cheap_step(strategy)
    w = strategy.mirror(jnp.zeros(()))
    x = jm.PerReplica(np.ones((n, 2), np.float32))
    w = step(w, x)
    with jax.profiler.trace(str(tmp_path)):
        w = step(w, x)
    w = step(w, x)
    assert made == [("cheap_step", 1)]
    assert float(strategy.read(w)) == 3.0
