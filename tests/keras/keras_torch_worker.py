"""One rank of a 2-process ``torch.distributed`` (gloo, 127.0.0.1) run of
``SyncBatchNormalization`` on the Keras PyTorch backend.

Before joining the group it checks the layer against ``keras.layers.BatchNormalization``
(no distribution: plain BN) and measures both variances at ``|mean| / std = 1e3``.
Then, for every case, one training call on its own part of the batch; it saves its
input, ``dy``, mask, output, gradients and weights to ``<out>/<case>-<rank>.npz`` and
the number of all-reduce calls per layer call to ``<out>/info-<rank>.json``.

    MASTER_ADDR=127.0.0.1 MASTER_PORT=P python tests/keras_torch_worker.py --rank R --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

import keras_oracle as oracle

# case -> (per-rank batch sizes, per-sample shape, channel axis, masked, layer kwargs);
# masked "rank 1 none" masks everything on rank 1.
CASES = {
    "uneven": ([5, 3], (4, 3, 3), -1, False, {}),
    "empty": ([4, 0], (3, 6), 1, False, {}),
    "masked": ([3, 6], (5, 3), -1, True, {}),
    "masked channels first": ([4, 3], (3, 5), 1, "rank 1 none", {}),
    "one value in all": ([1, 0], (3,), -1, False, {}),
    "nothing kept": ([2, 3], (4, 3), -1, "all none", {}),
    "renorm": ([4, 5], (2, 3), -1, False, {"renorm": True, "renorm_clipping": {"rmax": 1.5, "dmax": 0.8},
                                          "renorm_momentum": 0.8}),
}


def weights_by_name(layer):
    return {w.path.split("/")[-1]: np.array(w.numpy()) for w in layer.weights}


def check_local(info):
    """Not distributed: the same as Keras's layer; and the variance far from zero."""
    import keras
    import torch

    from syncbn.keras import SyncBatchNormalization

    rng = np.random.default_rng(30)
    xs, dys = oracle.make_inputs(rng, [6], (4, 3), 3)
    outs = []
    for cls in (keras.layers.BatchNormalization, SyncBatchNormalization):
        layer = cls(momentum=0.5)
        layer.build((None, 4, 3))
        x = torch.tensor(xs[0], requires_grad=True)
        y = layer(x, training=True)
        (y * torch.tensor(dys[0])).sum().backward()
        outs.append((y.detach().numpy(), x.grad.numpy(), layer.moving_variance.numpy()))
    for a, b in zip(*outs):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)

    x = (rng.standard_normal((256, 16, 4)) + 1000.0).astype(np.float32)
    reference = x.astype(np.float64).reshape(-1, 4).var(0)
    errors = {}
    for name, cls in (("syncbn", SyncBatchNormalization), ("keras", keras.layers.BatchNormalization)):
        layer = cls(momentum=0.0)
        layer(torch.tensor(x), training=True)
        errors[name] = oracle.variance_relative_error(layer.moving_variance.numpy(), reference)
    assert errors["syncbn"] <= 1e-5, errors
    info["local_variance_relative_error_at_ratio_1e3"] = errors


