"""The Keras fingerprint check in one process, with a stand-in for the replica context
whose all-reduce adds what another replica would send. Run by ``test_keras_mismatch.py``:

    python tests/keras_mismatch_checks.py --out R.json --checks NAME...
"""

from __future__ import annotations

import os

import numpy as np

from keras_harness import block_torch, worker_main

CHECKS = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def setup():
    block_torch()
    os.environ["KERAS_BACKEND"] = "tensorflow"


class TwoReplicas:
    """A replica context of 2 replicas in which the other replica sends ``other``'s
    fingerprint and zeros for the values."""

    num_replicas_in_sync = 2
    _replica_id_in_sync_group = 0

    def __init__(self, other):
        self.other = other

    def all_reduce(self, op, value):
        import tensorflow as tf

        from syncbn import layer_fingerprint as lf

        size = int(value.shape[0]) - lf.SIZE
        return value + tf.concat([tf.zeros((size,), value.dtype), tf.constant(lf.values(self.other), value.dtype)], 0)


@check
def verdicts():
    """Agreeing tags return the sum; disagreeing ones raise LayerMismatchError eagerly
    (naming both layers), an InvalidArgumentError with the same words in tf.function,
    and under XLA (which compiles the assert away) the sums are all NaN: never finite
    values from a disagreeing call."""
    import tensorflow as tf

    from syncbn import layer_fingerprint as lf
    from syncbn.keras import replicas

    mine = lf.Tag(lf.remember("mine", 3), 2)
    theirs = lf.Tag(lf.remember("theirs", 3), 2)
    value = tf.constant([1.0, 2.0, 3.0], tf.float64)
    info = {}
    same = replicas.tf_checked_all_reduce(TwoReplicas(mine), mine, False)
    assert np.array_equal(same(value).numpy(), value.numpy())
    assert np.array_equal(tf.function(same)(value).numpy(), value.numpy())
    assert np.array_equal(tf.function(same, jit_compile=True)(value).numpy(), value.numpy())
    other = replicas.tf_checked_all_reduce(TwoReplicas(theirs), mine, True)
    try:
        other(value)
        raise AssertionError("eager: no error")
    except lf.LayerMismatchError as err:
        info["eager"] = str(err)
    assert "(backward)" in info["eager"], info
    assert "replica 0 called layer 'mine' (3 channels), call 2" in info["eager"], info
    assert "replica 1 called layer 'theirs' (3 channels), call 2" in info["eager"], info
    try:
        tf.function(other)(value)
        raise AssertionError("tf.function: no error")
    except tf.errors.InvalidArgumentError as err:
        info["function"] = str(err).split("\n")[-3:]
    assert "this replica called layer" in " ".join(info["function"]), info
    try:
        got = tf.function(other, jit_compile=True)(value).numpy()
        assert np.all(np.isnan(got)), got
        info["xla"] = "assert compiled away; sums NaN"
    except tf.errors.InvalidArgumentError as err:
        info["xla"] = "raised: " + str(err)[-200:]
    return info


@check
def call_index():
    """In a traced graph the index counts this replica's synchronized calls so far; a new
    graph starts again at 0; eager calls have index 0."""
    import tensorflow as tf

    from syncbn.keras import replicas

    ctx = TwoReplicas(None)
    seen = []

    @tf.function
    def traced():
        seen.append([replicas.tf_tag("a", 3, ctx).index for _ in range(3)])
        return tf.constant(0)

    traced()
    tf.function(lambda: traced.python_function())()
    eager = replicas.tf_tag("a", 3, ctx).index
    assert seen == [[0, 1, 2], [0, 1, 2]] and eager == 0, (seen, eager)
    return {"traced": seen, "eager": eager}


if __name__ == "__main__":
    worker_main(CHECKS, setup=setup)
