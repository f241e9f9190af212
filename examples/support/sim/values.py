"""The K/V values serve_sim's "model" produces, and the scales a checkpoint would carry for them."""

from __future__ import annotations

import torch

from support.sim.config import K_SCALE, LATENT_SCALE, LAYER_LOG2_MAGNITUDE, V_SCALE


# --- K/V values the "model" produces ------------------------------------------------------------

_M31 = 2_147_483_647  # integer hashing modulo a prime keeps every intermediate below 2**62


def layer_magnitude(layer: int) -> tuple[float, float]:
    """The powers of two that ``layer``'s K and V values (and their checkpoint scales) are scaled by."""
    k_log2, v_log2 = LAYER_LOG2_MAGNITUDE[layer % len(LAYER_LOG2_MAGNITUDE)]
    return 2.0**k_log2, 2.0**v_log2


def kv_values(rids: torch.Tensor, positions: torch.Tensor, layer: int, heads: int, head_dim: int) -> torch.Tensor:
    """K and V of tokens (rid, position) at ``layer``: Tensor [T, 2, heads, head_dim] bfloat16.

    Pure integer arithmetic, then multiples of 1/256 in [-16, 16) times the layer's power of two
    (``layer_magnitude``; exact, so rounding to bfloat16 commutes with it), so the same values come
    out on every device and for any batch shape; the check regenerates them.
    """
    lanes = torch.arange(2 * heads * head_dim, dtype=torch.int64, device=rids.device)
    key = (rids * 65_537 + positions) * 131 + layer
    h = (key[:, None] * 4_099 + lanes) % _M31
    for _ in range(2):
        h = (h * 48_271) % _M31
        h = h ^ (h >> 11)
    values = ((h % 8_192) - 4_096).to(torch.float32).view(-1, 2, heads * head_dim)
    k_mag, v_mag = layer_magnitude(layer)
    magnitude = torch.tensor([k_mag / 256.0, v_mag / 256.0], dtype=torch.float32, device=rids.device)
    return (values * magnitude[:, None]).to(torch.bfloat16).view(-1, 2, heads, head_dim)


Scales = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k_scale, v_scale), float32 on the pool's device


def checkpoint_scales(layers: int, device: torch.device, mla: bool = False) -> Scales:
    """The scales a checkpoint would carry, per layer: K_SCALE and V_SCALE (an MLA row: LATENT_SCALE,
    as (s, s)) times the layer's magnitude."""
    out = []
    for layer in range(layers):
        k_mag, v_mag = layer_magnitude(layer)
        k, v = (LATENT_SCALE * k_mag, LATENT_SCALE * k_mag) if mla else (K_SCALE * k_mag, V_SCALE * v_mag)
        out.append(tuple(torch.tensor([s], dtype=torch.float32, device=device) for s in (k, v)))
    return out  # type: ignore[return-value]
