"""The backends that run a replica jaxpr on every replica: one registry, three entries.

Each backend turns the proven jaxpr of a replica function into a function of the flat inputs
(split inputs stacked on a leading replica axis, the others shared) that returns the flat
outputs (varying ones stacked, identical ones once), plus a scalar token when the step has no
array output (see `jmirror._dispatch`):

- `"pmap"`: `jax.pmap` over the topology's devices (the default);
- `"shard_map"`: `jax.shard_map` over the topology's mesh, with `check_vma=False` so that
  differentiation keeps `jax.pmap` semantics;
- `"vmap"`: every replica on one device through `jax.vmap` with the replica axis name (an
  emulated topology: `jmirror.testing.EmulatedStrategy`).

`jm.replicate` calls them inside its own `jax.jit`; this is the only module that calls
`jax.pmap` or `jax.shard_map`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jmirror._topology import Topology

Executable = Callable[..., Sequence[jax.Array]]


def _done_token(needs_token: bool) -> tuple[jax.Array, ...]:
    """A scalar output for a step with no array outputs, for the in-flight bound to wait on."""
    return (jnp.zeros((), jnp.int8),) if needs_token else ()


def _pmap_executable(
    topology: Topology,
    closed: Any,
    split: Sequence[bool],
    out_split: Sequence[bool],
    needs_token: bool,
) -> Executable:
    body = jex.jaxpr_as_fun(closed)
    # jax.pmap needs one mapped argument: a function of mirrored inputs only gets a dummy one.
    needs_mapped_input = not any(split)
    in_axes = tuple(0 if s else None for s in split) + ((0,) if needs_mapped_input else ())
    out_axes = tuple(0 if s else None for s in out_split) + (None,) * len(_done_token(needs_token))

    def replica(*flat):
        if needs_mapped_input:
            flat = flat[:-1]
        return (*body(*flat), *_done_token(needs_token))

    mapped = jax.pmap(
        replica,
        axis_name=topology.axis_name,
        in_axes=in_axes,
        out_axes=out_axes,
        devices=topology.devices,
    )
    if not needs_mapped_input:
        return mapped
    return lambda *flat: mapped(*flat, jnp.zeros((topology.num_replicas,), jnp.int8))


def _shard_map_executable(
    topology: Topology,
    closed: Any,
    split: Sequence[bool],
    out_split: Sequence[bool],
    needs_token: bool,
) -> Executable:
    body = jex.jaxpr_as_fun(closed)
    axis = topology.axis_name

    def replica(*flat):
        flat = [x[0] if s else x for x, s in zip(flat, split)]
        outs = [o[None] if s else o for o, s in zip(body(*flat), out_split)]
        return (*outs, *_done_token(needs_token))

    in_specs = tuple(P(axis) if s else P() for s in split)
    out_specs = tuple(P(axis) if s else P() for s in out_split)
    out_specs += (P(),) * len(_done_token(needs_token))
    return jax.shard_map(
        replica, mesh=topology.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
    )


def _vmap_executable(
    topology: Topology,
    closed: Any,
    split: Sequence[bool],
    out_split: Sequence[bool],
    needs_token: bool,
) -> Executable:
    """Every replica on one device, as `jax.vmap` with the replica axis name."""
    body = jex.jaxpr_as_fun(closed)
    replicas = jax.vmap(
        lambda *flat: tuple(body(*flat)),
        in_axes=tuple(0 if s else None for s in split) or 0,
        axis_name=topology.axis_name,
        axis_size=topology.num_replicas,
    )

    def run(*flat):
        outs = [o if s else o[0] for o, s in zip(replicas(*flat), out_split)]
        return (*outs, *_done_token(needs_token))

    return run


BACKENDS: dict[str, Callable[..., Executable]] = {
    "pmap": _pmap_executable,
    "shard_map": _shard_map_executable,
    "vmap": _vmap_executable,
}


def executable(backend: str, topology: Topology) -> Callable[..., Executable]:
    """The backend that runs replica jaxprs for `backend` on `topology`.

    Across processes `"pmap"` runs as `"shard_map"`: JAX cannot run a `jax.pmap` nested in
    `jax.jit` there, and `jax.pmap` is `jax.jit(jax.shard_map(..., check_vma=False))` anyway,
    so the semantics are the same.
    """
    if backend == "pmap" and topology.process_count > 1:
        return BACKENDS["shard_map"]
    return BACKENDS[backend]
