"""The report: the peers' raw results turned into tables, ratios and bars, written as
JSON (everything), Markdown (the tables and the plots) and a terminal summary.

Timing ratios are always taken against a ``torch.nn.BatchNorm2d`` measured on the same
per-replica batch: in the same processes, interleaved, for the torch rows (so a change
of load touches both), and in the torch peer's single process for the Keras and Flax
rows (their processes hold no torch). The bars are printed, never asserted.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Dict, List, Optional

from . import communication
from .floor import PASSES, floor_seconds
from .keras_multiworker import LABEL as MULTIWORKER_LABEL
from .peers import peer_failed
from .plan import ORDER, PEERS, PROBES
from .timing import summarize

__all__ = ["build", "write", "terminal", "markdown"]

SCHEMA = 1




def _label(key: str) -> str:
    return PEERS[key].label if key in PEERS else PROBES.get(key, key)


def _order(key_world):
    key, world = key_world
    return (ORDER.index(key) if key in ORDER else len(ORDER), -1 if world is None else world)


def _geomean(values):
    values = [v for v in values if v and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _worst(values, worst=max):
    """``max`` (or ``min``) of the figures ``values``, NaN when any of them is NaN: the
    built-ins keep or drop a NaN by its place in the list, so a NaN figure could pass a bar."""
    values = list(values)
    return math.nan if any(math.isnan(v) for v in values) else worst(values)


# --------------------------------------------------------------------------- timing


def _timing(plan: dict, raw: dict) -> dict:
    points = plan["points"]
    torch_result = raw["peers"].get("torch", {}).get("None") or {}
    rows: List[dict] = []
    refusals: List[dict] = []
    bn_local = {}
    bandwidth = (torch_result.get("floor") or {}).get("bytes_per_s")

    def add(key, world, i, seconds, reference, note=None):
        point = points[i]
        s = summarize(seconds)
        numel = point["N"] * point["C"] * point["H"] * point["W"]
        row = {"impl": key, "label": _label(key), "world": world, "point": i, **point,
               "global_batch": point["N"] * (world or 1), "median_ms": s["median_s"] * 1e3,
               "q1_ms": s["q1_s"] * 1e3, "q3_ms": s["q3_s"] * 1e3, "repeats": s["repeats"], "reference": reference}
        if bandwidth:
            row["floor_ms"] = floor_seconds(numel, bandwidth) * 1e3
        if note:
            row["note"] = note
        rows.append(row)
        return row

    local = torch_result.get("local")
    if local:
        for i, times in enumerate(local["times"]):
            bn = summarize(times["torch_bn"])["median_s"] * 1e3
            bn_local[i] = bn
            for key, seconds in times.items():
                note = "not distributed: runs as torch.nn.BatchNorm2d" if key == "torch_syncbn" else None
                add(key, None, i, seconds, "torch.nn.BatchNorm2d, same process, interleaved", note)["ratio_to_bn"] = (
                    summarize(seconds)["median_s"] * 1e3 / bn)
        for key, text in local.get("refusals", {}).items():
            refusals.append({"impl": key, "world": None, "refusal": text})
    for entry in torch_result.get("pool") or []:
        w = entry["world"]
        for i, times in enumerate(entry["times"]):
            bn = summarize(times["torch_bn"])["median_s"] * 1e3
            for key, seconds in times.items():
                row = add(key, w, i, seconds, f"torch.nn.BatchNorm2d on the same per-rank batch, in the same {w} "
                          "process(es), interleaved")
                row["ratio_to_bn"] = row["median_ms"] / bn
        for key, text in entry.get("refusals", {}).items():
            refusals.append({"impl": key, "world": w, "refusal": text})
    for peer in ("keras_bn", "keras_sync", "syncbn_keras", "flax"):
        for world_text, result in sorted(raw["peers"].get(peer, {}).items(), key=lambda kv: int(kv[0])):
            w = int(world_text)
            # the flax process times several implementations side by side
            by_impl = result.get("times_by_impl") or {peer: result.get("times") or []}
            for key, times in by_impl.items():
                for i, seconds in enumerate(times):
                    row = add(key, w, i, seconds, "torch.nn.BatchNorm2d on one replica's batch, torch peer process")
                    if i in bn_local:
                        row["ratio_to_bn"] = row["median_ms"] / bn_local[i]

    # each implementation against syncbn at the same W and global batch
    syncbn_at = {(r["world"], r["point"]): r["median_ms"] for r in rows if r["impl"] == "syncbn"}
    for row in rows:
        if row["impl"] not in ("syncbn", "torch_bn", "syncbn_act", "syncbn_leaky") and \
                (row["world"], row["point"]) in syncbn_at:
            row["ratio_to_syncbn"] = row["median_ms"] / syncbn_at[(row["world"], row["point"])]

    # syncbn.keras against Keras's own layers at the same W: unsynchronized at one
    # replica, synchronized=True at more
    for reference in ("keras_bn", "keras_sync"):
        at = {(r["world"], r["point"]): r["median_ms"] for r in rows if r["impl"] == reference}
        for row in rows:
            if row["impl"] == "syncbn_keras" and (row["world"], row["point"]) in at:
                row[f"ratio_to_{reference}"] = row["median_ms"] / at[(row["world"], row["point"])]

    unfused_at = {(r["world"], r["point"]): r["median_ms"] for r in rows if r["impl"] == "syncbn_leaky"}
    for row in rows:
        if row["impl"] == "syncbn_act" and (row["world"], row["point"]) in unfused_at:
            row["ratio_to_unfused"] = row["median_ms"] / unfused_at[(row["world"], row["point"])]

    summary = []
    for key, w in sorted({(r["impl"], r["world"]) for r in rows}, key=_order):
        mine = [r for r in rows if r["impl"] == key and r["world"] == w]
        ratios = [r.get("ratio_to_bn") for r in mine if r.get("ratio_to_bn") is not None]
        vs_syncbn = [r["ratio_to_syncbn"] for r in mine if "ratio_to_syncbn" in r]
        summary.append({
            "impl": key, "label": _label(key), "world": w, "points": len(mine),
            "geomean_ms": _geomean([r["median_ms"] for r in mine]),
            "median_ratio_to_bn": _median(ratios), "min_ratio_to_bn": min(ratios) if ratios else None,
            "max_ratio_to_bn": max(ratios) if ratios else None,
            "median_ratio_to_syncbn": _median(vs_syncbn),
            "median_ratio_to_unfused": _median([r["ratio_to_unfused"] for r in mine if "ratio_to_unfused" in r]),
            "median_ratio_to_floor": _median([r["median_ms"] / r["floor_ms"] for r in mine if r.get("floor_ms")]),
        })
    return {"rows": rows, "summary": summary, "refusals": refusals}


def _multiworker(plan: dict, raw: dict, timing: dict) -> Optional[dict]:
    """Keras at syncbn's topology: 2 worker processes under MultiWorkerMirroredStrategy
    (both Keras layers interleaved in the same workers) beside syncbn's torch layer at 2
    gloo processes (the torch peer's figure for the same grid point, another run). The
    bar on syncbn torch / Keras is in :func:`_bars`; syncbn.keras / Keras is a figure."""
    result = (raw["peers"].get("keras_multiworker") or {}).get("2")
    if not result or not result.get("points"):
        return None
    torch_w2 = {r["point"]: r["median_ms"] for r in timing["rows"] if r["impl"] == "syncbn" and r["world"] == 2}
    rows = []
    for j, i in enumerate(result["points"]):
        keras = summarize(result["times"]["keras_sync"][j])
        ours = summarize(result["times"]["syncbn_keras"][j])
        row = {"point": i, **plan["points"][i], "repeats": keras["repeats"],
               "keras_sync_ms": keras["median_s"] * 1e3, "syncbn_keras_ms": ours["median_s"] * 1e3,
               "syncbn_torch_ms": torch_w2.get(i)}
        row["ratio_syncbn_keras_to_keras_sync"] = row["syncbn_keras_ms"] / row["keras_sync_ms"]
        row["ratio_syncbn_torch_to_keras_sync"] = (None if row["syncbn_torch_ms"] is None
                                                   else row["syncbn_torch_ms"] / row["keras_sync_ms"])
        rows.append(row)
    return {
        "label": MULTIWORKER_LABEL, "world": 2, "communication": result.get("communication"), "rows": rows,
        "median_ratio_syncbn_keras_to_keras_sync": _median([r["ratio_syncbn_keras_to_keras_sync"] for r in rows]),
        "median_ratio_syncbn_torch_to_keras_sync": _median([r["ratio_syncbn_torch_to_keras_sync"] for r in rows]),
        "note": "Keras BatchNormalization(synchronized=True) and syncbn.keras.SyncBatchNormalization timed "
                "interleaved in the same 2 worker processes (one CPU replica each, TF_CONFIG on 127.0.0.1, ring "
                "all-reduce); syncbn.SyncBatchNorm (torch) at 2 gloo processes comes from the torch peer, same "
                "per-rank batch, another run. Medians in ms per forward + backward of one layer; the bar is on syncbn "
                "torch / Keras (< 1 at every point), syncbn.keras / Keras has none.",
    }


def _multiworker_rows(mw: dict) -> List[List[str]]:
    return [[str(r["N"]), str(r["C"]), f"{r['H']}x{r['W']}", r["layout"], _fmt(r["keras_sync_ms"], ".3f"),
             _fmt(r["syncbn_keras_ms"], ".3f"), _fmt(r["syncbn_torch_ms"], ".3f"),
             _fmt(r["ratio_syncbn_keras_to_keras_sync"]), _fmt(r["ratio_syncbn_torch_to_keras_sync"])]
            for r in mw["rows"]]


MULTIWORKER_HEADER = ["N", "C", "HxW", "layout", "Keras synchronized ms", "syncbn.keras ms", "syncbn torch W=2 ms",
                      "syncbn.keras / Keras", "syncbn torch / Keras"]


def _multiworker_lines(report: dict, md: bool) -> List[str]:
    mw = report.get("keras_multiworker")
    if not mw:
        return []
    ratio = lambda v: "not measured" if v is None else f"{v:.2f}x"  # noqa: E731
    lines = [f"Keras at equal topology: {mw['label']} (median ratios: syncbn.keras / Keras synchronized "
             f"{ratio(mw['median_ratio_syncbn_keras_to_keras_sync'])}, syncbn torch W=2 / Keras synchronized "
             f"{ratio(mw['median_ratio_syncbn_torch_to_keras_sync'])}; the bar is on the second, at every point)"]
    lines += [""] if md else []
    lines += (_md_table if md else _table)(MULTIWORKER_HEADER, _multiworker_rows(mw))
    return lines


# --------------------------------------------------------------------------- the rest


def _communication(plan: dict, torch_result: dict) -> dict:
    counted = torch_result.get("collectives") or []
    tables = {str(c): communication.table(plan["comm_worlds_formula"], c, counted) for c in plan["comm_channels"]}
    return {"counted": counted, "tables": tables,
            "models": {"syncbn": "all_reduce (2C+1) float64 forward, all_reduce (2C+1) float32 backward",
                       "torch_syncbn": "all_gather (2C+1) float32 per rank forward, all_reduce 2C float32 backward"}}


def _numerics(plan: dict, raw: dict) -> dict:
    rows = []
    torch_result = raw["peers"].get("torch", {}).get("None") or {}
    for entry in torch_result.get("numerics") or []:
        for key, errors in (entry.get("errors") or {}).items():
            if errors:  # the one-process rows see the same W shards, concatenated
                rows.append({"impl": key, "world": entry["world"], "errors": errors})
    for key in ("keras_sync", "syncbn_keras"):
        for w, result in sorted(raw["peers"].get(key, {}).items(), key=lambda kv: int(kv[0])):
            if result.get("numerics"):
                rows.append({"impl": key, "world": int(w), "errors": result["numerics"]})
    for w, result in sorted(raw["peers"].get("flax", {}).items(), key=lambda kv: int(kv[0])):
        for key, errors in (result.get("numerics") or {}).items():
            rows.append({"impl": key, "world": int(w), "errors": errors})
    labels = {"torch_bn_one_process": "torch.nn.BatchNorm2d, the W shards in one process",
              "naive_float32": "naive E[x^2] - E[x]^2, float32 sums, the W shards",
              "flax": "flax nn.BatchNorm(axis_name=...), default (use_fast_variance=True)",
              "flax_two_pass": "flax nn.BatchNorm(axis_name=...), use_fast_variance=False",
              "syncbn_flax": "syncbn.flax.BatchNorm(axis_name=...)"}
    for row in rows:
        row["label"] = labels.get(row["impl"], _label(row["impl"]))
    large = [r for r in torch_result.get("large_planes") or [] if r]
    return {"offsets": plan["numerics"]["offsets"], "rows": rows, "spec": plan["numerics"], "large_planes": large}


def _bar(name: str, passed: Optional[bool], figure: str) -> dict:
    return {"bar": name, "passed": passed, "figure": figure}


PAYLOAD_BAR = "communication: payload per rank independent of W (= (2C+1+F)*8 + (2C+1+F)*4 bytes, F = 18 fingerprint values)"


def _bars(timing: dict, comm: dict, num: dict, plan: dict, multiworker: Optional[dict]) -> List[dict]:
    bars = []
    summary = {(s["impl"], s["world"]): s for s in timing["summary"]}

    def ratio_bar(name, key, world, limit):
        s = summary.get((key, world))
        if not s or s["median_ratio_to_bn"] is None:
            bars.append(_bar(name, None, "not measured"))
            return
        r = s["median_ratio_to_bn"]
        figure = (f"median ratio {r:.2f}x over {s['points']} point(s) "
                  f"(min {s['min_ratio_to_bn']:.2f}x, max {s['max_ratio_to_bn']:.2f}x)")
        if limit is None:  # a figure only
            bars.append(_bar(name, None, figure))
        else:
            bars.append(_bar(name, r <= limit, f"{figure}; bar <= {limit:.2f}x"))

    ratio_bar("syncbn with no process group within 1.10x of torch.nn.BatchNorm2d", "syncbn", None, 1.10)
    ratio_bar("syncbn at W = 1 within 1.10x of torch.nn.BatchNorm2d", "syncbn", 1, 1.10)
    # syncbn's time at W = 2 minus its two all-reduces (timed inside the layer call, in the
    # same blocks), against BatchNorm2d: a figure, no longer a bar (issue #34 retired the
    # earlier "within 1.3x": on a 2-vCPU VM it measured Python's overhead, not the layer),
    # with BatchNorm2d holding the same two all-reduces in its step beside it as the control.
    ratio_bar("figure, no bar (retired): syncbn at W = 2 minus its two all-reduces (timed inside the call) "
              "against torch.nn.BatchNorm2d on the same per-rank batch", "syncbn_compute", 2, None)
    same_steps = summary.get(("bn_collectives_compute", 2))
    if same_steps and same_steps["median_ratio_to_bn"] is not None and "not measured" not in bars[-1]["figure"]:
        # beside it, what two blocking all-reduces in a step do to BatchNorm2d's own work
        bars[-1]["figure"] += (f"; BatchNorm2d with the same two all-reduces in its step, minus them: median "
                               f"{same_steps['median_ratio_to_bn']:.2f}x (no bar)")
    emulated = summary.get(("syncbn_emulated", None))
    if emulated and emulated["median_ratio_to_bn"] is not None and "not measured" not in bars[-1]["figure"]:
        # the layer's own work with no gloo and no second process on the cores
        bars[-1]["figure"] += (f"; syncbn's synchronized step emulated in one process (no communication): median "
                               f"{emulated['median_ratio_to_bn']:.2f}x, {emulated['min_ratio_to_bn']:.2f}-"
                               f"{emulated['max_ratio_to_bn']:.2f}x (no bar)")

    # Against Keras at syncbn's own topology, as issue 16 restates the bar: Keras in 2 worker
    # processes (MultiWorkerMirroredStrategy, ring all-reduce over loopback) beside syncbn in
    # 2 gloo processes, at the points the multi-worker run measures. The in-process
    # MirroredStrategy comparison (Keras reduces in memory, syncbn over gloo) is a figure.
    name = ("syncbn at W = 2 (2 gloo processes) faster than Keras synchronized BN at equal topology (2 worker "
            "processes, MultiWorkerMirroredStrategy), same per-rank batch")
    equal = [r["ratio_syncbn_torch_to_keras_sync"] for r in (multiworker or {}).get("rows", [])
             if r["ratio_syncbn_torch_to_keras_sync"] is not None]
    if equal:
        bars.append(_bar(name, _worst(equal) < 1.0,
                         f"syncbn / Keras time: median {statistics.median(equal):.2f}x, worst point {_worst(equal):.2f}x "
                         f"over {len(equal)} point(s) (the multi-worker run's); bar < 1 at every point"))
    else:
        bars.append(_bar(name, None, "not measured"))
    keras_rows = [r for r in timing["rows"] if r["impl"] == "keras_sync" and r["world"] == 2 and "ratio_to_syncbn" in r]
    if keras_rows:
        ratios = [1.0 / r["ratio_to_syncbn"] for r in keras_rows]
        bars[-1]["figure"] += (f"; against Keras in one process (MirroredStrategy, 2 logical devices), every grid "
                               f"point: median {statistics.median(ratios):.2f}x, worst point {max(ratios):.2f}x (no bar)")

    def keras_bar(name, world, reference, passes, limit_text):
        ratios = [r[f"ratio_to_{reference}"] for r in timing["rows"]
                  if r["impl"] == "syncbn_keras" and r["world"] == world and f"ratio_to_{reference}" in r]
        if not ratios:
            bars.append(_bar(name, None, "not measured"))
            return
        bars.append(_bar(name, passes(ratios), f"syncbn.keras / Keras time: median {statistics.median(ratios):.2f}x, "
                                               f"worst point {_worst(ratios):.2f}x over {len(ratios)} point(s); "
                                               f"{limit_text}"))

    keras_bar("syncbn.keras at 1 replica within 1.10x of keras BatchNormalization (TensorFlow)", 1, "keras_bn",
              lambda ratios: not math.isnan(_worst(ratios)) and statistics.median(ratios) <= 1.10,
              "bar: median <= 1.10x")
    keras_bar("syncbn.keras at 2 replicas faster than Keras synchronized BN (MirroredStrategy)", 2, "keras_sync",
              lambda ratios: _worst(ratios) < 1.0, "bar < 1 at every point")

    counted = comm["counted"]
    name = "communication: 1 collective forward, 1 backward, none in eval (counted at the process group)"
    if counted:
        ok = all(c["forward"]["count"] == 1 and c["backward"]["count"] == 1 and c["eval"]["count"] == 0 for c in counted)
        seen = ", ".join(f"W={c['world']} C={c['channels']}: {c['forward']['count']}/{c['backward']['count']}/"
                         f"{c['eval']['count']}" for c in counted)
        bars.append(_bar(name, ok, f"forward/backward/eval collectives: {seen}"))
        by_c: Dict[int, set] = {}
        for c in counted:
            by_c.setdefault(c["channels"], set()).add(c["forward"]["payload_bytes"] + c["backward"]["payload_bytes"])
        worlds = sorted({c["world"] for c in counted})
        model = {ch: communication.syncbn_model(2, ch) for ch in by_c}
        ok = all(len(v) == 1 and v == {model[ch]["forward_payload_bytes"] + model[ch]["backward_payload_bytes"]}
                 for ch, v in by_c.items())
        figure = "; ".join(f"C={ch}: {sorted(v)} B" for ch, v in sorted(by_c.items()))
        bars.append(_bar(PAYLOAD_BAR, ok, f"counted at W = {worlds}: {figure}; wire bytes stay below twice the payload"))
    else:
        bars.append(_bar(name, None, "not measured"))
        bars.append(_bar(PAYLOAD_BAR, None, "not measured"))

    name = "numerics: syncbn at |mean|/std = 1e4 at least 100x more accurate than the naive formula"
    key = str(float(1e4))
    naive = {r["world"]: r["errors"] for r in num["rows"] if r["impl"] == "naive_float32"}
    pairs = [(r["world"], r["errors"][key], naive[r["world"]][key]) for r in num["rows"]
             if r["impl"] == "syncbn" and key in r["errors"] and key in naive.get(r["world"], {})]
    if pairs:
        gains = [theirs / max(ours, 1e-300) for _, ours, theirs in pairs]
        text = ", ".join(f"W={w}: syncbn {ours:.1e} vs naive {theirs:.1e}" for w, ours, theirs in pairs)
        bars.append(_bar(name, _worst(gains, min) >= 100, f"{text} (at least {_worst(gains, min):.0f}x)"))
    else:
        bars.append(_bar(name, None, "not measured"))

    name = ("numerics, large planes: syncbn's merged variance within 1e-6 relative and its output within 1e-5 std "
            "of float64, and its variance no further off than torch.nn.BatchNorm2d's on the whole batch (+1e-7)")
    rows = num.get("large_planes") or []
    if rows:
        worst_var = _worst(r["syncbn_var"] for r in rows)
        worst_out = _worst(r["syncbn_out"] for r in rows)
        behind = [r for r in rows if r["syncbn_var"] > r["torch_bn_var"] + 1e-7]
        bars.append(_bar(name, worst_var <= 1e-6 and worst_out <= 1e-5 and not behind,
                         f"worst over {len(rows)} case(s): variance {worst_var:.1e}, output {worst_out:.1e} std; "
                         f"{len(behind)} case(s) behind BatchNorm2d"))
    else:
        bars.append(_bar(name, None, "not measured"))
    return bars


CUDA_BAR = ("CUDA path (counted on the CPU with the CUDA choices forced: Triton's kernels interpreted where Triton "
            "is installed, else the torch-op path), "
            "SyncBatchNorm and SyncBatchNormAct: forward <= 3 activation-sized passes and <= 5 kernel launches, "
            "backward <= 5 and <= 3, no host synchronisation in a layer call")


def _cuda_bar(counts: Optional[dict]) -> dict:
    if not counts:
        return _bar(CUDA_BAR, None, "not measured")
    bars = counts["bars"]
    ok = all(b["passes_ok"] and b["launches_ok"] and b["no_host_sync"] for b in bars.values())
    # the path counted is the one CUDA tensors take in this install: say which
    paths = sorted({r.get("path", "torch ops") for key in ("syncbn", "syncbn_act", "syncbn_act_elu")
                    for r in counts.get(key, [])})
    figure = f"path counted: {', '.join(paths)}; " + "; ".join(
        f"{way}: {b['worst']['passes']} passes, {b['worst']['launches']} launches "
                       f"(torch.nn.SyncBatchNorm {counts['torch_syncbn'][way]['launches']}), "
                       f"{b['worst']['host_syncs']} host syncs" for way, b in bars.items())
    return _bar(CUDA_BAR, ok, f"{figure}; {_per_step(counts)}")


def _per_step(counts: dict) -> str:
    """What the step pays once, whatever its number of layers: the fingerprint's read."""
    worst = {k: max(r[way]["per_step"][k] for r in counts["syncbn"] for way in ("forward", "backward"))
             for k in ("launches", "host_syncs")}
    return (f"once per step (the layer fingerprint's verdicts read when the backward pass ends): "
            f"{worst['launches']} launches, {worst['host_syncs']} host sync")


def _cuda_count_rows(report: dict) -> List[List[str]]:
    """Per layer call: syncbn's counted CUDA path beside torch's read-off algorithms."""
    counts = report.get("cuda_counts")
    if not counts:
        return []
    cell = lambda c: f"{c['passes']} / {c['launches']} / {c['host_syncs']}"  # noqa: E731
    rows = [[f"syncbn.{label} {tuple(r['shape'])} {r['layout']}", f"counted ({r.get('path', 'torch ops')})",
             cell(r["forward"]), cell(r["backward"])]
            for key, label in (("syncbn", "SyncBatchNorm"), ("syncbn_act", "SyncBatchNormAct"),
                               ("syncbn_act_elu", "SyncBatchNormAct(elu)"))  # every row the bar judges
            for r in counts.get(key, [])]
    for key, label in (("torch_syncbn", "torch.nn.SyncBatchNorm"), ("batchnorm2d", "torch.nn.BatchNorm2d")):
        rows.append([label, "read off the source", cell(counts[key]["forward"]), cell(counts[key]["backward"])])
    return rows


CUDA_HEADER = ["layer call", "how", "forward passes / launches / host syncs", "backward passes / launches / host syncs"]


def _large_plane_rows(report: dict) -> List[List[str]]:
    """One row per per-rank shape and offset: syncbn's variance and output error at each W
    beside BatchNorm2d's on the W = 2 batch (the W ranks' inputs in one process)."""
    rows = report["numerics"].get("large_planes") or []
    worlds = sorted({r["world"] for r in rows})
    by = {(tuple(r["shape"]), r["offset"], r["world"]): r for r in rows}
    out = []
    for shape, offset in dict.fromkeys((tuple(r["shape"]), r["offset"]) for r in rows):
        cells = [str(shape), f"{offset:g}"]
        cells += [_fmt(by[(shape, offset, w)]["syncbn_var"], ".1e") if (shape, offset, w) in by else "-" for w in worlds]
        first = by.get((shape, offset, worlds[0]))
        cells += [_fmt(first["torch_bn_var"], ".1e")]
        cells += [_fmt(by[(shape, offset, w)]["syncbn_out"], ".1e") if (shape, offset, w) in by else "-" for w in worlds]
        cells += [_fmt(first["torch_bn_out"], ".1e")]
        out.append(cells)
    return out


def _large_plane_header(report: dict) -> List[str]:
    worlds = sorted({r["world"] for r in report["numerics"].get("large_planes") or []})
    first = worlds[0] if worlds else 2
    return (["per-rank input", "|mean|/std"] + [f"variance, syncbn W={w}" for w in worlds]
            + [f"variance, BatchNorm2d (W={first} batch)"] + [f"output, syncbn W={w}" for w in worlds]
            + [f"output, BatchNorm2d (W={first} batch)"])


def _fused_figures(timing: dict, memory: Optional[dict]) -> List[dict]:
    """The fused layer against SyncBatchNorm + the same activation: time, saved bytes,
    peak memory (figures, not bars)."""
    figures = []
    for s in timing["summary"]:
        if s["impl"] == "syncbn_act" and s["median_ratio_to_unfused"] is not None:
            figures.append({"figure": f"fused block step time / SyncBatchNorm + LeakyReLU, W = {_world(s['world'])}",
                            "value": s["median_ratio_to_unfused"], "text": f"{s['median_ratio_to_unfused']:.2f}x "
                            f"(median over {s['points']} point(s))"})
    reasons = [r["refusal"] for r in timing["refusals"] if r["impl"] == "syncbn_act"]
    if not any(f["figure"].startswith("fused block step time") for f in figures):
        figures.append({"figure": "fused block step time / SyncBatchNorm + LeakyReLU", "value": None,
                        "text": "not available" + (f": {reasons[0]}" if reasons else "")})
    blocks = {b["block"]: b for b in (memory or {}).get("blocks") or []}
    fused = next((b for name, b in blocks.items() if "fused" in name), None)
    plain = next((b for name, b in blocks.items() if name.startswith("torch.nn.BatchNorm2d + LeakyReLU")), None)
    if fused and plain and fused["available"] and plain["available"]:
        figures.append({"figure": "bytes saved for backward, fused block / torch BN + LeakyReLU",
                        "value": fused["saved_bytes"] / plain["saved_bytes"],
                        "text": f"{fused['saved_bytes'] / 2**20:.2f} MiB vs {plain['saved_bytes'] / 2**20:.2f} MiB "
                                f"({fused['saved_bytes'] / plain['saved_bytes']:.2f}x)"})
    else:
        figures.append({"figure": "bytes saved for backward, fused block / torch BN + LeakyReLU", "value": None,
                        "text": "not available" + (f": {fused['reason']}" if fused and not fused["available"] else "")})
    peaks = (memory or {}).get("peak_step") or []
    for layout in dict.fromkeys(p.get("layout", "contiguous") for p in peaks) or ["contiguous"]:
        figures.append(_peak_figure([p for p in peaks if p.get("layout", "contiguous") == layout], layout))
    return figures


def _peak_figure(peaks: list, layout: str) -> dict:
    """Fused / unfused peak memory of a demo-network step in one layout, with the bound
    that a layer keeping only its output could reach."""
    from .memory import OUTPUT_ONLY

    fused = next((p for p in peaks if "fused" in p["model"]), None)
    unfused = next((p for p in peaks if p["model"].startswith("syncbn.SyncBatchNorm +")), None)
    bound = next((p for p in peaks if p["model"] == OUTPUT_ONLY), None)
    name = f"demo network training step, peak memory, fused / unfused, {layout}"
    if not (fused and unfused and fused["available"] and unfused["available"] and unfused["peak_allocated_bytes"] > 0):
        return {"figure": name, "value": None, "layout": layout,
                "text": "not available" + (f": {fused['reason']}" if fused and not fused["available"] else "")}
    mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    allocated = fused["peak_allocated_bytes"] / unfused["peak_allocated_bytes"]
    rss = fused["peak_rise_bytes"] / unfused["peak_rise_bytes"] if unfused["peak_rise_bytes"] > 0 else None
    text = (f"peak allocated {mib(fused['peak_allocated_bytes'])} vs {mib(unfused['peak_allocated_bytes'])} "
            f"({allocated:.3f}x); peak RSS rise {mib(fused['peak_rise_bytes'])} vs {mib(unfused['peak_rise_bytes'])} "
            f"({_fmt(rss)}x); {fused.get('fused_layers')} fused layers")
    figure = {"figure": name, "value": allocated, "rss_ratio": rss, "layout": layout, "bound_ratio": None}
    if bound and bound["available"]:
        figure["bound_ratio"] = bound["peak_allocated_bytes"] / unfused["peak_allocated_bytes"]
        text += (f"; a layer keeping only its output can reach at best {mib(bound['peak_allocated_bytes'])} allocated "
                 f"({figure['bound_ratio']:.3f}x; the fused layer is "
                 f"{mib(fused['peak_allocated_bytes'] - bound['peak_allocated_bytes'])} above it)")
    figure["text"] = text
    return figure


def build(plan: dict, raw: dict, meta: dict) -> dict:
    torch_result = raw["peers"].get("torch", {}).get("None") or {}
    timing = _timing(plan, raw)
    comm = _communication(plan, torch_result)
    num = _numerics(plan, raw)
    multiworker = _multiworker(plan, raw, timing)
    versions = {}
    for by_world in raw["peers"].values():
        for result in by_world.values():
            versions.update(result.get("versions") or {})
    errors = {}
    for key, by_world in raw["peers"].items():
        for w, result in by_world.items():
            for section, text in (result.get("errors") or {}).items():
                errors[f"{key} W={w} {section}"] = text
    for run in raw["runs"]:
        if peer_failed(run):
            name = f"{run['peer']} W={run['world']}"
            errors[f"{name} process"] = ("timed out" if run["timed_out"] else f"exit {run['returncode']}") + \
                "\n" + run["output_tail"]
    notes = [
        f"Each replica (process, logical device, host device) uses {plan['threads']} thread(s); a peer with W "
        f"replicas gets W x {plan['threads']} threads in all: W torch processes, or one TensorFlow / JAX process "
        f"with W x {plan['threads']} intra-op threads pinned to min(W x {plan['threads']}, {meta['cores']}) cores.",
        "N is the per-replica batch: at W replicas every implementation normalizes a global batch of N x W.",
        "Every peer process runs with the same glibc malloc settings (MALLOC_MMAP_THRESHOLD_=32 MiB, "
        "MALLOC_TRIM_THRESHOLD_=1 TiB unless set in the environment): steady-state steps reuse heap memory instead "
        "of faulting fresh pages, which otherwise depends on each process's allocation history.",
        "Keras and Flax: 'contiguous' is NCHW with axis=1, 'channels_last' is NHWC with axis=-1.",
        "Peak memory of a step: 'peak allocated' sums the profiler's allocation events (exact, allocator-free); "
        "'peak RSS rise' is what the operating system saw, at page granularity and after the allocator's reuse "
        "of freed memory, so it is coarse for small models. The lower-bound row replaces every fused layer by a "
        "stand-in that keeps only its output and allocates only the input gradient in backward (its gradients are "
        "not real): no layer that keeps its output can go below it; what lies between it and zero is the network's "
        "own (concatenations, loss, convolution inputs and scratch, which differs between the two layouts).",
        f"Floor: {sum(PASSES.values())} passes over the per-replica input ({', '.join(f'{k}: {v}' for k, v in PASSES.items())}) "
        "at the measured copy bandwidth of one process.",
    ]
    worlds = sorted({w for ws in plan["worlds"].values() for w in ws})
    over = [w for w in worlds if w * plan["threads"] > meta["cores"]]
    if over:
        notes.append(f"W = {over} asks for more threads than the {meta['cores']} cores of this machine: those rows "
                     "share cores and measure oversubscription as much as the implementation.")
    if meta.get("load_before") and meta["load_before"][0] > 0.5 * meta["cores"]:
        notes.append(f"The machine was busy (load average {meta['load_before']} at the start, {meta.get('load_after')} "
                     f"at the end, {meta['cores']} cores): timings are noisy; rerun on a quiet machine.")
    return {
        "schema": SCHEMA,
        "meta": dict(meta, versions=versions),
        "plan": plan,
        "timing": timing,
        "floor": torch_result.get("floor"),
        "communication": comm,
        "memory": torch_result.get("memory"),
        "numerics": num,
        "cuda_counts": torch_result.get("cuda_counts"),
        "bars": _bars(timing, comm, num, plan, multiworker) + [_cuda_bar(torch_result.get("cuda_counts"))],
        "fused": _fused_figures(timing, torch_result.get("memory")),
        "keras_multiworker": multiworker,
        "skipped": raw["skipped"],
        "runs": raw["runs"],
        "errors": errors,
        "notes": notes,
    }


# --------------------------------------------------------------------------- text


def _fmt(value, spec=".2f", none="-"):
    return none if value is None else format(value, spec)


def _world(w) -> str:
    return "no group" if w is None else str(w)


def _table(header: List[str], rows: List[List[str]]) -> List[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)] if rows else [len(h) for h in header]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return [line(header), line(["-" * w for w in widths])] + [line(r) for r in rows]


