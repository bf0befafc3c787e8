"""``syncbn verify``: proof, on the user's own model, that synchronized BatchNorm over W
processes trains exactly like one process on the concatenated batch.

    syncbn verify MODULE:FACTORY --input-shape N,C,H,W [--world-size W] [--steps K]

1. ``FACTORY`` (a callable in ``MODULE``, or in a ``.py`` file given by path) builds the
   model, seeded, in float64 by default; rank 0's initial parameters and buffers are
   given to every rank.
2. W local CPU processes (gloo on 127.0.0.1) each convert the model with
   :func:`syncbn.convert_sync_batchnorm` and run K training steps (plain SGD, gradients
   averaged over the ranks as DDP does) on their own random batch of shape
   ``(N, C, H, W)``, with the loss ``sum(output * g)`` for a fixed random ``g``.
3. One process runs the unconverted model from the same start on the concatenation of
   the W batches, with the mean of the W losses.
4. A table per BatchNorm layer shows the largest relative difference (``max |a - b| /
   max |b|``) of its outputs over all steps and of its running statistics after the
   last step, whether the ranks' buffers agree, and how often it ran per step; one line
   shows the parameters after the last step. Exit status 0 when everything is within
   ``--tolerance``, 1 when not (or when the run failed), 2 for a usage error.

A model that uses a BN layer in a way the ranks do not share (a layer skipped on some
ranks, or called more often on one rank than on another) would leave a rank waiting
for a collective that never comes. verify checks before every BN call, and at the end
of every forward pass, that all ranks are about to run the same layer (one small
all-gather), and stops every rank with a message naming the layers when they are not.
Anything else that stalls is ended by the process group's timeout (``--timeout``).
A layer called several times per step on every rank is fine (each call synchronizes);
the table shows its call count.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

__all__ = ["HELP", "VerifySpec", "LayerOrderError", "add_arguments", "run", "main", "verify"]

HELP = "check that syncbn on W local processes trains your model exactly like one process on the whole batch"

_DTYPES = ("float64", "float32")
_DEFAULT_TOLERANCE = {"float64": 1e-8, "float32": 1e-3}


class UsageError(ValueError):
    """A bad factory path, input shape or option (exit status 2)."""


class LayerOrderError(RuntimeError):
    """The ranks were about to run different BatchNorm layers (raised on every rank alike)."""


@dataclass
class VerifySpec:
    """Everything a rank (and the reference) needs to rebuild the same run."""

    target: str
    input_shape: tuple
    world_size: int = 2
    steps: int = 3
    dtype: str = "float64"
    seed: int = 0
    lr: float = 0.05
    tolerance: Optional[float] = None
    timeout: float = 60.0
    sys_path: List[str] = field(default_factory=list)

    @property
    def tol(self) -> float:
        return self.tolerance if self.tolerance is not None else _DEFAULT_TOLERANCE[self.dtype]


# ---- building the model and the data, identically everywhere ------------------------------


def load_factory(target: str, sys_path: Sequence[str] = ()):
    """The callable named by ``MODULE:FACTORY`` (``FACTORY`` may be dotted; ``MODULE`` a
    dotted module name or a path to a ``.py`` file)."""
    for path in reversed(list(sys_path)):
        if path not in sys.path:
            sys.path.insert(0, path)
    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"expected MODULE:FACTORY (e.g. mypkg.models:build_net), got {target!r}")
    try:
        if module_name.endswith(".py") or os.sep in module_name:
            path = os.path.abspath(module_name)
            if not os.path.isfile(path):
                raise UsageError(f"no such file: {module_name}")
            name = "_syncbn_verify_" + os.path.splitext(os.path.basename(path))[0]
            if name in sys.modules:
                module = sys.modules[name]
            else:
                spec = importlib.util.spec_from_file_location(name, path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[name] = module
                spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except UsageError:
        raise
    except ImportError as exc:
        raise UsageError(f"cannot import {module_name!r}: {exc}") from exc
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"{module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UsageError(f"{target!r} is not callable")
    return obj


def build_model(spec: VerifySpec):
    import torch
    import torch.nn as nn

    factory = load_factory(spec.target, spec.sys_path)
    torch.manual_seed(spec.seed)
    model = factory()
    if not isinstance(model, nn.Module):
        raise UsageError(f"{spec.target} returned a {type(model).__name__}, not a torch.nn.Module")
    return model.to(getattr(torch, spec.dtype)).train()


def rank_input(spec: VerifySpec, step: int, rank: int):
    """Rank ``rank``'s batch at ``step``: random, with a non-zero mean."""
    import torch

    gen = torch.Generator().manual_seed(1_000_003 * (spec.seed + 1) + 1009 * step + rank)
    x = torch.randn(spec.input_shape, generator=gen, dtype=torch.float64) * 2 + 0.5
    return x.to(getattr(torch, spec.dtype))


