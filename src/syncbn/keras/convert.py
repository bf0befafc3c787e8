"""``convert`` and ``revert``: a copy of a Keras model in which every BatchNormalization
synchronizes, and back. One walk over the model does both; a :class:`_Swap` says which
way."""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
import warnings

import keras

from .layer import SyncBatchNormalization, plain_in_place, synchronize_in_place

__all__ = ["convert", "revert", "Synchronized"]


def convert(model):
    """Return a copy of ``model`` in which every ``keras.layers.BatchNormalization`` is a
    :class:`SyncBatchNormalization` with the same configuration and weights.

    Only layers of exactly that class are replaced (and ours kept): a subclass of it
    may behave differently (a frozen BN that always runs in inference mode, extra
    constructor arguments), so it is left as it is and named in a warning.

    Sequential and Functional models are rebuilt with ``keras.models.clone_model``,
    recursing into nested Sequential / Functional models. A subclass of them (the
    keras_hub ``Backbone`` / ``Task`` pattern) is rebuilt through its own
    ``from_config(get_config())``, so its attributes and methods are kept (its class,
    as :func:`synchronized_class` of it: see below), given
    the original's weights, and its BatchNormalization layers are then synchronized in
    place (the class of such a layer in the fresh copy becomes
    :class:`SyncBatchNormalization`, which adds no state of its own). Every other
    layer is copied from its config and given the original's weights, and
    BatchNormalization layers held inside custom layers (as attributes, or in lists,
    tuples, dicts, sets, at any depth) are replaced too. A bare BatchNormalization layer gives a
    SyncBatchNormalization; a built subclassed ``keras.Model`` is copied from its
    config, built on the original's input shape and given its weights. The original
    model is left untouched and shares nothing with the copy, whose outputs in
    inference equal the original's. Layer names and weight paths are kept (except in
    a subclass rebuilt through its constructor, which names the layers it does not
    name itself afresh, as loading it from a file does; the weight paths then follow
    the copy's names, ``net/block_1/conv2d_3/kernel`` for ``net/block/conv2d_1/kernel``,
    as a call of the copy would make them).

    A layer or model that makes its BatchNormalization layers in its own constructor
    (a custom layer, a subclassed model, a keras_hub ``Backbone`` or ``Task``) saves
    only its constructor's arguments, so loading a ``.keras`` file would rebuild them
    plain. Its copy is therefore given a subclass of its class, :class:`Synchronized`
    (registered as ``syncbn>Synchronized``), which saves the original class and config
    and synchronizes them again when ``keras.models.load_model`` rebuilds it
    (``syncbn.keras`` imported; without it loading raises Keras's "Could not locate
    class" error, naming the converted class, ``SynchronizedBlock`` say, or
    ``SyncBatchNormalization``; never a plain model). Batch norm layers that such a layer
    makes in its own ``build()`` (none exist in a copy before it is built) are synchronized
    when it is built, converting and loading alike. Until then each custom layer of the copy
    not yet built whose class defines its own ``build()``, and each layer holding one, built
    or not (a model called in inference, whose block runs only in training), has that
    subclass (``SynchronizedBlock``), so that a ``.keras`` file saved before that layer is
    built loads back synchronized too; once it is built, each that made no batch norm has
    its own class back.

    Weights files (``.weights.h5``) name a layer's group after its class, so a file
    saved from the original loads into ``convert`` of a model that loaded it (load,
    then convert), and one saved from ``revert(model)`` into the plain model.

    Each copied layer gets the original's state as a ``.keras`` file carries it, through
    Keras's own ``save_own_variables`` / ``load_own_variables`` and ``save_assets`` /
    ``load_assets``: its weights, an adapted ``Normalization``'s statistics, an adapted
    lookup layer's vocabulary; and a stateful RNN's current states, with every model's
    ``trainable`` flag. A layer built by hand (``layer.build(shape)``) or by an earlier call
    inside a model not built (a Sequential without an ``Input``, a subclassed model not yet
    called) is built in the copy as in the original, from its build config, and holds its
    weights before the copy's first call; one marked built by hand whose weights no
    ``build()`` makes raises ``ValueError``, naming it. Python attributes set after
    construction and absent from the config cannot be copied: a public one of a plain value
    (a number, a string) that the copy has otherwise is named in a warning. Where a layer's
    copy from its config has other sub-layers than it (a constructor argument its
    ``get_config()`` leaves out decides them, one was assigned again before building, or the
    call that built it made one according to a call argument), the layers are paired by
    where each is held (``block/drop``): those alike get their state, a differing one that
    holds none is named in a warning, and one holding state without a counterpart raises
    ``ValueError``, naming it. A sub-layer's ``trainable`` flag (a frozen backbone) and LoRA
    enabled on it are given to its copy; one whose config differs otherwise in the copy
    (assigned again before building with other arguments, quantized) raises ``ValueError``,
    naming it and the entries, as the copy would compute something else (on the torch
    backend, the torch module that a ``keras.layers.TorchModuleWrapper``'s config carries
    pickled is compared without its train/eval modes, which the copy takes from the
    original's, module by module). A layer held in two places (an ``Embedding`` that a
    custom layer projects onto, for weight tying) stays one layer in the copy where its
    holder returns it in ``get_config()`` through ``keras.saving.serialize_keras_object``
    (as a ``.keras`` file keeps it; ``clone_model`` makes two); a tie that the copy would
    lose raises ``ValueError``, naming the layer. Seed generators (Dropout) start afresh.

    The copy is not compiled, whether or not ``model`` was: compile it (inside
    ``strategy.scope()`` when training with a ``tf.distribute`` strategy, and build or
    convert it there as well so that its variables are mirrored).
    """
    return _Swap.to_sync().run(model)


def revert(model):
    """The inverse of :func:`convert`: a copy of ``model`` in which every
    :class:`SyncBatchNormalization` is a ``keras.layers.BatchNormalization`` with the
    same configuration (``synchronized=False``) and weights, for inference or export
    where nothing is distributed.

    It walks the model as :func:`convert` does (a bare layer, Sequential and Functional
    models and the models nested in them, Functional subclasses through their own
    ``from_config``, layers held by custom layers), replaces only layers of exactly
    :class:`SyncBatchNormalization` (a subclass of it is kept and named in a warning)
    and leaves ``model`` untouched. ``revert(convert(model))`` has the original's
    layer classes, configurations and weight values (``synchronized=True`` of Keras's
    own layer, which ``convert`` replaces, comes back as ``False``), and its layer
    names and weight paths, except where a subclass is rebuilt through its constructor
    (a subclassed model, a Functional subclass, a custom layer holding batch norm
    layers): there, as when loading it from a file, a layer its constructor does not
    name, or the model itself when its config has no ``name``, is named afresh
    (``dense_1`` for ``dense``). Name them to keep the names.
    """
    return _Swap.to_plain().run(model)


