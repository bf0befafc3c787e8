"""``syncbn demo``: the command end to end (as a user runs it) and its pieces.

The end-to-end tests start the command as a subprocess with a deadline, in a new
session, and kill that session if the deadline passes, so a stuck worker can never
hang the suite. They check the figures written to results.json, never timings.
"""

import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import doc_blocks
from demo_checks import DEADLINE_S, check_report, run_command, start_together
from syncbn import cli, demo
from syncbn.demo import keras as demo_keras, report as demo_report, torch as demo_torch
from syncbn.tools.usage import UsageError

NO_FLAX = importlib.util.find_spec("flax") is None
NO_FLAX_OR_KERAS = NO_FLAX or importlib.util.find_spec("keras") is None

OPTIONS = (
    "--world-size", "--batch-per-rank", "--steps", "--backend", "--device", "--out", "--seed",
    "--quick", "--lr", "--image-size", "--background-weight", "--width", "--train-size",
    "--val-size", "--eval-every", "--progress", "--framework",
)


# The quick demo spawned on this machine (4 ranks) is README's `scripts/demo --quick`, run as
# written and its report checked by tests/test_readme.py (run_development): one run serves both.


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not installed")
def test_quick_demo_under_torchrun(tmp_path):
    out_dir = tmp_path / "demo"
    # through the wrapper that checks that each rank's process group really ended
    (tmp_path / "_ended.py").write_text(doc_blocks.torchrun_wrapper())
    out, err = run_command(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "_ended.py", "-m", "syncbn", "demo", "--quick", "--out", str(out_dir)],
        tmp_path,
    )
    check_report(out_dir, 2, "torchrun")
    assert out.count("syncbn matches the big batch") == 1  # rank 0 alone reports


# the command as a user runs it, in a process where torch, TensorFlow and Keras cannot be imported
NO_TORCH_NO_TF = """
import sys
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "tensorflow", "keras"):
            raise ImportError(f"import of {name!r} blocked: the Flax demo must run without it")
sys.meta_path.insert(0, Blocker())
from syncbn.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.skipif(NO_FLAX, reason="needs flax")
def test_short_flax_demo_without_torch_or_tensorflow(started):
    tmp_path, command = started["test_short_flax_demo_without_torch_or_tensorflow"]
    out, err = command.finish()
    out_dir = tmp_path / "demo"
    report = check_report(out_dir, 4, "pmap")
    assert report["framework"] == "flax" and report["devices"] == [f"cpu:{i}" for i in range(4)]
    assert report["model"]["batchnorm_layers"] == 14
    assert "syncbn matches the big batch" in out
    for title in ("per-device BN, pmap", "syncbn, pmap", "one device, batch 8"):
        assert title in out


SAME_START = """
import os
os.environ["KERAS_BACKEND"] = "jax"
import numpy as np
from syncbn.demo.flax_models import TinyUNet, init_variables
from syncbn.demo.keras_models import tiny_unet
flax_model = TinyUNet(width=8)
variables = init_variables(flax_model, 5, 16)
keras_model = tiny_unet(5, 16, width=8)
convs = [layer for layer in keras_model.layers if hasattr(layer, "kernel")]
assert len(convs) == len(variables["params"]) - len(variables["batch_stats"]) == 15
for layer in convs:
    for name, value in (("kernel", layer.kernel), ("bias", getattr(layer, "bias", None))):
        if value is not None:
            assert np.array_equal(np.asarray(value.value), variables["params"][layer.name][name]), layer.name
