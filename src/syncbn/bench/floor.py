"""The floor: the time a BN training step needs just to move its bytes.

A batch norm layer's training step cannot be faster than the memory traffic it needs,
per element of the input (no cache holds a real activation between the passes):

- forward: read x for the statistics (1), read x and write y to normalize (2);
- backward: read dy and x for the two per-channel sums (2), read dy and x and
  write dx (3);

8 passes over ``numel`` elements. The machine's bandwidth is measured as a large
tensor copy (read + write) in the same process and with the same threads as the
timings, and ``floor = 8 * numel * itemsize / bandwidth``.
"""

from __future__ import annotations

import statistics
import time

__all__ = ["PASSES", "step_bytes", "copy_bandwidth", "floor_seconds"]

PASSES = {"forward statistics (read x)": 1, "normalize (read x, write y)": 2,
          "backward sums (read dy, x)": 2, "input gradient (read dy, x, write dx)": 3}


def step_bytes(numel: int, itemsize: int = 4) -> int:
    """Bytes a forward + backward of one BN layer must move for an input of ``numel``."""
    return sum(PASSES.values()) * numel * itemsize


def copy_bandwidth(mib: int = 256, repeats: int = 7) -> dict:
    """Bytes per second moved by ``dst.copy_(src)`` on float32 CPU tensors of ``mib`` MiB
    (read + write counted), median of ``repeats`` copies after one warm-up."""
    import torch

    numel = mib * 2**20 // 4
    src = torch.rand(numel)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        seconds.append(time.perf_counter() - start)
    median = statistics.median(seconds)
    return {"bytes_per_s": 2 * numel * 4 / median, "tensor_mib": mib, "median_s": median,
            "threads": torch.get_num_threads()}


def floor_seconds(numel: int, bytes_per_s: float, itemsize: int = 4) -> float:
    return step_bytes(numel, itemsize) / bytes_per_s
