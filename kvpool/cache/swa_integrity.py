"""The sliding-window part of ``SWARadixCache.check_integrity``: the tree's nodes against the
allocator's full-to-SWA mapping, each part's accounting, and the running requests' windows.

- A live node's full slots all map to SWA slots (no SWA slot freed while a live node maps to it); a
  tombstone's map to none (its SWA slots were given back).
- Each part: free + the tree's evictable + protected + held by the running requests = its size (at
  page sizes above 1, plus the slots of partly held pages not handed out).
- Each running request has SWA KV for its last ``sliding_window_size`` committed tokens.

The checks read everything to the host; they are for tests and debugging.
"""

from __future__ import annotations

from typing import Any

import torch

from kvpool.cache.integrity import running_committed_len
from kvpool.cache.requests import protected_len

_SHOWN = 5


def _first(slots: torch.Tensor, bad: torch.Tensor) -> str:
    return ", ".join(str(int(s)) for s in slots[bad][:_SHOWN])


def swa_problems(cache: Any, reqs: list) -> list[str]:
    """What is wrong between ``cache``'s tree, its ``SWATokenToKVPoolAllocator`` and ``reqs`` (the
    running requests); nothing without an allocator."""
    alloc = cache.token_to_kv_pool_allocator
    if alloc is None:
        return []
    mapping = alloc.full_to_swa_index_mapping.cpu()
    rows = mapping.numel() - 1
    problems: list[str] = []
    stack = list(cache.root_node.children.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if node.value is None:
            continue
        v = node.value.cpu().to(torch.int64)
        v = v[(v >= 0) & (v < rows)]  # out-of-range slots are the ownership check's report
        m = mapping[v]
        if node.swa_tombstone:
            bad = m != 0
            if bool(bad.any()):
                problems.append(
                    f"tombstone node {node.id} still maps {int(bad.sum())} slots to SWA slots (its SWA KV must be given "
                    f"back; first full slots: {_first(v, bad)})"
                )
        else:
            bad = m <= 0
            if bool(bad.any()):
                problems.append(
                    f"node {node.id} is live but {int(bad.sum())} of its slots map to no SWA slot (their SWA KV was "
                    f"freed; first full slots: {_first(v, bad)})"
                )
    held_full = held_swa = 0
    window = cache.sliding_window_size
    table = cache.req_to_token_pool
    for req in reqs if table is not None else ():
        committed = running_committed_len(req)
        end = int(req.kv_allocated_len) if hasattr(req, "kv_allocated_len") else committed
        row = table.req_to_token[req.req_pool_idx, :end].cpu().to(torch.int64)
        own = row[protected_len(req) :]
        own = own[(own >= 0) & (own < rows)]
        held_full += own.numel()
        held_swa += int((mapping[own] > 0).sum())
        tail = row[max(committed - window, 0) : committed]
        tail = tail[(tail >= 0) & (tail < rows)]
        lacking = mapping[tail] <= 0
        if bool(lacking.any()):
            problems.append(
                f"request in row {req.req_pool_idx} lacks SWA KV for {int(lacking.sum())} of its last "
                f"{min(window, committed)} tokens (sliding_window_size = {window}; first full slots: {_first(tail, lacking)})"
            )
    parts = (
        ("full", alloc.full_attn_allocator, cache.full_evictable_size(), cache.full_protected_size(), held_full),
        ("SWA", alloc.swa_attn_allocator, cache.swa_evictable_size(), cache.swa_protected_size(), held_swa),
    )
    for name, part, evictable, protected, held in parts:
        state = part.backup_state()
        p = part.page_size
        handed = int((state.owners.cpu() > 0).sum())
        unused = int((~state.page_free.cpu()[1:]).sum()) * p - handed
        free = part.available_size()
        total = free + evictable + protected + held + unused
        if total != part.size:
            extra = f" (+ {unused} unused slots of partly held pages)" if p > 1 else ""
            problems.append(
                f"{name} part: free {free} + evictable {evictable} + protected {protected} + held by running requests "
                f"{held}{extra} = {total}, not its size {part.size}"
            )
    return problems
