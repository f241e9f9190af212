"""How the K/V write's work is cut into programs: one function, :func:`plan_write`, from the cache
geometry and the token count to the kernel's block shapes and warps (Liger's ``calculate_settings``
shape); the tiles it uses are named below (``benchmarks/bench_write.py --sections plans`` measures them).

A program of the kernel (``kernel.py``) writes BLOCK_T tokens x BLOCK_H heads x one head_dim
block of K or of V (grid axis 1 walks K's blocks, then V's), or, in a joined plan, one block of K
and one of V for its tokens. A row plan views each token's H x D row as one "head" of H x D elements.
None of this changes what is written (docs/contract.md, "The write").
"""

from __future__ import annotations

import functools
from bisect import bisect_left
from dataclasses import dataclass, replace
from typing import Optional

from kvpool.kernels.launch import Tile, cdiv, floor_pow2, next_pow2

#: Writes of at most this many tokens (decode steps, verify writes, short prefills) take the small
#: tiles, larger writes the large one.
SMALL_TOKENS = 2048
#: Small writes: few elements per thread keep a decode write's dependent chain (slot, scale, row
#: loads, then stores) short.
WRITE_SMALL = Tile(elems=1024, num_warps=4)
#: Large writes: more bytes in flight per program, fewer programs.
WRITE_LARGE = Tile(elems=2048, num_warps=4)
#: Large writes of several heads whose head_dim is cut into two pieces, viewed as one run per row:
#: a longer run per program takes those pieces' narrower accesses out of the write.
WRITE_LARGE_ROW = Tile(elems=4096, num_warps=4)
#: Small writes whose program holds a token's K and V rows (an MLA row's two parts): one row per
#: program, so no program waits on a second row.
WRITE_SMALL_JOINED = Tile(elems=512, num_warps=4)
#: A block shape must keep this share of its lanes busy; below it a head_dim is cut into two
#: power-of-two pieces, and heads that pad badly take a plan over each token's whole row.
LANE_USE = 0.9

#: Upper ends of the token-count bands a plan depends on: band ``b`` holds writes of at most
#: ``TOKEN_BANDS[b]`` tokens (the last band: the rest). ``band(tokens)`` is cheap enough for every call.
TOKEN_BANDS = (SMALL_TOKENS,)
#: The tile of each band, and the tile of each band for joined plans.
TILES = (WRITE_SMALL, WRITE_LARGE)
JOINED_TILES = (WRITE_SMALL_JOINED, WRITE_LARGE)
#: One token count per band (its smallest), for warming every band's variants.
BAND_TOKENS = (1, *(end + 1 for end in TOKEN_BANDS))

#: ``plan_write`` layouts: the policy, and the candidates it chooses among (for sweeps and tests).
AUTO, PER_HEAD, JOINED, ROW, ROW_JOINED, CHUNK = "auto", "per_head", "joined", "row", "row_joined", "chunk"
LAYOUTS = (AUTO, PER_HEAD, JOINED, ROW, ROW_JOINED, CHUNK)


def band(tokens: int) -> int:
    """The token-count band of a write of ``tokens`` tokens."""
    return bisect_left(TOKEN_BANDS, tokens)


@dataclass(frozen=True)
class LaunchPlan:
    """Block shapes of one compiled variant. ``heads``/``head_dim`` (and V's) are the geometry the
    kernel sees: the cache's own, or, for a row plan, one "head" holding a token's whole row (or
    runs of a chunk). ``block_d2 > 0``: head_dim is covered by two power-of-two pieces in one program,
    ``block_d + block_d2 >= head_dim`` (one head_dim block per head)."""

    heads: int
    head_dim: int
    v_heads: int
    v_head_dim: int
    block_t: int
    block_h: int
    block_d: int
    block_hv: int
    block_dv: int
    num_warps: int
    block_d2: int = 0
    block_dv2: int = 0
    #: ``heads`` x ``head_dim`` views each token's row (its heads end to end), not the cache's heads.
    row_view: bool = False
    #: One program writes a token block's K rows and V rows (each one block), loads before stores.
    joined: bool = False

    def __post_init__(self) -> None:
        if self.joined and (self.k_blocks, self.v_blocks) != (1, 1):
            raise ValueError(f"a joined plan needs one block per tensor, got {self.k_blocks} K and {self.v_blocks} V blocks")

    @property
    def k_blocks(self) -> int:
        """K's blocks per token block: head blocks x head_dim blocks (one head_dim block when it is cut
        into two pieces)."""
        d_blocks = 1 if self.block_d2 else cdiv(self.head_dim, self.block_d)
        return cdiv(self.heads, self.block_h) * d_blocks

    @property
    def v_blocks(self) -> int:
        """V's blocks per token block, as :attr:`k_blocks`."""
        d_blocks = 1 if self.block_dv2 else cdiv(self.v_head_dim, self.block_dv)
        return cdiv(self.v_heads, self.block_hv) * d_blocks

    @property
    def grid_y(self) -> int:
        """The grid's second dimension: a program per K block and per V block (one for a joined plan)."""
        return 1 if self.joined else self.k_blocks + self.v_blocks

    @property
    def lane_use(self) -> float:
        """Fraction of a program's lanes that carry an element (the rest are masked off)."""
        work = self.heads * self.head_dim + self.v_heads * self.v_head_dim
        lanes = (
            self.k_blocks * self.block_h * (self.block_d + self.block_d2)
            + self.v_blocks * self.block_hv * (self.block_dv + self.block_dv2)
        )
        return work / lanes


