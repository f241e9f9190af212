"""Serve prompts with a gpt-oss model whose KV cache lives in kvpool's sliding-window pool, and check it
against transformers.

gpt-oss (``GptOssForCausalLM``) alternates sliding-window layers (a window of the last
``sliding_window`` tokens) with full-attention layers, adds a learned per-head attention sink to every
layer, biases to every projection, YaRN RoPE, and a mixture of experts with a clamped SwiGLU. The model
here is a small seeded random-init one built locally, with a window shorter than the prompts, so the
window decides what each sliding layer sees.

- The pool is an ``SWAKVPool``: the sliding layers' K/V in its SWA part, the full layers' in its full
  part, sized by ``plan_swa_pools``; the scheduler is the Gemma 3 runner's (``SWAScheduler``: a
  ``ReqToTokenPool`` and a ``SWATokenToKVPoolAllocator``, continuous batching, chunked prefill; after
  every step each request gives back, with ``free_swa``, the SWA part of its whole pages whose tokens
  all left the window, and ``free`` the rest when it finishes; every step ends with the allocator's
  ``check_integrity()``, a check that each live window is mapped and that the SWA part holds at most a
  live window and a page per request).
- The model runner calls the HF modules for everything but attention: the embedding, the RMSNorms,
  the q/k/v/o projections with their biases, the YaRN rotary embedding, the router and the experts,
  the final norm and the LM head. Each layer writes the step's K/V with ``pool.set_kv_buffer`` (global
  layer ids: the pool routes a sliding layer's write through the full-to-SWA mapping) and attends over
  rows read back from its part: a full layer over each request's slots from ``req_to_token``, a sliding
  layer over those of its window translated with ``translate_loc_from_full_to_swa``; a key inside the
  window without a SWA slot is an error.

The attention is transformers' eager gpt-oss attention: scores ``q.k * head_dim ** -0.5``, a causal
mask, and for sliding layers the window rule of ``masking_utils.sliding_window_overlay``: the query at
position q sees the keys at positions k with ``q - sliding_window < k <= q``. On every layer the head's
sink logit joins the softmax as one more column: the row's max (sink included) is subtracted, the
softmax taken over the scores and the sink, and the sink's column dropped, so the weights of the keys
sum to less than 1 and the sink itself carries no value.

Checks, as the Llama runner's (docs there): with an fp32 model and an fp32 pool every generated token
equals HF's greedy ``generate`` of each prompt alone and the logits are within ``LOGIT_RTOL``
(else exit 1); bf16 and FP8 pools report token agreement and KL against HF, and must generate what HF
generates through a cache that rounds K/V as the pool does (HF's own sliding cache, which keeps the
last ``sliding_window - 1`` tokens of a sliding layer); every slot of both parts is back at the end.
FP8 pools run at scale 1.0 and with the scales the pool's own calibration gives.

Speculative decoding (``--spec-width W``, default 4, 0 for none; on the pools of ``--spec-dtypes``):
each decode step drafts ``W - 1`` tokens per request and verifies the block ``[last token, drafts]`` in
one forward. The draft is the target itself on an fp8_e5m2 ``MHATokenToKVPool`` of every layer at
the target's full slots (scale 1.0; sized with the SWA pools by ``plan_swa_pools``), which agrees with
the target except where the rounding turns a near-tie. The scheduler gives each block's tokens slots
in both parts; the verify forward attends over each layer's committed rows (a sliding layer over the
translated slots of its window) plus the block's own K/V as the pool stores it; the accepted prefix
is committed with ``set_kv_buffer_prefix_valid`` (the pool translates a sliding layer's slots) and the
rejected slots go back to both parts with ``free``, before the pages that left the window go back
with ``free_swa``. With an fp32 model the speculative tokens must equal the non-speculative run's on
the same pool dtype (and, on fp32, HF's).

With ``--prefix-cache`` the prompts share prefixes and the scheduler serves them on an
``SWARadixCache`` (support/runners/swa_prefix.py): admission matches each prompt but its last token
(a match ends where the last window of its tokens has SWA KV), locks it and prefills only the rest;
prefill chunks and finished requests go into the tree; an allocation that finds a part short evicts
from the tree (SWA KV alone from an inner node, which becomes a tombstone that keeps its full KV).
Each request gives back the SWA part of its own pages before the last window of its whole pages, so
its cached tail keeps a whole window. Every step ends with the cache's ``check_integrity`` over the
running requests (tree, allocator, table); the summary and ``--json`` give the tokens matched, the
evictions and the tombstones, and the tokens must still be transformers' (fp32).

``--json PATH`` writes ``{"model_type", "config", "seed", "prompts", "fp32_tokens"}`` and, with a
speculative run, ``"spec_tokens"`` (the fp32 pool's tokens without and with speculative decoding), with
``--prefix-cache`` ``"prefix_cache"`` (the fp32 run's prompt and matched tokens, evictions and tombstones): the model is
``GptOssForCausalLM(GptOssConfig(**config))`` built in float32 right after ``torch.manual_seed(seed)``,
so anyone can rebuild it and compare.

    python examples/gpt_oss_runner.py                       # tiny config, a few seconds on a CPU
    python examples/gpt_oss_runner.py --dtypes fp32 --sliding-window 6 --chunk-size 8
    python examples/gpt_oss_runner.py --config small --device cuda --json out.json
    python examples/gpt_oss_runner.py --dtypes fp32 --page-size 64 --prompt-len 70 90 --spec-width 6
    python examples/gpt_oss_runner.py --prefix-cache --sliding-window 6 --prompt-len 30 60 --prompts 8 --chunk-size 8

Exit status: 0 when the checks pass, 1 otherwise, 2 on bad arguments (page size 1 is refused: the SWA
allocator extends requests page by page).

Needs ``transformers`` >= 5 with ``gpt_oss`` (the ``model`` extra: ``pip install -e ".[model]"``).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # examples/: its shared code, support/
from support import runners as rc  # noqa: E402  (the shared scheduler, references and checks)
from support.runners import (  # noqa: E402, F401  (re-exported: the tests use them here)
    DTYPES,
    LOGIT_RTOL,
    ForwardBatch,
    Report,
    RunConfig,
    Scales,
    attention_mask,
    make_prompts,
    read_rows,
    unit_scales,
)
from support.runners.gemma3_model import (  # noqa: E402, F401  (the SWA pools and scheduler; the tests use them here)
    StepMemory,
    SWAPools,
    SWAScheduler,
    make_pool,
    swa_geometry,
    swa_pages,
)
from support.runners.sliding import (  # noqa: E402, F401  (the shared sliding-window frame; the tests use it here)
    PooledKV,
    SlidingArchitecture,
    SlidingOptions,
    SlidingRunner,
    add_spec_arguments,
    format_swa_summary,
    run_sliding,
    sliding_parser,
    window_keys,
)
from support.runners.verify import SpecReport  # noqa: E402

from kvpool import SWAKVPool  # noqa: E402
from kvpool.checks import positive_int  # noqa: E402

from transformers import GptOssConfig, GptOssForCausalLM  # noqa: E402
from transformers.models.gpt_oss.modeling_gpt_oss import apply_rotary_pos_emb  # noqa: E402

PROGRAM = "gpt_oss_runner"


# --- the model ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GptOssShape:
    """The dimensions of a gpt-oss model.

    Layer ``i`` slides (a window of ``sliding_window`` tokens) when ``i`` is even and attends over the
    whole context when odd, as gpt-oss's ``layer_types``. Every token goes to the ``top_k`` of
    ``experts`` experts its router scores highest. RoPE is YaRN at gpt-oss's parameters (base 150,000,
    factor 32 over 4,096 positions). The weights' std is ``init_std`` (HF's ``initializer_range``;
    None: 1 / sqrt(hidden), which keeps a random model's attention from being all but one-hot), the
    sinks' included.
    """

    layers: int = 4
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    intermediate: int = 64
    experts: int = 4
    top_k: int = 2
    vocab: int = 128
    sliding_window: int = 8
    init_std: Optional[float] = None

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "experts", "top_k", "vocab"):
            positive_int(getattr(self, name), name)
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads must divide heads = {self.heads}, got {self.kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE rotates halves), got {self.head_dim}")
        if self.layers < 2:
            raise ValueError(f"layers must be at least 2 (one sliding and one full layer), got {self.layers}")
        if self.top_k > self.experts:
            raise ValueError(f"top_k must be at most experts = {self.experts}, got {self.top_k}")
        if isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int) or self.sliding_window < 2:
            # transformers' sliding cache keeps the last window - 1 tokens, which is everything at 1
            raise ValueError(f"sliding_window must be an int >= 2, got {self.sliding_window!r}")
        if self.init_std is not None and not self.init_std > 0:
            raise ValueError(f"init_std must be None or > 0, got {self.init_std}")

    @property
    def layer_types(self) -> list[str]:
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(self.layers)]

    def describe(self) -> str:
        full = self.layer_types.count("full_attention")
        return (
            f"{self.layers} layers ({self.layers - full} sliding with a window of {self.sliding_window} tokens, "
            f"{full} full), hidden {self.hidden}, {self.heads} query / {self.kv_heads} KV heads x {self.head_dim} "
            f"with sinks, {self.experts} experts (top {self.top_k}) of intermediate {self.intermediate}, vocab {self.vocab}"
        )


SHAPES: dict[str, GptOssShape] = {
    "tiny": GptOssShape(),
    "small": GptOssShape(layers=8, hidden=256, heads=8, kv_heads=2, head_dim=64, intermediate=256, experts=8,
                         top_k=4, vocab=1024, sliding_window=16),  # fmt: skip
}

#: gpt-oss's RoPE (``GptOssConfig``'s default, with its base written out).
YARN = {
    "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
    "truncate": False, "original_max_position_embeddings": 4096,
}  # fmt: skip


def model_config(shape: GptOssShape) -> GptOssConfig:
    return GptOssConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        num_local_experts=shape.experts,
        num_experts_per_tok=shape.top_k,
        sliding_window=shape.sliding_window,
        layer_types=shape.layer_types,
        max_position_embeddings=131072,
        initializer_range=shape.init_std or shape.hidden**-0.5,
        rope_parameters=dict(YARN),
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def build_model(config: dict[str, Any], dtype: torch.dtype, device: str | torch.device, seed: int) -> GptOssForCausalLM:
    """``GptOssForCausalLM(GptOssConfig(**config))`` built in float32 on the CPU right after
    ``torch.manual_seed(seed)`` (what ``--json`` tells others to rebuild), then moved to ``device`` and
    ``dtype``, with HF's eager attention (the reference the runner matches)."""
    torch.manual_seed(seed)
    model = GptOssForCausalLM(GptOssConfig(**config))
    model.set_attn_implementation("eager")
    return model.to(device=device, dtype=dtype).eval()


