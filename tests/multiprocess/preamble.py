"""The start that every worker script of this directory shares: `join` the run.

A worker imports what it needs (importing JAX, flax or `training.py` touches no device), then
calls `join(...)` before anything touches a device:

    from preamble import join

    jm = join(watchdog_s=90)

The directory is on `sys.path` already: a script's own directory is its first entry, under
`python script.py` and under `python -m jmirror.launch` alike (and `-m worker` runs from it).
"""

import faulthandler
from types import ModuleType

import jax

import jmirror as jm


def join(
    *args: object,
    watchdog_s: float | None = None,
    devices: int | None = None,
    **kwargs: object,
) -> ModuleType:
    """Joins the multi-process run: `jm.distributed.initialize(*args, **kwargs)`.

    Args:
      *args: `initialize`'s positional arguments (coordinator, count, index); none to read
        the launcher's `JMIRROR_*` variables.
      watchdog_s: were the process still running this many seconds from now (stuck), print
        every thread's stack and end it, so that a test fails saying where it stood instead
        of at its own timeout. None: no watchdog.
      devices: the number of XLA:CPU host devices of this process, for a worker started
        without the launcher (which sets them through `JMIRROR_DEVICES_PER_PROCESS`).
      **kwargs: `initialize`'s keyword arguments (e.g. `timeout_s`).

    Returns:
      The `jmirror` module, joined.
    """
    if watchdog_s is not None:
        faulthandler.dump_traceback_later(watchdog_s, exit=True)
    if devices is not None:
        jax.config.update("jax_num_cpu_devices", devices)
    jm.distributed.initialize(*args, **kwargs)
    return jm