x = np.random.default_rng(1).random((2, 16, 16, 1)).astype("float32")
ours = np.asarray(flax_model.apply(variables, x, train=False))
theirs = np.asarray(keras_model(x, training=False))
print(float(np.max(np.abs(ours - theirs))), float(np.max(np.abs(theirs))))
"""


# The Flax demo and the twins' check are independent processes of about one core each:
# both start when the first test needs one, so on 2 cores they run side by side.
COMMANDS = {
    # a few steps: each run compiles its own step; 12 are enough to separate the runs by far
    "test_short_flax_demo_without_torch_or_tensorflow": (
        NO_FLAX, lambda tmp: [sys.executable, "-c", NO_TORCH_NO_TF, "demo", "--framework", "flax", "--quick",
                              "--steps", "12", "--eval-every", "6", "--out", str(tmp / "demo")], None, DEADLINE_S),
    "test_flax_twin_starts_from_the_keras_twins_weights": (
        NO_FLAX_OR_KERAS, lambda tmp: [sys.executable, "-c", SAME_START], None, 300),
}


@pytest.fixture(scope="module")
def started(request, tmp_path_factory):
    yield from start_together(request, tmp_path_factory, COMMANDS)


@pytest.mark.skipif(NO_FLAX_OR_KERAS, reason="needs flax and keras")
def test_flax_twin_starts_from_the_keras_twins_weights(started):
    out, _ = started["test_flax_twin_starts_from_the_keras_twins_weights"][1].finish()
    gap, scale = map(float, out.split())
    # the same float32 weights through the same XLA convolutions (0.0 apart, measured): only
    # how the BN / resize arithmetic is written may differ, a few roundings of 6e-8 relative per
    # layer over 15 conv + 14 BN layers, ~1e-7 of the output's scale even if amplified tenfold;
    # 2e-6 leaves a wide margin and still sees nearest for bilinear up-sampling (1.9e-5)
    assert np.isfinite(gap) and np.isfinite(scale) and scale > 0
    assert gap <= 2e-6 * scale, (gap, scale)


def test_help_documents_every_option(tmp_path):
    out, _ = run_command([sys.executable, "-m", "syncbn", "demo", "--help"], tmp_path, timeout=300)
    for option in OPTIONS:
        assert option in out, option
    top, _ = run_command([sys.executable, "-m", "syncbn", "--help"], tmp_path, timeout=300)
    assert "demo" in top


# --------------------------------------------------------------------- the pieces


def parse(*argv):
    return demo.config_from_args(cli.build_parser("demo").parse_args(["demo", *argv]))


def test_config_defaults_quick_and_explicit_options():
    config = parse()
    assert (config.world_size, config.batch_per_rank, config.backend, config.device) == (4, 2, "gloo", "cpu")
    quick = parse("--quick")
    assert quick.quick and quick.steps == demo.QUICK["steps"] < config.steps
    mixed = parse("--quick", "--steps", "7", "--world-size", "3", "--seed", "9")
    assert (mixed.steps, mixed.world_size, mixed.seed, mixed.val_size) == (7, 3, 9, demo.QUICK["val_size"])
    assert parse("--device", "cuda").backend == "nccl"
    assert parse("--device", "cuda", "--backend", "gloo").backend == "gloo"


def test_keras_config_and_backends():
    config = parse("--framework", "keras", "--quick")
    assert (config.framework, config.backend, config.device) == ("keras", "tensorflow", "auto")
    assert parse("--framework", "keras", "--backend", "jax").backend == "jax"
    assert parse("--framework", "keras", "--device", "cpu").device == "cpu"
    with pytest.raises(UsageError, match="Keras backend"):
        parse("--backend", "jax")
    with pytest.raises(UsageError, match="torch.distributed backend"):
        parse("--framework", "keras", "--backend", "gloo")


def test_flax_config():
    config = parse("--framework", "flax", "--quick")
    assert (config.framework, config.backend, config.device) == ("flax", "jax", "auto")
    assert parse("--framework", "flax", "--backend", "jax").backend == "jax"
    with pytest.raises(UsageError, match="runs on JAX"):
        parse("--framework", "flax", "--backend", "tensorflow")


def test_restarted_process_gets_the_same_config():
    for argv in ((), ("--framework", "flax", "--steps", "5", "--world-size", "2"), ("--framework", "keras", "--quick", "--steps", "5", "--no-progress"),
                 ("--framework", "keras", "--backend", "jax", "--device", "cpu", "--seed", "3")):
        config = parse(*argv)
        assert parse(*demo.to_argv(config)) == config, argv


def test_nccl_needs_cuda(capsys):
    assert cli.main(["demo", "--backend", "nccl", "--device", "cpu"]) == 2
    assert "--backend nccl needs --device cuda" in capsys.readouterr().err


CUDA_ON_JAX = """
import sys
import jax
try:
    jax.devices("gpu")
    print("this machine has a GPU for JAX")
    sys.exit(0)
