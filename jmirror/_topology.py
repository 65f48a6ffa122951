"""`Topology`: which devices, which mesh, which process, and how values are laid out.

A strategy holds one `Topology`, made once from its devices, and every part of jmirror that
places, reads or runs values asks it rather than the strategy: the replicas' devices in replica
order, the mesh over them, the layouts of distributed values (mirrored: the whole value on
every replica; stacked: slice i of a leading replica axis on replica i), where a read lands,
the specs a backend runs with, and which of those devices this process can address.

A replica spans `devices_per_replica` = k devices (section 13 of the spec). With k = 1 the mesh
is 1-D, named `axis_name`, and a mirrored leaf is one full copy per device. With k > 1 the mesh
is 2-D, `(axis_name, model_axis_name)` of shape (N, k): a mirrored leaf is replicated over the
replica axis and laid out inside each replica by a `PartitionSpec` over the model axis (its own
sharding metadata, else the strategy's `layout` rules, else replicated), and a stacked leaf is
split over the replica axis and replicated over the model axis. Everything that depends on k
lives here and in `jmirror._backends`.

An emulated topology (`Topology.emulated`, for `jmirror.testing.EmulatedStrategy`) puts every
replica on one device: both layouts are then that device, and per-replica values are stacked
arrays on it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, Sharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from jmirror._devices import Device
from jmirror._values import PyTree

# How a strategy lays out mirrored leaves inside a replica: a callable
# `(path, leaf) -> PartitionSpec | None`, or `(regex, PartitionSpec)` pairs.
LayoutRules = Callable[[Any, Any], "P | None"] | Sequence[tuple[str, P]] | None

_NO_MESH = contextlib.nullcontext()  # reusable: the scope of k = 1, entered on every call

_BAD_SPEC = (
    "{call}: the layout of the mirrored leaf at {path} of shape {shape} is {spec}, which {why}. "
    "A mirrored leaf is replicated over the replica axis {axis!r} and laid out inside a replica "
    "over the model axis {model!r} only ({k} devices per replica): give a PartitionSpec that "
    "names only {model!r}, on a dimension that {k} divides (or None for replicated)."
)


@dataclasses.dataclass(frozen=True, eq=False)
class Topology:
    """The devices of a strategy's replicas and the layouts of values on them.

    Make one with `Topology.create(devices, axis_name)` (one replica per device, or
    `devices_per_replica` consecutive devices per replica, in the given order) or
    `Topology.emulated(device, num_replicas, axis_name)`.

    Attributes:
      devices: every device, in replica order (replica i holds `replica_devices(i)`; every
        process's devices).
      axis_name: the collective axis name of the replicas.
      mesh: the mesh over `devices`: 1-D named `axis_name` (k = 1), or 2-D
        `(axis_name, model_axis_name)` of shape (N, k).
      mirrored: the layout of a mirrored value replicated inside each replica (fully
        replicated over `devices`); `mirrored_sharding` gives a leaf's own.
      stacked: the layout of per-replica values (leading axis split over the replicas,
        replicated inside each); `stacked_sharding` gives it for other inner specs.
      local_devices: the devices of `devices` this process can address, in replica order.
      process_index: this process's index; `process_count`: how many processes there are.
      is_emulated: whether every replica runs on one device.
      device_set: the devices as a set.
      timeout_s: the bound on a wait for other processes (`jmirror._deadline`), or None.
      devices_per_replica: k, how many devices one replica spans.
      model_axis_name: the mesh axis inside a replica (k > 1).
      layout: the rules that lay out mirrored leaves inside a replica (k > 1), or None.
    """

    devices: tuple[Device, ...]
    axis_name: str
    mesh: Mesh
    mirrored: Sharding
    stacked: Sharding
    local_devices: tuple[Device, ...]
    process_index: int
    process_count: int
    is_emulated: bool
    device_set: frozenset[Device]  # the devices as a set, for layout checks on every read
    timeout_s: float | None = None
    devices_per_replica: int = 1
    model_axis_name: str = "model"
    layout: Any = None

    @classmethod
    def create(
        cls,
        devices: Sequence[Device],
        axis_name: str,
        timeout_s: float | None = None,
        *,
        devices_per_replica: int = 1,
        model_axis_name: str = "model",
        layout: LayoutRules = None,
        call: str = "MirroredStrategy",
    ) -> Topology:
        """Returns the topology of replicas over `devices` (distinct, one platform), in that order:
        replica i runs on `devices[i*k:(i+1)*k]` for k = `devices_per_replica` (checked to divide
        them)."""
        devices = tuple(devices)
        k = check_devices_per_replica(devices_per_replica, len(devices), call)
        _check_processes(devices, k, call)
        if k == 1:
            mesh = Mesh(np.array(devices), (axis_name,))
        else:
            grid = np.array(devices).reshape(len(devices) // k, k)
            mesh = Mesh(grid, (axis_name, model_axis_name))
        me = jax.process_index()
        return cls(
            devices=devices,
            axis_name=axis_name,
            mesh=mesh,
            mirrored=NamedSharding(mesh, P()),
            stacked=NamedSharding(mesh, P(axis_name)),
            local_devices=tuple(d for d in devices if d.process_index == me),
            process_index=me,
            process_count=len({d.process_index for d in devices}),
            is_emulated=False,
            device_set=frozenset(devices),
            timeout_s=timeout_s,
            devices_per_replica=k,
            model_axis_name=model_axis_name,
            layout=_check_rules(layout),
        )

    @classmethod
    def emulated(cls, device: Device, num_replicas: int, axis_name: str) -> Topology:
        """Returns a topology of `num_replicas` replicas, all on `device` (replicas run through
        `jax.vmap`)."""
        sharding = SingleDeviceSharding(device)
        return cls(
            devices=(device,) * num_replicas,
            axis_name=axis_name,
            mesh=Mesh(np.array([device]), (axis_name,)),
            mirrored=sharding,
            stacked=sharding,
            local_devices=(device,) * num_replicas,
            process_index=jax.process_index(),
            process_count=1,
            is_emulated=True,
            device_set=frozenset((device,)),
        )

    @classmethod
    def of_mesh(cls, mesh: Mesh) -> Topology:
        """Returns the topology whose mesh is `mesh` (as a strategy made it): its first axis names
        the replicas, a second one the devices inside a replica."""
        names = mesh.axis_names
        k = mesh.devices.shape[1] if len(names) == 2 else 1
        model = str(names[1]) if len(names) == 2 else "model"
        return cls.create(
            tuple(mesh.devices.flat), str(names[0]), devices_per_replica=k, model_axis_name=model
        )

    # --- the replicas --------------------------------------------------------------------------

    @property
    def num_replicas(self) -> int:
        """Returns how many replicas (one per `devices_per_replica` entries of `devices`)."""
        return len(self.devices) // self.devices_per_replica

    @property
    def num_local_replicas(self) -> int:
        """Returns how many replicas run on this process's devices."""
        return len(self.local_devices) // self.devices_per_replica

    @property
    def first_local_device(self) -> Device:
        """Returns the first of this process's devices: where a value read on this process lives."""
        return self.local_devices[0]

    @property
    def local_replica_ids(self) -> tuple[int, ...]:
        """Returns the replica index of each replica on this process's devices."""
        if self.is_emulated:
            return tuple(range(self.num_replicas))
        k = self.devices_per_replica
        index = {d: i // k for i, d in enumerate(self.devices)}
        return tuple(index[d] for d in self.local_devices[::k])

    def replica_devices(self, i: int) -> tuple[Device, ...]:
        """Returns the devices replica `i` runs on, in the caller's order."""
        if self.is_emulated:
            return (self.devices[i],)
        k = self.devices_per_replica
        return self.devices[i * k : (i + 1) * k]

    @property
    def platform(self) -> str:
        """Returns the platform of the devices (`"cpu"`, `"gpu"`, `"tpu"`)."""
        return self.devices[0].platform

    @property
    def num_devices(self) -> int:
        """Returns how many distinct devices the replicas run on (1 when emulated)."""
        return 1 if self.is_emulated else len(self.devices)

    # --- layouts -------------------------------------------------------------------------------

    def layout_spec(self, path: tuple, leaf: PyTree, call: str = "strategy.mirror") -> P:
        """Returns the `PartitionSpec` inside a replica of the mirrored leaf `leaf` at `path`: its
        own sharding metadata when that names only the model axis, else the `layout` rules, else
        replicated (always replicated when k = 1). A bad spec is a `ValueError` naming the
        path, shape and spec."""
        if self.devices_per_replica == 1 or self.is_emulated:
            return P()
        spec = self._own_spec(leaf)
        if spec is None:
            spec = self._rule_spec(path, leaf)
        if spec is None:
            return P()
        self.check_spec(path, np.shape(leaf), spec, call)
        return spec

    def _own_spec(self, leaf: PyTree) -> P | None:
        """Returns the spec of `leaf`'s own metadata when it names only the model axis: a laid-out
        `jax.Array` of this mesh, an NNX `Variable`'s `sharding`, a linen `Partitioned` box."""
        names = _metadata_names(leaf)
        sharding = getattr(leaf, "sharding", None)
        if names is None and isinstance(sharding, NamedSharding):
            if sharding.mesh.shape_tuple == self.mesh.shape_tuple:
                names = tuple(sharding.spec)
        elif names is None and isinstance(sharding, (tuple, P)):
            names = tuple(sharding)
        if not names:
            return None
        flat = {n for entry in names for n in (entry if isinstance(entry, tuple) else (entry,))}
        if flat - {None} != {self.model_axis_name}:
            return None
        return P(*names)

    def _rule_spec(self, path: tuple, leaf: PyTree) -> P | None:
        rules = self.layout
        if rules is None:
            return None
        if callable(rules):
            spec: Any = rules(path, leaf)
            return spec
        where = jax.tree_util.keystr(tuple(path))
        for pattern, spec in rules:
            if re.search(pattern, where):
                return spec
        return None

    def check_spec(
        self, path: tuple, shape: tuple[int, ...], spec: jax.sharding.PartitionSpec, call: str
    ) -> None:
        """Raises a `ValueError` naming the path, shape and spec unless `spec` lays out a leaf of
        `shape` inside one replica."""
        why = _spec_problem(
            spec, shape, self.axis_name, self.model_axis_name, self.devices_per_replica
        )
        if why:
            where = jax.tree_util.keystr(tuple(path)) or "<root>"
            raise ValueError(
                _BAD_SPEC.format(
                    call=call,
                    path=where,
                    shape=tuple(shape),
                    spec=spec,
                    why=why,
                    axis=self.axis_name,
                    model=self.model_axis_name,
                    k=self.devices_per_replica,
                )
            )

    def mirrored_sharding(self, spec: P | None = None) -> Sharding:
        """Returns the layout of a mirrored leaf laid out by `spec` inside each replica (`mirrored`
        for None or `P()`)."""
        if spec is None or not tuple(spec) or self.is_emulated:
            return self.mirrored
        return NamedSharding(self.mesh, spec)

    def leaf_sharding(self, path: tuple, leaf: PyTree, call: str = "strategy.mirror") -> Sharding:
        """Returns the layout of the mirrored leaf `leaf` at `path` (`layout_spec`)."""
        return self.mirrored_sharding(self.layout_spec(path, leaf, call))

    def stacked_sharding(self, spec: P | None = None) -> Sharding:
        """Returns the layout of a per-replica stack whose components are laid out by `spec` inside
        each replica (`stacked` for None or `P()`)."""
        if spec is None or not tuple(spec) or self.is_emulated:
            return self.stacked
        return NamedSharding(self.mesh, P(self.axis_name, *spec))

    def pieces_sharding(self, length: int) -> Sharding:
        """Returns the layout of `[N, length]` stacked pieces (`jm.shard_update`'s state): split
        over the replica axis, and over the model axis too when k divides `length` (1/(N*k) of a
        leaf per device)."""
        k = self.devices_per_replica
        if k == 1 or self.is_emulated or length % k:
            return self.stacked
        return self.stacked_sharding(P(self.model_axis_name))

    def read_sharding(self, x: jax.Array, replica: int = 0) -> Sharding:
        """Returns where a read of the mirrored leaf `x` lands: replica `replica`'s device (k = 1),
        or its devices, laid out as `x` is inside a replica (k > 1)."""
        devices = self.replica_devices(replica)
        if len(devices) == 1:
            return SingleDeviceSharding(devices[0])
        spec = x.sharding.spec if isinstance(x.sharding, NamedSharding) else P()
        return NamedSharding(Mesh(np.array(devices), (self.model_axis_name,)), spec)

    def spec(self, split: bool) -> P:
        """Returns the spec a backend maps a flat input or output with: split over the replica axis
        (a per-replica stack) or not (mirrored; its layout inside a replica stays automatic)."""
        return P(self.axis_name) if split else P()

    def specs(self, split: Sequence[bool]) -> tuple[P, ...]:
        """Returns `spec` of each flat input or output."""
        return tuple(self.spec(s) for s in split)

    @property
    def manual_axes(self) -> frozenset[str]:
        """Returns the mesh axes a backend maps by hand: the replica axis (inside a replica, XLA
        partitions the model axis)."""
        return frozenset((self.axis_name,))

    def is_mirrored(self, x: jax.Array) -> bool:
        """Returns whether `x` is laid out as a mirrored value of this topology."""
        sharding = x.sharding
        if sharding == self.mirrored:
            return True
        if sharding.is_fully_replicated:
            return sharding.device_set == self.device_set
        return (
            self.devices_per_replica > 1
            and isinstance(sharding, NamedSharding)
            and sharding.mesh.shape_tuple == self.mesh.shape_tuple
            and sharding.device_set == self.device_set
            and not names_axis(sharding.spec, self.axis_name)
        )

    def is_stacked_elsewhere(self, x: object) -> bool:
        """Returns whether `x` is stacked per replica over a mesh of this replica axis name but
        other devices (placed by another strategy)."""
        sharding = getattr(x, "sharding", None)
        return (
            isinstance(sharding, NamedSharding)
            and sharding.mesh.axis_names[:1] == (self.axis_name,)
            and sharding.device_set != self.device_set
        )

    def is_pmap_layout(self, x: jax.Array) -> bool:
        """Returns whether `x` is laid out the `jax.pmap` way over these devices: a leading axis of
        `num_replicas` whose slices lie one per device (what `flax.jax_utils.replicate` and
        `prefetch_to_device` return), rather than mirrored."""
        n = self.num_replicas
        if self.is_emulated or n == 1 or not x.ndim or x.shape[0] != n:
            return False
        sharding = x.sharding
        return (
            not sharding.is_fully_replicated
            and sharding.device_set == self.device_set
            and sharding.shard_shape(x.shape)[0] == 1
        )

    def is_placed(self, x: jax.Array) -> bool:
        """Returns whether `x` lives on exactly this topology's devices."""
        return x.sharding.device_set == self.device_set

    def mesh_scope(self) -> contextlib.AbstractContextManager[Any]:
        """Returns the context of a strategy's `scope`: with k > 1 `mesh` is the current mesh there
        (`jax.set_mesh`), so that modules with partitioning metadata can be built inside."""
        if self.devices_per_replica == 1:
            return _NO_MESH
        return jax.set_mesh(self.mesh)

    def call_scope(self, traced: bool) -> tuple[contextlib.AbstractContextManager[Any], bool]:
        """Returns the mesh context of a replicated call at k > 1, and whether the call is inside
        a trace of the caller's (`traced`: its arguments are tracers; or a `jax.jit` closing over
        them), where `jax.set_mesh` is refused and the mesh's abstract form is current instead.

        `jax.set_mesh` sets the mesh when it is made and refuses (`ValueError`) only inside a
        trace for a strategy's mesh: JAX has no public query of its trace state.
        """
        if not traced:
            try:
                return jax.set_mesh(self.mesh), False
            except ValueError:
                pass
        return jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh), True

    def describe_spanning(self) -> str:
        """Returns the strategy repr's part about replicas spanning devices (empty when k = 1)."""
        k = self.devices_per_replica
        return (
            f", devices_per_replica={k}, model_axis_name={self.model_axis_name!r}" if k > 1 else ""
        )

    def __repr__(self) -> str:
        devices = ", ".join(f"{d.platform}:{d.id}" for d in self.devices)
        k = self.devices_per_replica
        per = f", devices_per_replica={k}" if k > 1 else ""
        return f"Topology(devices=[{devices}], axis_name={self.axis_name!r}{per})"


def _spec_problem(
    spec: object, shape: tuple[int, ...], axis: str, model: str, k: int
) -> str | None:
    """Returns what is wrong with `spec` as the layout of a leaf of `shape` inside one replica
    of `k` devices (model axis `model`, replica axis `axis`), or None."""
    if not isinstance(spec, P):
        return f"is not a jax.sharding.PartitionSpec (a {type(spec).__name__})"
    if len(spec) > len(shape):
        return f"has more entries than the leaf has dimensions ({len(shape)})"
    for dim, entry in zip(shape, spec):
        names = entry if isinstance(entry, tuple) else (entry,)
        if axis in names:
            return f"names the replica axis {axis!r}"
        if set(names) - {None, model}:
            return f"names an axis other than {model!r}"
        if model in names and dim % k:
            return f"splits a dimension of {dim} that {k} does not divide"
    return None


def check_devices_per_replica(k: object, num_devices: int, call: str = "MirroredStrategy") -> int:
    """Returns `k` when it is an int >= 1 that divides `num_devices`, else raises a `ValueError`
    naming both (a `TypeError` for a non-int)."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise TypeError(
            f"{call}(devices_per_replica={k!r}): expected an int >= 1 (how many devices one "
            "replica spans)."
        )
    if k < 1 or num_devices % k:
        raise ValueError(
            f"{call}(devices_per_replica={k}) needs an int >= 1 that divides the {num_devices} "
            f"device(s) (each replica spans devices_per_replica of them): {k} does not. Pick a "
            f"divisor of {num_devices}, or pass devices / num_devices so that their count is a "
            f"multiple of it."
        )
    return int(k)


def _check_processes(devices: Sequence[Device], k: int, call: str) -> None:
    """Raises a `ValueError` unless each process holds a multiple of k of `devices` (a replica's
    devices belong to one process)."""
    counts: dict[int, int] = {}
    for d in devices:
        counts[d.process_index] = counts.get(d.process_index, 0) + 1
    for process, count in sorted(counts.items()):
        if count % k:
            raise ValueError(
                f"{call}(devices_per_replica={k}): a replica's devices belong to one process, "
                f"but process {process} has {count} device(s), which {k} does not divide. Pick "
                "a devices_per_replica that divides every process's local device count."
            )


# What a library's metadata boxes declare: functions giving the partitioning names of `x`
# when it is such a box (a linen `Partitioned`, an NNX `Variable`; `()` for a box that names
# none), else None. Registered by the module owning the library (`jmirror._flax`).
BOX_NAMES: list[Callable[[Any], Any]] = []


def register_box(names_of: Callable[[Any], Any]) -> None:
    """Makes `declared_leaves` and the layout rules read the boxes `names_of` recognises."""
    if names_of not in BOX_NAMES:
        BOX_NAMES.append(names_of)


def _box_names(x: PyTree) -> Any:
    """Returns the partitioning names a registered box declares, or None."""
    for names_of in BOX_NAMES:
        names = names_of(x)
        if names is not None:
            return names
    return None


def _metadata_names(leaf: PyTree) -> Any:
    """Returns the partitioning names a leaf's own metadata gives: a registered box's, a
    `Declared`'s `sharding_names`, or None."""
    names = _box_names(leaf)
    if names is not None:
        return names or None
    return getattr(leaf, "sharding_names", None) or getattr(leaf, "names", None)


def names_axis(spec: P | tuple, axis: str) -> bool:
    return any(axis in (e if isinstance(e, tuple) else (e,)) for e in spec)


def _check_rules(layout: Any) -> Any:
    """Returns `layout` as given (a callable), or its `(regex, PartitionSpec)` pairs as a tuple."""
    if layout is None or callable(layout):
        return layout
    if isinstance(layout, (str, bytes)) or not isinstance(layout, Sequence):
        raise TypeError(
            "MirroredStrategy(layout=...) expects a callable (path, leaf) -> PartitionSpec | "
            f"None or a sequence of (regex, PartitionSpec) pairs, got {layout!r}."
        )
    rules = tuple(layout)
    for rule in rules:
        if not (
            isinstance(rule, tuple)
            and len(rule) == 2
            and isinstance(rule[0], str)
            and isinstance(rule[1], P)
        ):
            raise TypeError(
                f"MirroredStrategy(layout=...): the rule {rule!r} is not a (regex, "
                "PartitionSpec) pair, e.g. (r'dense.*kernel', P(None, 'model'))."
            )
        re.compile(rule[0])
    return rules


# --- what a leaf declares ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Declared:
    """A mirrored leaf's shape and the layout its metadata declares (`sharding_names`, as
    `Topology.layout_spec` reads it), standing in for the leaf where the metadata lives
    beside the array: an NNX `Variable`'s written-back value, a linen `Partitioned` box's."""

    shape: tuple[int, ...]
    sharding_names: tuple | None

    @classmethod
    def of(cls, box: Any, shape: Sequence[int]) -> Declared:
        """Returns what `box` (a linen metadata box, an NNX `Variable`) declares of a leaf of
        `shape`."""
        names = _metadata_names(box)
        return cls(tuple(shape), tuple(names) if names else None)


def declared_leaves(tree: PyTree, is_leaf: Callable[[Any], bool] | None = None) -> list:
    """Returns `(path, leaf, like)` for every leaf of `tree` in flattening order (with `is_leaf`):
    `like` is what the layout rules look at (`Topology.layout_spec`), the leaf itself, or for
    the value of a registered metadata box (`register_box`: linen's `nn.Partitioned`, an NNX
    `Variable` with `out_sharding`) a `Declared` with the box's names (a leaf's own metadata
    comes first)."""

    def stop(x: object) -> bool:
        return _is_box(x) or (is_leaf is not None and is_leaf(x))

    found = []
    for path, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=stop)[0]:
        if not _is_box(node) or (is_leaf is not None and is_leaf(node)):
            found.append((path, node, node))
            continue
        inner = jax.tree_util.tree_flatten_with_path(node, is_leaf=is_leaf)[0]
        for p, leaf in inner:
            like = Declared.of(node if len(inner) == 1 else None, np.shape(leaf))
            found.append((path + p, leaf, like))
    return found


def _is_box(x: object) -> bool:
    """Returns whether `x` is a registered box that declares partitioning names."""
    return bool(_box_names(x))
