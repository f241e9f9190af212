"""``PagedTokenToKVPoolAllocator``: the page allocator with SGLang's ``alloc_extend`` and
``alloc_decode``, which continue each request's last partial page before taking fresh ones, and
``alloc_extend_naive``, that slot computation on its own under SGLang's name for it.

The rules users rely on are in docs/contract.md, "Allocators and the request table".
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from kvpool.checks import positive_int, resolve_device
from kvpool.kernels.allocator import launcher as allocator_kernels
from kvpool.pools.allocator import checks
from kvpool.pools.allocator.base import BaseTokenToKVPoolAllocator, CopiesThroughKVCache
from kvpool.pools.allocator.checks import ceil_div


class PagedTokenToKVPoolAllocator(CopiesThroughKVCache, BaseTokenToKVPoolAllocator):
    """Hands out KV-cache slots a page at a time: pages ``1..size // page_size`` of ``page_size``
    slots; page 0 (slots ``0..page_size-1``, the padding slot among them) is never handed out.

    A request's slots fill its pages in order, so ``alloc_extend``/``alloc_decode`` continue its last
    partial page before taking a fresh one. A page returns to the free list only once every slot
    handed out from it has been freed.

    Parameters
    ----------
    size : slots to manage (the pool's ``size``); ``size // page_size`` pages are handed out.
    page_size : slots per page (the pool's ``page_size``).
    dtype, device, kvcache, need_sort, validate : as for ``BaseTokenToKVPoolAllocator``.

    Examples
    --------
    >>> a = PagedTokenToKVPoolAllocator(64, page_size=4)
    >>> one = torch.tensor([1])
    >>> a.alloc_extend(0 * one, 0 * one, 3 * one, 3 * one, -one, 3)  # a 3-token prompt, on page 1
    tensor([4, 5, 6])
    >>> # that request grows from 3 to 5 tokens (its last slot is 6); a new one brings 2 tokens
    >>> a.alloc_extend(torch.tensor([3, 0]), torch.tensor([3, 0]), torch.tensor([5, 2]),
    ...                torch.tensor([5, 2]), torch.tensor([6, -1]), 4)
    tensor([ 7,  8, 12, 13])
    >>> a.alloc_decode(torch.tensor([6, 3]), torch.tensor([6, 3]), torch.tensor([8, 13]))
    tensor([ 9, 14])
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: Optional[torch.dtype] = None,
        device: str | torch.device = "cpu",
        kvcache: Any = None,
        need_sort: bool = False,
        *,
        validate: bool = False,
    ) -> None:
        super().__init__(size, page_size, dtype, device, kvcache, need_sort, validate=validate)

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
    ) -> Optional[torch.Tensor]:
        """Slots for extending each request from ``prefix_lens[i]`` to ``seq_lens[i]`` tokens.

        Request i's new tokens first fill its last partial page (slots ``last_loc[i] + 1``, ...),
        then whole fresh pages, then the first slots of one more fresh page. Fresh pages are taken
        from the free list in request order.

        Parameters
        ----------
        prefix_lens, seq_lens : Tensor [B], int, on ``device``: tokens already held / held after.
        prefix_lens_cpu, seq_lens_cpu : the same values on the CPU (they size the allocation
            without a device synchronisation).
        last_loc : Tensor [B], int, on ``device``: slot of each request's last held token (any value,
            conventionally -1, when ``prefix_lens[i]`` is a multiple of ``page_size``).
        extend_num_tokens : ``sum(seq_lens - prefix_lens)``.

        Returns
        -------
        Tensor [extend_num_tokens] int64 on ``device``, request after request; or None, changing
        nothing, when too few pages are free.

        Raises
        ------
        ValueError
            On inconsistent lengths (the device ones checked against the CPU ones on a CPU allocator
            or under ``validate``); when a continuing request's ``last_loc`` is at the wrong page
            offset (same condition); under ``validate`` also when a continuation does not start after
            a held slot of a held page, runs onto a held slot, or meets another request's. Nothing
            changes.
        IndexError
            When a continuing request's ``last_loc`` is outside the slot range (same condition as
            the offset).
        """
        checks.request_vectors(
            (prefix_lens_cpu, seq_lens_cpu), ("prefix_lens_cpu", "seq_lens_cpu"),
            (prefix_lens, seq_lens, last_loc), ("prefix_lens", "seq_lens", "last_loc"), self.device,
        )  # fmt: skip
        pre_c = checks.as_int64(prefix_lens_cpu)
        seq_c = checks.as_int64(seq_lens_cpu)
        p = self.page_size
        total, fresh = checks.extend_lengths(pre_c, seq_c, extend_num_tokens, p)
        kernel = allocator_kernels.on_kernels(self.device)
        if kernel and not (self.validate or self._cheap_device_checks):  # the kernel reads any integer dtype
            pre, seq, last = prefix_lens, seq_lens, last_loc
        else:
            pre, seq, last = checks.as_int64(prefix_lens), checks.as_int64(seq_lens), checks.as_int64(last_loc)
            self._check_batch("alloc_extend", pre, seq, last, pre_c, seq_c)

        take = self._plan_take(fresh)
        if take is None:
            return None
        if total == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        if kernel:
            return self._hand_out_on_kernel(take, total, allocator_kernels.EXTEND, (pre, seq, last))
        out = _extend_slots(take.pages, pre, seq, last, total, p)
        self._hand_out(take, out, inside_range=False)
        return out

    def alloc_decode(
        self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor
    ) -> Optional[torch.Tensor]:
        """One slot per request for its next token: ``last_loc[i] + 1`` when that is on the same page,
        else the first slot of a fresh page (fresh pages are taken in request order).

        Parameters
        ----------
        seq_lens : Tensor [B], int, on ``device``: tokens each request holds after this step
            (so the new token is at position ``seq_lens[i] - 1``).
        seq_lens_cpu : the same values on the CPU.
        last_loc : Tensor [B], int, on ``device``: slot of each request's last held token.

        Returns
        -------
        Tensor [B] int64 on ``device``, or None, changing nothing, when too few pages are free.

        Raises
        ------
        ValueError, IndexError
            As ``alloc_extend``, with ``seq_lens - 1`` as the prefix lengths. Nothing changes.
        """
        bs = checks.request_vectors(
            (seq_lens_cpu,), ("seq_lens_cpu",), (seq_lens, last_loc), ("seq_lens", "last_loc"), self.device
        )  # fmt: skip
        seq_c = checks.as_int64(seq_lens_cpu)
        p = self.page_size
        fresh = checks.decode_lengths(seq_c, p)
        kernel = allocator_kernels.on_kernels(self.device)
        if kernel and not (self.validate or self._cheap_device_checks):  # the kernel reads any integer dtype
            seq, last = seq_lens, last_loc
        else:
            seq, last = checks.as_int64(seq_lens), checks.as_int64(last_loc)
            self._check_batch("alloc_decode", None, seq, last, None, seq_c)

        take = self._plan_take(fresh)
        if take is None:
            return None
        if bs == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        if kernel:
            return self._hand_out_on_kernel(take, bs, allocator_kernels.DECODE, (seq, seq, last))
        out = last + 1
        if take.pages.numel():
            starts = (seq - 1) % p == 0
            rank = (torch.cumsum(starts, 0) - 1).clamp(0, take.pages.numel() - 1)
            out = torch.where(starts, take.pages[rank] * p, out)
        self._hand_out(take, out, inside_range=False)
        return out

    def _check_batch(
        self,
        what: str,
        pre: Optional[torch.Tensor],
        seq: torch.Tensor,
        last: torch.Tensor,
        pre_c: Optional[torch.Tensor],
        seq_c: torch.Tensor,
    ) -> None:
        """Device arguments against each other (on a CPU allocator or under validate) and against the
        bookkeeping (under validate), reading the device once. ``pre``/``pre_c`` are None for decode,
        whose prefix lengths are ``seq_lens - 1``."""
        if not (self.validate or self._cheap_device_checks):
            return
        given_pre = pre is not None
        if pre is None or pre_c is None:
            pre, pre_c = seq - 1, seq_c - 1
        p = self.page_size
        bs = pre.numel()
        if self.validate:
            n_slots = self._owners.numel()
            at = (last[:, None] + self._slot_offsets).clamp(0, n_slots - 1)  # last_loc and the slots after it
            host = torch.cat(
                (pre, seq, last, self._owners[at].reshape(-1).to(torch.int64),
                 self._page_free[at[:, 0] // p].to(torch.int64))
            ).cpu()  # fmt: skip
            pre, seq, last, owners_at, page_free_at = host.split([bs, bs, bs, bs * p, bs])
        if given_pre:
            checks.same_as_cpu(pre, pre_c, "prefix_lens")
        checks.same_as_cpu(seq, seq_c, "seq_lens")
        checks.last_loc_arguments(what, last, pre, seq, p, self._owners.numel())
        if self.validate:
            checks.continuations_against_state(
                what, last, pre, seq, owners_at.view(bs, p), page_free_at.bool(), p
            )


def _extend_slots(
    pages: torch.Tensor, pre: torch.Tensor, seq: torch.Tensor, last: torch.Tensor, total: int, page_size: int
) -> torch.Tensor:
    """The ``total`` slots of an extension (``total >= 1``), fresh pages taken from ``pages`` in
    request order, on ``pre``'s device.

    Every index is clamped into its tensor, so device lengths that disagree with the CPU ones
    (unchecked on a GPU without validate) give wrong slots, never an error or an out-of-bounds
    read; the request of each output token comes from ``searchsorted`` rather than
    ``repeat_interleave``, which fails (a device assert on CUDA) when the lengths disagree.
    """
    p = page_size
    ext = seq - pre
    held = ceil_div(pre, p)  # pages each request holds already (the last one maybe partial)
    new_pages = ceil_div(seq, p) - held
    first_page = torch.cumsum(new_pages, 0) - new_pages  # index into `pages` per request
    ends = torch.cumsum(ext, 0)
    t = torch.arange(total, device=pre.device)
    req = torch.searchsorted(ends, t, right=True).clamp_(max=pre.numel() - 1)
    k = t - (ends - ext)[req]  # offset in the request's extension
    pos = pre[req] + k  # token position in its sequence
    out = last[req] + 1 + k
    if pages.numel():
        rank = (first_page[req] + pos // p - held[req]).clamp(0, pages.numel() - 1)
        out = torch.where(pos < held[req] * p, out, pages[rank] * p + pos % p)
    return out


def alloc_extend_naive(
    prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
    free_pages: torch.Tensor,
    out_indices: torch.Tensor,
    page_size: int,
    device: str | torch.device,
) -> None:
    """SGLang's plain-PyTorch ``alloc_extend`` step, on its own: write into ``out_indices`` the slots
    that extend each request from ``prefix_lens[i]`` to ``seq_lens[i]`` tokens, taking fresh pages
    from the front of ``free_pages`` in request order.

    Request i's new tokens first fill its last partial page (slots ``last_loc[i] + 1``, ...), then
    whole fresh pages, then the first slots of one more fresh page, exactly as
    ``PagedTokenToKVPoolAllocator.alloc_extend`` hands them out. Nothing else changes: the caller
    removes the ``sum(ceil(seq_lens / page_size) - ceil(prefix_lens / page_size))`` pages it used from
    its free list. It reads the lengths to the host (one synchronisation on a GPU).

    Parameters
    ----------
    prefix_lens, seq_lens, last_loc : Tensor [B], integer, on ``device``.
    free_pages : Tensor [F], integer page ids, on ``device``.
    out_indices : Tensor [sum(seq_lens - prefix_lens)], integer, on ``device``; written in place.
    page_size : slots per page.
    device : where the tensors live.

    Raises
    ------
    ValueError
        Before writing anything, where SGLang's helper checks nothing: tensors that are not 1-D
        integer tensors on ``device``, lengths that differ, ``prefix_lens`` negative or above
        ``seq_lens``, ``out_indices`` of another length, or too few ``free_pages``.
    """
    p = positive_int(page_size, "page_size")
    dev = resolve_device(device)
    bs = prefix_lens.shape[0] if isinstance(prefix_lens, torch.Tensor) and prefix_lens.dim() == 1 else 0
    for t, name in ((prefix_lens, "prefix_lens"), (seq_lens, "seq_lens"), (last_loc, "last_loc")):
        checks.device_vector(t, name, bs, dev)
    for t, name in ((free_pages, "free_pages"), (out_indices, "out_indices")):
        checks.device_vector(t, name, None, dev)  # any length
    pre_c, seq_c = prefix_lens.to("cpu", torch.int64), seq_lens.to("cpu", torch.int64)
    bad = ((pre_c < 0) | (seq_c < pre_c)).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(
            f"prefix_lens[{i}] must be in 0..seq_lens[{i}] = {int(seq_c[i])}, got {int(pre_c[i])}"
        )
    total = int((seq_c - pre_c).sum())
    if out_indices.shape[0] != total:
        raise ValueError(f"out_indices must have sum(seq_lens - prefix_lens) = {total} entries, got {out_indices.shape[0]}")
    needed = int((ceil_div(seq_c, p) - ceil_div(pre_c, p)).sum())
    if needed > free_pages.shape[0]:
        raise ValueError(f"free_pages must hold the {needed} pages this extension takes, got {free_pages.shape[0]}")
    if total == 0:
        return
    pre, seq = prefix_lens.to(torch.int64), seq_lens.to(torch.int64)
    out = _extend_slots(free_pages[:needed].to(torch.int64), pre, seq, last_loc.to(torch.int64), total, p)
    out_indices.copy_(out)
