"""Metrics updated inside replicated steps without communication and read once.

`stack_history` turns a list of per-step metric trees into one host tree (flax's
`common_utils.get_metrics`, the jmirror way).

Example:
    >>> import jax.numpy as jnp
    >>> from jmirror import metrics
    >>> float(metrics.Mean.empty().update(jnp.array([1.0, 3.0])).compute())
    2.0
"""

from jmirror.metrics._history import stack_history as stack_history
from jmirror.metrics._metrics import Accuracy as Accuracy
from jmirror.metrics._metrics import Mean as Mean
from jmirror.metrics._metrics import Metric as Metric
from jmirror.metrics._metrics import Sum as Sum

__all__ = ["Accuracy", "Mean", "Metric", "Sum", "stack_history"]