class _Swap:
    """One direction of the swap: the exact class it replaces (``source``), the class it
    puts in its place (``target``), and which other layers it leaves alone but names
    in a warning (``leaves``: subclasses of ``source``, whose behaviour a copy of the
    ``target`` class would lose)."""

    def __init__(self, verb, source, target, leaves):
        self.verb = verb
        self.source = source
        self.target = target
        self._leaves = leaves
        self.skipped = []
        self.swaps = 0  # batch norm layers swapped so far, to know which owners held one
        self.differing = []  # attributes that the copy, made from configs, has otherwise
        self.restructured = []  # stateless sub-layers that the copy has otherwise
        # id(layer) -> (layer, its copy): a layer met twice (shared by nested models, held
        # in two places) gets one copy; the layer is kept so that its id stays its own.
        self._copies = {}
        # (layer, a copy of it, the layer whose copying paired them): every layer paired
        # with its copy, to find a layer (or variable) of the original that its copy holds
        # twice over (_check_ties)
        self._pairs = []
        # id(layer) -> its copy, for each layer held in more than one place: what Keras's
        # deserialization gives a config that serializes it (_keeping_ties)
        self._shared = {}
        self._tied = set()  # the ids of those layers
        # the layers holding the one being walked (swap_within, retype_within), outermost
        # first: the owners of a layer that makes its batch norm layers when it is built
        self._owners = []

    @classmethod
    def to_sync(cls):
        return cls("convert", keras.layers.BatchNormalization, SyncBatchNormalization,
                   leaves=lambda layer: isinstance(layer, keras.layers.BatchNormalization)
                   and not isinstance(layer, SyncBatchNormalization))

    @classmethod
    def to_plain(cls):
        return cls("revert", SyncBatchNormalization, keras.layers.BatchNormalization,
                   leaves=lambda layer: isinstance(layer, SyncBatchNormalization))

    def replaces(self, layer) -> bool:
        return type(layer) is self.source

    def leaves(self, layer) -> bool:
        return not self.replaces(layer) and self._leaves(layer)

    # ------------------------------------------------------------------ entry point

    def run(self, model):
        if not isinstance(model, keras.layers.Layer):  # before the walk, which reads its attributes
            raise TypeError(f"syncbn.keras.{self.verb}: expected a Keras model or layer, got "
                            f"{type(model).__module__}.{type(model).__qualname__}")
        with self._keeping_ties(model):
            result = self.copy(model)
        self._pairs.append((model, result, None))
        self._check_ties()
        if keras.backend.backend() == "torch":
            _keep_torch_modes(model, result, self._made_from(model, result))
        if self.skipped:
            names = sorted({f"{layer.name} ({type(layer).__name__})" for layer in self.skipped})
            warnings.warn(
                f"syncbn.keras.{self.verb} left these {self.source.__name__} subclasses as they "
                f"were (only {self.source.__name__} itself is replaced): " + "; ".join(names),
                stacklevel=3,
            )
        if self.differing:
            warnings.warn(
                f"syncbn.keras.{self.verb}: the copy is rebuilt from each layer's config and "
                "state (as a .keras file is), and these attributes, set outside the config, "
                "differ in it: " + "; ".join(self.differing) + ". Put them in the layer's "
                "get_config() (or set them on the copy)",
                stacklevel=3,
            )
        if self.restructured:
            warnings.warn(
                f"syncbn.keras.{self.verb}: the copy is rebuilt from each layer's config and "
                "built for its input shapes (as a .keras file is), and these sub-layers, which "
                "hold no state, come out otherwise in it: " + "; ".join(self.restructured) + ". "
                "Every layer holding state was copied. Make each layer's sub-layers follow from "
                "its get_config() (every constructor argument that decides them) and its input "
                "shapes: create them in __init__() or build(), not according to a call argument "
                "or by assigning them later",
                stacklevel=3,
            )
        return result

    def _note(self, old, differing, restructured, pairs):
        self.differing += [d for d in differing if d not in self.differing]
        self.restructured += restructured
        self._pairs += [(a, b, old) for _, a, b in pairs]

    def _copied(self, old, new):
        """Give ``new`` (a fresh copy of the layer ``old`` from its config) ``old``'s state
        where ``old`` or a layer of its tree is built (:func:`_copy_state`), each layer of
        ``new``'s tree built first where its counterpart is (:func:`_build_as_built`: a
        layer built by hand in a Sequential without an ``Input``, or by an earlier call),
        else check its sub-layers as that does (:func:`_pair_sub_layers`)."""
        if any(layer.built for layer in old._flatten_layers(include_self=True, recursive=True)):
            _build_as_built(old, new, self.verb)
            self._note(old, *_copy_state(old, new, self.verb))
        else:
            self._note(old, [], [], _pair_sub_layers(old, new, self.verb)[0])

    @contextlib.contextmanager
    def _keeping_ties(self, model):
        """Within: a layer of ``model`` held in more than one place (an ``Embedding`` that
        a Functional model calls and that a custom layer holding it for weight tying
        serializes in its ``get_config()``) comes out of Keras's deserialization (that
        custom layer's ``from_config``) as the one copy that the walk made or will make of
        it, as loading a ``.keras`` file keeps one object for it. Keras's own mechanism
        (``shared_object_id``, the scope its saving opens), limited to those layers: a
        config that serializes one of them is given its id, and the copy made of it is
        what the deserialization returns. Without that mechanism (another Keras), nothing
        is kept, and :meth:`_check_ties` raises where a tie is lost."""
        try:
            from keras.src.backend.common import global_state
        except ImportError:  # pragma: no cover - another Keras
            yield
            return
        shared = _held_in_several_places(model)
        if not shared:
            yield
            return
        keys = ("shared_objects/id_to_obj_map", "shared_objects/id_to_config_map")
        before = [global_state.get_global_attribute(key) for key in keys]
        self._shared, self._tied = {}, shared
        global_state.set_global_attribute(keys[0], self._shared)
        global_state.set_global_attribute(keys[1], _Seen(shared))
        try:
            yield
        finally:
            for key, value in zip(keys, before):
                global_state.set_global_attribute(key, value)
            self._shared, self._tied = {}, set()

    def _check_ties(self):
        """Raise where the copy holds two layers (or variables) for one of the original's:
        a layer held in two places (passed to a custom layer's constructor for weight
        tying, or assigned to its attribute) whose holder's copy, made from its config,
        made its own. Training the copy would no longer tie them."""

        layers, variables = {}, {}  # id(original's) -> (original's, {id(copy's): (copy's, holders)})
        for a, b, owner in self._pairs:
            b = self._final(b)
            holders = layers.setdefault(id(a), (a, {}))[1].setdefault(id(b), (b, set()))[1]
            if owner is not None and owner is not a:
                holders.add(owner.name)
            own_a, own_b = _own_variables(a), _own_variables(b)
            if len(own_a) == len(own_b) and all(va.shape == vb.shape for va, vb in zip(own_a, own_b)):
                for va, vb in zip(own_a, own_b):
                    variables.setdefault(id(va), (va, {}))[1].setdefault(id(vb), (vb, set()))[1].add(a.name)
        lost = []
        for a, copies in layers.values():
            if len(copies) > 1:
                held = "; ".join(f"one held by {', '.join(sorted(repr(h) for h in holders)) or 'the model'}"
                                 for _, holders in copies.values())
                lost.append(f"layer {a.name!r} ({type(a).__name__}) is {len(copies)} layers in the copy: {held}")
        if not lost:  # a variable shared by layers that are not shared
            for v, copies in variables.values():
                if len(copies) > 1:
                    held = " and ".join(sorted({name for _, names in copies.values() for name in names}))
                    lost.append(f"variable {v.path!r}, held by {held}, is {len(copies)} variables in the copy")
        if lost:
            raise ValueError(
                f"{self.verb}: the original shares layers or variables between places that its copy, "
                "rebuilt from each layer's config, holds separately, so the copy would no longer tie "
                "them (training would move them apart): " + "; ".join(lost) + ". A layer that holds a "
                "layer of the model must be rebuilt holding that same layer, as a .keras file keeps it: "
                "return it in its get_config() through keras.saving.serialize_keras_object() and take "
                "it back in its from_config() through keras.saving.deserialize_keras_object(), or "
                "create the layers it ties in its own __init__()"
            )

    def _final(self, layer):
        """What the copy holds in the end for ``layer``, a copy the walk made (a swapped
        batch norm for one that a copied owner's constructor made, a copied model)."""
        seen = set()
        while id(layer) in self._copies and self._copies[id(layer)][0] is layer and id(layer) not in seen:
            seen.add(id(layer))
            layer = self._copies[id(layer)][1]
        return layer

    def _made_from(self, model, result) -> dict:
        """``id(layer) -> layer of model's tree`` for each layer of ``result``'s tree (the
        copy of ``model``) that the walk paired with one of ``model``'s: as
        :func:`_copy_state` paired them (by position where an owner's tree and its copy's
        match, else by where each is held), as ``clone_model`` copied a graph model's
        layers, followed through the copies made of those (a batch norm swapped, a nested
        model copied). A layer of the copy that no layer of ``model`` made (one that its
        owner's constructor made only in the copy) is absent."""
        source = {}  # id(copy) -> the layer it was made from (of model's tree, or a copy itself)
        for a, b, _ in self._pairs:
            source.setdefault(id(b), a)
        for value, new in self._copies.values():
            if new is not value:
                source.setdefault(id(new), value)
        tree = {id(layer) for layer in model._flatten_layers(include_self=True, recursive=True)}
        found = {}
        for layer in result._flatten_layers(include_self=True, recursive=True):
            origin, seen = layer, set()
            while id(origin) not in tree and id(origin) in source and id(origin) not in seen:
                seen.add(id(origin))
                origin = source[id(origin)]
            if id(origin) in tree:
                found[id(layer)] = origin
        return found

    def copy(self, model):
        """A copy of ``model`` (a layer or a model) with every ``source`` layer swapped."""
        if self.replaces(model):
            return self.swapped(model)
        if not isinstance(model, keras.layers.Layer):
            raise TypeError(f"{self.verb}: expected a Keras model or layer, got {type(model).__name__}")
        if self.leaves(model):
            self.skipped.append(model)

        if not _is_plain_graph_model(model):
            new = _copy_layer(model, self.verb)
            if model.built:
                if not new.built:
                    with _outer_scopes(model):  # built where ``model`` was: its weight paths
                        _build_like(new, model, self.verb)
            self._copied(model, new)
            if _is_graph_model(new):
                self.retype_within(new, set())
            else:
                self.swap_within(new, set())
            return new

        copies = []  # (original, copy) pairs whose weights are copied once the model is built

        def clone(layer):
            if id(layer) in self._copies:  # a layer shared with a model copied before
                return self._copies[id(layer)][1]
            # a layer that a layer copied before holds, and so made (from its config) as
            # the copy of this one (_keeping_ties)
            held = self._shared.get(id(layer))
            if self.replaces(layer) or _is_graph_model(layer):
                # swapped, or a copy that keeps its input names and, for a subclass, its class
                new = self.swapped(layer) if self.replaces(layer) else self.copy(layer)
                if held is not None:  # the holder's gets this copy in its place (swap_within)
                    self._copies[id(held)] = (held, new)
            elif not isinstance(layer, keras.layers.Layer):
                # an operation of the graph that is no layer (``h * h`` on KerasTensors is
                # keras.ops' Multiply): copied from its config, as clone_model copies it; it
                # holds no weights and no layers
                new = _copy_layer(layer, self.verb)
            else:
                if self.leaves(layer):
                    self.skipped.append(layer)
                new = held if held is not None and type(held) is type(layer) else _copy_layer(layer, self.verb)
                copies.append((layer, new))
            if isinstance(layer, keras.layers.Layer):
                self._pairs.append((layer, new, model))
                if id(layer) in self._tied:
                    self._shared.setdefault(id(layer), new)
            self._copies[id(layer)] = (layer, new)
            return new

        inputs = None if isinstance(model, keras.Sequential) else _inputs_like(model)
        # not compiled: clone_model would compile the copy from model's compile config; in the
        # name scopes that ``model`` was built in, where a Sequential's copy is built at once
        with _not_compiled(model), _outer_scopes(model):
            new_model = keras.models.clone_model(model, input_tensors=inputs, clone_function=clone)
        # its input layers, made afresh by clone_model, in their order (for _keep_torch_modes)
        ins = [[layer for layer in m._flatten_layers(include_self=False, recursive=False)
                if isinstance(layer, keras.layers.InputLayer)] for m in (model, new_model)]
        if len(ins[0]) == len(ins[1]):
            self._pairs += [(a, b, model) for a, b in zip(*ins)]
        _keep_trainable_flags(model, new_model)
        seen = set()
        for old, new in copies:
            self._copied(old, new)
            self.swap_within(new, seen)
        return new_model

    # ------------------------------------------------------------------ one layer

    def swapped(self, bn):
        """A ``target`` layer with ``bn``'s configuration, built like it (for the same
        input shape, its weights under the same paths) and holding copies of its
        weights."""
        self.swaps += 1
        config = bn.get_config()
        config.pop("synchronized", None)
        new = self.target.from_config(config)
        if bn.built:
            build_config = bn.get_build_config()  # the input shape it was built for
            with _outer_scopes(bn):
                if build_config:
                    new.build_from_config(build_config)
                else:
                    shape = [None] * bn.input_spec.ndim
                    shape[bn.axis] = bn.moving_mean.shape[0]
                    new.build(tuple(shape))
            new.set_weights(bn.get_weights())
        # What the swap itself decides is not an attribute lost in the copy: ``synchronized``
        # (False in every swapped layer, see convert and revert) and ``supports_jit``
        # (False for a synchronized layer made under a strategy of several replicas, see
        # mismatch.keep_fit_off_xla; True for Keras's layer).
        self.differing += _differing_attributes(bn, new, decided=("synchronized", "supports_jit"))
        return new

    def retype(self, bn):
        """Make ``bn`` (a fresh copy that nothing else references) a ``target`` layer
        without replacing the object: its variables, name and place in the graph stay.
        Converting, it gets what SyncBatchNormalization's constructor and build give
        (:func:`synchronize_in_place`: the build-time checks, and under TensorFlow fit
        kept off XLA and its verdict record); reverting, it drops them."""
        self.swaps += 1
        if self.target is SyncBatchNormalization:
            synchronize_in_place(bn)
        else:
            plain_in_place(bn)

    def retype_owner(self, layer, held_swapped: bool) -> None:
        """Give ``layer`` (a fresh copy that nothing else references) the class that
        saves it right. Converting, a layer that is not a plain Sequential/Functional
        model and held a swapped layer becomes :func:`synchronized_class` of its class;
        reverting, a :class:`Synchronized` layer gets its original class back."""
        if self.target is SyncBatchNormalization:
            if held_swapped and not _is_plain_graph_model(layer):
                if not isinstance(layer, Synchronized):
                    layer.__class__ = synchronized_class(type(layer))
                vars(layer).pop(_PROVISIONAL, None)  # converted for good
        else:
            if isinstance(layer, Synchronized):
                layer.__class__ = original_class(type(layer))
            vars(layer).pop(_PROVISIONAL, None)

    # ------------------------------------------------------------------ layers held

    def swap_within(self, layer, seen):
        """Replace, in place, every ``source`` layer held by ``layer`` or by the layers it
        holds (attributes, lists, tuples, dicts and sets of them, nested in each other)
        with a swapped copy, and every nested Sequential / Functional model with a copy.

        The replacement takes the old layer's slot in Keras's layer tracking, so the
        order of ``layer.weights`` does not change, and a layer held in several places
        is replaced by one copy everywhere.
        """
        if id(layer) in seen:
            return
        seen.add(id(layer))
        if self.leaves(layer):
            self.skipped.append(layer)
            return
        self._when_built(layer)
        before = self.swaps
        tracker = getattr(layer, "_tracker", None)
        stores = [] if tracker is None else [store for _, store in tracker.config.values()]

        def replace(value):
            if id(value) in self._copies:  # met before, here or in another container
                new = self._copies[id(value)][1]
            elif self.replaces(value):
                new = self.swapped(value)
            elif _is_graph_model(value):
                with self._inside(layer):
                    new = self.copy(value)
            else:
                if isinstance(value, keras.layers.Layer):
                    with self._inside(layer):
                        self.swap_within(value, seen)
                return value
            self._copies[id(value)] = (value, new)
            if tracker is not None and tracker.is_in_store("layers", value):
                tracker.replace_tracked_value("layers", value, new)
            return new

        for name, value in list(vars(layer).items()):
            if any(value is store for store in stores):
                continue  # Keras's own tracking lists; updated through the tracker
            if isinstance(value, keras.layers.Layer):
                new = replace(value)
                if new is not value:
                    if tracker is not None and tracker.is_in_store("layers", new):
                        # Already in the old layer's slot, so Keras's __setattr__ tracks
                        # nothing new; on TensorFlow it points the checkpoint
                        # dependency of this attribute at the new layer.
                        setattr(layer, name, new)
                    else:
                        object.__setattr__(layer, name, new)
            elif isinstance(value, _CONTAINERS):
                new = _replace_held(value, replace)
                if new is not value:  # a tuple, made anew
                    object.__setattr__(layer, name, new)
        self.retype_owner(layer, self.swaps > before)

    def retype_within(self, layer, seen):
        """:meth:`retype` every ``source`` layer held by ``layer`` (a fresh copy that
        nothing else references), at any depth."""
        if id(layer) in seen:
            return
        seen.add(id(layer))
        if self.replaces(layer):
            self.retype(layer)
            return
        if self.leaves(layer):
            self.skipped.append(layer)
            return
        self._when_built(layer)
        before = self.swaps
        with self._inside(layer):
            for value in list(vars(layer).values()):
                for item in _layers_in(value):
                    self.retype_within(item, seen)
        self.retype_owner(layer, self.swaps > before)

    @contextlib.contextmanager
    def _inside(self, layer):
        """Walking the layers ``layer`` holds: it is their innermost owner meanwhile."""
        self._owners.append(layer)
        try:
            yield
        finally:
            self._owners.pop()

    def _when_built(self, layer) -> None:
        """Converting, make the batch norm layers that ``layer`` (a fresh copy, not yet
        built) creates in its own ``build()`` synchronized when it is built: a copy made
        from its config holds none of them until then, nor does one that
        :meth:`Synchronized.from_config` rebuilds while a ``.keras`` file loads (they would
        otherwise train, and load from the file, as plain layers, in silence).

        Keras wraps ``build`` once per object, when it is made; this puts a step after that
        wrapper: :meth:`retype_within` of ``layer``, and, where it synchronized a layer,
        the class that saves as converted for ``layer`` and for the layers holding it
        (:meth:`retype_owner`), as :func:`convert` gives a layer built before it ran.

        Until then ``layer`` and the layers holding it (:attr:`_owners`), built or not,
        have that class provisionally, so that a ``.keras`` file saved before ``layer`` is
        built (before the model's first call, or after calls that did not reach it: a
        block that runs only in training) loads back through
        :meth:`Synchronized.from_config`, which hooks the rebuilt layer again; the configs
        of their own classes are the constructors' arguments, which make ``layer`` plain.
        Once ``layer`` is built, each of them that holds no layer still waiting to be
        built, and was not found to hold a synchronized one, has its own class back
        (:func:`_settle`). Only a layer whose class defines ``build()`` outside Keras is
        hooked (Keras's own layers make no batch norm there); a keras_hub preprocessing
        layer (a task's preprocessor, which runs on the data outside the model's call) is
        hooked but keeps its class, as do the layers holding it.

        Reverting, the hook and the provisional mark are taken off ``layer`` (a copy that
        :meth:`Synchronized.from_config` hooked)."""
        hook = _build_hook(layer)
        if self.target is not SyncBatchNormalization:
            if hook is not None:
                layer.build = hook.syncbn_keras_build
            vars(layer).pop(_PROVISIONAL, None)
            return
        if layer.built or _is_plain_graph_model(layer) or not _builds_its_own(layer) or hook is not None:
            return
        keras_build = layer.build
        owners = list(self._owners)

        @functools.wraps(keras_build)  # its signature, which Keras reads to call it
        def build(*args, **kwargs):
            result = keras_build(*args, **kwargs)
            swap = _Swap.to_sync()
            swap._owners = list(owners)
            swap.retype_within(layer, set())
            if swap.swaps:
                for owner in owners:
                    swap.retype_owner(owner, True)
            for held in [layer, *owners[::-1]]:  # innermost first
                _settle(held)
            return result

        build.syncbn_when_built = True
        build.syncbn_keras_build = keras_build
        layer.build = build
        if _preprocessing(layer):
            return  # runs on the data, outside the model's call: saved as it is
        # built owners too (a model called in inference, where ``layer`` runs only in
        # training): their configs, which make ``layer`` plain, are what a file holds
        for held in [layer, *owners]:
            if not _is_plain_graph_model(held) and not isinstance(held, Synchronized):
                held.__class__ = synchronized_class(type(held))
                object.__setattr__(held, _PROVISIONAL, True)


