"""The storage tier on the CPU: the file backend against plain file I/O of the same bytes, and the
Mooncake backend against Mooncake Store's own batch put and get of the same bytes.

Pages are host-pool pages of Llama-3-8B (32 layers, 8 KV heads, head_dim 128, bf16, ``layer_first``
host layout): 8 MiB at page size 64, 512 KiB at page size 4; a batch of ``--pages`` pages (32 by
default) per call, random bytes, wall time of the whole batch, medians of ``--reps`` calls. Each
backend and its ceilings are timed in alternation, call by call, so that both meet the same load
from the rest of the machine: their ratio is what the targets judge.

* ``file``: ``HiCacheFile.batch_set_v1`` / ``batch_get_v1`` (host pages to files and back) against
  the same bytes written and read with one ``open``/``writev``/``close`` (``readv``) per page to files
  in the same directory, from and into the same host blocks (the ratio the target judges: the same
  memory on both sides, whose layout alone moves a plain read or write by 10-40%), and from and into
  one contiguous buffer per page (shown beside it). The backend calls no ``fsync``, and neither does the plain write; each
  write creates its files anew (the backend's are removed before each timed call, the plain ones
  too). The page cache is not dropped (that needs root): every read is of warm, cached files.
* ``mooncake``: ``MooncakeStore.batch_set_v1`` / ``batch_get_v1`` against the client's own
  ``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers`` of the same host blocks (what
  the backend calls, without the record header and its check) and ``batch_put_from`` /
  ``batch_get_into`` of each page as one contiguous registered buffer, through a ``mooncake_master``
  the benchmark starts on 127.0.0.1 (TCP transport) and stops by its process id. The ratio is taken
  against the faster raw form. Skipped, saying why, where Mooncake Store is not installed.
* ``checksum``: the page record's checksums (``kvpool.storage.record``: two vectorised uint64
  sums of the payload, on the checksum threads) against one thread of ``zlib.crc32`` over the same
  bytes (a CRC-32 of the payload, for scale) and a one-thread ``memcpy`` of them (the machine's memory speed).

* ``--ttft llama,qwen3.5``: time to first token of a repeated long prompt served from storage (a
  fresh engine: nothing on the device or in host memory) against recomputing it, through the model
  runners (benchmarks/storage_ttft.py says how): Llama-3-8B's shape with 4 layers and Qwen3.5-397B's
  in 4 layers on a GPU, the runners' tiny shapes on a CPU. A model whose cache refuses a storage
  tier is skipped, saying why.

Targets: the file backend's write and read >= 80% of the plain write and read of the same host blocks; Mooncake's >= 90%
of its raw batch put and get.

Usage: python benchmarks/bench_storage.py --out DIR [--quick] [--dir PATH] [--ttft llama,qwen3.5]
(on a GPU, the time to first token alone: ``--backends none --ttft llama,qwen3.5``).
``--cpu-smoke`` runs every path on a toy host pool (seconds); it checks the script, measures nothing.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import zlib

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402

from kvpool import MHATokenToKVPool  # noqa: E402
from kvpool.host import MHATokenToKVPoolHost  # noqa: E402
from kvpool.storage import HiCacheFile, HiCacheStorageConfig, page_keys  # noqa: E402
from kvpool.storage import record  # noqa: E402

LAYERS, HEADS, HEAD_DIM, DTYPE = 32, 8, 128, torch.bfloat16
PAGE_SIZES = [64, 4]
LAYOUT = "layer_first"
BACKENDS = ["file", "mooncake"]
TARGETS = {"file": 0.80, "mooncake": 0.90}


def configure_smoke() -> None:
    global LAYERS, HEADS, HEAD_DIM, PAGE_SIZES
    LAYERS, HEADS, HEAD_DIM, PAGE_SIZES = 2, 2, 16, [4]


def timed(fn, reps: int, before=None) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls after one untimed call; ``before()`` runs
    untimed ahead of every call."""
    return timed_together({"t": (fn, before)}, reps)["t"]


