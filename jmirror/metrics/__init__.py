"""Metrics updated inside replicated steps without communication and read once.

Example:
    >>> import jax.numpy as jnp
    >>> from jmirror import metrics
    >>> float(metrics.Mean.empty().update(jnp.array([1.0, 3.0])).compute())
    2.0
"""

from jmirror.metrics._metrics import Accuracy as Accuracy
from jmirror.metrics._metrics import Mean as Mean
from jmirror.metrics._metrics import Metric as Metric
from jmirror.metrics._metrics import Sum as Sum

__all__ = ["Accuracy", "Mean", "Metric", "Sum"]