# --- the model runner ------------------------------------------------------------------------------


def sink_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, batch: ForwardBatch, mask: torch.Tensor,
    scale: float, sinks: Optional[torch.Tensor],
) -> torch.Tensor:  # fmt: skip
    """gpt-oss's eager attention of ragged queries ``q`` [T, Hq, D] over padded keys [B, L, Hkv, D]
    and values [B, L, Hkv, Dv], with ``sinks`` [Hq] (None: a plain softmax, no sink).

    Query head h uses KV head h // G (HF's ``repeat_kv``); the G query heads of a KV head are its
    G x Tq query rows, as in ``grouped_attention``. Masked scores (``mask`` [B, 1, G*Tq, L] False) get
    the dtype's lowest value, as HF's additive mask; the sink column joins before the row's max is
    subtracted and is dropped after the softmax. Returns [T, Hq * Dv] in token order.
    """
    b, l, hkv, d = keys.shape
    dv, hq = values.shape[-1], q.shape[1]
    g, tq = hq // hkv, batch.q_index.shape[1]
    qp = q[batch.q_index].view(b, tq, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * tq, d)
    scores = torch.matmul(qp, keys.permute(0, 2, 3, 1)) * scale  # [B, Hkv, G*Tq, L]
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    if sinks is not None:
        sink = sinks.to(scores.dtype).view(1, hkv, g, 1, 1).expand(b, hkv, g, tq, 1).reshape(b, hkv, g * tq, 1)
        scores = torch.cat([scores, sink], dim=-1)
    scores = scores - scores.max(dim=-1, keepdim=True).values
    probs = torch.softmax(scores, dim=-1, dtype=scores.dtype)[..., :l].to(values.dtype)
    out = torch.matmul(probs, values.transpose(1, 2))  # [B, Hkv, G*Tq, Dv]
    out = out.view(b, hkv, g, tq, dv).permute(0, 3, 1, 2, 4).reshape(b, tq, hq * dv)
    return out[batch.token_mask]


