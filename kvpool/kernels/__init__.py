"""Kernels and their launchers: the K/V write (``store_kv*.py``: kernel, plan, writer, operators and
public functions, reference, checks), the gate, the row copy (``row_table.py``, ``copy_rows*.py``),
and what they share (``launch.py``, ``tuning.py``, ``formats.py``)."""

from kvpool.errors import FusedPathUnavailable
from kvpool.kernels.gate import fused_eligibility
from kvpool.kernels.store_kv import PathStats
from kvpool.kernels.store_kv_naive import quantize
from kvpool.kernels.store_kv_op import fused_fp8_set_kv_buffer, reference_set_kv_buffer

__all__ = [
    "FusedPathUnavailable",
    "PathStats",
    "fused_eligibility",
    "fused_fp8_set_kv_buffer",
    "quantize",
    "reference_set_kv_buffer",
]
