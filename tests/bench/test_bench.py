"""``syncbn bench``: the quick run end to end (report structure and the collectives it
counted at the process group), and the report's handling of missing peers.

Timings are never asserted: the bars are printed by the report, not tested.
"""

import json
import math
import subprocess
import sys

import pytest

from syncbn.bench import communication, cuda_counts, keras_multiworker, memory, report, runner
from syncbn.bench.plan import PEERS, make_plan

QUICK_TIMEOUT = 420  # about 90-110 s on two cores (the multi-worker Keras row adds ~15 s); generous for a loaded machine


def _bench_command():
    """``python -m syncbn bench`` once the subcommand is registered, else the module."""
    try:
        from syncbn.cli import COMMANDS
    except ImportError:
        COMMANDS = {}
    return [sys.executable, "-m", "syncbn", "bench"] if "bench" in COMMANDS else [sys.executable, "-m", "syncbn.bench"]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run([*_bench_command(), "--quick", "--out", str(out)], capture_output=True, text=True,
                          timeout=QUICK_TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return out, json.loads((out / "report.json").read_text()), proc.stdout


def test_quick_writes_every_output(quick):
    out, rep, stdout = quick
    assert (out / "report.md").read_text().startswith("# syncbn bench")
    for name in rep["images"]:
        assert (out / name).stat().st_size > 0
    for section in ("meta", "plan", "timing", "floor", "communication", "memory", "numerics", "bars", "fused",
                    "skipped", "runs", "errors", "notes"):
        assert section in rep, section
    assert rep["meta"]["quick"] is True and rep["plan"]["quick"] is True
    assert rep["errors"] == {}, json.dumps(rep["errors"], indent=1)[:4000]
    # every bar is printed as a pass/fail/n.a. line, none is asserted here
    assert len(rep["bars"]) == 11
    for bar in rep["bars"]:
        assert bar["passed"] in (True, False, None) and bar["figure"]
        assert bar["bar"] in stdout
    # the CPU's "W = 2 minus all-reduces within 1.3x" is retired (issue #34): a figure with
    # BatchNorm2d holding the same all-reduces beside it, never a pass or a fail
    retired = [b for b in rep["bars"] if "minus its two all-reduces" in b["bar"]]
    assert len(retired) == 1 and retired[0]["passed"] is None and "bar <=" not in retired[0]["figure"]
    assert "BatchNorm2d with the same two all-reduces" in retired[0]["figure"], retired[0]["figure"]


def test_quick_counts_one_collective_each_way(quick):
    _, rep, _ = quick
    counted = rep["communication"]["counted"]
    assert {c["channels"] for c in counted} == set(rep["plan"]["comm_channels"])
    assert all(c["world"] >= 2 for c in counted)
    for c in counted:
        ch = c["channels"]
        assert c["forward"]["count"] == 1 and c["backward"]["count"] == 1 and c["eval"]["count"] == 0
        assert [call["op"] for call in c["forward"]["calls"] + c["backward"]["calls"]] == ["all_reduce"] * 2
        f = communication.FINGERPRINT  # the layer fingerprint's values ride along
        assert c["forward"]["payload_bytes"] == (2 * ch + 1 + f) * 8  # float64 sums
        assert c["backward"]["payload_bytes"] == (2 * ch + 1 + f) * 4  # float32 sums, overflow slot
    table = rep["communication"]["tables"]["256"]
    assert [r["world"] for r in table] == [2**k for k in range(1, 11)]
    assert any(r["source"] == "counted" for r in table)
    assert len({r["syncbn_payload_bytes"] for r in table}) == 1


def test_quick_times_every_installed_peer(quick):
    _, rep, _ = quick
    rows = rep["timing"]["rows"]
    seen = {(r["impl"], r["world"]) for r in rows}
    for key in ("torch_bn", "syncbn"):
        for world in (None, 1, 2):
            assert (key, world) in seen
    assert all(r["median_ms"] > 0 and r["repeats"] == rep["plan"]["repeats"] for r in rows)
    # at W = 2 both layers' times without their all-reduces, each against BatchNorm2d alone
    for key in ("syncbn_compute", "bn_collectives_compute"):
        assert (key, 2) in seen and (key, None) not in seen, key
        assert all(r["ratio_to_bn"] > 0 for r in rows if r["impl"] == key)
    assert ("bn_collectives", 2) not in seen  # only its time without the all-reduces is a row
    # syncbn's synchronized step in a group of two emulated in the single process
    assert ("syncbn_emulated", None) in seen
    assert all(r["world"] is None and r["ratio_to_bn"] > 0 for r in rows if r["impl"] == "syncbn_emulated")
    refused = {(r["impl"], r["world"]) for r in rep["timing"]["refusals"]}
    # torch.nn.SyncBatchNorm refuses CPU inputs: a result, not a crash (or, one day, a row)
    assert ("torch_syncbn", 2) in refused or ("torch_syncbn", 2) in seen
    skipped = {s["peer"] for s in rep["skipped"]}
    for key in ("keras_sync", "syncbn_keras", "flax"):
        assert key in skipped or (key, 2) in seen, key


def test_emulated_step_takes_the_synchronized_path(monkeypatch):
    """The emulated group of two runs syncbn's synchronized call (two all-reduces, the
    running variance of a batch counted twice) and refuses a layer that would not."""
    import torch

    from syncbn.bench import torch_peer

    x = torch.randn(3, 4, 5, 5, requires_grad=True)
    dy = torch.randn_like(x)
    built = []
    real_build = torch_peer.build
    monkeypatch.setattr(torch_peer, "build", lambda key, channels: built.append(real_build(key, channels)) or built[-1])
    step, _ = torch_peer.emulated_step(4, x, dy)
    step()
    layer = built[0]
    # two steps (the check and this one), momentum 0.1, from ones, towards the unbiased
    # variance over the doubled count 2n: var_b * 2n / (2n - 1)
    n = x[:, 0].numel()
    var = x.detach().var(dim=(0, 2, 3), unbiased=False).double() * (2 * n) / (2 * n - 1)
    expected = 1 + (var - 1) * (1 - 0.9**2)
    assert torch.allclose(layer.running_var.double(), expected, rtol=1e-5, atol=0)
    monkeypatch.setattr(torch_peer, "build", lambda key, channels: torch.nn.BatchNorm2d(channels))
    with pytest.raises(RuntimeError, match="made 0 all-reduce"):
        torch_peer.emulated_step(4, x, dy)


def test_quick_keras_multiworker_row(quick):
    """Keras at syncbn's topology (2 worker processes, MultiWorkerMirroredStrategy)
    beside syncbn's torch layer at 2 gloo processes: structure and finite, positive
    figures (no bar: the speeds are printed, not asserted)."""
    _, rep, stdout = quick
    if "keras_multiworker" in {s["peer"] for s in rep["skipped"]}:
        assert rep["keras_multiworker"] is None and "skipped Keras synchronized BN and syncbn.keras" in stdout
        return
    mw = rep["keras_multiworker"]
    assert mw["label"] == "2 worker processes, MultiWorkerMirroredStrategy" and mw["world"] == 2
    assert mw["label"] in stdout
    assert [r["point"] for r in mw["rows"]] == rep["plan"]["keras_multiworker"]["points"]
    torch_w2 = {r["point"]: r["median_ms"] for r in rep["timing"]["rows"] if r["impl"] == "syncbn" and r["world"] == 2}
    for row in mw["rows"]:
        assert {k: row[k] for k in ("N", "C", "H", "W", "layout")} == rep["plan"]["points"][row["point"]]
        assert row["repeats"] == rep["plan"]["repeats"]
        assert row["syncbn_torch_ms"] == torch_w2[row["point"]]  # the torch peer's figure, same point
        for key in ("keras_sync_ms", "syncbn_keras_ms", "syncbn_torch_ms", "ratio_syncbn_keras_to_keras_sync",
                    "ratio_syncbn_torch_to_keras_sync"):
            assert math.isfinite(row[key]) and row[key] > 0, (key, row)
        assert row["ratio_syncbn_keras_to_keras_sync"] == pytest.approx(row["syncbn_keras_ms"] / row["keras_sync_ms"])
        assert row["ratio_syncbn_torch_to_keras_sync"] == pytest.approx(row["syncbn_torch_ms"] / row["keras_sync_ms"])
    for key in ("median_ratio_syncbn_keras_to_keras_sync", "median_ratio_syncbn_torch_to_keras_sync"):
        assert math.isfinite(mw[key]) and mw[key] > 0, (key, mw)
    # the in-process MirroredStrategy rows stay
    seen = {(r["impl"], r["world"]) for r in rep["timing"]["rows"]}
    assert {("keras_sync", 2), ("syncbn_keras", 2)} <= seen


def test_quick_numerics_and_memory(quick):
    _, rep, _ = quick
    offsets = [str(float(o)) for o in rep["numerics"]["offsets"]]
    by_impl = {r["impl"]: r for r in rep["numerics"]["rows"]}
    for key in ("syncbn", "naive_float32", "torch_bn_one_process"):
        assert sorted(by_impl[key]["errors"]) == sorted(offsets)
    spec = rep["plan"]["large_planes"]
    large = rep["numerics"]["large_planes"]
    assert len(large) == len(spec["shapes"]) * len(spec["offsets"]) * len(spec["worlds"])
    for row in large:  # the figures come back finite (the bar compares them; see test_stats for bounds)
        assert all(0 <= row[k] < 1 for k in ("syncbn_var", "syncbn_out", "torch_bn_var")), row
    counts = rep["cuda_counts"]  # the CUDA path counted on the CPU (bars in test_stats / the report)
    assert [(r["shape"], r["layout"]) for r in counts["syncbn"]] == [
        (s, layout) for s in rep["plan"]["cuda_counts"]["shapes"] for layout in rep["plan"]["cuda_counts"]["layouts"]]
    for r in counts["syncbn"]:
        assert r["forward"]["collectives"] == 1 and r["backward"]["collectives"] == 1
    mem = rep["memory"]
    assert {b["block"] for b in mem["blocks"] if b["available"]} >= {
        "torch.nn.BatchNorm2d + LeakyReLU", "syncbn.SyncBatchNorm + LeakyReLU"}
    for b in mem["blocks"]:
        assert b["available"] or b["reason"]
    assert mem["peak_step"] and all(p["available"] or p["reason"] for p in mem["peak_step"])
    assert {p["layout"] for p in mem["peak_step"]} == {"contiguous", "channels_last"}
    for layout in ("contiguous", "channels_last"):
        rows = {p["model"]: p for p in mem["peak_step"] if p["layout"] == layout and p["available"]}
        fused = next((p for name, p in rows.items() if "fused" in name), None)
        bound = rows.get(memory.OUTPUT_ONLY)
        if fused is not None:  # the stand-in is a bound: no layer keeping its output goes below it
            assert bound is not None and bound["fused_layers"] == fused["fused_layers"] > 0
            assert bound["peak_allocated_bytes"] <= fused["peak_allocated_bytes"]
        figure = next(f for f in rep["fused"] if f["figure"].endswith(f"fused / unfused, {layout}"))
        assert figure["value"] is None or 0 < figure["value"] < 1.5
    assert rep["floor"]["bytes_per_s"] > 0


def test_keras_bar_judges_equal_topology():
    """The bar against Keras synchronized BN takes the multi-worker run (2 worker
    processes beside syncbn's 2 gloo processes): it fails when syncbn is slower at any
    one of its points, whatever the in-process MirroredStrategy rows say (a figure)."""
    in_process = [{"impl": "keras_sync", "world": 2, "point": i, "ratio_to_syncbn": r} for i, r in enumerate((0.8, 2.0))]
    timing = {"rows": in_process, "summary": []}
    empty = ({"counted": []}, {"rows": [], "large_planes": []}, make_plan(quick=True))

    def keras_bar(ratios):
        mw = None if ratios is None else {"rows": [{"ratio_syncbn_torch_to_keras_sync": r} for r in ratios]}
        bars = report._bars(timing, *empty, mw)
        assert len(bars) == 10  # the CUDA bar is added by build()
        return next(b for b in bars if "equal topology" in b["bar"])

    passed = keras_bar([0.4, 0.9, None])  # a point without syncbn's torch figure is left out
    assert passed["passed"] is True
    assert "worst point 0.90x over 2 point(s)" in passed["figure"]
    assert "one process" in passed["figure"] and "worst point 1.25x" in passed["figure"]  # 1 / 0.8
    assert keras_bar([0.4, 1.0])["passed"] is False
    assert keras_bar([0.3, 1.01, 0.2])["passed"] is False
    missing = keras_bar(None)
    assert missing["passed"] is None and missing["figure"].startswith("not measured")


@pytest.mark.parametrize("nan_first", [False, True])
def test_a_nan_figure_fails_its_bar(nan_first):
    """A NaN error or ratio fails its bar, wherever it sits among the figures: ``max`` and
    ``min`` drop a NaN that is not first, and a NaN variance at W=4 (or a NaN large-plane
    case, a NaN multi-worker point) passed behind a good first figure, printed as the worst."""
    nan, key = math.nan, str(float(1e4))

    def first(rows):
        return rows[::-1] if nan_first else rows

    naive = [{"impl": "naive_float32", "world": w, "errors": {key: 1e-2}} for w in (2, 4)]
    ours = first([{"impl": "syncbn", "world": 2, "errors": {key: 1e-8}}, {"impl": "syncbn", "world": 4, "errors": {key: nan}}])
    plane = {"shape": [1, 2, 4, 4], "offset": 1e4, "world": 2, "torch_bn_var": 1e-8, "torch_bn_out": 1e-7}
    planes = first([dict(plane, syncbn_var=1e-8, syncbn_out=1e-7), dict(plane, syncbn_var=nan, syncbn_out=nan)])
    mw = {"rows": first([{"ratio_syncbn_torch_to_keras_sync": 0.5}, {"ratio_syncbn_torch_to_keras_sync": nan}])}
    keras = [{"impl": "syncbn_keras", "world": w, "point": i, f"ratio_to_{ref}": r}
             for w, ref in ((1, "keras_bn"), (2, "keras_sync")) for i, r in enumerate(first([0.5, nan]))]
    bars = report._bars({"rows": keras, "summary": []}, {"counted": []},
                        {"rows": naive + ours, "large_planes": planes}, make_plan(quick=True), mw)
    judged = {b["bar"].split(":")[0].split(" (")[0]: b for b in bars if b["passed"] is not None}
    assert len(judged) == 5, list(judged)
    for name, bar in judged.items():
        assert bar["passed"] is False and "nan" in bar["figure"], (name, bar["figure"])


def test_missing_peers_are_skipped_with_a_note(tmp_path, monkeypatch):
    monkeypatch.setattr(runner.plans, "installed", lambda peer: "nothing")
    notes = []
    rep = runner.run_bench(make_plan(quick=True), tmp_path, say=notes.append)
    assert {s["peer"] for s in rep["skipped"]} == set(PEERS)
    assert rep["runs"] == [] and rep["timing"]["rows"] == []
    assert len(rep["bars"]) == 11 and all(bar["passed"] is None for bar in rep["bars"])
    assert "skipped" in report.terminal(rep)
    assert (tmp_path / "report.md").exists() and (tmp_path / "report.json").exists()


def test_a_failed_peer_fails_the_command(tmp_path, capsys, monkeypatch):
    """A peer that crashed left its figures out of the report, and the command still exited
    0 as if every measurement had run; it exits 1, naming the failure, report written."""
    from syncbn import cli

    crashed = {"returncode": 1, "timed_out": False, "seconds": 0.5, "output_tail": "RuntimeError: boom",
               "result": None}
    monkeypatch.setattr(runner.plans, "installed", lambda peer: None)
    monkeypatch.setattr(runner, "run_peer", lambda *a, **k: dict(crashed))
    assert cli.main(["bench", "--quick", "--peers", "torch_bn", "--out", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "measurement(s) failed: torch W=None process" in captured.err, captured.err
    rep = json.loads((tmp_path / "report.json").read_text())
    assert "boom" in rep["errors"]["torch W=None process"]
    assert "## Errors" in (tmp_path / "report.md").read_text()


HALF_WRITTEN_PEER = """
import argparse, os, signal
parser = argparse.ArgumentParser()
parser.add_argument("--plan")
parser.add_argument("--out")
with open(parser.parse_args().out, "w") as fh:
    fh.write('{"peer": "torch", "floor": {"bytes_per')
    fh.flush()
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_peer_killed_while_writing_its_result_is_an_error(tmp_path, monkeypatch):
    """A peer killed halfway through writing its result file (a timeout's SIGKILL, the OOM
    killer) ended the whole bench in a JSONDecodeError, with no report; its run is now an
    error of the report, the other peers' figures kept."""
    from syncbn.bench import peers

    (tmp_path / "half_written_peer.py").write_text(HALF_WRITTEN_PEER)
    outcome = peers.run_peer("half_written_peer", make_plan(quick=True), 60, env={"PYTHONPATH": str(tmp_path)})
    assert outcome["result"] is None and "could not be read" in outcome["unreadable"], outcome
    monkeypatch.setattr(runner.plans, "installed", lambda peer: None)
    monkeypatch.setattr(runner, "run_peer", lambda *a, **k: dict(outcome, returncode=0))
    rep = runner.run_bench(make_plan(quick=True, peers=["torch_bn"]), tmp_path / "out", say=lambda line: None)
    assert "could not be read" in rep["errors"]["torch W=None process"], rep["errors"]


def test_an_output_folder_that_cannot_be_made_is_a_usage_error(tmp_path, capsys, monkeypatch):
    """--out under a file ended in pathlib's FileNotFoundError traceback (exit 1); it is a
    usage error naming the option, before any peer runs."""
    from syncbn import cli

    monkeypatch.setattr(runner, "run_bench", lambda *a, **k: pytest.fail("the bench started"))
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert cli.main(["bench", "--quick", "--out", str(blocker / "out")]) == 2
    err = capsys.readouterr().err
    assert f"syncbn bench: --out {blocker / 'out'}: {blocker} is not a folder" in err, err


@pytest.mark.parametrize("shape", [["0", "64", "28", "28"], ["2", "64", "-1", "28"]])
def test_cuda_counts_refuses_a_shape_that_is_not_positive(shape, capsys, monkeypatch):
    """A size below 1 ended in each worker's RuntimeError traceback (exit 1); it is a usage
    error naming the option (exit 2), before any worker starts."""
    from syncbn.tools import launch

    monkeypatch.setattr(launch, "WorkerPool", lambda *a, **k: pytest.fail("workers started"))
    with pytest.raises(SystemExit) as info:
        cuda_counts.main(["--shape", *shape])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"python -m syncbn.bench.cuda_counts: error: --shape must be four positive sizes, got {' '.join(shape)}" in err


def test_communication_models():
    for c in (1, 64, 256):
        payloads = {communication.syncbn_model(w, c)["forward_payload_bytes"] for w in (2, 8, 1024)}
        f = communication.FINGERPRINT
        assert payloads == {(2 * c + 1 + f) * 8}
        for w in (2, 4, 1024):
            ours = communication.syncbn_model(w, c)
            assert ours["forward_wire_bytes"] + ours["backward_wire_bytes"] < 2 * ((2 * c + 1 + f) * 8
                                                                                   + (2 * c + 1 + f) * 4)
            theirs = communication.torch_syncbn_model(w, c)
            assert theirs["forward_wire_bytes"] == (w - 1) * (2 * c + 1) * 4


def test_output_only_stand_in_keeps_exactly_its_output():
    """The memory bound's stand-in: same forward output as the fused layer, and it saves
    one tensor, its output, whose storage is the input's (written in place)."""
    torch = pytest.importorskip("torch")
    from syncbn import SyncBatchNormAct
    from syncbn.tools.memory import saved_tensors

    torch.manual_seed(0)
    fused = SyncBatchNormAct(8, "leaky_relu", memory.LEAKY_SLOPE)
    with torch.no_grad():
        fused.weight.uniform_(0.5, 2.0)
        fused.bias.uniform_(-1.0, 1.0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), fused)
    x = torch.randn(4, 3, 16, 16)
    expected = model(x).detach()
    bound = memory._output_only(model)
    assert type(bound[1]).__name__ == "OutputOnly" and memory._count_fused(bound) == 1
    with saved_tensors(ignore=[bound]) as saved:
        y = bound(x)
    torch.testing.assert_close(y.detach(), expected, atol=1e-5, rtol=1e-5)
    # the conv keeps x (its input), the stand-in its output: nothing else
    assert saved.storages == 2 and saved.bytes == x.numel() * 4 + y.numel() * 4
    y.backward(torch.ones_like(y))
    assert bound[0].weight.grad is not None


def cuda_counts_job(spec):
    import torch.distributed as dist

    from syncbn.bench import cuda_counts
    from workers import group_of

    group = group_of(2)
    return cuda_counts.layer_counts(spec, group) if dist.get_rank() < 2 else None


def cuda_counts_without_triton_job(spec):
    """The counts with ``SYNCBN_TRITON=0``'s switch off (read once at import, so set here)."""
    from syncbn.torch import stats

    before, stats._TRITON_ENABLED = stats._TRITON_ENABLED, False
    try:
        return cuda_counts_job(spec)
    finally:
        stats._TRITON_ENABLED = before


def nan_on_rank_one_job(spec):
    """``large_plane_errors`` on ranks 0 and 1 with a layer whose output is NaN on rank 1 only."""
    import torch.distributed as dist

    from syncbn.bench import numerics
    from syncbn.torch import batchnorm
    from workers import group_of

    group = group_of(2)
    if dist.get_rank() >= 2:
        return None
    real = batchnorm.SyncBatchNorm

    class NanOnRankOne(real):
        def forward(self, x):
            y = super().forward(x)
            return y * float("nan") if dist.get_rank() == 1 else y

    batchnorm.SyncBatchNorm = NanOnRankOne
    try:
        return numerics.large_plane_errors(spec, 2, group)
    finally:
        batchnorm.SyncBatchNorm = real


def test_large_planes_keep_a_nan_output_of_another_rank(pool):
    """The output error is the largest over the ranks, reduced with MAX: gloo's MAX drops a
    NaN that is not rank 0's, so a NaN output on rank 1 read as rank 0's small error."""
    rows = pool.run(nan_on_rank_one_job, {"shapes": [[1, 2, 4, 4]], "offsets": [1.0]})[0]
    assert len(rows) == 1 and rows[0]["syncbn_var"] < 1e-6
    assert not math.isfinite(rows[0]["syncbn_out"]), rows[0]


_COUNTS = {}


def _cuda_counts(pool):
    """The counts on 2 ranks whose Triton (when installed) interprets the kernels: a pool
    spawned with ``TRITON_INTERPRET=1`` (the session's pool may have imported Triton
    compiling), once per session."""
    if "report" not in _COUNTS:
        import importlib.util

        from triton_pool import interpreting_pool

        if importlib.util.find_spec("triton") is None:
            _COUNTS["report"] = pool.run(cuda_counts_job, _COUNT_SPEC)[0]
        else:
            interpreting = interpreting_pool(2)
            try:
                _COUNTS["report"] = interpreting.run(cuda_counts_job, _COUNT_SPEC)[0]
                _COUNTS["without_triton"] = interpreting.run(cuda_counts_without_triton_job, _ONE_SHAPE)[0]
            finally:
                interpreting.close()
    return _COUNTS["report"]


_COUNT_SPEC = {"shapes": [[2, 4, 6, 5]], "layouts": ["contiguous", "channels_last"]}
_ONE_SHAPE = {"shapes": [[2, 4, 6, 5]], "layouts": ["contiguous"]}


def test_cuda_path_counts_meet_the_bars(pool):
    """The CUDA path, counted on the CPU, for SyncBatchNorm and SyncBatchNormAct: forward 3
    activation-sized passes (read x for the statistics; read x, write y), backward 5 (read
    dy and x or y; read them again, write dx), no host synchronisation in a layer call,
    one collective each way. Counts, not times: the same on any machine."""
    rep = _cuda_counts(pool)
    acts = rep["syncbn_act"] + rep["syncbn_act_elu"]
    for row in rep["syncbn"] + (acts if rep["syncbn"][0]["path"] == "triton" else []):
        assert row["forward"]["passes"] == 3 and row["backward"]["passes"] == 5, row
        for way in ("forward", "backward"):
            assert row[way]["collectives"] == 1, row[way]
            assert row[way]["host_syncs"] == 0, row[way]
        # the one read is the layer fingerprint's verdicts, all of the step's at once when the
        # backward pass ends (syncbn.torch.fingerprint.check_agreement): per step, not per layer
        assert row["forward"]["per_step"]["launches"] == row["forward"]["per_step"]["host_syncs"] == 0
        assert row["backward"]["per_step"]["host_syncs"] == 1 and row["backward"]["per_step"]["passes"] == 0
        ops = [o["op"] for o in row["forward"]["ops"]] + [o["op"] for o in row["backward"]["ops"]]
        if row["path"] == "triton":
            assert [o for o in ops if o.startswith("syncbn::")] == [
                "syncbn::triton_moment_partials", "syncbn::triton_moment_payload", "syncbn::triton_merge",
                "syncbn::triton_normalize", "syncbn::triton_grad_partials", "syncbn::triton_grad_payload",
                "syncbn::triton_input_grad"], ops
        else:
            assert "aten::batch_norm_elemt" in ops and "aten::batch_norm_backward_elemt" in ops
            assert "aten::batch_norm_backward_reduce" in ops
    assert all(b["no_host_sync"] for b in rep["bars"].values()) or rep["syncbn"][0]["path"] != "triton"


def test_the_cuda_bar_names_the_path_it_counted():
    """Without Triton (or with SYNCBN_TRITON=0) the torch-op path is counted, and the bar said
    "Triton's kernels interpreted" all the same; it names the path, and the table shows every
    row the bar judges (the ELU rows were judged, not shown)."""
    call = {"passes": 3, "launches": 20, "host_syncs": 0, "collectives": 1,
            "per_step": {"passes": 0, "launches": 2, "host_syncs": 1}}
    row = {"shape": [2, 4, 6, 5], "layout": "contiguous", "path": "torch ops", "forward": call, "backward": call}
    rows = {key: [row] for key in ("syncbn", "syncbn_act", "syncbn_act_elu")}
    counts = {**rows, "torch_syncbn": cuda_counts.TORCH_SYNCBN, "batchnorm2d": cuda_counts.BATCHNORM2D,
              "bars": cuda_counts._bars(rows["syncbn"] + rows["syncbn_act"] + rows["syncbn_act_elu"])}
    bar = report._cuda_bar(counts)
    assert bar["passed"] is False and bar["figure"].startswith("path counted: torch ops;"), bar["figure"]
    assert "Triton's kernels interpreted where Triton is installed, else the torch-op path" in bar["bar"]
    table = report._cuda_count_rows({"cuda_counts": counts})
    assert [r[0].split(" (")[0] for r in table[:3]] == [
        "syncbn.SyncBatchNorm", "syncbn.SyncBatchNormAct", "syncbn.SyncBatchNormAct(elu)"], table


def test_cuda_path_launches_meet_the_bars(pool):
    """On the Triton kernels (the path CUDA tensors take where Triton is installed), per
    layer call of SyncBatchNorm and SyncBatchNormAct: forward at most 5 launches besides
    the collective (moments, payload, merge, normalize, and the module's
    num_batches_tracked += 1), backward at most 3 (sums, payload, input gradient); torch.nn.SyncBatchNorm
    launches 14 and 3 (read off its source)."""
    pytest.importorskip("triton")
    rep = _cuda_counts(pool)
    for row in rep["syncbn"] + rep["syncbn_act"] + rep["syncbn_act_elu"]:
        assert row["path"] == "triton", row["path"]
        for way in ("forward", "backward"):
            assert row[way]["launches"] <= cuda_counts.BARS[way]["launches"], row[way]
    assert all(b["launches_ok"] and b["passes_ok"] and b["no_host_sync"] for b in rep["bars"].values())


def test_cuda_counts_follow_the_triton_switch(pool):
    """With ``SYNCBN_TRITON=0`` CUDA tensors take the torch-op path, so that is what the
    counts describe (they counted the kernels regardless, while the user's layers ran the
    torch ops): every row says "torch ops", with its stand-ins for the CUDA kernels."""
    pytest.importorskip("triton")
    _cuda_counts(pool)
    rep = _COUNTS["without_triton"]
    for row in rep["syncbn"] + rep["syncbn_act"] + rep["syncbn_act_elu"]:
        assert row["path"] == "torch ops", row["path"]
        ops = [o["op"] for o in row["forward"]["ops"] + row["backward"]["ops"]]
        assert not any(op.startswith("syncbn::triton_") for op in ops), ops
    assert "aten::batch_norm_elemt" in [o["op"] for o in rep["syncbn"][0]["forward"]["ops"]]


@pytest.mark.parametrize("timeout", ["0", "-5", "nan", "inf", "1e400", "soon"])
def test_keras_multiworker_timeout_must_be_finite_and_positive(tmp_path, capsys, timeout):
    """--timeout 0, a negative number or NaN gave each worker the launcher's floor of 1 s and
    killed it (an error row for a Keras peer that never ran); inf waited forever on a stuck
    worker. Each is a usage error naming the option (exit 2) before any worker starts."""
    with pytest.raises(SystemExit) as info:
        keras_multiworker.main(["--plan", str(tmp_path / "plan.json"), "--out", str(tmp_path / "out.json"),
                                "--timeout", timeout])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "python -m syncbn.bench.keras_multiworker: error: argument --timeout: expected a finite positive " \
           "number, got " in err, err
    assert not (tmp_path / "out.json").exists()
