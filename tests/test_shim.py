"""`jmirror._shim.put_rows` against the public `jax.make_array_from_callback` it stands in for."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmirror as jm
from jmirror import _shim

DTYPES = [np.float32, np.float64, np.int64, np.int8, np.uint8, np.bool_, np.float16, jnp.bfloat16]
TRAILING = [(), (3,), (2, 5)]


def _host(n: int, trailing: tuple[int, ...], dtype) -> np.ndarray:
    values = np.arange(n * int(np.prod(trailing, dtype=int))).reshape((n,) + trailing) % 7
    return values.astype(dtype)


def _assert_same_array(got: jax.Array, want: jax.Array) -> None:
    assert got.shape == want.shape
    assert got.dtype == want.dtype
    assert got.sharding == want.sharding
    assert got.committed and want.committed
    for a, b in zip(got.addressable_shards, want.addressable_shards, strict=True):
        assert a.device == b.device
        assert a.index == b.index
        np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("trailing", TRAILING)
def test_put_rows_matches_make_array_from_callback(n, dtype, trailing):
    sharding = jm.MirroredStrategy().topology.stacked
    x = _host(n, trailing, dtype)
    want = jax.make_array_from_callback(x.shape, sharding, x.__getitem__)
    _assert_same_array(_shim.put_rows(x, sharding), want)
    assert want.dtype == jax.dtypes.canonicalize_dtype(dtype)  # float64 -> float32 without x64


@pytest.mark.parametrize("dtype", [np.float64, np.int64, np.complex128])
def test_put_rows_keeps_64_bit_dtypes_under_x64(n, dtype):
    sharding = jm.MirroredStrategy().topology.stacked
    x = _host(n, (3,), dtype)
    with jax.enable_x64(True):
        want = jax.make_array_from_callback(x.shape, sharding, x.__getitem__)
        got = _shim.put_rows(x, sharding)
    assert got.dtype == np.dtype(dtype)
    _assert_same_array(got, want)


def test_put_rows_row_i_lands_on_device_i_only(n):
    strategy = jm.MirroredStrategy()
    x = _host(n, (4,), np.float32)
    placed = _shim.put_rows(x, strategy.topology.stacked)
    for i, device in enumerate(strategy.devices):
        (shard,) = [s for s in placed.addressable_shards if s.device == device]
        np.testing.assert_array_equal(np.asarray(shard.data), x[i : i + 1])


def test_put_rows_of_a_strided_view(n):
    sharding = jm.MirroredStrategy().topology.stacked
    x = _host(n, (6, 4), np.float32)[:, ::2, ::-1]  # not contiguous
    want = jax.make_array_from_callback(x.shape, sharding, x.__getitem__)
    _assert_same_array(_shim.put_rows(x, sharding), want)


def _aligned_zeros(shape: tuple[int, ...], offset: int) -> np.ndarray:
    """float32 zeros whose data starts `offset` bytes past a 64-byte boundary."""
    size = int(np.prod(shape)) * 4
    raw = np.zeros(size + 128, np.uint8)
    start = -raw.ctypes.data % 64 + offset
    return raw[start : start + size].view(np.float32).reshape(shape)


@pytest.mark.parametrize("public", [False, True])
@pytest.mark.parametrize("offset", [0, 16])
def test_put_rows_copies_the_host_buffer(n, monkeypatch, public, offset):
    # JAX on CPU places an aligned host buffer without a copy; a loader that refills its
    # buffer must not change batches already placed.
    if public:
        monkeypatch.setattr(_shim, "_batched_device_put", None)
    x = _aligned_zeros((n, 1024), offset)
    assert x.ctypes.data % 64 == offset
    placed = _shim.put_rows(x, jm.MirroredStrategy().topology.stacked)
    placed.block_until_ready()
    x[:] = 1.0
    np.testing.assert_array_equal(np.asarray(placed), 0.0)


@pytest.mark.parametrize("kind", ["replicated", "single_device", "other_row_count"])
def test_other_shardings_take_the_public_path(n, kind):
    strategy = jm.MirroredStrategy()
    sharding = {
        "replicated": strategy.topology.mirrored,
        "single_device": jax.sharding.SingleDeviceSharding(jax.devices()[0]),
        "other_row_count": strategy.topology.stacked,
    }[kind]
    rows = 2 * n if kind == "other_row_count" else n
    x = _host(rows, (3,), np.int32)
    want = jax.make_array_from_callback(x.shape, sharding, x.__getitem__)
    _assert_same_array(_shim.put_rows(x, sharding), want)


def test_without_the_internal_the_public_path_gives_the_same_array(n, monkeypatch):
    monkeypatch.setattr(_shim, "_batched_device_put", None)
    sharding = jm.MirroredStrategy().topology.stacked
    x = _host(n, (3,), np.float32)
    want = jax.make_array_from_callback(x.shape, sharding, x.__getitem__)
    _assert_same_array(_shim.put_rows(x, sharding), want)


def test_an_internal_that_rejects_the_call_warns_once_then_uses_the_public_path(n, monkeypatch):
    calls = []

    def changed_signature(*args):
        calls.append(args)
        raise TypeError("batched_device_put(): incompatible function arguments")

    monkeypatch.setattr(_shim, "_batched_device_put", changed_signature)
    sharding = jm.MirroredStrategy().topology.stacked
    x = _host(n, (3,), np.float32)
    want = jax.make_array_from_callback(x.shape, sharding, x.__getitem__)
    with pytest.warns(RuntimeWarning, match="make_array_from_callback from now on"):
        _assert_same_array(_shim.put_rows(x, sharding), want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _assert_same_array(_shim.put_rows(x, sharding), want)
    assert len(calls) == 1


class _Backend:
    def __init__(self, platform: str):
        self.platform = platform


def _fake_cache_internals(monkeypatch):
    """JAX's cache write and put replaced by recorders; returns (writes, puts)."""
    from jax._src import compilation_cache, compiler

    writes, puts = [], []

    def _cache_write(
        cache_key, compile_time_secs, module_name, backend, executable, host_callbacks
    ):
        writes.append(cache_key)

    def put_executable_and_time(cache_key, module_name, executable, backend, compile_time):
        puts.append(cache_key)

    monkeypatch.setattr(compiler, "_cache_write", _cache_write)
    monkeypatch.setattr(compilation_cache, "put_executable_and_time", put_executable_and_time)
    return writes, puts


