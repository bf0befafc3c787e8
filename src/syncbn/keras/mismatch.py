"""What a layer disagreement leaves behind where TensorFlow cannot raise (XLA), and how
a training loop acts on it.

Inside a step compiled by XLA (``jit_compile=True``, and every TPU step) TensorFlow
drops asserts, so the fingerprint check of :mod:`syncbn.keras.replicas` cannot stop the
step. There a disagreeing call still (1) leaves the moving statistics exactly as they
were (the layer's update is a ``where`` on the verdict) and makes its output NaN, and
(2) writes its verdict into a small per-layer TensorFlow variable, the **verdict
record** (not a Keras weight: it is in no weights file or checkpoint). Every replica
sees the same summed fingerprint, so every replica writes the same verdict. What
reads it:

- :class:`SkipMismatchedSteps`, an optimizer wrapper: inside the compiled step it
  applies the inner optimizer only when no synchronized call of the step disagreed,
  so a disagreeing step changes no weight, no optimizer state and no iteration count;
- :func:`check_agreement` (after each step of a custom loop) and the callback
  :class:`MismatchCheck` (``fit``): they read the records on the host and raise
  :class:`syncbn.core.fingerprint.LayerMismatchError` on every worker.

A record is sticky: once set, it stays set (after a disagreement, end the program;
TensorFlow's collectives say so themselves). Outside XLA the check raises at once
(eagerly, or from the traced assert) and the records are never needed.
"""

from __future__ import annotations

import weakref

import keras

from syncbn.core import fingerprint as lf

__all__ = ["MismatchCheck", "SkipMismatchedSteps", "allow_xla", "check_agreement"]

# Record layout (float64, every value an exact integer): disagreeing calls so far, then
# about the first: backward (0/1), call index, replicas, this replica's number (-1:
# unknown), the summed fingerprint.
COUNT, BACKWARD, INDEX, WORLD, RANK, SUMS = range(6)
RECORD_SIZE = SUMS + lf.SIZE

_records = weakref.WeakKeyDictionary()  # layer -> (name, channels, record variable)
_traced = weakref.WeakKeyDictionary()  # traced graph -> [record variables written in it]


def create(layer, channels):
    """The verdict record of ``layer`` (TensorFlow backend), made once when it is built:
    under a ``tf.distribute`` strategy one copy per replica that each replica writes
    alone (no collective) and the host reads from the first."""
    import tensorflow as tf

    if layer in _records:
        return
    with tf.init_scope():
        record = tf.Variable(
            tf.zeros((RECORD_SIZE,), tf.float64),
            trainable=False,
            name="syncbn_verdict",
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
        )
    _records[layer] = (layer.name, int(channels), record)


def forget(layer):
    """Drop ``layer``'s verdict record, if it has one (a layer that ``revert`` made a
    plain BatchNormalization in place)."""
    _records.pop(layer, None)


def keep_fit_off_xla(layer):
    """Under a ``tf.distribute`` strategy of more than one replica, mark ``layer`` as
    not supporting XLA (Keras's public ``Layer.supports_jit``), so that ``fit``,
    ``evaluate`` and ``predict`` never compile its steps with XLA, even with
    ``compile(jit_compile=True)`` (Keras warns "Model doesn't support
    `jit_compile=True`" and runs the step as a plain ``tf.function``). There the
    fingerprint's assert stops a disagreeing step on every replica before the
    optimizer runs; inside XLA it would be compiled away. (Keras's own default,
    ``jit_compile="auto"``, never uses XLA under a strategy anyway.) A program that
    wants XLA under a strategy opts in after building the model, by setting
    ``layer.supports_jit = True`` on the synchronized layers (:func:`allow_xla`), together
    with :class:`SkipMismatchedSteps` and :class:`MismatchCheck`. Called when the layer is
    made and when it is built, whichever happens inside the strategy's scope."""
    import tensorflow as tf

    if tf.distribute.has_strategy() and tf.distribute.get_strategy().num_replicas_in_sync > 1:
        layer.supports_jit = False


