"""Two hosts on one machine: several hosts.

Two Linux network namespaces joined by a veth pair are two hosts: each has its own network
(10.77.0.1/24 or 10.77.0.2/24, and its own loopback), its own host name (a UTS namespace) and
its own /etc/hosts (a private bind mount in a mount namespace). One jmirror process of 4 host
devices runs in each, the coordinator on the first host's private address. Making namespaces
needs root and `ip netns`: elsewhere the tests skip, saying which is missing. They start
processes, so they run once, in the 8-device pass (the oracle is one process of 8 devices).
"""

import itertools
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import jmirror as jm

HERE = Path(__file__).parent / "multiprocess"
sys.path.insert(0, str(HERE))
import harness  # noqa: E402
from training import train  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("JMIRROR_TEST_DEVICES", "8") != "8" or len(jax.devices()) != 8,
    reason="starts processes: runs once, in the 8-device pass",
)
kill_leftover_launchers = harness.kill_leftover_launchers

SUBNET = "10.77.0"
PORT = 12321  # each host's network is new and empty: any port is free there
ERROR_S = 60  # as documented, the loopback host name is an error on every process within 60 s
_NAMESPACE = re.compile(r"^jmirror-(\d+)-[0-9a-f]+-[01]$")  # jmirror-<test pid>-<token>-<i>
_tokens = itertools.count()


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _why_not() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if not sys.platform.startswith("linux"):
        return f"two hosts need Linux network namespaces; this is {sys.platform}"
    if os.geteuid() != 0:
        return "two hosts need network namespaces (ip netns), which need root; not root here"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"two hosts need the {tool!r} command (iproute2 / util-linux); not found"
    return None


def _remove_leftovers() -> None:
    """Namespaces of an earlier test process that was killed before it could remove them."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    for line in listed.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = _NAMESPACE.match(name)
        if match and not harness.is_running(int(match.group(1))):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


class TwoHosts:
    """Two namespaces joined by a veth pair; `start` runs a process on one of them."""

    def __init__(self, out_dir: Path):
        token = f"{secrets.token_hex(3)}{next(_tokens)}"
        self.out_dir = out_dir
        self.namespaces = [f"jmirror-{os.getpid()}-{token}-{i}" for i in (0, 1)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in (0, 1)]
        self.hostnames = [f"jmirror-host-{i}" for i in (0, 1)]
        self.processes: list[harness.Background] = []

    def create(self) -> None:
        veth = [f"jm{self.namespaces[0].split('-')[2]}{i}"[:15] for i in "ab"]
        for name in self.namespaces:
            _ip("netns", "add", name)
        _ip("link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
        for name, device, address in zip(self.namespaces, veth, self.addresses):
            _ip("link", "set", device, "netns", name)
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", device)
            _ip("-n", name, "link", "set", device, "up")
            _ip("-n", name, "link", "set", "lo", "up")

    def remove(self) -> None:
        for process in self.processes:
            process.kill()
        for name in self.namespaces:  # the veth pair goes with its namespaces
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)

    def start(self, index: int, hostname_address: str, args, env) -> harness.Background:
        """`python ARGS` on host `index`, whose /etc/hosts maps its name to that address."""
        hostname = self.hostnames[index]
        hosts = self.out_dir / f"hosts{index}"
        hosts.write_text(f"127.0.0.1 localhost\n{hostname_address} {hostname}\n")
        prefix = ["ip", "netns", "exec", self.namespaces[index], "unshare", "--uts", "--mount"]
        prefix += ["sh", "-c", 'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && '
                   'exec "$@"', "sh", hostname, str(hosts)]  # fmt: skip
        process = harness.Background(args, self.out_dir, f"host{index}", env, prefix=prefix)
        self.processes.append(process)
        return process

    def start_run(self, args, hostname_addresses) -> list[harness.Background]:
        """One process of 4 host devices on each host, the coordinator on host 0."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("JMIRROR_")}
        env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
        env.update(JMIRROR_COORDINATOR=f"{self.addresses[0]}:{PORT}")
        env.update(JMIRROR_NUM_PROCESSES="2", JMIRROR_DEVICES_PER_PROCESS="4")
        return [
            self.start(i, hostname_addresses[i], args, {**env, "JMIRROR_PROCESS_ID": str(i)})
            for i in (0, 1)
        ]


@pytest.fixture
def two_hosts(tmp_path):
    why = _why_not()
    if why is not None:
        pytest.skip(why)
    _remove_leftovers()
    hosts = TwoHosts(tmp_path)
    try:
        hosts.create()
    except subprocess.CalledProcessError as error:
        hosts.remove()
        pytest.skip(f"ip netns is not available here: {' '.join(error.cmd)}: {error.stderr}")
    try:
        yield hosts
    finally:
        hosts.remove()


def _one_process():
    """The same training on one process of 8 devices: the oracle."""
    params, loss, _ = train(jm.MirroredStrategy())
    return params, float(loss)


def test_two_hosts_train_like_one_host(two_hosts, tmp_path):
    # Each host's name resolves to its private address: gloo connects the hosts.
    processes = two_hosts.start_run(
        [str(HERE / "train_worker.py"), str(tmp_path)], two_hosts.addresses
    )
    for process in processes:
        code, _ = process.wait(300)
        assert code == 0, process.output()
    for index, process in enumerate(processes):
        assert f"process {index} on host {two_hosts.hostnames[index]}" in process.output()
    params, loss = _one_process()
    for index in (0, 1):
        seen = np.load(tmp_path / f"process{index}.npz")
        np.testing.assert_allclose(seen["params"], params, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(seen["loss"], loss, rtol=1e-5)
        assert int(seen["count"]) == 6 * 8 * 4  # every example counted once


def test_a_host_name_on_loopback_is_an_error_on_every_process(two_hosts, tmp_path):
    # Debian's "127.0.1.1 <hostname>" line on both hosts: gloo would publish 127.0.1.1 and
    # the other host's connection would be refused, then the run would abort (SIGABRT).
    processes = two_hosts.start_run(
        [str(HERE / "train_worker.py"), str(tmp_path)], ["127.0.1.1", "127.0.1.1"]
    )
    for process in processes:
        code, seconds = process.wait(ERROR_S + 30)
        output = process.output()
        assert code == 1, f"exit code {code}:\n{output}"  # not 128 + SIGABRT
        assert code != 128 + signal.SIGABRT and seconds < ERROR_S, output
        assert "OSError: jm.distributed.initialize()" in output, output
        assert "Check failure" not in output and "process 0 on host" not in output, output
        for i in (0, 1):  # every process names every host, its address and the fix
            name, address = two_hosts.hostnames[i], two_hosts.addresses[i]
            assert f"host name '{name}' resolves to 127.0.1.1, a loopback address" in output
            assert f"put the line '{address} {name}' in /etc/hosts" in output, output
    assert not list(tmp_path.glob("process*.npz"))  # nothing trained


def test_a_loopback_host_name_on_one_host_only_is_named(two_hosts, tmp_path):
    # Host 1 alone has the loopback line: both processes raise, naming host 1 only.
    processes = two_hosts.start_run(
        [str(HERE / "train_worker.py"), str(tmp_path)], [two_hosts.addresses[0], "127.0.1.1"]
    )
    for process in processes:
        code, seconds = process.wait(ERROR_S + 30)
        output = process.output()
        assert code == 1 and seconds < ERROR_S, f"exit code {code}:\n{output}"
        assert f"process 1: host name '{two_hosts.hostnames[1]}' resolves to 127.0.1.1" in output
        assert "process 0: host name" not in output, output
