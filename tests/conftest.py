"""Test configuration. The host device count is set by jmirror's own pytest plugin
(`jmirror.testing.pytest_plugin`), before any test touches JAX's devices: from
`JMIRROR_TEST_DEVICES`, else `jmirror_devices = 8` in pyproject.toml. `scripts/test.sh` runs
the suite with 8 devices and again with 1.
"""

import jax
import pytest

import jmirror as jm

BACKENDS = ("pmap", "shard_map")


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def strategy(backend) -> jm.MirroredStrategy:
    return jm.MirroredStrategy(backend=backend)


@pytest.fixture
def n() -> int:
    return len(jax.devices())