def allow_xla(model):
    """Opt in to XLA under a strategy: set ``supports_jit = True`` on every built
    ``SyncBatchNormalization`` of ``model`` (a Keras model or layer: those whose moving
    mean is among its weights), so that ``compile(jit_compile=True)`` compiles with XLA.
    Only together with :class:`SkipMismatchedSteps` and :class:`MismatchCheck` (or
    :func:`check_agreement`): inside XLA a layer disagreement cannot raise. Call it
    after the model is built (TensorFlow backend). Returns the number of layers."""
    if keras.backend.backend() != "tensorflow":
        raise RuntimeError("syncbn.keras.allow_xla: only the TensorFlow backend keeps fit off XLA "
                           f"(this is the {keras.backend.backend()} backend: nothing to allow)")
    layers = [layer for layer, _ in _entries_of(model)]
    if not layers:
        raise ValueError("syncbn.keras.allow_xla: the model has no built SyncBatchNormalization "
                         "layer; build it first (call it on data, or model.build(shape))")
    for layer in layers:
        layer.supports_jit = True
    return len(layers)


def write(layer, ok, sums, tag, world, rank, backward):
    """Record a traced call's verdict: unchanged where ``ok``, else the count plus one
    and, for the first disagreeing call, its details. Returns the assign op (None
    without a record)."""
    import tensorflow as tf

    entry = _records.get(layer)
    if entry is None:
        return None
    record = entry[2]
    # Known to the graph being traced and the ones it is nested in (a tf.function or a
    # cond branch inside the step), where the optimizer may be applied.
    graph = tf.compat.v1.get_default_graph()
    while graph is not None and graph.building_function:
        records = _traced.setdefault(graph, [])
        if not any(r is record for r in records):
            records.append(record)
        graph = graph.outer_graph
    old = tf.convert_to_tensor(record)
    details = tf.constant([float(backward), float(tag.index), float(world), float(-1 if rank is None else rank)],
                          tf.float64)
    first = tf.concat([details, tf.cast(sums, tf.float64)], axis=0)
    new = tf.concat([old[:1] + 1.0, tf.where(tf.equal(old[COUNT], 0.0), first, old[1:])], axis=0)
    return record.assign(tf.where(ok, old, new))


def step_agrees():
    """A boolean tensor: no synchronized call traced so far in the current graph (this
    step, functions nested in it included) has a disagreement on record. True where
    nothing was recorded. Called from a graph nested in the step (a ``tf.cond`` branch
    around ``apply_gradients``, as a ``LossScaleOptimizer`` or gradient accumulation
    makes, or a ``tf.function`` of its own), it reads the records of the graphs it is
    nested in too, where the step's calls were traced."""
    import tensorflow as tf

    records = []
    graph = tf.compat.v1.get_default_graph()
    while graph is not None:
        records.extend(r for r in _traced.get(graph, []) if not any(r is seen for seen in records))
        if not graph.building_function:
            break
        graph = graph.outer_graph
    if not records:
        return tf.constant(True)
    counts = [tf.convert_to_tensor(record)[COUNT] for record in records]
    return tf.reduce_all(tf.equal(tf.stack(counts), 0.0))


def _entries_of(model):
    """``(layer, record entry)`` of every built synchronized layer of ``model`` (a Keras
    model or layer: those whose moving mean is among its weights), or of this process
    (``model`` None)."""
    entries = list(_records.items())
    if model is None:
        return entries
    mine = {id(w) for w in model.weights}
    return [(layer, entry) for layer, entry in entries if id(layer.moving_mean) in mine]


def check_agreement(model=None):
    """Raise :class:`~syncbn.core.fingerprint.LayerMismatchError` if a synchronized
    call of a ``SyncBatchNormalization`` disagreed across the replicas inside an
    XLA-compiled step (TensorFlow backend; nothing to check elsewhere): of those in
    ``model`` (a Keras model or layer: those whose moving mean is among its weights),
    or of every one in this process (``model`` None). Every worker reads the same
    verdicts, so every worker raises alike. Call it after each compiled training step
    of a custom loop; ``fit`` does it with :class:`MismatchCheck`. One small host read
    per layer."""
    for _, (name, channels, record) in _entries_of(model):
        values = record.numpy()
        if values[COUNT] == 0:
            continue
        tag = lf.Tag(lf.remember(name, channels), int(values[INDEX]))
        rank = int(values[RANK])
        message = lf.mismatch_message(
            tag, [int(round(v)) for v in values[SUMS:]], int(values[WORLD]), None if rank < 0 else rank,
            bool(values[BACKWARD]), who="replica", group="the replicas", what="layer", features="channels")
        raise lf.LayerMismatchError(
            f"{message} Seen after an XLA-compiled step ({int(values[COUNT])} disagreeing call(s) of "
            f"'{name}' so far); end the program.")