class PooledGptOssAttention:
    """One gpt-oss attention layer: HF's projections (with biases) and RoPE; K/V written to the
    ``SWAKVPool`` under the global layer id and read back from the layer's part (``PooledKV``); the layer's sinks."""

    def __init__(self, attn: torch.nn.Module, layer_id: int, kv: SWAKVPool) -> None:
        self.attn = attn
        self.kv = PooledKV(layer_id, kv)

    def __call__(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
        keys: tuple[torch.Tensor, torch.Tensor], k_scale: torch.Tensor, v_scale: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """x [T, hidden] (normed), cos/sin [T, head_dim / 2], ``keys``: (slots of the layer's part
        [B, L], mask [B, 1, G*Tq, L]); returns the attention output [T, hidden]."""
        a, t = self.attn, x.shape[0]
        q = a.q_proj(x).view(t, -1, a.head_dim)
        k = a.k_proj(x).view(t, -1, a.head_dim)
        v = a.v_proj(x).view(t, -1, a.head_dim)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)  # heads on dim 1
        slots, mask = keys
        rows_k, rows_v = self.kv.rows(batch, k, v, slots, k_scale, v_scale, q.dtype)
        return a.o_proj(sink_attention(q, rows_k, rows_v, batch, mask, a.scaling, a.sinks))