def _output_tensors(output) -> list:
    import torch

    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        return [t for key in sorted(output, key=str) for t in _output_tensors(output[key])]
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _output_tensors(item)]
    return []


def _rank_loss(outputs: list, spec: VerifySpec, step: int, rank: int):
    """``sum(output * g)`` over the output tensors, ``g`` fixed by (seed, step, rank)."""
    import torch

    gen = torch.Generator().manual_seed(7_000_003 * (spec.seed + 1) + 1013 * step + rank)
    total = 0.0
    for out in outputs:
        if not out.is_floating_point() or not out.requires_grad:
            continue
        g = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out.dtype)
        total = total + (out * g).sum()
    return total


def _bn_layers(model) -> list:
    from torch.nn.modules.batchnorm import _BatchNorm

    return [(name, m) for name, m in model.named_modules() if isinstance(m, _BatchNorm)]


class _Recorder:
    """Per BN layer and step, the outputs of every call (detached)."""

    def __init__(self, layers):
        self.outputs: Dict[str, list] = {name: [] for name, _ in layers}  # [step][call]
        self.handles = [m.register_forward_hook(self._hook(name)) for name, m in layers]

    def new_step(self):
        for calls in self.outputs.values():
            calls.append([])

    def _hook(self, name):
        def hook(module, args, out):
            self.outputs[name][-1].append(out.detach().clone())

        return hook


class _OrderCheck:
    """Before each BN call and at the end of each forward: do all ranks agree on what
    comes next? One all-gather of two integers; every rank raises the same error if not."""

    END = -1

    def __init__(self, layers, device):
        self.names = [name for name, _ in layers]
        self.device = device
        self.step = 0
        self.calls = [0] * len(layers)
        self.handles = [m.register_forward_pre_hook(self._hook(i)) for i, (_, m) in enumerate(layers)]

    def new_step(self, step):
        self.step = step
        self.calls = [0] * len(self.names)

    def _hook(self, index):
        def hook(module, args):
            self.calls[index] += 1
            self.check(index, self.calls[index])

        return hook

    def check(self, index: int, call: int = 0) -> None:
        import torch

        from . import distributed

        mine = torch.tensor([index, call], dtype=torch.int64, device=self.device)
        rows = distributed.all_gather(mine).tolist()
        if all(row == rows[0] for row in rows):
            return
        lines = []
        for rank, (i, c) in enumerate(rows):
            what = "reached the end of its forward pass" if i == self.END else f"is calling {self.names[i]!r} (call {c} of this step)"
            lines.append(f"  rank {rank} {what}")
        involved = sorted({self.names[i] for i, _ in rows if i != self.END})
        raise LayerOrderError(
            f"BatchNorm layers out of step across ranks at training step {self.step + 1}:\n"
            + "\n".join(lines)
            + f"\nlayer(s) involved: {', '.join(involved)}. Every rank must call the same "
            "BatchNorm layers, the same number of times, in the same order: a synchronized "
            "layer that one rank skips leaves the others waiting for it. Make the layer run on "
            "every rank (for example on an empty batch), or keep it out of the conversion."
        )


