"""Serve prompts with a DeepSeek-V3 model whose latent KV cache lives in kvpool's MLA pool, and check
it against transformers.

The DeepSeek-V3 counterpart of examples/llama_runner.py, sharing with it (in examples/support/runners/)
the scheduler (``ReqToTokenPool`` + ``PagedTokenToKVPoolAllocator``, continuous batching), the HF
references and the checks; only the model and its attention differ. The model is a small seeded random-init ``DeepseekV3ForCausalLM``
with the whole architecture in it: a low-rank query (``q_a_proj``/``q_a_layernorm``/``q_b_proj``),
multi-head latent attention, YaRN RoPE on interleaved pairs, a dense first layer and MoE layers after
it (a router over a few routed experts plus a shared expert).

Per layer, the model runner calls HF's modules for the projections and norms and does attention
itself over an ``MLATokenToKVPool``, whose row per token is what HF's own cache holds: the
normalised latent ``kv_a_layernorm(c_kv)`` (``kv_lora_rank`` values) followed by the roped shared key
(``qk_rope_head_dim`` values):

- the step's latent and rope key are written with ``pool.set_mla_kv_buffer`` (the two parts as they
  come out of the projection, no concatenation; the fused Triton kernel on a GPU);
- each request's rows are read back through ``req_to_token`` and attended over in one of two forms
  (``--attention``), FP8 rows multiplied back by the layer's scale:
  ``absorbed`` (default; how serving engines decode over MLA caches): the rows as they are are the keys of a single KV
  head and their latent columns the values (``get_key_buffer``); ``kv_b_proj``'s key half is folded
  into the query and its value half applied to the attention output;
  ``expanded``: the rows are gathered with ``get_mla_kv_buffer`` and expanded into per-head keys and
  values by HF's own ``expand_kv`` (``kv_b_proj``), as HF's attention does.

The comparisons are the Llama runner's: with an fp32 model and an fp32 pool every generated token must
equal HF's greedy ``generate`` and the logits be within ``LOGIT_RTOL`` (else exit 1); bf16 and FP8
pools report token agreement and mean KL against HF, and are also compared with HF generating through
a cache that rounds the latent rows as the pool does (both parts divided by the one ``k_scale``),
where the tokens should be identical.

Two things make the 16-bit and FP8 numbers of this model larger than the Llama runner's. The MoE
router is discrete: a rounded latent that moves a token's router scores across a near-tie sends it to
another expert, so a small change in the cache becomes a large one in the logits (with every layer
made dense, the ``small`` preset's bf16 and FP8 KL divergences drop about 60x and 7x). And in a bf16 or fp16 model the absorbed form rounds
its products in another order than HF's expanded form, so it can part from HF at near-ties where the
expanded form does not; in an fp32 model both forms agree with HF to ~1e-6.

With ``--dtypes fp4_e2m1`` the rows live in an ``MLATokenToKVPoolFP4`` (``kv_lora_rank`` and
``qk_rope_head_dim`` multiples of 16: the ``small`` and ``v3-mla`` presets), dequantized on reading;
NVFP4 and per-token-head FP8 are refused (no MLA pool stores them).

    python examples/deepseek_runner.py                          # GPU if there is one, else CPU
    python examples/deepseek_runner.py --config tiny --dtypes fp32 bf16 --attention expanded
    python examples/deepseek_runner.py --config v3-mla --device cuda   # DeepSeek-V3's 512 + 64 rows

Exit status: 0 when the fp32 check passes (or was not requested) and the allocators are consistent,
1 otherwise, 2 on bad arguments.

Needs ``transformers`` >= 5 (the ``model`` extra: ``pip install -e ".[model]"``).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # examples/: its shared code, support/
from support import runners as rc  # noqa: E402  (the shared scheduler, references and checks)
from support.runners import (  # noqa: E402
    DTYPES,
    Architecture,
    ForwardBatch,
    RunConfig,
    Scales,
    attention_mask,
    grouped_attention,
    read_rows,
    unit_scales,
)

from kvpool import MLATokenToKVPool, MLATokenToKVPoolFP4  # noqa: E402
from support.runners.formats import PoolFormat, write_scales  # noqa: E402
from kvpool.checks import positive_int  # noqa: E402

from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (  # noqa: E402
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_interleave,
)

ATTENTION_FORMS = ("absorbed", "expanded")


# --- configuration --------------------------------------------------------------------------------


@dataclass(frozen=True)
class MLAShape:
    """The dimensions of a DeepSeek-V3-architecture model.

    ``q_lora_rank`` None gives the query one projection (``q_proj``) instead of the low-rank pair.
    The first ``dense_layers`` layers have a dense MLP of ``intermediate``; the others are MoE layers
    of ``routed_experts`` experts (``experts_per_token`` chosen per token, one group) of
    ``moe_intermediate`` plus one shared expert. ``yarn_factor`` None gives plain RoPE; otherwise YaRN
    with that factor over ``yarn_original_len`` positions (mscale 1, as DeepSeek-V3's config).
    """

    layers: int
    hidden: int
    heads: int
    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate: int
    vocab: int
    dense_layers: int = 1
    routed_experts: int = 4
    experts_per_token: int = 2
    moe_intermediate: int = 32
    rope_theta: float = 10000.0
    yarn_factor: Optional[float] = 4.0
    yarn_original_len: int = 64
    rope_interleave: bool = True

    def __post_init__(self) -> None:
        for name in (
            "layers", "hidden", "heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
            "intermediate", "vocab", "routed_experts", "experts_per_token", "moe_intermediate", "yarn_original_len",
        ):  # fmt: skip
            positive_int(getattr(self, name), name)
        if self.q_lora_rank is not None:
            positive_int(self.q_lora_rank, "q_lora_rank")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}")
        if not 0 <= self.dense_layers <= self.layers:
            raise ValueError(f"dense_layers must be in 0..layers = {self.layers}, got {self.dense_layers}")
        if self.experts_per_token > self.routed_experts:
            raise ValueError(
                f"experts_per_token must be at most routed_experts = {self.routed_experts}, "
                f"got {self.experts_per_token}"
            )
        if self.yarn_factor is not None and not self.yarn_factor > 1:
            raise ValueError(f"yarn_factor must be None or > 1, got {self.yarn_factor}")

    def describe(self) -> str:
        q = f"q_lora {self.q_lora_rank}" if self.q_lora_rank is not None else "q_proj"
        rope = f"YaRN x{self.yarn_factor:g}" if self.yarn_factor is not None else "RoPE"
        moe = self.layers - self.dense_layers
        return (
            f"{self.layers} layers ({self.dense_layers} dense, {moe} MoE of {self.routed_experts} experts "
            f"top-{self.experts_per_token} + 1 shared), hidden {self.hidden}, {self.heads} heads, {q}, "
            f"latent rows {self.kv_lora_rank} + {self.qk_rope_head_dim} rope ({rope}"
            f"{', interleaved' if self.rope_interleave else ''}), qk_nope {self.qk_nope_head_dim}, "
            f"v {self.v_head_dim}, vocab {self.vocab}"
        )


SHAPES = {
    "tiny": MLAShape(
        layers=2, hidden=64, heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, intermediate=128, vocab=128,
    ),
    "small": MLAShape(
        layers=4, hidden=256, heads=8, q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, intermediate=512, vocab=512, routed_experts=8, moe_intermediate=64,
    ),
    # DeepSeek-V3's attention (128 heads, q_lora 1536, latent rows 512 + 64, qk_nope 128, v 128, YaRN
    # x40 over 4096 positions) in 2 layers, with a small MLP, MoE and vocabulary.
    "v3-mla": MLAShape(
        layers=2, hidden=7168, heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, intermediate=2048, vocab=2048, routed_experts=8, moe_intermediate=256,
        yarn_factor=40.0, yarn_original_len=4096,
    ),
}  # fmt: skip


# --- the model --------------------------------------------------------------------------------------


def build_model(shape: MLAShape, dtype: torch.dtype, device: str | torch.device, seed: int) -> DeepseekV3ForCausalLM:
    """A seeded random-init ``DeepseekV3ForCausalLM`` of ``shape``, built on ``device`` in ``dtype``.

    As in the Llama runner, weights are drawn with std ``1/sqrt(hidden)`` (activations of unit scale,
    attention far from uniform) and no token ends a sequence. The router's correction bias stays
    zero, as HF initialises it.
    """
    rope: dict[str, object] = {"rope_type": "default", "rope_theta": shape.rope_theta}
    if shape.yarn_factor is not None:
        rope = {
            "rope_type": "yarn", "rope_theta": shape.rope_theta, "factor": shape.yarn_factor,
            "original_max_position_embeddings": shape.yarn_original_len, "mscale": 1.0, "mscale_all_dim": 1.0,
            "beta_fast": 32.0, "beta_slow": 1.0,
        }  # fmt: skip
    config = DeepseekV3Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        moe_intermediate_size=shape.moe_intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.heads,
        q_lora_rank=shape.q_lora_rank,
        kv_lora_rank=shape.kv_lora_rank,
        qk_nope_head_dim=shape.qk_nope_head_dim,
        qk_rope_head_dim=shape.qk_rope_head_dim,
        v_head_dim=shape.v_head_dim,
        first_k_dense_replace=shape.dense_layers,
        n_routed_experts=shape.routed_experts,
        num_experts_per_tok=shape.experts_per_token,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        num_mtp_layers=0,
        max_position_embeddings=int(shape.yarn_original_len * (shape.yarn_factor or 1.0)),
        rope_parameters=rope,
        rope_interleave=shape.rope_interleave,
        initializer_range=shape.hidden**-0.5,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        # HF's own loop over the experts: plain matmuls on any device and dtype (grouped_mm is not).
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation="eager", experts_implementation="eager"
        )
    return model.eval()


def mla_geometry(model: DeepseekV3ForCausalLM) -> tuple[int, int, int]:
    """(kv_lora_rank, qk_rope_head_dim, layers) of an HF DeepSeek-V3 model: what its MLA pool holds."""
    c = model.config
    return c.kv_lora_rank, c.qk_rope_head_dim, c.num_hidden_layers


def make_pool(
    cfg: RunConfig, model: DeepseekV3ForCausalLM, dtype: torch.dtype | PoolFormat
) -> MLATokenToKVPool | MLATokenToKVPoolFP4:
    """An MLA pool with room for ``cfg.batch`` of the longest requests (admission waits for the rest);
    for the ``fp4_e2m1`` format an ``MLATokenToKVPoolFP4``, whose getters dequantize to the model's
    dtype (``kv_lora_rank`` and ``qk_rope_head_dim`` multiples of 16)."""
    rank, rope, layers = mla_geometry(model)
    pages = cfg.batch * -(-cfg.max_context_len // cfg.page_size)
    if isinstance(dtype, PoolFormat):
        if dtype.kind != "fp4":
            raise ValueError(f"dtype must be fp4_e2m1 or a torch dtype for an MLA pool, got {dtype.name}")
        return MLATokenToKVPoolFP4(pages * cfg.page_size, cfg.page_size, dtype.name, rank, rope, layers, cfg.device,
                                   out_dtype=model.dtype)  # fmt: skip
    return MLATokenToKVPool(pages * cfg.page_size, cfg.page_size, dtype, rank, rope, layers, cfg.device)


# --- the model runner ------------------------------------------------------------------------------


class PooledMLA:
    """One DeepSeek-V3 attention layer: HF's projections, norms and RoPE; latent rows written to and
    read from the MLA pool; attention in the ``absorbed`` or ``expanded`` form."""

    def __init__(self, attn: torch.nn.Module, layer_id: int, pool: MLATokenToKVPool, form: str) -> None:
        self.attn = attn
        self.layer_id = layer_id  # what the pool's write and gather read from their ``layer`` argument
        self.pool = pool
        self.form = form
        self.rope = apply_rotary_pos_emb_interleave if attn.config.rope_interleave else apply_rotary_pos_emb

    def __call__(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, mask: torch.Tensor,
        k_scale: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """x [T, hidden] (normed), cos/sin [T, qk_rope_head_dim]; returns the attention output [T, hidden]."""
        a, t = self.attn, x.shape[0]
        q = a.q_proj(x) if a.q_lora_rank is None else a.q_b_proj(a.q_a_layernorm(a.q_a_proj(x)))
        q_nope, q_rot = q.view(t, a.num_heads, a.qk_head_dim).split([a.qk_nope_head_dim, a.qk_rope_head_dim], dim=-1)
        latent, k_rot = a.kv_a_proj_with_mqa(x).split([a.kv_lora_rank, a.qk_rope_head_dim], dim=-1)
        latent = a.kv_a_layernorm(latent)[:, None, :]  # [T, 1, kv_lora_rank]
        q_rot, k_rot = self.rope(q_rot, k_rot[:, None, :], cos, sin)  # heads on dim 1; k_rot [T, 1, rope]
        self.pool.set_mla_kv_buffer(self, batch.loc, latent, k_rot, write_scales(self.pool, k_scale, None)[0])
        if self.form == "absorbed":
            out = self._absorbed(q_nope, q_rot, batch, mask, k_scale)
        else:
            out = self._expanded(q_nope, q_rot, batch, mask, k_scale)
        return a.o_proj(out)

    def _absorbed(
        self, q_nope: torch.Tensor, q_rot: torch.Tensor, batch: ForwardBatch, mask: torch.Tensor, k_scale: torch.Tensor
    ) -> torch.Tensor:
        """Attention straight over the latent rows, as multi-query attention: one KV head whose key
        is the whole row and whose value is its latent part. HF's per-head key is ``[W_UK c, k_rot]``
        (``W_UK``: ``kv_b_proj``'s key rows for the head), and ``q_nope . W_UK c = (W_UK^T q_nope) . c``,
        so the query becomes ``[W_UK^T q_nope, q_rot]``; the per-head value ``W_UV c`` is applied after
        the (linear) attention average. ``mask`` [B, 1, heads * Tq, L]. Returns [T, heads * v_head_dim]."""
        a = self.attn
        h, r = a.num_heads, a.kv_lora_rank
        w = a.kv_b_proj.weight.view(h, a.qk_nope_head_dim + a.v_head_dim, r)
        w_uk, w_uv = w[:, : a.qk_nope_head_dim], w[:, a.qk_nope_head_dim :]
        query = torch.cat([torch.einsum("thn,hnr->thr", q_nope, w_uk), q_rot], dim=-1)  # [T, H, r + rope]
        rows = read_rows(self.pool.get_key_buffer(self.layer_id), batch.kv_slots, k_scale, query.dtype)
        out = grouped_attention(query, rows, rows[..., :r], batch, mask, a.scaling)  # [T, H * r]
        return torch.einsum("thr,hvr->thv", out.view(-1, h, r), w_uv).reshape(-1, h * a.v_head_dim)

    def _expanded(
        self, q_nope: torch.Tensor, q_rot: torch.Tensor, batch: ForwardBatch, mask: torch.Tensor, k_scale: torch.Tensor
    ) -> torch.Tensor:
        """HF's form: the rows gathered from the pool expanded by ``expand_kv`` into per-head keys
        ``[W_UK c, k_rot]`` and values ``W_UV c``. Returns [T, heads * v_head_dim]."""
        a = self.attn
        b, tq = batch.q_index.shape
        fp8 = isinstance(self.pool, MLATokenToKVPool) and self.pool.dtype.itemsize == 1  # an FP4 pool dequantizes
        read = torch.float32 if fp8 else q_nope.dtype
        nope, rope = self.pool.get_mla_kv_buffer(self, batch.kv_slots.reshape(-1), dst_dtype=read)
        if fp8:  # dequantise: the write divided both parts by the one k_scale
            nope, rope = ((p * k_scale).to(q_nope.dtype) for p in (nope, rope))
        keys, values = a.expand_kv(nope.view(b, 1, -1, a.kv_lora_rank), rope.view(b, 1, -1, a.qk_rope_head_dim))
        query = torch.cat([q_nope, q_rot], dim=-1)[batch.q_index].transpose(1, 2)  # [B, H, Tq, qk_head_dim]
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=a.scaling)
        return out.transpose(1, 2).reshape(b, tq, -1)[batch.token_mask]


class DeepseekV3Runner(rc.ModelRunner):
    """Runs a ``DeepseekV3ForCausalLM``'s forward over a ``ForwardBatch`` with its latent KV cache in
    ``pool``.

    Parameters
    ----------
    model : an HF ``DeepseekV3ForCausalLM`` (its modules are called; its own attention is not).
    pool : an ``MLATokenToKVPool`` with the model's ``kv_lora_rank``, ``qk_rope_head_dim`` and layers.
    scales : per layer ``(k_scale, v_scale)`` float32 tensors of one element on the pool's device
        (index = layer id - pool.start_layer); only ``k_scale`` is used (an MLA row has one scale),
        default 1.0. Used by FP8 pools only.
    form : ``"absorbed"`` or ``"expanded"`` attention (see the module docstring).
    """

    def __init__(
        self, model: DeepseekV3ForCausalLM, pool: MLATokenToKVPool, scales: Optional[Scales] = None,
        form: str = "absorbed",
    ) -> None:  # fmt: skip
        if form not in ATTENTION_FORMS:
            raise ValueError(f"form must be one of {', '.join(ATTENTION_FORMS)}, got {form!r}")
        want = mla_geometry(model)
        got = (pool.kv_lora_rank, pool.qk_rope_head_dim, pool.layer_num)
        if want != got:
            raise ValueError(
                f"pool must have (kv_lora_rank, qk_rope_head_dim, layers) = {want} to hold this model, got {got}"
            )
        layers = model.config.num_hidden_layers
        self.model = model
        self.pool = pool
        self.form = form
        self.layers = [
            PooledMLA(layer.self_attn, pool.start_layer + i, pool, form) for i, layer in enumerate(model.model.layers)
        ]
        self.scales = scales if scales is not None else unit_scales(layers, pool.device)
        if len(self.scales) != layers:
            raise ValueError(f"scales must have one (k_scale, v_scale) per layer ({layers}), got {len(self.scales)}")

    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits of each request's last token: [B, vocab] in the model's dtype."""
        m = self.model.model
        x = m.embed_tokens(batch.input_ids)  # [T, hidden]
        cos, sin = m.rotary_emb(x, batch.positions[None])
        cos, sin = cos[0], sin[0]
        # Every head sees the same rows: the absorbed form folds the heads into the query rows of its one
        # KV head ([B, 1, heads * Tq, L]); the expanded form's mask broadcasts over the heads ([B, 1, Tq, L]).
        mask = attention_mask(batch, self.model.config.num_attention_heads if self.form == "absorbed" else 1)
        for layer, attn, (k_scale, _) in zip(m.layers, self.layers, self.scales):
            x = x + attn(layer.input_layernorm(x), cos, sin, batch, mask, k_scale)
            x = x + layer.mlp(layer.post_attention_layernorm(x))  # dense MLP or MoE, as HF calls it
        return self.model.lm_head(m.norm(x[batch.last_index]))


class DeepseekV3(Architecture):
    """The DeepSeek-V3 architecture for the shared ``serve``/``calibrate``/``run``: the model above,
    an MLA pool, and this runner with attention in ``form``."""

    program = "deepseek_runner"
    pool_formats = {
        "fp4_e2m1": "",
        "nvfp4": "MLATokenToKVPoolFP4 stores exponent scales only",
        "fp8_e4m3_per_token_head": "there is no per-token-head MLA pool",
        "fp8_e5m2_per_token_head": "there is no per-token-head MLA pool",
    }
    kv_parts = ("latent", "rotary key")

    def __init__(self, form: str = "absorbed") -> None:
        if form not in ATTENTION_FORMS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_FORMS)}, got {form!r}")
        self.form = form
        self.model_name = f"DeepseekV3ForCausalLM, {form} MLA attention"

    def build_model(self, cfg: RunConfig) -> DeepseekV3ForCausalLM:
        if not isinstance(cfg.shape, MLAShape):
            raise ValueError(f"shape must be an MLAShape for DeepSeek-V3, got {type(cfg.shape).__name__}")
        return build_model(cfg.shape, DTYPES[cfg.model_dtype], cfg.device, cfg.seed)

    def make_pool(self, cfg: RunConfig, model: DeepseekV3ForCausalLM, dtype: torch.dtype) -> MLATokenToKVPool:
        return make_pool(cfg, model, dtype)

    def runner(
        self, model: DeepseekV3ForCausalLM, pool: MLATokenToKVPool, scales: Optional[Scales]
    ) -> DeepseekV3Runner:
        return DeepseekV3Runner(model, pool, scales, self.form)


