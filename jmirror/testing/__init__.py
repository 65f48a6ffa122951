"""Helpers for testing data-parallel code: fake host devices, assertions, an emulated strategy."""

from jmirror.testing._asserts import assert_mirrored as assert_mirrored
from jmirror.testing._asserts import assert_per_replica as assert_per_replica
from jmirror.testing._asserts import assert_replicas_equal as assert_replicas_equal
from jmirror.testing._emulated import EmulatedStrategy as EmulatedStrategy
from jmirror.testing._hlo import Collective as Collective
from jmirror.testing._hlo import collectives as collectives
from jmirror.testing._host import set_host_device_count as set_host_device_count

__all__ = [
    "Collective",
    "EmulatedStrategy",
    "assert_mirrored",
    "assert_per_replica",
    "assert_replicas_equal",
    "collectives",
    "set_host_device_count",
]
