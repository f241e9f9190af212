"""The NVFP4 write, as one unit: two-level NVFP4 (e2m1 values, one e4m3fn block scale per 16
elements, one float32 global scale per tensor), its PyTorch reference quantizer, dequantizer and
write (``naive.py``), the fused Triton write (``kernel.py``) and the one decision between them
(``writer.py``). What it stores: docs/contract.md, "NVFP4"."""

from kvpool.kernels.store_nvfp4.naive import (
    E2M1_RNE_BOUNDS,
    E4M3_MAX,
    dequantize_nvfp4,
    e2m1_codes,
    e4m3_bytes,
    quantize_nvfp4,
    write_nvfp4_reference,
)

__all__ = [
    "E2M1_RNE_BOUNDS",
    "E4M3_MAX",
    "dequantize_nvfp4",
    "e2m1_codes",
    "e4m3_bytes",
    "quantize_nvfp4",
    "write_nvfp4_reference",
]
