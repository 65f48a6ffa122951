"""The data and loss the NNX tests share: random images, integer labels, a softmax loss."""

import numpy as np
import optax

import jmirror as jm


def loss(model, x, y):
    logits = model(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def data(n, steps, per_replica, side, classes):
    """`steps` global batches of `n * per_replica` images (side x side x 1) and labels."""
    rs = np.random.RandomState(0)
    xs = rs.randn(steps, n * per_replica, side, side, 1).astype(np.float32)
    ys = rs.randint(0, classes, (steps, n * per_replica)).astype(np.int32)
    return xs, ys


def split(n, batch):
    """A global batch as `n` replicas' shares."""
    return jm.PerReplica(batch.reshape(n, -1, *batch.shape[1:]))
