"""What a run of the model runners gives: each serve's tallies (``ServeResult``), the agreement of
two runs' tokens and logits (``compare``, ``Agreement``), and the report of every pool's run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch.nn.functional as F

from support.runners.config import LOGIT_RTOL, RunConfig
from support.runners.reference import Generation

@dataclass
class ServeResult:
    generations: list[Generation]  # by request id
    prefill_steps: int = 0
    decode_steps: int = 0
    verify_steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    peak_running: int = 0
    wall_s: float = 0.0
    fused_calls: int = 0
    reference_calls: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    integrity_error: Optional[str] = None
    leaked_slots: int = 0
    accept_lengths: list[int] = field(default_factory=list)  # per request and verify step: drafts accepted
    prompt_tokens: int = 0  # with a prefix cache: the admitted prompts' tokens, and those it held
    cached_tokens: int = 0
    memory: dict[str, int] = field(default_factory=dict)  # the scheduler's own figures (its ``memory``), if any
    # With a host tier: cached tokens loaded back from the host, of which entered the host from storage;
    # a hybrid model's state snapshots loaded back with them (None for a model without states);
    # the storage tier's counters (StorageTierStats' fields).
    host_loaded_tokens: int = 0
    storage_loaded_tokens: int = 0
    host_loaded_states: Optional[int] = None
    storage: dict[str, int] = field(default_factory=dict)

    @property
    def generated_tokens(self) -> int:
        return sum(len(g.tokens) for g in self.generations)

    @property
    def allocators_ok(self) -> bool:
        return self.integrity_error is None and self.leaked_slots == 0



@dataclass
class Agreement:
    """How a run's generations compare with a reference's. A token agrees when it and every token
    before it in its request equal the reference's; logits are compared only where the prefix so far
    is identical (after a divergence the two continue from different text)."""

    tokens_agreeing: int
    tokens_total: int
    requests_identical: int
    requests: int
    compared_steps: int
    max_rel_logit_err: float  # max over compared steps of max|a - b| / max|b|, b = the reference's
    mean_kl: float  # mean over compared steps of KL(reference || run) of the next-token distributions
    first_divergence: Optional[tuple[int, int]] = None  # (request id, step)
    # At the first divergence: the reference's logit of its token minus its logit of the run's token,
    # over max|logit| (small: the reference itself nearly chose the run's token).
    divergence_gap: Optional[float] = None

    @property
    def identical(self) -> bool:
        return self.tokens_agreeing == self.tokens_total


def compare(run: Sequence[Generation], ref: Sequence[Generation]) -> Agreement:
    """Tokens and (where both kept them) logits of ``run`` against ``ref``, request by request."""
    agreeing = total = identical = steps = 0
    max_rel, kl_sum = 0.0, 0.0
    first: Optional[tuple[int, int]] = None
    gap: Optional[float] = None
    for rid, (a, b) in enumerate(zip(run, ref, strict=True)):
        n = len(b.tokens)
        same = next((i for i in range(n) if a.tokens[i] != b.tokens[i]), n)
        agreeing += same
        total += n
        identical += same == n
        if same < n and first is None:
            first = (rid, same)
            if b.logits is not None:
                lb = b.logits[same]
                gap = float((lb[b.tokens[same]] - lb[a.tokens[same]]) / lb.abs().max())
        if a.logits is None or b.logits is None:
            continue
        cmp = min(same + 1, n)  # the diverging step's logits still come from the same prefix
        la, lb = a.logits[:cmp].double(), b.logits[:cmp].double()
        err = (la - lb).abs().amax(dim=-1) / lb.abs().amax(dim=-1)
        max_rel = max(max_rel, float(err.max()))
        lpa, lpb = F.log_softmax(la, dim=-1), F.log_softmax(lb, dim=-1)
        kl_sum += float((lpb.exp() * (lpb - lpa)).sum())
        steps += cmp
    mean_kl = kl_sum / steps if steps else float("nan")
    return Agreement(agreeing, total, identical, len(ref), steps, max_rel, mean_kl, first, gap)


@dataclass
class PoolRun:
    dtype: str
    scales: str  # "1.0" or "calibrated" for FP8; "-" for pools that ignore scales
    result: ServeResult
    vs_hf: Agreement  # against HF's plain generate
    vs_rounded: Optional[Agreement]  # against HF through a RoundingCache (None: pool dtype = model dtype)
    tiers: Any = None  # with --host-tier: the support.runners.tiers.TierCheck of this run

    @property
    def label(self) -> str:
        return self.dtype if self.scales == "-" else f"{self.dtype}, scale {self.scales}"


@dataclass
class Report:
    config: RunConfig
    device: str
    transformers_version: str
    runs: list[PoolRun]
    program: str
    model_name: str
    notes: list[str] = field(default_factory=list)
    allocator_name: str = "PagedTokenToKVPoolAllocator"

    @property
    def fp32_check(self) -> Optional[bool]:
        """fp32 model and fp32 pool: identical tokens and logits within LOGIT_RTOL (None: not run)."""
        runs = [r for r in self.runs if r.dtype == "fp32"]
        if self.config.model_dtype != "fp32" or not runs:
            return None
        return all(r.vs_hf.identical and r.vs_hf.max_rel_logit_err <= LOGIT_RTOL for r in runs)

    @property
    def ok(self) -> bool:
        return self.fp32_check is not False and all(
            r.result.allocators_ok and (r.tiers is None or r.tiers.ok) for r in self.runs
        )
