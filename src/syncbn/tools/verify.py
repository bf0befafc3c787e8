"""``syncbn verify``: proof, on the user's own model, that synchronized BatchNorm over W
processes trains exactly like one process on the concatenated batch.

    syncbn verify MODULE:FACTORY --input-shape N,C,H,W [--world-size W] [--steps K]

1. ``FACTORY`` (a callable in ``MODULE``, or in a ``.py`` file given by path) builds the
   model, seeded, in float64 by default; rank 0's initial parameters and buffers are
   given to every rank.
2. W local CPU processes (gloo on 127.0.0.1) each convert the model with
   :func:`syncbn.convert_sync_batchnorm` and run K training steps (plain SGD, gradients
   averaged over the ranks as DDP does) on their own random batch of shape
   ``(N, C, H, W)``, with the loss ``mean(output * g)`` for a fixed random ``g`` (a mean,
   so that a step's size does not grow with the output's size: with a sum, a segmentation
   model's steps were so large that three of them made training chaotic in float32).
3. For every step, one process runs the unconverted model on the concatenation of the
   W batches, with the mean of the W losses, from the same state: the initial one, then
   rank 0's state after the step before. Each step is checked on its own: compared over a
   whole trajectory, float32 rounding grows from step to step until it reaches a ReLU kink
   (an input within rounding of zero), where results jump instead of moving smoothly
   with rounding, and no allowance measured by rerunning can bound a jump.
4. A table per BatchNorm layer shows the largest difference of its outputs and of its
   running statistics over the steps, each on its natural scale
   (outputs against the layer's largest output, a running mean against the channel's
   standard deviation, a running variance against itself plus eps), whether the ranks'
   buffers agree, and how often it ran per step; one line shows the parameters after each
   step (a BatchNorm bias against the layer's weight, any other tensor against its
   largest value).
5. What counts as equal comes from the model's own conditioning: each step's one-process
   run is repeated twice with inputs a few ulp away, and in float32 also in float64; how far those
   move each quantity is what rounding alone does to it. A quantity passes when
   syncbn's difference is at most 10 times that spread, plus ``--tolerance`` (default
   100 ulp of the dtype) on its natural scale. The "limit" column is the worst ratio of
   difference to allowance (PASS needs every ratio <= 1).
6. Each step's one-process run is also repeated on the very same data with another random seed:
   if the two disagree, the model is random in training (dropout, drop-path, ...), no
   comparison can mean anything, and verify FAILs saying so. So it does when the one-process
   run itself gives NaN or inf (the model diverges at this learning rate, dtype or input).

Exit status 0 on PASS, 1 on FAIL (or when the run failed), 2 for a usage error (a model
with no BatchNorm layer, where nothing can be verified, is one).

A model that uses a BN layer in a way the ranks do not share (a layer skipped on some
ranks, or called more often on one rank than on another) would leave a rank waiting
for a collective that never comes. verify checks before every BN call, and at the end
of every forward pass, that all ranks are about to run the same layer (one small
all-gather), and stops every rank with a message naming the layers when they are not.
When one rank raises while the others wait for it in a collective, verify stops the
waiting ranks a few seconds later (the worker pool's grace,
:data:`syncbn.tools.launch.FAILURE_GRACE_S`) and the report shows the error of the rank
that failed first. Anything else that stalls is ended by the process group's timeout
(``--timeout``).
A layer called several times per step on every rank is fine (each call synchronizes);
the table shows its call count.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from .launch import MAX_TIMEOUT_S, failure_report
from .usage import UsageError, torch_missing

__all__ = ["HELP", "VerifySpec", "LayerOrderError", "add_arguments", "run", "main", "verify"]

HELP = "check that syncbn on W local processes trains your model exactly like one process on the whole batch"

_DTYPES = ("float64", "float32")
_EPS = {"float64": 2.0**-52, "float32": 2.0**-23}
_SPREAD_FACTOR = 10.0  # syncbn's rounding may move a quantity this much more than the probe did
_NUDGE_ULPS = 4.0  # how far (in ulp of the dtype) the probe run moves every input element


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
        """The difference on the natural scale that passes whatever the conditioning."""
        return self.tolerance if self.tolerance is not None else 100 * _EPS[self.dtype]


def _check_spec(spec: VerifySpec) -> None:
    """Raise :class:`UsageError` for options no run can honour: a negative (or NaN)
    tolerance would make every allowance negative, and every difference pass; a timeout
    that is not positive kills the workers before they connect, one over
    :data:`~syncbn.tools.launch.MAX_TIMEOUT_S` hung them or killed them in an overflow; a
    learning rate of 0 never moves the parameters (their comparison checks nothing), a
    negative one failed on every rank in torch's SGD (a traceback reported as a
    distributed FAIL);
    a seed of 2**64 or more (or one that derived seeds push there) overflowed torch's
    generators in a traceback."""
    if spec.world_size < 2:
        raise UsageError("--world-size must be at least 2")
    if spec.steps < 1:
        raise UsageError("--steps must be at least 1")
    if spec.dtype not in _DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(_DTYPES)}, got {spec.dtype!r}")
    if spec.tolerance is not None and not 0.0 <= spec.tolerance < float("inf"):
        raise UsageError(f"--tolerance must be a finite number >= 0, got {spec.tolerance}")
    if not 0.0 < spec.timeout < float("inf"):
        raise UsageError(f"--timeout must be a finite positive number of seconds, got {spec.timeout}")
    if spec.timeout > MAX_TIMEOUT_S:  # torch's deadlines overflow (see MAX_TIMEOUT_S)
        raise UsageError(f"--timeout must be at most 1e9 seconds (about 31 years), got {spec.timeout}")
    if not 0.0 < spec.lr < float("inf"):
        raise UsageError(f"--lr must be a finite positive number, got {spec.lr}")
    if not 0 <= spec.seed < 2**32:  # the data's and loss weights' seeds derive from it
        raise UsageError(f"--seed must be an integer from 0 to 2**32 - 1, got {spec.seed}")


# ---- building the model and the data, identically everywhere ------------------------------


def _load_file(path: str):
    """The module of the ``.py`` file at the absolute ``path``, executed once per process.

    Its name holds a digest of the path, the same in every process (the workers of a
    pool, the reference): named after the file alone, ``a/models.py`` and then
    ``b/models.py`` checked in one process (two checks on one pool) both ran the first
    file's model."""
    digest = hashlib.sha1(path.encode()).hexdigest()[:10]
    name = f"_syncbn_verify_{os.path.splitext(os.path.basename(path))[0]}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


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
            module = _load_file(path)
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