# ---- one rank of the distributed run ----------------------------------------------------


def _rank_job(spec: VerifySpec) -> dict:
    import torch

    import syncbn

    from . import distributed

    rank = distributed.group_rank()
    world = distributed.group_size()
    model = build_model(spec)
    with torch.no_grad():  # every rank starts from rank 0's parameters and buffers
        for tensor in list(model.parameters()) + list(model.buffers()):
            distributed.broadcast(tensor.data, 0)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()} if rank == 0 else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = syncbn.convert_sync_batchnorm(model)
    notes = sorted({str(w.message) for w in caught if "convert_sync_batchnorm" in str(w.message)})
    layers = _bn_layers(model)
    recorder = _Recorder(layers)
    order = _OrderCheck(layers, torch.device("cpu"))
    opt = torch.optim.SGD(model.parameters(), lr=spec.lr)
    for step in range(spec.steps):
        recorder.new_step()
        order.new_step(step)
        opt.zero_grad(set_to_none=False)
        outputs = _output_tensors(model(rank_input(spec, step, rank)))
        order.check(_OrderCheck.END)
        loss = _rank_loss(outputs, spec, step, rank)
        if isinstance(loss, torch.Tensor):
            loss.backward()
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if params:  # the data-parallel average of the gradients, in one all-reduce
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            flat = distributed.all_reduce_sum(flat) / world
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        opt.step()
    return {
        "initial": initial,
        "outputs": recorder.outputs,
        "buffers": {k: v.detach().clone() for k, v in model.state_dict().items() if k not in dict(model.named_parameters())},
        "params": {k: p.detach().clone() for k, p in model.named_parameters()},
        "notes": notes,
    }


# ---- the one-process reference ------------------------------------------------------------


def _reference(spec: VerifySpec, initial: dict) -> dict:
    import torch

    model = build_model(spec)
    model.load_state_dict(initial)
    layers = _bn_layers(model)
    recorder = _Recorder(layers)
    opt = torch.optim.SGD(model.parameters(), lr=spec.lr)
    n = spec.input_shape[0]
    for step in range(spec.steps):
        recorder.new_step()
        opt.zero_grad(set_to_none=False)
        x = torch.cat([rank_input(spec, step, r) for r in range(spec.world_size)])
        outputs = _output_tensors(model(x))
        total = 0.0
        for r in range(spec.world_size):
            chunks = []
            for out in outputs:
                if out.dim() == 0 or out.shape[0] != n * spec.world_size:
                    raise UsageError(
                        f"an output of shape {tuple(out.shape)} does not keep the batch dimension "
                        f"first (expected {n * spec.world_size} rows for {spec.world_size} x {n})"
                    )
                chunks.append(out[r * n : (r + 1) * n])
            total = total + _rank_loss(chunks, spec, step, r)
        if isinstance(total, torch.Tensor):
            (total / spec.world_size).backward()
        opt.step()
    return {
        "outputs": recorder.outputs,
        "buffers": {k: v.detach().clone() for k, v in model.state_dict().items() if k not in dict(model.named_parameters())},
        "params": {k: p.detach().clone() for k, p in model.named_parameters()},
    }


# ---- comparison and report ------------------------------------------------------------------


def _rel(actual, expected) -> float:
    import torch

    if actual.shape != expected.shape:
        return float("inf")
    if expected.numel() == 0:
        return 0.0
    a, b = actual.double(), expected.double()
    # a NaN or inf on either side is a failure (a NaN figure would vanish in max())
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float("inf")
    scale = float(b.abs().max())
    diff = float((a - b).abs().max())
    if scale == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / scale


@dataclass
class LayerRow:
    name: str
    calls: str
    output: float
    running_mean: Optional[float]
    running_var: Optional[float]
    ranks_agree: bool

    def worst(self) -> float:
        return max(v for v in (self.output, self.running_mean or 0.0, self.running_var or 0.0))


