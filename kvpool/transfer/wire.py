"""What travels between the ranks: the byte layout of one token's rows, and the chunk plan.

A chunk of ``count`` tokens is ``count * token_bytes`` contiguous bytes of the staging buffer, token
after token; one token is its K row then its V row for every layer in order, each restricted to the
agreed heads. The staging buffer is addressed as one :class:`RowTable` per half whose buffer ``b`` is a
column band of the token rows (row stride ``token_bytes``), so a chunk of any size is the first
``count`` rows of the same table, and its bytes are one contiguous prefix of the half that NCCL or gloo
sends as one message.
"""

from __future__ import annotations

from dataclasses import dataclass

# Chunks start small and grow (and shrink again towards the end): the first chunk's gather and the
# last chunk's scatter cannot overlap any transfer, so small end chunks shorten the pipeline's fill
# and drain, while the middle chunks are as large as the staging allows so that the per-message cost
# of the transport is paid few times. Each chunk is at most RAMP times its predecessor, which keeps
# the gather of the next chunk (beside the transport, on a few SMs: about 120 us per 128 MiB on an
# H200) shorter than the send of the current one (about 390 us per 128 MiB over NVLink); a factor of
# 4 left the link waiting for the gather of a 512 MiB chunk after a 128 MiB one. With the default
# 512 MiB staging half the ends are 64, 128 and 256 MiB. benchmarks/bench_transfer.py --sweep on two
# H200s, 512 MiB chunks, 32k-token requests: 90.2-91.2% of the NCCL ceiling with 3 steps of 2,
# 90.3-90.5% with 2 steps of 2, 88.3-89.2% with 1 step of 4. Each chunk also costs the host about
# 0.1 ms to issue (benchmarks/trace_transfer.py), so chunks of a few MiB would leave the link
# waiting for the host.
RAMP = 2
RAMP_STEPS = 3


@dataclass(frozen=True)
class TokenLayout:
    """Byte layout of one token on the wire: ``row_bytes[b]`` bytes at ``offsets[b]`` for buffer
    ``b`` in the order K(layer 0), V(layer 0), K(layer 1), ..."""

    row_bytes: tuple[int, ...]
    offsets: tuple[int, ...]
    token_bytes: int

    @classmethod
    def of(cls, layer_num: int, heads: int, head_dim: int, v_head_dim: int, element_size: int) -> "TokenLayout":
        k, v = heads * head_dim * element_size, heads * v_head_dim * element_size
        row_bytes = (k, v) * layer_num
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
