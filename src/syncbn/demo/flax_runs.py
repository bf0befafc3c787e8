"""The three runs of ``syncbn demo --framework flax`` (linen, ``jax.pmap``).

Import this only in a process prepared by :func:`syncbn.demo.flax.run` (JAX's host
device count set before JAX was imported).

All three runs start from :func:`~syncbn.demo.flax_models.init_variables` (the Keras twin's
initial weights) and see the same global batches (:func:`syncbn.demo.report.global_batches`)
in the same order; device ``r`` of ``W`` gets rows ``r * b .. (r + 1) * b`` of each.

1. ``per_rank_bn``: the plain :class:`~syncbn.demo.flax_models.TinyUNet` (``flax.linen.BatchNorm``,
   ``axis_name=None``) trained under ``jax.pmap``: every BatchNorm normalizes with its own
   device's ``b`` images; the running statistics are averaged over the devices after each
   step (one model to evaluate).
2. ``syncbn``: the same model, the same ``pmap`` step, traced inside
   ``with syncbn.flax.convert(axis_name="batch"):``: every BatchNorm computes the
   statistics of the global batch, forward and backward.
3. ``big_batch``: one device (``jax.jit``) fed the whole global batch.

The loss of a batch is the mean over its images of each image's mean weighted pixel
cross-entropy; under ``pmap`` each device differentiates its own images' mean and the
gradients are averaged over the devices (``lax.pmean``): the gradient of the global
batch's loss. The optimizer is SGD with momentum written out (torch's rule:
``v = momentum * v + g``, ``p -= lr * v``), the learning rate
:func:`syncbn.demo.report.learning_rate`'s cosine decay. Evaluation uses the running
statistics on one device. Nothing here imports torch or TensorFlow.
"""

from __future__ import annotations

from typing import Dict, List

import flax
from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import report as report_
from ..flax.convert import convert
from .flax_models import TinyUNet, count_batchnorm, init_variables

__all__ = ["per_image_loss", "train_three_ways"]

AXIS = "batch"


def per_image_loss(logits, masks, class_weight):
    """Mean pixel cross-entropy of each image, pixels of class c weighted by
    ``class_weight[c]``; logits (N, H, W, C), masks (N, H, W) integers; shape (N,)."""
    log_p = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(log_p, masks[..., None], axis=-1)[..., 0]
    return jnp.mean(-picked * class_weight[masks], axis=(1, 2))


def _flat(tree) -> Dict[str, np.ndarray]:
    """``{"layer/name": float32 copy}`` of a nested dict of arrays."""
    flat = traverse_util.flatten_dict(tree, sep="/")
    return {k: np.array(v, dtype=np.float32, copy=True) for k, v in flat.items()}


def _make_step(model, class_weight, momentum: float, mapped: str):
    """One SGD step ``(params, stats, velocity, x, y, lr) -> (same, loss)``. ``mapped``:
    "" (one device), "per_device" or "sync" (inside ``pmap`` over :data:`AXIS`)."""

    def step(params, stats, velocity, x, y, lr):
        def loss_fn(p):
            logits, updates = model.apply({"params": p, "batch_stats": stats}, x, train=True,
                                          mutable=["batch_stats"])
            return jnp.mean(per_image_loss(logits, y, class_weight)), updates["batch_stats"]

        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        if mapped:
            # the mean of the devices' gradients is the gradient of the global batch's mean loss
            grads, loss = lax.pmean((grads, loss), AXIS)
        if mapped == "per_device":
            stats = lax.pmean(stats, AXIS)  # running statistics: the devices' average
        velocity = jax.tree.map(lambda v, g: momentum * v + g, velocity, grads)
        params = jax.tree.map(lambda p, v: p - lr * v, params, velocity)
        return params, stats, velocity, loss

    return step


