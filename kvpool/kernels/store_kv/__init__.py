"""The K/V write, as one unit: the Triton kernel (``kernel.py``), how its work is cut into programs
(``plan.py``), the writer that checks, classifies and launches (``writer.py``), the custom operators
and public functions (``op.py``), the PyTorch reference that defines the result (``naive.py``) and the
argument checks (``checks.py``). What it writes: docs/contract.md, "The write"."""
