"""Disagreement detection: every rank must be in the same synchronized layer call.

Each training call of a synchronized layer is one all-reduce forward and one backward,
and ranks pair them up by order alone. A rank that calls the layers in another order
(a data-dependent branch, ``if rank == 0:`` code, a model built differently) would
otherwise mix the statistics of different layers without any error. So every packed
payload carries, before its 2C+1 (forward) or 2C+1 (backward) values, a fingerprint of the
call: ``DIGITS`` small integers and their squares, ``SIZE = 2 * DIGITS`` values in the
payload's own dtype. No extra collective, a constant number of extra values. Every code
path (CPU, CUDA, portable, compiled, the Triton kernels) of both layers sends the same
payload, fingerprint first, then ``[n, n m, n (var + m^2)]`` forward and ``[sum dy, sum dy
(x - mean), overflow]`` backward (``overflow``: the kept-channel overflow of
:class:`syncbn.SyncBatchNormAct` on the kernels, 0 elsewhere; every synchronized backward
reads its sum, :func:`defer_overflow`), so ranks on different paths,
and a layer fused on some ranks only, still sum like with like. (A compiled call's index is 0, see below:
beside an eager rank, a compiled rank agrees on the step's first layer only, and every
rank raises at the second.)

What is fingerprinted (a :class:`Tag`, two integers):

- the layer's identity: a 24-bit CRC-32 of its name and ``num_features``. The name is
  ``model/path`` as :func:`name_layers` records it (``convert_sync_batchnorm`` and
  ``fuse_batchnorm_act`` call it; call ``syncbn.name_layers(model)`` for a model built
  with syncbn's layers directly): the qualified module name of the layer in the root it
  was called on, after the root's class (or the ``model`` given to it), so that two
  models converted separately (a GAN's ``Generator/1`` and ``Discriminator/1``, a
  teacher and a student, ``teacher.Model/1`` and ``student.Model/1``) differ even where
  their layers' paths and widths are the same; else the layer's class name, or the
  ``name`` given to the functional form. The root's class is its ``__qualname__`` after
  its module, without the module for a class of the script (``__main__.X`` in one
  process, ``__mp_main__.X`` in the processes ``multiprocessing`` spawns) or of torch
  (``Sequential``). (Not a count of layers or models constructed, nor an id: a rank that
  builds an extra model, for evaluation say, would then disagree with the others about
  every name.) Two roots of one class (two ``nn.Sequential``) are told apart by
  ``name_layers(root, model=...)``, else like unnamed layers of one class and width, by
  the call index alone;
- whether the call records an autograd graph (grad mode on, and the input or an affine
  parameter requires grad): a rank whose call records none makes no backward collective
  for it, so a training-mode forward under ``torch.no_grad`` on one rank alone (beside
  another rank's recorded one) is named at once instead of leaving the next collectives
  paired wrongly;
- the index of the call within the step on its process group (11 bits): the forward
  calls are counted from 0, and the first forward after a backward pass of a layer on
  that group starts a new step. A backward carries the tag of its own forward. Under
  ``torch.compile`` (a graph traced once) the index is not counted and is 0.

The check. Each of the 9 digits ``d`` (4 bits of the tag) travels as ``d`` and ``d^2``;
after the sum over the W ranks, a rank that sent ``e`` finds ``sum d = W e`` and ``sum
d^2 = W e^2`` for every digit exactly when every rank sent ``e``: together they say
``sum (d - e)^2 = 0``, and where the ranks differ that sum is positive whichever rank
computes it. All values are integers below ``W * 225``, so the sums are exact in float32
(the backward payload's dtype for float32 and half inputs) up to ``MAX_WORLD`` ranks.
Every rank sees the same sums, so every rank reaches the same verdict and raises the
same :class:`LayerMismatchError`. With W = 2 a rank also recovers the other rank's
digits (the sum minus its own) and names the other rank's layer when it knows that
name (a layer of its own model, or one it has called); with W > 2 it names its own.

When the check runs. On the CPU at once, before the running buffers move (a host read
of a CPU tensor costs no synchronization). Elsewhere (CUDA) without a host
synchronization per layer: the verdict stays on the device (two operations, a comparison
with the kept agreeing sums), the running buffers are updated only where it is good
(``torch.where``: bit for bit kept otherwise), and :func:`check_agreement` reads all
pending verdicts at once: at the end of every backward pass that ran a synchronized
layer (before the optimizer can use the gradients), at the first forward of the next
step, or when the user calls it. Under ``torch.compile`` the verdict is an assert
inside the graph (raised where the compiled kernel runs), with the same gated update.

Size disagreements (a skipped layer, another channel count) make the payloads differ
in length: the backend fails or, with ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, torch names
the mismatch on every rank before any value is exchanged. See the README's
troubleshooting section.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
from torch import Tensor

from . import distributed, stats

__all__ = [
    "SIZE",
    "DIGITS",
    "MAX_WORLD",
    "LayerMismatchError",
    "Tag",
    "set_layer_name",
    "layer_name",
    "forward_tag",
    "records_graph",
    "end_step",
    "STEP_CHECK",
    "all_reduce_checked",
    "check_world",
    "check_now",
    "fixed_values",
    "payload_values",
    "pending_verdict",
    "agreeing_values",
    "defer",
    "defer_overflow",
    "check_after_backward",
    "check_agreement",
    "reset",
]

from ..core.fingerprint import (  # the digit arithmetic, shared with the Keras layer
    DIGIT_BITS,
    DIGITS,
    IDENT_BITS,
    INDEX_BITS,
    MAX_WORLD,
    SIZE,
    LayerMismatchError,
    Tag,
)
from ..core.fingerprint import _names  # noqa: F401 - names this process can decode
from ..core.fingerprint import describe as _describe
from ..core.fingerprint import digits as _digits
from ..core.fingerprint import ident as _ident
from ..core.fingerprint import mismatch_message as _mismatch_message
from ..core.fingerprint import remember as _remember
from ..core.fingerprint import undigits as _undigits
from ..core.fingerprint import values as _values

# devices whose verdict is read on the host at once (no asynchronous queue to stall)
IMMEDIATE_DEVICES = {"cpu"}
# the profiler range around the once-per-step read of the pending verdicts
STEP_CHECK = "syncbn.check_agreement"


# ---- names ---------------------------------------------------------------------------

def layer_name(layer) -> str:
    """``layer``'s name in the fingerprint: ``model/path``, the model and qualified name
    :func:`syncbn.name_layers` recorded (``Generator/1``, ``teacher.Model/1``), else its
    class name."""
    name = getattr(layer, "_syncbn_name", None)
    if name is None:
        return type(layer).__name__
    model = getattr(layer, "_syncbn_model", None)
    return name if model is None else f"{model}/{name}"


def set_layer_name(layer, name: str, model: Optional[str] = None) -> None:
    """Make ``name`` ``layer``'s name in the fingerprint, in the model ``model`` (None:
    none), what :func:`syncbn.name_layers` records for each synchronized layer of a model:
    its qualified name in the model, and the model's class."""
    object.__setattr__(layer, "_syncbn_name", name)
    object.__setattr__(layer, "_syncbn_model", model)
    object.__setattr__(layer, "_syncbn_ident", None)
    _remember(layer_name(layer), layer.num_features)


