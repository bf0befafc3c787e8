"""``syncbn bench``: measured speed, communication, memory and numerics of syncbn, side
by side with the alternatives, in one run on this machine.

Modules, one concern each:

- :mod:`~syncbn.bench.plan`: the grid, world sizes, repeats and the peers;
- :mod:`~syncbn.bench.peers`: starting one peer's process with a bounded time;
- :mod:`~syncbn.bench.timing`: medians of interleaved, repeated blocks after warm-up;
- :mod:`~syncbn.bench.torch_peer`, :mod:`~syncbn.bench.keras_peer`,
  :mod:`~syncbn.bench.keras_multiworker`, :mod:`~syncbn.bench.flax_peer`: the processes
  that measure each framework;
- :mod:`~syncbn.bench.communication`, :mod:`~syncbn.bench.memory`,
  :mod:`~syncbn.bench.numerics`, :mod:`~syncbn.bench.floor`: what is measured;
- :mod:`~syncbn.bench.runner`, :mod:`~syncbn.bench.report`,
  :mod:`~syncbn.bench.plots`: running it all and writing the report.

This package is the ``bench`` subcommand of :mod:`syncbn.cli` (``HELP``,
``add_arguments``, ``run``) and runs alone as ``python -m syncbn.bench``. Importing
it imports no deep-learning framework: every measurement runs in a peer process.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

__all__ = ["HELP", "add_arguments", "run", "main"]

HELP = "measure syncbn against torch, Keras and Flax batch norms: speed, communication, memory, numerics"

DESCRIPTION = """\
Per-layer forward + backward time over a grid of shapes for torch.nn.BatchNorm2d,
syncbn.SyncBatchNorm (no process group, W gloo processes, and a group of two emulated
in one process without communication), torch.nn.SyncBatchNorm,
Keras BatchNormalization(synchronized=True) and syncbn.keras.SyncBatchNormalization
under MirroredStrategy on W logical CPUs and under MultiWorkerMirroredStrategy with
2 worker processes on 127.0.0.1 (beside syncbn's 2 gloo processes, a few grid points:
the equal-topology comparison that the Keras bar judges), and Flax BatchNorm (both variance modes) and
syncbn.flax.BatchNorm under pmap on W host devices, each in its own process(es) with the
same threads per replica; the collectives and bytes of one layer call counted at the
process group; the bytes saved
for backward and the peak memory of a demo-network step; the error of the merged
variance far from zero. Writes report.json, report.md and PNG plots to --out and
prints a summary with pass/fail lines for the targets.

Exit status 0 when every measurement ran, whatever the targets' pass/fail lines say;
1 when a peer process failed or timed out or a measurement raised (the report is
still written, its errors listed in report.json and report.md); 2 for a usage error.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .plan import PEERS

    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--out", default="syncbn-out/bench", help="output folder (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="one small point, few repeats, W <= 2 (1-2 minutes on 2 cores)")
    parser.add_argument("--threads", type=int, default=1, help="threads per replica (default: %(default)s)")
    parser.add_argument("--peers", nargs="+", choices=list(PEERS), default=None, metavar="PEER",
                        help=f"measure only these ({', '.join(PEERS)}; default: all that are installed)")


def run(args: argparse.Namespace) -> int:
    from ..tools.output import unusable_output
    from .plan import make_plan
    from .report import terminal
    from .runner import run_bench

    if args.threads < 1:
        print("syncbn bench: --threads must be at least 1", file=sys.stderr)
        return 2
    problem = unusable_output(args.out)  # before any peer runs; leaves nothing behind
    if problem:
        print(f"syncbn bench: {problem}", file=sys.stderr)
        return 2
    plan = make_plan(quick=args.quick, threads=args.threads, peers=args.peers)
    command = "syncbn bench " + " ".join(shlex.quote(a) for a in getattr(args, "argv", None) or sys.argv[2:])
    say = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    report = run_bench(plan, Path(args.out), say=say, command=command.strip())
    print(terminal(report))
    print(f"\nreport: {Path(args.out) / 'report.md'} (and report.json, plots)")
    if report["errors"]:  # a measurement that failed is missing from the figures: not a success
        print(f"syncbn bench: {len(report['errors'])} measurement(s) failed: {', '.join(report['errors'])} "
              "(see the report's errors)", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m syncbn.bench")
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return run(args)
