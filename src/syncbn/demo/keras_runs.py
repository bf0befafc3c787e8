"""The three runs of ``syncbn demo --framework keras``, on the TensorFlow or JAX backend.

Import this only in a process prepared by :func:`syncbn.demo.keras.run` (the Keras
backend chosen, the logical devices configured before the backend initialized).

All three runs start from the weights of one :func:`~syncbn.demo.keras_models.tiny_unet`
and see the same global batches (:func:`syncbn.demo.report.global_batches`) in the
same order; replica ``r`` of ``W`` gets rows ``r * b .. (r + 1) * b`` of each.

1. ``per_rank_bn``: the plain model trained over ``W`` replicas; every
   BatchNormalization normalizes with its own replica's ``b`` images.
2. ``syncbn``: the same after :func:`syncbn.keras.convert`.
3. ``big_batch``: one replica fed the whole global batch.

The loss of a batch is the mean over its images of each image's mean weighted pixel
cross-entropy. Under ``tf.distribute`` each replica divides its loss by ``W`` and the
Keras optimizer sums the replicas' gradients; under ``shard_map`` the devices' gradients
are averaged; under ``DataParallel`` the loss is the mean over the sharded global
batch itself. Either way the gradient is that of the big batch's loss. With
synchronized BN every layer's forward and backward are those of the global batch, so
runs 2 and 3 differ only by float32 summation order.

TensorFlow: ``tf.distribute.MirroredStrategy`` over the given devices, a custom loop
(``strategy.run`` of a traced step, each replica's slice placed with
``experimental_distribute_values_from_function``). JAX: Keras's stateless API in a
jitted step; run 1 maps the step over the devices with ``jax.shard_map`` (each device
sees its own slice, as under ``pmap``, so BN statistics are per device); run 2 shards
the global batch over the devices with ``keras.distribution.DataParallel``'s device
mesh and layout, where XLA makes every reduction global.
"""

from __future__ import annotations

from typing import Dict, List

import keras
import numpy as np
from keras import ops

from . import report as report_
from .report import RunRecord
from ..keras.convert import convert
from .keras_models import count_batchnorm, tiny_unet

__all__ = ["per_image_loss", "train_three_ways"]


def per_image_loss(logits, masks, class_weight):
    """Mean pixel cross-entropy of each image, pixels of class c weighted by
    ``class_weight[c]``; logits (N, H, W, C), masks (N, H, W) integers; shape (N,)."""
    pixels = ops.sparse_categorical_crossentropy(masks, logits, from_logits=True)
    return ops.mean(pixels * ops.take(class_weight, masks), axis=(1, 2))


def _predict(model, images: np.ndarray) -> np.ndarray:
    """Predicted classes (N, H, W) in inference mode."""
    return report_.in_chunks(lambda x: ops.convert_to_numpy(ops.argmax(model(x, training=False), axis=-1)), images)


def _values(variables) -> Dict[str, np.ndarray]:
    return {v.path: np.array(ops.convert_to_numpy(v.value), dtype=np.float32, copy=True) for v in variables}


def _train_loop(position: int, title: str, step_fn, model, config, data, progress: bool,
                predict=None) -> RunRecord:
    """:func:`syncbn.demo.report.train_loop` for a Keras model (both backends);
    ``predict(images)`` defaults to :func:`_predict` of ``model``."""
    return report_.train_loop(position, title, step_fn, predict or (lambda images: _predict(model, images)),
                              lambda: _values(model.trainable_weights),
                              lambda: _values(model.non_trainable_weights), config, data, progress)


def _model_with(initial, config):
    """A fresh :func:`tiny_unet` holding the weights ``initial``."""
    model = tiny_unet(config.seed, config.image_size, width=config.width)
    model.set_weights(initial)
    return model


def _optimizer(config):
    # cosine decay from the peak at step 1 (optimizer iteration 0) towards 0, as the torch demo
    schedule = keras.optimizers.schedules.CosineDecay(config.lr, decay_steps=config.steps)
    return keras.optimizers.SGD(learning_rate=schedule, momentum=config.momentum)


# --------------------------------------------------------------------------- TensorFlow