except RuntimeError:
    pass
from syncbn.demo.config import DemoConfig
from syncbn.demo.keras import _jax_devices
try:
    devices = _jax_devices(DemoConfig(framework="flax", device="cuda", world_size=1))
except SystemExit as refused:
    print("refused:", refused)
else:
    print("ran on", devices)
"""


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="needs jax")
def test_cuda_on_jax_without_a_gpu_is_refused_not_run_on_the_cpu():
    """``--device cuda`` for the Flax and Keras-on-JAX demos: ``jax.devices()`` falls back to
    the CPU where there is no GPU, so one replica ran there in silence, and more were
    refused as "JAX sees 1" (the CPU counted as a GPU). One replica is one (it said "1 replicas
    on GPUs need 1 GPUs")."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    proc = subprocess.run([sys.executable, "-c", CUDA_ON_JAX], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    if "has a GPU" in proc.stdout:
        pytest.skip("JAX sees a GPU here")
    assert proc.stdout.startswith("refused: syncbn demo: --device cuda: 1 replica on GPUs needs 1 GPU, JAX sees 0"), \
        proc.stdout


def test_an_output_folder_that_cannot_be_made_is_refused_before_training(tmp_path, monkeypatch, capsys):
    """--out under a file (or anywhere the folder cannot be made) trained every run for
    minutes, then ended in a FileNotFoundError traceback from the report writer; it is now
    refused first, naming the option and the reason, and the check leaves no trace."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setattr(demo_torch, "run", lambda *a, **k: pytest.fail("training started"))
    assert cli.main(["demo", "--quick", "--out", str(blocker / "out")]) == 2
    assert f"--out {blocker / 'out'}: {blocker} is not a folder" in capsys.readouterr().err
    assert cli.main(["demo", "--quick", "--out", str(blocker)]) == 2
    assert "exists and is not a folder" in capsys.readouterr().err
    good = tmp_path / "new" / "report"
    demo.check(demo.config_from_args(cli.build_parser("demo").parse_args(["demo", "--out", str(good)])))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # nothing made, nothing left


@pytest.mark.parametrize("seed", [-1, 2**64])
def test_a_seed_the_generators_refuse_is_a_usage_error(seed, monkeypatch, capsys):
    """numpy's generators refuse a negative seed and torch's one of 2**64 or more: the
    workers' ValueError tracebacks ended the demo with exit 1 (after starting them)."""
    monkeypatch.setattr(demo_torch, "run", lambda *a, **k: pytest.fail("training started"))
    assert cli.main(["demo", "--quick", "--seed", str(seed)]) == 2
    assert f"syncbn demo: --seed must be an integer from 0 to 2**64 - 1, got {seed}" in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--world-size", "--steps", "--batch-per-rank"])
def test_a_count_that_is_not_an_integer_is_named(option, capsys):
    """argparse named the converter ('invalid _positive value') instead of what was expected."""
    with pytest.raises(SystemExit):
        cli.main(["demo", option, "two"])
    err = capsys.readouterr().err
    assert f"argument {option}: expected a positive integer, got 'two'" in err, err
    assert "_positive" not in err


def test_cli_without_a_command_prints_help(capsys):
    assert cli.main([]) == 2
    assert "demo" in capsys.readouterr().out


def test_global_batches_are_seeded_epochs():
    a = demo_report.global_batches(10, 7, 4, seed=1)
    assert a.shape == (7, 4)
    np.testing.assert_array_equal(a, demo_report.global_batches(10, 7, 4, seed=1))
    flat = a.ravel()
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))
    assert not np.array_equal(a, demo_report.global_batches(10, 7, 4, seed=2))


