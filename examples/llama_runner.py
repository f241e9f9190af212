"""Serve prompts with a Llama model whose KV cache lives in kvpool, and check it against transformers.

A model runner and a scheduler in the shape of a serving engine's, around a Hugging Face
``LlamaForCausalLM`` (by default a small seeded random-init model built locally; GQA, fewer KV heads
than query heads):

- The scheduler keeps a ``ReqToTokenPool`` and a ``PagedTokenToKVPoolAllocator`` (page size > 1) and
  batches continuously: it admits waiting prompts while request rows and pages allow, prefills them
  in one ragged batch, otherwise decodes every running request by one token; requests ask for
  different numbers of tokens, finish at different steps, and give their slots back.
- The model runner calls the HF modules for everything but attention: embedding, RMSNorms, the Q/K/V/O
  projections, rotary embedding (``model.model.rotary_emb`` and ``apply_rotary_pos_emb``), MLP and LM
  head. Each layer writes the step's K/V with ``pool.set_kv_buffer`` (the fused Triton kernel on a
  GPU) and attends over each request's rows read back from the pool through ``req_to_token``
  (FP8 rows multiplied back by the layer's scale) with ``torch.nn.functional.scaled_dot_product_attention``.

It then compares, for each pool dtype, every generated token and next-token distribution with HF's
own greedy ``generate`` of each prompt alone: with an fp32 model and an fp32 pool the tokens must be
identical and the logits within ``LOGIT_RTOL`` (else the run exits 1); with a bf16 pool it reports
whether the tokens agree; with an FP8 pool it reports token agreement and the mean KL divergence of
the next-token distributions from HF's, with scale 1.0 and, when the pool offers
``calibrated_scales``, with scales calibrated on the same prompts.

A 16-bit or FP8 pool changes the model's numbers, so on a random-init model (whose top two logits
are often close) its greedy tokens can part from HF's at a near-tie. To check such a pool exactly as
well, each one is also compared with HF generating through a cache that rounds the K/V it stores the
way the pool does (docs/contract.md, "The write": divide by the scale, saturate, cast; multiply back
on reading): there the tokens should be identical, and the logits agree to ~1e-6 except where one
K/V element falls on the other side of a rounding boundary.

The pool formats that keep scales beside their codes are ``--dtypes`` names too (support/runners/formats.py):
``fp4_e2m1`` (SGLang's FP4, ``MHATokenToKVPoolFP4``), ``nvfp4`` (two-level NVFP4, global scale 1.0) and
``fp8_e4m3_per_token_head`` / ``fp8_e5m2_per_token_head`` (``MHATokenToKVPoolFP8PerTokenHead``): their
getters dequantize to the model's dtype, the rounded reference rounds by each format's rule, and a note
gives the round-trip error of HF's K/V in each format beside bf16 and per-tensor FP8.

    python examples/llama_runner.py                          # GPU if there is one, else CPU
    python examples/llama_runner.py --config tiny --dtypes fp32 fp8_e4m3 fp4_e2m1 nvfp4 fp8_e4m3_per_token_head
    python examples/llama_runner.py --config tiny --dtypes fp32 bf16
    python examples/llama_runner.py --config 8b-4layer --device cuda --prompts 16 --batch 8
    python examples/llama_runner.py --config tiny --prefix-cache   # prompts sharing prefixes on a RadixCache
    python examples/llama_runner.py --config tiny --dtypes fp32 --prefix-cache --host-tier --storage file
    python examples/llama_runner.py --config tiny --dtypes fp32 --prefix-cache --host-tier --storage mooncake \
        --storage-faults 0.2 --json tiers.json   # its own mooncake_master on 127.0.0.1, faults injected

With ``--host-tier`` the prefix cache is a ``HiRadixCache`` (a host tier below the device), with
``--storage file|mooncake`` a storage tier below that (support/runners/tiers.py): each pool's run is
checked against no cache, a device-only cache and a second engine that serves the prompts from what
the first stored (tokens identical, tokens loaded from storage and from the host > 0).

Exit status: 0 when the fp32 check passes (or was not requested) and the allocators are consistent,
1 otherwise, 2 on bad arguments.

Needs ``transformers`` (the ``model`` extra: ``pip install -e ".[model]"``).

The scheduler, the request table, the references and the checks live in
``examples/support/runners/``, shared with ``examples/deepseek_runner.py`` (DeepSeek-V3's multi-head
latent attention on an ``MLATokenToKVPool``) and ``examples/qwen35_runner.py`` (Qwen3.5's hybrid
linear/full attention on KV and state pools): what differs between model families is an
``Architecture`` (build the model, make its pool, run its forward over a ``ForwardBatch``). This
module re-exports the shared names, with ``serve``, ``calibrate`` and ``run`` defaulting to Llama's.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # examples/: its shared code, support/
from support import runners as rc  # noqa: E402  (the shared scheduler, references and checks)
from support.runners import tiers  # noqa: E402  (--host-tier, --storage, --json)
from support.runners.prefix import HostTier  # noqa: E402
from support.runners.formats import POOL_FORMATS, PoolFormat, write_scales  # noqa: E402
from support.runners import (  # noqa: E402, F401  (re-exported: the tests and benchmarks use them here)
    DTYPES,
    KV_LEN_MULTIPLE,
    LOGIT_RTOL,
    MODEL_DTYPES,
    Agreement,
    Architecture,
    ForwardBatch,
    Generation,
    PoolRun,
    Prompt,
    Report,
    Request,
    RoundingCache,
    RunConfig,
    Scales,
    Scheduler,
    ServeResult,
    Shape,
    add_run_arguments,
    attention_mask,
    compare,
    format_summary,
    grouped_attention,
    hf_reference,
    make_prompts,
    read_rows,
    round_like_pool,
    run_config,
    run_main,
    transformers,
    unit_scales,
)

from kvpool import MHATokenToKVPool  # noqa: E402
from kvpool.checks import positive_int  # noqa: E402
from kvpool.pools.base import KVCache  # noqa: E402

from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel  # noqa: E402
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

# --- configuration --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a Llama-architecture model (head_dim = hidden // heads)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab"):
            positive_int(getattr(self, name), name)
        if self.hidden % self.heads:
            raise ValueError(f"hidden must be a multiple of heads = {self.heads}, got {self.hidden}")
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads must divide heads = {self.heads}, got {self.kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def describe(self) -> str:
        return (
            f"{self.layers} layers, hidden {self.hidden}, {self.heads} query / {self.kv_heads} KV heads x "
            f"{self.head_dim}, intermediate {self.intermediate}, vocab {self.vocab}"
        )


SHAPES = {
    "tiny": ModelShape(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=128),
    "small": ModelShape(layers=4, hidden=256, heads=8, kv_heads=2, intermediate=512, vocab=512),
    # Llama-3-8B's dimensions (and rope theta) with 4 of its 32 layers.
    "8b-4layer": ModelShape(
        layers=4, hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256, rope_theta=500000.0
    ),
}


# --- the model -------------------------------------------------------------------------------------


def build_model(shape: ModelShape, dtype: torch.dtype, device: str | torch.device, seed: int) -> LlamaForCausalLM:
    """A seeded random-init ``LlamaForCausalLM`` of ``shape``, built on ``device`` in ``dtype``.

    Weights are drawn with std ``1/sqrt(hidden)``, so projections keep unit-scale activations:
    attention is far from uniform and next-token distributions are far from flat, which makes the
    comparison with HF sensitive to a wrong row (Llama's default 0.02 is that value at hidden 2500).
    No token is an end-of-sequence token, so every request generates exactly what it asks for.
    """
    config = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=8192,
        rope_theta=shape.rope_theta,
        initializer_range=shape.hidden**-0.5,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    return model.eval()


def kv_geometry(model: LlamaForCausalLM) -> tuple[int, int, int]:
    """(KV heads, head_dim, layers) of an HF Llama model: what its KV pool must hold."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return c.num_key_value_heads, head_dim, c.num_hidden_layers


# --- the model runner ------------------------------------------------------------------------------


class PooledAttention:
    """One attention layer: HF's projections and RoPE, K/V written to and read from the pool."""

    def __init__(self, attn: torch.nn.Module, layer_id: int, pool: MHATokenToKVPool) -> None:
        self.attn = attn
        self.layer_id = layer_id  # what set_kv_buffer reads from its ``layer`` argument
        self.pool = pool

    def __call__(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, mask: torch.Tensor,
        k_scale: torch.Tensor, v_scale: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """x [T, hidden] (normed), cos/sin [T, head_dim]; returns the attention output [T, hidden]."""
        attn, t = self.attn, x.shape[0]
        q = attn.q_proj(x).view(t, -1, attn.head_dim)
        k = attn.k_proj(x).view(t, -1, attn.head_dim)
        v = attn.v_proj(x).view(t, -1, attn.head_dim)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)  # heads on dim 1
        self.pool.set_kv_buffer(self, batch.loc, k, v, *write_scales(self.pool, k_scale, v_scale))
        k_buf, v_buf = self.pool.get_kv_buffer(self.layer_id)
        keys = read_rows(k_buf, batch.kv_slots, k_scale, q.dtype)
        values = read_rows(v_buf, batch.kv_slots, v_scale, q.dtype)
        return attn.o_proj(grouped_attention(q, keys, values, batch, mask, attn.scaling))


class LlamaRunner(rc.ModelRunner):
    """Runs a ``LlamaForCausalLM``'s forward over a ``ForwardBatch`` with its KV cache in ``pool``.

    Parameters
    ----------
    model : an HF ``LlamaForCausalLM`` (its modules are called; its own attention is not).
    pool : an ``MHATokenToKVPool`` with the model's KV heads, head_dim and layers (ids 0..layers-1).
    scales : per layer ``(k_scale, v_scale)`` float32 tensors on the pool's device (one element, or one
        per KV head), index = layer id - pool.start_layer; default 1.0. Used by FP8 pools only.
    """

    def __init__(self, model: LlamaForCausalLM, pool: MHATokenToKVPool, scales: Optional[Scales] = None) -> None:
        c = model.config
        want = kv_geometry(model)
        got = (pool.head_num, pool.head_dim, pool.layer_num)
        if want != got:
            raise ValueError(f"pool must have (KV heads, head_dim, layers) = {want} to hold this model, got {got}")
        self.model = model
        self.pool = pool
        self.groups = c.num_attention_heads // c.num_key_value_heads
        self.layers = [
            PooledAttention(layer.self_attn, pool.start_layer + i, pool) for i, layer in enumerate(model.model.layers)
        ]
        self.scales = scales if scales is not None else unit_scales(c.num_hidden_layers, pool.device)
        if len(self.scales) != c.num_hidden_layers:
            raise ValueError(
                f"scales must have one (k_scale, v_scale) per layer ({c.num_hidden_layers}), got {len(self.scales)}"
            )

    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits of each request's last token: [B, vocab] in the model's dtype."""
        m = self.model.model
        x = m.embed_tokens(batch.input_ids)  # [T, hidden]
        cos, sin = m.rotary_emb(x, batch.positions[None])
        cos, sin = cos[0], sin[0]
        mask = attention_mask(batch, self.groups)
        for layer, attn, (k_scale, v_scale) in zip(m.layers, self.layers, self.scales):
            x = x + attn(layer.input_layernorm(x), cos, sin, batch, mask, k_scale, v_scale)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.lm_head(m.norm(x[batch.last_index]))


class LlamaArchitecture(Architecture):
    """Llama's model, pool and runner for the shared ``serve``/``calibrate``/``run`` (``LLAMA``)."""

    program = "llama_runner"
    model_name = "LlamaForCausalLM"
    pool_formats = {name: "" for name in POOL_FORMATS}  # MHATokenToKVPoolFP4 and the per-token-head pool

    def build_model(self, cfg: RunConfig) -> PreTrainedModel:
        return build_model(cfg.shape, DTYPES[cfg.model_dtype], cfg.device, cfg.seed)  # type: ignore[arg-type]

    def make_pool(self, cfg: RunConfig, model: PreTrainedModel, dtype: torch.dtype) -> KVCache:
        return make_pool(cfg, model, dtype)  # type: ignore[arg-type]

    def runner(self, model: PreTrainedModel, pool: KVCache, scales: Optional[Scales]) -> LlamaRunner:
        return LlamaRunner(model, pool, scales)  # type: ignore[arg-type]


LLAMA = LlamaArchitecture()


def make_pool(cfg: RunConfig, model: LlamaForCausalLM, dtype: torch.dtype | PoolFormat) -> KVCache:
    """A pool with room for ``cfg.batch`` of the longest requests (admission waits for the rest); for
    a ``PoolFormat``, its pool, whose getters dequantize to the model's dtype."""
    heads, head_dim, layers = kv_geometry(model)
    pages = cfg.batch * -(-cfg.max_context_len // cfg.page_size)
    if isinstance(dtype, PoolFormat):
        return dtype.mha_pool(pages * cfg.page_size, cfg.page_size, heads, head_dim, layers, cfg.device, model.dtype)
    return MHATokenToKVPool(pages * cfg.page_size, cfg.page_size, dtype, heads, head_dim, layers, cfg.device)


# --- serving and comparing (the shared functions, Llama by default) --------------------------------


def serve(
    model: PreTrainedModel, pool: KVCache, prompts: Sequence[Prompt], max_running: int,
    scales: Optional[Scales] = None, keep_logits: bool = True, arch: Architecture = LLAMA,
    chunk_size: Optional[int] = None, prefix_cache: bool = False, tiers: Optional[HostTier] = None,
) -> ServeResult:  # fmt: skip
    """``support.runners.serve`` with Llama's architecture by default."""
    return rc.serve(model, pool, prompts, max_running, scales, keep_logits, arch, chunk_size, prefix_cache, tiers)


def calibrate(
    cfg: RunConfig, model: PreTrainedModel, pool: KVCache, prompts: Sequence[Prompt], arch: Architecture = LLAMA
) -> Scales:
    """``support.runners.calibrate`` with Llama's architecture by default."""
    return rc.calibrate(cfg, model, pool, prompts, arch)


def run(cfg: RunConfig, arch: Architecture = LLAMA) -> Report:
    """Build the model, serve the prompts on a pool of each dtype, compare each run with HF."""
    return rc.run(cfg, arch)


# --- command line -----------------------------------------------------------------------------------


def parse_args(argv: Optional[Sequence[str]] = None) -> tuple[RunConfig, Optional[str]]:
    """The run's config and the ``--json`` path (or None)."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--config", choices=sorted(SHAPES), default="small", help="model shape preset")
    p.add_argument("--llama3-8b-shape", action="store_true", help="same as --config 8b-4layer")
    p.add_argument("--layers", type=int, help="override the preset's layer count")
    p.add_argument("--hidden", type=int, help="override the preset's hidden size (head_dim = hidden / heads)")
    p.add_argument("--heads", type=int, help="override the preset's query heads")
    p.add_argument("--kv-heads", type=int, help="override the preset's KV heads")
    p.add_argument("--vocab", type=int, help="override the preset's vocabulary size")
    add_run_arguments(p)
    tiers.add_tier_arguments(p)
    p.add_argument("--json", metavar="PATH", help="write each pool's token checks and cache tier counters")
    a = p.parse_args(argv)
    preset = SHAPES["8b-4layer" if a.llama3_8b_shape else a.config]
    names = ("layers", "hidden", "heads", "kv_heads", "vocab")
    overrides = {k: getattr(a, k) for k in names if getattr(a, k) is not None}
    return run_config(a, replace(preset, **overrides)), a.json


def config_from_args(argv: Optional[Sequence[str]] = None) -> RunConfig:
    return parse_args(argv)[0]


def main(argv: Optional[Sequence[str]] = None) -> int:
    json_path: list[Optional[str]] = []

    def parse(a: Optional[Sequence[str]]) -> tuple[RunConfig, Architecture]:
        cfg, path = parse_args(a)
        json_path.append(path)
        return cfg, LLAMA

    def execute(cfg: RunConfig, arch: Architecture) -> Report:
        rep = rc.run(cfg, arch, lambda msg: print(f"{arch.program}: {msg}", file=sys.stderr, flush=True))
        if json_path[0] is not None:
            tiers.write_json(rep, json_path[0])
        return rep

    return run_main(argv, parse, LLAMA.program, execute)


if __name__ == "__main__":
    sys.exit(main())
