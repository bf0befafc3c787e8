"""What every framework's layer shares and none of them needs a framework for.

- :mod:`~syncbn.core.fingerprint`: the layer fingerprint's digit arithmetic (which layer
  call a rank is in, checked inside the statistics' all-reduce) and
  :class:`~syncbn.core.fingerprint.LayerMismatchError`;
- :mod:`~syncbn.core.moments`: the moment merge, its derivation and error analysis,
  which the PyTorch, Keras and Flax layers each implement with their own ops.

Imports nothing but the standard library (and numpy where said).
"""
