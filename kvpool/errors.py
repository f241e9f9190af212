"""The exceptions kvpool raises beyond Python's own (``ValueError``, ``TypeError``, ``IndexError``);
docs/contract.md, "Bad input", says when."""

from __future__ import annotations


class FusedPathUnavailable(RuntimeError):
    """The fused kernel was demanded (``fused="always"``) but the gate refused; the message gives why."""


class IntegrityError(RuntimeError):
    """An allocator's, table's or cache's bookkeeping contradicts itself (``check_integrity``)."""
