"""What the sliding-window runners (gemma3_runner.py, gpt_oss_runner.py) share on top of the pools and
scheduler of ``gemma3_model``: the architecture's pools and scheduler (``SlidingArchitecture``), the
model runner's frame (``SlidingRunner``: the layers, their K/V in the pool (``PooledKV``), the keys
each kind of layer reads, speculative decoding), the run with its checks and ``--json``
(``run_sliding``), the keys a sliding layer reads from the SWA part (``window_keys``, and in a verify
step ``verify_window_keys``) and the summary with the window and each pool's sliding-window memory
(``format_swa_summary``).

Speculative decoding (``spec_width``): the draft model is the target itself with its K/V in an FP8
``MHATokenToKVPool`` of every layer at the target's full slots (``DRAFT_DTYPE``, scale 1.0; sized
with the SWA pools by ``plan_swa_pools``; its sliding layers read every key and mask the window), so
it agrees with the target except where the rounding turns a near-tie. A verify step attends over the
committed rows of each layer's part (a sliding layer over the translated slots of the window before
the block) plus the block's own K/V as the pool stores it, and commits the accepted prefix with
``set_kv_buffer_prefix_valid``, which writes a sliding layer's rows at the SWA slots the mapping
translates the full slots to; the rejected slots go back to both parts with ``free``.

The window rule is transformers' (``masking_utils.sliding_window_overlay``): the query at position
``q`` sees the keys at positions ``k`` with ``q - window < k <= q``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from kvpool import MHATokenToKVPool, SWAKVPool
from support.runners.attention import attention_mask, read_rows
from support.runners.config import DTYPES, KV_LEN_MULTIPLE, LayerScales, RunConfig, unit_scales
from support.runners.gemma3_model import SWAPools, SWAScheduler, swa_geometry
from support.runners.reference import make_prompts
from support.runners.results import Report
from support.runners.scheduler import ForwardBatch
from support.runners.serving import Architecture, ModelRunner, cpu_threads
from support.runners.serving import run as run_architecture
from support.runners.summary import format_summary
from support.runners.swa_prefix import swa_caching
from support.runners.verify import (
    SpecReport,
    SpeculativeSteps,
    add_spec_runs,
    as_stored,
    grouped_mask,
    spec_check_line,
    spec_run_lines,
    verify_keys,
    verify_mask,
    with_spec_dtypes,
)

FULL, SLIDING = "full_attention", "sliding_attention"


class SlidingArchitecture(Architecture):
    """An ``Architecture`` whose K/V lives in the sliding-window pools (``SWAPools``, made by a
    subclass's ``make_pool``): the ``scheduler`` of every such model (``SWAScheduler``); a subclass
    names the model (``label``, for messages) and builds it, its pools and its runner. With
    ``spec_width``, speculative decoding with verify blocks of that many tokens: the pools carry the
    draft's pool (``SWAPools.draft``) and the scheduler schedules verify steps."""

    label = "this model"
    allocator_name = "SWATokenToKVPoolAllocator"

    def __init__(self, spec_width: Optional[int] = None) -> None:
        if spec_width is not None and (isinstance(spec_width, bool) or not isinstance(spec_width, int) or spec_width < 2):
            raise ValueError(f"spec_width must be an int >= 2 (the last token and a draft) or None, got {spec_width!r}")
        self.spec_width = spec_width

    def scheduler(
        self, pool: Any, max_running: int, max_context_len: int, chunk_size: Optional[int], prefix_cache: bool = False
    ) -> SWAScheduler:
        cls = swa_caching() if prefix_cache else SWAScheduler
        return cls(pool, max_running, max_context_len, chunk_size, verify_width=self.spec_width)

    def draft_pool(self, pools: SWAPools) -> Optional[MHATokenToKVPool]:
        """The draft's pool of ``pools`` when this architecture decodes speculatively, else None."""
        if self.spec_width is None:
            return None
        if pools.draft is None:
            raise ValueError("pools must carry a draft pool for speculative decoding: make them with verify_width")
        return pools.draft


class PooledKV:
    """The K/V side of one attention layer of a sliding-window runner, in ``pool`` under ``layer_id``
    (global ids: an ``SWAKVPool`` routes each layer to its part). A plain step writes its K/V with ``set_kv_buffer`` and reads the keys' rows back; a verify
    step reads the committed rows, appends the block's own K/V as the pool stores it and keeps the
    block for ``commit``, the verify write of the accepted prefix."""

    def __init__(self, layer_id: int, pool: Any) -> None:
        self.layer_id = layer_id  # what set_kv_buffer reads from its ``layer`` argument
        self.pool = pool
        self.pending: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # a verify block's [B * W, H, D] K and V

    def rows(
        self, batch: ForwardBatch, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_scale: torch.Tensor,
        v_scale: torch.Tensor, dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """k, v [T, Hkv, D] of the step; ``slots`` [B, L] of the layer's part; returns the keys' and
        values' rows [B, L', Hkv, D] in ``dtype`` (a verify step's: ``verify_keys``)."""
        k_buf, v_buf = self.pool.get_kv_buffer(self.layer_id)
        if batch.loc_2d is None:
            self.pool.set_kv_buffer(self, batch.loc, k, v, k_scale, v_scale)
            return read_rows(k_buf, slots, k_scale, dtype), read_rows(v_buf, slots, v_scale, dtype)
        b, w = batch.q_index.shape
        kb, vb = k[batch.q_index].reshape(b * w, *k.shape[1:]), v[batch.q_index].reshape(b * w, *v.shape[1:])
        self.pending = (kb, vb)
        rk, rv = as_stored(kb, vb, k_buf.dtype, k_scale, v_scale)
        keys = verify_keys(read_rows(k_buf, slots, k_scale, dtype), rk.view(b, w, *k.shape[1:]))
        values = verify_keys(read_rows(v_buf, slots, v_scale, dtype), rv.view(b, w, *v.shape[1:]))
        return keys, values

    def commit(self, loc_2d: torch.Tensor, commit_lens: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        """Write the pending verify block's accepted prefix (``commit_lens[i]`` tokens of request i)."""
        kb, vb = self.pending  # type: ignore[misc]
        self.pool.set_kv_buffer_prefix_valid(self, loc_2d, commit_lens, kb, vb, k_scale, v_scale)
        self.pending = None


@dataclass
class PlannedLayer:
    """One decoder layer a ``SlidingRunner`` runs: HF's layer, its pooled attention, its kind
    (``FULL`` or ``SLIDING``) and its ``(k_scale, v_scale)``."""

    layer: torch.nn.Module
    attn: Any
    kind: str
    scales: tuple[torch.Tensor, torch.Tensor]


class SlidingRunner(SpeculativeSteps, ModelRunner):
    """The frame of a sliding-window model's runner: ``forward`` over a ``ForwardBatch`` with the K/V
    in ``pools`` (``SWAPools``: the sliding layers' in the SWA part, the full layers' in the full
    part), and with ``draft_pool`` (``SWAPools.draft``) speculative decoding whose draft is this
    runner's class over one plain pool (``plain_pool``: ``pools`` is then the draft's
    ``MHATokenToKVPool`` of every layer, whose sliding layers read every key of the request and mask
    the window).

    A subclass names its pooled attention layer (``attention``: called with HF's attention module,
    the layer id and the pool; its ``kv`` a ``PooledKV``) and writes ``hidden(batch)`` (the residual
    stream after the planned layers, [T, hidden], from ``self.plan`` and ``self.keys(batch)``) and
    ``logits(x)`` (final norm, LM head and what follows).

    Parameters
    ----------
    model : the HF model (its modules are called; its own attention is not).
    pools : the model's ``SWAPools`` (``make_pool``); for ``plain_pool`` the draft's pool.
    plain_pool : every layer's K/V in the one plain pool ``pools`` (the draft model).
    scales : per layer ``(k_scale, v_scale)`` float32 tensors on the pool's device, a list in layer
        order or a mapping from layer id (what the pool's calibration gives); default 1.0. Used by FP8
        pools only.
    draft_pool : the draft's pool for speculative decoding, or None (plain decode steps).
    """

    attention: Callable[[torch.nn.Module, int, Any], Any]

    def __init__(
        self, model: Any, pools: Any, scales: Optional[LayerScales] = None,
        draft_pool: Optional[MHATokenToKVPool] = None, plain_pool: bool = False,
    ) -> None:  # fmt: skip
        g, c = swa_geometry(model), model.config
        if plain_pool:
            kv = pools
            want: tuple = (g.kv_heads, g.head_dim, c.num_hidden_layers)
            got: tuple = (kv.head_num, kv.head_dim, kv.layer_num)
            what = "(KV heads, head_dim, layers)"
        else:
            kv = pools.kv
            want = (g.kv_heads, g.head_dim, g.swa_layers, g.full_layers, g.window)
            got = (kv.head_num, kv.head_dim, kv.swa_attention_layer_ids, kv.full_attention_layer_ids, pools.window)
            what = "(KV heads, head_dim, SWA layers, full layers, window)"
        if want != got:
            raise ValueError(f"pools must have {what} = {want} to hold this model, got {got}")
        self.model, self.pools, self.window, self.plain_pool = model, pools, g.window, plain_pool
        self.groups = c.num_attention_heads // c.num_key_value_heads
        if isinstance(scales, Mapping):
            scales = [scales[i] for i in sorted(scales)]
        self.scales = scales if scales is not None else unit_scales(c.num_hidden_layers, kv.device)
        if len(self.scales) != c.num_hidden_layers:
            raise ValueError(
                f"scales must have one (k_scale, v_scale) per layer ({c.num_hidden_layers}), got {len(self.scales)}"
            )
        self.plan: list[PlannedLayer] = []
        for i, (layer, kind) in enumerate(zip(model.model.layers, c.layer_types)):
            self.plan.append(PlannedLayer(layer, type(self).attention(layer.self_attn, i, kv), kind, self.scales[i]))
        self.kinds = sorted({p.kind for p in self.plan})
        draft = type(self)(model, draft_pool, None, plain_pool=True) if draft_pool is not None else None
        self.start_speculation(draft)

    def keys(self, batch: ForwardBatch) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per kind of layer, the slots its part's rows are read from [B, L] and the mask
        [B, 1, G*Tq, L'] (a verify step's over ``verify_keys``)."""
        verify = batch.loc_2d is not None
        out = {}
        if FULL in self.kinds:
            out[FULL] = (batch.kv_slots, verify_mask(batch, self.groups) if verify else attention_mask(batch, self.groups))
        if SLIDING in self.kinds and self.plain_pool:  # every key in one pool: the window is a mask
            out[SLIDING] = (batch.kv_slots, attention_mask(batch, self.groups, self.window))
        elif SLIDING in self.kinds:
            keys = verify_window_keys if verify else window_keys
            out[SLIDING] = keys(batch, self.pools.kv, self.window, self.groups)
        return out

    def hidden(self, batch: ForwardBatch) -> torch.Tensor:
        raise NotImplementedError

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits of each request's last token: [B, vocab] in the model's dtype."""
        return self.logits(self.hidden(batch)[batch.last_index])

    @torch.no_grad()
    def verify_logits(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits of every token of a verify step's blocks: [T, vocab]."""
        return self.logits(self.hidden(batch))

    def commit(self, batch: ForwardBatch, commit_lens: torch.Tensor) -> None:
        for p in self.plan:
            p.attn.kv.commit(batch.loc_2d, commit_lens, *p.scales)


@dataclass(frozen=True)
class SlidingOptions:
    """What a sliding-window runner adds to a ``RunConfig``: the speculative runs (verify blocks of
    ``spec_width`` tokens, None: none, on a pool of each of ``spec_dtypes``; the command line's
    ``--spec-width`` is 4 unless told otherwise) and the JSON output."""

    spec_width: Optional[int] = None
    spec_dtypes: tuple[str, ...] = ("fp32",)
    json_path: Optional[str] = None

    def __post_init__(self) -> None:
        SlidingArchitecture(self.spec_width)  # checks the width
        for d in self.spec_dtypes:
            if d not in DTYPES:
                raise ValueError(f"spec dtype must be one of {', '.join(DTYPES)}, got {d!r}")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown, the description's paragraphs kept as written."""


def sliding_parser(program: str, doc: str) -> argparse.ArgumentParser:
    """A sliding-window runner's parser: ``doc``'s first two paragraphs as the description, its
    paragraphs on the attention rule and the exit status as the epilog."""
    paragraphs = doc.split("\n\n")
    rule = next(t for t in paragraphs if t.startswith("The attention is"))
    exits = next(t for t in paragraphs if t.startswith("Exit status"))
    return argparse.ArgumentParser(
        prog=program, description="\n\n".join(paragraphs[:2]), epilog=f"{rule}\n\n{exits}",
        formatter_class=HelpFormatter,
    )  # fmt: skip


def add_spec_arguments(p: argparse.ArgumentParser) -> None:
    """The sliding-window runners' options for the speculative runs and the JSON output."""
    p.add_argument("--spec-width", type=int, default=4,
                   help="tokens per verify block (the last token + drafts); 0: no speculative run")  # fmt: skip
    p.add_argument("--spec-dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32"],
                   help="pool dtypes of the speculative runs")  # fmt: skip
    p.add_argument("--json", metavar="PATH",
                   help="write model_type, config, seed, prompts and the fp32 pool's tokens (and the fp32 speculative run's)")


def run_sliding(
    cfg: RunConfig,
    arch: Callable[[Optional[int]], SlidingArchitecture],
    opts: SlidingOptions,
    model_config: Callable[[RunConfig], dict],
    log: Optional[Any] = None,
) -> SpecReport:
    """Build the model of ``arch`` (the architecture's class: called with a verify width, or None),
    serve the prompts on a pool of each dtype, compare each run with HF; then the speculative runs of
    ``opts`` (each compared with the plain run on its dtype and with HF); then write
    ``opts.json_path`` (if given): ``model_type``, the HF ``config`` (``model_config(cfg)``),
    ``seed``, ``prompts``, the fp32 pool's tokens and, with speculative runs, the fp32 speculative
    run's (``spec_tokens``); with a prefix cache, ``prefix_cache``: the fp32 run's prompt tokens,
    those matched, what evictions freed in each part, the nodes they made tombstones and the most
    tombstones at a step's end. ``log`` is told what starts."""
    json_path, plain = opts.json_path, arch(None)
    if cfg.page_size < 2:
        raise ValueError(
            f"page_size must be at least 2 (the SWA allocator extends requests page by page), got {cfg.page_size}"
        )
    if json_path is not None and (cfg.model_dtype != "fp32" or "fp32" not in cfg.pool_dtypes):
        raise ValueError("--json describes an fp32 model's fp32 pool: needs --model-dtype fp32 and fp32 in --dtypes")
    if json_path is not None and opts.spec_width is not None and "fp32" not in opts.spec_dtypes:
        raise ValueError("--json with a speculative run describes its fp32 pool: needs fp32 in --spec-dtypes")
    log = log or (lambda msg: None)
    if opts.spec_width is not None:
        cfg = with_spec_dtypes(cfg, opts.spec_dtypes)
    report = SpecReport.of(run_architecture(cfg, plain, log))
    if opts.spec_width is not None:
        with cpu_threads(cfg):
            add_spec_runs(report, cfg, arch(opts.spec_width), opts.spec_dtypes, log)
    if json_path is not None:
        fp32 = next(r for r in report.runs if r.dtype == "fp32")
        config = model_config(cfg)
        out = {
            "model_type": config["model_type"],
            "config": config,
            "seed": cfg.seed,
            "prompts": [list(p.tokens) for p in make_prompts(cfg)],
            "fp32_tokens": [g.tokens for g in fp32.result.generations],
        }
        for s in report.spec_runs:
            if s.dtype == "fp32":
                out["spec_tokens"] = [g.tokens for g in s.result.generations]
        if cfg.prefix_cache:
            res, m = fp32.result, fp32.result.memory
            out["prefix_cache"] = {
                "prompt_tokens": res.prompt_tokens, "cached_tokens": res.cached_tokens,
                **{k: m[k] for k in ("cache_full_evicted", "cache_swa_evicted", "tombstoned_nodes", "tombstoned_tokens",
                                     "tombstones_peak")},
            }  # fmt: skip
        with open(json_path, "w") as f:
            json.dump(out, f)
        log(f"wrote {json_path}")
    return report


def window_keys(batch: ForwardBatch, kv: SWAKVPool, window: int, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys a sliding layer reads in ``batch``: per request the positions from ``start - window + 1``
    (its first query's oldest visible key) to its last token, as SWA slots ``[B, Lw]`` (0 where
    padded) and the mask ``[B, 1, G*Tq, Lw]`` of the window rule ``q - window < k <= q``.

    Raises RuntimeError if a visible key's full slot has no SWA slot (its SWA part was given back)."""
    dev = batch.kv_slots.device
    starts = torch.tensor(batch.starts, dtype=torch.int64, device=dev)
    ends = starts + torch.tensor(batch.counts, dtype=torch.int64, device=dev)
    first = (starts - window + 1).clamp(min=0)
    span = int((ends - first).max())
    width = -(-span // KV_LEN_MULTIPLE) * KV_LEN_MULTIPLE
    pos = first[:, None] + torch.arange(width, device=dev)[None, :]  # [B, Lw]: each column's position
    inside = pos < ends[:, None]
    full = torch.where(inside, batch.kv_slots.gather(1, pos.clamp(max=batch.kv_slots.shape[1] - 1)), 0)
    swa = kv.translate_loc_from_full_to_swa(full).to(torch.int64)
    q = batch.q_positions[:, :, None]  # [B, Tq, 1]
    sees = (pos[:, None, :] <= q) & (pos[:, None, :] > q - window)  # [B, Tq, Lw]
    sees &= batch.token_mask[:, :, None]
    if bool((sees & (swa[:, None, :] <= 0)).any()):
        raise RuntimeError("a key inside a local layer's window has no SWA slot: its SWA part was given back")
    sees[:, :, 0] |= ~batch.token_mask  # padded query rows see one key (every key masked would be NaN)
    b, tq, lw = sees.shape
    return swa, sees[:, None].expand(b, groups, tq, lw).reshape(b, 1, groups * tq, lw)


def verify_window_keys(
    batch: ForwardBatch, kv: SWAKVPool, window: int, groups: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys a sliding layer reads in a verify step (``batch.loc_2d`` set; its keys are the
    committed ones, ``key_lens = starts``): per request the committed positions from ``start - window
    + 1`` to ``start - 1`` as SWA slots ``[B, Lc]`` (0 where padded), and the mask ``[B, 1, G*W, L]``
    over those and the block's own W keys (``verify_keys``' layout), by the window rule: block query j
    (position ``start + j``) sees committed position k iff ``start + j - window < k``, and block key i
    iff ``i <= j`` and ``j - i < window``.

    Raises RuntimeError if a visible committed key's full slot has no SWA slot."""
    dev = batch.kv_slots.device
    starts = torch.tensor(batch.starts, dtype=torch.int64, device=dev)
    first = (starts - window + 1).clamp(min=0)
    lc = max(int((starts - first).max()), 1)
    pos = first[:, None] + torch.arange(lc, device=dev)[None, :]  # [B, Lc]: each column's position
    inside = pos < starts[:, None]
    full = torch.where(inside, batch.kv_slots.gather(1, pos.clamp(max=batch.kv_slots.shape[1] - 1)), 0)
    swa = kv.translate_loc_from_full_to_swa(full).to(torch.int64)
    b, w = batch.q_index.shape
    q = batch.q_positions[:, :, None]  # [B, W, 1]
    committed = inside[:, None, :] & (pos[:, None, :] > q - window) & batch.token_mask[:, :, None]  # [B, W, Lc]
    if bool((committed & (swa[:, None, :] <= 0)).any()):
        raise RuntimeError("a key inside a local layer's window has no SWA slot: its SWA part was given back")
    j = torch.arange(w, device=dev)
    block = (j[None, :] <= j[:, None]) & (j[:, None] - j[None, :] < window)  # [W (query), W (key)]
    return swa, grouped_mask(torch.cat([committed, block[None].expand(b, w, w)], dim=-1), groups)


#: What a sliding-window runner's speculative run drafts with and commits with (its summary says so).
SPEC_DRAFT = "the target on an fp8_e5m2 MHATokenToKVPool of every layer (scale 1.0) at the target's full slots"
SPEC_COMMITS = "KV commits with set_kv_buffer_prefix_valid into both parts (SWA slots translated), rejected slots freed"


def format_swa_summary(rep: Report, window: int, sliding: str) -> str:
    """The shared summary with a line for the window (``sliding``: what the model calls its sliding
    layers) and, after each pool's lines, its sliding-window memory; then the speculative runs
    (a ``SpecReport``'s), each with its memory, and their check."""
    lines = format_summary(rep).split("\n")
    out: list[str] = []
    runs = iter(rep.runs)
    block = None  # the run whose lines are being copied
    for line in lines:
        if block is not None and not line.startswith("    "):
            out.append(memory_line(block.result.memory))
            block = None
        if line.startswith("  pool "):
            if not any(o.startswith("  window") for o in out):
                out.append(f"  window      {window} tokens ({sliding} layers: q - window < k <= q)")
            block = next(runs)
        out.append(line)
    spec_runs: Sequence[Any] = getattr(rep, "spec_runs", ())
    if spec_runs:
        out.pop()  # the final PASS/FAIL, said again below
        for s in spec_runs:
            out += spec_run_lines(s, SPEC_DRAFT, SPEC_COMMITS)
            if rep.config.prefix_cache:
                out.append(cache_line(s.result))
            out.append(memory_line(s.result.memory))
        check = spec_check_line(rep)  # type: ignore[arg-type]
        if check is not None:
            out.append(check)
        out.append("PASS" if rep.ok else "FAIL")
    return "\n".join(out)


def cache_line(r: Any) -> str:
    """A run's prefix-cache hits (a ``ServeResult``'s), as the shared summary prints them."""
    rate = 100 * r.cached_tokens / r.prompt_tokens if r.prompt_tokens else 0.0
    return (
        f"    cache       {r.cached_tokens} of {r.prompt_tokens} prompt tokens matched in the prefix cache ({rate:.0f}%), "
        "not prefilled"
    )


def memory_line(m: dict[str, int]) -> str:
    if not m:
        return "    memory      -"
    cached = "tombstones_peak" in m
    rule = "a window and a page of its own each, and the tree's SWA KV" if cached else "a live window and a page each"
    line = (
        f"    memory      SWA part at most {m['swa_peak']} slots held at a step's end ({m['swa_peak_running']} running, "
        f"bound {m['swa_peak_bound']}: {rule}), full part at most {m['full_peak']}; "
        f"SWAKVPool of {m['size']} full + {m['size_swa']} SWA slots: {m['pool_bytes'] / 1024:,.0f} KiB, "
        f"{m['all_layers_bytes'] / 1024:,.0f} KiB for every layer at {m['size']} slots"
        + (f"; the draft's pool {m['draft_bytes'] / 1024:,.0f} KiB" if m.get("draft_bytes") else "")
    )
    if cached:
        line += (
            f"\n    evicted     from the tree for room: {m['cache_full_evicted']} full tokens, {m['cache_swa_evicted']} "
            f"SWA tokens, which made {m['tombstoned_nodes']} nodes ({m['tombstoned_tokens']} tokens) tombstones (SWA KV "
            f"freed, full KV kept); at most {m['tombstones_peak']} tombstones ({m['tombstone_tokens_peak']} tokens) "
            "in the tree at a step's end"
        )
    return line
