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

from syncbn.core.fingerprint import SIZE as FINGERPRINT

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")

TIMEOUT = 240


@pytest.fixture(scope="module")
def run():
    with tempfile.TemporaryDirectory() as tmp:
        port, = harness.free_ports(1)
        procs = []
        for rank in range(2):
            env = harness.worker_env("torch", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=2, RANK=rank)
            procs.append(harness.start("keras/keras_torch_worker.py", ["--rank", rank, "--out", tmp], env))
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
    """One all-reduce forward (2C + 1 values; 3C when a mask gives each channel its own
    count, channels not last) and one backward (2C values), each with the 18-value
    layer fingerprint."""
    for rank in range(2):
        info = json.loads((run / f"info-{rank}.json").read_text())
        for case, (sizes, tail, axis, masked, _kwargs) in CASES.items():
            channels = ((None,) + tail)[axis]
            forward = 3 * channels if masked and axis != -1 else 2 * channels + 1
            assert info[f"{case}_all_reduce_calls"] == {"forward": [forward + FINGERPRINT],
                                                         "backward": [2 * channels + FINGERPRINT]}, case
        print(f"rank {rank}:", json.dumps(info))


def test_second_order_gradients_raise_on_both_ranks(run):
    """create_graph=True through the synchronized layer raises a clear RuntimeError on
    every rank (the cross-rank sums are not differentiable), never a silently wrong
    second-order gradient; plain backward still works, and nothing is read on the host."""
    for rank in range(2):
        result = json.loads((run / f"info-{rank}.json").read_text())["second_order"]
        assert "higher-order gradients" in result["create_graph"] and "create_graph=True" in result["create_graph"], \
            result
        assert result["create_graph_all_reduce"] == [7 + FINGERPRINT], result
        assert result["plain"] == {"all_reduce": [7 + FINGERPRINT, 6 + FINGERPRINT], "finite": True}, result
        assert result["host_reads"] == 0, result


def test_swapped_layers_raise_on_both_ranks(run):
    """The layer fingerprint on the torch backend: two layers of one width called in the
    other order on rank 1 raise the same LayerMismatchError on both ranks."""
    for rank in range(2):
        result = json.loads((run / f"info-{rank}.json").read_text())["mismatch"]
        assert "rank 0 called layer 'first' (3 features), call 0 of the step" in result["error"], result
        assert "rank 1 called layer 'second' (3 features), call 0 of the step" in result["error"], result
        assert result["moved"] == [False, False], result


def test_a_call_recorded_on_one_rank_only_raises_on_both(run):
    """A training call under torch.no_grad on one rank beside a recorded one: the same
    LayerMismatchError on both ranks at that call (the torch layers' fingerprint says
    this too), the moving statistics unmoved; no backward left waiting."""
    for rank in range(2):
        result = json.loads((run / f"info-{rank}.json").read_text())["graph_mismatch"]
        assert "records it for a backward pass" in result["error"] and "'graphed'" in result["error"], result
        assert result["moved"] is False, result


def test_convert_keeps_torch_modes(run):
    """A layer put in eval mode (torch's module mode) is in eval mode in the copy, and in
    the reverted copy; no warning names ``training`` or a NaN attribute the copy has alike."""
    result = json.loads((run / "info-0.json").read_text())["convert_modes"]
    assert result["original"]["bn"] == [False] * len(result["original"]["bn"]), result
    for step in ("convert", "revert"):
        assert result[step] == result["original"], (step, result)
    assert result["warnings"] == [], result["warnings"]


def test_convert_keeps_torch_modes_where_the_copy_differs(run):
    """A layer whose copy from its config has other sub-layers than it: each sub-layer
    with a counterpart keeps its torch mode (one in eval mode in a model in train mode,
    one back in train mode in a layer in eval mode), and the copy's sub-layer without one
    (``tail``'s Dropout) takes its owner's mode; converted and reverted."""
    result = json.loads((run / "info-0.json").read_text())["convert_modes_where_the_copy_differs"]
    model, alone = result["model"], result["alone"]
    # not vacuous: the modes set differ from their owners', the copies' trees from the originals'
    assert model["original"]["block"]["bn"] is False and model["original"]["root"] is True, result
    assert model["original"]["tail"]["self"] is False and model["original"]["tail"]["dense"] is True, result
    assert alone["original"]["alone"]["self"] is False and alone["original"]["alone"]["bn"] is True, result
    for step in ("convert", "revert"):
        for label, names in (("model", ("block", "tail")), ("alone", ("alone",))):
            got, want = result[label][step], result[label]["original"]
            assert got["root"] == want["root"], (label, step, result)
            for name in names:
                if name == "tail":
                    assert "drop" not in want[name] and got[name].pop("drop", "none") == want[name]["self"], (
                        label, step, result)
                else:
                    assert "drop" in want[name] and "drop" not in got[name], (label, step, result)
                    want = {**want, name: {k: v for k, v in want[name].items() if k != "drop"}}
                assert got[name] == want[name], (label, name, step, result)


