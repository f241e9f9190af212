"""FP8 with a scale per token and head, computed when the row is written (no calibration): its
PyTorch reference quantizer, dequantizer and write (``naive.py``), the fused Triton write
(``kernel.py``) and the one decision between them (``writer.py``). What it stores: docs/contract.md,
"Per-token-head FP8"."""

from kvpool.kernels.store_fp8_token.naive import (
    MIN_TOKEN_SCALE,
    TOKEN_HEAD_DTYPES,
    dequantize_token_head,
    mapped_slots,
    quantize_token_head,
    token_head_scales,
    write_token_head_reference,
)

__all__ = [
    "MIN_TOKEN_SCALE",
    "TOKEN_HEAD_DTYPES",
    "dequantize_token_head",
    "mapped_slots",
    "quantize_token_head",
    "token_head_scales",
    "write_token_head_reference",
]
