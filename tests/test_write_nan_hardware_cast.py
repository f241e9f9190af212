"""The write's hardware-cast branch stores every NaN as a bf16 cache's canonical NaN by itself.

On NVIDIA sm_89+ the write kernel converts into a bf16 cache with the GPU's own conversion
(``SOFT_CAST`` off) and selects no NaN pattern: ``cvt.rn.bf16.f32`` writes every NaN, of either sign
and any payload, as 0x7FFF. These tests run that branch alone (the writer is asked for the native
cast and must have taken it) on every fp16 NaN pattern and on float32 NaNs of every class, and
expect 0x7FFF in every element. They fail if the branch stops being the one taken or if the
conversion stores any other NaN bits. The integer encoder (``SOFT_CAST`` on) gets the same inputs as
a control. (A bf16 input into a bf16 cache converts nothing: its NaN bits are copied as they are,
tests/test_write_nan_and_autograd.py checks that.) CUDA only: the interpreter never takes the native branch.
"""

from __future__ import annotations

import pytest
import torch

from kvassert import bits, gpu, poison_
from kvpool.config import KernelOptions
from kvpool.kernels.store_kv.layout import native_cast_ok, storage_view
from kvpool.kernels.store_kv.writer import writer_for
from kvpool.write_types import FUNCTION_NAMES

pytestmark = [gpu]

#: The bits a bf16 cache holds for a NaN a write converts (formats.NAN_BITS, spelled out).
BF16_NAN = 0x7FFF
HEADS, DIM = 2, 64


def _every_nan(dtype: torch.dtype) -> torch.Tensor:
    """Every NaN bit pattern of a 16-bit format, both signs, as a 1-D tensor of ``dtype``."""
    every = torch.arange(65536, dtype=torch.int32, device="cuda").to(torch.int16).view(dtype)
    return every[torch.isnan(every)]


def _float32_nans() -> torch.Tensor:
    """Float32 NaNs of both signs: quiet and signalling, the lowest and highest payloads, and 4096
    random payloads."""
    fixed = [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FBFFFFF, 0xFFBFFFFF]
    g = torch.Generator(device="cuda").manual_seed(35)
    payload = torch.randint(1, 1 << 23, (4096,), device="cuda", generator=g, dtype=torch.int64)
    sign = torch.randint(0, 2, (4096,), device="cuda", generator=g, dtype=torch.int64) << 31
    raw = torch.cat((torch.tensor(fixed, device="cuda", dtype=torch.int64), sign | (0xFF << 23) | payload))
    return (raw - ((raw >= 1 << 31).to(torch.int64) << 32)).to(torch.int32).view(torch.float32)


def _rows_of(values: torch.Tensor) -> torch.Tensor:
    """[T, HEADS, DIM] holding ``values`` in order (padded with the first value to whole rows)."""
    per_row = HEADS * DIM
    pad = (-values.numel()) % per_row
    flat = torch.cat((values, values[:1].expand(pad)))
    return flat.reshape(-1, HEADS, DIM)


def _write(x: torch.Tensor, soft_cast: bool) -> tuple[torch.Tensor, torch.Tensor, object, tuple[int, int]]:
    """Write ``x`` as K and V into poisoned bf16 caches through a writer asked for this cast: the
    written rows, the writer, and the (fused, reference) calls the write added to its statistics."""
    t = x.shape[0]
    k_cache = poison_(torch.empty(t + 5, HEADS, DIM, dtype=torch.bfloat16, device="cuda"))
    v_cache = poison_(torch.empty(t + 5, HEADS, DIM, dtype=torch.bfloat16, device="cuda"))
    writer = writer_for(k_cache, v_cache, "always", options=KernelOptions(soft_cast=soft_cast))
    loc = torch.randperm(t, device="cuda", generator=torch.Generator(device="cuda").manual_seed(t)) + 3
    before = (writer.stats.fused_calls, writer.stats.reference_calls)
    writer.write(storage_view(k_cache), storage_view(v_cache), loc, x, x, None, None, FUNCTION_NAMES)
    torch.cuda.synchronize()
    added = (writer.stats.fused_calls - before[0], writer.stats.reference_calls - before[1])
    return k_cache[loc], v_cache[loc], writer, added


INPUTS = {
    "every_fp16_nan": lambda: _every_nan(torch.float16),
    "float32_nans": _float32_nans,
}


def test_this_gpu_takes_the_native_cast():
    """The premise of the file: on this device the writer's default is the hardware cast."""
    if not native_cast_ok(torch.device("cuda")):
        pytest.skip(f"no native FP8/bf16 conversion on sm_{''.join(map(str, torch.cuda.get_device_capability()))}")
    k_cache = torch.zeros(4, HEADS, DIM, dtype=torch.bfloat16, device="cuda")
    assert writer_for(k_cache, k_cache.clone(), "always").soft_cast is False


@pytest.mark.parametrize("soft_cast", [False, True], ids=["native", "soft"])
@pytest.mark.parametrize("inputs", list(INPUTS))
def test_every_nan_lands_as_the_canonical_bf16_nan(inputs, soft_cast):
    if not soft_cast and not native_cast_ok(torch.device("cuda")):
        pytest.skip("this GPU has no native conversion: the writer takes the integer encoder")
    values = INPUTS[inputs]()
    assert bool(torch.isnan(values).all()) and values.numel() > 100
    x = _rows_of(values)
    k_rows, v_rows, writer, added = _write(x, soft_cast)
    assert writer.soft_cast is soft_cast, "the writer took the other encoder"
    assert added == (1, 0), f"the write must take the fused path once, took (fused, reference) = {added}"
    for name, rows in (("K", k_rows), ("V", v_rows)):
        stored = bits(rows).to(torch.int32) & 0xFFFF
        wrong = stored != BF16_NAN
        if bool(wrong.any()):
            first = int(torch.nonzero(wrong.reshape(-1))[0])
            given = bits(x.reshape(-1)[first : first + 1]).to(torch.int64).item() & ((1 << (8 * x.element_size())) - 1)
            pytest.fail(
                f"{name}: {int(wrong.sum())} of {wrong.numel()} elements are not {BF16_NAN:#06x}; "
                f"the first, input bits {given:#x}, stored {int(stored.reshape(-1)[first]):#06x}"
            )