def _wrapper_result(run):
    return json.loads((run / "info-0.json").read_text())["convert_torch_module_wrapper"]


def test_convert_copies_a_torch_module_wrapper_whose_modules_are_in_eval_mode(run):
    """A custom layer holding a TorchModuleWrapper whose wrapped torch module has a
    sub-module in eval mode (a Dropout, a BatchNorm1d), or is all in eval mode, and a
    Functional model of such layers in a mixed state, are copied: the config's pickled
    module carries the torch modes, which are no configuration. Every layer of the copy,
    and every torch module its wrappers hold, is in the original's mode; the weights and
    the wrapped modules' buffers (running statistics) are the original's."""
    result = _wrapper_result(run)["modes"]
    assert set(result) == {"dropout eval", "batchnorm eval", "all eval", "mixed model"}, result
    for label, entry in result.items():
        assert "error" not in entry, (label, entry.get("error"))
        wrapped = [mode for _, held in entry["original"] if held for _, mode in held]
        assert False in wrapped, (label, entry["original"])  # not vacuous: a wrapped module in eval mode
        if label == "mixed model":
            assert entry["original"][0][0] is False and True in wrapped, entry["original"]
        for step in ("convert", "revert"):
            assert entry[step] == entry["original"], (label, step, entry)
            assert entry["state"][step] is True, (label, step)


def test_convert_of_a_torch_module_wrapper_computes_as_the_original(run):
    """The copies of those layers give the original's outputs in inference and training
    calls (one seed for the Dropouts), and their training calls move the wrapped
    BatchNorm1d's running statistics exactly as the original's do. The reverted copy has
    Keras's BatchNormalization, computing exactly as the original: equal to the bit. The
    converted one has SyncBatchNormalization, which (not distributed) computes the same
    float32 batch statistics over n = 6 rows in another order: each statistic within a few
    n * 2**-24 relative, so an output within c * n * 2**-24 * (|normalized| + |mean| / std),
    taken here, with c = 32 and |mean| / std of order one, as 32 * 6 * 2**-24 * (1 + the
    largest output); a copy in another state is off by orders of magnitude more."""
    result = _wrapper_result(run)["modes"]
    for label, entry in result.items():
        for call, diffs in entry["outputs"].items():
            tol = 32 * 6 * 2.0 ** -24 * (1 + diffs["largest"])
            assert diffs["revert"] == 0.0, (label, call, diffs)
            assert 0.0 <= diffs["convert"] <= tol, (label, call, diffs, tol)  # NaN fails both
        assert entry["state after"]["revert"] == 0.0, (label, entry["state after"])
        assert 0.0 <= entry["state after"]["convert"] <= 32 * 6 * 2.0 ** -24 * 2, (label, entry["state after"])
        for step in ("convert", "revert"):
            assert entry["wrapped after"][step] and all(entry["wrapped after"][step]), (label, step, entry)


def test_convert_of_a_torch_module_wrapper_in_safe_mode_names_the_switch(run):
    """A TorchModuleWrapper placed straight in a Functional model is copied from its
    config, which Keras's safe mode refuses to unpickle: the error names the layer and
    Keras's switch (not the general advice about get_config), and with the switch on the
    reverted copy computes as the original, bit for bit (the same layers, the same
    inference-mode ops)."""
    result = _wrapper_result(run)["direct"]
    message = result["safe"]
    assert "cannot copy layer 'direct' of type TorchModuleWrapper" in message, message
    assert "keras.config.enable_unsafe_deserialization() before converting" in message, message
    assert "give it a get_config()" not in message, message
    assert result["allowed"] == 0.0, result


def test_convert_still_refuses_a_torch_module_wrapper_configured_otherwise(run):
    """A wrapped torch module that the copy, made from its owner's config, builds otherwise
    (another Dropout rate, a ReLU added: constructor arguments that get_config() leaves
    out; state of the same shapes, so nothing else would notice) is refused, naming the
    sub-module that differs, also when a sub-module of it is in eval mode."""
    result = _wrapper_result(run)["refused"]
    for label, differs in (("rate", "has (1): Dropout(p=0.5, inplace=False); the copy's has (1): Dropout(p=0.1"),
                           ("relu", "has (2): ReLU(); the copy's has nothing"),
                           ("rate, dropout eval", "has (1): Dropout(p=0.5, inplace=False); the copy's has (1)")):
        message = result[label]
        assert "has sub-layers configured otherwise" in message, (label, message)
        assert "forgetful/wrap (TorchModuleWrapper): module (the wrapped torch module " + differs in message, (
            label, message)
