"""``syncbn soak`` in short (200 steps at W = 2, SyncBatchNorm and SyncBatchNormAct models
under DDP): resident memory grows by less than 10 MiB after the warm-up and the file
descriptors and threads stay as they were. The full run is ``syncbn soak`` (5,000 steps)."""

import pytest

from syncbn.tools.soak import process_figures, soak, soak_reset


def soak_on(pool, steps, every):
    """A soak at W = 2 on the pool (warm-up 50 steps, 10 MiB allowed), reset afterwards;
    returns its result and the lines it said."""
    lines = []
    try:
        result = soak(pool.run, 2, steps=steps, every=every, warmup=50, max_growth_mb=10, say=lines.append)
    finally:
        pool.run(soak_reset)
    return result, lines


def test_short_soak_stays_flat(pool):
    result, lines = soak_on(pool, steps=200, every=50)
    print("\n".join(lines))
    assert result["passed"], "\n".join(lines)
    assert [s[0]["step"] for s in result["samples"]] == [50, 100, 150, 200]
    assert len(result["samples"][0]) == 2


def test_process_figures_see_a_new_descriptor(tmp_path):
    before = process_figures()
    with open(tmp_path / "f", "w"):
        assert process_figures()["fds"] == before["fds"] + 1
    assert before["rss"] > 0 and before["threads"] >= 1


def test_a_run_that_ends_within_the_warm_up_fails(pool):
    """Nothing measured after the warm-up is no evidence: the verdict says so."""
    result, lines = soak_on(pool, steps=40, every=20)
    assert not result["passed"] and "no sample after the warm-up" in result["verdict"], "\n".join(lines)


def figures_from(rss_by_sample):
    """A stand-in for a pool's ``run`` that hands out each sample of ``rss_by_sample`` (one
    resident-memory figure in bytes per rank) in turn, with flat descriptors and threads."""
    samples = iter(rss_by_sample)
    step = [0]

    def run(fn, world, chunk):
        step[0] += chunk
        return [{"step": step[0], "rss": rss, "fds": 9, "threads": 3} for rss in next(samples)]

    return run


@pytest.mark.parametrize("growth, allowed, passed", [
    (0, 0.0, True), (2**20, 1.0, True), (2**20 + 1, 1.0, False), (1, 0.0, False)])
def test_growth_up_to_the_allowance_passes(growth, allowed, passed):
    """"Grows by more than --max-growth-mb" fails: growth equal to it passes (with
    --max-growth-mb 0, which the CLI accepts, a flat run passed no soak before)."""
    base = 100 * 2**20
    run = figures_from([[base, base], [base, base], [base, base + growth]])
    result = soak(run, 2, steps=30, every=10, warmup=10, max_growth_mb=allowed, say=lambda line: None)
    assert result["passed"] is passed, result["verdict"]


def test_memory_is_printed_in_the_unit_it_is_counted_in():
    """RSS and its growth are counted in 2**20 bytes (the allowance too): they were printed
    as MB, 4.9% off the megabyte the label named."""
    mib = 2**20
    run = figures_from([[100 * mib] * 2, [100 * mib] * 2, [100 * mib, 103 * mib]])
    lines = []
    result = soak(run, 2, steps=30, every=10, warmup=10, max_growth_mb=1.0, say=lines.append)
    assert "rank0 RSS MiB" in lines[1] and "MB" not in lines[1], lines[1]
    assert lines[-2].startswith("rank 1: RSS growth after step 10: +3.00 MiB (last +3.00 MiB)"), lines[-2]
    assert result["verdict"] == "FAIL: rank 1 grew 3.00 MiB", result["verdict"]


@pytest.mark.parametrize("error", ["raised", "timeout"])
def test_a_failed_rank_is_a_fail_line_not_a_traceback(error):
    """A rank that raises (or a chunk past the timeouts) ends the soak with a FAIL line
    naming the rank that failed first and its error, as ``syncbn verify`` shows it; the
    pool's error went up as a traceback."""
    from syncbn.tools.launch import WorkerError

    def run(fn, world, chunk):
        if error == "raised":
            raise WorkerError({1: (MemoryError("out"), "rank 1's traceback"), 0: (RuntimeError("peer"), "tb 0")})
        raise TimeoutError("rank(s) [0, 1] did not answer within 120 s")

    lines = []
    result = soak(run, 2, steps=30, every=10, warmup=10, max_growth_mb=1.0, say=lines.append)
    assert result["passed"] is False and lines[-1] == result["verdict"]
    if error == "raised":
        assert result["verdict"].startswith("FAIL: the distributed run failed on rank 1 first; rank(s) [0] failed "
                                             "after it. Rank 1's error:\nrank 1's traceback"), result["verdict"]
    else:
        assert result["verdict"].startswith("FAIL: rank(s) [0, 1] did not answer within 120 s"), result["verdict"]


def test_arguments_that_measure_nothing_are_usage_errors(capsys):
    from syncbn.cli import main

    assert main(["soak", "--steps", "300", "--warmup", "500"]) == 2
    assert "--steps (300) must be more than 500" in capsys.readouterr().err
    assert main(["soak", "--steps", "250", "--every", "250", "--warmup", "0"]) == 2
    assert main(["soak", "--steps", "0"]) == 2


@pytest.mark.parametrize("option, value, message", [
    ("--world-size", "1", "--world-size must be at least 2, got 1"),
    ("--every", "0", "--every must be at least 1, got 0"),
    ("--warmup", "-1", "--warmup must be 0 or more, got -1"),
    ("--max-growth-mb", "nan", "--max-growth-mb must be a finite number >= 0, got nan"),
    ("--timeout", "0", "--timeout must be a finite positive number, got 0.0"),
    ("--timeout", "inf", "--timeout must be a finite positive number, got inf"),
    ("--timeout", "nan", "--timeout must be a finite positive number, got nan"),
    # finite, but past torch's deadlines: the ranks died in an OverflowError traceback (and hung at 9e9,
    # not tested here: undone, the check would leave the test hanging)
    ("--timeout", "1e300", "--timeout must be at most 1e9 seconds (about 31 years), got 1e+300"),
])
def test_a_bad_option_is_named(option, value, message, capsys):
    """One sentence listed every rule whichever option broke one (and a NaN --max-growth-mb,
    which no growth exceeds, passed every run); the message names the option and its value."""
    from syncbn.cli import main

    assert main(["soak", option, value]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("must") == 1, err
