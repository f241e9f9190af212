"""The pool formats the runners take besides plain dtypes (``--dtypes`` names in ``POOL_FORMATS``):
SGLang's FP4 (``fp4_e2m1``, its ``--kv-cache-dtype`` name: e2m1 codes and an exponent scale per 16
elements), two-level NVFP4 (``nvfp4``: e4m3 block scales, global scale 1.0) and FP8 with a scale per
token and head computed when each row is written (``fp8_e4m3_per_token_head``,
``fp8_e5m2_per_token_head``).

Each format is also written out here as a rounding of K/V in plain PyTorch, from docs/contract.md
("The format, byte for byte", "NVFP4", "The rule, element by element"), not through kvpool: the
reference cache rounds with it (``PoolFormat.round``), and ``round_trip_errors`` measures it, with
bf16 and per-tensor FP8, on a model's real K/V."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from transformers import DynamicCache

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: Rounding bounds between e2m1 values; whether a tie goes up: away from zero (the exponent-scale
#: format) always; to even (NVFP4) when the upper code is even.
E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
BLOCK = 16


def _e2m1(mag: torch.Tensor, ties_to_even: bool) -> torch.Tensor:
    """``mag`` (>= 0, float32) rounded to the nearest e2m1 value, saturating at 6."""
    code = torch.zeros_like(mag, dtype=torch.int64)
    for upper, bound in enumerate(E2M1_BOUNDS, start=1):
        up = mag > bound if ties_to_even and upper % 2 else mag >= bound
        code += up.to(torch.int64)
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=mag.device)[code]


def _blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [..., D] as float32 blocks [..., D // 16, 16], and whether each block is all finite."""
    b = x.to(torch.float32).reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    return b, torch.isfinite(b).all(dim=-1, keepdim=True)


def round_fp4_exponent(x: torch.Tensor) -> torch.Tensor:
    """The exponent-scale FP4 format's read-back value of every element (float32): per block of 16,
    ``e = ceil(log2(max(amax / 6, 1e-10)))`` exactly, elements rounded to e2m1 times ``2**e``, ties
    away from zero; a non-finite block reads as zeros."""
    b, finite = _blocks(x)
    v = torch.clamp(b.abs().amax(dim=-1, keepdim=True) / 6.0, min=1e-10)
    m, e = torch.frexp(v)  # v = m * 2**e, 0.5 <= m < 1: a power of two has m == 0.5
    e = torch.where(m == 0.5, e - 1, e)
    step = torch.ldexp(torch.ones_like(v), e)
    s = b / step
    mag = _e2m1(s.abs(), ties_to_even=False) * step
    out = torch.where(s < 0, -mag, mag)  # the sign bit is set iff s < 0: -0.0 reads as +0.0
    return torch.where(finite, out, torch.zeros_like(out)).reshape(x.shape)


def round_nvfp4(x: torch.Tensor, global_scale: float = 1.0) -> torch.Tensor:
    """NVFP4's read-back value (float32): ``y = x / g``; per block of 16 an e4m3fn scale ``S =
    e4m3(amax / 6)`` (ties to even, saturating at 448), elements rounded to e2m1 of ``y / S`` ties
    to even, read as ``e2m1 * S * g``; a non-finite block reads as zeros."""
    b, finite = _blocks(x)
    y = b / global_scale
    finite &= torch.isfinite(y).all(dim=-1, keepdim=True)
    s = torch.clamp(y.abs().amax(dim=-1, keepdim=True) / 6.0, max=448.0).to(torch.float8_e4m3fn).to(torch.float32)
    q = torch.where(s > 0, y / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(y))
    mag = _e2m1(q.abs(), ties_to_even=True) * s * global_scale
    out = torch.where(torch.signbit(y), -mag, mag)  # the sign bit is x's, zeros included
    return torch.where(finite, out, torch.zeros_like(out)).reshape(x.shape)


