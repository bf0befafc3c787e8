"""Train a small Flax (linen) MLP with synchronized batch normalization under
``jax.pmap`` on logical CPU devices: ``syncbn.flax.BatchNorm(axis_name=...)``.

Each device sees a few samples per step (the situation synchronized BN is for), and
every device's data is shifted differently, so per-device statistics would disagree;
every BatchNorm layer still normalizes with the statistics of the whole global batch.
A mask drops some samples on each device (padding, uneven counts): they are left out
of the statistics exactly.

    python examples/flax_pmap.py                 # 4 logical CPU devices, 4 samples each
    python examples/flax_pmap.py --devices 2 --steps 50

On a machine with several accelerators, drop the XLA_FLAGS line: the rest is unchanged.
"""

from __future__ import annotations

import argparse
import os


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4, help="logical CPU devices")
    parser.add_argument("--per-device-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for name in ("devices", "per_device_batch", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    return args


def main():
    args = parse_args()
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={args.devices}").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    import flax.linen as nn

    import syncbn.flax

    devices = jax.devices()[:args.devices]
    n_dev, per = len(devices), args.per_device_batch

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x, mask, train):
            for width in (32, 32):
                x = nn.Dense(width)(x)
                x = syncbn.flax.BatchNorm(use_running_average=not train, axis_name="batch", momentum=0.9)(
                    x, mask=mask[:, None])
                x = nn.relu(x)
            return nn.Dense(3)(x)

    # three Gaussian classes in 8 dimensions, far from the origin
    rng = np.random.default_rng(args.seed)
    centers = rng.normal(size=(3, 8)) * 2 + 50.0

    def sample(n):
        labels = rng.integers(0, 3, n)
        return (centers[labels] + rng.normal(size=(n, 8))).astype(np.float32), labels

    model = MLP()
    x0, _ = sample(per)
    variables = model.init(jax.random.PRNGKey(args.seed), x0, np.ones(per, bool), True)
    optimizer = optax.sgd(0.1, momentum=0.9)
    state = (variables["params"], variables["batch_stats"], optimizer.init(variables["params"]))
    state = jax.tree.map(lambda a: np.broadcast_to(a, (n_dev,) + a.shape), state)  # one copy per device

    def train_step(state, x, y, mask):
        params, stats, opt_state = state

        def loss_fn(params):
            logits, upd = model.apply({"params": params, "batch_stats": stats}, x, mask, True,
                                      mutable=["batch_stats"])
            losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
            total = jax.lax.psum(jnp.sum(losses * mask), "batch")
            count = jax.lax.psum(jnp.sum(mask), "batch")
            return jnp.sum(losses * mask) / count, (upd["batch_stats"], total / count)

        grads, (stats, loss) = jax.grad(loss_fn, has_aux=True)(params)
        grads = jax.lax.psum(grads, "batch")  # each device's part of the global-mean loss
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), stats, opt_state), loss

    step = jax.pmap(train_step, axis_name="batch", devices=devices)
    for i in range(args.steps):
        x, y = sample(n_dev * per)
        x = x + np.repeat(np.arange(n_dev, dtype=np.float32), per)[:, None]  # a shift per device
        mask = rng.random(n_dev * per) < 0.8
        mask[0] = True
        shape = lambda a: a.reshape((n_dev, per) + a.shape[1:])
        state, loss = step(state, shape(x), shape(y), shape(mask))
        if i % 50 == 0 or i == args.steps - 1:
            print(f"step {i:4d}  loss {float(loss[0]):.4f}")

    params, stats = jax.tree.map(lambda a: a[0], state[:2])
    xt, yt = sample(512)
    logits = model.apply({"params": params, "batch_stats": stats}, xt, np.ones(512, bool), False)
    accuracy = float(np.mean(np.argmax(np.asarray(logits), -1) == yt))
    print(f"devices: {n_dev}, per-device batch: {per}")
    print(f"final evaluation accuracy (running statistics): {accuracy:.3f}")


if __name__ == "__main__":
    main()