class MismatchCheck(keras.callbacks.Callback):
    """``fit`` callback: :func:`check_agreement` on the model after every training
    batch, so that a layer disagreement inside an XLA-compiled step
    (``jit_compile=True``) ends training with
    :class:`~syncbn.core.fingerprint.LayerMismatchError` on every worker. Pair it with
    :class:`SkipMismatchedSteps` so that the step it reports changed no weight."""

    def on_train_batch_end(self, batch, logs=None):
        check_agreement(self.model)


@keras.saving.register_keras_serializable(package="syncbn", name="SkipMismatchedSteps")
class SkipMismatchedSteps(keras.optimizers.Optimizer):
    """An optimizer that applies ``inner_optimizer`` only in steps in which every
    synchronized layer call agreed across the replicas; in a step where one disagreed
    nothing changes (weights, the inner optimizer's state and its iteration count stay
    exactly as they were). For TensorFlow steps compiled by XLA, where the disagreement
    cannot raise; elsewhere the step has already failed and this wrapper only passes
    the gradients on. The verdict it reads is the one written earlier in the same traced
    step (the forward and the backward of every synchronized call), so call
    ``apply_gradients`` in the same ``tf.function`` as the forward and the gradient,
    as ``fit`` does.

    Args:
        inner_optimizer: the ``keras.optimizers.Optimizer`` to apply.
    """

    def __init__(self, inner_optimizer, name=None):
        if keras.backend.backend() != "tensorflow":
            raise ValueError(
                f"SkipMismatchedSteps is for the TensorFlow backend (steps compiled by XLA), got the "
                f"{keras.backend.backend()} backend: there a layer disagreement raises at once (torch) or "
                f"cannot happen (JAX: one program over the sharded batch); use the optimizer itself")
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise ValueError(
                f"SkipMismatchedSteps: inner_optimizer must be a keras.optimizers.Optimizer, got "
                f"{type(inner_optimizer).__name__}")
        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = inner_optimizer

    def build(self, var_list):
        self.inner_optimizer.build(var_list)
        super().build(var_list)

    @property
    def variables(self):
        # The inner optimizer's state only: saved optimizer states match the unwrapped
        # optimizer's (this wrapper's own counters are never used).
        return self.inner_optimizer.variables

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    def apply(self, grads, trainable_variables=None):
        if not self.built:
            self.build(trainable_variables)
            self.built = True
        import tensorflow as tf

        agrees = step_agrees()

        def apply():
            self.inner_optimizer.apply(grads, trainable_variables)
            return tf.constant(True)

        def skip():
            return tf.constant(False)

        replica = tf.distribute.get_replica_context()
        if (replica is None or not tf.distribute.has_strategy()
                or tf.__internal__.distribute.strategy_supports_no_merge_call()):
            # No strategy, or one whose update needs no cross-replica call: every
            # replica takes the same branch (they hold the same verdict).
            tf.cond(agrees, apply, skip)
            return

        # A strategy that merges in a cross-replica call (MirroredStrategy): the branch
        # must be taken there, around the inner optimizer's per-replica calls.
        def cross_replica(distribution, agrees, grads, trainable_variables):
            first = distribution.experimental_local_results(agrees)[0]

            def apply_all():
                distribution.extended.call_for_each_replica(
                    self.inner_optimizer.apply, args=(grads, trainable_variables))
                return tf.constant(True)

            tf.cond(first, apply_all, skip)

        replica.merge_call(cross_replica, args=(agrees, grads, trainable_variables))

    def get_config(self):
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"), custom_objects=custom_objects)
        return cls(inner, **config)
