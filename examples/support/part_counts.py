"""The write-path counts of a pool made of parts (``PathCounts``), read as one pool's ``stats``: the
sliding-window runners' and serve_sim's ``SWAKVPool``."""

from __future__ import annotations

from kvpool import SWAKVPool


class PathCounts:
    """The write-path counts of both parts of an ``SWAKVPool``, read when asked (a run takes the
    difference of two readings)."""

    def __init__(self, kv: SWAKVPool) -> None:
        self.parts = (kv.full_kv_pool.stats, kv.swa_kv_pool.stats)

    @property
    def fused_calls(self) -> int:
        return sum(s.fused_calls for s in self.parts)

    @property
    def reference_calls(self) -> int:
        return sum(s.reference_calls for s in self.parts)

    @property
    def reasons(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.parts:
            for k, v in s.reasons.items():
                out[k] = out.get(k, 0) + v
        return out
