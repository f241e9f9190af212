"""What the slot allocators check, kept apart from how they allocate.

Checks come in three kinds, by what they cost:

1. Arguments on the host (types, shapes, dtypes, devices, the CPU lengths, ``extend_num_tokens``,
   ``free_index``, the pool an allocator indexes): always, before anything changes.
2. Device arguments against each other (device lengths equal to their CPU copies; each
   continuing request's ``last_loc`` inside the slot range, at the page offset its prefix length
   implies): always on a CPU allocator, where the values are already on the host; under ``validate``
   on other devices, where reading them costs a synchronisation.
3. Arguments against the bookkeeping (a continuation starts after a held slot, on a held page,
   onto slots nobody holds, and no two requests of one batch continue onto the same slot; a free
   names held slots, once each): under ``validate``.

Index tensors are checked with :func:`kvpool.checks.check_index`; the rules are in docs/contract.md,
"Allocators and the request table".
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from kvpool.checks import INTEGER_DTYPES, check_index

Indices = Union[torch.Tensor, Sequence[int]]

CPU = torch.device("cpu")
VECTOR = "a 1-D integer tensor"
PER_REQUEST = "one per request"


def as_int64(t: torch.Tensor) -> torch.Tensor:
    """``t`` as int64 (itself when it is already: ``.to`` costs a dispatch even then, on every
    scheduler step)."""
    return t if t.dtype == torch.int64 else t.to(torch.int64)


def ceil_div(x: torch.Tensor, d: int) -> torch.Tensor:
    """``ceil(x / d)`` element-wise, in integers: the pages that ``x`` slots fill at page size ``d``.

    Parameters
    ----------
    x : Tensor of a non-negative integer dtype, any shape (lengths in slots).
    d : int >= 1.

    Returns
    -------
    Tensor of ``x``'s shape, dtype and device.
    """
    return (x + d - 1) // d


# --- 1. arguments on the host ------------------------------------------------------------------------


#: Sequence lengths must be below this (a trillion tokens): the sums of a batch's lengths and pages
#: then fit in int64 whatever the batch, on the tensor path as in Python.
MAX_SEQ_LEN = 2**40

#: Batches up to this many requests have their CPU lengths summed and checked in Python; larger ones
#: by numpy on the tensors' memory (a handful of calls, about 10 us whatever the batch, where a loop
#: over a list of 128 costs 30 us and torch's operations twice numpy's).
SMALL_BATCH = 16


def request_vectors(
    cpu: tuple[object, ...], cpu_names: tuple[str, ...], dev: tuple[object, ...], dev_names: tuple[str, ...],
    device: torch.device,
) -> int:
    """The per-request vectors of ``alloc_extend``/``alloc_decode``: ``cpu`` on the CPU, ``dev`` on
    the allocator's ``device``, all 1-D integer tensors of one length, which is returned. The common
    case is decided in one pass; a vector that fails gets :func:`lens_vector`'s or
    :func:`device_vector`'s message."""
    bs = cpu[0].shape[0] if type(cpu[0]) is torch.Tensor and cpu[0].dim() == 1 else -1  # type: ignore[union-attr]
    for ts, where in ((cpu, CPU), (dev, device)):
        for t in ts:
            if not (type(t) is torch.Tensor and t.dtype in INTEGER_DTYPES and t.dim() == 1
                    and t.shape[0] == bs and t.device == where):  # fmt: skip
                bs = lens_vector(cpu[0], cpu_names[0])
                for c, name in zip(cpu[1:], cpu_names[1:]):
                    lens_vector(c, name, bs)
                for d, name in zip(dev, dev_names):
                    device_vector(d, name, bs, device)
    return bs


def lens_vector(t: object, name: str, bs: Optional[int] = None) -> int:
    """A 1-D integer tensor on the CPU with ``bs`` entries (any count if None); returns its length."""
    _tensor(t, name)
    check_index(t, name, dtypes=INTEGER_DTYPES, expect=VECTOR, length=bs, per=PER_REQUEST, device=CPU, where="the CPU")
    return t.shape[0]  # type: ignore[union-attr]


