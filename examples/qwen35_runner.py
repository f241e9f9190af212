"""Serve prompts with a Qwen3.5 model whose K/V lives in kvpool's ``HybridLinearKVPool`` and whose
linear-attention state lives in its ``MambaPool``, with and without speculative decoding, and check it
against transformers.

Qwen3.5 (``Qwen3_5MoeForCausalLM``) is hybrid: every ``full_attention_interval``-th layer is gated
full attention (GQA, an output gate, RoPE on part of each head, per-head q/k RMSNorms), the others are
Gated DeltaNet linear attention, which keeps no K/V per token but a fixed-size state per request: a
causal convolution window and a recurrent (SSM) state. Every layer ends in a MoE block (routed experts
plus a gated shared expert). The model here is a small seeded random-init one built locally.

The runner shares examples/runner_common.py's scheduler, references and checks with the Llama and
DeepSeek-V3 runners (continuous batching, chunked prefill with ``--chunk-size``, requests finishing at
different steps) and calls HF's modules for everything but the token mixers' caches. The pools are
SGLang's trio: a ``HybridReqToTokenPool`` (the request table, one ``MambaPool`` state slot per
request, kept across prefill chunks) and a ``HybridLinearKVPool`` over the full-attention layers.

- Full-attention layers write the step's K/V with ``pool.set_kv_buffer`` (global layer ids; the pool
  holds the full-attention layers only) and attend over each request's rows read back through
  ``req_to_token``, FP8 rows multiplied back by the layer's scale.
- Gated DeltaNet layers read each request's state from its state slot, run HF's own torch gated delta
  rule (the chunked form for prefill chunks, from the request's state as initial state; the
  recurrent form for decode), and write the new state back. A request's first chunk starts from the
  zero state, as HF's prefill does.

State layout (SGLang's, which the pool keeps) and how it is converted at the boundary with HF's code:

- Convolution window: the pool keeps the last ``conv_kernel - 1`` inputs of the convolution,
  ``[slots + 1, conv_dim, conv_kernel - 1]``; HF's cache keeps ``conv_kernel`` columns, whose first is
  never read by the next step (the causal convolution of a new token covers the new token and the
  ``conv_kernel - 1`` before it). The runner concatenates the window with the step's inputs, runs the
  depthwise convolution without padding (HF's prefill pads with zeros on the left, the same as a zero
  window) and keeps each request's last ``conv_kernel - 1`` input columns as its new window.
- Recurrent state: the pool keeps ``[slots + 1, v_heads, v_head_dim, k_head_dim]`` (float32); HF's gated
  delta rule takes and returns ``[B, v_heads, k_head_dim, v_head_dim]``: the runner transposes the last
  two dimensions on the way in and on the way out.
- The window is kept in the model's dtype (what HF's cache keeps), the recurrent state in float32.

Speculative decoding (``--spec-width W``, on the pools of ``--spec-dtypes``): each decode step drafts
``W - 1`` tokens per request and verifies the block ``[last token, drafts]`` in one target forward.
The draft model is the target without its linear-attention layers (embedding, the gated-attention
layers with their MoE blocks, final norm, LM head: a layer-skipping self-draft that needs no state); its
K/V lives in a second KV pool indexed by the target's slots, as DFLASH's draft cache is. In the verify
forward, full-attention layers attend over the pool's rows of the committed prefix plus the block's
own K/V (rounded as the pool stores it), and linear layers step the recurrent rule through the block,
keeping the state and window after every step in the ``MambaPool``'s intermediate buffers (one row
per batch position). The greedy acceptance then commits, per request, its accepted prefix: the K/V
with ``set_kv_buffer_prefix_valid`` and the state with ``MambaPool.commit(slots, accepted_steps)``;
the rejected slots go back to the allocator. The tokens must equal the non-speculative run's.

Checks (exit status 1 if one fails): with an fp32 model and an fp32 pool every generated token equals
HF's greedy ``generate`` and the logits are within ``LOGIT_RTOL`` relative; with an fp32 model the
speculative run's tokens equal the non-speculative run's on the same pool dtype (with a 16-bit model
this is reported: a verify forward's wider matmuls may round differently from one-token steps on a
GPU and part at a near-tie); the allocators, the request table and the
state pool end consistent with nothing held. bf16 and FP8 pools (scale 1.0, and calibrated) report
token agreement and KL against HF, and the identical-tokens check against HF generating through a cache
that rounds K/V as the pool does (the state is float32 in both).

With ``--prefix-cache`` the prompts share prefixes and the plain runs serve them on a
``MambaRadixCache`` (examples/runner_prefix.py): a match's state snapshot is copied into the
request's state slot and only the rest of the prompt is prefilled; with pages above one token the
prefill chunks end at page boundaries, where each request's state is copied into its track slots (the
snapshots the tree caches). The speculative runs serve without the cache.

``--json PATH`` writes ``{"config": <the text config's to_dict()>, "seed": S, "prompts": [[ids]],
"fp32_tokens": [[ids]], "spec_tokens": [[ids]]}`` (generated tokens of the fp32 pool without and with
speculative decoding); the model is ``Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**config))`` built in
float32 right after ``torch.manual_seed(S)``, so anyone can rebuild it and compare.

    python examples/qwen35_runner.py                                  # tiny config, a few seconds on a CPU
    python examples/qwen35_runner.py --head-dim 256 --spec-width 6 --json out.json
    python examples/qwen35_runner.py --config 397b-4layer --device cuda --model-dtype bf16 --dtypes bf16 fp8_e4m3

Exit status: 0 when the checks pass, 1 otherwise, 2 on bad arguments.

Needs ``transformers`` >= 5 with ``qwen3_5_moe`` (the ``model`` extra: ``pip install -e ".[model]"``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import runner_common as rc  # noqa: E402  (the shared scheduler, references and checks)
import runner_prefix  # noqa: E402  (the scheduler on a prefix cache)
from runner_common import (  # noqa: E402
    DTYPES,
    KV_LEN_MULTIPLE,
    Agreement,
    Architecture,
    ForwardBatch,
    Generation,
    Request,
    RunConfig,
    Scales,
    ServeResult,
    attention_mask,
    grouped_attention,
    read_rows,
    unit_scales,
)

from kvpool import (  # noqa: E402
    HybridLinearKVPool,
    HybridReqToTokenPool,
    MambaCacheParams,
    MambaPool,
    MambaStateDType,
    MambaStateShape,
    MHATokenToKVPool,
    reference_set_kv_buffer,
)
from kvpool.checks import positive_int  # noqa: E402

try:
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as qwen
except ImportError as e:  # older transformers 5.x
    raise ImportError(
        "qwen35_runner needs a transformers with Qwen3.5 (qwen3_5_moe): pip install -U 'transformers>=5'"
    ) from e

PROGRAM = "qwen35_runner"


# --- configuration --------------------------------------------------------------------------------


@dataclass(frozen=True)
class QwenShape:
    """The dimensions of a Qwen3.5-architecture (``qwen3_5_moe``) text model.

    Layer ``i`` is full attention iff ``(i + 1) % full_attention_interval == 0`` (3:1 linear:full at
    the default 4). Full attention: ``heads`` query / ``kv_heads`` KV heads of ``head_dim``, RoPE on the
    first ``partial_rotary * head_dim`` of each head. Gated DeltaNet: ``linear_k_heads`` key heads of
    ``linear_k_dim`` and ``linear_v_heads`` value heads of ``linear_v_dim``, convolution of
    ``conv_kernel`` taps over ``2 * key_dim + value_dim`` channels. MoE: ``experts`` routed experts of
    ``moe_intermediate`` (``experts_per_token`` per token) and a shared expert of ``shared_intermediate``.
    """

    layers: int = 4
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    linear_k_heads: int = 2
    linear_v_heads: int = 4
    linear_k_dim: int = 16
    linear_v_dim: int = 16
    conv_kernel: int = 4
    experts: int = 4
    experts_per_token: int = 2
    moe_intermediate: int = 32
    shared_intermediate: int = 32
    vocab: int = 128
    full_attention_interval: int = 4
    partial_rotary: float = 0.25
    rope_theta: float = 10000.0
    init_std: Optional[float] = None  # the weights' std (HF's initializer_range); None: 1 / sqrt(hidden)

    def __post_init__(self) -> None:
        for name in (
            "layers", "hidden", "heads", "kv_heads", "head_dim", "linear_k_heads", "linear_v_heads", "linear_k_dim",
            "linear_v_dim", "experts", "experts_per_token", "moe_intermediate", "shared_intermediate", "vocab",
            "full_attention_interval",
        ):  # fmt: skip
            positive_int(getattr(self, name), name)
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads must divide heads = {self.heads}, got {self.kv_heads}")
        if self.linear_v_heads % self.linear_k_heads:
            raise ValueError(f"linear_k_heads must divide linear_v_heads = {self.linear_v_heads}, got {self.linear_k_heads}")
        if self.experts_per_token > self.experts:
            raise ValueError(f"experts_per_token must be at most experts = {self.experts}, got {self.experts_per_token}")
        if isinstance(self.conv_kernel, bool) or not isinstance(self.conv_kernel, int) or self.conv_kernel < 2:
            raise ValueError(f"conv_kernel must be an int >= 2, got {self.conv_kernel!r}")
        if not 2 <= self.full_attention_interval <= self.layers:
            raise ValueError(
                f"full_attention_interval must be in 2..layers = {self.layers} (at least one layer of each kind), "
                f"got {self.full_attention_interval}"
            )
        if self.init_std is not None and not self.init_std > 0:
            raise ValueError(f"init_std must be None or > 0, got {self.init_std}")
        rot = self.head_dim * self.partial_rotary
        if not (rot == int(rot) and rot >= 2 and int(rot) % 2 == 0):
            raise ValueError(
                f"partial_rotary * head_dim must be an even int >= 2 (RoPE rotates pairs), got {self.partial_rotary} "
                f"* {self.head_dim} = {rot:g}"
            )

    @property
    def layer_types(self) -> list[str]:
        k = self.full_attention_interval
        return ["full_attention" if (i + 1) % k == 0 else "linear_attention" for i in range(self.layers)]

    def describe(self) -> str:
        full = self.layer_types.count("full_attention")
        return (
            f"{self.layers} layers ({self.layers - full} Gated DeltaNet, {full} gated attention), hidden "
            f"{self.hidden}, attention {self.heads} query / {self.kv_heads} KV heads x {self.head_dim} (RoPE on "
            f"{int(self.head_dim * self.partial_rotary)}), DeltaNet {self.linear_k_heads} key / {self.linear_v_heads} "
            f"value heads x {self.linear_k_dim}/{self.linear_v_dim}, conv {self.conv_kernel}, MoE {self.experts} "
            f"experts top-{self.experts_per_token} + shared, vocab {self.vocab}"
        )


SHAPES = {
    # Weights of std 0.025 (HF's default is 0.02) keep the current token's embedding strong in the
    # residual stream, so the layer-skipping draft agrees with the target on part of the tokens (random
    # weights offer nothing else to agree on), while a lost K/V row or a stale state still moves the
    # logits far beyond LOGIT_RTOL.
    "tiny": QwenShape(init_std=0.025),
    "small": QwenShape(
        layers=8, hidden=256, heads=8, kv_heads=2, head_dim=64, linear_k_heads=4, linear_v_heads=8, linear_k_dim=32,
        linear_v_dim=32, experts=8, moe_intermediate=64, shared_intermediate=64, vocab=512,
    ),
    # Qwen3.5-397B-A17B's attention (32 query / 2 KV heads x 256, RoPE on 64) and Gated DeltaNet
    # (16 key / 64 value heads x 128, conv 4) in 4 layers (3 linear, 1 full), small MoE and vocabulary.
    "397b-4layer": QwenShape(
        layers=4, hidden=4096, heads=32, kv_heads=2, head_dim=256, linear_k_heads=16, linear_v_heads=64,
        linear_k_dim=128, linear_v_dim=128, experts=8, moe_intermediate=256, shared_intermediate=256, vocab=2048,
    ),
}  # fmt: skip


def text_config(shape: QwenShape) -> Qwen3_5MoeTextConfig:
    """The HF text config of ``shape``. Weights are drawn with std ``shape.init_std``, by default
    ``1/sqrt(hidden)`` (unit-scale activations, attention far from uniform, as in the Llama runner);
    no token ends a sequence."""
    return Qwen3_5MoeTextConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        linear_num_key_heads=shape.linear_k_heads,
        linear_num_value_heads=shape.linear_v_heads,
        linear_key_head_dim=shape.linear_k_dim,
        linear_value_head_dim=shape.linear_v_dim,
        linear_conv_kernel_dim=shape.conv_kernel,
        num_experts=shape.experts,
        num_experts_per_tok=shape.experts_per_token,
        moe_intermediate_size=shape.moe_intermediate,
        shared_expert_intermediate_size=shape.shared_intermediate,
        layer_types=shape.layer_types,
        max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "default", "rope_theta": shape.rope_theta, "partial_rotary_factor": shape.partial_rotary
        },
        initializer_range=shape.init_std or shape.hidden**-0.5,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def build_model(
    config: dict[str, Any], dtype: torch.dtype, device: str | torch.device, seed: int
) -> Qwen3_5MoeForCausalLM:
    """``Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**config))`` built in float32 on the CPU right
    after ``torch.manual_seed(seed)`` (what ``--json`` tells others to rebuild), then moved to
    ``device`` and ``dtype``. Its experts run HF's own loop (plain matmuls on any device and dtype,
    which ``grouped_mm`` is not); the weights are the same either way."""
    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**config))
    model.set_experts_implementation("eager")
    return model.to(device=device, dtype=dtype).eval()


@dataclass(frozen=True)
class HybridGeometry:
    """What a Qwen3.5 model's KV pool must hold, and which layers are which."""

    kv_heads: int
    head_dim: int
    full_layers: tuple[int, ...]  # global ids of the full-attention layers
    linear_layers: tuple[int, ...]  # global ids of the Gated DeltaNet layers


