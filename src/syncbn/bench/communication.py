"""Communication per layer call: counted in a real run, and modelled for any W.

Counted: inside a worker of a gloo process group, one ``syncbn.SyncBatchNorm`` call
runs under :func:`syncbn.tools.traffic.record_collectives`, which lists the collectives the
process group itself executed (not what syncbn believes it sends), forward and
backward separately, plus an eval-mode call, which must send nothing.

Modelled, per rank and per layer call, for W from 2 to 1024, with the bytes on the
wire of the usual bandwidth-optimal algorithms (:func:`syncbn.tools.traffic.wire_bytes`):

- syncbn: all_reduce of ``2C + 1`` float64 forward, all_reduce of ``2C + 1`` values of
  the compute dtype (float32) backward (the two sums and the kept-channel overflow slot
  of :class:`syncbn.SyncBatchNormAct`, 0 for the plain layer), each with the layer
  fingerprint's 18 values in front (:mod:`syncbn.torch.fingerprint`); the payload does not
  depend on W and the wire bytes stay below twice the payload.
- ``torch.nn.SyncBatchNorm``: all_gather of ``2C + 1`` float32 per rank forward
  (mean, invstd, count), all_reduce of ``2C`` float32 backward; each rank receives the
  other ranks' ``W - 1`` packs.

The model of syncbn is checked against the counted payloads at the W the run reached.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import List

from ..torch.fingerprint import SIZE as FINGERPRINT
from ..tools.traffic import wire_bytes

__all__ = ["count_layer_collectives", "syncbn_model", "torch_syncbn_model", "table"]


def count_layer_collectives(channels: int, group=None) -> dict:
    """Collectives of one training call (forward, backward) and one eval call of a
    ``SyncBatchNorm(channels)`` on this rank's ``group``; run it on every rank."""
    import torch

    from ..torch.batchnorm import SyncBatchNorm
    from ..torch.distributed import group_size
    from ..tools.traffic import record_collectives

    world = group_size(group)
    layer = SyncBatchNorm(channels, process_group=group)
    x = (torch.randn(2, channels, 4, 4) + 1.0).requires_grad_()
    layer(x).backward(torch.randn(2, channels, 4, 4))  # warm-up: lazy state of the group

    with record_collectives() as forward:
        y = layer(x)
    dy = torch.randn_like(y)
    with record_collectives() as backward:
        y.backward(dy)
    layer.eval()
    with record_collectives() as evaluation, torch.no_grad():
        layer(x)

    def describe(calls) -> dict:
        return {
            "count": len(calls),
            "calls": [asdict(c) for c in calls],
            "payload_bytes": sum(c.payload_bytes for c in calls),
            "wire_bytes": sum(wire_bytes(c.op, c.payload_bytes, world) for c in calls),
        }

    return {"world": world, "channels": channels, "forward": describe(forward),
            "backward": describe(backward), "eval": describe(evaluation)}


def _one_collective_each_way(world: int, forward_op: str, fwd: int, bwd: int) -> dict:
    """Per-rank figures of an algorithm with one collective forward and one all-reduce
    backward, of ``fwd`` and ``bwd`` payload bytes."""
    return {
        "forward_collectives": 1, "backward_collectives": 1,
        "forward_payload_bytes": fwd, "backward_payload_bytes": bwd,
        "forward_wire_bytes": wire_bytes(forward_op, fwd, world),
        "backward_wire_bytes": wire_bytes("all_reduce", bwd, world),
    }


def syncbn_model(world: int, channels: int) -> dict:
    """syncbn: all-reduce of 2C+1 float64 forward, of 2C+1 float32 backward (the sums and
    the kept-channel overflow slot), each with the layer fingerprint's ``FINGERPRINT``
    values."""
    return _one_collective_each_way(
        world, "all_reduce", (2 * channels + 1 + FINGERPRINT) * 8, (2 * channels + 1 + FINGERPRINT) * 4
    )


def torch_syncbn_model(world: int, channels: int) -> dict:
    """torch.nn.SyncBatchNorm: all-gather of 2C+1 float32 per rank forward, all-reduce of
    2C float32 backward."""
    return _one_collective_each_way(world, "all_gather", (2 * channels + 1) * 4, 2 * channels * 4)


def table(worlds: List[int], channels: int, counted: List[dict]) -> List[dict]:
    """One row per W: modelled bytes per rank (sent, = received) of both algorithms,
    with the counted figures where the run reached that W."""
    by_world = {c["world"]: c for c in counted if c["channels"] == channels}
    rows = []
    for w in worlds:
        ours, theirs = syncbn_model(w, channels), torch_syncbn_model(w, channels)
        row = {
            "world": w, "channels": channels,
            "syncbn_wire_bytes": ours["forward_wire_bytes"] + ours["backward_wire_bytes"],
            "syncbn_payload_bytes": ours["forward_payload_bytes"] + ours["backward_payload_bytes"],
            "torch_syncbn_wire_bytes": theirs["forward_wire_bytes"] + theirs["backward_wire_bytes"],
            "source": "model",
        }
        seen = by_world.get(w)
        if seen is not None:
            row["source"] = "counted"
            row["syncbn_wire_bytes"] = seen["forward"]["wire_bytes"] + seen["backward"]["wire_bytes"]
            row["syncbn_payload_bytes"] = seen["forward"]["payload_bytes"] + seen["backward"]["payload_bytes"]
            row["counted_collectives"] = [seen["forward"]["count"], seen["backward"]["count"]]
        row["ratio_torch_over_syncbn"] = row["torch_syncbn_wire_bytes"] / row["syncbn_wire_bytes"]
        rows.append(row)
    return rows
