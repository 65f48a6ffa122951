"""jmirror's uses of JAX internals, each with its public fallback.

1. `put_rows`: placing row i of a host array on device i in one call.
2. `distributed_client`: the client of JAX's coordination service (key-value store, barriers);
   `distributed_configuration`: the coordinator, count and index it was started with.
3. `write_cache_from_every_process`: JAX's persistent compilation cache written by every
   process of a run on XLA:CPU, not by process 0 alone.
4. `weakly_typed`: a traced value made weakly typed again after a collective.

**put_rows.**

`distribute_dataset` places every leaf of every batch, often from a background thread while
the replicated step keeps the host cores busy, so the host time per leaf is the input
pipeline's cost. The public `jax.make_array_from_callback` spends most of it in Python (one
callback, dtype check and validation per device) before its single C++ call,
`jaxlib.xla_client.batched_device_put`; calling that directly took about half the time on 8
XLA:CPU host devices (see benchmarks/RESULTS.md). The result is the same array: same shape,
canonical dtype, sharding and committed placement.

It is also always a copy. On CPU, JAX places a 64-byte-aligned host buffer without copying it
(measured with JAX 0.10.2 for `jax.device_put`, even with `may_alias=False`, and for
`jax.make_array_from_callback`), so a loader that refills one buffer per batch would change
batches already prefetched. `put_rows` asks for `IMMUTABLE_ONLY_DURING_CALL`: the rows are
copied before it returns, and the caller may reuse the buffer at once.

Only `put_rows` touches the internal. When `batched_device_put` is missing, it uses the public
path; when it exists but rejects the call (a jaxlib whose signature changed), it warns once and
uses the public path from then on.

**distributed_client.** `jax.distributed` keeps the coordination service's client in an
internal and does not expose it (orbax reads the same internal); `jmirror._deadline` uses it to
name the processes that did not arrive at a wait. It returns None where the internal is missing
or the runtime is not started.

**write_cache_from_every_process.** JAX writes its persistent compilation cache from process 0
only, expecting the other processes to find the same entries; on XLA:CPU each process's keys
hash its own CPU topology, so no other process ever finds one, and after every restart the
other processes compile each step again while process 0 waits for them in its first collective.
JAX has no public setting for it (`jax_share_binary_between_hosts` waits on the same
per-process key). The function wraps JAX's cache write (`jax._src.compiler._cache_write`) so
that on XLA:CPU every process writes its own entries, with JAX's own threshold and error
handling; process 0, other backends (whose processes share keys) and programs with host
callbacks keep JAX's behaviour. Where the internal is missing or its signature changed, it
does nothing and returns False: the other processes compile again, as without it.

**weakly_typed.** JAX's collectives (`psum`, `pmean`, `pmax`, `pmin`) return strongly typed
values for weakly typed operands, where every other elementwise operation keeps the weak type.
A weakly typed parameter (`eqx.nn.PReLU(0.2)`'s slope, any leaf made from a Python float) whose
gradient is averaged across replicas would come back strongly typed from the first step:
the step compiles a second time for the new input type, and the parameter then promotes
differently from one device's (a strong float32 times bfloat16 gives float32, a weak one
bfloat16). JAX's `convert_element_type` with `weak_type=True` is internal (the public
`jax.lax.convert_element_type` always gives a strong type); with the dtype unchanged it lowers
to an identity convert, which XLA removes. Where it is missing, values stay strongly typed.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import warnings
from typing import Any

import jax
import numpy as np
from jax.core import ShapedArray
from jaxlib import xla_client

_batched_device_put = getattr(xla_client, "batched_device_put", None)
_COPY_DURING_CALL = getattr(
    getattr(xla_client, "HostBufferSemantics", None), "IMMUTABLE_ONLY_DURING_CALL", None
)
if _COPY_DURING_CALL is None:
    _batched_device_put = None


@functools.lru_cache(maxsize=64)
def _row_devices(sharding: jax.sharding.Sharding, rows: int) -> tuple[Any, ...] | None:
    """Returns the device holding each row of a `(rows, ...)` array, or None if not one row each."""
    if not isinstance(sharding, jax.sharding.NamedSharding) or sharding.num_devices != rows:
        return None
    indices = sharding.addressable_devices_indices_map((rows,))
    by_row: dict[int, Any] = {}
    for device, index in indices.items():
        if not index:
            return None
        row = index[0]
        start = 0 if row.start is None else row.start
        stop = rows if row.stop is None else row.stop
        if stop - start != 1 or start in by_row:
            return None
        by_row[start] = device
    if sorted(by_row) != list(range(rows)):
        return None
    return tuple(by_row[i] for i in range(rows))


def put_rows(x: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """Returns `x` placed with `sharding`, as `jax.make_array_from_callback` would place it.

    Args:
      x: a host array of shape `(N, ...)`.
      sharding: where it goes; the fast path applies when it puts row i on the i-th of N
        devices (a strategy's stacked sharding), any other sharding takes the public path.

    Returns:
      A committed `jax.Array` with `sharding` and `x`'s canonical dtype (float64 becomes
      float32 unless x64 is enabled), holding a copy of `x` made before returning.
    """
    global _batched_device_put
    devices = None if x.ndim == 0 else _row_devices(sharding, x.shape[0])
    if _batched_device_put is None or devices is None:
        return _put_public(x, sharding)
    dtype = jax.dtypes.canonicalize_dtype(x.dtype)
    if x.dtype != dtype:
        x = x.astype(dtype)
    aval = ShapedArray(x.shape, dtype)
    try:
        return _batched_device_put(
            aval, sharding, list(x[:, None]), list(devices), True, True, _COPY_DURING_CALL
        )
    except TypeError as e:
        _batched_device_put = None
        version = importlib.metadata.version("jaxlib")
        warnings.warn(
            f"jmirror: jaxlib {version}'s xla_client.batched_device_put rejected the call "
            f"jmirror makes to place input batches ({e}); jmirror places them with "
            "jax.make_array_from_callback from now on, which is slower but gives the same "
            "arrays. Please report this with your jax and jaxlib versions.",
            RuntimeWarning,
            stacklevel=2,
        )
        return _put_public(x, sharding)


def _put_public(x: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    # Each piece is copied first: the public call may alias an aligned host buffer.
    return jax.make_array_from_callback(x.shape, sharding, lambda index: np.array(x[index]))


def distributed_configuration() -> tuple[str | None, int | None, int | None] | None:
    """Returns the coordinator address, process count and index `jax.distributed.initialize`
    uses (also those its cluster detection found), or None where the internal is missing."""
    try:
        from jax._src import distributed  # the internal, read only here
    except ImportError:
        return None
    state = getattr(distributed, "global_state", None)
    if state is None:
        return None
    found = [getattr(state, name, None) for name in ("coordinator_address", "num_processes")]
    return found[0], found[1], getattr(state, "process_id", None)


def distributed_client() -> Any:
    """Returns the client of JAX's coordination service, or None (one process, or no such
    internal)."""
    try:
        from jax._src import distributed  # the internal, read only here
    except ImportError:
        return None
    state = getattr(distributed, "global_state", None)
    return getattr(state, "client", None)


_MIN_COMPILE_TIME = "jax_persistent_cache_min_compile_time_secs"  # JAX's threshold, honoured
_CACHE_WRITE_PARAMETERS = (
    "cache_key",
    "compile_time_secs",
    "module_name",
    "backend",
    "executable",
    "host_callbacks",
)


def write_cache_from_every_process() -> bool:
    """Makes every process of a run write JAX's persistent compilation cache on XLA:CPU.

    Installs once per process; later calls do nothing. The cache itself stays JAX's: it writes
    only where JAX would look for the entry (`jax_compilation_cache_dir` set, the program not
    below `jax_persistent_cache_min_compile_time_secs`).

    Returns:
      Whether the write is wrapped: False where JAX's internal is missing or changed.
    """
    try:
        from jax._src import compilation_cache, compiler, distributed  # the internals, here only
    except ImportError:
        return False
    write = getattr(compiler, "_cache_write", None)
    put = getattr(compilation_cache, "put_executable_and_time", None)
    if write is None or put is None:
        return False
    if getattr(write, "_jmirror_every_process", False):
        return True
    if tuple(inspect.signature(write).parameters) != _CACHE_WRITE_PARAMETERS:
        return False

    @functools.wraps(write)
    def write_from_every_process(
        cache_key, compile_time_secs, module_name, backend, executable, host_callbacks
    ):
        process = getattr(getattr(distributed, "global_state", None), "process_id", 0)
        if process == 0 or host_callbacks or getattr(backend, "platform", None) != "cpu":
            return write(
                cache_key, compile_time_secs, module_name, backend, executable, host_callbacks
            )
        if compile_time_secs < getattr(jax.config, _MIN_COMPILE_TIME):
            return None
        try:
            put(cache_key, module_name, executable, backend, int(compile_time_secs))
        except Exception as e:  # JAX warns and goes on too: the step is compiled either way
            warnings.warn(
                f"jmirror: could not write the persistent compilation cache entry for "
                f"'{module_name}' from process {process}: {type(e).__name__}: {e}. "
                "This process compiles it again after a restart.",
                RuntimeWarning,
                stacklevel=2,
            )
        return None

    write_from_every_process._jmirror_every_process = True  # type: ignore[attr-defined]
    compiler._cache_write = write_from_every_process
    return True


def _internal_convert() -> Any:
    """Returns JAX's internal `_convert_element_type` where it takes `weak_type`, else None."""
    try:
        from jax._src.lax.lax import _convert_element_type  # the internal, here only
    except ImportError:
        return None
    try:
        parameters = inspect.signature(_convert_element_type).parameters
    except (TypeError, ValueError):
        return None
    return _convert_element_type if "weak_type" in parameters else None


_convert_element_type = _internal_convert()


def weakly_typed(x: jax.Array) -> jax.Array:
    """Returns `x` (a traced or concrete array) weakly typed, with its dtype; `x` itself where
    JAX's internal is missing."""
    if _convert_element_type is None:
        return x
    return _convert_element_type(x, x.dtype, weak_type=True)
