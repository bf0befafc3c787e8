"""Numerics: the relative error of the merged batch variance against float64.

Every implementation sees the same float32 data, drawn here with NumPy from a fixed
seed: W shards of shape (batch, C, size, size), channel c of mean ``offset * (1 + c/C)``
and standard deviation about 1, so ``|mean| / std`` is about ``offset``. The reference
is the biased variance, in float64, of the concatenation of the float32 shards (so
only the implementation's arithmetic is measured, not the rounding of the data).

The variance each implementation *uses* is read back through its public surface, with
the moving-average weight of the new batch set to 1 so that the running buffer holds
the batch statistic (torch stores it unbiased: multiplied back by (n - 1) / n in
float64). The error of a layer is the largest over the channels.

This module is imported by the Keras and Flax peers: it imports NumPy only, and torch
inside the functions that run in the torch peer.
"""

from __future__ import annotations

import math
from typing import List, Sequence

import numpy as np

__all__ = ["shards", "reference_variance", "relative_error", "naive_variance", "torch_variances", "large_plane_errors"]

SEED = 1234


def shards(offset: float, world: int, batch: int, channels: int, size: int) -> List[np.ndarray]:
    """``world`` float32 arrays of shape (batch, channels, size, size), NCHW."""
    rng = np.random.default_rng(SEED)
    means = offset * (1.0 + np.arange(channels) / channels)
    out = []
    for _ in range(world):
        z = rng.standard_normal((batch, channels, size, size))
        out.append((means[None, :, None, None] + z).astype(np.float32))
    return out


def _channels_first_rows(parts: Sequence[np.ndarray]) -> np.ndarray:
    """(C, everything else) view of the concatenated NCHW shards."""
    x = np.concatenate(parts, axis=0)
    return np.moveaxis(x, 1, 0).reshape(x.shape[1], -1)


def reference_variance(parts: Sequence[np.ndarray]) -> np.ndarray:
    """Biased per-channel variance of the concatenation, in float64 (two-pass)."""
    rows = _channels_first_rows(parts).astype(np.float64)
    return rows.var(axis=1)


def naive_variance(parts: Sequence[np.ndarray]) -> np.ndarray:
    """``E[x^2] - E[x]^2`` with float32 sums (NumPy's pairwise summation), the one-pass
    formula of Keras's synchronized BN and Flax's default."""
    rows = _channels_first_rows(parts)
    mean = rows.mean(axis=1, dtype=np.float32)
    mean_sq = (rows * rows).mean(axis=1, dtype=np.float32)
    return mean_sq - mean * mean


def relative_error(variance, reference) -> float:
    """Largest per-channel ``|var - ref| / ref``."""
    v = np.asarray(variance, dtype=np.float64).reshape(-1)
    r = np.asarray(reference, dtype=np.float64).reshape(-1)
    return float(np.max(np.abs(v - r) / r))


def torch_variances(spec: dict, world: int, group=None) -> dict:
    """Run on every rank of ``group`` (W = ``world`` ranks): the relative error of the
    variance ``syncbn.SyncBatchNorm`` merges across the ranks, per offset. Rank 0 also
    adds ``torch.nn.BatchNorm2d`` on the concatenated batch in one process and the
    naive float32 formula. Returns ``{impl: {offset: error}}`` (on rank 0; others None)."""
    import torch
    import torch.distributed as dist

    from ..torch.batchnorm import SyncBatchNorm

    rank = dist.get_rank(group) if dist.is_initialized() else 0
    errors = {"syncbn": {}, "torch_bn_one_process": {}, "naive_float32": {}}
    for offset in spec["offsets"]:
        parts = shards(offset, world, spec["batch"], spec["channels"], spec["size"])
        ref = reference_variance(parts)
        count = world * parts[0].size // parts[0].shape[1]

        layer = SyncBatchNorm(spec["channels"], momentum=1.0, process_group=group)
        layer(torch.from_numpy(parts[rank]))
        var = layer.running_var.double().numpy() * (count - 1) / count
        errors["syncbn"][str(offset)] = relative_error(var, ref)

        if rank == 0:
            bn = torch.nn.BatchNorm2d(spec["channels"], momentum=1.0)
            bn(torch.from_numpy(np.concatenate(parts)))
            var = bn.running_var.double().numpy() * (count - 1) / count
            errors["torch_bn_one_process"][str(offset)] = relative_error(var, ref)
            errors["naive_float32"][str(offset)] = relative_error(naive_variance(parts), ref)
    return errors if rank == 0 else None


def large_plane_errors(spec: dict, world: int, group=None) -> list:
    """Run on every rank of ``group`` (W = ``world`` ranks): per shape of ``spec["shapes"]``
    (one rank's input) and offset of ``spec["offsets"]``, the relative error of the merged
    variance (running buffer, momentum 1, de-biased) and the forward output error (largest
    over every rank's output, in units of the std) of ``syncbn.SyncBatchNorm``, against
    float64 two-pass statistics of the same float32 values reduced over the group; and
    the same two errors of ``torch.nn.BatchNorm2d`` on the W ranks' inputs concatenated
    in one process (rank 0 gathers them). Rank 0 returns the rows; the others None.

    Each rank draws its own input (channel c: mean ``offset * (1 + c / C)``, std 1)."""
    import torch
    import torch.distributed as dist

    from ..torch.batchnorm import SyncBatchNorm

    rank = dist.get_rank(group)
    rows = []
    for shape in spec["shapes"]:
        channels = shape[1]
        for offset in spec["offsets"]:
            gen = torch.Generator().manual_seed(SEED + 7919 * rank)
            means = offset * (1.0 + torch.arange(channels, dtype=torch.float64) / channels)
            x = (torch.randn(shape, generator=gen, dtype=torch.float64) + means.view(1, -1, 1, 1)).float()
            layer = SyncBatchNorm(channels, momentum=1.0, process_group=group)
            y = layer(x).detach()

            xd = x.double()
            count = float(world * (x.numel() // channels))
            mean = xd.sum((0, 2, 3))
            dist.all_reduce(mean, group=group)
            mean /= count
            var = (xd - mean.view(1, -1, 1, 1)).square().sum((0, 2, 3))
            dist.all_reduce(var, group=group)
            var /= count

            def errors(out, inp, buffer):
                xhat = (inp.double() - mean.view(1, -1, 1, 1)) / (var + layer.eps).sqrt().view(1, -1, 1, 1)
                merged = buffer.double() * (count - 1) / count
                return ((merged - var).abs() / var).max().item(), (out.double() - xhat).abs().max().item()

            var_err, out_err = errors(y, x, layer.running_var)
            # a NaN error as inf: gloo's MAX drops a NaN unless rank 0 holds it
            worst = torch.tensor([math.inf if math.isnan(out_err) else out_err], dtype=torch.float64)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
            parts = [torch.empty_like(x) for _ in range(world)] if rank == 0 else None
            dist.gather(x, parts, dst=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
            row = None
            if rank == 0:
                whole = torch.cat(parts)
                bn = torch.nn.BatchNorm2d(channels, momentum=1.0)
                bn_var, bn_out = errors(bn(whole).detach(), whole, bn.running_var)
                row = {"shape": list(shape), "offset": offset, "world": world,
                       "syncbn_var": var_err, "syncbn_out": worst.item(),
                       "torch_bn_var": bn_var, "torch_bn_out": bn_out}
            rows.append(row)
    return rows if rank == 0 else None