def _check_runs_here(spec: VerifySpec) -> None:
    """Build the model and run its forward once in this process on the whole first batch
    (the W ranks' batches together, as the reference runs it), before any rank starts:
    a factory or an input shape the model cannot take (a wrong channel count) is a usage
    error (exit 2) named here, not a distributed FAIL (exit 1) that reads as syncbn's."""
    import torch

    try:
        model = build_model(spec)
    except UsageError:
        raise
    except Exception as exc:  # the user's module or factory raised: name it, exit 2
        raise UsageError(
            f"{spec.target} raised while building the model in this process, before any rank starts: "
            f"{type(exc).__name__}: {exc}. Check that the module imports and the factory runs without "
            "syncbn (call it in Python to see the traceback)"
        ) from exc
    try:  # the batch too: a size torch cannot take (past int64) or allocate is --input-shape's
        x = whole_batch(spec, 0)
        with torch.no_grad():
            model(x)
    except Exception as exc:
        raise UsageError(
            f"{spec.target} fails in one process on the whole batch ({spec.world_size} x --input-shape "
            f"{','.join(map(str, spec.input_shape))}, before any rank starts): {type(exc).__name__}: {exc}. "
            "Check --input-shape (the channel count and sizes the model takes) and that the model runs "
            "without syncbn"
        ) from exc
    if not _bn_layers(model):  # after the forward: a layer built on the first call counts
        raise UsageError(_no_batchnorm(spec, model))