def run(cfg: RunConfig, form: str = "absorbed") -> rc.Report:
    """Build the model, serve the prompts on an MLA pool of each dtype, compare each run with HF."""
    return rc.run(cfg, DeepseekV3(form))


# --- command line -----------------------------------------------------------------------------------


def parse_args(argv: Optional[Sequence[str]] = None) -> tuple[RunConfig, DeepseekV3]:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--config", choices=sorted(SHAPES), default="small", help="model shape preset")
    p.add_argument("--layers", type=int, help="override the preset's layer count")
    p.add_argument("--vocab", type=int, help="override the preset's vocabulary size")
    p.add_argument("--attention", choices=ATTENTION_FORMS, default="absorbed", help="how attention reads the rows")
    rc.add_run_arguments(p)
    a = p.parse_args(argv)
    overrides = {k: getattr(a, k) for k in ("layers", "vocab") if getattr(a, k) is not None}
    if "layers" in overrides:  # keep the preset's dense layers where they fit
        overrides["dense_layers"] = min(SHAPES[a.config].dense_layers, overrides["layers"])
    return rc.run_config(a, replace(SHAPES[a.config], **overrides)), DeepseekV3(a.attention)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return rc.run_main(argv, parse_args, DeepseekV3.program)


if __name__ == "__main__":
    sys.exit(main())
