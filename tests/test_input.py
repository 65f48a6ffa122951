"""`strategy.distribute_dataset` and `strategy.distribute_datasets_from_function`."""

import gc
import os
import sys
import threading
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmirror as jm


@pytest.fixture
def s() -> jm.MirroredStrategy:
    """One strategy for tests whose input path does not depend on the backend."""
    return jm.MirroredStrategy()


def _concat(strategy, per_replica):
    """The global batch back from a PerReplica, through local_results."""
    parts = strategy.local_results(per_replica)
    return jax.tree.map(lambda *xs: np.concatenate([np.asarray(x) for x in xs]), *parts)


def _batches(n, sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {"x": rng.normal(size=(b, 3)).astype(np.float32), "y": rng.integers(0, 9, size=(b,))}
        for b in sizes
    ]


# --- contents ------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("kind", ["list", "generator_fn", "one_shot", "tuples"])
def test_local_results_concatenate_to_source_batches(s, n, kind, prefetch):
    batches = _batches(n, [4 * n, 4 * n, 4 * n])
    if kind == "tuples":
        batches = [(b["x"], b["y"]) for b in batches]
    source = {
        "list": batches,
        "tuples": batches,
        "generator_fn": lambda: (b for b in batches),
        "one_shot": iter(batches),
    }[kind]
    with s.distribute_dataset(source, remainder="drop", prefetch=prefetch) as data:
        out = list(data)
    assert len(out) == 3
    for got, want in zip(out, batches):
        assert isinstance(got, jm.PerReplica)
        jax.tree.map(np.testing.assert_array_equal, _concat(s, got), want)


class _Loader:
    """A tf.data- or grain-style loader: plain iteration, a fresh pass per `iter()`."""

    def __init__(self, batches):
        self.batches = batches
        self.passes = 0

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        self.passes += 1
        return iter(list(self.batches))


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_loader_object_is_read_once_per_epoch(s, n, prefetch):
    batches = _batches(n, [2 * n, 2 * n])
    loader = _Loader([(b["x"], b["y"]) for b in batches])
    data = s.distribute_dataset(loader, remainder="drop", prefetch=prefetch)
    for epoch in range(2):
        out = list(data)
        assert loader.passes == epoch + 1
        for got, want in zip(out, batches, strict=True):
            jax.tree.map(np.testing.assert_array_equal, _concat(s, got), (want["x"], want["y"]))


@pytest.mark.parametrize("prefetch", [0, 2, 4])
def test_a_loader_refilling_one_buffer_loses_no_batch(s, n, prefetch):
    # JAX on CPU places an aligned host buffer without copying it: a loader that reuses one
    # buffer must still see every batch it yielded, even when batches are prefetched.
    raw = np.zeros(n * 256 * 4 + 128, np.uint8)
    start = -raw.ctypes.data % 64  # 64-byte aligned, the case JAX would alias
    buffer = raw[start : start + n * 256 * 4].view(np.float32).reshape(n * 4, 64)

    def loader():
        for i in range(6):
            buffer[:] = i
            yield buffer

    with s.distribute_dataset(loader, remainder="drop", prefetch=prefetch) as data:
        out = [np.asarray(batch.values) for batch in data]
    assert [float(x.min()) for x in out] == [0, 1, 2, 3, 4, 5]
    assert [float(x.max()) for x in out] == [0, 1, 2, 3, 4, 5]


