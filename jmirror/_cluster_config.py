"""The configuration of `jm.distributed.initialize`, checked before JAX is asked.

Where a run's `coordinator_address`, `num_processes` and `process_id` come from (the arguments,
the `JMIRROR_*` variables of `python -m jmirror.launch`, a detected cluster), resolved into one
`Request`; and every check made of it before `jax.distributed.initialize` runs, so that a
mistake is an error at once: the arguments' types and ranges, the variables' values, the
coordinator's `host:port` and whether its host resolves, a coordinator port already in use on
process 0 (or, seen from the others, held by a program that is not JAX's coordination
service). A detected cluster (Open MPI, SLURM, Kubernetes) is read in JAX's order and as JAX
reads it, coordinator, count, index and the GPUs of each process included. Also the bind
address of a loopback coordinator. The standard library only: it never touches JAX.
"""

from __future__ import annotations

import dataclasses
import errno
import importlib.util
import ipaddress
import operator
import os
import re
import socket
from typing import Any

ENV_COORDINATOR = "JMIRROR_COORDINATOR"
ENV_NUM_PROCESSES = "JMIRROR_NUM_PROCESSES"
ENV_PROCESS_ID = "JMIRROR_PROCESS_ID"
ENV_DEVICES_PER_PROCESS = "JMIRROR_DEVICES_PER_PROCESS"
ENV_RESTART = "JMIRROR_RESTART"  # set by the launcher: restarts before this start ("0" first)
# Set by the launcher with --min-processes M < P: "M:P", the process counts the run may have.
ENV_PROCESS_COUNTS = "JMIRROR_PROCESS_COUNTS"


def process_counts() -> tuple[int, int] | None:
    """`(M, P)` when `python -m jmirror.launch --min-processes M --processes P` (M < P) started
    this process, so that the run may continue on fewer processes; else None."""
    value = os.environ.get(ENV_PROCESS_COUNTS, "")
    least, _, most = value.partition(":")
    if not (least.isdigit() and most.isdigit()) or int(least) >= int(most):
        return None
    return int(least), int(most)


@dataclasses.dataclass(frozen=True)
class Request:
    """What one call of `initialize` asked for, after the launcher's environment is read."""

    source: str  # "arguments", "launcher", "cluster" or "one process"
    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None
    heartbeat_timeout_s: int
    devices_per_process: int | None
    cluster: str | None
    # The GPUs this process sees, as `jax.distributed.initialize(local_device_ids=...)`; with
    # `jax_detects` False JAX's detection is off (everything is known) and None means every GPU.
    local_device_ids: tuple[int, ...] | None = None
    jax_detects: bool = True  # JAX's own detection fills what is None (and the GPUs)
    origin: str | None = None  # for a detected cluster: the variables the values came from
    # The variable that chose the coordinator's port over the cluster's own (JAX's
    # JAX_COORDINATOR_PORT or JAX_COORDINATOR_ADDRESS), which a busy port's fix names.
    port_variable: str | None = None


