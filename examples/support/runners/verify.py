"""The verify step of speculative decoding, as the runners with one do it (qwen35_runner.py,
gemma3_runner.py, gpt_oss_runner.py).

A decode step becomes a verify step: each decoding request gets ``min(W, tokens it still makes)``
slots for its last token and its drafts (``VerifyScheduling``); a draft model proposes the drafts one
token at a time, the target runs the whole block ``[last token, drafts]`` in one forward, attending
over the pool's committed rows plus the block's own K/V as the pool would store them
(``as_stored``, ``verify_keys``, ``verify_mask``), and greedy acceptance keeps, per request, the
longest prefix of drafts the target agrees with plus the target's next token
(``SpeculativeSteps``). The accepted prefix is committed with the pool's verify write
(``set_kv_buffer_prefix_valid``, in the model runner's ``commit``) and the rejected slots go back
to the allocator. ``SpecRun`` and ``SpecReport`` hold what a run with speculative decoding adds to
a runner's report; ``spec_run_lines`` and ``spec_check_line`` print it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from kvpool import reference_set_kv_buffer
from support.runners.attention import read_rows
from support.runners.config import DTYPES, KV_LEN_MULTIPLE, RunConfig
from support.runners.reference import hf_reference, make_prompts
from support.runners.results import Agreement, Report, ServeResult, compare
from support.runners.scheduler import ForwardBatch, Request, Scheduler
from support.runners.serving import serve
from support.runners.summary import agreement_line

# --- attention over the committed rows and the block ----------------------------------------------


def as_stored(
    k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype, k_scale: torch.Tensor, v_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``k``/``v`` [N, H, D] as a pool of ``dtype`` stores them and ``read_rows`` reads them back:
    written with kvpool's reference write into a scratch cache, then read."""
    caches = [torch.empty(t.shape, dtype=dtype, device=t.device) for t in (k, v)]
    loc = torch.arange(k.shape[0], device=k.device)
    reference_set_kv_buffer(k, v, caches[0], caches[1], loc, k_scale, v_scale)
    every = loc[None]
    return read_rows(caches[0], every, k_scale, k.dtype)[0], read_rows(caches[1], every, v_scale, v.dtype)[0]


