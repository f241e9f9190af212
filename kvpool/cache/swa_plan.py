"""What an insertion into the sliding-window tree will do, worked out before anything changes, and
the window rule a match follows (SGLang's ``SWARadixCache``).

A node of an ``SWARadixCache`` holds its tokens' full KV (its device slots) and, unless it is a
tombstone, their sliding-window (SWA) KV (the SWA slots those map to). A match may pass tombstones
but must end where the last ``sliding_window_size`` tokens have SWA KV: ``window_end`` finds that
point on a path described as pieces ``(start, end, live)``.

``plan_insert`` decides, for the nodes a key passes (``Segment``) and the caller's slots ``value``:

- pages the tree holds with SWA KV: the caller's slots are duplicates;
- a tombstone after the caller's own first ``p`` slots, unlocked, whose tokens the caller has SWA
  KV for (at or after ``e``, the caller's ``swa_evicted_seqlen``): the tree takes the caller's slots
  for them and gives back its own (SGLang revives it), split at ``e`` when ``e`` falls inside;
- a locked tombstone stays one (another request reads its full slots);
- new pages: the tree takes them, those before ``e`` as a tombstone (full KV only), the rest live;
  when none are live the tree takes none (a tombstone is never a leaf).

Nothing here changes the tree or calls the allocator; the cache carries the plan out.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvpool.cache.records import SWA


@dataclasses.dataclass
class Segment:
    """An existing node on a key's path: the key's elements ``[start, end)`` run through it (``end``
    before the node's own end where the key leaves it)."""

    start: int
    end: int
    node: Any


@dataclasses.dataclass
class SWAInsertPlan:
    """What ``SWARadixCache`` does to insert a key.

    n : elements the insertion covers (the tree takes nothing after them).
    cached : elements of the key the tree holds already (``prefix_len``).
    revive : ``(node, start, split, end)``: the node's elements from ``start + split`` to ``end``
        take the caller's slots and become live; the first ``split`` stay a tombstone.
    taken : ``(start, end, live)`` ranges of ``value`` the tree takes, with or without SWA KV.
    tree_old : the tree's own slots the revivals give back (full KV only: tombstones).
    pieces : the key's path after the insertion, ``(start, end, live)``, existing nodes past ``n``
        included as they are.
    """

    n: int
    cached: int
    revive: list[tuple[Any, int, int, int]]
    taken: list[tuple[int, int, bool]]
    tree_old: list[torch.Tensor]
    pieces: list[tuple[int, int, bool]]


def window_end(pieces: list[tuple[int, int, bool]], window: int) -> int:
    """Elements of the longest prefix of ``pieces`` a match returns: one ending at the path's end or
    just before a tombstone, with at least ``window`` live elements since the tombstone before it (or
    none before it at all)."""
    run = float("inf")  # no tombstone above: any length will do
    best = 0
    for start, end, live in pieces:
        if live:
            run += end - start
            continue
        if run >= window:
            best = start
        run = 0
    if pieces and run >= window:
        best = pieces[-1][1]
    return best


def plan_insert(segments: list[Segment], n: int, p: int, e: int) -> SWAInsertPlan:
    """The plan for inserting the key's first ``n`` elements (see the module docstring).

    Parameters
    ----------
    segments : the existing nodes along the whole key, in order.
    n : elements to insert (whole pages; a segment end or beyond the existing path).
    p : the caller's first ``p`` slots are the tree's own (``prev_prefix_len``; ``n`` or more: no
        slot is the caller's duplicate, nothing is revived).
    e : the caller's slots before ``e`` have no SWA KV (``swa_evicted_seqlen``, whole pages).
    """
    cached = segments[-1].end if segments else 0
    revive: list[tuple[Any, int, int, int]] = []
    taken: list[tuple[int, int, bool]] = []
    tree_old: list[torch.Tensor] = []
    pieces: list[tuple[int, int, bool]] = []
    for seg in segments:
        s, t, node = seg.start, seg.end, seg.node
        live = SWA in node.records
        if live or s < p or t > n or e >= t or node.device.lock_ref:
            pieces.append((s, t, live))
            continue
        split = max(e - s, 0)
        revive.append((node, s, split, t))
        taken.append((s + split, t, True))
        tree_old.append(node.device.value[split : t - s])
        if split:
            pieces.append((s, s + split, False))
        pieces.append((s + split, t, True))
    if n > cached:
        live_from = max(cached, e)
        if live_from >= n:
            n = cached  # every new page lacks SWA KV: a tombstone leaf, so none goes in
        else:
            if live_from > cached:
                taken.append((cached, live_from, False))
                pieces.append((cached, live_from, False))
            taken.append((live_from, n, True))
            pieces.append((live_from, n, True))
    return SWAInsertPlan(n, min(cached, n), revive, taken, tree_old, pieces)


def not_taken(slots: torch.Tensor, lo: int, hi: int, taken: list[tuple[int, int, bool]]) -> list[torch.Tensor]:
    """The parts of ``slots[lo:hi]`` outside every ``taken`` range (the caller's to give back)."""
    parts = []
    pos = lo
    for start, end, _ in sorted(taken):
        if start > pos:
            parts.append(slots[pos : min(start, hi)])
        pos = max(pos, end)
        if pos >= hi:
            break
    if pos < hi:
        parts.append(slots[pos:hi])
    return [x for x in parts if x.numel()]
