"""The free list of a ``MambaPool``'s state slots, kept on the host.

State slots are few (one or a few per running request) and a scheduler knows them on the host, so
the bookkeeping lives in Python and every free is checked, always: a slot freed twice, slot 0 (the
padding slot), a slot never handed out, out of range or listed twice raises ``ValueError`` and
frees nothing.
"""

from __future__ import annotations

from collections import deque
from typing import Optional, Sequence, Union

import torch

from kvpool.checks import int_list, non_negative_int, positive_int
from kvpool.errors import IntegrityError

SlotsArg = Union[int, Sequence[int], torch.Tensor]


class StateSlots:
    """Slots ``1..size`` handed out first in, first out (slot 0 never).

    >>> slots = StateSlots(4)
    >>> slots.take(3)
    [1, 2, 3]
    >>> slots.give_back([2])
    >>> slots.available(), slots.take(2)
    (2, [4, 2])
    """

    def __init__(self, size: int) -> None:
        self.size = positive_int(size, "size")
        self.clear()

    def clear(self) -> None:
        """Every slot free again, to be handed out in order ``1..size``."""
        self._free: deque[int] = deque(range(1, self.size + 1))
        self._held = [False] * (self.size + 1)

    def available(self) -> int:
        """Free slots."""
        return len(self._free)

    def is_held(self, slot: int) -> bool:
        """Whether ``slot`` is handed out (False for 0 and slots outside ``1..size``)."""
        return 0 < slot <= self.size and self._held[slot]

    def held(self) -> list[int]:
        """Every slot handed out and not yet given back, ascending."""
        return [s for s in range(1, self.size + 1) if self._held[s]]

    def take(self, n: int) -> Optional[list[int]]:
        """``n`` slots, or None (nothing changed) when fewer are free."""
        non_negative_int(n, "need_size")
        if n > len(self._free):
            return None
        out = [self._free.popleft() for _ in range(n)]
        for s in out:
            self._held[s] = True
        return out

    def check_held(self, slots: list[int], name: str = "free_index") -> None:
        """Raise ``ValueError`` unless every entry is a slot handed out, listed once."""
        seen: set[int] = set()
        for pos, s in enumerate(slots):
            if s == 0:
                raise ValueError(f"{name}[{pos}] is slot 0, the padding slot, which is never handed out")
            if not 0 < s <= self.size:
                raise ValueError(f"{name}[{pos}] = {s} is out of range: slots are 1..{self.size}")
            if s in seen:
                raise ValueError(f"{name}[{pos}] = {s} is listed twice")
            if not self._held[s]:
                raise ValueError(f"{name}[{pos}] = {s} is not handed out (a double free, or never allocated)")
            seen.add(s)

    def check_usable(self, slots: list[int], name: str, *, padding: bool = True) -> None:
        """Raise ``ValueError`` unless every entry of index argument ``name`` names a slot an
        operation may read or write: a slot handed out, or (with ``padding``) slot 0 or a negative
        entry, the padding a batch may carry. Ranges are the caller's (``IndexError``)."""
        for pos, s in enumerate(slots):
            if padding and s <= 0:
                continue
            if s == 0:
                raise ValueError(f"{name}[{pos}] is slot 0, the padding slot, which is never handed out")
            if not 0 < s <= self.size:
                raise ValueError(f"{name}[{pos}] = {s} is out of range: slots are 1..{self.size}")
            if not self._held[s]:
                raise ValueError(f"{name}[{pos}] = {s} is not a slot handed out (it is free)")

    def give_back(self, slots: list[int], name: str = "free_index") -> None:
        """Return handed-out slots (checked first; nothing changes if any is bad)."""
        self.check_held(slots, name)
        for s in slots:
            self._held[s] = False
        self._free.extend(slots)

    def check_integrity(self, what: str = "MambaPool") -> None:
        """Raise ``IntegrityError`` (with counts) if the free list and the held flags disagree."""
        problems = []
        free = list(self._free)
        bad = [s for s in free if not (isinstance(s, int) and 0 < s <= self.size)]
        if bad:
            problems.append(f"{len(bad)} free entries outside 1..{self.size} (first: {bad[0]!r})")
        if len(set(free)) != len(free):
            problems.append(f"{len(free) - len(set(free))} slots listed free more than once")
        held_and_free = [s for s in free if 0 < s <= self.size and self._held[s]]
        if held_and_free:
            problems.append(f"{len(held_and_free)} slots both free and held (first: {held_and_free[0]})")
        lost = self.size - len(set(free)) - sum(self._held[1:])
        if lost > 0:
            problems.append(f"{lost} slots neither free nor held (leaked)")
        if problems:
            raise IntegrityError(f"{what} integrity check failed: " + "; ".join(problems))


def as_slot_list(slots: SlotsArg, name: str = "free_index") -> list[int]:
    """A slot argument (an int, a sequence of ints, or a 0-D/1-D integer tensor on any device; a
    CUDA tensor is read with one synchronisation) as a list of ints."""
    return int_list(slots, name, accepts="an int, a sequence of ints or an integer tensor")
