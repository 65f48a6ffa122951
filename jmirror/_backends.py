"""The backends that run a replica jaxpr on every replica: one registry, three entries.

Each backend turns the proven jaxpr of a replica function into a function of the flat inputs
(split inputs stacked on a leading replica axis, the others shared) that returns the flat
outputs (varying ones stacked, identical ones once), plus a scalar token when the step has no
array output (see `jmirror._dispatch`):

- `"pmap"`: `jax.pmap` over the topology's devices (the default);
- `"shard_map"`: `jax.shard_map` over the topology's mesh, with `check_vma=False` so that
  differentiation keeps `jax.pmap` semantics; manual over the replica axis only, so that on a
  2-D mesh (replicas spanning k devices) XLA partitions each replica over the model axis;
- `"vmap"`: every replica on one device through `jax.vmap` with the replica axis name (an
  emulated topology: `jmirror.testing.EmulatedStrategy`).

`out_paths` (optional): each flat output's path, or `Output(path, like)` with the input leaf
it replaces; with replicas spanning several devices the mirrored outputs are then laid out by
the topology's rules (`Topology.leaf_sharding`), so that state keeps its layout from step to
step.

The topology owns the layout: the specs a backend maps its inputs and outputs with
(`Topology.specs`) and the mesh axes it maps by hand (`Topology.manual_axes`).
`jm.replicate` calls them inside its own `jax.jit`; this is the only module that calls
`jax.pmap` or `jax.shard_map`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jmirror._topology import Topology

Executable = Callable[..., Sequence[jax.Array]]


def _done_token(needs_token: bool) -> tuple[jax.Array, ...]:
    """Returns a scalar output for a step with no array outputs, for the in-flight bound."""
    return (jnp.zeros((), jnp.int8),) if needs_token else ()


def _pmap_executable(
    topology: Topology,
    closed: Any,
    split: Sequence[bool],
    out_split: Sequence[bool],
    needs_token: bool,
    out_paths: Sequence[Any] | None = None,
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
    out_paths: Sequence[Any] | None = None,
) -> Executable:
    spanning = topology.devices_per_replica > 1
    body = _with_replica_ids(closed, topology) if spanning else None
    plain = jex.jaxpr_as_fun(closed)
    split = tuple(split) + ((True,) if spanning else ())

    def replica(*flat):
        flat = [x[0] if s else x for x, s in zip(flat, split)]
        outs = body(*flat) if body is not None else plain(*flat)
        outs = [o[None] if s else o for o, s in zip(outs, out_split)]
        return (*outs, *_done_token(needs_token))

    in_specs = topology.specs(split)
    out_specs = topology.specs(out_split) + topology.specs((False,) * len(_done_token(needs_token)))
    mapped = jax.shard_map(
        replica,
        mesh=topology.mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names=set(topology.manual_axes),
        check_vma=False,
    )
    if not spanning:
        return mapped
    ids = np.arange(topology.num_replicas, dtype=np.int32)
    layouts = _out_layouts(topology, closed, out_split, out_paths)

    def run(*flat):
        outs = list(mapped(*flat, ids))
        for i, layout in layouts:
            outs[i] = jax.lax.with_sharding_constraint(outs[i], layout)
        return outs

    return run


class Output(NamedTuple):
    """An entry of `out_paths`: a flat output's path and what declares its layout, where
    that is not the output itself: a `jmirror._topology.Declared` (a linen box's names, the
    metadata of the NNX `Variable` it is written back to), or a leaf whose own layout counts."""

    path: tuple
    like: Any = None


def _out_layouts(
    topology: Topology, closed: Any, out_split: Sequence[bool], out_paths: Sequence[Any] | None
) -> list[tuple[int, Any]]:
    """Returns the layout of each mirrored output by the topology's rules
    (`Topology.leaf_sharding`), given the outputs' paths (key paths or `Output`s); without
    them XLA's propagation decides."""
    if out_paths is None:
        return []
    avals = closed.out_avals
    layouts = []
    for i, (entry, s) in enumerate(zip(out_paths, out_split)):
        if s:
            continue
        path, like = entry if isinstance(entry, Output) else (entry, None)
        if like is None:
            like = jax.ShapeDtypeStruct(avals[i].shape, avals[i].dtype)
        layouts.append((i, topology.leaf_sharding(path, like, "a replica function's output")))
    return layouts


def _with_replica_ids(closed: Any, topology: Topology) -> Callable[..., list[Any]]:
    """`closed` as a function of its inputs and, last, this replica's id, which stands for
    `axis_index(axis)`.

    Inside a shard_map manual over the replica axis only (replicas spanning several
    devices), JAX lowers `axis_index` through a nested shard_map that needs a mesh in
    context when the step is lowered; the replica id is an input instead (an iota split
    over the replicas), so the step lowers wherever it is lowered. Calls of `jax.jit` inside
    the replica function, and the primal bodies of `jax.custom_jvp` and `jax.custom_vjp`
    functions, are evaluated inline; `scan`, `cond`, `while` and `jax.checkpoint` are traced
    again with their bodies evaluated the same way. A `with_sharding_constraint` to a bare
    `PartitionSpec` (resolved against the mesh in context, `strategy.scope()`) is laid out
    over the strategy's mesh.
    """

    def run(*flat: Any) -> list[Any]:
        return _evaluate(closed.jaxpr, closed.consts, flat[:-1], flat[-1], topology)

    return run


