"""Test configuration. The host device count is set by jmirror's own pytest plugin
(`jmirror.testing.pytest_plugin`), before any test touches JAX's devices: from
`JMIRROR_TEST_DEVICES`, else `jmirror_devices = 8` in pyproject.toml. `scripts/test.sh` runs
the suite with 8 devices and again with 1.
"""

import os

import jax
import pytest

import jmirror as jm

BACKENDS = ("pmap", "shard_map")
ONCE_REASON = (
    "runs in processes of its own, which set their own device count: once, in the suite's "
    "8-device pass"
)


def pytest_configure(config):
    config.addinivalue_line("markers", f"once: {ONCE_REASON}")


def pytest_collection_modifyitems(config, items):
    # A test whose work happens in processes with their own device count would only repeat
    # itself in the other passes.
    if os.environ.get("JMIRROR_TEST_DEVICES", "8") == "8":
        return
    skip = pytest.mark.skip(reason=ONCE_REASON)
    for item in items:
        if item.get_closest_marker("once") is not None:
            item.add_marker(skip)


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def strategy(backend) -> jm.MirroredStrategy:
    return jm.MirroredStrategy(backend=backend)


@pytest.fixture
def n() -> int:
    return len(jax.devices())
