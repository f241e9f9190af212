"""serve_sim's pools that keep scales beside their codes: SGLang's FP4 (``--dtype fp4_e2m1``: packed
e2m1 codes and an exponent scale byte per 16 elements; ``MHATokenToKVPoolFP4``, with ``--model
deepseek-v3`` ``MLATokenToKVPoolFP4``), two-level NVFP4 (``--dtype nvfp4``: e4m3 block scales and
the checkpoint's per-layer scales as the global scales) and FP8 with a scale per token and head
(``--kv-scales per-token-head``: ``MHATokenToKVPoolFP8PerTokenHead``). The runners write as the MHA
and MLA runners do, passing the checkpoint's scales as SGLang's attention layers do, and the check
compares codes and scales byte for byte with kvpool's reference quantizers of the same rows."""

from __future__ import annotations

from typing import Union

import torch

from kvpool import (
    KVGeometry,
    MHATokenToKVPoolFP4,
    MHATokenToKVPoolFP8PerTokenHead,
    MLATokenToKVPoolFP4,
    quantize_fp4,
    quantize_nvfp4,
)
from kvpool.kernels.store_fp8_token import quantize_token_head
from support.sim.config import DTYPES, FP4_DTYPES, MLA_MODELS, SimConfig, pool_dtype
from support.sim.runner import MLAModelRunner, ModelRunner
from support.sim.values import checkpoint_scales

ScaledPool = Union[MHATokenToKVPoolFP4, MLATokenToKVPoolFP4, MHATokenToKVPoolFP8PerTokenHead]


def format_name(cfg: SimConfig) -> str:
    """The pool's format as the summary names it."""
    if cfg.dtype in FP4_DTYPES:
        return f"FP4 {FP4_DTYPES[cfg.dtype]} ({cfg.dtype})"
    if cfg.kv_scales == "per-token-head":
        return f"{DTYPES[cfg.dtype]} per-token-head"
    return str(DTYPES[cfg.dtype])


def scaled_geometry(cfg: SimConfig) -> KVGeometry:
    """The geometry of ``cfg``'s pool, scales included (``cfg.scaled_format`` runs)."""
    mla = MLA_MODELS.get(cfg.model)
    if mla is not None:
        return KVGeometry.mla(*mla, cfg.layers, pool_dtype(cfg.dtype))
    mode = "per_token_head" if cfg.kv_scales == "per-token-head" else "static"
    return KVGeometry(cfg.heads, cfg.head_dim, cfg.layers, pool_dtype(cfg.dtype), kv_scale_mode=mode)


def make_scaled_pool(cfg: SimConfig, size: int) -> ScaledPool:
    """``cfg``'s pool of ``size`` slots (an NVFP4 pool's global scales: the checkpoint's per layer)."""
    mla = MLA_MODELS.get(cfg.model)
    if mla is not None:
        return MLATokenToKVPoolFP4(size, cfg.page_size, cfg.dtype, *mla, cfg.layers, cfg.device)
    if cfg.kv_scales == "per-token-head":
        return MHATokenToKVPoolFP8PerTokenHead(
            size, cfg.page_size, DTYPES[cfg.dtype], cfg.heads, cfg.head_dim, cfg.layers, cfg.device
        )
    global_scales = {}
    if cfg.dtype == "nvfp4":
        pairs = [(float(k), float(v)) for k, v in checkpoint_scales(cfg.layers, torch.device("cpu"))]
        global_scales = dict(k_global_scales=[k for k, _ in pairs], v_global_scales=[v for _, v in pairs])
    return MHATokenToKVPoolFP4(
        size, cfg.page_size, cfg.dtype, cfg.heads, cfg.head_dim, cfg.layers, cfg.device,
        fp4_format=FP4_DTYPES[cfg.dtype], **global_scales,
    )  # fmt: skip


def divided(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What the exponent-scale FP4 pool quantizes for a write with ``scale``: ``float32(x) / s``,
    rounded back to ``x``'s dtype."""
    return (x.to(torch.float32) / scale.to(torch.float32)).to(x.dtype)


class ScaledModelRunner(ModelRunner):
    """The MHA runner on an FP4, NVFP4 or per-token-head FP8 pool: each part's codes and scales are
    checked against the reference quantizer of the rows written."""

    def stored_bytes(self, layer: int) -> list[tuple[torch.Tensor, ...]]:
        if isinstance(self.pool, MHATokenToKVPoolFP8PerTokenHead):
            k, v, k_scale, v_scale = self.pool.get_fp8_buffers(layer)
        else:
            k, v, k_scale, v_scale = self.pool.get_fp4_buffers(layer)[:4]
        return [(k.view(torch.uint8), k_scale.view(torch.uint8)), (v.view(torch.uint8), v_scale.view(torch.uint8))]

    def expected_bytes(self, x: torch.Tensor, scale: torch.Tensor, layer: int, part: int) -> tuple[torch.Tensor, ...]:
        if isinstance(self.pool, MHATokenToKVPoolFP8PerTokenHead):
            codes, scales = quantize_token_head(x, self.pool.dtype)  # the checkpoint's scale is not used
            return codes, scales.view(torch.uint8)
        if self.pool.fp4_format == "nvfp4":
            return quantize_nvfp4(x, scale.to(torch.float32).reshape(1))  # scale: the layer's global scale
        return quantize_fp4(divided(x, scale))


class ScaledMLAModelRunner(MLAModelRunner):
    """The MLA runner on an ``MLATokenToKVPoolFP4``: latent codes and scale bytes checked against
    ``quantize_fp4`` of the row written."""

    def stored_bytes(self, layer: int) -> list[tuple[torch.Tensor, ...]]:
        return [tuple(self.pool.get_fp4_buffers(layer))]

    def expected_bytes(self, x: torch.Tensor, scale: torch.Tensor, layer: int, part: int) -> tuple[torch.Tensor, ...]:
        return quantize_fp4(divided(x, scale))
