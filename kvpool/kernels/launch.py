"""What every kvpool Triton kernel needs to be launched: Triton's presence, its interpreter, block
arithmetic, and the cache that launches a compiled kernel straight after its first JIT launch.

Triton's JIT launch binds and specialises every argument and looks its cache up on each call, which
costs an eager decode step more host time than the kernel takes on the device. After a kernel's
first JIT launch for a kind of call, :class:`DirectLaunches` keeps the compiled kernel Triton hands
back under a key (:func:`launch_key`, a superset of what Triton specialises on), and later calls of
that kind launch it directly, all arguments positional in signature order, constexprs included
(:meth:`DirectLaunches.launch`), through the compiled kernel's launcher itself (:class:`Bound`): the
per-call wrapper ``CompiledKernel[grid]`` adds, its stream and device lookups and the launch hooks'
metadata, is left out while no launch hook is set. A cache is enabled only where the kernel's
parameters are the ones its caller passes, in order (checked against the signature at import; the
tests check each direct launch's arguments against what the JIT launch bound), since a launcher
need not check their count. A compiled-kernel launcher that raises on the arguments turns the cache
off for good, and the caller goes back to the JIT launch. The K/V write inlines the direct launch on
its hot path and shares the rest. What the kernels promise is in docs/contract.md ("The write",
"Moves and CPU copies").
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from kvpool.streams import OnStream

logger = logging.getLogger("kvpool")


@dataclass(frozen=True)
class Tile:
    """Work per program (or per task of a looping program): about ``elems`` elements of one tensor,
    over ``num_warps`` warps; ``maxnreg`` caps registers per thread (None: the compiler's choice).
    Each kernel family names its own tiles beside its plan; none changes a result, only how the work
    is cut up (``benchmarks/`` measures them, BENCHMARKS.md has the figures)."""

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
#: Programs per SM of an uncapped grid (each loops over its share of the tasks): enough to hide a
#: task's tail, few enough that the loop amortises each program's start.
PROGRAMS_PER_SM = 8

try:
    import triton

    @triton.jit
    def _probe():
        pass

    TRITON_AVAILABLE = True
    #: ``TRITON_INTERPRET=1`` was set before Triton defined its first kernel: every ``@triton.jit``
    #: function is then interpreted, on CPU tensors.
    INTERPRETER = type(_probe).__name__ == "InterpretedFunction"
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    TRITON_AVAILABLE = False
    INTERPRETER = False

#: The exceptions a compiled kernel's launcher raises when it takes its arguments differently from
#: how a direct launch passes them (nothing is launched then).
LAUNCH_ERRORS = (TypeError, SystemError, IndexError, AttributeError)

#: The index of the current CUDA device (a C function: no Python frame on a hot path); None in a
#: torch built without CUDA.
current_cuda_device: Optional[Callable[[], int]] = getattr(torch._C, "_cuda_getDevice", None)
#: The raw handle of a CUDA device's current stream, by device index (a C function, as above);
#: ``(0).__mul__`` (0 for every index, also a C function) where torch has no CUDA.
current_raw_stream: Callable[[int], int] = getattr(torch._C, "_cuda_getCurrentRawStream", (0).__mul__)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ``b``: the number of blocks of ``b`` covering ``a``."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (for ``n >= 1``)."""
    return 1 << max(0, (n - 1).bit_length())


def floor_pow2(n: int) -> int:
    """The largest power of two <= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(0, n.bit_length() - 1)


def compiled_on(device: torch.device) -> bool:
    """Whether kvpool's Triton kernels run compiled for tensors on ``device`` (CUDA, with Triton, not
    its interpreter): where a caller whose arguments are already checked may launch one directly."""
    return device.type == "cuda" and TRITON_AVAILABLE and not INTERPRETER


def uses_kernel(device: torch.device, on_cpu: bool) -> bool:
    """Whether a launcher runs its Triton kernel for tables on ``device``: compiled on CUDA; on the
    CPU only under the interpreter and when ``on_cpu`` (tests set it); elsewhere it takes its
    PyTorch reference."""
    if device.type == "cuda":
        return compiled_on(device)
    return TRITON_AVAILABLE and INTERPRETER and on_cpu


def row_elements(row_bytes: Sequence[int], align: int) -> tuple[int, int, list[int]]:
    """How a row-copying kernel moves rows of ``row_bytes`` bytes whose addresses, strides and sizes
    ``align`` divides: (bytes of the element it loads, 4 at most; elements per ``align``-byte vector;
    each row's length in elements)."""
    elem = min(align, 4)
    return elem, align // elem, [rb // elem for rb in row_bytes]


def column_chunks(row_elems: Sequence[int], cap: int) -> tuple[int, int, bool]:
    """How such a kernel cuts rows of ``row_elems`` elements into column chunks: (chunk width, a
    power of two no wider than the longest row needs and at most ``cap``; chunks in the longest
    row; whether every row is a whole number of chunks, so no column mask is needed)."""
    longest = max(row_elems)
    block_w = min(next_pow2(longest), cap)
    return block_w, cdiv(longest, block_w), all(e % block_w == 0 for e in row_elems)


def copy_warps(elements: int, vec: int, cap: int) -> int:
    """Warps for a task of ``elements`` elements moved ``vec`` at a time: about two vectors per
    thread at least (a 1-pair, 256-element task runs on one warp), a power of two, at most ``cap``."""
    return floor_pow2(max(1, min(cap, elements // (64 * vec))))


@functools.lru_cache(maxsize=16)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 elsewhere): what SM-wide grids are sized by."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def kernel_params(kernel: Any) -> tuple[str, ...]:
    """A ``@triton.jit`` function's parameter names in signature order (JIT or interpreter)."""
    return tuple(inspect.signature(getattr(kernel, "fn", kernel)).parameters)


def launch_key(device_index: Optional[int], constexprs: tuple, options: tuple, tensors: Sequence, ints: Sequence) -> tuple:
    """Everything the compiled kernel of a launch depends on: the device, the constexprs, the launch
    options (warps, a register cap), and what Triton specialises each runtime argument on: a
    tensor's dtype and whether 16 divides its address; an int's type (i32 up to 2**31 - 1, i64, u64
    from 2**63), whether it is 1 and whether 16 divides it. Two launches with equal keys run the
    same compiled kernel; the key is a superset of Triton's own, so a kernel is never reused for
    arguments it was not compiled for. (The grid is not part of it.)"""
    return (
        device_index, constexprs, options, *[(t.dtype, t.data_ptr() % 16 == 0) for t in tensors],
        *[(v == 1) | (v % 16 == 0) << 1 | (v > 0x7FFFFFFF) << 2 | (v >= 1 << 63) << 3 | (v < -0x80000000) << 4 for v in ints],
    )  # fmt: skip


class Bound:
    """A compiled kernel as its direct launches call it: ``run(gx, gy, gz, stream, function,
    metadata, None, None, None, *args)`` (stream: a raw handle, :data:`current_raw_stream`) is the
    call ``CompiledKernel[grid](*args)`` ends in, without its lookups; ``compiled`` is the kernel
    Triton handed back (what a launch by hand goes through)."""

    __slots__ = ("run", "function", "metadata", "compiled")

    def __init__(self, run: Callable[..., Any], function: Any, metadata: Any, compiled: Any) -> None:
        self.run, self.function, self.metadata, self.compiled = run, function, metadata, compiled

    @classmethod
    def of(cls, compiled: Any) -> "Bound":
        """``compiled``'s launcher entry, or Triton's own launch where a launch hook (a profiler's)
        is set now or the compiled kernel has no such entry. Decided once, when a variant is first
        kept: a hook set later is not called for variants kept before it (docs/contract.md)."""
        if _no_launch_hooks():
            try:
                return cls(compiled.run, compiled.function, compiled.packed_metadata, compiled)
            except AttributeError:  # another Triton's CompiledKernel: its own launch
                pass
        return cls(functools.partial(_through_triton, compiled), None, None, compiled)


def _through_triton(compiled: Any, gx: int, gy: int, gz: int, stream: int, *rest: Any) -> None:
    """A :class:`Bound` run through ``compiled[grid]`` (``rest``: function, metadata, the three
    hook arguments, then the kernel's arguments)."""
    compiled[(gx, gy, gz)](*rest[5:], stream=stream)


def _no_launch_hooks() -> bool:
    """Whether Triton would call no launch hook (its knobs' enter and exit hooks unset or empty)."""
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None:
        return False
    hooks = (getattr(runtime, "launch_enter_hook", None), getattr(runtime, "launch_exit_hook", None))
    return all(h is None or getattr(h, "calls", None) == [] for h in hooks)


class DirectLaunches:
    """Compiled kernels of one ``@triton.jit`` function, by launch key, for direct launches.

    ``entries`` maps a caller's key (a superset of what Triton specialises on, or an object standing
    for one) to the :class:`Bound` compiled kernel its first JIT launch handed back. ``enabled`` is
    False where direct launches cannot work (no Triton, the interpreter, a kernel whose signature is not the
    order the caller passes, or switched off) and once a direct launch failed. At most ``limit``
    entries, as Triton's own cache of compiled variants is bounded.
    """

    __slots__ = ("entries", "enabled", "limit", "what")

    def __init__(self, what: str, enabled: bool = True, limit: int = LAUNCH_CACHE_ENTRIES) -> None:
        self.what = what
        self.entries: dict = {}
        self.limit = limit
        self.enabled = enabled and TRITON_AVAILABLE and not INTERPRETER

    def launch(
        self,
        key: object,
        grid: tuple[int, int, int],
        args: tuple,
        jit: Callable[[], object],
        device: torch.device,
        stream: Optional[torch.cuda.Stream] = None,
    ) -> None:
        """One launch of a kind of call: the compiled kernel kept under ``key`` directly when there is
        one (``args``: every parameter positionally in signature order, constexprs included), else
        ``jit()``, the JIT launch on the current device and stream, whose compiled kernel is kept
        under ``key`` (None: not kept). ``device`` is where the kernel runs: one that is not the
        current device is made current for the JIT launch and its launches are not kept (a compiled
        kernel is loaded on one device). ``stream``: the CUDA stream to launch on (default: the
        current one), without leaving it current."""
        here = device.type != "cuda" or device.index == current_cuda_device()  # type: ignore[misc]
        if here and key is not None:
            bound = self.entries.get(key)
            if bound is not None:
                try:
                    if stream is not None:
                        raw = stream.cuda_stream
                    else:  # the CPU (tests' stand-ins) has no stream to ask for
                        raw = current_raw_stream(device.index) if device.type == "cuda" else 0
                    bound.run(*grid, raw, bound.function, bound.metadata, None, None, None, *args)
                    return
                except LAUNCH_ERRORS as exc:  # a launcher that parses its arguments refused these; nothing ran
                    self.failed(exc)
        if here and stream is None:
            compiled = jit()
        else:
            with OnStream(stream if stream is not None else torch.cuda.current_stream(device)):
                compiled = jit()
        if here and key is not None and compiled is not None:
            self.remember(key, compiled)

    def remember(self, key: object, compiled: object) -> None:
        """Keep ``compiled`` for later launches of ``key`` (dropping the oldest past ``limit``)."""
        if not self.enabled:
            return
        if len(self.entries) >= self.limit:
            del self.entries[next(iter(self.entries))]
        self.entries[key] = Bound.of(compiled)

    @contextlib.contextmanager
    def recording(self) -> Iterator[list["LaunchRecord"]]:
        """Record the direct launches made inside the block, for benchmarks that time a launch by
        hand: yields a list that gets a :class:`LaunchRecord` per direct launch (the kernels launch
        as usual). Launches through the JIT are not recorded."""
        records: list = []
        originals = dict(self.entries)
        self.entries.update({key: _Recorder(bound, key, records).bound for key, bound in originals.items()})
        try:
            yield records
        finally:
            for key, value in list(self.entries.items()):
                if type(value.run) is _Recorder:
                    self.entries[key] = value.run.original

    def failed(self, exc: BaseException) -> None:
        """A direct launch raised before launching: launch through the JIT from now on."""
        self.enabled = False
        self.entries.clear()
        logger.warning(
            "kvpool: direct launch of the compiled kernel failed (%s); the %s launches through Triton's JIT from now on",
            exc, self.what,
        )  # fmt: skip


@dataclass(frozen=True)
class LaunchRecord:
    """One direct launch: the compiled kernel, its grid, its arguments, the key it was kept under,
    and the :class:`Bound` it went through."""

    compiled: Any
    grid: tuple
    args: tuple
    kwargs: dict
    key: object
    bound: Optional[Bound] = None
    stream: int = 0  # the raw handle of the stream the direct launch was made on

    def replay(self) -> None:
        """Launch the same compiled kernel with the same arguments again, by hand through
        ``CompiledKernel[grid]`` (on the current stream)."""
        self.compiled[self.grid](*self.args, **self.kwargs)

    def replay_direct(self) -> None:
        """The same launch as a direct launch makes it: the launcher's entry, the same stream."""
        b = self.bound
        b.run(*self.grid, self.stream, b.function, b.metadata, None, None, None, *self.args)  # type: ignore[union-attr]


class _Recorder:
    """Stands in for a :class:`Bound`'s run inside :meth:`DirectLaunches.recording`: records each
    launch, then makes it."""

    __slots__ = ("original", "key", "records", "bound")

    def __init__(self, original: Bound, key: object, records: list) -> None:
        self.original, self.key, self.records = original, key, records
        self.bound = Bound(self, original.function, original.metadata, original.compiled)

    def __call__(self, gx: int, gy: int, gz: int, stream: int, *rest: Any) -> None:
        o = self.original
        self.records.append(LaunchRecord(o.compiled, (gx, gy, gz), rest[5:], {}, self.key, o, stream))
        o.run(gx, gy, gz, stream, *rest)