# a layer of a converted copy that has its synchronized class only until it is built
# (see _Swap._when_built): the name of its attribute that says so
_PROVISIONAL = "_syncbn_provisional"


def _build_hook(layer):
    """The ``build`` that :meth:`_Swap._when_built` put on ``layer``, or None."""
    hook = vars(layer).get("build")
    return hook if getattr(hook, "syncbn_when_built", False) else None


def _builds_its_own(layer) -> bool:
    """Whether ``layer``'s class defines ``build()`` outside Keras (a custom layer's, which
    may make batch norm layers); Keras's own layers make none there."""
    module = getattr(getattr(type(layer), "build", None), "__module__", None) or ""
    return not (module == "keras" or module.startswith("keras."))


def _preprocessing(layer) -> bool:
    """Whether ``layer`` is a keras_hub preprocessing layer (a task's preprocessor, its
    tokenizer or image converter: keras_hub's ``PreprocessingLayer``), which runs on the data
    before the model, not inside its call; told by its class's ancestry, without importing
    keras_hub."""
    return any(cls.__name__ == "PreprocessingLayer" and (cls.__module__ or "").startswith("keras_hub.")
               for cls in type(layer).__mro__)


def _settle(layer) -> None:
    """Give ``layer``, where it has its synchronized class provisionally (see
    :meth:`_Swap._when_built`) and holds no layer still waiting to be built with that hook,
    its own class back: it made no batch norm layer that needs the converted class."""
    if not vars(layer).get(_PROVISIONAL, False):
        return
    for held in layer._flatten_layers(include_self=True, recursive=True):
        if not held.built and _build_hook(held) is not None:
            return  # decided when that one is built
    vars(layer).pop(_PROVISIONAL, None)
    layer.__class__ = original_class(type(layer))


