"""Write paths: the fused Triton kernel and its launcher, the PyTorch reference, the gate."""

from kvpool.kernels.gate import fused_eligibility
from kvpool.kernels.reference import quantize, reference_set_kv_buffer
from kvpool.kernels.store_kv import FusedPathUnavailable, fused_fp8_set_kv_buffer

__all__ = [
    "FusedPathUnavailable",
    "fused_eligibility",
    "fused_fp8_set_kv_buffer",
    "quantize",
    "reference_set_kv_buffer",
]
