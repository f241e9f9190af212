"""What the examples' command lines share: the element types a dtype option names (``DTYPES``) and
a ``--device`` this torch can use."""

from __future__ import annotations

import torch

from kvpool.checks import resolve_device

#: The element types the examples' dtype options take, by the name on the command line.
DTYPES = {
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    # The FP8 formats of MI300-class GPUs (SGLang's fp8_e4m3 cache on gfx942 stores e4m3fnuz).
    "fp8_e4m3fnuz": torch.float8_e4m3fnuz,
    "fp8_e5m2fnuz": torch.float8_e5m2fnuz,
}


def check_device(value: str) -> None:
    """Raise a one-line ``ValueError`` naming ``--device`` unless this torch can use ``value``
    (``'cuda'`` on a CPU-only torch or without a GPU, or a name torch does not know)."""
    try:
        resolve_device(value, "--device")
    except RuntimeError as e:  # torch.device's own message for a name it does not know
        raise ValueError(f"--device must be a torch device (cpu, cuda, cuda:N), got {value!r}: {e}") from None