def check_convert_modes(info):
    """convert/revert on the torch backend: each layer of the copy (and the torch modules it
    holds) has the original's torch ``training`` mode (a layer put in eval mode came back
    in train mode), and neither that mode nor a NaN attribute the copy has alike is named
    in the attribute warning."""
    import warnings

    import keras

    from syncbn.keras import convert, revert

    class Gate(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.threshold = float("nan")  # set alike by every construction

        def call(self, x):
            return x

    inputs = keras.Input((4, 3))
    model = keras.Model(inputs, keras.layers.BatchNormalization(name="bn")(Gate(name="gate")(inputs)))
    model.get_layer("bn").eval()
    model.get_layer("gate").eval()
    result = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, made in (("convert", convert(model)), ("revert", revert(convert(model)))):
            result[step] = {layer.name: [m.training for m in layer.modules()]
                            for layer in made._flatten_layers(include_self=True, recursive=True)}
    result["original"] = {layer.name: [m.training for m in layer.modules()]
                          for layer in model._flatten_layers(include_self=True, recursive=True)}
    result["warnings"] = [str(w.message) for w in caught if "attributes" in str(w.message)]
    info["convert_modes"] = result


def check_convert_modes_where_the_copy_differs(info):
    """convert/revert on the torch backend of layers whose copy from their config has other
    sub-layers than they (a constructor argument that get_config() leaves out deciding a
    Dropout): each sub-layer of the copy that has a counterpart takes its torch
    ``training`` mode, and one without a counterpart takes its owner's. ``Block`` (from
    keras_roundtrip_checks) made with ``rate=0.5`` holds a Dropout that its copy lacks;
    ``Tail`` made with ``rate=0`` lacks the Dropout that its copy, made with the default
    rate, holds. The modes came back as the root's, whatever each layer had."""
    import warnings

    import keras

    from keras_roundtrip_checks import restructured_classes
    from syncbn.keras import convert, revert

    Block = restructured_classes()[0]

    class Tail(keras.layers.Layer):
        def __init__(self, rate=0.5, **kwargs):
            super().__init__(**kwargs)
            self.rate = rate
            self.dense = keras.layers.Dense(3)
            if rate:
                self.drop = keras.layers.Dropout(rate)
            self.bn = keras.layers.BatchNormalization()

        def call(self, x, training=None):
            h = self.dense(x)
            if self.rate:
                h = self.drop(h, training=training)
            return self.bn(h, training=training)

        def get_config(self):
            return super().get_config()  # ``rate`` left out

    def modes(layer):
        held = {name: getattr(layer, name) for name in ("norm", "dense", "drop", "bn") if hasattr(layer, name)}
        return {"self": layer.training, **{name: sub.training for name, sub in held.items()}}

    inputs = keras.Input((3,))
    block = Block(rate=0.5, name="block")  # its copy has no Dropout
    tail = Tail(rate=0.0, name="tail")  # its copy has one
    model = keras.Model(inputs, tail(block(inputs)), name="model")
    block.bn.eval()  # a sub-layer in eval mode, in a model in train mode
    tail.eval()  # a layer in eval mode (its copy's Dropout is to follow it), one sub-layer back in train mode
    tail.dense.train()
    alone = Block(rate=0.5, name="alone")
    alone(np.zeros((2, 3), np.float32))
    alone.eval()  # the converted layer itself in eval mode, one sub-layer back in train mode
    alone.bn.train()
    result = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the attribute and restructuring warnings, checked elsewhere
        for label, root, names in (("model", model, ("block", "tail")), ("alone", alone, ("alone",))):
            result[label] = {"original": {"root": root.training, **{
                name: modes(root if name == label else root.get_layer(name)) for name in names}}}
            for step, made in (("convert", convert(root)), ("revert", revert(convert(root)))):
                result[label][step] = {"root": made.training, **{
                    name: modes(made if name == label else made.get_layer(name)) for name in names}}
    info["convert_modes_where_the_copy_differs"] = result


def check_convert_torch_module_wrapper(info):
    """convert/revert on the torch backend of custom layers holding a
    ``keras.layers.TorchModuleWrapper``, whose config carries the wrapped torch module
    pickled, torch modes included. ``modes``: a wrapped sub-module in eval mode (a Dropout,
    a BatchNorm1d holding running statistics), the whole wrapped module in eval mode, and a
    Functional model in a mixed state are copied (no "configured otherwise" refusal), every
    torch module of the copy in the original's mode, every parameter and buffer alike, and
    the outputs alike in inference and training calls (one seed for the Dropouts).
    ``refused``: a wrapped module that the copy, made from the config, builds otherwise (a
    Dropout rate, a ReLU added, by constructor arguments that get_config() leaves out) is
    still refused, also with a sub-module in eval mode."""
    import warnings

    import keras
    import torch

    from syncbn.keras import convert, revert

    nn = torch.nn

    class Wrapping(keras.layers.Layer):
        def __init__(self, kind="dropout", **kwargs):
            super().__init__(**kwargs)
            self.kind = kind
            tail = nn.Dropout(0.1) if kind == "dropout" else nn.BatchNorm1d(4)
            self.wrap = keras.layers.TorchModuleWrapper(nn.Sequential(nn.Linear(4, 4), tail))
            self.bn = keras.layers.BatchNormalization()

        def call(self, x):
            return self.bn(self.wrap(x))

        def get_config(self):
            return {**super().get_config(), "kind": self.kind}

    class Forgetful(keras.layers.Layer):
        def __init__(self, rate=0.1, relu=False, **kwargs):
            super().__init__(**kwargs)
            parts = [nn.Linear(4, 4), nn.Dropout(rate)] + ([nn.ReLU()] if relu else [])
            self.wrap = keras.layers.TorchModuleWrapper(nn.Sequential(*parts))

        def call(self, x):
            return self.wrap(x)

        def get_config(self):
            return super().get_config()  # ``rate`` and ``relu`` left out

    keras.utils.set_random_seed(7)  # the same initial weights on every run
    rng = np.random.default_rng(7)
    x = torch.tensor(rng.standard_normal((6, 4)).astype(np.float32))

    def built(layer):
        layer(x)  # builds it; through a BatchNorm1d, moves its running statistics off 0 and 1
        return layer

    def dropout_eval():
        layer = built(Wrapping("dropout", name="layer"))
        layer.wrap.module[1].eval()
        return layer

    def batchnorm_eval():
        layer = built(Wrapping("batchnorm", name="layer"))
        layer.wrap.module[1].eval()
        return layer

    def all_eval():
        layer = built(Wrapping("batchnorm", name="layer"))
        layer.wrap.module.eval()
        return layer

    def mixed_model():
        inputs = keras.Input((4,))
        first, second = Wrapping("batchnorm", name="first"), Wrapping("dropout", name="second")
        h = keras.layers.Dense(4, name="dense")(second(first(inputs)))
        model = keras.Model(inputs, keras.layers.BatchNormalization(name="bn")(h), name="model")
        built(model)
        model.eval()  # the model in eval mode, with these back in train mode:
        first.wrap.module[1].train()  # a wrapped BatchNorm1d in a layer in eval mode
        second.train()  # a layer, whose wrapped Dropout is in eval mode again
        second.wrap.module[1].eval()
        model.get_layer("dense").train()
        return model

    def layers(root):  # the Keras layers of its tree, in order (as convert pairs them)
        return list(root._flatten_layers(include_self=True, recursive=True))

    def modes(root):  # each layer's torch mode, with those of the torch modules a wrapper holds
        return [[layer.training, [[type(m).__name__, m.training] for m in layer.module.modules()]
                 if isinstance(layer, keras.layers.TorchModuleWrapper) else None] for layer in layers(root)]

    def state(root):  # the weights in order, and the wrapped modules' buffers (running statistics)
        return [np.array(w.numpy()) for w in root.weights] + [
            v.detach().numpy().copy() for layer in layers(root) if isinstance(layer, keras.layers.TorchModuleWrapper)
            for v in layer.module.buffers()]

    def same(a, b):
        return len(a) == len(b) and all(x.shape == y.shape and np.array_equal(x, y) for x, y in zip(a, b))

    result = {"modes": {}, "refused": {}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for label, make in (("dropout eval", dropout_eval), ("batchnorm eval", batchnorm_eval),
                            ("all eval", all_eval), ("mixed model", mixed_model)):
            root = make()
            try:
                made = {"convert": convert(root), "revert": revert(convert(root))}
            except ValueError as err:
                result["modes"][label] = {"error": str(err)}
                continue
            entry = {"original": modes(root)}
            for step, copy in made.items():
                entry[step] = modes(copy)  # before any call, which sets the modes anew
            want = state(root)
            entry["state"] = {step: same(want, state(copy)) for step, copy in made.items()}
            outputs = {}
            for call, training in (("inference", False), ("training", True), ("no argument", None)):
                got = {}
                for step, layer in (("original", root), *made.items()):
                    torch.manual_seed(11)  # the same Dropout draws for each
                    y = layer(x) if training is None else layer(x, training=training)
                    got[step] = y.detach().numpy().astype(np.float64)
                outputs[call] = {"largest": float(np.max(np.abs(got["original"]))), **{
                    step: float(np.max(np.abs(got[step] - got["original"]))) for step in made}}
            entry["outputs"] = outputs
            # after the training calls, which moved the running statistics: the wrapped modules'
            # alike (the same computation); the Keras batch norms' as their outputs are
            want = state(root)
            entry["state after"] = {step: max(float(np.max(np.abs(a.astype(np.float64) - b)))
                                              for a, b in zip(want, state(copy))) for step, copy in made.items()}
            want = [layer.module.state_dict() for layer in layers(root)
                    if isinstance(layer, keras.layers.TorchModuleWrapper)]
            entry["wrapped after"] = {step: [{k: bool(torch.equal(v, got[k])) for k, v in w.items()} == {
                k: True for k in w} for w, got in zip(want, [layer.module.state_dict() for layer in layers(copy)
                                                             if isinstance(layer, keras.layers.TorchModuleWrapper)])]
                                      for step, copy in made.items()}
            result["modes"][label] = entry

        for label, kwargs, evaluated in (("rate", {"rate": 0.5}, False), ("relu", {"relu": True}, False),
                                         ("rate, dropout eval", {"rate": 0.5}, True)):
            layer = built(Forgetful(name="forgetful", **kwargs))
            if evaluated:
                layer.wrap.module[1].eval()
            try:
                convert(layer)
                result["refused"][label] = "no error"
            except ValueError as err:
                result["refused"][label] = str(err)

        # a TorchModuleWrapper straight in a Functional model: Keras's safe mode refuses to
        # unpickle its config; the error says how to allow it, and allowed, the copy computes
        # as the original (last here: the switch is global and has no public way back)
        inputs = keras.Input((4,))
        hidden = keras.layers.TorchModuleWrapper(nn.Linear(4, 4), output_shape=(None, 4), name="direct")(inputs)
        model = keras.Model(inputs, keras.layers.BatchNormalization(name="bn")(hidden))
        try:
            convert(model)
            result["direct"] = {"safe": "no error"}
        except TypeError as err:
            result["direct"] = {"safe": str(err)}
        keras.config.enable_unsafe_deserialization()
        made = revert(convert(model))
        result["direct"]["allowed"] = float(np.max(np.abs(made(x).detach().numpy() - model(x).detach().numpy())))
    info["convert_torch_module_wrapper"] = result


def check_second_order(info, rank, calls):
    """A gradient penalty (backward with create_graph=True) raises a RuntimeError that
    names the problem on both ranks, after the forward all-reduce and before any
    backward one (so neither waits); a plain backward afterwards still works and
    issues its one all-reduce. The training step reads nothing on the host."""
    import torch

    from syncbn.keras import SyncBatchNormalization

    layer = SyncBatchNormalization()
    layer.build((None, 3))
    reads = []
    item = torch.Tensor.item

    def counting_item(self):
        reads.append(self.numel())
        return item(self)

    torch.Tensor.item = counting_item
    results = {}
    try:
        x = torch.arange(1.0, 13.0).reshape(4, 3).mul(rank + 1).requires_grad_()
        calls.clear()
        y = layer(x, training=True)
        try:
            (g,) = torch.autograd.grad((y ** 3).sum(), x, create_graph=True)
            results["create_graph"] = "no error"
        except RuntimeError as err:
            results["create_graph"] = str(err)
        results["create_graph_all_reduce"] = list(calls)
        calls.clear()
        (layer(x, training=True) ** 3).sum().backward()
        results["plain"] = {"all_reduce": list(calls), "finite": bool(torch.isfinite(x.grad).all())}
        results["host_reads"] = len(reads)
    finally:
        torch.Tensor.item = item
    info["second_order"] = results


def check_mismatch(info, rank):
    """Rank 1 calls two layers of one width in the other order: both ranks raise
    LayerMismatchError at the first call, naming both layers, no moving mean moved."""
    import torch

    from syncbn.keras import SyncBatchNormalization
    from syncbn.core.fingerprint import LayerMismatchError

    layers = {name: SyncBatchNormalization(name=name) for name in ("first", "second")}
    for layer in layers.values():
        layer.build((None, 3))
    x = torch.arange(1.0, 13.0).reshape(4, 3)
    try:
        for name in (("first", "second") if rank == 0 else ("second", "first")):
            x = layers[name](x, training=True)
        outcome = "no error"
    except LayerMismatchError as err:
        outcome = str(err)
    moved = [bool(np.any(layer.moving_mean.numpy() != 0)) for layer in layers.values()]
    info["mismatch"] = {"error": outcome, "moved": moved}


def check_graph_mismatch(info, rank):
    """Rank 0 makes a training call under torch.no_grad (it records no graph, so it will
    make no backward all-reduce), rank 1 the same call with grad: both ranks raise
    LayerMismatchError at that call, saying only one rank records it, and the moving mean
    does not move. (Without the graph in the fingerprint both forwards agreed and rank
    1's backward waited for an all-reduce that rank 0 never makes.)"""
    import torch

    from syncbn.keras import SyncBatchNormalization
    from syncbn.core.fingerprint import LayerMismatchError

    layer = SyncBatchNormalization(name="graphed")
    layer.build((None, 3))
    x = torch.arange(1.0, 13.0).reshape(4, 3).requires_grad_()
    try:
        if rank == 0:
            with torch.no_grad():
                layer(x, training=True)
        else:
            layer(x, training=True)
        outcome = "no error"
    except LayerMismatchError as err:
        outcome = str(err)
    info["graph_mismatch"] = {"error": outcome, "moved": bool(np.any(layer.moving_mean.numpy() != 0))}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.environ["KERAS_BACKEND"] = "torch"
    import torch
    import torch.distributed as dist

    import syncbn.torch.distributed
    from syncbn.keras import SyncBatchNormalization

    out = Path(args.out)
    info = {}
    check_local(info)
    check_convert_modes(info)
    check_convert_modes_where_the_copy_differs(info)
    check_convert_torch_module_wrapper(info)

    dist.init_process_group("gloo", rank=args.rank, world_size=2)
    calls = []
    original = syncbn.torch.distributed.all_reduce_sum

    def counting(tensor, group=None):
        calls.append(tensor.numel())
        return original(tensor, group)

    syncbn.torch.distributed.all_reduce_sum = counting
    try:
        for case, (sizes, tail, axis, masked, kwargs) in CASES.items():
            rng = np.random.default_rng(sum(map(ord, case)))  # the same draws on both ranks
            full = (None,) + tail
            channels = full[axis]
            xs, dys = oracle.make_inputs(rng, sizes, tail, channels, axis)
            masks = oracle.make_masks(rng, xs) if masked else None
            if masked == "rank 1 none":
                masks[1][:] = False
            elif masked == "all none":
                masks = [np.zeros_like(m) for m in masks]
            layer = SyncBatchNormalization(axis=axis, momentum=0.9, **kwargs)
            layer.build(full)
            layer.set_weights([rng.uniform(0.5, 2.0, channels).astype(np.float32)
                               if w.path.endswith(("gamma", "variance", "stddev"))
                               else rng.uniform(-1, 1, channels).astype(np.float32) for w in layer.weights])
            initial = weights_by_name(layer)
            me = args.rank
            x = torch.tensor(xs[me], requires_grad=True)
            mask = None if masks is None else torch.tensor(masks[me])
            calls.clear()
            y = layer(x, training=True, mask=mask)
            forward_calls = list(calls)
            (y * torch.tensor(dys[me])).sum().backward()
            info[f"{case}_all_reduce_calls"] = {"forward": forward_calls, "backward": calls[len(forward_calls):]}
            final = weights_by_name(layer)
            np.savez(
                out / f"{case}-{me}.npz", x=xs[me], dy=dys[me], mask=np.array([]) if masks is None else masks[me],
                y=y.detach().numpy(), dx=x.grad.numpy(), dgamma=layer.gamma.value.grad.numpy(),
                dbeta=layer.beta.value.grad.numpy(),
                **{f"initial_{k}": v for k, v in initial.items()}, **{f"final_{k}": v for k, v in final.items()},
            )
        check_second_order(info, args.rank, calls)
        check_mismatch(info, args.rank)
        check_graph_mismatch(info, args.rank)
    finally:
        syncbn.torch.distributed.all_reduce_sum = original
        dist.destroy_process_group()
    (out / f"info-{args.rank}.json").write_text(json.dumps(info))


if __name__ == "__main__":
    main()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import doc_blocks

    doc_blocks.exit_unless_group_freed("keras_torch_worker.py")  # ended, and freed: no abort at exit
