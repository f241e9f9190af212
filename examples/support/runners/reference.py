"""The runners' prompts and Hugging Face references: seeded prompts (``make_prompts``), HF's greedy
``generate`` of each prompt alone (``hf_reference``), optionally through a cache that rounds K/V as a
pool of a given dtype does (``RoundingCache``)."""

from __future__ import annotations

import inspect
import random
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from support.runners.config import LayerScales, RunConfig, unit_scales
from support.runners.formats import PoolFormat

@dataclass(frozen=True)
class Prompt:
    tokens: list[int]
    new_tokens: int


def make_prompts(cfg: RunConfig) -> list[Prompt]:
    """Seeded random token ids; prompt lengths distinct where the range allows, output lengths drawn
    independently (so requests finish at different steps). With ``cfg.prefix_cache`` each prompt
    after the first begins with half or more of an earlier one (as far as it is long enough)."""
    rng = random.Random(cfg.seed)
    lo, hi = cfg.prompt_len
    if hi - lo + 1 >= cfg.prompts:
        lengths = rng.sample(range(lo, hi + 1), cfg.prompts)
    else:
        lengths = [rng.randint(lo, hi) for _ in range(cfg.prompts)]
    prompts = []
    for n in lengths:
        shared: list[int] = []
        if cfg.prefix_cache and prompts:
            earlier = rng.choice(prompts).tokens
            most = min(len(earlier), n - 1)
            shared = earlier[: rng.randint(most // 2, most)] if most > 0 else []
        tokens = shared + [rng.randrange(cfg.shape.vocab) for _ in range(n - len(shared))]
        prompts.append(Prompt(tokens, rng.randint(*cfg.new_tokens)))
    return prompts


@dataclass
class Generation:
    """What one request generated: its tokens and, when kept, the logits each came from."""

    tokens: list[int]
    logits: Optional[torch.Tensor] = None  # [len(tokens), vocab] float32 on the CPU


def round_like_pool(x: torch.Tensor, dtype: "torch.dtype | PoolFormat", scale: torch.Tensor) -> torch.Tensor:
    """``x`` [B, H, L, D] as a pool of ``dtype`` stores it and the runner reads it back, written out
    from docs/contract.md, "The write" (not through kvpool): FP8 divides by the scale (per tensor or
    per head), saturates, casts, and multiplies back; 16-bit and fp32 pools cast; a ``PoolFormat``
    (FP4, NVFP4, per-token-head FP8) rounds as its own rule says (``scale`` unused: the runs give 1.0)."""
    if isinstance(dtype, PoolFormat):
        return dtype.round(x)
    if dtype.itemsize == 1:
        fmax = torch.finfo(dtype).max
        s = scale.reshape(-1, 1, 1)
        return (torch.clamp(x.float() / s, -fmax, fmax).to(dtype).float() * s).to(x.dtype)
    return x.to(dtype).to(x.dtype)


class RoundingCache(DynamicCache):
    """HF's dynamic cache, storing every K/V rounded as a pool of ``dtype`` with ``scales`` would.
    HF's attention attends over what ``update`` returns, prefill included, as the runner does.
    ``scales`` is indexed by HF's layer index (a mapping where only some layers hold K/V).
    (DeepSeek-V3's attention hands ``update`` its latent as K and its rotary key as V; an MLA pool
    rounds both with the one ``k_scale``, so its scales are pairs ``(s, s)``.)"""

    def __init__(self, dtype: torch.dtype, scales: LayerScales, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.pool_dtype = dtype
        self.scales = scales

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # type: ignore[no-untyped-def]
        k_scale, v_scale = self.scales[layer_idx]
        key_states = round_like_pool(key_states, self.pool_dtype, k_scale)
        value_states = round_like_pool(value_states, self.pool_dtype, v_scale)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


@torch.no_grad()
def hf_reference(
    model: PreTrainedModel, prompts: Sequence[Prompt], pool_dtype: Optional[torch.dtype] = None,
    scales: Optional[LayerScales] = None,
) -> list[Generation]:  # fmt: skip
    """HF's greedy ``generate`` of each prompt alone (no padding), with its raw logits per step;
    with ``pool_dtype``, through a ``RoundingCache`` of that dtype and ``scales``."""
    device = model.device
    # transformers 5.x renamed generate's cache argument; take whichever this version has.
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = []
    for p in prompts:
        ids = torch.tensor([p.tokens], dtype=torch.int64, device=device)
        extra = {}
        if pool_dtype is not None:
            extra[cache_arg] = RoundingCache(pool_dtype, scales or unit_scales(len(model.model.layers), device),
                                             config=model.config)  # fmt: skip
        res = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=p.new_tokens,
            min_new_tokens=p.new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
            **extra,
        )
        tokens = res.sequences[0, len(p.tokens) :].tolist()
        logits = torch.stack([s[0] for s in res.logits]).float().cpu()
        out.append(Generation(tokens, logits))
    return out