def verify_keys(prefix: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """[B, Lp + W rounded up to KV_LEN_MULTIPLE, H, D]: the committed rows, the block's, zero padding."""
    keys = torch.cat([prefix, block], dim=1)
    pad = -keys.shape[1] % KV_LEN_MULTIPLE
    return F.pad(keys, (0, 0, 0, 0, 0, pad))


def verify_mask(batch: ForwardBatch, groups: int) -> torch.Tensor:
    """[B, 1, G*W, L] for ``verify_keys``: block query j sees the request's committed keys
    (``kv_slots`` columns before its start) and block keys 0..j."""
    b, w = batch.q_index.shape
    lp = batch.kv_slots.shape[1]
    dev = batch.kv_slots.device
    starts = torch.tensor(batch.starts, device=dev)
    committed = (torch.arange(lp, device=dev)[None, :] < starts[:, None])[:, None, :].expand(b, w, lp)
    j = torch.arange(w, device=dev)
    block = (j[None, :] <= j[:, None])[None].expand(b, w, w)
    return grouped_mask(torch.cat([committed, block], dim=-1), groups)


def grouped_mask(m: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, W, L'] (block query, key) -> [B, 1, G*W, L' rounded up to KV_LEN_MULTIPLE], the layout of
    ``verify_keys`` for ``grouped_attention``."""
    m = F.pad(m, (0, -m.shape[-1] % KV_LEN_MULTIPLE))
    b, w, n = m.shape
    return m[:, None].expand(b, groups, w, n).reshape(b, 1, groups * w, n)


# --- the scheduler's verify steps ------------------------------------------------------------------


class VerifyScheduling(Scheduler):
    """A ``Scheduler`` whose decode steps are verify steps once ``verify_width`` is set (None: plain
    decode): each decoding request gets ``min(verify_width, tokens it still makes)`` slots, for its
    last token and its drafts. A subclass sets ``verify_width`` in its constructor."""

    verify_width: Optional[int] = None

    def schedule(self) -> Optional[ForwardBatch]:
        if self.verify_width is None:
            return super().schedule()
        self._admit()
        prefilling = [r for r in self.running if r.prefilling]
        if prefilling:
            return self._prefill(prefilling)
        return self._verify(list(self.running)) if self.running else None

    def _verify(self, reqs: list[Request]) -> ForwardBatch:
        widths = [min(self.verify_width, r.max_new_tokens - len(r.output)) for r in reqs]  # type: ignore[type-var]
        starts = [r.kv_len for r in reqs]
        loc = self.alloc_extend(reqs, widths)
        self.record(reqs, starts, widths, loc)
        ids = [t for r, w in zip(reqs, widths) for t in [r.output[-1]] + [0] * (w - 1)]  # drafts filled in later
        batch = self.metadata(reqs, ids, starts, widths, loc, is_prefill=False, key_lens=starts)
        batch.loc_2d = torch.where(batch.token_mask, loc[batch.q_index], -1)
        return batch

    def advance_verify(self, batch: ForwardBatch, tokens: Sequence[list[int]], logits: Sequence[list[torch.Tensor]]) -> None:
        """Each request's accepted tokens (its committed block prefix is ``len(tokens[i])`` long);
        the rejected slots go back; finished requests are freed."""
        rejected = []
        for i, (r, toks, w) in enumerate(zip(batch.requests, tokens, batch.counts)):
            r.kv_len += len(toks)
            r.output.extend(toks)
            r.logits.extend(logits[i])
            rejected.append(batch.loc_2d[i, len(toks) : w])  # type: ignore[index]
        self.allocator.free(torch.cat(rejected))
        self.finish([r for r in batch.requests if r.done])


# --- the model runner's verify steps ---------------------------------------------------------------


class SpeculativeSteps:
    """What a model runner (a ``ModelRunner``) adds for speculative decoding: its decode steps are
    verify steps with ``draft``'s proposals, accepted greedily. The runner provides
    ``forward(batch)`` (last tokens' logits), ``verify_logits(batch)`` (every block token's logits,
    [T, vocab]) and ``commit(batch, commit_lens)`` (the pool's verify write of each request's
    accepted prefix, and whatever else a verify step keeps); ``draft`` is a runner whose pool holds
    the draft's K/V at the target's slots. ``start_speculation(None)``: plain steps."""

    draft: Optional[Any] = None

    def start_speculation(self, draft: Optional[Any]) -> None:
        self.draft = draft
        self.draft_len: dict[int, int] = {}  # rid -> tokens with draft K/V
        self.drafted_tokens = 0
        self.accepted_tokens = 0
        self.accept_lengths: list[int] = []  # per request and verify step: drafts accepted

    def verify_logits(self, batch: ForwardBatch) -> torch.Tensor:
        raise NotImplementedError

    def commit(self, batch: ForwardBatch, commit_lens: torch.Tensor) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, sched: Any, keep_logits: bool) -> Optional[str]:
        if self.draft is None:
            return super().step(sched, keep_logits)  # type: ignore[misc]
        batch = sched.schedule()
        if batch is None:
            return None
        if batch.is_prefill:
            logits = self.forward(batch)  # type: ignore[attr-defined]
            self.draft.forward(batch)  # the draft's K/V of the prompt, at the target's slots
            for r, s, n in zip(batch.requests, batch.starts, batch.counts):
                self.draft_len[r.rid] = s + n
            sched.advance(batch, logits, keep_logits)
            return "prefill"
        self.fill_drafts(sched, batch)
        logits = self.verify_logits(batch)  # [T, vocab], every block token
        targets = logits.argmax(dim=-1).tolist()
        ids = batch.input_ids.tolist()
        host = logits.float().cpu() if keep_logits else None
        tokens, kept, pos = [], [], 0
        for w in batch.counts:
            a = 0
            while a < w - 1 and ids[pos + a + 1] == targets[pos + a]:
                a += 1
            tokens.append(targets[pos : pos + a + 1])
            kept.append(list(host[pos : pos + a + 1]) if host is not None else [])
            self.drafted_tokens += w - 1
            self.accepted_tokens += a
            self.accept_lengths.append(a)
            pos += w
        self.commit(batch, torch.tensor([len(t) for t in tokens], dtype=torch.int64, device=batch.loc.device))
        for r, t, s, w in zip(batch.requests, tokens, batch.starts, batch.counts):
            if w >= 2:  # the draft wrote the block's tokens up to the second last; those accepted stay
                self.draft_len[r.rid] = s + min(len(t) - 1, w - 2) + 1
        sched.advance_verify(batch, tokens, kept)
        return "verify"

    def fill_drafts(self, sched: Scheduler, batch: ForwardBatch) -> None:
        """Draft each request's ``counts[i] - 1`` tokens into ``batch.input_ids``: the draft catches up
        on the committed tokens it has not seen (the last one at the block's first slot), then runs
        one token at a time at the block's slots."""
        reqs = [(i, r) for i, r in enumerate(batch.requests) if batch.counts[i] >= 2]
        if not reqs:
            return
        dev = sched.device
        first = [sum(batch.counts[:i]) for i in range(len(batch.counts))]
        ids = batch.input_ids.tolist()
        starts = [self.draft_len[r.rid] for _, r in reqs]
        counts = [batch.starts[i] + 1 - s for (i, _), s in zip(reqs, starts)]
        tokens = [t for (_, r), s, n in zip(reqs, starts, counts) for t in (r.prompt + r.output)[s : s + n]]
        rows = torch.tensor([r.row for _, r in reqs], device=dev).repeat_interleave(torch.tensor(counts, device=dev))
        cols = torch.tensor([s + j for s, n in zip(starts, counts) for j in range(n)], device=dev)
        loc = sched.table.req_to_token[rows, cols].to(torch.int64)
        step = sched.metadata([r for _, r in reqs], tokens, starts, counts, loc, False, None)
        for j in range(1, max(batch.counts)):
            for (i, _), d in zip(reqs, self.draft.forward(step).argmax(dim=-1).tolist()):  # type: ignore[union-attr]
                ids[first[i] + j] = d
            reqs = [(i, r) for i, r in reqs if batch.counts[i] > j + 1]  # who still needs a draft
            if not reqs:
                break
            at = torch.tensor([i for i, _ in reqs], device=dev)
            step = sched.metadata(
                [r for _, r in reqs], [ids[first[i] + j] for i, _ in reqs], [batch.starts[i] + j for i, _ in reqs],
                [1] * len(reqs), batch.loc_2d[at, j], False, None,  # type: ignore[index]
            )  # fmt: skip
        batch.input_ids.copy_(torch.tensor(ids, dtype=torch.int64))


# --- the report --------------------------------------------------------------------------------------


@dataclass
class SpecRun:
    dtype: str
    width: int
    result: ServeResult
    vs_plain: Agreement  # against the non-speculative run on a pool of the same dtype
    vs_hf: Agreement


@dataclass
class SpecReport(Report):
    """A runner's report with its speculative runs."""

    spec_runs: list[SpecRun] = field(default_factory=list)

    @classmethod
    def of(cls, base: Report) -> "SpecReport":
        return cls(**{f.name: getattr(base, f.name) for f in dataclasses.fields(Report)})

    @property
    def spec_check(self) -> Optional[bool]:
        """Speculative tokens identical to the non-speculative run's, with an fp32 model (None: not
        run, or a 16-bit model, where the verify forward's wider matmuls may round differently from
        one-token steps on a GPU and part at a near-tie: reported, not checked)."""
        if not self.spec_runs or self.config.model_dtype != "fp32":
            return None
        return all(s.vs_plain.identical for s in self.spec_runs)

    @property
    def ok(self) -> bool:
        return super().ok and self.spec_check is not False and all(s.result.allocators_ok for s in self.spec_runs)


def with_spec_dtypes(cfg: RunConfig, spec_dtypes: Sequence[str]) -> RunConfig:
    """``cfg`` with a plain run on every dtype of ``spec_dtypes`` (each speculative run is compared
    with the plain run on its dtype)."""
    return dataclasses.replace(cfg, pool_dtypes=cfg.pool_dtypes + tuple(d for d in spec_dtypes if d not in cfg.pool_dtypes))


def add_spec_runs(
    report: SpecReport, cfg: RunConfig, arch: Any, spec_dtypes: Sequence[str], log: Callable[[str], None]
) -> None:
    """Serve ``cfg``'s prompts with ``arch`` (an ``Architecture`` whose runner verifies, its verify
    width ``arch.spec_width``) on a pool of each of ``spec_dtypes``, and add each run to ``report``
    compared with the plain run on that dtype (scale 1.0 for FP8) and with HF."""
    model = arch.build_model(cfg)
    prompts = make_prompts(cfg)
    hf = hf_reference(model, prompts)
    for name in spec_dtypes:
        log(f"serving on a {name} pool with speculative decoding (verify blocks of {arch.spec_width})")
        plain = next(r for r in report.runs if r.dtype == name and r.scales in ("-", "1.0"))
        pool = arch.make_pool(cfg, model, DTYPES[name])
        cached = cfg.prefix_cache and arch.speculative_prefix_cache
        res = serve(model, pool, prompts, cfg.batch, arch=arch, chunk_size=cfg.chunk_size, prefix_cache=cached)
        vs_plain = compare(res.generations, plain.result.generations)
        report.spec_runs.append(SpecRun(name, arch.spec_width, res, vs_plain, compare(res.generations, hf)))


def spec_run_lines(s: SpecRun, draft: str, commits: str) -> list[str]:
    """A speculative run's lines of the summary; ``draft`` says what the draft model is, ``commits``
    what a verify step commits with."""
    r = s.result
    hist = {a: r.accept_lengths.count(a) for a in sorted(set(r.accept_lengths))}
    rate = 100 * r.accepted_tokens / r.drafted_tokens if r.drafted_tokens else 0.0
    lines = [
        f"  speculative pool {s.dtype}, verify blocks of {s.width} (last token + {s.width - 1} drafts); draft: {draft}",
        f"    vs plain    {agreement_line(s.vs_plain)}",
        f"    vs HF       {agreement_line(s.vs_hf)}",
        f"    served      {r.prefill_steps} prefill + {r.verify_steps} verify steps, {r.drafted_tokens} drafts, "
        f"{r.accepted_tokens} accepted ({rate:.0f}%), drafts accepted per verify {hist}; {commits}; KV writes "
        f"fused {r.fused_calls}, reference {r.reference_calls}",
    ]
    if not r.allocators_ok:
        problem = r.integrity_error or f"{r.leaked_slots} slots still held after every request finished"
        lines.append(f"    allocators  FAILED: {problem}")
    return lines


def spec_check_line(rep: SpecReport) -> Optional[str]:
    """The summary's verdict on the speculative runs (None: there were none)."""
    check = rep.spec_check
    if check is not None:
        return f"  spec check  {'PASS' if check else 'FAILED'}: speculative tokens identical to the non-speculative run"
    if rep.spec_runs:
        return "  spec check  not run (needs --model-dtype fp32: a 16-bit model's verify forward may round apart)"
    return None