def _no_batchnorm(spec: VerifySpec, model) -> str:
    """Why a model without a BatchNorm layer is refused: nothing in it is synchronized, so
    nothing would be compared but its parameters, and a PASS would vouch for nothing."""
    import torch

    names = (f"TorchScript {m.original_name}" if isinstance(m, torch.jit.ScriptModule) else type(m).__name__
             for m in model.modules())
    norms = sorted({name for name in names if "norm" in name.lower()})
    found = f" (its normalization layers: {', '.join(norms)})" if norms else ""
    return (
        f"{spec.target} builds a model with no BatchNorm layer{found}, so there is nothing to verify. "
        "A BatchNorm layer here is an instance of torch's _BatchNorm (BatchNorm1d/2d/3d, their Lazy forms, "
        "torch.nn.SyncBatchNorm, syncbn's layers, subclasses such as timm's BatchNormAct2d): the layers "
        "convert_sync_batchnorm synchronizes. Check that MODULE:FACTORY names the model you meant; "
        "GroupNorm, LayerNorm, InstanceNorm and hand-written normalizations have no statistics across "
        "the batch to synchronize; a BatchNorm inside TorchScript (torch.jit.script or trace) is not "
        "converted: give verify the factory of the model before scripting"
    )


def rank_input(spec: VerifySpec, step: int, rank: int, nudge: int = 0):
    """Rank ``rank``'s batch at ``step``: random, with a non-zero mean. ``nudge`` > 0:
    the same batch with every element moved by a few ulp (a different pattern per value)."""
    import torch

    gen = torch.Generator().manual_seed(1_000_003 * (spec.seed + 1) + 1009 * step + rank)
    x = torch.randn(spec.input_shape, generator=gen, dtype=torch.float64) * 2 + 0.5
    x = x.to(getattr(torch, spec.dtype))
    if nudge:
        gen = torch.Generator().manual_seed(31 * nudge + 1009 * step + rank)
        noise = torch.randn(spec.input_shape, generator=gen, dtype=torch.float64)
        x = (x.double() * (1 + _NUDGE_ULPS * _EPS[spec.dtype] * noise)).to(x.dtype)
    return x


def whole_batch(spec: VerifySpec, step: int, nudge: int = 0):
    """The W ranks' batches at ``step`` together (:func:`rank_input`, rank 0 first): what the
    one-process reference runs on."""
    import torch

    return torch.cat([rank_input(spec, step, r, nudge) for r in range(spec.world_size)])


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
    """``mean(output * g)`` summed over the output tensors, ``g`` fixed by (seed, step, rank)
    (a rank's outputs have the same size as its rows of the one-process outputs)."""
    import torch

    gen = torch.Generator().manual_seed(7_000_003 * (spec.seed + 1) + 1013 * step + rank)
    total = 0.0
    for out in outputs:
        if not out.is_floating_point() or not out.requires_grad:
            continue
        # rounded to the run's dtype first: a float64 rerun of a float32 check sees the same g
        g = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(getattr(torch, spec.dtype)).to(out.dtype)
        total = total + (out * g).mean()
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

        from ..torch import distributed

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

    from .. import torch as sbn

    from ..torch import distributed

    rank = distributed.group_rank()
    world = distributed.group_size()
    model = build_model(spec)
    with torch.no_grad():  # every rank starts from rank 0's parameters and buffers
        for tensor in list(model.parameters()) + list(model.buffers()):
            distributed.broadcast(tensor.data, 0)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()} if rank == 0 else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = sbn.convert_sync_batchnorm(model)
    notes = sorted({str(w.message) for w in caught if "convert_sync_batchnorm" in str(w.message)})
    layers = _bn_layers(model)
    recorder = _Recorder(layers)
    order = _OrderCheck(layers, torch.device("cpu"))
    opt = torch.optim.SGD(model.parameters(), lr=spec.lr)
    after = []
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
        # every rank's buffers after every step; the parameters (equal on every rank after
        # the average) from rank 0 at every step, the start of the reference's next step,
        # and from every rank after the last one
        last = step == spec.steps - 1
        after.append(_state(model, params=rank == 0 or last))
    return {"initial": initial, "outputs": recorder.outputs, "after": after, "notes": notes}


