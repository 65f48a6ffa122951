"""Several processes on JAX's own multi-controller runtime: `jm.distributed.initialize`.

jmirror adds no transport of its own. `initialize` starts `jax.distributed` (a coordination
service in process 0 that every process connects to, heartbeats and a key-value store) with
CPU collectives through gloo (a run of one process keeps XLA's own, faster collectives between
its devices), from one of three sources, in this order:

1. the arguments given to `initialize`;
2. the environment set by `python -m jmirror.launch` (or by any launcher of yours):
   `JMIRROR_COORDINATOR` (`host:port` of process 0's coordination service),
   `JMIRROR_NUM_PROCESSES`, `JMIRROR_PROCESS_ID` and, optionally,
   `JMIRROR_DEVICES_PER_PROCESS` (the number of XLA:CPU host devices of each process);
3. JAX's own cluster detection, used only when a cluster is detected, in JAX's order: an
   Open MPI job of several ranks (`mpirun` of Open MPI 4; also inside a SLURM step, as in
   `srun -n1 mpirun -np 2`), a SLURM job step of several tasks, or a Kubernetes Indexed Job
   or JobSet. jmirror reads the coordinator's address (`host:port`: mpirun's host, or the
   step's first node, and a port derived from the job id, or `JAX_COORDINATOR_PORT`), the
   process count and index from the cluster's variables as JAX does, before joining, so that
   its checks and errors name them (Kubernetes, which JAX asks through its API, is left to
   JAX). On GPUs a process alone on its host uses every GPU of the host; several processes on
   a host use one GPU each, by local index (JAX's `local_device_ids=[local id]`, which JAX
   would also impose on a process alone on its host).

With none of them it is one process and `initialize` does nothing. The launcher also sets
`JMIRROR_RESTART` (`ENV_RESTART`): how many times it restarted the run before this start
(`--max-restarts`), `"0"` the first time; `initialize` does not need it. With
`--min-processes M` it sets `JMIRROR_PROCESS_COUNTS` (`ENV_PROCESS_COUNTS`) to `"M:P"`.

The configuration is checked before JAX is asked, so that a mistake is an error at once (not
a wait of up to 300 s for a coordinator, or an `IndexError` from JAX): an address that is not
`host:port` with a port in 1-65535, or a host that does not resolve, is a `ValueError` naming
the argument or variable, its value and the fix; so are `JMIRROR_NUM_PROCESSES` /
`JMIRROR_PROCESS_ID` without `JMIRROR_COORDINATOR` and the reverse. On process 0, a coordinator
port that another program already listens on is an `OSError` (`EADDRINUSE`) naming the port;
the other processes, which connect to it, raise the same within seconds when what answers
there is not a gRPC server (JAX's coordination service is one).

Lost processes: JAX's coordination service ends every process of the run when one stops
sending heartbeats for `heartbeat_timeout_s` seconds. jmirror sets 10 s instead of JAX's
100 s so that a process killed while the others wait in a collective ends them within about
10 s: measured with JAX 0.10.2 (2 or 3 processes × 4 host devices in a loop of cross-process
sums, one SIGKILLed), every survivor ended by itself in 9-11 s, with SIGABRT (exit code 134),
printing JAX's `Terminating process because the JAX distributed service detected fatal
errors` and `The following tasks are unhealthy (stopped sending heartbeats):` followed by the
lost process's index (JAX's task number is the process index). When the lost process is
process 0, which runs the coordination service, the others end within about a second and
the message says the leader task (process 0) died. A gloo collective waiting for the lost
peer does not end by itself; the coordination service's abort is what ends it.

Security: the coordination service and gloo have no authentication and no encryption. Anyone
who can reach their ports can join or disrupt the run: run several machines on a private
network only.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import signal
import sys
import time

import jax

from jmirror import _cluster_config, _deadline, _shim
from jmirror._cluster_config import (
    ENV_COORDINATOR,
    ENV_DEVICES_PER_PROCESS,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_COUNTS,
    ENV_PROCESS_ID,
    ENV_RESTART,
)

__all__ = [
    "ENV_COORDINATOR",
    "ENV_DEVICES_PER_PROCESS",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_COUNTS",
    "ENV_PROCESS_ID",
    "ENV_RESTART",
    "check_initialized",
    "initialize",
    "is_initialized",
]

_TOO_LATE = (
    "jm.distributed.initialize() must run before anything touches a device, but JAX's backends "
    "are already initialized (by a computation, an array, jax.devices(), ...). Found: {what}. "
    "Call jm.distributed.initialize() first thing in the program, right after the imports."
)


_initialized: _cluster_config.Request | None = None


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    heartbeat_timeout_s: int = 10,
    timeout_s: float | None = 300,
) -> None:
    """Start JAX's multi-process runtime for this process, or do nothing when it is alone.

    Takes each of `coordinator_address`, `num_processes` and `process_id` from the arguments,
    else from the environment set by `python -m jmirror.launch` (`JMIRROR_*`, see the module
    docstring), else takes them from a detected Open MPI, SLURM or Kubernetes cluster as
    JAX's detection would. It then selects gloo for CPU collectives and calls
    `jax.distributed.initialize`.
    With no arguments, no launcher and no cluster it is one process and returns at once.

    Every process of the run must call it, before anything touches a device. Calling it again
    with the same configuration does nothing.

    In a run of several processes, an uncaught exception ends its process at once (exit code
    1, after printing it), without the `atexit` handlers: JAX's exit hook would otherwise keep
    it waiting up to 300 s for the other processes, which wait for it in their next
    collective. They are then ended within `heartbeat_timeout_s`, naming it. `sys.exit(code)`
    still waits in JAX's exit hook (except under `python -m jmirror.launch`, which stops every
    process): raise an exception to end one process of a run.

    A coordinator on a loopback address (`127.0.0.1:port`, `localhost:port`) binds that address
    only; any other binds every interface of process 0 on its port (JAX's default; set
    `JAX_COORDINATOR_BIND_ADDRESS` to narrow it). The runtime has no authentication: run it on
    a private network.

    Args:
      coordinator_address: `host:port` of process 0's coordination service, which process 0
        starts and every process connects to.
      num_processes: how many processes the run has.
      process_id: this process's index, `0 <= process_id < num_processes`.
      heartbeat_timeout_s: seconds after which a process that stopped sending heartbeats is
        declared lost, and JAX's coordination service ends every other process with an error
        naming it. 10 (JAX's default is 100) so that a killed process never leaves the others
        waiting in a collective for long; raise it if a process may legitimately stall longer
        (a very slow first compilation on an overloaded machine, swapping).
      timeout_s: how long to wait for every process to join: a process that has not called
        `initialize` (or cannot reach the coordinator) `timeout_s` seconds after this one did
        ends this one with an error on stderr naming it, and exit status 1. None waits as
        long as JAX does (300 s, then it aborts). It is also the `timeout_s` of the strategy
        that `jm.get_strategy()` makes when none is current in a run of several processes
        (what `jm.checkpoint.save` and a `CheckpointManager` use without `strategy=`).

    Raises:
      RuntimeError: JAX's backends are already initialized (something touched a device
        first), or `initialize` already ran with another configuration, or
        `jax.distributed.initialize` was already called directly.
      ValueError: an argument or a `JMIRROR_*` variable is out of range or malformed (an
        address that is not `host:port` with a port in 1-65535, a host that does not
        resolve), or only some of the three were given outside a cluster.
      TypeError: an argument has the wrong type.
      OSError: the coordinator's port is already in use (errno `EADDRINUSE`): on process 0,
        found free of listeners before JAX starts; on the others, held by a program that is
        not JAX's coordination service.

    Example:
      Alone (no arguments, no launcher, no cluster), it does nothing:

      >>> import jmirror as jm
      >>> jm.distributed.initialize()
      >>> jm.distributed.is_initialized(), jax.process_count()
      (True, 1)

      Each process of a run on two machines calls, with its own `process_id`:

      >>> jm.distributed.initialize("10.0.0.1:1234", 2, process_id=0)  # doctest: +SKIP
    """
    global _initialized
    timeout = _deadline.check_timeout(timeout_s, "jm.distributed.initialize")
    request = _cluster_config.resolve(
        coordinator_address, num_processes, process_id, heartbeat_timeout_s
    )
    if _initialized is not None:
        if request == _initialized:
            return
        raise RuntimeError(
            "jm.distributed.initialize() was already called with another configuration: "
            f"first {_cluster_config.describe(_initialized)}, now "
            f"{_cluster_config.describe(request)}. Call it once, first thing in the program, "
            "with the same arguments on every call."
        )
    if request.source == "one process":
        _initialized = request
        return
    if jax.distributed.is_initialized():
        raise RuntimeError(
            "jm.distributed.initialize() found JAX's distributed runtime already started by a "
            "direct call of jax.distributed.initialize(). Call one of them, not both: "
            "jm.distributed.initialize() also selects gloo and a short heartbeat timeout."
        )
    _cluster_config.check_port_free(request)
    _check_backends_not_initialized(_cluster_config.describe(request))
    _cluster_config.check_coordinator_port(request)
    if request.devices_per_process is not None:
        jax.config.update("jax_num_cpu_devices", request.devices_per_process)
    # One process needs no cross-process collectives: XLA's own, between the threads of its
    # devices, are several times faster than gloo's over loopback TCP (JAX picks gloo whenever
    # its distributed runtime is up).
    collectives = "gloo" if request.num_processes != 1 else None
    jax.config.update("jax_cpu_collectives_implementation", collectives)
    _join(request, timeout)
    _check_hosts_reachable(request, timeout)
    global _sigterm_after_initialize, _timeout_s
    _sigterm_after_initialize = signal.getsignal(signal.SIGTERM)
    _timeout_s = timeout
    if jax.process_count() > 1:
        sys.excepthook = _exit_at_once(sys.excepthook, request.heartbeat_timeout_s + 5)
        # A restart then finds its compiled steps on every process, not on process 0 alone.
        _shim.write_cache_from_every_process()
    _initialized = request


def _join(request: _cluster_config.Request, timeout_s: float | None) -> None:
    """`jax.distributed.initialize`, its wait for the other processes bounded by `timeout_s`.

    JAX's own bound (`initialization_timeout`) aborts the process with `DEADLINE_EXCEEDED`
    naming an RPC; jmirror's comes first and names the processes that did not join.
    """
    # JAX's default is 300 s; with jmirror's bound, JAX's comes a minute later.
    jax_timeout = 300 if timeout_s is None else math.ceil(timeout_s) + 60
    method, local_ids = None, None
    if not request.jax_detects:
        # Everything is known; JAX's detection would only restrict each process of a detected
        # cluster to one GPU (`local_device_ids=[local id]`), also when it is alone on its host.
        method = "deactivate"
        if request.local_device_ids is not None:
            local_ids = list(request.local_device_ids)
    with _deadline.bounded(
        "jm.distributed.initialize()",
        timeout_s,
        setting="jm.distributed.initialize",
        missing=lambda: _not_joined(request),
    ):
        jax.distributed.initialize(
            request.coordinator_address,
            request.num_processes,
            request.process_id,
            heartbeat_timeout_seconds=request.heartbeat_timeout_s,
            coordinator_bind_address=_cluster_config.bind_address(request.coordinator_address),
            initialization_timeout=jax_timeout,
            local_device_ids=local_ids,
            cluster_detection_method=method,
        )


def _check_hosts_reachable(request: _cluster_config.Request, timeout_s: float | None) -> None:
    """Returns every process's host name and address, exchanged through the coordination service's
    key-value store before gloo starts: several hosts with a host name on loopback is an
    `OSError` on every process (they all decide on the same list), not gloo's abort later.

    A loopback coordinator means one host: nothing to exchange.
    """
    if jax.process_count() < 2 or not _cluster_config.reaches_other_hosts(
        request.coordinator_address
    ):
        return
    client = _shim.distributed_client()
    if client is None:
        return  # no client to ask: gloo will report what it finds
    me = _cluster_config.this_host(request.coordinator_address)
    client.key_value_set(f"{_HOSTS_KEY}/{jax.process_index()}", json.dumps(me.__dict__))
    wait_ms = int(1000 * (300 if timeout_s is None else timeout_s))
    hosts = [
        _cluster_config.HostAddress(
            **json.loads(client.blocking_key_value_get(f"{_HOSTS_KEY}/{i}", wait_ms))
        )
        for i in range(jax.process_count())
    ]
    message = _cluster_config.loopback_hostname_error(hosts)
    if message is not None:
        jax.distributed.shutdown()  # every process does: its barrier does not wait long
        raise OSError(message)


_HOSTS_KEY = "jmirror/hosts"


def _not_joined(request: _cluster_config.Request) -> str:
    """Returns who may be missing while `jax.distributed.initialize` waits (none can be asked)."""
    address, count, me = _shim.distributed_configuration() or (None, None, None)
    # What jmirror worked out, else what JAX's own detection found (Kubernetes).
    address = request.coordinator_address or address
    count = request.num_processes if request.num_processes is not None else count
    me = request.process_id if request.process_id is not None else me
    where = f"the coordinator at {address or '(not found yet)'}"
    origin = f" (from {request.origin})" if request.origin else ""
    if me is None or count is None:
        return f"jmirror: not every process of the run has joined {where}{origin}."
    others = [p for p in range(count) if p != me]
    if len(others) == 1:
        names = f"process {others[0]} did not"
    else:
        names = f"one or more of processes {', '.join(map(str, others))} did not"
    text = (
        f"jmirror: processes that did not arrive: {names} call jm.distributed.initialize() "
        f"(or cannot reach {where}); this is process {me} of {count}{origin}."
    )
    if me != 0:
        text += f" Process 0 runs the coordination service: check that it started at {where}."
    return text


# What Python reports as the SIGTERM handler right after jax.distributed started. JAX's
# preemption notifier installs a C handler then, which Python does not see (it still reports
# the handler it knew); a different report later means a Python handler replaced JAX's.
_sigterm_after_initialize: object = signal.SIG_DFL
_timeout_s: float | None = 300.0


def timeout_s_of_initialize() -> float | None:
    """Returns the `timeout_s` given to `initialize` (internal; 300 before it ran): the bound of the
    default strategy of several processes, so that a call made without `strategy=` (a
    checkpoint's barrier) is bounded as the run asked.

    Example:
      >>> from jmirror import distributed
      >>> distributed.timeout_s_of_initialize()
      300.0
    """
    return _timeout_s


def sigterm_handler_after_initialize() -> object:
    """Returns what `signal.getsignal(SIGTERM)` said right after `jax.distributed` started.

    JAX's preemption notifier catches SIGTERM with a handler Python does not see; if Python
    reports another handler later, a Python handler has replaced JAX's. `jm.checkpoint`'s
    preemption watch asks this. `signal.SIG_DFL` when JAX was started without `initialize`.

    Example:
      >>> import signal
      >>> from jmirror import distributed
      >>> distributed.sigterm_handler_after_initialize() == signal.SIG_DFL
      True
    """
    return _sigterm_after_initialize


# A collective that failed because a peer went away (gloo's wording for a closed connection).
_LOST_PEER = re.compile(r"Gloo .*(Connection reset by peer|Connection closed by peer|EOF)")


def _exit_at_once(print_exception, lost_peer_wait_s: float):
    """Returns an excepthook that prints the uncaught exception and ends the process at once.

    Otherwise the interpreter would wait in JAX's exit hook (`shutdown_timeout_seconds`, 300 s)
    for the other processes, which wait for this one in their next collective: measured with
    JAX 0.10.2, every process then hung 300 s before aborting. Ending at once stops this
    process's heartbeats, so the coordination service ends the others within
    `heartbeat_timeout_s`, naming this process. Exit handlers (`atexit`) do not run.
    """

    def excepthook(kind, error, traceback):
        print_exception(kind, error, traceback)
        _deadline.explain(error)  # gloo's timeout at a first collective: name the absent peer
        if _LOST_PEER.search(str(error)):
            # A collective failed because a peer's connection went away: the peer died. JAX's
            # coordination service is about to end this process with a message that names the
            # lost process (within the heartbeat timeout; at once when it was process 0), so
            # wait for that rather than end without saying who was lost.
            print(
                "jmirror: a collective failed because a peer process's connection was lost; "
                "waiting for JAX's coordination service to name it...",
                file=sys.stderr,
                flush=True,
            )
            time.sleep(lost_peer_wait_s)
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(1)

    return excepthook


def is_initialized() -> bool:
    """Returns whether this process is ready for several processes (or knows it is alone).

    True once `jm.distributed.initialize` has returned (also when it found one process and did
    nothing), or when `jax.distributed.initialize` was called directly. Unlike
    `jax.distributed.is_initialized`, it is also True for a process that is alone.

    Returns:
      True if `initialize` ran or JAX's distributed runtime is up.

    Example:
      >>> import jmirror as jm
      >>> jm.distributed.initialize()
      >>> jm.distributed.is_initialized()
      True
    """
    return _initialized is not None or jax.distributed.is_initialized()


def check_initialized(call: str) -> None:
    """Raise if this process was started as one of several but the runtime was not started.

    A process started by `python -m jmirror.launch` (or with the `JMIRROR_*` variables set for
    several processes) that never called `jm.distributed.initialize` sees only its own devices
    and would silently train alone. Multi-process entry points call this first.

    Args:
      call: the call that needs the runtime, named in the error, e.g.
        `"jm.MultiWorkerMirroredStrategy()"`.

    Raises:
      RuntimeError: the `JMIRROR_*` variables ask for several processes and JAX's distributed
        runtime is not initialized.

    Example:
      >>> import jmirror as jm
      >>> jm.distributed.check_initialized("my_entry_point()")  # alone: nothing to check
    """
    count = os.environ.get(ENV_NUM_PROCESSES)
    if count is None or jax.distributed.is_initialized():
        return
    if _cluster_config.int_from_env(ENV_NUM_PROCESSES, 1) > 1:
        raise RuntimeError(
            f"{call} runs in a process started for {count} processes ({ENV_NUM_PROCESSES}="
            f"{count}, e.g. by python -m jmirror.launch), but JAX's distributed runtime is not "
            "initialized, so this process would see only its own devices. Call "
            "jm.distributed.initialize() first thing in the program, right after the imports."
        )


def _check_backends_not_initialized(what: str) -> None:
    if _backends_are_initialized():
        raise RuntimeError(_TOO_LATE.format(what=what))


def _backends_are_initialized() -> bool:
    """Returns whether JAX's backends have started, asked with public calls only.

    JAX answers this only internally. Its config refuses a new `jax_num_cpu_devices` with
    `RuntimeError` once the backends have started (the value is read when the CPU backend is
    made), and accepts it before; setting another value and restoring the old one asks that.
    """
    current = getattr(jax.config, "jax_num_cpu_devices")  # noqa: B009 (untyped for pyright)
    try:
        jax.config.update("jax_num_cpu_devices", current + 1)
    except RuntimeError:
        return True
    jax.config.update("jax_num_cpu_devices", current)
    return False