# ---------------------------------------------------------------------- saving


@keras.saving.register_keras_serializable(package="syncbn", name="Synchronized")
class Synchronized:
    """The mixin of :func:`synchronized_class`: a converted layer or model whose
    BatchNormalization layers its own constructor makes (so its config, its
    constructor's arguments, cannot say they are synchronized).

    Saved (``get_config``), it records its original class and that class's config;
    loaded (``from_config``), it rebuilds the original from them, then synchronizes
    every BatchNormalization it holds in place, exactly as :func:`convert` does to a
    copy, and so loads the weights of the file saved from the converted model. Every
    class made by :func:`synchronized_class` saves under the one registered name
    ``syncbn>Synchronized``, whose ``from_config`` reads the class from the config:
    importing ``syncbn.keras`` is all a new process needs to load the file.
    """

    def get_config(self):
        original = original_class(type(self))
        return {"original": {
            "module": original.__module__,
            "class_name": original.__name__,
            "registered_name": keras.saving.get_registered_name(original),
            "config": super().get_config(),
        }}

    @classmethod
    def from_config(cls, config):
        if cls is Synchronized:  # loading a file, or clone_model of a subclassed model
            rebuilt = _rebuild_original(config["original"])
        else:  # copying a converted object: its class knows the original, registered or not
            rebuilt = original_class(cls).from_config(config["original"]["config"])
        swap = _Swap.to_sync()
        swap.retype_within(rebuilt, set())
        # held no batch norm and none is waiting to be built (a provisional class, which
        # building settles, see _Swap._when_built): it still saves as converted
        if not isinstance(rebuilt, Synchronized):
            rebuilt.__class__ = synchronized_class(type(rebuilt))
        return rebuilt


def _rebuild_original(original):
    """The object that ``original`` (the ``"original"`` entry of a :class:`Synchronized`
    config) describes, rebuilt by its class's ``from_config``.

    The class is the original of the synchronized class that the caller hands Keras
    under that class's own name, if any: ``keras.models.clone_model`` of a converted
    subclassed model passes ``custom_objects={"SynchronizedTower": ...}`` (its registered
    name, ``syncbn>Synchronized``, finds only this mixin), which names the original even
    when Keras cannot find it by name. Otherwise Keras looks the original up (registered
    name, custom objects, then module) and raises its "Could not locate class" for a
    class neither registered nor passed in ``custom_objects``."""
    synced = keras.saving.get_registered_object(f"Synchronized{original['class_name']}")
    if isinstance(synced, type) and issubclass(synced, Synchronized):
        cls = original_class(synced)
        if (cls.__module__, cls.__name__) == (original["module"], original["class_name"]):
            return cls.from_config(original["config"])
    return keras.saving.deserialize_keras_object(original)


_SYNCHRONIZED_CLASSES = {}  # original class -> its synchronized subclass


def synchronized_class(original):
    """The subclass of ``original`` (a layer or model class) that saves and loads as
    converted: ``original``'s behaviour, :class:`Synchronized`'s config. One per class."""
    if issubclass(original, Synchronized):
        return original
    cls = _SYNCHRONIZED_CLASSES.get(original)
    if cls is None:
        namespace = {"__module__": __name__, "__qualname__": f"Synchronized{original.__name__}"}
        if callable(getattr(original, "save_to_preset", None)):  # keras_hub's Backbone, Task
            namespace["save_to_preset"] = _save_plain_preset
        cls = type(f"Synchronized{original.__name__}", (Synchronized, original), namespace)
        # Keras saves an object under its class's registered name: register the new class
        # under the mixin's name, then point that name back at the mixin (the live dict of
        # keras.saving.get_custom_objects()); either class's from_config reads the class
        # from the config, so whichever the name points at loads every file alike.
        keras.saving.register_keras_serializable(package="syncbn", name="Synchronized")(cls)
        keras.saving.get_custom_objects()["syncbn>Synchronized"] = Synchronized
        _SYNCHRONIZED_CLASSES[original] = cls
    return cls


def _save_plain_preset(self, preset_dir, *args, **kwargs):
    """``save_to_preset`` of a converted keras_hub model: keras_hub's own, applied to
    :func:`revert` of it, with a warning naming how to synchronize it again.

    keras_hub's ``from_preset`` finds the class to build from the preset's registered
    names and refuses (or, given ``num_classes``, rebuilds the head around) one that is not
    a subclass of the class it is called on, which ``syncbn>Synchronized`` never is: a
    converted model's own preset would not load back. The preset therefore holds the plain
    model, with the files, layer names and weights it had before the conversion, which any
    keras_hub loads; the model itself stays converted."""
    revert(self).save_to_preset(preset_dir, *args, **kwargs)
    warnings.warn(
        f"syncbn.keras: saved the preset {preset_dir} with plain BatchNormalization layers "
        "(keras_hub's from_preset() rebuilds a preset's classes by their registered names, "
        "which cannot say they are synchronized): call syncbn.keras.convert() on what "
        "from_preset() returns to train synchronized again, or save with "
        "model.save('model.keras'), which keeps the layers synchronized in the file",
        UserWarning, stacklevel=2)


def original_class(cls):
    """The class that :func:`synchronized_class` made ``cls`` from (``cls`` itself when it is not one)."""
    if not issubclass(cls, Synchronized):
        return cls
    return cls.__bases__[1]  # (Synchronized, original)


# ---------------------------------------------------------------------- helpers


def _is_graph_model(layer) -> bool:
    """Sequential and Functional models (and their subclasses)."""
    from keras.src.models.functional import Functional

    return isinstance(layer, (keras.Sequential, Functional))


def _is_plain_graph_model(layer) -> bool:
    """Exactly Sequential or Functional: ``keras.models.clone_model`` rebuilds them
    exactly. A subclass (the keras_hub ``Backbone`` / ``Task`` pattern) has its own
    constructor, attributes and methods, which a clone into a plain Functional loses."""
    from keras.src.models.functional import Functional

    return type(layer) in (keras.Sequential, Functional)


def _copy_layer(layer, verb):
    """A fresh copy of a layer from its config (not yet holding the weights)."""
    try:
        return layer.__class__.from_config(layer.get_config())
    except Exception as err:
        # Keras's safe mode refuses configs that hold code or pickles (a Lambda's function,
        # a TorchModuleWrapper's module); its message names the switch. Only the advice
        # depends on this test of the message: a miss gives the general advice.
        if "safe_mode" in str(err):
            advice = ("Keras's safe mode refused to rebuild it from its config: if you trust the "
                      "layer, call keras.config.enable_unsafe_deserialization() before converting")
        else:
            advice = "give it a get_config() that its constructor accepts"
        raise TypeError(
            f"{verb}: cannot copy layer {layer.name!r} of type {type(layer).__name__} from "
            f"its config ({type(err).__name__}: {err}); {advice}"
        ) from err