def resolve(
    coordinator_address: str | None,
    num_processes: int | None,
    process_id: int | None,
    heartbeat_timeout_s: int,
) -> Request:
    """Resolve the arguments, the launcher's environment and cluster detection into a request."""
    num_processes = _as_int(num_processes)
    process_id = _as_int(process_id)
    _check_arguments(coordinator_address, num_processes, process_id, heartbeat_timeout_s)
    given = (coordinator_address, num_processes, process_id)
    launcher = os.environ.get(ENV_COORDINATOR) is not None
    if not launcher:
        _check_no_partial_launcher_environment()
    variable = None
    if launcher and coordinator_address is None:
        coordinator_address = os.environ[ENV_COORDINATOR]
        variable = ENV_COORDINATOR
        _check_address(coordinator_address, ENV_COORDINATOR, variable)
    if launcher:
        if num_processes is None:
            num_processes = int_from_env(ENV_NUM_PROCESSES, 1)
        if process_id is None:
            process_id = int_from_env(ENV_PROCESS_ID, 0)
    devices = None
    if launcher and os.environ.get(ENV_DEVICES_PER_PROCESS) is not None:
        devices = int_from_env(ENV_DEVICES_PER_PROCESS, 1)
    resolved = (coordinator_address, num_processes, process_id)
    complete = None not in resolved
    source = "arguments" if None not in given else "launcher" if launcher else "cluster"
    cluster = None if complete else detect_cluster()
    local_device_ids, jax_detects, origin, port_variable = None, True, None, None
    if cluster is not None:
        # What JAX would fill in, filled in now: the argument given, else JAX's own variable,
        # else the cluster's value.
        origin = f"{cluster.name}: {cluster.origin}"
        if coordinator_address is None and os.environ.get(ADDRESS_VARIABLE):
            coordinator_address = os.environ[ADDRESS_VARIABLE]
            _check_address(coordinator_address, ADDRESS_VARIABLE)
            port_variable = ADDRESS_VARIABLE
            origin = f"{ADDRESS_VARIABLE}={coordinator_address!r}, and {origin}"
        if coordinator_address is None:
            coordinator_address = cluster.coordinator_address
            port_variable = cluster.port_variable
        if num_processes is None:
            num_processes = cluster.num_processes
        if process_id is None:
            process_id = cluster.process_id
        resolved = (coordinator_address, num_processes, process_id)
        complete = None not in resolved
        if complete:
            local_device_ids, jax_detects = cluster.local_device_ids(), False
    where = f"from {origin}" if origin else f"from the {source}"
    if num_processes is not None and process_id is not None:
        _check_range(num_processes, process_id, where)
    if complete and coordinator_address is not None:
        _check_host_resolves(coordinator_address, variable, origin)
    if not complete and cluster is None:
        if given == (None, None, None):
            return Request("one process", None, None, None, heartbeat_timeout_s, None, None)
        missing = [n for n, v in zip(_NAMES, resolved) if v is None]
        raise ValueError(
            "jm.distributed.initialize() needs coordinator_address, num_processes and "
            f"process_id outside a cluster; got {_format(resolved)}, missing "
            f"{', '.join(missing)}. Pass all three (or none, to run one process), or start the "
            "program with python -m jmirror.launch."
        )
    name = cluster.name if cluster is not None else None
    return Request(
        source,
        *resolved,
        heartbeat_timeout_s,
        devices,
        name,
        local_device_ids,
        jax_detects,
        origin,
        port_variable,
    )


def _as_int(value: Any) -> Any:
    """Returns an integer-like argument (a numpy integer, ...) as an int, anything else as is."""
    if value is None or isinstance(value, (bool, int)):
        return value
    try:
        return operator.index(value)
    except TypeError:
        return value


def _check_no_partial_launcher_environment() -> None:
    """`JMIRROR_NUM_PROCESSES` / `JMIRROR_PROCESS_ID` without `JMIRROR_COORDINATOR`: an error.

    Otherwise the process would silently run alone although its environment asks for several.
    """
    found = [n for n in (ENV_NUM_PROCESSES, ENV_PROCESS_ID) if os.environ.get(n) is not None]
    if found:
        values = ", ".join(f"{n}={os.environ[n]!r}" for n in found)
        raise ValueError(
            f"jm.distributed.initialize() found {values} but no {ENV_COORDINATOR}: a run of "
            f"several processes needs all three. Set {ENV_COORDINATOR}='host:port' of process "
            "0, or unset them to run one process (python -m jmirror.launch sets all three)."
        )


_NAMES = ("coordinator_address", "num_processes", "process_id")


def _format(values: tuple[object, ...]) -> str:
    return ", ".join(f"{name}={value!r}" for name, value in zip(_NAMES, values))


