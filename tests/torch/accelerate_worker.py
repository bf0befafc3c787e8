"""The README's accelerate recipe as a training script (tests/test_accelerate.py).

Launched with 2 processes on the CPU (``python -m torch.distributed.run --standalone
--nproc-per-node 2 tests/accelerate_worker.py OUT_DIR``);
``accelerate.Accelerator(cpu=True)`` then runs as MULTI_CPU over gloo. Each process saves its
model's state after training, and the distributed type accelerate chose, to
``OUT_DIR/rank{R}.pt``. The model, data and steps are recipe_job's, which the test also
compares with one process.
"""

import sys

import torch

from recipe_job import BATCH, LR, build_model, dataset


def main(out_dir: str) -> None:
    import accelerate

    import syncbn

    # -- the recipe (README, "With your framework", accelerate) --
    accelerator = accelerate.Accelerator(cpu=True)  # without cpu=True, no GPU: each process alone (NO)
    model = syncbn.convert_sync_batchnorm(build_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*dataset()), batch_size=BATCH)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    # -- end of the recipe --
    for x, g in loader:
        optimizer.zero_grad()
        loss = (model(x) * g).mean()
        accelerator.backward(loss)
        optimizer.step()
    plain = accelerator.unwrap_model(model)
    torch.save(
        {
            "distributed_type": str(accelerator.distributed_type),
            "backend": torch.distributed.get_backend(),
            "layers": sorted({type(m).__name__ for m in plain.modules() if "BatchNorm" in type(m).__name__}),
            "state": {k: v.detach().clone() for k, v in plain.state_dict().items()},
        },
        f"{out_dir}/rank{accelerator.process_index}.pt",
    )
    # the end of a job (docs/torch.md, "Ending a job"): the Accelerator keeps the prepared
    # (DDP) model too, so free_memory() before end_training() destroys the group
    del model, plain
    accelerator.free_memory()
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
    import doc_blocks

    doc_blocks.exit_unless_group_freed("accelerate_worker.py")
