"""Real cluster launchers: Open MPI's `mpirun` and SLURM's `srun`, on this machine.

`jm.distributed.initialize()` with no arguments must find what JAX's cluster detection finds,
in JAX's order: `mpirun -np 2`, `srun -N1 -n2` and `srun -n1 mpirun -np 2` (Open MPI ranks
inside a one-task SLURM step: an Open MPI job of two processes) each train 2 processes x 4
host devices equal to one process of 8 devices. A busy coordinator port and a task that never
joins are errors naming the coordinator's address, port, count and index.

SLURM runs for real: munged, slurmctld and slurmd are started by the tests (one node, this
host, a slurm.conf in a temporary directory, free ports) and stopped after them. That needs
root, Linux and Debian's `openmpi-bin`, `slurm-wlm` and `munge` (`.ci/run` installs them where
it is root and apt-get is present); elsewhere the tests skip, saying what is missing. They
start processes, so they run once, in the 8-device pass.
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

HERE = Path(__file__).parent / "multiprocess"
sys.path.insert(0, str(HERE))
from training import train  # noqa: E402

import jmirror as jm  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("JMIRROR_TEST_DEVICES", "8") != "8" or len(jax.devices()) != 8,
    reason="starts processes: runs once, in the 8-device pass",
)
WORKER = HERE / "cluster_worker.py"
RUN_S = 240  # one launcher's whole run, bounded (about 10 s when the machine is idle)
MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2"]


def _why_not(*tools: str) -> str | None:
    if not sys.platform.startswith("linux"):
        return f"the launchers' tests run on Linux; this is {sys.platform}"
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        return (
            f"{', '.join(missing)} not found: install Debian's openmpi-bin, slurm-wlm and munge "
            "(apt-get install openmpi-bin slurm-wlm munge; .ci/run does so as root)"
        )
    if os.geteuid() != 0:
        return "starting munged, slurmctld and slurmd for a test needs root; not root here"
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _environment(**extra: str) -> dict[str, str]:
    """This environment without a cluster's or the launcher's variables (the suite may itself
    run inside a SLURM job), with 4 host devices per process."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "OMPI_", "PMIX_", "JMIRROR_", "JAX_COORDINATOR"))
    }
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4"
    env.update(extra)
    return env


def _run(command: list[str], env: dict[str, str]) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    try:
        run = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=RUN_S, cwd=HERE
        )
    except subprocess.TimeoutExpired as expired:
        raise AssertionError(f"{command} still running after {RUN_S} s: {expired}") from None
    return run, time.monotonic() - start


def _worker(out: Path, *args: str) -> list[str]:
    return [sys.executable, str(WORKER), str(out), *args]