def describe(request: Request) -> str:
    """Returns the request in words, for the error of a second call with another configuration."""
    values = (request.coordinator_address, request.num_processes, request.process_id)
    where = f" ({request.cluster})" if request.cluster else ""
    devices = request.devices_per_process
    return (
        f"{request.source}{where}: {_format(values)}, "
        f"heartbeat_timeout_s={request.heartbeat_timeout_s}"
        + (f", {devices} host devices per process" if devices is not None else "")
    )


def _check_arguments(
    coordinator_address: object, num_processes: object, process_id: object, heartbeat: object
) -> None:
    if coordinator_address is not None:
        if not isinstance(coordinator_address, str):
            raise TypeError(
                "jm.distributed.initialize(coordinator_address=...) expects a 'host:port' "
                f"string; got {coordinator_address!r} of type {type(coordinator_address).__name__}."
            )
        _check_address(coordinator_address, "coordinator_address")
    for name, value in (("num_processes", num_processes), ("process_id", process_id)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise TypeError(
                f"jm.distributed.initialize({name}=...) expects an int or None; got {value!r} "
                f"of type {type(value).__name__}."
            )
    if not isinstance(heartbeat, int) or isinstance(heartbeat, bool) or heartbeat < 1:
        raise ValueError(
            "jm.distributed.initialize(heartbeat_timeout_s=...) expects a whole number of seconds "
            f">= 1; got {heartbeat!r}. The default, 10, ends the other processes about 10 s "
            "after one is lost."
        )


def _check_address(address: str, where: str, variable: str | None = None) -> None:
    """`host:port` with a host and a port in 1-65535, else a ValueError naming the fix.

    `where` names the argument; `variable`, when the address came from the environment, the
    variable it was read from.
    """
    host, sep, port = address.rpartition(":")
    if not address.strip():
        problem = "it is empty"
    elif not sep:
        problem = "it has no ':port'"
    elif not host:
        problem = "the host before ':' is missing"
    elif not port.isdigit():
        problem = f"the port {port!r} is not a number"
    elif not 0 < int(port) < 65536:
        problem = f"the port {int(port)} is not in 1-65535"
    elif host.strip() != host or any(c.isspace() for c in host):
        problem = "the host contains spaces"
    else:
        return
    if variable is not None:
        raise ValueError(
            f"jm.distributed.initialize() reads {variable} as the coordinator's 'host:port' "
            f"with a port in 1-65535, e.g. '10.0.0.1:1234'; found {variable}={address!r}: "
            f"{problem}. Fix or unset it (python -m jmirror.launch sets it), or pass "
            "coordinator_address."
        )
    raise ValueError(
        f"jm.distributed.initialize() expects {where} as 'host:port' with a port in "
        f"1-65535, e.g. '10.0.0.1:1234'; got {address!r}: {problem}."
    )


def _check_host_resolves(address: str, variable: str | None, origin: str | None = None) -> None:
    """Refuses a host name that does not resolve now, not after JAX's 300 s connection wait."""
    host, _, port = address.rpartition(":")
    try:
        socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as error:
        source = f"{variable}={address!r}" if variable else f"coordinator_address={address!r}"
        if origin:
            source += f", from {origin}"
        raise ValueError(
            f"jm.distributed.initialize(): the coordinator's host {host!r} ({source}) does not "
            f"resolve to an address ({error}). Give process 0's host name or IP address."
        ) from None


def check_port_free(request: Request) -> None:
    """On process 0, a coordinator port already in use is an `OSError` now.

    JAX would otherwise fail to start its service ("Failed to start RPC server", or a crash)
    only after about half a minute, without naming the port. The port is probed on the address
    JAX will bind (with `SO_REUSEADDR`, as gRPC binds, so that connections closing on it do not
    count).
    """
    address = request.coordinator_address
    if request.process_id != 0 or address is None:
        return
    bind = bind_address(address) or os.environ.get("JAX_COORDINATOR_BIND_ADDRESS")
    port = int(address.rpartition(":")[2])
    host = bind.rpartition(":")[0].strip("[]") if bind else "::"
    families = [socket.AF_INET6, socket.AF_INET] if ":" in host else [socket.AF_INET]
    for family in families:
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 here: JAX's "[::]" is IPv4's every interface
            host = "0.0.0.0" if host == "::" else host
            continue
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as error:
                if error.errno != errno.EADDRINUSE:
                    return  # not ours to judge (an address of another machine, ...): JAX's
                raise OSError(
                    errno.EADDRINUSE,
                    f"jm.distributed.initialize(): the coordinator port {port} "
                    f"({address!r}{_origin(request)}) is already in use on this machine, so "
                    "process 0 cannot start the coordination service there. " + _port_fix(request),
                ) from None
        return


def check_coordinator_port(request: Request, answer_s: float = 5.0) -> None:
    """On a process other than 0, a coordinator port held by another program is an `OSError`.

    Process 0 raises at once when its port is in use; the others would wait for a coordinator
    that never comes (`timeout_s`, minutes), or talk to the program holding the port. So they
    look first: a connection refused or not answered means the coordinator has not started yet
    (JAX waits for it); one that is accepted must answer as JAX's coordination service does, a
    gRPC server (an HTTP/2 SETTINGS frame in reply to HTTP/2's preface) within `answer_s`.
    """
    address = request.coordinator_address
    if request.process_id in (None, 0) or address is None:
        return
    host, _, port = address.rpartition(":")
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=2.0)
    except OSError:
        return  # nothing listens yet, or no route yet: JAX's wait, bounded by timeout_s
    with sock:
        sock.settimeout(answer_s)
        reply = b""
        try:
            sock.sendall(_HTTP2_PREFACE)
            while len(reply) < 9:
                data = sock.recv(9 - len(reply))
                if not data:
                    break
                reply += data
        except OSError:
            pass
    if len(reply) == 9 and reply[3] == _HTTP2_SETTINGS:
        return
    raise OSError(
        errno.EADDRINUSE,
        f"jm.distributed.initialize(): the coordinator port {port} ({address!r}"
        f"{_origin(request)}) is held by a program that is not JAX's coordination service (it "
        f"accepted a connection but did not answer as a gRPC server within {answer_s:g} s), "
        "so process 0 cannot start the service there (it stops with the same error: port in "
        f"use). This is process {request.process_id} of {request.num_processes}. "
        + _port_fix(request),
    )


