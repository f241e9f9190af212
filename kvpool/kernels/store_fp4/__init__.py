"""SGLang's KV FP4 format (e2m1 values, one exponent scale byte per 16 elements): the PyTorch
reference quantizer and dequantizer (``naive.py``) and the reference write into an FP4 pool."""

from kvpool.kernels.store_fp4.naive import (
    E2M1_BOUNDS,
    E2M1_MAX,
    E2M1_VALUES,
    FP4_BLOCK,
    FP4_DTYPE,
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
