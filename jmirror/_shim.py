"""jmirror's uses of JAX internals, each with its public fallback.

1. `put_rows`: placing row i of a host array on device i in one call.
2. `distributed_client`: the client of JAX's coordination service (key-value store, barriers);
   `distributed_configuration`: the coordinator, count and index it was started with.

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
"""

from __future__ import annotations

import functools
import importlib.metadata
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
    """The coordinator address, process count and index `jax.distributed.initialize` is using
    (also those its cluster detection found), or None where the internal is missing."""
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