def _state(model, params: bool = True) -> dict:
    names = dict(model.named_parameters())
    return {
        "buffers": {k: v.detach().clone() for k, v in model.state_dict().items() if k not in names},
        "params": {k: p.detach().clone() for k, p in names.items()} if params else None,
    }


# ---- the one-process reference ------------------------------------------------------------


def _reference(spec: VerifySpec, start: dict, step: int, nudge: int = 0, seed: int = 0, dtype: Optional[str] = None) -> dict:
    """One process, one training step (number ``step``) on the concatenated batch, from the
    state ``start``. ``nudge``: inputs a few ulp away (see :func:`rank_input`); ``seed``:
    the random state the step starts from; ``dtype``: run in another dtype (the data and
    the state are those of ``spec.dtype``, converted)."""
    import dataclasses

    import torch

    run_spec = dataclasses.replace(spec, dtype=dtype) if dtype else spec
    model = build_model(run_spec)
    model.load_state_dict(start)
    layers = _bn_layers(model)
    recorder = _Recorder(layers)
    opt = torch.optim.SGD(model.parameters(), lr=spec.lr)
    n = spec.input_shape[0]
    work = getattr(torch, run_spec.dtype)
    torch.manual_seed(1_000_000 + 1009 * step + seed)
    recorder.new_step()
    opt.zero_grad(set_to_none=False)
    x = whole_batch(spec, step, nudge).to(work)
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
    return dict(_state(model), outputs=recorder.outputs, eps={name: float(m.eps) for name, m in layers})


def _start_state(initial: dict, rank0: dict, step: int) -> dict:
    """Where step ``step`` starts: the initial state, or rank 0's state after the step before."""
    if step == 0:
        return initial
    before = rank0["after"][step - 1]
    return {**before["buffers"], **before["params"]}


def _references(spec: VerifySpec, start: dict, step: int) -> dict:
    """The reference for step ``step`` from the state ``start``, and the runs that measure
    the model's conditioning there (all one step from the same state)."""
    runs = {"ref": _reference(spec, start, step), "same": _reference(spec, start, step, seed=1)}
    runs["probes"] = [_reference(spec, start, step, nudge=1), _reference(spec, start, step, nudge=2)]
    if spec.dtype != "float64":  # torch's own rounding error at this dtype, against float64
        wide = {k: v.double() if v.is_floating_point() else v for k, v in start.items()}
        runs["probes"].append(_reference(spec, wide, step, dtype="float64"))
    return runs


# ---- comparison and report ------------------------------------------------------------------


class _Quantity:
    """One compared quantity: its largest difference and largest probe spread, both on
    the quantity's natural scale (a per-element scale, broadcast)."""

    def __init__(self):
        self.diff = 0.0
        self.spread = 0.0
        self.mismatch = False
        self.unmeasured = False  # a probe gave NaN or inf: no allowance can be measured

    def add(self, actual, expected, probes, scale) -> None:
        import torch

        if actual is None or expected is None:
            self.mismatch |= (actual is None) != (expected is None)
            return
        if actual.shape != expected.shape or not (torch.isfinite(actual).all() and torch.isfinite(expected).all()):
            # a NaN or inf on either side is a failure (a NaN figure would vanish in max())
            self.mismatch = True
            return
        if expected.numel() == 0:
            return
        a, b = actual.double(), expected.double()
        scale = torch.as_tensor(scale, dtype=torch.float64).clamp_min(torch.finfo(torch.float64).tiny)
        self.diff = max(self.diff, float(((a - b).abs() / scale).max()))
        for probe in probes:
            if probe is not None and probe.shape == expected.shape:
                p = probe.double()
                if not torch.isfinite(p).all():  # an infinite spread would allow any difference
                    self.unmeasured = True
                    continue
                self.spread = max(self.spread, float(((p - b).abs() / scale).max()))

    def relative(self) -> float:
        return float("inf") if self.mismatch else self.diff

    def weak(self) -> bool:
        """Rounding alone moves this quantity by more than 1% of its scale."""
        return not self.mismatch and self.spread > 1e-2

    def ratio(self, tol: float) -> float:
        """Difference over what is allowed (<= 1 passes; with nothing allowed, only an
        exact match passes)."""
        if self.mismatch or self.unmeasured:
            return float("inf")
        allowed = _SPREAD_FACTOR * self.spread + tol
        if allowed <= 0.0:
            return 0.0 if self.diff == 0.0 else float("inf")
        return self.diff / allowed