def test_every_process_writes_its_own_cache_entries_on_cpu(monkeypatch):
    writes, puts = _fake_cache_internals(monkeypatch)
    threshold = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    try:
        _every_process_writes(writes, puts, monkeypatch)
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", threshold)


def _every_process_writes(writes, puts, monkeypatch):
    from jax._src import compiler, distributed

    assert _shim.write_cache_from_every_process()
    write = compiler._cache_write
    assert _shim.write_cache_from_every_process() and compiler._cache_write is write  # once

    def compiled(key, backend="cpu", seconds=2.0, callbacks=()):
        write(key, seconds, "step", _Backend(backend), object(), callbacks)

    monkeypatch.setattr(distributed.global_state, "process_id", 0)
    compiled("process 0: JAX's own write")
    monkeypatch.setattr(distributed.global_state, "process_id", 1)
    compiled("process 1, cpu")
    compiled("process 1, gpu", backend="gpu")
    compiled("process 1, host callbacks", callbacks=(print,))
    compiled("process 1, quick", seconds=0.5)
    assert writes == [
        "process 0: JAX's own write",
        "process 1, gpu",
        "process 1, host callbacks",
    ]
    assert puts == ["process 1, cpu"]


def test_a_changed_cache_write_is_left_alone(monkeypatch):
    from jax._src import compiler

    def _cache_write(cache_key, executable):  # another JAX's signature
        pass

    monkeypatch.setattr(compiler, "_cache_write", _cache_write)
    assert not _shim.write_cache_from_every_process()
    assert compiler._cache_write is _cache_write


# --- weakly_typed ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
def test_weakly_typed_keeps_dtype_and_values_traced_or_not(dtype):
    x = jnp.arange(3).astype(dtype)
    assert not x.aval.weak_type
    for out in (_shim.weakly_typed(x), jax.jit(_shim.weakly_typed)(x)):
        assert out.aval.weak_type and out.dtype == dtype
        np.testing.assert_array_equal(np.asarray(out), np.asarray(x))
    # Weakly typed, it promotes as a Python scalar would: to the other operand's dtype.
    assert (_shim.weakly_typed(jnp.float32(2.0)) * jnp.ones(2, jnp.bfloat16)).dtype == jnp.bfloat16
    # An identity convert in the lowered program, which XLA removes: none in the compiled one.
    assert "convert" not in jax.jit(_shim.weakly_typed).lower(x).compile().as_text()


def test_without_the_internal_weakly_typed_returns_its_argument(monkeypatch):
    monkeypatch.setattr(_shim, "_convert_element_type", None)
    x = jnp.ones(3)
    assert _shim.weakly_typed(x) is x