def _md_table(header: List[str], rows: List[List[str]]) -> List[str]:
    return ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"] + \
        ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def _bar_lines(report: dict) -> List[str]:
    mark = {True: "PASS", False: "FAIL", None: "n/a "}
    return [f"[{mark[b['passed']]}] {b['bar']}: {b['figure']}" for b in report["bars"]]


def _summary_rows(report: dict) -> List[List[str]]:
    return [[s["label"], _world(s["world"]), str(s["points"]), _fmt(s["geomean_ms"], ".3f"),
             _fmt(s["median_ratio_to_bn"]), f"{_fmt(s['min_ratio_to_bn'])}-{_fmt(s['max_ratio_to_bn'])}",
             _fmt(s["median_ratio_to_syncbn"]), _fmt(s["median_ratio_to_floor"], ".1f")]
            for s in report["timing"]["summary"]]


SUMMARY_HEADER = ["implementation", "W", "points", "geomean ms", "x BN2d (median)", "x BN2d (range)",
                  "x syncbn same W", "x floor"]


def _comm_rows(report: dict, channels: str) -> List[List[str]]:
    return [[str(r["world"]), str(r["syncbn_payload_bytes"]), str(r["syncbn_wire_bytes"]), str(r["torch_syncbn_wire_bytes"]),
             _fmt(r["ratio_torch_over_syncbn"]), r["source"]]
            for r in report["communication"]["tables"][channels]]