@dataclass
class LayerRow:
    name: str
    calls: str
    output: float
    running_mean: Optional[float]
    running_var: Optional[float]
    ranks_agree: bool
    limit: float = 0.0  # worst difference / allowance over the row

    def worst(self) -> float:
        return max(v for v in (self.output, self.running_mean or 0.0, self.running_var or 0.0))


def _identical(a, b) -> bool:
    """Bit for bit the same values, a NaN matching a NaN (``torch.equal`` says a tensor
    holding a NaN differs from itself)."""
    import torch

    return a.shape == b.shape and a.dtype == b.dtype and torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True)


def _random_in_training(runs: dict, step: int = 0) -> Optional[str]:
    """Where two one-process runs of step ``step`` on the same data from the same state
    (other random seeds) first differ."""
    ref, same = runs["ref"], runs["same"]
    for name, steps in ref["outputs"].items():
        for calls, other in zip(steps, same["outputs"][name]):
            if len(other) != len(calls) or any(not _identical(a, b) for a, b in zip(calls, other)):
                return f"the outputs of BatchNorm layer {name or '(model)'!r} at step {step + 1}"
    for key, value in ref["params"].items():
        if not _identical(value, same["params"][key]):
            return f"parameter {key!r} after step {step + 1}"
    return None


def _not_finite(ref: dict, step: int = 0) -> Optional[str]:
    """Where the one-process run of step ``step`` itself first gives a NaN or an inf (then
    neither side can be judged, and the model, not syncbn, is what to look at)."""
    import torch

    for name, steps in ref["outputs"].items():
        for calls in steps:
            if any(out.is_floating_point() and not torch.isfinite(out).all() for out in calls):
                return f"the outputs of BatchNorm layer {name or '(model)'!r} at step {step + 1}"
    for group in ("buffers", "params"):
        for key, value in ref[group].items():
            if value.is_floating_point() and not torch.isfinite(value).all():
                return f"{key!r} after step {step + 1}"
    return None


def _probes_not_finite(runs: dict, step: int = 0) -> Optional[str]:
    """Where a probe run of step ``step`` (inputs a few ulp away, or float64) gives NaN or
    inf while the reference did not: rounding alone makes the model diverge here, so no
    allowance can be measured (and none may be infinite)."""
    for probe in runs["probes"]:
        where = _not_finite(probe, step)
        if where:
            return f"{where}, in the run on inputs {_NUDGE_ULPS:g} ulp away or in float64"
    return None


def _rank_view(rank: dict, step: int) -> dict:
    """One rank's results of one step, in the shape :func:`compare` reads."""
    return {
        "outputs": {name: [calls[step]] for name, calls in rank["outputs"].items()},
        "buffers": rank["after"][step]["buffers"],
        "params": rank["after"][step]["params"],
    }


def _merge(rows, params, more_rows, more_params, step: int):
    """The worst of two steps' comparisons (rows per layer, the parameter line)."""
    if rows is None:
        rows = more_rows
    else:
        for row, more in zip(rows, more_rows):
            calls = {int(c) for c in row.calls.split("/") + more.calls.split("/")}
            row.calls = "/".join(str(c) for c in sorted(calls))
            row.output = max(row.output, more.output)
            for stat in ("running_mean", "running_var"):
                old, new = getattr(row, stat), getattr(more, stat)
                setattr(row, stat, None if old is None and new is None else max(old or 0.0, new or 0.0))
            row.ranks_agree &= more.ranks_agree
            row.limit = max(row.limit, more.limit)
    relative, key, ratio, weak = more_params
    named = (relative, f"{key} after step {step + 1}" if key else key, ratio)
    if params is None:
        return rows, named + (list(weak),)
    best = named if ratio >= params[2] else params[:3]
    return rows, best + (params[3] + [k for k in weak if k not in params[3]],)


