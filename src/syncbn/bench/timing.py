"""Timing steps: medians of repeated blocks after warm-up, candidates interleaved.

Framework-free: a candidate is a ``step()`` callable (one forward + backward) and a
``sync()`` callable that returns once the work issued so far is done (a no-op for
eager CPU torch, ``block_until_ready`` for JAX ...). Every block runs ``inner`` steps,
with ``inner`` chosen so that a block lasts at least ``min_block_s``; the figure of a
candidate is the median over the repeats of the per-step time of a block.

Candidates measured in the same process are interleaved block by block (A B C A B C
...), so a change of machine load during the measurement touches all of them alike and
their ratio stays meaningful. In a multi-process job, ``agree`` makes every rank use
the same block length (the largest any rank asks for), and ``barrier`` lines the ranks
up before every block, so that collectives never wait on a rank that is still in
another candidate's block.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Dict, List, Optional, Tuple

__all__ = ["measure_interleaved", "summarize"]

Candidate = Tuple[Callable[[], object], Callable[[], object]]  # (step, sync)


def _block(step, sync, inner: int) -> float:
    start = time.perf_counter()
    for _ in range(inner):
        step()
    sync()
    return (time.perf_counter() - start) / inner


def measure_interleaved(
    candidates: Dict[str, Candidate],
    repeats: int,
    warmup: int = 1,
    min_block_s: float = 0.02,
    agree: Optional[Callable[[int], int]] = None,
    barrier: Optional[Callable[[], None]] = None,
) -> Dict[str, List[float]]:
    """Seconds per step of every candidate, one value per repeat (block)."""
    line_up = barrier or (lambda: None)
    same = agree or (lambda n: n)  # every count of steps that communicates must match across ranks
    inner = {}
    for name, (step, sync) in candidates.items():
        line_up()
        best = _block(step, sync, 1)  # the first call also builds caches, traces, graphs
        count = same(max(1, int(min_block_s / max(best, 1e-7))))
        for _ in range(warmup):
            line_up()
            best = min(best, _block(step, sync, count))
        inner[name] = same(max(1, math.ceil(min_block_s / max(best, 1e-7))))
    times: Dict[str, List[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, (step, sync) in candidates.items():
            line_up()
            times[name].append(_block(step, sync, inner[name]))
    return times


def summarize(seconds: List[float]) -> dict:
    """Median, spread and count of per-step times (seconds)."""
    ordered = sorted(seconds)
    n = len(ordered)
    q1 = ordered[(n - 1) // 4]
    q3 = ordered[(3 * (n - 1) + 3) // 4]
    return {"median_s": statistics.median(ordered), "min_s": ordered[0], "q1_s": q1, "q3_s": q3, "repeats": n}
