"""The GPU check's pieces that run without a GPU: its exit on a machine with none, the
emulated group of two, and the ratios of its summary. (The check itself runs on a GPU:
``scripts/gpu-check``; ``python -m syncbn.bench.gpu_check --device cpu`` is its dry run.)"""

import inspect
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import syncbn
from syncbn.torch import distributed
from syncbn.bench import gpu_check


def test_without_a_gpu_it_says_so_and_exits_0(tmp_path, capsys):
    if torch.cuda.is_available():
        return  # the check would run for real
    assert gpu_check.main(["--out", str(tmp_path / "out")]) == 0
    assert "no CUDA GPU" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


def test_a_misspelt_section_is_a_usage_error(tmp_path, capsys):
    """--sections timings (for timing) ran no section and exited 0 with an empty report: on
    a GPU machine, its time spent for nothing. The names are argparse choices now."""
    with pytest.raises(SystemExit) as info:
        gpu_check.main(["--sections", "timings", "--out", str(tmp_path / "out")])
    assert info.value.code == 2
    assert "argument --sections: invalid choice: 'timings'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    source = inspect.getsource(gpu_check.main)
    assert all(f'("{name}", {name}_job' in source for name in gpu_check.SECTIONS)  # every choice runs
    if not torch.cuda.is_available():
        assert gpu_check.main(["--sections", *gpu_check.SECTIONS, "--out", str(tmp_path / "out")]) == 0


@pytest.mark.parametrize("repeats", ["0", "-3", "many"])
def test_repeats_that_time_no_step_are_a_usage_error(tmp_path, capsys, repeats):
    """--repeats 0 (or fewer) timed no step: every timing section's median of nothing was a
    StatisticsError in the report, and the check exited 0. It is a usage error (exit 2,
    naming --repeats) before anything runs."""
    with pytest.raises(SystemExit) as info:
        gpu_check.main(["--repeats", repeats, "--sections", "timing", "--out", str(tmp_path / "out")])
    assert info.value.code == 2
    assert "argument --repeats: expected a positive integer" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_unusable_out_is_a_usage_error_before_any_work(tmp_path, capsys):
    """--out under a regular file: exit 2 with one line naming --out, before the GPU
    question (a machine without one would otherwise exit 0) and without making anything."""
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert gpu_check.main(["--out", str(blocker / "out")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: --out ") and "is not a folder" in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"] and blocker.read_text() == "not a folder"


def test_unusable_out_is_refused_before_torch_loads(tmp_path):
    """The --out check comes before torch is imported (a bad folder costs no torch start):
    in a process where importing torch fails, the usage error still comes out."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'torch':\n"
        "            raise ImportError('torch blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from syncbn.bench import gpu_check\n"
        "sys.exit(gpu_check.main(sys.argv[1:]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, "--out", str(blocker / "out")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("gpu-check: --out ") and proc.stderr.count("\n") == 1, proc.stderr[-2000:]


def test_no_communication_doubles_and_restores():
    """Inside the block every all-reduce doubles its tensor (a group of two ranks with
    the same data) and syncbn sees a group of two; after it, the real functions again."""
    saved = (distributed.all_reduce_sum, distributed.group_size, dist.all_reduce, dist.all_gather)
    t = torch.tensor([1.0, 2.5])
    with gpu_check._NoCommunication():
        assert distributed.group_size() == 2
        assert distributed.all_reduce_sum(t) is t
        dist.all_reduce(t)
        parts = [torch.zeros(2), torch.zeros(2)]
        dist.all_gather(parts, t)
    assert t.tolist() == [4.0, 10.0]
    assert all(p.tolist() == [4.0, 10.0] for p in parts)
    assert (distributed.all_reduce_sum, distributed.group_size, dist.all_reduce, dist.all_gather) == saved


def test_emulated_group_of_two_takes_the_synchronized_path():
    """With the same batch on both (emulated) ranks, the statistics are those of the batch
    twice: the same mean, the unbiased variance over 2n values, and one all-reduce
    each way (what the emulated timing measures is the synchronized path's work)."""
    x = torch.randn(3, 4, 5, 5, dtype=torch.float64, requires_grad=True)
    layer = syncbn.SyncBatchNorm(4, momentum=1.0).double()
    with gpu_check._NoCommunication() as emulation:
        layer(x).sum().backward()
    assert emulation.all_reduces == 2
    twice = torch.cat([x.detach(), x.detach()])
    torch.testing.assert_close(layer.running_mean, twice.mean((0, 2, 3)), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.running_var, twice.var((0, 2, 3)), rtol=1e-12, atol=1e-12)


def test_timing_summary_ratios():
    def row(shape, impl, world, ms, rest=None):
        r = {"shape": shape, "layout": "contiguous", "impl": impl, "world": world, "median_ms": ms}
        if rest is not None:
            r["minus_all_reduces_ms"] = rest
        return r

    rows = [
        row([2, 4, 3, 3], "syncbn.SyncBatchNorm", 2, 5.0, 3.0),
        row([2, 4, 3, 3], "torch.nn.BatchNorm2d", 2, 2.0),
        row([2, 4, 3, 3], "torch.nn.SyncBatchNorm", 2, 4.0),
        row([8, 4, 3, 3], "syncbn.SyncBatchNorm", 2, 9.0, 4.0),
        row([8, 4, 3, 3], "torch.nn.BatchNorm2d", 2, 1.0),
        row([8, 4, 3, 3], "torch.nn.SyncBatchNorm", 2, 10.0),
        {"shape": [8, 4, 3, 3], "layout": "contiguous", "impl": "syncbn.SyncBatchNormAct", "error": "x"},
    ]
    summary = gpu_check.timing_summary(rows)
    minus = summary["W2 syncbn minus all-reduces / BatchNorm2d"]
    assert (minus["median"], minus["worst"], minus["best"], minus["points"]) == (2.75, 4.0, 1.5, 2)
    against = summary["W2 syncbn / torch.nn.SyncBatchNorm"]
    assert (against["worst"], against["best"]) == (1.25, 0.9)
    assert summary["W1 syncbn / BatchNorm2d"] is None  # no such rows
    assert summary["W2 SyncBatchNormAct / torch.nn.SyncBatchNorm"] is None  # its row failed
