"""Settings read from the environment, in one place.

``KVPOOL_FUSED``: ``auto`` | ``always`` | ``never``; overrides the pool's ``fused`` argument.
``KVPOOL_VALIDATE``: ``1`` turns on the checks that cost a synchronisation (pools and allocators).
Both are read when an object is constructed, never on the hot path.
"""

from __future__ import annotations

import os
from typing import Literal

FusedMode = Literal["auto", "always", "never"]
FUSED_MODES: tuple[str, ...] = ("auto", "always", "never")


def fused_mode(requested: str) -> FusedMode:
    """The effective mode: ``KVPOOL_FUSED`` if set, else ``requested``; both checked."""
    env = os.environ.get("KVPOOL_FUSED")
    mode, source = (env, "KVPOOL_FUSED") if env else (requested, "fused")
    if mode not in FUSED_MODES:
        raise ValueError(f"{source} must be one of {', '.join(FUSED_MODES)}, got {mode!r}")
    return mode  # type: ignore[return-value]


def validate_enabled(requested: bool) -> bool:
    """``validate`` is on when requested or when ``KVPOOL_VALIDATE=1``."""
    env = os.environ.get("KVPOOL_VALIDATE", "")
    if env not in ("", "0", "1"):
        raise ValueError(f"KVPOOL_VALIDATE must be 0 or 1, got {env!r}")
    return bool(requested) or env == "1"
