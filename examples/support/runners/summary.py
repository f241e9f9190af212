"""The runners' printed summary of a ``Report`` (``format_summary``)."""

from __future__ import annotations

from support.runners.config import LOGIT_RTOL
from support.runners.results import Agreement, Report
from support.runners.tiers import tier_lines

def agreement_line(a: Agreement) -> str:
    if a.identical:
        tokens = f"tokens identical ({a.tokens_total}/{a.tokens_total})"
    else:
        rid, step = a.first_divergence or (-1, -1)
        tokens = (
            f"tokens DIFFER: {a.tokens_agreeing}/{a.tokens_total} agree, {a.requests_identical}/{a.requests} "
            f"requests entirely; first divergence request {rid} step {step}"
        )
        if a.divergence_gap is not None:
            tokens += f" (the reference's logits for the two tokens {100 * a.divergence_gap:.2g}% of max|logit| apart)"
    logits = f"max rel logit error {a.max_rel_logit_err:.1e}, mean KL {a.mean_kl:.1e} over {a.compared_steps} steps"
    return f"{tokens}; {logits}"


#: Printed when a pool stores K/V in another dtype than the model computes in.
ROUNDING_NOTE = (
    "a pool of another dtype than the model's rounds every K/V it stores, so its logits differ from HF's "
    "unrounded cache and greedy tokens may part at near-ties (random weights have many); 'vs rounded' is "
    "the exact check"
)


def format_summary(rep: Report) -> str:
    cfg = rep.config
    lo, hi = cfg.prompt_len
    chunks = f", prefill chunks of {cfg.chunk_size} tokens" if cfg.chunk_size is not None else ""
    tiers = ""
    if cfg.host_tier:
        tiers = "; a HiRadixCache with a host tier" + (f" over {cfg.storage.describe()} storage" if cfg.storage else "")
    lines = [
        f"kvpool {rep.program}: {rep.model_name} ({cfg.shape.describe()}), {cfg.model_dtype} weights, "
        f"seed {cfg.seed}, on {rep.device}",
        f"  requests    {cfg.prompts} prompts of {lo}-{hi} tokens asking {cfg.new_tokens[0]}-{cfg.new_tokens[1]} "
        f"new tokens, at most {cfg.batch} running{chunks}; {rep.allocator_name}(page_size={cfg.page_size}){tiers}",
        f"  reference   transformers {rep.transformers_version}: generate(do_sample=False) of each prompt alone; "
        f"'rounded': through a cache that rounds K/V as the pool does",
    ]
    if any(r.vs_rounded is not None for r in rep.runs):
        lines.append(f"  why         {ROUNDING_NOTE}")
    for r in rep.runs:
        s = r.result
        lines.append(f"  pool {r.label}")
        lines.append(f"    vs HF       {agreement_line(r.vs_hf)}")
        if r.vs_rounded is not None:
            lines.append(f"    vs rounded  {agreement_line(r.vs_rounded)}")
        lines.append(
            f"    served      {s.prefill_steps} prefill + {s.decode_steps} decode steps, peak {s.peak_running} "
            f"running, {s.generated_tokens / s.wall_s:,.0f} tokens/s; KV writes fused {s.fused_calls}, "
            f"reference {s.reference_calls}"
        )
        for reason, count in sorted(s.reasons.items(), key=lambda kv: -kv[1]):
            lines.append(f"                reference because {reason} ({count} calls)")
        if cfg.prefix_cache:
            rate = 100 * s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0
            lines.append(
                f"    cache       {s.cached_tokens} of {s.prompt_tokens} prompt tokens matched in the prefix cache "
                f"({rate:.0f}%), not prefilled"
            )
        if r.tiers is not None:
            lines += tier_lines(s, r.tiers)
        if not s.allocators_ok:
            problem = s.integrity_error or f"{s.leaked_slots} slots still held after every request finished"
            lines.append(f"    allocators  FAILED: {problem}")
    for note in rep.notes:
        lines.append(f"  note        {note}")
    if all(r.result.allocators_ok for r in rep.runs):
        lines.append("  allocators  OK: integrity checks pass; every slot and row given back")
    check = rep.fp32_check
    if check is None:
        lines.append("  fp32 check  not run (needs --model-dtype fp32 and an fp32 pool)")
    else:
        bound = f"fp32 pool's tokens identical to HF and logits within {LOGIT_RTOL:g} (relative)"
        lines.append(f"  fp32 check  {'PASS' if check else 'FAILED'}: {bound}")
    lines.append("PASS" if rep.ok else "FAIL")
    return "\n".join(lines)