def test_pad_masks_count_exactly_the_real_examples(s, n):
    sizes = [4 * n + 1, 4 * n, 3, 1]  # the first one is not a multiple of N when N > 1
    g = -(-sizes[0] // n) * n
    batches = _batches(n, sizes)
    out = list(s.distribute_dataset(batches, remainder="pad"))
    assert len(out) == len(sizes)
    for (batch, mask), want, size in zip(out, batches, sizes):
        assert isinstance(mask, jm.PerReplica)
        assert mask.values.shape == (n, g // n) and mask.values.dtype == np.bool_
        flat_mask = _concat(s, mask)
        np.testing.assert_array_equal(flat_mask, np.arange(g) < size)
        assert int(s.reduce("sum", mask, axis=0)) == size
        got = _concat(s, batch)
        assert got["x"].shape == (g, 3)  # shapes never change: no recompiles
        np.testing.assert_array_equal(got["x"][:size], want["x"])
        np.testing.assert_array_equal(got["y"][:size], want["y"])
        assert not np.any(got["x"][size:]) and not np.any(got["y"][size:])  # zero padding


def test_drop_yields_only_complete_batches(s, n):
    data = s.distribute_dataset(_batches(n, [96] * 10 + [1000 - 960]), remainder="drop")
    assert len(list(data)) == 1000 // 96


def test_error_raises_on_incomplete_batch_after_complete_ones(s, n):
    seen = []
    with pytest.raises(ValueError, match=rf"40 examples.*G=96.*N={n}"):
        for batch in s.distribute_dataset(_batches(n, [96, 96, 40]), remainder="error"):
            seen.append(batch)
    assert len(seen) == 2


def test_larger_later_batch_raises_after_earlier_batches(s, n):
    seen = []
    with pytest.raises(ValueError, match=rf"batch 2 has {8 * n} examples.*G={4 * n}"):
        for batch in s.distribute_dataset(_batches(n, [4 * n, 4 * n, 8 * n]), remainder="drop"):
            seen.append(batch)
    assert len(seen) == 2


@pytest.mark.parametrize("prefetch", [0, 2])
def test_mismatched_leading_sizes_name_the_leaf_path(s, n, prefetch):
    batch = {"a": {"x": np.zeros((2 * n, 3)), "y": np.zeros((2 * n + 1,))}, "b": np.zeros(2 * n)}
    with pytest.raises(ValueError, match=r"batch\['a'\]\['y'\].*leading size"):
        list(s.distribute_dataset([batch], prefetch=prefetch))


def test_scalar_leaf_is_a_value_error(s, n):
    with pytest.raises(ValueError, match=r"batch\['c'\].*scalar"):
        list(s.distribute_dataset([{"x": np.zeros((n, 1)), "c": 1.0}]))


def test_jax_array_leaves_are_accepted(s, n):
    batches = [jnp.arange(2 * n * 3, dtype=jnp.float32).reshape(2 * n, 3), jnp.ones((n, 3))]
    out = list(s.distribute_dataset(batches, remainder="pad"))
    np.testing.assert_array_equal(_concat(s, out[0][0]), np.asarray(batches[0]))
    np.testing.assert_array_equal(_concat(s, out[1][0])[:n], np.ones((n, 3)))


def test_placed_batch_is_stacked_one_slice_per_device(s, n):
    (batch,) = s.distribute_dataset([np.arange(4 * n * 2).reshape(4 * n, 2)], remainder="drop")
    leaf = batch.values
    assert leaf.shape == (n, 4, 2)
    assert leaf.sharding.is_equivalent_to(s.topology.stacked, leaf.ndim)
    by_device = {shard.device: shard for shard in leaf.addressable_shards}
    assert set(by_device) == set(s.devices)
    for i, device in enumerate(s.devices):
        shard = by_device[device]
        assert shard.data.shape == (1, 4, 2)
        np.testing.assert_array_equal(shard.data[0], np.arange(8 * i, 8 * i + 8).reshape(4, 2))


# --- a model evaluated through "pad" -------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["all_reduce", "strategy_reduce"])
def test_padded_evaluation_matches_single_device_accuracy(strategy, n, reduction):
    rng = np.random.default_rng(0)
    # Integer-valued float32 data: the matmul is exact, so the argmax is the same everywhere.
    x = rng.integers(-4, 5, size=(1000, 16)).astype(np.float32)
    labels = rng.integers(0, 4, size=(1000,))
    w = rng.integers(-3, 4, size=(16, 4)).astype(np.float32)
    expected = int(np.sum(np.argmax(x @ w, axis=1) == labels))

    def batches():
        for i in range(0, 1000, 96):
            yield {"x": x[i : i + 96], "label": labels[i : i + 96]}

    @jm.replicate(strategy=strategy)
    def correct(w, batch, mask):
        hits = (jnp.argmax(batch["x"] @ w, axis=1) == batch["label"]) & mask
        count = jnp.sum(hits.astype(jnp.int32))
        return jm.all_reduce("sum", count) if reduction == "all_reduce" else count

    w_mirrored = strategy.mirror(w)
    total = 0
    steps = 0
    for batch, mask in strategy.distribute_dataset(batches, remainder="pad"):
        out = correct(w_mirrored, batch, mask)
        if reduction == "all_reduce":
            total += int(strategy.read(out))
        else:
            assert isinstance(out, jm.PerReplica)
            total += int(strategy.reduce("sum", out))
        steps += 1
    assert steps == 11
    assert correct.num_compilations == 1  # the padded last batch has the same shapes
    assert total / 1000 == expected / 1000


# --- errors from the source and from arguments ---------------------------------------------------


@pytest.mark.parametrize("prefetch", [0, 2])
def test_source_exception_reaches_consumer_with_its_type(s, n, prefetch):
    def broken_source():
        yield np.zeros((n, 2))
        yield np.zeros((n, 2))
        raise KeyError("missing shard")

    seen = 0
    with pytest.raises(KeyError, match="missing shard") as info:
        for _ in s.distribute_dataset(broken_source, prefetch=prefetch):
            seen += 1
    assert seen == 2
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "broken_source" in frames  # the original traceback is kept


@pytest.mark.parametrize("bad", ["PAD", "truncate", None])
def test_invalid_remainder_is_a_value_error(s, bad):
    with pytest.raises(ValueError, match="remainder"):
        s.distribute_dataset([], remainder=bad)


def test_invalid_prefetch(s):
    with pytest.raises(ValueError, match="prefetch=-1"):
        s.distribute_dataset([], prefetch=-1)
    with pytest.raises(ValueError, match="prefetch=-1"):
        s.distribute_datasets_from_function(lambda ctx: [], prefetch=-1)
    with pytest.raises(TypeError, match="prefetch"):
        s.distribute_dataset([], prefetch=True)


def test_non_iterable_source_is_a_type_error(s):
    with pytest.raises(TypeError, match="iterable"):
        s.distribute_dataset(3)


def test_drop_warns_when_the_first_batch_cannot_be_complete(s, n):
    if n == 1:
        pytest.skip("every batch is a multiple of 1")
    with pytest.warns(UserWarning, match="will be dropped"):
        assert list(s.distribute_dataset([np.zeros((n + 1, 2))] * 2, remainder="drop")) == []


# --- threads -------------------------------------------------------------------------------------


def _source(n, count=50):
    def batches():
        for i in range(count):
            yield np.full((n, 4), i, np.float32)

    return batches


@pytest.mark.parametrize("how", ["close", "with", "dataset_close", "exhaustion", "gc", "error"])
def test_prefetch_thread_stops(s, n, how):
    start = threading.active_count()
    data = s.distribute_dataset(_source(n), remainder="drop", prefetch=2)
    if how == "close":
        it = iter(data)
        next(it)
        it.close()
        assert list(it) == []
    elif how == "with":
        with iter(data) as it:
            next(it)
    elif how == "dataset_close":
        it = iter(data)
        next(it)
        data.close()
        assert list(it) == []
    elif how == "exhaustion":
        assert len(list(data)) == 50
    elif how == "gc":
        it = iter(data)
        next(it)
        assert threading.active_count() == start + 1
        del it
        gc.collect()
    else:
        bad = s.distribute_dataset([np.zeros((n, 2)), np.zeros((2 * n, 2))], prefetch=2)
        with pytest.raises(ValueError):
            list(bad)
    # close() and exhaustion join the thread; gc runs the finalizer, which joins it too.
    assert threading.active_count() == start


def test_prefetch_zero_starts_no_thread(s, n):
    start = threading.active_count()
    it = iter(s.distribute_dataset(_source(n, 3), remainder="drop", prefetch=0))
    first = next(it)
    assert threading.active_count() == start
    assert float(np.asarray(first.values).max()) == 0.0
    assert len(list(it)) == 2


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread niceness is Linux's")
@pytest.mark.parametrize("prefetch", [0, 2])
def test_prefetch_thread_yields_the_cores_to_host_device_steps(s, n, prefetch):
    # On host devices the prefetch thread, and the source it runs, take niceness 19 so that
    # the step's compute threads go first; the consumer's thread keeps its priority.
    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    before = niceness()
    seen = []

    def source():
        for _ in range(3):
            seen.append(niceness())
            yield np.zeros((n, 2), np.float32)

    assert s.devices[0].platform == "cpu"
    with s.distribute_dataset(source, remainder="drop", prefetch=prefetch) as data:
        assert len(list(data)) == 3
    assert seen == [19] * 3 if prefetch else seen == [before] * 3
    assert niceness() == before


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread niceness is Linux's")
def test_prefetch_thread_keeps_its_priority_for_accelerator_steps():
    # An accelerator's step does not run on the host's cores: nothing to yield to.
    from types import SimpleNamespace

    from jmirror._input import DistributedDataset

    def source():
        yield os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    gpu_strategy = SimpleNamespace(devices=[SimpleNamespace(platform="gpu")], process_count=1)

    def open_elements(control, skip):  # one pass, as jmirror._input opens them
        return source()

    data = DistributedDataset(open_elements, 2, "test", gpu_strategy)  # type: ignore[arg-type]
    assert list(data) == [os.getpriority(os.PRIO_PROCESS, threading.get_native_id())]


def test_prefetch_stays_bounded(s, n):
    pulled = []

    def source():
        for i in range(20):
            pulled.append(i)
            yield np.zeros((n, 1))

    it = iter(s.distribute_dataset(source, remainder="drop", prefetch=3))
    next(it)
    for _ in range(500):  # let the thread run ahead as far as it may
        if len(pulled) >= 1 + 3:
            break
        threading.Event().wait(0.01)
    threading.Event().wait(0.1)
    assert len(pulled) == 1 + 3  # the consumed batch and `prefetch` more, no further
    it.close()


# --- re-iteration --------------------------------------------------------------------------------


@pytest.mark.parametrize("prefetch", [0, 2])
def test_reiteration_restarts_a_callable_source(s, n, prefetch):
    calls = []

    def source():
        calls.append(1)
        return _source(n, 3)()

    data = s.distribute_dataset(source, remainder="drop", prefetch=prefetch)
    first = [float(np.asarray(b.values)[0, 0, 0]) for b in data]
    second = [float(np.asarray(b.values)[0, 0, 0]) for b in data]
    assert first == second == [0.0, 1.0, 2.0]
    assert len(calls) == 2


def test_exhausted_one_shot_iterator_yields_nothing(s, n):
    data = s.distribute_dataset(_source(n, 3)(), remainder="drop")
    assert len(list(data)) == 3
    assert list(data) == []


# --- distribute_datasets_from_function -----------------------------------------------------------


@pytest.mark.parametrize("prefetch", [0, 2])
def test_datasets_from_function_deals_elements_in_order(s, n, prefetch):
    contexts = []

    def dataset_fn(ctx):
        contexts.append(ctx)
        return ({"v": np.full((2,), i, np.int32)} for i in range(3 * n))

    data = s.distribute_datasets_from_function(dataset_fn, prefetch=prefetch)
    for _ in range(2):  # each new iteration calls dataset_fn again
        steps = list(data)
        assert len(steps) == 3
        for step, batch in enumerate(steps):
            assert isinstance(batch, jm.PerReplica)
            assert batch.values["v"].shape == (n, 2)
            parts = s.local_results(batch)
            assert [int(p["v"][0]) for p in parts] == [step * n + r for r in range(n)]
    assert contexts == [jm.InputContext(1, 0, n)] * 2
    assert contexts[0].num_replicas_in_sync == n


def test_datasets_from_function_drops_a_short_final_group_with_a_warning(s, n):
    def dataset_fn(ctx):
        return [np.zeros((2,))] * (2 * n + 1)

    data = s.distribute_datasets_from_function(dataset_fn, prefetch=0)
    if n == 1:
        assert len(list(data)) == 3
        return
    with pytest.warns(UserWarning, match=rf"1 of the {n} per-replica batches"):
        assert len(list(data)) == 2


def test_datasets_from_function_needs_matching_shapes(s, n):
    if n == 1:
        pytest.skip("one element per step")

    def dataset_fn(ctx):
        return [np.zeros((2,)), np.zeros((3,))] * n

    with pytest.raises(ValueError, match="replica 1"):
        list(s.distribute_datasets_from_function(dataset_fn))


def test_input_context_per_replica_batch_size():
    ctx = jm.InputContext(num_replicas_in_sync=8)
    assert ctx.get_per_replica_batch_size(96) == 12
    with pytest.raises(ValueError, match="100.*num_replicas_in_sync=8"):
        ctx.get_per_replica_batch_size(100)
    assert jm.InputContext() == jm.InputContext(1, 0, 1)


# --- a run that may continue on fewer processes --------------------------------------------------


def test_an_elastic_run_refuses_a_global_batch_that_n_does_not_divide(n, monkeypatch):
    """Under `jmirror.launch --min-processes 3 --processes 4` a global batch that the N
    replicas do not divide is a ValueError at the first batch, before any step (padding it
    would change the global batch from one start to the next); one that N divides is split
    as ever, and outside such a run the batch is padded as section 7 says."""
    if n == 1:
        pytest.skip("one replica divides every batch")
    strategy = jm.MirroredStrategy()
    uneven = [np.arange(n + 1, dtype=np.float32)]
    monkeypatch.setenv(jm.distributed.ENV_PROCESS_COUNTS, "3:4")
    data = strategy.distribute_dataset(uneven, remainder="pad", prefetch=0)
    with pytest.raises(ValueError, match=rf"{n + 1} examples.*N={n}.*multiple of {12 * n}"):
        next(iter(data))
    even = [np.arange(2 * n, dtype=np.float32)]
    (batch,) = list(strategy.distribute_dataset(even, remainder="drop", prefetch=0))
    np.testing.assert_array_equal(np.asarray(batch.values).ravel(), np.arange(2 * n))
    monkeypatch.delenv(jm.distributed.ENV_PROCESS_COUNTS)
    ((padded, mask),) = list(strategy.distribute_dataset(uneven, remainder="pad", prefetch=0))
    assert int(np.asarray(mask.values).sum()) == n + 1


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_numpy_batches_of_jax_only_dtypes_are_batches(s, n, prefetch, dtype):
    # What jax.device_get gives for bfloat16: numpy holds ml_dtypes' types as raw records.
    batch = np.linspace(-2, 2, 2 * n * 3).reshape(2 * n, 3).astype(dtype)
    (got,) = list(s.distribute_dataset([batch], remainder="drop", prefetch=prefetch))
    assert got.values.dtype == dtype
    np.testing.assert_array_equal(np.asarray(_concat(s, got)), batch)
