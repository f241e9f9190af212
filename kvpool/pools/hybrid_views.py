"""Read-only views of a ``HybridReqToTokenPool``'s state: the device gathers and the ``MambaPool``
layer views SGLang's attention backends call, kept apart from the table's bookkeeping."""

from __future__ import annotations

import torch

from kvpool.checks import is_int
from kvpool.pools.mamba_pool import MambaPool


class HybridStateViews:
    """Lookups of ``HybridReqToTokenPool`` (a mixin: it reads the table's public attributes
    ``req_index_to_mamba_index_mapping``, ``mamba_ping_pong_track_buffer_size`` and ``mamba_pool``)."""

    req_index_to_mamba_index_mapping: torch.Tensor
    mamba_ping_pong_track_buffer_size: int
    mamba_pool: MambaPool

    def get_mamba_indices(self, req_indices: torch.Tensor) -> torch.Tensor:
        """State slots of rows ``req_indices`` (a gather on the device)."""
        return self.req_index_to_mamba_index_mapping[req_indices]

    def get_mamba_ping_pong_other_idx(self, mamba_next_track_idx: int) -> int:
        """The track slot number that is not ``mamba_next_track_idx`` (itself with one track slot);
        ``ValueError`` unless it is an int in ``0..mamba_ping_pong_track_buffer_size - 1``."""
        size = self.mamba_ping_pong_track_buffer_size
        if not (is_int(mamba_next_track_idx) and 0 <= mamba_next_track_idx < size):
            raise ValueError(f"mamba_next_track_idx must be an int in 0..{size - 1}, got {mamba_next_track_idx!r}")
        return 1 - mamba_next_track_idx if self.mamba_ping_pong_track_buffer_size == 2 else mamba_next_track_idx

    def mamba2_layer_cache(self, layer_id: int) -> MambaPool.State:
        """The states of global linear layer ``layer_id`` (SGLang's ``State`` at that layer)."""
        return self.mamba_pool.mamba2_layer_cache(self.mamba_pool.layer_index(layer_id))

    def get_speculative_mamba2_params_all_layers(self) -> MambaPool.SpeculativeState:
        """The ``mamba_pool``'s states and scratch of every layer (SGLang's name); ``ValueError`` without
        speculative state."""
        return self.mamba_pool.get_speculative_mamba2_params_all_layers()
