"""Row copies between tables of buffers, as one unit: the Triton kernel (``kernel.py``), its plan and
launcher (``launcher.py``) and the PyTorch reference that defines the result (``naive.py``). The
tables themselves are :class:`~kvpool.kernels.row_table.RowTable` (shared with the state commit).
Rules: docs/contract.md, "Moves and CPU copies"."""

from kvpool.kernels.copy_rows.launcher import RowTable, checked_copy, copy_rows, launch_copy_rows, plan_copy
from kvpool.kernels.copy_rows.naive import copy_rows_reference

__all__ = ["RowTable", "checked_copy", "copy_rows", "copy_rows_reference", "launch_copy_rows", "plan_copy"]