def _param_scale(key: str, value, params: dict, bn_names: set):
    """The natural scale of a parameter: a BatchNorm bias is measured against the layer's
    weight (the output scale it shifts), anything else against its own largest value."""
    module, _, leaf = key.rpartition(".")
    scale = float(value.abs().max()) if value.numel() else 0.0
    if module in bn_names and leaf == "bias":
        weight = params.get(f"{module}.weight")
        scale = max(scale, float(weight.abs().max()) if weight is not None else 1.0)
    return scale


def compare(spec: VerifySpec, ranks: List[dict], runs: dict):
    """Per-layer rows, (worst parameter difference, its name, its ratio), and the verdict."""
    import torch

    ref, probes = runs["ref"], runs["probes"]
    tol = spec.tol
    rows = []
    for name, ref_steps in ref["outputs"].items():
        ref_calls = {len(calls) for calls in ref_steps}
        rank_calls = {len(calls) for r in ranks for calls in r["outputs"].get(name, [])}
        calls = "/".join(str(c) for c in sorted(ref_calls | rank_calls))
        output = _Quantity()
        for step, ref_out in enumerate(ref_steps):
            per_rank = [r["outputs"][name][step] for r in ranks]
            if any(len(c) != len(ref_out) for c in per_rank):
                output.mismatch = True
                continue
            for call, expected in enumerate(ref_out):
                got = torch.cat([c[call] for c in per_rank])
                others = [p["outputs"][name][step][call] if len(p["outputs"][name][step]) > call else None for p in probes]
                output.add(got, expected, others, float(expected.abs().max()))
        stats = {}
        agree = True
        key = lambda stat: f"{name}.{stat}" if name else stat  # noqa: E731
        var = ref["buffers"].get(key("running_var"))
        eps = ref["eps"][name]
        for stat in ("running_mean", "running_var"):
            expected = ref["buffers"].get(key(stat))
            if expected is None:
                stats[stat] = None
                continue
            if var is None:
                scale = float(expected.abs().max())
            elif stat == "running_mean":  # against the channel's standard deviation
                scale = (var.double() + eps).sqrt()
            else:
                scale = var.double() + eps
            q = _Quantity()
            for r in ranks:
                q.add(r["buffers"][key(stat)], expected, [p["buffers"].get(key(stat)) for p in probes], scale)
            stats[stat] = q
            agree &= all(torch.equal(r["buffers"][key(stat)], ranks[0]["buffers"][key(stat)]) for r in ranks)
        quantities = [output] + [q for q in stats.values() if q is not None]
        rows.append(
            LayerRow(
                name or "(model)",
                calls,
                output.relative(),
                None if stats["running_mean"] is None else stats["running_mean"].relative(),
                None if stats["running_var"] is None else stats["running_var"].relative(),
                agree,
                max(q.ratio(tol) for q in quantities),
            )
        )
    bn_names = set(ref["outputs"])
    worst = (0.0, "", 0.0)
    weak = []
    for key, expected in ref["params"].items():
        q = _Quantity()
        scale = _param_scale(key, expected, ref["params"], bn_names)
        for r in ranks:
            if r["params"] is not None:  # (only rank 0 reports them before the last step)
                q.add(r["params"][key], expected, [p["params"].get(key) for p in probes], scale)
        if q.weak():
            weak.append(key)
        if q.ratio(tol) >= worst[2]:
            worst = (q.relative(), key, q.ratio(tol))
    ok = all(row.limit <= 1.0 and row.ranks_agree for row in rows) and worst[2] <= 1.0
    return rows, worst + (weak,), ok


