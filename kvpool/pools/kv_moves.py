"""The host tier's former way to a pool's row table; it reads ``pool.row_table`` now."""

from __future__ import annotations

from kvpool.kernels.row_table import RowTable


def kv_rows(pool: object) -> RowTable:
    """``pool.row_table``."""
    return pool.row_table  # type: ignore[attr-defined]
