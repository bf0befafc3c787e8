"""``SyncBatchNormalization`` on the Keras PyTorch backend: two gloo processes on
127.0.0.1 against the float64 oracle, and plain BN when not distributed."""

import importlib.util
import json
import tempfile
from pathlib import Path

import numpy as np
import pytest

import keras_harness as harness
import keras_oracle as oracle
from keras_torch_worker import CASES

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")

TIMEOUT = 240


@pytest.fixture(scope="module")
def run():
    with tempfile.TemporaryDirectory() as tmp:
        port, = harness.free_ports(1)
        procs = []
        for rank in range(2):
            env = harness.worker_env("torch", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=2, RANK=rank)
            procs.append(harness.start("keras_torch_worker.py", ["--rank", rank, "--out", tmp], env))
        outputs = harness.finish(procs, TIMEOUT)
        for code, output in outputs:
            assert code == 0, f"worker exited with {code}:\n{output[-6000:]}"
        yield Path(tmp)


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_match_oracle(run, case):
    sizes, tail, axis, masked, kwargs = CASES[case]
    parts = [dict(np.load(run / f"{case}-{r}.npz")) for r in range(2)]
    w = {k[len("initial_"):]: v for k, v in parts[0].items() if k.startswith("initial_")}
    renorm = None
    if kwargs.get("renorm"):
        renorm = dict(renorm_mean=w["renorm_mean"], renorm_std=w["renorm_stddev"], moving_std=w["moving_stddev"],
                      renorm_momentum=kwargs["renorm_momentum"], **kwargs["renorm_clipping"])
    ref = oracle.batch_norm(
        [p["x"] for p in parts], [p["dy"] for p in parts], axis=axis, gamma=w["gamma"], beta=w["beta"],
        momentum=0.9, moving_mean=w["moving_mean"], moving_var=w["moving_variance"],
        masks=[p["mask"] for p in parts] if masked else None, renorm=renorm,
    )
    for r, part in enumerate(parts):
        np.testing.assert_allclose(part["y"], ref["y"][r], rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(part["dx"], ref["dx"][r], rtol=2e-5, atol=2e-5)
        for key, name in (("moving_mean", "moving_mean"), ("moving_var", "moving_variance"),
                          ("renorm_mean", "renorm_mean"), ("renorm_std", "renorm_stddev")):
            if key in ref:
                np.testing.assert_allclose(part[f"final_{name}"], ref[key], rtol=1e-5, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(parts[0]["dgamma"] + parts[1]["dgamma"], ref["dgamma"], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(parts[0]["dbeta"] + parts[1]["dbeta"], ref["dbeta"], rtol=2e-5, atol=2e-5)


def test_one_all_reduce_each_way_and_local_numerics(run):
    for rank in range(2):
        info = json.loads((run / f"info-{rank}.json").read_text())
        for case, (sizes, tail, axis, *_rest) in CASES.items():
            channels = ((None,) + tail)[axis]
            assert info[f"{case}_all_reduce_calls"] == {"forward": [2 * channels + 1], "backward": [2 * channels]}
        print(f"rank {rank}:", json.dumps(info))


def test_too_few_values_raise_on_both_ranks(run):
    """One value per channel in training raises ValueError on every rank (after the
    forward all-reduce, before the backward one); two values train. A rank whose own
    batch has more than one value per channel never reads the count on the host."""
    for rank in range(2):
        info = json.loads((run / f"info-{rank}.json").read_text())
        local = info["local_too_few"]
        for case in ("batch 1", "mask keeps 1"):
            assert f"{local['layer']}: expected more than 1 value per channel when training, got 1 value(s)" \
                in local[case], (case, local[case])
        too_few = info["too_few"]
        error = f"{too_few['layer']}: expected more than 1 value per channel when training, got 1 value(s)"
        assert error in too_few["(1, 0)"]["outcome"], too_few
        assert too_few["(1, 0)"]["all_reduce"] == [7], too_few
        assert too_few["(1, 1)"]["outcome"] == "trained" and too_few["(1, 1)"]["all_reduce"] == [7, 6], too_few
        assert too_few["(5, 0)"]["outcome"] == "trained", too_few
        assert too_few["(5, 0)"]["host_reads"] == (0 if rank == 0 else 1), too_few
        print(f"rank {rank}:", json.dumps(too_few))