# A client's HTTP/2 connection preface and an empty SETTINGS frame: a gRPC server answers with
# its own SETTINGS frame (type 4), as the first frame of the connection.
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_HTTP2_SETTINGS = 4


def _origin(request: Request) -> str:
    return f", from {request.origin}" if request.origin else ""


def _port_fix(request: Request) -> str:
    fix = _port_holder_fix(request)
    count = request.num_processes
    if request.process_id == 0 and count is not None and count > 1:
        # Two processes given index 0 (a duplicated SLURM_PROCID, say) meet here: the second
        # cannot start the service the first started.
        fix += (
            " If another process of this run was also given process index 0, the port is "
            "its: give every process its own index, 0 to "
            f"{count - 1}{_origin(request)}."
        )
    return fix


def _port_holder_fix(request: Request) -> str:
    if request.port_variable == PORT_VARIABLE:
        return (
            f"The port is the one {PORT_VARIABLE} sets; set it to a free port (the same on "
            "every process), or stop the program that holds it (e.g. an earlier run still "
            "alive)."
        )
    if request.port_variable == ADDRESS_VARIABLE:
        return (
            f"The port is the one {ADDRESS_VARIABLE} names; give it a free port (the same on "
            "every process), or stop the program that holds it (e.g. an earlier run still "
            "alive)."
        )
    if request.source == "cluster":
        return (
            f"JAX derives the port from the job id; choose a free one for every process with "
            f"{PORT_VARIABLE}=<port> (the same on every process), or stop the program that "
            "holds it (e.g. an earlier run still alive)."
        )
    return (
        "Choose a free port (python -m jmirror.launch picks one itself), or stop the program "
        "that holds it (e.g. an earlier run still alive)."
    )


