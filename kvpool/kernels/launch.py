"""What every kvpool Triton kernel needs to be launched: Triton's presence, its interpreter, block
arithmetic, and the cache that launches a compiled kernel straight after its first JIT launch.

Triton's JIT launch binds and specialises every argument and looks its cache up on each call, which
costs an eager decode step more host time than the kernel takes on the device. After a kernel's
first JIT launch for a kind of call, :class:`DirectLaunches` keeps the compiled kernel Triton hands
back under a key the caller builds (a superset of what Triton specialises on), and later calls of
that kind launch it directly, all arguments positional in signature order. A compiled-kernel
launcher that refuses them turns the cache off for good, and the caller goes back to the JIT launch.
What the kernels promise is in docs/contract.md ("The write", "Moves and CPU copies").
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from kvpool.kernels.tuning import LAUNCH_CACHE_ENTRIES

logger = logging.getLogger("kvpool")

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


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ``b``: the number of blocks of ``b`` covering ``a``."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (for ``n >= 1``)."""
    return 1 << max(0, (n - 1).bit_length())


def floor_pow2(n: int) -> int:
    """The largest power of two <= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(0, n.bit_length() - 1)


def kernel_params(kernel: Any) -> tuple[str, ...]:
    """A ``@triton.jit`` function's parameter names in signature order (JIT or interpreter)."""
    return tuple(inspect.signature(getattr(kernel, "fn", kernel)).parameters)


class DirectLaunches:
    """Compiled kernels of one ``@triton.jit`` function, by launch key, for direct launches.

    ``entries`` maps a caller's key (a superset of what Triton specialises on, or an object standing
    for one) to the compiled kernel its first JIT launch handed back. ``enabled`` is False where
    direct launches cannot work (no Triton, the interpreter, a kernel whose signature is not the
    order the caller passes, or switched off) and once a direct launch failed. At most ``limit``
    entries, as Triton's own cache of compiled variants is bounded.
    """

    __slots__ = ("entries", "enabled", "limit", "what")

    def __init__(self, what: str, enabled: bool = True, limit: int = LAUNCH_CACHE_ENTRIES) -> None:
        self.what = what
        self.entries: dict = {}
        self.limit = limit
        self.enabled = enabled and TRITON_AVAILABLE and not INTERPRETER

    def remember(self, key: object, compiled: object) -> None:
        """Keep ``compiled`` for later launches of ``key`` (dropping the oldest past ``limit``)."""
        if not self.enabled:
            return
        if len(self.entries) >= self.limit:
            del self.entries[next(iter(self.entries))]
        self.entries[key] = compiled

    def failed(self, exc: BaseException) -> None:
        """A direct launch raised before launching: launch through the JIT from now on."""
        self.enabled = False
        self.entries.clear()
        logger.warning(
            "kvpool: direct launch of the compiled kernel failed (%s); the %s launches through Triton's JIT from now on",
            exc, self.what,
        )  # fmt: skip
