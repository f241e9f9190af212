"""The allocators' bookkeeping in one launch per call: the Triton kernels (``kernel.py``) and their
launchers (``launcher.py``). The PyTorch path that defines the same results lives with the
allocators (:mod:`kvpool.pools.allocator`); rules: docs/contract.md, "Allocators and the request
table"."""

from kvpool.kernels.allocator.launcher import give_back, hand_out, on_kernels

__all__ = ["give_back", "hand_out", "on_kernels"]
