"""Checks of plain constructor arguments, shared by every pool, allocator and table.

Each raises ``ValueError`` naming the argument, what it must be and what it was, so a bad
configuration fails at construction with the caller's own words in the message.
"""

from __future__ import annotations

import torch


def positive_int(value: object, name: str) -> int:
    """``value`` if it is an int >= 1 (bools are not ints here)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def non_negative_int(value: object, name: str) -> int:
    """``value`` if it is an int >= 0 (bools are not ints here)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


def resolve_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device``; a bare ``"cuda"`` names the current CUDA device, so that
    tensors made later compare equal to it."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev
