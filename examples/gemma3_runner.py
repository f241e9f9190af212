"""Serve prompts with a Gemma 3 model whose KV cache lives in kvpool's sliding-window pool, and check it
against transformers.

Gemma 3 (``Gemma3ForCausalLM``, text only) has five local layers to one global: a local layer attends
over a sliding window of the last ``sliding_window`` tokens (RoPE base 10,000), a global layer over the
whole context (RoPE base 1,000,000). The model here is a small seeded random-init one built locally,
with a window shorter than the prompts, so the window decides what each local layer sees.

- The pool is an ``SWAKVPool``: the local layers' K/V in its SWA part, the global layers' in its full
  part, the two parts sized by ``plan_swa_pools`` (the full part holds every token of the running
  requests, the SWA part only their live windows). The scheduler keeps a ``ReqToTokenPool`` and a
  ``SWATokenToKVPoolAllocator`` (page size > 1) and batches continuously, with chunked prefill; after
  every step each request gives back, with ``free_swa``, the SWA part of its whole pages whose tokens
  all left the window, and ``free`` gives back the rest when it finishes. Every step ends with the
  allocator's ``check_integrity()``, a check that each request's live window is mapped, and a check
  that the SWA part holds at most a live window and a page per request.
- The model runner calls the HF modules for everything but attention: the embedding (scaled by
  sqrt(hidden)), the RMSNorms (Gemma's ``1 + weight``, before and after attention and MLP), the q/k
  norms, the projections, the local and global rotary embeddings, the MLP, the final norm, the LM head
  and the final logit soft-capping. Each layer writes the step's K/V with ``pool.set_kv_buffer``
  (global layer ids: the pool routes a local layer's write through the full-to-SWA mapping) and
  attends over rows read back from its part: a global layer over each request's slots from
  ``req_to_token``, a local layer over those of its window translated through the mapping
  (``translate_loc_from_full_to_swa``); a key inside the window without a SWA slot is an error.

The attention is transformers' eager attention: scores scaled by ``query_pre_attn_scalar ** -0.5``,
no score soft-capping (HF's ``Gemma3Attention`` passes none, whatever ``attn_logit_softcapping``
says), a causal mask, and for local layers the window rule of ``masking_utils.sliding_window_overlay``:
the query at position q sees the keys at positions k with ``q - sliding_window < k <= q``.

Checks, as the Llama runner's (docs there): with an fp32 model and an fp32 pool every generated token
equals HF's greedy ``generate`` of each prompt alone and the logits are within ``LOGIT_RTOL``
(else exit 1); bf16 and FP8 pools report token agreement and KL against HF, and must generate what HF
generates through a cache that rounds K/V as the pool does (HF's own sliding cache, which keeps the
last ``sliding_window - 1`` tokens of a local layer); every slot of both parts is back at the end.
FP8 pools run at scale 1.0 and with the scales the pool's own calibration gives (each layer's from
its part, keyed by layer id), when the ``SWAKVPool`` offers ``calibrated_scales``.

Speculative decoding (``--spec-width W``, default 4, 0 for none; on the pools of ``--spec-dtypes``):
each decode step drafts ``W - 1`` tokens per request and verifies the block ``[last token, drafts]`` in
one forward. The draft is the target itself on an fp8_e5m2 ``MHATokenToKVPool`` of every layer at
the target's full slots (scale 1.0; sized with the SWA pools by ``plan_swa_pools``), which agrees with
the target except where the rounding turns a near-tie. The scheduler gives each block's tokens slots
in both parts; the verify forward attends over each layer's committed rows (a local layer over the
translated slots of its window) plus the block's own K/V as the pool stores it; the accepted prefix
is committed with ``set_kv_buffer_prefix_valid`` (the pool translates a local layer's slots) and the
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
``Gemma3ForCausalLM(Gemma3TextConfig(**config))`` built in float32 right after
``torch.manual_seed(seed)``, so anyone can rebuild it and compare.

    python examples/gemma3_runner.py                       # tiny config, a few seconds on a CPU
    python examples/gemma3_runner.py --dtypes fp32 --sliding-window 6 --chunk-size 8
    python examples/gemma3_runner.py --config small --device cuda --json out.json
    python examples/gemma3_runner.py --dtypes fp32 --page-size 64 --prompt-len 70 90 --spec-width 6
    python examples/gemma3_runner.py --prefix-cache --sliding-window 6 --prompt-len 30 60 --prompts 8 --chunk-size 8

Exit status: 0 when the checks pass, 1 otherwise, 2 on bad arguments (page size 1 is refused: the SWA
allocator extends requests page by page).

Needs ``transformers`` >= 5 with ``gemma3`` (the ``model`` extra: ``pip install -e ".[model]"``).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from typing import Any, Optional, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # examples/: its shared code, support/
from support import runners as rc  # noqa: E402  (the shared scheduler, references and checks)
from support.runners import (  # noqa: E402, F401  (re-exported: the tests use them here)
    DTYPES,
    KV_LEN_MULTIPLE,
    LOGIT_RTOL,
    ForwardBatch,
    Report,
    RunConfig,
    Scales,
    attention_mask,
    grouped_attention,
    make_prompts,
    read_rows,
    unit_scales,
)
from support.runners.sliding import (  # noqa: E402, F401  (the shared sliding-window frame; the tests use it here)
    PooledKV,
    SlidingArchitecture,
    SlidingOptions,
    SlidingRunner,
    add_spec_arguments,
    format_swa_summary,
    memory_line,
    run_sliding,
    sliding_parser,
    window_keys,
)
from support.runners.verify import SpecReport  # noqa: E402
from support.runners.gemma3_model import (  # noqa: E402, F401  (the tests use them here)
    SHAPES,
    GemmaShape,
    StepMemory,
    SWAPools,
    SWAScheduler,
    build_model,
    make_pool,
    plan_pools,
    swa_geometry,
    swa_pages,
    text_config,
)

from kvpool import SWAKVPool  # noqa: E402

from transformers import Gemma3ForCausalLM  # noqa: E402
from transformers.models.gemma3.modeling_gemma3 import apply_rotary_pos_emb  # noqa: E402

PROGRAM = "gemma3_runner"


# --- the model runner ------------------------------------------------------------------------------


class PooledGemmaAttention:
    """One Gemma 3 attention layer: HF's projections, q/k norms and RoPE; K/V written to the
    ``SWAKVPool`` under the global layer id and read back from the layer's part (``PooledKV``)."""

    def __init__(self, attn: torch.nn.Module, layer_id: int, kv: SWAKVPool) -> None:
        self.attn = attn
        self.kv = PooledKV(layer_id, kv)

    def __call__(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
        keys: tuple[torch.Tensor, torch.Tensor], k_scale: torch.Tensor, v_scale: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """x [T, hidden] (normed), cos/sin [T, head_dim] of the layer's kind, ``keys``: (slots of the
        layer's part [B, L], mask [B, 1, G*Tq, L]); returns the attention output [T, hidden]."""
        a, t = self.attn, x.shape[0]
        q = a.q_norm(a.q_proj(x).view(t, -1, a.head_dim))
        k = a.k_norm(a.k_proj(x).view(t, -1, a.head_dim))
        v = a.v_proj(x).view(t, -1, a.head_dim)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)  # heads on dim 1
        slots, mask = keys
        rows_k, rows_v = self.kv.rows(batch, k, v, slots, k_scale, v_scale, q.dtype)
        return a.o_proj(grouped_attention(q, rows_k, rows_v, batch, mask, a.scaling))


