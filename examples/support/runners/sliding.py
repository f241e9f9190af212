"""What the sliding-window runners (gemma3_runner.py, gpt_oss_runner.py) share on top of the pools and
scheduler of ``gemma3_model``: the keys a sliding layer reads from the SWA part (``window_keys``) and
the summary with the window and each pool's sliding-window memory (``format_swa_summary``).

The window rule is transformers' (``masking_utils.sliding_window_overlay``): the query at position
``q`` sees the keys at positions ``k`` with ``q - window < k <= q``.
"""

from __future__ import annotations

import torch

from kvpool import SWAKVPool
from support.runners.config import KV_LEN_MULTIPLE
from support.runners.results import Report
from support.runners.scheduler import ForwardBatch
from support.runners.summary import format_summary


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
