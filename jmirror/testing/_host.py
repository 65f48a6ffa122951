"""Setting the number of XLA:CPU host devices before JAX starts."""

from __future__ import annotations

import jax


def set_host_device_count(n: int) -> None:
    """Makes JAX see `n` CPU host devices, so that data parallelism can run on a CPU.

    Call it before anything touches JAX's devices (`jax.devices()`, creating an array, ...):
    at the top of a script, in a `conftest.py`, or in the first notebook cell. Calling it again
    with the count JAX already has is a no-op. No XLA:CPU threading flag made host devices
    faster in jmirror's measurements (benchmarks/RESULTS.md), so none is set here; what did
    help, skipping buffer donation, `MirroredStrategy` applies on CPU host devices itself.

    Args:
      n: the number of host devices, at least 1.

    Raises:
      RuntimeError: when JAX has already started with another device count; restart the
        process (or the notebook kernel), or use `jmirror.testing.EmulatedStrategy(n)`, which
        runs n replicas on one device without a restart.
      ValueError: when `n < 1`.

    Example:
        >>> import jax, jmirror.testing as jmt
        >>> jmt.set_host_device_count(jax.device_count())  # already started: same count is fine
    """
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"set_host_device_count expects an int, got {n!r}.")
    if n < 1:
        raise ValueError(f"set_host_device_count({n}) needs at least one device.")
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        have = len(jax.devices("cpu"))
        if have == n:
            return
        raise RuntimeError(
            f"set_host_device_count({n}) is too late: JAX has already started with {have} CPU "
            "device(s), and the count cannot change in a running process. Call it before "
            "anything touches JAX's devices (restart the process or the notebook kernel and "
            "make it the first call), or use jmirror.testing.EmulatedStrategy("
            f"{n}), which runs {n} replicas on one device without a restart."
        ) from None
