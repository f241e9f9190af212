"""What the sliding-window runners (gemma3_runner.py, gpt_oss_runner.py) share on top of the pools and
scheduler of ``gemma3_model``: the architecture's pools and scheduler (``SlidingArchitecture``), the
run with its checks and ``--json`` (``run_sliding``), the keys a sliding layer reads from the SWA part
(``window_keys``) and the summary with the window and each pool's sliding-window memory
(``format_swa_summary``).

The window rule is transformers' (``masking_utils.sliding_window_overlay``): the query at position
``q`` sees the keys at positions ``k`` with ``q - window < k <= q``.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Optional

import torch

from kvpool import SWAKVPool
from support.runners.config import KV_LEN_MULTIPLE, RunConfig
from support.runners.gemma3_model import SWAScheduler
from support.runners.reference import make_prompts
from support.runners.results import Report
from support.runners.scheduler import ForwardBatch
from support.runners.serving import Architecture
from support.runners.serving import run as run_architecture
from support.runners.summary import format_summary


class SlidingArchitecture(Architecture):
    """An ``Architecture`` whose K/V lives in the sliding-window pools (``SWAPools``, made by a
    subclass's ``make_pool``): the ``scheduler`` of every such model (``SWAScheduler``); a subclass
    names the model (``label``, for messages) and builds it, its pools and its runner."""

    label = "this model"
    allocator_name = "SWATokenToKVPoolAllocator"

    def scheduler(
        self, pool: Any, max_running: int, max_context_len: int, chunk_size: Optional[int], prefix_cache: bool = False
    ) -> SWAScheduler:
        if prefix_cache:
            raise ValueError(f"prefix_cache must be False for {self.label}: the runners have no sliding-window radix cache")
        return SWAScheduler(pool, max_running, max_context_len, chunk_size)


def run_sliding(
    cfg: RunConfig,
    arch: SlidingArchitecture,
    json_path: Optional[str],
    model_config: Callable[[RunConfig], dict],
    log: Optional[Any] = None,
) -> Report:
    """Build ``arch``'s model, serve the prompts on a pool of each dtype, compare each run with HF;
    then write ``json_path`` (if given): ``model_type``, the HF ``config`` (``model_config(cfg)``),
    ``seed``, ``prompts`` and the fp32 pool's tokens. ``log`` is told what starts."""
    if cfg.prefix_cache:
        raise ValueError(f"--prefix-cache is not available for {arch.label}: the runners have no sliding-window radix cache")
    if cfg.page_size < 2:
        raise ValueError(
            f"page_size must be at least 2 (the SWA allocator extends requests page by page), got {cfg.page_size}"
        )
    if json_path is not None and (cfg.model_dtype != "fp32" or "fp32" not in cfg.pool_dtypes):
        raise ValueError("--json describes an fp32 model's fp32 pool: needs --model-dtype fp32 and fp32 in --dtypes")
    report = run_architecture(cfg, arch, log)
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
        with open(json_path, "w") as f:
            json.dump(out, f)
        (log or (lambda msg: None))(f"wrote {json_path}")
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


def format_swa_summary(rep: Report, window: int, sliding: str) -> str:
    """The shared summary with a line for the window (``sliding``: what the model calls its sliding
    layers) and, after each pool's lines, its sliding-window memory."""
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
    return "\n".join(out)


def memory_line(m: dict[str, int]) -> str:
    if not m:
        return "    memory      -"
    return (
        f"    memory      SWA part at most {m['swa_peak']} slots held at a step's end ({m['swa_peak_running']} running, "
        f"bound {m['swa_peak_bound']}: a live window and a page each), full part at most {m['full_peak']}; "
        f"SWAKVPool of {m['size']} full + {m['size_swa']} SWA slots: {m['pool_bytes'] / 1024:,.0f} KiB, "
        f"{m['all_layers_bytes'] / 1024:,.0f} KiB for every layer at {m['size']} slots"
    )