def hybrid_geometry(model: Qwen3_5MoeForCausalLM) -> HybridGeometry:
    c = model.config
    return HybridGeometry(
        kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        full_layers=tuple(i for i, t in enumerate(c.layer_types) if t == "full_attention"),
        linear_layers=tuple(i for i, t in enumerate(c.layer_types) if t == "linear_attention"),
    )


# --- the pools ------------------------------------------------------------------------------------


@dataclass
class HybridPools:
    """The pools one engine process keeps for a hybrid model: ``kv``, a ``HybridLinearKVPool`` (the
    full-attention layers' K/V under global layer ids), and ``table``, a ``HybridReqToTokenPool`` (the
    request table, each request's state slot in ``table.mamba_pool``, a ``MambaPool``, which
    ``kv.mamba_pool`` names too). It stands where the shared code expects a KV pool: size, page size,
    dtype, device, path counts and calibration are the KV pool's."""

    kv: HybridLinearKVPool
    table: HybridReqToTokenPool

    def __getattr__(self, name: str) -> Any:  # size, page_size, dtype, device, stats, calibration
        return getattr(self.kv, name)


def state_params(model: Qwen3_5MoeForCausalLM) -> MambaCacheParams:
    """The state a ``MambaPool`` holds for ``model``'s linear layers: the window in the model's dtype
    (what HF's cache keeps), the recurrent state in float32."""
    c = model.config
    shape = MambaStateShape.gated_delta_net(
        num_k_heads=c.linear_num_key_heads, num_v_heads=c.linear_num_value_heads, head_k_dim=c.linear_key_head_dim,
        head_v_dim=c.linear_value_head_dim, conv_kernel=c.linear_conv_kernel_dim,
    )  # fmt: skip
    return MambaCacheParams(shape, hybrid_geometry(model).linear_layers, MambaStateDType(model.dtype, torch.float32))