def test_mean_of_rank_losses_is_the_big_batch_loss():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 11, 6, 6, generator=gen, dtype=torch.float64)
    masks = torch.randint(0, 11, (8, 6, 6), generator=gen)
    weight = torch.rand(11, generator=gen, dtype=torch.float64) + 0.1
    big = demo_torch.per_image_loss(logits, masks, weight).mean()
    ranks = [demo_torch.per_image_loss(logits[r * 2 : r * 2 + 2], masks[r * 2 : r * 2 + 2], weight).mean() for r in range(4)]
    # float64: the mean of 4 means of 2 vs one mean of 8, a handful of roundings of 2^-53 (1.1e-16)
    # relative each; bound 1e-14 (about 90 of them)
    torch.testing.assert_close(torch.stack(ranks).mean(), big, rtol=1e-14, atol=0)


def test_learning_rate_decays_from_the_peak():
    rates = [demo_report.learning_rate(0.1, 10, s) for s in range(1, 11)]
    assert rates[0] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(rates, rates[1:])) and rates[-1] > 0


def test_relative_difference():
    ref = {"a": np.array([3.0, 4.0], np.float32), "b": np.array([1.0, 0.0], np.float32)}
    same = {k: v.copy() for k, v in ref.items()}
    assert demo_report.relative_difference(same, ref)[0] == 0.0
    moved = {"a": np.array([3.0, 4.5], np.float32), "b": np.array([1.0, 0.0], np.float32)}
    value, name = demo_report.relative_difference(moved, ref)
    assert name == "a" and value == pytest.approx(0.1)
    broken = {"a": np.array([3.0, np.nan], np.float32), "b": ref["b"]}
    assert demo_report.relative_difference(broken, ref) == (np.inf, "a")


def test_predictions_come_in_chunks_in_order():
    images = np.arange(130 * 2, dtype=np.float32).reshape(130, 2)
    sizes = []

    def classes(batch):
        sizes.append(len(batch))
        return batch[:, 0].astype(np.int64)  # each image's first value: order is visible

    got = demo_report.in_chunks(classes, images)
    assert sizes == [64, 64, 2]
    np.testing.assert_array_equal(got, images[:, 0].astype(np.int64))


def test_eval_steps_end_at_the_last_step():
    assert demo.DemoConfig(steps=10, eval_every=4).eval_steps() == [0, 4, 8, 10]


def test_torch_demo_imports_no_keras_framework(tmp_path):
    code = ("import sys, syncbn.demo, syncbn.demo.torch, syncbn.demo.report; "
            "print(sorted(m for m in ('tensorflow', 'keras', 'jax') if m in sys.modules))")
    out, _ = run_command([sys.executable, "-c", code], tmp_path, timeout=300)
    assert out.strip() == "[]"


def _record(title, shift, steps=2):
    snap = {"w": np.array([1.0 + shift, 2.0], np.float32)}
    return demo_report.RunRecord(title, losses=[1.0, 0.5], miou={0: 0.1, steps: 0.2},
                                 snapshots={0: snap, steps: snap}, buffers=dict(snap),
                                 class_iou=[0.2] * 11, predictions=np.zeros((1, 4, 4), np.uint8))