def _copy_state(old, new, verb):
    """Give ``new`` (a fresh copy of ``old`` from its config, built as ``old`` is) ``old``'s
    state as a ``.keras`` file carries it, layer by layer (:func:`_copy_own_state`: the
    weights and what a layer derives from them when it loads, an adapted lookup layer's
    vocabulary, a stateful RNN's current states), then every variable exactly, as
    ``set_weights`` copies them: a saved value is not always the one held (LoRA adapters).

    The layers of the two trees are paired by position where the trees have the same
    layer classes in the same order (the common case). Where they differ (a sub-layer that
    a constructor argument missing from ``get_config()`` decides, one assigned after
    construction, one that the building call made according to a call argument), they are
    paired by where each is held (``block/towers/0/dense``, as a ``.keras`` file pairs
    them): every pair gets the state as above, and a layer without a counterpart of its
    class that holds no state is named in the second list returned. One that holds state
    (variables, assets, a stateful RNN's states), in either tree, or a pair whose variables
    differ in shape, raises ``ValueError`` naming them, as their state would be lost or
    made afresh. Each pair's copy is given what :func:`_match_sub_layers` can give it
    exactly, and checked by :func:`_configured_otherwise` once it holds its state.

    Returns ``(differing, restructured, pairs)``: ``layer.attribute`` for each public
    attribute of a plain value (a number, a string, a bool, None) that the copy has
    otherwise than ``old``, set after construction and absent from the config, that no copy
    can know; ``path (class; the copy has class)`` for each stateless sub-layer without a
    counterpart; and the pairs (see :func:`_pair_trees`)."""
    pairs, unpaired, by_position = _pair_trees(old, new)
    _match_sub_layers(old, pairs)
    lost, restructured = [], []
    for path, a, b in unpaired:
        where = (f"{path} ({type(a).__name__ if a is not None else 'no layer'}; the copy has "
                 f"{type(b).__name__ if b is not None else 'no layer'})")
        held = [f"{state} in the {'original' if layer is a else 'copy'}"
                for layer in (a, b) if layer is not None for state in [_state_held(layer)] if state]
        if held:
            lost.append(f"{where}, holding " + " and ".join(held))
        else:
            restructured.append(where)
    for path, a, b in [] if by_position else pairs:
        shapes_a = [tuple(v.shape) for v in _own_variables(a)]
        shapes_b = [tuple(v.shape) for v in _own_variables(b)]
        if shapes_a != shapes_b:
            lost.append(f"{path} ({type(a).__name__}): variables of shapes {shapes_a}; the copy's are {shapes_b}")
    if lost:
        raise ValueError(
            f"{verb}: cannot copy the state of {old.name!r} ({type(old).__name__}): its copy, "
            "rebuilt from its config and built for the original's input shapes (as a .keras file "
            "rebuilds it), has other sub-layers than it, and the state of these would be lost or "
            "made afresh: " + "; ".join(lost) + ". Make its sub-layers follow from its get_config() "
            "(every constructor argument that decides them) and its input shapes: create them in "
            "__init__() or build(), not according to a call argument or by assigning them later"
        )
    # sub-layers configured otherwise, compared again once they hold their state, which
    # gives some what their config then says (an adapted lookup layer's vocabulary size);
    # named at once where copying the state fails for it (a sub-layer quantized)
    configured = _configured_otherwise(old, pairs)
    differing = []
    try:
        for _, a, b in pairs:
            differing += _copy_own_state(a, b)
        if by_position:
            # and then every variable as it is: a file's values are what a layer exports, not
            # always what it holds (a LoRA-enabled Dense or Embedding saves its kernel with the
            # adapter merged in and zeroes both adapter factors when it loads, which no
            # gradient then moves); what a layer derived when it loaded is derived from these
            # same values
            new.set_weights(old.get_weights())
        else:
            for _, a, b in pairs:  # the same, layer by layer
                for va, vb in zip(_own_variables(a), _own_variables(b)):
                    vb.assign(va)
    except Exception as err:
        if configured:
            _raise_configured_otherwise(old, configured, verb, err)
        raise
    _raise_configured_otherwise(old, _configured_otherwise(old, [(p, a, b) for p, a, b, _ in configured]), verb)
    return differing, restructured, pairs


def _pair_trees(old, new):
    """The layers of ``old``'s tree (itself included) paired with those of ``new``'s, a copy
    of it from its config: ``(pairs, unpaired, by_position)``, lists of ``(path, layer of
    old, layer of new)`` as :func:`_pair_by_path` gives them, by position where the two
    trees have the same layer classes in the same order (``path`` None then)."""
    olds = list(old._flatten_layers(include_self=True, recursive=True))
    news = list(new._flatten_layers(include_self=True, recursive=True))
    if len(olds) == len(news) and all(_same_kind(a, b) for a, b in zip(olds, news)):
        return [(None, a, b) for a, b in zip(olds, news)], [], True
    return (*_pair_by_path(old, new, olds, news), False)


def _pair_sub_layers(old, new, verb):
    """:func:`_pair_trees` of a layer ``old`` that is not built and its copy ``new``, each
    pair given what :func:`_match_sub_layers` gives and checked by
    :func:`_configured_otherwise`: ``(pairs, unpaired)``."""
    pairs, unpaired, _ = _pair_trees(old, new)
    _match_sub_layers(old, pairs)
    _raise_configured_otherwise(old, _configured_otherwise(old, pairs), verb)
    return pairs, unpaired


def _match_sub_layers(old, pairs):
    """Give each sub-layer of ``old``'s copy in ``pairs`` (see :func:`_pair_trees`) what
    its original was given after construction, which no config that makes it says and
    which the copy can be given exactly: LoRA enabled (``enable_lora``, as keras-hub's
    ``backbone.enable_lora(rank)`` enables it on the attention layers' projections), with
    its rank and alpha, and the ``trainable`` flag of the layer (a sub-layer frozen) and
    of each variable it holds itself."""
    for _, a, b in pairs:
        if a is old:
            continue  # the copy itself, made from this config
        if (getattr(a, "lora_enabled", False) is True and getattr(b, "lora_enabled", True) is False
                and b.built and callable(getattr(b, "enable_lora", None))):
            b.enable_lora(a.lora_rank, lora_alpha=a.lora_alpha)
        _give_trainable(a, b)
        own_a, own_b = _own_variables(a), _own_variables(b)
        if len(own_a) == len(own_b):
            for va, vb in zip(own_a, own_b):
                if vb.trainable != va.trainable:
                    vb.trainable = va.trainable


def _configured_otherwise(old, pairs) -> list:
    """``(path, layer, its copy, config entries)`` for each sub-layer of ``old`` in
    ``pairs`` (see :func:`_pair_trees`, after :func:`_match_sub_layers`) whose copy has a
    config that differs from the original's in anything but its name (a sub-layer assigned
    again before building with other arguments, ``Dense(2, activation="softmax")`` for the
    constructor's ``Dense(2)``; one quantized after construction): the copy, rebuilt from
    ``old``'s config, would compute something else."""
    differing = []
    for path, a, b in pairs:
        if a is old:
            continue  # the copy itself, made from this config
        keys = _config_differences(a, b)
        if keys:
            differing.append((path, a, b, keys))
    return differing


def _raise_configured_otherwise(old, differing, verb, cause=None):
    """Raise ``ValueError`` naming each of ``differing`` (:func:`_configured_otherwise`), if any."""
    if not differing:
        return
    if any(path is None for path, _, _, _ in differing):
        paths = {id(layer): path for path, layer in _layers_by_path(
            old, old.name, list(old._flatten_layers(include_self=True, recursive=True))).items()}
        differing = [(paths.get(id(a), f"{old.name}/.../{a.name}") if path is None else path, a, b, keys)
                     for path, a, b, keys in differing]
    raise ValueError(
        f"{verb}: cannot copy {old.name!r} ({type(old).__name__}) as it is: its copy, rebuilt "
        "from its config (as a .keras file rebuilds it), has sub-layers configured otherwise "
        "than the original's, so it would compute something else: "
        + "; ".join(f"{path} ({type(a).__name__}): " + ", ".join(keys) for path, a, _, keys in differing)
        + ". Make its sub-layers follow from its get_config(): pass what configures them as "
        "constructor arguments that get_config() returns (or return the sub-layer itself through "
        "keras.saving.serialize_keras_object() and take it back in from_config()), rather than "
        "assigning or changing a sub-layer after construction"
    ) from cause


def _config_differences(a, b) -> list:
    """``key (value; the copy has value)`` for each entry of the layer ``a``'s config that
    the config of ``b``, its counterpart in a copy, has otherwise. Not compared: names
    (a layer's own and those of the layers a config holds, which a constructor that does
    not name its sub-layers makes afresh), ``synchronized`` (between BatchNormalization
    and SyncBatchNormalization), the layers of a plain Sequential or Functional model
    (compared each as a layer of the tree, their names and connections aside), the torch
    train/eval modes in the pickled module of a ``TorchModuleWrapper``'s config
    (:class:`_TorchModuleModesAside`; the copy takes them, :func:`_keep_torch_modes`). Where
    either config cannot be had (a sub-layer no file could save either), nothing."""
    if _is_plain_graph_model(a):
        return []
    try:
        config_a, config_b = a.get_config(), b.get_config()
    except Exception:
        return []
    if type(a) is not type(b):  # BatchNormalization and SyncBatchNormalization
        config_a, config_b = dict(config_a), dict(config_b)
        config_a.pop("synchronized", None)
        config_b.pop("synchronized", None)
    if _wraps_torch_module(a) and _wraps_torch_module(b) and "module" in config_a and "module" in config_b:
        # the pickled module, torch modes included: compared without them (_keep_torch_modes gives those)
        config_a, config_b = dict(config_a), dict(config_b)
        config_a["module"] = _TorchModuleModesAside(a.module, config_a["module"])
        config_b["module"] = _TorchModuleModesAside(b.module, config_b["module"])
    differing = []
    for key, _, _ in _differences(config_a, config_b, "", top=True):
        top = key.split(".")[0].split("[")[0]
        if top not in [d[0] for d in differing]:
            differing.append((top, config_a.get(top, _MISSING), config_b.get(top, _MISSING)))
    return [_torch_module_difference(key, x, y) if isinstance(x, _TorchModuleModesAside)
            and isinstance(y, _TorchModuleModesAside) else f"{key} ({_short(x)}; the copy has {_short(y)})"
            for key, x, y in differing]


