"""The K/V write: one :class:`KVWriter` per cache geometry, whose one method every entry calls.

The pools' ``set_kv_buffer``, ``set_kv_buffer_prefix_valid``, ``set_mla_kv_buffer`` and warmup, the
custom operators and the public functions (``op.py``) all end in :meth:`KVWriter.write`. It
classifies a call once into one key (dtypes, scale kinds, observation, token band, strides,
alignment, device: what the kernel is specialised on), which finds, in one lookup, the gate's
verdict, the launch plan with the fixed part of the kernel's arguments, and the compiled kernel;
then it launches the kernel (``kernel.py``, planned by ``plan.py``) or runs the
reference (``naive.py``), or raises. Rules: docs/contract.md ("The write", "Fused path,
reference path and the gate").
"""

from __future__ import annotations

import contextlib
import functools
import logging
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

import torch

from kvpool.checks import check_index, resolve_device
from kvpool.config import KernelOptions
from kvpool.errors import FusedPathUnavailable
from kvpool.kernels.formats import LOC_DTYPES, OUT_KIND, SCALE_HEAD, SCALE_NONE, SCALE_TENSOR, SCALE_VALUE, is_fp8
from kvpool.kernels.gate import cache_verdict, input_verdict
from kvpool.kernels.launch import (
    INTERPRETER,
    LAUNCH_CACHE_ENTRIES,
    LAUNCH_ERRORS,
    TRITON_AVAILABLE,
    DirectLaunches,
    LaunchRecord,
    Tile,
    cdiv,
    current_cuda_device,
    current_raw_stream,
    kernel_params,
)
from kvpool.kernels.store_kv.checks import PLAIN_WRITE, check_prefix_values, check_values, check_write
from kvpool.kernels.store_kv.layout import (
    I32_LIMIT,
    MAPPED_KEY,
    maps_in_kernel,
    native_cast_ok,
    parts_of_one_row,
    translate_slots,
)
from kvpool.kernels.store_kv.naive import write_reference
from kvpool.kernels.store_kv.plan import AUTO, BAND_TOKENS, TOKEN_BANDS, LaunchPlan, plan_write
from kvpool.write_types import F32_MAX, F32_MIN_NORMAL, ArgNames, Geometry, Scale

kernel = None
if TRITON_AVAILABLE:
    from kvpool.kernels.store_kv import kernel

logger = logging.getLogger("kvpool")

_F32 = torch.float32
_Tensor = torch.Tensor

#: The kernel's parameters in signature order, in three parts: those that change from call to call,
#: those fixed for a kind of call (the plan's view of the strides), and the compile-time constants.
#: A direct launch passes all of them positionally; it is used only where the kernel has exactly these.
PER_CALL = (
    "k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr", "loc_ptr", "k_scale_ptr", "v_scale_ptr", "commit_ptr",
    "k_amax_ptr", "v_amax_ptr", "k_scale_value", "v_scale_value", "k_scale_stride", "v_scale_stride", "T", "width",
    "stride_loc_row", "stride_commit", "map_ptr", "map_rows",
)  # fmt: skip
FIXED = (
    "capacity", "stride_loc", "stride_kt", "stride_kh", "stride_kd", "stride_vt", "stride_vh", "stride_vd",
    "stride_kct", "stride_kch", "stride_kcd", "stride_vct", "stride_vch", "stride_vcd",
)  # fmt: skip
CONSTEXPRS = (
    "H", "D", "HV", "DV", "BLOCK_T", "BLOCK_H", "BLOCK_D", "BLOCK_HV", "BLOCK_DV", "BLOCK_D2", "BLOCK_DV2",
    "K_SCALE_KIND", "V_SCALE_KIND", "OUT_KIND", "SOFT_CAST", "FAST_DIV", "PREFIX", "OBSERVE", "I64", "JOINED",
    "MAPPED",
)  # fmt: skip
PARAMS = PER_CALL + FIXED + CONSTEXPRS
_SIGNATURE_OK = kernel is not None and kernel_params(kernel.store_kv) == PARAMS


@dataclass
class PathStats:
    """How many eager writes took each path, and why the fallbacks happened.

    Calls made from ``torch.compile``d code are not counted (counting would put Python side effects
    into the compiled graph).
    """

    fused_calls: int = 0
    reference_calls: int = 0
    reasons: dict[str, int] = field(default_factory=dict)  # reason -> reference calls


