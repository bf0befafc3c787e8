"""Synchronized batch normalization for Keras 3, on the TensorFlow, JAX and PyTorch
backends.

- :class:`SyncBatchNormalization`: ``keras.layers.BatchNormalization`` whose training
  statistics span every replica's batch, exact for uneven and empty replicas and for
  masks, numerically stable far from zero, one collective per layer call each way.
- :func:`convert`: a copy of a model with every BatchNormalization synchronized;
  :func:`revert`: its inverse, a copy with every one plain again.
- :class:`SkipMismatchedSteps`, :class:`MismatchCheck`, :func:`check_agreement`: for
  TensorFlow steps compiled by XLA, where a layer disagreement across replicas cannot
  raise inside the step (see ``mismatch``).

Importing this package imports Keras (and so its backend) but never torch unless the
Keras backend is torch.

Modules, one concern each: ``moments`` (local statistics, pack and merge),
``replicas`` (which replicas to synchronize with and the collectives, per backend),
``layer`` (the layer), ``mismatch`` (the verdicts XLA cannot raise, and what acts on
them), ``convert`` (model conversion and its inverse).
"""

from .convert import convert, revert
from .layer import SyncBatchNormalization
from .mismatch import MismatchCheck, SkipMismatchedSteps, allow_xla, check_agreement

__all__ = ["MismatchCheck", "SkipMismatchedSteps", "SyncBatchNormalization", "allow_xla", "check_agreement", "convert",
           "revert"]