def _check_range(num_processes: int, process_id: int, where: str) -> None:
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(
            "jm.distributed.initialize() expects num_processes >= 1 and "
            f"0 <= process_id < num_processes; got num_processes={num_processes}, "
            f"process_id={process_id} ({where}). Number the processes 0 to num_processes - 1."
        )


def int_from_env(name: str, minimum: int) -> int:
    """Returns the integer in variable `name`, at least `minimum` (else a ValueError, the fix)."""
    text = os.environ.get(name)
    if text is None:
        raise ValueError(
            f"jm.distributed.initialize() found {ENV_COORDINATOR}="
            f"{os.environ.get(ENV_COORDINATOR)!r} but no {name}: a run of several processes "
            f"needs {ENV_COORDINATOR}, {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID}. Set {name} "
            "(python -m jmirror.launch sets all three), or pass the arguments."
        )
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ValueError(
            f"jm.distributed.initialize() reads {name} as an integer >= {minimum}; found "
            f"{name}={text!r}. Fix or unset it (python -m jmirror.launch sets it)."
        )
    return value


# --- the cluster JAX would detect, worked out before joining ----------------------------------
# JAX's cluster detection (`jax/_src/clusters`) tries, in this order: Open MPI (`mpirun` of
# Open MPI 4, which sets OMPI_MCA_orte_hnp_uri), SLURM (a job step's five variables), Cloud TPU
# VMs, Kubernetes; the first one present wins. So Open MPI ranks started inside a SLURM step
# (`srun -n1 mpirun -np 2`, what a multi-node `sbatch` + `mpirun` job does) are an Open MPI
# job, although each rank also inherits the step's SLURM_* variables, which say one task.
# jmirror reads the same variables the same way before joining, so that its checks (the
# coordinator's port, the host) and its errors name the coordinator, count and index JAX will
# use. Kubernetes, which JAX asks through the cluster's API, is left to JAX.