def compare(spec: VerifySpec, ranks: List[dict], ref: dict):
    """Per-layer rows, (worst parameter difference, its name), and the verdict."""
    import torch

    rows = []
    for name, ref_steps in ref["outputs"].items():
        ref_calls = {len(calls) for calls in ref_steps}
        rank_calls = {len(calls) for r in ranks for calls in r["outputs"].get(name, [])}
        calls = "/".join(str(c) for c in sorted(ref_calls | rank_calls))
        output = 0.0
        for step, ref_out in enumerate(ref_steps):
            per_rank = [r["outputs"][name][step] for r in ranks]
            if any(len(c) != len(ref_out) for c in per_rank):
                output = float("inf")
                continue
            for call, expected in enumerate(ref_out):
                got = torch.cat([c[call] for c in per_rank])
                output = max(output, _rel(got, expected))
        stats = {}
        agree = True
        for stat in ("running_mean", "running_var"):
            key = f"{name}.{stat}" if name else stat
            if key not in ref["buffers"] or ref["buffers"][key] is None:
                stats[stat] = None
                continue
            stats[stat] = max(_rel(r["buffers"][key], ref["buffers"][key]) for r in ranks)
            agree &= all(torch.equal(r["buffers"][key], ranks[0]["buffers"][key]) for r in ranks)
        rows.append(LayerRow(name or "(model)", calls, output, stats["running_mean"], stats["running_var"], agree))
    worst_param, worst_name = 0.0, ""
    for key, expected in ref["params"].items():
        err = max(_rel(r["params"][key], expected) for r in ranks)
        if err >= worst_param:
            worst_param, worst_name = err, key
    ok = all(row.worst() <= spec.tol and row.ranks_agree for row in rows) and worst_param <= spec.tol
    return rows, (worst_param, worst_name), ok


def _fmt(value: Optional[float]) -> str:
    if value is None:
        return "-"
    if value == float("inf"):
        return "mismatch"
    return f"{value:.1e}"


def format_report(spec: VerifySpec, rows, params, ok: bool, notes: Sequence[str] = ()) -> str:
    width = max([len("BatchNorm layer")] + [len(r.name) for r in rows])
    lines = [
        f"syncbn verify {spec.target}: {spec.world_size} ranks x input {tuple(spec.input_shape)}, "
        f"{spec.steps} step(s), {spec.dtype}, tolerance {spec.tol:g}",
        "max relative difference |syncbn on the ranks - one process on the concatenated batch| / |one process|",
        "",
        f"{'BatchNorm layer':<{width}}  {'calls/step':>10}  {'outputs':>9}  {'run. mean':>9}  {'run. var':>9}  ranks agree",
    ]
    for r in rows:
        flag = "yes" if r.ranks_agree else "NO"
        mark = "" if r.worst() <= spec.tol and r.ranks_agree else "   <-- over tolerance" if r.ranks_agree else "   <--"
        lines.append(
            f"{r.name:<{width}}  {r.calls:>10}  {_fmt(r.output):>9}  {_fmt(r.running_mean):>9}  "
            f"{_fmt(r.running_var):>9}  {flag}{mark}"
        )
    if not rows:
        lines.append("(no BatchNorm layer in this model)")
    lines.append("")
    lines.append(f"parameters after step {spec.steps}: {_fmt(params[0])}" + (f" (worst: {params[1]})" if params[1] else ""))
    for note in notes:
        lines.append(f"note: {note}")
    lines.append("")
    lines.append(
        "PASS: syncbn reproduces one process on the concatenated batch"
        if ok
        else "FAIL: differences above the tolerance (see the marked rows)"
    )
    return "\n".join(lines)


# ---- the command --------------------------------------------------------------------------