def _tf_run(position, title, strategy, initial, config, data, progress, sync: bool):
    import tensorflow as tf

    replicas = strategy.num_replicas_in_sync
    b = config.global_batch // replicas
    with strategy.scope():
        model = _model_with(initial, config)
        if sync:
            model = convert(model)
        optimizer = _optimizer(config)
        optimizer.build(model.trainable_weights)
    class_weight = tf.constant(data.class_weight)

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            loss = ops.mean(per_image_loss(model(x, training=True), y, class_weight))
            scaled = loss / replicas  # the optimizer sums the replicas' gradients
        grads = tape.gradient(scaled, model.trainable_weights)
        optimizer.apply_gradients(zip(grads, model.trainable_weights))
        return loss

    @tf.function
    def distributed_step(x, y):
        losses = strategy.run(replica_step, args=(x, y))
        return strategy.reduce(tf.distribute.ReduceOp.MEAN, losses, axis=None)

    def step_fn(step, x, y):
        def rows(array):
            return lambda ctx: tf.constant(array[ctx.replica_id_in_sync_group * b:
                                                 (ctx.replica_id_in_sync_group + 1) * b])

        xs = strategy.experimental_distribute_values_from_function(rows(x))
        ys = strategy.experimental_distribute_values_from_function(rows(y))
        return float(distributed_step(xs, ys))

    return _train_loop(position, title, step_fn, model, config, data, progress), model


def _tf_three_ways(config, devices: List[str], data, initial, progress: bool):
    import tensorflow as tf

    titles = {
        "per_rank_bn": "per-replica BN, MirroredStrategy",
        "syncbn": "syncbn, MirroredStrategy",
        "big_batch": f"one replica, batch {config.global_batch}",
    }
    strategy = tf.distribute.MirroredStrategy(devices)
    if strategy.num_replicas_in_sync != config.world_size:
        raise RuntimeError(f"MirroredStrategy has {strategy.num_replicas_in_sync} replicas, "
                           f"expected {config.world_size}")
    records = {}
    records["per_rank_bn"], _ = _tf_run(1, titles["per_rank_bn"], strategy, initial, config,
                                        data, progress, sync=False)
    records["syncbn"], synced = _tf_run(2, titles["syncbn"], strategy, initial, config, data,
                                        progress, sync=True)
    one = tf.distribute.OneDeviceStrategy(devices[0])
    records["big_batch"], _ = _tf_run(3, titles["big_batch"], one, initial, config, data,
                                      progress, sync=False)
    return records, _count_sync(synced)


# --------------------------------------------------------------------------- JAX


def _jax_run(position, title, mode, mesh, initial, config, data, progress):
    """``mode``: "per_device" (shard_map, each device its own slice and BN statistics),
    "data_parallel" (the batch sharded over ``mesh``, a keras.distribution.DataParallel),
    or "one_device"."""
    import jax
    from jax.sharding import PartitionSpec as P

    distribution = mesh if mode == "data_parallel" else None
    if distribution is not None:
        with distribution.scope():
            model = convert(_model_with(initial, config))
    else:
        model = _model_with(initial, config)
    optimizer = _optimizer(config)
    optimizer.build(model.trainable_variables)
    class_weight = ops.convert_to_tensor(data.class_weight)

    def loss_fn(trainable, non_trainable, x, y):
        logits, non_trainable = model.stateless_call(trainable, non_trainable, x, training=True)
        return ops.mean(per_image_loss(logits, y, class_weight)), non_trainable

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def step(state, x, y):
        trainable, non_trainable, opt_vars = state
        (loss, non_trainable), grads = grad_fn(trainable, non_trainable, x, y)
        if mode == "per_device":
            # the mean of the devices' gradients is the gradient of the global batch's mean loss
            grads, loss = jax.lax.pmean((grads, loss), "batch")
            non_trainable = jax.lax.pmean(non_trainable, "batch")  # moving statistics: the average
        trainable, opt_vars = optimizer.stateless_apply(opt_vars, grads, trainable)
        return loss, (trainable, non_trainable, opt_vars)

    if mode == "per_device":
        replicated = P()
        step = jax.shard_map(step, mesh=mesh, in_specs=(replicated, P("batch"), P("batch")),
                             out_specs=(replicated, replicated), check_vma=False)
    step = jax.jit(step)
    state = ([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables],
             [v.value for v in optimizer.variables])

    def place(array):
        if distribution is not None:
            return keras.distribution.distribute_tensor(array, distribution.get_data_layout(array.shape))
        return jax.numpy.asarray(array)

    def step_fn(number, x, y):
        nonlocal state
        loss, state = step(state, place(x), place(y))
        for variable, value in zip(model.trainable_variables, state[0]):
            variable.assign(value)
        for variable, value in zip(model.non_trainable_variables, state[1]):
            variable.assign(value)
        return float(loss)

    # inference as one compiled function: called eagerly, the model ran op by op on JAX,
    # each op compiled for its shapes and sharding (about 20 s of the quick demo's 70)
    def classes(trainable, non_trainable, x):
        logits, _ = model.stateless_call(trainable, non_trainable, x, training=False)
        return jax.numpy.argmax(logits, axis=-1)

    classes = jax.jit(classes)

    def predict(images):
        trainable, non_trainable, _ = state
        return report_.in_chunks(lambda x: classes(trainable, non_trainable, x), images)

    return _train_loop(position, title, step_fn, model, config, data, progress, predict), model