_OMPI_URI = "OMPI_MCA_orte_hnp_uri"
_SLURM_STEP = (
    "SLURM_JOB_ID",
    "SLURM_STEP_NODELIST",
    "SLURM_NTASKS",
    "SLURM_PROCID",
    "SLURM_LOCALID",
)
PORT_VARIABLE = "JAX_COORDINATOR_PORT"  # JAX's: a detected cluster's coordinator port
ADDRESS_VARIABLE = "JAX_COORDINATOR_ADDRESS"  # JAX's: the coordinator, instead of detection
LOCAL_IDS_VARIABLE = "JAX_LOCAL_DEVICE_IDS"  # JAX's: the GPUs this process may see


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A detected cluster that runs several processes: what JAX would take from it."""

    name: str  # "Open MPI", "SLURM" or "Kubernetes"
    coordinator_address: str | None  # None: JAX asks the cluster for it (Kubernetes)
    num_processes: int | None
    process_id: int | None
    local_id: int | None  # this process's index among those on its host (JAX's choice of GPU)
    tasks_on_host: int | None  # how many of the run's processes share this host; None: unknown
    origin: str  # where the values come from, in words, for errors
    port_variable: str | None = None  # JAX_COORDINATOR_PORT when it set the port

    def local_device_ids(self) -> tuple[int, ...] | None:
        """Returns the GPUs this process should see: None for every GPU of its host.

        JAX gives each process of a detected cluster the one GPU of its local index
        (`local_device_ids=[local id]`): right for one task per GPU, but one task per host
        would use GPU 0 only. A process alone on its host sees every GPU; several on a host
        keep JAX's one GPU each. `JAX_LOCAL_DEVICE_IDS`, when set, is left to JAX.
        """
        if self.local_id is None or os.environ.get(LOCAL_IDS_VARIABLE):
            return None
        if self.tasks_on_host == 1:
            return None
        return (self.local_id,)


def detect_cluster() -> Cluster | None:
    """Returns the cluster JAX would detect, only when it runs several processes; else None.

    Read from environment variables only, in JAX's order (Open MPI, then SLURM, then
    Kubernetes). A single SLURM task or Open MPI rank is one process. `KUBERNETES_SERVICE_HOST`
    is set in every Kubernetes pod, so a pod counts only as a member of an Indexed Job
    (`JOB_COMPLETION_INDEX`), which is what JAX's Kubernetes detection expects (a JobSet's pods
    are Indexed Jobs too).
    """
    env = os.environ
    if _OMPI_URI in env:
        return _open_mpi()
    if all(name in env for name in _SLURM_STEP):
        return _slurm()
    _check_not_unseen_open_mpi()
    if "KUBERNETES_SERVICE_HOST" in env and "JOB_COMPLETION_INDEX" in env:
        if importlib.util.find_spec("kubernetes") is None:
            raise RuntimeError(
                "jm.distributed.initialize() found a Kubernetes Indexed Job "
                "(KUBERNETES_SERVICE_HOST and JOB_COMPLETION_INDEX are set), but JAX's "
                "Kubernetes detection needs the kubernetes package, which is not installed. "
                "Install it (pip install 'jax[k8s]') or pass coordinator_address, "
                "num_processes and process_id."
            )
        index = _env_int("JOB_COMPLETION_INDEX", "Kubernetes")
        return Cluster("Kubernetes", None, None, index, None, None, "JOB_COMPLETION_INDEX")
    return None


def _open_mpi() -> Cluster | None:
    """Open MPI 4's ranks, read as JAX's `OmpiCluster` reads them."""
    count = _env_int("OMPI_COMM_WORLD_SIZE", "Open MPI")
    if count == 1:
        return None
    uri = os.environ[_OMPI_URI]
    # e.g. 1531576320.0;tcp://10.96.0.1,10.148.0.1:34911 or ...;tcp6://[fe80::1,fd00::2]:43370
    found = re.search(r"tcp://(.+?)[,:]|tcp6://\[(.+?)[,\]]", uri)
    job = uri.split(".", maxsplit=1)[0]
    if found is None or not job.isdigit():
        raise ValueError(
            f"jm.distributed.initialize() found an Open MPI job ({_OMPI_URI}={uri!r}) but "
            "cannot read mpirun's address and job id from it, as JAX does. Pass "
            "coordinator_address, num_processes and process_id."
        )
    host = next(group for group in found.groups() if group is not None)
    # JAX's port: the job id (a multiple of 2**12) over 2**12, in 61440-65535.
    override = _override_port()
    port = override or int(job) // 2**12 % 2**12 + 65536 - 2**12
    where = f"mpirun's address in {_OMPI_URI}"
    if override:
        where = f"the host of {where}, the port of {PORT_VARIABLE}={override}"
    return Cluster(
        "Open MPI",
        _address(host, port),
        count,
        _env_int("OMPI_COMM_WORLD_RANK", "Open MPI"),
        _env_int("OMPI_COMM_WORLD_LOCAL_RANK", "Open MPI"),
        _env_int("OMPI_COMM_WORLD_LOCAL_SIZE", "Open MPI", required=False),
        f"{where}, OMPI_COMM_WORLD_SIZE and OMPI_COMM_WORLD_RANK",
        PORT_VARIABLE if override else None,
    )


def _slurm() -> Cluster | None:
    """Returns a SLURM job step's tasks, read as JAX's `SlurmCluster` reads them."""
    count = _env_int("SLURM_NTASKS", "SLURM")
    if count == 1:
        return None
    # JAX's coordinator: the step's first node, e.g. of 'node[001-015],gpu1' node001.
    nodes = os.environ["SLURM_STEP_NODELIST"]
    first = re.match(r"([^,\[]*)(?:\[([^,\-\]]*))?", nodes)
    host = "".join(part or "" for part in first.groups()) if first else nodes
    override = _override_port()
    port = override or int(_env_int("SLURM_JOB_ID", "SLURM")) % 2**12 + 65536 - 2**12
    where = "the step's first node in SLURM_STEP_NODELIST, SLURM_JOB_ID"
    if override:
        where = f"the step's first node in SLURM_STEP_NODELIST, {PORT_VARIABLE}={override}"
    return Cluster(
        "SLURM",
        _address(host, port),
        count,
        _env_int("SLURM_PROCID", "SLURM"),
        _env_int("SLURM_LOCALID", "SLURM"),
        _slurm_tasks_on_this_node(),
        f"{where}, SLURM_NTASKS and SLURM_PROCID",
        PORT_VARIABLE if override else None,
    )


def _slurm_tasks_on_this_node() -> int | None:
    """This node's task count from SLURM_STEP_TASKS_PER_NODE ('2(x3),1': 2, 2, 2, 1), by
    SLURM_NODEID; None when SLURM does not say."""
    counts: list[int] = []
    for part in os.environ.get("SLURM_STEP_TASKS_PER_NODE", "").split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            return None
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    node = os.environ.get("SLURM_NODEID", "")
    if node.isdigit() and int(node) < len(counts):
        return counts[int(node)]
    return counts[0] if len(set(counts)) == 1 else None


def _check_not_unseen_open_mpi() -> None:
    """Open MPI 5's ranks (no OMPI_MCA_orte_hnp_uri), which JAX does not detect: an error, not
    every rank silently running alone."""
    size = os.environ.get("OMPI_COMM_WORLD_SIZE", "")
    if size.isdigit() and int(size) > 1:
        rank = os.environ.get("OMPI_COMM_WORLD_RANK", "?")
        raise ValueError(
            f"jm.distributed.initialize() found an Open MPI job of {size} ranks "
            f"(OMPI_COMM_WORLD_SIZE={size}, OMPI_COMM_WORLD_RANK={rank}) without {_OMPI_URI}, "
            "which JAX's cluster detection needs (Open MPI 4's mpirun sets it; Open MPI 5's "
            "does not), so every rank would run alone. Pass them: jm.distributed.initialize("
            "'<rank 0 host>:<free port>', num_processes=int(os.environ['OMPI_COMM_WORLD_SIZE']), "
            "process_id=int(os.environ['OMPI_COMM_WORLD_RANK']))."
        )


def _override_port() -> int | None:
    """JAX_COORDINATOR_PORT, which JAX's detection takes for the coordinator's port."""
    text = os.environ.get(PORT_VARIABLE)
    if not text:
        return None
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(
            f"jm.distributed.initialize() reads {PORT_VARIABLE} as the detected cluster's "
            f"coordinator port, in 1-65535; found {PORT_VARIABLE}={text!r}. Fix or unset it."
        )
    return int(text)


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _env_int(name: str, cluster: str, required: bool = True) -> Any:
    """Returns the integer in variable `name` of a detected cluster; a ValueError naming it if it is
    not one (JAX would raise a bare `int()` error); None if absent and not `required`."""
    text = os.environ.get(name)
    if text is None and not required:
        return None
    if text is None or not text.strip().isdigit():
        raise ValueError(
            f"jm.distributed.initialize() detected {cluster} but its variable {name}="
            f"{text!r} is not a whole number >= 0. Start the program with the cluster's "
            "launcher, or pass coordinator_address, num_processes and process_id."
        )
    return int(text)


def bind_address(coordinator_address: str | None) -> str | None:
    """Bind a loopback coordinator to that address only; otherwise keep JAX's default."""
    if coordinator_address is None:
        return None
    host, _, port = coordinator_address.rpartition(":")
    host = host.strip("[]")
    if host == "localhost":
        return f"127.0.0.1:{port}"
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        return None
    return coordinator_address if loopback else None


