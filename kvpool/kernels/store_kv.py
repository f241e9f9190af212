"""Launcher of the fused K/V write: picks the tile from a small table, binds arguments, launches.

Nothing here checks arguments or decides whether the kernel may run: ``kvpool.kernels.checks``
checks and classifies a write into its key, and the writer (``kvpool.kernels.write.KVWriter``) asks
the gate once per key and then calls its :class:`PreparedLaunch` (one per cache geometry) for every
fused write, whichever entry point the write came through (a pool's eager write, the custom operator,
the public functions). A pool's warmup calls the same ``PreparedLaunch`` directly with checked keys.
:func:`launch_store_kv` builds one for a chosen variant (tile, division, encoder) on caches the caller
owns, unchecked, for the tests; the benchmarks build ``PreparedLaunch`` objects themselves.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, replace
from typing import Optional

import torch

from kvpool.config import KernelOptions
from kvpool.kernels.checks import Scale, write_key
from kvpool.kernels.formats import OUT_KIND, SCALE_HEAD, SCALE_TENSOR, SCALE_VALUE, store_dtype_for

try:
    import triton

    from kvpool.kernels import store_kv_kernel as _k

    TRITON_AVAILABLE = True
    # TRITON_INTERPRET=1 must be set before the kernel module is imported; the decorator then
    # returns an interpreted function that runs on CPU tensors.
    INTERPRETER = type(_k._store_kv_kernel).__name__ == "InterpretedFunction"
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    _k = None
    TRITON_AVAILABLE = False
    INTERPRETER = False


logger = logging.getLogger("kvpool")

# The kernel's constexpr parameters in signature order (a direct launch passes them positionally).
_CONSTEXPR_NAMES = (
    "H", "D", "HV", "DV", "BLOCK_T", "BLOCK_H", "BLOCK_D", "BLOCK_HV", "BLOCK_DV", "BLOCK_D2", "BLOCK_DV2",
    "K_SCALE_KIND", "V_SCALE_KIND", "OUT_KIND", "SOFT_CAST", "FAST_DIV", "PREFIX", "OBSERVE", "I64", "JOINED",
)  # fmt: skip


# --- tile table --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TileConfig:
    """Work per program: about ``elems`` input elements of one tensor (K or V), ``num_warps`` warps."""

    elems: int
    num_warps: int

    def __post_init__(self) -> None:
        if self.elems < 1 or self.elems & (self.elems - 1):
            raise ValueError(f"elems must be a positive power of two, got {self.elems}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")


#: Tile by write size: "small" for writes of at most SMALL_TOKENS tokens (decode steps, verify
#: writes, short prefills), "large" above. Chosen from a sweep of 12 tiles from 1 to 16k tokens over
#: five geometries (H=8 D=128, H=1 D=128, H=1 D=256, H=3 D=96 and DeepSeek-V3's latent row) on an H200
#: (benchmarks/probe_plans.py --decode; BENCHMARKS.md, "Tiles by write size"): 1024 elements over 4
#: warps was within 3.4% of the best tile at every size from 1 to 1024 tokens (geometric mean over the
#: geometries), 2048 over 4 within 1.4% at 4k and 16k tokens, while no single tile came within 5% at
#: both ends (few elements per thread shorten a decode write's dependent chain; large writes want
#: more bytes per program). The previous table (per head_dim, one tile for all sizes: 1024/2 for
#: head_dim <= 128) was 5-10% off the best at decode sizes.
#: A joined plan's program holds a token's K and V rows: for small writes it takes "small_joined",
#: one 512 + 64 MLA row per program (benchmarks/probe_plans.py --ladder, H200: 1.28 / 1.37 / 1.55 us
#: per write at 1 / 32 / 256 tokens against 1.33 / 1.41 / 1.61 with the small tile's two rows per
#: program). Writes of 257 to SMALL_TOKENS tokens take it too without having been measured there; at
#: >= 8k tokens it measured 66% of a same-bytes copy against 82-90% for the large tile, which no
#: other tile (1024/4, 2048/2, 4096/4, 4096/8) beat by more than the spread between runs.
TILE_TABLE: dict[str, TileConfig] = {
    "small": TileConfig(elems=1024, num_warps=4),
    "large": TileConfig(elems=2048, num_warps=4),
    "small_joined": TileConfig(elems=512, num_warps=4),
}
#: Writes of at most this many tokens take the small tile (between the sizes swept, 1024 and 4096).
SMALL_TOKENS = 2048


@dataclass(frozen=True)
class LaunchPlan:
    """Block shapes of one compiled variant. ``heads``/``head_dim`` (and V's) are the geometry the
    kernel sees: the cache's own, or, for a flat plan, one "head" holding a token's whole row.
    ``block_d2 > 0`` means head_dim is covered by two power-of-two pieces in one program,
    ``block_d + block_d2 >= head_dim`` (so there is one head_dim block per head)."""

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
    #: ``heads`` x ``head_dim`` is a view of each token's row (all its heads end to end) as runs of
    #: ``head_dim`` elements, not the cache's own heads (flat and chunk plans).
    row_view: bool = False
    #: One program writes a token block's K rows and V rows (each one block): its loads are all
    #: issued before its stores, and the grid has one program per token block.
    joined: bool = False

    def __post_init__(self) -> None:
        if self.joined and (self.k_blocks, self.v_blocks) != (1, 1):
            raise ValueError(f"a joined plan needs one block per tensor, got {self.k_blocks} K and {self.v_blocks} V blocks")

    @property
    def k_blocks(self) -> int:
        d_blocks = 1 if self.block_d2 else -(-self.head_dim // self.block_d)
        return -(-self.heads // self.block_h) * d_blocks

    @property
    def v_blocks(self) -> int:
        d_blocks = 1 if self.block_dv2 else -(-self.v_head_dim // self.block_dv)
        return -(-self.v_heads // self.block_hv) * d_blocks

    @property
    def grid_y(self) -> int:
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


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _floor_pow2(n: int) -> int:
    return 1 << max(0, n.bit_length() - 1)


#: A block shape is acceptable when this fraction of its lanes carry an element; below it, a
#: head_dim is cut into two power-of-two pieces, and heads that pad badly take a flat plan.
FLAT_LANE_USE = 0.9


def _pieces(n: int) -> tuple[int, int]:
    """One power-of-two block covering ``n`` elements, or two (the largest power of two below ``n``,
    then the rest rounded up) when that fills more lanes and one block would leave more than
    1 - FLAT_LANE_USE of them idle: 96 = 64 + 32, 288 = 256 + 32, 72 = 64 + 8."""
    one = _pow2(n)
    if n / one >= FLAT_LANE_USE or n < 2:
        return one, 0
    first = one // 2
    second = _pow2(n - first)
    return (first, second) if first + second < one else (one, 0)


@functools.lru_cache(maxsize=256)
def plan_launch(heads: int, head_dim: int, v_heads: int, v_head_dim: int, tile: TileConfig | None = None) -> LaunchPlan:
    """Block shapes for a geometry. A program covers BLOCK_T tokens x BLOCK_H heads x one head_dim
    block (one or two power-of-two pieces) of K, or of V: about ``tile.elems`` elements; BLOCK_T is
    shared by K and V."""
    cfg = tile or TILE_TABLE["large"]
    block_d, block_d2 = _pieces(head_dim)
    block_dv, block_dv2 = _pieces(v_head_dim)
    block_h = min(_pow2(heads), _floor_pow2(max(1, cfg.elems // (block_d + block_d2))))
    block_hv = min(_pow2(v_heads), _floor_pow2(max(1, cfg.elems // (block_dv + block_dv2))))
    row = max(block_h * (block_d + block_d2), block_hv * (block_dv + block_dv2))
    return LaunchPlan(
        heads, head_dim, v_heads, v_head_dim,
        block_t=_floor_pow2(max(1, cfg.elems // row)), block_h=block_h, block_d=block_d,
        block_hv=block_hv, block_dv=block_dv, num_warps=cfg.num_warps, block_d2=block_d2, block_dv2=block_dv2,
    )  # fmt: skip


@functools.lru_cache(maxsize=256)
def plan_joined_launch(
    heads: int, head_dim: int, v_heads: int, v_head_dim: int, tile: TileConfig | None = None
) -> LaunchPlan | None:
    """The per-head plan's blocks with K and V written by the same program, when each tensor's row
    is one block (an MLA row: 512 latent values as K, 64 rotary ones as V). Each token's whole row
    is then written by one program, and no program carries only the short part: the per-head plan
    gives an MLA row's 64 rotary values programs of 4 x 64 elements beside the latent part's 4 x 512.
    None when a row takes more than one block."""
    plan = plan_launch(heads, head_dim, v_heads, v_head_dim, tile)
    if (plan.k_blocks, plan.v_blocks) != (1, 1):
        return None
    return replace(plan, joined=True)


def _row_block(n: int, cap: int) -> int:
    """The largest power of two, at most ``cap``, whose blocks cover ``n`` elements with at least
    FLAT_LANE_USE of their lanes in use (there is always one: 1 divides everything; halving a block
    never lowers the share of lanes in use)."""
    b = min(_pow2(n), cap)
    while n / (-(-n // b) * b) < FLAT_LANE_USE:
        b //= 2
    return b


def _row_pieces(n: int, cap: int) -> tuple[int, int]:
    """How a flat plan covers a row of ``n`` elements: one or two pieces in one program when the row
    fits the tile (288 = 256 + 32), else several blocks of at most ``cap`` (``_row_block``)."""
    if n <= cap:
        first, second = _pieces(n)
        if n / (first + second) >= FLAT_LANE_USE:
            return first, second
    return _row_block(n, cap), 0


@functools.lru_cache(maxsize=256)
def plan_flat_launch(
    heads: int, head_dim: int, v_heads: int, v_head_dim: int, tile: TileConfig | None = None
) -> LaunchPlan | None:
    """A plan that treats each token's H x D row as one run of elements, for geometries whose heads
    the per-head plan pads badly (H=3, D=96: three heads fill 3 of 4 head slots). A row that fits
    the tile is one program's one or two power-of-two pieces (288 = 256 + 32: every lane busy,
    the whole row in one program); a longer row is cut into blocks of at most the tile. Valid only
    when heads are contiguous within a row (head stride = D x element stride) in the inputs and the
    cache, and with per-tensor scales. None when the per-head plan already uses FLAT_LANE_USE of
    its lanes."""
    if plan_launch(heads, head_dim, v_heads, v_head_dim, tile).lane_use >= FLAT_LANE_USE:
        return None
    cfg = tile or TILE_TABLE["large"]
    row, v_row = heads * head_dim, v_heads * v_head_dim
    block_d, block_d2 = _row_pieces(row, cfg.elems)
    block_dv, block_dv2 = _row_pieces(v_row, cfg.elems)
    return LaunchPlan(
        1, row, 1, v_row,
        block_t=_floor_pow2(max(1, cfg.elems // max(block_d + block_d2, block_dv + block_dv2))), block_h=1,
        block_d=block_d, block_hv=1, block_dv=block_dv, num_warps=cfg.num_warps,
        block_d2=block_d2, block_dv2=block_dv2, row_view=True,
    )  # fmt: skip


def _pow2_dividing(n: int) -> int:
    return n & -n


def plan_chunk_launch(
    heads: int, head_dim: int, v_heads: int, v_head_dim: int, chunk: int, elems: int, num_warps: int
) -> LaunchPlan | None:
    """A plan that views each token's row as runs of ``chunk`` elements (``row / chunk`` "heads" of
    head_dim ``chunk``), so that no lane is masked whatever the head geometry: a program covers
    BLOCK_T tokens x a power-of-two number of runs dividing the row (at most ``elems`` elements).
    H=3 D=96 rows of 288 = 9 runs of 32; an MLA row's 512 latent + 64 rotary values = 16 + 2 runs
    of 32. Same validity conditions as a flat plan. None when ``chunk`` does not divide both rows."""
    row, v_row = heads * head_dim, v_heads * v_head_dim
    if chunk < 1 or chunk & (chunk - 1) or row % chunk or v_row % chunk:
        return None
    runs, v_runs = row // chunk, v_row // chunk
    cap = max(1, elems // chunk)
    block_h = min(_pow2_dividing(runs), _floor_pow2(cap))
    block_hv = min(_pow2_dividing(v_runs), _floor_pow2(cap))
    span = max(block_h, block_hv) * chunk
    return LaunchPlan(
        runs, chunk, v_runs, chunk, block_t=_floor_pow2(max(1, elems // span)), block_h=block_h, block_d=chunk,
        block_hv=block_hv, block_dv=chunk, num_warps=num_warps, row_view=True,
    )  # fmt: skip


# --- conversion mode ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def native_cast_ok(device: torch.device) -> bool:
    """Whether Triton's own fp32->fp8/bf16 conversion is exact here: NVIDIA sm_89+ (cvt.rn.satfinite).
    Elsewhere (interpreter, AMD, older NVIDIA) the kernel encodes with integer operations."""
    if INTERPRETER or device.type != "cuda" or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


# --- launch ------------------------------------------------------------------------------------------


class _Variant:
    """The constexpr arguments of one plan, per (K scale kind, V scale kind, prefix, observe), built on
    first use so a call builds no dict: as keywords for Triton's JIT launch and positionally for
    direct launches."""

    def __init__(
        self, plan: LaunchPlan, out_kind: int, soft_cast: bool, fast_div: bool, cache_strides: tuple[int, ...]
    ) -> None:
        self.plan = plan
        self.block_t = plan.block_t
        self.grid_y = plan.grid_y
        # The caches' strides as this plan addresses them (a row view runs its heads end to end).
        self.cache_strides = self.view(cache_strides[:3], cache_strides[3:])
        self._base = dict(
            H=plan.heads, D=plan.head_dim, HV=plan.v_heads, DV=plan.v_head_dim,
            BLOCK_T=plan.block_t, BLOCK_H=plan.block_h, BLOCK_D=plan.block_d,
            BLOCK_HV=plan.block_hv, BLOCK_DV=plan.block_dv, BLOCK_D2=plan.block_d2, BLOCK_DV2=plan.block_dv2,
            OUT_KIND=out_kind, SOFT_CAST=soft_cast, FAST_DIV=fast_div, JOINED=plan.joined,
        )  # fmt: skip
        self._by_flags: dict[tuple, tuple[dict, tuple]] = {}

    def view(self, kst: tuple, vst: tuple) -> tuple:
        """K's and V's strides [tokens, heads, head_dim] as the plan sees them, concatenated."""
        if not self.plan.row_view:
            return (*kst, *vst)
        p = self.plan
        return (kst[0], p.head_dim * kst[2], kst[2], vst[0], p.v_head_dim * vst[2], vst[2])

    def constexprs(self, flags: tuple[int, int, bool, bool, bool]) -> tuple[dict, tuple]:
        """(keywords with num_warps, positional tuple) for (K scale kind, V scale kind, prefix,
        observe, 64-bit offsets)."""
        got = self._by_flags.get(flags)
        if got is None:
            ka, va, prefix, observe, i64 = flags
            kw = {
                **self._base, "K_SCALE_KIND": ka, "V_SCALE_KIND": va, "PREFIX": prefix, "OBSERVE": observe, "I64": i64,
            }  # fmt: skip
            got = self._by_flags[flags] = ({**kw, "num_warps": self.plan.num_warps}, tuple(kw[n] for n in _CONSTEXPR_NAMES))
        return got


class PreparedLaunch:
    """Everything about a launch that is fixed for a cache geometry, computed once; ``__call__``
    binds the per-call tensors and launches. A writer keeps one per cache geometry.

    Two plans: the per-head one, and for geometries it pads badly a flat one (``plan_flat_launch``),
    taken by every call whose inputs keep heads contiguous within a row and whose scales are not
    per head (and that does not observe per-head maxima). A QKV slice and a plain [T, H, D] tensor
    both qualify. Each plan comes in two tiles (``TILE_TABLE``): writes of at most SMALL_TOKENS
    tokens take the small one (``small_per_head``, ``small_flat``), larger writes the large one
    (``per_head``, ``flat``). An explicit ``tile`` is used for both.

    With ``joined``, the per-head plans write K and V in the same program where each is one block
    (``plan_joined_launch``); small writes then take the ``small_joined`` tile.

    ``options`` are the launcher's debug switches (``KernelOptions``; default: from the environment).
    The soft encoder is used wherever the device has no exact native conversion, whatever
    ``options.soft_cast`` says; the fast division only where the native conversion runs."""

    def __init__(
        self,
        heads: int,
        head_dim: int,
        v_heads: int,
        v_head_dim: int,
        cache_dtype: torch.dtype,
        k_cache_strides: tuple[int, int, int],
        v_cache_strides: tuple[int, int, int],
        capacity: int,
        device: torch.device,
        *,
        options: Optional[KernelOptions] = None,
        tile: Optional[TileConfig] = None,
        caches_aligned: bool = False,
        flat: bool = True,
        row_plan: Optional[LaunchPlan] = None,
        joined: bool = False,
    ) -> None:
        opts = KernelOptions.from_env() if options is None else options
        self.soft_cast = opts.soft_cast or not native_cast_ok(device)
        self.fast_div = opts.fast_div and not self.soft_cast and not INTERPRETER
        # Direct launches of compiled variants; turned off for this launcher alone if one fails.
        self.direct = opts.direct_launch and not INTERPRETER
        # A pool's buffers are fresh allocations (16-byte aligned, fixed strides): their alignment
        # then needs no check per call.
        self.caches_aligned = caches_aligned
        self.heads, self.head_dim, self.v_heads, self.v_head_dim = heads, head_dim, v_heads, v_head_dim
        self.capacity = capacity
        self.cache_strides = (*k_cache_strides, *v_cache_strides)
        # 32-bit offsets need every offset of the launch below 2**31: the caches' (fixed here) and
        # the inputs' and loc's (checked per call, from T and the strides).
        cache_span = max(
            _span(capacity, heads, head_dim, k_cache_strides), _span(capacity, v_heads, v_head_dim, v_cache_strides)
        )
        self._i32_ok = cache_span < _I32_LIMIT
        self._head_spans = (heads - 1, head_dim - 1, v_heads - 1, v_head_dim - 1)
        out_kind = OUT_KIND[cache_dtype]
        flat_ok = flat and (
            _heads_contiguous(heads, head_dim, k_cache_strides) and _heads_contiguous(v_heads, v_head_dim, v_cache_strides)
        )

        def variants(tile_: TileConfig, joined_tile: TileConfig) -> tuple[_Variant, Optional[_Variant]]:
            plan = plan_joined_launch(heads, head_dim, v_heads, v_head_dim, joined_tile) if joined else None
            plan = plan or plan_launch(heads, head_dim, v_heads, v_head_dim, tile_)
            flat_plan = (row_plan or plan_flat_launch(heads, head_dim, v_heads, v_head_dim, tile_)) if flat_ok else None
            make = lambda p: _Variant(p, out_kind, self.soft_cast, self.fast_div, self.cache_strides)  # noqa: E731
            return make(plan), None if flat_plan is None else make(flat_plan)

        self.per_head, self.flat = variants(tile or TILE_TABLE["large"], tile or TILE_TABLE["large"])
        self.small_per_head, self.small_flat = (
            (self.per_head, self.flat) if tile is not None else variants(TILE_TABLE["small"], TILE_TABLE["small_joined"])
        )
        self._compiled: dict[tuple, object] = {}

    def variant_for(
        self, kst: tuple, vst: tuple, kinds: tuple[int, int], observe: bool = False, tokens: int = SMALL_TOKENS + 1
    ) -> _Variant:
        """The plan a call with these input strides, scale kinds and token count takes."""
        small = tokens <= SMALL_TOKENS
        flat = self.small_flat if small else self.flat
        if (
            flat is not None
            and kinds[0] != SCALE_HEAD
            and kinds[1] != SCALE_HEAD
            and not observe
            and _heads_contiguous(self.heads, self.head_dim, kst)
            and _heads_contiguous(self.v_heads, self.v_head_dim, vst)
        ):
            return flat
        return self.small_per_head if small else self.per_head

    def __call__(
        self,
        key: tuple,
        k: torch.Tensor,
        v: torch.Tensor,
        k_store: torch.Tensor,
        v_store: torch.Tensor,
        loc: torch.Tensor,
        k_scale: Scale,
        v_scale: Scale,
        commit_lens: Optional[torch.Tensor] = None,
        amax: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    ) -> None:
        """Launch one checked write. ``key`` is its ``WriteKey`` (scale kinds at 3 and 4, commit_lens's dtype at 7);
        ``commit_lens`` goes with a prefix key ([bs, width] ``loc``); ``amax`` = (K maxima [H], V maxima
        [Hv]) float32 tensors to fold the write's |x| into (calibration)."""
        tokens = k.shape[0]
        if tokens == 0:
            return
        kst = k.stride()
        vst = v.stride()
        lst = loc.stride()
        ckey = None
        if self.direct:
            # Everything Triton specializes a compiled variant on that varies between calls: the key
            # (dtypes, scale kinds and dtypes, commit_lens's dtype), observation, the tile (small or
            # large write), exact input and loc strides (covers "== 1" and "divisible by 16"),
            # 16-byte alignment of the row pointers
            # (the caches': fixed for a pool), and the current device, where Triton loaded the
            # compiled module and where it launches. The plan follows from strides, kinds and
            # observation; the offset width from these and T (an entry holds the largest T its
            # variant takes).
            ckey = (
                key, amax is None, tokens <= SMALL_TOKENS, kst, vst, lst, k.data_ptr() & 15, v.data_ptr() & 15,
                _current_device(),
            )  # fmt: skip
            if not self.caches_aligned:
                ckey += (k_store.data_ptr() & 15, v_store.data_ptr() & 15)
            entry = self._compiled.get(ckey)
            if entry is not None and tokens <= entry.max_tokens:
                ka, va = key[3], key[4]
                if key[7] is None:
                    head = (
                        k, v, k_store, v_store, loc,
                        k_scale if ka >= SCALE_TENSOR else loc, v_scale if va >= SCALE_TENSOR else loc,
                        loc, *((loc, loc) if amax is None else amax),
                        k_scale if ka == SCALE_VALUE else 1.0, v_scale if va == SCALE_VALUE else 1.0,
                        k_scale.stride(0) if ka == SCALE_HEAD else 0, v_scale.stride(0) if va == SCALE_HEAD else 0,
                        tokens,
                    )  # fmt: skip
                    args = head + entry.tail
                else:
                    args = self._args(key, k, v, k_store, v_store, loc, k_scale, v_scale, commit_lens, amax,
                                      entry.variant, kst, vst, entry.positional)  # fmt: skip
                try:
                    entry.compiled[(-(-tokens // entry.block_t), entry.grid_y, 1)](*args)
                    return
                except (TypeError, SystemError, IndexError, AttributeError) as exc:
                    # This Triton's compiled-kernel launcher takes its arguments differently (it
                    # failed on them, so nothing was launched): this launcher goes back to the JIT
                    # path for good.
                    self.direct = False
                    self._compiled.clear()
                    logger.warning(
                        "kvpool: direct launch of the compiled kernel failed (%s); this launcher uses Triton's JIT launch", exc
                    )
        ka, va, prefix = key[3], key[4], key[7] is not None
        observe = amax is not None
        max_tokens = self._max_tokens_i32(kst, vst, lst)
        i64 = tokens > max_tokens
        variant = self.variant_for(kst, vst, (ka, va), observe, tokens)
        kwargs, positional = variant.constexprs((ka, va, prefix, observe, i64))
        args = self._args(key, k, v, k_store, v_store, loc, k_scale, v_scale, commit_lens, amax, variant, kst, vst, ())
        # Triton's JIT path: specializes, compiles if needed, launches, and hands back the compiled
        # kernel, which later calls with the same specialization launch directly. Only the 32-bit
        # variant is kept for direct launches (a write too large for it is rare and takes this path).
        compiled = _k._store_kv_kernel[(-(-tokens // variant.block_t), variant.grid_y, 1)](*args, **kwargs)
        if ckey is not None and self.direct and compiled is not None and not i64:
            self._compiled[ckey] = _Compiled(
                compiled, positional, variant.block_t, variant.grid_y, max_tokens, args[15:] + positional, variant
            )

    def _max_tokens_i32(self, kst: tuple, vst: tuple, lst: tuple) -> int:
        """The largest T for which every offset of a launch with these strides fits in 32 bits (0 when
        the caches themselves do not)."""
        if not self._i32_ok:
            return 0
        h, d, hv, dv = self._head_spans
        limit = _I32_LIMIT - 1
        bounds = [
            (limit - h * kst[1] - d * kst[2], kst[0]),
            (limit - hv * vst[1] - dv * vst[2], vst[0]),
            (limit, sum(lst)),  # a [bs, width] loc too: each of its indices is at most T - 1
        ]
        most = _I32_LIMIT
        for room, step in bounds:
            if room < 0:
                return 0
            if step > 0:
                most = min(most, room // step + 1)
        return most

    def _args(self, key, k, v, k_store, v_store, loc, k_scale, v_scale, commit_lens, amax, variant, kst, vst, tail) -> tuple:
        """The kernel's runtime arguments in signature order, then ``tail`` (the constexprs of a
        direct launch). Pointer arguments the variant never dereferences get ``loc`` (the branches
        that read them are compiled out), so every call passes a real pointer and no argument's type
        depends on the variant. Strides are those of the variant's view of the rows."""
        ka, va = key[3], key[4]
        if key[7] is not None:  # a verify write: loc is [bs, width], commit_lens of dtype key[7]
            width, stride_loc, stride_row, commit, stride_commit = (
                loc.shape[1], loc.stride(1), loc.stride(0), commit_lens, commit_lens.stride(0)
            )
        else:
            width, stride_loc, stride_row, commit, stride_commit = 1, loc.stride(0), 0, loc, 0
        k_amax, v_amax = (loc, loc) if amax is None else amax
        return (
            k, v, k_store, v_store, loc,
            k_scale if ka >= SCALE_TENSOR else loc, v_scale if va >= SCALE_TENSOR else loc,
            commit, k_amax, v_amax,
            k_scale if ka == SCALE_VALUE else 1.0, v_scale if va == SCALE_VALUE else 1.0,
            k_scale.stride(0) if ka == SCALE_HEAD else 0, v_scale.stride(0) if va == SCALE_HEAD else 0,
            k.shape[0], self.capacity, width, stride_loc, stride_row, stride_commit,
            *variant.view(kst, vst), *variant.cache_strides, *tail,
        )  # fmt: skip


@dataclass(frozen=True)
class _Compiled:
    """A compiled variant ready for direct launches: the kernel, its constexprs (positional), its
    grid shape, the largest T it takes (32-bit offsets), and, for plain writes, every argument after
    T (fixed by the specialization key: sizes, strides, constexprs)."""

    compiled: object
    positional: tuple
    block_t: int
    grid_y: int
    max_tokens: int
    tail: tuple
    variant: _Variant


_I32_LIMIT = 2**31


def _span(rows: int, heads: int, head_dim: int, strides: tuple) -> int:
    """The largest element offset into a [rows, heads, head_dim] tensor with these strides."""
    return (rows - 1) * strides[0] + (heads - 1) * strides[1] + (head_dim - 1) * strides[2]


def _current_device() -> int:
    """Index of the current CUDA device (the cheap call; CUDA is initialised once anything launched)."""
    return torch._C._cuda_getDevice()


def _heads_contiguous(heads: int, head_dim: int, strides: tuple) -> bool:
    """Whether a [rows, heads, head_dim] tensor with these strides lays each row's heads end to end
    (so its H x D elements are one run with the head_dim stride)."""
    return heads == 1 or strides[1] == head_dim * strides[2]


def storage_view(cache: torch.Tensor) -> torch.Tensor:
    """The cache as the kernel addresses it: FP8 as its uint8 bytes (a view, never a copy)."""
    store = store_dtype_for(cache.dtype)
    return cache if store == cache.dtype else cache.view(store)


@functools.lru_cache(maxsize=64)
def _prepared(heads, head_dim, v_heads, v_head_dim, cache_dtype, kst, vst, capacity, device, options, tile, flat, joined):
    return PreparedLaunch(
        heads, head_dim, v_heads, v_head_dim, cache_dtype, kst, vst, capacity, device,
        options=options, tile=tile, flat=flat, joined=joined,
    )  # fmt: skip


def launch_store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    loc: torch.Tensor,
    k_scale: Scale = None,
    v_scale: Scale = None,
    *,
    options: Optional[KernelOptions] = None,
    tile: Optional[TileConfig] = None,
    flat: bool = True,
    joined: bool = False,
) -> None:
    """Launch the fused write with a chosen variant, for tests and benchmarks. Arguments are not
    checked and the gate is not asked: they must already be valid (caches in their logical dtype).
    ``options`` picks division and encoder (default: from the environment); ``flat=False`` keeps
    the per-head plan even where a flat one exists; ``joined=True`` writes K and V from one program
    where each is one block (``plan_joined_launch``). Scales of a 16-bit or fp32 cache are ignored."""
    if k.shape[0] == 0:
        return
    if OUT_KIND[k_cache.dtype] > OUT_KIND[torch.float8_e5m2]:
        k_scale = v_scale = None
    launch = _prepared(
        k_cache.shape[1], k_cache.shape[2], v_cache.shape[1], v_cache.shape[2], k_cache.dtype,
        tuple(k_cache.stride()), tuple(v_cache.stride()), k_cache.shape[0], k_cache.device,
        options or KernelOptions.from_env(), tile, flat, joined,
    )  # fmt: skip
    launch(write_key(k, v, loc, k_scale, v_scale), k, v, storage_view(k_cache), storage_view(v_cache), loc, k_scale, v_scale)