def device_vector(t: object, name: str, bs: Optional[int], device: torch.device) -> None:
    """A 1-D integer tensor on the allocator's ``device`` with ``bs`` entries (any count if None)."""
    _tensor(t, name)
    where = f"the allocator's device {device}"
    check_index(t, name, dtypes=INTEGER_DTYPES, expect=VECTOR, length=bs, per=PER_REQUEST, device=device, where=where)


def page_list(t: object, name: str) -> torch.Tensor:
    """A 1-D integer tensor (any device) to assign as a free list; returned as given."""
    _tensor(t, name)
    return check_index(t, name, dtypes=INTEGER_DTYPES, expect=VECTOR)


def _tensor(t: object, name: str) -> None:
    # The allocators raise ValueError for every malformed argument, a non-tensor included.
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")


def extend_lengths(pre_c: torch.Tensor, seq_c: torch.Tensor, extend_num_tokens: object, page_size: int) -> tuple[int, int]:
    """CPU lengths of ``alloc_extend``: ``0 <= prefix_lens <= seq_lens < MAX_SEQ_LEN``, and
    ``extend_num_tokens`` their difference's sum. Returns ``(tokens, fresh pages)``: that sum, and the pages the extension
    takes, ``sum(ceil(seq_lens / page_size) - ceil(prefix_lens / page_size))``. A handful of
    operations whatever the batch (this runs on every scheduler step)."""
    p = page_size
    if pre_c.shape[0] <= SMALL_BATCH:
        pre, seq = pre_c.tolist(), seq_c.tolist()
        longest = max(seq, default=0)
        total = sum(seq) - sum(pre)
        bad = bool(pre) and (min(pre) < 0 or min(map(int.__sub__, seq, pre)) < 0)
        fresh = sum((s + p - 1) // p for s in seq) - sum((q + p - 1) // p for q in pre)
    else:
        seq_n, pre_n = seq_c.numpy(), pre_c.numpy()
        longest = int(seq_n.max())
        ext = seq_n - pre_n
        total = int(ext.sum())
        bad = bool(pre_n.min() < 0) or bool(ext.min() < 0)
        fresh = int((pre_n // -p).sum() - (seq_n // -p).sum())  # ceil(x / p) is -(x // -p)
    if longest >= MAX_SEQ_LEN:
        raise ValueError(f"seq_lens_cpu must be below {MAX_SEQ_LEN} tokens, got {longest}")
    if bad:
        if bool((pre_c < 0).any()):
            raise ValueError(f"prefix_lens_cpu must be >= 0, got {pre_c.tolist()}")
        i = int((seq_c < pre_c).nonzero()[0])
        raise ValueError(
            f"seq_lens_cpu must be >= prefix_lens_cpu, got {int(seq_c[i])} < {int(pre_c[i])} for request {i}"
        )
    if isinstance(extend_num_tokens, bool) or not isinstance(extend_num_tokens, int):
        raise ValueError(f"extend_num_tokens must be an int, got {extend_num_tokens!r}")
    if extend_num_tokens != total:
        raise ValueError(f"extend_num_tokens must be sum(seq_lens - prefix_lens) = {total}, got {extend_num_tokens}")
    return total, fresh


def decode_lengths(seq_c: torch.Tensor, page_size: int) -> int:
    """The CPU lengths of ``alloc_decode``: each request's ``seq_lens`` at least 1 (it counts the new
    token). Returns the fresh pages the step takes (requests whose new token starts a page).

    Parameters
    ----------
    seq_c : Tensor [bs] of an integer dtype on the CPU (``seq_lens_cpu``).
    page_size : slots per page.

    Raises
    ------
    ValueError
        If an entry is below 1, listing the lengths.
    """
    p = page_size
    if seq_c.shape[0] <= SMALL_BATCH:
        seq = seq_c.tolist()
        bad = bool(seq) and min(seq) < 1
        fresh = sum((s - 1) % p == 0 for s in seq)
    else:
        seq_n = seq_c.numpy()
        bad = bool(seq_n.min() < 1)
        fresh = int(((seq_n - 1) % p == 0).sum())
    if bad:
        raise ValueError(f"seq_lens_cpu must be >= 1 (they count the new token), got {seq_c.tolist()}")
    return fresh


def free_index_slots(free_index: object, device: torch.device) -> torch.Tensor:
    """``free_index`` (a 0-D or 1-D integer tensor on ``device`` or the CPU, or a sequence of ints)
    as an int64 tensor on ``device``."""
    if type(free_index) is torch.Tensor and free_index.dtype == torch.int64 and free_index.dim() == 1 and free_index.device == device:
        return free_index  # what a scheduler frees on every step, taken as it is
    if isinstance(free_index, torch.Tensor):
        flat = free_index.reshape(1) if free_index.dim() == 0 else free_index
        where = "the CPU" if device.type == "cpu" else f"the allocator's device {device} or the CPU"
        check_index(flat, "free_index", dtypes=INTEGER_DTYPES, device=(device, CPU), where=where)
        return flat.to(device=device, dtype=torch.int64)
    if isinstance(free_index, (int, bool)) or not isinstance(free_index, Sequence):
        raise ValueError(f"free_index must be a tensor or a sequence of ints, got {type(free_index).__name__}")
    if any(isinstance(i, bool) or not isinstance(i, int) for i in free_index):
        raise ValueError(f"free_index must hold ints, got {list(free_index)!r}")
    return torch.tensor(list(free_index), dtype=torch.int64, device=device)


def fits_kvcache(size: int, page_size: int, kvcache: object) -> None:
    """Every slot an allocator of ``size`` and ``page_size`` hands out is a row of ``kvcache`` (when
    it is a pool, with ``size`` and ``page_size``): no more slots than the pool, in its pages."""
    pool_size, pool_page = getattr(kvcache, "size", None), getattr(kvcache, "page_size", None)
    if not (isinstance(pool_size, int) and isinstance(pool_page, int)):
        return
    if page_size != pool_page:
        hint = " (TokenToKVPoolAllocator hands out pages of one slot: use PagedTokenToKVPoolAllocator)" if page_size == 1 else ""
        raise ValueError(f"page_size must equal the kvcache's page_size = {pool_page}, got {page_size}{hint}")
    if size > pool_size:
        raise ValueError(
            f"size must be at most the kvcache's size = {pool_size} (the slots its buffers hold), got {size}"
        )


# --- 2. device arguments against each other (host copies) --------------------------------------------


def same_as_cpu(values: torch.Tensor, cpu: torch.Tensor, name: str) -> None:
    """``values`` (the device tensor ``name``, read to the host) equal ``name``_cpu."""
    if not torch.equal(values, cpu.to(torch.int64)):
        i = int((values != cpu).nonzero()[0])
        raise ValueError(
            f"{name} must equal {name}_cpu, got {name}[{i}] = {int(values[i])} and {name}_cpu[{i}] = {int(cpu[i])}"
        )


def last_loc_arguments(
    what: str, last: torch.Tensor, pre: torch.Tensor, seq: torch.Tensor, page_size: int, num_slots: int
) -> None:
    """Each request that continues a partial page names, in ``last_loc``, a slot in the handed-out range
    ``page_size..num_slots-1`` at the page offset its prefix length implies (host tensors)."""
    p = page_size
    continues = (pre % p != 0) & (seq > pre)
    outside = (continues & ((last < p) | (last >= num_slots))).nonzero().flatten()
    if outside.numel():
        i = int(outside[0])
        raise IndexError(
            f"{what}: last_loc[{i}] must be a slot in {p}..{num_slots - 1}, since request {i} continues "
            f"a partial page (prefix length {int(pre[i])}, page_size {p}), got {int(last[i])}"
        )
    misplaced = (continues & ((last + 1) % p != pre % p)).nonzero().flatten()
    if misplaced.numel():
        i = int(misplaced[0])
        raise ValueError(
            f"{what}: last_loc[{i}] must be a slot at offset {int(pre[i] % p) - 1} of its page "
            f"(prefix length {int(pre[i])}, page_size {p}), got {int(last[i])}"
        )


# --- 3. arguments against the bookkeeping (validate) --------------------------------------------------


def continuations_against_state(
    what: str,
    last: torch.Tensor,
    pre: torch.Tensor,
    seq: torch.Tensor,
    owners_at: torch.Tensor,
    page_free_at: torch.Tensor,
    page_size: int,
) -> None:
    """Host tensors, after ``last_loc_arguments`` passed: ``owners_at [B, page_size]`` holds the owner
    counts of slots ``last_loc[i] .. last_loc[i] + page_size - 1``, ``page_free_at [B]`` whether
    ``last_loc[i]``'s page is free. A request continuing its page must start after a held slot on a held
    page, onto slots nobody holds, and no two requests may continue onto the same slot."""
    p = page_size
    n_cont = (torch.minimum(seq, ceil_div(pre, p) * p) - pre).clamp(min=0)  # slots continuing the page
    continues = n_cont > 0
    bad = (continues & page_free_at).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        s = int(last[i])
        raise ValueError(
            f"{what}: last_loc[{i}] must be on a page this allocator has handed out, got slot {s} "
            f"(page {s // p}, which is not held)"
        )
    bad = (continues & (owners_at[:, 0] == 0)).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(
            f"{what}: last_loc[{i}] must be the request's last slot, which is handed out, got slot "
            f"{int(last[i])}, which is not handed out"
        )
    new = torch.arange(p - 1)[None, :] < n_cont[:, None]  # [B, p - 1]: which following slots it takes
    taken = (new & (owners_at[:, 1:] > 0)).nonzero()
    if taken.numel():
        i, j = int(taken[0, 0]), int(taken[0, 1])
        raise ValueError(
            f"{what}: request {i} would continue on slot {int(last[i]) + 1 + j}, which is already handed out; "
            f"last_loc[{i}] must be the request's last slot, got {int(last[i])}"
        )
    slots = (last[:, None] + 1 + torch.arange(p - 1)[None, :])[new]
    reqs = torch.arange(last.numel())[:, None].expand_as(new)[new]
    ordered, order = torch.sort(slots, stable=True)
    twice = (ordered[1:] == ordered[:-1]).nonzero().flatten()
    if twice.numel():
        k = int(twice[0])
        i, j = int(reqs[order[k]]), int(reqs[order[k + 1]])
        raise ValueError(
            f"{what}: requests {i} and {j} would both continue on slot {int(ordered[k])}; each request's "
            f"last_loc must be its own last slot, got last_loc[{i}] = {int(last[i])} and "
            f"last_loc[{j}] = {int(last[j])}"
        )


def bad_free(slot: int, position: int, page_size: int, num_slots: int, freed_before: Optional[bool]) -> ValueError:
    """The error for freeing ``slot`` (at ``position`` of ``free_index``), which is not held;
    ``freed_before`` tells a double free from a never-allocated slot (None: unknown)."""
    p = page_size
    if slot == 0:
        why = "which is the padding slot 0, never handed out"
    elif 0 < slot < p:
        why = f"which is on the reserved page 0 (slots 0..{p - 1}), never handed out"
    elif slot < 0 or slot >= num_slots:
        why = f"which is outside the handed-out range {p}..{num_slots - 1}"
    elif freed_before:
        why = "which was already freed (a double free)"
    else:
        why = "which was never allocated"
    return ValueError(
        f"free_index must hold slots that are handed out and not yet freed, got slot {slot} at position "
        f"{position}, {why}"
    )


def listed_twice(slots: torch.Tensor) -> Optional[int]:
    """A slot that ``slots`` lists more than once, or None."""
    ordered = torch.sort(slots).values
    dups = ordered[1:][ordered[1:] == ordered[:-1]]
    return int(dups[0]) if dups.numel() else None


def held_once(slots: torch.Tensor, owners: torch.Tensor, ever: Optional[torch.Tensor], page_size: int) -> torch.Tensor:
    """Under validate: ``slots`` (a free's, int64 on the bookkeeping's device), each held (``owners``)
    and listed once, else ``ValueError`` naming the first that is not (reads the device); ``ever``
    (slots ever handed out) tells a double free from a slot never allocated."""
    p = page_size
    n_slots = owners.numel()
    ok = (slots >= p) & (slots < n_slots) & (owners[slots.clamp(0, n_slots - 1)] > 0)
    if not bool(ok.all()):
        i = int((~ok).nonzero()[0])
        s = int(slots[i])
        freed_before = bool(ever[s]) if ever is not None and 0 <= s < n_slots else None
        raise bad_free(s, i, p, n_slots, freed_before)
    dup = listed_twice(slots)
    if dup is not None:
        raise ValueError(f"free_index must list each slot once, got slot {dup} more than once (a double free)")
    return slots