# --- the address gloo gives this process (several hosts) -----------------------------------------
# JAX 0.10 creates gloo's TCP transport without a host name or interface, so gloo binds the
# first address this host's name resolves to (`gethostname()`, then `getaddrinfo`) and
# publishes it to the other processes, which connect to it. A name that resolves to a loopback
# address (Debian's `127.0.1.1 <hostname>` line in /etc/hosts) works while every process is on
# one host, and makes every collective between hosts fail ("Connection refused") and abort.


@dataclasses.dataclass(frozen=True)
class HostAddress:
    """How one process is reached by gloo, as its host sees it."""

    hostname: str
    resolved: str | None  # the first address the name resolves to (gloo binds it); None: none
    route: str | None  # this host's address towards the coordinator; None: no route

    def is_loopback(self) -> bool:
        """Returns whether gloo would publish an address no other host can reach (or none)."""
        return self.resolved is None or ipaddress.ip_address(self.resolved).is_loopback


def reaches_other_hosts(coordinator_address: str | None) -> bool:
    """Returns whether the coordinator may be on another host: its address is not a loopback one."""
    if coordinator_address is None:
        return True  # a detected cluster: JAX finds the coordinator, on any host
    host = coordinator_address.rpartition(":")[0].strip("[]")
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return True
    return not all(ipaddress.ip_address(info[4][0]).is_loopback for info in found)


