"""What ``syncbn bench`` measures: the grid, the world sizes, the repeats, the peers.

A plan is plain data (dicts and lists of numbers and strings), so it travels as JSON
to every peer process and is written into the report as it was run.

Grid points are per-replica shapes: ``N`` is the batch of one replica (rank, logical
device, host device), so at W replicas every implementation normalizes the same
global batch of ``N * W`` images.
"""

from __future__ import annotations

import importlib.util
import itertools
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

__all__ = ["ORDER", "PEERS", "PROBES", "Peer", "make_plan", "grid", "installed"]


@dataclass(frozen=True)
class Peer:
    """One implementation measured in its own process(es)."""

    key: str  # the short name used in the JSON report
    label: str  # the name printed in tables
    family: str  # the peer module that runs it: torch, keras, flax
    needs: Sequence[str]  # importable modules it needs


PEERS: Dict[str, Peer] = {
    p.key: p
    for p in [
        Peer("torch_bn", "torch.nn.BatchNorm2d", "torch", ("torch",)),
        Peer("syncbn", "syncbn.SyncBatchNorm", "torch", ("torch",)),
        Peer("torch_syncbn", "torch.nn.SyncBatchNorm", "torch", ("torch",)),
        Peer("keras_bn", "keras BatchNormalization", "keras", ("tensorflow", "keras")),
        Peer("keras_sync", "keras BatchNormalization(synchronized=True)", "keras", ("tensorflow", "keras")),
        Peer("syncbn_keras", "syncbn.keras.SyncBatchNormalization", "keras", ("tensorflow", "keras")),
        Peer("keras_multiworker", "Keras synchronized BN and syncbn.keras, 2 worker processes, "
             "MultiWorkerMirroredStrategy", "keras_multiworker", ("tensorflow", "keras")),
        Peer("flax", "flax nn.BatchNorm(axis_name=...)", "flax", ("jax", "flax")),
        Peer("flax_two_pass", "flax nn.BatchNorm(axis_name=..., use_fast_variance=False)", "flax", ("jax", "flax")),
        Peer("syncbn_flax", "syncbn.flax.BatchNorm(axis_name=...)", "flax", ("jax", "flax")),
    ]
}


def installed(peer: Peer) -> Optional[str]:
    """None when every module the peer needs can be imported, else the missing one."""
    for name in peer.needs:
        if importlib.util.find_spec(name) is None:
            return name
    return None


def grid(batches, channels, sizes, layouts) -> List[dict]:
    """Every combination, as ``{"N", "C", "H", "W", "layout"}`` dicts."""
    return [
        {"N": n, "C": c, "H": s, "W": s, "layout": layout}
        for n, c, s, layout in itertools.product(batches, channels, sizes, layouts)
    ]


def make_plan(quick: bool = False, threads: int = 1, peers: Optional[Sequence[str]] = None) -> dict:
    """The full plan, or the tiny ``--quick`` one used by the tests."""
    if quick:
        plan = {
            "points": grid([2], [64], [28], ["contiguous"]),
            "worlds": {"torch": [1, 2], "keras": [2], "flax": [2]},
            "repeats": 3,
            "warmup": 1,
            "min_block_s": 0.01,
            "comm_channels": [64, 256],
            "numerics": {"offsets": [1.0, 1e2, 1e3, 1e4], "worlds": [2], "batch": 4, "channels": 8, "size": 6},
            "large_planes": {"shapes": [[1, 2, 64, 64]], "offsets": [0.0, 1e4], "worlds": [2]},
            # the counts do not depend on the shape (the same at 2x64x28x28, 2x16x8x8 and
            # 2x8x4x4), while Triton's interpreter takes 6x as long at 2x64x28x28 (43 s)
            "cuda_counts": {"shapes": [[2, 16, 8, 8]], "layouts": ["contiguous", "channels_last"]},
            "memory": {"channels": 64, "batch": 4, "size": 28, "model_batch": 2, "model_size": 64},
            "copy_mib": 64,
            "keras_multiworker": {"points": [0]},
        }
    else:
        plan = {
            "points": grid([2, 8], [64, 256], [28, 56], ["contiguous", "channels_last"]),
            "worlds": {"torch": [1, 2, 4], "keras": [1, 2, 4], "flax": [1, 2, 4]},
            "repeats": 7,
            "warmup": 2,
            "min_block_s": 0.03,
            "comm_channels": [64, 256],
            "numerics": {"offsets": [1.0, 1e2, 1e3, 1e4], "worlds": [2, 4], "batch": 8, "channels": 16, "size": 8},
            # segmentation-sized inputs per rank, where float32 accumulation of a long plane shows
            "large_planes": {"shapes": [[1, 16, 512, 512], [2, 8, 256, 384], [4, 32, 64, 64], [8, 4, 512, 512]],
                             "offsets": [0.0, 1e3, 1e4], "worlds": [2, 4]},
            "cuda_counts": {"shapes": [[8, 64, 56, 56]], "layouts": ["contiguous", "channels_last"]},
            "memory": {"channels": 256, "batch": 8, "size": 56, "model_batch": 8, "model_size": 128},
            "copy_mib": 256,
            # worker start-up costs seconds: the smallest and the largest point, both layouts
            "keras_multiworker": {"points": [0, 1, 14, 15]},
        }
    plan["quick"] = quick
    plan["threads"] = threads
    plan["peers"] = list(PEERS) if peers is None else [p for p in PEERS if p in set(peers)]
    plan["comm_worlds_formula"] = [2**k for k in range(1, 11)]  # 2 .. 1024
    return plan


# what the torch peer also times, beside the implementations
PROBES = {
    "syncbn_leaky": "syncbn.SyncBatchNorm + LeakyReLU",
    "syncbn_act": "syncbn.SyncBatchNormAct(leaky_relu), fused",
    "collectives": "syncbn's two all-reduces alone (gloo)",
    "syncbn_compute": "syncbn.SyncBatchNorm minus its all-reduces (timed inside the call)",
    "bn_collectives_compute": "torch.nn.BatchNorm2d with syncbn's two all-reduces made in its step, minus them",
    "syncbn_emulated": "syncbn.SyncBatchNorm at W=2 emulated in one process (all-reduces double: no communication)",
}
# the order of the rows in the report and the colours in the plots
ORDER = list(PEERS) + list(PROBES)