class GptOssRunner(SlidingRunner):
    """Runs a ``GptOssForCausalLM``'s forward over a ``ForwardBatch`` with its KV cache in ``pools``
    (``SlidingRunner``: parameters, speculative decoding).

    Parameters
    ----------
    model : an HF ``GptOssForCausalLM`` (its modules are called; its own attention is not).
    pools : ``SWAPools`` whose ``SWAKVPool`` has the model's KV heads and head_dim, its sliding layers
        in the SWA part and its full layers in the full part.
    scales : per layer ``(k_scale, v_scale)`` float32 tensors on the pool's device, a list in layer
        order or a mapping from layer id (what the pool's calibration gives); default 1.0. Used by FP8
        pools only.
    draft_pool : the draft's pool (``SWAPools.draft``) for speculative decoding, or None.
    """

    attention = PooledGptOssAttention

    def hidden(self, batch: ForwardBatch) -> torch.Tensor:
        """The residual stream after the planned layers, [T, hidden]."""
        m = self.model.model
        x = m.embed_tokens(batch.input_ids)  # [T, hidden]
        cos, sin = m.rotary_emb(x, batch.positions[None])  # YaRN: its attention factor is in cos and sin
        cos, sin = cos[0], sin[0]
        keys = self.keys(batch)
        for p in self.plan:
            x = x + p.attn(p.layer.input_layernorm(x), cos, sin, batch, keys[p.kind], *p.scales)
            h, _ = p.layer.mlp(p.layer.post_attention_layernorm(x)[None])  # router and experts: [1, T, hidden]
            x = x + h[0]
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm and the LM head of ``x`` [N, hidden]: [N, vocab]."""
        return self.model.lm_head(self.model.model.norm(x))


class GptOss(SlidingArchitecture):
    """gpt-oss's model and runner on the sliding-window pools, for the shared ``serve``/``run`` (``GPT_OSS``)."""

    program = PROGRAM
    model_name = "GptOssForCausalLM"
    label = "gpt-oss"

    def build_model(self, cfg: RunConfig) -> GptOssForCausalLM:
        if not isinstance(cfg.shape, GptOssShape):
            raise ValueError(f"shape must be a GptOssShape for gpt-oss, got {type(cfg.shape).__name__}")
        return build_model(model_config(cfg.shape).to_dict(), DTYPES[cfg.model_dtype], cfg.device, cfg.seed)

    def make_pool(self, cfg: RunConfig, model: Any, dtype: torch.dtype) -> SWAPools:
        return make_pool(cfg, model, dtype, self.spec_width)

    def runner(self, model: Any, pool: Any, scales: Optional[Scales]) -> GptOssRunner:
        return GptOssRunner(model, pool, scales, self.draft_pool(pool))