def _on_mesh(value: Any, here: AbstractMesh) -> Any:
    """Returns a parameter's sharding over the abstract mesh it was traced with, over `here`."""
    if (
        isinstance(value, NamedSharding)
        and isinstance(value.mesh, AbstractMesh)
        and value.mesh != here
        and value.mesh.axis_names == here.axis_names
    ):
        return NamedSharding(here, value.spec)
    return value


# `jax.custom_jvp` / `jax.custom_vjp` functions (softplus, logaddexp, optax's sigmoid losses).
_CUSTOM_CALLS = ("custom_jvp_call", "custom_vjp_call")


def _evaluate(
    jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], rid: Any, topology: Topology
) -> list[Any]:
    env: dict[Any, Any] = {}
    axis = topology.axis_name
    # The mesh of this trace (the replica axis manual), not the one in context when the
    # replica function was traced (`strategy.scope()`'s, all automatic), which each
    # equation's context recorded.
    here = jax.sharding.get_abstract_mesh()

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jex.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name == "axis_index" and eqn.params["axis_name"] in (axis, (axis,)):
            outs = [rid]
        elif name in ("pjit", "jit", "closed_call") and "jaxpr" in eqn.params:
            inner = eqn.params.get("jaxpr") or eqn.params["call_jaxpr"]
            outs = _evaluate(inner.jaxpr, inner.consts, invals, rid, topology)
        elif name in _CALLBACKS:
            outs = _callback(eqn, invals, topology, here)
        elif name in _CONTROL_FLOW:
            outs = _CONTROL_FLOW[name](eqn.params, invals, rid, topology)
        elif name in _CUSTOM_CALLS and isinstance(eqn.params.get("call_jaxpr"), jex.ClosedJaxpr):
            # Differentiation is done: only the primal body runs. Bound whole, its body's
            # equations would run with the mesh recorded when they were traced.
            inner = eqn.params["call_jaxpr"]
            outs = _evaluate(inner.jaxpr, inner.consts, invals, rid, topology)
        elif name == "sharding_constraint" and isinstance(
            getattr(eqn.params["sharding"], "mesh", None), AbstractMesh
        ):
            layout = NamedSharding(topology.mesh, eqn.params["sharding"].spec)
            outs = [jax.lax.with_sharding_constraint(invals[0], layout)]
        else:
            with eqn.ctx.manager, jax.sharding.use_abstract_mesh(here):
                outs = _rebind(eqn, invals, here)
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _rebind(eqn: jex.JaxprEqn, invals: Sequence[Any], here: AbstractMesh) -> list[Any]:
    """Binds `eqn`'s primitive again on `invals`, its shardings over `here` (this trace's mesh)."""
    params = eqn.primitive.get_bind_params(eqn.params)
    if not here.empty:
        params = {k: _on_mesh(v, here) for k, v in params.items()}
    out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


# Control flow is traced again through JAX's own functions, its bodies evaluated here: the
# replica id stands for `axis_index` inside them too (lowered as is, it would open a second
# shard_map over the replica axis inside the first), and their equations run with this trace's
# mesh, as an outer `jax.grad` or `jax.vmap` of the step then transforms them.


def _cond(params: dict, invals: Sequence[Any], rid: jax.Array, topology: Topology) -> list[Any]:
    def branch(closed: jex.ClosedJaxpr) -> Callable[..., list[Any]]:
        return lambda *ops: _evaluate(closed.jaxpr, closed.consts, ops, rid, topology)

    return jax.lax.switch(invals[0], [branch(b) for b in params["branches"]], *invals[1:])


def _while(params: dict, invals: Sequence[Any], rid: jax.Array, topology: Topology) -> list[Any]:
    nc, nb = params["cond_nconsts"], params["body_nconsts"]
    cond_consts, body_consts, init = invals[:nc], invals[nc : nc + nb], invals[nc + nb :]
    cond_jaxpr, body_jaxpr = params["cond_jaxpr"], params["body_jaxpr"]

    def cond(carry: tuple) -> jax.Array:
        return _evaluate(
            cond_jaxpr.jaxpr, cond_jaxpr.consts, [*cond_consts, *carry], rid, topology
        )[0]

    def body(carry: tuple) -> tuple:
        ins = [*body_consts, *carry]
        return tuple(_evaluate(body_jaxpr.jaxpr, body_jaxpr.consts, ins, rid, topology))

    return list(jax.lax.while_loop(cond, body, tuple(init)))


