"""`jm.distributed`: where initialize takes its configuration, its errors, and lost processes.

The tests that start processes run in the 8-device pass only (the suite runs twice).
"""

import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import pytest

sys.path.insert(0, str(Path(__file__).parent / "multiprocess"))
import harness  # noqa: E402

import jmirror as jm  # noqa: E402
from jmirror import _cluster_config, distributed  # noqa: E402

starts_processes = pytest.mark.skipif(
    os.environ.get("JMIRROR_TEST_DEVICES", "8") != "8",
    reason="starts processes: runs once, in the 8-device pass",
)
STARTUP_S = 60
LOST_PEER_S = 30  # documented: the survivors end within 30 s, naming the lost process

CLUSTER_VARIABLES = (
    "JMIRROR_COORDINATOR",
    "JMIRROR_NUM_PROCESSES",
    "JMIRROR_PROCESS_ID",
    "JMIRROR_DEVICES_PER_PROCESS",
    "SLURM_JOB_ID",
    "SLURM_STEP_NODELIST",
    "SLURM_NTASKS",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_STEP_TASKS_PER_NODE",
    "SLURM_STEP_NUM_NODES",
    "SLURM_NODEID",
    "OMPI_MCA_orte_hnp_uri",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "KUBERNETES_SERVICE_HOST",
    "JOB_COMPLETION_INDEX",
    "JAX_COORDINATOR_ADDRESS",
    "JAX_COORDINATOR_PORT",
    "JAX_LOCAL_DEVICE_IDS",
)


@pytest.fixture
def fresh(monkeypatch):
    """No configuration yet, and none of the launcher's or a cluster's variables."""
    monkeypatch.setattr(distributed, "_initialized", None)
    for name in CLUSTER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_alone_it_does_nothing_and_a_second_call_too(fresh):
    jm.distributed.initialize()
    jm.distributed.initialize()
    assert jm.distributed.is_initialized()
    assert not jax.distributed.is_initialized()
    assert jax.process_count() == 1


def test_another_configuration_later_is_an_error(fresh):
    jm.distributed.initialize()
    with pytest.raises(RuntimeError, match="already called with another configuration"):
        jm.distributed.initialize("127.0.0.1:1234", 2, 0)


def test_after_a_device_was_touched_it_is_an_error(fresh):
    jax.devices()
    with pytest.raises(RuntimeError, match="must run before anything touches a device"):
        jm.distributed.initialize("127.0.0.1:1234", 2, 0)
    assert not jm.distributed.is_initialized()


def test_launcher_variables_are_read_and_checked(fresh):
    fresh.setenv("JMIRROR_COORDINATOR", "127.0.0.1:1234")
    fresh.setenv("JMIRROR_NUM_PROCESSES", "two")
    fresh.setenv("JMIRROR_PROCESS_ID", "0")
    with pytest.raises(ValueError, match="JMIRROR_NUM_PROCESSES='two'"):
        jm.distributed.initialize()
    fresh.setenv("JMIRROR_NUM_PROCESSES", "2")
    fresh.setenv("JMIRROR_PROCESS_ID", "2")
    with pytest.raises(ValueError, match="process_id=2 .from the launcher"):
        jm.distributed.initialize()


