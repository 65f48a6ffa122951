"""Metrics: small immutable states that replicas update without communicating.

A metric is a frozen dataclass of counters that combine by summing (a total, a count, a
number of correct predictions). It has two forms:

- *local*: the counters are plain arrays (`Mean.empty()`). Update and compute it anywhere,
  for instance in a single-device `jax.jit` step.
- *distributed*: every counter is a `jm.SyncOnRead` with aggregation `SUM`
  (`Mean.create(strategy)`). Pass it into a replicated step: each replica updates its own
  component with no communication, the step returns it still sync-on-read, and
  `metric.compute(strategy)` (or `strategy.read(metric).compute()`) reduces the counters
  once, in cross-replica context.

Masks mark the real examples of a padded batch: masked-out entries are excluded from every
counter, even when they hold NaN or infinity.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jmirror._context import in_replica_context
from jmirror._strategy import MirroredStrategy
from jmirror._values import Aggregation, SyncOnRead

M = TypeVar("M", bound="Metric")

_UPDATE_OUTSIDE = (
    "{cls}.update was called in cross-replica context on a distributed metric (its counters "
    "are jm.SyncOnRead, one component per replica). Update it inside the replicated step, "
    "where each replica sees its own component, or update a local metric ({cls}.empty())."
)


def _is_sync_on_read(x: object) -> bool:
    return isinstance(x, SyncOnRead)


def _add(field: Any, delta: jax.Array) -> Any:
    """Adds `delta` to a counter, which may be a plain array or a `SyncOnRead` component."""
    if isinstance(field, SyncOnRead):
        return field.replace(field.value + delta.astype(jnp.result_type(field.value)))
    return field + delta.astype(jnp.result_type(field))


def _expand_mask(call: str, mask: ArrayLike | None, shape: tuple[int, ...]) -> jax.Array:
    """Returns `mask` broadcast over the trailing axes of `shape` (all True when `mask` is None)."""
    if mask is None:
        return jnp.ones(shape, jnp.bool_)
    mask = jnp.asarray(mask)
    if not (mask.dtype == jnp.bool_ or jnp.issubdtype(mask.dtype, jnp.integer)):
        raise TypeError(
            f"{call}: the mask has dtype {mask.dtype}, but a mask marks which examples count "
            "(booleans, True: counted; integers: nonzero counted); it is not a weight, so a "
            "value such as 0.5 has no meaning. Pass booleans (for example mask > 0), or "
            "multiply the values by your weights before updating."
        )
    if mask.shape != shape[: mask.ndim]:
        raise ValueError(
            f"{call}: the mask has shape {mask.shape}, but the values have shape {shape}; a "
            "mask covers the leading axes of the values (for a batch of shape (B, ...) pass "
            "a mask of shape (B,)) and is True on the real examples."
        )
    mask = mask.astype(jnp.bool_).reshape(mask.shape + (1,) * (len(shape) - mask.ndim))
    return jnp.broadcast_to(mask, shape)


class Metric:
    """The interface of every metric: `empty`, `create`, `update`, `merge`, `reset`, `compute`.

    A metric's fields are counters that combine across replicas and batches by summing.
    Subclasses are frozen dataclasses registered as pytrees; they define `_zeros` (the
    counters of an empty metric), `update` and `_result` (the value from summed counters).

    Example:
        >>> import jax.numpy as jnp
        >>> from jmirror import metrics
        >>> metric = metrics.Mean.empty().update(jnp.array([1.0, 2.0, 3.0]))
        >>> isinstance(metric, metrics.Metric), float(metric.compute())
        (True, 2.0)
    """

    @classmethod
    def _zeros(cls) -> dict[str, jax.Array]:
        raise NotImplementedError

    def _result(self) -> jax.Array:
        raise NotImplementedError

    @classmethod
    def empty(cls: type[M]) -> M:
        """Returns a local metric with every counter zero.

        Example:
            >>> from jmirror import metrics
            >>> metrics.Sum.empty()
            Sum(total=Array(0., dtype=float32))
        """
        return cls(**cls._zeros())

    @classmethod
    def create(cls: type[M], strategy: MirroredStrategy) -> M:
        """Returns a distributed metric: every counter a `SyncOnRead` (`SUM`) starting at zero.

        Call it in cross-replica context, pass the metric into a replicated step and update it
        there; the step returns it still distributed.

        Args:
          strategy: the `jm.MirroredStrategy` whose replicas will update the metric.

        Example:
            >>> import jmirror as jm
            >>> from jmirror import metrics
            >>> strategy = jm.MirroredStrategy()
            >>> metric = metrics.Mean.create(strategy)
            >>> metric.count.aggregation, metric.count.value.shape == (strategy.num_replicas,)
            (<Aggregation.SUM: 'sum'>, True)
        """
        return cls(
            **{
                name: strategy.sync_on_read(value, Aggregation.SUM)
                for name, value in cls._zeros().items()
            }
        )

    @property
    def is_distributed(self) -> bool:
        """Returns whether the counters are `SyncOnRead` (made by `create`) rather than plain
        arrays.

        Example:
            >>> from jmirror import metrics
            >>> metrics.Mean.empty().is_distributed
            False
        """
        return any(
            isinstance(x, SyncOnRead) for x in jax.tree.leaves(self, is_leaf=_is_sync_on_read)
        )

    def _check_update(self) -> None:
        if self.is_distributed and not in_replica_context():
            raise TypeError(_UPDATE_OUTSIDE.format(cls=type(self).__name__))

    def merge(self: M, other: M) -> M:
        """Returns a metric holding both metrics' examples (their counters summed).

        Both must be of the same class and form (local or distributed); a distributed pair is
        merged replica by replica, without communication.

        Raises:
          TypeError: for metrics of different classes or forms.

        Example:
            >>> import jax.numpy as jnp
            >>> from jmirror import metrics
            >>> a = metrics.Mean.empty().update(jnp.array([1.0, 2.0]))
            >>> b = metrics.Mean.empty().update(jnp.array([6.0]))
            >>> float(a.merge(b).compute())
            3.0
        """
        if type(other) is not type(self) or other.is_distributed != self.is_distributed:
            raise TypeError(
                f"{type(self).__name__}.merge(other) needs another {type(self).__name__} of "
                f"the same form (distributed={self.is_distributed}), got "
                f"{type(other).__name__} (distributed={getattr(other, 'is_distributed', None)})."
                " Read a distributed metric with strategy.read(metric) to get a local one."
            )
        return jax.tree.map(lambda a, b: a + b, self, other)

    def reset(self: M) -> M:
        """Returns a metric of the same form with every counter zero.

        Example:
            >>> import jax.numpy as jnp
            >>> from jmirror import metrics
            >>> metric = metrics.Sum.empty().update(jnp.ones(3))
            >>> float(metric.reset().compute())
            0.0
        """
        return jax.tree.map(jnp.zeros_like, self)

    def compute(self, strategy: MirroredStrategy | None = None) -> jax.Array:
        """Returns the metric's value.

        Args:
          strategy: for a distributed metric in cross-replica context, the strategy that
            reads it (one `strategy.read` of the counters). Inside a replica function a
            distributed metric gives that replica's own value, without communication.

        Raises:
          TypeError: for a distributed metric in cross-replica context without `strategy`.

        Example:
            >>> import jax.numpy as jnp, jmirror as jm
            >>> from jmirror import metrics
            >>> strategy = jm.MirroredStrategy()
            >>> step = jm.replicate(lambda m, x: m.update(x), strategy=strategy)
            >>> n = strategy.num_replicas
            >>> x = jm.PerReplica(jnp.arange(2.0 * n).reshape(n, 2))
            >>> metric = step(metrics.Mean.create(strategy), x)
            >>> float(metric.compute(strategy)) == (2 * n - 1) / 2
            True
        """
        metric = self
        if strategy is not None:
            metric = strategy.read(self)
        elif self.is_distributed:
            if not in_replica_context():
                raise TypeError(
                    f"{type(self).__name__}.compute() got a distributed metric in "
                    "cross-replica context: its counters are spread over the replicas. Pass "
                    f"the strategy, metric.compute(strategy), or read it first: "
                    "strategy.read(metric).compute()."
                )
            metric = jax.tree.map(lambda x: x.value, self, is_leaf=_is_sync_on_read)
        return metric._result()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sum(Metric):
    """The sum of all (unmasked) values seen.

    Attributes:
      total: the running sum (float32).

    Example:
        >>> import jax.numpy as jnp
        >>> from jmirror import metrics
        >>> metric = metrics.Sum.empty().update(jnp.array([1.0, 2.0, 9.0]),
        ...                                        mask=jnp.array([True, True, False]))
        >>> float(metric.compute())
        3.0
    """

    total: jax.Array | SyncOnRead

    @classmethod
    def _zeros(cls) -> dict[str, jax.Array]:
        return {"total": jnp.zeros((), jnp.float32)}

    def update(self, values: ArrayLike, mask: ArrayLike | None = None) -> Sum:
        """Returns the metric with the unmasked `values` added.

        Args:
          values: an array of any shape.
          mask: `None`, or booleans over the leading axes of `values` (True: counted).

        Example:
            >>> import jax.numpy as jnp
            >>> from jmirror import metrics
            >>> float(metrics.Sum.empty().update(jnp.ones((2, 3))).compute())
            6.0
        """
        self._check_update()
        values = jnp.asarray(values)
        mask = _expand_mask("metrics.Sum.update", mask, values.shape)
        return Sum(_add(self.total, jnp.sum(jnp.where(mask, values, 0))))

    def _result(self) -> jax.Array:
        return jnp.asarray(self.total)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mean(Metric):
    """The mean of all (unmasked) values seen: a weighted running average.

    `compute` gives NaN while no value has been counted.

    Attributes:
      total: the sum of the values (float32).
      count: how many values were counted (int32).

    Example:
        >>> import jax.numpy as jnp
        >>> from jmirror import metrics
        >>> loss = jnp.array([1.0, 3.0, jnp.nan])
        >>> metric = metrics.Mean.empty().update(loss, mask=jnp.array([1, 1, 0]))
        >>> float(metric.compute())
        2.0
    """

    total: jax.Array | SyncOnRead
    count: jax.Array | SyncOnRead

    @classmethod
    def _zeros(cls) -> dict[str, jax.Array]:
        return {"total": jnp.zeros((), jnp.float32), "count": jnp.zeros((), jnp.int32)}

    def update(self, values: ArrayLike, mask: ArrayLike | None = None) -> Mean:
        """Returns the metric with the unmasked `values` counted.

        Args:
          values: an array of any shape (every element counts once).
          mask: `None`, or booleans over the leading axes of `values` (True: counted).

        Example:
            >>> import jax.numpy as jnp
            >>> from jmirror import metrics
            >>> metric = metrics.Mean.empty().update(jnp.array([[1.0, 2.0], [3.0, 4.0]]))
            >>> float(metric.compute()), int(metric.count)
            (2.5, 4)
        """
        self._check_update()
        values = jnp.asarray(values)
        mask = _expand_mask("metrics.Mean.update", mask, values.shape)
        return Mean(
            _add(self.total, jnp.sum(jnp.where(mask, values, 0))),
            _add(self.count, jnp.sum(mask, dtype=jnp.int32)),
        )

    def _result(self) -> jax.Array:
        return jnp.asarray(self.total) / jnp.asarray(self.count)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Accuracy(Metric):
    """The fraction of (unmasked) examples whose highest logit is the label.

    `compute` gives NaN while no example has been counted.

    Attributes:
      correct: how many counted examples were classified correctly (int32).
      count: how many examples were counted (int32).

    Example:
        >>> import jax.numpy as jnp
        >>> from jmirror import metrics
        >>> logits = jnp.array([[2.0, 0.0], [0.0, 1.0], [5.0, 0.0]])
        >>> labels = jnp.array([0, 0, 1])
        >>> metric = metrics.Accuracy.empty().update(logits, labels, mask=[1, 1, 0])
        >>> float(metric.compute())
        0.5
    """

    correct: jax.Array | SyncOnRead
    count: jax.Array | SyncOnRead

    @classmethod
    def _zeros(cls) -> dict[str, jax.Array]:
        return {"correct": jnp.zeros((), jnp.int32), "count": jnp.zeros((), jnp.int32)}

    def update(
        self, logits: ArrayLike, labels: ArrayLike, mask: ArrayLike | None = None
    ) -> Accuracy:
        """Returns the metric with the unmasked examples counted.

        Args:
          logits: scores of shape `(..., num_classes)`.
          labels: integer class ids of shape `logits.shape[:-1]`.
          mask: `None`, or booleans over the leading axes of `labels` (True: counted).

        Raises:
          ValueError: when the shapes of `logits`, `labels` and `mask` do not match.

        Example:
            >>> import jax.numpy as jnp
            >>> from jmirror import metrics
            >>> metric = metrics.Accuracy.empty().update(jnp.eye(3), jnp.array([0, 1, 1]))
            >>> int(metric.correct), int(metric.count)
            (2, 3)
        """
        self._check_update()
        logits = jnp.asarray(logits)
        labels = jnp.asarray(labels)
        if logits.ndim < 1 or logits.shape[:-1] != labels.shape:
            raise ValueError(
                f"metrics.Accuracy.update: logits of shape {logits.shape} need labels of "
                f"shape {logits.shape[:-1]} (the logits without the class axis), got labels of "
                f"shape {labels.shape}. Pass integer class ids, not one-hot labels."
            )
        mask = _expand_mask("metrics.Accuracy.update", mask, labels.shape)
        hits = (jnp.argmax(logits, axis=-1) == labels) & mask
        return Accuracy(
            _add(self.correct, jnp.sum(hits, dtype=jnp.int32)),
            _add(self.count, jnp.sum(mask, dtype=jnp.int32)),
        )

    def _result(self) -> jax.Array:
        return jnp.asarray(self.correct) / jnp.asarray(self.count)