@pytest.mark.parametrize("sync_shift, per_rank_shift, matches, separated", [
    (1e-4, 1.0, True, True),      # the bars met: 4.5e-5 < 1e-3, 10^4 x further
    (1e-4, 5e-3, True, False),    # per-rank BN only 50x further away
    (1e-2, 1.0, False, True),     # syncbn above the 1e-3 bar
    (np.nan, 1.0, False, False),  # a NaN never passes
])
def test_the_bars_are_printed(sync_shift, per_rank_shift, matches, separated):
    config = demo.DemoConfig(steps=2, samples=1)
    records = {"per_rank_bn": _record("per-replica BN, somewhere", per_rank_shift),
               "syncbn": _record("syncbn, somewhere", sync_shift), "big_batch": _record("one replica", 0.0)}
    samples = {"images": np.zeros((1, 1, 4, 4), np.float32), "truth": np.zeros((1, 4, 4), np.int64)}
    report = demo_report.summarize(config, "a test", "none", records, samples, {"model": {"batchnorm_layers": 1}})
    assert (report["syncbn_matches_big_batch"], report["per_rank_bn_further_away"]) == (matches, separated)
    table = demo_report.format_table(report)
    assert ("syncbn matches the big batch" in table) == matches
    assert ("WARNING: syncbn is" in table) == (not matches)
    assert ("less than the 100x bar" in table) == (not separated)


@pytest.mark.parametrize("title, unit", [("per-rank BN under DDP", "rank"), ("per-replica BN, MirroredStrategy", "replica"),
                                         ("per-device BN, pmap", "device")])
def test_one_rank_has_no_separation_bar(tmp_path, capsys, title, unit):
    """With one rank, per-rank BN normalizes the whole global batch like the big batch, so it
    cannot be 100x further away: syncbn demo --framework flax --world-size 1 --quick printed
    "per-device BN is 0x further away (0.0e+00), WARNING: less than the 100x bar". The table
    says why there is no separation instead, and results.json has null for it."""
    config = demo.DemoConfig(world_size=1, steps=2, samples=1, out=str(tmp_path))
    records = {"per_rank_bn": _record(title, 0.0), "syncbn": _record("syncbn, somewhere", 2e-6),
               "big_batch": _record("one process", 0.0)}
    samples = {"images": np.zeros((1, 1, 4, 4), np.float32), "truth": np.zeros((1, 4, 4), np.int64)}
    report = demo_report.summarize(config, "a test", "none", records, samples, {"model": {"batchnorm_layers": 1}})
    assert report["syncbn_matches_big_batch"] is True and report["per_rank_bn_further_away"] is None
    demo_report.write_report(report, str(tmp_path))
    table = capsys.readouterr().out
    assert "WARNING" not in table and "further away" not in table, table
    assert (f"; with one {unit}, per-{unit} BN normalizes the whole global batch too (0.0e+00 away), so the runs "
            f"cannot separate: the 100x bar needs 2 or more {unit}s (--world-size).") in table, table
    with open(tmp_path / "results.json") as fh:
        assert json.load(fh)["per_rank_bn_further_away"] is None


@pytest.mark.parametrize("world, batch, steps, words", [
    (1, 1, 1, ("1 worker process (", "1 rank x 1 image = global batch 1, 1 step,")),
    (2, 2, 2, ("2 worker processes (", "2 ranks x 2 images = global batch 4, 2 steps,")),
])
def test_counts_are_plural_unless_one(monkeypatch, capsys, world, batch, steps, words):
    """The spawned demo printed "starting 1 worker processes" and its report "1 ranks x 1
    images", "1 steps"; the counts of its lines and of results.json agree with their number."""
    config = demo.DemoConfig(world_size=world, batch_per_rank=batch, steps=steps, samples=1)

    class Started(Exception):
        pass

    def pool(*args, **kwargs):  # the line is printed before the pool starts: stop there
        raise Started

    monkeypatch.setattr(demo_torch, "WorkerPool", pool)
    with pytest.raises(Started):
        demo_torch._run_spawned(config)
    assert f"syncbn demo: starting {words[0]}gloo, cpu)" in capsys.readouterr().out
    records = {"per_rank_bn": _record("per-rank BN under DDP", 1.0, steps), "syncbn": _record("syncbn", 0.0, steps),
               "big_batch": _record("one process", 0.0, steps)}
    report = demo_torch._summarize(config, "spawned", records, np.zeros((1, 1, 4, 4), np.float32),
                                   np.zeros((1, 4, 4), np.int64))
    assert report["setup"].startswith(words[1]), report["setup"]
    assert f"over {steps} step{'s' if steps > 1 else ''}, " in report["optimizer"], report["optimizer"]
    done = demo_report.run_done_line(1, records["syncbn"], steps)
    assert done.startswith(f"[1/3] syncbn: {steps} step{'s' if steps > 1 else ''} in "), done
    for unit in ("rank", "replica", "device"):  # the Keras and Flax demos' first line and setup
        assert demo_report.batch_words(config, unit) == (f"1 {unit} x 1 image" if world == 1 else
                                                          f"2 {unit}s x 2 images")
    assert demo_keras._replicas_need(world, "GPU", " on GPUs") == (
        "1 replica on GPUs needs 1 GPU" if world == 1 else "2 replicas on GPUs need 2 GPUs")


