"""The memory layout of an activation: which of torch's memory formats a tensor is laid
out in, so that outputs and gradients keep the input's."""

from __future__ import annotations

import torch

__all__ = ["memory_format"]


def memory_format(x: torch.Tensor):
    """The memory format ``x`` is laid out in (channels-last only when not also standard)."""
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
        return torch.channels_last
    if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d) and not x.is_contiguous():
        return torch.channels_last_3d
    return torch.contiguous_format
