"""Serve a stream of requests through kvpool: a scheduler and a model runner, simulated.

The scheduler admits requests as they arrive (seeded prompt and output lengths), reserves their
KV-cache slots with a ``PagedTokenToKVPoolAllocator`` (``--page-size 1``: ``TokenToKVPoolAllocator``),
records them in a ``ReqToTokenPool``, prefills long prompts in chunks, decodes one token per request
per step, retracts requests when decode runs out of pages, and frees requests when they finish. The
model runner writes each step's K/V for every layer with ``pool.set_kv_buffer`` into an FP8 pool
with per-layer, per-tensor float32 scales, as an attention layer would. K/V values are a deterministic
function of (request, position, layer), their range differing from layer to layer and between K and
V, so before a request's slots are freed its K/V is regenerated, quantized with ``kvpool.quantize``
and compared byte for byte with the pool. With ``--model deepseek-v3`` the pool is an
``MLATokenToKVPool`` with DeepSeek-V3's latent rows (512 latent + 64 rotary values per token and
layer), written through both of its entry points, and the check covers the whole latent row. With
``--model qwen3.5`` the model is hybrid, as Qwen3.5: every 4th layer is full attention (its K/V in a
``HybridLinearKVPool``) and the others are Gated DeltaNet layers whose per-request state lives in a
``MambaPool`` slot beside the request's row of a ``HybridReqToTokenPool``; the states are checked
byte for byte too (support/sim/hybrid.py). With ``--model gemma3`` (five sliding-window layers to one
global) or ``--model gpt-oss`` (sliding and full layers alternating) the pool is an ``SWAKVPool``
whose parts ``plan_swa_pools`` sizes from the budget at ``--swa-full-tokens-ratio``, the allocator a
``SWATokenToKVPoolAllocator``, and after every step each running request gives back with
``free_swa`` the SWA slots of its whole pages that left the ``--sliding-window``; the check reads a
sliding layer's rows at the translated SWA slots of the tokens it holds (a token inside the window
without one fails it), and the summary compares a request's KV bytes at ``--long-context`` tokens
with a pool that keeps every layer's (support/sim/sliding.py).

With ``--dtype fp4_e2m1`` the pool is SGLang's FP4 pool (``MHATokenToKVPoolFP4``; with ``--model
deepseek-v3`` ``MLATokenToKVPoolFP4``), with ``--dtype nvfp4`` its two-level NVFP4 format (the
checkpoint's per-layer scales as global scales), and with ``--kv-scales per-token-head`` FP8 with a
scale per token and head computed at write time (``MHATokenToKVPoolFP8PerTokenHead``); the check then
compares codes and scales byte for byte with kvpool's reference quantizers (support/sim/formats.py).
The summary gives every run's bytes and tokens per GiB.

With ``--calibrate`` a calibration pass comes first, on the same pool: the request stream of ``--seed
+ 1`` for ``--calibrate-steps`` steps, written with ``pool.observe_amax(True)``; the run then writes
and checks with ``pool.calibrated_scales()`` instead of the checkpoint's scales, and the summary
compares the quantisation error (relative RMS of the dequantised values against the bf16 input, per
layer, on the run's first requests) with scale 1.0, the checkpoint's scales and the calibrated ones
(support/sim/calibration.py).

With ``--prefix-cache`` the requests are turns of multi-turn chats after a common few-shot prompt,
served on a prefix cache (``RadixCache``; with ``--host-tier`` a ``HiRadixCache``, with ``--model
qwen3.5`` a ``MambaRadixCache``, and with both a ``HiMambaRadixCache``, whose nodes park their KV
pages and state snapshots on the host together and load them back together, the loaded state forked
into the request's slot and checked; with ``--model gemma3`` or ``gpt-oss`` an ``SWARadixCache``,
whose SWA eviction makes tombstones and whose requests keep the SWA KV of the last window of their
whole pages): each request prefills only what the tree does not hold, and a
token's K/V derive from the token and its prefix rather than the request, so the rows the tree hands
out are checked byte for byte like any others (support/sim/prefix.py). With ``--storage file`` or
``--storage mooncake`` as well, host copies are written through to a storage tier (a page directory,
or a Mooncake Store whose master the run starts on 127.0.0.1 unless ``--mooncake-master`` names one;
support/storage.py) and each admission first fetches from it what follows its match's host part: the
summary gives the hit rate of each tier (device, host, storage) and the prefill saved, and the rows
fetched from storage are byte-checked like every reloaded row. With ``--model qwen3.5`` the state
snapshots are stored beside their KV pages and fetched with them (a prefix comes from storage only
as far as a state stored with it), and a state loaded from storage is checked like any forked one. ``--host-ratio`` below 1 makes the host
tier drop pages that storage then serves back; ``--storage-faults P`` injects storage failures and
delays, which must cost hits only.

    python examples/serve_sim.py                    # GPU (fused kernel) if there is one, else CPU
    python examples/serve_sim.py --model deepseek-v3   # MLA pool, 4 layers of DeepSeek-V3's geometry
    python examples/serve_sim.py --page-size 1      # token allocator
    python examples/serve_sim.py --dtype fp4_e2m1   # SGLang's FP4 pool (--dtype nvfp4: two-level NVFP4)
    python examples/serve_sim.py --kv-scales per-token-head   # FP8 with a scale per token and head
    python examples/serve_sim.py --corrupt          # flip one stored byte: the check must fail
    python examples/serve_sim.py --host-tier        # park retracted requests' KV in host memory
    python examples/serve_sim.py --cpu-park         # ... with pool.get_cpu_copy / load_cpu_copy
    python examples/serve_sim.py --spec-decode 4    # speculative decoding: verify writes + moves
    python examples/serve_sim.py --calibrate        # calibrated per-layer scales, and their error
    python examples/serve_sim.py --model qwen3.5    # hybrid: KV of every 4th layer, state of the others
    python examples/serve_sim.py --model gpt-oss --spec-decode 4   # sliding-window pools, verify writes in both parts
    python examples/serve_sim.py --model gemma3 --sliding-window 64 --page-size 64
    python examples/serve_sim.py --prefix-cache     # multi-turn chats on a prefix cache (RadixCache)
    python examples/serve_sim.py --prefix-cache --host-tier   # ... whose evicted nodes live on in host memory
    python examples/serve_sim.py --prefix-cache --host-tier --host-ratio 0.5 --storage file   # ... and in storage
    python examples/serve_sim.py --prefix-cache --host-tier --host-ratio 0.5 --storage file --model qwen3.5   # KV and states

Exit status: 0 when every request's K/V verified and the allocators are consistent, 1 otherwise.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from typing import Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # examples/: its shared code, support/
from kvpool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402, F401  (the tests patch their methods here)
from kvpool.host import IO_BACKENDS, LAYOUTS  # noqa: E402
from support.sim.config import (  # noqa: E402, F401  (serve_sim's API, as disagg_sim.py and the tests use it)
    DTYPES,
    FORMAT_REFUSES,
    FP4_DTYPES,
    HYBRID_MODEL,
    KV_SCALES,
    MLA_MODELS,
    MODELS,
    PREFIX_CACHE_REFUSES,
    SWA_MODELS,
    SWA_REFUSES,
    WRITE_POLICIES,
    SimConfig,
    flag,
)
from support.sim.loop import Arrivals, Parts, budget_for, make_pool, make_requests, make_runner, simulate  # noqa: E402, F401
from support.sim.parking import CpuParking, HostParking, SpecDecode  # noqa: E402, F401
from support.sim.result import Mismatch, SimResult  # noqa: E402, F401
from support.sim.run import run  # noqa: E402, F401
from support.sim.runner import Checker, MLAModelRunner, ModelRunner  # noqa: E402, F401
from support.sim.scheduler import Batch, Request, Scheduler  # noqa: E402, F401
from support.sim.summary import format_summary  # noqa: E402
from support.sim.values import checkpoint_scales, kv_values  # noqa: E402, F401
from support.storage import add_storage_arguments, storage_options  # noqa: E402

#: What --help says about the option combinations a run refuses, and why.
REFUSED = (
    "options a run refuses (exit status 2, the reason on stderr): "
    "--host-tier with --cpu-park (two ways to park a retracted request: choose one); "
    "--spec-decode with --model deepseek-v3 (the MLA pool has no verify write); "
    "--calibrate with --model qwen3.5 (calibration runs on the MHA and MLA pools); "
    "--calibrate with a --dtype other than fp8_e4m3 or fp8_e5m2; "
    "--kv-scales per-token-head with a --dtype other than fp8_e4m3 or fp8_e5m2; "
    "--dtype fp4_e2m1 with a --model other than mha or deepseek-v3, --dtype nvfp4 or --kv-scales per-token-head "
    "with a --model other than mha, and any of them with "
    + ", ".join(f"{flag(name)} ({why})" for name, why in FORMAT_REFUSES.items()) + "; "
    + "; ".join(f"--prefix-cache with {flag} ({why})" for flag, why in (
        ("--cpu-park", PREFIX_CACHE_REFUSES["cpu_park"]),
        ("--spec-decode", PREFIX_CACHE_REFUSES["spec_k"]),
        ("--calibrate", PREFIX_CACHE_REFUSES["calibrate"]),
    ))
    + "; --storage without --prefix-cache --host-tier (the storage tier sits below the prefix cache's host tier); "
    + "; ".join(f"--model gemma3 or gpt-oss with {flag(name)} ({why})" for name, why in SWA_REFUSES.items())
    + "; --model gemma3 with fewer than 6 --layers (every 6th is global). "
    "--kv-budget-mib must hold the longest request plus a page (with --prefix-cache a conversation's last turn); "
    "with --prefix-cache and no --kv-budget-mib the budget grows to hold two of them."
)  # fmt: skip


def parse_args(argv: Optional[Sequence[str]] = None) -> SimConfig:
    d = SimConfig()
    p = argparse.ArgumentParser(
        prog="serve_sim", description=__doc__.split("\n\n")[0], epilog=REFUSED,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )  # fmt: skip
    p.add_argument("--requests", type=int, default=d.requests, help="requests in the stream")
    p.add_argument("--layers", type=int, default=None,
                   help=f"attention layers (default {d.layers}; gemma3: {SWA_MODELS['gemma3']}, five local and one global)")
    p.add_argument("--heads", type=int, default=d.heads, help="KV heads")
    p.add_argument("--head-dim", type=int, default=d.head_dim, help="K and V head dim")
    p.add_argument("--page-size", type=int, default=d.page_size, help="1 selects the token allocator")
    p.add_argument("--kv-budget-mib", type=float, default=None,
                   help=f"KV-cache memory; sizes the pool (default {d.kv_budget_mib:g}, or with --prefix-cache what holds two "
                        "of the longest conversations' last turns where that is more)")
    p.add_argument("--max-running", type=int, default=d.max_running, help="request table rows")
    p.add_argument("--chunk-size", type=int, default=d.chunk_size, help="prefill tokens per step")
    p.add_argument("--prompt-len", type=int, nargs=2, default=d.prompt_len, metavar=("MIN", "MAX"), help="uniform")
    p.add_argument("--output-len", type=int, nargs=2, default=d.output_len, metavar=("MIN", "MAX"), help="uniform")
    p.add_argument("--arrival-every", type=float, default=d.arrival_every, help="mean steps between arrivals")
    p.add_argument("--dtype", choices=[*sorted(DTYPES), *FP4_DTYPES], default=d.dtype,
                   help="pool element type (fp4_e2m1: SGLang's FP4 pool, exponent scales per 16 elements; nvfp4: "
                        "two-level NVFP4, the checkpoint's per-layer scales as global scales; fp8_*fnuz: MI300's FP8)")
    p.add_argument("--kv-scales", choices=KV_SCALES, default=d.kv_scales,
                   help="FP8 scales: the checkpoint's per tensor (static), or one per token and head computed when "
                        "each row is written (per-token-head: MHATokenToKVPoolFP8PerTokenHead)")
    p.add_argument("--model", choices=MODELS, default=d.model,
                   help="mha: --heads x --head-dim K and V; deepseek-v3: MLA pool of latent rows (512 + 64); "
                        "qwen3.5: hybrid, every 4th layer full attention, the others with a state per request; "
                        "gemma3: every 6th layer full attention, the others a sliding window (SWAKVPool); "
                        "gpt-oss: sliding-window and full-attention layers alternating (SWAKVPool)")
    p.add_argument("--sliding-window", type=int, default=d.sliding_window,
                   help="gemma3, gpt-oss: the sliding layers' window in tokens (gpt-oss's own is 128, Gemma 3's 1024)")
    p.add_argument("--swa-full-tokens-ratio", type=float, default=d.swa_full_tokens_ratio,
                   help="gemma3, gpt-oss: SWA-part slots per full-part slot, as SGLang's option")
    p.add_argument("--long-context", type=int, default=d.long_context,
                   help="gemma3, gpt-oss: the request length at which the summary compares KV bytes per request "
                        "with a pool that keeps every layer's")
    p.add_argument("--device", default=d.device, help="cuda when available, else cpu")
    p.add_argument("--seed", type=int, default=d.seed, help="seeds lengths and arrivals")
    p.add_argument("--cpu-threads", type=int, default=d.cpu_threads, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--max-steps", type=int, default=None, help="stop early (live requests are checked)")
    p.add_argument("--validate", action="store_true", help="allocators raise on bad frees and bad last_loc")
    p.add_argument("--corrupt", action="store_true", help="flip one stored byte: the run then reports FAIL and exits 1, which is the expected outcome")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress on stderr (a bar on a terminal, else a line every few seconds)")
    p.add_argument("--host-tier", action="store_true", help="park retracted requests' KV in host memory")
    p.add_argument("--host-ratio", type=float, default=d.host_ratio, help="host slots per device slot")
    p.add_argument("--host-layout", choices=LAYOUTS, default=d.host_layout, help="host memory layout")
    p.add_argument("--host-io-backend", choices=IO_BACKENDS, default=d.host_io_backend, help="host transfer backend")
    p.add_argument("--cpu-park", action="store_true", help="park retracted requests with get_cpu_copy/load_cpu_copy")
    p.add_argument("--spec-decode", type=int, default=d.spec_k, metavar="K",
                   help="speculative decoding: K drafts per request and step (0: off)")
    p.add_argument("--calibrate", action="store_true",
                   help="calibration pass with observe_amax first, then the run with the calibrated scales; "
                        "prints the quantisation error with scale 1.0, the checkpoint's and the calibrated scales")
    p.add_argument("--calibrate-steps", type=int, default=d.calibrate_steps, metavar="N",
                   help="steps of the calibration pass (the request stream of --seed + 1)")
    p.add_argument("--calibrate-per-head", action="store_true", help="calibrated scales per KV head, not per tensor")
    p.add_argument("--prefix-cache", action="store_true",
                   help="a chat workload (multi-turn conversations after a common few-shot prompt) on a prefix cache; "
                        "with --host-tier the cache's host tier, with --model qwen3.5 the hybrid cache")
    p.add_argument("--few-shot-len", type=int, default=d.few_shot_len, help="--prefix-cache: the common prompt's tokens")
    p.add_argument("--turns", type=int, nargs=2, default=d.turns, metavar=("MIN", "MAX"),
                   help="--prefix-cache: turns per conversation (each turn's user message: --prompt-len)")
    p.add_argument("--host-write-policy", choices=("write_through", "write_through_selective", "write_back"),
                   default=d.host_write_policy, help="--prefix-cache --host-tier: when tree nodes are backed up")
    add_storage_arguments(p)
    a = p.parse_args(argv)
    layers = a.layers if a.layers is not None else max(d.layers, SWA_MODELS.get(a.model, 0))  # gemma3: one global
    cfg = SimConfig(
        requests=a.requests, layers=layers, heads=a.heads, head_dim=a.head_dim, page_size=a.page_size,
        kv_budget_mib=d.kv_budget_mib if a.kv_budget_mib is None else a.kv_budget_mib, max_running=a.max_running, chunk_size=a.chunk_size,
        prompt_len=tuple(a.prompt_len), output_len=tuple(a.output_len), arrival_every=a.arrival_every,
        dtype=a.dtype, model=a.model, device=a.device, seed=a.seed, max_steps=a.max_steps, validate=a.validate,
        cpu_threads=a.cpu_threads or None,
        corrupt=a.corrupt, progress=not a.no_progress,
        host_tier=a.host_tier, host_ratio=a.host_ratio, host_layout=a.host_layout, host_io_backend=a.host_io_backend,
        cpu_park=a.cpu_park, spec_k=a.spec_decode,
        calibrate=a.calibrate, calibrate_steps=a.calibrate_steps, calibrate_per_head=a.calibrate_per_head,
        prefix_cache=a.prefix_cache, few_shot_len=a.few_shot_len, turns=tuple(a.turns),
        host_write_policy=a.host_write_policy, sliding_window=a.sliding_window,
        swa_full_tokens_ratio=a.swa_full_tokens_ratio, long_context=a.long_context,
        storage=storage_options(a, a.seed), kv_scales=a.kv_scales,
    )  # fmt: skip
    if a.kv_budget_mib is None and cfg.prefix_cache and cfg.model != HYBRID_MODEL:
        cfg = replace(cfg, kv_budget_mib=budget_for(cfg))
    return cfg


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        cfg = parse_args(argv)
        result = run(cfg)
    except ValueError as e:
        print(f"serve_sim: {e}", file=sys.stderr)
        return 2
    print(format_summary(result))
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
