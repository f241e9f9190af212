"""Every tuning constant of kvpool, with what each one trades.

The K/V write's plan function (``store_kv_plan.py``), the row copy's launcher (``copy_rows.py``), the
host tier's backends (``kvpool.host``), the rank-to-rank transfer (``kvpool.transfer``) and the
prefix cache's key comparison (``kvpool.cache.key``) read them from here. None of them changes a
result, only how the work is cut up and how much memory it holds; docs/contract.md says what is
guaranteed either way. ``benchmarks/bench_write.py --sections plans`` measures the write's plans
against each other and the ceiling (BENCHMARKS.md has the latest figures).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Tile:
    """Work per program (or per task of a looping program): about ``elems`` elements of one tensor,
    over ``num_warps`` warps; ``maxnreg`` caps registers per thread (None: the compiler's choice)."""

    elems: int
    num_warps: int
    maxnreg: Optional[int] = None

    def __post_init__(self) -> None:
        if self.elems < 1 or self.elems & (self.elems - 1):
            raise ValueError(f"elems must be a positive power of two, got {self.elems}")
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"num_warps must be a power of two from 1 to 32, got {self.num_warps}")


#: Kinds of call a cache of compiled kernels for direct launches (and the writer's memo) keeps:
#: enough for every variant a model meets, bounded as Triton's own cache of compiled variants is.
LAUNCH_CACHE_ENTRIES = 1024

# --- the K/V write --------------------------------------------------------------------------------

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

# --- row copies -----------------------------------------------------------------------------------

#: An SM-wide grid's task: enough vector loads per thread in flight without spilling registers.
SM_TILE = Tile(elems=4096, num_warps=4)
#: A grid of a few programs (the host tier's) needs more bytes in flight per SM to cover PCIe latency.
FEW_PROGRAMS_TILE = Tile(elems=16384, num_warps=16)
#: A grid of at most this many programs uses FEW_PROGRAMS_TILE.
FEW_PROGRAMS = 32
#: Programs per SM of an uncapped grid (each loops over its share of the tasks): enough to hide a
#: task's tail, few enough that the loop amortises each program's start.
PROGRAMS_PER_SM = 8
#: Register budget of a one-pass program (aliasing tables: it holds all pairs of its column chunk).
ONE_PASS_TILE = Tile(elems=4096, num_warps=4)
#: Most pairs a copy between aliasing tables does in one launch (each pair at least one 16-byte
#: vector per program within ONE_PASS_TILE); more go through a staging buffer.
ONE_PASS_MAX_PAIRS = 1024
#: Device memory a staged copy allocates per gather/scatter pair of launches: larger groups of
#: buffers per launch pair against a larger allocation.
STAGING_BYTES = 256 * 2**20

# --- state pools (MambaPool) ----------------------------------------------------------------------

#: The speculative commit's task: a linear layer's recurrent state row is hundreds of kilobytes, so
#: wide column chunks on many warps keep more bytes in flight per program than the row copy's tile.
STATE_COMMIT_TILE = Tile(elems=32768, num_warps=16)
#: Programs per SM of a state fork (the one-pass row copy over the pool's own table): fewer, longer
#: programs than a KV move's grid, whose rows are a few hundred bytes.
STATE_FORK_PROGRAMS_PER_SM = 4

# --- the host tier --------------------------------------------------------------------------------

#: Grid of the host tier's kernel backend: at most this many SMs copy, the rest stay with the model.
HOST_KERNEL_PROGRAMS = 8
#: Each of the host tier's direct backend's two device staging buffers per direction: larger ones
#: make longer copy-engine pieces, at the cost of device memory the model does not get.
HOST_STAGING_BYTES = 32 * 2**20

# --- transfers between ranks ----------------------------------------------------------------------

#: Staging per half on CUDA (or the whole pool's rows, if smaller): each NCCL message carries a fixed
#: cost, so large messages keep the link busy; the price is two halves of device memory per endpoint.
TRANSFER_CHUNK_BYTES_CUDA = 512 << 20
#: Staging per half on the CPU: gloo messages this large are past its per-message overhead.
TRANSFER_CHUNK_BYTES_CPU = 4 << 20
#: Chunks grow from small ends (the first gather and the last scatter overlap nothing, so small ends
#: shorten the pipeline's fill and drain) to staging-sized middles (few per-message costs); each is
#: at most RAMP times the previous, so the next chunk's gather stays shorter than the current send.
RAMP = 2
#: Steps of RAMP from the smallest chunk to a full one, at each end of a transfer.
RAMP_STEPS = 3

# --- the prefix cache ---------------------------------------------------------------------------

#: Matches shorter than this many key elements are found by comparing slices; longer ones with
#: numpy, whose fixed cost per call pays off only on long keys.
GALLOP_LIMIT = 32
