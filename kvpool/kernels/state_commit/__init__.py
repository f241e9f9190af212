"""Committing speculative state, as one unit: the Triton kernel (``kernel.py``) and its plan,
launcher and PyTorch reference (``launcher.py``). Rows are addressed through
:class:`~kvpool.kernels.row_table.RowTable`, as the row copy's are."""