@pytest.mark.parametrize(
    "args, kwargs, error, message",
    [
        (("127.0.0.1:1234", "2", 0), {}, TypeError, "num_processes=.... expects an int"),
        ((1234, 2, 0), {}, TypeError, "expects a 'host:port' string"),
        (("127.0.0.1", 2, 0), {}, ValueError, "as 'host:port'"),
        (("127.0.0.1:1234", 2, 2), {}, ValueError, "0 <= process_id < num_processes"),
        (("127.0.0.1:1234", 0, 0), {}, ValueError, "num_processes >= 1"),
        ((), {"heartbeat_timeout_s": 0}, ValueError, "heartbeat_timeout_s=.... expects"),
        ((), {"heartbeat_timeout_s": 2.5}, ValueError, "whole number of seconds"),
        (("127.0.0.1:1234",), {}, ValueError, "missing num_processes, process_id"),
    ],
)
def test_bad_arguments(fresh, args, kwargs, error, message):
    with pytest.raises(error, match=message):
        jm.distributed.initialize(*args, **kwargs)


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, None),
        ({"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NTASKS": "2",
          "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}, "SLURM"),
        ({"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n1", "SLURM_NTASKS": "1",
          "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}, None),
        ({"SLURM_JOB_ID": "7"}, None),  # an allocation, not a job step
        ({"OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:1", "OMPI_COMM_WORLD_SIZE": "4",
          "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}, "Open MPI"),
        ({"OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:1", "OMPI_COMM_WORLD_SIZE": "1",
          "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}, None),
        ({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, None),  # any pod: not a cluster by itself
    ],
)  # fmt: skip
def test_a_cluster_is_detected_only_when_it_runs_several_processes(fresh, env, expected):
    for name, value in env.items():
        fresh.setenv(name, value)
    cluster = _cluster_config.detect_cluster()
    assert (cluster.name if cluster else None) == expected


def test_a_kubernetes_job_without_the_kubernetes_package_is_explained(fresh):
    fresh.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    fresh.setenv("JOB_COMPLETION_INDEX", "0")
    fresh.setattr(_cluster_config.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match=r"pip install 'jax\[k8s\]'"):
        jm.distributed.initialize()


# --- a detected cluster, worked out as JAX's detection works it out --------------------------
# The oracle is JAX's own cluster detection (jax._src.clusters), asked with the same variables.

SLURM_STEP = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "node[007-009],gpu1",
              "SLURM_NTASKS": "3", "SLURM_PROCID": "2", "SLURM_LOCALID": "0",
              "SLURM_STEP_TASKS_PER_NODE": "1(x3)", "SLURM_STEP_NUM_NODES": "3",
              "SLURM_NODEID": "2"}  # fmt: skip
OPEN_MPI = {"OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911",
            "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}  # fmt: skip
# What every rank of `srun -n1 mpirun -np 2` inherits from its one-task step.
ONE_TASK_STEP = {**SLURM_STEP, "SLURM_NTASKS": "1", "SLURM_PROCID": "0",
                 "SLURM_STEP_TASKS_PER_NODE": "1", "SLURM_STEP_NUM_NODES": "1"}  # fmt: skip


def _jax_detects():
    """What `jax.distributed.initialize()` would take: (address, count, index, local ids)."""
    from jax._src import clusters

    return clusters.ClusterEnv.auto_detect_unset_distributed_params(
        None, None, None, None, None, None
    )


@pytest.mark.parametrize(
    "env",
    [
        pytest.param(SLURM_STEP, id="slurm"),
        pytest.param({**SLURM_STEP, "SLURM_STEP_NODELIST": "n1,n2,n3"}, id="slurm-list"),
        pytest.param({**SLURM_STEP, "SLURM_STEP_NODELIST": "solo"}, id="slurm-one-name"),
        pytest.param({**SLURM_STEP, "JAX_COORDINATOR_PORT": "12345"}, id="slurm-port"),
        pytest.param(OPEN_MPI, id="open-mpi"),
        pytest.param(
            {
                **OPEN_MPI,
                "OMPI_MCA_orte_hnp_uri": "1314521088.0;tcp6://[fe80::b9b:ac5d:9cf0:b858,2620:10d::2]:43370",
            },
            id="open-mpi-ipv6",
        ),  # fmt: skip
        pytest.param({**ONE_TASK_STEP, **OPEN_MPI}, id="open-mpi-inside-a-slurm-step"),
    ],
)
def test_the_cluster_is_worked_out_as_jax_works_it_out(fresh, env):
    for name, value in env.items():
        fresh.setenv(name, value)
    fresh.setattr(_cluster_config.socket, "getaddrinfo", lambda *args, **kwargs: [])  # any host
    address, count, index, _ = _jax_detects()
    request = _cluster_config.resolve(None, None, None, 10)
    assert (request.coordinator_address, request.num_processes, request.process_id) == (
        address.replace("fe80::b9b:ac5d:9cf0:b858", "[fe80::b9b:ac5d:9cf0:b858]"),
        count,
        index,
    )
    assert request.source == "cluster" and not request.jax_detects
    assert request.cluster == ("SLURM" if "OMPI_MCA_orte_hnp_uri" not in env else "Open MPI")


def test_open_mpi_ranks_inside_a_one_task_slurm_step_are_an_open_mpi_job(fresh):
    for name, value in {**ONE_TASK_STEP, **OPEN_MPI}.items():
        fresh.setenv(name, value)
    cluster = _cluster_config.detect_cluster()
    assert cluster is not None and cluster.name == "Open MPI"
    assert (cluster.num_processes, cluster.process_id) == (2, 1)
    assert _jax_detects()[1:3] == (2, 1)  # JAX's order: Open MPI first


@pytest.mark.parametrize(
    "tasks_per_node, node, local_ids",
    [
        ("1(x3)", "2", None),  # one task per host: every GPU of the host
        ("2(x3)", "2", (0,)),  # several: JAX's one GPU per task, by local index
        ("2,1", "1", None),  # this node has one task of the step
        ("2,1", "0", (0,)),
        ("garbled", "0", (0,)),  # unknown: JAX's choice
    ],
)
def test_a_task_alone_on_its_host_sees_every_gpu(fresh, tasks_per_node, node, local_ids):
    env = {**SLURM_STEP, "SLURM_STEP_TASKS_PER_NODE": tasks_per_node, "SLURM_NODEID": node}
    for name, value in env.items():
        fresh.setenv(name, value)
    fresh.setattr(_cluster_config.socket, "getaddrinfo", lambda *args, **kwargs: [])
    assert _jax_detects()[3] == [0]  # JAX alone: GPU 0 only, whatever the shape
    request = _cluster_config.resolve(None, None, None, 10)
    assert request.local_device_ids == local_ids and not request.jax_detects
    fresh.setenv("JAX_LOCAL_DEVICE_IDS", "0,1")  # the user's choice is JAX's to read
    assert _cluster_config.resolve(None, None, None, 10).local_device_ids is None


def test_open_mpi_without_jaxs_variable_is_an_error_not_lone_ranks(fresh):
    # Open MPI 5's mpirun sets no OMPI_MCA_orte_hnp_uri: JAX detects nothing.
    fresh.setenv("OMPI_COMM_WORLD_SIZE", "2")
    fresh.setenv("OMPI_COMM_WORLD_RANK", "1")
    with pytest.raises(ValueError, match=r"Open MPI job of 2 ranks .*OMPI_MCA_orte_hnp_uri"):
        jm.distributed.initialize()


def test_a_process_that_never_joins_is_named_with_the_detected_coordinator(fresh):
    for name, value in SLURM_STEP.items():
        fresh.setenv(name, value)
    fresh.setattr(_cluster_config.socket, "getaddrinfo", lambda *args, **kwargs: [])
    message = distributed._not_joined(_cluster_config.resolve(None, None, None, 10))
    assert "processes 0, 1 did not call jm.distributed.initialize()" in message, message
    port = 4242 % 4096 + 61440
    assert f"the coordinator at node007:{port}" in message and "process 2 of 3" in message
    assert "from SLURM" in message and "None" not in message


def test_a_port_held_by_another_program_ends_the_other_processes_at_once(port_in_use):
    request = _cluster_config.Request("cluster", f"127.0.0.1:{port_in_use}", 2, 1, 10, None, None)
    start = time.monotonic()
    with pytest.raises(OSError, match=rf"coordinator port {port_in_use} .* not JAX's") as error:
        _cluster_config.check_coordinator_port(request, answer_s=1)
    assert error.value.errno == errno.EADDRINUSE
    assert time.monotonic() - start < 5
    assert "JAX_COORDINATOR_PORT=<port>" in str(error.value)  # the fix, for a cluster


def test_a_coordinator_not_started_yet_is_left_to_jax():
    request = _cluster_config.Request("cluster", f"127.0.0.1:{_free_port()}", 2, 1, 10, None, None)
    start = time.monotonic()
    _cluster_config.check_coordinator_port(request)  # refused: process 0 is not there yet
    assert time.monotonic() - start < 3


@pytest.mark.parametrize(
    "address, bind",
    [
        ("127.0.0.1:1234", "127.0.0.1:1234"),
        ("localhost:1234", "127.0.0.1:1234"),
        ("[::1]:1234", "[::1]:1234"),
        ("10.0.0.1:1234", None),  # JAX's default: every interface
        ("node-0.example:1234", None),
    ],
)
def test_a_loopback_coordinator_binds_loopback_only(address, bind):
    assert _cluster_config.bind_address(address) == bind


def test_check_initialized_catches_a_launched_process_that_did_not_initialize(fresh):
    distributed.check_initialized("f()")  # alone
    fresh.setenv("JMIRROR_NUM_PROCESSES", "1")
    distributed.check_initialized("f()")
    fresh.setenv("JMIRROR_NUM_PROCESSES", "2")
    with pytest.raises(RuntimeError, match=r"f\(\) runs in a process started for 2 processes"):
        distributed.check_initialized("f()")


def test_backends_probe_answers_and_leaves_the_device_count_alone():
    # In a fresh interpreter: before and after the first device is touched.
    code = textwrap.dedent("""
        import jax
        from jmirror import distributed
        jax.config.update("jax_num_cpu_devices", 3)
        before = distributed._backends_are_initialized()
        devices = len(jax.devices())
        print(before, distributed._backends_are_initialized(), devices,
              jax.config.jax_num_cpu_devices)
    """)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    assert result.stdout.split() == ["False", "True", "3", "3"], result.stderr


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_two(tmp_path, how: str, mode: str = "loop"):
    """Two worker processes × 4 host devices started by the test itself, no launcher."""
    coordinator = f"127.0.0.1:{_free_port()}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    workers = []
    for index in (0, 1):
        if how == "arguments":
            args = ["--coordinator", coordinator, "--num-processes", "2", "--process-id"]
            args += [str(index), mode]
            worker_env = env
        else:  # the variables python -m jmirror.launch would set
            args = [mode]
            worker_env = {
                **env,
                "JMIRROR_COORDINATOR": coordinator,
                "JMIRROR_NUM_PROCESSES": "2",
                "JMIRROR_PROCESS_ID": str(index),
                "JMIRROR_DEVICES_PER_PROCESS": "4",
            }
        name = f"process{index}"
        workers.append(harness.Background([str(harness.WORKER), *args], tmp_path, name, worker_env))
    return workers


# JAX's coordination service names a lost process by its index ("task"); a lost process 0
# (which runs the service) is named as the leader.
NAMES_LOST = {
    1: r"tasks are unhealthy \(stopped sending heartbeats\):\s*1\s",
    0: r"the leader task was preempted/died",
}


@starts_processes
@pytest.mark.parametrize("how, lost", [("arguments", 1), ("environment", 0)])
def test_a_killed_process_ends_the_survivor_naming_it(tmp_path, how, lost):
    workers = _start_two(tmp_path, how)
    survivor = workers[1 - lost]
    try:
        survivor.wait_for(r"^step", STARTUP_S)
        workers[lost].wait_for(r"^step", STARTUP_S)
        os.kill(workers[lost].popen.pid, signal.SIGKILL)
        code, lost_s = survivor.wait(LOST_PEER_S + 10)
    finally:
        for worker in workers:
            worker.kill()
    print(f"process {1 - lost} ended {lost_s:.1f} s after process {lost} was SIGKILLed")
    assert code != 0
    assert lost_s < LOST_PEER_S
    assert re.search(NAMES_LOST[lost], survivor.output()), survivor.output()


@starts_processes
def test_an_uncaught_exception_ends_its_process_and_then_the_others(tmp_path):
    workers = _start_two(tmp_path, "arguments", "raise")
    try:
        workers[1].wait_for("process 1 fails on purpose", STARTUP_S)
        failed_at = time.monotonic()
        code, _ = workers[1].wait(10)
        assert code == 1, workers[1].output()
        code, _ = workers[0].wait(LOST_PEER_S + 10)
        lost_s = time.monotonic() - failed_at
    finally:
        for worker in workers:
            worker.kill()
    print(f"process 0 ended {lost_s:.1f} s after process 1 raised")
    assert code != 0
    assert lost_s < LOST_PEER_S
    assert re.search(NAMES_LOST[1], workers[0].output()), workers[0].output()


@starts_processes
@pytest.mark.parametrize("tasks_per_node, visible", [("1(x2)", ["all", "all"]),
                                                     ("2", ["0", "1"])])  # fmt: skip
def test_jax_is_told_every_gpu_of_a_task_alone_on_its_host(tmp_path, tasks_per_node, visible):
    # A SLURM step's variables, faked: two tasks on two hosts, or on one. No GPU here: what
    # JAX was told to use is its jax_cuda_visible_devices ("all" unless restricted).
    one_per_host = tasks_per_node != "2"
    env = {k: v for k, v in os.environ.items() if k not in CLUSTER_VARIABLES}
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", JAX_COORDINATOR_PORT=str(_free_port()))
    env.update(SLURM_JOB_ID="77", SLURM_STEP_NODELIST="localhost", SLURM_NTASKS="2",
               SLURM_STEP_TASKS_PER_NODE=tasks_per_node)  # fmt: skip
    workers = []
    for index in (0, 1):
        task = {"SLURM_PROCID": str(index), "SLURM_LOCALID": "0" if one_per_host else str(index),
                "SLURM_NODEID": str(index) if one_per_host else "0"}  # fmt: skip
        args = [str(harness.HERE / "cluster_worker.py"), str(tmp_path), "join", "60"]
        workers.append(harness.Background(args, tmp_path, f"task{index}", {**env, **task}))
    try:
        for worker in workers:
            code, _ = worker.wait(STARTUP_S + 60)
            assert code == 0, worker.output()
    finally:
        for worker in workers:
            worker.kill()
    for index in (0, 1):
        seen = json.loads((tmp_path / f"joined{index}.json").read_text())
        assert (seen["process_index"], seen["process_count"]) == (index, 2)
        assert seen["visible_gpus"] == visible[index]


# --- configuration checked at once ----------------------------------------------------------------
# Each case is raised before anything else is tried: in this process JAX's backends are already
# initialized, so a configuration that passed the checks would be the "too late" RuntimeError.


@pytest.mark.parametrize(
    "value, problem",
    [
        ("", "it is empty"),
        ("   ", "it is empty"),
        ("127.0.0.1:abc", "the port 'abc' is not a number"),
        ("nonsense", "it has no ':port'"),
        (":1234", "the host before ':' is missing"),
        ("127.0.0.1:0", "the port 0 is not in 1-65535"),
        ("127.0.0.1:65536", "the port 65536 is not in 1-65535"),
        ("127.0.0.1:", "the port '' is not a number"),
    ],
)
@pytest.mark.parametrize("process_id", ["0", "1"])
def test_a_bad_coordinator_variable_is_an_error_at_once(fresh, value, problem, process_id):
    fresh.setenv("JMIRROR_COORDINATOR", value)
    fresh.setenv("JMIRROR_NUM_PROCESSES", "2")
    fresh.setenv("JMIRROR_PROCESS_ID", process_id)
    start = time.monotonic()
    with pytest.raises(ValueError) as error:
        jm.distributed.initialize()
    message = str(error.value)
    assert f"JMIRROR_COORDINATOR={value!r}" in message and problem in message, message
    assert "'host:port' with a port in 1-65535" in message and "Fix or unset it" in message
    assert time.monotonic() - start < 5
    assert not jm.distributed.is_initialized()


def test_a_coordinator_host_that_does_not_resolve_is_an_error(fresh):
    fresh.setenv("JMIRROR_COORDINATOR", "no-such-host.invalid:1234")
    fresh.setenv("JMIRROR_NUM_PROCESSES", "2")
    fresh.setenv("JMIRROR_PROCESS_ID", "1")
    with pytest.raises(ValueError, match=r"host 'no-such-host.invalid' .* does not resolve"):
        jm.distributed.initialize()


@pytest.mark.parametrize("present", ["JMIRROR_NUM_PROCESSES", "JMIRROR_PROCESS_ID"])
def test_launcher_variables_without_a_coordinator_are_an_error(fresh, present):
    # Before: silently one process, although the environment asks for several.
    fresh.setenv(present, "1")
    with pytest.raises(ValueError, match=rf"found {present}='1' but no JMIRROR_COORDINATOR"):
        jm.distributed.initialize()


@pytest.mark.parametrize("missing", ["JMIRROR_NUM_PROCESSES", "JMIRROR_PROCESS_ID"])
def test_a_coordinator_without_the_other_variables_is_an_error(fresh, missing):
    # Before: a KeyError.
    fresh.setenv("JMIRROR_COORDINATOR", "127.0.0.1:1234")
    fresh.setenv("JMIRROR_NUM_PROCESSES", "2")
    fresh.setenv("JMIRROR_PROCESS_ID", "1")
    fresh.delenv(missing)
    with pytest.raises(ValueError, match=rf"but no {missing}"):
        jm.distributed.initialize()


@pytest.fixture
def port_in_use():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_a_coordinator_port_in_use_is_an_os_error_naming_it(fresh, port_in_use, host):
    start = time.monotonic()
    with pytest.raises(OSError, match=rf"coordinator port {port_in_use} .* in use") as error:
        jm.distributed.initialize(f"{host}:{port_in_use}", 2, 0)
    assert error.value.errno == errno.EADDRINUSE
    assert time.monotonic() - start < 5  # JAX: "Failed to start RPC server" after ~37 s
    # Two processes given index 0 meet here too: the message says so.
    assert "also given process index 0" in str(error.value) and "0 to 1" in str(error.value)
    fresh.setenv("JMIRROR_COORDINATOR", f"{host}:{port_in_use}")
    fresh.setenv("JMIRROR_NUM_PROCESSES", "2")
    fresh.setenv("JMIRROR_PROCESS_ID", "0")
    with pytest.raises(OSError, match="in use"):
        jm.distributed.initialize()


@pytest.mark.parametrize(
    "cluster, variable",
    [
        ("open-mpi", "JAX_COORDINATOR_PORT"),
        ("slurm", "JAX_COORDINATOR_PORT"),
        ("open-mpi", "JAX_COORDINATOR_ADDRESS"),
    ],
)
def test_a_busy_port_set_by_jaxs_variable_is_said_to_come_from_it(
    fresh, port_in_use, cluster, variable
):
    # Process 0 of Open MPI binds the port itself; process 2 of SLURM finds it held.
    if cluster == "open-mpi":
        env = {**OPEN_MPI, "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://127.0.0.1:34911"}
        env["OMPI_COMM_WORLD_RANK"] = env["OMPI_COMM_WORLD_LOCAL_RANK"] = "0"
    else:
        env = {**SLURM_STEP, "SLURM_STEP_NODELIST": "127.0.0.1"}
    value = str(port_in_use) if variable == "JAX_COORDINATOR_PORT" else f"127.0.0.1:{port_in_use}"
    for name, text in {**env, variable: value}.items():
        fresh.setenv(name, text)
    request = _cluster_config.resolve(None, None, None, 10)
    assert request.coordinator_address == f"127.0.0.1:{port_in_use}"
    with pytest.raises(OSError, match=rf"coordinator port {port_in_use} ") as error:
        _cluster_config.check_port_free(request)
        _cluster_config.check_coordinator_port(request, answer_s=1)
    message = str(error.value)
    assert error.value.errno == errno.EADDRINUSE
    assert f"{variable}={value!r}" in message or f"{variable}={value}" in message, message
    # Neither mpirun's address nor the job id chose the port, and the variable the user
    # already set is not offered as the fix.
    assert "from Open MPI: mpirun's address" not in message, message
    assert "SLURM_JOB_ID" not in message and f"with {variable}=<port>" not in message, message
    assert f"The port is the one {variable} " in message, message


def test_a_port_in_use_concerns_process_0_only(fresh, port_in_use):
    # Process 1 connects to the port (it is process 0's): only the "too late" error is left.
    jax.devices()  # this test process's devices are in use (also when this test runs alone)
    with pytest.raises(RuntimeError, match="must run before anything touches a device"):
        jm.distributed.initialize(f"127.0.0.1:{port_in_use}", 2, 1)


@pytest.mark.parametrize(
    "args, error, message",
    [
        (("127.0.0.1:1234", -1, 0), ValueError, "num_processes >= 1"),
        (("127.0.0.1:1234", 2, -1), ValueError, "0 <= process_id < num_processes"),
        (("127.0.0.1:1234", 2, 1.0), TypeError, "process_id=.... expects an int"),
        (("127.0.0.1:1234", True, 0), TypeError, "num_processes=.... expects an int"),
        (("127.0.0.1:abc", 2, 0), ValueError, "the port 'abc' is not a number"),
        (("nonsense", 2, 0), ValueError, "'host:port'.*got 'nonsense': it has no ':port'"),
    ],
)
def test_bad_values_of_the_arguments(fresh, args, error, message):
    with pytest.raises(error, match=message):
        jm.distributed.initialize(*args)


@pytest.mark.parametrize("variable, value", [("JMIRROR_NUM_PROCESSES", "0"),
                                             ("JMIRROR_NUM_PROCESSES", ""),
                                             ("JMIRROR_PROCESS_ID", "-1"),
                                             ("JMIRROR_PROCESS_ID", "one")])  # fmt: skip
def test_bad_values_of_the_variables(fresh, variable, value):
    fresh.setenv("JMIRROR_COORDINATOR", "127.0.0.1:1234")
    fresh.setenv("JMIRROR_NUM_PROCESSES", "2")
    fresh.setenv("JMIRROR_PROCESS_ID", "1")
    fresh.setenv(variable, value)
    with pytest.raises(ValueError, match=rf"{variable}={value!r}"):
        jm.distributed.initialize()


def test_numpy_integers_are_accepted(fresh):
    np = pytest.importorskip("numpy")
    # Accepted: what is left is only that this process's devices are already in use.
    with pytest.raises(RuntimeError, match="must run before anything touches a device"):
        jm.distributed.initialize("127.0.0.1:1234", np.int64(2), np.int32(1))


# --- several hosts: a host name on loopback -------------------------------------------------------
# The decision, in this process; tests/test_two_hosts.py runs it on two hosts for real.


def _host(name, resolved, route):
    return _cluster_config.HostAddress(name, resolved, route)


@pytest.mark.parametrize(
    "hosts, named",
    [
        ([_host("a", "10.0.0.1", "10.0.0.1"), _host("b", "10.0.0.2", "10.0.0.2")], []),
        # one host (one route to the coordinator): processes reach each other on loopback
        ([_host("a", "127.0.1.1", "10.0.0.1"), _host("a", "127.0.1.1", "10.0.0.1")], []),
        ([_host("a", "10.0.0.1", "10.0.0.1"), _host("b", "127.0.1.1", "10.0.0.2")], [1]),
        ([_host("a", "127.0.1.1", "10.0.0.1"), _host("b", "127.0.1.1", "10.0.0.2")], [0, 1]),
        ([_host("a", "::1", "fd00::1"), _host("b", "fd00::2", "fd00::2")], [0]),
        ([_host("a", None, "10.0.0.1"), _host("b", "10.0.0.2", "10.0.0.2")], [0]),
    ],
)
def test_a_host_name_on_loopback_is_an_error_only_across_hosts(hosts, named):
    message = _cluster_config.loopback_hostname_error(hosts)
    if not named:
        assert message is None
        return
    assert message is not None and "Connection refused" in message
    for index, host in enumerate(hosts):
        line = f"process {index}: host name {host.hostname!r}"
        assert (line in message) == (index in named), message
        if index in named:  # the fix: the host name's line with the network address
            assert f"put the line '{host.route} {host.hostname}' in /etc/hosts" in message
            found = "does not resolve" if host.resolved is None else f"resolves to {host.resolved}"
            assert f"{line} {found}" in message


@pytest.mark.parametrize(
    "address, other_hosts",
    [("127.0.0.1:1234", False), ("localhost:1234", False), ("[::1]:1234", False),
     ("10.0.0.1:1234", True), (None, True)],
)  # fmt: skip
def test_only_a_coordinator_off_loopback_may_need_other_hosts(address, other_hosts):
    assert _cluster_config.reaches_other_hosts(address) == other_hosts


@pytest.fixture
def debian_hostname(monkeypatch):
    """This host is 'node-7', and /etc/hosts says '127.0.1.1 node-7' (Debian's default)."""
    real = socket.getaddrinfo

    def getaddrinfo(host, *args, **kwargs):
        if host == "node-7":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.1.1", 0))]
        return real(host, *args, **kwargs)

    monkeypatch.setattr(_cluster_config.socket, "gethostname", lambda: "node-7")
    monkeypatch.setattr(_cluster_config.socket, "getaddrinfo", getaddrinfo)


def test_this_host_is_its_name_its_first_address_and_its_route(debian_hostname):
    assert _cluster_config.this_host("127.0.0.1:1234") == _host("node-7", "127.0.1.1", "127.0.0.1")


class _FakeClient:
    """The coordination service's key-value store, with the other process's entry in it."""

    def __init__(self, entries):
        self.store = dict(entries)

    def key_value_set(self, key, value):
        self.store[key] = value

    def blocking_key_value_get(self, key, timeout_ms):
        return self.store[key]


@pytest.mark.parametrize(
    "other, raises",
    [(_host("node-8", "10.1.2.4", "10.1.2.4"), True),  # another host: gloo would abort
     (_host("node-7", "127.0.1.1", "10.1.2.3"), False)],  # this host: loopback is fine
)  # fmt: skip
def test_initialize_raises_on_every_process_before_gloo_starts(
    fresh, debian_hostname, other, raises
):
    import json

    client = _FakeClient({"jmirror/hosts/1": json.dumps(other.__dict__)})
    shutdowns = []
    fresh.setattr(distributed._shim, "distributed_client", lambda: client)
    fresh.setattr(distributed.jax, "process_count", lambda: 2)
    fresh.setattr(distributed.jax, "process_index", lambda: 0)
    fresh.setattr(distributed.jax.distributed, "shutdown", lambda: shutdowns.append(1))
    fresh.setattr(_cluster_config, "_route_to", lambda address: "10.1.2.3")  # process 0's host
    request = _cluster_config.Request("arguments", "10.1.2.3:1234", 2, 0, 10, None, None)
    if not raises:
        distributed._check_hosts_reachable(request, 300)
        assert not shutdowns
        return
    with pytest.raises(OSError) as error:
        distributed._check_hosts_reachable(request, 300)
    message = str(error.value)
    assert "process 0: host name 'node-7' resolves to 127.0.1.1, a loopback address" in message
    assert "put the line '10.1.2.3 node-7' in /etc/hosts" in message
    assert "process 1:" not in message
    assert shutdowns == [1]  # the runtime is left before the error, on every process


def _launched_alone(extra_env: dict[str, str]) -> subprocess.CompletedProcess:
    """One process started as the launcher starts it (`JMIRROR_*`), summing over 4 host devices."""
    code = textwrap.dedent("""
        import jmirror as jm
        jm.distributed.initialize()
        import jax, numpy as np
        strategy = jm.MirroredStrategy()
        total = jm.replicate(lambda x: jm.all_reduce("sum", x), strategy=strategy)
        x = strategy.distribute_values_from_function(
            lambda context: np.float32(context.replica_id + 1))
        print("sum", float(strategy.read(total(x))), jax.process_count())
    """)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **extra_env}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=STARTUP_S, env=env
    )


@starts_processes
def test_one_launched_process_sums_with_xlas_collectives_not_gloo():
    env = {
        "JMIRROR_COORDINATOR": f"127.0.0.1:{_free_port()}",
        "JMIRROR_NUM_PROCESSES": "1",
        "JMIRROR_PROCESS_ID": "0",
        "JMIRROR_DEVICES_PER_PROCESS": "4",
    }
    result = _launched_alone(env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["sum", "10.0", "1"]  # 1 + 2 + 3 + 4
    assert "[Gloo]" not in result.stdout + result.stderr  # gloo reports the ranks it connects