_MISSING = type("_Missing", (), {"__repr__": lambda self: "nothing"})()


def _wraps_torch_module(layer) -> bool:
    """Whether ``layer`` is a ``keras.layers.TorchModuleWrapper`` (torch backend) holding a
    torch module, which its config carries pickled (``torch.save``), torch modes included."""
    wrapper = getattr(keras.layers, "TorchModuleWrapper", None)
    if wrapper is None or keras.backend.backend() != "torch" or not isinstance(layer, wrapper):
        return False
    import torch

    return isinstance(getattr(layer, "module", None), torch.nn.Module)


class _TorchModuleModesAside:
    """The ``module`` entry of a ``TorchModuleWrapper``'s config (the wrapped torch module,
    pickled by ``torch.save``) as :func:`_config_differences` compares it: everything the
    pickle holds (the modules' classes, their hyper-parameters, parameters and buffers) but
    each module's ``training`` flag, which is torch's train/eval mode, not configuration
    (``module.eval()``, or a sub-module's, changes only it). The copy takes the original's
    modes, module by module, from :func:`_keep_torch_modes`.

    The pickle compared is that of a deep copy of the module with every module's
    ``training`` flag set to True (the flag itself: no ``train()`` method of the user's
    runs); the module itself is left as it is. Where no such copy can be made or saved,
    the pickle from the config (``saved``), modes included, is compared as it is: a
    mode may then refuse a copy that differs in nothing else, never let through one that
    differs in more."""

    __hash__ = None

    def __init__(self, module, saved):
        import copy
        import io

        import torch

        self.text = repr(module)
        try:
            twin = copy.deepcopy(module)
            for sub in twin.modules():
                sub.training = True
            buffer = io.BytesIO()
            torch.save(twin, buffer)
            self.key = ("modes aside", buffer.getvalue())
        except Exception:
            self.key = ("as saved", saved)

    def __eq__(self, other):
        return isinstance(other, _TorchModuleModesAside) and self.key == other.key

    def __repr__(self):
        return " ".join(self.text.split())


def _torch_module_difference(key, a, b) -> str:
    """``key (...)`` naming where two wrapped torch modules (:class:`_TorchModuleModesAside`)
    differ: the first lines of their reprs that differ (a sub-module's hyper-parameters, one
    that only one of them holds), or, where the reprs are alike, that the pickles differ."""
    import difflib

    def cut(text):
        return text if len(text) <= 100 else text[:97] + "..."

    lines_a = [line.strip() for line in a.text.splitlines()]
    lines_b = [line.strip() for line in b.text.splitlines()]
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=lines_a, b=lines_b, autojunk=False).get_opcodes():
        if tag != "equal":
            x, y = " ".join(lines_a[i1:i2]) or "nothing", " ".join(lines_b[j1:j2]) or "nothing"
            return f"{key} (the wrapped torch module has {cut(x)}; the copy's has {cut(y)})"
    if "as saved" in (a.key[0], b.key[0]):
        return (f"{key} (the wrapped torch module {cut(repr(a))}, pickled otherwise in the copy, "
                "where its torch train/eval modes count too, as it could not be deep-copied to compare it "
                "without them: call train() on it before converting, and eval() on the copy's as needed)")
    return (f"{key} (the wrapped torch module {cut(repr(a))}, pickled otherwise in the copy: "
            "in an attribute or hyper-parameter that its repr does not show)")


def _short(value) -> str:
    """``value`` of a config in words of at most 100 characters, a serialized Keras object
    as ``ClassName(its config)``."""
    def compact(v):
        if isinstance(v, dict) and "class_name" in v and isinstance(v.get("config"), dict):
            args = ", ".join(f"{k}={compact(x)}" for k, x in v["config"].items() if k != "name" or "trainable" not in v["config"])
            return f"{v['class_name']}({args})"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k!r}: {compact(x)}" for k, x in v.items()) + "}"
        return repr(v)

    text = compact(value)
    return text if len(text) <= 100 else text[:97] + "..."


def _differences(a, b, key, top=False):
    """``(key, value of a, value of b)`` for each leaf at which the nested configs ``a``
    and ``b`` differ (see :func:`_same_value`); ``top``: ``a`` and ``b`` are layers' configs."""
    if isinstance(a, dict) and isinstance(b, dict):
        skip = {"shared_object_id"}  # what a serialization within Keras's sharing scope adds
        if top or "trainable" in a and "trainable" in b:  # a layer's config, at any depth
            skip.add("name")
            if "input_layers" in a or "input_layers" in b:  # a Functional model's: its layers
                skip.update(("layers", "input_layers", "output_layers"))
        found = []
        for k in list(a) + [k for k in b if k not in a]:
            if k in skip:
                continue
            sub = f"{key}.{k}" if key else str(k)
            if k not in a or k not in b:
                found.append((sub, a.get(k, _MISSING), b.get(k, _MISSING)))
            else:
                found += _differences(a[k], b[k], sub)
        return found
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        found = []
        for i, (x, y) in enumerate(zip(a, b)):
            found += _differences(x, y, f"{key}[{i}]")
        return found
    return [] if _same_value(a, b) else [(key, a, b)]


def _same_value(a, b) -> bool:
    """Whether two leaves of configs are alike: equal (NaN equal to NaN), arrays of the same
    dtype, shape and values, Keras objects of one class whose configs are alike, classes and
    functions of one name (a lambda each constructor makes afresh); other objects that
    compare only by identity (made afresh by each constructor), of one class."""
    if a is b:
        return True
    if isinstance(a, (int, float, complex)) and isinstance(b, (int, float, complex)):
        return a == b or (a != a and b != b)
    if callable(getattr(a, "get_config", None)) and not isinstance(a, type):
        if type(a) is not type(b):
            return False
        try:
            return not _differences(a.get_config(), b.get_config(), "")
        except Exception:
            return True  # cannot tell
    if hasattr(a, "shape") and hasattr(a, "dtype") and not isinstance(a, (str, bytes)):
        try:
            x, y = keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b)
        except Exception:
            return type(a) is type(b)
        import numpy as np

        return x.shape == y.shape and x.dtype == y.dtype and bool(
            np.array_equal(x, y, equal_nan=x.dtype.kind in "fc"))
    if isinstance(a, type) or callable(a) and hasattr(a, "__qualname__"):  # a class, a function
        return (getattr(a, "__module__", None), getattr(a, "__qualname__", None)) == (
            getattr(b, "__module__", None), getattr(b, "__qualname__", None))
    if type(a).__eq__ is object.__eq__:
        return type(a) is type(b)
    try:
        return bool(a == b)
    except Exception:
        return type(a) is type(b)


class _Seen(dict):
    """Keras's map of the objects seen by a serialization in its sharing scope (``id ->
    config``), seeded with ``ids`` (see :meth:`_Swap._keeping_ties`) and holding nothing
    else: every config that serializes one of those layers names its id, and no other
    object (a temporary one whose id another takes after it) is ever taken as seen."""

    def __init__(self, ids):
        super().__init__((i, {}) for i in ids)

    def __setitem__(self, key, value):
        if key in self:
            super().__setitem__(key, value)


def _held_in_several_places(model) -> set:
    """The ids of the layers of ``model``'s tree that two or more layers hold (a graph
    model among its layers, a layer in an attribute or in containers of them): a layer
    shared, for weight tying say."""
    holders = {}
    done = set()

    def visit(layer):
        if id(layer) in done:
            return
        done.add(id(layer))
        for _, value in _held(layer):
            for held in _layers_in(value):
                holders.setdefault(id(held), set()).add(id(layer))
                visit(held)

    visit(model)
    return {i for i, held_by in holders.items() if len(held_by) > 1}


def _same_kind(a, b) -> bool:
    """Whether the layer ``b`` can take ``a``'s state as a counterpart of it: the same class,
    or BatchNormalization and SyncBatchNormalization (which adds no state of its own), as a
    layer whose constructor makes one holds the other after :func:`revert` or
    :func:`convert`."""
    kinds = {type(a), type(b)}
    return len(kinds) == 1 or kinds == {keras.layers.BatchNormalization, SyncBatchNormalization}


