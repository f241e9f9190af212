"""Write paths: the fused Triton kernel and its launcher, the PyTorch reference, the gate, and the
writer that decides between them."""

from kvpool.kernels.gate import fused_eligibility
from kvpool.kernels.reference import quantize
from kvpool.kernels.write import FusedPathUnavailable, PathStats, fused_fp8_set_kv_buffer, reference_set_kv_buffer

__all__ = [
    "FusedPathUnavailable",
    "PathStats",
    "fused_eligibility",
    "fused_fp8_set_kv_buffer",
    "quantize",
    "reference_set_kv_buffer",
]