def make_pool(cfg: RunConfig, model: Qwen3_5MoeForCausalLM, dtype: torch.dtype, spec_steps: Optional[int] = None) -> HybridPools:
    """A KV pool of ``dtype`` over the full-attention layers with room for ``cfg.batch`` of the longest
    requests, and a request table of ``cfg.batch`` rows with a state slot each (``spec_steps`` verify
    steps of scratch per batch position). With ``cfg.prefix_cache`` (and no ``spec_steps``) as many
    state slots again for the tree's snapshots, and with pages above one token two track slots per
    request (``enable_mamba_extra_buffer``)."""
    g = hybrid_geometry(model)
    tracks = cfg.prefix_cache and spec_steps is None and cfg.page_size > 1
    states = cfg.batch if not cfg.prefix_cache else 2 * cfg.batch * (3 if tracks else 1)  # half for the tree's snapshots
    table = HybridReqToTokenPool(
        size=cfg.batch, mamba_size=states, max_context_len=cfg.max_context_len, device=cfg.device,
        cache_params=state_params(model), enable_mamba_extra_buffer=tracks, speculative_num_draft_tokens=spec_steps,
    )  # fmt: skip
    pages = cfg.batch * -(-cfg.max_context_len // cfg.page_size)
    kv = HybridLinearKVPool(
        pages * cfg.page_size, dtype, cfg.page_size, g.kv_heads, g.head_dim, g.full_layers, False, cfg.device,
        table.mamba_pool,
    )  # fmt: skip
    return HybridPools(kv, table)


# --- the scheduler ---------------------------------------------------------------------------------


class HybridScheduler(rc.Scheduler):
    """The shared scheduler over a hybrid model's pools (each request holds a table row and a state
    slot), and (``verify_width``) verify steps in place of decode steps: each decoding request gets
    ``min(verify_width, tokens it still makes)`` slots, for its last token and its drafts."""

    def __init__(
        self, pools: HybridPools, max_running: int, max_context_len: int, chunk_size: Optional[int],
        verify_width: Optional[int] = None,
    ) -> None:  # fmt: skip
        self.pools = pools
        super().__init__(pools, max_running, max_context_len, chunk_size)  # type: ignore[arg-type]
        self.verify_width = verify_width

    def _make_table(self, max_running: int, max_context_len: int, device: torch.device) -> HybridReqToTokenPool:
        table = self.pools.table
        if max_context_len > table.max_context_len or max_running > table.size:
            raise ValueError(
                f"the pools' table has {table.size} rows of {table.max_context_len} tokens, the scheduler needs "
                f"{max_running} of {max_context_len}"
            )
        return table

    def _give_back_row(self, r: Request) -> None:
        self.table.free_mamba_cache(r.row)
        super()._give_back_row(r)

    def metadata(self, reqs: list[Request], *args: Any, **kwargs: Any) -> ForwardBatch:
        batch = super().metadata(reqs, *args, **kwargs)
        rows = torch.tensor([r.row for r in reqs], dtype=torch.int64, device=self.device)
        batch.state_slots = self.table.get_mamba_indices(rows).to(torch.int64)
        return batch

    def schedule(self) -> Optional[ForwardBatch]:
        if self.verify_width is None:
            return super().schedule()
        self._admit()
        prefilling = [r for r in self.running if r.prefilling]
        if prefilling:
            return self._prefill(prefilling)
        return self._verify(list(self.running)) if self.running else None

    def _verify(self, reqs: list[Request]) -> ForwardBatch:
        widths = [min(self.verify_width, r.max_new_tokens - len(r.output)) for r in reqs]  # type: ignore[type-var]
        starts = [r.kv_len for r in reqs]
        loc = self.alloc_extend(reqs, widths)
        self.record(reqs, starts, widths, loc)
        ids = [t for r, w in zip(reqs, widths) for t in [r.output[-1]] + [0] * (w - 1)]  # drafts filled in later
        batch = self.metadata(reqs, ids, starts, widths, loc, is_prefill=False, key_lens=starts)
        batch.loc_2d = torch.where(batch.token_mask, loc[batch.q_index], -1)
        return batch

    def advance_verify(self, batch: ForwardBatch, tokens: Sequence[list[int]], logits: Sequence[list[torch.Tensor]]) -> None:
        """Each request's accepted tokens (its committed block prefix is ``len(tokens[i])`` long);
        the rejected slots go back; finished requests are freed."""
        rejected = []
        for i, (r, toks, w) in enumerate(zip(batch.requests, tokens, batch.counts)):
            r.kv_len += len(toks)
            r.output.extend(toks)
            r.logits.extend(logits[i])
            rejected.append(batch.loc_2d[i, len(toks) : w])  # type: ignore[index]
        self.allocator.free(torch.cat(rejected))
        self.finish([r for r in batch.requests if r.done])

    def slots_in_use(self) -> int:
        state = self.table.mamba_pool
        return super().slots_in_use() + (state.size - state.available_size())


# --- the model runner ------------------------------------------------------------------------------


class PooledGatedAttention:
    """One gated full-attention layer: HF's projections, q/k norms, partial RoPE and output gate;
    K/V written to and read from the pool (``layer_id``: the layer's id in that pool)."""

    def __init__(self, attn: torch.nn.Module, layer_id: int, pool: Any) -> None:
        self.attn = attn
        self.layer_id = layer_id
        self.pool = pool
        self.pending: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # a verify block's [B * W, H, D] K and V

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q [T, Hq, D], gate [T, Hq * D], k and v [T, Hkv, D] of ``x`` [T, hidden] (normed)."""
        a, t = self.attn, x.shape[0]
        q, gate = torch.chunk(a.q_proj(x).view(t, -1, a.head_dim * 2), 2, dim=-1)
        q = a.q_norm(q)
        k = a.k_norm(a.k_proj(x).view(t, -1, a.head_dim))
        v = a.v_proj(x).view(t, -1, a.head_dim)
        q, k = qwen.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)  # heads on dim 1
        return q, gate.reshape(t, -1), k, v

    def __call__(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, mask: torch.Tensor,
        k_scale: torch.Tensor, v_scale: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """The attention output [T, hidden]; a verify batch attends over the committed rows and the
        block's own K/V and keeps them in ``pending`` for ``commit``."""
        q, gate, k, v = self.project(x, cos, sin)
        k_buf, v_buf = self.pool.get_kv_buffer(self.layer_id)
        if batch.loc_2d is None:
            self.pool.set_kv_buffer(self, batch.loc, k, v, k_scale, v_scale)
            keys = read_rows(k_buf, batch.kv_slots, k_scale, q.dtype)
            values = read_rows(v_buf, batch.kv_slots, v_scale, q.dtype)
        else:
            b, w = batch.q_index.shape
            kb, vb = k[batch.q_index].reshape(b * w, *k.shape[1:]), v[batch.q_index].reshape(b * w, *v.shape[1:])
            self.pending = (kb, vb)
            rk, rv = as_stored(kb, vb, k_buf.dtype, k_scale, v_scale)
            keys = verify_keys(read_rows(k_buf, batch.kv_slots, k_scale, q.dtype), rk.view(b, w, *k.shape[1:]))
            values = verify_keys(read_rows(v_buf, batch.kv_slots, v_scale, q.dtype), rv.view(b, w, *v.shape[1:]))
        out = grouped_attention(q, keys, values, batch, mask, self.attn.scaling)
        return self.attn.o_proj(out * torch.sigmoid(gate))

    def commit(self, loc_2d: torch.Tensor, commit_lens: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        """Write the pending verify block's accepted prefix (``commit_lens[i]`` tokens of request i)."""
        kb, vb = self.pending  # type: ignore[misc]
        self.pool.set_kv_buffer_prefix_valid(self, loc_2d, commit_lens, kb, vb, k_scale, v_scale)
        self.pending = None


def as_stored(
    k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype, k_scale: torch.Tensor, v_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``k``/``v`` [N, H, D] as a pool of ``dtype`` stores them and ``read_rows`` reads them back:
    written with kvpool's reference write into a scratch cache, then read."""
    caches = [torch.empty(t.shape, dtype=dtype, device=t.device) for t in (k, v)]
    loc = torch.arange(k.shape[0], device=k.device)
    reference_set_kv_buffer(k, v, caches[0], caches[1], loc, k_scale, v_scale)
    every = loc[None]
    return read_rows(caches[0], every, k_scale, k.dtype)[0], read_rows(caches[1], every, v_scale, v.dtype)[0]


def verify_keys(prefix: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """[B, Lp + W rounded up to KV_LEN_MULTIPLE, H, D]: the committed rows, the block's, zero padding."""
    keys = torch.cat([prefix, block], dim=1)
    pad = -keys.shape[1] % KV_LEN_MULTIPLE
    return F.pad(keys, (0, 0, 0, 0, 0, pad))


def verify_mask(batch: ForwardBatch, groups: int) -> torch.Tensor:
    """[B, 1, G*W, L] for ``verify_keys``: block query j sees the request's committed keys
    (``kv_slots`` columns before its start) and block keys 0..j."""
    b, w = batch.q_index.shape
    lp = batch.kv_slots.shape[1]
    dev = batch.kv_slots.device
    starts = torch.tensor(batch.starts, device=dev)
    committed = (torch.arange(lp, device=dev)[None, :] < starts[:, None])[:, None, :].expand(b, w, lp)
    j = torch.arange(w, device=dev)
    block = (j[None, :] <= j[:, None])[None].expand(b, w, w)
    m = torch.cat([committed, block], dim=-1)
    m = F.pad(m, (0, -m.shape[-1] % KV_LEN_MULTIPLE))
    return m[:, None].expand(b, groups, w, m.shape[-1]).reshape(b, 1, groups * w, m.shape[-1])


class PooledGatedDeltaNet:
    """One Gated DeltaNet layer: HF's projections, convolution weights, gated delta rule and gated
    norm; each request's window and recurrent state read from and written to its slot of the state
    pool, converted at the boundary (module docstring)."""

    def __init__(self, gdn: torch.nn.Module, layer_id: int, state: MambaPool) -> None:
        self.gdn = gdn
        self.layer_id = layer_id
        self.conv_state = state.get_conv_state(layer_id)  # [slots + 1, conv_dim, conv_kernel - 1]
        self.ssm_state = state.get_ssm_state(layer_id)  # [slots + 1, v_heads, v_head_dim, k_head_dim]
        spec = state.speculative_num_draft_tokens
        self.spec_conv = state.get_intermediate_conv_window(layer_id) if spec else None  # [bs + 1, K, ...]
        self.spec_ssm = state.get_intermediate_ssm_state(layer_id) if spec else None

    def __call__(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x [T, hidden] (normed) -> [T, hidden]. Prefill chunks: the chunked rule; decode: the
        recurrent rule; verify (``batch.loc_2d``): the recurrent rule step by step, every step's
        state kept in the state pool's intermediate buffers for ``commit``."""
        g = self.gdn
        t, (b, tq) = x.shape[0], batch.q_index.shape
        slots, real = batch.state_slots, batch.token_mask
        fresh = torch.tensor([s == 0 for s in batch.starts], device=x.device)

        def padded(y: torch.Tensor) -> torch.Tensor:  # [T, ...] -> [B, Tq, ...], zero on padding rows
            p = y[batch.q_index]
            return torch.where(real.view(b, tq, *([1] * (p.dim() - 2))), p, 0)

        mixed = padded(g.in_proj_qkv(x)).transpose(1, 2)  # [B, conv_dim, Tq]
        window = torch.where(fresh[:, None, None], 0, self.conv_state[slots]).to(mixed.dtype)
        full = torch.cat([window, mixed], dim=-1)  # [B, conv_dim, K - 1 + Tq]
        weight = g.conv1d.weight  # [conv_dim, 1, K]
        conv = F.silu(F.conv1d(full.to(weight.dtype), weight, g.conv1d.bias, groups=weight.shape[0])).to(mixed.dtype)
        qkv = torch.where(real[:, :, None], conv.transpose(1, 2), 0)  # [B, Tq, conv_dim]
        query, key, value = qkv.split([g.key_dim, g.key_dim, g.value_dim], dim=-1)
        query = query.reshape(b, tq, -1, g.head_k_dim)
        key = key.reshape(b, tq, -1, g.head_k_dim)
        value = value.reshape(b, tq, -1, g.head_v_dim)
        # Each key head serves v_heads // k_heads consecutive value heads: expanded here, since
        # some transformers releases' rule functions expand them and others expect them expanded.
        rep = value.shape[2] // query.shape[2]
        if rep > 1:
            query, key = query.repeat_interleave(rep, dim=2), key.repeat_interleave(rep, dim=2)
        beta = padded(g.in_proj_b(x).sigmoid())  # padding rows: beta 0 and decay 0 leave the state as it is
        decay = padded(-g.A_log.float().exp() * F.softplus(g.in_proj_a(x).float() + g.dt_bias))
        # pool [B, v_heads, v_dim, k_dim] <-> HF [B, v_heads, k_dim, v_dim]
        ssm = torch.where(fresh[:, None, None, None], 0, self.ssm_state[slots]).transpose(-1, -2)
        k = self.conv_state.shape[-1]
        rule = dict(use_qk_l2norm_in_kernel=True, output_final_state=True)
        if batch.loc_2d is not None:
            outs = []
            for j in range(tq):
                o, ssm = qwen.torch_recurrent_gated_delta_rule(
                    query[:, j : j + 1], key[:, j : j + 1], value[:, j : j + 1], g=decay[:, j : j + 1],
                    beta=beta[:, j : j + 1], initial_state=ssm, **rule,
                )  # fmt: skip
                outs.append(o)
                self.spec_ssm[:b, j] = ssm.transpose(-1, -2)  # type: ignore[index]
                self.spec_conv[:b, j] = full[:, :, j + 1 : j + 1 + k].to(self.conv_state.dtype)  # type: ignore[index]
            core = torch.cat(outs, dim=1)
        else:
            rule_fn = qwen.torch_chunk_gated_delta_rule if batch.is_prefill else qwen.torch_recurrent_gated_delta_rule
            core, ssm = rule_fn(query, key, value, g=decay, beta=beta, initial_state=ssm, **rule)
            counts = torch.tensor(batch.counts, device=x.device)
            cols = (counts[:, None] + torch.arange(k, device=x.device))[:, None, :].expand(b, full.shape[1], k)
            self.conv_state[slots] = full.gather(2, cols).to(self.conv_state.dtype)
            self.ssm_state[slots] = ssm.transpose(-1, -2).to(self.ssm_state.dtype)
        core = core[real]  # [T, v_heads, v_dim]
        z = g.in_proj_z(x).reshape(t, -1, g.head_v_dim)
        out = g.norm(core.reshape(-1, g.head_v_dim), z.reshape(-1, g.head_v_dim)).reshape(t, -1)
        return g.out_proj(out)


class Qwen35Runner(rc.ModelRunner):
    """Runs a ``Qwen3_5MoeForCausalLM``'s forward over a ``ForwardBatch``, K/V in ``pool``, linear
    attention state in ``pool.mamba_pool``.

    Parameters
    ----------
    model : an HF ``Qwen3_5MoeForCausalLM`` (its modules are called; its own attention and cache are not).
    pool : the model's ``HybridPools`` (``make_pool``), or for the draft (``linear=False``) a plain KV pool
        over the full-attention layers with dense ids.
    scales : per full-attention layer ``(k_scale, v_scale)`` float32 tensors on the pool's device (one
        element, or one per KV head), in layer order or keyed by global layer id (as the pool's
        ``calibrated_scales`` returns them); default 1.0. Used by FP8 pools only.
    linear : False to skip the linear-attention layers (the draft model of speculative decoding).
    """

    def __init__(
        self, model: Qwen3_5MoeForCausalLM, pool: Any, scales: Optional[Scales] = None, linear: bool = True,
    ) -> None:  # fmt: skip
        g = hybrid_geometry(model)
        got = (pool.head_num, pool.head_dim)
        if got != (g.kv_heads, g.head_dim):
            raise ValueError(f"pool must have (KV heads, head_dim) = {(g.kv_heads, g.head_dim)}, got {got}")
        self.model = model
        self.pool = pool
        self.groups = model.config.num_attention_heads // g.kv_heads
        if isinstance(scales, Mapping):
            scales = [scales[i] for i in g.full_layers]
        self.scales = scales if scales is not None else unit_scales(len(g.full_layers), pool.device)
        if len(self.scales) != len(g.full_layers):
            raise ValueError(
                f"scales must have one (k_scale, v_scale) per full-attention layer ({len(g.full_layers)}), "
                f"got {len(self.scales)}"
            )
        self.mixers: list[tuple[torch.nn.Module, Any]] = []  # (decoder layer, its token mixer)
        self.attention: list[tuple[PooledGatedAttention, tuple[torch.Tensor, torch.Tensor]]] = []
        for i, layer in enumerate(model.model.layers):
            if i in g.full_layers:
                layer_id = i if linear else g.full_layers.index(i)  # the draft's pool has dense ids
                attn = PooledGatedAttention(layer.self_attn, layer_id, pool)
                self.attention.append((attn, self.scales[g.full_layers.index(i)]))
                self.mixers.append((layer, attn))
            elif linear:
                self.mixers.append((layer, PooledGatedDeltaNet(layer.linear_attn, i, pool.table.mamba_pool)))
        self.scale_of = {id(a): s for a, s in self.attention}

    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits of each request's last token: [B, vocab] in the model's dtype."""
        return self.model.lm_head(self.hidden(batch)[batch.last_index])

    @torch.no_grad()
    def hidden(self, batch: ForwardBatch) -> torch.Tensor:
        """The final normed hidden state of every token, [T, hidden]."""
        m = self.model.model
        x = m.embed_tokens(batch.input_ids)  # [T, hidden]
        # Text-only M-RoPE: the same positions on all three grids, [3, 1, T] (the shape every
        # transformers 5.x release takes; later ones also broadcast [1, T]).
        cos, sin = m.rotary_emb(x, batch.positions[None, None].expand(3, 1, -1))
        cos, sin = cos[0], sin[0]
        verify = batch.loc_2d is not None
        mask = verify_mask(batch, self.groups) if verify else attention_mask(batch, self.groups)
        for layer, mixer in self.mixers:
            h = layer.input_layernorm(x)
            if isinstance(mixer, PooledGatedAttention):
                h = mixer(h, cos, sin, batch, mask, *self.scale_of[id(mixer)])
            else:
                h = mixer(h, batch)
            x = x + h
            x = x + layer.mlp(layer.post_attention_layernorm(x)[None])[0]  # the MoE block wants [B, S, hidden]
        return m.norm(x)


# --- speculative decoding --------------------------------------------------------------------------


class SpecRunner(Qwen35Runner):
    """``Qwen35Runner`` whose decode steps are verify steps (see the module docstring): drafts from
    the target without its linear layers, K/V of the draft in ``draft_pool`` (same slots as the
    target's), greedy acceptance, commit of the accepted prefix."""

    def __init__(self, model: Qwen3_5MoeForCausalLM, pool: HybridPools, scales: Optional[Scales],
                 draft_pool: MHATokenToKVPool) -> None:  # fmt: skip
        super().__init__(model, pool, scales)
        self.draft = Qwen35Runner(model, draft_pool, self.scales, linear=False)
        self.draft_len: dict[int, int] = {}  # rid -> tokens with draft K/V
        self.drafted_tokens = 0
        self.accepted_tokens = 0
        self.accept_lengths: list[int] = []  # per request and verify step: drafts accepted

    @torch.no_grad()
    def step(self, sched: rc.Scheduler, keep_logits: bool) -> Optional[str]:
        batch = sched.schedule()
        if batch is None:
            return None
        if batch.is_prefill:
            logits = self.forward(batch)
            self.draft.forward(batch)  # the draft's K/V of the prompt, at the target's slots
            for r, s, n in zip(batch.requests, batch.starts, batch.counts):
                self.draft_len[r.rid] = s + n
            sched.advance(batch, logits, keep_logits)
            return "prefill"
        self.fill_drafts(sched, batch)  # type: ignore[arg-type]
        logits = self.model.lm_head(self.hidden(batch))  # [T, vocab], every block token
        targets = logits.argmax(dim=-1).tolist()
        ids = batch.input_ids.tolist()
        host = logits.float().cpu() if keep_logits else None
        tokens, kept, pos = [], [], 0
        for w in batch.counts:
            a = 0
            while a < w - 1 and ids[pos + a + 1] == targets[pos + a]:
                a += 1
            tokens.append(targets[pos : pos + a + 1])
            kept.append(list(host[pos : pos + a + 1]) if host is not None else [])
            self.drafted_tokens += w - 1
            self.accepted_tokens += a
            self.accept_lengths.append(a)
            pos += w
        commit = torch.tensor([len(t) for t in tokens], dtype=torch.int64, device=batch.loc.device)
        for attn, (k_scale, v_scale) in self.attention:
            attn.commit(batch.loc_2d, commit, k_scale, v_scale)  # type: ignore[arg-type]
        self.pool.table.mamba_pool.commit(batch.state_slots, commit)
        for r, t, s, w in zip(batch.requests, tokens, batch.starts, batch.counts):
            if w >= 2:  # the draft wrote the block's tokens up to the second last; those accepted stay
                self.draft_len[r.rid] = s + min(len(t) - 1, w - 2) + 1
        sched.advance_verify(batch, tokens, kept)  # type: ignore[attr-defined]
        return "verify"

    def fill_drafts(self, sched: HybridScheduler, batch: ForwardBatch) -> None:
        """Draft each request's ``counts[i] - 1`` tokens into ``batch.input_ids``: the draft catches up
        on the committed tokens it has not seen (the last one at the block's first slot), then runs
        one token at a time at the block's slots."""
        reqs = [(i, r) for i, r in enumerate(batch.requests) if batch.counts[i] >= 2]
        if not reqs:
            return
        dev = sched.device
        first = [sum(batch.counts[:i]) for i in range(len(batch.counts))]
        ids = batch.input_ids.tolist()
        starts = [self.draft_len[r.rid] for _, r in reqs]
        counts = [batch.starts[i] + 1 - s for (i, _), s in zip(reqs, starts)]
        tokens = [t for (_, r), s, n in zip(reqs, starts, counts) for t in (r.prompt + r.output)[s : s + n]]
        rows = torch.tensor([r.row for _, r in reqs], device=dev).repeat_interleave(torch.tensor(counts, device=dev))
        cols = torch.tensor([s + j for s, n in zip(starts, counts) for j in range(n)], device=dev)
        loc = sched.table.req_to_token[rows, cols].to(torch.int64)
        step = sched.metadata([r for _, r in reqs], tokens, starts, counts, loc, False, None)
        for j in range(1, max(batch.counts)):
            for (i, _), d in zip(reqs, self.draft.forward(step).argmax(dim=-1).tolist()):
                ids[first[i] + j] = d
            reqs = [(i, r) for i, r in reqs if batch.counts[i] > j + 1]  # who still needs a draft
            if not reqs:
                break
            at = torch.tensor([i for i, _ in reqs], device=dev)
            step = sched.metadata(
                [r for _, r in reqs], [ids[first[i] + j] for i, _ in reqs], [batch.starts[i] + j for i, _ in reqs],
                [1] * len(reqs), batch.loc_2d[at, j], False, None,  # type: ignore[index]
            )  # fmt: skip
        batch.input_ids.copy_(torch.tensor(ids, dtype=torch.int64))


# --- the architecture, runs and report --------------------------------------------------------------


class Qwen35(Architecture):
    """The Qwen3.5 architecture for the shared ``serve``/``calibrate``/``run``; with ``spec_width``,
    speculative decoding with verify blocks of that many tokens."""

    program = PROGRAM
    model_name = "Qwen3_5MoeForCausalLM"

    def __init__(self, spec_width: Optional[int] = None) -> None:
        if spec_width is not None and (isinstance(spec_width, bool) or not isinstance(spec_width, int) or spec_width < 2):
            raise ValueError(f"spec_width must be an int >= 2 (the last token and a draft) or None, got {spec_width!r}")
        self.spec_width = spec_width

    def build_model(self, cfg: RunConfig) -> Qwen3_5MoeForCausalLM:
        if not isinstance(cfg.shape, QwenShape):
            raise ValueError(f"shape must be a QwenShape for Qwen3.5, got {type(cfg.shape).__name__}")
        return build_model(text_config(cfg.shape).to_dict(), DTYPES[cfg.model_dtype], cfg.device, cfg.seed)

    def make_pool(self, cfg: RunConfig, model: Any, dtype: torch.dtype) -> HybridPools:
        return make_pool(cfg, model, dtype, self.spec_width)

    def runner(self, model: Any, pool: Any, scales: Optional[Scales]) -> Qwen35Runner:
        if self.spec_width is None:
            return Qwen35Runner(model, pool, scales)
        kv = pool.kv.full_kv_pool
        draft_pool = MHATokenToKVPool(kv.size, kv.page_size, kv.dtype, kv.head_num, kv.head_dim, kv.layer_num, kv.device)
        return SpecRunner(model, pool, scales, draft_pool)

    def scheduler(
        self, pool: Any, max_running: int, max_context_len: int, chunk_size: Optional[int], prefix_cache: bool = False
    ) -> HybridScheduler:
        if prefix_cache and self.spec_width is not None:
            raise ValueError("prefix_cache must be False for a speculative run (spec_width set): its verify steps are not cached")
        cls = runner_prefix.caching(HybridScheduler) if prefix_cache else HybridScheduler
        return cls(pool, max_running, max_context_len, chunk_size, self.spec_width)

    def reference_scales(self, model: Any, scales: Optional[rc.LayerScales]) -> Optional[rc.LayerScales]:
        if scales is None or isinstance(scales, Mapping):
            return scales
        return dict(zip(hybrid_geometry(model).full_layers, scales))


@dataclass
class SpecRun:
    dtype: str
    width: int
    result: ServeResult
    vs_plain: Agreement  # against the non-speculative run on a pool of the same dtype
    vs_hf: Agreement


@dataclass
class QwenReport(rc.Report):
    spec_runs: list[SpecRun] = field(default_factory=list)

    @property
    def spec_check(self) -> Optional[bool]:
        """Speculative tokens identical to the non-speculative run's, with an fp32 model (None: not
        run, or a 16-bit model, where the verify forward's wider matmuls may round differently from
        one-token steps on a GPU and part at a near-tie: reported, not checked)."""
        if not self.spec_runs or self.config.model_dtype != "fp32":
            return None
        return all(s.vs_plain.identical for s in self.spec_runs)

    @property
    def ok(self) -> bool:
        return (
            super().ok and self.spec_check is not False and all(s.result.allocators_ok for s in self.spec_runs)
        )


@dataclass(frozen=True)
class QwenOptions:
    """What the Qwen3.5 runner adds to a ``RunConfig``: the speculative runs and the JSON output."""

    spec_width: Optional[int] = 4
    spec_dtypes: tuple[str, ...] = ("fp32",)
    json_path: Optional[str] = None

    def __post_init__(self) -> None:
        Qwen35(self.spec_width)  # checks the width
        for d in self.spec_dtypes:
            if d not in DTYPES:
                raise ValueError(f"spec dtype must be one of {', '.join(DTYPES)}, got {d!r}")


def progress(msg: str) -> None:
    print(f"{PROGRAM}: {msg}", file=sys.stderr, flush=True)


def run(cfg: RunConfig, opts: QwenOptions = QwenOptions(), log: Optional[Any] = None) -> QwenReport:
    """The shared runs (each pool dtype against HF), then the speculative runs on a pool of each of
    ``opts.spec_dtypes`` (compared with the plain run on that dtype and with HF), then ``--json``;
    ``log`` is told what starts."""
    log = log or (lambda msg: None)
    if opts.json_path is not None:
        if cfg.model_dtype != "fp32":
            raise ValueError(f"--json describes an fp32 model: model_dtype must be fp32, got {cfg.model_dtype!r}")
        if opts.spec_width is None or "fp32" not in opts.spec_dtypes:
            raise ValueError("--json needs a speculative run on an fp32 pool (--spec-width >= 2, fp32 in --spec-dtypes)")
    if opts.spec_width is not None:  # each speculative run is compared with a plain run on its dtype
        cfg = replace(cfg, pool_dtypes=cfg.pool_dtypes + tuple(d for d in opts.spec_dtypes if d not in cfg.pool_dtypes))
    with exact_fp32():
        return _run(cfg, opts, log)


class exact_fp32:
    """Within the block, CUDA float32 convolutions and matmuls do not round their inputs to TF32
    (cuDNN's default for convolutions): the fp32 checks compare HF's prompt-long convolution with the
    runner's chunked one, which only plain float32 keeps within LOGIT_RTOL."""

    def __enter__(self) -> None:
        self.saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False

    def __exit__(self, *exc: object) -> None:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = self.saved


def _run(cfg: RunConfig, opts: QwenOptions, log: Any) -> QwenReport:
    base = rc.run(cfg, Qwen35(), log)
    report = QwenReport(**{f.name: getattr(base, f.name) for f in dataclasses.fields(rc.Report)})
    if opts.spec_width is None:
        return report
    arch = Qwen35(opts.spec_width)
    with rc.cpu_threads(cfg):
        model = arch.build_model(cfg)
        prompts = rc.make_prompts(cfg)
        hf = rc.hf_reference(model, prompts)
        for name in opts.spec_dtypes:
            log(f"serving on a {name} pool with speculative decoding (verify blocks of {opts.spec_width})")
            plain = next(r for r in report.runs if r.dtype == name and r.scales in ("-", "1.0"))
            pool = arch.make_pool(cfg, model, DTYPES[name])
            res = rc.serve(model, pool, prompts, cfg.batch, arch=arch, chunk_size=cfg.chunk_size)
            vs_plain = rc.compare(res.generations, plain.result.generations)
            report.spec_runs.append(SpecRun(name, opts.spec_width, res, vs_plain, rc.compare(res.generations, hf)))
    if opts.json_path is not None:
        write_json(opts.json_path, cfg, prompts, report)
        log(f"wrote {opts.json_path}")
    return report


def write_json(path: str, cfg: RunConfig, prompts: Sequence[rc.Prompt], report: QwenReport) -> None:
    fp32 = next(r for r in report.runs if r.dtype == "fp32")
    spec = next(s for s in report.spec_runs if s.dtype == "fp32")
    out = {
        "config": text_config(cfg.shape).to_dict(),  # type: ignore[arg-type]
        "seed": cfg.seed,
        "prompts": [list(p.tokens) for p in prompts],
        "fp32_tokens": [g.tokens for g in fp32.result.generations],
        "spec_tokens": [g.tokens for g in spec.result.generations],
    }
    with open(path, "w") as f:
        json.dump(out, f)


def format_summary(rep: QwenReport) -> str:
    lines = rc.format_summary(rep).split("\n")[:-1]  # without the final PASS/FAIL
    for s in rep.spec_runs:
        r = s.result
        hist = {a: r.accept_lengths.count(a) for a in sorted(set(r.accept_lengths))}
        rate = 100 * r.accepted_tokens / r.drafted_tokens if r.drafted_tokens else 0.0
        lines.append(
            f"  speculative pool {s.dtype}, verify blocks of {s.width} (last token + {s.width - 1} drafts); draft: the "
            "target without its linear-attention layers, K/V in a second pool at the target's slots"
        )
        lines.append(f"    vs plain    {rc.agreement_line(s.vs_plain)}")
        lines.append(f"    vs HF       {rc.agreement_line(s.vs_hf)}")
        lines.append(
            f"    served      {r.prefill_steps} prefill + {r.verify_steps} verify steps, {r.drafted_tokens} drafts, "
            f"{r.accepted_tokens} accepted ({rate:.0f}%), drafts accepted per verify {hist}; KV commits with "
            f"set_kv_buffer_prefix_valid, state with commit(slots, accepted_steps); KV writes fused {r.fused_calls}, "
            f"reference {r.reference_calls}"
        )
        if not r.allocators_ok:
            problem = r.integrity_error or f"{r.leaked_slots} slots still held after every request finished"
            lines.append(f"    allocators  FAILED: {problem}")
    if rep.spec_runs and rep.config.prefix_cache:
        lines.append("  note        the speculative runs serve without the prefix cache (verify steps are not cached)")
    check = rep.spec_check
    if check is not None:
        lines.append(f"  spec check  {'PASS' if check else 'FAILED'}: speculative tokens identical to the non-speculative run")
    elif rep.spec_runs:
        lines.append("  spec check  not run (needs --model-dtype fp32: a 16-bit model's verify forward may round apart)")
    lines.append("PASS" if rep.ok else "FAIL")
    return "\n".join(lines)


# --- command line -----------------------------------------------------------------------------------


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROGRAM, description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--config", choices=sorted(SHAPES), default="tiny", help="model shape preset")
    p.add_argument("--layers", type=int, help="override the preset's layer count")
    p.add_argument("--head-dim", type=int, help="override the preset's attention head_dim (Qwen3.5's is 256)")
    p.add_argument("--vocab", type=int, help="override the preset's vocabulary size")
    p.add_argument("--full-attention-interval", type=int, help="every N-th layer is full attention (Qwen3.5: 4)")
    p.add_argument("--spec-width", type=int, default=4,
                   help="tokens per verify block (the last token + drafts); 0: no speculative run")  # fmt: skip
    p.add_argument("--spec-dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32"],
                   help="pool dtypes of the speculative runs")  # fmt: skip
    p.add_argument("--json", metavar="PATH", help="write config, seed, prompts and the fp32 and speculative tokens")
    rc.add_run_arguments(p, **RUN_DEFAULTS)
    return p


#: The runner's defaults where they differ from ``RunConfig``'s: prompts longer than a prefill chunk,
#: pages of 4 so that prompts and decode cross page ends.
RUN_DEFAULTS: dict[str, Any] = dict(prompts=6, batch=3, prompt_len=(4, 40), new_tokens=(4, 10), page_size=4, chunk_size=16)


def parse_args(argv: Optional[Sequence[str]] = None) -> tuple[RunConfig, QwenOptions]:
    a = make_parser().parse_args(argv)
    names = {"layers": "layers", "head_dim": "head_dim", "vocab": "vocab", "full_attention_interval": "full_attention_interval"}
    overrides = {k: getattr(a, v) for k, v in names.items() if getattr(a, v) is not None}
    cfg = rc.run_config(a, replace(SHAPES[a.config], **overrides))
    return cfg, QwenOptions(a.spec_width or None, tuple(a.spec_dtypes), a.json)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return rc.run_main(argv, parse_args, PROGRAM, execute=lambda cfg, opts: run(cfg, opts, progress),  # type: ignore[arg-type]
                       summary=format_summary)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
