"""Attention over pool rows, as the runners' attention layers do it: rows read back and dequantised
(``read_rows``), grouped-query attention over a batch's padded keys (``grouped_attention``) and its
causal mask (``attention_mask``)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from support.runners.scheduler import ForwardBatch

def read_rows(buf: torch.Tensor, slots: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``slots`` ([B, L]) of a pool buffer ``[rows, H, D]`` as ``dtype``: ``[B, L, H, D]``. FP8
    rows are gathered as bytes (FP8 indexing is not implemented on every device) and multiplied by
    ``scale`` (per tensor, or per head ``[H]``) in float32; 16-bit and fp32 rows are cast."""
    if buf.element_size() == 1:
        rows = buf.view(torch.uint8)[slots].view(buf.dtype).to(torch.float32)
        return (rows * scale.reshape(-1, 1)).to(dtype)
    return buf[slots].to(dtype)


def grouped_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, batch: ForwardBatch, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of ragged queries ``q`` [T, Hq, D] over padded keys [B, L, Hkv, D] and values
    [B, L, Hkv, Dv].

    GQA without repeating K/V: the G = Hq/Hkv query heads that share a KV head (query head h uses
    KV head h // G, as HF's ``repeat_kv``) become G x Tq query rows of that KV head. ``mask``
    [B, 1, G*Tq, L] (from ``attention_mask``). Returns [T, Hq * Dv] in token order.
    """
    b, l, hkv, d = keys.shape
    dv = values.shape[-1]
    hq = q.shape[1]
    g, tq = hq // hkv, batch.q_index.shape[1]
    qp = q[batch.q_index].view(b, tq, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * tq, d)
    out = F.scaled_dot_product_attention(
        qp, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, scale=scale
    )  # [B, Hkv, G*Tq, Dv]
    out = out.view(b, hkv, g, tq, dv).permute(0, 3, 1, 2, 4).reshape(b, tq, hq * dv)
    return out[batch.token_mask]


def attention_mask(batch: ForwardBatch, groups: int, window: Optional[int] = None) -> torch.Tensor:
    """[B, 1, G*Tq, L] bool: query row (g, j) of a request sees keys 0..position(j) (causal; the
    request's own keys only, since position < its length); with ``window``, only the keys k with
    ``position(j) - window < k`` of those (transformers' sliding-window rule)."""
    b, tq = batch.q_positions.shape
    keys = torch.arange(batch.kv_slots.shape[1], device=batch.kv_slots.device)
    base = keys[None, None, :] <= batch.q_positions[:, :, None]  # [B, Tq, L]
    if window is not None:
        base &= keys[None, None, :] > batch.q_positions[:, :, None] - window
    return base[:, None].expand(b, groups, tq, keys.shape[0]).reshape(b, 1, groups * tq, keys.shape[0])
