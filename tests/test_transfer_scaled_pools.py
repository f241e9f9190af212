"""Transfers between ranks and pools whose rows carry scales beside their codes (both FP4 formats,
the FP4 latent pool, per-token-head FP8, a hybrid pool holding one): the wire layout has K and V
rows only, so a sender or receiver over such a pool is refused at construction with a TypeError
naming the pool's kind and parts, before any handshake or copy.
"""

from __future__ import annotations

import pytest
import torch
from kvassert import DEVICE, SCALED_KINDS, scaled_pool

from kvpool.pools.hybrid_kv_pool import HybridLinearKVPool
from kvpool.transfer import KVReceiver, KVSender


@pytest.mark.parametrize("device", [DEVICE])
@pytest.mark.parametrize("endpoint", [KVSender, KVReceiver], ids=["sender", "receiver"])
@pytest.mark.parametrize("kind", SCALED_KINDS)
def test_an_endpoint_over_a_pool_with_scales_is_refused(kind, endpoint, device):
    pool = scaled_pool(kind, device)
    with pytest.raises(TypeError, match=f"got {type(pool).__name__}: its rows keep scales beside their codes"):
        endpoint(pool)


@pytest.mark.parametrize("device", [DEVICE])
def test_a_hybrid_pool_holding_a_per_token_head_pool_is_refused(device):
    pool = HybridLinearKVPool(
        20, torch.float8_e4m3fn, 1, 2, 16, [3, 7], False, device, None, kv_scale_mode="per_token_head"
    )
    with pytest.raises(TypeError, match=r"MHATokenToKVPoolFP8PerTokenHead \(the full-attention pool of a "
                       r"HybridLinearKVPool\).*k_buffer, v_buffer, k_scale_buffer, v_scale_buffer"):
        KVSender(pool)
