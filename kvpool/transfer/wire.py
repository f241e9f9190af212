"""What travels between the ranks: the byte layout of one token's rows, and the chunk plan.

A chunk of ``count`` tokens is ``count * token_bytes`` contiguous bytes of the staging buffer, token
after token; one token is, for every layer in order, each of the layer's row parts restricted to the
agreed heads: its K row then its V row, and for a pool whose rows keep scales beside their codes
the K scales and the V scales after them (:mod:`kvpool.transfer.parts`). The staging buffer is addressed as one :class:`RowTable` per half whose buffer ``b`` is a
column band of the token rows (row stride ``token_bytes``), so a chunk of any size is the first
``count`` rows of the same table, and its bytes are one contiguous prefix of the half that NCCL or gloo
sends as one message.

docs/contract.md, "KV transfer between ranks", has the rules users rely on.
"""

from __future__ import annotations

from dataclasses import dataclass

# Read as this module's globals by chunk_plan (so a sweep may set wire.RAMP and wire.RAMP_STEPS).
#: Chunks grow from small ends (the first gather and the last scatter overlap nothing, so small ends
#: shorten the pipeline's fill and drain) to staging-sized middles (few per-message costs); each is
#: at most RAMP times the previous, so the next chunk's gather stays shorter than the current send.
RAMP = 2
#: Steps of RAMP from the smallest chunk to a full one, at each end of a transfer.
RAMP_STEPS = 3


@dataclass(frozen=True)
class TokenLayout:
    """Byte layout of one token on the wire: ``row_bytes[b]`` bytes at ``offsets[b]`` for buffer
    ``b`` in the order K(layer 0), V(layer 0), [K scales, V scales (layer 0),] K(layer 1), ..."""

    row_bytes: tuple[int, ...]
    offsets: tuple[int, ...]
    token_bytes: int

    @classmethod
    def of(cls, layer_num: int, heads: int, head_dim: int, v_head_dim: int, element_size: int) -> "TokenLayout":
        """The layout of ``layer_num`` layers' K and V rows of ``heads`` heads (``head_dim`` and
        ``v_head_dim`` elements of ``element_size`` bytes), packed end to end in the wire order."""
        k, v = heads * head_dim * element_size, heads * v_head_dim * element_size
        return cls.of_rows((k, v) * layer_num)

    @classmethod
    def of_rows(cls, row_bytes: tuple[int, ...]) -> "TokenLayout":
        """The layout of rows of ``row_bytes`` bytes each, packed end to end in that order."""
        offsets, at = [], 0
        for rb in row_bytes:
            offsets.append(at)
            at += rb
        return cls(row_bytes, tuple(offsets), at)


def chunk_plan(tokens: int, capacity: int) -> list[tuple[int, int]]:
    """``(start, count)`` of each chunk: counts sum to ``tokens``, each in ``[1, capacity]``.

    Sizes ramp up from about ``capacity / RAMP**RAMP_STEPS`` by a factor of ``RAMP`` at both ends,
    and are ``capacity`` in the middle. A pure function of its arguments: both ranks compute the
    same plan from the agreed token count and capacity.

    >>> [c for _, c in chunk_plan(100, 32)]
    [4, 8, 16, 22, 22, 16, 8, 4]
    """
    if tokens < 0 or capacity < 1:
        raise ValueError(f"tokens must be >= 0 and capacity >= 1, got tokens={tokens}, capacity={capacity}")
    front: list[int] = []
    back: list[int] = []
    middle: list[int] = []
    left = tokens
    size = max(1, capacity // RAMP**RAMP_STEPS)
    while left:
        if left <= size:  # one middle chunk
            middle = [left]
            break
        if left <= 2 * size:  # two middle chunks of about equal size
            middle = [left - left // 2, left // 2]
            break
        front.append(size)
        back.append(size)
        left -= 2 * size
        size = min(capacity, size * RAMP)
    if len(middle) == 1 and front and RAMP * middle[0] < front[-1]:
        # A sliver between two large chunks: share the three chunks' tokens out evenly instead.
        q, r = divmod(front.pop() + middle[0] + back.pop(), 3)
        front.append(q + (r > 0))
        middle = [q + (r > 1)]
        back.append(q)
    plan, start = [], 0
    for count in front + middle + back[::-1]:
        plan.append((start, count))
        start += count
    return plan