def plan_write(
    heads: int,
    head_dim: int,
    v_heads: int,
    v_head_dim: int,
    tokens: int,
    *,
    row: bool = False,
    joined: bool = False,
    tile: Optional[Tile] = None,
    layout: str = AUTO,
    chunk: int = 32,
) -> LaunchPlan:
    """The plan of a write of ``tokens`` tokens into caches of this geometry.

    Parameters
    ----------
    heads, head_dim, v_heads, v_head_dim : the caches' H, D, Hv, Dv.
    tokens : T; the plan depends on its band (``TOKEN_BANDS``), which picks the tile.
    row : the call may view each token's row as one run: heads contiguous within a row in inputs
        and caches, no per-head scales, no per-head observation.
    joined : K and V are the two parts of one row buffer (an MLA row), written by one program.
    tile : a tile for every band instead of ``TILES`` (tests, sweeps).
    layout : ``"auto"`` (the policy below) or one candidate: ``"per_head"``, ``"joined"`` (K and V
        from one program), ``"row"`` (a row plan), ``"row_joined"`` (a token's whole K row and V row
        from one program, the one-program-per-token shape), ``"chunk"`` (rows as runs of ``chunk``
        elements). A candidate the call cannot take (a row layout without ``row``, a join of
        tensors that take more than one block) gives the policy's plan.

    The policy: a row plan where the per-head plan would leave more than ``1 - LANE_USE`` of its
    lanes idle (H=3, D=96) and the call allows it; for large writes that allow it, a row plan over
    ``WRITE_LARGE_ROW`` where the per-head plan would cut several heads' head_dim into two pieces
    each (H=8, D=96); else the joined plan for joined caches whose rows are one block each; else
    the per-head plan.
    """
    return _plan(heads, head_dim, v_heads, v_head_dim, band(tokens), row, joined, tile, layout, chunk)


@functools.lru_cache(maxsize=1024)
def _plan(h, d, hv, dv, band_, row, joined, tile, layout, chunk) -> LaunchPlan:  # noqa: ANN001
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    t = tile or TILES[band_]
    joined_tile = tile or JOINED_TILES[band_]
    candidate = None
    if layout == PER_HEAD:
        candidate = _per_head(h, d, hv, dv, t)
    elif layout == JOINED:
        candidate = _joined(_per_head(h, d, hv, dv, joined_tile))
    elif layout == ROW and row:
        candidate = _row(h, d, hv, dv, t)
    elif layout == ROW_JOINED and row:
        candidate = _row_joined(h, d, hv, dv, t)
    elif layout == CHUNK and row:
        candidate = _chunk(h, d, hv, dv, chunk, t)
    if candidate is not None:
        return candidate
    per_head = _per_head(h, d, hv, dv, t)
    if row and per_head.lane_use < LANE_USE:
        return _row(h, d, hv, dv, t)
    if row and band_ == len(TOKEN_BANDS) and max(h, hv) > 1 and (per_head.block_d2 or per_head.block_dv2):
        # Two head_dim pieces per head issue narrower accesses than one run over the row's heads.
        return _row(h, d, hv, dv, tile or WRITE_LARGE_ROW)
    if joined:
        return _joined(_per_head(h, d, hv, dv, joined_tile)) or per_head
    return per_head


def _pieces(n: int) -> tuple[int, int]:
    """One power-of-two block covering ``n`` elements, or two (the largest power of two below ``n``,
    then the rest rounded up) when that fills more lanes and one block would leave more than
    ``1 - LANE_USE`` of them idle: 96 = 64 + 32, 288 = 256 + 32, 72 = 64 + 8."""
    one = next_pow2(n)
    if n / one >= LANE_USE or n < 2:
        return one, 0
    first = one // 2
    second = next_pow2(n - first)
    return (first, second) if first + second < one else (one, 0)


