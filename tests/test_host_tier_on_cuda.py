"""The host tier on a GPU (skipped without a CUDA device): both backends and layouts against the
device bytes, bit-identical backends, pinned buffers, the kernel backend's capped grid, no host
synchronisation, ordering of transfers that share host pages, layer waits (also in a CUDA graph and
after a failed background load), padding device indices and the frames down to a launch.
"""

from __future__ import annotations

import pytest
import torch
from kvassert import HOST_BACKENDS, HOST_LAYOUTS, assert_same_bytes, frames_up_to, gpu, no_sync, random_cuda_pool

from kvpool.kernels.copy_rows import launcher as C
from kvpool.host import MHATokenToKVPoolHost


# --- on a GPU: both backends and layouts against the device bytes, bit-identical backends, pinned
# buffers, the kernel backend's capped grid, no host synchronisation, ordering of transfers that share
# host pages, and the layer-wait path (eagerly, with the load queued by the call or by the host pool's
# worker thread, and inside a replayed CUDA graph) while later layers are still loading.


def device_pages(pool, tokens, page_size, gen) -> torch.Tensor:
    """Random whole device pages (not slot 0's page) for ``tokens`` slots, as an allocator gives."""
    pages = torch.randperm(pool.size // page_size - 1, generator=gen)[: tokens // page_size] + 1
    return (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1).to("cuda")


def host_pages(host, tokens, gen) -> torch.Tensor:
    """Whole host pages in random order."""
    slots = host.alloc(tokens)
    pages = slots.view(-1, host.page_size)
    return pages[torch.randperm(pages.shape[0], generator=gen)].reshape(-1)


def rows_of(pool, layer, which, idx):
    buf = pool.k_buffer[layer] if which == "k" else pool.v_buffer[layer]
    return buf.view(torch.uint8)[idx].cpu()


@gpu
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_backup_and_load_move_exact_bytes(layout, backend, page_size):
    if backend == "direct" and page_size == 1 and layout == "layer_first":
        tokens = 256  # one copy per token and layer: keep it short
    else:
        tokens = 4096
    gen = torch.Generator().manual_seed(page_size)
    pool = random_cuda_pool(size=16384, page_size=page_size, v_head_dim=64)
    host = MHATokenToKVPoolHost(pool, 2.0, 0, page_size, layout, staging_bytes=8 << 20)
    # Page-locked in place with cudaHostRegister (torch's is_pinned() answers only for its own
    # pinned allocator on some versions): both buffers lie inside the registered region.
    region = host._pinned
    assert host.pin_memory and region is not None
    for buf in (host.k_buffer, host.v_buffer):
        start = buf.data_ptr()
        assert region.ptr <= start and start + buf.numel() * buf.element_size() <= region.ptr + region.nbytes
    h = host_pages(host, tokens, gen)
    d = device_pages(pool, tokens, page_size, gen)
    event = host.backup_from_device_all_layer(pool, h, d, backend)
    assert isinstance(event, torch.cuda.Event)
    event.synchronize()
    for layer in range(pool.layer_num):
        hk = host.k_buffer[layer] if layout == "layer_first" else host.k_buffer[:, layer]
        hv = host.v_buffer[layer] if layout == "layer_first" else host.v_buffer[:, layer]
        assert_same_bytes(hk[h], rows_of(pool, layer, "k", d), f"host K {layer}")
        assert_same_bytes(hv[h], rows_of(pool, layer, "v", d), f"host V {layer}")
    other = random_cuda_pool(size=16384, page_size=page_size, v_head_dim=64, seed=1)
    before = [b.view(torch.uint8).cpu() for b in other.k_buffer + other.v_buffer]
    t = device_pages(other, tokens, page_size, gen)
    host.load_to_device_all_layer(other, h, t, backend)
    host.wait_for_loads()
    torch.cuda.synchronize()
    untouched = torch.ones(other.size + other.page_size, dtype=torch.bool)
    untouched[t.cpu()] = False
    for layer in range(pool.layer_num):
        for i, which in enumerate("kv"):
            assert_same_bytes(rows_of(other, layer, which, t), rows_of(pool, layer, which, d), f"{which} {layer}")
            buf = (other.k_buffer if which == "k" else other.v_buffer)[layer].view(torch.uint8).cpu()
            assert torch.equal(buf[untouched], before[i * pool.layer_num + layer][untouched])


@gpu
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_backends_are_bit_identical_on_cuda(layout):
    gen = torch.Generator().manual_seed(5)
    pool = random_cuda_pool(size=16384)
    d = device_pages(pool, 4096, 16, gen)
    hosts = {}
    for backend in HOST_BACKENDS:
        host = hosts[backend] = MHATokenToKVPoolHost(pool, 1.0, 0, 16, layout)
        host.k_buffer.view(torch.uint8).fill_(0xFF)
        host.v_buffer.view(torch.uint8).fill_(0xFF)
        h = host.alloc(4096)
        host.backup_from_device_all_layer(pool, h, d, backend)
    torch.cuda.synchronize()
    assert torch.equal(hosts["kernel"].k_buffer, hosts["direct"].k_buffer)
    assert torch.equal(hosts["kernel"].v_buffer, hosts["direct"].v_buffer)
    loaded = {}
    for backend, host in hosts.items():
        target = random_cuda_pool(size=16384, seed=9)
        host.load_to_device_per_layer(target, torch.arange(4096), d, 2, backend)
        torch.cuda.synchronize()
        loaded[backend] = [b.view(torch.uint8).cpu() for b in target.k_buffer + target.v_buffer]
    for a, b in zip(loaded["kernel"], loaded["direct"]):
        assert torch.equal(a, b)


@gpu
def test_kernel_backend_grid_is_capped(monkeypatch):
    programs = []
    real = C.launch_copy_rows

    def spy(dst, di, src, si, **kw):
        plan = C.plan_copy(di.shape[0], len(dst), dst.distinct_row_bytes, min(dst.align, src.align),
                           kw.get("one_pass", False), kw["max_programs"], C.FEW_PROGRAMS_TILE)  # fmt: skip
        programs.append(plan.programs)
        return real(dst, di, src, si, **kw)

    monkeypatch.setattr(C, "launch_copy_rows", spy)
    pool = random_cuda_pool(size=16384)
    host = MHATokenToKVPoolHost(pool, 1.0, 0, 16, "layer_first")
    h = host.alloc(8192)
    host.backup_from_device_all_layer(pool, h, torch.arange(16, 8208, device="cuda"), "kernel")
    host.load_to_device_all_layer(pool, h, torch.arange(16, 8208, device="cuda"), "kernel")  # one launch
    pool.register_layer_transfer_counter(host.layer_transfer_counter)
    host.load_to_device_all_layer(pool, h, torch.arange(16, 8208, device="cuda"), "kernel")  # one per layer
    torch.cuda.synchronize()
    assert programs == [8] * (2 + pool.layer_num)


@gpu
@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_transfers_do_not_synchronise(layout, backend):
    pool = random_cuda_pool(size=16384)
    host = MHATokenToKVPoolHost(pool, 1.0, 0, 16, layout)
    h = host.alloc(2048)
    d = torch.arange(16, 2064, device="cuda")
    host.backup_from_device_all_layer(pool, h, d, backend)  # compiles and makes the staging buffers
    host.load_to_device_all_layer(pool, h, d, backend)
    with no_sync():
        host.backup_from_device_all_layer(pool, h, d, backend)
        host.load_to_device_all_layer(pool, h, d, backend)
        host.load_to_device_per_layer(pool, h, d, 1, backend)
        host.wait_for_loads()
        host.wait_for_backups()


@gpu
@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_transfers_on_shared_host_pages_are_ordered(backend):
    """A load right after a backup of the same pages sees the backup's bytes; a backup right after
    a load from the same pages does not overwrite them before the load has read them. No sync in
    between: the streams' ordering alone must do it."""
    gen = torch.Generator().manual_seed(7)
    tokens = 32768
    a = random_cuda_pool(size=40960, layers=8, seed=1)
    b = random_cuda_pool(size=40960, layers=8, seed=2)
    host = MHATokenToKVPoolHost(a, 1.0, 0, 16, "page_first")
    h = host_pages(host, tokens, gen)
    d = device_pages(a, tokens, 16, gen)
    want_a = [rows_of(a, l, "k", d) for l in range(8)]
    want_b = [rows_of(b, l, "k", d) for l in range(8)]
    target = random_cuda_pool(size=40960, layers=8, seed=3)
    target2 = random_cuda_pool(size=40960, layers=8, seed=4)
    torch.cuda.synchronize()
    host.backup_from_device_all_layer(a, h, d, backend)  # host <- a
    host.load_to_device_all_layer(target, h, d, backend)  # target <- host: must see a's bytes
    host.backup_from_device_all_layer(b, h, d, backend)  # host <- b: only after that load read them
    host.load_to_device_all_layer(target2, h, d, backend)  # target2 <- host: b's bytes
    torch.cuda.synchronize()
    for layer in range(8):
        assert_same_bytes(rows_of(target, layer, "k", d), want_a[layer], f"first load, layer {layer}")
        assert_same_bytes(rows_of(target2, layer, "k", d), want_b[layer], f"second load, layer {layer}")


def _stand_in_attention(pool, d, out):
    """A model step reading each layer's loaded rows as attention would, through the getters."""
    for layer in range(pool.layer_num):
        k, v = pool.get_kv_buffer(layer)
        torch.index_select(k.view(torch.uint8), 0, d, out=out[0][layer])
        torch.index_select(v.view(torch.uint8), 0, d, out=out[1][layer])


@gpu
@pytest.mark.parametrize("background", [False, True], ids=["queued-by-the-call", "background"])
@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_layer_wait_reads_each_layer_after_it_lands(backend, background):
    gen = torch.Generator().manual_seed(11)
    tokens, layers = 32768, 8
    src = random_cuda_pool(size=40960, layers=layers, seed=1)
    host = MHATokenToKVPoolHost(src, 1.0, 0, 16, "layer_first")
    h = host_pages(host, tokens, gen)
    d = device_pages(src, tokens, 16, gen)
    host.backup_from_device_all_layer(src, h, d, backend)
    want = [[rows_of(src, l, w, d) for l in range(layers)] for w in "kv"]
    pool = random_cuda_pool(size=40960, layers=layers, seed=2)
    pool.register_layer_transfer_counter(host.layer_transfer_counter)
    out = [torch.empty((layers, tokens, 8, 128), dtype=torch.uint8, device="cuda") for _ in range(2)]
    torch.cuda.synchronize()
    for trial in range(3):
        for buf in pool.k_buffer + pool.v_buffer:  # stale bytes the model must never see
            buf.view(torch.uint8).fill_(trial)
        # Queued (or, in the background, being queued); the model starts right away.
        host.load_to_device_all_layer(pool, h, d, backend, background=background)
        _stand_in_attention(pool, d, out)
        torch.cuda.synchronize()
        for w in range(2):
            for layer in range(layers):
                assert_same_bytes(out[w][layer].cpu(), want[w][layer], f"trial {trial} {'kv'[w]} layer {layer}")


@gpu
@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_layer_wait_inside_a_cuda_graph(backend):
    """The getters' waits captured in a graph are external event waits: every replay waits for the
    loads enqueued before it, outside the graph."""
    gen = torch.Generator().manual_seed(12)
    tokens, layers = 16384, 8
    sources = [random_cuda_pool(size=20480, layers=layers, seed=s) for s in (1, 2)]
    host = MHATokenToKVPoolHost(sources[0], 2.0, 0, 16, "page_first")
    d = device_pages(sources[0], tokens, 16, gen)
    hs = []
    for src in sources:
        h = host_pages(host, tokens, gen)
        host.backup_from_device_all_layer(src, h, d, backend)
        hs.append(h)
    want = [[[rows_of(src, l, w, d) for l in range(layers)] for w in "kv"] for src in sources]
    pool = random_cuda_pool(size=20480, layers=layers, seed=3)
    pool.register_layer_transfer_counter(host.layer_transfer_counter)
    out = [torch.empty((layers, tokens, 8, 128), dtype=torch.uint8, device="cuda") for _ in range(2)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _stand_in_attention(pool, d, out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _stand_in_attention(pool, d, out)
    torch.cuda.synchronize()
    for trial in range(4):
        which = trial % 2
        for buf in pool.k_buffer + pool.v_buffer:
            buf.view(torch.uint8).fill_(0x40 + trial)
        host.load_to_device_all_layer(pool, hs[which], d, backend)
        graph.replay()
        torch.cuda.synchronize()
        for w in range(2):
            for layer in range(layers):
                assert_same_bytes(out[w][layer].cpu(), want[which][w][layer], f"replay {trial} {'kv'[w]} {layer}")


@gpu
def test_a_failed_background_load_still_orders_what_it_queued(monkeypatch):
    """A worker that fails part-way still records the pages its queued copies read (later backups
    into them wait) and keeps its index tensors until they ran; the layers it queued land."""
    gen = torch.Generator().manual_seed(21)
    tokens, layers = 4096, 4
    src = random_cuda_pool(size=16384, layers=layers, seed=1)
    host = MHATokenToKVPoolHost(src, 1.0, 0, 16, "layer_first")
    h = host_pages(host, tokens, gen)
    d = device_pages(src, tokens, 16, gen)
    host.backup_from_device_all_layer(src, h, d, "kernel")
    want = rows_of(src, 0, "k", d)
    pool = random_cuda_pool(size=16384, layers=layers, seed=2)
    pool.register_layer_transfer_counter(host.layer_transfer_counter)
    real, calls = C.launch_copy_rows, []

    def copy(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("copy failed")
        return real(*a, **k)

    monkeypatch.setattr(C, "launch_copy_rows", copy)  # layer 0's checked copy launches through it too
    seq = host._scheduler._seq
    host.load_to_device_all_layer(pool, h, d.clone(), "kernel", background=True)  # the clone is dropped at once
    with pytest.raises(RuntimeError, match="background load failed"):
        host.wait_for_loads()
    pages = h.numpy()[:: host.page_size] // host.page_size
    assert host._scheduler._seq == seq + 1 and (host._scheduler._page_read[pages] == host._scheduler._seq).all()
    torch.cuda.synchronize()
    assert_same_bytes(rows_of(pool, 0, "k", d), want, "layer 0, queued before the failure")
    with pytest.raises(RuntimeError, match="layer 1 was not loaded"):
        pool.get_key_buffer(1)


@gpu
@pytest.mark.parametrize(
    "backend, pin", [("kernel", True), ("direct", True), ("direct", False)], ids=["kernel", "direct", "direct-pageable"]
)
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
def test_padding_device_indices_leave_host_rows_as_they_were(layout, backend, pin):
    """Negative device indices (padding) and indices past the pool's rows are skipped: a backup
    keeps those host rows, bit for bit, though the direct backend's staging holds an earlier
    backup's rows there; a load writes nothing for them."""
    gen = torch.Generator().manual_seed(31)
    tokens = 2048
    pool = random_cuda_pool(size=16384, layers=3)
    host = MHATokenToKVPoolHost(pool, 1.0, 0, 16, layout, pin_memory=pin, staging_bytes=1 << 20)
    host.k_buffer.view(torch.uint8).copy_(torch.randint(0, 256, host.k_buffer.shape, dtype=torch.uint8, generator=gen))
    host.v_buffer.view(torch.uint8).copy_(torch.randint(0, 256, host.v_buffer.shape, dtype=torch.uint8, generator=gen))
    earlier = host_pages(host, tokens, gen)
    host.backup_from_device_all_layer(pool, earlier, device_pages(pool, tokens, 16, gen), backend)  # fills the staging
    h = host_pages(host, tokens, gen)
    d = device_pages(pool, tokens, 16, gen)
    skipped = torch.rand(tokens, generator=gen) < 0.25
    d[skipped.to("cuda")] = -1
    d[:: 97] = pool.size + pool.page_size + 5  # past the rows: skipped too (IndexError only under validate)
    skipped[:: 97] = True
    torch.cuda.synchronize()
    before = [b.view(torch.uint8).clone() for b in (host.k_buffer, host.v_buffer)]
    host.backup_from_device_all_layer(pool, h, d, backend)
    torch.cuda.synchronize()
    kept = ~skipped
    for layer in range(3):
        for which, buf, old in (("k", host.k_buffer, before[0]), ("v", host.v_buffer, before[1])):
            view = (lambda b: b[layer]) if layout == "layer_first" else (lambda b: b[:, layer])
            got, was = view(buf.view(torch.uint8))[h], view(old)[h]
            assert_same_bytes(got[skipped], was[skipped], f"skipped host rows {which}{layer}")
            assert_same_bytes(got[kept], rows_of(pool, layer, which, d.cpu()[kept].to("cuda")), f"{which}{layer}")
    target = random_cuda_pool(size=16384, layers=3, seed=4)
    untouched = [b.view(torch.uint8).cpu() for b in target.k_buffer + target.v_buffer]
    host.load_to_device_all_layer(target, h, d, backend)
    torch.cuda.synchronize()
    written = torch.zeros(target.size + target.page_size, dtype=torch.bool)
    written[d.cpu()[kept]] = True
    for i, b in enumerate(target.k_buffer + target.v_buffer):
        assert torch.equal(b.view(torch.uint8).cpu()[~written], untouched[i][~written]), f"device buffer {i}"


@gpu
@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_a_per_layer_load_reaches_its_launch_in_five_frames(monkeypatch, backend):
    """From ``load_to_device_per_layer`` to ``launch_copy_rows`` (which calls the compiled kernel),
    counting both."""
    depths = []
    real = C.launch_copy_rows

    def launch(*a, **k):  # stands for launch_copy_rows' own frame
        depths.append(frames_up_to("load_to_device_per_layer"))
        return real(*a, **k)

    pool = random_cuda_pool(size=16384)
    host = MHATokenToKVPoolHost(pool, 1.0, 0, 16, "layer_first")
    h = host.alloc(1024)
    d = torch.arange(16, 1040, device="cuda")
    host.backup_from_device_all_layer(pool, h, d, backend)
    monkeypatch.setattr(C, "launch_copy_rows", launch)
    host.load_to_device_per_layer(pool, h, d, 2, backend)
    torch.cuda.synchronize()
    assert depths and 0 not in depths and max(depths) <= 5, depths