def _run(position, title, mode, devices, model, initial, config, data, predict, progress):
    """``mode``: "per_device", "sync" (both ``pmap`` over ``devices``) or "one_device"."""
    class_weight = jnp.asarray(data.class_weight)
    velocity = jax.tree.map(np.zeros_like, initial["params"])
    state = (initial["params"], initial["batch_stats"], velocity)
    world = len(devices)
    if mode == "one_device":
        step = jax.jit(_make_step(model, class_weight, config.momentum, ""))
        state = jax.device_put(state, devices[0])
        split = jnp.asarray
        first = lambda tree: tree  # noqa: E731
    else:
        step = jax.pmap(_make_step(model, class_weight, config.momentum, mode), axis_name=AXIS,
                        in_axes=(0, 0, 0, 0, 0, None), devices=devices)
        state = jax.tree.map(lambda a: np.broadcast_to(a, (world,) + a.shape), state)  # a copy per device
        split = lambda a: a.reshape((world, -1) + a.shape[1:])  # noqa: E731  device r: rows r*b..(r+1)*b
        first = lambda tree: jax.tree.map(lambda a: a[0], tree)  # noqa: E731  the devices agree

    def step_fn(number, x, y):
        nonlocal state
        lr = np.float32(report_.learning_rate(config.lr, config.steps, number))
        if mode == "sync":
            with convert(axis_name=AXIS):  # traced (on the first step) with syncbn's BatchNorm
                *state, loss = step(*state, split(x), split(y), lr)
        else:
            *state, loss = step(*state, split(x), split(y), lr)
        return float(first(loss))

    def variables():
        return {"params": first(state[0]), "batch_stats": first(state[1])}

    record = report_.train_loop(position, title, step_fn, lambda images: predict(variables(), images),
                                lambda: _flat(variables()["params"]), lambda: _flat(variables()["batch_stats"]),
                                config, data, progress)
    return record


def train_three_ways(config, devices: List, progress: bool) -> dict:
    """Train the three runs over ``devices`` (JAX devices, one per replica) and return the report."""
    data = report_.ChannelsLastData(config)
    model = TinyUNet(width=config.width)
    initial = init_variables(model, config.seed, config.image_size)

    @jax.jit
    def _classes(variables, images):
        # inference mode: the running statistics, nothing to synchronize (compiled once, plain Flax)
        return jnp.argmax(model.apply(variables, images, train=False), axis=-1)

    def predict(variables, images):
        return report_.in_chunks(lambda x: _classes(variables, x), images)

    names = [f"{d.platform}:{d.id}" for d in devices]
    print(f"syncbn demo: Flax {flax.__version__} (linen) on JAX {jax.__version__}, "
          f"{report_.batch_words(config, 'device')} (global batch {config.global_batch}), "
          f"{report_.counted(config.steps, 'step')}, "
          f"{config.image_size}x{config.image_size} canvases, devices {', '.join(names)}", flush=True)
    titles = {
        "per_rank_bn": "per-device BN, pmap",
        "syncbn": "syncbn, pmap",
        "big_batch": f"one device, batch {config.global_batch}",
    }
    modes = {"per_rank_bn": "per_device", "syncbn": "sync", "big_batch": "one_device"}
    records = {}
    for position, name in enumerate(report_.RUNS, 1):
        records[name] = _run(position, titles[name], modes[name], devices, model, initial, config, data,
                             predict, progress)
    kinds = sorted({d.platform.upper() for d in devices})
    setup = (f"{report_.batch_words(config, 'device')} = global batch "
             f"{config.global_batch}, {report_.counted(config.steps, 'step')}, Flax linen under jax.pmap over "
             f"{report_.counted(len(devices), '/'.join(kinds) + ' device')}")
    meta = {
        "framework": "flax",
        "flax_version": flax.__version__,
        "jax_version": jax.__version__,
        "devices": names,
        "model": {
            "name": "TinyUNet (flax.linen)",
            "batchnorm_layers": count_batchnorm(initial),
            "parameters": int(sum(np.prod(np.shape(p)) for p in jax.tree.leaves(initial["params"]))),
        },
        "conversion": 'with syncbn.flax.convert(axis_name="batch"): (run 2 traced inside it)',
        "loss": "mean over the images of each image's mean pixel cross-entropy "
                f"(background pixels weighted {config.background_weight}, digit pixels 1)",
        "optimizer": f"SGD (lr={config.lr} cosine-decayed to 0 over {report_.counted(config.steps, 'step')}, "
                     f"momentum={config.momentum} as torch: v = m v + g, p -= lr v; no weight decay)",
    }
    samples = {"images": data.val_images[: config.samples], "truth": data.val_y[: config.samples]}
    return report_.summarize(config, setup, "pmap", records, samples, meta)
