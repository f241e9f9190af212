"""How a cache with a storage tier uses it: SGLang's prefetch policies, the prefetch threshold and
timeout, the back-off after failures, and whether storage calls run on worker threads
(``StoragePolicy``; ``kvpool.cache.storage_tier`` carries it out)."""

from __future__ import annotations

import dataclasses

from kvpool.checks import non_negative_int

#: When a prefetch lets its request go on (SGLang's ``hicache_storage_prefetch_policy``).
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")


@dataclasses.dataclass(frozen=True)
class StoragePolicy:
    """How a ``HiRadixCache`` or ``HiMambaRadixCache`` uses its storage tier.

    Parameters
    ----------
    prefetch_policy : ``"best_effort"``, ``"wait_complete"`` or ``"timeout"`` (see
        ``kvpool.cache.storage_tier``).
    prefetch_threshold : fewest tokens worth a prefetch: shorter remainders, and prefetches that
        find fewer pages in storage, fetch nothing (SGLang's default, 256).
    prefetch_timeout_base_s, prefetch_timeout_per_page_s : the ``timeout`` policy's limit, base plus
        per page looked up.
    backoff_s, max_backoff_s : the pause after a storage failure, doubled after each further one up
        to the maximum, back to ``backoff_s`` after a success.
    background : run storage calls on worker threads (False: on the caller's thread, in order, as
        tests want).
    """

    prefetch_policy: str = "best_effort"
    prefetch_threshold: int = 256
    prefetch_timeout_base_s: float = 1.0
    prefetch_timeout_per_page_s: float = 0.01
    backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    background: bool = True

    def __post_init__(self) -> None:
        if self.prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(f"prefetch_policy must be one of {', '.join(PREFETCH_POLICIES)}, got {self.prefetch_policy!r}")
        non_negative_int(self.prefetch_threshold, "prefetch_threshold")
        for name in ("prefetch_timeout_base_s", "prefetch_timeout_per_page_s", "backoff_s", "max_backoff_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ValueError(f"{name} must be a number of seconds >= 0, got {v!r}")
        if self.max_backoff_s < self.backoff_s:
            raise ValueError(f"max_backoff_s must be >= backoff_s {self.backoff_s}, got {self.max_backoff_s}")
        if not isinstance(self.background, bool):
            raise ValueError(f"background must be a bool, got {self.background!r}")
