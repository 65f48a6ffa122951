"""Optional baseline: TensorFlow's own MirroredStrategy custom training loop (when installed).

TensorFlow is a benchmark extra, not a dependency: `available()` says whether it can run.
The same MLP, data and SGD step as `models.py`, on N logical CPU devices.
"""

from __future__ import annotations

import importlib.util

import numpy as np

from benchmarks.models import CLASSES, FEATURES, GLOBAL_BATCH, Variant

_CONFIGURED: list[int] = []
_STRATEGY: list = []


def available() -> bool:
    return importlib.util.find_spec("tensorflow") is not None


def configure(num_devices: int) -> None:
    """Splits TensorFlow's CPU into `num_devices` logical devices (before TF starts)."""
    import tensorflow as tf

    if not _CONFIGURED:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(num_devices)]
        )
        _CONFIGURED.append(num_devices)


def tensorflow_variant(hidden: int) -> Variant:
    import tensorflow as tf

    num_devices = _CONFIGURED[0]
    if not _STRATEGY:
        # One strategy per process: a second one reuses TF's collective instance keys.
        _STRATEGY.append(tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(num_devices)]))
    strategy = _STRATEGY[0]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(GLOBAL_BATCH, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=(GLOBAL_BATCH,)).astype(np.int32)
    with strategy.scope():
        model = tf.keras.Sequential(
            [
                tf.keras.layers.Dense(hidden, activation="relu"),
                tf.keras.layers.Dense(hidden, activation="relu"),
                tf.keras.layers.Dense(CLASSES),
            ]
        )
        model.build((None, FEATURES))
        optimizer = tf.keras.optimizers.SGD(1e-3)
    per = GLOBAL_BATCH // num_devices

    def value_fn(ctx):
        i = ctx.replica_id_in_sync_group
        return (x[i * per : (i + 1) * per], y[i * per : (i + 1) * per])

    batch = strategy.experimental_distribute_values_from_function(value_fn)

    @tf.function
    def train_step(batch):
        def step_fn(xs, ys):
            with tf.GradientTape() as tape:
                logits = model(xs, training=True)
                losses = tf.keras.losses.sparse_categorical_crossentropy(
                    ys, logits, from_logits=True
                )
                loss = tf.reduce_sum(losses) / GLOBAL_BATCH
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        losses = strategy.run(step_fn, args=batch)
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    return Variant(
        "TensorFlow MirroredStrategy", lambda: train_step(batch), lambda out: out.numpy()
    )