COMM_HEADER = ["W", "syncbn payload B", "syncbn wire B/rank", "torch SyncBN wire B/rank", "torch / syncbn", "syncbn figure"]


def _numerics_rows(report: dict) -> List[List[str]]:
    offsets = report["numerics"]["offsets"]
    return [[r["label"], _world(r["world"])] +
            [_fmt(r["errors"].get(str(float(o))), ".1e") for o in offsets] for r in report["numerics"]["rows"]]


def _memory_lines(report: dict, md: bool) -> List[str]:
    mem = report.get("memory")
    if not mem:
        return ["not measured"]
    table = _md_table if md else _table
    lines = table(["block", "saved for backward", "x input"],
                  [[b["block"], f"{b['saved_bytes'] / 2**20:.2f} MiB" if b["available"] else "not available",
                    _fmt(b.get("ratio_to_input")) if b["available"] else b["reason"]] for b in mem["blocks"]])
    lines.append("")
    lines += table(["demo network (TinyUNet, LeakyReLU), one training step", "layout", "peak RSS rise",
                    "peak allocated", "peak RSS"],
                   [[p["model"], p.get("layout", "contiguous"), f"{p['peak_rise_bytes'] / 2**20:.1f} MiB",
                     f"{p['peak_allocated_bytes'] / 2**20:.1f} MiB", f"{p['peak_rss_bytes'] / 2**20:.0f} MiB"]
                    if p["available"] else [p["model"], p.get("layout", "contiguous"), "not available", "", p["reason"]]
                    for p in mem["peak_step"] or []])
    return lines