class Slurm:
    """munged, slurmctld and slurmd for one node (this host), in a directory of their own."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.daemons: list[subprocess.Popen] = []
        self.conf = directory / "slurm.conf"
        self.env = _environment(SLURM_CONF=str(self.conf))

    def start(self) -> None:
        d = self.dir
        (d / "munge").mkdir(mode=0o700)
        for name in ("state", "spool", "log"):
            (d / name).mkdir()
        key = d / "munge" / "key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        socket_path = d / "munge" / "socket"
        node = socket.gethostname().split(".")[0]
        self.conf.write_text(
            "\n".join([
                "ClusterName=jmirror",
                f"SlurmctldHost={node}",
                f"SlurmctldPort={_free_port()}",
                f"SlurmdPort={_free_port()}",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"AuthInfo=socket={socket_path}",
                "SlurmUser=root",
                "SlurmdUser=root",
                f"StateSaveLocation={d / 'state'}",
                f"SlurmdSpoolDir={d / 'spool'}",
                f"SlurmctldPidFile={d / 'slurmctld.pid'}",
                f"SlurmdPidFile={d / 'slurmd.pid'}",
                f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}",
                f"SlurmdLogFile={d / 'log' / 'slurmd.log'}",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "MpiDefault=none",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                "SchedulerType=sched/builtin",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_Core",
                "SlurmdParameters=config_overrides",  # 8 CPUs whatever this machine has
                "ReturnToService=2",
                f"NodeName={node} CPUs=8 State=UNKNOWN",
                "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP "
                "OverSubscribe=YES",
                "",
            ])
        )  # fmt: skip
        munge = ["munged", "--foreground", "--force", f"--socket={socket_path}"]
        munge += [f"--key-file={key}", f"--pid-file={d / 'munge' / 'pid'}"]
        munge += [f"--log-file={d / 'log' / 'munged.log'}", f"--seed-file={d / 'munge' / 'seed'}"]
        self._daemon(munge, socket_path)
        self._daemon(["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._daemon(["slurmd", "-D", "-f", str(self.conf)])
        self._wait_until_idle()

    def _daemon(self, command: list[str], wait_for: Path | None = None) -> None:
        log = open(self.dir / "log" / f"{command[0]}.out", "wb")
        with log:
            self.daemons.append(
                subprocess.Popen(
                    command, stdout=log, stderr=log, env=self.env, start_new_session=True
                )
            )
        deadline = time.monotonic() + 30
        while wait_for is not None and not wait_for.exists():
            if time.monotonic() > deadline or self.daemons[-1].poll() is not None:
                raise RuntimeError(f"{command[0]} did not start: {self.logs()}")
            time.sleep(0.1)

    def _wait_until_idle(self) -> None:
        deadline = time.monotonic() + 60
        state = ""
        while time.monotonic() < deadline:
            sinfo = subprocess.run(
                ["sinfo", "-h", "-o", "%T"], env=self.env, capture_output=True, text=True,
                timeout=30,
            )  # fmt: skip
            state = sinfo.stdout.strip() + sinfo.stderr.strip()
            if state == "idle":
                return
            if any(daemon.poll() is not None for daemon in self.daemons):
                break
            time.sleep(0.3)
        raise RuntimeError(f"SLURM's node is not idle ({state!r}): {self.logs()}")

    def logs(self) -> str:
        return "\n".join(
            f"--- {path.name}\n{path.read_text(errors='replace')[-2000:]}"
            for path in sorted((self.dir / "log").glob("*"))
        )

    def stop(self) -> None:
        for daemon in reversed(self.daemons):
            if daemon.poll() is None:
                daemon.terminate()
                try:
                    daemon.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    daemon.kill()
                    daemon.wait(timeout=15)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    why = _why_not("srun", "sinfo", "slurmctld", "slurmd", "munged")
    if why:
        pytest.skip(why)
    cluster = Slurm(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def mpirun():
    why = _why_not("mpirun")
    if why:
        pytest.skip(why)


@pytest.fixture(scope="module")
def one_process():
    """The oracle: the same training on one process of 8 devices."""
    return train(jm.MirroredStrategy())


def _check_trained_like_one_process(run, out: Path, one_process) -> None:
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    params, loss, _ = one_process
    for index in (0, 1):
        joined = json.loads((out / f"joined{index}.json").read_text())
        assert joined["process_count"] == 2 and joined["process_index"] == index, joined
        seen = np.load(out / f"process{index}.npz")
        np.testing.assert_allclose(seen["params"], params, rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(seen["loss"], loss, rtol=2e-5)
        assert int(seen["count"]) == 6 * 8 * 4  # every example of 6 steps counted once


def test_mpirun_trains_like_one_process(mpirun, tmp_path, one_process):
    run, _ = _run([*MPIRUN, *_worker(tmp_path, "train")], _environment())
    _check_trained_like_one_process(run, tmp_path, one_process)


def test_srun_trains_like_one_process(slurm, tmp_path, one_process):
    run, _ = _run(["srun", "-N1", "-n2", *_worker(tmp_path, "train")], slurm.env)
    _check_trained_like_one_process(run, tmp_path, one_process)


def test_mpirun_inside_a_slurm_step_is_an_open_mpi_job(slurm, mpirun, tmp_path, one_process):
    # Each rank also sees the step's SLURM_NTASKS=1: alone, each would train by itself.
    command = ["srun", "-N1", "-n1", *MPIRUN, *_worker(tmp_path, "train")]
    run, _ = _run(command, slurm.env)
    _check_trained_like_one_process(run, tmp_path, one_process)


@pytest.fixture
def held_port():
    """A port held by a program that is not JAX's coordination service."""
    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        yield holder.getsockname()[1]


@pytest.mark.parametrize("launcher", ["srun", "mpirun"])
def test_a_busy_coordinator_port_is_named_within_seconds(request, tmp_path, held_port, launcher):
    request.getfixturevalue("slurm" if launcher == "srun" else "mpirun")
    if launcher == "srun":
        env = {**request.getfixturevalue("slurm").env, "JAX_COORDINATOR_PORT": str(held_port)}
        command = ["srun", "-N1", "-n2", *_worker(tmp_path, "join", "120")]
    else:
        env = _environment(JAX_COORDINATOR_PORT=str(held_port))
        command = [*MPIRUN, *_worker(tmp_path, "join", "120")]
    run, took = _run(command, env)
    output = run.stdout + run.stderr
    assert run.returncode != 0, output
    # Process 0 would bind the port: the documented OSError, naming it, before JAX starts.
    in_use = rf"OSError: \[Errno 98\] .*coordinator port {held_port} .*already in use"
    assert re.search(in_use, output), output
    assert "Failed to start RPC server" not in output and "Segmentation" not in output
    # Named as where the port came from, with the fix of that variable.
    assert f"JAX_COORDINATOR_PORT={held_port}" in output, output
    assert "The port is the one JAX_COORDINATOR_PORT sets" in output, output
    assert took < 60, f"{took:.0f} s: {output}"  # the other process did not wait minutes
    print(f"{launcher}: ended {took:.1f} s after it started")


def test_a_task_that_never_joins_is_named_with_the_coordinator(slurm, tmp_path):
    command = ["srun", "--kill-on-bad-exit=1", "-N1", "-n2", *_worker(tmp_path, "skip-0", "15")]
    env = {**slurm.env, "JAX_COORDINATOR_PORT": str(_free_port())}
    run, _ = _run(command, env)
    output = run.stdout + run.stderr
    assert run.returncode != 0, output
    node = socket.gethostname().split(".")[0]
    address = f"{node}:{env['JAX_COORDINATOR_PORT']}"
    assert re.search(r"timed out: jm.distributed.initialize\(\)", output), output
    named = (
        rf"process 0 did not call jm.distributed.initialize\(\) \(or cannot reach the "
        rf"coordinator at {re.escape(address)}\); this is process 1 of 2 \(from SLURM"
    )
    assert re.search(named, output), output
    assert "at None" not in output
