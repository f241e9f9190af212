"""``SimResult``: what a serve_sim run did, and whether every check passed (``Mismatch``: the first
byte check that failed)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from support.sim.config import SimConfig


@dataclass
class Mismatch:
    rid: int
    position: int
    layer: int
    which: str  # "K", "V" or "latent"


@dataclass
class SimResult:
    config: SimConfig
    pool_size: int
    bytes_per_token: int
    served: int = 0
    steps: int = 0
    forward_steps: int = 0  # steps that ran a batch (the others waited for arrivals or made room)
    retractions: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    peak_slots: int = 0
    peak_running: int = 0
    verified_requests: int = 0
    verified_tokens: int = 0
    mismatched_tokens: int = 0
    first_mismatch: Optional[Mismatch] = None
    integrity_error: Optional[str] = None
    leaked_slots: int = 0
    fused_calls: int = 0
    reference_calls: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    device: str = ""
    # --host-tier
    parked: int = 0  # retractions whose KV went to the host tier
    reloaded: int = 0
    host_full: int = 0  # retractions recomputed because the host tier had no room
    host_bytes: int = 0  # backed up + loaded
    host_seconds: float = 0.0
    reloaded_tokens: int = 0
    reload_mismatches: int = 0
    # --cpu-park (parked/reloaded/reloaded_tokens/reload_mismatches above count these too)
    cpu_bytes: int = 0
    # --spec-decode
    spec_steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    moved_slots: int = 0
    # --calibrate
    calibration: Optional[Any] = None  # a support.sim.calibration.Calibration
    # --model qwen3.5: requests whose linear layers' states were checked, and those that differed
    state_checked: int = 0
    state_mismatches: int = 0
    # --prefix-cache: hits, savings and evictions
    prefix: Optional[Any] = None  # a support.sim.prefix.PrefixStats
    # --model gemma3 / gpt-oss: what the sliding window held and gave back
    swa: Optional[Any] = None  # a support.sim.sliding.WindowStats

    @property
    def ok(self) -> bool:
        return (
            self.mismatched_tokens == 0 and self.integrity_error is None and self.leaked_slots == 0
            and self.reload_mismatches == 0 and self.state_mismatches == 0
            and (self.calibration is None or self.calibration.result.ok)
        )  # fmt: skip
