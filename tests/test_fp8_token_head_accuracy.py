"""Per-token-head FP8's round-trip error (docs/contract.md, "Per-token-head FP8"): against the bf16
rows written, within the bound the format gives every element; and against per-tensor FP8 with the
best single scale for the same rows, lower wherever tokens or heads differ in magnitude (outliers)."""

from __future__ import annotations

import pytest
import torch

from kvassert import DEVICE, FP8, id_of
from kvpool import MHATokenToKVPool
from kvpool.pools.mha_fp8_token_pool import MHATokenToKVPoolFP8PerTokenHead

T, H, D = 64, 4, 64
#: (mantissa bits, exponent bias, largest finite) of each format: what the error bound is made of.
FORMAT = {torch.float8_e4m3fn: (3, 7, 448.0), torch.float8_e5m2: (2, 15, 57344.0)}
#: How much smaller the quiet quarter of the tokens is: below the normal range one scale for all rows
#: leaves them (e4m3 spans about 4.5 decades of normal values, e5m2 about 9).
QUIET = {torch.float8_e4m3fn: 1e-3, torch.float8_e5m2: 1e-6}


def rows_with_outliers(seed: int, quiet: float = 1e-3) -> torch.Tensor:
    """bf16 K-like rows: unit normals, two tokens 300x larger (attention sinks), one channel of one
    head 50x larger in every token (an outlier channel), and a quarter of the tokens ``quiet`` times
    as large."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, D, generator=g)
    x[[5, 60]] *= 300.0
    x[:, 1, 7] *= 50.0
    x[T // 2 : T // 2 + T // 4] *= quiet
    return x.to(torch.bfloat16).to(DEVICE)


def per_token_head_round_trip(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(values read back [T, H, D] float32, scales [T, H]) through the pool."""
    pool = MHATokenToKVPoolFP8PerTokenHead(T, 1, dtype, H, D, 1, DEVICE, out_dtype=torch.float32)
    loc = torch.arange(1, T + 1, device=DEVICE)
    pool.set_kv_buffer(None, loc, x, x, layer_id_override=0)
    return pool.get_key_buffer(0)[1:].cpu(), pool.get_fp8_buffers(0).k_scale[1:].cpu()


def per_tensor_round_trip(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values read back through the per-tensor FP8 pool with the best one scale: amax / fmax."""
    scale = x.float().abs().max().item() / FORMAT[dtype][2]
    pool = MHATokenToKVPool(T, 1, dtype, H, D, 1, DEVICE)
    pool.set_kv_buffer(None, torch.arange(1, T + 1, device=DEVICE), x, x, scale, scale, layer_id_override=0)
    return pool.get_key_buffer(0)[1:].cpu().double() * torch.tensor(scale, dtype=torch.float64).float().double()


def row_errors(back: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Relative L2 error of each (token, head) row, [T, H]."""
    exact = x.cpu().double()
    return (back.double() - exact).norm(dim=2) / exact.norm(dim=2)


@pytest.mark.parametrize("dtype", FP8, ids=id_of)
def test_every_element_is_within_half_an_fp8_step_of_the_bf16_value(dtype):
    mant, bias, _ = FORMAT[dtype]
    x = rows_with_outliers(1)
    back, scales = per_token_head_round_trip(x, dtype)
    exact = x.cpu().double()
    # Rounding to nearest is off by at most half a step: 2**-(mant + 1) of the value in the normal
    # range, half the smallest subnormal (2**(1 - bias - mant) in units of the scale) below it; the
    # float32 division and the read-back product add at most 2**-24 each.
    bound = (2.0 ** -(mant + 1) * exact.abs() + 2.0 ** (-bias - mant) * scales.double()[..., None]) * (1 + 2.0**-20)
    over = (back.double() - exact).abs() > bound
    assert not bool(over.any()), f"{int(over.sum())} elements off by more than half a step, first at {over.nonzero()[0].tolist()}"
    assert bool((scales > 0).all())


@pytest.mark.parametrize("dtype", FP8, ids=id_of)
def test_per_token_head_error_is_lower_than_per_tensor_error_with_outliers(dtype):
    mant = FORMAT[dtype][0]
    x = rows_with_outliers(2, QUIET[dtype])
    ours = row_errors(per_token_head_round_trip(x, dtype)[0], x)
    per_tensor = row_errors(per_tensor_round_trip(x, dtype), x)
    # Every row keeps the format's relative precision on its own scale ...
    assert float(ours.max()) <= 2.0 ** -(mant + 1) * 1.01
    # ... while one scale for all rows loses the quiet tokens to FP8's subnormals and zero.
    small = per_tensor[T // 2 : T // 2 + T // 4][:, [0, 2, 3]]  # (head 1 keeps its outlier channel)
    assert float(small.min()) > 4 * float(ours.max())
    assert float(ours.mean()) < float(per_tensor.mean()) / 2
    # Where magnitudes do not differ (the rows of the largest tokens), both are close to each other.
    assert float(ours[[5, 60]].max()) <= float(per_tensor[[5, 60]].max()) * 1.01