def _layer_ident(layer) -> int:
    cached = getattr(layer, "_syncbn_ident", None)
    if cached is None or cached[0] != layer.num_features:
        cached = (layer.num_features, _remember(layer_name(layer), layer.num_features))
        object.__setattr__(layer, "_syncbn_ident", cached)
    return cached[1]


# ---- the call index ------------------------------------------------------------------

_calls = {}  # id(group) -> forward calls counted in this step
_ended = set()  # id(group) whose backward ran since their last forward


def _group_key(group) -> int:
    return 0 if group is None else id(group)


def forward_tag(layer, num_features: int, group, name: Optional[str] = None, graph: bool = False) -> Tag:
    """The tag of a training forward call of ``layer`` (a module, or None with ``name``
    for the functional form) on ``group``; counts the call. ``graph``: the call records
    an autograd graph (see :func:`records_graph`), so its backward will communicate."""
    if distributed.compiling():
        # torch.compile(dynamic=True) gives the channel count as a symbolic int, which a
        # constant-result function cannot take: operator.index makes it a plain int (the
        # compiled code is then specialized to this channel count, guarded as for any shape)
        num_features = operator.index(num_features)
    if layer is not None:
        ident = _layer_ident(layer) if not distributed.compiling() else _traced_ident(layer_name(layer), num_features)
    elif distributed.compiling():
        ident = _traced_ident(name or "sync_batch_norm", num_features)
    else:
        ident = _remember(name or "sync_batch_norm", num_features)
    if distributed.compiling():
        return Tag(ident, 0, graph)
    key = _group_key(group)
    if key in _ended:
        _ended.discard(key)
        _calls[key] = 0
        if _pending:
            check_agreement()
    index = _calls.get(key, 0)
    _calls[key] = index + 1
    return Tag(ident, index & ((1 << INDEX_BITS) - 1), graph)