def timed_together(cases: dict, reps: int) -> dict:
    """Median seconds of each of ``cases`` (name -> ``(fn, before or None)``) over ``reps`` rounds
    after one untimed round; a round calls each case once, in turn, so a backend and its ceiling
    share whatever else the machine is doing at the time (their ratio is what the targets judge)."""
    times: dict = {name: [] for name in cases}
    for i in range(reps + 1):
        for name, (fn, before) in cases.items():
            if before is not None:
                before()
            t0 = time.perf_counter()
            fn()
            if i:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def gbps(nbytes: int, s: float) -> float:
    return nbytes / s / 1e9


# --- fixtures ---------------------------------------------------------------------------------------


class Pages:
    """A CPU host pool of ``2 * pages`` pages of random bytes: ``src`` pages to store, ``dst`` pages
    to read into, their keys, and each source page's bytes in the stored (flat) order."""

    def __init__(self, page_size: int, pages: int) -> None:
        self.page_size, self.pages = page_size, pages
        device = MHATokenToKVPool((pages + 1) * page_size, page_size, DTYPE, HEADS, HEAD_DIM, LAYERS, "cpu", warmup=False)
        self.host = MHATokenToKVPoolHost(device, 2.0, 0, page_size, LAYOUT, pin_memory=False)
        del device
        gen = torch.Generator().manual_seed(page_size)
        for b in (self.host.k_buffer, self.host.v_buffer):
            flat = b.view(-1).view(torch.uint8)
            flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))
        n = pages * page_size
        self.src, self.dst = self.host.alloc(n), self.host.alloc(n)
        self.keys = page_keys(list(range(n)), page_size)
        self.page_bytes = sum(self.host.page_bytes)
        self.nbytes = pages * self.page_bytes
        self.starts = self.src[::page_size].tolist()
        self.flat = [self.host.get_data_page(s).view(torch.uint8) for s in self.starts]

    def check_dst(self, what: str) -> None:
        for i, s in enumerate(self.dst[:: self.page_size].tolist()):
            if not torch.equal(self.host.get_data_page(s).view(torch.uint8), self.flat[i]):
                raise RuntimeError(f"{what}: page {i} read back differs from the page stored")

    def scramble_dst(self) -> None:
        for s in self.dst[:: self.page_size].tolist():
            self.host.set_from_flat_data_page(s, torch.zeros(self.page_bytes // 2, dtype=DTYPE))


def _mb(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


# --- the file backend -------------------------------------------------------------------------------


def plain_write(folder: str, flat: list[torch.Tensor]) -> None:
    for i, t in enumerate(flat):
        fd = os.open(os.path.join(folder, f"plain-{i}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(t.numpy()).cast("B")
            while view.nbytes:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)


def plain_read(folder: str, into: list[torch.Tensor]) -> None:
    for i, t in enumerate(into):
        fd = os.open(os.path.join(folder, f"plain-{i}"), os.O_RDONLY)
        try:
            view, got = memoryview(t.numpy()).cast("B"), 0
            while got < view.nbytes:
                n = os.readv(fd, [view[got:]])
                if n == 0:
                    raise RuntimeError(f"plain-{i} is short")
                got += n
        finally:
            os.close(fd)


def remove_plain(folder: str, n: int, prefix: str = "plain") -> None:
    for i in range(n):
        try:
            os.unlink(os.path.join(folder, f"{prefix}-{i}"))
        except FileNotFoundError:
            pass


def block_views(host, indices: torch.Tensor, pages: int) -> list[list[memoryview]]:
    """Each page's host blocks (as the host pool lists them) as writable memoryviews: the memory the
    backend reads from and writes into."""
    ptrs, sizes = host.get_page_buffer_meta(indices)
    per = len(ptrs) // pages
    return [[memoryview((ctypes.c_ubyte * n).from_address(a)).cast("B") for a, n in zip(ptrs[i * per : (i + 1) * per], sizes[i * per : (i + 1) * per])]
            for i in range(pages)]  # fmt: skip


def plain_blocks_write(folder: str, pages: list[list[memoryview]]) -> None:
    """One ``open``/``writev``/``close`` per page, straight from its host blocks."""
    for i, views in enumerate(pages):
        fd = os.open(os.path.join(folder, f"blocks-{i}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            if os.writev(fd, views) != sum(v.nbytes for v in views):
                raise RuntimeError(f"blocks-{i}: short write")
        finally:
            os.close(fd)


def plain_blocks_read(folder: str, pages: list[list[memoryview]]) -> None:
    """One ``open``/``readv``/``close`` per page, straight into its host blocks."""
    for i, views in enumerate(pages):
        fd = os.open(os.path.join(folder, f"blocks-{i}"), os.O_RDONLY)
        try:
            if os.readv(fd, views) != sum(v.nbytes for v in views):
                raise RuntimeError(f"blocks-{i} is short")
        finally:
            os.close(fd)


def bench_file(args, rep: report.Report, p: Pages) -> dict:
    root = tempfile.mkdtemp(prefix="kvpool-bench-storage-", dir=args.dir)
    try:
        store = HiCacheFile(HiCacheStorageConfig(model_name="bench"), os.path.join(root, "store"), max_bytes=4 * p.nbytes + (1 << 30))
        store.register_mem_pool_host(p.host)
        # The other way of summing a batch's pages (ahead on the checksum threads, or on the writer
        # just before each write) than this host's default, timed beside it.
        alt = HiCacheFile(HiCacheStorageConfig(model_name="bench"), os.path.join(root, "alt"), max_bytes=4 * p.nbytes + (1 << 30),
                          sum_ahead=not store.sum_ahead)  # fmt: skip
        alt.register_mem_pool_host(p.host)
        plain = os.path.join(root, "store")  # the plain files sit beside the pages, in the same directory
        into = [torch.empty_like(t) for t in p.flat]

        def store_write():
            if not all(store.batch_set_v1(p.keys, p.src)):
                raise RuntimeError("batch_set_v1 stored not every page")

        def alt_write():
            if not all(alt.batch_set_v1(p.keys, p.src)):
                raise RuntimeError("batch_set_v1 (the other way of summing) stored not every page")

        def store_read():
            if not all(store.batch_get_v1(p.keys, p.dst)):
                raise RuntimeError("batch_get_v1 missed a page")

        src, dst = block_views(p.host, p.src, p.pages), block_views(p.host, p.dst, p.pages)
        out = timed_together({"plain_write_s": (lambda: plain_write(plain, p.flat), lambda: remove_plain(plain, p.pages)),
                              "plain_blocks_write_s": (lambda: plain_blocks_write(plain, src), lambda: remove_plain(plain, p.pages, "blocks")),
                              "write_s": (store_write, store.clear),
                              "write_alt_s": (alt_write, alt.clear)}, args.reps)  # fmt: skip
        out["sum_ahead"] = store.sum_ahead
        p.scramble_dst()
        out.update(timed_together({"plain_read_s": (lambda: plain_read(plain, into), None),
                                   "plain_blocks_read_s": (lambda: plain_blocks_read(plain, dst), None),
                                   "read_s": (store_read, None)}, args.reps))  # fmt: skip
        p.check_dst("HiCacheFile.batch_get_v1")  # the last read of each round
        p.scramble_dst()
        plain_blocks_read(plain, dst)
        p.check_dst("the plain readv into the host blocks")
        for i, t in enumerate(into):
            if not torch.equal(t, p.flat[i]):
                raise RuntimeError(f"plain read of page {i} differs")
        store.clear()
        alt.clear()
        remove_plain(plain, p.pages)
        remove_plain(plain, p.pages, "blocks")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


# --- the Mooncake backend ---------------------------------------------------------------------------


def bench_mooncake(args, rep: report.Report, p: Pages) -> dict:
    from kvpool.storage.mooncake import MooncakeStore
    from kvpool.storage.mooncake_master import MooncakeMaster

    segment = 4 * p.nbytes + (64 << 20)  # the backend's pages, the raw forms' and room
    with MooncakeMaster() as master:
        store = MooncakeStore(
            HiCacheStorageConfig(model_name="bench"), master_server_address=master.master_server_address,
            metadata_server=master.metadata_server, global_segment_size=segment, local_buffer_size=64 << 20,
        )  # fmt: skip
        try:
            store.register_mem_pool_host(p.host)
            client = store.store
            ptrs, sizes = p.host.get_page_buffer_meta(p.src)
            dptrs, dsizes = p.host.get_page_buffer_meta(p.dst)
            per = len(ptrs) // p.pages
            blocks = [(ptrs[i * per : (i + 1) * per], sizes[i * per : (i + 1) * per]) for i in range(p.pages)]
            dblocks = [(dptrs[i * per : (i + 1) * per], dsizes[i * per : (i + 1) * per]) for i in range(p.pages)]
            raw_keys = [f"bench-raw-{i}" for i in range(p.pages)]
            flat_keys = [f"bench-flat-{i}" for i in range(p.pages)]
            # The contiguous form: every page's bytes one after another in one registered buffer.
            contiguous = torch.cat(p.flat)
            landing = torch.empty_like(contiguous)
            for t in (contiguous, landing):
                if client.register_buffer(t.data_ptr(), t.numel()) != 0:
                    raise RuntimeError("register_buffer failed")
            cptrs = [contiguous.data_ptr() + i * p.page_bytes for i in range(p.pages)]
            lptrs = [landing.data_ptr() + i * p.page_bytes for i in range(p.pages)]

            def check(codes, what):
                if any(c != 0 for c in codes) if what.startswith("put") else any(c < 0 for c in codes):
                    raise RuntimeError(f"{what} failed with codes {sorted(set(codes))}")

            def raw_put():
                check(client.batch_put_from_multi_buffers(raw_keys, [b[0] for b in blocks], [b[1] for b in blocks]), "put multi")

            def raw_get():
                check(client.batch_get_into_multi_buffers(raw_keys, [b[0] for b in dblocks], [b[1] for b in dblocks]), "get multi")

            def flat_put():
                check(client.batch_put_from(flat_keys, cptrs, [p.page_bytes] * p.pages), "put contiguous")

            def flat_get():
                check(client.batch_get_into(flat_keys, lptrs, [p.page_bytes] * p.pages), "get contiguous")

            def store_put():
                if not all(store.batch_set_v1(p.keys, p.src)):
                    raise RuntimeError(f"batch_set_v1 stored not every page ({store.last_error})")

            def store_get():
                if not all(store.batch_get_v1(p.keys, p.dst)):
                    raise RuntimeError(f"batch_get_v1 missed a page ({store.last_error})")

            out = timed_together({"raw_put_s": (raw_put, lambda: client.batch_remove(raw_keys, True)),
                                  "raw_flat_put_s": (flat_put, lambda: client.batch_remove(flat_keys, True)),
                                  "put_s": (store_put, store.clear)}, args.reps)  # fmt: skip
            p.scramble_dst()
            gets = {"raw_get_s": (raw_get, None), "raw_flat_get_s": (flat_get, None), "get_s": (store_get, None)}
            out.update(timed_together(gets, args.reps))
            p.check_dst("MooncakeStore.batch_get_v1")
            if not torch.equal(landing, contiguous):
                raise RuntimeError("batch_get_into read back other bytes")
            client.batch_remove(raw_keys + flat_keys, True)
            store.clear()
            for t in (contiguous, landing):
                client.unregister_buffer(t.data_ptr())
        finally:
            store.close()
    return out


# --- the checksum -----------------------------------------------------------------------------------


def bench_checksum(args, p: Pages) -> dict:
    name = b"bench-page-name"
    views = [memoryview(t.numpy()).cast("B") for t in p.flat]
    dst_np = torch.empty_like(p.flat[0]).numpy()
    return timed_together({
        "record_s": (lambda: [record.checksum(name, v) for v in views], None),
        "zlib_s": (lambda: [zlib.crc32(v) for v in views], None),
        # One thread, like the other cases (torch's copy_ of 8 MiB runs on its thread pool, which on a
        # busy machine waits for its slowest thread).
        "memcpy_s": (lambda: [np.copyto(dst_np, t.numpy()) for t in p.flat], None),
    }, args.reps)  # fmt: skip


# --- report -----------------------------------------------------------------------------------------


def rates(case: dict) -> dict:
    """GB/s of every timing in ``case`` (keys ending in ``_s``) and the ratios the targets judge."""
    n, out = case["bytes"], {}
    for k, v in case.items():
        if k.endswith("_s"):
            out[k[:-2]] = gbps(n, v)
    if "write" in out:
        # Judged against the plain I/O of the same host blocks; older reports have only the contiguous form.
        out["write_ratio"] = out["write"] / out.get("plain_blocks_write", out["plain_write"])
        out["read_ratio"] = out["read"] / out.get("plain_blocks_read", out["plain_read"])
        out["write_contiguous_ratio"] = out["write"] / out["plain_write"]
        out["read_contiguous_ratio"] = out["read"] / out["plain_read"]
    if "put" in out:
        out["put_ratio"] = out["put"] / max(out["raw_put"], out["raw_flat_put"])
        out["get_ratio"] = out["get"] / max(out["raw_get"], out["raw_flat_get"])
    return out


def verdicts(res: dict) -> list[str]:
    out = []
    for backend, (a, b) in (("file", ("write", "read")), ("mooncake", ("put", "get"))):
        cases = [c for c in res["cases"] if c["backend"] == backend]
        if not cases:
            out.append(f"{backend}: not measured in this run")
            continue
        target = TARGETS[backend]
        for what in (a, b):
            worst = min(rates(c)[f"{what}_ratio"] for c in cases)
            out.append(f"{backend} {what} >= {100 * target:.0f}% of the plain/raw {what} at every page size: "
                       f"{'met' if worst >= target else 'missed'} (worst {100 * worst:.0f}%)")  # fmt: skip
    return out


def markdown(res: dict) -> str:
    cfg = res["config"]
    lines = [
        f"Host pages ({cfg['layers']} layers, {cfg['heads']} KV heads, head_dim {cfg['head_dim']}, {cfg['dtype']}, "
        f"{cfg['layout']}), {cfg['pages']} pages per batch call, random bytes; wall time of the batch, medians of "
        f"{cfg['reps']} calls. Directory: `{cfg['dir']}` ({cfg['filesystem']}); no fsync (the backend does none); "
        "page cache warm (not dropped: that needs root). Mooncake: a master on 127.0.0.1, TCP transport, one client.",
        "",
        f"Load average (1 min) {cfg.get('load_start', float('nan')):.1f} at the start and {cfg.get('load_end', float('nan')):.1f} "
        "at the end of the run: other processes' share of the cores (above 0, the checksum threads and the I/O competed "
        "with them for the cores; the plain and raw baselines run on one thread).",
        "",
        "## Targets",
        "",
        *[f"- {v}" for v in verdicts(res)],
        "",
    ]
    files = [c for c in res["cases"] if c["backend"] == "file"]
    if files:
        lines += ["## File backend against plain file I/O of the same bytes (GB/s)", "",
                  "Plain forms: one `writev` / `readv` per page from and into the same host blocks (the ratio the target "
                  "judges), and from and into one contiguous buffer per page (its ratio in brackets).", "",
                  "| page | page bytes | plain write, blocks | plain write, contiguous | `batch_set_v1` | ratio "
                  "| plain read, blocks | plain read, contiguous | `batch_get_v1` | ratio |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        alt_notes: list = []
        for c in files:
            r = rates(c)
            if "write_alt" in r:
                alt_notes.append(f"page {c['page_size']}: {r['write_alt']:.2f} GB/s "
                                 f"({100 * r['write_alt'] / r.get('plain_blocks_write', r['plain_write']):.0f}%)")  # fmt: skip
            lines.append(f"| {c['page_size']} | {_mb(c['page_bytes'])} | {r.get('plain_blocks_write', float('nan')):.2f} | {r['plain_write']:.2f} "
                         f"| {r['write']:.2f} | {100 * r['write_ratio']:.0f}% ({100 * r['write_contiguous_ratio']:.0f}%) "
                         f"| {r.get('plain_blocks_read', float('nan')):.2f} | {r['plain_read']:.2f} | {r['read']:.2f} "
                         f"| {100 * r['read_ratio']:.0f}% ({100 * r['read_contiguous_ratio']:.0f}%) |")  # fmt: skip
        if alt_notes:
            ahead = files[0].get("sum_ahead")
            lines += ["", f"`batch_set_v1` above sums a batch's pages {'ahead, on the checksum threads' if ahead else 'on the writer, just before each write'} "
                          f"(this host's default, `sum_ahead={ahead}`); summed {'on the writer' if ahead else 'ahead'} instead, "
                          f"timed beside it: {'; '.join(alt_notes)}."]  # fmt: skip
        lines.append("")
    moon = [c for c in res["cases"] if c["backend"] == "mooncake"]
    if moon:
        lines += ["## Mooncake backend against Mooncake's own batch put and get of the same bytes (GB/s)", "",
                  "Raw forms: the host blocks themselves (`*_multi_buffers`, what the backend calls) and each page as one "
                  "contiguous buffer (`batch_put_from` / `batch_get_into`); the ratio is against the faster.", "",
                  "| page | page bytes | raw put, blocks | raw put, contiguous | `batch_set_v1` | ratio "
                  "| raw get, blocks | raw get, contiguous | `batch_get_v1` | ratio |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for c in moon:
            r = rates(c)
            lines.append(f"| {c['page_size']} | {_mb(c['page_bytes'])} | {r['raw_put']:.2f} | {r['raw_flat_put']:.2f} | {r['put']:.2f} "
                         f"| {100 * r['put_ratio']:.0f}% | {r['raw_get']:.2f} | {r['raw_flat_get']:.2f} | {r['get']:.2f} | {100 * r['get_ratio']:.0f}% |")  # fmt: skip
        lines.append("")
    sums = [c for c in res["cases"] if c["backend"] == "checksum"]
    if sums:
        lines += ["## The page checksum against one thread of zlib.crc32 and a memcpy of the same bytes (GB/s)", "",
                  f"The record's checksums: a uint64 sum and a position-weighted uint64 sum of the payload's words, "
                  f"{_mb(res['config']['chunk_bytes'])} chunks on up to {res['config']['checksum_threads']} threads, then one "
                  "CRC-32 over the header fields, the name and the two sums. zlib.crc32 of the payload is for scale.", "",
                  "| page | page bytes | record checksum | zlib.crc32, one thread | memcpy, one thread |", "|---:|---:|---:|---:|---:|"]  # fmt: skip
        for c in sums:
            r = rates(c)
            lines.append(f"| {c['page_size']} | {_mb(c['page_bytes'])} | {r['record']:.2f} | {r['zlib']:.2f} | {r['memcpy']:.2f} |")
    if res.get("ttft") or res.get("ttft_skipped"):
        import storage_ttft

        lines += ["", *storage_ttft.markdown(res.get("ttft", []), res.get("ttft_skipped", []))]
    return "\n".join(lines) + "\n"


def plot(res: dict, fig) -> None:
    """Each backend's share of the plain / raw rate, per page size and direction."""
    ax = fig.subplots()
    bars = []
    for c in res["cases"]:
        r = rates(c)
        for what in ("write", "read", "put", "get"):
            if f"{what}_ratio" in r:
                bars.append((f"{c['backend']} {what}\npage {c['page_size']}", 100 * r[f"{what}_ratio"], TARGETS[c["backend"]]))
    ax.bar(range(len(bars)), [b[1] for b in bars])
    for i, b in enumerate(bars):
        ax.plot([i - 0.4, i + 0.4], [100 * b[2]] * 2, "k--", linewidth=0.8)
    ax.set_xticks(range(len(bars)), [b[0] for b in bars], fontsize=7)
    ax.set_ylabel("% of the plain / raw rate (dashed: target)")


def filesystem(path: str) -> str:
    """The type of the filesystem ``path`` is on (from /proc/mounts), or "unknown"."""
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 2 and os.path.realpath(path).startswith(parts[1]) and len(parts[1]) > len(best):
                    best, kind = parts[1], f"{parts[2]} at {parts[1]}"
    except OSError:
        pass
    return kind


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    report.add_common_arguments(parser, "storage")
    parser.add_argument("--quick", action="store_true", help="page size 64 only, 3 repetitions")
    parser.add_argument("--reps", type=int, default=None, help="timed calls per measurement (default 5, quick 3)")
    parser.add_argument("--pages", type=int, default=None, help="pages per batch call (default 32)")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the file backend's directory is made (default: the temp dir)")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated backends to time")
    parser.add_argument("--page-sizes", default=None, help="comma-separated page sizes in tokens (default 64,4; quick 64)")
    parser.add_argument("--ttft", default="", help="comma-separated models (llama, qwen3.5) whose time to first token from storage is measured")
    parser.add_argument("--ttft-storage", choices=BACKENDS, default="file",
                        help="the storage tier of the time-to-first-token cases (mooncake: each engine lends 64 MiB, "
                             "less than the pages of a GPU run's 8192-token prompt: pass a shorter --ttft-prompt-len)")  # fmt: skip
    parser.add_argument("--ttft-prompt-len", type=int, default=None, help="prompt tokens (default 8192 on a GPU, 256 on a CPU)")
    parser.add_argument("--ttft-reps", type=int, default=None, help="timed engines of each kind (default 5, smoke 1)")
    args = parser.parse_args()
    backends = [] if args.backends == "none" else [b for b in args.backends.split(",") if b]
    if (not backends and args.backends != "none") or set(backends) - set(BACKENDS):
        parser.error(f"--backends must name some of {', '.join(BACKENDS)} (or be none), got {args.backends!r}")
    ttft = [m for m in args.ttft.split(",") if m]
    if set(ttft) - {"llama", "qwen3.5"}:
        parser.error(f"--ttft must name some of llama, qwen3.5, got {args.ttft!r}")
    if args.cpu_smoke:
        configure_smoke()
    page_sizes = PAGE_SIZES[:1] if args.quick else PAGE_SIZES
    if args.page_sizes and not args.cpu_smoke:
        page_sizes = [int(x) for x in args.page_sizes.split(",") if x]
        if not page_sizes or min(page_sizes) < 1:
            parser.error(f"--page-sizes must be positive ints, got {args.page_sizes!r}")
    args.reps = args.reps or (1 if args.cpu_smoke else 3 if args.quick else 5)
    pages = args.pages or (4 if args.cpu_smoke else 32)
    rep = report.Report(args, "bench_storage", "Storage tier on the CPU", markdown, plot)
    rep.meta["cpu"] = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    rep.result.update(
        config=dict(layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM, dtype=str(DTYPE).replace("torch.", ""), layout=LAYOUT,
                    pages=pages, reps=args.reps, dir=args.dir, filesystem=filesystem(args.dir),
                    chunk_bytes=record.CHUNK_BYTES, checksum_threads=record.checksum_threads(), load_start=os.getloadavg()[0]),
        cases=[],
    )  # fmt: skip
    for page_size in page_sizes if backends else []:
        p = Pages(page_size, pages)
        base = dict(page_size=page_size, page_bytes=p.page_bytes, pages=pages, bytes=p.nbytes)
        for backend in ["checksum", *backends]:
            if rep.over_budget(f"{backend} page {page_size}"):
                continue
            try:
                if backend == "mooncake":
                    from kvpool.storage.mooncake_config import import_store_class

                    try:
                        import_store_class()
                    except ImportError as exc:
                        rep.result["skipped"].append(f"mooncake: {exc}")
                        continue
                run = {"checksum": lambda: bench_checksum(args, p), "file": lambda: bench_file(args, rep, p),
                       "mooncake": lambda: bench_mooncake(args, rep, p)}[backend]  # fmt: skip
                case = dict(backend=backend, **base, **run())
            except Exception as exc:  # keep the other cases' results; report the failure
                rep.error(f"{backend} page {page_size}", exc)
                continue
            rep.result["cases"].append(case)
            r = rates(case)
            rep.log(f"{backend} page {page_size} ({_mb(p.page_bytes)} x {pages}): "
                    + ", ".join(f"{k} {100 * v:.0f}%" if k.endswith("ratio") else f"{k} {v:.2f} GB/s" for k, v in r.items()))  # fmt: skip
            rep.save()
        del p
    if ttft:
        import storage_ttft

        storage_ttft.run_cases(args, rep, ttft)
    rep.result["config"]["load_end"] = os.getloadavg()[0]
    rep.save(final=True)
    return 1 if rep.result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
