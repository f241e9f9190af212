"""Launcher of the fused K/V write: picks the tile from a small table, binds arguments, launches.

Public entry point: :func:`fused_fp8_set_kv_buffer` (checks, gate, launch). The pool calls the
unchecked :func:`launch_store_kv` after doing its own checks once.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch

from kvpool.kernels.checks import Scale, check_caller_values, check_caller_write
from kvpool.kernels.formats import store_dtype_for
from kvpool.kernels.gate import fused_eligibility

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

# Launch already compiled variants directly (see PreparedLaunch.__call__); KVPOOL_FAST_LAUNCH=0
# turns it off. Disabled for the process if the installed Triton's launcher disagrees.
_fast_launch_enabled = TRITON_AVAILABLE and not INTERPRETER and os.environ.get("KVPOOL_FAST_LAUNCH", "1") != "0"
_CONSTEXPR_NAMES = (
    "H", "D", "HV", "DV", "BLOCK_T", "BLOCK_H", "BLOCK_D", "BLOCK_HV", "BLOCK_DV",
    "K_SCALE_KIND", "V_SCALE_KIND", "OUT_KIND", "SOFT_CAST", "FAST_DIV",
)  # fmt: skip


class FusedPathUnavailable(RuntimeError):
    """Raised when the fused kernel was demanded (``fused="always"``) but the gate refused."""


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


#: Tile per head_dim (rounded up to a power of two), chosen by benchmarks/tune_tiles.py from a sweep on
#: an H200 (2026-11-29, benchmarks/results/h200-2026-11-29-tune2.json): the lowest geometric mean of
#: time / best time over 1, 256 and 16k tokens for the geometries of that head_dim ("score"); ties
#: within 1% go to the tile fastest at 16k tokens. BENCHMARKS.md ("Tile table") has the sweep.
TILE_TABLE: dict[int, TileConfig] = {
    64: TileConfig(elems=1024, num_warps=2),  # score 1.030, at 16k tokens 1.010
    128: TileConfig(elems=1024, num_warps=2),  # score 1.043, at 16k tokens 1.031
    256: TileConfig(elems=2048, num_warps=4),  # score 1.013, at 16k tokens 1.000
}
DEFAULT_TILE = TileConfig(elems=2048, num_warps=4)  # head_dim > 256: not swept; 256's choice


@dataclass(frozen=True)
class LaunchPlan:
    """Block shapes of one compiled variant. ``heads``/``head_dim`` (and V's) are the geometry the
    kernel sees: the cache's own, or, for a flat plan, one "head" holding a token's whole row."""

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

    @property
    def k_blocks(self) -> int:
        return -(-self.heads // self.block_h) * -(-self.head_dim // self.block_d)

    @property
    def v_blocks(self) -> int:
        return -(-self.v_heads // self.block_hv) * -(-self.v_head_dim // self.block_dv)

    @property
    def grid_y(self) -> int:
        return self.k_blocks + self.v_blocks

    @property
    def lane_use(self) -> float:
        """Fraction of a program's lanes that carry an element (the rest are masked off)."""
        work = self.heads * self.head_dim + self.v_heads * self.v_head_dim
        lanes = self.k_blocks * self.block_h * self.block_d + self.v_blocks * self.block_hv * self.block_dv
        return work / lanes


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _tile_for(head_dim: int, v_head_dim: int, tile: TileConfig | None) -> TileConfig:
    return tile or TILE_TABLE.get(max(_pow2(head_dim), _pow2(v_head_dim)), DEFAULT_TILE)


@functools.lru_cache(maxsize=256)
def plan_launch(heads: int, head_dim: int, v_heads: int, v_head_dim: int, tile: TileConfig | None = None) -> LaunchPlan:
    """Block shapes for a geometry. A program covers BLOCK_T tokens x BLOCK_H heads x BLOCK_D of K (or
    of V), about ``tile.elems`` elements; BLOCK_T is shared by K and V."""
    block_d, block_dv = _pow2(head_dim), _pow2(v_head_dim)
    cfg = _tile_for(head_dim, v_head_dim, tile)
    block_h = min(_pow2(heads), max(1, cfg.elems // block_d))
    block_hv = min(_pow2(v_heads), max(1, cfg.elems // block_dv))
    row = max(block_h * block_d, block_hv * block_dv)
    return LaunchPlan(
        heads, head_dim, v_heads, v_head_dim,
        block_t=max(1, cfg.elems // row), block_h=block_h, block_d=block_d,
        block_hv=block_hv, block_dv=block_dv, num_warps=cfg.num_warps,
    )  # fmt: skip


#: A flat plan is used when the per-head plan leaves more than this fraction of lanes idle.
FLAT_LANE_USE = 0.9


def _row_block(n: int, cap: int) -> int:
    """The largest power of two, at most ``cap``, whose blocks cover ``n`` elements with at least
    FLAT_LANE_USE of their lanes in use (there is always one: 1 divides everything; halving a block
    never lowers the share of lanes in use)."""
    b = min(_pow2(n), cap)
    while n / (-(-n // b) * b) < FLAT_LANE_USE:
        b //= 2
    return b


@functools.lru_cache(maxsize=256)
def plan_flat_launch(
    heads: int, head_dim: int, v_heads: int, v_head_dim: int, tile: TileConfig | None = None
) -> LaunchPlan | None:
    """A plan that treats each token's H x D row as one run of elements, cut into power-of-two
    blocks, for geometries the per-head plan pads badly (H=3, D=96 fills 56% of a [4, 128] block;
    its 288-element rows fill 90% of five 64-element blocks). Valid only when heads are contiguous
    within a row (head stride = D x element stride) in the inputs and the cache, and with per-tensor
    scales. None when the per-head plan already uses FLAT_LANE_USE of its lanes."""
    if plan_launch(heads, head_dim, v_heads, v_head_dim, tile).lane_use >= FLAT_LANE_USE:
        return None
    cfg = _tile_for(head_dim, v_head_dim, tile)
    row, v_row = heads * head_dim, v_heads * v_head_dim
    # A block holds at most the tile's elements: a long row (H=48, D=80: 3840) is cut into several.
    block_d, block_dv = _row_block(row, cfg.elems), _row_block(v_row, cfg.elems)
    return LaunchPlan(
        1, row, 1, v_row,
        block_t=max(1, cfg.elems // max(block_d, block_dv)), block_h=1, block_d=block_d,
        block_hv=1, block_dv=block_dv, num_warps=cfg.num_warps,
    )  # fmt: skip


# --- conversion mode ---------------------------------------------------------------------------------

_OUT_KIND = {
    torch.float8_e4m3fn: 0,
    torch.float8_e5m2: 1,
    torch.bfloat16: 2,
    torch.float16: 3,
    torch.float32: 4,
}


@functools.lru_cache(maxsize=None)
def _native_cast_ok(device_type: str, index: int | None) -> bool:
    """Whether Triton's own fp32->fp8/bf16 conversion is exact here: NVIDIA sm_89+ (cvt.rn.satfinite).
    Elsewhere (interpreter, AMD, older NVIDIA) the kernel encodes with integer operations."""
    if INTERPRETER or device_type != "cuda" or torch.version.hip is not None:
        return False
    if os.environ.get("KVPOOL_SOFT_CAST") == "1":
        return False
    return torch.cuda.get_device_capability(index) >= (8, 9)


def soft_cast_for(device: torch.device) -> bool:
    return not _native_cast_ok(device.type, device.index)


def fast_div_default(soft_cast: bool) -> bool:
    """Reciprocal-and-FMA division on compiled GPUs; div.rn under the interpreter (no fused FMA)
    and wherever the soft cast is used. ``KVPOOL_FAST_DIV=0`` forces div.rn (for comparison)."""
    return not soft_cast and not INTERPRETER and os.environ.get("KVPOOL_FAST_DIV", "1") != "0"


# --- launch ------------------------------------------------------------------------------------------


def _scale_args(scale: Scale) -> tuple[int, object, float, int]:
    """(kind, pointer, value, stride) for one tensor's scale; kinds as in store_kv_kernel."""
    if scale is None:
        return 0, None, 1.0, 0
    if type(scale) is float:
        return 1, None, scale, 0
    if scale.numel() == 1:  # type: ignore[union-attr]
        return 2, scale, 1.0, 0
    # per head ([H] or [H, 1]): read with its own stride along heads, so no copy is ever needed
    return 3, scale, 1.0, scale.stride(0)  # type: ignore[union-attr]


class _Variant:
    """The constexpr arguments of one plan, per (K scale kind, V scale kind), built once so a call
    builds no dict: as keywords for Triton's JIT launch and positionally for direct launches."""

    def __init__(self, plan: LaunchPlan, out_kind: int, soft_cast: bool, fast_div: bool) -> None:
        self.plan = plan
        self.block_t = plan.block_t
        self.grid_y = plan.grid_y
        base = dict(
            H=plan.heads, D=plan.head_dim, HV=plan.v_heads, DV=plan.v_head_dim,
            BLOCK_T=plan.block_t, BLOCK_H=plan.block_h, BLOCK_D=plan.block_d,
            BLOCK_HV=plan.block_hv, BLOCK_DV=plan.block_dv,
            OUT_KIND=out_kind, SOFT_CAST=soft_cast, FAST_DIV=fast_div, num_warps=plan.num_warps,
        )  # fmt: skip
        self.constexprs = {
            (a, b): {**base, "K_SCALE_KIND": a, "V_SCALE_KIND": b} for a in range(4) for b in range(4)
        }
        self.constexpr_args = {kinds: tuple(d[n] for n in _CONSTEXPR_NAMES) for kinds, d in self.constexprs.items()}


class PreparedLaunch:
    """Everything about a launch that is fixed for a cache geometry, computed once; ``__call__``
    binds the per-call tensors and launches. The pool keeps one; the public function builds one per
    geometry (cached).

    Two plans: the per-head one, and for geometries it pads badly a flat one (``plan_flat_launch``),
    taken by every call whose inputs keep heads contiguous within a row and whose scales are not
    per head. A QKV slice and a plain [T, H, D] tensor both do."""

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
        soft_cast: bool,
        tile: TileConfig | None = None,
        fast_div: bool | None = None,
        caches_aligned: bool = False,
        flat: bool = True,
    ) -> None:
        # A pool's buffers are fresh allocations (16-byte aligned, fixed strides): their alignment
        # then needs no check per call.
        self.caches_aligned = caches_aligned
        # Scales apply to FP8 caches only; a 16-bit or fp32 cache stores the inputs as they are.
        self.scales_apply = _OUT_KIND[cache_dtype] <= 1
        if fast_div is None:
            fast_div = fast_div_default(soft_cast)
        self.heads, self.head_dim, self.v_heads, self.v_head_dim = heads, head_dim, v_heads, v_head_dim
        self.capacity = capacity
        self.cache_strides = (*k_cache_strides, *v_cache_strides)
        out_kind = _OUT_KIND[cache_dtype]
        self.per_head = _Variant(plan_launch(heads, head_dim, v_heads, v_head_dim, tile), out_kind, soft_cast, fast_div)
        flat_plan = plan_flat_launch(heads, head_dim, v_heads, v_head_dim, tile) if flat else None
        if flat_plan is not None and not (
            _heads_contiguous(heads, head_dim, k_cache_strides) and _heads_contiguous(v_heads, v_head_dim, v_cache_strides)
        ):
            flat_plan = None
        self.flat = None if flat_plan is None else _Variant(flat_plan, out_kind, soft_cast, fast_div)
        self._compiled: dict[tuple, object] = {}

    def variant_for(self, kst: tuple, vst: tuple, kinds: tuple[int, int]) -> _Variant:
        """The plan a call with these input strides and scale kinds takes."""
        if (
            self.flat is not None
            and kinds[0] != 3
            and kinds[1] != 3
            and _heads_contiguous(self.heads, self.head_dim, kst)
            and _heads_contiguous(self.v_heads, self.v_head_dim, vst)
        ):
            return self.flat
        return self.per_head

    def __call__(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_store: torch.Tensor,
        v_store: torch.Tensor,
        loc: torch.Tensor,
        k_scale: Scale,
        v_scale: Scale,
    ) -> None:
        tokens = k.shape[0]
        if tokens == 0:
            return
        if not self.scales_apply:
            k_scale = v_scale = None
        ks_kind, ks_ptr, ks_val, ks_stride = _scale_args(k_scale)
        vs_kind, vs_ptr, vs_val, vs_stride = _scale_args(v_scale)
        kst = k.stride()
        vst = v.stride()
        kinds = (ks_kind, vs_kind)
        variant = self.per_head if self.flat is None else self.variant_for(kst, vst, kinds)
        grid = (-(-tokens // variant.block_t), variant.grid_y, 1)
        # Without a scale tensor the pointer argument is never dereferenced (the branch that reads it
        # is compiled out); loc stands in for it, so every call passes a real pointer and the
        # argument's type never depends on the scale. A flat plan sees one head per row, so the
        # head strides it is passed are never used.
        args = (
            k, v, k_store, v_store, loc,
            loc if ks_ptr is None else ks_ptr, loc if vs_ptr is None else vs_ptr,
            ks_val, vs_val, ks_stride, vs_stride,
            tokens, self.capacity, loc.stride(0),
            kst[0], kst[1], kst[2], vst[0], vst[1], vst[2],
            *self.cache_strides,
        )  # fmt: skip
        if not _fast_launch_enabled:
            _k._store_kv_kernel[grid](*args, **variant.constexprs[kinds])
            return
        # Everything Triton specializes a compiled variant on, for the arguments that vary between
        # calls: dtypes, exact strides (covers "== 1" and "divisible by 16"), 16-byte alignment of
        # the row pointers (caches: fixed per pool), and the scale kinds and dtypes; plus the current
        # device, which is where Triton loaded the compiled module and where it launches. The plan
        # follows from the strides and the scale kinds.
        key = (
            kinds, k.dtype, v.dtype, loc.dtype, loc.stride(0), kst, vst,
            k.data_ptr() & 15, v.data_ptr() & 15,
            None if ks_ptr is None else ks_ptr.dtype, None if vs_ptr is None else vs_ptr.dtype,
            k_store.dtype, torch.cuda.current_device(),
        )  # fmt: skip
        if not self.caches_aligned:
            key += (k_store.data_ptr() & 15, v_store.data_ptr() & 15)
        compiled = self._compiled.get(key)
        if compiled is None:
            # Triton's JIT path: specializes, compiles if needed, launches, and hands back the
            # compiled kernel, which later calls with the same key launch directly.
            compiled = _k._store_kv_kernel[grid](*args, **variant.constexprs[kinds])
            if compiled is not None:
                self._compiled[key] = compiled
            return
        _launch_compiled(compiled, grid, args, variant.constexpr_args[kinds], variant.constexprs[kinds])


def _heads_contiguous(heads: int, head_dim: int, strides: tuple) -> bool:
    """Whether a [rows, heads, head_dim] tensor with these strides lays each row's heads end to end
    (so its H x D elements are one run with the head_dim stride)."""
    return heads == 1 or strides[1] == head_dim * strides[2]


def _launch_compiled(compiled, grid, args: tuple, const_args: tuple, const_kwargs: dict) -> None:
    """Launch an already compiled variant without Triton's per-call specialization and cache-key
    work (most of a launch's host time). If this Triton's launcher takes its arguments differently,
    turn the shortcut off for the process and launch through the JIT path instead."""
    global _fast_launch_enabled
    try:
        compiled[grid](*args, *const_args)
    except (TypeError, SystemError, IndexError, AttributeError) as exc:
        _fast_launch_enabled = False
        logger.warning("kvpool: direct launch of compiled kernels unavailable (%s); using triton's JIT launch", exc)
        _k._store_kv_kernel[grid](*args, **const_kwargs)


@functools.lru_cache(maxsize=64)
def _prepared(heads, head_dim, v_heads, v_head_dim, cache_dtype, kst, vst, capacity, soft_cast, tile, fast_div, flat):
    return PreparedLaunch(
        heads, head_dim, v_heads, v_head_dim, cache_dtype, kst, vst, capacity, soft_cast, tile, fast_div,
        flat=flat,
    )


def launch_store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    loc: torch.Tensor,
    k_scale: Scale,
    v_scale: Scale,
    cache_dtype: torch.dtype,
    *,
    soft_cast: bool | None = None,
    tile: TileConfig | None = None,
    fast_div: bool | None = None,
    flat: bool = True,
) -> None:
    """Launch the fused write. Arguments must already be checked; ``k_store``/``v_store`` are the
    caches in storage dtype (uint8 for FP8) and ``cache_dtype`` the logical element type.
    ``flat=False`` keeps the per-head plan even where a flat one exists (for tests and benchmarks).
    Allocates nothing and never synchronises."""
    if k.shape[0] == 0:
        return
    if soft_cast is None:
        soft_cast = soft_cast_for(k_store.device)
    launch = _prepared(
        k_store.shape[1], k_store.shape[2], v_store.shape[1], v_store.shape[2], cache_dtype,
        tuple(k_store.stride()), tuple(v_store.stride()), k_store.shape[0], soft_cast, tile, fast_div, flat,
    )  # fmt: skip
    launch(k, v, k_store, v_store, loc, k_scale, v_scale)


def storage_view(cache: torch.Tensor) -> torch.Tensor:
    """The cache as the kernel addresses it: FP8 as its uint8 bytes (a view, never a copy)."""
    store = store_dtype_for(cache.dtype)
    return cache if store == cache.dtype else cache.view(store)


def fused_fp8_set_kv_buffer(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_loc: torch.Tensor,
    k_scale: Scale = None,
    v_scale: Scale = None,
    *,
    validate: bool | None = None,
) -> None:
    """Write K/V rows into caller-owned caches with the fused Triton kernel, in one launch.

    ``cache[cache_loc[t]] = q(x[t], scale)`` for K and V, where for FP8 caches q divides by the scale
    in correctly rounded float32, saturates to the format's finite range and rounds to nearest even
    (NaN stays NaN); for 16-bit/fp32 caches q is the plain cast and scales are ignored. Bit-identical
    to :func:`kvpool.reference_set_kv_buffer`. No allocation, no synchronisation, CUDA-graph safe (a
    tensor scale is read on the device when the kernel runs).

    Parameters
    ----------
    k, v : Tensor [T, H, D] and [T, Hv, Dv], bfloat16/float16/float32, any strides (slices of a
        fused QKV projection need no copy). Never modified.
    k_cache, v_cache : Tensor [slots, H, D] and [slots, Hv, Dv], float8_e4m3fn, float8_e5m2,
        bfloat16, float16 or float32, head_dim contiguous.
    cache_loc : Tensor [T], int32 or int64. Negative entries write nothing; entries >= slots are
        never written (``validate=True`` raises IndexError for them instead).
    k_scale, v_scale : None, a positive float, or a float32 tensor with 1 (per tensor) or H (per
        head, shape [H] or [H, 1]) elements.
    validate : also check slot range and scale values, at the cost of one synchronisation.
        None (the default) follows ``KVPOOL_VALIDATE``.

    Raises
    ------
    TypeError, ValueError, IndexError
        Malformed arguments (naming the argument, expected and actual value); nothing is written.
    FusedPathUnavailable
        The kernel cannot take this write (no CUDA device, unsupported scale dtype, ...); the message
        gives the gate's reason. :func:`kvpool.reference_set_kv_buffer` takes every write.

    Examples
    --------
    >>> k_cache = torch.zeros(4096, 8, 128, dtype=torch.float8_e4m3fn, device="cuda")
    >>> v_cache = torch.zeros_like(k_cache)
    >>> qkv = torch.randn(7, 48, 128, dtype=torch.bfloat16, device="cuda")
    >>> k, v = qkv[:, 32:40], qkv[:, 40:48]            # strided views, no copy
    >>> loc = torch.tensor([3, 4, 5, -1, 9, 10, 11], device="cuda")
    >>> fused_fp8_set_kv_buffer(k, v, k_cache, v_cache, loc, k_scale=0.05, v_scale=0.05)
    """
    checked = check_caller_write(k, v, k_cache, v_cache, cache_loc, k_scale, v_scale)
    ok, reason = fused_eligibility(
        device=k_cache.device, cache_dtype=k_cache.dtype, k_dtype=k.dtype, v_dtype=v.dtype,
        head_dim=k_cache.shape[2], v_head_dim=v_cache.shape[2],
        k_cache_stride_d=k_cache.stride(2), v_cache_stride_d=v_cache.stride(2),
        k_scale=checked.k_scale, v_scale=checked.v_scale,
        triton_available=TRITON_AVAILABLE, interpreter=INTERPRETER,
    )  # fmt: skip
    if not ok:
        raise FusedPathUnavailable(f"the fused kernel cannot take this write: {reason}")
    check_caller_values(checked, cache_loc, k_cache.shape[0], validate)
    launch_store_kv(
        k, v, storage_view(k_cache), storage_view(v_cache), cache_loc,
        checked.k_scale, checked.v_scale, k_cache.dtype,
    )  # fmt: skip