def this_host(coordinator_address: str | None) -> HostAddress:
    """This process's host name, the address gloo will bind for it, its route to the coordinator."""
    hostname = socket.gethostname()
    try:
        found = socket.getaddrinfo(hostname, None, type=socket.SOCK_STREAM)
        resolved = str(found[0][4][0]) if found else None
    except (socket.gaierror, UnicodeError):
        resolved = None
    return HostAddress(hostname, resolved, _route_to(coordinator_address))


def _route_to(coordinator_address: str | None) -> str | None:
    """Returns the local address the kernel picks to reach the coordinator (a UDP `connect` sends
    nothing); two processes on one host get the same, processes on two hosts do not."""
    if coordinator_address is None:
        return None
    host, _, port = coordinator_address.rpartition(":")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host.strip("[]"), int(port), type=socket.SOCK_DGRAM
        )[0]
        with socket.socket(family, kind, proto) as sock:
            sock.connect(address)
            return str(sock.getsockname()[0])
    except (OSError, UnicodeError, IndexError):
        return None


def loopback_hostname_error(hosts: list[HostAddress]) -> str | None:
    """Returns the error when the processes (`hosts[i]` is process i's) span several hosts and some
    host's name resolves to a loopback address, so that gloo could not connect them; else None.

    Hosts are told apart by their route to the coordinator; processes of one host reach each
    other on loopback, so a loopback name is harmless there.
    """
    count = len({h.route or h.hostname for h in hosts})
    bad = [(index, host) for index, host in enumerate(hosts) if host.is_loopback()]
    if count < 2 or not bad:
        return None
    lines = []
    for index, host in bad[:4]:
        found = (
            f"resolves to {host.resolved}, a loopback address"
            if host.resolved is not None
            else "does not resolve to any address"
        )
        entry = f"{host.route or '<its network address>'} {host.hostname}"
        instead = (
            f", in place of its '{host.resolved} {host.hostname}' line" if host.resolved else ""
        )
        lines.append(
            f"process {index}: host name {host.hostname!r} {found}; fix: put the line "
            f"'{entry}' in /etc/hosts on that host{instead}"
        )
    if len(bad) > 4:
        lines.append(f"... and {len(bad) - 4} more processes")
    return (
        f"jm.distributed.initialize(): the {len(hosts)} processes of this run are on {count} "
        "hosts, and gloo (JAX's CPU collectives) has the other hosts connect to each process "
        "at the first address its host name resolves to. A loopback address cannot be reached "
        "from another host: the first collective would fail with gloo's 'Connection refused' "
        "and abort.\n  "
        + "\n  ".join(lines)
        + "\nThe address given is the one that host uses to reach the coordinator (the address "
        "of the interface gloo must use). JAX offers no option to choose gloo's interface "
        "(GLOO_SOCKET_IFNAME is PyTorch's; JAX does not read it), so the host name's entry is "
        "the fix."
    )