class _Entry:
    """What one kind of call needs: the gate's refusal (None: fused), and for fused calls the plan,
    the scale kinds (``k_kind``, ``v_kind``: ``SCALE_NONE`` ... ``SCALE_HEAD``), the arguments after
    the per-call ones (``fixed_args``, for the JIT launch; ``direct_args``, the same with the
    constants appended, for a direct launch), the constants, and the largest T with 32-bit offsets."""

    __slots__ = (
        "refused", "plan", "k_kind", "v_kind", "block_t", "grid_y", "max_tokens", "fixed_args", "direct_args",
        "constexprs",
    )  # fmt: skip

    def __init__(self, refused: Optional[str]) -> None:
        self.refused = refused


class KVWriter:
    """Writes K/V rows into caches of one geometry: checks, gate verdict memo, statistics, launch.

    Parameters
    ----------
    geometry : the caches' element type, heads, head dims and device.
    k_strides, v_strides : the caches' strides (one layer's buffers; every layer of a pool shares them).
    capacity : rows per cache.
    mode : ``"auto"`` (fused when eligible, else reference), ``"always"`` (raise
        ``FusedPathUnavailable`` instead of falling back; also runs the kernel on CPU tensors under
        ``TRITON_INTERPRET=1``), ``"never"`` (reference only).
    options : the launcher's debug switches (default: from the environment). The soft encoder is used
        wherever the device has no exact native conversion, the fast division only where it runs.
    caches_aligned : the caches are fresh allocations (a pool's), so their 16-byte alignment needs
        no check per call.
    validate : :meth:`write` also checks slot range and scale values (one synchronisation).
    joined : K and V are the two parts of one row buffer (``parts_of_one_row``): one program writes
        both parts of its tokens' rows where each is one block.
    row_plans : calls that allow it may view each token's row as one run (``plan_write``'s ``row``).
    tile, layout, chunk : ``plan_write``'s overrides, for tests and plan sweeps.
    """

    #: One token count per token band of the plan (the band's smallest): a warmup that writes each
    #: count once compiles every variant a first real write of these caches would meet.
    band_tokens = BAND_TOKENS

    def __init__(
        self,
        geometry: Geometry,
        k_strides: Sequence[int],
        v_strides: Sequence[int],
        capacity: int,
        mode: str,
        *,
        options: Optional[KernelOptions] = None,
        caches_aligned: bool = False,
        validate: bool = False,
        joined: bool = False,
        row_plans: bool = True,
        tile: Optional[Tile] = None,
        layout: str = AUTO,
        chunk: int = 32,
    ) -> None:
        # A bare "cuda" names the current device, so that the tensors' cuda:N compare equal to it.
        g = self.geometry = geometry._replace(device=resolve_device(geometry.device))
        self.mode = mode
        self.capacity = capacity
        self.validate = validate
        self.caches_aligned = caches_aligned
        self.scales_apply = is_fp8(g.cache_dtype)
        self.stats = PathStats()
        self.cache_ok, self.cache_reason = cache_verdict(
            g.device, g.cache_dtype, g.head_dim, g.v_head_dim, k_strides[2], v_strides[2],
            triton_available=kernel is not None, interpreter=INTERPRETER and mode == "always",
        )  # fmt: skip
        #: Whether any write may take the kernel (the warmup compiles only then).
        self.fused_possible = self.cache_ok and mode != "never"
        opts = KernelOptions.from_env() if options is None else options
        self.soft_cast = opts.soft_cast or not native_cast_ok(g.device)
        self.fast_div = opts.fast_div and not self.soft_cast and not INTERPRETER
        #: Compiled kernels by entry; turned off for this writer alone if a direct launch fails.
        self.launches = DirectLaunches("K/V write", opts.direct_launch and _SIGNATURE_OK)
        #: Launches that went through Triton's JIT (a variant's first launch, or direct launches off).
        self.jit_launches = 0
        self.cache_strides = (*k_strides, *v_strides)
        self.joined, self.row_plans, self.tile, self.layout, self.chunk = joined, row_plans, tile, layout, chunk
        self._device_index = current_cuda_device if g.device.type == "cuda" else int  # int() is 0: no device to ask
        self._raw_stream = current_raw_stream if g.device.type == "cuda" else (0).__mul__  # no stream on the CPU
        # 32-bit offsets need every offset of a launch below 2**31: the caches' (fixed here) and the
        # inputs' and loc's (per kind of call, from the strides; the largest T is kept).
        self._i32_ok = max(
            _span(capacity, g.heads, g.head_dim, k_strides), _span(capacity, g.v_heads, g.v_head_dim, v_strides)
        ) < I32_LIMIT
        self._dims = (g.heads, g.head_dim, g.v_heads, g.v_head_dim)
        self._device = g.device
        self._entries: dict[tuple, _Entry] = {}

    # --- the write -------------------------------------------------------------------------------

    def write(
        self,
        k_store: torch.Tensor,
        v_store: torch.Tensor,
        loc: object,
        k: object,
        v: object,
        k_scale: object,
        v_scale: object,
        names: ArgNames,
        amax: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        commit_lens: object = PLAIN_WRITE,
        slot_map: Optional[torch.Tensor] = None,
    ) -> None:
        """Check, classify and perform one write: the fused kernel when the gate allows, else the
        reference path, or ``FusedPathUnavailable`` in ``"always"`` mode; counted in ``stats``.

        ``k_store``/``v_store`` are the caches in storage dtype (uint8 for FP8); ``loc``, ``k``, ``v``
        and the scales are the caller's, named in errors by ``names``. ``amax`` = (K maxima [H], V
        maxima [Hv]) float32 makes the write also fold its per-head max |x| into them (calibration).
        ``commit_lens`` makes it a verify write (``loc`` [bs, width]). ``slot_map`` (int64 [M] on the
        device, the caller's checked mapping) makes ``loc`` slots of another pool: entry ``s`` in
        ``[0, M)`` writes slot ``slot_map[s]``, any other entry nothing; the fused kernel reads the
        map itself (one launch), the reference path and ``validate`` translate first. Bad input
        raises before anything is written; under ``validate`` slot range and scale values are
        checked too.

        A plain write of tensors of this geometry on the device, with scales None, a float in range
        or a one-element float32 tensor on the device, is recognised with a few comparisons; a key
        found in the memo was checked when it was made. Anything else is checked in full."""
        if slot_map is not None and (self.validate or not maps_in_kernel(slot_map, self._device)):
            plain = commit_lens is PLAIN_WRITE
            check_index(loc, names.loc, ndim=1 if plain else 2, dims="[T]" if plain else "[bs, width]", dtypes=LOC_DTYPES,
                        device=self._device)
            loc, slot_map = translate_slots(slot_map, loc), None  # type: ignore[arg-type]
        call_key = None
        if commit_lens is PLAIN_WRITE and type(loc) is _Tensor and type(k) is _Tensor and type(v) is _Tensor:
            loc_shape = loc.shape
            dev = self._device
            h, d, hv, dv = self._dims
            if len(loc_shape) == 1 and k.shape == (loc_shape[0], h, d) and v.shape == (loc_shape[0], hv, dv) and (
                k.device == dev and v.device == dev and loc.device == dev
            ):
                # Scales the kernel takes as they are: None, a float in range, a one-element
                # float32 tensor on the device (SCALE_NONE / SCALE_VALUE / SCALE_TENSOR); -1 else.
                if not self.scales_apply:
                    k_kind = v_kind = SCALE_NONE
                    k_scale = v_scale = None
                else:
                    if k_scale is None:
                        k_kind = SCALE_NONE
                    elif type(k_scale) is float:
                        k_kind = SCALE_VALUE if F32_MIN_NORMAL <= k_scale <= F32_MAX else -1
                    elif type(k_scale) is _Tensor and k_scale.dtype is _F32 and k_scale.numel() == 1 and k_scale.device == dev:
                        k_kind = SCALE_TENSOR
                    else:
                        k_kind = -1
                    if v_scale is k_scale:
                        v_kind = k_kind
                    elif v_scale is None:
                        v_kind = SCALE_NONE
                    elif type(v_scale) is float:
                        v_kind = SCALE_VALUE if F32_MIN_NORMAL <= v_scale <= F32_MAX else -1
                    elif type(v_scale) is _Tensor and v_scale.dtype is _F32 and v_scale.numel() == 1 and v_scale.device == dev:
                        v_kind = SCALE_TENSOR
                    else:
                        v_kind = -1
                if k_kind >= 0 and v_kind >= 0:
                    tokens = loc_shape[0]
                    # The one key of a kind of call (``_key_of`` spells it for checked calls); its
                    # last entry, [15], is the current device index, which the launch reads too.
                    call_key = (
                        k.dtype, v.dtype, loc.dtype, k_kind, v_kind, None, None, None, amax is None,
                        bisect_left(TOKEN_BANDS, tokens), k.stride(), v.stride(), loc.stride(), k.data_ptr() & 15,
                        v.data_ptr() & 15, self._device_index(),
                    )  # fmt: skip
        if call_key is None:
            key, k_scale, v_scale = check_write(self.geometry, k, v, loc, k_scale, v_scale, names, commit_lens)
            tokens = k.shape[0]  # type: ignore[union-attr]
            call_key = self._key_of(key, k, v, loc, amax, tokens)
        if not self.caches_aligned:
            call_key += (k_store.data_ptr() & 15, v_store.data_ptr() & 15)
        if slot_map is not None:
            call_key += (MAPPED_KEY,)
        entry = self._entries.get(call_key)
        if entry is None:
            entry, k_scale, v_scale = self._new_entry(
                call_key, k, v, loc, k_scale, v_scale, names, commit_lens, slot_map is not None
            )
        if self.validate:
            if commit_lens is PLAIN_WRITE:
                check_values(loc, names.loc, self.capacity, k_scale, v_scale)  # type: ignore[arg-type]
            else:
                check_prefix_values(loc, commit_lens, self.capacity, k_scale, v_scale)  # type: ignore[arg-type]
        if tokens == 0:
            return
        if entry.refused is not None:
            if slot_map is not None:
                loc = translate_slots(slot_map, loc)  # type: ignore[arg-type]
            self._fall_back(entry.refused, k_store, v_store, loc, k, v, k_scale, v_scale, amax, commit_lens)
            return
        self.stats.fused_calls += 1
        k_kind, v_kind = entry.k_kind, entry.v_kind
        if commit_lens is PLAIN_WRITE:
            commit, width, stride_row, stride_commit = loc, 1, 0, 0
        else:
            commit, width, stride_row, stride_commit = commit_lens, loc.shape[1], loc.stride(0), commit_lens.stride(0)  # type: ignore
        k_amax, v_amax = (loc, loc) if amax is None else amax
        # Pointers the variant never dereferences get loc (their branches are compiled out), so no
        # argument's type depends on the variant.
        per_call = (
            k, v, k_store, v_store, loc,
            k_scale if k_kind >= SCALE_TENSOR else loc, v_scale if v_kind >= SCALE_TENSOR else loc, commit, k_amax, v_amax,
            k_scale if k_kind == SCALE_VALUE else 1.0, v_scale if v_kind == SCALE_VALUE else 1.0,
            k_scale.stride(0) if k_kind == SCALE_HEAD else 0, v_scale.stride(0) if v_kind == SCALE_HEAD else 0,  # type: ignore
            tokens, width, stride_row, stride_commit,
            loc if slot_map is None else slot_map, 0 if slot_map is None else slot_map.shape[0],
        )  # fmt: skip
        bound = self.launches.entries.get(entry)
        if bound is not None and tokens <= entry.max_tokens:
            try:
                bound.run(
                    cdiv(tokens, entry.block_t), entry.grid_y, 1, self._raw_stream(call_key[15]), bound.function,
                    bound.metadata, None, None, None, *per_call, *entry.direct_args,
                )  # fmt: skip
                return
            except LAUNCH_ERRORS as exc:  # this Triton's launcher takes its arguments otherwise; nothing ran
                self.launches.failed(exc)
        self._jit_launch(entry, per_call, tokens)

    def jit_launch_of(self, record: LaunchRecord) -> Callable[[], None]:
        """The launch ``record`` (from ``self.launches.recording()``) made, through Triton's JIT
        instead of the compiled kernel: what a caller without the launch cache pays (benchmarks)."""
        n, consts = len(PER_CALL) + len(FIXED), record.key.constexprs  # type: ignore[attr-defined]
        return lambda: kernel.store_kv[record.grid](*record.args[:n], **consts)  # type: ignore[union-attr]

    @contextlib.contextmanager
    def uncounted(self) -> Iterator[None]:
        """Writes inside the block (a pool's warmup) do not count in ``stats``."""
        stats, self.stats = self.stats, PathStats()
        try:
            yield
        finally:
            self.stats = stats

    # --- the slow paths ----------------------------------------------------------------------------

    def _key_of(self, key: tuple, k, v, loc, amax, tokens: int) -> tuple:
        """The full key of a checked call: its ``WriteKey`` (a float32 scale tensor's dtype spelled
        None, as the fast classification spells it), observation, token band, the inputs' strides
        and 16-byte alignment (what Triton specialises on), the current device."""
        kd, vd = key[5], key[6]
        return (
            *key[:5], None if kd is _F32 else kd, None if vd is _F32 else vd, key[7], amax is None,
            bisect_left(TOKEN_BANDS, tokens), k.stride(), v.stride(), loc.stride(), k.data_ptr() & 15,
            v.data_ptr() & 15, self._device_index(),
        )  # fmt: skip

    def _new_entry(
        self, call_key, k, v, loc, k_scale, v_scale, names, commit_lens, mapped: bool
    ) -> tuple[_Entry, Scale, Scale]:
        """The entry of a kind of call seen for the first time: the full checks, the gate, the plan."""
        key, k_scale, v_scale = check_write(self.geometry, k, v, loc, k_scale, v_scale, names, commit_lens)
        amax_none, tokens = call_key[8], k.shape[0]
        if self._key_of(key, k, v, loc, None if amax_none else (), tokens) != call_key[:16]:  # pragma: no cover
            raise AssertionError(f"kvpool: the fast write key {call_key} differs from the checked call's")
        if self.mode == "never":
            entry = _Entry("fused='never'")
        elif not self.cache_ok:
            entry = _Entry(self.cache_reason)
        else:
            ok, reason = input_verdict(key)
            entry = _Entry(None) if ok else _Entry(reason)
            if ok:
                strides = call_key[10:13]
                self._plan_entry(entry, key, *strides, observe=not call_key[8], tokens=k.shape[0], mapped=mapped)
        if len(self._entries) >= LAUNCH_CACHE_ENTRIES:
            del self._entries[next(iter(self._entries))]
        self._entries[call_key] = entry
        return entry, k_scale, v_scale

    def plan(self, kst: tuple, vst: tuple, kinds: tuple[int, int], observe: bool, tokens: int) -> LaunchPlan:
        """The plan a fused call with these input strides, scale kinds and token count takes: a row
        plan only where heads are contiguous within a row in inputs and caches, without per-head
        scales or observation."""
        g, cst = self.geometry, self.cache_strides
        row = (
            self.row_plans and SCALE_HEAD not in kinds and not observe
            and _heads_contiguous(g.heads, g.head_dim, kst) and _heads_contiguous(g.v_heads, g.v_head_dim, vst)
            and _heads_contiguous(g.heads, g.head_dim, cst[:3]) and _heads_contiguous(g.v_heads, g.v_head_dim, cst[3:])
        )  # fmt: skip
        return plan_write(
            g.heads, g.head_dim, g.v_heads, g.v_head_dim, tokens, row=row, joined=self.joined, tile=self.tile,
            layout=self.layout, chunk=self.chunk,
        )  # fmt: skip

    def _plan_entry(
        self, entry: _Entry, key: tuple, kst: tuple, vst: tuple, lst: tuple, observe: bool, tokens: int, mapped: bool
    ) -> None:
        k_kind, v_kind = entry.k_kind, entry.v_kind = key[3], key[4]
        p = entry.plan = self.plan(kst, vst, (k_kind, v_kind), observe, tokens)
        entry.block_t, entry.grid_y = p.block_t, p.grid_y
        entry.max_tokens = self._max_tokens_i32(kst, vst, lst)
        cst = self.cache_strides
        entry.fixed_args = (
            self.capacity, lst[-1], *_view(p, kst, vst), *_view(p, cst[:3], cst[3:]),
        )  # fmt: skip
        consts = dict(
            H=p.heads, D=p.head_dim, HV=p.v_heads, DV=p.v_head_dim, BLOCK_T=p.block_t, BLOCK_H=p.block_h,
            BLOCK_D=p.block_d, BLOCK_HV=p.block_hv, BLOCK_DV=p.block_dv, BLOCK_D2=p.block_d2, BLOCK_DV2=p.block_dv2,
            K_SCALE_KIND=k_kind, V_SCALE_KIND=v_kind, OUT_KIND=OUT_KIND[self.geometry.cache_dtype], SOFT_CAST=self.soft_cast,
            FAST_DIV=self.fast_div, PREFIX=key[7] is not None, OBSERVE=observe, I64=False, JOINED=p.joined,
            MAPPED=mapped,
        )  # fmt: skip
        entry.direct_args = entry.fixed_args + tuple(consts[n] for n in CONSTEXPRS)
        entry.constexprs = {**consts, "num_warps": p.num_warps}

    def _jit_launch(self, entry: _Entry, per_call: tuple, tokens: int) -> None:
        """Launch through Triton's JIT (compiling on first use); keep the compiled kernel for direct
        launches. A write too large for 32-bit offsets takes the 64-bit variant, never kept."""
        i64 = tokens > entry.max_tokens
        consts = {**entry.constexprs, "I64": True} if i64 else entry.constexprs
        grid = (cdiv(tokens, entry.block_t), entry.grid_y, 1)
        self.jit_launches += 1

        def jit():
            return kernel.store_kv[grid](*per_call, *entry.fixed_args, **consts)  # type: ignore[union-attr]

        self.launches.launch(None if i64 else entry, grid, per_call + entry.direct_args, jit, self._device)

    def _fall_back(self, reason, k_store, v_store, loc, k, v, k_scale, v_scale, amax, commit_lens) -> None:
        if self.mode == "always":
            raise FusedPathUnavailable(f"fused='always' but {reason}")
        stats = self.stats
        stats.reference_calls += 1
        seen = stats.reasons.get(reason)
        if seen is None:
            logger.info("kvpool: a write takes the reference path: %s", reason)
            stats.reasons[reason] = 1
        else:
            stats.reasons[reason] = seen + 1
        commit = None if commit_lens is PLAIN_WRITE else commit_lens
        write_reference(k, v, k_store, v_store, loc, k_scale, v_scale, self.geometry.cache_dtype, commit, amax)

    def _max_tokens_i32(self, kst: tuple, vst: tuple, lst: tuple) -> int:
        """The largest T for which every offset of a launch with these strides fits in 32 bits (0 when
        the caches themselves do not)."""
        if not self._i32_ok:
            return 0
        g = self.geometry
        limit = I32_LIMIT - 1
        bounds = [
            (limit - (g.heads - 1) * kst[1] - (g.head_dim - 1) * kst[2], kst[0]),
            (limit - (g.v_heads - 1) * vst[1] - (g.v_head_dim - 1) * vst[2], vst[0]),
            (limit, sum(lst)),  # a [bs, width] loc too: each of its indices is at most T - 1
        ]
        most = I32_LIMIT
        for room, step in bounds:
            if room < 0:
                return 0
            if step > 0:
                most = min(most, room // step + 1)
        return most


def _view(plan: LaunchPlan, kst: Sequence[int], vst: Sequence[int]) -> tuple:
    """K's and V's strides [tokens, heads, head_dim] as the plan addresses them (a row view runs a
    row's heads end to end), concatenated."""
    if not plan.row_view:
        return (*kst, *vst)
    return (kst[0], plan.head_dim * kst[2], kst[2], vst[0], plan.v_head_dim * vst[2], vst[2])


def _span(rows: int, heads: int, head_dim: int, strides: Sequence[int]) -> int:
    """The largest element offset into a [rows, heads, head_dim] tensor with these strides."""
    return (rows - 1) * strides[0] + (heads - 1) * strides[1] + (head_dim - 1) * strides[2]


def _heads_contiguous(heads: int, head_dim: int, strides: Sequence[int]) -> bool:
    """Whether a [rows, heads, head_dim] tensor with these strides lays each row's heads end to end."""
    return heads == 1 or strides[1] == head_dim * strides[2]


@functools.lru_cache(maxsize=64)
def _writer(geometry, k_strides, v_strides, capacity, mode, validate, options, tile, layout, chunk, row_plans, joined):  # noqa: ANN001
    if joined is None:
        joined = parts_of_one_row(geometry, k_strides, v_strides)
    return KVWriter(
        geometry, k_strides, v_strides, capacity, mode, validate=validate, options=options, tile=tile,
        layout=layout, chunk=chunk, row_plans=row_plans, joined=joined,
    )  # fmt: skip


def writer_for(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    mode: str,
    validate: bool = False,
    *,
    options: Optional[KernelOptions] = None,
    tile: Optional[Tile] = None,
    layout: str = AUTO,
    chunk: int = 32,
    row_plans: bool = True,
    joined: Optional[bool] = None,
) -> KVWriter:
    """The writer for caller-owned caches (given in their logical dtype), one per cache geometry,
    mode and settings. It checks the caches' alignment per call (they are not a pool's own
    allocations); caches that are the two parts of one row take joined plans unless ``joined`` says
    otherwise. The other keywords are the writer's, for tests and plan sweeps."""
    g = Geometry(k_cache.dtype, k_cache.shape[1], k_cache.shape[2], v_cache.shape[1], v_cache.shape[2], k_cache.device)
    return _writer(
        g, tuple(k_cache.stride()), tuple(v_cache.stride()), k_cache.shape[0], mode, validate, options, tile, layout,
        chunk, row_plans, joined,
    )  # fmt: skip