def _jax_three_ways(config, data, initial, progress):
    import jax
    from jax.sharding import Mesh

    devices = jax.devices()[: config.world_size]
    mesh = Mesh(np.array(devices), ("batch",))
    data_parallel = keras.distribution.DataParallel(devices=devices)
    titles = {
        "per_rank_bn": "per-device BN, shard_map",
        "syncbn": "syncbn, DataParallel",
        "big_batch": f"one device, batch {config.global_batch}",
    }
    records = {}
    records["per_rank_bn"], _ = _jax_run(1, titles["per_rank_bn"], "per_device", mesh, initial, config, data,
                                         progress)
    records["syncbn"], synced = _jax_run(2, titles["syncbn"], "data_parallel", data_parallel, initial, config,
                                         data, progress)
    records["big_batch"], _ = _jax_run(3, titles["big_batch"], "one_device", None, initial, config, data, progress)
    return records, _count_sync(synced)


# --------------------------------------------------------------------------- report


def _count_sync(model) -> int:
    from ..keras.layer import SyncBatchNormalization

    return sum(isinstance(layer, SyncBatchNormalization) for layer in model.layers)


def train_three_ways(config, devices: List[str], progress: bool) -> dict:
    """Train the three runs on ``devices`` (one per replica) and return the report."""
    data = report_.ChannelsLastData(config)
    probe = tiny_unet(config.seed, config.image_size, width=config.width)
    initial = probe.get_weights()
    backend = keras.backend.backend()
    print(f"syncbn demo: Keras {keras.__version__} on {backend}, "
          f"{report_.batch_words(config, 'replica')} (global batch {config.global_batch}), "
          f"{report_.counted(config.steps, 'step')}, "
          f"{config.image_size}x{config.image_size} canvases, devices {', '.join(devices)}", flush=True)
    if backend == "tensorflow":
        import tensorflow as tf

        records, synced = _tf_three_ways(config, devices, data, initial, progress)
        launcher = how = "MirroredStrategy"
        versions = {"tensorflow_version": tf.__version__}
    elif backend == "jax":
        import jax

        records, synced = _jax_three_ways(config, data, initial, progress)
        launcher = "DataParallel"
        how = "shard_map (run 1) / DataParallel (run 2)"
        versions = {"jax_version": jax.__version__}
    else:
        raise RuntimeError(f"syncbn demo: no Keras demo for the {backend} backend")
    if synced != count_batchnorm(probe):
        raise RuntimeError(f"convert left {count_batchnorm(probe) - synced} BatchNormalization layers unsynchronized")
    kinds = sorted({d.strip("/").split(":")[0].upper() for d in devices})
    setup = (f"{report_.batch_words(config, 'replica')} = global batch "
             f"{config.global_batch}, {report_.counted(config.steps, 'step')}, Keras/{backend} {how} over "
             f"{report_.counted(len(devices), '/'.join(kinds) + ' device')}")
    meta = {
        "framework": "keras",
        "keras_backend": backend,
        "keras_version": keras.__version__,
        **versions,
        "devices": list(devices),
        "model": {
            "name": probe.name,
            "batchnorm_layers": count_batchnorm(probe),
            "parameters": int(sum(np.prod(w.shape) for w in probe.trainable_weights)),
        },
        "loss": "mean over the images of each image's mean pixel cross-entropy "
                f"(background pixels weighted {config.background_weight}, digit pixels 1)",
        "optimizer": f"keras SGD(lr={config.lr} CosineDecay to 0 over {report_.counted(config.steps, 'step')}, "
                     f"momentum={config.momentum}, no weight decay)",
    }
    samples = {"images": data.val_images[: config.samples], "truth": data.val_y[: config.samples]}
    return report_.summarize(config, setup, launcher, records, samples, meta)