def terminal(report: dict) -> str:
    meta = report["meta"]
    out = [f"syncbn bench{' --quick' if meta['quick'] else ''}: {meta['cores']} cores, "
           f"{meta['threads_per_replica']} thread(s) per replica, load {meta['load_before']} -> {meta['load_after']}, "
           f"{meta['seconds']:.0f} s", ""]
    out.append("Per-layer forward + backward, float32 (ratios: median over the grid of per-point ratios)")
    out += _table(SUMMARY_HEADER, _summary_rows(report))
    for r in report["timing"]["refusals"]:
        out.append(f"  {_label(r['impl'])} at W = {_world(r['world'])}: not run: {r['refusal']}")
    floor = report.get("floor")
    if floor:
        out.append(f"  copy bandwidth {floor['bytes_per_s'] / 1e9:.1f} GB/s (floor = 8 passes over the input)")
    if report.get("keras_multiworker"):
        out += [""] + _multiworker_lines(report, md=False)
    out.append("")
    biggest = str(max(report["plan"]["comm_channels"]))
    out.append(f"Bytes per rank per layer call (forward + backward), C = {biggest}")
    out += _table(COMM_HEADER, [r for r in _comm_rows(report, biggest) if int(r[0]) in (2, 4, 8, 64, 1024)])
    out.append("")
    out.append("Relative error of the merged variance vs float64, by |mean| / std")
    out += _table(["implementation", "W"] + [f"{o:g}" for o in report["numerics"]["offsets"]], _numerics_rows(report))
    if report["numerics"].get("large_planes"):
        out.append("")
        out.append("Large planes: relative error of the merged variance, output error in units of the std (float64 reference)")
        out += _table(_large_plane_header(report), _large_plane_rows(report))
    if report.get("cuda_counts"):
        out.append("")
        out.append("CUDA path per layer call, one all-reduce each way (collectives not in the launches)")
        out += _table(CUDA_HEADER, _cuda_count_rows(report))
        out.append(_per_step(report["cuda_counts"]))
    out.append("")
    out.append("Memory")
    out += _memory_lines(report, md=False)
    out.append("")
    out += [f"{f['figure']}: {f['text']}" for f in report["fused"]]
    out.append("")
    out += _bar_lines(report)
    for s in report["skipped"]:
        out.append(f"skipped {s['label']}: {s['reason']}")
    for name in report["errors"]:
        out.append(f"error in {name} (see report.json)")
    return "\n".join(out)


