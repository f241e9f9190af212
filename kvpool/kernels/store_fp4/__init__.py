"""The FP4 write, as one unit: SGLang's KV FP4 format (e2m1 values, one exponent scale byte per 16
elements), its PyTorch reference quantizer, dequantizer and write (``naive.py``), the fused Triton
write (``kernel.py``) and the one decision between them (``writer.py``). What it stores:
docs/contract.md, "FP4 pools"."""

from kvpool.kernels.formats import FP4_DTYPE
from kvpool.kernels.store_fp4.naive import (
    E2M1_BOUNDS,
    E2M1_MAX,
    E2M1_VALUES,
    FP4_BLOCK,
    NON_FINITE_SCALE,
    dequantize_fp4,
    fp4_block_exponents,
    fp4_scale_tensor,
    quantize_fp4,
    write_fp4_reference,
)

__all__ = [
    "E2M1_BOUNDS",
    "E2M1_MAX",
    "E2M1_VALUES",
    "FP4_BLOCK",
    "FP4_DTYPE",
    "NON_FINITE_SCALE",
    "dequantize_fp4",
    "fp4_block_exponents",
    "fp4_scale_tensor",
    "quantize_fp4",
    "write_fp4_reference",
]
