"""A pytest plugin: run a test suite on N fake CPU host devices with one option.

Installed with jmirror (entry point `pytest11`), it adds `--jmirror-devices N` (or the ini
option `jmirror_devices = N`), which sets the host device count before any test imports JAX's
devices, and the fixtures `jmirror_strategy` (a `MirroredStrategy` over every device) and
`jmirror_emulated` (an `EmulatedStrategy` with as many replicas).
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("jmirror")
    group.addoption(
        "--jmirror-devices",
        type=int,
        default=None,
        help="number of XLA:CPU host devices to run the tests on (set before JAX starts)",
    )
    parser.addini("jmirror_devices", "number of XLA:CPU host devices for the tests", default="")


def pytest_configure(config: pytest.Config) -> None:
    count = config.getoption("--jmirror-devices")
    if count is None and config.getini("jmirror_devices"):
        count = int(config.getini("jmirror_devices"))
    if count is not None:
        from jmirror.testing._host import set_host_device_count

        set_host_device_count(count)


@pytest.fixture
def jmirror_strategy():
    """A `MirroredStrategy` over every local device."""
    import jmirror

    return jmirror.MirroredStrategy()


@pytest.fixture
def jmirror_emulated():
    """An `EmulatedStrategy` with one replica per local device, all on the first device."""
    import jax

    from jmirror.testing import EmulatedStrategy

    return EmulatedStrategy(jax.device_count())