def markdown(report: dict, images: List[str]) -> str:
    meta, plan = report["meta"], report["plan"]
    out = ["# syncbn bench", ""]
    out.append(f"Command: `{meta.get('command') or 'syncbn bench'}`; {meta['started']}; {meta['cores']} cores "
               f"({meta.get('processor') or meta['machine']}), {meta['threads_per_replica']} thread(s) per replica; "
               f"load average {meta['load_before']} at the start, {meta['load_after']} at the end; "
               f"{meta['seconds']:.0f} s.")
    out.append("Versions: " + ", ".join(f"{k} {v}" for k, v in sorted(meta["versions"].items())) + ".")
    out += ["", "## Bars", ""] + [f"- {line}" for line in _bar_lines(report)]
    out += ["", "## Per-layer forward + backward time", ""]
    out += _md_table(SUMMARY_HEADER, _summary_rows(report))
    out.append("")
    for r in report["timing"]["refusals"]:
        out.append(f"- {_label(r['impl'])} at W = {_world(r['world'])}: not run: `{r['refusal']}`")
    out.append("")
    for name in images:
        out.append(f"![{name}]({name})")
    out += ["", "### Every point (median ms; ratio to torch.nn.BatchNorm2d on the same per-replica batch)", ""]
    keys = sorted({(r["impl"], r["world"]) for r in report["timing"]["rows"]}, key=_order)
    header = ["N", "C", "HxW", "layout", "floor ms"] + [f"{_label(k)} W={_world(w)}" for k, w in keys]
    by = {(r["impl"], r["world"], r["point"]): r for r in report["timing"]["rows"]}
    rows = []
    for i, p in enumerate(plan["points"]):
        floor_ms = next((r.get("floor_ms") for r in report["timing"]["rows"] if r["point"] == i), None)
        cells = [str(p["N"]), str(p["C"]), f"{p['H']}x{p['W']}", p["layout"], _fmt(floor_ms, ".3f")]
        for k, w in keys:
            r = by.get((k, w, i))
            cells.append("-" if r is None else f"{r['median_ms']:.3f} ({_fmt(r.get('ratio_to_bn'))}x)")
        rows.append(cells)
    out += _md_table(header, rows)
    if report.get("keras_multiworker"):
        out += ["", "### Keras at equal topology", ""] + _multiworker_lines(report, md=True)
        out += ["", report["keras_multiworker"]["note"]]
    out += ["", "## Communication per layer call", ""]
    for c in report["communication"]["tables"]:
        out.append(f"C = {c} (bytes sent per rank, = bytes received; 'counted' rows come from the process group "
                   "in this run, the others from the model checked against them):")
        out.append("")
        out += _md_table(COMM_HEADER, _comm_rows(report, c))
        out.append("")
    out.append("Models: " + "; ".join(f"{k}: {v}" for k, v in report["communication"]["models"].items()) + ".")
    out += ["", "## Numerics: relative error of the merged variance vs float64", ""]
    spec = report["numerics"]["spec"]
    out.append(f"W shards of ({spec['batch']}, {spec['channels']}, {spec['size']}, {spec['size']}) float32 each, "
               "channel means ~ offset, std 1; largest error over the channels.")
    out.append("")
    out += _md_table(["implementation", "W"] + [f"{o:g}" for o in report["numerics"]["offsets"]], _numerics_rows(report))
    if report["numerics"].get("large_planes"):
        out += ["", "### Large planes", ""]
        out.append("Each rank draws its own float32 input (channel means ~ offset, std 1). Variance: relative error "
                   "of the merged running variance (momentum 1, de-biased); output: largest error over every rank's "
                   "output, in units of the std; both against float64 two-pass statistics of the same float32 "
                   "values. torch.nn.BatchNorm2d runs on the W ranks' inputs concatenated in one process.")
        out.append("")
        out += _md_table(_large_plane_header(report), _large_plane_rows(report))
    if report.get("cuda_counts"):
        out += ["", "## CUDA path: passes, launches, host synchronisations per layer call", ""]
        out.append("syncbn's rows are counted: the layer runs on the CPU with its device-dependent choices forced to "
                   "the CUDA ones, every dispatched operation recorded with its shapes (report.json lists them), "
                   "after one uncounted warm-up step; on the Triton kernels (rows marked triton) Triton's interpreter "
                   "runs them, each launch recorded as one operation; on the torch-op path the three CUDA-only "
                   "kernels run as CPU stand-ins recorded as one operation each. torch's rows are read "
                   "off their sources (torch.nn.SyncBatchNorm refuses CPU tensors): "
                   f"{report['cuda_counts']['torch_syncbn']['source']}; under CUDA-graph capture it skips its "
                   f"rank mask: {report['cuda_counts']['torch_syncbn']['forward']['launches_under_graph_capture']} "
                   "launches and no host sync forward.")
        out.append("")
        out += _md_table(CUDA_HEADER, _cuda_count_rows(report))
        out += ["", f"syncbn, {_per_step(report['cuda_counts'])}."]
    out += ["", "## Memory", ""] + _memory_lines(report, md=True)
    out += ["", "Fused BN + activation (syncbn.SyncBatchNormAct) against syncbn.SyncBatchNorm + LeakyReLU:", ""]
    out += [f"- {f['figure']}: {f['text']}" for f in report["fused"]]
    out += ["", "## Notes", ""] + [f"- {n}" for n in report["notes"]]
    for s in report["skipped"]:
        out.append(f"- skipped {s['label']}: {s['reason']}")
    if report["errors"]:
        out += ["", "## Errors", ""]
        for name, text in report["errors"].items():
            out += [f"### {name}", "", "```", text.strip()[-3000:], "```", ""]
    return "\n".join(out) + "\n"


def write(report: dict, out: Path) -> None:
    out = Path(out)
    images: List[str] = []
    try:
        from . import plots

        images = plots.write_all(report, out)
    except ImportError as exc:
        report["notes"].append(f"no plots: {exc}")
    report["images"] = images
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "report.md").write_text(markdown(report, images))