GPT_OSS = GptOss()


# --- the run, the report and --json -----------------------------------------------------------------


def progress(msg: str) -> None:
    print(f"{PROGRAM}: {msg}", file=sys.stderr, flush=True)


def run(cfg: RunConfig, opts: SlidingOptions = SlidingOptions(), log: Optional[Any] = None) -> SpecReport:
    """Build the model, serve the prompts on a pool of each dtype, compare each run with HF; then the
    speculative runs of ``opts`` and ``--json``. ``log`` is told what starts."""
    return run_sliding(cfg, GptOss, opts, lambda c: model_config(c.shape).to_dict(), log)  # type: ignore[arg-type]


def format_summary(rep: Report) -> str:
    """The shared summary, with the window and, after each pool's lines, its sliding-window memory."""
    return format_swa_summary(rep, rep.config.shape.sliding_window, "sliding")  # type: ignore[attr-defined]


# --- command line -----------------------------------------------------------------------------------

#: The runner's defaults where they differ from ``RunConfig``'s: prompts longer than the window and
#: than a prefill chunk, generation well past the window, pages of 4 (the window is not a page multiple
#: at --sliding-window 6 or 10).
RUN_DEFAULTS: dict[str, Any] = dict(prompts=6, batch=3, prompt_len=(20, 40), new_tokens=(6, 20), page_size=4, chunk_size=16)


def make_parser() -> argparse.ArgumentParser:
    p = sliding_parser(PROGRAM, __doc__)
    p.add_argument("--config", choices=sorted(SHAPES), default="tiny", help="model shape preset")
    p.add_argument("--layers", type=int, help="override the preset's layer count (even layers slide, odd are full)")
    p.add_argument("--experts", type=int, help="override the preset's expert count")
    p.add_argument("--top-k", type=int, help="override the preset's experts per token")
    p.add_argument("--vocab", type=int, help="override the preset's vocabulary size")
    p.add_argument("--sliding-window", type=int, help="override the preset's window of the sliding layers (tokens)")
    add_spec_arguments(p)
    rc.add_run_arguments(p, **RUN_DEFAULTS)
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> tuple[RunConfig, SlidingOptions]:
    a = make_parser().parse_args(argv)
    names = ("layers", "experts", "top_k", "vocab", "sliding_window")
    overrides = {k: getattr(a, k) for k in names if getattr(a, k) is not None}
    cfg = rc.run_config(a, replace(SHAPES[a.config], **overrides))
    return cfg, SlidingOptions(a.spec_width or None, tuple(a.spec_dtypes), a.json)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return rc.run_main(argv, parse_args, PROGRAM, execute=lambda cfg, opts: run(cfg, opts, progress),  # type: ignore[arg-type]
                       summary=format_summary)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
