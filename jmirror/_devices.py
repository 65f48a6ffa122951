"""Resolving device specs: the only place jmirror turns user input into devices."""

from __future__ import annotations

import operator
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import jax

if TYPE_CHECKING:  # jaxlib ships no type stubs for jax.Device, a variable to type checkers
    Device: TypeAlias = Any
else:
    Device = jax.Device

DeviceSpec = Device | str

_SPEC_RE = re.compile(r"^/?(?:device:)?([a-z]+):(\d+)$", re.IGNORECASE)


def _describe_available() -> str:
    return ", ".join(f"{d.platform}:{i}" for i, d in enumerate(jax.local_devices()))


def _platform_devices(platform: str) -> list[Device]:
    """Returns local devices of `platform` in `jax.local_devices` order, or [] if it has none."""
    try:
        return list(jax.local_devices(backend=platform))
    except RuntimeError:
        return []


def _resolve_one(spec: Any) -> Device:
    if isinstance(spec, jax.Device):
        if spec not in jax.local_devices(backend=spec.platform):
            raise ValueError(
                f"MirroredStrategy(devices=...) got {spec!r}, which is not a local device of this "
                f"process. Local devices: {_describe_available()}. Pass local devices only."
            )
        return spec
    if isinstance(spec, str):
        match = _SPEC_RE.match(spec.strip())
        if match is None:
            raise ValueError(
                f"MirroredStrategy(devices=...) got the device spec {spec!r}, which is not of the "
                "form 'cpu:0', 'gpu:1', '/device:GPU:1' or '/cpu:0'. Local devices: "
                f"{_describe_available()}."
            )
        platform, index = match.group(1).lower(), int(match.group(2))
        candidates = _platform_devices(platform)
        if index >= len(candidates):
            raise ValueError(
                f"MirroredStrategy(devices=...) got {spec!r}, but this process has "
                f"{len(candidates)} local {platform} device(s). Local devices: "
                f"{_describe_available()}."
            )
        return candidates[index]
    raise ValueError(
        f"MirroredStrategy(devices=...) got {spec!r} of type {type(spec).__name__}; expected a "
        f"jax.Device or a string such as 'cpu:0'. Local devices: {_describe_available()}."
    )


def as_int(value: Any, call: str) -> int:
    """Returns an integer-like `value` (a Python or NumPy integer, not a bool) as an int."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"{call} expects an int, got {value!r} of type {type(value).__name__}.")


def resolve_devices(
    devices: Sequence[DeviceSpec] | None, num_devices: int | None
) -> tuple[Device, ...]:
    """Resolves `MirroredStrategy`'s device arguments to devices, in the caller's order."""
    if devices is not None and num_devices is not None:
        raise ValueError(
            f"MirroredStrategy got both devices={devices!r} and num_devices={num_devices!r}; "
            "pass one of them (or neither, for every local device)."
        )
    available = jax.local_devices()
    if devices is None:
        if num_devices is None:
            return tuple(available)
        num_devices = as_int(num_devices, "MirroredStrategy(num_devices=...)")
        if not 1 <= num_devices <= len(available):
            raise ValueError(
                f"MirroredStrategy(num_devices={num_devices}) needs 1 <= num_devices <= "
                f"{len(available)} (the local devices: {_describe_available()}). On a CPU, more "
                "host devices come from jmirror.testing.set_host_device_count before JAX starts."
            )
        return tuple(available[:num_devices])
    if isinstance(devices, (str, jax.Device)):
        devices = [devices]
    resolved = tuple(_resolve_one(spec) for spec in devices)
    if not resolved:
        raise ValueError(
            "MirroredStrategy(devices=[]) got an empty device list; pass at least one device, "
            f"or devices=None for all of {_describe_available()}."
        )
    if len(set(resolved)) != len(resolved):
        raise ValueError(
            f"MirroredStrategy(devices={list(devices)!r}) names the same device more than once "
            f"(resolved to {list(resolved)}); list each device once."
        )
    platforms = sorted({d.platform for d in resolved})
    if len(platforms) > 1:
        raise ValueError(
            f"MirroredStrategy(devices={list(devices)!r}) mixes platforms {platforms}; all devices "
            "of a strategy must be of one platform."
        )
    return resolved
