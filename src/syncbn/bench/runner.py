"""Running the whole bench: every peer process in turn, then the report.

Peers run one after the other, never side by side, so none takes cores from another.
A peer that is not installed is skipped with a note; one that fails or times out is
reported with the tail of its output, and the rest of the bench still runs. Interrupted
(Ctrl-C, or SIGTERM, which ends the bench with exit status 143), the bench ends the
running peer and everything it started before it exits (:func:`~.peers.run_peer`).
"""

from __future__ import annotations

import platform
import time
from pathlib import Path
from typing import Callable, Optional

from . import plan as plans
from .peers import cpu_count, load_average, peer_failed, run_peer, sigterm_exits

__all__ = ["run_bench"]

# seconds allowed per peer process: (quick, full)
TIMEOUTS = {"torch": (150, 900), "keras": (120, 420), "keras_multiworker": (150, 420), "flax": (90, 300)}


def _runs(plan: dict):
    """(family, key, world, module, args) of every peer process to start, in order."""
    selected = plan["peers"]
    if any(plans.PEERS[k].family == "torch" for k in selected):
        yield "torch", "torch", None, "syncbn.bench.torch_peer", []
    for key in ("keras_bn", "keras_sync", "syncbn_keras"):
        if key in selected:
            # Keras's unsynchronized layer is the one-replica reference only
            for w in [w for w in plan["worlds"]["keras"] if key != "keras_bn" or w == 1]:
                yield "keras", key, w, "syncbn.bench.keras_peer", ["--impl", key, "--world", w]
    if "keras_multiworker" in selected:  # one launcher, two worker processes, both layers
        timeout = TIMEOUTS["keras_multiworker"][0 if plan["quick"] else 1]
        yield ("keras_multiworker", "keras_multiworker", 2, "syncbn.bench.keras_multiworker",
               ["--timeout", timeout - 10])
    if any(plans.PEERS[k].family == "flax" for k in selected):  # one process times them all
        for w in plan["worlds"]["flax"]:
            yield "flax", "flax", w, "syncbn.bench.flax_peer", ["--world", w]


def run_bench(plan: dict, out: Path, say: Callable[[str], None] = print, command: Optional[str] = None) -> dict:
    with sigterm_exits():  # so that SIGTERM, like Ctrl-C, ends the running peer's processes
        return _run_bench(plan, out, say, command)


def _run_bench(plan: dict, out: Path, say: Callable[[str], None], command: Optional[str]) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    raw = {"peers": {}, "runs": [], "skipped": []}
    meta = {"command": command, "quick": plan["quick"], "cores": cpu_count(), "threads_per_replica": plan["threads"],
            "python": platform.python_version(), "machine": platform.machine(), "system": platform.system(),
            "processor": platform.processor() or None,
            "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)), "load_before": load_average()}
    skipped_keys = set()
    for key in plan["peers"]:
        missing = plans.installed(plans.PEERS[key])
        if missing:
            skipped_keys.add(key)
            raw["skipped"].append({"peer": key, "label": plans.PEERS[key].label, "reason": f"{missing} is not installed"})
            say(f"skip {plans.PEERS[key].label}: {missing} is not installed")
    run_plan = dict(plan, peers=[k for k in plan["peers"] if k not in skipped_keys])
    for family, key, world, module, args in _runs(run_plan):
        timeout = TIMEOUTS[family][0 if plan["quick"] else 1]
        name = key if world is None else f"{key}-W{world}"
        say(f"run {name} (timeout {timeout} s, load {load_average()})")
        outcome = run_peer(module, run_plan, timeout, args, log_path=out / "logs" / f"{name}.log")
        result = outcome.pop("result")
        outcome.update(peer=key, world=world, load_after=load_average())
        raw["runs"].append(outcome)
        if result is not None:
            raw["peers"].setdefault(key, {})[str(world)] = result
        if peer_failed(outcome):
            say(f"  {name}: {'timed out' if outcome['timed_out'] else 'exit ' + str(outcome['returncode'])}; "
                f"see {out / 'logs' / (name + '.log')}")
        else:
            say(f"  {name}: done in {outcome['seconds']:.1f} s")
    meta["load_after"] = load_average()
    meta["seconds"] = round(time.time() - started, 1)

    from . import report

    rep = report.build(run_plan, raw, meta)
    report.write(rep, out)
    return rep