def test_figures_that_are_not_finite_are_written_as_null(tmp_path, capsys):
    # a class absent from a small validation set has a NaN IoU (--val-size 4), a diverged run
    # a NaN loss and an infinite distance to the big batch (--lr 1e6): results.json, written
    # with allow_nan=False, raised ValueError after every run had trained
    config = demo.DemoConfig(steps=2, samples=1, out=str(tmp_path))
    records = {"per_rank_bn": _record("per-rank BN", 1.0), "syncbn": _record("syncbn", np.inf),
               "big_batch": _record("one process", 0.0)}
    records["per_rank_bn"].class_iou = [0.5] + [np.nan] * 10
    records["syncbn"].losses = [1.0, float("nan")]
    samples = {"images": np.zeros((1, 1, 4, 4), np.float32), "truth": np.zeros((1, 4, 4), np.int64)}
    report = demo_report.summarize(config, "a test", "none", records, samples, {"model": {"batchnorm_layers": 1}})
    demo_report.write_report(report, str(tmp_path))

    def refuse(word):
        raise AssertionError(f"results.json holds {word}, which is not JSON")

    with open(tmp_path / "results.json") as fh:
        written = json.load(fh, parse_constant=refuse)
    assert written["runs"]["per_rank_bn"]["val_class_iou"]["background"] == 0.5
    assert written["runs"]["per_rank_bn"]["val_class_iou"]["9"] is None
    assert written["runs"]["syncbn"]["final_loss"] is None
    assert written["syncbn_vs_big_batch"] is None
    assert written["syncbn_matches_big_batch"] is False
    assert "WARNING: syncbn is inf away" in capsys.readouterr().out


def test_results_say_which_run_wrote_them(tmp_path, capsys):
    # results.json said "command": "syncbn demo" whatever the options and carried no date, so
    # a file left in --out could not be told from another run's; now it holds the options that
    # repeat the run and the time it was written
    config = demo.config_from_args(cli.build_parser("demo").parse_args(
        ["demo", "--framework", "flax", "--quick", "--steps", "2", "--out", str(tmp_path / "a b")]))
    records = {"per_rank_bn": _record("per-device BN", 1.0), "syncbn": _record("syncbn", 0.0),
               "big_batch": _record("one device", 0.0)}
    samples = {"images": np.zeros((1, 1, 4, 4), np.float32), "truth": np.zeros((1, 4, 4), np.int64)}
    report = demo_report.summarize(config, "a test", "none", records, samples, {"model": {"batchnorm_layers": 1}})
    demo_report.write_report(report, config.out)
    with open(tmp_path / "a b" / "results.json") as fh:
        written = json.load(fh)
    words = shlex.split(written["command"])
    assert words[:2] == ["syncbn", "demo"], words
    again = demo.config_from_args(cli.build_parser("demo").parse_args(words[1:]))
    assert again == config
    assert time.strptime(written["date"], "%Y-%m-%d %H:%M:%S UTC")