class Gemma3Runner(SlidingRunner):
    """Runs a ``Gemma3ForCausalLM``'s forward over a ``ForwardBatch`` with its KV cache in ``pools``
    (``SlidingRunner``: parameters, speculative decoding).

    Parameters
    ----------
    model : an HF ``Gemma3ForCausalLM`` (its modules are called; its own attention is not).
    pools : ``SWAPools`` whose ``SWAKVPool`` has the model's KV heads and head_dim, its local layers
        in the SWA part and its global layers in the full part.
    scales : per layer ``(k_scale, v_scale)`` float32 tensors on the pool's device, a list in layer
        order or a mapping from layer id (what the pool's calibration gives); default 1.0. Used by FP8
        pools only.
    draft_pool : the draft's pool (``SWAPools.draft``) for speculative decoding, or None.
    """

    attention = PooledGemmaAttention

    def hidden(self, batch: ForwardBatch) -> torch.Tensor:
        """The residual stream after the planned layers, [T, hidden]."""
        m = self.model.model
        x = m.embed_tokens(batch.input_ids)  # [T, hidden], scaled by sqrt(hidden)
        rope = {}
        for kind in self.kinds:
            cos, sin = m.rotary_emb(x, batch.positions[None], kind)
            rope[kind] = (cos[0], sin[0])
        keys = self.keys(batch)
        for p in self.plan:
            layer = p.layer
            h = p.attn(layer.input_layernorm(x), *rope[p.kind], batch, keys[p.kind], *p.scales)
            x = x + layer.post_attention_layernorm(h)
            x = x + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(x)))
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm, the LM head and the final soft-capping of ``x`` [N, hidden]: [N, vocab]."""
        cap = self.model.config.final_logit_softcapping
        logits = self.model.lm_head(self.model.model.norm(x))
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


class Gemma3(SlidingArchitecture):
    """Gemma 3's model and runner on the sliding-window pools, for the shared ``serve``/``run`` (``GEMMA3``)."""

    program = PROGRAM
    model_name = "Gemma3ForCausalLM"
    label = "Gemma 3"

    def build_model(self, cfg: RunConfig) -> Gemma3ForCausalLM:
        if not isinstance(cfg.shape, GemmaShape):
            raise ValueError(f"shape must be a GemmaShape for Gemma 3, got {type(cfg.shape).__name__}")
        return build_model(text_config(cfg.shape).to_dict(), DTYPES[cfg.model_dtype], cfg.device, cfg.seed)

    def make_pool(self, cfg: RunConfig, model: Any, dtype: torch.dtype) -> SWAPools:
        return make_pool(cfg, model, dtype, self.spec_width)

    def runner(self, model: Any, pool: Any, scales: Optional[Scales]) -> Gemma3Runner:
        return Gemma3Runner(model, pool, scales, self.draft_pool(pool))