def records_graph(*tensors) -> bool:
    """Whether a call on ``tensors`` (the input and the affine parameters; None skipped)
    records an autograd graph: grad mode on and one of them requires grad. A rank whose
    call records none makes no backward collective for it, so the ranks must agree."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _assume_constant(fn):
    compiler = getattr(torch, "compiler", None)
    wrap = getattr(compiler, "assume_constant_result", None)
    return wrap(fn) if wrap is not None else fn


@_assume_constant
def _traced_ident(name: str, num_features: int) -> int:
    return _ident(name, num_features)


def end_step(group) -> None:
    """A backward pass ran a layer on ``group``: its next forward starts a new step.
    Verdicts still pending (the forward verdicts of the CUDA path) are read when this
    backward pass ends."""
    if not distributed.compiling():
        _ended.add(_group_key(group))
        if _pending:
            _check_after_backward()


def reset() -> None:
    """Forget the call counts and pending verdicts (after a failed step that every rank
    abandons, so that all ranks count from 0 again)."""
    _calls.clear()
    _ended.clear()
    _pending.clear()


# ---- the payload ---------------------------------------------------------------------

def fixed_values(tag: Tag, dtype, device) -> Tensor:
    """The ``SIZE`` payload values of ``tag`` as a tensor (kept per tag, dtype, device),
    for a payload that the caller builds (first, as :func:`all_reduce_checked` puts
    them); :func:`pending_verdict` checks their sums."""
    return stats.constant(_values, (tag,), dtype, device)


def payload_values(tag: Tag) -> tuple:
    """The ``SIZE`` payload values of ``tag`` as integers (for a payload built elsewhere)."""
    return tuple(_values(tag))


def _agreeing_sums(tag: Tag, world: int) -> list:
    return [world * v for v in _values(tag)]


def all_reduce_checked(packed: Tensor, group, tag: Tag, world: int, backward: bool = False):
    """Sum ``packed`` plus the fingerprint of ``tag`` over ``group`` (one all-reduce) and
    check that every rank sent the same tag.

    Returns ``(summed, ok)``: ``summed`` the sum of ``packed`` (fingerprint removed);
    ``ok`` None when the verdict was read at once (a disagreement raised
    :class:`LayerMismatchError` on every rank), else a 0-d bool tensor on the device that
    gates the running buffers (:func:`syncbn.torch.stats.update_running_stats`).
    """
    check_world(world)
    # the fingerprint first, as every path puts it (a compiled rank and an eager one sum alike)
    payload = torch.cat([fixed_values(tag, packed.dtype, packed.device), packed])
    payload = distributed.all_reduce_sum(payload, group)
    sums, summed = payload[:SIZE], payload[SIZE:]
    if distributed.compiling():
        ok = _agree(sums, tag, world)
        torch._assert_async(ok, _compiled_message(tag, backward))
        return summed, ok
    if packed.device.type in IMMEDIATE_DEVICES and not stats.cuda_path(packed):
        # 18 numbers read at once (the CUDA path, forced on the CPU by the bench's
        # counts, keeps its verdict on the device as on CUDA)
        check_now(sums, group, tag, world, backward)
        return summed, None
    return summed, pending_verdict(sums, group, tag, world, backward)


def check_now(sums: Tensor, group, tag: Tag, world: int, backward: bool = False) -> None:
    """Read the ``SIZE`` summed fingerprint values of a CPU payload at once and raise
    :class:`LayerMismatchError` (on every rank alike) unless every rank sent ``tag``."""
    if [int(v) for v in sums.tolist()] != _agreeing_sums(tag, world):
        _raise(tag, sums, world, distributed.group_rank(group), backward, group)


def check_world(world: int) -> None:
    if world > MAX_WORLD:
        raise ValueError(f"syncbn's layer fingerprint is exact up to {MAX_WORLD} ranks, got {world}")


def pending_verdict(sums: Tensor, group, tag: Tag, world: int, backward: bool = False,
                    ok: Optional[Tensor] = None) -> Tensor:
    """The verdict on the ``SIZE`` summed fingerprint values, left on the device (two
    operations, no host read) and read by :func:`check_agreement` with the others of the
    step; a 0-d bool tensor, true where every rank sent ``tag``. ``ok``: the verdict
    computed already, by a kernel that compared the sums with :func:`agreeing_values`."""
    if ok is None:
        ok = _agree(sums, tag, world)
    _queue((ok, sums, tag, world, (distributed.group_rank(group), group), backward), backward)
    return ok


def agreeing_values(tag: Tag, world: int, dtype, device) -> Tensor:
    """The summed fingerprint values that mean agreement (``world`` times this rank's), kept
    on the device: what a kernel compares the summed payload's first ``SIZE`` values with."""
    return stats.constant(_agreeing_sums, (tag, world), dtype, device)


def defer(ok: Tensor, error, backward: bool = False) -> None:
    """Raise ``error`` (an exception, or a callable that makes it, called only to raise) at
    the next :func:`check_agreement` unless ``ok`` (a 0-d bool tensor
    on the device) holds: a device-side check of a layer call that costs no host read of
    its own (read with the step's verdicts; call :func:`check_after_backward` from the
    layer's backward so that it is read when that backward pass ends). ``backward``: made
    in a backward pass, read when it ends, as :func:`pending_verdict`'s backward verdicts
    (no bound on what waits there: a host read in the middle of the pass, at the 1025th
    waiting check, would be a second per step)."""
    _queue((ok, None, error, None, None, None), backward)


def _queue(entry: tuple, backward: bool) -> None:
    """Add ``entry`` to what :func:`check_agreement` reads next: made in a backward pass,
    it is read when that pass ends (whatever waits, one read per pass); in forward, what
    waits is bounded (forward-only loops), read at the 1025th entry."""
    _pending.append(entry)
    if backward:
        _check_after_backward()
    elif len(_pending) > 1024:
        check_agreement()


def defer_overflow(overflow: Tensor, error, fit: Optional[Tensor] = None) -> None:
    """The kept-channel check of a synchronized backward call, the same on every rank.

    ``overflow`` is the summed backward payload's last value (0-d): how many ranks'
    :class:`syncbn.SyncBatchNormAct` ran out of kept channels in this call (a layer fused
    on some ranks only, or fused ranks on different paths, share the payload). Every
    synchronized backward, of either layer and on every path, reads it, so that every rank
    raises ``error`` (a :class:`~syncbn.torch.batchnorm_act.KeptChannelsOverflow`, or a
    callable making it, called only to raise) at the same point: when the backward pass
    ends (:func:`check_agreement`), after the verdicts this call put before it. ``fit``:
    the verdict ``overflow == 0`` computed already (by the input-gradient kernel). No host
    read on the device (one comparison where ``fit`` is None); on the CPU the value is
    read at once (free there) and only an overflow is queued. Under ``torch.compile`` an
    assert inside the graph, as the fingerprint's."""
    if distributed.compiling():
        ok = torch.eq(overflow, 0) if fit is None else fit
        torch._assert_async(ok, str(error() if callable(error) else error))
        return
    if fit is None and overflow.device.type in IMMEDIATE_DEVICES and not stats.cuda_path(overflow):
        if not overflow.item():  # a host read that costs nothing on the CPU
            return
        fit = torch.zeros((), dtype=torch.bool)
    defer(torch.eq(overflow, 0) if fit is None else fit, error, backward=True)


def check_after_backward() -> None:
    """Have the pending checks read when the running backward pass ends (what a
    synchronized layer's backward does through :func:`end_step`), for a layer that
    communicates nothing but has a check deferred with :func:`defer`."""
    if _pending and not distributed.compiling():
        _check_after_backward()


def _agree(sums: Tensor, tag: Tag, world: int) -> Tensor:
    """Whether the summed fingerprint is ``world`` times this rank's: per digit, ``sum d =
    W d_own`` and ``sum d^2 = W d_own^2``. Together they give ``sum (d - d_own)^2 = sum d^2
    - 2 d_own sum d + W d_own^2 = 0``, so every rank sent ``d_own``; where the ranks
    differ, that sum is positive on every rank, so every rank finds the disagreement. All
    values are integers, exact in the payload's dtype (see ``MAX_WORLD``)."""
    return torch.eq(sums, stats.constant(_agreeing_sums, (tag, world), sums.dtype, sums.device)).all()


# ---- verdicts that wait on the device ------------------------------------------------

_pending = []  # (ok, sums, tag, world, (rank, group), backward) not yet read on the host
_queued_for = [None]  # the backward pass (graph task) whose end will check them


def _check_after_backward() -> None:
    """Have the autograd engine run :func:`check_agreement` when this backward pass ends
    (before ``loss.backward()`` returns, so before any optimizer step), once per pass."""
    task = torch._C._current_graph_task_id()
    if task == -1 or _queued_for[0] == task:
        return
    _queued_for[0] = task
    torch.autograd.Variable._execution_engine.queue_callback(check_agreement)


def check_agreement() -> None:
    """Read every verdict still on the device (one host synchronization) and raise
    :class:`LayerMismatchError` for the first disagreement. Runs by itself at the end of a
    backward pass and at the first forward of a step; call it after forward-only work.
    (Marked ``syncbn.check_agreement`` in profiler traces: a cost per step, not per layer.)"""
    if not _pending:
        return
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return  # no host read while a CUDA graph is captured: the verdicts wait for the next check
    pending = list(_pending)
    _pending.clear()
    with torch.autograd.profiler.record_function(STEP_CHECK):
        if all(bool(torch.stack(same).all()) for same in _by_device([p[0] for p in pending])):
            return  # one synchronization per device (a CPU verdict's read is free)
    for ok, sums, tag, world, rank, backward in pending:
        if not bool(ok):
            if sums is None:  # a deferred check (defer): its own error
                _pending.clear()
                raise tag() if callable(tag) else tag
            _raise(tag, sums, world, rank[0], backward, rank[1])


def _by_device(verdicts: list) -> list:
    """``verdicts`` in one list per device, in the order of their first: a CPU check (an
    overflow of a CPU layer, or one of :func:`defer`) may wait beside a GPU's verdicts,
    and one ``torch.stack`` of both would raise torch's device error instead of theirs."""
    groups = {}
    for verdict in verdicts:
        groups.setdefault(verdict.device, []).append(verdict)
    return list(groups.values())


# ---- the message ---------------------------------------------------------------------


def _raise(tag: Tag, sums: Tensor, world: int, rank: int, backward: bool, group=None):
    """Raise the disagreement, naming a subgroup's ranks by their global ranks."""
    _pending.clear()
    raise LayerMismatchError(_mismatch_message(tag, sums[:DIGITS].tolist() + sums[DIGITS:].tolist(),
                                               world, rank, backward, numbers=distributed.global_ranks(group)))


def _compiled_message(tag: Tag, backward: bool) -> str:
    phase = "backward" if backward else "forward"
    name = _tag_name(tag)
    return (
        f"syncbn: the ranks of the process group are in different synchronized layer calls "
        f"({phase}); this rank called layer {name!r}"
    )


def _tag_name(tag: Tag) -> str:
    """The layer name of ``tag`` where this process knows it, else its id."""
    known = _names.get(tag.ident)
    return known[0] if known else f"id {tag.ident:06x}"
