"""Synchronized batch normalization for Keras 3, on the TensorFlow, JAX and PyTorch
backends.

- :class:`SyncBatchNormalization`: ``keras.layers.BatchNormalization`` whose training
  statistics span every replica's batch, exact for uneven and empty replicas and for
  masks, numerically stable far from zero, one collective per layer call each way.
- :func:`convert`: a copy of a model with every BatchNormalization synchronized.

Importing this package imports Keras (and so its backend) but never torch unless the
Keras backend is torch.

Modules, one concern each: ``moments`` (local statistics, pack and merge),
``replicas`` (which replicas to synchronize with and the collectives, per backend),
``layer`` (the layer), ``convert`` (model conversion).
"""

from .convert import convert
from .layer import SyncBatchNormalization

__all__ = ["SyncBatchNormalization", "convert"]
