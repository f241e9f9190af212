"""serve_sim's model runners (they write each layer's K/V or latent rows) and the byte check of what
they wrote."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kvpool import MHATokenToKVPool, MLATokenToKVPool, quantize
from support.sim.config import SimConfig
from support.sim.result import Mismatch, SimResult
from support.sim.scheduler import Batch, Request
from support.sim.values import Scales, checkpoint_scales, kv_values

@dataclass(frozen=True)
class Layer:
    layer_id: int


class ModelRunner:
    """Writes each layer's K/V for a batch, as every attention layer's ``forward`` would, with the
    layer's ``scales`` (default: ``checkpoint_scales``)."""

    def __init__(self, cfg: SimConfig, pool: MHATokenToKVPool, scales: Optional[Scales] = None) -> None:
        self.cfg = cfg
        self.pool = pool
        self.layers = [Layer(i) for i in range(cfg.layers)]
        if scales is None:
            scales = checkpoint_scales(cfg.layers, pool.device, mla=isinstance(pool, MLATokenToKVPool))
        if len(scales) != cfg.layers:
            raise ValueError(f"scales must have one (k_scale, v_scale) per layer ({cfg.layers}), got {len(scales)}")
        self.scales = scales

    def forward(self, batch: Batch) -> None:
        for layer in self.layers:
            kv = kv_values(batch.rids, batch.positions, layer.layer_id, self.cfg.heads, self.cfg.head_dim)
            k_scale, v_scale = self.scales[layer.layer_id]
            # K and V are strided views of one projection output, as with a fused QKV matmul.
            self.pool.set_kv_buffer(layer, batch.loc, kv[:, 0], kv[:, 1], k_scale, v_scale)

    def parts(self, rids: torch.Tensor, positions: torch.Tensor, layer: int) -> list[tuple[str, torch.Tensor]]:
        """What a write of ``layer`` stores for tokens (rid, position): (name, values) for K and V,
        quantised with the layer's k_scale and v_scale in that order."""
        kv = kv_values(rids, positions, layer, self.cfg.heads, self.cfg.head_dim)
        return [("K", kv[:, 0]), ("V", kv[:, 1])]

    def stored(self, layer: int) -> tuple[torch.Tensor, ...]:
        """The buffers of ``layer`` that hold ``parts``, in the same order: its K and V buffers."""
        return self.pool.get_kv_buffer(layer)

    def stored_bytes(self, layer: int) -> list[tuple[torch.Tensor, ...]]:
        """Per part of ``parts``, the uint8 views of the buffers of ``layer`` that hold it: one here
        (a pool that keeps scales beside its codes has two)."""
        return [(buf.view(torch.uint8),) for buf in self.stored(layer)]

    def expected_bytes(self, x: torch.Tensor, scale: torch.Tensor, layer: int, part: int) -> tuple[torch.Tensor, ...]:
        """What a write of rows ``x`` (part ``part`` of ``layer``, with its ``scale``) stores, as
        uint8 per buffer of ``stored_bytes``: here ``kvpool.quantize``'s bytes."""
        return (quantize(x, self.pool.dtype, scale).contiguous().view(torch.uint8),)

    def rows_of(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Where ``layer``'s buffers (``stored``) hold the tokens at ``slots``, and which of those
        tokens they hold ([n] bool; None: all). A pool with layers of several parts overrides it."""
        return slots, None

    def verify(self, r: Request, slots: torch.Tensor, start: int = 0) -> tuple[int, Optional[Mismatch]]:
        """Tokens of ``r`` whose stored bytes of any part (``parts``, in ``stored``) differ from what
        was written, and the first one; ``slots`` hold its positions ``start..`` (each layer's rows
        at ``rows_of``, only the tokens it holds compared)."""
        n = slots.shape[0]
        rids = r.keys(start, start + n, self.pool.device)
        positions = torch.arange(start, start + n, dtype=torch.int64, device=self.pool.device)
        bad_any = torch.zeros(n, dtype=torch.bool, device=self.pool.device)
        first: Optional[Mismatch] = None
        for layer in self.layers:
            lid = layer.layer_id
            rows, held = self.rows_of(lid, slots)
            # Part j is quantised with the layer's j-th scale (K: k_scale, V: v_scale; a latent row: k_scale).
            parts = zip(self.parts(rids, positions, lid), self.stored_bytes(lid), self.scales[lid])
            for j, ((which, x), bufs, scale) in enumerate(parts):
                bad = torch.zeros(n, dtype=torch.bool, device=self.pool.device)
                for buf, expected in zip(bufs, self.expected_bytes(x, scale, lid, j), strict=True):
                    bad |= (buf[rows] != expected).flatten(1).any(dim=1)
                if held is not None:
                    bad &= held
                if first is None and bool(bad.any()):
                    first = Mismatch(r.rid, start + int(bad.nonzero()[0]), lid, which)
                bad_any |= bad
        return int(bad_any.sum()), first


class MLAModelRunner(ModelRunner):
    """Writes each layer's latent rows as an MLA attention layer would: the latent and rotary parts
    (two column ranges of one projection output) through ``set_mla_kv_buffer`` on even layers, the
    whole row through ``set_kv_buffer`` on odd ones, so both entry points serve every run."""

    def __init__(self, cfg: SimConfig, pool: MLATokenToKVPool, scales: Optional[Scales] = None) -> None:
        super().__init__(cfg, pool, scales)  # type: ignore[arg-type]
        self.pool: MLATokenToKVPool = pool

    def latent(self, rids: torch.Tensor, positions: torch.Tensor, layer: int) -> torch.Tensor:
        """The latent rows of tokens (rid, position) at ``layer``: [T, 1, kv_cache_dim] bfloat16."""
        return kv_values(rids, positions, layer, 1, self.pool.kv_cache_dim)[:, 0]

    def parts(self, rids: torch.Tensor, positions: torch.Tensor, layer: int) -> list[tuple[str, torch.Tensor]]:
        return [("latent", self.latent(rids, positions, layer))]

    def forward(self, batch: Batch) -> None:
        r = self.pool.kv_lora_rank
        for layer in self.layers:
            row = self.latent(batch.rids, batch.positions, layer.layer_id)
            scale = self.scales[layer.layer_id][0]  # one scale per row: the pair's k_scale
            if layer.layer_id % 2 == 0:
                self.pool.set_mla_kv_buffer(layer, batch.loc, row[:, :, :r], row[:, :, r:], scale)
            else:
                self.pool.set_kv_buffer(layer, batch.loc, row, None, scale)

    def stored(self, layer: int) -> tuple[torch.Tensor, ...]:
        """The buffer of ``layer`` that holds its latent rows."""
        return (self.pool.get_key_buffer(layer),)


class Checker:
    """Verifies requests against what was written and tallies the outcome in a ``SimResult``.

    With ``corrupt``, it first flips one stored byte of the first request it checks (its V, last
    layer, middle token, or the last one the layer holds), as a stray write would, to show that the
    check fails.
    """

    def __init__(self, runner: ModelRunner, result: SimResult, corrupt: bool) -> None:
        self.runner, self.result, self.corrupt_pending = runner, result, corrupt

    def check(self, r: Request, slots: torch.Tensor) -> None:
        if self.corrupt_pending and slots.numel():
            last_layer = self.runner.layers[-1].layer_id
            rows, held = self.runner.rows_of(last_layer, slots)
            at = slots.numel() // 2 if held is None else int(held.nonzero()[-1])
            buf = self.runner.stored_bytes(last_layer)[-1][0]  # the last part's codes: V, or the latent row
            buf[(rows[at],) + (0,) * (buf.dim() - 1)] ^= 0x5A
            self.corrupt_pending = False
        bad, first = self.runner.verify(r, slots)
        res = self.result
        res.verified_requests += 1
        res.verified_tokens += slots.numel()
        res.mismatched_tokens += bad
        if res.first_mismatch is None:
            res.first_mismatch = first
