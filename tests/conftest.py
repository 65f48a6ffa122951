"""Test configuration: the host device count is set here, once, before JAX starts.

`JMIRROR_TEST_DEVICES` (default 8) picks how many XLA:CPU host devices the suite sees; `.ci/run`
runs the suite with 8 and again with 1.
"""

import os

import jax
import pytest

import jmirror as jm
from jmirror.testing import set_host_device_count

NUM_DEVICES = int(os.environ.get("JMIRROR_TEST_DEVICES", "8"))
set_host_device_count(NUM_DEVICES)

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