def _scan(params: dict, invals: Sequence[Any], rid: jax.Array, topology: Topology) -> list[Any]:
    nc, nk, closed = params["num_consts"], params["num_carry"], params["jaxpr"]
    consts, init, xs = invals[:nc], invals[nc : nc + nk], invals[nc + nk :]

    def body(carry: tuple, x: tuple) -> tuple[tuple, tuple]:
        outs = _evaluate(closed.jaxpr, closed.consts, [*consts, *carry, *x], rid, topology)
        return tuple(outs[:nk]), tuple(outs[nk:])

    carry, ys = jax.lax.scan(
        body,
        tuple(init),
        tuple(xs),
        length=params["length"],
        reverse=params["reverse"],
        unroll=params["unroll"],
    )
    return [*carry, *ys]


def _remat(params: dict, invals: Sequence[Any], rid: jax.Array, topology: Topology) -> list[Any]:
    def body(*args: jax.Array) -> list[Any]:
        return _evaluate(params["jaxpr"], (), args, rid, topology)

    remat = jax.checkpoint(body, prevent_cse=params["prevent_cse"], policy=params["policy"])
    return list(remat(*invals))


# Host callbacks: JAX lowers them only where every mesh axis is manual.
_CALLBACKS = ("pure_callback", "io_callback")


def _callback(
    eqn: jex.JaxprEqn, invals: Sequence[Any], topology: Topology, here: AbstractMesh
) -> list:
    """Binds a host callback manual over the model axis too, with whole operands: it runs
    once per device of the replica, each on the replica's whole values. An ordered
    `io_callback` is refused: XLA:CPU aborts on its token there."""
    if eqn.params.get("ordered"):
        k = topology.devices_per_replica
        raise NotImplementedError(
            f"An ordered io_callback (io_callback(..., ordered=True)) inside a replica function "
            f"is not supported with replicas spanning {k} devices (devices_per_replica={k}): "
            "XLA cannot order a callback inside a replica laid out over several devices. Pass "
            "ordered=False (it then runs once on each of the replica's devices), or use "
            "devices_per_replica=1."
        )
    whole = jax.shard_map(
        lambda *args: _rebind(eqn, args, here),
        mesh=here,
        in_specs=tuple(P() for _ in invals),
        out_specs=[P() for _ in eqn.outvars],
        axis_names={topology.model_axis_name},
        check_vma=False,
    )
    return whole(*invals)


_CONTROL_FLOW: dict[str, Callable[[dict, Sequence[Any], Any, Topology], list[Any]]] = {
    "cond": _cond,
    "while": _while,
    "scan": _scan,
    "remat2": _remat,
    "checkpoint": _remat,
}


def _vmap_executable(
    topology: Topology,
    closed: Any,
    split: Sequence[bool],
    out_split: Sequence[bool],
    needs_token: bool,
    out_paths: Sequence[Any] | None = None,
) -> Executable:
    """Builds the executable running every replica on one device (`jax.vmap`, replica axis)."""
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


def choose(backend: str | None, topology: Topology, call: str = "MirroredStrategy") -> str:
    """Returns the backend a strategy runs on: `backend`, or with None `"pmap"` (one device per
    replica) or `"shard_map"` (replicas spanning several devices, which `jax.pmap` cannot
    run: `"pmap"` given then is a `ValueError`)."""
    k = topology.devices_per_replica
    if backend is None:
        return "shard_map" if k > 1 else "pmap"
    if backend == "pmap" and k > 1:
        raise ValueError(
            f'{call}(backend="pmap", devices_per_replica={k}): jax.pmap runs one replica per '
            'device; replicas spanning several devices run on backend="shard_map" (the '
            "default when devices_per_replica > 1): omit backend or pass "
            'backend="shard_map".'
        )
    return backend


def compiler_options(topology: Topology) -> tuple[tuple[str, str], ...]:
    """Returns the XLA compiler options of a step on `topology` (`()`: XLA's defaults).

    On XLA:CPU with replicas spanning devices, JAX lowers a collective of the replica axis
    with a sharding constraint inside its reduction (the other mesh axis is automatic), and
    XLA's pass that promotes bfloat16 and float16 all-reduces to float32 aborts the process on
    it ("Invalid binary instruction opcode copy"); XLA:CPU's collectives reduce those dtypes
    without it.
    """
    if topology.devices_per_replica > 1 and topology.devices[0].platform == "cpu":
        return _SPANNING_CPU
    return ()


_SPANNING_CPU = (("xla_disable_hlo_passes", "all-reduce-promotion"),)


def executable(backend: str, topology: Topology) -> Callable[..., Executable]:
    """Returns the backend that runs replica jaxprs for `backend` on `topology`.

    Across processes `"pmap"` runs as `"shard_map"`: JAX cannot run a `jax.pmap` nested in
    `jax.jit` there, and `jax.pmap` is `jax.jit(jax.shard_map(..., check_vma=False))` anyway,
    so the semantics are the same. Replicas spanning several devices (k > 1) run as
    `"shard_map"` too: manual over the replica axis only (`Topology.manual_axes`), so that XLA
    partitions each replica over its k devices.
    """
    if backend == "pmap" and (topology.process_count > 1 or topology.devices_per_replica > 1):
        return BACKENDS["shard_map"]
    return BACKENDS[backend]
