"""The Qwen3.5 runner's layers over kvpool's pools: gated full attention whose K/V goes through the
``HybridLinearKVPool`` (``PooledGatedAttention``), Gated DeltaNet layers whose convolution window and
recurrent state live in the ``MambaPool`` (``PooledGatedDeltaNet``), the model runner
(``Qwen35Runner``) and its speculative-decoding variant (``SpecRunner``)."""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F

from transformers import Qwen3_5MoeForCausalLM
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as qwen

from kvpool import MambaPool, MHATokenToKVPool
from support.runners.attention import attention_mask, grouped_attention, read_rows
from support.runners.config import Scales, unit_scales
from support.runners.formats import per_token_head_rows
from support.runners.qwen35_model import HybridPools, hybrid_geometry
from support.runners.scheduler import ForwardBatch
from support.runners.serving import ModelRunner
from support.runners.verify import SpeculativeSteps, as_stored, verify_keys, verify_mask

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
        if batch.loc_2d is None:
            self.pool.set_kv_buffer(self, batch.loc, k, v, k_scale, v_scale)
            # A per-token-head pool's rows are read from its codes and scales after the write.
            k_buf, v_buf = per_token_head_rows(self.pool, self.layer_id, q.dtype) or self.pool.get_kv_buffer(self.layer_id)
            keys = read_rows(k_buf, batch.kv_slots, k_scale, q.dtype)
            values = read_rows(v_buf, batch.kv_slots, v_scale, q.dtype)
        else:
            k_buf, v_buf = self.pool.get_kv_buffer(self.layer_id)
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


class Qwen35Runner(ModelRunner):
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


class SpecRunner(SpeculativeSteps, Qwen35Runner):
    """``Qwen35Runner`` whose decode steps are verify steps (see the module docstring and
    ``support.runners.verify``): drafts from the target without its linear layers, K/V of the draft
    in ``draft_pool`` (same slots as the target's), greedy acceptance, commit of the accepted prefix
    (K/V with the verify write, states with ``MambaPool.commit``)."""

    def __init__(self, model: Qwen3_5MoeForCausalLM, pool: HybridPools, scales: Optional[Scales],
                 draft_pool: MHATokenToKVPool) -> None:  # fmt: skip
        super().__init__(model, pool, scales)
        self.start_speculation(Qwen35Runner(model, draft_pool, self.scales, linear=False))

    @torch.no_grad()
    def verify_logits(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model.lm_head(self.hidden(batch))  # [T, vocab], every block token

    def commit(self, batch: ForwardBatch, commit_lens: torch.Tensor) -> None:
        for attn, (k_scale, v_scale) in self.attention:
            attn.commit(batch.loc_2d, commit_lens, k_scale, v_scale)  # type: ignore[arg-type]
        self.pool.table.mamba_pool.commit(batch.state_slots, commit_lens)
