"""docs/torch.md's Ray Train recipe as a driver script (tests/torch/test_ray_train.py).

``python tests/torch/ray_worker.py OUT_DIR RAY_TEMP_DIR`` starts a local Ray of its own
(``address="local"``: never an existing cluster; 2 CPUs, no dashboard, on 127.0.0.1, its
files under RAY_TEMP_DIR), runs a ``TorchTrainer`` with 2 CPU workers, and shuts Ray down.
Each worker converts the model, lets ``ray.train.torch.prepare_model`` wrap it in DDP
(gloo, as Ray chooses for ``use_gpu=False``), trains :data:`STEPS` steps of SGD on its
rows of each step's batch, and saves its model's state, its rank, world size, backend and
batch norm classes to ``OUT_DIR/rank{R}.pt``. The model, data and steps are recipe_job's,
which the test also compares with one process.
"""

import sys

import torch

from recipe_job import BATCH, LR, STEPS, WORLD, build_model, dataset


def train_loop_per_worker(config):
    import ray.train
    import ray.train.torch

    import syncbn

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    # -- the recipe (docs/torch.md, "With your framework", Ray Train) --
    model = syncbn.convert_sync_batchnorm(build_model())
    model = ray.train.torch.prepare_model(model)
    # -- end of the recipe --
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x_all, g_all = dataset()
    for step in range(STEPS):
        first = (step * world + rank) * BATCH
        x, g = x_all[first : first + BATCH], g_all[first : first + BATCH]
        optimizer.zero_grad()
        (model(x) * g).mean().backward()
        optimizer.step()
    plain = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    torch.save(
        {
            "rank": rank,
            "world": world,
            "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
            "master_addr": __import__("os").environ.get("MASTER_ADDR"),
            "ddp": isinstance(model, torch.nn.parallel.DistributedDataParallel),
            "layers": sorted({type(m).__name__ for m in plain.modules() if "BatchNorm" in type(m).__name__}),
            "state": {k: v.detach().clone() for k, v in plain.state_dict().items()},
        },
        f"{config['out_dir']}/rank{rank}.pt",
    )


def main(out_dir: str, temp_dir: str) -> None:
    import ray
    import ray.train
    import ray.train.torch

    ray.init(address="local", num_cpus=WORLD, include_dashboard=False, _node_ip_address="127.0.0.1",
             _temp_dir=temp_dir, object_store_memory=100 * 2**20)
    try:
        # -- the recipe --
        trainer = ray.train.torch.TorchTrainer(
            train_loop_per_worker, train_loop_config={"out_dir": out_dir},
            scaling_config=ray.train.ScalingConfig(num_workers=WORLD, use_gpu=False),
            run_config=ray.train.RunConfig(storage_path=f"{out_dir}/ray_results", name="syncbn"))
        trainer.fit()
        # -- end of the recipe --
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
