"""KV-scale calibration of an ``SWAKVPool``'s two parts, each layer by its own part, keyed by global
layer id (docs/contract.md, "Sliding-window attention", "KV-scale calibration"): a mixin, kept apart
from the pool's writes and copies."""

from __future__ import annotations

from typing import Any, Optional

import torch

from kvpool.pools.built_parts import FP4_NOT_CALIBRATED, check_fp4_observe
from kvpool.pools.mha_fp4_pool import MHATokenToKVPoolFP4


class SWACalibration:
    """Calibration of ``SWAKVPool`` (a mixin: it reads the pool's public attributes ``full_kv_pool``,
    ``swa_kv_pool`` and ``layers_mapping``). FP4 parts have nothing to calibrate."""

    full_kv_pool: Any
    swa_kv_pool: Any
    layers_mapping: dict[int, tuple[int, bool]]

    def observe_amax(self, enabled: bool = True) -> None:
        """Both pools' ``observe_amax``: every write folds its maxima into its pool's ``kv_amax``.
        FP4 parts observe nothing: only ``observe_amax(False)`` is allowed."""
        if not isinstance(enabled, bool):
            raise ValueError(f"enabled must be a bool, got {enabled!r}")
        if isinstance(self.full_kv_pool, MHATokenToKVPoolFP4):
            check_fp4_observe(enabled)
            return
        self.full_kv_pool.observe_amax(enabled)
        self.swa_kv_pool.observe_amax(enabled)

    def reset_amax(self) -> None:
        """Both pools' ``reset_amax`` (nothing to reset in FP4 parts)."""
        if isinstance(self.full_kv_pool, MHATokenToKVPoolFP4):
            return
        self.full_kv_pool.reset_amax()
        self.swa_kv_pool.reset_amax()

    @property
    def kv_amax(self) -> Optional[dict[int, torch.Tensor]]:
        """Each layer's maxima ``[2, heads]`` (K, V) keyed by global layer id (views of the pools'
        ``kv_amax``), or None before observation was first enabled (always, for FP4 parts)."""
        if isinstance(self.full_kv_pool, MHATokenToKVPoolFP4):
            return None
        full, swa = self.full_kv_pool.kv_amax, self.swa_kv_pool.kv_amax
        if full is None or swa is None:
            return None
        return {g: (swa if is_swa else full)[i] for g, (i, is_swa) in self.layers_mapping.items()}

    def calibrated_scales(
        self, margin: float = 1.0, per_head: bool = False, dtype: Optional[torch.dtype] = None
    ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's calibrated ``(k_scale, v_scale)`` from its own pool's
        ``MHATokenToKVPool.calibrated_scales`` (same rule, arguments and errors), keyed by global
        layer id. ``ValueError`` for FP4 or per-token-head parts, which have nothing to calibrate."""
        if isinstance(self.full_kv_pool, MHATokenToKVPoolFP4):
            raise ValueError(FP4_NOT_CALIBRATED)
        full = self.full_kv_pool.calibrated_scales(margin, per_head, dtype)
        swa = self.swa_kv_pool.calibrated_scales(margin, per_head, dtype)
        return {g: (swa if is_swa else full)[i] for g, (i, is_swa) in sorted(self.layers_mapping.items())}
