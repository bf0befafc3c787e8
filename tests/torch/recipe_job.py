"""The training job the framework-recipe tests share (test_accelerate.py with
accelerate_worker.py, test_ray_train.py with ray_worker.py): a small ResNet in float64,
:data:`STEPS` steps of SGD, each of :data:`WORLD` processes on its :data:`BATCH` rows of each
step's batch, and the one-process reference on the concatenated batches that their results
must equal."""

import torch

BATCH, STEPS, WORLD, LR = 2, 2, 2, 0.1  # BATCH rows per process and step


def build_model():
    """tests/verify_models.py's small ResNet (BatchNorm2d layers and a BatchNorm1d head with
    momentum=None), seeded, in float64."""
    from verify_models import TinyResNet

    torch.manual_seed(5)
    return TinyResNet(classes=4).double()


def dataset():
    """(x, g) for every step: step s's batch is the rows from ``s * BATCH * WORLD`` on, of
    which process r takes the r-th BATCH rows (rows ``(s * WORLD + r) * BATCH`` on, the order
    a DataLoader of BATCH rows deals them out under accelerate); g is the output gradient
    (loss = mean of output * g)."""
    gen = torch.Generator().manual_seed(23)
    n = BATCH * WORLD * STEPS
    x = torch.randn(n, 3, 5, 5, generator=gen, dtype=torch.float64) * 2 + 0.5
    g = torch.randn(n, 4, generator=gen, dtype=torch.float64)
    return x, g


def assert_equal_to_one_process(states):
    """Each of ``states`` (a process's ``state_dict`` after training) equals one process
    trained on each step's whole batch."""
    model = build_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x_all, g_all = dataset()
    rows = BATCH * WORLD
    for step in range(STEPS):
        x, g = x_all[step * rows : (step + 1) * rows], g_all[step * rows : (step + 1) * rows]
        opt.zero_grad()
        (model(x) * g).mean().backward()  # the processes' mean losses, averaged by DDP
        opt.step()
    for key, ref in model.state_dict().items():
        for state in states:
            # float64 (unit roundoff 1.1e-16), 2 steps of a 6-BN-layer net: the processes sum
            # in another order (a few ulp), amplified by the 1/std factors of the BN layers
            # (Ray measured at most 4.4e-16 apart; without the conversion 68 of the 2 x 36
            # differ, by up to 1.45); NaN/inf fail assert_close
            torch.testing.assert_close(state[key], ref, rtol=1e-10, atol=1e-12,
                                       msg=lambda m, key=key: f"{key}: {m}")
