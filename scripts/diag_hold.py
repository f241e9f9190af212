"""Diagnostic: can a process of the GPU transfer test hold its compute stream with a sleep kernel?"""
import json, os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist, torch.multiprocessing as mp

def check(tag, out):
    torch.cuda.synchronize()
    ev = torch.cuda.Event()
    torch.cuda._sleep(400_000_000)  # ~0.2 s
    ev.record()
    out[tag] = {"busy_right_after": not ev.query(), "stream": str(torch.cuda.current_stream()), "device": torch.cuda.current_device()}
    t = time.perf_counter(); ev.synchronize(); out[tag]["held_s"] = round(time.perf_counter() - t, 4)

def run(rank, port, device_id):
    out = {}
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    check("before_init", out)
    kw = {"device_id": dev} if device_id else {}
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=60), **kw)
    check("after_init", out)
    from kvpool import KVReceiver, KVSender, MHATokenToKVPool
    pool = MHATokenToKVPool(4096, 1, torch.float8_e4m3fn, 8, 128, 4, dev, warmup=False)
    loc = torch.randperm(4097, generator=torch.Generator().manual_seed(7 + rank))[:1000]
    ep = KVSender(pool, chunk_bytes=1 << 20) if rank == 0 else KVReceiver(pool, chunk_bytes=1 << 20)
    move = ep.send if rank == 0 else ep.recv
    for _ in range(2):
        move(loc, 1 - rank).wait()
    check("after_transfers", out)
    dist.barrier(); torch.cuda.synchronize()
    check("after_barrier", out)
    loc_dev = loc.to(dev); torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)
    t = time.perf_counter()
    for b in pool.k_buffer + pool.v_buffer:
        b.index_fill_(0, loc_dev, 17)
    out["fill"] = {"host_s": round(time.perf_counter() - t, 4), "dtype": str(pool.k_buffer[0].dtype)}
    ev = torch.cuda.Event(); ev.record()
    out["fill"]["busy_after_fill"] = not ev.query()
    h = move(loc, 1 - rank)
    out["transfer_during_sleep"] = {"busy": not ev.query(), "done": h.is_completed()}
    h.wait(); torch.cuda.synchronize()
    print(f"rank {rank} device_id={device_id}: {json.dumps(out)}", flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    import socket
    for device_id in (True,):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
        mp.spawn(run, args=(port, device_id), nprocs=2, join=True)