def _shape(text: str) -> tuple:
    try:
        shape = tuple(int(v) for v in text.replace("x", ",").split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 2,3,32,32, got {text!r}")
    if len(shape) < 2 or any(v < 1 for v in shape):
        raise argparse.ArgumentTypeError(f"expected at least (N, C), all positive, got {text!r}")
    return shape


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n")[0].replace("``", "")
    parser.add_argument("target", metavar="MODULE:FACTORY", help="callable returning the nn.Module to check (MODULE may be a .py path)")
    parser.add_argument("--input-shape", type=_shape, required=True, metavar="N,C,H,W", help="one rank's input shape")
    parser.add_argument("--world-size", type=int, default=2, metavar="W", help="local processes (default 2)")
    parser.add_argument("--steps", type=int, default=3, metavar="K", help="training steps (default 3)")
    parser.add_argument("--dtype", choices=_DTYPES, default="float64", help="model and data dtype (default float64)")
    parser.add_argument("--tolerance", type=float, default=None, help="largest relative difference that passes (default 1e-8 in float64, 1e-3 in float32)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS", help="process-group timeout: the longest any collective may wait (default 60)")


def verify(spec: VerifySpec, out=None, pool=None) -> int:
    """Run the check and print the report to ``out``; returns the exit status.

    ``pool``: an existing :class:`syncbn.launch.WorkerPool` of ``spec.world_size`` ranks
    to run on (its own process-group timeout then applies); by default one is started
    with ``spec.timeout`` and stopped afterwards.
    """
    out = out or sys.stdout
    from .launch import WorkerError, WorkerPool

    build_model(spec)  # fail early, here, on a bad factory
    job_timeout = spec.timeout * (spec.steps + 2) + 60
    try:
        if pool is not None:
            if pool.world_size != spec.world_size:
                raise UsageError(f"the pool has {pool.world_size} ranks, the check wants {spec.world_size}")
            ranks = pool.run(_rank_job, spec, timeout=job_timeout)
        else:
            with WorkerPool(spec.world_size, backend="gloo", timeout=spec.timeout) as own:
                ranks = own.run(_rank_job, spec, timeout=job_timeout)
    except WorkerError as exc:
        first = exc.errors[min(exc.errors)]
        if any(isinstance(e, (LayerOrderError, UsageError)) for e, _ in exc.errors.values()):
            error = next(e for e, _ in exc.errors.values() if isinstance(e, (LayerOrderError, UsageError)))
            print(f"FAIL: {error}", file=out)
            return 2 if isinstance(error, UsageError) else 1
        print(f"FAIL: the distributed run failed on rank(s) {sorted(exc.errors)}:", file=out)
        print(first[1], file=out)
        return 1
    except TimeoutError as exc:
        print(f"FAIL: {exc} (a collective or a step did not finish within the timeouts)", file=out)
        return 1
    ref = _reference(spec, ranks[0]["initial"])
    rows, params, ok = compare(spec, ranks, ref)
    print(format_report(spec, rows, params, ok, ranks[0]["notes"]), file=out)
    out.flush()
    return 0 if ok else 1


def run(args: argparse.Namespace) -> int:
    """The ``syncbn verify`` subcommand (see :mod:`syncbn.cli`)."""
    if args.world_size < 2:
        print("syncbn verify: --world-size must be at least 2", file=sys.stderr)
        return 2
    if args.steps < 1:
        print("syncbn verify: --steps must be at least 1", file=sys.stderr)
        return 2
    spec = VerifySpec(
        target=args.target,
        input_shape=tuple(args.input_shape),
        world_size=args.world_size,
        steps=args.steps,
        dtype=args.dtype,
        seed=args.seed,
        lr=args.lr,
        tolerance=args.tolerance,
        timeout=args.timeout,
        sys_path=[os.getcwd()],
    )
    try:
        return verify(spec)
    except UsageError as exc:
        print(f"syncbn verify: {exc}", file=sys.stderr)
        return 2


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="syncbn verify")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":  # python -m syncbn.verify (spawned workers import this too)
    from syncbn.verify import main as _main  # the importable module, so errors unpickle to its classes

    sys.exit(_main())