def _per_head(h: int, d: int, hv: int, dv: int, t: Tile) -> LaunchPlan:
    """BLOCK_T tokens x BLOCK_H heads x one head_dim block (one or two pieces) of K, or of V, about
    ``t.elems`` elements per program; BLOCK_T is shared by K and V."""
    block_d, block_d2 = _pieces(d)
    block_dv, block_dv2 = _pieces(dv)
    block_h = min(next_pow2(h), floor_pow2(max(1, t.elems // (block_d + block_d2))))
    block_hv = min(next_pow2(hv), floor_pow2(max(1, t.elems // (block_dv + block_dv2))))
    span = max(block_h * (block_d + block_d2), block_hv * (block_dv + block_dv2))
    return LaunchPlan(
        h, d, hv, dv, block_t=floor_pow2(max(1, t.elems // span)), block_h=block_h, block_d=block_d,
        block_hv=block_hv, block_dv=block_dv, num_warps=t.num_warps, block_d2=block_d2, block_dv2=block_dv2,
    )  # fmt: skip


def _joined(plan: LaunchPlan) -> Optional[LaunchPlan]:
    """``plan`` with K and V written by the same program, when each tensor's row is one block."""
    if (plan.k_blocks, plan.v_blocks) != (1, 1):
        return None
    return replace(plan, joined=True)


def _row_block(n: int, cap: int) -> int:
    """The largest power of two, at most ``cap``, whose blocks cover ``n`` elements with at least
    LANE_USE of their lanes in use (there is always one: 1 divides everything)."""
    b = min(next_pow2(n), cap)
    while n / (cdiv(n, b) * b) < LANE_USE:
        b //= 2
    return b


def _row_pieces(n: int, cap: int) -> tuple[int, int]:
    """How a row plan covers a row of ``n`` elements: one or two pieces in one program when the row
    fits the tile (288 = 256 + 32), else several blocks of at most ``cap`` (``_row_block``)."""
    if n <= cap:
        first, second = _pieces(n)
        if n / (first + second) >= LANE_USE:
            return first, second
    return _row_block(n, cap), 0


def _row(h: int, d: int, hv: int, dv: int, t: Tile) -> LaunchPlan:
    """Each token's H x D row as one run: one program's one or two pieces when it fits the tile,
    else blocks of at most the tile."""
    row, v_row = h * d, hv * dv
    block_d, block_d2 = _row_pieces(row, t.elems)
    block_dv, block_dv2 = _row_pieces(v_row, t.elems)
    return LaunchPlan(
        1, row, 1, v_row,
        block_t=floor_pow2(max(1, t.elems // max(block_d + block_d2, block_dv + block_dv2))), block_h=1,
        block_d=block_d, block_hv=1, block_dv=block_dv, num_warps=t.num_warps,
        block_d2=block_d2, block_dv2=block_dv2, row_view=True,
    )  # fmt: skip


def _row_joined(h: int, d: int, hv: int, dv: int, t: Tile) -> LaunchPlan:
    """A token's whole K row and V row (one or two pieces each, whatever the tile) from one program,
    ``t.elems // row`` tokens per program (at least one)."""
    (block_d, block_d2), (block_dv, block_dv2) = _pieces(h * d), _pieces(hv * dv)
    span = max(block_d + block_d2, block_dv + block_dv2)
    return LaunchPlan(
        1, h * d, 1, hv * dv, block_t=floor_pow2(max(1, t.elems // span)), block_h=1, block_d=block_d,
        block_hv=1, block_dv=block_dv, num_warps=t.num_warps, block_d2=block_d2, block_dv2=block_dv2,
        row_view=True, joined=True,
    )  # fmt: skip


def _chunk(h: int, d: int, hv: int, dv: int, chunk: int, t: Tile) -> Optional[LaunchPlan]:
    """Each token's row as runs of ``chunk`` elements (``row / chunk`` "heads" of head_dim ``chunk``):
    no lane masked whatever the head geometry; a program covers BLOCK_T tokens x a power-of-two
    number of runs dividing the row (at most ``t.elems`` elements). None unless ``chunk`` is a power
    of two dividing both rows."""
    row, v_row = h * d, hv * dv
    if chunk < 1 or chunk & (chunk - 1) or row % chunk or v_row % chunk:
        return None
    runs, v_runs = row // chunk, v_row // chunk
    cap = floor_pow2(max(1, t.elems // chunk))
    block_h, block_hv = min(runs & -runs, cap), min(v_runs & -v_runs, cap)
    span = max(block_h, block_hv) * chunk
    return LaunchPlan(
        runs, chunk, v_runs, chunk, block_t=floor_pow2(max(1, t.elems // span)), block_h=block_h, block_d=chunk,
        block_hv=block_hv, block_dv=chunk, num_warps=t.num_warps, row_view=True,
    )  # fmt: skip
