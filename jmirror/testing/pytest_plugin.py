"""A pytest plugin: run a test suite on N fake CPU host devices with one option.

Installed with jmirror (entry point `pytest11`), it adds `--jmirror-devices N`, which sets the
host device count before any test touches JAX's devices, and the fixtures `jmirror_strategy`
(a `MirroredStrategy` over every device) and `jmirror_emulated` (an `EmulatedStrategy` with as
many replicas). Without the option it takes the environment variable `JMIRROR_TEST_DEVICES`,
then the ini option `jmirror_devices = N`; with none of them it leaves JAX's count alone.
"""

from __future__ import annotations

import argparse
import os

import pytest

_ENV = "JMIRROR_TEST_DEVICES"


def _device_count(text: str) -> int:
    """Returns a device count of at least 1, or raises a usage error naming the option."""
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(
            f"--jmirror-devices expects a number of host devices of at least 1, got {text!r}."
        )
    return count


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("jmirror")
    group.addoption(
        "--jmirror-devices",
        type=_device_count,
        default=None,
        help="number of XLA:CPU host devices to run the tests on (set before JAX starts)",
    )
    parser.addini("jmirror_devices", "number of XLA:CPU host devices for the tests", default="")


def pytest_configure(config: pytest.Config) -> None:
    count = config.getoption("--jmirror-devices")
    for name, text in (
        (f"the environment variable {_ENV}", os.environ.get(_ENV, "")),
        ("the ini option jmirror_devices", config.getini("jmirror_devices")),
    ):
        if count is None and text:
            try:
                count = _device_count(text)
            except argparse.ArgumentTypeError as e:
                raise pytest.UsageError(f"{name}: {e}") from None
    if count is not None:
        from jmirror.testing._host import set_host_device_count

        set_host_device_count(count)


@pytest.fixture
def jmirror_strategy():
    """Returns a `MirroredStrategy` over every local device."""
    import jmirror

    return jmirror.MirroredStrategy()


@pytest.fixture
def jmirror_emulated():
    """Returns an `EmulatedStrategy` with one replica per local device, all on the first device."""
    import jax

    from jmirror.testing import EmulatedStrategy

    return EmulatedStrategy(jax.device_count())