GEMMA3 = Gemma3()


# --- the run, the report and --json -----------------------------------------------------------------


def progress(msg: str) -> None:
    print(f"{PROGRAM}: {msg}", file=sys.stderr, flush=True)


def run(cfg: RunConfig, opts: SlidingOptions = SlidingOptions(), log: Optional[Any] = None) -> SpecReport:
    """Build the model, serve the prompts on a pool of each dtype, compare each run with HF; then the
    speculative runs of ``opts`` and ``--json``. ``log`` is told what starts."""
    return run_sliding(cfg, Gemma3, opts, lambda c: text_config(c.shape).to_dict(), log)  # type: ignore[arg-type]


def format_summary(rep: Report) -> str:
    """The shared summary, with the window and, after each pool's lines, its sliding-window memory."""
    return format_swa_summary(rep, rep.config.shape.sliding_window, "local")  # type: ignore[attr-defined]


# --- command line -----------------------------------------------------------------------------------

#: The runner's defaults where they differ from ``RunConfig``'s: prompts longer than the window and
#: than a prefill chunk, generation well past the window, pages of 4 (the window is not a page multiple).
RUN_DEFAULTS: dict[str, Any] = dict(prompts=6, batch=3, prompt_len=(20, 40), new_tokens=(6, 20), page_size=4, chunk_size=16)


def make_parser() -> argparse.ArgumentParser:
    p = sliding_parser(PROGRAM, __doc__)
    p.add_argument("--config", choices=sorted(SHAPES), default="tiny", help="model shape preset")
    p.add_argument("--layers", type=int, help="override the preset's layer count")
    p.add_argument("--head-dim", type=int, help="override the preset's attention head_dim")
    p.add_argument("--vocab", type=int, help="override the preset's vocabulary size")
    p.add_argument("--sliding-window", type=int, help="override the preset's window of the local layers (tokens)")
    p.add_argument("--sliding-window-pattern", type=int,
                   help="every N-th layer is global, the others local (Gemma 3: 6)")  # fmt: skip
    add_spec_arguments(p)
    rc.add_run_arguments(p, **RUN_DEFAULTS)
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> tuple[RunConfig, SlidingOptions]:
    a = make_parser().parse_args(argv)
    names = ("layers", "head_dim", "vocab", "sliding_window", "sliding_window_pattern")
    overrides = {k: getattr(a, k) for k in names if getattr(a, k) is not None}
    cfg = rc.run_config(a, replace(SHAPES[a.config], **overrides))
    return cfg, SlidingOptions(a.spec_width or None, tuple(a.spec_dtypes), a.json)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return rc.run_main(argv, parse_args, PROGRAM, execute=lambda cfg, opts: run(cfg, opts, progress),  # type: ignore[arg-type]
                       summary=format_summary)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