def round_token_head(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-token-head FP8's read-back value (float32) of ``x`` [..., D] (one row per token and head):
    ``s = max(amax_finite / fmax, 2**-126)``, ``cast(clamp(x / s)) * s``."""
    fmax = torch.finfo(dtype).max
    xf = x.to(torch.float32)
    finite = torch.where(torch.isfinite(xf), xf.abs(), torch.zeros_like(xf))
    s = torch.clamp(finite.amax(dim=-1, keepdim=True) / fmax, min=2.0**-126)
    return torch.clamp(xf / s, -fmax, fmax).to(dtype).to(torch.float32) * s


@dataclass(frozen=True)
class PoolFormat:
    """A pool format by its ``--dtypes`` name: what pool stores it and how it rounds K/V."""

    name: str
    kind: str  # "fp4" (exponent scales), "nvfp4" or "token_head"
    fp8: Optional[torch.dtype] = None  # the codes of a per-token-head pool

    @property
    def scale_label(self) -> str:
        """How the format scales, as a run's label names it."""
        return {"fp4": "exponent per 16", "nvfp4": "e4m3 per 16 x 1.0", "token_head": "per token-head"}[self.kind]

    def round(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [..., D] as the pool stores and reads it back, in ``x``'s dtype."""
        if self.kind == "fp4":
            return round_fp4_exponent(x).to(x.dtype)
        if self.kind == "nvfp4":
            return round_nvfp4(x).to(x.dtype)
        return round_token_head(x, self.fp8).to(x.dtype)  # type: ignore[arg-type]

    def mha_pool(self, size: int, page_size: int, heads: int, head_dim: int, layers: int, device: Any,
                 out_dtype: torch.dtype) -> Any:  # fmt: skip
        """The MHA pool of this format (its getters dequantize to ``out_dtype``, the model's)."""
        from kvpool import MHATokenToKVPoolFP4, MHATokenToKVPoolFP8PerTokenHead

        if self.kind == "token_head":
            return MHATokenToKVPoolFP8PerTokenHead(size, page_size, self.fp8, heads, head_dim, layers, device,
                                                   out_dtype=out_dtype)  # fmt: skip
        return MHATokenToKVPoolFP4(size, page_size, self.name, heads, head_dim, layers, device, out_dtype=out_dtype,
                                   fp4_format="fp4_mx_block16" if self.kind == "fp4" else "nvfp4")  # fmt: skip


POOL_FORMATS = {
    "fp4_e2m1": PoolFormat("fp4_e2m1", "fp4"),
    "nvfp4": PoolFormat("nvfp4", "nvfp4"),
    "fp8_e4m3_per_token_head": PoolFormat("fp8_e4m3_per_token_head", "token_head", torch.float8_e4m3fn),
    "fp8_e5m2_per_token_head": PoolFormat("fp8_e5m2_per_token_head", "token_head", torch.float8_e5m2),
}


def check_formats(names: Sequence[str], supported: dict[str, str], program: str) -> None:
    """Raise ``ValueError`` for a ``POOL_FORMATS`` name in ``names`` that ``program``'s model has no
    pool for; ``supported`` maps each name it takes to ``""`` and each it refuses to the reason."""
    for name in names:
        if name in POOL_FORMATS and supported.get(name, "no pool of this format") != "":
            raise ValueError(f"--dtypes {name} is not run by {program}: {supported.get(name, 'no pool of this format')}")


def write_scales(pool: Any, k_scale: Any, v_scale: Any) -> tuple[Any, Any]:
    """The scales a runner's write hands ``pool``: the layer's, except for an FP4 pool, which gets
    None (its block scales are computed at write time, and its fused write takes no scale)."""
    from kvpool import MHATokenToKVPoolFP4, MLATokenToKVPoolFP4

    return (None, None) if isinstance(pool, (MHATokenToKVPoolFP4, MLATokenToKVPoolFP4)) else (k_scale, v_scale)


def per_token_head_rows(pool: Any, layer_id: int, dtype: torch.dtype) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """A per-token-head pool's (K, V) rows of ``layer_id`` dequantized to ``dtype`` from its codes and
    scales (``get_fp8_buffers``; of a ``HybridLinearKVPool``'s full-attention part by its dense id),
    as an attention backend reads them; None for any other pool."""
    from kvpool.kernels.store_fp8_token import dequantize_token_head

    inner, lid = pool, layer_id
    if hasattr(pool, "full_kv_pool") and hasattr(pool, "dense_layer_id"):
        inner, lid = pool.full_kv_pool, pool.dense_layer_id(layer_id)
    if not hasattr(inner, "get_fp8_buffers"):
        return None
    k, v, ks, vs = inner.get_fp8_buffers(lid)
    return dequantize_token_head(k, ks, inner.dtype, dtype), dequantize_token_head(v, vs, inner.dtype, dtype)


# --- round-trip error on a model's real K/V --------------------------------------------------------


class CapturingCache(DynamicCache):
    """HF's dynamic cache, keeping a float32 copy of every K/V ``update`` is given (by layer)."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.seen.append((key_states.detach().float().cpu(), value_states.detach().float().cpu()))
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


@torch.no_grad()
def captured_kv(model: Any, prompts: Sequence[Any]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The K/V HF's attention layers hand their cache in one forward of each prompt: per layer and
    prompt, (K, V) float32 [1, H, L, D] (DeepSeek-V3: the latent and the rotary key)."""
    import inspect

    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = []
    for p in prompts:
        cache = CapturingCache(config=model.config)
        ids = torch.tensor([p.tokens], dtype=torch.int64, device=model.device)
        model(ids, use_cache=True, **{cache_arg: cache})
        out += cache.seen
    return out


def _rel_rms(rounded: torch.Tensor, x: torch.Tensor) -> float:
    return float(((rounded.double() - x.double()) ** 2).sum().sqrt() / (x.double() ** 2).sum().sqrt())


def round_trip_errors(kv: Sequence[tuple[torch.Tensor, torch.Tensor]], names: Sequence[str]) -> dict[str, tuple[float, float]]:
    """Relative RMS error (``||round(x) - x|| / ||x||`` over every captured row) of K and of V, for
    bf16, per-tensor FP8 e4m3 (each tensor's scale ``amax / 448``, as calibration gives) and each
    ``POOL_FORMATS`` name in ``names`` whose row width it takes."""

    def per_tensor_fp8(x: torch.Tensor) -> torch.Tensor:
        s = torch.clamp(x.abs().amax() / 448.0, min=2.0**-126)
        return torch.clamp(x / s, -448.0, 448.0).to(torch.float8_e4m3fn).to(torch.float32) * s

    rounders = {"bf16": lambda x: x.to(torch.bfloat16).float(), "fp8_e4m3 per tensor": per_tensor_fp8}
    rounders |= {n: POOL_FORMATS[n].round for n in names if n in POOL_FORMATS}
    out = {}
    for label, rnd in rounders.items():
        errs = []
        for part in (0, 1):
            xs = [pair[part] for pair in kv]
            if any(x.shape[-1] % BLOCK for x in xs) and label in POOL_FORMATS:
                errs.append(float("nan"))
                continue
            errs.append(_rel_rms(torch.cat([rnd(x).flatten() for x in xs]), torch.cat([x.flatten() for x in xs])))
        out[label] = (errs[0], errs[1])
    return out


def round_trip_note(errors: dict[str, tuple[float, float]], what: tuple[str, str] = ("K", "V")) -> str:
    """One summary line of ``round_trip_errors``."""
    parts = ", ".join(f"{label} {k:.2e} / {v:.2e}" for label, (k, v) in errors.items())
    return f"K/V round-trip error (relative RMS, {what[0]} / {what[1]}, HF's K/V of the prompts): {parts}"