def _fmt(value: Optional[float]) -> str:
    if value is None:
        return "-"
    if value == float("inf"):
        return "mismatch"
    return f"{value:.1e}"


def format_report(
    spec: VerifySpec,
    rows,
    params,
    ok: bool,
    notes: Sequence[str] = (),
    random: Optional[str] = None,
    not_finite: Optional[str] = None,
) -> str:
    """The table, the parameter line, the notes and the verdict. ``random``: where the model
    showed it is random in training; ``not_finite``: where its one-process run gave NaN or
    inf (either one is the verdict, a FAIL that no difference can explain)."""
    width = max([len("BatchNorm layer")] + [len(r.name) for r in rows])
    lines = [
        f"syncbn verify {spec.target}: {spec.world_size} ranks x input {tuple(spec.input_shape)}, "
        f"{spec.steps} step(s), {spec.dtype}",
        "largest |syncbn on the ranks - one process on the concatenated batch|, each step from the same state, "
        "each on its natural scale (outputs: the layer's largest output; running mean: the channel's std; "
        "running var: itself)",
        f"limit: that difference over what is allowed = {_SPREAD_FACTOR:g} x how far inputs {_NUDGE_ULPS:g} ulp away "
        + ("(or float64) " if spec.dtype != "float64" else "")
        + f"move the one-process run, + {spec.tol:.1e}; PASS needs every limit <= 1",
        "",
        f"{'BatchNorm layer':<{width}}  {'calls/step':>10}  {'outputs':>9}  {'run. mean':>9}  {'run. var':>9}  {'limit':>7}  ranks agree",
    ]
    for r in rows:
        flag = "yes" if r.ranks_agree else "NO"
        mark = "" if r.limit <= 1.0 and r.ranks_agree else "   <-- over the limit" if r.ranks_agree else "   <--"
        lines.append(
            f"{r.name:<{width}}  {r.calls:>10}  {_fmt(r.output):>9}  {_fmt(r.running_mean):>9}  "
            f"{_fmt(r.running_var):>9}  {_fmt(r.limit):>7}  {flag}{mark}"
        )
    if not rows:  # (verify refuses such a model before it starts: _check_runs_here)
        lines.append("(no BatchNorm layer in this model)")
    lines.append("")
    lines.append(
        f"parameters after each step: {_fmt(params[0])}"
        + (f" (worst: {params[1]}, limit {_fmt(params[2])})" if params[1] else "")
    )
    for note in notes:
        lines.append(f"note: {note}")
    weak = params[3] if len(params) > 3 else []
    if weak and not (random or not_finite):
        lines.append(
            f"note: at this input shape, rounding alone moves {len(weak)} parameter tensor(s) "
            f"by more than 1% (e.g. {weak[0]}): the model is that ill-conditioned here (small batches per "
            "BatchNorm channel), so only larger differences can be told apart; for a sharper "
            "check use float64 or larger inputs"
        )
    lines.append("")
    if random:
        lines.append(
            "FAIL: the model is random in training: two one-process runs on the same data with different "
            f"random seeds differ ({random}), so syncbn's results cannot be compared with anything. Build the "
            "model with its randomness off (dropout, drop-path / stochastic depth / drop-connect, e.g. timm's "
            "and segmentation-models-pytorch's drop_rate=0, drop_path_rate=0) and run verify again."
        )
    elif not_finite:
        lines.append(
            f"FAIL: the one-process run itself gives NaN or inf ({not_finite}), so syncbn's results cannot be "
            "compared with anything: the model diverges or computes NaN at this input, learning rate and "
            "dtype. Make it train in one process first (a smaller --lr, another --dtype or input shape)."
        )
    elif not rows:
        lines.append("FAIL: no BatchNorm layer was compared, so nothing was verified")
    else:
        lines.append(
            "PASS: syncbn reproduces one process on the concatenated batch"
            if ok
            else "FAIL: differences above the limit (see the marked rows)"
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
    if any(v > 2**63 - 1 for v in shape):  # what torch takes as a size
        raise argparse.ArgumentTypeError(f"expected sizes up to 2**63 - 1, got {text!r}")
    return shape


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n")[0].replace("``", "")
    parser.add_argument("target", metavar="MODULE:FACTORY", help="callable returning the nn.Module to check (MODULE may be a .py path)")
    parser.add_argument("--input-shape", type=_shape, required=True, metavar="N,C,H,W", help="one rank's input shape")
    parser.add_argument("--world-size", type=int, default=2, metavar="W", help="local processes (default 2)")
    parser.add_argument("--steps", type=int, default=3, metavar="K", help="training steps (default 3)")
    parser.add_argument("--dtype", choices=_DTYPES, default="float64", help="model and data dtype (default float64)")
    parser.add_argument("--tolerance", type=float, default=None, help="difference on the natural scale that passes whatever the conditioning (default 100 ulp: 2.2e-14 in float64, 1.2e-5 in float32)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate, a positive finite number (default 0.05)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the initial weights (torch.manual_seed before the factory runs), the data and the loss weights: 0 to 2**32 - 1 (default 0)")
    parser.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS", help="process-group timeout: the longest any collective may wait (default 60); ranks left waiting on a rank that raised are stopped sooner")


def verify(spec: VerifySpec, out=None, pool=None) -> int:
    """Run the check and print the report to ``out``; returns the exit status.

    ``pool``: an existing :class:`syncbn.tools.launch.WorkerPool` of ``spec.world_size`` ranks
    to run on (its own process-group timeout then applies); by default one is started
    with ``spec.timeout`` and stopped afterwards.

    Raises ``syncbn.tools.usage.UsageError`` (what ``syncbn verify`` reports with exit
    status 2) before any rank starts for an option no run can honour, a factory or input
    shape that fails in this process, and a model with no BatchNorm layer (nothing to verify).
    """
    out = out or sys.stdout
    from .launch import WorkerError, WorkerPool

    _check_spec(spec)
    _check_runs_here(spec)  # fail early, here, on a bad factory or input shape
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
        if any(isinstance(e, (LayerOrderError, UsageError)) for e, _ in exc.errors.values()):
            error = next(e for e, _ in exc.errors.values() if isinstance(e, (LayerOrderError, UsageError)))
            print(f"FAIL: {error}", file=out)
            return 2 if isinstance(error, UsageError) else 1
        print(failure_report(exc.errors, exc.stuck), file=out)
        return 1
    except TimeoutError as exc:
        print(f"FAIL: {exc} (a collective or a step did not finish within the timeouts)", file=out)
        return 1
    rows = params = random = not_finite = None
    ok = True
    for step in range(spec.steps):  # each step from the same state: rank 0's after the step before
        runs = _references(spec, _start_state(ranks[0]["initial"], ranks[0], step), step)
        random = random or _random_in_training(runs, step)
        not_finite = not_finite or _not_finite(runs["ref"], step) or _probes_not_finite(runs, step)
        step_rows, step_params, step_ok = compare(spec, [_rank_view(r, step) for r in ranks], runs)
        rows, params = _merge(rows, params, step_rows, step_params, step)
        ok &= step_ok
        del runs
    ok = ok and bool(rows) and not (random or not_finite)
    print(format_report(spec, rows, params, ok, ranks[0]["notes"], random, not_finite), file=out)
    out.flush()
    return 0 if ok else 1


def run(args: argparse.Namespace) -> int:
    """The ``syncbn verify`` subcommand (see :mod:`syncbn.cli`)."""
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
    if torch_missing("verify"):  # the check trains torch models: say so before anything else
        return 2
    try:
        return verify(spec)
    except UsageError as exc:
        print(f"syncbn verify: {exc}", file=sys.stderr)
        return 2


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="syncbn verify")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":  # python -m syncbn.tools.verify (spawned workers import this too)
    from syncbn.tools.verify import main as _main  # the importable module, so errors unpickle to its classes

    sys.exit(_main())
