"""Every setting kvpool reads from the environment, in one place.

``KVPOOL_FUSED``: ``auto`` | ``always`` | ``never``; overrides a pool's ``fused`` argument.
``KVPOOL_VALIDATE``: ``1`` turns on the checks that cost a synchronisation (pools and allocators).
``KVPOOL_DIRECT_LAUNCH``, ``KVPOOL_FAST_DIV``, ``KVPOOL_SOFT_CAST``: debug switches of the fused
kernel's writer (see :class:`KernelOptions`); the defaults are what production should run.

Each is read when an object is built (a pool, an allocator, a host pool, a K/V writer; the
public write functions build their writer on the first call for a cache geometry), with one
exception: ``fused_fp8_set_kv_buffer`` and ``reference_set_kv_buffer`` called with ``validate=None``
read ``KVPOOL_VALIDATE`` on every call. Nothing else in the package reads ``os.environ``.

One setting is written, not read: ``MC_TCP_BIND_ADDRESS``, Mooncake's, when a ``MooncakeStore``
connects (:func:`default_mooncake_bind_address`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

FusedMode = Literal["auto", "always", "never"]
FUSED_MODES: tuple[str, ...] = ("auto", "always", "never")


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name, "")
    if value == "":
        return default
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


def fused_mode(requested: str) -> FusedMode:
    """The effective mode: ``KVPOOL_FUSED`` if set, else ``requested``; both checked."""
    env = os.environ.get("KVPOOL_FUSED")
    mode, source = (env, "KVPOOL_FUSED") if env else (requested, "fused")
    if mode not in FUSED_MODES:
        raise ValueError(f"{source} must be one of {', '.join(FUSED_MODES)}, got {mode!r}")
    return mode  # type: ignore[return-value]


def default_mooncake_bind_address(host: str) -> None:
    """Make Mooncake's TCP transport offer peers ``host`` (its ``MC_TCP_BIND_ADDRESS``) unless the
    environment already names an address; the setting is per process."""
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)


def validate_enabled(requested: bool) -> bool:
    """``validate`` is on when requested or when ``KVPOOL_VALIDATE=1``."""
    return bool(requested) or _flag("KVPOOL_VALIDATE", False)


@dataclass(frozen=True)
class KernelOptions:
    """How the K/V writer builds and launches the fused kernel.

    direct_launch : after a variant's first launch through Triton's JIT, launch the compiled kernel
        directly (skips Triton's per-call specialisation, most of a launch's host time). A writer
        whose direct launch fails goes back to the JIT path for itself and logs why.
    fast_div : divide by the scale with a correctly rounded reciprocal and two FMAs where that is
        exact (compiled NVIDIA kernels); ``False`` uses ``div.rn`` for every element.
    soft_cast : encode FP8/bf16 with integer operations even where the GPU converts natively
        (bit-identical either way; for comparison and for GPUs without the conversion).
    """

    direct_launch: bool = True
    fast_div: bool = True
    soft_cast: bool = False

    @classmethod
    def from_env(cls) -> "KernelOptions":
        """``KVPOOL_DIRECT_LAUNCH`` (default 1), ``KVPOOL_FAST_DIV`` (default 1), ``KVPOOL_SOFT_CAST``
        (default 0); each 0 or 1."""
        return cls(
            direct_launch=_flag("KVPOOL_DIRECT_LAUNCH", True),
            fast_div=_flag("KVPOOL_FAST_DIV", True),
            soft_cast=_flag("KVPOOL_SOFT_CAST", False),
        )