def _copy_own_state(a, b):
    """Give the layer ``b`` the state that ``a``, a layer of its class, holds itself (not
    its sub-layers'), as a ``.keras`` file carries it: ``save_own_variables`` into ``b``'s
    ``load_own_variables`` (the weights, and what a layer derives from them when it loads:
    an adapted ``Normalization``'s mean and variance, which ``set_weights`` leaves at their
    initial values), then ``save_assets`` into ``load_assets`` (an adapted lookup layer's
    vocabulary, which no weight holds); and a stateful RNN's current states, which neither
    a file nor ``clone_model`` keeps. Returns :func:`_differing_attributes` of the two."""
    store = {}
    a.save_own_variables(store)
    b.load_own_variables(store)
    if callable(getattr(a, "save_assets", None)) and callable(getattr(b, "load_assets", None)):
        with tempfile.TemporaryDirectory() as assets:
            a.save_assets(assets)
            b.load_assets(assets)
    if isinstance(a, keras.layers.RNN) and a.stateful and a.states is not None and b.states is not None:
        for va, vb in zip(keras.tree.flatten(a.states), keras.tree.flatten(b.states)):
            vb.assign(va)
    return _differing_attributes(a, b)


def _own_variables(layer):
    """The variables ``layer`` holds itself (not its sub-layers'), as ``layer.weights`` lists them."""
    own = []
    for v in layer._trainable_variables + layer._non_trainable_variables:
        if not any(v is w for w in own):
            own.append(v)
    return own


def _state_held(layer):
    """What state ``layer`` holds itself, in words ("2 variables", "assets", "a stateful
    RNN's states"), or "" for none: what a copy without a counterpart of it loses."""
    held = []
    store = {}
    layer.save_own_variables(store)
    count = max(len(_own_variables(layer)), len(store))
    if count:
        held.append(f"{count} variable{'s' if count != 1 else ''}")
    if callable(getattr(layer, "save_assets", None)):
        with tempfile.TemporaryDirectory() as assets:
            layer.save_assets(assets)
            if os.listdir(assets):
                held.append("assets")
    if isinstance(layer, keras.layers.RNN) and layer.stateful and layer.states is not None:
        held.append("a stateful RNN's states")
    return " and ".join(held)


def _pair_by_path(old, new, olds, news):
    """Pair the layers of ``old``'s tree (``olds``) with those of ``new``'s (``news``) by
    where each is held: ``(pairs, unpaired)``, lists of ``(path, layer of old, layer of
    new)``, the second with ``None`` for a side that holds no layer at that path or with
    layers of different classes."""
    found_old = _layers_by_path(old, old.name, olds)
    found_new = _layers_by_path(new, old.name, news)
    pairs, unpaired = [], []
    for path in list(found_old) + [p for p in found_new if p not in found_old]:
        a, b = found_old.get(path), found_new.get(path)
        if a is not None and b is not None and _same_kind(a, b):
            pairs.append((path, a, b))
        else:
            unpaired.append((path, a, b))
    return pairs, unpaired


def _layers_by_path(root, name, layers):
    """``{path: layer}`` for each of ``layers`` (``root``'s flattened tree), at the first
    path at which it is held, starting from ``root`` named ``name``: a layer's attribute
    names, list and tuple indices and dict keys, and for a Sequential or Functional model
    the index of each of its layers (``block/mlp/layers/1``). A layer of the tree that no
    attribute reaches gets ``root/.../its name``."""
    tree = {id(layer) for layer in layers}
    found, seen = {}, set()

    def visit(value, path):
        if id(value) in seen:
            return
        if isinstance(value, keras.layers.Layer):
            if id(value) not in tree:
                return  # a reference to a layer outside the tree
            seen.add(id(value))
            while path in found:  # a dict key that reads like another path: keep both layers
                path += "'"
            found[path] = value
            for key, item in _held(value):
                visit(item, f"{path}/{key}")
        elif isinstance(value, (list, tuple)):
            seen.add(id(value))
            for i, item in enumerate(value):
                visit(item, f"{path}/{i}")
        elif isinstance(value, dict):
            seen.add(id(value))
            for key, item in value.items():
                visit(item, f"{path}/{key}")

    visit(root, name)
    for layer in layers:
        if id(layer) not in seen:
            found.setdefault(f"{name}/.../{layer.name}", layer)
    return found


_CONTAINERS = (list, tuple, dict, set, frozenset)  # what may hold layers, at any depth


def _layers_in(value):
    """The layers that ``value`` is or holds through containers (:data:`_CONTAINERS`,
    nested: a list of dicts of layers), not those inside the layers."""
    found, stack, seen = [], [value], set()
    while stack:
        value = stack.pop()
        if isinstance(value, keras.layers.Layer):
            found.append(value)
        elif isinstance(value, _CONTAINERS) and id(value) not in seen:
            seen.add(id(value))
            items = list(value.values() if isinstance(value, dict) else value)
            stack.extend(reversed(items))
    return found


def _replace_held(value, replace, seen=None):
    """``value`` (a container, :data:`_CONTAINERS`) with each layer it holds, at any
    depth, put through ``replace``: lists, dicts and sets changed in place (through the
    plain container methods, as Keras's tracking versions of them would track the new
    layer again), a tuple or frozenset that changed made anew and returned in its place."""
    seen = set() if seen is None else seen
    if id(value) in seen:
        return value
    seen.add(id(value))

    def one(item):
        if isinstance(item, keras.layers.Layer):
            return replace(item)
        return _replace_held(item, replace, seen) if isinstance(item, _CONTAINERS) else item

    if isinstance(value, list):
        for i, item in enumerate(list(value)):
            new = one(item)
            if new is not item:
                list.__setitem__(value, i, new)
    elif isinstance(value, dict):
        for key, item in list(value.items()):
            new = one(item)
            if new is not item:
                dict.__setitem__(value, key, new)
    elif isinstance(value, set):
        for item in list(value):
            new = one(item)
            if new is not item:
                set.discard(value, item)
                set.add(value, new)
    else:  # tuple (a named one too), frozenset
        items = [one(item) for item in value]
        if any(new is not item for new, item in zip(items, value)):
            if hasattr(value, "_fields"):
                return type(value)(*items)
            return type(value)(items)
    return value


def _held(layer):
    """``(key, value)`` for each attribute of ``layer`` that is or may hold a layer (a
    layer, a list, tuple or dict), after a Sequential or Functional model's own layers
    (``layers/0``, ...), public attributes before private ones (on the torch backend, those
    that torch keeps in ``_modules`` too), TensorFlow's checkpoint dependencies last;
    Keras's tracking lists, which hold the same layers, are skipped."""
    if _is_graph_model(layer):
        for i, sub in enumerate(layer.layers):
            yield f"layers/{i}", sub
    tracker = getattr(layer, "_tracker", None)
    stores = [] if tracker is None else [store for _, store in tracker.config.values()]
    attributes = vars(layer)
    if isinstance(attributes.get("_modules"), dict):  # torch: a Module holds its sub-modules there
        attributes = {**attributes["_modules"], **attributes}
    # public attributes first, TensorFlow's tracking of the same layers (its checkpoint
    # dependencies, ``_self_unconditional_...``) last
    for key in sorted(attributes, key=lambda key: key.startswith("_") + key.startswith("_self_unconditional")):
        value = attributes[key]
        if isinstance(value, (keras.layers.Layer, *_CONTAINERS)) and not any(value is s for s in stores):
            yield key, value


def _keep_torch_modes(old, new, made_from) -> None:
    """On the torch backend, where every layer is a ``torch.nn.Module``: give each of the
    copy's layers, and the torch modules each holds itself (a wrapped torch layer, which
    reads its mode when the model is called directly), the ``training`` mode of the
    original's (``model.eval()`` or ``layer.eval()`` before converting).

    The layers are paired as :func:`_copy_state` paired them to copy their state
    (``made_from``, see :meth:`_Swap._made_from`: by position where a layer's tree and its
    copy's match, else by where each is held). A layer of the copy without a counterpart
    (a sub-layer that its owner's constructor made only in the copy) takes the mode of
    its nearest ancestor that has one (the root ``new`` has ``old``'s). The torch modules
    a layer holds itself take its counterpart's, one by one, where the two hold modules of
    the same classes in the same order, else the layer's mode."""
    if keras.backend.backend() != "torch" or not hasattr(new, "train"):
        return

    def own_modules(layer):  # the torch modules it holds, not through a layer of the tree
        found, stack = [], list(layer.children())[::-1]
        while stack:
            module = stack.pop()
            if isinstance(module, keras.layers.Layer):
                continue  # a layer of the tree: set on its own
            found.append(module)
            stack.extend(list(module.children())[::-1])
        return found

    modes = {}  # id(layer of the copy) -> the mode it was given
    queue = [(new, None)]
    while queue:  # the copy's tree, owners before the layers they hold
        layer, owner = queue.pop(0)
        if id(layer) in modes:
            continue
        a = made_from.get(id(layer), old if layer is new else None)
        mode = bool(a.training) if a is not None else modes[id(owner)]
        modes[id(layer)] = mode
        layer.training = mode
        held_a, held_b = (own_modules(a) if a is not None else []), own_modules(layer)
        if a is not None and [type(m) for m in held_a] == [type(m) for m in held_b]:
            for x, y in zip(held_a, held_b):
                y.training = x.training
        else:
            for y in held_b:
                y.training = mode
        queue += [(sub, layer) for sub in layer._flatten_layers(include_self=False, recursive=False)]


