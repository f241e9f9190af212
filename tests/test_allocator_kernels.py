"""The allocators' bookkeeping kernels (one launch per call on CUDA): every call on the kernel path
returns what the PyTorch path returns and leaves the same bookkeeping, call after call, for the
token and paged allocators, with and without ``need_sort`` and ``validate``, free groups, backups,
bad frees and extensions that continue onto slots nobody holds; device lengths that disagree with
the host's (unchecked on a GPU without validate) write every output and touch nothing outside the
bookkeeping; both kernels compile for every GPU target.

``cpu-kernel`` runs the kernels through Triton's interpreter on CPU allocators; ``cuda-kernel`` the
compiled kernels on a GPU. The reference is always a CPU allocator on the PyTorch path.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvassert import counts_copied_back, cross_compile, swa_allocator_snapshot, swa_as_on_gpu
from kvpool.kernels.allocator import launcher as allocator_kernels
from kvpool import SWATokenToKVPoolAllocator
from kvpool.pools.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator


@pytest.fixture(params=["cpu-kernel", pytest.param("cuda-kernel", marks=pytest.mark.gpu)])
def kernel_device(request, monkeypatch):
    """The device of the allocator under test, on the kernel path (the interpreter's on the CPU)."""
    dev = request.param.split("-")[0]
    if dev == "cpu":
        if not allocator_kernels.kernel is not None or not _interpreter():
            pytest.skip("the kernels on CPU tensors need TRITON_INTERPRET=1")
        monkeypatch.setattr(allocator_kernels, "kernel_on_cpu", True)
    return dev


def _interpreter() -> bool:
    from kvpool.kernels.launch import INTERPRETER

    return INTERPRETER


def _books(a) -> list[torch.Tensor]:
    s = a.backup_state()
    tensors = [s.free_pages, s.release_pages, s.owners, s.live, s.page_free, s.unrecorded, *s.free_group]
    return [t.cpu() for t in tensors]


class Twins:
    """The same allocator twice, one under test (``device``, kernel path) and one reference (CPU,
    PyTorch path); ``call`` makes the same call on both and compares results and bookkeeping."""

    def __init__(self, device: str, page: int, token: bool, need_sort: bool, validate: bool, pages: int = 12) -> None:
        def make(dev):
            if token:
                return TokenToKVPoolAllocator(pages, device=dev, need_sort=need_sort, validate=validate)
            return PagedTokenToKVPoolAllocator(pages * page, page, device=dev, need_sort=need_sort, validate=validate)

        self.device, self.page = device, page
        with torch.device("cpu"):
            self.ref = make("cpu")
        self.dut = make(device)

    def call(self, what: str, fn) -> object:
        results = []
        for a, dev, kernel in ((self.ref, "cpu", False), (self.dut, self.device, True)):
            allocator_kernels.kernel_on_cpu, saved = kernel and dev == "cpu", allocator_kernels.kernel_on_cpu
            try:
                results.append(_outcome(lambda: fn(a, dev)))
            finally:
                allocator_kernels.kernel_on_cpu = saved
        want, got = results
        assert got == want, f"{what}: the kernel path gave {got}, the PyTorch path {want}"
        for i, (w, g) in enumerate(zip(_books(self.ref), _books(self.dut))):
            assert torch.equal(w, g), f"{what}: bookkeeping entry {i} differs: {g.tolist()} != {w.tolist()}"
        assert self.dut.available_size() <= self.ref.available_size()
        self.dut.errors()
        assert self.dut.available_size() == self.ref.available_size(), what
        assert self.dut.errors() == self.ref.errors(), what
        return want


def _outcome(fn) -> object:
    try:
        out = fn()
    except (ValueError, IndexError) as exc:
        return type(exc).__name__, str(exc)
    return out.tolist() if isinstance(out, torch.Tensor) else out


def _random_calls(tw: Twins, rng: random.Random, steps: int) -> None:
    p, dut = tw.page, tw.dut
    paged = isinstance(dut, PagedTokenToKVPoolAllocator)
    n_slots = (dut.num_pages + 1) * p
    for step in range(steps):
        op = rng.choice(["alloc", "alloc", "extend", "decode", "free", "free", "bad free", "group", "backup"])
        what = f"step {step}: {op}"
        dtype = rng.choice([torch.int64, torch.int32])
        if op == "alloc":
            n = rng.randint(0, 3) * p
            tw.call(f"{what}({n})", lambda a, d: a.alloc(n))
        elif op == "extend" and paged:
            reqs = []
            for _ in range(rng.randint(1, 3)):
                pre = rng.randint(0, 2 * p)
                seq = pre + rng.randint(0, 2 * p)
                last = -1 if pre % p == 0 else rng.randint(1, dut.num_pages) * p + pre % p - 1
                reqs.append((pre, seq, last))
            pre, seq, last = ([r[i] for r in reqs] for i in range(3))
            total = sum(seq) - sum(pre)

            def extend(a, d):
                on = lambda xs: torch.tensor(xs, dtype=dtype, device=d)  # noqa: E731
                return a.alloc_extend(on(pre), torch.tensor(pre), on(seq), torch.tensor(seq), on(last), total)

            tw.call(f"{what}{reqs}", extend)
        elif op == "decode" and paged:
            seq = [rng.randint(1, 3 * p) for _ in range(rng.randint(1, 4))]
            last = [rng.randint(1, dut.num_pages) * p + (s - 2) % p for s in seq]

            def decode(a, d):
                on = lambda xs: torch.tensor(xs, dtype=dtype, device=d)  # noqa: E731
                return a.alloc_decode(on(seq), torch.tensor(seq), on(last))

            tw.call(f"{what}{seq, last}", decode)
        elif op == "free":
            held = tw.ref.backup_state().owners.nonzero().flatten().tolist()
            rng.shuffle(held)
            chosen = held[: rng.randint(0, len(held))]
            tw.call(f"{what}({chosen})", lambda a, d: a.free(torch.tensor(chosen, dtype=dtype, device=d)))
        elif op == "bad free" and not dut.validate:
            chosen = [rng.randint(-3, n_slots + 2 * p) for _ in range(rng.randint(1, 6))]
            skip = rng.random() < 0.5
            tw.call(f"{what}({chosen}, skip_padding={skip})", lambda a, d: a.free(torch.tensor(chosen, device=d), skip_padding=skip))
        elif op == "group":
            end = rng.random() < 0.5
            tw.call(f"{what} end={end}", lambda a, d: a.free_group_end() if end else a.free_group_begin())
        elif op == "backup":
            n = rng.randint(0, 2) * p

            def backup_alloc_restore(a, d):
                state = a.backup_state()
                out = a.alloc(n)
                a.restore_state(state)
                return out

            tw.call(f"{what}({n})", backup_alloc_restore)


@pytest.mark.parametrize("page,token", [(1, True), (1, False), (4, False)])
@pytest.mark.parametrize("need_sort", [False, True])
@pytest.mark.parametrize("validate", [False, True])
def test_every_call_on_the_kernel_path_matches_the_pytorch_path(kernel_device, page, token, need_sort, validate):
    for seed in range(3):
        tw = Twins(kernel_device, page, token, need_sort, validate)
        _random_calls(tw, random.Random(seed * 7 + page), 30)


@pytest.mark.parametrize("page", [1, 4])
def test_wide_batches_match_the_pytorch_path_across_programs_and_request_chunks(kernel_device, page):
    """Batches wider than the hand-out kernel's chunks of requests, and allocations that span many of
    its programs: prefills of mixed lengths (empty ones, one token, many pages), continuations of
    one to a few tokens each (as speculative decoding extends), then a decode step of every request."""
    rng = random.Random(page)
    bs = allocator_kernels.HAND_OUT_REQ_BLOCK * 2 + 37
    first = [rng.choice([0, 1, 2, 3, 5, 17, page * 9 + 1, 160]) for _ in range(bs)]
    more = [rng.choice([0, 1, 2, 4]) for _ in range(bs)]
    pages = sum(-(-(a + b + 1) // page) for a, b in zip(first, more)) + 8
    tw = Twins(kernel_device, page, False, False, False, pages=pages)

    def extend(pre, seq, last):
        def call(a, d):
            on = lambda xs: torch.tensor(xs, dtype=torch.int64, device=d)  # noqa: E731
            return a.alloc_extend(on(pre), torch.tensor(pre), on(seq), torch.tensor(seq), on(last), sum(seq) - sum(pre))

        return call

    def last_slots(out, pre, seq, before):
        ends = [sum(s - p for p, s in zip(pre[: i + 1], seq[: i + 1])) for i in range(len(seq))]
        return [out[e - 1] if s > p else b for e, p, s, b in zip(ends, pre, seq, before)]

    zeros = [0] * bs
    out = tw.call("prefill", extend(zeros, first, [-1] * bs))
    last = last_slots(out, zeros, first, [-1] * bs)
    seq = [a + b for a, b in zip(first, more)]
    out = tw.call("continuation", extend(first, seq, last))
    last = last_slots(out, first, seq, last)
    step = [s + 1 for s in seq]
    tw.call("decode", lambda a, d: a.alloc_decode(torch.tensor(step, device=d), torch.tensor(step), torch.tensor(last, device=d)))


@pytest.mark.parametrize("page,token,need_sort", [(1, True, False), (4, False, False), (4, False, True)])
def test_a_free_copies_its_counts_back_itself(kernel_device, monkeypatch, page, token, need_sort):
    """With counts copied back rather than read (a GPU allocator without validate), the give-back
    kernel writes the counters to the host mirror itself: a free launches no copy after it, and the
    counts the host folds in match the PyTorch path's, call after call."""
    from kvpool.pools.allocator.count_mirror import CountMirror

    tw = Twins(kernel_device, page, token, need_sort, False)
    if kernel_device == "cpu":
        counts_copied_back(tw.dut)
    copies = []
    queue = CountMirror.queue
    monkeypatch.setattr(CountMirror, "queue", lambda self, *args: copies.append(1) or queue(self, *args))
    tw.call("alloc", lambda a, d: a.alloc(3 * page))
    slots = tw.dut.backup_state().owners.nonzero().flatten().tolist()
    before = len(copies)
    tw.call("free", lambda a, d: a.free(torch.tensor(slots[:page] + [0, slots[0]], device=d)))
    assert len(copies) == before, "a free launched a copy of its counts"
    assert tw.dut.rejected_frees == tw.ref.rejected_frees == 2
    _random_calls(tw, random.Random(page), 30)


@pytest.mark.gpu
def test_a_token_free_of_device_slots_launches_the_kept_kernel_and_keeps_the_pytorch_paths_books(monkeypatch):
    """Once a free of a size has compiled the give-back kernel, a token allocator's free of int64
    device slots launches it directly with its kept arguments (``RingFrees``); what that leaves
    (results, bookkeeping, counts, rejected frees) is the PyTorch path's, call after call, through
    the free list's moves to fresh buffers and restored backups."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: the kept launch is of the compiled kernel")
    direct = []
    launch = allocator_kernels.RingFrees.launch
    monkeypatch.setattr(allocator_kernels.RingFrees, "launch", lambda self, *a: direct.append(launch(self, *a)) or direct[-1])
    tw = Twins("cuda", 1, True, False, False)
    for step in range(40):
        out = tw.call(f"alloc {step}", lambda a, d: a.alloc(4))
        if out is not None:
            tw.call(f"free {step}", lambda a, d: a.free(torch.tensor(out[::-1] + out[:1], device=d)))  # a repeat: rejected
    _random_calls(tw, random.Random(7), 60)
    assert True in direct, "no free took the kept launch"


@pytest.mark.parametrize("page", [1, 4])
def test_a_sliding_window_free_is_one_launch_that_matches_the_pytorch_path(kernel_device, monkeypatch, page):
    """A sliding-window allocator's SWA part frees full slots through the mapping in one launch of the
    give-back kernel (translated, freed with unmapped entries skipped, mapping cleared), with what
    the PyTorch path leaves in both parts and the mapping, call after call: repeats, unmapped and
    out-of-range entries, padding, frees inside a free group."""
    import kvpool.pools.allocator.swa as swa_module

    def make(dev):
        a = SWATokenToKVPoolAllocator(24 * page, 12 * page, page, None, dev)
        return swa_as_on_gpu(a) if dev == "cpu" else a

    ref, dut = make("cpu"), make(kernel_device)
    calls = []  # ("mapped" | "plain" | "translate") of the allocator under test
    give_back, translate = allocator_kernels.give_back, swa_module.translate_slots

    def counted_give_back(*args, **kwargs):
        calls.append("mapped" if kwargs.get("mapping") is not None else "plain")
        return give_back(*args, **kwargs)

    def counted_translate(*args):
        calls.append("translate")
        return translate(*args)

    def counted_kept_launch(frees, *args):  # a full part's free through its kept launch is a plain one
        launched = kept_launch(frees, *args)
        if launched:
            calls.append("plain")
        return launched

    kept_launch = allocator_kernels.RingFrees.launch
    monkeypatch.setattr(allocator_kernels, "give_back", counted_give_back)
    monkeypatch.setattr(allocator_kernels.RingFrees, "launch", counted_kept_launch)
    monkeypatch.setattr(swa_module, "translate_slots", counted_translate)
    rng = random.Random(page)
    n_full = (24 + 1) * page
    for step in range(40):
        op = rng.choice(["alloc", "alloc", "free_swa", "free_swa", "free", "group"])
        held = ref.full_attn_allocator.backup_state().owners.nonzero().flatten().tolist()
        chosen = rng.sample(held, rng.randint(0, len(held))) + [rng.randint(-2, n_full + 3) for _ in range(rng.randint(0, 3))]
        chosen += chosen[:1]
        n = rng.randint(0, 3) * page
        finished = held[: rng.randint(1, len(held))] if held else []
        for a, dev in ((ref, "cpu"), (dut, kernel_device)):
            allocator_kernels.kernel_on_cpu = a is dut and dev == "cpu"
            calls.clear()
            try:
                if op == "alloc":
                    a.alloc(n)
                elif op == "free_swa" and chosen:
                    a.free_swa(torch.tensor(chosen, device=dev))
                    if a is dut:
                        assert calls == ["mapped"], f"step {step}: free_swa made {calls}"
                elif op == "free" and finished:
                    a.free(torch.tensor(finished, device=dev))
                    if a is dut:
                        assert calls == ["plain", "mapped"], f"step {step}: free made {calls}"
                elif op == "group":
                    a.free_group_end() if step % 2 else a.free_group_begin()
            finally:
                allocator_kernels.kernel_on_cpu = False
        assert swa_allocator_snapshot(dut) == swa_allocator_snapshot(ref), f"step {step}: {op}"
        assert dut.errors() == ref.errors(), f"step {step}: {op}"


@pytest.mark.parametrize("sorted_by", ["the kernel", "torch.sort"])
def test_a_large_free_crosses_blocks_and_keeps_pages_in_order(kernel_device, monkeypatch, sorted_by):
    """More entries than one step of the give-back program, a page's slots split across two steps,
    in shuffled order with repeats, sorted by the kernel itself or (more than it sorts) by
    ``torch.sort`` first: the released pages come out ascending, as on the PyTorch path."""
    monkeypatch.setattr(allocator_kernels, "GIVE_BACK_BLOCK", 16)
    if sorted_by == "torch.sort":
        monkeypatch.setattr(allocator_kernels, "GIVE_BACK_SORT_MAX", 32)
    tw = Twins(kernel_device, 4, False, False, False, pages=20)
    tw.call("alloc", lambda a, d: a.alloc(80))
    order = list(range(4, 84))
    random.Random(3).shuffle(order)
    order += order[:5]
    tw.call("free", lambda a, d: a.free(torch.tensor(order, device=d)))
    assert tw.dut.free_pages.tolist() == list(range(1, 21))


@pytest.mark.parametrize("kind", ["extend", "decode"])
def test_device_lengths_that_disagree_with_the_host_write_every_output_and_stay_in_bounds(kernel_device, kind):
    """The kernel given lengths whose sums are not the host's: every output entry is written, every
    page read comes from the pages taken, and slots outside the handed-out range are counted in
    ``unrecorded`` instead of recorded."""
    dev = kernel_device
    p, pages = 4, 6
    n_slots = (pages + 1) * p
    ring = torch.tensor([3, 5, 2, 6], dtype=torch.int64, device=dev)
    owners = torch.zeros(n_slots, dtype=torch.int32, device=dev)
    live = torch.zeros(pages + 1, dtype=torch.int32, device=dev)
    page_free = torch.ones(pages + 1, dtype=torch.bool, device=dev)
    unrecorded = torch.zeros((), dtype=torch.int64, device=dev)
    on = lambda xs: torch.tensor(xs, dtype=torch.int64, device=dev)  # noqa: E731
    # The host sized 9 outputs and 2 pages; the device's lengths say other things (negative
    # extensions, continuations off the pool's end, a prefix longer than the sequence).
    pre, seq, last = on([0, 7, 30]), on([12, 3, 41]), on([-1, 1000, -50])
    out = torch.full((9,), -7, dtype=torch.int64, device=dev)
    kind_id = allocator_kernels.EXTEND if kind == "extend" else allocator_kernels.DECODE
    allocator_kernels.hand_out(out, ring, 1, 4, 2, (pre, seq, last), owners, live, page_free, None, unrecorded, p, kind_id)
    got = out.cpu()
    assert (got != -7).all(), f"outputs left unwritten: {got.tolist()}"
    recorded = int(owners.sum())
    inside = int(((got >= p) & (got < n_slots)).sum())
    assert recorded == inside and int(live.sum()) == inside
    assert int(unrecorded) == got.numel() - inside
    taken = [5, 2]
    assert page_free.cpu().tolist() == [i not in taken for i in range(pages + 1)]
    fresh = got[(got >= p) & (got < n_slots)] // p
    assert set(fresh.tolist()) <= set(taken) | set((((last.cpu() + 1).clamp(0) + torch.arange(20)[:, None]) // p).flatten().tolist())


def test_the_bookkeeping_kernels_compile_for_every_target():
    """Every kind the launchers make compiles for Hopper (the interpreter would not notice a construct
    the compiler rejects), and the common kinds for every other target."""
    compiled = cross_compile("--allocator")
    assert {v["target"] for v in compiled} == {"sm90", "sm100", "sm80", "gfx942"}
    hopper = {(v["kernel"], *v["consts"][1:4]) for v in compiled if v["target"] == "sm90" and v["consts"][0] == 64}
    hand_outs = {("hand_out", kind, ever, allocator_kernels.HAND_OUT_BLOCK) for kind in (0, 1, 2) for ever in (False, True)}
    give_backs = {("give_back", dest, to, append) for dest, to in ((0, 0), (1, 1), (1, -1)) for append in (False, True)}
    assert hopper == hand_outs | give_backs
    sorts = {v["consts"][5] for v in compiled if v["kernel"] == "give_back" and v["target"] == "sm90"}
    assert sorts == {0, 16, allocator_kernels.GIVE_BACK_SORT_MAX}
    # Every hand-out kind keeps its values in registers on Hopper: a kernel that spills runs its
    # arithmetic through memory, on every scheduler step.
    spilling = [v for v in compiled if v["target"] == "sm90" and v["kernel"] == "hand_out" and v["spill_bytes"] > 0]
    assert not spilling, spilling


@pytest.mark.parametrize("view", ["a table's column", "an expand", "every other entry"])
def test_strided_views_free_and_extend_what_they_name(kernel_device, view):
    """Index and length tensors that are views with strides (a column of a table, a stride-0 expand,
    a slice with a step): the kernels read the entries the views name, as the PyTorch path does."""
    tw = Twins(kernel_device, 4, False, False, False, pages=16)
    tw.call("alloc", lambda a, d: a.alloc(16))

    def strided(d):
        held = torch.arange(4, 20, device=d)
        if view == "a table's column":
            return torch.stack((held, held + 100), 1)[:6, 0]
        if view == "an expand":
            return held[5:6].expand(3)
        return held[::2]

    tw.call(f"free of {view}", lambda a, d: a.free(strided(d)))
    seq_c = torch.tensor([3, 5, 2])
    seq_rows = torch.tensor([3, 7, 5, 7, 2, 7])

    def extend(a, d):
        z = torch.zeros(3, dtype=torch.int64, device=d)
        return a.alloc_extend(z, z.cpu(), seq_rows.to(d)[::2], seq_c, torch.full((3,), -1, device=d), 10)

    tw.call("alloc_extend with strided seq_lens", extend)
