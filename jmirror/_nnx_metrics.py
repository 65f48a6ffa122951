"""NNX metrics updated inside replica functions: sync-on-read state, read across replicas.

A metric passed to a replicated function (`nnx.metrics.Average`, `Accuracy`, `Welford`,
`MultiMetric`, or a `Metric` whose state are sums in `nnx.metrics.MetricState`) keeps one
component per replica: `metric_roles` says how each of its `Variable`s is read (`SUM` for
sums, `NONE` for a `Welford`, which `read_metrics` combines with Chan's parallel formula),
`start_metric` makes a replica's first component (the value on replica 0, zero elsewhere), and
the caller's `Variable`s hold `MetricComponents` after the call. Used by `jmirror._nnx`.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from jmirror._values import Aggregation, PerReplica, PyTree, SyncOnRead

if TYPE_CHECKING:
    from flax.nnx import Metric, Variable


def metric_roles(nnx: types.ModuleType, root: PyTree) -> dict[int, Aggregation]:
    """Returns, for each argument `Variable` (by position) that is a metric's state, how it is read:
    `SUM` for sums, `NONE` for a `Welford` (combined by `read_metrics`)."""
    is_variable = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    variables = [x for x in jax.tree_util.tree_leaves(root, is_leaf=is_variable) if is_variable(x)]
    position = {id(v): k for k, v in reversed(list(enumerate(variables)))}
    roles: dict[int, Aggregation] = {}
    for path, metric, own in _leaf_metrics(nnx, root):
        role = _aggregation(nnx, path, metric, own)
        for v in own:
            roles[position[id(v)]] = role
    return roles


def _where(path: tuple) -> str:
    """Returns `args[i]...` / `kwargs[...]` for a path into `([dynamic args], kwargs)`."""
    if path[0].idx == 1:
        return "kwargs" + jax.tree_util.keystr(path[1:])
    return f"args[{path[1].idx}]" + jax.tree_util.keystr(path[2:])


def _leaf_metrics(nnx: types.ModuleType, root: PyTree) -> list[tuple[str, Any, list]]:
    """Returns every metric holding state of its own, with its path and its own `Variable`s."""
    metric_type = nnx.metrics.Metric
    out = []
    is_metric = lambda x: isinstance(x, metric_type)  # noqa: E731
    for path, node in jax.tree_util.tree_flatten_with_path(root, is_leaf=is_metric)[0]:
        if is_metric(node):
            out.extend(_own_metrics(nnx, _where(path), node))
    return out


def _own_metrics(nnx: types.ModuleType, path: str, metric: Metric) -> list[tuple[str, Any, list]]:
    kinds = (nnx.metrics.Metric, nnx.Variable)

    def is_leaf(x: object) -> bool:
        return x is not metric and isinstance(x, kinds)

    out, own = [], []
    for p, node in jax.tree_util.tree_flatten_with_path(metric, is_leaf=is_leaf)[0]:
        if isinstance(node, nnx.metrics.Metric):
            out.extend(_own_metrics(nnx, path + jax.tree_util.keystr(p), node))
        elif isinstance(node, nnx.Variable):
            own.append(node)
    if own:
        out.append((path, metric, own))
    return out


def _aggregation(nnx: types.ModuleType, path: str, metric: Metric, own: list) -> Aggregation:
    metrics = nnx.metrics
    if isinstance(metric, metrics.Welford) and len(own) == 3:
        return Aggregation.NONE
    if not isinstance(metric, metrics.Welford) and all(
        isinstance(v, metrics.MetricState) and _is_number(v.get_raw_value()) for v in own
    ):
        return Aggregation.SUM
    raise TypeError(
        f"jm.replicate cannot aggregate the metric {type(metric).__qualname__} at "
        f"{path or '<root>'} across replicas: jmirror reads nnx.metrics.Average and Accuracy "
        "(sums), Welford (combined with Chan's parallel formula), MultiMetric of those, and "
        "metrics whose every state is an nnx.metrics.MetricState holding a sum of numbers. "
        f"Found state {[type(v).__name__ for v in own]}. Keep sums in MetricState "
        "variables, or update this metric outside the replicated function from "
        "strategy.gather / strategy.reduce of the step's outputs."
    )


def _is_number(x: object) -> bool:
    if isinstance(x, SyncOnRead):
        x = x.value
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return isinstance(x, (int, float)) and not isinstance(x, bool)
    return jnp.issubdtype(dtype, jnp.number)


def start_metric(variable: Variable, replica_id: jax.Array) -> None:
    """Sets a metric's state to this replica's component: its own if sync-on-read already, else
    the value on replica 0 and zero elsewhere (so reading gives the value back exactly)."""
    value = variable.get_raw_value()
    if isinstance(value, SyncOnRead):
        variable.set_raw_value(value.value)
        return
    value = jnp.asarray(value)
    variable.set_raw_value(jnp.where(replica_id == 0, value, jnp.zeros_like(value)))


@jax.tree_util.register_dataclass
class MetricComponents(SyncOnRead):
    """A metric `Variable`'s sync-on-read state outside the replicas.

    A `SyncOnRead` whose components the metric's own `reset()` (and any `variable[...] = v`
    on the host) can overwrite: replica 0's component becomes `v` and the others zero, so
    reading gives `v`. Reading it in any other way is a `TypeError` that points to
    `strategy.read(metric)`.
    """

    __slots__ = ()

    def __setitem__(self, index: object, value: PyTree) -> None:
        if index is not Ellipsis:
            raise TypeError(_METRIC_ITEM)
        stacked = self.value
        value = jnp.asarray(value, stacked.dtype)
        fresh = jnp.zeros_like(stacked).at[0].set(value)
        object.__setattr__(self, "value", jax.device_put(fresh, stacked.sharding))

    def _refuse(self, *args: PyTree, **kwargs: PyTree) -> Any:
        raise TypeError(_METRIC_ITEM)

    __getitem__ = __array__ = __jax_array__ = __float__ = __int__ = __bool__ = _refuse
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _refuse
    __truediv__ = __rtruediv__ = __floordiv__ = __pow__ = __rpow__ = __neg__ = _refuse


_METRIC_ITEM = (
    "jm: this metric's state is sync-on-read (one component per replica, written by a replicated "
    "function): read the metric with strategy.read(metric).compute(); reset it with "
    "metric.reset() or assign a whole value with variable[...] = value."
)


def read_metrics(gathered: Callable[[Any], jax.Array], tree: PyTree) -> PyTree:
    """Returns `tree` with every sync-on-read `Welford` combined across replicas (Chan et al.), as
    a copy; `gathered(x)` gives a stacked leaf's components on one device."""
    from flax import nnx

    welford = nnx.metrics.Welford

    def one(node: PyTree) -> PyTree:
        if not isinstance(node, welford):
            return node
        parts = [getattr(node, n).get_raw_value() for n in ("count", "mean", "m2")]
        if not all(isinstance(p, SyncOnRead) for p in parts):
            return node
        copy = jax.tree.map(lambda x: x, node, is_leaf=lambda x: isinstance(x, SyncOnRead))
        count, mean, m2 = _chan(*(gathered(p.value) for p in parts))
        copy.count.set_raw_value(count)
        copy.mean.set_raw_value(mean)
        copy.m2.set_raw_value(m2)
        return copy

    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, (welford, PerReplica)))


@jax.jit
def _chan(count: jax.Array, mean: jax.Array, m2: jax.Array) -> tuple[jax.Array, ...]:
    """Returns Chan, Golub and LeVeque's parallel combination of Welford states (leading axis)."""
    n = jnp.sum(count, axis=0)
    weights = count.astype(mean.dtype)
    total = jnp.sum(weights, axis=0)
    safe = jnp.where(total == 0, 1, total)
    combined = jnp.sum(weights * mean, axis=0) / safe
    spread = jnp.sum(m2, axis=0) + jnp.sum(weights * (mean - combined) ** 2, axis=0)
    return n.astype(count.dtype), combined, spread