def _differing_attributes(old, new, decided=()) -> list:
    """``layer.attribute`` (with both values) for each public attribute of a plain value (a
    number, a string, a bool, None) that ``new``, a copy of ``old``, has otherwise: set
    after construction and absent from the config, no copy can know it. The attributes
    named in ``decided`` are left out (the copy's class sets them)."""
    differing = []
    ours = vars(new)
    for key, value in vars(old).items():
        if key.startswith("_") or key == "name" or not isinstance(value, (bool, int, float, str, type(None))):
            continue
        if key in decided:
            continue
        if key == "training" and keras.backend.backend() == "torch":
            continue  # torch's module mode, which the copy takes (_keep_torch_modes)
        if key not in ours or type(ours[key]) is not type(value) or not _same_value(value, ours[key]):  # NaN is NaN
            differing.append(f"{old.name}.{key} ({value!r}; the copy has {ours.get(key, 'no such attribute')!r})")
    return differing


@contextlib.contextmanager
def _not_compiled(model):
    """``model`` seen as not compiled, so that ``keras.models.clone_model`` of it (which
    compiles its copy from ``model``'s compile config, a fresh optimizer) does not
    compile the copy: a copy is never compiled (see :func:`convert`)."""
    compiled = getattr(model, "compiled", False) is True
    if compiled:
        model.compiled = False
    try:
        yield
    finally:
        if compiled:
            model.compiled = True


def _keep_trainable_flags(old, new):
    """The ``trainable`` flags that ``clone_model`` drops (a Functional model's own and its
    input layers'; the other layers' are in their configs) as ``old`` has them."""
    olds = list(old._flatten_layers(include_self=True, recursive=False))
    news = list(new._flatten_layers(include_self=True, recursive=False))
    if len(olds) != len(news):
        return
    for a, b in zip(olds, news):
        if _is_graph_model(a) or isinstance(a, keras.layers.InputLayer):
            _give_trainable(a, b)


def _give_trainable(a, b):
    """Give the layer ``b`` the ``trainable`` flag of ``a``, its own only: the private field,
    as the public setter would also set every layer inside (each is given its own)."""
    if b.trainable != a.trainable:
        b._trainable = a.trainable
        if b.trainable != a.trainable:  # a Keras that keeps the flag elsewhere: never silently
            raise RuntimeError(
                f"syncbn.keras: could not give the copy of {a.name!r} its trainable={a.trainable} flag "
                f"on this Keras {keras.__version__}; please report it")


def _inputs_like(model):
    """New inputs for a clone of the Functional ``model``, each a copy of its input layer
    (``clone_model`` would name them after the input tensors, ``keras_tensor_N``,
    where the layers are named ``input_layer_N``)."""
    layers = {id(layer.output): layer for layer in model.layers if isinstance(layer, keras.layers.InputLayer)}

    def like(x):
        layer = layers.get(id(x))
        if layer is None:
            return keras.Input(batch_shape=x.shape, dtype=x.dtype, name=x.name)
        return keras.layers.InputLayer.from_config(layer.get_config()).output

    return keras.tree.map_structure(like, model.input)


def _outer_scopes(layer, pairs=()):
    """The name scopes around ``layer``'s own in which it was built (``net/block`` for a
    layer whose path is ``net/block/conv``: built in the call of the custom layer ``block``
    in the model ``net``), entered in place of those open (:func:`_in_scopes`), so that a
    copy built in them gets the weight paths that ``layer``'s weights have in its tree.

    Where those scopes are, or lie inside, the scope of a layer of ``pairs`` (``(path,
    layer of the original's tree, its copy)``, as :func:`_pair_trees` gives them; the
    innermost such layer), that part is its copy's scope instead, once the copy is built (a
    copy not built yet leaves the original's): a layer that its owner's constructor names
    afresh in the copy (``block_1``) holds the weights of the layers built in it under its
    own name, as a call of the copy would, and never under the original's. The scopes come
    from ``layer.path`` (where its ``build()`` ran), else from its own first weight's path;
    a layer with neither (marked built by hand) gets none entered."""
    parent = _scope_around(layer)
    if parent is None:
        return contextlib.ExitStack()
    enclosing, copy_path = None, None  # the innermost layer's scope around, its copy's
    for _, a, b in pairs:
        path = getattr(a, "path", None)
        if (a is not layer and isinstance(path, str) and path
                and (parent == path or parent.startswith(path + "/"))
                and (enclosing is None or len(path) > len(enclosing))):
            enclosing, copy_path = path, getattr(b, "path", None)
    if enclosing is not None and isinstance(copy_path, str):
        parent = copy_path + parent[len(enclosing):]
    return _in_scopes(parent)


def _in_scopes(path):
    """Keras's name scopes ``path`` (``net/block``; ``""`` for none) entered, in place of
    those open around (the copy of a Sequential, which is built where the original was):
    the weights made within have the paths that scopes give, whatever is open outside."""
    stack = contextlib.ExitStack()
    try:
        from keras.src.backend.common import global_state
    except ImportError:  # pragma: no cover - another Keras: entered within those open
        global_state = None
    if global_state is not None:
        key = "name_scope_stack"  # what Keras's current path is made of
        stack.callback(global_state.set_global_attribute, key, global_state.get_global_attribute(key))
        global_state.set_global_attribute(key, [])
    for part in path.split("/"):
        if part:
            stack.enter_context(keras.name_scope(part))
    return stack


def _scope_around(layer):
    """The path of the name scopes around ``layer``'s own in which it was built (``""``
    for none), or None where that is unknown."""
    path = getattr(layer, "path", None)  # Keras's name scopes when build() ran, then its name
    if isinstance(path, str):
        head, _, own = path.rpartition("/")
        if own == layer.name:
            return head
    own = _own_variables(layer)  # made outside build() (in __init__): the first one's path
    parts = own[0].path.split("/") if own else []
    if len(parts) >= 2 and parts[-2] == layer.name:
        return "/".join(parts[:-2])
    return None


def _build_as_built(old, new, verb):
    """Build each layer of ``new``'s tree (a fresh copy of ``old`` from its config) whose
    counterpart in ``old``'s tree (paired as :func:`_pair_trees` pairs them) is built and it
    is not, owners before the layers they hold, as a ``.keras`` file rebuilds a layer:
    ``build_from_config`` of the original's ``get_build_config()`` (the input shape it was
    built for), in the name scopes it was built in, its owners' copies'
    (:func:`_outer_scopes`). A layer built by hand (``layer.build(shape)``) or by a call,
    held by a model not built (a Sequential without an ``Input``, a subclassed model not yet
    called), is copied from its config unbuilt, and would otherwise make fresh weights when
    the copy is first called. Each layer is built as the original's is, and no other: called
    later, the copy builds what the original would (a layer marked built by hand, whose
    ``build()`` never ran, holding no state itself, is marked so in the copy). Where such a
    layer holds state (weights that no ``build()`` makes), or building a copy fails or
    leaves it unbuilt, raises ``ValueError`` naming it."""
    done = set()
    while True:
        pairs, _, _ = _pair_trees(old, new)
        todo = [(a, b) for _, a, b in pairs if a.built and not b.built and id(b) not in done]
        if not todo:
            return
        a, b = todo[0]
        done.add(id(b))
        where = f"{a.name!r} ({type(a).__name__})" + ("" if a is old else f" in {old.name!r}")
        cannot = (f"{verb}: cannot copy the state of {where}: it is built, but its copy, rebuilt from "
                  "its config, is not")
        fix = (f"Build the model before {verb}ing it: call it once on a batch (or start a Sequential "
               "with keras.Input(shape)), so that its layers are built where they are called")
        config = a.get_build_config()
        if not config and not _state_held(a):
            # marked built by hand, its own build() never run (that records an input shape,
            # none for a build() without arguments): the flag is all it has, and the copy
            # gets it, so that no build() of the copy's makes its sub-layers afresh later
            b.built = True
            continue
        if not config:
            raise ValueError(
                f"{cannot}, and no build() of it ran (its get_build_config() is empty: it was marked "
                "built by hand), so the copy would start from fresh weights, as a .keras file would. "
                "Make its weights in its build(), from the input shape (or in its __init__())")
        try:
            with _outer_scopes(a, pairs), warnings.catch_warnings():
                # Keras's default build() (a layer without its own) warns that it leaves the
                # sub-layers unbuilt: those built in the original are built next, one by one
                warnings.filterwarnings("ignore", message=r"`build\(\)` was called on layer")
                b.build_from_config(config)
        except Exception as err:
            raise ValueError(
                f"{cannot}, and building the copy from the original's build config {config} failed "
                f"({type(err).__name__}: {err}), so the copy would start from fresh weights. {fix}"
            ) from err
        if not b.built:
            raise ValueError(
                f"{cannot}, and it stayed unbuilt after build_from_config({config}), so it would "
                f"start from fresh weights. {fix}")


def _build_like(new, old, verb):
    """Build ``new`` (a fresh copy of ``old``) by calling it on symbolic inputs of the
    shapes ``old`` was built with, which builds its sublayers as a real call would."""
    shapes = getattr(old, "_build_shapes_dict", None)
    if not shapes:
        raise ValueError(
            f"{verb}: {old.name!r} ({type(old).__name__}) is built but its input shape "
            f"is unknown; {verb} it before building it, or wrap it in a Functional model"
        )
    new(*(keras.KerasTensor(shape) for shape in shapes.values()))
